// tfclip XLA glue: the custom-call handlers' C entries, and who registers them.
//
// Three targets (custom_calls.h), each with a Host handler (ffi_handlers.cc: the CPU driver on
// XLA:CPU's thread pool) and, in a CUDA build, a CUDA one (cuda_handlers.cc: the CUDA driver on
// XLA's stream). All six are plain C symbols over the typed FFI's C API (ffi_frame.h), so one
// build of them serves two registries:
//   - TF's XLA: tf_registration.cc registers them when the op library loads;
//   - JAX's (tests/xla_jax/tfclip_jax.py): the test harness's _jax_ffi module exports them and
//     its loader registers them with jax.ffi, so they run under a real XLA runtime without TF.
// TF 2.16's XLA has no typed-FFI runtime: there the six are legacy entries over the same bodies
// (legacy_call.h), registered in XLA's custom-call target registry.
#pragma once

#include "xla/ffi/api/c_api.h"

#include "csrc/xla/ffi/frame.h"

extern "C" {
#if TFCLIP_XLA_TYPED_FFI
XLA_FFI_Error* tfclip_norm_host(XLA_FFI_CallFrame* f);
XLA_FFI_Error* tfclip_clip_host(XLA_FFI_CallFrame* f);
XLA_FFI_Error* tfclip_apply_host(XLA_FFI_CallFrame* f);
XLA_FFI_Error* tfclip_norm_cuda(XLA_FFI_CallFrame* f);
XLA_FFI_Error* tfclip_clip_cuda(XLA_FFI_CallFrame* f);
XLA_FFI_Error* tfclip_apply_cuda(XLA_FFI_CallFrame* f);
#else
// TF 2.16 (legacy_call.h): the legacy custom-call API's entries, API_VERSION_STATUS_RETURNING_UNIFIED.
struct XlaCustomCallStatus_;
void tfclip_norm_host_legacy(void* out, const void** in, const char* opaque, size_t len, XlaCustomCallStatus_* s);
void tfclip_clip_host_legacy(void* out, const void** in, const char* opaque, size_t len, XlaCustomCallStatus_* s);
void tfclip_apply_host_legacy(void* out, const void** in, const char* opaque, size_t len, XlaCustomCallStatus_* s);
void tfclip_norm_cuda_legacy(void* stream, void** buffers, const char* opaque, size_t len, XlaCustomCallStatus_* s);
void tfclip_clip_cuda_legacy(void* stream, void** buffers, const char* opaque, size_t len, XlaCustomCallStatus_* s);
void tfclip_apply_cuda_legacy(void* stream, void** buffers, const char* opaque, size_t len, XlaCustomCallStatus_* s);
#endif
}
