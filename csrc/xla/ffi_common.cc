// tfclip XLA glue: decoding shared by the Host and CUDA custom-call handlers (ffi_common.h).
#include "csrc/xla/ffi_common.h"

#include <cstring>

#include <string>
#include <vector>

#include "csrc/core/rule_table.h"

namespace ffi = ::xla::ffi;

namespace tfclip {
namespace xla_glue {

bool ToCoreDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F16: *out = DType::kHalf; return true;
    case ffi::DataType::BF16: *out = DType::kBFloat16; return true;
    case ffi::DataType::F32: *out = DType::kFloat; return true;
    case ffi::DataType::F64: *out = DType::kDouble; return true;
    default: return false;
  }
}

ffi::Error ToCoreDTypeOr(ffi::DataType t, DType* out) {
  return ToCoreDType(t, out) ? ffi::Error::Success()
                             : ffi::Error::Internal("tfclip custom call: a buffer of an unexpected dtype");
}

ffi::Error ViewBuffer(const ffi::AnyBuffer& b, const char* what, int i, TensorView* out) {
  DType dt;
  if (!ToCoreDType(b.element_type(), &dt)) {
    return ffi::Error::InvalidArgument(std::string(what) + "[" + std::to_string(i) +
                                       "] has an unsupported dtype");
  }
  *out = TensorView{b.untyped_data(), static_cast<int64_t>(b.element_count()), dt};
  return ffi::Error::Success();
}

ffi::Error ViewArgs(const ffi::RemainingArgs& args, size_t first, int n, const char* what, TensorView* out) {
  for (int i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(first + static_cast<size_t>(i));
    if (b.has_error()) return b.error();
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(*b, what, i, &out[i]));
  }
  return ffi::Error::Success();
}

ffi::Error ViewRets(const ffi::RemainingRets& rets, size_t first, int n, const char* what, TensorView* out) {
  for (int i = 0; i < n; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(first + static_cast<size_t>(i));
    if (b.has_error()) return b.error();
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(**b, what, i, &out[i]));
  }
  return ffi::Error::Success();
}

ffi::Error ClipCall::Decode(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                            const ffi::Dictionary& attrs) {
  int64_t g = 0;
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "use_given_norm", &g));
  given = g != 0;
  n = static_cast<int>(args.size()) - 2;
  in.resize(static_cast<size_t>(n));
  out.resize(static_cast<size_t>(n));
  TFCLIP_FFI_RETURN_IF_ERROR(ViewArgs(args, 0, n, "t_list", in.data()));
  TFCLIP_FFI_RETURN_IF_ERROR(ViewRets(rets, 0, n, "t_list", out.data()));
  auto c = args.get<ffi::AnyBuffer>(n);
  auto u = args.get<ffi::AnyBuffer>(n + 1);
  auto rn = rets.get<ffi::AnyBuffer>(n);
  auto rt = rets.get<ffi::AnyBuffer>(n + 1);
  if (c.has_error()) return c.error();
  if (u.has_error()) return u.error();
  if (rn.has_error()) return rn.error();
  if (rt.has_error()) return rt.error();
  clip_norm.emplace(*c);
  use_norm.emplace(*u);
  norm.emplace(**rn);
  tensor_norms.emplace(**rt);
  return ffi::Error::Success();
}

ffi::Error GetI64(const ffi::Dictionary& attrs, const char* name, int64_t* out) {
  auto v = attrs.get<int64_t>(name);
  if (v.has_error()) return ffi::Error::Internal(std::string("tfclip custom call: attribute ") + name);
  *out = *v;
  return ffi::Error::Success();
}

ffi::Error GetI64s(const ffi::Dictionary& attrs, const char* name, std::vector<int64_t>* out) {
  auto v = attrs.get<ffi::Span<const int64_t>>(name);
  if (v.has_error()) return ffi::Error::Internal(std::string("tfclip custom call: attribute ") + name);
  out->assign(v->begin(), v->end());
  return ffi::Error::Success();
}

double ReadScalar(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F64 ? *static_cast<const double*>(b.untyped_data())
                                                : *static_cast<const float*>(b.untyped_data());
}

void WriteNorms(const double* norms, int n, void* out, ffi::DataType dtype) {
  for (int i = 0; i < n; ++i) {
    if (dtype == ffi::DataType::F64) static_cast<double*>(out)[i] = RoundNorm<double>(norms[i]);
    else static_cast<float*>(out)[i] = RoundNorm<float>(norms[i]);
  }
}

int ApplyCall::NumHParams() const {
  int h = 0;
  for (int k = 0; k < kNumHParams; ++k) h += (hmask >> k) & 1u;
  return h;
}

