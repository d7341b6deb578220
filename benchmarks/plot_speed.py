"""The README's speed chart, from committed benchmark results: each method's step time as a ratio to
its memory floor (1.0 = moving the step's bytes at copy speed; lower is faster).

    python benchmarks/plot_speed.py --cpu benchmarks/results/cpu-2026-11-22c.txt \\
        [--gpu benchmarks/results/gpu-<date>-<kind>.txt] --out docs/speed.png

--cpu: a `cpu_bench.py` run (its main table: tfclip against the TF paths, "x floor" from the net
time; with `--extras state_dtype`, a second panel: BERT-base's Adam step with bfloat16 and int8
optimizer state as a multiple of the float32-state step, its "x fp32"). --gpu: a `gpu_bench.py` run (tfclip's "% of copy", so x floor = 100 / %, and PyTorch's
fused clip_grad_norm_ + Adam as torch/tfclip times that). Needs matplotlib (`pip install
".[plot]"`).
"""
import argparse
import re


def read_cpu(path):
    """{set: [(method, x floor)]} from cpu_bench's main table (the first table in the file)."""
    out, current = {}, None
    for line in open(path):
        if line.startswith("bert_base (") or line.startswith("200 variables"):
            break  # the extras' tables
        m = re.match(r"^(\S+)\s+[\d.]+M\s+\d+\s+(.+?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m:
            current = m.group(1)
            out.setdefault(current, []).append((m.group(2), float(m.group(5))))
            continue
        m = re.match(r"^\s{20,}(\S.+?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m and current and not m.group(1).startswith(("harness", "floor")):
            out[current].append((m.group(1), float(m.group(4))))
    return out


def read_state(path):
    """{step: [(state dtype, x fp32)]} from cpu_bench's state_dtype table (Adam rows), or {}."""
    out, inside = {}, False
    for line in open(path):
        if "optimizer state in float32 against" in line:
            inside = True
            continue
        if inside and not line.strip():
            break
        m = re.match(r"^(fused_clip_apply Adam|tfclip\.keras\.Adam apply_gradients)\s+(float32|bfloat16|int8)\s.*?"
                     r"([\d.]+)\s*$", line) if inside else None
        if m:
            step = "fused_clip_apply" if m.group(1).startswith("fused") else "tfclip.keras.Adam"
            out.setdefault(step, []).append((m.group(2) + " state", float(m.group(3))))
    return out


def read_gpu(path):
    """{set: [("tfclip", x floor), ("PyTorch fused", x floor)]} from gpu_bench's fp32 Adam rows."""
    out = {}
    for line in open(path):
        m = re.match(r"^(\S+)\s+adam\s+float32\s.*?([\d.]+)% of copy.*torch/tfclip\s+([\d.]+)x", line)
        if m:
            x = 100.0 / float(m.group(2))
            out[m.group(1)] = [("tfclip (CUDA)", x), ("PyTorch fused clip + Adam", x * float(m.group(3)))]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", required=True)
    p.add_argument("--gpu")
    p.add_argument("--out", default="docs/speed.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("CPU (TensorFlow, fp32 Adam, global clip)", read_cpu(args.cpu),
               "step time / memory floor (lower is faster)")]
    state = read_state(args.cpu)
    if state:
        panels.append(("CPU, BERT-base Adam: optimizer state dtype", state,
                       "step time / float32 state's step (lower is faster)"))
    if args.gpu:
        panels.append(("GPU (fp32 Adam, global clip)", read_gpu(args.gpu), "step time / memory floor (lower is faster)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 4.5), squeeze=False)
    for ax, (title, data, ylabel) in zip(axes[0], panels):
        sets = list(data)
        methods = list(dict.fromkeys(m for rows in data.values() for m, _ in rows))
        width = 0.8 / len(methods)
        for k, method in enumerate(methods):
            vals = [dict(data[s]).get(method, np.nan) for s in sets]
            bars = ax.bar(np.arange(len(sets)) + k * width, vals, width, label=method)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(np.arange(len(sets)) + 0.4 - width / 2, sets)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
