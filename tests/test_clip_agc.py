"""Adaptive gradient clipping, unit-wise (clip_mode="agc"), against a NumPy float64 reference
written from the paper (Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without
Normalization", section 4.1 / eq. 3), never from our kernels:

  units: a tensor of rank <= 1 is one unit; rank >= 2: one unit per index of the LAST axis, the
  unit's norm over every other axis (optax's unitwise_norm reduces only axis 0 for rank 3: the
  paper, and tfclip, reduce all but the output axis);
  bound_u = clip * max(||W_u||, eps);  G_u <- G_u * bound_u / ||G_u|| if ||G_u|| > bound_u.

The global norm a step reports is the pre-clip one. Checked through tfclip._core (the core's
CPU driver on NumPy arrays) and through the TF op (tfclip._loader.ops(), the CPU kernel).
"""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_close
from tfclip import _core

BF16 = ml_dtypes.bfloat16
LR = 0.1


# ------------------------------------------------------------------ the float64 reference

def units_of(x):
    """x as rows x units (the paper's units: the last axis; rank <= 1: one unit)."""
    x = np.asarray(x, np.float64)
    return x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def agc_scales(g, w, clip, eps=1e-3):
    """Per unit: (scale, clipped?) from the paper's definition, in float64."""
    gn = np.sqrt((units_of(g) ** 2).sum(axis=0))
    wn = np.sqrt((units_of(w) ** 2).sum(axis=0))
    bound = clip * np.maximum(wn, eps)
    clipped = gn > bound
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(clipped, bound / np.where(gn == 0, 1, gn), 1.0)
    return scale, clipped


def agc_clip(g, w, clip, eps=1e-3):
    """The clipped gradient in float64 (exact scale) and the unit mask of clipped units."""
    scale, clipped = agc_scales(g, w, clip, eps)
    gc = units_of(g) * scale[None, :]
    return gc.reshape(np.shape(g)), clipped


def densify(values, indices, rows):
    """An IndexedSlices gradient as tf.convert_to_tensor makes it: duplicates summed in order."""
    out = np.zeros((rows,) + values.shape[1:], values.dtype)
    for j, r in enumerate(indices):
        out[r] = (out[r] + values[j]).astype(values.dtype)
    return out


def mixed_grads(rng, shape, dtype, w):
    """Gradients whose units straddle the bound: each unit's norm a random multiple of
    clip * max(||W_u||, eps) for clip = 0.05, 1.25x .. 20x for the even units (clipped), 0.01x ..
    0.8x for the odd ones (not): far enough from the bound that no rounding decides."""
    g = rng.normal(size=shape)
    gu = units_of(g)
    wn = np.maximum(np.sqrt((units_of(w) ** 2).sum(0)), 1e-3)
    c = gu.shape[1]
    above = rng.uniform(np.log(1.25), np.log(20), size=c)
    below = rng.uniform(np.log(0.01), np.log(0.8), size=c)
    target = 0.05 * wn * np.exp(np.where(np.arange(c) % 2 == 0, above, below))
    gu = gu / np.maximum(np.sqrt((gu ** 2).sum(0)), 1e-30) * target
    return gu.reshape(shape).astype(dtype)


def run_core(vars_, grads, clip=0.05, mode="agc", rule="sgd", slots=None, hp=None, **kw):
    n = len(vars_)
    norms = np.zeros(n)
    clipped = np.zeros(n, np.int64)
    out = _core.clip_apply(rule, vars_, grads, slots or [], hp or {"learning_rate": LR}, mode, clip,
                           tensor_norms_out=norms, agc_clipped_out=clipped, **kw)
    return out, norms, clipped


SHAPES = {
    "rank0": (),
    "rank1": (37,),
    "rank2": (13, 6),
    "rank3": (4, 5, 7),
    "rank4": (3, 3, 4, 8),  # HWIO: units are the 8 output channels
    "wide": (3, 3000),      # more units than a tile's columns (kAgcMaxCols)
    "tall": (70_001, 2),    # more rows than a tile: partials over several row blocks
    # Narrow tiles of several row blocks, each summed 8 rows at a time and a remainder
    # (AgcTileSums' kAgcRowsAtOnce loop); and one long unit, summed in kTile pieces of g and w.
    "wide_blocks": (150, 1500),
    "rank1_long": (5003,),
}
DTYPES = {
    "float32": (np.float32, np.float32),
    "float64": (np.float64, np.float64),
    "bfloat16": (BF16, BF16),
    "bf16_grad_f32_var": (np.float32, BF16),
}


