// tfclip core, CPU: the driver. The element passes live in cpu_kernels.inc, compiled per
// instruction set (cpu_kernels.cc picks the variant at run time); this file runs a step's
// passes in order.
#include "csrc/core/cpu_driver.h"

#include <cmath>
#include <cstdlib>

#include "csrc/core/cpu_kernels.h"
#include "csrc/core/denormals.h"

namespace tfclip {

void SumSquaresCpu(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                   double* per_tensor, double* total, const CpuExecutor& exec) {
  ActiveCpuKernels().sum_squares(ts, n, plan, partials, per_tensor, total, exec);
}

void AgcSumsCpu(const ApplyTensor* ts, const AgcPlan& plan, const SparsePlan& sp, double* part_g,
                double* part_w, double* unit_g, double* sparse_values_sumsq,
                const CpuExecutor& exec) {
  ActiveCpuKernels().agc_sums(ts, plan, sp, part_g, part_w, unit_g, sparse_values_sumsq, exec);
}

void ScaleCpu(const TensorView* in, const TensorView* out, const ChunkPlan& plan,
              double scale, const CpuExecutor& exec) {
  ActiveCpuKernels().scale(in, out, plan, scale, exec);
}

void ApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
              const ChunkPlan& plan, const ClipFactor* factors, const CpuExecutor& exec,
              double* trust) {
  ActiveCpuKernels().apply(rule, hp, ts, plan, factors, trust, exec);
}

void SparseApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,
                    const ClipFactor* factors, const CpuExecutor& exec, double* trust) {
  ActiveCpuKernels().sparse_apply(rule, hp, ts, sp, factors, trust, exec);
}

void TrustCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,
              const SparsePlan& sp, const double* sums, const CpuExecutor& exec) {
  ActiveCpuKernels().trust(rule, hp, ts, plan, sp, sums, exec);
}

void ReduceTrustSums(const ChunkPlan& plan, const SparsePlan& sp, const double* trust, int n,
                     double* sums) {
  for (int i = 0; i < 2 * n; ++i) sums[i] = 0.0;
  const size_t nchunks = plan.chunks.size();
  for (size_t c = 0; c < nchunks; ++c) {
    const int i = plan.chunks[c].tensor;
    sums[2 * i] += trust[2 * c];
    sums[2 * i + 1] += trust[2 * c + 1];
  }
  for (size_t x = 0; x < sp.units.size(); ++x) {
    const int i = sp.units[x].tensor;
    sums[2 * i] += trust[2 * (nchunks + x)];
    sums[2 * i + 1] += trust[2 * (nchunks + x) + 1];
  }
}

double GlobalNormCpu(const TensorView* ts, int n, const CpuExecutor& exec, double* tensor_norms) {
  ChunkPlan plan;
  PlanList(ts, n, &plan);
  std::vector<double> partials(plan.chunks.size());
  double total = 0.0;
  // The per-tensor sums go straight to the caller's buffer, then become norms in place.
  SumSquaresCpu(ts, n, plan, partials.data(), tensor_norms, &total, exec);
  if (tensor_norms != nullptr) TensorNorms(tensor_norms, n, tensor_norms);
  return std::sqrt(total);
}

void TensorNorms(const double* per_tensor_sumsq, int n, double* out, double grad_scale) {
  for (int i = 0; i < n; ++i) {
    out[i] = per_tensor_sumsq != nullptr ? std::sqrt(per_tensor_sumsq[i]) * grad_scale : NAN;
  }
}

void ScaleListCpu(const TensorView* in, const TensorView* out, int n, double scale,
                  const CpuExecutor& exec) {
  ChunkPlan plan;
  PlanList(in, n, &plan);
  ScaleCpu(in, out, plan, scale, exec);
}

template <typename T>
T RoundNorm(double norm) {
  ScopedKeepDenormals keep;
  volatile T r = static_cast<T>(norm);  // converted inside the scope, not hoisted out of it
  return r;
}
template float RoundNorm<float>(double);
template double RoundNorm<double>(double);

