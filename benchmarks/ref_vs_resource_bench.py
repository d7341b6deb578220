"""A tfclip.compat.v1 step on TF1 ref variables against the same step on resource variables
(the same model, optimizer and gradients), in TF1 graphs with a Session, CPU.

    python benchmarks/ref_vs_resource_bench.py [--tensors 40] [--size 65536] [--steps 200]

Each graph applies fixed gradients (constants: the step alone, no backprop), so the time is
the optimizer step's: `sess.run(train_op)`. Rounds alternate between the two graphs; the report
is each one's median time per step over the rounds and their ratio (ref / resource)."""
import argparse
import time

import numpy as np
import tensorflow as tf

import tfclip

v1 = tf.compat.v1


def build(use_resource, name, tensors, size):
    g = tf.Graph()
    with g.as_default():
        rng = np.random.default_rng(0)
        vs, grads = [], []
        for i in range(tensors):
            n = size if i % 4 else size // 16 + 1  # large and small tensors
            vs.append(v1.get_variable(f"w{i}", initializer=rng.normal(size=n).astype("float32"),
                                      use_resource=use_resource))
            grads.append(tf.constant(rng.normal(size=n).astype("float32") * 1e-3))
        make = {"adam": lambda: tfclip.compat.v1.AdamOptimizer(1e-3, global_clipnorm=1.0),
                "momentum": lambda: tfclip.compat.v1.MomentumOptimizer(1e-3, 0.9, global_clipnorm=1.0),
                "gd": lambda: tfclip.compat.v1.GradientDescentOptimizer(1e-3, global_clipnorm=1.0)}[name]
        train = make().apply_gradients(zip(grads, vs))
        init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
    return g, train, init


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--size", type=int, default=65536)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--optimizers", default="adam,momentum,gd")
    a = p.parse_args()
    for name in a.optimizers.split(","):
        sessions = {}
        for kind, use_resource in (("ref", False), ("resource", True)):
            g, train, init = build(use_resource, name, a.tensors, a.size)
            s = v1.Session(graph=g)
            s.run(init)
            for _ in range(20):  # warm up
                s.run(train)
            sessions[kind] = (s, train)
        times = {k: [] for k in sessions}
        for _ in range(a.rounds):
            for kind, (s, train) in sessions.items():
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    s.run(train)
                times[kind].append((time.perf_counter() - t0) / a.steps)
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"{name:9s} {a.tensors} tensors, {a.size} max elements: ref {med['ref'] * 1e6:8.1f} us/step, "
              f"resource {med['resource'] * 1e6:8.1f} us/step, ref/resource {med['ref'] / med['resource']:.3f}")
        for s, _ in sessions.values():
            s.close()


if __name__ == "__main__":
    main()
