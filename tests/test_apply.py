"""fused_clip_apply against NumPy float64, TF's ResourceApply* ops and the Keras 3 optimizers."""
import sys

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from conftest import TOL, assert_close
import reference as ref

NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
            "float64": np.float64}

# (name, tfclip rule factory, reference rule, reference hparams)
RULES = {
    "sgd": (lambda: tfclip.rules.SGD(0.1), "sgd", {"learning_rate": 0.1}),
    "sgd_wd": (lambda: tfclip.rules.SGD(0.1, weight_decay=0.05), "sgd",
               {"learning_rate": 0.1, "weight_decay": 0.05}),
    "momentum": (lambda: tfclip.rules.Momentum(0.1, 0.9), "momentum",
                 {"learning_rate": 0.1, "momentum": 0.9}),
    "momentum_nesterov": (lambda: tfclip.rules.Momentum(0.1, 0.9, use_nesterov=True), "momentum",
                          {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "keras_momentum": (lambda: tfclip.rules.SGD(0.1, momentum=0.8), "keras_momentum",
                       {"learning_rate": 0.1, "momentum": 0.8}),
    "keras_nesterov": (lambda: tfclip.rules.SGD(0.1, momentum=0.8, nesterov=True), "keras_momentum",
                       {"learning_rate": 0.1, "momentum": 0.8, "nesterov": True}),
    "adam": (lambda: tfclip.rules.Adam(0.01), "adam", {"learning_rate": 0.01}),
    "amsgrad": (lambda: tfclip.rules.Adam(0.01, amsgrad=True), "adam",
                {"learning_rate": 0.01, "amsgrad": True}),
    "adamw": (lambda: tfclip.rules.AdamW(0.01, weight_decay=0.1), "adam",
              {"learning_rate": 0.01, "weight_decay": 0.1}),
}
MODES = {"none": {}, "global_norm": {"global_clipnorm": 0.7}, "norm": {"clipnorm": 0.4},
         "value": {"clipvalue": 0.3}}


def run_reference(rule, hp, mode, clip, var0, grad_steps, np_dtype):
    """float64 math, rounding vars, slots and clipped gradients to the storage dtype each step."""
    rnd = lambda a: np.asarray(a, np.float64).astype(np_dtype).astype(np.float64)
    vars_ = [rnd(v) for v in var0]
    slots = [[np.zeros_like(v) for _ in range(ref.num_slots(rule, hp))] for v in vars_]
    for t, grads in enumerate(grad_steps, start=1):
        clipped = ref.clip([rnd(g) for g in grads], mode, clip)
        for i, g in enumerate(clipped):
            vars_[i] = rnd(ref.step(rule, vars_[i], slots[i], rnd(g), hp, t))
            for s in slots[i]:
                s[...] = rnd(s)
    return vars_, slots


def make_problem(rng, shapes, steps, scale=1.0):
    var0 = [rng.normal(size=s) for s in shapes]
    grad_steps = [[rng.normal(size=s) * scale for s in shapes] for _ in range(steps)]
    return var0, grad_steps


def run_tfclip(rule_obj, var0, grad_steps, dtype, grad_dtype=None, **kw):
    variables = [tf.Variable(v, dtype=dtype) for v in var0]
    for grads in grad_steps:
        res = tfclip.fused_clip_apply(
            [(tf.constant(g, grad_dtype or dtype), v) for g, v in zip(grads, variables)],
            rule_obj, **kw)
        assert bool(res.applied)
    return variables


@pytest.mark.parametrize("mode", MODES, ids=MODES.keys())
@pytest.mark.parametrize("rule_name", RULES, ids=RULES.keys())
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rules_and_modes_match_float64_reference(rng, rule_name, mode, dtype):
    make_rule, rule, hp = RULES[rule_name]
    var0, grad_steps = make_problem(rng, [(5,), (3, 4), ()], steps=10, scale=0.5)
    kw = MODES[mode]
    r = make_rule()
    got = run_tfclip(r, var0, grad_steps, getattr(tf, dtype), **kw)
    clip = next(iter(kw.values()), None)
    want, want_slots = run_reference(rule, hp, mode, clip, var0, grad_steps, NP_DTYPE[dtype])
    for g, w in zip(got, want):
        assert_close(g.numpy(), w, dtype, scale=10)
    for v, ws in zip(got, want_slots):
        for name, s in zip(r.slot_names, ws):
            assert_close(r.slots(v)[name].numpy(), s, dtype, scale=10)
    assert int(r.iterations.numpy()) == 10


@pytest.mark.parametrize("rule_name", ["sgd", "keras_momentum", "adam", "adamw"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_vars_match_rounded_reference(rng, rule_name, dtype):
    make_rule, rule, hp = RULES[rule_name]
    var0, grad_steps = make_problem(rng, [(9,), (2, 3)], steps=3, scale=0.5)
    got = run_tfclip(make_rule(), var0, grad_steps, getattr(tf, dtype), global_clipnorm=0.7)
    want, _ = run_reference(rule, hp, "global_norm", 0.7, var0, grad_steps, NP_DTYPE[dtype])
    rtol, _ = TOL[dtype]
    for g, w in zip(got, want):
        # Within a couple of ulps of the value (our math is fp32, the reference fp64).
        np.testing.assert_allclose(g.numpy().astype(np.float64), w, rtol=2 * rtol, atol=rtol)


def test_mixed_dtypes_and_low_precision_grads_in_one_call(rng):
    var0, grad_steps = make_problem(rng, [(6,), (4,), (5,), (3,)], steps=3)
    var_dtypes = [tf.float32, tf.float32, tf.float64, tf.float16]
    grad_dtypes = [tf.bfloat16, tf.float16, tf.float64, tf.float16]
    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(v, dtype=d) for v, d in zip(var0, var_dtypes)]
    for grads in grad_steps:
        tfclip.fused_clip_apply([(tf.constant(g, gd), v) for g, gd, v in
                                 zip(grads, grad_dtypes, variables)], r, global_clipnorm=1.0)
    # Reference: gradients rounded to their dtype, one global norm over all of them.
    rounded = [[np.asarray(g).astype(NP_DTYPE[gd.name]).astype(np.float64) for g, gd in
                zip(grads, grad_dtypes)] for grads in grad_steps]
    want = [np.asarray(v).astype(NP_DTYPE[d.name]).astype(np.float64) for v, d in zip(var0, var_dtypes)]
    slots = [[np.zeros_like(v), np.zeros_like(v)] for v in want]
    for t, grads in enumerate(rounded, start=1):
        for i, g in enumerate(ref.clip(grads, "global_norm", 1.0)):
            want[i] = ref.step("adam", want[i], slots[i], g, {"learning_rate": 0.01}, t)
    tols = ["bfloat16", "float16", "float64", "float16"]
    for v, w, tol in zip(variables, want, tols):
        assert_close(v.numpy(), w, tol, scale=2)


FLOATS = ["float16", "bfloat16", "float32", "float64"]


def rnd(a, dtype):
    return np.asarray(a, np.float64).astype(NP_DTYPE[dtype]).astype(np.float64)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
@pytest.mark.parametrize("mode", MODES, ids=MODES.keys())
@pytest.mark.parametrize("grad_dtype", FLOATS)
@pytest.mark.parametrize("var_dtype", FLOATS)
def test_any_float_gradient_for_any_float_variable(rng, var_dtype, grad_dtype, mode, sparse):
    """Stock Keras clips a gradient in its own dtype and casts it to its variable's dtype in
    update_step; tfclip does the same inside the apply pass (no cast op, no extra pass)."""
    var0, grad_steps = make_problem(rng, [(4, 3), (5,)], steps=3, scale=0.8)
    kw = MODES[mode]
    c = next(iter(kw.values()), None)
    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(v, dtype=var_dtype) for v in var0]
    want = [rnd(v, var_dtype) for v in var0]
    slots = [[np.zeros_like(v), np.zeros_like(v)] for v in want]
    for t, grads in enumerate(grad_steps, start=1):
        gq = [rnd(g, grad_dtype) for g in grads]
        if sparse:  # rows 3, 0, 2, each once: the values of the dense gradient with row 1 zero
            gq[0][1] = 0.0
            g0 = tf.IndexedSlices(tf.constant(gq[0][[3, 0, 2]], grad_dtype), tf.constant([3, 0, 2]),
                                  tf.constant([4, 3]))
        else:
            g0 = tf.constant(gq[0], grad_dtype)
        res = tfclip.fused_clip_apply([(g0, variables[0]), (tf.constant(gq[1], grad_dtype), variables[1])],
                                      r, **kw)
        assert bool(res.applied)
        # Reference: clipped in the gradient's dtype (scale and bounds rounded to it, as TF's
        # `g * cast(scale, g.dtype)` and clip_by_value), then cast to the variable's dtype.
        if mode == "value":
            clipped = [np.clip(g, -rnd(c, grad_dtype), rnd(c, grad_dtype)) for g in gq]
        elif mode == "none":
            clipped = gq
        else:
            norms = [ref.global_norm(gq)] * 2 if mode == "global_norm" else [ref.global_norm([g]) for g in gq]
            scales = [c / max(n, c) for n in norms]
            clipped = [rnd(g * rnd(k, grad_dtype), grad_dtype) for g, k in zip(gq, scales)]
        for i, g in enumerate(clipped):
            want[i] = rnd(ref.step("adam", want[i], slots[i], rnd(g, var_dtype), {"learning_rate": 0.01}, t),
                          var_dtype)
            for sl in slots[i]:
                sl[...] = rnd(sl, var_dtype)
    for v, w in zip(variables, want):
        assert_close(v.numpy(), w, var_dtype, scale=10)
    assert v.dtype == getattr(tf, var_dtype)


@pytest.mark.parametrize("shapes", [
    [()], [(0,), (4,)], [(7,), (1, 13)], [(200_003,), (5,)], [(i % 5 + 1,) for i in range(1100)]],
    ids=["scalar", "empty", "odd", "over_chunk", "many"])
def test_shapes(rng, shapes):
    var0, grad_steps = make_problem(rng, shapes, steps=2)
    r = tfclip.rules.Adam(0.01)
    got = run_tfclip(r, var0, grad_steps, tf.float32, global_clipnorm=1.0)
    want, _ = run_reference("adam", {"learning_rate": 0.01}, "global_norm", 1.0, var0, grad_steps,
                            np.float32)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert_close(g.numpy(), w, "float32", scale=10)


# ------------------------------------------------------------------ against TF's own ops
def _tf_raw_step(kind, v, slots, g, t, lr):
    raw = tf.raw_ops
    if kind == "sgd":
        raw.ResourceApplyGradientDescent(var=v.handle, alpha=lr, delta=g)
    elif kind in ("momentum", "momentum_nesterov"):
        raw.ResourceApplyMomentum(var=v.handle, accum=slots[0].handle, lr=lr, grad=g,
                                  momentum=0.9, use_nesterov=kind.endswith("nesterov"))
    elif kind in ("keras_momentum", "keras_nesterov"):
        raw.ResourceApplyKerasMomentum(var=v.handle, accum=slots[0].handle, lr=lr, grad=g,
                                       momentum=0.8, use_nesterov=kind.endswith("nesterov"))
    elif kind == "adam":
        raw.ResourceApplyAdam(var=v.handle, m=slots[0].handle, v=slots[1].handle,
                              beta1_power=0.9 ** t, beta2_power=0.999 ** t, lr=lr, beta1=0.9,
                              beta2=0.999, epsilon=1e-7, grad=g)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "momentum_nesterov", "keras_momentum",
                                  "keras_nesterov", "adam"])
