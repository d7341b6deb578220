// tfclip TF glue: the step's resource variables (resources.h).
#include "csrc/tf/resources.h"

#include <algorithm>
#include <cstring>
#include <utility>

#if TFCLIP_WITH_CUDA
#include "csrc/core/cuda/workspace.h"
#endif

namespace tfclip {

absl::Status VarLookup::Add(const char* input, const char* label, int n, std::vector<VarRef>* out) {
  static const uint64_t kVarType = tf::TypeIndex::Make<tf::Var>().hash_code();
  int start, stop;
  TF_RETURN_IF_ERROR(ctx_->op_kernel().InputRange(input, &start, &stop));
  int64_t total = 0;
  for (int j = start; j < stop; ++j) {
    const tf::Tensor& t = ctx_->input(j);
    if (t.dims() > 1) {
      return tf::errors::InvalidArgument(label, " must hold scalar or vector resource handles; "
                                         "got shape ", t.shape().DebugString());
    }
    total += t.NumElements();
  }
  if (total != n) {
    const std::string what(label);
    if (what == "vars") {
      return tf::errors::InvalidArgument("got ", n, " gradients for ", total, " variables");
    }
    if (what == "iterations") {
      return tf::errors::InvalidArgument("iterations must be one variable, got ", total,
                                         " handles");
    }
    return tf::errors::InvalidArgument("got ", total, " ", label, " slots for ", n,
                                       " variables");
  }
  int i = 0;
  for (int j = start; j < stop; ++j) {
    const auto handles = ctx_->input(j).flat<tf::ResourceHandle>();
    for (int64_t e = 0; e < handles.size(); ++e, ++i) {
      VarRef r{label, i, nullptr};
      const tf::ResourceHandle& h = handles(e);
      if (h.IsRefCounting() && h.hash_code() == kVarType && h.device() == device_) {
        r.var = static_cast<tf::Var*>(h.resource().get());
      } else {
        tf::core::RefCountPtr<tf::Var> v;
        const absl::Status s = tf::LookupResource(ctx_, h, &v);
        if (!s.ok()) {
          return tf::errors::FailedPrecondition(r.name(), " is not initialized (or was deleted): ",
                                                s.message());
        }
        r.var = v.get();
        owned_.push_back(std::move(v));
      }
      out->push_back(r);
    }
  }
  return absl::OkStatus();
}


absl::Status VarLookup::Count(const char* input, int64_t* total) const {
  int start, stop;
  TF_RETURN_IF_ERROR(ctx_->op_kernel().InputRange(input, &start, &stop));
  *total = 0;
  for (int j = start; j < stop; ++j) *total += ctx_->input(j).NumElements();
  return absl::OkStatus();
}

absl::Status LockOrder::Lock(const std::vector<VarRef>& refs, LockSet* locks) {
  std::vector<tf::mutex*> order;
  {
    tf::mutex_lock l(mu_);
    bool same = key_.size() == refs.size();
    for (size_t k = 0; same && k < refs.size(); ++k) same = key_[k] == Key(refs[k]);
    if (same) order = order_;
  }
  if (order.empty()) {
    // (The keys are gathered first: a sort that chases refs[k].var->mu() per comparison cost
    // more; benchmarks/NOTES.md, "Figures behind the code": T1.)
    std::vector<std::pair<tf::mutex*, int>> sorted(refs.size());
    for (size_t k = 0; k < refs.size(); ++k) sorted[k] = {refs[k].mu(), static_cast<int>(k)};
    std::sort(sorted.begin(), sorted.end());
    for (size_t k = 1; k < sorted.size(); ++k) {
      const VarRef& a = refs[sorted[k - 1].second];
      const VarRef& b = refs[sorted[k].second];
      if (sorted[k - 1].first == sorted[k].first) {  // one mutex: one variable
        return tf::errors::InvalidArgument(b.name(), " and ", a.name(),
                                           " are the same variable; each may appear once");
      }
    }
    order.reserve(sorted.size());
    for (const auto& o : sorted) order.push_back(o.first);
    std::vector<const void*> key(refs.size());
    for (size_t k = 0; k < refs.size(); ++k) key[k] = Key(refs[k]);
    tf::mutex_lock l(mu_);
    key_ = std::move(key);
    order_ = order;
  }
  for (tf::mutex* m : order) locks->Lock(m);
  return absl::OkStatus();
}

absl::Status EnsureExclusive(tf::OpKernelContext* ctx, tf::Var* var, void* gpu_stream) {
  tf::Tensor* t = var->tensor();
  if (!var->copy_on_read_mode.load() && t->RefCountIsOne()) return absl::OkStatus();
  tf::Tensor copy;
  tf::AllocatorAttributes attr;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy, attr));
  char* dst = const_cast<char*>(copy.tensor_data().data());
  if (gpu_stream != nullptr) {
#if TFCLIP_WITH_CUDA
    if (t->TotalBytes() > 0) {
      const std::string e =
          cuda::CopyDeviceAsync(dst, t->tensor_data().data(), t->TotalBytes(), gpu_stream);
      if (!e.empty()) return tf::errors::Internal(e);
    }
#endif
  } else {
    std::memcpy(dst, t->tensor_data().data(), t->TotalBytes());
  }
  *t = copy;
  return absl::OkStatus();
}

}  // namespace tfclip
