"""tfclip.compat.v1 optimizers against tf.compat.v1.train.* with tf.clip_by_global_norm between
compute_gradients and apply_gradients, in a TF1 graph with a Session (the code in
shared/user-questions)."""
import re

import numpy as np
import pytest
import tensorflow as tf

import tfclip

MAKERS = {
    "gd": lambda m, kw: m.GradientDescentOptimizer(0.1, **kw),
    "momentum": lambda m, kw: m.MomentumOptimizer(0.1, 0.9, use_nesterov=True, **kw),
    "adam": lambda m, kw: m.AdamOptimizer(0.05, **kw),
    "rmsprop_momentum": lambda m, kw: m.RMSPropOptimizer(0.05, momentum=0.5, **kw),
    "rmsprop_centered": lambda m, kw: m.RMSPropOptimizer(0.05, decay=0.8, centered=True, **kw),
    "adagrad": lambda m, kw: m.AdagradOptimizer(0.1, initial_accumulator_value=0.2, **kw),
    "adadelta": lambda m, kw: m.AdadeltaOptimizer(1.0, rho=0.9, epsilon=1e-6, **kw),
    "ftrl": lambda m, kw: m.FtrlOptimizer(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                          l2_shrinkage_regularization_strength=0.03, beta=0.1, **kw),
    "ftrl_power": lambda m, kw: m.FtrlOptimizer(0.2, learning_rate_power=-0.7, initial_accumulator_value=0.3,
                                                accum_name="acc", linear_name="lin", **kw),
    "proximal_gd": lambda m, kw: m.ProximalGradientDescentOptimizer(
        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.05, **kw),
    "proximal_adagrad": lambda m, kw: m.ProximalAdagradOptimizer(
        0.1, initial_accumulator_value=0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.05, **kw),
    # AdagradDA reads the graph's global step (the stock class requires one).
    "adagrad_da": lambda m, kw: m.AdagradDAOptimizer(
        0.1, tf.compat.v1.train.get_or_create_global_step(), initial_gradient_squared_accumulator_value=0.2,
        l1_regularization_strength=0.01, l2_regularization_strength=0.05, **kw),
}


def run(make, fused, use_minimize, steps=6):
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)).astype("float32"))
        w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 3), "float32"), use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=np.zeros(3, "float32"), use_resource=True)
        frozen = tf.compat.v1.get_variable("f", initializer=np.ones(3, "float32"), use_resource=True)
        outside = tf.compat.v1.get_variable("o", initializer=np.ones(3, "float32"), use_resource=True)
        loss = tf.reduce_sum((tf.matmul(x, w) + b + tf.stop_gradient(frozen) + outside) ** 2)
        gs = tf.compat.v1.train.get_or_create_global_step()
        var_list = [w, b, frozen]  # `outside` is not in var_list
        if fused:
            opt = make(tfclip.compat.v1, {"global_clipnorm": 1.0})
            if use_minimize:
                train = opt.minimize(loss, global_step=gs, var_list=var_list)
            else:
                train = opt.apply_gradients(opt.compute_gradients(loss, var_list=var_list), global_step=gs)
            norm = opt.global_norm()
        else:
            opt = make(tf.compat.v1.train, {})
            gv = [(gr, v) for gr, v in opt.compute_gradients(loss, var_list=var_list) if gr is not None]
            clipped, norm = tf.clip_by_global_norm([gr for gr, _ in gv], 1.0)
            train = opt.apply_gradients(zip(clipped, [v for _, v in gv]), global_step=gs)
        norms = []
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                if fused:
                    s.run(train)
                    norms.append(s.run(norm))
                else:
                    norms.append(s.run([train, norm])[1])
            return s.run([w, b, frozen, outside, gs]), norms


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("use_minimize", [True, False])
def test_matches_stock_with_clip_by_global_norm(name, use_minimize):
    (fw, fb, ff, fo, fgs), fnorms = run(MAKERS[name], True, use_minimize)
    (sw, sb, sf, so, sgs), snorms = run(MAKERS[name], False, use_minimize)
    np.testing.assert_allclose(fw, sw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fb, sb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fnorms, snorms, rtol=1e-5)
    np.testing.assert_array_equal(ff, np.ones(3))  # behind tf.stop_gradient
    np.testing.assert_array_equal(fo, np.ones(3))  # outside var_list
    assert fgs == sgs == 6


