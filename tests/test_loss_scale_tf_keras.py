"""tfclip.tf_keras.LossScaleOptimizer (issue 47): tf_keras's dynamic loss scaling with the unscale
and the finite check folded into a tfclip.tf_keras optimizer's passes in `minimize`
(tfclip/tf_keras/_loss_scale.py).

The reference is the stock tf_keras.mixed_precision.LossScaleOptimizer around the same tfclip
optimizer: the scaled loss's gradients times 1 / scale (written), all checked for inf/NaN, then
the inner step or, for a non-finite one, none. Step for step through growth and back-off, the
variables, slots, iterations, loss scale and counter must have the same bits."""
import numpy as np
import pytest

tf_keras = pytest.importorskip("tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed: "
                               "pip install '.[tf-keras]' to test tfclip.tf_keras")
import tensorflow as tf  # noqa: E402

import tfclip.tf_keras as tk  # noqa: E402
from tfclip.tf_keras._loss_scale import LegacyLossScaleOptimizer  # noqa: E402
from tfclip import _loader  # noqa: E402

INNER = {
    "adam_clip": lambda: tk.Adam(0.01, global_clipnorm=1.0),
    "sgd_momentum": lambda: tk.SGD(0.05, momentum=0.9),
    "adamw_schedule": lambda: tk.AdamW(tf_keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5),
                                       weight_decay=0.05, clipnorm=0.5),
    "adam_int8": lambda: tk.Adam(0.01, global_clipnorm=1.0, state_dtype="int8"),
}


def _same_bits(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), (what, np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _run(wrapper, make_inner, init, coefs, how):
    vars_ = [tf.Variable(x) for x in init]
    opt = wrapper(make_inner(), initial_scale=2.0 ** 15, dynamic_growth_steps=3)

    def step(cs):
        # a loss whose gradients are the coefficients (times the loss scale)
        loss = lambda: sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs))  # noqa: E731
        opt.minimize(loss, vars_)

    run = {"eager": step, "function": tf.function(step), "xla": tf.function(step, jit_compile=True)}[how]
    trace = []
    for c in coefs:
        run([tf.constant(x) for x in c])
        # (a schedule's value as of the last applied step too: checkpointed, and opt.learning_rate)
        lr = getattr(opt.inner_optimizer, "_current_learning_rate", None)
        trace.append([v.numpy() for v in vars_] + [np.asarray(v.numpy()) for v in opt.variables]
                     + [opt.loss_scale.numpy(), opt.dynamic_counter.numpy()]
                     + ([lr.numpy()] if isinstance(lr, tf.Variable) else []))
    return opt, trace


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("how", ["eager", "function", "xla"])
def test_folded_is_the_stock_wrapper_step_for_step(rng, inner, how):
    if how == "xla" and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    coefs = _coefs(rng, init)
    ours, got = _run(tk.LossScaleOptimizer, INNER[inner], init, coefs, how)
    stock, want = _run(tf_keras.mixed_precision.LossScaleOptimizer, INNER[inner], init, coefs, how)
    assert ours.fold_refusal() is None
    for k, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_bits(x, y, f"step {k}")
    # 2**15; steps 0, 1 count; 2 backs off (2**14); 3, 4, 5 grow it (2**15); 6 backs off; 7, 8 count.
    assert float(ours.loss_scale.numpy()) == 2.0 ** 14 and int(ours.dynamic_counter.numpy()) == 2
    assert int(ours.iterations.numpy()) == 9  # (tf_keras counts the skipped steps too)


@pytest.mark.parametrize("make", [lambda: tk.Adam(0.01, global_clipnorm=1.0),
                                  lambda: tk.legacy.Adam(0.01, global_clipnorm=1.0)], ids=["new", "legacy"])
