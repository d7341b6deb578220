"""AGC (clip_mode="agc", csrc/core/agc.h) on CUDA against the CPU driver, through tfclip._core.

The CUDA norm pass sums each unit in the CPU's order (a thread per column over its rows; a
one-unit tile on the CPU's 16 lanes; an IndexedSlices gradient's densified units row by row), so
the per-unit scales, and with them the variables and slots, are the CPU's bits; only the global
norm is summed in another order (to 1e-12). The float64 reference of the paper's definition is
tests/test_clip_agc.py's; here the CPU is the reference.
"""
import numpy as np
import pytest

from gpu_arrays import BF16, assert_same_bits, core, full, to_dev, to_host

SHAPES = [(), (37,), (13, 6), (4, 5, 7), (3, 3, 4, 8), (3, 3000), (70_001, 2), (40_000,)]
PAIRS = {"float32": (np.float32, np.float32), "float64": (np.float64, np.float64),
         "bf16_grad_f32_var": (np.float32, BF16)}
RULES = {"sgd": ([], {"learning_rate": 0.1}),
         "adam": (["m", "v"], {"learning_rate": 0.01, "step": 1}),
         "lamb": (["m", "v"], {"learning_rate": 0.01, "step": 1})}


def units_of(x):
    x = np.asarray(x, np.float64)
    return x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def mixed_grads(rng, shape, dtype, w, clip=0.05):
    """Even units 1.25x-20x over their bound, odd ones 0.01x-0.8x under it."""
    gu = units_of(rng.normal(size=shape))
    wn = np.maximum(np.sqrt((units_of(w) ** 2).sum(0)), 1e-3)
    c = gu.shape[1]
    f = np.where(np.arange(c) % 2 == 0, rng.uniform(1.25, 20, size=c), rng.uniform(0.01, 0.8, size=c))
    gu = gu / np.maximum(np.sqrt((gu ** 2).sum(0)), 1e-30) * clip * wn * f
    return gu.reshape(shape).astype(dtype)


def same_bits(got, want):
    assert_same_bits(got, want)


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_agc_dense_parity(rng, pair, rule):
    vd, gd = pair
    slot_names, hp = RULES[rule]
    vars_c = [rng.normal(size=s).astype(vd) for s in SHAPES]
    vars_c0 = [v.copy() for v in vars_c]
    grads = [mixed_grads(rng, s, gd, v.astype(np.float64)) for s, v in zip(SHAPES, vars_c)]
    slots_c = [[np.zeros(s, vd) for s in SHAPES] for _ in slot_names]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    tn_c = np.zeros(len(SHAPES))
    tn_g = full((len(SHAPES),), np.nan, np.float64)
    cu_c = np.full(len(SHAPES), -7, np.int64)
    cu_g = full((len(SHAPES),), -7, np.int64)  # poisoned: the step must write every count
    nc, ac = core.clip_apply(rule, vars_c, grads, slots_c, hp, "agc", 0.05, tensor_norms_out=tn_c,
                             agc_clipped_out=cu_c)
    ng, ag = core.cuda_clip_apply(rule, vars_g, [to_dev(g) for g in grads], slots_g, hp, "agc", 0.05,
                                  tensor_norms_out=tn_g, agc_clipped_out=cu_g)
    assert ac and ag
    # The counts of clipped units, counted on the device: the CPU's, and the paper's.
    same_bits(to_host(cu_g, np.int64), cu_c)
    want = [int((np.sqrt((units_of(g) ** 2).sum(0)) >
                 0.05 * np.maximum(np.sqrt((units_of(v) ** 2).sum(0)), 1e-3)).sum())
            for g, v in zip(grads, vars_c0)]
    assert list(cu_c) == want and 0 < sum(want)
    np.testing.assert_allclose(ng, nc, rtol=1e-12)
    same_bits(to_host(tn_g, np.float64), tn_c)  # each tensor's sum: the CPU's order
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        g = to_host(got, vd)
        if rule == "lamb":  # its trust-ratio sums run in another order on the device
            np.testing.assert_allclose(g, want, rtol=1e-5 if vd == np.float32 else 1e-12, atol=1e-7)
        else:
            same_bits(g, want)


