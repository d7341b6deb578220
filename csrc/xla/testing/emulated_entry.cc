// tfclip XLA glue, test entry: runs the CUDA apply handler's body (ApplyCudaStep,
// cuda_handlers.cc) on a call frame built here as XLA's GPU runtime builds one (typed-FFI buffers
// with dtype and dims, results after arguments, attributes sorted by name), so the handler is
// exercised without XLA and without a GPU: on the emulated-CUDA build of _core
// (-DTFCLIP_CUDA_EMULATION=ON), from tests/gpu/test_xla_cuda_handler.py through ctypes. The
// workspace comes from cudaMalloc here (XLA's scratch allocator in the real handler). Or, as TF
// 2.16's XLA calls it, a legacy call (legacy_call.h): the buffers' addresses, operands then
// results, and the opaque string the XLA kernel writes, through the legacy entries' own runner.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/core/cuda/workspace.h"
#include "csrc/xla/ffi/cuda_handlers.h"
#include "csrc/xla/ffi/frame.h"
#include "csrc/xla/ffi/legacy_call.h"
#include "xla/ffi/api/c_api.h"

// XLA's status object as this test sees it (XLA's own, in TF 2.16, is not linked in here).
struct XlaCustomCallStatus_ {
  bool failed = false;
  std::string message;
};

void tfclip::xla_glue::SetLegacyFailure(XlaCustomCallStatus_* status, const std::string& message) {
  status->failed = true;
  status->message = message;
}

namespace {

struct Buffers {
  std::vector<XLA_FFI_Buffer> bufs;
  std::vector<void*> ptrs;
  std::vector<int64_t> dims;
  void Build(int n, const int32_t* dtypes, void* const* data, const int64_t* ranks, const int64_t* dims_in) {
    bufs.resize(n);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += ranks[i];
    dims.assign(dims_in, dims_in + total);
    int64_t off = 0;
    for (int i = 0; i < n; ++i) {
      XLA_FFI_Buffer& b = bufs[i];
      std::memset(&b, 0, sizeof(b));
      b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
      b.dtype = static_cast<XLA_FFI_DataType>(dtypes[i]);
      b.data = data[i];
      b.rank = ranks[i];
      b.dims = dims.data() + off;
      off += ranks[i];
    }
    for (auto& b : bufs) ptrs.push_back(&b);
  }
};

const char* const kAttrNames[] = {"rule", "flags", "mode", "policy", "has_use_norm", "lazy",
                                  "sum_of_squares", "nslots", "has_iterations", "agc_eps_bits"};

// A legacy call of the handler (TF 2.16's XLA): its descriptor string as the XLA kernel writes it
// (EncodeLegacyCall), the buffers' addresses, operands then results.
int LegacyApply(void* stream, const Buffers& args, const Buffers& rets, const int64_t* attr_values,
                const char* const* names, char* err, int err_len) {
  using tfclip::xla_glue::LegacyAttr;
  using tfclip::xla_glue::LegacyShape;
  std::vector<LegacyShape> a, r;
  for (const auto* in : {&args, &rets}) {
    for (const XLA_FFI_Buffer& b : in->bufs) {
      (in == &args ? a : r).push_back(LegacyShape{static_cast<int64_t>(b.dtype),
                                                  std::vector<int64_t>(b.dims, b.dims + b.rank)});
    }
  }
  std::vector<LegacyAttr> attrs;
  for (int k = 0; k < 10; ++k) attrs.push_back(LegacyAttr{names[k], false, {attr_values[k]}});
  attrs.push_back(LegacyAttr{"sparse", true, {}});
  const std::string opaque = tfclip::xla_glue::EncodeLegacyCall(a, r, attrs);
  std::vector<void*> buffers;
  for (const XLA_FFI_Buffer& b : args.bufs) buffers.push_back(b.data);
  for (const XLA_FFI_Buffer& b : rets.bufs) buffers.push_back(b.data);
  XlaCustomCallStatus_ status;
  tfclip::xla_glue::RunLegacyCuda(stream, buffers.data(), opaque.data(), opaque.size(), &status,
                                  &tfclip::xla_glue::ApplyCuda);
  tfclip::cuda::StreamSynchronize(stream);
  if (!status.failed) return 0;
  std::snprintf(err, static_cast<size_t>(err_len), "%s", status.message.c_str());
  return 1;
}

}  // namespace

