"""state_dtype="int8" on the tf_keras (Keras 2) drop-ins, new and legacy (issue 47).

The definition and the reference are those of tests/test_state_int8.py: each class with int8
state is checked, bit for bit, against the same class with float32 state whose slots are set,
before every step, to the int8 run's dequantized slots (NumPy, tests/reference.py); after each
step the variables match and the int8 run's codes and absmax are NumPy's quantization of the
float32 run's new slots. The float32 classes are themselves checked against stock tf_keras
elsewhere (tests/test_dropin_tf_keras.py)."""
import numpy as np
import pytest

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed: "
    "pip install '.[tf-keras]' to test tfclip.tf_keras")

import tensorflow as tf  # noqa: E402

import reference  # noqa: E402
import tfclip.tf_keras as tk  # noqa: E402
from tfclip import _loader  # noqa: E402
from tfclip._engine import opcall as _opcall
from tfclip._engine import narrow_state as _narrow
from test_state_bf16_tf_keras import CASES, _make, _problem, _same_bits, _variables  # noqa: E402


def _pairs(opt, vars_):
    """(is unsigned, [(slot variable, its absmax or None) per variable]) for each slot of opt."""
    unsigned = set(_opcall.RULES[opt._tfclip_binding.kind(opt)]["unsigned_slots"])
    out = []
    for table, src in opt._tfclip_binding.slot_names(opt):
        slots = [opt._tfclip_slot_var(src, v) for v in vars_]
        out.append((table in unsigned, [(s, opt.tfclip_absmax(s)) for s in slots]))
    return out


def _build(kind, opt, vars_):
    opt.build(vars_) if kind == "new" else opt._create_all_weights(vars_)


@pytest.mark.parametrize("kind,name", CASES)
def test_int8_state_starts_at_the_stock_start(kind, name):
    """A fresh optimizer's codes dequantize to the stock class's start (0, or Adagrad's initial
    accumulator value) exactly, and are the start's index in the code the rule table gives the
    slot (the unsigned one for a slot kept >= 0: the rule table's, by the stock slot
    name): the signed code's 0 is at index 127, the unsigned one's at 0, the same value (absmax
    0) but not the same bytes in a checkpoint."""
    v, bv = tf.Variable(np.zeros(300, np.float32)), tf.Variable(np.zeros(300, np.float32))
    a, b = _make(kind, name, state_dtype="int8"), _make(kind, name)
    _build(kind, a, [v])
    _build(kind, b, [bv])
    for (unsigned, got), (_, want) in zip(_pairs(a, [v]), _pairs(b, [bv])):
        (codes, absmax), = got
        assert codes.dtype == tf.uint8 and absmax.dtype == tf.float32 and tuple(absmax.shape) == (2,)
        stock = want[0][0].numpy().ravel()
        np.testing.assert_array_equal(
            reference.dequantize_blockwise(codes.numpy(), absmax.numpy(), not unsigned), stock)
        index, _ = _narrow.int8_start(float(stock[0]), not unsigned)
        assert set(codes.numpy().ravel().tolist()) == {index}


@pytest.mark.parametrize("kind,name", CASES)
@pytest.mark.parametrize("how", ["eager", "function"])
def test_int8_state_is_the_float32_step_quantized(rng, kind, name, how):
    """Bit for bit over three steps (see the module docstring); float32 variables get uint8 codes
    of their shape and a float32 absmax per 256 elements, listed with the optimizer's variables
    (so saved with it); the float64 variable keeps float64 slots."""
    init = _problem(rng)
    a_vars = [tf.Variable(x) for x in init]
    b_vars = [tf.Variable(x) for x in init]
    a = _make(kind, name, global_clipnorm=1.0, state_dtype="int8")
    b = _make(kind, name, global_clipnorm=1.0)

    def a_step(gs):
        a.apply_gradients(zip(gs, a_vars))  # (legacy returns an Operation in a graph, as stock)

    def b_step(gs):
        b.apply_gradients(zip(gs, b_vars))
    if how == "function":
        a_step, b_step = tf.function(a_step), tf.function(b_step)
    _build(kind, a, a_vars)
    _build(kind, b, b_vars)
    pa, pb = _pairs(a, a_vars), _pairs(b, b_vars)
    listed = {id(x) for x in _variables(a)}
    for _, got in pa:
        for (codes, absmax), v in zip(got, a_vars):
            if v.dtype == tf.float32:
                assert codes.dtype == tf.uint8 and tuple(codes.shape) == tuple(v.shape)
                assert tuple(absmax.shape) == (_narrow.int8_blocks(v.shape),) and id(absmax) in listed
            else:
                assert codes.dtype == tf.float64 and absmax is None
    for _ in range(3):
        for (unsigned, got), (_, want) in zip(pa, pb):
            for (codes, absmax), (slot, _) in zip(got, want):
                if absmax is not None:
                    slot.assign(reference.dequantize_blockwise(codes.numpy(), absmax.numpy(), not unsigned)
                                .reshape(slot.shape))
        grads = [tf.constant(rng.normal(size=np.shape(x)).astype(x.dtype)) for x in init]
        a_step(grads)
        b_step(grads)
        for x, y in zip(a_vars, b_vars):
            _same_bits(x.numpy(), y.numpy())
        for (unsigned, got), (_, want) in zip(pa, pb):
            for (codes, absmax), (slot, _) in zip(got, want):
                if absmax is None:
                    _same_bits(codes.numpy(), slot.numpy())
                    continue
                q, am = reference.quantize_blockwise(slot.numpy(), not unsigned)
                _same_bits(codes.numpy().ravel(), q)
                _same_bits(absmax.numpy(), am)


