"""CUDA against CPU (and NumPy float64) through tfclip._core: every op, rule, dtype and clip mode.

No TensorFlow here. On a GPU host (CuPy or PyTorch, or _core's own allocator) this runs the real
CUDA build. In CI it runs the emulated build (scripts/cuda_emulation.sh), which compiles the very
csrc/core/*.cu sources against cuda/emulation/, so every kernel and launcher line executes there too.

The apply kernels are built without FMA contraction and run the same rule bodies in the same
order as the CPU, so with no clip (or a clip by value) they match the CPU bit for bit. The norm
sums in another order, so there the norm agrees to 1e-12 and the results to a couple of ulps.
"""
import numpy as np
import pytest

import reference
from gpu_arrays import BF16, DEVICE, EMULATED, assert_same_bits, core, dev, full, to_dev, to_host

DTYPES = {"float16": np.float16, "bfloat16": BF16, "float32": np.float32, "float64": np.float64}
CHUNK = core.cuda_chunk_elems
# Empty, scalar, odd, exactly one chunk, over one chunk (unaligned tail), and many small ones.
SHAPES = [(0,), (), (7,), (CHUNK,), (3 * CHUNK + 5,), (33, 17)] + [(i % 13 + 1,) for i in range(200)]
ULPS = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2.4e-7, "float64": 4.5e-16}
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 4e-6, "float64": 1e-12}
PRECISION = ["bfloat16", "float16", "float32", "float64"]  # low to high


def rand(rng, shape, dtype, scale=1.0):
    """A C-contiguous array of `shape` (a 0-d array for (), never a NumPy scalar)."""
    return np.array(rng.normal(size=shape) * scale, dtype=dtype, ndmin=0).reshape(shape)


def small_pos(rng, shape, dtype):
    """|N(0,1)| * 0.1 as an array of `shape` (slot values: v must be non-negative)."""
    a = rand(rng, shape, dtype)
    np.abs(a, out=a)
    a *= np.array(0.1, dtype)
    return a