@pytest.mark.parametrize("dt", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_core_matches_paper_reference(rng, shape, dt):
    vdt, gdt = dt
    w0 = rng.normal(size=shape).astype(vdt)
    g = mixed_grads(rng, shape, gdt, w0.astype(np.float64))
    gc, clipped = agc_clip(g, w0, 0.05)
    v = w0.copy()
    (norm, applied), norms, nclipped = run_core([v], [g])
    assert applied
    # The reported norms are the pre-clip ones.
    g64 = np.asarray(g, np.float64)
    np.testing.assert_allclose(norm, np.sqrt((g64 ** 2).sum()), rtol=1e-12)
    np.testing.assert_allclose(norms[0], np.sqrt((g64 ** 2).sum()), rtol=1e-12)
    assert nclipped[0] == clipped.sum()
    if clipped.size > 1:  # (mixed_grads puts units on both sides)
        assert 0 < clipped.sum() < clipped.size, "the data must have units on both sides"
    want = np.asarray(w0, np.float64) - LR * gc
    name = "bfloat16" if BF16 in (vdt, gdt) else np.dtype(vdt).name
    # bfloat16: the gradient is rounded to bfloat16 after the scale (as TF), and the var too.
    assert_close(np.asarray(v, np.float64), want, name, scale=2)
    # Units under the bound are untouched: the same bits as the step without any clip.
    v_none = w0.copy()
    _core.clip_apply("sgd", [v_none], [g], [], {"learning_rate": LR})
    vu, nu = units_of(v), units_of(v_none)
    np.testing.assert_array_equal(vu[:, ~clipped], nu[:, ~clipped])


def test_spike_is_clipped_back_per_unit(rng):
    """A step whose gradients are x100 is clipped back to each unit's bound; a unit with zero
    weights gets the eps floor; normal units stay as they are."""
    w = rng.normal(size=(20, 8))
    w[:, 3] = 0.0  # a zero-initialized unit: bound clip * eps
    g = mixed_grads(rng, (20, 8), np.float64, w)
    scale, clipped = agc_scales(g, w, 0.05)
    spike = g * 100.0
    v = w.copy()
    (_, applied), _, nclipped = run_core([v], [spike])
    assert applied
    step = units_of((w - v) / LR)
    step_norm = np.sqrt((step ** 2).sum(0))
    bound = 0.05 * np.maximum(np.sqrt((units_of(w) ** 2).sum(0)), 1e-3)
    s_scale, s_clipped = agc_scales(spike, w, 0.05)
    assert nclipped[0] == s_clipped.sum() and s_clipped.sum() > clipped.sum()
    np.testing.assert_allclose(step_norm[s_clipped], bound[s_clipped], rtol=1e-12)
    np.testing.assert_allclose(step_norm[3], 0.05 * 1e-3, rtol=1e-12)
    # Units that even x100 leaves under the bound keep the spike itself.
    np.testing.assert_allclose(step[:, ~s_clipped], units_of(spike)[:, ~s_clipped], rtol=1e-12)


def test_agc_eps_and_bound_follow_the_paper(rng):
    """eps floors ||W_u||: a bigger eps lets more through; clip scales the bound linearly."""
    w = np.zeros((4, 3))
    g = np.full((4, 3), 0.01)  # each unit's norm 0.02
    for eps, clip, want_clipped in [(1e-3, 1.0, 3), (0.05, 1.0, 0), (1e-3, 30.0, 0), (1e-3, 19.0, 3)]:
        v = w.copy()
        _, _, nclipped = run_core([v], [g], clip=clip, agc_eps=eps)
        assert nclipped[0] == want_clipped, (eps, clip)
        np.testing.assert_allclose(-v / LR, agc_clip(g, w, clip, eps)[0], rtol=1e-12)


@pytest.mark.parametrize("rule,slots,hp", [
    ("sgd", 0, {"learning_rate": LR}),
    ("adam", 2, {"learning_rate": 0.01, "step": 1}),
])
@pytest.mark.parametrize("vshape,units", [((12, 4), 4), ((9, 2, 3), 3), ((15,), 1)])
def test_indexed_slices_clip_as_the_dense_gradient(rng, rule, slots, hp, vshape, units):
    """IndexedSlices with duplicate rows: the unit norms are the densified gradient's, so the
    step is the dense gradient's step (to rounding: duplicates are clipped then summed)."""
    w0 = rng.normal(size=vshape).astype(np.float32)
    idx = np.array([1, 4, 1, 0, 4, 4, 7], np.int64)
    # Even units far over their bound, odd ones far under it (a rank-1 variable: one unit, over).
    per_unit = np.where(np.arange(units) % 2 == 0, 3.0, 1e-3)
    values = (rng.normal(size=(len(idx),) + vshape[1:]) * per_unit).astype(np.float32)
    dense = densify(values, idx, vshape[0])
    outs = []
    for sparse in (True, False):
        v = w0.copy()
        sl = [[np.zeros_like(w0)] for _ in range(slots)]
        kw = {"indices": [idx]} if sparse else {}
        (norm, applied), norms, nclipped = run_core([v], [values if sparse else dense], clip=0.05,
                                                    rule=rule, slots=sl, hp=hp, **kw)
        assert applied
        outs.append((v, norm, norms[0], nclipped[0]))
    (vs, ns, tns, cs), (vd, nd, tnd, cd) = outs
    _, clipped = agc_clip(dense, w0, 0.05)
    assert cs == cd == clipped.sum() and 0 < clipped.sum()
    np.testing.assert_allclose(vs, vd, rtol=2e-6, atol=1e-6)
    # The norms reported are as in every mode: an IndexedSlices' is its values' (duplicates
    # counted apart, as tf.linalg.global_norm of the IndexedSlices).
    np.testing.assert_allclose(tns, np.sqrt((values.astype(np.float64) ** 2).sum()), rtol=1e-12)
    np.testing.assert_allclose(ns, tns, rtol=1e-12)
    if rule == "sgd":
        want = w0.astype(np.float64) - LR * agc_clip(dense, w0, 0.05)[0]
        assert_close(vs, want, "float32", scale=2)


@pytest.mark.parametrize("policy", ["skip", "raise", "propagate"])
def test_nonfinite_policies(rng, policy):
    w0 = [rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)]
    g = [rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)]
    g[0][2, 1] = np.nan
    vs = [x.copy() for x in w0]
    if policy == "raise":
        with pytest.raises(ValueError, match="non-finite"):
            run_core(vs, g, nonfinite=policy)
        for a, b in zip(vs, w0):
            np.testing.assert_array_equal(a, b)
        return
    (norm, applied), norms, nclipped = run_core(vs, g, nonfinite=policy)
    assert np.isnan(norm) and np.isnan(norms[0]) and np.isfinite(norms[1])
    # The NaN unit counts as clipped (its scale is not 1), beside the clipped finite ones.
    assert nclipped[0] == 1 + agc_scales(np.delete(g[0], 1, axis=1), np.delete(w0[0], 1, axis=1), 0.05)[1].sum()
    if policy == "skip":
        assert not applied
        for a, b in zip(vs, w0):
            np.testing.assert_array_equal(a, b)
    else:
        assert applied
        # A NaN unit norm makes its whole unit NaN (column 1 of the first tensor), as optax's
        # adaptive_grad_clip and clip_by_norm; the other tensor and units are clipped as usual.
        assert np.isnan(vs[0][:, 1]).all() and np.isfinite(np.delete(vs[0], 1, axis=1)).all()
        np.testing.assert_allclose(vs[1], w0[1] - LR * agc_clip(g[1], w0[1], 0.05)[0], rtol=2e-6)


