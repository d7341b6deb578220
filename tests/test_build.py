"""The build records what it was made for; a TF mismatch is an ImportError saying how to rebuild."""
import pytest
import tensorflow as tf

from tfclip import _build_info, _loader


def test_build_records_the_tf_version():
    assert _build_info.TF_VERSION == tf.__version__
    assert isinstance(_build_info.CUDA, bool)


def test_tf_version_mismatch_is_an_import_error(monkeypatch):
    monkeypatch.setattr(_build_info, "TF_VERSION", "2.0.0")
    with pytest.raises(ImportError, match=r"built for TensorFlow 2\.0\.0 but TensorFlow .* is installed.*Rebuild"):
        _loader.load_op_library()


def test_core_only_build_is_an_import_error_for_the_ops(monkeypatch):
    monkeypatch.setattr(_build_info, "TF_VERSION", "")
    with pytest.raises(ImportError, match="no TensorFlow"):
        _loader.load_op_library()


OPS = ["TfclipGlobalNorm", "TfclipClipByGlobalNorm", "TfclipClipApplySgd", "TfclipClipApplyMomentum",
       "TfclipClipApplyKerasMomentum", "TfclipClipApplyAdam"]


def _devices(op):
    from tensorflow.python.framework import kernels
    _loader.ops()
    return {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_a_cpu_kernel_and_a_gpu_kernel_when_built_with_cuda(op):
    devices = _devices(op)
    assert "CPU" in devices
    assert ("GPU" in devices) == _build_info.CUDA, (
        f"{op}: GPU kernel registered={('GPU' in devices)} but the build says CUDA={_build_info.CUDA}")


def test_cuda_build_records_nvcc_and_core_agrees():
    from tfclip import _core
    assert _core.cuda == _build_info.CUDA
    if _build_info.CUDA:
        assert _build_info.NVCC_VERSION.split(".")[0].isdigit()


def test_core_cuda_entry_points_reject_host_arrays_before_touching_a_device():
    """Argument checks run before any CUDA call, so they hold on CPU-only machines too."""
    import numpy as np

    from tfclip import _core
    if not _core.cuda:
        pytest.skip("tfclip._core was built without CUDA (no toolkit at build time)")
    a = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"t_list\[0\] has no __cuda_array_interface__"):
        _core.cuda_global_norm([a])
    with pytest.raises(ValueError, match=r"vars\[0\] has no __cuda_array_interface__"):
        _core.cuda_clip_apply("sgd", [a], [a], [], {"learning_rate": 0.1})
    with pytest.raises(ValueError, match="unknown rule 'no_such_rule'"):
        _core.cuda_clip_apply("no_such_rule", [a], [a], [], {})


# ---------------------------------------------------------------- the CPU variants' machine code
# The CPU passes are compiled for baseline x86-64 and AVX2 (and the norm pass for AVX-512) and
# picked at run time.
# Two ways this breaks silently, each seen once: (1) a helper shared by the variants is compiled
# with AVX flags and the linker keeps that copy for everyone, so a CPU without AVX dies of SIGILL
# in baseline code; (2) a variant's loop calls an out-of-line copy of the update rule per element
# instead of inlining and vectorizing it (6-10 ns instead of ~1 ns per Adam element). Both show
# in the disassembly, which these tests read.
_AVX_NS = ("tfclip::isa_avx2::", "tfclip::isa_avx512::")


def _functions(path):
    import platform
    import re
    import shutil
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the ISA variants exist on x86-64 only; this is {platform.machine()}")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not on PATH; it reads the machine code checked here")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", path], check=True,
                          capture_output=True, text=True).stdout
    funcs = {}
    for block in re.split(r"\n(?=[0-9a-f]+ <)", text):
        head = re.match(r"[0-9a-f]+ <(.*)>:", block)
        if head:
            funcs.setdefault(head.group(1), []).extend(block.split("\n")[1:])
    if not any("tfclip::isa_baseline::" in name for name in funcs):
        pytest.skip(f"{path} has no symbols (stripped); pyproject.toml keeps them for this check")
    return funcs


def _modules():
    import os

    from tfclip import _core
    paths = [_core.__file__]
    if _build_info.TF_VERSION:
        paths.append(os.path.join(os.path.dirname(_core.__file__), "_tfclip_ops.so"))
    return paths


