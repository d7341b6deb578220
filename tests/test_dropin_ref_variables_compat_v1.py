"""tfclip.compat.v1 on TF1 ref variables (what `tf.disable_v2_behavior()` and
`use_resource=False` make: dtype float32_ref), against the stock tf.compat.v1.train classes,
which take them (ApplyAdam on a ref, ResourceApplyAdam on a handle), and against NumPy float64.

In-process tests build their own tf.Graph and ask for ref variables with use_resource=False; the
user's program runs as written, under tf.disable_v2_behavior(), in a subprocess (the switch is
process-wide)."""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfclip

# Where the tfclip these tests import lives (site-packages when installed, the checkout when built
# in place): the subprocesses must import the same one, not the checkout's unbuilt sources.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
v1 = tf.compat.v1

MAKERS = {
    "gd": lambda m, kw: m.GradientDescentOptimizer(0.1, **kw),
    "momentum": lambda m, kw: m.MomentumOptimizer(0.1, 0.9, **kw),
    "nesterov": lambda m, kw: m.MomentumOptimizer(0.1, 0.9, use_nesterov=True, **kw),
    "adam": lambda m, kw: m.AdamOptimizer(0.05, **kw),
    "rmsprop_momentum": lambda m, kw: m.RMSPropOptimizer(0.05, momentum=0.5, **kw),
    "rmsprop_centered": lambda m, kw: m.RMSPropOptimizer(0.05, decay=0.8, centered=True, **kw),
    "adagrad": lambda m, kw: m.AdagradOptimizer(0.1, initial_accumulator_value=0.2, **kw),
    "adadelta": lambda m, kw: m.AdadeltaOptimizer(1.0, rho=0.9, epsilon=1e-6, **kw),
    "ftrl": lambda m, kw: m.FtrlOptimizer(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                          l2_shrinkage_regularization_strength=0.03, beta=0.1, **kw),
}


def is_ref(v):
    return v.dtype._is_ref_dtype  # pylint: disable=protected-access


def ref_var(name, value, use_resource=False):
    return v1.get_variable(name, initializer=value, use_resource=use_resource)


def apply_ops(graph):
    return [op for op in graph.get_operations() if op.type.startswith("TfclipClipApply")]


# ------------------------------------------------------------------ the user's program
USER_PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    import tfclip

    def program(make_optimizer, clip):
        # The program of shared/user-questions/002 (tf.stop_gradient), as written, in its own
        # graph; `clip`: the stock class with tf.clip_by_global_norm between the two calls.
        g = tf.Graph()
        with g.as_default():
            tf.set_random_seed(7)
            w1 = tf.get_variable("w1", shape=[5, 1], initializer=tf.truncated_normal_initializer())
            w2 = tf.get_variable("w2", shape=[5, 1], initializer=tf.truncated_normal_initializer())
            w3 = tf.get_variable("w3", shape=[5, 1], initializer=tf.truncated_normal_initializer())
            x = tf.placeholder(tf.float32, shape=[None, 5], name="x")
            a1 = tf.matmul(x, w1)
            a2 = tf.matmul(x, w2*w3)
            a2 = tf.stop_gradient(a2)
            loss = tf.reduce_mean(tf.square(a1 - a2))
            optimizer = make_optimizer()
            gradients = optimizer.compute_gradients(loss)
            if clip:
                kept = [(gr, v) for gr, v in gradients if gr is not None]
                clipped, _ = tf.clip_by_global_norm([gr for gr, _ in kept], clip)
                gradients = list(zip(clipped, [v for _, v in kept]))
            train_op = optimizer.apply_gradients(gradients)
        kinds = [v.dtype.name for v in (w1, w2, w3)]
        ops = sorted({op.type for op in g.get_operations() if "Apply" in op.type})
        rng = np.random.default_rng(0)
        out = []
        with tf.Session(graph=g) as sess:
            sess.run(tf.global_variables_initializer())
            out.append(sess.run([w1, w2, w3]))
            for _ in range(20):
                feed = {x: rng.normal(size=(16, 5)).astype("float32") * 3}
                sess.run(train_op, feed)
                out.append(sess.run([w1, w2, w3]))
        return np.array(out), kinds, ops

    res = {}
    for key, make, clip in [
            ("stock", lambda: tf.train.GradientDescentOptimizer(learning_rate=0.1), None),
            ("tfclip", lambda: tfclip.compat.v1.GradientDescentOptimizer(learning_rate=0.1), None),
            ("stock_clip", lambda: tf.train.GradientDescentOptimizer(learning_rate=0.1), 0.5),
            ("tfclip_clip", lambda: tfclip.compat.v1.GradientDescentOptimizer(0.1, global_clipnorm=0.5), None)]:
        vals, kinds, ops = program(make, clip)
        res[key] = vals
        print(key, kinds, ops)
    np.savez(sys.argv[1], **res)
