// tfclip core: the one rule table. Each row names a rule's struct (csrc/core/rules.h), its op
// (TfclipClipApply<Op>, registered from this table in csrc/tf/ops.cc and apply_kernel.cc), its name
// in tfclip._core and tfclip/_engine/opcall.py, its slot inputs, and the hyper-parameters and flags it
// takes (csrc/core/hparams.h). Dispatch, op registration, HParams reading, _core and the Python
// op calls all follow from it. Adding a rule: its struct in rules.h, one row here, one Python
// declaration (tfclip/rules/__init__.py, and the drop-ins that use it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/hparams.h"
#include "csrc/core/rules.h"
#include "csrc/core/rules_tf1.h"

namespace tfclip {

#define TFCLIP_H(f) | HPBit(HP::f)
#define TFCLIP_F(f) | FlagBit(Flag::f)

// X(kind, struct, op suffix, name, "slot inputs", hyper-parameters, flags)
#define TFCLIP_FOR_EACH_RULE(X)                                                                 \
  X(kSgd, SgdRule, "Sgd", "sgd", "", 0u TFCLIP_H(lr) TFCLIP_H(weight_decay), 0u)               \
  X(kMomentum, MomentumRule, "Momentum", "momentum", "accum",                                  \
    0u TFCLIP_H(lr) TFCLIP_H(momentum) TFCLIP_H(weight_decay), 0u TFCLIP_F(nesterov))          \
  X(kKerasMomentum, KerasMomentumRule, "KerasMomentum", "keras_momentum", "accum",             \
    0u TFCLIP_H(lr) TFCLIP_H(momentum) TFCLIP_H(weight_decay), 0u TFCLIP_F(nesterov))          \
  X(kAdam, AdamRule, "Adam", "adam", "m,v,vhat",                                               \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(epsilon) TFCLIP_H(weight_decay) \
        TFCLIP_H(step) TFCLIP_H(beta_1_power) TFCLIP_H(beta_2_power),                          \
    0u TFCLIP_F(amsgrad))                                                                      \
  X(kAdagrad, AdagradRule, "Adagrad", "adagrad", "accumulator",                                \
    0u TFCLIP_H(lr) TFCLIP_H(epsilon) TFCLIP_H(weight_decay), 0u TFCLIP_F(eps_outside))        \
  X(kRmsProp, RmsPropRule, "RmsProp", "rmsprop", "velocity,momentum_slot,average_gradient",         \
    0u TFCLIP_H(lr) TFCLIP_H(rho) TFCLIP_H(momentum) TFCLIP_H(epsilon) TFCLIP_H(weight_decay), \
    0u TFCLIP_F(centered) TFCLIP_F(has_momentum) TFCLIP_F(eps_outside))                        \
  X(kAdadelta, AdadeltaRule, "Adadelta", "adadelta", "accumulated_grad,accumulated_delta_var", \
    0u TFCLIP_H(lr) TFCLIP_H(rho) TFCLIP_H(epsilon) TFCLIP_H(weight_decay), 0u)                \
  X(kAdamax, AdamaxRule, "Adamax", "adamax", "m,u",                                            \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(epsilon) TFCLIP_H(weight_decay) \
        TFCLIP_H(step),                                                                        \
    0u)                                                                                        \
  X(kLion, LionRule, "Lion", "lion", "m",                                                      \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(weight_decay), 0u)               \
  X(kNadam, NadamRule, "Nadam", "nadam", "m,v",                                                \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(epsilon) TFCLIP_H(weight_decay) \
        TFCLIP_H(step) TFCLIP_H(u_product) TFCLIP_H(schedule_decay),                           \
    0u TFCLIP_F(legacy_nadam))                                                                 \
  X(kFtrl, FtrlPowRule, "Ftrl", "ftrl", "accumulator,linear",                                  \
    0u TFCLIP_H(lr) TFCLIP_H(lr_power) TFCLIP_H(l1) TFCLIP_H(l2) TFCLIP_H(l2_shrinkage)        \
        TFCLIP_H(beta) TFCLIP_H(weight_decay),                                                 \
    0u)                                                                                        \
  X(kFtrlSqrt, FtrlSqrtRule, "FtrlSqrt", "ftrl_sqrt", "accumulator,linear",                    \
    0u TFCLIP_H(lr) TFCLIP_H(l1) TFCLIP_H(l2) TFCLIP_H(l2_shrinkage) TFCLIP_H(beta)            \
        TFCLIP_H(weight_decay),                                                                \
    0u)                                                                                        \
  X(kTfRmsProp, TfRmsPropRule, "TfRmsProp", "tf_rmsprop", "rms,mom,mg",                   \
    0u TFCLIP_H(lr) TFCLIP_H(rho) TFCLIP_H(momentum) TFCLIP_H(epsilon) TFCLIP_H(weight_decay), \
    0u TFCLIP_F(centered))                                                                     \
  X(kLamb, LambRule, "Lamb", "lamb", "m,v",                                                    \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(epsilon) TFCLIP_H(weight_decay) \
        TFCLIP_H(step),                                                                        \
    0u)                                                                                        \
  X(kScheduleFreeAdamW, ScheduleFreeAdamWRule, "ScheduleFreeAdamW", "schedule_free_adamw",      \
    "momentum_slot,velocity",                                                                  \
    0u TFCLIP_H(lr) TFCLIP_H(beta_1) TFCLIP_H(beta_2) TFCLIP_H(epsilon) TFCLIP_H(weight_decay) \
        TFCLIP_H(step) TFCLIP_H(warmup_steps),                                                 \
    0u)                                                                                      \
  X(kProximalSgd, ProximalSgdRule, "ProximalGradientDescent", "proximal_gradient_descent", "",  \
    0u TFCLIP_H(lr) TFCLIP_H(l1) TFCLIP_H(l2), 0u)                                             \
  X(kProximalAdagrad, ProximalAdagradRule, "ProximalAdagrad", "proximal_adagrad", "accumulator", \
    0u TFCLIP_H(lr) TFCLIP_H(l1) TFCLIP_H(l2), 0u)                                             \
  X(kAdagradDa, AdagradDaRule, "AdagradDa", "adagrad_da",                                      \
    "gradient_accumulator,gradient_squared_accumulator",                                       \
    0u TFCLIP_H(lr) TFCLIP_H(l1) TFCLIP_H(l2) TFCLIP_H(global_step), 0u)                  \
  X(kAdafactor, AdafactorRule, "Adafactor", "adafactor", "r,c,v",                             \
    0u TFCLIP_H(lr) TFCLIP_H(beta_2_decay) TFCLIP_H(epsilon_1) TFCLIP_H(epsilon_2)            \
        TFCLIP_H(clip_threshold) TFCLIP_H(weight_decay) TFCLIP_H(step),                        \
    0u)                                                                                        \
  X(kMuonMomentum, MuonMomentumRule, "MuonMomentum", "muon_momentum", "",                     \
    0u TFCLIP_H(momentum), 0u)                                                                 \
  X(kMuonUpdate, MuonUpdateRule, "MuonUpdate", "muon_update", "",                             \
    0u TFCLIP_H(lr) TFCLIP_H(weight_decay) TFCLIP_H(shape_scale) TFCLIP_H(rms_rate), 0u)

enum class RuleKind : int {
#define TFCLIP_RULE_ENUM(kind, ...) kind,
  TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_ENUM)
#undef TFCLIP_RULE_ENUM
};

