// tfclip, CUDA: workspace for callers without an allocator of their own (tfclip._core on CuPy
// or PyTorch arrays). The TF op does not use this: it takes both buffers from TF's allocators.
// Plain C++ header: no CUDA header, so the pybind11 module includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tfclip {
namespace cuda {

// A small ring of buffer pairs (pinned host table, device workspace), each guarded by an event
// recorded after the step that used it: a slot is reused only once its step has run, so a table
// is never overwritten while its upload is still queued, and a workspace never while a kernel
// reads it. The buffers are kept and grow when a step needs more (on the current device), so a
// step allocates nothing; cudaMallocAsync per step would ask the stream-ordered pool each time,
// and the pool hands its memory back to the system at every synchronize (release threshold 0),
// so _core's waiting calls would map it again every call.
class OwnedWorkspace {
 public:
  OwnedWorkspace() = default;
  ~OwnedWorkspace();
  OwnedWorkspace(const OwnedWorkspace&) = delete;
  OwnedWorkspace& operator=(const OwnedWorkspace&) = delete;

  // Buffers of at least these sizes for one step on `stream`.
  std::string Acquire(size_t host_bytes, size_t device_bytes, void* stream, void** host,
                      void** device);
  // After the step's launches: marks the slot busy until the stream has passed this point.
  std::string Release(void* stream);
  // Whether a step's buffers are acquired and not yet released.
  bool Held() const { return cur_ >= 0; }

 private:
  static constexpr int kRing = 4;
  void* host_[kRing] = {};
  size_t host_cap_[kRing] = {};
  void* dev_[kRing] = {};
  size_t dev_cap_[kRing] = {};
  int dev_id_[kRing] = {};  // the device dev_[i] lives on
  void* event_[kRing] = {};
  int cur_ = -1, next_ = 0;
};

// Copies `bytes` from device memory to host memory and waits for the stream.
std::string CopyToHostSync(void* host, const void* device, size_t bytes, void* stream);

// Plain device memory for a few bytes (cudaMalloc / cudaFree).
std::string DeviceAlloc(void** p, size_t bytes);
void DeviceFree(void* p);

// Device and pinned-host allocations made here so far (the workspace ring, DeviceAlloc): tests
// check that repeated steps allocate nothing.
int64_t Allocations();

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
