"""Adaptive clipping (tfclip.clipping: ZClip, AutoClip) against NumPy float64 references written
from the papers' definitions (tests/reference.py), over many steps with injected gradient spikes,
from every front door."""
import math

import numpy as np
import pytest
import tensorflow as tf

import reference
import tfclip
from tfclip import _loader, clipping

LR = 0.1
SPIKES = (31, 47, 48)  # gradients x100 at these steps


def _skip_jit_without_xla_kernels(graph):
    """fused_clip_apply under jit_compile needs tfclip's XLA kernels (built for TF 2.17-2.21)."""
    if graph == "jit_compile":
        from test_xla import HAVE_XLA, WHY

        if not HAVE_XLA:
            pytest.skip(f"tfclip was built without its XLA kernels (TF 2.17 to 2.21): {WHY}")


def _grads(steps, shapes, seed=0, spikes=SPIKES, nan_at=()):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        scale = 100.0 if t in spikes else 1.0 + 0.2 * math.sin(t / 3.0)
        gs = [rng.normal(size=s) * scale for s in shapes]
        if t in nan_at:
            gs[0].flat[0] = np.nan
        out.append(gs)
    return out


def _sgd_reference(grad_steps, targets, init, lr=LR):
    """SGD with each step's gradients scaled as TF's clip_by_global_norm scales them to the
    target (None: not clipped); a None step in `skipped` is not applied."""
    w = [np.array(x, np.float64) for x in init]
    for gs, target in zip(grad_steps, targets):
        n = reference.global_norm(gs)
        if not np.isfinite(n):
            continue
        scale = 1.0 if target is None else target * min(1.0 / n, 1.0 / target)
        w = [x - lr * g * scale for x, g in zip(w, gs)]
    return w


SHAPES = [(6, 5), (5,), (3, 2, 4)]
ZCLIP_CASES = [
    dict(warmup_steps=25),
    dict(warmup_steps=10, clip_to="mean", alpha=0.9),
    dict(warmup_steps=5, z_thresh=2.0, max_norm=9.0),
    dict(warmup_steps=8, skip_update_on_spike=True),
]


@pytest.mark.parametrize("case", ZCLIP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("graph", [False, True, "jit_compile"], ids=["eager", "tf.function", "jit_compile"])
def test_zclip_follows_the_float64_reference_step_by_step(case, graph):
    _skip_jit_without_xla_kernels(graph)
    steps = 60
    grad_steps = _grads(steps, SHAPES)
    norms = [reference.global_norm(gs) for gs in grad_steps]
    ref = reference.zclip_targets(norms, **case)
    init = [np.ones(s) for s in SHAPES]
    variables = [tf.Variable(x) for x in init]
    clip = clipping.ZClip(**case)
    rule = tfclip.rules.SGD(LR)

    def step(gs):
        return tfclip.fused_clip_apply(zip(gs, variables), rule, clip=clip)

    step_fn = tf.function(step, jit_compile=graph == "jit_compile") if graph else step
    for t, gs in enumerate(grad_steps):
        result = step_fn([tf.constant(g) for g in gs])
        target, mu, s2 = ref[t]
        assert bool(result.applied)
        assert float(result.global_norm) == pytest.approx(norms[t], rel=1e-6)
        want = _sgd_reference(grad_steps[: t + 1], [r[0] for r in ref[: t + 1]], init)
        for v, w in zip(variables, want):
            np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-12, err_msg=f"step {t}")
        assert int(clip.state["count"].numpy()) == t + 1
        if mu is not None:
            assert float(clip.state["mean"].numpy()) == pytest.approx(mu, rel=1e-12)
            assert float(clip.state["var"].numpy()) == pytest.approx(s2, rel=1e-10)
    # The spikes were clipped back to near the running mean; the other steps (past the warm-up)
    # were not clipped at all.
    for t in SPIKES:
        assert ref[t][0] is not None and ref[t][0] < 3 * np.mean(norms[:25]), t
    clipped = [t for t in range(steps) if ref[t][0] is not None]
    if "max_norm" not in case:
        assert set(clipped) <= set(SPIKES) | {t for t in range(steps) if norms[t] > 1.5 * np.median(norms)}