def _is_vex(line):
    import re
    m = re.search(r"\t(v[a-z0-9]+)\s+(.*)", line)
    return bool(m) and (m.group(1) == "vzeroupper" or re.search(r"%[xyz]mm", m.group(2)) is not None)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_only_the_avx_variants_hold_avx_instructions(path):
    funcs = _functions(path)
    offenders = [name for name, body in funcs.items()
                 if not any(ns in name for ns in _AVX_NS) and any(_is_vex(line) for line in body)]
    assert not offenders, f"AVX code outside the AVX variants (a CPU without AVX would crash): {offenders[:5]}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_each_variant_vectorizes_the_adam_step(path):
    funcs = _functions(path)

    def apply_code(ns):
        # The dense pass, Apply, and its chunk and loop templates for Adam, wherever the compiler
        # left them (inlined into Apply, or out of line once Apply grew: the AVX2 variant's
        # ApplyChunk<AdamRule, ...> since Lamb's instantiations; ApplyLoopInPlace<AdamRule, ...>,
        # the in-place loop that ApplyChunk and the bf16-state chunk share).
        adam = ("ApplyChunk<tfclip::AdamRule", "ApplyLoop<tfclip::AdamRule", "ApplyLoopInPlace<tfclip::AdamRule")
        return "\n".join("\n".join(body) for name, body in funcs.items()
                         if f"{ns}Apply(" in name or (ns in name and any(a in name for a in adam)))

    # Adam's sqrt, packed at each variant's width: SSE xmm, AVX2 ymm. The AVX-512 variant has
    # no apply pass of its own (csrc/core/isa/avx512.cc: it runs AVX2's).
    assert "\tsqrtps " in apply_code("tfclip::isa_baseline::")
    assert any("vsqrtps" in l and "%ymm" in l for l in apply_code("tfclip::isa_avx2::").split("\n"))
    assert not apply_code("tfclip::isa_avx512::")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_the_avx512_norm_pass_uses_512_bit_vectors(path):
    # What the AVX-512 variant is for: the norm pass at 512 bits (16-bit gradients: 4.4 ms
    # against AVX2's 6.4, benchmarks/NOTES.md section 8).
    funcs = _functions(path)
    code = [line for name, body in funcs.items()
            if "tfclip::isa_avx512::" in name and ("SumSquares" in name or "AddSquares" in name)
            for line in body]
    assert code, "no AVX-512 norm pass in the module"
    assert any("%zmm" in line for line in code)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_avx_variants_convert_float16_with_f16c(path):
    funcs = _functions(path)
    for ns in _AVX_NS:
        code = [line for name, body in funcs.items() if ns in name for line in body]
        assert any("vcvtph2ps" in line for line in code), ns  # widening: the norm and apply passes
        if ns != "tfclip::isa_avx512::":  # rounding back: the apply pass (AVX2's in the AVX-512 variant)
            assert any("vcvtps2ph" in line for line in code), ns


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_the_int8_state_tiles_do_not_gather(path):
    # Issue 69: int8 state's code from its formula (quant8.h), not looked up through memory:
    # no gather instruction in any variant's state tiles (on AMD's Zen cores gathers made the
    # int8 step 4x the float32-state step), and the AVX2 tiles vectorized at 256 bits.
    funcs = _functions(path)
    tiles = {name: body for name, body in funcs.items()
             if "::isa_" in name and ("Q8NarrowTile" in name or "Q8WidenTile" in name
                                      or "NearestCode8" in name or "CodeValue8" in name)}
    assert any("isa_avx2::Q8NarrowTile" in name for name in tiles), sorted(tiles)[:5]
    gathers = [name for name, body in tiles.items() if any("gather" in line for line in body)]
    assert not gathers, f"gathers in the int8 state tiles: {gathers}"
    avx2 = [line for name, body in tiles.items() if "isa_avx2::" in name for line in body]
    assert any("vdivps" in line and "%ymm" in line for line in avx2)
    assert any("vpermps" in line for line in avx2)


# ---------------------------------------------------------------- a statically linked libstdc++
# A toolchain that links libstdc++ into a module (the lent H100 host's g++ 13 in /opt/gcc did)
# must keep that copy's symbols local: exported, they bound to the libstdc++.so that numpy and
# torch had loaded, the two copies' locale facets mixed, and every _core call crashed in an
# ostringstream (benchmarks/NOTES.md 30). CMakeLists.txt's tfclip_local_libstdcxx passes the
# linker option below to every module.
_LIBSTDCXX_INTERNALS = ("std::locale::", "std::ios_base::")


