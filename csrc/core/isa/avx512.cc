// The CPU passes built for AVX-512 (F, BW, VL, DQ) with AVX2, FMA and F16C available. Flags: CMakeLists.txt (TFCLIP_ISA_FLAGS_avx512).
#define TFCLIP_ISA_NS isa_avx512
#define TFCLIP_ISA_NAME "avx512"
#include "csrc/core/cpu_kernels.inc"