def test_model_fit_under_mixed_float16(rng, folded_steps, make):
    """model.fit (minimize) with tfclip's wrapper given to compile: the fold runs, it trains."""
    tf_keras.utils.set_random_seed(3)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = rng.normal(size=(256, 8)).astype(np.float32)
        y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
        model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16, activation="relu"),
                                     tf_keras.layers.Dense(1, dtype="float32")])
        opt = tk.LossScaleOptimizer(make())
        model.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt
        hist = model.fit(x, y, batch_size=32, epochs=4, verbose=0).history["loss"]
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert hist[-1] < 0.5 * hist[0] and folded_steps
    assert int(opt.iterations.numpy()) == 32
    back = type(opt).from_config(opt.get_config())
    assert type(back.inner_optimizer) is type(opt.inner_optimizer) and back.fold_refusal() is None


def test_a_constrained_variable_runs_the_stock_passes(rng):
    """Stock leaves a constrained variable be on a skipped step; the folded step would run its
    constraint: minimize takes the stock passes, with the stock results."""
    init = [rng.normal(size=(20,)).astype(np.float32)]
    out = []
    for wrapper in (tk.LossScaleOptimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        v = tf.Variable(init[0], constraint=lambda w: tf.clip_by_norm(w, 1.0))
        opt = wrapper(tk.Adam(0.01))
        for k in range(3):
            c = tf.constant(np.inf if k == 1 else 1.0, tf.float32)
            opt.minimize(lambda: tf.reduce_sum(v * c), [v])
        out.append(v.numpy())
    _same_bits(out[0], out[1])


def test_refusals_and_config():
    with pytest.raises(TypeError, match="wraps a tf_keras optimizer"):
        tk.LossScaleOptimizer("adam")
    assert "use_ema" in tk.LossScaleOptimizer(tk.Adam(0.01, use_ema=True)).fold_refusal()
    assert "fixed loss scale" in tk.LossScaleOptimizer(tk.Adam(0.01), dynamic=False, initial_scale=128).fold_refusal()
    assert "not a power of two" in tk.LossScaleOptimizer(tk.Adam(0.01), initial_scale=1000.0).fold_refusal()
    assert "not a tfclip.tf_keras one" in tk.LossScaleOptimizer(tf_keras.optimizers.Adam()).fold_refusal()
    opt = tk.LossScaleOptimizer(tk.Adam(0.01), initial_scale=512.0, dynamic_growth_steps=5)
    back = tk.LossScaleOptimizer.from_config(opt.get_config())
    assert type(back.inner_optimizer) is tk.Adam and back.initial_scale == 512.0 and back.dynamic_growth_steps == 5


@pytest.mark.parametrize("make", [lambda: tk.Adam(0.01, global_clipnorm=1.0),
                                  lambda: tk.legacy.Adam(0.01, global_clipnorm=1.0)], ids=["new", "legacy"])
def test_the_folded_step_has_no_pass_of_its_own(rng, make):
    """The stock wrapper's minimize holds an IsFinite per gradient (and one more for the grown
    scale); the folded one only that last: the op decides, and scales inside its passes."""
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]

    def ops_of(wrapper):
        vars_ = [tf.Variable(x) for x in init]
        opt = wrapper(make())
        def step():
            opt.minimize(lambda: sum(tf.reduce_sum(v * v) for v in vars_), vars_)

        f = tf.function(step)
        gd = f.get_concrete_function().graph.as_graph_def()
        return [n.op for n in gd.node] + [n.op for fn in gd.library.function for n in fn.node_def]

    stock, ours = ops_of(tf_keras.mixed_precision.LossScaleOptimizer), ops_of(tk.LossScaleOptimizer)
    assert stock.count("IsFinite") == len(init) + 1 and ours.count("IsFinite") == 1
    assert sum(t.startswith("TfclipClipApply") for t in ours) == 1


