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


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


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


# ---------------------------------------------------------------- short failure messages for buffers
# The suites compare raw buffers (`a.tobytes() == b.tobytes()`, lists of them). On a failure,
# pytest's own explanation diffs the reprs with difflib, which is quadratic in their length: a
# planted fault (scripts/planted_faults.sh) once left one such comparison of six 256 KiB buffers
# computing its message for over an hour in CI. For bytes, and lists or tuples of bytes, past a
# small size this hook says instead which buffers differ and where.
_SHORT = 512


def _first_difference(a, b):
    n = min(len(a), len(b))
    a8, b8 = np.frombuffer(a[:n], np.uint8), np.frombuffer(b[:n], np.uint8)
    diff = np.flatnonzero(a8 != b8)
    where = int(diff[0]) if diff.size else n
    return (f"{len(a)} vs {len(b)} bytes, {int(diff.size)} of the first {n} differ, the first at byte {where}"
            f" ({a[where:where + 8].hex() or 'end'} vs {b[where:where + 8].hex() or 'end'})")


def _buffers(x):
    if isinstance(x, (bytes, bytearray)):
        return None
    if isinstance(x, (list, tuple)) and x and all(isinstance(e, (bytes, bytearray)) for e in x):
        return list(x)
    return False


def pytest_assertrepr_compare(config, op, left, right):
    if op != "==":
        return None
    lb, rb = _buffers(left), _buffers(right)
    if lb is None and rb is None:  # two bytes objects
        if max(len(left), len(right)) <= _SHORT:
            return None
        return [f"two buffers differ: {_first_difference(left, right)}"]
    if lb and rb:
        if sum(map(len, lb)) + sum(map(len, rb)) <= _SHORT:
            return None
        lines = [f"lists of {len(lb)} and {len(rb)} buffers differ"]
        for i, (a, b) in enumerate(zip(lb, rb)):
            if a != b:
                lines.append(f"  [{i}]: {_first_difference(a, b)}")
        return lines
    return None
