// tfclip._core, CUDA adapter: the core's CUDA driver on arrays with __cuda_array_interface__
// (CuPy, PyTorch, or _core's own cuda_malloc), with a stream argument. The same checks as the
// NumPy adapter (arrays.h), then the very launcher the TF GPU kernels call.
// Compiled only into a build with CUDA (a toolkit, or the emulation): module.cc calls DefineCuda
// under the same condition.
#if TFCLIP_WITH_CUDA
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "csrc/core/cuda/driver.h"
#include "csrc/core/cuda/workspace.h"
#include "csrc/core/validate.h"
#include "csrc/py/arrays.h"

#ifndef TFCLIP_EMULATED_CUDA
#define TFCLIP_EMULATED_CUDA 0
#endif

namespace tfclip {
namespace {

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
  if (code == "u1") {  // int8 state's codes (Arrays() refuses them elsewhere)
    r.codes = true;
  } else if (!DTypeFromTypeCode(code.c_str(), &r.dtype)) {
    Fail(name + " has typestr " + ts + "; only float16, float32, float64 (and a uint16/int16 view as bfloat16)");
  }
  r.size = 1;
  for (auto d : cai["shape"].cast<py::tuple>()) {
    r.shape.push_back(d.cast<int64_t>());
    r.size *= r.shape.back();
  }
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    int64_t expect = r.codes ? 1 : DTypeSize(r.dtype);
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

// What an output array's __cuda_array_interface__ says: its pointer, typestr ("<f4"), the code
// after the byte order ("f4"), element count and whether it is packed (no gaps between elements).
struct DeviceOut {
  void* ptr;
  std::string typestr, code;
  int64_t size;
  bool packed;
};
DeviceOut ReadDeviceOut(const py::object& o) {
  const py::dict cai = o.attr("__cuda_array_interface__").cast<py::dict>();
  DeviceOut d;
  d.typestr = cai["typestr"].cast<std::string>();
  d.code = d.typestr.size() >= 2 ? d.typestr.substr(1) : d.typestr;
  d.size = 1;
  for (auto dim : cai["shape"].cast<py::tuple>()) d.size *= dim.cast<int64_t>();
  const int64_t item = d.code == "f8" ? 8 : d.code == "f4" ? 4 : 1;
  d.packed = !(cai.contains("strides") && !cai["strides"].is_none() && py::len(cai["strides"]) > 0 &&
               d.size > 1 && cai["strides"].cast<py::tuple>()[0].cast<int64_t>() != item);
  d.ptr = reinterpret_cast<void*>(cai["data"].cast<py::tuple>()[0].cast<uintptr_t>());
  return d;
}

// Optional device scalar outputs: (pointer, dtype) or null.
void* ScalarOut(py::object o, const char* what, DType* dtype, bool is_bool) {
  if (o.is_none()) return nullptr;
  const DeviceOut d = ReadDeviceOut(o);
  if (d.size != 1) Fail(std::string(what) + " must hold exactly one element");
  if (is_bool) {
    if (d.code != "b1") Fail(std::string(what) + " must be a bool array");
  } else if (d.code == "f4") {
    *dtype = DType::kFloat;
  } else if (d.code == "f8") {
    *dtype = DType::kDouble;
  } else {
    Fail(std::string(what) + " must be float32 or float64");
  }
  return d.ptr;
}

// An optional per-tensor norms output: a packed float32 or float64 device array of n elements,
// or None (null).
void* DeviceNormsOut(py::object o, size_t n, DType* dtype) {
  if (o.is_none()) return nullptr;
  const DeviceOut d = ReadDeviceOut(o);
  if ((d.code != "f4" && d.code != "f8") || static_cast<size_t>(d.size) != n || !d.packed) {
    Fail("tensor_norms_out must be a contiguous float32 or float64 device array of " +
         std::to_string(n) + " elements (one per tensor), got typestr " + d.typestr + " with " +
         std::to_string(d.size));
  }
  *dtype = d.code == "f8" ? DType::kDouble : DType::kFloat;
  return d.ptr;
}

// An optional per-tensor count output (AGC's clipped units): a packed int64 device array of n
// elements, or None (null).
int64_t* DeviceClippedOut(py::object o, size_t n) {
  if (o.is_none()) return nullptr;
  const DeviceOut d = ReadDeviceOut(o);
  if (d.code != "i8" || static_cast<size_t>(d.size) != n || !d.packed) {
    Fail("agc_clipped_out must be a contiguous int64 device array of " + std::to_string(n) +
         " elements (one per tensor), got typestr " + d.typestr + " with " + std::to_string(d.size));
  }
  return static_cast<int64_t*>(d.ptr);
}

// A step's memory from the module's OwnedWorkspace (the core releases it on every path).
class OwnedMemory : public cuda::CudaStepMemory {
 public:
  explicit OwnedMemory(void* stream) : stream_(stream) {}
  std::string Acquire(size_t host_bytes, size_t device_bytes, void** host, void** device) override {
    return Workspace().Acquire(host_bytes, device_bytes, stream_, host, device);
  }
  std::string Release() override { return Workspace().Release(stream_); }

