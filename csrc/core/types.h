// tfclip core: element types shared by the CPU driver, the CUDA kernels, the TF glue and the
// pybind11 module. No TensorFlow, Eigen or CUDA header is included here: the core sees raw
// storage and converts with its own bit-exact half/bfloat16 routines, so the same code
// compiles for host and device.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

// TFCLIP_CUDA_EMULATION: cuda/*.cu compiled by the host compiler against
// cuda/emulation/cuda_runtime.h (CI runs the CUDA kernels that way); it takes the CUDA branches.
#if defined(__CUDACC__) || defined(TFCLIP_CUDA_EMULATION)
#define TFCLIP_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined on the host too: the CPU passes are compiled once per instruction set
// (cpu_kernels.h), and each must carry its own inlined copy of every per-element body. A
// shared out-of-line copy cannot be inlined across targets and costs a call per element.
#define TFCLIP_HD inline __attribute__((always_inline))
#else
#define TFCLIP_HD inline
#endif

namespace tfclip {

// The one dtype list. Op attrs, TF dtype mapping, dispatch (host and device) and _core's NumPy
// and __cuda_array_interface__ dtypes are all driven from it, so the lists cannot drift apart.
//   X(enum name, storage type, math type, name as TF spells it in an attr, NumPy dtype name,
//     __cuda_array_interface__ type codes)
// bfloat16's codes are 16-bit integer views: no CUDA array library exports a bfloat16 typestr
// (CuPy has no bfloat16 dtype, PyTorch refuses to export one), so callers pass a uint16 or
// int16 view of bfloat16 data, and _core reads those codes as bfloat16.
#define TFCLIP_FOR_EACH_TYPE(X)                                      \
  X(kHalf, ::tfclip::half, float, "half", "float16", "f2")           \
  X(kBFloat16, ::tfclip::bfloat16, float, "bfloat16", "bfloat16", "u2,i2") \
  X(kFloat, float, float, "float", "float32", "f4")                  \
  X(kDouble, double, double, "double", "float64", "f8")

enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2, kDouble = 3 };

const char* DTypeName(DType t);
int DTypeSize(DType t);
// The dtype of a NumPy dtype name ("float32", ...), or of a __cuda_array_interface__ type code
// ("f4", ...; the typestr without its byte-order character). False if it is none of ours.
bool DTypeFromNumpyName(const char* name, DType* out);
bool DTypeFromTypeCode(const char* code, DType* out);
// What the dtype list accepts, for error messages: "float16, bfloat16, float32, float64".
const char* NumpyDTypeNames();

// Storage-only 16-bit types: arithmetic always happens in the math type (float).
struct half {
  uint16_t bits;
};
struct bfloat16 {
  uint16_t bits;
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types");

TFCLIP_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__) || defined(TFCLIP_CUDA_EMULATION)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TFCLIP_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(TFCLIP_CUDA_EMULATION)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE binary16 <-> float, round to nearest even, NaN and inf kept, subnormals exact.
// Branch-free (every case computed, one selected), so the CPU loops that convert 16-bit
// gradients vectorize; checked against the branchy reference on all 2^16 / 2^32 inputs.
TFCLIP_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + 0x38000000u;  // exponent rebiased by 127 - 15
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  // Subnormal half: value = man * 2^-24, exactly representable in float (no subnormal float
  // on the way, so flush-to-zero modes cannot touch it).
  const uint32_t sub = FloatBits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  // Masks rather than ?: so compilers emit no branch (and the CPU loops vectorize).
  const uint32_t is_special = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  const uint32_t is_normal = (0u - static_cast<uint32_t>(em >= 0x0400u)) & ~is_special;
  const uint32_t is_sub = ~(is_special | is_normal);
  return BitsFloat(sign | (infnan & is_special) | (normal & is_normal) | (sub & is_sub));
}

TFCLIP_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // inf or NaN (NaN kept quiet and non-zero).
  const uint32_t nan_inf = 0x7c00u | (0x200u & (0u - static_cast<uint32_t>(a > 0x7f800000u)));
  // Subnormal (or zero) result: adding 0.5 = 2^-1 aligns the half ulp 2^-24 with the float ulp,
  // so the float adder rounds to nearest even for us.
  const uint32_t sub = FloatBits(BitsFloat(a & 0x3fffffffu) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t is_special = 0u - static_cast<uint32_t>(a >= 0x7f800000u);
  const uint32_t is_inf = (0u - static_cast<uint32_t>(a >= 0x477ff000u)) & ~is_special;  // rounds to inf
  const uint32_t is_sub = (0u - static_cast<uint32_t>(a < 0x38800000u));
  const uint32_t is_normal = ~(is_special | is_inf | is_sub);
  const uint32_t r = (nan_inf & is_special) | (0x7c00u & is_inf) | (sub & is_sub) | (normal & is_normal);
  return static_cast<uint16_t>(sign | r);
}

TFCLIP_HD float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

TFCLIP_HD uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t nan = (u >> 16) | 0x40u;  // NaN kept quiet
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // nearest even
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
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

// Calls fn(StorageType{}) for a runtime dtype. Host and device.
template <typename Fn>
TFCLIP_HD void DispatchDType(DType t, Fn&& fn) {
  switch (t) {
#define TFCLIP_DISPATCH_CASE(E, S, M, N, ...) \
  case DType::E:                         \
    fn(S{});                             \
    break;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_DISPATCH_CASE)
#undef TFCLIP_DISPATCH_CASE
  }
}

// The dtype of a storage type, from the same list: kDTypeOf<float> is DType::kFloat.
template <typename T>
struct DTypeOf;
#define TFCLIP_DTYPE_OF(E, S, ...) \
  template <>                      \
  struct DTypeOf<S> {              \
    static constexpr DType value = DType::E; \
  };
TFCLIP_FOR_EACH_TYPE(TFCLIP_DTYPE_OF)
#undef TFCLIP_DTYPE_OF
template <typename T>
inline constexpr DType kDTypeOf = DTypeOf<T>::value;

// Rounds a math-type value to storage precision and back: TF computes the clip scale in the
// tensor's own dtype (`v * cast(scale, v.dtype)`), so we round the scale the same way.
template <typename T>
TFCLIP_HD typename Elem<T>::Math RoundTo(typename Elem<T>::Math x) {
  return Elem<T>::Load(Elem<T>::Store(x));
}

}  // namespace tfclip
