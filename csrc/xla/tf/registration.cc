// tfclip XLA glue: the custom-call handlers (handlers.h) joined to TF's XLA registry when the op
// library loads.
//
// TF's typed-FFI API is XLA_FFI_GetApi, the C API's entry, exported by libtensorflow_framework
// from TF 2.20 on. TF 2.18 and 2.19 export only the C++ function xla::ffi::GetXlaFfiApi() (in
// libtensorflow_cc), which returns the same table. Both are weak references here, so the library
// loads on every version and uses whichever the loaded TF has (measured 2026-11-27 with nm -D:
// 2.21 and 2.20 export both; 2.19, 2.18 and 2.17 only the C++ one). TF 2.16's XLA runs no typed-FFI
// call: the legacy entries join its custom-call target registry instead (legacy_call.h).
#include <cstdio>
#include <string>

#include "csrc/xla/ffi/custom_calls.h"
#include "csrc/xla/ffi/frame.h"
#include "csrc/xla/ffi/handlers.h"
#include "csrc/xla/ffi/legacy_call.h"
#if !TFCLIP_XLA_TYPED_FFI
#include "xla/service/custom_call_status_internal.h"
#include "xla/service/custom_call_target_registry.h"
#endif

#pragma weak XLA_FFI_GetApi
namespace xla {
namespace ffi {
const XLA_FFI_Api* GetXlaFfiApi() __attribute__((weak));
}  // namespace ffi
}  // namespace xla

namespace tfclip {
namespace xla_glue {
namespace {

#if TFCLIP_XLA_TYPED_FFI
const XLA_FFI_Api* TfFfiApi() {
  if (&XLA_FFI_GetApi != nullptr) return XLA_FFI_GetApi();
  if (&::xla::ffi::GetXlaFfiApi != nullptr) return ::xla::ffi::GetXlaFfiApi();
  return nullptr;
}

bool RegisterAll() {
  struct Entry {
    const char* target;
    const char* platform;
    XLA_FFI_Handler* handler;
  };
  static const Entry kEntries[] = {
      {kNormTarget, "Host", tfclip_norm_host},
      {kClipTarget, "Host", tfclip_clip_host},
      {kApplyTarget, "Host", tfclip_apply_host},
#if TFCLIP_WITH_CUDA
      {kNormTarget, "CUDA", tfclip_norm_cuda},
      {kClipTarget, "CUDA", tfclip_clip_cuda},
      {kApplyTarget, "CUDA", tfclip_apply_cuda},
#endif
  };
  const XLA_FFI_Api* api = TfFfiApi();
  if (api == nullptr) {
    std::fprintf(stderr, "tfclip: this TensorFlow exports no typed-FFI API (XLA_FFI_GetApi); "
                         "tfclip's ops cannot run under jit_compile=True\n");
    return false;
  }
  bool ok = true;
  for (const Entry& e : kEntries) {
    const std::string err = RegisterHandler(api, e.target, e.platform, e.handler);
    if (!err.empty()) {
      std::fprintf(stderr, "tfclip: could not register the XLA custom call %s on %s: %s\n", e.target,
                   e.platform, err.c_str());
      ok = false;
    }
  }
  return ok;
}

#else
// TF 2.16: XLA's custom-call target registry (legacy_call.h); its Register cannot fail.
bool RegisterAll() {
  auto* r = ::xla::CustomCallTargetRegistry::Global();
  r->Register(kNormTarget, reinterpret_cast<void*>(&tfclip_norm_host_legacy), "Host");
  r->Register(kClipTarget, reinterpret_cast<void*>(&tfclip_clip_host_legacy), "Host");
  r->Register(kApplyTarget, reinterpret_cast<void*>(&tfclip_apply_host_legacy), "Host");
#if TFCLIP_WITH_CUDA
  r->Register(kNormTarget, reinterpret_cast<void*>(&tfclip_norm_cuda_legacy), "CUDA");
  r->Register(kClipTarget, reinterpret_cast<void*>(&tfclip_clip_cuda_legacy), "CUDA");
  r->Register(kApplyTarget, reinterpret_cast<void*>(&tfclip_apply_cuda_legacy), "CUDA");
#endif
  return true;
}
#endif

const bool kRegistered = RegisterAll();

}  // namespace

#if !TFCLIP_XLA_TYPED_FFI
// What XLA's XlaCustomCallStatusSetFailure does (TF 2.16 exports no such symbol): a message present
// means failure. XLA then fails the executable's run with "CustomCall failed: <message>".
void SetLegacyFailure(XlaCustomCallStatus_* status, const std::string& message) {
  status->message = message;
}
#endif

}  // namespace xla_glue
}  // namespace tfclip

// Whether every handler joined TF's registry (tfclip/_loader.py: without them the XLA kernels
// would compile calls nothing can run, so the front doors take the stock fallback instead).
extern "C" __attribute__((visibility("default"))) int tfclip_xla_handlers_registered() {
  return tfclip::xla_glue::kRegistered ? 1 : 0;
}
