// tfclip core, CPU: each instruction-set variant's kernel table, from the passes compiled for it
// (csrc/core/cpu/pass_*.cc, cpu/isa.h), and which variant runs (kernels.h).
#include "csrc/core/cpu/kernels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace tfclip {

TFCLIP_CPU_PASSES(isa_baseline)
#if TFCLIP_ISA_VARIANTS
TFCLIP_CPU_PASSES(isa_avx2)
TFCLIP_CPU_PASSES(isa_avx512)
#endif

namespace {

// The baseline's passes, every one of them (every CPU runs it; the only variant off x86-64 or
// with a compiler other than GCC).
const CpuKernels& Baseline() {
  using namespace isa_baseline;
  static const CpuKernels k{"baseline", &SumSquares, &Scale, &Apply, &SparseApply, &Trust, &FactoredPass,
                            &AgcSums, &Bf16WidenTile, &Bf16NarrowTile, &Q8WidenTile, &Q8NarrowTile};
  return k;
}

#if TFCLIP_ISA_VARIANTS
// AVX2 with FMA and F16C, but the sparse apply pass, which is the baseline's: its row gathers are
// memory-bound in either, the same speed in benchmarks/sparse_bench.py (2026-11-27), and it was
// a third of this variant's compile time (issue 43).
const CpuKernels& Avx2() {
  using namespace isa_avx2;
  static const CpuKernels k{"avx2", &SumSquares, &Scale, &Apply, &isa_baseline::SparseApply, &Trust,
                            &FactoredPass, &AgcSums, &Bf16WidenTile, &Bf16NarrowTile, &Q8WidenTile,
                            &Q8NarrowTile};
  return k;
}

// AVX-512 (F, BW, VL, DQ), 512-bit vectors preferred, for the norm and scale passes (the gain
// measured was the 16-bit norm pass: 4.4 ms against AVX2's 6.4, benchmarks/NOTES.md section 8),
// the factored passes (compute-bound: a square root and two divisions an element, float64 sums)
// and narrow state's tiles (bound by arithmetic, 16 lanes at a time); the element-wise apply
// passes are AVX2's, memory-bound there already (compiling them a third time took 100 s of the
// build, issue 43).
const CpuKernels& Avx512() {
  static const CpuKernels k = [] {
    CpuKernels x = Avx2();
    x.name = "avx512";
    x.sum_squares = &isa_avx512::SumSquares;
    x.scale = &isa_avx512::Scale;
    x.factored = &isa_avx512::FactoredPass;
    x.bf16_widen = &isa_avx512::Bf16WidenTile;
    x.bf16_narrow = &isa_avx512::Bf16NarrowTile;
    x.q8_widen = &isa_avx512::Q8WidenTile;
    x.q8_narrow = &isa_avx512::Q8NarrowTile;
    return x;
  }();
  return k;
}
#endif

struct Variant {
  const CpuKernels& (*kernels)();
  bool (*supported)();
};

bool Always() { return true; }
#if TFCLIP_ISA_VARIANTS
bool HasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool HasAvx512() {
  __builtin_cpu_init();
  return HasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

// Best first.
const Variant kVariants[] = {
#if TFCLIP_ISA_VARIANTS
    {&Avx512, &HasAvx512},
    {&Avx2, &HasAvx2},
#endif
    {&Baseline, &Always},
};

const CpuKernels* Pick(const char* want) {
  for (const Variant& v : kVariants) {
    if (!v.supported()) continue;
    if (want == nullptr || *want == '\0' || std::string(want) == v.kernels().name) return &v.kernels();
  }
  return nullptr;
}

std::atomic<const CpuKernels*>& Active() {
  static std::atomic<const CpuKernels*> active{[] {
    const CpuKernels* k = Pick(std::getenv("TFCLIP_CPU_ISA"));
    return k != nullptr ? k : Pick(nullptr);  // an unknown or unsupported request: the best
  }()};
  return active;
}

}  // namespace

const CpuKernels& ActiveCpuKernels() { return *Active().load(std::memory_order_acquire); }

std::vector<std::string> SupportedCpuIsas() {
  std::vector<std::string> out;
  for (const Variant& v : kVariants) {
    if (v.supported()) out.push_back(v.kernels().name);
  }
  return out;
}

bool SetCpuIsa(const std::string& name) {
  const CpuKernels* k = Pick(name.c_str());
  if (k == nullptr) return false;
  Active().store(k, std::memory_order_release);
  return true;
}

}  // namespace tfclip
