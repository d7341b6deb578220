// tfclip core, CPU: the norm pass (SumSquares: each chunk's sum of squares in a fixed order, fp64
// lanes, then the chunks in slot order) and the clip op's scale pass (Scale), per instruction set
// (cpu/isa.h).
#include <cmath>
#include "csrc/core/cpu/kernels.h"
#include "csrc/core/cpu/denormals.h"

#include "csrc/core/cpu/isa.h"  // from here to TFCLIP_ISA_END: TFCLIP_CPU_ISA's instruction set
#include "csrc/core/cpu/tiles.h"

namespace tfclip {
TFCLIP_CPU_PASSES(TFCLIP_ISA_NS)
namespace TFCLIP_ISA_NS {
void SumSquares(const TensorView* ts, int n, const ChunkPlan& plan, double* partials,
                   double* per_tensor, double* total, const CpuExecutor& exec) {
  const int64_t nchunks = static_cast<int64_t>(plan.chunks.size());
  if (nchunks > 0) {
    exec.parallel_for(plan.num_blocks(), kChunkElems * kNormCostPerElem, [&](int64_t bb, int64_t be) {
      ScopedKeepDenormals keep;
      for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
        const Chunk& ch = plan.chunks[c];
        const TensorView& t = ts[ch.tensor];
        DispatchDType(t.dtype, [&](auto tag) {
          using T = decltype(tag);
          partials[c] = ChunkSumSquares(static_cast<const T*>(t.data), ch.begin, ch.end);
        });
      }
    });
  }
  // Reduce in slot order: the same bits whatever the partition above.
  if (per_tensor != nullptr) {
    for (int i = 0; i < n; ++i) per_tensor[i] = 0.0;
  }
  double sum = 0.0;
  for (int64_t c = 0; c < nchunks; ++c) {
    sum += partials[c];
    if (per_tensor != nullptr) per_tensor[plan.chunks[c].tensor] += partials[c];
  }
  *total = sum;
}

void Scale(const TensorView* in, const TensorView* out, const ChunkPlan& plan,
              double scale, const CpuExecutor& exec) {
  if (plan.chunks.empty()) return;
  exec.parallel_for(plan.num_blocks(), kChunkElems * kNormCostPerElem, [&](int64_t bb, int64_t be) {
    for (int64_t c = plan.block_begin[bb]; c < plan.block_begin[be]; ++c) {
      const Chunk& ch = plan.chunks[c];
      DispatchDType(in[ch.tensor].dtype, [&](auto tag) {
        using T = decltype(tag);
        ScaleChunk(static_cast<const T*>(in[ch.tensor].data), static_cast<T*>(out[ch.tensor].data),
                   ch.begin, ch.end, scale);
      });
    }
  });
}

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
