// tfclip core, CPU: narrow optimizer state's tiles (csrc/core/tensors.h, SlotStorage), each
// variant's own, reached through CpuKernels: bf16 state widened and rounded back
// (Bf16WidenTile, Bf16NarrowTile), int8 state (csrc/core/quant8.h) dequantized (Q8WidenTile) and
// quantized with each block's absmax (Q8NarrowTile). The apply passes call the active variant's
// through Bf16Slots and Q8Slots (pass_apply.cc), so the AVX-512 variant, whose apply passes are
// AVX2's, converts 16 lanes at a time all the same (the conversions, unlike the update loops,
// are bound by arithmetic). Every variant gives the same bits: the same operations on each
// element (bf16: a shift, round to nearest even with FloatToBFloat16's NaN; int8: a float32
// multiply, a float32 divide, the count of the code's flips <= the quotient, an order-free max),
// so tests/test_state_int8.py, tests/test_state_int8_code.py and tests/test_state_bf16.py compare the
// variants bit for bit.
//
// How each variant finds int8 values:
// - baseline: element by element, NearestCodeIndexed's bucket table and walk (three loads from
//   L1: in scalar code cheaper than the formula's arithmetic), and the code's table.
// - AVX2: 8 lanes of the code's formula (quant8.h), no gathers: the band from six compares, its constants
//   from registers (vpermps), the index from a multiply and one compare with a midpoint (the
//   rare lane within a few ulps of it redone exactly). Dequantizing, eight loads from the code
//   (in L1). Gathers were most of the int8 step on AMD's Zen cores (about 4x the float32-state
//   step, ../shared/notes/narrow-state-cpu.md).
// - AVX-512: no memory lookups at all. The code's 256 values sit in 16 registers, picked by
//   vpermt2ps (32 values by an index's low 5 bits) and blends on its bits 5, 6 and 7. The 255
//   flips sit in 18 registers as an implicit binary search tree (CodeIndex::tree): level L's 2^L
//   nodes looked up the same way by the L bits found so far, each level one more bit of the
//   count. On the development machine's Xeon (Sapphire Rapids, microcode that serializes
//   gathers) the gathers were 32% of the int8 Adam step's samples under perf, and the step 2.8x
//   the float32-state step's time; benchmarks/results/cpu-2026-11-29-int8-permute.txt has the
//   figures after.
#include <cmath>
#include "csrc/core/cpu/kernels.h"
#include "csrc/core/quant8.h"
#include "csrc/core/types.h"

#include "csrc/core/cpu/isa.h"  // from here to TFCLIP_ISA_END: TFCLIP_CPU_ISA's instruction set
#include "csrc/core/cpu/tiles.h"

namespace tfclip {
TFCLIP_CPU_PASSES(TFCLIP_ISA_NS)
namespace TFCLIP_ISA_NS {
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*(), which its
// -Wmaybe-uninitialized reports once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// BlockAbsmax (quant8.h) of a block, vectorized where the variant can: |x| with inf and NaN as
// +inf, a running max per lane, then the lanes; max is exact and order-free, so the same value
// as the scalar loop's (whose dependency chain through maxss was a third of the int8 step).
inline float TileAbsmax(const float* __restrict__ x, int64_t n) {
  int64_t j = 0;
  float m = 0.0f;
#if TFCLIP_ISA_AVX512
  if (n >= 32) {
    const __m512 big = _mm512_set1_ps(3.402823466e38f), inf = _mm512_set1_ps(INFINITY);
    __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    auto abs_inf = [&](__m512 v) {
      const __m512 a = _mm512_abs_ps(v);
      return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, big, _CMP_LE_OQ), inf, a);  // (false: inf, NaN)
    };
    for (; j + 32 <= n; j += 32) {
      m0 = _mm512_max_ps(m0, abs_inf(_mm512_loadu_ps(x + j)));
      m1 = _mm512_max_ps(m1, abs_inf(_mm512_loadu_ps(x + j + 16)));
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  }
#elif TFCLIP_ISA_F16C
  if (n >= 16) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e38f);
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    auto abs_inf = [&](__m256 v) {
      const __m256 a = _mm256_andnot_ps(sign, v);
      return _mm256_blendv_ps(inf, a, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // (false: inf, NaN)
    };
    for (; j + 16 <= n; j += 16) {
      m0 = _mm256_max_ps(m0, abs_inf(_mm256_loadu_ps(x + j)));
      m1 = _mm256_max_ps(m1, abs_inf(_mm256_loadu_ps(x + j + 8)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int k = 0; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
  }
#endif
  for (; j < n; ++j) m = AbsmaxAdd(m, x[j]);
  return AbsmaxOf(m);
}

// bf16 state (Bf16Slots): n bfloat16 slots widened exactly (a shift) into floats, and floats
// rounded back to nearest even (NarrowBFloat16Tile's bits, NaN included). AVX-512: 16 lanes of
// integer ops (not AVX512-BF16's vcvtneps2bf16, which treats subnormal inputs as zero).
void Bf16WidenTile(const bfloat16* __restrict__ in, float* __restrict__ out, int64_t n) {
  int64_t j = 0;
#if TFCLIP_ISA_AVX512
  for (; j + 16 <= n; j += 16) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j));
    _mm512_storeu_ps(out + j, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
  }
#endif
  WidenTile(in + j, out + j, n - j);
}
void Bf16NarrowTile(const float* __restrict__ in, bfloat16* __restrict__ out, int64_t n) {
  int64_t j = 0;
#if TFCLIP_ISA_AVX512
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(in + j);
    const __m512i u = _mm512_castps_si512(x);
    // The top half after adding 0x7fff plus the kept part's lowest bit; a NaN's top half with
    // the quiet bit set.
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i top = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), odd), 16);
    top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                _mm512_srli_epi32(_mm512_or_si512(u, quiet), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm512_cvtepi32_epi16(top));
  }
