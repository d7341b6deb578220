"""CPU speed of one clip(global 1.0) + update step: tfclip against TensorFlow's paths.

    python benchmarks/cpu_bench.py [--sets resnet50,bert_base,small2000] [--repeats 7]
                                   [--extras rules,tf1,adaptive,grad_dtypes,overhead,state_dtype,state_tiles,op_vs_core,loss_scale,rounding,adafactor,muon]

Main table: one fp32 clip + Adam step per `tf.function` call, median of --repeats (after two
warm-up calls). Every call of a `tf.function` that captures N variables and tensors pays TF's
cost of passing them in (about 3 us each here: 24 ms for small2000's 8000), whatever the step
does; the "harness" row measures that cost with the same captures passed to one stateful no-op
(`consume` below), and "net" is a method's time minus it. "x floor" divides net time by the memory floor: 32 bytes per
parameter (4 to read the gradient for the norm, 16 to read grad/var/m/v, 12 to write var/m/v)
at the speed of a multi-threaded copy that moves as many bytes, timed in the same interleaved
loop as the methods (a bandwidth read once at the start swung the ratios by 20% between runs).

Extras: every rule (SGD ... Lamb, ScheduleFreeAdamW) on the BERT-base set against its own floor (16 + 8 B/param per
slot; Lamb 44, its three passes) and against the stock Keras optimizer's tf.function step; the
TF1-only optimizers (ProximalGradientDescent, ProximalAdagrad, AdagradDA: tfclip.compat.v1)
against their floor and the stock tf.compat.v1.train class after tf.clip_by_global_norm, in
tf.function; the adaptive clips (tfclip.clipping ZClip, AutoClip) with Adam against the fixed
global clip's fused step, the floor, and the same clipping written with stock TF ops
(tf.linalg.global_norm, the threshold, tf.clip_by_global_norm, Keras Adam), and AGC against its
floor (36 B/param: the variable's read in the norm pass) and the unit norms in stock TF ops; float16/bfloat16 gradients for float32 variables, per parameter,
against float32 gradients; the fixed cost of one call with 200 small variables, eager and in
`tf.function`; bfloat16 and int8 optimizer state (`state_dtype=`) against float32 state, for
fused_clip_apply and the Keras drop-in (whole calls), each against its own floor, with the
optimizer's bytes per parameter; mixed_float16's loss scaling around tfclip's Adam, the stock
wrapper against tfclip.keras.LossScaleOptimizer; pure-bfloat16 weights (bf16 variables and
slots), stochastic rounding against round to nearest and stock Keras Adam. Machines are shared
and noisy: compare ratios within one run.
"""
import argparse
import importlib
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tfclip  # noqa: E402
import tfclip.keras  # noqa: E402,F401  (the state_dtype table's drop-in)
from tfclip import _core  # noqa: E402,F401  (tfclip._core.cpu_isa)

BYTES_PER_PARAM = 32


def _numpy_pages_as_tf():
    """NumPy asks the kernel for transparent huge pages on its large arrays (madvise); TF's CPU
    allocator does not. A floor (or a core step) timed on NumPy arrays would then run on bigger
    pages than the TF steps beside it: 1.2x faster on the development machine, whose THP setting
    is "madvise" (benchmarks/NOTES.md, section 37). Turned off here, NumPy's arrays get the pages
    malloc gives, as TF's tensors do (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 gives both huge ones)."""
    mod = getattr(np, "_core", None) or np.core
    set_hugepage = getattr(mod.multiarray, "_set_madvise_hugepage", None)
    if set_hugepage is not None:
        set_hugepage(False)


_numpy_pages_as_tf()


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


def floor_copy(n_params, threads=None):
    """A copy that moves 32 bytes per parameter (reads 16, writes 16), split over all cores
    (numpy releases the GIL). It is timed in the same interleaved loop as the methods, so the
    floor sees the same machine they do; its median time is the floor."""
    threads = threads or os.cpu_count() or 1
    n = 4 * n_params  # float32 elements: 16 bytes per parameter each way
    src = np.ones(n, np.float32)
    dst = np.zeros_like(src)
    parts = np.array_split(np.arange(0, n, 1 << 16), threads)
    bounds = [(int(p[0]), min(n, int(p[-1]) + (1 << 16))) for p in parts if len(p)]

    def run():
        ts = [threading.Thread(target=np.copyto, args=(dst[b:e], src[b:e])) for b, e in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run


def consume(tensors):
    """One op that takes every tensor and does nothing: TF's `Print` with first_n=0 (it prints
    nothing; its output is its first input). It is stateful, so grappler keeps it and with it
    every input. (A harness that passed the captures to IdentityN and returned one output was
    rewritten by grappler to return that input alone: the call then ran one _Arg op instead of
    thousands, and the harness undercounted TF's per-input cost; see NOTES.md, section 13.)"""
    tensors = list(tensors)
    return tf.raw_ops.Print(input=tensors[-1], data=tensors, message="", first_n=0, summarize=0)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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

    # The cost of calling a tf.function with these captures, whatever it does: the same
    # variables, two slot sets and the gradients, passed to one no-op.
    @tf.function
    def harness():
        return consume([v.handle for v in list(variables) + ms + vs] + list(grads))

    return {
        "tfclip fused_clip_apply": fused,
        "tf.clip_by_global_norm + Keras Adam": keras_unfused,
        "Keras Adam(global_clipnorm), XLA": keras_xla,
        "clip + per-var ResourceApplyAdam": raw_per_variable,
    }, harness


def interleaved_times(fns, repeats, shuffle=False):
    """Seconds per call of each function, `repeats` rounds, calls interleaved so drift hits
    all alike (round r of every function ran within one pass). `shuffle`: each round in a new
    order (fixed seed), so no function always runs after the same neighbour, whose leftovers
    in the caches it would pay for."""
    for fn in fns.values():
        fn()
        fn()
    times = {k: [] for k in fns}
    order = list(fns)
    rng = np.random.default_rng(0)
    for _ in range(repeats):
        if shuffle:
            rng.shuffle(order)
        for k in order:
            times[k].append(_timed(fns[k]))
    return {k: np.array(v) for k, v in times.items()}


def interleaved_medians(fns, repeats):
    """Median seconds per call of each function, calls interleaved."""
    return {k: float(np.median(v)) for k, v in interleaved_times(fns, repeats).items()}


def make_set(name, rng, grad_dtype=np.float32):
    shapes = SETS[name]()
    variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32).astype(grad_dtype)) for s in shapes]
    return shapes, variables, grads


