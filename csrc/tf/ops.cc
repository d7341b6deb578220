// tfclip TF glue: op declarations (attrs, inputs, shape functions). Kernels live in kernels.cc
// (the norm ops) and apply_kernel.cc (the apply ops).
//
// Every op takes its tensors as lists: one norm pass and one apply pass cover the whole list,
// whatever its length. Hyper-parameters are scalar tensors (double), so schedules and
// tf.Variables work; the Python layer (tfclip/ops.py) casts them.
#include "csrc/core/apply_op.h"
#include "csrc/core/rule_table.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfclip {
namespace {

using ::tensorflow::shape_inference::InferenceContext;

// The global norm (output `norm`) a scalar, tensor_norms a vector of one norm per tensor of the
// input list `list`.
absl::Status NormShapes(InferenceContext* c, const char* list, const char* norm_name) {
  std::vector<::tensorflow::shape_inference::ShapeHandle> shapes;
  TF_RETURN_IF_ERROR(c->input(list, &shapes));
  std::vector<::tensorflow::shape_inference::ShapeHandle> norm{c->Scalar()};
  TF_RETURN_IF_ERROR(c->set_output(norm_name, norm));
  std::vector<::tensorflow::shape_inference::ShapeHandle> per{
      c->Vector(static_cast<int64_t>(shapes.size()))};
  return c->set_output("tensor_norms", per);
}

absl::Status GlobalNormShapes(InferenceContext* c) { return NormShapes(c, "t", "norm"); }

// clipped[i] has the shape of t[i]; the norm is a scalar, tensor_norms [N].
absl::Status ClipShapes(InferenceContext* c) {
  std::vector<::tensorflow::shape_inference::ShapeHandle> shapes;
  TF_RETURN_IF_ERROR(c->input("t", &shapes));
  TF_RETURN_IF_ERROR(c->set_output("clipped", shapes));
  return NormShapes(c, "t", "norm");
}

// The apply ops' outputs by their shape kind (csrc/core/apply_op.h): scalars, or one entry per
// gradient.
absl::Status ApplyShapes(InferenceContext* c) {
  std::vector<::tensorflow::shape_inference::ShapeHandle> grads;
  TF_RETURN_IF_ERROR(c->input("grad", &grads));
  for (const ApplyOutputDef& out : kApplyOutputs) {
    std::vector<::tensorflow::shape_inference::ShapeHandle> shape{
        out.shape == ApplyOutputShape::kScalar ? c->Scalar()
                                               : c->Vector(static_cast<int64_t>(grads.size()))};
    TF_RETURN_IF_ERROR(c->set_output(out.name, shape));
  }
  return absl::OkStatus();
}

}  // namespace

// Global L2 norm of a list of tensors (tf.linalg.global_norm), fp64-accumulated, deterministic;
// tensor_norms: each tensor's own norm, from the same pass (the same fp64 sums).
REGISTER_OP("TfclipGlobalNorm")
    .Input("t: T")
    .Output("norm: Tnorm")
    .Output("tensor_norms: Tnorm")
    .Attr(FloatTypeListAttr("T", " >= 1"))
    .Attr("Tnorm: {float, double} = DT_FLOAT")
    .SetShapeFn(GlobalNormShapes);

// The norm pass split across owners (sharded state, tfclip/_engine/shard.py): NormPartials gives
// each chunk's sum of squares (csrc/core/chunk_plan.h: a tensor's chunks start at its first
// element, so a tensor's partials are the same in any list); NormFromPartials adds a whole list's
// partials, in chunk order, as TfclipGlobalNorm adds them: the same bits, given every chunk.
REGISTER_OP("TfclipNormPartials")
    .Input("t: T")
    .Output("partials: double")
    .Attr(FloatTypeListAttr("T", " >= 1"))
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    });

// sizes: each tensor's element count, in the list's order (the chunk plan); partials: every
// chunk's, in that plan's order. norm: the global norm; tensor_norms: each tensor's.
REGISTER_OP("TfclipNormFromPartials")
    .Input("partials: double")
    .Output("norm: double")
    .Output("tensor_norms: double")
    .Attr("sizes: list(int) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle partials;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &partials));
      std::vector<int64_t> sizes;
      TF_RETURN_IF_ERROR(c->GetAttr("sizes", &sizes));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(static_cast<int64_t>(sizes.size())));
      return absl::OkStatus();
    });

// tf.clip_by_global_norm in two passes: norm (unless use_given_norm), then t * scale.
// tensor_norms: each input's pre-clip norm from the norm pass (NaN with use_given_norm).
REGISTER_OP("TfclipClipByGlobalNorm")
    .Input("t: T")
    .Input("clip_norm: Tnorm")
    .Input("use_norm: Tnorm")
    .Output("clipped: T")
    .Output("norm: Tnorm")
    .Output("tensor_norms: Tnorm")
    .Attr(FloatTypeListAttr("T", " >= 1"))
    .Attr("Tnorm: {float, double} = DT_FLOAT")
    .Attr("use_given_norm: bool = false")
    .SetShapeFn(ClipShapes);

