// tfclip core, CUDA: a factored rule's passes (Adafactor; csrc/core/factored.h), after the norm
// and finalize kernels: the per-element arithmetic is AdafactorRule (rules.h) and every float64
// sum follows factored.h's order, so the bits are the CPU driver's (FactoredApplyCpu). One block
// per tile of the plan (one per tensor for the r and c kernel); every kernel returns at once on
// a step the finalize kernel did not apply.
#include "csrc/core/cuda/kernels.cuh"

#include <cmath>

namespace tfclip {
namespace cuda {
namespace {

using Rule = AdafactorRule;

// Tensor i's clip factor, with AGC's unit scales where the step has them (on CUDA they sit in
// the tensor table, not in the finalize's factors).
__device__ ClipFactor FactorOf(const Table& t, int i) {
  ClipFactor f = t.factors[i];
  const DevTensor& ten = t.tensors[i];
  if (ten.unit_scale != nullptr) {
    f.unit_scale = ten.unit_scale;
    f.units = ten.units;
  }
  return f;
}

// Once every thread has written its rows' sums (row_sums, shared): the tile's total, over its
// rows in order, by one thread (factored.h's order).
// (Rows: the __shared__ array, whose type the emulation checks every access through.)
template <typename Rows>
__device__ void TileTotal(Rows& row_sums, int64_t nrows, double* out) {
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int64_t j = 0; j < nrows; ++j) total += row_sums[j];
    *out = total;
  }
}

// 1. stats: each row's sums of q and w^2 (one thread a row: FactoredStatsRow, as the CPU), each
// column's partial over the tile's rows (one thread a column), the tile's sum of w^2 over its
// rows in order.
__global__ void FactoredStatsKernel(Table t, DevFactored f) {
  if (!t.status->apply) return;
  TFCLIP_SHARED_ARRAY(double, row_w, kFactoredMaxRows);
  const FactoredTile tile = f.tiles[blockIdx.x];
  const int i = tile.tensor;
  const DevTensor& ten = t.tensors[i];
  const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
  const int64_t cols = ten.fac_cols;
  const int64_t nrows = FactoredTileRows(tile.r0, tile.r1, cols);
  DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
    using V = decltype(vtag);
    const auto& c = ConstsFor<V>(consts);
    const V* var = static_cast<const V*>(ten.var);
    const ClippedGrad<V> grad{ten.grad, static_cast<DType>(ten.grad_dtype), FactorOf(t, i)};
    for (int64_t j = threadIdx.x; j < nrows; j += kThreads) {
      double q, w;
      if (cols > 0) {
        const int64_t r = tile.r0 + j;
        // (the column partials are the column threads' below: a row thread writes none)
        FactoredStatsRow<false, V>(c, grad, var, r * cols, cols, nullptr, &q, &w);
        double lq[kFactoredLanes] = {};
        for (int64_t k = 0; k < cols; ++k) {
          lq[k % kFactoredLanes] += static_cast<double>(Rule::Square(c, grad(r * cols + k)));
        }
        q = FactoredLaneTotal(lq);
        // (planted: a row's sum of q loses its last element)
        if (TFCLIP_PLANTED(FACTORED_ROW)) q -= static_cast<double>(Rule::Square(c, grad(r * cols + cols - 1)));
        f.rows[f.row_off[i] + r] = q;
      } else {
        const int64_t e0 = tile.r0 + j * kFactoredRowElems;
        const int64_t len = e0 + kFactoredRowElems < tile.r1 ? kFactoredRowElems : tile.r1 - e0;
        FactoredStatsRow<false, V>(c, grad, var, e0, len, nullptr, &q, &w);
      }
      row_w[j] = w;
    }
    if (cols > 0) {
      double* part = f.part + f.part_off[i] + tile.part * cols;
      for (int64_t k = threadIdx.x; k < cols; k += kThreads) {
        double p = 0.0;
        for (int64_t r = tile.r0; r < tile.r1; ++r) p += static_cast<double>(Rule::Square(c, grad(r * cols + k)));
        part[k] = p;
      }
    }
  });
  TileTotal(row_w, nrows, &f.w_part[blockIdx.x]);
}

