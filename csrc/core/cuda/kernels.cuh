// tfclip core, CUDA: what the driver's .cu files share (and nothing outside them includes):
// the tensor table as the kernels see it, the fixed-order warp and block sums, the chunk crews,
// the step's plan and host table layout, and the launchers each kernel file exports to the
// driver (host functions: no __global__ symbol crosses a file, relocatable device code is off).
//   cuda_driver.cu        the entry points of cuda_driver.h: each op's launch sequence
//   cuda_plan.cu          the host side of a step: plan, table layout and upload, chunk ranges
//   cuda_norm.cu          the norm kernel and AGC's unit-sum kernels
//   cuda_finalize.cu      the finalize kernel and the clip op's scale kernel
//   cuda_apply.cu         the dense apply kernel and the trust-ratio kernels (Lamb)
//   cuda_sparse_apply.cu  the IndexedSlices apply kernel
//   cuda_factored.cu      a factored rule's passes (Adafactor; csrc/core/factored.h)
//   cuda_workspace.cu     the workspace (cuda_workspace.h), and the copies _core makes
// The apply kernels are most of the device code (one instantiation per rule and slot count), so
// they have files of their own: the build compiles them side by side.
//
// Built with --fmad=false (CMakeLists.txt): nvcc would otherwise contract a*b+c into FMA where
// the CPU build does not, and the apply pass would differ from the CPU in the last bit.
#pragma once

#include "csrc/core/cuda/driver.h"

#include "csrc/core/agc.h"
#include "csrc/core/apply_elem.h"
#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"
#include "csrc/core/sparse.h"
#include "csrc/core/validate.h"

#include <cuda_runtime.h>

// Under nvcc a launch is kernel<<<...>>>; the CPU emulation (cuda/emulation/cuda_runtime.h, CI's
// way to run these kernels) defines its own.
#ifndef TFCLIP_LAUNCH
#define TFCLIP_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif
// __shared__ data: plain __shared__ declarations under nvcc; the emulation's own definitions
// check every access for races between its threads.
#ifndef TFCLIP_SHARED
#define TFCLIP_SHARED(T, name) __shared__ T name
#define TFCLIP_SHARED_ARRAY(T, name, n) __shared__ T name[n]
#endif

