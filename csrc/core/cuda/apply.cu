// tfclip core, CUDA: the dense apply kernel (each element's clipped gradient through the rule's
// ApplyElem, csrc/core/apply_elem.h) and a trust-ratio rule's two extra kernels. Shared
// structures and launch declarations: csrc/core/cuda/kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {
namespace {


// A range of a dense tensor: each element's gradient clipped (GradReader) and ApplyElem, four
// elements per thread with vector loads when every array is aligned for them. A trust-ratio
// rule's elements go to threads the same way whether aligned or not (groups of four from b,
// then the tail), so its sums depend on the values only, never on where a buffer starts.
//
// Out of line (as ApplyRangeAgc): the kernel calls one per chunk. Inlined into ApplyKernel, the
// ten dtype pairs and AGC's four made each kernel one function too large for ptxas, which took
// 85-90 s per SASS target for this file on the 2-core machine; out of line, about a quarter of
// that (issue 43). The constants and the clip factor come as pointers into the workspace, read
// once into registers here (a by-value or by-reference argument went through a 900-byte stack
// frame in the kernel, with spills; this way the kernel keeps no frame).
//
// S: the slots' storage type, V or, for a float variable's bf16 state, bfloat16 (G float or
// bfloat16, the gradients such a model has, with vector loads as above; any other gradient dtype
// through AnyGrad, element by element). Element by element, every slot load and store was 2 bytes
// a lane: BERT-base's bf16-state Adam kernel ran at 21% of the H200's DRAM throughput, 2.5x the
// float32-state kernel's time (ncu, 2026-12-04).
template <typename Rule, typename V, typename G, int kSlots, typename S = V>
TFCLIP_DEVICE_NOINLINE TrustAcc ApplyRange(const ConstsOf<Rule, V>* __restrict__ cp,
                                           const DevTensor& t, const ClipFactor* __restrict__ fp,
                                           int64_t b, int64_t e, Crew crew, int tensor) {
  using M = typename Elem<V>::Math;
  // (its stochastic rounding, rounding.h; planted: every tensor draws the first tensor's bits)
  const ConstsOf<Rule, V> c = WithTensor(*cp, TFCLIP_PLANTED(ROUND_TENSOR) ? 0 : tensor);
  const ClipFactor f = *fp;
  constexpr int kV = 4;
  TrustAcc acc;
  V* var = static_cast<V*>(t.var);
  S* s0 = static_cast<S*>(t.slots[0]);
  S* s1 = static_cast<S*>(t.slots[1]);
  S* s2 = static_cast<S*>(t.slots[2]);
  const GradReader<V, G> grad(t.grad, static_cast<DType>(t.grad_dtype), f);
  const int64_t nvec = (e - b) / kV;
  int64_t i0 = b;
  bool grouped = false;
  if constexpr (!std::is_same<G, AnyGrad>::value) {
    S* sp[kMaxSlots] = {s0, s1, s2};
    const G* graw = static_cast<const G*>(t.grad);
    bool aligned = reinterpret_cast<uintptr_t>(var + b) % (sizeof(V) * kV) == 0 &&
                   reinterpret_cast<uintptr_t>(graw + b) % (sizeof(G) * kV) == 0;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      aligned = aligned && reinterpret_cast<uintptr_t>(sp[k] + b) % (sizeof(S) * kV) == 0;
    }
    if (aligned) {
      for (int64_t j = crew.rank; j < nvec; j += crew.size) {
        const int64_t i = b + j * kV;
        Vec<V, kV> vv = *reinterpret_cast<const Vec<V, kV>*>(var + i);
        const Vec<G, kV> gv = *reinterpret_cast<const Vec<G, kV>*>(graw + i);
        Vec<S, kV> sv[kMaxSlots];
#pragma unroll
        for (int k = 0; k < kSlots; ++k) sv[k] = *reinterpret_cast<const Vec<S, kV>*>(sp[k] + i);
#pragma unroll
        for (int q = 0; q < kV; ++q) {
          const M g = ClipGrad<G, M>(gv.v[q], grad.scale, grad.lo, grad.hi);
          acc.Add(ApplyElem<Rule, kSlots>(c, DenseGrad<M>{g}, vv.v, sv[0].v, sv[1].v, sv[2].v, q, i));
        }
        if constexpr (!Rule::kTrustRatio) *reinterpret_cast<Vec<V, kV>*>(var + i) = vv;
        // (planted: bfloat16 state's last slot not stored back)
        constexpr bool kNarrow = !std::is_same<S, V>::value;
        const int stored = kSlots - (kNarrow && TFCLIP_PLANTED(BF16_SLOT_STORE) ? 1 : 0);
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          if (k < stored) *reinterpret_cast<Vec<S, kV>*>(sp[k] + i) = sv[k];
        }
      }
      grouped = true;
    }
  }
  if (Rule::kTrustRatio && !grouped) {  // the same groups, element by element
    for (int64_t j = crew.rank; j < nvec; j += crew.size) {
      for (int q = 0; q < kV; ++q) {
        const int64_t i = b + j * kV + q;
        acc.Add(ApplyElem<Rule, kSlots>(c, DenseGrad<M>{grad(i)}, var, s0, s1, s2, i));
      }
    }
    grouped = true;
  }
  if (grouped) i0 = b + nvec * kV;
  // (planted: the block's stride, where the crew may be a warp)
  const int64_t stride = TFCLIP_PLANTED(TAIL_STRIDE) ? kThreads : crew.size;
  for (int64_t i = i0 + crew.rank; i < e; i += stride) {
    acc.Add(ApplyElem<Rule, kSlots>(c, DenseGrad<M>{grad(i)}, var, s0, s1, s2, i));
  }
  return acc;
}

