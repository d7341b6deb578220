"""tfclip's ops under XLA (tf.function(jit_compile=True), CPU): the XLA kernels of csrc/xla emit
custom calls into the same core drivers as the TF kernels, so every result must be the same bits
as the non-XLA op's (tested against NumPy float64 and TF in test_apply.py and the others), for
every rule of the rule table, every clip mode, use_norm, the per-tensor norms, the non-finite
policies, mixed dtypes and IndexedSlices. The compiled module must hold the custom calls, and the
variables must be updated in place (aliased, no copy)."""
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from tfclip._engine import opcall as _opcall
import reference as ref

NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
            "float64": np.float64}


def _has_xla_kernels():
    """Whether this build has csrc/xla (TFCLIP_XLA): a jit-compiled global_norm compiles."""
    try:
        tf.function(lambda x: tfclip.global_norm([x]), jit_compile=True)(tf.ones([2]))
        return True, ""
    except tf.errors.InvalidArgumentError as e:
        return False, str(e).splitlines()[0]


HAVE_XLA, WHY = _has_xla_kernels()
pytestmark = pytest.mark.skipif(
    not HAVE_XLA, reason=f"tfclip was built without its XLA kernels (TFCLIP_XLA=OFF or TF's "
                         f"headers lack them; see the CMake message): {WHY}")


# The error a bad input raises from inside a compiled step: XLA passes the handler's code on
# (INVALID_ARGUMENT) from TF 2.18 on; TF 2.17's and 2.16's XLA:CPU report any custom call's
# failure as INTERNAL ("CustomCall failed: " + tfclip's message). The message is tfclip's on every
# version.
BAD_INPUT = (tf.errors.InternalError if tf.__version__.startswith(("2.16.", "2.17."))
             else tf.errors.InvalidArgumentError)


def assert_same_bits(a, b, what):
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
        eq = (a.view(np.uint8) == b.view(np.uint8)).all()
        if not eq:
            np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64), err_msg=what)
        assert eq, f"{what}: equal values, different bits (signed zero or NaN payload)"
    else:
        np.testing.assert_array_equal(a, b, err_msg=what)


# ---------------------------------------------------------------- the two paths, side by side
def _step(rule, variables, kw):
    return lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), rule, **kw)


class Twin:
    """The same problem twice: one rule and variable set stepped by the XLA-compiled step, one by
    the plain op (eager), from the same initial values."""

    def __init__(self, make_rule, var0, var_dtypes):
        self.rules = [make_rule(), make_rule()]
        self.vars = [[tf.Variable(v, dtype=d) for v, d in zip(var0, var_dtypes)] for _ in range(2)]
        self.fns = {}

    def step(self, grads, **kw):
        """One step on both; returns (xla result, eager result) as NumPy."""
        outs = []
        for k, jit in enumerate((True, False)):
            f = _step(self.rules[k], self.vars[k], kw)  # (the variables captured, as users do)
            if jit:
                key = tuple(sorted(kw.items()))
                fn = self.fns.get(key)
                if fn is None:
                    fn = self.fns[key] = tf.function(f, jit_compile=True)
                res = fn(list(grads))
            else:
                res = f(list(grads))
            outs.append([np.asarray(r) for r in res])
        return outs

    def assert_same(self, what=""):
        for i, (a, b) in enumerate(zip(*self.vars)):
            assert_same_bits(a.numpy(), b.numpy(), f"{what} vars[{i}]")
        ra, rb = self.rules
        for i, (a, b) in enumerate(zip(*self.vars)):
            for s in ra.slot_names:
                assert_same_bits(ra.slots(a)[s].numpy(), rb.slots(b)[s].numpy(), f"{what} {s}[{i}]")
        assert int(ra.iterations.numpy()) == int(rb.iterations.numpy()), what


def assert_results_equal(xr, er, what=""):
    for name, a, b in zip(("global_norm", "applied", "tensor_norms"), xr, er):
        assert_same_bits(a, b, f"{what} {name}")


