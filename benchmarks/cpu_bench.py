"""One fp32 clip(global 1.0) + Adam step: tfclip against TensorFlow's paths, on the CPU.

    python benchmarks/cpu_bench.py [--sets resnet50,bert_base,small2000] [--repeats 7]

Each figure is the median of --repeats timed steps (after two warm-up steps) and is also shown
as a ratio to a memory-bandwidth floor measured in the same run: 32 bytes per parameter
(4 to read the gradient for the norm, 16 to read grad/var/m/v, 12 to write var/m/v) at the
read+write bandwidth of a large multi-threaded copy. Machines are shared and noisy: compare
ratios within one run, not absolute times across runs.
"""
import argparse
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402

BYTES_PER_PARAM = 32


def resnet50_like():
    """~25.5M parameters in ~160 tensors: conv kernels plus BN scale/shift vectors."""
    shapes = [(7, 7, 3, 64), (64,), (64,)]
    cin = 64
    for width, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for b in range(blocks):
            for k, ci, co in [(1, cin, width), (3, width, width), (1, width, width * 4)]:
                shapes += [(k, k, ci, co), (co,), (co,)]
            if b == 0:
                shapes += [(1, 1, cin, width * 4)]
            cin = width * 4
    shapes += [(2048, 1000), (1000,)]
    return shapes


def bert_base_like():
    """~110M parameters in ~200 tensors: embeddings and 12 transformer layers."""
    h, ff = 768, 3072
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (h, ff), (ff,), (ff, h), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]
    return shapes


def small2000():
    """2000 small tensors, ~8M parameters."""
    return [(64, 64 if i % 2 else 62) for i in range(2000)]


SETS = {"resnet50": resnet50_like, "bert_base": bert_base_like, "small2000": small2000}


def copy_bandwidth(nbytes=512 << 20, threads=None, repeats=5):
    """Read+write bytes per second of a large copy split over all cores (numpy releases the GIL)."""
    threads = threads or os.cpu_count() or 1
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(n), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts if len(p)]

    def run():
        ts = [threading.Thread(target=np.copyto, args=(dst[b:e], src[b:e])) for b, e in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run()
    best = min(_timed(run) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn, repeats):
    fn()
    fn()
    return float(np.median([_timed(fn) for _ in range(repeats)]))


def contestants(variables, grads):
    lr = 1e-9  # keep weights where they are; the speed does not depend on it
    rule = tfclip.rules.Adam(lr)

    @tf.function
    def fused():
        return tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied

    k_adam = keras.optimizers.Adam(lr)
    k_adam.build(variables)

    @tf.function
    def keras_unfused():
        clipped, _ = tf.clip_by_global_norm(grads, 1.0)
        k_adam.apply_gradients(zip(clipped, variables))

    k_xla = keras.optimizers.Adam(lr, global_clipnorm=1.0)
    k_xla.build(variables)

    @tf.function(jit_compile=True)
    def keras_xla():
        k_xla.apply_gradients(zip(grads, variables))

    ms = [tf.Variable(tf.zeros_like(v)) for v in variables]
    vs = [tf.Variable(tf.zeros_like(v)) for v in variables]
    step = tf.Variable(1.0)

    @tf.function
    def raw_per_variable():
        clipped, _ = tf.clip_by_global_norm(grads, 1.0)
        b1p, b2p = tf.pow(0.9, step), tf.pow(0.999, step)
        for v, m, s, g in zip(variables, ms, vs, clipped):
            tf.raw_ops.ResourceApplyAdam(var=v.handle, m=m.handle, v=s.handle, beta1_power=b1p,
                                         beta2_power=b2p, lr=lr, beta1=0.9, beta2=0.999,
                                         epsilon=1e-7, grad=g)
        step.assign_add(1.0)

    return {
        "tfclip fused_clip_apply": fused,
        "tf.clip_by_global_norm + Keras Adam": keras_unfused,
        "Keras Adam(global_clipnorm), XLA": keras_xla,
        "clip + per-var ResourceApplyAdam": raw_per_variable,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    bw = copy_bandwidth()
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; copy bandwidth (read+write) "
          f"{bw / 1e9:.1f} GB/s; floor = {BYTES_PER_PARAM} B/param at that bandwidth\n")
    header = f"{'set':<10} {'params':>7} {'tensors':>7}  {'method':<37} {'ms':>9} {'x floor':>8} {'x tfclip':>9}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for name in args.sets.split(","):
        shapes = SETS[name]()
        variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        n = sum(int(np.prod(s)) for s in shapes)
        floor = BYTES_PER_PARAM * n / bw
        results = {}
        for label, fn in contestants(variables, grads).items():
            results[label] = median_time(fn, args.repeats)
        base = results["tfclip fused_clip_apply"]
        for i, (label, t) in enumerate(results.items()):
            first = f"{name:<10} {n / 1e6:6.1f}M {len(shapes):7d}" if i == 0 else " " * 26
            print(f"{first}  {label:<37} {t * 1e3:9.2f} {t / floor:8.2f} {t / base:9.2f}")
        print(f"{'':26}  {'floor (32 B/param)':<37} {floor * 1e3:9.2f} {1.0:8.2f}")
        del variables, grads


if __name__ == "__main__":
    main()
