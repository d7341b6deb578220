"""Adafactor on CUDA (csrc/core/cuda/factored.cu) against the CPU driver bit for bit: both sum
every float64 in the order csrc/core/factored.h fixes, and the per-element arithmetic is the one
AdafactorRule. Shapes cut a matrix into several tiles (column partials added over tiles) and
several matrices; every dtype pair the kernels dispatch; factored_state's scalar v; each clip
mode with the same clip factors on both (the device's norm pass sums in another order, so a
global-norm clip takes a given norm); the skip writes nothing; four launches whatever the tensor
count."""
import numpy as np
import pytest

from gpu_arrays import BF16, assert_same_bits, core, to_dev, to_host

HP = {"lr": 0.05, "beta_2_decay": -0.8, "epsilon_1": 1e-30, "epsilon_2": 1e-3, "clip_threshold": 1.0,
      "step": 3.0, "weight_decay": 0.01}
# (5000, 3): one matrix in five tiles; (2, 1500, 40): two matrices of two tiles each
SHAPES = [(7, 5), (3, 4, 6), (9,), (), (5000, 3), (2, 1500, 40), (300,)]


@pytest.fixture
def rng():
    return np.random.default_rng(31)


def _slot_shapes(shape, factored_state=False):
    if len(shape) < 2:
        return [(), (), shape]
    return [shape[:-1], shape[:-2] + shape[-1:], () if factored_state else shape]


def _state(rng, dtype, shapes=SHAPES, factored_state=False):
    vars0 = [np.asarray(rng.normal(size=s), dtype) for s in shapes]
    slots0 = [[np.asarray(np.abs(rng.normal(size=_slot_shapes(s, factored_state)[k])) * 0.1, dtype)
               for s in shapes] for k in range(3)]
    return vars0, slots0


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _both(vars0, slots0, grads, hp=HP, **kw):
    dtype = vars0[0].dtype
    cv = [x.copy() for x in vars0]
    cs = [[x.copy() for x in lst] for lst in slots0]
    rc = core.clip_apply("adafactor", cv, grads, cs, hp, **kw)
    gv = [to_dev(x) for x in vars0]
    gs = [[to_dev(x) for x in lst] for lst in slots0]
    rg = core.cuda_clip_apply("adafactor", gv, [to_dev(g) for g in grads], gs, hp, **kw)
    gv = [to_host(x, dtype) for x in gv]
    gs = [[to_host(x, dtype) for x in lst] for lst in gs]
    return (rc, cv, cs), (rg, gv, gs)


def _same(cpu, cuda):
    (_, cv, cs), (_, gv, gs) = cpu, cuda
    for k, (a, b) in enumerate(zip(cv + sum(cs, []), gv + sum(gs, []))):
        assert_same_bits(_bits(a), _bits(b), k)


@pytest.mark.parametrize("dtype,gdtype", [(np.float32, np.float32), (np.float64, np.float64),
                                          (BF16, BF16), (np.float32, np.float16), (np.float16, np.float32)],
                         ids=["f32", "f64", "bf16", "f32-f16grad", "f16-f32grad"])
def test_adafactor_cuda_same_bits_as_cpu(rng, dtype, gdtype):
    vars0, slots0 = _state(rng, dtype)
    grads = [np.asarray(rng.normal(size=s), gdtype) for s in SHAPES]
    cpu, cuda = _both(vars0, slots0, grads)
    assert cpu[0][1] and cuda[0][1]
    _same(cpu, cuda)


@pytest.mark.parametrize("mode,clip,kw", [("value", 0.3, {}), ("global_norm", 1.0, {"use_norm": 7.0}),
                                          ("norm", 0.5, {}), ("agc", 0.01, {})], ids=["value", "global", "norm", "agc"])
def test_adafactor_cuda_clip_modes_same_bits(rng, mode, clip, kw):
    vars0, slots0 = _state(rng, np.float32)
    grads = [np.asarray(rng.normal(size=s) * 3, np.float32) for s in SHAPES]
    _same(*_both(vars0, slots0, grads, clip_mode=mode, clip=clip, **kw))


def test_adafactor_cuda_factored_state_and_stochastic_rounding(rng):
    vars0, slots0 = _state(rng, BF16, factored_state=True)
    grads = [np.asarray(rng.normal(size=s), BF16) for s in SHAPES]
    cpu, cuda = _both(vars0, slots0, grads, rounding=(5.0, 3.0))
    _same(cpu, cuda)
    for s, placeholder in zip(SHAPES, cuda[2][2]):
        if len(s) >= 2:
            assert placeholder.shape == ()


def test_adafactor_cuda_skip_writes_nothing_and_launches_four_kernels(rng):
    vars0, slots0 = _state(rng, np.float32)
    grads = [np.asarray(rng.normal(size=s), np.float32) for s in SHAPES]
    cpu, cuda = _both(vars0, slots0, grads, clip_mode="global_norm", clip=1.0, use_norm=3.0)
    # norm (given: none), finalize, then the four factored kernels
    assert core.cuda_last_launches() == 5
    grads[0] = grads[0].copy()
    grads[0].flat[3] = np.nan
    cpu, cuda = _both(vars0, slots0, grads, clip_mode="global_norm", clip=1.0)
    assert not cuda[0][1] and not cpu[0][1]
    for a, b in zip(vars0 + sum(slots0, []), cuda[1] + sum(cuda[2], [])):
        assert_same_bits(_bits(a), _bits(b))
    # the same count of launches for 40 tensors as for 7
    shapes = [(6, 4)] * 40
    v40, s40 = _state(rng, np.float32, shapes)
    _both(v40, s40, [np.asarray(rng.normal(size=s), np.float32) for s in shapes],
          clip_mode="global_norm", clip=1.0, use_norm=3.0)
    assert core.cuda_last_launches() == 5


def test_adafactor_cuda_hyper_parameters_read_on_the_device(rng):
    """As TF's GPU kernel hands them over (apply_kernel.cc): every hyper-parameter a device
    scalar, the step constants made by the finalize kernel (MakeConsts on the device; t^decay in
    double, rounded once, so a GPU's pow and glibc's agree for float32 variables)."""
    vars0, slots0 = _state(rng, np.float32)
    grads = [np.asarray(rng.normal(size=s), np.float32) for s in SHAPES]
    cv = [x.copy() for x in vars0]
    cs = [[x.copy() for x in lst] for lst in slots0]
    core.clip_apply("adafactor", cv, grads, cs, HP)
    gv = [to_dev(x) for x in vars0]
    gs = [[to_dev(x) for x in lst] for lst in slots0]
    hp_dev = {k: to_dev(np.asarray(v, np.float64)) for k, v in HP.items()}
    core.cuda_clip_apply("adafactor", gv, [to_dev(g) for g in grads], gs, hp_dev)
    _same(((), cv, cs), ((), [to_host(x, np.float32) for x in gv], [[to_host(x, np.float32) for x in lst] for lst in gs]))