// Clip-and-apply ops, one per row of the rule table (csrc/core/rule_table.h): TfclipClipApply<Op>.
// Their signature (inputs, outputs, attributes, in order) is written once, in
// csrc/core/apply_op.h; AddApplyOp below only walks it. What they mean:
// N resource variables updated in place from N gradients (same shapes; any float dtype: a
// gradient is clipped in its own dtype, then cast to its variable's as Keras does), with each of
// the rule's slots as a further list of resources (N of them, or none for a slot the step's flags
// leave unused, e.g. Adam's vhat without amsgrad), then the rule's hyper-parameters as scalar
// double inputs (csrc/core/hparams.h; on GPU read in device memory) and its flags as bool attrs.
// Outputs the pre-clip global norm and whether the update was applied (false when
// nonfinite='skip' met a non-finite norm, or a hyper-parameter read on the GPU is out of range),
// and tensor_norms: each gradient's pre-clip norm (IndexedSlices: its values'), summed by the same
// norm pass (no extra pass), written even for a skipped step; NaN when no norm pass ran
// (use_given_norm).
// clip_mode 'agc': adaptive gradient clipping, unit-wise (csrc/core/agc.h): `clip` is the clip
// factor lambda, `agc_eps` the floor of a unit's weight norm (a float attr: 1e-3 as float32);
// units are var.shape[-1] (the whole variable for rank <= 1); global_norm and tensor_norms stay
// the pre-clip norms. clipped_units (int64 [N], aligned with tensor_norms): each tensor's count
// of units AGC scaled down (scale != 1: ||g_u|| > clip * max(||w_u||, agc_eps), and every unit
// with a non-finite scale), 0 for every tensor in the other clip modes (and with clip 0).
// Written with tensor_norms, also for a skipped step (the counts the step would have clipped:
// a non-finite tensor's units all count); nothing is written on an error.
// IndexedSlices gradients: `sparse` lists their positions in `grad` (ascending); for each,
// grad holds the slices (`.values`, shape [k] + var.shape[1:]) and `indices` one int32/int64
// vector of k rows. `lazy`: only touched rows (and their slots) update; else stock Keras
// semantics (slots decay on every row). `sum_of_squares`: duplicate rows feed Adam's v the sum
// of their squares (stock Keras on raw IndexedSlices), not the square of their sum (the dense
// result). See csrc/core/sparse.h.
// Each resource list may hold one handle per tensor or pack them into vectors (see resources.h:
// an eager caller packs a repeated step's lists once); its handles, in order, are the lists'.
// `iterations`: none, or an int64 scalar variable counting applied steps, read and advanced
// under the step's locks (the rule's t is then iterations + `step`). `clip`: 0 is no clip.
// Adam: bias correction from t, as Keras: alpha = lr*sqrt(1-b2^t)/(1-b1^t); `beta_1_power` and
// `beta_2_power`, when not NaN, are b1^t and b2^t themselves (TF1 AdamOptimizer's accumulators).
//
// TfclipClipApplyRef<Op>: the same step for TF1 graphs, whose variables (tf.disable_v2_behavior(),
// use_resource=False) are ref variables. Each resource list keeps its place, any length (one
// handle a tensor), and is followed by a ref list, `<list>_ref: Ref(T<list>_ref)`: `ref` lists
// the gradient positions (ascending) whose variable is a ref; its slots are refs too (TF1 makes a
// ref variable's slots refs), the others' resources, so a var_list mixing both is one step (one
// norm pass). Refs are updated in place under their mutexes, locked with the resources' in one
// address order. A separate op: an op with a ref input has no eager wrapper in Python, and the
// resource op must keep its eager path. No XLA kernel: ref variables live only in TF1 graphs.
namespace {
// The signature from the description (csrc/core/apply_op.h): its inputs in order, a rule's slot
// lists (each with its count attr, and on the ref op its ref list) and hyper-parameters where
// the description places them; the rule's flags; its outputs; its attributes.
void AddApplyOp(const RuleInfo& r, bool with_refs) {
  namespace reg = ::tensorflow::register_op;
  const std::string name = std::string(with_refs ? kApplyRefOpPrefix : kApplyOpPrefix) + r.op;
  reg::OpDefBuilderWrapper w(name.c_str());
  for (const ApplyInputDef& in : kApplyInputs) {
    if (!ApplyOpHas(in.ops, with_refs)) continue;
    switch (in.kind) {
      case ApplyInputKind::kInput:
        w.Input(std::string(in.name) + ": " + in.type);
        if (in.attr != nullptr) w.Attr(FloatTypeListAttr(in.attr, in.attr_bound));
        break;
      case ApplyInputKind::kRuleSlots:
        for (const std::string& slot : r.slots()) {
          w.Input(slot + ": N_" + slot + " * resource");
          w.Attr("N_" + slot + ": int >= 0");
          if (with_refs) {
            w.Input(slot + "_ref: Ref(T" + slot + "_ref)").Attr(FloatTypeListAttr("T" + slot + "_ref", " >= 0"));
          }
        }
        break;
      case ApplyInputKind::kRuleHParams:
        for (int k = 0; k < kNumHParams; ++k) {
          if ((r.hparams >> k) & 1u) w.Input(std::string(GetHParamInfo(static_cast<HP>(k)).input) + ": double");
        }
        break;
    }
  }
  for (int k = 0; k < kNumFlags; ++k) {
    if ((r.flags >> k) & 1u) w.Attr(std::string(FlagAttr(static_cast<Flag>(k))) + ": bool = false");
  }
  for (const ApplyOutputDef& out : kApplyOutputs) w.Output(std::string(out.name) + ": " + out.type);
  for (const ApplyAttrDef& a : kApplyAttrs) {
    if (ApplyOpHas(a.ops, with_refs)) w.Attr(ApplyAttrSpec(a, with_refs));
  }
  w.SetShapeFn(ApplyShapes);
  w();
}

bool RegisterApplyOps() {
  for (const RuleInfo& r : AllRules()) {
    AddApplyOp(r, false);
    AddApplyOp(r, true);
  }
  return true;
}
[[maybe_unused]] const bool kApplyOpsRegistered = RegisterApplyOps();
}  // namespace

}  // namespace tfclip
