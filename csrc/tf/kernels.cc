// tfclip TF glue: the OpKernels, CPU and GPU. Each Compute() validates, looks up and locks the
// variables, allocates, and calls the core: csrc/core/cpu_driver.h on CPU, cuda/cuda_driver.h on
// GPU (stream from the op context, temp memory from TF's allocators). Nothing else happens here.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "csrc/core/cpu_driver.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"

#if TFCLIP_WITH_CUDA
#include "cuda/cuda_driver.h"
#include "cuda/workspace.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tfclip {
namespace {

namespace tf = ::tensorflow;
using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;

struct OnCpu {};
struct OnGpu {};
template <typename D>
constexpr bool kGpu = std::is_same_v<D, OnGpu>;

CpuExecutor TfExecutor(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return CpuExecutor{[pool](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    // One contiguous range of units per thread (as many as the work is worth): streams stay
    // long, and no thread picks up scattered small shards. The partition never changes a result.
    constexpr int64_t kMinCyclesPerThread = int64_t{1} << 17;
    const int64_t threads = std::max<int64_t>(
        1, std::min<int64_t>({static_cast<int64_t>(pool->NumThreads()) + 1, n,
                              n * cost / kMinCyclesPerThread}));
    if (threads <= 1) {
      fn(0, n);
      return;
    }
    const int64_t per = (n + threads - 1) / threads;
    pool->TransformRangeConcurrently(per, n, fn);
  }};
}

bool ToCoreDType(tf::DataType t, DType* out) {
  switch (t) {
    case tf::DT_HALF: *out = DType::kHalf; return true;
    case tf::DT_BFLOAT16: *out = DType::kBFloat16; return true;
    case tf::DT_FLOAT: *out = DType::kFloat; return true;
    case tf::DT_DOUBLE: *out = DType::kDouble; return true;
    default: return false;
  }
}

// Reads a scalar input as double, or names it in the error.
absl::Status ScalarInput(OpKernelContext* ctx, const char* name, double* out) {
  const Tensor* t;
  TF_RETURN_IF_ERROR(ctx->input(name, &t));
  if (!tf::TensorShapeUtils::IsScalar(t->shape())) {
    return tf::errors::InvalidArgument(name, " must be a scalar, got shape ",
                                       t->shape().DebugString());
  }
  switch (t->dtype()) {
    case tf::DT_FLOAT: *out = t->scalar<float>()(); break;
    case tf::DT_DOUBLE: *out = t->scalar<double>()(); break;
    default: return tf::errors::InvalidArgument(name, " must be float or double");
  }
  return absl::OkStatus();
}

absl::Status ViewList(const tf::OpInputList& list, const char* what, std::vector<TensorView>* out) {
  out->resize(list.size());
  for (int i = 0; i < list.size(); ++i) {
    DType dt;
    if (!ToCoreDType(list[i].dtype(), &dt)) {
      return tf::errors::InvalidArgument(what, "[", i, "] has unsupported dtype ",
                                         tf::DataTypeString(list[i].dtype()));
    }
    (*out)[i] = TensorView{const_cast<char*>(list[i].tensor_data().data()),
                           list[i].NumElements(), dt};
  }
  return absl::OkStatus();
}

#if TFCLIP_WITH_CUDA
absl::Status CudaStatus(const std::string& e) {
  return e.empty() ? absl::OkStatus() : tf::errors::Internal(e);
}

// One GPU step's workspace: the tensor table in pinned host memory and the device buffer,
// both from TF's allocators. The device buffer may be freed when Compute returns (TF's GPU
// allocator is ordered on the compute stream); the host table is held until the stream has
// passed its upload, as TF's own GpuDeviceArrayOnHost does.
class GpuStep {
 public:
  explicit GpuStep(OpKernelContext* ctx)
      : ctx_(ctx), stream_(ctx->op_device_context()->stream()->platform_specific_handle().stream) {}

  absl::Status Plan(const std::vector<int64_t>& sizes, const SparsePlan* sparse = nullptr) {
    cuda::PlanCudaStep(sizes.data(), static_cast<int>(sizes.size()), &plan_, sparse);
    tf::AllocatorAttributes host_attr;
    host_attr.set_on_host(true);
    host_attr.set_gpu_compatible(true);
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(
        tf::DT_INT8, tf::TensorShape({static_cast<int64_t>(plan_.host_bytes)}), &host_, host_attr));
    return ctx_->allocate_temp(tf::DT_INT8,
                               tf::TensorShape({static_cast<int64_t>(plan_.device_bytes)}), &dev_);
  }
  // After the launches: releases the host table once the stream is past its copy.
  absl::Status Done() {
    auto* keep = new Tensor(host_);
    return CudaStatus(cuda::ThenRunOnHost(
        stream_, [](void* t) { delete static_cast<Tensor*>(t); }, keep));
  }
  // The op's scalar norm output, in device memory.
  static cuda::CudaOutputs NormOutput(Tensor* norm, DType dtype) {
    cuda::CudaOutputs o;
    o.norm = const_cast<char*>(norm->tensor_data().data());
    o.norm_dtype = dtype;
    return o;
  }
  const cuda::CudaPlan& plan() const { return plan_; }
  void* host() { return const_cast<char*>(host_.tensor_data().data()); }
  void* dev() { return const_cast<char*>(dev_.tensor_data().data()); }
  void* stream() const { return stream_; }