 private:
  void* stream_;
};

std::vector<TensorView> CudaViews(const py::list& l, const char* what, bool writable,
                                  std::vector<uintptr_t>* streams) {
  const auto arrays = Arrays(l, what, writable, &FromCuda);
  for (const Array& a : arrays) streams->push_back(a.stream);
  return Views(arrays, what);
}


// Reads back a device scalar the step wrote to the scratch buffer, waiting for the stream.
double SyncNorm(void* dev_norm, DType dt, void* stream) {
  double d = 0;
  float f = 0;
  if (dt == DType::kDouble) Check(cuda::CopyToHostSync(&d, dev_norm, 8, stream));
  else Check(cuda::CopyToHostSync(&f, dev_norm, 4, stream)), d = f;
  return d;
}

// 16 bytes of device memory on the current device for the outputs a caller did not give (the
// norm, the applied flag), read back before the call returns. Allocated once per device and
// kept: cudaMalloc and cudaFree per call would each synchronize the whole device. One buffer is
// enough: the calls hold the GIL, and a call that uses it has waited for its stream before it
// returns, so no step still writes there when the next begins.
void* Scratch() {
  static std::vector<void*> per_device;
  int d = 0;
  Check(cuda::CurrentDevice(&d));
  if (per_device.size() <= static_cast<size_t>(d)) per_device.resize(static_cast<size_t>(d) + 1);
  if (per_device[d] == nullptr) Check(cuda::DeviceAlloc(&per_device[d], 16));
  return per_device[d];
}

// When the caller gave no norm output: the scratch, as `dtype`. Returns whether it is used
// (then the norm is read back after the step).
bool NormOutOrScratch(py::object given, const char* what, cuda::CudaOutputs* o, DType dtype) {
  o->norm = ScalarOut(given, what, &o->norm_dtype, false);
  if (o->norm != nullptr) return false;
  o->norm = Scratch();
  o->norm_dtype = dtype;
  return true;
}

py::object CudaGlobalNormPy(const py::list& t_list, py::object out, py::object stream_o,
                            py::object tensor_norms_out) {
  std::vector<uintptr_t> streams;
  const auto in = CudaViews(t_list, "t_list", false, &streams);
  void* stream = StepStream(stream_o, streams);
  cuda::CudaOutputs o;
  o.tensor_norms = DeviceNormsOut(tensor_norms_out, in.size(), &o.tensor_norms_dtype);
  const bool scratch = NormOutOrScratch(out, "out", &o, DType::kDouble);
  OwnedMemory mem(stream);
  Check(cuda::CudaGlobalNorm(in.data(), static_cast<int>(in.size()), &mem, o, stream));
  if (scratch) return py::float_(SyncNorm(o.norm, o.norm_dtype, stream));
  return py::none();
}

// A scalar the step reads on the device: a 1-element device array of `typestr` ("f8" or "i8").
void* DeviceScalarPtr(const py::object& o, const std::string& what, const char* typestr) {
  const py::dict cai = o.attr("__cuda_array_interface__").cast<py::dict>();
  const std::string ts = cai["typestr"].cast<std::string>();
  int64_t size = 1;
  for (auto d : cai["shape"].cast<py::tuple>()) size *= d.cast<int64_t>();
  if (ts.size() < 2 || ts.substr(1) != typestr || size != 1) {
    const std::string t(typestr);
    Fail(what + " must be a 1-element " +
         (t == "f8" ? "float64" : t == "f4" ? "float32 or float64" : "int64") +
         " device array, got typestr " + ts + " with " + std::to_string(size) + " elements");
  }
  Array a;
  a.name = what;
  a.data = reinterpret_cast<void*>(cai["data"].cast<py::tuple>()[0].cast<uintptr_t>());
  a.size = 1;
  a.dtype = DType::kDouble;  // 8 bytes either way: for the alignment check
  CheckOnDevice(a);
  return a.data;
}

// clip_norm and use_norm: numbers, or 1-element float32/float64 device arrays (of one dtype)
// that the step reads on the device.
py::object CudaClipByGlobalNormPy(const py::list& t_list, const py::list& out_list,
                                  py::object clip_norm, py::object use_norm, py::object norm_out,
                                  py::object stream_o, py::object tensor_norms_out) {
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
  cuda::ClipOpScalars dev;
  double clip = 0.0, un = 0.0;
  auto device_scalar = [&](const py::object& o, const char* what) -> const void* {
    const py::dict cai = o.attr("__cuda_array_interface__").cast<py::dict>();
    const std::string ts = cai["typestr"].cast<std::string>();
    const bool f8 = ts.size() >= 2 && ts.substr(1) == "f8";
    dev.dtype = f8 ? DType::kDouble : DType::kFloat;
    return DeviceScalarPtr(o, what, f8 ? "f8" : "f4");
  };
  if (IsDeviceScalar(clip_norm)) {
    dev.clip_norm = device_scalar(clip_norm, "clip_norm");
  } else {
    clip = clip_norm.cast<double>();
    const std::string err = ValidateClipNorm(clip, "clip_norm");
    if (!err.empty()) Fail(err);
  }
  const bool has = !use_norm.is_none();
  if (has && IsDeviceScalar(use_norm)) {
    const DType clip_dtype = dev.dtype;
    dev.use_norm = device_scalar(use_norm, "use_norm");
    if (dev.clip_norm != nullptr && dev.dtype != clip_dtype) {
      Fail("clip_norm and use_norm on the device must have one dtype");
    }
  } else if (has) {
    un = use_norm.cast<double>();
  }
  void* stream = StepStream(stream_o, streams);
  cuda::CudaOutputs o;
  o.tensor_norms = DeviceNormsOut(tensor_norms_out, in.size(), &o.tensor_norms_dtype);
  const bool scratch = NormOutOrScratch(norm_out, "norm_out", &o, DType::kFloat);  // as the TF op's default Tnorm
  OwnedMemory mem(stream);
  Check(cuda::CudaClipByGlobalNorm(in.data(), outs.data(), static_cast<int>(in.size()), clip, has,
                                   un, dev, &mem, o, stream));
  if (scratch) return py::float_(SyncNorm(o.norm, o.norm_dtype, stream));
  return py::none();
}

py::object CudaClipApplyPy(const std::string& rule_name, const py::list& vars_l,
                           const py::list& grads_l, const py::list& slots_l, const py::dict& hparams,
                           const std::string& clip_mode, py::object clip, py::object use_norm,
                           const std::string& nonfinite, py::object indices, bool lazy,
                           py::object iterations, py::object norm_out, py::object applied_out,
                           py::object stream_o, py::object tensor_norms_out, double agc_eps,
                           py::object agc_clipped_out, py::object absmax, py::object grad_scale,
                           py::object rounding) {
  ApplyCall c = PrepareApply(rule_name, vars_l, grads_l, slots_l, hparams, clip_mode, clip,
                             use_norm, nonfinite, indices, lazy, &FromCuda, absmax);
  c.cfg.agc_eps = agc_eps;
  cuda::DeviceScalars ds;
  if (IsDeviceScalar(grad_scale)) {
    ds.grad_scale = static_cast<const double*>(DeviceScalarPtr(grad_scale, "grad_scale", "f8"));
  } else {
    c.cfg.grad_scale = grad_scale.cast<double>();
  }
  if (!rounding.is_none()) {  // (seed, step): numbers, or 1-element float64 device arrays
    const auto r = RoundingPair(rounding);
    c.hp.stochastic_rounding = true;
    const py::object parts[2] = {r.first, r.second};
    double* fields[2] = {&c.hp.rounding_seed, &c.hp.rounding_step};
    for (int k = 0; k < 2; ++k) {
      if (IsDeviceScalar(parts[k])) {
        ds.rounding[k] = static_cast<const double*>(DeviceScalarPtr(parts[k], k == 0 ? "rounding seed" : "rounding step", "f8"));
        if (k == 0) c.hp.rounding_seed = 0.0;  // on: the device's value replaces it
      } else {
        *fields[k] = parts[k].cast<double>();
      }
    }
  }
  for (const auto& [k, o] : c.device_scalars) {
    if (k == kClipScalar) {
      ds.clip = static_cast<const double*>(DeviceScalarPtr(o, "clip", "f8"));
    } else if (k == kUseNormScalar) {
      ds.use_norm = static_cast<const double*>(DeviceScalarPtr(o, "use_norm", "f8"));
    } else {
      ds.hparams[k] = static_cast<const double*>(
          DeviceScalarPtr(o, std::string("hparams['") + GetHParamInfo(static_cast<HP>(k)).input + "']", "f8"));
    }
  }
  if (!iterations.is_none()) {
    if (!IsDeviceScalar(iterations)) Fail("iterations must be a 1-element int64 device array");
    ds.iterations = static_cast<int64_t*>(DeviceScalarPtr(iterations, "iterations", "i8"));
  }
  StepArgs args = c.Args();
  void* stream = StepStream(stream_o, c.streams);
  cuda::CudaOutputs o;
  DType unused;
  o.norm = ScalarOut(norm_out, "norm_out", &o.norm_dtype, false);
  o.applied = static_cast<bool*>(ScalarOut(applied_out, "applied_out", &unused, true));
  o.tensor_norms =
      DeviceNormsOut(tensor_norms_out, static_cast<size_t>(args.n), &o.tensor_norms_dtype);
  o.clipped_units = DeviceClippedOut(agc_clipped_out, static_cast<size_t>(args.n));
  const bool sync = o.norm == nullptr && o.applied == nullptr;
  if (sync) {
    o.norm = Scratch();
    o.norm_dtype = DType::kDouble;
    o.applied = reinterpret_cast<bool*>(static_cast<char*>(o.norm) + 8);
  }
  OwnedMemory mem(stream);
  StepResult r;
  Check(cuda::CudaClipApply(args, ds, &mem, o, stream, &r));
  if (!r.error.empty()) Fail(r.error);
  if (!sync) return py::none();
  double res[2] = {0, 0};
  Check(cuda::CopyToHostSync(res, o.norm, 16, stream));
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
}  // namespace

void DefineCuda(py::module_& m) {
  m.attr("cuda") = true;
  m.attr("cuda_chunk_elems") = cuda::kCudaChunkElems;
  m.attr("cuda_warp_chunk_elems") = cuda::kWarpChunkElems;
  m.attr("cuda_warps_per_block") = cuda::kWarpsPerBlock;
  m.def("cuda_global_norm", &CudaGlobalNormPy, py::arg("t_list"), py::arg("out") = py::none(),
        py::arg("stream") = py::none(), py::arg("tensor_norms_out") = py::none(),
        "Global norm of CUDA arrays (__cuda_array_interface__). With `out` (a 1-element float32 "
        "or float64 device array) it is written there without waiting; else returned as a float. "
        "tensor_norms_out: None or a float32/float64 device array of len(t_list), given each "
        "array's own norm from the same pass.");
  m.def("cuda_clip_by_global_norm", &CudaClipByGlobalNormPy, py::arg("t_list"), py::arg("out"),
        py::arg("clip_norm"), py::arg("use_norm") = py::none(), py::arg("norm_out") = py::none(),
        py::arg("stream") = py::none(), py::arg("tensor_norms_out") = py::none(),
        "out[i] = t_list[i] * clip scale (tf.clip_by_global_norm). The norm goes to norm_out, "
        "or is returned (after a wait) when norm_out is None. clip_norm and use_norm may be "
        "1-element float32/float64 device arrays, read by the step on the device (a clip_norm "
        "there that is not finite and > 0 makes every output NaN).");
  m.def("cuda_clip_apply", &CudaClipApplyPy, py::arg("rule"), py::arg("vars"), py::arg("grads"),
        py::arg("slots"), py::arg("hparams"), py::arg("clip_mode") = "none",
        py::arg("clip") = 0.0, py::arg("use_norm") = py::none(), py::arg("nonfinite") = "skip",
        py::arg("indices") = py::none(), py::arg("lazy") = false,
        py::arg("iterations") = py::none(),
        py::arg("norm_out") = py::none(), py::arg("applied_out") = py::none(),
        py::arg("stream") = py::none(), py::arg("tensor_norms_out") = py::none(),
        py::arg("agc_eps") = 1e-3, py::arg("agc_clipped_out") = py::none(), py::arg("absmax") = py::none(),
        py::arg("grad_scale") = 1.0, py::arg("rounding") = py::none(),
        "clip_apply on CUDA arrays. With norm_out/applied_out (device scalars) nothing waits "
        "and None is returned; else (global_norm, applied) after a wait. nonfinite='raise' "
        "always waits. bfloat16 arrays are passed as uint16 views. indices (host NumPy arrays, "
        "as clip_apply) make grads[i] the slices of an IndexedSlices gradient. Any hyper-"
        "parameter, clip and use_norm may be a 1-element float64 device array, and iterations a "
        "1-element int64 device array (a step counter): the step reads them on the device, "
        "without a host wait; a bad value there writes nothing (applied False), and with "
        "nonfinite='raise' is an error. tensor_norms_out: None or a float32/float64 device "
        "array of len(grads), given each gradient's pre-clip norm from the norm pass (NaN with "
        "use_norm), also when the step is skipped. agc_clipped_out: None or an int64 device array "
        "of len(grads), given each tensor's count of units clip_mode='agc' scaled down, counted "
        "on the device (0 in the other modes), written with tensor_norms_out. absmax: int8 "
        "optimizer state's absmax device arrays, as clip_apply (the codes uint8 device arrays). "
        "grad_scale: as clip_apply, a number or a 1-element float64 device array. rounding: as "
        "clip_apply, each of (seed, step) a number or a 1-element float64 device array.");
  m.def("cuda_allocations", &cuda::Allocations,
        "Device and pinned-host allocations _core has made so far (its workspace ring, scratch "
        "and cuda_malloc): a step of a size seen before allocates nothing.");
  m.def("cuda_workspace_held", [] { return Workspace().Held(); },
        "Whether a step's workspace is acquired and not yet released (tests: the core releases "
        "it on every path, errors included).");
  m.def("cuda_last_launches", &cuda::LastStepLaunches,
        "Kernel launches of the last CUDA step issued from this thread.");
  m.def("cuda_last_blocks", &cuda::LastStepBlocks,
        "CUDA blocks of the last step's norm and dense apply launches (a chunk over "
        "kWarpChunkElems elements alone, smaller ones one per warp, 16 to a block).");
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
}

}  // namespace tfclip

#endif  // TFCLIP_WITH_CUDA