ffi::Error ApplyCall::Decode(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                             const ffi::Dictionary& attrs) {
  int64_t rule, flags, mode, policy, has_use_norm, lazy, sos, ns, iters;
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "rule", &rule));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "flags", &flags));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "mode", &mode));
  if (mode == static_cast<int64_t>(ClipMode::kAgc)) {  // (the other modes' calls need not carry it)
    int64_t eps_bits = 0;
    TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "agc_eps_bits", &eps_bits));
    std::memcpy(&step.cfg.agc_eps, &eps_bits, sizeof(double));
  }
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "policy", &policy));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "has_use_norm", &has_use_norm));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "lazy", &lazy));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "sum_of_squares", &sos));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "nslots", &ns));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64(attrs, "has_iterations", &iters));
  TFCLIP_FFI_RETURN_IF_ERROR(GetI64s(attrs, "sparse", &sparse));
  if (rule < 0 || rule >= static_cast<int64_t>(AllRules().size())) {
    return ffi::Error::Internal("tfclip_apply: unknown rule " + std::to_string(rule));
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
  if (args.size() < fixed || (args.size() - fixed) % static_cast<size_t>(nslots + 2) != 0) {
    return ffi::Error::Internal("tfclip_apply: unexpected operand count " + std::to_string(args.size()));
  }
  n = static_cast<int>((args.size() - fixed) / static_cast<size_t>(nslots + 2));
  const size_t nrets = static_cast<size_t>((nslots + 1) * n) + 4 + (has_iterations ? 1 : 0);
  if (rets.size() != nrets) {
    return ffi::Error::Internal("tfclip_apply: unexpected result count " + std::to_string(rets.size()));
  }
  auto sc = args.get<ffi::AnyBuffer>(ScalarsArg());
  if (sc.has_error()) return sc.error();
  if (sc->element_type() != ffi::DataType::F64 ||
      sc->element_count() != static_cast<size_t>(NumHParams() + 2)) {
    return ffi::Error::Internal("tfclip_apply: bad scalars operand");
  }
  scalars = sc->untyped_data();
  const size_t r0 = static_cast<size_t>((nslots + 1) * n);
  void** outs[] = {&applied_out, &norm_out, &tensor_norms_out, &clipped_out, &iterations_out};
  for (size_t k = 0; k < 4 + (has_iterations ? 1u : 0u); ++k) {
    auto r = rets.get<ffi::AnyBuffer>(r0 + k);
    if (r.has_error()) return r.error();
    *outs[k] = (*r)->untyped_data();
  }
  if (has_iterations) {
    auto it = args.get<ffi::AnyBuffer>(ScalarsArg() + 1);
    if (it.has_error()) return it.error();
    iterations_in = it->untyped_data();
  }
  return ffi::Error::Success();
}

ffi::Error ApplyCall::Tensors(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                              ApplyTensor* ts) const {
  for (int i = 0; i < n; ++i) {
    auto v = rets.get<ffi::AnyBuffer>(i);
    auto g = args.get<ffi::AnyBuffer>(static_cast<size_t>((nslots + 1) * n + i));
    if (v.has_error()) return v.error();
    if (g.has_error()) return g.error();
    TensorView vv, gv;
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(**v, "vars", i, &vv));
    TFCLIP_FFI_RETURN_IF_ERROR(ViewBuffer(*g, "grads", i, &gv));
    ApplyTensor& t = ts[i];
    t.var = vv.data;
    t.var_dtype = vv.dtype;
    t.size = vv.size;
    t.grad = gv.data;
    t.grad_dtype = gv.dtype;
    const auto vdims = (*v)->dimensions();  // AGC's units (csrc/core/agc.h)
    t.units = vdims.size() >= 2 ? vdims[vdims.size() - 1] : 1;
    for (int k = 0; k < nslots; ++k) {
      auto s = rets.get<ffi::AnyBuffer>(static_cast<size_t>((k + 1) * n + i));
      if (s.has_error()) return s.error();
      t.slots[k] = (*s)->untyped_data();
    }
  }
  for (size_t k = 0; k < sparse.size(); ++k) {
    auto idx = args.get<ffi::AnyBuffer>(static_cast<size_t>((nslots + 2) * n) + k);
    if (idx.has_error()) return idx.error();
    ApplyTensor& t = ts[sparse[k]];
    auto v = rets.get<ffi::AnyBuffer>(static_cast<size_t>(sparse[k]));
    if (v.has_error()) return v.error();
    const auto dims = (*v)->dimensions();
    t.sparse = true;
    t.indices = static_cast<const int64_t*>(idx->untyped_data());
    t.nnz = static_cast<int64_t>(idx->element_count());
    t.rows = dims.size() > 0 ? dims[0] : 0;
    t.width = 1;
    for (size_t d = 1; d < dims.size(); ++d) t.width *= dims[d];
  }
  return ffi::Error::Success();
}

ffi::Error ApplyCall::ReadHostScalars(const ffi::RemainingArgs& args, StepArgs* a) const {
  const double* s = static_cast<const double*>(scalars);
  int j = 0;
  for (int k = 0; k < kNumHParams; ++k) {
    if ((hmask >> k) & 1u) a->hp.Set(static_cast<HP>(k), s[j++]);
  }
  a->cfg.clip = s[j];
  a->cfg.use_norm = s[j + 1];
  return ffi::Error::Success();
}

}  // namespace xla_glue
}  // namespace tfclip