""")


def test_user_program_under_disable_v2_behavior_matches_stock(tmp_path):
    """The user-question program (w1 trained, w2 * w3 behind tf.stop_gradient) as written, under
    tf.disable_v2_behavior(): ref variables, the stock GradientDescentOptimizer against tfclip's,
    without and with a global-norm clip, the same weights after every step."""
    out = tmp_path / "out.npz"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run([sys.executable, "-c", USER_PROGRAM, str(out)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    for key in ("stock", "tfclip", "stock_clip", "tfclip_clip"):
        assert "['float32_ref', 'float32_ref', 'float32_ref']" in lines[key], lines[key]
    assert "ApplyGradientDescent" in lines["stock"]
    assert "TfclipClipApplyRefSgd" in lines["tfclip"] and "ApplyGradientDescent" not in lines["tfclip"]
    res = np.load(out)
    for fused, stock in (("tfclip", "stock"), ("tfclip_clip", "stock_clip")):
        np.testing.assert_array_equal(res[fused][0], res[stock][0])  # the same start
        np.testing.assert_allclose(res[fused], res[stock], rtol=1e-5, atol=1e-6)
        # w2 and w3 never move; w1 does, towards w2 * w3
        np.testing.assert_array_equal(res[fused][:, 1:], np.broadcast_to(res[fused][:1, 1:], res[fused][:, 1:].shape))
        assert not np.allclose(res[fused][-1, 0], res[fused][0, 0])
    # the clip changed the trajectory (the test would not tell the two apart otherwise)
    assert not np.allclose(res["tfclip_clip"][-1], res["tfclip"][-1], rtol=1e-3)


# ------------------------------------------------------------------ every class vs stock
ROWS, WIDTH = 7, 3


def run_model(make, fused, sparse, dtype, clip, steps=4, resource=(False, False)):
    """A graph with two variables (a table and a bias), ref unless `resource` says otherwise;
    `sparse`: the table is read through embedding_lookup (IndexedSlices gradients). Returns the
    values after every step, the slot values at the end, the slot kinds, the op types."""
    g = tf.Graph()
    with g.as_default():
        rng = np.random.default_rng(3)
        table = ref_var("table", rng.normal(size=(ROWS, WIDTH)).astype(dtype), resource[0])
        bias = ref_var("bias", rng.normal(size=(WIDTH,)).astype(dtype), resource[1])
        if sparse:
            ids = tf.constant([1, 4, 1, 6])  # a repeated row
            h = tf.nn.embedding_lookup(table, ids)
        else:
            h = tf.matmul(tf.constant(rng.normal(size=(5, ROWS)).astype(dtype)), table)
        loss = tf.reduce_sum((h + bias - 0.3) ** 2) + tf.reduce_sum(tf.sin(h))
        gs = v1.train.get_or_create_global_step()
        if fused:
            opt = make(tfclip.compat.v1, {} if clip is None else {"global_clipnorm": clip})
            train = opt.minimize(loss, global_step=gs)
        else:
            opt = make(v1.train, {})
            gv = opt.compute_gradients(loss)
            if clip is not None:
                clipped, _ = tf.clip_by_global_norm([gr for gr, _ in gv], clip)
                gv = list(zip(clipped, [v for _, v in gv]))
            train = opt.apply_gradients(gv, global_step=gs)
        if sparse:
            assert isinstance(opt.compute_gradients(loss)[0][0], tf.IndexedSlices)
        slots = [opt.get_slot(v, s) for v in (table, bias) for s in sorted(opt.get_slot_names())]
        kinds = [(s.op.name, is_ref(s)) for s in slots]
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            vals = []
            for _ in range(steps):
                s.run(train)
                vals.append(s.run([table, bias]))
            names = sorted(v.op.name for v in opt.variables())
            return vals, s.run(slots), kinds, s.run(gs), names, {op.type for op in g.get_operations()}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "slices"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_each_class_on_ref_variables_matches_stock(name, sparse, clip, dtype):
    fv, fs, fk, fgs, fnames, fops = run_model(MAKERS[name], True, sparse, dtype, clip)
    sv, ss, sk, sgs, snames, _ = run_model(MAKERS[name], False, sparse, dtype, clip)
    rv, rs, _, _, _, rops = run_model(MAKERS[name], True, sparse, dtype, clip, resource=(True, True))
    assert any(t.startswith("TfclipClipApplyRef") for t in fops), fops
    assert not any(t.startswith("TfclipClipApplyRef") for t in rops), rops
    assert fk == sk and all(k for _, k in fk), fk  # the stock slots, refs, by the stock names
    assert fnames == snames  # Adam's beta powers too
    assert fgs == sgs == 4
    # The same kernel arithmetic as on resource variables: the same bits.
    for a, b in zip(fv + [fs], rv + [rs]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # The stock class, to float rounding (the clip's scale and TF's kernels round differently;
    # Adam's m / sqrt(v) magnifies it where a gradient is near 0). In float64 too: the stock
    # class computes with its Python-number hyper-parameters rounded to float32 (its tensors are
    # float32, cast to the variable's dtype; Adam's beta powers are float32 variables), tfclip
    # with them in float64. (float64 precision itself: test_basic_ref_variables_against_numpy.)
    rtol, atol = (1e-4 if name == "adam" else 1e-5), 5e-6
    for step, (a, b) in enumerate(zip(fv, sv)):
        for x, y in zip(a, b):
            assert x.dtype == np.dtype(dtype)
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"step {step}")
    for x, y in zip(fs, ss):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["adam", "momentum", "rmsprop_centered", "ftrl"])
@pytest.mark.parametrize("resource", [(False, True), (True, False)], ids=["ref_res", "res_ref"])
def test_a_var_list_mixing_ref_and_resource_variables_is_one_step(name, resource):
    """A ref table and a resource bias (and the other way round): one fused op, one norm over
    both (the clip binds), each variable's slots of its own kind, the stock result."""
    fv, fs, fk, _, _, fops = run_model(MAKERS[name], True, False, "float32", 0.5, resource=resource)
    sv, ss, sk, _, _, _ = run_model(MAKERS[name], False, False, "float32", 0.5, resource=resource)
    rv, rs, _, _, _, _ = run_model(MAKERS[name], True, False, "float32", 0.5, resource=(True, True))
    assert len([t for t in fops if t.startswith("TfclipClipApply")]) == 1, fops
    assert fk == sk
    per_var = len(fk) // 2
    assert [k for _, k in fk] == [not resource[0]] * per_var + [not resource[1]] * per_var
    for a, b in zip(fv + [fs], rv + [rs]):  # the all-resource step's bits
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(fv + [fs], sv + [ss]):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=5e-6)


