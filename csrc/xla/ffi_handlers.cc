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

bool ToCoreDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F16: *out = DType::kHalf; return true;
    case ffi::DataType::BF16: *out = DType::kBFloat16; return true;
    case ffi::DataType::F32: *out = DType::kFloat; return true;
    case ffi::DataType::F64: *out = DType::kDouble; return true;
    default: return false;
  }
}

ffi::Error ToCoreDTypeOr(ffi::DataType t, DType* out) {
  return ToCoreDType(t, out) ? ffi::Error::Success()
                             : ffi::Error::Internal("tfclip custom call: a buffer of an unexpected dtype");
}

ffi::Error ViewBuffer(const ffi::AnyBuffer& b, const char* what, int i, TensorView* out) {
  DType dt;
  if (!ToCoreDType(b.element_type(), &dt)) {
    return ffi::Error::InvalidArgument(std::string(what) + "[" + std::to_string(i) +
                                       "] has an unsupported dtype");
  }
  *out = TensorView{b.untyped_data(), static_cast<int64_t>(b.element_count()), dt};
  return ffi::Error::Success();
}

ffi::Error GetI64(const ffi::Dictionary& attrs, const char* name, int64_t* out) {
  auto v = attrs.get<int64_t>(name);
  if (v.has_error()) return ffi::Error::Internal(std::string("tfclip custom call: attribute ") + name);
  *out = *v;
  return ffi::Error::Success();
}

ffi::Error GetI64s(const ffi::Dictionary& attrs, const char* name, std::vector<int64_t>* out) {
  auto v = attrs.get<ffi::Span<const int64_t>>(name);
  if (v.has_error()) return ffi::Error::Internal(std::string("tfclip custom call: attribute ") + name);
  out->assign(v->begin(), v->end());
  return ffi::Error::Success();
}

#define TFCLIP_FFI_RETURN_IF_ERROR(expr)  \
  do {                                    \
    ::xla::ffi::Error _e = (expr);        \
    if (_e.failure()) return _e;          \
  } while (0)

double ReadScalar(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F64 ? *static_cast<const double*>(b.untyped_data())
                                                : *static_cast<const float*>(b.untyped_data());
}

void WriteNorms(const double* norms, int n, void* out, ffi::DataType dtype) {
  for (int i = 0; i < n; ++i) {
    if (dtype == ffi::DataType::F64) static_cast<double*>(out)[i] = RoundNorm<double>(norms[i]);
    else static_cast<float*>(out)[i] = RoundNorm<float>(norms[i]);
  }
}

int ApplyCall::NumHParams() const {
  int h = 0;
  for (int k = 0; k < kNumHParams; ++k) h += (hmask >> k) & 1u;
  return h;
}

ffi::Error ApplyCall::Decode(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                             const ffi::Dictionary& attrs) {
  int64_t rule, flags, mode, policy, has_use_norm, lazy, sos, ns, iters;
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "rule", &rule));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "flags", &flags));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "mode", &mode));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "policy", &policy));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "has_use_norm", &has_use_norm));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "lazy", &lazy));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "sum_of_squares", &sos));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "nslots", &ns));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "has_iterations", &iters));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64s(attrs, "sparse", &sparse));
  if (rule < 0 || rule >= static_cast<int64_t>(AllRules().size())) {
    return ffi::Error::Internal("tfclip_apply: unknown rule " + std::to_string(rule));
  }
  step.rule = static_cast<RuleKind>(rule);
  for (int k = 0; k < kNumFlags; ++k) step.hp.SetFlag(static_cast<Flag>(k), (flags >> k) & 1);
  step.hp.sum_of_squares = sos != 0;
  step.cfg.mode = static_cast<ClipMode>(mode);
  step.cfg.policy = static_cast<NonFinitePolicy>(policy);
  step.cfg.has_use_norm = has_use_norm != 0;
  step.lazy = lazy != 0;
  nslots = static_cast<int>(ns);
  has_iterations = iters != 0;
  hmask = RuleHParams(step.rule);
  // Operands: (nslots + 2) * n tensors, the sparse indices, the scalars, the counter.
  const size_t fixed = sparse.size() + 1 + (has_iterations ? 1 : 0);
  if (args.size() < fixed || (args.size() - fixed) % static_cast<size_t>(nslots + 2) != 0) {
    return ffi::Error::Internal("tfclip_apply: unexpected operand count " + std::to_string(args.size()));
  }
  n = static_cast<int>((args.size() - fixed) / static_cast<size_t>(nslots + 2));
  const size_t nrets = static_cast<size_t>((nslots + 1) * n) + 3 + (has_iterations ? 1 : 0);
  if (rets.size() != nrets) {
    return ffi::Error::Internal("tfclip_apply: unexpected result count " + std::to_string(rets.size()));
  }
  auto sc = args.get<ffi::AnyBuffer>(ScalarsArg());
  if (sc.has_error()) return sc.error();
  if (sc->element_type() != ffi::DataType::F64 ||
      sc->element_count() != static_cast<size_t>(NumHParams() + 2)) {
    return ffi::Error::Internal("tfclip_apply: bad scalars operand");
  }
  scalars = sc->untyped_data();
  const size_t r0 = static_cast<size_t>((nslots + 1) * n);
  void** outs[] = {&applied_out, &norm_out, &tensor_norms_out, &iterations_out};
  for (size_t k = 0; k < 3 + (has_iterations ? 1u : 0u); ++k) {
    auto r = rets.get<ffi::AnyBuffer>(r0 + k);
    if (r.has_error()) return r.error();
    *outs[k] = (*r)->untyped_data();
  }
  if (has_iterations) {
    auto it = args.get<ffi::AnyBuffer>(ScalarsArg() + 1);
    if (it.has_error()) return it.error();
    iterations_in = it->untyped_data();
  }
  return ffi::Error::Success();
}

