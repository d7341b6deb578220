"""Adafactor (rule "adafactor"; csrc/core/factored.h): the core against a NumPy float64 reference
written from the paper's definitions (tests/reference.py, adafactor), never from our kernels;
tfclip.keras.Adafactor against stock keras.optimizers.Adafactor step for step; tfclip.rules.
Adafactor through fused_clip_apply. Keras's own adafactor_test.py runs against the tfclip class
in tests/test_dropin_yardstick_keras.py.

Tolerances: stock keras computes the means and rms in float32 with TF's reductions (their order
is TF's), the core in float64 in a fixed order, so a float32 trajectory agrees to a few ulp per
step, not to the bit; the float64 core agrees with the float64 reference to 1e-12."""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import reference
from conftest import assert_close
from test_clip_agc import agc_clip
from tfclip import _core

ROW = _core.rule_table()["adafactor"]
HP = {"lr": 0.05, "beta_2_decay": -0.8, "epsilon_1": 1e-30, "epsilon_2": 1e-3, "clip_threshold": 1.0}
# (2, 70, 300): several matrices; (70000, 2): one matrix in 69 tiles of 1024 rows (column
# partials added over tiles); (3, 1000, 130): two tiles a matrix.
SHAPES = [(7, 5), (3, 4, 6), (9,), (), (70000, 2), (3, 1000, 130), (2, 70, 300)]


def _state(shape, dtype, factored_state=False):
    """r, c, v as keras makes them (zeros), v a scalar placeholder with factored_state."""
    r = np.zeros(reference.slot_shape(ROW, "r", shape), dtype)
    c = np.zeros(reference.slot_shape(ROW, "c", shape), dtype)
    v = np.zeros(() if factored_state and len(shape) >= 2 else shape, dtype)
    return r, c, v


def _apply(var, g, slots, hp, mode="none", clip=0.0, **kw):
    return _core.clip_apply("adafactor", [var], [g], [[slots[0]], [slots[1]], [slots[2]]], hp, mode, clip, **kw)


# ------------------------------------------------------------------ the core, on NumPy arrays

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_core_matches_the_float64_definition(rng, shape, dtype):
    var = np.array(rng.standard_normal(shape), dtype)
    slots = _state(shape, dtype)
    ref = (var.astype(np.float64),) + tuple(s.astype(np.float64) for s in slots)
    for t in range(1, 4):
        g = np.array(rng.standard_normal(shape) * (0.1 if t == 2 else 1.0), dtype)
        hp = {**HP, "step": float(t), "weight_decay": 0.01}
        _, applied = _apply(var, g, slots, hp)
        assert applied
        ref = reference.adafactor(ref[0], ref[1], ref[2], ref[3], g, hp, t)
        # float32: each step's rounding, the update's relative error a few ulp of float32
        scale = 1.0 if dtype == "float64" else 10.0
        assert_close(var, ref[0], dtype, scale)
        if len(shape) >= 2:
            assert_close(slots[0], ref[1], dtype, scale)
            assert_close(slots[1], ref[2], dtype, scale)
        assert_close(slots[2], ref[3], dtype, scale)


@pytest.mark.parametrize("mode,clip", [("global_norm", 2.0), ("norm", 1.5), ("value", 0.05), ("agc", 0.01)])
def test_core_clips_the_gradient_the_statistics_see(rng, mode, clip):
    """The row and column means, rms(u) and the update all see the clipped gradient."""
    shapes = [(40, 30), (3, 5, 8), (12,)]
    var = [rng.standard_normal(s) for s in shapes]
    slots = [_state(s, np.float64) for s in shapes]
    grads = [rng.standard_normal(s) * 3 for s in shapes]
    if mode == "agc":
        clipped = [agc_clip(g, w, clip)[0] for g, w in zip(grads, var)]
    else:
        clipped = reference.clip(grads, mode, clip)
    hp = {**HP, "step": 1.0}
    expect = [reference.adafactor(w, *s, gc, hp, 1) for w, s, gc in zip(var, slots, clipped)]
    _core.clip_apply("adafactor", var, grads, [[s[k] for s in slots] for k in range(3)], hp, mode, clip)
    for w, s, e in zip(var, slots, expect):
        assert_close(w, e[0], "float64")
        assert_close(s[2], e[3], "float64")


