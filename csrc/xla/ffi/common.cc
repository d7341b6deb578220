// tfclip XLA glue: decoding shared by the Host and CUDA custom-call handlers (ffi_common.h).
#include "csrc/xla/ffi/common.h"

#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"

#include <cstring>

#include <string>
#include <vector>

#include "csrc/core/rule_table.h"

namespace tfclip {
namespace xla_glue {

bool ToCoreDType(XLA_FFI_DataType t, DType* out) {
  switch (t) {
    case XLA_FFI_DataType_F16: *out = DType::kHalf; return true;
    case XLA_FFI_DataType_BF16: *out = DType::kBFloat16; return true;
    case XLA_FFI_DataType_F32: *out = DType::kFloat; return true;
    case XLA_FFI_DataType_F64: *out = DType::kDouble; return true;
    default: return false;
  }
}

FfiStatus ToCoreDTypeOr(XLA_FFI_DataType t, DType* out) {
  return ToCoreDType(t, out) ? FfiStatus::Ok()
                             : FfiStatus::Internal("tfclip custom call: a buffer of an unexpected dtype");
}

FfiStatus ViewBuffer(const FfiBuffer& b, const char* what, int i, TensorView* out) {
  DType dt;
  if (!ToCoreDType(b.dtype, &dt)) {
    return FfiStatus::InvalidArgument(std::string(what) + "[" + std::to_string(i) +
                                      "] has an unsupported dtype");
  }
  *out = TensorView{b.data, b.element_count(), dt};
  return FfiStatus::Ok();
}

FfiStatus ViewArgs(const FfiFrame& f, size_t first, int n, const char* what, TensorView* out) {
  for (int i = 0; i < n; ++i) {
    FfiBuffer b;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(first + static_cast<size_t>(i), &b));
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(b, what, i, &out[i]));
  }
  return FfiStatus::Ok();
}

FfiStatus ViewRets(const FfiFrame& f, size_t first, int n, const char* what, TensorView* out) {
  for (int i = 0; i < n; ++i) {
    FfiBuffer b;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(first + static_cast<size_t>(i), &b));
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(b, what, i, &out[i]));
  }
  return FfiStatus::Ok();
}

FfiStatus ClipCall::Decode(const FfiFrame& f) {
  int64_t g = 0;
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("use_given_norm", &g));
  given = g != 0;
  if (f.num_args() < 2 || f.num_rets() != f.num_args()) {
    return FfiStatus::Internal("tfclip_clip: unexpected operand or result count");
  }
  n = static_cast<int>(f.num_args()) - 2;
  in.resize(static_cast<size_t>(n));
  out.resize(static_cast<size_t>(n));
  TFCLIP_FFI_RETURN_IF_ERROR(ViewArgs(f, 0, n, "t_list", in.data()));
  TFCLIP_FFI_RETURN_IF_ERROR(ViewRets(f, 0, n, "t_list", out.data()));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(n, &clip_norm));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(n + 1, &use_norm));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(n, &norm));
  TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(n + 1, &tensor_norms));
  return FfiStatus::Ok();
}

double ReadScalar(const FfiBuffer& b) {
  return b.dtype == XLA_FFI_DataType_F64 ? *static_cast<const double*>(b.data)
                                         : *static_cast<const float*>(b.data);
}

void WriteNorms(const double* norms, int n, void* out, XLA_FFI_DataType dtype) {
  for (int i = 0; i < n; ++i) {
    if (dtype == XLA_FFI_DataType_F64) static_cast<double*>(out)[i] = RoundNorm<double>(norms[i]);
    else static_cast<float*>(out)[i] = RoundNorm<float>(norms[i]);
  }
}

int ApplyCall::NumHParams() const {
  int h = 0;
  for (int k = 0; k < kNumHParams; ++k) h += (hmask >> k) & 1u;
  return h;
}

