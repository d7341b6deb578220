// tfclip core, CUDA: the norm pass's kernels. NormKernel: each chunk's fp64 sum of squares into
// its slot of the workspace (the global norm's first launch). AGC's pass in its place (clip mode
// agc, csrc/core/agc.h): the tiles' and IndexedSlices spans' sums, each unit's sum, then each
// tensor's sum and its units' scales. The launch sequence that picks one: cuda_driver.cu
// (NormAndFinalize); the finalize kernel that reduces the slots: cuda_finalize.cu; the step's
// plan and tensor table: cuda_plan.cu; the apply kernels: cuda_apply.cu, cuda_sparse_apply.cu.
// Shared structures and the launchers' declarations: csrc/core/cuda/kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {
namespace {

// This thread's share of a chunk's sum of squares. The elements are taken in groups of kV (16
// bytes) counted from the chunk's first element: crew thread r sums groups r, r + size, ...,
// each group's elements in order. Which thread sums which element, and in what order, depends
// only on the chunk, never on where the buffer starts: the same values give the same bits in an
// aligned buffer and in a view such as x[1:]. An aligned chunk reads a group with one 16-byte
// load, a misaligned one with kV scalar loads (the same elements, the same order).
template <typename T>
__device__ double ThreadSumSquares(const T* p, int64_t b, int64_t e, Crew crew) {
  constexpr int kV = 16 / sizeof(T);
  double acc = 0.0;
  const int64_t n = e - b;
  const int64_t ngroups = n / kV;
  const bool aligned = reinterpret_cast<uintptr_t>(p + b) % 16 == 0;
  if (aligned) {
    const Vec<T, kV>* vp = reinterpret_cast<const Vec<T, kV>*>(p + b);
    for (int64_t g = crew.rank; g < ngroups; g += crew.size) {
      const Vec<T, kV> x = vp[g];
#pragma unroll
      for (int k = 0; k < kV; ++k) acc += Sq(x.v[k]);
    }
  } else {
    for (int64_t g = crew.rank; g < ngroups; g += crew.size) {
      const T* q = p + b + g * kV;
#pragma unroll
      for (int k = 0; k < kV; ++k) acc += Sq(q[k]);
    }
  }
  // The last, partial group: its elements one per thread, after the full groups.
  for (int64_t i = b + ngroups * kV + crew.rank; i < e; i += crew.size) acc += Sq(p[i]);
  return acc;
}

// ---------------------------------------------------------------- kernel 1: norm
__global__ void __launch_bounds__(kThreads) NormKernel(Table t) {
  ForEachChunk(t, [&](int64_t c, Crew crew) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    double acc = 0.0;
    DispatchDType(static_cast<DType>(ten.grad_dtype), [&](auto tag) {
      using T = decltype(tag);
      acc = ThreadSumSquares(static_cast<const T*>(ten.grad), ch.begin, ch.end, crew);
    });
    const double s = crew.Sum(acc);
    if (crew.rank == 0) t.partials[c] = s;
  });
}

// ---------------------------------------------------------------- kernel 1 (AGC): unit sums
// The CPU driver's AGC norm pass (cpu_kernels.inc: AgcTileSums, AgcSparseGradSums) with the same
// order per sum, so the unit sums are the CPU's bits: a one-unit tile on kLanes lanes (thread k
// sums lane k, elements r0 + k, r0 + k + 16, ...; thread 0 adds the lanes pairwise), a wider one
// a thread per column over its rows in order; an IndexedSlices gradient a thread per unit, rows
// ascending, columns u, u + C, ... (each row's slices summed in the gradient's dtype).
constexpr int kAgcLanes = 16;