PY_RULES = {
    "sgd": lambda: tfclip.rules.SGD(0.1),
    "sgd_wd": lambda: tfclip.rules.SGD(0.1, weight_decay=0.05),
    "keras_momentum": lambda: tfclip.rules.SGD(0.1, momentum=0.8, nesterov=True),
    "momentum": lambda: tfclip.rules.Momentum(0.1, 0.9),
    "adam": lambda: tfclip.rules.Adam(0.01),
    "amsgrad": lambda: tfclip.rules.Adam(0.01, amsgrad=True),
    "adamw": lambda: tfclip.rules.AdamW(0.01, weight_decay=0.1),
    "adagrad": lambda: tfclip.rules.Adagrad(0.05),
    "rmsprop": lambda: tfclip.rules.RMSprop(0.01, momentum=0.5, centered=True),
    "adadelta": lambda: tfclip.rules.Adadelta(1.0),
    "adamax": lambda: tfclip.rules.Adamax(0.01),
    "lion": lambda: tfclip.rules.Lion(0.001),
    "nadam": lambda: tfclip.rules.Nadam(0.01),
    "ftrl": lambda: tfclip.rules.Ftrl(0.05, l1_regularization_strength=0.01),
    "lamb": lambda: tfclip.rules.Lamb(0.01),
    "schedule_free_adamw": lambda: tfclip.rules.ScheduleFreeAdamW(0.01, warmup_steps=2, weight_decay=0.01),
    "proximal_gradient_descent": lambda: tfclip.rules.ProximalGradientDescent(
        0.05, l1_regularization_strength=0.01, l2_regularization_strength=0.1),
    "proximal_adagrad": lambda: tfclip.rules.ProximalAdagrad(0.05, l1_regularization_strength=0.01),
    "adagrad_da": lambda: tfclip.rules.AdagradDA(0.05, l1_regularization_strength=0.01,
                                                 l2_regularization_strength=0.1),
}
MODES = {"none": {}, "global_norm": {"global_clipnorm": 0.7}, "norm": {"clipnorm": 0.4},
         "value": {"clipvalue": 0.3}}
SHAPES = [(5,), (3, 4), (), (70, 3)]


def problem(rng, shapes=SHAPES, steps=3, scale=0.5):
    var0 = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) * scale for s in shapes] for _ in range(steps)]
    return var0, grads


@pytest.mark.parametrize("mode", MODES, ids=MODES.keys())
@pytest.mark.parametrize("rule", PY_RULES, ids=PY_RULES.keys())
def test_every_rule_and_mode_same_bits_as_the_op(rng, rule, mode):
    var0, steps = problem(rng)
    t = Twin(PY_RULES[rule], var0, [tf.float32] * len(var0))
    for grads in steps:
        xr, er = t.step([tf.constant(g, tf.float32) for g in grads], **MODES[mode])
        assert_results_equal(xr, er, rule)
        assert bool(xr[1])
    t.assert_same(f"{rule}/{mode}")
    assert int(t.rules[0].iterations.numpy()) == len(steps)


def test_adam_matches_float64_reference(rng):
    """One independent check of the XLA path itself (the rest compare it with the op)."""
    var0, steps = problem(rng, shapes=[(7,), (2, 3)], steps=4)
    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(v, dtype=tf.float64) for v in var0]
    fn = tf.function(lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), r,
                                                        global_clipnorm=0.7), jit_compile=True)
    for grads in steps:
        fn([tf.constant(g, tf.float64) for g in grads])
    want = [v.copy() for v in var0]
    slots = [[np.zeros_like(v), np.zeros_like(v)] for v in want]
    for t, grads in enumerate(steps, start=1):
        for i, g in enumerate(ref.clip(grads, "global_norm", 0.7)):
            want[i] = ref.step("adam", want[i], slots[i], g, {"learning_rate": 0.01}, t)
    for v, w in zip(variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-12)


# Every row of the core's rule table through the table-driven op call (_opcall.apply): a rule
# added to the table runs under XLA with nothing added to csrc/xla.
HP_VALUES = {"lr": 0.01, "momentum": 0.9, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7,
             "weight_decay": 0.01, "rho": 0.9, "step": 3.0, "u_product": 0.7,
             "lr_power": -0.6, "l1": 0.01, "l2": 0.02, "l2_shrinkage": 0.01, "beta": 0.1, "warmup_steps": 5.0,
             "global_step": 3.0, "schedule_decay": 0.004, "beta_2_decay": -0.8, "epsilon_1": 1e-30,
             "epsilon_2": 1e-3, "clip_threshold": 1.0, "shape_scale": 2.25, "rms_rate": 0.2}


