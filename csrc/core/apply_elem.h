// tfclip core: the one per-element apply, and the dispatch every apply pass goes through.
//
// ApplyElem is the wrapper around a rule's Update: load the slots, decoupled weight decay, the
// rule (once, or once per duplicate row of a scatter rule), store. Every apply pass calls it:
// dense chunks, rows no IndexedSlices slice touches, touched rows; on the CPU (cpu_kernels.inc)
// and on CUDA (cuda_apply.cu, cuda_sparse_apply.cu). The code that decides CPU/CUDA bit parity exists once.
//
// The gradient reaches it as a "grads" source, already clipped in the variable's math type M:
//   DenseGrad<M>{g}   a dense element (or a zero one: an untouched row of an all-rows pass)
//   RowGrads<...>     an IndexedSlices row's slices for this column (csrc/core/sparse.h)
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "csrc/core/clip.h"
#include "csrc/core/rules.h"
#include "csrc/core/types.h"

namespace tfclip {

// A rule's step constants (rules.h) in the math type of variable dtype V.
template <typename Rule, typename V>
using ConstsOf = typename Rule::template Consts<typename Elem<V>::Math>;

template <typename M>
struct DenseGrad {
  M g;
  template <typename Rule, typename F>
  TFCLIP_HD void Feed(const StepBase<M>&, const F& update) const {
    update(g, Rule::Second(g));
  }
};

// The rule's Update on one element's loaded values (a functor, not a lambda: TFCLIP_HD forces
// it inline into every instruction-set variant of the CPU loops).
template <typename Rule, typename M>
struct RuleStep {
  const typename Rule::template Consts<M>& c;
  M& v;
  M* s;
  TFCLIP_HD void operator()(M g, M gsq) const { Rule::Update(c, g, gsq, v, s); }
};

// What one element adds to its tensor's sums in a trust-ratio rule's slot pass: the variable
// after weight decay, w, and its update u (Rule::Direction of the stored slots). Zeros for the
// other rules, whose ApplyElem finishes the element.
template <typename M>
struct ElemNorms {
  M w, u;
};

// var[i] and slot k's s_k[i] (k < kSlots; the others are never touched and may be null), in
// storage types V and S (S: V, or bfloat16 for a float variable's bf16 state, SlotStorage),
// updated in place. A trust-ratio rule (rules.h) updates the slots only, and returns the
// element's w and u: its variable is written by TrustElem, a pass later.
// `at`: where element i sits in its tensor, less i (a pass over a vector of loaded values
// indexes them from 0): what a bfloat16 variable's stochastic rounding draws for (StoreVar,
// csrc/core/rounding.h).
template <typename Rule, int kSlots, typename V, typename Grads, typename S>
TFCLIP_HD ElemNorms<typename Elem<V>::Math> ApplyElem(const ConstsOf<Rule, V>& c,
                                                      const Grads& grads, V* var, S* s0, S* s1,
                                                      S* s2, int64_t i, int64_t at = 0) {
  using M = typename Elem<V>::Math;
  static_assert(kSlots >= Rule::kMinSlots && kSlots <= Rule::kMaxSlots, "slot count of the rule");
  static_assert(std::is_same<typename Elem<S>::Math, M>::value, "slots in the variable's math type");
  M s[kMaxSlots] = {M(0), M(0), M(0)};
  if (kSlots > 0) s[0] = Elem<S>::Load(s0[i]);
  if (kSlots > 1) s[1] = Elem<S>::Load(s1[i]);
  if (kSlots > 2) s[2] = Elem<S>::Load(s2[i]);
  M v = DecayVar(c, Elem<V>::Load(var[i]));
  grads.template Feed<Rule>(c, RuleStep<Rule, M>{c, v, s});
  if constexpr (!Rule::kTrustRatio) var[i] = StoreVar<V>(c.round, v, i + at);
  if (kSlots > 0) s0[i] = Elem<S>::Store(s[0]);
  if (kSlots > 1) s1[i] = Elem<S>::Store(s[1]);
  if (kSlots > 2) s2[i] = Elem<S>::Store(s[2]);
  if constexpr (Rule::kTrustRatio) {
    // u from the slots as stored (rounded to S), as TrustElem reads them back: the sums and
    // the step see the same u, as in keras, whose update is computed from the slot variables.
    M sr[kMaxSlots] = {M(0), M(0), M(0)};
    for (int k = 0; k < kSlots; ++k) sr[k] = Elem<S>::Load(Elem<S>::Store(s[k]));
    return ElemNorms<M>{v, Rule::Direction(c, sr)};
  } else {
    return ElemNorms<M>{M(0), M(0)};
  }
}

// A tensor's trust ratio times the learning rate, from its sums of w^2 and u^2 (fp64, in a
// fixed order), as keras computes it in the variable's dtype: |w| / |u| when both are > 0
// (a NaN norm compares false: 1), else 1; then ratio * lr.
template <typename M>
TFCLIP_HD M TrustRatioLr(const StepBase<M>& c, double w2, double u2) {
  const M w = static_cast<M>(std::sqrt(w2)), u = static_cast<M>(std::sqrt(u2));
  const M ratio = w > M(0) ? (u > M(0) ? w / u : M(1)) : M(1);
  return ratio * c.lr;
}

// The last pass of a trust-ratio rule: var[i] after weight decay, stepped by ratio_lr * u.
template <typename Rule, int kSlots, typename V, typename S>
TFCLIP_HD void TrustElem(const ConstsOf<Rule, V>& c,
                         typename Elem<V>::Math ratio_lr, V* var, const S* s0, const S* s1,
                         const S* s2, int64_t i) {
  using M = typename Elem<V>::Math;
  M s[kMaxSlots] = {M(0), M(0), M(0)};
  if (kSlots > 0) s[0] = Elem<S>::Load(s0[i]);
  if (kSlots > 1) s[1] = Elem<S>::Load(s1[i]);
  if (kSlots > 2) s[2] = Elem<S>::Load(s2[i]);
  M v = DecayVar(c, Elem<V>::Load(var[i]));
  Rule::Trust(c, ratio_lr, v, s);
  var[i] = StoreVar<V>(c.round, v, i);
}

// Calls fn(std::integral_constant<int, k>{}) for the runtime slot count k of `Rule`, from the
// rule's own range (kMinSlots..kMaxSlots). A count outside the range calls nothing and returns
// false: the adapters check counts first (NumSlots), so that is a bug, never a silent fallback
// to another count.
template <typename Rule, typename Fn>
TFCLIP_HD bool DispatchSlots(int nslots, Fn&& fn) {
  static_assert(Rule::kMinSlots >= 0 && Rule::kMaxSlots <= kMaxSlots, "slot range");
  bool done = false;
  auto one = [&](auto k) {
    constexpr int kS = decltype(k)::value;
    if constexpr (kS >= Rule::kMinSlots && kS <= Rule::kMaxSlots) {
      if (nslots == kS) {
        fn(k);
        done = true;
      }
    }
  };
  one(std::integral_constant<int, 0>{});
  one(std::integral_constant<int, 1>{});
  one(std::integral_constant<int, 2>{});
  one(std::integral_constant<int, 3>{});
  static_assert(kMaxSlots == 3, "DispatchSlots lists every count up to kMaxSlots");
  return done;
}

// Calls fn(V{}, S{}) for a variable's dtype and its slots' storage type: S = V, or bfloat16 for
// a float variable's bf16 state (bf16_slots; tensors.h, SlotStorage). Host and device.
template <typename Fn>
TFCLIP_HD void DispatchState(DType var, bool bf16_slots, Fn&& fn) {
  if (bf16_slots) return fn(float{}, bfloat16{});
  DispatchDType(var, [&](auto vtag) { fn(vtag, vtag); });
}

// Calls fn(V{}, G{}) for a (variable, gradient) dtype pair: G is the gradient's storage type for
// the pairs with a fused path of their own (the same dtype; half or bfloat16 for a float
// variable), else AnyGrad (any other float pair: read at run time through CastClipGradAt, one
// code path per variable dtype rather than one per pair). Host and device.
template <typename Fn>
TFCLIP_HD void DispatchPair(DType var, DType grad, Fn&& fn) {
  if (var == DType::kFloat && grad == DType::kHalf) return fn(float{}, half{});
  if (var == DType::kFloat && grad == DType::kBFloat16) return fn(float{}, bfloat16{});
  DispatchDType(var, [&](auto v) {
    using V = decltype(v);
    if (var == grad) fn(V{}, V{});
    else fn(V{}, AnyGrad{});
  });
}

// A rule's step constants in both math types (float: half, bfloat16 and float variables;
// double), computed once per step by the CPU driver, the CUDA upload or the finalize kernel.
template <typename Rule>
struct RuleConsts {
  typename Rule::template Consts<float> f;
  typename Rule::template Consts<double> d;
};

template <typename Rule>
TFCLIP_HD RuleConsts<Rule> MakeRuleConsts(const HParams& hp) {
  RuleConsts<Rule> c;
  c.f = Rule::template MakeConsts<float>(hp);
  c.d = Rule::template MakeConsts<double>(hp);
  return c;
}

// The step constants in V's math type, from the float and double sets.
template <typename V, typename Rule>
TFCLIP_HD const ConstsOf<Rule, V>& ConstsFor(const RuleConsts<Rule>& c) {
  if constexpr (std::is_same_v<typename Elem<V>::Math, double>) {
    return c.d;
  } else {
    return c.f;
  }
}

// Element k of a gradient, clipped and in V's math type: for gradient dtype G (AnyGrad: any
// other float dtype than the variable's, read through CastClipGradAt).
template <typename V, typename G>
struct GradReader {
  using M = typename Elem<V>::Math;
  const G* values;
  M scale, lo, hi;
  TFCLIP_HD GradReader(const void* v, DType, const ClipFactor& f)
      : values(static_cast<const G*>(v)),
        scale(InGradDType<G, M>(f.scale)),
        lo(InGradDType<G, M>(f.lo)),
        hi(InGradDType<G, M>(f.hi)) {}
  TFCLIP_HD M operator()(int64_t k) const { return ClipGrad<G, M>(values[k], scale, lo, hi); }
};
template <typename V>
struct GradReader<V, AnyGrad> {
  const void* values;
  DType dtype;
  ClipFactor f;
  TFCLIP_HD GradReader(const void* v, DType t, const ClipFactor& cf) : values(v), dtype(t), f(cf) {}
  TFCLIP_HD typename Elem<V>::Math operator()(int64_t k) const {
    return CastClipGradAt<V>(values, dtype, k, f);
  }
};

}  // namespace tfclip
