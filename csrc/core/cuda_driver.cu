// tfclip core, CUDA: the multi-tensor launcher and its kernels (norm, finalize, apply, sparse
// apply), plus the clip op's scale kernel. The update rules are csrc/core/rules.h, applied per
// element by csrc/core/apply_elem.h, the clip modes csrc/core/clip.h: the same TFCLIP_HD bodies
// and dispatch the CPU driver runs.
//
// Built with --fmad=false (CMakeLists.txt): nvcc would otherwise contract a*b+c into FMA where
// the CPU build does not, and the apply pass would differ from the CPU in the last bit.
//
// This file: the step's plan and its upload, the norm, AGC, finalize and scale kernels, and the
// entry points of csrc/core/cuda_driver.h. The apply kernels are cuda_apply.cu and
// cuda_sparse_apply.cu; what they share, cuda_kernels.cuh.
#include "csrc/core/cuda_kernels.cuh"

namespace tfclip {
namespace cuda {

std::string CudaError(cudaError_t e, const char* what) {
  std::ostringstream os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
     << ")";
  return os.str();
}

std::string Launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : CudaError(e, what);
}

namespace {

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
  size_t off_agc = 0;            // its device buffers: part_g, part_w, unit_g, unit_w, unit_scale, vsq
};

size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

// Host table layout: the step constants, the host hyper-parameters, tensors, chunks, block
// starts, the tensors of many chunks, then the sparse plan's units, order, urows and ustart
// (each 256-aligned).
struct HostLayout {
  size_t off_hparams, off_tensors, off_chunks, off_blocks, off_many, off_units, off_order,
      off_urows, off_ustart, off_tiles, off_uoff, off_poff, off_ablocks, off_spans, bytes;
};
template <typename T>
size_t Bytes(const std::vector<T>& v) {
  return Align256(sizeof(T) * v.size());
}
HostLayout Layout(const CudaPlan& p) {
  HostLayout l;
  l.off_hparams = Align256(sizeof(DevConsts));
  l.off_tensors = l.off_hparams + Align256(sizeof(HParams));
  l.off_chunks = l.off_tensors + Align256(sizeof(DevTensor) * static_cast<size_t>(p.n));
  l.off_blocks = l.off_chunks + Align256(sizeof(DevChunk) * p.plan.chunks.size());
  l.off_many = l.off_blocks + Bytes(p.plan.block_begin);
  l.off_units = l.off_many + Bytes(p.many);
  l.bytes = l.off_units;
  l.off_order = l.off_urows = l.off_ustart = l.bytes;
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    l.off_order = l.off_units + Bytes(sp.units);
    l.off_urows = l.off_order + Bytes(sp.order);
    l.off_ustart = l.off_urows + Bytes(sp.urows);
    l.bytes = l.off_ustart + Bytes(sp.ustart);
  }
  l.off_tiles = l.off_uoff = l.off_poff = l.off_ablocks = l.off_spans = l.bytes;
  if (p.agc != nullptr) {
    l.off_uoff = l.off_tiles + Bytes(p.agc->tiles);
    l.off_poff = l.off_uoff + Bytes(p.agc->unit_off);
    l.off_ablocks = l.off_poff + Bytes(p.agc->part_off);
    l.off_spans = l.off_ablocks + Bytes(p.agc->blocks);
    l.bytes = l.off_spans + (p.sparse != nullptr ? Bytes(p.sparse->spans) : 0);
  }
  return l;
}

