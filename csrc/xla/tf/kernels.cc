// tfclip XLA glue: the XLA kernels (XlaOpKernel) of every tfclip op, for the XLA CPU and GPU JIT
// devices. Each validates what the graph shows (shapes, dtypes, variables), reads the
// variables, emits typed-FFI custom calls (legacy ones on TF 2.16: legacy_call.h) into the core
// drivers (ffi_handlers.cc; operand order in custom_calls.h) with each variable operand aliased
// to its result (updated in place: no copy), and writes the variables back. The apply ops are
// registered from the rule table.
//
// The kernels are registered for the JIT device types directly (not with REGISTER_XLA_OP, whose
// registry is read once, at the first XLA compilation in the process: a library loaded after it
// would be silently ignored).
//
// An apply op is one norm call over every gradient (the global norm, the per-tensor norms, and
// the IndexedSlices indices checked), then apply calls over groups of kGroupVars variables, each
// given that norm as its use_norm: the same bits as the one-call op (the norm's chunk sums are
// per tensor, reduced in the same order), the same non-finite decision in every group, and every
// error that a group could meet (hyper-parameters, clip, the norm under nonfinite='raise') met by
// every group before it writes anything. IndexedSlices gradients go to the core as rows (values
// and int64 indices), as in the TF kernel: the same update, lazy and sum_of_squares included.
// On the GPU JIT device the indices stay in device memory, where the core cannot plan rows: the
// kernel densifies them with an XLA scatter-add (the norm still of `.values`, as TF's), which is
// the op's update for a non-lazy step without sum_of_squares (duplicate rows summed first, in an
// order XLA picks: the last bit may differ with duplicates); lazy or sum_of_squares steps are an
// error there that says so, and an out-of-range index is dropped, as XLA's scatter drops it
// (the op reports it). TFCLIP_XLA_DENSIFY_SPARSE=1 takes this path on CPU too (for tests).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/core/apply_op.h"
#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"
#include "csrc/core/clip.h"
#include "csrc/core/rule_table.h"
#include "csrc/tf/apply_op_attrs.h"
#include "csrc/xla/ffi/custom_calls.h"
#include "csrc/xla/ffi/legacy_call.h"
#include "csrc/xla/tf/builder_compat.h"
#include "tensorflow/compiler/tf2xla/type_util.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/kernel_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/shape_util.h"

namespace tfclip {
namespace {

namespace tf = ::tensorflow;
using tf::XlaOpKernel;
using tf::XlaOpKernelContext;
using xla_glue::kGroupVars;

std::vector<int64_t> ShapeDims(const tf::TensorShape& s) {
  std::vector<int64_t> d(static_cast<size_t>(s.dims()));
  for (int k = 0; k < s.dims(); ++k) d[static_cast<size_t>(k)] = s.dim_size(k);
  return d;
}

// A call's attributes: i64 scalars and arrays. For a typed-FFI call, the backend config: an MLIR
// dictionary; for a legacy one (TF 2.16), tokens of the opaque string (legacy_call.h).
class Attrs {
 public:
  Attrs& I64(const char* name, int64_t v) {
    Sep();
    s_ += std::string(name) + " = " + std::to_string(v) + " : i64";
    legacy_.push_back({name, /*array=*/false, {v}});
    return *this;
  }
  Attrs& I64s(const char* name, const std::vector<int64_t>& v) {
    Sep();
    s_ += std::string(name) + " = array<i64";
    for (size_t k = 0; k < v.size(); ++k) s_ += (k == 0 ? ": " : ", ") + std::to_string(v[k]);
    s_ += ">";
    legacy_.push_back({name, /*array=*/true, v});
    return *this;
  }
  std::string str() const { return "{" + s_ + "}"; }
  const std::vector<xla_glue::LegacyAttr>& legacy() const { return legacy_; }

