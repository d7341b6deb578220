// tfclip core: element types shared by the CPU driver, the CUDA kernels, the TF glue and the
// pybind11 module. No TensorFlow, Eigen or CUDA header is included here: the core sees raw
// storage and converts with its own bit-exact half/bfloat16 routines, so the same code
// compiles for host and device.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define TFCLIP_HD __host__ __device__ __forceinline__
#else
#define TFCLIP_HD inline
#endif

namespace tfclip {

// The one dtype list. Op attrs, kernel registration, pybind dispatch and explicit
// instantiations are all driven from it, so the lists cannot drift apart.
//   X(enum name, storage type, math type, name as TF spells it in an attr)
#define TFCLIP_FOR_EACH_TYPE(X)           \
  X(kHalf, ::tfclip::half, float, "half") \
  X(kBFloat16, ::tfclip::bfloat16, float, "bfloat16") \
  X(kFloat, float, float, "float")        \
  X(kDouble, double, double, "double")

enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2, kDouble = 3 };

const char* DTypeName(DType t);
int DTypeSize(DType t);

// Storage-only 16-bit types: arithmetic always happens in the math type (float).
struct half {
  uint16_t bits;
};
struct bfloat16 {
  uint16_t bits;
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types");

TFCLIP_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TFCLIP_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE binary16 <-> float, round to nearest even, NaN and inf kept, subnormals exact.
TFCLIP_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal half: value = man * 2^-24, exactly representable in float.
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

TFCLIP_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN (keep NaN quiet and non-zero)
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): scale so the half ulp 2^-24 becomes 1.0 and let the
    // float adder round to nearest even for us.
    const float shifted = BitsFloat(a) + 0.5f;  // 0.5 = 2^-1: aligns bit 2^-24 to the ulp
    return static_cast<uint16_t>(sign | (FloatBits(shifted) - 0x3f000000u));
  }
  // Normal: rebias exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t r = a + 0xc8000fffu + odd;  // (-(127-15) << 23) + rounding bias
  return static_cast<uint16_t>(sign | (r >> 13));
}

TFCLIP_HD float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

TFCLIP_HD uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t odd = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + odd) >> 16);
}

// Load / store between storage and math type.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Math = float;
  static TFCLIP_HD float Load(float x) { return x; }
  static TFCLIP_HD float Store(float x) { return x; }
};
template <>
struct Elem<double> {
  using Math = double;
  static TFCLIP_HD double Load(double x) { return x; }
  static TFCLIP_HD double Store(double x) { return x; }
};
template <>
struct Elem<half> {
  using Math = float;
  static TFCLIP_HD float Load(half x) { return HalfToFloat(x.bits); }
  static TFCLIP_HD half Store(float x) { return half{FloatToHalf(x)}; }
};
template <>
struct Elem<bfloat16> {
  using Math = float;
  static TFCLIP_HD float Load(bfloat16 x) { return BFloat16ToFloat(x.bits); }
  static TFCLIP_HD bfloat16 Store(float x) { return bfloat16{FloatToBFloat16(x)}; }
};

// Rounds a math-type value to storage precision and back: TF computes the clip scale in the
// tensor's own dtype (`v * cast(scale, v.dtype)`), so we round the scale the same way.
template <typename T>
TFCLIP_HD typename Elem<T>::Math RoundTo(typename Elem<T>::Math x) {
  return Elem<T>::Load(Elem<T>::Store(x));
}

}  // namespace tfclip
