"""Low-precision optimizer state on the GPU (issue 47): tfclip's clip(global 1.0) + optimizer step
with float32, bfloat16 and int8 state (`state_dtype=`), the same set, rule and gradients, in one
interleaved loop.

    python benchmarks/gpu_state_bench.py [--sets bert_base,small2000] [--rules adam,sgdm]
                                         [--states float32,bfloat16,int8] [--iters 20]

Needs a tfclip._core built with CUDA; no TensorFlow and no PyTorch. Arrays come from
tests/gpu/gpu_arrays.py (CuPy or PyTorch on a GPU, _core's own device memory on the emulated
build, where `--sets tiny` is this script's CPU proof: tests/gpu/test_gpu_state_bench.py).

Before timing, each state's first two steps are checked against the core's CPU steps on the same
arrays (tfclip._core.clip_apply), bit for bit: the variables, the slots (int8: codes and absmax),
both clipped by the CPU's global norm (use_norm), so the device's own summation order is not in
the comparison (tests/gpu checks its norm). Then, per set and rule, for each state dtype:
  - the wall-clock step (issue and wait; the hyper-parameters and step counter in device memory,
    as a Keras step on a GPU has them, so nothing waits on the host) and the device's time by
    CUDA events (CuPy or PyTorch), each with its ratio to float32 state's step in the same loop
    (issue 47's targets: int8 <= 0.7x, bfloat16 <= 0.8x; where the wall clock is far above the
    device time the host's issue, not the state, sets it);
  - the floor: bytes per parameter a step must move (the gradient twice, the variable read and
    written, each slot read and written at the state's width, int8's absmax per 256 elements),
    and the step's bandwidth at that byte count as % of a device-to-device copy (CuPy or PyTorch
    where present);
  - "x floor": the step's time over float32 state's time scaled by the bytes (issue 47's target
    for int8: <= 1.25x); kernel launches per step.
Compare ratios within one run.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu"))
from gpu_arrays import BF16, Frozen, core, dev, to_dev, to_host  # noqa: E402 (the array backend)
from gpu_sets import SETS  # noqa: E402
from timing import wall_time  # noqa: E402

# rule: (tfclip rule, slots, hyper-parameters, which slots are unsigned: int8's code per slot)
RULES = {
    "adam": ("adam", 2, {"lr": 1e-3}, (False, True)),
    "sgdm": ("keras_momentum", 1, {"lr": 1e-2, "momentum": 0.9}, (False,)),
}
ZERO_CODE = {False: 127, True: 0}
DEVICE_TIME_FAILED = []  # the index of 0.0 in the signed and the unsigned code (csrc/core/quant8.h)
STATE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / 256}  # per slot element (int8: + absmax)
QUANT_BLOCK = 256


def floor_bytes(nparams, nslots, state):
    """Bytes a step moves at the least: the gradient read twice (norm, apply), the variable read
    and written, each slot read and written at the state's width."""
    return nparams * (2 * 4 + 2 * 4 + 2 * nslots * STATE_BYTES[state])


