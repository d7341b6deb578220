"""Every bad input is a clear error naming the culprit, and a failed apply writes nothing."""
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from tfclip import _loader

OPS = _loader.ops()


def _vars(rng, shapes=((3,), (4,), (2, 2)), dtype=np.float32):
    return [tf.Variable(rng.normal(size=s).astype(dtype)) for s in shapes]


def _snap(variables):
    return [v.numpy().copy() for v in variables]


def _unchanged(variables, before):
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def _sgd_raw(variables, grads, lr=0.1, **kw):
    kw.setdefault("clip", tf.constant(0.0, tf.float64))
    kw.setdefault("use_norm", tf.constant(0.0, tf.float64))
    kw.setdefault("indices", [])
    kw.setdefault("iterations", [])
    return OPS.tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], var=[v.handle for v in variables], grad=grads,
                                     lr=tf.constant(lr, tf.float64),
                                     weight_decay=tf.constant(0.0, tf.float64), **kw)


# ------------------------------------------------------------------ Python layer
PY_CASES = {
    "empty_list": (lambda v: [], {}, ValueError, "empty"),
    "all_none": (lambda v: [(None, x) for x in v], {}, ValueError, "No gradients"),
    "shape": (lambda v: [(tf.ones([3]), v[0]), (tf.ones([5]), v[1])], {}, ValueError,
              r"grads_and_vars\[1\]: gradient element count"),
    "shape_same_count": (lambda v: [(tf.ones([4]), v[2])], {}, ValueError,
                         r"grads_and_vars\[0\]: gradient shape"),
    "dtype": (lambda v: [(tf.ones([3]), v[0]), (tf.ones([4], tf.int32), v[1])], {}, TypeError,
              r"grads_and_vars\[1\]: gradient dtype int32 .*must be float16, bfloat16, float32 or float64"),
    "int_var": (lambda v: [(tf.ones([3]), v[0]), (tf.ones([2], tf.int32), tf.Variable([1, 2]))],
                {}, TypeError, r"grads_and_vars\[1\].*int32"),
    "not_a_variable": (lambda v: [(tf.ones([3]), tf.ones([3]))], {}, TypeError,
                       r"grads_and_vars\[0\] holds a"),
    "not_a_pair": (lambda v: [tf.ones([3])], {}, TypeError, r"grads_and_vars\[0\] is not"),
    "duplicate": (lambda v: [(tf.ones([3]), v[0]), (tf.ones([4]), v[1]), (tf.ones([3]), v[0])],
                  {}, ValueError, r"grads_and_vars\[2\] and grads_and_vars\[0\]"),
    "clip_bool": (lambda v: [(tf.ones([3]), v[0])], {"global_clipnorm": True}, ValueError,
                  "global_clipnorm must be a finite number >= 0"),
    "clip_negative": (lambda v: [(tf.ones([3]), v[0])], {"clipnorm": -1.0}, ValueError,
                      r"clipnorm must be a finite number >= 0 \(None or 0: no clip\)"),
    "clip_nan": (lambda v: [(tf.ones([3]), v[0])], {"clipvalue": float("nan")}, ValueError,
                 "clipvalue must be a finite number"),
    "clip_inf": (lambda v: [(tf.ones([3]), v[0])], {"global_clipnorm": float("inf")}, ValueError,
                 "global_clipnorm must be a finite number"),
    "two_clips": (lambda v: [(tf.ones([3]), v[0])], {"clipnorm": 1.0, "clipvalue": 1.0}, ValueError,
                  "at most one"),
    "policy": (lambda v: [(tf.ones([3]), v[0])], {"nonfinite": "ignore"}, ValueError, "nonfinite"),
    "negative_use_norm": (lambda v: [(tf.ones([3]), v[0])], {"use_norm": -1.0}, ValueError,
                          "use_norm must be >= 0"),
}


@pytest.mark.parametrize("case", PY_CASES, ids=PY_CASES.keys())
def test_python_layer_errors_write_nothing(rng, case):
    make, kw, exc, pattern = PY_CASES[case]
    variables = _vars(rng)
    before = _snap(variables)
    rule = tfclip.rules.Adam(0.1)
    with pytest.raises(exc, match=pattern):
        tfclip.fused_clip_apply(make(variables), rule, **kw)
    _unchanged(variables, before)
    assert int(rule.iterations.numpy()) == 0