def test_factored_state_gives_the_same_bits_and_leaves_the_placeholder(rng):
    shape = (3, 40, 50)
    var0 = rng.standard_normal(shape).astype(np.float32)
    a, b = var0.copy(), var0.copy()
    sa, sb = _state(shape, np.float32), _state(shape, np.float32, factored_state=True)
    sb[2][...] = 7.0
    for t in range(1, 4):
        g = rng.standard_normal(shape).astype(np.float32)
        _apply(a, g, sa, {**HP, "step": float(t)})
        _apply(b, g, sb, {**HP, "step": float(t)})
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa[0], sb[0])
    np.testing.assert_array_equal(sa[1], sb[1])
    assert sb[2].shape == () and float(sb[2]) == 7.0


def test_same_bits_for_any_thread_count(rng):
    shape = (3, 1000, 130)
    var0 = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    results = []
    before = _core.num_threads()
    try:
        for n in (1, 2, 5):
            _core.set_num_threads(n)
            var, slots = var0.copy(), _state(shape, np.float32)
            _apply(var, g, slots, {**HP, "step": 1.0}, "global_norm", 1.0)
            results.append((var, slots))
    finally:
        _core.set_num_threads(before)
    for var, slots in results[1:]:
        np.testing.assert_array_equal(var, results[0][0])
        for s, s0 in zip(slots, results[0][1]):
            np.testing.assert_array_equal(s, s0)


def test_bfloat16_variable_and_a_float16_gradient(rng):
    bf16 = ml_dtypes.bfloat16
    shape = (16, 24)
    var = rng.standard_normal(shape).astype(bf16)
    slots = _state(shape, bf16)
    g = rng.standard_normal(shape).astype(np.float16)
    expect = reference.adafactor(var.astype(np.float64), *[s.astype(np.float64) for s in slots],
                                 g.astype(np.float64), {**HP, "step": 1.0}, 1)
    _apply(var, g, slots, {**HP, "step": 1.0})
    assert_close(var, expect[0], "bfloat16")
    # float32 variable, float16 gradient: the gradient cast to float32 first, as keras casts it
    var32 = rng.standard_normal(shape).astype(np.float32)
    s32 = _state(shape, np.float32)
    expect = reference.adafactor(var32, *s32, g.astype(np.float32), {**HP, "step": 1.0}, 1)
    _apply(var32, g, s32, {**HP, "step": 1.0})
    assert_close(var32, expect[0], "float32", 10.0)


def test_stochastic_rounding_of_a_bfloat16_variable_lands_on_a_neighbour(rng):
    """A bfloat16 variable's stochastic rounding (csrc/core/rounding.h) in Adafactor's update
    pass; its unbiasedness is tests/test_stochastic_rounding.py's (one StoreVar for every rule)."""
    bf16 = ml_dtypes.bfloat16
    shape = (64, 48)
    var0 = rng.standard_normal(shape).astype(bf16)
    g = rng.standard_normal(shape).astype(bf16)
    near, sr = var0.copy(), var0.copy()
    _apply(near, g, _state(shape, bf16), {**HP, "step": 1.0})
    _apply(sr, g, _state(shape, bf16), {**HP, "step": 1.0}, rounding=(3.0, 1.0))
    # The same float value rounded two ways: to nearest, and down or up at random. So each
    # stochastically rounded value is the nearest one or its bfloat16 neighbour (one bfloat16
    # ulp: float32's spacing there times 2^16).
    a, b = sr.astype(np.float64), near.astype(np.float64)
    ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float32)).astype(np.float64) * 2 ** 16
    assert (np.abs(a - b) <= ulp).all()
    assert (sr != near).any(), "stochastic rounding rounded every element to nearest"