void PlanCudaStep(const int64_t* sizes, int n, CudaPlan* p, const SparsePlan* sparse, bool trust,
                  const AgcPlan* agc) {
  p->n = n;
  p->sparse = sparse;
  p->trust = trust;
  p->agc = agc;
  PlanChunks(sizes, n, kCudaChunkElems, &p->plan);
  PackCudaBlocks(&p->plan);
  p->many.clear();
  for (int i = 0; i < n; ++i) {  // PlanChunks cuts a tensor into ceil(size / kCudaChunkElems)
    if ((sizes[i] + kCudaChunkElems - 1) / kCudaChunkElems > kThreadChunks) p->many.push_back(i);
  }
  const size_t nchunks = p->plan.chunks.size();
  p->host_bytes = Layout(*p).bytes;
  p->off_partials = p->host_bytes;
  p->off_factors = p->off_partials + Align256(sizeof(double) * nchunks);
  p->off_status = p->off_factors + Align256(sizeof(ClipFactor) * static_cast<size_t>(n));
  p->device_bytes = p->off_status + Align256(sizeof(DevStatus));
  p->off_trust = p->off_trust_sums = p->device_bytes;
  if (trust) {
    const size_t nunits = sparse != nullptr ? sparse->units.size() : 0;
    p->off_trust_sums = p->off_trust + Align256(2 * sizeof(double) * (nchunks + nunits));
    p->device_bytes = p->off_trust_sums + Align256(2 * sizeof(double) * static_cast<size_t>(n));
  }
  p->off_agc = p->device_bytes;
  if (agc != nullptr) {
    const size_t np = static_cast<size_t>(agc->num_partials()), nu = static_cast<size_t>(agc->num_units());
    p->device_bytes += 2 * Align256(sizeof(double) * np) + 3 * Align256(sizeof(double) * nu) +
                       Align256(sizeof(double) * static_cast<size_t>(n));
  }
}

thread_local int g_last_launches = 0;
thread_local void* g_last_stream = nullptr;
thread_local int64_t g_last_blocks = 0;


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
#ifdef TFCLIP_PLANT_AGC_BLOCK
    // Every tile's partials land in row block 0: a tensor of several row blocks loses all but one.
    const int64_t off = a.part_off[tl.tensor] + tl.c0;
#else
    const int64_t off = a.part_off[tl.tensor] + tl.block * units + tl.c0;
#endif
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

// ---------------------------------------------------------------- kernel 2: finalize
constexpr int kFinalizeThreads = 1024;

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

// Thread 0: the scalars given in device memory, checked, and the step constants from them.
// Returns 0, or what is bad (DevStatus::bad).
__device__ int ReadDeviceScalars(const FinalizeArgs& a, const HParams& host_hp, ClipConfig* cfg,
                                 DevConsts* consts, double* bad_value) {
  HParams hp = host_hp;
  for (int k = 0; k < kNumHParams; ++k) {
    if (a.ds.hparams[k] != nullptr) hp.Set(static_cast<HP>(k), *a.ds.hparams[k]);
  }
  if (a.ds.iterations != nullptr) hp.step += static_cast<double>(*a.ds.iterations);
  if (a.ds.clip != nullptr) cfg->clip = *a.ds.clip;
  if (a.ds.use_norm != nullptr) cfg->use_norm = *a.ds.use_norm;
  const int k = FirstBadHParam(RuleHParams(a.rule), hp);
  if (k >= 0) {
    *bad_value = hp.Get(static_cast<HP>(k));
    return 1 + k;
  }
  const int c = ClipConfigError(*cfg);
  if (c != 0) {
    *bad_value = c == 1 ? cfg->clip : cfg->use_norm;
    return -c;
  }
  consts->f = MakeStepConsts<float>(hp);
  consts->d = MakeStepConsts<double>(hp);
  return 0;
}

