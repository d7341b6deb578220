// tfclip core, CPU: the driver. The element passes live in cpu_kernels.inc, compiled per
// instruction set (cpu_kernels.cc picks the variant at run time); this file runs a step's
// passes in order.
#include "csrc/core/cpu/driver.h"

#include <cmath>
#include <cstdlib>

#include "csrc/core/cpu/kernels.h"
#include "csrc/core/cpu/denormals.h"

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

// A factored step (Adafactor; csrc/core/factored.h) after the clip factors: the stats pass, each
// tensor's column sums, r and c and each matrix's mean of r (in order, on this thread), the
// rms(u) pass, each tensor's sums, the update pass. The passes are the per-ISA kernels'
// (cpu_factored.inc).
void FactoredApplyCpu(const HParams& hp, const ApplyTensor* ts, int n, const ClipFactor* factors,
                      FactoredScratch* s, const CpuExecutor& exec) {
  const FactoredPlan& plan = s->plan;
  using Rule = AdafactorRule;
  const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
  const int64_t ntiles = static_cast<int64_t>(plan.tiles.size());
  s->rows.assign(static_cast<size_t>(plan.row_off.back()), 0.0);
  s->part.assign(static_cast<size_t>(plan.part_off.back()), 0.0);
  s->cols.assign(static_cast<size_t>(plan.col_off.back()), 0.0);
  s->r_mean.assign(static_cast<size_t>(plan.mat_off.back()), 0.0);
  s->w_part.assign(static_cast<size_t>(ntiles), 0.0);
  s->u_part.assign(static_cast<size_t>(ntiles), 0.0);
  s->w_sum.assign(static_cast<size_t>(n), 0.0);
  s->u_sum.assign(static_cast<size_t>(n), 0.0);

  ActiveCpuKernels().factored(1, hp, ts, factors, s, exec);  // stats

  // Per tensor, in order: column sums, r and c updated and stored, each matrix's mean of r.
  for (int i = 0; i < n; ++i) {
    const ApplyTensor& t = ts[i];
    double w2 = 0.0;
    for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) w2 += s->w_part[x];
    s->w_sum[i] = w2;
    if (t.fac_cols <= 0 || t.size == 0) continue;
    DispatchDType(t.var_dtype, [&](auto vtag) {
      using V = decltype(vtag);
      using M = typename Elem<V>::Math;
      const auto& c = ConstsFor<V>(rc);
      const int64_t m = t.fac_rows, cols = t.fac_cols;
      const int64_t nrows = plan.row_off[i + 1] - plan.row_off[i];
      const int64_t mats = plan.mat_off[i + 1] - plan.mat_off[i];
      double* colsum = s->cols.data() + plan.col_off[i];
      for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) {
        const FactoredTile& tile = plan.tiles[x];
        const double* part = s->part.data() + plan.part_off[i] + tile.part * cols;
        double* dst = colsum + tile.matrix * cols;
        for (int64_t k = 0; k < cols; ++k) dst[k] += part[k];
      }
      V* r = static_cast<V*>(t.slots[0]);
      V* cc = static_cast<V*>(t.slots[1]);
      const double* rows = s->rows.data() + plan.row_off[i];
      for (int64_t k = 0; k < nrows; ++k) {
        const M mean = static_cast<M>(rows[k] / static_cast<double>(cols));
        r[k] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(r[k]), mean));
      }
      for (int64_t k = 0; k < mats * cols; ++k) {
        const M mean = static_cast<M>(colsum[k] / static_cast<double>(m));
        cc[k] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(cc[k]), mean));
      }
      double* r_mean = s->r_mean.data() + plan.mat_off[i];
      for (int64_t b = 0; b < mats; ++b) {
        double sum = 0.0;
        for (int64_t k = b * m; k < (b + 1) * m; ++k) sum += static_cast<double>(Elem<V>::Load(r[k]));
        r_mean[b] = static_cast<double>(static_cast<M>(sum / static_cast<double>(m)));
      }
    });
  }

  ActiveCpuKernels().factored(2, hp, ts, factors, s, exec);  // rms(u)
  for (int i = 0; i < n; ++i) {
    double u2 = 0.0;
    for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) u2 += s->u_part[x];
    s->u_sum[i] = u2;
  }

  ActiveCpuKernels().factored(3, hp, ts, factors, s, exec);  // the update
}

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
