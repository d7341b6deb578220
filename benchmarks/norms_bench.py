"""Do the per-tensor norms (issue 22) cost step time? The step as a user runs it, this tree against
another checkout of tfclip built without them, in alternating processes.

    python benchmarks/norms_bench.py --compare OLD_ROOT [--rounds 3] [--sets bert_base,small2000]
    python benchmarks/norms_bench.py --one [--sets ...]     # one process: this tree's figures

OLD_ROOT is a checkout with its op library built in place (e.g. `git worktree add /tmp/old
<commit>` and `cmake --build` with TFCLIP_OUTPUT_DIR=/tmp/old/tfclip). Each process times, in one
interleaved loop (cpu_bench.py's), the 32 B/param copy floor and two steps in `tf.function`:

- `fused_clip_apply(..., global_clipnorm=1.0)` with tfclip.rules.Adam (the op's own cost);
- the whole Keras step: `tfclip.keras.Adam(global_clipnorm=1.0).apply_gradients` (the op, and
  in the new tree also the optimizer's recording of tensor_norms and clip counters).

Each is reported as x floor (its median over the copy's, same loop), so the two trees compare as
ratios: processes run A B A B ..., and the table gives each tree's median x floor and new / old.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def one(sets, repeats):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, HERE)
    import cpu_bench  # noqa: E402  (puts this process's tfclip first on sys.path)
    import numpy as np
    import tensorflow as tf

    import tfclip

    out = {}
    rng = np.random.default_rng(0)
    for name in sets:
        shapes, variables, grads = cpu_bench.make_set(name, rng)
        n = sum(int(np.prod(s)) for s in shapes)
        rule = tfclip.rules.Adam(1e-9)
        opt = tfclip.keras.Adam(1e-9, global_clipnorm=1.0)
        opt.build(variables)

        @tf.function
        def fused():
            return tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0).applied

        @tf.function
        def keras_step():
            opt.apply_gradients(zip(grads, variables))

        med = cpu_bench.interleaved_medians(
            {"fused_clip_apply": fused, "keras_step": keras_step, "floor": cpu_bench.floor_copy(n)}, repeats)
        floor = med.pop("floor")
        out[name] = {k: {"ms": v * 1e3, "x_floor": v / floor} for k, v in med.items()}
        out[name]["floor_ms"] = floor * 1e3
        del variables, grads
    return out


def compare(old_root, sets, rounds, repeats):
    trees = {"new": os.path.dirname(HERE), "old": os.path.abspath(old_root)}
    runs = {k: [] for k in trees}
    for r in range(rounds):
        for label, root in trees.items():
            env = dict(os.environ, PYTHONPATH=root)
            cmd = [sys.executable, os.path.join(HERE, "norms_bench.py"), "--one", "--json",
                   "--sets", ",".join(sets), "--repeats", str(repeats)]
            # The child imports the tfclip of `root`: cpu_bench puts its parent first, so run
            # the old tree's copy of this file's helpers with the old tree first on the path.
            if label == "old":
                cmd[1] = os.path.join(root, "benchmarks", "norms_bench.py")
                if not os.path.exists(cmd[1]):
                    os.makedirs(os.path.join(root, "benchmarks"), exist_ok=True)
                    with open(__file__) as src, open(cmd[1], "w") as dst:
                        dst.write(src.read())
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {label}: " + ", ".join(
                f"{s}/{k} {runs[label][-1][s][k]['x_floor']:.3f}" for s in sets
                for k in ("fused_clip_apply", "keras_step")), flush=True)
    import statistics

    print(f"\n{'set':<10} {'step':<18} {'old x floor':>12} {'new x floor':>12} {'new / old':>10}   "
          f"(median of {rounds} processes each; floor ms new/old)")
    for s in sets:
        for k in ("fused_clip_apply", "keras_step"):
            o = statistics.median(r[s][k]["x_floor"] for r in runs["old"])
            n = statistics.median(r[s][k]["x_floor"] for r in runs["new"])
            fl = (statistics.median(r[s]["floor_ms"] for r in runs["new"]),
                  statistics.median(r[s]["floor_ms"] for r in runs["old"]))
            print(f"{s:<10} {k:<18} {o:12.3f} {n:12.3f} {n / o:10.3f}   ({fl[0]:.1f}/{fl[1]:.1f} ms)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", metavar="OLD_ROOT")
    p.add_argument("--one", action="store_true")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sets", default="bert_base,small2000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    if args.compare:
        return compare(args.compare, sets, args.rounds, args.repeats)
    res = one(sets, args.repeats)
    if args.json:
        print(json.dumps(res))
    else:
        for s, r in res.items():
            for k in ("fused_clip_apply", "keras_step"):
                print(f"{s:<10} {k:<18} {r[k]['ms']:9.2f} ms  {r[k]['x_floor']:6.3f} x floor")


if __name__ == "__main__":
    main()
