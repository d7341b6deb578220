// tfclip core, CPU: the dense apply pass (Apply: each chunk's gradient clipped, then ApplyElem),
// per instruction set (cpu/isa.h): a gradient of its variable's dtype read in place (ApplyChunk),
// a 16-bit one widened a tile at a time, any other cast into a tile (ApplyChunkAnyGrad); AGC's
// per-unit scales (ApplyChunkAgc, AgcScaleTile); a float32 variable's narrow state, its bfloat16
// slots or int8 codes converted a tile at a time by the active variant's state tiles
// (ApplyChunkNarrowState, Bf16Slots, Q8Slots; pass_state_tiles.cc).
#include <cmath>
#include <type_traits>
#include "csrc/core/cpu/kernels.h"
#include "csrc/core/cpu/denormals.h"
#include "csrc/core/agc.h"
#include "csrc/core/apply_elem.h"
#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"
#include "csrc/core/sparse.h"

#include "csrc/core/cpu/isa.h"  // from here to TFCLIP_ISA_END: TFCLIP_CPU_ISA's instruction set
#include "csrc/core/cpu/tiles.h"
#include "csrc/core/cpu/rounding_tiles.h"
#include "csrc/core/cpu/apply_loops.h"

namespace tfclip {
TFCLIP_CPU_PASSES(TFCLIP_ISA_NS)
namespace TFCLIP_ISA_NS {
namespace {

// A chunk [b, e) of a dense tensor; a trust-ratio rule's sums of the chunk into trust[0..2).
template <typename Rule, typename V, typename G, int kSlots>
void ApplyChunk(const ConstsOf<Rule, V>& c, const ApplyTensor& t,
                const ClipFactor& f, int64_t b, int64_t e, double* trust) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  const G* grad = static_cast<const G*>(t.grad);
  V* s0 = static_cast<V*>(t.slots[0]);
  V* s1 = static_cast<V*>(t.slots[1]);
  V* s2 = static_cast<V*>(t.slots[2]);
  const M scale = InGradDType<G, M>(f.scale);
  const M lo = InGradDType<G, M>(f.lo), hi = InGradDType<G, M>(f.hi);
  const bool scaled = f.scale != 1.0;
  const bool clamped = std::isfinite(f.lo) || std::isfinite(f.hi);
  double lanes[2 * kLanes] = {};
  if constexpr (!kWiden<G>) {
    // The gradient read in place, clipped in the loop (a compile-time clip shape: branch-free).
    // A loop reading the gradient into a buffer first stalls on its loads alone (benchmarks/
    // NOTES.md 29: the clip_by_value step took 1.1-1.5x the global clip's through one).
    ApplyLoopInPlace<Rule, V, G, kSlots>(c, var, grad, s0, s1, s2, scale, lo, hi, scaled, clamped, b, e, lanes);
  } else {
    // A 16-bit gradient: a tile at a time widened (and scaled, rounded as TF rounds) into a
    // float buffer by a loop that vectorizes, clamped there for clip_by_value, then the one
    // tile loop the AnyGrad and AGC paths use too. One loop per rule and variable dtype for
    // every 16-bit clip shape: these passes are most of the build's compile time, once per
    // instruction set.
    static_assert(std::is_same_v<M, float>, "a 16-bit gradient pairs with a float-math variable");
    float buf[kTile];
    for (int64_t t0 = b; t0 < e; t0 += kTile) {
      const int64_t n = e - t0 < kTile ? e - t0 : kTile;
      if (scaled) {
        WidenScaledTile(grad + t0, buf, n, static_cast<float>(scale));
      } else {
        WidenTile(grad + t0, buf, n);
      }
      if (clamped) {
        for (int64_t j = 0; j < n; ++j) buf[j] = ClampGrad(buf[j], lo, hi);
      }
      ApplyTile<Rule, V, kSlots>(c, var, buf, s0, s1, s2, t0, t0 + n, lanes);
    }
  }
  if constexpr (Rule::kTrustRatio) ReduceTrustLanes(lanes, trust);
}

// A tile [i, i + n) of a gradient of another dtype than its variable (AnyGrad), clipped in its
// own dtype and cast to the variable's math type into buf. Out of line and rule-free: the cast
// loops depend on the dtype pair alone, so they compile once per variable dtype, not once per
// rule and slot count as well (issue 43: these copies were a quarter of the passes' compile time).
template <typename V>
__attribute__((noinline)) void CastClipTile(const ApplyTensor& t, const ClipFactor& f, int64_t i,
                                            int64_t n, typename Elem<V>::Math* __restrict__ buf) {
  DispatchDType(t.grad_dtype, [&](auto gtag) {
    using G = decltype(gtag);
    const G* grad = static_cast<const G*>(t.grad) + i;
    for (int64_t j = 0; j < n; ++j) buf[j] = CastClipGrad<G, V>(grad[j], f);
  });
}

// A chunk whose gradient has another dtype than its variable (AnyGrad, not a fused pair): a
// tile at a time, the gradient is clipped in its own dtype and cast to the variable's into a
// buffer of the math type, which ApplyTile then reads as a clip-free gradient.
template <typename Rule, typename V, int kSlots>
void ApplyChunkAnyGrad(const ConstsOf<Rule, V>& c, const ApplyTensor& t,
                       const ClipFactor& f, int64_t b, int64_t e, double* trust) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  V* s0 = static_cast<V*>(t.slots[0]);
  V* s1 = static_cast<V*>(t.slots[1]);
  V* s2 = static_cast<V*>(t.slots[2]);
  M buf[kTile];
  double lanes[2 * kLanes] = {};
  for (int64_t i = b; i < e; i += kTile) {
    const int64_t n = e - i < kTile ? e - i : kTile;
    CastClipTile<V>(t, f, i, n, buf);
    ApplyTile<Rule, V, kSlots>(c, var, buf, s0, s1, s2, i, i + n, lanes);
  }
  if constexpr (Rule::kTrustRatio) ReduceTrustLanes(lanes, trust);
}

// AGC's per-element scales of a tile: element j's unit's scale, in GM (the gradient's math
// type), for n elements from unit column *col (which walks on, wrapping at units). A run of
// consecutive units at a time: plain loops that vectorize, no modulo per element.
template <typename G>
void AgcTileScales(const double* us, int64_t units, int64_t* col, int64_t n,
                   typename Elem<G>::Math* __restrict__ sb) {
  using GM = typename Elem<G>::Math;
  if (units == 1) {
    const GM s = InGradDType<G, GM>(us[0]);
    for (int64_t j = 0; j < n; ++j) sb[j] = s;
    return;
  }
  int64_t c = *col;
  for (int64_t j = 0; j < n;) {
    const int64_t len = n - j < units - c ? n - j : units - c;
    for (int64_t k = 0; k < len; ++k) sb[j + k] = InGradDType<G, GM>(us[c + k]);
    j += len;
    c += len;
    if (c == units) c = 0;
  }
  *col = c;
}

// An AGC tile [i, i + n) of any gradient into buf: each element times its unit's scale in the
// gradient's dtype, as TF's `g * cast(scale, g.dtype)`, cast to the variable's math type.
// Out of line and rule-free, as CastClipTile.
template <typename V>
__attribute__((noinline)) void AgcScaleTile(const ApplyTensor& t, const double* us, int64_t units,
                                            int64_t* col, int64_t i, int64_t n,
                                            typename Elem<V>::Math* __restrict__ buf) {
  using M = typename Elem<V>::Math;
  DispatchDType(t.grad_dtype, [&](auto gtag) {
    using G = decltype(gtag);
    using GM = typename Elem<G>::Math;
    const G* __restrict__ grad = static_cast<const G*>(t.grad) + i;
    GM sb[kTile];
    AgcTileScales<G>(us, units, col, n, sb);
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = RoundTo<V>(static_cast<M>(RoundTo<G>(Elem<G>::Load(grad[j]) * sb[j])));
    }
  });
}

