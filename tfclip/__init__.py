"""tfclip: fused gradient clipping and optimizer updates for TensorFlow.

One norm pass and one clip-and-apply pass over every gradient, in native multi-tensor kernels
registered as TF custom ops::

    clipped, norm = tfclip.fused_clip_by_global_norm(grads, 5.0)   # = tf.clip_by_global_norm
    rule = tfclip.rules.Adam(learning_rate=1e-3)
    tfclip.fused_clip_apply(zip(grads, variables), rule, global_clipnorm=5.0)
    tfclip.fused_clip_apply(zip(grads, variables), rule, clip="zclip")   # tfclip.clipping

`tfclip._core` is the same core on NumPy arrays and imports without TensorFlow.
"""
__version__ = "0.1.0"

try:
    import tensorflow as _tf  # noqa: F401
except ModuleNotFoundError as _e:  # a host with only tfclip._core (e.g. a GPU test host)
    _TF_MISSING = _e

    def __getattr__(name):
        if name.startswith("_"):
            # Not found, so `from tfclip import _core` goes on to import the submodule.
            raise AttributeError(name)
        raise ImportError(f"tfclip.{name} needs TensorFlow, which is not installed") from _TF_MISSING

else:
    from tfclip import clipping, compat, rules
    from tfclip._keras_version import KERAS_PROBLEM as _KERAS_PROBLEM

    if _KERAS_PROBLEM is None:
        from tfclip import keras  # (imported here: it registers the classes load_model finds)

    def __getattr__(name):
        # tfclip.tf_keras on first use (importing tf_keras costs a second or two); without Keras 3
        # (TF 2.15), tfclip.keras says why not, and the ops, rules and compat.v1 serve.
        if name == "tf_keras":
            import importlib

            return importlib.import_module("tfclip.tf_keras")
        if name == "keras" and _KERAS_PROBLEM is not None:
            raise ImportError(_KERAS_PROBLEM)
        raise AttributeError(f"module 'tfclip' has no attribute {name!r}")

    from tfclip.checkpoint import convert_checkpoint
    from tfclip.ops import (
        ClipApplyResult,
        fused_clip_apply,
        fused_clip_by_global_norm,
        global_norm,
    )

    __all__ = [
        "ClipApplyResult",
        "clipping",
        "convert_checkpoint",
        "fused_clip_apply",
        "fused_clip_by_global_norm",
        "compat",
        "global_norm",
        "keras",
        "rules",
        "tf_keras",
    ]
