"""Distributed training with tfclip optimizers, in a fresh process (strategies configure devices
at start-up, so tests/test_distribute.py runs this as a subprocess; a test harness, not part of
the installed package).

    python tests/harness/distributed_check.py mirrored OUT.npz       # 2 logical CPUs, fit + custom loop
    python tests/harness/distributed_check.py single OUT.npz         # the same training on one device
    python tests/harness/distributed_check.py replica_apply OUT.npz  # fused_clip_apply and compat.v1
                                                                     # inside strategy.run, 2 logical CPUs
    TF_CONFIG=... python tests/harness/distributed_check.py worker OUT.npz  # one MultiWorkerMirrored
                                                                            # worker (custom loop)

Each mode trains the same small model on the same global batches with `tfclip.keras.Adam(...,
global_clipnorm=...)` (and with `tfclip.keras.Muon`, in `mirrored` and `single`) and saves the weights, so the caller can compare them with `single`.
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


def _optimizer(muon=False):
    import tfclip

    if muon:  # (its matrices' step is TF ops beside the fused op: tfclip/keras/_muon.py)
        return tfclip.keras.Muon(0.05, global_clipnorm=0.5)
    return tfclip.keras.Adam(0.05, global_clipnorm=0.5)


def _fit(strategy, muon=False):
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _model()
        model.compile(optimizer=_optimizer(muon), loss="mse", jit_compile=False)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    model.fit(ds.with_options(opts), epochs=1, verbose=0, shuffle=False)
    _check_replicas_identical(strategy, model.trainable_variables + list(model.optimizer.variables))
    return ([w for w in model.get_weights()], float(model.optimizer.global_norm.numpy()),
            model.optimizer.tensor_norms.numpy())


def _custom_loop(strategy, muon=False):
    """A hand-written loop: per-replica loss scaled by the global batch, strategy.run."""
    import tensorflow as tf

    x, y = _data()
    with strategy.scope():
        model = _model()
        opt = _optimizer(muon)
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
        _check_replicas_identical(strategy, model.trainable_variables + list(opt.variables))
    return model.get_weights()


def _check_replicas_identical(strategy, variables):
    """Every local copy of every variable holds the same bits (after a step)."""
    import numpy as np

    for v in variables:
        copies = [np.asarray(c) for c in strategy.experimental_local_results(getattr(v, "value", v))]
        for c in copies[1:]:
            if not np.array_equal(c, copies[0], equal_nan=True):
                raise AssertionError(f"the replicas of {v.name} differ: {copies}")


def _replica_gradient(base):
    """base * (replica id + 1): a different gradient on each replica (global id, so workers differ)."""
    import tensorflow as tf

    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.cast(r + 1, base.dtype) * base


def _replica_apply(strategy):
    """tfclip.fused_clip_apply called inside strategy.run with a different gradient per replica.

    Returns a dict of results for the test: per aggregation, tfclip's copies and stock
    assign_sub's; Adam + global clip on Keras weights against one device on the summed
    gradient; the cross-replica call; the errors for unmirrored and SyncOnRead variables; and
    tfclip.compat.v1 against stock tf.compat.v1 Adam."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfclip

    n = strategy.num_replicas_in_sync
    out = {}
    agg = tf.VariableAggregation
    base = tf.constant([1.0, 2.0])
    for name in ("MEAN", "SUM", "ONLY_FIRST_REPLICA", "NONE"):
        for eager in (False, True):
            with strategy.scope():
                v = tf.Variable([1.0, 1.0], aggregation=getattr(agg, name))
                ref = tf.Variable([1.0, 1.0], aggregation=getattr(agg, name))
                rule = tfclip.rules.SGD(0.1)

            def replica_step():
                g = _replica_gradient(base)
                result = tfclip.fused_clip_apply([(g, v)], rule)
                ref.assign_sub(0.1 * g)
                return result.applied

            def run():
                return strategy.run(replica_step)

            if not eager:
                run = tf.function(run)
            for _ in range(2):
                run()
                _check_replicas_identical(strategy, [v] + rule.variables)
            out[f"agg_{name}_{'eager' if eager else 'graph'}"] = np.asarray(strategy.experimental_local_results(v)[0])
            if name != "NONE":  # stock assign_sub in a replica context lets NONE's copies differ
                out[f"stock_{name}_{'eager' if eager else 'graph'}"] = np.asarray(
                    strategy.experimental_local_results(ref)[0])
            out[f"iterations_{name}"] = int(rule.iterations.numpy())

    # Adam, a global clip, Keras weights (aggregation NONE): one device on the summed gradient.
    rng = np.random.default_rng(5)
    shapes = [(4, 3), (3,), ()]
    init = [rng.normal(size=s).astype("float32") for s in shapes]
    bases = [tf.constant(rng.normal(size=s).astype("float32")) for s in shapes]
    for rule_name in ("Adam", "Nadam", "Lamb", "Adafactor"):
        with strategy.scope():
            ws = [keras.Variable(x) for x in init]
            rule = getattr(tfclip.rules, rule_name)(0.05)

        @tf.function
        def step():
            def replica_step():
                grads = [_replica_gradient(b) for b in bases]
                return tfclip.fused_clip_apply(zip(grads, ws), rule, global_clipnorm=1.0).global_norm
            return strategy.run(replica_step)

        one = [tf.Variable(x) for x in init]
        one_rule = getattr(tfclip.rules, rule_name)(0.05)
        total = sum(range(1, n + 1))
        norms = []
        for _ in range(3):
            norms.append(float(strategy.experimental_local_results(step())[0]))
            _check_replicas_identical(strategy, ws + rule.variables)
            want = tfclip.fused_clip_apply([(b * total, w) for b, w in zip(bases, one)], one_rule,
                                           global_clipnorm=1.0)
        out[f"{rule_name}_mirrored"] = np.concatenate([np.ravel(w.numpy()) for w in ws])
        out[f"{rule_name}_one_device"] = np.concatenate([np.ravel(w.numpy()) for w in one])
        out[f"{rule_name}_norm"] = np.array([norms[-1], float(want.global_norm)])

    # An adaptive clip (ZClip, AutoClip) from the all-reduced norm: the same statistics on every
    # replica, equal to one device given the summed gradient; a x100 spike at step 6. Through
    # fused_clip_apply (a rule) and a Keras 3 optimizer's apply.
    from tfclip import clipping

    for clip_name, make in (("zclip", lambda: clipping.ZClip(warmup_steps=3)),
                            ("autoclip", lambda: clipping.AutoClip(percentile=30, history_size=5))):
        for front in ("rule", "keras"):
            with strategy.scope():
                ws = [keras.Variable(x) for x in init]
                if front == "rule":
                    rule, clip = tfclip.rules.Adam(0.05), make()
                else:
                    # Built before the first traced step: stock Keras optimizers built inside the
                    # first strategy.run of a tf.function fail the same way (a placeholder of
                    # tf.function's variable-lifting cond is never fed), clip or not.
                    opt = tfclip.keras.Adam(0.05, clip=make())
                    opt.build(ws)
            spike = tf.Variable(1.0)

            @tf.function
            def step():
                def replica_step():
                    grads = [_replica_gradient(b) * spike for b in bases]
                    if front == "rule":
                        return tfclip.fused_clip_apply(zip(grads, ws), rule, clip=clip).global_norm
                    opt.apply(grads, ws)
                    return tf.constant(0.0)
                return strategy.run(replica_step)

            one = [tf.Variable(x) for x in init]
            one_rule, one_clip = tfclip.rules.Adam(0.05), make()
            for t in range(8):
                spike.assign(100.0 if t == 6 else 1.0)
                step()
                state = clip.state if front == "rule" else opt.clip.state
                _check_replicas_identical(strategy, ws + list(state.values()))
                tfclip.fused_clip_apply([(b * total * spike, w) for b, w in zip(bases, one)], one_rule,
                                        clip=one_clip)
            key = f"adaptive_{clip_name}_{front}"
            out[key + "_mirrored"] = np.concatenate([np.ravel(w.numpy()) for w in ws])
            out[key + "_one_device"] = np.concatenate([np.ravel(w.numpy()) for w in one])
            out[key + "_count"] = np.array([int(np.asarray(strategy.experimental_local_results(
                state["count"])[0])), int(one_clip.state["count"].numpy())])
            out[key + "_clipped"] = bool(one_clip.last_step.clipped)

    # Called in the cross-replica context with mirrored variables: every copy moves.
    with strategy.scope():
        v = tf.Variable([1.0, 1.0], aggregation=agg.MEAN)
        rule = tfclip.rules.Adam(0.1)
        tfclip.fused_clip_apply([(tf.constant([1.0, -1.0]), v)], rule)
    _check_replicas_identical(strategy, [v] + rule.variables)
    one = tf.Variable([1.0, 1.0])
    tfclip.fused_clip_apply([(tf.constant([1.0, -1.0]), one)], tfclip.rules.Adam(0.1))
    out["cross_replica"] = np.stack([np.asarray(c) for c in strategy.experimental_local_results(v)])
    out["cross_replica_one"] = one.numpy()

    # Refused, by name: a variable made outside the strategy, and a SyncOnRead one.
    plain = tf.Variable([1.0], name="plain_var")
    with strategy.scope():
        on_read = tf.Variable([1.0], name="on_read_var", trainable=False,
                              synchronization=tf.VariableSynchronization.ON_READ,
                              aggregation=agg.SUM)
    for key, var in (("error_plain", plain), ("error_on_read", on_read)):
        before = [np.asarray(c) for c in strategy.experimental_local_results(var)]
        try:
            strategy.run(lambda var=var: tfclip.fused_clip_apply([(tf.constant([1.0]), var)],
                                                                  tfclip.rules.SGD(0.1)))
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
        after = [np.asarray(c) for c in strategy.experimental_local_results(var)]
        out[key + "_unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, after))

    # tfclip.compat.v1 against stock tf.compat.v1 Adam: the summed gradient, every copy alike.
    for clip in (None, 1.0):
        finals = []
        for make in (lambda: tf.compat.v1.train.AdamOptimizer(0.05),
                     lambda: tfclip.compat.v1.AdamOptimizer(0.05, global_clipnorm=clip)):
            with strategy.scope():
                ws = [tf.Variable(x) for x in init]
                opt = make()
                gstep = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    aggregation=agg.ONLY_FIRST_REPLICA)

            @tf.function
            def step():
                def replica_step():
                    grads = [_replica_gradient(b) for b in bases]
                    opt.apply_gradients(zip(grads, ws), global_step=gstep)
                strategy.run(replica_step)

            for _ in range(3):
                step()
                _check_replicas_identical(strategy, ws + opt.variables())
            finals.append(np.concatenate([np.ravel(w.numpy()) for w in ws]))
            out[f"v1_gstep_{type(opt).__module__.split('.')[0]}_{clip}"] = int(gstep.numpy())
        out[f"v1_stock_{clip}"], out[f"v1_tfclip_{clip}"] = finals
    one = [tf.Variable(x) for x in init]
    one_opt = tfclip.compat.v1.AdamOptimizer(0.05, global_clipnorm=1.0)
    for _ in range(3):
        one_opt.apply_gradients([(b * sum(range(1, n + 1)), w) for b, w in zip(bases, one)])
    out["v1_one_device_1.0"] = np.concatenate([np.ravel(w.numpy()) for w in one])
    return out


