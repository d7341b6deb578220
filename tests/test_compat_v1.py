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
