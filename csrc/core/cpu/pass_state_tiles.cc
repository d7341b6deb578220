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
// How each variant looks int8 values up:
// - baseline: element by element, NearestCodeIndexed's bucket table and walk.
// - AVX2: 8 lanes with gathers from the code, the bucket table and the flips.
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
// NearestCodeIndexed on 16 lanes: the number of flips <= y, NaN to the code's 0.
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

// n codes from a block boundary (n <= kTile; the last block may be short) into out, each
// block's under absmax[block]: code[q] * absmax.
void Q8WidenTile(const uint8_t* __restrict__ q, const float* __restrict__ absmax, const float* __restrict__ code,
                 float* __restrict__ out, int64_t n) {
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
    for (; j + 8 <= e; j += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), vm));
    }
#endif
    for (; j < e; ++j) out[j] = code[q[j]] * m;
  }
}

// n floats from a block boundary (n <= kTile) into codes: each block's absmax into
// absmax[block], then each element's nearest code under it (QuantizeOneIndexed's).
void Q8NarrowTile(const float* __restrict__ in, const CodeIndex& ci, uint8_t* __restrict__ q,
                  float* __restrict__ absmax, int64_t n) {
#if TFCLIP_ISA_AVX512
  const FlipTree16 tree(ci.tree);
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
    const __m256i flip = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i vbase = _mm256_set1_epi32(static_cast<int>(ci.base));
    const __m256i vbase_s = _mm256_xor_si256(vbase, flip);  // for an unsigned compare
    const __m256i vlast = _mm256_set1_epi32(ci.buckets - 1), vzi = _mm256_set1_epi32(ci.zero);
    for (; j + 8 <= e; j += 8) {
      const __m256 y = _mm256_div_ps(_mm256_loadu_ps(in + j), vm);
      const __m256i u = _mm256_castps_si256(y);
      // OrderedKey: ~u for a negative y, u | 2^31 else; then the bucket, clamped.
      const __m256i key = _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31), flip));
      const __m256i below_base = _mm256_cmpgt_epi32(vbase_s, _mm256_xor_si256(key, flip));
      __m256i bk = _mm256_andnot_si256(below_base, _mm256_srli_epi32(_mm256_sub_epi32(key, vbase), kCodeKeyShift));
      bk = _mm256_min_epi32(bk, vlast);
      __m256i lo = _mm256_i32gather_epi32(ci.start, bk, 4);
      for (int s = 0; s < kCodeWalk; ++s) {  // lo += flips[lo] <= y (a true compare is -1)
        lo = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(_mm256_i32gather_ps(ci.flips, lo, 4), y, _CMP_LE_OQ)));
      }
      lo = _mm256_blendv_epi8(lo, vzi, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
      const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + j), _mm_packus_epi16(w16, w16));
    }
#endif
    for (; j < e; ++j) q[j] = static_cast<uint8_t>(NearestCodeIndexed(ci, in[j] / m));
  }
}

#pragma GCC diagnostic pop

}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
TFCLIP_ISA_END
