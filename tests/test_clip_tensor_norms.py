"""Per-tensor pre-clip norms from the norm pass, against NumPy float64 norms of the gradients.

`fused_clip_apply(...).tensor_norms`, `fused_clip_by_global_norm(..., return_tensor_norms=True)`,
`_core`'s `tensor_norms_out`, and the Keras optimizers' `tensor_norms` (eager, tf.function,
model.fit, IndexedSlices, weight-decay groups, skipped steps, checkpoints). tf.distribute is in
test_distribute.py, the CUDA kernels' twin of these in tests/gpu/test_cuda_tensor_norms.py.
"""
import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from core_loader import load_core

DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16, "float32": tf.float32, "float64": tf.float64}
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
SHAPES = [(3,), (), (0,), (70000,), (17, 5)]


def np_norms(grads):
    """The float64 norm of each gradient as given (its own dtype's values)."""
    return np.array([np.sqrt(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads])


def f32(x):
    """What a float32 output holds of a float64 norm (rounded once)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def grads_of(rng, dtype, scale=1.0):
    return [(rng.normal(size=s) * scale).astype(NP[dtype]) for s in SHAPES]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["none", "global_clipnorm", "clipnorm", "clipvalue"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_fused_clip_apply_tensor_norms(rng, dtype, mode, graph):
    g = grads_of(rng, dtype)
    vs = [tf.Variable(np.zeros(s, NP[dtype])) for s in SHAPES]
    extra = tf.Variable(np.zeros(4, NP[dtype]))  # a None gradient: not in the norms
    rule = tfclip.rules.Adam(0.01)
    clip = {} if mode == "none" else {mode: 0.5}
    pairs = list(zip([tf.constant(x) for x in g], vs))
    pairs.insert(2, (None, extra))

    def step():
        return tfclip.fused_clip_apply(pairs, rule, **clip)

    result = tf.function(step)() if graph else step()
    assert isinstance(result, tfclip.ClipApplyResult) and len(result) == 4
    # No AGC clip: every gradient's count of clipped units is 0 (aligned as tensor_norms).
    assert result.clipped_units.dtype == tf.int64
    np.testing.assert_array_equal(result.clipped_units.numpy(), np.zeros(len(SHAPES), np.int64))
    tn = result.tensor_norms.numpy()
    assert result.tensor_norms.dtype == tf.float32 and tn.shape == (len(SHAPES),)
    want = np_norms(g)
    np.testing.assert_allclose(tn, f32(want), rtol=1e-7, atol=0)
    # The global norm is the norm of the tensor norms (both from one pass).
    np.testing.assert_allclose(result.global_norm.numpy(), np.sqrt(np.sum(want ** 2)), rtol=1e-6)


def test_tensor_norms_of_indexed_slices_are_their_values(rng):
    """As the global norm counts them: the norm of `.values`, duplicates not summed first."""
    table = tf.Variable(np.zeros((10, 4), np.float32))
    dense = tf.Variable(np.zeros(3, np.float32))
    values = rng.normal(size=(3, 4)).astype(np.float32)
    slices = tf.IndexedSlices(tf.constant(values), tf.constant([2, 2, 7]), tf.constant([10, 4]))
    gd = rng.normal(size=3).astype(np.float32)
    for lazy in (False, True):
        r = tfclip.fused_clip_apply([(slices, table), (tf.constant(gd), dense)], tfclip.rules.Adam(0.1),
                                    global_clipnorm=1.0, lazy_sparse=lazy)
        np.testing.assert_allclose(r.tensor_norms.numpy(), f32(np_norms([values, gd])), rtol=1e-7)


def test_skipped_step_still_names_the_bad_tensor(rng):
    g = [rng.normal(size=5).astype(np.float32) for _ in range(3)]
    g[1][2] = np.inf
    vs = [tf.Variable(np.ones(5, np.float32)) for _ in range(3)]
    r = tfclip.fused_clip_apply(zip([tf.constant(x) for x in g], vs), tfclip.rules.SGD(0.1),
                                global_clipnorm=1.0)
    assert not bool(r.applied)
    tn = r.tensor_norms.numpy()
    assert np.isinf(tn[1]) and np.all(np.isfinite(tn[[0, 2]]))
    np.testing.assert_allclose(tn[[0, 2]], f32(np_norms([g[0], g[2]])), rtol=1e-7)
    for v in vs:
        np.testing.assert_array_equal(v.numpy(), np.ones(5))  # nothing written


def test_given_norm_means_no_norm_pass_and_nan_norms():
    v = tf.Variable([1.0, 2.0])
    r = tfclip.fused_clip_apply([(tf.constant([3.0, 4.0]), v)], tfclip.rules.SGD(0.1),
                                global_clipnorm=1.0, use_norm=10.0)
    assert np.isnan(r.tensor_norms.numpy()).all()
    assert float(r.global_norm) == 10.0


def test_result_is_one_structure_for_tf_function_and_session(rng):
    """A namedtuple: returned from a tf.function whole, and fetched whole by Session.run."""
    v = tf.Variable(np.zeros(3, np.float32))
    rule = tfclip.rules.SGD(0.1)
    out = tf.function(lambda: tfclip.fused_clip_apply([(tf.constant([3.0, 0.0, 4.0]), v)], rule))()
    assert out._fields == ("global_norm", "applied", "tensor_norms", "clipped_units")
    np.testing.assert_allclose(out.tensor_norms.numpy(), [5.0])
    with tf.Graph().as_default():
        w = tf.Variable(np.zeros(2, np.float32))
        step = tfclip.fused_clip_apply([(tf.constant([6.0, 8.0]), w)], tfclip.rules.SGD(0.1))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(step)
    assert type(got).__name__ == "ClipApplyResult"
    np.testing.assert_allclose(got.tensor_norms, [10.0])
    np.testing.assert_array_equal(got.clipped_units, [0])


# ---------------------------------------------------------------- fused_clip_by_global_norm
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_clip_by_global_norm_opt_in(rng, dtype):
    g = grads_of(rng, dtype)
    t_list = [tf.constant(x) for x in g]
    t_list.insert(1, None)
    out = tfclip.fused_clip_by_global_norm(t_list, 1.0)
    assert len(out) == 2  # the drop-in's shape stays TF's
    clipped, norm, tn = tfclip.fused_clip_by_global_norm(t_list, 1.0, return_tensor_norms=True)
    assert tn.dtype == norm.dtype == DTYPES[dtype] and tn.shape == (len(SHAPES),)
    want = np_norms(g)
    rtol = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-7, "float64": 1e-14}[dtype]
    np.testing.assert_allclose(np.asarray(tn, np.float64), want, rtol=rtol)
    # The clipped tensors as without the opt-in (TF's own float16 sum of 70000 squares
    # overflows to NaN, so the reference for every dtype is the plain call's output).
    for a, b in zip(clipped, out[0]):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert float(norm) == float(out[1])


def test_clip_by_global_norm_tensor_norms_gradient_is_tf_norms(rng):
    x = tf.Variable(rng.normal(size=(4, 3)))
    y = tf.Variable(rng.normal(size=5))
    w = tf.constant([0.7, -1.3], tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        clipped, norm, tn = tfclip.fused_clip_by_global_norm([x * 1.0, y * 1.0], 2.0,
                                                             return_tensor_norms=True)
        ours = tf.reduce_sum(tn * w) + tf.reduce_sum(clipped[0]) + norm
        c_tf, n_tf = tf.clip_by_global_norm([x * 1.0, y * 1.0], 2.0)
        theirs = tf.norm(x) * w[0] + tf.norm(y) * w[1] + tf.reduce_sum(c_tf[0]) + n_tf
    for a, b in zip(tape.gradient(ours, [x, y]), tape.gradient(theirs, [x, y])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12)


def test_clip_by_global_norm_tensor_norms_with_use_norm_is_an_error():
    with pytest.raises(ValueError, match="return_tensor_norms=True needs the norm pass"):
        tfclip.fused_clip_by_global_norm([tf.ones(3)], 1.0, use_norm=2.0, return_tensor_norms=True)


# ---------------------------------------------------------------- _core
def test_core_tensor_norms_same_bits_for_any_thread_count(rng):
    core = load_core()
    ts = [rng.normal(size=s).astype(np.float32) * 3 for s in [(300000,), (5,), (0,), (123457,)]]
    want = np_norms(ts)
    outs = []
    for threads in (1, 2, 5):
        core.set_num_threads(threads)
        try:
            out = np.empty(len(ts))
            norm = core.global_norm(ts, tensor_norms_out=out)
            vars_ = [np.zeros_like(t) for t in ts]
            out2 = np.empty(len(ts))
            n2, applied = core.clip_apply("sgd", vars_, ts, [], {"learning_rate": 0.1}, "norm", 1.0,
                                          tensor_norms_out=out2)
        finally:
            core.set_num_threads(0)
        assert applied and norm == n2
        np.testing.assert_allclose(out, want, rtol=1e-14)
        outs.append(np.concatenate([out, out2]).tobytes())
    assert len(set(outs)) == 1


def test_core_tensor_norms_out_is_checked():
    core = load_core()
    with pytest.raises(ValueError, match="tensor_norms_out must be .*float64 array of 2 elements"):
        core.global_norm([np.ones(3, np.float32), np.ones(2, np.float32)],
                         tensor_norms_out=np.empty(3))
    with pytest.raises(ValueError, match="tensor_norms_out must be"):
        core.clip_apply("sgd", [np.ones(2, np.float32)], [np.ones(2, np.float32)], [],
                        {"learning_rate": 0.1}, tensor_norms_out=np.empty(1, np.float32))


# ---------------------------------------------------------------- Keras
def _model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3), keras.layers.Dense(1)])


def _grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("cls,kw", [
    ("Adam", dict(global_clipnorm=0.3)),
    ("SGD", dict(clipnorm=0.2)),
    ("AdamW", dict(weight_decay=0.1)),  # bias excluded below: two op groups, one norm pass
    ("Lamb", dict(clipvalue=0.1)),
])
def test_keras_optimizer_tensor_norms(rng, graph, cls, kw):
    model = _model()
    opt = getattr(tfclip.keras, cls)(0.01, **kw)
    if cls == "AdamW":
        opt.exclude_from_weight_decay(var_names=["bias"])
    x = rng.normal(size=(16, 6)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    def apply(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    apply = tf.function(apply) if graph else apply
    assert opt.tensor_norms is None  # until built
    for _ in range(2):
        grads = _grads(model, x, y)
        want = np_norms([g.numpy() for g in grads])
        apply(grads)
        np.testing.assert_allclose(opt.tensor_norms.numpy(), f32(want), rtol=1e-6)
    assert opt.tensor_norm_names == [v.path for v in model.trainable_variables]
    np.testing.assert_allclose(opt.global_norm.numpy(), np.sqrt(np.sum(want ** 2)), rtol=1e-6)


def test_keras_clip_counters_against_numpy(rng):
    """clipped_steps and clip_scale_sum against the norms NumPy computes, global and per tensor."""
    for kw in (dict(global_clipnorm=0.5), dict(clipnorm=0.2)):
        model = _model()
        opt = tfclip.keras.SGD(0.01, **kw)
        fired, scale_sum = 0, 0.0
        for i in range(4):
            s = 0.01 if i % 2 else 3.0  # alternately below and above the clip
            x = (rng.normal(size=(8, 6)) * s).astype(np.float32)
            y = (rng.normal(size=(8, 1)) * s).astype(np.float32)
            grads = _grads(model, x, y)
            norms = np_norms([g.numpy() for g in grads])
            clip, m = (0.5, np.sqrt(np.sum(norms ** 2))) if "global_clipnorm" in kw else (0.2, norms.max())
            fired += m > clip
            scale_sum += clip / m if m > clip else 1.0
            opt.apply_gradients(zip(grads, model.trainable_variables))
        assert 0 < fired < 4
        assert int(opt.clipped_steps.numpy()) == fired
        np.testing.assert_allclose(opt.clip_scale_sum.numpy(), scale_sum, rtol=1e-6)


def test_keras_variable_without_gradient_reads_zero(rng):
    a, b = keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones(2, np.float32))
    opt = tfclip.keras.Adam(0.1)
    opt.build([a, b])
    opt.apply_gradients([(tf.constant([0.0, 3.0, 4.0]), a), (None, b)])
    np.testing.assert_allclose(opt.tensor_norms.numpy(), [5.0, 0.0])


def test_keras_fit_tensor_norms_and_not_in_checkpoints(rng, tmp_path):
    model = _model()
    opt = tfclip.keras.Adam(0.01, global_clipnorm=0.1)
    model.compile(optimizer=opt, loss="mse")
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0, shuffle=False)
    want = np_norms([g.numpy() for g in _grads(model, x[4:], y[4:])])
    model.fit(x[4:], y[4:], batch_size=4, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(opt.tensor_norms.numpy(), f32(want), rtol=1e-5)
    assert not any("tensor_norms" in v.path for v in opt.variables)
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
    names = [n for n, _ in tf.train.list_variables(path)]
    assert names and not any("tensor_norms" in n or "clip_scale" in n for n in names)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    stock = _model()
    stock.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    stock.optimizer.build(stock.trainable_variables)
    stock.load_weights(str(tmp_path / "w.weights.h5"))  # the same variable lists both ways


@pytest.mark.parametrize("fallback", [False, True], ids=["xla_kernels", "stock_fallback"])
def test_keras_xla_records_tensor_norms(rng, monkeypatch, fallback):
    """Inside jit_compile the step runs tfclip's XLA custom calls, or, in a build without them,
    falls back to stock ops (with a warning); either way the norms are recorded."""
    from tfclip import _loader
    from tfclip._engine import xla as _xla

    if fallback:
        monkeypatch.setattr(_loader, "_XLA", False)
        monkeypatch.setattr(_xla, "_WARNED", set())
    elif not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (TFCLIP_XLA off): the fallback case covers it")
    model = _model()
    opt = tfclip.keras.Adam(0.01, global_clipnorm=0.1)
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    x = rng.normal(size=(4, 6)).astype(np.float32)
    y = rng.normal(size=(4, 1)).astype(np.float32)
    want = np_norms([g.numpy() for g in _grads(model, x, y)])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    said = [str(w.message) for w in caught if "no XLA kernels" in str(w.message)]
    assert len(said) == (1 if fallback else 0), said
    np.testing.assert_allclose(opt.tensor_norms.numpy(), want, rtol=1e-5)
    assert int(opt.clipped_steps.numpy()) == int(np.sqrt(np.sum(want ** 2)) > 0.1)