 private:
  void Sep() {
    if (!s_.empty()) s_ += ", ";
  }
  std::string s_;
  std::vector<xla_glue::LegacyAttr> legacy_;
};

#if !TFCLIP_XLA_TYPED_FFI
xla_glue::LegacyShape ToLegacy(const xla::Shape& s) {
  xla_glue::LegacyShape out;
  out.dtype = static_cast<int64_t>(s.element_type());
  out.dims.assign(s.dimensions().begin(), s.dimensions().end());
  return out;
}
#endif

xla::XlaOp FfiCall(xla::XlaBuilder* b, const char* target, const std::vector<xla::XlaOp>& operands,
                   const xla::Shape& shape, const Attrs& attrs, bool side_effect,
                   const std::vector<std::pair<xla::ShapeIndex, std::pair<int64_t, xla::ShapeIndex>>>&
                       aliasing = {}) {
#if TFCLIP_XLA_TYPED_FFI
  return xla::CustomCall(b, target, operands, shape, attrs.str(), side_effect, aliasing,
                         /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                         xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
#else
  // TF 2.16: the legacy API, every shape and attribute in the opaque string (legacy_call.h).
  std::vector<xla_glue::LegacyShape> args, rets;
  for (const xla::XlaOp& op : operands) {
    absl::StatusOr<xla::Shape> s = b->GetShape(op);
    if (!s.ok()) return b->ReportError(s.status());
    args.push_back(ToLegacy(*s));
  }
  for (const xla::Shape& e : shape.tuple_shapes()) rets.push_back(ToLegacy(e));
  return xla::CustomCall(b, target, operands, shape, xla_glue::EncodeLegacyCall(args, rets, attrs.legacy()),
                         side_effect, aliasing, /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                         xla::CustomCallApiVersion::API_VERSION_STATUS_RETURNING_UNIFIED);
#endif
}

absl::Status NormPrimitive(tf::OpKernelConstruction* c, xla::PrimitiveType* out) {
  tf::DataType t;
  TF_RETURN_IF_ERROR(c->GetAttr("Tnorm", &t));
  return tf::DataTypeToPrimitiveType(t, out);
}

absl::StatusOr<xla::Shape> ShapeOf(xla::XlaBuilder* b, xla::XlaOp op) { return b->GetShape(op); }

// ---------------------------------------------------------------- TfclipGlobalNorm
class GlobalNormXla : public XlaOpKernel {
 public:
  explicit GlobalNormXla(tf::OpKernelConstruction* c) : XlaOpKernel(c) {
    OP_REQUIRES_OK(c, NormPrimitive(c, &nt_));
  }
  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<xla::XlaOp> t;
    std::vector<tf::TensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->InputList("t", &t, &shapes));
    const xla::PrimitiveType nt = nt_;
    const int64_t n = static_cast<int64_t>(t.size());
    const xla::Shape shape = xla::ShapeUtil::MakeTupleShape(
        {xla::ShapeUtil::MakeShape(xla::F64, {}), xla::ShapeUtil::MakeShape(nt, {}),
         xla::ShapeUtil::MakeShape(nt, {n})});
    const xla::XlaOp call = FfiCall(ctx->builder(), xla_glue::kNormTarget, t, shape,
                                    Attrs().I64s("sparse", {}).I64s("rows", {}).I64s("widths", {}).I64("f64_norm", 0),
                                    /*side_effect=*/false);
    ctx->SetOutput(0, xla::GetTupleElement(call, 1));
    ctx->SetOutput(1, xla::GetTupleElement(call, 2));
  }

 private:
  xla::PrimitiveType nt_ = xla::F32;
};

// ---------------------------------------------------------------- TfclipClipByGlobalNorm
class ClipByGlobalNormXla : public XlaOpKernel {
 public:
  explicit ClipByGlobalNormXla(tf::OpKernelConstruction* c) : XlaOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("use_given_norm", &use_given_norm_));
    OP_REQUIRES_OK(c, NormPrimitive(c, &nt_));
  }
  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<xla::XlaOp> ops;
    std::vector<tf::TensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->InputList("t", &ops, &shapes));
    const xla::PrimitiveType nt = nt_;
    xla::XlaBuilder* b = ctx->builder();
    const int n = static_cast<int>(ops.size());
    std::vector<xla::Shape> outs;
    for (const xla::XlaOp& op : ops) {
      auto s = ShapeOf(b, op);
      OP_REQUIRES_OK(ctx, s.status());
      outs.push_back(*s);
    }
    outs.push_back(xla::ShapeUtil::MakeShape(nt, {}));
    outs.push_back(xla::ShapeUtil::MakeShape(nt, {n}));
    ops.push_back(ctx->Input("clip_norm"));
    ops.push_back(ctx->Input("use_norm"));
    // Side effect: a bad clip_norm is an error the call reports, which XLA must not drop.
    const xla::XlaOp call =
        FfiCall(b, xla_glue::kClipTarget, ops, xla::ShapeUtil::MakeTupleShape(outs),
                Attrs().I64("use_given_norm", use_given_norm_ ? 1 : 0), /*side_effect=*/true);
    for (int i = 0; i < n + 2; ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  bool use_given_norm_ = false;
  xla::PrimitiveType nt_ = xla::F32;
};

