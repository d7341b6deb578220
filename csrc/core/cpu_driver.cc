// tfclip core, CPU: the norm, scale and apply passes over the chunk plan of a whole list.
#include "csrc/core/cpu_driver.h"

#include "csrc/core/sparse.h"

#include <cmath>
#include <type_traits>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define TFCLIP_HAVE_MXCSR 1
#endif

namespace tfclip {
namespace {

// Calls fn(StorageType{}) for a runtime dtype.
template <typename Fn>
void DispatchDType(DType t, Fn&& fn) {
  switch (t) {
#define TFCLIP_DISPATCH_CASE(E, S, M, N) \
  case DType::E:                         \
    fn(S{});                             \
    break;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_DISPATCH_CASE)
#undef TFCLIP_DISPATCH_CASE
  }
}

// TF runs kernels with flush-to-zero and denormals-are-zero set; the norm pass must still see
// subnormal gradients (their norm is small, not zero), so it clears both for its duration.
class ScopedKeepDenormals {
 public:
#if TFCLIP_HAVE_MXCSR
  ScopedKeepDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFtzDaz); }
  ~ScopedKeepDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bits 15 (FTZ) and 6 (DAZ)
  unsigned saved_;
#endif
};

// Sum of squares of one chunk in a fixed order: four fp64 lanes, then lane 0..3 added.
template <typename T>
double ChunkSumSquares(const T* p, int64_t b, int64_t e) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = b;
  for (; i + 4 <= e; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = static_cast<double>(Elem<T>::Load(p[i + k]));
      acc[k] += x * x;
    }
  }
  for (int k = 0; i < e; ++i, ++k) {
    const double x = static_cast<double>(Elem<T>::Load(p[i]));
    acc[k] += x * x;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T>
void ScaleChunk(const T* in, T* out, int64_t b, int64_t e, double scale) {
  using M = typename Elem<T>::Math;
  const M s = RoundTo<T>(static_cast<M>(scale));
  for (int64_t i = b; i < e; ++i) out[i] = Elem<T>::Store(Elem<T>::Load(in[i]) * s);
}

template <typename Rule, typename V, typename G, int kSlots, bool kScaled, bool kClamped>
void ApplyLoop(const StepConsts<typename Elem<V>::Math> c, V* __restrict__ var,
               const G* __restrict__ grad, V* __restrict__ s0, V* __restrict__ s1,
               V* __restrict__ s2, typename Elem<V>::Math scale, typename Elem<V>::Math lo,
               typename Elem<V>::Math hi, int64_t b, int64_t e) {
  // The constants are a by-value copy and the pointers are __restrict__: no store can alias
  // them, so the loop keeps them in registers and vectorizes.
  using M = typename Elem<V>::Math;
  for (int64_t i = b; i < e; ++i) {
    M g = static_cast<M>(Elem<G>::Load(grad[i]));
    if (kScaled) g = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(g * scale)));
    if (kClamped) g = ClampGrad(g, lo, hi);
    M s[kMaxSlots] = {M(0), M(0), M(0)};
    if (kSlots > 0) s[0] = Elem<V>::Load(s0[i]);
    if (kSlots > 1) s[1] = Elem<V>::Load(s1[i]);
    if (kSlots > 2) s[2] = Elem<V>::Load(s2[i]);
    M v = DecayVar(c, Elem<V>::Load(var[i]));
    Rule::Update(c, g, g * g, v, s);
    var[i] = Elem<V>::Store(v);
    if (kSlots > 0) s0[i] = Elem<V>::Store(s[0]);
    if (kSlots > 1) s1[i] = Elem<V>::Store(s[1]);
    if (kSlots > 2) s2[i] = Elem<V>::Store(s[2]);
  }
}