def test_mixed_var_list_builds_a_single_op():
    with tf.Graph().as_default() as g:
        a = ref_var("a", np.ones(3, "float32"))
        b = ref_var("b", np.ones(3, "float32"), use_resource=True)
        c = ref_var("c", np.ones(2, "float32"))
        opt = tfclip.compat.v1.AdamOptimizer(0.1, global_clipnorm=1.0)
        train = opt.apply_gradients([(tf.constant([3.0, 0, 0]), a), (tf.constant([0, 4.0, 0]), b),
                                     (tf.constant([0.0, 0.0]), c)])
        ops = apply_ops(g)
        assert [op.type for op in ops] == ["TfclipClipApplyRefAdam"]
        assert ops[0].get_attr("ref") == [0, 2]
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(train)
            np.testing.assert_allclose(s.run(opt.global_norm()), 5.0, rtol=1e-6)  # one norm over all
            np.testing.assert_allclose(s.run(opt.tensor_norms()), [3.0, 4.0, 0.0], rtol=1e-6)
            # Adam's first step moves each coordinate with a non-zero gradient by lr
            np.testing.assert_allclose(s.run(a), [0.9, 1, 1], rtol=1e-5)
            np.testing.assert_allclose(s.run(b), [1, 0.9, 1], rtol=1e-5)


