// tfclip core, CPU: a factored rule's passes (Adafactor's, factored.h): the stats, rms(u) and update
// passes over its tiles (FactoredPass), each row through factored.h's per-row bodies (the ones the
// CUDA kernels call), per instruction set (cpu/isa.h; AVX-512's too: unlike the element-wise apply
// passes they are compute-bound, a square root and two divisions an element, float64 sums).
// factored.cc runs them in order with the serial steps between.
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


namespace tfclip {
TFCLIP_CPU_PASSES(TFCLIP_ISA_NS)
namespace TFCLIP_ISA_NS {
// fn(V{}, reader) with the tensor's gradient reader: the typed one of its dtype pair (clip
// factors read once), or ClippedGrad for AGC's per-unit scales. Both read the same values.
template <typename Fn>
void WithReader(const ApplyTensor& t, const ClipFactor& f, Fn&& fn) {
  if (f.unit_scale != nullptr) {
    DispatchDType(t.var_dtype, [&](auto vtag) {
      using V = decltype(vtag);
      fn(vtag, ClippedGrad<V>{t.grad, t.grad_dtype, f});
    });
    return;
  }
  DispatchPair(t.var_dtype, t.grad_dtype, [&](auto vtag, auto gtag) {
    using V = decltype(vtag);
    fn(vtag, GradReader<V, decltype(gtag)>(t.grad, t.grad_dtype, f));
  });
}

// A tile's rows: fn(e0, n, row) for each, in order (factored: the matrix's rows; else rows of
// kFactoredRowElems).
template <typename Fn>
void ForEachRow(const ApplyTensor& t, const FactoredTile& tile, Fn&& fn) {
  if (t.fac_cols > 0) {
    for (int64_t r = tile.r0; r < tile.r1; ++r) fn(r * t.fac_cols, t.fac_cols, r);
  } else {
    for (int64_t e0 = tile.r0; e0 < tile.r1; e0 += kFactoredRowElems) {
      fn(e0, e0 + kFactoredRowElems < tile.r1 ? kFactoredRowElems : tile.r1 - e0, int64_t{-1});
    }
  }
}

// A factored row's update (FactoredUpdateElem, element by element) with the pointers declared
// apart (__restrict__) and v's store decided once: a loop the compiler vectorizes (it did not
// with a null test per element and pointers that might alias).
template <bool kWriteV, typename V, typename Grad>
void UpdateFactoredRow(const ConstsOf<AdafactorRule, V>& c, const Grad& grad, V* __restrict__ var, int64_t e0, int64_t n,
                       typename Elem<V>::Math scale, const V* __restrict__ cv, V* __restrict__ v_out,
                       typename Elem<V>::Math alpha, typename Elem<V>::Math denom) {
  for (int64_t k = 0; k < n; ++k) {
    FactoredUpdateElem<true, V>(c, grad, var, e0, k, scale, cv, kWriteV ? v_out : nullptr, alpha, denom);
  }
}

// Pass `pass` (1: stats, 2: rms(u), 3: the update) of a factored step over s->plan's tiles.
void FactoredPass(int pass, const HParams& hp, const ApplyTensor* ts, const ClipFactor* factors,
                  FactoredScratch* s, const CpuExecutor& exec) {
  using Rule = AdafactorRule;
  const FactoredPlan& plan = s->plan;
  const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
  const int64_t ntiles = static_cast<int64_t>(plan.tiles.size());
  const int64_t cost = kFactoredTileElems * kApplyCostPerElem;
  // A row's scale r / mean(r) (factored), in M.
  auto row_scale = [&](const ApplyTensor& t, int i, int64_t r, auto vtag) {
    using V = decltype(vtag);
    using M = typename Elem<V>::Math;
    if (r < 0) return M(0);
    const M rm = static_cast<M>(s->r_mean[plan.mat_off[i] + r / t.fac_rows]);
    return Rule::RowScale(Elem<V>::Load(static_cast<const V*>(t.slots[0])[r]), rm);
  };
  // What a row reads beside its gradient: its matrix's c row (factored), or v at the row.
  auto row_cv = [&](const ApplyTensor& t, int64_t e0, int64_t r, auto vtag) {
    using V = decltype(vtag);
    if (r < 0) return static_cast<const V*>(t.slots[2]) + e0;
    return static_cast<const V*>(t.slots[1]) + (r / t.fac_rows) * t.fac_cols;
  };

  if (pass == 1) {
  // stats: row sums and column partials of q, sums of w^2.
    exec.parallel_for(ntiles, cost, [&](int64_t xb, int64_t xe) {
      for (int64_t x = xb; x < xe; ++x) {
        const FactoredTile& tile = plan.tiles[x];
        const int i = tile.tensor;
        const ApplyTensor& t = ts[i];
        WithReader(t, factors[i], [&](auto vtag, const auto& grad) {
          using V = decltype(vtag);
          const auto& c = ConstsFor<V>(rc);
          const V* var = static_cast<const V*>(t.var);
          double w2 = 0.0, q;
          if (t.fac_cols > 0) {
            double* part = s->part.data() + plan.part_off[i] + tile.part * t.fac_cols;
            double* rows = s->rows.data() + plan.row_off[i];
            ForEachRow(t, tile, [&](int64_t e0, int64_t len, int64_t r) {
              double w;
              FactoredStatsRow<true, V>(c, grad, var, e0, len, part, &rows[r], &w);
              w2 += w;
            });
          } else {
            ForEachRow(t, tile, [&](int64_t e0, int64_t len, int64_t) {
              double w;
              FactoredStatsRow<false, V>(c, grad, var, e0, len, nullptr, &q, &w);
              w2 += w;
            });
          }
          s->w_part[x] = w2;
        });
      }
    });
  } else if (pass == 2) {
  // rms(u): sums of u^2 (reads only).
    exec.parallel_for(ntiles, cost, [&](int64_t xb, int64_t xe) {
      for (int64_t x = xb; x < xe; ++x) {
        const FactoredTile& tile = plan.tiles[x];
        const int i = tile.tensor;
        const ApplyTensor& t = ts[i];
        WithReader(t, factors[i], [&](auto vtag, const auto& grad) {
          using V = decltype(vtag);
          const auto& c = ConstsFor<V>(rc);
          double u2 = 0.0;
          ForEachRow(t, tile, [&](int64_t e0, int64_t len, int64_t r) {
            u2 += r >= 0 ? FactoredURow<true, V>(c, grad, e0, len, row_scale(t, i, r, vtag), row_cv(t, e0, r, vtag))
                         : FactoredURow<false, V>(c, grad, e0, len, row_scale(t, i, r, vtag), row_cv(t, e0, r, vtag));
          });
          s->u_part[x] = u2;
        });
      }
    });
  } else {
  // the update: var, and v where it is kept.
    exec.parallel_for(ntiles, cost, [&](int64_t xb, int64_t xe) {
      for (int64_t x = xb; x < xe; ++x) {
        const FactoredTile& tile = plan.tiles[x];
        const int i = tile.tensor;
        const ApplyTensor& t = ts[i];
        WithReader(t, factors[i], [&](auto vtag, const auto& grad) {
          using V = decltype(vtag);
          using M = typename Elem<V>::Math;
          const auto c = WithTensor(ConstsFor<V>(rc), i);  // stochastic rounding's key (rounding.h)
          const double size = static_cast<double>(t.size);
          const M alpha = Rule::Alpha(c, static_cast<M>(std::sqrt(s->w_sum[i] / size)));
          const M denom = Rule::Denominator(c, static_cast<M>(std::sqrt(s->u_sum[i] / size)));
          V* var = static_cast<V*>(t.var);
          V* vs = static_cast<V*>(t.slots[2]);
          ForEachRow(t, tile, [&](int64_t e0, int64_t len, int64_t r) {
            const M scale = row_scale(t, i, r, vtag);
            const V* cv = row_cv(t, e0, r, vtag);
            if (r >= 0 && t.fac_full_v) {
              UpdateFactoredRow<true>(c, grad, var, e0, len, scale, cv, vs + e0, alpha, denom);
            } else if (r >= 0) {
              UpdateFactoredRow<false>(c, grad, var, e0, len, scale, cv, static_cast<V*>(nullptr), alpha, denom);
            } else {
              for (int64_t k = 0; k < len; ++k) {
                FactoredUpdateElem<false, V>(c, grad, var, e0, k, scale, cv, vs + e0, alpha, denom);
              }
            }
          });
        });
      }
    });
  }
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
