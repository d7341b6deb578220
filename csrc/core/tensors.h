// tfclip core: what every adapter hands the core: raw tensors (pointers, sizes, dtypes). No TF,
// CUDA or pybind11 header.
#pragma once

#include <cstdint>

#include "csrc/core/rules.h"
#include "csrc/core/types.h"

namespace tfclip {

struct TensorView {
  void* data = nullptr;
  int64_t size = 0;  // elements
  DType dtype = DType::kFloat;
};

// How a variable's slots are stored: in the variable's dtype (the stock layout), or as bfloat16
// for a float32 variable (state_dtype="bfloat16": half the optimizer-state bytes; each slot is
// loaded to float, updated in float as in the stock layout, and rounded to nearest even when
// stored), or 8-bit blockwise for a float32 variable (state_dtype="int8", csrc/core/quant8.h: a
// uint8 per element, its index into the signed code, or into the unsigned one for a slot the
// rule keeps >= 0 (Rule::kUnsignedSlots), and one float32 absmax per kQuantBlock elements; each
// block is dequantized to float, updated in float as in the stock layout, and quantized again).
enum class SlotStorage : int { kVariable = 0, kBFloat16 = 1, kInt8 = 2 };

// Whether slots of dtype `slot` may serve a variable of dtype `var`, and how they are stored.
inline bool SlotStorageOf(DType var, DType slot, SlotStorage* out) {
  if (slot == var) {
    *out = SlotStorage::kVariable;
    return true;
  }
  if (var == DType::kFloat && slot == DType::kBFloat16) {
    *out = SlotStorage::kBFloat16;
    return true;
  }
  return false;
}

struct ApplyTensor {
  void* var = nullptr;
  const void* grad = nullptr;
  void* slots[kMaxSlots] = {nullptr, nullptr, nullptr};
  int64_t size = 0;  // elements of the variable (and of a dense gradient)
  DType var_dtype = DType::kFloat;
  DType grad_dtype = DType::kFloat;
  SlotStorage slot_storage = SlotStorage::kVariable;  // every slot of the variable alike
  DType slot_dtype() const { return slot_storage == SlotStorage::kBFloat16 ? DType::kBFloat16 : var_dtype; }
  // kInt8: slot k's absmax, ceil(size / kQuantBlock) floats, updated in place with the codes.
  float* absmax[kMaxSlots] = {nullptr, nullptr, nullptr};
  // An IndexedSlices gradient: `grad` holds nnz slices of `width` elements, slice j for row
  // indices[j] of the variable seen as a rows x width matrix. Indices are in host memory.
  bool sparse = false;
  const int64_t* indices = nullptr;
  int64_t nnz = 0;
  int64_t rows = 0;
  int64_t width = 0;
  // AGC's units (clip mode kAgc, clip.h): var.shape[-1] for a variable of rank >= 2, else 1 (the
  // whole tensor one unit); element i of the variable is in unit i % units. Set by every adapter
  // from the variable's shape; 0 (not given) is an error for an AGC step.
  int64_t units = 0;
  // A factored rule's (Adafactor; csrc/core/factored.h) view of the variable: the last two axes
  // M = shape[-2], N = shape[-1] of a variable of rank >= 2 (0, 0 below rank 2: not factored),
  // and whether its full-size v slot is kept (the stock layout) or is a scalar placeholder
  // (factored_state). Set by every adapter from the shapes it checked (FactoredSlotShape).
  int64_t fac_rows = 0, fac_cols = 0;
  bool fac_full_v = true;
  int64_t grad_size() const { return sparse ? nnz * width : size; }
};

}  // namespace tfclip