def main_table(args, rng):
    header = (f"{'set':<10} {'params':>7} {'tensors':>7}  {'method':<37} {'ms/call':>8} {'net ms':>8} "
              f"{'x floor':>8} {'x tfclip':>9}")
    print(header)
    print("-" * len(header))
    for name in args.sets.split(","):
        shapes, variables, grads = make_set(name, rng)
        n = sum(int(np.prod(s)) for s in shapes)
        fns, harness = contestants(variables, grads)
        results = interleaved_medians({**fns, "harness": harness, "floor": floor_copy(n)}, args.repeats)
        h = results.pop("harness")
        floor = results.pop("floor")
        base = results["tfclip fused_clip_apply"] - h
        for i, (label, t) in enumerate(results.items()):
            first = f"{name:<10} {n / 1e6:6.1f}M {len(shapes):7d}" if i == 0 else " " * 26
            print(f"{first}  {label:<37} {t * 1e3:8.2f} {(t - h) * 1e3:8.2f} {(t - h) / floor:8.2f} "
                  f"{(t - h) / base:9.2f}")
        print(f"{'':26}  {'harness (captures, no-op)':<37} {h * 1e3:8.2f}")
        print(f"{'':26}  {'floor (32 B/param copy, same loop)':<37} {'':8} {floor * 1e3:8.2f} {1.0:8.2f}"
              f"   ({BYTES_PER_PARAM * n / floor / 1e9:.1f} GB/s)")
        del variables, grads


def _bytes(slots):
    """Bytes per fp32 parameter of a clip(global) + apply step with `slots` slot arrays: the norm
    reads the gradient (4), the apply reads gradient, variable and slots and writes variable and
    slots (4 + 8 + 8 * slots)."""
    return 4 + 4 + 8 + 8 * slots


# Lamb's per-tensor trust ratio needs every update before any variable moves: the norm reads
# the gradient (4); the slot pass reads gradient, variable (for |w|) and m, v and writes m, v
# (4 + 4 + 16); the variable pass reads variable, m, v and writes the variable (16).
LAMB_BYTES = 4 + (4 + 4 + 16) + 16


# label: (tfclip.rules object, stock Keras optimizer, bytes per fp32 parameter). lr 1e-9 keeps the weights where
# they are; the speed does not depend on it.
RULES = {
    "SGD": (lambda: tfclip.rules.SGD(1e-9), lambda: keras.optimizers.SGD(1e-9, global_clipnorm=1.0), _bytes(0)),
    "Momentum": (lambda: tfclip.rules.SGD(1e-9, momentum=0.9),
                 lambda: keras.optimizers.SGD(1e-9, momentum=0.9, global_clipnorm=1.0), _bytes(1)),
    "Adam": (lambda: tfclip.rules.Adam(1e-9), lambda: keras.optimizers.Adam(1e-9, global_clipnorm=1.0), _bytes(2)),
    "AdamW": (lambda: tfclip.rules.AdamW(1e-9, weight_decay=1e-9),
              lambda: keras.optimizers.AdamW(1e-9, weight_decay=1e-9, global_clipnorm=1.0), _bytes(2)),
    "RMSprop": (lambda: tfclip.rules.RMSprop(1e-9), lambda: keras.optimizers.RMSprop(1e-9, global_clipnorm=1.0), _bytes(1)),
    "RMSprop mom+centered": (lambda: tfclip.rules.RMSprop(1e-9, momentum=0.9, centered=True),
                             lambda: keras.optimizers.RMSprop(1e-9, momentum=0.9, centered=True,
                                                              global_clipnorm=1.0), _bytes(3)),
    "Adagrad": (lambda: tfclip.rules.Adagrad(1e-9), lambda: keras.optimizers.Adagrad(1e-9, global_clipnorm=1.0), _bytes(1)),
    "Adadelta": (lambda: tfclip.rules.Adadelta(1e-9),
                 lambda: keras.optimizers.Adadelta(1e-9, global_clipnorm=1.0), _bytes(2)),
    "Adamax": (lambda: tfclip.rules.Adamax(1e-9), lambda: keras.optimizers.Adamax(1e-9, global_clipnorm=1.0), _bytes(2)),
    "Nadam": (lambda: tfclip.rules.Nadam(1e-9), lambda: keras.optimizers.Nadam(1e-9, global_clipnorm=1.0), _bytes(2)),
    "Lion": (lambda: tfclip.rules.Lion(1e-9), lambda: keras.optimizers.Lion(1e-9, global_clipnorm=1.0), _bytes(1)),
    "Ftrl": (lambda: tfclip.rules.Ftrl(1e-9), lambda: keras.optimizers.Ftrl(1e-9, global_clipnorm=1.0), _bytes(2)),
    "Lamb": (lambda: tfclip.rules.Lamb(1e-9), lambda: keras.optimizers.Lamb(1e-9, global_clipnorm=1.0),
             LAMB_BYTES),
    "ScheduleFreeAdamW": (lambda: tfclip.rules.ScheduleFreeAdamW(1e-9),
                          lambda: keras.optimizers.ScheduleFreeAdamW(1e-9, global_clipnorm=1.0), _bytes(2)),
}


def rules_table(args, rng):
    """Every rule on the BERT-base set: tfclip against its own floor (its bytes per parameter) and
    against the stock Keras optimizer (global_clipnorm=1.0) in tf.function, the whole call. One
    rule at a time (its slots, and the stock optimizer's, freed after), each interleaved with
    the floor copy and its harness."""
    shapes, variables, grads = make_set("bert_base", rng)
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params): each rule's clip(global 1.0) + apply step, tfclip against"
          f" its own floor (the 32 B/param copy's median, scaled by the rule's bytes) and against stock"
          f" Keras in tf.function (whole calls)")
    print(f"{'rule':<21} {'B/param':>7} {'ms/call':>8} {'net ms':>8} {'floor ms':>9} {'x floor':>8} "
          f"{'Keras ms':>9} {'x Keras':>8}")
    only = set(args.rules.split(",")) if args.rules else None
    for label, (make_rule, make_stock, nbytes) in RULES.items():
        if only and label not in only:
            continue
        rule, stock = make_rule(), make_stock()
        stock.build(variables)

        @tf.function
        def fused():
            return tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied

        fused()  # creates the slots, so the harness can capture them too

        @tf.function
        def harness():
            return consume([v.handle for v in list(variables) + rule.variables[1:]] + list(grads))

        @tf.function
        def keras_step():
            stock.apply_gradients(zip(grads, variables))

        r = interleaved_medians({"fused": fused, "harness": harness, "keras": keras_step,
                                 "floor": floor_copy(n)}, args.repeats)
        floor = r["floor"] * nbytes / BYTES_PER_PARAM
        net = r["fused"] - r["harness"]
        print(f"{label:<21} {nbytes:7d} {r['fused'] * 1e3:8.2f} {net * 1e3:8.2f} {floor * 1e3:9.2f} "
              f"{net / floor:8.2f} {r['keras'] * 1e3:9.2f} {r['fused'] / r['keras']:8.2f}", flush=True)
        del rule, stock, fused, harness, keras_step


