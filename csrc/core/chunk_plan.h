// tfclip core: the chunk plan over the flattened list of tensors, the unit of work of every
// pass (CPU thread-pool tasks, CUDA blocks) and of the norm's deterministic partial sums.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/core/tensors.h"

namespace tfclip {

// Work is split into fixed-size chunks over all tensors flattened together. A chunk never
// spans two tensors, and its boundaries depend only on the tensor sizes, never on the thread
// count or launch shape: that is what makes the norm bitwise deterministic.
constexpr int64_t kChunkElems = int64_t{1} << 16;

struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// The chunks of a list, and the work blocks the thread pool schedules: consecutive chunks
// grouped until they hold about chunk_elems elements, so 2,000 small tensors are a few dozen
// tasks, not 2,000. Both depend only on the sizes; partial sums stay per chunk.
struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<int64_t> block_begin;  // block b covers chunks [block_begin[b], block_begin[b+1])
  int64_t num_blocks() const { return static_cast<int64_t>(block_begin.size()) - 1; }
};

// Plans the chunks of tensors with the given sizes (empty tensors get none).
void PlanChunks(const int64_t* sizes, int n, int64_t chunk_elems, ChunkPlan* plan);
// The same for a list of tensors, at kChunkElems.
void PlanList(const TensorView* ts, int n, ChunkPlan* plan);

}  // namespace tfclip
