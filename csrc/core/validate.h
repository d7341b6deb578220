// tfclip core: validation shared by the adapters (the TF ops and _core). Each returns "" when
// fine, else a message naming the culprit. Shapes are the adapters' business (the core only
// sees sizes). The checks themselves are TFCLIP_HD (hparams.h, clip.h), so the CUDA finalize
// kernel applies the same ones to values it reads from device memory.
#pragma once

#include <string>

#include "csrc/core/clip.h"
#include "csrc/core/rule_table.h"

namespace tfclip {

// The clip op's clip_norm (tf.clip_by_global_norm): finite and > 0.
std::string ValidateClipNorm(double clip_norm, const char* what);
std::string ValidateClipConfig(const ClipConfig& cfg);
// The hyper-parameters `rule` takes (its row of the rule table), each in its range.
std::string ValidateHParams(RuleKind rule, const HParams& hp);
// The message for hyper-parameter `k` with value v (k from FirstBadHParam).
std::string HParamError(int k, double v);
// The message for RoundingError's `bad` (1: the seed, 2: the step) with value v; "" for 0.
std::string RoundingMessage(int bad, double value);
// Stochastic rounding's seed and step (RoundingError): "" or the message.
std::string ValidateRounding(const HParams& hp);

}  // namespace tfclip
