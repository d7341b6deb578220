// tfclip stand-in for llvm/ADT/ArrayRef.h, for TF 2.19's headers only (csrc/xla/tf/compat/README.md):
// a read-only view, a pointer and a length as LLVM's.
#pragma once

#include <cstddef>

namespace llvm {

template <typename T>
class ArrayRef {
 public:
  ArrayRef() = default;
  ArrayRef(const T* data, size_t length) : data_(data), length_(length) {}
  template <typename C>
  ArrayRef(const C& c) : data_(c.data()), length_(c.size()) {}  // NOLINT: implicit, as LLVM's
  const T* data() const { return data_; }
  size_t size() const { return length_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + length_; }

 private:
  const T* data_ = nullptr;
  size_t length_ = 0;
};

}  // namespace llvm