__device__ double ReadScalar(const void* p, DType t) {
  return t == DType::kDouble ? *static_cast<const double*>(p)
                             : static_cast<double>(*static_cast<const float*>(p));
}

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(Table t, FinalizeArgs a,
                                                                  const HParams* host_hp) {
  double local = 0.0;
  if (a.have_partials) {
    for (int64_t c = threadIdx.x; c < t.nchunks; c += kFinalizeThreads) local += t.partials[c];
  }
  const double total = BlockSum<kFinalizeThreads>(local);
  TFCLIP_SHARED(double, s_scale);
  TFCLIP_SHARED(double, s_clip);
  TFCLIP_SHARED(int, s_mode);
  if (threadIdx.x == 0) {
    ClipConfig cfg = a.cfg;
    int bad = 0;
    double bad_value = 0.0;
    if (a.read_scalars) bad = ReadDeviceScalars(a, *host_hp, &cfg, t.consts, &bad_value);
    bool bad_clip_norm = false;
    if (a.clip_op.clip_norm != nullptr) {
      cfg.clip = ReadScalar(a.clip_op.clip_norm, a.clip_op.dtype);
      bad_clip_norm = !(isfinite(cfg.clip) && cfg.clip > 0.0);
    }
    if (a.clip_op.use_norm != nullptr) cfg.use_norm = ReadScalar(a.clip_op.use_norm, a.clip_op.dtype);
    double norm = StepGlobalNorm(cfg, total);
    if (a.round_norm && a.out.norm_dtype == DType::kFloat) norm = static_cast<float>(norm);
    const bool finite = isfinite(norm);
    const bool apply = bad == 0 && (finite || cfg.policy == NonFinitePolicy::kPropagate);
    const ClipMode mode = a.apply_step ? ActiveClipMode(cfg) : cfg.mode;
    double scale = mode == ClipMode::kGlobalNorm ? GlobalClipScale(cfg.clip, norm) : 1.0;
    if (bad_clip_norm) scale = NAN;
    t.status->norm = norm;
    t.status->scale = scale;
    t.status->finite = finite;
    t.status->apply = apply;
    t.status->bad = bad;
    t.status->bad_value = bad_value;
    if (a.out.norm != nullptr) {
      if (a.out.norm_dtype == DType::kDouble) *static_cast<double*>(a.out.norm) = norm;
      else *static_cast<float*>(a.out.norm) = static_cast<float>(norm);
    }
    if (a.out.applied != nullptr) *a.out.applied = apply;
    // Only an applied step counts (nothing else reads the counter in this step).
    if (apply && a.ds.iterations != nullptr) *a.ds.iterations += 1;
    s_scale = scale;
    s_clip = cfg.clip;
    s_mode = static_cast<int>(mode);
  }
  __syncthreads();
  if (a.zero_clipped) {
    for (int i = threadIdx.x; i < t.n; i += kFinalizeThreads) a.out.clipped_units[i] = 0;
  }
  void* norms_out = a.out.tensor_norms;
  if (t.factors == nullptr && norms_out == nullptr) return;
  const ClipMode mode = static_cast<ClipMode>(s_mode);
  const bool sums = a.have_partials && (mode == ClipMode::kNorm || norms_out != nullptr);
  auto finish = [&](int i, double sumsq) {
    if (t.factors != nullptr) t.factors[i] = TensorClipFactor(mode, s_clip, s_scale, sumsq);
    if (norms_out != nullptr) {
      const double nt = a.have_partials ? sqrt(sumsq) : NAN;
      if (a.out.tensor_norms_dtype == DType::kDouble) static_cast<double*>(norms_out)[i] = nt;
      else static_cast<float*>(norms_out)[i] = static_cast<float>(nt);
    }
  };
  for (int i = threadIdx.x; i < t.n; i += kFinalizeThreads) {
    const DevTensor& ten = t.tensors[i];
    if (sums && ten.num_chunks > kThreadChunks) continue;  // a warp's, below
    double sumsq = 0.0;
    if (sums) {
      for (int64_t c = ten.first_chunk; c < ten.first_chunk + ten.num_chunks; ++c) sumsq += t.partials[c];
    }
    finish(i, sumsq);
  }
  if (!sums) return;
  const int lane = threadIdx.x & 31;
  for (int k = threadIdx.x >> 5; k < t.nmany; k += kFinalizeThreads / 32) {
    const int i = t.many[k];
    const DevTensor& ten = t.tensors[i];
    double acc = 0.0;
    for (int64_t c = lane; c < ten.num_chunks; c += 32) acc += t.partials[ten.first_chunk + c];
    const double sumsq = WarpSum(acc);
    if (lane == 0) finish(i, sumsq);
  }
}

