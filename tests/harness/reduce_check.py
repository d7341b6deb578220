"""`reduce_dtype` across replicas, in a fresh process (strategies configure devices at start-up,
so tests/test_distribute_reduce.py runs this as a subprocess; a test harness, not part of the
installed package).

    python tests/harness/reduce_check.py mirrored OUT.npz           # 2 logical CPUs
    TF_CONFIG=... python tests/harness/reduce_check.py worker OUT.npz  # one of 2 worker processes

Each replica's gradient differs from the other's in bits that bfloat16 (and float16) drop, so a
sum in 16 bits differs from the float32 sum. For each front door (tfclip.keras.Adam,
tfclip.tf_keras.Adam, tfclip.rules.Adam through fused_clip_apply; Keras and the rule also with
shard_state=True), two steps inside strategy.run with global_clipnorm / clip 1, and the same
two steps on one device outside the strategy given the reference sum: each replica's gradient
rounded to the reduce dtype, the two added and rounded once (what add_n and the collective's
ring do with two operands). The test compares the copies' bits with that reference's; and the
float32 run (reduce_dtype=None) with the one-device step given the float32 sum.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SHAPES = [(4, 3), (3,)]
STEPS = 2


def _base(step):
    import numpy as np

    rng = np.random.default_rng(7 + step)
    # Two parts per replica: 1 + 2^-12 * k has bits below bfloat16's 8 and float16's 11.
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES], \
        [(1.0 + 2.0 ** -12 * rng.integers(1, 64, size=s)).astype(np.float32) for s in SHAPES]


def _replica_grads(step, n):
    """The gradients of every replica at `step`: replica r's is base * (1 + r * (frac - 1) * 37)."""
    import numpy as np

    base, frac = _base(step)
    return [[(b * (1.0 + r * (f - 1.0) * 37.0)).astype(np.float32) for b, f in zip(base, frac)] for r in range(n)]


def _reference_sum(step, n, reduce_dtype):
    """The gradients summed as a collective of n replicas in `reduce_dtype` sums them: each
    rounded to it, then added in replica order, rounded after each addition (n = 2: once)."""
    import numpy as np
    import tensorflow as tf

    per = _replica_grads(step, n)
    out = []
    for i in range(len(SHAPES)):
        if reduce_dtype is None:
            out.append(tf.constant(np.sum([p[i].astype(np.float64) for p in per], axis=0).astype(np.float32)))
            continue
        acc = tf.cast(tf.constant(per[0][i]), reduce_dtype)
        for p in per[1:]:
            acc = acc + tf.cast(tf.constant(p[i]), reduce_dtype)
        out.append(acc)
    return out


def _this_replica_grads(step):
    import numpy as np
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    n = ctx.num_replicas_in_sync
    per = _replica_grads(step, n)
    rid = ctx.replica_id_in_sync_group
    stacked = [np.stack([p[i] for p in per]) for i in range(len(SHAPES))]
    return [tf.gather(tf.constant(a), rid) for a in stacked]


def _front_doors():
    """(name, make optimizer(reduce_dtype, shard_state), kind)."""
    import keras
    import tensorflow as tf

    import tfclip

    return [
        ("keras", lambda rd, sh: tfclip.keras.Adam(0.1, global_clipnorm=1.0, reduce_dtype=rd, shard_state=sh),
         lambda a: keras.Variable(a)),
        ("keras_shard", lambda rd, sh: tfclip.keras.Adam(0.1, global_clipnorm=1.0, reduce_dtype=rd, shard_state=True),
         lambda a: keras.Variable(a)),
        ("tf_keras", lambda rd, sh: tfclip.tf_keras.Adam(0.1, global_clipnorm=1.0, reduce_dtype=rd),
         lambda a: tf.Variable(a)),
        ("rules", lambda rd, sh: tfclip.rules.Adam(0.1, reduce_dtype=rd, shard_state=sh), lambda a: tf.Variable(a)),
        ("rules_shard", lambda rd, sh: tfclip.rules.Adam(0.1, reduce_dtype=rd, shard_state=True),
         lambda a: tf.Variable(a)),
    ]


def _apply(opt, pairs):
    import tfclip

    if isinstance(opt, tfclip.rules.Rule):
        tfclip.fused_clip_apply(pairs, opt, global_clipnorm=1.0)
    else:
        opt.apply_gradients(pairs)


def _init():
    import numpy as np

    rng = np.random.default_rng(3)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _distributed(strategy, name, make_opt, make_var, reduce_dtype):
    import numpy as np
    import tensorflow as tf

    with strategy.scope():
        variables = [make_var(a) for a in _init()]
        opt = make_opt(reduce_dtype, False)
        if hasattr(opt, "build") and not hasattr(opt, "binding"):
            opt.build(variables)
    for step in range(STEPS):
        @tf.function
        def run(step=step):
            def replica():
                _apply(opt, list(zip(_this_replica_grads(step), variables)))
            strategy.run(replica)
        run()
    out = []
    for v in variables:
        tv = v if callable(getattr(v, "value", None)) else v.value  # (a keras.Variable: its tf.Variable)
        copies = [np.asarray(c) for c in strategy.experimental_local_results(tv)]
        for c in copies[1:]:
            if not np.array_equal(c.view(np.uint32), copies[0].view(np.uint32)):
                raise AssertionError(f"{name}: the copies of a variable differ")
        out.append(copies[0])
    return out


def _one_device(n, name, make_opt, make_var, reduce_dtype):
    import numpy as np

    variables = [make_var(a) for a in _init()]
    opt = make_opt(reduce_dtype, False)
    for step in range(STEPS):
        _apply(opt, list(zip(_reference_sum(step, n, reduce_dtype), variables)))
    return [np.asarray(v.numpy()) for v in variables]


def _refusal(strategy):
    """A float64 variable with reduce_dtype="bfloat16" under the strategy: the error's text."""
    import keras
    import tensorflow as tf

    import tfclip

    with strategy.scope():
        v = keras.Variable(tf.zeros([2], tf.float64), dtype="float64", name="wide")
        opt = tfclip.keras.SGD(0.1, reduce_dtype="bfloat16")
        opt.build([v])

    @tf.function
    def run():
        strategy.run(lambda: opt.apply_gradients([(tf.ones([2], tf.float64), v)]))
    try:
        run()
    except ValueError as e:
        return str(e)
    return ""


def run_all(strategy):
    out = {}
    n = strategy.num_replicas_in_sync
    for name, make_opt, make_var in _front_doors():
        for rd in ("bfloat16", "float16", None):
            if rd == "float16" and name not in ("keras", "rules"):
                continue
            key = f"{name}_{rd or 'float32'}"
            got = _distributed(strategy, key, make_opt, make_var, rd)
            want = _one_device(n, key, make_opt, make_var, rd)
            for i, (g, w) in enumerate(zip(got, want)):
                out[f"{key}_got_{i}"] = g
                out[f"{key}_want_{i}"] = w
    out["refusal"] = _refusal(strategy)
    out["replicas"] = n
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mode, path = argv[0], argv[1]
    import numpy as np
    import tensorflow as tf

    if mode == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    elif mode == "worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        sys.exit(f"unknown mode {mode!r}")
    out = run_all(strategy)
    if mode == "worker":
        out["task"] = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(path, **{k: np.asarray(v) for k, v in out.items()})


if __name__ == "__main__":
    main()
