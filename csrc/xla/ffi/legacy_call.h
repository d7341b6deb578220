// tfclip XLA glue: the legacy custom-call API, for TF 2.16, whose XLA has no typed-FFI runtime
// ("Unknown custom-call API version enum value: 4 (API_VERSION_TYPED_FFI)", docs/xla.md).
//
// There a custom call (API_VERSION_STATUS_RETURNING_UNIFIED: the same entry signature on CPU as on
// GPU, the opaque string included, which plain STATUS_RETURNING lacks on CPU) gets raw buffer
// addresses and one opaque string, nothing else: no dtypes, no dims, no attributes, no thread
// pool, no scratch allocator.
// So the XLA kernel (xla_kernels.cc) writes into the opaque string what a typed-FFI call frame
// would carry: every operand's and result's dtype and dims, and the i64 attributes
// (EncodeLegacyCall); the legacy entry decodes it (LegacyCall) and runs the same handler body
// through an FfiFrame built on it. The handlers do not know which API called them.
//
// The string is text, one ';'-separated token each (readable in an HLO dump):
//   a<dtype>:<d0>,<d1>,...   an operand (dtype: XLA's PrimitiveType number; no dims: a scalar)
//   r<dtype>:<dims>          a result
//   i<name>=<v>              an i64 attribute
//   v<name>=<v0>,<v1>,...    an i64 array attribute (may be empty)
// No TF header: the XLA kernel and the handlers' entries both include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/xla/ffi/frame.h"

struct XlaCustomCallStatus_;  // XLA's (xla/service/custom_call_status.h)

namespace tfclip {
namespace xla_glue {

struct LegacyShape {
  int64_t dtype = 0;  // XLA_FFI_DataType (the same numbers as xla::PrimitiveType)
  std::vector<int64_t> dims;
};

struct LegacyAttr {
  std::string name;
  bool array = false;
  std::vector<int64_t> values;
};

std::string EncodeLegacyCall(const std::vector<LegacyShape>& args, const std::vector<LegacyShape>& rets,
                             const std::vector<LegacyAttr>& attrs);

// One legacy call: its opaque string decoded, then its buffers' addresses bound.
class LegacyCall {
 public:
  // "" or what is wrong with the string.
  std::string Decode(const char* opaque, size_t len);
  // args: the operands' addresses (num_args()); rets: the results' (num_rets()).
  void Bind(const void* const* args, void* const* rets);

  size_t num_args() const { return args_.size(); }
  size_t num_rets() const { return rets_.size(); }
  FfiStatus Arg(size_t i, FfiBuffer* out) const;
  FfiStatus Ret(size_t i, FfiBuffer* out) const;
  FfiStatus I64(const char* name, int64_t* out) const;
  FfiStatus I64s(const char* name, std::vector<int64_t>* out) const;

  void* stream = nullptr;  // CUDA: the call's stream

 private:
  const LegacyAttr* Find(const char* name, bool array) const;
  std::vector<LegacyShape> args_, rets_;
  std::vector<void*> arg_data_, ret_data_;
  std::vector<LegacyAttr> attrs_;
};

// The legacy entries' bodies. Host: `out` is the result tuple's table of buffer addresses, `in`
// the operands'. CUDA: `buffers` holds the operands' addresses, then the results'.
void RunLegacyHost(void* out, const void** in, const char* opaque, size_t len, XlaCustomCallStatus_* status,
                   FfiBody body);
void RunLegacyCuda(void* stream, void** buffers, const char* opaque, size_t len, XlaCustomCallStatus_* status,
                   FfiBody body);

// Writes a failure into XLA's status object (tf_registration.cc, which has XLA's header; XLA
// exports no function for it in TF 2.16's libraries).
void SetLegacyFailure(XlaCustomCallStatus_* status, const std::string& message);

}  // namespace xla_glue
}  // namespace tfclip

// Defines a legacy C entry for a handler body (handlers.h).
#define TFCLIP_EXPORT_LEGACY_HOST_HANDLER(sym, body)                                                   \
  extern "C" __attribute__((visibility("default"))) void sym(void* out, const void** in, const char* opaque, \
                                                             size_t len, XlaCustomCallStatus_* status) {     \
    ::tfclip::xla_glue::RunLegacyHost(out, in, opaque, len, status, body);                             \
  }
#define TFCLIP_EXPORT_LEGACY_CUDA_HANDLER(sym, body)                                                    \
  extern "C" __attribute__((visibility("default"))) void sym(void* stream, void** buffers,              \
                                                             const char* opaque, size_t len,            \
                                                             XlaCustomCallStatus_* status) {            \
    ::tfclip::xla_glue::RunLegacyCuda(stream, buffers, opaque, len, status, body);                      \
  }