@pytest.mark.parametrize("percentile,history", [(10.0, 1000), (50.0, 16), (0.0, 7), (100.0, 5), (37.5, 9)])
def test_autoclip_follows_the_float64_reference_step_by_step(percentile, history):
    steps = 50
    grad_steps = _grads(steps, SHAPES, seed=1)
    norms = [reference.global_norm(gs) for gs in grad_steps]
    targets = reference.autoclip_targets(norms, percentile, history)
    init = [np.zeros(s) for s in SHAPES]
    variables = [tf.Variable(x) for x in init]
    clip = clipping.AutoClip(percentile=percentile, history_size=history)
    rule = tfclip.rules.SGD(LR)
    @tf.function
    def step_fn(gs):
        tfclip.fused_clip_apply(zip(gs, variables), rule, clip=clip)
        return clip.last_step.threshold  # (in a tf.function, last_step holds the graph's tensors)

    for t, gs in enumerate(grad_steps):
        threshold = step_fn([tf.constant(g) for g in gs])
        want = _sgd_reference(grad_steps[: t + 1], targets[: t + 1], init)
        for v, w in zip(variables, want):
            np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-12, err_msg=f"step {t}")
    # The threshold of the last step is the percentile of the last `history` norms.
    assert float(threshold) == pytest.approx(np.percentile(norms[-history:], percentile), rel=1e-12)
    if percentile <= 50:
        for t in SPIKES:
            assert targets[t] is not None and targets[t] < 10 * np.median(norms[:30])


def test_a_spike_is_clipped_back_and_normal_steps_are_not():
    grad_steps = _grads(40, SHAPES, seed=2, spikes=(35,))
    variables = [tf.Variable(np.zeros(s)) for s in SHAPES]
    rule = tfclip.rules.SGD(1.0)
    clip = clipping.ZClip(warmup_steps=10)
    for t, gs in enumerate(grad_steps):
        before = [v.numpy().copy() for v in variables]
        tfclip.fused_clip_apply(zip([tf.constant(g) for g in gs], variables), rule, clip=clip)
        moved = math.sqrt(sum(np.sum((v.numpy() - b) ** 2) for v, b in zip(variables, before)))
        n = reference.global_norm(gs)
        if t == 35:
            assert moved < 0.05 * n  # x100: clipped back to about the usual norm
            assert bool(clip.last_step.clipped)
        else:
            assert moved == pytest.approx(n, rel=1e-12)
            assert not bool(clip.last_step.clipped)


@pytest.mark.parametrize("policy", ["skip", "propagate", "raise"])
def test_a_non_finite_norm_leaves_the_statistics_alone(policy):
    grad_steps = _grads(30, SHAPES, seed=3, spikes=(), nan_at=(20,))
    variables = [tf.Variable(np.zeros(s)) for s in SHAPES]
    rule = tfclip.rules.SGD(LR)
    clip = clipping.ZClip(warmup_steps=10)
    for t, gs in enumerate(grad_steps):
        before = {k: v.numpy().copy() for k, v in clip.state.items()} if clip.state else None
        if t == 20 and policy == "raise":
            with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
                tfclip.fused_clip_apply(zip([tf.constant(g) for g in gs], variables), rule, clip=clip,
                                        nonfinite=policy)
        else:
            r = tfclip.fused_clip_apply(zip([tf.constant(g) for g in gs], variables), rule, clip=clip,
                                        nonfinite=policy)
            assert bool(r.applied) == (t != 20 or policy == "propagate")
        if t == 20:
            for k, v in clip.state.items():
                np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
    norms = [reference.global_norm(gs) for gs in grad_steps]
    _, mu, s2 = reference.zclip_targets(norms, warmup_steps=10)[-1]
    assert float(clip.state["mean"].numpy()) == pytest.approx(mu, rel=1e-12)
    assert float(clip.state["var"].numpy()) == pytest.approx(s2, rel=1e-10)


