"""The element-wise rules beyond SGD/Momentum/Adam (issue 21): Adagrad, RMSprop
(momentum, centered), Adadelta, Adamax, Lion, Nadam, Ftrl, Lamb, ScheduleFreeAdamW as tfclip.rules, fused_clip_apply
against stock Keras 3 step by step (dense gradients, each clip mode, weight decay), and the core
against NumPy float64 (TF1's RMSProp kernel order too). The Keras drop-ins: test_dropin_rules_keras.py."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import reference
import tfclip

SHAPES = [(7, 5), (33,), ()]
CASES = {
    "adagrad": (lambda: tfclip.rules.Adagrad(0.05, initial_accumulator_value=0.2),
                lambda kw: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2, **kw)),
    "rmsprop": (lambda: tfclip.rules.RMSprop(0.01), lambda kw: keras.optimizers.RMSprop(0.01, **kw)),
    "rmsprop_momentum_centered": (
        lambda: tfclip.rules.RMSprop(0.01, rho=0.8, momentum=0.7, centered=True),
        lambda kw: keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.7, centered=True, **kw)),
    "rmsprop_centered": (lambda: tfclip.rules.RMSprop(0.01, centered=True),
                         lambda kw: keras.optimizers.RMSprop(0.01, centered=True, **kw)),
    "adadelta": (lambda: tfclip.rules.Adadelta(1.0), lambda kw: keras.optimizers.Adadelta(1.0, **kw)),
    "adamax": (lambda: tfclip.rules.Adamax(0.02), lambda kw: keras.optimizers.Adamax(0.02, **kw)),
    "lion": (lambda: tfclip.rules.Lion(0.003), lambda kw: keras.optimizers.Lion(0.003, **kw)),
    "nadam": (lambda: tfclip.rules.Nadam(0.01), lambda kw: keras.optimizers.Nadam(0.01, **kw)),
    "ftrl": (lambda: tfclip.rules.Ftrl(0.05, l1_regularization_strength=0.001, l2_regularization_strength=0.01,
                                       l2_shrinkage_regularization_strength=0.01, beta=0.1),
             lambda kw: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.001, l2_regularization_strength=0.01,
                                              l2_shrinkage_regularization_strength=0.01, beta=0.1, **kw)),
    # Another power than -0.5: the core's general (std::pow) variant.
    "ftrl_power": (lambda: tfclip.rules.Ftrl(0.05, learning_rate_power=-0.7, l2_regularization_strength=0.01),
                   lambda kw: keras.optimizers.Ftrl(0.05, learning_rate_power=-0.7, l2_regularization_strength=0.01,
                                                    **kw)),
    "lamb": (lambda: tfclip.rules.Lamb(0.01), lambda kw: keras.optimizers.Lamb(0.01, **kw)),
    "schedule_free_adamw": (lambda: tfclip.rules.ScheduleFreeAdamW(0.01, warmup_steps=5),
                            lambda kw: keras.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=5, **kw)),
}
CLIPS = {"none": {}, "global_clipnorm": {"global_clipnorm": 0.5}, "clipnorm": {"clipnorm": 0.3},
         "clipvalue": {"clipvalue": 0.05}}


def _side_by_side(case, steps, seed, keras_kw, fused_kw, weight_decay=None):
    """`steps` steps of tfclip.fused_clip_apply and of the stock Keras optimizer on the same
    gradients; returns (tfclip's variables, Keras's, the rule)."""
    make_rule, make_keras = CASES[case]
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    ours = [tf.Variable(x) for x in init]
    theirs = [keras.Variable(x) for x in init]
    rule = make_rule()
    if weight_decay is not None:
        rule.weight_decay = weight_decay
        keras_kw = {**keras_kw, "weight_decay": weight_decay}
    opt = make_keras(keras_kw)
    for step in range(steps):
        grads = [tf.constant(rng.normal(size=s).astype(np.float32) * (1 + step % 3)) for s in SHAPES]
        res = tfclip.fused_clip_apply(list(zip(grads, ours)), rule, **fused_kw)
        assert bool(res.applied)
        opt.apply_gradients(zip(grads, theirs))
    return ours, theirs, rule


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("case", list(CASES))
def test_trajectory_matches_stock_keras(case, clip):
    """20 steps of fused_clip_apply against the stock Keras optimizer clipping the same way."""
    ours, theirs, rule = _side_by_side(case, 20, 3, CLIPS[clip], CLIPS[clip])
    for a, b in zip(ours, theirs):
        if case == "lamb":
            # Keras sums |w|^2 and |u|^2 in float32 (TF's reduction order), tfclip in fp64 over
            # fixed chunks: the per-tensor trust ratio can differ in its last bits.
            np.testing.assert_allclose(a.numpy(), np.asarray(b.numpy()), rtol=1e-5, atol=1e-6)
        elif case.startswith("ftrl"):
            # n^0.5 is a pow: TF's vectorized Eigen pow is an ulp off for about a quarter of
            # float32 inputs, std::pow is not (tests/test_dropin_rules_keras.py measures it).
            np.testing.assert_allclose(a.numpy(), np.asarray(b.numpy()), rtol=2e-5, atol=1e-6)
        elif clip in ("none", "clipvalue"):
            # The same operations in the same order as Keras: the same bits.
            np.testing.assert_array_equal(a.numpy(), np.asarray(b.numpy()))
        else:
            # Keras's norm is float32 (tf.linalg.global_norm), tfclip's float64: the clip scale
            # can differ in its last bit.
            np.testing.assert_allclose(a.numpy(), np.asarray(b.numpy()), rtol=2e-6, atol=1e-7)
    assert int(rule.iterations.numpy()) == 20


@pytest.mark.parametrize("case", ["adagrad", "rmsprop", "adamax", "lion", "nadam", "lamb", "schedule_free_adamw"])
def test_decoupled_weight_decay_as_keras(case):
    ours, theirs, _ = _side_by_side(case, 10, 5, {}, {}, weight_decay=0.05)
    for a, b in zip(ours, theirs):
        if case == "lamb":  # the ratio's norms: see test_trajectory_matches_stock_keras
            np.testing.assert_allclose(a.numpy(), np.asarray(b.numpy()), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a.numpy(), np.asarray(b.numpy()))


@pytest.mark.parametrize("rule,nslots,hp,flags", [
    ("adagrad", 1, {"lr": 0.05, "epsilon": 1e-6}, {}),
    ("adagrad", 1, {"lr": 0.05, "epsilon": 1e-3}, {"epsilon_outside_sqrt": True}),
    ("rmsprop", 3, {"lr": 0.01, "rho": 0.8, "momentum": 0.5, "epsilon": 1e-6},
     {"centered": True, "has_momentum": True}),
    ("rmsprop", 1, {"lr": 0.01, "rho": 0.8, "momentum": 0.0, "epsilon": 1e-3}, {"epsilon_outside_sqrt": True}),
    ("rmsprop", 3, {"lr": 0.01, "rho": 0.8, "momentum": 0.5, "epsilon": 1e-3},
     {"centered": True, "has_momentum": True, "epsilon_outside_sqrt": True}),
    ("adadelta", 2, {"lr": 1.0, "rho": 0.9, "epsilon": 1e-6}, {}),
    ("adamax", 2, {"lr": 0.02, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6}, {}),
    ("lion", 1, {"lr": 0.003, "beta_1": 0.9, "beta_2": 0.99}, {}),
    ("nadam", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "u_product": 0.4}, {}),
    ("nadam", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "u_product": 0.4,
                  "schedule_decay": 0.5}, {}),
    ("nadam", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "u_product": 0.4,
                  "schedule_decay": 0.004}, {"legacy_nadam": True}),
    ("ftrl", 2, {"lr": 0.05, "lr_power": -0.6, "l1": 0.01, "l2": 0.02, "l2_shrinkage": 0.03, "beta": 0.2}, {}),
    ("ftrl_sqrt", 2, {"lr": 0.05, "l1": 0.01, "l2": 0.02, "l2_shrinkage": 0.03, "beta": 0.2}, {}),
    ("tf_rmsprop", 3, {"lr": 0.01, "rho": 0.8, "momentum": 0.5, "epsilon": 1e-6}, {"centered": True}),
    ("lamb", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "weight_decay": 0.1}, {}),
    ("schedule_free_adamw", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "warmup_steps": 3,
                                "weight_decay": 0.1}, {}),
    ("proximal_gradient_descent", 0, {"lr": 0.05, "l1": 0.01, "l2": 0.2}, {}),
    ("proximal_gradient_descent", 0, {"lr": 0.05, "l1": 0.0, "l2": 0.2}, {}),
    ("proximal_adagrad", 1, {"lr": 0.05, "l1": 0.01, "l2": 0.2}, {}),
    ("adagrad_da", 2, {"lr": 0.05, "l1": 0.02, "l2": 0.2, "global_step": 3.0}, {}),
    ("adagrad_da", 2, {"lr": 0.05, "l1": 0.0, "l2": 0.2, "global_step": 7.0}, {}),
])
def test_core_rules_against_numpy_float64(rule, nslots, hp, flags):
    from tfclip import _core

    rng = np.random.default_rng(11)
    v = [rng.normal(size=(50,)).astype(np.float64)]
    s = [[np.abs(rng.normal(size=(50,))) * 0.1] for _ in range(nslots)]
    v_ref, s_ref = v[0].copy(), [x[0].copy() for x in s]
    for t in range(1, 6):
        g = [rng.normal(size=(50,))]
        step = {"step": float(t)} if rule in ("adamax", "nadam", "lamb", "schedule_free_adamw") else {}
        _core.clip_apply(rule, v, g, s, {**hp, **flags, **step})
        v_ref = reference.step(rule, v_ref, s_ref, g[0], {**hp, **flags, "learning_rate": hp["lr"]}, t)
        if rule == "lamb":  # one step's exact value, so the checks cannot lag a whole step
            np.testing.assert_allclose(v[0], v_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v[0], v_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(s, s_ref):
        np.testing.assert_allclose(a[0], b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["adagrad", "rmsprop_momentum_centered", "adadelta", "adamax", "lion", "nadam",
                                  "ftrl", "lamb", "schedule_free_adamw"])
def test_indexed_slices_give_the_densified_gradients_update(case):
    """IndexedSlices with duplicate rows, without densifying: the same bits as the rule given the
    dense gradient (untouched rows get the zero-gradient update, as a dense zero row does)."""
    make_rule, _ = CASES[case]
    rng = np.random.default_rng(9)
    init = rng.normal(size=(6, 4)).astype(np.float32)
    a, b = tf.Variable(init), tf.Variable(init)
    ra, rb = make_rule(), make_rule()
    for _ in range(5):
        values = tf.constant(rng.normal(size=(4, 4)).astype(np.float32))
        idx = tf.constant([3, 0, 3, 5])
        sl = tf.IndexedSlices(values, idx, tf.constant([6, 4]))
        tfclip.fused_clip_apply([(sl, a)], ra)
        tfclip.fused_clip_apply([(tf.convert_to_tensor(sl), b)], rb)
    if case == "lamb":
        # The sparse pass sums |w|^2 and |u|^2 row by row, the dense one over fixed lanes: the
        # trust ratio, and so the step, can differ in its last bit.
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _bad_values():
    from tfclip import _core

    out = []
    for rule, row in _core.rule_table().items():
        for name in row["hparams"]:
            info = _core.hparam_table()[name]
            # Below a finite lower bound, above a finite upper one, else (a range as wide as the
            # stock classes') -inf (NaN is an optional input's "not given").
            bad = (info["lo"] - 1.0 if np.isfinite(info["lo"])
                   else info["hi"] + 1.0 if np.isfinite(info["hi"]) else float("-inf"))
            out.append(pytest.param(rule, name, bad, id=f"{rule}-{name}"))
            out.append(pytest.param(rule, name, float("inf"), id=f"{rule}-{name}-inf"))
    return out


@pytest.mark.parametrize("rule,name,bad", _bad_values())
def test_every_hyperparameter_out_of_range_is_named_and_writes_nothing(rule, name, bad):
    """Every rule of the table, every hyper-parameter it takes: a value out of its range (or not
    finite) is an error naming it (by its Keras name), and nothing is written."""
    from tfclip import _core

    table = _core.hparam_table()
    row = _core.rule_table()[rule]
    rng = np.random.default_rng(2)
    var = [rng.normal(size=(9,))]
    slots = [[np.array(np.abs(rng.normal(size=reference.slot_shape(row, s, (9,)))))] for s in row["slots"][:row["min_slots"]]]
    before = [var[0].copy()] + [s[0].copy() for s in slots]
    hp = {n: (0.01 if n == "lr" else table[n]["default"]) for n in row["hparams"]}
    hp = {n: v for n, v in hp.items() if not np.isnan(v)}
    hp[name] = bad
    with pytest.raises(ValueError, match=table[name]["display"]):
        _core.clip_apply(rule, var, [rng.normal(size=(9,))], slots, hp)
    for a, b in zip([var[0]] + [s[0] for s in slots], before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rule,nslots,hp", [
    ("proximal_gradient_descent", 0, {"lr": 0.05, "l1": 0.01, "l2": 0.2}),
    ("proximal_adagrad", 1, {"lr": 0.05, "l1": 0.01, "l2": 0.2}),
    ("adagrad_da", 2, {"lr": 0.05, "l1": 0.02, "l2": 0.2, "global_step": 4.0}),
    ("sgd", 0, {"lr": 0.05}),
])
@pytest.mark.parametrize("lazy", [False, True], ids=["all_rows", "lazy"])
def test_tf1_rules_indexed_slices_equal_the_summed_dense_gradient(rule, nslots, hp, lazy):
    """TF1's rules on IndexedSlices (duplicate rows): lazy, the touched rows as the dense step on
    the duplicates' sum (TF1's base optimizer sums them before the sparse kernel), the others
    untouched; not lazy, every row as the dense step, a zero gradient still shrinking a proximal
    rule's weights (SGD's untouched rows stay put either way)."""
    from tfclip import _core

    rng = np.random.default_rng(12)
    rows, width = 6, 3
    idx = np.array([4, 1, 4, 4], np.int64)
    vals = rng.normal(size=(len(idx), width))
    dense = np.zeros((rows, width))
    np.add.at(dense, idx, vals)
    init = rng.normal(size=(rows, width))
    slots0 = [np.abs(rng.normal(size=(rows, width))) + 0.1 for _ in range(nslots)]
    a, sa = init.copy(), [s.copy() for s in slots0]
    b, sb = init.copy(), [s.copy() for s in slots0]
    _core.clip_apply(rule, [a], [vals], [[s] for s in sa], hp, indices=[idx], lazy=lazy)
    _core.clip_apply(rule, [b], [dense], [[s] for s in sb], hp)
    touched = [1, 4]
    keep = [r for r in range(rows) if r not in touched]
    if rule == "sgd":  # a scatter: each duplicate in turn, not their sum (an ulp apart)
        np.testing.assert_allclose(a[touched], b[touched], rtol=1e-14)
    else:
        np.testing.assert_array_equal(a[touched], b[touched])
    for x, y in zip(sa, sb):
        np.testing.assert_array_equal(x[touched], y[touched])
    if lazy or rule == "sgd":
        np.testing.assert_array_equal(a[keep], init[keep])
    else:
        np.testing.assert_array_equal(a[keep], b[keep])
        assert rule == "adagrad_da" or np.all(np.abs(a[keep]) < np.abs(init[keep]))  # shrunk


# tfclip.rules for TF1's proximal rules against the stock tf.compat.v1.train classes, eagerly
# and in a tf.function, step for step: dense, and IndexedSlices with duplicate rows (the stock
# sparse kernels update only the touched rows: lazy_sparse=True), with a global norm clip (the
# stock side: tf.clip_by_global_norm before apply_gradients) and without. The stock classes are
# given the hyper-parameters as tensors of the variable's dtype (their ops take Python numbers
# as float32); AdagradDA a global step that starts at 0 and advances once per step.
TF1_RULES = {
    "proximal_gradient_descent": (
        lambda: tfclip.rules.ProximalGradientDescent(0.1, l1_regularization_strength=0.02,
                                                     l2_regularization_strength=0.3),
        lambda c, gs: tf.compat.v1.train.ProximalGradientDescentOptimizer(
            c(0.1), l1_regularization_strength=c(0.02), l2_regularization_strength=c(0.3))),
    "proximal_adagrad": (
        lambda: tfclip.rules.ProximalAdagrad(0.2, initial_accumulator_value=0.3, l1_regularization_strength=0.02,
                                             l2_regularization_strength=0.1),
        lambda c, gs: tf.compat.v1.train.ProximalAdagradOptimizer(
            c(0.2), initial_accumulator_value=0.3, l1_regularization_strength=c(0.02),
            l2_regularization_strength=c(0.1))),
    "adagrad_da": (
        lambda: tfclip.rules.AdagradDA(0.2, initial_gradient_squared_accumulator_value=0.3,
                                       l1_regularization_strength=0.05, l2_regularization_strength=0.1),
        lambda c, gs: tf.compat.v1.train.AdagradDAOptimizer(
            c(0.2), gs, initial_gradient_squared_accumulator_value=0.3, l1_regularization_strength=c(0.05),
            l2_regularization_strength=c(0.1))),
}
TF1_SLOTS = {"proximal_gradient_descent": (), "proximal_adagrad": ("accumulator",),
             "adagrad_da": ("gradient_accumulator", "gradient_squared_accumulator")}


def _tf1_steps(dtype, sparse, steps=6):
    rng = np.random.default_rng(17)
    out = []
    for k in range(steps):
        if sparse:
            idx = [[1, 4, 1], [6], [0, 4, 4, 4], [2, 1], [5, 5], [3]][k % 6]
            out.append((rng.normal(size=(len(idx), 3)).astype(dtype), np.array(idx, np.int64)))
        else:
            out.append((rng.normal(size=(7, 3)).astype(dtype), None))
    return out


def _tf1_grad(vals, rows):
    if rows is None:
        return tf.constant(vals)
    return tf.IndexedSlices(tf.constant(vals), tf.constant(rows), tf.constant([7, 3], tf.int64))


@pytest.mark.parametrize("case", list(TF1_RULES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
@pytest.mark.parametrize("clip", [None, 0.8], ids=["noclip", "global_clipnorm"])
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_tf1_rules_match_the_stock_tf1_classes_step_for_step(case, dtype, sparse, clip, mode):
    make_rule, make_stock = TF1_RULES[case]
    init = np.random.default_rng(3).normal(size=(7, 3)).astype(dtype)
    ours, theirs = tf.Variable(init), tf.Variable(init)
    gs = tf.Variable(0, dtype=tf.int64)
    rule, stock = make_rule(), make_stock(lambda x: tf.constant(x, dtype), gs)

    def fused(g):
        return tfclip.fused_clip_apply([(g, ours)], rule, lazy_sparse=sparse,
                                       **({"global_clipnorm": clip} if clip else {}))

    def reference(g):
        if clip:
            (g,), _ = tf.clip_by_global_norm([g], clip)
        stock.apply_gradients([(g, theirs)], global_step=gs)

    if mode == "tf_function":
        fused, reference = tf.function(fused), tf.function(reference)
    tol = dict(rtol=2e-6, atol=1e-7) if dtype == "float32" else dict(rtol=1e-13, atol=1e-15)
    for k, (vals, rows) in enumerate(_tf1_steps(dtype, sparse)):
        assert bool(fused(_tf1_grad(vals, rows)).applied)
        reference(_tf1_grad(vals, rows))
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), err_msg=f"step {k + 1}", **tol)
        assert int(rule.iterations) == int(gs.numpy()) == k + 1
        if sparse and k < 5:  # row 3, first touched at step 6, is left alone until then (lazy)
            np.testing.assert_array_equal(ours.numpy()[3], init[3])
    assert tuple(rule.slots(ours)) == TF1_SLOTS[case]
    for n in TF1_SLOTS[case]:
        np.testing.assert_allclose(rule.slots(ours)[n].numpy(), stock.get_slot(theirs, n).numpy(), **tol)


@pytest.mark.parametrize("case", list(TF1_RULES))
def test_tf1_rules_densify_indexed_slices_unless_lazy(case):
    """Without lazy_sparse the IndexedSlices step is the dense gradient's (every row shrunk). (No
    norm clip: the slices' norm, as TF's, counts each duplicate, the dense gradient's their sum.)"""
    make_rule, _ = TF1_RULES[case]
    init = np.random.default_rng(4).normal(size=(7, 3)).astype(np.float32)
    a, b = tf.Variable(init), tf.Variable(init)
    ra, rb = make_rule(), make_rule()
    for vals, rows in _tf1_steps("float32", True, 4):
        tfclip.fused_clip_apply([(_tf1_grad(vals, rows), a)], ra)
        tfclip.fused_clip_apply([(tf.convert_to_tensor(_tf1_grad(vals, rows)), b)], rb)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_adagrad_da_rule_counts_only_applied_steps():
    """A skipped step (non-finite norm) writes nothing and does not advance the count, so the
    next step is given the same global step as if the skipped one never came."""
    make_rule, make_stock = TF1_RULES["adagrad_da"]
    init = np.random.default_rng(5).normal(size=(7, 3)).astype(np.float64)
    ours, theirs = tf.Variable(init), tf.Variable(init)
    gs = tf.Variable(0, dtype=tf.int64)
    rule, stock = make_rule(), make_stock(lambda x: tf.constant(x, tf.float64), gs)
    steps = _tf1_steps("float64", False, 4)
    for k, (vals, _) in enumerate(steps):
        if k == 2:
            before = ours.numpy().copy()
            bad = vals.copy()
            bad[0, 0] = np.nan
            assert not bool(tfclip.fused_clip_apply([(tf.constant(bad), ours)], rule, global_clipnorm=1.0).applied)
            np.testing.assert_array_equal(ours.numpy(), before)
            assert int(rule.iterations) == 2
        tfclip.fused_clip_apply([(tf.constant(vals), ours)], rule, global_clipnorm=1.0)
        (g,), _ = tf.clip_by_global_norm([tf.constant(vals)], 1.0)
        stock.apply_gradients([(g, theirs)], global_step=gs)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-13, atol=1e-15)
    assert int(rule.iterations) == int(gs.numpy()) == 4


