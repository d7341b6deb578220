// tfclip XLA glue: what the XLA kernels (xla_kernels.cc) and the custom-call handlers
// (ffi_handlers.cc) agree on: the targets' names and the order of their operands and results.
// No TF, XLA or CUDA header: both sides include it.
//
// Every call is a typed-FFI custom call (API_VERSION_TYPED_FFI) whose attributes are i64 scalars
// and i64 arrays in the backend config (an MLIR dictionary).
//
// tfclip_norm      operands: t[n], then one int64 index vector per sparse entry
//                  results:  norm f64[], norm Tnorm[], tensor_norms Tnorm[n]
//                  attrs:    sparse (positions), rows, widths (per sparse entry): the indices are
//                            checked here, before any apply call can write (an apply op that
//                            fails writes nothing; on CUDA there are none: the XLA kernel
//                            densifies IndexedSlices there); f64_norm: which norm result the
//                            CUDA handler writes (1: the f64 one, an apply op's; 0: the Tnorm one,
//                            the norm op's; the Host handler writes both)
// tfclip_clip      operands: t[n], clip_norm Tnorm[], use_norm Tnorm[]
//                  results:  clipped[n], norm Tnorm[], tensor_norms Tnorm[n]
//                  attrs:    use_given_norm
// tfclip_apply     one group of at most kGroupVars variables of an apply op
//                  operands: var[g], slot_0[g] .. slot_{s-1}[g], grad[g], indices (int64, one per
//                            sparse entry), scalars f64[h + 2], f64[h + 3] or f64[h + 6] (the
//                            rule's hyper-parameters in HP order, clip, use_norm; where the op
//                            has one grad_scale; where it has stochastic rounding, grad_scale
//                            (1 if none), seed, step and the call's first variable's position in
//                            the op: its length says), then iterations s64[] if has_iterations
//                  results:  var[g], slot_0[g] .. (each aliased to its operand: in place),
//                            applied pred[], norm f32[], tensor_norms f32[g], clipped_units
//                            s64[g] (AGC's count of clipped units per variable, 0 in the other
//                            modes), then the advanced counter s64[] if has_iterations
//                  attrs:    rule, flags (FlagBit mask), mode, policy, has_use_norm, lazy,
//                            sum_of_squares, nslots (the state lists), has_iterations, sparse
//                            (group positions)
//                  int8 state (a group whose slots are u8: every variable of it float32 with
//                  int8 state): the state lists are the rule's s slots' codes u8, then their
//                  absmax f32[ceil(size / 256)] in the same order, nslots = 2s, all aliased.
#pragma once

namespace tfclip {
namespace xla_glue {

inline constexpr char kNormTarget[] = "tfclip_norm";
inline constexpr char kClipTarget[] = "tfclip_clip";
inline constexpr char kApplyTarget[] = "tfclip_apply";

// Variables per apply call: one call with thousands of in-place results makes XLA:CPU's fusion
// pass take minutes (issue 33: 2,000 variables 40 s, 4,000 over 5 min); groups of 64 compile
// in seconds and cost one more small call per 64 variables.
inline constexpr int kGroupVars = 64;

}  // namespace xla_glue
}  // namespace tfclip