# TF1-only rules (tf.compat.v1.train classes with no Keras counterpart): the tfclip.compat.v1
# drop-in (global_clipnorm=1.0) against the stock TF1 class with tf.clip_by_global_norm between
# the gradients and apply_gradients, the recipe TF1 code uses. Both run as TF2 runs a TF1
# optimizer's graph, in tf.function (a Session runs the same ops), with the global step
# advanced by apply_gradients. lr and the l1/l2 strengths 1e-9 (the l1 branch runs; the weights
# stay where they are). AdagradDA's bytes count the variable's read: its update overwrites the
# variable from the slots, but the store brings the line in anyway (write-allocate), as the
# floor copy's stores do.
TF1_RULES = {
    "ProximalGradientDescent": (lambda m, gs, kw: m.ProximalGradientDescentOptimizer(
        1e-9, l1_regularization_strength=1e-9, l2_regularization_strength=1e-9, **kw), _bytes(0)),
    "ProximalAdagrad": (lambda m, gs, kw: m.ProximalAdagradOptimizer(
        1e-9, l1_regularization_strength=1e-9, l2_regularization_strength=1e-9, **kw), _bytes(1)),
    "AdagradDA": (lambda m, gs, kw: m.AdagradDAOptimizer(
        1e-9, gs, l1_regularization_strength=1e-9, l2_regularization_strength=1e-9, **kw), _bytes(2)),
}


def tf1_table(args, rng):
    """The TF1-only rules on the BERT-base set: tfclip.compat.v1 against its own floor and against
    the stock tf.compat.v1.train class (+ tf.clip_by_global_norm) in tf.function, whole calls.
    One rule at a time, interleaved with the floor copy and the harness (variables, slots, global
    step and gradients passed to a no-op)."""
    shapes, variables, grads = make_set("bert_base", rng)
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params), TF1-only optimizers: tfclip.compat.v1 (global_clipnorm=1.0) "
          f"against its floor and against the stock tf.compat.v1.train class after tf.clip_by_global_norm, "
          f"both in tf.function (whole calls)")
    print(f"{'optimizer':<24} {'B/param':>7} {'ms/call':>8} {'net ms':>8} {'floor ms':>9} {'x floor':>8} "
          f"{'stock ms':>9} {'x stock':>8}")
    only = set(args.rules.split(",")) if args.rules else None
    for label, (make, nbytes) in TF1_RULES.items():
        if only and label not in only:
            continue
        gs = tf.Variable(0, dtype=tf.int64)
        ours, stock = make(tfclip.compat.v1, gs, {"global_clipnorm": 1.0}), make(tf.compat.v1.train, gs, {})

        @tf.function
        def fused():
            ours.apply_gradients(zip(grads, variables), global_step=gs)

        @tf.function
        def stock_step():
            clipped, _ = tf.clip_by_global_norm(grads, 1.0)
            stock.apply_gradients(zip(clipped, variables), global_step=gs)

        fused()  # creates the slots, so the harness can capture them too
        slots = [ours.get_slot(v, s).handle for s in ours.get_slot_names() for v in variables]

        @tf.function
        def harness():
            return consume([v.handle for v in variables] + slots + [gs.handle] + list(grads))

        r = interleaved_medians({"fused": fused, "harness": harness, "stock": stock_step,
                                 "floor": floor_copy(n)}, args.repeats)
        floor = r["floor"] * nbytes / BYTES_PER_PARAM
        net = r["fused"] - r["harness"]
        print(f"{label:<24} {nbytes:7d} {r['fused'] * 1e3:8.2f} {net * 1e3:8.2f} {floor * 1e3:9.2f} "
              f"{net / floor:8.2f} {r['stock'] * 1e3:9.2f} {r['fused'] / r['stock']:8.2f}", flush=True)
        del ours, stock, fused, stock_step, harness, slots


def adaptive_table(args, rng):
    """The adaptive clips on the BERT-base set with Adam, whole tf.function calls: tfclip's step
    (norm pass, threshold on the device, clip-and-apply pass) against the fixed global clip's
    fused step, the 32 B/param floor, and the same clipping written with stock TF ops."""
    from tfclip import clipping

    shapes, variables, grads = make_set("bert_base", rng)
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params), Adam: adaptive clipping fused (tfclip.clipping) against "
          "the fixed global clip's fused step, the floor, and the same clip in stock TF ops + Keras Adam "
          "(tf.function, whole calls)")
    print(f"{'clip':<10} {'ms/call':>8} {'net ms':>8} {'x floor':>8} {'x fixed':>8} {'stock ms':>9} {'x stock':>8}")
    makers = {"zclip": lambda: clipping.ZClip(warmup_steps=3), "autoclip": lambda: clipping.AutoClip(),
              "agc": lambda: clipping.AGC(clip_factor=0.01)}
    fixed_rule = tfclip.rules.Adam(1e-9)

    @tf.function
    def fixed():
        return tfclip.fused_clip_apply(zip(grads, variables), fixed_rule, global_clipnorm=1.0).applied

    fixed()

    @tf.function
    def harness():
        return consume([v.handle for v in list(variables) + fixed_rule.variables[1:]] + list(grads))

    for label, make in makers.items():
        rule, clip, stock_clip = tfclip.rules.Adam(1e-9), make(), make()
        stock = keras.optimizers.Adam(1e-9)
        stock.build(variables)
        agc = isinstance(clip, clipping.AGC)
        if not agc:
            stock_clip.build()

        @tf.function
        def fused():
            return tfclip.fused_clip_apply(zip(grads, variables), rule, clip=clip).applied

        @tf.function
        def stock_agc():
            stock.apply_gradients(zip(stock_clip.unfused(grads, variables), variables))

        @tf.function
        def stock_step():
            norm = tf.linalg.global_norm(grads)
            step = stock_clip.step(norm)
            threshold = tf.cast(tf.where(step.clipped, step.clip, tf.cast(norm, tf.float64)), tf.float32)
            clipped, _ = tf.clip_by_global_norm(grads, threshold, use_norm=norm)
            stock.apply_gradients(zip(clipped, variables))
            for v, x in step.updates:
                v.assign(x)

        r = interleaved_medians({"fused": fused, "fixed": fixed, "harness": harness,
                                 "stock": stock_agc if agc else stock_step, "floor": floor_copy(n)}, args.repeats)
        net = r["fused"] - r["harness"]
        # AGC's floor: the 32 B/param of Adam's two passes and the variable's read in the norm pass.
        floor = r["floor"] * (36 if agc else BYTES_PER_PARAM) / BYTES_PER_PARAM
        print(f"{label:<10} {r['fused'] * 1e3:8.2f} {net * 1e3:8.2f} {net / floor:8.2f} "
              f"{r['fused'] / r['fixed']:8.2f} {r['stock'] * 1e3:9.2f} {r['fused'] / r['stock']:8.2f}", flush=True)
        print(f"{'  fixed':<10} {r['fixed'] * 1e3:8.2f} {(r['fixed'] - r['harness']) * 1e3:8.2f} "
              f"{(r['fixed'] - r['harness']) / r['floor']:8.2f}", flush=True)
        del rule, clip, stock, fused, stock_step, stock_agc


