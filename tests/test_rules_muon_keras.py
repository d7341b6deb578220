"""tfclip.keras.Muon against stock keras.optimizers.Muon step for step (eagerly, in tf.function,
under XLA, model.fit), against a NumPy float64 Muon written from the definitions
(tests/reference.py, muon_matrix), and its Newton–Schulz products batched by shape. Keras's own
muon_test.py runs against the tfclip class in tests/test_dropin_yardstick_keras.py; under
tf.distribute in tests/test_distribute.py.

Tolerances: without a norm clip the arithmetic is stock's, operation for operation (the fused
momentum and update ops compute keras's expressions in keras's order; the batched matrix
products too: TF's CPU batch matmul gives each matrix the bits of its own matmul), so eagerly
the bits are stock's, and in a tf.function with TF's graph optimizer (grappler) off. With it on,
grappler rewrites stock's element-wise chains and products, not the fused ops: a few float32
ulp, as stock's own graph differs from stock's eager step (test_grappler_moves_stock_not_tfclip).
A norm clip's scale comes from tfclip's float64 norm, stock's from a float32 one: a few float32
ulp per step. XLA compiles the matrix products with its own kernels, stock's too. bfloat16
matrices: the fused ops compute in float32 and round once, stock rounds after each op."""
import numpy as np
import pytest
import tensorflow as tf

import reference
from test_clip_agc import agc_clip

try:
    import keras
    import tfclip.keras as tk
except ImportError:  # TF 2.15 (Keras 2): tfclip.keras says why
    keras = tk = None
pytestmark = pytest.mark.skipif(tk is None, reason="Keras 3 (tfclip.keras) is not installed with this TF")


def _model(exclude_embeddings=True):
    """Token ids -> Embedding (AdamW unless exclude_embeddings=False) -> Dense kernels of shapes
    (8, 16), (16, 16) twice, (16, 8) (Muon: two batches, one of them a wide and a tall matrix
    joined) -> a (32, 1) output layer `last` (excluded: AdamW); biases AdamW."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(20, 8)(inp)
    for units in (16, 16, 16, 8):
        x = keras.layers.Dense(units, activation="tanh")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inp, keras.layers.Dense(1, name="last")(x))


def _data(seed=3, n=16):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 20, size=(n, 4)).astype(np.int32), rng.standard_normal((n, 1)).astype(np.float32)


def _train(cls, how="eager", steps=4, grad_fn=None, model=None, **kw):
    """Custom-loop training; returns (model weights, optimizer variables' values, optimizer)."""
    m = model or _model()
    opt = cls(**{"learning_rate": 0.02, "exclude_layers": ["last"], **kw})
    x, y = _data()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(xb) - yb) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        if grad_fn is not None:
            grads = grad_fn(grads)
        opt.apply(grads, m.trainable_variables)

    if how != "eager":
        step = tf.function(step, jit_compile=how == "xla")
    for t in range(steps):
        step(x[4 * t:4 * t + 4], y[4 * t:4 * t + 4] * (8.0 if t == 1 else 1.0))
    return [w.numpy() for w in m.trainable_variables], [v.numpy() for v in opt.variables], opt


def _same(a, b, exact, rtol=2e-5, atol=2e-6):
    assert len(a) == len(b)
    for k, (p, q) in enumerate(zip(a, b)):
        if exact:
            np.testing.assert_array_equal(p, q, err_msg=f"#{k}")
        else:
            np.testing.assert_allclose(p, q, rtol=rtol, atol=atol, err_msg=f"#{k}")


CASES = [{}, {"nesterov": False}, {"rms_rate": None, "weight_decay": 0.1}, {"adam_lr_ratio": 0.1},
         {"adam_weight_decay": None, "ns_steps": 3, "momentum": 0.8}, {"clipvalue": 0.05},
         {"global_clipnorm": 0.5}, {"clipnorm": 0.1}]