 private:
  OpKernelContext* ctx_;
  void* stream_;
  cuda::CudaPlan plan_;
  Tensor host_, dev_;
};

std::vector<int64_t> ViewSizes(const std::vector<TensorView>& v) {
  std::vector<int64_t> s;
  for (const auto& t : v) s.push_back(t.size);
  return s;
}

template <typename Tnorm>
DType NormDType() {
  return std::is_same_v<Tnorm, double> ? DType::kDouble : DType::kFloat;
}
#endif  // TFCLIP_WITH_CUDA

// ---------------------------------------------------------------- TfclipGlobalNorm
template <typename Tnorm, typename D>
class GlobalNormOp : public OpKernel {
 public:
  explicit GlobalNormOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    tf::OpInputList t;
    OP_REQUIRES_OK(ctx, ctx->input_list("t", &t));
    std::vector<TensorView> views;
    OP_REQUIRES_OK(ctx, ViewList(t, "t_list", &views));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    const int n = static_cast<int>(views.size());
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      GpuStep step(ctx);
      OP_REQUIRES_OK(ctx, step.Plan(ViewSizes(views)));
      const cuda::CudaOutputs o = GpuStep::NormOutput(out, NormDType<Tnorm>());
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaGlobalNorm(views.data(), n, step.plan(), step.host(),
                                                          step.dev(), o, step.stream())));
      OP_REQUIRES_OK(ctx, step.Done());
#endif
    } else {
      out->scalar<Tnorm>()() = RoundNorm<Tnorm>(GlobalNormCpu(views.data(), n, TfExecutor(ctx)));
    }
  }
};

// ---------------------------------------------------------------- TfclipClipByGlobalNorm
template <typename Tnorm, typename D>
class ClipByGlobalNormOp : public OpKernel {
 public:
  explicit ClipByGlobalNormOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("use_given_norm", &use_given_norm_));
  }
  void Compute(OpKernelContext* ctx) override {
    tf::OpInputList t;
    OP_REQUIRES_OK(ctx, ctx->input_list("t", &t));
    double clip_norm = 0, use_norm = 0;
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, "clip_norm", &clip_norm));
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, "use_norm", &use_norm));
    const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
    OP_REQUIRES(ctx, err.empty(), tf::errors::InvalidArgument(err));
    std::vector<TensorView> in;
    OP_REQUIRES_OK(ctx, ViewList(t, "t_list", &in));
    const int n = static_cast<int>(in.size());
    int start, stop;
    OP_REQUIRES_OK(ctx, ctx->op_kernel().InputRange("t", &start, &stop));
    std::vector<TensorView> out(n);
    for (int i = 0; i < n; ++i) {
      Tensor* o;
      // Reuse the input buffer when nobody else holds it, as TF's element-wise ops do.
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({start + i}, i, t[i].shape(), &o));
      out[i] = TensorView{const_cast<char*>(o->tensor_data().data()), o->NumElements(), in[i].dtype};
    }
    Tensor* norm_out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(n, tf::TensorShape({}), &norm_out));
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      GpuStep step(ctx);
      OP_REQUIRES_OK(ctx, step.Plan(ViewSizes(in)));
      const cuda::CudaOutputs o = GpuStep::NormOutput(norm_out, NormDType<Tnorm>());
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaClipByGlobalNorm(
                              in.data(), out.data(), n, clip_norm, use_given_norm_, use_norm,
                              step.plan(), step.host(), step.dev(), o, step.stream())));
      OP_REQUIRES_OK(ctx, step.Done());
#endif
    } else {
      const CpuExecutor exec = TfExecutor(ctx);
      const double norm = use_given_norm_ ? use_norm : GlobalNormCpu(in.data(), n, exec);
      // The norm the caller sees is in Tnorm; TF computes the scale from that value.
      const Tnorm norm_t = RoundNorm<Tnorm>(norm);
      ScaleListCpu(in.data(), out.data(), n, GlobalClipScale(clip_norm, static_cast<double>(norm_t)),
                   exec);
      norm_out->scalar<Tnorm>()() = norm_t;
    }
  }

 private:
  bool use_given_norm_ = false;
};

