// tfclip._core: the arrays a call hands over, checked (arrays.h).
#include "csrc/py/arrays.h"

#include "csrc/core/factored.h"
#include "csrc/core/quant8.h"

#include <cstring>
#include <map>
#include <sstream>

namespace tfclip {

[[noreturn]] void Fail(const std::string& msg) { throw py::value_error(msg); }

namespace {
DType ArrayDType(const py::array& a, const std::string& name) {
  const std::string dname = py::str(a.dtype().attr("name"));
  DType t;
  if (!DTypeFromNumpyName(dname.c_str(), &t)) {
    Fail(name + " has dtype " + dname + "; only " + NumpyDTypeNames());
  }
  return t;
}

}  // namespace

// What every array handed over must be: C-contiguous, and writable where it is updated in place.
static void CheckLayout(const py::array& a, const std::string& name, bool writable) {
  if (!(a.flags() & py::array::c_style)) Fail(name + " must be C-contiguous");
  if (writable && !a.writeable()) Fail(name + " must be writable (it is updated in place)");
}

TensorView View(const py::array& a, const std::string& name, bool writable) {
  CheckLayout(a, name, writable);
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

std::vector<int64_t> Shape(const py::array& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}


Array FromNumpy(const py::handle& h, const std::string& name, bool writable) {
  if (!py::isinstance<py::array>(h)) Fail(name + " is not a NumPy array");
  const py::array a = py::reinterpret_borrow<py::array>(h);
  if (std::string(py::str(a.dtype().attr("name"))) == "uint8") {  // int8 state's codes
    CheckLayout(a, name, writable);
    Array r;
    r.data = const_cast<void*>(a.data());
    r.shape = Shape(a);
    r.size = static_cast<int64_t>(a.size());
    r.name = name;
    r.codes = true;
    return r;
  }
  const TensorView v = View(a, name, writable);
  Array r;
  r.data = v.data;
  r.shape = Shape(a);
  r.size = v.size;
  r.dtype = v.dtype;
  r.name = name;
  return r;
}


void FailCodes(const Array& a) {
  Fail(a.name + " has dtype uint8; only " + NumpyDTypeNames() +
       " (uint8 only for int8 optimizer state's slots, with their absmax)");
}

std::vector<Array> Arrays(const py::list& l, const char* what, bool writable, MakeArray make,
                          bool codes_ok) {
  std::vector<Array> out;
  for (size_t i = 0; i < l.size(); ++i) {
    out.push_back(make(l[i], Idx(what, i), writable));
    if (out.back().codes && !codes_ok) FailCodes(out.back());
  }
  return out;
}

std::vector<TensorView> Views(const std::vector<Array>& arrays, const char* what) {
  if (arrays.empty()) Fail(std::string(what) + " is empty; pass at least one array");
  std::vector<TensorView> v;
  for (const Array& a : arrays) v.push_back(TensorView{a.data, a.size, a.dtype});
  return v;
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

// Everything a clip-and-apply call needs, validated: the same checks for NumPy and CUDA.
bool IsDeviceScalar(const py::handle& h) { return py::hasattr(h, "__cuda_array_interface__"); }

// The hyper-parameters and flags by their names in the rule table (hparams.h); "learning_rate"
// is lr. A name the rule does not take is an error; one not given takes the table's default.
HParams ParseHParams(RuleKind rule, const py::dict& d,
                     std::vector<std::pair<int, py::object>>* device) {
  HParams hp;
  const RuleInfo& info = GetRuleInfo(rule);
  for (auto item : d) {
    std::string k = py::str(item.first);
    if (k == "sum_of_squares") {
      hp.sum_of_squares = item.second.cast<bool>();
      continue;
    }
    if (k == "learning_rate") k = "lr";
    bool found = false;
    for (int f = 0; f < kNumFlags && !found; ++f) {
      if ((info.flags >> f) & 1u) {
        std::string attr = FlagAttr(static_cast<Flag>(f));
        if (k == attr || "use_" + k == attr) {
          hp.SetFlag(static_cast<Flag>(f), item.second.cast<bool>());
          found = true;
        }
      }
    }
    for (int h = 0; h < kNumHParams && !found; ++h) {
      if (((info.hparams >> h) & 1u) && k == GetHParamInfo(static_cast<HP>(h)).input) {
        if (IsDeviceScalar(item.second)) {
          device->emplace_back(h, py::reinterpret_borrow<py::object>(item.second));
        } else {
          hp.Set(static_cast<HP>(h), item.second.cast<double>());
        }
        found = true;
      }
    }
    if (!found) {
      std::string takes;
      for (int h = 0; h < kNumHParams; ++h) {
        if ((info.hparams >> h) & 1u) takes += std::string(takes.empty() ? "" : ", ") + GetHParamInfo(static_cast<HP>(h)).input;
      }
      for (int f = 0; f < kNumFlags; ++f) {
        if ((info.flags >> f) & 1u) takes += std::string(", ") + FlagAttr(static_cast<Flag>(f));
      }
      Fail("rule '" + std::string(info.name) + "' takes no hyper-parameter '" + k + "' (it takes " +
           takes + ", sum_of_squares)");
    }
  }
  return hp;
}


// indices[i] for an IndexedSlices gradient: a 1-D NumPy integer array (host memory, for the
// CUDA entry points too, as the TF GPU kernels take them); grads[i] holds its slices.
void SetSparse(const py::handle& h, const Array& var, const Array& values, size_t i,
               std::vector<int64_t>* rows, ApplyTensor* t) {
  const std::string name = Idx("indices", i);
  if (!py::isinstance<py::array>(h)) Fail(name + " is not a NumPy array (or None for a dense gradient)");
  const py::array a = py::reinterpret_borrow<py::array>(h);
  if (a.ndim() != 1) Fail(name + " must be 1-D, got " + std::to_string(a.ndim()) + " dimensions");
  if (var.shape.empty()) Fail(Idx("vars", i) + " is a scalar; a sparse gradient needs rank >= 1");
  std::vector<int64_t> want{static_cast<int64_t>(a.size())};
  want.insert(want.end(), var.shape.begin() + 1, var.shape.end());
  if (values.shape != want) {
    Fail(values.name + " has shape " + ShapeStr(values.shape) + "; with " + std::to_string(a.size()) +
         " indices and " + var.name + " of shape " + ShapeStr(var.shape) + " it must be " + ShapeStr(want));
  }
  const std::string dt = py::str(a.dtype().attr("name"));
  rows->resize(static_cast<size_t>(a.size()));
  if (dt == "int64") {
    const auto v = a.cast<py::array_t<int64_t, py::array::c_style>>();
    std::memcpy(rows->data(), v.data(), sizeof(int64_t) * rows->size());
  } else if (dt == "int32") {
    const auto v = a.cast<py::array_t<int32_t, py::array::c_style>>();
    for (size_t j = 0; j < rows->size(); ++j) (*rows)[j] = v.data()[j];
  } else {
    Fail(name + " has dtype " + dt + "; indices must be int32 or int64");
  }
  t->sparse = true;
  t->indices = rows->data();
  t->nnz = static_cast<int64_t>(a.size());
  t->rows = var.shape[0];
  t->width = 1;
  for (size_t d = 1; d < var.shape.size(); ++d) t->width *= var.shape[d];
}

std::pair<py::object, py::object> RoundingPair(const py::object& rounding) {
  if (!py::isinstance<py::tuple>(rounding) && !py::isinstance<py::list>(rounding)) {
    Fail("rounding must be None or a (seed, step) pair");
  }
  py::sequence s = py::reinterpret_borrow<py::sequence>(rounding);
  if (py::len(s) != 2) Fail("rounding must be None or a (seed, step) pair, got " + std::to_string(py::len(s)) + " values");
  return {s[0], s[1]};
}

ApplyCall PrepareApply(const std::string& rule_name, const py::list& vars_l, const py::list& grads_l,
                       const py::list& slots_l, const py::dict& hparams, const std::string& clip_mode,
                       py::object clip, py::object use_norm, const std::string& nonfinite,
                       const py::object& indices_o, bool lazy, MakeArray make,
                       const py::object& absmax_o) {
  ApplyCall call;
  call.lazy = lazy;
  if (!ParseRule(rule_name, &call.rule)) Fail("unknown rule '" + rule_name + "'");
  call.hp = ParseHParams(call.rule, hparams, &call.device_scalars);
  ClipConfig& cfg = call.cfg;
  if (!ParseClipMode(clip_mode, &cfg.mode)) Fail("unknown clip_mode '" + clip_mode + "'");
  if (!ParseNonFinitePolicy(nonfinite, &cfg.policy)) Fail("unknown nonfinite '" + nonfinite + "'");
  if (IsDeviceScalar(clip)) call.device_scalars.emplace_back(kClipScalar, clip);
  else cfg.clip = clip.cast<double>();
  cfg.has_use_norm = !use_norm.is_none();
  if (IsDeviceScalar(use_norm)) call.device_scalars.emplace_back(kUseNormScalar, use_norm);
  else if (cfg.has_use_norm) cfg.use_norm = use_norm.cast<double>();
  // (Values are checked by the core step, host ones before anything runs.)

  const auto vars = Arrays(vars_l, "vars", true, make);
  const auto grads = Arrays(grads_l, "grads", false, make);
  if (vars.empty()) Fail("vars is empty; pass at least one variable");
  if (vars.size() != grads.size()) {
    Fail("got " + std::to_string(grads.size()) + " gradients for " + std::to_string(vars.size()) +
         " variables");
  }
  const int n = static_cast<int>(vars.size());
  const int nslots = NumSlots(call.rule, call.hp);
  if (static_cast<int>(slots_l.size()) != nslots) {
    Fail("rule '" + rule_name + "' takes " + std::to_string(nslots) + " slot lists, got " +
         std::to_string(slots_l.size()));
  }
  static const char* kSlotNames[kMaxSlots] = {"slots[0]", "slots[1]", "slots[2]"};
  std::vector<std::vector<Array>> slots;
  for (int k = 0; k < nslots; ++k) {
    slots.push_back(Arrays(slots_l[k].cast<py::list>(), kSlotNames[k], true, make, true));
    if (static_cast<int>(slots[k].size()) != n) {
      Fail(std::string(kSlotNames[k]) + " has " + std::to_string(slots[k].size()) +
           " arrays for " + std::to_string(n) + " variables");
    }
  }
  // int8 state: absmax[k][i], a float32 array of ceil(size / kQuantBlock) elements for slot k of
  // variable i (its codes a uint8 array of the variable's shape), or None for a variable whose
  // slots are not int8.
  static const char* kAbsmaxNames[kMaxSlots] = {"absmax[0]", "absmax[1]", "absmax[2]"};
  std::vector<std::vector<py::object>> absmax(static_cast<size_t>(nslots),
                                              std::vector<py::object>(static_cast<size_t>(n), py::none()));
  if (!absmax_o.is_none()) {
    const py::list al = absmax_o.cast<py::list>();
    if (static_cast<int>(al.size()) != nslots) {
      Fail("absmax has " + std::to_string(al.size()) + " lists for the " + std::to_string(nslots) +
           " slots of rule '" + rule_name + "' (one per slot, like slots)");
    }
    for (int k = 0; k < nslots; ++k) {
      const py::list ak = al[k].cast<py::list>();
      if (static_cast<int>(ak.size()) != n) {
        Fail(std::string(kAbsmaxNames[k]) + " has " + std::to_string(ak.size()) + " entries for " +
             std::to_string(n) + " variables (None for a variable whose state is not int8)");
      }
      for (int i = 0; i < n; ++i) absmax[k][i] = ak[i];
    }
  }
  py::list indices;
  if (!indices_o.is_none()) {
    indices = indices_o.cast<py::list>();
    if (static_cast<int>(indices.size()) != n) {
      Fail("indices has " + std::to_string(indices.size()) + " entries for " + std::to_string(n) +
           " variables (None for each dense gradient)");
    }
  }
  call.ts.resize(n);
  call.rows.resize(n);
  std::map<const void*, std::string> seen;
  auto claim = [&](const Array& a) {
    if (a.size == 0) return;  // empty arrays own no memory to alias
    auto it = seen.emplace(a.data, a.name);
    if (!it.second) Fail(a.name + " and " + it.first->second + " are the same array; each may appear once");
  };
  for (int i = 0; i < n; ++i) {
    const Array& v = vars[i];
    const Array& g = grads[i];
    const bool sparse = !indices_o.is_none() && !indices[i].is_none();
    if (sparse) {
      SetSparse(indices[i], v, g, i, &call.rows[i], &call.ts[i]);
    } else if (v.shape != g.shape) {
      Fail(g.name + " has shape " + ShapeStr(g.shape) + " but " + v.name + " has shape " +
           ShapeStr(v.shape));
    }
    claim(v);
    ApplyTensor& t = call.ts[i];
    t.var = v.data;
    t.var_dtype = v.dtype;
    t.grad = g.data;
    t.grad_dtype = g.dtype;
    t.size = v.size;
    t.units = v.shape.size() >= 2 ? v.shape.back() : 1;  // AGC's units (csrc/core/agc.h)
    const bool factored = RuleFactored(call.rule);
    if (factored) SetFactoredDims(v.shape, &t);
    for (int k = 0; k < nslots; ++k) {
      const Array& s = slots[k][i];
      SlotStorage storage;
      const bool q8 = !absmax[k][i].is_none();
      if (q8 || s.codes) {
        if (!q8) Fail(s.name + " is uint8 (int8 state's codes) but " + Idx(kAbsmaxNames[k], i) + " is None");
        if (v.codes || v.dtype != DType::kFloat) Fail(v.name + ": int8 optimizer state is for float32 variables");
        if (!s.codes || s.shape != v.shape) {
          Fail(s.name + " must be a uint8 array of the shape of " + v.name + " (int8 state's codes)");
        }
        const Array am = make(absmax[k][i], Idx(kAbsmaxNames[k], i), true);
        const int64_t blocks = QuantBlocks(v.size);
        if (am.codes || am.dtype != DType::kFloat || am.size != blocks) {
          Fail(am.name + " must be a float32 array of " + std::to_string(blocks) + " elements (one per " +
               std::to_string(kQuantBlock) + " of " + v.name + ")");
        }
        if (k > 0 && t.slot_storage != SlotStorage::kInt8) {
          Fail(s.name + " is int8 state but " + slots[0][i].name + " is not; a variable's slots share one dtype");
        }
        t.slot_storage = SlotStorage::kInt8;
        claim(s);
        claim(am);
        t.slots[k] = s.data;
        t.absmax[k] = static_cast<float*>(am.data);
        call.streams.push_back(am.stream);
        continue;
      }
      if (factored) {  // Adafactor's r, c, v (csrc/core/factored.h)
        bool placeholder = false;
        const std::string e = FactoredSlotShape(k, v.shape, s.shape, &placeholder);
        if (!e.empty()) Fail(s.name + " " + e);
        if (k == 2) t.fac_full_v = !placeholder;
        if (placeholder) continue;  // neither read nor written: any dtype
      }
      if (!SlotStorageOf(v.dtype, s.dtype, &storage) || (!factored && s.shape != v.shape)) {
        Fail(s.name + " must have the shape of " + v.name + " and its dtype (or bfloat16 for a float32 "
             "variable's state)");
      }
      if (k > 0 && storage != t.slot_storage) {
        Fail(s.name + " is " + DTypeName(s.dtype) + " but " + slots[0][i].name + " is " +
             (slots[0][i].codes ? "int8 state" : DTypeName(slots[0][i].dtype)) +
             "; a variable's slots share one dtype");
      }
      t.slot_storage = storage;
      claim(s);
      t.slots[k] = s.data;
    }
  }
  for (const auto* l : {&vars, &grads}) {
    for (const Array& a : *l) call.streams.push_back(a.stream);
  }
  for (const auto& l : slots) {
    for (const Array& a : l) call.streams.push_back(a.stream);
  }
  return call;
}

[[noreturn]] void FailNonFinite() {
  throw py::value_error("the global norm of the gradients is non-finite and nonfinite='raise'; "
                        "no variable was updated");
}

StepArgs ApplyCall::Args() const {
  StepArgs a;
  a.rule = rule;
  a.hp = hp;
  a.cfg = cfg;
  a.ts = ts.data();
  a.n = static_cast<int>(ts.size());
  a.lazy = lazy;
  return a;
}

}  // namespace tfclip
