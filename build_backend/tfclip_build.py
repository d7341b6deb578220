"""tfclip's build backend: scikit-build-core, building against the TensorFlow the user has.

A TF custom-op library only loads in the TensorFlow it was compiled against, and pip builds in an
isolated environment. So the build requirement is not a fixed pin: it is the TensorFlow version
installed where tfclip is going (asked of that environment's own interpreter), which the build
then uses from there (no second copy in the build environment), or, where none is, the newest
supported one (which pip then installs for the run time too). `pip install .` thus never replaces
a user's TensorFlow. TFCLIP_TF_VERSION=X.Y.Z overrides the choice.
"""
import os
import re
import subprocess
import sys

from scikit_build_core import build as _skbuild

# The supported range: TF 2.15 (Keras 2) through 2.21. Kept with pyproject.toml's dependency.
OLDEST, NEWEST = (2, 15), (2, 21)
_NEWEST_PIN = "tensorflow==2.21.*"


def _installed_tensorflow():
    """The TensorFlow version in the target environment, or None. pip runs this backend with the
    target's interpreter but an isolated sys.path (PYTHONPATH and a sitecustomize); a child
    without those sees the target's own site-packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    code = ("import importlib.metadata as m\n"
            "for n in ('tensorflow', 'tensorflow-cpu', 'tf-nightly'):\n"
            "    try:\n        print(n, m.version(n)); break\n"
            "    except m.PackageNotFoundError:\n        pass\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env,
                             capture_output=True, text=True, timeout=120).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[0], out[1]) if len(out) == 2 else None


def _tensorflow_requirement():
    """The TensorFlow the isolated build environment needs, or None when the target environment
    already has a supported one: CMakeLists.txt then compiles against that one (it queries the
    target interpreter without pip's isolation), and pip does not install a second copy of
    TensorFlow (about 45 s and 1.7 GB on the 2-core CI machine) only to build."""
    forced = os.environ.get("TFCLIP_TF_VERSION")
    if forced:
        return f"tensorflow=={forced}"
    found = _installed_tensorflow()
    if found is None:
        return _NEWEST_PIN
    name, version = found
    m = re.match(r"(\d+)\.(\d+)", version)
    minor = (int(m.group(1)), int(m.group(2))) if m else None
    if minor is None or not OLDEST <= minor <= NEWEST:
        raise RuntimeError(
            f"tfclip builds against the TensorFlow installed here, and found {name} {version}; "
            f"tfclip supports TensorFlow {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}. Install one "
            f"of those first (pip install \"tensorflow>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}\"), "
            "or set TFCLIP_TF_VERSION to build for another.")
    return None


def _with_tensorflow(requires):
    tf = _tensorflow_requirement()
    return [*requires, tf] if tf else list(requires)


def get_requires_for_build_wheel(config_settings=None):
    return _with_tensorflow(_skbuild.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _with_tensorflow(_skbuild.get_requires_for_build_editable(config_settings))


get_requires_for_build_sdist = _skbuild.get_requires_for_build_sdist
build_wheel = _skbuild.build_wheel
build_sdist = _skbuild.build_sdist
build_editable = _skbuild.build_editable
prepare_metadata_for_build_wheel = _skbuild.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _skbuild.prepare_metadata_for_build_editable