// ---------------------------------------------------------------- TfclipClipApply<Op>
class ClipApplyXla : public XlaOpKernel {
 public:
  explicit ClipApplyXla(tf::OpKernelConstruction* c) : XlaOpKernel(c) {
    const std::string& op = c->def().op();
    bool ref_op = false;
    const RuleInfo* info = FindApplyRule(op, &ref_op);
    OP_REQUIRES(c, info != nullptr && !ref_op, tf::errors::Internal("no rule for op ", op));
    rule_ = *info;
    slots_ = rule_.slots();
    // The common attrs, as the TF kernel reads them (csrc/tf/apply_op_attrs.h), checked.
    ApplyOpAttrs attrs;
    OP_REQUIRES_OK(c, ReadApplyOpAttrs(c, rule_, /*ref_op=*/false, &attrs));
    n_ = attrs.num_grads;
    cfg_ = attrs.Clip();
    lazy_ = attrs.lazy;
    sum_of_squares_ = attrs.sum_of_squares;
    has_iterations_ = attrs.num_iterations > 0;
    num_absmax_ = attrs.num_absmax;
    has_grad_scale_ = attrs.num_grad_scale > 0;
    has_rounding_ = attrs.num_rounding > 0;
    for (const int32_t o : attrs.var_offsets) {
      OP_REQUIRES(c, o < 0, tf::errors::Unimplemented(
                                "var_offsets (a range of a variable: a share of a variable split across replicas) "
                                "is not compiled by XLA; step outside jit_compile=True"));
    }
    const std::vector<int32_t>& sparse = attrs.sparse;
    sparse_of_.assign(static_cast<size_t>(n_), -1);
    for (size_t k = 0; k < sparse.size(); ++k) sparse_of_[sparse[k]] = static_cast<int>(k);
    flags_ = attrs.flags;
    HParams hp;
    for (int k = 0; k < kNumFlags; ++k) {
      if ((flags_ >> k) & 1) hp.SetFlag(static_cast<Flag>(k), true);
    }
    nslots_ = NumSlots(rule_.kind, hp);
    const char* env = std::getenv("TFCLIP_XLA_DENSIFY_SPARSE");
    densify_ = c->device_type() == tf::DeviceType(tf::DEVICE_GPU_XLA_JIT) ||
               (env != nullptr && std::string(env) == "1");
    OP_REQUIRES(c, !(densify_ && !sparse.empty() && (lazy_ || sum_of_squares_)),
                tf::errors::Unimplemented(
                    "tfclip's XLA kernel on GPU densifies IndexedSlices gradients (grads[",
                    sparse.empty() ? 0 : sparse[0], "]), which cannot give ",
                    lazy_ ? "lazy_sparse's row-only update" : "sum_of_squares (stock Keras's v from "
                    "a duplicated row's summed squares)", "; run this step without jit_compile"));
  }

  // A step's XLA: its operands read and checked, the norm call where the step needs one, then one
  // apply call per group of variables, each writing its variables back (in place), then the
  // outputs. Each part is a function below, in that order; any error leaves nothing written.
  void Compile(XlaOpKernelContext* ctx) override {
    xla::XlaBuilder* b = ctx->builder();
    Step st;
    OP_REQUIRES_OK(ctx, ReadState(ctx, &st));
    OP_REQUIRES_OK(ctx, ReadAbsmax(ctx, &st));
    OP_REQUIRES_OK(ctx, ReadGrads(ctx, b, &st));
    OP_REQUIRES_OK(ctx, BuildScalars(ctx, b, &st));
    OP_REQUIRES_OK(ctx, ReadCounter(ctx, &st));
    // The groups: each a call with its variables and slots aliased to its results; at most
    // kGroupVars variables, consecutive, all with int8 state or none (an int8 group's calls carry
    // the absmax lists after the codes': custom_calls.h), so the outputs stay in variable order.
    for (int g0 = 0, gn = 0; g0 < n_; g0 += gn) {
      const bool q8 = st.q8_of[g0] >= 0;
      gn = 1;
      while (g0 + gn < n_ && gn < kGroupVars && (st.q8_of[g0 + gn] >= 0) == q8) ++gn;
      OP_REQUIRES_OK(ctx, ApplyGroup(ctx, b, g0, gn, &st));
    }
    SetNormOutputs(ctx, b, st);
  }

 private:
  // What the parts of a step share: the variables' and state lists' inputs, the gradients, the
  // scalars every group's call takes, the norm call's results, the groups' outputs.
  struct Step {
    std::vector<int> index;  // input index of vars[i] (k * n + i: slot list k - 1)
    std::vector<tf::DataType> types;
    std::vector<tf::TensorShape> shapes;
    std::vector<xla::XlaOp> values;
    std::vector<int> q8_of;  // per variable: its rank among those with int8 state, or -1
    int nq = 0;
    std::vector<int> aindex;             // the absmax inputs, slot-major
    std::vector<xla::XlaOp> avalues;     // avalues[k * nq + q]: slot k's absmax of the q-th int8 variable
    std::vector<xla::XlaOp> grads, indices;
    std::vector<tf::TensorShape> gshapes, ishapes;
    std::vector<xla::XlaOp> dense;  // what the groups apply: densified on GPU
    std::vector<int64_t> sparse, rows, widths;
    xla::XlaOp norm_call, grad_scale, scalar_vec, counter;
    int counter_index = -1;
    std::vector<xla::XlaOp> group_norms, group_clipped;
  };

