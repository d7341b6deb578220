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

// One element's code index under its block's absmax.
TFCLIP_HD uint8_t QuantizeOne(const float* code, int zero_index, float x, float absmax) {
  return static_cast<uint8_t>(absmax > 0.0f ? NearestCode(code, x / absmax, zero_index) : zero_index);
}

// NearestCode on the host without the binary search (8 unpredictable branches an element, most
// of the CPU pass's time). NearestCode(y) is the number of the code's 255 flip points <= y: flip
// k is the smallest float y in (code[k], code[k+1]] that NearestCode sends to k + 1 (its test,
// code[k+1] - y < y - code[k], holds from there on in float arithmetic), found once by bisection
// over the floats. Floats ordered as integers (OrderedKey), their top bits a bucket (2^-6 of a
// binade), each bucket's count of the flips below it in a table; from it kCodeWalk branch-free
// steps over the flips in the bucket (building the table checks there are no more), and NaN to
// the code's 0. The same result as NearestCode for every float; tests/test_state_int8_code.py checks it
// against NumPy, ties included, and tests/gpu against the CUDA kernels' NearestCode.
struct CodeIndex {
  const float* code;
  const float* flips;    // 255 flip points, then a NaN (a walk's compare past the last is false)
  const int32_t* start;  // per bucket: the count of flips below its smallest float
  // The flips as an implicit binary search tree, level by level: level L's 2^L nodes from
  // 2^L - 1, node p of level L flip (2 p + 1) 2^(7 - L) - 1. Descending it, each level's compare
  // (node <= y) is the next bit of the count of flips <= y (cpu_state_tiles.inc's AVX-512 tiles).
  const float* tree;
  int zero;
  uint32_t base;  // OrderedKey(-1.0f)
  int32_t buckets;
};
constexpr int kCodeKeyShift = 17;
constexpr int kCodeWalk = 2;
inline uint32_t OrderedKey(float y) {
  uint32_t u;
  __builtin_memcpy(&u, &y, sizeof(u));
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
const CodeIndex& DynamicCodeIndex(bool is_signed);
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

// x[0..n) into q[0..n) and absmax[0..ceil(n / block)), per the definition above.
void QuantizeBlockwise(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q, float* absmax);
// q and absmax back into out[0..n).
void DequantizeBlockwise(const uint8_t* q, const float* absmax, int64_t n, int64_t block, bool is_signed,
                         float* out);

}  // namespace tfclip
