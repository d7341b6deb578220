// tfclip core, CPU: the IndexedSlices apply pass (SparseApply, over sparse.h's units): touched rows
// through ApplyElem with their slices, in an all-rows unit the untouched runs between them with a
// zero gradient (SparseUnitCpu). Compiled for the baseline alone: its row gathers are memory-bound
// in any variant (kernels.cc).
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

// One unit of a sparse pass (see sparse.h): touched rows through ApplyElem with their slices,
// and in an all-rows unit the untouched runs between them through ZeroGradLoop. A trust-ratio
// rule's sums of the unit into trust[0..2): the elements in row order, each run of untouched
// rows through its own lanes.
template <typename Rule, typename V, typename G, int kSlots, typename S = V>
void SparseUnitCpu(const ConstsOf<Rule, V>& c, const ApplyTensor& t,
                   const ClipFactor& f, const SparsePlan& sp, const SparseUnit& u, double* trust) {
  using M = typename Elem<V>::Math;
  V* var = static_cast<V*>(t.var);
  const GradReader<V, G> grad(t.grad, t.grad_dtype, f);
  S* s0 = static_cast<S*>(t.slots[0]);
  S* s1 = static_cast<S*>(t.slots[1]);
  S* s2 = static_cast<S*>(t.slots[2]);
  const int64_t w = t.width;
  double sum_w = 0.0, sum_u = 0.0;
  auto one = [&](const auto& rg, int64_t k) __attribute__((always_inline)) {
    const ElemNorms<M> wu = ApplyElem<Rule, kSlots>(c, rg, var, s0, s1, s2, k);
    if constexpr (Rule::kTrustRatio) {
      sum_w += static_cast<double>(wu.w) * static_cast<double>(wu.w);
      sum_u += static_cast<double>(wu.u) * static_cast<double>(wu.u);
    }
  };
  auto touched = [&](int64_t uidx) {
    const int64_t row = sp.urows[uidx];
    int64_t uc = 0;
    for (int64_t col = 0; col < w; ++col) {
      // AGC: column col's slices through their unit's scale (width is a multiple of the units)
      // in place of the tensor's factor: one ApplyElem body for both (each copy is compile time).
      GradReader<V, G> g = grad;
      if (f.unit_scale != nullptr) {
        ClipFactor fc;
        fc.scale = f.unit_scale[uc];
        g = GradReader<V, G>(t.grad, t.grad_dtype, fc);
        if (++uc == f.units) uc = 0;
      }
      one(RowGrads<M, GradReader<V, G>>{g, w, col, sp.order.data(), sp.ustart[uidx], sp.ustart[uidx + 1]},
          row * w + col);
    }
  };
  if (!u.all_rows) {
    for (int64_t x = u.begin; x < u.end; ++x) touched(x);
  } else {
    int64_t row = u.begin;
    for (int64_t x = u.u_begin; x <= u.u_end; ++x) {
      const int64_t next = x < u.u_end ? sp.urows[x] : u.end;
      if (next > row) {
        double lanes[2 * kLanes] = {};
        ZeroGradLoop<Rule, V, kSlots, S>(c, var, s0, s1, s2, row * w, next * w, lanes);
        if constexpr (Rule::kTrustRatio) {
          double run[2];
          ReduceTrustLanes(lanes, run);
          sum_w += run[0];
          sum_u += run[1];
        }
      }
      if (x < u.u_end) touched(x);
      row = next + 1;
    }
  }
  if constexpr (Rule::kTrustRatio) {
    trust[0] = sum_w;
    trust[1] = sum_u;
  }
}

}  // namespace

void SparseApply(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const SparsePlan& sp,
                    const ClipFactor* factors, double* trust, const CpuExecutor& exec) {
  if (sp.units.empty()) return;
  DispatchElementRule(rule, [&](auto rule_tag) {
    using Rule = decltype(rule_tag);
    const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
    DispatchSlots<Rule>(NumSlots(rule, hp), [&](auto slots_tag) {
      constexpr int kS = decltype(slots_tag)::value;
      const int64_t nunits = static_cast<int64_t>(sp.units.size());
      exec.parallel_for(nunits, kChunkElems * kApplyCostPerElem, [&](int64_t ub, int64_t ue) {
        for (int64_t x = ub; x < ue; ++x) {
          const SparseUnit& u = sp.units[x];
          const ApplyTensor& t = ts[u.tensor];
          if (t.slot_storage == SlotStorage::kBFloat16) {  // a float variable: any gradient
            SparseUnitCpu<Rule, float, AnyGrad, kS, bfloat16>(ConstsFor<float>(rc), t, factors[u.tensor], sp, u,
                                                            trust != nullptr ? trust + 2 * x : nullptr);
            continue;
          }
          // A float variable's float gradient has a path of its own; every other pair reads
          // its gradient through AnyGrad (CastClipGradAt: the same rounding in the gradient's
          // dtype, so the same bits as a path of its own: tests/test_core_properties.py), one
          // path per variable dtype: the rows gathered are memory-bound, and DispatchPair's
          // eleven paths made 264 copies of the unit here, 144 now (issue 67: the build).
          if (t.var_dtype == DType::kFloat && t.grad_dtype == DType::kFloat) {
            SparseUnitCpu<Rule, float, float, kS>(WithTensor(ConstsFor<float>(rc), u.tensor), t, factors[u.tensor],
                                                  sp, u, trust != nullptr ? trust + 2 * x : nullptr);
            continue;
          }
          DispatchDType(t.var_dtype, [&](auto vtag) {
            using V = decltype(vtag);
            SparseUnitCpu<Rule, V, AnyGrad, kS>(WithTensor(ConstsFor<V>(rc), u.tensor), t, factors[u.tensor],
                                                sp, u, trust != nullptr ? trust + 2 * x : nullptr);
          });
        }
      });
    });
  });
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
