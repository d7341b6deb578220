"""int8 optimizer state (issue 47): a float32 variable's slots stored 8-bit blockwise
(csrc/core/tensors.h SlotStorage::kInt8, csrc/core/quant8.h), through tfclip._core.

The definition the passes follow: each block of 256 elements of a slot is dequantized (code[byte]
* absmax, float32), the rule's update runs in float32 exactly as with float32 slots, and the new
slot values are quantized again (the block's absmax, then each element's nearest code; the
unsigned code for a slot the rule keeps >= 0, the signed one for the others). So the reference is
independent of the int8 code path: the float32-state step (checked against the stock optimizers
elsewhere) from the dequantized slots, its new slots quantized by NumPy (tests/reference.py, the
bitsandbytes code written out). Variables, codes and absmax must match it bit for bit, step after
step, for any thread count."""
import numpy as np
import pytest

import reference
from tfclip import _core

# rule -> (hyper-parameters and flags, which slots are >= 0)
RULES = {
    "momentum": ({"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, [False]),
    "keras_momentum": ({"lr": 0.1, "momentum": 0.9}, [False]),
    "adam": ({"lr": 0.01, "step": 3.0, "weight_decay": 0.01}, [False, True]),
    "adam_amsgrad": ({"lr": 0.01, "step": 3.0, "amsgrad": True}, [False, True, True]),
    "adagrad": ({"lr": 0.1}, [True]),
    "rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True, "has_momentum": True}, [True, False, False]),
    "adadelta": ({"lr": 1.0}, [True, True]),
    "adamax": ({"lr": 0.01, "step": 2.0}, [False, True]),
    "lion": ({"lr": 0.01, "weight_decay": 0.1}, [False]),
    "nadam": ({"lr": 0.01, "step": 2.0, "u_product": 0.9}, [False, True]),
    "tf_rmsprop": ({"lr": 0.01, "momentum": 0.9, "centered": True}, [True, False, False]),
    "ftrl": ({"lr": 0.1, "lr_power": -0.5, "l1": 0.001, "l2": 0.001}, [True, False]),
    "adagrad_da": ({"lr": 0.1, "l1": 0.001, "l2": 0.001, "global_step": 3.0}, [False, True]),
    "schedule_free_adamw": ({"lr": 0.01, "step": 3.0}, [False, True]),
}
# Short blocks, one block, a short last block, over one CPU chunk (65,536) with a short tail.
SHAPES = [(1,), (7, 5), (256,), (3, 300), (65536 + 300,)]
MODES = [("none", 0.0), ("global_norm", 0.5), ("value", 0.01), ("norm", 0.3), ("agc", 0.05)]


def _rule(rule):
    return "adam" if rule == "adam_amsgrad" else rule


def _state(rng, unsigned, shapes=SHAPES):
    """Random slots of each sign kind, quantized: (codes, absmax) per slot per variable."""
    out = []
    for u in unsigned:
        codes, absmax = [], []
        for s in shapes:
            x = rng.normal(size=s).astype(np.float32) * np.float32(0.1)
            x = np.abs(x) + np.float32(0.01) if u else x
            q, a = reference.quantize_blockwise(x, not u)
            codes.append(q.reshape(s))
            absmax.append(a)
        out.append((codes, absmax))
    return out


def _dequantized(state, unsigned):
    return [[reference.dequantize_blockwise(q, a, not u).reshape(q.shape) for q, a in zip(*st)]
            for st, u in zip(state, unsigned)]


def _step(rule, vars_, grads, state, mode="none", clip=0.0, **kw):
    hp, _ = RULES[rule]
    return _core.clip_apply(_rule(rule), vars_, grads, [st[0] for st in state], hp, clip_mode=mode, clip=clip,
                            absmax=[st[1] for st in state], **kw)


def _reference_steps(rule, vars_, grads_list, state, mode, clip, **kw):
    """The float32-state step from the dequantized slots, its new slots quantized by NumPy."""
    hp, unsigned = RULES[rule]
    rv = [v.copy() for v in vars_]
    rs = [([q.copy() for q in st[0]], [a.copy() for a in st[1]]) for st in state]
    for grads in grads_list:
        fs = _dequantized(rs, unsigned)
        _core.clip_apply(_rule(rule), rv, grads, fs, hp, clip_mode=mode, clip=clip, **kw)
        rs = []
        for lst, u in zip(fs, unsigned):
            qs = [reference.quantize_blockwise(s, not u) for s in lst]
            rs.append(([q.reshape(s.shape) for (q, _), s in zip(qs, lst)], [a for _, a in qs]))
    return rv, rs


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), np.flatnonzero(a.ravel() != b.ravel())[:10]


def _check(vars_, state, rv, rs):
    for a, b in zip(vars_, rv):
        _same_bits(a, b)
    for (qa, aa), (qb, ab) in zip(state, rs):
        for x, y in zip(qa, qb):
            _same_bits(x, y)
        for x, y in zip(aa, ab):
            _same_bits(x, y)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mode,clip", MODES)
def test_int8_state_is_the_float32_step_quantized(rng, rule, mode, clip):
    _, unsigned = RULES[rule]
    vars_ = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    state = _state(rng, unsigned)
    grads_list = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(2)]
    rv, rs = _reference_steps(rule, vars_, grads_list, state, mode, clip)
    for grads in grads_list:
        _, applied = _step(rule, vars_, grads, state, mode, clip)
        assert applied
    _check(vars_, state, rv, rs)


