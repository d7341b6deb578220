"""state_dtype="bfloat16" on the tf_keras (Keras 2) drop-ins, new and legacy (issue 47).

The definition and the reference are those of tests/test_state_bf16.py: a float32 variable's
slots are stored as bfloat16, each loaded exactly, updated in float32 as with float32 slots and
rounded to nearest even when stored. So each class with bf16 state is checked, bit for bit,
against the same class with float32 state whose slots are rounded to bfloat16 (ml_dtypes) before
every step: the float32 classes are themselves checked against stock tf_keras elsewhere."""
import ml_dtypes
import numpy as np
import pytest

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed: "
    "pip install '.[tf-keras]' to test tfclip.tf_keras")

import tensorflow as tf  # noqa: E402

import tfclip.tf_keras as tk  # noqa: E402
from tfclip import _loader  # noqa: E402

BF16 = ml_dtypes.bfloat16

NEW = {
    "SGD": dict(learning_rate=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=0.01, amsgrad=True),
    "AdamW": dict(learning_rate=0.01, weight_decay=0.1),
    "RMSprop": dict(learning_rate=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(learning_rate=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adamax": dict(learning_rate=0.01),
    "Nadam": dict(learning_rate=0.01),
    "Lion": dict(learning_rate=0.01),
}
LEGACY = {
    "SGD": dict(learning_rate=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=0.01, amsgrad=True),
    "RMSprop": dict(learning_rate=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(learning_rate=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adamax": dict(learning_rate=0.01),
    "Nadam": dict(learning_rate=0.01),
}
CASES = [("new", n) for n in sorted(NEW)] + [("legacy", n) for n in sorted(LEGACY)]


def _make(kind, name, **kw):
    if kind == "new":
        return getattr(tk, name)(**NEW[name], **kw)
    return getattr(tk.legacy, name)(**LEGACY[name], **kw)


def _variables(opt):
    return opt.variables() if callable(opt.variables) else opt.variables


def _slots(opt, vars_):
    """The optimizer's slot variables of vars_, in a fixed order."""
    keys = {id(v) for v in vars_}
    if hasattr(opt, "get_slot_names"):  # legacy: by slot name
        return [opt.get_slot(v, s) for v in vars_ for s in opt.get_slot_names() if id(v) in keys]
    return [v for v in _variables(opt) if v.dtype != tf.int64 and "iteration" not in v.name]


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))


def _problem(rng):
    return [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30), ()]] + [rng.normal(size=(5,))]