// ---------------------------------------------------------------- the clip op's scale pass
__global__ void __launch_bounds__(kThreads) ScaleKernel(Table t) {
  const double scale = t.status->scale;
  ForEachChunk(t, [&](int64_t c, Crew crew) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    DispatchDType(static_cast<DType>(ten.grad_dtype), [&](auto tag) {
      using T = decltype(tag);
      using M = typename Elem<T>::Math;
      const M s = RoundTo<T>(static_cast<M>(scale));
      const T* in = static_cast<const T*>(ten.grad);
      T* out = static_cast<T*>(ten.var);
      for (int64_t i = ch.begin + crew.rank; i < ch.end; i += crew.size) {
        out[i] = Elem<T>::Store(Elem<T>::Load(in[i]) * s);
      }
    });
  });
}

// ---------------------------------------------------------------- host side
// Fills the host table, uploads it, and returns the device-side view of the workspace.
std::string Upload(const CudaPlan& p, const DevTensor* tensors, const HParams* hp, void* host_ws,
                   void* dev_ws, cudaStream_t stream, Table* t) {
  const HostLayout l = Layout(p);
  char* h = static_cast<char*>(host_ws);
  char* d = static_cast<char*>(dev_ws);
  DevConsts* hc0 = reinterpret_cast<DevConsts*>(h);
  std::memset(static_cast<void*>(hc0), 0, sizeof(DevConsts));
  if (hp != nullptr) {
    hc0->f = MakeStepConsts<float>(*hp);
    hc0->d = MakeStepConsts<double>(*hp);
    std::memcpy(h + l.off_hparams, hp, sizeof(HParams));
  }
  std::memcpy(h + l.off_tensors, tensors, sizeof(DevTensor) * p.n);
  DevChunk* hc = reinterpret_cast<DevChunk*>(h + l.off_chunks);
  for (size_t c = 0; c < p.plan.chunks.size(); ++c) {
    const Chunk& ch = p.plan.chunks[c];
    hc[c] = DevChunk{ch.begin, ch.end, ch.tensor, 0};
#ifdef TFCLIP_PLANT_CHUNK_END
    // A chunk followed by another of its tensor ends one element early.
    if (c + 1 < p.plan.chunks.size() && p.plan.chunks[c + 1].tensor == ch.tensor) hc[c].end--;
#endif
  }
  std::memcpy(h + l.off_blocks, p.plan.block_begin.data(), sizeof(int64_t) * p.plan.block_begin.size());
  if (!p.many.empty()) std::memcpy(h + l.off_many, p.many.data(), sizeof(int32_t) * p.many.size());
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    std::memcpy(h + l.off_units, sp.units.data(), sizeof(SparseUnit) * sp.units.size());
    std::memcpy(h + l.off_order, sp.order.data(), sizeof(int64_t) * sp.order.size());
    std::memcpy(h + l.off_urows, sp.urows.data(), sizeof(int64_t) * sp.urows.size());
    std::memcpy(h + l.off_ustart, sp.ustart.data(), sizeof(int64_t) * sp.ustart.size());
  }
  if (p.agc != nullptr) {
    const AgcPlan& ap = *p.agc;
    if (!ap.tiles.empty()) std::memcpy(h + l.off_tiles, ap.tiles.data(), sizeof(AgcTile) * ap.tiles.size());
    std::memcpy(h + l.off_uoff, ap.unit_off.data(), sizeof(int64_t) * ap.unit_off.size());
    std::memcpy(h + l.off_poff, ap.part_off.data(), sizeof(int64_t) * ap.part_off.size());
    if (!ap.blocks.empty()) std::memcpy(h + l.off_ablocks, ap.blocks.data(), sizeof(int64_t) * ap.blocks.size());
    if (p.sparse != nullptr && !p.sparse->spans.empty()) {
      std::memcpy(h + l.off_spans, p.sparse->spans.data(), sizeof(SparseSpan) * p.sparse->spans.size());
    }
  }
  const cudaError_t e = cudaMemcpyAsync(d, h, l.bytes, cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return CudaError(e, "the tensor table upload");
  t->consts = reinterpret_cast<DevConsts*>(d);
  t->tensors = reinterpret_cast<const DevTensor*>(d + l.off_tensors);
  t->chunks = reinterpret_cast<const DevChunk*>(d + l.off_chunks);
  t->block_begin = reinterpret_cast<const int64_t*>(d + l.off_blocks);
  t->partials = reinterpret_cast<double*>(d + p.off_partials);
  t->factors = reinterpret_cast<ClipFactor*>(d + p.off_factors);
  t->status = reinterpret_cast<DevStatus*>(d + p.off_status);
  t->trust = p.trust ? reinterpret_cast<double*>(d + p.off_trust) : nullptr;
  t->trust_sums = p.trust ? reinterpret_cast<double*>(d + p.off_trust_sums) : nullptr;
  t->many = reinterpret_cast<const int32_t*>(d + l.off_many);
  t->nmany = static_cast<int>(p.many.size());
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
  for (int i = 0; i < p.n; ++i) ts[i].first_unit = ts[i].num_units = 0;
  if (p.sparse != nullptr) {
    const auto& un = p.sparse->units;
    for (size_t x = un.size(); x-- > 0;) {
      ts[un[x].tensor].first_unit = static_cast<int64_t>(x);
      ts[un[x].tensor].num_units++;
    }
  }
}