def test_matches_tf_resource_apply_ops_after_clip_by_global_norm(rng, kind):
    var0, grad_steps = make_problem(rng, [(6,), (2, 5)], steps=10)
    schedule = lambda step: 0.05 * 0.9 ** tf.cast(step, tf.float32)  # a learning-rate schedule
    lr_t = lambda step: schedule(step)
    factories = {"sgd": lambda: tfclip.rules.SGD(schedule),
                 "momentum": lambda: tfclip.rules.Momentum(schedule, 0.9),
                 "momentum_nesterov": lambda: tfclip.rules.Momentum(schedule, 0.9, use_nesterov=True),
                 "keras_momentum": lambda: tfclip.rules.SGD(schedule, momentum=0.8),
                 "keras_nesterov": lambda: tfclip.rules.SGD(schedule, momentum=0.8, nesterov=True),
                 "adam": lambda: tfclip.rules.Adam(schedule)}
    r = factories[kind]()
    got = [tf.Variable(v, dtype=tf.float32) for v in var0]
    want = [tf.Variable(v, dtype=tf.float32) for v in var0]
    nslots = {"sgd": 0, "adam": 2}.get(kind, 1)
    slots = [[tf.Variable(tf.zeros_like(v)) for _ in range(nslots)] for v in want]
    for step, grads in enumerate(grad_steps):
        gs = [tf.constant(g, tf.float32) for g in grads]
        tfclip.fused_clip_apply(zip(gs, got), r, global_clipnorm=1.0)
        clipped, _ = tf.clip_by_global_norm(gs, 1.0)
        for v, s, g in zip(want, slots, clipped):
            _tf_raw_step(kind, v, s, g, step + 1, lr_t(step))
    for g, w in zip(got, want):
        assert_close(g.numpy(), w.numpy(), "float32", scale=10)
    for v, s in zip(got, slots):
        for name, sv in zip(r.slot_names, s):
            assert_close(r.slots(v)[name].numpy(), sv.numpy(), "float32", scale=10)