#endif
  NarrowBFloat16Tile(in + j, out + j, n - j);
}

#if TFCLIP_ISA_AVX512
// r[0 .. N) hold 16 N floats; lane i gets float idx[i] (idx < 16 N). N = 1: vpermps; else
// vpermt2ps on each pair of registers (the index's low 5 bits), then blends on bits 5, 6, 7.
template <int N>
inline __m512 Lookup16(const __m512* r, __m512i idx) {
  if constexpr (N == 1) {
    return _mm512_permutexvar_ps(idx, r[0]);
  } else {
    __m512 p[N / 2];  // (unrolled, so p stays in registers)
#pragma GCC unroll 8
    for (int j = 0; j < N / 2; ++j) p[j] = _mm512_permutex2var_ps(r[2 * j], idx, r[2 * j + 1]);
    int bit = 32;
#pragma GCC unroll 3
    for (int w = N / 2; w > 1; w /= 2, bit *= 2) {
      const __mmask16 upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(bit));
#pragma GCC unroll 4
      for (int j = 0; j < w / 2; ++j) p[j] = _mm512_mask_blend_ps(upper, p[2 * j], p[2 * j + 1]);
    }
    return p[0];
  }
}

// The flips' tree (CodeIndex::tree) in registers: level 0's node broadcast, levels 1 to 4 one
// register each (vpermps reads the low 4 bits), 5 two, 6 four, 7 eight. Loaded from the tree's
// level offsets 2^L - 1; no load reads past node 254.
struct FlipTree16 {
  __m512 root, l1, l2, l3, l4, l5[2], l6[4], l7[8];
  explicit FlipTree16(const float* t)
      : root(_mm512_set1_ps(t[0])),
        l1(_mm512_loadu_ps(t + 1)),
        l2(_mm512_loadu_ps(t + 3)),
        l3(_mm512_loadu_ps(t + 7)),
        l4(_mm512_loadu_ps(t + 15)) {
    for (int k = 0; k < 2; ++k) l5[k] = _mm512_loadu_ps(t + 31 + 16 * k);
    for (int k = 0; k < 4; ++k) l6[k] = _mm512_loadu_ps(t + 63 + 16 * k);
    for (int k = 0; k < 8; ++k) l7[k] = _mm512_loadu_ps(t + 127 + 16 * k);
  }
};
// One level down: the count's next bit is node <= y.
inline __m512i Descend16(__m512i idx, __m512 node, __m512 y) {
  const __m512i d = _mm512_add_epi32(idx, idx);
  return _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(node, y, _CMP_LE_OQ), d, _mm512_set1_epi32(1));
}
// NearestCode on 16 lanes: the number of flips <= y, NaN to the code's 0.
inline __m512i NearestCode16(const FlipTree16& t, __m512 y, int zero) {
  __m512i idx = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(t.root, y, _CMP_LE_OQ), _mm512_set1_epi32(1));
  idx = Descend16(idx, Lookup16<1>(&t.l1, idx), y);
  idx = Descend16(idx, Lookup16<1>(&t.l2, idx), y);
  idx = Descend16(idx, Lookup16<1>(&t.l3, idx), y);
  idx = Descend16(idx, Lookup16<1>(&t.l4, idx), y);
  idx = Descend16(idx, Lookup16<2>(t.l5, idx), y);
  idx = Descend16(idx, Lookup16<4>(t.l6, idx), y);
  idx = Descend16(idx, Lookup16<8>(t.l7, idx), y);
  return _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(zero));
}
#endif

