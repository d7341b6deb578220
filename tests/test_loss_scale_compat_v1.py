"""tfclip.compat.v1.MixedPrecisionLossScaleOptimizer (issue 47): TF1's dynamic loss scaling with
the unscale and the finite check folded into a tfclip.compat.v1 optimizer's step in `minimize`
(tfclip/compat/_loss_scale.py).

The reference is the stock tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer around
the same tfclip optimizer: the scaled loss's gradients times 1 / scale (written), all checked
for inf/NaN, then the inner step with `global_step` or, for a non-finite one, none. Step for step
through growth and back-off, in a TF1 graph's Session and eagerly, the variables, the slots (and
Adam's beta powers), `global_step`, the loss scale and its counter must have the same bits. Ref
variables run in a subprocess under tf.disable_v2_behavior(): the stock wrapper's tf.cond cannot
take them under TF2's control flow (nor the stock TF1 optimizers')."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training.experimental import loss_scale as _ls

import tfclip
import tfclip.compat.v1 as tc

v1 = tf.compat.v1
STOCK = v1.mixed_precision.MixedPrecisionLossScaleOptimizer
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))

INNER = {
    "adam_clip": lambda: tc.AdamOptimizer(0.01, global_clipnorm=1.0),
    "momentum": lambda: tc.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "gd_clipvalue": lambda: tc.GradientDescentOptimizer(0.1, clipvalue=0.5),
    "rmsprop_int8": lambda: tc.RMSPropOptimizer(0.01, momentum=0.5, state_dtype="int8"),
}


def _same_bits(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), (what, np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _coefs(rng, init, bad=(1, 5)):
    out = []
    for k in range(8):
        c = [rng.normal(size=x.shape).astype(np.float32) for x in init]
        if k in bad:
            c[1].flat[3] = np.inf
        out.append(c)
    return out


def _loss_scale():
    return _ls.DynamicLossScale(initial_loss_scale=2.0 ** 10, increment_period=2, multiplier=2.0)


def _graph_run(wrapper, make_inner, init, coefs):
    with tf.Graph().as_default():
        vars_ = [v1.Variable(x) for x in init]
        cs = [v1.placeholder(tf.float32, x.shape) for x in init]
        step = v1.train.get_or_create_global_step()
        ls = _loss_scale()
        opt = wrapper(make_inner(), ls)
        train_op = opt.minimize(sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs)), global_step=step,
                                var_list=vars_)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            trace = []
            for c in coefs:
                sess.run(train_op, dict(zip(cs, c)))
                trace.append(sess.run(vars_ + opt.variables() + [step, ls._current_loss_scale, ls._num_good_steps]))
    return opt, trace


@pytest.mark.parametrize("inner", sorted(INNER))
def test_folded_is_the_stock_wrapper_step_for_step_in_a_session(rng, inner, folded_steps):
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    coefs = _coefs(rng, init)
    ours, got = _graph_run(tc.MixedPrecisionLossScaleOptimizer, INNER[inner], init, coefs)
    assert ours.fold_refusal() is None and len(folded_steps) == 1
    _, want = _graph_run(STOCK, INNER[inner], init, coefs)
    for k, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_bits(x, y, f"step {k}")
    # 2^10; step 0 counts; 1 backs off (2^9); 2, 3 grow it (2^10); 4 counts; 5 backs off; 6, 7 grow.
    assert got[-1][-3] == 6 and got[-1][-2] == 2.0 ** 10 and got[-1][-1] == 0  # (global_step: applied only)


def test_folded_eagerly(rng, folded_steps):
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]
    coefs = _coefs(rng, init)
    out = []
    for wrapper in (tc.MixedPrecisionLossScaleOptimizer, STOCK):
        vars_ = [tf.Variable(x) for x in init]
        step = tf.Variable(0, dtype=tf.int64)
        ls = _loss_scale()
        opt = wrapper(tc.AdamOptimizer(0.01, global_clipnorm=1.0), ls)
        for c in coefs:
            cs = [tf.constant(x) for x in c]
            opt.minimize(lambda: sum(tf.reduce_sum(v * x) for v, x in zip(vars_, cs)), global_step=step,
                         var_list=vars_)
        out.append([v.numpy() for v in vars_ + opt.variables()] + [step.numpy(), ls()])
    assert folded_steps
    for a, b in zip(*out):
        _same_bits(a, b)


def test_gradients_taken_apart_keep_the_stock_passes(rng, folded_steps):
    """compute_gradients then apply_gradients (a program that clips or logs in between): the
    gradients it sees are unscaled, as the stock wrapper gives them; nothing is folded."""
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]
    out = []
    for wrapper in (tc.MixedPrecisionLossScaleOptimizer, STOCK):
        with tf.Graph().as_default():
            vars_ = [v1.Variable(x) for x in init]
            opt = wrapper(tc.AdamOptimizer(0.01), _loss_scale())
            gv = opt.compute_gradients(sum(tf.reduce_sum(v * v) for v in vars_), var_list=vars_)
            train_op = opt.apply_gradients([(tf.clip_by_norm(g, 1.0), v) for g, v in gv])
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                grads = sess.run([g for g, _ in gv])
                sess.run(train_op)
                out.append(grads + sess.run(vars_))
    assert not folded_steps
    for a, b in zip(*out):
        _same_bits(a, b)
    np.testing.assert_allclose(out[0][0], 2 * init[0], rtol=1e-6)  # (unscaled: d/dv v^2)


def test_the_folded_step_has_no_pass_of_its_own(rng):
    """The stock wrapper's step holds an IsFinite per gradient (and one for the grown scale); the
    folded one only that last."""
    def ops_of(wrapper):
        with tf.Graph().as_default() as g:
            vars_ = [v1.Variable(np.ones(s, np.float32)) for s in [(30,), (4, 5)]]
            wrapper(tc.AdamOptimizer(0.01), _loss_scale()).minimize(
                sum(tf.reduce_sum(v * v) for v in vars_), var_list=vars_)
            gd = g.as_graph_def()
        return [n.op for n in gd.node] + [n.op for fn in gd.library.function for n in fn.node_def]

    stock, ours = ops_of(STOCK), ops_of(tc.MixedPrecisionLossScaleOptimizer)
    assert stock.count("IsFinite") == 2 + 1 and ours.count("IsFinite") == 1
    assert sum(t.startswith("TfclipClipApply") for t in ours) == 1


def test_refusals():
    def refusal(inner, ls):
        return tc.MixedPrecisionLossScaleOptimizer(inner, ls).fold_refusal()

    assert "not a tfclip.compat.v1 one" in refusal(v1.train.AdamOptimizer(0.1), "dynamic")
    assert "fixed loss scale" in refusal(tc.AdamOptimizer(0.1), 128)
    assert "multiplier 3.0 is not a power of two" in refusal(
        tc.AdamOptimizer(0.1), _ls.DynamicLossScale(2.0 ** 10, 2, 3.0))
    assert "initial_loss_scale 1000.0 is not a power of two" in refusal(
        tc.AdamOptimizer(0.1), _ls.DynamicLossScale(1000.0, 2, 2.0))
    assert "AGC" in refusal(tc.MomentumOptimizer(0.1, 0.9, clip=tfclip.clipping.AGC(0.01)), "dynamic")
    assert refusal(tc.AdamOptimizer(0.1), "dynamic") is None


REF_PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow.compat.v1 as tf
    from tensorflow.python.training.experimental import loss_scale as ls_mod
    tf.disable_v2_behavior()
    import tfclip.compat.v1 as tc
    rng = np.random.default_rng(5)
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]
    coefs = []
    for k in range(6):
        c = [rng.normal(size=x.shape).astype(np.float32) for x in init]
        if k == 2:
            c[1].flat[0] = np.inf
        coefs.append(c)
    out = []
    for wrapper in (tc.MixedPrecisionLossScaleOptimizer, tf.mixed_precision.MixedPrecisionLossScaleOptimizer):
        with tf.Graph().as_default():
            vars_ = [tf.Variable(x) for x in init]  # ref variables (float32_ref)
            assert all(v.dtype._is_ref_dtype for v in vars_)
            cs = [tf.placeholder(tf.float32, x.shape) for x in init]
            step = tf.train.get_or_create_global_step()
            ls = ls_mod.DynamicLossScale(2.0 ** 10, 2, 2.0)
            opt = wrapper(tc.AdamOptimizer(0.01, global_clipnorm=1.0), ls)
            train_op = opt.minimize(sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs)), global_step=step,
                                    var_list=vars_)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for c in coefs:
                    sess.run(train_op, dict(zip(cs, c)))
                out.append(sess.run(vars_ + opt.variables() + [step, ls._current_loss_scale]))
    assert len(out[0]) == len(out[1])
    for a, b in zip(*out):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (a, b)
    assert out[0][-2] == 5
    print("OK")
""")


def test_ref_variables_under_disable_v2_behavior(tmp_path):
    # (cwd away from the checkout: `python -c` puts cwd first on sys.path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", REF_PROGRAM], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
