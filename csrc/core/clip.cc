// tfclip core: clip modes and policies by name, and the CPU driver's clip factors (clip.h).
#include "csrc/core/clip.h"

#include <cmath>

namespace tfclip {

bool ParseClipMode(const std::string& s, ClipMode* out) {
  if (s == "none") *out = ClipMode::kNone;
  else if (s == "global_norm") *out = ClipMode::kGlobalNorm;
  else if (s == "norm") *out = ClipMode::kNorm;
  else if (s == "value") *out = ClipMode::kValue;
  else if (s == "agc") *out = ClipMode::kAgc;
  else return false;
  return true;
}

bool ParseNonFinitePolicy(const std::string& s, NonFinitePolicy* out) {
  if (s == "skip") *out = NonFinitePolicy::kSkip;
  else if (s == "propagate") *out = NonFinitePolicy::kPropagate;
  else if (s == "raise") *out = NonFinitePolicy::kRaise;
  else return false;
  return true;
}

bool NeedsNormPass(const ClipConfig& cfg) {
  // clipnorm and AGC need each tensor's (each unit's) own sums whatever the global norm.
  return !(cfg.has_use_norm && cfg.mode != ClipMode::kNorm && cfg.mode != ClipMode::kAgc);
}

ClipOutcome ComputeClipFactors(const ClipConfig& cfg, const double* per_tensor_sumsq,
                               double total_sumsq, int n, ClipFactor* factors) {
  ClipOutcome out;
  out.global_norm = StepGlobalNorm(cfg, total_sumsq);
  out.finite = std::isfinite(out.global_norm);
  const ClipMode mode = ActiveClipMode(cfg);
  const double gs = mode == ClipMode::kGlobalNorm ? GlobalClipScale(cfg.clip, out.global_norm) : 1.0;
  for (int i = 0; i < n; ++i) {
    factors[i] = TensorClipFactor(mode, cfg.clip, gs, per_tensor_sumsq[i], cfg.grad_scale);
  }
  return out;
}

}  // namespace tfclip
