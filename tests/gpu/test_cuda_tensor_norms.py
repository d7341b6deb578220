"""Per-tensor norms from the CUDA norm pass (the finalize kernel sums each tensor's partials in
chunk order) against the CPU core and NumPy float64: the global-norm, clip and apply steps, every
dtype and clip mode, IndexedSlices, skipped steps and given norms. No TensorFlow; in CI on the
emulated build (scripts/cuda_emulation.sh), on a GPU host on the device."""
import numpy as np
import pytest

from gpu_arrays import BF16, core, full, to_dev, to_host

DTYPES = {"float16": np.float16, "bfloat16": BF16, "float32": np.float32, "float64": np.float64}
CHUNK = core.cuda_chunk_elems
SHAPES = [(0,), (), (7,), (CHUNK,), (3 * CHUNK + 5,), (33, 17)] + [(i % 13 + 1,) for i in range(40)]
MODES = {"none": 0.0, "global_norm": 1.0, "norm": 0.3, "value": 0.01}


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def rand(rng, shape, dtype):
    return np.array(rng.normal(size=shape), dtype=dtype, ndmin=0).reshape(shape)


def np_norms(ts):
    return np.array([np.sqrt(np.sum(np.asarray(t, np.float64) ** 2)) for t in ts])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("out_dtype", [np.float64, np.float32])
def test_global_norm_tensor_norms(rng, dtype, out_dtype):
    ts = [rand(rng, s, DTYPES[dtype]) for s in SHAPES]
    out = full((len(ts),), np.nan, out_dtype)  # poisoned: every entry must be written
    norm = core.cuda_global_norm([to_dev(t) for t in ts], tensor_norms_out=out)
    got = to_host(out, out_dtype).astype(np.float64)
    cpu = np.empty(len(ts))
    assert core.global_norm(ts, tensor_norms_out=cpu) == pytest.approx(norm, rel=1e-12)
    if out_dtype == np.float64:
        np.testing.assert_allclose(got, np_norms(ts), rtol=1e-12, atol=0)
        np.testing.assert_allclose(got, cpu, rtol=1e-12, atol=0)
    else:
        np.testing.assert_allclose(got, np_norms(ts).astype(np.float32), rtol=6e-8, atol=0)
    np.testing.assert_allclose(np.sqrt(np.sum(got ** 2)), norm, rtol=1e-6)


def test_tensor_norms_same_bits_over_runs(rng):
    ts = [to_dev(rand(rng, s, np.float32)) for s in [(2_000_003,), (70_001,), (3,)] + [(99,)] * 200]
    out = full((len(ts),), 0.0, np.float64)
    bits = set()
    for _ in range(5):
        core.cuda_global_norm(ts, tensor_norms_out=out)
        bits.add(to_host(out, np.float64).tobytes())
    assert len(bits) == 1


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("var_dtype,grad_dtype", [("float32", "float32"), ("float16", "float16"),
                                                  ("bfloat16", "bfloat16"), ("float64", "float64"),
                                                  ("float32", "bfloat16")])
