// The CPU passes built for AVX2 with FMA and F16C, but the sparse apply pass, which is the
// baseline's (TFCLIP_ISA_SPARSE_FROM): its row gathers are memory-bound in either, the same
// speed in benchmarks/sparse_bench.py (2026-11-27), and it was a third of this file's compile
// time (issue 43). Only the code of
// cpu_kernels.inc gets this target (its #pragma GCC target region); every header is compiled for
// the baseline, so a shared inline copy the linker keeps is safe on any x86-64.
#define TFCLIP_ISA_NS isa_avx2
#define TFCLIP_ISA_NAME "avx2"
#define TFCLIP_ISA_TARGET "avx2,fma,f16c"
#define TFCLIP_ISA_F16C 1  // the target has F16C (GCC defines no __F16C__ after a target pragma)
#define TFCLIP_ISA_SPARSE_FROM isa_baseline
#include "csrc/core/cpu_kernels.inc"
