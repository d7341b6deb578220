// tfclip core, CPU: a bfloat16 variable's stochastic rounding in the passes (csrc/core/rounding.h
// defines the bits): a tile's Philox draws made ahead, 8 at a time with AVX2 (FillRoundBitsTile),
// the constants pointed at them (WithTileBits), and a tile narrowed with them
// (NarrowStochasticTile).
#pragma once
#ifndef TFCLIP_ISA_NS
#error "cpu/rounding_tiles.h is compiled for a pass file's instruction set: include csrc/core/cpu/isa.h first"
#endif

namespace tfclip {
namespace TFCLIP_ISA_NS {
namespace {

// FillRoundBits (csrc/core/rounding.h) with 8 Philox draws at a time where the variant has AVX2:
// each lane's 32 x 32 -> 64-bit products from _mm256_mul_epu32 on the even and the odd lanes, the
// same rounds on the same words, so the same bits (tests/test_stochastic_rounding.py holds every
// path to the NumPy reference); the draws' 16-bit halves then go to their elements in order.
inline void FillRoundBitsTile(const RoundKey& k, int64_t b, int64_t n, uint16_t* __restrict__ out) {
  if (n <= 0) return;
  uint64_t q = static_cast<uint64_t>(b) >> 3;
  const uint64_t last = static_cast<uint64_t>(b + n - 1) >> 3;
#if TFCLIP_ISA_F16C
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; q + 8 <= last + 1; q += 8) {
    if ((q >> 32) != ((q + 7) >> 32)) break;  // (a carry into the high word: the scalar draws)
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(q))), lane);
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(q >> 32)));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(k.tensor));
    __m256i c3 = _mm256_set1_epi32(static_cast<int>(k.step));
    uint32_t k0 = k.k0, k1 = k.k1;
    for (int r = 0; r < 10; ++r) {
      if (r > 0) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      const __m256i e0 = _mm256_mul_epu32(c0, m0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
      const __m256i e1 = _mm256_mul_epu32(c2, m1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
      const __m256i lo0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
      const __m256i lo1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
    }
    alignas(32) uint32_t w[4][8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[0]), c0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[1]), c1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[2]), c2);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[3]), c3);
    for (int d = 0; d < 8; ++d) {
      for (int h = 0; h < 8; ++h) {
        const int64_t j = static_cast<int64_t>(8 * (q + d)) + h - b;
        if (j >= 0 && j < n) out[j] = static_cast<uint16_t>((w[h >> 1][d] >> (16 * (h & 1))) & 0xFFFFu);
      }
    }
  }
#endif
  if (q > last) return;
  const int64_t done = static_cast<int64_t>(8 * q) - b;  // elements [b, 8q) drawn above
  const int64_t skip = done > 0 ? done : 0;
  FillRoundBits(k, b + skip, n - skip, out + skip);
}

// A bfloat16 variable's stochastic rounding (csrc/core/rounding.h) draws a tile's bits ahead,
// 8 elements a draw, into `bits`: the constants then point the store at them.
template <typename V, typename C>
C WithTileBits(const C& c, int64_t b, int64_t e, uint16_t* bits) {
  if constexpr (!std::is_same_v<V, bfloat16>) {
    return c;
  } else {
    if (!c.round.on) return c;
    FillRoundBitsTile(c.round, b, e - b, bits);
    C k = c;
    k.round.bits = bits;
    k.round.bits_at = b;
    return k;
  }
}

// A tile of float values stored into a bfloat16 variable, each rounded stochastically with its
// drawn bits (StoreVar's rounding, a loop that vectorizes).
inline void NarrowStochasticTile(const float* __restrict__ in, bfloat16* __restrict__ out,
                                 const uint16_t* __restrict__ bits, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = StochasticRoundBf16(in[j], bits[j]);
}

}  // namespace
}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
