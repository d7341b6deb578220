// tfclip core: the one description of the clip-and-apply ops' common signature (no TF header).
// TfclipClipApply<Op> and TfclipClipApplyRef<Op> (csrc/tf/ops.cc) are, in order: the inputs of
// kApplyInputs, in which kRuleSlots and kRuleHParams stand for a rule's own inputs (its slot
// lists and hyper-parameters, from the rule table, csrc/core/rule_table.h, with its flags as
// bool attrs after the inputs' attrs); the outputs of kApplyOutputs; then the attributes of
// kApplyAttrs. The op registration (csrc/tf/ops.cc) writes its .Input/.Output/.Attr lines from
// these tables, its shape function sets the outputs by their shape kind, and the TF and XLA
// kernels (csrc/tf/apply_kernel.cc, csrc/xla/tf/kernels.cc) read the attributes into one
// ApplyOpAttrs by looping over kApplyAttrs (csrc/tf/apply_op_attrs.h). A new attribute or output
// is one row here (and a field of ApplyOpAttrs for an attribute the kernels read);
// docs/architecture.md, "Adding an apply-op attribute or output", lists what else may follow.
// tests/test_build_op_def.py checks the registered ops against Python's view of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/clip.h"
#include "csrc/core/rule_table.h"

namespace tfclip {

inline constexpr char kApplyOpPrefix[] = "TfclipClipApply";        // + RuleInfo::op
inline constexpr char kApplyRefOpPrefix[] = "TfclipClipApplyRef";  // TF1 ref variables

// The common attributes as the kernels use them, one field per attribute they read.
struct ApplyOpAttrs {
  int num_grads = 0;         // Tgrad: the gradients' count (its length)
  int num_iterations = 0;    // Niterations: 0, or 1 step counter variable
  ClipMode mode = ClipMode::kNone;                    // clip_mode
  double agc_eps = 1e-3;                              // agc_eps (a float attr, widened)
  NonFinitePolicy policy = NonFinitePolicy::kSkip;    // nonfinite
  bool use_given_norm = false;                        // use_given_norm
  std::vector<int32_t> sparse;  // sparse: the IndexedSlices gradients' positions, ascending
  bool lazy = false;            // lazy
  bool sum_of_squares = false;  // sum_of_squares
  std::vector<int32_t> ref;     // ref (ref op only): the ref variables' positions, ascending
  int num_absmax = 0;           // Nabsmax (resource op only): int8 state's absmax variables
  int num_grad_scale = 0;       // Ngrad_scale: 0, or 1 grad_scale (ClipConfig::grad_scale)
  int num_rounding = 0;         // Nrounding: 0, or 2 (stochastic rounding's seed and step)
  // var_offsets (resource op only): [] (every variable whole), or one entry per variable: -1 whole,
  // else the element where its gradient and slots start, a range of the variable flat (a replica's
  // share of a variable split across replicas, tfclip/_engine/shard.py).
  std::vector<int32_t> var_offsets;

  // The rule's bool attrs (its flags, from the rule table; not rows of kApplyAttrs): the
  // FlagBit mask of those set.
  uint32_t flags = 0;

