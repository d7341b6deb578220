// tfclip TF glue: the apply ops' common attributes read into ApplyOpAttrs, one loop over the
// description's rows (csrc/core/apply_op.h), with the rule's flags from the rule table. The TF
// kernel (apply_kernel.cc) and the XLA kernel (csrc/xla/tf/kernels.cc) both call it: an
// XlaOpKernel is constructed from the same tf::OpKernelConstruction.
#pragma once

#include "csrc/core/apply_op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tfclip {

// Reads every kApplyAttrs row of the op (`ref_op`: TfclipClipApplyRef<Op>), then `rule`'s flags
// into out->flags, and checks them (ApplyOpAttrs::Check): an InvalidArgument error names the
// attr.
absl::Status ReadApplyOpAttrs(::tensorflow::OpKernelConstruction* c, const RuleInfo& rule,
                              bool ref_op, ApplyOpAttrs* out);

}  // namespace tfclip
