"""What the drop-ins accept is what their stock classes accept, found by asking both.

For every drop-in (Keras 3, tf.compat.v1) and every rule, each float hyper-parameter of its stock
class's constructor is probed with a spread of values: both constructors are called, and where
both accept the value two steps are taken with each and compared. tfclip's one deliberate
refusal, a non-finite value (stock would write NaN or inf into every variable), must come at
construction with an error naming the argument; so may a value stock refuses only when its step
runs (a kernel's check, as ProximalAdagrad's lr > 0); any other disagreement is a failure. (The
docs' "Deliberate differences from stock", docs/differences.md, lists the same.)

Also: every mismatch between the lengths of the gradient and variable lists either matches stock
or names both lengths."""
import inspect
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfclip

PROBES = [-1.5, -0.1, 0.0, 0.5, 1.0, 1.5, float("nan"), float("inf"), float("-inf")]
KERAS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "Lamb",
         "ScheduleFreeAdamW"]
TF1 = ["GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer", "RMSPropOptimizer",
       "AdagradOptimizer", "AdadeltaOptimizer", "FtrlOptimizer", "ProximalGradientDescentOptimizer",
       "ProximalAdagradOptimizer", "AdagradDAOptimizer"]
# Constructor arguments of the base classes: not hyper-parameters of an update rule.
_BASE_ARGS = {"clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
              "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps", "name"}


def _float_args(cls, skip=()):
    """The constructor arguments of `cls` whose default is a float (plus learning_rate)."""
    out = []
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name in _BASE_ARGS or name in skip:
            continue
        if isinstance(p.default, float) and not isinstance(p.default, bool):
            out.append(name)
        elif name == "learning_rate":
            out.append(name)
    return out


def _outcome(make):
    try:
        return make(), None
    except (ValueError, TypeError) as e:
        return None, e


def _compare_steps(step_stock, step_tfclip, what, problems):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = step_stock()
        except Exception as e:  # noqa: BLE001 - a stock step that fails is itself a finding
            problems.append(f"{what}: the stock step failed ({type(e).__name__}: {e})")
            return
        try:
            got = step_tfclip()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{what}: stock steps, tfclip fails: {type(e).__name__}: {e}")
            return
    for g, w in zip(got, want):
        if not np.allclose(g, w, rtol=2e-5, atol=1e-7, equal_nan=True):
            problems.append(f"{what}: tfclip {g} vs stock {w}")


# Differences listed in docs/differences.md ("Deliberate differences from stock"), skipped by name here.
KNOWN = {
    # TF1 FtrlOptimizer at learning_rate 0: TF's kernel leaves the variables at 0, the core
    # computes Keras's Ftrl arithmetic (l2 + beta / (2 * lr)), which gives NaN there as Keras does.
    ("FtrlOptimizer", "learning_rate", 0.0),
    # TF1 ProximalGradientDescent and AdagradDA: a negative l1/l2 strength is refused (their
    # documentation requires >= 0, as TF's ProximalAdagrad kernel checks; their kernels do not).
    *((cls, arg, v) for cls in ("ProximalGradientDescentOptimizer", "AdagradDAOptimizer")
      for arg in ("l1_regularization_strength", "l2_regularization_strength") for v in (-1.5, -0.1)),
}


def _stock_step_refuses(step):
    """Whether the stock step fails on the value (a kernel's own check, when the step runs)."""
    try:
        step()
    except tf.errors.InvalidArgumentError:
        return True
    return False


def _probe(name, args, make_stock, make_tfclip, steps, problems, required=()):
    for arg in args:
        for value in PROBES:
            what = f"{name}({arg}={value})"
            if (name, arg, value) in KNOWN:
                continue
            kw = {a: 0.1 for a in required if a != arg}
            stock, stock_err = _outcome(lambda: make_stock(**kw, **{arg: value}))
            ours, our_err = _outcome(lambda: make_tfclip(**kw, **{arg: value}))
            if not math.isfinite(value):
                # tfclip's deliberate refusal, at construction, naming the argument.
                if our_err is None:
                    problems.append(f"{what}: tfclip accepted a non-finite value")
                elif arg not in str(our_err) and stock_err is None:
                    problems.append(f"{what}: tfclip's error does not name {arg}: {our_err}")
                continue
            if stock_err is None and our_err is not None and _stock_step_refuses(lambda: steps(stock)):
                # Stock refuses it when its step runs (TF's ProximalAdagrad kernel: lr > 0, l1,
                # l2 >= 0); tfclip at construction, naming the argument.
                if arg not in str(our_err):
                    problems.append(f"{what}: tfclip's error does not name {arg}: {our_err}")
                continue
            if (stock_err is None) != (our_err is None):
                problems.append(f"{what}: stock {'accepts' if stock_err is None else 'refuses'}, "
                                f"tfclip {'accepts' if our_err is None else 'refuses'} "
                                f"({stock_err or our_err})")
                continue
            if stock_err is None:
                _compare_steps(lambda: steps(stock), lambda: steps(ours), what, problems)