// ---------------------------------------------------------------- clip-and-apply ops
// Which slot inputs and hyper-parameters each op has.
struct RuleSpec {
  RuleKind kind;
  std::vector<const char*> slots;   // resource list inputs after "var"
  std::vector<const char*> hparams; // scalar double inputs
};

// Reads the scalar hyper-parameter inputs. Compute validates them once Adam's step is known
// (it may add the step counter, read under the variables' locks).
absl::Status ReadHParams(OpKernelContext* ctx, const RuleSpec& spec, HParams* hp) {
  for (const char* name : spec.hparams) {
    double v = 0;
    TF_RETURN_IF_ERROR(ScalarInput(ctx, name, &v));
    const std::string n(name);
    if (n == "lr") hp->lr = v;
    else if (n == "momentum") hp->momentum = v;
    else if (n == "beta_1") hp->beta_1 = v;
    else if (n == "beta_2") hp->beta_2 = v;
    else if (n == "epsilon") hp->epsilon = v;
    else if (n == "weight_decay") hp->weight_decay = v;
    else if (n == "step") hp->step = v;
  }
  if (spec.kind == RuleKind::kAdam) {  // TF1 Adam's running powers, when given (ops.cc)
    tf::OpInputList powers;
    TF_RETURN_IF_ERROR(ctx->input_list("beta_powers", &powers));
    if (powers.size() != 0) {
      if (powers.size() != 2) {
        return tf::errors::InvalidArgument("beta_powers takes [beta_1^t, beta_2^t], got ",
                                           powers.size(), " tensors");
      }
      for (int k = 0; k < 2; ++k) {
        if (!tf::TensorShapeUtils::IsScalar(powers[k].shape())) {
          return tf::errors::InvalidArgument("beta_powers[", k, "] must be a scalar, got shape ",
                                             powers[k].shape().DebugString());
        }
      }
      hp->beta_powers = true;
      hp->beta_1_power = powers[0].scalar<double>()();
      hp->beta_2_power = powers[1].scalar<double>()();
    }
  }
  return absl::OkStatus();
}

// One resource variable input: where it came from (for errors) and its Var. The Var stays
// alive for all of Compute: see VarLookup.
struct VarRef {
  const char* label;  // the input list: "vars", "m", ...
  int index;
  tf::Var* var;
  std::string name() const { return absl::StrCat(label, "[", index, "]"); }  // errors only
};

// Holds the locks of a step's variables, released in reverse order.
class LockSet {
 public:
  LockSet() = default;
  LockSet(const LockSet&) = delete;
  LockSet& operator=(const LockSet&) = delete;
  void Lock(tf::mutex* m) TF_NO_THREAD_SAFETY_ANALYSIS {
    m->lock();
    held_.push_back(m);
  }
  ~LockSet() TF_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->unlock();
  }

 private:
  std::vector<tf::mutex*> held_;
};

// Finds the Vars of a step's resource inputs. A TF2 variable's handle is ref-counting: it owns
// its Var, and the op's input owns the handle until Compute returns, so such a Var is used
// through the handle's pointer, with no reference taken and dropped (two atomic operations per
// resource, ~10% of a small step's fixed cost). The handle must name this device and a Var,
// as TF's LookupResource checks; anything else (shared-name TF1 variables, a wrong device or
// type, a deleted variable) goes through LookupResource itself, which keeps a reference in
// `owned_` and gives TF's own error.
class VarLookup {
 public:
  explicit VarLookup(OpKernelContext* ctx)
      : ctx_(ctx), device_(ctx->device()->attributes().name()) {}