#if TFCLIP_ISA_F16C && !TFCLIP_ISA_AVX512
// Q8Bands (quant8.h) in registers: each 8-entry table one register, looked up by a lane's band
// (vpermps).
struct Bands8 {
  __m256 p, r, lastf, mu, nu, lo_pos, lo_neg, hi_pos, hi_neg;
  __m256i base, last;
  __m256 bound[7];
  explicit Bands8(const Q8Bands& q)
      : p(_mm256_loadu_ps(q.p)),
        r(_mm256_loadu_ps(q.r)),
        mu(_mm256_loadu_ps(q.mu)),
        nu(_mm256_loadu_ps(q.nu)),
        lo_pos(_mm256_loadu_ps(q.lo[0])),
        lo_neg(_mm256_loadu_ps(q.lo[1])),
        hi_pos(_mm256_loadu_ps(q.hi[0])),
        hi_neg(_mm256_loadu_ps(q.hi[1])),
        base(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base))),
        last(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.last))) {
    lastf = _mm256_cvtepi32_ps(last);
    for (int k = 1; k < 7; ++k) bound[k] = _mm256_set1_ps(q.bound[k]);
  }
};

// The nearest code on 8 lanes by the code's formula (quant8.h): the band and the index in it as
// NearestCodeFormula's, then one compare with the band's affine midpoint (kQ8Ambiguous); a lane whose |y| lies within
// kQ8Ambiguous of its band's affine midpoint (about 1e-5 of them) is redone by the exact scalar
// NearestCodeFormula after the vector (its mask in *amb).
inline __m256i NearestCode8(const Bands8& t, const CodeIndex& ci, __m256 y, int* amb) {
  const __m256i ones = _mm256_set1_epi32(-1);
  // neg: a signed code's negative y (the sign bit); an unsigned code's is |y| = 0.
  const __m256i sign = _mm256_srai_epi32(_mm256_castps_si256(y), 31);
  __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y);
  __m256i neg = sign;
  if (!ci.is_signed) {
    a = _mm256_andnot_ps(_mm256_castsi256_ps(sign), a);
    neg = _mm256_setzero_si256();
  }
  const __m256 negf = _mm256_castsi256_ps(neg);
  __m256i b = _mm256_setzero_si256();
#pragma GCC unroll 6
  for (int k = 1; k < 7; ++k) b = _mm256_sub_epi32(b, _mm256_castps_si256(_mm256_cmp_ps(a, t.bound[k], _CMP_GE_OQ)));
  __m256 p = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_permutevar8x32_ps(t.p, b)), _mm256_permutevar8x32_ps(t.r, b));
  p = _mm256_max_ps(p, _mm256_set1_ps(-1.0f));
  p = _mm256_min_ps(p, _mm256_permutevar8x32_ps(t.lastf, b));
  const __m256i j1 = _mm256_cvttps_epi32(_mm256_add_ps(p, _mm256_set1_ps(1.0f)));  // j + 1
  const __m256i j = _mm256_add_epi32(j1, ones);
  const __m256 below = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_setzero_si256(), j));
  const __m256 top_end = _mm256_castsi256_ps(_mm256_cmpeq_epi32(j, _mm256_permutevar8x32_epi32(t.last, b)));
  // inside the band: |y| against the midpoint; at its ends, against the exact thresholds
  const __m256 m = _mm256_add_ps(_mm256_permutevar8x32_ps(t.mu, b),
                                 _mm256_mul_ps(_mm256_permutevar8x32_ps(t.nu, b), _mm256_cvtepi32_ps(j1)));
  const __m256 d = _mm256_sub_ps(a, m);
  const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo_pos, b), _mm256_permutevar8x32_ps(t.lo_neg, b), negf);
  const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.hi_pos, b), _mm256_permutevar8x32_ps(t.hi_neg, b), negf);
  __m256 up = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ);
  up = _mm256_blendv_ps(up, _mm256_cmp_ps(a, hi, _CMP_GE_OQ), top_end);
  up = _mm256_blendv_ps(up, _mm256_cmp_ps(a, lo, _CMP_GE_OQ), below);
  const __m256 close = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), d),
                                     _mm256_mul_ps(a, _mm256_set1_ps(kQ8Ambiguous)), _CMP_LE_OQ);
  *amb = _mm256_movemask_ps(_mm256_andnot_ps(_mm256_or_ps(below, top_end), close));
  __m256i r = _mm256_sub_epi32(_mm256_add_epi32(_mm256_permutevar8x32_epi32(t.base, b), j), _mm256_castps_si256(up));
  const __m256i top = _mm256_blendv_epi8(_mm256_set1_epi32(ci.bands->top[0]), _mm256_set1_epi32(ci.bands->top[1]), neg);
  r = _mm256_min_epi32(r, top);
  const __m256i zero = _mm256_set1_epi32(ci.zero);
  __m256i idx = r;
  if (ci.is_signed) idx = _mm256_blendv_epi8(_mm256_add_epi32(zero, r), _mm256_sub_epi32(zero, r), neg);
  return _mm256_blendv_epi8(idx, zero, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
}
#endif

