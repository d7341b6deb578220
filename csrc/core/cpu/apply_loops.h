// tfclip core, CPU: the element loops of the apply passes, per instruction set: ApplyLoop (each
// element's gradient clipped, then ApplyElem), its in-place and tile forms (ApplyLoopInPlace,
// ApplyTile), the zero-gradient rows of an all-rows sparse unit (ZeroGradLoop), and a
// trust-ratio rule's sums and last pass (ReduceTrustLanes, TrustLoop). Needs cpu/tiles.h and
// cpu/rounding_tiles.h before it.
#pragma once
#ifndef TFCLIP_ISA_NS
#error "cpu/apply_loops.h is compiled for a pass file's instruction set: include csrc/core/cpu/isa.h first"
#endif

namespace tfclip {
namespace TFCLIP_ISA_NS {
namespace {

// The dense apply pass over elements [b, e): each element's gradient, clipped, then ApplyElem.
// G is the gradient's dtype (for the clip's rounding); Gin what `grad` points at: G itself, or
// float (or M) for a gradient already widened (or clipped) into a tile buffer indexed from b
// (kTile). kZero: no gradient at all (an all-rows sparse pass's untouched rows, as stock Keras
// computes them on the densified gradient: the rule with a zero gradient).
// A trust-ratio rule also sums its elements' w^2 and u^2 (ApplyElem's ElemNorms) in fp64 into
// lanes[0..kLanes) and lanes[kLanes..2 kLanes), element i on lane (i - b) % kLanes, as the norm
// pass does; b is a chunk's start or a tile's (a multiple of kLanes past it), so every element
// keeps its lane whatever the tiling.
// kUnitScaled (AGC, G the variable's float or double): element i's gradient times
// unit_scale[i - b] (its unit's scale in the math type), rounded as kScaled rounds.
template <typename Rule, typename V, int kSlots, typename G, bool kScaled, bool kClamped,
          typename Gin = G, bool kTile = !std::is_same_v<Gin, G>, bool kZero = false,
          bool kUnitScaled = false, typename S = V>
void ApplyLoop(const ConstsOf<Rule, V> c, V* __restrict__ var,
               const Gin* __restrict__ grad, S* __restrict__ s0, S* __restrict__ s1,
               S* __restrict__ s2, typename Elem<V>::Math scale, typename Elem<V>::Math lo,
               typename Elem<V>::Math hi, int64_t b, int64_t e, double* __restrict__ lanes,
               const typename Elem<V>::Math* __restrict__ unit_scale = nullptr) {
  // The constants are a by-value copy and the pointers are __restrict__: no store can alias
  // them, so the loop keeps them in registers and vectorizes.
  using M = typename Elem<V>::Math;
  const int64_t gbase = kTile ? b : 0;
  auto elem = [&](int64_t i) __attribute__((always_inline)) {
    M g = M(0);
    if constexpr (!kZero) {
      g = static_cast<M>(Elem<Gin>::Load(grad[i - gbase]));
      if (kScaled) g = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(g * scale)));
      if constexpr (kUnitScaled) {
        g = static_cast<M>(RoundTo<G>(static_cast<typename Elem<G>::Math>(g * unit_scale[i - b])));
      }
      if (kClamped) g = ClampGrad(g, lo, hi);
    }
    return ApplyElem<Rule, kSlots>(c, DenseGrad<M>{g}, var, s0, s1, s2, i);
  };
  if constexpr (Rule::kTrustRatio) {
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const ElemNorms<M> wu = elem(i + k);
        const double w = static_cast<double>(wu.w), u = static_cast<double>(wu.u);
        lanes[k] += w * w;
        lanes[kLanes + k] += u * u;
      }
    }
    for (int k = 0; i < e; ++i, ++k) {
      const ElemNorms<M> wu = elem(i);
      const double w = static_cast<double>(wu.w), u = static_cast<double>(wu.u);
      lanes[k] += w * w;
      lanes[kLanes + k] += u * u;
    }
  } else {
    for (int64_t i = b; i < e; ++i) elem(i);
  }
}

// Lanes of a trust-ratio sum (2 x kLanes), added pairwise into out[0] (w^2) and out[1] (u^2).
inline void ReduceTrustLanes(double* lanes, double* out) {
  for (int h = 0; h < 2; ++h) {
    double* a = lanes + h * kLanes;
    for (int w = kLanes / 2; w > 0; w /= 2) {
      for (int k = 0; k < w; ++k) a[k] += a[k + w];
    }
    out[h] = a[0];
  }
}

