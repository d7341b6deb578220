"""The Keras drop-ins of the other element-wise Keras 3 optimizers (issue 21): RMSprop, Adagrad,
Adadelta, Adamax, Nadam, Lion, Ftrl, Lamb, ScheduleFreeAdamW against the stock classes, step by step, on dense gradients
and on IndexedSlices with duplicate rows, each clip mode; fit with XLA / mixed precision / EMA /
accumulation; non-finite steps; bad arguments."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import tfclip
from test_dropin_keras import CLIPS, fit_both, lstm, mlp_frozen, trajectories

RNG = np.random.default_rng(21)
# Token ids drawn with repeats: each batch's IndexedSlices gradient has duplicate rows.
TOK_DUP = RNG.integers(0, 12, size=(64, 6)).astype("int32")


def embedding_dups():
    inp = keras.Input((6,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(12, 4)(inp))
    return keras.Model(inp, keras.layers.Dense(1)(x)), TOK_DUP


MODELS = {"mlp_frozen": mlp_frozen, "lstm": lstm, "embedding_dups": embedding_dups}
SCHEDULE = lambda: keras.optimizers.schedules.ExponentialDecay(0.02, 5, 0.5)  # noqa: E731
OPTS = {
    "rmsprop": lambda m, kw: m.RMSprop(0.01, **kw),
    "rmsprop_momentum_centered_wd": lambda m, kw: m.RMSprop(0.01, rho=0.8, momentum=0.7, centered=True,
                                                            weight_decay=0.01, **kw),
    "adagrad": lambda m, kw: m.Adagrad(0.05, initial_accumulator_value=0.2, **kw),
    "adadelta": lambda m, kw: m.Adadelta(1.0, **kw),
    "adamax_schedule": lambda m, kw: m.Adamax(SCHEDULE(), **kw),
    "nadam": lambda m, kw: m.Nadam(0.01, **kw),
    "lion": lambda m, kw: m.Lion(0.003, weight_decay=0.01, **kw),
    "ftrl": lambda m, kw: m.Ftrl(0.05, l1_regularization_strength=0.001, l2_regularization_strength=0.01,
                                 l2_shrinkage_regularization_strength=0.01, beta=0.1, **kw),
    "lamb_wd": lambda m, kw: m.Lamb(0.01, weight_decay=0.01, **kw),
    "schedule_free_warmup_wd": lambda m, kw: m.ScheduleFreeAdamW(0.01, warmup_steps=4, weight_decay=0.01, **kw),

}
NEW = ["RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "Lamb", "ScheduleFreeAdamW"]


# Stock Keras 3.15 cannot run centered RMSprop on IndexedSlices with duplicate rows (its sparse
# divide gathers out of range): test_centered_rmsprop_on_duplicate_rows covers that case.
CASES = [(m, o, c) for m in MODELS for o in OPTS for c in CLIPS
         if not (m == "embedding_dups" and o == "rmsprop_momentum_centered_wd")]


@pytest.mark.parametrize("model_name,opt_name,clip", CASES)
def test_same_trajectory_as_stock_keras(model_name, opt_name, clip):
    (stock, _, _), (fused, opt, _) = trajectories(MODELS[model_name], lambda m: OPTS[opt_name](m, CLIPS[clip]))
    for step, (a, b) in enumerate(zip(stock, fused)):
        for wa, wb in zip(a, b):
            if opt_name == "lion":
                # sign() of a value within rounding of 0 may flip: such an element is off by a
                # whole 2*lr step. Few may.
                off = ~np.isclose(wb, wa, rtol=1e-4, atol=1e-5)
                assert off.sum() <= max(1, off.size // 50), (step, off.sum())
                continue
            tol = 5e-7 if step == 0 else 2e-5
            np.testing.assert_allclose(wb, wa, rtol=10 * tol, atol=tol, err_msg=f"step {step}")
    assert int(opt.iterations.numpy()) == 20 and int(opt.skipped_steps.numpy()) == 0


# test_dropin_keras.py's classes (their trajectories are tested there), here for the bit-for-bit test.
TEST_KERAS_OPTS = {
    "adam_amsgrad": lambda m, kw: m.Adam(0.01, amsgrad=True, **kw),
    "adamw": lambda m, kw: m.AdamW(0.01, weight_decay=0.05, **kw),
    "sgd_nesterov": lambda m, kw: m.SGD(0.05, momentum=0.9, nesterov=True, **kw),
}


@pytest.mark.parametrize("name", NEW + ["Adam", "AdamW", "SGD"])
@pytest.mark.parametrize("clip", ["none", "clipvalue"])
def test_dense_steps_are_bitwise_stock(name, clip):
    """Without a norm clip (whose scale is float32 in Keras, float64 here) the fused step does
    the stock operations in the stock order: the same bits, every step. (The trajectory tests'
    tolerances would admit a constant rounded another way, as `1 - beta_2` in float32 instead of
    Python's double: a relative 1e-5 in every update of v.)"""
    make = {n: ({**OPTS, **TEST_KERAS_OPTS})[k] for n, k in zip(NEW + ["Adam", "AdamW", "SGD"], [
        "rmsprop_momentum_centered_wd", "adagrad", "adadelta", "adamax_schedule", "nadam", "lion", "ftrl",
        "lamb_wd", "schedule_free_warmup_wd", "adam_amsgrad", "adamw", "sgd_nesterov"])}[name]
    rng = np.random.default_rng(5)
    init = [rng.normal(size=s).astype("float32") for s in [(7, 5), (33,), ()]]
    out = []
    for mod in (keras.optimizers, tfclip.keras):
        vs = [keras.Variable(x) for x in init]
        opt = make(mod, CLIPS[clip])
        r = np.random.default_rng(6)
        for step in range(15):
            opt.apply_gradients([(tf.constant(r.normal(size=x.shape).astype("float32") * (1 + step % 3)), v)
                                 for x, v in zip(init, vs)])
        out.append([v.numpy() for v in vs] + [np.asarray(s) for s in opt.variables])
    for a, b in zip(*out):
        if name == "Ftrl":
            # Ftrl's n^0.5 is a pow: TF's vectorized Eigen pow is off the correctly rounded value
            # by an ulp for about a quarter of float32 inputs (measured against libm's powf and
            # sqrt), std::pow here is not; a few ulps over 15 steps.
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6)
        elif name == "Lamb":
            # Lamb's |w| and |u| are float32 reductions in Keras (TF's own summation order),
            # fp64 sums here: the trust ratio can differ in its last bit.
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(b, a)