def _table_cases():
    for name, row in _opcall.RULES.items():
        yield name, {}
        for f in row["flags"]:
            yield name, {f: True}


@pytest.mark.parametrize("rule,flags", list(_table_cases()),
                         ids=[f"{r}-{'-'.join(f) or 'plain'}" for r, f in _table_cases()])
def test_every_rule_table_row_same_bits(rng, rule, flags):
    row = _opcall.RULES[rule]
    var0, steps = problem(rng, shapes=[(6,), (2, 5), (130, 2)], steps=2)
    # (the optional ones too where HP_VALUES has a value: Adam's beta powers stay not given)
    hp = {n: HP_VALUES[n] for n in row["hparams"] if n in HP_VALUES or not _opcall.HPARAMS[n]["optional"]}

    def make_state():
        # Slots start positive (Adagrad's and Ftrl's accumulators must be).
        return ([tf.Variable(v, dtype=tf.float32) for v in var0],
                {s: [tf.Variable(np.full(ref.slot_shape(row, s, np.shape(v)), 0.1 + 0.01 * j), dtype=tf.float32)
                     for j, v in enumerate(var0)] for s in row["slots"]},
                tf.Variable(0, dtype=tf.int64))

    def run(state, grads, names):
        vs, sl, it = state
        return _opcall.apply(rule, [v.handle for v in vs], {s: [x.handle for x in sl[s]] for s in names},
                             grads, hp, flags, indices=[], sparse=[], clip=0.5,
                             use_norm=tf.constant(0.0, tf.float64), iterations=[it.handle],
                             clip_mode="global_norm", nonfinite="skip", use_given_norm=False)

    # The slot lists these flags use (the op tells a wrong count): the first k of the table's.
    names = None
    for k in range(len(row["slots"]), row["min_slots"] - 1, -1):
        try:
            run(make_state(), [tf.constant(g, tf.float32) for g in steps[0]], row["slots"][:k])
            names = row["slots"][:k]
            break
        except tf.errors.InvalidArgumentError:
            continue
    assert names is not None
    x_state, e_state = make_state(), make_state()
    fn = tf.function(lambda gs: run(x_state, gs, names), jit_compile=True)
    for j, grads in enumerate(steps):
        gs = [tf.constant(g, tf.float32) for g in grads]
        xr = [np.asarray(r) for r in fn(gs)]
        er = [np.asarray(r) for r in run(e_state, gs, names)]
        assert_results_equal(xr, er, rule)
        assert bool(xr[1])
    assert 'custom_call_target="tfclip_apply"' in fn.experimental_get_compiler_ir(gs)(stage="hlo")
    for a, b in zip(x_state[0], e_state[0]):
        assert_same_bits(a.numpy(), b.numpy(), f"{rule} var")
    for s in names:
        for a, b in zip(x_state[1][s], e_state[1][s]):
            assert_same_bits(a.numpy(), b.numpy(), f"{rule} {s}")
    assert int(x_state[2].numpy()) == int(e_state[2].numpy()) == len(steps)


# ---------------------------------------------------------------- use_norm, norms, policies
@pytest.mark.parametrize("mode", ["global_norm", "norm"])
def test_use_norm_same_bits(rng, mode):
    var0, steps = problem(rng)
    t = Twin(lambda: tfclip.rules.Adam(0.01), var0, [tf.float32] * len(var0))
    kw = {"global_clipnorm": 0.7} if mode == "global_norm" else {"clipnorm": 0.4}
    for grads in steps:
        xr, er = t.step([tf.constant(g, tf.float32) for g in grads], use_norm=2.5, **kw)
        assert_results_equal(xr, er)
        assert xr[0] == np.float32(2.5)
        if mode == "global_norm":
            assert np.isnan(xr[2]).all()  # no norm pass ran
        else:
            assert np.isfinite(xr[2]).all()  # clipnorm needs each tensor's norm: they are given
    t.assert_same("use_norm")


@pytest.mark.parametrize("mode", ["global_norm", "norm", "none"])
def test_grad_scale_same_bits(rng, mode):
    """The loss-scale unscale folded in (grad_scale; the custom calls' last scalar, where the op
    has one): the XLA step is the eager op's, bit for bit, on every TF's XLA path (the matrix
    runs this file on 2.16's legacy calls and 2.17's first typed FFI)."""
    var0, steps = problem(rng)
    t = Twin(lambda: tfclip.rules.Adam(0.01), var0, [tf.float32] * len(var0))
    kw = {"global_norm": {"global_clipnorm": 0.7}, "norm": {"clipnorm": 0.4}, "none": {}}[mode]
    for grads in steps:
        xr, er = t.step([tf.constant(g * 2.0 ** 10, tf.float32) for g in grads], grad_scale=2.0 ** -10, **kw)
        assert_results_equal(xr, er)
    t.assert_same("grad_scale")


