// tfclip core: the clip configuration, and each clip mode as TF computes it, written once for
// the CPU driver and the CUDA finalize and apply kernels (TFCLIP_HD).
#pragma once

#include <cmath>
#include <string>

#include "csrc/core/types.h"

namespace tfclip {

// kAgc: adaptive gradient clipping, unit-wise (Brock et al. 2021, NFNets; csrc/core/agc.h): each
// unit's gradient G_u is scaled to clip * max(||W_u||, agc_eps) when its norm is above that.
enum class ClipMode : int { kNone = 0, kGlobalNorm = 1, kNorm = 2, kValue = 3, kAgc = 4 };
enum class NonFinitePolicy : int { kSkip = 0, kPropagate = 1, kRaise = 2 };

bool ParseClipMode(const std::string& s, ClipMode* out);
bool ParseNonFinitePolicy(const std::string& s, NonFinitePolicy* out);

struct ClipConfig {
  ClipMode mode = ClipMode::kNone;
  // global_clipnorm, clipnorm or clipvalue, by mode; 0 means no clip, as in Keras (one rule for
  // every entry point: Python, the ops, _core).
  double clip = 0.0;
  bool has_use_norm = false;
  double use_norm = 0.0;  // a global norm computed elsewhere (e.g. all-reduced across shards)
  NonFinitePolicy policy = NonFinitePolicy::kSkip;
  // kAgc: the floor of a unit's weight norm in its bound, clip * max(||W_u||, agc_eps) (the
  // paper's and optax's default 1e-3); finite and >= 0.
  double agc_eps = 1e-3;
  // A factor on every gradient, folded into the passes: mixed precision's loss-scale unscale
  // (1 / loss scale), instead of a pass that writes g / scale. The gradients are read as given;
  // the norms the step computes (or is given, use_norm) are of them and are multiplied by it,
  // and each tensor's clip factor is multiplied by it (so the update sees g * grad_scale,
  // clipped as stock clips g / scale). For a power of two (every dynamic loss scale) that is
  // exact: the same bits as dividing first, barring float underflow. Finite and > 0; not with
  // kAgc (its unit scales count the units they clip).
  double grad_scale = 1.0;
};

// The clip folded into the apply pass, per tensor: g' = clamp(g * scale, lo, hi), with the
// scale first rounded to the gradient's dtype as TF's `v * cast(scale, v.dtype)` does.
// kAgc: the scale is per unit instead, unit_scale[unit of element] (the step's per-unit scales,
// host memory on the CPU, device memory on CUDA), the element at flat index i of a tensor of
// `units` units being unit i % units (units = var.shape[-1], 1 for rank <= 1); scale stays 1.
struct ClipFactor {
  double scale = 1.0;
  double lo = -INFINITY;
  double hi = INFINITY;
  const double* unit_scale = nullptr;
  int64_t units = 0;
};

// A gradient element through its clip factor, as the dense apply pass does it:
// g' = clamp(cast<G>(g * cast<G>(scale)), lo, hi), in the variable's math type M. A scale of 1
// and infinite bounds are exact no-ops; NaN stays NaN through the clamp, as tf.clip_by_value.
template <typename M>
TFCLIP_HD M ClampGrad(M g, M lo, M hi) {
  return g < lo ? lo : (g > hi ? hi : g);
}
// The clip scale and bounds as TF applies them: converted to the gradient's dtype G first
// (`g * cast(scale, g.dtype)`, clip_by_value's bounds), then held in the math type M.
template <typename G, typename M>
TFCLIP_HD M InGradDType(double x) {
  return static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(x)));
}
template <typename G, typename M>
TFCLIP_HD M ClipGrad(G graw, M scale, M lo, M hi) {
  M g = static_cast<M>(Elem<G>::Load(graw));
  g = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(g * scale)));
  return ClampGrad(g, lo, hi);
}

// A gradient of another float dtype than its variable, other than the fused mixed-precision
// pairs (half or bfloat16 for a float variable): clipped in its own dtype G as TF clips it, then
// cast to the variable's dtype V as stock Keras casts every gradient in update_step (a float
// gradient for a double variable, a double one for a float variable, ...). In V's math type.
template <typename G, typename V>
TFCLIP_HD typename Elem<V>::Math CastClipGrad(G graw, const ClipFactor& f) {
  using GM = typename Elem<G>::Math;
  GM g = Elem<G>::Load(graw);
  g = RoundTo<G>(g * InGradDType<G, GM>(f.scale));
  g = ClampGrad(g, InGradDType<G, GM>(f.lo), InGradDType<G, GM>(f.hi));
  return RoundTo<V>(static_cast<typename Elem<V>::Math>(g));
}

// The dispatch tag of such a gradient (the drivers' DispatchPair gives it for any pair other than
// the same dtype or half/bfloat16 for float): its dtype is read at run time (one well-predicted branch,
// the same for a whole tensor), so these rare pairs cost one code path per variable dtype, not
// one per pair. grad[i] of dtype gt through CastClipGrad.
struct AnyGrad {};
template <typename V>
TFCLIP_HD typename Elem<V>::Math CastClipGradAt(const void* grad, DType gt, int64_t i,
                                                const ClipFactor& f) {
  switch (gt) {
#define TFCLIP_CAST_CASE(E, S, M, N, ...) \
  case DType::E:                     \
    return CastClipGrad<S, V>(static_cast<const S*>(grad)[i], f);
    TFCLIP_FOR_EACH_TYPE(TFCLIP_CAST_CASE)
#undef TFCLIP_CAST_CASE
  }
  return typename Elem<V>::Math(0);
}

