// tfclip TF glue: the kernels' shared device glue (device.h): TF's thread pool and dtypes for the
// core, scalar inputs, and on GPU the op's stream and TF-allocated step memory.
#include "csrc/tf/device.h"

#include <algorithm>
#include <utility>

#include "tensorflow/core/platform/threadpool.h"

#if TFCLIP_WITH_CUDA
#include "csrc/core/cuda/workspace.h"
#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tfclip {
namespace tf_glue {

CpuExecutor TfExecutor(tf::OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return CpuExecutor{[pool](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    // One contiguous range of units per thread (as many as the work is worth, CpuRanges): streams
    // stay long, and no thread picks up scattered small shards. The partition never changes a
    // result. TF's fixed-block ParallelFor runs the first range on the calling thread.
    const int64_t threads = CpuRanges(pool->NumThreads(), n, cost);
    if (threads <= 1) {
      fn(0, n);
      return;
    }
    const int64_t per = (n + threads - 1) / threads;
    pool->TransformRangeConcurrently(per, n, fn);
  }};
}

bool ToCoreDType(tf::DataType t, DType* out) {
  static const std::vector<std::pair<tf::DataType, DType>> kMap = [] {
    std::vector<std::pair<tf::DataType, DType>> m;
#define TFCLIP_TF_DTYPE(E, S, M, N, ...)          \
  {                                               \
    tf::DataType dt;                              \
    if (tf::DataTypeFromString(N, &dt)) m.push_back({dt, DType::E}); \
  }
    TFCLIP_FOR_EACH_TYPE(TFCLIP_TF_DTYPE)
#undef TFCLIP_TF_DTYPE
    return m;
  }();
  for (const auto& [tf_type, core] : kMap) {
    if (tf_type == t) {
      *out = core;
      return true;
    }
  }
  return false;
}

absl::Status ScalarInput(tf::OpKernelContext* ctx, const char* name, double* out) {
  const tf::Tensor* t;
  TF_RETURN_IF_ERROR(ctx->input(name, &t));
  if (!tf::TensorShapeUtils::IsScalar(t->shape())) {
    return tf::errors::InvalidArgument(name, " must be a scalar, got shape ",
                                       t->shape().DebugString());
  }
  switch (t->dtype()) {
    case tf::DT_FLOAT: *out = t->scalar<float>()(); break;
    case tf::DT_DOUBLE: *out = t->scalar<double>()(); break;
    default: return tf::errors::InvalidArgument(name, " must be float or double");
  }
  return absl::OkStatus();
}

#if TFCLIP_WITH_CUDA
absl::Status CudaStatus(const std::string& e) {
  return e.empty() ? absl::OkStatus() : tf::errors::Internal(e);
}

void* GpuStream(tf::OpKernelContext* ctx) {
  return ctx->op_device_context()->stream()->platform_specific_handle().stream;
}

std::string GpuMemory::Acquire(size_t host_bytes, size_t device_bytes, void** host, void** device) {
  tf::AllocatorAttributes host_attr;
  host_attr.set_on_host(true);
  host_attr.set_gpu_compatible(true);
  absl::Status s = ctx_->allocate_temp(
      tf::DT_INT8, tf::TensorShape({static_cast<int64_t>(host_bytes)}), &host_, host_attr);
  if (s.ok()) {
    s = ctx_->allocate_temp(tf::DT_INT8, tf::TensorShape({static_cast<int64_t>(device_bytes)}),
                            &dev_);
  }
  if (!s.ok()) return std::string(s.message());
  *host = const_cast<char*>(host_.tensor_data().data());
  *device = const_cast<char*>(dev_.tensor_data().data());
  return "";
}

std::string GpuMemory::Release() {
  const auto* info = ctx_->device()->tensorflow_accelerator_device_info();
  if (info != nullptr && info->event_mgr != nullptr) {
    info->event_mgr->ThenExecute(ctx_->op_device_context()->stream(), [keep = host_]() {});
    return "";
  }
  auto* keep = new tf::Tensor(host_);
  return cuda::ThenRunOnHost(
      GpuStream(ctx_), [](void* t) { delete static_cast<tf::Tensor*>(t); }, keep);
}

cuda::CudaOutputs NormOutput(tf::Tensor* norm, DType dtype, tf::Tensor* tensor_norms) {
  cuda::CudaOutputs o;
  o.norm = const_cast<char*>(norm->tensor_data().data());
  o.norm_dtype = dtype;
  o.tensor_norms = const_cast<char*>(tensor_norms->tensor_data().data());
  o.tensor_norms_dtype = dtype;
  return o;
}
#endif  // TFCLIP_WITH_CUDA

}  // namespace tf_glue
}  // namespace tfclip