@pytest.mark.parametrize("grad_dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("mode,clip", [("global_norm", 0.5), ("agc", 0.05)])
def test_int8_state_any_gradient_dtype(rng, grad_dtype, mode, clip):
    import ml_dtypes

    gd = ml_dtypes.bfloat16 if grad_dtype == "bfloat16" else np.dtype(grad_dtype)
    vars_ = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    state = _state(rng, [False, True])
    grads_list = [[rng.normal(size=s).astype(gd) for s in SHAPES]]
    rv, rs = _reference_steps("adam", vars_, grads_list, state, mode, clip)
    _step("adam", vars_, grads_list[0], state, mode, clip)
    _check(vars_, state, rv, rs)


def test_int8_state_from_zero_is_adams_first_step_quantized(rng):
    """From zero state (codes of 0, absmax 0), one Adam step: m = (1 - b1) g and v = (1 - b2) g^2
    in float32, quantized; the variable moves by lr * m_hat / (sqrt(v_hat) + eps) as fp32 Adam's.
    Written out here in NumPy float32, not through the float32-state path."""
    n = 1000
    w0 = rng.normal(size=n).astype(np.float32)
    g = rng.normal(size=n).astype(np.float32)
    nb = (n + 255) // 256
    state = [([np.full(n, 127, np.uint8)], [np.zeros(nb, np.float32)]),
             ([np.zeros(n, np.uint8)], [np.zeros(nb, np.float32)])]
    w = w0.copy()
    _core.clip_apply("adam", [w], [g], [st[0] for st in state], {"lr": 1e-3, "step": 1.0},
                     absmax=[st[1] for st in state])
    m = np.float32(1 - 0.9) * g
    v = np.float32(1 - 0.999) * g * g
    for (q, a), x, signed in [(state[0], m, True), (state[1], v, False)]:
        rq, ra = reference.quantize_blockwise(x, signed)
        _same_bits(q[0], rq)
        _same_bits(a[0], ra)
    # Keras 3 Adam: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); var -= alpha * m / (sqrt(v) + eps).
    alpha = 1e-3 * np.sqrt(1 - 0.999) / (1 - 0.9)
    want = w0.astype(np.float64) - alpha * m / (np.sqrt(v.astype(np.float64)) + 1e-7)
    np.testing.assert_allclose(w, want, rtol=0, atol=2e-7)  # float32 rounding of w (|w| < 4)


def test_int8_state_mixed_with_float32_state(rng):
    """One call, some variables with int8 state (absmax given), others with float32 slots (None
    in absmax): each as it would be alone, under the whole list's norm."""
    vars0 = [rng.normal(size=s).astype(np.float32) for s in [(300,), (40,), (5, 5)]]
    grads = [rng.normal(size=v.shape).astype(np.float32) for v in vars0]
    q8 = _state(rng, [False, True], shapes=[(300,), (5, 5)])
    f32 = [np.abs(rng.normal(size=(40,))).astype(np.float32) * np.float32(0.1) for _ in range(2)]
    vars_ = [v.copy() for v in vars0]
    state = [([q8[k][0][0].copy(), f32[k].copy(), q8[k][0][1].copy()],
              [q8[k][1][0].copy(), None, q8[k][1][1].copy()]) for k in range(2)]
    norm, applied = _step("adam", vars_, grads, state, "global_norm", 0.5)
    assert applied
    rv, rs = _reference_steps("adam", [vars0[0], vars0[2]], [[grads[0], grads[2]]], q8, "global_norm", 0.5,
                              use_norm=norm)
    _check([vars_[0], vars_[2]], [([st[0][0], st[0][2]], [st[1][0], st[1][2]]) for st in state], rv, rs)
    rf = [vars0[1].copy()]
    rslots = [[f.copy()] for f in f32]
    _core.clip_apply("adam", rf, [grads[1]], rslots, RULES["adam"][0], clip_mode="global_norm", clip=0.5,
                     use_norm=norm)
    _same_bits(vars_[1], rf[0])
    for k in range(2):
        _same_bits(state[k][0][1], rslots[k][0])


def test_int8_state_same_bits_for_any_thread_count_and_instruction_set(rng):
    """1, 2 or 4 threads, and each instruction-set variant of the CPU passes this machine runs
    (AVX-512 converts 16 lanes at a time from registers, AVX2 8 with gathers, the baseline element
    by element: csrc/core/cpu/pass_state_tiles.cc): the same bits, and those of the float32 step quantized by NumPy."""
    shapes = [(3 * 65536 + 1000,), (700,)]
    vars0 = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
    state0 = _state(rng, [False, True], shapes)
    rv, rs = _reference_steps("adam", vars0, [grads], state0, "global_norm", 0.5)
    results = []
    old, old_isa = _core.num_threads(), _core.cpu_isa()
    try:
        for isa in _core.cpu_isas():
            _core.set_cpu_isa(isa)
            for threads in (1, 2, 4):
                _core.set_num_threads(threads)
                vars_ = [v.copy() for v in vars0]
                state = [([q.copy() for q in st[0]], [a.copy() for a in st[1]]) for st in state0]
                _step("adam", vars_, grads, state, "global_norm", 0.5)
                results.append((vars_, state))
    finally:
        _core.set_num_threads(old)
        _core.set_cpu_isa(old_isa)
    assert len(results) >= 3
    for vars_, state in results:
        _check(vars_, state, rv, rs)


def test_int8_state_non_finite(rng):
    """nonfinite='skip' writes nothing; 'propagate' applies: a block whose new slot holds inf or
    NaN stores absmax NaN (every element of it dequantizes to NaN), the other blocks are finite."""
    vars0 = [rng.normal(size=(600,)).astype(np.float32)]
    grads = [rng.normal(size=(600,)).astype(np.float32)]
    grads[0][300] = np.inf
    state0 = _state(rng, [False, True], [(600,)])
    vars_ = [v.copy() for v in vars0]
    state = [([q.copy() for q in st[0]], [a.copy() for a in st[1]]) for st in state0]
    _, applied = _step("adam", vars_, grads, state, "global_norm", 0.5, nonfinite="skip")
    assert not applied
    _check(vars_, state, vars0, state0)
    _, applied = _step("adam", vars_, grads, state, "none", 0.0, nonfinite="propagate")
    assert applied
    for q, a in state:
        assert np.isnan(a[0][1]) and np.all(np.isfinite(a[0][[0, 2]]))
    rv, rs = _reference_steps("adam", vars0, [grads], state0, "none", 0.0, nonfinite="propagate")
    _check(vars_, state, rv, rs)


def test_int8_state_errors_write_nothing(rng):
    v = [np.ones(300, np.float32)]
    g = [np.ones(300, np.float32)]
    q = [np.zeros(300, np.uint8)]
    a = [np.zeros(2, np.float32)]
    hp = {"lr": 0.1, "step": 1.0}
    with pytest.raises(ValueError, match=r"int8 optimizer state is not supported for rule 'lamb'"):
        _core.clip_apply("lamb", v, g, [q, [np.zeros(300, np.uint8)]], hp, absmax=[a, [np.zeros(2, np.float32)]])
    with pytest.raises(ValueError, match=r"absmax\[0\]\[0\] must be a float32 array of 2 elements"):
        _core.clip_apply("momentum", v, g, [q], {"lr": 0.1}, absmax=[[np.zeros(3, np.float32)]])
    with pytest.raises(ValueError, match=r"slots\[0\]\[0\] is uint8 \(int8 state's codes\) but absmax\[0\]\[0\] is None"):
        _core.clip_apply("momentum", v, g, [q], {"lr": 0.1}, absmax=[[None]])
    with pytest.raises(ValueError, match=r"slots\[0\]\[0\] is uint8 \(int8 state's codes\) but absmax"):
        _core.clip_apply("momentum", v, g, [q], {"lr": 0.1})  # no absmax at all
    with pytest.raises(ValueError, match=r"vars\[0\]: int8 optimizer state is for float32 variables"):
        _core.clip_apply("momentum", [np.ones(300)], [np.ones(300)], [q], {"lr": 0.1}, absmax=[a])
    with pytest.raises(ValueError, match=r"must be a uint8 array of the shape of vars\[0\]"):
        _core.clip_apply("momentum", v, g, [[np.zeros(300, np.float32)]], {"lr": 0.1}, absmax=[a])
    with pytest.raises(ValueError, match=r"absmax has 1 lists for the 2 slots of rule 'adam'"):
        _core.clip_apply("adam", v, g, [q, [np.zeros(300, np.uint8)]], hp, absmax=[a])
    with pytest.raises(ValueError, match=r"IndexedSlices"):
        _core.clip_apply("momentum", [np.ones((30, 10), np.float32)], [np.ones((2, 10), np.float32)],
                         [[np.zeros((30, 10), np.uint8)]], {"lr": 0.1}, absmax=[[np.zeros(2, np.float32)]],
                         indices=[np.array([1, 2])])
    with pytest.raises(ValueError, match=r"grads\[0\] has dtype uint8"):
        _core.clip_apply("momentum", v, [np.ones(300, np.uint8)], [q], {"lr": 0.1}, absmax=[a])
    assert v[0].tolist() == [1.0] * 300 and not q[0].any() and not a[0].any()  # nothing was written


# ---------------------------------------------------------------- the TF op and tfclip.rules
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
from tfclip import _loader  # noqa: E402

TF_RULES = {
    "adam": (lambda sd: tfclip.rules.Adam(0.01, amsgrad=True, state_dtype=sd), "adam",
             {"lr": 0.01, "amsgrad": True}, ["m", "v", "vhat"], [False, True, True]),
    "sgd_momentum": (lambda sd: tfclip.rules.SGD(0.1, momentum=0.9, nesterov=True, state_dtype=sd),
                     "keras_momentum", {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, ["momentum"], [False]),
    "rmsprop": (lambda sd: tfclip.rules.RMSprop(0.01, momentum=0.5, centered=True, state_dtype=sd), "rmsprop",
                {"lr": 0.01, "momentum": 0.5, "centered": True, "has_momentum": True},
                ["velocity", "momentum", "average_gradient"], [True, False, False]),
    "adagrad": (lambda sd: tfclip.rules.Adagrad(0.1, state_dtype=sd), "adagrad", {"lr": 0.1},
                ["accumulator"], [True]),
    "lion": (lambda sd: tfclip.rules.Lion(0.01, state_dtype=sd), "lion", {"lr": 0.01, "beta_1": 0.9, "beta_2": 0.99},
             ["m"], [False]),
}


@pytest.mark.parametrize("name", sorted(TF_RULES))
@pytest.mark.parametrize("how", ["eager", "function"])
def test_rules_int8_state_through_the_op(rng, name, how):
    """tfclip.rules.X(state_dtype='int8'): uint8 code variables and float32 absmax variables for
    float32 variables (float64 ones keep their float64 slots), and the op's step is the core's
    (checked above) bit for bit, eagerly and in a tf.function, over two steps."""
    make, core_rule, hp, slot_names, unsigned = TF_RULES[name]
    rule = make("int8")
    shapes = [(300,), (20, 30), ()]
    var0 = [rng.normal(size=s).astype(np.float32) for s in shapes] + [rng.normal(size=(5,))]
    grads = [rng.normal(size=v.shape).astype(v.dtype) for v in var0]
    tvars = [tf.Variable(v) for v in var0]

    def step():
        return tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, tvars)], rule,
                                       global_clipnorm=1.0)

    run = {"eager": step, "function": tf.function(step)}[how]
    for _ in range(2):
        run()
    for v in tvars:
        slots, absmax = rule.slots(v), rule.absmax(v)
        if v.dtype == tf.float32:
            assert all(s.dtype == tf.uint8 and s.shape == v.shape for s in slots.values())
            assert sorted(absmax) == sorted(slots)
            assert all(a.dtype == tf.float32 and a.shape == [-(-v.shape.num_elements() // 256)]
                       for a in absmax.values())
        else:
            assert all(s.dtype == v.dtype for s in slots.values()) and absmax == {}
    # The core on NumPy from the same start: int8 state for the float32 variables (Adagrad's
    # accumulator starts at 0.1: absmax 0.1, the code of 1), float64 slots for the other.
    init = 0.1 if name == "adagrad" else 0.0
    cvars = [v.copy() for v in var0]
    cslots, cabsmax = [], []
    for u in unsigned:
        q = [np.full(v.shape, 255 if init else (0 if u else 127), np.uint8) if v.dtype == np.float32
             else np.full(v.shape, init) for v in var0]
        a = [np.full(-(-v.size // 256), init, np.float32) if v.dtype == np.float32 else None for v in var0]
        cslots.append(q)
        cabsmax.append(a)
    for k in range(2):
        h = dict(hp, step=float(k + 1)) if core_rule == "adam" else hp
        _core.clip_apply(core_rule, cvars, grads, cslots, h, clip_mode="global_norm", clip=1.0, absmax=cabsmax)
    for a, v in zip(cvars, tvars):
        _same_bits(v.numpy(), a)
    for k, s in enumerate(slot_names):
        for i, v in enumerate(tvars):
            _same_bits(rule.slots(v)[s].numpy(), cslots[k][i])
            if v.dtype == tf.float32:
                _same_bits(rule.absmax(v)[s].numpy(), cabsmax[k][i])


def test_rules_int8_state_indexed_slices_are_densified(rng):
    """An IndexedSlices gradient (an embedding's) with int8 state: the step of its dense
    conversion (duplicate rows summed), as TF's own conversion gives."""
    e0 = rng.normal(size=(50, 8)).astype(np.float32)
    values = rng.normal(size=(4, 8)).astype(np.float32)
    idx = np.array([3, 7, 3, 49])
    a, b = tf.Variable(e0), tf.Variable(e0)
    ra, rb = tfclip.rules.Adam(0.01, state_dtype="int8"), tfclip.rules.Adam(0.01, state_dtype="int8")
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant(idx), tf.constant([50, 8]))
    for _ in range(2):
        tfclip.fused_clip_apply([(sparse, a)], ra, global_clipnorm=1.0)
        tfclip.fused_clip_apply([(tf.convert_to_tensor(sparse), b)], rb, global_clipnorm=1.0)
    _same_bits(a.numpy(), b.numpy())
    for s in ("m", "v"):
        _same_bits(ra.slots(a)[s].numpy(), rb.slots(b)[s].numpy())
        _same_bits(ra.absmax(a)[s].numpy(), rb.absmax(b)[s].numpy())


def test_int8_state_refused_where_it_does_not_run(rng):
    with pytest.raises(ValueError, match="Lamb does not take state_dtype='int8': its trust ratio"):
        tfclip.rules.Lamb(state_dtype="int8")
    with pytest.raises(ValueError, match="state_dtype must be None"):
        tfclip.rules.Adam(state_dtype="int4")
    assert tfclip.rules.Adam(state_dtype="int8").state_dtype == "int8"


def _need_xla():
    if not _loader.xla_kernels():
        from tfclip import _build_info

        pytest.skip(f"this build has no XLA kernels: {_build_info.XLA_WHY_NOT}")


@pytest.mark.parametrize("name", ["adam", "rmsprop", "adagrad"])
def test_rules_int8_state_under_xla_is_the_ops_step(rng, name):
    """jit_compile=True: the custom calls carry the codes and their absmax (custom_calls.h); the
    step is the eager op's bit for bit, over a list mixing int8-state variables with a float64 one
    (the groups split where the state changes) and more than one group of 64."""
    _need_xla()
    make = TF_RULES[name][0]
    shapes = [(300,), (20, 30), ()] + [(7,)] * 70 + [(5,)]
    var0 = [rng.normal(size=s).astype(np.float32) for s in shapes[:-1]] + [rng.normal(size=(5,))]
    var0[40] = var0[40].astype(np.float64)
    grads = [rng.normal(size=v.shape).astype(v.dtype) for v in var0]
    runs = {}
    for how in ("eager", "xla"):
        rule = make("int8")
        tvars = [tf.Variable(v) for v in var0]

        def step(rule=rule, tvars=tvars):
            return tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, tvars)], rule,
                                           global_clipnorm=1.0)

        run = step if how == "eager" else tf.function(step, jit_compile=True)
        for _ in range(2):
            assert bool(run().applied)
        runs[how] = (rule, tvars)
    (ra, va), (rb, vb) = runs["eager"], runs["xla"]
    for a, b in zip(va, vb):
        _same_bits(b.numpy(), a.numpy())
        for s in ra.slots(a):
            _same_bits(rb.slots(b)[s].numpy(), ra.slots(a)[s].numpy())
            if a.dtype == tf.float32:
                _same_bits(rb.absmax(b)[s].numpy(), ra.absmax(a)[s].numpy())


def test_keras_int8_state_under_jit_compile(rng):
    """Keras 3 with jit_compile=True (its default on a GPU) and int8 state: apply_gradients in an
    XLA-compiled function gives the eager step's variables and state bit for bit (gradients
    given: XLA's own forward and backward differ from TF's in the last bits), and model.fit
    compiled with XLA trains."""
    _need_xla()
    import keras

    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30), ()]]
    grads = [[rng.normal(size=x.shape).astype(np.float32) for x in init] for _ in range(2)]
    out = {}
    for jit in (False, True):
        vars_ = [keras.Variable(x) for x in init]
        opt = tfclip.keras.Adam(0.01, global_clipnorm=1.0, state_dtype="int8")
        opt.build(vars_)

        def make(opt, vars_):
            def step(g):
                opt.apply([tf.convert_to_tensor(x) for x in g], vars_)
            return step

        step = make(opt, vars_)
        run = tf.function(step, jit_compile=True) if jit else step
        for g in grads:
            run([tf.constant(x) for x in g])
        out[jit] = [v.numpy() for v in vars_] + [v.numpy() for v in opt.variables]
    for a, b in zip(out[False], out[True]):
        _same_bits(b, a)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = tfclip.keras.Adam(0.01, state_dtype="int8")
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    hist = model.fit(x, y, epochs=5, batch_size=32, verbose=0).history["loss"]
    assert hist[-1] < 0.5 * hist[0]
    assert sum(v.dtype == "uint8" for v in opt.variables) == 2 * len(model.trainable_variables)


