// tfclip core: factored second moments (Adafactor), its plan and its CPU passes (factored.h).
#include "csrc/core/factored.h"

#include <cmath>
#include <sstream>

#include "csrc/core/apply_elem.h"
#include "csrc/core/cpu_driver.h"
#include "csrc/core/cpu_kernels.h"

namespace tfclip {

namespace {

std::string ShapeText(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t k = 0; k < s.size(); ++k) os << (k ? ", " : "") << s[k];
  os << "]";
  return os.str();
}

using Rule = AdafactorRule;

}  // namespace

std::string FactoredSlotShape(int k, const std::vector<int64_t>& var, const std::vector<int64_t>& slot,
                              bool* placeholder) {
  const size_t rank = var.size();
  *placeholder = false;
  std::vector<int64_t> want;
  const char* what = "";
  if (k == 2) {
    if (slot == var) return "";
    if (rank >= 2 && slot.empty()) {
      *placeholder = true;
      return "";
    }
    want = var;
    what = rank >= 2 ? " (Adafactor's v: the variable's shape, or [] with factored_state)"
                     : " (Adafactor's v: the variable's shape)";
  } else if (rank < 2) {
    *placeholder = true;
    what = k == 0 ? " (Adafactor's r of a variable of rank < 2: a scalar placeholder)"
                  : " (Adafactor's c of a variable of rank < 2: a scalar placeholder)";
  } else if (k == 0) {
    want.assign(var.begin(), var.end() - 1);
    what = " (Adafactor's r: the variable's shape without its last axis)";
  } else {
    want.assign(var.begin(), var.end() - 2);
    want.push_back(var.back());
    what = " (Adafactor's c: the variable's shape without its second-to-last axis)";
  }
  if (slot == want) return "";
  return "has shape " + ShapeText(slot) + " but must have shape " + ShapeText(want) + what;
}

void SetFactoredDims(const std::vector<int64_t>& var, ApplyTensor* t) {
  const size_t rank = var.size();
  t->fac_rows = rank >= 2 ? var[rank - 2] : 0;
  t->fac_cols = rank >= 2 ? var[rank - 1] : 0;
}

std::string PlanFactored(const ApplyTensor* ts, int n, FactoredPlan* plan) {
  plan->tiles.clear();
  plan->tile_off.assign(1, 0);
  plan->row_off.assign(1, 0);
  plan->col_off.assign(1, 0);
  plan->part_off.assign(1, 0);
  plan->mat_off.assign(1, 0);
  for (int i = 0; i < n; ++i) {
    const ApplyTensor& t = ts[i];
    std::ostringstream err;
    err << "tensor " << i << ": ";
    if (t.sparse) {
      err << "Adafactor takes a dense gradient (its row and column means cover every element); "
             "pass tf.convert_to_tensor(grad), as keras's Adafactor densifies it";
      return err.str();
    }
    if (t.slot_storage != SlotStorage::kVariable) {
      err << "Adafactor keeps its state in the variable's dtype (state_dtype='float32' for a float32 "
             "variable): its factored r and c are already a small fraction of the variable";
      return err.str();
    }
    const int64_t m = t.fac_rows, cols = t.fac_cols;
    int64_t rows = 0, mats = 0, parts = 0;
    if (cols > 0 || m > 0) {
      if (m <= 0 || cols <= 0 || t.size % (m * cols) != 0) {
        if (t.size != 0) {
          err << "factored dims " << m << " x " << cols << " do not divide its " << t.size << " elements";
          return err.str();
        }
      }
    }
    if (t.size > 0 && cols > 0) {
      rows = t.size / cols;
      mats = rows / m;
      int64_t per = kFactoredTileElems / cols;
      if (per < kFactoredMinRows) per = kFactoredMinRows;
      if (per > kFactoredMaxRows) per = kFactoredMaxRows;
      for (int64_t b = 0; b < mats; ++b) {
        for (int64_t r0 = b * m; r0 < (b + 1) * m; r0 += per) {
          const int64_t r1 = r0 + per < (b + 1) * m ? r0 + per : (b + 1) * m;
          plan->tiles.push_back(FactoredTile{i, b, r0, r1, parts});
          ++parts;
        }
      }
    } else {
      for (int64_t e0 = 0; e0 < t.size; e0 += kFactoredTileElems) {
        const int64_t e1 = e0 + kFactoredTileElems < t.size ? e0 + kFactoredTileElems : t.size;
        plan->tiles.push_back(FactoredTile{i, 0, e0, e1, 0});
      }
    }
    plan->tile_off.push_back(static_cast<int64_t>(plan->tiles.size()));
    plan->row_off.push_back(plan->row_off.back() + rows);
    plan->col_off.push_back(plan->col_off.back() + mats * (cols > 0 ? cols : 0));
    plan->part_off.push_back(plan->part_off.back() + parts * (cols > 0 ? cols : 0));
    plan->mat_off.push_back(plan->mat_off.back() + mats);
  }
  return "";
}

