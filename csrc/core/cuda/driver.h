// tfclip core, CUDA: the multi-tensor launcher. The CUDA twin of the CPU driver (ClipApplyCpu
// and its passes), which it does not include: the step types both take (StepArgs, StepResult)
// are csrc/core/step.h. The code behind it: csrc/core/cuda/kernels.cuh lists the .cu files.
//
// This header includes no CUDA, TF or pybind11 header, so the TF glue and the pybind11 module
// (plain C++ compilers) call it. A stream is a `cudaStream_t` passed as void*.
//
// A step is: one host-to-device copy of the tensor table (from pinned host memory the caller's
// CudaStepMemory gives), then a fixed number of launches whatever the tensor count:
//   norm kernel      per-chunk fp64 sums of squares into fixed slots (one slot per chunk)
//   finalize kernel  one block: reads the hyper-parameters, clip and step counter given in
//                    device memory, checks them, computes the step constants (bias
//                    corrections), reduces the slots in a fixed order, writes the norm, each
//                    tensor's clip factor and the apply flag to device memory
//   apply kernel     reads the flag, constants and factors there, then grad, var, slots once
//   sparse kernel    only with IndexedSlices gradients: their rows (csrc/core/sparse.h)
// Nothing waits on the host, except nonfinite='raise', which must learn whether to fail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/core/chunk_plan.h"
#include "csrc/core/clip.h"
#include "csrc/core/sparse.h"
#include "csrc/core/step.h"
#include "csrc/core/tensors.h"

namespace tfclip {
namespace cuda {

// GPU chunks are smaller than the CPU's: a chunk is one CUDA block's share of a tensor.
constexpr int64_t kCudaChunkElems = int64_t{1} << 15;
constexpr int kThreads = 512;  // per block, norm and apply kernels
// A chunk of at most kWarpChunkElems elements is summed and applied by one warp, and up to
// kThreads / 32 such chunks share a block (one per warp); a larger chunk has a block to itself.
// Which threads sum a chunk, in what order, depends on its size alone, so a tensor's partial
// sums are the same bits whatever tensors are beside it. Without this, 10,000 tensors of a few
// elements were two blocks, each paying a 512-thread reduction per chunk, one chunk after another.
constexpr int64_t kWarpChunkElems = 2048;
constexpr int kWarpsPerBlock = kThreads / 32;

// Where a step's memory comes from: TF's allocators in the op, an OwnedWorkspace in _core.
// Acquire gives pinned host memory (the tensor table) and device memory, both kWorkspaceAlign-
// byte aligned, for one step on the stream. Release is called exactly once after a successful
// Acquire, on every path, errors included, after the step's last launch: the host table must
// stay alive until the stream has passed its upload, so Release hands it back in stream order.
constexpr size_t kWorkspaceAlign = 256;
class CudaStepMemory {
 public:
  virtual ~CudaStepMemory() = default;
  virtual std::string Acquire(size_t host_bytes, size_t device_bytes, void** host,
                              void** device) = 0;
  virtual std::string Release() = 0;
};

// Scalars read on the device: each non-null pointer is a device-memory scalar that replaces
// the host value (a learning-rate schedule's value or Keras's step, computed on the GPU). The
// finalize kernel reads and checks them; the host never waits for them.
struct DeviceScalars {
  const double* hparams[kNumHParams] = {};  // indexed by HP
  const double* clip = nullptr;
  const double* use_norm = nullptr;
  const double* grad_scale = nullptr;  // ClipConfig::grad_scale (a loss scale's 1 / scale)
  // Stochastic rounding's seed, step and first tensor position (HParams::rounding_seed,
  // rounding_step, rounding_tensor).
  const double* rounding[3] = {nullptr, nullptr, nullptr};
  // A step counter in device memory (int64): t = *iterations + step, advanced by the finalize
  // kernel when the step is applied. (StepArgs::iterations is for host counters.)
  int64_t* iterations = nullptr;
  bool any() const;
};

// Outputs a step writes in device memory (each may be null).
struct CudaOutputs {
  void* norm = nullptr;  // scalar of norm_dtype
  DType norm_dtype = DType::kFloat;
  bool* applied = nullptr;  // scalar bool
  // Each tensor's pre-clip norm (n of tensor_norms_dtype): the finalize kernel sums each
  // tensor's norm-pass partials (in chunk order up to 32 chunks, by a warp beyond), in an order
  // that depends on the tensor alone; NaN when no norm pass ran. Written whatever the
  // non-finite policy decides.
  void* tensor_norms = nullptr;
  DType tensor_norms_dtype = DType::kFloat;
  // An apply step's count of clipped units per tensor (n int64; StepArgs::agc_clipped): with
  // clip_mode agc counted on the device from the units' scales (AGC's tensor kernel, one thread
  // a tensor, in unit order), 0 in the other modes (the finalize kernel). Written with
  // tensor_norms, whatever the non-finite policy decides.
  int64_t* clipped_units = nullptr;
};

// The global norm of `ts` into out.norm. Two launches.
std::string CudaGlobalNorm(const TensorView* ts, int n, CudaStepMemory* mem,
                           const CudaOutputs& out, void* stream);

// The clip op's clip_norm and use_norm when they are in device memory (each may be null: the
// host value), scalars of `dtype` (float or double: the op's Tnorm).
struct ClipOpScalars {
  const void* clip_norm = nullptr;
  const void* use_norm = nullptr;
  DType dtype = DType::kFloat;
};

// out[i] = in[i] * cast<T>(scale), scale from the norm of `in` (or the given one). The norm is
// rounded to out.norm_dtype before the scale is computed, as TF does. Three launches. A
// clip_norm read on the device that is not finite and > 0 makes the scale, and so every
// output, NaN (the host value is checked by the caller).
std::string CudaClipByGlobalNorm(const TensorView* in, const TensorView* outs, int n,
                                 double clip_norm, bool has_use_norm, double use_norm,
                                 const ClipOpScalars& dev, CudaStepMemory* mem,
                                 const CudaOutputs& out, void* stream);

// Both passes of a clip-and-apply step: the CUDA ClipApplyCpu. Host-side values (args.hp,
// args.cfg) are checked before anything is queued, sparse indices too (r->error: nothing
// written); values in device memory (ds) are checked by the finalize kernel, and a bad one
// writes nothing and leaves `applied` false. With nonfinite='raise' the call waits for the
// stream and reports a non-finite norm or a bad device value in r->error; otherwise it returns
// at once (the device-side `applied` flag tells). Returns "" or a CUDA error.
std::string CudaClipApply(const StepArgs& args, const DeviceScalars& ds, CudaStepMemory* mem,
                          const CudaOutputs& out, void* stream, StepResult* r);

// Launches the last step issued from this thread (for tests and benchmarks: "launches per
// step"), and the stream it was issued on.
int LastStepLaunches();
void* LastStepStream();
// The blocks of the last step's norm and dense apply launches (the packing above).
int64_t LastStepBlocks();

// Groups a plan's chunks into CUDA blocks (plan->block_begin): each chunk over kWarpChunkElems
// alone, the others kWarpsPerBlock at a time in list order.
void PackCudaBlocks(ChunkPlan* plan);

}  // namespace cuda
}  // namespace tfclip
