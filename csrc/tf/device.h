// tfclip TF glue: what the norm kernels (kernels.cc) and the apply kernel (apply_kernel.cc)
// share: the device tags, TF's thread pool as the core's CpuExecutor, TF's dtypes as the core's
// (from the one dtype list), scalar inputs, per-tensor norm outputs, and on GPU the op's stream
// and the step's memory from TF's allocators (the core's CudaStepMemory).
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "csrc/core/cpu/driver.h"
#include "csrc/core/types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

#if TFCLIP_WITH_CUDA
#include "csrc/core/cuda/driver.h"
#endif

namespace tfclip {
namespace tf_glue {

namespace tf = ::tensorflow;

// A kernel's device: its template argument.
struct OnCpu {};
struct OnGpu {};
template <typename D>
constexpr bool kGpu = std::is_same_v<D, OnGpu>;

// The op's CPU thread pool as the core's executor.
CpuExecutor TfExecutor(tf::OpKernelContext* ctx);

// TF's dtype as the core's, from the one dtype list (its TF names); false for any other.
bool ToCoreDType(tf::DataType t, DType* out);

// Reads a scalar input (float or double) as double, or names it in the error.
absl::Status ScalarInput(tf::OpKernelContext* ctx, const char* name, double* out);

// A tensor_norms output from the core's fp64 norms, rounded as the global norm is.
template <typename Tnorm>
void WriteNorms(const std::vector<double>& norms, tf::Tensor* out) {
  auto f = out->flat<Tnorm>();
  for (size_t i = 0; i < norms.size(); ++i) f(static_cast<int64_t>(i)) = RoundNorm<Tnorm>(norms[i]);
}

#if TFCLIP_WITH_CUDA
absl::Status CudaStatus(const std::string& e);

// The op's CUDA stream.
void* GpuStream(tf::OpKernelContext* ctx);

// A step's memory from TF's allocators: the tensor table in pinned host memory and the device
// workspace. The device buffer may be freed when Compute returns (TF's GPU allocator is ordered
// on the compute stream); the host table is held until the stream has passed its upload, as
// TF's own GpuDeviceArrayOnHost does: through the device's EventMgr, which records an event and
// lets go of the table from its polling thread, so the stream never waits. (A host function,
// cudaLaunchHostFunc, holds the stream until a CUDA host thread has run it: only where the
// device has no EventMgr.) The core calls Release on every path (cuda_driver.h).
class GpuMemory : public cuda::CudaStepMemory {
 public:
  explicit GpuMemory(tf::OpKernelContext* ctx) : ctx_(ctx) {}
  std::string Acquire(size_t host_bytes, size_t device_bytes, void** host, void** device) override;
  std::string Release() override;

 private:
  tf::OpKernelContext* ctx_;
  tf::Tensor host_, dev_;
};

// The op's scalar norm output and its tensor_norms vector (of the same dtype), in device memory.
cuda::CudaOutputs NormOutput(tf::Tensor* norm, DType dtype, tf::Tensor* tensor_norms);
#endif  // TFCLIP_WITH_CUDA

}  // namespace tf_glue
}  // namespace tfclip
