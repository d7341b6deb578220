// tfclip's CUDA emulation: the subset of the CUDA language and runtime that cuda/*.cu uses,
// for the host C++ compiler, so the production kernels and launcher execute on the CPU in CI
// (CMake -DTFCLIP_CUDA_EMULATION=ON). It is not a second implementation of any kernel: the very
// cuda/*.cu sources are compiled against it (force-included, and found as <cuda_runtime.h>).
//
// The execution model it gives the kernels:
//   - a block's threads run concurrently as fibers (one stack each) on the stream's worker
//     thread; the next fiber to run at every switch is drawn at random (seeded, reproducible:
//     TFCLIP_EMU_SEED), so code that relies on an order the hardware does not promise sees
//     another order and gives another result;
//   - __syncthreads() is a real barrier over every thread of the block; a barrier that cannot
//     complete (some threads exited or wait elsewhere) fails the launch, it never hangs;
//   - __shfl_xor_sync exchanges values between the 32 lanes of a warp: every lane named in the
//     mask must arrive before any lane gets its partner's value;
//   - blocks of a grid run one after another; __shared__ variables are one per worker thread;
//   - streams are in-order queues, each run by its own host thread, asynchronous to the caller;
//     events, cudaStreamWaitEvent and cudaLaunchHostFunc keep stream order; the default stream
//     (0) is one more queue (the legacy stream's implicit synchronization is not modelled);
//   - device memory is host memory allocated and registered here, so cudaPointerGetAttributes
//     tells device from host pointers; copies from pageable host memory are staged at the call,
//     from pinned memory (cudaMallocHost) they read the buffer when the stream reaches them.
// Launches use TFCLIP_LAUNCH(kernel, grid, block, smem, stream)(args...), which cuda/*.cu
// defines as kernel<<<grid, block, smem, stream>>>(args...) under nvcc.
#pragma once

#define TFCLIP_CUDA_EMULATION 1

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------- language keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// One per worker thread: blocks run one after another there, so a block's threads share it.
#define __shared__ static thread_local
#define __restrict__ __restrict

#define CUDART_VERSION 13000

// Device math functions are global names in CUDA.
using std::isfinite;
using std::isinf;
using std::isnan;

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// ---------------------------------------------------------------- runtime types
enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3,
};

struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

struct cudaDeviceProp {
  char name[256];
  int major;
  int minor;
  int multiProcessorCount;
  int maxThreadsPerBlock;
  size_t totalGlobalMem;
};

namespace tfclip_emu {
struct Stream;
struct Event;
}  // namespace tfclip_emu
typedef tfclip_emu::Stream* cudaStream_t;
typedef tfclip_emu::Event* cudaEvent_t;
typedef void (*cudaHostFn_t)(void*);

#define cudaStreamDefault 0x0
#define cudaStreamNonBlocking 0x1
#define cudaEventDefault 0x0
#define cudaEventDisableTiming 0x2
#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

// ---------------------------------------------------------------- runtime API
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void* p, cudaStream_t s);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags = 0);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* arg);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);

cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d);
cudaError_t cudaDriverGetVersion(int* v);
cudaError_t cudaRuntimeGetVersion(int* v);

// ---------------------------------------------------------------- execution model
namespace tfclip_emu {

// What the current (emulated) thread sees; set by the fiber scheduler.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
ThreadState& Current();

void SyncThreads();
// Exchanges `bytes` (<= 8) of `v` with lane (own lane ^ lane_mask) across the lanes of `mask`.
void ShuffleXor(unsigned mask, void* v, size_t bytes, int lane_mask);

// Queues `body` (one emulated thread's run of the kernel) as a grid on stream `s`; records a
// launch error (cudaGetLastError) for a bad configuration.
void EnqueueLaunch(const char* name, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   std::function<void()> body);

// TFCLIP_LAUNCH(kernel, grid, block, smem, stream)(args...): the arguments are converted to the
// kernel's parameter types and copied at the launch, as CUDA does.
template <typename... P>
struct Launch {
  void (*kernel)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel argument count");
    auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(a)...);
    void (*k)(P...) = kernel;
    EnqueueLaunch(name, grid, block, smem, stream, [k, params] { std::apply(k, *params); });
  }
};
template <typename... P>
Launch<P...> MakeLaunch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream) {
  return Launch<P...>{kernel, name, grid, block, smem, stream};
}

}  // namespace tfclip_emu

#define threadIdx (::tfclip_emu::Current().thread_idx)
#define blockIdx (::tfclip_emu::Current().block_idx)
#define blockDim (::tfclip_emu::Current().block_dim)
#define gridDim (::tfclip_emu::Current().grid_dim)

#define TFCLIP_LAUNCH(kernel, grid, block, smem, stream) \
  ::tfclip_emu::MakeLaunch(kernel, #kernel, grid, block, smem, stream)

inline void __syncthreads() { ::tfclip_emu::SyncThreads(); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
  (void)width;
  ::tfclip_emu::ShuffleXor(mask, &v, sizeof(T), lane_mask);
  return v;
}

inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