template <typename G, typename V, bool kGrad>
__device__ void AgcTileDev(const G* g, const V* w, int64_t units, const AgcTile& tl, double* pg,
                           double* pw) {
  if (units == 1) {
    TFCLIP_SHARED_ARRAY(double, lanes, 2 * kAgcLanes);
    if (threadIdx.x < kAgcLanes) {
      double ag = 0.0, aw = 0.0;
      for (int64_t r = tl.r0 + threadIdx.x; r < tl.r1; r += kAgcLanes) {
        if (kGrad) ag += Sq(g[r]);
        aw += Sq(w[r]);
      }
      lanes[threadIdx.x] = ag;
      lanes[kAgcLanes + threadIdx.x] = aw;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int h = kAgcLanes / 2; h > 0; h /= 2) {
        for (int k = 0; k < h; ++k) {
          lanes[k] += lanes[k + h];
          lanes[kAgcLanes + k] += lanes[kAgcLanes + k + h];
        }
      }
      if (kGrad) pg[0] = lanes[0];
      pw[0] = lanes[kAgcLanes];
    }
    return;
  }
  const int64_t cw = tl.c1 - tl.c0;
  for (int64_t k = threadIdx.x; k < cw; k += kThreads) {
    double ag = 0.0, aw = 0.0;
    for (int64_t r = tl.r0; r < tl.r1; ++r) {
      const int64_t i = r * units + tl.c0 + k;
      if (kGrad) ag += Sq(g[i]);
      aw += Sq(w[i]);
    }
    if (kGrad) pg[k] = ag;
    pw[k] = aw;
  }
}

template <typename G>
__device__ void AgcSparseDev(const DevTensor& ten, const DevAgc& a, const SparseSpan& span,
                             int64_t units) {
  using GM = typename Elem<G>::Math;
  const G* vals = static_cast<const G*>(ten.grad);
  const int64_t w = ten.width;
  double* ug = a.unit_g + a.unit_off[span.tensor];
  for (int64_t u = threadIdx.x; u < units; u += kThreads) {
    double acc = 0.0;
    for (int64_t x = span.u_first; x < span.u_last; ++x) {
      const int64_t jb = a.ustart[x], je = a.ustart[x + 1];
      for (int64_t col = u; col < w; col += units) {
        GM s = GM(0);
        for (int64_t j = jb; j < je; ++j) s = RoundTo<G>(s + Elem<G>::Load(vals[a.order[j] * w + col]));
        const double d = static_cast<double>(s);
        acc += d * d;
      }
    }
    ug[u] = acc;
  }
  // The values' sum of squares on kLanes lanes, as the CPU's ChunkSumSquares.
  TFCLIP_SHARED_ARRAY(double, lanes, kAgcLanes);
  const int64_t nv = ten.size;  // nnz * width
  if (threadIdx.x < kAgcLanes) {
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < nv; i += kAgcLanes) acc += Sq(vals[i]);
    lanes[threadIdx.x] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int h = kAgcLanes / 2; h > 0; h /= 2) {
      for (int k = 0; k < h; ++k) lanes[k] += lanes[k + h];
    }
    a.vsq[span.tensor] = nv > 0 ? lanes[0] : 0.0;
  }
}

__global__ void __launch_bounds__(kThreads) AgcNormKernel(Table t, DevAgc a) {
  const int64_t x = blockIdx.x;
  if (x < a.ntiles) {
    const AgcTile tl = a.tiles[x];
    const DevTensor& ten = t.tensors[tl.tensor];
    const int64_t units = a.unit_off[tl.tensor + 1] - a.unit_off[tl.tensor];
    // (planted: every tile's partials land in row block 0, a tensor of several loses all but one)
    const int64_t off = a.part_off[tl.tensor] + (TFCLIP_PLANTED(AGC_BLOCK) ? 0 : tl.block * units) + tl.c0;
    DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
      using V = decltype(vtag);
      const V* w = static_cast<const V*>(ten.var);
      if (tl.kind == 1) {
        AgcTileDev<V, V, false>(nullptr, w, units, tl, nullptr, a.part_w + off);
      } else {
        DispatchDType(static_cast<DType>(ten.grad_dtype), [&](auto gtag) {
          using G = decltype(gtag);
          AgcTileDev<G, V, true>(static_cast<const G*>(ten.grad), w, units, tl, a.part_g + off,
                                 a.part_w + off);
        });
      }
    });
  } else {
    const SparseSpan span = a.spans[x - a.ntiles];
    const DevTensor& ten = t.tensors[span.tensor];
    const int64_t units = a.unit_off[span.tensor + 1] - a.unit_off[span.tensor];
    DispatchDType(static_cast<DType>(ten.grad_dtype), [&](auto gtag) {
      AgcSparseDev<decltype(gtag)>(ten, a, span, units);
    });
  }
}

