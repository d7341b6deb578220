// tfclip._core, NumPy adapter: the core's CPU driver on NumPy arrays, on threads of our own. It
// only checks (arrays.h), converts and calls csrc/core: the very code the TF CPU kernels call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/cpu/driver.h"
#include "csrc/core/cpu/kernels.h"
#include "csrc/core/validate.h"
#include "csrc/py/arrays.h"

namespace tfclip {
namespace {

std::atomic<int> g_num_threads{0};  // 0: hardware concurrency

int NumThreads() {
  const int n = g_num_threads.load();
  if (n > 0) return n;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Our own threads: contiguous blocks of units, one per thread; small work stays inline.
CpuExecutor PyExecutor() {
  return CpuExecutor{[](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t threads = CpuRanges(NumThreads(), n, cost, int64_t{1} << 16);
    if (threads <= 1) {
      fn(0, n);
      return;
    }
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads - 1));
    const int64_t per = (n + threads - 1) / threads;
    for (int64_t t = 1; t < threads; ++t) {
      const int64_t b = t * per, e = std::min(n, b + per);
      if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
    }
    fn(0, std::min(n, per));
    for (auto& th : pool) th.join();
  }};
}

// An optional output of one float64 per tensor: a writable C-contiguous NumPy float64 array of
// n elements, or None (null).
double* NormsOut(py::object o, size_t n) {
  if (o.is_none()) return nullptr;
  if (!py::isinstance<py::array>(o)) Fail("tensor_norms_out must be a NumPy float64 array");
  py::array a = py::reinterpret_borrow<py::array>(o);
  if (std::string(py::str(a.dtype().attr("name"))) != "float64" || !a.writeable() ||
      !(a.flags() & py::array::c_style) || static_cast<size_t>(a.size()) != n) {
    Fail("tensor_norms_out must be a writable C-contiguous NumPy float64 array of " +
         std::to_string(n) + " elements (one per tensor), got " +
         std::string(py::str(a.dtype().attr("name"))) + " with " + std::to_string(a.size()));
  }
  return static_cast<double*>(a.mutable_data());
}

// An optional output of one int64 per tensor (AGC's clipped units), or None (null).
int64_t* ClippedOut(py::object o, size_t n) {
  if (o.is_none()) return nullptr;
  if (!py::isinstance<py::array>(o)) Fail("agc_clipped_out must be a NumPy int64 array");
  py::array a = py::reinterpret_borrow<py::array>(o);
  if (std::string(py::str(a.dtype().attr("name"))) != "int64" || !a.writeable() ||
      !(a.flags() & py::array::c_style) || static_cast<size_t>(a.size()) != n) {
    Fail("agc_clipped_out must be a writable C-contiguous NumPy int64 array of " +
         std::to_string(n) + " elements (one per tensor), got " +
         std::string(py::str(a.dtype().attr("name"))) + " with " + std::to_string(a.size()));
  }
  return static_cast<int64_t*>(a.mutable_data());
}

double Norm(const std::vector<TensorView>& ts, double* tensor_norms = nullptr) {
  py::gil_scoped_release nogil;
  return GlobalNormCpu(ts.data(), static_cast<int>(ts.size()), PyExecutor(), tensor_norms);
}

double GlobalNorm(const py::list& t_list, py::object tensor_norms_out) {
  const auto views = Views(Arrays(t_list, "t_list", false, &FromNumpy), "t_list");
  return Norm(views, NormsOut(tensor_norms_out, views.size()));
}

py::tuple ClipByGlobalNorm(const py::list& t_list, double clip_norm, py::object use_norm) {
  const auto arrays = Arrays(t_list, "t_list", false, &FromNumpy);
  const auto in = Views(arrays, "t_list");
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) Fail(err);
  const double norm = use_norm.is_none() ? Norm(in) : use_norm.cast<double>();
  const double scale = GlobalClipScale(clip_norm, norm);
  py::list outs;
  std::vector<TensorView> out;
  for (size_t i = 0; i < arrays.size(); ++i) {
    py::array o = py::array(py::reinterpret_borrow<py::array>(t_list[i]).dtype(), arrays[i].shape);
    outs.append(o);
    out.push_back(View(o, Idx("out", i), true));
  }
  {
    py::gil_scoped_release nogil;
    ScaleListCpu(in.data(), out.data(), static_cast<int>(in.size()), scale, PyExecutor());
  }
  return py::make_tuple(outs, norm);
}


