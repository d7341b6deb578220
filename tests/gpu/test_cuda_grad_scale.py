"""The loss-scale unscale folded into the CUDA passes (issue 47; ClipConfig::grad_scale, read by
the finalize kernel, csrc/core/cuda/finalize.cu), against the same device's step on NumPy's
g * s (exact for a power of two): the same kernels and summation order, so bit for bit in every
clip mode, with grad_scale a number or a device scalar; and the CPU fold (tests/test_loss_scale.py)
to the norms' 1e-12."""
import numpy as np
import pytest

from gpu_arrays import BF16, assert_same_bits, core, to_dev, to_host

CHUNK = core.cuda_chunk_elems
SHAPES = [(7,), (300,), (33, 17), (2 * CHUNK + 300,), ()]
RULES = {
    "adam": {"lr": 0.01, "step": 3.0, "weight_decay": 0.01},
    "momentum": {"lr": 0.1, "momentum": 0.9, "use_nesterov": True},
    "lamb": {"lr": 0.01, "step": 2.0, "weight_decay": 0.01},
}
SCALE = 2.0 ** -15


@pytest.fixture
def rng():
    return np.random.default_rng(17)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert_same_bits(a, b)


# (Lamb takes no int8 state: its trust ratio reads the slots back; tests/test_state_int8.py.)
@pytest.mark.parametrize("rule,state", [(r, s) for r in sorted(RULES) for s in ("float32", "bfloat16", "int8")
                                        if (r, s) != ("lamb", "int8")])
@pytest.mark.parametrize("mode,clip", [("none", 0.0), ("global_norm", 0.5), ("norm", 0.3), ("value", 0.01)])
@pytest.mark.parametrize("on_device", [False, True])
def test_grad_scale_on_the_device(rng, rule, mode, clip, state, on_device):
    hp = RULES[rule]
    nslots = {"adam": 2, "momentum": 1, "lamb": 2}[rule]
    vars0 = [np.asarray(rng.normal(size=s), np.float32) for s in SHAPES]
    grads = [np.asarray(rng.normal(size=s) / SCALE, np.float32) for s in SHAPES]
    if state == "int8":
        codes0 = [[np.asarray(rng.integers(100, 156, size=s), np.uint8) for s in SHAPES] for _ in range(nslots)]
        absmax0 = [[np.full(-(-max(int(np.prod(s)), 1) // 256), 0.1, np.float32) for s in SHAPES]
                   for _ in range(nslots)]
        slots0 = codes0
    else:
        sd = BF16 if state == "bfloat16" else np.float32
        slots0 = [[np.asarray(np.abs(rng.normal(size=s)) * 0.1, sd) for s in SHAPES] for _ in range(nslots)]
        absmax0 = None
    out = []
    for folded in (True, False):
        v = [to_dev(x) for x in vars0]
        sl = [[to_dev(x) for x in lst] for lst in slots0]
        am = None if absmax0 is None else [[to_dev(x) for x in lst] for lst in absmax0]
        g = grads if folded else [np.asarray(x * np.float32(SCALE)) for x in grads]
        gs = (to_dev(np.array([SCALE])) if on_device else SCALE) if folded else 1.0
        tn = to_dev(np.zeros(len(SHAPES)))
        r = core.cuda_clip_apply(rule, v, [to_dev(x) for x in g], sl, hp, mode, clip, absmax=am,
                                 tensor_norms_out=tn, grad_scale=gs)
        got = [to_host(x, np.float32) for x in v]
        for lst, src in zip(sl, slots0):
            got += [to_host(x, src[0].dtype) for x in lst]
        if am is not None:
            got += [to_host(x, np.float32) for lst in am for x in lst]
        out.append((r, to_host(tn, np.float64), got))
    (fr, ftn, fgot), (rr, rtn, rgot) = out
    assert fr == rr and fr[1]
    _same_bits(ftn, rtn)
    for a, b in zip(fgot, rgot):
        _same_bits(a, b)
    # And the CPU's fold, to the norm's summation order.
    if state == "float32":
        cv, cs = [x.copy() for x in vars0], [[x.copy() for x in lst] for lst in slots0]
        cn, _ = core.clip_apply(rule, cv, grads, cs, hp, clip_mode=mode, clip=clip, grad_scale=SCALE)
        np.testing.assert_allclose(fr[0], cn, rtol=1e-12)


def test_grad_scale_bad_on_the_device_writes_nothing(rng):
    """A grad_scale read on the device that is not > 0 makes the step write nothing, and with
    nonfinite='raise' is the error naming it."""
    v0 = rng.normal(size=(300,)).astype(np.float32)
    v = [to_dev(v0)]
    g = [to_dev(rng.normal(size=(300,)).astype(np.float32))]
    _, applied = core.cuda_clip_apply("sgd", v, g, [], {"lr": 0.1}, grad_scale=to_dev(np.array([0.0])))
    assert not applied
    _same_bits(to_host(v[0], np.float32), v0)
    with pytest.raises(ValueError, match="grad_scale must be finite and > 0"):
        core.cuda_clip_apply("sgd", v, g, [], {"lr": 0.1}, nonfinite="raise", grad_scale=to_dev(np.array([-1.0])))
    with pytest.raises(ValueError, match="grad_scale must be finite and > 0"):
        core.cuda_clip_apply("sgd", v, g, [], {"lr": 0.1}, grad_scale=np.inf)
    _same_bits(to_host(v[0], np.float32), v0)
