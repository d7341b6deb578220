// tfclip core, CUDA: the multi-tensor launcher and its three kernels (norm, finalize, apply),
// plus the clip op's scale kernel. The update rules are csrc/core/rules.h, the clip modes
// csrc/core/multi_tensor.h: the same TFCLIP_HD bodies the CPU driver runs.
//
// Built with --fmad=false (CMakeLists.txt): nvcc would otherwise contract a*b+c into FMA where
// the CPU build does not, and the apply pass would differ from the CPU in the last bit.
#include "cuda/cuda_driver.h"

#include "csrc/core/sparse.h"

#include <cuda_runtime.h>

// Under nvcc a launch is kernel<<<...>>>; the CPU emulation (cuda/emulation/cuda_runtime.h, CI's
// way to run these kernels) defines its own.
#ifndef TFCLIP_LAUNCH
#define TFCLIP_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

#include <algorithm>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace tfclip {
namespace cuda {
namespace {

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
  int32_t pad;
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
};

// Device pointers into the workspace, passed to every kernel by value.
struct Table {
  const DevTensor* tensors;
  const DevChunk* chunks;
  const int64_t* block_begin;
  double* partials;
  ClipFactor* factors;
  DevStatus* status;
  int n;
  int64_t nchunks;
};

size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

// Host table layout: tensors, chunks, block starts, then the sparse plan's units, order,
// urows and ustart (each 256-aligned).
struct HostLayout {
  size_t off_chunks, off_blocks, off_units, off_order, off_urows, off_ustart, bytes;
};
template <typename T>
size_t Bytes(const std::vector<T>& v) {
  return Align256(sizeof(T) * v.size());
}
HostLayout Layout(const CudaPlan& p) {
  HostLayout l;
  l.off_chunks = Align256(sizeof(DevTensor) * static_cast<size_t>(p.n));
  l.off_blocks = l.off_chunks + Align256(sizeof(DevChunk) * p.plan.chunks.size());
  l.off_units = l.off_blocks + Bytes(p.plan.block_begin);
  l.bytes = l.off_units;
  l.off_order = l.off_urows = l.off_ustart = l.bytes;
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    l.off_order = l.off_units + Bytes(sp.units);
    l.off_urows = l.off_order + Bytes(sp.order);
    l.off_ustart = l.off_urows + Bytes(sp.urows);
    l.bytes = l.off_ustart + Bytes(sp.ustart);
  }
  return l;
}

thread_local int g_last_launches = 0;
thread_local void* g_last_stream = nullptr;

// ---------------------------------------------------------------- device helpers
template <typename Fn>
__device__ __forceinline__ void DispatchDTypeDev(int t, Fn&& fn) {
  switch (static_cast<DType>(t)) {
    case DType::kHalf: fn(half{}); break;
    case DType::kBFloat16: fn(bfloat16{}); break;
    case DType::kFloat: fn(float{}); break;
    case DType::kDouble: fn(double{}); break;
  }
}

// Sum over the block in a fixed order (warp butterflies, then warp 0 over the warp sums):
// the same bits on every run. The result is valid in thread 0.
template <int kBlock>
__device__ double BlockSum(double v) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block size");
  __shared__ double warp_sums[kBlock / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // warp_sums may still be read from the previous call
  if (lane == 0) warp_sums[w] = v;
  __syncthreads();
  double r = 0.0;
  if (w == 0) {
    r = lane < kBlock / 32 ? warp_sums[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  }
  return r;
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

// This thread's share of a chunk's sum of squares: a scalar head up to 16-byte alignment,
// 16-byte vector loads, a scalar tail. The thread-to-element map depends only on the chunk.
template <typename T>
__device__ double ThreadSumSquares(const T* p, int64_t b, int64_t e) {
  constexpr int kV = 16 / sizeof(T);
  double acc = 0.0;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p + b);
  int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(T));
  if (addr % sizeof(T) != 0) head = e - b;  // misaligned element type: all scalar
  head = head < e - b ? head : e - b;
  for (int64_t i = b + threadIdx.x; i < b + head; i += kThreads) acc += Sq(p[i]);
  const int64_t vb = b + head;
  const int64_t nvec = (e - vb) / kV;
  const Vec<T, kV>* vp = reinterpret_cast<const Vec<T, kV>*>(p + vb);
  for (int64_t j = threadIdx.x; j < nvec; j += kThreads) {
    const Vec<T, kV> x = vp[j];
#pragma unroll
    for (int k = 0; k < kV; ++k) acc += Sq(x.v[k]);
  }
  for (int64_t i = vb + nvec * kV + threadIdx.x; i < e; i += kThreads) acc += Sq(p[i]);
  return acc;
}