# ------------------------------------------------------------------ Saver, both ways
def build_saver_graph(module, name):
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.random.default_rng(1).normal(size=(8, 4)).astype("float32"))
        w = ref_var("w", np.ones((4, 3), "float32"))
        b = ref_var("b", np.zeros(3, "float32"))
        loss = tf.reduce_sum((tf.matmul(x, w) + b) ** 2)
        gs = v1.train.get_or_create_global_step()
        opt = MAKERS[name](module, {})
        train = opt.minimize(loss, global_step=gs)
        saver = v1.train.Saver()
        init = v1.global_variables_initializer()
    return g, opt, train, saver, init, [w, b]


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("direction", ["stock_to_tfclip", "tfclip_to_stock"])
def test_saver_checkpoints_of_ref_variables_restore_across_stock_and_tfclip(tmp_path, name, direction):
    src, dst = ((v1.train, tfclip.compat.v1) if direction == "stock_to_tfclip"
                else (tfclip.compat.v1, v1.train))
    path = str(tmp_path / "model.ckpt")
    g, opt, train, saver, init, vs = build_saver_graph(src, name)
    with g.as_default(), v1.Session() as s:
        s.run(init)
        for _ in range(3):
            s.run(train)
        saver.save(s, path)
        state = s.run(opt.variables())
        for _ in range(3):
            s.run(train)
        want = s.run(vs + [v1.train.get_global_step()])
    g, opt, train, saver, _, vs = build_saver_graph(dst, name)
    with g.as_default(), v1.Session() as s:
        assert all(is_ref(v) for v in opt.variables())
        saver.restore(s, path)
        s.run(v1.local_variables_initializer())
        for a, b in zip(s.run(opt.variables()), state):  # the optimizer's state came across
            np.testing.assert_array_equal(a, b)
        for _ in range(3):
            s.run(train)
        got = s.run(vs + [v1.train.get_global_step()])
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert got[-1] == 6


# ------------------------------------------------------------------ TF's own TF1 optimizer tests,
# their use_resource=False cases, rewritten: NumPy float64 references, literal values.
def np_step(name, var, g, state, t, hp):
    """One step of the TF1 rule in float64 (TF's training_ops semantics)."""
    var = var.astype(np.float64)
    g = g.astype(np.float64)
    if name == "gd":
        return var - hp["lr"] * g
    if name == "momentum":
        a = state.setdefault("accum", np.zeros_like(var))
        a[...] = hp["momentum"] * a + g
        if hp.get("nesterov"):
            return var - hp["lr"] * (g + hp["momentum"] * a)
        return var - hp["lr"] * a
    if name == "adam":
        m = state.setdefault("m", np.zeros_like(var))
        v = state.setdefault("v", np.zeros_like(var))
        b1, b2 = hp["beta1"], hp["beta2"]
        # TF1's beta1^t and beta2^t: float32 accumulators (the stock class makes them from Python
        # floats), multiplied in float32, cast to the variable's dtype.
        p1, p2 = np.float32(b1), np.float32(b2)
        for _ in range(t - 1):
            p1, p2 = p1 * np.float32(b1), p2 * np.float32(b2)
        lr_t = hp["lr"] * np.sqrt(1 - np.float64(p2)) / (1 - np.float64(p1))
        m[...] = b1 * m + (1 - b1) * g
        v[...] = b2 * v + (1 - b2) * g * g
        return var - lr_t * m / (np.sqrt(v) + hp["epsilon"])
    if name == "adagrad":
        a = state.setdefault("accum", np.full_like(var, hp["init"]))
        a[...] += g * g
        return var - hp["lr"] * g / np.sqrt(a)
    if name == "rmsprop":
        ms = state.setdefault("ms", np.ones_like(var))
        mom = state.setdefault("mom", np.zeros_like(var))
        ms[...] = hp["decay"] * ms + (1 - hp["decay"]) * g * g
        mom[...] = hp["momentum"] * mom + hp["lr"] * g / np.sqrt(ms + hp["epsilon"])
        return var - mom
    if name == "adadelta":
        a = state.setdefault("accum", np.zeros_like(var))
        u = state.setdefault("update", np.zeros_like(var))
        a[...] = hp["rho"] * a + (1 - hp["rho"]) * g * g
        upd = np.sqrt(u + hp["epsilon"]) / np.sqrt(a + hp["epsilon"]) * g
        u[...] = hp["rho"] * u + (1 - hp["rho"]) * upd * upd
        return var - hp["lr"] * upd
    raise AssertionError(name)