FfiStatus ApplyCall::Decode(const FfiFrame& f) {
  int64_t rule, flags, mode, policy, has_use_norm, lazy, sos, ns, iters;
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("rule", &rule));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("flags", &flags));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("mode", &mode));
  if (mode == static_cast<int64_t>(ClipMode::kAgc)) {  // (the other modes' calls need not carry it)
    int64_t eps_bits = 0;
    TFCLIP_FFI_RETURN_IF_ERROR(f.I64("agc_eps_bits", &eps_bits));
    std::memcpy(&step.cfg.agc_eps, &eps_bits, sizeof(double));
  }
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("policy", &policy));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("has_use_norm", &has_use_norm));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("lazy", &lazy));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("sum_of_squares", &sos));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("nslots", &ns));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64("has_iterations", &iters));
  TFCLIP_FFI_RETURN_IF_ERROR(f.I64s("sparse", &sparse));
  if (rule < 0 || rule >= static_cast<int64_t>(AllRules().size())) {
    return FfiStatus::Internal("tfclip_apply: unknown rule " + std::to_string(rule));
  }
  step.rule = static_cast<RuleKind>(rule);
  for (int k = 0; k < kNumFlags; ++k) step.hp.SetFlag(static_cast<Flag>(k), (flags >> k) & 1);
  step.hp.sum_of_squares = sos != 0;
  step.cfg.mode = static_cast<ClipMode>(mode);
  step.cfg.policy = static_cast<NonFinitePolicy>(policy);
  step.cfg.has_use_norm = has_use_norm != 0;
  step.lazy = lazy != 0;
  nslots = static_cast<int>(ns);
  has_iterations = iters != 0;
  hmask = RuleHParams(step.rule);
  // Operands: (nslots + 2) * n tensors, the sparse indices, the scalars, the counter.
  const size_t fixed = sparse.size() + 1 + (has_iterations ? 1 : 0);
  const size_t nargs = f.num_args();
  if (nargs < fixed || (nargs - fixed) % static_cast<size_t>(nslots + 2) != 0) {
    return FfiStatus::Internal("tfclip_apply: unexpected operand count " + std::to_string(nargs));
  }
  n = static_cast<int>((nargs - fixed) / static_cast<size_t>(nslots + 2));
  const size_t nrets = static_cast<size_t>((nslots + 1) * n) + 4 + (has_iterations ? 1 : 0);
  if (f.num_rets() != nrets) {
    return FfiStatus::Internal("tfclip_apply: unexpected result count " + std::to_string(f.num_rets()));
  }
  FfiBuffer sc;
  TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(ScalarsArg(), &sc));
  // (grad_scale, then stochastic rounding's seed, step and the call's first tensor position,
  // only where the op has them: calls without them keep their layout.)
  const int64_t h = static_cast<int64_t>(NumHParams());
  if (sc.dtype != XLA_FFI_DataType_F64 ||
      (sc.element_count() != h + 2 && sc.element_count() != h + 3 && sc.element_count() != h + 6)) {
    return FfiStatus::Internal("tfclip_apply: bad scalars operand");
  }
  scalars = sc.data;
  has_grad_scale = sc.element_count() >= h + 3;
  has_rounding = sc.element_count() == h + 6;
  const size_t r0 = static_cast<size_t>((nslots + 1) * n);
  void** outs[] = {&applied_out, &norm_out, &tensor_norms_out, &clipped_out, &iterations_out};
  for (size_t k = 0; k < 4 + (has_iterations ? 1u : 0u); ++k) {
    FfiBuffer r;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(r0 + k, &r));
    *outs[k] = r.data;
  }
  if (has_iterations) {
    FfiBuffer it;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(ScalarsArg() + 1, &it));
    iterations_in = it.data;
  }
  return FfiStatus::Ok();
}