def test_many_tensors_and_units_spanning_chunks(rng):
    """1200 small tensors and big ones whose units span apply chunks (65536 elements) and norm
    tiles: every tensor against the reference."""
    shapes = [(i % 5 + 1, i % 3 + 1) for i in range(1200)] + [(40_000, 3), (300, 1000), (100_003,)]
    w0 = [rng.normal(size=s) for s in shapes]
    g = [mixed_grads(rng, s, np.float64, w) for s, w in zip(shapes, w0)]
    vs = [x.copy() for x in w0]
    (norm, applied), norms, nclipped = run_core(vs, g)
    assert applied
    np.testing.assert_allclose(norm, np.sqrt(sum((x ** 2).sum() for x in g)), rtol=1e-12)
    for v, w, gg, k in zip(vs, w0, g, nclipped):
        gc, clipped = agc_clip(gg, w, 0.05)
        assert k == clipped.sum()
        np.testing.assert_allclose(v, w - LR * gc, rtol=1e-12, atol=1e-15)


def test_same_bits_for_any_thread_count(rng):
    shapes = [(200_001, 3), (5000, 70), (1_000_003,), (3, 2000)]
    w0 = [rng.normal(size=s).astype(np.float32) for s in shapes]
    g = [mixed_grads(rng, s, np.float32, w.astype(np.float64)) for s, w in zip(shapes, w0)]
    results = []
    try:
        for n in (1, 2, 3, 8):
            _core.set_num_threads(n)
            vs = [x.copy() for x in w0]
            (norm, _), norms, nclipped = run_core(vs, g)
            results.append((norm, norms.tobytes(), nclipped.tobytes(), b"".join(v.tobytes() for v in vs)))
    finally:
        _core.set_num_threads(0)
    assert all(r == results[0] for r in results)