def test_tensor_norms_are_each_gradients_norm(rng):
    var0, steps = problem(rng, steps=1)
    t = Twin(lambda: tfclip.rules.SGD(0.1), var0, [tf.float32] * len(var0))
    grads = [tf.constant(g, tf.float32) for g in steps[0]]
    xr, er = t.step(grads, global_clipnorm=1.0)
    assert_results_equal(xr, er)
    want = [np.sqrt(np.sum(np.asarray(g, np.float32).astype(np.float64) ** 2)) for g in steps[0]]
    np.testing.assert_allclose(xr[2], want, rtol=1e-6)
    np.testing.assert_allclose(xr[0], np.sqrt(np.sum(np.square(want))), rtol=1e-6)


def _nan_grads(rng, shapes=SHAPES):
    gs = [rng.normal(size=s) for s in shapes]
    gs[1] = gs[1].copy()
    gs[1].flat[2] = np.nan
    return [tf.constant(g, tf.float32) for g in gs]


def test_nonfinite_skip_writes_nothing(rng):
    var0, steps = problem(rng)
    t = Twin(lambda: tfclip.rules.Adam(0.01), var0, [tf.float32] * len(var0))
    t.step([tf.constant(g, tf.float32) for g in steps[0]], global_clipnorm=1.0)
    before = [v.numpy().copy() for v in t.vars[0]]
    slots_before = [t.rules[0].slots(v)["m"].numpy().copy() for v in t.vars[0]]
    xr, er = t.step(_nan_grads(rng), global_clipnorm=1.0)
    assert_results_equal(xr, er, "skip")
    assert not bool(xr[1]) and np.isnan(xr[0])
    assert np.isnan(xr[2][1]) and np.isfinite(np.delete(xr[2], 1)).all()  # the culprit named
    for v, b in zip(t.vars[0], before):
        assert_same_bits(v.numpy(), b, "skip wrote a variable")
    for v, b in zip(t.vars[0], slots_before):
        assert_same_bits(t.rules[0].slots(v)["m"].numpy(), b, "skip wrote a slot")
    assert int(t.rules[0].iterations.numpy()) == 1  # the skipped step does not count
    t.assert_same("skip")


def test_nonfinite_propagate_same_bits(rng):
    var0, _ = problem(rng)
    t = Twin(lambda: tfclip.rules.SGD(0.1), var0, [tf.float32] * len(var0))
    xr, er = t.step(_nan_grads(rng), global_clipnorm=1.0, nonfinite="propagate")
    assert_results_equal(xr, er)
    assert bool(xr[1]) and all(np.isnan(v.numpy()).all() for v in t.vars[0])
    t.assert_same("propagate")


def test_nonfinite_raise_names_the_cause_and_writes_nothing(rng):
    var0, _ = problem(rng)
    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(v, dtype=tf.float32) for v in var0]
    before = [v.numpy().copy() for v in variables]
    fn = tf.function(lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), r,
                                                        global_clipnorm=1.0, nonfinite="raise"),
                     jit_compile=True)
    with pytest.raises(BAD_INPUT, match=r"global norm of the gradients is nan.*"
                                                             r"nonfinite='raise'; no variable was updated"):
        fn(_nan_grads(rng))
    for v, b in zip(variables, before):
        assert_same_bits(v.numpy(), b, "raise wrote a variable")
    for v in variables:
        assert (r.slots(v)["m"].numpy() == 0).all()
    assert int(r.iterations.numpy()) == 0
    # And the same function still steps with finite gradients afterwards.
    fn([tf.constant(np.ones(s), tf.float32) for s in SHAPES])
    assert int(r.iterations.numpy()) == 1


