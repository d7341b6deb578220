// tfclip core, CPU: Adaptive Gradient Clipping's norm pass (AgcSums, clip mode kAgc, agc.h): the
// per-unit fp64 sums of g^2 and w^2 over each tile in a fixed order (AgcTileSums), and the unit
// sums of an IndexedSlices gradient, densified (AgcSparseGradSums), per instruction set
// (cpu/isa.h).
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

namespace tfclip {
TFCLIP_CPU_PASSES(TFCLIP_ISA_NS)
namespace TFCLIP_ISA_NS {
namespace {

// AGC's norm pass over one tile (agc.h): per column of [c0, c1), the fp64 sums of g^2 (kGrad)
// and w^2 over rows [r0, r1), in row order, into pg[0..c1-c0) and pw[..]. A one-unit tensor (its
// rows are its elements, contiguous) sums on kLanes lanes as the norm pass does (element r on
// lane (r - r0) % kLanes, lanes added pairwise); wider ones keep one accumulator per column (the
// column loop vectorizes). Either way the order depends on the shape alone.
constexpr int kAgcRowsAtOnce = 8;

template <typename G, typename V, bool kGrad>
void AgcTileSums(const G* __restrict__ g, const V* __restrict__ w, int64_t units, const AgcTile& tl,
                 double* __restrict__ pg, double* __restrict__ pw) {
  const int64_t cw = tl.c1 - tl.c0;
  if (units == 1) {
    double ag[kLanes] = {}, aw[kLanes] = {};
    int64_t r = tl.r0;
    // g and w a kTile piece at a time, each piece on the lanes (kTile is a multiple of kLanes, so
    // every element keeps its lane and each lane its order). Interleaved element by element, the
    // two streams ran at half the speed of these pieces (NOTES.md 29).
    for (; r + kTile <= tl.r1; r += kTile) {
      if constexpr (kGrad) {
        for (int64_t j = 0; j < kTile; j += kLanes) {
          for (int k = 0; k < kLanes; ++k) {
            const double x = static_cast<double>(Elem<G>::Load(g[r + j + k]));
            ag[k] += x * x;
          }
        }
      }
      for (int64_t j = 0; j < kTile; j += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
          const double y = static_cast<double>(Elem<V>::Load(w[r + j + k]));
          aw[k] += y * y;
        }
      }
    }
    for (; r + kLanes <= tl.r1; r += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        if constexpr (kGrad) {
          const double x = static_cast<double>(Elem<G>::Load(g[r + k]));
          ag[k] += x * x;
        }
        const double y = static_cast<double>(Elem<V>::Load(w[r + k]));
        aw[k] += y * y;
      }
    }
    for (int k = 0; r < tl.r1; ++r, ++k) {
      if constexpr (kGrad) {
        const double x = static_cast<double>(Elem<G>::Load(g[r]));
        ag[k] += x * x;
      }
      const double y = static_cast<double>(Elem<V>::Load(w[r]));
      aw[k] += y * y;
    }
    for (int h = kLanes / 2; h > 0; h /= 2) {
      for (int k = 0; k < h; ++k) {
        ag[k] += ag[k + h];
        aw[k] += aw[k + h];
      }
    }
    if constexpr (kGrad) pg[0] = ag[0];
    pw[0] = aw[0];
    return;
  }
  for (int64_t k = 0; k < cw; ++k) {
    if constexpr (kGrad) pg[k] = 0.0;
    pw[k] = 0.0;
  }
  int64_t r0 = tl.r0;
  if (cw < units) {
    // A tile narrower than its rows (C > kAgcMaxCols) reads a piece of each row, a row apart:
    // kAgcRowsAtOnce rows a column at a time (each column's sum still takes its rows in order),
    // so each accumulator is loaded and stored once per kAgcRowsAtOnce rows, not per row. Row by
    // row, such tiles ran at a third of the plain norm pass's speed ([9000, 3072] fp32, one
    // thread: 28 ms against 11; this loop 13; NOTES.md 30); a tile of whole rows is contiguous
    // and the row loop below already runs near it (15 ms).
    constexpr int kR = kAgcRowsAtOnce;
    for (; r0 + kR <= tl.r1; r0 += kR) {
      const int64_t base = r0 * units + tl.c0;
      if constexpr (kGrad) {
        const G* gr = g + base;
        for (int64_t k = 0; k < cw; ++k) {
          double a = pg[k];
          for (int q = 0; q < kR; ++q) {
            const double x = static_cast<double>(Elem<G>::Load(gr[q * units + k]));
            a += x * x;
          }
          pg[k] = a;
        }
      }
      const V* wr = w + base;
      for (int64_t k = 0; k < cw; ++k) {
        double a = pw[k];
        for (int q = 0; q < kR; ++q) {
          const double y = static_cast<double>(Elem<V>::Load(wr[q * units + k]));
          a += y * y;
        }
        pw[k] = a;
      }
    }
  }
  for (int64_t r = r0; r < tl.r1; ++r) {
    const int64_t base = r * units + tl.c0;
    if constexpr (kGrad) {
      const G* gr = g + base;
      for (int64_t k = 0; k < cw; ++k) {
        const double x = static_cast<double>(Elem<G>::Load(gr[k]));
        pg[k] += x * x;
      }
    }
    const V* wr = w + base;
    for (int64_t k = 0; k < cw; ++k) {
      const double y = static_cast<double>(Elem<V>::Load(wr[k]));
      pw[k] += y * y;
    }
  }
}

// AGC's unit sums of g^2 of an IndexedSlices gradient, densified: per touched row and column,
// its slices summed in slice order in the gradient's dtype (tf.convert_to_tensor's
// unsorted_segment_sum: 0 + g_1 + g_2 + ...), squared in fp64 into its unit, rows ascending;
// and the sum of squares of its values (its tensor_norms entry), on kLanes lanes.
template <typename G>
void AgcSparseGradSums(const ApplyTensor& t, const SparsePlan& sp, const SparseSpan& span,
                       double* ug, double* values_sumsq) {
  using GM = typename Elem<G>::Math;
  const G* vals = static_cast<const G*>(t.grad);
  const int64_t units = t.units > 0 ? t.units : 1, w = t.width;
  for (int64_t u = 0; u < units; ++u) ug[u] = 0.0;
  for (int64_t x = span.u_first; x < span.u_last; ++x) {
    const int64_t jb = sp.ustart[x], je = sp.ustart[x + 1];
    int64_t uc = 0;
    for (int64_t col = 0; col < w; ++col) {
      GM acc = GM(0);
      for (int64_t j = jb; j < je; ++j) acc = RoundTo<G>(acc + Elem<G>::Load(vals[sp.order[j] * w + col]));
      const double d = static_cast<double>(acc);
      ug[uc] += d * d;
      if (++uc == units) uc = 0;
    }
  }
  *values_sumsq = t.nnz * w > 0 ? ChunkSumSquares(vals, 0, t.nnz * w) : 0.0;
}

}  // namespace

