import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

# Tolerances by dtype name: (rtol, atol).
TOL = {
    "float64": (1e-12, 1e-12),
    "float32": (2e-6, 1e-6),
    "float16": (2e-3, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def assert_close(actual, expected, dtype_name, scale=1.0):
    rtol, atol = TOL[dtype_name]
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
        rtol=rtol * scale, atol=atol * scale)


# Keras 3, where this TensorFlow has it (TF 2.15 has Keras 2): `keras` (None without it) and the
# mark for the tests that need it, so a file with other tests keeps them where Keras 3 is missing.
try:
    import keras
    if int(keras.__version__.split(".")[0]) < 3:
        keras = None
except ImportError:
    keras = None
keras3 = pytest.mark.skipif(keras is None, reason="tfclip.keras needs Keras 3")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def folded_steps(monkeypatch):
    """A list that gets an entry each time a LossScaleOptimizer builds a step with its unscale
    folded in (tfclip._engine.loss_scale.with_loss_scale): the fold ran, not the stock passes."""
    from tfclip._engine import loss_scale as _loss_scale

    calls, real = [], _loss_scale.with_loss_scale
    monkeypatch.setattr(_loss_scale, "with_loss_scale", lambda *a: calls.append(1) or real(*a))
    return calls


# ---------------------------------------------------------------- tests/gpu: no silent skips
# The CUDA parity suite cannot skip silently where it is required to run: with
# TFCLIP_REQUIRE_GPU=1 (CI's emulated run, GPU hosts) a skipped test there is a failure, except
# one marked `gpu_only` on the emulated build (the >2^31-element case), or `emulation_only` on a
# real GPU (fault injection, which only the emulation offers).
_REQUIRE_GPU = os.environ.get("TFCLIP_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: needs a real GPU (skipped on the emulated build)")
    config.addinivalue_line("markers", "emulation_only: needs the CUDA emulation (skipped on a real GPU)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (_REQUIRE_GPU and rep.skipped and os.sep + "gpu" + os.sep in str(item.fspath)):
        return
    emulated = getattr(item.module, "EMULATED", None)
    if item.get_closest_marker("gpu_only") is not None and emulated is True:
        return
    if item.get_closest_marker("emulation_only") is not None and emulated is False:
        return
    rep.outcome = "failed"
    rep.longrepr = f"TFCLIP_REQUIRE_GPU=1, and this test was skipped: {rep.longrepr}"

