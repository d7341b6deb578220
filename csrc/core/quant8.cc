// tfclip core: the dynamic codes and the blockwise quantization of quant8.h, on the host.
#include "csrc/core/quant8.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace tfclip {
namespace {

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), in float64: per
// exponent i = 0..6, the midpoints of linspace(0.1, 1, k + 1) (k = 2^i signed, 2^(i+1) unsigned)
// times 10^(i - 6), and their negatives when signed; then 0 and 1. 2 * 127 + 2 = 256 values
// either way.
std::vector<float> BuildCode(bool is_signed) {
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const int k = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, i - 6);
    for (int j = 0; j < k; ++j) {
      const double a = 0.1 + 0.9 * j / k, b = 0.1 + 0.9 * (j + 1) / k;
      const double mean = (a + b) / 2.0;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  std::vector<float> code(data.size());
  for (size_t i = 0; i < data.size(); ++i) code[i] = static_cast<float>(data[i]);
  std::sort(code.begin(), code.end());
  return code;
}

}  // namespace

const float* DynamicCode(bool is_signed) {
  static const std::vector<float> kSigned = BuildCode(true);
  static const std::vector<float> kUnsigned = BuildCode(false);
  return is_signed ? kSigned.data() : kUnsigned.data();
}

namespace {
float FromKey(uint32_t key) {  // OrderedKey's inverse
  const uint32_t u = (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
  float y;
  std::memcpy(&y, &u, sizeof(y));
  return y;
}

CodeIndex BuildIndex(bool is_signed) {
  static std::vector<int32_t> tables[2];
  static std::vector<float> flip_tables[2];
  static std::vector<float> trees[2];
  std::vector<int32_t>& t = tables[is_signed ? 1 : 0];
  std::vector<float>& flips = flip_tables[is_signed ? 1 : 0];
  CodeIndex ci;
  ci.code = DynamicCode(is_signed);
  ci.zero = QuantZeroIndex(is_signed);
  const float* c = ci.code;
  // Flip k: the smallest float in (c[k], c[k+1]] where NearestCode's test picks k + 1 (it holds
  // at c[k+1], where the distance above is 0), by bisection over the ordered floats.
  flips.assign(kQuantCodeSize, NAN);
  for (int k = 0; k + 1 < kQuantCodeSize; ++k) {
    uint32_t lo = OrderedKey(c[k]) + 1, hi = OrderedKey(c[k + 1]);
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      const float y = FromKey(mid);
      if (c[k + 1] - y < y - c[k]) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    flips[k] = FromKey(lo);
  }
  ci.flips = flips.data();
  ci.base = OrderedKey(-1.0f);
  ci.buckets = static_cast<int32_t>((OrderedKey(1.0f) - ci.base) >> kCodeKeyShift) + 1;
  t.resize(static_cast<size_t>(ci.buckets) + 1);
  for (int32_t b = 0; b <= ci.buckets; ++b) {
    const uint32_t first = ci.base + (static_cast<uint32_t>(b) << kCodeKeyShift);
    int32_t below = 0;
    while (below < kQuantCodeSize - 1 && OrderedKey(flips[below]) < first) ++below;
    t[b] = below;
  }
  for (int32_t b = 0; b < ci.buckets; ++b) {
    if (t[b + 1] - t[b] > kCodeWalk) std::abort();  // NearestCodeIndexed's walk would stop short
  }
  ci.start = t.data();
  std::vector<float>& tree = trees[is_signed ? 1 : 0];
  tree.assign(kQuantCodeSize, NAN);  // 255 nodes, then a pad
  for (int level = 0; level < 8; ++level) {
    for (int p = 0; p < (1 << level); ++p) tree[(1 << level) - 1 + p] = flips[(2 * p + 1) * (1 << (7 - level)) - 1];
  }
  ci.tree = tree.data();
  return ci;
}
}  // namespace

const CodeIndex& DynamicCodeIndex(bool is_signed) {
  static const CodeIndex kSigned = BuildIndex(true);
  static const CodeIndex kUnsigned = BuildIndex(false);
  return is_signed ? kSigned : kUnsigned;
}

void QuantizeBlockwise(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q, float* absmax) {
  const CodeIndex& ci = DynamicCodeIndex(is_signed);
  for (int64_t b = 0, k = 0; b < n; b += block, ++k) {
    const int64_t e = std::min(n, b + block);
    const float m = BlockAbsmax(x + b, e - b);
    absmax[k] = m;
    for (int64_t i = b; i < e; ++i) q[i] = QuantizeOneIndexed(ci, x[i], m);
  }
}

void DequantizeBlockwise(const uint8_t* q, const float* absmax, int64_t n, int64_t block, bool is_signed,
                         float* out) {
  const float* code = DynamicCode(is_signed);
  for (int64_t i = 0; i < n; ++i) out[i] = code[q[i]] * absmax[i / block];
}

}  // namespace tfclip