  // The variables and slot lists: their inputs, dtypes, shapes and values, each slot checked
  // against its variable (Adafactor's factored shapes; a float variable's narrow state).
  absl::Status ReadState(XlaOpKernelContext* ctx, Step* st) {
    TF_RETURN_IF_ERROR(ReadList(ctx, "var", "vars", &st->index, &st->types, &st->shapes, &st->values));
    int used = 0;
    for (const std::string& s : slots_) {
      int start, stop;
      TF_RETURN_IF_ERROR(InputRange(s, &start, &stop));
      if (stop == start) continue;
      if (used >= nslots_) {
        return tf::errors::InvalidArgument("got ", stop - start, " ", s, " slots, but with these flags rule '",
                                           rule_.name, "' takes ", nslots_, " slot lists");
      }
      const size_t first = st->index.size();
      const bool factored = RuleFactored(rule_.kind);
      TF_RETURN_IF_ERROR(ReadList(ctx, s.c_str(), s.c_str(), &st->index, &st->types, &st->shapes, &st->values,
                                  /*codes=*/true, /*any_dtype=*/factored));
      for (int i = 0; i < n_; ++i) {
        TF_RETURN_IF_ERROR(CheckSlot(*st, s, used, first, i, factored));
      }
      ++used;
    }
    if (used != nslots_) {
      return tf::errors::InvalidArgument("with these flags rule '", rule_.name, "' takes ", nslots_,
                                         " slot lists, got ", used);
    }
    return absl::OkStatus();
  }

  // Slot list `s` (the `used`-th, from st.values[first]) at variable i.
  absl::Status CheckSlot(const Step& st, const std::string& s, int used, size_t first, int i, bool factored) {
    if (factored) {  // Adafactor's r, c, v (csrc/core/factored.h): a placeholder may be any dtype
      bool placeholder = false;
      const std::string e = FactoredSlotShape(used, ShapeDims(st.shapes[i]), ShapeDims(st.shapes[first + i]),
                                              &placeholder);
      if (!e.empty()) return tf::errors::InvalidArgument(s, "[", i, "] ", e);
      if (!placeholder && st.types[first + i] != st.types[i]) {
        return tf::errors::InvalidArgument(s, "[", i, "] is ", tf::DataTypeString(st.types[first + i]),
                                           " but vars[", i, "] is ", tf::DataTypeString(st.types[i]),
                                           "; Adafactor's state has its variable's dtype");
      }
      return absl::OkStatus();
    }
    // Its variable's dtype, or bfloat16 (bf16 state) or uint8 (int8 state's codes) for a float
    // variable's state (SlotStorage), as every slot of that variable (the handler checks the
    // storage against the variable's dtype).
    const tf::DataType t = st.types[first + i];
    const bool narrow_state = st.types[i] == tf::DT_FLOAT && (t == tf::DT_BFLOAT16 || t == tf::DT_UINT8);
    if (!((t == st.types[i] || narrow_state) && st.shapes[first + i] == st.shapes[i] &&
          (first == static_cast<size_t>(n_) || t == st.types[n_ + i]))) {
      return tf::errors::InvalidArgument(
          s, "[", i, "] is ", tf::DataTypeString(t), st.shapes[first + i].DebugString(), " but vars[", i, "] is ",
          tf::DataTypeString(st.types[i]), st.shapes[i].DebugString(),
          "; a slot must match its variable (its shape, and its dtype, or bfloat16 or "
          "uint8 for a float variable's state, the same for all its slots)");
    }
    return absl::OkStatus();
  }

  // int8 state (uint8 slots): each such variable's absmax variables, slot-major (apply_op.h).
  absl::Status ReadAbsmax(XlaOpKernelContext* ctx, Step* st) {
    st->q8_of.assign(static_cast<size_t>(n_), -1);
    for (int i = 0; i < n_ && nslots_ > 0; ++i) {
      if (st->types[static_cast<size_t>(n_) + i] == tf::DT_UINT8) st->q8_of[i] = st->nq++;
    }
    if (num_absmax_ != st->nq * nslots_) {
      return tf::errors::InvalidArgument("got ", num_absmax_, " absmax variables for ", st->nq,
                                         " variables with int8 state (uint8 slots) and ", nslots_, " slots each");
    }
    if (num_absmax_ == 0) return absl::OkStatus();
    int start, stop;
    TF_RETURN_IF_ERROR(InputRange("absmax", &start, &stop));
    if (stop - start != num_absmax_) {
      return tf::errors::InvalidArgument("under XLA (jit_compile) each absmax variable needs its own "
                                         "resource input (handles packed into vectors are for eager calls)");
    }
    for (int k = 0; k < nslots_; ++k) {
      for (int i = 0; i < n_; ++i) {
        if (st->q8_of[i] < 0) continue;
        const int in = start + k * st->nq + st->q8_of[i];
        tf::DataType t;
        tf::TensorShape sh;
        TF_RETURN_IF_ERROR(ctx->GetVariableTypeAndShape(in, &t, &sh));
        const int64_t blocks = QuantBlocks(st->shapes[i].num_elements());
        if (!(t == tf::DT_FLOAT && sh.dims() == 1 && sh.dim_size(0) == blocks)) {
          return tf::errors::InvalidArgument("absmax ", k * st->nq + st->q8_of[i], " is ", tf::DataTypeString(t),
                                             sh.DebugString(), "; the absmax of ", slots_[k], "[", i,
                                             "] must be float32[", blocks, "]");
        }
        xla::XlaOp v;
        TF_RETURN_IF_ERROR(ctx->ReadVariableInput(in, t, &sh, &v));
        st->aindex.push_back(in);
        st->avalues.push_back(v);
      }
    }
    return absl::OkStatus();
  }

