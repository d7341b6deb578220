"""Low-precision optimizer state, bfloat16 (issue 47): a float32 variable's slots stored as bfloat16.

The definition the core follows (csrc/core/tensors.h, SlotStorage): each slot is loaded to float32
(exact), the rule's update runs in float32 exactly as with float32 slots, and each slot is rounded
to the nearest bfloat16 (ties to even) when stored. So the reference is independent of the bf16
code path: the float32-state step (itself checked against the stock optimizers elsewhere) started
from the same bf16-representable slots, its new slots then rounded by ml_dtypes (round to nearest
even). Variables and slots must match it bit for bit, step after step. Lamb, whose update reads the
slots back as stored, is checked against NumPy's float64 Lamb on the stored slots."""
import ml_dtypes
import numpy as np
import pytest

from tfclip import _core

BF16 = ml_dtypes.bfloat16
SHAPES = [(3000,), (7, 5), (1,), (33, 64)]

# rule -> (hyper-parameters and flags, slot count)
RULES = {
    "momentum": ({"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, 1),
    "keras_momentum": ({"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, 1),
    "adam": ({"lr": 0.01, "step": 3.0}, 2),
    "adam_amsgrad": ({"lr": 0.01, "step": 3.0, "amsgrad": True, "weight_decay": 0.01}, 3),
    "adagrad": ({"lr": 0.1}, 1),
    "rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True, "has_momentum": True}, 3),
    "adadelta": ({"lr": 1.0}, 2),
    "adamax": ({"lr": 0.01, "step": 2.0}, 2),
    "lion": ({"lr": 0.01, "weight_decay": 0.1}, 1),
    "nadam": ({"lr": 0.01, "step": 2.0, "u_product": 0.9}, 2),
    "tf_rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True}, 3),
}
MODES = [("global_norm", 0.5), ("norm", 0.3), ("value", 0.01), ("agc", 0.05), ("none", 0.0)]


def _rule_name(rule):
    return "adam" if rule == "adam_amsgrad" else rule


def _problem(rng, nslots, grad_dtype):
    vars_ = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [rng.normal(size=s).astype(grad_dtype) for s in SHAPES]
    # Positive (second moments) and bf16-representable: both paths start from the same values.
    slots = [[(np.abs(rng.normal(size=s)) * 0.1 + 0.01).astype(BF16) for s in SHAPES] for _ in range(nslots)]
    return vars_, grads, slots


def _step(rule, vars_, grads, slots, mode, clip, **kw):
    hp, _ = RULES[rule]
    return _core.clip_apply(_rule_name(rule), vars_, grads, slots, hp, clip_mode=mode, clip=clip, **kw)


def _reference_steps(rule, vars_, grads, slots, mode, clip, steps, **kw):
    """The float32-state step from the bf16 slots, its slots rounded to bf16 after each step."""
    rv = [v.copy() for v in vars_]
    rs = [[s.copy() for s in lst] for lst in slots]
    for _ in range(steps):
        fs = [[s.astype(np.float32) for s in lst] for lst in rs]
        _step(rule, rv, grads, fs, mode, clip, **kw)
        rs = [[s.astype(BF16) for s in lst] for lst in fs]
    return rv, rs


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mode,clip", MODES)
@pytest.mark.parametrize("grad_dtype", [np.float32, BF16, np.float16])
def test_bf16_state_is_the_float32_step_rounded(rng, rule, mode, clip, grad_dtype):
    _, nslots = RULES[rule]
    vars_, grads, slots = _problem(rng, nslots, grad_dtype)
    rv, rs = _reference_steps(rule, vars_, grads, slots, mode, clip, steps=3)
    for _ in range(3):
        _, applied = _step(rule, vars_, grads, slots, mode, clip)
        assert applied
    for a, b in zip(vars_, rv):
        _same_bits(a, b)
    for la, lb in zip(slots, rs):
        for a, b in zip(la, lb):
            _same_bits(a, b)


@pytest.mark.parametrize("rule", ["adam", "momentum", "rmsprop", "adagrad"])
@pytest.mark.parametrize("lazy", [False, True])
def test_bf16_state_sparse(rng, rule, lazy):
    """IndexedSlices gradients (duplicates summed; lazy: only touched rows) with bf16 slots."""
    _, nslots = RULES[rule]
    vars_ = [rng.normal(size=(50, 8)).astype(np.float32), rng.normal(size=(40,)).astype(np.float32)]
    idx = np.array([3, 7, 3, 49, 0], np.int64)
    grads = [rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(40,)).astype(np.float32)]
    slots = [[(np.abs(rng.normal(size=v.shape)) * 0.1 + 0.01).astype(BF16) for v in vars_]
             for _ in range(nslots)]
    kw = {"indices": [idx, None], "lazy": lazy}
    rv, rs = _reference_steps(rule, vars_, grads, slots, "global_norm", 0.5, steps=2, **kw)
    for _ in range(2):
        _step(rule, vars_, grads, slots, "global_norm", 0.5, **kw)
    for a, b in zip(vars_, rv):
        _same_bits(a, b)
    for la, lb in zip(slots, rs):
        for a, b in zip(la, lb):
            _same_bits(a, b)


def test_bf16_state_lamb_against_float64(rng):
    """Lamb's update reads its slots back as stored (bf16 here): m and v as the float32 step
    rounded; the variable as NumPy float64's Lamb on those stored slots (Keras's formula), to
    float32 rounding of the trust ratio (its norms are fp64 sums in another order)."""
    lr, b1, b2, eps, step = 0.01, 0.9, 0.999, 1e-7, 1.0
    vars_ = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    grads = [rng.normal(size=v.shape).astype(np.float32) for v in vars_]
    slots = [[np.zeros(v.shape, BF16) for v in vars_] for _ in range(2)]
    w0 = [v.astype(np.float64) for v in vars_]
    _core.clip_apply("lamb", vars_, grads, slots, {"lr": lr, "step": step})
    for i, g in enumerate(grads):
        g = g.astype(np.float32)
        m_want = (np.float32(1 - b1) * g).astype(BF16)
        v_want = (np.float32(1 - b2) * g * g).astype(BF16)
        _same_bits(slots[0][i], m_want)
        _same_bits(slots[1][i], v_want)
        m = slots[0][i].astype(np.float64) / (1 - b1 ** step)
        v = slots[1][i].astype(np.float64) / (1 - b2 ** step)
        u = m / (np.sqrt(v) + eps)
        ratio = np.linalg.norm(w0[i]) / np.linalg.norm(u)
        np.testing.assert_allclose(vars_[i], w0[i] - lr * ratio * u, rtol=2e-6, atol=1e-7)


def test_bf16_state_errors(rng):
    v = [np.ones(4, np.float64)]
    g = [np.ones(4, np.float64)]
    with pytest.raises(ValueError, match="bfloat16 for a float32"):
        _core.clip_apply("momentum", v, g, [[np.zeros(4, BF16)]], {"lr": 0.1, "momentum": 0.9})
    v = [np.ones(4, np.float32)]
    g = [np.ones(4, np.float32)]
    with pytest.raises(ValueError, match="bfloat16 for a float32"):
        _core.clip_apply("momentum", v, g, [[np.zeros(4, np.float16)]], {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="share one dtype"):
        _core.clip_apply("adam", v, g, [[np.zeros(4, BF16)], [np.zeros(4, np.float32)]], {"lr": 0.1, "step": 1.0})
    assert v[0].tolist() == [1.0] * 4  # nothing was written


# ---------------------------------------------------------------- the TF front door
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
from tfclip import _loader  # noqa: E402

TF_RULES = {
    "adam": (lambda sd: tfclip.rules.Adam(0.01, amsgrad=True, state_dtype=sd), "adam",
             {"lr": 0.01, "amsgrad": True}, ["m", "v", "vhat"]),
    "sgd_momentum": (lambda sd: tfclip.rules.SGD(0.1, momentum=0.9, nesterov=True, state_dtype=sd),
                     "keras_momentum", {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, ["momentum"]),
    "rmsprop": (lambda sd: tfclip.rules.RMSprop(0.01, momentum=0.5, centered=True, state_dtype=sd), "rmsprop",
                {"lr": 0.01, "momentum": 0.5, "centered": True, "has_momentum": True},
                ["velocity", "momentum", "average_gradient"]),
    "lion": (lambda sd: tfclip.rules.Lion(0.01, state_dtype=sd), "lion", {"lr": 0.01, "beta_1": 0.9, "beta_2": 0.99},
             ["m"]),
    "lamb": (lambda sd: tfclip.rules.Lamb(0.01, state_dtype=sd), "lamb", {"lr": 0.01}, ["m", "v"]),
}


@pytest.mark.parametrize("name", sorted(TF_RULES))
@pytest.mark.parametrize("how", ["eager", "function", "xla"])
def test_rules_state_dtype_through_the_op(rng, name, how):
    """tfclip.rules.X(state_dtype='bfloat16'): bfloat16 slot variables for float32 variables
    (float64 ones keep theirs), and the op's step is the core's (checked above) bit for bit,
    eagerly, in a tf.function and under XLA."""
    if how == "xla" and not _loader.xla_kernels():
        from tfclip import _build_info

        pytest.skip(f"this build has no XLA kernels: {_build_info.XLA_WHY_NOT}")
    make, core_rule, hp, slot_names = TF_RULES[name]
    rule = make("bfloat16")
    shapes = [(300,), (20, 30), ()]
    var0 = [rng.normal(size=s).astype(np.float32) for s in shapes] + [rng.normal(size=(5,))]
    grads = [rng.normal(size=v.shape).astype(v.dtype) for v in var0]
    tvars = [tf.Variable(v) for v in var0]

    def step():
        return tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, tvars)], rule,
                                       global_clipnorm=1.0)

    run = {"eager": step, "function": tf.function(step), "xla": tf.function(step, jit_compile=True)}[how]
    for _ in range(2):
        run()
    for v in tvars:
        want = tf.bfloat16 if v.dtype == tf.float32 else v.dtype
        assert all(s.dtype == want for s in rule.slots(v).values())
    # The core on NumPy: float32 variables with bf16 slots, the float64 one with float64 slots.
    cvars = [v.copy() for v in var0]
    cslots = [[np.zeros(v.shape, BF16 if v.dtype == np.float32 else v.dtype) for v in var0] for _ in slot_names]
    for k in range(2):
        h = dict(hp, step=float(k + 1)) if core_rule in ("adam", "lamb") else hp
        _core.clip_apply(core_rule, cvars, grads, cslots, h, clip_mode="global_norm", clip=1.0)
    for a, v in zip(cvars, tvars):
        _same_bits(v.numpy(), a)
    for k, s in enumerate(slot_names):
        for a, v in zip(cslots[k], tvars):
            got = rule.slots(v)[s].numpy()
            _same_bits(got, a)


def test_rules_refuse_state_dtype_where_it_does_not_apply():
    # The rules whose state must stay as it is take no state_dtype at all.
    for cls in (tfclip.rules.ScheduleFreeAdamW, tfclip.rules.Ftrl, tfclip.rules.ProximalAdagrad):
        with pytest.raises(TypeError, match="state_dtype"):
            cls(learning_rate=0.1, state_dtype="bfloat16")
    with pytest.raises(ValueError, match="state_dtype must be None"):
        tfclip.rules.Adam(state_dtype="int4")
    assert tfclip.rules.Adam(state_dtype="float32").state_dtype is None
    assert tfclip.rules.Adam(state_dtype=tf.bfloat16).state_dtype == "bfloat16"


def test_op_refuses_mismatched_slots():
    """A slot of another dtype than its variable's (other than bf16 state of a float32 one) is
    an error naming it, and nothing is written."""
    v = tf.Variable(tf.ones([4], tf.float64))
    rule = tfclip.rules.SGD(0.1, momentum=0.9)
    rule._slots[v.ref()] = {"momentum": tf.Variable(tf.zeros([4], tf.bfloat16))}
    with pytest.raises(tf.errors.InvalidArgumentError, match="a slot must match its variable"):
        tfclip.fused_clip_apply([(tf.ones([4], tf.float64), v)], rule)
    assert v.numpy().tolist() == [1.0] * 4


# ---------------------------------------------------------------- the Keras 3 drop-ins
# (Not pytest.importorskip: at module level it would skip this whole file, the core's tests too,
# where Keras 3 is missing: TF 2.15. The Keras 3 tests below each carry `keras3`.)
from conftest import keras, keras3  # noqa: E402

KERAS_OPTS = {
    "SGD": dict(learning_rate=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=0.01, amsgrad=True),
    "AdamW": dict(learning_rate=0.01, weight_decay=0.1),
    "RMSprop": dict(learning_rate=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(learning_rate=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adamax": dict(learning_rate=0.01),
    "Nadam": dict(learning_rate=0.01),
    "Lion": dict(learning_rate=0.01),
    "Lamb": dict(learning_rate=0.01),
}


def _keras_vars(rng):
    return [keras.Variable(rng.normal(size=s).astype(np.float32), name=f"w{i}")
            for i, s in enumerate([(300,), (20, 30), ()])] + [
        keras.Variable(rng.normal(size=(5,)), dtype="float64", name="w64")]


def _slots(opt):
    """The optimizer's slot variables, by path (Keras names a slot `<variable>_<slot>`; the
    variables here are w0, w1, ...)."""
    return {_leaf(v): v for v in opt.variables if _leaf(v).startswith("w")}


def _leaf(v):
    """A variable's path without the optimizer's name (two optimizers of one class differ there)."""
    return v.path.split("/", 1)[-1]


@keras3
@pytest.mark.parametrize("name", sorted(KERAS_OPTS))
def test_keras_state_dtype_is_the_float32_step_rounded(rng, name):
    """tfclip.keras.X(state_dtype='bfloat16') against the same class with float32 state whose
    slots are rounded to bfloat16 after every step (ml_dtypes: to nearest even): the same
    variables and slots, bit for bit (Lamb: its update reads the stored slots, so the float32
    run's variables differ; its slots still match)."""
    cls = getattr(tfclip.keras, name)
    kw = dict(KERAS_OPTS[name], global_clipnorm=1.0)
    a_vars, b_vars = _keras_vars(rng), None
    b_vars = [keras.Variable(v.numpy(), dtype=v.dtype, name=v.name) for v in a_vars]
    a, b = cls(state_dtype="bfloat16", **kw), cls(**kw)
    a.build(a_vars)
    b.build(b_vars)
    sa, sb = _slots(a), _slots(b)
    assert sa.keys() == sb.keys() and sa
    for path, v in sa.items():
        want = "float64" if "w64" in path else "bfloat16"
        assert v.dtype == want, path
    for _ in range(3):
        # The reference: float32 slots rounded to bf16 before each step (Adagrad's start, 0.1,
        # is not a bfloat16 number: both start from its rounding).
        for path, v in sb.items():
            if v.dtype == "float32":
                v.assign(v.numpy().astype(BF16).astype(np.float32))
        grads = [rng.normal(size=v.shape).astype(v.dtype) for v in a_vars]
        a.apply([tf.constant(g) for g in grads], a_vars)
        b.apply([tf.constant(g) for g in grads], b_vars)
    for path in sa:
        got = sa[path].numpy()
        _same_bits(got, sb[path].numpy().astype(got.dtype))
    for va, vb in zip(a_vars, b_vars):
        if name == "Lamb" and va.dtype == "float32":
            # Its trust ratio reads the stored slots: bf16 ones here, float32 ones there (the
            # core's Lamb is checked exactly against float64 above): 3 steps of ~0.01 agree
            # within 5e-4, bf16's relative precision (2^-9) on each.
            np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=0, atol=5e-4)
        else:
            _same_bits(va.numpy(), vb.numpy())


@keras3
def test_keras_state_dtype_config_ema_accumulation_and_checkpoints(rng, tmp_path):
    opt = tfclip.keras.Adam(0.01, state_dtype="bfloat16", use_ema=True, gradient_accumulation_steps=2)
    assert opt.get_config()["state_dtype"] == "bfloat16"
    assert tfclip.keras.Adam.from_config(opt.get_config()).state_dtype == "bfloat16"
    assert "state_dtype" not in tfclip.keras.Adam(0.01).get_config()  # the stock config by default
    vars_ = _keras_vars(rng)[:2]
    opt.build(vars_)
    for v in opt.variables:
        leaf = v.path.split("/")[-1]
        if leaf.endswith("_average") or leaf.endswith("_gradient_accumulator"):
            assert v.dtype == "float32", v.path  # stock code updates these in the variable's dtype
        elif leaf.endswith("_momentum") or leaf.endswith("_velocity"):
            assert v.dtype == "bfloat16", v.path
    # A checkpoint of bf16 state restores into the same layout.
    for _ in range(2):
        opt.apply([tf.ones_like(v) for v in vars_], vars_)
    ckpt = tf.train.Checkpoint(opt=opt)
    path = ckpt.save(str(tmp_path / "c"))
    saved = {_leaf(v): v.numpy() for v in opt.variables}
    opt2 = tfclip.keras.Adam(0.01, state_dtype="bfloat16", use_ema=True, gradient_accumulation_steps=2)
    opt2.build(vars_)
    tf.train.Checkpoint(opt=opt2).restore(path).assert_existing_objects_matched()
    for v in opt2.variables:
        _same_bits(v.numpy(), saved[_leaf(v)])


@keras3
def test_keras_state_dtype_refused_where_the_state_must_stay():
    with pytest.raises(ValueError, match="Ftrl keeps its state"):
        tfclip.keras.Ftrl(state_dtype="bfloat16")
    if hasattr(tfclip.keras, "ScheduleFreeAdamW"):
        with pytest.raises(ValueError, match="ScheduleFreeAdamW keeps its state"):
            tfclip.keras.ScheduleFreeAdamW(state_dtype="bfloat16")


@keras3
@pytest.mark.parametrize("jit", [False, True])
def test_keras_state_dtype_model_fit(rng, jit):
    """model.fit with bf16 state, eagerly compiled and under XLA: it trains, the slots are bf16,
    and the step is tfclip's (under XLA: the compiled module runs tfclip's custom calls)."""
    if jit and not _loader.xla_kernels():
        pytest.skip("this build has no XLA kernels (tests/test_xla.py says why)")
    keras.utils.set_random_seed(3)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = tfclip.keras.Adam(0.01, global_clipnorm=1.0, state_dtype="bfloat16")
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    hist = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert hist.history["loss"][-1] < 0.5 * hist.history["loss"][0]
    slots = [v for v in opt.variables if v.path.endswith(("_momentum", "_velocity"))]
    assert len(slots) == 8 and {v.dtype for v in slots} == {"bfloat16"}
    assert int(opt.iterations.numpy()) == 24


# ---------------------------------------------------------------- tfclip.compat.v1
V1_OPTS = {
    "Momentum": (lambda **kw: tfclip.compat.v1.MomentumOptimizer(0.1, 0.9, use_nesterov=True, **kw), ["momentum"]),
    "Adam": (lambda **kw: tfclip.compat.v1.AdamOptimizer(0.01, **kw), ["m", "v"]),
    "RMSProp": (lambda **kw: tfclip.compat.v1.RMSPropOptimizer(0.01, momentum=0.5, centered=True, **kw),
                ["rms", "mg", "momentum"]),
    "Adagrad": (lambda **kw: tfclip.compat.v1.AdagradOptimizer(0.1, **kw), ["accumulator"]),
    "Adadelta": (lambda **kw: tfclip.compat.v1.AdadeltaOptimizer(1.0, **kw), ["accum", "accum_update"]),
}


@pytest.mark.parametrize("name", sorted(V1_OPTS))
@pytest.mark.parametrize("use_resource", [True, False])
def test_compat_v1_state_dtype(rng, name, use_resource):
    """tfclip.compat.v1 optimizers with state_dtype='bfloat16', in a TF1 graph with a Session, on
    resource and ref variables: bfloat16 slots for float32 variables, and the same variables and
    slots, bit for bit, as the float32-state optimizer whose slots are rounded to bfloat16
    before each step."""
    make, slot_names = V1_OPTS[name]
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    grads = [[rng.normal(size=v.shape).astype(np.float32) for v in init] for _ in range(3)]
    with tf.Graph().as_default():
        va = [tf.compat.v1.Variable(v, use_resource=use_resource) for v in init]
        vb = [tf.compat.v1.Variable(v, use_resource=use_resource) for v in init]
        gph = [tf.compat.v1.placeholder(tf.float32, v.shape) for v in init]
        a, b = make(global_clipnorm=1.0, state_dtype="bfloat16"), make(global_clipnorm=1.0)
        step_a = a.apply_gradients(list(zip(gph, va)))
        step_b = b.apply_gradients(list(zip(gph, vb)))
        slots_a = [a.get_slot(v, s) for v in va for s in slot_names]
        slots_b = [b.get_slot(v, s) for v in vb for s in slot_names]
        assert all(s.dtype.base_dtype == tf.bfloat16 for s in slots_a)
        rounded = [tf.compat.v1.placeholder(tf.float32, s.shape) for s in slots_b]
        round_b = [s.assign(r) for s, r in zip(slots_b, rounded)]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for g in grads:
                sess.run(round_b, {r: v.astype(BF16).astype(np.float32)
                                   for r, v in zip(rounded, sess.run(slots_b))})
                feed = dict(zip(gph, g))
                sess.run(step_a, feed)
                sess.run(step_b, feed)
            got_v, want_v, got_s, want_s = sess.run([va, vb, slots_a, slots_b])
    for x, y in zip(got_v, want_v):
        _same_bits(x, y)
    for x, y in zip(got_s, want_s):
        _same_bits(x, y.astype(BF16))


def test_compat_v1_state_dtype_refused_where_the_state_must_stay():
    with pytest.raises(TypeError, match="state_dtype"):
        tfclip.compat.v1.FtrlOptimizer(0.1, state_dtype="bfloat16")


def test_bf16_slots_round_alike_in_every_cpu_variant():
    """The slot as stored, in each CPU variant this machine runs (csrc/core/cpu/pass_state_tiles.cc:
    AVX-512 16 lanes, AVX2 8, baseline one at a time): TF's Momentum at momentum 0 stores the
    gradient itself (0 * accum + g), so the bf16 slot is the gradient rounded. Random float32 bit
    patterns (subnormals, infs and NaNs with payloads among them) and the rounding ties (low
    halves 0x7fff, 0x8000, 0x8001 under odd and even top halves): finite values as ml_dtypes
    rounds them (to nearest even), a NaN as its top half with the quiet bit set; a length that
    leaves a tail past the last full vector."""
    rng = np.random.default_rng(11)
    u = rng.integers(0, 1 << 32, size=40_000, dtype=np.uint64).astype(np.uint32)
    tops = rng.integers(0, 1 << 16, size=3000, dtype=np.uint64).astype(np.uint32) << 16
    ties = np.concatenate([tops | low for low in (0x7FFF, 0x8000, 0x8001)])
    g = np.concatenate([u, ties, np.float32([0.0, -0.0, 1e-45, -1e-45]).view(np.uint32)]).view(np.float32)
    assert g.size % 16 != 0
    zero = np.float32(0.0) * np.float32(0.0) + g  # the slot's float32 value (-0.0 becomes +0.0)
    bits = zero.view(np.uint32)
    nan = np.isnan(zero)
    want = np.where(nan, (bits >> 16) | 0x40, zero.astype(BF16).view(np.uint16)).astype(np.uint16)
    old = _core.cpu_isa()
    try:
        for isa in _core.cpu_isas():
            _core.set_cpu_isa(isa)
            slot = np.zeros(g.size, BF16)
            v = np.zeros(g.size, np.float32)
            with np.errstate(all="ignore"):
                _core.clip_apply("momentum", [v], [g], [[slot]], {"lr": 1e-30, "momentum": 0.0}, clip_mode="none",
                                 clip=0.0, nonfinite="propagate")
            got = slot.view(np.uint16)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (isa, [(hex(bits[i]), hex(got[i]), hex(want[i])) for i in bad[:5]])
    finally:
        _core.set_cpu_isa(old)
