// tfclip core: adaptive gradient clipping, unit-wise (clip mode kAgc; Brock et al. 2021, NFNets).
//
// Units (the paper's "unit-wise" norms): a tensor of rank <= 1 is one unit; a tensor of rank >= 2
// has one unit per index of its LAST axis (C = shape[-1]), the unit's norm taken over every other
// axis. (optax's `unitwise_norm` reduces only axis 0 for a rank-3 tensor and axes 0-2 for rank 4;
// the paper, and we, reduce every axis but the output one.) Element i of a row-major tensor is in
// unit i % C, so a tensor is seen as R = size / C rows of C units.
//
// An AGC step's norm pass reads each gradient AND its variable once, giving per unit the fp64
// sums of g^2 and w^2, deterministically: a tensor is cut into tiles of (a block of rows) x (a
// block of columns), fixed by its shape alone; a tile sums its columns over its rows in row order
// into its own partials (one pair of doubles per (row block, unit): about size / 64 + C doubles
// a tensor, never one per element); the partials are then added in row-block order. Each tensor's
// sum of squares (its tensor_norms entry, and the global norm's share) is the sum of its units'
// in unit order. An IndexedSlices gradient's units are those of the densified gradient
// (duplicate rows summed in slice order, in the gradient's dtype, as tf.convert_to_tensor does
// with unsorted_segment_sum), so the clip matches the dense gradient's; its tensor_norms entry is
// its values' norm, as in the other modes. Its variable's unit norms are over the whole variable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/clip.h"
#include "csrc/core/sparse.h"
#include "csrc/core/tensors.h"

namespace tfclip {

// A tile of the AGC norm pass: rows [r0, r1) x columns [c0, c1) of tensor `tensor`, whose
// partials go to row block `block`. kind 0: the gradient and the variable (a dense gradient);
// kind 1: the variable only (an IndexedSlices gradient's variable; its gradient's units are
// summed by a task of its own, AgcSparseGradSums).
struct AgcTile {
  int32_t tensor;
  int32_t kind;
  int64_t block;
  int64_t r0, r1, c0, c1;
};

// Columns per tile, and about how many elements a tile holds (rows per block =
// max(1, kAgcTileElems / min(C, kAgcMaxCols))): at least 64 rows per block, so the partials of a
// tensor are at most size / 64 + C pairs.
constexpr int64_t kAgcMaxCols = 1024;
constexpr int64_t kAgcTileElems = int64_t{1} << 16;

struct AgcPlan {
  std::vector<AgcTile> tiles;
  std::vector<int64_t> unit_off;  // n + 1: tensor i's units are [unit_off[i], unit_off[i + 1])
  std::vector<int64_t> part_off;  // n + 1: tensor i's partials (blocks x C), per sum
  std::vector<int64_t> blocks;    // n: row blocks of tensor i
  int64_t num_units() const { return unit_off.back(); }
  int64_t num_partials() const { return part_off.back(); }
};

// Plans the AGC norm pass of `ts` (depends only on the shapes); checks each tensor's unit count
// (ApplyTensor::units): "" or an error naming the tensor.
std::string PlanAgc(const ApplyTensor* ts, int n, AgcPlan* plan);

// After the tiles and the sparse tasks ran: unit sums (partials added in row-block order; a
// sparse tensor's gradient unit sums are already in unit_g), each tensor's sum of squares
// (dense: its units' in unit order; sparse: sparse_values_sumsq[i], its values'), and the total
// (tensors in order).
void ReduceAgcSums(const ApplyTensor* ts, int n, const AgcPlan& plan, const double* part_g,
                   const double* part_w, double* unit_g, double* unit_w,
                   const double* sparse_values_sumsq, double* per_tensor, double* total);

// Each unit's scale (AgcUnitScale), each tensor's count of clipped units (scale != 1; may be
// null), and the tensors' clip factors pointing at their units' scales.
void AgcScales(const ClipConfig& cfg, const ApplyTensor* ts, int n, const AgcPlan& plan,
               const double* unit_g, const double* unit_w, double* unit_scale, int64_t* clipped,
               ClipFactor* factors);

}  // namespace tfclip
