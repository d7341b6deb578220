"""bfloat16 weights with stochastic rounding (issue 47; csrc/core/rounding.h): the generator
against Random123's known answers, the rounding against a NumPy reference written from the
definitions (tests/reference.py) for every element-wise rule, eagerly, in tf.function and under
XLA, the bias (none: the mean of many rounded updates is the exact one; round to nearest loses
updates below half an ulp), reproducibility (thread count, seed, step, variable), and the errors.
The CUDA kernels draw the same bits: tests/gpu/test_cuda_stochastic_rounding.py."""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import reference
import tfclip
from tfclip import _core, _loader

BF16 = ml_dtypes.bfloat16
SEED = 2024

# Random123's kat_vectors for philox4x32 with 10 rounds: counter, key, the four output words.
PHILOX_KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert _core.philox4x32_10(counter, key) == want
    assert [int(w[0]) for w in reference.philox4x32_10([[c] for c in counter], key)] == want


def _bits(v):
    return np.asarray(v.numpy() if hasattr(v, "numpy") else v).view(np.uint16)


# Every element-wise rule with a bfloat16 variable's own arithmetic (slots start at values
# exact in bfloat16, so a float32 copy of the step computes the same unrounded update).
RULES = {
    "SGD": lambda: tfclip.rules.SGD(0.05),
    "SGD-momentum": lambda: tfclip.rules.SGD(0.05, momentum=0.9, nesterov=True),
    "Momentum": lambda: tfclip.rules.Momentum(0.05, 0.9),
    "Adam": lambda: tfclip.rules.Adam(0.01, amsgrad=True),
    "AdamW": lambda: tfclip.rules.AdamW(0.01, weight_decay=0.1),
    "Adagrad": lambda: tfclip.rules.Adagrad(0.05, initial_accumulator_value=0.5),
    "RMSprop": lambda: tfclip.rules.RMSprop(0.01, momentum=0.5, centered=True),
    "Adadelta": lambda: tfclip.rules.Adadelta(1.0),
    "Adamax": lambda: tfclip.rules.Adamax(0.01),
    "Lion": lambda: tfclip.rules.Lion(0.001, weight_decay=0.5),
    "Ftrl": lambda: tfclip.rules.Ftrl(0.05, initial_accumulator_value=0.5, l1_regularization_strength=0.001),
    "ScheduleFreeAdamW": lambda: tfclip.rules.ScheduleFreeAdamW(0.01),
}
# Rules whose bfloat16 step computes differently from a float32 copy's: Lamb's trust ratio reads
# the slots as stored (bf16), Nadam keeps its momentum-cache product in the variable's dtype.
# Their check: each element is the round-to-nearest step's value or its neighbour.
OTHER_ARITHMETIC = {
    "Lamb": lambda: tfclip.rules.Lamb(0.01, weight_decay=0.01),
    "Nadam": lambda: tfclip.rules.Nadam(0.01),
}
SHAPES = [(3, 5), (70001,), ()]  # (several CPU chunks; a scalar)