  // The handles of one resource list input, in order: each tensor of the list is one handle
  // or a vector of handles (an eager caller packs a repeated step's lists once, so the step
  // pays TF's per-input dispatch for three tensors, not 600). `n`: the number of gradients.
  absl::Status Add(const char* input, const char* label, int n, std::vector<VarRef>* out) {
    static const uint64_t kVarType = tf::TypeIndex::Make<tf::Var>().hash_code();
    int start, stop;
    TF_RETURN_IF_ERROR(ctx_->op_kernel().InputRange(input, &start, &stop));
    int64_t total = 0;
    for (int j = start; j < stop; ++j) {
      const Tensor& t = ctx_->input(j);
      if (t.dims() > 1) {
        return tf::errors::InvalidArgument(label, " must hold scalar or vector resource handles; "
                                           "got shape ", t.shape().DebugString());
      }
      total += t.NumElements();
    }
    if (total != n) {
      const std::string what(label);
      if (what == "vars") {
        return tf::errors::InvalidArgument("got ", n, " gradients for ", total, " variables");
      }
      if (what == "iterations") {
        return tf::errors::InvalidArgument("iterations must be one variable, got ", total,
                                           " handles");
      }
      return tf::errors::InvalidArgument("got ", total, " ", label, " slots for ", n,
                                         " variables");
    }
    int i = 0;
    for (int j = start; j < stop; ++j) {
      const auto handles = ctx_->input(j).flat<tf::ResourceHandle>();
      for (int64_t e = 0; e < handles.size(); ++e, ++i) {
        VarRef r{label, i, nullptr};
        const tf::ResourceHandle& h = handles(e);
        if (h.IsRefCounting() && h.hash_code() == kVarType && h.device() == device_) {
          r.var = static_cast<tf::Var*>(h.resource().get());
        } else {
          tf::core::RefCountPtr<tf::Var> v;
          const absl::Status s = tf::LookupResource(ctx_, h, &v);
          if (!s.ok()) {
            return tf::errors::FailedPrecondition(r.name(), " is not initialized (or was deleted): ",
                                                  s.message());
          }
          r.var = v.get();
          owned_.push_back(std::move(v));
        }
        out->push_back(r);
      }
    }
    return absl::OkStatus();
  }

 private:
  OpKernelContext* ctx_;
  const std::string& device_;
  std::vector<tf::core::RefCountPtr<tf::Var>> owned_;
};

// Replaces a variable's buffer by a private copy when a reader still aliases it, so the
// in-place update cannot change a value someone already read (TF's copy-on-write rule).
// On GPU the copy is queued on the op's stream, ahead of the step's kernels.
absl::Status EnsureExclusive(OpKernelContext* ctx, tf::Var* var, void* gpu_stream) {
  Tensor* t = var->tensor();
  if (!var->copy_on_read_mode.load() && t->RefCountIsOne()) return absl::OkStatus();
  Tensor copy;
  tf::AllocatorAttributes attr;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy, attr));
  char* dst = const_cast<char*>(copy.tensor_data().data());
  if (gpu_stream != nullptr) {
#if TFCLIP_WITH_CUDA
    if (t->TotalBytes() > 0) {
      TF_RETURN_IF_ERROR(CudaStatus(
          cuda::CopyDeviceAsync(dst, t->tensor_data().data(), t->TotalBytes(), gpu_stream)));
    }
#endif
  } else {
    std::memcpy(dst, t->tensor_data().data(), t->TotalBytes());
  }
  *t = copy;
  return absl::OkStatus();
}

template <typename D>
class ClipApplyOp : public OpKernel {
 public:
  ClipApplyOp(OpKernelConstruction* c, RuleSpec spec) : OpKernel(c), spec_(std::move(spec)) {
    std::string mode, policy;
    // One variable per gradient; the resource lists may pack their handles (see VarLookup).
    std::vector<tf::DataType> grad_types;
    OP_REQUIRES_OK(c, c->GetAttr("Tgrad", &grad_types));
    n_ = static_cast<int>(grad_types.size());
    OP_REQUIRES_OK(c, c->GetAttr("clip_mode", &mode));
    OP_REQUIRES_OK(c, c->GetAttr("nonfinite", &policy));
    OP_REQUIRES_OK(c, c->GetAttr("use_given_norm", &cfg_.has_use_norm));
    OP_REQUIRES(c, ParseClipMode(mode, &cfg_.mode), tf::errors::InvalidArgument("clip_mode ", mode));
    OP_REQUIRES(c, ParseNonFinitePolicy(policy, &cfg_.policy),
                tf::errors::InvalidArgument("nonfinite ", policy));
    OP_REQUIRES_OK(c, c->GetAttr("lazy", &lazy_));
    int n_iterations = 0;
    OP_REQUIRES_OK(c, c->GetAttr("Niterations", &n_iterations));
    OP_REQUIRES(c, n_iterations <= 1,
                tf::errors::InvalidArgument("iterations takes at most one variable, got ",
                                            n_iterations));
    // On GPU the counter would live in device memory, where the host cannot read Adam's step
    // without a round trip: the caller passes the step (and advances its counter) instead.
    OP_REQUIRES(c, !(kGpu<D> && n_iterations > 0),
                tf::errors::InvalidArgument("iterations is taken by the CPU kernels only; on GPU "
                                            "pass the step and advance the counter outside"));
    has_iterations_ = n_iterations > 0;
    OP_REQUIRES_OK(c, c->GetAttr("sum_of_squares", &hp_.sum_of_squares));
    std::vector<int32_t> sparse;
    OP_REQUIRES_OK(c, c->GetAttr("sparse", &sparse));
    sparse_of_.assign(static_cast<size_t>(n_), -1);
    for (size_t k = 0; k < sparse.size(); ++k) {
      const int32_t i = sparse[k];
      OP_REQUIRES(c, i >= 0 && i < n_ && (k == 0 || i > sparse[k - 1]),
                  tf::errors::InvalidArgument("sparse must list gradient positions in [0, ", n_,
                                              ") in increasing order; got ", i, " at ", k));
      sparse_of_[i] = static_cast<int>(k);
    }
    num_sparse_ = static_cast<int>(sparse.size());
    if (c->HasAttr("use_nesterov")) OP_REQUIRES_OK(c, c->GetAttr("use_nesterov", &hp_.nesterov));
    if (c->HasAttr("amsgrad")) {
      OP_REQUIRES_OK(c, c->GetAttr("amsgrad", &hp_.amsgrad));
      int nvhat = 0;
      OP_REQUIRES_OK(c, c->GetAttr("Nvhat", &nvhat));
      OP_REQUIRES(c, hp_.amsgrad ? nvhat > 0 : nvhat == 0,
                  tf::errors::InvalidArgument("amsgrad=", hp_.amsgrad, " needs ",
                                              hp_.amsgrad ? "vhat slots" : "no vhat slots",
                                              ", got ", nvhat, " vhat inputs"));
    }
  }