def test_slots_have_stock_names():
    v = tf.Variable(np.ones(3, "float32"))
    opt = tfclip.compat.v1.AdamOptimizer(0.1, clipvalue=0.5)
    opt.apply_gradients([(tf.constant([1.0, 2.0, -3.0]), v)])  # eager works too
    assert sorted(opt.get_slot_names()) == ["m", "v"]
    np.testing.assert_allclose(opt.get_slot(v, "m").numpy(), 0.1 * np.array([0.5, 0.5, -0.5]), rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"global_clipnorm": -1.0}, "global_clipnorm must be a finite number >= 0"),
    ({"clipnorm": 1.0, "clipvalue": 1.0}, "at most one"),
    ({"nonfinite": "nope"}, "nonfinite must be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfclip.compat.v1.GradientDescentOptimizer(0.1, **kwargs)


def test_no_gradients_is_an_error_naming_the_variables():
    v = tf.Variable(1.0, name="lonely")
    with pytest.raises(ValueError, match="No gradients provided for any variable.*lonely"):
        tfclip.compat.v1.GradientDescentOptimizer(0.1).apply_gradients([(None, v)])


# ------------------------------------------------------------------ drop-in state and Saver
def build(module, name, clip=None):
    """A TF1 graph: two variables, a loss, the optimizer's train op and a Saver of all globals."""
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.random.default_rng(1).normal(size=(8, 4)).astype("float32"))
        w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 3), "float32"), use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=np.zeros(3, "float32"), use_resource=True)
        loss = tf.reduce_sum((tf.matmul(x, w) + b) ** 2)
        gs = tf.compat.v1.train.get_or_create_global_step()
        opt = MAKERS[name](module, {} if clip is None else {"global_clipnorm": clip})
        train = opt.minimize(loss, global_step=gs)
        saver = tf.compat.v1.train.Saver()
        init = tf.compat.v1.global_variables_initializer()
    return g, opt, train, saver, init, [w, b]


@pytest.mark.parametrize("name", list(MAKERS))
def test_variables_and_saved_keys_equal_the_stock_class(name):
    lists = []
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        g, opt, _, saver, _, _ = build(module, name)
        with g.as_default():
            lists.append(([(v.name, v.shape.as_list(), v.dtype) for v in opt.variables()],
                          sorted(v.name for v in tf.compat.v1.global_variables()),
                          sorted(saver._var_list) if isinstance(saver._var_list, dict) else None))
    assert lists[1] == lists[0]


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("direction", ["stock_to_tfclip", "tfclip_to_stock"])
def test_saver_checkpoints_restore_across_stock_and_tfclip(tmp_path, name, direction):
    src, dst = ((tf.compat.v1.train, tfclip.compat.v1) if direction == "stock_to_tfclip"
                else (tfclip.compat.v1, tf.compat.v1.train))
    path = str(tmp_path / "model.ckpt")
    g, _, train, saver, init, vs = build(src, name)
    with g.as_default(), tf.compat.v1.Session() as s:
        s.run(init)
        for _ in range(3):
            s.run(train)
        saver.save(s, path)
        for _ in range(3):
            s.run(train)
        want = s.run(vs + [tf.compat.v1.train.get_global_step()])
    g, opt, train, saver, _, vs = build(dst, name)
    with g.as_default(), tf.compat.v1.Session() as s:
        saver.restore(s, path)  # every variable the graph saves is in the checkpoint
        s.run(tf.compat.v1.local_variables_initializer())
        for _ in range(3):
            s.run(train)
        got = s.run(vs + [tf.compat.v1.train.get_global_step()])
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert got[-1] == 6


def test_initializing_only_the_model_variables_is_enough_for_gradient_descent():
    g, opt, train, _, _, vs = build(tfclip.compat.v1, "gd", clip=1.0)
    with g.as_default(), tf.compat.v1.Session() as s:
        s.run(tf.compat.v1.variables_initializer(vs + [tf.compat.v1.train.get_global_step()]))
        s.run(train)
        assert s.run(opt.global_norm()) > 1.0  # written by the step, never initialized
        assert opt.global_norm() not in tf.compat.v1.global_variables()


