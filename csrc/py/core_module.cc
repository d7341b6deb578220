// tfclip._core: the same core on NumPy arrays, without TensorFlow. It exists so the kernels
// can be tested and benchmarked on hosts that have no TF (the GPU hosts), and it must stay the
// very code path the TF kernels call: it only validates, converts and calls csrc/core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "csrc/core/cpu_driver.h"
#include "csrc/core/cpu_kernels.h"
#if TFCLIP_WITH_CUDA
#include "cuda/cuda_driver.h"
#include "cuda/workspace.h"
#endif

#ifndef TFCLIP_EMULATED_CUDA
#define TFCLIP_EMULATED_CUDA 0
#endif

namespace py = pybind11;

namespace tfclip {
namespace {

std::atomic<int> g_num_threads{0};  // 0: hardware concurrency

int NumThreads() {
  const int n = g_num_threads.load();
  if (n > 0) return n;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Our own threads: contiguous blocks of units, one per thread; small work stays inline.
CpuExecutor PyExecutor() {
  return CpuExecutor{[](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    constexpr int64_t kMinCyclesPerThread = 1 << 16;
    int64_t threads = std::min<int64_t>(NumThreads(), n);
    threads = std::min<int64_t>(threads, std::max<int64_t>(1, n * cost / kMinCyclesPerThread));
    if (threads <= 1) {
      fn(0, n);
      return;
    }
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads - 1));
    const int64_t per = (n + threads - 1) / threads;
    for (int64_t t = 1; t < threads; ++t) {
      const int64_t b = t * per, e = std::min(n, b + per);
      if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
    }
    fn(0, std::min(n, per));
    for (auto& th : pool) th.join();
  }};
}

[[noreturn]] void Fail(const std::string& msg) { throw py::value_error(msg); }

DType ArrayDType(const py::array& a, const std::string& name) {
  const py::dtype dt = a.dtype();
  const std::string dname = py::str(dt.attr("name"));
  if (dname == "float16") return DType::kHalf;
  if (dname == "bfloat16") return DType::kBFloat16;
  if (dname == "float32") return DType::kFloat;
  if (dname == "float64") return DType::kDouble;
  Fail(name + " has dtype " + dname + "; only float16, bfloat16, float32 and float64");
}

TensorView View(const py::array& a, const std::string& name, bool writable) {
  if (!(a.flags() & py::array::c_style)) Fail(name + " must be C-contiguous");
  if (writable && !a.writeable()) Fail(name + " must be writable (it is updated in place)");
  TensorView v;
  v.dtype = ArrayDType(a, name);
  v.size = static_cast<int64_t>(a.size());
  v.data = const_cast<void*>(a.data());
  return v;
}

std::string Idx(const char* list, size_t i) {
  std::ostringstream os;
  os << list << "[" << i << "]";
  return os.str();
}

std::vector<int64_t> Shape(const py::array& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

double Norm(const std::vector<TensorView>& ts) {
  py::gil_scoped_release nogil;
  return GlobalNormCpu(ts.data(), static_cast<int>(ts.size()), PyExecutor());
}

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
};

Array FromNumpy(const py::handle& h, const std::string& name, bool writable) {
  if (!py::isinstance<py::array>(h)) Fail(name + " is not a NumPy array");
  const py::array a = py::reinterpret_borrow<py::array>(h);
  const TensorView v = View(a, name, writable);
  Array r;
  r.data = v.data;
  r.shape = Shape(a);
  r.size = v.size;
  r.dtype = v.dtype;
  r.name = name;
  return r;
}

using MakeArray = Array (*)(const py::handle&, const std::string&, bool);

std::vector<Array> Arrays(const py::list& l, const char* what, bool writable, MakeArray make) {
  std::vector<Array> out;
  for (size_t i = 0; i < l.size(); ++i) out.push_back(make(l[i], Idx(what, i), writable));
  return out;
}

// The list's arrays as core views; an empty list is an error (NumPy and CUDA alike).
std::vector<TensorView> Views(const std::vector<Array>& arrays, const char* what) {
  if (arrays.empty()) Fail(std::string(what) + " is empty; pass at least one array");
  std::vector<TensorView> v;
  for (const Array& a : arrays) v.push_back(TensorView{a.data, a.size, a.dtype});
  return v;
}

double GlobalNorm(const py::list& t_list) {
  return Norm(Views(Arrays(t_list, "t_list", false, &FromNumpy), "t_list"));
}

py::tuple ClipByGlobalNorm(const py::list& t_list, double clip_norm, py::object use_norm) {
  const auto arrays = Arrays(t_list, "t_list", false, &FromNumpy);
  const auto in = Views(arrays, "t_list");
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) Fail(err);
  const double norm = use_norm.is_none() ? Norm(in) : use_norm.cast<double>();
  const double scale = GlobalClipScale(clip_norm, norm);
  py::list outs;
  std::vector<TensorView> out;
  for (size_t i = 0; i < arrays.size(); ++i) {
    py::array o = py::array(py::reinterpret_borrow<py::array>(t_list[i]).dtype(), arrays[i].shape);
    outs.append(o);
    out.push_back(View(o, Idx("out", i), true));
  }
  {
    py::gil_scoped_release nogil;
    ScaleListCpu(in.data(), out.data(), static_cast<int>(in.size()), scale, PyExecutor());
  }
  return py::make_tuple(outs, norm);
}

