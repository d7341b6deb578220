"""Stochastic rounding of bfloat16 variables on CUDA (issue 47; csrc/core/rounding.h), against
the CPU driver bit for bit: the random bits are Philox4x32-10's of (seed, step, the variable's
position, the element), so the kernels' every path (the aligned four-element groups, the tail,
AnyGrad gradients, IndexedSlices rows, Lamb's trust pass) must draw the CPU's bits for each
element. The clip factor is the same on both (no norm clip, clip-by-value, or a global-norm clip
on a given norm: the norm pass sums in another order on the device)."""
import numpy as np
import pytest

from gpu_arrays import BF16, assert_same_bits, core, to_dev, to_host

CHUNK = core.cuda_chunk_elems
# Sizes for every path: a tail shorter than a vector, odd sizes, several chunks.
SHAPES = [(7,), (300,), (33, 17), (2 * CHUNK + 301,), ()]
RULES = {
    "sgd": ({"lr": 0.01}, 0),
    "momentum": ({"lr": 0.01, "momentum": 0.9, "use_nesterov": True}, 1),
    "adam": ({"lr": 0.003, "step": 3.0, "weight_decay": 0.01}, 2),
    "lion": ({"lr": 0.001, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.01}, 1),
    "lamb": ({"lr": 0.01, "step": 2.0, "weight_decay": 0.01}, 2),
}
SEED, STEP = 12345 + 7 * 2 ** 32, 41.0


@pytest.fixture
def rng():
    return np.random.default_rng(23)


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _state(rng, nslots, shapes=SHAPES):
    vars0 = [np.asarray(rng.normal(size=s), BF16) for s in shapes]
    slots0 = [[np.asarray(np.abs(rng.normal(size=s)) * 0.1, BF16) for s in shapes] for _ in range(nslots)]
    return vars0, slots0


def _cpu(rule, vars0, slots0, grads, hp, rounding, **kw):
    v = [x.copy() for x in vars0]
    s = [[x.copy() for x in lst] for lst in slots0]
    r = core.clip_apply(rule, v, grads, s, hp, rounding=rounding, **kw)
    return r, v, s


def _cuda(rule, vars0, slots0, grads, hp, rounding, **kw):
    v = [to_dev(x) for x in vars0]
    s = [[to_dev(x) for x in lst] for lst in slots0]
    r = core.cuda_clip_apply(rule, v, [to_dev(g) for g in grads], s, hp, rounding=rounding, **kw)
    return r, [to_host(x, BF16) for x in v], [[to_host(x, BF16) for x in lst] for lst in s]


def _same(cpu, cuda):
    (_, cv, cs), (_, gv, gs) = cpu, cuda
    for k, (a, b) in enumerate(zip(cv + sum(cs, []), gv + sum(gs, []))):
        assert_same_bits(_bits(a), _bits(b), k)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("gdtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode,clip,use_norm", [("none", 0.0, None), ("value", 0.02, None),
                                                ("global_norm", 0.5, 3.0)])
def test_cuda_draws_the_cpu_bits(rng, rule, gdtype, mode, clip, use_norm):
    hp, nslots = RULES[rule]
    vars0, slots0 = _state(rng, nslots)
    gd = BF16 if gdtype == "bfloat16" else np.float32
    grads = [np.asarray(rng.normal(size=s) * 0.05, gd) for s in SHAPES]
    kw = dict(clip_mode=mode, clip=clip, use_norm=use_norm)
    cpu = _cpu(rule, vars0, slots0, grads, hp, (SEED, STEP), **kw)
    _same(cpu, _cuda(rule, vars0, slots0, grads, hp, (SEED, STEP), **kw))
    # ... and the rounding is stochastic there: round to nearest gives other bits somewhere.
    nearest = _cpu(rule, vars0, slots0, grads, hp, None, **kw)
    assert any((_bits(a) != _bits(b)).any() for a, b in zip(cpu[1], nearest[1]))


@pytest.mark.parametrize("rule", ["sgd", "adam", "lamb"])
def test_cuda_indexed_slices_rows(rng, rule):
    """IndexedSlices gradients (duplicate rows, all-rows and lazy passes): each row's elements
    draw by their place in the variable."""
    hp, nslots = RULES[rule]
    shapes = [(40, 9), (300, 33)]
    vars0, slots0 = _state(rng, nslots, shapes)
    idx = [np.array([3, 7, 3, 39], np.int64), np.array([0, 299, 150, 150, 2], np.int64)]
    grads = [np.asarray(rng.normal(size=(len(i), s[1])) * 0.05, BF16) for i, s in zip(idx, shapes)]
    for lazy in (False, True):
        cpu = _cpu(rule, vars0, slots0, grads, hp, (SEED, STEP), indices=idx, lazy=lazy)
        _same(cpu, _cuda(rule, vars0, slots0, grads, hp, (SEED, STEP), indices=idx, lazy=lazy))


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_cuda_agc(rng, rule):
    """AGC's pass (ApplyRangeAgc): with a clip factor that scales no unit (every scale exactly 1,
    whatever order the unit sums take) the device draws the CPU's bits; with one that clips
    (the unit sums in another order), each element is the device's own round-to-nearest value or
    its neighbour."""
    hp, nslots = RULES[rule]
    vars0, slots0 = _state(rng, nslots, [(64, 33), (5000,)])
    grads = [np.asarray(rng.normal(size=v.shape) * 0.01, BF16) for v in vars0]
    kw = dict(clip_mode="agc", clip=1e6)
    _same(_cpu(rule, vars0, slots0, grads, hp, (SEED, STEP), **kw), _cuda(rule, vars0, slots0, grads, hp, (SEED, STEP), **kw))
    kw = dict(clip_mode="agc", clip=0.01)
    _, sr, _ = _cuda(rule, vars0, slots0, grads, hp, (SEED, STEP), **kw)
    _, rn, _ = _cuda(rule, vars0, slots0, grads, hp, None, **kw)
    for a, b in zip(sr, rn):
        d = _bits(a).astype(np.int64) - _bits(b).astype(np.int64)
        assert np.isin(d, (-1, 0, 1)).all() and (d != 0).any()


def test_cuda_rounding_read_on_the_device(rng):
    """The seed and step as device scalars (a step counter on the GPU): the same bits; a bad
    one writes nothing and, with nonfinite='raise', is the error naming it."""
    hp, nslots = RULES["adam"]
    vars0, slots0 = _state(rng, nslots)
    grads = [np.asarray(rng.normal(size=s) * 0.05, BF16) for s in SHAPES]
    host = _cuda("adam", vars0, slots0, grads, hp, (SEED, STEP))
    dev = _cuda("adam", vars0, slots0, grads, hp, (to_dev(np.array([float(SEED)])), to_dev(np.array([STEP]))))
    _same(host, dev)
    bad = _cuda("adam", vars0, slots0, grads, hp, (to_dev(np.array([float(SEED)])), to_dev(np.array([1.5]))))
    assert not bad[0][1]
    for a, b in zip(bad[1], vars0):
        assert_same_bits(_bits(a), _bits(b))
    with pytest.raises(ValueError, match="stochastic rounding's seed must be an integer in"):
        _cuda("adam", vars0, slots0, grads, hp, (to_dev(np.array([-1.0])), to_dev(np.array([1.0]))),
              nonfinite="raise")
    with pytest.raises(ValueError, match="stochastic rounding's step must be an integer in"):
        _cuda("adam", vars0, slots0, grads, hp, (SEED, 2.0 ** 60))
