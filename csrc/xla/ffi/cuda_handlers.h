// tfclip XLA glue, CUDA: what the CUDA custom-call handlers share (cuda_handlers.cc). The step's
// memory for the CUDA driver: the device workspace from an allocator function (XLA's scratch
// allocator in the handler; any device allocator in a test), the tensor table from a ring of
// pinned host buffers kept across steps.
#pragma once

#include <cstddef>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "csrc/core/cuda/driver.h"
#include "csrc/xla/ffi/frame.h"

namespace tfclip {
namespace xla_glue {

// Device bytes from XLA's allocator, aligned to kXlaScratchAlign: all an FFI scratch allocation
// may ask (XLA's XLA_FFI_DeviceMemory_Allocate refuses an alignment above 16, its kMaxAlignment,
// xla/ffi/ffi_api.cc). Found on an H200 under JAX (2026-11-27): asking 256, then 64, failed every
// step ("could not allocate the step's device workspace"). XlaCudaMemory aligns the workspace
// itself. An empty function: the runtime has no scratch allocator (FFI API 0.0, TF 2.17), and
// the workspace comes from the ring's own device buffers, reused once the stream has passed
// their step (as the tensor tables).
using CudaAllocFn = std::function<std::optional<void*>(size_t)>;
inline constexpr size_t kXlaScratchAlign = 16;

class XlaCudaMemory : public cuda::CudaStepMemory {
 public:
  XlaCudaMemory(void* stream, CudaAllocFn alloc) : stream_(stream), alloc_(std::move(alloc)) {}
  std::string Acquire(size_t host_bytes, size_t device_bytes, void** host, void** device) override;
  std::string Release() override;

 private:
  void* stream_;
  CudaAllocFn alloc_;
  std::unique_lock<std::mutex> lock_;
};

// The CUDA apply handler's body, on a call frame (custom_calls.h order).
FfiStatus ApplyCudaStep(void* stream, const CudaAllocFn& alloc, const FfiFrame& f);
// The same with the frame's stream and scratch allocator (what the handler's entries run).
FfiStatus ApplyCuda(const FfiFrame& f);

}  // namespace xla_glue
}  // namespace tfclip