template <typename Rule, typename V, typename G>
void ApplyChunk(const StepConsts<typename Elem<V>::Math>& c, const ApplyTensor& t, int nslots,
                const ClipFactor& f, int64_t b, int64_t e) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  const G* grad = static_cast<const G*>(t.grad);
  V* s0 = static_cast<V*>(t.slots[0]);
  V* s1 = static_cast<V*>(t.slots[1]);
  V* s2 = static_cast<V*>(t.slots[2]);
  const M scale = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(f.scale)));
  const M lo = static_cast<M>(f.lo), hi = static_cast<M>(f.hi);
  const bool scaled = f.scale != 1.0;
  const bool clamped = std::isfinite(f.lo) || std::isfinite(f.hi);
  // Compile-time slot count and clip shape: branch-free inner loops.
  auto run = [&](auto slots_tag) {
    constexpr int kS = decltype(slots_tag)::value;
    if (scaled && clamped) ApplyLoop<Rule, V, G, kS, true, true>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e);
    else if (scaled) ApplyLoop<Rule, V, G, kS, true, false>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e);
    else if (clamped) ApplyLoop<Rule, V, G, kS, false, true>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e);
    else ApplyLoop<Rule, V, G, kS, false, false>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e);
  };
  switch (nslots) {
    case 0: run(std::integral_constant<int, 0>{}); break;
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    default: run(std::integral_constant<int, 3>{}); break;
  }
}

// Calls fn(V{}, G{}) for the allowed (variable, gradient) dtype pairs.
template <typename Fn>
void DispatchPair(DType var, DType grad, Fn&& fn) {
  if (var == DType::kFloat && grad == DType::kHalf) return fn(float{}, half{});
  if (var == DType::kFloat && grad == DType::kBFloat16) return fn(float{}, bfloat16{});
  DispatchDType(var, [&](auto v) { fn(v, v); });
}


// An all-rows sparse pass over rows no slice touches: the rule with a zero gradient, as stock
// Keras computes it on the densified gradient. Branch-free, vectorized like ApplyLoop.
template <typename Rule, typename V, int kSlots>
void ZeroGradLoop(const StepConsts<typename Elem<V>::Math> c, V* __restrict__ var,
                  V* __restrict__ s0, V* __restrict__ s1, V* __restrict__ s2, int64_t b, int64_t e) {
  using M = typename Elem<V>::Math;
  for (int64_t i = b; i < e; ++i) {
    M s[kMaxSlots] = {M(0), M(0), M(0)};
    if (kSlots > 0) s[0] = Elem<V>::Load(s0[i]);
    if (kSlots > 1) s[1] = Elem<V>::Load(s1[i]);
    if (kSlots > 2) s[2] = Elem<V>::Load(s2[i]);
    M v = DecayVar(c, Elem<V>::Load(var[i]));
    Rule::Update(c, M(0), M(0), v, s);
    var[i] = Elem<V>::Store(v);
    if (kSlots > 0) s0[i] = Elem<V>::Store(s[0]);
    if (kSlots > 1) s1[i] = Elem<V>::Store(s[1]);
    if (kSlots > 2) s2[i] = Elem<V>::Store(s[2]);
  }
}

// One unit of a sparse pass (see sparse.h): touched rows through SparseElem, and in an
// all-rows unit the untouched runs between them through ZeroGradLoop.
template <typename Rule, typename V, typename G, int kSlots>
void SparseUnitCpu(const StepConsts<typename Elem<V>::Math>& c, const ApplyTensor& t,
                   const ClipFactor& f, const SparsePlan& sp, const SparseUnit& u) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  const G* values = static_cast<const G*>(t.grad);
  V* sl[kMaxSlots] = {static_cast<V*>(t.slots[0]), static_cast<V*>(t.slots[1]),
                      static_cast<V*>(t.slots[2])};
  const M scale = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(f.scale)));
  const M lo = static_cast<M>(f.lo), hi = static_cast<M>(f.hi);
  const int64_t w = t.width;
  auto touched = [&](int64_t uidx) {
    const int64_t row = sp.urows[uidx];
    for (int64_t col = 0; col < w; ++col) {
      const int64_t i = row * w + col;
      V s[kMaxSlots];
      for (int k = 0; k < kSlots; ++k) s[k] = sl[k][i];
      SparseElem<Rule, V, G, kSlots>(c, scale, lo, hi, values, w, col, sp.order.data(),
                                     sp.ustart[uidx], sp.ustart[uidx + 1], var[i], s);
      for (int k = 0; k < kSlots; ++k) sl[k][i] = s[k];
    }
  };
  if (!u.all_rows) {
    for (int64_t x = u.begin; x < u.end; ++x) touched(x);
    return;
  }
  int64_t row = u.begin;
  for (int64_t x = u.u_begin; x <= u.u_end; ++x) {
    const int64_t next = x < u.u_end ? sp.urows[x] : u.end;
    if (next > row) ZeroGradLoop<Rule, V, kSlots>(c, var, sl[0], sl[1], sl[2], row * w, next * w);
    if (x < u.u_end) touched(x);
    row = next + 1;
  }
}