def _data(seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    w = [np.asarray(rng.normal(size=s), BF16) for s in shapes]
    # (float32 gradients with bfloat16 values: a bf16 variable's step casts its gradient to
    # bf16, as TF casts it, after the clip; so the float32 copy's step sees the same values)
    g = [np.asarray(np.asarray(rng.normal(size=s) * 0.1, BF16), np.float32) for s in shapes]
    return w, g


def _step(rule, variables, grads, mode="eager", steps=1, **kw):
    def one():
        return tfclip.fused_clip_apply(zip(grads, variables), rule, **kw)

    fn = {"eager": one, "function": tf.function(one), "xla": tf.function(one, jit_compile=True)}[mode]
    for _ in range(steps):
        fn()


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_rounding_against_the_reference(name, mode):
    """The bfloat16 variables hold exactly the reference's stochastic rounding of the update a
    float32 copy of the step computes (the same arithmetic: the core steps a bfloat16 variable in
    float32), element by element, for each variable's position; float32 gradients (any dtype
    pairs with a bf16 variable) clipped by value to a bf16 number (so exact in both steps)."""
    w, g = _data()
    start = 6  # the rule's step is iterations + 1: 7 here
    bf, f32 = RULES[name](), RULES[name]()
    bvars = [tf.Variable(x) for x in w]
    fvars = [tf.Variable(x.astype(np.float32)) for x in w]
    for rule in (bf, f32):
        rule.iterations.assign(start)
    grads = [tf.constant(x) for x in g]
    _step(bf, bvars, grads, mode, clipvalue=0.25, stochastic_rounding=True, rounding_seed=SEED)
    _step(f32, fvars, grads, mode, clipvalue=0.25)
    for k, (b, f) in enumerate(zip(bvars, fvars)):
        want = reference.stochastic_round_bf16(f.numpy(), SEED, start + 1, k)
        np.testing.assert_array_equal(_bits(b).ravel(), want)
    # The slots round to nearest, as always: ml_dtypes' rounding of the float32 copy's.
    for b, f in zip(bvars, fvars):
        for name, slot in bf.slots(b).items():
            np.testing.assert_array_equal(_bits(slot), _bits(f32.slots(f)[name].numpy().astype(BF16)), name)


@pytest.mark.parametrize("name", sorted(RULES))
def test_bf16_variables_round_to_nearest_as_the_float32_step(name):
    """Without stochastic rounding a bfloat16 variable and its slots hold ml_dtypes' round to
    nearest of the float32 copy's step (the CPU steps a bf16 tile widened to float32 and narrows
    it back), for bf16 and float32 gradients."""
    w, g = _data(2)
    for gdt in (BF16, np.float32):
        bf, f32 = RULES[name](), RULES[name]()
        bvars = [tf.Variable(x) for x in w]
        fvars = [tf.Variable(x.astype(np.float32)) for x in w]
        _step(bf, bvars, [tf.constant(x.astype(gdt)) for x in g], clipvalue=0.25)
        _step(f32, fvars, [tf.constant(x) for x in g], clipvalue=0.25)
        for b, f in zip(bvars, fvars):
            np.testing.assert_array_equal(_bits(b), _bits(f.numpy().astype(BF16)))
            for slot, fslot in zip(bf.slots(b).values(), f32.slots(f).values()):
                np.testing.assert_array_equal(_bits(slot), _bits(fslot.numpy().astype(BF16)))


def test_xla_group_calls_draw_the_op_positions():
    """Under XLA an op of more than 64 variables is several custom calls (csrc/xla/ffi/custom_calls.h,
    kGroupVars); each call's variables still draw by their position in the op: the bits of the
    eager op, which is one call."""
    w, g = _data(4, [(33,)] * 150)
    out = []
    for mode in ("eager", "xla"):
        rule = tfclip.rules.Adam(0.01)
        vs = [tf.Variable(x) for x in w]
        _step(rule, vs, [tf.constant(x) for x in g], mode, steps=2, stochastic_rounding=True, rounding_seed=SEED)
        out.append(np.stack([_bits(v) for v in vs]))
    np.testing.assert_array_equal(out[0], out[1])
    assert len({a.tobytes() for a in out[0]}) == 150  # (and no two variables alike)


@pytest.mark.parametrize("name", sorted(OTHER_ARITHMETIC))
def test_rounding_next_to_nearest(name):
    w, g = _data()
    runs = []
    for sr in (True, False):
        rule = OTHER_ARITHMETIC[name]()
        vs = [tf.Variable(x) for x in w]
        _step(rule, vs, [tf.constant(x) for x in g], stochastic_rounding=sr, rounding_seed=SEED)
        runs.append([_bits(v).astype(np.int64) for v in vs])
    for a, b in zip(*runs):
        assert np.isin(a - b, (-1, 0, 1)).all()
    assert any((a != b).any() for a, b in zip(*runs))


def test_reproducible_and_drawn_per_step_variable_and_seed():
    """The same (seed, step, variable, element) gives the same bits whatever the thread count;
    another seed, step or variable position draws other bits."""
    w, g = _data(1, [(50000,), (50000,)])
    g = [g[0], g[0]]
    w = [w[0], w[0]]  # the same values and gradient in both variables: only the position differs

    def run(seed=SEED, start=0):
        rule = tfclip.rules.SGD(0.01)
        rule.iterations.assign(start)
        vs = [tf.Variable(x) for x in w]
        _step(rule, vs, [tf.constant(x) for x in g], stochastic_rounding=True, rounding_seed=seed)
        return [_bits(v) for v in vs]

    base = run()
    assert (base[0] != base[1]).any(), "two variables drew the same bits"
    for other in (run(seed=SEED + 1), run(start=1)):
        assert (other[0] != base[0]).any()
    # The core's own thread counts.
    counts = []
    for threads in (1, 2, 0):
        _core.set_num_threads(threads)
        v = [w[0].copy()]
        _core.clip_apply("sgd", v, [g[0]], [], {"lr": 0.01}, rounding=(SEED, 1))
        counts.append(v[0].view(np.uint16))
    _core.set_num_threads(0)
    assert all((c == counts[0]).all() for c in counts)
    np.testing.assert_array_equal(counts[0], base[0])  # _core and the TF op: the same bits


def test_every_cpu_variant_draws_the_reference_bits():
    """The CPU variants draw a tile's bits ahead (AVX2: 8 Philox draws at a time, baseline: one):
    SGD on bf16 variables whose update is exact in float32 (lr 1/2, gradients with few bits), so
    the stored bits are the reference's rounding of a known value, for sizes and chunk bounds
    that split draws (a tile, a chunk, a tensor ending mid-draw)."""
    rng = np.random.default_rng(8)
    sizes = [5, 8, 1030, _core.chunk_elems + 13]
    w = [np.asarray(rng.normal(size=n), BF16) for n in sizes]
    g = [np.asarray(rng.integers(-64, 64, size=n) / 64.0, np.float32) for n in sizes]
    isas = _core.cpu_isas()
    try:
        for isa in isas:
            _core.set_cpu_isa(isa)
            v = [x.copy() for x in w]
            _core.clip_apply("sgd", v, g, [], {"lr": 0.5}, rounding=(SEED, 9))
            for k, (got, x, gr) in enumerate(zip(v, w, g)):
                exact = x.astype(np.float32) - np.float32(0.5) * gr
                np.testing.assert_array_equal(got.view(np.uint16), reference.stochastic_round_bf16(exact, SEED, 9, k),
                                              err_msg=f"{isa}, tensor {k}")
    finally:
        _core.set_cpu_isa(isas[0])


def test_unbiased_over_elements_and_steps():
    """The mean of the rounded values is the exact value: over 2^20 elements of one value (the
    fraction rounded down is the distance's share of the gap, within 5 sigma), and for each
    element over 400 steps (the steps draw independent bits)."""
    x = np.float32(1.0) - np.float32(1e-3)  # between bf16 0.99609375 and 1.0
    lo, hi = 0.99609375, 1.0
    p_up = (float(x) - lo) / (hi - lo)
    n = 1 << 20
    v = [np.ones(n, BF16)]
    _core.clip_apply("sgd", v, [np.ones(n, np.float32)], [], {"lr": 1e-3}, rounding=(SEED, 3))
    got = v[0].astype(np.float64)
    assert set(np.unique(got)) == {lo, hi}
    up = (got == hi).mean()
    assert abs(up - p_up) < 5 * np.sqrt(p_up * (1 - p_up) / n)
    assert abs(got.mean() - float(x)) < 5 * (hi - lo) * np.sqrt(p_up * (1 - p_up) / n)
    # Per element across steps.
    m, steps = 1000, 400
    ups = np.zeros(m)
    for s in range(1, steps + 1):
        v = [np.ones(m, BF16)]
        _core.clip_apply("sgd", v, [np.ones(m, np.float32)], [], {"lr": 1e-3}, rounding=(SEED, s))
        ups += v[0].astype(np.float64) == hi
    freq = ups / steps
    sigma = np.sqrt(p_up * (1 - p_up) / steps)
    assert np.abs(freq - p_up).max() < 5.5 * sigma  # every element unbiased across steps
    assert abs(freq.mean() - p_up) < 5 * sigma / np.sqrt(m)


def test_small_updates_survive_where_nearest_loses_them():
    """SGD with updates of a quarter ulp: round to nearest never moves the weights; stochastic
    rounding moves them by the exact total on average (a bf16 training run's failure mode)."""
    n, steps, lr = 4096, 300, 2.0 ** -12  # ulp of bf16 in [1, 2): 2^-7; the update 2^-12 * 0.5
    w0 = np.full(n, 1.5, BF16)
    g = tf.constant(np.full(n, 0.5, BF16))
    out = {}
    for sr in (False, True):
        v = tf.Variable(w0)
        rule = tfclip.rules.SGD(lr)
        f = tf.function(lambda: tfclip.fused_clip_apply([(g, v)], rule, stochastic_rounding=sr, rounding_seed=SEED))
        for _ in range(steps):
            f()
        out[sr] = v.numpy().astype(np.float64)
    exact = 1.5 - steps * lr * 0.5
    assert (out[False] == 1.5).all()
    assert abs(out[True].mean() - exact) < 0.02 * (1.5 - exact)


def test_specials_and_other_dtypes():
    """NaN stays NaN and inf stays inf; float32, float16 and float64 variables are stored as
    always (stochastic rounding is a bfloat16 variable's)."""
    v = [np.array([np.inf, -np.inf, 1.0, -1.0], BF16)]
    _core.clip_apply("sgd", v, [np.array([0, 0, np.nan, 1e-3], np.float32)], [], {"lr": 1.0},
                     nonfinite="propagate", rounding=(SEED, 1))
    out = v[0].astype(np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] in (-1.0, np.float32(BF16(-1.0078125)))
    for dt in (np.float16, np.float32, np.float64):
        rng = np.random.default_rng(3)
        w0, g0 = rng.normal(size=1000).astype(dt), rng.normal(size=1000).astype(dt)
        a, b = [w0.copy()], [w0.copy()]
        _core.clip_apply("sgd", a, [g0], [], {"lr": 0.01}, rounding=(SEED, 1))
        _core.clip_apply("sgd", b, [g0], [], {"lr": 0.01})
        np.testing.assert_array_equal(a[0], b[0])


def test_errors():
    v = tf.Variable(np.ones(4, BF16))
    g = tf.constant(np.ones(4, BF16))
    rule = tfclip.rules.SGD(0.1)
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        tfclip.fused_clip_apply([(g, v)], rule, stochastic_rounding=1)
    with pytest.raises(TypeError, match="rounding_seed must be an int"):
        tfclip.fused_clip_apply([(g, v)], rule, stochastic_rounding=True, rounding_seed=1.5)
    with pytest.raises(ValueError, match=r"rounding_seed must be in \[0, 2\*\*32\)"):
        tfclip.fused_clip_apply([(g, v)], rule, stochastic_rounding=True, rounding_seed=-1)
    # The raw op: a count other than 0 or 2, and values that are not integers in [0, 2^53]
    # (an apply that fails writes nothing).
    ops = _loader.ops()
    kw = dict(var=[v.handle], grad=[g], lr=0.1, weight_decay=0.0, indices=[], clip=0.0, use_norm=0.0,
              iterations=[], absmax=[], grad_scale=[])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rounding takes none or two scalars"):
        ops.tfclip_clip_apply_sgd(rounding=[tf.constant(1.0, tf.float64)], **kw)
    for seed, step, what in ((1.5, 1.0, "seed"), (-1.0, 1.0, "seed"), (np.nan, 1.0, "seed"), (1.0, np.nan, "step"),
                             (1.0, 2.0 ** 54, "step")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"stochastic rounding's {what} must be an integer"):
            ops.tfclip_clip_apply_sgd(rounding=[tf.constant(seed, tf.float64), tf.constant(step, tf.float64)], **kw)
    np.testing.assert_array_equal(v.numpy(), np.ones(4, BF16))
    with pytest.raises(ValueError, match=r"rounding must be None or a \(seed, step\) pair"):
        _core.clip_apply("sgd", [np.ones(4, BF16)], [np.ones(4, np.float32)], [], {"lr": 0.1}, rounding=(1,))
    with pytest.raises(ValueError, match=r"stochastic rounding's seed must be an integer in \[0, 2\^53\], got nan$"):
        _core.clip_apply("sgd", [np.ones(4, BF16)], [np.ones(4, np.float32)], [], {"lr": 0.1},
                         rounding=(np.nan, 1.0), iterations=np.zeros(1, np.int64))


# ---------------------------------------------------------------- the optimizers
def _keras_run(make, w, g, mode="eager", steps=3, variable=tf.Variable):
    opt = make()
    vs = [variable(x) for x in w]

    def one():
        opt.apply_gradients(zip(g, vs))

    fn = {"eager": one, "function": tf.function(one), "xla": tf.function(one, jit_compile=True)}[mode]
    for _ in range(steps):
        fn()
    return opt, [_bits(v) for v in vs]


def _rule_run(w, g, steps=3, **kw):
    rule = tfclip.rules.Adam(0.01)
    vs = [tf.Variable(x) for x in w]
    for _ in range(steps):
        tfclip.fused_clip_apply(zip(g, vs), rule, global_clipnorm=1.0, **kw)
    return [_bits(v) for v in vs]


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_keras_optimizers_draw_the_rule_bits(mode):
    """tfclip.keras.Adam and tfclip.tf_keras.Adam with stochastic_rounding=True: the bits of
    fused_clip_apply with tfclip.rules.Adam (the same seed, step iterations + 1, positions), in
    get_config only when on, so a default config stays the stock class's."""
    import keras
    import tfclip.keras
    import tfclip.tf_keras
    w, g = _data(5, [(300,), (7, 3)])
    g = [tf.constant(x) for x in g]
    want = _rule_run(w, g, stochastic_rounding=True, rounding_seed=SEED)
    nearest = _rule_run(w, g)
    assert any((a != b).any() for a, b in zip(want, nearest))
    k3, got = _keras_run(lambda: tfclip.keras.Adam(0.01, global_clipnorm=1.0, stochastic_rounding=True,
                                                   rounding_seed=SEED), w, g, mode,
                         variable=lambda x: keras.Variable(x, dtype="bfloat16"))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert k3.get_config()["stochastic_rounding"] is True and k3.get_config()["rounding_seed"] == SEED
    again = tfclip.keras.Adam.from_config(k3.get_config())
    assert again.stochastic_rounding and again.rounding_seed == SEED
    assert "stochastic_rounding" not in tfclip.keras.Adam().get_config()
    if mode != "xla":  # (tf_keras's own jit_compile path: tests/test_dropin_tf_keras.py)
        tk, got = _keras_run(lambda: tfclip.tf_keras.Adam(0.01, global_clipnorm=1.0, stochastic_rounding=True,
                                                          rounding_seed=SEED), w, g, mode)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert tfclip.tf_keras.Adam.from_config(tk.get_config()).rounding_seed == SEED


def test_keras_weight_decay_groups_draw_their_own_seeds():
    """Keras applies weight decay per variable (exclude_from_weight_decay): one op per group, group
    k drawing with seed + k * 2^32 and its variables' positions in the group's op, so no two
    variables of a step share bits. Against the reference, from a float32 copy's step."""
    import keras
    import tfclip.keras
    w, g = _data(9, [(50,), (6, 7), (40,)])
    grads = [tf.constant(x) for x in g]

    def run(dtype, **kw):
        opt = tfclip.keras.SGD(0.05, weight_decay=0.1, **kw)
        vs = [keras.Variable(x.astype(dtype), name=f"v{k}") for k, x in enumerate(w)]
        opt.exclude_from_weight_decay(var_names=["v1"])
        opt.apply(grads, vs)
        return [v.numpy() for v in vs]

    got = run(BF16, stochastic_rounding=True, rounding_seed=SEED)
    exact = run(np.float32)
    # partition([decay of v0, v1, v2]) = [(False, [1]), (True, [0, 2])]: v1 is group 0's first, v0
    # and v2 group 1's first and second.
    for k, (group, pos) in enumerate([(1, 0), (0, 0), (1, 1)]):
        want = reference.stochastic_round_bf16(exact[k], SEED + group * 2 ** 32, 1, pos)
        np.testing.assert_array_equal(_bits(got[k]).ravel(), want, err_msg=f"v{k}")


def test_tf_keras_legacy_rounds_stochastically():
    """tf_keras's legacy (OptimizerV2) classes read their hyper-parameters in the variable's
    dtype, as stock does (a bf16 Adam's beta_2 0.999 is 1.0 there, and the stock step does not
    move the weights): SGD, with stochastic rounding, gives each element its round-to-nearest
    step's value or the neighbour."""
    import tfclip.tf_keras
    w, g = _data(6, [(300,), (7, 3)])
    g = [tf.constant(x) for x in g]
    runs = [_keras_run(lambda: tfclip.tf_keras.legacy.SGD(0.01, momentum=0.9, stochastic_rounding=sr,
                                                          rounding_seed=SEED),
                       w, g, "function", steps=1)[1] for sr in (True, False)]
    for a, b in zip(*runs):
        assert np.isin(a.astype(np.int64) - b.astype(np.int64), (-1, 0, 1)).all()
    assert any((a != b).any() for a, b in zip(*runs))


def test_keras_model_fit_pure_bfloat16():
    """model.fit on a pure-bfloat16 layer (dtype "bfloat16": bf16 weights), with and without
    jit_compile, at a learning rate whose updates are mostly below half a bf16 ulp: projected on
    the same layer's float32 run, stochastic rounding moves the weights about as far (its
    gradients are the bf16 forward pass's, so not the same amount: the bias is
    test_unbiased_over_elements_and_steps's), round to nearest by a small part of it."""
    import keras
    import tfclip.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 512))).astype(np.float32)
    w0 = np.asarray(rng.normal(size=(8, 512)) * 0.5, BF16).astype(np.float32)

    def fit(dtype, sr, jit):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(512, use_bias=False, dtype=dtype)])
        model.layers[0].kernel.assign(w0)
        model.compile(tfclip.keras.SGD(3e-5, stochastic_rounding=sr, rounding_seed=SEED), "mse", jit_compile=jit)
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
        assert model.layers[0].kernel.dtype == dtype
        return model.layers[0].kernel.numpy().astype(np.float64) - w0

    exact = fit("float32", False, False)
    direction = np.sign(exact)
    for jit in (False, True):
        share = {sr: (fit("bfloat16", sr, jit) * direction).sum() / np.abs(exact).sum() for sr in (False, True)}
        assert 0.5 < share[True] < 2.0, share
        assert share[False] < 0.3, share