// Planted faults, for scripts/planted_faults.sh only. The emulated build (CMake's
// TFCLIP_CUDA_EMULATION) defines TFCLIP_PLANTED_FAULT: there TFCLIP_PLANTED(NAME) is true where
// the environment's TFCLIP_PLANT names that fault (read once per site), so one build serves the
// emulated suite (no fault) and every planted run. Every other build compiles each to `false`,
// the fault away. Each site names its fault where it acts.
#ifdef TFCLIP_PLANTED_FAULT
#include <cstdlib>
#include <cstring>
namespace tfclip {
namespace cuda {
inline bool PlantedIs(const char* name) {
  const char* planted = std::getenv("TFCLIP_PLANT");
  return planted != nullptr && std::strcmp(planted, name) == 0;
}
}  // namespace cuda
}  // namespace tfclip
#define TFCLIP_PLANTED(name)                                            \
  ([] {                                                                 \
    static const bool planted = ::tfclip::cuda::PlantedIs(#name);       \
    return planted;                                                     \
  }())
#else
#define TFCLIP_PLANTED(name) false
#endif

#include <algorithm>
#include <cstring>
#include <sstream>

// A device function the kernels call rather than inline (cuda_apply.cu's ApplyRange: compile
// time). The emulation's host compiler spells it as GCC does.
#ifdef __CUDACC__
#define TFCLIP_DEVICE_NOINLINE __device__ __noinline__
#else
#define TFCLIP_DEVICE_NOINLINE __device__ __attribute__((noinline))
#endif
#include <string>
#include <type_traits>
#include <vector>

namespace tfclip {
namespace cuda {

// ---------------------------------------------------------------- the tensor table
struct DevTensor {
  void* var;          // apply: the variable; scale: the output
  const void* grad;   // apply: the gradient (sparse: its slices); norm/scale: the input
  void* slots[kMaxSlots];
  int64_t size;       // of grad
  int64_t first_chunk;
  int64_t num_chunks;
  int64_t width;      // sparse: elements per row
  int32_t var_dtype;
  int32_t grad_dtype;
  int32_t sparse;     // 1: applied by the sparse kernel; its chunks are the norm's only
  int32_t bf16_slots;  // 1: a float variable's slots are bfloat16 (SlotStorage::kBFloat16)
  int32_t q8_slots;    // 1: a float variable's slots are int8 state (SlotStorage::kInt8)
  int64_t first_unit;  // sparse: its units of the sparse plan (consecutive)
  int64_t num_units;
  // AGC (csrc/core/agc.h): its units' scales in the workspace (null in the other modes), and
  // its unit count; element i is in unit i % units.
  const double* unit_scale;
  int64_t units;
  float* absmax[kMaxSlots];  // int8 state: each slot's absmax (quant8.h)
  // A factored rule's (Adafactor; factored.h): the last two axes (0, 0 below rank 2), and
  // whether the full v is kept.
  int64_t fac_rows;
  int64_t fac_cols;
  int32_t fac_full_v;
};

// A factored rule's plan (csrc/core/factored.h; uploaded with the tensor table) and its device
// scratch, as the CPU driver's FactoredScratch has them.
struct DevFactored {
  const FactoredTile* tiles;
  int64_t ntiles;
  const int64_t* tile_off;  // n + 1 each
  const int64_t* row_off;
  const int64_t* part_off;
  const int64_t* mat_off;
  double* rows;    // each row's sum of q
  double* part;    // each tile's column partials
  double* r_mean;  // each matrix's mean of r
  double* w_part;  // each tile's sum of w^2
  double* u_part;  // each tile's sum of u^2
};

// AGC's norm pass and scales (csrc/core/agc.h): the plan's tables (uploaded with the tensor
// table) and the device buffers, as the CPU driver's StepScratch has them.
struct DevAgc {
  const AgcTile* tiles;
  int64_t ntiles;
  const int64_t* unit_off;  // n + 1
  const int64_t* part_off;  // n + 1
  const int64_t* blocks;    // n
  const SparseSpan* spans;
  int64_t nspans;
  const int64_t* order;     // the sparse plan's (spans index its urows and ustart)
  const int64_t* urows;
  const int64_t* ustart;
  double* part_g;
  double* part_w;
  double* unit_g;
  double* unit_w;
  double* unit_scale;
  double* vsq;  // n: an IndexedSlices gradient's values' sum of squares
  int64_t* clipped;  // n: each tensor's count of clipped units (CudaOutputs), or null
  int64_t nunits;
  int n;
  double clip, eps;
  const double* dev_clip;  // the clip in device memory, or null
};

// The sparse apply pass's table (csrc/core/sparse.h), uploaded with the tensor table.
struct DevSparse {
  const SparseUnit* units;
  const int64_t* order;
  const int64_t* urows;
  const int64_t* ustart;
  int64_t nunits;
};

struct DevChunk {
  int64_t begin;
  int64_t end;
  int32_t tensor;
  int32_t pad;
};

struct DevStatus {
  double norm;
  double scale;  // the clip op's scale (kGlobalNorm)
  int finite;
  int apply;
  int bad;           // a bad value read on the device: 1 + HP index, or -1 clip, -2 use_norm,
                     // -3..-5 ClipConfigError, -6/-7 stochastic rounding's seed/step
  double bad_value;
};

// The per-step constants the apply kernels read: the step's rule's RuleConsts<Rule> (its own
// constants in float and double, csrc/core/apply_elem.h), from the host (Upload) or computed by
// the finalize kernel from scalars in device memory. One slot in the workspace, sized and aligned
// for the largest rule's; the kernels, each compiled for one rule, read it as that rule's.
#define TFCLIP_RULE_CONSTS_SIZE(kind, Struct, ...) sizeof(RuleConsts<Struct>),
#define TFCLIP_RULE_CONSTS_ALIGN(kind, Struct, ...) alignof(RuleConsts<Struct>),
constexpr size_t kDevConstsBytes = std::max({TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_CONSTS_SIZE)});
constexpr size_t kDevConstsAlign = std::max({TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_CONSTS_ALIGN)});
#undef TFCLIP_RULE_CONSTS_SIZE
#undef TFCLIP_RULE_CONSTS_ALIGN

struct alignas(kDevConstsAlign) DevConsts {
  unsigned char bytes[kDevConstsBytes];
  template <typename Rule>
  TFCLIP_HD const RuleConsts<Rule>* As() const {
    static_assert(sizeof(RuleConsts<Rule>) <= kDevConstsBytes, "a rule's constants fit the slot");
    return reinterpret_cast<const RuleConsts<Rule>*>(bytes);
  }
  template <typename Rule>
  TFCLIP_HD void Set(const RuleConsts<Rule>& c) {
    static_assert(sizeof(RuleConsts<Rule>) <= kDevConstsBytes, "a rule's constants fit the slot");
    *reinterpret_cast<RuleConsts<Rule>*>(bytes) = c;
  }
};

// Device pointers into the workspace, passed to every kernel by value.
struct Table {
  const DevTensor* tensors;
  const DevChunk* chunks;
  const int64_t* block_begin;
  double* partials;
  // A trust-ratio rule (rules.h): the slot pass's sums of w^2 and u^2, two per chunk then two
  // per sparse unit, and per tensor (two each); null for the other rules.
  double* trust;
  double* trust_sums;
  ClipFactor* factors;
  DevStatus* status;
  DevConsts* consts;
  const int32_t* many;  // the tensors of over kThreadChunks chunks (a warp sums each one's)
  // int8 state's codes (quant8.h) in the workspace: the signed one, then the unsigned one, and
  // their formulas' bands (Q8Bands) in the same order; null in a step without int8 state.
  const float* codes;
  const Q8Bands* bands;
  int nmany;
  int n;
  int64_t nchunks;
};

// The finalize kernel sums a tensor's chunk partials in one thread, in chunk order, up to this
// many chunks; a tensor of more (an embedding of 31M elements has 954) gets a warp: lane l sums
// chunks l, l + 32, ..., then the butterfly. Either way the order follows from the tensor's own
// chunk count, so its norm is the same bits whatever is beside it.
constexpr int64_t kThreadChunks = 32;

// ---------------------------------------------------------------- device helpers
// Sum over the warp in a fixed order (butterflies): the same bits on every run, in every lane.
__device__ __forceinline__ double WarpSum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block in a fixed order (warp butterflies, then warp 0 over the warp sums):
// the same bits on every run. The result is valid in thread 0.
template <int kBlock>
__device__ double BlockSum(double v) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block size");
  TFCLIP_SHARED_ARRAY(double, warp_sums, kBlock / 32);
  v = WarpSum(v);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (!TFCLIP_PLANTED(REUSE_BARRIER)) __syncthreads();  // warp_sums may still be read from the previous call
  if (lane == 0) warp_sums[w] = v;
  if (!TFCLIP_PLANTED(PUBLISH_BARRIER)) __syncthreads();
  double r = 0.0;
  if (w == 0) r = WarpSum(lane < kBlock / 32 ? warp_sums[lane] : 0.0);
  return r;
}

