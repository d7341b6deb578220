// tfclip core: the chunk plan (chunk_plan.h).
#include "csrc/core/chunk_plan.h"

namespace tfclip {

namespace {
// Plans into `plan`'s existing buffers (a caller that keeps the plan allocates nothing).
template <typename SizeOf>
void PlanChunksBy(int n, int64_t chunk_elems, SizeOf size_of, ChunkPlan* plan) {
  plan->chunks.clear();
  plan->block_begin.assign(1, 0);
  int64_t in_block = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t size = size_of(i);
    for (int64_t b = 0; b < size; b += chunk_elems) {
      const int64_t e = b + chunk_elems < size ? b + chunk_elems : size;
      plan->chunks.push_back(Chunk{static_cast<int32_t>(i), b, e});
      in_block += e - b;
      if (in_block >= chunk_elems) {
        plan->block_begin.push_back(static_cast<int64_t>(plan->chunks.size()));
        in_block = 0;
      }
    }
  }
  if (in_block > 0) plan->block_begin.push_back(static_cast<int64_t>(plan->chunks.size()));
}
}  // namespace

void PlanChunks(const int64_t* sizes, int n, int64_t chunk_elems, ChunkPlan* plan) {
  PlanChunksBy(n, chunk_elems, [sizes](int i) { return sizes[i]; }, plan);
}

void PlanList(const TensorView* ts, int n, ChunkPlan* plan) {
  PlanChunksBy(n, kChunkElems, [ts](int i) { return ts[i].size; }, plan);
}

}  // namespace tfclip
