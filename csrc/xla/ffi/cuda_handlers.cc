// tfclip XLA glue, CUDA: the custom-call handlers for XLA's GPU backend (the typed FFI's C API
// through ffi_frame.h, platform "CUDA"; handlers.h). Each makes one call of the CUDA driver (csrc/core/cuda/driver.h) on XLA's stream:
// hyper-parameters, clip, use_norm and the step counter stay in device memory, read by the
// finalize kernel; nothing waits on the host but nonfinite='raise'. Plain C++ (the driver's
// header has no CUDA header); built only with TFCLIP_WITH_CUDA.
//
// A step's memory: the device workspace comes from XLA's allocator through the FFI's scratch
// allocator (no cudaMalloc per step; freed in stream order as TF's own temporaries are), the
// tensor table from a small ring of pinned host buffers kept across steps (OwnedWorkspace,
// csrc/core/cuda/workspace.h: reused only once the stream has passed its upload).
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/cuda/driver.h"
#include "csrc/core/cuda/workspace.h"
#include "csrc/xla/ffi/cuda_handlers.h"
#include "csrc/xla/ffi/custom_calls.h"
#include "csrc/xla/ffi/common.h"
#include "csrc/xla/ffi/handlers.h"
#include "csrc/xla/ffi/legacy_call.h"

namespace tfclip {
namespace xla_glue {
namespace {

FfiStatus CudaError(const std::string& e) {
  return e.empty() ? FfiStatus::Ok() : FfiStatus::Internal(e);
}

// XLA's scratch allocator for the step's device workspace; none where the API has none.
CudaAllocFn ScratchOf(const FfiFrame& f) {
  if (!f.HasAllocator()) return CudaAllocFn();
  return [&f](size_t b) { return f.Allocate(b, kXlaScratchAlign); };
}

// The host tables' ring is shared by every call of the process (one lock from a step's Acquire to
// its Release: a step queues its launches, it does not wait for them).
std::mutex g_table_mu;
cuda::OwnedWorkspace& TableRing() {
  static cuda::OwnedWorkspace* ring = new cuda::OwnedWorkspace();
  return *ring;
}

}  // namespace

std::string XlaCudaMemory::Acquire(size_t host_bytes, size_t device_bytes, void** host, void** device) {
  lock_ = std::unique_lock<std::mutex>(g_table_mu);
  void* unused = nullptr;
  // Without XLA's allocator the ring holds the device workspace too (cudaMalloc'd, so aligned to
  // 256 = cuda::kWorkspaceAlign).
  std::string e = TableRing().Acquire(host_bytes, alloc_ ? 0 : device_bytes, stream_, host,
                                      alloc_ ? &unused : device);
  if (!e.empty()) {
    lock_.unlock();
    return e;
  }
  if (!alloc_) return "";
  // The driver's workspace is aligned to cuda::kWorkspaceAlign; XLA grants kXlaScratchAlign.
  static_assert(kXlaScratchAlign <= 16, "XLA's FFI scratch allocator refuses an alignment above 16");
  constexpr size_t kAlign = cuda::kWorkspaceAlign;
  std::optional<void*> d = alloc_(device_bytes + kAlign);
  if (!d.has_value()) {
    TableRing().Release(stream_);
    lock_.unlock();
    return "could not allocate the step's device workspace (" + std::to_string(device_bytes) +
           " bytes) from XLA's allocator";
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(*d);
  *device = reinterpret_cast<void*>((p + kAlign - 1) / kAlign * kAlign);
  return "";
}

std::string XlaCudaMemory::Release() {
  std::string e = TableRing().Release(stream_);
  if (lock_.owns_lock()) lock_.unlock();
  return e;
}

FfiStatus NormCuda(const FfiFrame& f) {
  void* stream = nullptr;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Stream(&stream));
  std::vector<int64_t> sparse;
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64s("sparse", &sparse));
  if (!sparse.empty()) {
    return FfiStatus::Internal("tfclip_norm on CUDA: IndexedSlices are densified by the XLA kernel");
  }
  int64_t f64 = 0;
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("f64_norm", &f64));
  if (f.num_rets() != 3) return FfiStatus::Internal("tfclip_norm: unexpected result count");
  const int n = static_cast<int>(f.num_args());
  std::vector<TensorView> views(n);
  TFCLIP_FFI_RETURN_IF_ERROR(ViewArgs(f, 0, n, "t_list", views.data()));
  // The apply ops' norm call wants the fp64 norm (result 0: the groups' use_norm); the norm op
  // its Tnorm norm (result 1). The per-tensor norms (result 2) either way.
  FfiBuffer r, rt;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(f64 ? 0 : 1, &r));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(2, &rt));
  cuda::CudaOutputs o;
  o.norm = r.data;
  TFCLIP_FFI_RETURN_IF_ERROR(ToCoreDTypeOr(r.dtype, &o.norm_dtype));
  o.tensor_norms = rt.data;
  TFCLIP_FFI_RETURN_IF_ERROR(ToCoreDTypeOr(rt.dtype, &o.tensor_norms_dtype));
  XlaCudaMemory mem(stream, ScratchOf(f));
  return CudaError(cuda::CudaGlobalNorm(views.data(), n, &mem, o, stream));
}