HParams ParseHParams(RuleKind rule, const py::dict& d) {
  HParams hp;
  for (auto item : d) {
    const std::string k = py::str(item.first);
    if (k == "nesterov") { hp.nesterov = item.second.cast<bool>(); continue; }
    if (k == "amsgrad") { hp.amsgrad = item.second.cast<bool>(); continue; }
    if (k == "sum_of_squares") { hp.sum_of_squares = item.second.cast<bool>(); continue; }
    const double v = item.second.cast<double>();
    if (k == "learning_rate" || k == "lr") hp.lr = v;
    else if (k == "momentum") hp.momentum = v;
    else if (k == "beta_1") hp.beta_1 = v;
    else if (k == "beta_2") hp.beta_2 = v;
    else if (k == "epsilon") hp.epsilon = v;
    else if (k == "weight_decay") hp.weight_decay = v;
    else if (k == "step") hp.step = v;
    else if (k == "beta_1_power") hp.beta_1_power = v, hp.beta_powers = true;
    else if (k == "beta_2_power") hp.beta_2_power = v, hp.beta_powers = true;
    else Fail("unknown hyper-parameter '" + k + "'");
  }
  const std::string e = ValidateHParams(rule, hp);
  if (!e.empty()) Fail(e);
  return hp;
}

#if TFCLIP_WITH_CUDA
// An array's memory must be on the current device: a host pointer (a NumPy-backed interface)
// or another device's would make the kernels fault. Pointers found on the device are kept (a
// step's arrays are the same every step, and the query costs about a microsecond each).
// (Not in the emulated build: its device memory comes from the host heap, where a freed
// address can come back as host memory; a GPU's device addresses never do.)
void CheckOnDevice(const Array& a) {
  if (a.size == 0) return;
  if (reinterpret_cast<uintptr_t>(a.data) % DTypeSize(a.dtype) != 0) {
    Fail(a.name + " is not aligned to its element size (" + std::to_string(DTypeSize(a.dtype)) +
         " bytes); the kernels would fault on it");
  }
  static std::mutex mu;
  static std::unordered_set<uintptr_t> seen;
  const uintptr_t key = reinterpret_cast<uintptr_t>(a.data);
  constexpr bool kCache = !TFCLIP_EMULATED_CUDA;
  if (kCache) {
    std::lock_guard<std::mutex> l(mu);
    if (seen.count(key) != 0) return;
  }
  int device = -1, current = 0;
  std::string e = cuda::PointerDevice(a.data, &device);
  if (e.empty()) e = cuda::CurrentDevice(&current);
  if (!e.empty()) Fail(a.name + ": cannot tell where its memory lives: " + e);
  if (device < 0) {
    Fail(a.name + " is not in device memory (its __cuda_array_interface__ points to host memory)");
  }
  if (device != current) {
    Fail(a.name + " is on CUDA device " + std::to_string(device) + " but the current device is " +
         std::to_string(current));
  }
  if (kCache) {
    std::lock_guard<std::mutex> l(mu);
    if (seen.size() > (1u << 16)) seen.clear();
    seen.insert(key);
  }
}

// __cuda_array_interface__ (CuPy, PyTorch, Numba): C-contiguous float16/32/64; bfloat16 travels
// as a 16-bit integer view (uint16 or int16), since CuPy has no bfloat16 dtype and PyTorch does
// not export one.
Array FromCuda(const py::handle& h, const std::string& name, bool writable) {
  if (!py::hasattr(h, "__cuda_array_interface__")) {
    Fail(name + " has no __cuda_array_interface__ (pass a CuPy or PyTorch CUDA array)");
  }
  const py::dict cai = h.attr("__cuda_array_interface__").cast<py::dict>();
  Array r;
  r.name = name;
  const py::tuple data = cai["data"].cast<py::tuple>();
  r.data = reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  if (writable && data[1].cast<bool>()) Fail(name + " is read-only (it is updated in place)");
  const std::string ts = cai["typestr"].cast<std::string>();
  const std::string code = ts.size() >= 2 ? ts.substr(1) : ts;
  if (code == "f2") r.dtype = DType::kHalf;
  else if (code == "u2" || code == "i2") r.dtype = DType::kBFloat16;
  else if (code == "f4") r.dtype = DType::kFloat;
  else if (code == "f8") r.dtype = DType::kDouble;
  else Fail(name + " has typestr " + ts + "; only float16, float32, float64 (and a uint16/int16 view as bfloat16)");
  r.size = 1;
  for (auto d : cai["shape"].cast<py::tuple>()) {
    r.shape.push_back(d.cast<int64_t>());
    r.size *= r.shape.back();
  }
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    int64_t expect = DTypeSize(r.dtype);
    const py::tuple st = cai["strides"].cast<py::tuple>();
    for (int k = static_cast<int>(r.shape.size()) - 1; k >= 0; --k) {
      if (r.shape[k] > 1 && st[k].cast<int64_t>() != expect) Fail(name + " must be C-contiguous");
      expect *= r.shape[k];
    }
  }
  if (cai.contains("stream") && !cai["stream"].is_none()) {
    r.stream = cai["stream"].cast<uintptr_t>();
    if (r.stream == 0) Fail(name + " declares stream 0, which __cuda_array_interface__ forbids");
  }
  CheckOnDevice(r);
  return r;
}
#endif

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