FEATURES = {"xla": dict(jit_compile=True), "mixed_bfloat16": dict(policy="mixed_bfloat16"),
            "mixed_float16": dict(policy="mixed_float16"),
            "ema_accumulation": dict(opt_kw=dict(use_ema=True, ema_overwrite_frequency=3,
                                                 gradient_accumulation_steps=2))}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", NEW)
def test_fit_features_match_stock(name, feature):
    f = FEATURES[feature]
    ws, opts = fit_both(lambda mod: getattr(mod, name)(0.01, global_clipnorm=0.5, **f.get("opt_kw", {})),
                        f.get("policy", "float32"), f.get("jit_compile", False))
    for a, b in zip(*ws):
        if name == "Lion":
            off = ~np.isclose(b, a, rtol=1e-3, atol=1e-4)
            assert off.sum() <= max(1, off.size // 20), off.sum()
        else:
            np.testing.assert_allclose(b, a, rtol=2e-4 if "mixed" in feature else 1e-5, atol=2e-6)
    inner = getattr(opts[1], "inner_optimizer", opts[1])
    assert isinstance(inner, getattr(tfclip.keras, name)) and float(inner.global_norm.numpy()) > 0


@pytest.mark.parametrize("name", NEW)
def test_nonfinite_step_writes_nothing(name):
    v = keras.Variable(np.ones((4, 3), "float32"))
    opt = getattr(tfclip.keras, name)(0.1, global_clipnorm=1.0)
    opt.apply_gradients([(tf.ones((4, 3)), v)])
    before = {x.path: np.asarray(x).copy() for x in [v, *opt.variables]}
    bad = np.ones((4, 3), "float32")
    bad[2, 1] = np.nan
    opt.apply_gradients([(tf.constant(bad), v)])
    assert int(opt.skipped_steps.numpy()) == 1 and np.isnan(opt.global_norm.numpy())
    for x in [v, *opt.variables]:
        # The step counter advances as in stock Keras, and Nadam's u_product, a function of it, with it.
        if x.path.endswith("iteration") or x is getattr(opt, "_u_product", None):
            continue
        np.testing.assert_array_equal(np.asarray(x), before[x.path], err_msg=x.path)


@pytest.mark.parametrize("name", NEW)
def test_config_round_trip_and_registration(name):
    cls = getattr(tfclip.keras, name)
    opt = cls(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9), clipnorm=2.0,
              nonfinite="raise")
    again = cls.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).__class__ is cls
    assert type(tfclip.keras.get(name.lower())) is cls
    # A default config is the stock class's, key for key.
    assert cls(name="o").get_config() == getattr(keras.optimizers, name)(name="o").get_config()