def test_op_refuses_int8_state_without_its_absmax(rng):
    """uint8 slots with absmax variables missing or of the wrong shape: an error naming them, and
    nothing written."""
    v = tf.Variable(tf.ones([300], tf.float32))
    rule = tfclip.rules.SGD(0.1, momentum=0.9, state_dtype="int8")
    rule.slots(v)
    rule._absmax[v.ref()] = {"momentum": tf.Variable(tf.zeros([3], tf.float32))}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"must be float32\[2\] \(one per 256 elements"):
        tfclip.fused_clip_apply([(tf.ones([300]), v)], rule)
    rule._handle_cache = None
    rule._absmax[v.ref()] = {}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is uint8 \(int8 state\) but the step got absmax "
                                                              r"variables for 0"):
        tfclip.fused_clip_apply([(tf.ones([300]), v)], rule)
    assert v.numpy().tolist() == [1.0] * 300


# ---------------------------------------------------------------- tfclip.compat.v1
@pytest.mark.parametrize("name", ["Momentum", "Adam", "RMSProp", "Adagrad", "Adadelta"])
def test_compat_v1_int8_state(rng, name, tmp_path):
    """tfclip.compat.v1 optimizers with state_dtype='int8' in a TF1 graph with a Session: uint8
    code slots and a float32 `<slot>_absmax` slot beside each, and over three steps the variables
    bit for bit those of the float32-state optimizer whose slots are set to the dequantized
    codes before each step, the codes and absmax NumPy's quantization of its new slots. A Saver
    names each absmax after its slot, and restores the state bit for bit."""
    from test_state_bf16 import V1_OPTS

    make, slot_names = V1_OPTS[name]
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    grads = [[rng.normal(size=v.shape).astype(np.float32) for v in init] for _ in range(3)]
    with tf.Graph().as_default():
        va = [tf.compat.v1.Variable(v, use_resource=True, name=f"a{i}") for i, v in enumerate(init)]
        vb = [tf.compat.v1.Variable(v, use_resource=True, name=f"b{i}") for i, v in enumerate(init)]
        gph = [tf.compat.v1.placeholder(tf.float32, v.shape) for v in init]
        a, b = make(global_clipnorm=1.0, state_dtype="int8"), make(global_clipnorm=1.0)
        step_a = a.apply_gradients(list(zip(gph, va)))
        step_b = b.apply_gradients(list(zip(gph, vb)))
        unsigned = a._unsigned_slots()
        codes = [a.get_slot(v, s) for s in slot_names for v in va]
        absmax = [a.get_slot(v, f"{s}_absmax") for s in slot_names for v in va]
        signed = [s not in unsigned for s in slot_names for _ in va]
        slots_b = [b.get_slot(v, s) for s in slot_names for v in vb]
        assert {c.dtype.base_dtype for c in codes} == {tf.uint8}
        assert [tuple(x.shape) for x in absmax] == [(2,), (3,)] * len(slot_names)
        assert sorted(x.op.name for x in absmax if x.op.name.startswith("a0/")) == sorted(
            f"a0/{a.get_name()}_{s}_absmax" for s in slot_names)
        fed = [tf.compat.v1.placeholder(tf.float32, x.shape) for x in slots_b]
        set_b = [x.assign(f) for x, f in zip(slots_b, fed)]
        saver = tf.compat.v1.train.Saver(va + codes + absmax)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for g in grads:
                q, am = sess.run([codes, absmax])
                sess.run(set_b, {f: reference.dequantize_blockwise(c, m, sg).reshape(c.shape)
                                 for f, c, m, sg in zip(fed, q, am, signed)})
                feed = dict(zip(gph, g))
                sess.run(step_a, feed)
                sess.run(step_b, feed)
                for x, y in zip(*sess.run([va, vb])):
                    _same_bits(x, y)
                for c, m, y, sg in zip(*sess.run([codes, absmax, slots_b]), signed):
                    wq, wm = reference.quantize_blockwise(y, sg)
                    _same_bits(c.ravel(), wq)
                    _same_bits(m, wm)
            saved = sess.run(codes + absmax)
            path = saver.save(sess, str(tmp_path / "v1"))
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.restore(sess, path)
            for x, y in zip(sess.run(codes + absmax), saved):
                _same_bits(x, y)
    names = dict(tf.train.list_variables(path))
    assert f"a0/{a.get_name()}_{slot_names[0]}_absmax" in names