NP_CASES = {
    "gd": ({"lr": 3.0}, lambda m, hp: m.GradientDescentOptimizer(hp["lr"])),
    "momentum": ({"lr": 2.0, "momentum": 0.9}, lambda m, hp: m.MomentumOptimizer(hp["lr"], hp["momentum"])),
    "nesterov": ({"lr": 2.0, "momentum": 0.9, "nesterov": True},
                 lambda m, hp: m.MomentumOptimizer(hp["lr"], hp["momentum"], use_nesterov=True)),
    "adam": ({"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
             lambda m, hp: m.AdamOptimizer()),
    "adagrad": ({"lr": 3.0, "init": 0.1}, lambda m, hp: m.AdagradOptimizer(hp["lr"], initial_accumulator_value=hp["init"])),
    "rmsprop": ({"lr": 0.1, "decay": 0.9, "momentum": 0.5, "epsilon": 1e-10},
                lambda m, hp: m.RMSPropOptimizer(hp["lr"], hp["decay"], hp["momentum"], hp["epsilon"])),
    "adadelta": ({"lr": 1.0, "rho": 0.95, "epsilon": 1e-8},
                 lambda m, hp: m.AdadeltaOptimizer(hp["lr"], hp["rho"], hp["epsilon"])),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(NP_CASES))
def test_basic_ref_variables_against_numpy(name, dtype):
    """The TF1 tests' testBasic with use_resource=False: var0 = [1, 2], var1 = [3, 4], constant
    gradients [0.1, 0.1] and [0.01, 0.01], three steps, each checked against NumPy float64."""
    hp, make = NP_CASES[name]
    rule = "momentum" if name == "nesterov" else name
    with tf.Graph().as_default():
        var0 = v1.Variable([1.0, 2.0], dtype=dtype, use_resource=False)
        var1 = v1.Variable([3.0, 4.0], dtype=dtype, use_resource=False)
        g0, g1 = np.array([0.1, 0.1]), np.array([0.01, 0.01])
        opt = make(tfclip.compat.v1, hp)
        update = opt.apply_gradients(zip([tf.constant(g0, dtype), tf.constant(g1, dtype)], [var0, var1]))
        assert is_ref(var0) and is_ref(var1)
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            np.testing.assert_array_equal(s.run([var0, var1]), [[1, 2], [3, 4]])
            want0, want1 = np.array([1.0, 2.0]), np.array([3.0, 4.0])
            st0, st1 = {}, {}
            for t in range(1, 4):
                s.run(update)
                want0 = np_step(rule, want0, g0, st0, t, hp)
                want1 = np_step(rule, want1, g1, st1, t, hp)
                rtol = 1e-6 if dtype == "float32" else 1e-12
                np.testing.assert_allclose(s.run(var0), want0, rtol=rtol, atol=rtol)
                np.testing.assert_allclose(s.run(var1), want1, rtol=rtol, atol=rtol)
                if name == "adam":
                    b1p, b2p = opt._get_beta_accumulators()
                    assert is_ref(b1p) and is_ref(b2p)
                    np.testing.assert_allclose(s.run([b1p, b2p]), [0.9 ** (t + 1), 0.999 ** (t + 1)], rtol=1e-6)


def test_gradient_descent_literal_values_and_global_step():
    """gradient_descent_test's testBasic/testWithGlobalStep, use_resource=False: lr 3, the
    values after one step are [1 - 3 * 0.1, 2 - 3 * 0.1] and [3 - 3 * 0.01, 4 - 3 * 0.01]."""
    with tf.Graph().as_default():
        var0 = v1.Variable([1.0, 2.0], use_resource=False)
        var1 = v1.Variable([3.0, 4.0], use_resource=False)
        global_step = v1.Variable(0, trainable=False, use_resource=False)
        sgd = tfclip.compat.v1.GradientDescentOptimizer(3.0).apply_gradients(
            zip([tf.constant([0.1, 0.1]), tf.constant([0.01, 0.01])], [var0, var1]), global_step=global_step)
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(sgd)
            np.testing.assert_allclose(s.run(var0), [1.0 - 3.0 * 0.1, 2.0 - 3.0 * 0.1], rtol=1e-6)
            np.testing.assert_allclose(s.run(var1), [3.0 - 3.0 * 0.01, 4.0 - 3.0 * 0.01], rtol=1e-6)
            assert s.run(global_step) == 1


def test_gradient_descent_tensor_learning_rate_and_minimize():
    """testTensorLearningRate and testMinimize (a linear model, use_resource=False)."""
    with tf.Graph().as_default():
        var0 = v1.Variable([[1.0, 2.0]], use_resource=False)
        var1 = v1.Variable([3.0], use_resource=False)
        x = tf.constant([[4.0], [5.0]])
        loss = tf.matmul(var0, x) + var1
        lr = tf.constant(1.0) * 3.0  # a tensor, not a number
        sgd = tfclip.compat.v1.GradientDescentOptimizer(lr).minimize(loss)
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(sgd)
            np.testing.assert_allclose(s.run(var0), [[1.0 - 3.0 * 4.0, 2.0 - 3.0 * 5.0]], rtol=1e-6)
            np.testing.assert_allclose(s.run(var1), [3.0 - 3.0 * 1.0], rtol=1e-6)


def test_gradient_descent_sparse_and_grad_wrt_ref():
    """testSparseBasic (IndexedSlices onto [2, 1] ref variables) and testGradWrtRef (the
    gradient of a sum of ref variables is ones)."""
    with tf.Graph().as_default():
        var0 = v1.Variable([[1.0], [2.0]], use_resource=False)
        var1 = v1.Variable([[3.0], [4.0]], use_resource=False)
        g0 = tf.IndexedSlices(tf.constant([0.1], shape=[1, 1]), tf.constant([0]), tf.constant([2, 1]))
        g1 = tf.IndexedSlices(tf.constant([0.01], shape=[1, 1]), tf.constant([1]), tf.constant([2, 1]))
        sgd = tfclip.compat.v1.GradientDescentOptimizer(3.0).apply_gradients(zip([g0, g1], [var0, var1]))
        opt = tfclip.compat.v1.GradientDescentOptimizer(3.0)
        values = [1.0, 3.0]
        vars_ = [v1.Variable([v], use_resource=False) for v in values]
        grads_and_vars = opt.compute_gradients(vars_[0] + vars_[1], vars_)
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(sgd)
            np.testing.assert_allclose(s.run(var0), [[1.0 - 3.0 * 0.1], [2.0]], rtol=1e-6)
            np.testing.assert_allclose(s.run(var1), [[3.0], [4.0 - 3.0 * 0.01]], rtol=1e-6)
            for grad, _ in grads_and_vars:
                np.testing.assert_array_equal(s.run(grad), [1.0])


def test_momentum_sharing_and_literal_values():
    """momentum_test's testBasic values and testSharing (use_resource=False): two train ops from
    one optimizer share its `momentum` slots, run alternately."""
    with tf.Graph().as_default():
        var0 = v1.Variable([1.0, 2.0], use_resource=False)
        var1 = v1.Variable([3.0, 4.0], use_resource=False)
        grads = [tf.constant([0.1, 0.1]), tf.constant([0.01, 0.01])]
        opt = tfclip.compat.v1.MomentumOptimizer(learning_rate=2.0, momentum=0.9)
        up1 = opt.apply_gradients(zip(grads, [var0, var1]))
        up2 = opt.apply_gradients(zip(grads, [var0, var1]))
        assert opt.get_slot_names() == ["momentum"]
        slot0 = opt.get_slot(var0, "momentum")
        assert is_ref(slot0) and slot0.get_shape() == var0.get_shape()
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(up1)
            np.testing.assert_allclose(s.run(slot0), [0.1, 0.1], rtol=1e-6)
            np.testing.assert_allclose(s.run(var0), [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 2.0], rtol=1e-6)
            np.testing.assert_allclose(s.run(var1), [3.0 - 0.01 * 2.0, 4.0 - 0.01 * 2.0], rtol=1e-6)
            s.run(up2)
            np.testing.assert_allclose(s.run(slot0), [0.9 * 0.1 + 0.1] * 2, rtol=1e-6)
            np.testing.assert_allclose(
                s.run(var0), [1.0 - 0.1 * 2.0 - (0.9 * 0.1 + 0.1) * 2.0, 2.0 - 0.1 * 2.0 - (0.9 * 0.1 + 0.1) * 2.0],
                rtol=1e-6)


def test_adam_sparse_and_two_sessions_and_callable_hyperparameters():
    """adam_test's testSparse (IndexedSlices rows [0, 1] of [3, 1]-shaped... here of [2]-vectors),
    testTwoSessions (one optimizer, a graph per session), testBasicCallableParams."""
    hp = NP_CASES["adam"][0]
    for callable_params in (False, True):
        with tf.Graph().as_default():
            var0 = v1.Variable([1.0, 2.0], use_resource=False)
            g0 = tf.IndexedSlices(tf.constant([0.1, 0.1]), tf.constant([0, 1]), tf.constant([2]))
            kw = ({"learning_rate": lambda: 0.001, "beta1": lambda: 0.9, "beta2": lambda: 0.999,
                   "epsilon": lambda: 1e-8} if callable_params else {})
            opt = tfclip.compat.v1.AdamOptimizer(**kw)
            update = opt.apply_gradients([(g0, var0)])
            with v1.Session() as s:
                s.run(v1.global_variables_initializer())
                want, st = np.array([1.0, 2.0]), {}
                for t in range(1, 4):
                    s.run(update)
                    want = np_step("adam", want, np.array([0.1, 0.1]), st, t, hp)
                    np.testing.assert_allclose(s.run(var0), want, rtol=1e-6)
    opt = tfclip.compat.v1.AdamOptimizer()
    for _ in range(2):  # testTwoSessions: the same optimizer in a second graph
        with tf.Graph().as_default():
            var0 = v1.Variable(np.array([1.0, 2.0], "float32"), use_resource=False)
            update = opt.apply_gradients([(tf.constant([0.1, 0.1]), var0)])
            with v1.Session() as s:
                s.run(v1.global_variables_initializer())
                s.run(update)
                np.testing.assert_allclose(s.run(var0), [1.0 - 0.001, 2.0 - 0.001], rtol=1e-6)


@pytest.mark.parametrize("use_locking", [False, True])
def test_concurrent_steps_on_ref_variables_lose_no_update(use_locking):
    """Ref variables are updated under their mutexes, whatever use_locking: four threads running
    the train op on the same large variables, 25 steps each, land exactly where 100 serial
    steps do (an unlocked read-modify-write would lose updates)."""
    with tf.Graph().as_default():
        a = v1.Variable(np.zeros(1 << 18, "float32"), use_resource=False)
        b = v1.Variable(np.zeros(1 << 16, "float32"), use_resource=False)
        opt = tfclip.compat.v1.GradientDescentOptimizer(1.0, use_locking=use_locking)
        train = opt.apply_gradients([(tf.ones_like(a), a), (tf.ones_like(b), b)])
        config = v1.ConfigProto(inter_op_parallelism_threads=4, intra_op_parallelism_threads=2)
        with v1.Session(config=config) as s:
            s.run(v1.global_variables_initializer())

            def work():
                for _ in range(25):
                    s.run(train)

            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            va, vb = s.run([a, b])
    np.testing.assert_array_equal(va, np.full(1 << 18, -100.0, "float32"))
    np.testing.assert_array_equal(vb, np.full(1 << 16, -100.0, "float32"))


# ------------------------------------------------------------------ errors
def test_non_float_ref_variable_is_named():
    with tf.Graph().as_default():
        w = v1.Variable([1, 2], name="counts", use_resource=False)
        with pytest.raises(TypeError, match=r"grads_and_vars\[0\]: counts:0 is a int32 variable"):
            tfclip.compat.v1.GradientDescentOptimizer(0.1).apply_gradients([(tf.constant([1, 1]), w)])


def test_ref_of_another_dtype_than_its_gradient_is_named():
    with tf.Graph().as_default() as g:
        a = v1.Variable([1.0, 2.0], name="fine", use_resource=False)
        w = v1.Variable([1.0, 2.0], name="narrow", use_resource=False)
        with pytest.raises(TypeError, match=r"grads_and_vars\[1\]: the gradient of narrow:0 is float64 "
                                            r"but the variable is float32"):
            tfclip.compat.v1.AdamOptimizer(0.1).apply_gradients(
                [(tf.constant([1.0, 1.0]), a), (tf.constant([1.0, 1.0], tf.float64), w)])
        assert not apply_ops(g)


def test_uninitialized_ref_variable_is_named_and_nothing_is_written():
    with tf.Graph().as_default():
        a = v1.Variable([1.0, 2.0], name="ready", use_resource=False)
        late = v1.Variable([3.0], name="late", use_resource=False)
        train = tfclip.compat.v1.GradientDescentOptimizer(0.1).apply_gradients(
            [(tf.constant([1.0, 1.0]), a), (tf.constant([1.0]), late)])
        with v1.Session() as s:
            s.run(a.initializer)
            # (TF's executor checks a ref input before the kernel runs, in its own words.)
            with pytest.raises(tf.errors.FailedPreconditionError, match=r"uninitialized value late"):
                s.run(train)
            np.testing.assert_array_equal(s.run(a), [1.0, 2.0])


@pytest.mark.parametrize("resource_first", [False, True])
def test_a_failed_step_writes_nothing(resource_first):
    """A gradient of the wrong shape (known only when the step runs) after a good pair: the op
    names it, and neither variable nor any slot changed."""
    with tf.Graph().as_default():
        a = v1.Variable([1.0, 2.0], name="a", use_resource=resource_first)
        b = v1.Variable([[3.0, 4.0]], name="b", use_resource=False)
        gb = v1.placeholder(tf.float32, shape=None)
        opt = tfclip.compat.v1.AdamOptimizer(0.1)
        train = opt.apply_gradients([(tf.constant([1.0, 1.0]), a), (gb, b)])
        watched = [a, b, opt.get_slot(a, "m"), opt.get_slot(b, "m"), opt.get_slot(b, "v"),
                   *opt._get_beta_accumulators()]
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            before = s.run(watched)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"grads\[1\] has 3 elements .* but vars\[1\] \(b\) has 2"):
                s.run(train, {gb: [1.0, 2.0, 3.0]})
            for x, y in zip(s.run(watched), before):
                np.testing.assert_array_equal(x, y)
            s.run(train, {gb: [[1.0, 1.0]]})  # and the next good step runs
            assert not np.array_equal(s.run(b), before[1])