  // The gradients, each IndexedSlices checked (and densified on GPU, else its rows and widths).
  absl::Status ReadGrads(XlaOpKernelContext* ctx, xla::XlaBuilder* b, Step* st) {
    TF_RETURN_IF_ERROR(ctx->InputList("grad", &st->grads, &st->gshapes));
    TF_RETURN_IF_ERROR(ctx->InputList("indices", &st->indices, &st->ishapes));
    if (static_cast<int>(st->indices.size()) != NumSparse()) {
      return tf::errors::InvalidArgument("got ", st->indices.size(), " index vectors for ", NumSparse(),
                                         " sparse gradients");
    }
    st->dense = st->grads;
    for (int i = 0; i < n_; ++i) {
      const int k = sparse_of_[i];
      if (k >= 0) {
        TF_RETURN_IF_ERROR(CheckSparse(i, st->shapes[i], st->gshapes[i], st->ishapes[k]));
        st->indices[k] = xla::ConvertElementType(st->indices[k], xla::S64);
        if (densify_) {
          st->dense[i] = Densify(b, st->grads[i], st->indices[k], st->shapes[i], st->ishapes[k].dim_size(0));
          continue;
        }
        st->sparse.push_back(i);
        st->rows.push_back(st->shapes[i].dim_size(0));
        tf::TensorShape row = st->shapes[i];
        row.RemoveDim(0);
        st->widths.push_back(row.num_elements());
      } else if (st->gshapes[i] != st->shapes[i]) {
        return tf::errors::InvalidArgument("grads[", i, "] has shape ", st->gshapes[i].DebugString(),
                                           " but vars[", i, "] has shape ", st->shapes[i].DebugString());
      }
    }
    return absl::OkStatus();
  }

  // The scalars every group's call takes (custom_calls.h): the rule's hyper-parameters in HP
  // order, clip, use_norm (the given one, or the norm call's, made here), then grad_scale and
  // stochastic rounding's seed and step where the op has them.
  absl::Status BuildScalars(XlaOpKernelContext* ctx, xla::XlaBuilder* b, Step* st) {
    std::vector<xla::XlaOp> scalars;
    for (int k = 0; k < kNumHParams; ++k) {
      if ((rule_.hparams >> k) & 1u) {
        scalars.push_back(xla::Reshape(ctx->Input(GetHParamInfo(static_cast<HP>(k)).input), {1}));
      }
    }
    scalars.push_back(xla::Reshape(ctx->Input("clip"), {1}));
    const bool norm_call_made = !cfg_.has_use_norm || !st->sparse.empty();
    if (norm_call_made) {
      std::vector<xla::XlaOp> ops = st->grads;  // (IndexedSlices: their values, as TF's norm)
      for (int64_t i : st->sparse) ops.push_back(st->indices[sparse_of_[i]]);
      st->norm_call = FfiCall(
          b, xla_glue::kNormTarget, ops,
          xla::ShapeUtil::MakeTupleShape({xla::ShapeUtil::MakeShape(xla::F64, {}),
                                          xla::ShapeUtil::MakeShape(xla::F32, {}),
                                          xla::ShapeUtil::MakeShape(xla::F32, {n_})}),
          Attrs().I64s("sparse", st->sparse).I64s("rows", st->rows).I64s("widths", st->widths).I64("f64_norm", 1),
          /*side_effect=*/!st->sparse.empty());
    }
    xla::XlaOp use_norm = cfg_.has_use_norm ? ctx->Input("use_norm") : xla::GetTupleElement(st->norm_call, 0);
    if (cfg_.has_use_norm && norm_call_made) {
      // The norm call only checks the indices here: every group waits for it all the same, so a
      // bad index fails the step before any group writes.
      use_norm = xla::GetTupleElement(
          xla::OptimizationBarrier(xla::Tuple(b, {use_norm, xla::GetTupleElement(st->norm_call, 0)})), 0);
    }
    scalars.push_back(xla::Reshape(use_norm, {1}));
    if (has_grad_scale_) {  // (last: a call without it keeps the layout; custom_calls.h)
      int start, stop;
      TF_RETURN_IF_ERROR(InputRange("grad_scale", &start, &stop));
      st->grad_scale = ctx->Input(start);
      scalars.push_back(xla::Reshape(st->grad_scale, {1}));
    }
    if (has_rounding_) {
      // Stochastic rounding's seed and step, then each group call's first variable (its
      // tensors' positions in the op: the same bits as one op call), after a grad_scale (1
      // where the op has none): the scalars are h + 6 long (custom_calls.h).
      if (!has_grad_scale_) scalars.push_back(xla::ConstantR1<double>(b, {1.0}));
      int start, stop;
      TF_RETURN_IF_ERROR(InputRange("rounding", &start, &stop));
      for (int k = 0; k < 2; ++k) {  // (as the TF kernel: scalars)
        if (!tf::TensorShapeUtils::IsScalar(ctx->InputShape(start + k))) {
          return tf::errors::InvalidArgument("rounding's ", k == 0 ? "seed" : "step", " must be a scalar, got shape ",
                                             ctx->InputShape(start + k).DebugString());
        }
        scalars.push_back(xla::Reshape(ctx->Input(start + k), {1}));
      }
    }
    st->scalar_vec = xla::ConcatInDim(b, scalars, 0);
    return absl::OkStatus();
  }