@pytest.mark.parametrize("kind,name", CASES)
@pytest.mark.parametrize("how", ["eager", "function"])
def test_bf16_state_is_the_float32_step_rounded(rng, kind, name, how):
    """Bit for bit, over three steps, against float32 state rounded to bf16 before each step;
    float32 variables get bf16 slots, the float64 one keeps float64 slots."""
    init = _problem(rng)
    a_vars = [tf.Variable(x) for x in init]
    b_vars = [tf.Variable(x) for x in init]
    a = _make(kind, name, global_clipnorm=1.0, state_dtype="bfloat16")
    b = _make(kind, name, global_clipnorm=1.0)

    def a_step(gs):
        a.apply_gradients(zip(gs, a_vars))  # (legacy returns an Operation in a graph, as stock)

    def b_step(gs):
        b.apply_gradients(zip(gs, b_vars))

    if how == "function":
        a_step, b_step = tf.function(a_step), tf.function(b_step)
    for opt, vars_ in ((a, a_vars), (b, b_vars)):  # (the slots exist before the first step)
        opt.build(vars_) if kind == "new" else opt._create_all_weights(vars_)
    for _ in range(3):
        grads = [tf.constant(rng.normal(size=np.shape(x)).astype(x.dtype)) for x in init]
        for s in _slots(b, b_vars):  # (Adagrad's start, 0.1, is no bf16 number: rounded too)
            if s.dtype == tf.float32:
                s.assign(s.numpy().astype(BF16).astype(np.float32))
        a_step(grads)
        b_step(grads)
    sa, sb = _slots(a, a_vars), _slots(b, b_vars)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb):
        want = tf.bfloat16 if y.dtype == tf.float32 else y.dtype
        assert x.dtype == want, x.name
        _same_bits(x.numpy(), y.numpy().astype(x.dtype.as_numpy_dtype))
    for x, y in zip(a_vars, b_vars):
        _same_bits(x.numpy(), y.numpy())


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_config_and_checkpoint_round_trip(rng, kind, tmp_path):
    """state_dtype is in get_config (only when set) and from_config keeps it; a checkpoint of
    bf16 state restores into the same layout, also when the slots are made after the restore
    (legacy: deferred slot restoration reads the saved bf16 values)."""
    opt = _make(kind, "Adam", state_dtype="bfloat16")
    assert opt.get_config()["state_dtype"] == "bfloat16"
    assert type(opt).from_config(opt.get_config()).state_dtype == "bfloat16"
    assert "state_dtype" not in _make(kind, "Adam").get_config()
    vars_ = [tf.Variable(x) for x in _problem(rng)[:2]]
    for _ in range(2):
        opt.apply_gradients(zip([tf.ones_like(v) * 0.3 for v in vars_], vars_))
    path = tf.train.Checkpoint(opt=opt, v=vars_).save(str(tmp_path / "c"))
    saved = [s.numpy() for s in _slots(opt, vars_)]
    vars2 = [tf.Variable(tf.zeros_like(v)) for v in vars_]
    opt2 = _make(kind, "Adam", state_dtype="bfloat16")
    tf.train.Checkpoint(opt=opt2, v=vars2).restore(path)
    if kind == "new":  # (slots made at build, then restored into)
        opt2.build(vars2)
    opt2.apply_gradients(zip([tf.zeros_like(v) for v in vars2], vars2))
    # One more step with a zero gradient from the restored state: m decays by beta_1, v by
    # beta_2, each rounded to bf16 again; both runs from the same bits.
    opt.apply_gradients(zip([tf.zeros_like(v) for v in vars_], vars_))
    for x, y, s in zip(_slots(opt2, vars2), _slots(opt, vars_), saved):
        assert x.dtype == tf.bfloat16 and s.dtype == BF16
        _same_bits(x.numpy(), y.numpy())
    for x, y in zip(vars2, vars_):
        _same_bits(x.numpy(), y.numpy())


def test_ema_average_stays_in_the_variables_dtype(rng):
    opt = tk.Adam(0.01, state_dtype="bfloat16", use_ema=True)
    vars_ = [tf.Variable(x) for x in _problem(rng)[:2]]
    opt.apply_gradients(zip([tf.ones_like(v) for v in vars_], vars_))
    dtypes = {v.name.split("/")[1]: v.dtype for v in opt.variables if "/" in v.name}
    assert dtypes == {"m": tf.bfloat16, "v": tf.bfloat16, "average": tf.float32}, dtypes


