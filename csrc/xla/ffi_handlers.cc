// tfclip XLA glue: the custom-call handlers (typed FFI, xla/ffi/api/ffi.h only). Each reads the
// buffers XLA passes (custom_calls.h), checks what only it sees, and makes one core call: the
// CPU driver on the FFI's thread pool ("Host"); the CUDA driver on XLA's stream ("CUDA",
// cuda_handlers.cc). No TF header.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/cpu_driver.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/validate.h"
#include "csrc/xla/custom_calls.h"
#include "csrc/xla/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = ::xla::ffi;

namespace tfclip {
namespace xla_glue {

namespace {

// The CPU driver's executor on the FFI's thread pool (XLA:CPU: TF's intra-op pool). The work is
// split up front into parts; the calling thread claims parts itself, as do the tasks it
// schedules, and it waits only for parts another thread has already started. So no task ever
// waits for a task that has not started: no deadlock when the pool is busy, of size 1, or the
// caller is itself one of its threads (a scheduled task that starts late finds nothing left).
class PoolParallelFor {
 public:
  explicit PoolParallelFor(ffi::ThreadPool* pool) : pool_(pool) {}

  void operator()(int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    // As the TF kernel's executor (csrc/tf/device.cc): contiguous ranges, as many as the work
    // is worth. The partition never changes a result.
    constexpr int64_t kMinCyclesPerThread = int64_t{1} << 17;
    const int64_t threads = pool_ == nullptr ? 0 : pool_->num_threads();
    const int64_t parts =
        std::max<int64_t>(1, std::min<int64_t>({threads + 1, n, n * cost / kMinCyclesPerThread}));
    if (parts <= 1) {
      if (n > 0) fn(0, n);
      return;
    }
    struct State {
      std::atomic<int64_t> next{0};
      int64_t parts = 0, n = 0;
      const std::function<void(int64_t, int64_t)>* fn = nullptr;
      std::mutex mu;
      std::condition_variable cv;
      int64_t done = 0;
      // Runs parts until none is left; returns after its last claimed part completes.
      void Run() {
        for (;;) {
          const int64_t p = next.fetch_add(1);
          if (p >= parts) return;
          const int64_t per = (n + parts - 1) / parts;
          const int64_t b = std::min(n, p * per), e = std::min(n, b + per);
          if (b < e) (*fn)(b, e);
          std::lock_guard<std::mutex> l(mu);
          if (++done == parts) cv.notify_all();
        }
      }
    };
    auto st = std::make_shared<State>();
    st->parts = parts;
    st->n = n;
    st->fn = &fn;
    for (int64_t p = 1; p < parts; ++p) pool_->Schedule([st] { st->Run(); });
    st->Run();
    std::unique_lock<std::mutex> l(st->mu);
    st->cv.wait(l, [&] { return st->done == st->parts; });
    // (A task that starts after this finds next >= parts and touches neither fn nor the caller.)
  }

