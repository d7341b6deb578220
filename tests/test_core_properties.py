"""Property tests (hypothesis) of the core through tfclip._core, against NumPy float64.

Random lists (count, shapes with empty and scalar ones, dtypes, magnitudes), clip modes and
hyper-parameters. No TensorFlow here: `scripts/sanitize.sh` runs this file against an
ASan+UBSan build of `_core`, loaded from TFCLIP_CORE_MODULE without importing the tfclip
package (which would import TensorFlow).
"""
import zlib

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the [test] extra")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import reference  # noqa: E402
from core_loader import load_core  # noqa: E402


core = load_core()

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with TensorFlow
    BF16 = None

DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
if BF16 is not None:
    DTYPES["bfloat16"] = BF16
# Relative error of one rounding to the dtype (the kernels compute in float for 16-bit types).
EPS = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 2 ** -23, "float64": 2 ** -52}
# The smallest subnormal: results below it round to zero (as in TF).
TINY = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149, "float64": 5e-324}
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (64, 33), (70_001,)]
PROFILE = settings(max_examples=40, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def tensor_lists(draw, max_len=6, dtypes=tuple(DTYPES)):
    n = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        name = draw(st.sampled_from(dtypes))
        shape = draw(st.sampled_from(SHAPES))
        exp = draw(st.sampled_from([-3, 0, 2] if name in ("float16", "bfloat16") else [-30, -3, 0, 3, 15]))
        out.append((name, np.asarray(rng.normal(size=shape) * 10.0 ** exp, dtype=DTYPES[name])))
    return out


@PROFILE
@given(tensor_lists())
def test_global_norm_is_the_float64_norm(ts):
    arrays = [a for _, a in ts]
    want = np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in arrays))
    got = core.global_norm(arrays)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-300)


@PROFILE
@given(tensor_lists(), st.sampled_from([1e-3, 0.5, 1.0, 1e6]))
def test_clip_by_global_norm_scales_each_tensor(ts, clip):
    arrays = [a for _, a in ts]
    outs, norm = core.clip_by_global_norm(arrays, clip)
    want_norm = np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in arrays))
    assert norm == pytest.approx(want_norm, rel=1e-12, abs=1e-300)
    scale = clip * min(1.0 / want_norm, 1.0 / clip) if want_norm > 0 else 1.0
    for (name, a), o in zip(ts, outs):
        assert o.dtype == a.dtype and o.shape == a.shape
        want = np.asarray(a, np.float64) * scale
        # Two roundings: the scale to the dtype, the product to the dtype.
        tol = 3 * EPS[name] * np.abs(want) + (np.abs(np.asarray(a, np.float64)) + 1) * TINY[name]
        assert np.all(np.abs(np.asarray(o, np.float64) - want) <= tol)


HP = st.fixed_dictionaries({
    "learning_rate": st.sampled_from([1e-4, 0.01, 0.3]),
    "momentum": st.sampled_from([0.0, 0.5, 0.99]),
    "nesterov": st.booleans(),
    "beta_1": st.sampled_from([0.0, 0.9]),
    "beta_2": st.sampled_from([0.5, 0.999]),
    "epsilon": st.sampled_from([1e-7, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "amsgrad": st.booleans(),
    "step": st.integers(1, 50),
})
MODES = st.sampled_from([("none", 0.0), ("global_norm", 0.7), ("norm", 0.2), ("value", 0.05)])
RULE_HP = {
    "sgd": ("learning_rate", "weight_decay"),
    "momentum": ("learning_rate", "momentum", "nesterov", "weight_decay"),
    "keras_momentum": ("learning_rate", "momentum", "nesterov", "weight_decay"),
    "adam": ("learning_rate", "beta_1", "beta_2", "epsilon", "weight_decay", "amsgrad", "step"),
    "lamb": ("learning_rate", "beta_1", "beta_2", "epsilon", "weight_decay", "step"),
}


@PROFILE
@given(tensor_lists(max_len=5, dtypes=("float16", "float32", "float64") + (("bfloat16",) if BF16 else ())),
       st.sampled_from(list(RULE_HP)), HP, MODES, st.integers(0, 2 ** 32 - 1))
def test_clip_apply_matches_float64_reference(ts, rule, hp_all, mode_clip, seed):
    """Variables of each gradient's dtype (float32 variables for half gradients, half the time),
    slots random, against reference.clip + reference.step in float64."""
    mode, clip = mode_clip
    hp = {k: hp_all[k] for k in RULE_HP[rule]}
    rng = np.random.default_rng(seed)
    grads, variables, var_names = [], [], []
    for name, g in ts:
        vname = "float32" if name in ("float16", "bfloat16") and rng.random() < 0.5 else name
        grads.append(g)
        variables.append(np.asarray(rng.normal(size=g.shape), dtype=DTYPES[vname]))
        var_names.append(vname)
    nslots = reference.num_slots(rule, hp)
    slots = [[np.asarray(np.abs(rng.normal(size=v.shape)) * 0.1, dtype=v.dtype) for v in variables]
             for _ in range(nslots)]
    v0 = [np.array(v, np.float64) for v in variables]  # copies: the core updates in place
    s0 = [[np.array(s, np.float64) for s in sl] for sl in slots]
    norm, applied = core.clip_apply(rule, variables, grads, slots, hp, mode, clip)
    want_norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads))
    assert applied and norm == pytest.approx(want_norm, rel=1e-12, abs=1e-300)
    clipped = reference.clip(grads, mode, clip)
    hp64 = dict(hp)
    t = hp64.pop("step", 1)
    for i, (g, vname) in enumerate(zip(clipped, var_names)):
        sl = [s0[k][i].copy() for k in range(nslots)]
        want = reference.step(rule, v0[i].copy(), sl, g, hp64, t)
        # Float rounding of each operand: bound the error by the magnitudes involved.
        eps = max(EPS[vname], EPS[ts[i][0]])
        scale = np.abs(v0[i]) + np.abs(want) + np.abs(want - v0[i]) * 64 + 1e-30 + TINY[ts[i][0]] * 1e3
        got = np.asarray(variables[i], np.float64)
        assert np.all(np.abs(got - want) <= 64 * eps * scale), (rule, mode, vname)
        for k in range(nslots):
            s_scale = np.abs(s0[k][i]) + np.abs(sl[k]) + 1e-30
            assert np.all(np.abs(np.asarray(slots[k][i], np.float64) - sl[k]) <= 64 * eps * s_scale)


