"""The step as a user runs it through each front door, to compare two versions of tfclip's Python
layer (a refactoring must not slow any of them):

    PYTHONPATH=<tree A> python benchmarks/front_door_bench.py 40
    PYTHONPATH=<tree B> python benchmarks/front_door_bench.py 40     (then A and B again)

The whole call: Keras 3 `tfclip.keras.Adam` / `AdamW` (two weight-decay groups) and
`tfclip.tf_keras.Adam` in `tf.function`, `fused_clip_apply` in `tf.function` (BERT-layer shapes,
5.6M parameters, fp32, global clip 1.0), and `fused_clip_apply` eagerly over 200 variables of 4
elements (the fixed cost), with a fixed clip and with ZClip. Median microseconds per call over
the rounds given (default 30), each round in a shuffled order. Two processes cannot share one
interleaved loop, so run the trees alternately, twice, and compare ratios of the same rows."""
import sys
import time

import numpy as np
import tensorflow as tf
import tfclip
import tfclip.keras
import tfclip.tf_keras

rng = np.random.default_rng(0)
shapes = [(768, 768)] * 8 + [(768, 3072), (3072, 768)] * 2 + [(768,)] * 20
def mk():
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.02) for s in shapes]
    gs = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    return vs, gs

cases = {}
vs, gs = mk()
k3 = tfclip.keras.Adam(1e-3, global_clipnorm=1.0); k3.build(vs)
cases["keras3 Adam(global_clipnorm) tf.function"] = tf.function(lambda: k3.apply(gs, vs))
vs2, gs2 = mk()
k3w = tfclip.keras.AdamW(1e-3, weight_decay=0.01, global_clipnorm=1.0); k3w.exclude_from_weight_decay(var_list=vs2[-20:]); k3w.build(vs2)
cases["keras3 AdamW 2 groups tf.function"] = tf.function(lambda: k3w.apply(gs2, vs2))
vs3, gs3 = mk()
tk = tfclip.tf_keras.Adam(1e-3, global_clipnorm=1.0)
cases["tf_keras Adam tf.function"] = tf.function(lambda: tk.apply_gradients(zip(gs3, vs3)))
vs4, gs4 = mk()
rule = tfclip.rules.Adam(1e-3)
cases["fused_clip_apply tf.function"] = tf.function(lambda: tfclip.fused_clip_apply(zip(gs4, vs4), rule, global_clipnorm=1.0).applied)
sv = [tf.Variable(rng.standard_normal(4).astype(np.float32)) for _ in range(200)]
sg = [tf.constant(rng.standard_normal(4).astype(np.float32)) for _ in range(200)]
pairs = list(zip(sg, sv)); rule2 = tfclip.rules.Adam(1e-9)
cases["eager fused_clip_apply 200x4"] = lambda: tfclip.fused_clip_apply(pairs, rule2, global_clipnorm=1.0)
rule3 = tfclip.rules.Adam(1e-9); z = tfclip.clipping.ZClip()
cases["eager fused_clip_apply 200x4 zclip"] = lambda: tfclip.fused_clip_apply(pairs, rule3, clip=z)
for f in cases.values():
    f(); f()
times = {k: [] for k in cases}
order = list(cases)
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    rng.shuffle(order)
    for k in order:
        n = 20 if k.startswith("eager") else 1
        t0 = time.perf_counter()
        for _ in range(n):
            cases[k]()
        times[k].append((time.perf_counter() - t0) / n)
for k in cases:
    print(f"{k:45s} {np.median(times[k]) * 1e6:10.1f}")