  // An IndexedSlices gradient of vars[i]: values [k] + var.shape[1:], indices [k] (int32 or
  // int64, read as int64 here; their range is checked by PlanSparse before anything is written).
  static absl::Status CheckSparse(int i, const Tensor& var, const Tensor& values,
                                  const Tensor& idx, std::vector<int64_t>* rows_out,
                                  ApplyTensor* t) {
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

  void Compute(OpKernelContext* ctx) override {
    HParams hp = hp_;
    OP_REQUIRES_OK(ctx, ReadHParams(ctx, spec_, &hp));
    ClipConfig cfg = cfg_;
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, "clip", &cfg.clip));
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, "use_norm", &cfg.use_norm));
    const std::string cerr = ValidateClipConfig(cfg);
    OP_REQUIRES(ctx, cerr.empty(), tf::errors::InvalidArgument(cerr));

    tf::OpInputList grads, indices;
    OP_REQUIRES_OK(ctx, ctx->input_list("grad", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("indices", &indices));
    OP_REQUIRES(ctx, indices.size() == num_sparse_,
                tf::errors::InvalidArgument("got ", indices.size(), " index vectors for ",
                                            num_sparse_, " sparse gradients"));

    // Look up every resource: vars, then each slot list (slot k of var i is slots[k][i]).
    const int nslots = NumSlots(spec_.kind, hp);
    VarLookup lookup(ctx);  // before refs: it may own references refs point through
    std::vector<VarRef> refs;
    refs.reserve(static_cast<size_t>((nslots + 1) * n_));
    OP_REQUIRES_OK(ctx, lookup.Add("var", "vars", n_, &refs));
    for (int k = 0; k < nslots; ++k) {
      OP_REQUIRES_OK(ctx, lookup.Add(spec_.slots[k], spec_.slots[k], n_, &refs));
    }
    // The step counter, if given, is locked and copied-on-write with the rest: refs' last.
    if (has_iterations_) OP_REQUIRES_OK(ctx, lookup.Add("iterations", "iterations", 1, &refs));

    LockSet locks;
    OP_REQUIRES_OK(ctx, LockInOrder(refs, &locks));

    void* gpu_stream = nullptr;
#if TFCLIP_WITH_CUDA
    if constexpr (kGpu<D>) {
      gpu_stream = ctx->op_device_context()->stream()->platform_specific_handle().stream;
    }
#endif
    // Validate everything before the first write. Each variable, once checked, gets a private
    // buffer (EnsureExclusive changes no value, so a later failure has still written nothing)
    // and its raw pointers for the core: one visit of each Var and tensor per step.
    std::vector<ApplyTensor> ts(n_);
    std::vector<std::vector<int64_t>> sparse_rows(static_cast<size_t>(num_sparse_));
    for (int i = 0; i < n_; ++i) {
      tf::Var* var = refs[i].var;
      OP_REQUIRES(ctx, var->is_initialized,
                  tf::errors::FailedPrecondition("vars[", i, "] is not initialized"));
      const Tensor& vt = *var->tensor();
      OP_REQUIRES(ctx, ToCoreDType(vt.dtype(), &ts[i].var_dtype),
                  tf::errors::InvalidArgument("vars[", i, "] has dtype ",
                                              tf::DataTypeString(vt.dtype()),
                                              "; only half, bfloat16, float and double variables"));
      OP_REQUIRES(ctx, ToCoreDType(grads[i].dtype(), &ts[i].grad_dtype),
                  tf::errors::InvalidArgument("grads[", i, "] has unsupported dtype"));
      if (sparse_of_[i] >= 0) {
        OP_REQUIRES_OK(ctx, CheckSparse(i, vt, grads[i], indices[sparse_of_[i]],
                                        &sparse_rows[sparse_of_[i]], &ts[i]));
      } else if (vt.shape() != grads[i].shape()) {
        if (vt.NumElements() != grads[i].NumElements()) {
          ctx->CtxFailure(tf::errors::InvalidArgument(
              "grads[", i, "] has ", grads[i].NumElements(), " elements (shape ",
              grads[i].shape().DebugString(), ") but vars[", i, "] has ", vt.NumElements(),
              " (shape ", vt.shape().DebugString(), ")"));
        } else {
          ctx->CtxFailure(tf::errors::InvalidArgument(
              "grads[", i, "] has shape ", grads[i].shape().DebugString(), " but vars[", i,
              "] has shape ", vt.shape().DebugString()));
        }
        return;
      }
      ts[i].size = vt.NumElements();
      OP_REQUIRES_OK(ctx, EnsureExclusive(ctx, var, gpu_stream));
      ts[i].var = const_cast<char*>(var->tensor()->tensor_data().data());
      ts[i].grad = grads[i].tensor_data().data();
      for (int k = 0; k < nslots; ++k) {
        const VarRef& s = refs[static_cast<size_t>((k + 1) * n_ + i)];
        OP_REQUIRES(ctx, s.var->is_initialized,
                    tf::errors::FailedPrecondition(s.name(), " is not initialized"));
        const Tensor& st = *s.var->tensor();
        OP_REQUIRES(ctx, st.dtype() == vt.dtype() && st.shape() == vt.shape(),
                    tf::errors::InvalidArgument(
                        s.name(), " is ", tf::DataTypeString(st.dtype()), st.shape().DebugString(),
                        " but vars[", i, "] is ", tf::DataTypeString(vt.dtype()),
                        vt.shape().DebugString(), "; a slot must match its variable"));
        OP_REQUIRES_OK(ctx, EnsureExclusive(ctx, s.var, gpu_stream));
        ts[i].slots[k] = const_cast<char*>(s.var->tensor()->tensor_data().data());
      }
    }
    tf::Var* counter = has_iterations_ ? refs.back().var : nullptr;
    if (counter != nullptr) {
      OP_REQUIRES(ctx, counter->is_initialized,
                  tf::errors::FailedPrecondition("iterations is not initialized"));
      const Tensor& c = *counter->tensor();
      OP_REQUIRES(ctx, c.dtype() == tf::DT_INT64 && tf::TensorShapeUtils::IsScalar(c.shape()),
                  tf::errors::InvalidArgument("iterations must be an int64 scalar variable, got ",
                                              tf::DataTypeString(c.dtype()),
                                              c.shape().DebugString()));
      OP_REQUIRES_OK(ctx, EnsureExclusive(ctx, counter, gpu_stream));
      // Read under its lock; only Adam's step uses it.
      if (spec_.kind == RuleKind::kAdam) hp.step += static_cast<double>(c.scalar<int64_t>()());
    }
    const std::string herr = ValidateHParams(spec_.kind, hp);
    OP_REQUIRES(ctx, herr.empty(),
                tf::errors::InvalidArgument(
                    herr, counter != nullptr && spec_.kind == RuleKind::kAdam
                              ? absl::StrCat(" (iterations + step = ", hp.step, ")")
                              : std::string()));

    Tensor* norm_out;
    Tensor* applied_out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &norm_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &applied_out));
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      // Indices are in host memory (HostMemory("indices")): checked and grouped here, before
      // any launch, so a bad one writes nothing and costs no device round trip.
      SparsePlan sparse;
      const std::string serr = PlanSparse(ts.data(), n_, spec_.kind, hp, lazy_, cuda::kCudaChunkElems,
                                          &sparse);
      OP_REQUIRES(ctx, serr.empty(), tf::errors::InvalidArgument(serr));
      GpuStep step(ctx);
      std::vector<int64_t> sizes;
      for (const ApplyTensor& t : ts) sizes.push_back(t.grad_size());
      OP_REQUIRES_OK(ctx, step.Plan(sizes, &sparse));
      cuda::CudaOutputs o = GpuStep::NormOutput(norm_out, DType::kFloat);
      o.applied = reinterpret_cast<bool*>(const_cast<char*>(applied_out->tensor_data().data()));
      bool nonfinite = false;
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaClipApply(spec_.kind, hp, cfg, ts.data(), n_,
                                                         step.plan(), step.host(), step.dev(), o,
                                                         step.stream(), &nonfinite)));
      OP_REQUIRES_OK(ctx, step.Done());
      OP_REQUIRES(ctx, !nonfinite,
                  tf::errors::InvalidArgument("the global norm of the gradients is non-finite "
                                              "and nonfinite='raise'; no variable was updated"));