def test_indexed_slices_and_mixed_dtypes_take_the_norm_of_their_values():
    rng = np.random.default_rng(4)
    emb = tf.Variable(np.ones((10, 3), np.float32))
    dense = tf.Variable(np.ones((4,), np.float64))
    rule = tfclip.rules.Adam(1e-2)
    clip = clipping.AutoClip(percentile=50, history_size=8)
    norms = []
    for t in range(12):
        k = 50.0 if t == 9 else 1.0
        vals = (rng.normal(size=(3, 3)) * k).astype(np.float32)
        idx = np.array([1, 4, 1])
        gd = rng.normal(size=4) * k
        norms.append(reference.global_norm([vals, gd]))
        r = tfclip.fused_clip_apply(
            [(tf.IndexedSlices(tf.constant(vals), tf.constant(idx), tf.constant([10, 3])), emb),
             (tf.constant(gd), dense)], rule, clip=clip)
        np.testing.assert_allclose(r.tensor_norms.numpy(),
                                   [np.linalg.norm(vals.astype(np.float64)), np.linalg.norm(gd)], rtol=1e-6)
        target = reference.autoclip_targets(norms, 50, 8)[-1]
        assert bool(clip.last_step.clipped) == (target is not None)
        if target is not None:
            assert float(clip.last_step.clip) == pytest.approx(target, rel=1e-6)  # a float32 value's norm
    assert reference.autoclip_targets(norms, 50, 8)[9] is not None


def test_the_state_checkpoints_and_a_restored_run_continues_identically(tmp_path):
    grad_steps = _grads(40, SHAPES, seed=5)

    def run(steps, clip, variables, rule):
        for gs in steps:
            tfclip.fused_clip_apply(zip([tf.constant(g) for g in gs], variables), rule, clip=clip)

    def fresh():
        return clipping.ZClip(warmup_steps=6), [tf.Variable(np.zeros(s)) for s in SHAPES], tfclip.rules.Adam(1e-2)

    clip, variables, rule = fresh()
    run(grad_steps, clip, variables, rule)
    clip2, variables2, rule2 = fresh()
    run(grad_steps[:20], clip2, variables2, rule2)
    ckpt = tf.train.Checkpoint(clip=clip2, variables=variables2, rule=rule2.variables)
    path = ckpt.save(str(tmp_path / "c"))
    clip3, variables3, rule3 = fresh()
    rule3._make_state(variables3)
    clip3.build()
    tf.train.Checkpoint(clip=clip3, variables=variables3, rule=rule3.variables).restore(path).assert_consumed()
    assert int(clip3.state["count"].numpy()) == 20
    run(grad_steps[20:], clip3, variables3, rule3)
    for a, b in zip(variables, variables3):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for k in clip.state:
        np.testing.assert_array_equal(clip.state[k].numpy(), clip3.state[k].numpy())


def test_a_named_mode_keeps_its_state_on_the_rule():
    v = tf.Variable(np.zeros(3))
    rule = tfclip.rules.SGD(LR)
    for _ in range(3):
        tfclip.fused_clip_apply([(tf.constant([1.0, 2.0, 3.0], tf.float64), v)], rule, clip="autoclip")
    names = [x.name for x in rule.variables]
    assert any("autoclip_count" in n for n in names) and any("autoclip_history" in n for n in names)
    count = [x for x in rule.variables if "autoclip_count" in x.name][0]
    assert int(count.numpy()) == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(clip="zclip", global_clipnorm=1.0), "cannot be combined with global_clipnorm"),
    (dict(clip="agc-ish"), "clip must be one of"),
    (dict(clip=clipping.ZClip, clipvalue=0.5), "clip must be one of"),
])
def test_bad_clip_arguments_are_refused_by_name(kwargs, match):
    v = tf.Variable(np.zeros(2))
    with pytest.raises(ValueError, match=match):
        tfclip.fused_clip_apply([(tf.constant([1.0, 1.0], tf.float64), v)], tfclip.rules.SGD(0.1), **kwargs)
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])