def test_refused_where_the_state_must_stay_or_the_stock_step_would_run():
    for cls in (tk.Ftrl, tk.legacy.Ftrl):
        with pytest.raises(ValueError, match="Ftrl keeps its state"):
            cls(0.1, state_dtype="bfloat16")
    with pytest.raises(ValueError, match="state_dtype must be None"):
        tk.Adam(0.1, state_dtype="float16")
    # A legacy step stock would run (gradient_transformers) cannot take bf16 slots: an error
    # naming why, before anything is written.
    v = tf.Variable([1.0, 2.0])
    opt = tk.legacy.Adam(0.1, state_dtype="bfloat16", gradient_transformers=[lambda gv: gv])
    with pytest.raises(ValueError, match="gradient_transformers"):
        opt.apply_gradients([(tf.ones(2), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


@pytest.mark.parametrize("jit", [False, True])
def test_model_fit_with_mixed_precision(rng, jit):
    """tf_keras model.fit under mixed_float16 (float32 variables behind AutoCastVariables, the
    stock LossScaleOptimizer around the tfclip one): the slots are bf16, it trains; under XLA the
    step is tfclip's custom calls."""
    if jit and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    tf_keras.utils.set_random_seed(3)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = rng.normal(size=(256, 8)).astype(np.float32)
        y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
        model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16, activation="relu"),
                                     tf_keras.layers.Dense(1, dtype="float32")])
        opt = tk.Adam(0.01, global_clipnorm=1.0, state_dtype="bfloat16")
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        hist = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert hist.history["loss"][-1] < 0.5 * hist.history["loss"][0]
    inner = model.optimizer.inner_optimizer
    assert inner is opt
    slots = [v for v in opt.variables if v.name.startswith(("m/", "v/"))]
    assert len(slots) == 8 and {v.dtype for v in slots} == {tf.bfloat16}
    assert int(opt.iterations.numpy()) == 24


def test_legacy_slots_restored_inside_an_autocast_scope(rng, tmp_path):
    """A subclassed model under mixed_float16 builds its weights at its first call, after the
    restore: the legacy slots are made (and restored) then, inside the layer's float16 autocast
    scope, where the variable's dtype says float16. Its true dtype, float32, decides: bf16 slots."""

    class M(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.d = tf_keras.layers.Dense(3)

        def call(self, x):
            return self.d(x)

    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = tf.constant(rng.normal(size=(4, 5)).astype(np.float32))
        m, opt = M(), tk.legacy.Adam(0.01, state_dtype="bfloat16")
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(m(x), tf.float32))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
        path = tf.train.Checkpoint(m=m, o=opt).save(str(tmp_path / "c"))
        m2, opt2 = M(), tk.legacy.Adam(0.01, state_dtype="bfloat16")
        tf.train.Checkpoint(m=m2, o=opt2).restore(path)
        m2(x)  # builds the weights, and with them the slots, restored
        for v, v2 in zip(m.trainable_variables, m2.trainable_variables):
            for s in ("m", "v"):
                got = opt2.get_slot(v2, s)
                assert got.dtype == tf.bfloat16
                _same_bits(got.numpy(), opt.get_slot(v, s).numpy())
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_mirrored_strategy_makes_bf16_slots(rng, kind):
    """Under MirroredStrategy the strategy's variable creator runs below state_dtype's: the
    slots are mirrored bf16 variables and the step is the one without a strategy. (One device
    in this process; two replicas in their own processes: tests/test_distribute.py, float32
    state.)"""
    strategy = tf.distribute.MirroredStrategy(["CPU:0"])
    init = _problem(rng)[:2]
    grad = [rng.normal(size=x.shape).astype(np.float32) for x in init]
    with strategy.scope():
        vars_ = [tf.Variable(x) for x in init]
        opt = _make(kind, "Adam", state_dtype="bfloat16")

    @tf.function
    def step():
        def replica():
            opt.apply_gradients(zip([tf.constant(g) for g in grad], vars_))
        strategy.run(replica)

    step()
    one_vars = [tf.Variable(x) for x in init]
    one = _make(kind, "Adam", state_dtype="bfloat16")
    one.apply_gradients(zip([tf.constant(g) for g in grad], one_vars))
    slots, one_slots = _slots(opt, vars_), _slots(one, one_vars)
    assert len(slots) == len(one_slots) == 6  # (m, v, vhat: amsgrad)
    for s, s1 in zip(slots, one_slots):
        assert isinstance(s, tf.distribute.DistributedValues), type(s)
        copies = [c.numpy() for c in strategy.experimental_local_results(s)]
        assert len(copies) == 1 and copies[0].dtype == BF16
        _same_bits(copies[0], s1.numpy())
    for v, v1 in zip(vars_, one_vars):
        _same_bits(v.numpy(), v1.numpy())
