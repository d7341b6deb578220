// tfclip core, CUDA: the host side of a step. Its plan (chunks packed into CUDA blocks, where
// each part of the tensor table lives in pinned host memory and in the device workspace), the
// table filled and uploaded in one copy, each tensor's chunk ranges, and the CUDA error text of
// every .cu file. Nothing here runs on the device. The launch sequences that use it:
// cuda_driver.cu; the kernels: cuda_norm.cu (norm, AGC sums), cuda_finalize.cu (finalize, the
// clip op's scale), cuda_apply.cu and cuda_sparse_apply.cu (apply); the workspace the table
// lives in: cuda_workspace.cu. Shared structures and declarations: csrc/core/cuda/kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {

std::string CudaError(cudaError_t e, const char* what) {
  std::ostringstream os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
     << ")";
  return os.str();
}

std::string Launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : CudaError(e, what);
}

namespace {

template <typename T>
size_t Bytes(const std::vector<T>& v) {
  return Align256(sizeof(T) * v.size());
}

}  // namespace

HostLayout Layout(const CudaPlan& p) {
  HostLayout l;
  l.off_hparams = Align256(sizeof(DevConsts));
  l.off_tensors = l.off_hparams + Align256(sizeof(HParams));
  l.off_chunks = l.off_tensors + Align256(sizeof(DevTensor) * static_cast<size_t>(p.n));
  l.off_blocks = l.off_chunks + Align256(sizeof(DevChunk) * p.plan.chunks.size());
  l.off_many = l.off_blocks + Bytes(p.plan.block_begin);
  l.off_units = l.off_many + Bytes(p.many);
  l.bytes = l.off_units;
  l.off_order = l.off_urows = l.off_ustart = l.bytes;
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    l.off_order = l.off_units + Bytes(sp.units);
    l.off_urows = l.off_order + Bytes(sp.order);
    l.off_ustart = l.off_urows + Bytes(sp.urows);
    l.bytes = l.off_ustart + Bytes(sp.ustart);
  }
  l.off_tiles = l.off_uoff = l.off_poff = l.off_ablocks = l.off_spans = l.bytes;
  if (p.agc != nullptr) {
    l.off_uoff = l.off_tiles + Bytes(p.agc->tiles);
    l.off_poff = l.off_uoff + Bytes(p.agc->unit_off);
    l.off_ablocks = l.off_poff + Bytes(p.agc->part_off);
    l.off_spans = l.off_ablocks + Bytes(p.agc->blocks);
    l.bytes = l.off_spans + (p.sparse != nullptr ? Bytes(p.sparse->spans) : 0);
  }
  l.off_codes = l.bytes;
  if (p.q8) l.bytes += Align256(sizeof(float) * 2 * kQuantCodeSize + 2 * sizeof(Q8Bands));
  l.off_ftiles = l.off_ftile_off = l.off_frow_off = l.off_fpart_off = l.off_fmat_off = l.bytes;
  if (p.fac != nullptr) {
    const FactoredPlan& f = *p.fac;
    l.off_ftile_off = l.off_ftiles + Bytes(f.tiles);
    l.off_frow_off = l.off_ftile_off + Bytes(f.tile_off);
    l.off_fpart_off = l.off_frow_off + Bytes(f.row_off);
    l.off_fmat_off = l.off_fpart_off + Bytes(f.part_off);
    l.bytes = l.off_fmat_off + Bytes(f.mat_off);
  }
  return l;
}