@pytest.mark.parametrize("cls,kwargs,match", [
    (clipping.ZClip, dict(alpha=1.0), "alpha"),
    (clipping.ZClip, dict(alpha=0.0), "alpha"),
    (clipping.ZClip, dict(z_thresh=-1), "z_thresh"),
    (clipping.ZClip, dict(warmup_steps=2.5), "warmup_steps"),
    (clipping.ZClip, dict(warmup_steps=0), "warmup_steps"),
    (clipping.ZClip, dict(clip_to="median"), "clip_to"),
    (clipping.ZClip, dict(max_norm=math.inf), "max_norm"),
    (clipping.AutoClip, dict(percentile=101), "percentile"),
    (clipping.AutoClip, dict(percentile=-1), "percentile"),
    (clipping.AutoClip, dict(history_size=0), "history_size"),
])
def test_bad_settings_are_refused_by_name(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_one_clip_object_serves_one_rule():
    clip = clipping.ZClip()
    v = tf.Variable(np.zeros(2))
    first = tfclip.rules.SGD(0.1)
    tfclip.fused_clip_apply([(tf.constant([1.0, 1.0], tf.float64), v)], first, clip=clip)
    with pytest.raises(ValueError, match="already serves"):
        tfclip.fused_clip_apply([(tf.constant([1.0, 1.0], tf.float64), v)], tfclip.rules.SGD(0.1), clip=clip)


def test_compat_v1_graph_session_takes_an_adaptive_clip():
    """TF1 code as written: the clip's state joins the graph's variables, Saver saves it."""
    grad_steps = _grads(30, [(3, 2)], seed=6, spikes=(25,))
    norms = [reference.global_norm(gs) for gs in grad_steps]
    targets = [r[0] for r in reference.zclip_targets(norms, warmup_steps=10)]
    want = _sgd_reference(grad_steps, targets, [np.ones((3, 2))])[0]
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.ones((3, 2)), use_resource=True)
        g = tf.compat.v1.placeholder(tf.float64, [3, 2])
        opt = tfclip.compat.v1.GradientDescentOptimizer(LR, clip=clipping.ZClip(warmup_steps=10))
        train = opt.apply_gradients([(g, w)])
        names = [v.name for v in tf.compat.v1.global_variables()]
        assert any("zclip_mean" in n for n in names), names
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for gs in grad_steps:
                sess.run(train, {g: gs[0]})
            got = sess.run(w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ Keras 3
needs_keras3 = pytest.mark.skipif(tfclip._KERAS_PROBLEM is not None,
                                  reason="tfclip.keras needs Keras 3 (TF 2.15 ships Keras 2)")
if tfclip._KERAS_PROBLEM is None:
    import keras


def _stock_under(how):
    """Whether the Keras step runs stock Keras ops: the XLA fallback, forced, or jit_compile in a
    build without tfclip's XLA kernels (built against TF < 2.21: the TF-version matrix)."""
    from tfclip import _loader

    return how == "xla_fallback" or (how == "jit_compile" and not _loader.xla_kernels())


def _scaled_steps(grad_steps, targets):
    """Each step's gradients as the reference clips them (None targets: as they are)."""
    out = []
    for gs, target in zip(grad_steps, targets):
        n = reference.global_norm(gs)
        scale = 1.0 if target is None else target * min(1.0 / n, 1.0 / target)
        out.append([g * scale for g in gs])
    return out


@needs_keras3
@pytest.mark.parametrize("how", ["eager", "tf.function", "jit_compile", "xla_fallback"])
@pytest.mark.parametrize("make_clip,ref", [
    (lambda: clipping.ZClip(warmup_steps=10), lambda n: [r[0] for r in reference.zclip_targets(n, warmup_steps=10)]),
    (lambda: clipping.AutoClip(percentile=25, history_size=12), lambda n: reference.autoclip_targets(n, 25, 12)),
], ids=["zclip", "autoclip"])
def test_keras_adam_with_an_adaptive_clip_is_stock_adam_on_the_reference_clipped_gradients(how, make_clip, ref,
                                                                                          monkeypatch):
    """xla_fallback: a build without tfclip's XLA kernels, under jit_compile, takes stock Keras ops
    (with a warning), the adaptive clip computed the same way."""
    if how == "xla_fallback":
        from tfclip._engine import xla as _xla

        monkeypatch.setattr(_loader, "_XLA", False)
        monkeypatch.setattr(_xla, "_WARNED", {"keras"})
    grad_steps = _grads(40, SHAPES, seed=7)
    targets = ref([reference.global_norm(gs) for gs in grad_steps])
    assert any(t is not None for t in targets)
    init = [np.full(s, 0.5) for s in SHAPES]
    ours, unclipped, stock = ([keras.Variable(x, dtype="float64") for x in init] for _ in range(3))
    opt = tfclip.keras.Adam(1e-2, clip=make_clip())
    # Fed the reference's clipped gradients: tfclip's Adam without a clip (the same arithmetic:
    # to the last bits), and stock Keras Adam (whose float64 step differs from tfclip's, with or
    # without a clip, near float32 rounding: 3e-7 here).
    plain_opt, stock_opt = tfclip.keras.Adam(1e-2), keras.optimizers.Adam(1e-2)

    def step(gs):
        opt.apply(gs, ours)

    if how != "eager":
        step = tf.function(step, jit_compile=how in ("jit_compile", "xla_fallback"))
    for gs, clipped in zip(grad_steps, _scaled_steps(grad_steps, targets)):
        step([tf.constant(g) for g in gs])
        plain_opt.apply([tf.constant(g) for g in clipped], unclipped)
        stock_opt.apply([tf.constant(g) for g in clipped], stock)
    # (The XLA fallback runs stock Keras's Adam, its norm in float32: it is the stock result that
    # it matches closely.)
    close, loose = (stock, unclipped) if _stock_under(how) else (unclipped, stock)
    tight = 1e-7 if _stock_under(how) else 1e-10
    for a, b, c in zip(ours, close, loose):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=tight, atol=1e-12)
        np.testing.assert_allclose(a.numpy(), c.numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.clipped_steps.numpy()) == sum(t is not None for t in targets)
    assert int(opt.clip.state["count"].numpy()) == 40


