// tfclip core: dtype names and sizes from the one dtype list (types.h).
#include "csrc/core/types.h"

namespace tfclip {

const char* DTypeName(DType t) {
  switch (t) {
#define TFCLIP_NAME_CASE(E, S, M, N) \
  case DType::E:                     \
    return N;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_NAME_CASE)
#undef TFCLIP_NAME_CASE
  }
  return "unknown";
}

int DTypeSize(DType t) {
  switch (t) {
#define TFCLIP_SIZE_CASE(E, S, M, N) \
  case DType::E:                     \
    return static_cast<int>(sizeof(S));
    TFCLIP_FOR_EACH_TYPE(TFCLIP_SIZE_CASE)
#undef TFCLIP_SIZE_CASE
  }
  return 0;
}

}  // namespace tfclip