KERAS = {
    "sgd": (lambda lr, **k: keras.optimizers.SGD(lr, **k), lambda lr: tfclip.rules.SGD(lr)),
    "sgd_momentum": (lambda lr, **k: keras.optimizers.SGD(lr, momentum=0.9, **k),
                     lambda lr: tfclip.rules.SGD(lr, momentum=0.9)),
    "sgd_nesterov": (lambda lr, **k: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True, **k),
                     lambda lr: tfclip.rules.SGD(lr, momentum=0.9, nesterov=True)),
    "adam": (lambda lr, **k: keras.optimizers.Adam(lr, **k), lambda lr: tfclip.rules.Adam(lr)),
    "adam_amsgrad": (lambda lr, **k: keras.optimizers.Adam(lr, amsgrad=True, **k),
                     lambda lr: tfclip.rules.Adam(lr, amsgrad=True)),
    "adamw": (lambda lr, **k: keras.optimizers.AdamW(lr, weight_decay=0.05, **k),
              lambda lr: tfclip.rules.AdamW(lr, weight_decay=0.05)),
}


@pytest.mark.parametrize("clip", [{"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"clipvalue": 0.2}],
                         ids=["global_clipnorm", "clipnorm", "clipvalue"])
@pytest.mark.parametrize("name", KERAS, ids=KERAS.keys())
def test_matches_keras3_optimizers_over_10_steps(rng, name, clip):
    make_keras, make_rule = KERAS[name]
    var0, grad_steps = make_problem(rng, [(6,), (3, 4), (1,)], steps=10, scale=2.0)
    sched = lambda: keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5)
    kopt = make_keras(sched(), **clip)
    r = make_rule(sched())
    kvars = [tf.Variable(v, dtype=tf.float32) for v in var0]
    fvars = [tf.Variable(v, dtype=tf.float32) for v in var0]
    for grads in grad_steps:
        gs = [tf.constant(g, tf.float32) for g in grads]
        kopt.apply_gradients(zip(gs, kvars))
        tfclip.fused_clip_apply(zip(gs, fvars), r, **clip)
    for k, f in zip(kvars, fvars):
        assert_close(f.numpy(), k.numpy(), "float32", scale=10)
    assert int(r.iterations.numpy()) == int(kopt.iterations.numpy()) == 10


# ------------------------------------------------------------------ selection and policies
def test_none_gradients_and_unlisted_variables_are_untouched(rng):
    a, b, c = (tf.Variable(rng.normal(size=(4,)).astype(np.float32)) for _ in range(3))
    b0, c0 = b.numpy().copy(), c.numpy().copy()
    ga = tf.constant(rng.normal(size=(4,)).astype(np.float32) * 10)
    r = tfclip.rules.SGD(1.0)
    res = tfclip.fused_clip_apply([(ga, a), (None, b)], r, global_clipnorm=1.0)  # c unlisted
    np.testing.assert_array_equal(b.numpy(), b0)
    np.testing.assert_array_equal(c.numpy(), c0)
    assert_close(res.global_norm, np.linalg.norm(ga.numpy()), "float32")  # b not in the norm
    assert b.ref() not in r._slots and c.ref() not in r._slots


def _nonfinite_problem(rng, n=500):
    var0 = [rng.normal(size=(3,)).astype(np.float32) for _ in range(n)]
    grads = [rng.normal(size=(3,)).astype(np.float32) for _ in range(n)]
    grads[n * 2 // 3][1] = np.inf
    return var0, grads


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_skip_writes_nothing(rng, bad):
    var0, grads = _nonfinite_problem(rng)
    grads[333][1] = bad
    variables = [tf.Variable(v) for v in var0]
    r = tfclip.rules.Adam(0.1)
    tfclip.fused_clip_apply([(tf.ones_like(v), v) for v in variables], r)  # slots non-zero
    before = [v.numpy().copy() for v in variables]
    slots_before = [[s.numpy().copy() for s in r.slots(v).values()] for v in variables]
    res = tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, variables)], r,
                                  global_clipnorm=1.0)
    assert not bool(res.applied) and not np.isfinite(res.global_norm.numpy())
    for v, b, sb in zip(variables, before, slots_before):
        np.testing.assert_array_equal(v.numpy(), b)
        for s, x in zip(r.slots(v).values(), sb):
            np.testing.assert_array_equal(s.numpy(), x)
    assert int(r.iterations.numpy()) == 1