def _exported(path):
    import shutil
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH; it lists the symbols checked here")
    out = subprocess.run([nm, "-D", "-C", "--defined-only", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(k in line for k in _LIBSTDCXX_INTERNALS)]


def test_the_link_option_keeps_a_static_libstdcxx_local(tmp_path):
    """The option CMakeLists.txt gives every module, on a shared object that links libstdc++
    statically: without it the copy's locale machinery is exported, with it none of it is."""
    import os
    import platform
    import re
    import shutil
    import subprocess

    if platform.system() != "Linux":
        pytest.skip(f"the option is GNU ld's, used on Linux only; this is {platform.system()}")
    cmake = open(os.path.join(os.path.dirname(__file__), "..", "CMakeLists.txt")).read()
    opt = re.search(r'"LINKER:(--exclude-libs,[^"]+)"', cmake)
    assert opt, "CMakeLists.txt no longer passes --exclude-libs for a static libstdc++"
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH to link the two test objects")
    src = tmp_path / "s.cc"
    src.write_text("#include <sstream>\n#include <string>\n"
                   "std::string f(unsigned long i) { std::ostringstream os; os << i; return os.str(); }\n")
    base = [cxx, "-fPIC", "-shared", "-static-libstdc++", str(src)]
    r = subprocess.run(base + ["-o", str(tmp_path / "plain.so")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"this toolchain cannot link libstdc++ statically (no libstdc++.a): {r.stderr[-300:]}")
    subprocess.run(base + ["-Wl," + opt.group(1), "-o", str(tmp_path / "local.so")], check=True)
    assert _exported(tmp_path / "plain.so"), "the check itself: a static libstdc++ exports its locale"
    assert _exported(tmp_path / "local.so") == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.rsplit("/", 1)[-1].split(".")[0])
def test_modules_export_no_libstdcxx_internals(path):
    assert _exported(path) == []


def test_cuda_driver_older_than_the_runtime_built_in_is_named_with_the_fix():
    gpus = lambda: ["GPU:0"]  # noqa: E731
    msg = _loader.cuda_driver_problem(12040, 13000, gpus)
    assert "built with CUDA 13.0" in msg and "supports CUDA 12.4" in msg
    assert "-DCMAKE_CUDA_COMPILER=/usr/local/cuda-12/bin/nvcc" in msg and "pip install --force-reinstall" in msg
    # Fine: no driver, a driver of the same major (minor-version compatibility) or newer, no GPU.
    assert _loader.cuda_driver_problem(0, 13000, gpus) is None
    assert _loader.cuda_driver_problem(13000, 13020, gpus) is None
    assert _loader.cuda_driver_problem(13020, 12050, gpus) is None
    assert _loader.cuda_driver_problem(12040, 13000, lambda: []) is None


def test_load_refuses_a_gpu_with_a_too_old_driver_and_loads_without_a_driver(monkeypatch):
    monkeypatch.setattr(_build_info, "CUDA", True)
    monkeypatch.setattr(_loader, "_visible_gpus", lambda: ["GPU:0"])
    monkeypatch.setattr(_loader, "_cuda_versions", lambda: (12020, 13000))
    with pytest.raises(ImportError, match=r"supports CUDA 12\.2.*cuda-12/bin/nvcc"):
        _loader.load_op_library()
    monkeypatch.setattr(_loader, "_cuda_versions", lambda: (0, 13000))  # a machine without a driver
    assert _loader.load_op_library() is not None


@pytest.mark.skipif(not _build_info.CUDA, reason="this build has no CUDA entry points to ask")
def test_this_machine_reports_its_real_driver_and_runtime():
    from tfclip import _core

    driver, runtime = _core.cuda_versions()
    assert runtime // 1000 == int(_build_info.NVCC_VERSION.split(".")[0])
    assert driver >= 0
    assert _loader.cuda_driver_problem(driver, runtime, _loader._visible_gpus) is None


def test_core_imports_without_tensorflow(tmp_path):
    """A GPU test host has tfclip._core and no TensorFlow: `from tfclip import _core` (as
    benchmarks/gpu_bench.py does) must work there, and the TF API must say what is missing."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "from tfclip import _core\n"
        "assert _core.global_norm\n"
        "import tfclip\n"
        "try:\n"
        "    tfclip.fused_clip_apply\n"
        "except ImportError as e:\n"
        "    assert 'needs TensorFlow' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    root = os.path.dirname(os.path.dirname(tfclip_path()))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr


def tfclip_path():
    import tfclip

    return tfclip.__file__


def test_required_gpu_suite_fails_instead_of_skipping_where_it_cannot_run(tmp_path):
    """TFCLIP_REQUIRE_GPU=1 turns the CUDA suite's skips into failures: on this build (no
    device, or no CUDA at all) it must fail and say why, never pass as 'skipped'."""
    import os
    import subprocess
    import sys

    from tfclip import _core

    if _core.cuda and not _core.cuda_emulated:
        try:
            _core.cuda_device()
            pytest.skip("a GPU is present: there the suite runs for real")
        except RuntimeError:
            pass
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TFCLIP_REQUIRE_GPU="1")
    env.pop("TFCLIP_CORE_MODULE", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(tests, "gpu")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "TFCLIP_REQUIRE_GPU=1 but the CUDA suite cannot run" in r.stdout + r.stderr