def close_ulps(got, want, dtype_name, ulps=2):
    """Within `ulps` ulps of the dtype, relative, or absolute at unit scale (the values here are
    O(1); slots near cancellation, e.g. momentum accumulators, lose relative precision)."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    np.testing.assert_allclose(g, w, rtol=ULPS[dtype_name] * ulps, atol=ULPS[dtype_name] * ulps)


def assert_unwritten(after, before):
    """The buffers (bytes) are as they were. Compared here, not by `assert after == before`:
    pytest explains a failed comparison of lists of large bytes with difflib, quadratic in their
    length (a planted fault once left that running for over an hour in CI)."""
    written = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(after) == len(before) and not written, f"buffers {written} of {len(before)} were written"


def same_bits(got, want):
    assert_same_bits(got, want)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_device_is_what_the_build_says():
    assert DEVICE["name"]
    assert ("emulation" in DEVICE["name"]) == EMULATED


# ---------------------------------------------------------------- norm
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_global_norm_parity(rng, dtype):
    ts = [rand(rng, s, DTYPES[dtype]) for s in SHAPES]
    gpu = core.cuda_global_norm([to_dev(t) for t in ts])
    np.testing.assert_allclose(gpu, core.global_norm(ts), rtol=1e-12)
    np.testing.assert_allclose(gpu, reference.global_norm(ts), rtol=1e-12)


def test_global_norm_mixed_dtypes_and_device_output(rng):
    ts = [rand(rng, (1000 + i,), dt) for i, dt in enumerate(DTYPES.values())]
    out = full((1,), np.nan, np.float64)  # poisoned
    assert core.cuda_global_norm([to_dev(t) for t in ts], out=out) is None
    np.testing.assert_allclose(float(to_host(out, np.float64)[0]), core.global_norm(ts), rtol=1e-12)
    out32 = full((), np.nan, np.float32)
    core.cuda_global_norm([to_dev(t) for t in ts], out=out32)
    np.testing.assert_allclose(to_host(out32, np.float32), np.float32(core.global_norm(ts)), rtol=6e-8)


def test_norm_is_deterministic_over_10_runs(rng):
    ts = [to_dev(rand(rng, s, np.float32)) for s in [(5_000_003,), (70_001,), (3,)] + [(99,)] * 500]
    out = full((1,), 0.0, np.float64)
    bits = set()
    for _ in range(10):
        core.cuda_global_norm(ts, out=out)
        bits.add(to_host(out, np.float64).tobytes())
    assert len(bits) == 1


def test_norm_overflow_safe_and_subnormal():
    big = np.full((1000,), 3e20, dtype=np.float32)  # squares overflow float32
    np.testing.assert_allclose(core.cuda_global_norm([to_dev(big)]), float(np.float32(3e20)) * np.sqrt(1000),
                               rtol=1e-12)
    tiny = np.full((64,), 1e-40, dtype=np.float32)  # subnormal
    np.testing.assert_allclose(core.cuda_global_norm([to_dev(tiny)]), float(np.float32(1e-40)) * 8, rtol=1e-12)


def test_many_tensors_few_launches(rng):
    """10,000 tiny tensors: more chunks than one block holds, one table, three launches."""
    ts = [rand(rng, (i % 7 + 1,), np.float32) for i in range(10_000)]
    vs = [rand(rng, t.shape, np.float32) for t in ts]
    m = [np.zeros_like(v) for v in vs]
    v2 = [np.zeros_like(v) for v in vs]
    gv, gm, gv2 = [to_dev(x) for x in vs], [to_dev(x) for x in m], [to_dev(x) for x in v2]
    hp = {"learning_rate": 1e-2}
    core.cuda_clip_apply("adam", gv, [to_dev(t) for t in ts], [gm, gv2], hp, "global_norm", 1.0)
    assert core.cuda_last_launches() == 3
    core.clip_apply("adam", vs, ts, [m, v2], hp, "global_norm", 1.0)
    for g, c in zip(gv, vs):
        close_ulps(to_host(g, np.float32), c, "float32")


# ---------------------------------------------------------------- clip_by_global_norm
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clip_by_global_norm_parity(rng, dtype, clip):
    ts = [rand(rng, s, DTYPES[dtype]) for s in SHAPES]
    g_in = [to_dev(t) for t in ts]
    g_out = [full(t.shape, np.nan, DTYPES[dtype]) for t in ts]  # poisoned
    norm = core.cuda_clip_by_global_norm(g_in, g_out, clip)
    assert core.cuda_last_launches() == 3
    # The op reports the norm as float32 (TF's default) and, as TF, takes the scale from it.
    want_norm = np.float32(core.global_norm(ts))
    np.testing.assert_allclose(norm, want_norm, rtol=6e-8)
    cpu_out, _ = core.clip_by_global_norm(ts, clip, use_norm=float(want_norm))
    for g, c in zip(g_out, cpu_out):
        close_ulps(to_host(g, DTYPES[dtype]), c, dtype, ulps=1)


def test_clip_by_global_norm_given_norm(rng):
    ts = [rand(rng, s, np.float32) for s in SHAPES[:8]]
    cpu_out, _ = core.clip_by_global_norm(ts, 1.0, use_norm=4.0)
    g_out = [full(t.shape, np.nan, np.float32) for t in ts]
    norm = core.cuda_clip_by_global_norm([to_dev(t) for t in ts], g_out, 1.0, use_norm=4.0)
    assert norm == 4.0
    assert core.cuda_last_launches() == 2  # no norm pass
    for g, c in zip(g_out, cpu_out):
        same_bits(to_host(g, np.float32), c)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_clip_in_place(rng, dtype):
    """out may be the input list itself: each element is read before it is written."""
    ts = [rand(rng, s, DTYPES[dtype], 3.0) for s in [(5,), (CHUNK + 9,), (), (0,)]]
    d = [to_dev(t) for t in ts]
    core.cuda_clip_by_global_norm(d, d, 0.25, use_norm=2.0)
    cpu_out, _ = core.clip_by_global_norm(ts, 0.25, use_norm=2.0)
    for g, c in zip(d, cpu_out):
        same_bits(to_host(g, DTYPES[dtype]), c)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_16bit_value_converts_through_the_device_code(dtype):
    """All 2^16 bit patterns through the scale kernel's load and store: with scale 1 every
    non-NaN value comes back unchanged (NaN stays NaN), and with scale 0.7 every product
    rounds as NumPy / ml_dtypes round float32 (to nearest even); both bit for bit as the CPU,
    NaNs aside: a NaN's sign and payload are the hardware's (an H100's multiply returns the
    canonical NaN where x86 keeps the operand's, as TF's own GPU and CPU kernels differ), so
    there NaN is compared as NaN."""
    dt = DTYPES[dtype]
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.view(dt)
    nan = np.isnan(x.astype(np.float32))
    for clip, use_norm in [(1.0, 1.0), (0.7, 1.0)]:
        out = full(x.shape, 0, dt)
        core.cuda_clip_by_global_norm([to_dev(x)], [out], clip, use_norm=use_norm)
        got = to_host(out, dt)
        cpu, _ = core.clip_by_global_norm([x], clip, use_norm=use_norm)
        cpu = cpu[0] if isinstance(cpu, list) else cpu
        assert np.array_equal(np.isnan(cpu.astype(np.float32)), nan)
        same_bits(got[~nan], cpu[~nan])
        scale = np.float32(np.float32(clip).astype(dt))  # TF: cast(scale, dtype)
        with np.errstate(invalid="ignore"):
            want = (x.astype(np.float32) * scale).astype(dt)
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        assert np.isnan(got.astype(np.float32)[nan]).all()
        if clip == 1.0:
            assert np.array_equal(got.view(np.uint16)[~nan], bits[~nan])


# ---------------------------------------------------------------- clip + apply
RULES = {
    "sgd": ([], {"learning_rate": 0.1, "weight_decay": 0.01}),
    "momentum": (["accum"], {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "keras_momentum": (["m"], {"learning_rate": 0.1, "momentum": 0.9}),
    "adam": (["m", "v"], {"learning_rate": 0.01, "weight_decay": 0.004}),
    "amsgrad": (["m", "v", "vhat"], {"learning_rate": 0.01, "amsgrad": True}),
    "adagrad": (["accumulator"], {"learning_rate": 0.05, "epsilon": 1e-6}),
    "rmsprop": (["velocity", "momentum", "average_gradient"],
                {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5, "centered": True,
                 "has_momentum": True}),
    # epsilon_outside_sqrt: ResourceApplyAdagradV2's and tf_keras legacy RMSprop's sqrt(x) + eps
    "adagrad_eps_outside": (["accumulator"], {"learning_rate": 0.05, "epsilon": 1e-3,
                                              "epsilon_outside_sqrt": True}),
    "rmsprop_eps_outside": (["velocity", "average_gradient"],
                            {"learning_rate": 0.01, "rho": 0.8, "epsilon": 1e-3, "centered": True,
                             "epsilon_outside_sqrt": True}),
    "adadelta": (["accumulated_grad", "accumulated_delta_var"], {"learning_rate": 1.0, "rho": 0.9}),
    "adamax": (["m", "u"], {"learning_rate": 0.02, "beta_1": 0.8, "weight_decay": 0.004}),
    "lion": (["m"], {"learning_rate": 0.003, "beta_1": 0.9, "beta_2": 0.99}),
    "nadam": (["m", "v"], {"learning_rate": 0.01, "u_product": 0.3, "weight_decay": 0.004}),
    # tf_keras legacy Nadam: 0.96^(0.004 t), its own order of the same math
    "nadam_legacy": (["m", "v"], {"learning_rate": 0.01, "u_product": 0.3, "schedule_decay": 0.004,
                                  "legacy_nadam": True}),
    "ftrl": (["accumulator", "linear"], {"learning_rate": 0.05, "lr_power": -0.5, "l1": 0.001,
                                         "l2": 0.01, "l2_shrinkage": 0.01, "beta": 0.1}),
    "ftrl_sqrt": (["accumulator", "linear"], {"learning_rate": 0.05, "l1": 0.001, "l2": 0.01,
                                              "l2_shrinkage": 0.01, "beta": 0.1}),
    "tf_rmsprop": (["rms", "mom", "mg"], {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5,
                                          "centered": True}),
    "lamb": (["m", "v"], {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.004}),
    "schedule_free_adamw": (["momentum", "velocity"], {"learning_rate": 0.01, "beta_1": 0.8, "warmup_steps": 3,
                                                       "weight_decay": 0.004}),
    "proximal_gradient_descent": ([], {"learning_rate": 0.05, "l1": 0.01, "l2": 0.2}),
    "proximal_adagrad": (["accumulator"], {"learning_rate": 0.05, "l1": 0.01, "l2": 0.2}),
    "adagrad_da": (["gradient_accumulator", "gradient_squared_accumulator"],
                   {"learning_rate": 0.05, "l1": 0.02, "l2": 0.2, "global_step": 3.0}),
    # Muon's matrix halves: the momentum slot as the variable; the update of an orthogonalized o
    "muon_momentum": ([], {"momentum": 0.95}),
    "muon_update": ([], {"learning_rate": 0.02, "weight_decay": 0.004, "shape_scale": float(np.sqrt(np.float32(12))),
                         "rms_rate": 0.2}),
}
TAKES_STEP = {r for r, row in core.rule_table().items() if "step" in row["hparams"]}
MODES = {"none": 0.0, "global_norm": 1.0, "norm": 0.3, "value": 0.01}
PAIRS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
         ("float64", "float64"), ("float32", "float16"), ("float32", "bfloat16"),
         # any other float pair: clipped in the gradient's dtype, cast to the variable's (AnyGrad)
         ("float64", "float32"), ("float32", "float64"), ("float16", "float32"), ("bfloat16", "float16"),
         ("float64", "bfloat16")]


def core_rule(rule):
    return {"amsgrad": "adam", "adagrad_eps_outside": "adagrad", "rmsprop_eps_outside": "rmsprop",
            "nadam_legacy": "nadam"}.get(rule, rule)


def run_both(rng, rule, var_dtype, grad_dtype, mode, shapes, steps=2, nonfinite="skip", poison=None):
    """`steps` steps on the CPU, on the device and in NumPy float64; returns all three."""
    slot_names, hp = RULES[rule]
    vd, gd = DTYPES[var_dtype], DTYPES[grad_dtype]
    vars_c = [rand(rng, s, vd) for s in shapes]
    # Slots start positive and small; RMSprop's average_gradient at 0, as it does, so that the
    # centered denominator v - avg^2 + eps stays a variance (random slots could make it ~0).
    slots_c = [[np.zeros(s, vd) if name in ("average_gradient", "mg") else small_pos(rng, s, vd)
                for s in shapes] for name in slot_names]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    vars_r = [v.astype(np.float64) for v in vars_c]
    slots_r = [[s.astype(np.float64) for s in sl] for sl in slots_c]
    results = []
    for step in range(steps):
        grads = [rand(rng, s, gd) for s in shapes]
        if poison is not None:
            grads[poison][...] = np.inf
        h = dict(hp)
        if core_rule(rule) in TAKES_STEP:
            h["step"] = step + 1
        rc = core.clip_apply(core_rule(rule), vars_c, grads, slots_c, h, mode, MODES[mode], None, nonfinite)
        rg = core.cuda_clip_apply(core_rule(rule), vars_g, [to_dev(g) for g in grads], slots_g, h, mode,
                                  MODES[mode], None, nonfinite)
        results.append((rc, rg))
        clipped = reference.clip(grads, mode, MODES[mode])
        for i in range(len(shapes)):
            sl = [s[i] for s in slots_r]
            vars_r[i] = reference.step(core_rule(rule), vars_r[i], sl, clipped[i], h, step + 1, slot_dtype=vd)
    return vars_c, slots_c, vars_g, slots_g, vars_r, results


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("var_dtype,grad_dtype", PAIRS)
def test_apply_parity(rng, rule, mode, var_dtype, grad_dtype):
    vars_c, slots_c, vars_g, slots_g, vars_r, results = run_both(
        rng, rule, var_dtype, grad_dtype, mode, SHAPES)
    vd = DTYPES[var_dtype]
    for (nc, ac), (ng, ag) in results:
        assert ac and ag
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    # Lamb's per-tensor sums run in another order on the device (as the norm's): its ratio, and
    # so its variables, agree to a few ulps; its slots (computed before the ratio) to the bit.
    exact = mode in ("none", "value") and rule != "lamb"
    # FTRL's general power in double math: CUDA's pow (2 ulp) is not glibc's (under 1), and FTRL's
    # cancellation (linear against the l1 clip) grows that to ~50 ulp of the variables (an H100,
    # 2026-11-26: 1.2e-14 at most). Float math takes pow in double on both (rules.h): exact.
    pow_fp64 = rule == "ftrl" and var_dtype == "float64" and not EMULATED
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        g = to_host(got, vd)
        if pow_fp64:
            close_ulps(g, want, var_dtype, ulps=256)
        elif exact:
            same_bits(g, want)
        elif rule == "lamb" and var_dtype == "float64":
            # fp64 sums of 10^5 squares in two orders differ by ~1e-14 relative, and so the ratio.
            np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
        else:
            close_ulps(g, want, var_dtype, ulps=4)
    # And against NumPy float64, to the coarser of the two dtypes.
    tol = TOL[min(var_dtype, grad_dtype, key=PRECISION.index)]
    for got, want in zip(vars_g, vars_r):
        got = to_host(got, vd).astype(np.float64)
        if rule == "lion":
            # sign(m*b1 + g*(1-b1)) of a value within rounding of 0 can flip in a 16-bit dtype: such
            # an element is off by a whole 2*lr step (and only such), and there are few.
            lr2 = 2 * RULES[rule][1]["learning_rate"]
            off = ~np.isclose(got, want, rtol=tol, atol=tol)
            steps = np.abs(got - want)[off] / lr2
            assert np.allclose(steps, np.round(steps), atol=tol / lr2 + 0.01), steps
            assert off.sum() <= max(2, off.size // 5000), off.sum()
            continue
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# Low-precision state (issue 47): a float32 variable's slots as bfloat16 (SlotStorage::kBFloat16).
BF16_STATE_RULES = ["momentum", "keras_momentum", "adam", "amsgrad", "adagrad", "rmsprop", "adadelta",
                    "adamax", "lion", "nadam", "tf_rmsprop", "lamb"]


@pytest.mark.parametrize("rule", BF16_STATE_RULES)
@pytest.mark.parametrize("mode,clip", [("none", 0.0), ("value", 0.01), ("global_norm", 1.0), ("agc", 0.05)])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sparse", [False, True])
def test_bf16_state_parity(rng, rule, mode, clip, grad_dtype, sparse):
    """bfloat16 slots of float32 variables: the device kernels (dense, AGC, sparse, Lamb's trust
    pass) against the CPU driver, which tests/test_state_bf16.py checks against the float32
    step rounded. Bits where the CPU and the device take the same order (tolerances as
    test_apply_parity's otherwise); slots, rounded to bf16, then to 2 bf16 ulps."""
    slot_names, hp = RULES[rule]
    gd = DTYPES[grad_dtype]
    shapes = [(3 * CHUNK + 5,), (33, 17), (7,), ()]
    indices = None
    if sparse:
        shapes[1] = (40, 17)
        indices = [None, np.array([3, 0, 3, 39], np.int64), None, None]
    vars_c = [rand(rng, s, np.float32) for s in shapes]
    slots_c = [[np.zeros(s, BF16) if name in ("average_gradient", "mg") else small_pos(rng, s, BF16)
                for s in shapes] for name in slot_names]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    for step in range(2):
        grads = [rand(rng, (4, 17) if indices is not None and indices[i] is not None else s, gd)
                 for i, s in enumerate(shapes)]
        h = dict(hp)
        if core_rule(rule) in TAKES_STEP:
            h["step"] = step + 1
        nc, ac = core.clip_apply(core_rule(rule), vars_c, grads, slots_c, h, mode, clip, None, "skip",
                                 indices=indices)
        ng, ag = core.cuda_clip_apply(core_rule(rule), vars_g, [to_dev(g) for g in grads], slots_g, h, mode,
                                      clip, None, "skip", indices=indices)
        assert ac and ag
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    exact = mode in ("none", "value") and rule != "lamb"
    for got, want in zip(vars_g, vars_c):
        g = to_host(got, np.float32)
        if exact:
            same_bits(g, want)
        else:
            close_ulps(g, want, "float32", ulps=4)
    for sg, sc in zip(slots_g, slots_c):
        for got, want in zip(sg, sc):
            g = to_host(got, BF16)
            assert g.dtype == BF16
            if exact:
                same_bits(g, want)
            else:
                close_ulps(g, want, "bfloat16", ulps=2)


def test_misaligned_views_take_the_scalar_paths(rng):
    """Views that start one element into their buffer (x[1:]): the norm's scalar head and the
    apply kernel's scalar loop, which aligned allocations never reach."""
    for vdt, gdt in [(np.float32, np.float32), (np.float32, np.float16), (np.float64, np.float64),
                     (BF16, BF16)]:
        sizes = [CHUNK + 37, 1000, 5, 2]
        base_v = [rand(rng, (n + 1,), vdt) for n in sizes]
        base_g = [rand(rng, (n + 1,), gdt) for n in sizes]
        base_m = [np.abs(rand(rng, (n + 1,), vdt)) for n in sizes]
        base_s = [np.abs(rand(rng, (n + 1,), vdt)) for n in sizes]
        dv, dg, dm, ds = ([to_dev(a) for a in b] for b in (base_v, base_g, base_m, base_s))
        views = lambda ds_: [d[1:] for d in ds_]  # noqa: E731
        cpu = lambda bs: [b[1:].copy() for b in bs]  # noqa: E731
        g_views = cpu(base_g)
        np.testing.assert_allclose(core.cuda_global_norm(views(dg)), reference.global_norm(g_views), rtol=1e-12)
        np.testing.assert_allclose(core.cuda_global_norm(views(dg)), core.global_norm(g_views), rtol=1e-12)
        v_c, m_c, s_c = cpu(base_v), cpu(base_m), cpu(base_s)
        hp = {"learning_rate": 0.01, "step": 3}
        core.clip_apply("adam", v_c, g_views, [m_c, s_c], hp, "value", 0.5)
        core.cuda_clip_apply("adam", views(dv), views(dg), [views(dm), views(ds)], hp, "value", 0.5)
        for d, base, want in zip([*dv, *dm, *ds], [*base_v, *base_m, *base_s], [*v_c, *m_c, *s_c]):
            got = to_host(d, vdt)
            same_bits(got[1:], want)
            same_bits(got[:1], base[:1])  # the element before the view is untouched


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_nonfinite_writes_nothing(rng, nonfinite):
    shapes = [(100,), (CHUNK + 3,), (5,)]
    vars_g = [to_dev(rand(rng, s, np.float32)) for s in shapes]
    m = [to_dev(np.zeros(s, np.float32)) for s in shapes]
    v = [to_dev(np.zeros(s, np.float32)) for s in shapes]
    before = [to_host(x, np.float32).tobytes() for x in [*vars_g, *m, *v]]
    grads = [rand(rng, s, np.float32) for s in shapes]
    grads[1][7] = np.nan
    args = ("adam", vars_g, [to_dev(g) for g in grads], [m, v], {"learning_rate": 0.1}, "global_norm", 1.0,
            None, nonfinite)
    if nonfinite == "raise":
        with pytest.raises(ValueError, match="non-finite"):
            core.cuda_clip_apply(*args)
    else:
        norm, applied = core.cuda_clip_apply(*args)
        assert not applied and np.isnan(norm)
    assert_unwritten([to_host(x, np.float32).tobytes() for x in [*vars_g, *m, *v]], before)


def test_nonfinite_propagate_matches_cpu(rng):
    vars_c, _, vars_g, _, _, results = run_both(
        rng, "adam", "float32", "float32", "global_norm", [(50,), (9,)], steps=1, nonfinite="propagate", poison=1)
    (nc, ac), (ng, ag) = results[0]
    assert ac and ag and np.isinf(nc) and np.isinf(ng)
    for g, c in zip(vars_g, vars_c):
        np.testing.assert_array_equal(to_host(g, np.float32), c)  # NaN where TF gives NaN


def test_device_outputs_no_wait_on_a_stream(rng):
    """norm_out / applied_out in device memory: the call returns without waiting; the results
    are there once the step's stream is synchronized."""
    shapes = [(1000,), (10,)]
    grads_h = [rand(rng, s, np.float32, 100.0) for s in shapes]
    vars_g = [to_dev(rand(rng, s, np.float32)) for s in shapes]
    grads = [to_dev(g) for g in grads_h]
    norm = full((1,), np.nan, np.float32)
    applied = to_dev(np.zeros((1,), np.bool_))
    dev.synchronize()  # the uploads above are queued on the default stream; order them first
    stream = dev.stream()
    r = core.cuda_clip_apply("sgd", vars_g, grads, [], {"learning_rate": 0.1}, "global_norm", 1.0,
                             norm_out=norm, applied_out=applied, stream=stream)
    assert r is None and core.cuda_last_stream() == stream.ptr
    stream.synchronize()
    assert bool(to_host(applied, np.bool_)[0])
    np.testing.assert_allclose(float(to_host(norm, np.float32)[0]), reference.global_norm(grads_h), rtol=1e-6)


def test_the_stream_the_arrays_declare_is_used(rng):
    """__cuda_array_interface__ v3: with no stream= the step runs on the stream the arrays
    declare; a stream= given runs the step there, after the declared stream's work."""
    s1, s2 = dev.stream(), dev.stream()
    vars_h = [rand(rng, (300,), np.float32), rand(rng, (7,), np.float32)]
    grads_h = [rand(rng, (300,), np.float32), rand(rng, (7,), np.float32)]
    vars_c = [v.copy() for v in vars_h]
    hp = {"learning_rate": 0.5}
    for stream_arg in [None, s2]:
        vars_d = [s1.declare(to_dev(v)) for v in vars_c]
        grads_d = [s1.declare(to_dev(g)) for g in grads_h]
        dev.synchronize()
        core.cuda_clip_apply("sgd", vars_d, grads_d, [], hp, "none", 0.0, stream=stream_arg,
                             norm_out=full((1,), 0.0, np.float32), applied_out=to_dev(np.zeros(1, np.bool_)))
        assert core.cuda_last_stream() == (s1.ptr if stream_arg is None else s2.ptr)
        dev.synchronize()
        want = [v.copy() for v in vars_c]
        core.clip_apply("sgd", want, grads_h, [], hp, "none", 0.0)
        for d, w in zip(vars_d, want):
            same_bits(to_host(d, np.float32), w)
    plain = [to_dev(v) for v in vars_c]
    core.cuda_clip_apply("sgd", plain, [to_dev(g) for g in grads_h], [], hp)
    assert core.cuda_last_stream() in (0, 1)  # the legacy default stream (CuPy declares it as 1)


def test_repeated_steps_without_waiting_go_through_the_workspace_ring(rng):
    """Twelve steps queued without a wait, each with a table of another length (1 to 5
    tensors): every step must upload its own table, never one a later step overwrote."""
    shapes = [(CHUNK + 1,), (40,), (3,), (CHUNK * 2,), (1,)]
    vars_c = [rand(rng, s, np.float32) for s in shapes]
    m_c = [np.zeros(s, np.float32) for s in shapes]
    vars_d = [to_dev(v) for v in vars_c]
    m_d = [to_dev(m) for m in m_c]
    stream = dev.stream()
    norms, want_norms = [], []
    grads_all = [[rand(rng, s, np.float32) for s in shapes] for _ in range(12)]
    grads_d = [[to_dev(g) for g in gs] for gs in grads_all]
    dev.synchronize()
    hp = {"learning_rate": 0.05, "momentum": 0.9}
    for k in range(12):
        n = k % 5 + 1
        out = full((1,), np.nan, np.float64)
        norms.append(out)
        core.cuda_clip_apply("keras_momentum", vars_d[:n], grads_d[k][:n], [m_d[:n]], hp, "global_norm", 2.0,
                             norm_out=out, applied_out=to_dev(np.zeros(1, np.bool_)), stream=stream)
        nc, _ = core.clip_apply("keras_momentum", vars_c[:n], grads_all[k][:n], [m_c[:n]], hp, "global_norm", 2.0)
        want_norms.append(nc)
    stream.synchronize()
    for out, want in zip(norms, want_norms):
        np.testing.assert_allclose(float(to_host(out, np.float64)[0]), want, rtol=1e-12)
    for d, c in zip([*vars_d, *m_d], [*vars_c, *m_c]):
        close_ulps(to_host(d, np.float32), c, "float32", ulps=4)


def test_steps_of_a_size_seen_before_allocate_nothing(rng):
    """The workspace ring keeps its pinned tables and device workspaces, and the waiting calls'
    outputs go to one kept scratch buffer: once every ring slot has seen a step this size, steps
    allocate nothing (a cudaMalloc/cudaFree pair per call would synchronize the whole device)."""
    shapes = [(CHUNK + 1,), (40,), (3,)]
    vs = [to_dev(rand(rng, s, np.float32)) for s in shapes]
    gs = [to_dev(rand(rng, s, np.float32)) for s in shapes]
    m = [to_dev(np.zeros(s, np.float32)) for s in shapes]
    outs = [to_dev(np.zeros(s, np.float32)) for s in shapes]
    norm_out, applied_out = full((1,), np.nan, np.float64), to_dev(np.zeros(1, np.bool_))
    hp = {"learning_rate": 0.01, "momentum": 0.9}
    want = np.sqrt(sum(np.sum(to_host(g, np.float32).astype(np.float64) ** 2) for g in gs))

    def steps():
        for _ in range(5):  # more than the ring's slots
            assert core.cuda_global_norm(gs) == pytest.approx(want, rel=1e-12)
            core.cuda_clip_by_global_norm(gs, outs, 1.0)
            norm, applied = core.cuda_clip_apply("keras_momentum", vs, gs, [m], hp, "global_norm", 1.0)
            assert applied and norm == pytest.approx(want, rel=1e-12)
            core.cuda_clip_apply("keras_momentum", vs, gs, [m], hp, "global_norm", 1.0,
                                 norm_out=norm_out, applied_out=applied_out)
        dev.synchronize()

    steps()
    before = core.cuda_allocations()
    steps()
    assert core.cuda_allocations() == before
    assert float(to_host(norm_out, np.float64)[0]) == pytest.approx(want, rel=1e-12)


def _raw(cai, keep):
    class Raw:
        __cuda_array_interface__ = cai
        base = keep
    return Raw()


def test_bad_inputs_are_named():
    a = to_dev(np.zeros((3,), np.float32))
    with pytest.raises(ValueError, match=r"grads\[0\] has shape"):
        core.cuda_clip_apply("sgd", [a], [to_dev(np.zeros((4,), np.float32))], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"vars\[0\] has no __cuda_array_interface__"):
        core.cuda_clip_apply("sgd", [np.zeros(3, np.float32)], [a], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"typestr"):
        core.cuda_global_norm([to_dev(np.zeros((3,), np.int32))])
    cai = dict(to_dev(np.zeros((4, 4), np.float32)).__cuda_array_interface__)
    strided = dict(cai, shape=(4, 2), strides=(16, 8))
    with pytest.raises(ValueError, match="C-contiguous"):
        core.cuda_global_norm([_raw(strided, None)])


def test_host_memory_and_misaligned_pointers_are_rejected_by_name():
    """A NumPy buffer behind __cuda_array_interface__, or a pointer not aligned to its element,
    would fault in the kernels: each is an error naming the array, and nothing runs."""
    host = np.zeros(8, np.float32)
    fake = _raw({"shape": (8,), "typestr": "<f4", "data": (host.ctypes.data, False), "version": 3,
                 "strides": None}, host)
    good = to_dev(np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"vars\[0\] is not in device memory"):
        core.cuda_clip_apply("sgd", [fake], [good], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"t_list\[1\] is not in device memory"):
        core.cuda_global_norm([good, fake])
    buf = to_dev(np.ones(9, np.float32))
    ptr = buf.__cuda_array_interface__["data"][0]
    odd = _raw({"shape": (8,), "typestr": "<f4", "data": (ptr + 1, False), "version": 3, "strides": None}, buf)
    with pytest.raises(ValueError, match=r"grads\[0\] is not aligned"):
        core.cuda_clip_apply("sgd", [good], [odd], [], {"learning_rate": 0.1})
    assert_same_bits(host, np.zeros(8, np.float32))
    same_bits(to_host(good, np.float32), np.ones(8, np.float32))


@pytest.mark.gpu_only
@pytest.mark.slow
def test_tensor_over_2_pow_31_elements():
    if EMULATED:
        pytest.skip("GPU only: two 4 GiB tensors are beyond the emulation's time in CI")
    n = (1 << 31) + 5
    g = to_dev(np.ones((n,), dtype=np.float16))
    v = to_dev(np.zeros((n,), dtype=np.float16))
    np.testing.assert_allclose(core.cuda_global_norm([g]), np.sqrt(n), rtol=1e-12)
    norm, applied = core.cuda_clip_apply("sgd", [v], [g], [], {"learning_rate": 0.5})
    assert applied
    h = to_host(v, np.float16)
    # The last elements (beyond 2^31) were reached.
    assert h[-1] == -0.5 and h[0] == -0.5 and h[(1 << 31) + 1] == -0.5
    assert np.count_nonzero(h + np.float16(0.5)) == 0


# ---------------------------------------------------------------- IndexedSlices (sparse kernel)
SPARSE_RULES = ["sgd", "keras_momentum", "momentum", "adam", "amsgrad", "lamb", "schedule_free_adamw",
                "nadam_legacy"]


def test_adam_with_given_beta_powers_matches_cpu(rng):
    """TF1 AdamOptimizer's running beta1_power / beta2_power, given instead of the step."""
    shapes = [(5000,), (7, 3)]
    vars_c = [rand(rng, s, np.float32) for s in shapes]
    slots_c = [[small_pos(rng, s, np.float32) for s in shapes] for _ in range(2)]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(x) for x in sl] for sl in slots_c]
    h = {"learning_rate": 0.01, "beta_1_power": 0.9 ** 7, "beta_2_power": 0.999 ** 7}
    grads = [rand(rng, s, np.float32) for s in shapes]
    core.clip_apply("adam", vars_c, grads, slots_c, h, "value", 0.5, None, "skip")
    core.cuda_clip_apply("adam", vars_g, [to_dev(g) for g in grads], slots_g, h, "value", 0.5, None, "skip")
    for got, want in zip([*vars_g, *[x for sl in slots_g for x in sl]], [*vars_c, *[x for sl in slots_c for x in sl]]):
        same_bits(to_host(got, np.float32), want)
    # The same as the step they stand for (t = 7): alpha from 0.9^7, 0.999^7 either way.
    again = [rand(rng, s, np.float32) for s in shapes]
    a, b = [x.copy() for x in again], [x.copy() for x in again]
    sa = [[np.zeros(s, np.float32) for s in shapes] for _ in range(2)]
    sb = [[np.zeros(s, np.float32) for s in shapes] for _ in range(2)]
    core.clip_apply("adam", a, grads, sa, h, "none", 0.0, None, "skip")
    core.clip_apply("adam", b, grads, sb, {"learning_rate": 0.01, "step": 7}, "none", 0.0, None, "skip")
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=2e-7, atol=1e-7)  # 0.9^7 in double vs float