// Everything a clip-and-apply call needs, validated: the same checks for NumPy and CUDA.
struct ApplyCall {
  RuleKind rule;
  HParams hp;
  ClipConfig cfg;
  std::vector<ApplyTensor> ts;
  bool lazy = false;
  std::vector<std::vector<int64_t>> rows;  // the int64 indices of each sparse gradient
  std::vector<uintptr_t> streams;          // the streams the arrays declare (CUDA)
};

// indices[i] for an IndexedSlices gradient: a 1-D NumPy integer array (host memory, for the
// CUDA entry points too, as the TF GPU kernels take them); grads[i] holds its slices.
void SetSparse(const py::handle& h, const Array& var, const Array& values, size_t i,
               std::vector<int64_t>* rows, ApplyTensor* t) {
  const std::string name = Idx("indices", i);
  if (!py::isinstance<py::array>(h)) Fail(name + " is not a NumPy array (or None for a dense gradient)");
  const py::array a = py::reinterpret_borrow<py::array>(h);
  if (a.ndim() != 1) Fail(name + " must be 1-D, got " + std::to_string(a.ndim()) + " dimensions");
  if (var.shape.empty()) Fail(Idx("vars", i) + " is a scalar; a sparse gradient needs rank >= 1");
  std::vector<int64_t> want{static_cast<int64_t>(a.size())};
  want.insert(want.end(), var.shape.begin() + 1, var.shape.end());
  if (values.shape != want) {
    Fail(values.name + " has shape " + ShapeStr(values.shape) + "; with " + std::to_string(a.size()) +
         " indices and " + var.name + " of shape " + ShapeStr(var.shape) + " it must be " + ShapeStr(want));
  }
  const std::string dt = py::str(a.dtype().attr("name"));
  rows->resize(static_cast<size_t>(a.size()));
  if (dt == "int64") {
    const auto v = a.cast<py::array_t<int64_t, py::array::c_style>>();
    std::memcpy(rows->data(), v.data(), sizeof(int64_t) * rows->size());
  } else if (dt == "int32") {
    const auto v = a.cast<py::array_t<int32_t, py::array::c_style>>();
    for (size_t j = 0; j < rows->size(); ++j) (*rows)[j] = v.data()[j];
  } else {
    Fail(name + " has dtype " + dt + "; indices must be int32 or int64");
  }
  t->sparse = true;
  t->indices = rows->data();
  t->nnz = static_cast<int64_t>(a.size());
  t->rows = var.shape[0];
  t->width = 1;
  for (size_t d = 1; d < var.shape.size(); ++d) t->width *= var.shape[d];
}