#endif
    } else {
      // The plan and partials' buffers are kept across steps (nothing allocated per step once
      // they have grown); a concurrent call of the same kernel waits for them.
      tf::mutex_lock scratch_lock(scratch_mu_);
      const StepResult r =
          ClipApplyCpu(spec_.kind, hp, cfg, ts.data(), n_, lazy_, &scratch_, TfExecutor(ctx));
      OP_REQUIRES(ctx, r.error.empty(), tf::errors::InvalidArgument(r.error));
      OP_REQUIRES(ctx, !(r.nonfinite && cfg.policy == NonFinitePolicy::kRaise),
                  tf::errors::InvalidArgument("the global norm of the gradients is ",
                                              r.global_norm,
                                              " (non-finite) and nonfinite='raise'; no variable "
                                              "was updated"));
      norm_out->scalar<float>()() = RoundNorm<float>(r.global_norm);
      applied_out->scalar<bool>()() = r.applied;
      // Only an applied step counts (EnsureExclusive gave the counter a private buffer).
      if (counter != nullptr && r.applied) ++counter->tensor()->scalar<int64_t>()();
    }
  }

 private:
  // Locks the step's variables in increasing mutex address, as TF's own multi-variable ops do.
  // The same variable twice would be updated twice (and would deadlock a naive lock): sorted,
  // it is adjacent, and named. The order of the last step's Vars is kept: a repeated step
  // (the same Vars) skips the sort and the check. Var pointers alone fix the mutex addresses
  // (a member of the Var), so the key stays right even for a Var freed and another allocated
  // at its address; the pointers are never followed from here.
  absl::Status LockInOrder(const std::vector<VarRef>& refs, LockSet* locks) {
    std::vector<tf::mutex*> order;
    {
      tf::mutex_lock l(order_mu_);
      bool same = order_key_.size() == refs.size();
      for (size_t k = 0; same && k < refs.size(); ++k) same = order_key_[k] == refs[k].var;
      if (same) order = order_;
    }
    if (order.empty()) {
      // (The keys are gathered first: a sort that chases refs[k].var->mu() per comparison
      // cost ~3x as much for a few hundred variables.)
      std::vector<std::pair<tf::mutex*, int>> sorted(refs.size());
      for (size_t k = 0; k < refs.size(); ++k) sorted[k] = {refs[k].var->mu(), static_cast<int>(k)};
      std::sort(sorted.begin(), sorted.end());
      for (size_t k = 1; k < sorted.size(); ++k) {
        const VarRef& a = refs[sorted[k - 1].second];
        const VarRef& b = refs[sorted[k].second];
        if (a.var == b.var) {
          return tf::errors::InvalidArgument(b.name(), " and ", a.name(),
                                             " are the same variable; each may appear once");
        }
      }
      order.reserve(sorted.size());
      for (const auto& o : sorted) order.push_back(o.first);
      std::vector<tf::Var*> key(refs.size());
      for (size_t k = 0; k < refs.size(); ++k) key[k] = refs[k].var;
      tf::mutex_lock l(order_mu_);
      order_key_ = std::move(key);
      order_ = order;
    }
    for (tf::mutex* m : order) locks->Lock(m);
    return absl::OkStatus();
  }

  RuleSpec spec_;
  int n_ = 0;
  HParams hp_;
  ClipConfig cfg_;
  bool lazy_ = false;
  bool has_iterations_ = false;  // an `iterations` input: see ops.cc
  std::vector<int> sparse_of_;  // per gradient: its position in `indices`, or -1 (dense)
  int num_sparse_ = 0;
  tf::mutex order_mu_;
  std::vector<tf::Var*> order_key_ TF_GUARDED_BY(order_mu_);   // see LockInOrder
  std::vector<tf::mutex*> order_ TF_GUARDED_BY(order_mu_);
  tf::mutex scratch_mu_;
  StepScratch scratch_ TF_GUARDED_BY(scratch_mu_);
};

