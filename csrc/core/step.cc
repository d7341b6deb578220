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
  if (a.iterations != nullptr) hp->step += static_cast<double>(*a.iterations);
  std::string e = ValidateHParams(a.rule, *hp);
  if (!e.empty() && a.iterations != nullptr) {
    std::ostringstream os;
    os << " (iterations + step = " << hp->step << ")";
    e += os.str();
  }
  if (e.empty()) e = ValidateClipConfig(a.cfg);
  return e;
}

}  // namespace tfclip
