"""global_norm and fused_clip_by_global_norm against tf.linalg.global_norm / tf.clip_by_global_norm."""
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from conftest import assert_close
from reference import global_norm as np_global_norm

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
SHAPES = {
    "scalar": [()],
    "empty": [(0,), (3, 0), (5,)],
    "odd": [(7,), (3, 5), (1, 1, 13)],
    "over_chunk": [(200_003,), (3,)],
    "many": [(i % 7 + 1,) for i in range(1200)],
}


def make(rng, shapes, dtype, scale=1.0):
    return [tf.constant(rng.normal(size=s) * scale, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_global_norm_matches_tf(rng, dtype, shapes):
    ts = make(rng, shapes, dtype)
    got = tfclip.global_norm(ts)
    assert got.dtype == dtype
    # tf.linalg.global_norm accumulates in the tensors' dtype; the float64 reference is exact.
    assert_close(got, np_global_norm([t.numpy() for t in ts]), dtype.name)
    if dtype in (tf.float32, tf.float64):
        assert_close(got, tf.linalg.global_norm(ts), dtype.name, scale=10)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("clip_norm", [0.5, 1e6])
def test_clip_by_global_norm_matches_tf(rng, dtype, shapes, clip_norm):
    ts = make(rng, shapes, dtype)
    got, gn = tfclip.fused_clip_by_global_norm(ts, clip_norm)
    want, wn = tf.clip_by_global_norm(ts, clip_norm)
    assert gn.dtype == wn.dtype == dtype
    ref_norm = np_global_norm([t.numpy() for t in ts])
    assert_close(gn, ref_norm, dtype.name)
    scale = clip_norm / max(ref_norm, clip_norm)
    for g, w, t in zip(got, want, ts):
        assert g.dtype == dtype and g.shape == t.shape
        # Against float64: the tensor times the scale rounded to the dtype, rounded.
        assert_close(g.numpy().astype(np.float64), t.numpy().astype(np.float64) * scale,
                     dtype.name, scale=2)
        if np.isfinite(w.numpy().astype(np.float64)).all():
            # Against TF: both scale by the dtype-rounded scale; equal but for the norm's bits.
            assert_close(g.numpy().astype(np.float64), w.numpy().astype(np.float64), dtype.name,
                         scale=4)
        else:
            # TF computes the norm and the scale in float16 and overflows (a norm over 65504,
            # or clip_norm=1e6 cast to inf: its outputs are NaN); tfclip stays right.
            assert dtype == tf.float16 and np.isfinite(g.numpy()).all()


def test_mixed_dtypes_one_norm(rng):
    ts = [tf.constant(rng.normal(size=(9,)), dtype=d) for d in DTYPES]
    got, norm = tfclip.fused_clip_by_global_norm(ts, 1.0)
    ref = np_global_norm([t.numpy() for t in ts])
    assert norm.dtype == tf.float64  # mixed list: float64 when any float64, as documented
    assert_close(norm, ref, "float64")
    for g, t in zip(got, ts):
        assert g.dtype == t.dtype
        assert_close(g.numpy().astype(np.float64), t.numpy().astype(np.float64) / ref, t.dtype.name)


def test_none_and_indexed_slices(rng):
    dense = tf.constant(rng.normal(size=(4, 3)), tf.float32)
    sl = tf.IndexedSlices(tf.constant(rng.normal(size=(2, 3)), tf.float32),
                          tf.constant([0, 5]), tf.constant([10, 3]))
    ts = [None, dense, sl, None]
    got, gn = tfclip.fused_clip_by_global_norm(ts, 0.1)
    want, wn = tf.clip_by_global_norm(ts, 0.1)
    assert got[0] is None and got[3] is None
    assert isinstance(got[2], tf.IndexedSlices)
    np.testing.assert_array_equal(got[2].indices, sl.indices)
    np.testing.assert_array_equal(got[2].dense_shape, sl.dense_shape)
    assert_close(got[1], want[1], "float32")
    assert_close(got[2].values, want[2].values, "float32")
    assert_close(gn, wn, "float32")
    assert_close(tfclip.global_norm(ts), tf.linalg.global_norm(ts), "float32")


def test_use_norm_skips_the_norm_and_is_returned(rng):
    ts = make(rng, [(5,), (6,)], tf.float32)
    use = tf.constant(40.0)
    got, n = tfclip.fused_clip_by_global_norm(ts, 2.0, use_norm=use)
    want, wn = tf.clip_by_global_norm(ts, 2.0, use_norm=use)
    assert n is use
    for g, w in zip(got, want):
        assert_close(g, w, "float32")


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_norm_gives_nan_like_tf(rng, bad):
    ts = make(rng, [(5,), (6,)], tf.float32)
    ts[1] = tf.tensor_scatter_nd_update(ts[1], [[2]], [bad])
    got, gn = tfclip.fused_clip_by_global_norm(ts, 1.0)
    want, wn = tf.clip_by_global_norm(ts, 1.0)
    for g, w in zip(got, want):
        assert np.isnan(w.numpy()).all() and np.isnan(g.numpy()).all()
    assert np.isnan(gn.numpy()) == np.isnan(wn.numpy())


def test_overflow_safe_and_subnormal_norm():
    big = [tf.constant([1e20, -1e20, 3e20], tf.float32)]
    # Squares overflow float32; the fp64 accumulation gives the right finite norm.
    assert_close(tfclip.global_norm(big), np.sqrt(11) * 1e20, "float32")
    # Every element subnormal (TF flushes those to zero in its kernels), the norm normal.
    tiny = [tf.fill([100_000], tf.constant(1e-39, tf.float32)), tf.constant([2e-39], tf.float32)]
    want = np.sqrt(100_000 * np.float64(np.float32(1e-39)) ** 2 + np.float64(np.float32(2e-39)) ** 2)
    got = tfclip.global_norm(tiny).numpy()
    assert got > 0 and abs(got - want) <= 1e-6 * want


def test_tf_function_and_graph_session(rng):
    ts = make(rng, [(5,), (3, 2)], tf.float32)
    f = tf.function(lambda a, b: tfclip.fused_clip_by_global_norm([a, b], 1.5))
    got, n = f(*ts)
    want, wn = tf.clip_by_global_norm(ts, 1.5)
    for g, w in zip(got, want):
        assert_close(g, w, "float32")
    vals = [t.numpy() for t in ts]
    with tf.Graph().as_default():
        ph = [tf.compat.v1.placeholder(tf.float32, shape=None) for _ in vals]  # unknown shapes
        out, norm = tfclip.fused_clip_by_global_norm(ph, 1.5)
        with tf.compat.v1.Session() as sess:
            got_g, got_n = sess.run([out, norm], feed_dict=dict(zip(ph, vals)))
    for g, w in zip(got_g, want):
        assert_close(g, w, "float32")
    assert_close(got_n, wn, "float32")


def test_outputs_do_not_alias_inputs(rng):
    a = tf.Variable(rng.normal(size=(10,)).astype(np.float32))
    before = a.numpy().copy()
    out, _ = tfclip.fused_clip_by_global_norm([a.read_value()], 0.01)
    np.testing.assert_array_equal(a.numpy(), before)
    assert not np.allclose(out[0].numpy(), before)
