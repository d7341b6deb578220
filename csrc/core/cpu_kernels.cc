// tfclip core, CPU: which instruction-set variant of the passes runs (cpu_kernels.h). The
// variants are csrc/core/isa/*.cc, one compilation of cpu_kernels.inc each.
#include "csrc/core/cpu_kernels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace tfclip {

#define TFCLIP_DECLARE_ISA(NS) \
  namespace NS {                \
  const CpuKernels& Kernels();  \
  }
TFCLIP_DECLARE_ISA(isa_baseline)
#if TFCLIP_ISA_VARIANTS
TFCLIP_DECLARE_ISA(isa_avx2)
TFCLIP_DECLARE_ISA(isa_avx512)
#endif
#undef TFCLIP_DECLARE_ISA

namespace {

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
    {&isa_avx512::Kernels, &HasAvx512},
    {&isa_avx2::Kernels, &HasAvx2},
#endif
    {&isa_baseline::Kernels, &Always},
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