// A row of the table, for the adapters (op registration, _core, error messages).
struct RuleInfo {
  RuleKind kind;
  const char* op;        // "Adam": the op TfclipClipApplyAdam
  const char* name;      // "adam"
  const char* slot_csv;  // "m,v,vhat": the slot inputs, at most kMaxSlots of the struct
  uint32_t hparams;      // HPBit mask: the scalar inputs, in HP order
  uint32_t flags;        // FlagBit mask: the bool attrs
  int min_slots, max_slots;
  uint32_t unsigned_slots;  // Rule::kUnsignedSlots: bit k, slot k is never negative (int8 state's code)
  std::vector<std::string> slots() const;
};

constexpr int CsvCount(const char* s) {
  if (*s == '\0') return 0;
  int n = 1;
  for (; *s != '\0'; ++s) n += *s == ',';
  return n;
}
// Whether the comma-separated list `csv` holds `name`.
constexpr bool CsvHas(const char* csv, const char* name) {
  while (*csv != '\0') {
    const char* n = name;
    while (*n != '\0' && *csv == *n) {
      ++csv;
      ++n;
    }
    if (*n == '\0' && (*csv == ',' || *csv == '\0')) return true;
    while (*csv != ',' && *csv != '\0') ++csv;
    if (*csv == ',') ++csv;
  }
  return false;
}
// Whether a slot input would share its op input name with a hyper-parameter or flag (the op
// registration fails at load time on "Duplicate name": caught here at build time instead).
constexpr bool SlotNamesClash(const char* csv) {
#define TFCLIP_HP_CLASH(f, ...) || CsvHas(csv, #f)
#define TFCLIP_FLAG_CLASH(f, attr) || CsvHas(csv, attr)
  return false TFCLIP_FOR_EACH_HPARAM(TFCLIP_HP_CLASH) TFCLIP_FOR_EACH_FLAG(TFCLIP_FLAG_CLASH);
#undef TFCLIP_HP_CLASH
#undef TFCLIP_FLAG_CLASH
}
static_assert(CsvHas("rms,mom,mg", "mom") && !CsvHas("rms,mom,mg", "mo") && !CsvHas("momentum_slot", "momentum"));

