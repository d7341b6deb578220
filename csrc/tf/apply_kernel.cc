// tfclip TF glue: the clip-and-apply OpKernel, CPU and GPU, of TfclipClipApply<Op> and
// TfclipClipApplyRef<Op> (ops.cc), with its registrations: one kernel class for every rule of the
// rule table (csrc/core/rule_table.h). Compute() checks what only TF sees (shapes, dtypes, the
// IndexedSlices indices), looks up, locks and copies-on-write the variables (resources.h),
// allocates the outputs, and calls one core step: csrc/core/cpu/driver.h on CPU,
// csrc/core/cuda/driver.h on GPU (the op's stream, memory from TF's allocators: device.h).
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "csrc/core/apply_op.h"
#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"
#include "csrc/core/cpu/driver.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/validate.h"
#include "csrc/tf/apply_op_attrs.h"
#include "csrc/tf/device.h"
#include "csrc/tf/resources.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

#if TFCLIP_WITH_CUDA
#include "csrc/core/cuda/driver.h"
#endif

namespace tfclip {
namespace {

using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using namespace tf_glue;  // NOLINT(build/namespaces): the glue both kernel files share (device.h)

std::vector<int64_t> ShapeDims(const tf::TensorShape& s) {
  std::vector<int64_t> d(static_cast<size_t>(s.dims()));
  for (int k = 0; k < s.dims(); ++k) d[static_cast<size_t>(k)] = s.dim_size(k);
  return d;
}

// An IndexedSlices gradient of vars[i]: values [k] + var.shape[1:], indices [k] (int32 or
// int64, read as int64 here; their range is checked by PlanSparse before anything is written).
absl::Status CheckSparse(int i, const Tensor& var, const Tensor& values,
                         const Tensor& idx, std::vector<int64_t>* rows_out, ApplyTensor* t) {
  const std::string g = absl::StrCat("grads[", i, "] (IndexedSlices)");
  if (var.dims() < 1) {
    return tf::errors::InvalidArgument(g, ": vars[", i, "] is a scalar; IndexedSlices need a "
                                       "variable of rank >= 1");
  }
  if (!tf::TensorShapeUtils::IsVector(idx.shape())) {
    return tf::errors::InvalidArgument(g, ": indices must be a vector, got shape ",
                                       idx.shape().DebugString());
  }
  tf::TensorShape row_shape = var.shape();
  row_shape.RemoveDim(0);
  tf::TensorShape want({idx.NumElements()});
  want.AppendShape(row_shape);
  if (values.shape() != want) {
    return tf::errors::InvalidArgument(g, ": values have shape ", values.shape().DebugString(),
                                       "; with ", idx.NumElements(), " indices and vars[", i,
                                       "] of shape ", var.shape().DebugString(), " they must be ",
                                       want.DebugString());
  }
  std::vector<int64_t>& rows = *rows_out;
  rows.resize(static_cast<size_t>(idx.NumElements()));
  if (idx.dtype() == tf::DT_INT32) {
    const auto f = idx.flat<int32_t>();
    for (int64_t j = 0; j < idx.NumElements(); ++j) rows[j] = f(j);
  } else {
    const auto f = idx.flat<int64_t>();
    for (int64_t j = 0; j < idx.NumElements(); ++j) rows[j] = f(j);
  }
  t->sparse = true;
  t->indices = rows.data();
  t->nnz = idx.NumElements();
  t->rows = var.dim_size(0);
  t->width = row_shape.num_elements();
  return absl::OkStatus();
}


// TfclipClipApply<Op> and TfclipClipApplyRef<Op> (TF1 ref variables too; ops.cc): one kernel
// class for every rule, which it finds by the op's name in the rule table.
template <typename D>
class ClipApplyOp : public OpKernel {
 public:
  explicit ClipApplyOp(OpKernelConstruction* c) : OpKernel(c) {
    const std::string& op = c->def().op();
    const RuleInfo* info = FindApplyRule(op, &with_refs_);
    OP_REQUIRES(c, info != nullptr, tf::errors::Internal("no rule for op ", op));
    rule_ = *info;
    slots_ = rule_.slots();
    // The common attrs, from the description (csrc/core/apply_op.h), checked; the rule's flags.
    ApplyOpAttrs attrs;
    OP_REQUIRES_OK(c, ReadApplyOpAttrs(c, rule_, with_refs_, &attrs));
    // One variable per gradient; the resource lists may pack their handles (see VarLookup).
    n_ = attrs.num_grads;
    cfg_ = attrs.Clip();
    lazy_ = attrs.lazy;
    has_iterations_ = attrs.num_iterations > 0;
    num_absmax_ = attrs.num_absmax;
    has_grad_scale_ = attrs.num_grad_scale > 0;
    has_rounding_ = attrs.num_rounding > 0;
    hp_.sum_of_squares = attrs.sum_of_squares;
    for (int k = 0; k < kNumFlags; ++k) {
      if ((rule_.flags >> k) & 1u) hp_.SetFlag(static_cast<Flag>(k), (attrs.flags >> k) & 1u);
    }
    sparse_of_.assign(static_cast<size_t>(n_), -1);
    for (size_t k = 0; k < attrs.sparse.size(); ++k) sparse_of_[attrs.sparse[k]] = static_cast<int>(k);
    num_sparse_ = static_cast<int>(attrs.sparse.size());
    is_ref_.assign(static_cast<size_t>(n_), false);
    for (const int32_t i : attrs.ref) is_ref_[i] = true;
    num_ref_ = static_cast<int>(attrs.ref.size());
    nslots_ = NumSlots(rule_.kind, hp_);
    // A range of a variable (var_offsets, a share of a variable split across replicas): only
    // where each element's update needs nothing beyond its own range.
    var_offsets_ = attrs.var_offsets;
    bool ranges = false;
    for (const int32_t o : var_offsets_) ranges = ranges || o >= 0;
    if (ranges) {
      const char* why = RuleFactored(rule_.kind) ? "its factored second moments are a whole matrix's"
                        : RuleTrustRatio(rule_.kind) ? "its trust ratio is a whole variable's"
                        : cfg_.mode == ClipMode::kNorm ? "clip_mode 'norm' clips by a whole gradient's norm"
                        : cfg_.mode == ClipMode::kAgc ? "clip_mode 'agc' clips by a whole variable's units"
                        : has_rounding_ ? "stochastic rounding draws by an element's place in its variable"
                        : nullptr;
      OP_REQUIRES(c, why == nullptr,
                  tf::errors::InvalidArgument("var_offsets: rule '", rule_.name, "' cannot step a range of a "
                                              "variable: ", why));
    }
  }

