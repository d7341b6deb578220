// tfclip core: factored second moments, Adafactor's passes (rule kAdafactor; the per-element
// arithmetic is AdafactorRule in rules.h, written once for every driver).
//
// A variable of rank >= 2 is factored over its last two axes: seen as B matrices of M x N
// (M = shape[-2], N = shape[-1], B = size / (M N)), i.e. R = B M rows of N. Its slots are
// r (shape[:-1]: one per row), c (shape[:-2] + [N]: one per matrix column) and v (the
// variable's shape, which keras writes every step but never reads back; with factored_state a
// scalar placeholder, so the optimizer keeps R + B N numbers, not M N). A variable of rank < 2
// keeps a full v (r and c are scalar placeholders, as keras makes them).
//
// A step after the norm pass and the clip factors (any clip mode: each element's clipped
// gradient g is read as the apply pass reads it):
//   1. stats: per row, the float64 sum of q = g^2 + epsilon_1 (rows in order, columns in order);
//      per tile, each column's sum over its rows; per tile, the sum of w^2 (w after weight decay).
//      Then, per tensor in a fixed order: each column's sum over its tiles in order, r and c
//      updated and stored, each matrix's mean of the stored r, the tensor's sum of w^2.
//   2. rms(u): per tile, the float64 sum of u^2 (u = g / sqrt(v), v from the stored r and c, or
//      the unfactored v's new value, rounded to the variable's dtype as keras stores it); then
//      per tensor, over its tiles in order. Reads only.
//   3. the update: var (and v) written, from the same u.
// Tiles depend on the shapes alone, so the bits are the same for any thread count. Bytes per
// float32 element of a factored variable: 4 (norm) + 8 (stats) + 4 (rms) + 8 + 4 (+ 4 with the
// full v) = 28 (32), against keras's ten or so tensor-wide ops.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/apply_elem.h"
#include "csrc/core/clip.h"
#include "csrc/core/hparams.h"
#include "csrc/core/tensors.h"