@pytest.mark.parametrize("name,kwargs,match", [
    ("RMSprop", {"rho": float("nan")}, "rho must be finite"),
    ("RMSprop", {"momentum": float("inf")}, "momentum must be finite"),
    ("Adadelta", {"epsilon": float("-inf")}, "epsilon must be finite"),
    ("Adamax", {"beta_1": float("nan")}, "beta_1 must be finite"),
    ("Nadam", {"beta_2": float("inf")}, "beta_2 must be finite"),
    ("Lion", {"beta_2": float("nan")}, "beta_2 must be finite"),
    ("Ftrl", {"beta": float("inf")}, "beta must be finite"),
    ("ScheduleFreeAdamW", {"warmup_steps": float("nan")}, "warmup_steps must be finite"),
    ("ScheduleFreeAdamW", {"beta_1": float("inf")}, "beta_1 must be finite"),
    ("Ftrl", {"l1_regularization_strength": -1.0}, "needs to be positive or zero"),  # stock's own
    ("Ftrl", {"learning_rate_power": 0.5}, "needs to be negative"),  # stock Keras's own check
    ("Adagrad", {"nonfinite": "ignore"}, "nonfinite must be one of"),
])
def test_bad_constructor_arguments_raise(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        getattr(tfclip.keras, name)(0.1, **kwargs)


@pytest.mark.parametrize("name", NEW)
def test_bad_learning_rate_at_step_time_writes_nothing(name):
    """A learning rate out of range, known only when the step runs: the op names it and writes
    nothing (variable, slots, Nadam's u_product: all as a fresh optimizer has them)."""
    v = keras.Variable(np.ones(3, "float32"))
    lr = keras.Variable(float("nan"))
    opt = getattr(tfclip.keras, name)(lambda: lr.value)
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate"):
        opt.apply_gradients([(tf.ones(3), v)])
    np.testing.assert_array_equal(v.numpy(), np.ones(3, "float32"))
    fresh = getattr(keras.optimizers, name)(lambda: lr.value)
    fresh.build([v])
    for a, b in zip(opt.variables, fresh.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_centered_rmsprop_on_duplicate_rows():
    """Centered RMSprop with momentum on IndexedSlices with duplicate rows, against NumPy float64
    with stock Keras's semantics for its uncentered form (velocity takes the duplicates' sum of
    squares, the rest their sum). Stock Keras 3.15 itself fails here; if a later Keras runs it,
    its result is the reference instead."""
    import reference

    rng = np.random.default_rng(4)
    init = rng.normal(size=(6, 3)).astype("float32")
    steps = [(rng.normal(size=(4, 3)).astype("float32"), np.array([2, 0, 2, 2])) for _ in range(5)]
    kw = dict(rho=0.8, momentum=0.5, centered=True)
    ours = keras.Variable(init)
    opt = tfclip.keras.RMSprop(0.01, **kw)
    for vals, idx in steps:
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(vals), tf.constant(idx), tf.constant([6, 3])), ours)])
    try:
        theirs = keras.Variable(init)
        stock = keras.optimizers.RMSprop(0.01, **kw)
        for vals, idx in steps:
            stock.apply_gradients([(tf.IndexedSlices(tf.constant(vals), tf.constant(idx), tf.constant([6, 3])),
                                    theirs)])
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)
        return
    except tf.errors.InvalidArgumentError as e:
        assert "is not in [0," in str(e)  # the Keras failure this test was written against
    var = init.astype(np.float64)
    slots = [np.zeros_like(var) for _ in range(3)]  # velocity, momentum, average_gradient
    hp = {"learning_rate": 0.01, **kw, "has_momentum": True, "epsilon": 1e-7}
    for t, (vals, idx) in enumerate(steps, 1):
        g, gsq = np.zeros_like(var), np.zeros_like(var)
        np.add.at(g, idx, vals.astype(np.float64))
        np.add.at(gsq, idx, vals.astype(np.float64) ** 2)
        var = reference.step("rmsprop", var, slots, g, hp, t, gsq=gsq)
    np.testing.assert_allclose(ours.numpy(), var, rtol=2e-6, atol=1e-7)
    for got, want in zip(opt.variables[2:], slots):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("power,kind", [(-0.5, "ftrl_sqrt"), (-0.7, "ftrl"), (0.0, "ftrl")])
def test_ftrl_power_picks_its_core_variant_and_matches_stock(power, kind):
    v, w = keras.Variable(np.ones((5, 3), "float32")), keras.Variable(np.ones((5, 3), "float32"))
    ours = tfclip.keras.Ftrl(0.1, learning_rate_power=power, l1_regularization_strength=0.01)
    stock = keras.optimizers.Ftrl(0.1, learning_rate_power=power, l1_regularization_strength=0.01)
    r = np.random.default_rng(1)
    for _ in range(8):
        g = tf.constant(r.normal(size=(5, 3)).astype("float32"))
        ours.apply_gradients([(g, v)])
        stock.apply_gradients([(g, w)])
    assert ours._tfclip_binding.kind(ours) == kind  # (the binding row picks the variant)
    np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=2e-5, atol=1e-6)
