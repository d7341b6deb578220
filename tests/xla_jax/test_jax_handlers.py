"""The XLA custom-call handlers under a real XLA runtime (JAX's), not a hand-built call frame: a
jitted clip-and-apply step through `jax.ffi.ffi_call` (tests/xla_jax/tfclip_jax.py, the calls TF's
XLA kernel makes) equals, bit for bit, the TF op's step on the same numbers (where TF is
installed: CI) and the core's CPU driver's (`_core.clip_apply`: always, also on the GPU hosts,
which have no TF). On every platform the module was built for and JAX has: the Host handler on
JAX's CPU backend; the CUDA handler on a GPU (scripts/gpu_session.sh)."""
import os

import numpy as np
import pytest

from core_loader import load_core

# CI's emulation step sets TFCLIP_REQUIRE_JAX=1: there, JAX or the module missing is a failure.
REQUIRE = os.environ.get("TFCLIP_REQUIRE_JAX") == "1"


def _unavailable(why):
    if REQUIRE:
        pytest.fail(why + " (TFCLIP_REQUIRE_JAX=1)", pytrace=False)
    pytest.skip(why, allow_module_level=True)


try:
    import jax
    import jax.numpy as jnp

    from tfclip_jax import TfclipJax, find_module
except ImportError as e:
    _unavailable(f"JAX is not installed ({e}): pip install '.[jax]' (scripts/cuda_emulation.sh does, in CI)")
if find_module() is None:
    _unavailable("no _jax_ffi.so: CMake builds it where the build's Python has jaxlib "
                 "(scripts/cuda_emulation.sh in CI, scripts/gpu_session.sh on a GPU host); "
                 "or set TFCLIP_JAX_FFI_MODULE")

try:
    import tensorflow as tf

    from tfclip._engine import opcall as _opcall
except ImportError:  # the GPU hosts: the core's driver is the reference there
    tf = None

core = load_core()


@pytest.fixture(scope="module")
def tj():
    return TfclipJax(core)


@pytest.fixture(scope="module")
def jax_platforms(tj):
    """The platforms to run on: those the module has handlers for and JAX has devices for."""
    have = []
    for p in tj.platforms:
        try:
            jax.devices("cpu" if p == "cpu" else "cuda")
            have.append("cpu" if p == "cpu" else "cuda")
        except RuntimeError:
            pass
    if os.environ.get("TFCLIP_REQUIRE_GPU") == "1" and "cuda" not in have:
        pytest.fail("TFCLIP_REQUIRE_GPU=1 but the CUDA handler cannot run here: module platforms "
                    f"{tj.platforms}, JAX backends {jax.default_backend()}")
    return have


BF16 = jnp.bfloat16
ADAM = dict(lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.004, step=1.0)
HPARAMS = {
    "adam": ADAM,
    "lamb": dict(lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-6, weight_decay=0.01, step=1.0),
    "momentum": dict(lr=0.05, momentum=0.9, weight_decay=0.0),
    "rmsprop": dict(lr=0.01, rho=0.9, momentum=0.5, epsilon=1e-7, weight_decay=0.0),
}
FLAGS = {"momentum": {"use_nesterov": True}, "rmsprop": {"centered": True, "has_momentum": True}}
SHAPES = [(33, 17), (129,), (4, 5, 6), (1,)]


def _problem(rule, var_dt, grad_dt, shapes=SHAPES, seed=0, nan_at=None):
    rng = np.random.default_rng(seed)
    nslots = _nslots(rule)
    vs = [rng.standard_normal(s).astype(var_dt) for s in shapes]
    gs = [(rng.standard_normal(s) * 3).astype(np.float32).astype(grad_dt) for s in shapes]
    if nan_at is not None:
        gs[nan_at].reshape(-1)[0] = np.nan
    slots = [[np.abs(rng.standard_normal(s)).astype(var_dt) * 0.1 for s in shapes] for _ in range(nslots)]
    if FLAGS.get(rule, {}).get("centered"):
        # A centered RMSprop's state holds ms >= mg^2 (ms - mg^2 is the gradient's variance, kept
        # >= 0 by the update): drawn independently, ms - mg^2 < 0 makes the step NaN, whose
        # payload bits the CPU and a GPU make differently (an H200, 2026-12-04).
        ms, mg = slots[0], slots[2]
        slots[0] = [(m + g * g).astype(var_dt) for m, g in zip(ms, mg)]
    return vs, slots, gs


def _nslots(rule):
    return {"adam": 2, "lamb": 2, "momentum": 1, "rmsprop": 3}[rule]


