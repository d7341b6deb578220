"""The registered gradient of fused_clip_by_global_norm equals TF's gradient of the unfused op."""
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from conftest import assert_close


def _grads(fn, ts, clip_norm, use_norm, weights, norm_weight):
    with tf.GradientTape() as tape:
        tape.watch(ts)
        tape.watch(clip_norm)
        if use_norm is not None:
            tape.watch(use_norm)
        out, n = fn(ts, clip_norm, use_norm=use_norm)
        loss = norm_weight * n + sum(tf.reduce_sum(w * o) for w, o in zip(weights, out) if o is not None)
    srcs = list(ts) + [clip_norm] + ([use_norm] if use_norm is not None else [])
    return tape.gradient(loss, srcs)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize("case", ["clipping", "not_clipping", "tie", "use_norm", "zero_norm"])
def test_gradient_matches_tf(rng, dtype, case):
    ts = [tf.constant(rng.normal(size=s), dtype) for s in [(3,), (2, 2), ()]]
    c = {"clipping": 0.5, "not_clipping": 100.0, "use_norm": 1.0, "zero_norm": 1.0}.get(case)
    if case == "tie":  # norm exactly 5 == clip_norm: TF's Minimum gradient picks 1/norm
        ts = [tf.constant([3.0], dtype), tf.constant([[4.0]], dtype)]
        c = 5.0
    if case == "zero_norm":  # TF's SqrtGrad at 0 makes the tensor gradients NaN
        ts = [tf.zeros([3], dtype), tf.zeros([2], dtype)]
    clip_norm = tf.constant(c, dtype)
    use_norm = tf.constant(3.0, dtype) if case == "use_norm" else None
    weights = [tf.constant(rng.normal(size=t.shape), dtype) for t in ts]
    got = _grads(tfclip.fused_clip_by_global_norm, ts, clip_norm, use_norm, weights, 0.7)
    want = _grads(tf.clip_by_global_norm, ts, clip_norm, use_norm, weights, 0.7)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            w = w.numpy()
            np.testing.assert_array_equal(np.isnan(g.numpy()), np.isnan(w))
            assert_close(np.nan_to_num(g.numpy()), np.nan_to_num(w), dtype.name, scale=10)


def test_gradient_with_none_and_unused_outputs(rng):
    ts = [tf.constant(rng.normal(size=(4,)), tf.float32), None, tf.constant(rng.normal(size=(2,)), tf.float32)]
    c = tf.constant(0.3)

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([ts[0], ts[2], c])
            out, _ = fn(ts, c)
            loss = tf.reduce_sum(out[0] ** 2)  # out[2] unused
        return tape.gradient(loss, [ts[0], ts[2], c])

    for g, w in zip(grads(tfclip.fused_clip_by_global_norm), grads(tf.clip_by_global_norm)):
        assert_close(g, w, "float32", scale=10)


def test_numeric_gradient_check(rng):
    ts = [tf.constant(rng.normal(size=(3,)), tf.float64), tf.constant(rng.normal(size=(2,)), tf.float64)]

    def f(a, b, c):
        out, n = tfclip.fused_clip_by_global_norm([a, b], c)
        return tf.reduce_sum(out[0] * [1.0, -2.0, 0.5]) + tf.reduce_sum(out[1]) + n

    theoretical, numerical = tf.test.compute_gradient(f, [ts[0], ts[1], tf.constant(0.8, tf.float64)])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-6)
