// tfclip XLA glue: the typed FFI's C API, read directly (ffi_frame.h).
#include "csrc/xla/ffi/frame.h"

#include <cstring>
#include "csrc/xla/ffi/legacy_call.h"
#include <thread>
#include <type_traits>

namespace tfclip {
namespace xla_glue {

// A legacy call (legacy_call.h) answers from its decoded descriptor and has no context; a
// typed-FFI frame, from XLA's call frame and API table.
size_t FfiFrame::num_args() const {
#if TFCLIP_XLA_TYPED_FFI
  if (legacy_ == nullptr) return static_cast<size_t>(f_->args.size);
#endif
  return legacy_->num_args();
}

size_t FfiFrame::num_rets() const {
#if TFCLIP_XLA_TYPED_FFI
  if (legacy_ == nullptr) return static_cast<size_t>(f_->rets.size);
#endif
  return legacy_->num_rets();
}

#if TFCLIP_XLA_TYPED_FFI
namespace {

XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const std::string& message) {
  XLA_FFI_Error_Create_Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = message.c_str();  // (XLA copies it)
  a.errc = code;
  return api->XLA_FFI_Error_Create(&a);
}


// The calls some APIs lack, each asked for at compile time (the member exists in this c_api.h)
// and at run time (the runtime's table is long enough to hold it), and called through its own
// argument type, so this file compiles against every version's header. Without them:
//   XLA_FFI_ThreadPool_NumThreads (from 0.1 on TF 2.19): the part count comes from the machine;
//   XLA_FFI_ThreadPool_Schedule (from 0.1): the caller runs every part (TF 2.17: one thread);
//   XLA_FFI_DeviceMemory_Allocate (from 0.1): no scratch (TF 2.17: the CUDA handlers keep their
//   own device buffers, cuda_handlers.cc).
template <typename F>
struct ArgsOf;
template <typename R, typename A>
struct ArgsOf<R (*)(A*)> {
  using type = A;
};

// (Api is the template's parameter: the member is named only where the overload exists.)
#define TFCLIP_FFI_HAS(api, fn) \
  ((api)->struct_size >= offsetof(Api, fn) + sizeof(void*) && (api)->fn != nullptr)

// One call of api->fn through its own argument struct: zeroed, sized, filled by `fill`, and read
// back by `out` (generic lambdas: they name the struct's members only where the call exists).
template <typename Fn, typename Fill, typename Out>
XLA_FFI_Error* CallWith(Fn* fn, Fill fill, Out out) {
  using Args = typename ArgsOf<Fn*>::type;
  Args a;
  std::memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(Args);
  fill(a);
  XLA_FFI_Error* e = fn(&a);
  out(a);
  return e;
}
template <typename Fn, typename Fill>
XLA_FFI_Error* CallWith(Fn* fn, Fill fill) {
  return CallWith(fn, fill, [](auto&) {});
}

// Each call below: an overload taking `int` where the API has it, and one taking `long` (picked
// where it does not) that says so. nullptr: no error (or no such call).
template <typename Api>
auto PoolThreads(const Api* api, XLA_FFI_ExecutionContext* ctx, int64_t* n, int)
    -> decltype(api->XLA_FFI_ThreadPool_NumThreads, (XLA_FFI_Error*)nullptr) {
  *n = -1;
  if (!TFCLIP_FFI_HAS(api, XLA_FFI_ThreadPool_NumThreads)) return nullptr;
  return CallWith(api->XLA_FFI_ThreadPool_NumThreads, [&](auto& a) {
    a.ctx = ctx;
    a.num_threads = n;
  });
}
template <typename Api>
XLA_FFI_Error* PoolThreads(const Api*, XLA_FFI_ExecutionContext*, int64_t* n, long) {
  *n = -1;
  return nullptr;
}

// false with *err == nullptr: no such call.
template <typename Api>
auto PoolSchedule(const Api* api, XLA_FFI_ExecutionContext* ctx, FfiTask task, void* data,
                  XLA_FFI_Error** err, int) -> decltype(api->XLA_FFI_ThreadPool_Schedule, bool()) {
  *err = nullptr;
  if (!TFCLIP_FFI_HAS(api, XLA_FFI_ThreadPool_Schedule)) return false;
  *err = CallWith(api->XLA_FFI_ThreadPool_Schedule, [&](auto& a) {
    a.ctx = ctx;
    a.task = task;
    a.data = data;
  });
  return *err == nullptr;
}
template <typename Api>
bool PoolSchedule(const Api*, XLA_FFI_ExecutionContext*, FfiTask, void*, XLA_FFI_Error** err, long) {
  *err = nullptr;
  return false;
}

template <typename Api>
auto CanSchedule(const Api* api, int) -> decltype(api->XLA_FFI_ThreadPool_Schedule, bool()) {
  return TFCLIP_FFI_HAS(api, XLA_FFI_ThreadPool_Schedule);
}
template <typename Api>
bool CanSchedule(const Api*, long) {
  return false;
}

template <typename Api>
auto CanAllocate(const Api* api, int) -> decltype(api->XLA_FFI_DeviceMemory_Allocate, bool()) {
  return TFCLIP_FFI_HAS(api, XLA_FFI_DeviceMemory_Allocate);
}
template <typename Api>
bool CanAllocate(const Api*, long) {
  return false;
}

template <typename Api>
auto DeviceAllocate(const Api* api, XLA_FFI_ExecutionContext* ctx, size_t bytes, size_t alignment,
                    void** out, XLA_FFI_Error** err, int)
    -> decltype(api->XLA_FFI_DeviceMemory_Allocate, bool()) {
  *err = nullptr;
  if (!TFCLIP_FFI_HAS(api, XLA_FFI_DeviceMemory_Allocate)) return false;
  *err = CallWith(
      api->XLA_FFI_DeviceMemory_Allocate,
      [&](auto& a) {
        a.ctx = ctx;
        a.size = bytes;
        a.alignment = alignment;
      },
      [&](auto& a) { *out = a.data; });
  return *err == nullptr;
}
template <typename Api>
bool DeviceAllocate(const Api*, XLA_FFI_ExecutionContext*, size_t, size_t, void**, XLA_FFI_Error** err, long) {
  *err = nullptr;
  return false;
}
// XLA's metadata query (API 0.1 on): a call frame whose first extension asks the handler which
// API version it was built against. Answered with the c_api.h compiled against, no traits, no
// state. 0.0 (TF 2.17) has no extensions.
#if XLA_FFI_API_MAJOR > 0 || XLA_FFI_API_MINOR >= 1
// The metadata's state type (API 0.2 on): none, tfclip's handlers are stateless. Absent in 0.1.
template <typename M>
auto ClearStateType(M* m, int) -> decltype(m->state_type_id, void()) {
  m->state_type_id.type_id = 0;  // XLA_FFI_UNKNOWN_TYPE_ID
}
template <typename M>
void ClearStateType(M*, long) {}

bool AnswerMetadataQuery(XLA_FFI_CallFrame* f) {
  if (f->extension_start == nullptr || f->extension_start->type != XLA_FFI_Extension_Metadata) return false;
  XLA_FFI_Metadata* m = reinterpret_cast<XLA_FFI_Metadata_Extension*>(f->extension_start)->metadata;
  m->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  m->api_version.extension_start = nullptr;
  m->api_version.major_version = XLA_FFI_API_MAJOR;
  m->api_version.minor_version = XLA_FFI_API_MINOR;
  m->traits = 0;
  ClearStateType(m, 0);
  return true;
}
#else
bool AnswerMetadataQuery(XLA_FFI_CallFrame*) { return false; }
#endif

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
  if (legacy_ != nullptr) return legacy_->Arg(i, out);
  if (i >= num_args() || f_->args.types[i] != XLA_FFI_ArgType_BUFFER) {
    return FfiStatus::Internal("tfclip custom call: operand " + std::to_string(i) + " is not a buffer");
  }
  *out = ToBuffer(f_->args.args[i]);
  return FfiStatus::Ok();
}

FfiStatus FfiFrame::Ret(size_t i, FfiBuffer* out) const {
  if (legacy_ != nullptr) return legacy_->Ret(i, out);
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
  if (legacy_ != nullptr) return legacy_->I64(name, out);
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
  if (legacy_ != nullptr) return legacy_->I64s(name, out);
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
  if (legacy_ != nullptr) {
    *out = legacy_->stream;
    return FfiStatus::Ok();
  }
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

bool FfiFrame::HasAllocator() const { return legacy_ == nullptr && CanAllocate(f_->api, 0); }

std::optional<void*> FfiFrame::Allocate(size_t bytes, size_t alignment) const {
  if (legacy_ != nullptr) return std::nullopt;
  void* p = nullptr;
  XLA_FFI_Error* e = nullptr;
  if (DeviceAllocate(f_->api, f_->ctx, bytes, alignment, &p, &e, 0)) return p;
  Drop(e);
  return std::nullopt;
}

int64_t FfiFrame::NumThreads() const {
  if (legacy_ != nullptr || !CanSchedule(f_->api, 0)) return 0;  // no pool: the caller runs the work
  int64_t n = -1;
  XLA_FFI_Error* e = PoolThreads(f_->api, f_->ctx, &n, 0);
  if (e != nullptr) {  // (no pool in this context)
    Drop(e);
    return 0;
  }
  return n;
}

bool FfiFrame::Schedule(FfiTask task, void* data) const {
  if (legacy_ != nullptr) return false;
  XLA_FFI_Error* e = nullptr;
  if (PoolSchedule(f_->api, f_->ctx, task, data, &e, 0)) return true;
  Drop(e);
  return false;
}

XLA_FFI_Error* RunHandler(XLA_FFI_CallFrame* f, FfiBody body) {
  if (f->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE) {
    return MakeError(f->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "tfclip custom call: XLA's call frame is older than the FFI tfclip was built against");
  }
  if (AnswerMetadataQuery(f)) return nullptr;
  if (f->stage != XLA_FFI_ExecutionStage_EXECUTE) {
    return MakeError(f->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "tfclip custom call: called at stage " + std::to_string(static_cast<int>(f->stage)) +
                         "; it has only an execute stage");
  }
  const FfiStatus s = body(FfiFrame(f));
  return s.ok() ? nullptr : MakeError(f->api, s.code(), s.message());
}

// An error's message. XLA renamed XLA_FFI_Error_GetMessage to XLA_FFI_Error_GetDetails (the same
// slot of the API table, its arguments one out-field longer: jaxlib 0.11's headers have only the
// new name, TF's the old), so the call is picked by which member the table has; the arguments'
// type comes from the member's own signature and its size from its last field, as XLA counts it.
template <typename Fn> struct FirstArg;
template <typename A> struct FirstArg<void (*)(A*)> { using type = A; };

template <typename Args, typename Fn>
std::string ReadMessage(Fn fn, XLA_FFI_Error* e, size_t struct_size) {
  Args g;
  std::memset(&g, 0, sizeof(g));
  g.struct_size = struct_size;
  g.error = e;
  fn(&g);
  return g.message != nullptr ? g.message : "unknown error";
}

template <typename Api>
auto ErrorMessage(const Api* api, XLA_FFI_Error* e, int)
    -> decltype(api->XLA_FFI_Error_GetDetails, std::string()) {
  using Args = typename FirstArg<decltype(api->XLA_FFI_Error_GetDetails)>::type;
  return ReadMessage<Args>(api->XLA_FFI_Error_GetDetails, e, XLA_FFI_STRUCT_SIZE(Args, errc));
}

template <typename Api>
auto ErrorMessage(const Api* api, XLA_FFI_Error* e, long)
    -> decltype(api->XLA_FFI_Error_GetMessage, std::string()) {
  using Args = typename FirstArg<decltype(api->XLA_FFI_Error_GetMessage)>::type;
  return ReadMessage<Args>(api->XLA_FFI_Error_GetMessage, e, XLA_FFI_STRUCT_SIZE(Args, message));
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
  std::string msg = ErrorMessage(api, e, 0);
  XLA_FFI_Error_Destroy_Args d;
  std::memset(&d, 0, sizeof(d));
  d.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  d.error = e;
  api->XLA_FFI_Error_Destroy(&d);
  return msg;
}

#else  // !TFCLIP_XLA_TYPED_FFI: legacy calls only (TF 2.16)

FfiStatus FfiFrame::Arg(size_t i, FfiBuffer* out) const { return legacy_->Arg(i, out); }
FfiStatus FfiFrame::Ret(size_t i, FfiBuffer* out) const { return legacy_->Ret(i, out); }
FfiStatus FfiFrame::I64(const char* name, int64_t* out) const { return legacy_->I64(name, out); }
FfiStatus FfiFrame::I64s(const char* name, std::vector<int64_t>* out) const { return legacy_->I64s(name, out); }
FfiStatus FfiFrame::Stream(void** out) const {
  *out = legacy_->stream;
  return FfiStatus::Ok();
}
bool FfiFrame::HasAllocator() const { return false; }
std::optional<void*> FfiFrame::Allocate(size_t, size_t) const { return std::nullopt; }
int64_t FfiFrame::NumThreads() const { return 0; }
bool FfiFrame::Schedule(FfiTask, void*) const { return false; }

#endif  // TFCLIP_XLA_TYPED_FFI

}  // namespace xla_glue
}  // namespace tfclip
