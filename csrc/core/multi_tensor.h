// tfclip core: what every adapter hands the core — raw tensors, the chunk plan over the
// flattened list, the clip configuration and its per-tensor outcome, validation. No TF header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/rules.h"
#include "csrc/core/types.h"

namespace tfclip {

// Work is split into fixed-size chunks over all tensors flattened together. A chunk never
// spans two tensors, and its boundaries depend only on the tensor sizes, never on the thread
// count or launch shape: that is what makes the norm bitwise deterministic.
constexpr int64_t kChunkElems = int64_t{1} << 16;

struct TensorView {
  void* data = nullptr;
  int64_t size = 0;  // elements
  DType dtype = DType::kFloat;
};

struct ApplyTensor {
  void* var = nullptr;
  const void* grad = nullptr;
  void* slots[kMaxSlots] = {nullptr, nullptr, nullptr};
  int64_t size = 0;  // elements of the variable (and of a dense gradient)
  DType var_dtype = DType::kFloat;  // slots share the variable's dtype
  DType grad_dtype = DType::kFloat;
  // An IndexedSlices gradient: `grad` holds nnz slices of `width` elements, slice j for row
  // indices[j] of the variable seen as a rows x width matrix. Indices are in host memory.
  bool sparse = false;
  const int64_t* indices = nullptr;
  int64_t nnz = 0;
  int64_t rows = 0;
  int64_t width = 0;
  int64_t grad_size() const { return sparse ? nnz * width : size; }
};

struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// The chunks of a list, and the work blocks the thread pool schedules: consecutive chunks
// grouped until they hold about chunk_elems elements, so 2,000 small tensors are a few dozen
// tasks, not 2,000. Both depend only on the sizes; partial sums stay per chunk.
struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<int64_t> block_begin;  // block b covers chunks [block_begin[b], block_begin[b+1])
  int64_t num_blocks() const { return static_cast<int64_t>(block_begin.size()) - 1; }
};

// Plans the chunks of tensors with the given sizes (empty tensors get none).
void PlanChunks(const int64_t* sizes, int n, int64_t chunk_elems, ChunkPlan* plan);
// The same for a list of tensors, at kChunkElems.
void PlanList(const TensorView* ts, int n, ChunkPlan* plan);

enum class ClipMode : int { kNone = 0, kGlobalNorm = 1, kNorm = 2, kValue = 3 };
enum class NonFinitePolicy : int { kSkip = 0, kPropagate = 1, kRaise = 2 };

bool ParseClipMode(const std::string& s, ClipMode* out);
bool ParseNonFinitePolicy(const std::string& s, NonFinitePolicy* out);
bool ParseRule(const std::string& s, RuleKind* out);

struct ClipConfig {
  ClipMode mode = ClipMode::kNone;
  double clip = 0.0;  // global_clipnorm, clipnorm or clipvalue, by mode
  bool has_use_norm = false;
  double use_norm = 0.0;  // a global norm computed elsewhere (e.g. all-reduced across shards)
  NonFinitePolicy policy = NonFinitePolicy::kSkip;
};

// The clip folded into the apply pass, per tensor: g' = clamp(g * scale, lo, hi), with the
// scale first rounded to the gradient's dtype as TF's `v * cast(scale, v.dtype)` does.
struct ClipFactor {
  double scale = 1.0;
  double lo = -INFINITY;
  double hi = INFINITY;
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
#define TFCLIP_CAST_CASE(E, S, M, N) \
  case DType::E:                     \
    return CastClipGrad<S, V>(static_cast<const S*>(grad)[i], f);
    TFCLIP_FOR_EACH_TYPE(TFCLIP_CAST_CASE)
#undef TFCLIP_CAST_CASE
  }
  return typename Elem<V>::Math(0);
}

// TF's clip_by_global_norm scale: clip * min(1/norm, 1/clip) + (norm - norm); NaN when the
// norm is inf or NaN. Host and device (the CUDA finalize kernel computes it on the GPU).
TFCLIP_HD double GlobalClipScale(double clip_norm, double norm) {
  const double inv_n = 1.0 / norm, inv_c = 1.0 / clip_norm;
  return clip_norm * (inv_n < inv_c ? inv_n : inv_c) + (norm - norm);
}

// One tensor's clip factor, given the global scale (kGlobalNorm) or its own sum of squares
// (kNorm). The one definition of each clip mode, for the CPU driver and the CUDA finalize.
TFCLIP_HD ClipFactor TensorClipFactor(ClipMode mode, double clip, double global_scale,
                                      double sumsq) {
  ClipFactor f;
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
  }
  return f;
}

// The global norm a step reports: the given one, or sqrt of the summed squares.
TFCLIP_HD double StepGlobalNorm(const ClipConfig& cfg, double total_sumsq) {
  return cfg.has_use_norm ? cfg.use_norm : std::sqrt(total_sumsq);
}

// Whether the norm pass is needed: always, except a global-norm clip given `use_norm`.
bool NeedsNormPass(const ClipConfig& cfg);

// From the per-tensor sums of squares, the global norm and each tensor's clip factor.
struct ClipOutcome {
  double global_norm = 0.0;
  bool finite = true;
};
ClipOutcome ComputeClipFactors(const ClipConfig& cfg, const double* per_tensor_sumsq,
                               double total_sumsq, int n, ClipFactor* factors);

// Validation shared by the adapters. Each returns "" when fine, else a message naming the
// culprit by list index. Shapes are the adapters' business (the core only sees sizes).
std::string ValidateClipNorm(double clip_norm, const char* what);
std::string ValidateClipConfig(const ClipConfig& cfg);
std::string ValidateHParams(RuleKind rule, const HParams& hp);

}  // namespace tfclip