namespace tfclip {

// A tile: rows [r0, r1) of one matrix of a factored tensor (column partials at `part`, in units
// of the tensor's N), or elements [r0, r1) of an unfactored one.
struct FactoredTile {
  int32_t tensor;
  int64_t matrix;
  int64_t r0, r1;
  int64_t part;
};

constexpr int64_t kFactoredTileElems = int64_t{1} << 16;
constexpr int64_t kFactoredMinRows = 64;  // column partials at most size / 64 doubles a tensor
constexpr int64_t kFactoredMaxRows = 1024;  // a tile's row sums fit a CUDA block's shared memory
// An unfactored tile's elements are summed as rows of this many (the last one shorter).
constexpr int64_t kFactoredRowElems = 256;

// The order every float64 sum takes, on the CPU and on CUDA alike (so both give the same bits):
// a row's sum over its elements in kFactoredLanes lanes (element k in lane k % 8, each lane in
// order; then the lanes pairwise, FactoredLaneTotal: the CPU's vectors, a CUDA thread's
// registers); a tile's sum of w^2 or u^2 over its rows' sums in row order (a factored tile's
// rows are the matrix's, an unfactored tile's of kFactoredRowElems); a column's partial over the
// tile's rows in order; a column's sum, and a tensor's, over its tiles in order; a matrix's mean
// of r over its rows in order. The per-row passes below are the one body both drivers run.
constexpr int kFactoredLanes = 8;
TFCLIP_HD double FactoredLaneTotal(const double* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
TFCLIP_HD int64_t FactoredTileRows(int64_t r0, int64_t r1, int64_t cols) {
  return cols > 0 ? r1 - r0 : (r1 - r0 + kFactoredRowElems - 1) / kFactoredRowElems;
}

// Element k of a tensor's gradient, clipped (any clip mode; AGC: its unit's scale) and in V's
// math type, as the apply passes read it.
template <typename V>
struct ClippedGrad {
  const void* g;
  DType gt;
  ClipFactor f;
  TFCLIP_HD typename Elem<V>::Math operator()(int64_t k) const {
    if (f.unit_scale == nullptr) return CastClipGradAt<V>(g, gt, k, f);
    ClipFactor u = f;
    u.scale = f.unit_scale[k % f.units];
    return CastClipGradAt<V>(g, gt, k, u);
  }
};

// The per-row passes, for `n` elements from element e0 of a tensor, its gradient read by `grad`
// (ClippedGrad, or the CPU's typed GradReader: the same values), in V's math type M.
//
// Stats: the row's sums of q and of w^2 (w after weight decay); with kFactored, each q also added
// to its column's partial part[k].
template <bool kFactored, typename V, typename Grad>
TFCLIP_HD void FactoredStatsRow(const ConstsOf<AdafactorRule, V>& c, const Grad& grad, const V* var,
                                int64_t e0, int64_t n, double* part, double* row_q, double* row_w) {
  double lq[kFactoredLanes] = {}, lw[kFactoredLanes] = {};
  auto one = [&](int64_t k, int l) {
    const double q = static_cast<double>(AdafactorRule::Square(c, grad(e0 + k)));
    if constexpr (kFactored) {
      lq[l] += q;
      part[k] += q;
    }
    const double w = static_cast<double>(DecayVar(c, Elem<V>::Load(var[e0 + k])));
    lw[l] += w * w;
  };
  int64_t k = 0;
  for (; k + kFactoredLanes <= n; k += kFactoredLanes) {
    for (int l = 0; l < kFactoredLanes; ++l) one(k + l, l);
  }
  for (int l = 0; k < n; ++k, ++l) one(k, l);
  *row_q = FactoredLaneTotal(lq);
  *row_w = FactoredLaneTotal(lw);
}

// v and u of one element: a factored row's v from its scale r / mean(r) and the column's c, an
// unfactored element's from its stored v and q; v rounded to V, as keras stores it.
template <bool kFactored, typename V, typename M>
TFCLIP_HD void FactoredElemVU(const ConstsOf<AdafactorRule, V>& c, M g, M row_scale, M col_or_v, M* v, M* u) {
  *v = RoundTo<V>(kFactored ? AdafactorRule::FactoredV(row_scale, col_or_v)
                            : AdafactorRule::Average(c, col_or_v, AdafactorRule::Square(c, g)));
  *u = AdafactorRule::Direction(g, *v);
}

// rms(u): the row's sum of u^2. cv: the matrix's c row (factored) or the tensor's v (at e0).
template <bool kFactored, typename V, typename Grad>
TFCLIP_HD double FactoredURow(const ConstsOf<AdafactorRule, V>& c, const Grad& grad, int64_t e0, int64_t n,
                              typename Elem<V>::Math row_scale, const V* cv) {
  using M = typename Elem<V>::Math;
  double lu[kFactoredLanes] = {};
  auto one = [&](int64_t k, int l) {
    M v, u;
    FactoredElemVU<kFactored, V>(c, grad(e0 + k), row_scale, Elem<V>::Load(cv[k]), &v, &u);
    const double d = static_cast<double>(u);
    lu[l] += d * d;
  };
  int64_t k = 0;
  for (; k + kFactoredLanes <= n; k += kFactoredLanes) {
    for (int l = 0; l < kFactoredLanes; ++l) one(k + l, l);
  }
  for (int l = 0; k < n; ++k, ++l) one(k, l);
  return FactoredLaneTotal(lu);
}

// The update of element e0 + k: var (after weight decay) stepped by alpha * (u / denominator),
// stored (a bfloat16 variable's stochastic rounding: rounding.h), and v where it is kept.
template <bool kFactored, typename V, typename Grad>
TFCLIP_HD void FactoredUpdateElem(const ConstsOf<AdafactorRule, V>& c, const Grad& grad, V* var, int64_t e0,
                                  int64_t k, typename Elem<V>::Math row_scale, const V* cv, V* v_out,
                                  typename Elem<V>::Math alpha, typename Elem<V>::Math denom) {
  using M = typename Elem<V>::Math;
  M v, u;
  FactoredElemVU<kFactored, V>(c, grad(e0 + k), row_scale, Elem<V>::Load(cv[k]), &v, &u);
  M w = DecayVar(c, Elem<V>::Load(var[e0 + k]));
  AdafactorRule::Step(alpha, denom, u, w);
  var[e0 + k] = StoreVar<V>(c.round, w, e0 + k);
  if (v_out != nullptr) v_out[k] = Elem<V>::Store(v);
}

struct FactoredPlan {
  std::vector<FactoredTile> tiles;
  std::vector<int64_t> tile_off;  // n + 1: tensor i's tiles
  std::vector<int64_t> row_off;   // n + 1: tensor i's row sums (R)
  std::vector<int64_t> col_off;   // n + 1: tensor i's column sums (B N)
  std::vector<int64_t> part_off;  // n + 1: tensor i's column partials (tiles x N)
  std::vector<int64_t> mat_off;   // n + 1: tensor i's matrices (B)
};

// The shape slot k (0: r, 1: c, 2: v) of a factored rule's variable of shape `var` must have:
// "" or what is wrong, in words that name the expected shape. *placeholder: the slot is a
// scalar placeholder the step neither reads nor writes (r and c of a variable of rank < 2, as
// keras makes them, in any dtype; v of a variable of rank >= 2 with factored_state).
std::string FactoredSlotShape(int k, const std::vector<int64_t>& var, const std::vector<int64_t>& slot,
                              bool* placeholder);

// Sets ts[i].fac_rows / fac_cols from a variable's shape (rank >= 2: its last two axes).
void SetFactoredDims(const std::vector<int64_t>& var, ApplyTensor* t);

// Checks the tensors of a factored step (dense gradients, slots in the variable's dtype, the
// dims consistent with the sizes) and plans its tiles: "" or the error naming the tensor.
std::string PlanFactored(const ApplyTensor* ts, int n, FactoredPlan* plan);

struct FactoredScratch {
  FactoredPlan plan;
  std::vector<double> rows, part, cols, w_part, u_part, r_mean;
  std::vector<double> w_sum, u_sum;
};

}  // namespace tfclip