def test_bad_hyper_parameter_is_an_error_naming_it(rng):
    var0, steps = problem(rng)
    r = tfclip.rules.Adam(tf.Variable(0.01, dtype=tf.float64))
    variables = [tf.Variable(v, dtype=tf.float32) for v in var0]
    fn = tf.function(lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), r), jit_compile=True)
    r.learning_rate.assign(np.inf)  # the one refusal: a non-finite hyper-parameter
    before = [v.numpy().copy() for v in variables]
    with pytest.raises(BAD_INPUT, match="learning_rate"):
        fn([tf.constant(g, tf.float32) for g in steps[0]])
    for v, b in zip(variables, before):
        assert_same_bits(v.numpy(), b, "a failed step wrote a variable")


# ---------------------------------------------------------------- dtypes, groups, sparse
def test_mixed_dtypes_same_bits(rng):
    var0, steps = problem(rng, shapes=[(6,), (4,), (5,), (3,), (2, 2)])
    var_dtypes = [tf.float32, tf.float32, tf.float64, tf.float16, tf.bfloat16]
    grad_dtypes = [tf.bfloat16, tf.float16, tf.float64, tf.float16, tf.float32]
    t = Twin(lambda: tfclip.rules.Adam(0.01), var0, var_dtypes)
    for grads in steps:
        xr, er = t.step([tf.constant(g, d) for g, d in zip(grads, grad_dtypes)], global_clipnorm=1.0)
        assert_results_equal(xr, er)
    t.assert_same("mixed")


def test_many_variables_over_several_groups_same_bits(rng):
    """More variables than one apply call takes (64): several groups, one norm."""
    shapes = [(int(k % 7) + 1, 3) for k in range(150)]
    var0, steps = problem(rng, shapes=shapes, steps=2)
    t = Twin(lambda: tfclip.rules.Lamb(0.01), var0, [tf.float32] * len(var0))
    for grads in steps:
        xr, er = t.step([tf.constant(g, tf.float32) for g in grads], clipnorm=0.5)
        assert_results_equal(xr, er)
    t.assert_same("groups")


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_indexed_slices_same_bits(rng, rule, lazy):
    """IndexedSlices go to the core as rows (values + indices), duplicates and all."""
    var0 = [rng.normal(size=(10, 3)), rng.normal(size=(4,))]
    t = Twin(PY_RULES[rule], var0, [tf.float32, tf.float32])
    for _ in range(2):
        idx = tf.constant([7, 1, 7, 0], tf.int64)
        vals = tf.constant(rng.normal(size=(4, 3)), tf.float32)
        dense = tf.constant(rng.normal(size=(4,)), tf.float32)
        xr, er = t.step([tf.IndexedSlices(vals, idx, tf.constant([10, 3], tf.int64)), dense],
                        global_clipnorm=1.0, lazy_sparse=lazy)
        assert_results_equal(xr, er)
    t.assert_same("sparse")


def test_indexed_slices_bad_index_writes_nothing(rng):
    var0 = [rng.normal(size=(5, 2)) for _ in range(70)]  # two groups: the check precedes both
    r = tfclip.rules.SGD(0.1)
    variables = [tf.Variable(v, dtype=tf.float32) for v in var0]
    before = [v.numpy().copy() for v in variables]

    @tf.function(jit_compile=True)
    def fn(idx):
        gs = [tf.ones([5, 2])] * 69 + [tf.IndexedSlices(tf.ones([1, 2]), idx, tf.constant([5, 2]))]
        return tfclip.fused_clip_apply(list(zip(gs, variables)), r)

    with pytest.raises(BAD_INPUT, match=r"grads\[69\]"):
        fn(tf.constant([9], tf.int32))
    for v, b in zip(variables, before):
        assert_same_bits(v.numpy(), b, "a bad index wrote a variable")

    @tf.function(jit_compile=True)
    def given(idx):  # use_norm given: the norm call only checks the indices, before every group
        gs = [tf.ones([5, 2])] * 69 + [tf.IndexedSlices(tf.ones([1, 2]), idx, tf.constant([5, 2]))]
        return tfclip.fused_clip_apply(list(zip(gs, variables)), r, use_norm=1.0)

    with pytest.raises(BAD_INPUT, match=r"grads\[69\]"):
        given(tf.constant([-1], tf.int32))
    for v, b in zip(variables, before):
        assert_same_bits(v.numpy(), b, "a bad index wrote a variable (use_norm given)")