// attrs: rule, flags, mode, policy, has_use_norm, lazy, sum_of_squares, nslots, has_iterations,
// agc_eps_bits (the double's bits; read only with mode agc).
// dtypes are XLA_FFI_DataType values. xla_scratch: 1, XLA's scratch allocator; 0, a runtime
// without one (FFI API 0.0, TF 2.17); 2, a legacy call (TF 2.16). Returns 0, or 1 with the
// handler's message in err.
extern "C" __attribute__((visibility("default"))) int tfclip_xla_cuda_apply_for_test(
    void* stream, int nargs, const int32_t* arg_dtypes, void* const* arg_data, const int64_t* arg_ranks,
    const int64_t* arg_dims, int nrets, const int32_t* ret_dtypes, void* const* ret_data,
    const int64_t* ret_ranks, const int64_t* ret_dims, const int64_t* attr_values, int xla_scratch,
    char* err, int err_len) {
  Buffers args, rets;
  args.Build(nargs, arg_dtypes, arg_data, arg_ranks, arg_dims);
  rets.Build(nrets, ret_dtypes, ret_data, ret_ranks, ret_dims);
  if (xla_scratch == 2) return LegacyApply(stream, args, rets, attr_values, kAttrNames, err, err_len);
  std::vector<XLA_FFI_ArgType> arg_types(nargs, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(nrets, XLA_FFI_RetType_BUFFER);
  XLA_FFI_Args a{XLA_FFI_Args_STRUCT_SIZE, nullptr, nargs, arg_types.data(), args.ptrs.data()};
  XLA_FFI_Rets r{XLA_FFI_Rets_STRUCT_SIZE, nullptr, nrets, ret_types.data(), rets.ptrs.data()};

  // The attributes, as XLA decodes the backend config: sorted by name.
  struct Attr {
    std::string name;
    XLA_FFI_AttrType type;
    int64_t value;
  };
  std::vector<Attr> list;
  for (int k = 0; k < 10; ++k) list.push_back({kAttrNames[k], XLA_FFI_AttrType_SCALAR, attr_values[k]});
  list.push_back({"sparse", XLA_FFI_AttrType_ARRAY, 0});
  std::sort(list.begin(), list.end(), [](const Attr& x, const Attr& y) { return x.name < y.name; });
  std::vector<XLA_FFI_ByteSpan> spans(list.size());
  std::vector<XLA_FFI_ByteSpan*> names(list.size());
  std::vector<XLA_FFI_Scalar> scalars(list.size());
  XLA_FFI_Array empty{XLA_FFI_DataType_S64, 0, nullptr};
  std::vector<XLA_FFI_AttrType> types(list.size());
  std::vector<void*> values(list.size());
  for (size_t k = 0; k < list.size(); ++k) {
    spans[k] = XLA_FFI_ByteSpan{list[k].name.data(), list[k].name.size()};
    names[k] = &spans[k];
    types[k] = list[k].type;
    scalars[k] = XLA_FFI_Scalar{XLA_FFI_DataType_S64, &list[k].value};
    values[k] = list[k].type == XLA_FFI_AttrType_ARRAY ? static_cast<void*>(&empty)
                                                       : static_cast<void*>(&scalars[k]);
  }
  XLA_FFI_Attrs at{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(list.size()), types.data(),
                   names.data(), values.data()};

  // As XLA's scratch allocator: memory aligned to kXlaScratchAlign and no more (here exactly
  // that, off any larger boundary), so the handler's own alignment of its workspace runs.
  std::vector<void*> allocated;
  // xla_scratch 0: a runtime without a scratch allocator (FFI API 0.0, TF 2.17).
  tfclip::xla_glue::CudaAllocFn alloc;
  if (xla_scratch) alloc = [&allocated](size_t bytes) -> std::optional<void*> {
    void* p = nullptr;
    const size_t a = tfclip::xla_glue::kXlaScratchAlign;
    if (!tfclip::cuda::DeviceAlloc(&p, bytes + a).empty()) return std::nullopt;
    allocated.push_back(p);
    return static_cast<char*>(p) + a;
  };
  // The frame as XLA passes it at the execute stage (no API table: the body reads only buffers
  // and attributes, and returns its status).
  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = a;
  frame.rets = r;
  frame.attrs = at;
  const tfclip::xla_glue::FfiStatus e =
      tfclip::xla_glue::ApplyCudaStep(stream, alloc, tfclip::xla_glue::FfiFrame(&frame));
  tfclip::cuda::StreamSynchronize(stream);  // the workspace is freed below
  for (void* p : allocated) tfclip::cuda::DeviceFree(p);
  if (e.ok()) return 0;
  std::snprintf(err, static_cast<size_t>(err_len), "%s", e.message().c_str());
  return 1;
}