// ---------------------------------------------------------------- kernel 1: norm
__global__ void __launch_bounds__(kThreads) NormKernel(Table t) {
  const int64_t cb = t.block_begin[blockIdx.x], ce = t.block_begin[blockIdx.x + 1];
  for (int64_t c = cb; c < ce; ++c) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    double acc = 0.0;
    DispatchDTypeDev(ten.grad_dtype, [&](auto tag) {
      using T = decltype(tag);
      acc = ThreadSumSquares(static_cast<const T*>(ten.grad), ch.begin, ch.end);
    });
    const double s = BlockSum<kThreads>(acc);
    if (threadIdx.x == 0) t.partials[c] = s;
  }
}

// ---------------------------------------------------------------- kernel 2: finalize
constexpr int kFinalizeThreads = 1024;

struct FinalizeArgs {
  ClipConfig cfg;
  bool have_partials;   // false: no norm pass ran (a given norm)
  bool round_norm;      // the clip op: the scale comes from the norm rounded to its dtype
  CudaOutputs out;
};

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(Table t, FinalizeArgs a) {
  double local = 0.0;
  if (a.have_partials) {
    for (int64_t c = threadIdx.x; c < t.nchunks; c += kFinalizeThreads) local += t.partials[c];
  }
  const double total = BlockSum<kFinalizeThreads>(local);
  __shared__ double s_scale;
  if (threadIdx.x == 0) {
    double norm = StepGlobalNorm(a.cfg, total);
    if (a.round_norm && a.out.norm_dtype == DType::kFloat) norm = static_cast<float>(norm);
    const bool finite = isfinite(norm);
    const bool apply = finite || a.cfg.policy == NonFinitePolicy::kPropagate;
    const double scale = a.cfg.mode == ClipMode::kGlobalNorm ? GlobalClipScale(a.cfg.clip, norm) : 1.0;
    t.status->norm = norm;
    t.status->scale = scale;
    t.status->finite = finite;
    t.status->apply = apply;
    if (a.out.norm != nullptr) {
      if (a.out.norm_dtype == DType::kDouble) *static_cast<double*>(a.out.norm) = norm;
      else *static_cast<float*>(a.out.norm) = static_cast<float>(norm);
    }
    if (a.out.applied != nullptr) *a.out.applied = apply;
    s_scale = scale;
  }
  __syncthreads();
  if (t.factors == nullptr) return;
  for (int i = threadIdx.x; i < t.n; i += kFinalizeThreads) {
    const DevTensor& ten = t.tensors[i];
    double sumsq = 0.0;
    if (a.cfg.mode == ClipMode::kNorm) {  // in chunk order, as the CPU driver sums
      for (int64_t c = ten.first_chunk; c < ten.first_chunk + ten.num_chunks; ++c) sumsq += t.partials[c];
    }
    t.factors[i] = TensorClipFactor(a.cfg.mode, a.cfg.clip, s_scale, sumsq);
  }
}

// ---------------------------------------------------------------- kernel 3: apply
// One element: the clip factor, decoupled weight decay, then the rule. Operation for operation
// the CPU driver's ApplyLoop (a scale of 1 and infinite bounds are exact no-ops).
// ApplyElemClipped takes the gradient already clipped (and cast) in the math type.
template <typename Rule, typename V, int kSlots>
__device__ __forceinline__ void ApplyElemClipped(const StepConsts<typename Elem<V>::Math>& c,
                                                 typename Elem<V>::Math g, V& var, V* s) {
  using M = typename Elem<V>::Math;
  M sl[kMaxSlots] = {M(0), M(0), M(0)};
#pragma unroll
  for (int k = 0; k < kSlots; ++k) sl[k] = Elem<V>::Load(s[k]);
  M v = DecayVar(c, Elem<V>::Load(var));
  Rule::Update(c, g, g * g, v, sl);
  var = Elem<V>::Store(v);
#pragma unroll
  for (int k = 0; k < kSlots; ++k) s[k] = Elem<V>::Store(sl[k]);
}
template <typename Rule, typename V, typename G, int kSlots>
__device__ __forceinline__ void ApplyElem(const StepConsts<typename Elem<V>::Math>& c,
                                          typename Elem<V>::Math scale,
                                          typename Elem<V>::Math lo, typename Elem<V>::Math hi,
                                          G graw, V& var, V* s) {
  ApplyElemClipped<Rule, V, kSlots>(c, ClipGrad<G, typename Elem<V>::Math>(graw, scale, lo, hi),
                                    var, s);
}

