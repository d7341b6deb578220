// The CPU passes built for the compiler's baseline for the target (x86-64: SSE2): the variant
// every CPU can run, and the only one off x86-64 or with a compiler other than GCC.
#define TFCLIP_ISA_NS isa_baseline
#define TFCLIP_ISA_NAME "baseline"
#include "csrc/core/cpu_kernels.inc"