ApplyCall PrepareApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                       const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                       double clip, py::object use_norm, const std::string& nonfinite,
                       const py::object& indices_o, bool lazy, MakeArray make) {
  ApplyCall call;
  call.lazy = lazy;
  if (!ParseRule(rule_name, &call.rule)) Fail("unknown rule '" + rule_name + "'");
  call.hp = ParseHParams(call.rule, hparams);
  ClipConfig& cfg = call.cfg;
  if (!ParseClipMode(clip_mode, &cfg.mode)) Fail("unknown clip_mode '" + clip_mode + "'");
  if (!ParseNonFinitePolicy(nonfinite, &cfg.policy)) Fail("unknown nonfinite '" + nonfinite + "'");
  cfg.clip = clip;
  cfg.has_use_norm = !use_norm.is_none();
  if (cfg.has_use_norm) cfg.use_norm = use_norm.cast<double>();
  const std::string cerr = ValidateClipConfig(cfg);
  if (!cerr.empty()) Fail(cerr);

  const auto vars = Arrays(vars_l, "vars", true, make);
  const auto grads = Arrays(grads_l, "grads", false, make);
  if (vars.empty()) Fail("vars is empty; pass at least one variable");
  if (vars.size() != grads.size()) {
    Fail("got " + std::to_string(grads.size()) + " gradients for " + std::to_string(vars.size()) +
         " variables");
  }
  const int n = static_cast<int>(vars.size());
  const int nslots = NumSlots(call.rule, call.hp);
  if (static_cast<int>(slots_l.size()) != nslots) {
    Fail("rule '" + rule_name + "' takes " + std::to_string(nslots) + " slot lists, got " +
         std::to_string(slots_l.size()));
  }
  static const char* kSlotNames[kMaxSlots] = {"slots[0]", "slots[1]", "slots[2]"};
  std::vector<std::vector<Array>> slots;
  for (int k = 0; k < nslots; ++k) {
    slots.push_back(Arrays(slots_l[k].cast<py::list>(), kSlotNames[k], true, make));
    if (static_cast<int>(slots[k].size()) != n) {
      Fail(std::string(kSlotNames[k]) + " has " + std::to_string(slots[k].size()) +
           " arrays for " + std::to_string(n) + " variables");
    }
  }
  py::list indices;
  if (!indices_o.is_none()) {
    indices = indices_o.cast<py::list>();
    if (static_cast<int>(indices.size()) != n) {
      Fail("indices has " + std::to_string(indices.size()) + " entries for " + std::to_string(n) +
           " variables (None for each dense gradient)");
    }
  }
  call.ts.resize(n);
  call.rows.resize(n);
  std::map<const void*, std::string> seen;
  auto claim = [&](const Array& a) {
    if (a.size == 0) return;  // empty arrays own no memory to alias
    auto it = seen.emplace(a.data, a.name);
    if (!it.second) Fail(a.name + " and " + it.first->second + " are the same array; each may appear once");
  };
  for (int i = 0; i < n; ++i) {
    const Array& v = vars[i];
    const Array& g = grads[i];
    const bool sparse = !indices_o.is_none() && !indices[i].is_none();
    if (sparse) {
      SetSparse(indices[i], v, g, i, &call.rows[i], &call.ts[i]);
    } else if (v.shape != g.shape) {
      Fail(g.name + " has shape " + ShapeStr(g.shape) + " but " + v.name + " has shape " +
           ShapeStr(v.shape));
    }
    claim(v);
    ApplyTensor& t = call.ts[i];
    t.var = v.data;
    t.var_dtype = v.dtype;
    t.grad = g.data;
    t.grad_dtype = g.dtype;
    t.size = v.size;
    for (int k = 0; k < nslots; ++k) {
      const Array& s = slots[k][i];
      if (s.dtype != v.dtype || s.shape != v.shape) Fail(s.name + " must have the dtype and shape of " + v.name);
      claim(s);
      t.slots[k] = s.data;
    }
  }
  for (const auto* l : {&vars, &grads}) {
    for (const Array& a : *l) call.streams.push_back(a.stream);
  }
  for (const auto& l : slots) {
    for (const Array& a : l) call.streams.push_back(a.stream);
  }
  return call;
}

[[noreturn]] void FailNonFinite() {
  throw py::value_error("the global norm of the gradients is non-finite and nonfinite='raise'; "
                        "no variable was updated");
}

py::tuple ClipApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                    const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                    double clip, py::object use_norm, const std::string& nonfinite,
                    py::object indices, bool lazy) {
  ApplyCall c = PrepareApply(rule_name, vars_l, grads_l, slots_l, hparams, clip_mode, clip,
                             use_norm, nonfinite, indices, lazy, &FromNumpy);
  StepScratch scratch;
  StepResult r;
  {
    py::gil_scoped_release nogil;
    r = ClipApplyCpu(c.rule, c.hp, c.cfg, c.ts.data(), static_cast<int>(c.ts.size()), c.lazy,
                     &scratch, PyExecutor());
  }
  if (!r.error.empty()) Fail(r.error);
  if (r.nonfinite && c.cfg.policy == NonFinitePolicy::kRaise) FailNonFinite();
  return py::make_tuple(r.global_norm, r.applied);
}

#if TFCLIP_WITH_CUDA
// ---------------------------------------------------------------- CUDA entry points
void Check(const std::string& e) {
  if (!e.empty()) throw std::runtime_error(e);
}

cuda::OwnedWorkspace& Workspace() {
  static cuda::OwnedWorkspace* ws = new cuda::OwnedWorkspace();  // outlives the CUDA runtime
  return *ws;
}

void* StreamArg(py::object stream) {
  if (py::hasattr(stream, "ptr")) return reinterpret_cast<void*>(stream.attr("ptr").cast<uintptr_t>());  // CuPy
  if (py::hasattr(stream, "cuda_stream")) return reinterpret_cast<void*>(stream.attr("cuda_stream").cast<uintptr_t>());  // PyTorch
  return reinterpret_cast<void*>(stream.cast<uintptr_t>());
}

