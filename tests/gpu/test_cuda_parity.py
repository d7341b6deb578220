"""CUDA against CPU through tfclip._core: every op, dtype and clip mode.

The GPU test hosts have CuPy and no TensorFlow, so these tests use `_core` alone: the CPU
reference is `_core`'s NumPy path (itself tested against TF and NumPy float64 in tests/), the
CUDA side is `_core.cuda_*` on CuPy arrays, the entry points the TF GPU kernels share.

The apply kernels are built with --fmad=false and run the same rule bodies in the same order as
the CPU, so with no clip (or a clip by value) they match the CPU bit for bit. Norm-based clips
sum in a different order on the GPU, so there the norm agrees to 1e-12 and the results to a
couple of ulps of the dtype.
"""
import numpy as np
import pytest

_core = pytest.importorskip("tfclip._core", reason="tfclip._core is not built")
if not _core.cuda:
    pytest.skip("tfclip._core was built without CUDA (no toolkit at build time)", allow_module_level=True)
cp = pytest.importorskip("cupy", reason="CuPy is needed to hold CUDA arrays for _core")
try:
    if cp.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no device")
except Exception as e:  # noqa: BLE001 - CuPy raises its own runtime errors
    pytest.skip(f"no CUDA device: {e}", allow_module_level=True)
ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes gives NumPy a bfloat16 for the CPU reference")

DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
}
CHUNK = _core.cuda_chunk_elems
# Empty, scalar, odd, exactly one chunk, over one chunk (unaligned tail), and many small ones.
SHAPES = [(0,), (), (7,), (CHUNK,), (3 * CHUNK + 5,), (33, 17)] + [(i % 13 + 1,) for i in range(200)]
ULPS = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2.4e-7, "float64": 4.5e-16}


def to_gpu(a):
    """bfloat16 travels as a uint16 view (CuPy has no bfloat16)."""
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a)


def to_cpu(d, dtype):
    h = cp.asnumpy(d)
    return h.view(ml_dtypes.bfloat16) if dtype == ml_dtypes.bfloat16 else h


