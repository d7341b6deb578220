"""Reliability: a matrix of bad calls (each a named error, nothing written), non-finite gradients
under each policy, concurrent steps on shared variables, and memory over 10,000 steps."""
import os
import threading

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfclip
from tfclip import _core, _loader

OPS = _loader.ops()
F64 = tf.float64


class Env:
    """Three variables with live Adam slots (tfclip.rules and tfclip.keras), after one real step."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.shapes = [(3,), (4,), (2, 2)]
        self.vars = [tf.Variable(rng.normal(size=s).astype("float32"), name=f"v{i}") for i, s in enumerate(self.shapes)]
        self.table = tf.Variable(rng.normal(size=(6, 2)).astype("float32"), name="table")
        self.rule = tfclip.rules.Adam(0.1)
        self.pairs = list(zip(self.grads(), self.vars))
        tfclip.fused_clip_apply(self.pairs + [(self.sparse([1, 4]), self.table)], self.rule, global_clipnorm=1.0)
        self.kvars = [keras.Variable(rng.normal(size=s).astype("float32")) for s in self.shapes]
        self.kopt = tfclip.keras.Adam(0.1, global_clipnorm=1.0)
        self.kopt.apply_gradients(zip(self.grads(), self.kvars))
        self.momentum = [tf.Variable(tf.zeros(s)) for s in self.shapes]

    def grads(self):
        return [tf.ones(s) * 0.5 for s in self.shapes]

    def sparse(self, idx, width=2, dtype=tf.int32):
        return tf.IndexedSlices(tf.ones([len(idx), width]), tf.constant(idx, dtype))

    def state(self):
        every = (self.vars + [self.table] + self.rule.variables + self.kvars + list(self.kopt.variables)
                 + self.momentum)
        return [np.array(v.numpy()) for v in every]

    def raw_sgd(self, grads, var=None, **kw):
        kw.setdefault("indices", [])
        kw.setdefault("iterations", [])
        return OPS.tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], 
            var=[v.handle for v in (var or self.vars)], grad=grads, lr=tf.constant(0.1, F64),
            weight_decay=tf.constant(0.0, F64), clip=tf.constant(0.0, F64), use_norm=tf.constant(0.0, F64), **kw)

    def raw_momentum(self, accum, grads=None):
        return OPS.tfclip_clip_apply_momentum(absmax=[], grad_scale=[], rounding=[], 
            var=[v.handle for v in self.vars], accum=[a.handle for a in accum], grad=grads or self.grads(),
            indices=[], iterations=[], lr=tf.constant(0.1, F64), momentum=tf.constant(0.9, F64),
            weight_decay=tf.constant(0.0, F64), clip=tf.constant(0.0, F64), use_norm=tf.constant(0.0, F64))


IAE = tf.errors.InvalidArgumentError
# (case id, call, exception, message pattern). Each call is bad in one way; most are bad only at
# the last list entry, where stock Keras would already have updated the first variables.
CASES = [
    # -- fused_clip_apply: lists, pairs, shapes, dtypes, variables
    ("not_a_pair", lambda e: tfclip.fused_clip_apply([e.pairs[0], (tf.ones(3),)], e.rule),
     TypeError, r"grads_and_vars\[1\] is not a \(gradient, variable\) pair"),
    ("empty_list", lambda e: tfclip.fused_clip_apply([], e.rule), ValueError, "grads_and_vars is empty"),
    ("all_none", lambda e: tfclip.fused_clip_apply([(None, v) for v in e.vars], e.rule),
     ValueError, "No gradients provided for any variable"),
    ("shape_last", lambda e: tfclip.fused_clip_apply(e.pairs[:2] + [(tf.ones([4]), e.vars[2])], e.rule),
     ValueError, r"grads_and_vars\[2\]: gradient shape differs"),
    ("count_last", lambda e: tfclip.fused_clip_apply(e.pairs[:2] + [(tf.ones([5]), e.vars[2])], e.rule),
     ValueError, r"grads_and_vars\[2\]: gradient element count differs"),
    ("grad_int", lambda e: tfclip.fused_clip_apply(e.pairs[:2] + [(tf.ones([2, 2], tf.int32), e.vars[2])], e.rule),
     TypeError, r"gradient dtype int32 for variable .*gradients must be float16"),
    ("var_int", lambda e: tfclip.fused_clip_apply(e.pairs + [(tf.ones([2]), tf.Variable([1, 2]))], e.rule),
     TypeError, r"grads_and_vars\[3\]: variable .* has dtype int32"),
    ("var_twice", lambda e: tfclip.fused_clip_apply(e.pairs + [(tf.ones([3]), e.vars[0])], e.rule),
     ValueError, r"grads_and_vars\[3\] and grads_and_vars\[0\] hold the same variable"),
    ("not_a_variable", lambda e: tfclip.fused_clip_apply(e.pairs + [(tf.ones([3]), tf.ones([3]))], e.rule),
     TypeError, r"grads_and_vars\[3\] holds a .*not a resource tf.Variable"),
    ("not_a_rule", lambda e: tfclip.fused_clip_apply(e.pairs, keras.optimizers.Adam()), TypeError, "rule must be a tfclip.rules"),
    # -- clip arguments and policies
    ("two_clips", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, clipnorm=1.0, clipvalue=1.0),
     ValueError, "set at most one of"),
    ("clip_nan", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, global_clipnorm=float("nan")),
     ValueError, "global_clipnorm must be a finite number >= 0"),
    ("clip_negative", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, clipnorm=-1.0), ValueError, "clipnorm must be a finite number >= 0"),
    ("clip_string", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, clipvalue="0.5"), ValueError, "clipvalue must be a finite number >= 0"),
    ("clip_tensor_nan", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, global_clipnorm=tf.constant(np.nan)),
     IAE, "clip"),
    ("clip_not_scalar", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, global_clipnorm=tf.constant([1.0, 2.0])),
     ValueError, "must be a scalar"),
    ("bad_policy", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, nonfinite="ignore"), ValueError, "nonfinite must be one of"),
    ("use_norm_negative", lambda e: tfclip.fused_clip_apply(e.pairs, e.rule, use_norm=-1.0), ValueError, "use_norm must be >= 0"),
    # -- hyper-parameters
    ("lr_nan", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.SGD(float("nan"))), ValueError, "learning_rate must be finite"),
    ("lr_inf_tensor", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.SGD(tf.constant(-np.inf))), IAE,
     r"learning_rate must be finite, got -inf"),
    ("lr_not_scalar", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.SGD(tf.constant([0.1, 0.2]))),
     ValueError, "learning_rate must be a scalar"),
    ("sgd_momentum_above_1", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.SGD(0.1, momentum=1.5)), ValueError,
     r"momentum must be in \[0, 1\] \(as the stock class checks it\)"),
    ("beta_1_nan", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.Adam(beta_1=float("nan"))), ValueError, "beta_1 must be finite"),
    ("epsilon_inf", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.Adam(epsilon=float("inf"))), ValueError, "epsilon must be finite"),
    ("weight_decay_inf", lambda e: tfclip.fused_clip_apply(e.pairs, tfclip.rules.AdamW(weight_decay=float("inf"))),
     ValueError, "weight_decay must be finite"),
    # -- IndexedSlices
    ("slices_out_of_range", lambda e: tfclip.fused_clip_apply(e.pairs + [(e.sparse([0, 6]), e.table)], e.rule),
     IAE, r"grads\[3\] \(IndexedSlices\): indices\[1\] = 6 is out of range for vars\[3\], which has 6 rows"),
    ("slices_negative", lambda e: tfclip.fused_clip_apply(e.pairs + [(e.sparse([-1], dtype=tf.int64), e.table)], e.rule),
     IAE, r"indices\[0\] = -1 is out of range"),
    ("slices_row_shape", lambda e: tfclip.fused_clip_apply(e.pairs + [(e.sparse([0], width=3), e.table)], e.rule),
     ValueError, r"values of shape \(1, 3\) do not fit"),
    ("slices_float_indices", lambda e: tfclip.fused_clip_apply(
        e.pairs + [(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0.0])), e.table)], e.rule), TypeError, "int32 or int64"),
    # -- the raw op: what the Python layer cannot see
    ("op_count", lambda e: e.raw_sgd(e.grads()[:2]), IAE, "got 2 gradients for 3 variables"),
    ("op_shape_last", lambda e: e.raw_sgd(e.grads()[:2] + [tf.ones([4])]), IAE, r"grads\[2\] has shape \[4\] but vars\[2\]"),
    ("op_same_var", lambda e: e.raw_sgd(e.grads()[:2] + [tf.ones([3])], var=e.vars[:2] + e.vars[:1]),
     IAE, r"vars\[2\] and vars\[0\] are the same variable"),
    ("op_slot_shape", lambda e: e.raw_momentum(e.momentum[:2] + [tf.Variable(tf.zeros([4]))]),
     IAE, r"accum\[2\] is float\[4\] but vars\[2\] is float\[2,2\]; a slot must match"),
    ("op_slot_dtype", lambda e: e.raw_momentum(e.momentum[:2] + [tf.Variable(tf.zeros([2, 2], F64))]),
     IAE, r"accum\[2\] is double"),
    ("op_var_as_own_slot", lambda e: e.raw_momentum(e.momentum[:2] + [e.vars[2]]), IAE, r"accum\[2\] and vars\[2\]"),
    ("op_uninitialized", lambda e: OPS.tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[],   # a handle never assigned
        var=[v.handle for v in e.vars[:2]] + [tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2, 2], shared_name="tfclip_uninit")],
        grad=e.grads(), indices=[], iterations=[], lr=tf.constant(0.1, F64), weight_decay=tf.constant(0.0, F64),
        clip=tf.constant(0.0, F64), use_norm=tf.constant(0.0, F64)),
     tf.errors.FailedPreconditionError, r"vars\[2\] is not initialized"),
    ("op_lr_vector", lambda e: OPS.tfclip_clip_apply_sgd(absmax=[], grad_scale=[], rounding=[], 
        var=[v.handle for v in e.vars], grad=e.grads(), indices=[], iterations=[], lr=tf.constant([0.1, 0.1], F64),
        weight_decay=tf.constant(0.0, F64), clip=tf.constant(0.0, F64), use_norm=tf.constant(0.0, F64)),
     IAE, r"lr must be a scalar, got shape \[2\]"),
    ("op_sparse_position", lambda e: e.raw_sgd(e.grads(), indices=[tf.constant([0])], sparse=[5]),
     IAE, r"sparse must list gradient positions in \[0, 3\)"),
    ("op_indices_count", lambda e: e.raw_sgd(e.grads(), indices=[tf.constant([0]), tf.constant([1])], sparse=[0]),
     IAE, "got 2 index vectors for 1 sparse gradients"),
    # -- the clip function and the norm
    ("clip_fn_empty", lambda e: tfclip.fused_clip_by_global_norm([], 1.0), ValueError, "holds no tensor"),
    ("clip_fn_int", lambda e: tfclip.fused_clip_by_global_norm([tf.constant([1, 2])], 1.0), ValueError, r"t_list\[0\] has dtype int32"),
    ("clip_fn_zero", lambda e: tfclip.fused_clip_by_global_norm(e.grads(), 0.0), ValueError, "clip_norm must be finite and > 0"),
    ("norm_all_none", lambda e: tfclip.global_norm([None, None]), ValueError, "holds no tensor"),
    # -- optimizers
    ("keras_shape_last", lambda e: e.kopt.apply_gradients(zip(e.grads()[:2] + [tf.ones([4])], e.kvars)),
     IAE, r"grads\[2\] has shape \[4\] but vars\[2\]"),
    ("keras_slices_out_of_range", lambda e: e.kopt.apply_gradients(
        [(g, v) for g, v in zip(e.grads()[:2], e.kvars[:2])] + [(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2])), e.kvars[2])]),
     IAE, "out of range"),
    ("keras_bad_policy", lambda e: tfclip.keras.Adam(nonfinite="maybe"), ValueError, "nonfinite must be one of"),
    ("keras_clip_negative", lambda e: tfclip.keras.SGD(global_clipnorm=-1.0), ValueError, "global_clipnorm must be"),
    ("keras_beta_nan", lambda e: tfclip.keras.Adam(beta_1=float("nan")), ValueError, "beta_1 must be finite"),
    ("v1_clip_negative", lambda e: tfclip.compat.v1.AdamOptimizer(global_clipnorm=-1.0), ValueError, "global_clipnorm must be a finite number >= 0"),
    ("v1_no_gradients", lambda e: tfclip.compat.v1.GradientDescentOptimizer(0.1).apply_gradients([(None, v) for v in e.vars]),
     ValueError, "No gradients provided for any variable"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_call_is_named_and_writes_nothing(call, exc, pattern):
    env = Env()
    before = env.state()
    with pytest.raises(exc, match=pattern):
        call(env)
    after = env.state()
    assert len(after) == len(before)
    for b, a in zip(before, after):
        assert a.tobytes() == b.tobytes()  # bitwise: nothing written, no slot, no step counter


def test_the_matrix_is_large_and_distinct():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


def test_stock_keras_writes_the_first_variables_before_failing():
    """Why the matrix puts the bad entry last: stock Keras has already updated the others."""
    a, b = keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(4, "float32"))
    with pytest.raises(Exception):
        keras.optimizers.SGD(0.1).apply_gradients([(tf.ones(3), a), (tf.ones(5), b)])
    assert not np.array_equal(a.numpy(), np.ones(3))
    a2, b2 = keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(4, "float32"))
    with pytest.raises(IAE):
        tfclip.keras.SGD(0.1).apply_gradients([(tf.ones(3), a2), (tf.ones(5), b2)])
    np.testing.assert_array_equal(a2.numpy(), np.ones(3))


# ---------------------------------------------------------------- non-finite: 1 element of 500
def _five_hundred(bad):
    rng = np.random.default_rng(1)
    shapes = [(int(rng.integers(1, 9)),) for _ in range(500)]
    vals = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [rng.normal(size=s).astype("float32") for s in shapes]
    grads[317][0] = bad
    return vals, grads


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_skip_and_raise_write_nothing(bad, policy):
    vals, grads = _five_hundred(bad)
    variables = [tf.Variable(v) for v in vals]
    rule = tfclip.rules.Adam(0.01)
    tfclip.fused_clip_apply(zip([tf.ones_like(v) for v in vals], variables), rule, global_clipnorm=1.0)
    before = [v.numpy().copy() for v in variables + rule.variables]
    if policy == "skip":
        res = tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0, nonfinite="skip")
        assert not bool(res.applied)
        assert not np.isfinite(float(res.global_norm))  # reported
    else:
        with pytest.raises(IAE, match="non-finite.*nonfinite='raise'; no variable was updated"):
            tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=1.0, nonfinite="raise")
    for b, v in zip(before, variables + rule.variables):
        assert v.numpy().tobytes() == b.tobytes()
    assert int(rule.iterations.numpy()) == 1


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_nonfinite_propagate_matches_tf(bad):
    """'propagate' does what tf.clip_by_global_norm + Keras Adam does: NaN everywhere, bit for bit."""
    vals, grads = _five_hundred(bad)
    ours = [keras.Variable(v) for v in vals]
    stock = [keras.Variable(v) for v in vals]
    tfclip.keras.Adam(0.01, global_clipnorm=1.0, nonfinite="propagate").apply_gradients(zip(grads, ours))
    keras.optimizers.Adam(0.01, global_clipnorm=1.0).apply_gradients(zip(grads, stock))
    for a, b in zip(ours, stock):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # NaN == NaN here
    assert all(np.isnan(v.numpy()).all() for v in ours)


def test_keras_skips_by_default_and_counts():
    vals, grads = _five_hundred(np.inf)
    kv = [keras.Variable(v) for v in vals]
    opt = tfclip.keras.Adam(0.01, global_clipnorm=1.0)
    opt.apply_gradients(zip(grads, kv))
    assert int(opt.skipped_steps.numpy()) == 1
    for a, b in zip(kv, vals):
        assert a.numpy().tobytes() == b.tobytes()
    assert all(not np.any(s.numpy()) for s in opt._momentums + opt._velocities)


def test_overflow_and_subnormal_norm_through_the_op():
    big = tf.Variable(np.zeros(1000, "float32"))
    rule = tfclip.rules.SGD(1.0)
    res = tfclip.fused_clip_apply([(tf.fill([1000], 3e20), big)], rule, global_clipnorm=1.0)
    assert float(res.global_norm) == pytest.approx(3e20 * np.sqrt(1000), rel=1e-6)
    np.testing.assert_allclose(big.numpy(), -1.0 / np.sqrt(1000), rtol=1e-5)  # finite, clipped
    tiny = tf.Variable(np.zeros(64, "float32"))
    res = tfclip.fused_clip_apply([(tf.constant(np.full(64, 1e-40, np.float32)), tiny)], rule)
    assert float(res.global_norm) == pytest.approx(float(np.float32(1e-40)) * 8, rel=1e-5)
    assert float(res.global_norm) > 0


# ---------------------------------------------------------------- concurrency
def _run_at_once(work, args):
    """Runs work(a) for each a in its own thread, all released together by a barrier; fails on
    a thread still running after 120 s (a deadlock) or on any exception in a thread."""
    barrier = threading.Barrier(len(args))
    errors = []

    def run(a):
        try:
            barrier.wait()
            work(a)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors


def test_eight_threads_on_shared_variables_equal_a_serial_order():
    """8 threads each apply one TF1-Momentum step (lr 1, momentum 1) to lists sharing the same
    float64 variables in different orders. Gradient j is 16**j, so the final value encodes the
    order the steps ran in: var0 - var = sum_j (8 - pos_j) * 16**j. Every variable must show a
    permutation, the same one (each step held all its variables at once), and none may hang."""
    n = 8
    for _ in range(5):
        vs = [tf.Variable(np.zeros(4, np.float64)) for _ in range(3)]
        rule = tfclip.rules.Momentum(1.0, 1.0)
        for v in vs:
            rule.slots(v)  # created up front: slot creation is Python, not part of the op
        orders = [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1]]
        grads = [tf.constant(np.full(4, 16.0 ** j)) for j in range(n)]
        _run_at_once(lambda j: tfclip.fused_clip_apply([(grads[j], vs[k]) for k in orders[j % 4]], rule),
                     range(n))
        total = sum(16.0 ** j for j in range(n))
        decoded = []
        for v in vs:
            np.testing.assert_array_equal(rule.slots(v)["momentum"].numpy(), total)
            d = int(-v.numpy()[0])
            weights = [(d >> (4 * j)) & 0xF for j in range(n)]
            assert sorted(weights) == list(range(1, n + 1)), weights  # a serial order
            decoded.append(weights)
        assert decoded[0] == decoded[1] == decoded[2]


def test_threads_with_different_variable_orders_send_each_gradient_to_its_variable():
    """One rule, eager steps from 8 threads, each listing the same 4 variables in its own order
    (a rule keeps the handle lists of the last list it saw): variable k always gets gradient
    k + 1, so after every step has run, variable k is -(k + 1) * steps, whatever interleaving."""
    n_threads, steps = 8, 40
    vs = [tf.Variable(np.zeros(3, np.float64)) for _ in range(4)]
    rule = tfclip.rules.SGD(1.0)
    orders = [list(np.random.default_rng(t).permutation(4)) for t in range(n_threads)]
    pairs = [[(tf.constant(np.full(3, k + 1.0)), vs[k]) for k in order] for order in orders]

    def work(t):
        for _ in range(steps):
            tfclip.fused_clip_apply(pairs[t], rule)

    _run_at_once(work, range(n_threads))
    for k, v in enumerate(vs):
        np.testing.assert_array_equal(v.numpy(), -(k + 1.0) * steps * n_threads)


# ---------------------------------------------------------------- memory
def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from /proc (Linux)")
def test_ten_thousand_steps_do_not_grow_memory():
    rng = np.random.default_rng(2)
    variables = [tf.Variable(rng.normal(size=(64,)).astype("float32")) for _ in range(10)]
    table = tf.Variable(rng.normal(size=(100, 8)).astype("float32"))
    rule = tfclip.rules.Adam(1e-3)

    @tf.function
    def step(g, idx):
        pairs = [(g, v) for v in variables] + [(tf.IndexedSlices(tf.ones([4, 8]), idx), table)]
        return tfclip.fused_clip_apply(pairs, rule, global_clipnorm=1.0).global_norm

    g = tf.constant(rng.normal(size=(64,)).astype("float32"))
    idx = tf.constant([1, 5, 5, 99])
    arrays = [rng.normal(size=(64,)).astype("float32") for _ in range(10)]
    grads = [rng.normal(size=(64,)).astype("float32") for _ in range(10)]
    slots = [[np.zeros(64, np.float32) for _ in range(10)] for _ in range(2)]
    for _ in range(500):  # warm up: tracing, pools, allocator caches
        step(g, idx)
        _core.clip_apply("adam", arrays, grads, slots, {"lr": 1e-3}, "global_norm", 1.0)
    before = _rss_mib()
    for _ in range(10_000):
        step(g, idx)
        _core.clip_apply("adam", arrays, grads, slots, {"lr": 1e-3}, "global_norm", 1.0)
    grown = _rss_mib() - before
    assert grown < 4.0, f"RSS grew {grown:.1f} MiB over 10,000 steps"


def test_readme_promises_name_tests_that_exist():
    """Every test the "What tfclip promises" table (docs/guarantees.md) names is a test function here."""
    import re

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    readme = open(os.path.join(root, "docs", "guarantees.md"), encoding="utf-8").read()
    table = readme.split("## What tfclip promises", 1)[1].split("\n## ", 1)[0]
    named = 0
    for line in table.splitlines()[4:]:
        current = None
        for file_, name in re.findall(r"`((?:test_\w+\.py)?)::(test_\w+)`", line):  # `::name` reuses the file
            current = file_ or current
            assert current, line
            src = open(os.path.join(root, "tests", current), encoding="utf-8").read()
            assert f"def {name}(" in src, f"{current}::{name}"
            named += 1
    assert named >= 20
