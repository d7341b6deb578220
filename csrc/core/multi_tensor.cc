// tfclip core: chunk planning, clip policy and validation shared by every adapter.
#include "csrc/core/multi_tensor.h"

#include <cmath>
#include <sstream>

namespace tfclip {

const char* DTypeName(DType t) {
  switch (t) {
#define TFCLIP_NAME_CASE(E, S, M, N) \
  case DType::E:                     \
    return N;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_NAME_CASE)
#undef TFCLIP_NAME_CASE
  }
  return "unknown";
}

int DTypeSize(DType t) {
  switch (t) {
#define TFCLIP_SIZE_CASE(E, S, M, N) \
  case DType::E:                     \
    return static_cast<int>(sizeof(S));
    TFCLIP_FOR_EACH_TYPE(TFCLIP_SIZE_CASE)
#undef TFCLIP_SIZE_CASE
  }
  return 0;
}

const char* RuleName(RuleKind r) {
  switch (r) {
    case RuleKind::kSgd: return "sgd";
    case RuleKind::kMomentum: return "momentum";
    case RuleKind::kKerasMomentum: return "keras_momentum";
    case RuleKind::kAdam: return "adam";
  }
  return "unknown";
}

int NumSlots(RuleKind rule, const HParams& hp) {
  switch (rule) {
    case RuleKind::kSgd: return 0;
    case RuleKind::kMomentum:
    case RuleKind::kKerasMomentum: return 1;
    case RuleKind::kAdam: return hp.amsgrad ? 3 : 2;
  }
  return 0;
}

namespace {
// Plans into `plan`'s existing buffers (a caller that keeps the plan allocates nothing).
template <typename SizeOf>
void PlanChunksBy(int n, int64_t chunk_elems, SizeOf size_of, ChunkPlan* plan) {
  plan->chunks.clear();
  plan->block_begin.assign(1, 0);
  int64_t in_block = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t size = size_of(i);
    for (int64_t b = 0; b < size; b += chunk_elems) {
      const int64_t e = b + chunk_elems < size ? b + chunk_elems : size;
      plan->chunks.push_back(Chunk{static_cast<int32_t>(i), b, e});
      in_block += e - b;
      if (in_block >= chunk_elems) {
        plan->block_begin.push_back(static_cast<int64_t>(plan->chunks.size()));
        in_block = 0;
      }
    }
  }
  if (in_block > 0) plan->block_begin.push_back(static_cast<int64_t>(plan->chunks.size()));
}
}  // namespace

void PlanChunks(const int64_t* sizes, int n, int64_t chunk_elems, ChunkPlan* plan) {
  PlanChunksBy(n, chunk_elems, [sizes](int i) { return sizes[i]; }, plan);
}

void PlanList(const TensorView* ts, int n, ChunkPlan* plan) {
  PlanChunksBy(n, kChunkElems, [ts](int i) { return ts[i].size; }, plan);
}

bool ParseClipMode(const std::string& s, ClipMode* out) {
  if (s == "none") *out = ClipMode::kNone;
  else if (s == "global_norm") *out = ClipMode::kGlobalNorm;
  else if (s == "norm") *out = ClipMode::kNorm;
  else if (s == "value") *out = ClipMode::kValue;
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

bool ParseRule(const std::string& s, RuleKind* out) {
  if (s == "sgd") *out = RuleKind::kSgd;
  else if (s == "momentum") *out = RuleKind::kMomentum;
  else if (s == "keras_momentum") *out = RuleKind::kKerasMomentum;
  else if (s == "adam") *out = RuleKind::kAdam;
  else return false;
  return true;
}

bool NeedsNormPass(const ClipConfig& cfg) {
  return !(cfg.has_use_norm && cfg.mode != ClipMode::kNorm);
}

ClipOutcome ComputeClipFactors(const ClipConfig& cfg, const double* per_tensor_sumsq,
                               double total_sumsq, int n, ClipFactor* factors) {
  ClipOutcome out;
  out.global_norm = StepGlobalNorm(cfg, total_sumsq);
  out.finite = std::isfinite(out.global_norm);
  const double gs = cfg.mode == ClipMode::kGlobalNorm ? GlobalClipScale(cfg.clip, out.global_norm) : 1.0;
  for (int i = 0; i < n; ++i) {
    factors[i] = TensorClipFactor(cfg.mode, cfg.clip, gs, per_tensor_sumsq[i]);
  }
  return out;
}

namespace {
std::string Fmt(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
std::string CheckRange(const char* name, double v, double lo, bool lo_open, double hi,
                       bool hi_open) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (ok) return "";
  std::ostringstream os;
  os << name << " must be finite and in " << (lo_open ? "(" : "[") << lo << ", "
     << (std::isinf(hi) ? "inf" : Fmt(hi)) << (hi_open ? ")" : "]") << ", got " << v;
  return os.str();
}
}  // namespace

std::string ValidateClipNorm(double clip_norm, const char* what) {
  if (std::isfinite(clip_norm) && clip_norm > 0) return "";
  return std::string(what) + " must be finite and > 0, got " + Fmt(clip_norm);
}

std::string ValidateClipConfig(const ClipConfig& cfg) {
  if (cfg.mode != ClipMode::kNone) {
    // Named as Keras names the argument for each mode.
    const char* what = cfg.mode == ClipMode::kGlobalNorm ? "global_clipnorm"
                       : cfg.mode == ClipMode::kNorm     ? "clipnorm"
                                                         : "clipvalue";
    const std::string e = ValidateClipNorm(cfg.clip, what);
    if (!e.empty()) return e;
  }
  if (cfg.has_use_norm && cfg.use_norm < 0) {
    return "use_norm must be >= 0 (it is a norm), got " + Fmt(cfg.use_norm);
  }
  return "";
}

std::string ValidateHParams(RuleKind rule, const HParams& hp) {
  const double inf = INFINITY;
  std::string e = CheckRange("learning_rate", hp.lr, 0, false, inf, false);
  if (e.empty()) e = CheckRange("weight_decay", hp.weight_decay, 0, false, inf, false);
  if (!e.empty()) return e;
  switch (rule) {
    case RuleKind::kSgd: break;
    case RuleKind::kMomentum:
    case RuleKind::kKerasMomentum:
      e = CheckRange("momentum", hp.momentum, 0, false, 1, false);
      break;
    case RuleKind::kAdam:
      e = CheckRange("beta_1", hp.beta_1, 0, false, 1, true);
      // beta_2 = 1 is a zero update (1 - beta_2^t = 0), as stock Keras and TF accept it;
      // beta_1 = 1 would divide by 1 - beta_1^t = 0.
      if (e.empty()) e = CheckRange("beta_2", hp.beta_2, 0, false, 1, false);
      if (e.empty()) e = CheckRange("epsilon", hp.epsilon, 0, false, inf, false);
      if (hp.beta_powers) {
        if (e.empty()) e = CheckRange("beta_powers[0]", hp.beta_1_power, 0, false, 1, true);
        if (e.empty()) e = CheckRange("beta_powers[1]", hp.beta_2_power, 0, false, 1, false);
      } else if (e.empty()) {
        e = CheckRange("step", hp.step, 1, false, inf, false);
      }
      break;
  }
  return e;
}

}  // namespace tfclip
