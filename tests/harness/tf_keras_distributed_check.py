"""tf_keras (Keras 2) training with tfclip.tf_keras optimizers under tf.distribute, in a fresh
process (strategies configure devices at start-up, so tests/test_dropin_tf_keras.py runs this as a
subprocess; a test harness, not part of the installed package).

    python tests/harness/tf_keras_distributed_check.py mirrored OUT.npz   # 2 logical CPUs
    python tests/harness/tf_keras_distributed_check.py single OUT.npz     # one device
    TF_CONFIG=... python tests/harness/tf_keras_distributed_check.py worker OUT.npz  # a MultiWorkerMirrored
                                                                                   # worker

Each mode trains the same small tf_keras model on the same global batches with
`tfclip.tf_keras.Adam(..., global_clipnorm=...)` and with the stock `tf_keras.optimizers.Adam`,
(and with `tfclip.tf_keras.legacy.Adam` / `tf_keras.optimizers.legacy.Adam`, legacy RMSprop
with momentum, and legacy Nadam: its momentum_cache product too), by `model.fit` and by a custom loop (`strategy.run` + `apply_gradients`), and saves
the weights. Every replica's copies (of the weights and of the optimizer's variables) must be
identical after training; `worker` (MultiWorkerMirroredStrategy, one CPU per worker, each worker a
process given its TF_CONFIG) saves its own copies, which the test compares across workers.
`mirrored` also runs the two-replica clip example: each replica's gradient is 3,
`global_clipnorm=1`, SGD with lr 1: tf_keras sums across replicas before it clips (unlike
Keras 3), so stock and tfclip both move the variable by -1 (the clip of the summed 6).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The same global batches as the Keras 3 run (distributed_check.py beside this file, which a
# script's directory on sys.path finds).
from distributed_check import GLOBAL_BATCH, STEPS, _data  # noqa: E402,F401


def _model():
    import tf_keras

    tf_keras.utils.set_random_seed(3)
    inp = tf_keras.Input((8,))
    h = tf_keras.layers.Dense(16, activation="tanh")(inp)
    return tf_keras.Model(inp, tf_keras.layers.Dense(1)(h))


def _optimizer(kind):
    import tf_keras

    import tfclip.tf_keras

    cls, kw = {"tfclip": (tfclip.tf_keras.Adam, {}), "stock": (tf_keras.optimizers.Adam, {}),
               "legacy_tfclip": (tfclip.tf_keras.legacy.Adam, {}),
               "legacy_stock": (tf_keras.optimizers.legacy.Adam, {}),
               "legacyrms_tfclip": (tfclip.tf_keras.legacy.RMSprop, {"momentum": 0.9}),
               "legacyrms_stock": (tf_keras.optimizers.legacy.RMSprop, {"momentum": 0.9}),
               "legacynadam_tfclip": (tfclip.tf_keras.legacy.Nadam, {}),
               "legacynadam_stock": (tf_keras.optimizers.legacy.Nadam, {})}[kind]
    return cls(0.05, global_clipnorm=0.5, **kw)


KINDS = ("tfclip", "stock", "legacy_tfclip", "legacy_stock", "legacyrms_tfclip", "legacyrms_stock",
         "legacynadam_tfclip", "legacynadam_stock")


def _check_replicas_identical(strategy, variables):
    import numpy as np

    for v in variables:
        values = [t.numpy() for t in strategy.experimental_local_results(v)]
        for other in values[1:]:
            np.testing.assert_array_equal(values[0], other, err_msg=v.name)


def _snapshot(strategy, model, opt):
    """This process's copy of every weight and optimizer variable, flat (float64), after checking
    that this process's replicas hold the same copies."""
    import numpy as np

    variables = model.trainable_variables + list(opt.variables())
    _check_replicas_identical(strategy, variables)
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])


def _fit(strategy, kind, history):
    import tensorflow as tf
    import tf_keras

    x, y = _data()
    with strategy.scope():
        model = _model()
        model.compile(optimizer=_optimizer(kind), loss="mse")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    record = tf_keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: history.append(_snapshot(strategy, model, model.optimizer)))
    model.fit(ds.with_options(opts), epochs=1, verbose=0, shuffle=False, callbacks=[record])
    _check_replicas_identical(strategy, model.trainable_variables + list(model.optimizer.variables()))
    return model.get_weights()


def _custom_loop(strategy, kind, history):
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _model()
        opt = _optimizer(kind)
        if kind.startswith("legacy"):
            opt._create_all_weights(model.trainable_variables)
        else:
            opt.build(model.trainable_variables)
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(xb) - yb)) / GLOBAL_BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=batch)

    for batch in ds:
        step(batch)
        history.append(_snapshot(strategy, model, opt))
    _check_replicas_identical(strategy, model.trainable_variables + list(opt.variables()))
    return model.get_weights()


def _two_replica_clip(strategy, kind):
    """Each replica's gradient 3, global_clipnorm 1, SGD lr 1: the variable's move."""
    import tensorflow as tf
    import tf_keras

    import tfclip.tf_keras

    with strategy.scope():
        v = tf.Variable(0.0)
        cls = tfclip.tf_keras.SGD if kind == "tfclip" else tf_keras.optimizers.SGD
        opt = cls(1.0, global_clipnorm=1.0)
        opt.build([v])

    @tf.function
    def step():
        strategy.run(lambda: opt.apply_gradients([(tf.constant(3.0), v)]))

    step()
    _check_replicas_identical(strategy, [v])
    return float(v.numpy())


def main(mode, out):
    import numpy as np
    import tensorflow as tf

    if mode == "mirrored":
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    elif mode == "single":
        strategy = tf.distribute.get_strategy()
    elif mode == "worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    result = {"replicas": np.array(strategy.num_replicas_in_sync)}
    if mode == "worker":
        result["task"] = np.array(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    for kind in KINDS:
        for how, run in (("fit", _fit), ("custom", _custom_loop)):
            history = []  # after every step
            for i, w in enumerate(run(strategy, kind, history)):
                result[f"{how}_{kind}_{i}"] = w
            result[f"hist_{how}_{kind}"] = np.stack(history)
    if mode == "mirrored":
        result["two_replica_clip"] = np.array([_two_replica_clip(strategy, "tfclip"),
                                               _two_replica_clip(strategy, "stock")])
    np.savez(out, **result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