def test_nonfinite_raise_writes_nothing(rng):
    var0, grads = _nonfinite_problem(rng)
    variables = [tf.Variable(v) for v in var0]
    r = tfclip.rules.Momentum(0.1, 0.9)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, variables)], r,
                                clipnorm=1.0, nonfinite="raise")
    for v, v0 in zip(variables, var0):
        np.testing.assert_array_equal(v.numpy(), v0)
    assert int(r.iterations.numpy()) == 0


@pytest.mark.parametrize("mode", ["global_clipnorm", "clipnorm", "clipvalue"])
def test_nonfinite_propagate_matches_tf(rng, mode):
    var0, grads = _nonfinite_problem(rng, n=20)
    grads[0][0], grads[5][2] = np.inf, np.nan
    got = [tf.Variable(v) for v in var0]
    want = [tf.Variable(v) for v in var0]
    gs = [tf.constant(g) for g in grads]
    res = tfclip.fused_clip_apply(zip(gs, got), tfclip.rules.SGD(0.1), nonfinite="propagate",
                                  **{mode: 1.0})
    assert bool(res.applied)
    clipped = {"global_clipnorm": lambda: tf.clip_by_global_norm(gs, 1.0)[0],
               "clipnorm": lambda: [tf.clip_by_norm(g, 1.0) for g in gs],
               "clipvalue": lambda: [tf.clip_by_value(g, -1.0, 1.0) for g in gs]}[mode]()
    for v, g in zip(want, clipped):
        tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=0.1, delta=g)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g.numpy()), np.isnan(w.numpy()))
        assert_close(np.nan_to_num(g.numpy()), np.nan_to_num(w.numpy()), "float32")


def test_use_norm_replaces_the_norm_pass(rng):
    var0, grad_steps = make_problem(rng, [(5,)], steps=1)
    v = tf.Variable(var0[0], dtype=tf.float32)
    g = tf.constant(grad_steps[0][0], tf.float32)
    res = tfclip.fused_clip_apply([(g, v)], tfclip.rules.SGD(1.0), global_clipnorm=1.0, use_norm=10.0)
    assert_close(res.global_norm, 10.0, "float32")
    assert_close(v.numpy(), var0[0] - grad_steps[0][0] * 0.1, "float32")


# ------------------------------------------------------------------ execution modes
def test_tf_function_matches_eager(rng):
    var0, grad_steps = make_problem(rng, [(5,), (2, 2)], steps=4)
    eager = [tf.Variable(v, dtype=tf.float32) for v in var0]
    fn = [tf.Variable(v, dtype=tf.float32) for v in var0]
    r1, r2 = tfclip.rules.Adam(0.01), tfclip.rules.Adam(0.01)

    @tf.function
    def step(gs):
        return tfclip.fused_clip_apply(zip(gs, fn), r2, global_clipnorm=0.5)

    for grads in grad_steps:
        gs = [tf.constant(g, tf.float32) for g in grads]
        tfclip.fused_clip_apply(zip(gs, eager), r1, global_clipnorm=0.5)
        step(gs)
    for a, b in zip(eager, fn):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(r2.iterations.numpy()) == 4


def test_tf1_graph_session_compute_gradients_stop_gradient_var_list(rng):
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    w0, b0, f0 = (rng.normal(size=s).astype(np.float32) for s in [(3, 1), (1,), (3, 1)])

    def build(fused):
        w = tf.Variable(w0, name="w")
        b = tf.Variable(b0, name="b")
        frozen = tf.Variable(f0, name="frozen")  # behind tf.stop_gradient: gradient None
        pred = tf.matmul(x, w) + b + tf.matmul(x, tf.stop_gradient(frozen))
        loss = tf.reduce_mean((pred - y) ** 2) * 100.0
        opt = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
        gvs = opt.compute_gradients(loss, var_list=[w, b, frozen])
        if fused:
            train = tfclip.fused_clip_apply(gvs, tfclip.rules.Momentum(0.05, 0.9), global_clipnorm=1.0)
        else:
            grads, variables = zip(*[(g, v) for g, v in gvs if g is not None])
            grads, _ = tf.clip_by_global_norm(grads, 1.0)
            train = opt.apply_gradients(zip(grads, variables))
        return train, [w, b, frozen]

    results = []
    for fused in (True, False):
        with tf.Graph().as_default():
            train, variables = build(fused)
            init = tf.compat.v1.global_variables_initializer()
            with tf.compat.v1.Session() as sess:
                sess.run(init)
                for _ in range(5):
                    sess.run(train)
                results.append(sess.run(variables))
    for a, b in zip(*results):
        assert_close(a, b, "float32", scale=10)
    np.testing.assert_array_equal(results[0][2], f0)  # frozen untouched