// Norm (when needed) and finalize: the first two launches of every op.
std::string NormAndFinalize(const CudaPlan& p, const Table& t, const FinalizeArgs& a,
                            const void* dev_ws, cudaStream_t stream, const DevAgc* agc = nullptr) {
  const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
  if (agc != nullptr) {
    // AGC's pass instead of the norm kernel: unit sums, then each tensor's sum where the
    // finalize reads it, and the units' scales (csrc/core/agc.h). No host wait.
    const int64_t nb = agc->ntiles + agc->nspans;
    if (nb > 0) {
      TFCLIP_LAUNCH(AgcNormKernel, static_cast<unsigned>(nb), kThreads, 0, stream)(t, *agc);
      ++g_last_launches;
      std::string e = Launched("the AGC norm kernel");
      if (!e.empty()) return e;
    }
    if (agc->nunits > 0) {
      TFCLIP_LAUNCH(AgcUnitKernel, static_cast<unsigned>((agc->nunits + kThreads - 1) / kThreads),
                    kThreads, 0, stream)(t, *agc);
      ++g_last_launches;
      std::string e = Launched("the AGC unit kernel");
      if (!e.empty()) return e;
    }
    TFCLIP_LAUNCH(AgcTensorKernel, static_cast<unsigned>((agc->n + kThreads - 1) / kThreads),
                  kThreads, 0, stream)(t, *agc);
    ++g_last_launches;
    std::string e = Launched("the AGC tensor kernel");
    if (!e.empty()) return e;
  } else if (a.have_partials && nblocks > 0) {
    TFCLIP_LAUNCH(NormKernel, nblocks, kThreads, 0, stream)(t);
    ++g_last_launches;
    const std::string e = Launched("the norm kernel");
    if (!e.empty()) return e;
  }
  const HParams* hp = reinterpret_cast<const HParams*>(static_cast<const char*>(dev_ws) +
                                                       Layout(p).off_hparams);
  TFCLIP_LAUNCH(FinalizeKernel, 1, kFinalizeThreads, 0, stream)(t, a, hp);
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

// Plans a step, acquires its memory, runs fn(plan, host, device) and releases the memory on
// every path: the one place a step's workspace is handed back (in stream order).
template <typename Fn>
std::string WithStepMemory(const int64_t* sizes, int n, const SparsePlan* sparse, bool trust,
                           CudaStepMemory* mem, void* stream, Fn&& fn, const AgcPlan* agc = nullptr) {
  g_last_launches = 0;
  g_last_stream = stream;
  CudaPlan p;
  PlanCudaStep(sizes, n, &p, sparse, trust, agc);
  g_last_blocks = p.plan.num_blocks();
  void* host = nullptr;
  void* dev = nullptr;
  std::string e = mem->Acquire(p.host_bytes, p.device_bytes, &host, &dev);
  if (!e.empty()) return e;
  e = fn(p, host, dev);
  const std::string r = mem->Release();
  return e.empty() ? r : e;
}

std::vector<int64_t> ViewSizes(const TensorView* v, int n) {
  std::vector<int64_t> s(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) s[i] = v[i].size;
  return s;
}

// The norm and clip ops' steps: inputs (and outputs), no clip factors.
std::string ViewStep(const TensorView* in, const TensorView* out, int n, const FinalizeArgs& a,
                     CudaStepMemory* mem, void* stream_v, bool scale) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  const std::vector<int64_t> sizes = ViewSizes(in, n);
  return WithStepMemory(sizes.data(), n, nullptr, false, mem, stream_v,
                        [&](const CudaPlan& p, void* h, void* d) -> std::string {
    std::vector<DevTensor> dts = TensorsFromViews(in, out, n);
    ChunkRanges(p, dts.data());
    Table t;
    std::string e = Upload(p, dts.data(), nullptr, h, d, stream, &t);
    if (!e.empty()) return e;
    t.factors = nullptr;
    e = NormAndFinalize(p, t, a, d, stream);
    if (!e.empty()) return e;
    const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
    if (scale && nblocks > 0) {
      TFCLIP_LAUNCH(ScaleKernel, nblocks, kThreads, 0, stream)(t);
      ++g_last_launches;
      return Launched("the scale kernel");
    }
    return "";
  });
}

}  // namespace