# ---------------------------------------------------------------- norm and clip ops
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_global_norm_same_bits(rng, dtype):
    ts = [tf.constant(rng.normal(size=s) * 3, getattr(tf, dtype)) for s in SHAPES]
    x = tf.function(tfclip.global_norm, jit_compile=True)(ts)
    assert_same_bits(x.numpy(), tfclip.global_norm(ts).numpy(), "global_norm")
    np.testing.assert_allclose(float(x), float(tf.linalg.global_norm([tf.cast(t, tf.float64) for t in ts])),
                               rtol={"float64": 1e-12, "float32": 1e-6}.get(dtype, 1e-2))
    hlo = tf.function(lambda ts: tfclip.global_norm(ts), jit_compile=True).experimental_get_compiler_ir(ts)(stage="hlo")
    assert 'custom_call_target="tfclip_norm"' in hlo


@pytest.mark.parametrize("use_norm", [None, 3.0])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_clip_by_global_norm_same_bits(rng, dtype, use_norm):
    ts = [tf.constant(rng.normal(size=s), getattr(tf, dtype)) for s in SHAPES]

    def f(ts):
        return tfclip.fused_clip_by_global_norm(ts, 1.5, use_norm=use_norm)

    xc, xn = tf.function(f, jit_compile=True)(ts)
    ec, en = f(ts)
    for a, b in zip(xc, ec):
        assert_same_bits(a.numpy(), b.numpy(), "clipped")
    if use_norm is None:
        assert_same_bits(xn.numpy(), en.numpy(), "norm")
    else:
        assert xn == en == use_norm  # given back as given
    tc, tn = tf.clip_by_global_norm(ts if dtype != "bfloat16" else [tf.cast(t, tf.float32) for t in ts], 1.5,
                                    use_norm=None if use_norm is None else tf.constant(
                                        use_norm, tf.float64 if dtype == "float64" else tf.float32))
    for a, b in zip(xc, tc):
        np.testing.assert_allclose(a.numpy().astype(np.float64), b.numpy().astype(np.float64),
                                   rtol={"bfloat16": 1e-2}.get(dtype, 1e-6), atol=1e-6)


def test_clip_by_global_norm_tensor_norms_and_nan(rng):
    ts = [tf.constant(rng.normal(size=s), tf.float32) for s in SHAPES]
    f = lambda ts: tfclip.fused_clip_by_global_norm(ts, 1.0, return_tensor_norms=True)
    x = tf.function(f, jit_compile=True)(ts)
    e = f(ts)
    assert_same_bits(x[2].numpy(), e[2].numpy(), "tensor_norms")
    bad = list(ts)
    bad[0] = tf.constant([np.inf, 1, 2, 3, 4], tf.float32)
    xc, xn = tf.function(lambda ts: tfclip.fused_clip_by_global_norm(ts, 1.0), jit_compile=True)(bad)
    assert np.isinf(xn) and all(np.isnan(c.numpy()).all() for c in xc)  # TF's semantics


def test_clip_by_global_norm_bad_clip_norm_is_an_error(rng):
    ts = [tf.constant(rng.normal(size=s), tf.float32) for s in SHAPES]
    fn = tf.function(lambda ts, c: tfclip.fused_clip_by_global_norm(ts, c), jit_compile=True)
    with pytest.raises(BAD_INPUT, match="clip_norm"):
        fn(ts, tf.constant(-1.0))


# ---------------------------------------------------------------- the compiled module
def _step_fn(n=3):
    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(np.ones((4, 5)) * k, dtype=tf.float32) for k in range(n)]
    fn = tf.function(lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), r,
                                                        global_clipnorm=1.0), jit_compile=True)
    return fn, variables, r


def test_compiled_module_holds_the_custom_calls_and_aliases_the_variables():
    fn, variables, r = _step_fn()
    gs = [tf.ones((4, 5))] * len(variables)
    hlo = fn.experimental_get_compiler_ir(gs)(stage="hlo")
    assert hlo.count('custom_call_target="tfclip_norm"') == 1
    assert hlo.count('custom_call_target="tfclip_apply"') == 1
    assert "output_to_operand_aliasing" in hlo
    opt = fn.experimental_get_compiler_ir(gs)(stage="optimized_hlo")
    assert "input_output_alias" in opt
    # Every variable and slot (3 x (var, m, v)) and the step counter are aliased parameters.
    alias = opt[opt.index("input_output_alias"):].split("\n")[0]
    assert alias.count("may-alias") + alias.count("must-alias") >= 3 * 3 + 1, alias
    # No copy of a variable: the custom call's operands are the parameters themselves.
    assert " copy(" not in opt, [l for l in opt.splitlines() if " copy(" in l]