def test_update_does_not_change_a_value_read_before(rng):
    v = tf.Variable(rng.normal(size=(6,)).astype(np.float32))
    before = v.value()  # aliases the buffer; copy-on-write must keep it
    snapshot = before.numpy().copy()
    tfclip.fused_clip_apply([(tf.ones([6]), v)], tfclip.rules.SGD(1.0))
    np.testing.assert_array_equal(before.numpy(), snapshot)
    np.testing.assert_array_equal(v.numpy(), snapshot - 1)


def test_one_rule_over_changing_variable_lists_keeps_each_variables_slots():
    """Eagerly, a rule keeps the op's handle lists for the last list of variables. Lists that
    change order or membership between steps must still reach each variable's own slots."""
    a = tf.Variable([1.0, 2.0], dtype=tf.float64)
    b = tf.Variable([10.0, 20.0, 30.0], dtype=tf.float64)
    rule = tfclip.rules.SGD(0.1, momentum=0.9)
    want = {"a": [np.array([1.0, 2.0]), np.zeros(2)], "b": [np.array([10.0, 20.0, 30.0]), np.zeros(3)]}

    def step(names_and_grads):
        pairs = [(tf.constant(g, tf.float64), {"a": a, "b": b}[k]) for k, g in names_and_grads]
        tfclip.fused_clip_apply(pairs, rule)
        for k, g in names_and_grads:  # Keras SGD momentum: m = 0.9 m - lr g; var += m
            var, m = want[k]
            m[:] = 0.9 * m - 0.1 * np.asarray(g)
            var += m

    step([("a", [1.0, -1.0]), ("b", [0.5, 0.5, 0.5])])
    step([("a", [2.0, 0.0]), ("b", [1.0, 1.0, 1.0])])  # the same list again: cached handles
    step([("b", [-3.0, 0.0, 3.0]), ("a", [4.0, 4.0])])  # another order
    step([("a", [1.0, 1.0])])  # a subset
    step([("a", [0.5, 0.0]), ("b", [1.0, 2.0, 3.0])])
    np.testing.assert_allclose(a.numpy(), want["a"][0], rtol=1e-12)
    np.testing.assert_allclose(b.numpy(), want["b"][0], rtol=1e-12)
    np.testing.assert_allclose(rule.slots(a)["momentum"].numpy(), want["a"][1], rtol=1e-12)
    np.testing.assert_allclose(rule.slots(b)["momentum"].numpy(), want["b"][1], rtol=1e-12)


def _snapshot(variables):
    return [v.numpy().copy() for v in variables]


@pytest.mark.parametrize("bad, error, words", [
    (lambda g: tf.reshape(g, [2, 3]), ValueError, "grads_and_vars[1]: gradient shape differs"),
    (lambda g: g[:5], ValueError, "grads_and_vars[1]: gradient element count differs"),
    (lambda g: tf.cast(g, tf.int32), TypeError, "grads_and_vars[1]: gradient dtype int32"),
])
def test_repeated_eager_step_still_names_a_bad_gradient_and_writes_nothing(rng, bad, error, words):
    """A repeated eager step over the same variables skips the per-pair Python checks (the op
    checks dtypes and shapes before writing): a bad gradient must still get the named Python
    error of the full check, with no variable, slot or step count changed."""
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in [(4,), (6,), (2, 2)]]
    rule = tfclip.rules.Adam(0.1)

    def grads():
        return [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in variables]

    tfclip.fused_clip_apply(zip(grads(), variables), rule, global_clipnorm=1.0)
    tfclip.fused_clip_apply(zip(grads(), variables), rule, global_clipnorm=1.0)  # the fast path
    assert rule._pairs_cache is not None
    before = _snapshot(variables + rule.variables)
    gs = grads()
    gs[1] = bad(gs[1])
    with pytest.raises(error) as e:
        tfclip.fused_clip_apply(zip(gs, variables), rule, global_clipnorm=1.0)
    assert words in str(e.value)
    for b, v in zip(before, variables + rule.variables):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(rule.iterations.numpy()) == 2


def test_repeated_pair_split_accepts_only_the_same_variables_with_exact_type_gradients():
    """The repeated eager step's gate (tfclip._eager.split_repeated_pairs, one C pass): the
    gradients, in order, only for a list of 2-tuples whose variables are the remembered objects
    themselves and whose gradients are exactly the given type; anything else is None, so the
    step takes the full path."""
    from tfclip import _eager as _core

    class Grad:
        pass

    class SubGrad(Grad):
        pass

    class Var:
        def __eq__(self, other):  # must never be asked: identity decides
            raise AssertionError("__eq__ called")

    vs = (Var(), Var(), Var())
    gs = [Grad(), Grad(), Grad()]
    got = _core.split_repeated_pairs(list(zip(gs, vs)), vs, Grad)
    assert type(got) is list and len(got) == 3 and all(a is b for a, b in zip(got, gs))
    assert _core.split_repeated_pairs([], (), Grad) == []
    refused = {
        "another variable object": (list(zip(gs, (vs[0], Var(), vs[2]))), vs, Grad),
        "another order": (list(zip(gs, (vs[1], vs[0], vs[2]))), vs, Grad),
        "one pair fewer": (list(zip(gs[:2], vs[:2])), vs, Grad),
        "a subclass gradient": (list(zip([gs[0], SubGrad(), gs[2]], vs)), vs, Grad),
        "a None gradient": (list(zip([gs[0], None, gs[2]], vs)), vs, Grad),
        "pairs as lists": ([[g, v] for g, v in zip(gs, vs)], vs, Grad),
        "a 3-tuple": ([(gs[0], vs[0], 1)] + list(zip(gs[1:], vs[1:])), vs, Grad),
        "pairs as a tuple": (tuple(zip(gs, vs)), vs, Grad),
        "variables as a list": (list(zip(gs, vs)), list(vs), Grad),
        "no type": (list(zip(gs, vs)), vs, Grad()),
    }
    counts = [sys.getrefcount(g) for g in gs]
    for what, args in refused.items():
        assert _core.split_repeated_pairs(*args) is None, what
    assert [sys.getrefcount(g) for g in gs] == counts  # a refused half-filled list leaks nothing


