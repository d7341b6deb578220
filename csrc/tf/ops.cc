// tfclip TF glue: op declarations (attrs, inputs, shape functions). Kernels live in kernels.cc.
//
// Every op takes its tensors as lists: one norm pass and one apply pass cover the whole list,
// whatever its length. Hyper-parameters are scalar tensors (double), so schedules and
// tf.Variables work; the Python layer (tfclip/ops.py) casts them.
#include "csrc/core/types.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfclip {
namespace {

using ::tensorflow::shape_inference::InferenceContext;

// "half, bfloat16, float, double" from the one dtype list.
#define TFCLIP_ATTR_NAME(E, S, M, N) N ", "
constexpr char kTypeList[] = TFCLIP_FOR_EACH_TYPE(TFCLIP_ATTR_NAME);
#undef TFCLIP_ATTR_NAME

std::string TypeAttr(const char* name, const char* suffix) {
  std::string list(kTypeList);
  list.resize(list.size() - 2);  // drop the trailing ", "
  return std::string(name) + ": list({" + list + "})" + suffix;
}

absl::Status ScalarOutputs(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Scalar());
  return absl::OkStatus();
}

// clipped[i] has the shape of t[i]; the norm is a scalar.
absl::Status ClipShapes(InferenceContext* c) {
  std::vector<::tensorflow::shape_inference::ShapeHandle> shapes;
  TF_RETURN_IF_ERROR(c->input("t", &shapes));
  TF_RETURN_IF_ERROR(c->set_output("clipped", shapes));
  std::vector<::tensorflow::shape_inference::ShapeHandle> norm{c->Scalar()};
  return c->set_output("norm", norm);
}

}  // namespace

// Global L2 norm of a list of tensors (tf.linalg.global_norm), fp64-accumulated, deterministic.
REGISTER_OP("TfclipGlobalNorm")
    .Input("t: T")
    .Output("norm: Tnorm")
    .Attr(TypeAttr("T", " >= 1"))
    .Attr("Tnorm: {float, double} = DT_FLOAT")
    .SetShapeFn(ScalarOutputs);

// tf.clip_by_global_norm in two passes: norm (unless use_given_norm), then t * scale.
REGISTER_OP("TfclipClipByGlobalNorm")
    .Input("t: T")
    .Input("clip_norm: Tnorm")
    .Input("use_norm: Tnorm")
    .Output("clipped: T")
    .Output("norm: Tnorm")
    .Attr(TypeAttr("T", " >= 1"))
    .Attr("Tnorm: {float, double} = DT_FLOAT")
    .Attr("use_given_norm: bool = false")
    .SetShapeFn(ClipShapes);

// Clip-and-apply ops: N resource variables updated in place from N gradients (same shapes; any
// float dtype: a gradient is clipped in its own dtype, then cast to its variable's as Keras does), with
// the rule's slots as further lists of N resources. Outputs the pre-clip global norm and
// whether the update was applied (false only when nonfinite='skip' met a non-finite norm).
// IndexedSlices gradients: `sparse` lists their positions in `grad` (ascending); for each,
// grad holds the slices (`.values`, shape [k] + var.shape[1:]) and `indices` one int32/int64
// vector of k rows. `lazy`: only touched rows (and their slots) update; else stock Keras
// semantics (slots decay on every row). `sum_of_squares`: duplicate rows feed Adam's v the sum
// of their squares (stock Keras on raw IndexedSlices), not the square of their sum (the dense
// result). See csrc/core/sparse.h.
// Each resource list may hold one handle per tensor or pack them into vectors (see kernels.cc:
// an eager caller packs a repeated step's lists once); its handles, in order, are the lists'.
// `iterations`: none, or an int64 scalar variable counting applied steps, read and advanced
// under the step's locks (Adam's t is then iterations + `step`); the CPU kernels only.
#define TFCLIP_APPLY_COMMON                                           \
  Input("indices: Tindices")                                          \
      .Input("clip: double")                                          \
      .Input("use_norm: double")                                      \
      .Input("iterations: Niterations * resource")                    \
      .Output("global_norm: float")                                   \
      .Output("applied: bool")                                        \
      .Attr("N: int >= 1")                                            \
      .Attr("Niterations: int >= 0 = 0")                              \
      .Attr(TypeAttr("Tgrad", " >= 1"))                               \
      .Attr("clip_mode: {'none', 'global_norm', 'norm', 'value'} = 'none'") \
      .Attr("nonfinite: {'skip', 'propagate', 'raise'} = 'skip'")    \
      .Attr("use_given_norm: bool = false")                           \
      .Attr("Tindices: list({int32, int64}) >= 0")                    \
      .Attr("sparse: list(int) = []")                                 \
      .Attr("lazy: bool = false")                                     \
      .Attr("sum_of_squares: bool = false")                           \
      .SetShapeFn(ScalarOutputs)

// var -= lr * g  (ResourceApplyGradientDescent, keras SGD without momentum)
REGISTER_OP("TfclipClipApplySgd")
    .Input("var: N * resource")
    .Input("grad: Tgrad")
    .Input("lr: double")
    .Input("weight_decay: double")
    .TFCLIP_APPLY_COMMON;

// Both momentum forms take the same inputs; only the rule differs.
#define TFCLIP_MOMENTUM_INPUTS          \
  Input("var: N * resource")            \
      .Input("accum: N * resource")     \
      .Input("grad: Tgrad")             \
      .Input("lr: double")              \
      .Input("momentum: double")        \
      .Input("weight_decay: double")    \
      .Attr("use_nesterov: bool = false")

// tf.compat.v1 MomentumOptimizer form (ResourceApplyMomentum).
REGISTER_OP("TfclipClipApplyMomentum").TFCLIP_MOMENTUM_INPUTS.TFCLIP_APPLY_COMMON;

// Keras SGD(momentum, nesterov) form (ResourceApplyKerasMomentum).
REGISTER_OP("TfclipClipApplyKerasMomentum").TFCLIP_MOMENTUM_INPUTS.TFCLIP_APPLY_COMMON;

#undef TFCLIP_MOMENTUM_INPUTS

// Adam / AdamW (weight_decay > 0: decoupled) / AMSGrad (vhat has N entries, else none).
// Bias correction from t = `step` (1-based), or iterations + `step` when `iterations` is given,
// as Keras: alpha = lr*sqrt(1-b2^t)/(1-b1^t). `beta_powers`, when given, is [b1^t, b2^t] itself
// (TF1 AdamOptimizer's running beta1_power / beta2_power accumulators), and `step` is unused.
REGISTER_OP("TfclipClipApplyAdam")
    .Input("var: N * resource")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("vhat: Nvhat * resource")
    .Input("grad: Tgrad")
    .Input("lr: double")
    .Input("beta_1: double")
    .Input("beta_2: double")
    .Input("epsilon: double")
    .Input("weight_decay: double")
    .Input("step: double")
    .Input("beta_powers: Npowers * double")
    .Attr("Nvhat: int >= 0")
    .Attr("Npowers: int >= 0 = 0")
    .Attr("amsgrad: bool = false")
    .TFCLIP_APPLY_COMMON;

#undef TFCLIP_APPLY_COMMON

}  // namespace tfclip