template <RuleKind K, typename D>
class RuleOp : public ClipApplyOp<D> {
 public:
  explicit RuleOp(OpKernelConstruction* c) : ClipApplyOp<D>(c, Spec()) {}
  static RuleSpec Spec() {
    switch (K) {
      case RuleKind::kSgd: return {K, {}, {"lr", "weight_decay"}};
      case RuleKind::kMomentum:
      case RuleKind::kKerasMomentum: return {K, {"accum"}, {"lr", "momentum", "weight_decay"}};
      case RuleKind::kAdam:
        return {K, {"m", "v", "vhat"}, {"lr", "beta_1", "beta_2", "epsilon", "weight_decay", "step"}};
    }
    return {K, {}, {}};
  }
};

}  // namespace

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::DEVICE_GPU;

#define TFCLIP_REGISTER_NORM_OPS(DEV, D, ...)                                                  \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("TfclipGlobalNorm").Device(DEV).TypeConstraint<float>("Tnorm") __VA_ARGS__,       \
      GlobalNormOp<float, D>);                                                               \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("TfclipGlobalNorm").Device(DEV).TypeConstraint<double>("Tnorm") __VA_ARGS__,      \
      GlobalNormOp<double, D>);

// Scalars the host must see before launching (clip values, hyper-parameters) and resource
// handles live in host memory on GPU, as for TF's own ResourceApply* GPU kernels.
#define TFCLIP_HOST_CLIP \
  .HostMemory("clip").HostMemory("use_norm").HostMemory("var").HostMemory("indices")