@pytest.mark.parametrize("make,pattern", [
    (lambda: tfclip.rules.SGD(float("nan")), "learning_rate must be finite"),
    (lambda: tfclip.rules.SGD(float("-inf")), "learning_rate must be finite"),
    (lambda: tfclip.rules.SGD(0.1, momentum=1.5), "momentum must be in"),  # Keras SGD's own range
    (lambda: tfclip.rules.Lion(beta_1=0.0), r"beta_1 must be in \(0, 1\]"),  # Keras Lion's
    (lambda: tfclip.rules.Adam(beta_1=float("nan")), "beta_1 must be finite"),
    (lambda: tfclip.rules.Adam(epsilon=float("inf")), "epsilon must be finite"),
    (lambda: tfclip.rules.AdamW(weight_decay=float("inf")), "weight_decay must be finite"),
])
def test_bad_hyperparameters_at_construction(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.mark.parametrize("lr,exc,pattern", [
    (tf.constant([0.1, 0.2]), ValueError, "learning_rate must be a scalar"),
    (tf.constant(float("nan")), tf.errors.InvalidArgumentError, "learning_rate must be finite"),
    (tf.constant(float("inf")), tf.errors.InvalidArgumentError, "learning_rate must be finite, got inf"),
])
def test_bad_tensor_hyperparameters_write_nothing(rng, lr, exc, pattern):
    variables = _vars(rng)
    before = _snap(variables)
    with pytest.raises(exc, match=pattern):
        tfclip.fused_clip_apply([(tf.ones(v.shape), v) for v in variables], tfclip.rules.Adam(lr))
    _unchanged(variables, before)


def test_clip_tensor_checked_by_the_op(rng):
    variables = _vars(rng)
    before = _snap(variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"global_clipnorm must be finite and >= 0 \(0: no clip\), got -2"):
        tfclip.fused_clip_apply([(tf.ones(v.shape), v) for v in variables], tfclip.rules.SGD(0.1),
                                global_clipnorm=tf.constant(-2.0))
    _unchanged(variables, before)
    with pytest.raises(tf.errors.InvalidArgumentError, match="clip_norm must be finite and > 0"):
        tfclip.fused_clip_by_global_norm([tf.ones([2])], tf.constant(0.0))


@pytest.mark.parametrize("t_list,exc,pattern", [
    ([], ValueError, "holds no tensor"),
    ([None, None], ValueError, "holds no tensor"),
    ([tf.ones([2]), tf.constant([1, 2])], ValueError, r"t_list\[1\] has dtype int32"),
    ("abc", TypeError, "should be a sequence"),
])
def test_clip_and_norm_bad_lists(t_list, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tfclip.fused_clip_by_global_norm(t_list, 1.0)
    with pytest.raises(exc, match=pattern):
        tfclip.global_norm(t_list)


def test_clip_norm_python_number_checked():
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="clip_norm must be finite and > 0"):
            tfclip.fused_clip_by_global_norm([tf.ones([2])], bad)


# ------------------------------------------------------------------ op level (raw op, any caller)
def test_op_list_length_mismatch(rng):
    variables = _vars(rng)
    before = _snap(variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match="got 2 gradients for 3 variables"):
        _sgd_raw(variables, [tf.ones([3]), tf.ones([4])])
    _unchanged(variables, before)


def test_op_same_variable_twice_is_caught_after_good_steps_of_the_same_kernel(rng):
    """The kernel keeps the last step's lock order; a later list with a repeat (same length,
    so the same kernel) must still be caught, and a reordered list still be applied right."""
    variables = _vars(rng, shapes=((3,), (3,), (3,)))
    for _ in range(2):
        _sgd_raw(variables, [tf.ones([3])] * 3)
    before = _snap(variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"vars\[2\] and vars\[0\] are the same variable"):
        _sgd_raw([variables[0], variables[1], variables[0]], [tf.ones([3])] * 3)
    _unchanged(variables, before)
    _sgd_raw(variables[::-1], [tf.fill([3], float(k)) for k in (1, 2, 3)], lr=1.0)
    for v, b, k in zip(variables, before, (3, 2, 1)):
        np.testing.assert_array_equal(v.numpy(), b - k)


def _momentum_raw(var, accum, grads, iterations=(), step_lr=0.1):
    return OPS.tfclip_clip_apply_momentum(absmax=[], grad_scale=[], rounding=[], 
        var=var, accum=accum, grad=grads, lr=tf.constant(step_lr, tf.float64),
        momentum=tf.constant(0.9, tf.float64), weight_decay=tf.constant(0.0, tf.float64),
        clip=tf.constant(0.0, tf.float64), use_norm=tf.constant(0.0, tf.float64), indices=[],
        iterations=list(iterations))


def _pack(vs):
    return tf.raw_ops.Pack(values=[v.handle for v in vs], axis=0)


def test_op_packed_handles_bad_counts_shapes_and_repeats_write_nothing(rng):
    """Packed resource inputs (vectors of handles) are checked as one handle per input is:
    counts against the gradients, a slot list of another length, handles of rank 2, the same
    variable twice inside a vector; each named, nothing written."""
    variables = _vars(rng)
    accum = [tf.Variable(tf.zeros(v.shape)) for v in variables]
    before = _snap(variables + accum)
    grads = [tf.ones(v.shape) for v in variables]
    with pytest.raises(tf.errors.InvalidArgumentError, match="got 3 gradients for 2 variables"):
        _momentum_raw([_pack(variables[:2])], [_pack(accum[:2])], grads)
    with pytest.raises(tf.errors.InvalidArgumentError, match="got 2 accum slots for 3 variables"):
        _momentum_raw([_pack(variables)], [_pack(accum[:2])], grads)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"vars must hold scalar or vector resource handles; got shape \[1,3\]"):
        _momentum_raw([tf.reshape(_pack(variables), [1, 3])], [_pack(accum)], grads)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"vars\[2\] and vars\[0\] are the same"):
        _momentum_raw([_pack([variables[0], variables[1], variables[0]])], [_pack(accum)],
                      [grads[0], grads[1], grads[0]])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"accum\[1\] is float\[4\] but vars\[1\] is float\[2,2\]"):
        _momentum_raw([_pack([variables[0], variables[2], variables[1]])], [_pack(accum)],
                      [grads[0], grads[2], grads[1]])
    _unchanged(variables + accum, before)


