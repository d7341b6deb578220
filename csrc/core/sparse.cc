// tfclip core: planning the apply pass of IndexedSlices gradients (see sparse.h).
#include "csrc/core/sparse.h"

#include <algorithm>
#include <numeric>
#include <sstream>

namespace tfclip {

bool SparseAllRows(RuleKind rule, const HParams& hp, bool lazy, bool hparams_on_device) {
  if (lazy) return false;
  return !RuleZeroGradKeeps(rule) || hp.weight_decay != 0.0 || hparams_on_device;
}

std::string PlanSparse(const ApplyTensor* ts, int n, RuleKind rule, const HParams& hp, bool lazy,
                       int64_t unit_elems, SparsePlan* plan, bool hparams_on_device) {
  plan->order.clear();
  plan->urows.clear();
  plan->ustart.clear();
  plan->units.clear();
  plan->spans.clear();
  const bool all_rows = SparseAllRows(rule, hp, lazy, hparams_on_device);
  std::vector<int64_t>& local = plan->sort_buf;
  for (int i = 0; i < n; ++i) {
    const ApplyTensor& t = ts[i];
    if (!t.sparse) continue;
    const int64_t rows = t.rows;
    for (int64_t j = 0; j < t.nnz; ++j) {
      const int64_t r = t.indices[j];
      if (r < 0 || r >= rows) {
        std::ostringstream os;
        os << "grads[" << i << "] (IndexedSlices): indices[" << j << "] = " << r
           << " is out of range for vars[" << i << "], which has " << rows
           << " rows; no variable was updated";
        return os.str();
      }
    }
    // Group the slices by row, keeping duplicates in their order.
    local.resize(static_cast<size_t>(t.nnz));
    std::iota(local.begin(), local.end(), int64_t{0});
    std::stable_sort(local.begin(), local.end(),
                     [&](int64_t a, int64_t b) { return t.indices[a] < t.indices[b]; });
    const int64_t u_first = static_cast<int64_t>(plan->urows.size());
    const int64_t o_first = static_cast<int64_t>(plan->order.size());
    for (int64_t j = 0; j < t.nnz; ++j) {
      const int64_t r = t.indices[local[j]];
      if (j == 0 || r != plan->urows.back()) {
        plan->urows.push_back(r);
        plan->ustart.push_back(o_first + j);
      }
      plan->order.push_back(local[j]);
    }
    const int64_t u_last = static_cast<int64_t>(plan->urows.size());
    plan->spans.push_back(SparseSpan{i, u_first, u_last});
    const int64_t width = std::max<int64_t>(t.width, 1);
    const int64_t per = std::max<int64_t>(1, unit_elems / width);
    if (all_rows) {
      int64_t u = u_first;
      for (int64_t r = 0; r < rows; r += per) {
        const int64_t e = std::min(rows, r + per);
        const int64_t ub = u;
        while (u < u_last && plan->urows[u] < e) ++u;
        plan->units.push_back(SparseUnit{i, 1, r, e, ub, u});
      }
    } else {
      for (int64_t u = u_first; u < u_last; u += per) {
        const int64_t e = std::min(u_last, u + per);
        plan->units.push_back(SparseUnit{i, 0, u, e, u, e});
      }
    }
  }
  plan->ustart.push_back(static_cast<int64_t>(plan->order.size()));
  return "";
}

}  // namespace tfclip
