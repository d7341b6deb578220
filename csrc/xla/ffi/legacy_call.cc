// tfclip XLA glue: the legacy custom-call API's opaque string and entries (legacy_call.h).
#include "csrc/xla/ffi/legacy_call.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tfclip {
namespace xla_glue {

namespace {

void AppendInts(const std::vector<int64_t>& v, std::string* s) {
  for (size_t k = 0; k < v.size(); ++k) {
    if (k > 0) *s += ',';
    *s += std::to_string(v[k]);
  }
}

// "<v0>,<v1>,..." (empty: none) into *out; false on anything else.
bool ParseInts(const std::string& s, std::vector<int64_t>* out) {
  out->clear();
  if (s.empty()) return true;
  size_t p = 0;
  for (;;) {
    const size_t e = s.find(',', p);
    const std::string tok = s.substr(p, e == std::string::npos ? std::string::npos : e - p);
    if (tok.empty()) return false;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    if (errno != 0 || end != tok.c_str() + tok.size()) return false;
    out->push_back(static_cast<int64_t>(v));
    if (e == std::string::npos) return true;
    p = e + 1;
  }
}

FfiBuffer ToBuffer(const LegacyShape& s, void* data) {
  FfiBuffer b;
  b.dtype = static_cast<XLA_FFI_DataType>(s.dtype);
  b.data = data;
  b.rank = static_cast<int64_t>(s.dims.size());
  b.dims = s.dims.data();
  return b;
}

}  // namespace

std::string EncodeLegacyCall(const std::vector<LegacyShape>& args, const std::vector<LegacyShape>& rets,
                             const std::vector<LegacyAttr>& attrs) {
  std::string s;
  auto sep = [&s] {
    if (!s.empty()) s += ';';
  };
  for (const auto* list : {&args, &rets}) {
    for (const LegacyShape& sh : *list) {
      sep();
      s += (list == &args ? 'a' : 'r') + std::to_string(sh.dtype) + ':';
      AppendInts(sh.dims, &s);
    }
  }
  for (const LegacyAttr& a : attrs) {
    sep();
    s += (a.array ? 'v' : 'i') + a.name + '=';
    AppendInts(a.values, &s);
  }
  return s;
}

std::string LegacyCall::Decode(const char* opaque, size_t len) {
  args_.clear();
  rets_.clear();
  attrs_.clear();
  const std::string s(opaque, len);
  size_t p = 0;
  while (p < s.size()) {
    const size_t e = std::min(s.find(';', p), s.size());
    const std::string tok = s.substr(p, e - p);
    p = e + 1;
    const auto bad = [&tok] { return "tfclip custom call: a malformed descriptor token '" + tok + "'"; };
    if (tok.size() < 2) return bad();
    const char kind = tok[0];
    if (kind == 'a' || kind == 'r') {
      const size_t colon = tok.find(':');
      if (colon == std::string::npos) return bad();
      std::vector<int64_t> dt;
      LegacyShape sh;
      if (!ParseInts(tok.substr(1, colon - 1), &dt) || dt.size() != 1 || !ParseInts(tok.substr(colon + 1), &sh.dims)) {
        return bad();
      }
      sh.dtype = dt[0];
      (kind == 'a' ? args_ : rets_).push_back(std::move(sh));
    } else if (kind == 'i' || kind == 'v') {
      const size_t eq = tok.find('=');
      if (eq == std::string::npos || eq == 1) return bad();
      LegacyAttr a;
      a.name = tok.substr(1, eq - 1);
      a.array = kind == 'v';
      if (!ParseInts(tok.substr(eq + 1), &a.values) || (!a.array && a.values.size() != 1)) return bad();
      attrs_.push_back(std::move(a));
    } else {
      return bad();
    }
  }
  return "";
}

void LegacyCall::Bind(const void* const* args, void* const* rets) {
  arg_data_.assign(args_.size(), nullptr);
  ret_data_.assign(rets_.size(), nullptr);
  for (size_t i = 0; i < args_.size(); ++i) arg_data_[i] = const_cast<void*>(args[i]);
  for (size_t i = 0; i < rets_.size(); ++i) ret_data_[i] = rets[i];
}

FfiStatus LegacyCall::Arg(size_t i, FfiBuffer* out) const {
  if (i >= args_.size()) return FfiStatus::Internal("tfclip custom call: no operand " + std::to_string(i));
  *out = ToBuffer(args_[i], arg_data_[i]);
  return FfiStatus::Ok();
}

FfiStatus LegacyCall::Ret(size_t i, FfiBuffer* out) const {
  if (i >= rets_.size()) return FfiStatus::Internal("tfclip custom call: no result " + std::to_string(i));
  *out = ToBuffer(rets_[i], ret_data_[i]);
  return FfiStatus::Ok();
}

const LegacyAttr* LegacyCall::Find(const char* name, bool array) const {
  for (const LegacyAttr& a : attrs_) {
    if (a.array == array && a.name == name) return &a;
  }
  return nullptr;
}

FfiStatus LegacyCall::I64(const char* name, int64_t* out) const {
  const LegacyAttr* a = Find(name, false);
  if (a == nullptr) return FfiStatus::Internal(std::string("tfclip custom call: attribute ") + name);
  *out = a->values[0];
  return FfiStatus::Ok();
}

FfiStatus LegacyCall::I64s(const char* name, std::vector<int64_t>* out) const {
  const LegacyAttr* a = Find(name, true);
  if (a == nullptr) return FfiStatus::Internal(std::string("tfclip custom call: attribute ") + name);
  *out = a->values;
  return FfiStatus::Ok();
}

// Where no XLA status type is linked in (the JAX harness's module, which runs no legacy call):
// the TF op library and the emulated test entry define their own.
__attribute__((weak)) void SetLegacyFailure(XlaCustomCallStatus_*, const std::string& message) {
  std::fprintf(stderr, "tfclip: a legacy custom call failed with no way to report it: %s\n", message.c_str());
  std::abort();
}

namespace {

// Decoded once per thread and reused while a call's string is the same (each compiled call keeps
// its string for the executable's life; a string is compared, not trusted by address).
LegacyCall* DecodeCached(const char* opaque, size_t len, std::string* err) {
  thread_local LegacyCall call;
  thread_local std::string key;
  thread_local bool valid = false;
  if (!valid || key.size() != len || std::memcmp(key.data(), opaque, len) != 0) {
    valid = false;
    *err = call.Decode(opaque, len);
    if (!err->empty()) return nullptr;
    key.assign(opaque, len);
    valid = true;
  }
  return &call;
}

void Run(LegacyCall* call, XlaCustomCallStatus_* status, FfiBody body) {
  const FfiStatus s = body(FfiFrame(call));
  if (!s.ok()) SetLegacyFailure(status, s.message());
}

}  // namespace

void RunLegacyHost(void* out, const void** in, const char* opaque, size_t len, XlaCustomCallStatus_* status,
                   FfiBody body) {
  std::string err;
  LegacyCall* call = DecodeCached(opaque, len, &err);
  if (call == nullptr) return SetLegacyFailure(status, err);
  call->stream = nullptr;
  // Every tfclip call returns a tuple: `out` is its table of buffer addresses.
  call->Bind(in, static_cast<void* const*>(out));
  Run(call, status, body);
}

void RunLegacyCuda(void* stream, void** buffers, const char* opaque, size_t len, XlaCustomCallStatus_* status,
                   FfiBody body) {
  std::string err;
  LegacyCall* call = DecodeCached(opaque, len, &err);
  if (call == nullptr) return SetLegacyFailure(status, err);
  call->stream = stream;
  call->Bind(buffers, buffers + call->num_args());
  Run(call, status, body);
}

}  // namespace xla_glue
}  // namespace tfclip
