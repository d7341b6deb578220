// tfclip core, CUDA: the finalize kernel and the clip op's scale kernel. FinalizeKernel, one
// block after the norm pass: reads and checks the scalars given in device memory, computes the
// step constants, reduces the norm pass's slots in a fixed order, and writes the norm, each
// tensor's clip factor (and norm) and the apply flag. ScaleKernel: the clip op's second pass,
// out = in * scale. The launch sequences: cuda_driver.cu; the norm pass's kernels (the slots
// read here): cuda_norm.cu; the step's plan and tensor table: cuda_plan.cu; the apply kernels:
// cuda_apply.cu, cuda_sparse_apply.cu. Shared structures (FinalizeArgs among them) and the
// launchers' declarations: csrc/core/cuda/kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {
namespace {

// ---------------------------------------------------------------- kernel 2: finalize
constexpr int kFinalizeThreads = 1024;

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
  if (a.ds.grad_scale != nullptr) cfg->grad_scale = *a.ds.grad_scale;
  if (a.ds.rounding[0] != nullptr) hp.rounding_seed = *a.ds.rounding[0];
  if (a.ds.rounding[1] != nullptr) hp.rounding_step = *a.ds.rounding[1];
  if (a.ds.rounding[2] != nullptr) hp.rounding_tensor = *a.ds.rounding[2];
  // (counted from the op's step counter, as `step`: after the rounding step is read)
  if (a.ds.iterations != nullptr && hp.stochastic_rounding) {
    hp.rounding_step += static_cast<double>(*a.ds.iterations);
  }
  const int k = FirstBadHParam(RuleHParams(a.rule), hp);
  if (k >= 0) {
    *bad_value = hp.Get(static_cast<HP>(k));
    return 1 + k;
  }
  const int r = RoundingError(hp);  // stochastic rounding's [seed, step] (rounding.h)
  if (r != 0) {
    *bad_value = r == 1 ? hp.rounding_seed : hp.rounding_step;
    return -5 - r;  // -6, -7
  }
  const int c = ClipConfigError(*cfg);
  if (c != 0) {
    *bad_value = c == 1 ? cfg->clip : (c == 4 || c == 5) ? cfg->grad_scale : cfg->use_norm;
    return -c;
  }
  DispatchRule(a.rule, [&](auto rule_tag) { consts->Set(MakeRuleConsts<decltype(rule_tag)>(hp)); });
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
  TFCLIP_SHARED(double, s_grad_scale);
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
    s_grad_scale = cfg.grad_scale;
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
    // (planted: the clip factors without grad_scale, its default 1: the apply sees g, not g * s)
    if (t.factors != nullptr) {
      t.factors[i] = TensorClipFactor(mode, s_clip, s_scale, sumsq, TFCLIP_PLANTED(GRAD_SCALE) ? 1.0 : s_grad_scale);
    }
    if (norms_out != nullptr) {
      const double nt = a.have_partials ? sqrt(sumsq) * s_grad_scale : NAN;
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

}  // namespace

std::string LaunchFinalize(const Table& t, const FinalizeArgs& a, const HParams* host_hp,
                           cudaStream_t stream, int* launches) {
  TFCLIP_LAUNCH(FinalizeKernel, 1, kFinalizeThreads, 0, stream)(t, a, host_hp);
  ++*launches;
  return Launched("the finalize kernel");
}

std::string LaunchScale(const Table& t, unsigned nblocks, cudaStream_t stream, int* launches) {
  TFCLIP_LAUNCH(ScaleKernel, nblocks, kThreads, 0, stream)(t);
  ++*launches;
  return Launched("the scale kernel");
}

}  // namespace cuda
}  // namespace tfclip
