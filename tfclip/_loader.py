"""Loads the native op library and checks it was built for the TensorFlow in this process."""
import os

import tensorflow as tf

_REBUILD = (
    "Rebuild tfclip against the installed TensorFlow: `pip install --force-reinstall --no-deps .` "
    "from the tfclip source folder, or `./build_ops.sh` for an in-place checkout."
)


def load_op_library():
    try:
        import tfclip._build_info as _build_info
    except ImportError as e:  # never built
        raise ImportError(f"tfclip's native ops are not built. {_REBUILD}") from e
    if _build_info.TF_VERSION != tf.__version__:
        built = _build_info.TF_VERSION or "no TensorFlow (a _core-only build)"
        raise ImportError(
            f"tfclip was built for TensorFlow {built} but TensorFlow {tf.__version__} is "
            f"installed; a custom op library only works with the TF it was built against. {_REBUILD}"
        )
    path = os.path.join(os.path.dirname(__file__), "_tfclip_ops.so")
    if not os.path.exists(path):
        raise ImportError(f"tfclip's op library is missing ({path}). {_REBUILD}")
    if _build_info.CUDA:
        driver, runtime = _cuda_versions()
        problem = cuda_driver_problem(driver, runtime, _visible_gpus)
        if problem:
            raise ImportError(problem)
    return tf.load_op_library(path)


def _cuda_versions():
    import tfclip._core as _core

    return _core.cuda_versions()


def _visible_gpus():
    return tf.config.list_physical_devices("GPU")


def _fmt(v):
    return f"{v // 1000}.{v % 1000 // 10}"


def cuda_driver_problem(driver, runtime, visible_gpus):
    """Why the GPU kernels cannot run here, or None. `driver` and `runtime` are CUDA versions as
    1000 * major + 10 * minor (driver 0: none installed); `visible_gpus()` lists TF's GPUs and
    is asked only when the driver is too old. The runtime is linked in statically, so a driver
    of its major version or newer runs it (CUDA's minor-version compatibility); an older one
    would fail at the op's first CUDA call with "insufficient driver"."""
    if driver == 0 or driver // 1000 >= runtime // 1000 or not visible_gpus():
        return None
    import tfclip._build_info as _build_info

    major = driver // 1000
    return (
        f"tfclip's GPU kernels were built with CUDA {_fmt(runtime)} (nvcc {_build_info.NVCC_VERSION or '?'}), "
        f"which needs an NVIDIA driver for CUDA {runtime // 1000}.0 or newer, but this machine's driver "
        f"supports CUDA {_fmt(driver)}, and TensorFlow sees a GPU, so tfclip's ops would be placed there "
        f"and fail. Update the NVIDIA driver, or rebuild tfclip with a CUDA {major} toolkit from the "
        f"tfclip source folder: CMAKE_ARGS=\"-DCMAKE_CUDA_COMPILER=/usr/local/cuda-{major}/bin/nvcc\" "
        f"pip install --force-reinstall --no-deps . (or CMAKE_ARGS=\"-DTFCLIP_CUDA=OFF\" for CPU-only ops; "
        f"docs/install.md: CUDA toolkits, drivers and architectures)."
    )


_OPS = None
_XLA = None


def xla_kernels():
    """Whether this build has tfclip's XLA kernels (csrc/xla; CMake's TFCLIP_XLA): inside
    `jit_compile=True` every tfclip op then compiles to custom calls into the fused core (on CPU,
    and on GPU in a CUDA build). Without them a tfclip op cannot be compiled by XLA."""
    global _XLA
    if _XLA is None:
        from tensorflow.python.framework import kernels

        ops()  # registers them, if built
        found = kernels.get_registered_kernels_for_op("TfclipGlobalNorm").kernel
        _XLA = any(k.device_type == "XLA_CPU_JIT" for k in found) and _xla_handlers_registered()
    return _XLA


def _xla_handlers_registered():
    """Whether the op library's custom-call handlers joined TF's XLA registry when it loaded
    (csrc/xla/tf/registration.cc; a TF whose typed FFI they cannot join prints why)."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), "_tfclip_ops.so"))  # (already loaded)
    return bool(getattr(lib, "tfclip_xla_handlers_registered", lambda: 0)())


def ops():
    """The loaded op module (generated wrappers: tfclip_global_norm, tfclip_clip_apply_adam, ...)."""
    global _OPS
    if _OPS is None:
        _OPS = load_op_library()
    return _OPS
