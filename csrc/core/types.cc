// tfclip core: dtype names and sizes from the one dtype list (types.h).
#include "csrc/core/types.h"

#include <string>

namespace tfclip {

const char* DTypeName(DType t) {
  switch (t) {
#define TFCLIP_NAME_CASE(E, S, M, N, ...) \
  case DType::E:                     \
    return N;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_NAME_CASE)
#undef TFCLIP_NAME_CASE
  }
  return "unknown";
}

int DTypeSize(DType t) {
  switch (t) {
#define TFCLIP_SIZE_CASE(E, S, M, N, ...) \
  case DType::E:                     \
    return static_cast<int>(sizeof(S));
    TFCLIP_FOR_EACH_TYPE(TFCLIP_SIZE_CASE)
#undef TFCLIP_SIZE_CASE
  }
  return 0;
}

bool DTypeFromNumpyName(const char* name, DType* out) {
#define TFCLIP_NP_CASE(E, S, M, N, NP, TC) \
  if (std::string(name) == NP) {           \
    *out = DType::E;                       \
    return true;                           \
  }
  TFCLIP_FOR_EACH_TYPE(TFCLIP_NP_CASE)
#undef TFCLIP_NP_CASE
  return false;
}

bool DTypeFromTypeCode(const char* code, DType* out) {
  const std::string c(code);
#define TFCLIP_TC_CASE(E, S, M, N, NP, TC)                                  \
  {                                                                         \
    const std::string codes = std::string(",") + TC + ",";                  \
    if (!c.empty() && codes.find("," + c + ",") != std::string::npos) {     \
      *out = DType::E;                                                      \
      return true;                                                          \
    }                                                                       \
  }
  TFCLIP_FOR_EACH_TYPE(TFCLIP_TC_CASE)
#undef TFCLIP_TC_CASE
  return false;
}

const char* NumpyDTypeNames() {
  static const std::string names = [] {
    std::string s;
#define TFCLIP_NP_NAME(E, S, M, N, NP, TC) s += std::string(s.empty() ? "" : ", ") + NP;
    TFCLIP_FOR_EACH_TYPE(TFCLIP_NP_NAME)
#undef TFCLIP_NP_NAME
    return s;
  }();
  return names.c_str();
}

}  // namespace tfclip
