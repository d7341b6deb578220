// tfclip core: stochastic rounding of bfloat16 variables (opt-in; the apply ops' `rounding`
// input, docs/low-precision-state.md "bfloat16 weights, stochastic rounding").
//
// Pure-bf16 training keeps no float32 master weights: an update smaller than half a bf16 ulp of
// its weight rounds away to nothing under round-to-nearest, every step, and training stalls.
// Rounded stochastically, x goes up to the next bf16 value with probability (x - lo) / (hi - lo)
// and down to lo otherwise, so the expected stored value is x: small updates survive on average.
//
// The random bits come from Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator: a keyed bijection of a
// 128-bit counter, no state. One draw gives 128 bits, 16 for each of 8 elements: elements
// 8q .. 8q + 7 of the step's tensor t (its position in the op's variable list) at step s share
// the draw of counter (q mod 2^32, q / 2^32, t, s mod 2^32) under key (seed mod 2^32, seed / 2^32),
// element i taking the 16-bit half i mod 8 of it (word (i mod 8) / 2, its low half for an even i).
// So the bits depend on (seed, step, tensor, element) alone: the same on the CPU, on CUDA and under
// XLA, for any thread count or chunking. tests/test_stochastic_rounding.py checks the generator
// against Random123's known-answer vectors and the rounding against a NumPy reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "csrc/core/hparams.h"  // (kMaxRoundingWord)
#include "csrc/core/types.h"

namespace tfclip {

struct Philox4 {
  uint32_t v[4];
};

// Philox4x32 with 10 rounds: the multipliers and Weyl key increments of the paper.
TFCLIP_HD Philox4 Philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {  // the key is bumped before every round but the first
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c.v[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}

// A step's key: off, or the seed's words, the step's low word and the tensor's position (set
// per tensor by the passes: WithTensor). `bits`: where a CPU pass drew a tile's bits ahead
// (FillRoundBits, 8 elements a draw), element i's at bits[i - bits_at]; else (null, and always on
// CUDA) each element draws its own (RoundBits).
struct RoundKey {
  bool on = false;
  uint32_t k0 = 0, k1 = 0, step = 0, tensor = 0;
  const uint16_t* bits = nullptr;
  int64_t bits_at = 0;
};

// A seed or step value as the integer it is (checked by RoundingError where the value is read
// on the host; a bad value read on the device is refused there too, so this never sees one).
TFCLIP_HD uint64_t RoundingWord(double v) {
  return v >= 0.0 && v <= kMaxRoundingWord ? static_cast<uint64_t>(v) : 0u;
}

// The key from the `rounding` input's values (off: round to nearest), and the position of the
// step's first tensor (0 but in an XLA call of a later group of the op's).
TFCLIP_HD RoundKey MakeRoundKey(bool on, double seed, double step, double first_tensor) {
  RoundKey k;
  if (!on) return k;
  const uint64_t s = RoundingWord(seed);
  k.on = true;
  k.k0 = static_cast<uint32_t>(s);
  k.k1 = static_cast<uint32_t>(s >> 32);
  k.step = static_cast<uint32_t>(RoundingWord(step));
  k.tensor = static_cast<uint32_t>(RoundingWord(first_tensor));
  return k;
}

// The draw of elements 8q .. 8q + 7.
TFCLIP_HD Philox4 RoundDraw(const RoundKey& k, uint64_t q) {
  return Philox4x32_10(Philox4{{static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), k.tensor, k.step}},
                       k.k0, k.k1);
}
// Element h (0..7) of a draw's 16-bit halves.
TFCLIP_HD uint32_t RoundHalf(const Philox4& d, int h) { return (d.v[h >> 1] >> (16 * (h & 1))) & 0xFFFFu; }

// The 16 random bits of element i.
TFCLIP_HD uint32_t RoundBits(const RoundKey& k, int64_t i) {
  const uint64_t u = static_cast<uint64_t>(i);
  return RoundHalf(RoundDraw(k, u >> 3), static_cast<int>(u & 7u));
}

// The bits of elements [b, b + n) into out[0, n): one draw per 8 elements (the host's passes,
// a tile at a time: a draw per element cost 2.5x the bf16 step on the CPU).
inline void FillRoundBits(const RoundKey& k, int64_t b, int64_t n, uint16_t* out) {
  if (n <= 0) return;
  const uint64_t first = static_cast<uint64_t>(b) >> 3, last = static_cast<uint64_t>(b + n - 1) >> 3;
  for (uint64_t q = first; q <= last; ++q) {
    const Philox4 d = RoundDraw(k, q);
    for (int h = 0; h < 8; ++h) {
      const int64_t j = static_cast<int64_t>(8 * q) + h - b;
      if (j >= 0 && j < n) out[j] = static_cast<uint16_t>(RoundHalf(d, h));
    }
  }
}

// x rounded to bfloat16 with the 16 random bits r: r added to x's low 16 bits carries into the
// kept half with probability (low bits) / 2^16, then the low half is dropped. On the magnitude
// bits, so a negative x rounds away from zero with that probability too; inf stays inf; a
// finite x above bf16's largest finite value may carry to inf, as its distance says. NaN is
// rounded as Elem<bfloat16>::Store rounds it (quiet, sign kept).
// Branch-free (both computed, one selected, as FloatToBFloat16), so a CPU loop of it vectorizes.
TFCLIP_HD bfloat16 StochasticRoundBf16(float x, uint32_t r) {
  const uint32_t u = FloatBits(x);
  const uint32_t nan = (u >> 16) | 0x40u;  // NaN kept quiet, as FloatToBFloat16
  const uint32_t up = (u + r) >> 16;
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);
  return bfloat16{static_cast<uint16_t>((nan & is_nan) | (up & ~is_nan))};
}

// What the passes store into variable element i (its position in its tensor) of storage type V
// from its new value v: a bfloat16 variable under an on key rounds stochastically; everything
// else as Elem<V>::Store.
template <typename V, typename M>
TFCLIP_HD V StoreVar(const RoundKey& k, M v, int64_t i) {
  if constexpr (std::is_same<V, bfloat16>::value) {
    if (k.on) return StochasticRoundBf16(v, k.bits != nullptr ? k.bits[i - k.bits_at] : RoundBits(k, i));
  }
  return Elem<V>::Store(v);
}

}  // namespace tfclip
