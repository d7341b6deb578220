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

#include "csrc/core/clip.h"
#include "csrc/core/hparams.h"
#include "csrc/core/tensors.h"

namespace tfclip {

struct CpuExecutor;

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

// Steps 1-3 above on the CPU, after the clip factors (the non-finite policy already decided).
void FactoredApplyCpu(const HParams& hp, const ApplyTensor* ts, int n, const ClipFactor* factors,
                      FactoredScratch* s, const CpuExecutor& exec);

}  // namespace tfclip
