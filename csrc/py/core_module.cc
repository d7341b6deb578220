// tfclip._core: the same core on NumPy arrays, without TensorFlow. It exists so the kernels
// can be tested and benchmarked on hosts that have no TF (the GPU hosts), and it must stay the
// very code path the TF kernels call: it only validates, converts and calls csrc/core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/cpu_driver.h"

namespace py = pybind11;

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
    constexpr int64_t kMinCyclesPerThread = 1 << 16;
    int64_t threads = std::min<int64_t>(NumThreads(), n);
    threads = std::min<int64_t>(threads, std::max<int64_t>(1, n * cost / kMinCyclesPerThread));
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

[[noreturn]] void Fail(const std::string& msg) { throw py::value_error(msg); }

DType ArrayDType(const py::array& a, const std::string& name) {
  const py::dtype dt = a.dtype();
  const std::string dname = py::str(dt.attr("name"));
  if (dname == "float16") return DType::kHalf;
  if (dname == "bfloat16") return DType::kBFloat16;
  if (dname == "float32") return DType::kFloat;
  if (dname == "float64") return DType::kDouble;
  Fail(name + " has dtype " + dname + "; only float16, bfloat16, float32 and float64");
}

TensorView View(const py::array& a, const std::string& name, bool writable) {
  if (!(a.flags() & py::array::c_style)) Fail(name + " must be C-contiguous");
  if (writable && !a.writeable()) Fail(name + " must be writable (it is updated in place)");
  TensorView v;
  v.dtype = ArrayDType(a, name);
  v.size = static_cast<int64_t>(a.size());
  v.data = const_cast<void*>(a.data());
  return v;
}

std::string Idx(const char* list, size_t i) {
  std::ostringstream os;
  os << list << "[" << i << "]";
  return os.str();
}

std::vector<py::array> AsArrays(const py::list& l, const char* what) {
  std::vector<py::array> out;
  for (size_t i = 0; i < l.size(); ++i) {
    if (!py::isinstance<py::array>(l[i])) Fail(Idx(what, i) + " is not a NumPy array");
    out.push_back(l[i].cast<py::array>());
  }
  return out;
}

