"""The XLA CUDA custom-call handler (csrc/xla/ffi/cuda_handlers.cc) without XLA and without a GPU: on
the emulated-CUDA build of _core, a call frame built as XLA's GPU runtime builds one (typed-FFI
buffers with dtype and dims, the variables' results aliased to their operands, the hyper-parameters
in one device f64 vector, the step counter's copy as a result) runs the handler's body, against
the CPU driver (_core.clip_apply) on the same numbers."""
import ctypes

import numpy as np
import pytest

import reference
from gpu_arrays import BF16, EMULATED, assert_same_bits, core, to_dev, to_host

pytestmark = pytest.mark.emulation_only

# XLA_FFI_DataType (xla/ffi/api/c_api.h).
FFI = {np.dtype(np.bool_): 1, np.dtype(np.int64): 5, np.dtype(np.uint8): 6, np.dtype(np.float16): 10,
       np.dtype(np.float32): 11, np.dtype(np.float64): 12, BF16: 16}
MODES = {"none": 0, "global_norm": 1, "norm": 2, "value": 3, "agc": 4}
POLICIES = {"skip": 0, "propagate": 1, "raise": 2}
OVERRIDES = {"learning_rate": 0.01, "step": 1.0, "u_product": 0.7, "schedule_decay": 0.004, "weight_decay": 0.01,
             "l1_regularization_strength": 0.01}


def _entry():
    if not EMULATED:
        pytest.skip("the handler's test entry is built into the emulated-CUDA _core only")
    lib = ctypes.CDLL(core.__file__)
    try:
        f = lib.tfclip_xla_cuda_apply_for_test
    except AttributeError:
        pytest.fail("the emulated _core lacks the XLA handler entry: CMake found no typed-FFI "
                    "headers (TF's include/xla/ffi/api) when it configured this build")
    f.restype = ctypes.c_int
    return f


def _ptr(d):
    return d.__cuda_array_interface__["data"][0]


def _frame(bufs):
    n = len(bufs)
    dtypes = (ctypes.c_int32 * n)(*[FFI[np.dtype(dt)] for _, dt, _ in bufs])
    data = (ctypes.c_void_p * n)(*[_ptr(d) for d, _, _ in bufs])
    ranks = (ctypes.c_int64 * n)(*[len(s) for _, _, s in bufs])
    dims = [x for _, _, s in bufs for x in s]
    dims_arr = (ctypes.c_int64 * max(1, len(dims)))(*dims)
    return n, dtypes, data, ranks, dims_arr