def test_compat_v1_int8_state_indexed_slices_are_densified(rng):
    """An embedding's IndexedSlices gradient on an int8-state variable is applied as its dense
    sum (duplicate rows summed), as the other front doors apply it."""
    init = rng.normal(size=(10, 4)).astype(np.float32)
    vals = tf.constant(rng.normal(size=(3, 4)).astype(np.float32))
    idx = tf.constant([1, 7, 1])
    a, b = tf.Variable(init), tf.Variable(init)
    oa = tfclip.compat.v1.AdamOptimizer(0.01, state_dtype="int8")
    ob = tfclip.compat.v1.AdamOptimizer(0.01, state_dtype="int8")
    oa.apply_gradients([(tf.IndexedSlices(vals, idx, tf.constant([10, 4])), a)])
    ob.apply_gradients([(tf.math.unsorted_segment_sum(vals, idx, 10), b)])
    _same_bits(a.numpy(), b.numpy())
    for s in ("m", "v", "m_absmax", "v_absmax"):
        _same_bits(oa.get_slot(a, s).numpy(), ob.get_slot(b, s).numpy())


def test_compat_v1_int8_state_refuses_ref_variables():
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable([1.0, 2.0], use_resource=False)
        opt = tfclip.compat.v1.AdamOptimizer(0.1, state_dtype="int8")
        with pytest.raises(ValueError, match="ref variable: int8 optimizer state is for resource variables"):
            opt.apply_gradients([(tf.ones(2), v)])
    with pytest.raises(TypeError, match="state_dtype"):  # (no such argument: its state stays)
        tfclip.compat.v1.FtrlOptimizer(0.1, state_dtype="int8")


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
}