// The threads that work on one chunk: the whole block for a chunk over kWarpChunkElems, one
// warp for a smaller one (PackCudaBlocks gives such chunks a block of their own, or packs them
// one per warp). `rank` is this thread's index among them, `size` their count.
struct Crew {
  int rank;
  int size;
  bool warp;
  // The crew's sum of v, valid in rank 0 (every thread of a block crew must call it).
  __device__ double Sum(double v) const { return warp ? WarpSum(v) : BlockSum<kThreads>(v); }
};

// Calls f(c, crew) for each chunk c of this block with the threads that work on it: one call
// per warp (its own chunk), or one per chunk with the whole block.
template <typename F>
__device__ void ForEachChunk(const Table& t, F&& f) {
  const int64_t cb = t.block_begin[blockIdx.x], ce = t.block_begin[blockIdx.x + 1];
  if (cb < ce && t.chunks[cb].end - t.chunks[cb].begin <= kWarpChunkElems) {
    const int64_t c = cb + (threadIdx.x >> 5);
    if (c < ce) f(c, Crew{static_cast<int>(threadIdx.x & 31), 32, true});
    return;
  }
  for (int64_t c = cb; c < ce; ++c) f(c, Crew{static_cast<int>(threadIdx.x), kThreads, false});
}

template <typename T, int kN>
struct alignas(sizeof(T) * kN) Vec {
  T v[kN];
};

