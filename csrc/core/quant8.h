// tfclip core: 8-bit blockwise dynamic quantization (issue 47's int8 optimizer state), the
// definition of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022), as
// bitsandbytes builds it (create_dynamic_map, quantize_blockwise):
// - the code: 256 float values in [-1, 1] (signed, for signed moments: Adam's m) or [0, 1]
//   (unsigned, for second moments: Adam's v), a dynamic exponent 10^-6 .. 10^0 and a fraction
//   whose bits shrink as the exponent grows; 0 and 1 included. Built from the paper's
//   construction in float64, each value rounded once to float32, sorted ascending (DynamicCode).
// - a block of kQuantBlock consecutive elements (the last may be shorter) stored as one float32
//   absmax, the largest |x| of the block, and one byte per element: the index of the code value
//   nearest x / absmax (float32 division; ties to the lower index; an all-zero block: absmax 0,
//   every byte the index of 0). A block holding inf or NaN stores absmax NaN: every element of
//   it dequantizes to NaN.
// - dequantized: code[byte] * absmax, in float32.
// The per-element functions are TFCLIP_HD: the CPU passes and the CUDA kernels call the same ones.
#pragma once

#include <cmath>
#include <cstdint>

#include "csrc/core/types.h"

namespace tfclip {

constexpr int kQuantCodeSize = 256;
// 256 elements per absmax: 4 bytes of absmax per 256 bytes of state (1.6%), a divisor of the
// CPU passes' tile (1024) and one CUDA thread block's width.
constexpr int64_t kQuantBlock = 256;
// The absmax count of n elements: one per kQuantBlock, the last block perhaps short.
constexpr int64_t QuantBlocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// The code, sorted ascending (host memory, built once).
const float* DynamicCode(bool is_signed);

// The index of the code value nearest y (y in [-1, 1], or NaN: the index of 0 then), ties to
// the lower index: a binary search over the sorted code for the first value >= y, then the
// nearer of it and its predecessor.
TFCLIP_HD int NearestCode(const float* code, float y, int zero_index) {
  if (!(y == y)) return zero_index;
  int lo = 0, hi = kQuantCodeSize - 1;  // first index with code >= y, in [0, 255]
  if (y >= code[hi]) return hi;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (code[mid] < y) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return 0;
  const float below = y - code[lo - 1], above = code[lo] - y;
  return above < below ? lo : lo - 1;
}

// The index of 0 in a code: the signed code has 127 negative values below it, the unsigned
// none (checked against the built codes by tests/test_state_int8_code.py).
constexpr int QuantZeroIndex(bool is_signed) { return is_signed ? 127 : 0; }

// A block's absmax, element by element: m = AbsmaxAdd(m, x) from m = 0 over the block, then
// AbsmaxOf(m). A non-finite |x| counts as +inf, so the block's absmax is NaN when any element is
// inf or NaN (the definition above) whatever the order the elements come in (max is
// order-free: the CPU's loop and the CUDA warp's butterfly give the same value).
TFCLIP_HD float AbsmaxAdd(float m, float x) {
  float a = x < 0.0f ? -x : x;
  if (!(a <= 3.402823466e38f)) a = INFINITY;
  return a > m ? a : m;
}
TFCLIP_HD float AbsmaxOf(float m) { return m <= 3.402823466e38f ? m : NAN; }
// The absmax of the block x[0..n) on the host (the CPU passes and QuantizeBlockwise).
inline float BlockAbsmax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = AbsmaxAdd(m, x[i]);
  return AbsmaxOf(m);
}