def _batched_matmul_gives_the_per_matrix_bits():
    """Whether this CPU's TF computes a stacked matrix product with the bits of each matrix's own
    (a Xeon's did, 2026-11; a 2-core AMD EPYC's AVX2 kernels did not, 2026-12-04: 4e-8 apart in a
    Muon step). Where they differ, the batched chain is held to a tolerance: its arithmetic is
    stock's, summed in another order."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 16, 16)).astype(np.float32)
    b = rng.standard_normal((3, 16, 16)).astype(np.float32)
    stacked = tf.linalg.matmul(a, b).numpy()
    return all(np.array_equal(stacked[k], tf.linalg.matmul(a[k], b[k]).numpy()) for k in range(3))


_BATCHED_BITS = _batched_matmul_gives_the_per_matrix_bits()


@pytest.fixture(params=[False, True], ids=["per_matrix", "batched"])
def batched(request, monkeypatch):
    """The Newton–Schulz products per matrix (the CPU's default) or batched by shape (a GPU's)."""
    monkeypatch.setattr(tk.Muon, "_tfclip_batch_products", request.param)
    return request.param


# Under XLA (each case a compile, ~4 s on 2 cores): the cases that change the op's inputs or the
# matrices' clip; the rest are the same XLA programs with other numbers.
XLA_CASES = [{}, {"adam_lr_ratio": 0.1}, {"global_clipnorm": 0.5}, {"clipnorm": 0.1}]


@pytest.mark.parametrize("kw,how", [(kw, how) for how in ("eager", "function") for kw in CASES]
                         + [(kw, "xla") for kw in XLA_CASES],
                         ids=lambda x: x if isinstance(x, str) else "-".join(x) or "plain")
def test_follows_stock_muon(kw, how, batched):
    sw, sv, so = _train(keras.optimizers.Muon, how, **kw)
    ow, ov, oo = _train(tk.Muon, how, **kw)
    # In a graph, TF's graph optimizer (grappler) rewrites stock's ops, not the fused ones:
    # test_same_arithmetic_as_stock_in_a_graph shows the bits with it off. Batched, the products
    # sum in the order of TF's batched matrix kernel, which TF picks per CPU (_BATCHED_BITS).
    exact = how == "eager" and not ({"global_clipnorm", "clipnorm"} & set(kw)) and not (batched and not _BATCHED_BITS)
    _same(sw, ow, exact)
    _same(sv, ov, exact)
    assert [tuple(v.shape) for v in so.variables] == [tuple(v.shape) for v in oo.variables]


@pytest.mark.parametrize("kw", [{}, {"nesterov": False, "adam_lr_ratio": 0.1}, {"rms_rate": None, "weight_decay": 0.1}],
                         ids=lambda kw: "-".join(kw) or "plain")
def test_same_arithmetic_as_stock_in_a_graph(kw, batched):
    """With grappler off, a tf.function step gives stock's bits, per matrix and batched (where
    the CPU's batched product has the per-matrix bits, _BATCHED_BITS: else within a tolerance):
    the fused ops and the batched chain are the same arithmetic; only the graph optimizer's
    rewrites of stock's ops tell them apart."""
    before = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        sw, sv, _ = _train(keras.optimizers.Muon, "function", **kw)
        ow, ov, _ = _train(tk.Muon, "function", **kw)
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before})
    exact = not batched or _BATCHED_BITS
    _same(sw, ow, exact=exact)
    _same(sv, ov, exact=exact)


def test_grappler_moves_stock_not_tfclip():
    """Why a tf.function step is compared to a tolerance: with grappler on, stock's own graph
    step leaves its eager bits, tfclip's stays on them (its fused ops are not rewritten; its
    chains are stock's, per matrix on the CPU)."""
    se, _, _ = _train(keras.optimizers.Muon, "eager")
    sf, _, _ = _train(keras.optimizers.Muon, "function")
    of, _, _ = _train(tk.Muon, "function")
    assert any(not np.array_equal(a, b) for a, b in zip(se, sf))
    _same(se, sf, exact=False)
    _same(sf, of, exact=False)