template <typename T>
__device__ __forceinline__ double Sq(T x) {
  const double d = static_cast<double>(Elem<T>::Load(x));
  return d * d;
}

// ---------------------------------------------------------------- kernel 3: apply
// This thread's share of a trust-ratio rule's sums (w^2, u^2) over the elements it applied.
struct TrustAcc {
  double w = 0.0, u = 0.0;
  template <typename M>
  __device__ void Add(const ElemNorms<M>& e) {
    const double w_ = static_cast<double>(e.w), u_ = static_cast<double>(e.u);
    w += w_ * w_;
    u += u_ * u_;
  }
};

// ---------------------------------------------------------------- shared by the .cu files
std::string CudaError(cudaError_t e, const char* what);
// "" or the error of the launch just queued (cudaGetLastError).
std::string Launched(const char* what);

// launch(Rule{}, std::integral_constant<int, kSlots>{}) for the rule's kernels at its slot count,
// returning what launch returns ("" or an error); "internal: no <what> ..." if none is compiled.
template <typename Launch>
std::string LaunchForRule(RuleKind rule, int nslots, const char* what, Launch&& launch) {
  std::string err = std::string("internal: no ") + what + " for this rule's slot count";
  DispatchElementRule(rule, [&](auto rule_tag) {
    DispatchSlots<decltype(rule_tag)>(nslots, [&](auto slots_tag) { err = launch(rule_tag, slots_tag); });
  });
  return err;
}

// ---------------------------------------------------------------- the step's plan (cuda_plan.cu)
// The plan of one step: chunks over the flattened list, the sparse plan (owned by the caller),
// and where each part lives in the host table and the device workspace.
struct CudaPlan {
  ChunkPlan plan;
  std::vector<int32_t> many;  // Table::many
  int n = 0;
  const SparsePlan* sparse = nullptr;
  size_t host_bytes = 0;    // the table: consts, hparams, tensors, chunks, block starts, sparse plan
  size_t device_bytes = 0;  // the table's device copy, then partials, clip factors, status
  size_t off_partials = 0, off_factors = 0, off_status = 0, off_trust = 0, off_trust_sums = 0;
  bool trust = false;
  const AgcPlan* agc = nullptr;  // an AGC step's plan (null otherwise)
  bool q8 = false;               // a step with int8 state: the codes go up with the table
  size_t off_agc = 0;            // its device buffers: part_g, part_w, unit_g, unit_w, unit_scale, vsq
  const FactoredPlan* fac = nullptr;  // a factored rule's plan (null otherwise)
  size_t off_fac = 0;                 // its device buffers: rows, part, r_mean, w_part, u_part
};

inline size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

// Host table layout: the step constants, the host hyper-parameters, tensors, chunks, block
// starts, the tensors of many chunks, then the sparse plan's units, order, urows and ustart
// (each 256-aligned).
struct HostLayout {
  size_t off_hparams, off_tensors, off_chunks, off_blocks, off_many, off_units, off_order,
      off_urows, off_ustart, off_tiles, off_uoff, off_poff, off_ablocks, off_spans, off_codes,
      off_ftiles, off_ftile_off, off_frow_off, off_fpart_off, off_fmat_off, bytes;
};
HostLayout Layout(const CudaPlan& p);

