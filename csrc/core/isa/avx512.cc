// The CPU norm and scale passes built for AVX-512 (F, BW, VL, DQ), 512-bit vectors preferred;
// the apply passes are the AVX2 variant's (TFCLIP_ISA_APPLY_FROM). The AVX-512 gain measured was
// the 16-bit norm pass (4.4 ms against AVX2's 6.4, benchmarks/NOTES.md section 8); the apply
// passes are memory-bound in AVX2 already, and compiling them a third time took 100 s of the
// build (issue 43). Only the code of cpu_kernels.inc gets this target (its #pragma GCC target
// region); every header is compiled for the baseline, so a shared inline copy the linker keeps is
// safe on any x86-64.
#define TFCLIP_ISA_NS isa_avx512
#define TFCLIP_ISA_NAME "avx512"
#define TFCLIP_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"
#define TFCLIP_ISA_F16C 1  // the target has F16C (GCC defines no __F16C__ after a target pragma)
#define TFCLIP_ISA_AVX512 1  // cpu_state_tiles.inc's 16-lane bf16 and int8 state tiles
#define TFCLIP_ISA_NORM_ONLY 1
#define TFCLIP_ISA_APPLY_FROM isa_avx2
#include "csrc/core/cpu_kernels.inc"