def test_trust_ratio_rule_sees_the_clipped_gradient(rng):
    """A rule with its own pass (Lamb) gets the per-unit clipped gradient: the same step as
    unclipped Lamb on the reference-clipped gradient."""
    w0 = rng.normal(size=(30, 5))
    g = mixed_grads(rng, (30, 5), np.float64, w0)
    hp = {"learning_rate": 0.01, "step": 1}
    v1, v2 = w0.copy(), w0.copy()
    s1 = [[np.zeros_like(w0)], [np.zeros_like(w0)]]
    s2 = [[np.zeros_like(w0)], [np.zeros_like(w0)]]
    run_core([v1], [g], rule="lamb", slots=s1, hp=hp)
    _core.clip_apply("lamb", [v2], [agc_clip(g, w0, 0.05)[0]], s2, hp)
    np.testing.assert_allclose(v1, v2, rtol=1e-12, atol=1e-15)


def test_use_norm_reports_it_and_still_clips_per_unit(rng):
    w0 = rng.normal(size=(6, 4))
    g = mixed_grads(rng, (6, 4), np.float64, w0)
    v = w0.copy()
    (norm, applied), norms, _ = run_core([v], [g], use_norm=123.0)
    assert norm == 123.0 and applied
    np.testing.assert_allclose(norms[0], np.sqrt((g ** 2).sum()), rtol=1e-12)
    np.testing.assert_allclose(v, w0 - LR * agc_clip(g, w0, 0.05)[0], rtol=1e-12)


def test_clip_zero_is_no_clip(rng):
    w0 = rng.normal(size=(6, 4))
    g = mixed_grads(rng, (6, 4), np.float64, w0) * 100
    v = w0.copy()
    _, _, nclipped = run_core([v], [g], clip=0.0)
    assert nclipped[0] == 0
    np.testing.assert_array_equal(v, w0 - LR * g)


@pytest.mark.parametrize("kw,match", [
    ({"clip": -1.0}, r"clip_factor \(agc\) must be finite and >= 0"),
    ({"clip": float("nan")}, r"clip_factor \(agc\) must be finite"),
    ({"agc_eps": -1e-3}, "agc_eps must be finite and >= 0"),
    ({"agc_eps": float("inf")}, "agc_eps must be finite and >= 0"),
])
def test_bad_numbers_write_nothing(rng, kw, match):
    w0 = rng.normal(size=(6, 4))
    v = w0.copy()
    args = dict(clip=0.05)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        run_core([v], [w0.copy()], **args)
    np.testing.assert_array_equal(v, w0)


def test_clipped_out_is_checked():
    v = np.zeros(3)
    with pytest.raises(ValueError, match="agc_clipped_out must be"):
        _core.clip_apply("sgd", [v], [np.ones(3)], [], {"learning_rate": 0.1}, "agc", 0.05,
                         agc_clipped_out=np.zeros(2, np.int64))


# ------------------------------------------------------------------ the TF op (CPU kernel)

F64 = tf.float64


def _ops():
    from tfclip import _loader
    return _loader.ops()


def raw_sgd(variables, grads, clip=0.05, indices=(), sparse=(), **kw):
    return _ops().tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], 
        var=[v.handle for v in variables], grad=grads, lr=tf.constant(LR, F64),
        weight_decay=tf.constant(0.0, F64), clip=tf.constant(clip, F64),
        use_norm=tf.constant(0.0, F64), indices=list(indices), sparse=list(sparse), iterations=[],
        clip_mode="agc", **kw)