// A range of a dense tensor under AGC: each element's gradient times its unit's scale (in the
// gradient's dtype, cast to the variable's: CastClipGradAt, as the CPU's ApplyChunkAgc), a
// thread per element in crew order. The unit walks with the thread: one modulo per range, then
// a step of crew.size % units with one compare per element.
template <typename Rule, typename V, int kSlots, typename S = V>
TFCLIP_DEVICE_NOINLINE TrustAcc ApplyRangeAgc(const ConstsOf<Rule, V>* __restrict__ cp,
                                              const DevTensor& t, int64_t b, int64_t e, Crew crew,
                                              int tensor) {
  using M = typename Elem<V>::Math;
  const ConstsOf<Rule, V> c = WithTensor(*cp, tensor);
  TrustAcc acc;
  V* var = static_cast<V*>(t.var);
  S* s0 = static_cast<S*>(t.slots[0]);
  S* s1 = static_cast<S*>(t.slots[1]);
  S* s2 = static_cast<S*>(t.slots[2]);
  const int64_t units = t.units;
  const int64_t step = crew.size % units;
  // (planted: the unit index one off, element i takes unit (i + 1) % units's scale)
  int64_t col = (b + crew.rank + (TFCLIP_PLANTED(AGC_UNIT) ? 1 : 0)) % units;
  const DType gt = static_cast<DType>(t.grad_dtype);
  for (int64_t i = b + crew.rank; i < e; i += crew.size) {
    ClipFactor f;
    f.scale = t.unit_scale[col];
    const M g = CastClipGradAt<V>(t.grad, gt, i, f);
    acc.Add(ApplyElem<Rule, kSlots>(c, DenseGrad<M>{g}, var, s0, s1, s2, i));
    col += step;
    if (col >= units) col -= units;
  }
  return acc;
}