def grad_dtypes_table(args, rng):
    """Float32 variables with float32, float16 and bfloat16 gradients: time per parameter."""
    shapes = SETS["bert_base"]()
    variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    base = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    fns = {}
    for label, dt in (("float32", tf.float32), ("float16", tf.float16), ("bfloat16", tf.bfloat16)):
        grads = [tf.cast(tf.constant(b), dt) for b in base]
        rule = tfclip.rules.Adam(1e-9)

        def make(grads=grads, rule=rule):
            @tf.function
            def f():
                return tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied
            return f
        fns[label] = make()
    results = interleaved_medians(fns, args.repeats)
    print(f"\nbert_base, float32 variables, Adam: gradient dtype (bytes/param: 32 for float32, 28 for 16-bit)")
    print(f"{'grads':<10} {'ms':>8} {'ns/param':>9} {'x float32':>10}")
    for label, t in results.items():
        print(f"{label:<10} {t * 1e3:8.2f} {t / n * 1e9:9.3f} {t / results['float32']:10.2f}")


# label: (rule maker, slots). Bytes per parameter of a clip(global) + apply step with float32
# variables and gradients and `slots` slot arrays of `b` bytes an element: the norm reads the
# gradient (4), the apply reads gradient and variable (8) and the slots, and writes the variable
# (4) and the slots (int8 state: a byte per element and a float32 absmax per 256).
STATE_RULES = {
    "Adam": (lambda sd: tfclip.rules.Adam(1e-9, state_dtype=sd), 2),
    "Momentum": (lambda sd: tfclip.rules.SGD(1e-9, momentum=0.9, state_dtype=sd), 1),
    "Lion": (lambda sd: tfclip.rules.Lion(1e-9, state_dtype=sd), 1),
    "RMSprop mom+centered": (lambda sd: tfclip.rules.RMSprop(1e-9, momentum=0.9, centered=True,
                                                             state_dtype=sd), 3),
}


STATE_DTYPES = ("float32", "bfloat16", "int8")
STATE_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}


def _state_bytes(slots, sd):
    return 4 + 8 + 4 + 2 * STATE_ELEM_BYTES[sd] * slots


def state_dtype_table(args, rng):
    """bfloat16 and int8 optimizer state against float32 state on the BERT-base set (float32 variables and
    gradients): each rule's step through fused_clip_apply in tf.function, and Adam through the
    Keras drop-in's apply_gradients in tf.function (the whole call as model.fit makes it), each
    against its own floor (the 32 B/param copy scaled to its bytes); the optimizer state's bytes
    per parameter, counted from the slot variables."""
    shapes, variables, grads = make_set("bert_base", rng)
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params), float32 variables: optimizer state in float32 against "
          f"bfloat16 and int8 (state_dtype=...), whole tf.function calls")
    print(f"{'step':<37} {'state':<9} {'state B/p':>9} {'B/param':>7} {'ms/call':>8} {'net ms':>8} "
          f"{'x floor':>8} {'x fp32':>7}")
    only = set(args.rules.split(",")) if args.rules else None
    for label, (make_rule, slots) in STATE_RULES.items():
        if only and label not in only:
            continue
        fns, rules = {}, {}
        for sd in STATE_DTYPES:
            rule = rules[sd] = make_rule(None if sd == "float32" else sd)

            def make(rule=rule):
                @tf.function
                def f():
                    return tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied
                return f
            fns[sd] = make()
            fns[sd]()  # the slots, so the harness captures them
        state_vars = [v for sd in STATE_DTYPES for v in rules[sd].variables[1:]]

        @tf.function
        def harness():
            return consume([v.handle for v in list(variables) + state_vars] + list(grads))

        r = interleaved_medians({**fns, "harness": harness, "floor": floor_copy(n)}, args.repeats)
        for sd in STATE_DTYPES:
            nbytes = _state_bytes(slots, sd)
            state_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in rules[sd].variables[1:]) / n
            net = r[sd] - r["harness"]
            floor = r["floor"] * nbytes / BYTES_PER_PARAM
            print(f"{'fused_clip_apply ' + label:<37} {sd:<9} {state_bytes:9.2f} {nbytes:7.1f} {r[sd] * 1e3:8.2f} "
                  f"{net * 1e3:8.2f} {net / floor:8.2f} {r[sd] / r['float32']:7.2f}", flush=True)
        del fns, rules, harness, state_vars
    # The Keras drop-ins, Adam: the step as model.fit runs it (tf_keras's too, where installed).
    drop_ins = [("tfclip.keras.Adam", lambda sd: tfclip.keras.Adam(1e-9, global_clipnorm=1.0, state_dtype=sd),
                 lambda v: v.path.endswith(("_momentum", "_velocity", "_absmax")), STATE_DTYPES)]
    try:
        tk = importlib.import_module("tfclip.tf_keras")
        drop_ins.append(("tfclip.tf_keras.Adam",
                         lambda sd: tk.Adam(1e-9, global_clipnorm=1.0, state_dtype=sd),
                         lambda v: v.name.startswith(("m/", "v/")), ("float32", "bfloat16")))
    except ImportError:
        pass
    for label, make_opt, is_slot, dtypes in drop_ins:
        opts = {sd: make_opt(None if sd == "float32" else sd) for sd in dtypes}
        fns = {}
        for sd, opt in opts.items():
            opt.build(variables)

            def make(opt=opt):
                @tf.function
                def f():
                    opt.apply_gradients(zip(grads, variables))
                return f
            fns[sd] = make()
        r = interleaved_medians({**fns, "floor": floor_copy(n)}, args.repeats)
        for sd, opt in opts.items():
            nbytes = _state_bytes(2, sd)
            slots = [v for v in opt.variables if is_slot(v)]
            state_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in slots) / n
            floor = r["floor"] * nbytes / BYTES_PER_PARAM
            print(f"{label + ' apply_gradients':<37} {sd:<9} {state_bytes:9.2f} {nbytes:7.1f} {r[sd] * 1e3:8.2f} "
                  f"{'':>8} {r[sd] / floor:8.2f} {r[sd] / r['float32']:7.2f}", flush=True)
        del opts, fns
    print("(x floor: net time over the floor for fused_clip_apply; the whole call's for Keras, which has "
          "no harness row)")