  // The clip configuration of a step (clip and use_norm are inputs: set per step).
  ClipConfig Clip() const;
  // What the attrs' types cannot say: sparse and ref ascending in [0, num_grads), at most one
  // step counter. "" when they hold, else the error.
  std::string Check() const;
};

// Which ops carry a row.
enum class ApplyOps : int { kBoth, kResourceOnly, kRefOnly };
inline bool ApplyOpHas(ApplyOps which, bool ref_op) {
  return which == ApplyOps::kBoth || (which == ApplyOps::kRefOnly) == ref_op;
}

// How a glue reads an attribute's value (its GetAttr overload), and where it goes.
enum class AttrKind : int {
  kDeclared,  // registration only: no kernel reads it (N; Tindices: the inputs tell)
  kBool,      // -> bool field
  kInt,       // -> int field
  kFloat,     // -> double field (a TF float: float32)
  kString,    // -> parse(value, attrs): an enum attr
  kIntList,   // -> std::vector<int32_t> field
  kTypeList,  // -> int field: the list's length
};

struct ApplyAttrDef {
  const char* name;
  // TF's attr type text ("bool", "{'skip', 'propagate', 'raise'}", "int >= 0"), or for
  // float_types the text after "list({<tfclip's dtypes>})" (" >= 1").
  const char* type;
  const char* default_value;  // TF's text ("false", "'none'", "[]"), or nullptr: none
  ApplyOps ops;
  AttrKind kind;
  bool float_types = false;   // a list(type) attr over tfclip's dtypes (csrc/core/types.h)
  const char* ref_type = nullptr;  // the ref op's type text, where it differs
  bool ApplyOpAttrs::*bool_field = nullptr;
  int ApplyOpAttrs::*int_field = nullptr;
  double ApplyOpAttrs::*double_field = nullptr;
  std::vector<int32_t> ApplyOpAttrs::*ints_field = nullptr;
  // kString: stores the parsed value; "" or the error.
  std::string (*parse)(const std::string& value, ApplyOpAttrs* out) = nullptr;
};

// The row builders (by kind).
constexpr ApplyAttrDef DeclaredAttr(const char* name, const char* type, const char* dflt = nullptr,
                                    const char* ref_type = nullptr) {
  ApplyAttrDef d{name, type, dflt, ApplyOps::kBoth, AttrKind::kDeclared};
  d.ref_type = ref_type;
  return d;
}
constexpr ApplyAttrDef BoolAttr(const char* name, const char* dflt, bool ApplyOpAttrs::*f,
                                ApplyOps ops = ApplyOps::kBoth) {
  ApplyAttrDef d{name, "bool", dflt, ops, AttrKind::kBool};
  d.bool_field = f;
  return d;
}
constexpr ApplyAttrDef IntAttr(const char* name, const char* type, const char* dflt,
                               int ApplyOpAttrs::*f, ApplyOps ops = ApplyOps::kBoth) {
  ApplyAttrDef d{name, type, dflt, ops, AttrKind::kInt};
  d.int_field = f;
  return d;
}
constexpr ApplyAttrDef FloatAttr(const char* name, const char* dflt, double ApplyOpAttrs::*f) {
  ApplyAttrDef d{name, "float", dflt, ApplyOps::kBoth, AttrKind::kFloat};
  d.double_field = f;
  return d;
}
constexpr ApplyAttrDef EnumAttr(const char* name, const char* type, const char* dflt,
                                std::string (*parse)(const std::string&, ApplyOpAttrs*)) {
  ApplyAttrDef d{name, type, dflt, ApplyOps::kBoth, AttrKind::kString};
  d.parse = parse;
  return d;
}
constexpr ApplyAttrDef IntListAttr(const char* name, const char* dflt,
                                   std::vector<int32_t> ApplyOpAttrs::*f,
                                   ApplyOps ops = ApplyOps::kBoth) {
  ApplyAttrDef d{name, "list(int)", dflt, ops, AttrKind::kIntList};
  d.ints_field = f;
  return d;
}
// A list(type) attr; `count`: the int field its length goes to (nullptr: registration only).
constexpr ApplyAttrDef TypeListAttr(const char* name, const char* type, bool float_types,
                                    int ApplyOpAttrs::*count) {
  ApplyAttrDef d{name, type, nullptr, ApplyOps::kBoth,
                 count != nullptr ? AttrKind::kTypeList : AttrKind::kDeclared};
  d.float_types = float_types;
  d.int_field = count;
  return d;
}

std::string ParseClipModeAttr(const std::string& s, ApplyOpAttrs* out);
std::string ParseNonFiniteAttr(const std::string& s, ApplyOpAttrs* out);

// The common attributes, in the ops' attr order (after the inputs' own attrs and the rule's
// flags). Order, names, types and defaults are the ops' signature: saved graphs and
// tfclip/_engine/opcall.py (by keyword) depend on them; change them only by adding a row with a default.
inline constexpr ApplyAttrDef kApplyAttrs[] = {
    DeclaredAttr("N", "int >= 1", nullptr, /*ref_type=*/"int >= 0"),
    IntAttr("Niterations", "int >= 0", "0", &ApplyOpAttrs::num_iterations),
    TypeListAttr("Tgrad", " >= 1", /*float_types=*/true, &ApplyOpAttrs::num_grads),
    EnumAttr("clip_mode", "{'none', 'global_norm', 'norm', 'value', 'agc'}", "'none'",
             &ParseClipModeAttr),
    FloatAttr("agc_eps", "0.001", &ApplyOpAttrs::agc_eps),
    EnumAttr("nonfinite", "{'skip', 'propagate', 'raise'}", "'skip'", &ParseNonFiniteAttr),
    BoolAttr("use_given_norm", "false", &ApplyOpAttrs::use_given_norm),
    TypeListAttr("Tindices", "list({int32, int64}) >= 0", /*float_types=*/false, nullptr),
    IntListAttr("sparse", "[]", &ApplyOpAttrs::sparse),
    BoolAttr("lazy", "false", &ApplyOpAttrs::lazy),
    BoolAttr("sum_of_squares", "false", &ApplyOpAttrs::sum_of_squares),
    IntListAttr("ref", "[]", &ApplyOpAttrs::ref, ApplyOps::kRefOnly),
    IntAttr("Nabsmax", "int >= 0", "0", &ApplyOpAttrs::num_absmax, ApplyOps::kResourceOnly),
    IntAttr("Ngrad_scale", "int >= 0", "0", &ApplyOpAttrs::num_grad_scale),
    IntAttr("Nrounding", "int >= 0", "0", &ApplyOpAttrs::num_rounding),
    IntListAttr("var_offsets", "[]", &ApplyOpAttrs::var_offsets, ApplyOps::kResourceOnly),
};

// The inputs, in order. A row of kind kRuleSlots or kRuleHParams stands for the rule's own.
enum class ApplyInputKind : int { kInput, kRuleSlots, kRuleHParams };
struct ApplyInputDef {
  ApplyInputKind kind;
  const char* name;
  const char* type;   // TF's arg type text ("N * resource", "double")
  ApplyOps ops;
  // On GPU, an input the kernel reads on the host (resource handles, the IndexedSlices indices
  // it plans there); every other input stays in device memory. (kRuleSlots: the slot resource
  // lists; a ref op's ref lists are the variables' own tensors, in device memory.)
  bool host_memory = false;
  // An attr the input brings along, registered with it (before kApplyAttrs): its name, and for
  // a list(type) over tfclip's dtypes the text after the list (" >= 0").
  const char* attr = nullptr;
  const char* attr_bound = nullptr;
};
inline constexpr ApplyInputDef kApplyInputs[] = {
    {ApplyInputKind::kInput, "var", "N * resource", ApplyOps::kBoth, true},
    {ApplyInputKind::kInput, "var_ref", "Ref(Tvar_ref)", ApplyOps::kRefOnly, false, "Tvar_ref", " >= 0"},
    // each slot: "<slot>: N_<slot> * resource" with attr "N_<slot>: int >= 0"; on the ref op
    // then "<slot>_ref: Ref(T<slot>_ref)" with its list(type) attr
    {ApplyInputKind::kRuleSlots, nullptr, nullptr, ApplyOps::kBoth, true},
    {ApplyInputKind::kInput, "grad", "Tgrad", ApplyOps::kBoth},
    {ApplyInputKind::kRuleHParams, nullptr, nullptr, ApplyOps::kBoth},  // each: "<hparam>: double"
    {ApplyInputKind::kInput, "indices", "Tindices", ApplyOps::kBoth, true},
    {ApplyInputKind::kInput, "clip", "double", ApplyOps::kBoth},
    {ApplyInputKind::kInput, "use_norm", "double", ApplyOps::kBoth},
    {ApplyInputKind::kInput, "iterations", "Niterations * resource", ApplyOps::kBoth, true},
    // int8 state (state_dtype="int8"; csrc/core/tensors.h SlotStorage::kInt8): a variable whose
    // slots are uint8 (their codes) has one float32 absmax variable per slot, here: for each
    // slot list in order, the absmax of each such variable in gradient order. Last, with a
    // default count of 0: graphs saved before it still load.
    {ApplyInputKind::kInput, "absmax", "Nabsmax * resource", ApplyOps::kResourceOnly, true},
    // The loss-scale unscale folded into the passes (ClipConfig::grad_scale: 1 / loss scale),
    // a scalar, or none (1). A list of 0 or 1, last, for the same reason as absmax.
    {ApplyInputKind::kInput, "grad_scale", "Ngrad_scale * double", ApplyOps::kBoth},
    // Stochastic rounding of bfloat16 variables (csrc/core/rounding.h): none (round to nearest),
    // or two scalars, the seed and the step (HParams::rounding_seed, rounding_step). Last, for
    // the same reason.
    {ApplyInputKind::kInput, "rounding", "Nrounding * double", ApplyOps::kBoth},
};

// The outputs, in order, with their shapes.
enum class ApplyOutputShape : int { kScalar, kPerGrad };  // [] or [num_grads]
struct ApplyOutputDef {
  const char* name;
  const char* type;  // TF's dtype name
  ApplyOutputShape shape;
};
inline constexpr ApplyOutputDef kApplyOutputs[] = {
    {"global_norm", "float", ApplyOutputShape::kScalar},
    {"applied", "bool", ApplyOutputShape::kScalar},
    {"tensor_norms", "float", ApplyOutputShape::kPerGrad},
    {"clipped_units", "int64", ApplyOutputShape::kPerGrad},
};
inline constexpr int kNumApplyOutputs = static_cast<int>(sizeof(kApplyOutputs) / sizeof(kApplyOutputs[0]));

// The output's index by name (a kernel's allocate_output/SetOutput), -1 if none.
constexpr int ApplyOutputIndex(const char* name) {
  for (int i = 0; i < kNumApplyOutputs; ++i) {
    const char* a = kApplyOutputs[i].name;
    const char* b = name;
    while (*a != '\0' && *a == *b) {
      ++a;
      ++b;
    }
    if (*a == '\0' && *b == '\0') return i;
  }
  return -1;
}

// The outputs the kernels write, by name: their indices.
inline constexpr int kApplyOutGlobalNorm = ApplyOutputIndex("global_norm");
inline constexpr int kApplyOutApplied = ApplyOutputIndex("applied");
inline constexpr int kApplyOutTensorNorms = ApplyOutputIndex("tensor_norms");
inline constexpr int kApplyOutClippedUnits = ApplyOutputIndex("clipped_units");
static_assert(kApplyOutGlobalNorm >= 0 && kApplyOutApplied >= 0 && kApplyOutTensorNorms >= 0 &&
                  kApplyOutClippedUnits >= 0,
              "an output the kernels write is missing from kApplyOutputs");

// "half, bfloat16, float, double": tfclip's dtypes by their TF names (csrc/core/types.h).
std::string FloatTypeNames();
// "name: list({half, bfloat16, float, double})" + bound.
std::string FloatTypeListAttr(const std::string& name, const char* bound);
// An attr row as TF's Attr() text: "name: type = default".
std::string ApplyAttrSpec(const ApplyAttrDef& a, bool ref_op);

// The rule of an apply op by its name (TfclipClipApply<Op> or TfclipClipApplyRef<Op>), nullptr
// if none; *ref_op: whether it is the ref op.
const RuleInfo* FindApplyRule(const std::string& op, bool* ref_op);

}  // namespace tfclip
