"""Distributed training with tfclip optimizers, in a fresh process (strategies configure devices
at start-up, so the tests and the demo run this as a subprocess).

    python -m tfclip.distributed_check mirrored OUT.npz        # 2 logical CPUs, fit + custom loop
    python -m tfclip.distributed_check single OUT.npz          # the same training on one device
    TF_CONFIG=... python -m tfclip.distributed_check worker OUT.npz   # one MultiWorkerMirrored worker
                                                                      # (custom loop)

Each mode trains the same small model on the same global batches with `tfclip.keras.Adam(...,
global_clipnorm=...)` and saves the weights, so the caller can compare them with `single`.
`mirrored` also runs the two-replica clip example: each replica's gradient is 3,
`global_clipnorm=1`, SGD with lr 1: tfclip moves the variable by -1 (clip of the summed 6, the
norm its `tensor_norms` reports), stock Keras by -2 (each replica clipped to 1 before the sum).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 32
STEPS = 6


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) * 5 + rng.normal(size=(GLOBAL_BATCH * STEPS, 1))).astype("float32")
    return x, y


def _model():
    import keras

    keras.utils.set_random_seed(3)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(1)(h))


def _optimizer():
    import tfclip

    return tfclip.keras.Adam(0.05, global_clipnorm=0.5)


def _fit(strategy):
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _model()
        model.compile(optimizer=_optimizer(), loss="mse", jit_compile=False)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    model.fit(ds.with_options(opts), epochs=1, verbose=0, shuffle=False)
    return ([w for w in model.get_weights()], float(model.optimizer.global_norm.numpy()),
            model.optimizer.tensor_norms.numpy())


def _custom_loop(strategy):
    """A hand-written loop: per-replica loss scaled by the global batch, strategy.run."""
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _model()
        opt = _optimizer()
        opt.build(model.trainable_variables)  # variables are created outside the replica function
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(xb, training=True) - yb) ** 2, axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=batch)

    for batch in ds:
        step(batch)
    return model.get_weights()


def _two_replica_clip(strategy):
    """Both replicas hold gradient 3; global_clipnorm=1; SGD lr 1. Returns (tfclip, stock) deltas."""
    import keras
    import tensorflow as tf

    import tfclip

    out = []
    for make in (lambda: tfclip.keras.SGD(1.0, global_clipnorm=1.0),
                 lambda: keras.optimizers.SGD(1.0, global_clipnorm=1.0)):
        with strategy.scope():
            v = keras.Variable(0.0)
            opt = make()
            opt.build([v])

        @tf.function
        def step():
            def replica_step():
                opt.apply_gradients([(tf.constant(3.0), v)])

            strategy.run(replica_step)

        step()
        out.append(float(v.numpy()))
        if isinstance(opt, tfclip.keras.SGD):  # the norm of the all-reduced gradient: 3 + 3
            out.append(float(opt.tensor_norms.numpy()[0]))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mode, out = argv[0], argv[1]
    import tensorflow as tf

    result = {}
    if mode == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        result["fit"], result["fit_norm"], result["tnorms_fit"] = _fit(strategy)
        result["custom"] = _custom_loop(strategy)
        result["two_replica_clip"] = _two_replica_clip(strategy)
        result["replicas"] = strategy.num_replicas_in_sync
    elif mode == "single":
        strategy = tf.distribute.get_strategy()
        result["fit"], result["fit_norm"], result["tnorms_fit"] = _fit(strategy)
        result["custom"] = _custom_loop(strategy)
    elif mode == "worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        # A custom loop: Keras 3.15's model.fit fails under MultiWorkerMirroredStrategy on CPU
        # workers with the stock optimizers too (it converts a PerReplica batch to a tensor).
        result["custom"] = _custom_loop(strategy)
        result["replicas"] = strategy.num_replicas_in_sync
        result["task"] = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        sys.exit(f"unknown mode {mode!r}")
    import numpy as np

    flat = {}
    for k, v in result.items():
        if isinstance(v, list) and v and hasattr(v[0], "shape"):
            for i, a in enumerate(v):
                flat[f"{k}_{i}"] = a
        else:
            flat[k] = np.asarray(v)
    np.savez(out, **flat)


if __name__ == "__main__":
    main()
