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
