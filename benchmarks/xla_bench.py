"""CPU speed of one clip(global 1.0) + Adam step under XLA (`tf.function(jit_compile=True)`):
tfclip's XLA kernels (custom calls into the fused core, csrc/xla) against stock Keras Adam under
XLA and against tfclip's step without XLA.

    python benchmarks/xla_bench.py [--sets resnet50,bert_base,small2000] [--repeats 7]
                                   [--compile-vars 4000] [--no-compile]

Main table: median ms per call of each method, calls interleaved (benchmarks/cpu_bench.py's
sets and harness), and each method's time over tfclip-with-XLA's, all in one run (the machine is
shared and noisy: compare ratios within a run). Methods:
  tfclip fused_clip_apply, XLA     tf.function(jit_compile=True) around tfclip.fused_clip_apply
  tfclip fused_clip_apply, no XLA  the same tf.function without jit_compile (the TF op)
  Keras Adam(global_clipnorm), XLA the stock optimizer's apply_gradients, jit-compiled
  tfclip.keras.Adam, XLA           the Keras drop-in's apply_gradients under jit_compile (the
                                   whole Keras step, as model.fit runs it: its fused op compiles
                                   to tfclip's custom calls)
  tfclip.keras.Adam, no XLA        the same Keras step in a plain tf.function (the TF op)
  XLA launch, same captures        a jit-compiled function that only reads one element of every
                                   variable, slot and gradient the step captures: TF's fixed cost
                                   of launching an XLA cluster with that many resource inputs,
                                   which every XLA method above pays (at 2,000 variables most of
                                   the XLA step)
Then the first call (trace + compile + one step) at --compile-vars small variables, tfclip under
XLA (fused_clip_apply, and the Keras drop-in) against stock Keras Adam under XLA. `--sets ""`
runs only that (the check on each TF version, docs/install.md).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tfclip  # noqa: E402
import tfclip.keras  # noqa: E402
from cpu_bench import SETS, interleaved_medians, make_set  # noqa: E402

LR = 1e-9  # keep weights where they are; the speed does not depend on it


def contestants(variables, grads):
    rule_x = tfclip.rules.Adam(LR)
    rule_n = tfclip.rules.Adam(LR)

    def fused(rule):
        return lambda: tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied

    k_xla = keras.optimizers.Adam(LR, global_clipnorm=1.0)
    k_xla.build(variables)
    t_keras = tfclip.keras.Adam(LR, global_clipnorm=1.0)
    t_keras.build(variables)
    t_keras_n = tfclip.keras.Adam(LR, global_clipnorm=1.0)
    t_keras_n.build(variables)

    captured = list(variables) + [s for v in variables for s in rule_x.slots(v).values()]

    def launch():
        return tf.add_n([tf.reshape(v, [-1])[0] for v in captured] +
                        [tf.reshape(g, [-1])[0] for g in grads])

    return {
        "tfclip fused_clip_apply, XLA": tf.function(fused(rule_x), jit_compile=True),
        "tfclip fused_clip_apply, no XLA": tf.function(fused(rule_n)),
        "Keras Adam(global_clipnorm), XLA": tf.function(
            lambda: k_xla.apply_gradients(zip(grads, variables)), jit_compile=True),
        "tfclip.keras.Adam, XLA": tf.function(
            lambda: t_keras.apply_gradients(zip(grads, variables)), jit_compile=True),
        "tfclip.keras.Adam, no XLA": tf.function(
            lambda: t_keras_n.apply_gradients(zip(grads, variables))),
        "XLA launch, same captures": tf.function(launch, jit_compile=True),
    }


def main_table(args, rng):
    header = f"{'set':<10} {'params':>7} {'tensors':>7}  {'method':<34} {'ms/call':>8} {'x tfclip XLA':>13}"
    print(header)
    print("-" * len(header))
    for name in args.sets.split(","):
        shapes, variables, grads = make_set(name, rng)
        n = sum(int(np.prod(s)) for s in shapes)
        results = interleaved_medians(contestants(variables, grads), args.repeats)
        base = results["tfclip fused_clip_apply, XLA"]
        for k, t in results.items():
            print(f"{name:<10} {n / 1e6:>6.1f}M {len(shapes):>7}  {k:<34} {t * 1e3:>8.2f} {t / base:>13.2f}")
        print()
        del variables, grads


def first_call(make_fn):
    t0 = time.perf_counter()
    make_fn()()
    return time.perf_counter() - t0


def compile_times(args, rng):
    n = args.compile_vars
    shapes = [(16 + (i % 5),) for i in range(n)]

    def tfclip_xla():
        variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        rule = tfclip.rules.Adam(LR)
        return tf.function(lambda: tfclip.fused_clip_apply(zip(grads, variables), rule,
                                                           global_clipnorm=1.0).applied,
                           jit_compile=True)

    def keras_step(cls):
        def make():
            variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
            grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
            opt = cls(LR, global_clipnorm=1.0)
            opt.build(variables)
            return tf.function(lambda: opt.apply_gradients(zip(grads, variables)), jit_compile=True)
        return make

    print(f"first call (trace + XLA compile + one step), {n} variables:")
    methods = [("tfclip fused_clip_apply, XLA", tfclip_xla),
               ("tfclip.keras.Adam, XLA", keras_step(tfclip.keras.Adam)),
               ("Keras Adam(global_clipnorm), XLA", keras_step(keras.optimizers.Adam))]
    if args.no_stock_compile:
        methods = methods[:2]
    for name, mk in methods:
        print(f"  {name:<34} {first_call(mk):>7.1f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="resnet50,bert_base,small2000")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compile-vars", type=int, default=4000)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-stock-compile", action="store_true",
                   help="leave stock Keras out of the first-call table (minutes at 4,000 variables)")
    args = p.parse_args()
    print(f"TF {tf.__version__}, keras {keras.__version__}, {os.cpu_count()} CPUs")
    rng = np.random.default_rng(0)
    if args.sets:
        main_table(args, rng)
    if not args.no_compile:
        compile_times(args, rng)


if __name__ == "__main__":
    main()