void PlanCudaStep(const int64_t* sizes, int n, CudaPlan* p, const SparsePlan* sparse, bool trust,
                  const AgcPlan* agc, bool q8, const FactoredPlan* fac) {
  p->n = n;
  p->fac = fac;
  p->q8 = q8;
  p->sparse = sparse;
  p->trust = trust;
  p->agc = agc;
  PlanChunks(sizes, n, kCudaChunkElems, &p->plan);
  PackCudaBlocks(&p->plan);
  p->many.clear();
  for (int i = 0; i < n; ++i) {  // PlanChunks cuts a tensor into ceil(size / kCudaChunkElems)
    if ((sizes[i] + kCudaChunkElems - 1) / kCudaChunkElems > kThreadChunks) p->many.push_back(i);
  }
  const size_t nchunks = p->plan.chunks.size();
  p->host_bytes = Layout(*p).bytes;
  p->off_partials = p->host_bytes;
  p->off_factors = p->off_partials + Align256(sizeof(double) * nchunks);
  p->off_status = p->off_factors + Align256(sizeof(ClipFactor) * static_cast<size_t>(n));
  p->device_bytes = p->off_status + Align256(sizeof(DevStatus));
  p->off_trust = p->off_trust_sums = p->device_bytes;
  if (trust) {
    const size_t nunits = sparse != nullptr ? sparse->units.size() : 0;
    p->off_trust_sums = p->off_trust + Align256(2 * sizeof(double) * (nchunks + nunits));
    p->device_bytes = p->off_trust_sums + Align256(2 * sizeof(double) * static_cast<size_t>(n));
  }
  p->off_agc = p->device_bytes;
  if (agc != nullptr) {
    const size_t np = static_cast<size_t>(agc->num_partials()), nu = static_cast<size_t>(agc->num_units());
    p->device_bytes += 2 * Align256(sizeof(double) * np) + 3 * Align256(sizeof(double) * nu) +
                       Align256(sizeof(double) * static_cast<size_t>(n));
  }
  p->off_fac = p->device_bytes;
  if (fac != nullptr) {
    p->device_bytes += Align256(sizeof(double) * static_cast<size_t>(fac->row_off.back())) +
                       Align256(sizeof(double) * static_cast<size_t>(fac->part_off.back())) +
                       Align256(sizeof(double) * static_cast<size_t>(fac->mat_off.back())) +
                       2 * Align256(sizeof(double) * fac->tiles.size());
  }
}

