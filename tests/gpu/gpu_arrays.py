"""Device arrays for the CUDA parity suite, on whichever backend this host has.

- "core": device memory from tfclip._core itself (cuda_malloc / cuda_to_device), exposed through
  __cuda_array_interface__ v3. The only backend of the emulated-CUDA build (CI: there device
  memory is host memory the emulation registered), and it works on a real GPU too.
- "cupy" / "torch": CuPy or PyTorch CUDA arrays (real GPUs).

TFCLIP_GPU_ARRAYS=core|cupy|torch picks one; by default the emulated build takes "core", a real
build CuPy, else PyTorch, else "core". With TFCLIP_REQUIRE_GPU=1 (set by CI for the emulated
run, and on GPU hosts) anything that would skip the suite fails it instead.
"""
import os

import numpy as np
import pytest

from core_loader import load_core

REQUIRE = os.environ.get("TFCLIP_REQUIRE_GPU") == "1"


def unavailable(msg):
    """Skips the module, or fails it where the suite is required to run."""
    if REQUIRE:
        pytest.fail(f"TFCLIP_REQUIRE_GPU=1 but the CUDA suite cannot run: {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


try:
    core = load_core()
except ImportError as e:
    unavailable(f"tfclip._core is not built ({e})")
if not core.cuda:
    unavailable("tfclip._core was built without CUDA (no toolkit at build time; "
                "-DTFCLIP_CUDA_EMULATION=ON builds the emulated variant)")
try:
    DEVICE = core.cuda_device()
except RuntimeError as e:
    unavailable(f"no CUDA device: {e}")
EMULATED = bool(core.cuda_emulated)

try:
    import ml_dtypes
except ImportError:
    unavailable("ml_dtypes is needed for the bfloat16 CPU reference (pip install ml_dtypes)")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _wire(a):
    """bfloat16 travels as a uint16 view: no array library exports a bfloat16 typestr."""
    a = np.ascontiguousarray(a).reshape(np.shape(a))  # (ascontiguousarray makes a 0-d array 1-d)
    return a.view(np.uint16) if a.dtype == BF16 else a


class CoreArray:
    """Device memory owned through tfclip._core, C-contiguous, with a declared stream."""

    def __init__(self, shape, dtype, ptr=None, owner=None, stream=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self._owner = owner
        self._owned = ptr is None
        self.ptr = core.cuda_malloc(self.nbytes) if ptr is None else ptr
        self.stream = stream

    def __del__(self):
        if getattr(self, "_owned", False):
            core.cuda_free(self.ptr)

    @property
    def __cuda_array_interface__(self):
        d = {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
             "version": 3, "strides": None}
        d["stream"] = self.stream
        return d

    def __getitem__(self, key):
        """x[k:] of a 1-D array: a view that starts k elements in (misaligned for k odd)."""
        assert len(self.shape) == 1 and isinstance(key, slice) and key.stop is None and key.step is None
        k = key.start or 0
        return CoreArray((self.shape[0] - k,), self.dtype, self.ptr + k * self.dtype.itemsize, self,
                         self.stream)


class _Core:
    name = "core"

    def to_dev(self, a):
        a = _wire(a)
        d = CoreArray(a.shape, a.dtype)
        if d.nbytes:
            core.cuda_to_device(d.ptr, a)
        return d

    def to_host(self, d):
        out = np.empty(d.shape, d.dtype)
        core.cuda_synchronize()
        if d.nbytes:
            core.cuda_to_host(out, d.ptr)
        return out

    def stream(self):
        return _CoreStream()

    def synchronize(self):
        core.cuda_synchronize()


class _CoreStream:
    def __init__(self):
        self.ptr = core.cuda_stream_create(True)

    def __del__(self):
        core.cuda_stream_destroy(self.ptr)

    def declare(self, d):
        """The array now declares this stream in its __cuda_array_interface__."""
        d.stream = self.ptr
        return d

    def synchronize(self):
        core.cuda_stream_synchronize(self.ptr)


class _CuPy:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy

    def to_dev(self, a):
        return self.cp.asarray(_wire(a))

    def to_host(self, d):
        self.cp.cuda.Device().synchronize()
        return self.cp.asnumpy(d)

    def stream(self):
        cp = self.cp

        class S:
            def __init__(self):
                self.s = cp.cuda.Stream(non_blocking=True)
                self.ptr = self.s.ptr

            def declare(self, d):
                # CuPy exports the current stream when the interface is read: read it now.
                with self.s:
                    cai = dict(d.__cuda_array_interface__)
                return _Declared(cai, d)

            def synchronize(self):
                self.s.synchronize()

        return S()

    def synchronize(self):
        self.cp.cuda.Device().synchronize()


class _Torch:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def to_dev(self, a):
        a = _wire(a)
        if a.dtype == np.uint16:
            a = a.view(np.int16)  # PyTorch has no uint16 before 2.3; _core takes i2 as bfloat16
        return self.torch.from_numpy(np.array(a)).cuda()

    def to_host(self, d):
        self.torch.cuda.synchronize()
        h = d.cpu().numpy()
        return h.view(np.uint16) if h.dtype == np.int16 else h

    def stream(self):
        torch = self.torch

        class S:
            def __init__(self):
                self.s = torch.cuda.Stream()
                self.ptr = self.s.cuda_stream

            def declare(self, d):
                cai = dict(d.__cuda_array_interface__)
                cai["version"] = 3
                cai["stream"] = self.ptr
                return _Declared(cai, d)

            def synchronize(self):
                self.s.synchronize()

        return S()

    def synchronize(self):
        self.torch.cuda.synchronize()


class _Declared:
    """Another library's array, re-exported with a declared stream."""

    def __init__(self, cai, base):
        self.__cuda_array_interface__ = cai
        self.base = base


def _pick():
    want = os.environ.get("TFCLIP_GPU_ARRAYS")
    order = [want] if want else (["core"] if EMULATED else ["cupy", "torch", "core"])
    errors = []
    for name in order:
        try:
            if name == "core":
                return _Core()
            if name == "cupy":
                return _CuPy()
            if name == "torch":
                return _Torch()
            errors.append(f"unknown TFCLIP_GPU_ARRAYS={name!r}")
        except ImportError as e:
            errors.append(f"{name}: {e}")
    unavailable("no array backend: " + "; ".join(errors))


dev = _pick()


def to_dev(a):
    return dev.to_dev(a)


def to_host(d, dtype):
    """The device array as NumPy, viewed as `dtype` (bfloat16 comes back from its uint16 view)."""
    h = dev.to_host(d)
    return h.view(BF16) if np.dtype(dtype) == BF16 else h


def full(shape, value, dtype):
    return to_dev(np.full(shape, value, dtype=dtype))


class Frozen:
    """A device array's __cuda_array_interface__, read once, for a timed loop. CuPy and PyTorch
    build that dict in Python on every access (microseconds each): a step over BERT-base's 800
    arrays spent 4 ms of its wall clock in them on an H200 (2026-12-04), where the kernels took
    1 ms. A TF user's step passes tensors to the op directly and pays neither."""

    def __init__(self, a):
        self.__cuda_array_interface__ = dict(a.__cuda_array_interface__)
        self._keep = a


def assert_same_bits(got, want, what=""):
    """`got` and `want` hold the same bytes, bit for bit (NaN payloads and -0.0 too). On failure:
    how many elements differ and the first few, never the bytes themselves: pytest explains a
    failed `a.tobytes() == b.tobytes()` through difflib, quadratic in the bytes, and under CI=true
    in full, which once ran a planted fault's first failing check past CI's time limit."""
    a, b = np.ascontiguousarray(got), np.ascontiguousarray(want)
    ab, bb = a.tobytes(), b.tobytes()
    if ab == bb:
        return
    label = f"{what}: " if what != "" else ""
    if len(ab) != len(bb):
        raise AssertionError(f"{label}{a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}: "
                             f"{len(ab)} bytes against {len(bb)}")
    if a.dtype.itemsize != b.dtype.itemsize:  # (then the bytes themselves)
        a, b = np.frombuffer(ab, np.uint8), np.frombuffer(bb, np.uint8)
    k = max(a.dtype.itemsize, 1)
    bad = np.unique(np.flatnonzero(np.frombuffer(ab, np.uint8) != np.frombuffer(bb, np.uint8)) // k)
    fa, fb = a.reshape(-1), b.reshape(-1)
    first = ", ".join(f"[{i}] {fa[i]!r} vs {fb[i]!r}" for i in bad[:6])
    raise AssertionError(f"{label}{bad.size} of {fa.size} elements differ in their bits: {first}")
