// tfclip's CUDA emulation: the subset of the CUDA language and runtime that cuda/*.cu uses,
// for the host C++ compiler, so the production kernels and launcher execute on the CPU in CI
// (CMake -DTFCLIP_CUDA_EMULATION=ON). It is not a second implementation of any kernel: the very
// cuda/*.cu sources are compiled against it (force-included, and found as <cuda_runtime.h>).
//
// The execution model it gives the kernels:
//   - a block's threads run concurrently as fibers (one stack each) on the stream's worker
//     thread, switched only at __syncthreads, __syncwarp and warp shuffles; which fiber runs
//     next is the launch's schedule (TFCLIP_EMU_SCHEDULE, below), so code that relies on an
//     order the hardware does not promise sees another order and gives another result;
//   - __syncthreads() is a real barrier over every thread of the block; a barrier that cannot
//     complete (some threads exited or wait elsewhere) fails the launch, it never hangs;
//   - __shfl_xor_sync exchanges values between the 32 lanes of a warp: every lane named in the
//     mask must arrive before any lane gets its partner's value; __syncwarp(mask) is a barrier
//     over those lanes;
//   - __shared__ data is declared with TFCLIP_SHARED / TFCLIP_SHARED_ARRAY (plain __shared__
//     declarations under nvcc; a bare __shared__ does not compile here) and every access to it
//     is checked: two threads touching one element between the same pair of barriers, one of
//     them writing, fail the launch with the kernel, the array, the element and both threads,
//     whatever order the schedule picked (like Oclgrind's race plugin and compute-sanitizer's
//     racecheck). A shuffle orders no memory: lanes of one warp are ordered only by __syncwarp
//     (TFCLIP_EMU_RACECHECK=0 turns the check off);
//   - blocks of a grid run one after another; __shared__ variables are one per worker thread;
//   - streams are in-order queues, each run by its own host thread, asynchronous to the caller;
//     events, cudaStreamWaitEvent and cudaLaunchHostFunc keep stream order; the default stream
//     (0) is one more queue (the legacy stream's implicit synchronization is not modelled);
//   - device memory is host memory allocated and registered here, so cudaPointerGetAttributes
//     tells device from host pointers; copies from pageable host memory are staged at the call,
//     from pinned memory (cudaMallocHost) they read the buffer when the stream reaches them.
// Launches use TFCLIP_LAUNCH(kernel, grid, block, smem, stream)(args...), which cuda/*.cu
// defines as kernel<<<grid, block, smem, stream>>>(args...) under nvcc.
//
// Schedules (TFCLIP_EMU_SCHEDULE: one policy, a comma-separated list, or "cycle", the default,
// for all four): a kernel's n-th launch runs under the n-th policy of the list (counted per
// kernel instantiation), so one run of the suite gives every kernel every policy.
//   random     the next fiber drawn uniformly among the runnable ones (seeded: TFCLIP_EMU_SEED)
//   warp-desc  warp-greedy: the highest-numbered warp with a runnable lane runs, through its
//              shuffles, until every lane of it waits at a __syncthreads (or exited); then the
//              next warp down. Warp 15 writes before warp 0 has read, as a GPU's scheduler may.
//   warp-asc   the same from warp 0 up: warp 0 reads before the others have written.
//   thread     one-thread-greedy: a fixed priority per thread (thread 0, the last thread or a
//              random one first, the rest in a random order): the first runs until it blocks,
//              and whenever it can run again it runs before any other.
// TFCLIP_EMU_STATS=path writes, at exit, each kernel (its name at the launch and its offset in
// the module, which `nm -C` turns into the instantiation) with its launches under each policy.
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
// __shared__ data is declared with TFCLIP_SHARED(T, name) / TFCLIP_SHARED_ARRAY(T, name, n)
// (below), so the race detector sees every access; a bare __shared__ would go unchecked.
#define __shared__ \
  _Pragma("GCC error \"declare __shared__ data with TFCLIP_SHARED or TFCLIP_SHARED_ARRAY (cuda/emulation/cuda_runtime.h) so that the emulation checks it for races\"")
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
void SyncWarp(unsigned mask);
// Exchanges `bytes` (<= 8) of `v` with lane (own lane ^ lane_mask) across the lanes of `mask`.
void ShuffleXor(unsigned mask, void* v, size_t bytes, int lane_mask);