TF_DTYPES = {
    "float32": (np.float32, np.float32, tf.float32, tf.float32),
    "float64": (np.float64, np.float64, tf.float64, tf.float64),
    "bf16_grad_f32_var": (np.float32, BF16, tf.float32, tf.bfloat16),
}


@pytest.mark.parametrize("dt", TF_DTYPES.values(), ids=TF_DTYPES.keys())
def test_tf_op_matches_reference_and_core(rng, dt):
    vdt, gdt, tvdt, tgdt = dt
    shapes = list(SHAPES.values())
    w0 = [rng.normal(size=s).astype(vdt) for s in shapes]
    g = [mixed_grads(rng, s, gdt, w.astype(np.float64)) for s, w in zip(shapes, w0)]
    tvars = [tf.Variable(w, dtype=tvdt) for w in w0]
    norm, applied, tnorms, cunits = raw_sgd(tvars, [tf.constant(x, dtype=tgdt) for x in g])
    assert bool(applied)
    g64 = [np.asarray(x, np.float64) for x in g]
    np.testing.assert_allclose(float(norm), np.sqrt(sum((x ** 2).sum() for x in g64)), rtol=1e-6)
    np.testing.assert_allclose(tnorms.numpy(), [np.sqrt((x ** 2).sum()) for x in g64], rtol=1e-6)
    assert cunits.dtype == tf.int64 and cunits.shape == [len(shapes)]
    np.testing.assert_array_equal(cunits.numpy(), [agc_scales(x, w, 0.05)[1].sum() for x, w in zip(g, w0)])
    cvars = [w.copy() for w in w0]
    _, _, core_clipped = run_core(cvars, g)
    np.testing.assert_array_equal(cunits.numpy(), core_clipped)
    name = "bfloat16" if gdt is BF16 else np.dtype(vdt).name
    for tv, cv, w, gg in zip(tvars, cvars, w0, g):
        # The op and _core run the same core step: the same bits.
        np.testing.assert_array_equal(tv.numpy(), cv)
        assert_close(tv.numpy(), np.asarray(w, np.float64) - LR * agc_clip(gg, w, 0.05)[0], name, scale=2)


def test_tf_op_indexed_slices_and_eps_attr(rng):
    """The op's IndexedSlices path (duplicate rows) against its dense gradient, and agc_eps
    reaching the core (a zero unit's bound is clip * eps)."""
    w0 = rng.normal(size=(10, 3)).astype(np.float32)
    w0[:, 2] = 0.0
    idx = np.array([3, 1, 3, 8], np.int64)
    values = (rng.normal(size=(4, 3)) * [0.001, 1.0, 1.0]).astype(np.float32)
    dense = densify(values, idx, 10)
    eps = 2.0 ** -6  # exact in the op's float32 attr
    vs, vd = tf.Variable(w0), tf.Variable(w0)
    raw_sgd([vs], [tf.constant(values)], indices=[tf.constant(idx)], sparse=[0], agc_eps=eps)
    raw_sgd([vd], [tf.constant(dense)], agc_eps=eps)
    np.testing.assert_allclose(vs.numpy(), vd.numpy(), rtol=2e-6, atol=1e-7)
    gc, clipped = agc_clip(dense, w0, 0.05, eps)
    assert clipped[1] and clipped[2] and not clipped[0]
    assert_close(vs.numpy(), w0.astype(np.float64) - LR * gc, "float32", scale=2)
    step = (w0 - vd.numpy()) / LR
    np.testing.assert_allclose(np.sqrt((step[:, 2].astype(np.float64) ** 2).sum()), 0.05 * eps, rtol=1e-5)


def test_tf_op_nonfinite_skip_and_bad_eps(rng):
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    v = tf.Variable(w0)
    g = np.ones((4, 3), np.float32)
    g[1, 1] = np.inf
    norm, applied, _, cunits = raw_sgd([v], [tf.constant(g)], nonfinite="skip")
    assert not bool(applied) and np.isinf(float(norm))
    # Written for the skipped step too: the units it would have clipped (the inf unit among them).
    assert cunits.numpy()[0] == agc_scales(g, w0, 0.05)[1].sum() >= 1
    np.testing.assert_array_equal(v.numpy(), w0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="agc_eps must be finite and >= 0"):
        raw_sgd([v], [tf.constant(w0)], agc_eps=-1.0)
    np.testing.assert_array_equal(v.numpy(), w0)