// The code as a formula (quant8.cc's BuildCode): band b = 0..6 holds K_b = 2^(b + u) magnitudes
// (u = 1 unsigned, 0 signed), value j of it s_b (0.1 + 0.9 (j + 1/2) / K_b), s_b = 10^(b - 6),
// which is float(A_b + B_b j) evaluated in double (the same floats as BuildCode's: all 256 of
// each code are checked where the bands are built). A magnitude's rank: 0 the code's 0, then the
// bands' values in order (band b's from base_b = K_b - u), then the code's 1 (positive only).
// Entries 7 of each table repeat entry 6, so a 256-bit register holds a whole table.
struct Q8Bands {
  double a[8], b[8];        // A_b, B_b
  float p[8], r[8];         // the rank estimate: floor(|y| p_b - r_b) is j or j - 1 (below)
  int32_t base[8], last[8];  // base_b, K_b - 1
  float below[8], above[8];  // the magnitudes of ranks base_b - 1 and base_b + K_b (0 and 1 at the ends)
  float bound[8];            // bound[b] = 10^(b - 7) (b = 1..6): the band of |y| is #{b : |y| >= bound[b]}
  // The vector tiles' fast test (kQ8Ambiguous): inside band b the real midpoint between values j and j + 1,
  // mu_b + nu_b (j + 1) in float, within a few ulps of where the index steps up; at the band's
  // ends the exact thresholds (the smallest magnitude of rank base_b, and of base_b + K_b), for a
  // positive and a negative y (ties go the other way).
  float mu[8], nu[8];
  float lo[2][8], hi[2][8];  // [0]: a positive y's, [1]: a negative y's
  int32_t top[2];            // the largest rank of a positive and of a negative y
};

