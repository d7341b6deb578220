// tfclip XLA glue: the typed FFI read through its C API alone (xla/ffi/api/c_api.h). A call
// frame's buffers and attributes, the handler's status, the context's stream, scratch allocator
// and thread pool, and handler registration.
//
// Why not XLA's C++ layer (xla/ffi/api/ffi.h): TF ships it only from 2.20 on, and it must match
// its c_api.h exactly. c_api.h is the stable contract, and every TF from 2.17 ships it (API 0.0
// on 2.17, 0.1 on 2.18-2.20, 0.2 on 2.21 and JAX 0.10). This file compiles against any of them.
// Where an API lacks a call (2.18 has no XLA_FFI_ThreadPool_NumThreads), the code asks at compile
// time and says what it does instead. TF 2.16's XLA has no typed-FFI runtime: there the same
// frame is built on a legacy call (legacy_call.h). No TF header, no XLA C++ header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

// Whether this c_api.h has typed-FFI results and array attributes, which the handlers' typed
// entries need: from API 0.0 as TF 2.17 ships it on. TF 2.16's 0.0 has neither; the build
// (CMakeLists.txt) sets 0 there and the handlers get legacy entries alone (legacy_call.h).
#ifndef TFCLIP_XLA_TYPED_FFI
#define TFCLIP_XLA_TYPED_FFI 1
#endif

namespace tfclip {
namespace xla_glue {

// A handler's outcome: OK, or a code and a message that become an XLA_FFI_Error at the handler's
// boundary (RunHandler).
class FfiStatus {
 public:
  FfiStatus() = default;
  static FfiStatus Ok() { return FfiStatus(); }
  static FfiStatus Internal(std::string m) { return FfiStatus(XLA_FFI_Error_Code_INTERNAL, std::move(m)); }
  static FfiStatus InvalidArgument(std::string m) {
    return FfiStatus(XLA_FFI_Error_Code_INVALID_ARGUMENT, std::move(m));
  }
  bool ok() const { return code_ == XLA_FFI_Error_Code_OK; }
  XLA_FFI_Error_Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  FfiStatus(XLA_FFI_Error_Code c, std::string m) : code_(c), message_(std::move(m)) {}
  XLA_FFI_Error_Code code_ = XLA_FFI_Error_Code_OK;
  std::string message_;
};

// Returns a failed FfiStatus from the enclosing function.
#define TFCLIP_FFI_RETURN_IF_ERROR(expr)              \
  do {                                                \
    ::tfclip::xla_glue::FfiStatus _s = (expr);        \
    if (!_s.ok()) return _s;                          \
  } while (0)

// An operand or result buffer as XLA passes it.
struct FfiBuffer {
  XLA_FFI_DataType dtype = XLA_FFI_DataType_INVALID;
  void* data = nullptr;
  int64_t rank = 0;
  const int64_t* dims = nullptr;

  int64_t element_count() const {
    int64_t n = 1;
    for (int64_t d = 0; d < rank; ++d) n *= dims[d];
    return n;
  }
};

// A task for XLA:CPU's thread pool (XLA_FFI_Task, which API 0.0 lacks).
using FfiTask = void (*)(void* data);

class LegacyCall;  // legacy_call.h

// One call of a handler: what XLA passes, and what the call's context offers. Built on a typed-FFI
// call frame, or on a legacy call (TF 2.16: legacy_call.h), which has buffers and attributes but
// no context: no stream but its own (CUDA), no allocator, no thread pool.
class FfiFrame {
 public:
  explicit FfiFrame(XLA_FFI_CallFrame* f) : f_(f) {}
  explicit FfiFrame(const LegacyCall* l) : legacy_(l) {}

  size_t num_args() const;
  size_t num_rets() const;
  FfiStatus Arg(size_t i, FfiBuffer* out) const;
  FfiStatus Ret(size_t i, FfiBuffer* out) const;
  // Attributes: i64 scalars and i64 arrays (custom_calls.h); an internal error names a missing one.
  FfiStatus I64(const char* name, int64_t* out) const;
  FfiStatus I64s(const char* name, std::vector<int64_t>* out) const;

  // The platform stream (CUDA: the cudaStream_t XLA runs the call on).
  FfiStatus Stream(void** out) const;
  // Device memory from XLA's allocator for the call's duration; nullopt when XLA refuses.
  // HasAllocator: false where the API has none (0.0, TF 2.17).
  bool HasAllocator() const;
  std::optional<void*> Allocate(size_t bytes, size_t alignment) const;
  // XLA:CPU's thread pool: its size, 0 where there is none (TF 2.17's API 0.0, a legacy call),
  // or -1 where the API cannot say (TF 2.18's 0.1 has no XLA_FFI_ThreadPool_NumThreads); and a
  // task scheduled on it, false when there is no pool (the caller then runs the work itself).
  int64_t NumThreads() const;
  bool Schedule(FfiTask task, void* data) const;

 private:
  FfiStatus Attr(const char* name, XLA_FFI_AttrType type, void** out) const;
  void Drop(XLA_FFI_Error* e) const;  // destroys an error a context call returned
  XLA_FFI_CallFrame* f_ = nullptr;
  const LegacyCall* legacy_ = nullptr;
};

using FfiBody = FfiStatus (*)(const FfiFrame&);

#if TFCLIP_XLA_TYPED_FFI
// Every tfclip handler's body runs through this: it answers XLA's metadata query (the API version
// the handler was compiled against; XLA asks once at registration), refuses any stage but execute,
// and turns the body's status into XLA's error.
XLA_FFI_Error* RunHandler(XLA_FFI_CallFrame* f, FfiBody body);

// Registers an execute-stage handler with a runtime's registry: "" or what went wrong.
std::string RegisterHandler(const XLA_FFI_Api* api, const char* name, const char* platform,
                            XLA_FFI_Handler* handler);
#endif

}  // namespace xla_glue
}  // namespace tfclip

#if TFCLIP_XLA_TYPED_FFI
// Defines the C entry XLA calls for a handler body.
#define TFCLIP_FFI_HANDLER(sym, body) \
  XLA_FFI_Error* sym(XLA_FFI_CallFrame* f) { return ::tfclip::xla_glue::RunHandler(f, body); }

// A handler's C entry, exported by name (handlers.h): TF's registration takes its address, and the
// JAX harness's loader finds it in _jax_ffi by name.
#define TFCLIP_EXPORT_HANDLER(sym, body)                                                       \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* sym(XLA_FFI_CallFrame* f) { \
    return ::tfclip::xla_glue::RunHandler(f, body);                                            \
  }
#endif