def test_the_same_ref_variable_twice_is_refused():
    with tf.Graph().as_default():
        w = v1.Variable([1.0, 2.0], name="twice", use_resource=False)
        with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="twice"):
            train = tfclip.compat.v1.GradientDescentOptimizer(0.1).apply_gradients(
                [(tf.constant([1.0, 1.0]), w), (tf.constant([1.0, 1.0]), w)])
            with v1.Session() as s:
                s.run(v1.global_variables_initializer())
                s.run(train)


# ------------------------------------------------------------------ the op itself
def test_ref_op_has_no_xla_kernel_and_the_resource_op_keeps_its_own():
    from tensorflow.python.framework import kernels

    def devices(op):
        return {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}

    for rule in ("Sgd", "Adam", "TfRmsProp", "Ftrl"):
        ref = devices("TfclipClipApplyRef" + rule)
        assert "CPU" in ref and not any("XLA" in d for d in ref), ref
        assert "XLA_CPU_JIT" in devices("TfclipClipApply" + rule)


def test_resource_op_keeps_its_eager_path():
    """The resource op has no ref input (an op with one has no eager Python wrapper): eager
    compat.v1 steps still run."""
    v = tf.Variable([1.0, 2.0])
    tfclip.compat.v1.GradientDescentOptimizer(0.5).apply_gradients([(tf.constant([1.0, 1.0]), v)])
    np.testing.assert_allclose(v.numpy(), [0.5, 1.5])


