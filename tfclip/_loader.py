"""Loads the native op library and checks it was built for the TensorFlow in this process."""
import os

import tensorflow as tf

_REBUILD = (
    "Rebuild tfclip against the installed TensorFlow: `pip install --force-reinstall --no-deps .` "
    "from the tfclip source folder, or `./build_ops.sh` for an in-place checkout."
)


def load_op_library():
    try:
        from tfclip import _build_info
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
    return tf.load_op_library(path)


_OPS = None


def ops():
    """The loaded op module (generated wrappers: tfclip_global_norm, tfclip_clip_apply_adam, ...)."""
    global _OPS
    if _OPS is None:
        _OPS = load_op_library()
    return _OPS