def test_adam_beta2_of_one_and_beta_powers_follow_stock():
    out = []
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        v = tf.Variable([1.0, -2.0])
        opt = module.AdamOptimizer(0.1, beta2=1.0)
        for _ in range(2):
            opt.apply_gradients([(tf.constant([0.5, 0.25]), v)])
        out.append((v.numpy(), [p.numpy() for p in opt._get_beta_accumulators()]
                    if module is tf.compat.v1.train else [p.numpy() for p in opt._beta_powers()]))
    np.testing.assert_array_equal(out[1][0], out[0][0])
    np.testing.assert_array_equal(out[1][1], out[0][1])


def test_skipped_step_leaves_adam_beta_powers_alone():
    v = tf.Variable([1.0, -2.0])
    opt = tfclip.compat.v1.AdamOptimizer(0.1)
    opt.apply_gradients([(tf.constant([0.5, 0.25]), v)])
    before = [p.numpy() for p in opt._beta_powers()] + [v.numpy()]
    opt.apply_gradients([(tf.constant([np.nan, 0.25]), v)])
    after = [p.numpy() for p in opt._beta_powers()] + [v.numpy()]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("name", ["gd", "momentum", "adam", "rmsprop_centered"])
def test_tensor_norms_in_a_session(name):
    """opt.tensor_norms(): each pair's pre-clip gradient norm, against NumPy on the gradients
    fetched at the same weights; 0 for the stop_gradient pair; the global norm is their 2-norm.
    A local variable written by the step (only the global variables are initialized here)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.random.default_rng(1).normal(size=(8, 4)).astype("float32"))
        w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 3), "float32"), use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=np.full(3, 0.5, "float32"), use_resource=True)
        frozen = tf.compat.v1.get_variable("f", initializer=np.ones(3, "float32"), use_resource=True)
        loss = tf.reduce_sum((tf.matmul(x, w) + b + tf.stop_gradient(frozen)) ** 2)
        opt = MAKERS[name](tfclip.compat.v1, {"global_clipnorm": 1.0})
        assert opt.tensor_norms() is None
        gv = opt.compute_gradients(loss, var_list=[w, b, frozen])
        assert gv[2][0] is None
        grads = [gr for gr, _ in gv[:2]]
        train = opt.apply_gradients(gv)
        tn = opt.tensor_norms()
        assert opt.tensor_norm_names() == [w.name, b.name, frozen.name]
        assert tn in tf.compat.v1.local_variables() and tn not in tf.compat.v1.global_variables()
        assert tn not in opt.variables()
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for _ in range(3):
                gw, gb = s.run(grads)
                s.run(train)
                want = [np.linalg.norm(gw.astype(np.float64)), np.linalg.norm(gb.astype(np.float64)), 0.0]
                np.testing.assert_allclose(s.run(tn), want, rtol=1e-6)
                np.testing.assert_allclose(s.run(opt.global_norm()), np.linalg.norm(want), rtol=1e-6)
            before = s.run(w)
            s.run(tn)  # reading the norms runs no step
            np.testing.assert_array_equal(s.run(w), before)


def test_tensor_norms_name_the_nonfinite_gradient_of_a_skipped_step():
    g = tf.Graph()
    with g.as_default():
        y = tf.compat.v1.placeholder(tf.float32, [3])
        w = tf.compat.v1.get_variable("w", initializer=np.ones(3, "float32"), use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=np.zeros(3, "float32"), use_resource=True)
        loss = tf.reduce_sum(w ** 2) + tf.reduce_sum((b - y) ** 2)
        opt = tfclip.compat.v1.AdamOptimizer(0.1, global_clipnorm=1.0)
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(train, {y: [np.nan, 1.0, 1.0]})
            tn = s.run(opt.tensor_norms())
            np.testing.assert_allclose(tn[0], 2 * np.sqrt(3), rtol=1e-6)  # d/dw sum(w^2) = 2w
            assert np.isnan(tn[1])
            np.testing.assert_array_equal(s.run([w, b]), [np.ones(3), np.zeros(3)])  # skipped


def test_tensor_norms_eagerly_and_per_var_list():
    v1, v2 = tf.Variable([3.0, 4.0]), tf.Variable([1.0])
    opt = tfclip.compat.v1.GradientDescentOptimizer(0.1, global_clipnorm=100.0)
    opt.apply_gradients([(tf.constant([0.6, 0.8]), v1), (None, v2)])
    np.testing.assert_allclose(opt.tensor_norms().numpy(), [1.0, 0.0], rtol=1e-6)
    first = opt.tensor_norms()
    opt.apply_gradients([(tf.constant([2.0]), v2)])  # another list: its own variable
    np.testing.assert_allclose(opt.tensor_norms().numpy(), [2.0], rtol=1e-6)
    assert opt.tensor_norm_names() == [v2.name]
    np.testing.assert_allclose(first.numpy(), [1.0, 0.0], rtol=1e-6)  # left as it was


@pytest.mark.parametrize("name", list(MAKERS))
def test_graph_collections_equal_the_stock_class(name):
    """Everything a stock TF1 optimizer leaves in the graph besides the update: every collection
    holds what the stock class's holds (by name; the train op joins GraphKeys.TRAIN_OP, where a
    re-imported meta-graph finds it). tfclip's own extras are local variables (its norms), so
    LOCAL_VARIABLES is compared without them."""
    found = []
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        g, opt, train, _, _, _ = build(module, name)
        with g.as_default():
            extras = {v.name for v in g.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
                      if re.search(r"_tfclip(_\d+)?/", v.name)}
            collections = {}
            for key in g.get_all_collection_keys():
                items = [getattr(x, "name", str(x)) for x in g.get_collection(key)]
                collections[key] = [n for n in items if n not in extras]
            assert g.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP) == [train]
            found.append({k: v for k, v in collections.items() if v})
    stock, ours = found
    assert set(ours) == set(stock), (sorted(ours), sorted(stock))
    for key in stock:
        assert len(ours[key]) == len(stock[key]), key
        if key != tf.compat.v1.GraphKeys.TRAIN_OP:  # (the train op's name is the op's own)
            assert ours[key] == stock[key], key


def test_train_op_is_found_after_a_meta_graph_round_trip(tmp_path):
    """The TF1 language-model pattern: export the meta-graph, import it into a new graph, take the
    train op from the collection, and train with it."""
    g, opt, train, saver, init, _ = build(tfclip.compat.v1, "adam", clip=1.0)
    with g.as_default(), tf.compat.v1.Session() as s:
        s.run(init)
        saver.save(s, str(tmp_path / "m"))
    g2 = tf.Graph()
    with g2.as_default(), tf.compat.v1.Session() as s:
        restored = tf.compat.v1.train.import_meta_graph(str(tmp_path / "m.meta"))
        restored.restore(s, str(tmp_path / "m"))
        s.run(tf.compat.v1.local_variables_initializer())
        train_op = tf.compat.v1.get_collection_ref("train_op")[0]
        step = tf.compat.v1.train.get_global_step()
        before = s.run(step)
        s.run(train_op)
        assert s.run(step) == before + 1


def test_adam_beta_accumulators_are_the_stock_pair():
    """AdamOptimizer._get_beta_accumulators(): the stock pair, beta^t after t steps."""
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        g, opt, train, _, init, _ = build(module, "adam")
        with g.as_default(), tf.compat.v1.Session() as s:
            s.run(init)
            for _ in range(3):
                s.run(train)
            b1, b2 = opt._get_beta_accumulators()
            assert [b1.op.name, b2.op.name] == ["beta1_power", "beta2_power"]
            np.testing.assert_allclose(s.run([b1, b2]), [0.9 ** 4, 0.999 ** 4], rtol=1e-6)


# ------------------------------------------- ProximalGradientDescent, ProximalAdagrad, AdagradDA
# Step for step against the stock classes: a TF1 graph with a Session (resource variables), and
# eagerly; dense and IndexedSlices gradients (duplicate rows); float32 and float64; with a global
# norm clip (the stock side: tf.clip_by_global_norm between compute and apply) and without.
# The hyper-parameters are given to both as tensors of the variables' dtype: the stock proximal
# classes pass Python numbers to their ops as float32 (a float64 variable fails there), and stock
# AdagradDA rounds them to float32 before casting.
PROX = {
    "proximal_gd": ("ProximalGradientDescentOptimizer", lambda c, gs: dict(
        learning_rate=c(0.1), l1_regularization_strength=c(0.02), l2_regularization_strength=c(0.3))),
    "proximal_gd_l2": ("ProximalGradientDescentOptimizer", lambda c, gs: dict(
        learning_rate=c(0.1), l1_regularization_strength=c(0.0), l2_regularization_strength=c(0.3))),
    "proximal_adagrad": ("ProximalAdagradOptimizer", lambda c, gs: dict(
        learning_rate=c(0.2), initial_accumulator_value=0.3, l1_regularization_strength=c(0.02),
        l2_regularization_strength=c(0.1))),
    "proximal_adagrad_plain": ("ProximalAdagradOptimizer", lambda c, gs: dict(
        learning_rate=c(0.2), l1_regularization_strength=c(0.0), l2_regularization_strength=c(0.0))),
    "adagrad_da": ("AdagradDAOptimizer", lambda c, gs: dict(
        learning_rate=c(0.2), global_step=gs, initial_gradient_squared_accumulator_value=0.3,
        l1_regularization_strength=c(0.05), l2_regularization_strength=c(0.1))),
    "adagrad_da_l2": ("AdagradDAOptimizer", lambda c, gs: dict(
        learning_rate=c(0.2), global_step=gs, l2_regularization_strength=c(0.1))),
}
PROX_STEPS = 5
ROWS, WIDTH = 7, 3
SPARSE_IDX = [[1, 4, 1], [6], [0, 4, 4, 4], [2, 1], [5, 5]]


def prox_grads(dtype, sparse):
    """Per step: a dense gradient of the table's shape, or IndexedSlices with duplicate rows."""
    rng = np.random.default_rng(21)
    out = []
    for idx in SPARSE_IDX[:PROX_STEPS]:
        if sparse:
            out.append((rng.normal(size=(len(idx), WIDTH)).astype(dtype), np.array(idx, np.int64)))
        else:
            out.append((rng.normal(size=(ROWS, WIDTH)).astype(dtype), None))
    return out