 private:
  ffi::ThreadPool* pool_;
};

CpuExecutor PoolExecutor(ffi::ThreadPool* pool) {
  return CpuExecutor{PoolParallelFor(pool)};
}

// ---------------------------------------------------------------- tfclip_norm
ffi::Error NormHost(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Dictionary attrs) {
  std::vector<int64_t> sparse, rows, widths;
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64s(attrs, "sparse", &sparse));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64s(attrs, "rows", &rows));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64s(attrs, "widths", &widths));
  const int n = static_cast<int>(args.size() - sparse.size());
  std::vector<TensorView> views(n);
  TFCLIP_FFI_RETURN_IF_ERROR(ViewArgs(args, 0, n, "t_list", views.data()));
  if (!sparse.empty()) {
    // The apply op's IndexedSlices indices, checked by the core's own planner before any apply
    // call runs (the apply calls take this call's norm, so they run after it).
    std::vector<ApplyTensor> ts(n);
    for (int i = 0; i < n; ++i) {
      ts[i].grad = views[i].data;
      ts[i].size = views[i].size;
      ts[i].grad_dtype = ts[i].var_dtype = views[i].dtype;
    }
    for (size_t k = 0; k < sparse.size(); ++k) {
      auto idx = args.get<ffi::AnyBuffer>(n + k);
      if (idx.has_error()) return idx.error();
      ApplyTensor& t = ts[sparse[k]];
      t.sparse = true;
      t.indices = static_cast<const int64_t*>(idx->untyped_data());
      t.nnz = static_cast<int64_t>(idx->element_count());
      t.rows = rows[k];
      t.width = widths[k];
      t.size = rows[k] * widths[k];
    }
    SparsePlan plan;
    const std::string e = PlanSparse(ts.data(), n, RuleKind::kSgd, HParams{}, /*lazy=*/true,
                                     kChunkElems, &plan);
    if (!e.empty()) return ffi::Error::InvalidArgument(e);
  }
  std::vector<double> norms(n);
  const double norm = GlobalNormCpu(views.data(), n, PoolExecutor(&pool), norms.data());
  auto r64 = rets.get<ffi::AnyBuffer>(0);
  auto rn = rets.get<ffi::AnyBuffer>(1);
  auto rt = rets.get<ffi::AnyBuffer>(2);
  if (r64.has_error()) return r64.error();
  if (rn.has_error()) return rn.error();
  if (rt.has_error()) return rt.error();
  *static_cast<double*>((*r64)->untyped_data()) = norm;
  WriteNorms(&norm, 1, (*rn)->untyped_data(), (*rn)->element_type());
  WriteNorms(norms.data(), n, (*rt)->untyped_data(), (*rt)->element_type());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- tfclip_clip
ffi::Error ClipHost(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Dictionary attrs) {
  ClipCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(args, rets, attrs));
  const int n = call.n;
  const double clip_norm = ReadScalar(*call.clip_norm), use_norm = ReadScalar(*call.use_norm);
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  const CpuExecutor exec = PoolExecutor(&pool);
  std::vector<double> norms(n);
  double norm = use_norm;
  if (call.given) TensorNorms(nullptr, n, norms.data());  // no norm pass: NaN
  else norm = GlobalNormCpu(call.in.data(), n, exec, norms.data());
  WriteNorms(norms.data(), n, call.tensor_norms->untyped_data(), call.tensor_norms->element_type());
  // As the TF kernel: the scale comes from the norm rounded to Tnorm.
  WriteNorms(&norm, 1, call.norm->untyped_data(), call.norm->element_type());
  const double norm_t = ReadScalar(*call.norm);
  ScaleListCpu(call.in.data(), call.out.data(), n, GlobalClipScale(clip_norm, norm_t), exec);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- tfclip_apply
// Scratch kept per thread across steps (a call of another group on another thread has its own).
struct ApplyScratch {
  StepScratch step;
  std::vector<double> norms;
  std::vector<ApplyTensor> ts;
};

ffi::Error ApplyHost(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     ffi::Dictionary attrs) {
  ApplyCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(args, rets, attrs));
  thread_local ApplyScratch s;
  s.ts.assign(static_cast<size_t>(call.n), ApplyTensor{});
  TFCLIP_FFI_RETURN_IF_ERROR(call.Tensors(args, rets, s.ts.data()));
  StepArgs a = call.step;
  a.ts = s.ts.data();
  a.n = call.n;
  // Host scalars: read here (CPU buffers). The counter is the call's own copy (every group
  // reads the same count); group 0's advanced copy becomes the variable's value.
  TFCLIP_FFI_RETURN_IF_ERROR(call.ReadHostScalars(args, &a));
  int64_t counter = 0;
  if (call.has_iterations) {
    counter = *static_cast<const int64_t*>(call.iterations_in);
    a.iterations = &counter;
  }
  s.norms.resize(static_cast<size_t>(call.n));
  a.tensor_norms = s.norms.data();
  a.agc_clipped = static_cast<int64_t*>(call.clipped_out);
  const StepResult r = ClipApplyCpu(a, &s.step, PoolExecutor(&pool));
  if (!r.error.empty()) return ffi::Error::InvalidArgument(r.error);
  *static_cast<bool*>(call.applied_out) = r.applied;
  *static_cast<float*>(call.norm_out) = RoundNorm<float>(r.global_norm);
  WriteNorms(s.norms.data(), call.n, call.tensor_norms_out, ffi::DataType::F32);
  if (call.has_iterations) *static_cast<int64_t*>(call.iterations_out) = counter;
  return ffi::Error::Success();
}

}  // namespace

// Every Host handler binds the same: the FFI's thread pool, operands, results, attributes.
#define TFCLIP_HOST_HANDLER(name, fn)                                                              \
  XLA_FFI_DEFINE_HANDLER(name, fn,                                                                 \
                         ffi::Ffi::Bind()                                                          \
                             .Ctx<ffi::ThreadPool>()                                               \
                             .RemainingArgs()                                                      \
                             .RemainingRets()                                                      \
                             .Attrs<ffi::Dictionary>())
TFCLIP_HOST_HANDLER(kNormHost, NormHost);
TFCLIP_HOST_HANDLER(kClipHost, ClipHost);
TFCLIP_HOST_HANDLER(kApplyHost, ApplyHost);

#if TFCLIP_XLA_STANDALONE
// The standalone module (_jax_ffi, CMakeLists.txt) joins no registry at load: its loader
// registers the handlers by these names (tests/xla_jax/tfclip_jax.py, platform "cpu").
TFCLIP_EXPORT_HANDLER(tfclip_norm_host, kNormHost)
TFCLIP_EXPORT_HANDLER(tfclip_clip_host, kClipHost)
TFCLIP_EXPORT_HANDLER(tfclip_apply_host, kApplyHost)
#else
// TF's XLA registry (XLA_FFI_GetApi is TF's), joined when the op library loads.
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kNormTarget, "Host", kNormHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kClipTarget, "Host", kClipHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kApplyTarget, "Host", kApplyHost);
#endif

}  // namespace xla_glue
}  // namespace tfclip
