// tfclip stand-in for llvm/ADT/SmallVector.h, for TF 2.19's headers only
// (csrc/xla/tf/compat/README.md): declarations enough for a class member, with LLVM's layout on
// LP64 (begin pointer, 32-bit size and capacity, inline storage filling the object to 64 bytes by
// default). Never constructed by tfclip.
#pragma once

#include <cstddef>
#include <cstdint>

namespace llvm {

template <typename T>
constexpr unsigned SmallVectorDefaultInline() {
  constexpr size_t kHeader = sizeof(void*) + 2 * sizeof(uint32_t);
  constexpr size_t kFit = (64 - kHeader) / sizeof(T);
  return kFit == 0 ? 1u : static_cast<unsigned>(kFit);
}

template <typename T, unsigned N = SmallVectorDefaultInline<T>()>
class SmallVector {
 public:
  SmallVector() = default;
  const T* data() const { return static_cast<const T*>(begin_); }
  size_t size() const { return size_; }

 private:
  void* begin_ = inline_;
  uint32_t size_ = 0;
  uint32_t capacity_ = N;
  alignas(T) unsigned char inline_[N * sizeof(T)];
};

}  // namespace llvm