INIT = np.array([0.5, -1.0, 2.0], "float32")
# Compared: how far each step moved the variable (what the update rule decides; the final value
# near 0 would hide a relative error in a cancellation).


def _keras_steps(opt):
    v = keras.Variable(INIT)
    for g in ([0.1, -0.2, 0.3], [-0.3, 0.1, 0.2]):
        opt.apply_gradients([(tf.constant(g, tf.float32), v)])
    return [v.numpy().astype("float64") - INIT]


@pytest.mark.parametrize("name", KERAS)
def test_keras_dropins_accept_what_stock_accepts(name):
    stock_cls, ours_cls = getattr(keras.optimizers, name), getattr(tfclip.keras, name)
    problems = []
    _probe(name, _float_args(stock_cls), stock_cls, ours_cls, _keras_steps, problems)
    assert not problems, "\n".join(problems)


def _tf1_steps(opt):
    v = tf.Variable(INIT)
    for g in ([0.1, -0.2, 0.3], [-0.3, 0.1, 0.2]):
        opt.apply_gradients([(tf.constant(g, tf.float32), v)])
    return [v.numpy().astype("float64") - INIT]


@pytest.mark.parametrize("name", TF1)
def test_tf1_dropins_accept_what_stock_accepts(name):
    stock_cls, ours_cls = getattr(tf.compat.v1.train, name), getattr(tfclip.compat.v1, name)
    # Required arguments that are no hyper-parameter: AdagradDA's step counter (a variable).
    fixed = {"global_step": lambda: tf.Variable(2, dtype=tf.int64)} if name == "AdagradDAOptimizer" else {}
    required = [n for n, p in inspect.signature(stock_cls.__init__).parameters.items()
                if p.default is inspect.Parameter.empty and n != "self" and n not in fixed]
    args = sorted(set(_float_args(stock_cls)) | set(required))
    problems = []
    _probe(name, args, lambda **kw: stock_cls(**{k: f() for k, f in fixed.items()}, **kw),
           lambda **kw: ours_cls(**{k: f() for k, f in fixed.items()}, **kw), _tf1_steps, problems,
           required=required)
    assert not problems, "\n".join(problems)


# Each rule against the stock class it mirrors (the Keras class; Momentum: TF1's).
RULES = [(n, getattr(keras.optimizers, n)) for n in KERAS] + [("Momentum", tf.compat.v1.train.MomentumOptimizer)]


def _rule_steps(obj):
    if isinstance(obj, keras.optimizers.Optimizer):
        return _keras_steps(obj)
    if not isinstance(obj, tfclip.rules.Rule):
        return _tf1_steps(obj)
    v = tf.Variable(INIT)
    for g in ([0.1, -0.2, 0.3], [-0.3, 0.1, 0.2]):
        tfclip.fused_clip_apply([(tf.constant(g, tf.float32), v)], obj)
    return [v.numpy().astype("float64") - INIT]


@pytest.mark.parametrize("name,stock_cls", RULES, ids=[n for n, _ in RULES])
def test_rules_accept_what_their_stock_class_accepts(name, stock_cls):
    rule_cls = getattr(tfclip.rules, name)
    shared = set(inspect.signature(rule_cls.__init__).parameters)
    args = [a for a in _float_args(stock_cls) if a in shared]
    required = ["learning_rate", "momentum"] if name == "Momentum" else []
    assert args, "no shared hyper-parameter found to probe"
    problems = []
    _probe(name, sorted(set(args) | set(required)), stock_cls, rule_cls, _rule_steps, problems,
           required=required)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("rule", [tfclip.rules.SGD, tfclip.rules.Adam, tfclip.rules.Lion, tfclip.rules.Ftrl])