def test_repeated_eager_steps_match_the_full_path_whatever_the_gradients(rng):
    """The same variable list over eager steps whose gradients change kind (dense, None,
    IndexedSlices, NumPy) and hyper-parameters that change between steps: every step must be
    the float64 reference's, each variable touched only when it has a gradient."""
    shapes = [(3, 2), (5,), (4, 2)]
    variables = [tf.Variable(rng.standard_normal(s)) for s in shapes]
    want = [v.numpy().copy() for v in variables]
    rule = tfclip.rules.SGD(0.1)
    for step in range(8):
        gs = [rng.standard_normal(s) for s in shapes]
        given = [tf.constant(g) for g in gs]
        if step == 3:
            given[1] = None
        if step == 4:
            given[0] = tf.IndexedSlices(tf.constant(gs[0][[2, 0]]), tf.constant([2, 0]), tf.constant([3, 2]))
            gs[0] = np.zeros((3, 2))
            gs[0][[2, 0]] = given[0].values.numpy()
        if step == 5:
            given[2] = gs[2]  # a NumPy array
        if step == 6:  # a float32 gradient for a float64 variable: cast as Keras casts it
            gs[1] = gs[1].astype(np.float32).astype(np.float64)
            given[1] = tf.constant(gs[1], tf.float32)
        lr = 0.1 if step < 6 else 0.05
        rule.learning_rate = lr
        tfclip.fused_clip_apply(zip(given, variables), rule, global_clipnorm=1.5)
        present = [g for g, t in zip(gs, given) if t is not None]
        norm = np.sqrt(sum(np.sum(g * g) for g in present))
        scale = 1.5 / max(norm, 1.5)
        for w, g, t in zip(want, gs, given):
            if isinstance(t, tf.Tensor) and t.dtype == tf.float32:  # clipped in float32, then cast
                w -= lr * (g * np.float32(scale)).astype(np.float32).astype(np.float64)
            elif t is not None:
                w -= lr * g * scale
        for v, w in zip(variables, want):
            np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-15)
    assert int(rule.iterations.numpy()) == 8


def test_eager_step_counts_only_applied_steps_and_bias_corrects_from_it(rng):
    """Eagerly the step counter is read and bumped with raw ops: a skipped (non-finite) step
    must not count, and Adam's bias correction must use the counter's value + 1, also after
    the counter is set by hand (a restored checkpoint)."""
    var0 = rng.standard_normal(6).astype(np.float64)
    var = tf.Variable(var0)
    rule = tfclip.rules.Adam(0.01)
    g1 = rng.standard_normal(6)
    tfclip.fused_clip_apply([(tf.constant(g1), var)], rule)
    tfclip.fused_clip_apply([(tf.constant([np.nan] * 6, tf.float64), var)], rule)
    assert int(rule.iterations.numpy()) == 1
    rule.iterations.assign(41)
    g2 = rng.standard_normal(6)
    tfclip.fused_clip_apply([(tf.constant(g2), var)], rule)
    assert int(rule.iterations.numpy()) == 42
    # float64 reference: step 1 with t=1, then a step with t=42 on the same m and v.
    m = 0.1 * g1
    v = 0.001 * g1 * g1
    w = var0 - 0.01 * np.sqrt(1 - 0.999) / (1 - 0.9) * m / (np.sqrt(v) + 1e-7)
    m = 0.9 * m + 0.1 * g2
    v = 0.999 * v + 0.001 * g2 * g2
    lr_t = 0.01 * np.sqrt(1 - 0.999 ** 42) / (1 - 0.9 ** 42)
    w = w - lr_t * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(var.numpy(), w, rtol=1e-12)


# ------------------------------------------------------------------ the op's packed inputs
F64 = tf.float64
PACKED_RULES = {  # op, its slot inputs, its hyper-parameters
    "sgd": ("tfclip_clip_apply_sgd", (), dict(lr=0.1, weight_decay=0.01)),
    "keras_nesterov": ("tfclip_clip_apply_keras_momentum", ("accum",),
                       dict(lr=0.1, momentum=0.8, weight_decay=0.0, use_nesterov=True)),
    "momentum": ("tfclip_clip_apply_momentum", ("accum",), dict(lr=0.1, momentum=0.9, weight_decay=0.0)),
    "amsgrad_adamw": ("tfclip_clip_apply_adam", ("m", "v", "vhat"),
                      dict(lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.004,
                           step=3.0, beta_1_power=float("nan"), beta_2_power=float("nan"), amsgrad=True)),
}