  // Check, look up and lock, allocate, one core step.
  void Compute(OpKernelContext* ctx) override {
    StepArgs args;
    args.rule = rule_.kind;
    args.hp = hp_;
    args.cfg = cfg_;
    args.lazy = lazy_;
    Scalars ds;
    OP_REQUIRES_OK(ctx, ReadScalars(ctx, &args, &ds));
    tf::OpInputList grads, indices;
    OP_REQUIRES_OK(ctx, ctx->input_list("grad", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("indices", &indices));
    OP_REQUIRES(ctx, indices.size() == num_sparse_,
                tf::errors::InvalidArgument("got ", indices.size(), " index vectors for ",
                                            num_sparse_, " sparse gradients"));
    VarLookup lookup(ctx);  // before refs: it may own references refs point through
    std::vector<VarRef> refs;
    OP_REQUIRES_OK(ctx, LookUp(ctx, &lookup, &refs));
    LockSet locks;
    OP_REQUIRES_OK(ctx, lock_order_.Lock(refs, &locks));
    // Ref variables: their tensors, read under their mutexes (an Assign may have replaced the
    // buffer), as TF's ApplyX ops read theirs. They share the variables' buffers: the core
    // updates the variables in place (TF1 semantics: no copy-on-write for refs).
    std::vector<Tensor> ref_tensors;
    if (with_refs_) {
      ref_tensors.reserve(static_cast<size_t>(num_ref_ * (nslots_ + 1)));
      for (VarRef& r : refs) {
        if (r.ref_input < 0) continue;
        ref_tensors.push_back(ctx->mutable_input(r.ref_input, /*lock_held=*/true));
        r.ref = &ref_tensors.back();
      }
    }
    void* gpu_stream = nullptr;
#if TFCLIP_WITH_CUDA
    if constexpr (kGpu<D>) gpu_stream = GpuStream(ctx);
#endif
    std::vector<ApplyTensor> ts(n_);
    std::vector<std::vector<int64_t>> sparse_rows(static_cast<size_t>(num_sparse_));
    int64_t* counter = nullptr;
    OP_REQUIRES_OK(ctx, Prepare(ctx, refs, grads, indices, gpu_stream, &ts, &sparse_rows, &counter));
    args.ts = ts.data();
    args.n = n_;

    // The outputs, each of its shape kind (csrc/core/apply_op.h).
    Tensor* outs[kNumApplyOutputs];
    for (int k = 0; k < kNumApplyOutputs; ++k) {
      const bool scalar = kApplyOutputs[k].shape == ApplyOutputShape::kScalar;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(k, scalar ? tf::TensorShape({}) : tf::TensorShape({n_}),
                                               &outs[k]));
    }
    Tensor* norm_out = outs[kApplyOutGlobalNorm];
    Tensor* applied_out = outs[kApplyOutApplied];
    Tensor* per_out = outs[kApplyOutTensorNorms];
    Tensor* clipped_out = outs[kApplyOutClippedUnits];
    StepResult r;
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      ds.iterations = counter;
      GpuMemory mem(ctx);
      cuda::CudaOutputs o = NormOutput(norm_out, DType::kFloat, per_out);
      o.applied = reinterpret_cast<bool*>(const_cast<char*>(applied_out->tensor_data().data()));
      o.clipped_units = clipped_out->flat<int64_t>().data();
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaClipApply(args, ds, &mem, o, gpu_stream, &r)));
      OP_REQUIRES(ctx, r.error.empty(), tf::errors::InvalidArgument(r.error));
#endif
    } else {
      args.iterations = counter;
      // The plan and partials' buffers are kept across steps (nothing allocated per step once
      // they have grown); a concurrent call of the same kernel waits for them.
      tf::mutex_lock scratch_lock(scratch_mu_);
      scratch_norms_.resize(static_cast<size_t>(n_));
      args.tensor_norms = scratch_norms_.data();
      args.agc_clipped = clipped_out->flat<int64_t>().data();
      r = ClipApplyCpu(args, &scratch_, TfExecutor(ctx));
      OP_REQUIRES(ctx, r.error.empty(), tf::errors::InvalidArgument(r.error));
      norm_out->scalar<float>()() = RoundNorm<float>(r.global_norm);
      applied_out->scalar<bool>()() = r.applied;
      WriteNorms<float>(scratch_norms_, per_out);
    }
  }

 private:
