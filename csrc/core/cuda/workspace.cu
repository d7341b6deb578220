// tfclip, CUDA: OwnedWorkspace (see workspace.h).
#include "csrc/core/cuda/workspace.h"

#include <cuda_runtime.h>

#include <atomic>
#include <sstream>

namespace tfclip {
namespace cuda {
namespace {
std::atomic<int64_t> g_allocations{0};

std::string Err(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return "";
  std::ostringstream os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
     << ")";
  return os.str();
}
}  // namespace

OwnedWorkspace::~OwnedWorkspace() {
  for (int i = 0; i < kRing; ++i) {
    if (event_[i] != nullptr) {
      cudaEventSynchronize(static_cast<cudaEvent_t>(event_[i]));
      cudaEventDestroy(static_cast<cudaEvent_t>(event_[i]));
    }
    if (host_[i] != nullptr) cudaFreeHost(host_[i]);
    if (dev_[i] != nullptr) cudaFree(dev_[i]);
  }
}

std::string OwnedWorkspace::Acquire(size_t host_bytes, size_t device_bytes, void* stream,
                                    void** host, void** device) {
  const int i = next_;
  next_ = (next_ + 1) % kRing;
  std::string e;
  if (event_[i] == nullptr) {
    cudaEvent_t ev;
    e = Err(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    if (!e.empty()) return e;
    event_[i] = ev;
  } else {
    // Waits only when kRing steps are still queued ahead of this one.
    e = Err(cudaEventSynchronize(static_cast<cudaEvent_t>(event_[i])), "cudaEventSynchronize");
    if (!e.empty()) return e;
  }
  if (host_cap_[i] < host_bytes) {
    if (host_[i] != nullptr) cudaFreeHost(host_[i]);
    host_[i] = nullptr;
    host_cap_[i] = 0;
    ++g_allocations;
    e = Err(cudaMallocHost(&host_[i], host_bytes), "cudaMallocHost (the tensor table)");
    if (!e.empty()) return e;
    host_cap_[i] = host_bytes;
  }
  int dev = 0;
  e = Err(cudaGetDevice(&dev), "cudaGetDevice");
  if (!e.empty()) return e;
  if (dev_cap_[i] < device_bytes || dev_id_[i] != dev) {
    // Growth (or another device): rare, and the slot's last step has run (the event above).
    if (dev_[i] != nullptr) cudaFree(dev_[i]);
    dev_[i] = nullptr;
    dev_cap_[i] = 0;
    const size_t bytes = device_bytes < 4096 ? 4096 : device_bytes;
    ++g_allocations;
    e = Err(cudaMalloc(&dev_[i], bytes), "cudaMalloc (the step workspace)");
    if (!e.empty()) return e;
    dev_cap_[i] = bytes;
    dev_id_[i] = dev;
  }
  cur_ = i;
  *host = host_[i];
  *device = dev_[i];
  return "";
}

std::string OwnedWorkspace::Release(void* stream) {
  std::string e;
  if (cur_ >= 0) {
    e = Err(cudaEventRecord(static_cast<cudaEvent_t>(event_[cur_]), static_cast<cudaStream_t>(stream)),
            "cudaEventRecord");
  }
  cur_ = -1;
  return e;
}

namespace {
std::string CopySync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::string e = Err(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync");
  if (e.empty()) e = Err(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return e;
}
}  // namespace

std::string CopyToHostSync(void* host, const void* device, size_t bytes, void* stream) {
  return CopySync(host, device, bytes, cudaMemcpyDeviceToHost, stream);
}

std::string DeviceAlloc(void** p, size_t bytes) {
  ++g_allocations;
  return Err(cudaMalloc(p, bytes), "cudaMalloc");
}

int64_t Allocations() { return g_allocations.load(); }

void DeviceFree(void* p) {
  if (p != nullptr) cudaFree(p);
}

std::string CopyDeviceAsync(void* dst, const void* src, size_t bytes, void* stream) {
  return Err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                             static_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync (copy-on-write of a variable)");
}

std::string ThenRunOnHost(void* stream, void (*fn)(void*), void* arg) {
  return Err(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg), "cudaLaunchHostFunc");
}

std::string DeviceInfo(std::string* name, int* major, int* minor) {
  int dev = 0;
  std::string e = Err(cudaGetDevice(&dev), "cudaGetDevice");
  if (!e.empty()) return e;
  cudaDeviceProp prop;
  e = Err(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  if (!e.empty()) return e;
  *name = prop.name;
  *major = prop.major;
  *minor = prop.minor;
  return "";
}

void Versions(int* driver, int* runtime) {
  *driver = 0;
  if (cudaDriverGetVersion(driver) != cudaSuccess) *driver = 0;
  *runtime = CUDART_VERSION;
}

std::string PointerDevice(const void* p, int* device) {
  cudaPointerAttributes a;
  std::string e = Err(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
  if (!e.empty()) {
    cudaGetLastError();  // not sticky: a host pointer is an answer, not a failure
    return e;
  }
  *device = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
  return "";
}

std::string CurrentDevice(int* device) { return Err(cudaGetDevice(device), "cudaGetDevice"); }

std::string StreamWaitStreams(void* stream, const void* const* others, int n) {
  for (int i = 0; i < n; ++i) {
    cudaEvent_t ev;
    std::string e = Err(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    if (!e.empty()) return e;
    e = Err(cudaEventRecord(ev, static_cast<cudaStream_t>(const_cast<void*>(others[i]))),
            "cudaEventRecord (on the arrays' stream)");
    if (e.empty()) {
      e = Err(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), ev, 0), "cudaStreamWaitEvent");
    }
    cudaEventDestroy(ev);  // released once complete
    if (!e.empty()) return e;
  }
  return "";
}

std::string CopyHostToDeviceSync(void* device, const void* host, size_t bytes, void* stream) {
  return CopySync(device, host, bytes, cudaMemcpyHostToDevice, stream);
}

std::string StreamCreate(void** stream, bool non_blocking) {
  cudaStream_t s;
  const std::string e = Err(
      cudaStreamCreateWithFlags(&s, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault),
      "cudaStreamCreateWithFlags");
  *stream = e.empty() ? static_cast<void*>(s) : nullptr;
  return e;
}

std::string StreamDestroy(void* stream) {
  return Err(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy");
}

std::string StreamSynchronize(void* stream) {
  return Err(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

std::string DeviceSynchronize() { return Err(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // namespace cuda
}  // namespace tfclip