def prox_session(name, fused, dtype, sparse, clip):
    """Every step's variables (and the global step after it), in a TF1 graph with a Session."""
    cls, kwargs = PROX[name]
    steps = prox_grads(dtype, sparse)
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.enable_resource_variables()
        init = np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype(dtype)
        table = tf.compat.v1.get_variable("table", initializer=init, use_resource=True)
        bias = tf.compat.v1.get_variable("bias", initializer=np.full(WIDTH, 0.5, dtype), use_resource=True)
        gs = tf.compat.v1.train.get_or_create_global_step()
        values = tf.compat.v1.placeholder(dtype, [None, WIDTH])
        idx = tf.compat.v1.placeholder(tf.int64, [None])
        gt = tf.IndexedSlices(values, idx, tf.constant([ROWS, WIDTH], tf.int64)) if sparse else values
        gb = tf.reduce_sum(values, 0)
        c = lambda x: tf.constant(x, dtype)
        module = tfclip.compat.v1 if fused else tf.compat.v1.train
        opt = getattr(module, cls)(**kwargs(c, gs), **({"global_clipnorm": clip} if fused and clip else {}))
        pairs = [(gt, table), (gb, bias)]
        if clip and not fused:
            clipped, _ = tf.clip_by_global_norm([gt, gb], clip)
            pairs = list(zip(clipped, [table, bias]))
        train = opt.apply_gradients(pairs, global_step=gs)
        out = []
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for vals, rows in steps:
                s.run(train, {values: vals, idx: rows if sparse else np.zeros(0, np.int64)})
                out.append(s.run([table, bias, gs]))
            slots = {n: s.run(opt.get_slot(table, n)) for n in opt.get_slot_names()}
    return out, slots