@pytest.mark.parametrize("lazy", [False, True], ids=["stock", "lazy"])
@pytest.mark.parametrize("rule", SPARSE_RULES)
@pytest.mark.parametrize("mode", ["none", "value", "global_norm"])
@pytest.mark.parametrize("var_dtype,grad_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                  ("float64", "float64"), ("float16", "float16"),
                                                  ("float64", "float32"), ("float16", "float32")])
def test_sparse_apply_parity(rng, rule, mode, lazy, var_dtype, grad_dtype):
    """A dense tensor plus two tables (one wider than a block, one narrow) with duplicate,
    unsorted and untouched rows: the sparse kernel against the CPU pass, per step."""
    slot_names, hp = RULES[rule]
    vd, gd = DTYPES[var_dtype], DTYPES[grad_dtype]
    shapes = [(1000,), (300, 700), (5000, 3)]
    vars_c = [rand(rng, s, vd) for s in shapes]
    # Slots start positive and small; RMSprop's average_gradient at 0, as it does, so that the
    # centered denominator v - avg^2 + eps stays a variance (random slots could make it ~0).
    slots_c = [[np.zeros(s, vd) if name in ("average_gradient", "mg") else small_pos(rng, s, vd)
                for s in shapes] for name in slot_names]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    for step in range(3):
        idx1 = rng.integers(0, 300, size=64)
        idx1[:5] = idx1[5]  # duplicates
        idx2 = np.concatenate([rng.integers(0, 5000, size=2000), [4999, 0, 4999]]).astype(np.int32)
        grads = [rand(rng, shapes[0], gd), rand(rng, (64, 700), gd), rand(rng, (len(idx2), 3), gd)]
        h = dict(hp, sum_of_squares=step == 1)
        if core_rule(rule) in TAKES_STEP:
            h["step"] = step + 1
        ind = [None, idx1, idx2]
        nc, ac = core.clip_apply(core_rule(rule), vars_c, grads, slots_c, h, mode, MODES[mode], None, "skip",
                                 indices=ind, lazy=lazy)
        ng, ag = core.cuda_clip_apply(core_rule(rule), vars_g, [to_dev(g) for g in grads], slots_g, h, mode,
                                      MODES[mode], None, "skip", indices=ind, lazy=lazy)
        assert ac and ag
        # norm, finalize, dense apply, sparse apply; Lamb: its per-tensor sums and the variables
        assert core.cuda_last_launches() == (6 if rule == "lamb" else 4)
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    # Lamb's per-tensor sums run in another order on the device (as the norm's): its ratio, and
    # so its variables, agree to a few ulps; its slots (computed before the ratio) to the bit.
    exact = mode in ("none", "value") and rule != "lamb"
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        g = to_host(got, vd)
        if exact:
            same_bits(g, want)
        elif rule == "lamb" and var_dtype == "float64":
            # fp64 sums of 10^5 squares in two orders differ by ~1e-14 relative, and so the ratio.
            np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
        else:
            close_ulps(g, want, var_dtype, ulps=4)


