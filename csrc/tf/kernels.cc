// tfclip TF glue: the OpKernels of the norm ops, TfclipGlobalNorm and TfclipClipByGlobalNorm
// (ops.cc), CPU and GPU, with their registrations. Each Compute() validates what only TF sees,
// allocates, and calls one core pass: csrc/core/cpu/driver.h on CPU, csrc/core/cuda/driver.h on
// GPU (the op's stream, memory from TF's allocators: device.h). The apply ops' kernel is in
// apply_kernel.cc.
#include <cmath>
#include <string>
#include <vector>

#include "csrc/core/cpu/driver.h"
#include "csrc/core/validate.h"
#include "csrc/tf/device.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

#if TFCLIP_WITH_CUDA
#include "csrc/core/cuda/driver.h"
#endif

namespace tfclip {
namespace {

namespace tf = ::tensorflow;
using tf::OpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using namespace tf_glue;  // NOLINT(build/namespaces): the glue both kernel files share (device.h)

// The input list as the core's tensor views; an error names `what`[i].
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

// The op's input list "t" as the core's tensor views (the norm ops' one input list).
absl::Status InputViews(OpKernelContext* ctx, std::vector<TensorView>* out) {
  tf::OpInputList t;
  TF_RETURN_IF_ERROR(ctx->input_list("t", &t));
  return ViewList(t, "t_list", out);
}

#if TFCLIP_WITH_CUDA
template <typename Tnorm>
DType NormDType() {
  return kDTypeOf<Tnorm>;
}
#endif  // TFCLIP_WITH_CUDA

// ---------------------------------------------------------------- TfclipGlobalNorm
template <typename Tnorm, typename D>
class GlobalNormOp : public OpKernel {
 public:
  explicit GlobalNormOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    std::vector<TensorView> views;
    OP_REQUIRES_OK(ctx, InputViews(ctx, &views));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    const int n = static_cast<int>(views.size());
    Tensor* per;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({n}), &per));
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      GpuMemory mem(ctx);
      const cuda::CudaOutputs o = NormOutput(out, NormDType<Tnorm>(), per);
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaGlobalNorm(views.data(), n, &mem, o, GpuStream(ctx))));
#endif
    } else {
      std::vector<double> norms(n);
      out->scalar<Tnorm>()() = RoundNorm<Tnorm>(GlobalNormCpu(views.data(), n, TfExecutor(ctx), norms.data()));
      WriteNorms<Tnorm>(norms, per);
    }
  }
};

// ---------------------------------------------------------------- TfclipNormPartials (CPU)
class NormPartialsOp : public OpKernel {
 public:
  explicit NormPartialsOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    std::vector<TensorView> views;
    OP_REQUIRES_OK(ctx, InputViews(ctx, &views));
    ChunkPlan plan;
    PlanList(views.data(), static_cast<int>(views.size()), &plan);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({static_cast<int64_t>(plan.chunks.size())}), &out));
    double total = 0.0;
    SumSquaresCpu(views.data(), static_cast<int>(views.size()), plan, out->flat<double>().data(), nullptr, &total,
                  TfExecutor(ctx));
  }
};

