"""ScheduleFreeAdamW (issue 35): tfclip.keras.ScheduleFreeAdamW and tfclip.rules.ScheduleFreeAdamW
against stock keras.optimizers.ScheduleFreeAdamW step by step (eager, tf.function; warmup; weight
decay in two groups; float64, float16 and mixed dtypes) and against NumPy float64 over many steps;
the momentum slot's initial copy of the variable; warmup_steps as stock takes it; identifiers.
The lists of every rule (test_dropin_rules_keras, test_rules, test_dropin_stock_state, test_xla, ...) cover it
too: fit with XLA, mixed precision, EMA, accumulation, checkpoints both ways, IndexedSlices."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import reference
import tfclip

pytestmark = pytest.mark.skipif(not hasattr(keras.optimizers, "ScheduleFreeAdamW"),
                                reason=f"this Keras ({keras.__version__}) has no ScheduleFreeAdamW")

SHAPES = [(7, 5), (33,), ()]


def _grads(rng, steps, dtype="float32"):
    return [[(rng.normal(size=s) * (1 + t % 3)).astype(dtype) for s in SHAPES] for t in range(steps)]


def _run_keras(mod, init, grads, make, compiled=False, grad_dtype=None, exclude=None):
    vs = [keras.Variable(x, name=f"v{i}") for i, x in enumerate(init)]
    opt = make(mod)
    if exclude:
        opt.exclude_from_weight_decay(var_names=exclude)

    def step(gs):
        opt.apply_gradients(zip(gs, vs))

    fn = tf.function(step) if compiled else step
    for gs in grads:
        fn([tf.constant(g, grad_dtype) if grad_dtype else tf.constant(g) for g in gs])
    return [v.numpy() for v in vs] + [np.asarray(s) for s in opt.variables], opt


# ---------------------------------------------------------------- what stock Keras computes
def test_stock_keras_on_tensorflow_recovers_x_from_the_updated_momentum():
    """The premise of the core rule: keras's `momentum_old = momentum.value` is, on the TensorFlow
    backend, the variable itself, read after `assign_sub`, so stock recovers x from the NEW z (and
    beta_1 cancels out of y's update: y' = (1 - 1/t) y + (1/t) z'). In float64 stock follows the
    reference that reads the new z, not the paper's. If a Keras release reads the old z, this
    fails, and the rule (csrc/core/rules.h) must follow it."""
    rng = np.random.default_rng(1)
    init = [rng.normal(size=s) for s in SHAPES]
    grads = _grads(rng, 12, "float64")
    hp = {"learning_rate": 0.05, "beta_1": 0.5, "beta_2": 0.99, "epsilon": 1e-8}
    # (Stock casts its Python-float hyper-parameters through float32 for a float64 variable.)
    hp32 = {k: float(np.float32(v)) for k, v in hp.items()}
    stock, _ = _run_keras(keras.optimizers, init, grads, lambda m: m.ScheduleFreeAdamW(0.05, beta_1=0.5, beta_2=0.99))
    for paper in (False, True):
        want = [x.copy() for x in init]
        slots = [[x.copy(), np.zeros_like(x)] for x in init]
        averaged = [x.copy() for x in init]  # (1 - 1/t) y + (1/t) z': keras's y, algebraically
        for t, gs in enumerate(grads, 1):
            for i, g in enumerate(gs):
                want[i] = reference.schedule_free_adamw(want[i], slots[i], g, hp32, t, paper=paper)
                averaged[i] = (1 - 1 / t) * averaged[i] + (1 / t) * slots[i][0]
        close = all(np.allclose(s, w, rtol=1e-9, atol=1e-12) for s, w in zip(stock, want))
        assert close == (not paper), f"stock Keras {'matches' if close else 'differs from'} paper={paper}"
    for s, a in zip(stock, averaged):
        np.testing.assert_allclose(s, a, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- against stock, step by step
CONFIGS = {
    "default": lambda m: m.ScheduleFreeAdamW(),
    "warmup": lambda m: m.ScheduleFreeAdamW(0.01, warmup_steps=6),
    "warmup_fraction": lambda m: m.ScheduleFreeAdamW(0.01, warmup_steps=2.5, beta_1=0.7),
    "warmup_negative": lambda m: m.ScheduleFreeAdamW(0.01, warmup_steps=-3),  # stock: no warmup
    "weight_decay": lambda m: m.ScheduleFreeAdamW(0.02, weight_decay=0.1, warmup_steps=3),
    "schedule": lambda m: m.ScheduleFreeAdamW(keras.optimizers.schedules.ExponentialDecay(0.05, 4, 0.5),
                                              beta_2=0.95, epsilon=1e-6),
    "clipvalue": lambda m: m.ScheduleFreeAdamW(0.01, clipvalue=0.5, warmup_steps=4),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_same_bits_as_stock_every_step(config, compiled):
    rng = np.random.default_rng(2)
    init = [rng.normal(size=s).astype("float32") for s in SHAPES]
    grads = _grads(rng, 15)
    # Two weight-decay groups where weight decay is on (the bias-like vector excluded).
    exclude = ["v1"] if config == "weight_decay" else None
    stock, _ = _run_keras(keras.optimizers, init, grads, CONFIGS[config], compiled, exclude=exclude)
    ours, opt = _run_keras(tfclip.keras, init, grads, CONFIGS[config], compiled, exclude=exclude)
    assert isinstance(opt, tfclip.keras.ScheduleFreeAdamW) and int(opt.iterations.numpy()) == 15
    if not compiled:
        for a, b in zip(stock, ours):
            np.testing.assert_array_equal(b, a)
        return
    # In a tf.function Grappler's constant folding rewrites stock's graph (a division by the
    # constant beta_1 among what it may turn into a product): a few ulps, compounding over steps.
    for a, b in zip(stock, ours):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-7)
    # Without that pass stock's graph does the eager operations: the same bits again.
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    try:
        stock, _ = _run_keras(keras.optimizers, init, grads, CONFIGS[config], compiled, exclude=exclude)
        ours, _ = _run_keras(tfclip.keras, init, grads, CONFIGS[config], compiled, exclude=exclude)
    finally:
        tf.config.optimizer.set_experimental_options({"constant_folding": True})
    for a, b in zip(stock, ours):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("var_dtype,grad_dtype,rtol", [
    ("float64", "float64", 1e-6),  # stock rounds its Python floats through float32 there
    ("float16", "float16", 2e-3),  # stock computes in float16, the core in float
    ("float32", "bfloat16", 1e-6),  # a 16-bit gradient on a float32 variable: cast, then float32 math
    ("float32", "float16", 1e-6),
])
def test_other_dtypes_match_stock(var_dtype, grad_dtype, rtol):
    rng = np.random.default_rng(3)
    init = [rng.normal(size=s).astype(var_dtype) for s in SHAPES]
    grads = _grads(rng, 8, "float32")
    make = lambda m: m.ScheduleFreeAdamW(0.01, warmup_steps=3, weight_decay=0.01)  # noqa: E731
    stock, _ = _run_keras(keras.optimizers, init, grads, make, grad_dtype=grad_dtype)
    ours, _ = _run_keras(tfclip.keras, init, grads, make, grad_dtype=grad_dtype)
    for a, b in zip(stock, ours):
        assert b.dtype == a.dtype
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if var_dtype == "float16":
            # Stock's float16 math loses epsilon (1e-8 is 0 in float16) and underflows velocity:
            # 0/0 gives it NaN where the core's float math stays finite. Compared where stock is.
            assert np.isfinite(b).all()
            a, b = a[np.isfinite(a)], b[np.isfinite(a)]
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------- against NumPy float64
@pytest.mark.parametrize("hp", [
    {"learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8, "warmup_steps": 10,
     "weight_decay": 0.02},
    {"learning_rate": 0.003, "beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-6, "warmup_steps": 0, "weight_decay": 0.0},
])
def test_many_steps_against_numpy_float64(hp):
    """200 steps of tfclip.rules on float64 variables (the core's double math) and of the Keras
    drop-in on float32 ones, against the float64 reference."""
    rng = np.random.default_rng(4)
    init = [rng.normal(size=s) for s in SHAPES]
    grads = [[rng.normal(size=s) for s in SHAPES] for _ in range(200)]
    rule = tfclip.rules.ScheduleFreeAdamW(**hp)
    ours = [tf.Variable(x) for x in init]
    k32 = [keras.Variable(x.astype("float32")) for x in init]
    opt = tfclip.keras.ScheduleFreeAdamW(**hp)
    want = [x.copy() for x in init]
    slots = [[x.copy(), np.zeros_like(x)] for x in init]
    for t, gs in enumerate(grads, 1):
        tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(gs, ours)], rule)
        opt.apply_gradients([(tf.constant(g, tf.float32), v) for g, v in zip(gs, k32)])
        for i, g in enumerate(gs):
            want[i] = reference.step("schedule_free_adamw", want[i], slots[i], g, hp, t)
    assert int(rule.iterations.numpy()) == 200
    for v, w, sl in zip(ours, want, slots):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(rule.slots(v)["momentum"].numpy(), sl[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(rule.slots(v)["velocity"].numpy(), sl[1], rtol=1e-10, atol=1e-14)
    for v, w in zip(k32, want):  # float32 rounding, carried through 200 steps of averaging
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the momentum slot's start
def test_rule_momentum_slot_starts_as_the_variable_eagerly_and_in_tf_function():
    x = np.array([[1.0, -2.0], [3.0, 0.5]], "float32")
    for compiled in (False, True):
        v = tf.Variable(x)
        rule = tfclip.rules.ScheduleFreeAdamW(0.1)
        step = lambda: tfclip.fused_clip_apply([(tf.zeros_like(x), v)], rule)  # noqa: E731
        (tf.function(step) if compiled else step)()
        # A zero gradient: z stays where it started, at the variable, and so does y.
        np.testing.assert_array_equal(rule.slots(v)["momentum"].numpy(), x)
        np.testing.assert_array_equal(v.numpy(), x)
    fresh = tf.Variable(x)
    np.testing.assert_array_equal(tfclip.rules.ScheduleFreeAdamW().slots(fresh)["momentum"].numpy(), x)


def test_rule_momentum_slot_in_a_tf1_graph_reads_the_initialized_variable():
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("w", initializer=tf.constant([1.5, -0.5]), use_resource=True)
        rule = tfclip.rules.ScheduleFreeAdamW(0.1)
        res = tfclip.fused_clip_apply([(tf.constant([0.0, 0.0]), v)], rule)
        z = rule.slots(v)["momentum"]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(z), [1.5, -0.5])
            sess.run(res)
            np.testing.assert_array_equal(sess.run([v, z]), [[1.5, -0.5], [1.5, -0.5]])


def test_keras_momentum_slots_start_as_copies_and_list_as_stock():
    vs = [keras.Variable(np.arange(6.0).reshape(2, 3).astype("float32"), name="k"), keras.Variable([2.0], name="b")]
    ours, stock = tfclip.keras.ScheduleFreeAdamW(name="o"), keras.optimizers.ScheduleFreeAdamW(name="o")
    ours.build(vs)
    stock.build(vs)
    assert [v.path for v in ours.variables] == [v.path for v in stock.variables]
    for a, b in zip(ours.variables, stock.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ours._momentums[0]), np.asarray(vs[0]))


# ---------------------------------------------------------------- arguments and identifiers
@pytest.mark.parametrize("warmup", [-3, 0, 1, 2, 2.5, 4, 100, np.int64(3)])
def test_warmup_steps_stock_takes_give_the_stock_steps(warmup):
    init = [np.array([0.5, -1.0, 2.0], "float32")]
    grads = [[np.array(g, "float32")] for g in ([0.1, -0.2, 0.3], [-0.3, 0.1, 0.2], [0.2, 0.2, -0.1])]
    stock, _ = _run_keras(keras.optimizers, init, grads, lambda m: m.ScheduleFreeAdamW(0.1, warmup_steps=warmup))
    ours, _ = _run_keras(tfclip.keras, init, grads, lambda m: m.ScheduleFreeAdamW(0.1, warmup_steps=warmup))
    for a, b in zip(stock, ours):
        np.testing.assert_array_equal(b, a)
    rule = tfclip.rules.ScheduleFreeAdamW(0.1, warmup_steps=warmup)
    v = tf.Variable(init[0])
    for gs in grads:
        tfclip.fused_clip_apply([(tf.constant(gs[0]), v)], rule)
    np.testing.assert_array_equal(v.numpy(), stock[0])


@pytest.mark.parametrize("bad,match", [(float("nan"), "warmup_steps must be finite"),
                                       (float("inf"), "warmup_steps must be finite"),
                                       ("10", "warmup_steps must be a number"),
                                       (lambda: 3, "warmup_steps must be a number")])
def test_bad_warmup_steps_is_named_at_construction(bad, match):
    """Stock takes these and then ignores NaN (`nan > 0` is False), never moves with inf (lr * 0)
    or fails at its first step: tfclip names them when the optimizer is made."""
    with pytest.raises(ValueError, match=match):
        tfclip.keras.ScheduleFreeAdamW(warmup_steps=bad)
    if isinstance(bad, float):
        with pytest.raises(ValueError, match=match):
            tfclip.rules.ScheduleFreeAdamW(warmup_steps=bad)


def test_identifiers_as_keras_optimizers_get():
    for ident in ("ScheduleFreeAdamW", "schedulefreeadamw",
                  {"class_name": "ScheduleFreeAdamW", "config": {"learning_rate": 0.5, "warmup_steps": 7}}):
        stock = keras.optimizers.get(ident if isinstance(ident, str) else dict(ident))
        ours = tfclip.keras.get(ident if isinstance(ident, str) else dict(ident))
        assert type(stock) is keras.optimizers.ScheduleFreeAdamW
        assert type(ours) is tfclip.keras.ScheduleFreeAdamW
        assert {**ours.get_config(), "name": ""} == {**stock.get_config(), "name": ""}
    for ident in ("schedule_free_adamw", "ScheduleFree"):  # names stock does not know: neither does tfclip
        with pytest.raises(ValueError):
            keras.optimizers.get(ident)
        with pytest.raises(ValueError):
            tfclip.keras.get(ident)


def test_lazy_sparse_moves_only_the_rows_given():
    w0 = np.random.default_rng(5).normal(size=(8, 3)).astype("float32")
    emb = keras.Variable(w0)
    opt = tfclip.keras.ScheduleFreeAdamW(0.05, weight_decay=0.1, lazy_sparse=True)
    for _ in range(3):
        opt.apply_gradients([(tf.IndexedSlices(tf.ones([3, 3]), tf.constant([4, 4, 6]), tf.constant([8, 3])), emb)])
    untouched = [r for r in range(8) if r not in (4, 6)]
    np.testing.assert_array_equal(emb.numpy()[untouched], w0[untouched])
    np.testing.assert_array_equal(np.asarray(opt._momentums[0])[untouched], w0[untouched])
    assert not np.allclose(emb.numpy()[[4, 6]], w0[[4, 6]])
