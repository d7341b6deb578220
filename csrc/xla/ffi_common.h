// tfclip XLA glue: decoding shared by the Host and CUDA custom-call handlers (typed FFI headers
// only; no TF header).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "csrc/core/cpu_driver.h"
#include "csrc/core/tensors.h"
#include "xla/ffi/api/ffi.h"

// Returns an FFI error from the enclosing function.
#define TFCLIP_FFI_RETURN_IF_ERROR(expr)  \
  do {                                    \
    ::xla::ffi::Error _e = (expr);        \
    if (_e.failure()) return _e;          \
  } while (0)

// A handler exported under a C name, for a module that joins no registry (TFCLIP_XLA_STANDALONE:
// _jax_ffi, whose loader registers the handlers with its own runtime).
#define TFCLIP_EXPORT_HANDLER(sym, handler)                                                    \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* sym(XLA_FFI_CallFrame* f) { \
    return handler(f);                                                                         \
  }

namespace tfclip {
namespace xla_glue {

bool ToCoreDType(::xla::ffi::DataType t, DType* out);
// The same, an internal error for another dtype (an output XLA was told to make float).
::xla::ffi::Error ToCoreDTypeOr(::xla::ffi::DataType t, DType* out);
::xla::ffi::Error ViewBuffer(const ::xla::ffi::AnyBuffer& b, const char* what, int i, TensorView* out);
::xla::ffi::Error GetI64(const ::xla::ffi::Dictionary& attrs, const char* name, int64_t* out);
::xla::ffi::Error GetI64s(const ::xla::ffi::Dictionary& attrs, const char* name,
                          std::vector<int64_t>* out);

// Operands (results) [first, first + n) of a call as tensor views; an error names `what`[i].
::xla::ffi::Error ViewArgs(const ::xla::ffi::RemainingArgs& args, size_t first, int n, const char* what,
                           TensorView* out);
::xla::ffi::Error ViewRets(const ::xla::ffi::RemainingRets& rets, size_t first, int n, const char* what,
                           TensorView* out);

// One tfclip_clip call, decoded (custom_calls.h): n tensors in and out, then the clip_norm and
// use_norm operands and the norm and tensor_norms results. The Host and CUDA handlers differ only
// in where they read the scalars.
struct ClipCall {
  int n = 0;
  bool given = false;  // use_given_norm: no norm pass
  std::vector<TensorView> in, out;
  std::optional<::xla::ffi::AnyBuffer> clip_norm, use_norm, norm, tensor_norms;

  ::xla::ffi::Error Decode(const ::xla::ffi::RemainingArgs& args,
                           const ::xla::ffi::RemainingRets& rets,
                           const ::xla::ffi::Dictionary& attrs);
};

// A host scalar buffer (f32 or f64) as double.
double ReadScalar(const ::xla::ffi::AnyBuffer& b);
// Norms (fp64) rounded to a host buffer of f32 or f64, subnormals kept (RoundNorm).
void WriteNorms(const double* norms, int n, void* out, ::xla::ffi::DataType dtype);

// One tfclip_apply call, decoded (custom_calls.h has the operand and result order).
struct ApplyCall {
  int n = 0;       // variables in this group
  int nslots = 0;  // slot lists the step uses
  bool has_iterations = false;
  std::vector<int64_t> sparse;  // group positions of the IndexedSlices gradients
  uint32_t hmask = 0;           // the rule's hyper-parameters (HPBit mask)
  StepArgs step;                // rule, flags, clip mode, policy, lazy (no tensors, no scalars)
  const void* scalars = nullptr;  // f64[popcount(hmask) + 2]: hyper-parameters, clip, use_norm
  const void* iterations_in = nullptr;
  void* applied_out = nullptr;       // pred[]
  void* norm_out = nullptr;          // f32[]
  void* tensor_norms_out = nullptr;  // f32[n]
  void* clipped_out = nullptr;       // s64[n]: AGC's clipped units per variable
  void* iterations_out = nullptr;    // s64[]

  ::xla::ffi::Error Decode(const ::xla::ffi::RemainingArgs& args,
                           const ::xla::ffi::RemainingRets& rets,
                           const ::xla::ffi::Dictionary& attrs);
  // The group's tensors: vars and slots are the (aliased) result buffers, updated in place.
  // Sparse gradients need host indices (the CPU handler only).
  ::xla::ffi::Error Tensors(const ::xla::ffi::RemainingArgs& args,
                            const ::xla::ffi::RemainingRets& rets, ApplyTensor* ts) const;
  // Hyper-parameters, clip and use_norm from the host scalars buffer into a->hp, a->cfg.
  ::xla::ffi::Error ReadHostScalars(const ::xla::ffi::RemainingArgs& args, StepArgs* a) const;
  // Index of the first scalar operand.
  size_t ScalarsArg() const { return static_cast<size_t>((nslots + 2) * n) + sparse.size(); }
  int NumHParams() const;
};

}  // namespace xla_glue
}  // namespace tfclip
