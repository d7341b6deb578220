// tfclip core, CPU: the driver. The element passes live in cpu_kernels.inc, compiled per
// instruction set; this file picks the variant at run time and runs a step's passes in order.
#include "csrc/core/cpu_driver.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "csrc/core/cpu_kernels.h"
#include "csrc/core/denormals.h"
#include "csrc/core/validate.h"

namespace tfclip {

#define TFCLIP_DECLARE_ISA(NS) \
  namespace NS {                \
  const CpuKernels& Kernels();  \
  }
TFCLIP_DECLARE_ISA(isa_baseline)
#if TFCLIP_ISA_VARIANTS
TFCLIP_DECLARE_ISA(isa_avx2)
TFCLIP_DECLARE_ISA(isa_avx512)
#endif
#undef TFCLIP_DECLARE_ISA

namespace {

struct Variant {
  const CpuKernels& (*kernels)();
  bool (*supported)();
};

bool Always() { return true; }
#if TFCLIP_ISA_VARIANTS
bool HasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool HasAvx512() {
  __builtin_cpu_init();
  return HasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

// Best first.
const Variant kVariants[] = {
#if TFCLIP_ISA_VARIANTS
    {&isa_avx512::Kernels, &HasAvx512},
    {&isa_avx2::Kernels, &HasAvx2},
#endif
    {&isa_baseline::Kernels, &Always},
};

const CpuKernels* Pick(const char* want) {
  for (const Variant& v : kVariants) {
    if (!v.supported()) continue;
    if (want == nullptr || *want == '\0' || std::string(want) == v.kernels().name) return &v.kernels();
  }
  return nullptr;
}

std::atomic<const CpuKernels*>& Active() {
  static std::atomic<const CpuKernels*> active{[] {
    const CpuKernels* k = Pick(std::getenv("TFCLIP_CPU_ISA"));
    return k != nullptr ? k : Pick(nullptr);  // an unknown or unsupported request: the best
  }()};
  return active;
}

}  // namespace

const CpuKernels& ActiveCpuKernels() { return *Active().load(std::memory_order_acquire); }

std::vector<std::string> SupportedCpuIsas() {
  std::vector<std::string> out;
  for (const Variant& v : kVariants) {
    if (v.supported()) out.push_back(v.kernels().name);
  }
  return out;
}

bool SetCpuIsa(const std::string& name) {
  const CpuKernels* k = Pick(name.c_str());
  if (k == nullptr) return false;
  Active().store(k, std::memory_order_release);
  return true;
}

void SumSquaresCpu(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                   double* per_tensor, double* total, const CpuExecutor& exec) {
  ActiveCpuKernels().sum_squares(ts, n, plan, partials, per_tensor, total, exec);
}

void ScaleCpu(const TensorView* in, const TensorView* out, const ChunkPlan& plan,
              double scale, const CpuExecutor& exec) {
  ActiveCpuKernels().scale(in, out, plan, scale, exec);
}

void ApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
              const ChunkPlan& plan, const ClipFactor* factors, const CpuExecutor& exec) {
  ActiveCpuKernels().apply(rule, hp, ts, plan, factors, exec);
}

void SparseApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,
                    const ClipFactor* factors, const CpuExecutor& exec) {
  ActiveCpuKernels().sparse_apply(rule, hp, ts, sp, factors, exec);
}

double GlobalNormCpu(const TensorView* ts, int n, const CpuExecutor& exec) {
  ChunkPlan plan;
  PlanList(ts, n, &plan);
  std::vector<double> partials(plan.chunks.size());
  double total = 0.0;
  SumSquaresCpu(ts, n, plan, partials.data(), nullptr, &total, exec);
  return std::sqrt(total);
}

void ScaleListCpu(const TensorView* in, const TensorView* out, int n, double scale,
                  const CpuExecutor& exec) {
  ChunkPlan plan;
  PlanList(in, n, &plan);
  ScaleCpu(in, out, plan, scale, exec);
}

template <typename T>
T RoundNorm(double norm) {
  ScopedKeepDenormals keep;
  volatile T r = static_cast<T>(norm);  // converted inside the scope, not hoisted out of it
  return r;
}
template float RoundNorm<float>(double);
template double RoundNorm<double>(double);

std::string NonFiniteError(double norm) {
  std::ostringstream os;
  os << "the global norm of the gradients is " << norm
     << " (non-finite) and nonfinite='raise'; no variable was updated";
  return os.str();
}

std::string StepHParams(const StepArgs& a, HParams* hp) {
  *hp = a.hp;
  if (a.iterations != nullptr) hp->step += static_cast<double>(*a.iterations);
  std::string e = ValidateHParams(a.rule, *hp);
  if (!e.empty() && a.iterations != nullptr) {
    std::ostringstream os;
    os << " (iterations + step = " << hp->step << ")";
    e += os.str();
  }
  if (e.empty()) e = ValidateClipConfig(a.cfg);
  return e;
}

StepResult ClipApplyCpu(const StepArgs& a, StepScratch* s, const CpuExecutor& exec) {
  StepResult r;
  HParams hp;
  r.error = StepHParams(a, &hp);
  if (!r.error.empty()) return r;
  const int n = a.n;
  const ApplyTensor* ts = a.ts;
  // Indices are checked (and grouped) before anything runs: a bad one writes nothing.
  r.error = PlanSparse(ts, n, a.rule, hp, a.lazy, kChunkElems, &s->sparse);
  if (!r.error.empty()) return r;
  s->grads.resize(n);
  for (int i = 0; i < n; ++i) {
    s->grads[i] = TensorView{const_cast<void*>(ts[i].grad), ts[i].grad_size(), ts[i].grad_dtype};
  }
  PlanList(s->grads.data(), n, &s->plan);
  s->per_tensor.assign(n, 0.0);
  s->factors.resize(n);
  double total = 0.0;
  if (NeedsNormPass(a.cfg)) {
    s->partials.resize(s->plan.chunks.size());
    SumSquaresCpu(s->grads.data(), n, s->plan, s->partials.data(), s->per_tensor.data(), &total,
                  exec);
  }
  const ClipOutcome oc = ComputeClipFactors(a.cfg, s->per_tensor.data(), total, n, s->factors.data());
  r.global_norm = oc.global_norm;
  r.nonfinite = !oc.finite;
  if (!oc.finite && a.cfg.policy != NonFinitePolicy::kPropagate) {  // nothing written
    if (a.cfg.policy == NonFinitePolicy::kRaise) r.error = NonFiniteError(r.global_norm);
    return r;
  }
  ApplyCpu(a.rule, hp, ts, s->plan, s->factors.data(), exec);
  SparseApplyCpu(a.rule, hp, ts, s->sparse, s->factors.data(), exec);
  r.applied = true;
  if (a.iterations != nullptr) ++*a.iterations;
  return r;
}

}  // namespace tfclip
