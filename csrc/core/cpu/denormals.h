// tfclip core: keeping subnormal numbers while TF's flush-to-zero mode is on.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define TFCLIP_HAVE_MXCSR 1
#endif

namespace tfclip {

// TF runs kernels with flush-to-zero and denormals-are-zero set; the norm pass must still see
// subnormal gradients (their norm is small, not zero), so it clears both for its duration.
class ScopedKeepDenormals {
 public:
#if TFCLIP_HAVE_MXCSR
  ScopedKeepDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFtzDaz); }
  ~ScopedKeepDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bits 15 (FTZ) and 6 (DAZ)
  unsigned saved_;
#endif
};

}  // namespace tfclip