def test_int8_codes_are_signed_as_the_rule_table_says():
    """Every int8-state slot a class makes takes the signed code exactly where the rule table keeps
    the slot's values of either sign (tfclip._engine.narrow_state.made_signed, from the stock
    name it is made under), and no stock name is signed in one class and unsigned in another."""
    seen = {}
    for kind, name in CASES:
        opt, v = _make(kind, name, state_dtype="int8"), tf.Variable(np.zeros(3, np.float32))
        _build(kind, opt, [v])
        made = {id(s.codes): s.signed for s in opt.tfclip_int8_slots()}
        for table, src in opt._tfclip_binding.slot_names(opt):
            slot = opt._tfclip_slot_var(src, v)
            stock = slot.name.split(":")[0].split("/")[-1 if kind == "legacy" else -2]
            unsigned = table in _opcall.RULES[opt._tfclip_binding.kind(opt)]["unsigned_slots"]
            assert seen.setdefault(stock, unsigned) == unsigned, (kind, name, stock)
            assert made[id(slot)] == (not unsigned), (kind, name, stock)
            if not float(opt.tfclip_absmax(slot).numpy().ravel()[0]):  # (a slot starting at 0: that code's 0)
                assert int(slot.numpy().ravel()[0]) == (0 if unsigned else 127), (kind, name, stock)
    assert {"m", "v", "momentum", "accumulator"} <= set(seen)


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_config_and_checkpoint_round_trip(rng, kind, tmp_path):
    """state_dtype='int8' is in get_config; a checkpoint of int8 state restores into the same
    layout bit for bit, also when the slots are made after the restore (legacy: deferred slot
    restoration makes the codes and their absmax from the saved values), and the next step from
    it is the first run's."""
    opt = _make(kind, "Adam", state_dtype="int8")
    assert opt.get_config()["state_dtype"] == "int8"
    assert type(opt).from_config(opt.get_config()).state_dtype == "int8"
    vars_ = [tf.Variable(x) for x in _problem(rng)[:2]]
    for _ in range(2):
        opt.apply_gradients(zip([tf.constant(rng.normal(size=v.shape), tf.float32) for v in vars_], vars_))
    path = tf.train.Checkpoint(opt=opt, v=vars_).save(str(tmp_path / "c"))
    vars2 = [tf.Variable(tf.zeros_like(v)) for v in vars_]
    opt2 = _make(kind, "Adam", state_dtype="int8")
    tf.train.Checkpoint(opt=opt2, v=vars2).restore(path).assert_existing_objects_matched()
    if kind == "new":  # (slots made at build, then restored into)
        opt2.build(vars2)
    else:  # (made by the step, restored as they are made)
        opt2._create_all_weights(vars2)
    for (_, got), (_, want) in zip(_pairs(opt2, vars2), _pairs(opt, vars_)):
        for (c2, a2), (c1, a1) in zip(got, want):
            _same_bits(c2.numpy(), c1.numpy())
            _same_bits(a2.numpy(), a1.numpy())
    g = [tf.constant(rng.normal(size=v.shape), tf.float32) for v in vars_]
    opt.apply_gradients(zip(g, vars_))
    opt2.apply_gradients(zip(g, vars2))
    for x, y in zip(vars2, vars_):
        _same_bits(x.numpy(), y.numpy())


