// tfclip core: what both drivers do with a step's arguments (csrc/core/step.h): the checked
// hyper-parameters and the non-finite error's words.
#include "csrc/core/step.h"

#include <sstream>

#include "csrc/core/validate.h"

namespace tfclip {

std::string NonFiniteError(double norm) {
  std::ostringstream os;
  os << "the global norm of the gradients is " << norm
     << " (non-finite) and nonfinite='raise'; no variable was updated";
  return os.str();
}

std::string StepHParams(const StepArgs& a, HParams* hp) {
  *hp = a.hp;
  if (a.iterations != nullptr) {
    hp->step += static_cast<double>(*a.iterations);
    if (hp->stochastic_rounding) hp->rounding_step += static_cast<double>(*a.iterations);
  }
  std::string e = ValidateHParams(a.rule, *hp);
  if (!e.empty() && a.iterations != nullptr) {
    std::ostringstream os;
    os << " (iterations + step = " << hp->step << ")";
    e += os.str();
  }
  if (e.empty()) e = ValidateRounding(*hp);
  if (e.empty()) e = ValidateClipConfig(a.cfg);
  return e;
}

std::string ValidateState(const StepArgs& a) {
  const RuleInfo& info = GetRuleInfo(a.rule);
  const int nslots = NumSlots(a.rule, a.hp);
  for (int i = 0; i < a.n; ++i) {
    const ApplyTensor& t = a.ts[i];
    if (t.slot_storage != SlotStorage::kInt8) continue;
    std::ostringstream os;
    os << "tensor " << i << ": int8 optimizer state ";
    if (nslots == 0) {
      os << "given to rule '" << info.name << "', which keeps no slots";
    } else if (RuleTrustRatio(a.rule)) {
      os << "is not supported for rule '" << info.name
         << "' (its trust ratio reads the slots back a pass later); use float32 or bfloat16 state";
    } else if (t.var_dtype != DType::kFloat) {
      os << "is for float32 variables; this one is " << DTypeName(t.var_dtype);
    } else if (t.sparse) {
      os << "is not supported with an IndexedSlices gradient yet (a row's update would requantize "
            "blocks the slices do not cover); pass a dense gradient (tf.convert_to_tensor)";
    } else {
      bool all = true;
      for (int k = 0; k < nslots; ++k) all = all && t.absmax[k] != nullptr;
      if (all) continue;
      os << "needs one absmax array per slot";
    }
    return os.str();
  }
  return "";
}

}  // namespace tfclip
