// tfclip TF glue: the step's resource variables. Finding each Var behind its handle, locking a
// step's variables in one global order, copy-on-write before an in-place update: what a TF
// kernel that updates resource variables must do, apart from the core's work (apply_kernel.cc).
#pragma once

#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/platform/mutex.h"

namespace tfclip {
namespace tf = ::tensorflow;

// One variable input: where it came from (for errors) and its Var. The Var stays alive for all
// of Compute: see VarLookup. A TF1 ref variable (TfclipClipApplyRef<Op>, ops.cc) has no Var:
// `var` is null, `ref_mu` its mutex, `ref_input` the op input, `ref` its tensor (sharing the
// variable's buffer), set once its mutex is held; `node` the variable's node, for errors.
struct VarRef {
  const char* label;  // the input list: "vars", "m", ...
  int index;
  tf::Var* var;
  tf::mutex* ref_mu = nullptr;
  int ref_input = -1;
  tf::Tensor* ref = nullptr;
  const std::string* node = nullptr;
  tf::mutex* mu() const { return var != nullptr ? var->mu() : ref_mu; }
  // The tensor to update: the Var's, or the ref's.
  tf::Tensor* tensor() const { return var != nullptr ? var->tensor() : ref; }
  bool initialized() const { return var != nullptr ? var->is_initialized : ref->IsInitialized(); }
  std::string name() const {  // errors only
    return node == nullptr ? absl::StrCat(label, "[", index, "]")
                           : absl::StrCat(label, "[", index, "] (", *node, ")");
  }
};

// Holds the locks of a step's variables, released in reverse order.
class LockSet {
 public:
  LockSet() = default;
  LockSet(const LockSet&) = delete;
  LockSet& operator=(const LockSet&) = delete;
  void Lock(tf::mutex* m) TF_NO_THREAD_SAFETY_ANALYSIS {
    m->lock();
    held_.push_back(m);
  }
  ~LockSet() TF_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->unlock();
  }

 private:
  std::vector<tf::mutex*> held_;
};

// Finds the Vars of a step's resource inputs. A TF2 variable's handle is ref-counting: it owns
// its Var, and the op's input owns the handle until Compute returns, so such a Var is used
// through the handle's pointer, with no reference taken and dropped (two atomic operations per
// resource; benchmarks/NOTES.md, "Figures behind the code": T2). The handle must name this device and a Var,
// as TF's LookupResource checks; anything else (shared-name TF1 variables, a wrong device or
// type, a deleted variable) goes through LookupResource itself, which keeps a reference in
// `owned_` and gives TF's own error.
class VarLookup {
 public:
  explicit VarLookup(tf::OpKernelContext* ctx)
      : ctx_(ctx), device_(ctx->device()->attributes().name()) {}

  // The handles of one resource list input, in order: each tensor of the list is one handle
  // or a vector of handles (an eager caller packs a repeated step's lists once, so the step
  // pays TF's per-input dispatch for three tensors, not 600). `n`: the number of gradients.
  absl::Status Add(const char* input, const char* label, int n, std::vector<VarRef>* out);
  // How many handles a resource list input holds (0 for an unused optional slot list).
  absl::Status Count(const char* input, int64_t* total) const;

 private:
  tf::OpKernelContext* ctx_;
  const std::string& device_;
  std::vector<tf::core::RefCountPtr<tf::Var>> owned_;
};

// Locks the step's variables in increasing mutex address, as TF's own multi-variable ops do
// (resource Vars' and ref variables' mutexes in the one order, as TF's ops lock a mix).
// The same variable twice would be updated twice (and would deadlock a naive lock): sorted, it
// is adjacent, and named. One per kernel: the order of the last step's Vars is kept, and a
// repeated step (the same Vars) skips the sort and the check. Var pointers alone fix the mutex
// addresses (a member of the Var), so the key stays right even for a Var freed and another
// allocated at its address; the pointers are never followed from here. A ref variable's key
// is its mutex itself.
class LockOrder {
 public:
  absl::Status Lock(const std::vector<VarRef>& refs, LockSet* locks);

 private:
  static const void* Key(const VarRef& r) {
    return r.var != nullptr ? static_cast<const void*>(r.var) : static_cast<const void*>(r.ref_mu);
  }
  tf::mutex mu_;
  std::vector<const void*> key_ TF_GUARDED_BY(mu_);
  std::vector<tf::mutex*> order_ TF_GUARDED_BY(mu_);
};

// Replaces a variable's buffer by a private copy when a reader still aliases it, so the
// in-place update cannot change a value someone already read (TF's copy-on-write rule). On GPU
// (gpu_stream not null) the copy is queued on the op's stream, ahead of the step's kernels.
absl::Status EnsureExclusive(tf::OpKernelContext* ctx, tf::Var* var, void* gpu_stream);

}  // namespace tfclip
