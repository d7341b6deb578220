// tfclip._core: the arrays a call hands over, checked, as the core's tensors. Shared by the NumPy
// adapter (numpy_adapter.cc) and the CUDA one (cuda_adapter.cc): the same checks for both.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/clip.h"
#include "csrc/core/cpu/driver.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/tensors.h"

namespace tfclip {
namespace py = pybind11;

[[noreturn]] void Fail(const std::string& msg);
std::string Idx(const char* list, size_t i);
std::string ShapeStr(const std::vector<int64_t>& s);
TensorView View(const py::array& a, const std::string& name, bool writable);

// An array from either side: a NumPy array, or an object with __cuda_array_interface__.
struct Array {
  void* data = nullptr;
  std::vector<int64_t> shape;
  int64_t size = 0;
  DType dtype = DType::kFloat;
  std::string name;
  // __cuda_array_interface__ v3 "stream": the stream its producer uses (1: legacy default,
  // 2: per-thread default, else a cudaStream_t); 0 when it declares none.
  uintptr_t stream = 0;
  // A uint8 array: int8 optimizer state's codes (dtype unused). Arrays() refuses it unless asked.
  bool codes = false;
};

Array FromNumpy(const py::handle& h, const std::string& name, bool writable);
using MakeArray = Array (*)(const py::handle&, const std::string&, bool);
// The list's arrays; a uint8 one (codes) is an error unless codes_ok.
std::vector<Array> Arrays(const py::list& l, const char* what, bool writable, MakeArray make,
                          bool codes_ok = false);
// The message for a uint8 array where only float ones go.
[[noreturn]] void FailCodes(const Array& a);
// The list's arrays as core views; an empty list is an error (NumPy and CUDA alike).
std::vector<TensorView> Views(const std::vector<Array>& arrays, const char* what);

// A scalar given as a device array (CUDA): read by the step on the device.
bool IsDeviceScalar(const py::handle& h);
constexpr int kClipScalar = -1, kUseNormScalar = -2;

// Everything a clip-and-apply call needs, checked: the same checks for NumPy and CUDA.
struct ApplyCall {
  RuleKind rule;
  HParams hp;
  ClipConfig cfg;
  std::vector<ApplyTensor> ts;
  bool lazy = false;
  std::vector<std::vector<int64_t>> rows;  // the int64 indices of each sparse gradient
  std::vector<uintptr_t> streams;          // the streams the arrays declare (CUDA)
  // Scalars given as device arrays (CUDA): (HP index, or kClip / kUseNorm / kIterations; array).
  std::vector<std::pair<int, py::object>> device_scalars;
  // The core's step arguments (the tensors stay owned here).
  StepArgs Args() const;
};

// clip_apply's `rounding`: a (seed, step) pair, or a TypeError naming what is wrong.
std::pair<py::object, py::object> RoundingPair(const py::object& rounding);

ApplyCall PrepareApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                       const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                       py::object clip, py::object use_norm, const std::string& nonfinite,
                       const py::object& indices_o, bool lazy, MakeArray make,
                       const py::object& absmax_o);

}  // namespace tfclip