// A chunk of an AGC step (clip mode kAgc): each element's gradient times its unit's scale
// (f.unit_scale[i % f.units]), in the gradient's dtype as TF's `g * cast(scale, g.dtype)`, cast
// to the variable's dtype. A float or double gradient of its variable's dtype is read by
// ApplyLoop itself with a tile of scales beside the variable and slots (a separate loop reading
// the gradient into a buffer first stalled on its loads alone: the step took 2x the fixed clip's
// on BERT shapes, benchmarks/NOTES.md 29); any other gradient is scaled and cast into a buffer
// of the math type (AgcScaleTile), which ApplyTile reads as a clip-free gradient.
template <typename Rule, typename V, int kSlots>
void ApplyChunkAgc(const ConstsOf<Rule, V>& c, const ApplyTensor& t,
                   const ClipFactor& f, int64_t b, int64_t e, double* trust) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  V* s0 = static_cast<V*>(t.slots[0]);
  V* s1 = static_cast<V*>(t.slots[1]);
  V* s2 = static_cast<V*>(t.slots[2]);
  const double* us = f.unit_scale;
  const int64_t units = f.units;
  int64_t col = b % units;
  M buf[kTile];
  double lanes[2 * kLanes] = {};
  for (int64_t i = b; i < e; i += kTile) {
    const int64_t n = e - i < kTile ? e - i : kTile;
    if constexpr (!kWiden<V>) {
      if (t.grad_dtype == kDTypeOf<V>) {
        AgcTileScales<V>(us, units, &col, n, buf);
        ApplyLoop<Rule, V, kSlots, V, false, false, V, false, false, true>(
            c, var, static_cast<const V*>(t.grad), s0, s1, s2, M(1), M(0), M(0), i, i + n, lanes, buf);
        continue;
      }
    }
    AgcScaleTile<V>(t, us, units, &col, i, n, buf);
    ApplyTile<Rule, V, kSlots>(c, var, buf, s0, s1, s2, i, i + n, lanes);
  }
  if constexpr (Rule::kTrustRatio) ReduceTrustLanes(lanes, trust);
}



