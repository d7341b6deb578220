// tfclip core, CPU: what the passes run on. The executor is whatever thread pool the adapter has
// (TF's intra-op pool in the OpKernel, XLA's in its handler, a pool of _core's own in the pybind11
// module); the passes say how much work a unit is, and it says how to cut the units into ranges.
#pragma once

#include <cstdint>
#include <functional>

namespace tfclip {

// parallel_for(num_units, cost_per_unit_in_cycles, fn(begin, end)) must call fn over a
// partition of [0, num_units). How it partitions does not change any result.
struct CpuExecutor {
  std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)> parallel_for;
};

// How many contiguous ranges an executor cuts n units of `cost` cycles each into: at most one per
// thread of its pool (`threads`), and none smaller than `min_cycles` of work (one: run inline).
// Not one more than the threads: a pool whose caller is one of its threads, or that queues ranges
// beyond them (TF's fixed-block ParallelFor), then runs a second round (benchmarks/NOTES.md, T3).
inline int64_t CpuRanges(int64_t threads, int64_t n, int64_t cost, int64_t min_cycles = int64_t{1} << 17) {
  const int64_t by_work = n * cost / min_cycles;
  int64_t r = threads < n ? threads : n;
  r = r < by_work ? r : by_work;
  return r > 1 ? r : 1;
}

// Cycles of work per element, for the executor's cost model.
constexpr int64_t kNormCostPerElem = 2;
constexpr int64_t kApplyCostPerElem = 10;

}  // namespace tfclip