StepResult ClipApplyCpu(const StepArgs& a, StepScratch* s, const CpuExecutor& exec) {
  StepResult r;
  HParams hp;
  r.error = StepHParams(a, &hp);
  if (r.error.empty()) r.error = ValidateState(a);
  if (!r.error.empty()) return r;
  const int n = a.n;
  const ApplyTensor* ts = a.ts;
  // Indices are checked (and grouped) before anything runs: a bad one writes nothing.
  r.error = PlanSparse(ts, n, a.rule, hp, a.lazy, kChunkElems, &s->sparse);
  if (!r.error.empty()) return r;
  s->grads.resize(n);
  for (int i = 0; i < n; ++i) {
    s->grads[i] = TensorView{const_cast<void*>(ts[i].grad), ts[i].grad_size(), ts[i].grad_dtype};
  }
  PlanList(s->grads.data(), n, &s->plan);
  const bool factored = RuleFactored(a.rule);
  if (factored) {
    r.error = PlanFactored(ts, n, &s->factored.plan);
    if (!r.error.empty()) return r;
  }
  s->per_tensor.assign(n, 0.0);
  s->factors.resize(n);
  double total = 0.0;
  const bool agc = ActiveClipMode(a.cfg) == ClipMode::kAgc;
  if (agc) {
    // One pass reads each gradient and its variable: per-unit sums, the tensors' and the total
    // from them (agc.h).
    r.error = PlanAgc(ts, n, &s->agc);
    if (!r.error.empty()) return r;
    const size_t np = static_cast<size_t>(s->agc.num_partials());
    const size_t nu = static_cast<size_t>(s->agc.num_units());
    s->agc_part_g.resize(np);
    s->agc_part_w.resize(np);
    s->unit_g.resize(nu);
    s->unit_w.resize(nu);
    s->unit_scale.resize(nu);
    s->sparse_vsq.assign(n, 0.0);
    AgcSumsCpu(ts, s->agc, s->sparse, s->agc_part_g.data(), s->agc_part_w.data(), s->unit_g.data(),
               s->sparse_vsq.data(), exec);
    ReduceAgcSums(ts, n, s->agc, s->agc_part_g.data(), s->agc_part_w.data(), s->unit_g.data(),
                  s->unit_w.data(), s->sparse_vsq.data(), s->per_tensor.data(), &total);
  } else if (NeedsNormPass(a.cfg)) {
    s->partials.resize(s->plan.chunks.size());
    SumSquaresCpu(s->grads.data(), n, s->plan, s->partials.data(), s->per_tensor.data(), &total,
                  exec);
  }
  const ClipOutcome oc = ComputeClipFactors(a.cfg, s->per_tensor.data(), total, n, s->factors.data());
  if (agc) {
    AgcScales(a.cfg, ts, n, s->agc, s->unit_g.data(), s->unit_w.data(), s->unit_scale.data(),
              a.agc_clipped, s->factors.data());
  } else if (a.agc_clipped != nullptr) {
    for (int i = 0; i < n; ++i) a.agc_clipped[i] = 0;
  }
  if (a.tensor_norms != nullptr) {
    TensorNorms(NeedsNormPass(a.cfg) ? s->per_tensor.data() : nullptr, n, a.tensor_norms, a.cfg.grad_scale);
  }
  r.global_norm = oc.global_norm;
  r.nonfinite = !oc.finite;
  if (!oc.finite && a.cfg.policy != NonFinitePolicy::kPropagate) {  // nothing written
    if (a.cfg.policy == NonFinitePolicy::kRaise) r.error = NonFiniteError(r.global_norm);
    return r;
  }
  if (factored) {
    FactoredApplyCpu(hp, ts, n, s->factors.data(), &s->factored, exec);
  } else if (!RuleTrustRatio(a.rule)) {
    ApplyCpu(a.rule, hp, ts, s->plan, s->factors.data(), exec);
    SparseApplyCpu(a.rule, hp, ts, s->sparse, s->factors.data(), exec);
  } else {
    // Slots and per-tensor sums, then the variables with each tensor's ratio.
    const size_t nchunks = s->plan.chunks.size();
    s->trust.assign(2 * (nchunks + s->sparse.units.size()), 0.0);
    s->trust_sums.resize(2 * static_cast<size_t>(n));
    ApplyCpu(a.rule, hp, ts, s->plan, s->factors.data(), exec, s->trust.data());
    SparseApplyCpu(a.rule, hp, ts, s->sparse, s->factors.data(), exec, s->trust.data() + 2 * nchunks);
    ReduceTrustSums(s->plan, s->sparse, s->trust.data(), n, s->trust_sums.data());
    TrustCpu(a.rule, hp, ts, s->plan, s->sparse, s->trust_sums.data(), exec);
  }
  r.applied = true;
  if (a.iterations != nullptr) ++*a.iterations;
  return r;
}

}  // namespace tfclip
