"""IndexedSlices gradients: in the norm as TF counts them, applied without densifying, with the
stock optimizers' results (Keras 3 and tf.compat.v1), the lazy option, and bad indices."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import tfclip
from reference import step as ref_step

ROWS, WIDTH = 12, 5


def slices(rng, idx, dtype=np.float32, scale=1.0):
    idx = np.asarray(idx)
    vals = (rng.normal(size=(len(idx), WIDTH)) * scale).astype(dtype)
    return tf.IndexedSlices(tf.constant(vals), tf.constant(idx), tf.constant([ROWS, WIDTH], tf.int64))


def densify_sums(values, idx, rows):
    """Keras densifies an IndexedSlices gradient with unsorted_segment_sum: per row the sum of its
    slices, and (Adam's `square(g)` before densifying) the sum of their squares. Float64."""
    v = np.asarray(values, np.float64)
    g = np.zeros((rows,) + v.shape[1:])
    gsq = np.zeros_like(g)
    for j, r in enumerate(idx):
        g[r] += v[j]
        gsq[r] += v[j] ** 2
    return g, gsq


def ref_sparse(rule, var, slots, values, idx, hp, t, lazy, sum_of_squares=False):
    """Float64 reference of one sparse update (clip already applied to `values`): the dense
    update of the densified gradient (or of its rows only, lazily)."""
    g, gsq = densify_sums(values, idx, var.shape[0])
    if not sum_of_squares:
        gsq = g * g
    var = np.asarray(var, np.float64)
    slots = [np.asarray(s, np.float64).copy() for s in slots]
    rows = np.unique(idx)
    if lazy or (rule == "sgd" and not hp.get("weight_decay")):
        out = var.copy()
        sub = [s[rows] for s in slots]
        out[rows] = ref_step(rule, var[rows], sub, g[rows], hp, t, gsq=gsq[rows])
        for s, ss in zip(slots, sub):
            s[rows] = ss
        return out, slots
    return ref_step(rule, var, slots, g, hp, t, gsq=gsq), slots


RULES = {
    "sgd": (lambda: tfclip.rules.SGD(0.1), "sgd", {"learning_rate": 0.1}),
    "sgd_wd": (lambda: tfclip.rules.SGD(0.1, weight_decay=0.05), "sgd",
               {"learning_rate": 0.1, "weight_decay": 0.05}),
    "keras_momentum": (lambda: tfclip.rules.SGD(0.1, momentum=0.9, nesterov=True), "keras_momentum",
                       {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "momentum": (lambda: tfclip.rules.Momentum(0.1, 0.9), "momentum", {"learning_rate": 0.1, "momentum": 0.9}),
    "adam_amsgrad": (lambda: tfclip.rules.Adam(0.05, amsgrad=True), "adam", {"learning_rate": 0.05, "amsgrad": True}),
    "adamw": (lambda: tfclip.rules.AdamW(0.05, weight_decay=0.1), "adam",
              {"learning_rate": 0.05, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["stock", "lazy"])
@pytest.mark.parametrize("name", list(RULES))
def test_fused_clip_apply_matches_float64_reference(name, lazy):
    """A dense tensor and an embedding table with duplicate and untouched rows, clipped together
    by global norm, three steps, against NumPy float64."""
    make, rule_name, hp = RULES[name]
    rng = np.random.default_rng(1)
    rule = make()
    w0 = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    d0 = rng.normal(size=(4,)).astype(np.float32)
    emb, dense = tf.Variable(w0), tf.Variable(d0)
    ref_w, ref_d = w0.astype(np.float64), d0.astype(np.float64)
    n = {"sgd": 0, "momentum": 1, "keras_momentum": 1}.get(rule_name, 3 if hp.get("amsgrad") else 2)
    ref_sw = [np.zeros((ROWS, WIDTH)) for _ in range(n)]
    ref_sd = [np.zeros(4) for _ in range(n)]
    for t in (1, 2, 3):
        idx = [3, 7, 3, 0, 3] if t != 2 else [11, 7]
        sl = slices(rng, idx, scale=2.0)
        gd = rng.normal(size=(4,)).astype(np.float32)
        res = tfclip.fused_clip_apply([(sl, emb), (tf.constant(gd), dense)], rule, global_clipnorm=1.5,
                                      lazy_sparse=lazy)
        norm = np.sqrt(np.sum(sl.values.numpy().astype(np.float64) ** 2) + np.sum(gd.astype(np.float64) ** 2))
        np.testing.assert_allclose(float(res.global_norm), norm, rtol=1e-6)
        s = min(1.0, 1.5 / norm)
        ref_w, ref_sw = ref_sparse(rule_name, ref_w, ref_sw, sl.values.numpy() * s, idx, hp, t, lazy)
        ref_d = ref_step(rule_name, ref_d, ref_sd, gd.astype(np.float64) * s, hp, t)
        np.testing.assert_allclose(emb.numpy(), ref_w, rtol=2e-5, atol=2e-6, err_msg=f"step {t}")
        np.testing.assert_allclose(dense.numpy(), ref_d, rtol=2e-5, atol=2e-6)
        for k, sname in enumerate(rule.slot_names):
            np.testing.assert_allclose(rule.slots(emb)[sname].numpy(), ref_sw[k], rtol=2e-5, atol=2e-6)
    if lazy or (rule_name == "sgd" and "weight_decay" not in hp):
        np.testing.assert_array_equal(emb.numpy()[[1, 2]], w0[[1, 2]])  # never-touched rows


# ---------------------------------------------------------------- stock Keras 3, step by step
KERAS_OPTS = {
    "sgd": lambda m, kw: m.SGD(0.1, **kw),
    "sgd_wd": lambda m, kw: m.SGD(0.1, weight_decay=0.05, **kw),
    "momentum": lambda m, kw: m.SGD(0.1, momentum=0.9, **kw),
    "nesterov": lambda m, kw: m.SGD(0.1, momentum=0.9, nesterov=True, **kw),
    "adam": lambda m, kw: m.Adam(0.05, **kw),
    "adam_amsgrad": lambda m, kw: m.Adam(0.05, amsgrad=True, **kw),
    "adamw": lambda m, kw: m.AdamW(0.05, weight_decay=0.1, **kw),
    "rmsprop_momentum": lambda m, kw: m.RMSprop(0.02, momentum=0.5, **kw),
    "adagrad": lambda m, kw: m.Adagrad(0.1, **kw),
    "adadelta": lambda m, kw: m.Adadelta(1.0, **kw),
    "adamax": lambda m, kw: m.Adamax(0.05, **kw),
    "nadam": lambda m, kw: m.Nadam(0.05, **kw),
    "lion": lambda m, kw: m.Lion(0.01, **kw),
    "ftrl": lambda m, kw: m.Ftrl(0.1, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.01,
                                 **kw),
    "schedule_free_adamw": lambda m, kw: m.ScheduleFreeAdamW(0.05, warmup_steps=2, weight_decay=0.01, **kw),
}
KERAS_CLIPS = {"none": {}, "global_clipnorm": {"global_clipnorm": 1.0}, "clipnorm": {"clipnorm": 0.5}}


def _keras_run(mod, opt_name, clip, steps, dtype="float32"):
    rng = np.random.default_rng(2)
    emb = keras.Variable(rng.normal(size=(ROWS, WIDTH)).astype(dtype), name="emb")
    dense = keras.Variable(rng.normal(size=(3, 2)).astype(dtype), name="dense")
    opt = KERAS_OPTS[opt_name](mod, KERAS_CLIPS[clip])
    history = []
    for t in range(steps):
        idx = [[2, 9, 2, 2], [5], [0, 11, 5, 0]][t % 3]
        sl = slices(rng, idx, dtype=dtype)
        gd = tf.constant(rng.normal(size=(3, 2)).astype(dtype))
        opt.apply_gradients([(sl, emb), (gd, dense)])
        history.append([emb.numpy().copy(), dense.numpy().copy()] +
                       [v.numpy().copy() for v in opt.variables if "emb" in v.path])
    return history


@pytest.mark.parametrize("clip", list(KERAS_CLIPS))
@pytest.mark.parametrize("opt_name", list(KERAS_OPTS))
def test_keras_optimizers_match_stock_on_indexed_slices(opt_name, clip):
    """Variables and the embedding's slots after every step, against stock Keras 3 given the same
    IndexedSlices (with duplicates). Stock Keras densifies; tfclip does not, and agrees."""
    stock = _keras_run(keras.optimizers, opt_name, clip, 6)
    fused = _keras_run(tfclip.keras, opt_name, clip, 6)
    for t, (a, b) in enumerate(zip(stock, fused)):
        assert len(a) == len(b)
        for wa, wb in zip(a, b):
            # Duplicates summed before (stock) or after (Keras momentum's g*lr) a multiply: an ulp.
            np.testing.assert_allclose(wb, wa, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")


def test_keras_lazy_sparse_touches_only_the_rows_given():
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(ROWS, WIDTH)).astype("float32")
    emb = keras.Variable(w0)
    opt = tfclip.keras.AdamW(0.05, weight_decay=0.1, lazy_sparse=True)
    for _ in range(3):
        opt.apply_gradients([(slices(rng, [4, 4, 6]), emb)])
    untouched = [r for r in range(ROWS) if r not in (4, 6)]
    np.testing.assert_array_equal(emb.numpy()[untouched], w0[untouched])
    assert not np.allclose(emb.numpy()[[4, 6]], w0[[4, 6]])
    assert tfclip.keras.AdamW.from_config(opt.get_config()).lazy_sparse is True
    with pytest.raises(TypeError, match="lazy_sparse"):
        tfclip.keras.Adam(lazy_sparse="yes")


def test_keras_embedding_model_with_repeated_tokens_matches_stock():
    """An Embedding model whose batches repeat token ids, trained in tf.function, and the update
    graph holds no densifying op for the table."""
    rng = np.random.default_rng(4)
    tok = rng.integers(0, 30, size=(64, 6)).astype("int32")  # many repeats
    y = rng.normal(size=(64, 1)).astype("float32")
    out = []
    for mod in (keras.optimizers, tfclip.keras):
        keras.utils.set_random_seed(5)
        inp = keras.Input((6,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(30, 4)(inp))
        model = keras.Model(inp, keras.layers.Dense(1)(h))
        opt = mod.Adam(0.02, global_clipnorm=0.5)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for i in range(8):
            step(tok[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
        out.append([w.copy() for w in model.get_weights()])
        if mod is tfclip.keras:
            graph = step.get_concrete_function(tok[:8], y[:8]).graph
            kinds = {op.type for op in graph.get_operations()}
            assert "TfclipClipApplyAdam" in kinds
            assert not kinds & {"UnsortedSegmentSum", "ScatterNd", "SparseToDense"}, kinds
    for a, b in zip(*out):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- tf.compat.v1, stock TF1 classes
V1 = {
    "sgd": (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
            lambda **kw: tfclip.compat.v1.GradientDescentOptimizer(0.1, **kw)),
    "momentum": (lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
                 lambda **kw: tfclip.compat.v1.MomentumOptimizer(0.1, 0.9, **kw)),
    "adam": (lambda: tf.compat.v1.train.AdamOptimizer(0.05),
             lambda **kw: tfclip.compat.v1.AdamOptimizer(0.05, **kw)),
    "rmsprop_centered_momentum": (
        lambda: tf.compat.v1.train.RMSPropOptimizer(0.05, momentum=0.5, centered=True),
        lambda **kw: tfclip.compat.v1.RMSPropOptimizer(0.05, momentum=0.5, centered=True, **kw)),
    "adagrad": (lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
                lambda **kw: tfclip.compat.v1.AdagradOptimizer(0.1, **kw)),
    "adadelta": (lambda: tf.compat.v1.train.AdadeltaOptimizer(1.0, epsilon=1e-6),
                 lambda **kw: tfclip.compat.v1.AdadeltaOptimizer(1.0, epsilon=1e-6, **kw)),
    "ftrl": (lambda: tf.compat.v1.train.FtrlOptimizer(0.2, l1_regularization_strength=0.01,
                                                     l2_shrinkage_regularization_strength=0.03, beta=0.1),
             lambda **kw: tfclip.compat.v1.FtrlOptimizer(0.2, l1_regularization_strength=0.01,
                                                        l2_shrinkage_regularization_strength=0.03, beta=0.1, **kw)),
    "proximal_gd": (lambda: tf.compat.v1.train.ProximalGradientDescentOptimizer(
                        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.2),
                    lambda **kw: tfclip.compat.v1.ProximalGradientDescentOptimizer(
                        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.2, **kw)),
    "proximal_adagrad": (lambda: tf.compat.v1.train.ProximalAdagradOptimizer(
                             0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.2),
                         lambda **kw: tfclip.compat.v1.ProximalAdagradOptimizer(
                             0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.2, **kw)),
    # (a global step of 4: the op is given t = 5 every step, as no apply advances it here)
    "adagrad_da": (lambda: tf.compat.v1.train.AdagradDAOptimizer(
                       0.1, tf.Variable(4, dtype=tf.int64), l1_regularization_strength=0.01,
                       l2_regularization_strength=0.2),
                   lambda **kw: tfclip.compat.v1.AdagradDAOptimizer(
                       0.1, tf.Variable(4, dtype=tf.int64), l1_regularization_strength=0.01,
                       l2_regularization_strength=0.2, **kw)),
}


@pytest.mark.parametrize("name", list(V1))
def test_compat_v1_matches_stock_tf1_on_indexed_slices(name):
    """Stock TF1 classes apply IndexedSlices with their sparse kernels (Momentum, RMSProp and
    Adagrad lazily, Adam on every row, duplicates summed first); tfclip matches them."""
    stock_make, fused_make = V1[name]
    idx_seq = [[1, 8, 1], [8], [0, 3, 3]]
    results = []
    for make in (stock_make, lambda: fused_make(global_clipnorm=1e9)):
        rng = np.random.default_rng(6)
        emb = tf.Variable(rng.normal(size=(ROWS, WIDTH)).astype("float32"))
        opt = make()
        for idx in idx_seq:
            opt.apply_gradients([(slices(rng, idx), emb)])
        results.append(emb.numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_compat_v1_session_minimize_embedding_lookup():
    """A TF1 graph: embedding_lookup gives IndexedSlices through compute_gradients; minimize runs."""
    with tf.Graph().as_default():
        tf.compat.v1.enable_resource_variables()
        table = tf.compat.v1.get_variable("table", initializer=np.ones((ROWS, WIDTH), "float32"))
        ids = tf.constant([2, 2, 5])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) ** 2)
        opt = tfclip.compat.v1.GradientDescentOptimizer(0.1, global_clipnorm=1e9)
        (g, _), = opt.compute_gradients(loss, var_list=[table])
        assert isinstance(g, tf.IndexedSlices)
        train = opt.minimize(loss, var_list=[table])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            got = sess.run(table)
    want = np.ones((ROWS, WIDTH), "float32")
    want[2] -= 0.1 * 2 * 2  # d/dx of x^2 twice, scattered
    want[5] -= 0.1 * 2
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ---------------------------------------------------------------- forms and errors
def test_fused_clip_by_global_norm_keeps_indexed_slices():
    rng = np.random.default_rng(7)
    sl = slices(rng, [1, 1, 4])
    d = tf.constant(rng.normal(size=(3,)).astype("float32"))
    got, norm = tfclip.fused_clip_by_global_norm([sl, d], 0.5)
    want, want_norm = tf.clip_by_global_norm([sl, d], 0.5)
    assert isinstance(got[0], tf.IndexedSlices)
    np.testing.assert_array_equal(got[0].indices.numpy(), sl.indices.numpy())
    np.testing.assert_allclose(got[0].values.numpy(), want[0].values.numpy(), rtol=1e-6)
    np.testing.assert_allclose(float(norm), float(want_norm), rtol=1e-6)


def test_half_precision_values_on_float32_table():
    rng = np.random.default_rng(8)
    sl = slices(rng, [0, 2, 0], dtype=np.float16)
    emb = tf.Variable(np.zeros((ROWS, WIDTH), "float32"))
    tfclip.fused_clip_apply([(sl, emb)], tfclip.rules.SGD(1.0))
    g, _ = densify_sums(sl.values.numpy(), [0, 2, 0], ROWS)
    np.testing.assert_allclose(emb.numpy(), -g, rtol=1e-3)


def test_int64_and_int32_indices_agree():
    rng = np.random.default_rng(9)
    vals = rng.normal(size=(3, WIDTH)).astype("float32")
    out = []
    for dt in (tf.int32, tf.int64):
        emb = tf.Variable(np.ones((ROWS, WIDTH), "float32"))
        rule = tfclip.rules.Adam(0.1)
        tfclip.fused_clip_apply([(tf.IndexedSlices(tf.constant(vals), tf.constant([3, 0, 3], dt)), emb)], rule)
        out.append(emb.numpy())
    np.testing.assert_array_equal(out[0], out[1])


def test_empty_indexed_slices_decays_slots_only():
    emb = tf.Variable(np.ones((ROWS, WIDTH), "float32"))
    rule = tfclip.rules.SGD(0.1, momentum=0.5)
    rule.slots(emb)["momentum"].assign(np.ones((ROWS, WIDTH), "float32"))
    empty = tf.IndexedSlices(tf.zeros([0, WIDTH]), tf.zeros([0], tf.int64))
    tfclip.fused_clip_apply([(empty, emb)], rule)
    np.testing.assert_allclose(rule.slots(emb)["momentum"].numpy(), 0.5)
    np.testing.assert_allclose(emb.numpy(), 1.5)


@pytest.mark.parametrize("bad", [-1, ROWS, 10**9], ids=["negative", "rows", "huge"])
@pytest.mark.parametrize("make", [lambda: tfclip.rules.SGD(0.1), lambda: tfclip.rules.Adam(0.1)], ids=["sgd", "adam"])
def test_out_of_range_index_is_an_error_and_writes_nothing(bad, make):
    rng = np.random.default_rng(10)
    rule = make()
    dense = tf.Variable(np.ones(3, "float32"))
    emb = tf.Variable(np.ones((ROWS, WIDTH), "float32"))
    tfclip.fused_clip_apply([(tf.ones(3), dense), (slices(rng, [1]), emb)], rule)  # slots exist
    before = [v.numpy().copy() for v in [dense, emb] + rule.variables]
    sl = tf.IndexedSlices(tf.ones([2, WIDTH]), tf.constant([0, bad], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"grads\[1\] \(IndexedSlices\): indices\[1\] = {bad} is out of range"):
        tfclip.fused_clip_apply([(tf.ones(3), dense), (sl, emb)], rule)
    for b, v in zip(before, [dense, emb] + rule.variables):
        np.testing.assert_array_equal(v.numpy(), b)


def test_out_of_range_index_in_keras_optimizer_writes_nothing():
    emb = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
    opt = tfclip.keras.Adam(0.1)
    opt.build([emb])
    sl = tf.IndexedSlices(tf.ones([1, WIDTH]), tf.constant([ROWS]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        opt.apply_gradients([(sl, emb)])
    np.testing.assert_array_equal(emb.numpy(), 1.0)
    assert all(np.all(v.numpy() == 0) for v in opt.variables if "emb" in v.path or "variable" in v.path)


@pytest.mark.parametrize("values,indices,var_shape,match", [
    (np.ones((2, 4), "float32"), [0, 1], (ROWS, WIDTH), r"values of shape \(2, 4\) do not fit"),
    (np.ones((2, WIDTH), "float32"), [[0], [1]], (ROWS, WIDTH), "indices must be a vector"),
    (np.ones((2,), "float32"), [0, 1], (), "scalar variable"),
    (np.ones((2, WIDTH), "float32"), np.array([0, 1], "float32"), (ROWS, WIDTH), "int32 or int64"),
], ids=["row_shape", "indices_rank", "scalar_var", "float_indices"])
def test_bad_indexed_slices_are_named(values, indices, var_shape, match):
    var = tf.Variable(np.ones(var_shape, "float32"))
    sl = tf.IndexedSlices(tf.constant(values), tf.constant(indices))
    with pytest.raises((ValueError, TypeError), match=match):
        tfclip.fused_clip_apply([(sl, var)], tfclip.rules.SGD(0.1))
    np.testing.assert_array_equal(var.numpy(), 1.0)


def test_op_checks_value_rows_in_a_function_without_static_shapes():
    """Shapes unknown when traced: the op itself names the mismatch, nothing written."""
    var = tf.Variable(np.ones((ROWS, WIDTH), "float32"))
    rule = tfclip.rules.SGD(0.1)

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32), tf.TensorSpec(None, tf.int32)])
    def step(v, i):
        return tfclip.fused_clip_apply([(tf.IndexedSlices(v, i), var)], rule).applied

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"values have shape \[3,5\]; with 2 indices"):
        step(tf.ones([3, WIDTH]), tf.constant([0, 1]))
    np.testing.assert_array_equal(var.numpy(), 1.0)


def test_core_module_sparse_matches_tf_op():
    """tfclip._core (the GPU hosts' entry point) runs the same sparse pass as the TF op."""
    from tfclip import _core as core

    rng = np.random.default_rng(11)
    w0 = rng.normal(size=(ROWS, WIDTH)).astype("float32")
    vals = rng.normal(size=(4, WIDTH)).astype("float32")
    idx = np.array([5, 1, 5, 5], np.int32)
    d0, gd = rng.normal(size=(3,)).astype("float32"), rng.normal(size=(3,)).astype("float32")
    for lazy in (False, True):
        emb, dense = tf.Variable(w0), tf.Variable(d0)
        rule = tfclip.rules.Adam(0.1, weight_decay=0.01)
        tfclip.fused_clip_apply([(tf.IndexedSlices(tf.constant(vals), tf.constant(idx)), emb),
                                 (tf.constant(gd), dense)], rule, global_clipnorm=1.0, lazy_sparse=lazy)
        w, d = w0.copy(), d0.copy()
        slots = [[np.zeros_like(w), np.zeros_like(d)], [np.zeros_like(w), np.zeros_like(d)]]
        norm, applied = core.clip_apply("adam", [w, d], [vals, gd], slots,
                                        {"lr": 0.1, "weight_decay": 0.01, "step": 1}, "global_norm",
                                        1.0, indices=[idx, None], lazy=lazy)
        assert norm == pytest.approx(np.sqrt(np.sum(vals.astype(np.float64) ** 2) + np.sum(gd.astype(np.float64) ** 2)))
        assert applied
        np.testing.assert_array_equal(w, emb.numpy())
        np.testing.assert_array_equal(d, dense.numpy())
        np.testing.assert_array_equal(slots[1][0], rule.slots(emb)["v"].numpy())
    with pytest.raises(ValueError, match=r"indices\[1\] = 12 is out of range"):
        core.clip_apply("sgd", [w], [vals[:2]], [], {"lr": 0.1}, indices=[np.array([0, 12])])
