"""The CUDA parity suite cannot skip silently where it is required to run.

With TFCLIP_REQUIRE_GPU=1 (CI's emulated run, GPU hosts) a skipped test is reported as a
failure, except a test marked `gpu_only` on the emulated build (the >2^31-element case, which
the emulation cannot hold in reasonable time and memory).
"""
import os

import pytest

REQUIRE = os.environ.get("TFCLIP_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: needs a real GPU (skipped on the emulated build)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (REQUIRE and rep.skipped):
        return
    if item.get_closest_marker("gpu_only") is not None and getattr(item.module, "EMULATED", False):
        return
    rep.outcome = "failed"
    rep.longrepr = f"TFCLIP_REQUIRE_GPU=1, and this test was skipped: {rep.longrepr}"
