// tfclip core: a clip-and-apply step as every adapter hands it to the core, and what comes back,
// for both drivers: the CPU one (csrc/core/cpu/driver.h, ClipApplyCpu) and the CUDA one
// (csrc/core/cuda/driver.h, CudaClipApply), neither of which includes the other. No TF, CUDA or
// pybind11 header. Definitions: step.cc.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/core/clip.h"
#include "csrc/core/hparams.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/tensors.h"

namespace tfclip {

// A clip-and-apply step as every adapter hands it to the core.
struct StepArgs {
  RuleKind rule = RuleKind::kSgd;
  HParams hp;
  ClipConfig cfg;
  const ApplyTensor* ts = nullptr;
  int n = 0;
  bool lazy = false;  // sparse gradients update only the rows they touch (see sparse.h)
  // A step counter (CPU: host memory) or null: the rule's step is then *iterations + hp.step,
  // and the counter advances by one when the step is applied, under the caller's locks.
  int64_t* iterations = nullptr;
  // Out (may be null): each tensor's pre-clip gradient norm (IndexedSlices: its values'), from
  // the norm pass at no extra pass; NaN when none ran (use_norm). Written before the non-finite
  // policy acts, so a skipped step still tells which tensor was not finite.
  double* tensor_norms = nullptr;
  // Out (may be null): with clip_mode agc, each tensor's count of clipped units (scale < 1);
  // 0 in the other modes. Written with tensor_norms.
  int64_t* agc_clipped = nullptr;
};

// Both passes of a clip-and-apply step, with the non-finite policy. Everything is checked before
// anything is written: hyper-parameters, clip numbers, sparse indices (the adapters check
// shapes and dtypes, which the core does not see).
struct StepResult {
  double global_norm = 0.0;
  bool applied = false;
  bool nonfinite = false;  // with kRaise: the caller reports the error; nothing was written
  std::string error;       // a bad input: nothing was written
};

// The message of a non-finite norm with nonfinite='raise' (every adapter's).
std::string NonFiniteError(double norm);

// The hyper-parameters of a step with its counter applied, checked: "" or the error.
std::string StepHParams(const StepArgs& args, HParams* hp);

// The tensors' state storage, checked against the rule: "" or the error. int8 state
// (SlotStorage::kInt8) is for a float32 variable with a dense gradient, a rule with slots and
// without a trust ratio, every absmax given. Both drivers call it before anything runs.
std::string ValidateState(const StepArgs& args);

}  // namespace tfclip
