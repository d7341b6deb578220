"""tfclip.tf_keras: the drop-ins for the tf_keras (Keras 2) optimizers, each against the stock
tf_keras class (the only reference: never tfclip itself): trajectories with every clip mode,
schedules, IndexedSlices with duplicate rows, weight decay, EMA, model.fit (and jit_compile=True),
the variable list, tf.train.Checkpoint both ways, the non-finite policies, MirroredStrategy and
MultiWorkerMirroredStrategy (in subprocesses), TF_USE_LEGACY_KERAS=1, the Keras 3 / tf_keras mix-up
errors, the tf_keras.optimizers.legacy drop-ins, and the behaviours tf-keras's own optimizer tests
check (their files are not vendored: our versions of their cases, against the stock classes)."""
import inspect
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed: "
    "pip install '.[tf-keras]' to test tfclip.tf_keras")

import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
import tfclip.tf_keras as tk  # noqa: E402
from tfclip.tf_keras import _legacy  # noqa: E402  (their warned-once flags)
from tfclip.tf_keras import _dropin
from procs import free_ports  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "tf_keras_distributed_check.py")
stock = tf_keras.optimizers
RTOL, ATOL = 3e-6, 1e-7

# (class name, constructor arguments beyond the clip)
CASES = [
    ("SGD", {}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.8, "nesterov": True}),
    ("Adam", {"learning_rate": 0.05}),
    ("Adam", {"amsgrad": True}),
    ("Adam", {"adaptive_epsilon": True, "epsilon": 1e-3}),
    ("AdamW", {"weight_decay": 0.1, "learning_rate": 0.01}),
    ("AdamW", {"amsgrad": True}),
    ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.5, "centered": True}),
    ("Adagrad", {"initial_accumulator_value": 0.2}),
    ("Adadelta", {"learning_rate": 1.0}),
    ("Adamax", {}),
    ("Nadam", {}),
    ("Lion", {"learning_rate": 0.01}),
    ("Ftrl", {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
              "l2_shrinkage_regularization_strength": 0.1, "beta": 0.1}),
    ("Ftrl", {"learning_rate_power": -0.7}),
]
CLIPS = [{}, {"global_clipnorm": 1.0}, {"clipnorm": 0.7}, {"clipvalue": 0.4}]


def _ids(case):
    name, kw = case
    return name + ("-" + "-".join(f"{k}={v}" for k, v in kw.items()) if kw else "")


def _grads(step, sparse):
    g1 = (np.sin(np.arange(12) * 1.3 + step) * 3).astype(np.float32).reshape(3, 4)
    if sparse:  # duplicated row 0, as an Embedding lookup of [0, 2, 0] gives
        g1 = tf.IndexedSlices(tf.constant(g1), tf.constant([0, 2, 0]), tf.constant([5, 4]))
    else:
        g1 = tf.constant(np.concatenate([g1, np.zeros((2, 4), np.float32)]))
    g2 = tf.constant((np.cos(np.arange(6) + 2 * step) * (step + 1)).astype(np.float32))
    return [g1, g2]


def _train(cls, kw, steps=4, sparse=False, function=False, grads_fn=_grads):
    v1 = tf.Variable(np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1, name="emb")
    v2 = tf.Variable(np.linspace(-1, 1, 6).astype(np.float32), name="bias")
    opt = cls(**kw)

    def apply(gs):
        opt.apply_gradients(zip(gs, [v1, v2]))

    if function:
        apply = tf.function(apply)
    for s in range(steps):
        apply(grads_fn(s, sparse))
    return opt, [v1.numpy(), v2.numpy()] + [v.numpy() for v in _opt_vars(opt)]


def _opt_vars(opt):
    """The optimizer's variables: a list (new optimizers: a callable list) or, legacy, a method."""
    return list(opt.variables())


def _assert_same(got, want, rtol=RTOL, atol=ATOL):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        # atol grows with the array's largest element: a float32 sum that cancels (Ftrl's linear
        # slot) carries rounding of the size of its largest terms, not of its result.
        scale = float(np.max(np.abs(b))) if np.size(b) and np.isfinite(b).all() else 0.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol + rtol * scale, err_msg=f"entry {i}")


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "-".join(c) or "noclip")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_trajectory_matches_stock(case, clip):
    name, kw = case
    if any(k not in inspect.signature(getattr(stock, name)).parameters for k in kw):
        pytest.skip(f"this tf_keras's {name} has no {sorted(kw)} (older tf-keras)")
    kw = {**kw, **clip}
    for sparse in (False, True):
        _, want = _train(getattr(stock, name), kw, sparse=sparse)
        opt, got = _train(getattr(tk, name), kw, sparse=sparse)
        _assert_same(got, want)
        assert isinstance(opt, getattr(stock, name))
        assert int(opt.skipped_steps.numpy()) == 0


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop", "Lion"])
def test_tf_function_and_schedule(name):
    sched = tf_keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    kw = {"learning_rate": sched, "global_clipnorm": 2.0}
    for sparse in (False, True):
        _, want = _train(getattr(stock, name), kw, steps=5, sparse=sparse, function=True)
        _, got = _train(getattr(tk, name), kw, steps=5, sparse=sparse, function=True)
        _assert_same(got, want)


def test_nadam_in_a_tf_function_follows_the_eager_stock_trajectory():
    """Stock tf_keras Nadam advances its `_u_product` by a Python counter compared with
    `iterations` per variable: eagerly once per step, in a tf.function with two variables once per
    variable from the second step on. tfclip's advances it once per step in both."""
    for sparse in (False, True):
        eager_stock, want = _train(stock.Nadam, {"global_clipnorm": 1.0}, steps=5, sparse=sparse)
        opt, got = _train(tk.Nadam, {"global_clipnorm": 1.0}, steps=5, sparse=sparse, function=True)
        _assert_same(got, want)
        np.testing.assert_allclose(opt._u_product.numpy(), eager_stock._u_product.numpy(), rtol=1e-6)


def test_weight_decay_with_exclusions():
    for name, kw in (("SGD", {"momentum": 0.9, "weight_decay": 0.05}), ("Adam", {"weight_decay": 0.05}),
                     ("AdamW", {"weight_decay": 0.2, "clipnorm": 0.5})):
        res = []
        for cls in (getattr(stock, name), getattr(tk, name)):
            v1, v2 = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.ones([2]) * 2, name="bias_x")
            opt = cls(**kw)
            opt.exclude_from_weight_decay(var_names=["bias"])
            for s in range(3):
                opt.apply_gradients([(tf.fill([3, 2], 0.5 + s), v1), (tf.fill([2], -1.0), v2)])
            res.append([v1.numpy(), v2.numpy()] + [v.numpy() for v in opt.variables])
        _assert_same(res[1], res[0])