#if TFCLIP_WITH_CUDA
  using Scalars = cuda::DeviceScalars;
#else
  struct Scalars {
    int64_t* iterations = nullptr;
  };
#endif

  // The scalar inputs: read here on CPU; on GPU they stay in device memory, read by the core.
  absl::Status ReadScalars(OpKernelContext* ctx, StepArgs* args, Scalars* ds) {
    for (int k = 0; k < kNumHParams; ++k) {
      if (!((rule_.hparams >> k) & 1u)) continue;
      const char* name = GetHParamInfo(static_cast<HP>(k)).input;
      if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
        TF_RETURN_IF_ERROR(DeviceScalar(ctx, name, &ds->hparams[k]));
#endif
      } else {
        double v = 0;
        TF_RETURN_IF_ERROR(ScalarInput(ctx, name, &v));
        args->hp.Set(static_cast<HP>(k), v);
      }
    }
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      TF_RETURN_IF_ERROR(DeviceScalar(ctx, "clip", &ds->clip));
      TF_RETURN_IF_ERROR(DeviceScalar(ctx, "use_norm", &ds->use_norm));
      if (!cfg_.has_use_norm) ds->use_norm = nullptr;
#endif
    } else {
      TF_RETURN_IF_ERROR(ScalarInput(ctx, "clip", &args->cfg.clip));
      TF_RETURN_IF_ERROR(ScalarInput(ctx, "use_norm", &args->cfg.use_norm));
    }
    if (has_grad_scale_) {
      tf::OpInputList gs;
      TF_RETURN_IF_ERROR(ctx->input_list("grad_scale", &gs));
      if (!tf::TensorShapeUtils::IsScalar(gs[0].shape())) {
        return tf::errors::InvalidArgument("grad_scale must be a scalar, got shape ", gs[0].shape().DebugString());
      }
      if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
        ds->grad_scale = reinterpret_cast<const double*>(gs[0].tensor_data().data());
#endif
      } else {
        args->cfg.grad_scale = gs[0].scalar<double>()();
      }
    }
    if (has_rounding_) {  // stochastic rounding's seed and step (csrc/core/rounding.h)
      args->hp.stochastic_rounding = true;
      tf::OpInputList rs;
      TF_RETURN_IF_ERROR(ctx->input_list("rounding", &rs));
      double* fields[2] = {&args->hp.rounding_seed, &args->hp.rounding_step};
      for (int k = 0; k < 2; ++k) {
        if (!tf::TensorShapeUtils::IsScalar(rs[k].shape())) {
          return tf::errors::InvalidArgument("rounding's ", k == 0 ? "seed" : "step", " must be a scalar, got shape ",
                                             rs[k].shape().DebugString());
        }
        if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
          ds->rounding[k] = reinterpret_cast<const double*>(rs[k].tensor_data().data());
#endif
        } else {
          *fields[k] = rs[k].scalar<double>()();
        }
      }
    }
    return absl::OkStatus();
  }

  // Every resource: vars, then each slot list the step uses (slot k of var i is
  // refs[(k + 1) * n + i]), then int8 state's absmax variables (slot k of the j-th variable with
  // int8 state is refs[(nslots + 1) * n + k * nq + j]), then the step counter, if given (locked
  // and copied-on-write with the rest: refs' last). A slot the step's flags leave out (Adam's vhat without amsgrad, RMSprop's
  // momentum without has_momentum) is an empty input; the others follow in the table's order.
  absl::Status LookUp(OpKernelContext* ctx, VarLookup* lookup, std::vector<VarRef>* refs) {
    refs->reserve(static_cast<size_t>((nslots_ + 1) * n_ + 1));
    TF_RETURN_IF_ERROR(AddList(ctx, lookup, "var", "vars", refs));
    int used = 0;
    for (const std::string& s : slots_) {
      int64_t count = 0;
      TF_RETURN_IF_ERROR(lookup->Count(s.c_str(), &count));
      if (with_refs_) {
        int start, stop;
        TF_RETURN_IF_ERROR(ctx->op_kernel().InputRange(s + "_ref", &start, &stop));
        count += stop - start;
      }
      if (count == 0) continue;
      if (used == nslots_) {
        return tf::errors::InvalidArgument("got ", count, " ", s, " slots, but with these flags rule '",
                                           rule_.name, "' takes ", nslots_, " slot lists");
      }
      TF_RETURN_IF_ERROR(AddList(ctx, lookup, s, s.c_str(), refs));
      ++used;
    }
    if (used != nslots_) {
      return tf::errors::InvalidArgument("with these flags rule '", rule_.name, "' takes ", nslots_,
                                         " slot lists, got ", used);
    }
    if (num_absmax_ > 0) {  // (a list of handles, or packed: its handles' count)
      int64_t count = 0;
      TF_RETURN_IF_ERROR(lookup->Count("absmax", &count));
      TF_RETURN_IF_ERROR(lookup->Add("absmax", "absmax", static_cast<int>(count), refs));
    }
    if (has_iterations_) TF_RETURN_IF_ERROR(lookup->Add("iterations", "iterations", 1, refs));
    return absl::OkStatus();
  }

  // One variable or slot list: its n_ entries in gradient order. Without refs the resource list
  // alone; with them the resource list holds the positions `ref` leaves out, in order, and
  // `<input>_ref` those it names (ops.cc).
  absl::Status AddList(OpKernelContext* ctx, VarLookup* lookup, const std::string& input,
                       const char* label, std::vector<VarRef>* refs) {
    if (!with_refs_) return lookup->Add(input.c_str(), label, n_, refs);
    int start, stop;
    TF_RETURN_IF_ERROR(ctx->op_kernel().InputRange(input + "_ref", &start, &stop));
    int64_t num_resources = 0;
    TF_RETURN_IF_ERROR(lookup->Count(input.c_str(), &num_resources));
    if (stop - start != num_ref_ || num_resources != n_ - num_ref_) {
      return tf::errors::InvalidArgument(
          "got ", num_resources, " resource and ", stop - start, " ref ", label, " for ", n_,
          " gradients, of which `ref` names ", num_ref_, " positions: there must be ", n_ - num_ref_,
          " and ", num_ref_);
    }
    const size_t first = refs->size();
    TF_RETURN_IF_ERROR(lookup->Add(input.c_str(), label, n_ - num_ref_, refs));
    const std::vector<VarRef> resources(refs->begin() + static_cast<std::ptrdiff_t>(first), refs->end());
    refs->resize(first);
    int r = 0, k = 0;
    for (int i = 0; i < n_; ++i) {
      if (is_ref_[i]) {
        VarRef v{label, i, nullptr};
        v.ref_input = start + r++;
        v.ref_mu = ctx->input_ref_mutex(v.ref_input);
        v.node = &ctx->op_kernel().requested_input(v.ref_input);
        if (v.ref_mu == nullptr) return tf::errors::Internal(v.name(), " has no mutex");
        refs->push_back(v);
      } else {
        VarRef v = resources[static_cast<size_t>(k++)];
        v.index = i;
        refs->push_back(v);
      }
    }
    return absl::OkStatus();
  }

  // Checks everything TF sees (dtypes, shapes, initialization) before the first write, and gives
  // each variable, once checked, a private buffer (EnsureExclusive changes no value, so a later
  // failure has still written nothing) and its raw pointers for the core: one visit of each Var
  // and tensor per step. The step counter's pointer, if any, in *counter.
  absl::Status Prepare(OpKernelContext* ctx, const std::vector<VarRef>& refs,
                       const tf::OpInputList& grads, const tf::OpInputList& indices,
                       void* gpu_stream, std::vector<ApplyTensor>* ts_out,
                       std::vector<std::vector<int64_t>>* sparse_rows, int64_t** counter) {
    std::vector<ApplyTensor>& ts = *ts_out;
    // int8 state: nq variables with uint8 slots, each with nslots absmax variables (refs between
    // the slots and the step counter).
    const size_t absmax_base = static_cast<size_t>(nslots_ + 1) * static_cast<size_t>(n_);
    const int num_absmax = static_cast<int>(refs.size() - absmax_base) - (has_iterations_ ? 1 : 0);
    if (num_absmax > 0 && (nslots_ == 0 || num_absmax % nslots_ != 0)) {
      return tf::errors::InvalidArgument("got ", num_absmax, " absmax variables; rule '", rule_.name,
                                         "' takes ", nslots_, " per variable with int8 state");
    }
    const int nq = nslots_ > 0 ? num_absmax / nslots_ : 0;
    int q8 = 0;  // variables with int8 state so far
    for (int i = 0; i < n_; ++i) {
      const VarRef& vr = refs[i];
      if (!vr.initialized()) return tf::errors::FailedPrecondition(vr.name(), " is not initialized");
      const Tensor& vt = *vr.tensor();
      const int64_t offset = var_offsets_.empty() ? -1 : var_offsets_[static_cast<size_t>(i)];
      // The shape the slots and the step see: the variable's, or its range's (the gradient's).
      const tf::TensorShape& shape = offset >= 0 ? grads[i].shape() : vt.shape();
      if (!ToCoreDType(vt.dtype(), &ts[i].var_dtype)) {
        return tf::errors::InvalidArgument(vr.name(), " has dtype ", tf::DataTypeString(vt.dtype()),
                                           "; only half, bfloat16, float and double variables");
      }
      if (!ToCoreDType(grads[i].dtype(), &ts[i].grad_dtype)) {
        return tf::errors::InvalidArgument("grads[", i, "] has unsupported dtype");
      }
      if (sparse_of_[i] >= 0) {
        TF_RETURN_IF_ERROR(CheckSparse(i, vt, grads[i], indices[sparse_of_[i]],
                                       &(*sparse_rows)[sparse_of_[i]], &ts[i]));
      } else if (offset >= 0) {  // a range of the variable, flat: the gradient's elements from `offset`
        if (offset + grads[i].NumElements() > vt.NumElements()) {
          return tf::errors::InvalidArgument("grads[", i, "] has ", grads[i].NumElements(), " elements from var_offsets[",
                                             i, "] = ", offset, " but ", vr.name(), " has ", vt.NumElements());
        }
      } else if (vt.shape() != grads[i].shape()) {
        if (vt.NumElements() != grads[i].NumElements()) {
          return tf::errors::InvalidArgument(
              "grads[", i, "] has ", grads[i].NumElements(), " elements (shape ",
              grads[i].shape().DebugString(), ") but ", vr.name(), " has ", vt.NumElements(),
              " (shape ", vt.shape().DebugString(), ")");
        }
        return tf::errors::InvalidArgument("grads[", i, "] has shape ", grads[i].shape().DebugString(),
                                           " but ", vr.name(), " has shape ", vt.shape().DebugString());
      }
      ts[i].size = shape.num_elements();
      ts[i].units = vt.dims() >= 2 ? vt.dim_size(vt.dims() - 1) : 1;  // AGC's (csrc/core/agc.h)
      const bool factored = RuleFactored(rule_.kind);
      if (factored) SetFactoredDims(ShapeDims(vt.shape()), &ts[i]);
      if (vr.var != nullptr) TF_RETURN_IF_ERROR(EnsureExclusive(ctx, vr.var, gpu_stream));
      ts[i].var = const_cast<char*>(vr.tensor()->tensor_data().data()) +
                  (offset >= 0 ? offset * static_cast<int64_t>(tf::DataTypeSize(vt.dtype())) : 0);
      ts[i].grad = grads[i].tensor_data().data();
      ts[i].slot_storage = SlotStorage::kVariable;
      for (int k = 0; k < nslots_; ++k) {
        const VarRef& s = refs[static_cast<size_t>((k + 1) * n_ + i)];
        if (!s.initialized()) return tf::errors::FailedPrecondition(s.name(), " is not initialized");
        const Tensor& st = *s.tensor();
        if (st.dtype() == tf::DT_UINT8 || (k > 0 && ts[i].slot_storage == SlotStorage::kInt8)) {
          TF_RETURN_IF_ERROR(Int8Slot(ctx, refs, vr, shape, s, i, k, q8, nq, absmax_base, gpu_stream, &ts[i]));
          continue;
        }
        DType sdt = DType::kFloat;
        SlotStorage storage = SlotStorage::kVariable;
        if (factored) {  // Adafactor's r, c, v (csrc/core/factored.h)
          bool placeholder = false;
          const std::string e = FactoredSlotShape(k, ShapeDims(vt.shape()), ShapeDims(st.shape()), &placeholder);
          if (!e.empty()) return tf::errors::InvalidArgument(s.name(), " (slot of ", vr.name(), ") ", e);
          if (k == 2) ts[i].fac_full_v = !placeholder;
          if (placeholder) continue;  // neither read nor written: any dtype (keras's are float32)
        }
        if (!ToCoreDType(st.dtype(), &sdt) || !SlotStorageOf(ts[i].var_dtype, sdt, &storage) ||
            (!factored && st.shape() != shape)) {
          return tf::errors::InvalidArgument(
              s.name(), " is ", tf::DataTypeString(st.dtype()), st.shape().DebugString(), " but ",
              vr.name(), " is ", tf::DataTypeString(vt.dtype()), vt.shape().DebugString(),
              offset >= 0 ? tf::strings::StrCat(" (its range from var_offsets[", i, "] = ", offset, ": ",
                                                 shape.DebugString(), ")") : std::string(),
              "; a slot must match its variable (its shape, and its dtype or bfloat16 for a float "
              "variable's state)");
        }
        if (k > 0 && storage != ts[i].slot_storage) {
          return tf::errors::InvalidArgument(s.name(), " is ", tf::DataTypeString(st.dtype()),
                                             " but the other slots of ", vr.name(),
                                             " are not; a variable's slots share one dtype");
        }
        ts[i].slot_storage = storage;
        if (s.var != nullptr) TF_RETURN_IF_ERROR(EnsureExclusive(ctx, s.var, gpu_stream));
        ts[i].slots[k] = const_cast<char*>(s.tensor()->tensor_data().data());
      }
    }
    if (q8 != nq) {
      return tf::errors::InvalidArgument("got ", num_absmax, " absmax variables for ", q8,
                                         " variables with int8 state (uint8 slots) and ", nslots_,
                                         " slots each");
    }
    *counter = nullptr;
    if (has_iterations_) {
      tf::Var* cv = refs.back().var;
      if (!cv->is_initialized) return tf::errors::FailedPrecondition("iterations is not initialized");
      const Tensor& c = *cv->tensor();
      if (c.dtype() != tf::DT_INT64 || !tf::TensorShapeUtils::IsScalar(c.shape())) {
        return tf::errors::InvalidArgument("iterations must be an int64 scalar variable, got ",
                                           tf::DataTypeString(c.dtype()), c.shape().DebugString());
      }
      TF_RETURN_IF_ERROR(EnsureExclusive(ctx, cv, gpu_stream));
      // Read and advanced by the core, under the step's locks: every rule's t is
      // iterations + step (on GPU in device memory, by the finalize kernel).
      *counter = const_cast<int64_t*>(
          reinterpret_cast<const int64_t*>(cv->tensor()->tensor_data().data()));
    }
    return absl::OkStatus();
  }

  // Slot k of variable i (ref s) as int8 state: uint8 codes of the variable's shape, a float32
  // variable, its absmax variable a float32 vector of one value per kQuantBlock elements. q8:
  // the count of variables with int8 state before this one (advanced after its last slot).
  absl::Status Int8Slot(OpKernelContext* ctx, const std::vector<VarRef>& refs, const VarRef& vr,
                        const tf::TensorShape& shape, const VarRef& s, int i, int k, int& q8, int nq,
                        size_t absmax_base, void* gpu_stream, ApplyTensor* t) {
    const Tensor& vt = *vr.tensor();
    const Tensor& st = *s.tensor();
    if (st.dtype() != tf::DT_UINT8 || st.shape() != shape || vt.dtype() != tf::DT_FLOAT ||
        (k > 0 && t->slot_storage != SlotStorage::kInt8)) {
      return tf::errors::InvalidArgument(
          s.name(), " is ", tf::DataTypeString(st.dtype()), st.shape().DebugString(), " but ", vr.name(),
          " is ", tf::DataTypeString(vt.dtype()), vt.shape().DebugString(),
          "; int8 state is uint8 codes of a float32 variable's shape, for every slot of the variable");
    }
    if (q8 >= nq) {
      return tf::errors::InvalidArgument(s.name(), " is uint8 (int8 state) but the step got absmax variables for ",
                                         nq, " such variables only");
    }
    const VarRef& a = refs[absmax_base + static_cast<size_t>(k) * nq + q8];
    if (!a.initialized()) return tf::errors::FailedPrecondition(a.name(), " is not initialized");
    const Tensor& at = *a.tensor();
    const int64_t blocks = QuantBlocks(shape.num_elements());
    if (at.dtype() != tf::DT_FLOAT || at.dims() != 1 || at.dim_size(0) != blocks) {
      return tf::errors::InvalidArgument(a.name(), " is ", tf::DataTypeString(at.dtype()), at.shape().DebugString(),
                                         "; the absmax of ", s.name(), " must be float32[", blocks, "] (one per ",
                                         kQuantBlock, " elements of ", vr.name(), ")");
    }
    if (s.var != nullptr) TF_RETURN_IF_ERROR(EnsureExclusive(ctx, s.var, gpu_stream));
    if (a.var != nullptr) TF_RETURN_IF_ERROR(EnsureExclusive(ctx, a.var, gpu_stream));
    t->slot_storage = SlotStorage::kInt8;
    t->slots[k] = const_cast<char*>(s.tensor()->tensor_data().data());
    t->absmax[k] = reinterpret_cast<float*>(const_cast<char*>(a.tensor()->tensor_data().data()));
    if (k == nslots_ - 1) ++q8;
    return absl::OkStatus();
  }