@needs_keras3
def test_keras_fit_saves_and_loads_the_clip_and_its_state(tmp_path):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.normal(size=(64, 1)).astype(np.float32)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=tfclip.keras.SGD(0.05, clip=clipping.ZClip(warmup_steps=4, z_thresh=2.0)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    opt = model.optimizer
    names = [v.path for v in opt.variables]
    assert any(n.endswith("zclip_mean") for n in names), names
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lo = loaded.optimizer
    assert isinstance(lo.clip, clipping.ZClip) and lo.clip.get_config() == opt.clip.get_config()
    for k in ("count", "mean", "var", "warmup_norms"):
        np.testing.assert_array_equal(lo.clip.state[k].numpy(), opt.clip.state[k].numpy(), err_msg=k)
    # Both continue identically.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(opt.clip_threshold.numpy()) > 0


@needs_keras3
def test_keras_refuses_a_fixed_clip_beside_an_adaptive_one():
    with pytest.raises(ValueError, match="cannot be combined with global_clipnorm"):
        tfclip.keras.Adam(1e-3, clip="zclip", global_clipnorm=1.0)
    with pytest.raises(ValueError, match="clip must be one of"):
        tfclip.keras.Adam(1e-3, clip="sometimes")


@needs_keras3
def test_gradient_norm_logger_writes_the_adaptive_threshold(tmp_path):
    from test_clip_norm_logger_keras import read_events

    rng = np.random.default_rng(9)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = rng.normal(size=(80, 1)).astype(np.float32)
    x[60:64] *= 200.0  # a spike at step 16
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = tfclip.keras.SGD(0.01, clip=clipping.ZClip(warmup_steps=5))
    model.compile(optimizer=opt, loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(
        (float(opt.global_norm.numpy()), float(opt.clip_threshold.numpy()))))
    log_dir = str(tmp_path / "logs")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[tfclip.keras.GradientNormLogger(log_dir, every_n_steps=1), record])
    events, _ = read_events(log_dir)
    thr = {s: float(v) for s, v in events["gradients/clip_threshold"]}
    assert sorted(thr) == list(range(1, 21))
    for step, (norm, threshold) in enumerate(seen, 1):
        assert thr[step] == pytest.approx(threshold, rel=1e-6) if np.isfinite(threshold) else np.isinf(thr[step])
    norms = [n for n, _ in seen]
    ref = reference.zclip_targets(norms, warmup_steps=5)
    assert ref[15][0] is not None  # the spike was clipped ...
    fraction = {s: float(v) for s, v in events["gradients/clip_fraction"]}
    assert fraction[16] == 1.0 and sum(fraction.values()) == sum(r[0] is not None for r in ref)