def test_op_step_counter_bad_or_misused_is_named_and_writes_nothing(rng):
    """`iterations`, the op-owned step counter: a float variable, two counters, an
    uninitialized one, or a count that makes Adam's step < 1 are named errors; nothing written,
    the counter unchanged."""
    variables = _vars(rng)
    accum = [tf.Variable(tf.zeros(v.shape)) for v in variables]
    before = _snap(variables + accum)
    grads = [tf.ones(v.shape) for v in variables]
    lists = ([v.handle for v in variables], [a.handle for a in accum])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"iterations must be an int64 scalar variable, got float\[\]"):
        _momentum_raw(*lists, grads, iterations=[tf.Variable(0.0).handle])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got int64\[2\]"):
        _momentum_raw(*lists, grads, iterations=[tf.Variable([0, 0], dtype=tf.int64).handle])
    counter = tf.Variable(4, dtype=tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="iterations takes at most one variable, got 2"):
        _momentum_raw(*lists, grads, iterations=[counter.handle, counter.handle])
    with pytest.raises(tf.errors.InvalidArgumentError, match="iterations must be one variable, got 2 handles"):
        _momentum_raw(*lists, grads, iterations=[_pack([counter, counter])])
    uninit = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name="tfclip_uninit_counter")
    with pytest.raises(tf.errors.FailedPreconditionError, match=r"iterations\[0\] is not initialized"):
        _momentum_raw(*lists, grads, iterations=[uninit])
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be"):
        _momentum_raw(*lists, grads, iterations=[counter.handle], step_lr=float("nan"))
    counter.assign(-3)  # Adam's t = iterations + step = -2
    f64 = lambda x: tf.constant(x, tf.float64)  # noqa: E731
    m = [tf.Variable(tf.zeros(v.shape)) for v in variables]
    vv = [tf.Variable(tf.zeros(v.shape)) for v in variables]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"step must be .*\(iterations \+ step = -2\)"):
        OPS.tfclip_clip_apply_adam(absmax=[], grad_scale=[], rounding=[], 
            var=lists[0], m=[x.handle for x in m], v=[x.handle for x in vv], vhat=[], grad=grads,
            lr=f64(0.1), beta_1=f64(0.9), beta_2=f64(0.999), epsilon=f64(1e-7), weight_decay=f64(0.0),
            step=f64(1.0), beta_1_power=f64(float("nan")), beta_2_power=f64(float("nan")), clip=f64(0.0), use_norm=f64(0.0), indices=[],
            iterations=[counter.handle])
    assert int(counter.numpy()) == -3
    _unchanged(variables + accum, before)