bool DeviceScalars::any() const {
  for (const double* p : hparams) {
    if (p != nullptr) return true;
  }
  return clip != nullptr || use_norm != nullptr || iterations != nullptr;
}

int LastStepLaunches() { return g_last_launches; }

int64_t LastStepBlocks() { return g_last_blocks; }

void PackCudaBlocks(ChunkPlan* plan) {
  plan->block_begin.assign(1, 0);
  int in_block = 0;  // small chunks in the open block
  const int64_t nchunks = static_cast<int64_t>(plan->chunks.size());
  for (int64_t c = 0; c < nchunks; ++c) {
    const Chunk& ch = plan->chunks[c];
    if (ch.end - ch.begin > kWarpChunkElems) {
      if (in_block > 0) plan->block_begin.push_back(c);
      plan->block_begin.push_back(c + 1);
      in_block = 0;
    } else if (++in_block == kWarpsPerBlock) {
      plan->block_begin.push_back(c + 1);
      in_block = 0;
    }
  }
  if (in_block > 0) plan->block_begin.push_back(nchunks);
}

void* LastStepStream() { return g_last_stream; }

std::string CudaGlobalNorm(const TensorView* ts, int n, CudaStepMemory* mem,
                           const CudaOutputs& out, void* stream) {
  FinalizeArgs a{};
  a.cfg = ClipConfig{};
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = true;
  a.out = out;
  return ViewStep(ts, nullptr, n, a, mem, stream, false);
}

std::string CudaClipByGlobalNorm(const TensorView* in, const TensorView* outs, int n,
                                 double clip_norm, bool has_use_norm, double use_norm,
                                 const ClipOpScalars& dev, CudaStepMemory* mem,
                                 const CudaOutputs& out, void* stream) {
  FinalizeArgs a{};
  a.clip_op = dev;
  a.cfg.mode = ClipMode::kGlobalNorm;
  a.cfg.clip = clip_norm;
  a.cfg.has_use_norm = has_use_norm;
  a.cfg.use_norm = use_norm;
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = !has_use_norm;
  a.round_norm = true;
  a.out = out;
  return ViewStep(in, outs, n, a, mem, stream, true);
}