// The stream a step runs on: the one given, else the one the arrays declare (the first that
// declares one), else the legacy default stream. Every other stream an array declares is made
// to wait first, as __cuda_array_interface__ asks of a consumer.
void* StepStream(py::object stream, const std::vector<uintptr_t>& streams) {
  std::vector<const void*> declared;
  for (uintptr_t v : streams) {
    const void* st = reinterpret_cast<const void*>(v);
    if (v != 0 && std::find(declared.begin(), declared.end(), st) == declared.end()) {
      declared.push_back(st);
    }
  }
  void* s = nullptr;
  if (!stream.is_none()) s = StreamArg(stream);
  else if (!declared.empty()) s = const_cast<void*>(declared.front());
  declared.erase(std::remove(declared.begin(), declared.end(), s), declared.end());
  if (s == nullptr) {  // the legacy stream under its two names
    declared.erase(std::remove(declared.begin(), declared.end(), reinterpret_cast<const void*>(1)),
                   declared.end());
  }
  if (!declared.empty()) {
    Check(cuda::StreamWaitStreams(s, declared.data(), static_cast<int>(declared.size())));
  }
  return s;
}

// Optional device scalar outputs: (pointer, dtype) or null.
void* ScalarOut(py::object o, const char* what, DType* dtype, bool is_bool) {
  if (o.is_none()) return nullptr;
  const py::dict cai = o.attr("__cuda_array_interface__").cast<py::dict>();
  const std::string ts = cai["typestr"].cast<std::string>();
  const std::string code = ts.size() >= 2 ? ts.substr(1) : ts;
  int64_t size = 1;
  for (auto d : cai["shape"].cast<py::tuple>()) size *= d.cast<int64_t>();
  if (size != 1) Fail(std::string(what) + " must hold exactly one element");
  if (is_bool) {
    if (code != "b1") Fail(std::string(what) + " must be a bool array");
  } else if (code == "f4") {
    *dtype = DType::kFloat;
  } else if (code == "f8") {
    *dtype = DType::kDouble;
  } else {
    Fail(std::string(what) + " must be float32 or float64");
  }
  return reinterpret_cast<void*>(cai["data"].cast<py::tuple>()[0].cast<uintptr_t>());
}

template <typename Fn>
void RunStep(const std::vector<int64_t>& sizes, void* stream, Fn&& fn,
             const SparsePlan* sparse = nullptr) {
  cuda::CudaPlan plan;
  cuda::PlanCudaStep(sizes.data(), static_cast<int>(sizes.size()), &plan, sparse);
  void* host = nullptr;
  void* dev = nullptr;
  Check(Workspace().Acquire(plan.host_bytes, plan.device_bytes, stream, &host, &dev));
  const std::string e = fn(plan, host, dev);
  const std::string e2 = Workspace().Release(stream);
  Check(e);
  Check(e2);
}

std::vector<TensorView> CudaViews(const py::list& l, const char* what, bool writable,
                                  std::vector<uintptr_t>* streams) {
  const auto arrays = Arrays(l, what, writable, &FromCuda);
  for (const Array& a : arrays) streams->push_back(a.stream);
  return Views(arrays, what);
}

std::vector<int64_t> Sizes(const std::vector<TensorView>& v) {
  std::vector<int64_t> s;
  for (const auto& t : v) s.push_back(t.size);
  return s;
}

// Reads back a device scalar the step wrote to its workspace-free temporary.
double SyncNorm(void* dev_norm, DType dt, void* stream) {
  double d = 0;
  float f = 0;
  if (dt == DType::kDouble) Check(cuda::CopyToHostSync(&d, dev_norm, 8, stream));
  else Check(cuda::CopyToHostSync(&f, dev_norm, 4, stream)), d = f;
  return d;
}

// A small device buffer for outputs the caller did not give (then read back, with a wait).
struct Scratch8 {
  void* p = nullptr;
  Scratch8() { Check(cuda::DeviceAlloc(&p, 16)); }
  ~Scratch8() { cuda::DeviceFree(p); }
};

// When the caller gave no norm output: a scratch one of `dtype`, to read back after the step.
std::unique_ptr<Scratch8> NormOutOrScratch(py::object given, const char* what, cuda::CudaOutputs* o,
                                           DType dtype) {
  o->norm = ScalarOut(given, what, &o->norm_dtype, false);
  if (o->norm != nullptr) return nullptr;
  auto tmp = std::make_unique<Scratch8>();
  o->norm = tmp->p;
  o->norm_dtype = dtype;
  return tmp;
}

py::object CudaGlobalNormPy(const py::list& t_list, py::object out, py::object stream_o) {
  std::vector<uintptr_t> streams;
  const auto in = CudaViews(t_list, "t_list", false, &streams);
  void* stream = StepStream(stream_o, streams);
  cuda::CudaOutputs o;
  const auto tmp = NormOutOrScratch(out, "out", &o, DType::kDouble);
  RunStep(Sizes(in), stream, [&](const cuda::CudaPlan& p, void* h, void* d) {
    return cuda::CudaGlobalNorm(in.data(), static_cast<int>(in.size()), p, h, d, o, stream);
  });
  if (tmp) return py::float_(SyncNorm(o.norm, o.norm_dtype, stream));
  return py::none();
}

