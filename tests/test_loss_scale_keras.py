"""tfclip.keras.LossScaleOptimizer (issue 47): Keras 3's dynamic loss scaling with the unscale and
the finite check folded into a tfclip optimizer's passes (tfclip/keras/_loss_scale.py).

The reference is the stock keras.optimizers.LossScaleOptimizer around the same tfclip optimizer:
it checks every gradient for inf/NaN, divides every gradient by the scale, then runs the inner
step. Step for step, through growth (the scale doubling every dynamic_growth_steps applied steps)
and back-off (a non-finite step: nothing written, the scale halved, iterations not advanced),
the variables, slots, iterations, dynamic_scale and step_counter must have the same bits."""
import numpy as np
import pytest

keras = pytest.importorskip("keras", minversion="3", reason="tfclip.keras needs Keras 3")
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
import tfclip.keras  # noqa: E402
from tfclip import _loader  # noqa: E402

INNER = {
    "adam_clip": lambda: tfclip.keras.Adam(0.01, global_clipnorm=1.0),
    "sgd_momentum": lambda: tfclip.keras.SGD(0.05, momentum=0.9),
    "adam_schedule": lambda: tfclip.keras.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)),
    "adamw_clipnorm": lambda: tfclip.keras.AdamW(0.01, weight_decay=0.05, clipnorm=0.5),
    "adam_int8": lambda: tfclip.keras.Adam(0.01, global_clipnorm=1.0, state_dtype="int8"),
}


def _same_bits(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), (what, np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _grads(rng, init, steps=9, bad=(2, 6)):
    """Loss-scaled gradients (about 2**15 times a unit one); an inf at the steps `bad`."""
    out = []
    for k in range(steps):
        g = [np.asarray(rng.normal(size=x.shape) * 2.0 ** 15, np.float32) for x in init]
        if k in bad:
            g[0].flat[0] = np.inf
        out.append(g)
    return out


def _run(wrapper, make_inner, init, grads, how):
    vars_ = [keras.Variable(x) for x in init]
    opt = wrapper(make_inner(), initial_scale=2.0 ** 15, dynamic_growth_steps=3)
    opt.build(vars_)

    def step(gs):
        opt.apply(gs, vars_)

    run = {"eager": step, "function": tf.function(step), "xla": tf.function(step, jit_compile=True)}[how]
    trace = []
    for g in grads:
        run([tf.constant(x) for x in g])
        trace.append([v.numpy() for v in vars_] + [np.asarray(v.numpy()) for v in opt.variables])
    return opt, trace, run


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("how", ["eager", "function", "xla"])
def test_folded_is_the_stock_wrapper_step_for_step(rng, inner, how):
    if how == "xla" and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30), ()]]
    grads = _grads(rng, init)
    ours, got, _ = _run(tfclip.keras.LossScaleOptimizer, INNER[inner], init, grads, how)
    stock, want, _ = _run(keras.optimizers.LossScaleOptimizer, INNER[inner], init, grads, how)
    assert ours.fold_refusal(grads[0]) is None
    assert len(ours.variables) == len(stock.variables)
    for k, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            _same_bits(x, y, f"step {k}")
    # Two back-offs, growth in between: the state the stock wrapper keeps.
    assert int(ours.inner_optimizer.iterations.numpy()) == len(grads) - 2
    assert float(ours.dynamic_scale.numpy()) == float(stock.dynamic_scale.numpy())
    assert int(ours.step_counter.numpy()) == int(stock.step_counter.numpy())
    # 2**15; steps 0, 1 grow the counter; 2 backs off (2**14); 3, 4, 5 make three: 2**15; 6
    # backs off (2**14); 7, 8: the counter at 2.
    assert float(ours.dynamic_scale.numpy()) == 2.0 ** 14 and int(ours.step_counter.numpy()) == 2


def test_the_folded_step_has_no_pass_of_its_own(rng):
    """The stock wrapper's step holds an IsFinite per gradient and a RealDiv per gradient; the
    folded one neither: the op does both in its passes."""
    init = [rng.normal(size=s).astype(np.float32) for s in [(30,), (4, 5)]]

    def ops_of(wrapper):
        vars_ = [keras.Variable(x) for x in init]
        opt = wrapper(tfclip.keras.Adam(0.01, global_clipnorm=1.0))
        opt.build(vars_)
        f = tf.function(lambda gs: opt.apply(gs, vars_))
        gd = f.get_concrete_function([tf.TensorSpec(x.shape, tf.float32) for x in init]).graph.as_graph_def()
        # (the conds' branches are functions of the graph's library)
        return [n.op for n in gd.node] + [n.op for fn in gd.library.function for n in fn.node_def]

    stock, ours = ops_of(keras.optimizers.LossScaleOptimizer), ops_of(tfclip.keras.LossScaleOptimizer)
    # (Both keep the scalar divisions: Adam's bias corrections, the folded one's 1 / scale.)
    assert stock.count("IsFinite") == len(init) and ours.count("IsFinite") == 0
    assert stock.count("RealDiv") - ours.count("RealDiv") == len(init) - 1
    assert sum(t.startswith("TfclipClipApply") for t in ours) == 1


