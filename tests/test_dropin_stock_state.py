"""Drop-in means drop-in: tfclip's Keras and tf.compat.v1 optimizers hold exactly the stock
classes' state, so checkpoints move both ways; gradients of another float dtype are cast as stock
Keras casts them; the stock hooks (`_clip_gradients`) answer as stock; stock ranges hold."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfclip

RNG = np.random.default_rng(3)
X = RNG.normal(size=(32, 6)).astype("float32")
TOK = RNG.integers(0, 30, size=(32, 6)).astype("int32")  # repeated ids: IndexedSlices duplicates
Y = RNG.normal(size=(32, 1)).astype("float32")

CONFIGS = {  # name: (class name, constructor kwargs)
    "sgd": ("SGD", dict(learning_rate=0.05)),
    "sgd_momentum": ("SGD", dict(learning_rate=0.05, momentum=0.9, nesterov=True)),
    "adam": ("Adam", dict(learning_rate=0.01, global_clipnorm=0.5)),
    "adam_amsgrad_ema": ("Adam", dict(learning_rate=0.01, amsgrad=True, use_ema=True, clipnorm=0.3)),
    "adamw_accumulate": ("AdamW", dict(learning_rate=0.01, weight_decay=0.05, gradient_accumulation_steps=2)),
    "adamw": ("AdamW", dict(learning_rate=0.01, weight_decay=0.05)),
    "rmsprop_centered_momentum": ("RMSprop", dict(learning_rate=0.01, momentum=0.5, centered=True)),
    "rmsprop": ("RMSprop", dict(learning_rate=0.01, clipnorm=0.5)),
    "adagrad": ("Adagrad", dict(learning_rate=0.05)),
    "adadelta": ("Adadelta", dict(learning_rate=1.0, global_clipnorm=0.5)),
    "adamax": ("Adamax", dict(learning_rate=0.01)),
    "nadam": ("Nadam", dict(learning_rate=0.01, global_clipnorm=0.5)),
    "lion": ("Lion", dict(learning_rate=0.001)),
    "ftrl": ("Ftrl", dict(learning_rate=0.05, l1_regularization_strength=0.01, beta=0.1)),
    "lamb": ("Lamb", dict(learning_rate=0.01, weight_decay=0.01, global_clipnorm=0.5)),
    "schedule_free_adamw": ("ScheduleFreeAdamW", dict(learning_rate=0.01, warmup_steps=3, weight_decay=0.01,
                                                      clipnorm=0.5)),
}


def make_opt(module, config, **over):
    cls, kw = CONFIGS[config]
    return getattr(module, cls)(**{**kw, **over})


def make_model(kind):
    """The same model each call, layer names included (slot variables are named after them)."""
    keras.utils.set_random_seed(7)
    if kind == "embedding":
        inp = keras.Input((6,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(30, 3, name="emb")(inp))
        return keras.Model(inp, keras.layers.Dense(1, name="out")(h)), TOK
    inp = keras.Input((6,))
    h = keras.layers.Dense(5, activation="tanh", name="hidden")(inp)
    return keras.Model(inp, keras.layers.Dense(1, name="out")(h)), X


def _name(path):
    """A variable's path, with Keras's automatic names (`variable_<global counter>`, as stock
    Nadam's unnamed u_product gets: two stock optimizers differ there too) made alike."""
    return re.sub(r"\bvariable(_\d+)?$", "variable_N", path)


def signature(opt):
    return [(_name(v.path), tuple(v.shape), v.dtype) for v in opt.variables]


@pytest.mark.parametrize("name", CONFIGS)
def test_variables_equal_the_stock_list(name):
    got, want = [], []
    for module, out in ((keras.optimizers, want), (tfclip.keras, got)):
        model, _ = make_model("dense")
        opt = make_opt(module, name, name="opt")
        opt.build(model.trainable_variables)
        out.extend(signature(opt))
    assert got == want
    assert not any("global_norm" in p or "skipped" in p for p, _, _ in got)


def fit(model, opt, x, epochs=1):
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, Y, batch_size=8, epochs=epochs, verbose=0, shuffle=False)


def save(model, path, how):
    if how == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(path))
    else:
        model.save(path) if how == "keras" else model.save_weights(path)


def load(model, opt, x, path, how):
    """Resumes `path` into a fresh model compiled with `opt` (the way each format is resumed)."""
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    opt.build(model.trainable_variables)
    if how == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=opt).read(str(path)).assert_consumed()
    else:
        model.load_weights(path)