def _reference(rule, vs, slots, gs, clip_mode, clip, nonfinite, counter):
    """The step by the TF op (eager, the CPU kernel) where TF is installed, else by the core's
    CPU driver: (vars, slots, counter, applied)."""
    hp, flags = HPARAMS[rule], FLAGS.get(rule, {})
    if tf is not None:
        tv = [tf.Variable(v) for v in vs]
        ts = [[tf.Variable(s) for s in lst] for lst in slots]
        tc = tf.Variable(np.int64(counter), dtype=tf.int64)
        _, applied, _, _ = _opcall.apply(
            rule, [v.handle for v in tv], [[s.handle for s in lst] for lst in ts],
            [tf.constant(g) for g in gs], hp, flags, lazy=False, **_opcall.NO_SPARSE,
            clip=_opcall.scalar(clip, "clip"), use_norm=_opcall.scalar(0.0, "use_norm"),
            iterations=[tc.handle], clip_mode=clip_mode, nonfinite=nonfinite, use_given_norm=False)
        return ([v.numpy() for v in tv], [[s.numpy() for s in lst] for lst in ts], int(tc.numpy()),
                bool(applied.numpy()))
    vs, slots = [v.copy() for v in vs], [[s.copy() for s in lst] for lst in slots]
    it = np.array([counter], np.int64)
    _, applied = core.clip_apply(rule, vs, list(gs), slots, {**hp, **flags}, clip_mode=clip_mode, clip=clip,
                                 nonfinite=nonfinite, iterations=it)
    return vs, slots, int(it[0]), bool(applied)


_OWNED = jax.jit(lambda xs: jax.tree.map(jnp.copy, xs))


def _run(tj, platform, rule, vs, slots, gs, clip_mode, clip, nonfinite, counter, donate=True):
    dev = jax.devices(platform)[0]
    # (Arrays a computation made: on the CPU backend JAX copies some device_put arrays rather
    # than donate them, as it may; XLA's own outputs it donates.)
    put = lambda xs: _OWNED([jax.device_put(x, dev) for x in xs])  # noqa: E731
    step = tj.step_fn(rule, HPARAMS[rule], flags=FLAGS.get(rule), clip_mode=clip_mode, clip=clip,
                      nonfinite=nonfinite, donate=donate)
    jv, js, jg = put(vs), [put(lst) for lst in slots], put(gs)
    jc = _OWNED(jax.device_put(np.asarray(counter, np.int64), dev))
    ptrs = [x.unsafe_buffer_pointer() for x in jv]
    nv, ns, nc, applied, _ = step(jv, js, jg, jc)
    return ([np.asarray(x) for x in nv], [[np.asarray(x) for x in lst] for lst in ns], int(nc),
            bool(applied), ptrs, [x.unsafe_buffer_pointer() for x in nv])


def _assert_bits(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            pytest.fail(f"{what}[{i}] differs from the reference in {np.count_nonzero(d)} elements "
                        f"(max {d.max()})")


CASES = [
    # rule, var dtype, grad dtype, clip mode, clip (the norm of these gradients is about 150)
    ("adam", np.float32, np.float32, "global_norm", 1.0),
    ("adam", np.float32, BF16, "global_norm", 1.0),
    ("adam", np.float64, np.float32, "global_norm", 1e6),  # not clipped
    ("adam", np.float32, np.float16, "value", 0.5),
    ("lamb", np.float32, np.float32, "global_norm", 1.0),
    ("momentum", np.float32, np.float16, "global_norm", 2.0),
    ("rmsprop", np.float32, np.float32, "norm", 3.0),
]


@pytest.mark.parametrize("rule,var_dt,grad_dt,mode,clip", CASES,
                         ids=[f"{c[0]}-{np.dtype(c[1]).name}-{np.dtype(c[2]).name}-{c[3]}" for c in CASES])
def test_step_equals_the_reference_bit_for_bit(tj, jax_platforms, rule, var_dt, grad_dt, mode, clip):
    vs, slots, gs = _problem(rule, var_dt, grad_dt)
    want_v, want_s, want_c, want_applied = _reference(rule, vs, slots, gs, mode, clip, "skip", 5)
    assert want_applied and want_c == 6
    for platform in jax_platforms:
        got_v, got_s, got_c, applied, before, after = _run(tj, platform, rule, vs, slots, gs, mode, clip, "skip", 5)
        assert applied and got_c == want_c, platform
        _assert_bits(got_v, want_v, f"{platform} vars")
        for k, (a, b) in enumerate(zip(got_s, want_s)):
            _assert_bits(a, b, f"{platform} slot {k}")
        # The variables were donated and the calls alias their results to them: updated in place.
        assert after == before, f"{platform}: the donated variables' buffers were not reused"


def test_nonfinite_step_is_skipped_and_writes_nothing(tj, jax_platforms):
    vs, slots, gs = _problem("adam", np.float32, np.float32, nan_at=2)
    want_v, want_s, want_c, want_applied = _reference("adam", vs, slots, gs, "global_norm", 1.0, "skip", 5)
    assert not want_applied and want_c == 5
    for platform in jax_platforms:
        got_v, got_s, got_c, applied, _, _ = _run(tj, platform, "adam", vs, slots, gs, "global_norm", 1.0, "skip", 5)
        assert not applied and got_c == 5, platform
        _assert_bits(got_v, vs, f"{platform} vars")  # untouched
        _assert_bits(got_v, want_v, f"{platform} vars")
        for a, b in zip(got_s, slots):
            _assert_bits(a, b, f"{platform} slots")


def test_more_variables_than_one_apply_call_takes(tj, jax_platforms):
    # 150 variables: three apply calls (64 each at most, custom_calls.h) after one norm call, as
    # the TF XLA kernel makes them; every group is clipped by the one global norm.
    shapes = [(i % 7 + 1, 3) for i in range(150)]
    vs, slots, gs = _problem("adam", np.float32, np.float32, shapes=shapes, seed=3)
    want_v, want_s, want_c, _ = _reference("adam", vs, slots, gs, "global_norm", 1.0, "skip", 0)
    for platform in jax_platforms:
        got_v, got_s, got_c, applied, _, _ = _run(tj, platform, "adam", vs, slots, gs, "global_norm", 1.0, "skip", 0)
        assert applied and got_c == want_c == 1
        _assert_bits(got_v, want_v, f"{platform} vars")
        _assert_bits(got_s[1], want_s[1], f"{platform} v")


class _CoreArray:
    """Device memory of the core's own (cuda_malloc), for its CUDA driver as the reference."""

    def __init__(self, a):
        a = np.ascontiguousarray(a)
        self._wire = a.view(np.uint16) if a.dtype == BF16 else a  # bfloat16 travels as uint16
        self.ptr = core.cuda_malloc(a.nbytes)
        core.cuda_to_device(self.ptr, self._wire)
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": self._wire.dtype.str,
                                         "data": (self.ptr, False), "version": 3, "strides": None,
                                         "stream": None}

    def host(self, dtype):
        out = np.empty(self._wire.shape, self._wire.dtype)
        core.cuda_synchronize()
        core.cuda_to_host(out, self.ptr)
        return out.view(dtype)

    def __del__(self):
        core.cuda_free(self.ptr)


