"""What this tfclip build is and what it finds on this machine: paste it into a bug report.

    python -m tfclip.info        (or the `tfclip-info` script)

Every line is one probe; a probe that fails prints its error instead of stopping the report, so a
broken install (a TensorFlow other than the one tfclip was built for, a missing library, a driver
too old) still reports everything else.
"""
import importlib
import importlib.metadata
import os
import platform
import sys


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fmt_cuda(v):
    return f"{v // 1000}.{v % 1000 // 10}"


def _build_info():
    try:
        return importlib.import_module("tfclip._build_info")
    except ImportError:
        return None


def pages_line(thp_setting, tunables, libc):
    """The "memory pages" line from the kernel's THP setting (the text of
    /sys/kernel/mm/transparent_hugepage/enabled, the chosen mode in brackets), GLIBC_TUNABLES and
    platform.libc_ver(). Where the kernel gives huge pages only on request ("madvise"), TF's CPU
    allocator never asks, and its large tensors sit on 4 KB pages: a memory-bound CPU step (tfclip's,
    any op's) ran 1.2x slower on the development machine (docs/benchmarks.md, the huge-pages tip).
    glibc 2.35 and later can ask on every large allocation (glibc.malloc.hugetlb=1)."""
    mode = thp_setting.split("[")[-1].split("]")[0].strip() if "[" in thp_setting else thp_setting.strip()
    lib, ver = libc
    parts = tuple(int(x) for x in ver.split(".")[:2] if x.isdigit())
    if lib != "glibc":
        can_ask = "this C library is not glibc: GLIBC_TUNABLES cannot ask"
    elif parts and parts < (2, 35):
        can_ask = f"glibc {ver} cannot ask; 2.35 has GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
    else:
        can_ask = None
    asked = "glibc.malloc.hugetlb=1" in tunables
    line = f"transparent huge pages: {mode}"
    if mode != "madvise":
        return line
    if asked and can_ask is None:
        return line + "; GLIBC_TUNABLES asks for them"
    if asked:
        return line + f"; GLIBC_TUNABLES is set, but {can_ask}"
    return line + (", not asked for: TF's tensors on 4 KB pages ("
                   + (can_ask or "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 asks") + "; docs/benchmarks.md)")


def _probes():
    """(label, callable returning the value's text), in report order."""
    here = os.path.dirname(os.path.abspath(__file__))
    bi = _build_info()

    def tfclip_line():
        return f"{_version('tfclip') or 'not installed (a source checkout)'}, loaded from {here}"

    def built():
        if bi is None:
            return "NOT BUILT (no tfclip/_build_info.py): pip install . from the source folder"
        return (f"TensorFlow {bi.TF_VERSION or '(none: a _core-only build)'}; {bi.BUILD_TYPE} build, "
                f"{bi.COMPILER}")

    def tensorflow():
        import tensorflow as tf

        running = tf.__version__
        if bi is not None and bi.TF_VERSION and bi.TF_VERSION != running:
            return (f"{running} -- MISMATCH: tfclip was built for {bi.TF_VERSION}; rebuild with "
                    "`pip install --force-reinstall --no-deps .` from the tfclip source folder")
        return f"{running} (at {os.path.dirname(tf.__file__)})"

    def keras_line():
        k3 = _version("keras")
        tk = _version("tf-keras") or _version("tf_keras")
        return f"keras {k3 or 'not installed'}; tf_keras {tk or 'not installed'}"

    def op_library():
        from tfclip import _loader

        _loader.ops()
        return os.path.join(here, "_tfclip_ops.so") + " (loads)"

    def xla():
        if bi is None:
            return "unknown (not built)"
        if not bi.XLA:
            return f"not built: {bi.XLA_WHY_NOT or 'unknown'}; under jit_compile=True the Keras optimizers warn and run stock ops"
        from tfclip import _loader

        registered = _loader.xla_kernels()
        return "built, registered with XLA" if registered else "built, but NOT registered (the op library did not load)"

    def cuda_build():
        if bi is None:
            return "unknown (not built)"
        if getattr(bi, "CUDA_EMULATION", False):
            return "the CPU emulation of the CUDA kernels (a test build: _core only)"
        if not bi.CUDA:
            return "not built (no CUDA toolkit at build time, or TFCLIP_CUDA=OFF): CPU kernels only"
        return f"built with nvcc {bi.NVCC_VERSION}; GPU code for {bi.CUDA_TARGETS}"

    def cuda_runtime():
        if bi is None or not bi.CUDA:
            return "-"
        import tfclip._core as _core

        driver, runtime = _core.cuda_versions()
        drv = _fmt_cuda(driver) if driver else "none found (no NVIDIA driver)"
        return f"runtime {_fmt_cuda(runtime)} (linked in), driver supports CUDA {drv}"

    def gpus():
        import tensorflow as tf

        found = tf.config.list_physical_devices("GPU")
        if not found:
            return "none"
        out = []
        for d in found:
            details = tf.config.experimental.get_device_details(d)
            cc = details.get("compute_capability")
            cc = f"sm_{cc[0]}{cc[1]}" if cc else "?"
            out.append(f"{d.name} {details.get('device_name', '?')} ({cc})")
        return "; ".join(out)

    def cpu():
        import tfclip._core as _core

        built_isas = "baseline, avx2, avx512 (norm pass)" if bi is not None and bi.ISA_VARIANTS else "baseline only"
        return (f"{platform.machine()}, {os.cpu_count()} logical CPUs; variant in use: {_core.cpu_isa()} "
                f"(this CPU runs: {', '.join(_core.cpu_isas())}; built: {built_isas}); "
                f"{_core.num_threads()} threads")

    def pages():
        path = "/sys/kernel/mm/transparent_hugepage/enabled"
        if not os.path.exists(path):
            return "transparent huge pages: not on this system"
        with open(path) as f:
            return pages_line(f.read(), os.environ.get("GLIBC_TUNABLES", ""), platform.libc_ver())

    def tensorboard():
        v = _version("tensorboard")
        return v or "not installed (tfclip.keras.GradientNormLogger needs it: pip install tensorboard)"

    return [
        ("tfclip", tfclip_line),
        ("built for", built),
        ("Python", lambda: f"{platform.python_version()} on {platform.platform()}"),
        ("TensorFlow", tensorflow),
        ("Keras", keras_line),
        ("op library", op_library),
        ("XLA kernels", xla),
        ("CUDA kernels", cuda_build),
        ("CUDA here", cuda_runtime),
        ("GPUs TF sees", gpus),
        ("CPU", cpu),
        ("memory pages", pages),
        ("tensorboard", tensorboard),
    ]


def collect():
    """The report as (label, text) pairs; a probe that raised gives 'ERROR: <type>: <message>'."""
    rows = []
    for label, probe in _probes():
        try:
            text = probe()
        except Exception as e:  # noqa: BLE001 - the report must go on past any one failure
            text = f"ERROR: {type(e).__name__}: {e}"
        rows.append((label, str(text)))
    return rows


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's start-up chatter is not the report
    rows = collect()
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:<{width}}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
