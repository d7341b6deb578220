"""The loss-scale unscale folded into the passes (issue 47): `grad_scale` (csrc/core/clip.h,
ClipConfig::grad_scale), through tfclip._core.

The definition: the step with grad_scale s is the step on the gradients g * s (mixed precision's
unscale, g / loss_scale, with s = 1 / loss_scale), without a pass that writes them. The reference
is independent of the fold: NumPy's g * s, exact for a power of two (every dynamic loss scale is
one), fed to the same step with grad_scale 1. Variables, slots, the global norm and each tensor's
norm must match it bit for bit, for every rule, clip mode and state kind; another scale within
the one rounding that multiplying the clip factor by s may move."""
import ml_dtypes
import numpy as np
import pytest

import reference
from tfclip import _core

RULES = {
    "adam": {"lr": 0.01, "step": 3.0, "weight_decay": 0.01},
    "momentum": {"lr": 0.1, "momentum": 0.9, "use_nesterov": True},
    "rmsprop": {"lr": 0.01, "momentum": 0.9, "centered": True, "has_momentum": True},
    "adagrad": {"lr": 0.1},
    "lion": {"lr": 0.01, "weight_decay": 0.1},
    "nadam": {"lr": 0.01, "step": 2.0, "u_product": 0.9},
    "lamb": {"lr": 0.01, "step": 2.0, "weight_decay": 0.01},
    "ftrl": {"lr": 0.1, "lr_power": -0.5, "l1": 0.001, "l2": 0.001},
}
MODES = [("none", 0.0), ("global_norm", 0.5), ("norm", 0.3), ("value", 0.01)]
SHAPES = [(300,), (7, 5), (), (65536 + 300,)]
SCALE = 2.0 ** -15  # Keras's initial loss scale is 2**15


def _problem(rng, rule, dtype=np.float32, scaled_by=1.0 / SCALE):
    """Variables, loss-scaled gradients (as a scaled loss gives them) and slots."""
    vars_ = [np.asarray(rng.normal(size=s), dtype) for s in SHAPES]
    grads = [np.asarray(rng.normal(size=s) * scaled_by, dtype) for s in SHAPES]
    nslots = reference.num_slots(rule, RULES[rule])
    slots = [[np.asarray(np.abs(rng.normal(size=s)) * 0.1, dtype) for s in SHAPES] for _ in range(nslots)]
    return vars_, grads, slots


def _copy(vars_, slots):
    return [v.copy() for v in vars_], [[s.copy() for s in lst] for lst in slots]


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), np.flatnonzero(a.ravel() != b.ravel())[:10]


def _both(rule, vars_, grads, slots, mode, clip, s=SCALE, **kw):
    """(folded, reference): each (vars, slots, (norm, applied), tensor norms) after one step."""
    out = []
    for folded in (True, False):
        v, sl = _copy(vars_, slots)
        tn = np.zeros(len(grads))
        g = grads if folded else [np.asarray(x * x.dtype.type(s)) for x in grads]
        r = _core.clip_apply(rule, v, g, sl, RULES[rule], clip_mode=mode, clip=clip, tensor_norms_out=tn,
                             grad_scale=s if folded else 1.0, **kw)
        out.append((v, sl, r, tn))
    return out


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mode,clip", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_scale_is_the_step_on_the_scaled_gradients(rng, rule, mode, clip, dtype):
    vars_, grads, slots = _problem(rng, rule, dtype)
    (fv, fs, fr, ftn), (rv, rs, rr, rtn) = _both(rule, vars_, grads, slots, mode, clip)
    assert fr == rr and fr[1]  # (global norm, applied)
    _same_bits(ftn, rtn)
    for a, b in zip(fv, rv):
        _same_bits(a, b)
    for la, lb in zip(fs, rs):
        for a, b in zip(la, lb):
            _same_bits(a, b)


