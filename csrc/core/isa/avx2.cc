// The CPU passes built for AVX2 with FMA and F16C available. Flags: CMakeLists.txt (TFCLIP_ISA_FLAGS_avx2).
#define TFCLIP_ISA_NS isa_avx2
#define TFCLIP_ISA_NAME "avx2"
#include "csrc/core/cpu_kernels.inc"
