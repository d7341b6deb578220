// tfclip core, CPU: the multi-tensor driver. One parallel region per pass over the chunk plan
// of the whole list (the passes: cpu/kernels.h); the executor is whatever thread pool the
// adapter has (cpu/executor.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "csrc/core/agc.h"
#include "csrc/core/cpu/executor.h"
#include "csrc/core/factored.h"
#include "csrc/core/chunk_plan.h"
#include "csrc/core/clip.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/step.h"
#include "csrc/core/tensors.h"
#include "csrc/core/sparse.h"

namespace tfclip {

// Norm pass: fp64 sum of squares per chunk into partials[chunk], then reduced in chunk order
// into per_tensor[n] (may be null) and *total. fp64 accumulation keeps float32 values near
// 1e20 (whose squares overflow float32) and subnormals exact enough for a right norm.
void SumSquaresCpu(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                   double* per_tensor, double* total, const CpuExecutor& exec);

// The global L2 norm of a list: plan, norm pass, sqrt. What every adapter's norm op calls.
// tensor_norms (may be null): each tensor's own norm, from the same pass (TensorNorms).
double GlobalNormCpu(const TensorView* ts, int n, const CpuExecutor& exec,
                     double* tensor_norms = nullptr);

// Each tensor's L2 norm from the norm pass's per-tensor fp64 sums of squares (reduced in chunk
// order: the same bits for any thread count), or NaN for all when no norm pass ran.
void TensorNorms(const double* per_tensor_sumsq, int n, double* out, double grad_scale = 1.0);

// AGC's norm pass (agc.h) over the plan's tiles and the IndexedSlices gradients' spans.
void AgcSumsCpu(const ApplyTensor* ts, const AgcPlan& plan, const SparsePlan& sp, double* part_g,
                double* part_w, double* unit_g, double* sparse_values_sumsq,
                const CpuExecutor& exec);

// Clip op's second pass over a whole list: out[i] = in[i] * cast<T>(scale).
void ScaleListCpu(const TensorView* in, const TensorView* out, int n, double scale,
                  const CpuExecutor& exec);

// Clip op's second pass: out[i] = in[i] * cast<T>(scale).
void ScaleCpu(const TensorView* in, const TensorView* out, const ChunkPlan& plan,
              double scale, const CpuExecutor& exec);

// Apply pass: for each element, the clip factor of its tensor, decoupled weight decay, then
// the rule; reads grad, var and slots once and writes var and slots once. A trust-ratio rule
// (rules.h) writes the slots only, and chunk c's sums of w^2 and u^2 into trust[2c], trust[2c+1]
// (trust is null for the other rules).
void ApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
              const ChunkPlan& plan, const ClipFactor* factors, const CpuExecutor& exec,
              double* trust = nullptr);

// The apply pass of the IndexedSlices gradients of `ts` (planned by PlanSparse); a trust-ratio
// rule's sums of unit x into trust[2x], trust[2x+1].
void SparseApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,
                    const ClipFactor* factors, const CpuExecutor& exec, double* trust = nullptr);

// A trust-ratio rule's last pass: every variable element, dense and sparse, stepped with its
// tensor's ratio from sums[2i] (w^2) and sums[2i+1] (u^2).
void TrustCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,
              const SparsePlan& sp, const double* sums, const CpuExecutor& exec);

// The per-tensor sums of a trust-ratio rule's slot pass: the chunks' (trust[2c..]) then the
// sparse units' (trust[2 (nchunks + x)..]), each tensor's in plan order, into sums[2n].
void ReduceTrustSums(const ChunkPlan& plan, const SparsePlan& sp, const double* trust, int n,
                     double* sums);

// scratch is reused across calls when the caller keeps it.
struct StepScratch {
  ChunkPlan plan;
  std::vector<double> partials, per_tensor;
  std::vector<double> trust, trust_sums;  // trust-ratio rules (ReduceTrustSums)
  std::vector<ClipFactor> factors;
  std::vector<TensorView> grads;
  SparsePlan sparse;
  // AGC (agc.h): the plan, the tiles' partials, per-unit sums and scales.
  AgcPlan agc;
  std::vector<double> agc_part_g, agc_part_w, unit_g, unit_w, unit_scale, sparse_vsq;
  FactoredScratch factored;  // a factored rule's (Adafactor; factored.h)
};
// A factored rule's passes (factored.h: stats, rms(u), update) after the clip factors, the
// non-finite policy already decided.
void FactoredApplyCpu(const HParams& hp, const ApplyTensor* ts, int n, const ClipFactor* factors,
                      FactoredScratch* s, const CpuExecutor& exec);

// Both passes of a clip-and-apply step (StepArgs, StepResult: csrc/core/step.h), with the
// non-finite policy.
StepResult ClipApplyCpu(const StepArgs& args, StepScratch* scratch, const CpuExecutor& exec);

// A norm rounded to float (or kept double) with subnormal results kept: TF runs kernels with
// flush-to-zero set, which would turn a right, subnormal float norm into 0.
template <typename T>
T RoundNorm(double norm);

}  // namespace tfclip