@pytest.mark.parametrize("width", [1, 2, 511, 512, 513, 1030])
@pytest.mark.parametrize("lazy", [False, True], ids=["stock", "lazy"])
def test_sparse_row_widths_around_the_block(rng, width, lazy):
    """The sparse kernel walks each thread's (row, column) pairs by steps of the block size,
    without a division per element: widths that divide it, are one off it, or exceed it, with
    touched rows in runs and gaps, against the CPU to the bit."""
    rows = 3000 // width + 7
    var = rand(rng, (rows, width), np.float32)
    m, v = small_pos(rng, (rows, width), np.float32), small_pos(rng, (rows, width), np.float32)
    idx = np.concatenate([np.arange(2, 9), rng.integers(0, rows, size=20), [rows - 1, 2]]).astype(np.int64)
    vals = rand(rng, (len(idx), width), np.float32)
    hp = {"learning_rate": 0.01, "step": 2}
    dv, dm, dvv = to_dev(var), to_dev(m), to_dev(v)
    core.cuda_clip_apply("adam", [dv], [to_dev(vals)], [[dm], [dvv]], hp, "none", 0.0, None, "skip",
                         indices=[idx], lazy=lazy)
    core.clip_apply("adam", [var], [vals], [[m], [v]], hp, "none", 0.0, None, "skip", indices=[idx], lazy=lazy)
    for got, want in zip([dv, dm, dvv], [var, m, v]):
        same_bits(to_host(got, np.float32), want)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_nonfinite_sparse_gradient_writes_nothing(rng, nonfinite):
    """A NaN in an IndexedSlices gradient's values: neither the dense nor the sparse kernel
    writes, in stock (all rows) and lazy mode alike."""
    for lazy in (False, True):
        shapes = [(64,), (40, 8)]
        vars_d = [to_dev(rand(rng, s, np.float32)) for s in shapes]
        m = [to_dev(np.abs(rand(rng, s, np.float32))) for s in shapes]
        v = [to_dev(np.abs(rand(rng, s, np.float32))) for s in shapes]
        before = [to_host(x, np.float32).tobytes() for x in [*vars_d, *m, *v]]
        values = rand(rng, (6, 8), np.float32)
        values[4, 3] = np.nan
        args = ("adam", vars_d, [to_dev(rand(rng, (64,), np.float32)), to_dev(values)], [m, v],
                {"learning_rate": 0.1, "step": 2}, "global_norm", 1.0, None, nonfinite)
        kw = {"indices": [None, np.array([3, 9, 3, 0, 39, 12])], "lazy": lazy}
        if nonfinite == "raise":
            with pytest.raises(ValueError, match="non-finite"):
                core.cuda_clip_apply(*args, **kw)
        else:
            norm, applied = core.cuda_clip_apply(*args, **kw)
            assert not applied and np.isnan(norm)
        assert_unwritten([to_host(x, np.float32).tobytes() for x in [*vars_d, *m, *v]], before)