def _raw_apply(name, handles, grads, iterations=(), nonfinite="skip", **hp_over):
    """One raw apply op call, global clip 0.5: `handles` maps "var" and each slot input to its
    list; `hp_over` replaces hyper-parameters."""
    op, slot_inputs, hp = PACKED_RULES[name]
    hp = {**hp, **{k: v for k, v in hp_over.items() if k in hp}}
    kw = {k: (tf.constant(v, F64) if isinstance(v, float) else v) for k, v in hp.items()}
    return getattr(tfclip._loader.ops(), op)(
        var=handles["var"], **{s: handles[s] for s in slot_inputs}, grad=grads, indices=[], absmax=[], grad_scale=[], rounding=[],
        iterations=list(iterations), clip=tf.constant(0.5, F64), use_norm=tf.constant(0.0, F64),
        clip_mode="global_norm", nonfinite=nonfinite, **kw)


def _packed_problem(rng, name, shapes=((3,), (2, 4), (5,), (1,))):
    """Two identical sets of variables and slots (random, so every slot term matters)."""
    slot_inputs = PACKED_RULES[name][1]
    init = {k: [rng.standard_normal(s).astype(np.float32) for s in shapes] for k in ("var",) + slot_inputs}
    if "v" in init:  # Adam's second moments are >= 0
        init["v"] = [np.abs(x) for x in init["v"]]
        init["vhat"] = [x + 0.5 for x in init["v"]]
    make = lambda: {k: [tf.Variable(x) for x in xs] for k, xs in init.items()}  # noqa: E731
    return make(), make()


@pytest.mark.parametrize("name", PACKED_RULES)
def test_packed_handle_inputs_update_exactly_as_one_handle_per_input(rng, name):
    """A resource list may pack its handles into vectors (the eager path packs all of a list
    into one): the result must be the same bits as one handle per input, for every rule, over
    steps, including a partition that mixes a vector and a scalar handle in one list."""
    a, b = _packed_problem(rng, name)
    pack = lambda vs: tf.raw_ops.Pack(values=[v.handle for v in vs], axis=0)  # noqa: E731
    for step in range(3):
        grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in a["var"]]
        ra = _raw_apply(name, {k: [v.handle for v in vs] for k, vs in a.items()}, grads)
        if step == 1:  # each list as a vector of three and a scalar handle
            hb = {k: [pack(vs[:3]), vs[3].handle] for k, vs in b.items()}
        else:
            hb = {k: [pack(vs)] for k, vs in b.items()}
        rb = _raw_apply(name, hb, grads)
        assert float(ra[0]) == float(rb[0]) and bool(ra[1]) and bool(rb[1])
        for k in a:
            for x, y in zip(a[k], b[k]):
                np.testing.assert_array_equal(x.numpy(), y.numpy(), err_msg=f"{name} {k} step {step}")


@pytest.mark.parametrize("name", PACKED_RULES)
def test_op_owned_step_counter_counts_applied_steps_and_gives_adam_its_step(rng, name):
    """With `iterations`, the op reads the counter under its locks (Adam's t = iterations +
    step) and advances it by one for an applied step only: the same bits as passing the step
    and counting outside, a skipped (non-finite) step leaves it alone, 'raise' too."""
    a, b = _packed_problem(rng, name)
    counter = tf.Variable(6, dtype=tf.int64)
    lists = lambda vs: {k: [v.handle for v in x] for k, x in vs.items()}  # noqa: E731
    for step in range(3):
        grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in a["var"]]
        # The reference is told t = iterations + 1; the op with the counter is told step=1.
        ra = _raw_apply(name, lists(a), grads, step=float(counter.numpy()) + 1.0)
        rb = _raw_apply(name, lists(b), grads, iterations=[counter.handle], step=1.0)
        assert bool(rb[1]) and int(counter.numpy()) == 7 + step
        assert float(ra[0]) == float(rb[0])
        for k in a:
            for x, y in zip(a[k], b[k]):
                np.testing.assert_array_equal(x.numpy(), y.numpy(), err_msg=f"{name} {k} step {step}")
        bad = [tf.fill(g.shape, np.float32("nan")) for g in grads]
        rs = _raw_apply(name, lists(b), bad, iterations=[counter.handle], step=1.0)
        assert not bool(rs[1])
        with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
            _raw_apply(name, lists(b), bad, iterations=[counter.handle], step=1.0, nonfinite="raise")
        assert int(counter.numpy()) == 7 + step  # neither the skipped nor the raised step counted
        for k in a:
            for x, y in zip(a[k], b[k]):
                np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_eager_steps_use_packed_handles_and_the_op_owned_counter(rng):
    """The eager path on host variables packs its handle lists and lets the op count: after a
    first step the rule's cached inputs are one vector per list and the counter is the op's,
    and steps still match TF's own ResourceApplyAdam (bias correction from the counter)."""
    var0, grad_steps = make_problem(rng, [(6,), (2, 5), (3,)], steps=4)
    rule = tfclip.rules.Adam(0.05)
    got = [tf.Variable(v, dtype=tf.float32) for v in var0]
    want = [tf.Variable(v, dtype=tf.float32) for v in var0]
    slots = [[tf.Variable(tf.zeros_like(v)) for _ in range(2)] for v in want]
    for step, grads in enumerate(grad_steps):
        gs = [tf.constant(g, tf.float32) for g in grads]
        tfclip.fused_clip_apply(zip(gs, got), rule)
        ids, _, var_in, slot_in, packed, counter, absmax = rule._handle_cache
        assert absmax == []  # float32 state: no int8 absmax
        assert packed and len(var_in) == 1 and var_in[0].shape == [3]
        assert counter is rule.iterations.handle  # kept with the lists: the op counts
        assert all(len(h) == 1 and h[0].shape == [3] for h in slot_in.values())
        assert int(rule.iterations.numpy()) == step + 1
        for v, s, g in zip(want, slots, gs):
            _tf_raw_step("adam", v, s, g, step + 1, 0.05)
    for g, w in zip(got, want):
        assert_close(g.numpy(), w.numpy(), "float32", scale=10)