  // The step counter (`iterations`), where the op owns it.
  absl::Status ReadCounter(XlaOpKernelContext* ctx, Step* st) {
    if (!has_iterations_) return absl::OkStatus();
    int start, stop;
    TF_RETURN_IF_ERROR(InputRange("iterations", &start, &stop));
    st->counter_index = start;
    tf::DataType t;
    tf::TensorShape sh;
    TF_RETURN_IF_ERROR(ctx->GetVariableTypeAndShape(start, &t, &sh));
    if (!(t == tf::DT_INT64 && sh.dims() == 0)) {
      return tf::errors::InvalidArgument("iterations must be an int64 scalar variable, got ",
                                         tf::DataTypeString(t), sh.DebugString());
    }
    return ctx->ReadVariableInput(start, tf::DT_INT64, nullptr, &st->counter);
  }

  // One group's apply call over variables [g0, g0 + gn): its operands (the state lists aliased
  // to its results), its attributes, the results written back to the variables; the first group
  // gives the op's norm, applied and counter.
  absl::Status ApplyGroup(XlaOpKernelContext* ctx, xla::XlaBuilder* b, int g0, int gn, Step* st) {
    const bool q8 = st->q8_of[g0] >= 0;
    const int lists = nslots_ + 1 + (q8 ? nslots_ : 0);
    // List l's i-th variable: values (vars, then the slot lists), then the absmax.
    auto value_at = [&](int l, int i) -> xla::XlaOp {
      if (l <= nslots_) return st->values[static_cast<size_t>(l) * n_ + i];
      return st->avalues[static_cast<size_t>(l - nslots_ - 1) * st->nq + st->q8_of[i]];
    };
    std::vector<xla::XlaOp> ops;
    std::vector<xla::Shape> outs;
    std::vector<std::pair<xla::ShapeIndex, std::pair<int64_t, xla::ShapeIndex>>> alias;
    for (int l = 0; l < lists; ++l) {
      for (int i = g0; i < g0 + gn; ++i) {
        const xla::XlaOp v = value_at(l, i);
        auto s = ShapeOf(b, v);
        TF_RETURN_IF_ERROR(s.status());
        alias.push_back({xla::ShapeIndex{static_cast<int64_t>(ops.size())},
                         {static_cast<int64_t>(ops.size()), xla::ShapeIndex{}}});
        ops.push_back(v);
        outs.push_back(*s);
      }
    }
    std::vector<int64_t> group_sparse;
    for (int i = g0; i < g0 + gn; ++i) ops.push_back(st->dense[i]);
    for (int i = g0; i < g0 + gn; ++i) {
      if (sparse_of_[i] >= 0 && !densify_) {
        ops.push_back(st->indices[sparse_of_[i]]);
        group_sparse.push_back(i - g0);
      }
    }
    ops.push_back(has_rounding_ ? xla::ConcatInDim(b, {st->scalar_vec, xla::ConstantR1<double>(b, {double(g0)})}, 0)
                                : st->scalar_vec);
    if (has_iterations_) {
      // Group 0's advanced counter is the variable's new value: aliased to the counter operand
      // (in place; XLA copies the count first where later groups still read it).
      if (g0 == 0) {
        alias.push_back({xla::ShapeIndex{static_cast<int64_t>(outs.size()) + 4},
                         {static_cast<int64_t>(ops.size()), xla::ShapeIndex{}}});
      }
      ops.push_back(st->counter);
    }
    outs.push_back(xla::ShapeUtil::MakeShape(xla::PRED, {}));
    outs.push_back(xla::ShapeUtil::MakeShape(xla::F32, {}));
    outs.push_back(xla::ShapeUtil::MakeShape(xla::F32, {gn}));
    outs.push_back(xla::ShapeUtil::MakeShape(xla::S64, {gn}));  // clipped_units
    if (has_iterations_) outs.push_back(xla::ShapeUtil::MakeShape(xla::S64, {}));
    const xla::XlaOp call = FfiCall(b, xla_glue::kApplyTarget, ops, xla::ShapeUtil::MakeTupleShape(outs),
                                    GroupAttrs(lists, group_sparse), /*side_effect=*/true, alias);
    const int64_t r0 = static_cast<int64_t>(lists) * gn;
    for (int l = 0; l < lists; ++l) {
      for (int i = g0; i < g0 + gn; ++i) {
        const xla::XlaOp r = xla::GetTupleElement(call, l * gn + (i - g0));
        if (l <= nslots_) {
          const size_t j = static_cast<size_t>(l) * n_ + i;
          TF_RETURN_IF_ERROR(ctx->AssignVariable(st->index[j], st->types[j], r));
        } else {
          TF_RETURN_IF_ERROR(ctx->AssignVariable(
              st->aindex[static_cast<size_t>(l - nslots_ - 1) * st->nq + st->q8_of[i]], tf::DT_FLOAT, r));
        }
      }
    }
    if (g0 == 0) {
      ctx->SetOutput(kApplyOutGlobalNorm, xla::GetTupleElement(call, r0 + 1));
      ctx->SetOutput(kApplyOutApplied, xla::GetTupleElement(call, r0));
      if (has_iterations_) {
        TF_RETURN_IF_ERROR(ctx->AssignVariable(st->counter_index, tf::DT_INT64, xla::GetTupleElement(call, r0 + 4)));
      }
    }
    st->group_norms.push_back(xla::GetTupleElement(call, r0 + 2));
    st->group_clipped.push_back(xla::GetTupleElement(call, r0 + 3));
    return absl::OkStatus();
  }