// A gradient of another float dtype than its variable (AnyGrad: not a fused pair), element by
// element through CastClipGradAt.
template <typename Rule, typename V, int kSlots>
__device__ void ApplyRangeAnyGrad(const StepConsts<typename Elem<V>::Math>& c, const DevTensor& t,
                                  const ClipFactor& f, int64_t b, int64_t e) {
  V* var = static_cast<V*>(t.var);
  V* sp[kMaxSlots] = {static_cast<V*>(t.slots[0]), static_cast<V*>(t.slots[1]),
                      static_cast<V*>(t.slots[2])};
  const DType gt = static_cast<DType>(t.grad_dtype);
  for (int64_t i = b + threadIdx.x; i < e; i += kThreads) {
    V s[kMaxSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) s[k] = sp[k][i];
    ApplyElemClipped<Rule, V, kSlots>(c, CastClipGradAt<V>(t.grad, gt, i, f), var[i], s);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) sp[k][i] = s[k];
  }
}

template <typename Rule, typename V, typename G, int kSlots>
__device__ void ApplyRange(const StepConsts<typename Elem<V>::Math>& c, const DevTensor& t,
                           const ClipFactor& f, int64_t b, int64_t e) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  const G* grad = static_cast<const G*>(t.grad);
  V* sp[kMaxSlots] = {static_cast<V*>(t.slots[0]), static_cast<V*>(t.slots[1]),
                      static_cast<V*>(t.slots[2])};
  const M scale = InGradDType<G, M>(f.scale);
  const M lo = InGradDType<G, M>(f.lo), hi = InGradDType<G, M>(f.hi);

  // Four elements per thread with vector loads when every array is aligned for them.
  constexpr int kV = 4;
  bool aligned = reinterpret_cast<uintptr_t>(var + b) % (sizeof(V) * kV) == 0 &&
                 reinterpret_cast<uintptr_t>(grad + b) % (sizeof(G) * kV) == 0;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    aligned = aligned && reinterpret_cast<uintptr_t>(sp[k] + b) % (sizeof(V) * kV) == 0;
  }
  int64_t i0 = b;
  if (aligned) {
    const int64_t nvec = (e - b) / kV;
    for (int64_t j = threadIdx.x; j < nvec; j += kThreads) {
      const int64_t i = b + j * kV;
      Vec<V, kV> vv = *reinterpret_cast<const Vec<V, kV>*>(var + i);
      const Vec<G, kV> gv = *reinterpret_cast<const Vec<G, kV>*>(grad + i);
      Vec<V, kV> sv[kSlots > 0 ? kSlots : 1];
#pragma unroll
      for (int k = 0; k < kSlots; ++k) sv[k] = *reinterpret_cast<const Vec<V, kV>*>(sp[k] + i);
#pragma unroll
      for (int q = 0; q < kV; ++q) {
        V s[kMaxSlots];
#pragma unroll
        for (int k = 0; k < kSlots; ++k) s[k] = sv[k].v[q];
        ApplyElem<Rule, V, G, kSlots>(c, scale, lo, hi, gv.v[q], vv.v[q], s);
#pragma unroll
        for (int k = 0; k < kSlots; ++k) sv[k].v[q] = s[k];
      }
      *reinterpret_cast<Vec<V, kV>*>(var + i) = vv;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) *reinterpret_cast<Vec<V, kV>*>(sp[k] + i) = sv[k];
    }
    i0 = b + nvec * kV;
  }
  for (int64_t i = i0 + threadIdx.x; i < e; i += kThreads) {
    V s[kMaxSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) s[k] = sp[k][i];
    ApplyElem<Rule, V, G, kSlots>(c, scale, lo, hi, grad[i], var[i], s);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) sp[k][i] = s[k];
  }
}