def test_tf_function_step_counts_in_the_op_and_orders_reads_around_it(rng):
    """In a tf.function over host variables the op owns the step counter too: reads of
    `iterations` before the step (a learning-rate schedule) see the old count, reads after it
    the new one (automatic control dependencies order them by the counter input), a skipped
    step does not count, and the updates match a float64 Adam with that schedule."""
    var0 = rng.standard_normal(5)
    var = tf.Variable(var0)
    rule = tfclip.rules.Adam(lambda step: 0.01 * 0.5 ** tf.cast(step, tf.float64))

    @tf.function
    def step(g):
        before = rule.iterations.read_value()
        r = tfclip.fused_clip_apply([(g, var)], rule, global_clipnorm=1.0)
        return before, rule.iterations.read_value(), r.applied

    graph = step.get_concrete_function(tf.TensorSpec([5], tf.float64)).graph
    assert not [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    w, m, v = var0.copy(), np.zeros(5), np.zeros(5)
    for t, g in enumerate([rng.standard_normal(5) * 3, [np.nan] * 5, rng.standard_normal(5)]):
        count = int(rule.iterations.numpy())
        before, after, applied = step(tf.constant(g, tf.float64))
        finite = bool(np.all(np.isfinite(g)))
        assert (int(before), int(after), bool(applied)) == (count, count + finite, finite)
        if finite:
            g = np.asarray(g) * min(1.0, 1.0 / np.linalg.norm(g))
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            k = count + 1
            lr = 0.01 * 0.5 ** count * np.sqrt(1 - 0.999 ** k) / (1 - 0.9 ** k)
            w = w - lr * m / (np.sqrt(v) + 1e-7)
        np.testing.assert_allclose(var.numpy(), w, rtol=1e-12)


def test_clip_zero_is_no_clip_everywhere(rng):
    """One rule for a clip of 0 in every entry point, as Keras: no clip. fused_clip_apply, the
    Keras and TF1 optimizers, the op itself and _core all give the unclipped update."""
    from tfclip import _core

    g0 = rng.normal(size=(5,)).astype(np.float32) * 10
    v0 = rng.normal(size=(5,)).astype(np.float32)
    want = v0 - 0.1 * g0  # plain SGD, no clip (the gradient's norm is far above any clip here)

    def fresh():
        return tf.Variable(v0)

    v = fresh()
    tfclip.fused_clip_apply([(tf.constant(g0), v)], tfclip.rules.SGD(0.1), global_clipnorm=0.0)
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    for kw in ({"clipnorm": 0.0}, {"clipvalue": 0}, {"global_clipnorm": tf.constant(0.0)}):
        v = fresh()
        tfclip.fused_clip_apply([(tf.constant(g0), v)], tfclip.rules.SGD(0.1), **kw)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, err_msg=str(kw))
    from tfclip._keras_version import KERAS_PROBLEM

    if KERAS_PROBLEM is None:  # (Keras 2, TF 2.15: no tfclip.keras to ask)
        v = fresh()
        tfclip.keras.SGD(0.1, global_clipnorm=0.0).apply_gradients([(tf.constant(g0), v)])
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    v = fresh()
    tfclip.compat.v1.GradientDescentOptimizer(0.1, clipnorm=0.0).apply_gradients([(tf.constant(g0), v)])
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    c = [v0.copy()]
    _core.clip_apply("sgd", c, [g0], [], {"lr": 0.1}, clip_mode="global_norm", clip=0.0)
    np.testing.assert_allclose(c[0], want, rtol=1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="global_clipnorm must be finite and >= 0"):
            _core.clip_apply("sgd", [v0.copy()], [g0], [], {"lr": 0.1}, clip_mode="global_norm", clip=bad)


@pytest.mark.parametrize("rule,slots,hp", [
    ("sgd", 0, {"lr": 0.1}),
    ("momentum", 1, {"lr": 0.1, "momentum": 0.9}),
    ("adam", 2, {"lr": 0.01}),
])
def test_core_step_counter_serves_every_rule(rng, rule, slots, hp):
    """The step counter is the core's, for every rule (it once applied to Adam only): t is
    iterations + step for whichever rule takes a step, and an applied step advances it."""
    from tfclip import _core

    v0 = [rng.normal(size=(6,)).astype(np.float32)]
    g = [rng.normal(size=(6,)).astype(np.float32)]
    a, b = [v0[0].copy()], [v0[0].copy()]
    sa = [[np.zeros(6, np.float32)] for _ in range(slots)]
    sb = [[np.zeros(6, np.float32)] for _ in range(slots)]
    counter = np.array([4], np.int64)
    step = {"step": 1.0} if rule == "adam" else {}
    _core.clip_apply(rule, a, g, sa, {**hp, **({"step": 5.0} if rule == "adam" else {})})
    _, applied = _core.clip_apply(rule, b, g, sb, {**hp, **step}, iterations=counter)
    assert applied and counter[0] == 5
    np.testing.assert_array_equal(a[0], b[0])
    bad = [np.full(6, np.nan, np.float32)]
    _, applied = _core.clip_apply(rule, b, bad, sb, {**hp, **step}, clip_mode="global_norm", clip=1.0,
                                  iterations=counter)
    assert not applied and counter[0] == 5