@pytest.mark.parametrize("how", ["weights_h5", "keras", "checkpoint"])
@pytest.mark.parametrize("direction", ["stock_to_tfclip", "tfclip_to_stock"])
@pytest.mark.parametrize("name,kind", [("adam", "embedding"), ("adam_amsgrad_ema", "dense"),
                                       ("sgd_momentum", "embedding"), ("adamw_accumulate", "dense"),
                                       ("nadam", "dense"), ("rmsprop_centered_momentum", "embedding"),
                                       ("ftrl", "embedding"), ("adamax", "embedding"),
                                       ("lamb", "embedding"), ("schedule_free_adamw", "embedding"),
                                       ("schedule_free_adamw", "dense")])
def test_checkpoints_resume_across_stock_and_tfclip(tmp_path, name, kind, direction, how):
    src_mod, dst_mod = ((keras.optimizers, tfclip.keras) if direction == "stock_to_tfclip"
                        else (tfclip.keras, keras.optimizers))
    path = tmp_path / {"weights_h5": "w.weights.h5", "keras": "m.keras", "checkpoint": "ckpt"}[how]
    model, x = make_model(kind)
    fit(model, make_opt(src_mod, name), x)  # 4 steps
    save(model, path, how)
    resumed, _ = make_model(kind)
    opt = make_opt(dst_mod, name)
    load(resumed, opt, x, path, how)
    assert int(opt.iterations.numpy()) == int(model.optimizer.iterations.numpy()) > 0
    for a, b in zip(model.optimizer.variables, opt.variables):
        assert _name(a.path).split("/")[-1] == _name(b.path).split("/")[-1]  # the optimizer's own name differs
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=b.path)
    # The next steps: the resumed optimizer continues as the original one does.
    model.fit(x, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    resumed.fit(x, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.optimizer.variables, opt.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=b.path)


def test_extras_are_attributes_outside_every_saved_list(tmp_path):
    model, x = make_model("dense")
    opt = tfclip.keras.Adam(0.01, global_clipnorm=0.1)
    fit(model, opt, x)
    assert float(opt.global_norm.numpy()) > 0 and int(opt.skipped_steps.numpy()) == 0
    ckpt = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "c"))
    keys = [k for k, _ in tf.train.list_variables(ckpt)]
    assert keys and not any("global_norm" in k or "skipped" in k for k in keys)


# ------------------------------------------------------------------ gradient dtypes
@pytest.mark.parametrize("var_dtype,grad_dtype", [("float64", "float32"), ("float32", "float64"),
                                                  ("float64", "float16"), ("float32", "bfloat16")])
@pytest.mark.parametrize("name,clip", [("adam", dict(clipvalue=0.3)), ("adam", dict(global_clipnorm=0.5)),
                                       ("sgd_momentum", {}), ("adamw", {})])
def test_gradients_of_another_float_dtype_are_cast_as_stock_keras_casts_them(name, clip, var_dtype, grad_dtype):
    init = [RNG.normal(size=(4, 3)), RNG.normal(size=(3,))]
    grads = [[RNG.normal(size=w.shape) for w in init] for _ in range(6)]
    out = []
    for module, cast_first in ((keras.optimizers, False), (tfclip.keras, False), (tfclip.keras, True)):
        variables = [keras.Variable(w, dtype=var_dtype) for w in init]
        opt = make_opt(module, name, **{"global_clipnorm": None, **({} if cast_first else clip)})
        for gs in grads:
            gs = [tf.constant(g, grad_dtype) for g in gs]
            if cast_first and "global_clipnorm" not in clip:  # the cast as a separate op
                gs = [tf.cast(keras.ops.clip(g, -0.3, 0.3) if clip else g, var_dtype) for g in gs]
            opt.apply_gradients(zip(gs, variables))
        out.append([v.numpy() for v in variables])
    stock, fused, cast_first = out
    # Against stock Keras: to float32 rounding, as stock rounds its Python-float hyper-parameters
    # to float32 for a float64 variable (ops.cast(0.9, "float64") is 0.899999976...) where tfclip
    # keeps them exact; a norm clip's scale comes from stock's norm summed in the gradient's dtype
    # (tfclip's in float64), so there it agrees to that dtype.
    tol = {"float64": 1e-6, "float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2}
    rtol = max(tol[var_dtype], tol[grad_dtype] if "global_clipnorm" in clip else 0)
    for a, b, c in zip(stock, fused, cast_first):
        assert b.dtype == np.dtype(var_dtype)
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol)
        if "global_clipnorm" not in clip:  # bit for bit: clip in the gradient's dtype, then cast
            np.testing.assert_array_equal(b, c)