// The mode a step runs: a clip of 0 is no clip.
TFCLIP_HD ClipMode ActiveClipMode(const ClipConfig& cfg) {
  return cfg.clip == 0.0 ? ClipMode::kNone : cfg.mode;
}

// What is wrong with a clip configuration's numbers: 0 fine, 1 the clip (must be finite and
// >= 0), 2 use_norm (a norm: >= 0, or NaN, which the non-finite policy handles). Host and
// device: the CUDA finalize kernel checks values it reads from device memory with it.
TFCLIP_HD int ClipConfigError(const ClipConfig& cfg) {
  if (cfg.mode != ClipMode::kNone && !(cfg.clip - cfg.clip == 0.0 && cfg.clip >= 0.0)) return 1;
  if (cfg.has_use_norm && cfg.use_norm < 0.0) return 2;
  if (cfg.mode == ClipMode::kAgc && !(cfg.agc_eps - cfg.agc_eps == 0.0 && cfg.agc_eps >= 0.0)) return 3;
  if (!(cfg.grad_scale - cfg.grad_scale == 0.0 && cfg.grad_scale > 0.0)) return 4;
  if (cfg.grad_scale != 1.0 && cfg.mode == ClipMode::kAgc) return 5;
  return 0;
}

// TF's clip_by_global_norm scale: clip * min(1/norm, 1/clip) + (norm - norm); NaN when the
// norm is inf or NaN. Host and device (the CUDA finalize kernel computes it on the GPU).
TFCLIP_HD double GlobalClipScale(double clip_norm, double norm) {
  const double inv_n = 1.0 / norm, inv_c = 1.0 / clip_norm;
  return clip_norm * (inv_n < inv_c ? inv_n : inv_c) + (norm - norm);
}

// One tensor's clip factor, given the global scale (kGlobalNorm) or its own sum of squares
// (kNorm) of the gradient as given, times grad_scale (ClipConfig::grad_scale). The one
// definition of each clip mode, for the CPU driver and the CUDA finalize.
TFCLIP_HD ClipFactor TensorClipFactor(ClipMode mode, double clip, double global_scale,
                                      double sumsq, double grad_scale = 1.0) {
  ClipFactor f;
  sumsq *= grad_scale * grad_scale;  // (the scaled gradient's: exact for a power of two)
  switch (mode) {
    case ClipMode::kNone: break;
    case ClipMode::kGlobalNorm: f.scale = global_scale; break;
    case ClipMode::kNorm: {
      // TF clip_by_norm: t * c / max(||t||, c); NaN norms propagate through the max.
      const double nt = std::sqrt(sumsq);
      const double m = nt != nt ? nt : (nt > clip ? nt : clip);
      f.scale = clip / m;
      break;
    }
    case ClipMode::kValue:
      f.lo = -clip;
      f.hi = clip;
      break;
    case ClipMode::kAgc: break;  // per unit: AgcUnitScale, in unit_scale
  }
  f.scale *= grad_scale;
  return f;
}

// AGC's scale of one unit from its fp64 sums of squares: g2 of the (pre-clip) gradient, w2 of
// the variable before the step. The paper (Brock et al. 2021, eq. 3): G_u is multiplied by
// clip * max(||W_u||, eps) / ||G_u|| when ||G_u|| > clip * max(||W_u||, eps), else left as it
// is. (optax divides by max(||G_u||, 1e-6): the same whenever clip * eps >= 1e-6, since then the
// scaled branch has ||G_u|| > 1e-6; with a smaller bound we follow the paper.) Non-finite norms,
// which the paper leaves open, as optax's adaptive_grad_clip and TF's clip_by_norm treat them: a
// NaN gradient or weight norm makes the whole unit NaN (the scale is NaN), an infinite gradient
// norm under a finite bound gives scale 0. (The non-finite policy acts on the global norm first:
// only nonfinite='propagate' writes such a step.) Clipped: every scale but 1, NaN included.
TFCLIP_HD double AgcUnitScale(double clip, double eps, double g2, double w2) {
  const double wn = std::sqrt(w2), gn = std::sqrt(g2);
  const double floor = wn != wn ? wn : (wn > eps ? wn : eps);
  const double bound = clip * floor;
  return gn <= bound ? 1.0 : bound / gn;
}

// The global norm a step reports: the given one, or sqrt of the summed squares.
TFCLIP_HD double StepGlobalNorm(const ClipConfig& cfg, double total_sumsq) {
  return (cfg.has_use_norm ? cfg.use_norm : std::sqrt(total_sumsq)) * cfg.grad_scale;
}

// Whether the norm pass is needed: always, except with `use_norm` (unless clipnorm needs each
// tensor's own norm).
bool NeedsNormPass(const ClipConfig& cfg);

// From the per-tensor sums of squares, the global norm and each tensor's clip factor.
struct ClipOutcome {
  double global_norm = 0.0;
  bool finite = true;
};
ClipOutcome ComputeClipFactors(const ClipConfig& cfg, const double* per_tensor_sumsq,
                               double total_sumsq, int n, ClipFactor* factors);

}  // namespace tfclip