  // A group call's attributes (custom_calls.h: a derived i64 wire format, not the op's attrs).
  Attrs GroupAttrs(int lists, const std::vector<int64_t>& group_sparse) const {
    int64_t eps_bits = 0;
    std::memcpy(&eps_bits, &cfg_.agc_eps, sizeof(eps_bits));
    Attrs attrs;
    attrs.I64("rule", static_cast<int64_t>(rule_.kind))
        .I64("flags", flags_)
        .I64("mode", static_cast<int64_t>(cfg_.mode))
        .I64("agc_eps_bits", eps_bits)  // the double's bits (i64 attrs only)
        .I64("policy", static_cast<int64_t>(cfg_.policy))
        .I64("has_use_norm", 1)
        .I64("lazy", lazy_ ? 1 : 0)
        .I64("sum_of_squares", sum_of_squares_ ? 1 : 0)
        .I64("nslots", lists - 1)  // the state lists: slots, then (int8 state) their absmax
        .I64("has_iterations", has_iterations_ ? 1 : 0)
        .I64s("sparse", group_sparse);
    return attrs;
  }

  // Each gradient's norm: the norm call's, or (use_norm given) what each group's step wrote
  // (NaN, or its own norms where clipnorm needs them). The norm call's are of the gradients as
  // given: times grad_scale, as the step's own. Then each variable's count of AGC's clipped
  // units, the groups' in order.
  void SetNormOutputs(XlaOpKernelContext* ctx, xla::XlaBuilder* b, const Step& st) {
    xla::XlaOp norms = cfg_.has_use_norm ? xla::ConcatInDim(b, st.group_norms, 0) : xla::GetTupleElement(st.norm_call, 2);
    if (has_grad_scale_ && !cfg_.has_use_norm) {
      norms = xla::ConvertElementType(xla::Mul(xla::ConvertElementType(norms, xla::F64), st.grad_scale), xla::F32);
    }
    ctx->SetOutput(kApplyOutTensorNorms, norms);
    ctx->SetOutput(kApplyOutClippedUnits, xla::ConcatInDim(b, st.group_clipped, 0));
  }

  int NumSparse() const {
    return static_cast<int>(std::count_if(sparse_of_.begin(), sparse_of_.end(), [](int k) { return k >= 0; }));
  }

  // Reads the n_ variables of resource list `input`, appending their input indices, dtypes,
  // shapes and values; `what` names them in errors.
  absl::Status ReadList(XlaOpKernelContext* ctx, const char* input, const char* what,
                        std::vector<int>* index, std::vector<tf::DataType>* types,
                        std::vector<tf::TensorShape>* shapes, std::vector<xla::XlaOp>* values,
                        bool codes = false, bool any_dtype = false) {
    int start, stop;
    TF_RETURN_IF_ERROR(InputRange(input, &start, &stop));
    if (stop - start != n_) {
      return tf::errors::InvalidArgument(
          "under XLA (jit_compile) each of the ", n_, " ", what, " needs its own resource input; got ",
          stop - start, " (handles packed into vectors are for eager calls)");
    }
    for (int i = 0; i < n_; ++i) {
      tf::DataType t;
      tf::TensorShape sh;
      TF_RETURN_IF_ERROR(ctx->GetVariableTypeAndShape(start + i, &t, &sh));
      if (t == tf::DT_INVALID) {
        return tf::errors::FailedPrecondition(what, "[", i, "] is not initialized");
      }
      if (t != tf::DT_HALF && t != tf::DT_BFLOAT16 && t != tf::DT_FLOAT && t != tf::DT_DOUBLE &&
          !(codes && t == tf::DT_UINT8) && !any_dtype) {  // (any_dtype: Adafactor's placeholders)  // (a slot list: uint8 is int8 state's codes)
        return tf::errors::InvalidArgument(what, "[", i, "] has dtype ", tf::DataTypeString(t),
                                           "; only half, bfloat16, float and double variables");
      }
      xla::XlaOp v;
      TF_RETURN_IF_ERROR(ctx->ReadVariableInput(start + i, t, &sh, &v));
      index->push_back(start + i);
      types->push_back(t);
      shapes->push_back(sh);
      values->push_back(v);
    }
    return absl::OkStatus();
  }

