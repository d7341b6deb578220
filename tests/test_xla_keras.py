"""The Keras drop-ins under XLA (jit_compile=True, Keras 3's default wherever a GPU is visible):
their step compiles to tfclip's custom calls, not to stock ops, and gives the non-XLA step's bits;
model.fit with schedules, EMA, gradient accumulation and loss scaling trains as without XLA, and
no fallback is announced. (tests/test_xla.py covers the ops themselves.)"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfclip
import tfclip.keras._dropin as tk
from tfclip import _loader

pytestmark = pytest.mark.skipif(
    not _loader.xla_kernels(), reason="this build of tfclip has no XLA kernels (TFCLIP_XLA off: a TF "
                                  "other than the one the XLA glue is built for); the Keras "
                                  "fallback is tested in test_clip_tensor_norms.py")

CLASSES = {
    "SGD": dict(momentum=0.9, nesterov=True), "Adam": dict(amsgrad=True), "AdamW": {}, "RMSprop":
    dict(momentum=0.5, centered=True), "Adagrad": {}, "Adadelta": {}, "Adamax": {}, "Nadam": {},
    "Lion": {}, "Ftrl": dict(l1_regularization_strength=0.01), "Lamb": {},
    "ScheduleFreeAdamW": dict(warmup_steps=2, weight_decay=0.01), "Adafactor": dict(weight_decay=0.01),
    "Muon": dict(weight_decay=0.01),
}


def _problem(rng):
    shapes = [(6, 4), (4,), (4, 1), ()]
    init = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(3)]
    return init, grads


def _stepper(opt, vs):
    def step(gs):
        opt.apply_gradients(zip(gs, vs))
        return opt.global_norm.value
    return step


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_optimizer_step_under_xla_runs_the_custom_calls_with_the_same_bits(rng, name):
    init, steps = _problem(rng)
    results = []
    for jit in (False, True):
        vs = [keras.Variable(x) for x in init]
        opt = getattr(tfclip.keras, name)(0.05, global_clipnorm=1.0, **CLASSES[name])
        opt.build(vs)

        fn = tf.function(_stepper(opt, vs), jit_compile=jit)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning
            for gs in steps:
                fn([tf.constant(g) for g in gs])
        if jit:
            hlo = fn.experimental_get_compiler_ir([tf.constant(g) for g in steps[0]])(stage="hlo")
            assert 'custom_call_target="tfclip_apply"' in hlo, hlo[:2000]
        results.append([np.asarray(v.numpy()) for v in vs] + [np.asarray(v.numpy()) for v in opt.variables])
    for a, b in zip(*results):
        if name in TF_OPS:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


# Classes whose step also runs TF ops, which XLA compiles with its own kernels (their bits are
# not TF's): Muon's Newton–Schulz products (tfclip/keras/_muon.py); its AdamW variables are the op's.
TF_OPS = {"Muon"}


def _model():
    keras.utils.set_random_seed(7)
    inp = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(1)(h))


def _data():
    r = np.random.default_rng(3)
    x = r.normal(size=(64, 5)).astype("float32")
    return x, (x @ r.normal(size=(5, 1)) * 3).astype("float32")


FEATURES = {
    "schedule": lambda: dict(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)),
    "ema": lambda: dict(learning_rate=0.05, use_ema=True, ema_overwrite_frequency=3),
    "accumulation": lambda: dict(learning_rate=0.05, gradient_accumulation_steps=2),
    "plain": lambda: dict(learning_rate=0.05),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("name", ["Adam", "Nadam", "SGD", "ScheduleFreeAdamW"])
def test_fit_with_jit_compile_trains_as_without_xla(name, feature):
    x, y = _data()
    out = []
    for jit in (False, True):
        model = _model()
        opt = getattr(tfclip.keras, name)(global_clipnorm=0.5, **FEATURES[feature]())
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        assert not [w for w in caught if "XLA" in str(w.message)], [str(w.message) for w in caught]
        out.append((model.get_weights(), int(opt.iterations.numpy()), float(opt.global_norm.numpy())))
    (w0, it0, n0), (w1, it1, n1) = out
    assert it0 == it1 == (8 if feature == "accumulation" else 16)  # (Keras counts applied updates)
    assert n1 == pytest.approx(n0, rel=1e-4)
    for a, b in zip(w0, w1):  # (XLA compiles the model's own gradients too: rounding may differ)
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_fit_with_jit_compile_and_mixed_float16_loss_scaling():
    """LossScaleOptimizer around the drop-in under mixed_float16, compiled with and without XLA:
    each run equals stock Keras Adam's run compiled the same way. (Not XLA against no XLA: the
    model's own float16 math differs between them on TF 2.17, by 0.05 in a weight after an epoch,
    stock Keras's too.)"""
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for jit in (False, True):
            out = []
            for cls in (tfclip.keras.Adam, keras.optimizers.Adam):
                model = _model()
                opt = keras.optimizers.LossScaleOptimizer(cls(0.01, global_clipnorm=1.0))
                model.compile(optimizer=opt, loss="mse", jit_compile=jit)
                model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
                out.append(model.get_weights())
            for a, b in zip(*out):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                           rtol=1e-5, atol=1e-6, err_msg=f"jit_compile={jit}")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _v1_stepper(opt, vs):
    def step(gs):
        opt.apply_gradients(zip(gs, vs))
    return step


