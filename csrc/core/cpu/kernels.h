// tfclip core, CPU: the passes that touch every element, one file each (csrc/core/cpu/pass_*.cc),
// compiled once per instruction set they are built for (cpu/isa.h: baseline x86-64 and AVX2, and
// AVX-512 for the norm and scale passes, the factored passes and the narrow-state tiles, with
// AVX2's apply passes; the sparse apply pass is the baseline's in every variant; baseline only
// elsewhere), and picked at run time from what the CPU supports (kernels.cc). Never
// -march=native: the shipped library runs on any x86-64. Every variant is built with
// -ffp-contract=off and runs the same operations in the same order, so all of them give the same
// bits (tests/test_core_parity.py checks).
#pragma once

#include <string>
#include <vector>

#include "csrc/core/agc.h"
#include "csrc/core/chunk_plan.h"
#include "csrc/core/clip.h"
#include "csrc/core/cpu/executor.h"
#include "csrc/core/factored.h"
#include "csrc/core/hparams.h"
#include "csrc/core/quant8.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/sparse.h"
#include "csrc/core/tensors.h"

namespace tfclip {

struct CpuKernels {
  const char* name;
  void (*sum_squares)(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                      double* per_tensor, double* total, const CpuExecutor& exec);
  void (*scale)(const TensorView* in, const TensorView* out, const ChunkPlan& plan, double scale,
                const CpuExecutor& exec);
  void (*apply)(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,
                const ClipFactor* factors, double* trust, const CpuExecutor& exec);
  void (*sparse_apply)(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
                       const SparsePlan& sp, const ClipFactor* factors, double* trust,
                       const CpuExecutor& exec);
  void (*trust)(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,
                const SparsePlan& sp, const double* sums, const CpuExecutor& exec);
  // A factored rule's pass 1, 2 or 3 (stats, rms(u), update) over its tiles (factored.h).
  void (*factored)(int pass, const HParams& hp, const ApplyTensor* ts, const ClipFactor* factors,
                   FactoredScratch* s, const CpuExecutor& exec);
  // AGC's norm pass (agc.h): the tiles' partials and the sparse gradients' unit sums.
  void (*agc_sums)(const ApplyTensor* ts, const AgcPlan& plan, const SparsePlan& sp,
                   double* part_g, double* part_w, double* unit_g, double* sparse_values_sumsq,
                   const CpuExecutor& exec);
  // bf16 state's tiles (pass_state_tiles.cc): n slots widened to floats, floats rounded back.
  void (*bf16_widen)(const bfloat16* in, float* out, int64_t n);
  void (*bf16_narrow)(const float* in, bfloat16* out, int64_t n);
  // int8 state's tiles (pass_state_tiles.cc): n elements from a block boundary, n <= the apply
  // passes' tile; absmax one float per kQuantBlock. Widen dequantizes the codes q; narrow
  // writes each block's absmax and the codes.
  void (*q8_widen)(const uint8_t* q, const float* absmax, const CodeIndex& ci, float* out, int64_t n);
  void (*q8_narrow)(const float* in, const CodeIndex& ci, uint8_t* q, float* absmax, int64_t n);
};

// Each variant's passes (csrc/core/cpu/pass_*.cc), declared in its namespace: the entries of its
// CpuKernels (kernels.cc).
#define TFCLIP_CPU_PASSES(NS)                                                                            \
  namespace NS {                                                                                         \
  void SumSquares(const TensorView* ts, int n, const ChunkPlan& plan, double* partials, double* per_tensor, \
                  double* total, const CpuExecutor& exec);                                               \
  void Scale(const TensorView* in, const TensorView* out, const ChunkPlan& plan, double scale,            \
             const CpuExecutor& exec);                                                                   \
  void Apply(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,               \
             const ClipFactor* factors, double* trust, const CpuExecutor& exec);                         \
  void SparseApply(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,          \
                   const ClipFactor* factors, double* trust, const CpuExecutor& exec);                   \
  void Trust(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,               \
             const SparsePlan& sp, const double* sums, const CpuExecutor& exec);                         \
  void FactoredPass(int pass, const HParams& hp, const ApplyTensor* ts, const ClipFactor* factors,        \
                    FactoredScratch* s, const CpuExecutor& exec);                                        \
  void AgcSums(const ApplyTensor* ts, const AgcPlan& plan, const SparsePlan& sp, double* part_g,          \
               double* part_w, double* unit_g, double* sparse_values_sumsq, const CpuExecutor& exec);     \
  void Bf16WidenTile(const bfloat16* in, float* out, int64_t n);                                         \
  void Bf16NarrowTile(const float* in, bfloat16* out, int64_t n);                                        \
  void Q8WidenTile(const uint8_t* q, const float* absmax, const CodeIndex& ci, float* out, int64_t n);   \
  void Q8NarrowTile(const float* in, const CodeIndex& ci, uint8_t* q, float* absmax, int64_t n);         \
  }

// The variant in use: the best the CPU supports, or TFCLIP_CPU_ISA (avx512 | avx2 | baseline)
// when set and supported.
const CpuKernels& ActiveCpuKernels();
// The variants this build has and this CPU can run, best first.
std::vector<std::string> SupportedCpuIsas();
// Switches the variant (tests, benchmarks); false if it is not supported here.
bool SetCpuIsa(const std::string& name);

}  // namespace tfclip