# ---------------------------------------------------------------- legacy (OptimizerV2) inner
LEGACY_INNER = {
    "adam_clip": lambda: tk.legacy.Adam(0.01, global_clipnorm=1.0),
    "nadam": lambda: tk.legacy.Nadam(0.01),  # (its momentum-cache product: stock keeps it on a skip)
    "sgd_momentum_schedule": lambda: tk.legacy.SGD(
        tf_keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5), momentum=0.9, clipnorm=0.5),
    "rmsprop_int8": lambda: tk.legacy.RMSprop(0.01, state_dtype="int8"),
}


def _legacy_run(wrapper, make_inner, init, coefs, how):
    vars_ = [tf.Variable(x) for x in init]
    opt = wrapper(make_inner(), initial_scale=2.0 ** 15, dynamic_growth_steps=3)

    def step(cs):
        opt.minimize(lambda: sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs)), vars_)

    run = {"eager": step, "function": tf.function(step)}[how]
    trace = []
    for c in coefs:
        run([tf.constant(x) for x in c])
        trace.append([v.numpy() for v in vars_] + [np.asarray(v.numpy()) for v in opt.variables()]
                     + [opt.loss_scale.numpy(), opt.dynamic_counter.numpy()])
    return opt, trace


def _coefs(rng, init, bad=(2, 6)):
    out = []
    for k in range(9):
        c = [rng.normal(size=x.shape).astype(np.float32) for x in init]
        if k in bad:
            c[1].flat[3] = np.inf
        out.append(c)
    return out


@pytest.mark.parametrize("inner", sorted(LEGACY_INNER))
@pytest.mark.parametrize("how", ["eager", "function"])
def test_legacy_folded_is_the_stock_wrapper_step_for_step(rng, inner, how, folded_steps):
    """tfclip.tf_keras.LossScaleOptimizer around a tfclip.tf_keras.legacy optimizer is the legacy
    wrapper (as tf_keras's own picks its V2 class), folded, with the stock V2 wrapper's bits."""
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    coefs = _coefs(rng, init)
    ours, got = _legacy_run(tk.LossScaleOptimizer, LEGACY_INNER[inner], init, coefs, how)
    assert folded_steps
    stock, want = _legacy_run(tf_keras.mixed_precision.LossScaleOptimizer, LEGACY_INNER[inner], init, coefs, how)
    assert isinstance(ours, LegacyLossScaleOptimizer) and ours.fold_refusal() is None
    for k, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_bits(x, y, f"step {k}")
    assert float(ours.loss_scale.numpy()) == 2.0 ** 14 and int(ours.dynamic_counter.numpy()) == 2
    assert int(ours.iterations.numpy()) == 9  # (the V2 wrapper counts the skipped steps too)


def test_legacy_in_a_tf1_graph(rng, folded_steps):
    """A TF1 graph's `train_op = opt.minimize(loss_fn)`, run in a Session: the folded op holds
    the inner step, the counter and the loss scale's update; the stock wrapper's bits."""
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]
    coefs = _coefs(rng, init, bad=(1,))
    out = []
    for wrapper in (tk.LossScaleOptimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        with tf.Graph().as_default():
            vars_ = [tf.compat.v1.Variable(x, use_resource=True) for x in init]
            cs = [tf.compat.v1.placeholder(tf.float32, x.shape) for x in init]
            opt = wrapper(tk.legacy.Adam(0.01), initial_scale=2.0 ** 10, dynamic_growth_steps=2)
            train_op = opt.minimize(lambda: sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs)), vars_)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for c in coefs:
                    sess.run(train_op, dict(zip(cs, c)))
                out.append(sess.run(vars_ + [opt.loss_scale, opt.iterations]))
    for a, b in zip(*out):
        _same_bits(a, b)
    assert out[0][-1] == 9 and len(folded_steps) == 1  # (ours: one graph, folded once)


def test_legacy_refusals():
    assert isinstance(tk.LossScaleOptimizer(tk.legacy.Adam(0.01)), LegacyLossScaleOptimizer)
    assert "not a tfclip.tf_keras one" in tk.LossScaleOptimizer(tf_keras.optimizers.legacy.Adam()).fold_refusal()
    assert "not a power of two" in tk.LossScaleOptimizer(tk.legacy.SGD(0.1), initial_scale=3.0).fold_refusal()
    with pytest.raises(TypeError, match="takes a legacy"):
        LegacyLossScaleOptimizer(tk.Adam(0.01))