@pytest.mark.parametrize("make", [
    lambda: tfclip.compat.v1.AdamOptimizer(0.05, global_clipnorm=1.0),
    lambda: tfclip.compat.v1.MomentumOptimizer(0.05, 0.9, use_nesterov=True, clipnorm=0.5),
    lambda: tfclip.compat.v1.RMSPropOptimizer(0.05, momentum=0.5, centered=True),
], ids=["adam", "momentum", "rmsprop"])
def test_compat_v1_step_under_xla_runs_the_custom_calls_with_the_same_bits(rng, make):
    """tfclip.compat.v1 in a jit-compiled tf.function: the custom calls, the non-XLA bits (Adam's
    beta powers included)."""
    init, steps = _problem(rng)
    results = []
    for jit in (False, True):
        vs = [tf.Variable(x) for x in init]
        opt = make()
        fn = tf.function(_v1_stepper(opt, vs), jit_compile=jit)
        for gs in steps:
            fn([tf.constant(g) for g in gs])
        if jit:
            hlo = fn.experimental_get_compiler_ir([tf.constant(g) for g in steps[0]])(stage="hlo")
            assert 'custom_call_target="tfclip_apply"' in hlo
        state = [x for slots in opt._slots.values() for x in slots.values()] + list(opt._non_slot_dict.values())
        results.append([v.numpy() for v in vs] + [x.numpy() for x in state])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lazy,clip,falls_back", [
    (False, dict(global_clipnorm=1.0), False), (True, dict(global_clipnorm=1.0), True),
    (False, dict(clipnorm=1.0), True), (False, {}, True)])
def test_gpu_indexed_slices_that_xla_cannot_densify_fall_back_with_the_reason(lazy, clip, falls_back):
    """On a GPU the XLA kernel densifies IndexedSlices: lazy_sparse's rows and stock Keras's sum of
    a repeated row's squares (every clip but global_clipnorm) cannot be had there, so that one
    case takes the stock step, saying why; dense gradients and CPU variables never do."""
    opt = tfclip.keras.Adam(0.1, lazy_sparse=lazy, **clip)

    class OnGpu:
        device = "/job:localhost/replica:0/task:0/device:GPU:0"

    slices = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 0]), tf.constant([4, 3]))
    why = tk._xla_fallback_reason(opt, [slices], [OnGpu()])
    assert (why is not None) == falls_back
    if falls_back:
        assert "IndexedSlices on the GPU" in why
    assert tk._xla_fallback_reason(opt, [tf.ones([4, 3])], [OnGpu()]) is None
    assert tk._xla_fallback_reason(opt, [slices], [tf.Variable(tf.ones([4, 3]))]) is None
