"""tfclip.keras.GradientNormLogger: what it writes to the event files, read back and checked
against NumPy (gradients recomputed with a tape from the weights before the logged step), and
the demo's picture."""
import glob
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfclip
import tfclip.demo

CLIP = 0.5
BATCH = 4
STEPS = 10
BAD = 4  # the batch (0-based) whose input holds a NaN: that step is skipped


def _model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh", name="a"),
                             keras.layers.Dense(4, activation="tanh", name="b"), keras.layers.Dense(1, name="c")])


def _data(rng):
    x = rng.normal(size=(BATCH * STEPS, 5)).astype(np.float32)
    y = (rng.normal(size=(BATCH * STEPS, 1)) * 4).astype(np.float32)
    x[BAD * BATCH, 0] = np.nan
    return x, y


def read_events(log_dir):
    """{tag: [(step, value)]} from every event file under log_dir, and each tag's plugin."""
    out, plugins = {}, {}
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)):
        for e in tf.compat.v1.train.summary_iterator(path):
            for v in e.summary.value:
                out.setdefault(v.tag, []).append((e.step, tf.make_ndarray(v.tensor)))
                if v.metadata.plugin_data.plugin_name:
                    plugins[v.tag] = v.metadata.plugin_data.plugin_name
    return out, plugins