// The largest of v over the warp (butterflies: every lane gets it).
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// A range of a float variable with int8 state (SlotStorage::kInt8, csrc/core/quant8.h): one warp
// per quantization block of kQuantBlock elements (the crew's warps take blocks in turn), each
// lane kQuantBlock / 32 of its elements. The lane dequantizes them, steps them through
// ApplyElem in float with their clipped gradient (any dtype; AGC's unit scales as
// ApplyRangeAgc), keeps the new slot values in registers, and the warp's butterfly gives the
// block's absmax (AbsmaxAdd, order-free: the CPU's bits); then each element's nearest code. The
// range starts at a block (chunks start at multiples of kCudaChunkElems), so blocks are the
// CPU's.
template <typename Rule, int kSlots>
TFCLIP_DEVICE_NOINLINE void ApplyRangeQ8(const ConstsOf<Rule, float>* __restrict__ cp,
                                         const DevTensor& t, const ClipFactor* __restrict__ fp,
                                         const float* __restrict__ codes,
                                         const Q8Bands* __restrict__ bands, int64_t b, int64_t e,
                                         Crew crew) {
  static_assert(kQuantBlock % 32 == 0 && kCudaChunkElems % kQuantBlock == 0, "warps hold whole blocks");
  constexpr int kPer = static_cast<int>(kQuantBlock / 32);
  const ConstsOf<Rule, float> c = *cp;
  const ClipFactor f = *fp;
  float* var = static_cast<float*>(t.var);
  const GradReader<float, AnyGrad> grad(t.grad, static_cast<DType>(t.grad_dtype), f);
  const DType gt = static_cast<DType>(t.grad_dtype);
  const float* code[kMaxSlots];
  const Q8Bands* band[kMaxSlots];
  uint8_t* q[kMaxSlots];
#pragma unroll
  for (int k = 0; k < kMaxSlots; ++k) {
    // (planted: every slot with the signed code, the second moments too)
    const bool u = ((Rule::kUnsignedSlots >> k) & 1u) && !TFCLIP_PLANTED(Q8_CODE);
    code[k] = codes + (u ? kQuantCodeSize : 0);
    band[k] = bands + (u ? 1 : 0);
    q[k] = static_cast<uint8_t*>(t.slots[k]);
  }
  const int lane = crew.rank & 31, warp = crew.rank >> 5, warps = crew.size >> 5;
  const int64_t nblocks = QuantBlocks(e - b);
  for (int64_t qb = warp; qb < nblocks; qb += warps) {
    const int64_t base = b + qb * kQuantBlock;
    const int64_t blk = base / kQuantBlock;
    float s[kMaxSlots][kPer];
    float m[kMaxSlots] = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t i = base + lane + 32 * j;
      if (i >= e) continue;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) s[k][j] = code[k][q[k][i]] * t.absmax[k][blk];
      float g;
      if (t.unit_scale != nullptr) {  // AGC: element i's unit scale
        ClipFactor fu;
        fu.scale = t.unit_scale[i % t.units];
        g = CastClipGradAt<float>(t.grad, gt, i, fu);
      } else {
        g = grad(i);
      }
      float* sk[kMaxSlots] = {&s[0][j], kSlots > 1 ? &s[1][j] : nullptr, kSlots > 2 ? &s[2][j] : nullptr};
      ApplyElem<Rule, kSlots>(c, DenseGrad<float>{g}, var + i, sk[0], sk[1], sk[2], 0, i);
#pragma unroll
      for (int k = 0; k < kSlots; ++k) m[k] = AbsmaxAdd(m[k], s[k][j]);
    }
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      // (planted: the lane's own max, not the block's)
      const float am = AbsmaxOf(TFCLIP_PLANTED(Q8_WARP_MAX) ? m[k] : WarpMax(m[k]));
      if (lane == 0) t.absmax[k][blk] = am;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int64_t i = base + lane + 32 * j;
        // (the code's formula, quant8.h: the CPU's index, without a search through memory)
        const bool sg = !((Rule::kUnsignedSlots >> k) & 1u) || TFCLIP_PLANTED(Q8_CODE);
        if (i < e) q[k][i] = QuantizeOneFormula(*band[k], sg, QuantZeroIndex(sg), s[k][j], am);
      }
    }
  }
}