#if TFCLIP_WITH_CUDA
  // A scalar double input left in device memory.
  static absl::Status DeviceScalar(OpKernelContext* ctx, const char* name, const double** out) {
    const Tensor* t;
    TF_RETURN_IF_ERROR(ctx->input(name, &t));
    if (!tf::TensorShapeUtils::IsScalar(t->shape())) {
      return tf::errors::InvalidArgument(name, " must be a scalar, got shape ",
                                         t->shape().DebugString());
    }
    *out = reinterpret_cast<const double*>(t->tensor_data().data());
    return absl::OkStatus();
  }
#endif

  RuleInfo rule_{};
  std::vector<std::string> slots_;
  int nslots_ = 0;
  int n_ = 0;
  HParams hp_;
  ClipConfig cfg_;
  bool lazy_ = false;
  bool has_iterations_ = false;  // an `iterations` input: see ops.cc
  int num_absmax_ = 0;           // the `absmax` input's count (int8 state): see apply_op.h
  bool has_grad_scale_ = false;  // the `grad_scale` input (ClipConfig::grad_scale)
  bool has_rounding_ = false;    // the `rounding` input (stochastic rounding's seed and step)
  std::vector<int32_t> var_offsets_;  // [] or per variable: -1 whole, else its range's first element
  std::vector<int> sparse_of_;  // per gradient: its position in `indices`, or -1 (dense)
  int num_sparse_ = 0;
  bool with_refs_ = false;  // TfclipClipApplyRef<Op>
  std::vector<bool> is_ref_;  // per gradient: its variable (and slots) a ref
  int num_ref_ = 0;
  LockOrder lock_order_;
  tf::mutex scratch_mu_;
  StepScratch scratch_ TF_GUARDED_BY(scratch_mu_);
  std::vector<double> scratch_norms_ TF_GUARDED_BY(scratch_mu_);
};