def call_handler(rule, vars_d, slots_d, grads_d, scalars, counter, shapes, var_dt, grad_dt,
                 mode, policy, agc_eps=1e-3, clipped_out=None, scratch="xla", absmax_d=None):
    """One tfclip_apply call as XLA makes it; returns (error or None, applied, norm,
    tensor_norms, counter after). clipped_out: a list given the clipped_units result. scratch:
    "xla", the workspace from an allocator as XLA's; "own", a runtime with none (the typed FFI's
    API 0.0, TF 2.17), where the handler keeps its own device buffers; "legacy", a legacy custom
    call as TF 2.16's XLA makes it (csrc/xla/ffi/legacy_call.h: raw buffers, the shapes and
    attributes in the opaque string, no allocator). absmax_d: int8 state, slots_d then hold the
    codes (uint8) and these lists their absmax."""
    n = len(vars_d)
    scal = to_dev(np.asarray(scalars, np.float64))
    cnt_in = to_dev(np.asarray(counter, np.int64).reshape(()))
    applied = to_dev(np.zeros((), np.bool_))
    norm = to_dev(np.full((), np.nan, np.float32))
    tn = to_dev(np.full((n,), np.nan, np.float32))
    cnt_out = to_dev(np.asarray(-1, np.int64).reshape(()))
    clipped = to_dev(np.full((n,), -7, np.int64))  # poisoned: every count must be written
    state = [(d, var_dt, s) for d, s in zip(vars_d, shapes)]
    for sl in slots_d:  # (each slot's own shape: Adafactor's r and c are not their variable's)
        state += [(d, np.uint8 if absmax_d else var_dt, tuple(d.shape)) for d in sl]
    for sl in absmax_d or []:  # int8 state: the codes' absmax lists follow them (custom_calls.h)
        state += [(d, np.float32, (-(-int(np.prod(s)) // 256),)) for d, s in zip(sl, shapes)]
    args = state + [(d, grad_dt, s) for d, s in zip(grads_d, shapes)] + \
        [(scal, np.float64, (len(scalars),)), (cnt_in, np.int64, ())]
    rets = state + [(applied, np.bool_, ()), (norm, np.float32, ()), (tn, np.float32, (n,)),
                    (clipped, np.int64, (n,)), (cnt_out, np.int64, ())]
    attrs = [list(core.rule_table()).index(rule), 0, MODES[mode], POLICIES[policy], 1, 0, 0,
             len(slots_d) + len(absmax_d or []), 1, int(np.float64(agc_eps).view(np.int64))]
    err = ctypes.create_string_buffer(4096)
    rc = _entry()(None, *_frame(args), *_frame(rets), (ctypes.c_int64 * 10)(*attrs),
                  {"own": 0, "xla": 1, "legacy": 2}[scratch], err, 4096)
    if clipped_out is not None:
        clipped_out.append(to_host(clipped, np.int64).reshape(-1))
    if rc:
        return err.value.decode(), None, None, None, None
    one = lambda d, dt: to_host(d, dt).reshape(-1)[0].item()  # noqa: E731
    return (None, bool(one(applied, np.bool_)), float(np.float32(one(norm, np.float32))),
            to_host(tn, np.float32), int(one(cnt_out, np.int64)))


def _problem(rng, rule, shapes, var_dt, grad_dt):
    row = core.rule_table()[rule]
    nslots = row["min_slots"]
    vars_ = [np.asarray(rng.normal(size=s)).astype(var_dt) for s in shapes]
    grads = [np.asarray(rng.normal(size=s)).astype(grad_dt) for s in shapes]
    slots = [[np.asarray(np.abs(rng.normal(size=reference.slot_shape(row, name, s))) + 0.1).astype(var_dt)
              for s in shapes] for name in row["slots"][:nslots]]
    table = core.hparam_table()
    names = row["hparams"]
    values = []
    hp = {}
    for name in names:
        disp = table[name]["display"]
        v = OVERRIDES.get(disp, table[name]["default"])
        values.append(v)
        if not np.isnan(v):
            hp[name] = v
    return vars_, grads, slots, values, hp


def _same_bits(got, want):
    want = np.asarray(want)
    got = np.asarray(got).reshape(want.shape)  # (a 0-d array travels as one element)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_same_bits(got, want)


RULES = list(core.rule_table())


@pytest.mark.parametrize("scratch", ["xla", "own", "legacy"])
@pytest.mark.parametrize("mode", ["none", "global_norm", "value", "norm"])
@pytest.mark.parametrize("rule", RULES)
def test_handler_matches_cpu_driver(rng, rule, mode, scratch):
    shapes = [(5,), (3, 4), (), (1000,)]
    var_dt, grad_dt = np.float32, np.float32
    vars_, grads, slots, values, hp = _problem(rng, rule, shapes, var_dt, grad_dt)
    clip = {"none": 0.0, "global_norm": 0.7, "norm": 0.4, "value": 0.3}[mode]
    # What the norm call hands every group: the global norm of all the gradients.
    use_norm = core.global_norm(grads)
    vars_d = [to_dev(v) for v in vars_]
    slots_d = [[to_dev(s) for s in sl] for sl in slots]
    grads_d = [to_dev(g) for g in grads]
    clipped = []
    err, applied, norm, tn, counter = call_handler(rule, vars_d, slots_d, grads_d,
                                                   values + [clip, use_norm], 4, shapes, var_dt,
                                                   grad_dt, mode, "skip", clipped_out=clipped,
                                                   scratch=scratch)
    assert err is None, err
    _same_bits(clipped[0], np.zeros(len(shapes), np.int64))  # no AGC: every count 0
    # The CPU driver, given the same counter (t = iterations + step).
    it = np.array([4], np.int64)
    want_norm, want_applied = core.clip_apply(rule, vars_, grads, slots, hp, mode, clip,
                                              iterations=it)
    assert applied and want_applied
    assert counter == 5 == int(it[0])
    assert norm == np.float32(want_norm)
    exact = mode != "norm" and rule != "lamb"  # (per-tensor sums in another order on the device)
    for d, want in zip([*vars_d, *[s for sl in slots_d for s in sl]], [*vars_, *[s for sl in slots for s in sl]]):
        got = to_host(d, var_dt)
        if exact:
            _same_bits(got, want)
        else:
            np.testing.assert_allclose(got.reshape(np.shape(want)), want, rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("scratch", ["xla", "own", "legacy"])
@pytest.mark.parametrize("mode", ["none", "global_norm", "value"])
def test_handler_grad_scale(rng, scratch, mode):
    """The loss-scale unscale as the last scalar (an op with grad_scale): the handler reads it on
    the device, and the step is the CPU driver's with that grad_scale."""
    shapes = [(5,), (3, 4), (), (1000,)]
    vars_, grads, slots, values, hp = _problem(rng, "adam", shapes, np.float32, np.float32)
    grads = [np.asarray(g * np.float32(2.0 ** 12)) for g in grads]
    clip = {"none": 0.0, "global_norm": 0.7, "value": 0.3}[mode]
    use_norm = core.global_norm(grads)  # (of the gradients as given: the step scales it)
    vars_d = [to_dev(v) for v in vars_]
    slots_d = [[to_dev(s) for s in sl] for sl in slots]
    err, applied, norm, tn, counter = call_handler("adam", vars_d, slots_d, [to_dev(g) for g in grads],
                                                   values + [clip, use_norm, 2.0 ** -12], 0, shapes,
                                                   np.float32, np.float32, mode, "skip", scratch=scratch)
    assert err is None, err
    want_norm, want_applied = core.clip_apply("adam", vars_, grads, slots, hp, mode, clip,
                                              iterations=np.array([0], np.int64), grad_scale=2.0 ** -12)
    assert applied and want_applied and norm == np.float32(want_norm)
    for d, want in zip([*vars_d, *[x for sl in slots_d for x in sl]], [*vars_, *[x for sl in slots for x in sl]]):
        _same_bits(to_host(d, np.float32), want)


@pytest.mark.parametrize("scratch", ["xla", "own", "legacy"])
@pytest.mark.parametrize("rule", ["adam", "sgd", "lamb"])
def test_handler_stochastic_rounding(rng, scratch, rule):
    """Stochastic rounding of bfloat16 variables (csrc/core/rounding.h): the scalars end with
    grad_scale, the seed, the step and the call's first variable's position in the op (a later
    group's call of an op with many variables); the handler reads them on the device, and the
    bits are the CPU driver's for the variables at those positions of one call."""
    shapes = [(5,), (3, 4), (), (1000,)]
    first = 5  # this call's variables are the op's 5..8
    vars_, grads, slots, values, hp = _problem(rng, rule, shapes, BF16, BF16)
    grads = [np.asarray(g * 0.01, BF16) for g in grads]
    use_norm = core.global_norm(grads)
    seed, step = 7 + 3 * 2 ** 32, 12.0
    vars_d = [to_dev(v) for v in vars_]
    slots_d = [[to_dev(x) for x in sl] for sl in slots]
    err, applied, _, _, _ = call_handler(rule, vars_d, slots_d, [to_dev(g) for g in grads],
                                         values + [0.5, use_norm, 1.0, float(seed), step, float(first)], 0,
                                         shapes, BF16, BF16, "global_norm", "skip", scratch=scratch)
    assert err is None and applied, err
    # The CPU driver with `first` leading variables that take no update (zero gradients, SGD:
    # their values stay), so the call's variables sit at the same positions.
    pad = [np.zeros((1,), BF16) for _ in range(first)]
    cv = pad + [v.copy() for v in vars_]
    cs = [[np.zeros((1,), BF16) for _ in range(first)] + [x.copy() for x in sl] for sl in slots]
    cg = [np.zeros((1,), BF16) for _ in range(first)] + grads
    core.clip_apply(rule, cv, cg, cs, hp, "global_norm", 0.5, use_norm=use_norm,
                    iterations=np.array([0], np.int64), rounding=(seed, step))
    for d, want in zip(vars_d, cv[first:]):
        _same_bits(to_host(d, BF16), want)


def test_handler_mixed_dtypes(rng):
    shapes = [(7,), (2, 3)]
    for var_dt, grad_dt in [(np.float32, BF16), (np.float32, np.float16), (np.float64, np.float64)]:
        vars_, grads, slots, values, hp = _problem(rng, "adam", shapes, var_dt, grad_dt)
        vars_d = [to_dev(v) for v in vars_]
        slots_d = [[to_dev(s) for s in sl] for sl in slots]
        grads_d = [to_dev(g) for g in grads]
        use_norm = core.global_norm(grads)
        err, applied, _, _, _ = call_handler("adam", vars_d, slots_d, grads_d, values + [1.0, use_norm],
                                             0, shapes, var_dt, grad_dt, "global_norm", "skip")
        assert err is None and applied, err
        core.clip_apply("adam", vars_, grads, slots, hp, "global_norm", 1.0, iterations=np.zeros(1, np.int64))
        for d, want in zip(vars_d, vars_):
            _same_bits(to_host(d, var_dt), want)


@pytest.mark.parametrize("scratch", ["xla", "own", "legacy"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_handler_nonfinite_writes_nothing(rng, policy, scratch):
    shapes = [(5,), (3,)]
    vars_, grads, slots, values, hp = _problem(rng, "adam", shapes, np.float32, np.float32)
    vars_d = [to_dev(v) for v in vars_]
    slots_d = [[to_dev(s) for s in sl] for sl in slots]
    grads_d = [to_dev(g) for g in grads]
    err, applied, norm, _, counter = call_handler("adam", vars_d, slots_d, grads_d,
                                                  values + [1.0, float("nan")], 2, shapes,
                                                  np.float32, np.float32, "global_norm", policy,
                                                  scratch=scratch)
    if policy == "raise":
        assert err is not None and "non-finite" in err and "nonfinite='raise'" in err, err
    else:
        assert err is None and applied is False and np.isnan(norm)
        assert counter == 2  # not advanced
    for d, want in zip([*vars_d, *[s for sl in slots_d for s in sl]], [*vars_, *[s for sl in slots for s in sl]]):
        _same_bits(to_host(d, np.float32), want)


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_handler_agc_clipped_units(rng, rule):
    """clip_mode agc through the CUDA handler: the variables, slots and each tensor's count of
    clipped units (the clipped_units result, counted on the device) are the CPU driver's."""
    shapes = [(), (7,), (6, 5), (3, 4, 5), (2, 3, 4, 6)]
    vars_, grads, slots, values, hp = _problem(rng, rule, shapes, np.float32, np.float32)
    grads = [np.asarray(g * (50.0 if i % 2 == 0 else 0.001), np.float32) for i, g in enumerate(grads)]
    vars_d = [to_dev(v) for v in vars_]
    slots_d = [[to_dev(s) for s in sl] for sl in slots]
    grads_d = [to_dev(g) for g in grads]
    eps = 2.0 ** -7
    clipped = []
    err, applied, _, _, _ = call_handler(rule, vars_d, slots_d, grads_d,
                                         values + [0.05, core.global_norm(grads)], 0, shapes, np.float32,
                                         np.float32, "agc", "skip", agc_eps=eps, clipped_out=clipped)
    assert err is None and applied, err
    want = np.full(len(shapes), -7, np.int64)
    core.clip_apply(rule, vars_, grads, slots, hp, "agc", 0.05, agc_eps=eps,
                    iterations=np.zeros(1, np.int64), agc_clipped_out=want)
    _same_bits(clipped[0], want)
    assert 0 < want.sum() < sum(1 if len(s) <= 1 else s[-1] for s in shapes)
    for d, w in zip([*vars_d, *[s for sl in slots_d for s in sl]], [*vars_, *[s for sl in slots for s in sl]]):
        _same_bits(to_host(d, np.float32), w)


@pytest.mark.parametrize("scratch", ["xla", "own", "legacy"])
@pytest.mark.parametrize("rule", ["adam", "rmsprop", "adagrad", "momentum"])
def test_handler_int8_state_matches_cpu_driver(rng, rule, scratch):
    """int8 state through the XLA CUDA handler (u8 codes, then their f32 absmax as more aliased
    state lists; custom_calls.h): the CPU driver's codes, absmax and variables, bit for bit (no
    clip: no norm summed in another order)."""
    import reference

    shapes = [(5,), (3, 100), (), (1000,)]
    vars_, grads, _, values, hp = _problem(rng, rule, shapes, np.float32, np.float32)
    unsigned = set(core.rule_table()[rule]["unsigned_slots"])
    names = core.rule_table()[rule]["slots"][:core.rule_table()[rule]["min_slots"]]
    codes, absmax = [], []
    for name in names:
        qs = [reference.quantize_blockwise(np.abs(rng.normal(size=s)).astype(np.float32) * 0.1 + 0.01,
                                           name not in unsigned) for s in shapes]
        codes.append([q.reshape(s) for (q, _), s in zip(qs, shapes)])
        absmax.append([a for _, a in qs])
    vars_d = [to_dev(v) for v in vars_]
    codes_d = [[to_dev(q) for q in lst] for lst in codes]
    absmax_d = [[to_dev(a) for a in lst] for lst in absmax]
    use_norm = core.global_norm(grads)
    err, applied, _, _, _ = call_handler(rule, vars_d, codes_d, [to_dev(g) for g in grads],
                                         values + [0.0, use_norm], 4, shapes, np.float32, np.float32,
                                         "none", "skip", scratch=scratch, absmax_d=absmax_d)
    assert err is None, err
    assert applied
    it = np.array([4], np.int64)
    core.clip_apply(rule, vars_, grads, codes, hp, "none", 0.0, None, "skip", iterations=it, absmax=absmax)
    for got, want in zip(vars_d, vars_):
        _same_bits(to_host(got, np.float32), want)
    for lst_d, lst in zip(codes_d + absmax_d, codes + absmax):
        for got, want in zip(lst_d, lst):
            _same_bits(to_host(got, want.dtype), want)