// Queues `body` (one emulated thread's run of the kernel) as a grid on stream `s`; records a
// launch error (cudaGetLastError) for a bad configuration.
// `kernel` identifies the kernel (an instantiation of a template is a kernel of its own) for
// the per-kernel cycle of schedules.
void EnqueueLaunch(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t s, std::function<void()> body);

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
    EnqueueLaunch(reinterpret_cast<const void*>(k), name, grid, block, smem, stream,
                  [k, params] { std::apply(k, *params); });
  }
};
template <typename... P>
Launch<P...> MakeLaunch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream) {
  return Launch<P...>{kernel, name, grid, block, smem, stream};
}

// ---------------------------------------------------------------- __shared__ data, checked
// The race detector's record of one element within the current barrier interval: the last
// writer and up to two readers (thread index, and the __syncwarp count of its warp then).
struct ShadowCell {
  uint64_t interval = 0;  // the interval the records belong to (0: none)
  int32_t writer = -1;
  int32_t reader[2] = {-1, -1};
  uint32_t writer_wsync = 0;
  uint32_t reader_wsync[2] = {0, 0};
};
// Checks (and records) one access by the running emulated thread; outside a kernel, nothing.
void SharedAccess(const char* array, size_t index, ShadowCell* cell, bool write);

template <typename T>
class SharedRef {
 public:
  SharedRef(T* p, ShadowCell* c, const char* name, size_t i) : p_(p), c_(c), name_(name), i_(i) {}
  operator T() const {
    SharedAccess(name_, i_, c_, false);
    return *p_;
  }
  // static_cast<Enum>(s_mode) and the like, as on the plain type.
  template <typename U, typename = std::enable_if_t<!std::is_same<U, T>::value>>
  explicit operator U() const {
    return static_cast<U>(static_cast<T>(*this));
  }
  const SharedRef& operator=(const T& v) const {
    SharedAccess(name_, i_, c_, true);
    *p_ = v;
    return *this;
  }
  const SharedRef& operator=(const SharedRef& o) const { return *this = static_cast<T>(o); }
  const SharedRef& operator+=(const T& v) const { return *this = static_cast<T>(*this) + v; }
  const SharedRef& operator-=(const T& v) const { return *this = static_cast<T>(*this) - v; }
  const SharedRef& operator*=(const T& v) const { return *this = static_cast<T>(*this) * v; }

 private:
  T* p_;
  ShadowCell* c_;
  const char* name_;
  size_t i_;
};

template <typename T, size_t N>
class SharedArray {
 public:
  // constexpr: the thread_local is constant-initialized, with no guard for the fibers to race on.
  constexpr explicit SharedArray(const char* name) : name_(name) {}
  SharedRef<T> operator[](size_t i) { return SharedRef<T>(&data_[i], &shadow_[i], name_, i); }

 private:
  T data_[N] = {};
  ShadowCell shadow_[N];
  const char* name_;
};

template <typename T>
class SharedVar {
 public:
  constexpr explicit SharedVar(const char* name) : name_(name) {}
  operator T() { return Ref(); }
  template <typename U, typename = std::enable_if_t<!std::is_same<U, T>::value>>
  explicit operator U() {
    return static_cast<U>(static_cast<T>(Ref()));
  }
  SharedVar& operator=(const T& v) {
    Ref() = v;
    return *this;
  }
  SharedVar& operator+=(const T& v) {
    Ref() += v;
    return *this;
  }

 private:
  SharedRef<T> Ref() { return SharedRef<T>(&data_, &shadow_, name_, SIZE_MAX); }
  T data_{};
  ShadowCell shadow_;
  const char* name_;
};

}  // namespace tfclip_emu

// TFCLIP_SHARED(T, name) is `__shared__ T name;`, TFCLIP_SHARED_ARRAY(T, name, n) is
// `__shared__ T name[n];` under nvcc (csrc/core/cuda_*.cu). Here: one per worker thread
// (blocks run one after another there, so a block's threads share it), every access checked.
#define TFCLIP_SHARED(T, name) static thread_local ::tfclip_emu::SharedVar<T> name(#name)
#define TFCLIP_SHARED_ARRAY(T, name, n) \
  static thread_local ::tfclip_emu::SharedArray<T, (n)> name(#name)

#define threadIdx (::tfclip_emu::Current().thread_idx)
#define blockIdx (::tfclip_emu::Current().block_idx)
#define blockDim (::tfclip_emu::Current().block_dim)
#define gridDim (::tfclip_emu::Current().grid_dim)

#define TFCLIP_LAUNCH(kernel, grid, block, smem, stream) \
  ::tfclip_emu::MakeLaunch(kernel, #kernel, grid, block, smem, stream)

inline void __syncthreads() { ::tfclip_emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::tfclip_emu::SyncWarp(mask); }

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
