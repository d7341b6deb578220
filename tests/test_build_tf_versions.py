"""The TensorFlow you have: tfclip builds against the TF installed where it goes (2.15-2.21) and
never replaces it; a TF outside the range, one without headers or libraries, or an environment
without Keras 3 gets an error that names what was found and what to do.

(scripts/tf_matrix.sh builds and runs the suite's subset on each version; CI runs the newest and,
with the subset, TF 2.16.)"""
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tensorflow as tf

import tfclip

SRC = Path(os.environ.get("TFCLIP_SOURCE_DIR", Path(__file__).resolve().parents[1]))
HAVE_SOURCE = (SRC / "build_backend" / "tfclip_build.py").exists() and (SRC / "CMakeLists.txt").exists()
needs_source = pytest.mark.skipif(not HAVE_SOURCE, reason=f"the source checkout (build_backend/, "
                                                          f"CMakeLists.txt) is not at {SRC}")


def _backend():
    spec = importlib.util.spec_from_file_location("tfclip_build", SRC / "build_backend" / "tfclip_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_source
@pytest.mark.parametrize("found,want", [
    # A supported TF where tfclip goes: the build compiles against that one, from there
    # (CMakeLists.txt queries the target interpreter without pip's isolation), so the isolated
    # build environment gets no second TensorFlow. (CI's TF 2.16 step builds this way.)
    (("tensorflow", "2.18.1"), None),
    (("tensorflow", "2.15.0"), None),
    (("tensorflow-cpu", "2.16.2"), None),
    # None there: the newest supported, which pip then installs for the run time too.
    (None, "tensorflow==2.21.*"),
])
def test_build_requires_the_tensorflow_already_installed(monkeypatch, found, want):
    backend = _backend()
    monkeypatch.delenv("TFCLIP_TF_VERSION", raising=False)
    monkeypatch.setattr(backend, "_installed_tensorflow", lambda: found)
    assert backend._tensorflow_requirement() == want
    monkeypatch.setattr(backend._skbuild, "get_requires_for_build_wheel", lambda cs=None: ["cmake"])
    assert backend.get_requires_for_build_wheel() == (["cmake"] + [want] if want else ["cmake"])


@needs_source
def test_the_build_finds_the_target_tensorflow_from_an_isolated_build_without_one(tmp_path):
    """pip's isolated build environment holds no TF when the target has one (above): a configure
    run under an isolation that hides TensorFlow (PYTHONPATH's sitecustomize blocks the import,
    as pip's overlay lacks it) still finds this environment's TF, and says which."""
    iso = tmp_path / "overlay"
    iso.mkdir()
    (iso / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class _NoTF:
            def find_spec(self, name, path=None, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ModuleNotFoundError("No module named 'tensorflow' (isolated)")
        sys.meta_path.insert(0, _NoTF())
    """))
    env = dict(os.environ, PYTHONPATH=str(iso), PYTHONNOUSERSITE="1")
    probe = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0  # the isolation really hides it
    out = subprocess.run(["cmake", "-S", str(SRC), "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}",
                          "-DTFCLIP_CUDA=OFF", "-DTFCLIP_XLA=OFF", "-DTFCLIP_ISA_VARIANTS=OFF"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"tfclip: TensorFlow {tf.__version__} at {tf.sysconfig.get_lib()}" in out.stdout


@needs_source
@pytest.mark.parametrize("version", ["2.14.1", "2.22.0", "1.15.5"])
def test_build_refuses_a_tensorflow_outside_the_range_by_name(monkeypatch, version):
    backend = _backend()
    monkeypatch.delenv("TFCLIP_TF_VERSION", raising=False)
    monkeypatch.setattr(backend, "_installed_tensorflow", lambda: ("tensorflow", version))
    with pytest.raises(RuntimeError, match=rf"found tensorflow {re.escape(version)}; tfclip supports "
                                           r"TensorFlow 2\.15 to 2\.21.*pip install"):
        backend._tensorflow_requirement()


@needs_source
def test_build_backend_finds_this_environments_tensorflow_from_an_isolated_build():
    """pip builds in an isolated environment (its own PYTHONPATH, user site off): the backend asks
    the target interpreter without those, and finds the TF installed here."""
    backend = _backend()
    env = dict(os.environ, PYTHONPATH="/nonexistent-isolated-overlay", PYTHONNOUSERSITE="1")
    code = (f"import importlib.util as u; s = u.spec_from_file_location('b', {str(SRC / 'build_backend' / 'tfclip_build.py')!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m._installed_tensorflow())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(f"'{tf.__version__}')"), out.stdout
    del backend


@needs_source
def test_the_supported_range_is_said_the_same_everywhere():
    backend = _backend()
    lo, hi = backend.OLDEST, backend.NEWEST
    pyproject = (SRC / "pyproject.toml").read_text()
    assert f'"tensorflow>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"' in pyproject
    cmake = (SRC / "CMakeLists.txt").read_text()
    assert f'set(TFCLIP_TF_OLDEST "{lo[0]}.{lo[1]}")' in cmake
    assert f'set(TFCLIP_TF_NEWEST "{hi[0]}.{hi[1]}")' in cmake
    installed = tuple(int(x) for x in tf.__version__.split(".")[:2])
    assert lo <= installed <= hi


def _fake_python(tmp_path, version, include_dir, lib_dir):
    """A Python for CMake whose `import tensorflow` query answers as a given TF would (every other
    question goes to the real interpreter)."""
    script = tmp_path / "python"
    answer = "\\n".join([version, f"-I{include_dir} -D_GLIBCXX_USE_CXX11_ABI=1 --std=c++17",
                        f"-L{lib_dir} -l:libtensorflow_framework.so.2", str(lib_dir)])
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in
          *tf.sysconfig*) printf '{answer}\\n'; exit 0;;
        esac
        exec {sys.executable} "$@"
        """))
    script.chmod(0o755)
    return script


def _configure(tmp_path, python):
    cmake = subprocess.run(["cmake", "-S", str(SRC), "-B", str(tmp_path / "build"),
                            f"-DPython_EXECUTABLE={python}", "-DTFCLIP_CUDA=OFF", "-DTFCLIP_XLA=OFF"],
                           capture_output=True, text=True, timeout=600)
    return cmake.returncode, cmake.stdout + cmake.stderr


@needs_source
@pytest.mark.parametrize("version", ["2.14.1", "2.22.0"])
def test_cmake_refuses_a_tensorflow_outside_the_range(tmp_path, version):
    python = _fake_python(tmp_path, version, tf.sysconfig.get_include(), tf.sysconfig.get_lib())
    rc, out = _configure(tmp_path, python)
    assert rc != 0
    flat = " ".join(out.split())
    assert f"has TensorFlow '{version}'" in flat and "supports TensorFlow 2.15 to 2.21" in flat, out[-3000:]


@needs_source
def test_cmake_names_a_tensorflow_without_headers(tmp_path):
    empty = tmp_path / "include"
    empty.mkdir()
    python = _fake_python(tmp_path, tf.__version__, empty, tf.sysconfig.get_lib())
    rc, out = _configure(tmp_path, python)
    flat = " ".join(out.split())
    assert rc != 0
    assert f"TensorFlow {tf.__version__}" in flat and "has no C++ headers" in flat, out[-3000:]
    assert "pip install --force-reinstall" in flat


@needs_source
def test_cmake_names_a_tensorflow_without_its_library(tmp_path):
    python = _fake_python(tmp_path, tf.__version__, tf.sysconfig.get_include(), tmp_path)
    rc, out = _configure(tmp_path, python)
    flat = " ".join(out.split())
    assert rc != 0 and "lacks libtensorflow_framework.so.2" in flat, out[-3000:]


def test_import_refuses_a_tensorflow_other_than_the_one_built_for(monkeypatch):
    from tfclip import _build_info, _loader

    other = "2.15.1" if tf.__version__ != "2.15.1" else "2.16.2"
    monkeypatch.setattr(_build_info, "TF_VERSION", other)
    with pytest.raises(ImportError, match=rf"built for TensorFlow {re.escape(other)} but TensorFlow "
                                          rf"{re.escape(tf.__version__)} is installed.*pip install"):
        _loader.load_op_library()


def test_keras_2_environment_keeps_the_ops_and_names_what_tfclip_keras_needs(tmp_path):
    """TF 2.15 ships Keras 2: `import tfclip` still works (ops, rules, compat.v1), and
    `tfclip.keras` is an ImportError naming the Keras found and what to use instead."""
    fake = tmp_path / "keras"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.15.0'\n")
    root = Path(tfclip.__file__).resolve().parents[1]
    code = textwrap.dedent("""\
        import tensorflow as tf
        import tfclip
        v = tf.Variable([1.0, 2.0])
        tfclip.fused_clip_apply([(tf.constant([1.0, 1.0]), v)], tfclip.rules.SGD(0.5))
        assert v.numpy().tolist() == [0.5, 1.5], v.numpy()
        opt = tfclip.compat.v1.GradientDescentOptimizer(0.5)
        opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
        assert v.numpy().tolist() == [0.0, 1.0], v.numpy()
        try:
            tfclip.keras
        except ImportError as e:
            print("IMPORT ERROR:", e)
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]), TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IMPORT ERROR: tfclip.keras subclasses the Keras 3 optimizers" in out.stdout
    assert "Keras 2.15.0" in out.stdout and "tfclip.compat.v1" in out.stdout