def test_a_non_finite_norm_writes_nothing(rng):
    shape = (6, 5)
    var = rng.standard_normal(shape).astype(np.float32)
    slots = _state(shape, np.float32)
    slots[0][...] = 0.5
    g = rng.standard_normal(shape).astype(np.float32)
    g[2, 3] = np.inf
    before = [var.copy()] + [s.copy() for s in slots]
    norm, applied = _apply(var, g, slots, {**HP, "step": 1.0}, "global_norm", 1.0)
    assert not applied and not np.isfinite(norm)
    for a, b in zip([var] + list(slots), before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="non-finite"):
        _apply(var, g, slots, {**HP, "step": 1.0}, "global_norm", 1.0, nonfinite="raise")


@pytest.mark.parametrize("case,match", [
    ("r", r"slots\[0\]\[0\] has shape \[7\] but must have shape \[6\] \(Adafactor's r"),
    ("c", r"has shape \[6\] but must have shape \[7\] \(Adafactor's c"),
    ("v", r"has shape \[7, 7\] but must have shape \[6, 7\] \(Adafactor's v"),
    ("v1", r"has shape \[\] but must have shape \[9\] \(Adafactor's v: the variable's shape\)"),
    ("sparse", "Adafactor takes a dense gradient"),
    ("bf16_state", "Adafactor keeps its state in the variable's dtype"),
])
def test_bad_state_is_named_and_nothing_is_written(rng, case, match):
    shape = (9,) if case in ("v1", "sparse") else (6, 7)
    var = rng.standard_normal(shape).astype(np.float32)
    r, c, v = _state(shape, np.float32)
    kw = {}
    g = rng.standard_normal(shape).astype(np.float32)
    if case == "r":
        r = np.zeros(7, np.float32)
    elif case == "c":
        c = np.zeros(6, np.float32)
    elif case == "v":
        v = np.zeros((7, 7), np.float32)
    elif case == "v1":
        v = np.zeros((), np.float32)
    elif case == "sparse":
        g = rng.standard_normal((2, 1)).astype(np.float32)[:, 0]
        kw = {"indices": [np.array([1, 4], np.int64)]}
    elif case == "bf16_state":
        r, c, v = (s.astype(ml_dtypes.bfloat16) for s in (r, c, v))
    before = var.copy()
    with pytest.raises(ValueError, match=match):
        _apply(var, g, (r, c, v), {**HP, "step": 1.0}, "global_norm", 1.0, **kw)
    np.testing.assert_array_equal(var, before)


# ------------------------------------------------------------------ tfclip.keras.Adafactor

try:
    import keras
    import tfclip.keras as tk
except ImportError:  # TF 2.15 (Keras 2): tfclip.keras says why
    keras = tk = None
try:
    import tf_keras
    import tfclip.tf_keras as tfk
except ImportError:  # the tf-keras package is not installed
    tf_keras = tfk = None
needs_keras = pytest.mark.skipif(tk is None, reason="Keras 3 (tfclip.keras) is not installed with this TF")
needs_tf_keras = pytest.mark.skipif(tfk is None, reason="the tf-keras package is not installed")
SHAPES_K = [(6, 5), (3, 4, 7), (5,), ()]


def _train(cls, steps=5, seed=0, how="eager", **kw):
    rng = np.random.default_rng(seed)
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]
    opt = cls(**{"learning_rate": 0.05, **kw})
    opt.build(vs)
    step = (lambda gs: opt.apply(gs, vs)) if how == "eager" else tf.function(
        lambda gs: opt.apply(gs, vs), jit_compile=how == "xla")
    for t in range(steps):
        step([tf.constant(rng.standard_normal(s).astype(np.float32) * (10.0 if t == 1 else 1.0)) for s in SHAPES_K])
    return vs, opt