ffi::Error ApplyCall::Tensors(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                              ApplyTensor* ts) const {
  for (int i = 0; i < n; ++i) {
    auto v = rets.get<ffi::AnyBuffer>(i);
    auto g = args.get<ffi::AnyBuffer>(static_cast<size_t>((nslots + 1) * n + i));
    if (v.has_error()) return v.error();
    if (g.has_error()) return g.error();
    TensorView vv, gv;
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(**v, "vars", i, &vv));
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(*g, "grads", i, &gv));
    ApplyTensor& t = ts[i];
    t.var = vv.data;
    t.var_dtype = vv.dtype;
    t.size = vv.size;
    t.grad = gv.data;
    t.grad_dtype = gv.dtype;
    for (int k = 0; k < nslots; ++k) {
      auto s = rets.get<ffi::AnyBuffer>(static_cast<size_t>((k + 1) * n + i));
      if (s.has_error()) return s.error();
      t.slots[k] = (*s)->untyped_data();
    }
  }
  for (size_t k = 0; k < sparse.size(); ++k) {
    auto idx = args.get<ffi::AnyBuffer>(static_cast<size_t>((nslots + 2) * n) + k);
    if (idx.has_error()) return idx.error();
    ApplyTensor& t = ts[sparse[k]];
    auto v = rets.get<ffi::AnyBuffer>(static_cast<size_t>(sparse[k]));
    if (v.has_error()) return v.error();
    const auto dims = (*v)->dimensions();
    t.sparse = true;
    t.indices = static_cast<const int64_t*>(idx->untyped_data());
    t.nnz = static_cast<int64_t>(idx->element_count());
    t.rows = dims.size() > 0 ? dims[0] : 0;
    t.width = 1;
    for (size_t d = 1; d < dims.size(); ++d) t.width *= dims[d];
  }
  return ffi::Error::Success();
}

ffi::Error ApplyCall::ReadHostScalars(const ffi::RemainingArgs& args, StepArgs* a) const {
  const double* s = static_cast<const double*>(scalars);
  int j = 0;
  for (int k = 0; k < kNumHParams; ++k) {
    if ((hmask >> k) & 1u) a->hp.Set(static_cast<HP>(k), s[j++]);
  }
  a->cfg.clip = s[j];
  a->cfg.use_norm = s[j + 1];
  return ffi::Error::Success();
}

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
    // As the TF kernel's executor (csrc/tf/kernels.cc): contiguous ranges, as many as the work
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
  for (int i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(*b, "t_list", i, &views[i]));
  }
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
  int64_t given = 0;
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "use_given_norm", &given));
  const int n = static_cast<int>(args.size()) - 2;
  std::vector<TensorView> in(n), out(n);
  for (int i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(*b, "t_list", i, &in[i]));
    auto o = rets.get<ffi::AnyBuffer>(i);
    if (o.has_error()) return o.error();
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(**o, "t_list", i, &out[i]));
  }
  auto c = args.get<ffi::AnyBuffer>(n);
  auto u = args.get<ffi::AnyBuffer>(n + 1);
  if (c.has_error()) return c.error();
  if (u.has_error()) return u.error();
  const double clip_norm = ReadScalar(*c), use_norm = ReadScalar(*u);
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  auto rn = rets.get<ffi::AnyBuffer>(n);
  auto rt = rets.get<ffi::AnyBuffer>(n + 1);
  if (rn.has_error()) return rn.error();
  if (rt.has_error()) return rt.error();
  const CpuExecutor exec = PoolExecutor(&pool);
  std::vector<double> norms(n);
  double norm = use_norm;
  if (given) TensorNorms(nullptr, n, norms.data());  // no norm pass: NaN
  else norm = GlobalNormCpu(in.data(), n, exec, norms.data());
  WriteNorms(norms.data(), n, (*rt)->untyped_data(), (*rt)->element_type());
  // As the TF kernel: the scale comes from the norm rounded to Tnorm.
  WriteNorms(&norm, 1, (*rn)->untyped_data(), (*rn)->element_type());
  const double norm_t = ReadScalar(**rn);
  ScaleListCpu(in.data(), out.data(), n, GlobalClipScale(clip_norm, norm_t), exec);
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
  const StepResult r = ClipApplyCpu(a, &s.step, PoolExecutor(&pool));
  if (!r.error.empty()) return ffi::Error::InvalidArgument(r.error);
  *static_cast<bool*>(call.applied_out) = r.applied;
  *static_cast<float*>(call.norm_out) = RoundNorm<float>(r.global_norm);
  WriteNorms(s.norms.data(), call.n, call.tensor_norms_out, ffi::DataType::F32);
  if (call.has_iterations) *static_cast<int64_t*>(call.iterations_out) = counter;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kNormHost, NormHost,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER(kClipHost, ClipHost,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER(kApplyHost, ApplyHost,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs<ffi::Dictionary>());

XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kNormTarget, "Host", kNormHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kClipTarget, "Host", kClipHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kApplyTarget, "Host", kApplyHost);

}  // namespace xla_glue
}  // namespace tfclip
