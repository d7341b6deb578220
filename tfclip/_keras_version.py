"""Whether the installed Keras is one tfclip.keras serves (Keras 3), told without importing it
twice: TF 2.15 and older ship Keras 2, whose optimizers have another layout."""
try:
    import keras as _keras
except ImportError as e:  # no Keras at all
    KERAS_PROBLEM = (f"tfclip.keras needs Keras 3, which is not installed ({e}); `pip install "
                     "keras>=3` (it comes with TensorFlow 2.16 and newer). tfclip.fused_clip_apply, "
                     "tfclip.rules and tfclip.compat.v1 work without it.")
else:
    _major = int(str(getattr(_keras, "__version__", "0")).split(".")[0] or 0)
    KERAS_PROBLEM = None if _major >= 3 else (
        f"tfclip.keras subclasses the Keras 3 optimizers, but this environment has Keras "
        f"{_keras.__version__} (TensorFlow 2.15 and older ship Keras 2). Use tfclip.fused_clip_apply "
        "with tfclip.rules, or tfclip.compat.v1, which work with any supported TensorFlow; or "
        "install TensorFlow 2.16 or newer for Keras 3.")