def _assert_trajectories_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@needs_keras
@pytest.mark.parametrize("kw", [
    {}, {"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"clipvalue": 0.3}, {"weight_decay": 0.1},
    {"relative_step": False, "learning_rate": 0.5}, {"clip_threshold": 0.2, "epsilon_2": 0.05, "beta_2_decay": -0.5},
], ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize("how", ["eager", "function", "xla"])
def test_keras_follows_stock_adafactor(kw, how):
    stock, so = _train(keras.optimizers.Adafactor, how=how, **kw)
    ours, oo = _train(tk.Adafactor, how=how, **kw)
    _assert_trajectories_close(stock, ours)
    assert [(v.name, tuple(v.shape), v.dtype) for v in so.variables] == \
        [(v.name, tuple(v.shape), v.dtype) for v in oo.variables]
    _assert_trajectories_close([v.numpy() for v in so.variables], [v.numpy() for v in oo.variables], 1e-4, 1e-6)


@needs_keras
def test_keras_learning_rate_schedule():
    sched = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=2, decay_rate=0.5)
    stock, _ = _train(keras.optimizers.Adafactor, learning_rate=sched)
    ours, _ = _train(tk.Adafactor, learning_rate=sched)
    _assert_trajectories_close(stock, ours)


@needs_keras
def test_keras_factored_state_keeps_no_full_velocity():
    full, of = _train(tk.Adafactor, global_clipnorm=1.0)
    fac, oc = _train(tk.Adafactor, global_clipnorm=1.0, factored_state=True)
    for a, b in zip(full, fac):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    count = lambda o: sum(int(np.prod(v.shape)) for v in o.variables)  # noqa: E731
    # the (6, 5) and (3, 4, 7) velocities (30 + 84 numbers) are scalars now
    assert count(of) - count(oc) == 30 + 84 - 2
    config = oc.get_config()
    assert config["factored_state"] is True and "factored_state" not in of.get_config()
    assert tk.Adafactor.from_config(config).factored_state


@needs_keras
def test_keras_checkpoints_move_both_ways(tmp_path):
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES_K]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES_K] for _ in range(4)]

    def run(first, second):
        vs = [tf.Variable(x) for x in init]
        o1 = first(learning_rate=0.05)
        for g in grads[:2]:
            o1.apply([tf.constant(x) for x in g], vs)
        path = tf.train.Checkpoint(opt=o1, vs=vs).write(str(tmp_path / f"{first.__module__}-{second.__module__}"))
        vs2 = [tf.Variable(np.zeros_like(x)) for x in init]
        o2 = second(learning_rate=0.05)
        o2.build(vs2)
        tf.train.Checkpoint(opt=o2, vs=vs2).read(path).assert_consumed()
        for g in grads[2:]:
            o2.apply([tf.constant(x) for x in g], vs2)
        return vs2

    straight = run(keras.optimizers.Adafactor, keras.optimizers.Adafactor)
    _assert_trajectories_close(straight, run(keras.optimizers.Adafactor, tk.Adafactor))
    _assert_trajectories_close(straight, run(tk.Adafactor, keras.optimizers.Adafactor))


def _model(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(20, 8)(inp)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, keras.layers.Dense(1)(x))


@needs_keras
@pytest.mark.parametrize("jit", [False, True])
def test_keras_model_fit_with_an_embedding_follows_stock(jit):
    """model.fit; the Embedding's gradient is IndexedSlices, which global_clipnorm's scale densifies
    in stock Keras too (without it, test_keras_indexed_slices_with_repeated_rows_follow_stock)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 20, size=(64, 4)).astype(np.int32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    out = []
    for cls in (keras.optimizers.Adafactor, tk.Adafactor):
        m = _model(7)
        m.compile(optimizer=cls(learning_rate=0.05, global_clipnorm=1.0), loss="mse", jit_compile=jit)
        h = m.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
        out.append((h.history["loss"], m.get_weights()))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
    _assert_trajectories_close(out[0][1], out[1][1], 1e-4, 1e-5)


def _sparse_grads(rng, table_shape=(10, 6)):
    """An embedding's IndexedSlices gradient with repeated rows, and dense ones for the others."""
    values = tf.constant(rng.standard_normal((7,) + table_shape[1:]).astype(np.float32))
    emb = tf.IndexedSlices(values, tf.constant([1, 4, 4, 0, 4, 9, 1]), tf.constant(table_shape))
    return [emb] + [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]