def _keras_vars(rng):
    return [keras.Variable(rng.normal(size=s).astype(np.float32), name=f"w{i}")
            for i, s in enumerate([(300,), (20, 30), ()])] + [
        keras.Variable(rng.normal(size=(5,)), dtype="float64", name="w64")]


def _slot_pairs(opt):
    """(table slot, is unsigned, [slot variable per model variable]) for each slot of `opt`."""
    unsigned = set(_opcall_rules()[opt._tfclip_binding.kind(opt)]["unsigned_slots"])
    return [(table, table in unsigned, getattr(opt, attr)) for table, attr in opt._tfclip_binding.slot_names(opt)]


def _opcall_rules():
    from tfclip._engine import opcall as _opcall

    return _opcall.RULES


@keras3
@pytest.mark.parametrize("name", sorted(KERAS_OPTS))
def test_keras_int8_state_is_the_float32_step_quantized(rng, name):
    """tfclip.keras.X(state_dtype='int8') against the same class with float32 state whose slots
    are set, before each step, to the int8 run's dequantized slots (NumPy, tests/reference.py):
    after each step the variables match bit for bit and the int8 run's codes and absmax are
    NumPy's quantization of the float32 run's slots. The codes start at the quantized start
    (Adagrad's 0.1: absmax 0.1, the code of 1)."""
    cls = getattr(tfclip.keras, name)
    kw = dict(KERAS_OPTS[name], global_clipnorm=1.0)
    a_vars = _keras_vars(rng)
    b_vars = [keras.Variable(v.numpy(), dtype=v.dtype, name=v.name) for v in a_vars]
    a, b = cls(state_dtype="int8", **kw), cls(**kw)
    a.build(a_vars)
    b.build(b_vars)
    pa, pb = _slot_pairs(a), _slot_pairs(b)
    for (_, unsigned, la), (_, _, lb) in zip(pa, pb):
        for sa, va in zip(la, a_vars):
            if va.dtype == "float32":
                assert sa.dtype == "uint8" and tuple(sa.shape) == tuple(va.shape)
                am = a.tfclip_absmax(sa)
                assert am.dtype == "float32" and tuple(am.shape) == (-(-int(np.prod(va.shape)) // 256),)
                assert any(am is v for v in a.variables)  # saved with the optimizer
            else:
                assert sa.dtype == "float64" and a.tfclip_absmax(sa) is None
    for _ in range(2):
        for (_, unsigned, la), (_, _, lb) in zip(pa, pb):
            for sa, sb, va in zip(la, lb, a_vars):
                if va.dtype == "float32":
                    sb.assign(reference.dequantize_blockwise(sa.numpy(), a.tfclip_absmax(sa).numpy(),
                                                             not unsigned).reshape(sb.shape))
        grads = [rng.normal(size=v.shape).astype(v.dtype) for v in a_vars]
        a.apply([tf.constant(g) for g in grads], a_vars)
        b.apply([tf.constant(g) for g in grads], b_vars)
        for va, vb in zip(a_vars, b_vars):
            _same_bits(va.numpy(), vb.numpy())
        for (table, unsigned, la), (_, _, lb) in zip(pa, pb):
            for sa, sb, va in zip(la, lb, a_vars):
                if va.dtype != "float32":
                    _same_bits(sa.numpy(), sb.numpy())
                    continue
                q, am = reference.quantize_blockwise(sb.numpy(), not unsigned)
                _same_bits(sa.numpy().ravel(), q)
                _same_bits(a.tfclip_absmax(sa).numpy(), am)


@keras3
@pytest.mark.parametrize("name", sorted(KERAS_OPTS))
def test_keras_int8_codes_are_signed_as_the_rule_table_says(name):
    """Every int8-state slot a class makes takes the signed code exactly where the rule table keeps
    the slot's values of either sign (its unsigned_slots: the rest >= 0), whatever Keras 3 names
    the slot (tfclip._engine.narrow_state.made_signed): its codes start at that code's 0."""
    opt = getattr(tfclip.keras, name)(**KERAS_OPTS[name], state_dtype="int8")
    v = keras.Variable(np.zeros(3, np.float32))
    opt.build([v])
    made = {id(s.codes): s.signed for s in opt.tfclip_int8_slots()}
    pairs = _slot_pairs(opt)
    assert len(made) == len(pairs)
    for table, unsigned, slots in pairs:
        assert made[id(slots[0])] == (not unsigned), (name, table)
        if not float(opt.tfclip_absmax(slots[0]).numpy()[0]):  # (a slot starting at 0: that code's 0)
            assert int(slots[0].numpy()[0]) == (0 if unsigned else 127), (name, table)


@keras3
def test_keras_int8_state_config_checkpoint_and_fit(rng, tmp_path):
    opt = tfclip.keras.Adam(0.01, state_dtype="int8")
    assert opt.get_config()["state_dtype"] == "int8"
    assert tfclip.keras.Adam.from_config(opt.get_config()).state_dtype == "int8"
    with pytest.raises(ValueError, match="Lamb does not take state_dtype='int8'"):
        tfclip.keras.Lamb(state_dtype="int8")
    # model.fit with int8 state: the loss falls and the state stays int8.
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    hist = model.fit(x, y, epochs=5, batch_size=32, verbose=0).history["loss"]
    assert hist[-1] < 0.5 * hist[0]
    codes = [v for v in opt.variables if v.dtype == "uint8"]
    assert len(codes) == 2 * len(model.trainable_variables)
    # A checkpoint of int8 state restores into the same layout, bit for bit.
    ckpt = tf.train.Checkpoint(opt=opt)
    path = ckpt.save(str(tmp_path / "c"))
    saved = [v.numpy() for v in opt.variables]
    opt2 = tfclip.keras.Adam(0.01, state_dtype="int8")
    opt2.build(model.trainable_variables)
    tf.train.Checkpoint(opt=opt2).restore(path).assert_existing_objects_matched()
    for v, s in zip(opt2.variables, saved):
        _same_bits(v.numpy(), s)


@pytest.mark.parametrize("front", [pytest.param("keras", marks=keras3), "rules"])
def test_int8_state_under_mirrored_strategy(rng, front):
    """Under MirroredStrategy the codes and absmax are mirrored variables and the step is the one
    without a strategy, bit for bit. (One device in this process.)"""
    strategy = tf.distribute.MirroredStrategy(["CPU:0"])
    init = [rng.normal(size=s).astype(np.float32) for s in [(300,), (20, 30)]]
    grad = [rng.normal(size=x.shape).astype(np.float32) for x in init]

    def make():
        return (tfclip.keras.Adam(0.01, global_clipnorm=1.0, state_dtype="int8") if front == "keras"
                else tfclip.rules.Adam(0.01, state_dtype="int8"))

    def apply(opt, vars_):
        pairs = zip([tf.constant(g) for g in grad], vars_)
        if front == "keras":
            opt.apply_gradients(pairs)
        else:
            tfclip.fused_clip_apply(pairs, opt, global_clipnorm=1.0)

    with strategy.scope():
        vars_ = [tf.Variable(x) for x in init]
        opt = make()

    @tf.function
    def step():
        strategy.run(lambda: apply(opt, vars_))

    step()
    one_vars = [tf.Variable(x) for x in init]
    one = make()
    apply(one, one_vars)

    def state(o, vs):
        if front == "keras":
            return [v for v in o.variables if v.dtype in ("uint8", "float32") and "iteration" not in v.path
                    and "learning_rate" not in v.path]
        return [s for v in vs for s in list(o.slots(v).values()) + list(o.absmax(v).values())]

    got, want = state(opt, vars_), state(one, one_vars)
    assert len(got) == len(want) == 8  # m, v and their absmax, two variables
    for s, s1 in zip(got, want):
        copies = [c.numpy() for c in strategy.experimental_local_results(s)]
        assert len(copies) == 1
        _same_bits(copies[0], np.asarray(s1.numpy()))
    for v, v1 in zip(vars_, one_vars):
        _same_bits(v.numpy(), v1.numpy())