MIRRORED_PROGRAM = r"""
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_keras
import tfclip.tf_keras as tk
from tfclip._engine import loss_scale as _loss_scale
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]
coefs = []
for k in range(8):
    c = [rng.normal(size=x.shape).astype(np.float32) for x in init]
    if k in (2, 6):
        c[1].flat[3] = np.inf
    coefs.append(c)
calls, real = [], _loss_scale.with_loss_scale
_loss_scale.with_loss_scale = lambda *a: calls.append(1) or real(*a)


def custom_loop(wrapper, make):  # (new and legacy: OptimizerV2's variables is a method)
    with strategy.scope():
        vars_ = [tf.Variable(x) for x in init]
        opt = wrapper(make(), initial_scale=2.0 ** 10, dynamic_growth_steps=2)
    @tf.function
    def train(cs):
        def step(cs):
            opt.minimize(lambda: sum(tf.reduce_sum(v * c) for v, c in zip(vars_, cs)), vars_)
        strategy.run(step, args=(cs,))
    for c in coefs:
        train([tf.constant(x) for x in c])
    for v in vars_:
        a, b = [np.asarray(x) for x in strategy.experimental_local_results(v)]
        assert a.tobytes() == b.tobytes(), v.name
    variables = opt.variables() if callable(opt.variables) else opt.variables
    return [v.numpy() for v in vars_] + [np.asarray(v.numpy()) for v in variables] + [opt.loss_scale.numpy()]


X = rng.normal(size=(128, 8)).astype(np.float32)
Y = (X @ np.arange(8, dtype=np.float32)[:, None] / 8).astype(np.float32)


def fit(wrapper, make):
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        tf_keras.utils.set_random_seed(3)
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16, activation="relu"),
                                         tf_keras.layers.Dense(1, dtype="float32")])
            opt = wrapper(make())
            model.compile(optimizer=opt, loss="mse")
        model.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    return [w.numpy() for w in model.weights] + [opt.loss_scale.numpy()]


CASES = [(custom_loop, lambda: tk.Adam(0.01, global_clipnorm=1.0)),
         (custom_loop, lambda: tk.SGD(tf_keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5), momentum=0.9)),
         (custom_loop, lambda: tk.legacy.Adam(0.01, global_clipnorm=1.0)),
         (custom_loop, lambda: tk.legacy.Nadam(0.01)),
         (fit, lambda: tk.Adam(0.01, global_clipnorm=1.0)),
         (fit, lambda: tk.legacy.Adam(0.01))]
for run, make in CASES:
    n0 = len(calls)
    ours = run(tk.LossScaleOptimizer, make)
    assert len(calls) > n0, "the fold did not run"
    n1 = len(calls)
    stock = run(tf_keras.mixed_precision.LossScaleOptimizer, make)
    assert len(calls) == n1 and len(ours) == len(stock)
    for a, b in zip(ours, stock):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (run.__name__, a, b)
print("OK")
"""


def test_mirrored_strategy_folds_with_the_stock_results(tmp_path):
    """Under MirroredStrategy (2 logical CPUs: a fresh process) each replica runs the folded step
    on its own copies and the loss scale (and a schedule's stored value) is updated once, from the
    cross-replica context: custom loops with two skipped steps (new: Adam with a clip, SGD with a
    schedule; legacy: Adam with a clip, Nadam) and model.fit under mixed_float16 (new and legacy)
    end with the stock wrapper's bits, the replicas' copies alike."""
    import os
    import subprocess
    import sys

    import tfclip
    root = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
    # (cwd away from the checkout: `python -c` puts cwd first on sys.path)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", MIRRORED_PROGRAM], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