def rand(rng, shape, dtype, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(dtype)


def close_ulps(gpu, cpu, dtype_name, ulps=2):
    g = np.asarray(gpu, dtype=np.float64)
    c = np.asarray(cpu, dtype=np.float64)
    np.testing.assert_allclose(g, c, rtol=ULPS[dtype_name] * ulps, atol=ULPS[dtype_name] * ulps * 1e-3)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# ---------------------------------------------------------------- norm
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_global_norm_parity(rng, dtype):
    ts = [rand(rng, s, DTYPES[dtype]) for s in SHAPES]
    cpu = _core.global_norm(ts)
    gpu = _core.cuda_global_norm([to_gpu(t) for t in ts])
    np.testing.assert_allclose(gpu, cpu, rtol=1e-12)


def test_global_norm_mixed_dtypes_and_device_output(rng):
    ts = [rand(rng, (1000 + i,), dt) for i, dt in enumerate(DTYPES.values())]
    out = cp.full((1,), np.nan, dtype=cp.float64)  # poisoned
    assert _core.cuda_global_norm([to_gpu(t) for t in ts], out=out) is None
    np.testing.assert_allclose(float(out[0]), _core.global_norm(ts), rtol=1e-12)
    out32 = cp.full((), np.nan, dtype=cp.float32)
    _core.cuda_global_norm([to_gpu(t) for t in ts], out=out32)
    assert np.float32(out32.get()) == np.float32(_core.global_norm(ts))


def test_norm_is_deterministic_over_10_runs(rng):
    ts = [to_gpu(rand(rng, s, np.float32)) for s in [(5_000_003,), (70_001,), (3,)] + [(99,)] * 500]
    out = cp.zeros((1,), dtype=cp.float64)
    bits = set()
    for _ in range(10):
        _core.cuda_global_norm(ts, out=out)
        bits.add(out.get().tobytes())
    assert len(bits) == 1


def test_norm_overflow_safe_and_subnormal():
    big = np.full((1000,), 3e20, dtype=np.float32)  # squares overflow float32
    np.testing.assert_allclose(_core.cuda_global_norm([to_gpu(big)]), 3e20 * np.sqrt(1000), rtol=1e-12)
    tiny = np.full((64,), 1e-40, dtype=np.float32)  # subnormal
    np.testing.assert_allclose(_core.cuda_global_norm([to_gpu(tiny)]), float(np.float32(1e-40)) * 8, rtol=1e-6)


def test_many_tensors_few_launches(rng):
    ts = [rand(rng, (i % 7 + 1,), np.float32) for i in range(10_000)]
    vs = [rand(rng, t.shape, np.float32) for t in ts]
    m = [np.zeros_like(v) for v in vs]
    v2 = [np.zeros_like(v) for v in vs]
    gv, gm, gv2 = [to_gpu(x) for x in vs], [to_gpu(x) for x in m], [to_gpu(x) for x in v2]
    hp = {"learning_rate": 1e-2}
    _core.cuda_clip_apply("adam", gv, [to_gpu(t) for t in ts], [gm, gv2], hp, "global_norm", 1.0)
    assert _core.cuda_last_launches() <= 3
    _core.clip_apply("adam", vs, ts, [m, v2], hp, "global_norm", 1.0)
    for g, c in zip(gv, vs):
        close_ulps(cp.asnumpy(g), c, "float32")


# ---------------------------------------------------------------- clip_by_global_norm
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clip_by_global_norm_parity(rng, dtype, clip):
    ts = [rand(rng, s, DTYPES[dtype]) for s in SHAPES]
    cpu_out, cpu_norm = _core.clip_by_global_norm(ts, clip)
    g_in = [to_gpu(t) for t in ts]
    g_out = [cp.full(g.shape, np.nan, dtype=g.dtype) if g.dtype != cp.uint16 else cp.full(g.shape, 0x7fc1, dtype=cp.uint16)
             for g in g_in]  # poisoned
    norm = _core.cuda_clip_by_global_norm(g_in, g_out, clip)
    np.testing.assert_allclose(norm, cpu_norm, rtol=1e-12)
    assert _core.cuda_last_launches() == 3
    for g, c in zip(g_out, cpu_out):
        close_ulps(to_cpu(g, DTYPES[dtype]), c, dtype, ulps=1)


def test_clip_by_global_norm_given_norm(rng):
    ts = [rand(rng, s, np.float32) for s in SHAPES[:8]]
    cpu_out, _ = _core.clip_by_global_norm(ts, 1.0, use_norm=4.0)
    g_out = [cp.empty(t.shape, dtype=cp.float32) for t in ts]
    norm = _core.cuda_clip_by_global_norm([to_gpu(t) for t in ts], g_out, 1.0, use_norm=4.0)
    assert norm == 4.0
    assert _core.cuda_last_launches() == 2  # no norm pass
    for g, c in zip(g_out, cpu_out):
        assert cp.asnumpy(g).tobytes() == c.tobytes()


# ---------------------------------------------------------------- clip + apply
RULES = {
    "sgd": ([], {"learning_rate": 0.1, "weight_decay": 0.01}),
    "momentum": (["accum"], {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "keras_momentum": (["m"], {"learning_rate": 0.1, "momentum": 0.9}),
    "adam": (["m", "v"], {"learning_rate": 0.01, "weight_decay": 0.004}),
    "amsgrad": (["m", "v", "vhat"], {"learning_rate": 0.01, "amsgrad": True}),
}
MODES = {"none": 0.0, "global_norm": 1.0, "norm": 0.3, "value": 0.01}
PAIRS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
         ("float64", "float64"), ("float32", "float16"), ("float32", "bfloat16")]


def run_both(rng, rule, var_dtype, grad_dtype, mode, shapes, steps=2, nonfinite="skip", poison=None):
    slot_names, hp = RULES[rule]
    core_rule = "adam" if rule == "amsgrad" else rule
    vd, gd = DTYPES[var_dtype], DTYPES[grad_dtype]
    vars_c = [rand(rng, s, vd) for s in shapes]
    slots_c = [[np.abs(rand(rng, s, vd)) * 0.1 for s in shapes] for _ in slot_names]
    vars_g = [to_gpu(v) for v in vars_c]
    slots_g = [[to_gpu(s) for s in sl] for sl in slots_c]
    results = []
    for step in range(steps):
        grads = [rand(rng, s, gd) for s in shapes]
        if poison is not None:
            grads[poison][...] = np.inf
        h = dict(hp)
        if core_rule == "adam":
            h["step"] = step + 1
        rc = _core.clip_apply(core_rule, vars_c, grads, slots_c, h, mode, MODES[mode], None, nonfinite)
        rg = _core.cuda_clip_apply(core_rule, vars_g, [to_gpu(g) for g in grads], slots_g, h, mode,
                                   MODES[mode], None, nonfinite)
        results.append((rc, rg))
    return vars_c, slots_c, vars_g, slots_g, results


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("var_dtype,grad_dtype", PAIRS)
def test_apply_parity(rng, rule, mode, var_dtype, grad_dtype):
    vars_c, slots_c, vars_g, slots_g, results = run_both(rng, rule, var_dtype, grad_dtype, mode, SHAPES)
    vd = DTYPES[var_dtype]
    for (nc, ac), (ng, ag) in results:
        assert ac and ag
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    exact = mode in ("none", "value")
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        g = to_cpu(got, vd)
        if exact:
            assert g.tobytes() == want.tobytes()
        else:
            close_ulps(g, want, var_dtype, ulps=4)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_nonfinite_writes_nothing(rng, nonfinite):
    shapes = [(100,), (CHUNK + 3,), (5,)]
    vars_g = [to_gpu(rand(rng, s, np.float32)) for s in shapes]
    m = [cp.zeros(s, cp.float32) for s in shapes]
    v = [cp.zeros(s, cp.float32) for s in shapes]
    before = [x.get().tobytes() for x in [*vars_g, *m, *v]]
    grads = [to_gpu(rand(rng, s, np.float32)) for s in shapes]
    grads[1][7] = np.nan
    args = ("adam", vars_g, grads, [m, v], {"learning_rate": 0.1}, "global_norm", 1.0, None, nonfinite)
    if nonfinite == "raise":
        with pytest.raises(ValueError, match="non-finite"):
            _core.cuda_clip_apply(*args)
    else:
        norm, applied = _core.cuda_clip_apply(*args)
        assert not applied and np.isnan(norm)
    assert [x.get().tobytes() for x in [*vars_g, *m, *v]] == before


def test_nonfinite_propagate_matches_cpu(rng):
    vars_c, slots_c, vars_g, slots_g, results = run_both(
        rng, "adam", "float32", "float32", "global_norm", [(50,), (9,)], steps=1, nonfinite="propagate", poison=1)
    (nc, ac), (ng, ag) = results[0]
    assert ac and ag and np.isinf(nc) and np.isinf(ng)
    for g, c in zip(vars_g, vars_c):
        np.testing.assert_array_equal(cp.asnumpy(g), c)  # NaN where TF gives NaN


def test_device_outputs_no_wait(rng):
    shapes = [(1000,), (10,)]
    vars_g = [to_gpu(rand(rng, s, np.float32)) for s in shapes]
    grads = [to_gpu(rand(rng, s, np.float32) * 100) for s in shapes]
    norm = cp.full((1,), np.nan, cp.float32)
    applied = cp.zeros((1,), cp.bool_)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        r = _core.cuda_clip_apply("sgd", vars_g, grads, [], {"learning_rate": 0.1}, "global_norm", 1.0,
                                  norm_out=norm, applied_out=applied, stream=stream)
    stream.synchronize()
    assert r is None and bool(applied.get()[0])
    want = np.sqrt(sum((cp.asnumpy(g).astype(np.float64) ** 2).sum() for g in grads))
    np.testing.assert_allclose(float(norm.get()[0]), want, rtol=1e-6)


def test_bad_inputs_are_named():
    a = cp.zeros((3,), cp.float32)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape"):
        _core.cuda_clip_apply("sgd", [a], [cp.zeros((4,), cp.float32)], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"vars\[0\] has no __cuda_array_interface__"):
        _core.cuda_clip_apply("sgd", [np.zeros(3, np.float32)], [a], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"typestr"):
        _core.cuda_global_norm([cp.zeros((3,), cp.int32)])
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.cuda_global_norm([cp.zeros((4, 4), cp.float32)[:, ::2]])


@pytest.mark.slow
def test_tensor_over_2_pow_31_elements():
    n = (1 << 31) + 5
    try:
        g = cp.ones((n,), dtype=cp.float16)
        v = cp.zeros((n,), dtype=cp.float16)
    except cp.cuda.memory.OutOfMemoryError:
        pytest.skip("the GPU cannot hold two 4 GiB half tensors")
    np.testing.assert_allclose(_core.cuda_global_norm([g]), np.sqrt(n), rtol=1e-12)
    norm, applied = _core.cuda_clip_apply("sgd", [v], [g], [], {"learning_rate": 0.5})
    assert applied
    # The last elements (beyond 2^31) were reached.
    assert float(v[-1]) == -0.5 and float(v[0]) == -0.5 and float(v[(1 << 31) + 1]) == -0.5
    assert int(cp.count_nonzero(v + 0.5)) == 0


# ---------------------------------------------------------------- IndexedSlices (sparse kernel)
SPARSE_RULES = ["sgd", "keras_momentum", "momentum", "adam", "amsgrad"]


@pytest.mark.parametrize("lazy", [False, True], ids=["stock", "lazy"])
@pytest.mark.parametrize("rule", SPARSE_RULES)
@pytest.mark.parametrize("mode", ["none", "value", "global_norm"])
@pytest.mark.parametrize("var_dtype,grad_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                  ("float64", "float64"), ("float16", "float16")])
def test_sparse_apply_parity(rng, rule, mode, lazy, var_dtype, grad_dtype):
    """A dense tensor plus two tables (one wider than a block, one narrow) with duplicate,
    unsorted and untouched rows: the sparse kernel against the CPU pass, per step."""
    slot_names, hp = RULES[rule]
    core_rule = "adam" if rule == "amsgrad" else rule
    vd, gd = DTYPES[var_dtype], DTYPES[grad_dtype]
    shapes = [(1000,), (300, 700), (5000, 3)]
    vars_c = [rand(rng, s, vd) for s in shapes]
    slots_c = [[np.abs(rand(rng, s, vd)) * 0.1 for s in shapes] for _ in slot_names]
    vars_g = [to_gpu(v) for v in vars_c]
    slots_g = [[to_gpu(s) for s in sl] for sl in slots_c]
    for step in range(3):
        idx1 = rng.integers(0, 300, size=64)
        idx1[:5] = idx1[5]  # duplicates
        idx2 = np.concatenate([rng.integers(0, 5000, size=2000), [4999, 0, 4999]]).astype(np.int32)
        grads = [rand(rng, shapes[0], gd), rand(rng, (64, 700), gd), rand(rng, (len(idx2), 3), gd)]
        h = dict(hp, sum_of_squares=step == 1)
        if core_rule == "adam":
            h["step"] = step + 1
        ind = [None, idx1, idx2]
        nc, ac = _core.clip_apply(core_rule, vars_c, grads, slots_c, h, mode, MODES[mode], None, "skip",
                                  indices=ind, lazy=lazy)
        ng, ag = _core.cuda_clip_apply(core_rule, vars_g, [to_gpu(g) for g in grads], slots_g, h, mode,
                                       MODES[mode], None, "skip", indices=ind, lazy=lazy)
        assert ac and ag
        assert _core.cuda_last_launches() == 4  # norm, finalize, dense apply, sparse apply
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    exact = mode in ("none", "value")
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        g = to_cpu(got, vd)
        if exact:
            assert g.tobytes() == want.tobytes()
        else:
            close_ulps(g, want, var_dtype, ulps=4)


def test_sparse_out_of_range_index_writes_nothing(rng):
    v = to_gpu(np.ones((10, 4), np.float32))
    m, s = cp.zeros((10, 4), cp.float32), cp.zeros((10, 4), cp.float32)
    with pytest.raises(ValueError, match=r"grads\[0\] \(IndexedSlices\): indices\[1\] = 10 is out of range"):
        _core.cuda_clip_apply("adam", [v], [cp.ones((2, 4), cp.float32)], [[m], [s]], {"learning_rate": 0.1},
                              indices=[np.array([3, 10])])
    assert float(cp.abs(v - 1).max()) == 0.0 and float(cp.abs(m).max()) == 0.0
