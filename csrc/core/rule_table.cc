// tfclip core: the rule table's host-side lookups (see rule_table.h).
#include "csrc/core/rule_table.h"

#include <cstring>

namespace tfclip {

std::vector<std::string> RuleInfo::slots() const {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = slot_csv; *p != '\0'; ++p) {
    if (*p == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

const std::vector<RuleInfo>& AllRules() {
  static const std::vector<RuleInfo> rules{
#define TFCLIP_RULE_INFO(kind, Struct, op, name, slots, hps, flags) \
  RuleInfo{RuleKind::kind, op, name, slots, hps, flags, Struct::kMinSlots, Struct::kMaxSlots, \
           Struct::kUnsignedSlots},
      TFCLIP_FOR_EACH_RULE(TFCLIP_RULE_INFO)
#undef TFCLIP_RULE_INFO
  };
  return rules;
}

const RuleInfo& GetRuleInfo(RuleKind r) { return AllRules()[static_cast<size_t>(r)]; }

bool ParseRule(const std::string& s, RuleKind* out) {
  for (const RuleInfo& r : AllRules()) {
    if (s == r.name) {
      *out = r.kind;
      return true;
    }
  }
  return false;
}

}  // namespace tfclip
