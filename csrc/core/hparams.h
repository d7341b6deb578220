// tfclip core: the one table of a step's scalar hyper-parameters and rule flags. The op inputs
// (csrc/tf/ops.cc), the HParams fields, their validation (host and device), _core's keyword
// names and tfclip/_engine/opcall.py all follow from it: a name exists once.
#pragma once

#include <cmath>
#include <cstdint>

#include "csrc/core/types.h"

namespace tfclip {

// X(field = op input name, name in messages, default, lo, lo_open, hi, hi_open)
// A NaN default marks an optional input: NaN there means "not given" (Adam's beta powers, given
// by TF1's AdamOptimizer, else computed from `step`), and NaN is accepted for it.
// The ranges are the stock classes' (Keras 3, tf.compat.v1.train): a value any of them accepts is
// accepted here and gives the stock arithmetic, NaN included (a negative learning rate ascends;
// Adam's beta_1 = 1 divides by zero as stock does). Stock checks only Ftrl's (learning_rate_power
// <= 0, the l1/l2/shrinkage strengths >= 0; TF's ProximalAdagrad kernel the same l1/l2; Keras
// SGD's momentum and Lion's beta_1 are checked by those classes themselves). tfclip's own
// refusals: a non-finite value (stock would write NaN or inf into every variable), `step`
// (tfclip's own t) below 1, and a negative l1/l2 for TF1's ProximalGradientDescent and AdagradDA,
// whose documentation requires >= 0 and whose kernels do not check. `global_step` is the step
// TF1's AdagradDA feeds its op (the stock class gives its global_step + 1). `schedule_decay`
// (optional) scales the exponent of Nadam's momentum schedule, u_t = beta_1 * (1 - 0.5 *
// 0.96^(schedule_decay * t)): not given, 0.96^t (Keras 3's and tf_keras's Nadam); tf_keras's
// legacy Nadam gives its `schedule_decay` (0.004 by default), whose range stock does not check.
// beta_2_decay, epsilon_1, epsilon_2, clip_threshold: Adafactor's (keras's names and defaults;
// stock checks none of them). shape_scale, rms_rate: Muon's update scale (rules.h, MuonUpdateRule:
// sqrt(max(rows, cols)) as float32, and keras's rms_rate).
#define TFCLIP_FOR_EACH_HPARAM(X)                                      \
  X(lr, "learning_rate", 0.0, -INFINITY, false, INFINITY, false)      \
  X(momentum, "momentum", 0.0, -INFINITY, false, INFINITY, false)      \
  X(beta_1, "beta_1", 0.9, -INFINITY, false, INFINITY, false)          \
  X(beta_2, "beta_2", 0.999, -INFINITY, false, INFINITY, false)        \
  X(epsilon, "epsilon", 1e-7, -INFINITY, false, INFINITY, false)       \
  X(weight_decay, "weight_decay", 0.0, -INFINITY, false, INFINITY, false) \
  X(rho, "rho", 0.9, -INFINITY, false, INFINITY, false)                \
  X(step, "step", 1.0, 1.0, false, INFINITY, false)                    \
  X(beta_1_power, "beta_1_power", NAN, -INFINITY, false, INFINITY, false) \
  X(beta_2_power, "beta_2_power", NAN, -INFINITY, false, INFINITY, false) \
  X(u_product, "u_product", 1.0, -INFINITY, false, INFINITY, false)    \
  X(lr_power, "learning_rate_power", -0.5, -INFINITY, false, 0.0, false) \
  X(l1, "l1_regularization_strength", 0.0, 0.0, false, INFINITY, false) \
  X(l2, "l2_regularization_strength", 0.0, 0.0, false, INFINITY, false) \
  X(l2_shrinkage, "l2_shrinkage_regularization_strength", 0.0, 0.0, false, INFINITY, false) \
  X(beta, "beta", 0.0, -INFINITY, false, INFINITY, false)               \
  X(warmup_steps, "warmup_steps", 0.0, -INFINITY, false, INFINITY, false) \
  X(global_step, "global_step", 1.0, -INFINITY, false, INFINITY, false) \
  X(schedule_decay, "schedule_decay", NAN, -INFINITY, false, INFINITY, false) \
  X(beta_2_decay, "beta_2_decay", -0.8, -INFINITY, false, INFINITY, false) \
  X(epsilon_1, "epsilon_1", 1e-30, -INFINITY, false, INFINITY, false)    \
  X(epsilon_2, "epsilon_2", 1e-3, -INFINITY, false, INFINITY, false)     \
  X(clip_threshold, "clip_threshold", 1.0, -INFINITY, false, INFINITY, false) \
  X(shape_scale, "shape_scale", 1.0, -INFINITY, false, INFINITY, false)       \
  X(rms_rate, "rms_rate", 0.2, -INFINITY, false, INFINITY, false)

// X(field, op attr name): the rules' boolean options. eps_outside (Adagrad, RMSprop): epsilon
// added to the square root, lr*g / (sqrt(x) + eps), as TF's ResourceApplyAdagradV2 and
// tf_keras's legacy RMSprop without momentum, instead of Keras 3's lr*g / sqrt(x + eps).
// legacy_nadam (Nadam): tf_keras legacy Nadam's arithmetic (rules.h, NadamRule).
#define TFCLIP_FOR_EACH_FLAG(X) \
  X(nesterov, "use_nesterov")   \
  X(amsgrad, "amsgrad")         \
  X(centered, "centered")       \
  X(has_momentum, "has_momentum") \
  X(eps_outside, "epsilon_outside_sqrt") \
  X(legacy_nadam, "legacy_nadam")

// HP::lr, ... : an hyper-parameter's index; HPBit(HP::lr) its bit in a rule's mask.
enum class HP : int {
#define TFCLIP_HP_ENUM(f, ...) f,
  TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_ENUM)
#undef TFCLIP_HP_ENUM
};
enum class Flag : int {
#define TFCLIP_FLAG_ENUM(f, ...) f,
  TFCLIP_FOR_EACH_FLAG(TFCLIP_FLAG_ENUM)
#undef TFCLIP_FLAG_ENUM
};
#define TFCLIP_COUNT(...) +1
constexpr int kNumHParams = 0 TFCLIP_FOR_EACH_HPARAM(TFCLIP_COUNT);
constexpr int kNumFlags = 0 TFCLIP_FOR_EACH_FLAG(TFCLIP_COUNT);
#undef TFCLIP_COUNT
constexpr TFCLIP_HD uint32_t HPBit(HP h) { return 1u << static_cast<int>(h); }
constexpr TFCLIP_HD uint32_t FlagBit(Flag f) { return 1u << static_cast<int>(f); }

