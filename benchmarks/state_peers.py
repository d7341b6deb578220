"""Narrow optimizer state against its peers on this CPU (issue 69, item 4): tfclip with float32,
bfloat16 and int8 state beside PyTorch's fused optimizers (float32 state) and bitsandbytes' 8-bit
optimizers on the CPU (its CPU backend), the same clip (by the global norm, 1.0) and the same
parameters, every call interleaved in one loop, medians.

    python benchmarks/state_peers.py [--sets bert_base,resnet50] [--rules Adam,Momentum] [--repeats 7]

Needs torch and bitsandbytes beside tfclip (`pip install torch bitsandbytes`); a missing one's
rows say so. The steps, each the whole call as a user makes it:
- tfclip: `fused_clip_apply(zip(grads, vars), tfclip.rules.Adam(state_dtype=...), global_clipnorm=1.0)`
  in `tf.function` (Momentum: `tfclip.rules.SGD(momentum=0.9)`).
- PyTorch: `torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)` then `torch.optim.Adam(
  params, fused=True).step()` (Momentum: `torch.optim.SGD(momentum=0.9, fused=True)`).
- bitsandbytes: the same clip, then `bnb.optim.Adam8bit(params).step()` (Momentum: `SGD8bit`),
  its blockwise 8-bit state (the same definition as tfclip's int8 state, Dettmers et al. 2022).
Each row: ms per call, x tfclip's float32-state step, and x the byte floor of its own state (the
32 B/param multi-threaded copy of cpu_bench.py, timed in the same loop, scaled to the bytes the
step must move: 16 B/param for the variable, the gradient read twice, plus each slot read and
written at its width; PyTorch's clip also writes the gradient back, which its floor leaves out).
"""
import argparse
import os
import sys

import numpy as np

try:  # (before TensorFlow: importing torch's optimizers after TF 2.21 crashed the process, SIGSEGV in
    import torch  # noqa: F401  # torch._dynamo's import, torch 2.14)
    import torch._dynamo  # noqa: F401
except ImportError:
    pass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_bench import SETS, floor_copy, interleaved_medians  # noqa: E402

import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402

BYTES_PER_PARAM = 32  # floor_copy's
SLOT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}
RULES = {"Adam": 2, "Momentum": 1}


def _floor_bytes(rule, sd):
    return 16 + 2 * SLOT_BYTES[sd] * RULES[rule]


def _tfclip_steps(rule, variables, grads):
    fns = {}
    for sd in SLOT_BYTES:
        kw = {} if sd == "float32" else {"state_dtype": sd}
        r = tfclip.rules.Adam(1e-9, **kw) if rule == "Adam" else tfclip.rules.SGD(1e-9, momentum=0.9, **kw)

        def make(r=r):
            @tf.function
            def f():
                return tfclip.fused_clip_apply(zip(grads, variables), r, global_clipnorm=1.0).applied
            return f
        fns[f"tfclip, {sd} state"] = make()
    return fns


def _torch_steps(rule, arrays, grad_arrays):
    out = {}
    try:
        import torch
    except ImportError:
        print("(torch is not installed: no PyTorch or bitsandbytes rows)")
        return out, None
    torch.set_num_threads(os.cpu_count() or 1)

    def params():
        ps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in arrays]
        for p, g in zip(ps, grad_arrays):
            p.grad = torch.from_numpy(g.copy())
        return ps

    def stepper(ps, opt):
        def f():
            torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            opt.step()
        return f

    ps = params()
    opt = (torch.optim.Adam(ps, lr=1e-9, fused=True) if rule == "Adam"
           else torch.optim.SGD(ps, lr=1e-9, momentum=0.9, fused=True))
    out[f"PyTorch {torch.__version__} fused, float32 state"] = stepper(ps, opt)
    versions = f"torch {torch.__version__}"
    try:
        import bitsandbytes as bnb
        ps8 = params()
        opt8 = (bnb.optim.Adam8bit(ps8, lr=1e-9) if rule == "Adam"
                else bnb.optim.SGD8bit(ps8, lr=1e-9, momentum=0.9))
        out[f"bitsandbytes {bnb.__version__} 8-bit, int8 state"] = stepper(ps8, opt8)
        versions += f", bitsandbytes {bnb.__version__}"
    except ImportError:
        print("(bitsandbytes is not installed: no bitsandbytes rows)")
    return out, versions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="bert_base,resnet50")
    p.add_argument("--rules", default="Adam,Momentum")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    from tfclip import _core

    print(f"TensorFlow {tf.__version__}, tfclip CPU kernels: {_core.cpu_isa()} (python -m tfclip.info says "
          f"which CPU), {os.cpu_count()} cores")
    rng = np.random.default_rng(0)
    for name in args.sets.split(","):
        shapes = SETS[name]()
        arrays = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for s in shapes]
        grad_arrays = [rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3) for s in shapes]
        n = sum(a.size for a in arrays)
        variables = [tf.Variable(a) for a in arrays]
        grads = [tf.constant(g) for g in grad_arrays]
        for rule in args.rules.split(","):
            fns = _tfclip_steps(rule, variables, grads)
            peers, versions = _torch_steps(rule, arrays, grad_arrays)
            fns.update(peers)
            r = interleaved_medians({**fns, "floor": floor_copy(n)}, args.repeats)
            print(f"\n{name} ({n / 1e6:.1f}M params, {len(shapes)} tensors), {rule}, clip by global norm 1.0"
                  + (f" ({versions})" if versions else ""))
            print(f"{'step':<46} {'B/param':>7} {'ms/call':>8} {'x tfclip fp32':>13} {'x its floor':>11}")
            base = r["tfclip, float32 state"]
            for k in fns:
                sd = "int8" if "int8" in k else "bfloat16" if "bfloat16" in k else "float32"
                nbytes = _floor_bytes(rule, sd)
                floor = r["floor"] * nbytes / BYTES_PER_PARAM
                print(f"{k:<46} {nbytes:7.1f} {r[k] * 1e3:8.2f} {r[k] / base:13.2f} {r[k] / floor:11.2f}",
                      flush=True)
            del fns, peers


if __name__ == "__main__":
    main()