def prox_eager(name, fused, dtype, sparse, clip):
    cls, kwargs = PROX[name]
    steps = prox_grads(dtype, sparse)
    table = tf.Variable(np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype(dtype))
    gs = tf.Variable(0, dtype=tf.int64)
    module = tfclip.compat.v1 if fused else tf.compat.v1.train
    opt = getattr(module, cls)(**kwargs(lambda x: tf.constant(x, dtype), gs),
                               **({"global_clipnorm": clip} if fused and clip else {}))
    out = []
    for vals, rows in steps:
        gt = (tf.IndexedSlices(tf.constant(vals), tf.constant(rows), tf.constant([ROWS, WIDTH], tf.int64))
              if sparse else tf.constant(vals))
        if clip and not fused:
            (gt,), _ = tf.clip_by_global_norm([gt], clip)
        opt.apply_gradients([(gt, table)], global_step=gs)
        out.append([table.numpy(), gs.numpy()])
    return out, {n: opt.get_slot(table, n).numpy() for n in opt.get_slot_names()}


def _tol(dtype):
    # float32: TF's rsqrt (Eigen's fast one) against a division by sqrt, an ulp or two a step;
    # float64: the same operations in the same order.
    return dict(rtol=2e-6, atol=1e-7) if dtype == "float32" else dict(rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", list(PROX))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
@pytest.mark.parametrize("clip", [None, 1.5], ids=["noclip", "clip"])
def test_new_tf1_optimizers_match_stock_step_for_step_in_a_session(name, dtype, sparse, clip):
    got, got_slots = prox_session(name, True, dtype, sparse, clip)
    want, want_slots = prox_session(name, False, dtype, sparse, clip)
    for k, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, err_msg=f"step {k + 1}", **_tol(dtype))
        assert a[2] == b[2] == k + 1  # the global step, advanced once per step
    assert sorted(got_slots) == sorted(want_slots)
    for n in want_slots:
        np.testing.assert_allclose(got_slots[n], want_slots[n], **_tol(dtype))
    if sparse:  # rows no slice touched are left alone (TF's sparse kernels: lazy)
        untouched = sorted(set(range(ROWS)) - {r for idx in SPARSE_IDX for r in idx})
        init = np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype(dtype)
        np.testing.assert_array_equal(got[-1][0][untouched], init[untouched])