template <typename D>
OpKernel* CreateClipApply(OpKernelConstruction* c) {
  return new ClipApplyOp<D>(c);
}

// One kernel per rule and device, from the rule table. On GPU only the resource handles and the
// IndexedSlices indices (planned on the host) are in host memory (the inputs csrc/core/apply_op.h
// marks host_memory); every scalar stays on the device, where the step reads it without a host
// round trip. (The ref op's ref inputs are the variables' own tensors, in device memory.)
bool RegisterApplyKernels() {
  for (const RuleInfo& r : AllRules()) {
    for (const bool ref_op : {false, true}) {
      const std::string op = std::string(ref_op ? kApplyRefOpPrefix : kApplyOpPrefix) + r.op;
      tf::kernel_factory::OpKernelRegistrar cpu(
          tf::KernelDefBuilder(op.c_str()).Device(tf::DEVICE_CPU).Build(), "ClipApplyOp",
          &CreateClipApply<OnCpu>);
#if TFCLIP_WITH_CUDA
      tf::KernelDefBuilder gpu(op.c_str());
      gpu.Device(tf::DEVICE_GPU);
      const std::vector<std::string> slots = r.slots();
      for (const ApplyInputDef& in : kApplyInputs) {
        if (!in.host_memory || !ApplyOpHas(in.ops, ref_op)) continue;
        if (in.kind == ApplyInputKind::kInput) gpu.HostMemory(in.name);
        if (in.kind == ApplyInputKind::kRuleSlots) {
          for (const std::string& s : slots) gpu.HostMemory(s.c_str());
        }
      }
      tf::kernel_factory::OpKernelRegistrar reg(gpu.Build(), "ClipApplyOp", &CreateClipApply<OnGpu>);
#endif
    }
  }
  return true;
}
[[maybe_unused]] const bool kApplyKernelsRegistered = RegisterApplyKernels();

}  // namespace
}  // namespace tfclip