// Build-time checks of every row: its slot names match its struct's slot range, and none is an
// input name the op already has.
#define TFCLIP_RULE_CHECK(kind, Struct, op, name, slots, hps, flags)                    \
  static_assert(CsvCount(slots) == Struct::kMaxSlots, #Struct ": one slot name per slot"); \
  static_assert(Struct::kMaxSlots <= kMaxSlots, #Struct ": too many slots");               \
  static_assert(!SlotNamesClash(slots), #Struct ": a slot input named as a hyper-parameter or flag");
TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_CHECK)
#undef TFCLIP_RULE_CHECK

const std::vector<RuleInfo>& AllRules();
const RuleInfo& GetRuleInfo(RuleKind r);
bool ParseRule(const std::string& s, RuleKind* out);

// Calls fn(RuleStruct{}) for a runtime rule kind. Host and device.
template <typename Fn>
TFCLIP_HD void DispatchRule(RuleKind r, Fn&& fn) {
  switch (r) {
#define TFCLIP_RULE_CASE(kind, Struct, ...) \
  case RuleKind::kind:                      \
    fn(Struct{});                           \
    break;
    TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_CASE)
#undef TFCLIP_RULE_CASE
  }
}

// DispatchRule for the element-wise passes (dense, sparse, trust; CPU and CUDA): fn(Struct{})
// for every rule but a factored one (Adafactor), whose passes are csrc/core/factored.h's and
// for which it calls nothing, so those loops are never compiled for it.
template <typename Fn>
TFCLIP_HD void DispatchElementRule(RuleKind r, Fn&& fn) {
  DispatchRule(r, [&](auto rule_tag) {
    if constexpr (!decltype(rule_tag)::kFactored) fn(rule_tag);
  });
}

// The slot count a step of `rule` uses with these flags.
TFCLIP_HD int NumSlots(RuleKind rule, const HParams& hp) {
  int n = 0;
  DispatchRule(rule, [&](auto r) { n = decltype(r)::NumSlots(hp); });
  return n;
}

// Whether a zero gradient leaves an element as it is (SGD: an IndexedSlices pass may skip the
// rows no slice touches; a proximal rule still shrinks them).
TFCLIP_HD bool RuleZeroGradKeeps(RuleKind rule) {
  bool k = false;
  DispatchRule(rule, [&](auto r) { k = decltype(r)::kZeroGradKeeps; });
  return k;
}

// Whether a rule scales its step by a per-tensor trust ratio (rules.h): a third pass.
TFCLIP_HD bool RuleTrustRatio(RuleKind rule) {
  bool t = false;
  DispatchRule(rule, [&](auto r) { t = decltype(r)::kTrustRatio; });
  return t;
}

// Whether a rule keeps factored second moments (Adafactor; csrc/core/factored.h): slots of
// other shapes than the variable's, and passes of their own.
TFCLIP_HD bool RuleFactored(RuleKind rule) {
  bool f = false;
  DispatchRule(rule, [&](auto r) { f = decltype(r)::kFactored; });
  return f;
}

// The hyper-parameters a rule takes (HPBit mask). Host and device.
TFCLIP_HD uint32_t RuleHParams(RuleKind rule) {
  switch (rule) {
#define TFCLIP_RULE_HPS(kind, Struct, op, name, slots, hps, flags) \
  case RuleKind::kind:                                             \
    return hps;
    TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_HPS)
#undef TFCLIP_RULE_HPS
  }
  return 0u;
}

}  // namespace tfclip
