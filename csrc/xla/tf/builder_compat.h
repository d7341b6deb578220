// tfclip XLA glue: the XLA builder's headers, wherever this TF keeps them. TF 2.19 on ships them
// under xla/hlo/builder/; TF 2.18 and older under xla/client/ (the same API for what tfclip uses:
// CustomCall with API_VERSION_TYPED_FFI, OptimizationBarrier, Scatter, the lib helpers).
#pragma once

#if __has_include("xla/hlo/builder/xla_builder.h")
#include "xla/hlo/builder/lib/arithmetic.h"
#include "xla/hlo/builder/lib/constants.h"
#include "xla/hlo/builder/xla_builder.h"
#else
#include "xla/client/lib/arithmetic.h"
#include "xla/client/lib/constants.h"
#include "xla/client/xla_builder.h"
#endif
