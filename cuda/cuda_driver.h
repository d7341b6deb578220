// tfclip core, CUDA: the multi-tensor launcher. The CUDA twin of csrc/core/cpu_driver.h.
//
// This header includes no CUDA, TF or pybind11 header, so the TF glue and the pybind11 module
// (plain C++ compilers) call it. A stream is a `cudaStream_t` passed as void*.
//
// A step is: one host-to-device copy of the tensor table (from pinned host memory the caller
// owns), then a fixed number of launches whatever the tensor count:
//   norm kernel      per-chunk fp64 sums of squares into fixed slots (one slot per chunk)
//   finalize kernel  one block: reduces the slots in a fixed order, writes the norm, each
//                    tensor's clip factor and the apply/non-finite flags to device memory
//   apply kernel     reads the flags and factors there, then grad, var, slots once each
//   sparse kernel    only with IndexedSlices gradients: their rows (csrc/core/sparse.h)
// Nothing waits on the host, except nonfinite='raise', which must learn whether to fail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/core/multi_tensor.h"
#include "csrc/core/sparse.h"

namespace tfclip {
namespace cuda {

// GPU chunks are smaller than the CPU's: a chunk is one CUDA block's share of a tensor.
constexpr int64_t kCudaChunkElems = int64_t{1} << 15;
constexpr int kThreads = 512;  // per block, norm and apply kernels

// Where each part of a step's workspace lives, from the tensor sizes alone. The caller
// allocates `host_bytes` of pinned host memory and `device_bytes` of device memory (TF's
// allocators in the op, cudaMallocHost/cudaMallocAsync in _core), both 256-byte aligned.
// The host buffer must stay alive until the step's copy has run on the stream.
struct CudaPlan {
  ChunkPlan plan;
  int n = 0;
  const SparsePlan* sparse = nullptr;  // IndexedSlices gradients (owned by the caller)
  size_t host_bytes = 0;    // the table: tensors, chunks, block starts
  size_t device_bytes = 0;  // the table's device copy, then partials, clip factors, status
  // Offsets into the device buffer.
  size_t off_partials = 0, off_factors = 0, off_status = 0;
};
// sizes: of each gradient (sparse: its slices). `sparse` (may be null) joins the table; it must
// outlive the step's launch.
void PlanCudaStep(const int64_t* sizes, int n, CudaPlan* p, const SparsePlan* sparse = nullptr);

// Outputs a step writes in device memory (each may be null).
struct CudaOutputs {
  void* norm = nullptr;  // scalar of norm_dtype
  DType norm_dtype = DType::kFloat;
  bool* applied = nullptr;  // scalar bool
};

// The global norm of `ts` into out.norm. Two launches.
std::string CudaGlobalNorm(const TensorView* ts, int n, const CudaPlan& p, void* host_ws,
                           void* dev_ws, const CudaOutputs& out, void* stream);

// out[i] = in[i] * cast<T>(scale), scale from the norm of `in` (or the given one). The norm is
// rounded to out.norm_dtype before the scale is computed, as TF does. Three launches.
std::string CudaClipByGlobalNorm(const TensorView* in, const TensorView* outs, int n,
                                 double clip_norm, bool has_use_norm, double use_norm,
                                 const CudaPlan& p, void* host_ws, void* dev_ws,
                                 const CudaOutputs& out, void* stream);

// Both passes of a clip-and-apply step. Validated inputs only (as ClipApplyCpu). With
// nonfinite='raise' the call waits for the stream and sets *nonfinite; otherwise it returns
// at once and *nonfinite is left false (the device-side `applied` flag tells).
std::string CudaClipApply(RuleKind rule, const HParams& hp, const ClipConfig& cfg,
                          const ApplyTensor* ts, int n, const CudaPlan& p, void* host_ws,
                          void* dev_ws, const CudaOutputs& out, void* stream, bool* nonfinite);

// Launches the last step issued from this thread (for tests and benchmarks: "launches per
// step"), and the stream it was issued on.
int LastStepLaunches();
void* LastStepStream();

}  // namespace cuda
}  // namespace tfclip