def _np_grad_norms(model, weights, x, y):
    """Each variable's gradient norm in float64, from a tape at the given weights."""
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return {v.path: np.sqrt(np.sum(g.numpy().astype(np.float64) ** 2))
            for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = np.random.default_rng(2)
    x, y = _data(rng)
    model = _model()
    opt = tfclip.keras.Adam(0.05, global_clipnorm=CLIP)
    model.compile(optimizer=opt, loss="mse")
    log_dir = str(tmp_path_factory.mktemp("logs"))
    seen = []  # per step: weights after it, global norm, applied

    def record(batch, logs):
        seen.append((model.get_weights(), float(opt.global_norm.numpy()),
                     int(opt.skipped_steps.numpy())))

    start = model.get_weights()
    logger = tfclip.keras.GradientNormLogger(log_dir, every_n_steps=3, top_k=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[logger, keras.callbacks.LambdaCallback(on_train_batch_end=record)])
    return dict(model=model, x=x, y=y, start=start, seen=seen, events=read_events(log_dir), opt=opt)


def test_writes_every_n_steps_the_global_norm_and_skips(run):
    events, plugins = run["events"]
    seen = run["seen"]
    assert [s for s, _ in events["gradients/global_norm"]] == [3, 6, 9]
    for step, value in events["gradients/global_norm"]:
        assert float(value) == pytest.approx(seen[step - 1][1], rel=1e-6)
    assert plugins["gradients/global_norm"] == "scalars"
    # The NaN batch (step BAD + 1 = 5) is skipped: counted in the window 4..6 only.
    skipped = {s: int(v) for s, v in events["gradients/skipped_steps"]}
    assert skipped == {3: 0, 6: 1, 9: 0}
    assert {s: int(v) for s, v in events["gradients/skipped_steps_total"]} == {3: 0, 6: 1, 9: 1}
    assert seen[BAD][2] == 1 and np.isnan(seen[BAD][1])


def test_clip_fraction_and_scale_against_numpy(run):
    events, _ = run["events"]
    norms = np.array([s[1] for s in run["seen"]], np.float64)
    fired = np.nan_to_num(norms, nan=0.0) > CLIP  # a skipped step is not a clipped one
    scale = np.where(fired, CLIP / np.where(fired, norms, 1.0), 1.0)
    fraction = {s: float(v) for s, v in events["gradients/clip_fraction"]}
    mean = {s: float(v) for s, v in events["gradients/clip_scale_mean"]}
    for step in (3, 6, 9):
        window = slice(step - 3, step)
        assert fraction[step] == pytest.approx(fired[window].mean())
        assert mean[step] == pytest.approx(scale[window].mean(), rel=1e-6)
    assert 0 < fired.sum() < STEPS  # the run exercises both


def test_top_k_layers_and_histogram_against_numpy_gradients(run):
    """Per-layer norms (sqrt of the sum of the layer's squared variable norms) at the logged steps,
    from gradients NumPy recomputes at the weights before each of those steps."""
    events, plugins = run["events"]
    model, x, y, seen = run["model"], run["x"], run["y"], run["seen"]
    for step in (3, 9):
        before = seen[step - 2][0]
        sl = slice((step - 1) * BATCH, step * BATCH)
        per_var = _np_grad_norms(model, before, x[sl], y[sl])
        layers = {}
        for path, n in per_var.items():
            layers.setdefault(path.rsplit("/", 1)[0], []).append(n)
        layer_norms = {k: np.sqrt(np.sum(np.square(v))) for k, v in layers.items()}
        top = sorted(layer_norms, key=layer_norms.get, reverse=True)[:2]
        logged = {tag[len("gradients/layer/"):]: dict(vals)[step] for tag, vals in events.items()
                  if tag.startswith("gradients/layer/") and step in dict(vals)}
        assert sorted(logged) == sorted(top)
        for name in top:
            assert float(logged[name]) == pytest.approx(layer_norms[name], rel=1e-5)
        hist = dict(events["gradients/layer_norms"])[step]
        assert hist.shape[1] == 3 and hist[:, 2].sum() == len(layer_norms)
        assert hist[0, 0] == pytest.approx(min(layer_norms.values()), rel=1e-5)
        assert hist[-1, 1] == pytest.approx(max(layer_norms.values()), rel=1e-5)
    assert plugins["gradients/layer_norms"] == "histograms"


def test_by_variable_and_bad_arguments(tmp_path, rng):
    x, y = rng.normal(size=(8, 5)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
    model = _model()
    model.compile(optimizer=tfclip.keras.SGD(0.01), loss="mse")
    logger = tfclip.keras.GradientNormLogger(str(tmp_path), every_n_steps=2, top_k=10, by="variable")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[logger])
    events, _ = read_events(str(tmp_path))
    var_tags = sorted(t for t in events if t.startswith("gradients/variable/"))
    assert var_tags == sorted("gradients/variable/" + v.path for v in model.trainable_variables)
    assert "gradients/clip_fraction" not in events  # no norm clip configured
    with pytest.raises(ValueError, match="every_n_steps"):
        tfclip.keras.GradientNormLogger(str(tmp_path), every_n_steps=0)
    with pytest.raises(ValueError, match="by must be"):
        tfclip.keras.GradientNormLogger(str(tmp_path), by="tensor")
    stock = _model()
    stock.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(TypeError, match="needs a tfclip.keras optimizer"):
        stock.fit(x, y, epochs=1, verbose=0, callbacks=[tfclip.keras.GradientNormLogger(str(tmp_path))])


# ---------------------------------------------------------------- the demo's picture
def test_demo_saves_its_picture(tmp_path, capsys):
    png, adaptive_png = tmp_path / "demo.png", tmp_path / "adaptive.png"
    tfclip.demo.main(["--steps", "12", "--units", "8", "--length", "6", "--batch", "8", "--plot", str(png),
                      "--spikes", "11", "--adaptive-plot", str(adaptive_png)])
    out = capsys.readouterr().out
    assert f"saved the plot of norms and loss to {png}" in out
    assert f"saved the comparison of fixed and adaptive clipping to {adaptive_png}" in out
    for p in (png, adaptive_png):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000
    # The spiked batch (step 11, targets x50) is clipped by ZClip (past its 10-step warm-up) and
    # by AutoClip.
    lines = {line.split()[0]: line for line in out.splitlines() if "(spiked batches left out)" in line}
    assert set(lines) == {"fixed", "zclip", "autoclip", "agc"}
    for mode in ("zclip", "autoclip"):
        assert int(lines[mode].split("clipped ")[1].split()[0]) >= 1, lines[mode]


def test_demo_without_matplotlib_says_how_to_get_the_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    msg = tfclip.demo.save_plot(str(tmp_path / "x.png"), {"norm": [1.0], "loss": [1.0],
                                                          "tensor_norms": [np.ones(2)]}, ["a", "b"], 1.0)
    assert "matplotlib is not installed" in msg and 'pip install "tfclip[plot]"' in msg
    assert not (tmp_path / "x.png").exists()


def test_agc_clipped_units_and_fraction_against_numpy(tmp_path):
    """With clip=AGC the logger writes the last step's count of clipped units (all variables
    together) and its share of the units, read back from the event file and checked against the
    float64 reference on the step's gradients (a tape at the weights before the step)."""
    from test_clip_agc import ref_counts

    rng = np.random.default_rng(5)
    x = rng.normal(size=(BATCH * 6, 5)).astype(np.float32)
    y = (rng.normal(size=(BATCH * 6, 1)) * 4).astype(np.float32)
    model = _model()
    # Weights of our own (whatever Keras's seed state): units on both sides of the bound.
    wr = np.random.default_rng(21)
    model.set_weights([wr.normal(size=w.shape).astype(np.float32) * 0.5 for w in model.get_weights()])
    opt = tfclip.keras.SGD(0.1, clip=tfclip.clipping.AGC(clip_factor=0.5))
    model.compile(optimizer=opt, loss="mse")
    want = {}  # step -> reference counts per variable

    def before(batch, logs):
        xb, yb = x[batch * BATCH:(batch + 1) * BATCH], y[batch * BATCH:(batch + 1) * BATCH]
        weights = [v.numpy() for v in model.trainable_variables]
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(yb, model(xb, training=True))
        grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        want[batch + 1] = ref_counts(grads, weights, 0.5)

    def after(batch, logs):
        np.testing.assert_array_equal(opt.clipped_units.numpy(), want[batch + 1])

    log_dir = str(tmp_path / "agc")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_begin=before, on_train_batch_end=after),
                         tfclip.keras.GradientNormLogger(log_dir, every_n_steps=2)])
    events, _ = read_events(log_dir)
    units = 6 + 1 + 4 + 1 + 1 + 1  # Dense kernels: their output units; biases: one unit each
    got = dict(events["gradients/agc_clipped_units"])
    frac = dict(events["gradients/agc_clipped_fraction"])
    assert sorted(got) == sorted(frac) == [2, 4, 6]
    for step in (2, 4, 6):
        assert float(got[step]) == want[step].sum()
        np.testing.assert_allclose(float(frac[step]), want[step].sum() / units, rtol=1e-6)
    assert 0 < sum(want[s].sum() for s in want) < units * len(want)
    # Without AGC neither is written.
    assert "gradients/agc_clipped_units" not in run_plain_events(tmp_path, x, y)


def run_plain_events(tmp_path, x, y):
    model = _model()
    model.compile(optimizer=tfclip.keras.SGD(0.1, global_clipnorm=1.0), loss="mse")
    log_dir = str(tmp_path / "plain")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[tfclip.keras.GradientNormLogger(log_dir, every_n_steps=2)])
    return read_events(log_dir)[0]


def test_without_tensorboard_the_logger_says_what_to_install(monkeypatch):
    """TensorFlow 2.21 no longer installs tensorboard, where tf.summary's scalar and histogram
    live: the logger refuses at construction (not at the first write, mid-fit) and names the
    package and the command."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ImportError, match=r"needs the tensorboard package: pip install tensorboard"):
        tfclip.keras.GradientNormLogger("unused-log-dir")