# ------------------------------------------------------------------ tf_keras (Keras 2)
@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_tf_keras_sgd_with_zclip_follows_the_reference(legacy, graph):
    tf_keras = pytest.importorskip("tf_keras", reason="tf-keras is the optional Keras 2 extra")
    import tfclip.tf_keras as tk

    grad_steps = _grads(40, SHAPES, seed=10)
    norms = [reference.global_norm(gs) for gs in grad_steps]
    targets = [r[0] for r in reference.zclip_targets(norms, warmup_steps=8)]
    init = [np.full(s, 0.25) for s in SHAPES]
    variables = [tf.Variable(x) for x in init]
    cls = tk.legacy.SGD if legacy else tk.SGD
    opt = cls(0.125, clip=clipping.ZClip(warmup_steps=8))  # (tf_keras keeps lr in float32: 0.125 exact)

    def step(gs):
        opt.apply_gradients(zip(gs, variables))

    if graph:
        step = tf.function(step)
    for gs in grad_steps:
        step([tf.constant(g) for g in gs])
    want = _sgd_reference(grad_steps, targets, init, lr=0.125)
    for v, w in zip(variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-12)
    names = [v.name for v in opt.variables()] if legacy else [v.name for v in opt.variables]
    assert any("zclip_mean" in n for n in names), names
    config = opt.get_config()
    assert config["clip"]["mode"] == "zclip" and cls.from_config(config).clip.warmup_steps == 8
    with pytest.raises(ValueError, match="cannot be combined"):
        cls(LR, clip="autoclip", clipnorm=1.0)


# ------------------------------------------------------------------ TF1 as written
TF1_PROGRAM = """
import sys
import numpy as np
import tensorflow.compat.v1 as tf
tf.disable_v2_behavior()
import tfclip
from tfclip import clipping

steps = np.load(sys.argv[1])["grads"]
w = tf.get_variable("w", initializer=np.ones((3, 2)))  # a ref variable under disable_v2_behavior
assert w.dtype._is_ref_dtype
g = tf.placeholder(tf.float64, [3, 2])
loss = tf.reduce_sum(w * g)  # d loss / d w = g
opt = tfclip.compat.v1.GradientDescentOptimizer(0.1, clip=clipping.ZClip(warmup_steps=10))
train = opt.minimize(loss)
saver = tf.train.Saver()
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for gs in steps:
        sess.run(train, {g: gs})
    names = [v.name for v in tf.global_variables()]
    np.savez(sys.argv[2], w=sess.run(w), names=np.array(names), count=sess.run(opt._adaptive.state["count"]))
"""


def test_tf1_program_with_ref_variables_under_disable_v2_behavior(tmp_path):
    import os
    import subprocess
    import sys

    grad_steps = _grads(30, [(3, 2)], seed=11, spikes=(25,))
    np.savez(tmp_path / "in.npz", grads=np.stack([gs[0] for gs in grad_steps]))
    script = tmp_path / "prog.py"
    script.write_text(TF1_PROGRAM)
    root = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    norms = [reference.global_norm(gs) for gs in grad_steps]
    targets = [t[0] for t in reference.zclip_targets(norms, warmup_steps=10)]
    assert targets[25] is not None
    np.testing.assert_allclose(out["w"], _sgd_reference(grad_steps, targets, [np.ones((3, 2))])[0],
                               rtol=1e-12, atol=1e-12)
    assert int(out["count"]) == 30
    assert any("zclip_mean" in str(n) for n in out["names"])


# ------------------------------------------------------------------ AGC from every front door
AGC_SHAPES = [(), (7,), (6, 5), (3, 4, 5), (2, 3, 4, 6)]


def _agc_reference(grad_steps, init, clip_factor, lr):
    """SGD with each step's gradients clipped unit-wise (the paper's AGC, float64 reference of
    tests/test_clip_agc.py), against the weights before the step."""
    from test_clip_agc import agc_clip

    w = [np.array(x, np.float64) for x in init]
    for gs in grad_steps:
        w = [x - lr * agc_clip(g, x, clip_factor)[0] for x, g in zip(w, gs)]
    return w


