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