// Fills the host table, uploads it, and returns the device-side view of the workspace.
std::string Upload(const CudaPlan& p, const DevTensor* tensors, const HParams* hp, RuleKind rule,
                   void* host_ws, void* dev_ws, cudaStream_t stream, Table* t) {
  const HostLayout l = Layout(p);
  char* h = static_cast<char*>(host_ws);
  char* d = static_cast<char*>(dev_ws);
  DevConsts* hc0 = reinterpret_cast<DevConsts*>(h);
  std::memset(static_cast<void*>(hc0), 0, sizeof(DevConsts));
  if (hp != nullptr) {
    DispatchRule(rule, [&](auto rule_tag) { hc0->Set(MakeRuleConsts<decltype(rule_tag)>(*hp)); });
    std::memcpy(h + l.off_hparams, hp, sizeof(HParams));
  }
  std::memcpy(h + l.off_tensors, tensors, sizeof(DevTensor) * p.n);
  DevChunk* hc = reinterpret_cast<DevChunk*>(h + l.off_chunks);
  for (size_t c = 0; c < p.plan.chunks.size(); ++c) {
    const Chunk& ch = p.plan.chunks[c];
    hc[c] = DevChunk{ch.begin, ch.end, ch.tensor, 0};
    // (planted: a chunk followed by another of its tensor ends one element early)
    if (TFCLIP_PLANTED(CHUNK_END) && c + 1 < p.plan.chunks.size() && p.plan.chunks[c + 1].tensor == ch.tensor) {
      hc[c].end--;
    }
  }
  std::memcpy(h + l.off_blocks, p.plan.block_begin.data(), sizeof(int64_t) * p.plan.block_begin.size());
  if (!p.many.empty()) std::memcpy(h + l.off_many, p.many.data(), sizeof(int32_t) * p.many.size());
  if (p.sparse != nullptr && !p.sparse->empty()) {
    const SparsePlan& sp = *p.sparse;
    std::memcpy(h + l.off_units, sp.units.data(), sizeof(SparseUnit) * sp.units.size());
    std::memcpy(h + l.off_order, sp.order.data(), sizeof(int64_t) * sp.order.size());
    std::memcpy(h + l.off_urows, sp.urows.data(), sizeof(int64_t) * sp.urows.size());
    std::memcpy(h + l.off_ustart, sp.ustart.data(), sizeof(int64_t) * sp.ustart.size());
  }
  if (p.agc != nullptr) {
    const AgcPlan& ap = *p.agc;
    if (!ap.tiles.empty()) std::memcpy(h + l.off_tiles, ap.tiles.data(), sizeof(AgcTile) * ap.tiles.size());
    std::memcpy(h + l.off_uoff, ap.unit_off.data(), sizeof(int64_t) * ap.unit_off.size());
    std::memcpy(h + l.off_poff, ap.part_off.data(), sizeof(int64_t) * ap.part_off.size());
    if (!ap.blocks.empty()) std::memcpy(h + l.off_ablocks, ap.blocks.data(), sizeof(int64_t) * ap.blocks.size());
    if (p.sparse != nullptr && !p.sparse->spans.empty()) {
      std::memcpy(h + l.off_spans, p.sparse->spans.data(), sizeof(SparseSpan) * p.sparse->spans.size());
    }
  }
  if (p.fac != nullptr) {
    const FactoredPlan& f = *p.fac;
    if (!f.tiles.empty()) std::memcpy(h + l.off_ftiles, f.tiles.data(), sizeof(FactoredTile) * f.tiles.size());
    std::memcpy(h + l.off_ftile_off, f.tile_off.data(), sizeof(int64_t) * f.tile_off.size());
    std::memcpy(h + l.off_frow_off, f.row_off.data(), sizeof(int64_t) * f.row_off.size());
    std::memcpy(h + l.off_fpart_off, f.part_off.data(), sizeof(int64_t) * f.part_off.size());
    std::memcpy(h + l.off_fmat_off, f.mat_off.data(), sizeof(int64_t) * f.mat_off.size());
  }
  if (p.q8) {
    std::memcpy(h + l.off_codes, DynamicCode(true), sizeof(float) * kQuantCodeSize);
    std::memcpy(h + l.off_codes + sizeof(float) * kQuantCodeSize, DynamicCode(false),
                sizeof(float) * kQuantCodeSize);
    Q8Bands* bands = reinterpret_cast<Q8Bands*>(h + l.off_codes + sizeof(float) * 2 * kQuantCodeSize);
    bands[0] = *DynamicCodeIndex(true).bands;
    bands[1] = *DynamicCodeIndex(false).bands;
  }
  const cudaError_t e = cudaMemcpyAsync(d, h, l.bytes, cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return CudaError(e, "the tensor table upload");
  t->consts = reinterpret_cast<DevConsts*>(d);
  t->tensors = reinterpret_cast<const DevTensor*>(d + l.off_tensors);
  t->chunks = reinterpret_cast<const DevChunk*>(d + l.off_chunks);
  t->block_begin = reinterpret_cast<const int64_t*>(d + l.off_blocks);
  t->partials = reinterpret_cast<double*>(d + p.off_partials);
  t->factors = reinterpret_cast<ClipFactor*>(d + p.off_factors);
  t->status = reinterpret_cast<DevStatus*>(d + p.off_status);
  t->trust = p.trust ? reinterpret_cast<double*>(d + p.off_trust) : nullptr;
  t->trust_sums = p.trust ? reinterpret_cast<double*>(d + p.off_trust_sums) : nullptr;
  t->many = reinterpret_cast<const int32_t*>(d + l.off_many);
  t->nmany = static_cast<int>(p.many.size());
  t->codes = p.q8 ? reinterpret_cast<const float*>(d + l.off_codes) : nullptr;
  t->bands = p.q8 ? reinterpret_cast<const Q8Bands*>(d + l.off_codes + sizeof(float) * 2 * kQuantCodeSize) : nullptr;
  t->n = p.n;
  t->nchunks = static_cast<int64_t>(p.plan.chunks.size());
  return "";
}

// Per-tensor chunk ranges (chunks of a tensor are consecutive in the plan).
void ChunkRanges(const CudaPlan& p, DevTensor* ts) {
  for (int i = 0; i < p.n; ++i) {
    ts[i].first_chunk = 0;
    ts[i].num_chunks = 0;
  }
  const auto& ch = p.plan.chunks;
  for (size_t c = ch.size(); c-- > 0;) {
    ts[ch[c].tensor].first_chunk = static_cast<int64_t>(c);
    ts[ch[c].tensor].num_chunks++;
  }
  for (int i = 0; i < p.n; ++i) ts[i].first_unit = ts[i].num_units = 0;
  if (p.sparse != nullptr) {
    const auto& un = p.sparse->units;
    for (size_t x = un.size(); x-- > 0;) {
      ts[un[x].tensor].first_unit = static_cast<int64_t>(x);
      ts[un[x].tensor].num_units++;
    }
  }
}

void PackCudaBlocks(ChunkPlan* plan) {
  plan->block_begin.assign(1, 0);
  int in_block = 0;  // small chunks in the open block
  const int64_t nchunks = static_cast<int64_t>(plan->chunks.size());
  for (int64_t c = 0; c < nchunks; ++c) {
    const Chunk& ch = plan->chunks[c];
    if (ch.end - ch.begin > kWarpChunkElems) {
      if (in_block > 0) plan->block_begin.push_back(c);
      plan->block_begin.push_back(c + 1);
      in_block = 0;
    } else if (++in_block == kWarpsPerBlock) {
      plan->block_begin.push_back(c + 1);
      in_block = 0;
    }
  }
  if (in_block > 0) plan->block_begin.push_back(nchunks);
}

}  // namespace cuda
}  // namespace tfclip