def _agc_grads(steps, seed):
    return _grads(steps, AGC_SHAPES, seed=seed, spikes=(7,))


@pytest.mark.parametrize("graph", [False, True, "jit_compile"], ids=["eager", "tf.function", "jit_compile"])
@pytest.mark.parametrize("clip", ["agc", clipping.AGC(clip_factor=0.05)], ids=["named", "object"])
def test_agc_through_fused_clip_apply_follows_the_paper(graph, clip):
    _skip_jit_without_xla_kernels(graph)
    grad_steps = _agc_grads(10, seed=12)
    rng = np.random.default_rng(13)
    init = [rng.normal(size=s) + 0.5 for s in AGC_SHAPES]  # unit norms well above eps
    variables = [tf.Variable(x) for x in init]
    rule = tfclip.rules.SGD(LR)

    def step(gs):
        return tfclip.fused_clip_apply(zip(gs, variables), rule, clip=clip)

    if graph:
        step = tf.function(step, jit_compile=graph == "jit_compile")
    for gs in grad_steps:
        r = step([tf.constant(g) for g in gs])
        assert bool(r.applied)
    factor = 0.01 if clip == "agc" else 0.05
    for v, w in zip(variables, _agc_reference(grad_steps, init, factor, LR)):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-12, atol=1e-12)


@needs_keras3
@pytest.mark.parametrize("how", ["eager", "jit_compile", "xla_fallback"])
def test_agc_in_keras_adam_is_adam_on_the_unit_clipped_gradients(how, monkeypatch):
    from test_clip_agc import agc_clip

    if how == "xla_fallback":
        from tfclip._engine import xla as _xla

        monkeypatch.setattr(_loader, "_XLA", False)
        monkeypatch.setattr(_xla, "_WARNED", {"keras"})
    grad_steps = _agc_grads(8, seed=14)
    rng = np.random.default_rng(15)
    init = [rng.normal(size=s) + 0.5 for s in AGC_SHAPES]
    ours, plain = ([keras.Variable(x, dtype="float64") for x in init] for _ in range(2))
    opt = tfclip.keras.Adam(1e-2, clip=clipping.AGC(clip_factor=0.02))
    # (The XLA fallback runs stock Keras's Adam, whose float64 step differs from tfclip's near
    # float32 rounding: it is compared with stock Adam on the clipped gradients.)
    plain_opt = keras.optimizers.Adam(1e-2) if _stock_under(how) else tfclip.keras.Adam(1e-2)

    def step(gs):
        opt.apply(gs, ours)

    if how != "eager":
        step = tf.function(step, jit_compile=True)
    from test_clip_agc import ref_counts

    assert opt.clipped_units is None  # (made by build)
    for gs in grad_steps:
        clipped = [agc_clip(g, p.numpy(), 0.02)[0] for g, p in zip(gs, plain)]
        counts = ref_counts(gs, [p.numpy() for p in ours], 0.02)
        step([tf.constant(g) for g in gs])
        plain_opt.apply([tf.constant(c) for c in clipped], plain)
        # Each variable's clipped units of the step (the fallback: counted in stock ops).
        assert opt.clipped_units.dtype == "int64" and not opt.clipped_units.trainable
        np.testing.assert_array_equal(opt.clipped_units.numpy(), counts)
    assert sum(ref_counts(gs, init, 0.02).sum() for gs in grad_steps) > 0
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)
    assert opt.get_config()["clip"] == {"mode": "agc", "clip_factor": 0.02, "eps": 1e-3}