def test_variables_keep_their_buffers(rng):
    """In place: the variable's buffer keeps its address across jit-compiled steps."""
    fn, variables, r = _step_fn()
    gs = [tf.ones((4, 5))] * len(variables)
    fn(gs)

    # TF gives no public address of a resource's buffer: compare through a DLPack capsule.
    def dl_addr(v):
        cap = tf.experimental.dlpack.to_dlpack(v.read_value())
        return np.from_dlpack(_Capsule(cap)).__array_interface__["data"][0]

    a0 = [dl_addr(v) for v in variables]
    fn(gs)
    fn(gs)
    assert [dl_addr(v) for v in variables] == a0


class _Capsule:
    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, stream=None):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def test_compile_time_with_many_variables_stays_small():
    """Groups of 64: 1,000 variables compile in seconds (one call of thousands of aliased results
    took minutes in XLA:CPU's fusion pass)."""
    import time

    r = tfclip.rules.Adam(0.01)
    variables = [tf.Variable(tf.zeros([8]), dtype=tf.float32) for _ in range(1000)]
    fn = tf.function(lambda gs: tfclip.fused_clip_apply(list(zip(gs, variables)), r,
                                                        global_clipnorm=1.0), jit_compile=True)
    gs = [tf.ones([8])] * len(variables)
    t0 = time.perf_counter()
    fn(gs)
    took = time.perf_counter() - t0
    assert took < 60, f"first call (trace + compile) took {took:.1f} s"
    assert float(variables[0][0]) != 0.0


def test_import_after_first_xla_compilation_gets_the_kernels(tmp_path):
    """The library loaded after XLA compiled something: its kernels are still found."""
    code = textwrap.dedent("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import tensorflow as tf
        tf.function(lambda x: x * 2.0, jit_compile=True)(tf.ones([3]))  # XLA's registry is read
        import tfclip
        v = tf.Variable([1.0, 2.0])
        r = tfclip.rules.SGD(0.5)
        f = tf.function(lambda g: tfclip.fused_clip_apply([(g, v)], r), jit_compile=True)
        g = tf.constant([1.0, 1.0])
        f(g)
        hlo = f.experimental_get_compiler_ir(g)(stage="hlo")
        assert 'custom_call_target="tfclip_apply"' in hlo, hlo
        print("OK", v.numpy().tolist())
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # cwd away from the checkout: `python -c` puts cwd first on sys.path, and the checkout's
    # unbuilt tfclip/ would shadow the installed one.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK [0.5, 1.5]" in out.stdout


def test_the_handlers_joined_tfs_xla_registry():
    """The op library registered its custom-call handlers with TF's typed FFI when it loaded
    (csrc/xla/tf/registration.cc, through XLA_FFI_GetApi or, on TF 2.17-2.19,
    xla::ffi::GetXlaFfiApi; on TF 2.16, legacy entries in XLA's custom-call target registry)."""
    from tfclip import _loader

    assert _loader._xla_handlers_registered()


def test_handlers_not_registered_means_no_xla_kernels(monkeypatch):
    """Kernels whose handlers could not join XLA's registry would compile calls nothing can run:
    such a build counts as having no XLA kernels, so the Keras drop-ins take the warned stock
    step instead of failing at run time."""
    from tfclip import _loader

    monkeypatch.setattr(_loader, "_XLA", None)
    monkeypatch.setattr(_loader, "_xla_handlers_registered", lambda: False)
    assert not _loader.xla_kernels()
    monkeypatch.setattr(_loader, "_XLA", None)
    monkeypatch.undo()
    assert _loader.xla_kernels()


# ---------------------------------------------------------------- the Keras drop-ins
# tfclip.keras runs the stock Keras ops in an XLA context only in a build without these kernels
# (tests/test_xla_keras.py tests the drop-ins as users run them). With the detection off, its own
# fused step compiles to the custom calls and gives the non-XLA step's bits.
KERAS_OPTS = {
    "adam": lambda: tfclip.keras.Adam(0.01, global_clipnorm=0.5),
    "adamw_excluded": lambda: _adamw_excluding_bias(),
    "sgd_momentum": lambda: tfclip.keras.SGD(0.1, momentum=0.9, clipvalue=0.2),
    "lamb": lambda: tfclip.keras.Lamb(0.01, clipnorm=0.3),
}


def _adamw_excluding_bias():
    opt = tfclip.keras.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])  # two groups: one norm op, use_norm in both
    return opt


