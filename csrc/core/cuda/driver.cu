// tfclip core, CUDA: the multi-tensor launcher, the entry points of csrc/core/cuda/driver.h:
// each op's launch sequence (plan, upload, norm, finalize, then scale or apply) and the counts
// tests read. The update rules are csrc/core/rules.h, applied per element by
// csrc/core/apply_elem.h, the clip modes csrc/core/clip.h: the same TFCLIP_HD bodies and dispatch
// the CPU driver runs.
//
// Built with --fmad=false (CMakeLists.txt): nvcc would otherwise contract a*b+c into FMA where
// the CPU build does not, and the apply pass would differ from the CPU in the last bit.
//
// The rooms of the CUDA driver (csrc/core/cuda/kernels.cuh has the list): this file launches;
// the step's plan, table layout and upload are cuda_plan.cu; the norm and AGC unit-sum kernels
// cuda_norm.cu; the finalize and scale kernels cuda_finalize.cu; the apply kernels cuda_apply.cu
// and cuda_sparse_apply.cu; what they share, cuda_kernels.cuh.
#include "csrc/core/cuda/kernels.cuh"

namespace tfclip {
namespace cuda {
namespace {

thread_local int g_last_launches = 0;
thread_local void* g_last_stream = nullptr;
thread_local int64_t g_last_blocks = 0;

// Norm (when needed) and finalize: the first two launches of every op.
std::string NormAndFinalize(const CudaPlan& p, const Table& t, const FinalizeArgs& a,
                            const void* dev_ws, cudaStream_t stream, const DevAgc* agc = nullptr) {
  const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
  if (agc != nullptr) {
    // AGC's pass instead of the norm kernel: unit sums, then each tensor's sum where the
    // finalize reads it, and the units' scales (csrc/core/agc.h). No host wait.
    const std::string e = LaunchAgcSums(t, *agc, stream, &g_last_launches);
    if (!e.empty()) return e;
  } else if (a.have_partials && nblocks > 0) {
    const std::string e = LaunchNorm(t, nblocks, stream, &g_last_launches);
    if (!e.empty()) return e;
  }
  const HParams* hp = reinterpret_cast<const HParams*>(static_cast<const char*>(dev_ws) +
                                                       Layout(p).off_hparams);
  return LaunchFinalize(t, a, hp, stream, &g_last_launches);
}

std::vector<DevTensor> TensorsFromViews(const TensorView* in, const TensorView* out, int n) {
  std::vector<DevTensor> ts(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    DevTensor& d = ts[i];
    std::memset(&d, 0, sizeof(d));
    d.grad = in[i].data;
    d.var = out != nullptr ? out[i].data : nullptr;
    d.size = in[i].size;
    d.grad_dtype = d.var_dtype = static_cast<int32_t>(in[i].dtype);
  }
  return ts;
}

// Plans a step, acquires its memory, runs fn(plan, host, device) and releases the memory on
// every path: the one place a step's workspace is handed back (in stream order).
template <typename Fn>
std::string WithStepMemory(const int64_t* sizes, int n, const SparsePlan* sparse, bool trust,
                           CudaStepMemory* mem, void* stream, Fn&& fn, const AgcPlan* agc = nullptr,
                           bool q8 = false, const FactoredPlan* fac = nullptr) {
  g_last_launches = 0;
  g_last_stream = stream;
  CudaPlan p;
  PlanCudaStep(sizes, n, &p, sparse, trust, agc, q8, fac);
  g_last_blocks = p.plan.num_blocks();
  void* host = nullptr;
  void* dev = nullptr;
  std::string e = mem->Acquire(p.host_bytes, p.device_bytes, &host, &dev);
  if (!e.empty()) return e;
  e = fn(p, host, dev);
  const std::string r = mem->Release();
  return e.empty() ? r : e;
}

std::vector<int64_t> ViewSizes(const TensorView* v, int n) {
  std::vector<int64_t> s(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) s[i] = v[i].size;
  return s;
}

// The norm and clip ops' steps: inputs (and outputs), no clip factors.
std::string ViewStep(const TensorView* in, const TensorView* out, int n, const FinalizeArgs& a,
                     CudaStepMemory* mem, void* stream_v, bool scale) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  const std::vector<int64_t> sizes = ViewSizes(in, n);
  return WithStepMemory(sizes.data(), n, nullptr, false, mem, stream_v,
                        [&](const CudaPlan& p, void* h, void* d) -> std::string {
    std::vector<DevTensor> dts = TensorsFromViews(in, out, n);
    ChunkRanges(p, dts.data());
    Table t;
    std::string e = Upload(p, dts.data(), nullptr, RuleKind::kSgd /* no constants */, h, d, stream, &t);
    if (!e.empty()) return e;
    t.factors = nullptr;
    e = NormAndFinalize(p, t, a, d, stream);
    if (!e.empty()) return e;
    const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
    if (scale && nblocks > 0) return LaunchScale(t, nblocks, stream, &g_last_launches);
    return "";
  });
}

}  // namespace

bool DeviceScalars::any() const {
  for (const double* p : hparams) {
    if (p != nullptr) return true;
  }
  return clip != nullptr || use_norm != nullptr || grad_scale != nullptr || rounding[0] != nullptr ||
         rounding[1] != nullptr || rounding[2] != nullptr || iterations != nullptr;
}

int LastStepLaunches() { return g_last_launches; }

int64_t LastStepBlocks() { return g_last_blocks; }

void* LastStepStream() { return g_last_stream; }

std::string CudaGlobalNorm(const TensorView* ts, int n, CudaStepMemory* mem,
                           const CudaOutputs& out, void* stream) {
  FinalizeArgs a{};
  a.cfg = ClipConfig{};
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = true;
  a.out = out;
  return ViewStep(ts, nullptr, n, a, mem, stream, false);
}

std::string CudaClipByGlobalNorm(const TensorView* in, const TensorView* outs, int n,
                                 double clip_norm, bool has_use_norm, double use_norm,
                                 const ClipOpScalars& dev, CudaStepMemory* mem,
                                 const CudaOutputs& out, void* stream) {
  FinalizeArgs a{};
  a.clip_op = dev;
  a.cfg.mode = ClipMode::kGlobalNorm;
  a.cfg.clip = clip_norm;
  a.cfg.has_use_norm = has_use_norm;
  a.cfg.use_norm = use_norm;
  a.cfg.policy = NonFinitePolicy::kPropagate;
  a.have_partials = !has_use_norm;
  a.round_norm = true;
  a.out = out;
  return ViewStep(in, outs, n, a, mem, stream, true);
}

std::string CudaClipApply(const StepArgs& args, const DeviceScalars& ds, CudaStepMemory* mem,
                          const CudaOutputs& out, void* stream_v, StepResult* r) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_v);
  *r = StepResult{};
  const int n = args.n;
  const ApplyTensor* ts = args.ts;
  // Host values are checked here, device ones by the finalize kernel (agc_eps is a host value).
  const bool on_device = ds.any();
  if (args.cfg.mode == ClipMode::kAgc) {
    ClipConfig eps_only = args.cfg;  // its eps alone (the clip may be on the device)
    eps_only.clip = 0.0;
    eps_only.has_use_norm = false;
    r->error = ValidateClipConfig(eps_only);
    if (!r->error.empty()) return "";
  }
  r->error = ValidateState(args);
  if (!r->error.empty()) return "";
  const bool factored = RuleFactored(args.rule);
  FactoredPlan fac_plan;
  if (factored) {
    r->error = PlanFactored(ts, n, &fac_plan);
    if (!r->error.empty()) return "";
  }
  HParams hp;
  if (!on_device) {
    r->error = StepHParams(args, &hp);
    if (!r->error.empty()) return "";
  } else {
    hp = args.hp;
  }
  SparsePlan sparse;
  r->error = PlanSparse(ts, n, args.rule, hp, args.lazy, kCudaChunkElems, &sparse,
                        ds.hparams[static_cast<int>(HP::weight_decay)] != nullptr);
  if (!r->error.empty()) return "";
  // AGC: with a clip given on the device (0 there is no clip: scales of 1) or a host one > 0.
  const bool agc = args.cfg.mode == ClipMode::kAgc && (ds.clip != nullptr || args.cfg.clip != 0.0);
  AgcPlan agc_plan;
  if (agc) {
    r->error = PlanAgc(ts, n, &agc_plan);
    if (!r->error.empty()) return "";
  }
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) sizes[i] = ts[i].grad_size();
  DevStatus status{};
  const bool trust = RuleTrustRatio(args.rule);
  bool q8 = false;
  for (int i = 0; i < n; ++i) q8 = q8 || ts[i].slot_storage == SlotStorage::kInt8;
  const std::string e = WithStepMemory(sizes.data(), n, &sparse, trust, mem, stream_v,
                                       [&](const CudaPlan& p, void* h, void* d) -> std::string {
    std::vector<DevTensor> dts(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      DevTensor& dt = dts[i];
      std::memset(&dt, 0, sizeof(dt));
      dt.var = ts[i].var;
      dt.grad = ts[i].grad;
      for (int k = 0; k < kMaxSlots; ++k) dt.slots[k] = ts[i].slots[k];
      dt.size = ts[i].grad_size();
      dt.width = ts[i].width;
      dt.sparse = ts[i].sparse ? 1 : 0;
      dt.var_dtype = static_cast<int32_t>(ts[i].var_dtype);
      dt.grad_dtype = static_cast<int32_t>(ts[i].grad_dtype);
      dt.bf16_slots = ts[i].slot_storage == SlotStorage::kBFloat16 ? 1 : 0;
      dt.q8_slots = ts[i].slot_storage == SlotStorage::kInt8 ? 1 : 0;
      for (int k = 0; k < kMaxSlots; ++k) dt.absmax[k] = ts[i].absmax[k];
      dt.fac_rows = ts[i].fac_rows;
      dt.fac_cols = ts[i].fac_cols;
      dt.fac_full_v = ts[i].fac_full_v ? 1 : 0;
    }
    ChunkRanges(p, dts.data());
    DevAgc dagc{};
    if (agc) {
      const HostLayout l = Layout(p);
      char* dc = static_cast<char*>(d);
      const size_t np = static_cast<size_t>(agc_plan.num_partials());
      const size_t nu = static_cast<size_t>(agc_plan.num_units());
      size_t o = p.off_agc;
      auto take = [&](size_t count) {
        double* q = reinterpret_cast<double*>(dc + o);
        o += Align256(sizeof(double) * count);
        return q;
      };
      dagc.part_g = take(np);
      dagc.part_w = take(np);
      dagc.unit_g = take(nu);
      dagc.unit_w = take(nu);
      dagc.unit_scale = take(nu);
      dagc.vsq = take(static_cast<size_t>(n));
      dagc.tiles = reinterpret_cast<const AgcTile*>(dc + l.off_tiles);
      dagc.ntiles = static_cast<int64_t>(agc_plan.tiles.size());
      dagc.unit_off = reinterpret_cast<const int64_t*>(dc + l.off_uoff);
      dagc.part_off = reinterpret_cast<const int64_t*>(dc + l.off_poff);
      dagc.blocks = reinterpret_cast<const int64_t*>(dc + l.off_ablocks);
      dagc.spans = reinterpret_cast<const SparseSpan*>(dc + l.off_spans);
      dagc.nspans = static_cast<int64_t>(sparse.spans.size());
      dagc.order = reinterpret_cast<const int64_t*>(dc + l.off_order);
      dagc.urows = reinterpret_cast<const int64_t*>(dc + l.off_urows);
      dagc.ustart = reinterpret_cast<const int64_t*>(dc + l.off_ustart);
      dagc.nunits = static_cast<int64_t>(nu);
      dagc.n = n;
      dagc.clip = args.cfg.clip;
      dagc.eps = args.cfg.agc_eps;
      dagc.dev_clip = ds.clip;
      dagc.clipped = out.clipped_units;
      for (int i = 0; i < n; ++i) {
        dts[i].unit_scale = dagc.unit_scale + agc_plan.unit_off[i];
        dts[i].units = agc_plan.unit_off[i + 1] - agc_plan.unit_off[i];
      }
    }
    Table t;
    std::string err = Upload(p, dts.data(), &hp, args.rule, h, d, stream, &t);
    if (!err.empty()) return err;
    FinalizeArgs a{};
    a.cfg = args.cfg;
    a.rule = args.rule;
    a.have_partials = NeedsNormPass(args.cfg);
    a.apply_step = true;
    a.ds = ds;
    a.read_scalars = on_device;
    a.out = out;
    a.zero_clipped = out.clipped_units != nullptr && !agc;
    err = NormAndFinalize(p, t, a, d, stream, agc ? &dagc : nullptr);
    if (!err.empty()) return err;
    const int nslots = NumSlots(args.rule, hp);
    const unsigned nblocks = static_cast<unsigned>(p.plan.num_blocks());
    const bool has_sparse = !sparse.empty();
    DevSparse dsp{};
    if (has_sparse) {
      const HostLayout l = Layout(p);
      const char* dc = static_cast<const char*>(d);
      dsp.units = reinterpret_cast<const SparseUnit*>(dc + l.off_units);
      dsp.order = reinterpret_cast<const int64_t*>(dc + l.off_order);
      dsp.urows = reinterpret_cast<const int64_t*>(dc + l.off_urows);
      dsp.ustart = reinterpret_cast<const int64_t*>(dc + l.off_ustart);
      dsp.nunits = static_cast<int64_t>(sparse.units.size());
    }
    if (factored) {
      const HostLayout l = Layout(p);
      char* dc = static_cast<char*>(d);
      DevFactored f{};
      f.tiles = reinterpret_cast<const FactoredTile*>(dc + l.off_ftiles);
      f.ntiles = static_cast<int64_t>(fac_plan.tiles.size());
      f.tile_off = reinterpret_cast<const int64_t*>(dc + l.off_ftile_off);
      f.row_off = reinterpret_cast<const int64_t*>(dc + l.off_frow_off);
      f.part_off = reinterpret_cast<const int64_t*>(dc + l.off_fpart_off);
      f.mat_off = reinterpret_cast<const int64_t*>(dc + l.off_fmat_off);
      size_t o = p.off_fac;
      auto take = [&](int64_t count) {
        double* q = reinterpret_cast<double*>(dc + o);
        o += Align256(sizeof(double) * static_cast<size_t>(count));
        return q;
      };
      f.rows = take(fac_plan.row_off.back());
      f.part = take(fac_plan.part_off.back());
      f.r_mean = take(fac_plan.mat_off.back());
      f.w_part = take(f.ntiles);
      f.u_part = take(f.ntiles);
      err = LaunchFactored(t, f, stream, &g_last_launches);
    } else if (nblocks > 0) {
      err = LaunchDenseApply(args.rule, nslots, t, nblocks, stream, &g_last_launches);
    }
    if (err.empty() && has_sparse) err = LaunchSparseApply(args.rule, nslots, t, dsp, stream, &g_last_launches);
    if (err.empty() && trust && n > 0) err = LaunchTrust(args.rule, nslots, t, dsp, nblocks, stream, &g_last_launches);
    if (!err.empty()) return err;
    if (args.cfg.policy == NonFinitePolicy::kRaise) {
      // The one host wait in tfclip: 'raise' must know before it returns.
      cudaError_t ce = cudaMemcpyAsync(&status, t.status, sizeof(DevStatus),
                                       cudaMemcpyDeviceToHost, stream);
      if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
      if (ce != cudaSuccess) return CudaError(ce, "reading the step's status");
    }
    return "";
  }, agc ? &agc_plan : nullptr, q8, factored ? &fac_plan : nullptr);
  if (!e.empty()) return e;
  if (args.cfg.policy == NonFinitePolicy::kRaise) {
    r->global_norm = status.norm;
    r->applied = status.apply != 0;
    r->nonfinite = !status.finite;
    if (status.bad > 0) {
      r->error = HParamError(status.bad - 1, status.bad_value) + " (read on the device); no variable was updated";
    } else if (status.bad == -6 || status.bad == -7) {
      r->error = RoundingMessage(-5 - status.bad, status.bad_value) + " (read on the device); no variable was updated";
    } else if (status.bad < 0) {
      ClipConfig c = args.cfg;
      c.clip = c.use_norm = status.bad_value;
      c.has_use_norm = status.bad == -2;
      if (status.bad == -2 || status.bad == -4) c.mode = ClipMode::kNone;
      if (status.bad == -4 || status.bad == -5) c.grad_scale = status.bad_value;
      r->error = ValidateClipConfig(c) + " (read on the device); no variable was updated";
    } else if (!status.finite) {
      r->error = NonFiniteError(status.norm);
    }
  }
  return "";
}

}  // namespace cuda
}  // namespace tfclip
