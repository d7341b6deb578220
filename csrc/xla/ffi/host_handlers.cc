// tfclip XLA glue: the Host custom-call handlers (the typed FFI's C API, through ffi_frame.h).
// Each reads the buffers XLA passes (custom_calls.h), checks what only it sees, and makes one
// core call: the CPU driver on the FFI's thread pool. The CUDA ones, on XLA's stream, are in
// cuda_handlers.cc; who registers them where, in handlers.h. No TF header.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/cpu/driver.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/validate.h"
#include "csrc/xla/ffi/custom_calls.h"
#include "csrc/xla/ffi/common.h"
#include "csrc/xla/ffi/handlers.h"
#include "csrc/xla/ffi/legacy_call.h"

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
  explicit PoolParallelFor(const FfiFrame* f) : f_(f) {}

  void operator()(int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    // As the TF kernel's executor (csrc/tf/device.cc): contiguous ranges, as many as the work
    // is worth (CpuRanges). The partition never changes a result.
    // The pool's size; where the API cannot say (TF 2.18), the machine's (TF's intra-op pool
    // defaults to it).
    int64_t threads = f_->NumThreads();
    if (threads < 0) threads = static_cast<int64_t>(std::thread::hardware_concurrency());
    const int64_t parts = CpuRanges(threads, n, cost);
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
    for (int64_t p = 1; p < parts; ++p) {
      // (A task that cannot be scheduled, where there is no pool, is run here by Run's loop.)
      auto* hold = new std::shared_ptr<State>(st);
      if (!f_->Schedule(&RunTask<State>, hold)) delete hold;
    }
    st->Run();
    std::unique_lock<std::mutex> l(st->mu);
    st->cv.wait(l, [&] { return st->done == st->parts; });
    // (A task that starts after this finds next >= parts and touches neither fn nor the caller.)
  }

 private:
  template <typename State>
  static void RunTask(void* data) {
    auto* hold = static_cast<std::shared_ptr<State>*>(data);
    (*hold)->Run();
    delete hold;
  }
  const FfiFrame* f_;
};

CpuExecutor PoolExecutor(const FfiFrame& f) {
  return CpuExecutor{PoolParallelFor(&f)};
}

// ---------------------------------------------------------------- tfclip_norm
FfiStatus NormHost(const FfiFrame& f) {
  std::vector<int64_t> sparse, rows, widths;
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64s("sparse", &sparse));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64s("rows", &rows));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64s("widths", &widths));
  if (f.num_args() < sparse.size() || rows.size() != sparse.size() || widths.size() != sparse.size() ||
      f.num_rets() != 3) {
    return FfiStatus::Internal("tfclip_norm: unexpected operands, results or attributes");
  }
  const int n = static_cast<int>(f.num_args() - sparse.size());
  std::vector<TensorView> views(n);
  TFCLIP_FFI_RETURN_IF_ERROR(ViewArgs(f, 0, n, "t_list", views.data()));
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
      FfiBuffer idx;
      TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(n + k, &idx));
      ApplyTensor& t = ts[sparse[k]];
      t.sparse = true;
      t.indices = static_cast<const int64_t*>(idx.data);
      t.nnz = idx.element_count();
      t.rows = rows[k];
      t.width = widths[k];
      t.size = rows[k] * widths[k];
    }
    SparsePlan plan;
    const std::string e = PlanSparse(ts.data(), n, RuleKind::kSgd, HParams{}, /*lazy=*/true,
                                     kChunkElems, &plan);
    if (!e.empty()) return FfiStatus::InvalidArgument(e);
  }
  std::vector<double> norms(n);
  const double norm = GlobalNormCpu(views.data(), n, PoolExecutor(f), norms.data());
  FfiBuffer r64, rn, rt;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(0, &r64));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(1, &rn));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(2, &rt));
  *static_cast<double*>(r64.data) = norm;
  WriteNorms(&norm, 1, rn.data, rn.dtype);
  WriteNorms(norms.data(), n, rt.data, rt.dtype);
  return FfiStatus::Ok();
}