@pytest.mark.parametrize("name", ["proximal_gd", "proximal_adagrad", "adagrad_da"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
@pytest.mark.parametrize("clip", [None, 0.8], ids=["noclip", "clip"])
def test_new_tf1_optimizers_match_stock_step_for_step_eagerly(name, dtype, sparse, clip):
    got, got_slots = prox_eager(name, True, dtype, sparse, clip)
    want, want_slots = prox_eager(name, False, dtype, sparse, clip)
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a[0], b[0], err_msg=f"step {k + 1}", **_tol(dtype))
        assert a[1] == b[1] == k + 1
    for n in want_slots:
        np.testing.assert_allclose(got_slots[n], want_slots[n], **_tol(dtype))


@pytest.mark.parametrize("name,rule", [("proximal_gd", "proximal_gradient_descent"),
                                       ("proximal_adagrad", "proximal_adagrad"), ("adagrad_da", "adagrad_da")])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
def test_new_tf1_optimizers_against_numpy_float64(name, rule, sparse):
    """The update itself, from the papers' formulas in float64 NumPy (tests/reference.py): FOBOS
    with a fixed step and with Adagrad's step, and dual averaging at global step t (the stock class
    gives global_step + 1). IndexedSlices: a row's duplicates summed, untouched rows left alone."""
    import reference

    cls, kwargs = PROX[name]
    kw = kwargs(float, tf.Variable(0, dtype=tf.int64))
    steps = prox_grads("float64", sparse)
    init = np.random.default_rng(3).normal(size=(ROWS, WIDTH))
    table = tf.Variable(init)
    opt = getattr(tfclip.compat.v1, cls)(**kw)
    gs = kw.get("global_step", tf.Variable(0, dtype=tf.int64))
    hp = {"learning_rate": kw["learning_rate"], "l1": kw.get("l1_regularization_strength", 0.0),
          "l2": kw.get("l2_regularization_strength", 0.0)}
    first = kw.get("initial_accumulator_value", kw.get("initial_gradient_squared_accumulator_value"))
    # The slots as the stock classes start them: ProximalAdagrad's accumulator, AdagradDA's
    # gradient sum (zeros) and its squared one.
    slots = [[], [np.full((ROWS, WIDTH), first)],
             [np.zeros((ROWS, WIDTH)), np.full((ROWS, WIDTH), first)]][reference.num_slots(rule, {})]
    want = init.copy()
    for t, (vals, rows) in enumerate(steps, start=1):
        if sparse:
            g = np.zeros((ROWS, WIDTH))
            np.add.at(g, rows, vals)
            touched = sorted(set(rows))
        else:
            g, touched = vals, list(range(ROWS))
        sl = [x[touched] for x in slots]
        want[touched] = reference.step(rule, want[touched], sl, g[touched], {**hp, "global_step": float(t)}, t)
        for x, y in zip(slots, sl):
            x[touched] = y
        gt = tf.IndexedSlices(tf.constant(vals), tf.constant(rows), tf.constant([ROWS, WIDTH], tf.int64)) \
            if sparse else tf.constant(vals)
        opt.apply_gradients([(gt, table)], global_step=gs)
        np.testing.assert_allclose(table.numpy(), want, rtol=1e-12, atol=1e-14, err_msg=f"step {t}")
    for n, x in zip(opt.get_slot_names(), slots):
        np.testing.assert_allclose(opt.get_slot(table, n).numpy(), x, rtol=1e-12, atol=1e-14)


def test_new_tf1_optimizers_have_the_stock_slot_names():
    v = tf.Variable(np.ones(3, "float32"))
    gs = tf.Variable(0, dtype=tf.int64)
    for cls, args, slots in [("ProximalGradientDescentOptimizer", (0.1,), []),
                             ("ProximalAdagradOptimizer", (0.1,), ["accumulator"]),
                             ("AdagradDAOptimizer", (0.1, gs), ["gradient_accumulator",
                                                                "gradient_squared_accumulator"])]:
        for module in (tf.compat.v1.train, tfclip.compat.v1):
            opt = getattr(module, cls)(*args)
            opt.apply_gradients([(tf.constant([1.0, 2.0, -3.0]), v)])
            assert sorted(opt.get_slot_names()) == slots, (module, cls)
            assert [opt.get_slot(v, s).shape for s in slots] == [v.shape] * len(slots)


def test_adagrad_da_reads_the_global_step_when_the_step_runs():
    """The stock class feeds its op global_step + 1 as it is when the step runs (a global step set
    by hand, or advanced elsewhere, counts); so does tfclip's."""
    out = []
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        v = tf.Variable([0.5, -1.0, 2.0])
        gs = tf.Variable(0, dtype=tf.int64)
        opt = module.AdagradDAOptimizer(0.1, gs, l1_regularization_strength=0.05, l2_regularization_strength=0.2)
        opt.apply_gradients([(tf.constant([0.3, -0.2, 0.1]), v)])  # no global_step: t stays 1
        gs.assign(40)
        opt.apply_gradients([(tf.constant([0.3, -0.2, 0.1]), v)], global_step=gs)  # t = 41
        out.append((v.numpy(), gs.numpy()))
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-6)
    assert out[0][1] == out[1][1] == 41
    # At t = 41 the l1 threshold t * l1 = 2.05 exceeds |sum of g| = 0.6: every weight is 0.
    np.testing.assert_array_equal(out[1][0], np.zeros(3))