void AgcSums(const ApplyTensor* ts, const AgcPlan& plan, const SparsePlan& sp, double* part_g,
             double* part_w, double* unit_g, double* sparse_values_sumsq, const CpuExecutor& exec) {
  const int64_t ntiles = static_cast<int64_t>(plan.tiles.size());
  const int64_t nsparse = static_cast<int64_t>(sp.spans.size());
  if (ntiles + nsparse == 0) return;
  // One task list: the tiles, then one task per IndexedSlices gradient. Each writes its own
  // partials (or its tensor's unit sums): the same bits whatever the partition.
  exec.parallel_for(ntiles + nsparse, kAgcTileElems * kNormCostPerElem * 2, [&](int64_t xb, int64_t xe) {
    ScopedKeepDenormals keep;
    for (int64_t x = xb; x < xe; ++x) {
      if (x < ntiles) {
        const AgcTile& tl = plan.tiles[x];
        const ApplyTensor& t = ts[tl.tensor];
        const int64_t units = plan.unit_off[tl.tensor + 1] - plan.unit_off[tl.tensor];
        const int64_t off = plan.part_off[tl.tensor] + tl.block * units + tl.c0;
        DispatchDType(t.var_dtype, [&](auto vtag) {
          using V = decltype(vtag);
          const V* w = static_cast<const V*>(t.var);
          if (tl.kind == 1) {
            AgcTileSums<V, V, false>(nullptr, w, units, tl, nullptr, part_w + off);
          } else {
            DispatchDType(t.grad_dtype, [&](auto gtag) {
              using G = decltype(gtag);
              AgcTileSums<G, V, true>(static_cast<const G*>(t.grad), w, units, tl, part_g + off,
                                      part_w + off);
            });
          }
        });
      } else {
        const SparseSpan& span = sp.spans[x - ntiles];
        const ApplyTensor& t = ts[span.tensor];
        DispatchDType(t.grad_dtype, [&](auto gtag) {
          AgcSparseGradSums<decltype(gtag)>(t, sp, span, unit_g + plan.unit_off[span.tensor],
                                            sparse_values_sumsq + span.tensor);
        });
      }
    }
  });
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