@pytest.mark.parametrize("make,match", [
    (lambda: tfclip.rules.ProximalAdagrad(0.1, initial_accumulator_value=0.0), "initial_accumulator_value"),
    (lambda: tfclip.rules.ProximalAdagrad(0.0), "learning_rate must be > 0"),
    (lambda: tfclip.rules.ProximalAdagrad(0.1, l1_regularization_strength=-0.1), "l1_regularization_strength"),
    (lambda: tfclip.rules.ProximalGradientDescent(0.1, l2_regularization_strength=-1.0),
     "l2_regularization_strength"),
    (lambda: tfclip.rules.AdagradDA(0.1, initial_gradient_squared_accumulator_value=-1.0),
     "initial_gradient_squared_accumulator_value"),
    (lambda: tfclip.rules.AdagradDA(float("nan")), "learning_rate"),
])
def test_tf1_rules_refuse_bad_arguments_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_proximal_adagrad_rule_refuses_a_nonpositive_tensor_learning_rate_writing_nothing():
    lr = tf.Variable(0.1)
    rule = tfclip.rules.ProximalAdagrad(lr)
    var = tf.Variable(np.ones((3,), np.float32))
    tfclip.fused_clip_apply([(tf.ones(3), var)], rule)
    before, acc = var.numpy().copy(), rule.slots(var)["accumulator"].numpy().copy()
    lr.assign(-0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be > 0"):
        tfclip.fused_clip_apply([(tf.ones(3), var)], rule)
    np.testing.assert_array_equal(var.numpy(), before)
    np.testing.assert_array_equal(rule.slots(var)["accumulator"].numpy(), acc)
    assert int(rule.iterations) == 1