def test_opcall_clip_config_accepts_agc():
    from tfclip._engine import opcall as _opcall
    assert _opcall.clip_config(agc_clip_factor=0.01) == ("agc", 0.01)
    assert _opcall.clip_config(agc_clip_factor=0) == ("none", 0.0)
    with pytest.raises(ValueError, match="at most one"):
        _opcall.clip_config(global_clipnorm=1.0, agc_clip_factor=0.01)
    with pytest.raises(ValueError, match="agc_clip_factor must be a finite number"):
        _opcall.clip_config(agc_clip_factor=-1.0)
    assert _opcall.check_agc_eps(1e-3) == 1e-3
    with pytest.raises(ValueError, match="agc_eps must be a finite number >= 0"):
        _opcall.check_agc_eps(float("nan"))


# ------------------------------------------------------------------ XLA (jit_compile, CPU)

def test_xla_same_bits_as_the_op(rng):
    """Under tf.function(jit_compile=True) the op's XLA kernel runs the same core step through
    its custom calls (in groups of variables, each with the norm call's global norm): the same
    bits as the eager op, IndexedSlices included."""
    shapes = [(13, 6), (37,), (3, 3, 4, 8), (), (40_000, 3)]
    w0 = [rng.normal(size=s).astype(np.float32) for s in shapes]
    g = [mixed_grads(rng, s, np.float32, w.astype(np.float64)) for s, w in zip(shapes, w0)]
    idx = np.array([2, 0, 2, 5], np.int64)
    sw0 = rng.normal(size=(8, 4)).astype(np.float32)
    sval = (rng.normal(size=(4, 4)) * [3.0, 1e-3, 3.0, 1e-3]).astype(np.float32)
    eps = 2.0 ** -7

    def step(variables, grads):
        return raw_sgd(variables, grads + [tf.constant(sval)], indices=[tf.constant(idx)],
                       sparse=[len(grads)], agc_eps=eps)

    ev = [tf.Variable(w) for w in w0] + [tf.Variable(sw0)]
    xv = [tf.Variable(w) for w in w0] + [tf.Variable(sw0)]
    gs = [tf.constant(x) for x in g]
    en, ea, et, ec = step(ev, gs)
    xn, xa, xt, xc = tf.function(step, jit_compile=True)(xv, gs)
    assert bool(ea) and bool(xa)
    np.testing.assert_array_equal(en.numpy(), xn.numpy())
    np.testing.assert_array_equal(et.numpy(), xt.numpy())
    np.testing.assert_array_equal(ec.numpy(), xc.numpy())
    want = [agc_scales(x, w, 0.05)[1].sum() for x, w in zip(g, w0)]
    want.append(agc_scales(densify(sval, idx, 8), sw0, 0.05, eps)[1].sum())
    np.testing.assert_array_equal(xc.numpy(), want)
    for a, b in zip(ev, xv):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # And the reference, for the dense ones.
    for v, w, gg in zip(xv, w0, g):
        assert_close(v.numpy(), w.astype(np.float64) - LR * agc_clip(gg, w, 0.05)[0], "float32", scale=2)


# ------------------------------------------------------------------ the clipped_units output

def ref_counts(grads, variables, clip, eps=1e-3):
    """Each tensor's count of units with ||g_u|| > clip * max(||w_u||, eps), in float64, from the
    definition (units: every axis but the last; the whole tensor for rank <= 1)."""
    out = []
    for g, w in zip(grads, variables):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.ndim <= 1:
            gn, wn = np.array([np.sqrt((g64 ** 2).sum())]), np.array([np.sqrt((w64 ** 2).sum())])
        else:
            axes = tuple(range(g64.ndim - 1))
            gn, wn = np.sqrt((g64 ** 2).sum(axis=axes)), np.sqrt((w64 ** 2).sum(axis=axes))
        out.append(int((gn > clip * np.maximum(wn, eps)).sum()))
    return np.array(out, np.int64)


COUNT_CASES = [  # (variable dtype, gradient dtype, shape): ranks 0-4, mixed dtypes in one step
    (tf.float32, tf.float32, ()),
    (tf.float64, tf.float64, (29,)),
    (tf.float32, tf.bfloat16, (11, 6)),
    (tf.float32, tf.float32, (4, 5, 7)),
    (tf.float64, tf.float64, (3, 3, 4, 8)),
    (tf.float32, tf.float32, (2, 1500)),
]