def _norm_and_clip_reference(platform, gs):
    """(norm f64, clipped, clip's norm) by the core's driver of the platform: on the GPU its CUDA
    driver, which the CUDA handler calls (its sum runs in another order than the CPU's: the f64
    norms are 1 ulp apart, seen on an H200, 2026-12-04)."""
    if platform == "cpu":
        clipped, norm = core.clip_by_global_norm(gs, 1.0)
        return core.global_norm(gs), clipped, norm
    ins = [_CoreArray(g) for g in gs]
    outs = [_CoreArray(np.zeros_like(g)) for g in gs]
    norm = core.cuda_global_norm(ins)
    clip_norm = core.cuda_clip_by_global_norm(ins, outs, 1.0)
    return norm, [o.host(g.dtype) for o, g in zip(outs, gs)], clip_norm


def test_norm_and_clip_calls_equal_the_reference(tj, jax_platforms):
    rng = np.random.default_rng(5)
    gs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES] + [rng.standard_normal(40).astype(BF16)]
    clipped_want, norm_want = core.clip_by_global_norm(gs, 1.0)
    if tf is not None:
        import tfclip

        tf_clipped, tf_norm = tfclip.fused_clip_by_global_norm([tf.constant(g) for g in gs], 1.0)
        assert np.float32(tf_norm.numpy()) == np.float32(norm_want)
        _assert_bits([t.numpy() for t in tf_clipped], clipped_want, "TF's clipped")
    for platform in jax_platforms:
        want, clipped_want, clip_norm_want = _norm_and_clip_reference(platform, gs)
        assert abs(float(want) - float(norm_want)) <= 1e-12 * float(norm_want)  # the drivers agree
        dev = jax.devices(platform)[0]
        jg = [jax.device_put(g, dev) for g in gs]
        norm64, _ = jax.jit(tj.norm)(jg)
        assert float(norm64) == float(want), platform
        clipped, norm = jax.jit(tj.clip)(jg, 1.0)
        assert np.float32(norm) == np.float32(clip_norm_want) == np.float32(want), platform
        _assert_bits([np.asarray(c) for c in clipped], clipped_want, f"{platform} clipped")


def test_a_bad_clip_writes_nothing_and_is_named(tj, jax_platforms):
    vs, slots, gs = _problem("adam", np.float32, np.float32)
    named = r"global_clipnorm must be finite and >= 0 \(0: no clip\), got -1"
    for platform in jax_platforms:
        # nonfinite='raise' waits for the step's verdict: an error naming the value, either platform.
        with pytest.raises(Exception, match=named):
            _run(tj, platform, "adam", vs, slots, gs, "global_norm", -1.0, "raise", 0, donate=False)
        if platform == "cpu":  # the Host handler reads the scalars on the host: an error at once
            with pytest.raises(Exception, match=named):
                _run(tj, platform, "adam", vs, slots, gs, "global_norm", -1.0, "skip", 0, donate=False)
        else:  # read on the device, where nothing waits: the step is skipped, nothing written
            got_v, got_s, got_c, applied, _, _ = _run(tj, platform, "adam", vs, slots, gs, "global_norm", -1.0,
                                                      "skip", 0)
            assert not applied and got_c == 0
            _assert_bits(got_v, vs, f"{platform} vars")
