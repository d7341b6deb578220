// tfclip core: IndexedSlices gradients (embedding tables), applied without densifying them.
//
// The norm pass needs nothing new: a sparse gradient's `values` are one more tensor of the list
// (TF's global norm of IndexedSlices is the norm of `.values`, duplicates counted separately).
// The apply pass is planned here, on the host, once per step, for the CPU driver and the CUDA
// launcher alike:
//   - indices are checked against the variable's rows before anything is written;
//   - slices are grouped by row, stably (duplicates keep their order): `order` lists slice
//     positions sorted by row, `urows[u]` is the u-th touched row, its slices are
//     order[ustart[u] .. ustart[u+1]);
//   - each tensor is walked in one of two ways:
//       touched rows only: lazy updates, and SGD without weight decay (a scatter: an untouched
//         row would not change anyway);
//       all rows: what stock Keras does for Momentum, Adam and AdamW (their slots decay on every
//         row, and weight decay touches every row), and what a dense gradient would do with any
//         rule a zero gradient moves (RuleZeroGradKeeps): untouched rows run the rule with a zero
//         gradient, touched rows with their slices. No dense gradient is ever materialized.
//   - units: blocks of about kChunkElems elements (rows or touched rows), the thread pool's or
//     the CUDA grid's work items. Results do not depend on the partition.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/apply_elem.h"
#include "csrc/core/chunk_plan.h"
#include "csrc/core/clip.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/tensors.h"

namespace tfclip {

struct SparseUnit {
  int32_t tensor;
  int32_t all_rows;  // 1: rows [begin, end) of the variable; 0: touched rows urows[begin, end)
  int64_t begin, end;
  int64_t u_begin, u_end;  // all_rows: the touched rows inside [begin, end), as urows indices
};

// The touched rows of one sparse tensor: urows[u_first, u_last).
struct SparseSpan {
  int32_t tensor;
  int64_t u_first, u_last;
};

struct SparsePlan {
  std::vector<SparseSpan> spans;  // one per sparse tensor, in tensor order
  std::vector<int64_t> order;   // slice positions (within their tensor), grouped by row
  std::vector<int64_t> urows;   // touched rows, ascending, per tensor one after another
  std::vector<int64_t> ustart;  // urows.size() + 1 offsets into `order`
  std::vector<SparseUnit> units;
  std::vector<int64_t> sort_buf;  // planning scratch, kept with the plan
  bool empty() const { return units.empty(); }
};

// Whether a sparse tensor's pass walks every row (stock Keras semantics for rules with slots or
// weight decay; a rule a zero gradient moves) or only the touched ones (lazy, or plain SGD). `hparams_on_device`: the weight
// decay is read on the device (CUDA), so the plan cannot know it is 0 and walks every row (an
// untouched row then gets an exact no-op when it is).
bool SparseAllRows(RuleKind rule, const HParams& hp, bool lazy, bool hparams_on_device = false);

// Validates the indices of every sparse tensor of `ts` and plans the sparse apply pass.
// Returns "" or an error naming the culprit (grads[i], the index position and value).
std::string PlanSparse(const ApplyTensor* ts, int n, RuleKind rule, const HParams& hp, bool lazy,
                       int64_t unit_elems, SparsePlan* plan, bool hparams_on_device = false);

// The slices of one row, for column `col`, as ApplyElem's gradient source: order[jb .. je) (none
// for an untouched row of an all-rows pass); grad(k) gives element k of the values, clipped, in
// V's math type M (GradReader). A scatter rule (SGD) is fed once per duplicate, in order; the
// others once, with the duplicates' sum g and either Second(g) (g*g) or (sum_of_squares) the sum
// of their Second(g_j) (rules.h). Keras densifies with unsorted_segment_sum: 0 + g_1 + g_2 + ..., in slice order.
template <typename M, typename GradAt>
struct RowGrads {
  const GradAt& grad;
  int64_t width, col;
  const int64_t* order;
  int64_t jb, je;
  template <typename Rule, typename F>
  TFCLIP_HD void Feed(const StepBase<M>& c, const F& update) const {
    if (Rule::kScatter) {
      for (int64_t j = jb; j < je; ++j) {
        const M g = grad(order[j] * width + col);
        update(g, Rule::Second(g));
      }
    } else {
      M g = M(0), g2 = M(0);
      for (int64_t j = jb; j < je; ++j) {
        const M gj = grad(order[j] * width + col);
        g += gj;
        g2 += Rule::Second(gj);
      }
      update(g, c.sum_of_squares ? g2 : Rule::Second(g));
    }
  }
};

}  // namespace tfclip