std::string CudaClipApply(const StepArgs& args, const DeviceScalars& ds, CudaStepMemory* mem,
                          const CudaOutputs& out, void* stream_v, StepResult* r) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  *r = StepResult{};
  const int n = args.n;
  const ApplyTensor* ts = args.ts;
  // Host values are checked here, device ones by the finalize kernel (agc_eps is a host value).
  const bool on_device = ds.any();
  if (args.cfg.mode == ClipMode::kAgc) {
    ClipConfig eps_only = args.cfg;  // its eps alone (the clip may be on the device)
    eps_only.clip = 0.0;
    eps_only.has_use_norm = false;
    r->error = ValidateClipConfig(eps_only);
    if (!r->error.empty()) return "";
  }
  HParams hp;
  if (!on_device) {
    r->error = StepHParams(args, &hp);
    if (!r->error.empty()) return "";
  } else {
    hp = args.hp;
  }
  SparsePlan sparse;
  r->error = PlanSparse(ts, n, args.rule, hp, args.lazy, kCudaChunkElems, &sparse,
                        ds.hparams[static_cast<int>(HP::weight_decay)] != nullptr);
  if (!r->error.empty()) return "";
  // AGC: with a clip given on the device (0 there is no clip: scales of 1) or a host one > 0.
  const bool agc = args.cfg.mode == ClipMode::kAgc && (ds.clip != nullptr || args.cfg.clip != 0.0);
  AgcPlan agc_plan;
  if (agc) {
    r->error = PlanAgc(ts, n, &agc_plan);
    if (!r->error.empty()) return "";
  }
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) sizes[i] = ts[i].grad_size();
  DevStatus status{};
  const bool trust = RuleTrustRatio(args.rule);
  const std::string e = WithStepMemory(sizes.data(), n, &sparse, trust, mem, stream_v,
                                       [&](const CudaPlan& p, void* h, void* d) -> std::string {
    std::vector<DevTensor> dts(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      DevTensor& dt = dts[i];
      std::memset(&dt, 0, sizeof(dt));
      dt.var = ts[i].var;
      dt.grad = ts[i].grad;
      for (int k = 0; k < kMaxSlots; ++k) dt.slots[k] = ts[i].slots[k];
      dt.size = ts[i].grad_size();
      dt.width = ts[i].width;
      dt.sparse = ts[i].sparse ? 1 : 0;
      dt.var_dtype = static_cast<int32_t>(ts[i].var_dtype);
      dt.grad_dtype = static_cast<int32_t>(ts[i].grad_dtype);
    }
    ChunkRanges(p, dts.data());
    DevAgc dagc{};
    if (agc) {
      const HostLayout l = Layout(p);
      char* dc = static_cast<char*>(d);
      const size_t np = static_cast<size_t>(agc_plan.num_partials());
      const size_t nu = static_cast<size_t>(agc_plan.num_units());
      size_t o = p.off_agc;
      auto take = [&](size_t count) {
        double* q = reinterpret_cast<double*>(dc + o);
        o += Align256(sizeof(double) * count);
        return q;
      };
      dagc.part_g = take(np);
      dagc.part_w = take(np);
      dagc.unit_g = take(nu);
      dagc.unit_w = take(nu);
      dagc.unit_scale = take(nu);
      dagc.vsq = take(static_cast<size_t>(n));
      dagc.tiles = reinterpret_cast<const AgcTile*>(dc + l.off_tiles);
      dagc.ntiles = static_cast<int64_t>(agc_plan.tiles.size());
      dagc.unit_off = reinterpret_cast<const int64_t*>(dc + l.off_uoff);
      dagc.part_off = reinterpret_cast<const int64_t*>(dc + l.off_poff);
      dagc.blocks = reinterpret_cast<const int64_t*>(dc + l.off_ablocks);
      dagc.spans = reinterpret_cast<const SparseSpan*>(dc + l.off_spans);
      dagc.nspans = static_cast<int64_t>(sparse.spans.size());
      dagc.order = reinterpret_cast<const int64_t*>(dc + l.off_order);
      dagc.urows = reinterpret_cast<const int64_t*>(dc + l.off_urows);
      dagc.ustart = reinterpret_cast<const int64_t*>(dc + l.off_ustart);
      dagc.nunits = static_cast<int64_t>(nu);
      dagc.n = n;
      dagc.clip = args.cfg.clip;
      dagc.eps = args.cfg.agc_eps;
      dagc.dev_clip = ds.clip;
      dagc.clipped = out.clipped_units;
      for (int i = 0; i < n; ++i) {
        dts[i].unit_scale = dagc.unit_scale + agc_plan.unit_off[i];
        dts[i].units = agc_plan.unit_off[i + 1] - agc_plan.unit_off[i];
      }
    }
    Table t;
    std::string err = Upload(p, dts.data(), &hp, h, d, stream, &t);
    if (!err.empty()) return err;
    FinalizeArgs a{};
    a.cfg = args.cfg;
    a.rule = args.rule;
    a.have_partials = NeedsNormPass(args.cfg);
    a.apply_step = true;
    a.ds = ds;
    a.read_scalars = on_device;
    a.out = out;
    a.zero_clipped = out.clipped_units != nullptr && !agc;
    err = NormAndFinalize(p, t, a, d, stream, agc ? &dagc : nullptr);
    if (!err.empty()) return err;
    const int nslots = NumSlots(args.rule, hp);
    const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
    const bool has_sparse = !sparse.empty();
    DevSparse dsp{};
    if (has_sparse) {
      const HostLayout l = Layout(p);
      const char* dc = static_cast<const char*>(d);
      dsp.units = reinterpret_cast<const SparseUnit*>(dc + l.off_units);
      dsp.order = reinterpret_cast<const int64_t*>(dc + l.off_order);
      dsp.urows = reinterpret_cast<const int64_t*>(dc + l.off_urows);
      dsp.ustart = reinterpret_cast<const int64_t*>(dc + l.off_ustart);
      dsp.nunits = static_cast<int64_t>(sparse.units.size());
    }
    if (nblocks > 0) err = LaunchDenseApply(args.rule, nslots, t, nblocks, stream, &g_last_launches);
    if (err.empty() && has_sparse) err = LaunchSparseApply(args.rule, nslots, t, dsp, stream, &g_last_launches);
    if (err.empty() && trust && n > 0) err = LaunchTrust(args.rule, nslots, t, dsp, nblocks, stream, &g_last_launches);
    if (!err.empty()) return err;
    if (args.cfg.policy == NonFinitePolicy::kRaise) {
      // The one host wait in tfclip: 'raise' must know before it returns.
      cudaError_t ce = cudaMemcpyAsync(&status, t.status, sizeof(DevStatus),
                                       cudaMemcpyDeviceToHost, stream);
      if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
      if (ce != cudaSuccess) return CudaError(ce, "reading the step's status");
    }
    return "";
  }, agc ? &agc_plan : nullptr);
  if (!e.empty()) return e;
  if (args.cfg.policy == NonFinitePolicy::kRaise) {
    r->global_norm = status.norm;
    r->applied = status.apply != 0;
    r->nonfinite = !status.finite;
    if (status.bad > 0) {
      r->error = HParamError(status.bad - 1, status.bad_value) + " (read on the device); no variable was updated";
    } else if (status.bad < 0) {
      ClipConfig c = args.cfg;
      c.clip = c.use_norm = status.bad_value;
      c.has_use_norm = status.bad == -2;
      if (status.bad == -2) c.mode = ClipMode::kNone;
      r->error = ValidateClipConfig(c) + " (read on the device); no variable was updated";
    } else if (!status.finite) {
      r->error = NonFiniteError(status.norm);
    }
  }
  return "";
}

}  // namespace cuda
}  // namespace tfclip