template <typename Rule, int kSlots>
__global__ void __launch_bounds__(kThreads) ApplyKernel(Table t) {
  // skip / raise / a bad value: nothing is written (planted: the flag ignored)
  if (!t.status->apply && !TFCLIP_PLANTED(SKIP_IGNORED)) return;
  const RuleConsts<Rule>* consts = t.consts->template As<Rule>();
  ForEachChunk(t, [&](int64_t c, Crew crew) {
    const DevChunk ch = t.chunks[c];
    const DevTensor& ten = t.tensors[ch.tensor];
    if (ten.sparse) {  // the sparse kernel applies it
      if (Rule::kTrustRatio && crew.rank == 0) t.trust[2 * c] = t.trust[2 * c + 1] = 0.0;
      return;
    }
    TrustAcc acc;
    if (ten.q8_slots) {  // a float variable with int8 state, a dense gradient (ValidateState)
      if constexpr (!Rule::kTrustRatio && kSlots > 0) {
        ApplyRangeQ8<Rule, kSlots>(&ConstsFor<float>(*consts), ten, &t.factors[ch.tensor], t.codes, t.bands, ch.begin,
                                   ch.end, crew);
      }
    } else if (ten.bf16_slots) {  // a float variable with bfloat16 slots (any gradient, any clip)
      const auto* cf = &ConstsFor<float>(*consts);
      const ClipFactor* fp = &t.factors[ch.tensor];
      const DType gt = static_cast<DType>(ten.grad_dtype);
      if (ten.unit_scale != nullptr) {
        acc = ApplyRangeAgc<Rule, float, kSlots, bfloat16>(cf, ten, ch.begin, ch.end, crew, ch.tensor);
      } else if (gt == DType::kFloat) {
        acc = ApplyRange<Rule, float, float, kSlots, bfloat16>(cf, ten, fp, ch.begin, ch.end, crew, ch.tensor);
      } else if (gt == DType::kBFloat16) {
        acc = ApplyRange<Rule, float, bfloat16, kSlots, bfloat16>(cf, ten, fp, ch.begin, ch.end, crew, ch.tensor);
      } else {
        acc = ApplyRange<Rule, float, AnyGrad, kSlots, bfloat16>(cf, ten, fp, ch.begin, ch.end, crew, ch.tensor);
      }
    } else if (ten.unit_scale != nullptr) {  // AGC: per-unit scales
      DispatchDType(static_cast<DType>(ten.var_dtype), [&](auto vtag) {
        using V = decltype(vtag);
        acc = ApplyRangeAgc<Rule, V, kSlots>(&ConstsFor<V>(*consts), ten, ch.begin,
                                             ch.end, crew, ch.tensor);
      });
    } else {
      DispatchPair(static_cast<DType>(ten.var_dtype), static_cast<DType>(ten.grad_dtype),
                   [&](auto vtag, auto gtag) {
                     using V = decltype(vtag);
                     acc = ApplyRange<Rule, V, decltype(gtag), kSlots>(
                         &ConstsFor<V>(*consts), ten, &t.factors[ch.tensor],
                         ch.begin, ch.end, crew, ch.tensor);
                   });
    }
    if constexpr (Rule::kTrustRatio) {
      const double w = crew.Sum(acc.w);
      const double u = crew.Sum(acc.u);
      if (crew.rank == 0) {
        t.trust[2 * c] = w;
        t.trust[2 * c + 1] = u;
      }
    }
  });
}

// ---------------------------------------------------------------- kernels 5, 6: trust ratio
// A trust-ratio rule's per-tensor sums: one block per tensor, over its chunks' then its sparse
// units' sums (thread k takes entries k, k + kThreads, ...; BlockSum's fixed order).
__global__ void __launch_bounds__(kThreads) TrustSumKernel(Table t) {
  if (!t.status->apply) return;
  const DevTensor& ten = t.tensors[blockIdx.x];
  double w = 0.0, u = 0.0;
  for (int64_t k = threadIdx.x; k < ten.num_chunks + ten.num_units; k += kThreads) {
    const int64_t x = k < ten.num_chunks ? ten.first_chunk + k : t.nchunks + ten.first_unit + (k - ten.num_chunks);
    w += t.trust[2 * x];
    u += t.trust[2 * x + 1];
  }
  w = BlockSum<kThreads>(w);
  u = BlockSum<kThreads>(u);
  if (threadIdx.x == 0) {
    t.trust_sums[2 * blockIdx.x] = w;
    t.trust_sums[2 * blockIdx.x + 1] = u;
  }
}

