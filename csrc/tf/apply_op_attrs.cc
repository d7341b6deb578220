// tfclip TF glue: ReadApplyOpAttrs (apply_op_attrs.h), each attr by its kind's GetAttr.
#include "csrc/tf/apply_op_attrs.h"

#include <string>
#include <vector>

#include "tensorflow/core/framework/types.h"

namespace tfclip {

namespace tf = ::tensorflow;

absl::Status ReadApplyOpAttrs(tf::OpKernelConstruction* c, const RuleInfo& rule, bool ref_op,
                              ApplyOpAttrs* out) {
  for (const ApplyAttrDef& a : kApplyAttrs) {
    if (!ApplyOpHas(a.ops, ref_op)) continue;
    switch (a.kind) {
      case AttrKind::kDeclared: break;
      case AttrKind::kBool: TF_RETURN_IF_ERROR(c->GetAttr(a.name, &(out->*a.bool_field))); break;
      case AttrKind::kInt: TF_RETURN_IF_ERROR(c->GetAttr(a.name, &(out->*a.int_field))); break;
      case AttrKind::kFloat: {
        float v = 0;
        TF_RETURN_IF_ERROR(c->GetAttr(a.name, &v));
        out->*a.double_field = static_cast<double>(v);
        break;
      }
      case AttrKind::kString: {
        std::string v;
        TF_RETURN_IF_ERROR(c->GetAttr(a.name, &v));
        const std::string err = a.parse(v, out);
        if (!err.empty()) return tf::errors::InvalidArgument(err);
        break;
      }
      case AttrKind::kIntList: TF_RETURN_IF_ERROR(c->GetAttr(a.name, &(out->*a.ints_field))); break;
      case AttrKind::kTypeList: {
        std::vector<tf::DataType> v;
        TF_RETURN_IF_ERROR(c->GetAttr(a.name, &v));
        out->*a.int_field = static_cast<int>(v.size());
        break;
      }
    }
  }
  out->flags = 0;
  for (int k = 0; k < kNumFlags; ++k) {
    if (!((rule.flags >> k) & 1u)) continue;
    bool v = false;
    TF_RETURN_IF_ERROR(c->GetAttr(FlagAttr(static_cast<Flag>(k)), &v));
    if (v) out->flags |= FlagBit(static_cast<Flag>(k));
  }
  const std::string err = out->Check();
  if (!err.empty()) return tf::errors::InvalidArgument(err);
  return absl::OkStatus();
}

}  // namespace tfclip