py::tuple ClipApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                    const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                    py::object clip, py::object use_norm, const std::string& nonfinite,
                    py::object indices, bool lazy, py::object iterations,
                    py::object tensor_norms_out, double agc_eps, py::object agc_clipped_out, py::object absmax,
                    double grad_scale, py::object rounding) {
  ApplyCall c = PrepareApply(rule_name, vars_l, grads_l, slots_l, hparams, clip_mode, clip,
                             use_norm, nonfinite, indices, lazy, &FromNumpy, absmax);
  c.cfg.agc_eps = agc_eps;
  c.cfg.grad_scale = grad_scale;
  if (!rounding.is_none()) {
    const auto r = RoundingPair(rounding);
    c.hp.stochastic_rounding = true;
    c.hp.rounding_seed = r.first.cast<double>();
    c.hp.rounding_step = r.second.cast<double>();
  }
  if (!c.device_scalars.empty()) Fail("clip_apply takes numbers; device arrays go to cuda_clip_apply");
  StepArgs args = c.Args();
  int64_t* counter = nullptr;
  if (!iterations.is_none()) {
    if (!py::isinstance<py::array>(iterations)) Fail("iterations must be a NumPy int64 array of one element");
    py::array a = py::reinterpret_borrow<py::array>(iterations);
    if (a.size() != 1 || std::string(py::str(a.dtype().attr("name"))) != "int64" || !a.writeable() ||
        !(a.flags() & py::array::c_style)) {
      Fail("iterations must be a writable NumPy int64 array of one element");
    }
    counter = static_cast<int64_t*>(a.mutable_data());
  }
  args.iterations = counter;
  args.tensor_norms = NormsOut(tensor_norms_out, static_cast<size_t>(args.n));
  args.agc_clipped = ClippedOut(agc_clipped_out, static_cast<size_t>(args.n));
  StepScratch scratch;
  StepResult r;
  {
    py::gil_scoped_release nogil;
    r = ClipApplyCpu(args, &scratch, PyExecutor());
  }
  if (!r.error.empty()) Fail(r.error);
  return py::make_tuple(r.global_norm, r.applied);
}

}  // namespace

void DefineNumpy(py::module_& m) {
  m.def("global_norm", &GlobalNorm, py::arg("t_list"), py::arg("tensor_norms_out") = py::none(),
        "Global L2 norm of a list of float arrays (fp64 accumulation, deterministic). "
        "tensor_norms_out: None or a float64 array of len(t_list), given each array's own norm "
        "from the same pass.");
  m.def("clip_by_global_norm", &ClipByGlobalNorm, py::arg("t_list"), py::arg("clip_norm"),
        py::arg("use_norm") = py::none(),
        "(clipped arrays, norm) with tf.clip_by_global_norm semantics.");
  m.def("clip_apply", &ClipApply, py::arg("rule"), py::arg("vars"), py::arg("grads"),
        py::arg("slots"), py::arg("hparams"), py::arg("clip_mode") = "none",
        py::arg("clip") = 0.0, py::arg("use_norm") = py::none(), py::arg("nonfinite") = "skip",
        py::arg("indices") = py::none(), py::arg("lazy") = false,
        py::arg("iterations") = py::none(), py::arg("tensor_norms_out") = py::none(),
        py::arg("agc_eps") = 1e-3, py::arg("agc_clipped_out") = py::none(), py::arg("absmax") = py::none(),
        py::arg("grad_scale") = 1.0, py::arg("rounding") = py::none(),
        "Clip and apply in place. rule: a name of rule_table(). slots: one list of arrays per "
        "slot the step uses (momentum: [accum]; adam: [m, v] or [m, v, vhat]). hparams: the "
        "rule's hyper-parameters and flags by name (rule_table(); missing ones take the table's "
        "default). clip 0: no clip. indices: None, or per variable None (dense) or an "
        "int32/int64 array of rows, grads[i] then holding the slices (IndexedSlices); lazy: "
        "sparse updates touch only those rows. iterations: None or a 1-element int64 array, a "
        "step counter: t = iterations + step, advanced when applied. tensor_norms_out: None or a "
        "float64 array of len(grads), given each gradient's pre-clip norm from the norm pass (NaN "
        "with use_norm), also when the step is skipped. clip_mode 'agc': adaptive gradient clipping, "
        "unit-wise (clip = the clip factor lambda; agc_eps the floor of a unit's weight norm; "
        "units: var.shape[-1], the whole tensor for rank <= 1); agc_clipped_out: None or an "
        "int64 array of len(grads), given each tensor's count of clipped units. absmax: None, or "
        "int8 optimizer state (csrc/core/quant8.h): one list per slot of one float32 array of "
        "ceil(size / 256) elements per variable (None for a variable whose state is not int8), "
        "that variable's slots[k][i] then a uint8 array of code indices. grad_scale: a factor on "
        "every gradient folded into the passes (a loss scale's 1/scale; ClipConfig::grad_scale): "
        "the norms are the scaled gradients'. rounding: None (bfloat16 variables round to "
        "nearest), or (seed, step), integers in [0, 2^53]: bfloat16 variables round "
        "stochastically, from Philox bits of (seed, step, the variable's position, the element) "
        "(csrc/core/rounding.h). Returns (global_norm, applied).");
  m.def("set_num_threads", [](int n) { g_num_threads = n; }, py::arg("n"),
        "Threads for the CPU passes (0: all cores). Results do not depend on it.");
  m.def("num_threads", &NumThreads);
  m.attr("chunk_elems") = kChunkElems;
  m.def("cpu_isa", [] { return std::string(ActiveCpuKernels().name); },
        "The instruction set the CPU passes run with (avx512, avx2 or baseline), picked at run "
        "time from the CPU (or TFCLIP_CPU_ISA).");
  m.def("cpu_isas", &SupportedCpuIsas, "The instruction-set variants this CPU can run, best first.");
  m.def("set_cpu_isa", [](const std::string& name) {
          if (!SetCpuIsa(name)) Fail("CPU variant '" + name + "' is not supported here");
        }, py::arg("name"), "Switch variant (every variant gives the same bits).");
}

}  // namespace tfclip
