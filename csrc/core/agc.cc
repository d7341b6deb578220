// tfclip core: AGC's plan, reductions and scales (agc.h). The element passes are in
// cpu_kernels.inc (AgcSums) and cuda_norm.cu (AGC's norm pass), cuda_apply.cu (its scales applied).
#include "csrc/core/agc.h"

#include <algorithm>
#include <sstream>

namespace tfclip {

std::string PlanAgc(const ApplyTensor* ts, int n, AgcPlan* plan) {
  plan->tiles.clear();
  plan->unit_off.assign(1, 0);
  plan->part_off.assign(1, 0);
  plan->blocks.assign(static_cast<size_t>(n), 0);
  for (int i = 0; i < n; ++i) {
    const ApplyTensor& t = ts[i];
    const int64_t c = t.units;
    const int64_t size = t.sparse ? t.rows * t.width : t.size;
    if (size > 0 && (c < 1 || size % c != 0 || (t.sparse && t.width % c != 0))) {
      std::ostringstream os;
      os << "vars[" << i << "]: clip_mode='agc' needs its unit count (var.shape[-1], 1 for rank <= 1)"
         << " dividing its " << size << " elements" << (t.sparse ? " and its row width" : "")
         << ", got " << c << " (an adapter bug); no variable was updated";
      return os.str();
    }
    const int64_t units = size > 0 ? c : std::max<int64_t>(c, 0);
    int64_t nblocks = 0;
    if (size > 0) {
      const int64_t rows = size / c;
      const int64_t cw = std::min(c, kAgcMaxCols);
      const int64_t rb = std::max<int64_t>(1, kAgcTileElems / cw);
      nblocks = (rows + rb - 1) / rb;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t r0 = b * rb, r1 = std::min(rows, r0 + rb);
        for (int64_t c0 = 0; c0 < c; c0 += cw) {
          plan->tiles.push_back(AgcTile{i, t.sparse ? 1 : 0, b, r0, r1, c0, std::min(c, c0 + cw)});
        }
      }
    }
    plan->blocks[i] = nblocks;
    plan->unit_off.push_back(plan->unit_off.back() + units);
    plan->part_off.push_back(plan->part_off.back() + nblocks * units);
  }
  return "";
}

void ReduceAgcSums(const ApplyTensor* ts, int n, const AgcPlan& plan, const double* part_g,
                   const double* part_w, double* unit_g, double* unit_w,
                   const double* sparse_values_sumsq, double* per_tensor, double* total) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    const int64_t c = plan.unit_off[i + 1] - plan.unit_off[i];
    const int64_t uo = plan.unit_off[i], po = plan.part_off[i];
    const bool sparse = ts[i].sparse;
    for (int64_t u = 0; u < c; ++u) {
      double g = 0.0, w = 0.0;
      for (int64_t b = 0; b < plan.blocks[i]; ++b) {
        if (!sparse) g += part_g[po + b * c + u];
        w += part_w[po + b * c + u];
      }
      if (!sparse) unit_g[uo + u] = g;
      unit_w[uo + u] = w;
    }
    double t = 0.0;
    if (sparse) {
      t = sparse_values_sumsq[i];
    } else {
      for (int64_t u = 0; u < c; ++u) t += unit_g[uo + u];
    }
    if (per_tensor != nullptr) per_tensor[i] = t;
    sum += t;
  }
  *total = sum;
}

void AgcScales(const ClipConfig& cfg, const ApplyTensor* ts, int n, const AgcPlan& plan,
               const double* unit_g, const double* unit_w, double* unit_scale, int64_t* clipped,
               ClipFactor* factors) {
  for (int i = 0; i < n; ++i) {
    const int64_t uo = plan.unit_off[i], c = plan.unit_off[i + 1] - uo;
    int64_t k = 0;
    for (int64_t u = uo; u < uo + c; ++u) {
      unit_scale[u] = AgcUnitScale(cfg.clip, cfg.agc_eps, unit_g[u], unit_w[u]);
      k += unit_scale[u] != 1.0 ? 1 : 0;  // NaN too (clip.h)
    }
    if (clipped != nullptr) clipped[i] = k;
    factors[i] = ClipFactor{};
    factors[i].unit_scale = unit_scale + uo;
    factors[i].units = c;
  }
  (void)ts;
}

}  // namespace tfclip