// ---------------------------------------------------------------- tfclip_clip
FfiStatus ClipHost(const FfiFrame& f) {
  ClipCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(f));
  const int n = call.n;
  const double clip_norm = ReadScalar(call.clip_norm), use_norm = ReadScalar(call.use_norm);
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) return FfiStatus::InvalidArgument(err);
  const CpuExecutor exec = PoolExecutor(f);
  std::vector<double> norms(n);
  double norm = use_norm;
  if (call.given) TensorNorms(nullptr, n, norms.data());  // no norm pass: NaN
  else norm = GlobalNormCpu(call.in.data(), n, exec, norms.data());
  WriteNorms(norms.data(), n, call.tensor_norms.data, call.tensor_norms.dtype);
  // As the TF kernel: the scale comes from the norm rounded to Tnorm.
  WriteNorms(&norm, 1, call.norm.data, call.norm.dtype);
  const double norm_t = ReadScalar(call.norm);
  ScaleListCpu(call.in.data(), call.out.data(), n, GlobalClipScale(clip_norm, norm_t), exec);
  return FfiStatus::Ok();
}

// ---------------------------------------------------------------- tfclip_apply
// Scratch kept per thread across steps (a call of another group on another thread has its own).
struct ApplyScratch {
  StepScratch step;
  std::vector<double> norms;
  std::vector<ApplyTensor> ts;
};

FfiStatus ApplyHost(const FfiFrame& f) {
  ApplyCall call;
  TFCLIP_FFI_RETURN_IF_ERROR(call.Decode(f));
  thread_local ApplyScratch s;
  s.ts.assign(static_cast<size_t>(call.n), ApplyTensor{});
  TFCLIP_FFI_RETURN_IF_ERROR(call.Tensors(f, s.ts.data()));
  StepArgs a = call.step;
  a.ts = s.ts.data();
  a.n = call.n;
  // Host scalars: read here (CPU buffers). The counter is the call's own copy (every group
  // reads the same count); group 0's advanced copy becomes the variable's value.
  call.ReadHostScalars(&a);
  int64_t counter = 0;
  if (call.has_iterations) {
    counter = *static_cast<const int64_t*>(call.iterations_in);
    a.iterations = &counter;
  }
  s.norms.resize(static_cast<size_t>(call.n));
  a.tensor_norms = s.norms.data();
  a.agc_clipped = static_cast<int64_t*>(call.clipped_out);
  const StepResult r = ClipApplyCpu(a, &s.step, PoolExecutor(f));
  if (!r.error.empty()) return FfiStatus::InvalidArgument(r.error);
  *static_cast<bool*>(call.applied_out) = r.applied;
  *static_cast<float*>(call.norm_out) = RoundNorm<float>(r.global_norm);
  WriteNorms(s.norms.data(), call.n, call.tensor_norms_out, XLA_FFI_DataType_F32);
  if (call.has_iterations) *static_cast<int64_t*>(call.iterations_out) = counter;
  return FfiStatus::Ok();
}

}  // namespace

}  // namespace xla_glue
}  // namespace tfclip

// The C entries (handlers.h).
#if TFCLIP_XLA_TYPED_FFI
TFCLIP_EXPORT_HANDLER(tfclip_norm_host, tfclip::xla_glue::NormHost)
TFCLIP_EXPORT_HANDLER(tfclip_clip_host, tfclip::xla_glue::ClipHost)
TFCLIP_EXPORT_HANDLER(tfclip_apply_host, tfclip::xla_glue::ApplyHost)
#else
TFCLIP_EXPORT_LEGACY_HOST_HANDLER(tfclip_norm_host_legacy, tfclip::xla_glue::NormHost)
TFCLIP_EXPORT_LEGACY_HOST_HANDLER(tfclip_clip_host_legacy, tfclip::xla_glue::ClipHost)
TFCLIP_EXPORT_LEGACY_HOST_HANDLER(tfclip_apply_host_legacy, tfclip::xla_glue::ApplyHost)
#endif
