"""The element-wise rules beyond SGD/Momentum/Adam (issue 21): Adagrad, RMSprop
(momentum, centered), Adadelta, Adamax, Lion, Nadam, Ftrl, Lamb, ScheduleFreeAdamW as tfclip.rules, fused_clip_apply
against stock Keras 3 step by step (dense gradients, each clip mode, weight decay), and the core
against NumPy float64 (TF1's RMSProp kernel order too). The Keras drop-ins: test_keras_more.py."""
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
            # float32 inputs, std::pow is not (tests/test_keras_more.py measures it).
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
    ("rmsprop", 3, {"lr": 0.01, "rho": 0.8, "momentum": 0.5, "epsilon": 1e-6},
     {"centered": True, "has_momentum": True}),
    ("adadelta", 2, {"lr": 1.0, "rho": 0.9, "epsilon": 1e-6}, {}),
    ("adamax", 2, {"lr": 0.02, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6}, {}),
    ("lion", 1, {"lr": 0.003, "beta_1": 0.9, "beta_2": 0.99}, {}),
    ("nadam", 2, {"lr": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6, "u_product": 0.4}, {}),
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
    slots = [[np.abs(rng.normal(size=(9,)))] for _ in row["slots"][:row["min_slots"]]]
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