def test_negative_learning_rate_ascends_as_stock(rule):
    """Gradient ascent, the use of a negative learning rate: the variable moves along the
    gradient, by what the stock Keras class gives."""
    stock = getattr(keras.optimizers, rule.__name__)(learning_rate=-0.1)
    want = _keras_steps(stock)[0]
    got = _rule_steps(rule(learning_rate=-0.1))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.any(np.abs(got) > 1e-3)  # it moved
    if rule is tfclip.rules.SGD:  # uphill: along the gradients' sum
        np.testing.assert_allclose(got, 0.1 * np.array([-0.2, -0.1, 0.5]), rtol=1e-6)


def test_non_finite_learning_rate_tensor_at_run_time_writes_nothing():
    """A schedule or tensor known only at run time: refused by the op, nothing written."""
    v = tf.Variable([1.0, 2.0])
    lr = tf.Variable(float("nan"))
    rule = tfclip.rules.Adam(lambda: lr)
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be finite"):
        tfclip.fused_clip_apply([(tf.constant([1.0, 1.0]), v)], rule)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    for s in rule.variables:
        assert not np.any(s.numpy())


# ---------------------------------------------------------------- list lengths
@pytest.mark.parametrize("name", ["SGD", "Adam", "Lamb"])
@pytest.mark.parametrize("n_grads", [2, 4])
def test_keras_apply_with_unequal_lists_matches_stock(name, n_grads):
    """optimizer.apply(grads, variables) with 2 or 4 gradients for 3 variables: stock Keras zips
    the lists and applies the pairs it has; tfclip does the same, with a warning naming both
    lengths (it raised IndexError from inside tfclip/keras/__init__.py)."""
    init = [np.array([1.0, 2.0], "float32"), np.array([3.0], "float32"), np.array([-1.0], "float32")]
    grads = [tf.constant([0.5, 0.5]), tf.constant([1.0]), tf.constant([2.0]), tf.constant([3.0])][:n_grads]

    def run(cls, **kw):
        vs = [keras.Variable(x) for x in init]
        opt = cls(0.1)
        opt.apply(grads, vs, **kw)
        return [v.numpy() for v in vs], opt

    want, stock = run(getattr(keras.optimizers, name))
    with pytest.warns(UserWarning, match=f"{n_grads} gradients for 3 variables"):
        got, ours = run(getattr(tfclip.keras, name))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()) == 1


def test_keras_apply_without_variables_names_both_lengths():
    """grads without variables on a built optimizer: stock's own error, which names both."""
    vs = [keras.Variable([1.0]), keras.Variable([2.0])]
    opt = tfclip.keras.Adam(0.1)
    opt.build(vs)
    with pytest.raises(ValueError, match="1 gradients.*2 trainable variables"):
        opt.apply([tf.constant([1.0])])


# The TF1 proximal rules against the stock TF1 classes they mirror (AdagradDA's global step: a
# variable the stock side advances with each step, as the rule's own count advances).
TF1_RULES = [("ProximalGradientDescent", "ProximalGradientDescentOptimizer"),
             ("ProximalAdagrad", "ProximalAdagradOptimizer"), ("AdagradDA", "AdagradDAOptimizer")]


def _tf1_rule_steps(obj):
    if isinstance(obj, tfclip.rules.Rule):
        return _rule_steps(obj)
    v = tf.Variable(INIT)
    gs = getattr(obj, "_global_step", None)
    for g in ([0.1, -0.2, 0.3], [-0.3, 0.1, 0.2]):
        obj.apply_gradients([(tf.constant(g, tf.float32), v)], global_step=gs)
    return [v.numpy().astype("float64") - INIT]


@pytest.mark.parametrize("name,stock_name", TF1_RULES, ids=[n for n, _ in TF1_RULES])
def test_tf1_rules_accept_what_their_stock_class_accepts(name, stock_name):
    stock_cls, rule_cls = getattr(tf.compat.v1.train, stock_name), getattr(tfclip.rules, name)
    fixed = {"global_step": lambda: tf.Variable(0, dtype=tf.int64)} if name == "AdagradDA" else {}
    shared = set(inspect.signature(rule_cls.__init__).parameters)
    args = sorted({a for a in _float_args(stock_cls) if a in shared} | {"learning_rate"})
    assert len(args) >= 3
    problems = []
    # (named as the stock class, so KNOWN's entries for it apply)
    _probe(stock_name, args, lambda **kw: stock_cls(**{k: f() for k, f in fixed.items()}, **kw), rule_cls,
           _tf1_rule_steps, problems, required=["learning_rate"])
    assert not problems, "\n".join(problems)