# ------------------------------------------------------------------ stock hooks and ranges
@pytest.mark.parametrize("clip", [dict(clipnorm=1.0), dict(clipvalue=0.5), dict(global_clipnorm=1.0), {}])
@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW"])
def test_clip_gradients_called_directly_answers_as_stock(cls, clip):
    grads = [tf.constant([100.0, -100.0]), tf.constant([[3.0, 0.25]])]
    want = getattr(keras.optimizers, cls)(**clip)._clip_gradients(grads)
    got = getattr(tfclip.keras, cls)(**clip)._clip_gradients(grads)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-7)
    if clip:
        assert not np.allclose(np.asarray(got[0]), np.asarray(grads[0]))


def test_apply_weight_decay_called_directly_answers_as_stock():
    out = []
    for module in (keras.optimizers, tfclip.keras):
        v = keras.Variable([2.0, -1.0])
        opt = module.AdamW(learning_rate=0.5, weight_decay=0.1)
        opt.build([v])
        opt._apply_weight_decay([v])
        out.append(v.numpy())
    np.testing.assert_array_equal(out[1], out[0])
    assert not np.array_equal(out[0], [2.0, -1.0])


def test_beta_2_of_one_is_a_zero_update_as_stock():
    out = []
    for module in (keras.optimizers, tfclip.keras):
        v = keras.Variable([1.0, 2.0])
        opt = module.Adam(0.1, beta_2=1.0)
        for _ in range(3):
            opt.apply_gradients([(tf.constant([0.5, -0.5]), v)])
        out.append(v.numpy())
    np.testing.assert_array_equal(out[1], out[0])
    r = tfclip.rules.Adam(0.1, beta_2=1.0)
    w = tf.Variable([1.0, 2.0])
    tfclip.fused_clip_apply([(tf.constant([0.5, -0.5]), w)], r)
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    with pytest.raises(ValueError, match=r"beta_2 must be finite"):
        tfclip.keras.Adam(beta_2=float("inf"))
    with pytest.raises(ValueError, match=r"beta_1 must be finite"):
        tfclip.keras.Adam(beta_1=float("nan"))


# ------------------------------------------------------------------ without tfclip installed
NO_TFCLIP = textwrap.dedent("""
    import sys
    class _Block:  # tfclip is not installed here
        def find_spec(self, name, path=None, target=None):
            if name == "tfclip" or name.startswith("tfclip."):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _Block())
    import numpy as np, keras
    path, x_path = sys.argv[1], sys.argv[2]
    x = np.load(x_path)
    try:
        keras.models.load_model(path)
        print("LOADED-PLAIN")
    except Exception as e:
        print("PLAIN-ERROR", type(e).__name__, str(e)[:2000].replace("\\n", " "))
    m = keras.models.load_model(path, compile=False)
    np.save(x_path + ".compile_false.npy", m.predict(x, verbose=0))
    m = keras.models.load_model(path, custom_objects={"tfclip>Adam": keras.optimizers.Adam})
    print("OPT", type(m.optimizer).__module__, type(m.optimizer).__name__, int(m.optimizer.iterations.numpy()))
    np.save(x_path + ".state.npy", np.concatenate([np.ravel(v) for v in m.optimizer.variables]))
""")


def test_a_tfclip_saved_model_loads_where_tfclip_is_absent(tmp_path):
    model, x = make_model("dense")
    fit(model, tfclip.keras.Adam(0.01, global_clipnorm=1.0), x)
    path = tmp_path / "m.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "PYTHONPATH": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run([sys.executable, "-c", NO_TFCLIP, str(path), str(tmp_path / "x.npy")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # Plain load_model cannot build a class it does not have; Keras's error names its module and
    # registered name (docs/keras.md says what to do).
    assert "PLAIN-ERROR" in r.stdout and "'module': 'tfclip.keras'" in r.stdout, r.stdout
    assert "tfclip>Adam" in r.stdout, r.stdout
    # For inference: compile=False; to keep training: the stock class, with the same state.
    np.testing.assert_allclose(np.load(tmp_path / "x.npy.compile_false.npy"), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert "OPT keras.src.optimizers.adam Adam 4" in r.stdout, r.stdout
    want = np.concatenate([np.ravel(v) for v in model.optimizer.variables])
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy.state.npy"), want)