AUTO_JIT_PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    import tfclip

    def run(jit):
        g = tf.Graph()
        with g.as_default():
            w = tf.get_variable("w", initializer=np.linspace(-1, 1, 12).reshape(4, 3).astype("float32"))
            b = tf.get_variable("b", initializer=np.zeros(3, "float32"), use_resource=True)
            x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)).astype("float32"))
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w) + b) ** 2)
            train = tfclip.compat.v1.AdamOptimizer(0.1, global_clipnorm=0.5).minimize(
                loss, global_step=tf.train.get_or_create_global_step())
        config = tf.ConfigProto()
        if jit:
            config.graph_options.optimizer_options.global_jit_level = tf.OptimizerOptions.ON_1
        with tf.Session(graph=g, config=config) as s:
            s.run(tf.global_variables_initializer())
            for _ in range(5):
                s.run(train)
            return s.run([w, b])

    a, b = run(False), run(True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    print("SAME", a[0].ravel()[:3])
""")


def test_tf1_auto_clustering_leaves_the_ref_step_alone(tmp_path):
    """XLA auto-clustering (global_jit_level ON_1, on CPU too) over a TF1 graph whose var_list
    mixes a ref and a resource variable: the ref op has no XLA kernel, so it stays a TF op, and
    the result is the unclustered one."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_XLA_FLAGS": "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"}
    r = subprocess.run([sys.executable, "-c", AUTO_JIT_PROGRAM], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SAME" in r.stdout


def test_ref_op_lists_that_disagree_with_ref_are_named():
    """The ref op called directly: resource and ref lists that do not fit `ref` (the positions of
    the refs among the gradients), and `ref` itself out of order, are errors naming them."""
    from tfclip._engine import opcall as _opcall

    with tf.Graph().as_default():
        a = v1.Variable([1.0, 2.0], name="a", use_resource=False)
        b = v1.Variable([3.0, 4.0], name="b", use_resource=False)
        r = v1.Variable([5.0, 6.0], name="r", use_resource=True)
        g = [tf.constant([1.0, 1.0])] * 2

        def call(var, refs):
            return _opcall.apply("sgd", var, [], g, {"lr": 0.1, "weight_decay": 0.0}, refs=refs,
                                 clip=tf.constant(0.0, tf.float64), use_norm=tf.constant(0.0, tf.float64),
                                 iterations=[], indices=[], sparse=[])

        bad_counts = call([r.handle], ([0], [a, b], []))  # 1 + 2 variables for 2 gradients
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"got 1 resource and 2 ref vars for 2 gradients, of which `ref` names 1"):
                s.run(bad_counts)
            np.testing.assert_array_equal(s.run([a, b, r]), [[1, 2], [3, 4], [5, 6]])
            ok = call([r.handle], ([1], [a], []))  # r at 0, a at 1
            s.run(ok)
            np.testing.assert_allclose(s.run([r, a]), [[4.9, 5.9], [0.9, 1.9]], rtol=1e-6)
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="ref must list gradient positions"):
                s.run(call([], ([1, 0], [a, b], [])))