// The slot counts each rule can have (SGD none, momentum one, Adam two or three).
template <typename Rule, typename Fn>
__device__ __forceinline__ void DispatchSlots(int nslots, Fn&& fn) {
  if constexpr (std::is_same<Rule, SgdRule>::value) {
    fn(std::integral_constant<int, 0>{});
  } else if constexpr (std::is_same<Rule, AdamRule>::value) {
    if (nslots == 3) fn(std::integral_constant<int, 3>{});
    else fn(std::integral_constant<int, 2>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

// Calls fn(V{}, G{}, consts) for a tensor's (variable, gradient) dtype pair, with the step
// constants in the variable's math type.
template <typename Fn>
__device__ __forceinline__ void DispatchPairDev(const DevTensor& ten, const StepConsts<float>& cf,
                                                const StepConsts<double>& cd, Fn&& fn) {
  const DType vd = static_cast<DType>(ten.var_dtype), gd = static_cast<DType>(ten.grad_dtype);
  if (vd == DType::kFloat && gd == DType::kHalf) {
    fn(float{}, half{}, cf);
  } else if (vd == DType::kFloat && gd == DType::kBFloat16) {
    fn(float{}, bfloat16{}, cf);
  } else if (vd == DType::kDouble) {
    if (gd == vd) fn(double{}, double{}, cd);
    else fn(double{}, AnyGrad{}, cd);
  } else {
    DispatchDTypeDev(ten.var_dtype, [&](auto tag) {
      using V = decltype(tag);
      if constexpr (!std::is_same<V, double>::value) {
        if (gd == vd) fn(V{}, V{}, cf);
        else fn(V{}, AnyGrad{}, cf);
      }
    });
  }
}

template <typename Rule>
__global__ void __launch_bounds__(kThreads)
    ApplyKernel(Table t, StepConsts<float> cf, StepConsts<double> cd, int nslots) {
  if (!t.status->apply) return;  // skip / raise: nothing is written
  const int64_t cb = t.block_begin[blockIdx.x], ce = t.block_begin[blockIdx.x + 1];
  for (int64_t c = cb; c < ce; ++c) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    if (ten.sparse) continue;  // the sparse kernel applies it
    const ClipFactor f = t.factors[ch.tensor];
    DispatchSlots<Rule>(nslots, [&](auto slots_tag) {
      constexpr int kS = decltype(slots_tag)::value;
      DispatchPairDev(ten, cf, cd, [&](auto vtag, auto gtag, const auto& consts) {
        using V = decltype(vtag);
        using G = decltype(gtag);
        if constexpr (std::is_same<G, AnyGrad>::value) {
          ApplyRangeAnyGrad<Rule, V, kS>(consts, ten, f, ch.begin, ch.end);
        } else {
          ApplyRange<Rule, V, G, kS>(consts, ten, f, ch.begin, ch.end);
        }
      });
    });
  }
}

// ---------------------------------------------------------------- kernel 4: sparse apply
// One block per unit of the sparse plan; a thread per (row, column) element. In an all-rows
// unit a row finds its slices by binary search over the unit's touched rows.
template <typename Rule, typename V, typename G, int kSlots>
__device__ void SparseUnitDev(const StepConsts<typename Elem<V>::Math>& c, const DevTensor& ten,
                              const ClipFactor& f, const DevSparse& sp, const SparseUnit& u) {
  V* var = static_cast<V*>(ten.var);
  const SparseGrad<V, G> grad(ten.grad, static_cast<DType>(ten.grad_dtype), f);
  V* sl[kMaxSlots] = {static_cast<V*>(ten.slots[0]), static_cast<V*>(ten.slots[1]),
                      static_cast<V*>(ten.slots[2])};
  const int64_t w = ten.width;
  const int64_t total = (u.end - u.begin) * w;
  for (int64_t e = threadIdx.x; e < total; e += kThreads) {
    const int64_t r = e / w, col = e - r * w;
    int64_t row, jb = 0, je = 0;
    if (u.all_rows) {
      row = u.begin + r;
      int64_t a = u.u_begin, b = u.u_end;
      while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (sp.urows[mid] < row) a = mid + 1;
        else b = mid;
      }
      if (a < u.u_end && sp.urows[a] == row) {
        jb = sp.ustart[a];
        je = sp.ustart[a + 1];
      }
    } else {
      const int64_t x = u.begin + r;
      row = sp.urows[x];
      jb = sp.ustart[x];
      je = sp.ustart[x + 1];
    }
    const int64_t i = row * w + col;
    V s[kMaxSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) s[k] = sl[k][i];
    SparseElem<Rule, V, kSlots>(c, grad, w, col, sp.order, jb, je, var[i], s);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) sl[k][i] = s[k];
  }
}