// The slot counts each rule can have (SGD none, momentum one, Adam two or three).
template <typename Rule, typename Fn>
void DispatchSlots(int nslots, Fn&& fn) {
  if constexpr (std::is_same_v<Rule, SgdRule>) {
    fn(std::integral_constant<int, 0>{});
  } else if constexpr (std::is_same_v<Rule, AdamRule>) {
    if (nslots == 3) fn(std::integral_constant<int, 3>{});
    else fn(std::integral_constant<int, 2>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void SumSquaresCpu(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                   double* per_tensor, double* total, const CpuExecutor& exec) {
  const int64_t nchunks = static_cast<int64_t>(plan.chunks.size());
  if (nchunks > 0) {
    exec.parallel_for(plan.num_blocks(), kChunkElems * kNormCostPerElem, [&](int64_t bb, int64_t be) {
      ScopedKeepDenormals keep;
      for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
        const Chunk& ch = plan.chunks[c];
        const TensorView& t = ts[ch.tensor];
        DispatchDType(t.dtype, [&](auto tag) {
          using T = decltype(tag);
          partials[c] = ChunkSumSquares(static_cast<const T*>(t.data), ch.begin, ch.end);
        });
      }
    });
  }
  // Reduce in slot order: the same bits whatever the partition above.
  if (per_tensor != nullptr) {
    for (int i = 0; i < n; ++i) per_tensor[i] = 0.0;
  }
  double sum = 0.0;
  for (int64_t c = 0; c < nchunks; ++c) {
    sum += partials[c];
    if (per_tensor != nullptr) per_tensor[plan.chunks[c].tensor] += partials[c];
  }
  *total = sum;
}

void ScaleCpu(const TensorView* in, const TensorView* out, const ChunkPlan& plan,
              double scale, const CpuExecutor& exec) {
  if (plan.chunks.empty()) return;
  exec.parallel_for(plan.num_blocks(), kChunkElems * kNormCostPerElem, [&](int64_t bb, int64_t be) {
    for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
      const Chunk& ch = plan.chunks[c];
      DispatchDType(in[ch.tensor].dtype, [&](auto tag) {
        using T = decltype(tag);
        ScaleChunk(static_cast<const T*>(in[ch.tensor].data), static_cast<T*>(out[ch.tensor].data),
                   ch.begin, ch.end, scale);
      });
    }
  });
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

void ApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
              const ChunkPlan& plan, const ClipFactor* factors, const CpuExecutor& exec) {
  if (plan.chunks.empty()) return;
  const int nslots = NumSlots(rule, hp);
  const StepConsts<float> cf = MakeStepConsts<float>(hp);
  const StepConsts<double> cd = MakeStepConsts<double>(hp);
  DispatchRule(rule, [&](auto rule_tag) {
    using Rule = decltype(rule_tag);
    exec.parallel_for(plan.num_blocks(), kChunkElems * kApplyCostPerElem, [&](int64_t bb, int64_t be) {
      for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
        const Chunk& ch = plan.chunks[c];
        const ApplyTensor& t = ts[ch.tensor];
        if (t.sparse) continue;  // its chunks cover the values (norm); SparseApplyCpu applies it
        DispatchPair(t.var_dtype, t.grad_dtype, [&](auto vtag, auto gtag) {
          using V = decltype(vtag);
          using G = decltype(gtag);
          if constexpr (std::is_same_v<typename Elem<V>::Math, double>) {
            ApplyChunk<Rule, V, G>(cd, t, nslots, factors[ch.tensor], ch.begin, ch.end);
          } else {
            ApplyChunk<Rule, V, G>(cf, t, nslots, factors[ch.tensor], ch.begin, ch.end);
          }
        });
      }
    });
  });
}

