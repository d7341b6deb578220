// tfclip XLA glue: the typed FFI's C API, read directly (ffi_frame.h).
#include "csrc/xla/ffi_frame.h"

#include <cstring>
#include <thread>
#include <type_traits>

namespace tfclip {
namespace xla_glue {

namespace {

const char* StageName(int s) {
  switch (s) {
    case XLA_FFI_ExecutionStage_INSTANTIATE: return "instantiate";
    case XLA_FFI_ExecutionStage_PREPARE: return "prepare";
    case XLA_FFI_ExecutionStage_INITIALIZE: return "initialize";
    case XLA_FFI_ExecutionStage_EXECUTE: return "execute";
    default: return "unknown";
  }
}

XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const std::string& message) {
  XLA_FFI_Error_Create_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = message.c_str();  // (XLA copies it)
  a.errc = code;
  return api->XLA_FFI_Error_Create(&a);
}

// The metadata's state type (API 0.2 on): none, tfclip's handlers are stateless. Absent in 0.1.
template <typename M>
auto ClearStateType(M* m, int) -> decltype(m->state_type_id, void()) {
  m->state_type_id.type_id = 0;  // XLA_FFI_UNKNOWN_TYPE_ID
}
template <typename M>
void ClearStateType(M*, long) {}

template <typename F>
struct ArgsOf;
template <typename R, typename A>
struct ArgsOf<R (*)(A*)> {
  using type = A;
};

// XLA_FFI_ThreadPool_NumThreads where the API has it (0.1 from TF 2.19, 0.2), read through the
// function's own argument type so the code compiles where it does not (TF 2.18).
template <typename Api>
auto PoolThreads(const Api* api, XLA_FFI_ExecutionContext* ctx, int64_t* n, int)
    -> decltype(api->XLA_FFI_ThreadPool_NumThreads, (XLA_FFI_Error*)nullptr) {
  using Args = typename ArgsOf<decltype(api->XLA_FFI_ThreadPool_NumThreads)>::type;
  if (api->struct_size < offsetof(Api, XLA_FFI_ThreadPool_NumThreads) + sizeof(void*) ||
      api->XLA_FFI_ThreadPool_NumThreads == nullptr) {
    *n = -1;
    return nullptr;
  }
  Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(Args);
  a.ctx = ctx;
  a.num_threads = n;
  return api->XLA_FFI_ThreadPool_NumThreads(&a);
}
template <typename Api>
XLA_FFI_Error* PoolThreads(const Api*, XLA_FFI_ExecutionContext*, int64_t* n, long) {
  *n = -1;
  return nullptr;
}

FfiBuffer ToBuffer(void* p) {
  const auto* b = static_cast<const XLA_FFI_Buffer*>(p);
  FfiBuffer out;
  out.dtype = b->dtype;
  out.data = b->data;
  out.rank = b->rank;
  out.dims = b->dims;
  return out;
}

}  // namespace

FfiStatus FfiFrame::Arg(size_t i, FfiBuffer* out) const {
  if (i >= num_args() || f_->args.types[i] != XLA_FFI_ArgType_BUFFER) {
    return FfiStatus::Internal("tfclip custom call: operand " + std::to_string(i) + " is not a buffer");
  }
  *out = ToBuffer(f_->args.args[i]);
  return FfiStatus::Ok();
}

FfiStatus FfiFrame::Ret(size_t i, FfiBuffer* out) const {
  if (i >= num_rets() || f_->rets.types[i] != XLA_FFI_RetType_BUFFER) {
    return FfiStatus::Internal("tfclip custom call: result " + std::to_string(i) + " is not a buffer");
  }
  *out = ToBuffer(f_->rets.rets[i]);
  return FfiStatus::Ok();
}

FfiStatus FfiFrame::Attr(const char* name, XLA_FFI_AttrType type, void** out) const {
  const size_t len = std::strlen(name);
  for (int64_t k = 0; k < f_->attrs.size; ++k) {
    const XLA_FFI_ByteSpan* s = f_->attrs.names[k];
    if (s->len == len && std::memcmp(s->ptr, name, len) == 0) {
      if (f_->attrs.types[k] != type) break;
      *out = f_->attrs.attrs[k];
      return FfiStatus::Ok();
    }
  }
  return FfiStatus::Internal(std::string("tfclip custom call: attribute ") + name);
}

FfiStatus FfiFrame::I64(const char* name, int64_t* out) const {
  void* p = nullptr;
  TFCLIP_FFI_RETURN_IF_ERROR(Attr(name, XLA_FFI_AttrType_SCALAR, &p));
  const auto* s = static_cast<const XLA_FFI_Scalar*>(p);
  if (s->dtype != XLA_FFI_DataType_S64) {
    return FfiStatus::Internal(std::string("tfclip custom call: attribute ") + name + " is not an i64");
  }
  *out = *static_cast<const int64_t*>(s->value);
  return FfiStatus::Ok();
}

FfiStatus FfiFrame::I64s(const char* name, std::vector<int64_t>* out) const {
  void* p = nullptr;
  TFCLIP_FFI_RETURN_IF_ERROR(Attr(name, XLA_FFI_AttrType_ARRAY, &p));
  const auto* a = static_cast<const XLA_FFI_Array*>(p);
  if (a->dtype != XLA_FFI_DataType_S64) {
    return FfiStatus::Internal(std::string("tfclip custom call: attribute ") + name + " is not an i64 array");
  }
  const auto* v = static_cast<const int64_t*>(a->data);
  out->assign(v, v + a->size);
  return FfiStatus::Ok();
}

void FfiFrame::Drop(XLA_FFI_Error* e) const {
  if (e == nullptr) return;
  XLA_FFI_Error_Destroy_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  a.error = e;
  f_->api->XLA_FFI_Error_Destroy(&a);
}

FfiStatus FfiFrame::Stream(void** out) const {
  XLA_FFI_Stream_Get_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  a.ctx = f_->ctx;
  XLA_FFI_Error* e = f_->api->XLA_FFI_Stream_Get(&a);
  if (e != nullptr) {
    Drop(e);
    return FfiStatus::Internal("tfclip custom call: XLA gave no stream");
  }
  *out = a.stream;
  return FfiStatus::Ok();
}

std::optional<void*> FfiFrame::Allocate(size_t bytes, size_t alignment) const {
  XLA_FFI_DeviceMemory_Allocate_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE;
  a.ctx = f_->ctx;
  a.size = bytes;
  a.alignment = alignment;
  XLA_FFI_Error* e = f_->api->XLA_FFI_DeviceMemory_Allocate(&a);
  if (e != nullptr) {
    Drop(e);
    return std::nullopt;
  }
  return a.data;
}

int64_t FfiFrame::NumThreads() const {
  int64_t n = -1;
  XLA_FFI_Error* e = PoolThreads(f_->api, f_->ctx, &n, 0);
  if (e != nullptr) {  // (no pool in this context)
    Drop(e);
    return 0;
  }
  return n;
}

bool FfiFrame::Schedule(XLA_FFI_Task* task, void* data) const {
  XLA_FFI_ThreadPool_Schedule_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
  a.ctx = f_->ctx;
  a.task = task;
  a.data = data;
  XLA_FFI_Error* e = f_->api->XLA_FFI_ThreadPool_Schedule(&a);
  if (e == nullptr) return true;
  Drop(e);
  return false;
}

XLA_FFI_Error* RunHandler(XLA_FFI_CallFrame* f, FfiBody body) {
  if (f->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE) {
    return MakeError(f->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "tfclip custom call: XLA's call frame is older than the FFI tfclip was built against");
  }
  if (f->extension_start != nullptr && f->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* ext = reinterpret_cast<XLA_FFI_Metadata_Extension*>(f->extension_start);
    XLA_FFI_Metadata* m = ext->metadata;
    m->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    m->api_version.extension_start = nullptr;
    m->api_version.major_version = XLA_FFI_API_MAJOR;
    m->api_version.minor_version = XLA_FFI_API_MINOR;
    m->traits = 0;
    ClearStateType(m, 0);
    return nullptr;
  }
  if (f->stage != XLA_FFI_ExecutionStage_EXECUTE) {
    return MakeError(f->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     std::string("tfclip custom call: called at the ") + StageName(f->stage) +
                         " stage; it has only an execute stage");
  }
  const FfiStatus s = body(FfiFrame(f));
  return s.ok() ? nullptr : MakeError(f->api, s.code(), s.message());
}

std::string RegisterHandler(const XLA_FFI_Api* api, const char* name, const char* platform,
                            XLA_FFI_Handler* handler) {
  XLA_FFI_Handler_Register_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  a.name = XLA_FFI_ByteSpan{name, std::strlen(name)};
  a.platform = XLA_FFI_ByteSpan{platform, std::strlen(platform)};
  a.bundle.execute = handler;
  a.traits = 0;
  XLA_FFI_Error* e = api->XLA_FFI_Handler_Register(&a);
  if (e == nullptr) return "";
  XLA_FFI_Error_GetMessage_Args g;
  std::memset(&g, 0, sizeof(g));
  g.struct_size = XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE;
  g.error = e;
  api->XLA_FFI_Error_GetMessage(&g);
  std::string msg = g.message != nullptr ? g.message : "unknown error";
  XLA_FFI_Error_Destroy_Args d;
  std::memset(&d, 0, sizeof(d));
  d.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  d.error = e;
  api->XLA_FFI_Error_Destroy(&d);
  return msg;
}

}  // namespace xla_glue
}  // namespace tfclip
