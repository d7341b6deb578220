// tfclip core, CPU: a trust-ratio rule's last pass (Trust, Lamb's): every variable stepped by its
// tensor's ratio |w| / |u| from the sums of the slot pass, the dense chunks and the sparse units
// (SparseTrustUnitCpu), per instruction set (cpu/isa.h).
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

// The last pass of a trust-ratio rule over one sparse unit: every row it covers.
template <typename Rule, typename V, int kSlots, typename S = V>
void SparseTrustUnitCpu(const ConstsOf<Rule, V>& c,
                        typename Elem<V>::Math ratio_lr, const ApplyTensor& t,
                        const SparsePlan& sp, const SparseUnit& u) {
  V* var = static_cast<V*>(t.var);
  const S* s0 = static_cast<const S*>(t.slots[0]);
  const S* s1 = static_cast<const S*>(t.slots[1]);
  const S* s2 = static_cast<const S*>(t.slots[2]);
  const int64_t w = t.width;
  if (u.all_rows) {
    TrustLoop<Rule, V, kSlots>(c, ratio_lr, var, s0, s1, s2, u.begin * w, u.end * w);
  } else {
    for (int64_t x = u.begin; x < u.end; ++x) {
      TrustLoop<Rule, V, kSlots>(c, ratio_lr, var, s0, s1, s2, sp.urows[x] * w, sp.urows[x] * w + w);
    }
  }
}

}  // namespace

void Trust(RuleKind rule, const HParams& hp, const ApplyTensor* ts, const ChunkPlan& plan,
           const SparsePlan& sp, const double* sums, const CpuExecutor& exec) {
  DispatchElementRule(rule, [&](auto rule_tag) {
    using Rule = decltype(rule_tag);
    if constexpr (Rule::kTrustRatio) {
      const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
      DispatchSlots<Rule>(NumSlots(rule, hp), [&](auto slots_tag) {
        constexpr int kS = decltype(slots_tag)::value;
        // One task list: the dense tensors' chunks, then the sparse units.
        const int64_t nunits = static_cast<int64_t>(sp.units.size());
        const int64_t nblocks = plan.chunks.empty() ? 0 : plan.num_blocks();
        if (nblocks + nunits == 0) return;
        exec.parallel_for(nblocks + nunits, kChunkElems * kApplyCostPerElem, [&](int64_t xb, int64_t xe) {
          for (int64_t x = xb; x < xe; ++x) {
            if (x < nblocks) {
              for (int64_t c = plan.block_begin[x]; c < plan.block_begin[x + 1]; ++c) {
                const Chunk& ch = plan.chunks[c];
                const ApplyTensor& t = ts[ch.tensor];
                if (t.sparse) continue;
                DispatchState(t.var_dtype, t.slot_storage == SlotStorage::kBFloat16, [&](auto vtag, auto stag) {
                  using V = decltype(vtag);
                  using S = decltype(stag);
                  const auto k = WithTensor(ConstsFor<V>(rc), ch.tensor);
                  const double* s = sums + 2 * ch.tensor;
                  TrustLoop<Rule, V, kS>(k, TrustRatioLr(k, s[0], s[1]), static_cast<V*>(t.var),
                                         static_cast<const S*>(t.slots[0]),
                                         static_cast<const S*>(t.slots[1]),
                                         static_cast<const S*>(t.slots[2]), ch.begin, ch.end);
                });
              }
            } else {
              const SparseUnit& u = sp.units[x - nblocks];
              const ApplyTensor& t = ts[u.tensor];
              DispatchState(t.var_dtype, t.slot_storage == SlotStorage::kBFloat16, [&](auto vtag, auto stag) {
                using V = decltype(vtag);
                const auto k = WithTensor(ConstsFor<V>(rc), u.tensor);
                const double* s = sums + 2 * u.tensor;
                SparseTrustUnitCpu<Rule, V, kS, decltype(stag)>(k, TrustRatioLr(k, s[0], s[1]), t, sp, u);
              });
            }
          }
        });
      });
    }
  });
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