template <typename Rule>
__global__ void __launch_bounds__(kThreads)
    SparseApplyKernel(Table t, DevSparse sp, StepConsts<float> cf, StepConsts<double> cd,
                      int nslots) {
  if (!t.status->apply) return;
  const SparseUnit u = sp.units[blockIdx.x];
  const DevTensor& ten = t.tensors[u.tensor];
  const ClipFactor f = t.factors[u.tensor];
  DispatchSlots<Rule>(nslots, [&](auto slots_tag) {
    constexpr int kS = decltype(slots_tag)::value;
    DispatchPairDev(ten, cf, cd, [&](auto vtag, auto gtag, const auto& consts) {
      SparseUnitDev<Rule, decltype(vtag), decltype(gtag), kS>(consts, ten, f, sp, u);
    });
  });
}

// ---------------------------------------------------------------- the clip op's scale pass
__global__ void __launch_bounds__(kThreads) ScaleKernel(Table t) {
  const double scale = t.status->scale;
  const int64_t cb = t.block_begin[blockIdx.x], ce = t.block_begin[blockIdx.x + 1];
  for (int64_t c = cb; c < ce; ++c) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    DispatchDTypeDev(ten.grad_dtype, [&](auto tag) {
      using T = decltype(tag);
      using M = typename Elem<T>::Math;
      const M s = RoundTo<T>(static_cast<M>(scale));
      const T* in = static_cast<const T*>(ten.grad);
      T* out = static_cast<T*>(ten.var);
      for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kThreads) {
        out[i] = Elem<T>::Store(Elem<T>::Load(in[i]) * s);
      }
    });
  }
}

// ---------------------------------------------------------------- host side
std::string CudaError(cudaError_t e, const char* what) {
  std::ostringstream os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
     << ")";
  return os.str();
}

// Fills the host table, uploads it, and returns the device-side view of the workspace.
std::string Upload(const CudaPlan& p, const DevTensor* tensors, void* host_ws, void* dev_ws,
                   cudaStream_t stream, Table* t) {
  const HostLayout l = Layout(p);
  char* h = static_cast<char*>(host_ws);
  char* d = static_cast<char*>(dev_ws);
  std::memcpy(h, tensors, sizeof(DevTensor) * p.n);
  DevChunk* hc = reinterpret_cast<DevChunk*>(h + l.off_chunks);
  for (size_t c = 0; c < p.plan.chunks.size(); ++c) {
    const Chunk& ch = p.plan.chunks[c];
    hc[c] = DevChunk{ch.begin, ch.end, ch.tensor, 0};
  }
  std::memcpy(h + l.off_blocks, p.plan.block_begin.data(), sizeof(int64_t) * p.plan.block_begin.size());
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    std::memcpy(h + l.off_units, sp.units.data(), sizeof(SparseUnit) * sp.units.size());
    std::memcpy(h + l.off_order, sp.order.data(), sizeof(int64_t) * sp.order.size());
    std::memcpy(h + l.off_urows, sp.urows.data(), sizeof(int64_t) * sp.urows.size());
    std::memcpy(h + l.off_ustart, sp.ustart.data(), sizeof(int64_t) * sp.ustart.size());
  }
  const cudaError_t e = cudaMemcpyAsync(d, h, l.bytes, cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return CudaError(e, "the tensor table upload");
  t->tensors = reinterpret_cast<const DevTensor*>(d);
  t->chunks = reinterpret_cast<const DevChunk*>(d + l.off_chunks);
  t->block_begin = reinterpret_cast<const int64_t*>(d + l.off_blocks);
  t->partials = reinterpret_cast<double*>(d + p.off_partials);
  t->factors = reinterpret_cast<ClipFactor*>(d + p.off_factors);
  t->status = reinterpret_cast<DevStatus*>(d + p.off_status);
  t->n = p.n;
  t->nchunks = static_cast<int64_t>(p.plan.chunks.size());
  return "";
}