def copy_bandwidth(nbytes=1 << 30, iters=20):
    """Bytes read + written per second by a device-to-device copy, where CuPy or PyTorch is."""
    if dev.name == "cupy":
        a = dev.cp.empty(nbytes // 4, dtype=np.float32)
        b = dev.cp.empty_like(a)
        t = wall_time(lambda: b.__setitem__(Ellipsis, a), dev.synchronize, iters)
    elif dev.name == "torch":
        a = dev.torch.empty(nbytes // 4, dtype=dev.torch.float32, device="cuda")
        b = dev.torch.empty_like(a)
        t = wall_time(lambda: b.copy_(a), dev.synchronize, iters)
    else:
        return None
    return 2 * nbytes / t


def initial_state(shapes, unsigned, state):
    """Zero state for every variable, as a tfclip optimizer builds it: (slots, absmax); int8: each
    slot's code of 0.0 under absmax 0."""
    if state == "int8":
        slots = [[np.full(s, ZERO_CODE[u], np.uint8) for s in shapes] for u in unsigned]
        absmax = [[np.zeros(-(-int(np.prod(s)) // QUANT_BLOCK), np.float32) for s in shapes] for _ in unsigned]
        return slots, absmax
    dt = BF16 if state == "bfloat16" else np.float32
    return [[np.zeros(s, dt) for s in shapes] for _ in unsigned], None


def device_time(step, iters):
    """Seconds per step on the device (CUDA events around `iters` steps), where the array library
    has events (CuPy, PyTorch): beside the wall clock, it tells a step bound by its kernels from
    one bound by the host's issue (many small tensors). None on the emulated build."""
    if dev.name == "cupy":
        cp = dev.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        timed = lambda a, b: cp.cuda.get_elapsed_time(a, b)  # noqa: E731
    elif dev.name == "torch":
        start, end = dev.torch.cuda.Event(enable_timing=True), dev.torch.cuda.Event(enable_timing=True)
        timed = lambda a, b: a.elapsed_time(b)  # noqa: E731
    else:
        return None
    try:
        dev.synchronize()
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        return timed(start, end) / 1e3 / iters
    except Exception as e:  # noqa: BLE001 - the wall clock stands without it; say why once
        if not DEVICE_TIME_FAILED:
            DEVICE_TIME_FAILED.append(f"{type(e).__name__}: {e}")
            print(f"# device time not measured: {DEVICE_TIME_FAILED[0]}", flush=True)
        return None


def bench_set(name, rule_name, states, iters, copy_bw):
    shapes = SETS[name]()
    core_rule, nslots, hp, unsigned = RULES[rule_name]
    host_hp = dict(hp, step=1.0) if core_rule == "adam" else dict(hp)
    rng = np.random.default_rng(0)
    var0 = [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)) for s in shapes]
    grads_h = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    nparams = sum(v.size for v in var0)
    grads = [to_dev(g) for g in grads_h]
    steps = {}
    for state in states:
        slots_h, absmax_h = initial_state(shapes, unsigned, state)
        var = [to_dev(v) for v in var0]
        slots = [[to_dev(x) for x in sl] for sl in slots_h]
        absmax = None if absmax_h is None else [[to_dev(a) for a in sl] for sl in absmax_h]
        # The check: two steps here and the core's CPU steps on copies of the same arrays (the
        # second reads the state the first wrote), bit for bit. Both clip by the same given norm
        # (use_norm, the CPU's): the device's norm pass sums in another order, and a clip factor
        # one ulp apart would round some bfloat16 slots or int8 codes the other way.
        v_cpu = [v.copy() for v in var0]
        norm = core.global_norm(grads_h)
        for _ in range(2):
            core.clip_apply(core_rule, v_cpu, grads_h, slots_h, host_hp, "global_norm", 1.0, use_norm=norm,
                            absmax=absmax_h)
            core.cuda_clip_apply(core_rule, var, grads, slots, host_hp, "global_norm", 1.0, use_norm=norm,
                                 absmax=absmax)
        what = f"{name} {rule_name} {state} state, after two steps"
        for k, (got, want) in enumerate(zip(var, v_cpu)):
            np.testing.assert_array_equal(to_host(got, np.float32).view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{what}: variable {k}")
        wire = {"float32": np.uint32, "bfloat16": np.uint16, "int8": np.uint8}[state]
        for j, (sl_d, sl_h) in enumerate(zip(slots, slots_h)):
            for k, (got, want) in enumerate(zip(sl_d, sl_h)):
                np.testing.assert_array_equal(to_host(got, wire).view(wire), want.view(wire),
                                              err_msg=f"{what}: slot {j} of variable {k}")
        for j, (am_d, am_h) in enumerate(zip(absmax or [], absmax_h or [])):
            for k, (got, want) in enumerate(zip(am_d, am_h)):
                np.testing.assert_array_equal(to_host(got, np.float32), want, err_msg=f"{what}: absmax {j} of variable {k}")
        # The timed step: hyper-parameters and the step counter in device memory, device outputs;
        # every array's interface read once (Frozen), so the loop times the step, not the harness.
        h = {k: Frozen(to_dev(np.array([v], np.float64))) for k, v in hp.items()}
        if core_rule == "adam":
            h["step"] = 1.0  # t = iterations + 1
        counter = Frozen(to_dev(np.zeros(1, np.int64)))
        norm_out, applied_out = Frozen(to_dev(np.zeros(1, np.float32))), Frozen(to_dev(np.zeros(1, np.bool_)))
        fvar, fgrads = [Frozen(x) for x in var], [Frozen(x) for x in grads]
        fslots = [[Frozen(x) for x in sl] for sl in slots]
        fabsmax = None if absmax is None else [[Frozen(a) for a in sl] for sl in absmax]

        def step(var=fvar, slots=fslots, absmax=fabsmax, h=h, counter=counter, norm_out=norm_out,
                 applied_out=applied_out):
            core.cuda_clip_apply(core_rule, var, fgrads, slots, h, "global_norm", 1.0, iterations=counter,
                                 norm_out=norm_out, applied_out=applied_out, absmax=absmax)

        step()
        steps[state] = (step, core.cuda_last_launches())
    # One loop for all states in turn, repeated: a drift of the machine's clocks meets every state.
    times = {s: [] for s in states}
    dtimes = {s: [] for s in states}
    for _ in range(3):
        for s in states:
            times[s].append(wall_time(steps[s][0], dev.synchronize, iters))
            dtimes[s].append(device_time(steps[s][0], iters))
    t = {s: float(np.median(v)) for s, v in times.items()}
    td = {s: None if None in v else float(np.median(v)) for s, v in dtimes.items()}
    rows = []
    ref = "float32" if "float32" in t else None
    for s in states:
        fb = floor_bytes(nparams, nslots, s)
        vs_copy = f"{100 * fb / t[s] / copy_bw:6.1f}%" if copy_bw else "    n/a"
        x32 = f"{t[s] / t[ref]:6.2f}" if ref else "   n/a"
        x_floor = f"{t[s] / (t[ref] * fb / floor_bytes(nparams, nslots, ref)):6.2f}" if ref else "   n/a"
        dev_ms = f"{td[s] * 1e3:9.3f}" if td[s] is not None else "      n/a"
        dx32 = f"{td[s] / td[ref]:6.2f}" if ref and td[s] is not None else "   n/a"
        rows.append(f"{name:<10} {rule_name:<5} {s:<9} {nparams / 1e6:8.3f}M {len(shapes):5d} {t[s] * 1e3:9.3f} "
                    f"{x32} {dev_ms} {dx32} {fb / nparams:7.2f} {fb / t[s] / 1e9:7.0f} {vs_copy} {x_floor} "
                    f"{steps[s][1]:5d}  yes")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="bert_base,small2000")
    ap.add_argument("--rules", default="adam,sgdm")
    ap.add_argument("--states", default="float32,bfloat16,int8")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    states = args.states.split(",")
    for s in states:
        if s not in STATE_BYTES:
            ap.error(f"--states: {s!r} is not one of {', '.join(STATE_BYTES)}")
    if not core.cuda:
        sys.exit("tfclip._core was built without CUDA")
    d = core.cuda_device()
    copy_bw = copy_bandwidth() if not core.cuda_emulated else None
    print(f"# {d['name']} (sm_{d['compute_capability'][0]}{d['compute_capability'][1]}"
          f"{', emulated' if core.cuda_emulated else ''}), arrays: {dev.name}; device-to-device copy "
          + (f"{copy_bw / 1e9:.0f} GB/s (read+write)" if copy_bw else "not measured"))
    print("# set        rule  state       params  tens  ms/step x fp32 device ms x fp32  B/param  GB/s  vs copy "
          "x floor launch checked")
    for rule in args.rules.split(","):
        for s in args.sets.split(","):
            for row in bench_set(s, rule, states, args.iters, copy_bw):
                print(row, flush=True)
    print("# ms/step: wall clock (issue and wait); device ms: CUDA events around the steps (n/a: no event API); "
          "x fp32: over float32 state's; GB/s, vs copy, x floor: from the wall clock; x floor: over float32 "
          "state's time scaled to this state's bytes; checked: the first two steps matched the core's CPU steps")


if __name__ == "__main__":
    main()
