// tfclip core, CPU: a pass file's instruction set. CMake compiles each csrc/core/cpu/pass_*.cc once
// per variant it is built for, naming it with TFCLIP_CPU_ISA_AVX2 or TFCLIP_CPU_ISA_AVX512 (none:
// the baseline, the compiler's default for the target, x86-64's SSE2); kernels.cc picks the best
// the CPU supports at run time. Never -march=native: the shipped library runs on any x86-64.
//
// A pass file includes every header of the core first, then this one, then the instruction-set
// headers it uses (cpu/tiles.h, cpu/apply_loops.h, ...), and ends with TFCLIP_ISA_END. From here
// to TFCLIP_ISA_END, and only there, code is compiled for the variant's target (a
// `#pragma GCC target` region, not -m flags): the headers included before stay at the baseline
// in every variant, so no inline function the linker merges across the variants carries an
// instruction the CPU may lack. The TFCLIP_HD bodies are always inlined (types.h), so the loops
// get their own copies, vectorized for the target. Every variant is built with -ffp-contract=off
// and runs the same operations in the same order: the same bits (tests/test_core_parity.py).
#pragma once

#if defined(TFCLIP_CPU_ISA_AVX512)
#define TFCLIP_ISA_NS isa_avx512
#define TFCLIP_ISA_NAME "avx512"
#define TFCLIP_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"
#define TFCLIP_ISA_F16C 1    // the target has F16C (GCC defines no __F16C__ after a target pragma)
#define TFCLIP_ISA_AVX512 1  // pass_state_tiles.cc's 16-lane bf16 and int8 state tiles
#elif defined(TFCLIP_CPU_ISA_AVX2)
#define TFCLIP_ISA_NS isa_avx2
#define TFCLIP_ISA_NAME "avx2"
#define TFCLIP_ISA_TARGET "avx2,fma,f16c"
#define TFCLIP_ISA_F16C 1
#else
#define TFCLIP_ISA_NS isa_baseline
#define TFCLIP_ISA_NAME "baseline"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifdef TFCLIP_ISA_TARGET
#define TFCLIP_PRAGMA_STR(x) _Pragma(#x)
#define TFCLIP_PRAGMA(x) TFCLIP_PRAGMA_STR(x)  // expands TFCLIP_ISA_TARGET (#pragma would not)
#pragma GCC push_options
TFCLIP_PRAGMA(GCC target(TFCLIP_ISA_TARGET))
#define TFCLIP_ISA_END _Pragma("GCC pop_options")
#else
#define TFCLIP_ISA_END
#endif