def test_ema_and_constraints():
    kw = {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 2, "learning_rate": 0.1}
    res = []
    for cls in (stock.Adam, tk.Adam):
        v = tf.Variable([1.0, -2.0], constraint=lambda x: tf.clip_by_value(x, -1.5, 1.5))
        opt = cls(**kw)
        for s in range(5):
            opt.apply_gradients([(tf.constant([0.3, -0.2]) * (s + 1), v)])
        opt.finalize_variable_values([v])
        res.append([v.numpy()] + [x.numpy() for x in opt.variables])
    _assert_same(res[1], res[0])


def test_variables_list_and_config_identical_to_stock():
    for name, kw in CASES:
        if any(k not in inspect.signature(getattr(stock, name)).parameters for k in kw):
            continue  # (an argument of a newer tf-keras)
        v1, v2 = tf.Variable(tf.ones([3, 2]), name="w"), tf.Variable(tf.ones([2]), name="b")
        a, b = getattr(stock, name)(**kw), getattr(tk, name)(**kw)
        a.build([v1, v2])
        b.build([v1, v2])
        assert [(v.name, v.shape, v.dtype) for v in b.variables] == [(v.name, v.shape, v.dtype) for v in a.variables]
        assert b.get_config() == a.get_config()  # the default tfclip arguments leave it stock
        c = getattr(tk, name).from_config(b.get_config())
        assert type(c) is getattr(tk, name)
    cfg = tk.Adam(nonfinite="raise", lazy_sparse=True).get_config()
    assert cfg["nonfinite"] == "raise" and cfg["lazy_sparse"] is True
    assert tk.Adam.from_config(cfg).nonfinite == "raise"


