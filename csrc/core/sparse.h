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
//         row, and weight decay touches every row): untouched rows run the rule with a zero
//         gradient, touched rows with their slices. No dense gradient is ever materialized.
//   - units: blocks of about kChunkElems elements (rows or touched rows), the thread pool's or
//     the CUDA grid's work items. Results do not depend on the partition.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/multi_tensor.h"
#include "csrc/core/rules.h"

namespace tfclip {

struct SparseUnit {
  int32_t tensor;
  int32_t all_rows;  // 1: rows [begin, end) of the variable; 0: touched rows urows[begin, end)
  int64_t begin, end;
  int64_t u_begin, u_end;  // all_rows: the touched rows inside [begin, end), as urows indices
};

struct SparsePlan {
  std::vector<int64_t> order;   // slice positions (within their tensor), grouped by row
  std::vector<int64_t> urows;   // touched rows, ascending, per tensor one after another
  std::vector<int64_t> ustart;  // urows.size() + 1 offsets into `order`
  std::vector<SparseUnit> units;
  std::vector<int64_t> sort_buf;  // planning scratch, kept with the plan
  bool empty() const { return units.empty(); }
};

// Whether a sparse tensor's pass walks every row (stock Keras semantics for rules with slots or
// weight decay) or only the touched ones (lazy, or plain SGD).
bool SparseAllRows(RuleKind rule, const HParams& hp, bool lazy);

// Validates the indices of every sparse tensor of `ts` and plans the sparse apply pass.
// Returns "" or an error naming the culprit (grads[i], the index position and value).
std::string PlanSparse(const ApplyTensor* ts, int n, RuleKind rule, const HParams& hp, bool lazy,
                       int64_t unit_elems, SparsePlan* plan);

// One element (column `col`) of one row of a sparse update: the row's slices are
// order[jb .. je) (none for an untouched row of an all-rows pass); grad(k) gives element k of
// the values, clipped, in V's math type (ClipGrad or CastClipGradAt). Decoupled weight decay,
// then the rule: with the duplicates' sum g and either g*g or (sum_of_squares) the sum of their
// squares, or once per duplicate for scatter rules (SGD). var and s[] hold the element in
// storage type V, updated in place. Host and device: the CPU driver and the CUDA sparse kernel
// both call it.
template <typename Rule, typename V, int kSlots, typename GradAt>
TFCLIP_HD void SparseElem(const StepConsts<typename Elem<V>::Math>& c, const GradAt& grad,
                          int64_t width, int64_t col, const int64_t* order, int64_t jb,
                          int64_t je, V& var, V* s) {
  using M = typename Elem<V>::Math;
  M sl[kMaxSlots] = {M(0), M(0), M(0)};
  for (int k = 0; k < kSlots; ++k) sl[k] = Elem<V>::Load(s[k]);
  M v = DecayVar(c, Elem<V>::Load(var));
  if (Rule::kScatter) {
    for (int64_t j = jb; j < je; ++j) {
      const M g = grad(order[j] * width + col);
      Rule::Update(c, g, g * g, v, sl);
    }
  } else {
    // Keras densifies with unsorted_segment_sum: 0 + g_1 + g_2 + ..., in slice order.
    M g = M(0), gsq = M(0);
    for (int64_t j = jb; j < je; ++j) {
      const M gj = grad(order[j] * width + col);
      g += gj;
      gsq += gj * gj;
    }
    Rule::Update(c, g, c.sum_of_squares ? gsq : g * g, v, sl);
  }
  var = Elem<V>::Store(v);
  for (int k = 0; k < kSlots; ++k) s[k] = Elem<V>::Store(sl[k]);
}

// The gradient accessor SparseElem takes, for a tensor with gradient dtype G (AnyGrad: any
// other float dtype than the variable's, read through CastClipGradAt).
template <typename V, typename G>
struct SparseGrad {
  using M = typename Elem<V>::Math;
  const G* values;
  M scale, lo, hi;
  TFCLIP_HD SparseGrad(const void* v, DType, const ClipFactor& f)
      : values(static_cast<const G*>(v)),
        scale(InGradDType<G, M>(f.scale)),
        lo(InGradDType<G, M>(f.lo)),
        hi(InGradDType<G, M>(f.hi)) {}
  TFCLIP_HD M operator()(int64_t k) const { return ClipGrad<G, M>(values[k], scale, lo, hi); }
};
template <typename V>
struct SparseGrad<V, AnyGrad> {
  const void* values;
  DType dtype;
  ClipFactor f;
  TFCLIP_HD SparseGrad(const void* v, DType t, const ClipFactor& cf) : values(v), dtype(t), f(cf) {}
  TFCLIP_HD typename Elem<V>::Math operator()(int64_t k) const {
    return CastClipGradAt<V>(values, dtype, k, f);
  }
};

}  // namespace tfclip
