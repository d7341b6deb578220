"""python -m tfclip.info: the bug-report printout, checked against what the build and this
process really have (tfclip/_build_info.py, TensorFlow, tfclip._core)."""
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tfclip
import tfclip.info
from tfclip import _build_info, _core, _loader


def _report(cwd):
    # The tfclip this test imported (installed, or an in-place build), from another folder: `-m`
    # puts the working directory first on sys.path, where a source checkout's unbuilt tfclip/
    # would shadow the installed one.
    root = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "tfclip.info"], capture_output=True, text=True,
                         timeout=300, check=True, cwd=cwd, env=env).stdout
    rows = {}
    for line in out.splitlines():
        label, _, text = line.partition("  ")
        rows[label.strip()] = text.strip()
    return out, rows


def test_report_says_what_was_built_and_what_runs(tmp_path):
    out, rows = _report(tmp_path)
    assert "ERROR" not in out, out
    assert rows["TensorFlow"].startswith(tf.__version__) and "MISMATCH" not in rows["TensorFlow"]
    assert rows["built for"].startswith(f"TensorFlow {_build_info.TF_VERSION};")
    assert rows["op library"].endswith("_tfclip_ops.so (loads)")
    assert rows["XLA kernels"].startswith("built, registered" if _loader.xla_kernels() else "not built: ")
    if _build_info.CUDA:
        assert _build_info.CUDA_TARGETS and _build_info.CUDA_TARGETS in rows["CUDA kernels"]
        driver, runtime = _core.cuda_versions()
        assert rows["CUDA here"].startswith(f"runtime {runtime // 1000}.{runtime % 1000 // 10}")
    else:
        assert rows["CUDA kernels"].startswith("not built")
    assert f"variant in use: {_core.cpu_isa()} " in rows["CPU"]
    gpus = tf.config.list_physical_devices("GPU")
    assert (rows["GPUs TF sees"] == "none") == (not gpus)
    for label in ("tfclip", "Python", "Keras", "tensorboard"):
        assert rows[label], label


def test_a_failing_probe_is_reported_and_the_rest_goes_on(monkeypatch):
    def broken():
        raise RuntimeError("no driver for you")

    monkeypatch.setattr(_core, "cpu_isa", broken)
    rows = dict(tfclip.info.collect())
    assert rows["CPU"] == "ERROR: RuntimeError: no driver for you"
    assert rows["TensorFlow"].startswith(tf.__version__)


def test_a_tensorflow_mismatch_is_named_with_the_rebuild_command(monkeypatch):
    monkeypatch.setattr(_build_info, "TF_VERSION", "2.0.0")
    rows = dict(tfclip.info.collect())
    assert "MISMATCH: tfclip was built for 2.0.0" in rows["TensorFlow"]
    assert "pip install --force-reinstall --no-deps ." in rows["TensorFlow"]


def test_memory_pages_line_reads_this_machines_setting():
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    text = dict(tfclip.info.collect())["memory pages"]
    if not os.path.exists(path):
        assert text == "transparent huge pages: not on this system"
    else:
        with open(path) as f:
            assert text.startswith("transparent huge pages: " + f.read().split("[")[1].split("]")[0])


@pytest.mark.parametrize("setting,tunables,libc,want", [
    # The kernel gives huge pages unasked, or never: nothing to ask for.
    ("[always] madvise never\n", "", ("glibc", "2.36"), "transparent huge pages: always"),
    ("always madvise [never]\n", "glibc.malloc.hugetlb=1", ("glibc", "2.36"), "transparent huge pages: never"),
    # Only on request: who can ask, and whether anyone does.
    ("always [madvise] never\n", "", ("glibc", "2.36"),
     "transparent huge pages: madvise, not asked for: TF's tensors on 4 KB pages "
     "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1 asks; docs/benchmarks.md)"),
    ("always [madvise] never\n", "glibc.malloc.check=0:glibc.malloc.hugetlb=1", ("glibc", "2.35"),
     "transparent huge pages: madvise; GLIBC_TUNABLES asks for them"),
    ("always [madvise] never\n", "", ("glibc", "2.31"),
     "transparent huge pages: madvise, not asked for: TF's tensors on 4 KB pages "
     "(glibc 2.31 cannot ask; 2.35 has GLIBC_TUNABLES=glibc.malloc.hugetlb=1; docs/benchmarks.md)"),
    ("always [madvise] never\n", "glibc.malloc.hugetlb=1", ("glibc", "2.31"),
     "transparent huge pages: madvise; GLIBC_TUNABLES is set, but glibc 2.31 cannot ask; "
     "2.35 has GLIBC_TUNABLES=glibc.malloc.hugetlb=1"),
    ("always [madvise] never\n", "glibc.malloc.hugetlb=1", ("", ""),
     "transparent huge pages: madvise; GLIBC_TUNABLES is set, but this C library is not glibc: "
     "GLIBC_TUNABLES cannot ask"),
])
def test_memory_pages_line(setting, tunables, libc, want):
    assert tfclip.info.pages_line(setting, tunables, libc) == want