def test_keras_errors():
    import tfclip.keras
    import tfclip.tf_keras
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        tfclip.keras.Adam(stochastic_rounding="yes")
    with pytest.raises(ValueError, match=r"rounding_seed must be in \[0, 2\*\*32\)"):
        tfclip.tf_keras.Adam(stochastic_rounding=True, rounding_seed=2 ** 32)


@pytest.mark.parametrize("given_step", [False, True], ids=["own_count", "global_step"])
def test_compat_v1_in_a_session_and_eagerly(given_step):
    """tfclip.compat.v1's optimizers draw by global_step + 1 where apply_gradients is given one,
    else by their own count of steps in the graph (a local variable, never saved): SGD with
    updates exact in float32, three train-op runs, against the reference step by step."""
    import tfclip.compat.v1 as tc
    rng = np.random.default_rng(12)
    w = [np.asarray(rng.normal(size=s), BF16) for s in [(40,), (3, 7)]]
    g = [np.asarray(rng.integers(-64, 64, size=x.shape) / 64.0, np.float32) for x in w]
    first = 41 if given_step else 1
    want = [x.copy() for x in w]
    for s in range(3):
        for k, x in enumerate(want):
            exact = x.astype(np.float32) - np.float32(0.5) * g[k]
            want[k] = reference.stochastic_round_bf16(exact, SEED, first + s, k).view(BF16).reshape(x.shape)
    with tf.Graph().as_default():
        vars_ = [tf.compat.v1.Variable(x, use_resource=True) for x in w]
        step = tf.compat.v1.Variable(first - 1, dtype=tf.int64) if given_step else None
        opt = tc.GradientDescentOptimizer(0.5, stochastic_rounding=True, rounding_seed=SEED)
        train_op = opt.apply_gradients(zip([tf.constant(x) for x in g], vars_), global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.local_variables_initializer())
            for _ in range(3):
                sess.run(train_op)
            got = sess.run(vars_)
        assert not any("rounding_step" in v.name for v in tf.compat.v1.global_variables())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    vars_ = [tf.Variable(x) for x in w]
    step = tf.Variable(first - 1, dtype=tf.int64) if given_step else None
    opt = tc.GradientDescentOptimizer(0.5, stochastic_rounding=True, rounding_seed=SEED)
    for _ in range(3):
        opt.apply_gradients(zip([tf.constant(x) for x in g], vars_), global_step=step)
    for a, b in zip(vars_, want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        tc.AdamOptimizer(stochastic_rounding="on")