def test_sparse_out_of_range_index_writes_nothing(rng):
    v = to_dev(np.ones((10, 4), np.float32))
    m, s = to_dev(np.zeros((10, 4), np.float32)), to_dev(np.zeros((10, 4), np.float32))
    with pytest.raises(ValueError, match=r"grads\[0\] \(IndexedSlices\): indices\[1\] = 10 is out of range"):
        core.cuda_clip_apply("adam", [v], [to_dev(np.ones((2, 4), np.float32))], [[m], [s]], {"learning_rate": 0.1},
                             indices=[np.array([3, 10])])
    same_bits(to_host(v, np.float32), np.ones((10, 4), np.float32))
    same_bits(to_host(m, np.float32), np.zeros((10, 4), np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_norm_bits_depend_on_values_not_on_alignment(rng, dtype):
    """The norm's summation order is fixed by the chunk, not by where a buffer starts: the same
    values in an aligned buffer and in views starting 1..7 elements in give the same bits (the
    global norm, and so every clip factor)."""
    dt = DTYPES[dtype]
    sizes = [3 * CHUNK + 37, 1000, 13]
    vals = [rand(rng, (n,), dt) for n in sizes]
    want = core.cuda_global_norm([to_dev(v) for v in vals])
    for k in range(1, 8):
        bases = [np.concatenate([rand(rng, (k,), dt), v]) for v in vals]
        got = core.cuda_global_norm([to_dev(b)[k:] for b in bases])
        assert_same_bits(np.float64(got), np.float64(want), k)


def test_lamb_bits_depend_on_values_not_on_alignment(rng):
    """Lamb's per-tensor sums of w^2 and u^2 give each thread the same elements in the same order
    whether the arrays are aligned for vector loads or views starting 1..3 elements in: the
    same values, the same bits (variables and slots). Five launches whatever the tensor count."""
    sizes = [2 * CHUNK + 37, 1000, 13]
    vals = [[rand(rng, (n,), np.float32) for n in sizes] for _ in range(4)]  # var, grad, m, v
    for x in vals[2:]:
        for a in x:
            np.abs(a, out=a)
    hp = {"learning_rate": 0.01, "step": 3, "weight_decay": 0.01}
    out = []
    for k in range(4):
        bases = [[np.concatenate([rand(rng, (k,), np.float32), a]) for a in x] for x in vals]
        dv, dg, dm, ds = ([to_dev(b)[k:] for b in x] for x in bases)
        core.cuda_clip_apply("lamb", dv, dg, [dm, ds], hp, "global_norm", 1.0)
        assert core.cuda_last_launches() == 5  # norm, finalize, slots + sums, sums per tensor, variables
        out.append([to_host(d, np.float32).tobytes() for d in [*dv, *dm, *ds]])
    assert all(o == out[0] for o in out[1:])
