// tfclip core, CPU: the tiles every pass builds on, per instruction set: the norm pass's fp64
// lanes (AddSquares, ChunkSumSquares), 16-bit storage widened into float tiles and rounded back
// (WidenTile, WidenScaledTile, NarrowBFloat16Tile; with F16C where the target has it), the clip
// op's scale (ScaleChunk).
#pragma once
#ifndef TFCLIP_ISA_NS
#error "cpu/tiles.h is compiled for a pass file's instruction set: include csrc/core/cpu/isa.h first"
#endif

namespace tfclip {
namespace TFCLIP_ISA_NS {
namespace {

// Sum of squares of one chunk in a fixed order: kLanes fp64 lanes (element i on lane
// (i - b) % kLanes), then the lanes added pairwise. kLanes independent add chains keep the
// loop at memory speed; with four, one vector of adds waited on the last (latency-bound;
// benchmarks/NOTES.md, "Figures behind the code": C1). 16-bit storage is widened a tile at a time into a float buffer
// by a plain loop (which vectorizes; the conversion is branch-free), then the same loop runs
// on the buffer: kTile is a multiple of kLanes, so every element keeps its lane.
constexpr int64_t kTile = 1024;
constexpr int kLanes = 16;
static_assert(kTile % kLanes == 0, "tiles keep the lanes");
template <typename T>
constexpr bool kWiden = sizeof(T) == 2;

#if TFCLIP_ISA_F16C
// The AVX2 and AVX-512 variants (csrc/core/isa/) convert float16 with F16C: the same values as
// HalfToFloat and FloatToHalf (exact widening; round to nearest even, subnormals and overflow
// included). A NaN is rounded to FloatToHalf's quiet NaN with its sign, so the bits match the
// baseline's too. 8 elements at a time; the tail takes the portable path.
constexpr int64_t kF16cWidth = 8;
inline __m256 LoadHalf8(const half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 RoundHalf8(__m256 x) {
  const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  const __m256 quiet_nan = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  return _mm256_blendv_ps(r, quiet_nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
// bfloat16 has no conversion instructions before AVX-512 BF16; these are FloatToBFloat16 and
// BFloat16ToFloat (types.h) on 8 lanes of AVX2 integer ops, the same bits: widening is a
// shift, rounding adds 0x7fff plus the kept part's lowest bit, a NaN keeps its top half with
// the quiet bit set. (The portable loop did not vectorize: benchmarks/NOTES.md, "Figures
// behind the code": C2.)
inline __m256 LoadBFloat16x8(const bfloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline __m256 RoundBFloat16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), high);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan),
                          _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

// Floats rounded to bfloat16 (to nearest even, FloatToBFloat16's bits): the store of a float
// variable's bf16 slots (SlotStorage), a tile at a time. Inside the update loop the rounding
// does not vectorize (NOTES.md's C2, C3); here 8 lanes at a time, packed to 16 bits.
inline void NarrowBFloat16Tile(const float* __restrict__ in, bfloat16* __restrict__ out, int64_t n) {
  int64_t j = 0;
#if TFCLIP_ISA_F16C
  for (; j + kF16cWidth <= n; j += kF16cWidth) {
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(RoundBFloat16x8(_mm256_loadu_ps(in + j))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
  }
#endif
  for (; j < n; ++j) out[j] = Elem<bfloat16>::Store(in[j]);
}

template <typename T>
void WidenTile(const T* __restrict__ p, float* __restrict__ out, int64_t n) {
  int64_t j = 0;
#if TFCLIP_ISA_F16C
  if constexpr (std::is_same_v<T, half>) {
    for (; j + kF16cWidth <= n; j += kF16cWidth) _mm256_storeu_ps(out + j, LoadHalf8(p + j));
  }
#endif
  for (; j < n; ++j) out[j] = Elem<T>::Load(p[j]);
}

// A 16-bit gradient times the clip scale, rounded back to its dtype (as TF computes
// `g * cast(scale, g.dtype)`): ApplyLoop's scaled step, done here in a loop simple enough to
// vectorize (inside the update loop the 16-bit rounding did not: NOTES.md's C3).
template <typename T>
void WidenScaledTile(const T* __restrict__ p, float* __restrict__ out, int64_t n, float scale) {
  int64_t j = 0;
#if TFCLIP_ISA_F16C
  if constexpr (std::is_same_v<T, half>) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + kF16cWidth <= n; j += kF16cWidth) {
      _mm256_storeu_ps(out + j, RoundHalf8(_mm256_mul_ps(LoadHalf8(p + j), s)));
    }
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + kF16cWidth <= n; j += kF16cWidth) {
      _mm256_storeu_ps(out + j, RoundBFloat16x8(_mm256_mul_ps(LoadBFloat16x8(p + j), s)));
    }
  }
#endif
  for (; j < n; ++j) out[j] = RoundTo<T>(Elem<T>::Load(p[j]) * scale);
}

template <typename T>
void AddSquares(const T* __restrict__ p, int64_t n, double* __restrict__ acc) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double x = static_cast<double>(Elem<T>::Load(p[j + k]));
      acc[k] += x * x;
    }
  }
  for (int k = 0; j < n; ++j, ++k) {
    const double x = static_cast<double>(Elem<T>::Load(p[j]));
    acc[k] += x * x;
  }
}

template <typename T>
double ChunkSumSquares(const T* p, int64_t b, int64_t e) {
  double acc[kLanes] = {};
  if constexpr (kWiden<T>) {
    float buf[kTile];
    for (int64_t t = b; t < e; t += kTile) {
      const int64_t n = e - t < kTile ? e - t : kTile;
      WidenTile(p + t, buf, n);
      AddSquares(buf, n, acc);  // a partial group only in the last tile
    }
  } else {
    AddSquares(p + b, e - b, acc);
  }
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  }
  return acc[0];
}

template <typename T>
void ScaleChunk(const T* in, T* out, int64_t b, int64_t e, double scale) {
  using M = typename Elem<T>::Math;
  const M s = RoundTo<T>(static_cast<M>(scale));
  for (int64_t i = b; i < e; ++i) out[i] = Elem<T>::Store(Elem<T>::Load(in[i]) * s);
}

}  // namespace
}  // namespace TFCLIP_ISA_NS
}  // namespace tfclip