@pytest.mark.parametrize("lazy", [False, True], ids=["stock", "lazy"])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_agc_sparse_parity(rng, rule, lazy):
    """IndexedSlices with duplicate rows (units of the densified gradient), rank 2 and 3 tables
    and a rank-1 one, beside a dense tensor."""
    slot_names, hp = RULES[rule]
    shapes = [(50, 6), (12, 4), (9, 2, 3), (15,)]
    vars_c = [rng.normal(size=s).astype(np.float32) for s in shapes]
    i1 = np.array([1, 4, 1, 0, 4, 4, 7, 11], np.int64)
    i2 = np.array([8, 0, 8, 3], np.int32)
    i3 = np.array([14, 2, 14], np.int64)
    grads = [mixed_grads(rng, shapes[0], np.float32, vars_c[0].astype(np.float64)),
             (rng.normal(size=(8, 4)) * [3.0, 1e-3, 3.0, 1e-3]).astype(np.float32),
             (rng.normal(size=(4, 2, 3)) * [3.0, 1e-3, 3.0]).astype(np.float32),
             (rng.normal(size=(3,)) * 3.0).astype(np.float32)]
    ind = [None, i1, i2, i3]
    slots_c = [[np.zeros(s, np.float32) for s in shapes] for _ in slot_names]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    cu_c = np.full(4, -7, np.int64)
    cu_g = full((4,), -7, np.int64)
    nc, ac = core.clip_apply(rule, vars_c, grads, slots_c, hp, "agc", 0.05, indices=ind, lazy=lazy,
                             agc_clipped_out=cu_c)
    ng, ag = core.cuda_clip_apply(rule, vars_g, [to_dev(g) for g in grads], slots_g, hp, "agc", 0.05,
                                  indices=ind, lazy=lazy, agc_clipped_out=cu_g)
    assert ac and ag
    same_bits(to_host(cu_g, np.int64), cu_c)
    assert cu_c.min() >= 0 and cu_c[1:].sum() > 0
    np.testing.assert_allclose(ng, nc, rtol=1e-12)
    for got, want in zip([*vars_g, *[s for sl in slots_g for s in sl]],
                         [*vars_c, *[s for sl in slots_c for s in sl]]):
        same_bits(to_host(got, np.float32), want)


def test_agc_device_clip_eps_and_skip(rng):
    """The clip in device memory (read by the step, no host wait), a non-default eps, and a
    non-finite step skipped without a write."""
    shapes = [(20, 5), (7,)]
    vars_c = [rng.normal(size=s).astype(np.float32) for s in shapes]
    vars_c[0][:, 1] = 0.0  # a zero unit: bound clip * eps
    grads = [mixed_grads(rng, s, np.float32, v.astype(np.float64)) for s, v in zip(shapes, vars_c)]
    vars_g = [to_dev(v) for v in vars_c]
    hp = {"learning_rate": 0.1}
    core.clip_apply("sgd", vars_c, grads, [], hp, "agc", 0.05, agc_eps=0.01)
    _, ag = core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in grads], [], hp, "agc",
                                 full((1,), 0.05, np.float64), agc_eps=0.01)
    assert ag
    for got, want in zip(vars_g, vars_c):
        same_bits(to_host(got, np.float32), want)
    before = [to_host(v, np.float32).tobytes() for v in vars_g]
    bad = [g.copy() for g in grads]
    bad[1][3] = np.nan
    cu_g = full((2,), -7, np.int64)
    cu_c = np.full(2, -7, np.int64)
    _, ag = core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in bad], [], hp, "agc", 0.05,
                                 agc_clipped_out=cu_g)
    assert not ag
    assert [to_host(v, np.float32).tobytes() for v in vars_g] == before
    # Counted for the skipped step too (the NaN unit among them), as the CPU counts.
    core.clip_apply("sgd", [v.copy() for v in vars_c], bad, [], hp, "agc", 0.05, agc_clipped_out=cu_c)
    same_bits(to_host(cu_g, np.int64), cu_c)
    assert cu_c[1] == 1
    # Another clip mode: every count 0 (poisoned first), on the device as on the CPU.
    cu_g = full((2,), -7, np.int64)
    core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in grads], [], hp, "global_norm", 0.01,
                         agc_clipped_out=cu_g)
    same_bits(to_host(cu_g, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="agc_clipped_out must be"):
        core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in grads], [], hp, "agc", 0.05,
                             agc_clipped_out=full((3,), 0, np.int64))
    with pytest.raises(ValueError, match="agc_eps must be finite and >= 0"):
        core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in grads], [], hp, "agc", 0.05, agc_eps=-1.0)