def _keras_step(vs, opt, jit):
    return tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)), jit_compile=jit)


@pytest.mark.parametrize("name", KERAS_OPTS, ids=KERAS_OPTS.keys())
def test_keras_fused_step_compiles_to_the_kernels(rng, monkeypatch, name):
    import keras
    from tfclip._engine import xla as _xla

    monkeypatch.setattr(_xla, "in_context", lambda: False)
    shapes = {"kernel": (4, 3), "bias": (3,), "emb": (6, 2)}
    init = {k: rng.normal(size=s) for k, s in shapes.items()}
    steps = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(3)]
    states = []
    for jit in (True, False):
        vs = [keras.Variable(init[k].astype(np.float32), name=k) for k in shapes]
        opt = KERAS_OPTS[name]()
        opt.build(vs)
        fn = _keras_step(vs, opt, jit)
        for st in steps:
            fn([tf.constant(st[k], tf.float32) for k in shapes])
        states.append((vs, opt, fn))
    (xv, xo, xf), (ev, eo, _) = states
    for a, b in zip(xv, ev):
        assert_same_bits(a.numpy(), b.numpy(), f"{name} {a.name}")
    for a, b in zip(xo.variables, eo.variables):
        assert_same_bits(np.asarray(a.numpy()), np.asarray(b.numpy()), f"{name} {a.name}")
    gs = [tf.constant(steps[0][k], tf.float32) for k in shapes]
    assert 'custom_call_target="tfclip_apply"' in xf.experimental_get_compiler_ir(gs)(stage="hlo")


# ---------------------------------------------------------------- IndexedSlices, densified (GPU)
# On the GPU JIT device the XLA kernel densifies IndexedSlices (the core plans rows from host
# indices, and XLA keeps them on the device). TFCLIP_XLA_DENSIFY_SPARSE=1 takes that path on CPU.
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_indexed_slices_densified_path(rng, monkeypatch, rule):
    monkeypatch.setenv("TFCLIP_XLA_DENSIFY_SPARSE", "1")
    var0 = [rng.normal(size=(10, 3)), rng.normal(size=(4,))]
    t = Twin(PY_RULES[rule], var0, [tf.float32, tf.float32])
    for _ in range(2):
        idx = tf.constant([7, 1, 7, 0], tf.int32)
        vals = tf.constant(rng.normal(size=(4, 3)), tf.float32)
        dense = tf.constant(rng.normal(size=(4,)), tf.float32)
        xr, er = t.step([tf.IndexedSlices(vals, idx, tf.constant([10, 3])), dense], global_clipnorm=1.0)
        assert_results_equal(xr, er)  # the norm of .values, as TF's; the same decision
    hlo = t.fns[(("global_clipnorm", 1.0),)].experimental_get_compiler_ir(
        [tf.IndexedSlices(vals, idx, tf.constant([10, 3])), dense])(stage="hlo")
    assert "scatter(" in hlo and "tfclip_apply" in hlo
    # The densified update sums a duplicated row first (the op feeds its slices to SGD one after
    # another): the same values but for the last bit.
    for a, b in zip(*t.vars):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    ra, rb = t.rules
    for a, b in zip(*t.vars):
        for s in ra.slot_names:
            np.testing.assert_allclose(ra.slots(a)[s].numpy(), rb.slots(b)[s].numpy(), rtol=1e-6, atol=1e-7)


def test_indexed_slices_densified_path_refuses_lazy(rng, monkeypatch):
    monkeypatch.setenv("TFCLIP_XLA_DENSIFY_SPARSE", "1")
    v = tf.Variable(rng.normal(size=(5, 2)), dtype=tf.float32)
    r = tfclip.rules.Adam(0.01)
    fn = tf.function(lambda g: tfclip.fused_clip_apply([(g, v)], r, lazy_sparse=True), jit_compile=True)
    with pytest.raises((tf.errors.UnimplementedError, tf.errors.InvalidArgumentError),
                       match="lazy_sparse"):
        fn(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3]), tf.constant([5, 2])))
