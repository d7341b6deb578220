"""tfclip._core, or the build named by TFCLIP_CORE_MODULE (a path to a `_core*.so`).

scripts/sanitize.sh (ASan+UBSan) and scripts/cuda_emulation.sh (the emulated-CUDA build) point
TFCLIP_CORE_MODULE at their own builds, which are loaded without importing the tfclip package
(whose __init__ imports TensorFlow).
"""
import importlib.machinery
import importlib.util
import os


def load_core():
    path = os.environ.get("TFCLIP_CORE_MODULE")
    if not path:
        from tfclip import _core

        return _core
    loader = importlib.machinery.ExtensionFileLoader("_core", path)
    spec = importlib.util.spec_from_file_location("_core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