def state_tiles_table(args, rng):
    """Narrow state's tiles in each CPU variant this machine runs (csrc/core/cpu/pass_state_tiles.cc:
    AVX-512 converts 16 lanes from registers, AVX2 8 lanes (int8: with gathers), the baseline
    element by element), interleaved in one loop: the core's step (tfclip._core.clip_apply on NumPy
    arrays, no TensorFlow: set_cpu_isa reaches only the _core module, not the TF op's library) over
    32M float32 parameters, bfloat16 and int8 state against float32 state under the same variant,
    and each against the AVX2 variant's."""
    n = 32 * 1024 * 1024
    var = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    print(f"\nnarrow state's tiles by CPU variant: tfclip._core.clip_apply, {n / 2**20:.0f}M float32 parameters, "
          f"global clip 1.0")
    print(f"{'step':<22} {'variant':<9} {'ms/call':>8} {'x fp32':>7} {'x avx2':>7}")
    rules = {"Adam": ("adam", {"lr": 1e-9, "step": 1.0}, 2), "Momentum": ("momentum", {"lr": 1e-9, "momentum": 0.9}, 1)}
    dtypes = ("float32", "bfloat16", "int8")
    old = _core.cpu_isa()
    try:
        for label, (rule, hp, k) in rules.items():
            fns = {}
            for isa in _core.cpu_isas():
                for sd in dtypes:
                    absmax = None
                    if sd == "int8":
                        slots = [[np.full(n, 127, np.uint8)] for _ in range(k)]
                        absmax = [[np.zeros(-(-n // 256), np.float32)] for _ in range(k)]
                    else:
                        slots = [[np.zeros(n, ml_dtypes.bfloat16 if sd == "bfloat16" else np.float32)] for _ in range(k)]

                    def f(isa=isa, slots=slots, absmax=absmax):
                        _core.set_cpu_isa(isa)
                        _core.clip_apply(rule, [var], [grad], slots, hp, clip_mode="global_norm", clip=1.0,
                                         absmax=absmax)
                    fns[(isa, sd)] = f
            r = interleaved_medians(fns, args.repeats)
            for isa in _core.cpu_isas():
                for sd in dtypes:
                    ab = r[(isa, sd)] / r[("avx2", sd)] if ("avx2", sd) in r else float("nan")
                    print(f"{label + ' ' + sd:<22} {isa:<9} {r[(isa, sd)] * 1e3:8.2f} "
                          f"{r[(isa, sd)] / r[(isa, 'float32')]:7.2f} {ab:7.2f}", flush=True)
    finally:
        _core.set_cpu_isa(old)


def stream_in_place(n_elems, dtype, threads=None):
    """a += b over two arrays of n_elems, split over all cores: reads a and b, writes a, whose
    lines were just read, as the step writes only lines it has read. What the bus gives a pass
    like the step's, for elements of this width."""
    threads = threads or os.cpu_count() or 1
    a, b = np.ones(n_elems, dtype), np.ones(n_elems, dtype)
    bounds = [(i * n_elems // threads, (i + 1) * n_elems // threads) for i in range(threads)]

    def run():
        ts = [threading.Thread(target=np.add, args=(a[lo:hi], b[lo:hi]), kwargs={"out": a[lo:hi]})
              for lo, hi in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run, 3 * n_elems * np.dtype(dtype).itemsize


def op_vs_core_table(args, rng):
    """The TF op against the core on the same step, interleaved in one loop: one float32 tensor of
    110M parameters (a step touches 1.3 to 1.8 GB, past this machine's 480 MB L3; each stream
    880 MB), global clip 1.0, Adam and SGD momentum with
    float32 and bfloat16 state; the whole tf.function call of fused_clip_apply, and
    tfclip._core.clip_apply on NumPy arrays (the same kernels on the core's own threads, the same
    pages: _numpy_pages_as_tf). Each
    step's bytes over its time, beside an in-place stream's (stream_in_place: float32 and 16-bit
    elements) and the copy's: what the bus gives two cores, and whether fewer bytes are less time."""
    n = 110_000_000
    print(f"\nthe TF op and the core, the same step: one float32 tensor of {n / 1e6:.0f}M parameters, global clip 1.0")
    print(f"{'step':<37} {'state':<9} {'B/param':>7} {'ms/call':>8} {'GB/s':>6} {'x core':>7}")
    var0 = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    grad0 = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    g = tf.constant(grad0)
    rules = {"Adam": ("adam", {"lr": 1e-9, "step": 1.0}, 2, lambda sd: tfclip.rules.Adam(1e-9, state_dtype=sd)),
             "SGD momentum": ("keras_momentum", {"lr": 1e-9, "momentum": 0.9}, 1,
                              lambda sd: tfclip.rules.SGD(1e-9, momentum=0.9, state_dtype=sd))}
    fns, nbytes = {}, {}
    for label, (core_rule, hp, k, make) in rules.items():
        for sd in ("float32", "bfloat16"):
            v = tf.Variable(var0)
            rule = make(sd)
            fns[(label, sd, "op")] = tf.function(lambda v=v, rule=rule: tfclip.fused_clip_apply([(g, v)], rule,
                                                                                              global_clipnorm=1.0))
            cv = var0.copy()
            slots = [[np.zeros(n, ml_dtypes.bfloat16 if sd == "bfloat16" else np.float32)] for _ in range(k)]
            fns[(label, sd, "core")] = (lambda cv=cv, slots=slots, core_rule=core_rule, hp=hp:
                                        _core.clip_apply(core_rule, [cv], [grad0], slots, hp,
                                                         clip_mode="global_norm", clip=1.0))
            nbytes[(label, sd)] = n * (16 + 2 * k * (4 if sd == "float32" else 2))
    streams = {}
    for dt in (np.float32, np.uint16):  # the same bytes: twice the 16-bit elements
        streams[("stream", np.dtype(dt).name)] = stream_in_place(n * 4 // np.dtype(dt).itemsize, dt)
    copy = floor_copy(n)
    r = interleaved_medians({**fns, **{key: fn for key, (fn, _) in streams.items()}, "copy": copy}, args.repeats)
    for label in rules:
        for sd in ("float32", "bfloat16"):
            b = nbytes[(label, sd)]
            for where in ("op", "core"):
                t = r[(label, sd, where)]
                name = f"{label}, {'TF op in tf.function' if where == 'op' else 'core (_core.clip_apply)'}"
                print(f"{name:<37} {sd:<9} {b / n:7.0f} {t * 1e3:8.2f} {b / t / 1e9:6.1f} "
                      f"{t / r[(label, sd, 'core')]:7.2f}", flush=True)
    for key, (_, b) in streams.items():
        print(f"{'in-place stream a += b':<37} {key[1]:<9} {'':>7} {r[key] * 1e3:8.2f} {b / r[key] / 1e9:6.1f}")
    print(f"{'copy (the floor of the tables above)':<37} {'float32':<9} {'':>7} {r['copy'] * 1e3:8.2f} "
          f"{BYTES_PER_PARAM * n / r['copy'] / 1e9:6.1f}  (counted as {BYTES_PER_PARAM} B/param)")


def loss_scale_table(args, rng):
    """mixed_float16's loss scaling around tfclip's Adam on the BERT-base set (float32 variables
    and loss-scaled float32 gradients, global clip 1.0), the whole tf.function call `opt.apply`
    as model.fit makes it: the stock wrapper (IsFinite over every gradient, g / scale written,
    then the fused step) against tfclip's (the unscale and the check inside the step's two
    passes), and the bare tfclip Adam without loss scaling as the step's own cost. Keras 3 only:
    tf_keras's wrappers unscale in compute_gradients, outside an apply call."""
    shapes, variables, grads = make_set("bert_base", rng)
    n = sum(int(np.prod(s)) for s in shapes)
    scaled = [g * 2.0 ** 15 for g in grads]
    print(f"\nbert_base ({n / 1e6:.1f}M params): loss scaling (mixed_float16's dynamic scale 2^15) around "
          f"tfclip.keras.Adam(global_clipnorm=1.0), whole tf.function calls of opt.apply")
    print(f"{'step':<58} {'ms/call':>8} {'x bare':>7} {'x floor':>8}")
    opts = {
        "keras.optimizers.LossScaleOptimizer(tfclip Adam)": keras.optimizers.LossScaleOptimizer(
            tfclip.keras.Adam(1e-9, global_clipnorm=1.0)),
        "tfclip.keras.LossScaleOptimizer(tfclip Adam)": tfclip.keras.LossScaleOptimizer(
            tfclip.keras.Adam(1e-9, global_clipnorm=1.0)),
        "tfclip.keras.Adam, no loss scaling (bare)": tfclip.keras.Adam(1e-9, global_clipnorm=1.0),
    }
    fns = {}
    for label, opt in opts.items():
        opt.build(variables)
        g = grads if "bare" in label else scaled

        def make(opt=opt, g=g):
            @tf.function
            def f():
                opt.apply(g, variables)
            return f
        fns[label] = make()
    r = interleaved_medians({**fns, "floor": floor_copy(n)}, args.repeats)
    bare = r["tfclip.keras.Adam, no loss scaling (bare)"]
    for label in opts:
        print(f"{label:<58} {r[label] * 1e3:8.2f} {r[label] / bare:7.2f} {r[label] / r['floor']:8.2f}", flush=True)
    print("(x floor: against the 32 B/param copy; the stock wrapper adds a read of every gradient (its "
          "IsFinite) and a read and a write (g / scale): 12 B/param more)")


BF16 = ml_dtypes.bfloat16


def rounding_table(args, rng):
    """Pure-bfloat16 training's step on the BERT-base set: bf16 variables (and so bf16 slots)
    and bf16 gradients, Adam with global_clipnorm=1.0, whole tf.function calls of opt.apply:
    tfclip.keras.Adam rounding to nearest, the same with stochastic_rounding=True (a
    Philox4x32-10 draw per element), and stock keras.optimizers.Adam."""
    shapes = SETS["bert_base"]()
    variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32).astype(BF16)) for s in shapes]
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32).astype(BF16)) for s in shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params), bfloat16 variables, slots and gradients: Adam, global "
          f"clip 1.0, whole tf.function calls of opt.apply")
    print(f"{'step':<58} {'ms/call':>8} {'x nearest':>10} {'x floor':>8}")
    opts = {
        "tfclip.keras.Adam (round to nearest)": tfclip.keras.Adam(1e-9, global_clipnorm=1.0),
        "tfclip.keras.Adam(stochastic_rounding=True)": tfclip.keras.Adam(1e-9, global_clipnorm=1.0,
                                                                        stochastic_rounding=True),
        "keras.optimizers.Adam (stock)": keras.optimizers.Adam(1e-9, global_clipnorm=1.0),
    }
    fns = {}
    for label, opt in opts.items():
        opt.build(variables)

        def make(opt=opt):
            @tf.function
            def f():
                opt.apply(grads, variables)
            return f
        fns[label] = make()
    # The floor: 16 B/param (the gradient read twice, variable and two slots read and written,
    # 2 bytes each): half the 32 B/param copy.
    r = interleaved_medians({**fns, "floor": floor_copy(n // 2)}, args.repeats)
    near = r["tfclip.keras.Adam (round to nearest)"]
    for label in opts:
        print(f"{label:<58} {r[label] * 1e3:8.2f} {r[label] / near:10.2f} {r[label] / r['floor']:8.2f}",
              flush=True)
    print("(x floor: against a copy moving 16 B/param, the bf16 step's bytes)")


def apply_step(opt, grads, variables, jit=False):
    """A Keras optimizer's whole step as a user runs it: one tf.function call of opt.apply."""
    @tf.function(jit_compile=jit)
    def f():
        opt.apply(grads, variables)
    return f


def adafactor_table(args, rng):
    """Adafactor on the BERT-base set, float32, global_clipnorm=1.0, whole tf.function calls of
    opt.apply (and jit_compile=True): tfclip.keras.Adafactor (stock layout: the full `velocity`
    written every step), with factored_state=True (no full velocity), and stock
    keras.optimizers.Adafactor; the optimizer's bytes per parameter for each. The floor is the
    fused step's own bytes (csrc/core/factored.h): per parameter of a factored matrix 4 (norm)
    + 8 (g, w: row/column sums, rms(w)) + 4 (g: rms(u)) + 12 (g, w read, w written) + 4 (the full
    v written) = 32 B, 28 without the full v."""
    shapes = SETS["bert_base"]()
    variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nbert_base ({n / 1e6:.1f}M params), float32: Adafactor, global clip 1.0, whole tf.function calls "
          f"of opt.apply")
    print(f"{'step':<52} {'ms/call':>8} {'x stock':>8} {'x floor':>8} {'state B/param':>14}")
    opts = {
        "tfclip.keras.Adafactor": (tfclip.keras.Adafactor(1e-9, global_clipnorm=1.0), 32, False),
        "tfclip.keras.Adafactor(factored_state=True)": (
            tfclip.keras.Adafactor(1e-9, global_clipnorm=1.0, factored_state=True), 28, False),
        "keras.optimizers.Adafactor (stock)": (keras.optimizers.Adafactor(1e-9, global_clipnorm=1.0), None, False),
    }
    if args.jit:
        opts.update({
            "tfclip.keras.Adafactor, jit_compile": (tfclip.keras.Adafactor(1e-9, global_clipnorm=1.0), 32, True),
            "keras.optimizers.Adafactor (stock), jit_compile": (
                keras.optimizers.Adafactor(1e-9, global_clipnorm=1.0), None, True),
        })
    fns, state = {}, {}
    for label, (opt, _, jit) in opts.items():
        opt.build(variables)
        state[label] = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in opt.variables
                           if "iteration" not in v.name and "learning_rate" not in v.name) / n
        fns[label] = apply_step(opt, grads, variables, jit)
    r = interleaved_medians({**fns, "floor32": floor_copy(n), "floor28": floor_copy(n * 28 // 32)}, args.repeats)
    stock = r["keras.optimizers.Adafactor (stock)"]
    for label, (_, floor, _) in opts.items():
        fl = f"{r[label] / r[f'floor{floor}']:8.2f}" if floor else f"{'':>8}"
        print(f"{label:<52} {r[label] * 1e3:8.2f} {r[label] / stock:8.2f} {fl} {state[label]:14.3f}", flush=True)
    print("(x floor: against a copy moving the step's own bytes, 32 or 28 B/param; state: the optimizer's "
          "variables but its counter and learning rate, bytes per model parameter)")


def bert_layers(layers):
    """BERT-base's embeddings and `layers` of its transformer layers (bert_base_like has 12)."""
    h, ff = 768, 3072
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (h, ff), (ff,), (ff, h), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def muon_table(args, rng):
    """Muon on BERT-base's shapes (`--muon-layers` transformer layers: each has four (768, 768)
    matrices and a (768, 3072) with a (3072, 768), so two shape batches whatever the depth; the
    three embeddings take AdamW, as stock's exclude_embeddings), float32, global_clipnorm=1.0,
    whole tf.function calls of opt.apply: tfclip.keras.Muon and stock keras.optimizers.Muon
    (and jit_compile=True with --jit). Beside them, the Newton–Schulz chains alone on the same
    matrices, per matrix (stock's, and tfclip's on the CPU) and batched by shape (tfclip's on a
    GPU): the share of the step that is matrix products."""
    import keras

    from tfclip.keras import _muon

    shapes = bert_layers(args.muon_layers)
    variables = [keras.Variable(rng.standard_normal(s, dtype=np.float32) * 0.02,
                                name=("embedding" if k < 3 else "w") + str(k)) for k, s in enumerate(shapes)]
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    mats = [g for g, s in zip(grads, shapes) if len(s) == 2][3:]  # (the embeddings are AdamW's)
    print(f"\nBERT-base shapes, {args.muon_layers} layers ({n / 1e6:.1f}M params, {len(mats)} Muon matrices), "
          f"float32: Muon, global clip 1.0, whole tf.function calls of opt.apply")
    print(f"{'step':<52} {'ms/call':>9} {'x stock':>8}")
    ref = keras.optimizers.Muon()
    opts = {"tfclip.keras.Muon": (tfclip.keras.Muon(1e-9, global_clipnorm=1.0), False),
            "keras.optimizers.Muon (stock)": (keras.optimizers.Muon(1e-9, global_clipnorm=1.0), False)}
    if args.jit:
        opts.update({"tfclip.keras.Muon, jit_compile": (tfclip.keras.Muon(1e-9, global_clipnorm=1.0), True),
                     "keras.optimizers.Muon (stock), jit_compile": (
                         keras.optimizers.Muon(1e-9, global_clipnorm=1.0), True)})
    fns, ops = {}, {}
    for label, (opt, jit) in opts.items():
        opt.build(variables)
        fns[label] = apply_step(opt, grads, variables, jit)
        if not jit:  # the ops a step runs (a GPU's launches, near enough), library functions included
            g = fns[label].get_concrete_function().graph.as_graph_def()
            ops[label] = len(g.node) + sum(len(f.node_def) for f in g.library.function)

    @tf.function
    def ns_batched():
        return _muon.orthogonalize(mats, lambda x: ref.zeropower_via_newtonschulz5(x, 5))

    @tf.function
    def ns_per_matrix():
        return [ref.zeropower_via_newtonschulz5(x, 5) for x in mats]

    fns["Newton-Schulz alone, per matrix (stock; tfclip, CPU)"] = ns_per_matrix
    fns["Newton-Schulz alone, batched by shape (tfclip, GPU)"] = ns_batched
    r = interleaved_medians(fns, args.repeats)
    stock = r["keras.optimizers.Muon (stock)"]
    for label, t in r.items():
        print(f"{label:<52} {t * 1e3:9.1f} {t / stock:8.2f}", flush=True)
    alone = r["Newton-Schulz alone, per matrix (stock; tfclip, CPU)"]
    print(f"(the Newton-Schulz chains alone: {alone / r['tfclip.keras.Muon']:.0%} of tfclip's step, {alone / stock:.0%} "
          f"of stock's; tfclip batches them only on a GPU, where a step is launch-bound: on this CPU the "
          f"batched chains take {r['Newton-Schulz alone, batched by shape (tfclip, GPU)'] / alone:.2f}x the per-matrix ones)")
    print("(ops in the traced step, a GPU's kernel launches near enough: "
          + ", ".join(f"{label} {k}" for label, k in ops.items()) + ")")


def overhead_table(args, rng):
    """The fixed cost of one call with 200 variables of 4 elements (kernel time ~0).

    TF itself pays for every op input, eagerly (dispatch, ~0.7 us per resource handle and
    ~0.45 us per tensor here) and in a `tf.function` (the call's captures). So each row is set
    against TF's cheapest op, `consume` (a no-op), timed in the same rounds; a difference is
    the median of the per-round differences. Eagerly tfclip passes each handle list packed
    (one input per list, see csrc/tf/resources.h), so its eager call is set against two no-ops: over
    the 800 tensors a per-variable op must take (variables, m, v, gradients), and over the 200
    gradients alone, which any op that consumes them takes. In a `tf.function` the captures
    are the same for every method (the model's step captures the variables anyway). Eager and
    `tf.function` rows are timed as two groups, each round in a shuffled order: a 200-op eager
    loop run next to a `tf.function` call added up to 50 us to its difference."""
    variables = [tf.Variable(rng.standard_normal(4, dtype=np.float32)) for _ in range(200)]
    grads = [tf.constant(rng.standard_normal(4, dtype=np.float32)) for _ in range(200)]
    rule = tfclip.rules.Adam(1e-9)
    pairs = list(zip(grads, variables))
    tfclip.fused_clip_apply(pairs, rule, global_clipnorm=1.0)  # slots
    ops = tfclip._loader.ops()
    handles = [v.handle for v in variables]
    m = [rule.slots(v)["m"].handle for v in variables]
    s = [rule.slots(v)["v"].handle for v in variables]
    pack = lambda hs: [tf.raw_ops.Pack(values=hs, axis=0)]  # noqa: E731
    packed = dict(var=pack(handles), m=pack(m), v=pack(s))
    inputs = handles + m + s + grads
    f64 = lambda x: tf.constant(x, tf.float64)  # noqa: E731
    hp = dict(lr=f64(1e-9), beta_1=f64(0.9), beta_2=f64(0.999), epsilon=f64(1e-7),
              weight_decay=f64(0.0), step=f64(1.0), beta_1_power=f64(float("nan")),
              beta_2_power=f64(float("nan")), clip=f64(1.0), use_norm=f64(0.0))

    def raw_op(var, m, v):
        return ops.tfclip_clip_apply_adam(var=var, m=m, v=v, vhat=[], grad=grads, indices=[],
                                          iterations=[], absmax=[], grad_scale=[], rounding=[], clip_mode="global_norm", **hp)

    @tf.function
    def in_function():
        return tfclip.fused_clip_apply(pairs, rule, global_clipnorm=1.0).applied

    @tf.function
    def harness():
        return consume(inputs)

    step = tf.Variable(1.0, dtype=tf.float32)

    @tf.function
    def resource_apply_adam():
        for v, mv, vv, g in zip(variables, m, s, grads):
            tf.raw_ops.ResourceApplyAdam(var=v.handle, m=mv, v=vv, beta1_power=0.9, beta2_power=0.999,
                                         lr=1e-9, beta1=0.9, beta2=0.999, epsilon=1e-7, grad=g)
        return step.read_value()

    eager = {"eager fused_clip_apply (Python + op)": lambda: tfclip.fused_clip_apply(pairs, rule, global_clipnorm=1.0),
             "eager op, packed handle lists": lambda: raw_op(**packed),
             "eager op, one input per handle": lambda: raw_op(handles, m, s),
             "eager no-op, 800 tensors [TF]": lambda: consume(inputs),
             "eager no-op, 200 gradients [TF]": lambda: consume(grads)}
    graph = {"tf.function fused_clip_apply": in_function,
             "tf.function, 200 ResourceApplyAdam [TF]": resource_apply_adam,
             "tf.function no-op, same captures [TF]": harness}
    rounds = max(args.repeats, 501)
    times = {**interleaved_times(eager, rounds, shuffle=True), **interleaved_times(graph, rounds, shuffle=True)}
    # The same eager calls under TF's direct dispatch. TF 2.21 runs every eager op as a
    # one-op function (run_eager_op_as_function is always on) and charges that per input; the
    # older direct path, switched on here for this one-threaded measurement only (a private
    # switch tfclip never touches), shows how much of an eager call that wrapping is.
    direct_rows = ("eager fused_clip_apply (Python + op)", "eager op, packed handle lists",
                   "eager no-op, 200 gradients [TF]")
    direct = _direct_dispatch_times({f"{k}, direct dispatch": eager[k] for k in direct_rows}, rounds)
    eager800, eager200 = times["eager no-op, 800 tensors [TF]"], times["eager no-op, 200 gradients [TF]"]
    graph = times["tf.function no-op, same captures [TF]"]
    beyond = lambda t, base: f"{np.median(t - base) * 1e6:.1f}"  # noqa: E731
    print("\n200 variables x 4 elements, Adam, global clip: fixed cost per call, median of "
          f"{len(graph)} interleaved rounds ([TF]: TF's own, for scale); 'beyond': the median "
          "of per-round differences against TF's no-op over the 800 tensors, the 200 "
          "gradients, or the tf.function's captures")
    print(f"{'':40} {'us/call':>9} {'beyond 800':>11} {'beyond 200':>11} {'beyond capt.':>13}")
    for label, t in times.items():
        if "no-op" in label:
            cols = ("", "", "")
        elif label.startswith("eager"):
            cols = (beyond(t, eager800), beyond(t, eager200), "")
        else:
            cols = ("", "", beyond(t, graph))
        print(f"{label:<40} {np.median(t) * 1e6:9.1f} {cols[0]:>11} {cols[1]:>11} {cols[2]:>13}".rstrip())
    ours = np.median(times["tf.function fused_clip_apply"] - graph)
    theirs = np.median(times["tf.function, 200 ResourceApplyAdam [TF]"] - graph)
    print(f"tf.function: tfclip's cost beyond the captures is {ours / theirs:.2f}x TF's own "
          "per-variable update's (a ratio that holds while the machine's speed wanders)")
    if direct:
        print("\nThe same eager calls with TF's direct dispatch instead of its one-op function "
              "wrapping (measurement only)")
        base = direct["eager no-op, 200 gradients [TF], direct dispatch"]
        for label, t in direct.items():
            col = "" if "no-op" in label else f"{np.median(t - base) * 1e6:.1f}"
            print(f"{label:<58} {np.median(t) * 1e6:9.1f} {col:>11}".rstrip())


def _direct_dispatch_times(fns, rounds):
    """interleaved_times with TF's eager op-as-function wrapping switched off, then back on;
    {} where this TF has no such switch."""
    try:
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import context

        switch = pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction
        handle = context.context()._handle
    except (ImportError, AttributeError):
        return {}
    switch(handle, False)
    try:
        return interleaved_times(fns, rounds, shuffle=True)
    finally:
        switch(handle, True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rules", default="", help="rules and tf1 tables: only these labels (comma-separated)")
    p.add_argument("--extras", default="rules,tf1,adaptive,grad_dtypes,overhead,state_dtype,loss_scale,rounding,"
                   "adafactor", help="comma list of rules, tf1, adaptive, grad_dtypes, overhead, state_dtype, state_tiles, "
                   "op_vs_core, loss_scale, rounding, adafactor, muon (or empty)")
    p.add_argument("--jit", action="store_true", help="adafactor, muon: also jit_compile=True steps")
    p.add_argument("--muon-layers", type=int, default=2, help="muon: BERT-base transformer layers (12: all)")
    args = p.parse_args(argv)

    isa = tfclip._core.cpu_isa()
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores, tfclip CPU kernels: {isa}; "
          f"floor = {BYTES_PER_PARAM} B/param moved by a multi-threaded copy timed in the same loop\n")
    rng = np.random.default_rng(0)
    if args.sets:
        main_table(args, rng)
    extras = [e for e in args.extras.split(",") if e]
    if "rules" in extras:
        rules_table(args, rng)
    if "tf1" in extras:
        tf1_table(args, rng)
    if "adaptive" in extras:
        adaptive_table(args, rng)
    if "grad_dtypes" in extras:
        grad_dtypes_table(args, rng)
    if "overhead" in extras:
        overhead_table(args, rng)
    if "state_dtype" in extras:
        state_dtype_table(args, rng)
    if "state_tiles" in extras:
        state_tiles_table(args, rng)
    if "op_vs_core" in extras:
        op_vs_core_table(args, rng)
    if "loss_scale" in extras:
        loss_scale_table(args, rng)
    if "rounding" in extras:
        rounding_table(args, rng)
    if "adafactor" in extras:
        adafactor_table(args, rng)
    if "muon" in extras:
        muon_table(args, rng)


if __name__ == "__main__":
    main()
