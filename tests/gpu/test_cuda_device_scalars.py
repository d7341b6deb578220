"""Hyper-parameters, clip numbers and the step counter read where the variables live.

On a GPU a learning-rate schedule's value, Keras's step counter and an all-reduced norm are
computed on the device; the step reads them there (the CUDA finalize kernel), so no host copy
and no wait stands before the launches. Through tfclip._core these are 1-element device arrays.
Also here: the core releases a step's workspace on every path, a failed launch included.
"""
import math
import os

import numpy as np
import pytest

from gpu_arrays import EMULATED, assert_same_bits, core, to_dev, to_host

SHAPES = [(5000,), (7, 3), (1,)]
# rule: (slot count, hyper-parameters by their rule-table names, flags)
RULES = {
    "sgd": (0, {"lr": 0.1, "weight_decay": 0.01}, {}),
    "momentum": (1, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}, {"nesterov": True}),
    "keras_momentum": (1, {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.02}, {}),
    "adam": (3, {"lr": 0.01, "beta_1": 0.85, "beta_2": 0.99, "epsilon": 1e-6, "weight_decay": 0.004,
                 "step": 3.0}, {"amsgrad": True}),
    # TF1's AdagradDA: its global step (a device value under a TF graph) read on the device too.
    "adagrad_da": (2, {"lr": 0.05, "l1": 0.02, "l2": 0.2, "global_step": 6.0}, {}),
}


def scalar(x, dtype=np.float64):
    return to_dev(np.array([x], dtype))


def state(rng, nslots):
    vars_ = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    slots = [[np.abs(rng.normal(size=s)).astype(np.float32) * 0.1 for s in SHAPES] for _ in range(nslots)]
    return vars_, slots


def on_device(vars_, slots):
    return [to_dev(v) for v in vars_], [[to_dev(x) for x in sl] for sl in slots]


def host(vars_d, slots_d):
    return [to_host(v, np.float32) for v in vars_d] + [to_host(x, np.float32) for sl in slots_d for x in sl]


def match(got, want, rule):
    for g, w in zip(got, want):
        if EMULATED or rule != "adam":
            # The step constants are the same casts (and, emulated, the same pow) either way.
            assert_same_bits(g, w)
        else:
            # On a GPU Adam's beta^t is the device's pow: within an ulp of the host's.
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_device_scalars_give_the_host_values_result(rng, rule, sparse):
    """Every hyper-parameter, the clip and use_norm as device arrays: the same update as the
    same numbers given on the host (dense and IndexedSlices)."""
    nslots, hp, flags = RULES[rule]
    vars_, slots = state(rng, nslots)
    grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    indices = None
    if sparse:
        indices = [np.array([2, 0, 2, 4], np.int64), None, None]
        grads[0] = rng.normal(size=(4,)).astype(np.float32)
        vars_[0] = vars_[0][:5].copy()
        slots = [[sl[0][:5].copy(), *sl[1:]] for sl in slots]
    a_vars, a_slots = on_device(vars_, slots)
    b_vars, b_slots = on_device(vars_, slots)
    gd = [to_dev(g) for g in grads]
    for _ in range(2):
        core.cuda_clip_apply(rule, a_vars, gd, a_slots, {**hp, **flags}, "global_norm", 0.7, 3.0,
                             "skip", indices)
        dev_hp = {k: scalar(v) for k, v in hp.items()}
        core.cuda_clip_apply(rule, b_vars, gd, b_slots, {**dev_hp, **flags}, "global_norm",
                             scalar(0.7), scalar(3.0), "skip", indices)
    match(host(b_vars, b_slots), host(a_vars, a_slots), rule)


def test_device_step_counter_counts_applied_steps_only(rng):
    """iterations, a device int64 counter: Adam's t = iterations + step, and the finalize kernel
    advances it only for an applied step (a skipped non-finite step leaves it)."""
    nslots, hp, flags = RULES["adam"]
    vars_, slots = state(rng, nslots)
    grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    a_vars, a_slots = on_device(vars_, slots)
    b_vars, b_slots = on_device(vars_, slots)
    gd = [to_dev(g) for g in grads]
    counter = scalar(4, np.int64)
    core.cuda_clip_apply("adam", a_vars, gd, a_slots, {**hp, **flags, "step": 5.0}, "value", 0.5)
    core.cuda_clip_apply("adam", b_vars, gd, b_slots, {**hp, **flags, "step": 1.0}, "value", 0.5,
                         iterations=counter)
    match(host(b_vars, b_slots), host(a_vars, a_slots), "adam")
    assert to_host(counter, np.int64)[0] == 5
    bad = [g.copy() for g in grads]
    bad[1][0, 0] = np.inf
    before = host(b_vars, b_slots)
    norm, applied = core.cuda_clip_apply("adam", b_vars, [to_dev(g) for g in bad], b_slots,
                                         {**hp, **flags, "step": 1.0}, "global_norm", 1.0,
                                         iterations=counter)
    assert not applied and math.isinf(norm)
    assert to_host(counter, np.int64)[0] == 5
    for g, w in zip(host(b_vars, b_slots), before):
        assert_same_bits(g, w)