@PROFILE
@given(tensor_lists(max_len=4, dtypes=("float32",)), st.integers(0, 2 ** 32 - 1), st.booleans())
def test_sparse_apply_equals_dense_apply_of_the_densified_gradient(ts, seed, lazy):
    """An IndexedSlices gradient (random rows, duplicates) gives the dense result of its
    densified gradient (Adam, stock semantics), or that result on its rows only (lazy)."""
    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    k = int(rng.integers(0, 3 * rows))
    idx = rng.integers(0, rows, size=k).astype(np.int64)
    values = rng.normal(size=(k, width)).astype(np.float32)
    dense_g = np.zeros((rows, width), np.float32)
    np.add.at(dense_g, idx, values)
    var = rng.normal(size=(rows, width)).astype(np.float32)
    m, v = np.abs(var) * 0.1, np.abs(var) * 0.2
    hp = {"learning_rate": 0.05, "step": 3, "weight_decay": 0.01}
    sv, sm, svv = var.copy(), m.copy(), v.copy()
    core.clip_apply("adam", [sv], [values], [[sm], [svv]], hp, "global_norm", 1.0, indices=[idx], lazy=lazy)
    dv, dm, dvv = var.copy(), m.copy(), v.copy()
    core.clip_apply("adam", [dv], [dense_g], [[dm], [dvv]], hp, "global_norm", 1.0,
                    use_norm=float(np.sqrt(np.sum(values.astype(np.float64) ** 2))))
    touched = np.zeros(rows, bool)
    touched[idx] = True
    if lazy:
        for a, b, orig in ((sv, dv, var), (sm, dm, m), (svv, dvv, v)):
            np.testing.assert_allclose(a[touched], b[touched], rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(a[~touched], orig[~touched])
    else:
        for a, b in ((sv, dv), (sm, dm), (svv, dvv)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@PROFILE
@given(tensor_lists(max_len=4, dtypes=("float32", "float64")), st.integers(1, 4))
def test_results_do_not_depend_on_thread_count(ts, threads):
    arrays = [a for _, a in ts]
    try:
        core.set_num_threads(1)
        one = core.global_norm(arrays), [o.tobytes() for o in core.clip_by_global_norm(arrays, 0.3)[0]]
        core.set_num_threads(threads)
        many = core.global_norm(arrays), [o.tobytes() for o in core.clip_by_global_norm(arrays, 0.3)[0]]
    finally:
        core.set_num_threads(0)
    assert one == many


@pytest.mark.parametrize("clip_mode", ["global_norm", "value"])
@pytest.mark.parametrize("rule", ["adam", "momentum"])
@pytest.mark.parametrize("gname", list(DTYPES))
@pytest.mark.parametrize("vname", list(DTYPES))
def test_sparse_pass_gives_the_dense_pass_bits_for_every_dtype_pair(vname, gname, rule, clip_mode):
    """Every row touched once, in shuffled order: the IndexedSlices pass must give the dense
    pass's bits for every (variable, gradient) dtype pair. The sparse pass reads every pair but
    float/float through one run-time cast path (AnyGrad), the dense pass has its own paths for
    the same dtype and for half/bfloat16 gradients of a float variable: the same rounding, so
    the same bits."""
    rng = np.random.default_rng(zlib.crc32(f"{vname} {gname} {rule} {clip_mode}".encode()))  # (the same each run)
    rows, width = 37, 5
    order = rng.permutation(rows).astype(np.int64)
    dense_g = (rng.normal(size=(rows, width)) * 3).astype(DTYPES[gname])
    values = dense_g[order]
    var = rng.normal(size=(rows, width)).astype(DTYPES[vname])
    hp = {"learning_rate": 0.05, "step": 3} if rule == "adam" else {"lr": 0.05, "momentum": 0.9}
    nslots = 2 if rule == "adam" else 1
    slots0 = [(np.abs(rng.normal(size=(rows, width))) * 0.1).astype(DTYPES[vname]) for _ in range(nslots)]
    # The same clip factor for both: the norm given (the passes sum squares in other orders).
    kw = {"use_norm": 7.5} if clip_mode == "global_norm" else {}
    sv, ss = var.copy(), [s.copy() for s in slots0]
    core.clip_apply(rule, [sv], [values], [[s] for s in ss], hp, clip_mode, 2.0, indices=[order], **kw)
    dv, ds = var.copy(), [s.copy() for s in slots0]
    core.clip_apply(rule, [dv], [dense_g], [[s] for s in ds], hp, clip_mode, 2.0, **kw)
    np.testing.assert_array_equal(sv.view(np.uint8), dv.view(np.uint8), err_msg="variable")
    for a, b in zip(ss, ds):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg="slot")
    assert not np.array_equal(sv.view(np.uint8), var.view(np.uint8))  # the step moved it