// The variables: blocks [0, nblocks) the dense chunks' blocks, then one per sparse unit.
template <typename Rule, int kSlots>
__global__ void __launch_bounds__(kThreads) TrustKernel(Table t, DevSparse sp, int64_t nblocks) {
  if (!t.status->apply) return;
  if constexpr (Rule::kTrustRatio) {
    const RuleConsts<Rule> consts = *t.consts->template As<Rule>();
    auto range = [&](const DevTensor& ten, int tensor, int64_t b, int64_t e, Crew crew) {
      DispatchState(static_cast<DType>(ten.var_dtype), ten.bf16_slots != 0, [&](auto vtag, auto stag) {
        using V = decltype(vtag);
        using S = decltype(stag);
        const auto c = WithTensor(ConstsFor<V>(consts), tensor);
        const auto ratio_lr = TrustRatioLr(c, t.trust_sums[2 * tensor], t.trust_sums[2 * tensor + 1]);
        V* var = static_cast<V*>(ten.var);
        const S* s0 = static_cast<const S*>(ten.slots[0]);
        const S* s1 = static_cast<const S*>(ten.slots[1]);
        const S* s2 = static_cast<const S*>(ten.slots[2]);
        for (int64_t i = b + crew.rank; i < e; i += crew.size) {
          TrustElem<Rule, kSlots>(c, ratio_lr, var, s0, s1, s2, i);
        }
      });
    };
    if (static_cast<int64_t>(blockIdx.x) < nblocks) {
      ForEachChunk(t, [&](int64_t c, Crew crew) {
        const DevChunk ch = t.chunks[c];
        const DevTensor& ten = t.tensors[ch.tensor];
        if (!ten.sparse) range(ten, ch.tensor, ch.begin, ch.end, crew);
      });
    } else {
      const SparseUnit u = sp.units[blockIdx.x - nblocks];
      const DevTensor& ten = t.tensors[u.tensor];
      const int64_t w = ten.width;
      const Crew block{static_cast<int>(threadIdx.x), kThreads, false};
      if (u.all_rows) {
        range(ten, u.tensor, u.begin * w, u.end * w, block);
      } else {
        for (int64_t x = u.begin; x < u.end; ++x) {
          range(ten, u.tensor, sp.urows[x] * w, sp.urows[x] * w + w, block);
        }
      }
    }
  }
}

}  // namespace

std::string LaunchDenseApply(RuleKind rule, int nslots, const Table& t, unsigned nblocks,
                             cudaStream_t stream, int* launches) {
  return LaunchForRule(rule, nslots, "apply kernel", [&](auto rule_tag, auto slots_tag) {
    auto* apply_kernel = &ApplyKernel<decltype(rule_tag), decltype(slots_tag)::value>;
    TFCLIP_LAUNCH(apply_kernel, nblocks, kThreads, 0, stream)(t);
    ++*launches;
    return Launched("the apply kernel");
  });
}

std::string LaunchTrust(RuleKind rule, int nslots, const Table& t, const DevSparse& sp,
                        unsigned nblocks, cudaStream_t stream, int* launches) {
  TFCLIP_LAUNCH(TrustSumKernel, static_cast<unsigned>(t.n), kThreads, 0, stream)(t);
  ++*launches;
  std::string err = Launched("the trust-ratio sum kernel");
  const int64_t tblocks = static_cast<int64_t>(nblocks) + sp.nunits;
  if (!err.empty() || tblocks == 0) return err;
  return LaunchForRule(rule, nslots, "trust-ratio kernel", [&](auto rule_tag, auto slots_tag) {
    auto* trust_kernel = &TrustKernel<decltype(rule_tag), decltype(slots_tag)::value>;
    TFCLIP_LAUNCH(trust_kernel, static_cast<unsigned>(tblocks), kThreads, 0, stream)(
        t, sp, static_cast<int64_t>(nblocks));
    ++*launches;
    return Launched("the trust-ratio apply kernel");
  });
}

}  // namespace cuda
}  // namespace tfclip