// The last pass of a trust-ratio rule over elements [b, e) of one tensor.
template <typename Rule, typename V, int kSlots, typename S>
void TrustLoop(const ConstsOf<Rule, V> c, typename Elem<V>::Math ratio_lr,
               V* __restrict__ var, const S* __restrict__ s0, const S* __restrict__ s1,
               const S* __restrict__ s2, int64_t b, int64_t e) {
  uint16_t bits[std::is_same_v<V, bfloat16> ? kTile : 1];
  for (int64_t t = b; t < e; t += kTile) {
    const int64_t te = e - t < kTile ? e : t + kTile;
    const auto k = WithTileBits<V>(c, t, te, bits);
    for (int64_t i = t; i < te; ++i) TrustElem<Rule, kSlots>(k, ratio_lr, var, s0, s1, s2, i);
  }
}

// ApplyLoop over a tile buffer of already clipped gradients in the math type (indexed from b):
// the loop the 16-bit, mixed-dtype (AnyGrad) and AGC paths share. Kept out of line so each
// (rule, variable dtype, slot count) compiles it once rather than once per gradient dtype and
// path: those copies were most of the CPU passes' compile time (issue 43), and a call per
// 1024-element tile costs nothing measurable.
template <typename Rule, typename V, int kSlots, typename S>
__attribute__((noinline)) void ApplyTile(const ConstsOf<Rule, V> c,
                                         V* __restrict__ var,
                                         const typename Elem<V>::Math* __restrict__ buf,
                                         S* __restrict__ s0, S* __restrict__ s1,
                                         S* __restrict__ s2, int64_t b, int64_t e,
                                         double* __restrict__ lanes) {
  using M = typename Elem<V>::Math;
  if constexpr (std::is_same_v<V, bfloat16> && std::is_same_v<S, bfloat16> && !Rule::kTrustRatio) {
    // A bfloat16 variable and its bf16 slots: widened into float tiles (exact), stepped by the
    // float variable's loop (which vectorizes: the bf16 one, converting at every load and store,
    // did not), and narrowed back, the slots to nearest, the variable to nearest or
    // stochastically: the same values as ApplyElem's per-element stores.
    const int64_t n = e - b;
    float vb[kTile], sb[kSlots > 0 ? kSlots : 1][kTile];
    S* sp[kMaxSlots] = {s0, s1, s2};
    float* p[kMaxSlots] = {nullptr, nullptr, nullptr};
    WidenTile(var + b, vb, n);
    for (int k = 0; k < kSlots; ++k) {
      WidenTile(sp[k] + b, sb[k], n);
      p[k] = sb[k];
    }
    ApplyLoop<Rule, float, kSlots, float, false, false, float, true>(c, vb, buf, p[0], p[1], p[2], 1.0f, 0.0f,
                                                                      0.0f, 0, n, lanes);
    for (int k = 0; k < kSlots; ++k) NarrowBFloat16Tile(sb[k], sp[k] + b, n);
    if (c.round.on) {
      uint16_t bits[kTile];
      FillRoundBitsTile(c.round, b, n, bits);
      NarrowStochasticTile(vb, var + b, bits, n);
    } else {
      NarrowBFloat16Tile(vb, var + b, n);
    }
  } else {
    uint16_t bits[std::is_same_v<V, bfloat16> ? kTile : 1];
    ApplyLoop<Rule, V, kSlots, M, false, false, M, true>(WithTileBits<V>(c, b, e, bits), var, buf, s0, s1, s2,
                                                          M(1), M(0), M(0), b, e, lanes);
  }
}

template <typename Rule, typename V, int kSlots, typename S>
void ZeroGradLoop(const ConstsOf<Rule, V>& c, V* var, S* s0, S* s1, S* s2,
                  int64_t b, int64_t e, double* lanes) {
  using M = typename Elem<V>::Math;
  ApplyLoop<Rule, V, kSlots, M, false, false, M, false, true>(c, var, nullptr, s0, s1, s2, M(1),
                                                                M(0), M(0), b, e, lanes);
}

// ApplyLoop over [b, e) with the gradient read in place and clipped in the loop, in the loop
// built for the clip's shape (scaled, clamped: compile-time, so the loop is branch-free).
template <typename Rule, typename V, typename G, int kSlots, typename S>
void ApplyLoopInPlace(const ConstsOf<Rule, V>& c, V* var, const G* grad, S* s0, S* s1, S* s2,
                      typename Elem<V>::Math scale, typename Elem<V>::Math lo, typename Elem<V>::Math hi,
                      bool scaled, bool clamped, int64_t b, int64_t e, double* lanes) {
  if (scaled && clamped) ApplyLoop<Rule, V, kSlots, G, true, true>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e, lanes);
  else if (scaled) ApplyLoop<Rule, V, kSlots, G, true, false>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e, lanes);
  else if (clamped) ApplyLoop<Rule, V, kSlots, G, false, true>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e, lanes);
  else ApplyLoop<Rule, V, kSlots, G, false, false>(c, var, grad, s0, s1, s2, scale, lo, hi, b, e, lanes);
}

}  // namespace
}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