py::object CudaClipByGlobalNormPy(const py::list& t_list, const py::list& out_list, double clip_norm,
                                  py::object use_norm, py::object norm_out, py::object stream_o) {
  std::vector<uintptr_t> streams;
  const auto in = CudaViews(t_list, "t_list", false, &streams);
  const auto outs = CudaViews(out_list, "out", true, &streams);
  if (in.size() != outs.size()) Fail("out has " + std::to_string(outs.size()) + " arrays for " +
                                     std::to_string(in.size()) + " inputs");
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].size != outs[i].size || in[i].dtype != outs[i].dtype) {
      Fail(Idx("out", i) + " must have the size and dtype of " + Idx("t_list", i));
    }
  }
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) Fail(err);
  void* stream = StepStream(stream_o, streams);
  cuda::CudaOutputs o;
  const auto tmp = NormOutOrScratch(norm_out, "norm_out", &o, DType::kFloat);  // as the TF op's default Tnorm
  const bool has = !use_norm.is_none();
  const double un = has ? use_norm.cast<double>() : 0.0;
  RunStep(Sizes(in), stream, [&](const cuda::CudaPlan& p, void* h, void* d) {
    return cuda::CudaClipByGlobalNorm(in.data(), outs.data(), static_cast<int>(in.size()),
                                      clip_norm, has, un, p, h, d, o, stream);
  });
  if (tmp) return py::float_(SyncNorm(o.norm, o.norm_dtype, stream));
  return py::none();
}

py::object CudaClipApplyPy(const std::string& rule_name, const py::list& vars_l,
                           const py::list& grads_l, const py::list& slots_l, const py::dict& hparams,
                           const std::string& clip_mode, double clip, py::object use_norm,
                           const std::string& nonfinite, py::object indices, bool lazy,
                           py::object norm_out, py::object applied_out, py::object stream_o) {
  ApplyCall c = PrepareApply(rule_name, vars_l, grads_l, slots_l, hparams, clip_mode, clip,
                             use_norm, nonfinite, indices, lazy, &FromCuda);
  SparsePlan sparse;
  const std::string serr = PlanSparse(c.ts.data(), static_cast<int>(c.ts.size()), c.rule, c.hp,
                                      c.lazy, cuda::kCudaChunkElems, &sparse);
  if (!serr.empty()) Fail(serr);
  void* stream = StepStream(stream_o, c.streams);
  cuda::CudaOutputs o;
  DType unused;
  o.norm = ScalarOut(norm_out, "norm_out", &o.norm_dtype, false);
  o.applied = static_cast<bool*>(ScalarOut(applied_out, "applied_out", &unused, true));
  std::unique_ptr<Scratch8> tmp;
  const bool sync = o.norm == nullptr && o.applied == nullptr;
  if (sync) {
    tmp = std::make_unique<Scratch8>();
    o.norm = tmp->p;
    o.norm_dtype = DType::kDouble;
    o.applied = reinterpret_cast<bool*>(static_cast<char*>(tmp->p) + 8);
  }
  std::vector<int64_t> sizes;
  for (const auto& t : c.ts) sizes.push_back(t.grad_size());
  bool nonfinite_hit = false;
  RunStep(sizes, stream, [&](const cuda::CudaPlan& p, void* h, void* d) {
    return cuda::CudaClipApply(c.rule, c.hp, c.cfg, c.ts.data(), static_cast<int>(c.ts.size()), p,
                               h, d, o, stream, &nonfinite_hit);
  }, &sparse);
  if (nonfinite_hit) FailNonFinite();
  if (!sync) return py::none();
  double res[2] = {0, 0};
  Check(cuda::CopyToHostSync(res, tmp->p, 16, stream));
  bool applied = false;
  std::memcpy(&applied, reinterpret_cast<char*>(res) + 8, sizeof(bool));
  return py::make_tuple(res[0], applied);
}

// Plain device memory and streams for tests and tools without CuPy or PyTorch (the emulated
// build has neither): the test suite's "core" array backend.
uintptr_t CudaMalloc(size_t bytes) {
  void* p = nullptr;
  Check(cuda::DeviceAlloc(&p, bytes == 0 ? 1 : bytes));
  return reinterpret_cast<uintptr_t>(p);
}

py::buffer_info HostBuffer(const py::array& a, bool writable) {
  if (!(a.flags() & py::array::c_style)) Fail("host array must be C-contiguous");
  if (writable && !a.writeable()) Fail("host array must be writable");
  return a.request(writable);
}

void CudaToDevice(uintptr_t dst, const py::array& src, py::object stream) {
  const py::buffer_info b = HostBuffer(src, false);
  void* st = stream.is_none() ? nullptr : StreamArg(stream);
  const size_t bytes = static_cast<size_t>(b.size * b.itemsize);
  py::gil_scoped_release nogil;
  Check(cuda::CopyHostToDeviceSync(reinterpret_cast<void*>(dst), b.ptr, bytes, st));
}