// 2. per factored tensor (a block each): column sums over its tiles in order, r and c updated
// and stored, then each matrix's mean of the stored r (one thread a matrix, rows in order).
__global__ void FactoredMomentsKernel(Table t, DevFactored f) {
  if (!t.status->apply) return;
  const int i = static_cast<int>(blockIdx.x);
  const DevTensor& ten = t.tensors[i];
  if (ten.fac_cols <= 0 || ten.size == 0) return;
  const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
  const int64_t m = ten.fac_rows, cols = ten.fac_cols;
  const int64_t nrows = f.row_off[i + 1] - f.row_off[i];
  const int64_t mats = f.mat_off[i + 1] - f.mat_off[i];
  const int64_t t0 = f.tile_off[i];
  const int64_t per_matrix = (f.tile_off[i + 1] - t0) / mats;  // (every matrix has as many tiles)
  DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
    using V = decltype(vtag);
    using M = typename Elem<V>::Math;
    const auto& c = ConstsFor<V>(consts);
    V* r = static_cast<V*>(ten.slots[0]);
    V* cc = static_cast<V*>(ten.slots[1]);
    for (int64_t x = threadIdx.x; x < mats * cols; x += kThreads) {
      const int64_t b = x / cols, k = x % cols;
      double sum = 0.0;
      for (int64_t tt = t0 + b * per_matrix; tt < t0 + (b + 1) * per_matrix; ++tt) {
        sum += f.part[f.part_off[i] + f.tiles[tt].part * cols + k];
      }
      const M mean = static_cast<M>(sum / static_cast<double>(m));
      cc[x] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(cc[x]), mean));
    }
    const double* rows = f.rows + f.row_off[i];
    for (int64_t x = threadIdx.x; x < nrows; x += kThreads) {
      const M mean = static_cast<M>(rows[x] / static_cast<double>(cols));
      r[x] = Elem<V>::Store(Rule::Average(c, Elem<V>::Load(r[x]), mean));
    }
    if (!TFCLIP_PLANTED(FACTORED_BARRIER)) __syncthreads();  // every r stored before any matrix's mean reads it
    for (int64_t b = threadIdx.x; b < mats; b += kThreads) {
      double sum = 0.0;
      for (int64_t k = b * m; k < (b + 1) * m; ++k) sum += static_cast<double>(Elem<V>::Load(r[k]));
      f.r_mean[f.mat_off[i] + b] = static_cast<double>(static_cast<M>(sum / static_cast<double>(m)));
    }
  });
}

// A row of a tile: its first element and length; for a factored tensor its scale r / mean(r)
// and its matrix's c row, else the v it reads from.
template <typename V>
struct FactoredRow {
  int64_t e0, n;
  bool factored;
  typename Elem<V>::Math scale;
  const V* cv;
};

template <typename V>
__device__ FactoredRow<V> RowOf(const DevTensor& ten, const DevFactored& f, int i, const FactoredTile& tile,
                                int64_t j) {
  using M = typename Elem<V>::Math;
  FactoredRow<V> row{};
  if (ten.fac_cols > 0) {
    const int64_t r = tile.r0 + j, b = r / ten.fac_rows;
    row.e0 = r * ten.fac_cols;
    row.n = ten.fac_cols;
    row.factored = true;
    row.scale = Rule::RowScale(Elem<V>::Load(static_cast<const V*>(ten.slots[0])[r]),
                               static_cast<M>(f.r_mean[f.mat_off[i] + b]));
    row.cv = static_cast<const V*>(ten.slots[1]) + b * ten.fac_cols;
  } else {
    row.e0 = tile.r0 + j * kFactoredRowElems;
    row.n = row.e0 + kFactoredRowElems < tile.r1 ? kFactoredRowElems : tile.r1 - row.e0;
    row.factored = false;
    row.scale = M(0);
    row.cv = static_cast<const V*>(ten.slots[2]) + row.e0;
  }
  return row;
}

