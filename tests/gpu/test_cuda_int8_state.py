"""int8 optimizer state on CUDA (issue 47; csrc/core/cuda/apply.cu ApplyRangeQ8) against the CPU
driver, which tests/test_state_int8.py checks against the float32 step quantized by NumPy.

The device quantizes a block of 256 in one warp (a butterfly for the absmax) where the CPU loops
over it; the update and the code search are the same functions. So with no clip or a clip by
value, codes, absmax and variables match the CPU bit for bit; under a norm clip the scale comes
from a norm summed in another order (1e-12 apart), and a code may land one index over."""
import numpy as np
import pytest

import reference
from gpu_arrays import BF16, assert_same_bits, core, to_dev, to_host

CHUNK = core.cuda_chunk_elems
# A warp's chunk (<= cuda_warp_chunk_elems), a short last block, a block crew's chunks, a tail.
SHAPES = [(7,), (300,), (33, 17), (2 * CHUNK + 300,), (1,)]
RULES = {
    "momentum": ({"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, [False]),
    "adam": ({"lr": 0.01, "step": 3.0, "weight_decay": 0.01}, [False, True]),
    "adam_amsgrad": ({"lr": 0.01, "step": 3.0, "amsgrad": True}, [False, True, True]),
    "adagrad": ({"lr": 0.1}, [True]),
    "rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True, "has_momentum": True}, [True, False, False]),
    "adadelta": ({"lr": 1.0}, [True, True]),
    "adamax": ({"lr": 0.01, "step": 2.0}, [False, True]),
    "lion": ({"lr": 0.01, "weight_decay": 0.1}, [False]),
    "nadam": ({"lr": 0.01, "step": 2.0, "u_product": 0.9}, [False, True]),
    "tf_rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True}, [True, False, False]),
}


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def _state(rng, unsigned, centered=False):
    raw = [[rng.normal(size=s).astype(np.float32) * np.float32(0.1) for s in SHAPES] for _ in unsigned]
    raw = [[np.abs(x) + np.float32(0.01) for x in xs] if u else xs for xs, u in zip(raw, unsigned)]
    if centered:
        # A centered RMSprop's ms (slot 0) holds at least mg^2 (slot 2): the update keeps
        # ms - mg^2 >= 0, and independent draws below it make the step NaN, whose payload bits
        # the CPU and a GPU make differently (an H200, 2026-12-04). Twice mg^2: a margin over
        # the codes' rounding.
        raw[0] = [m + np.float32(2) * g * g for m, g in zip(raw[0], raw[2])]
    out = []
    for xs, u in zip(raw, unsigned):
        codes, absmax = [], []
        for s, x in zip(SHAPES, xs):
            q, a = reference.quantize_blockwise(x, not u)
            codes.append(q.reshape(s))
            absmax.append(a)
        out.append((codes, absmax))
    return out


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert_same_bits(a, b)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mode,clip", [("none", 0.0), ("value", 0.01), ("global_norm", 0.5), ("agc", 0.05)])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_int8_state_parity(rng, rule, mode, clip, grad_dtype):
    hp, unsigned = RULES[rule]
    name = "adam" if rule == "adam_amsgrad" else rule
    gd = BF16 if grad_dtype == "bfloat16" else np.float32
    vars_c = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    state_c = _state(rng, unsigned, hp.get("centered", False))
    vars_g = [to_dev(v) for v in vars_c]
    codes_g = [[to_dev(q) for q in st[0]] for st in state_c]
    absmax_g = [[to_dev(a) for a in st[1]] for st in state_c]
    for _ in range(2):
        grads = [rng.normal(size=s).astype(gd) for s in SHAPES]
        nc, ac = core.clip_apply(name, vars_c, grads, [st[0] for st in state_c], hp, mode, clip,
                                 absmax=[st[1] for st in state_c])
        ng, ag = core.cuda_clip_apply(name, vars_g, [to_dev(g) for g in grads], codes_g, hp, mode, clip,
                                      absmax=absmax_g)
        assert ac and ag
        np.testing.assert_allclose(ng, nc, rtol=1e-12)
    exact = mode in ("none", "value")
    for got, want in zip(vars_g, vars_c):
        g = to_host(got, np.float32)
        if exact:
            _same_bits(g, want)
        else:
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    for k, u in enumerate(unsigned):
        for i in range(len(SHAPES)):
            q, a = to_host(codes_g[k][i], np.uint8), to_host(absmax_g[k][i], np.float32)
            qc, acpu = state_c[k][0][i], state_c[k][1][i]
            if exact:
                _same_bits(q, qc)
                _same_bits(a, acpu)
            else:
                # Norm-clip scales a few ulps apart: a code one index over at most, rarely.
                np.testing.assert_allclose(a, acpu, rtol=1e-5)
                d = np.abs(q.astype(np.int32) - qc.astype(np.int32))
                assert d.max() <= 1 and d.sum() <= max(2, d.size // 500), (d.max(), d.sum())


def test_int8_state_non_finite_block_and_skip(rng):
    """A non-finite element makes its block's absmax NaN on the device as on the CPU
    ('propagate'); 'skip' writes nothing."""
    vars_c = [rng.normal(size=(600,)).astype(np.float32)]
    q, a = reference.quantize_blockwise(rng.normal(size=600).astype(np.float32) * np.float32(0.1), True)
    state_c = [([q], [a])]
    grads = [rng.normal(size=(600,)).astype(np.float32)]
    grads[0][300] = np.nan
    vars_g = [to_dev(v) for v in vars_c]
    codes_g = [[to_dev(st[0][0])] for st in state_c]
    absmax_g = [[to_dev(st[1][0])] for st in state_c]
    before = [to_host(codes_g[0][0], np.uint8).tobytes(), to_host(absmax_g[0][0], np.float32).tobytes(), to_host(vars_g[0], np.float32).tobytes()]
    _, applied = core.cuda_clip_apply("momentum", vars_g, [to_dev(grads[0])], codes_g, {"lr": 0.1}, "global_norm",
                                      1.0, absmax=absmax_g)
    assert not applied
    assert [to_host(codes_g[0][0], np.uint8).tobytes(), to_host(absmax_g[0][0], np.float32).tobytes(),
            to_host(vars_g[0], np.float32).tobytes()] == before
    core.clip_apply("momentum", vars_c, grads, [state_c[0][0]], {"lr": 0.1}, "none", 0.0, nonfinite="propagate",
                    absmax=[state_c[0][1]])
    core.cuda_clip_apply("momentum", vars_g, [to_dev(grads[0])], codes_g, {"lr": 0.1}, "none", 0.0,
                         nonfinite="propagate", absmax=absmax_g)
    a = to_host(absmax_g[0][0], np.float32)
    assert np.isnan(a[1]) and np.all(np.isfinite(a[[0, 2]]))
    _same_bits(a, state_c[0][1][0])
    _same_bits(to_host(codes_g[0][0], np.uint8), state_c[0][0][0])


def test_int8_state_refused_before_anything_runs(rng):
    v = [to_dev(np.ones(300, np.float32))]
    q = [to_dev(np.zeros(300, np.uint8)), to_dev(np.zeros(300, np.uint8))]
    a = [to_dev(np.zeros(2, np.float32)), to_dev(np.zeros(2, np.float32))]
    with pytest.raises(ValueError, match="int8 optimizer state is not supported for rule 'lamb'"):
        core.cuda_clip_apply("lamb", v, [to_dev(np.ones(300, np.float32))], [[q[0]], [q[1]]],
                             {"lr": 0.1, "step": 1.0}, absmax=[[a[0]], [a[1]]])
    assert np.all(to_host(v[0], np.float32) == 1.0) and not to_host(q[0], np.uint8).any()
