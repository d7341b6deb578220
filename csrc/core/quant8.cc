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

// The formula's tables (quant8.h, Q8Bands), checked against the built code: every value of every
// band, its ends' neighbours and the ranks' ends (the process stops on a difference: the
// formula would then not be the code).
Q8Bands BuildBands(bool is_signed, const float* code, const float* flips) {
  static const double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  const int u = is_signed ? 0 : 1;
  const int zero = QuantZeroIndex(is_signed);
  Q8Bands q;
  for (int b = 0; b < 8; ++b) {
    const int e = b < 7 ? b : 6;
    const double s = kScale[e];
    const int k = 1 << (e + u);
    // (BuildCode's scale is std::pow(10.0, i - 6): the same doubles, checked by the values below)
    q.a[b] = s * (0.1 + 0.45 / k);
    q.b[b] = s * 0.9 / k;
    q.p[b] = static_cast<float>(k / (0.9 * s));
    q.r[b] = static_cast<float>(k / 9.0 + 0.5);
    q.base[b] = k - u;
    q.last[b] = k - 1;
    q.bound[b] = static_cast<float>(kScale[e] / 10.0);
    q.mu[b] = static_cast<float>(0.1 * s);
    q.nu[b] = static_cast<float>(s * 0.9 / k);
  }
  q.bound[0] = 0.0f;
  q.top[0] = is_signed ? kQuantCodeSize - 1 - zero : kQuantCodeSize - 1;
  q.top[1] = is_signed ? zero : 0;
  auto magnitude = [&](int rank) { return code[zero + rank]; };  // the positive side's
  for (int b = 0; b < 8; ++b) {
    q.below[b] = magnitude(q.base[b] - 1);
    q.above[b] = b < 6 ? magnitude(q.base[b] + q.last[b] + 1) : 1.0f;
    for (int j = -1; j <= q.last[b] + 1; ++j) {
      const int rank = q.base[b] + j;
      if (BandValue(q, b, j) != magnitude(rank)) std::abort();
      if (is_signed && rank <= q.top[1] && BandValue(q, b, j) != -code[zero - rank]) std::abort();
    }
  }
  if (magnitude(q.top[0]) != 1.0f || q.base[6] + q.last[6] + 1 != q.top[0]) std::abort();
  // The smallest magnitude of rank r + 1: a positive y's is flip zero + r; a negative y's is
  // above -flip(zero - r - 1) (a y at that flip keeps the index zero - r), so the next float.
  auto pos = [&](int r) { return r + zero < kQuantCodeSize - 1 ? flips[zero + r] : INFINITY; };
  auto neg = [&](int r) {
    return is_signed && r < q.top[1] ? std::nextafter(-flips[zero - r - 1], INFINITY) : INFINITY;
  };
  for (int b = 0; b < 8; ++b) {
    q.lo[0][b] = pos(q.base[b] - 1);
    q.lo[1][b] = neg(q.base[b] - 1);
    q.hi[0][b] = pos(q.base[b] + q.last[b]);
    q.hi[1][b] = neg(q.base[b] + q.last[b]);
  }
  return q;
}

CodeIndex BuildIndex(bool is_signed) {
  static std::vector<int32_t> tables[2];
  static std::vector<float> flip_tables[2];
  static std::vector<float> trees[2];
  static Q8Bands bands[2];
  std::vector<float>& flips = flip_tables[is_signed ? 1 : 0];
  CodeIndex ci;
  ci.code = DynamicCode(is_signed);
  ci.zero = QuantZeroIndex(is_signed);
  ci.is_signed = is_signed;
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
  std::vector<float>& tree = trees[is_signed ? 1 : 0];
  tree.assign(kQuantCodeSize, NAN);  // 255 nodes, then a pad
  for (int level = 0; level < 8; ++level) {
    for (int p = 0; p < (1 << level); ++p) tree[(1 << level) - 1 + p] = flips[(2 * p + 1) * (1 << (7 - level)) - 1];
  }
  ci.tree = tree.data();
  // NearestCodeIndexed's buckets
  std::vector<int32_t>& t = tables[is_signed ? 1 : 0];
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
  bands[is_signed ? 1 : 0] = BuildBands(is_signed, c, flips.data());
  ci.bands = &bands[is_signed ? 1 : 0];
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

int64_t Q8SweepCode(bool is_signed, int64_t stride, Q8NarrowFn narrow, bool formula, int64_t* bad, float* first_bad) {
  const CodeIndex& ci = DynamicCodeIndex(is_signed);
  const float* code = ci.code;
  *bad = 0;
  *first_bad = NAN;
  auto miss = [&](float y) {
    if (*bad == 0) *first_bad = y;
    ++*bad;
  };
  // At each flip and the float below it: the count of flips is the search's index.
  for (int k = 0; k + 1 < kQuantCodeSize; ++k) {
    const float f = ci.flips[k];
    if (NearestCode(code, f, ci.zero) != k + 1) miss(f);
    if (NearestCode(code, FromKey(OrderedKey(f) - 1), ci.zero) != k) miss(FromKey(OrderedKey(f) - 1));
  }
  constexpr int64_t kPer = kQuantBlock - 1;  // after each block's 1.0f
  const uint32_t first = OrderedKey(-1.0f), end = OrderedKey(1.0f);
  std::vector<float> in(kQuantBlock * 64);
  std::vector<uint8_t> q(in.size());
  std::vector<float> absmax(in.size() / kQuantBlock);
  int flip = 0;  // flips <= the current float
  int64_t checked = 0;
  uint64_t key = first;
  while (key <= end) {
    int64_t n = 0;  // fill whole blocks of 1.0f + kPer swept floats
    for (int64_t blk = 0; blk < static_cast<int64_t>(absmax.size()) && key <= end; ++blk) {
      in[n++] = 1.0f;
      for (int64_t j = 0; j < kPer && key <= end; ++j, key += static_cast<uint64_t>(stride)) {
        in[n++] = FromKey(static_cast<uint32_t>(key));
      }
    }
    narrow(in.data(), ci, q.data(), absmax.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      if (i % kQuantBlock == 0) continue;
      const float y = in[i];
      while (flip < kQuantCodeSize - 1 && ci.flips[flip] <= y) ++flip;
      const int want = flip;
      ++checked;
      if (q[i] != want || (formula && NearestCodeFormula(ci, y) != want)) miss(y);
      if (checked % 4099 == 0 && NearestCode(code, y, ci.zero) != want) miss(y);
    }
  }
  return checked;
}

}  // namespace tfclip
