// tfclip XLA glue: decoding shared by the Host and CUDA custom-call handlers (the typed FFI's C
// API through ffi_frame.h; no TF header).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/cpu/driver.h"
#include "csrc/core/tensors.h"
#include "csrc/xla/ffi/frame.h"

namespace tfclip {
namespace xla_glue {

bool ToCoreDType(XLA_FFI_DataType t, DType* out);
// The same, an internal error for another dtype (an output XLA was told to make float).
FfiStatus ToCoreDTypeOr(XLA_FFI_DataType t, DType* out);
FfiStatus ViewBuffer(const FfiBuffer& b, const char* what, int i, TensorView* out);

// Operands (results) [first, first + n) of a call as tensor views; an error names `what`[i].
FfiStatus ViewArgs(const FfiFrame& f, size_t first, int n, const char* what, TensorView* out);
FfiStatus ViewRets(const FfiFrame& f, size_t first, int n, const char* what, TensorView* out);

// One tfclip_clip call, decoded (custom_calls.h): n tensors in and out, then the clip_norm and
// use_norm operands and the norm and tensor_norms results. The Host and CUDA handlers differ only
// in where they read the scalars.
struct ClipCall {
  int n = 0;
  bool given = false;  // use_given_norm: no norm pass
  std::vector<TensorView> in, out;
  FfiBuffer clip_norm, use_norm, norm, tensor_norms;

  FfiStatus Decode(const FfiFrame& f);
};

// A host scalar buffer (f32 or f64) as double.
double ReadScalar(const FfiBuffer& b);
// Norms (fp64) rounded to a host buffer of f32 or f64, subnormals kept (RoundNorm).
void WriteNorms(const double* norms, int n, void* out, XLA_FFI_DataType dtype);

// One tfclip_apply call, decoded (custom_calls.h has the operand and result order).
struct ApplyCall {
  int n = 0;       // variables in this group
  int nslots = 0;  // state lists: the slot lists the step uses (int8 state: then their absmax)
  bool has_iterations = false;
  std::vector<int64_t> sparse;  // group positions of the IndexedSlices gradients
  uint32_t hmask = 0;           // the rule's hyper-parameters (HPBit mask)
  StepArgs step;                // rule, flags, clip mode, policy, lazy (no tensors, no scalars)
  // f64[popcount(hmask) + 2 (+ 1)]: hyper-parameters, clip, use_norm (, grad_scale)
  const void* scalars = nullptr;
  bool has_grad_scale = false;  // the scalars end with grad_scale (ClipConfig::grad_scale)
  // ... then stochastic rounding's seed, step and this call's first tensor position (HParams)
  bool has_rounding = false;
  const void* iterations_in = nullptr;
  void* applied_out = nullptr;       // pred[]
  void* norm_out = nullptr;          // f32[]
  void* tensor_norms_out = nullptr;  // f32[n]
  void* clipped_out = nullptr;       // s64[n]: AGC's clipped units per variable
  void* iterations_out = nullptr;    // s64[]

  FfiStatus Decode(const FfiFrame& f);
  // The group's tensors: vars and slots are the (aliased) result buffers, updated in place.
  // Sparse gradients need host indices (the CPU handler only).
  FfiStatus Tensors(const FfiFrame& f, ApplyTensor* ts) const;
  // Variable i's int8 state (its slot 0 is u8): the first nslots / 2 state lists are the codes,
  // the others their absmax (custom_calls.h).
  FfiStatus Int8State(const FfiFrame& f, int i, ApplyTensor* t) const;
  // Hyper-parameters, clip, use_norm (and grad_scale) from the host scalars buffer into a->hp, a->cfg.
  void ReadHostScalars(StepArgs* a) const;
  // Index of the first scalar operand.
  size_t ScalarsArg() const { return static_cast<size_t>((nslots + 2) * n) + sparse.size(); }
  int NumHParams() const;
};

}  // namespace xla_glue
}  // namespace tfclip