def _sparse_runs(seed, classes, apply, kw):
    """Three steps of _sparse_grads on an embedding table and SHAPES_K, for each class: the
    variables after them (`apply(opt, grads, variables)` is the library's apply call)."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in [(10, 6)] + SHAPES_K]
    steps = [_sparse_grads(rng) for _ in range(3)]
    out = []
    for cls in classes:
        vs = [tf.Variable(x) for x in init]
        opt = cls(learning_rate=0.05, **kw)
        for g in steps:
            apply(opt, g, vs)
        out.append([v.numpy() for v in vs])
    return out


@needs_keras
@pytest.mark.parametrize("kw", [{}, {"clipnorm": 0.5}, {"global_clipnorm": 1.0}], ids=lambda kw: "-".join(kw) or "plain")
def test_keras_indexed_slices_with_repeated_rows_follow_stock(kw):
    """Stock Keras 3 squares each slice apart (r, c and rms(u) take the sum of a repeated row's
    squares) and scatters each slice's update; without global_clipnorm tfclip runs the stock
    step for such a gradient, so the bits are stock's; with it, both take the dense gradient."""
    out = _sparse_runs(8, (keras.optimizers.Adafactor, tk.Adafactor), lambda opt, g, vs: opt.apply(g, vs), kw)
    _assert_trajectories_close(out[0], out[1], 1e-6, 1e-7)
    if not kw:  # the same ops: the same bits
        for a, b in zip(out[0], out[1]):
            np.testing.assert_array_equal(a, b)


@needs_keras
def test_keras_factored_state_takes_indexed_slices_as_the_dense_gradient():
    rng = np.random.default_rng(9)
    init = [rng.standard_normal(s).astype(np.float32) for s in [(10, 6)] + SHAPES_K]
    steps = [_sparse_grads(rng) for _ in range(3)]
    out = []
    for dense in (False, True):
        vs = [tf.Variable(x) for x in init]
        opt = tk.Adafactor(learning_rate=0.05, factored_state=True)
        for g in steps:
            opt.apply([tf.convert_to_tensor(x) for x in g] if dense else g, vs)
        out.append([v.numpy() for v in vs])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="factored_state=True needs tfclip's fused op"):
        tk.Adafactor(factored_state=True)._stock_update_step([], [], [], 0.1, cannot="a test")


@needs_keras
def test_keras_nonfinite_step_is_skipped():
    rng = np.random.default_rng(1)
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]
    opt = tk.Adafactor(learning_rate=0.05, global_clipnorm=1.0)
    opt.apply([tf.constant(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K], vs)
    before = [v.numpy() for v in vs + list(opt.variables)]
    bad = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]
    bad[0] = tf.tensor_scatter_nd_update(bad[0], [[1, 1]], [np.nan])
    opt.apply(bad, vs)
    after = [v.numpy() for v in vs + list(opt.variables)]
    names = [v.name for v in opt.variables]
    for name, a, b in zip(["var"] * len(vs) + names, before, after):
        if name != "iteration":  # the counter advances, as stock's
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert int(opt.skipped_steps.numpy()) == 1


@needs_keras
def test_keras_agc_clip_is_the_papers():
    import tfclip

    rng = np.random.default_rng(4)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES_K]
    grads = [rng.standard_normal(s).astype(np.float32) * 5 for s in SHAPES_K]
    ours = [tf.Variable(x) for x in init]
    tk.Adafactor(learning_rate=0.05, clip=tfclip.clipping.AGC(0.01)).apply([tf.constant(g) for g in grads], ours)
    stock = [tf.Variable(x) for x in init]
    clipped = [agc_clip(g, w, 0.01)[0].astype(np.float32) for g, w in zip(grads, init)]
    keras.optimizers.Adafactor(learning_rate=0.05).apply([tf.constant(g) for g in clipped], stock)
    _assert_trajectories_close(stock, ours)