template <typename T>
T RoundNorm(double norm) {
  ScopedKeepDenormals keep;
  volatile T r = static_cast<T>(norm);  // converted inside the scope, not hoisted out of it
  return r;
}
template float RoundNorm<float>(double);
template double RoundNorm<double>(double);

void SparseApplyCpu(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,
                    const ClipFactor* factors, const CpuExecutor& exec) {
  if (sp.units.empty()) return;
  const int nslots = NumSlots(rule, hp);
  const StepConsts<float> cf = MakeStepConsts<float>(hp);
  const StepConsts<double> cd = MakeStepConsts<double>(hp);
  DispatchRule(rule, [&](auto rule_tag) {
    using Rule = decltype(rule_tag);
    const int64_t nunits = static_cast<int64_t>(sp.units.size());
    exec.parallel_for(nunits, kChunkElems * kApplyCostPerElem, [&](int64_t ub, int64_t ue) {
      for (int64_t x = ub; x < ue; ++x) {
        const SparseUnit& u = sp.units[x];
        const ApplyTensor& t = ts[u.tensor];
        DispatchPair(t.var_dtype, t.grad_dtype, [&](auto vtag, auto gtag) {
          using V = decltype(vtag);
          using G = decltype(gtag);
          DispatchSlots<Rule>(nslots, [&](auto slots_tag) {
            constexpr int kS = decltype(slots_tag)::value;
            if constexpr (std::is_same_v<typename Elem<V>::Math, double>) {
              SparseUnitCpu<Rule, V, G, kS>(cd, t, factors[u.tensor], sp, u);
            } else {
              SparseUnitCpu<Rule, V, G, kS>(cf, t, factors[u.tensor], sp, u);
            }
          });
        });
      }
    });
  });
}

StepResult ClipApplyCpu(RuleKind rule, const HParams& hp, const ClipConfig& cfg,
                        const ApplyTensor* ts, int n, bool lazy, StepScratch* s,
                        const CpuExecutor& exec) {
  StepResult r;
  // Indices are checked (and grouped) before anything runs: a bad one writes nothing.
  r.error = PlanSparse(ts, n, rule, hp, lazy, kChunkElems, &s->sparse);
  if (!r.error.empty()) return r;
  s->grads.resize(n);
  for (int i = 0; i < n; ++i) {
    s->grads[i] = TensorView{const_cast<void*>(ts[i].grad), ts[i].grad_size(), ts[i].grad_dtype};
  }
  PlanList(s->grads.data(), n, &s->plan);
  s->per_tensor.assign(n, 0.0);
  s->factors.resize(n);
  double total = 0.0;
  if (NeedsNormPass(cfg)) {
    s->partials.resize(s->plan.chunks.size());
    SumSquaresCpu(s->grads.data(), n, s->plan, s->partials.data(), s->per_tensor.data(), &total,
                  exec);
  }
  const ClipOutcome oc = ComputeClipFactors(cfg, s->per_tensor.data(), total, n, s->factors.data());
  r.global_norm = oc.global_norm;
  r.nonfinite = !oc.finite;
  if (!oc.finite && cfg.policy != NonFinitePolicy::kPropagate) return r;  // nothing written
  ApplyCpu(rule, hp, ts, s->plan, s->factors.data(), exec);
  SparseApplyCpu(rule, hp, ts, s->sparse, s->factors.data(), exec);
  r.applied = true;
  return r;
}

}  // namespace tfclip