// Per-tensor chunk ranges (chunks of a tensor are consecutive in the plan).
void ChunkRanges(const CudaPlan& p, DevTensor* ts) {
  for (int i = 0; i < p.n; ++i) {
    ts[i].first_chunk = 0;
    ts[i].num_chunks = 0;
  }
  const auto& ch = p.plan.chunks;
  for (size_t c = ch.size(); c-- > 0;) {
    ts[ch[c].tensor].first_chunk = static_cast<int64_t>(c);
    ts[ch[c].tensor].num_chunks++;
  }
}

std::string Launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : CudaError(e, what);
}

// Norm (when needed) and finalize: the first two launches of every op.
std::string NormAndFinalize(const CudaPlan& p, const Table& t, const FinalizeArgs& a,
                            cudaStream_t stream) {
  g_last_launches = 0;
  g_last_stream = stream;
  const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
  if (a.have_partials && nblocks > 0) {
    TFCLIP_LAUNCH(NormKernel, nblocks, kThreads, 0, stream)(t);
    ++g_last_launches;
    const std::string e = Launched("the norm kernel");
    if (!e.empty()) return e;
  }
  TFCLIP_LAUNCH(FinalizeKernel, 1, kFinalizeThreads, 0, stream)(t, a);
  ++g_last_launches;
  return Launched("the finalize kernel");
}

std::vector<DevTensor> TensorsFromViews(const TensorView* in, const TensorView* out, int n) {
  std::vector<DevTensor> ts(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    DevTensor& d = ts[i];
    std::memset(&d, 0, sizeof(d));
    d.grad = in[i].data;
    d.var = out != nullptr ? out[i].data : nullptr;
    d.size = in[i].size;
    d.grad_dtype = d.var_dtype = static_cast<int32_t>(in[i].dtype);
  }
  return ts;
}

// The norm and clip ops' table: inputs (and outputs), no clip factors.
std::string UploadViews(const TensorView* in, const TensorView* out, int n, const CudaPlan& p,
                        void* host_ws, void* dev_ws, cudaStream_t stream, Table* t) {
  std::vector<DevTensor> dts = TensorsFromViews(in, out, n);
  ChunkRanges(p, dts.data());
  const std::string e = Upload(p, dts.data(), host_ws, dev_ws, stream, t);
  t->factors = nullptr;
  return e;
}

}  // namespace

void PlanCudaStep(const int64_t* sizes, int n, CudaPlan* p, const SparsePlan* sparse) {
  p->n = n;
  p->sparse = sparse;
  PlanChunks(sizes, n, kCudaChunkElems, &p->plan);
  const size_t nchunks = p->plan.chunks.size();
  p->host_bytes = Layout(*p).bytes;
  p->off_partials = p->host_bytes;
  p->off_factors = p->off_partials + Align256(sizeof(double) * nchunks);
  p->off_status = p->off_factors + Align256(sizeof(ClipFactor) * static_cast<size_t>(n));
  p->device_bytes = p->off_status + Align256(sizeof(DevStatus));
}

int LastStepLaunches() { return g_last_launches; }

void* LastStepStream() { return g_last_stream; }

std::string CudaGlobalNorm(const TensorView* ts, int n, const CudaPlan& p, void* host_ws,
                           void* dev_ws, const CudaOutputs& out, void* stream_v) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  Table t;
  std::string e = UploadViews(ts, nullptr, n, p, host_ws, dev_ws, stream, &t);
  if (!e.empty()) return e;
  FinalizeArgs a{};
  a.cfg = ClipConfig{};
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = true;
  a.out = out;
  return NormAndFinalize(p, t, a, stream);
}

