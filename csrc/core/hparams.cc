// tfclip core: the hyper-parameter table's host-side lookups (hparams.h).
#include "csrc/core/hparams.h"

namespace tfclip {

const char* FlagAttr(Flag f) {
  switch (f) {
#define TFCLIP_FLAG_ATTR(f, attr) \
  case Flag::f:                   \
    return attr;
    TFCLIP_FOR_EACH_FLAG(TFCLIP_FLAG_ATTR)
#undef TFCLIP_FLAG_ATTR
  }
  return "";
}

}  // namespace tfclip
