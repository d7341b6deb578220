"""One clip(global 1.0) + optimizer step on the GPU: tfclip (through _core) against PyTorch.

    python benchmarks/gpu_bench.py [--sets bert_base,bert_large,small2000,one_tensor]
                                   [--rules adam,adamw,sgdm] [--grad-dtypes float32,bfloat16]
                                   [--iters 50] [--profile] [--clip global|agc]

Needs PyTorch (CUDA) and a tfclip._core built with CUDA; no TensorFlow. Tensors are PyTorch
CUDA tensors; tfclip reads them through __cuda_array_interface__ on PyTorch's current stream,
so both contenders run on the same memory and stream.

For each set it reports, in one run:
  - the device-to-device copy bandwidth (bytes read + written), measured now;
  - tfclip's step time, its achieved bandwidth at the floor's byte count (4 B/param to read the
    gradient for the norm + read grad/var/slots + write var/slots) and that as % of the copy;
  - kernel launches per step (tfclip counts its own; with --profile also as PyTorch's profiler
    (CUPTI) sees them on the device, with their names, for tfclip's step and PyTorch's);
  - PyTorch's clip_grad_norm_(foreach=True) + optimizer(fused=True) on the same tensors, and the
    ratio torch_time / tfclip_time (> 1: tfclip is faster);
  - each side's host time to issue a step (no wait): near the step's time, the step is bound by
    the host (Python, argument parsing, launches), not by the kernels; with --profile, also the
    kernels' summed time on the device. tfclip's arrays are handed over with their
    __cuda_array_interface__ read once (Frozen): PyTorch rebuilds that dict in Python per access.
With --clip agc the step clips unit-wise (AGC, clip factor 0.01, eps 1e-3: clip_mode="agc"),
whose floor adds one read of each variable (4 B/param) in the norm pass; PyTorch's side is the
same AGC written with its stock ops (per-unit norms of grad and weight with torch.linalg.
vector_norm, a torch.where scale, in-place multiply) before the fused optimizer: PyTorch has no
AGC of its own.
Times are medians of CUDA-event-timed loops of --iters steps. Compare ratios within one run.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from core_loader import load_core  # noqa: E402 (tfclip._core, without importing TensorFlow)
from gpu_sets import SETS  # noqa: E402
from timing import wall_time  # noqa: E402

_core = load_core()

# rule: (tfclip rule, slots, hparams, bytes of var+slots traffic per param at fp32 beyond the grad)
RULES = {
    "adam": ("adam", 2, {"lr": 1e-3}),
    "adamw": ("adam", 2, {"lr": 1e-3, "weight_decay": 0.01}),
    "sgdm": ("keras_momentum", 1, {"lr": 1e-2, "momentum": 0.9}),
}
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def floor_bytes(nparams, nslots, grad_bytes, clip="global"):
    # norm read of grad + apply read of grad + read/write var and each slot (fp32); AGC's norm
    # pass also reads the variable (its unit norms)
    return nparams * (2 * grad_bytes + 2 * 4 * (1 + nslots) + (4 if clip == "agc" else 0))


def torch_agc_(params, clip_factor=0.01, eps=1e-3):
    """AGC in stock PyTorch ops, unfused: each unit's gradient (the norm over all axes but the
    last; the whole tensor for rank <= 1) scaled to clip * max(||w_unit||, eps) when above it."""
    for p in params:
        g = p.grad
        dims = tuple(range(p.dim() - 1)) if p.dim() > 1 else None
        gn = torch.linalg.vector_norm(g, dim=dims, keepdim=p.dim() > 1)
        wn = torch.linalg.vector_norm(p.detach(), dim=dims, keepdim=p.dim() > 1).clamp_min(eps)
        bound = clip_factor * wn
        g.mul_(torch.where(gn > bound, bound / gn.clamp_min(1e-6), torch.ones_like(gn)))


def time_loop(fn, iters, repeats=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def profiled_kernels(fn):
    """The kernels one call of fn runs on the device, as CUPTI records them (copies and memsets
    left out): an independent count of launches per step, and their summed time there."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    # Each kernel's time on the device, in microseconds (device_time; cuda_time before torch 2.4).
    busy = sum(float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0) for e in kernels)
    return [e.name for e in kernels], busy


def short(names):
    counts = {}
    for n in names:
        k = n.split("(")[0].split("<")[0].split("::")[-1][:40]
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())


def copy_bandwidth(nbytes=2 << 30, iters=20):
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = time_loop(lambda: b.copy_(a), iters)
    return 2 * nbytes / t


