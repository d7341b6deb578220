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
    with pytest.raises(ValueError, match="unknown rule 'adamax'"):
        _core.cuda_clip_apply("adamax", [a], [a], [], {})