// ---------------------------------------------------------------- TfclipNormFromPartials (CPU)
class NormFromPartialsOp : public OpKernel {
 public:
  explicit NormFromPartialsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("sizes", &sizes_));
    for (size_t i = 0; i < sizes_.size(); ++i) {
      OP_REQUIRES(c, sizes_[i] >= 0, tf::errors::InvalidArgument("sizes[", i, "] is ", sizes_[i], ", below 0"));
    }
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& partials = ctx->input(0);
    const int n = static_cast<int>(sizes_.size());
    ChunkPlan plan;
    PlanChunks(sizes_.data(), n, kChunkElems, &plan);
    OP_REQUIRES(ctx, partials.dims() == 1 && partials.NumElements() == static_cast<int64_t>(plan.chunks.size()),
                tf::errors::InvalidArgument("partials has shape ", partials.shape().DebugString(), "; the sizes' ",
                                            plan.chunks.size(), " chunks need [", plan.chunks.size(), "]"));
    const double* p = partials.flat<double>().data();
    // In chunk order, as SumSquares adds them (csrc/core/cpu/pass_norm.cc).
    std::vector<double> per(n, 0.0);
    double sum = 0.0;
    for (size_t c = 0; c < plan.chunks.size(); ++c) {
      sum += p[c];
      per[plan.chunks[c].tensor] += p[c];
    }
    Tensor* norm;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &norm));
    norm->scalar<double>()() = RoundNorm<double>(std::sqrt(sum));
    Tensor* norms;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({n}), &norms));
    TensorNorms(per.data(), n, norms->flat<double>().data());
  }

 private:
  std::vector<int64_t> sizes_;
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
    // clip_norm and use_norm: read here on CPU; on GPU left in device memory for the step.
    double clip_norm = 0, use_norm = 0;
    if constexpr (!kGpu<D>) {
      OP_REQUIRES_OK(ctx, ScalarInput(ctx, "clip_norm", &clip_norm));
      OP_REQUIRES_OK(ctx, ScalarInput(ctx, "use_norm", &use_norm));
      const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
      OP_REQUIRES(ctx, err.empty(), tf::errors::InvalidArgument(err));
    }
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
    Tensor* per_out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(n + 1, tf::TensorShape({n}), &per_out));
    if constexpr (kGpu<D>) {
#if TFCLIP_WITH_CUDA
      cuda::ClipOpScalars dev;
      dev.clip_norm = ctx->input(n).tensor_data().data();  // inputs: t..., clip_norm, use_norm
      if (use_given_norm_) dev.use_norm = ctx->input(n + 1).tensor_data().data();
      dev.dtype = NormDType<Tnorm>();
      GpuMemory mem(ctx);
      const cuda::CudaOutputs o = NormOutput(norm_out, NormDType<Tnorm>(), per_out);
      OP_REQUIRES_OK(ctx, CudaStatus(cuda::CudaClipByGlobalNorm(in.data(), out.data(), n, clip_norm,
                                                                use_given_norm_, use_norm, dev, &mem,
                                                                o, GpuStream(ctx))));
#endif
    } else {
      const CpuExecutor exec = TfExecutor(ctx);
      std::vector<double> norms(n);
      double norm = use_norm;
      if (use_given_norm_) TensorNorms(nullptr, n, norms.data());  // no norm pass: NaN
      else norm = GlobalNormCpu(in.data(), n, exec, norms.data());
      WriteNorms<Tnorm>(norms, per_out);
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

TFCLIP_REGISTER_NORM_OPS(DEVICE_CPU, OnCpu)
REGISTER_KERNEL_BUILDER(Name("TfclipNormPartials").Device(DEVICE_CPU), NormPartialsOp);
REGISTER_KERNEL_BUILDER(Name("TfclipNormFromPartials").Device(DEVICE_CPU), NormFromPartialsOp);
REGISTER_KERNEL_BUILDER(
    Name("TfclipClipByGlobalNorm").Device(DEVICE_CPU).TypeConstraint<float>("Tnorm"),
    ClipByGlobalNormOp<float, OnCpu>);
REGISTER_KERNEL_BUILDER(
    Name("TfclipClipByGlobalNorm").Device(DEVICE_CPU).TypeConstraint<double>("Tnorm"),
    ClipByGlobalNormOp<double, OnCpu>);

#if TFCLIP_WITH_CUDA
TFCLIP_REGISTER_NORM_OPS(DEVICE_GPU, OnGpu)
// clip_norm and use_norm stay in device memory (an all-reduced norm is computed there).
#define TFCLIP_REGISTER_CLIP_GPU(T)                                                          \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("TfclipClipByGlobalNorm").Device(DEVICE_GPU).TypeConstraint<T>("Tnorm"),          \
      ClipByGlobalNormOp<T, OnGpu>);
TFCLIP_REGISTER_CLIP_GPU(float)
TFCLIP_REGISTER_CLIP_GPU(double)
#endif  // TFCLIP_WITH_CUDA

}  // namespace tfclip