def _step_ops(cls, **kw):
    """The op types of one traced training step of `_model()` with `cls` (library functions
    included)."""
    x, y = _data()
    m = _model()
    opt = cls(learning_rate=0.02, exclude_layers=["last"], **kw)
    opt.build(m.trainable_variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(xb) - yb) ** 2)
        opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)

    graph = step.get_concrete_function(x[:4], y[:4]).graph.as_graph_def()
    return [n.op for n in list(graph.node) + [n for f in graph.library.function for n in f.node_def]]


def _count_matmuls(ops):
    return sum(op in ("MatMul", "BatchMatMulV2", "BatchMatMulV3") for op in ops)


@pytest.mark.parametrize("device,want_batched", [(None, False), ("GPU", True)])
def test_newton_schulz_is_batched_by_shape_on_a_gpu(monkeypatch, device, want_batched):
    """Four Muon matrices of two shape classes ((8, 16) with (16, 8) transposed, (16, 16) twice):
    where the variables are on a GPU, 3 * ns_steps products per class, where stock issues them
    per matrix (the model's own products are the same in both graphs); on the CPU per matrix,
    as stock. (No GPU here: the device the class reads is the variables' `device`, patched.)"""
    if device is not None:
        from tfclip.keras import _muon

        real = _muon._tf_var
        monkeypatch.setattr(_muon, "_tf_var", lambda v: _OnDevice(real(v), device))
    counts = [_count_matmuls(_step_ops(cls, ns_steps=5)) for cls in (keras.optimizers.Muon, tk.Muon)]
    assert counts[0] - counts[1] == (3 * 5 * (4 - 2) if want_batched else 0), counts


def test_matrices_element_wise_step_is_two_fused_ops():
    """The matrices' momentum is one op over all of them, their decay and scaled update one op
    per largest dimension (16 for all four here), where stock writes each matrix's momentum and
    variable with its own assign ops; tfclip's step has no AssignAdd or AssignSub at all (the
    AdamW variables are the Adam op's)."""
    stock, ours = _step_ops(keras.optimizers.Muon), _step_ops(tk.Muon)
    assert ours.count("TfclipClipApplyMuonMomentum") == 1
    assert ours.count("TfclipClipApplyMuonUpdate") == 1
    assert ours.count("TfclipClipApplyAdam") == 1
    assert ours.count("AssignAddVariableOp") + ours.count("AssignSubVariableOp") == 0
    assert stock.count("AssignAddVariableOp") >= 4 and stock.count("AssignSubVariableOp") >= 4
    # (the graph as a whole: fewer ops than stock's, whose per-variable ops outnumber the fused ones)
    assert len(ours) < len(stock)