// n codes from a block boundary (n <= kTile; the last block may be short) into out, each
// block's under absmax[block]: code[q] * absmax.
void Q8WidenTile(const uint8_t* __restrict__ q, const float* __restrict__ absmax, const CodeIndex& ci,
                 float* __restrict__ out, int64_t n) {
  const float* __restrict__ code = ci.code;
#if TFCLIP_ISA_AVX512
  __m512 lut[kQuantCodeSize / 16];
#pragma GCC unroll 16
  for (int k = 0; k < kQuantCodeSize / 16; ++k) lut[k] = _mm512_loadu_ps(code + 16 * k);
#endif
  for (int64_t b = 0; b < n; b += kQuantBlock) {
    const int64_t e = n - b < kQuantBlock ? n : b + kQuantBlock;
    const float m = absmax[b / kQuantBlock];
    int64_t j = b;
#if TFCLIP_ISA_AVX512
    const __m512 vm = _mm512_set1_ps(m);
    for (; j + 16 <= e; j += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
      _mm512_storeu_ps(out + j, _mm512_mul_ps(Lookup16<kQuantCodeSize / 16>(lut, idx), vm));
    }
#elif TFCLIP_ISA_F16C
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= e; j += 8) {  // eight loads from the code in L1: cheaper than a gather or a formula
      const __m256 v = _mm256_setr_ps(code[q[j]], code[q[j + 1]], code[q[j + 2]], code[q[j + 3]],
                                      code[q[j + 4]], code[q[j + 5]], code[q[j + 6]], code[q[j + 7]]);
      _mm256_storeu_ps(out + j, _mm256_mul_ps(v, vm));
    }
#endif
    for (; j < e; ++j) out[j] = code[q[j]] * m;
  }
}

// n floats from a block boundary (n <= kTile) into codes: each block's absmax into
// absmax[block], then each element's nearest code under it (NearestCodeIndexed's).
void Q8NarrowTile(const float* __restrict__ in, const CodeIndex& ci, uint8_t* __restrict__ q,
                  float* __restrict__ absmax, int64_t n) {
#if TFCLIP_ISA_AVX512
  const FlipTree16 tree(ci.tree);
#elif TFCLIP_ISA_F16C
  const Bands8 bands(*ci.bands);
#endif
  for (int64_t b = 0; b < n; b += kQuantBlock) {
    const int64_t e = n - b < kQuantBlock ? n : b + kQuantBlock;
    const float m = TileAbsmax(in + b, e - b);
    absmax[b / kQuantBlock] = m;
    if (!(m > 0.0f)) {
      for (int64_t j = b; j < e; ++j) q[j] = static_cast<uint8_t>(ci.zero);
      continue;
    }
    int64_t j = b;
#if TFCLIP_ISA_AVX512
    const __m512 vm = _mm512_set1_ps(m);
    for (; j + 16 <= e; j += 16) {
      const __m512 y = _mm512_div_ps(_mm512_loadu_ps(in + j), vm);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(NearestCode16(tree, y, ci.zero)));
    }
#elif TFCLIP_ISA_F16C
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= e; j += 8) {
      const __m256 y = _mm256_div_ps(_mm256_loadu_ps(in + j), vm);
      int amb;
      const __m256i lo = NearestCode8(bands, ci, y, &amb);
      const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + j), _mm_packus_epi16(w16, w16));
      if (__builtin_expect(amb != 0, 0)) {
        alignas(32) float ys[8];
        _mm256_store_ps(ys, y);
        for (int l = 0; l < 8; ++l) {
          if ((amb >> l) & 1) q[j + l] = static_cast<uint8_t>(NearestCodeFormula(ci, ys[l]));
        }
      }
    }
#endif
    for (; j < e; ++j) q[j] = static_cast<uint8_t>(NearestCodeIndexed(ci, in[j] / m));
  }
}

#pragma GCC diagnostic pop

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