// 3. rms(u): each row's sum of u^2 (one thread a row: FactoredURow, as the CPU), the tile's over
// its rows in order. Reads only.
__global__ void FactoredRmsKernel(Table t, DevFactored f) {
  if (!t.status->apply) return;
  TFCLIP_SHARED_ARRAY(double, row_u, kFactoredMaxRows);
  const FactoredTile tile = f.tiles[blockIdx.x];
  const int i = tile.tensor;
  const DevTensor& ten = t.tensors[i];
  const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
  const int64_t nrows = FactoredTileRows(tile.r0, tile.r1, ten.fac_cols);
  DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
    using V = decltype(vtag);
    const auto& c = ConstsFor<V>(consts);
    const ClippedGrad<V> grad{ten.grad, static_cast<DType>(ten.grad_dtype), FactorOf(t, i)};
    for (int64_t j = threadIdx.x; j < nrows; j += kThreads) {
      const FactoredRow<V> row = RowOf<V>(ten, f, i, tile, j);
      row_u[j] = row.factored ? FactoredURow<true, V>(c, grad, row.e0, row.n, row.scale, row.cv)
                              : FactoredURow<false, V>(c, grad, row.e0, row.n, row.scale, row.cv);
    }
  });
  TileTotal(row_u, nrows, &f.u_part[blockIdx.x]);
}

// 4. the update: the tensor's sums of w^2 and u^2 (its tiles in order, by one thread), alpha
// and the denominator, then var and v (FactoredUpdateElem, as the CPU), each row's elements
// strided over the block.
__global__ void FactoredUpdateKernel(Table t, DevFactored f) {
  if (!t.status->apply) return;
  TFCLIP_SHARED_ARRAY(double, sums, 2);
  const FactoredTile tile = f.tiles[blockIdx.x];
  const int i = tile.tensor;
  const DevTensor& ten = t.tensors[i];
  if (threadIdx.x == 0) {
    double w2 = 0.0, u2 = 0.0;
    for (int64_t x = f.tile_off[i]; x < f.tile_off[i + 1]; ++x) {
      w2 += f.w_part[x];
      u2 += f.u_part[x];
    }
    sums[0] = w2;
    sums[1] = u2;
  }
  __syncthreads();
  const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
  const int64_t nrows = FactoredTileRows(tile.r0, tile.r1, ten.fac_cols);
  DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
    using V = decltype(vtag);
    using M = typename Elem<V>::Math;
    const auto c = WithTensor(ConstsFor<V>(consts), i);  // stochastic rounding's key (rounding.h)
    const double size = static_cast<double>(ten.size);
    const M alpha = Rule::Alpha(c, static_cast<M>(sqrt(sums[0] / size)));
    const M denom = Rule::Denominator(c, static_cast<M>(sqrt(sums[1] / size)));
    const ClippedGrad<V> grad{ten.grad, static_cast<DType>(ten.grad_dtype), FactorOf(t, i)};
    V* var = static_cast<V*>(ten.var);
    V* vs = static_cast<V*>(ten.slots[2]);
    for (int64_t j = 0; j < nrows; ++j) {
      const FactoredRow<V> row = RowOf<V>(ten, f, i, tile, j);
      for (int64_t k = threadIdx.x; k < row.n; k += kThreads) {
        if (row.factored) {
          FactoredUpdateElem<true, V>(c, grad, var, row.e0, k, row.scale, row.cv,
                                      ten.fac_full_v ? vs + row.e0 : nullptr, alpha, denom);
        } else {
          FactoredUpdateElem<false, V>(c, grad, var, row.e0, k, row.scale, row.cv, vs + row.e0, alpha, denom);
        }
      }
    }
  });
}

}  // namespace

std::string LaunchFactored(const Table& t, const DevFactored& f, cudaStream_t stream, int* launches) {
  if (f.ntiles == 0) return "";
  const unsigned tiles = static_cast<unsigned>(f.ntiles);
  TFCLIP_LAUNCH(FactoredStatsKernel, tiles, kThreads, 0, stream)(t, f);
  ++*launches;
  std::string e = Launched("the factored stats kernel");
  if (!e.empty()) return e;
  TFCLIP_LAUNCH(FactoredMomentsKernel, static_cast<unsigned>(t.n), kThreads, 0, stream)(t, f);
  ++*launches;
  e = Launched("the factored moments kernel");
  if (!e.empty()) return e;
  TFCLIP_LAUNCH(FactoredRmsKernel, tiles, kThreads, 0, stream)(t, f);
  ++*launches;
  e = Launched("the factored rms kernel");
  if (!e.empty()) return e;
  TFCLIP_LAUNCH(FactoredUpdateKernel, tiles, kThreads, 0, stream)(t, f);
  ++*launches;
  return Launched("the factored update kernel");
}

}  // namespace cuda
}  // namespace tfclip