def test_adagrad_da_without_a_global_step_is_refused():
    with pytest.raises(ValueError, match="AdagradDAOptimizer needs global_step"):
        tfclip.compat.v1.AdagradDAOptimizer(0.1, None)
    # The stock class takes None and fails when the step is built.
    opt = tf.compat.v1.train.AdagradDAOptimizer(0.1, None)
    with pytest.raises(ValueError, match="None"):
        opt.apply_gradients([(tf.constant([1.0]), tf.Variable([1.0]))])


@pytest.mark.parametrize("cls,args,arg", [
    ("ProximalAdagradOptimizer", (0.1,), "initial_accumulator_value"),
    ("AdagradDAOptimizer", (0.1, tf.constant(0, tf.int64)), "initial_gradient_squared_accumulator_value"),
])
@pytest.mark.parametrize("value", [0.0, -0.5])
def test_initial_accumulator_checks_are_the_stock_ones(cls, args, arg, value):
    errors = []
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        with pytest.raises(ValueError) as e:
            getattr(module, cls)(*args, **{arg: value})
        errors.append(str(e.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("cls,args", [("ProximalGradientDescentOptimizer", (0.1,)),
                                      ("ProximalAdagradOptimizer", (0.1,)),
                                      ("AdagradDAOptimizer", (0.1, tf.constant(0, tf.int64)))])
@pytest.mark.parametrize("arg", ["l1_regularization_strength", "l2_regularization_strength"])
def test_negative_strengths_are_refused_naming_them_and_write_nothing(cls, args, arg):
    """A number at construction; a tensor when the step runs (the op, before it writes)."""
    with pytest.raises(ValueError, match=f"{arg} must be >= 0, got -0.1"):
        getattr(tfclip.compat.v1, cls)(*args, **{arg: -0.1})
    v = tf.Variable([1.0, -2.0])
    strength = tf.Variable(-0.1, dtype=tf.float64)
    opt = getattr(tfclip.compat.v1, cls)(*args, **{arg: strength})
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{arg} must be finite and in \[0, inf\], got -0.1"):
        opt.apply_gradients([(tf.constant([0.5, 0.5]), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, -2.0])
    for s in opt.get_slot_names():
        np.testing.assert_array_equal(opt.get_slot(v, s).numpy(), np.float32(opt._slot_initial(s)))


@pytest.mark.parametrize("lr", [0.0, -0.1])
def test_proximal_adagrad_refuses_a_learning_rate_the_stock_kernel_refuses(lr):
    """TF's ProximalAdagrad kernel refuses lr <= 0 when the step runs; tfclip refuses a number at
    construction and a tensor when the step runs, nothing written."""
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        tfclip.compat.v1.ProximalAdagradOptimizer(lr)
    for module in (tf.compat.v1.train, tfclip.compat.v1):
        v = tf.Variable([1.0, -2.0])
        rate = tf.Variable(lr)
        opt = module.ProximalAdagradOptimizer(rate if module is tfclip.compat.v1 else lr)
        with pytest.raises(tf.errors.InvalidArgumentError, match="lr is not a positive scalar|learning_rate must be > 0"):
            opt.apply_gradients([(tf.constant([0.5, 0.5]), v)])
        np.testing.assert_array_equal(v.numpy(), [1.0, -2.0])
        np.testing.assert_array_equal(opt.get_slot(v, "accumulator").numpy(), np.float32([0.1, 0.1]))
    # In a graph: the check runs before the op, which then writes nothing.
    g = tf.Graph()
    with g.as_default():
        v = tf.compat.v1.get_variable("v", initializer=[1.0, -2.0], use_resource=True)
        rate = tf.compat.v1.placeholder(tf.float32, [])
        train = tfclip.compat.v1.ProximalAdagradOptimizer(rate).minimize(tf.reduce_sum(v ** 2))
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be > 0"):
                s.run(train, {rate: lr})
            np.testing.assert_array_equal(s.run(v), [1.0, -2.0])
            s.run(train, {rate: 0.1})
            assert s.run(v)[0] < 1.0


def test_proximal_optimizers_take_python_numbers_with_float64_variables():
    """The stock proximal classes hand Python numbers to their ops as float32, so a float64
    variable fails there unless every hyper-parameter is a float64 tensor; tfclip takes the
    numbers (as float64) and gives what the stock class gives with float64 tensors."""
    for cls in ("ProximalGradientDescentOptimizer", "ProximalAdagradOptimizer"):
        v_stock = tf.Variable([1.0, -2.0], dtype=tf.float64)
        with pytest.raises(tf.errors.InvalidArgumentError, match="expected to be a float tensor"):
            getattr(tf.compat.v1.train, cls)(0.1, l1_regularization_strength=0.05).apply_gradients(
                [(tf.constant([0.5, 0.5], tf.float64), v_stock)])
        c = lambda x: tf.constant(x, tf.float64)
        getattr(tf.compat.v1.train, cls)(c(0.1), l1_regularization_strength=c(0.05),
                                         l2_regularization_strength=c(0.0)).apply_gradients(
            [(tf.constant([0.5, 0.5], tf.float64), v_stock)])
        v = tf.Variable([1.0, -2.0], dtype=tf.float64)
        getattr(tfclip.compat.v1, cls)(0.1, l1_regularization_strength=0.05).apply_gradients(
            [(tf.constant([0.5, 0.5], tf.float64), v)])
        np.testing.assert_array_equal(v.numpy(), v_stock.numpy())