def test_update_ops_group_by_largest_dimension_and_decay():
    """Matrices of three largest dimensions (6, 5, 8), one excluded from weight decay: four update
    ops (each group's shape_scale and weight decay its own), and stock's bits eagerly."""
    rng = np.random.default_rng(21)
    shapes = [(6, 4), (4, 6), (3, 5), (5, 5), (8, 2)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    steps = [[tf.constant(rng.standard_normal(s), tf.float32) for s in shapes] for _ in range(3)]
    out = []
    for cls in (keras.optimizers.Muon, tk.Muon):
        vs = [keras.Variable(x, name=f"w{k}") for k, x in enumerate(init)]
        opt = cls(learning_rate=0.05, weight_decay=0.1)
        opt.exclude_from_weight_decay(var_names=["w3"])
        for g in steps:
            opt.apply(g, vs)
        out.append([v.numpy() for v in vs] + [m.numpy() for m in opt.momentums])
        if cls is tk.Muon:
            graph = tf.function(lambda: opt.apply(steps[0], vs)).get_concrete_function().graph.as_graph_def()
            ops = [n.op for n in list(graph.node) + [n for f in graph.library.function for n in f.node_def]]
            assert ops.count("TfclipClipApplyMuonUpdate") == 4  # (6, decay), (5, decay), (5, none), (8, decay)
    _same(out[0], out[1], exact=True)


class _OnDevice:
    """A variable that says it is on `device` (the rest is the variable's)."""

    def __init__(self, var, device):
        self._var, self.device = var, f"/job:localhost/replica:0/task:0/device:{device}:0"

    def __getattr__(self, name):
        return getattr(self._var, name)


def test_batches_join_transposed_shapes():
    from tfclip.keras import _muon

    groups = _muon.shape_groups([(8, 16), (16, 16), (16, 8), (3, 5), (16, 16)])
    assert groups == [((8, 16), [(0, False), (2, True)]), ((16, 16), [(1, False), (4, False)]),
                      ((3, 5), [(3, False)])]


def test_matches_the_float64_definition():
    """Plain variables (no layer: every matrix takes Muon's step): three steps against
    reference.muon_matrix, each from tfclip's previous state."""
    rng = np.random.default_rng(2)
    shapes = [(6, 10), (10, 6), (6, 10), (7, 7)]
    vs = [keras.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    opt = tk.Muon(learning_rate=0.05, weight_decay=0.01)
    opt.build(vs)
    for _ in range(3):
        g = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        before = [(v.numpy(), opt.momentums[k].numpy()) for k, v in enumerate(vs)]
        opt.apply([tf.constant(x) for x in g], vs)
        for k, (w, m) in enumerate(before):
            want_w, want_m = reference.muon_matrix(w, m, g[k], 0.05, weight_decay=0.01)
            np.testing.assert_allclose(opt.momentums[k].numpy(), want_m, rtol=1e-6, atol=1e-6)
            # float32 Newton–Schulz products against float64: ~1e-6 of the update's scale
            np.testing.assert_allclose(vs[k].numpy(), want_w, rtol=1e-5, atol=2e-6)


def test_matrices_only_and_nonfinite_policies():
    """A model of matrices only (no AdamW variable, so no apply op: the policy on the norm
    pass's norm): skip writes nothing and counts; raise fails naming the norm and writes
    nothing; propagate spreads the NaN as stock does."""
    rng = np.random.default_rng(4)
    shapes = [(5, 3), (3, 5)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    good = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    bad = [good[0], tf.tensor_scatter_nd_update(good[1], [[1, 1]], [np.nan])]
    for policy in ("skip", "raise", "propagate"):
        vs = [keras.Variable(x) for x in init]
        opt = tk.Muon(learning_rate=0.05, nonfinite=policy)
        opt.apply(good, vs)
        before = [v.numpy() for v in vs] + [v.numpy() for v in opt.variables if v.name != "iteration"]
        if policy == "raise":
            with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite.*nonfinite='raise'"):
                opt.apply(bad, vs)
        else:
            opt.apply(bad, vs)
        after = [v.numpy() for v in vs] + [v.numpy() for v in opt.variables if v.name != "iteration"]
        if policy == "propagate":
            stock = [keras.Variable(x) for x in init]
            so = keras.optimizers.Muon(learning_rate=0.05)
            so.apply(good, stock)
            so.apply(bad, stock)
            _same([v.numpy() for v in stock], after[:2], exact=True)
            assert np.isnan(after[1]).all()
        else:
            _same(before, after, exact=True)
        assert int(opt.skipped_steps.numpy()) == (policy == "skip")


def test_nonfinite_skip_writes_nothing_in_a_model():
    nan_at_2 = {"t": 0}

    def poison(grads):
        nan_at_2["t"] += 1
        if nan_at_2["t"] == 2:
            return [g * np.nan if k == 3 else g for k, g in enumerate(grads)]
        return grads

    ref_w, ref_v, _ = _train(tk.Muon, steps=1)
    w, v, opt = _train(tk.Muon, steps=2, grad_fn=poison)
    # step 2 skipped: every weight and slot as after step 1 (the counter advances, as stock's)
    _same(ref_w, w, exact=True)
    names = [x.name for x in opt.variables]
    _same([a for a, n in zip(ref_v, names) if n != "iteration"], [a for a, n in zip(v, names) if n != "iteration"],
          exact=True)
    assert int(opt.skipped_steps.numpy()) == 1


@pytest.mark.parametrize("how", ["eager", "function"])
def test_an_embedding_taking_muons_step_follows_stock(how):
    """exclude_embeddings=False: the Embedding's IndexedSlices gradient (repeated rows) feeds
    the dense momentum, densified as stock's add densifies it."""
    sw, sv, _ = _train(keras.optimizers.Muon, how, model=_model(), exclude_embeddings=False)
    ow, ov, oo = _train(tk.Muon, how, model=_model(), exclude_embeddings=False)
    assert oo.adam_velocities[0] is None  # (the embedding is a Muon matrix here)
    _same(sw, ow, exact=how == "eager")  # (a graph: grappler, test_same_arithmetic_as_stock_in_a_graph)
    _same(sv, ov, exact=how == "eager")


def test_learning_rate_schedule_and_model_fit_follow_stock():
    x, y = _data(n=32)
    out = []
    for cls in (keras.optimizers.Muon, tk.Muon):
        m = _model()
        sched = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        m.compile(optimizer=cls(learning_rate=sched, exclude_layers=["last"]), loss="mse", jit_compile=False)
        h = m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        out.append((h.history["loss"], m.get_weights()))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
    _same(out[0][1], out[1][1], exact=False)  # (fit's step is a graph: grappler's rewrites)


def test_checkpoints_move_both_ways(tmp_path):
    x, y = _data()

    def run(first, second):
        m = _model()
        o1 = first(learning_rate=0.02, exclude_layers=["last"])
        for t in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((m(x[4 * t:4 * t + 4]) - y[4 * t:4 * t + 4]) ** 2)
            o1.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
        path = tf.train.Checkpoint(opt=o1, m=m).write(str(tmp_path / f"{first.__module__}-{second.__module__}"))
        m2 = _model()
        o2 = second(learning_rate=0.02, exclude_layers=["last"])
        o2.build(m2.trainable_variables)
        tf.train.Checkpoint(opt=o2, m=m2).read(path).assert_consumed()
        for t in range(2, 4):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((m2(x[4 * t:4 * t + 4]) - y[4 * t:4 * t + 4]) ** 2)
            o2.apply(tape.gradient(loss, m2.trainable_variables), m2.trainable_variables)
        return [w.numpy() for w in m2.trainable_variables]

    straight = run(keras.optimizers.Muon, keras.optimizers.Muon)
    _same(straight, run(keras.optimizers.Muon, tk.Muon), exact=True)
    _same(straight, run(tk.Muon, keras.optimizers.Muon), exact=True)


def test_agc_clips_every_variable_as_the_paper():
    """clip=AGC: the AdamW variables clipped inside the op, the matrices by the same clip in TF
    ops; both against stock Muon given the gradients clipped by the float64 reference."""
    import tfclip

    rng = np.random.default_rng(6)
    shapes = [(6, 4), (4,), (4, 6)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float32) * 5 for s in shapes]
    ours = [keras.Variable(x) for x in init]
    opt = tk.Muon(learning_rate=0.05, clip=tfclip.clipping.AGC(0.01))
    opt.apply([tf.constant(g) for g in grads], ours)
    stock = [keras.Variable(x) for x in init]
    clipped = [agc_clip(g, w, 0.01) for g, w in zip(grads, init)]
    keras.optimizers.Muon(learning_rate=0.05).apply([tf.constant(c.astype(np.float32)) for c, _ in clipped], stock)
    _same([v.numpy() for v in stock], [v.numpy() for v in ours], exact=False)
    assert list(opt.clipped_units.numpy()) == [int(np.sum(u)) for _, u in clipped]


def test_loss_scale_optimizer_follows_stock():
    out = []
    for wrap, cls in ((keras.optimizers.LossScaleOptimizer, keras.optimizers.Muon),
                      (tk.LossScaleOptimizer, tk.Muon)):
        m = _model()
        opt = wrap(cls(learning_rate=0.02, exclude_layers=["last"]), initial_scale=2.0 ** 10)
        x, y = _data()
        for t in range(3):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_mean((m(x[4 * t:4 * t + 4]) - y[4 * t:4 * t + 4]) ** 2))
            opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
        out.append([w.numpy() for w in m.trainable_variables])
    _same(out[0], out[1], exact=True)


@pytest.mark.parametrize("kw,match", [
    ({"state_dtype": "bfloat16"}, "Muon keeps its state as the stock class does"),
    ({"stochastic_rounding": True}, "stochastic_rounding"),
    ({"adam_beta_1": float("inf")}, "adam_beta_1 must be finite"),
    ({"ns_steps": -1}, "ns_steps must be an int >= 0"),
    ({"rms_rate": float("nan")}, "rms_rate must be a finite number or None"),
    ({"adam_lr_ratio": "1"}, "adam_lr_ratio must be a finite number"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        tk.Muon(**kw)


def test_config_round_trip_and_get():
    opt = tk.Muon(learning_rate=0.5, exclude_layers=["out"], nonfinite="propagate", rms_rate=None)
    again = tk.Muon.from_config(opt.get_config())
    assert again.exclude_layers == ["out"] and again.nonfinite == "propagate" and again.rms_rate is None
    assert type(tk.get("muon")) is tk.Muon


def test_bfloat16_matrices_follow_stock():
    """A bfloat16 model (as under keras's "bfloat16" dtype policy). The fused ops compute a
    bfloat16 variable's step in float32 and round once; stock rounds after each op (its momentum's
    `m * (momentum - 1)` and sum, its decay's two products and difference, `lr * u` cast before
    the subtraction): the matrices and momentum within a bfloat16 ulp or two of stock's, and
    their momentum exactly the float32 expression rounded once (an ulp of the values, about 1: a
    result near 0 from a cancellation may differ by it). The bias takes the fused Adam op:
    tfclip.keras.AdamW's bits."""
    rng = np.random.default_rng(12)
    shapes = [(6, 4), (4,), (4, 6)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    steps = [[tf.constant(rng.standard_normal(s), tf.bfloat16) for s in shapes] for _ in range(3)]
    out = {}
    for cls in (keras.optimizers.Muon, tk.Muon, tk.AdamW):
        vs = [keras.Variable(x, dtype="bfloat16") for x in init]
        opt = cls(learning_rate=0.05) if cls is not tk.AdamW else cls(learning_rate=0.05, weight_decay=0.004)
        for g in steps:
            opt.apply(g, vs)
        out[cls] = [v.numpy().astype(np.float32) for v in vs], opt
    (sw, so), (ow, oo), (aw, _) = out[keras.optimizers.Muon], out[tk.Muon], out[tk.AdamW]
    _same([sw[0], sw[2], so.momentums[0].numpy(), so.momentums[2].numpy()],
          [ow[0], ow[2], oo.momentums[0].numpy(), oo.momentums[2].numpy()], exact=False, rtol=2 ** -6, atol=2 ** -8)
    m = np.zeros((6, 4), np.float32)  # the momentum as the fused op computes it, from the same gradients
    for g in steps:
        g = g[0].numpy().astype(np.float32)
        m = (m + (g + m * np.float32(0.95 - 1.0))).astype("bfloat16").astype(np.float32)
    np.testing.assert_array_equal(oo.momentums[0].numpy().astype(np.float32), m)
    np.testing.assert_array_equal(ow[1], aw[1])
    assert not np.array_equal(ow[1], init[1].astype("bfloat16").astype(np.float32))


def test_a_batch_is_one_dtype(monkeypatch):
    """Batched (a GPU's way), matrices of one shape but two dtypes take a batch each. (Stock
    Muon cannot step a float64 matrix: its rms_rate factor is float32.)"""
    from tfclip.keras import _muon

    assert [k for k, _ in _muon.shape_groups([(4, 6), (6, 4), (4, 6)], ["float32", "bfloat16", "bfloat16"])] == \
        [(4, 6, "float32"), (4, 6, "bfloat16")]
    monkeypatch.setattr(tk.Muon, "_tfclip_batch_products", True)
    rng = np.random.default_rng(13)
    init = [(rng.standard_normal((4, 6)), "float32"), (rng.standard_normal((6, 4)), "bfloat16"),
            (rng.standard_normal((4, 6)), "bfloat16")]
    steps = [[tf.constant(rng.standard_normal(x.shape), d) for x, d in init] for _ in range(2)]
    out = []
    for cls in (keras.optimizers.Muon, tk.Muon):
        vs = [keras.Variable(x, dtype=d) for x, d in init]
        opt = cls(learning_rate=0.05)
        for g in steps:
            opt.apply(g, vs)
        out.append([v.numpy().astype(np.float32) for v in vs])
    _same(out[0][:1], out[1][:1], exact=True)
    # (bfloat16: one rounding, not stock's one per op; test_bfloat16_matrices_follow_stock)
    _same(out[0][1:], out[1][1:], exact=False, rtol=2 ** -6, atol=2 ** -8)


@pytest.mark.parametrize("kw", [{"global_clipnorm": 1.0}, {"clipnorm": 0.5}, {"clipvalue": 0.3}],
                         ids=lambda kw: "-".join(kw))
def test_indexed_slices_on_a_matrix_are_clipped_by_their_slices(kw):
    """A Muon matrix's IndexedSlices gradient with a repeated row: its norm is its slices'
    (stock's global_norm and clip_by_norm square the slices apart), so the clip every variable
    gets is stock's; value clipping clips each slice, then the rows are summed, as keras's
    ops.clip."""
    rng = np.random.default_rng(14)
    init = [rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((6,)).astype(np.float32)]
    steps = []
    for _ in range(3):
        values = tf.constant(rng.standard_normal((3, 6)).astype(np.float32) * 3)
        steps.append([tf.IndexedSlices(values, tf.constant([1, 1, 4]), tf.constant([5, 6])),
                      tf.constant(rng.standard_normal(6).astype(np.float32))])
    out = []
    for cls in (keras.optimizers.Muon, tk.Muon):
        vs = [keras.Variable(x) for x in init]
        opt = cls(learning_rate=0.05, **kw)
        for g in steps:
            opt.apply(g, vs)
        out.append([v.numpy() for v in vs])
    # (the clip scale's last bit: tfclip's norm is float64, stock's float32)
    _same(out[0], out[1], exact=False, rtol=1e-6, atol=1e-7)


def test_raise_under_xla_with_matrices_only():
    """A step of matrices alone raises under XLA too (its momentum op does, as every fused op),
    and writes nothing."""
    vs = [keras.Variable(np.ones((3, 4), np.float32))]
    opt = tk.Muon(learning_rate=0.05, nonfinite="raise")
    opt.build(vs)
    step = tf.function(lambda g: opt.apply([g], vs), jit_compile=True)
    step(tf.ones((3, 4)))
    before = [vs[0].numpy(), opt.momentums[0].numpy()]
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite.*nonfinite='raise'"):
        step(tf.constant(np.full((3, 4), np.nan, np.float32)))
    np.testing.assert_array_equal(vs[0].numpy(), before[0])
    np.testing.assert_array_equal(opt.momentums[0].numpy(), before[1])