@pytest.mark.parametrize("how", ["eager", "function", "jit"])
def test_clipped_units_output_against_reference(rng, how):
    """The apply op's clipped_units: each tensor's count from the float64 reference, dense and
    IndexedSlices gradients (duplicate rows: the densified gradient's units), eagerly, in a
    tf.function and under jit_compile=True (the XLA kernel's groups concatenated)."""
    w0 = [rng.normal(size=s) for _, _, s in COUNT_CASES]
    g = [mixed_grads(rng, s, np.float64, w) for (_, _, s), w in zip(COUNT_CASES, w0)]
    idx = np.array([5, 0, 5, 2, 9], np.int64)
    sw0 = rng.normal(size=(10, 6)).astype(np.float32)
    sval = (rng.normal(size=(5, 6)) * [3.0, 1e-3, 3.0, 3.0, 1e-3, 1e-3]).astype(np.float32)
    vdts = [c[0] for c in COUNT_CASES] + [tf.float32]
    # The values as the op sees them (bfloat16 rounded), for the reference.
    gs = [tf.cast(tf.constant(x), gd) for x, (_, gd, _) in zip(g, COUNT_CASES)]
    wv = [tf.cast(tf.constant(w), vd) for w, (vd, _, _) in zip(w0, COUNT_CASES)]
    tvars = [tf.Variable(w) for w in wv] + [tf.Variable(sw0)]

    def step(grads):
        return raw_sgd(tvars, grads + [tf.constant(sval)], indices=[tf.constant(idx)], sparse=[len(grads)])

    fn = {"eager": step, "function": tf.function(step), "jit": tf.function(step, jit_compile=True)}[how]
    _, applied, tnorms, cunits = fn(gs)
    assert bool(applied) and cunits.dtype == tf.int64 and cunits.shape == [len(tvars)]
    want = ref_counts([x.numpy() for x in gs] + [densify(sval, idx, 10)], [w.numpy() for w in wv] + [sw0], 0.05)
    units = [1, 1] + [s[-1] for _, _, s in COUNT_CASES[2:]] + [6]
    assert 0 < want.sum() < sum(units), "the data must have units on both sides"
    np.testing.assert_array_equal(cunits.numpy(), want)
    assert [v.dtype for v in tvars] == vdts


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_units_zero_in_other_modes(rng, jit):
    """global_norm (and the other modes): every count 0, even where AGC would have clipped."""
    w0 = [rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)]
    g = [mixed_grads(rng, w.shape, np.float32, w.astype(np.float64)) * 100 for w in w0]
    tvars = [tf.Variable(w) for w in w0]
    for mode in ("global_norm", "norm", "value", "none"):
        def step():
            return _ops().tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], 
                var=[v.handle for v in tvars], grad=[tf.constant(x) for x in g], lr=tf.constant(LR, F64),
                weight_decay=tf.constant(0.0, F64), clip=tf.constant(1.0, F64),
                use_norm=tf.constant(0.0, F64), indices=[], sparse=[], iterations=[], clip_mode=mode)
        _, _, _, cunits = (tf.function(step, jit_compile=True) if jit else step)()
        np.testing.assert_array_equal(cunits.numpy(), [0, 0], err_msg=mode)


def test_fused_clip_apply_result_clipped_units(rng):
    """fused_clip_apply(clip=AGC) gives result.clipped_units aligned with tensor_norms (a None
    gradient's pair left out), and zeros with global_clipnorm."""
    import tfclip
    from tfclip import clipping

    w0 = [rng.normal(size=(8, 3)), rng.normal(size=(7,)), rng.normal(size=(2, 3, 5))]
    g = [mixed_grads(rng, w.shape, np.float64, w) for w in w0]
    tvars = [tf.Variable(w) for w in w0] + [tf.Variable(np.ones(3))]
    rule = tfclip.rules.SGD(learning_rate=LR)
    res = tfclip.fused_clip_apply(list(zip([tf.constant(x) for x in g] + [None], tvars)), rule,
                                  clip=clipping.AGC(clip_factor=0.05))
    assert res.clipped_units.dtype == tf.int64 and res.clipped_units.shape == [3]
    np.testing.assert_array_equal(res.clipped_units.numpy(), ref_counts(g, w0, 0.05))
    res = tfclip.fused_clip_apply(list(zip([tf.constant(x) for x in g], tvars[:3])), rule, global_clipnorm=1.0)
    np.testing.assert_array_equal(res.clipped_units.numpy(), [0, 0, 0])