// The plan of a step over n tensors of sizes[i] gradient elements (the sparse plan, a
// trust-ratio rule's buffers and AGC's plan when given; q8: the codes of int8 state).
void PlanCudaStep(const int64_t* sizes, int n, CudaPlan* p, const SparsePlan* sparse, bool trust,
                  const AgcPlan* agc, bool q8 = false, const FactoredPlan* fac = nullptr);
// Fills the host table, uploads it, and returns the device-side view of the workspace. With
// hyper-parameters (an apply step), the table's constants are `rule`'s from them.
std::string Upload(const CudaPlan& p, const DevTensor* tensors, const HParams* hp, RuleKind rule,
                   void* host_ws, void* dev_ws, cudaStream_t stream, Table* t);
// Per-tensor chunk ranges (chunks of a tensor are consecutive in the plan).
void ChunkRanges(const CudaPlan& p, DevTensor* ts);

// ---------------------------------------------------------------- the finalize kernel's arguments
struct FinalizeArgs {
  ClipConfig cfg;
  RuleKind rule;
  bool have_partials;   // false: no norm pass ran (a given norm)
  bool round_norm;      // the clip op: the scale comes from the norm rounded to its dtype
  bool apply_step;      // a clip-and-apply step (hyper-parameters, factors, consts)
  DeviceScalars ds;     // scalars to read from device memory (apply steps)
  ClipOpScalars clip_op;  // the clip op's clip_norm / use_norm in device memory
  bool read_scalars;    // ds.any(): read them, check them, recompute the step constants
  bool zero_clipped;    // out.clipped_units is 0s (no AGC pass counted them)
  CudaOutputs out;
};

// ---------------------------------------------------------------- the launchers
// A step's launches, each adding one to *launches per kernel queued; each returns "" or an error.
// cuda_norm.cu: the norm kernel over the plan's nblocks blocks (each chunk's sum of squares
// into t.partials).
std::string LaunchNorm(const Table& t, unsigned nblocks, cudaStream_t stream, int* launches);
// cuda_norm.cu: AGC's pass in the norm kernel's place: the tiles' and spans' sums, the units'
// sums, then each tensor's sum where the finalize kernel reads it and its units' scales (up to
// three launches).
std::string LaunchAgcSums(const Table& t, const DevAgc& agc, cudaStream_t stream, int* launches);
// cuda_finalize.cu: the finalize kernel (one block); host_hp is the host hyper-parameters'
// copy in the workspace.
std::string LaunchFinalize(const Table& t, const FinalizeArgs& a, const HParams* host_hp,
                           cudaStream_t stream, int* launches);
// cuda_finalize.cu: the clip op's scale kernel over the plan's nblocks blocks.
std::string LaunchScale(const Table& t, unsigned nblocks, cudaStream_t stream, int* launches);
// cuda_apply.cu: the dense apply kernel over the plan's nblocks blocks.
std::string LaunchDenseApply(RuleKind rule, int nslots, const Table& t, unsigned nblocks,
                             cudaStream_t stream, int* launches);
// cuda_apply.cu: a trust-ratio rule's per-tensor sums, then its variables (dense blocks, then
// one block per sparse unit).
std::string LaunchTrust(RuleKind rule, int nslots, const Table& t, const DevSparse& sp,
                        unsigned nblocks, cudaStream_t stream, int* launches);
// cuda_factored.cu: a factored rule's passes after the finalize (csrc/core/factored.h): stats,
// r and c, rms(u), the update. Four launches whatever the tensor count.
std::string LaunchFactored(const Table& t, const DevFactored& f, cudaStream_t stream, int* launches);
// cuda_sparse_apply.cu: one block per unit of the sparse plan.
std::string LaunchSparseApply(RuleKind rule, int nslots, const Table& t, const DevSparse& sp,
                              cudaStream_t stream, int* launches);

}  // namespace cuda
}  // namespace tfclip