@pytest.mark.parametrize("mode,clip", MODES)
def test_grad_scale_with_bfloat16_and_int8_state_and_indexed_slices(rng, mode, clip):
    """bf16 state, int8 state (their own tile paths) and an IndexedSlices gradient (the sparse
    pass) fold the same factor."""
    vars_, grads, slots = _problem(rng, "adam")
    bf = [[s.astype(ml_dtypes.bfloat16) for s in lst] for lst in slots]
    (fv, fs, fr, _), (rv, rs, rr, _) = _both("adam", vars_, grads, bf, mode, clip)
    assert fr == rr
    for a, b in zip(fv + sum(fs, []), rv + sum(rs, [])):
        _same_bits(a, b)
    # int8 state (the float32 variables' slots as codes and absmax)
    q = [[reference.quantize_blockwise(s, signed) for s in lst] for lst, signed in zip(slots, (True, False))]
    codes = [[c.reshape(s.shape) for (c, _), s in zip(lst, sl)] for lst, sl in zip(q, slots)]
    absmax = [[a for _, a in lst] for lst in q]
    out = []
    for folded in (True, False):
        v, c = _copy(vars_, codes)
        am = [[a.copy() for a in lst] for lst in absmax]
        g = grads if folded else [np.asarray(x * np.float32(SCALE)) for x in grads]
        r = _core.clip_apply("adam", v, g, c, RULES["adam"], clip_mode=mode, clip=clip, absmax=am,
                             grad_scale=SCALE if folded else 1.0)
        out.append((r, v + sum(c, []) + sum(am, [])))
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        _same_bits(a, b)
    # IndexedSlices: rows 1, 3, 1 of a (6, 4) variable
    var = rng.normal(size=(6, 4)).astype(np.float32)
    vals = (rng.normal(size=(3, 4)) / SCALE).astype(np.float32)
    idx = np.array([1, 3, 1], np.int64)
    res = []
    for folded in (True, False):
        v, m, w = var.copy(), np.zeros_like(var), np.zeros_like(var)
        g = vals if folded else vals * np.float32(SCALE)
        r = _core.clip_apply("adam", [v], [g], [[m], [w]], RULES["adam"], clip_mode=mode, clip=clip,
                             indices=[idx], grad_scale=SCALE if folded else 1.0)
        res.append((v, m, w, r))
    assert res[0][3] == res[1][3]
    for a, b in zip(res[0][:3], res[1][:3]):
        _same_bits(a, b)


def test_grad_scale_not_a_power_of_two_is_within_a_rounding(rng):
    """A loss scale that is no power of two (Keras takes any initial_scale): g * s is then not
    exact, and the fold multiplies the clip factor by s once: within a float32 rounding or two."""
    vars_, grads, slots = _problem(rng, "adam", scaled_by=1000.0)
    (fv, fs, fr, _), (rv, rs, rr, _) = _both("adam", vars_, grads, slots, "global_norm", 0.5, s=1.0 / 1000.0)
    # (The reference's norm is of g * s rounded to float32 element by element, the fold's of g,
    # scaled in float64: a float32 rounding apart.)
    assert fr[0] == pytest.approx(rr[0], rel=1e-6)
    for a, b in zip(fv + sum(fs, []), rv + sum(rs, [])):
        np.testing.assert_allclose(a, b, rtol=3e-6, atol=1e-9)


def test_grad_scale_non_finite_and_errors(rng):
    """An inf or NaN in the loss-scaled gradients makes the step non-finite (nothing written
    with 'skip', the norm reported inf/NaN): the loss scale's back-off case. A grad_scale that
    is not finite and > 0, or with AGC, is an error naming it, and nothing is written."""
    vars_, grads, slots = _problem(rng, "adam")
    grads[1][0, 0] = np.inf
    v, sl = _copy(vars_, slots)
    norm, applied = _core.clip_apply("adam", v, grads, sl, RULES["adam"], clip_mode="global_norm", clip=1.0,
                                     grad_scale=SCALE)
    assert norm == np.inf and not applied
    for a, b in zip(v + sum(sl, []), vars_ + sum(slots, [])):
        _same_bits(a, b)
    grads[1][0, 0] = 1.0
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="grad_scale must be finite and > 0"):
            _core.clip_apply("adam", v, grads, sl, RULES["adam"], grad_scale=bad)
    with pytest.raises(ValueError, match="does not combine with clip_mode 'agc'"):
        _core.clip_apply("adam", v, grads, sl, RULES["adam"], clip_mode="agc", clip=0.01, grad_scale=SCALE)
    for a, b in zip(v + sum(sl, []), vars_ + sum(slots, [])):
        _same_bits(a, b)


# ---------------------------------------------------------------- the op: tfclip.fused_clip_apply
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
from tfclip import _loader  # noqa: E402

TF_RULES = {
    "adam": lambda: tfclip.rules.Adam(0.01, amsgrad=True),
    "sgd_momentum": lambda: tfclip.rules.SGD(0.05, momentum=0.9, nesterov=True),
    "lamb": lambda: tfclip.rules.Lamb(0.01, weight_decay=0.01),
    "adam_int8": lambda: tfclip.rules.Adam(0.01, state_dtype="int8"),
}


def _tf_problem(rng):
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30), ()]]
    grads = [[np.asarray(rng.normal(size=x.shape) / SCALE, np.float32) for x in init] for _ in range(3)]
    return init, grads