def test_model_fit_under_mixed_float16(rng, folded_steps):
    """model.fit with mixed_float16 and tfclip's wrapper given to compile (which keeps a
    LossScaleOptimizer it is given): the fold runs (the step is built through it), it trains,
    the scale stays a power of two."""
    keras.utils.set_random_seed(2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = rng.normal(size=(256, 8)).astype(np.float32)
        y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        opt = tfclip.keras.LossScaleOptimizer(tfclip.keras.Adam(0.01, global_clipnorm=1.0))
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        assert model.optimizer is opt
        hist = model.fit(x, y, batch_size=32, epochs=4, verbose=0).history["loss"]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert hist[-1] < 0.5 * hist[0] and folded_steps
    scale = float(opt.dynamic_scale.numpy())
    assert scale == 2.0 ** round(np.log2(scale))
    assert int(opt.iterations.numpy()) <= 32


def test_config_round_trip_and_refusals(rng):
    opt = tfclip.keras.LossScaleOptimizer(tfclip.keras.Adam(0.01), initial_scale=256.0, dynamic_growth_steps=7)
    back = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(back) is tfclip.keras.LossScaleOptimizer and type(back.inner_optimizer) is tfclip.keras.Adam
    assert back.initial_scale == 256.0 and back.dynamic_growth_steps == 7
    g = [tf.ones([3])]
    assert "not a tfclip.keras one" in tfclip.keras.LossScaleOptimizer(keras.optimizers.Adam()).fold_refusal(g, [])
    assert "use_ema" in tfclip.keras.LossScaleOptimizer(tfclip.keras.Adam(use_ema=True)).fold_refusal(g, [])
    assert "AGC" in tfclip.keras.LossScaleOptimizer(
        tfclip.keras.Adam(clip=tfclip.clipping.AGC(0.01))).fold_refusal(g, [])
    assert "not a power of two" in tfclip.keras.LossScaleOptimizer(
        tfclip.keras.Adam(), initial_scale=1000.0).fold_refusal(g, [])
    constrained = [keras.Variable(np.zeros(3, np.float32))]
    constrained[0].constraint = keras.constraints.NonNeg()  # (as Layer.add_weight sets it)
    assert "constraint" in tfclip.keras.LossScaleOptimizer(tfclip.keras.Adam()).fold_refusal(g, constrained)


def test_refused_fold_runs_the_stock_wrapper(rng):
    """Where the fold does not apply (use_ema here) the stock wrapper's passes run: the same
    trajectory as the stock wrapper around the same optimizer."""
    init = [rng.normal(size=(50,)).astype(np.float32)]
    grads = _grads(rng, init, steps=5, bad=(1,))
    make = lambda: tfclip.keras.Adam(0.01, use_ema=True)  # noqa: E731
    _, got, _ = _run(tfclip.keras.LossScaleOptimizer, make, init, grads, "eager")
    _, want, _ = _run(keras.optimizers.LossScaleOptimizer, make, init, grads, "eager")
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            _same_bits(x, y)


def test_the_unscale_being_folded_is_the_building_threads_own():
    """Another thread stepping the same inner optimizer meanwhile does not see it (nor, eagerly,
    run at the same time: the optimizer's lock), and it is gone afterwards."""
    import threading

    from tfclip._engine import loss_scale as _loss_scale

    opt, seen = tfclip.keras.Adam(0.01), []

    def apply():
        t = threading.Thread(target=lambda: seen.append(_loss_scale.loss_scale(opt)))
        t.start()
        t.join()
        seen.append(_loss_scale.loss_scale(opt))

    assert bool(_loss_scale.with_loss_scale(opt, 0.5, apply))  # (no fused step ran: counted as applied)
    assert seen == [None, 0.5] and _loss_scale.loss_scale(opt) is None


MIRRORED_PROGRAM = r"""
import sys
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import tfclip.keras as tk
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


def custom_loop(wrapper):
    with strategy.scope():
        vars_ = [keras.Variable(x) for x in init]
        opt = wrapper(tk.Adam(0.01, global_clipnorm=1.0), initial_scale=2.0 ** 10, dynamic_growth_steps=2)
        opt.build(vars_)

    @tf.function
    def train(cs):
        def step(cs):
            opt.apply([c * tf.cast(opt.dynamic_scale, tf.float32) for c in cs], vars_)  # scaled gradients
        strategy.run(step, args=(cs,))

    for c in coefs:
        train([tf.constant(x) for x in c])
    for v in vars_:  # the replicas' copies alike
        a, b = [np.asarray(x) for x in strategy.experimental_local_results(v.value)]
        assert a.tobytes() == b.tobytes(), v.name
    return [v.numpy() for v in vars_] + [np.asarray(v.numpy()) for v in opt.variables] + [
        opt.inner_optimizer.iterations.numpy()]


X = rng.normal(size=(128, 8)).astype(np.float32)
Y = (X @ np.arange(8, dtype=np.float32)[:, None] / 8).astype(np.float32)


def fit(wrapper):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(3)
        x, y = X, Y
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1, dtype="float32")])
            opt = wrapper(tk.Adam(0.01, global_clipnorm=1.0))
            model.compile(optimizer=opt, loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return [w.numpy() for w in model.weights] + [np.asarray(v.numpy()) for v in opt.variables]


for run in (custom_loop, fit):
    n0 = len(calls)
    ours = run(tk.LossScaleOptimizer)
    assert len(calls) > n0, "the fold did not run"
    n1 = len(calls)
    stock = run(keras.optimizers.LossScaleOptimizer)
    assert len(calls) == n1
    assert len(ours) == len(stock)
    for a, b in zip(ours, stock):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (run.__name__, a, b)
print("OK")
"""


def test_mirrored_strategy_folds_with_the_stock_results(tmp_path):
    """Under MirroredStrategy (2 logical CPUs: a fresh process) each replica runs the folded step
    on its own copies and the loss scale is updated once: a custom loop (two skipped steps) and
    model.fit under mixed_float16 end with the stock wrapper's bits, the copies alike."""
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
