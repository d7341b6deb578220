"""tfclip._core (NumPy, our threads) and the TF op (TF's thread pool) run the same core: same bits.
Also: the norm is deterministic whatever the thread count."""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from tfclip import _core

SHAPES = [(200_003,), (7,), ()] + [(i % 9 + 1,) for i in range(300)]


def test_norm_same_bits_for_any_thread_count(rng):
    ts = [rng.normal(size=s).astype(np.float32) for s in [(1_000_003,), (70_001,), (5,)]]
    norms = set()
    for n in (1, 2, 3, 8):
        _core.set_num_threads(n)
        for _ in range(3):
            norms.add(_core.global_norm(ts))
    _core.set_num_threads(0)
    assert len(norms) == 1
    np.testing.assert_allclose(norms.pop(), np.sqrt(sum((t.astype(np.float64) ** 2).sum() for t in ts)),
                               rtol=1e-13)


@pytest.mark.parametrize("np_dtype,tf_dtype", [(np.float16, tf.float16), (ml_dtypes.bfloat16, tf.bfloat16),
                                               (np.float32, tf.float32), (np.float64, tf.float64)])
def test_clip_by_global_norm_parity(rng, np_dtype, tf_dtype):
    ts = [rng.normal(size=s).astype(np_dtype) for s in SHAPES]
    out, norm = _core.clip_by_global_norm(ts, 0.5)
    tf_out, tf_norm = tfclip.fused_clip_by_global_norm([tf.constant(t) for t in ts], 0.5)
    nd = np.float64 if np_dtype is np.float64 else np.float32
    assert nd(norm).astype(np_dtype) == tf_norm.numpy()
    for a, b in zip(out, tf_out):
        assert a.dtype == b.numpy().dtype
        assert a.tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("rule_name,rule,slots,hp", [
    ("sgd", lambda: tfclip.rules.SGD(0.1, weight_decay=0.01), [], {"learning_rate": 0.1, "weight_decay": 0.01}),
    ("momentum", lambda: tfclip.rules.Momentum(0.1, 0.9, use_nesterov=True), ["momentum"],
     {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("keras_momentum", lambda: tfclip.rules.SGD(0.1, momentum=0.9), ["momentum"],
     {"learning_rate": 0.1, "momentum": 0.9}),
    ("adam", lambda: tfclip.rules.Adam(0.01, amsgrad=True), ["m", "v", "vhat"],
     {"learning_rate": 0.01, "amsgrad": True}),
])
@pytest.mark.parametrize("mode,kw", [("global_norm", {"global_clipnorm": 1.0}), ("norm", {"clipnorm": 0.3}),
                                     ("value", {"clipvalue": 0.01}), ("none", {})])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_apply_parity_bitwise(rng, rule_name, rule, slots, hp, mode, kw, grad_dtype):
    np_g = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[grad_dtype]
    var0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [rng.normal(size=s).astype(np_g) for s in SHAPES]
    r = rule()
    tvars = [tf.Variable(v) for v in var0]
    for _ in range(2):
        res = tfclip.fused_clip_apply([(tf.constant(g), v) for g, v in zip(grads, tvars)], r, **kw)
    cvars = [v.copy() for v in var0]
    cslots = [[np.zeros_like(v) for v in var0] for _ in slots]
    for step in (1, 2):
        norm, applied = _core.clip_apply(rule_name, cvars, grads, cslots,
                                         dict(hp, step=step) if rule_name == "adam" else hp,
                                         clip_mode=mode, clip=next(iter(kw.values()), 0.0))
        assert applied
    assert np.float32(norm) == res.global_norm.numpy()
    for a, b in zip(cvars, tvars):
        np.testing.assert_array_equal(a, b.numpy())
    for k, name in enumerate(slots):
        for a, v in zip(cslots[k], tvars):
            np.testing.assert_array_equal(a, r.slots(v)[name].numpy())


def test_core_half_conversion_matches_numpy(rng):
    # Every float16 bit pattern (finite ones) round-trips through the core's own conversion.
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    h = bits.view(np.float16)
    h = h[np.isfinite(h)]
    out, _ = _core.clip_by_global_norm([h], 1.0, use_norm=0.5)  # scale exactly 1
    np.testing.assert_array_equal(out[0].view(np.uint16), h.view(np.uint16))
    # float -> half rounding (nearest even, subnormals, overflow) against NumPy's cast.
    x = np.concatenate([rng.normal(size=20000) * s for s in (1e-7, 1e-5, 1, 1e3, 7e4)]).astype(np.float32)
    with np.errstate(over="ignore"):  # the 7e4 cases overflow to inf on purpose
        x16 = x.astype(np.float16)
    out, _ = _core.clip_by_global_norm([x16], 1.0, use_norm=0.5)
    np.testing.assert_array_equal(out[0].view(np.uint16), x16.view(np.uint16))
    v = np.zeros_like(x, dtype=np.float32)
    # var(float32) -= 1 * grad(half): exercises half loads; sgd with lr 1 from zero gives -grad.
    # (x16 holds infs from the overflow cases: "propagate" applies them as TF would.)
    _core.clip_apply("sgd", [v], [x16], [], {"learning_rate": 1.0}, nonfinite="propagate")
    np.testing.assert_array_equal(v, -x16.astype(np.float32))


def test_every_cpu_variant_gives_the_same_bits():
    """The CPU passes are compiled per instruction set and picked at run time; every variant
    this CPU runs gives the same bits for the norm, the clip, each rule's apply and AGC (so the
    emulated CUDA suite, built with the baseline alone, checks the kernels against all of them),
    Adafactor's factored passes too."""
    isas = _core.cpu_isas()
    assert isas[-1] == "baseline" and _core.cpu_isa() in isas
    rng = np.random.default_rng(3)
    shapes = [(70_001,), (3, 5), (), (0,), (257,)]
    results = {}
    try:
        for isa in isas:
            _core.set_cpu_isa(isa)
            out = [_core.global_norm([rng.normal(size=(1000,)).astype(np.float32)])]
            rng = np.random.default_rng(3)
            for rule, slots, hp in [("sgd", 0, {"lr": 0.1, "weight_decay": 0.01}),
                                    ("momentum", 1, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
                                    ("keras_momentum", 1, {"lr": 0.1, "momentum": 0.9}),
                                    ("adam", 3, {"lr": 0.1, "amsgrad": True, "step": 3})]:
                for gdt in (np.float32, np.float16):
                    r = np.random.default_rng(4)
                    vs = [np.asarray(r.normal(size=s), np.float32) for s in shapes]
                    gs = [np.asarray(r.normal(size=s), gdt) for s in shapes]
                    sl = [[np.asarray(np.abs(r.normal(size=s)), np.float32) for s in shapes] for _ in range(slots)]
                    _core.clip_apply(rule, vs, gs, sl, hp, "global_norm", 0.5)
                    out += [a.tobytes() for a in vs + [x for s in sl for x in s]]
            # AGC (its own norm pass over g and w, per unit; a tensor of two row blocks too), with
            # its per-tensor norms and clipped-unit counts.
            for rule, slots, hp in [("sgd", 0, {"lr": 0.1}), ("adam", 2, {"lr": 0.1, "step": 2})]:
                for gdt in (np.float32, np.float16, np.float64):
                    r = np.random.default_rng(5)
                    agc_shapes = shapes + [(2000, 40), (40, 3000)]
                    vs = [np.asarray(r.normal(size=s), np.float32) for s in agc_shapes]
                    gs = [np.asarray(r.normal(size=s) * 0.1, gdt) for s in agc_shapes]
                    sl = [[np.asarray(np.abs(r.normal(size=s)), np.float32) for s in agc_shapes]
                          for _ in range(slots)]
                    tn, cu = np.zeros(len(agc_shapes)), np.zeros(len(agc_shapes), np.int64)
                    out.append(_core.clip_apply(rule, vs, gs, sl, hp, "agc", 0.05, tensor_norms_out=tn,
                                                agc_clipped_out=cu))
                    out += [tn.tobytes(), cu.tobytes()] + [a.tobytes() for a in vs + [x for s in sl for x in s]]
            # Adafactor's factored passes (csrc/core/cpu/pass_factored.cc): matrices of several tiles,
            # a batch of matrices, unfactored vectors; its r and c slots of their own shapes.
            for gdt in (np.float32, np.float16):
                r = np.random.default_rng(6)
                fac_shapes = [(3, 5), (), (257,), (2000, 40), (40, 3000), (2, 30, 70)]
                vs = [np.asarray(r.normal(size=s), np.float32) for s in fac_shapes]
                gs = [np.asarray(r.normal(size=s), gdt) for s in fac_shapes]
                sl = [[np.zeros(s[:-1] if len(s) > 1 else (), np.float32) for s in fac_shapes],
                      [np.zeros(s[:-2] + s[-1:] if len(s) > 1 else (), np.float32) for s in fac_shapes],
                      [np.zeros(s, np.float32) for s in fac_shapes]]
                out.append(_core.clip_apply("adafactor", vs, gs, sl, {"lr": 0.1, "step": 2}, "global_norm", 0.5))
                out += [a.tobytes() for a in vs + [x for s in sl for x in s]]
            clipped, norm = _core.clip_by_global_norm([np.asarray(r.normal(size=s), np.float64) for s in shapes], 0.3)
            out += [norm] + [c.tobytes() for c in clipped]
            results[isa] = out
    finally:
        _core.set_cpu_isa(isas[0])
    first = results[isas[0]]
    for isa in isas[1:]:
        assert results[isa] == first, isa
    with pytest.raises(ValueError, match="not supported"):
        _core.set_cpu_isa("sse9")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_16bit_gradients_round_alike_in_every_cpu_variant(dtype):
    """Every finite 16-bit value as a gradient, scaled by a global clip and rounded back to its
    dtype (TF's `g * cast(scale, g.dtype)`), then applied by SGD at lr 1 to zeros: the variable
    is exactly -round(g * scale). The AVX variants convert 8 lanes at a time (F16C for float16,
    integer ops for bfloat16), the baseline one element at a time: all must equal the
    float32 -> 16-bit rounding of NumPy / ml_dtypes, and a NaN must give the same bits."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    g = bits.view(dtype)
    g = g[np.isfinite(g.astype(np.float32))]
    norm = _core.global_norm([g])
    clip = norm * 0.3  # a scale whose 16-bit rounding is inexact
    scale16 = dtype(np.float64(clip) / norm)  # the op rounds the scale to the gradient's dtype
    want = np.float32(0.0) - (g.astype(np.float32) * np.float32(scale16)).astype(dtype).astype(np.float32)
    nan_grad = np.array([1.0, np.nan, -2.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype)  # a full vector
    nan_grad.view(np.uint16)[1] = 0xfd37 if dtype is np.float16 else 0xff97  # negative, a payload
    isas = _core.cpu_isas()
    nan_bits = {}
    try:
        for isa in isas:
            _core.set_cpu_isa(isa)
            v = np.full(g.shape, np.nan, np.float32)  # poisoned, then zeroed: SGD writes v - g
            v[:] = 0.0
            _core.clip_apply("sgd", [v], [g], [], {"lr": 1.0}, "global_norm", clip)
            np.testing.assert_array_equal(v.view(np.uint32), want.view(np.uint32), err_msg=isa)
            w = np.zeros(nan_grad.shape, np.float32)
            _core.clip_apply("sgd", [w], [nan_grad], [], {"lr": 1.0}, "global_norm", 1.0,
                             nonfinite="propagate")
            assert np.isnan(w).all(), isa
            nan_bits[isa] = w.tobytes()
    finally:
        _core.set_cpu_isa(isas[0])
    assert len(set(nan_bits.values())) == 1, {k: np.frombuffer(b, np.uint32) for k, b in nan_bits.items()}