@pytest.mark.parametrize("front", ["tf_keras", "tf_keras.legacy", "compat.v1"])
def test_agc_in_tf_keras_and_compat_v1_follows_the_paper(front):
    grad_steps = _agc_grads(8, seed=16)
    rng = np.random.default_rng(17)
    init = [rng.normal(size=s) + 0.5 for s in AGC_SHAPES]
    from test_clip_agc import ref_counts

    want = _agc_reference(grad_steps, init, 0.03, 0.125)
    assert sum(ref_counts(g, init, 0.03).sum() for g in grad_steps) > 0
    clip = clipping.AGC(clip_factor=0.03)
    if front == "compat.v1":
        with tf.Graph().as_default():
            ws = [tf.compat.v1.get_variable(f"w{i}", initializer=x, use_resource=True) for i, x in enumerate(init)]
            gs = [tf.compat.v1.placeholder(tf.float64, s) for s in AGC_SHAPES]
            opt_v1 = tfclip.compat.v1.GradientDescentOptimizer(0.125, clip=clip)
            train = opt_v1.apply_gradients(zip(gs, ws))
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(tf.compat.v1.local_variables_initializer())
                for step in grad_steps:
                    before = sess.run(ws)
                    sess.run(train, dict(zip(gs, step)))
                    np.testing.assert_array_equal(sess.run(opt_v1.clipped_units()),
                                                  ref_counts(step, before, 0.03))
                got = sess.run(ws)
    else:
        pytest.importorskip("tf_keras", reason="tf-keras is the optional Keras 2 extra")
        import tfclip.tf_keras as tk

        cls = tk.legacy.SGD if front.endswith("legacy") else tk.SGD
        ws = [tf.Variable(x) for x in init]
        opt = cls(0.125, clip=clip)
        for step in grad_steps:
            before = [w.numpy() for w in ws]
            opt.apply_gradients(zip([tf.constant(g) for g in step], ws))
            assert opt.clipped_units.dtype == tf.int64 and not opt.clipped_units.trainable
            np.testing.assert_array_equal(opt.clipped_units.numpy(), ref_counts(step, before, 0.03))
        got = [w.numpy() for w in ws]
        assert cls.from_config(opt.get_config()).clip.clip_factor == 0.03
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_agc_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="clip_factor"):
        clipping.AGC(clip_factor=0.0)
    with pytest.raises(ValueError, match="eps"):
        clipping.AGC(eps=-1e-3)
    with pytest.raises(ValueError, match="cannot be combined with clipnorm"):
        tfclip.fused_clip_apply([(tf.constant([1.0]), tf.Variable([1.0]))], tfclip.rules.SGD(0.1), clip="agc",
                                clipnorm=1.0)


@pytest.mark.parametrize("front", ["keras", "tf_keras"])
def test_agc_counts_keep_the_variables_order_across_weight_decay_groups(front):
    """AdamW with some variables excluded from the decay runs one op per group (undecayed
    first); optimizer.clipped_units must still follow the variables' order."""
    from test_clip_agc import ref_counts

    grad_steps = _agc_grads(4, seed=18)
    rng = np.random.default_rng(19)
    init = [rng.normal(size=s) + 0.5 for s in AGC_SHAPES]
    names = [f"w{i}" for i in range(len(init))]
    clip = clipping.AGC(clip_factor=0.03)
    if front == "keras":
        if tfclip._KERAS_PROBLEM is not None:
            pytest.skip(f"Keras 3 is not here: {tfclip._KERAS_PROBLEM}")
        ws = [keras.Variable(x, dtype="float64", name=n) for x, n in zip(init, names)]
        opt = tfclip.keras.AdamW(1e-2, weight_decay=0.1, clip=clip)
    else:
        pytest.importorskip("tf_keras", reason="tf-keras is the optional Keras 2 extra")
        ws = [tf.Variable(x, name=n) for x, n in zip(init, names)]
        opt = tfclip.tf_keras.AdamW(1e-2, weight_decay=0.1, clip=clip)
    opt.exclude_from_weight_decay(var_names=["w1", "w3"])  # the groups: [w1, w3], [w0, w2, w4]
    seen = 0
    for step in grad_steps:
        before = [w.numpy() for w in ws]
        want = ref_counts(step, before, 0.03)
        if front == "keras":
            opt.apply([tf.constant(g) for g in step], ws)
        else:
            opt.apply_gradients(zip([tf.constant(g) for g in step], ws))
        np.testing.assert_array_equal(opt.clipped_units.numpy(), want)
        seen += int(len(set(want.tolist())) > 1)
    assert seen > 0  # counts that differ between variables, so a misordering would show