def test_indexed_slices_are_applied_densified(rng):
    """An embedding's IndexedSlices gradient on an int8-state variable is applied as its dense
    sum (duplicate rows summed, as tf.convert_to_tensor does), for both generations."""
    init = rng.normal(size=(10, 4)).astype(np.float32)
    idx = tf.constant([1, 7, 1])
    vals = tf.constant(rng.normal(size=(3, 4)).astype(np.float32))
    for kind in ("new", "legacy"):
        a, b = tf.Variable(init), tf.Variable(init)
        oa, ob = _make(kind, "Adam", state_dtype="int8"), _make(kind, "Adam", state_dtype="int8")
        oa.apply_gradients([(tf.IndexedSlices(vals, idx, tf.constant([10, 4])), a)])
        ob.apply_gradients([(tf.math.unsorted_segment_sum(vals, idx, 10), b)])
        _same_bits(a.numpy(), b.numpy())
        for (_, got), (_, want) in zip(_pairs(oa, [a]), _pairs(ob, [b])):
            _same_bits(got[0][0].numpy(), want[0][0].numpy())


def test_refused_where_it_does_not_run():
    for cls in (tk.Ftrl, tk.legacy.Ftrl):
        with pytest.raises(ValueError, match="Ftrl keeps its state"):
            cls(0.1, state_dtype="int8")
    # A legacy step stock would run cannot take int8 codes: an error naming why, nothing written.
    v = tf.Variable([1.0, 2.0])
    opt = tk.legacy.Adam(0.1, state_dtype="int8", gradient_transformers=[lambda gv: gv])
    with pytest.raises(ValueError, match="gradient_transformers"):
        opt.apply_gradients([(tf.ones(2), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


@pytest.mark.parametrize("jit", [False, True])
def test_model_fit(rng, jit):
    """tf_keras model.fit with int8 state trains; under XLA the step is tfclip's custom calls and
    the state stays int8."""
    if jit and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    tf_keras.utils.set_random_seed(3)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16, activation="relu"),
                                 tf_keras.layers.Dense(1)])
    opt = tk.AdamW(0.01, global_clipnorm=1.0, state_dtype="int8")
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    hist = model.fit(x, y, batch_size=32, epochs=4, verbose=0).history["loss"]
    assert hist[-1] < 0.5 * hist[0]
    assert sum(v.dtype == tf.uint8 for v in opt.variables) == 2 * len(model.trainable_variables)
    assert int(opt.iterations.numpy()) == 32


def test_jit_compiled_step_is_the_eager_step(rng):
    """apply_gradients inside tf.function(jit_compile=True) gives the eager step's variables,
    codes and absmax bit for bit (gradients given)."""
    if not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    init = _problem(rng)[:3]
    grads = [[rng.normal(size=np.shape(x)).astype(np.float32) for x in init] for _ in range(2)]
    out = {}
    for jit in (False, True):
        vars_ = [tf.Variable(x) for x in init]
        opt = tk.Adam(0.01, global_clipnorm=1.0, state_dtype="int8")
        opt.build(vars_)

        def step(g, opt=opt, vars_=vars_):
            opt.apply_gradients(zip(g, vars_))

        run = tf.function(step, jit_compile=True) if jit else step
        for g in grads:
            run([tf.constant(x) for x in g])
        out[jit] = [v.numpy() for v in vars_] + [v.numpy() for v in opt.variables]
    for a, b in zip(out[False], out[True]):
        _same_bits(b, a)


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_mirrored_strategy(rng, kind):
    """Under MirroredStrategy the codes and absmax are mirrored variables and the step is the one
    without a strategy, bit for bit (one device in this process)."""
    strategy = tf.distribute.MirroredStrategy(["CPU:0"])
    init = _problem(rng)[:2]
    grad = [rng.normal(size=x.shape).astype(np.float32) for x in init]
    with strategy.scope():
        vars_ = [tf.Variable(x) for x in init]
        opt = _make(kind, "Adam", state_dtype="int8")

    @tf.function
    def step():
        strategy.run(lambda: opt.apply_gradients(zip([tf.constant(g) for g in grad], vars_)))

    step()
    one_vars = [tf.Variable(x) for x in init]
    one = _make(kind, "Adam", state_dtype="int8")
    one.apply_gradients(zip([tf.constant(g) for g in grad], one_vars))
    got = [x for _, p in _pairs(opt, vars_) for pair in p for x in pair]
    want = [x for _, p in _pairs(one, one_vars) for pair in p for x in pair]
    assert len(got) == len(want) == 12  # m, v, vhat (amsgrad) and their absmax, two variables
    for s, s1 in zip(got, want):
        assert isinstance(s, tf.distribute.DistributedValues), type(s)
        copies = [c.numpy() for c in strategy.experimental_local_results(s)]
        assert len(copies) == 1
        _same_bits(copies[0], s1.numpy())
    for v, v1 in zip(vars_, one_vars):
        _same_bits(v.numpy(), v1.numpy())