void CudaToHost(py::array& dst, uintptr_t src, py::object stream) {
  const py::buffer_info b = HostBuffer(dst, true);
  void* st = stream.is_none() ? nullptr : StreamArg(stream);
  const size_t bytes = static_cast<size_t>(b.size * b.itemsize);
  py::gil_scoped_release nogil;
  Check(cuda::CopyToHostSync(b.ptr, reinterpret_cast<const void*>(src), bytes, st));
}

uintptr_t CudaStreamCreate(bool non_blocking) {
  void* s = nullptr;
  Check(cuda::StreamCreate(&s, non_blocking));
  return reinterpret_cast<uintptr_t>(s);
}

py::dict CudaDevice() {
  std::string name;
  int major = 0, minor = 0;
  Check(cuda::DeviceInfo(&name, &major, &minor));
  py::dict d;
  d["name"] = name;
  d["compute_capability"] = py::make_tuple(major, minor);
  return d;
}
#endif  // TFCLIP_WITH_CUDA

// For tfclip/ops.py's repeated eager step, one pass in C over the (gradient, variable) pairs
// instead of several in Python (which ran cache-cold after each op: ~50 us for 200 pairs).
// Returns the gradients as a list when `pairs` is a list of 2-tuples whose variables are, in
// order, the very objects of the tuple `variables` and whose gradients are all exactly of type
// `grad_type`; else None (the caller then takes its general path). Nothing here knows TF.
py::object SplitRepeatedPairs(py::handle pairs, py::handle variables, py::handle grad_type) {
  PyObject* p = pairs.ptr();
  PyObject* vs = variables.ptr();
  if (!PyList_CheckExact(p) || !PyTuple_CheckExact(vs) || !PyType_Check(grad_type.ptr()) ||
      PyList_GET_SIZE(p) != PyTuple_GET_SIZE(vs)) {
    return py::none();
  }
  const Py_ssize_t n = PyList_GET_SIZE(p);
  const auto* type = reinterpret_cast<PyTypeObject*>(grad_type.ptr());
  // Allocated first: nothing after it can run Python code (a collection's finalizer) while
  // the loop holds borrowed items. Unfilled slots are NULL, which the list's dealloc allows.
  py::list grads(n);
  if (PyList_GET_SIZE(p) != n) return py::none();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pair = PyList_GET_ITEM(p, i);
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        PyTuple_GET_ITEM(pair, 1) != PyTuple_GET_ITEM(vs, i) ||
        Py_TYPE(PyTuple_GET_ITEM(pair, 0)) != type) {
      return py::none();
    }
    PyObject* g = PyTuple_GET_ITEM(pair, 0);
    Py_INCREF(g);
    PyList_SET_ITEM(grads.ptr(), i, g);
  }
  return std::move(grads);
}

}  // namespace
}  // namespace tfclip