FfiStatus ClipCuda(const FfiFrame& f) {
  void* stream = nullptr;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Stream(&stream));
  ClipCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(f));
  // clip_norm and use_norm stay in device memory, as in the TF GPU kernel (a clip_norm that is
  // not finite and > 0 makes every output NaN there: the host never reads it).
  cuda::ClipOpScalars dev;
  dev.clip_norm = call.clip_norm.data;
  if (call.given) dev.use_norm = call.use_norm.data;
  TFCLIP_FFI_RETURN_IF_ERROR(ToCoreDTypeOr(call.clip_norm.dtype, &dev.dtype));
  cuda::CudaOutputs o;
  o.norm = call.norm.data;
  o.tensor_norms = call.tensor_norms.data;
  TFCLIP_FFI_RETURN_IF_ERROR(ToCoreDTypeOr(call.norm.dtype, &o.norm_dtype));
  o.tensor_norms_dtype = o.norm_dtype;
  XlaCudaMemory mem(stream, ScratchOf(f));
  return CudaError(cuda::CudaClipByGlobalNorm(call.in.data(), call.out.data(), call.n, 0.0, call.given,
                                              0.0, dev, &mem, o, stream));
}

FfiStatus ApplyCudaStep(void* stream, const CudaAllocFn& alloc, const FfiFrame& f) {
  ApplyCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(f));
  if (!call.sparse.empty()) {
    return FfiStatus::Internal("tfclip_apply on CUDA: IndexedSlices are densified by the XLA kernel");
  }
  std::vector<ApplyTensor> ts(static_cast<size_t>(call.n));
  TFCLIP_FFI_RETURN_IF_ERROR(call.Tensors(f, ts.data()));
  StepArgs a = call.step;
  a.ts = ts.data();
  a.n = call.n;
  // Every scalar in device memory: the finalize kernel reads and checks it.
  cuda::DeviceScalars ds;
  const double* s = static_cast<const double*>(call.scalars);
  int j = 0;
  for (int k = 0; k < kNumHParams; ++k) {
    if ((call.hmask >> k) & 1u) ds.hparams[k] = s + j++;
  }
  ds.clip = s + j;
  ds.use_norm = s + j + 1;
  if (call.has_grad_scale) ds.grad_scale = s + j + 2;
  if (call.has_rounding) {
    a.hp.stochastic_rounding = true;
    for (int k = 0; k < 3; ++k) ds.rounding[k] = s + j + 3 + k;
  }
  if (call.has_iterations) {
    // The call's own copy of the count (every group reads the same one), advanced by the
    // finalize kernel when the step is applied; group 0's becomes the variable's value.
    if (call.iterations_out != call.iterations_in) {  // (group 0's is aliased: in place)
      TFCLIP_FFI_RETURN_IF_ERROR(CudaError(
          cuda::CopyDeviceAsync(call.iterations_out, call.iterations_in, sizeof(int64_t), stream)));
    }
    ds.iterations = static_cast<int64_t*>(call.iterations_out);
  }
  cuda::CudaOutputs o;
  o.norm = call.norm_out;
  o.norm_dtype = DType::kFloat;
  o.applied = static_cast<bool*>(call.applied_out);
  o.tensor_norms = call.tensor_norms_out;
  o.tensor_norms_dtype = DType::kFloat;
  o.clipped_units = static_cast<int64_t*>(call.clipped_out);
  XlaCudaMemory mem(stream, alloc);
  StepResult r;
  TFCLIP_FFI_RETURN_IF_ERROR(CudaError(cuda::CudaClipApply(a, ds, &mem, o, stream, &r)));
  if (!r.error.empty()) return FfiStatus::InvalidArgument(r.error);
  return FfiStatus::Ok();
}

FfiStatus ApplyCuda(const FfiFrame& f) {
  void* stream = nullptr;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Stream(&stream));
  return ApplyCudaStep(stream, ScratchOf(f), f);
}

}  // namespace xla_glue
}  // namespace tfclip

#if !TFCLIP_XLA_EMULATED_TEST
// The C entries (handlers.h). (The emulated-CUDA _core runs ApplyCudaStep without XLA:
// emulated_entry.cc.)
#if TFCLIP_XLA_TYPED_FFI
TFCLIP_EXPORT_HANDLER(tfclip_norm_cuda, tfclip::xla_glue::NormCuda)
TFCLIP_EXPORT_HANDLER(tfclip_clip_cuda, tfclip::xla_glue::ClipCuda)
TFCLIP_EXPORT_HANDLER(tfclip_apply_cuda, tfclip::xla_glue::ApplyCuda)
#else
TFCLIP_EXPORT_LEGACY_CUDA_HANDLER(tfclip_norm_cuda_legacy, tfclip::xla_glue::NormCuda)
TFCLIP_EXPORT_LEGACY_CUDA_HANDLER(tfclip_clip_cuda_legacy, tfclip::xla_glue::ClipCuda)
TFCLIP_EXPORT_LEGACY_CUDA_HANDLER(tfclip_apply_cuda_legacy, tfclip::xla_glue::ApplyCuda)
#endif
#endif
