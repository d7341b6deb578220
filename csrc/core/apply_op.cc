// tfclip core: the apply ops' description (apply_op.h): the attrs' parsers and checks, and the
// text of their TF signature.
#include "csrc/core/apply_op.h"

#include "csrc/core/types.h"

namespace tfclip {

ClipConfig ApplyOpAttrs::Clip() const {
  ClipConfig c;
  c.mode = mode;
  c.policy = policy;
  c.has_use_norm = use_given_norm;
  c.agc_eps = agc_eps;
  return c;
}

namespace {
// A positions attr: ascending, in [0, n).
std::string CheckPositions(const char* what, const std::vector<int32_t>& p, int n) {
  for (size_t k = 0; k < p.size(); ++k) {
    const int32_t i = p[k];
    if (!(i >= 0 && i < n && (k == 0 || i > p[k - 1]))) {
      return std::string(what) + " must list gradient positions in [0, " + std::to_string(n) +
             ") in increasing order; got " + std::to_string(i) + " at " + std::to_string(k);
    }
  }
  return "";
}
}  // namespace

std::string ApplyOpAttrs::Check() const {
  if (num_iterations > 1) {
    return "iterations takes at most one variable, got " + std::to_string(num_iterations);
  }
  if (num_grad_scale > 1) {
    return "grad_scale takes at most one scalar, got " + std::to_string(num_grad_scale);
  }
  if (num_rounding != 0 && num_rounding != 2) {
    return "rounding takes none or two scalars (seed, step), got " + std::to_string(num_rounding);
  }
  std::string e = CheckPositions("sparse", sparse, num_grads);
  if (e.empty()) e = CheckPositions("ref", ref, num_grads);
  if (e.empty() && !var_offsets.empty()) {
    if (static_cast<int>(var_offsets.size()) != num_grads) {
      return "var_offsets has " + std::to_string(var_offsets.size()) + " entries for " +
             std::to_string(num_grads) + " variables (one each, or none)";
    }
    for (size_t i = 0; i < var_offsets.size(); ++i) {
      if (var_offsets[i] < -1) {
        return "var_offsets[" + std::to_string(i) + "] is " + std::to_string(var_offsets[i]) +
               "; -1 (the whole variable) or the element its range starts at";
      }
      for (const int32_t k : sparse) {
        if (k == static_cast<int32_t>(i) && var_offsets[i] >= 0) {
          return "var_offsets[" + std::to_string(i) + "]: a range of a variable takes a dense gradient, "
                 "and grads[" + std::to_string(i) + "] is sparse";
        }
      }
    }
  }
  return e;
}

std::string ParseClipModeAttr(const std::string& s, ApplyOpAttrs* out) {
  return ParseClipMode(s, &out->mode) ? "" : "clip_mode " + s;
}

std::string ParseNonFiniteAttr(const std::string& s, ApplyOpAttrs* out) {
  return ParseNonFinitePolicy(s, &out->policy) ? "" : "nonfinite " + s;
}

std::string FloatTypeNames() {
#define TFCLIP_TYPE_NAME(E, S, M, N, ...) N ", "
  std::string list = TFCLIP_FOR_EACH_TYPE(TFCLIP_TYPE_NAME);
#undef TFCLIP_TYPE_NAME
  list.resize(list.size() - 2);  // the trailing ", "
  return list;
}

std::string FloatTypeListAttr(const std::string& name, const char* bound) {
  return name + ": list({" + FloatTypeNames() + "})" + bound;
}

std::string ApplyAttrSpec(const ApplyAttrDef& a, bool ref_op) {
  const char* type = ref_op && a.ref_type != nullptr ? a.ref_type : a.type;
  std::string s = a.float_types ? FloatTypeListAttr(a.name, type) : std::string(a.name) + ": " + type;
  if (a.default_value != nullptr) s += std::string(" = ") + a.default_value;
  return s;
}

const RuleInfo* FindApplyRule(const std::string& op, bool* ref_op) {
  for (const RuleInfo& r : AllRules()) {
    if (op == std::string(kApplyOpPrefix) + r.op) {
      *ref_op = false;
      return &r;
    }
    if (op == std::string(kApplyRefOpPrefix) + r.op) {
      *ref_op = true;
      return &r;
    }
  }
  return nullptr;
}

}  // namespace tfclip