@pytest.mark.parametrize("what,value,pattern", [
    ("lr", float("inf"), r"learning_rate must be finite, got inf"),
    ("beta_1", float("-inf"), r"beta_1 must be finite, got -inf"),
    ("epsilon", float("nan"), r"epsilon must be finite"),
    ("step", 0.5, r"step must be finite and in \[1, inf\], got 0.5"),
    ("clip", -2.0, r"global_clipnorm must be finite and >= 0 \(0: no clip\), got -2"),
    ("use_norm", -1.0, r"use_norm must be >= 0"),
])
def test_bad_device_value_writes_nothing(rng, what, value, pattern):
    """A value read on the device out of its range: nothing is written and applied is False;
    with nonfinite='raise' (the one call that waits) it is an error naming the value."""
    nslots, hp, flags = RULES["adam"]
    vars_, slots = state(rng, nslots)
    vd, sd = on_device(vars_, slots)
    gd = [to_dev(rng.normal(size=s).astype(np.float32)) for s in SHAPES]
    before = host(vd, sd)
    kw = {"clip": 1.0, "use_norm": None}
    hps = {**hp, **flags}
    if what in kw:
        kw[what] = scalar(value)
    else:
        hps[what] = scalar(value)
    norm, applied = core.cuda_clip_apply("adam", vd, gd, sd, hps, "global_norm", kw["clip"],
                                         kw["use_norm"], "skip")
    assert not applied
    with pytest.raises(ValueError, match=pattern + r".*\(read on the device\); no variable was updated"):
        core.cuda_clip_apply("adam", vd, gd, sd, hps, "global_norm", kw["clip"], kw["use_norm"], "raise")
    for g, w in zip(host(vd, sd), before):
        assert_same_bits(g, w)


def test_device_scalar_must_be_one_float64(rng):
    vd, sd = on_device(*state(rng, 0))
    gd = [to_dev(np.ones(s, np.float32)) for s in SHAPES]
    with pytest.raises(ValueError, match=r"hparams\['lr'\] must be a 1-element float64 device array"):
        core.cuda_clip_apply("sgd", vd, gd, [], {"lr": to_dev(np.array([0.1], np.float32))})
    with pytest.raises(ValueError, match=r"hparams\['lr'\] must be a 1-element float64"):
        core.cuda_clip_apply("sgd", vd, gd, [], {"lr": to_dev(np.array([0.1, 0.2]))})
    with pytest.raises(ValueError, match="iterations must be a 1-element int64 device array"):
        core.cuda_clip_apply("sgd", vd, gd, [], {"lr": 0.1}, iterations=scalar(1.0))
    with pytest.raises(ValueError, match="rule 'sgd' takes no hyper-parameter 'beta_1'"):
        core.cuda_clip_apply("sgd", vd, gd, [], {"lr": 0.1, "beta_1": 0.9})


@pytest.mark.emulation_only
@pytest.mark.parametrize("kernel", ["NormKernel", "FinalizeKernel", "apply_kernel", "sparse_apply_kernel"])
def test_failed_launch_releases_the_workspace_and_writes_nothing(rng, monkeypatch, kernel):
    """A launch that fails after the tensor table's upload was queued: the error is reported,
    nothing is written, and the core still hands the step's memory back in stream order (the
    pinned host table must outlive its pending copy; the TF glue had leaked it to an early return).
    The emulation fails the launch on request (TFCLIP_EMU_FAIL_LAUNCH)."""
    if not EMULATED:
        pytest.skip("fault injection is the emulation's (TFCLIP_EMU_FAIL_LAUNCH)")
    nslots, hp, flags = RULES["adam"]
    vars_, slots = state(rng, nslots)
    vd, sd = on_device(vars_, slots)
    g0 = rng.normal(size=(4,)).astype(np.float32)
    grads = [to_dev(g0)] + [to_dev(rng.normal(size=s).astype(np.float32)) for s in SHAPES[1:]]
    indices = [np.array([1, 3, 1, 0], np.int64), None, None]
    before = host(vd, sd)
    monkeypatch.setenv("TFCLIP_EMU_FAIL_LAUNCH", kernel)
    with pytest.raises(RuntimeError, match="CUDA error in the .*kernel"):
        core.cuda_clip_apply("adam", vd, grads, sd, {**hp, **flags}, "global_norm", 1.0, None, "skip",
                             indices)
    assert not core.cuda_workspace_held()
    monkeypatch.delenv("TFCLIP_EMU_FAIL_LAUNCH")
    core.cuda_synchronize()
    if kernel in ("NormKernel", "FinalizeKernel"):  # nothing after the failed launch ran
        for g, w in zip(host(vd, sd), before):
            assert_same_bits(g, w)
    # The next step runs normally.
    norm, applied = core.cuda_clip_apply("adam", vd, grads, sd, {**hp, **flags}, "global_norm", 1.0,
                                         None, "skip", indices)
    assert applied and norm > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_op_reads_clip_norm_and_use_norm_on_the_device(rng, dtype):
    """tf.clip_by_global_norm's op: clip_norm and use_norm (an all-reduced norm lives on the GPU)
    read on the device give the host-value result; a bad clip_norm there makes every output NaN."""
    ts = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    ins = [to_dev(t) for t in ts]
    a = [to_dev(np.zeros_like(t)) for t in ts]
    b = [to_dev(np.zeros_like(t)) for t in ts]
    for use_norm in (None, 3.5):
        na = core.cuda_clip_by_global_norm(ins, a, 0.5, use_norm)
        nb = core.cuda_clip_by_global_norm(ins, b, scalar(0.5, dtype),
                                           None if use_norm is None else scalar(use_norm, dtype))
        assert na == nb
        for x, y in zip(a, b):
            assert_same_bits(to_host(x, np.float32), to_host(y, np.float32))
    core.cuda_clip_by_global_norm(ins, b, scalar(-1.0, dtype))
    assert all(np.isnan(to_host(y, np.float32)).all() for y in b)
    with pytest.raises(ValueError, match="clip_norm and use_norm on the device must have one dtype"):
        core.cuda_clip_by_global_norm(ins, b, scalar(0.5, np.float32), scalar(1.0, np.float64))