// A thread per unit: its partials added in row-block order (ReduceAgcSums).
__global__ void __launch_bounds__(kThreads) AgcUnitKernel(Table t, DevAgc a) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (u >= a.nunits) return;
  int lo = 0, hi = a.n - 1;  // the tensor whose units hold u: the last i with unit_off[i] <= u
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.unit_off[mid] <= u) lo = mid;
    else hi = mid - 1;
  }
  const int i = lo;
  const int64_t c = a.unit_off[i + 1] - a.unit_off[i], k = u - a.unit_off[i], po = a.part_off[i];
  const bool sparse = t.tensors[i].sparse != 0;
  double g = 0.0, w = 0.0;
  for (int64_t b = 0; b < a.blocks[i]; ++b) {
    if (!sparse) g += a.part_g[po + b * c + k];
    w += a.part_w[po + b * c + k];
  }
  if (!sparse) a.unit_g[u] = g;
  a.unit_w[u] = w;
}

// A thread per tensor: its sum of squares (dense: its units' in unit order; IndexedSlices: its
// values'), put where the finalize kernel reads the norm pass's (its first chunk's partial, the
// others 0: the finalize's sums then give it exactly), and its units' scales.
__global__ void __launch_bounds__(kThreads) AgcTensorKernel(Table t, DevAgc a) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= a.n) return;
  const DevTensor& ten = t.tensors[i];
  const int64_t uo = a.unit_off[i], c = a.unit_off[i + 1] - uo;
  double sum = 0.0;
  if (ten.sparse) {
    sum = a.vsq[i];
  } else {
    for (int64_t u = 0; u < c; ++u) sum += a.unit_g[uo + u];
  }
  for (int64_t k = 0; k < ten.num_chunks; ++k) t.partials[ten.first_chunk + k] = k == 0 ? sum : 0.0;
  const double clip = a.dev_clip != nullptr ? *a.dev_clip : a.clip;
  int64_t k = 0;
  for (int64_t u = uo; u < uo + c; ++u) {
    a.unit_scale[u] = clip == 0.0 ? 1.0 : AgcUnitScale(clip, a.eps, a.unit_g[u], a.unit_w[u]);
    k += a.unit_scale[u] != 1.0 ? 1 : 0;  // NaN too, as AgcScales counts
  }
  if (a.clipped != nullptr) a.clipped[i] = k;
}

}  // namespace

std::string LaunchNorm(const Table& t, unsigned nblocks, cudaStream_t stream, int* launches) {
  TFCLIP_LAUNCH(NormKernel, nblocks, kThreads, 0, stream)(t);
  ++*launches;
  return Launched("the norm kernel");
}

std::string LaunchAgcSums(const Table& t, const DevAgc& agc, cudaStream_t stream, int* launches) {
  const int64_t nb = agc.ntiles + agc.nspans;
  if (nb > 0) {
    TFCLIP_LAUNCH(AgcNormKernel, static_cast<unsigned>(nb), kThreads, 0, stream)(t, agc);
    ++*launches;
    std::string e = Launched("the AGC norm kernel");
    if (!e.empty()) return e;
  }
  if (agc.nunits > 0) {
    TFCLIP_LAUNCH(AgcUnitKernel, static_cast<unsigned>((agc.nunits + kThreads - 1) / kThreads),
                  kThreads, 0, stream)(t, agc);
    ++*launches;
    std::string e = Launched("the AGC unit kernel");
    if (!e.empty()) return e;
  }
  TFCLIP_LAUNCH(AgcTensorKernel, static_cast<unsigned>((agc.n + kThreads - 1) / kThreads),
                kThreads, 0, stream)(t, agc);
  ++*launches;
  return Launched("the AGC tensor kernel");
}

}  // namespace cuda
}  // namespace tfclip