std::string CudaClipByGlobalNorm(const TensorView* in, const TensorView* outs, int n,
                                 double clip_norm, bool has_use_norm, double use_norm,
                                 const CudaPlan& p, void* host_ws, void* dev_ws,
                                 const CudaOutputs& out, void* stream_v) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  Table t;
  std::string e = UploadViews(in, outs, n, p, host_ws, dev_ws, stream, &t);
  if (!e.empty()) return e;
  FinalizeArgs a{};
  a.cfg.mode = ClipMode::kGlobalNorm;
  a.cfg.clip = clip_norm;
  a.cfg.has_use_norm = has_use_norm;
  a.cfg.use_norm = use_norm;
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = !has_use_norm;
  a.round_norm = true;
  a.out = out;
  e = NormAndFinalize(p, t, a, stream);
  if (!e.empty()) return e;
  const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
  if (nblocks > 0) {
    TFCLIP_LAUNCH(ScaleKernel, nblocks, kThreads, 0, stream)(t);
    ++g_last_launches;
    return Launched("the scale kernel");
  }
  return "";
}

std::string CudaClipApply(RuleKind rule, const HParams& hp, const ClipConfig& cfg,
                          const ApplyTensor* ts, int n, const CudaPlan& p, void* host_ws,
                          void* dev_ws, const CudaOutputs& out, void* stream_v, bool* nonfinite) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  *nonfinite = false;
  std::vector<DevTensor> dts(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    DevTensor& d = dts[i];
    std::memset(&d, 0, sizeof(d));
    d.var = ts[i].var;
    d.grad = ts[i].grad;
    for (int k = 0; k < kMaxSlots; ++k) d.slots[k] = ts[i].slots[k];
    d.size = ts[i].grad_size();
    d.width = ts[i].width;
    d.sparse = ts[i].sparse ? 1 : 0;
    d.var_dtype = static_cast<int32_t>(ts[i].var_dtype);
    d.grad_dtype = static_cast<int32_t>(ts[i].grad_dtype);
  }
  ChunkRanges(p, dts.data());
  Table t;
  std::string e = Upload(p, dts.data(), host_ws, dev_ws, stream, &t);
  if (!e.empty()) return e;
  FinalizeArgs a{};
  a.cfg = cfg;
  a.have_partials = NeedsNormPass(cfg);
  a.out = out;
  e = NormAndFinalize(p, t, a, stream);
  if (!e.empty()) return e;
  const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
  if (nblocks > 0) {
    const StepConsts<float> cf = MakeStepConsts<float>(hp);
    const StepConsts<double> cd = MakeStepConsts<double>(hp);
    const int nslots = NumSlots(rule, hp);
    DispatchRule(rule, [&](auto rule_tag) {
      using Rule = decltype(rule_tag);
      TFCLIP_LAUNCH(ApplyKernel<Rule>, nblocks, kThreads, 0, stream)(t, cf, cd, nslots);
    });
    ++g_last_launches;
    e = Launched("the apply kernel");
    if (!e.empty()) return e;
  }
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const HostLayout l = Layout(p);
    const char* d = static_cast<const char*>(dev_ws);
    DevSparse sp;
    sp.units = reinterpret_cast<const SparseUnit*>(d + l.off_units);
    sp.order = reinterpret_cast<const int64_t*>(d + l.off_order);
    sp.urows = reinterpret_cast<const int64_t*>(d + l.off_urows);
    sp.ustart = reinterpret_cast<const int64_t*>(d + l.off_ustart);
    sp.nunits = static_cast<int64_t>(p.sparse->units.size());
    const StepConsts<float> cf = MakeStepConsts<float>(hp);
    const StepConsts<double> cd = MakeStepConsts<double>(hp);
    const int nslots = NumSlots(rule, hp);
    DispatchRule(rule, [&](auto rule_tag) {
      using Rule = decltype(rule_tag);
      TFCLIP_LAUNCH(SparseApplyKernel<Rule>, static_cast<unsigned>(sp.nunits), kThreads, 0, stream)(
          t, sp, cf, cd, nslots);
    });
    ++g_last_launches;
    e = Launched("the sparse apply kernel");
    if (!e.empty()) return e;
  }
  if (cfg.policy == NonFinitePolicy::kRaise) {
    // The one host wait in tfclip: 'raise' must know before it returns.
    int finite = 1;
    cudaError_t ce = cudaMemcpyAsync(&finite, &t.status->finite, sizeof(int),
                                     cudaMemcpyDeviceToHost, stream);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
    if (ce != cudaSuccess) return CudaError(ce, "reading the non-finite flag");
    *nonfinite = finite == 0;
  }
  return "";
}

}  // namespace cuda
}  // namespace tfclip