def test_op_shape_mismatch_at_last_index_writes_nothing(rng):
    variables = _vars(rng)
    before = _snap(variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"grads\[2\] has shape \[4\] but vars\[2\]"):
        _sgd_raw(variables, [tf.ones([3]), tf.ones([4]), tf.ones([4])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"grads\[2\] has 5 elements"):
        _sgd_raw(variables, [tf.ones([3]), tf.ones([4]), tf.ones([5])])
    _unchanged(variables, before)


def test_op_int_variable(rng):
    variables = _vars(rng)
    before = _snap(variables)
    iv = tf.Variable([1, 2, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"vars\[1\] has dtype int32"):
        _sgd_raw([variables[0], iv], [tf.ones([3]), tf.ones([3])])
    _unchanged(variables, before)


def test_op_same_variable_twice_is_an_error_not_a_hang(rng):
    variables = _vars(rng)
    before = _snap(variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"vars\[2\] and vars\[0\] are the same variable"):
        _sgd_raw([variables[0], variables[1], variables[0]], [tf.ones([3]), tf.ones([4]), tf.ones([3])])
    # A variable passed as its own slot is caught too.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"accum\[0\] and vars\[0\]"):
        OPS.tfclip_clip_apply_momentum(absmax=[], grad_scale=[], rounding=[], 
            var=[variables[0].handle], accum=[variables[0].handle], grad=[tf.ones([3])],
            lr=tf.constant(0.1, tf.float64), momentum=tf.constant(0.9, tf.float64),
            weight_decay=tf.constant(0.0, tf.float64), clip=tf.constant(0.0, tf.float64),
            use_norm=tf.constant(0.0, tf.float64), indices=[], iterations=[])
    _unchanged(variables, before)


def test_op_slot_of_wrong_shape_or_dtype_writes_nothing(rng):
    variables = _vars(rng)
    before = _snap(variables)
    accum = [tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([4])), tf.Variable(tf.zeros([5]))]
    acc_before = _snap(accum)
    args = dict(grad=[tf.ones(v.shape) for v in variables], lr=tf.constant(0.1, tf.float64),
                momentum=tf.constant(0.9, tf.float64), weight_decay=tf.constant(0.0, tf.float64),
                clip=tf.constant(0.0, tf.float64), use_norm=tf.constant(0.0, tf.float64), indices=[],
                iterations=[])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"accum\[2\] is float\[5\] but vars\[2\] is float\[2,2\]"):
        OPS.tfclip_clip_apply_momentum(absmax=[], grad_scale=[], rounding=[], var=[v.handle for v in variables],
                                       accum=[a.handle for a in accum], **args)
    accum[2] = tf.Variable(tf.zeros([2, 2], tf.float64))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"accum\[2\] is double"):
        OPS.tfclip_clip_apply_momentum(absmax=[], grad_scale=[], rounding=[], var=[v.handle for v in variables],
                                       accum=[a.handle for a in accum], **args)
    _unchanged(variables, before)
    _unchanged(accum[:2], acc_before[:2])


def test_op_non_scalar_hyperparameter(rng):
    variables = _vars(rng)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"lr must be a scalar, got shape \[2\]"):
        OPS.tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], var=[variables[0].handle], grad=[tf.ones([3])],
                                  lr=tf.constant([0.1, 0.1], tf.float64),
                                  weight_decay=tf.constant(0.0, tf.float64),
                                  clip=tf.constant(0.0, tf.float64), use_norm=tf.constant(0.0, tf.float64),
                                  indices=[], iterations=[])


def test_uninitialized_variable_in_a_graph(rng):
    with tf.Graph().as_default():
        a = tf.Variable(np.ones(3, np.float32))
        b = tf.Variable(np.ones(4, np.float32))
        step = tfclip.fused_clip_apply([(tf.ones([3]), a), (tf.ones([4]), b)], tfclip.rules.SGD(0.1))
        with tf.compat.v1.Session() as sess:
            sess.run([a.initializer])  # b (and the rule's step counter) left uninitialized
            with pytest.raises(tf.errors.FailedPreconditionError, match=r"vars\[1\] is not initialized"):
                sess.run(step)
            np.testing.assert_array_equal(sess.run(a), np.ones(3))


# ------------------------------------------------------------------ _core on NumPy arrays
def test_core_errors_write_nothing(rng):
    from tfclip import _core

    v = [rng.normal(size=s).astype(np.float32) for s in [(3,), (4,)]]
    before = [x.copy() for x in v]
    g = [np.ones(3, np.float32), np.ones(4, np.float32)]
    cases = [
        (dict(grads=g[:1]), "got 1 gradients for 2 variables"),
        (dict(grads=[g[0], np.ones(5, np.float32)]), r"grads\[1\] has shape \(5,\)"),
        (dict(grads=[g[0], np.ones(4, np.int32)]), r"grads\[1\] has dtype int32"),
        (dict(vars=[v[0], v[0]], grads=[g[0], g[0]]), r"vars\[1\] and vars\[0\] are the same array"),
        (dict(vars=[], grads=[]), "vars is empty"),
        (dict(hparams={"learning_rate": float("nan")}), "learning_rate must be finite"),
        (dict(clip_mode="global_norm", clip=-1.0), r"global_clipnorm must be finite and >= 0 \(0: no clip\)"),
    ]
    for over, pattern in cases:
        kw = dict(rule="sgd", vars=v, grads=g, slots=[], hparams={"learning_rate": 0.1})
        kw.update(over)
        with pytest.raises(ValueError, match=pattern):
            _core.clip_apply(**kw)
        for x, b in zip(v, before):
            np.testing.assert_array_equal(x, b)
