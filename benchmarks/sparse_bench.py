"""Embedding table + dense tower: one clip(global 1.0)+Adam step with an IndexedSlices gradient.

    python benchmarks/sparse_bench.py            # 1M x 128 table, 4096 touched rows, 4M-param tower

Every method runs inside `tf.function` on its own copy of the variables, given the same
precomputed gradients (the step measures clip + apply only). Reported: median ms per step and
the ratio to TF's path (stock Keras Adam with global_clipnorm, which densifies the table's
gradient in the clip). Ratios within one run; the machines are shared and absolute times wander.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tfclip  # noqa: E402


def make_problem(rows, width, touched, tower, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(rows, width)).astype(np.float32) * 0.05
    dense = [rng.normal(size=(tower, tower)).astype(np.float32) * 0.02 for _ in range(4)]
    # Token ids as a batch gives them: mostly distinct, some repeated.
    idx = rng.integers(0, rows, size=touched).astype(np.int32)
    idx[: touched // 16] = idx[touched // 16: touched // 8]
    g_emb = tf.IndexedSlices(tf.constant(rng.normal(size=(touched, width)).astype(np.float32)),
                             tf.constant(idx), tf.constant([rows, width]))
    g_dense = [tf.constant(rng.normal(size=d.shape).astype(np.float32) * 0.1) for d in dense]
    return [table] + dense, [g_emb] + g_dense


def method_step(name, init, grads):
    variables = [keras.Variable(v) for v in init]
    if name == "tfclip.keras.Adam (stock semantics)":
        opt = tfclip.keras.Adam(1e-3, global_clipnorm=1.0)
    elif name == "tfclip.keras.Adam(lazy_sparse=True)":
        opt = tfclip.keras.Adam(1e-3, global_clipnorm=1.0, lazy_sparse=True)
    elif name.startswith("Keras Adam(global_clipnorm)"):
        opt = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)
    else:
        opt = keras.optimizers.Adam(1e-3)
    opt.build(variables)
    clip_first = name.startswith("tf.clip_by_global_norm")

    @tf.function(jit_compile=False)
    def step():
        g = grads
        if clip_first:
            g, _ = tf.clip_by_global_norm(g, 1.0)
        opt.apply_gradients(zip(g, variables))

    return step, variables


METHODS = [
    "tfclip.keras.Adam (stock semantics)",
    "tfclip.keras.Adam(lazy_sparse=True)",
    "Keras Adam(global_clipnorm)  [TF's path]",
    "tf.clip_by_global_norm + Keras Adam",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--touched", type=int, default=4096)
    ap.add_argument("--tower", type=int, default=1024, help="4 dense tower matrices of tower x tower")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    init, grads = make_problem(args.rows, args.width, args.touched, args.tower)
    n_table, n_tower = args.rows * args.width, 4 * args.tower ** 2
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; table {args.rows:,} x {args.width} "
          f"({n_table / 1e6:.0f}M params), {args.touched} touched rows/step, tower {n_tower / 1e6:.1f}M params")
    steps = {}
    for name in METHODS:
        steps[name] = method_step(name, init, grads)
        steps[name][0]()  # trace + first step
    times = {name: [] for name in METHODS}
    for _ in range(args.repeats):  # interleaved, so drift hits every method alike
        for name in METHODS:
            t0 = time.perf_counter()
            steps[name][0]()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[METHODS[2]])
    print(f"\n{'method':45s} {'ms/step':>9s} {'x TF path':>10s}")
    for name in METHODS:
        ms = statistics.median(times[name]) * 1e3
        print(f"{name:45s} {ms:9.1f} {ms / (base * 1e3):10.3f}")
    # The stock-semantics step matches TF's path (same update, no densified gradient).
    a = steps[METHODS[0]][1][0].numpy()
    b = steps[METHODS[2]][1][0].numpy()
    print(f"\nmax |table(tfclip) - table(TF path)| after {args.repeats + 1} steps: {np.max(np.abs(a - b)):.2e}")


if __name__ == "__main__":
    main()