void FactoredApplyCpu(const HParams& hp, const ApplyTensor* ts, int n, const ClipFactor* factors,
                      FactoredScratch* s, const CpuExecutor& exec) {
  const FactoredPlan& plan = s->plan;
  const RuleConsts<Rule> rc = MakeRuleConsts<Rule>(hp);
  const int64_t ntiles = static_cast<int64_t>(plan.tiles.size());
  s->rows.assign(static_cast<size_t>(plan.row_off.back()), 0.0);
  s->part.assign(static_cast<size_t>(plan.part_off.back()), 0.0);
  s->cols.assign(static_cast<size_t>(plan.col_off.back()), 0.0);
  s->r_mean.assign(static_cast<size_t>(plan.mat_off.back()), 0.0);
  s->w_part.assign(static_cast<size_t>(ntiles), 0.0);
  s->u_part.assign(static_cast<size_t>(ntiles), 0.0);
  s->w_sum.assign(static_cast<size_t>(n), 0.0);
  s->u_sum.assign(static_cast<size_t>(n), 0.0);

  ActiveCpuKernels().factored(1, hp, ts, factors, s, exec);  // stats

  // Per tensor, in order: column sums, r and c updated and stored, each matrix's mean of r.
  for (int i = 0; i < n; ++i) {
    const ApplyTensor& t = ts[i];
    double w2 = 0.0;
    for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) w2 += s->w_part[x];
    s->w_sum[i] = w2;
    if (t.fac_cols <= 0 || t.size == 0) continue;
    DispatchDType(t.var_dtype, [&](auto vtag) {
      using V = decltype(vtag);
      using M = typename Elem<V>::Math;
      const auto& c = ConstsFor<V>(rc);
      const int64_t m = t.fac_rows, cols = t.fac_cols;
      const int64_t nrows = plan.row_off[i + 1] - plan.row_off[i];
      const int64_t mats = plan.mat_off[i + 1] - plan.mat_off[i];
      double* colsum = s->cols.data() + plan.col_off[i];
      for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) {
        const FactoredTile& tile = plan.tiles[x];
        const double* part = s->part.data() + plan.part_off[i] + tile.part * cols;
        double* dst = colsum + tile.matrix * cols;
        for (int64_t k = 0; k < cols; ++k) dst[k] += part[k];
      }
      V* r = static_cast<V*>(t.slots[0]);
      V* cc = static_cast<V*>(t.slots[1]);
      const double* rows = s->rows.data() + plan.row_off[i];
      for (int64_t k = 0; k < nrows; ++k) {
        const M mean = static_cast<M>(rows[k] / static_cast<double>(cols));
        r[k] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(r[k]), mean));
      }
      for (int64_t k = 0; k < mats * cols; ++k) {
        const M mean = static_cast<M>(colsum[k] / static_cast<double>(m));
        cc[k] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(cc[k]), mean));
      }
      double* r_mean = s->r_mean.data() + plan.mat_off[i];
      for (int64_t b = 0; b < mats; ++b) {
        double sum = 0.0;
        for (int64_t k = b * m; k < (b + 1) * m; ++k) sum += static_cast<double>(Elem<V>::Load(r[k]));
        r_mean[b] = static_cast<double>(static_cast<M>(sum / static_cast<double>(m)));
      }
    });
  }

  ActiveCpuKernels().factored(2, hp, ts, factors, s, exec);  // rms(u)
  for (int i = 0; i < n; ++i) {
    double u2 = 0.0;
    for (int64_t x = plan.tile_off[i]; x < plan.tile_off[i + 1]; ++x) u2 += s->u_part[x];
    s->u_sum[i] = u2;
  }

  ActiveCpuKernels().factored(3, hp, ts, factors, s, exec);  // the update
}

}  // namespace tfclip