std::vector<int64_t> Shape(const py::array& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

double Norm(const std::vector<TensorView>& ts) {
  py::gil_scoped_release nogil;
  return GlobalNormCpu(ts.data(), static_cast<int>(ts.size()), PyExecutor());
}

std::vector<TensorView> Views(const std::vector<py::array>& arrays, const char* what) {
  if (arrays.empty()) Fail(std::string(what) + " is empty; pass at least one array");
  std::vector<TensorView> v;
  for (size_t i = 0; i < arrays.size(); ++i) v.push_back(View(arrays[i], Idx(what, i), false));
  return v;
}

double GlobalNorm(const py::list& t_list) {
  const auto arrays = AsArrays(t_list, "t_list");
  return Norm(Views(arrays, "t_list"));
}

py::tuple ClipByGlobalNorm(const py::list& t_list, double clip_norm, py::object use_norm) {
  const auto arrays = AsArrays(t_list, "t_list");
  const auto in = Views(arrays, "t_list");
  const std::string err = ValidateClipNorm(clip_norm, "clip_norm");
  if (!err.empty()) Fail(err);
  const double norm = use_norm.is_none() ? Norm(in) : use_norm.cast<double>();
  const double scale = GlobalClipScale(clip_norm, norm);
  py::list outs;
  std::vector<TensorView> out;
  for (size_t i = 0; i < arrays.size(); ++i) {
    py::array o = py::array(arrays[i].dtype(), Shape(arrays[i]));
    outs.append(o);
    out.push_back(View(o, Idx("out", i), true));
  }
  {
    py::gil_scoped_release nogil;
    ScaleListCpu(in.data(), out.data(), static_cast<int>(in.size()), scale, PyExecutor());
  }
  return py::make_tuple(outs, norm);
}

HParams ParseHParams(RuleKind rule, const py::dict& d) {
  HParams hp;
  for (auto item : d) {
    const std::string k = py::str(item.first);
    if (k == "nesterov") { hp.nesterov = item.second.cast<bool>(); continue; }
    if (k == "amsgrad") { hp.amsgrad = item.second.cast<bool>(); continue; }
    const double v = item.second.cast<double>();
    if (k == "learning_rate" || k == "lr") hp.lr = v;
    else if (k == "momentum") hp.momentum = v;
    else if (k == "beta_1") hp.beta_1 = v;
    else if (k == "beta_2") hp.beta_2 = v;
    else if (k == "epsilon") hp.epsilon = v;
    else if (k == "weight_decay") hp.weight_decay = v;
    else if (k == "step") hp.step = v;
    else Fail("unknown hyper-parameter '" + k + "'");
  }
  const std::string e = ValidateHParams(rule, hp);
  if (!e.empty()) Fail(e);
  return hp;
}

py::tuple ClipApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                    const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                    double clip, py::object use_norm, const std::string& nonfinite) {
  RuleKind rule;
  if (!ParseRule(rule_name, &rule)) Fail("unknown rule '" + rule_name + "'");
  const HParams hp = ParseHParams(rule, hparams);
  ClipConfig cfg;
  if (!ParseClipMode(clip_mode, &cfg.mode)) Fail("unknown clip_mode '" + clip_mode + "'");
  if (!ParseNonFinitePolicy(nonfinite, &cfg.policy)) Fail("unknown nonfinite '" + nonfinite + "'");
  cfg.clip = clip;
  cfg.has_use_norm = !use_norm.is_none();
  if (cfg.has_use_norm) cfg.use_norm = use_norm.cast<double>();
  const std::string cerr = ValidateClipConfig(cfg);
  if (!cerr.empty()) Fail(cerr);

  const auto vars = AsArrays(vars_l, "vars");
  const auto grads = AsArrays(grads_l, "grads");
  if (vars.empty()) Fail("vars is empty; pass at least one variable");
  if (vars.size() != grads.size()) {
    Fail("got " + std::to_string(grads.size()) + " gradients for " + std::to_string(vars.size()) +
         " variables");
  }
  const int n = static_cast<int>(vars.size());
  const int nslots = NumSlots(rule, hp);
  if (static_cast<int>(slots_l.size()) != nslots) {
    Fail("rule '" + rule_name + "' takes " + std::to_string(nslots) + " slot lists, got " +
         std::to_string(slots_l.size()));
  }
  static const char* kSlotNames[kMaxSlots] = {"slots[0]", "slots[1]", "slots[2]"};
  std::vector<std::vector<py::array>> slots;
  for (int k = 0; k < nslots; ++k) {
    slots.push_back(AsArrays(slots_l[k].cast<py::list>(), kSlotNames[k]));
    if (static_cast<int>(slots[k].size()) != n) {
      Fail(std::string(kSlotNames[k]) + " has " + std::to_string(slots[k].size()) +
           " arrays for " + std::to_string(n) + " variables");
    }
  }
  std::vector<ApplyTensor> ts(n);
  std::map<const void*, std::string> seen;
  auto claim = [&](const py::array& a, const std::string& name) {
    if (a.size() == 0) return;  // empty arrays own no memory to alias
    auto it = seen.emplace(a.data(), name);
    if (!it.second) Fail(name + " and " + it.first->second + " are the same array; each may appear once");
  };
  for (int i = 0; i < n; ++i) {
    const std::string vn = Idx("vars", i), gn = Idx("grads", i);
    const TensorView v = View(vars[i], vn, true);
    const TensorView g = View(grads[i], gn, false);
    if (Shape(vars[i]) != Shape(grads[i])) {
      Fail(gn + " has shape " + std::string(py::str(grads[i].attr("shape"))) + " but " + vn +
           " has shape " + std::string(py::str(vars[i].attr("shape"))));
    }
    claim(vars[i], vn);
    ts[i].var = v.data;
    ts[i].var_dtype = v.dtype;
    ts[i].grad = g.data;
    ts[i].grad_dtype = g.dtype;
    ts[i].size = v.size;
    for (int k = 0; k < nslots; ++k) {
      const std::string sn = std::string(kSlotNames[k]) + "[" + std::to_string(i) + "]";
      const TensorView s = View(slots[k][i], sn, true);
      if (s.dtype != v.dtype || Shape(slots[k][i]) != Shape(vars[i])) {
        Fail(sn + " must have the dtype and shape of " + vn);
      }
      claim(slots[k][i], sn);
      ts[i].slots[k] = s.data;
    }
  }
  const std::string derr = ValidateApplyDTypes(ts.data(), n);
  if (!derr.empty()) Fail(derr);

  StepScratch scratch;
  StepResult r;
  {
    py::gil_scoped_release nogil;
    r = ClipApplyCpu(rule, hp, cfg, ts.data(), n, &scratch, PyExecutor());
  }
  if (r.nonfinite && cfg.policy == NonFinitePolicy::kRaise) {
    throw py::value_error("the global norm of the gradients is non-finite and nonfinite='raise'; "
                          "no variable was updated");
  }
  return py::make_tuple(r.global_norm, r.applied);
}

}  // namespace
}  // namespace tfclip

PYBIND11_MODULE(_core, m) {
  using namespace tfclip;
  m.doc() = "tfclip's core on NumPy arrays (no TensorFlow): the same CPU kernels the TF ops call.";
  m.def("global_norm", &GlobalNorm, py::arg("t_list"),
        "Global L2 norm of a list of float arrays (fp64 accumulation, deterministic).");
  m.def("clip_by_global_norm", &ClipByGlobalNorm, py::arg("t_list"), py::arg("clip_norm"),
        py::arg("use_norm") = py::none(),
        "(clipped arrays, norm) with tf.clip_by_global_norm semantics.");
  m.def("clip_apply", &ClipApply, py::arg("rule"), py::arg("vars"), py::arg("grads"),
        py::arg("slots"), py::arg("hparams"), py::arg("clip_mode") = "none",
        py::arg("clip") = 0.0, py::arg("use_norm") = py::none(), py::arg("nonfinite") = "skip",
        "Clip and apply in place. rule: sgd | momentum | keras_momentum | adam. slots: one list "
        "of arrays per slot (momentum: [accum]; adam: [m, v] or [m, v, vhat]). Returns "
        "(global_norm, applied).");
  m.def("set_num_threads", [](int n) { g_num_threads = n; }, py::arg("n"),
        "Threads for the CPU passes (0: all cores). Results do not depend on it.");
  m.def("num_threads", &NumThreads);
  m.attr("chunk_elems") = kChunkElems;
  m.attr("cuda") = false;
}