def as_cai(t):
    """bfloat16 torch tensors go to _core as int16 views (no bf16 in __cuda_array_interface__)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


class Frozen:
    """A tensor's __cuda_array_interface__, read once. PyTorch builds that dict in Python on
    every access (microseconds each): thousands of tensors a step made the harness, not the
    step, the time (an H100, 2026-11-26: small2000 took 47 ms a step). A TF user's step passes
    tensors to the op directly and pays neither."""

    def __init__(self, t):
        self.__cuda_array_interface__ = as_cai(t).__cuda_array_interface__
        self._keep = t


def issue_time(fn, iters):
    """Seconds the host takes to issue one step (no wait on the device): where it is near the
    step's time, the step is host-bound."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters


def bench_jax(name, rule_name, grad_dtype, iters, t_core_wall, t_torch_wall, fb, copy_bw, profile_kernels):
    """tfclip's XLA handler and optax, each under jax.jit on the same GPU, this set."""
    try:
        import jax
        import jax_contenders
    except ImportError as e:
        return f"\n    jax: not run ({e})"
    lines = []
    t = {}
    for which in ("xla", "optax"):  # each on its own: one failing leaves the other's figure
        try:
            c = jax_contenders.contenders(_core, SETS[name](), rule_name, grad_dtype, jax.devices("cuda")[0],
                                          which=(which,))
            step, wait, t_compile = c[which]
            t[which] = wall_time(step, wait, iters)
        except Exception as e:
            lines.append(f"\n    jax.jit {which:<5} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        k = which
        prof = ""
        if profile_kernels:
            try:
                names, busy = profiled_kernels(lambda: (step(), wait()))
                prof = f"; {len(names)} kernels [{short(names)}], {busy / 1e3:.3f} ms on the device"
            except Exception as e:
                prof = f"; profile failed: {type(e).__name__}: {e}"
        lines.append(f"\n    jax.jit {k:<5} {t[k] * 1e3:8.3f} ms wall ({100 * fb / t[k] / copy_bw:5.1f}% of copy; "
                     f"compile {t_compile:.1f} s){prof}")
        del c, step, wait
    if "xla" in t:
        lines.append(f"\n    XLA handler / _core (wall) {t['xla'] / t_core_wall:5.2f}x")
    if "optax" in t:
        lines.append(f"; optax / tfclip _core (wall) {t['optax'] / t_core_wall:5.2f}x")
        if "xla" in t:
            lines.append(f"; optax / tfclip XLA handler {t['optax'] / t['xla']:5.2f}x")
    lines.append(f"; torch / tfclip _core (wall) {t_torch_wall / t_core_wall:5.2f}x")
    return "".join(lines)


def bench_set(name, rule_name, grad_dtype, iters, copy_bw, profile_kernels=False, clip="global", with_jax=True):
    shapes = SETS[name]()
    core_rule, nslots, hp = RULES[rule_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=gen).to(TORCH_DTYPE[grad_dtype]) for s in shapes]
    slots = [[torch.zeros_like(p) for p in params] for _ in range(nslots)]
    nparams = sum(p.numel() for p in params)
    stream = torch.cuda.current_stream()
    norm_out = torch.zeros((1,), dtype=torch.float32, device="cuda")
    applied_out = torch.zeros((1,), dtype=torch.bool, device="cuda")
    g_cai = [Frozen(g) for g in grads]
    p_cai = [Frozen(p) for p in params]
    s_cai = [[Frozen(x) for x in sl] for sl in slots]
    # As a Keras step on a GPU has them: the learning rate and the step counter in device memory
    # (a schedule's value, `iterations`), read by the step itself; nothing waits on the host.
    h = {k: Frozen(torch.tensor([v], dtype=torch.float64, device="cuda")) for k, v in hp.items()}
    counter = Frozen(torch.zeros((1,), dtype=torch.int64, device="cuda"))
    norm_out, applied_out = Frozen(norm_out), Frozen(applied_out)
    if core_rule == "adam":
        h["step"] = 1.0  # t = iterations + 1

    def tfclip_step():
        _core.cuda_clip_apply(core_rule, p_cai, g_cai, s_cai, h,
                              "agc" if clip == "agc" else "global_norm", 0.01 if clip == "agc" else 1.0,
                              iterations=counter, norm_out=norm_out, applied_out=applied_out,
                              stream=stream)

    t_tfclip = time_loop(tfclip_step, iters)
    launches = _core.cuda_last_launches()
    t_issue = issue_time(tfclip_step, iters)
    t_tfclip_wall = wall_time(tfclip_step, torch.cuda.synchronize, iters)

    # PyTorch on copies of the same data (its optimizer owns its own state).
    tparams = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(tparams, grads):
        p.grad = g.to(torch.float32) if grad_dtype != "float32" else g.clone()
    if rule_name == "adam":
        opt = torch.optim.Adam(tparams, lr=1e-3, fused=True)
    elif rule_name == "adamw":
        opt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.01, fused=True)
    else:
        opt = torch.optim.SGD(tparams, lr=1e-2, momentum=0.9, fused=True)

    def torch_step():
        if clip == "agc":
            torch_agc_(tparams)
        else:
            torch.nn.utils.clip_grad_norm_(tparams, 1.0, foreach=True)
        opt.step()

    t_torch = time_loop(torch_step, iters)
    t_torch_issue = issue_time(torch_step, iters)
    t_torch_wall = wall_time(torch_step, torch.cuda.synchronize, iters)
    prof = ""
    if profile_kernels:
        try:
            (kt, dt), (kp, dp) = profiled_kernels(tfclip_step), profiled_kernels(torch_step)
            prof = (f"\n    profile: tfclip {len(kt)} kernels [{short(kt)}], {dt / 1e3:.3f} ms on the device; "
                    f"torch {len(kp)} kernels [{short(kp)}], {dp / 1e3:.3f} ms on the device")
        except Exception as e:  # the timing above stands without it
            prof = f"\n    profile failed: {type(e).__name__}: {e}"
    fb = floor_bytes(nparams, nslots, torch.tensor([], dtype=TORCH_DTYPE[grad_dtype]).element_size(), clip)
    bw = fb / t_tfclip
    note = "" if grad_dtype == "float32" else " (torch: grads upcast to fp32 first, not timed)"
    jax_part = ""
    if with_jax and clip == "global":
        del opt, tparams
        torch.cuda.empty_cache()
        jax_part = bench_jax(name, rule_name, grad_dtype, iters, t_tfclip_wall, t_torch_wall, fb, copy_bw,
                             profile_kernels)
    return (f"{name:<11} {rule_name + ('+agc' if clip == 'agc' else ''):<10} {grad_dtype:<8} {nparams / 1e6:8.1f}M {len(shapes):6d}  "
            f"{t_tfclip * 1e3:8.3f} ms  {bw / 1e9:7.0f} GB/s  {100 * bw / copy_bw:5.1f}% of copy  "
            f"{launches} launches  torch {t_torch * 1e3:8.3f} ms  torch/tfclip {t_torch / t_tfclip:5.2f}x{note}"
            f"\n    host time to issue a step: tfclip {t_issue * 1e3:.3f} ms, torch {t_torch_issue * 1e3:.3f} ms "
            f"(near the step's time: host-bound){prof}"
            f"\n    wall per step: tfclip _core {t_tfclip_wall * 1e3:.3f} ms, torch {t_torch_wall * 1e3:.3f} ms{jax_part}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="bert_base,bert_large,small2000,one_tensor")
    ap.add_argument("--rules", default="adam")
    ap.add_argument("--grad-dtypes", default="float32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--clip", choices=["global", "agc"], default="global",
                    help="global: clip by the global norm 1.0; agc: unit-wise AGC (factor 0.01)")
    ap.add_argument("--no-jax", action="store_true", help="leave out tfclip's XLA handler and optax under jax.jit")
    ap.add_argument("--profile", action="store_true",
                    help="also count each step's kernels with PyTorch's profiler (CUPTI)")
    args = ap.parse_args(argv)
    if not _core.cuda:
        sys.exit("tfclip._core was built without CUDA")
    dev = _core.cuda_device()
    copy_bw = copy_bandwidth()
    print(f"# {dev['name']} (sm_{dev['compute_capability'][0]}{dev['compute_capability'][1]}), "
          f"torch {torch.__version__}; device-to-device copy {copy_bw / 1e9:.0f} GB/s (read+write)")
    print("# set        rule       grads      params tensors  tfclip step   achieved  vs copy         launches  PyTorch")
    for rule in args.rules.split(","):
        for gd in args.grad_dtypes.split(","):
            for s in args.sets.split(","):
                print(bench_set(s, rule, gd, args.iters, copy_bw, args.profile, args.clip, not args.no_jax), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
