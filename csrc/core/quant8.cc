// tfclip core: the dynamic codes and the blockwise quantization of quant8.h, on the host.
#include "csrc/core/quant8.h"

#include <algorithm>
#include <cmath>
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

int ZeroIndex(const float* code) {
  return static_cast<int>(std::find(code, code + kQuantCodeSize, 0.0f) - code);
}

void QuantizeBlockwise(const float* x, int64_t n, int64_t block, bool is_signed, uint8_t* q, float* absmax) {
  const float* code = DynamicCode(is_signed);
  const int zero = ZeroIndex(code);
  for (int64_t b = 0, k = 0; b < n; b += block, ++k) {
    const int64_t e = std::min(n, b + block);
    float m = 0.0f;
    for (int64_t i = b; i < e; ++i) m = AbsmaxAdd(m, x[i]);
    m = AbsmaxOf(m);
    absmax[k] = m;
    for (int64_t i = b; i < e; ++i) q[i] = QuantizeOne(code, zero, x[i], m);
  }
}

void DequantizeBlockwise(const uint8_t* q, const float* absmax, int64_t n, int64_t block, bool is_signed,
                         float* out) {
  const float* code = DynamicCode(is_signed);
  for (int64_t i = 0; i < n; ++i) out[i] = code[q[i]] * absmax[i / block];
}

}  // namespace tfclip
