// tfclip, CUDA: workspace for callers without an allocator of their own (tfclip._core on CuPy
// or PyTorch arrays). The TF op does not use this: it takes both buffers from TF's allocators.
// Plain C++ header: no CUDA header, so the pybind11 module includes it.
#pragma once

#include <cstddef>
#include <string>

namespace tfclip {
namespace cuda {

// Pinned host buffers in a small ring, each guarded by an event recorded after the step that
// used it, so a table is never overwritten while its upload is still queued; device memory
// from the stream-ordered allocator (cudaMallocAsync / cudaFreeAsync), so nothing waits.
class OwnedWorkspace {
 public:
  OwnedWorkspace() = default;
  ~OwnedWorkspace();
  OwnedWorkspace(const OwnedWorkspace&) = delete;
  OwnedWorkspace& operator=(const OwnedWorkspace&) = delete;

  // Buffers of at least these sizes for one step on `stream`.
  std::string Acquire(size_t host_bytes, size_t device_bytes, void* stream, void** host,
                      void** device);
  // After the step's launches: frees the device buffer in stream order, marks the host one.
  std::string Release(void* stream);
  // Whether a step's buffers are acquired and not yet released.
  bool Held() const { return cur_ >= 0 || device_ != nullptr; }

 private:
  static constexpr int kRing = 4;
  void* host_[kRing] = {};
  size_t host_cap_[kRing] = {};
  void* event_[kRing] = {};
  int cur_ = -1, next_ = 0;
  void* device_ = nullptr;
};

// Copies `bytes` from device memory to host memory and waits for the stream.
std::string CopyToHostSync(void* host, const void* device, size_t bytes, void* stream);

// Plain device memory for a few bytes (cudaMalloc / cudaFree).
std::string DeviceAlloc(void** p, size_t bytes);
void DeviceFree(void* p);

// Device-to-device copy queued on `stream`.
std::string CopyDeviceAsync(void* dst, const void* src, size_t bytes, void* stream);

// Runs fn(arg) on a CUDA host thread once `stream` reaches this point (cudaLaunchHostFunc);
// fn must not call CUDA.
std::string ThenRunOnHost(void* stream, void (*fn)(void*), void* arg);

// The current device's name and compute capability, or an error.
std::string DeviceInfo(std::string* name, int* major, int* minor);

// The CUDA driver's version (0: no driver) and the runtime's built into this module, as
// 1000 * major + 10 * minor.
void Versions(int* driver, int* runtime);

// Where `p` lives: *device is the device holding it, or -1 when it is not device memory
// (pageable or pinned host memory).
std::string PointerDevice(const void* p, int* device);
// The current device's index.
std::string CurrentDevice(int* device);

// Makes `stream` wait for the work queued so far on each of `others` (an event each).
std::string StreamWaitStreams(void* stream, const void* const* others, int n);

// Plain runtime calls for tests and tools that hold no CUDA library of their own (the
// emulated build has no CuPy or PyTorch to allocate with).
std::string CopyHostToDeviceSync(void* device, const void* host, size_t bytes, void* stream);
std::string StreamCreate(void** stream, bool non_blocking);
std::string StreamDestroy(void* stream);
std::string StreamSynchronize(void* stream);
std::string DeviceSynchronize();

}  // namespace cuda
}  // namespace tfclip