def test_clip_apply_tensor_norms(rng, mode, var_dtype, grad_dtype):
    vd, gd = DTYPES[var_dtype], DTYPES[grad_dtype]
    vars_c = [rand(rng, s, vd) for s in SHAPES]
    slots_c = [[np.zeros(s, vd) for s in SHAPES] for _ in range(2)]
    vars_g = [to_dev(v) for v in vars_c]
    slots_g = [[to_dev(s) for s in sl] for sl in slots_c]
    grads = [rand(rng, s, gd) for s in SHAPES]
    hp = {"learning_rate": 0.01, "step": 1}
    cpu = np.empty(len(SHAPES))
    core.clip_apply("adam", vars_c, grads, slots_c, hp, mode, MODES[mode], tensor_norms_out=cpu)
    out = full((len(SHAPES),), np.nan, np.float32)
    norm, applied = core.cuda_clip_apply("adam", vars_g, [to_dev(g) for g in grads], slots_g, hp, mode,
                                         MODES[mode], tensor_norms_out=out)
    assert applied
    assert core.cuda_last_launches() == 3  # the norms cost no launch
    want = np_norms(grads)
    np.testing.assert_allclose(cpu, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(to_host(out, np.float32), want.astype(np.float32), rtol=6e-8, atol=0)


def test_sparse_tensor_norms_are_the_values(rng):
    shapes = [(1000,), (300, 700)]
    vars_c = [rand(rng, s, np.float32) for s in shapes]
    vars_g = [to_dev(v) for v in vars_c]
    idx = rng.integers(0, 300, size=64)
    idx[:5] = idx[5]  # duplicates: the values' norm, not the densified gradient's
    grads = [rand(rng, shapes[0], np.float32), rand(rng, (64, 700), np.float32)]
    out = full((2,), np.nan, np.float64)
    core.cuda_clip_apply("sgd", vars_g, [to_dev(g) for g in grads], [], {"learning_rate": 0.1},
                         "global_norm", 1.0, indices=[None, idx], tensor_norms_out=out)
    cpu = np.empty(2)
    core.clip_apply("sgd", vars_c, grads, [], {"learning_rate": 0.1}, "global_norm", 1.0,
                    indices=[None, idx], tensor_norms_out=cpu)
    np.testing.assert_allclose(to_host(out, np.float64), np_norms(grads), rtol=1e-12)
    np.testing.assert_allclose(cpu, np_norms(grads), rtol=1e-12)


def test_skipped_step_writes_norms_not_variables(rng):
    vs = [rand(rng, (500,), np.float32) for _ in range(3)]
    grads = [rand(rng, (500,), np.float32) for _ in range(3)]
    grads[1][7] = np.nan
    vg = [to_dev(v) for v in vs]
    out = full((3,), -1.0, np.float64)
    norm, applied = core.cuda_clip_apply("sgd", vg, [to_dev(g) for g in grads], [], {"learning_rate": 0.1},
                                         "global_norm", 1.0, tensor_norms_out=out)
    assert not applied
    got = to_host(out, np.float64)
    assert np.isnan(got[1])
    np.testing.assert_allclose(got[[0, 2]], np_norms([grads[0], grads[2]]), rtol=1e-12)
    for g, v in zip(vg, vs):
        np.testing.assert_array_equal(to_host(g, np.float32), v)


def test_given_norm_gives_nan_norms_and_clip_op_norms(rng):
    ts = [rand(rng, (300,), np.float32), rand(rng, (CHUNK + 1,), np.float32)]
    vg = [to_dev(np.zeros_like(t)) for t in ts]
    out = full((2,), 0.0, np.float32)
    core.cuda_clip_apply("sgd", vg, [to_dev(t) for t in ts], [], {"learning_rate": 0.1}, "global_norm", 1.0,
                         use_norm=5.0, tensor_norms_out=out)
    assert np.isnan(to_host(out, np.float32)).all()
    # The clip op: its norms from its own norm pass; NaN with a given norm.
    outs = [to_dev(np.zeros_like(t)) for t in ts]
    per = full((2,), np.nan, np.float64)
    core.cuda_clip_by_global_norm([to_dev(t) for t in ts], outs, 1.0, tensor_norms_out=per)
    np.testing.assert_allclose(to_host(per, np.float64), np_norms(ts), rtol=1e-12)
    core.cuda_clip_by_global_norm([to_dev(t) for t in ts], outs, 1.0, use_norm=3.0, tensor_norms_out=per)
    assert np.isnan(to_host(per, np.float64)).all()


def test_bad_tensor_norms_out_is_named(rng):
    t = to_dev(rand(rng, (10,), np.float32))
    with pytest.raises(ValueError, match="tensor_norms_out must be .* of 1 elements"):
        core.cuda_global_norm([t], tensor_norms_out=full((2,), 0.0, np.float64))
    with pytest.raises(ValueError, match="tensor_norms_out must be"):
        core.cuda_global_norm([t], tensor_norms_out=full((1,), 0, np.int32))
