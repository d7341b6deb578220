"""The core's per-element apply and dispatch, checked at the header level with rules that exist
only in the test (tests/cpp/apply_elem_test.cc): a new 2- or 3-slot rule gets its own slot count
on every path (DispatchSlots is the one every CPU and CUDA pass uses), never a fallback."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_apply_elem_and_slot_dispatch(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (g++) found; the core's header checks need one")
    exe = tmp_path / "apply_elem_test"
    srcs = [os.path.join(ROOT, "tests", "cpp", "apply_elem_test.cc")] + [
        os.path.join(ROOT, "csrc", "core", f) for f in ("rule_table.cc", "types.cc", "hparams.cc")]
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-ffp-contract=off",
                            "-I", ROOT, *srcs, "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "all checks held" in run.stdout