// NearestCode of the host, without a search (issue 69): the band of |y| from six compares, the
// index j inside it from a multiply (|y| p_b - r_b is within 1/2 of the real position of |y|
// among the band's values minus 1/2, so its floor is the nearest value or the one below it; the
// code's own rounding moves its flips by about 1e-5 of a step), then NearestCode's own test
// against the two neighbours (values j and j + 1, from the formula: the band's neighbours at its
// ends), which picks between them exactly as the search does: the upper one when nearer, ties to
// the lower index (for a negative y, the larger magnitude). NaN to the code's 0. The same index
// as NearestCode for every float: tests/test_state_int8_code.py sweeps every float in [-1, 1].
// The code's flips (kept for the AVX-512 tiles' search tree and the tests' sweep): flip k is the
// smallest float y in (code[k], code[k+1]] that NearestCode sends to k + 1 (its test,
// code[k+1] - y < y - code[k], holds from there on in float arithmetic), found once by bisection
// over the floats (ordered as integers: OrderedKey). NearestCode(y) is the number of flips <= y.
struct CodeIndex {
  const float* code;
  const float* flips;  // 255 flip points, then a NaN
  // The flips as an implicit binary search tree, level by level: level L's 2^L nodes from
  // 2^L - 1, node p of level L flip (2 p + 1) 2^(7 - L) - 1. Descending it, each level's compare
  // (node <= y) is the next bit of the count of flips <= y (pass_state_tiles.cc's AVX-512 tiles).
  const float* tree;
  const Q8Bands* bands;
  const int32_t* start;  // per bucket (NearestCodeIndexed): the count of flips below its smallest float
  uint32_t base;         // OrderedKey(-1.0f)
  int32_t buckets;
  int zero;
  bool is_signed;
};
inline uint32_t OrderedKey(float y) {
  uint32_t u;
  __builtin_memcpy(&u, &y, sizeof(u));
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
const CodeIndex& DynamicCodeIndex(bool is_signed);

// NearestCode element by element without the search (the baseline's tiles and scalar tails:
// three loads from L1, cheaper in scalar code than the formula's arithmetic, 2-3x on the
// development machine): the floats ordered as integers (OrderedKey), their top bits a bucket
// (2^-6 of a binade), each bucket's count of the flips below it in a table; from it kCodeWalk
// branch-free steps over the flips in the bucket (building the table checks there are no
// more), and NaN to the code's 0.
constexpr int kCodeKeyShift = 17;
constexpr int kCodeWalk = 2;
inline int NearestCodeIndexed(const CodeIndex& ci, float y) {
  // The bucket: below -1 (not a quotient x / absmax) clamps to the first, above 1 to the last.
  const uint32_t key = OrderedKey(y);
  int32_t b = key < ci.base ? 0 : static_cast<int32_t>((key - ci.base) >> kCodeKeyShift);
  b = b < ci.buckets ? b : ci.buckets - 1;
  int lo = ci.start[b];
  for (int s = 0; s < kCodeWalk; ++s) lo += ci.flips[lo] <= y ? 1 : 0;
  return y == y ? lo : ci.zero;
}
inline uint8_t QuantizeOneIndexed(const CodeIndex& ci, float x, float absmax) {
  return static_cast<uint8_t>(absmax > 0.0f ? NearestCodeIndexed(ci, x / absmax) : ci.zero);
}

// Value j of band b (j = -1 and j = K_b: its neighbours).
TFCLIP_HD float BandValue(const Q8Bands& q, int b, int j) {
  if (j < 0) return q.below[b];
  if (j > q.last[b]) return q.above[b];
  return static_cast<float>(q.a[b] + q.b[b] * static_cast<double>(j));
}

TFCLIP_HD bool SignBit(float y) {
#ifdef __CUDA_ARCH__
  return (__float_as_uint(y) >> 31) != 0;
#else
  uint32_t u;
  __builtin_memcpy(&u, &y, sizeof(u));
  return (u >> 31) != 0;
#endif
}

// NearestCodeFormula of a code's bands (host and device: the CUDA kernel's too).
TFCLIP_HD int NearestCodeFormula(const Q8Bands& q, bool is_signed, int zero, float y) {
  if (!(y == y)) return zero;
  const bool neg = is_signed && SignBit(y);
  float a = y < 0.0f ? -y : y;
  if (!is_signed && SignBit(y)) a = 0.0f;  // unsigned: nearest to 0 (rank 0)
  int b = 0;
  for (int k = 1; k < 7; ++k) b += a >= q.bound[k] ? 1 : 0;
  float p = a * q.p[b] - q.r[b];
  p = p > -1.0f ? p : -1.0f;  // (|y| <= 1: finite, and p >= -1 truncates as floor below)
  p = p < static_cast<float>(q.last[b]) ? p : static_cast<float>(q.last[b]);
  const int j = static_cast<int>(p + 1.0f) - 1;
  const float d_lo = a - BandValue(q, b, j), d_hi = BandValue(q, b, j + 1) - a;
  int r = q.base[b] + j + ((neg ? d_hi <= d_lo : d_hi < d_lo) ? 1 : 0);
  const int top = q.top[neg ? 1 : 0];
  r = r < top ? r : top;
  return !is_signed ? r : neg ? zero - r : zero + r;
}
TFCLIP_HD uint8_t QuantizeOneFormula(const Q8Bands& q, bool is_signed, int zero, float x, float absmax) {
  return static_cast<uint8_t>(absmax > 0.0f ? NearestCodeFormula(q, is_signed, zero, x / absmax) : zero);
}
inline int NearestCodeFormula(const CodeIndex& ci, float y) {
  return NearestCodeFormula(*ci.bands, ci.is_signed, ci.zero, y);
}

// The vector tiles' fast test (pass_state_tiles.cc, NearestCode8): inside the band, |y| against
// the affine midpoint (Q8Bands::mu, nu) in float, whose error and the code's own rounding put the
// true step within kQ8Ambiguous |y| of it; a |y| that close (about 1e-5 of the inputs) takes
// NearestCodeFormula's exact test. At the band's ends, the exact thresholds.
constexpr float kQ8Ambiguous = 1.0f / (1 << 19);

// The sweep behind the tests' proof (tests/test_state_int8_code.py): every float in [-1, 1]
// with a stride (1: all of them, about 2^31) through a CPU variant's int8 tiles (blocks of 255
// of them after a 1, so each block's absmax is 1 and each quotient the float itself) and, with
// `formula`, through NearestCodeFormula itself (the CUDA kernel's and the AVX2 tiles' exact
// test), against the count of the code's flips <= y, and every 4099th float and each flip and
// the float below it against NearestCode's search itself. Returns the floats checked; *bad how
// many differed, *first_bad the first.
using Q8NarrowFn = void (*)(const float* in, const CodeIndex& ci, uint8_t* q, float* absmax, int64_t n);
int64_t Q8SweepCode(bool is_signed, int64_t stride, Q8NarrowFn narrow, bool formula, int64_t* bad, float* first_bad);

// x[0..n) into q[0..n) and absmax[0..ceil(n / block)), per the definition above.
void QuantizeBlockwise(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q, float* absmax);
// q and absmax back into out[0..n).
void DequantizeBlockwise(const uint8_t* q, const float* absmax, int64_t n, int64_t block, bool is_signed,
                         float* out);

}  // namespace tfclip
