"""tfclip.keras optimizers against the stock Keras 3 optimizers, step by step."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import tfclip

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = (RNG.normal(size=(64, 1)) * 10).astype("float32")
# Each batch of 16 rows holds 96 distinct token ids: see test_embedding_with_repeated_rows_norm.
TOK = np.concatenate([RNG.permutation(200)[:96].reshape(16, 6) for _ in range(4)])


def mlp_frozen():
    inp = keras.Input((6,))
    x = keras.layers.Dense(8, activation="tanh", trainable=False)(inp)  # a frozen layer
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model(inp, keras.layers.Dense(1)(x)), X


def lstm():
    inp = keras.Input((6, 1))
    return keras.Model(inp, keras.layers.Dense(1)(keras.layers.LSTM(8)(inp))), X[..., None]


def embedding():
    inp = keras.Input((6,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(200, 4)(inp))
    return keras.Model(inp, keras.layers.Dense(1)(x)), TOK


MODELS = {"mlp_frozen": mlp_frozen, "lstm": lstm, "embedding": embedding}
CLIPS = {"global_clipnorm": {"global_clipnorm": 0.5}, "clipnorm": {"clipnorm": 0.2},
         "clipvalue": {"clipvalue": 0.05}, "none": {}}
OPTS = {
    "sgd_nesterov": lambda m, kw: m.SGD(0.05, momentum=0.9, nesterov=True, **kw),
    "sgd": lambda m, kw: m.SGD(0.05, **kw),
    "adam_amsgrad": lambda m, kw: m.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 5, 0.5),
                                         amsgrad=True, **kw),
    "adamw": lambda m, kw: m.AdamW(0.02, weight_decay=0.1, **kw),
}


def trajectories(model_fn, make_opt, steps=20):
    """Weights after each of `steps` custom-loop steps, for stock Keras and for tfclip."""
    out = []
    for mod in (keras.optimizers, tfclip.keras):
        keras.utils.set_random_seed(1)
        model, x = model_fn()
        opt = make_opt(mod)
        if isinstance(opt, keras.optimizers.AdamW):
            opt.exclude_from_weight_decay(var_names=["bias"])  # two weight-decay groups

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        traj = []
        for i in range(steps):
            b = slice(16 * (i % 4), 16 * (i % 4) + 16)
            step(x[b], Y[b])
            traj.append([w.copy() for w in model.get_weights()])
        out.append((traj, opt, model))
    return out


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("clip", list(CLIPS))
def test_same_trajectory_as_stock_keras(model_name, opt_name, clip):
    (stock, _, _), (fused, opt, model) = trajectories(MODELS[model_name],
                                                      lambda m: OPTS[opt_name](m, CLIPS[clip]))
    # Float32 rounding differs in a few places (fused vs separate ops; the LSTM's gradient graph),
    # a few ulps after one step; training dynamics carry that along but never away.
    for step, (a, b) in enumerate(zip(stock, fused)):
        for wa, wb in zip(a, b):
            tol = 5e-7 if step == 0 else 1e-5
            np.testing.assert_allclose(wb, wa, rtol=10 * tol, atol=tol, err_msg=f"step {step}")
    assert int(opt.iterations.numpy()) == 20 and int(opt.skipped_steps.numpy()) == 0


def test_frozen_layer_is_not_touched():
    (_, _, _), (traj, _, model) = trajectories(mlp_frozen, lambda m: m.Adam(0.05, global_clipnorm=1.0), steps=3)
    keras.utils.set_random_seed(1)
    fresh, _ = mlp_frozen()
    np.testing.assert_array_equal(model.layers[1].kernel.numpy(), fresh.layers[1].kernel.numpy())


def test_embedding_with_repeated_rows_norm():
    """With repeated token ids the gradient is IndexedSlices with duplicate rows: the global norm
    is the norm of `.values` (as tf.linalg.global_norm and Keras count it)."""
    emb = keras.Variable(np.ones((10, 3), "float32"))
    g = tf.IndexedSlices(tf.constant([[1.0, 2.0, 2.0], [1.0, 2.0, 2.0]]), tf.constant([4, 4]), tf.constant([10, 3]))
    opt = tfclip.keras.SGD(0.1, global_clipnorm=100.0)
    opt.apply_gradients([(g, emb)])
    np.testing.assert_allclose(opt.global_norm.numpy(), np.sqrt(18.0), rtol=1e-6)
    want = np.ones((10, 3), "float32")
    want[4] -= 0.1 * np.array([2.0, 4.0, 4.0])  # duplicates summed, as a scatter-add
    np.testing.assert_allclose(emb.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("extra", [{"use_ema": True, "ema_overwrite_frequency": 3}, {"loss_scale_factor": 128.0},
                                   {"gradient_accumulation_steps": 3}], ids=["ema", "loss_scale", "accumulation"])
def test_base_optimizer_arguments_work(extra):
    (stock, _, sm), (fused, opt, fm) = trajectories(mlp_frozen, lambda m: m.Adam(0.02, global_clipnorm=0.5, **extra),
                                                    steps=9)
    for a, b in zip(stock[-1], fused[-1]):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_model_fit_global_norm_is_observable():
    keras.utils.set_random_seed(1)
    model, x = mlp_frozen()
    opt = tfclip.keras.Adam(0.01, global_clipnorm=1.0)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    norms = []
    cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: norms.append(float(opt.global_norm.numpy())))
    model.fit(x[:16], Y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    # The same norm computed by hand from the pre-step weights.
    keras.utils.set_random_seed(1)
    ref, _ = mlp_frozen()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(Y[:16], ref(x[:16], training=True))
    want = tf.linalg.global_norm(tape.gradient(loss, ref.trainable_variables))
    np.testing.assert_allclose(norms, [float(want)], rtol=1e-5)


def fit_both(make_opt, policy="float32", jit_compile=False):
    """Two epochs of model.fit on a small MLP with the stock optimizer and with tfclip's, under a
    dtype policy: (stock weights, tfclip weights), (stock optimizer, tfclip optimizer)."""
    ws, opts = [], []
    try:
        for mod in (keras.optimizers, tfclip.keras):
            keras.config.set_dtype_policy(policy)
            keras.utils.set_random_seed(1)
            inp = keras.Input((6,))
            h = keras.layers.Dense(8, activation="tanh")(inp)
            model = keras.Model(inp, keras.layers.Dense(1, dtype="float32")(h))
            model.compile(optimizer=make_opt(mod), loss="mse", jit_compile=jit_compile)
            model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            ws.append(model.get_weights())
            opts.append(model.optimizer)
    finally:
        keras.config.set_dtype_policy("float32")
    return ws, opts


@pytest.mark.parametrize("jit_compile", [False, True, "auto"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_fit_xla_and_mixed_precision_match_stock(jit_compile, policy):
    ws, opts = fit_both(lambda mod: mod.Adam(1e-2, global_clipnorm=0.5), policy, jit_compile)
    for a, b in zip(*ws):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)
    inner = getattr(opts[1], "inner_optimizer", opts[1])
    assert isinstance(inner, tfclip.keras.Adam) and float(inner.global_norm.numpy()) > 0
    if policy == "mixed_float16":
        assert isinstance(opts[1], keras.optimizers.LossScaleOptimizer)


def test_nonfinite_gradient_is_skipped_and_counted():
    v = keras.Variable(np.ones(4, "float32"))
    w = keras.Variable(np.ones(3, "float32"))
    opt = tfclip.keras.Adam(0.1, global_clipnorm=1.0)
    opt.apply_gradients([(tf.ones(4), v), (tf.ones(3), w)])
    before = [x.numpy().copy() for x in [v, w, *opt.variables]]
    opt.apply_gradients([(tf.constant([1.0, np.nan, 1.0, 1.0]), v), (tf.ones(3), w)])
    assert int(opt.skipped_steps.numpy()) == 1
    assert np.isnan(opt.global_norm.numpy())
    after = {id(x): x.numpy() for x in [v, w, *opt.variables]}
    for x, b in zip([v, w, *opt.variables], before):
        if x.path.endswith(("iteration", "global_norm", "skipped_steps")):
            continue
        np.testing.assert_array_equal(after[id(x)], b)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        tfclip.keras.SGD(0.1, nonfinite="raise").apply_gradients([(tf.constant([np.inf, 1.0, 1.0]), w)])


def test_save_and_load_round_trip(tmp_path):
    keras.utils.set_random_seed(1)
    model, x = lstm()
    model.compile(optimizer=tfclip.keras.AdamW(0.01, global_clipnorm=1.0, nonfinite="propagate"), loss="mse",
                  jit_compile=False)
    model.fit(x, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is tfclip.keras.AdamW
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert loaded.optimizer.nonfinite == "propagate"
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.fit(x, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [tfclip.keras.SGD, tfclip.keras.Adam, tfclip.keras.AdamW])
def test_get_config_from_config(cls):
    opt = cls(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9), clipnorm=2.0,
              nonfinite="raise")
    again = cls.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).__class__ is cls


@pytest.mark.parametrize("kwargs,match", [
    ({"global_clipnorm": -1.0}, "global_clipnorm must be a finite number"),
    ({"clipnorm": float("nan")}, "clipnorm must be a finite number"),
    ({"clipvalue": 1.0, "clipnorm": 1.0}, "Only one of"),
    ({"nonfinite": "ignore"}, "nonfinite must be one of"),
    ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps"),
    ({"epsilon": float("nan")}, "epsilon must be finite"),
])
def test_bad_constructor_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfclip.keras.Adam(0.1, **kwargs)
