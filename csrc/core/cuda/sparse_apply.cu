// tfclip core, CUDA: the apply kernel of IndexedSlices gradients (csrc/core/sparse.h's plan:
// one block per unit of rows). Shared structures and launch declarations:
// csrc/core/cuda/kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {
namespace {

// ---------------------------------------------------------------- kernel 4: sparse apply
// One block per unit of the sparse plan; a thread per (row, column) element. In an all-rows
// unit a row finds its slices by binary search over the unit's touched rows (once per row a
// thread visits, not per element).
// S: the slots' storage type (V, or bfloat16 for a float variable's bf16 state).
template <typename Rule, typename V, typename G, int kSlots, typename S = V>
__device__ TrustAcc SparseUnitDev(const ConstsOf<Rule, V>& c, const DevTensor& ten,
                                  const ClipFactor& f, const DevSparse& sp, const SparseUnit& u) {
  using M = typename Elem<V>::Math;
  TrustAcc acc;
  V* var = static_cast<V*>(ten.var);
  const GradReader<V, G> grad(ten.grad, static_cast<DType>(ten.grad_dtype), f);
  S* s0 = static_cast<S*>(ten.slots[0]);
  S* s1 = static_cast<S*>(ten.slots[1]);
  S* s2 = static_cast<S*>(ten.slots[2]);
  const int64_t w = ten.width;
  const int64_t total = (u.end - u.begin) * w;
  if (total == 0) return acc;
  // This thread's elements e = threadIdx.x + k * kThreads, walked as (r, col) = divmod(e, w)
  // with the divisions done once: each step moves r by kThreads / w and col by kThreads % w.
  const int64_t dr = kThreads / w, dc = kThreads % w;
  int64_t r = threadIdx.x / w, col = threadIdx.x % w;
  // AGC: the column's unit (w is a multiple of the units, so it moves with col alone).
  const int64_t units = ten.units > 0 ? ten.units : 1;
  const int64_t du = dc % units;
  int64_t ucol = col % units;
  // The row's slices [jb, je), looked up when r changes. In an all-rows unit rows only grow,
  // so each binary search over the touched rows starts where the last one ended.
  int64_t looked_up = -1, row = 0, jb = 0, je = 0, lo = u.u_begin;
  for (int64_t e = threadIdx.x; e < total; e += kThreads) {
    if (r != looked_up) {
      looked_up = r;
      if (u.all_rows) {
        row = u.begin + r;
        int64_t hi = u.u_end;
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo) / 2;
          if (sp.urows[mid] < row) lo = mid + 1;
          else hi = mid;
        }
        const bool touched = lo < u.u_end && sp.urows[lo] == row;
        jb = touched ? sp.ustart[lo] : 0;
        je = touched ? sp.ustart[lo + 1] : 0;
      } else {
        const int64_t x = u.begin + r;
        row = sp.urows[x];
        jb = sp.ustart[x];
        je = sp.ustart[x + 1];
      }
    }
    // AGC: the element's unit scale in place of the tensor's factor. One ApplyElem body for
    // both: the rule's body is most of this kernel's code, and each copy is compile time.
    GradReader<V, G> g = grad;
    if (ten.unit_scale != nullptr) {
      ClipFactor fu;
      fu.scale = ten.unit_scale[ucol];
      g = GradReader<V, G>(ten.grad, static_cast<DType>(ten.grad_dtype), fu);
    }
    const RowGrads<M, GradReader<V, G>> rg{g, w, col, sp.order, jb, je};
    acc.Add(ApplyElem<Rule, kSlots>(c, rg, var, s0, s1, s2, row * w + col));
    r += dr;
    col += dc;
    ucol += du;
    if (ucol >= units) ucol -= units;
    if (col >= w) {
      col -= w;
      ++r;
    }
  }
  return acc;
}

template <typename Rule, int kSlots>
__global__ void __launch_bounds__(kThreads) SparseApplyKernel(Table t, DevSparse sp) {
  if (!t.status->apply) return;
  const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
  const SparseUnit u = sp.units[blockIdx.x];
  const DevTensor& ten = t.tensors[u.tensor];
  const ClipFactor f = t.factors[u.tensor];
  TrustAcc acc;
  if (ten.bf16_slots) {  // a float variable with bfloat16 slots: any gradient
    acc = SparseUnitDev<Rule, float, AnyGrad, kSlots, bfloat16>(ConstsFor<float>(consts), ten, f, sp, u);
  } else {
    DispatchPair(static_cast<DType>(ten.var_dtype), static_cast<DType>(ten.grad_dtype),
                 [&](auto vtag, auto gtag) {
                   using V = decltype(vtag);
                   acc = SparseUnitDev<Rule, V, decltype(gtag), kSlots>(
                       WithTensor(ConstsFor<V>(consts), u.tensor), ten, f, sp, u);
                 });
  }
  if constexpr (Rule::kTrustRatio) {
    const double w = BlockSum<kThreads>(acc.w);
    const double uu = BlockSum<kThreads>(acc.u);
    if (threadIdx.x == 0) {
      const int64_t x = t.nchunks + blockIdx.x;
      t.trust[2 * x] = w;
      t.trust[2 * x + 1] = uu;
    }
  }
}
}  // namespace

std::string LaunchSparseApply(RuleKind rule, int nslots, const Table& t, const DevSparse& sp,
                              cudaStream_t stream, int* launches) {
  return LaunchForRule(rule, nslots, "sparse apply kernel", [&](auto rule_tag, auto slots_tag) {
    auto* sparse_apply_kernel = &SparseApplyKernel<decltype(rule_tag), decltype(slots_tag)::value>;
    TFCLIP_LAUNCH(sparse_apply_kernel, static_cast<unsigned>(sp.nunits), kThreads, 0, stream)(t, sp);
    ++*launches;
    return Launched("the sparse apply kernel");
  });
}

}  // namespace cuda
}  // namespace tfclip
