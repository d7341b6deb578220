"""shard_state=True (ZeRO-1, tfclip/_shard.py) against the unsharded step, under MirroredStrategy
over N logical CPU devices of this machine: optimizer-state bytes per replica, and the whole
`tf.function` call of `strategy.run(step)` as a custom loop runs it (the all-reduce of the
gradients, Keras's apply_gradients with the fused step, the all-gather of the updated variables),
medians of interleaved repeats, as ratios in the same run.

    python benchmarks/shard_bench.py [--layers 12] [--replicas 2] [--repeats 5] [--iters 3]

--layers: BERT-base's embeddings and that many of its transformer layers (12: BERT-base, 110M
parameters). The gradients are fixed per replica (made once, outside the timed call), float32,
Adam with global_clipnorm=1. Logical CPU devices share this machine's cores: the times say what
the extra norm pass and all-gather cost here, not what N GPUs would gain.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()

    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tfclip
    from cpu_bench import bert_layers

    shapes = bert_layers(args.layers)
    n_params = sum(int(np.prod(s)) for s in shapes)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s).astype("float32") * 0.02 for s in shapes]
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.constant(rng.normal(size=s).astype("float32") * 1e-3) for s in shapes])

    contenders = {
        "stock keras.optimizers.Adam": lambda: keras.optimizers.Adam(1e-4, global_clipnorm=1.0),
        "tfclip.keras.Adam": lambda: tfclip.keras.Adam(1e-4, global_clipnorm=1.0),
        "tfclip.keras.Adam(shard_state=True)": lambda: tfclip.keras.Adam(1e-4, global_clipnorm=1.0, shard_state=True),
    }
    steps, state = {}, {}
    for label, make in contenders.items():
        with strategy.scope():
            vs = [keras.Variable(x) for x in init]
            opt = make()
            opt.build(vs)

        def step(g, vs=vs, opt=opt):
            opt.apply_gradients(zip(g, vs))

        steps[label] = tf.function(lambda g, step=step: strategy.run(step, args=(g,)))
        by = {}
        for v in opt.variables:
            if v.path.split("/")[-1] in ("iteration", "learning_rate"):
                continue
            x = v.value
            n = v.shape.num_elements() * tf.as_dtype(v.dtype).size
            for d in ([c.device for c in x.values] if isinstance(x, tf.distribute.DistributedValues) else [x.device]):
                by[d] = by.get(d, 0) + n
        state[label] = [by.get(d, 0) / n_params for d in sorted(by)]
        steps[label](grads)  # trace and warm up
        steps[label](grads)

    times = {label: [] for label in contenders}
    for _ in range(args.repeats):
        for label, f in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = f(grads)
            tf.nest.map_structure(lambda t: t, out)
            times[label].append((time.perf_counter() - t0) / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["tfclip.keras.Adam"]
    print(f"shard_bench: BERT-base embeddings + {args.layers} layers, {n_params:,} parameters, {len(shapes)} "
          f"tensors, Adam float32, global_clipnorm=1, MirroredStrategy over {args.replicas} logical CPUs "
          f"({os.cpu_count()} cores); median of {args.repeats} x {args.iters} whole tf.function calls")
    print(f"{'':<40} {'ms/step':>9} {'x unsharded':>12}   optimizer state, bytes/param on each replica")
    for label in contenders:
        per = "  ".join(f"{b:5.2f}" for b in state[label])
        print(f"{label:<40} {med[label] * 1e3:9.1f} {med[label] / base:12.2f}   {per}")


if __name__ == "__main__":
    main()
