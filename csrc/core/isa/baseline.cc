// The CPU passes built for the compiler's baseline for the target (x86-64: SSE2). Flags: CMakeLists.txt (TFCLIP_ISA_FLAGS_baseline).
#define TFCLIP_ISA_NS isa_baseline
#define TFCLIP_ISA_NAME "baseline"
#include "csrc/core/cpu_kernels.inc"