def _worker_apply(strategy):
    """fused_clip_apply across workers: a MEAN variable and an Adam rule, each worker's
    gradient its replica id + 1; every worker must end with the same copies."""
    import numpy as np
    import tensorflow as tf

    import tfclip

    with strategy.scope():
        v = tf.Variable([1.0, 1.0], aggregation=tf.VariableAggregation.MEAN)
        w = tf.Variable([1.0, -1.0])
        sgd, adam = tfclip.rules.SGD(0.1), tfclip.rules.Adam(0.1)

    @tf.function
    def step():
        def replica_step():
            tfclip.fused_clip_apply([(_replica_gradient(tf.constant([1.0, 2.0])), v)], sgd)
            tfclip.fused_clip_apply([(_replica_gradient(tf.constant([3.0, -1.0])), w)], adam,
                                    global_clipnorm=1.0)
        strategy.run(replica_step)

    for _ in range(2):
        step()
        _check_replicas_identical(strategy, [v, w] + sgd.variables + adam.variables)
    return np.concatenate([v.numpy(), w.numpy(), [float(adam.iterations.numpy())]])


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
        result["muon_fit"] = _fit(strategy, muon=True)[0]
        result["muon_custom"] = _custom_loop(strategy, muon=True)
        result["two_replica_clip"] = _two_replica_clip(strategy)
        result["replicas"] = strategy.num_replicas_in_sync
    elif mode == "replica_apply":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        result.update(_replica_apply(strategy))
        result["replicas"] = strategy.num_replicas_in_sync
    elif mode == "single":
        strategy = tf.distribute.get_strategy()
        result["fit"], result["fit_norm"], result["tnorms_fit"] = _fit(strategy)
        result["custom"] = _custom_loop(strategy)
        result["muon_fit"] = _fit(strategy, muon=True)[0]
        result["muon_custom"] = _custom_loop(strategy, muon=True)
    elif mode == "worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        # A custom loop: Keras 3.15's model.fit fails under MultiWorkerMirroredStrategy on CPU
        # workers with the stock optimizers too (it converts a PerReplica batch to a tensor).
        result["custom"] = _custom_loop(strategy)
        result["fused_clip_apply"] = _worker_apply(strategy)
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