PYBIND11_MODULE(_core, m) {
  using namespace tfclip;
  m.doc() = "tfclip's core on NumPy arrays (no TensorFlow): the same CPU kernels the TF ops call.";
  m.def("split_repeated_pairs", &SplitRepeatedPairs, py::arg("pairs"), py::arg("variables"),
        py::arg("grad_type"),
        "tfclip.fused_clip_apply's repeated eager step: the gradients of a list of (gradient, "
        "variable) 2-tuples whose variables are, in order, the objects of the tuple `variables` "
        "and whose gradients are exactly of `grad_type`; else None.");
  m.def("global_norm", &GlobalNorm, py::arg("t_list"),
        "Global L2 norm of a list of float arrays (fp64 accumulation, deterministic).");
  m.def("clip_by_global_norm", &ClipByGlobalNorm, py::arg("t_list"), py::arg("clip_norm"),
        py::arg("use_norm") = py::none(),
        "(clipped arrays, norm) with tf.clip_by_global_norm semantics.");
  m.def("clip_apply", &ClipApply, py::arg("rule"), py::arg("vars"), py::arg("grads"),
        py::arg("slots"), py::arg("hparams"), py::arg("clip_mode") = "none",
        py::arg("clip") = 0.0, py::arg("use_norm") = py::none(), py::arg("nonfinite") = "skip",
        py::arg("indices") = py::none(), py::arg("lazy") = false,
        "Clip and apply in place. rule: sgd | momentum | keras_momentum | adam. slots: one list "
        "of arrays per slot (momentum: [accum]; adam: [m, v] or [m, v, vhat]). indices: None, "
        "or per variable None (dense) or an int32/int64 array of rows, grads[i] then holding "
        "the slices (IndexedSlices); lazy: sparse updates touch only those rows. Returns "
        "(global_norm, applied).");
  m.def("set_num_threads", [](int n) { g_num_threads = n; }, py::arg("n"),
        "Threads for the CPU passes (0: all cores). Results do not depend on it.");
  m.def("num_threads", &NumThreads);
  m.attr("chunk_elems") = kChunkElems;
  m.def("cpu_isa", [] { return std::string(ActiveCpuKernels().name); },
        "The instruction set the CPU passes run with (avx512, avx2 or baseline), picked at run "
        "time from the CPU (or TFCLIP_CPU_ISA).");
  m.def("cpu_isas", &SupportedCpuIsas, "The instruction-set variants this CPU can run, best first.");
  m.def("set_cpu_isa", [](const std::string& name) {
          if (!SetCpuIsa(name)) Fail("CPU variant '" + name + "' is not supported here");
        }, py::arg("name"), "Switch variant (every variant gives the same bits).");
#if TFCLIP_WITH_CUDA
  m.attr("cuda") = true;
  m.attr("cuda_chunk_elems") = cuda::kCudaChunkElems;
  m.def("cuda_global_norm", &CudaGlobalNormPy, py::arg("t_list"), py::arg("out") = py::none(),
        py::arg("stream") = py::none(),
        "Global norm of CUDA arrays (__cuda_array_interface__). With `out` (a 1-element float32 "
        "or float64 device array) it is written there without waiting; else returned as a float.");
  m.def("cuda_clip_by_global_norm", &CudaClipByGlobalNormPy, py::arg("t_list"), py::arg("out"),
        py::arg("clip_norm"), py::arg("use_norm") = py::none(), py::arg("norm_out") = py::none(),
        py::arg("stream") = py::none(),
        "out[i] = t_list[i] * clip scale (tf.clip_by_global_norm). The norm goes to norm_out, "
        "or is returned (after a wait) when norm_out is None.");
  m.def("cuda_clip_apply", &CudaClipApplyPy, py::arg("rule"), py::arg("vars"), py::arg("grads"),
        py::arg("slots"), py::arg("hparams"), py::arg("clip_mode") = "none",
        py::arg("clip") = 0.0, py::arg("use_norm") = py::none(), py::arg("nonfinite") = "skip",
        py::arg("indices") = py::none(), py::arg("lazy") = false,
        py::arg("norm_out") = py::none(), py::arg("applied_out") = py::none(),
        py::arg("stream") = py::none(),
        "clip_apply on CUDA arrays. With norm_out/applied_out (device scalars) nothing waits "
        "and None is returned; else (global_norm, applied) after a wait. nonfinite='raise' "
        "always waits. bfloat16 arrays are passed as uint16 views. indices (host NumPy arrays, "
        "as clip_apply) make grads[i] the slices of an IndexedSlices gradient.");
  m.def("cuda_last_launches", &cuda::LastStepLaunches,
        "Kernel launches of the last CUDA step issued from this thread.");
  m.def("cuda_last_stream", [] { return reinterpret_cast<uintptr_t>(cuda::LastStepStream()); },
        "The stream (as an integer; 0: the legacy default) of the last CUDA step issued from this thread.");
  m.def("cuda_device", &CudaDevice, "Name and compute capability of the current CUDA device.");
#if TFCLIP_EMULATED_CUDA
  m.attr("cuda_emulated") = true;
#else
  m.attr("cuda_emulated") = false;
#endif
  m.def("cuda_versions", [] {
          int driver = 0, runtime = 0;
          cuda::Versions(&driver, &runtime);
          return py::make_tuple(driver, runtime);
        },
        "(driver, runtime): the CUDA driver's version (0: no driver) and the runtime built in, "
        "each as 1000 * major + 10 * minor.");
  m.def("cuda_malloc", &CudaMalloc, py::arg("nbytes"),
        "Device memory (cudaMalloc), as an integer pointer; for tests and tools.");
  m.def("cuda_free", [](uintptr_t p) { cuda::DeviceFree(reinterpret_cast<void*>(p)); }, py::arg("ptr"));
  m.def("cuda_to_device", &CudaToDevice, py::arg("dst"), py::arg("src"), py::arg("stream") = py::none(),
        "Copies the C-contiguous host array `src` to device pointer `dst` and waits.");
  m.def("cuda_to_host", &CudaToHost, py::arg("dst"), py::arg("src"), py::arg("stream") = py::none(),
        "Copies dst.nbytes from device pointer `src` into the host array `dst` and waits.");
  m.def("cuda_stream_create", &CudaStreamCreate, py::arg("non_blocking") = true);
  m.def("cuda_stream_destroy", [](uintptr_t s) { Check(cuda::StreamDestroy(reinterpret_cast<void*>(s))); },
        py::arg("stream"));
  m.def("cuda_stream_synchronize",
        [](uintptr_t s) {
          py::gil_scoped_release nogil;
          Check(cuda::StreamSynchronize(reinterpret_cast<void*>(s)));
        },
        py::arg("stream"));
  m.def("cuda_synchronize", [] {
    py::gil_scoped_release nogil;
    Check(cuda::DeviceSynchronize());
  });
#else
  m.attr("cuda") = false;
  m.attr("cuda_emulated") = false;
#endif
}