// Hyper-parameters as the user gave them (one POD for every rule, so a launcher uploads it with
// the tensor table). Rules read the fields they take.
struct HParams {
#define TFCLIP_HP_FIELD(f, name, def, ...) double f = def;
  TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_FIELD)
#undef TFCLIP_HP_FIELD
#define TFCLIP_FLAG_FIELD(f, attr) bool f = false;
  TFCLIP_FOR_EACH_FLAG(TFCLIP_FLAG_FIELD)
#undef TFCLIP_FLAG_FIELD
  // IndexedSlices rows with duplicate indices: Adam's v (any rule's second input, rules.h's
  // Second) takes the sum of the duplicates' squares (stock Keras when nothing densifies the gradient first) instead of the square of
  // their sum (a dense gradient's result; TF1 Adam; Keras after global_clipnorm densified it).
  bool sum_of_squares = false;
  // Stochastic rounding of bfloat16 variables (the apply ops' `rounding` input, [seed, step];
  // csrc/core/rounding.h): on where the input is given (else round to nearest). With a step
  // counter given to the op (`iterations`) the step is counted from it, as `step` is.
  bool stochastic_rounding = false;
  double rounding_seed = 0.0;
  double rounding_step = 0.0;
  double rounding_tensor = 0.0;  // the step's first tensor's position (an XLA group call's)

  TFCLIP_HD double Get(HP h) const {
    switch (h) {
#define TFCLIP_HP_GET(f, ...) \
  case HP::f:                 \
    return f;
      TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_GET)
#undef TFCLIP_HP_GET
    }
    return 0.0;
  }
  TFCLIP_HD void Set(HP h, double v) {
    switch (h) {
#define TFCLIP_HP_SET(f, ...) \
  case HP::f:                 \
    f = v;                    \
    break;
      TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_SET)
#undef TFCLIP_HP_SET
    }
  }
  TFCLIP_HD void SetFlag(Flag g, bool v) {
    switch (g) {
#define TFCLIP_FLAG_SET(f, attr) \
  case Flag::f:                  \
    f = v;                       \
    break;
      TFCLIP_FOR_EACH_FLAG(TFCLIP_FLAG_SET)
#undef TFCLIP_FLAG_SET
    }
  }
};

// An hyper-parameter's name (as the op input), its name in messages, and its range.
struct HParamInfo {
  const char* input;
  const char* display;
  double def, lo;
  bool lo_open;
  double hi;
  bool hi_open;
};
TFCLIP_HD HParamInfo GetHParamInfo(HP h) {
  switch (h) {
#define TFCLIP_HP_INFO(f, name, def, lo, lo_open, hi, hi_open) \
  case HP::f:                                                    \
    return HParamInfo{#f, name, def, lo, lo_open, hi, hi_open};
    TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_INFO)
#undef TFCLIP_HP_INFO
  }
  return HParamInfo{"", "", 0, 0, false, 0, false};
}
const char* FlagAttr(Flag f);

// Whether a value is in its hyper-parameter's range (an optional one may be NaN: not given).
TFCLIP_HD bool HParamOk(HP h, double v) {
  const HParamInfo i = GetHParamInfo(h);
  if (v != v && i.def != i.def) return true;
  const bool finite = v - v == 0.0;
  return finite && (i.lo_open ? v > i.lo : v >= i.lo) && (i.hi_open ? v < i.hi : v <= i.hi);
}

// The first hyper-parameter in `mask` out of its range, or -1. Host and device: the CUDA
// finalize kernel checks values it reads from device memory with it.
TFCLIP_HD int FirstBadHParam(uint32_t mask, const HParams& hp) {
  for (int k = 0; k < kNumHParams; ++k) {
    if ((mask >> k) & 1u) {
      if (!HParamOk(static_cast<HP>(k), hp.Get(static_cast<HP>(k)))) return k;
    }
  }
  return -1;
}

// The `rounding` input's values: 0 when they are fine (or it is off), 1 for a bad seed, 2 for a
// bad step. Each must be an integer in [0, 2^53] (kMaxRoundingWord; csrc/core/rounding.h): NaN
// is refused.
// The largest seed or step the `rounding` input takes: every integer up to it is a double.
constexpr double kMaxRoundingWord = 9007199254740992.0;  // 2^53

TFCLIP_HD int RoundingError(const HParams& hp) {
  auto ok = [](double v) { return v >= 0.0 && v <= kMaxRoundingWord && v == std::floor(v); };
  if (!hp.stochastic_rounding) return 0;
  if (!ok(hp.rounding_seed)) return 1;
  return ok(hp.rounding_step) ? 0 : 2;
}

}  // namespace tfclip