@pytest.mark.parametrize("direction", ["stock_to_tfclip", "tfclip_to_stock"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop", "Nadam", "Ftrl"])
def test_checkpoint_both_ways(tmp_path, direction, name):
    kw = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    first, second = (stock, tk) if direction == "stock_to_tfclip" else (tk, stock)

    def make(mod):
        v = tf.Variable(tf.ones([4, 3]), name="w")
        opt = getattr(mod, name)(**kw)
        return v, opt

    v, opt = make(first)
    for s in range(3):
        opt.apply_gradients([(tf.fill([4, 3], 0.1 * (s + 1)), v)])
    path = tf.train.Checkpoint(v=v, opt=opt).save(str(tmp_path / "ckpt"))
    v2, opt2 = make(second)
    opt2.build([v2])
    tf.train.Checkpoint(v=v2, opt=opt2).restore(path).assert_consumed()
    _assert_same([v2.numpy()] + [x.numpy() for x in opt2.variables], [v.numpy()] + [x.numpy() for x in opt.variables], 0, 0)
    # and they go on alike
    for o, var in ((opt, v), (opt2, v2)):
        o.apply_gradients([(tf.fill([4, 3], -0.3), var)])
    _assert_same([v2.numpy()] + [x.numpy() for x in opt2.variables], [v.numpy()] + [x.numpy() for x in opt.variables])


def _nan_grads(step, sparse):
    gs = _grads(step, sparse)
    if step == 2:
        return [gs[0], tf.constant([np.nan, 0, 0, 0, 0, 0], tf.float32)]
    return gs


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adamax", "Ftrl"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_nonfinite_skip_writes_nothing(name, sparse):
    kw = {"momentum": 0.9} if name == "SGD" else {}
    opt, got = _train(getattr(tk, name), {**kw, "global_clipnorm": 1.0}, steps=4, sparse=sparse,
                      grads_fn=_nan_grads)
    assert int(opt.skipped_steps.numpy()) == 1
    assert np.isfinite(opt.global_norm.numpy())  # (the last step's norm)
    # Stock, with the NaN step left out but `iterations` advanced, as tfclip's skip does.
    v1 = tf.Variable(np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1)
    v2 = tf.Variable(np.linspace(-1, 1, 6).astype(np.float32))
    ref = getattr(stock, name)(**kw, global_clipnorm=1.0)
    for s in range(4):
        if s == 2:
            ref.build([v1, v2])
            ref.iterations.assign_add(1)
            continue
        ref.apply_gradients(zip(_grads(s, sparse), [v1, v2]))
    _assert_same(got, [v1.numpy(), v2.numpy()] + [v.numpy() for v in ref.variables])


def test_nonfinite_propagate_and_raise():
    _, want = _train(stock.Adam, {}, steps=3, grads_fn=_nan_grads)
    _, got = _train(tk.Adam, {"nonfinite": "propagate"}, steps=3, grads_fn=_nan_grads)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    v = tf.Variable([1.0, 2.0])
    opt = tk.Adam(nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError):
        opt.apply_gradients([(tf.constant([np.inf, 0.0]), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    with pytest.raises(ValueError, match="nonfinite"):
        tk.SGD(nonfinite="ignore")


def _embedding_model():
    tf_keras.utils.set_random_seed(1)
    inp = tf_keras.Input((5,), dtype="int32")
    x = tf_keras.layers.Embedding(20, 4)(inp)
    x = tf_keras.layers.Flatten()(x)
    return tf_keras.Model(inp, tf_keras.layers.Dense(1)(x))


def _fit(opt, jit, x, y):
    m = _embedding_model()
    m.compile(optimizer=opt, loss="mse", jit_compile=jit)
    m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return m, [w.numpy() for w in m.weights] + [v.numpy() for v in _opt_vars(m.optimizer)]


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "jit_compile"])
@pytest.mark.parametrize("name,kw", [("Adam", {"global_clipnorm": 0.5}), ("SGD", {"momentum": 0.9, "clipvalue": 0.1}),
                                     ("RMSprop", {"clipnorm": 0.3})])
def test_model_fit_embedding(jit, name, kw):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (32, 5)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    _, want = _fit(getattr(stock, name)(0.05, **kw), jit, x, y)
    m, got = _fit(getattr(tk, name)(0.05, **kw), jit, x, y)
    _assert_same(got, want, rtol=1e-5, atol=1e-6)
    assert float(m.optimizer.global_norm.numpy()) > 0


def test_jit_compile_runs_the_fused_op():
    """Inside model.compile(jit_compile=True), a NaN batch is skipped: the fused op ran under XLA
    (stock ops would have written NaN)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (16, 5)).astype("int32")
    y = rng.normal(size=(16, 1)).astype("float32")
    y[8] = np.nan  # the second batch of 8
    m = _embedding_model()
    m.compile(optimizer=tk.Adam(0.05), loss="mse", jit_compile=True)
    m.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert int(m.optimizer.skipped_steps.numpy()) == 1
    assert int(m.optimizer.iterations.numpy()) == 2
    assert all(np.isfinite(w.numpy()).all() for w in m.weights)


def test_loss_scale_optimizer_mixed_precision():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    res = []
    for cls in (stock.Adam, tk.Adam):
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            tf_keras.utils.set_random_seed(2)
            m = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3),
                                     tf_keras.layers.Dense(1, dtype="float32")])
            opt = tf_keras.mixed_precision.LossScaleOptimizer(cls(0.01, global_clipnorm=1.0))
            m.compile(optimizer=opt, loss="mse")
            m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
            res.append([w.numpy() for w in m.weights])
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")
    _assert_same(res[1], res[0], rtol=1e-5, atol=1e-6)


def test_keras3_optimizer_given_to_tf_keras_names_both():
    k3 = pytest.importorskip("tfclip.keras", reason="tfclip.keras needs Keras 3")
    m = _embedding_model()
    with pytest.raises(ValueError, match=r"tfclip\.keras\.Adam is an optimizer for Keras 3.*tfclip\.tf_keras\.Adam"):
        m.compile(optimizer=k3.Adam(1e-4), loss="mse")
    with pytest.raises(ValueError, match=r"tfclip\.tf_keras\.SGD"):
        tk.get(k3.SGD())
    assert isinstance(tk.get("adam"), tk.Adam)


def test_tf_keras_optimizer_given_to_keras3_names_both():
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip("Keras 3 is not installed")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"tfclip\.tf_keras\.Adam is an optimizer for tf_keras.*tfclip\.keras\.Adam"):
        model.compile(optimizer=tk.Adam(), loss="mse")


def test_a_legacy_optimizer_given_to_keras3_names_its_legacy_class_and_the_keras3_one():
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip("Keras 3 is not installed")
    from tfclip._engine import mixup as _mixup

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"tfclip\.tf_keras\.legacy\.Adam is an optimizer for tf_keras.*"
                                         r"use tfclip\.keras\.Adam with Keras 3"):
        model.compile(optimizer=tk.legacy.Adam(), loss="mse")
    # Installed once: a second install leaves one wrapper around the stock get.
    from keras.src import optimizers as keras_optimizers

    wrapped = keras_optimizers.get
    _mixup.install()
    assert keras_optimizers.get is wrapped and wrapped.__wrapped__.__module__.startswith("keras")
    assert _mixup.refusal(keras.optimizers.Adam(), "tf_keras") is None  # stock classes pass through


_LEGACY_SCRIPT = r"""
import numpy as np, tensorflow as tf, tf_keras
import tfclip.tf_keras
assert tf.keras.optimizers.Adam is tf_keras.optimizers.Adam, tf.keras.optimizers.Adam
assert issubclass(tfclip.tf_keras.Adam, tf.keras.optimizers.Adam)
assert issubclass(tfclip.tf_keras.legacy.Adam, tf.keras.optimizers.legacy.Adam)
for n in ("SGD", "Adam", "RMSprop", "Adadelta", "Adamax", "Ftrl"):
    assert issubclass(getattr(tfclip.tf_keras.legacy, n), getattr(tf.keras.optimizers.legacy, n)), n
for n in ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl"):
    assert issubclass(getattr(tfclip.tf_keras, n), getattr(tf.keras.optimizers, n)), n
x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32"); y = x.sum(1, keepdims=True)
out = []
pairs = [(tf.keras.optimizers.Adam, tfclip.tf_keras.Adam), (tf.keras.optimizers.legacy.Adam, tfclip.tf_keras.legacy.Adam),
         (tf.keras.optimizers.legacy.Adamax, tfclip.tf_keras.legacy.Adamax)]
for opt in [c(0.1, global_clipnorm=1.0) for pair in pairs for c in pair]:
    tf.keras.utils.set_random_seed(0)
    m = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    m.compile(optimizer=opt, loss="mse")
    m.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    out.append(m.get_weights())
for want, got in ((out[0], out[1]), (out[2], out[3]), (out[4], out[5])):
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=3e-6, atol=1e-7)
print("LEGACY-OK", type(m.optimizer).__module__)
"""


def test_tf_use_legacy_keras_subprocess(tmp_path):
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _LEGACY_SCRIPT], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "LEGACY-OK tfclip.tf_keras" in p.stdout


def test_mirrored_strategy_subprocess(tmp_path):
    out = tmp_path / "m.npz"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, HARNESS, "mirrored", str(out)],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    m = np.load(out)
    assert int(m["replicas"]) == 2
    # tf_keras sums across replicas, then clips: stock and tfclip both move by clip(3 + 3) = 1.
    np.testing.assert_allclose(m["two_replica_clip"], [-1.0, -1.0], rtol=1e-6)
    for prefix in ("fit", "custom", "fit_legacy", "custom_legacy", "fit_legacyrms", "custom_legacyrms",
                   "fit_legacynadam", "custom_legacynadam"):
        keys = sorted(k for k in m.files if k.startswith(prefix + "_tfclip_"))
        assert keys
        for k in keys:
            np.testing.assert_allclose(m[k], m[k.replace("_tfclip_", "_stock_")], rtol=1e-5, atol=1e-6, err_msg=k)


def _check(mode, out, env_extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    return subprocess.Popen([sys.executable, HARNESS, mode, str(out)],
                            env=env, cwd=os.path.dirname(str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_multi_worker_mirrored_two_processes(tmp_path):
    """MultiWorkerMirroredStrategy, 2 worker processes on localhost (one CPU replica each):
    model.fit and a custom loop with tfclip.tf_keras.Adam, legacy.Adam, legacy.RMSprop and
    legacy.Nadam. After
    every step both workers hold bit-identical weights and optimizer variables, and they follow
    the one-device run of the same global batches, as stock tf_keras does."""
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [_check("worker", tmp_path / f"w{i}.npz",
                    {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})})
             for i in range(2)]
    procs.append(_check("single", tmp_path / "s.npz"))
    for p in procs:
        out, _ = p.communicate(timeout=500)
        assert p.returncode == 0, out[-3000:]
    w0, w1, single = (np.load(tmp_path / f) for f in ("w0.npz", "w1.npz", "s.npz"))
    assert int(w0["replicas"]) == 2 and int(w1["replicas"]) == 2
    assert (int(w0["task"]), int(w1["task"])) == (0, 1)
    hists = sorted(k for k in w0.files if k.startswith("hist_"))
    assert len(hists) == 16
    for k in hists:
        assert w0[k].shape[0] == single[k].shape[0] > 1, k
        np.testing.assert_array_equal(w0[k], w1[k], err_msg=k)  # the copies alike, step by step
        np.testing.assert_allclose(w0[k], single[k], rtol=1e-5, atol=2e-6, err_msg=k)
        if "_tfclip" in k:  # and tfclip's steps are stock's
            np.testing.assert_allclose(w0[k], w0[k.replace("_tfclip", "_stock")], rtol=1e-5, atol=2e-6,
                                       err_msg=k)


# -- tf_keras.optimizers.legacy (OptimizerV2, TF's training ops) ------------------------------
LEGACY_CASES = [("SGD", {}), ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.8, "nesterov": True}),
                ("Adam", {}), ("Adam", {"amsgrad": True}), ("Adam", {"learning_rate": 0.1, "decay": 0.1}),
                ("RMSprop", {"momentum": 0.9}), ("RMSprop", {"momentum": 0.5, "centered": True, "rho": 0.8}),
                ("RMSprop", {}), ("RMSprop", {"centered": True, "rho": 0.8, "epsilon": 1e-3}),
                ("Adagrad", {}), ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.0,
                                              "epsilon": 1e-3}),
                ("Adadelta", {"learning_rate": 1.0}), ("Adadelta", {"rho": 0.8, "epsilon": 1e-5}),
                ("Adamax", {}), ("Adamax", {"learning_rate": 0.1, "decay": 0.1}),
                ("Ftrl", {}), ("Ftrl", {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
                                        "l2_shrinkage_regularization_strength": 0.1, "beta": 0.1}),
                ("Ftrl", {"learning_rate_power": -0.7, "initial_accumulator_value": 0.5}),
                ("Nadam", {}), ("Nadam", {"learning_rate": 0.05, "beta_1": 0.8, "schedule_decay": 0.01})]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "-".join(c) or "noclip")
@pytest.mark.parametrize("case", LEGACY_CASES, ids=_ids)
def test_legacy_trajectory_matches_stock(case, clip):
    """IndexedSlices included: legacy SGD with momentum, RMSprop with momentum, Adagrad, Adadelta,
    Adamax and Ftrl update only the touched rows (TF's ResourceSparseApply* ops; Adamax's own
    scatter), legacy Adam every row, RMSprop without momentum every row's slots; duplicates summed
    first. (Nadam's IndexedSlices steps run the stock ops: test_legacy_nadam_indexed_slices.)"""
    name, kw = case
    kw = {**kw, **clip}
    for sparse in (False, True):
        for function in (False, True):
            _, want = _train(getattr(stock.legacy, name), kw, sparse=sparse, function=function)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore" if name == "Nadam" and sparse else "error")
                opt, got = _train(getattr(tk.legacy, name), kw, sparse=sparse, function=function)
            _assert_same(got, want)
            assert isinstance(opt, getattr(stock.legacy, name))


def test_legacy_variables_config_and_checkpoints(tmp_path):
    for name, kw in LEGACY_CASES:
        for first, second in ((stock.legacy, tk.legacy), (tk.legacy, stock.legacy)):
            v = tf.Variable(tf.ones([4, 3]), name="w")
            opt = getattr(first, name)(**kw)
            for s in range(3):
                opt.apply_gradients([(tf.fill([4, 3], 0.1 * (s + 1)), v)])
            path = tf.train.Checkpoint(v=v, opt=opt).save(str(tmp_path / f"{name}{id(opt)}"))
            v2 = tf.Variable(tf.zeros([4, 3]), name="w")
            opt2 = getattr(second, name)(**kw)
            opt2._create_all_weights([v2])
            tf.train.Checkpoint(v=v2, opt=opt2).restore(path).assert_consumed()
            # (the iteration variable's name scope is where it was first made: built here by hand)
            assert [(x.name.split("/")[-1], x.shape) for x in _opt_vars(opt2)] == \
                [(x.name.split("/")[-1], x.shape) for x in _opt_vars(opt)]
            for o, var in ((opt, v), (opt2, v2)):
                o.apply_gradients([(tf.fill([4, 3], -0.3), var)])
            _assert_same([v2.numpy()] + [x.numpy() for x in _opt_vars(opt2)],
                         [v.numpy()] + [x.numpy() for x in _opt_vars(opt)])
        a, b = getattr(stock.legacy, name)(**kw), getattr(tk.legacy, name)(**kw)
        assert b.get_config() == a.get_config()


def test_legacy_sparse_updates_only_the_touched_rows():
    """The rows an IndexedSlices gradient leaves out keep their values and slots (stock's sparse
    ops), for the classes whose stock sparse update is lazy."""
    for name, kw in (("RMSprop", {"momentum": 0.9}), ("Adadelta", {"learning_rate": 1.0}), ("Adamax", {}),
                     ("Ftrl", {"l2_shrinkage_regularization_strength": 0.1}), ("Adagrad", {})):
        opt, got = _train(getattr(tk.legacy, name), kw, steps=3, sparse=True)
        v0 = np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1
        np.testing.assert_array_equal(got[0][[1, 3, 4]], v0[[1, 3, 4]], err_msg=name)
        assert not np.allclose(got[0][[0, 2]], v0[[0, 2]]), name
        assert opt.lazy_sparse is True


@pytest.mark.parametrize("kw", [{}, {"centered": True, "clipnorm": 0.5}, {"epsilon": 1e-3, "global_clipnorm": 1.0}])
def test_legacy_rmsprop_without_momentum_is_fused_epsilon_outside_the_sqrt(kw):
    """Stock legacy RMSprop without momentum (the default) computes var -= lr*g / (sqrt(rms) +
    epsilon): fused now (no stock fallback, no warning), and its IndexedSlices step decays every
    row's rms as stock does (lazy_sparse defaults to False there)."""
    _legacy._LEGACY_WARNED.clear()
    for sparse in (False, True):
        _, want = _train(stock.legacy.RMSprop, kw, sparse=sparse)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt, got = _train(tk.legacy.RMSprop, kw, sparse=sparse)
        _assert_same(got, want)
        assert opt.lazy_sparse is False and int(opt.iterations.numpy()) == 4
        assert int(opt.clipped_steps.numpy()) >= (1 if set(kw) & {"clipnorm", "global_clipnorm"} else 0)
    assert not _legacy._LEGACY_WARNED


@pytest.mark.parametrize("centered", [False, True])
def test_legacy_rmsprop_without_momentum_decays_untouched_rows_as_stock(centered):
    """A dense step fills every row's rms (and mg), then an IndexedSlices step touching row 2
    only: stock decays every row's slots and moves only row 2; so does the drop-in (its default,
    lazy_sparse=False), while lazy_sparse=True leaves the other rows' slots alone (not stock)."""
    res = {}
    for key, cls, kw in (("stock", stock.legacy.RMSprop, {}), ("tfclip", tk.legacy.RMSprop, {}),
                         ("lazy", tk.legacy.RMSprop, {"lazy_sparse": True})):
        v = tf.Variable(np.linspace(-1, 1, 20).astype(np.float32).reshape(5, 4))
        opt = cls(0.05, centered=centered, **kw)
        opt.apply_gradients([(tf.constant(np.full((5, 4), 0.5, np.float32)), v)])
        opt.apply_gradients([(tf.IndexedSlices(tf.constant([[1.0, -1.0, 2.0, 0.5]]), tf.constant([2]),
                                               tf.constant([5, 4])), v)])
        res[key] = [v.numpy()] + [opt.get_slot(v, n).numpy() for n in (("rms", "mg") if centered else ("rms",))]
    _assert_same(res["tfclip"], res["stock"])
    rms_stock, rms_lazy = res["stock"][1], res["lazy"][1]
    assert not np.allclose(rms_lazy[[0, 1, 3, 4]], rms_stock[[0, 1, 3, 4]])  # stock decayed them
    np.testing.assert_allclose(res["lazy"][0], res["stock"][0], rtol=1e-6)  # the variable: row 2 only


def test_legacy_rmsprop_and_adagrad_put_epsilon_outside_the_sqrt():
    """The epsilon placement is real: with a small accumulator it changes the step, and the
    drop-ins take stock's (lr*g / (sqrt(x) + eps)), not Keras 3's (lr*g / sqrt(x + eps))."""
    for name, kw in (("Adagrad", {"initial_accumulator_value": 0.0}), ("RMSprop", {"rho": 0.0})):
        got = []
        for cls in (stock.legacy, tk.legacy):
            v = tf.Variable([1.0])
            getattr(cls, name)(1.0, epsilon=1e-3, **kw).apply_gradients([(tf.constant([1e-4]), v)])
            got.append(1.0 - v.numpy()[0])
        np.testing.assert_allclose(got, [1e-4 / (1e-4 + 1e-3)] * 2, rtol=1e-5)  # not 1e-4/sqrt(1e-8+1e-3)


def _nadam_steps(cls, kw, dtypes=("float32", "float32"), steps=5, function=False, nan_step=None):
    """Dense steps on two variables (of `dtypes`); the variables and the optimizer's variables
    (iterations, momentum_cache, the m and v slots) after them."""
    v1 = tf.Variable((np.arange(20).reshape(5, 4) / 10 - 1).astype(dtypes[0]))
    v2 = tf.Variable(np.linspace(-1, 1, 6).astype(dtypes[1]))
    opt = cls(**kw)

    def apply(gs):
        opt.apply_gradients(zip(gs, [v1, v2]))

    if function:
        apply = tf.function(apply)
    for s in range(steps):
        g1 = (np.sin(np.arange(20) * 1.3 + s) * 3).reshape(5, 4)
        g2 = np.cos(np.arange(6) + 2 * s) * (s + 1)
        if s == nan_step:
            g2[1] = np.nan
        apply([tf.constant(g1.astype(dtypes[0])), tf.constant(g2.astype(dtypes[1]))])
    return opt, [v1.numpy(), v2.numpy()] + [x.numpy() for x in opt.variables()]


@pytest.mark.parametrize("function", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("kw", [{}, {"clipvalue": 0.4}, {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.9,
                                                         "epsilon": 1e-4, "schedule_decay": 0.01}])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_legacy_nadam_same_bits_as_stock(kw, dtype, function):
    """tf_keras legacy Nadam (0.96^(schedule_decay * t), its product in `momentum_cache`, m and v
    written beta*m + (1-beta)*g, the learning rate not decayed by `decay`): the variables, the
    slots and the product bit for bit (the clip modes that scale by a norm: test_legacy_trajectory
    _matches_stock, within an ulp or two of the clipped gradient)."""
    _, want = _nadam_steps(stock.legacy.Nadam, kw, (dtype, dtype), function=function)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused: no stock fallback
        opt, got = _nadam_steps(tk.legacy.Nadam, kw, (dtype, dtype), function=function)
    assert len(got) == len(want) == 2 + 2 + 4
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"entry {i}")
    assert float(got[3]) != 1.0  # the momentum cache moved
    assert int(opt.iterations.numpy()) == 5 and int(opt.skipped_steps.numpy()) == 0


def test_legacy_nadam_schedule_decay_and_undecayed_learning_rate():
    """The two things the Keras 3 Nadam rule would get wrong, shown to matter: the schedule's
    0.004 scale (Keras 3's 0.96^t differs) and stock's learning rate, which `decay` (holding
    schedule_decay) does not decay."""
    _, want = _nadam_steps(stock.legacy.Nadam, {"learning_rate": 0.1}, steps=3)
    _, got = _nadam_steps(tk.legacy.Nadam, {"learning_rate": 0.1}, steps=3)
    _, k3 = _nadam_steps(tk.Nadam, {"learning_rate": 0.1}, steps=3)
    np.testing.assert_array_equal(got[0], want[0])
    assert np.max(np.abs(k3[0] - want[0])) > 1e-3
    # m_cache after 3 steps: the product of beta_1 (1 - 0.5 0.96^(0.004 t)), in float32
    m = [np.float32(0.9) * (np.float32(1) - np.float32(0.5) * np.float32(0.96) ** (np.float32(0.004) * t))
         for t in (1, 2, 3)]
    np.testing.assert_allclose(got[3], m[0] * m[1] * m[2], rtol=1e-6)


def test_legacy_nadam_mixed_dtypes_as_stock():
    """A float64 and a float32 variable in one step: stock computes the constants per dtype (and
    stores the product from the momentum_cache's dtype, the first variable's): one op per dtype on
    one norm pass."""
    for dtypes in (("float32", "float64"), ("float64", "float32")):
        # (stock's global_clipnorm cannot stack a float32 and a float64 norm)
        for kw in ({}, {"clipvalue": 0.4}, {"clipnorm": 0.5}):
            _, want = _nadam_steps(stock.legacy.Nadam, kw, dtypes)
            _, got = _nadam_steps(tk.legacy.Nadam, kw, dtypes)
            if "clipnorm" in kw:
                _assert_same(got, want)
            else:
                for i, (a, b) in enumerate(zip(got, want)):
                    np.testing.assert_array_equal(a, b, err_msg=f"{dtypes} entry {i}")


def test_legacy_nadam_indexed_slices():
    """Stock's IndexedSlices step decays every row's m and v and moves only the touched rows:
    neither the dense update nor the lazy one. The default runs the stock ops (a warning once);
    lazy_sparse=True is fused and leaves the other rows and their slots alone."""
    _legacy._LEGACY_WARNED.clear()
    _, want = _train(stock.legacy.Nadam, {}, sparse=True)
    with pytest.warns(UserWarning, match="IndexedSlices gradient: stock decays every row"):
        opt, got = _train(tk.legacy.Nadam, {}, sparse=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert opt.lazy_sparse is False
    v0 = np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1
    np.testing.assert_array_equal(want[0][[1, 3, 4]], v0[[1, 3, 4]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lazy, got_lazy = _train(tk.legacy.Nadam, {"lazy_sparse": True}, sparse=True)
    names = [x.name for x in lazy.variables()]
    m = got_lazy[2 + next(i for i, n in enumerate(names) if "emb" in n and "/m:" in n)]
    np.testing.assert_array_equal(m[[1, 3, 4]], 0)  # untouched rows' slots: never written
    np.testing.assert_array_equal(got_lazy[0][[1, 3, 4]], v0[[1, 3, 4]])
    np.testing.assert_array_equal(got_lazy[1], want[1])  # the dense bias: stock's bits
    # the touched rows: the dense update with the duplicates summed (a stock dense step)
    _, dense = _train(stock.legacy.Nadam, {}, grads_fn=lambda s, sp: [
        tf.convert_to_tensor(tf.math.unsorted_segment_sum(*_sparse_parts(s), 5)), _grads(s, False)[1]])
    np.testing.assert_array_equal(got_lazy[0][[0, 2]], dense[0][[0, 2]])


def _sparse_parts(step):
    g = _grads(step, True)[0]
    return g.values, g.indices


def test_legacy_nadam_nonfinite_skip():
    """A skipped step (non-finite norm) writes no variable or slot; `iterations` and the
    momentum_cache advance, as tfclip.tf_keras.Nadam's product does (the schedule follows
    `iterations`). Reference: stock with that step's product advanced by hand."""
    opt, got = _nadam_steps(tk.legacy.Nadam, {"global_clipnorm": 1.0}, steps=4, nan_step=2)
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 4
    ref = stock.legacy.Nadam(global_clipnorm=1.0)
    v1 = tf.Variable((np.arange(20).reshape(5, 4) / 10 - 1).astype("float32"))
    v2 = tf.Variable(np.linspace(-1, 1, 6).astype("float32"))
    for s in range(4):
        if s == 2:
            ref._create_all_weights([v1, v2])
            t = tf.cast(ref.iterations + 1, tf.float32)
            ref._m_cache.assign(ref._m_cache * (0.9 * (1.0 - 0.5 * tf.pow(tf.cast(0.96, tf.float32), 0.004 * t))))
            ref.iterations.assign_add(1)
            continue
        g1 = (np.sin(np.arange(20) * 1.3 + s) * 3).reshape(5, 4).astype("float32")
        g2 = (np.cos(np.arange(6) + 2 * s) * (s + 1)).astype("float32")
        ref.apply_gradients([(tf.constant(g1), v1), (tf.constant(g2), v2)])
    _assert_same(got, [v1.numpy(), v2.numpy()] + [x.numpy() for x in ref.variables()])
    v = tf.Variable([1.0, 2.0])
    opt = tk.legacy.Nadam(nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError):
        opt.apply_gradients([(tf.constant([np.inf, 0.0]), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert float(opt._m_cache.numpy()) == 1.0  # a failed step writes nothing, the product neither


def test_legacy_nadam_bad_arguments():
    with pytest.raises(ValueError, match="schedule_decay"):
        tk.legacy.Nadam(schedule_decay=float("nan"))
    with pytest.raises(ValueError, match="beta_2"):
        tk.legacy.Nadam(beta_2=float("inf"))
    with pytest.raises(ValueError, match="LearningRateSchedule"):  # stock's own refusal
        tk.legacy.Nadam(tf_keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5))


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "jit_compile"])
@pytest.mark.parametrize("kw", [{}, {"global_clipnorm": 0.5}, {"clipnorm": 0.2}])
def test_legacy_nadam_model_fit(jit, kw):
    """model.fit on a dense model (fused, also under XLA), and on an Embedding model (its
    IndexedSlices gradient: the stock step), against stock."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def fit(opt):
        tf_keras.utils.set_random_seed(1)
        m = tf_keras.Sequential([tf_keras.Input((5,)), tf_keras.layers.Dense(4, activation="tanh"),
                                 tf_keras.layers.Dense(1)])
        m.compile(optimizer=opt, loss="mse", jit_compile=jit)
        m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return m, [w.numpy() for w in m.weights] + [v.numpy() for v in _opt_vars(m.optimizer)]

    _, want = fit(stock.legacy.Nadam(0.05, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m, got = fit(tk.legacy.Nadam(0.05, **kw))
    _assert_same(got, want, rtol=1e-5, atol=1e-6)
    assert int(m.optimizer.iterations.numpy()) == 8 and float(m.optimizer.global_norm.numpy()) > 0
    xi = rng.integers(0, 20, (32, 5)).astype("int32")
    _, want = _fit(stock.legacy.Nadam(0.05, **kw), False, xi, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = _fit(tk.legacy.Nadam(0.05, **kw), jit, xi, y)
    _assert_same(got, want, rtol=1e-5, atol=1e-6)


def test_legacy_nonfinite_skip_for_every_class():
    for name, kw in (("RMSprop", {"momentum": 0.9}), ("Adadelta", {}), ("Adamax", {}), ("Ftrl", {}),
                     ("RMSprop", {"centered": True}), ("Adagrad", {})):
        for sparse in (False, True):
            opt, got = _train(getattr(tk.legacy, name), {**kw, "global_clipnorm": 1.0}, steps=4, sparse=sparse,
                              grads_fn=_nan_grads)
            assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 4
            v1 = tf.Variable(np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1)
            v2 = tf.Variable(np.linspace(-1, 1, 6).astype(np.float32))
            ref = getattr(stock.legacy, name)(**kw, global_clipnorm=1.0)
            for s in range(4):
                if s == 2:
                    ref._create_all_weights([v1, v2])
                    ref.iterations.assign_add(1)
                    continue
                ref.apply_gradients(zip(_grads(s, sparse), [v1, v2]))
            _assert_same(got, [v1.numpy(), v2.numpy()] + [v.numpy() for v in ref.variables()])


def test_legacy_loss_scale_optimizer_mixed_precision():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    for name, kw in (("RMSprop", {"momentum": 0.9}), ("Adamax", {}), ("Ftrl", {"global_clipnorm": 1.0}),
                     ("RMSprop", {"clipnorm": 1.0}), ("Adagrad", {"global_clipnorm": 1.0}), ("Nadam", {}),
                     ("Nadam", {"global_clipnorm": 1.0})):
        res = []
        for cls in (getattr(stock.legacy, name), getattr(tk.legacy, name)):
            tf_keras.mixed_precision.set_global_policy("mixed_float16")
            try:
                tf_keras.utils.set_random_seed(2)
                m = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3),
                                         tf_keras.layers.Dense(1, dtype="float32")])
                opt = tf_keras.mixed_precision.LossScaleOptimizer(cls(0.01, **kw))
                m.compile(optimizer=opt, loss="mse")
                m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
                res.append([w.numpy() for w in m.weights])
            finally:
                tf_keras.mixed_precision.set_global_policy("float32")
        _assert_same(res[1], res[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "jit_compile"])
@pytest.mark.parametrize("name,kw", [("Adam", {"global_clipnorm": 0.5}), ("SGD", {"momentum": 0.9, "clipnorm": 0.1}),
                                     ("RMSprop", {"momentum": 0.9, "clipvalue": 0.1}), ("Adadelta", {"clipnorm": 0.2}),
                                     ("Adamax", {"global_clipnorm": 0.5}), ("Ftrl", {"global_clipnorm": 0.5}),
                                     ("RMSprop", {"global_clipnorm": 0.5}), ("Adagrad", {"clipnorm": 0.2})])
def test_legacy_model_fit_embedding(jit, name, kw):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (32, 5)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    # (stock legacy sparse ops (SGD's momentum, RMSprop's, Ftrl's, ...) have no XLA kernel: the
    # reference runs without jit)
    _, want = _fit(getattr(stock.legacy, name)(0.05, **kw), False, x, y)
    _, got = _fit(getattr(tk.legacy, name)(0.05, **kw), jit, x, y)
    _assert_same(got, want, rtol=1e-5, atol=1e-6)


def test_legacy_nonfinite_skip_and_stock_fallback():
    v = tf.Variable([1.0, 2.0])
    opt = tk.legacy.Adam(0.1)
    opt.apply_gradients([(tf.constant([np.nan, 1.0]), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 1
    assert all((x.numpy() == 0).all() for x in opt.get_slot_names() and [opt.get_slot(v, "m"), opt.get_slot(v, "v")])
    # clipvalue with clipnorm: stock applies both, one after the other; tfclip runs the stock step.
    kw = {"clipvalue": 0.3, "clipnorm": 0.4}
    _, want = _train(stock.legacy.SGD, kw)
    with pytest.warns(UserWarning, match="stock tf_keras ops"):
        _, got = _train(tk.legacy.SGD, kw)
    _assert_same(got, want)


def test_jit_without_xla_kernels_runs_the_stock_step(monkeypatch):
    """A build without tfclip's XLA kernels: inside jit_compile=True the stock tf_keras step runs
    (it clips after the all-reduce too), said once."""
    from tfclip import _loader
    from tfclip._engine import xla as _xla

    monkeypatch.setattr(_loader, "_XLA", False)
    monkeypatch.setattr(_xla, "_WARNED", set())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (32, 5)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    _, want = _fit(stock.Adam(0.05, global_clipnorm=0.5), True, x, y)
    with pytest.warns(UserWarning, match="no XLA kernels"):
        _, got = _fit(tk.Adam(0.05, global_clipnorm=0.5), True, x, y)
    _assert_same(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["m.keras", "m.h5"])
def test_model_save_and_load_keep_the_class(tmp_path, fmt):
    for opt, cls in ((tk.Adam(0.1, global_clipnorm=1.0, nonfinite="propagate"), tk.Adam),
                     (tk.legacy.Adam(0.1), tk.legacy.Adam)):
        m = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(1)])
        m.compile(optimizer=opt, loss="mse")
        m.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
        path = str(tmp_path / (type(opt).__module__ + str(id(opt)) + fmt))
        m.save(path)
        loaded = tf_keras.models.load_model(path).optimizer
        assert type(loaded) is cls
        assert loaded.nonfinite == opt.nonfinite


# -- the behaviours tf-keras's own optimizer tests check (optimizer_test.py, legacy/*_test.py),
#    as our own cases against the stock classes ------------------------------------------------
LEGACY_NEW = [("RMSprop", {"momentum": 0.9}), ("Adadelta", {"learning_rate": 1.0}), ("Adamax", {}),
              ("Ftrl", {"l2_shrinkage_regularization_strength": 0.1}), ("RMSprop", {"centered": True}),
              ("Adagrad", {}), ("Nadam", {})]


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("name,kw", LEGACY_NEW + [("SGD", {"momentum": 0.9}), ("Adam", {})])
def test_legacy_other_float_dtypes(name, kw, dtype):
    """legacy/*_test.py run half, float32 and float64 variables; complex ones (which tfclip's
    kernels do not take) run the stock step, said once."""
    res = []
    for cls in (getattr(stock.legacy, name), getattr(tk.legacy, name)):
        v = tf.Variable(np.array([[1.0, -2.0], [0.5, 3.0]], dtype))
        opt = cls(**kw)
        for s in range(3):
            opt.apply_gradients([(tf.constant(np.array([[0.1, -0.2], [0.3, 0.05]]) * (s + 1), dtype), v)])
        res.append([v.numpy()] + [x.numpy() for x in opt.variables()])
    # float64: a few ulps of the values summed in Ftrl's linear slot (which cancel) remain
    tol = 2e-3 if dtype == "float16" else 1e-9
    _assert_same(res[1], res[0], rtol=tol, atol=tol)


def test_legacy_complex_variables_run_the_stock_step():
    _legacy._LEGACY_WARNED.clear()
    res = []
    for cls in (stock.legacy.Adam, tk.legacy.Adam):
        v = tf.Variable([1 + 1j, 2 - 1j], dtype=tf.complex64)
        opt = cls(0.1)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            opt.apply_gradients([(tf.constant([0.5 + 0.5j, -1j], tf.complex64), v)])
        res.append(v.numpy())
    assert any("not complex64" in str(w.message) and "stock tf_keras ops" in str(w.message) for w in rec)
    np.testing.assert_array_equal(res[1], res[0])


@pytest.mark.parametrize("name,kw", LEGACY_NEW + [("Adam", {})])
def test_legacy_callable_hyperparameters(name, kw):
    """Hyper-parameters given as callables (legacy tests' use_callable_params), read per step."""
    calls = {"lr": 0.2}
    callables = {"learning_rate": lambda: calls["lr"]}
    if name == "RMSprop":
        callables.update(rho=lambda: 0.8, momentum=lambda: 0.5)
    if name == "Adadelta":
        callables.update(rho=lambda: 0.9)
    if name in ("Adamax", "Nadam"):
        callables.update(beta_1=lambda: 0.8)
    res = []
    for cls in (getattr(stock.legacy, name), getattr(tk.legacy, name)):
        calls["lr"] = 0.2
        v = tf.Variable([1.0, -2.0, 0.5])
        opt = cls(**{**kw, **callables})
        for s in range(3):
            opt.apply_gradients([(tf.constant([0.1, -0.2, 0.3]) * (s + 1), v)])
            calls["lr"] *= 0.5
        res.append([v.numpy()] + [x.numpy() for x in opt.variables()])
    _assert_same(res[1], res[0])


@pytest.mark.parametrize("name,kw", LEGACY_NEW + [("SGD", {"momentum": 0.9}), ("Adam", {})])
def test_legacy_made_eagerly_applied_in_a_v1_graph(name, kw):
    """optimizer_v2_test: an optimizer constructed eagerly, its step built in a tf.Graph and run in
    a Session (the constructor must not make the hyper variables in the eager context)."""
    res = []
    for cls in (getattr(stock.legacy, name), getattr(tk.legacy, name)):
        opt = cls(**kw)
        with tf.Graph().as_default():
            v = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
            g = tf.compat.v1.placeholder(tf.float32, [2, 2])
            train = opt.apply_gradients([(g, v)])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for s in range(3):
                    sess.run(train, {g: np.array([[0.1, -0.2], [0.3, 0.05]]) * (s + 1)})
                res.append(sess.run([v] + opt.variables()))
    _assert_same(res[1], res[0])


@pytest.mark.parametrize("legacy", [False, True], ids=["new", "legacy"])
def test_set_weights_learning_rate_iterations_and_name(legacy):
    """optimizer_test: set_weights only once built; the learning rate set between steps (and
    by the legacy `lr` name); `iterations` replaced; apply_gradients's name scopes the slots; an
    empty step."""
    mod_s, mod_t = (stock.legacy, tk.legacy) if legacy else (stock, tk)
    res = []
    for mod in (mod_s, mod_t):
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        opt = mod.Adam(1.0)
        opt.apply_gradients(zip([], []))  # nothing to do, no error
        opt.apply_gradients([(tf.constant([[1.0, 2.0], [3.0, 4.0]]), v)], name="dummy")
        slot = opt.get_slot(v, "m") if legacy else opt._momentums[0]
        assert "dummy" in slot.name or legacy  # (legacy slots are named by the variable)
        opt.learning_rate = 0.5
        opt.apply_gradients([(tf.constant([[1.0, -2.0], [3.0, 0.5]]), v)])
        opt.lr = 0.25
        opt.apply_gradients([(tf.constant([[0.3, -2.0], [1.0, 0.5]]), v)])
        assert int(opt.iterations.numpy()) == 3
        fresh = mod.Adam()
        if not legacy:
            with pytest.raises(ValueError, match="You are calling"):
                fresh.set_weights([x.numpy() for x in opt.variables])
            fresh.build([v])
            fresh.set_weights([x.numpy() for x in opt.variables])
            _assert_same([x.numpy() for x in fresh.variables], [x.numpy() for x in opt.variables], 0, 0)
        res.append([v.numpy()] + [x.numpy() for x in _opt_vars(opt) if hasattr(x, "numpy")]
                   if legacy else [v.numpy()] + [x.numpy() for x in opt.variables])
    _assert_same(res[1], res[0])
    if not legacy:
        opt = tk.Adam(jit_compile=False)
        opt.iterations = tf.Variable(2, dtype=tf.int32)
        out = opt.apply_gradients(zip(tf.convert_to_tensor([1.0, 1.0]), [tf.Variable(2.0), tf.Variable(2.0)]))
        assert int(out) == 3 and int(opt.iterations) == 3


@pytest.mark.parametrize("legacy", [False, True], ids=["new", "legacy"])
def test_config_round_trip_with_a_schedule(legacy):
    """optimizer_test.testGetAndFromConfig: a learning-rate schedule and the clip in the config;
    from_config gives tfclip's class with the same config."""
    mod_s, mod_t = (stock.legacy, tk.legacy) if legacy else (stock, tk)
    names = ["SGD", "Adam", "RMSprop", "Adadelta", "Adamax", "Ftrl"] + ([] if legacy else ["Adagrad", "Nadam", "Lion", "AdamW"])
    for name in names:
        sched = tf_keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.9)
        kw = {"learning_rate": sched, "clipnorm": 0.5}
        a, b = getattr(mod_s, name)(**kw), getattr(mod_t, name)(**kw)
        assert b.get_config() == a.get_config(), name
        c = getattr(mod_t, name).from_config(b.get_config())
        assert type(c) is getattr(mod_t, name)
        assert c.get_config() == b.get_config(), name


def test_legacy_tensor_instead_of_a_variable_is_refused_like_stock():
    """optimizer_v2_test.testComputeGradientsWithTensors: a tensor where a variable belongs."""
    x = tf.convert_to_tensor(1.0)
    for cls in (stock.legacy.SGD, tk.legacy.SGD, tk.legacy.Adamax):
        opt = cls(3.0)
        (grad, var), = opt._compute_gradients(lambda: x * x, [x])
        assert var is x and float(grad) == 2.0
        with pytest.raises(NotImplementedError, match="Tensor"):
            opt.apply_gradients([(grad, var)])
