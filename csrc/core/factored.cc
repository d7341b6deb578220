// tfclip core: factored second moments (Adafactor): the slots' shapes and the plan (factored.h).
#include "csrc/core/factored.h"

#include <sstream>

#include "csrc/core/apply_elem.h"

namespace tfclip {

namespace {

std::string ShapeText(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t k = 0; k < s.size(); ++k) os << (k ? ", " : "") << s[k];
  os << "]";
  return os.str();
}


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

}  // namespace tfclip