// A float variable's bf16 slots (SlotStorage::kBFloat16) as ApplyChunkNarrowState reads and
// writes them: widened exactly, rounded back to nearest even.
struct Bf16Slots {
  bfloat16* s[kMaxSlots];
  const CpuKernels& kernels = ActiveCpuKernels();  // (its tiles: pass_state_tiles.cc)
  explicit Bf16Slots(const ApplyTensor& t)
      : s{static_cast<bfloat16*>(t.slots[0]), static_cast<bfloat16*>(t.slots[1]),
          static_cast<bfloat16*>(t.slots[2])} {}
  void Widen(int k, int64_t i, int64_t n, float* out) const { kernels.bf16_widen(s[k] + i, out, n); }
  void Narrow(int k, const float* in, int64_t i, int64_t n) const { kernels.bf16_narrow(in, s[k] + i, n); }
};

// A float variable's int8 slots (SlotStorage::kInt8, csrc/core/quant8.h): code indices and a
// float32 absmax per kQuantBlock elements, converted a tile at a time by the active variant's
// Q8WidenTile and Q8NarrowTile (pass_state_tiles.cc: the AVX-512 one even where the apply passes are
// AVX2's). A tile starts at a multiple of kQuantBlock (chunks start at multiples of
// kChunkElems), so it holds whole blocks, the tensor's last one perhaps short.
template <typename Rule>
struct Q8Slots {
  uint8_t* q[kMaxSlots];
  float* absmax[kMaxSlots];
  const CodeIndex* ci[kMaxSlots];
  const CpuKernels& kernels = ActiveCpuKernels();
  explicit Q8Slots(const ApplyTensor& t) {
    for (int k = 0; k < kMaxSlots; ++k) {
      q[k] = static_cast<uint8_t*>(t.slots[k]);
      absmax[k] = t.absmax[k];
      ci[k] = &DynamicCodeIndex(!((Rule::kUnsignedSlots >> k) & 1u));
    }
  }
  void Widen(int k, int64_t i, int64_t n, float* out) const {
    kernels.q8_widen(q[k] + i, absmax[k] + i / kQuantBlock, *ci[k], out, n);
  }
  void Narrow(int k, const float* in, int64_t i, int64_t n) const {
    kernels.q8_narrow(in, *ci[k], q[k] + i, absmax[k] + i / kQuantBlock, n);
  }
};
static_assert(kTile % kQuantBlock == 0, "a tile holds whole quantization blocks");
static_assert(kChunkElems % kQuantBlock == 0, "chunks start at a block");