  // An IndexedSlices gradient as the dense tensor it stands for: zeros of the variable's shape
  // (in the values' dtype) with each slice added at its row.
  static xla::XlaOp Densify(xla::XlaBuilder* b, xla::XlaOp values, xla::XlaOp rows64,
                            const tf::TensorShape& var, int64_t k) {
    const xla::PrimitiveType t = b->GetShape(values).value().element_type();
    const auto sizes = var.dim_sizes();  // (by value: one copy for both ends)
    const std::vector<int64_t> dims(sizes.begin(), sizes.end());
    xla::ScatterDimensionNumbers dn;
    for (int d = 1; d < var.dims(); ++d) dn.add_update_window_dims(d);
    dn.add_inserted_window_dims(0);
    dn.add_scatter_dims_to_operand_dims(0);
    dn.set_index_vector_dim(1);
    return xla::Scatter(xla::Broadcast(xla::Zero(b, t), dims), xla::Reshape(rows64, {k, 1}), values,
                        xla::CreateScalarAddComputation(t, b), dn);
  }

  static absl::Status CheckSparse(int i, const tf::TensorShape& var, const tf::TensorShape& values,
                                  const tf::TensorShape& idx) {
    const std::string g = absl::StrCat("grads[", i, "] (IndexedSlices)");
    if (var.dims() < 1) {
      return tf::errors::InvalidArgument(g, ": vars[", i, "] is a scalar; IndexedSlices need a "
                                         "variable of rank >= 1");
    }
    if (idx.dims() != 1) {
      return tf::errors::InvalidArgument(g, ": indices must be a vector, got shape ", idx.DebugString());
    }
    tf::TensorShape row = var;
    row.RemoveDim(0);
    tf::TensorShape want({idx.dim_size(0)});
    want.AppendShape(row);
    if (values != want) {
      return tf::errors::InvalidArgument(g, ": values have shape ", values.DebugString(), "; with ",
                                         idx.dim_size(0), " indices and vars[", i, "] of shape ",
                                         var.DebugString(), " they must be ", want.DebugString());
    }
    return absl::OkStatus();
  }

  RuleInfo rule_{};
  std::vector<std::string> slots_;
  int nslots_ = 0;
  int num_absmax_ = 0;  // int8 state's absmax variables (the absmax input, slot-major)
  bool has_grad_scale_ = false;  // the grad_scale input (ClipConfig::grad_scale)
  bool has_rounding_ = false;    // the rounding input (stochastic rounding's seed and step)
  int n_ = 0;
  int64_t flags_ = 0;
  ClipConfig cfg_;
  bool lazy_ = false;
  bool sum_of_squares_ = false;
  bool has_iterations_ = false;
  bool densify_ = false;  // IndexedSlices densified by XLA (GPU), not rows for the core
  std::vector<int> sparse_of_;
};

template <typename K>
tf::OpKernel* Create(tf::OpKernelConstruction* c) {
  return new K(c);
}

void Register(const std::string& op, const char* device, tf::OpKernel* (*create)(tf::OpKernelConstruction*)) {
  tf::kernel_factory::OpKernelRegistrar reg(
      tf::KernelDefBuilder(op.c_str()).Device(device).Build(), "TfclipXlaKernel", create);
}

bool RegisterXlaKernels() {
  std::vector<const char*> devices{tf::DEVICE_CPU_XLA_JIT};
#if TFCLIP_WITH_CUDA
  devices.push_back(tf::DEVICE_GPU_XLA_JIT);
#endif
  for (const char* d : devices) {
    Register("TfclipGlobalNorm", d, &Create<GlobalNormXla>);
    Register("TfclipClipByGlobalNorm", d, &Create<ClipByGlobalNormXla>);
    for (const RuleInfo& r : AllRules()) {
      Register(std::string(kApplyOpPrefix) + r.op, d, &Create<ClipApplyXla>);
    }
  }
  return true;
}
[[maybe_unused]] const bool kXlaKernelsRegistered = RegisterXlaKernels();

}  // namespace
}  // namespace tfclip
