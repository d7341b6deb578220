// tfclip core: validation messages (validate.h).
#include "csrc/core/validate.h"

#include <cmath>
#include <sstream>

namespace tfclip {

namespace {
std::string Fmt(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
}  // namespace

std::string ValidateClipNorm(double clip_norm, const char* what) {
  if (std::isfinite(clip_norm) && clip_norm > 0) return "";
  return std::string(what) + " must be finite and > 0, got " + Fmt(clip_norm);
}

std::string ValidateClipConfig(const ClipConfig& cfg) {
  switch (ClipConfigError(cfg)) {
    case 1: {
      // Named as Keras names the argument for each mode.
      const char* what = cfg.mode == ClipMode::kGlobalNorm ? "global_clipnorm"
                         : cfg.mode == ClipMode::kNorm     ? "clipnorm"
                         : cfg.mode == ClipMode::kAgc      ? "clip_factor (agc)"
                                                           : "clipvalue";
      return std::string(what) + " must be finite and >= 0 (0: no clip), got " + Fmt(cfg.clip);
    }
    case 2: return "use_norm must be >= 0 (it is a norm), got " + Fmt(cfg.use_norm);
    case 3: return "agc_eps must be finite and >= 0, got " + Fmt(cfg.agc_eps);
    case 4: return "grad_scale must be finite and > 0 (1 / the loss scale), got " + Fmt(cfg.grad_scale);
    case 5: return "grad_scale (a loss-scale unscale) does not combine with clip_mode 'agc'; unscale the "
                   "gradients first";
    default: return "";
  }
}

std::string HParamError(int k, double v) {
  const HParamInfo i = GetHParamInfo(static_cast<HP>(k));
  std::ostringstream os;
  if (std::isinf(i.lo) && std::isinf(i.hi)) {
    os << i.display << " must be finite, got " << v;
    return os.str();
  }
  os << i.display << " must be finite and in " << (i.lo_open ? "(" : "[") << i.lo << ", "
     << (std::isinf(i.hi) ? "inf" : Fmt(i.hi)) << (i.hi_open ? ")" : "]") << ", got " << v;
  return os.str();
}

std::string RoundingMessage(int bad, double value) {
  if (bad == 0) return "";
  return std::string("stochastic rounding's ") + (bad == 1 ? "seed" : "step") +
         " must be an integer in [0, 2^53], got " + Fmt(value);
}

std::string ValidateHParams(RuleKind rule, const HParams& hp) {
  const int k = FirstBadHParam(RuleHParams(rule), hp);
  return k < 0 ? "" : HParamError(k, hp.Get(static_cast<HP>(k)));
}

std::string ValidateRounding(const HParams& hp) {
  const int r = RoundingError(hp);
  return RoundingMessage(r, r == 1 ? hp.rounding_seed : hp.rounding_step);
}

}  // namespace tfclip