// A chunk of a float variable whose slots are narrower than float (bf16 or int8 state:
// Bf16Slots, Q8Slots), any gradient dtype and any clip. A tile at a time the slots are widened
// into float buffers, the float variable's own loops run on them, and the slots are narrowed
// back: no copy of the rule per state type. The loops: for a float gradient and a global,
// per-tensor or value clip, ApplyChunk's (the gradient read and clipped in place); else the tile
// loop of the 16-bit gradients, the gradient clipped and cast into a float buffer first
// (CastClipTile: for a float gradient the fused loop's bits; AGC: AgcScaleTile). A trust-ratio
// rule (bf16 state only; ValidateState refuses int8) instead reads and writes the bf16 slots in
// the tile loop: its u must come from the slots as stored.
template <typename Rule, int kSlots, typename Slots>
void ApplyChunkNarrowState(const ConstsOf<Rule, float>& c, const ApplyTensor& t,
                           const ClipFactor& f, int64_t b, int64_t e, double* trust) {
  float* var = static_cast<float*>(t.var);
  const Slots slots(t);
  const bool in_place = !Rule::kTrustRatio && t.grad_dtype == DType::kFloat && f.unit_scale == nullptr;
  const float scale = InGradDType<float, float>(f.scale);
  const float lo = InGradDType<float, float>(f.lo), hi = InGradDType<float, float>(f.hi);
  const bool scaled = f.scale != 1.0;
  const bool clamped = std::isfinite(f.lo) || std::isfinite(f.hi);
  const int64_t units = f.units;
  int64_t col = units > 0 ? b % units : 0;
  float buf[kTile];
  double lanes[2 * kLanes] = {};
  for (int64_t i = b; i < e; i += kTile) {
    const int64_t n = e - i < kTile ? e - i : kTile;
    if (!in_place) {
      if (f.unit_scale != nullptr) {
        AgcScaleTile<float>(t, f.unit_scale, units, &col, i, n, buf);
      } else {
        CastClipTile<float>(t, f, i, n, buf);
      }
    }
    if constexpr (Rule::kTrustRatio) {
      static_assert(std::is_same_v<Slots, Bf16Slots>, "a trust-ratio rule's state is float or bf16");
      ApplyTile<Rule, float, kSlots>(c, var, buf, slots.s[0], slots.s[1], slots.s[2], i, i + n, lanes);
    } else {
      float sb[kSlots > 0 ? kSlots : 1][kTile];
      float* p[kMaxSlots] = {nullptr, nullptr, nullptr};
      for (int k = 0; k < kSlots; ++k) {
        slots.Widen(k, i, n, sb[k]);
        p[k] = sb[k];
      }
      if (in_place) {
        ApplyLoopInPlace<Rule, float, float, kSlots>(c, var + i, static_cast<const float*>(t.grad) + i, p[0],
                                                     p[1], p[2], scale, lo, hi, scaled, clamped, 0, n, lanes);
      } else {
        ApplyTile<Rule, float, kSlots>(c, var + i, buf, p[0], p[1], p[2], 0, n, lanes);
      }
      for (int k = 0; k < kSlots; ++k) slots.Narrow(k, sb[k], i, n);
    }
  }
  if constexpr (Rule::kTrustRatio) ReduceTrustLanes(lanes, trust);
}

}  // namespace

void Apply(RuleKind rule, const HParams& hp, const ApplyTensor* ts,
              const ChunkPlan& plan, const ClipFactor* factors, double* trust,
              const CpuExecutor& exec) {
  if (plan.chunks.empty()) return;
  DispatchElementRule(rule, [&](auto rule_tag) {
    using Rule = decltype(rule_tag);
    const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
    DispatchSlots<Rule>(NumSlots(rule, hp), [&](auto slots_tag) {
      constexpr int kS = decltype(slots_tag)::value;
      exec.parallel_for(plan.num_blocks(), kChunkElems * kApplyCostPerElem, [&](int64_t bb, int64_t be) {
        for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
          const Chunk& ch = plan.chunks[c];
          const ApplyTensor& t = ts[ch.tensor];
          if (t.sparse) continue;  // its chunks cover the values (norm); SparseApply applies it
          if (t.slot_storage == SlotStorage::kBFloat16) {  // a float variable (SlotStorageOf)
            ApplyChunkNarrowState<Rule, kS, Bf16Slots>(ConstsFor<float>(rc), t, factors[ch.tensor], ch.begin,
                                                       ch.end, trust != nullptr ? trust + 2 * c : nullptr);
            continue;
          }
          if (t.slot_storage == SlotStorage::kInt8) {  // a float variable, a dense gradient (ValidateState)
            if constexpr (!Rule::kTrustRatio && kS > 0) {
              ApplyChunkNarrowState<Rule, kS, Q8Slots<Rule>>(ConstsFor<float>(rc), t, factors[ch.tensor],
                                                             ch.begin, ch.end, nullptr);
            }
            continue;
          }
          DispatchPair(t.var_dtype, t.grad_dtype, [&](auto vtag, auto gtag) {
            using V = decltype(vtag);
            using G = decltype(gtag);
            const auto consts = WithTensor(ConstsFor<V>(rc), ch.tensor);  // (rounding.h)
            double* tr = trust != nullptr ? trust + 2 * c : nullptr;
            if (factors[ch.tensor].unit_scale != nullptr) {  // AGC: per-unit scales
              ApplyChunkAgc<Rule, V, kS>(consts, t, factors[ch.tensor], ch.begin, ch.end, tr);
            } else if constexpr (std::is_same_v<G, AnyGrad>) {
              ApplyChunkAnyGrad<Rule, V, kS>(consts, t, factors[ch.tensor], ch.begin, ch.end, tr);
            } else {
              ApplyChunk<Rule, V, G, kS>(consts, t, factors[ch.tensor], ch.begin, ch.end, tr);
            }
          });
        }
      });
    });
  });
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