#define TFCLIP_HOST_LR_WD .HostMemory("lr").HostMemory("weight_decay")

TFCLIP_REGISTER_NORM_OPS(DEVICE_CPU, OnCpu)
REGISTER_KERNEL_BUILDER(
    Name("TfclipClipByGlobalNorm").Device(DEVICE_CPU).TypeConstraint<float>("Tnorm"),
    ClipByGlobalNormOp<float, OnCpu>);
REGISTER_KERNEL_BUILDER(
    Name("TfclipClipByGlobalNorm").Device(DEVICE_CPU).TypeConstraint<double>("Tnorm"),
    ClipByGlobalNormOp<double, OnCpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplySgd").Device(DEVICE_CPU), RuleOp<RuleKind::kSgd, OnCpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyMomentum").Device(DEVICE_CPU),
                        RuleOp<RuleKind::kMomentum, OnCpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyKerasMomentum").Device(DEVICE_CPU),
                        RuleOp<RuleKind::kKerasMomentum, OnCpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyAdam").Device(DEVICE_CPU), RuleOp<RuleKind::kAdam, OnCpu>);

#if TFCLIP_WITH_CUDA
TFCLIP_REGISTER_NORM_OPS(DEVICE_GPU, OnGpu)
#define TFCLIP_REGISTER_CLIP_GPU(T)                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfclipClipByGlobalNorm")                                     \
                              .Device(DEVICE_GPU)                                            \
                              .TypeConstraint<T>("Tnorm")                                    \
                              .HostMemory("clip_norm")                                       \
                              .HostMemory("use_norm"),                                       \
                          ClipByGlobalNormOp<T, OnGpu>);
TFCLIP_REGISTER_CLIP_GPU(float)
TFCLIP_REGISTER_CLIP_GPU(double)
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplySgd").Device(DEVICE_GPU) TFCLIP_HOST_CLIP TFCLIP_HOST_LR_WD,
                        RuleOp<RuleKind::kSgd, OnGpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyMomentum")
                            .Device(DEVICE_GPU) TFCLIP_HOST_CLIP TFCLIP_HOST_LR_WD
                            .HostMemory("accum")
                            .HostMemory("momentum"),
                        RuleOp<RuleKind::kMomentum, OnGpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyKerasMomentum")
                            .Device(DEVICE_GPU) TFCLIP_HOST_CLIP TFCLIP_HOST_LR_WD
                            .HostMemory("accum")
                            .HostMemory("momentum"),
                        RuleOp<RuleKind::kKerasMomentum, OnGpu>);
REGISTER_KERNEL_BUILDER(Name("TfclipClipApplyAdam")
                            .Device(DEVICE_GPU) TFCLIP_HOST_CLIP TFCLIP_HOST_LR_WD
                            .HostMemory("m")
                            .HostMemory("v")
                            .HostMemory("vhat")
                            .HostMemory("beta_1")
                            .HostMemory("beta_2")
                            .HostMemory("epsilon")
                            .HostMemory("step")
                            .HostMemory("beta_powers"),
                        RuleOp<RuleKind::kAdam, OnGpu>);
#endif  // TFCLIP_WITH_CUDA

}  // namespace tfclip