def _run(make, init, grads, how, folded, **kw):
    """Three steps; the variables, the rule's state and each step's (norm, applied, tensor norms)."""
    vars_, rule = [tf.Variable(x) for x in init], make()

    def step(gs):
        if folded:
            return tfclip.fused_clip_apply(zip(gs, vars_), rule, grad_scale=tf.constant(SCALE, tf.float32), **kw)
        return tfclip.fused_clip_apply(zip([g * SCALE for g in gs], vars_), rule, **kw)

    run = {"eager": step, "function": tf.function(step), "xla": tf.function(step, jit_compile=True)}[how]
    outs = []
    for g in grads:
        r = run([tf.constant(x) for x in g])
        outs.append((float(r.global_norm), bool(r.applied), r.tensor_norms.numpy()))
    state = [v.numpy() for v in vars_] + [s.numpy() for v in vars_ for s in list(rule.slots(v).values())
                                          + list(rule.absmax(v).values())] + [rule.iterations.numpy()]
    return outs, state


@pytest.mark.parametrize("name", sorted(TF_RULES))
@pytest.mark.parametrize("how", ["eager", "function", "xla"])
@pytest.mark.parametrize("clip", [dict(global_clipnorm=1.0), dict(clipnorm=0.5), dict(clipvalue=1e-3), {}])
def test_fused_clip_apply_grad_scale_is_the_unscaled_step(rng, name, how, clip):
    """fused_clip_apply(..., grad_scale=1/scale) on loss-scaled gradients against the same call
    on the gradients TF unscaled first (g * s, exact for a power of two): the same bits, norms and
    state, eagerly, in a tf.function and under XLA (the custom calls carry it as the last scalar)."""
    if how == "xla" and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    init, grads = _tf_problem(rng)
    a = _run(TF_RULES[name], init, grads, how, True, **clip)
    b = _run(TF_RULES[name], init, grads, how, False, **clip)
    for (na, aa, ta), (nb, ab, tb) in zip(a[0], b[0]):
        assert na == nb and aa and ab
        _same_bits(ta, tb)
    for x, y in zip(a[1], b[1]):
        _same_bits(x, y)


def test_fused_clip_apply_grad_scale_with_an_adaptive_clip_and_indexed_slices(rng):
    """ZClip's threshold follows the unscaled norms (its norm op's, times the scale), and an
    IndexedSlices gradient's values are scaled as a dense one's."""
    init = rng.normal(size=(10, 4)).astype(np.float32)
    steps = [(tf.constant(rng.normal(size=(3, 4)) / SCALE, tf.float32), tf.constant([1, 7, 1])) for _ in range(4)]
    out = []
    for folded in (True, False):
        v, rule = tf.Variable(init), tfclip.rules.Adam(0.01)
        clip = tfclip.clipping.ZClip(warmup_steps=2)
        for vals, idx in steps:
            g = tf.IndexedSlices(vals if folded else vals * SCALE, idx, tf.constant([10, 4]))
            r = tfclip.fused_clip_apply([(g, v)], rule, clip=clip, **({"grad_scale": SCALE} if folded else {}))
        out.append((v.numpy(), float(r.global_norm)))
    _same_bits(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


def test_fused_clip_apply_grad_scale_non_finite_and_errors(rng):
    """An inf in the loss-scaled gradients: nothing written, the counter stays (the loss scale's
    back-off case). A bad grad_scale is an error naming it, and nothing is written."""
    v, rule = tf.Variable(rng.normal(size=(5,)).astype(np.float32)), tfclip.rules.Adam(0.01)
    before = v.numpy()
    r = tfclip.fused_clip_apply([(tf.constant([1.0, np.inf, 0, 0, 0]), v)], rule, grad_scale=SCALE)
    assert not bool(r.applied) and float(r.global_norm) == np.inf and int(rule.iterations.numpy()) == 0
    _same_bits(v.numpy(), before)
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="grad_scale must be finite and > 0"):
            tfclip.fused_clip_apply([(tf.ones([5]), v)], rule, grad_scale=bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad_scale must be finite and > 0"):
        tfclip.fused_clip_apply([(tf.ones([5]), v)], rule, grad_scale=tf.constant(0.0))
    with pytest.raises(ValueError, match="does not combine with AGC"):
        tfclip.fused_clip_apply([(tf.ones([5]), v)], rule, clip=tfclip.clipping.AGC(0.01), grad_scale=SCALE)
    _same_bits(v.numpy(), before)
    assert int(rule.iterations.numpy()) == 0