FfiStatus ApplyCall::Tensors(const FfiFrame& f, ApplyTensor* ts) const {
  for (int i = 0; i < n; ++i) {
    FfiBuffer v, g;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>(i), &v));
    TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(static_cast<size_t>((nslots + 1) * n + i), &g));
    TensorView vv, gv;
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(v, "vars", i, &vv));
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(g, "grads", i, &gv));
    ApplyTensor& t = ts[i];
    t.var = vv.data;
    t.var_dtype = vv.dtype;
    t.size = vv.size;
    t.grad = gv.data;
    t.grad_dtype = gv.dtype;
    t.units = v.rank >= 2 ? v.dims[v.rank - 1] : 1;  // AGC's units (csrc/core/agc.h)
    const bool factored = RuleFactored(step.rule);
    if (factored) SetFactoredDims(std::vector<int64_t>(v.dims, v.dims + v.rank), &t);
    FfiBuffer s0;
    if (nslots > 0) TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>(n + i), &s0));
    if (nslots > 0 && s0.dtype == XLA_FFI_DataType_U8) {  // int8 state: codes, then their absmax
      TFCLIP_FFI_RETURN_IF_ERROR(Int8State(f, i, &t));
      continue;
    }
    for (int k = 0; k < nslots; ++k) {
      FfiBuffer s;
      TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>((k + 1) * n + i), &s));
      if (factored) {  // Adafactor's r, c, v (csrc/core/factored.h)
        bool placeholder = false;
        const std::string e = FactoredSlotShape(k, std::vector<int64_t>(v.dims, v.dims + v.rank),
                                                std::vector<int64_t>(s.dims, s.dims + s.rank), &placeholder);
        if (!e.empty()) {
          return FfiStatus::InvalidArgument("slot " + std::to_string(k) + " of vars[" + std::to_string(i) + "] " + e);
        }
        if (k == 2) t.fac_full_v = !placeholder;
        if (placeholder) continue;  // neither read nor written: any dtype
      }
      DType sdt;
      SlotStorage storage;
      if (!ToCoreDType(s.dtype, &sdt) || !SlotStorageOf(t.var_dtype, sdt, &storage) ||
          (k > 0 && storage != t.slot_storage)) {
        return FfiStatus::InvalidArgument("slots of vars[" + std::to_string(i) +
                                          "] have a dtype their variable cannot take");
      }
      t.slot_storage = storage;
      t.slots[k] = s.data;
    }
  }
  for (size_t k = 0; k < sparse.size(); ++k) {
    FfiBuffer idx, v;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Arg(static_cast<size_t>((nslots + 2) * n) + k, &idx));
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>(sparse[k]), &v));
    ApplyTensor& t = ts[sparse[k]];
    t.sparse = true;
    t.indices = static_cast<const int64_t*>(idx.data);
    t.nnz = idx.element_count();
    t.rows = v.rank > 0 ? v.dims[0] : 0;
    t.width = 1;
    for (int64_t d = 1; d < v.rank; ++d) t.width *= v.dims[d];
  }
  return FfiStatus::Ok();
}

FfiStatus ApplyCall::Int8State(const FfiFrame& f, int i, ApplyTensor* t) const {
  const int h = nslots / 2;  // the slots; lists h.. are their absmax
  const std::string what = "int8 state of vars[" + std::to_string(i) + "]";
  if (nslots % 2 != 0 || t->var_dtype != DType::kFloat) {
    return FfiStatus::InvalidArgument(what + ": uint8 slots of a float32 variable, then one float32 absmax each");
  }
  const int64_t blocks = QuantBlocks(t->size);
  for (int k = 0; k < h; ++k) {
    FfiBuffer s, a;
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>((k + 1) * n + i), &s));
    TFCLIP_FFI_RETURN_IF_ERROR(f.Ret(static_cast<size_t>((h + k + 1) * n + i), &a));
    if (s.dtype != XLA_FFI_DataType_U8 || s.element_count() != t->size || a.dtype != XLA_FFI_DataType_F32 ||
        a.element_count() != blocks) {
      return FfiStatus::InvalidArgument(what + ": slot " + std::to_string(k) + " must be u8[" +
                                        std::to_string(t->size) + "] with an f32[" + std::to_string(blocks) +
                                        "] absmax");
    }
    t->slots[k] = s.data;
    t->absmax[k] = static_cast<float*>(a.data);
  }
  t->slot_storage = SlotStorage::kInt8;
  return FfiStatus::Ok();
}

void ApplyCall::ReadHostScalars(StepArgs* a) const {
  const double* s = static_cast<const double*>(scalars);
  int j = 0;
  for (int k = 0; k < kNumHParams; ++k) {
    if ((hmask >> k) & 1u) a->hp.Set(static_cast<HP>(k), s[j++]);
  }
  a->cfg.clip = s[j];
  a->cfg.use_norm = s[j + 1];
  if (has_grad_scale) a->cfg.grad_scale = s[j + 2];
  if (has_rounding) {
    a->hp.stochastic_rounding = true;
    a->hp.rounding_seed = s[j + 3];
    a->hp.rounding_step = s[j + 4];
    a->hp.rounding_tensor = s[j + 5];
  }
}

}  // namespace xla_glue
}  // namespace tfclip