@needs_keras
def test_rules_adafactor_through_fused_clip_apply():
    import tfclip
    import tfclip.rules

    rng = np.random.default_rng(6)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES_K]
    stock = [tf.Variable(x) for x in init]
    ours = [tf.Variable(x) for x in init]
    so = keras.optimizers.Adafactor(learning_rate=0.05, global_clipnorm=1.0)
    rule = tfclip.rules.Adafactor(0.05, factored_state=True)
    for _ in range(4):
        g = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]
        so.apply(g, stock)
        tfclip.fused_clip_apply(list(zip(g, ours)), rule, global_clipnorm=1.0)
    _assert_trajectories_close(stock, ours)
    assert [tuple(s.shape) for s in rule.slots(ours[1]).values()] == [(3, 4), (3, 7), ()]


# ------------------------------------------------------------------ tfclip.tf_keras.Adafactor

def _train_tf_keras(cls, how, steps=5, **kw):
    rng = np.random.default_rng(2)
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in SHAPES_K]
    opt = cls(**{"learning_rate": 0.05, **kw})
    step = (lambda gs: opt.apply_gradients(zip(gs, vs))) if how == "eager" else tf.function(
        lambda gs: opt.apply_gradients(zip(gs, vs)))
    for t in range(steps):
        step([tf.constant(rng.standard_normal(s).astype(np.float32) * (10.0 if t == 1 else 1.0)) for s in SHAPES_K])
    return vs, opt


@needs_tf_keras
@pytest.mark.parametrize("kw", [{}, {"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"weight_decay": 0.1},
                                {"clip_threshold": 0.2, "epsilon_2": 0.05}], ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize("how", ["eager", "function"])
def test_tf_keras_follows_stock_adafactor(kw, how):
    stock, so = _train_tf_keras(tf_keras.optimizers.Adafactor, how, **kw)
    ours, oo = _train_tf_keras(tfk.Adafactor, how, **kw)
    # (tf_keras computes rsqrt where keras 3 divides by sqrt: the same rule to a few ulp)
    _assert_trajectories_close(stock, ours)
    assert [(v.name, tuple(v.shape)) for v in so.variables] == [(v.name, tuple(v.shape)) for v in oo.variables]


@needs_tf_keras
def test_tf_keras_factored_state_and_checkpoints(tmp_path):
    full, of = _train_tf_keras(tfk.Adafactor, "eager", global_clipnorm=1.0)
    fac, oc = _train_tf_keras(tfk.Adafactor, "eager", global_clipnorm=1.0, factored_state=True)
    for a, b in zip(full, fac):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert oc.get_config()["factored_state"] is True
    # a stock checkpoint restores into tfclip's optimizer (the default layout), and back
    stock, so = _train_tf_keras(tf_keras.optimizers.Adafactor, "eager", steps=2)
    path = tf.train.Checkpoint(opt=so).write(str(tmp_path / "stock"))
    back = tfk.Adafactor(learning_rate=0.05)
    back.build(stock)
    tf.train.Checkpoint(opt=back).read(path).assert_consumed()
    for a, b in zip(so.variables, back.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@needs_tf_keras
@pytest.mark.parametrize("kw", [{}, {"clipnorm": 0.5}], ids=["plain", "clipnorm"])
def test_tf_keras_indexed_slices_with_repeated_rows_follow_stock(kw):
    """tf_keras sums a repeated row's slices first (convert_to_tensor), as tfclip's dense
    passes take it; its clipnorm is of the slices (tf.clip_by_norm), as tfclip clips it first."""
    out = _sparse_runs(10, (tf_keras.optimizers.Adafactor, tfk.Adafactor),
                       lambda opt, g, vs: opt.apply_gradients(zip(g, vs)), kw)
    _assert_trajectories_close(out[0], out[1])
