// tfclip._core: the same core on NumPy arrays and CUDA arrays, without TensorFlow. It exists so
// the kernels can be tested and benchmarked on hosts that have no TF (the GPU hosts), and it
// must stay the very code path the TF kernels call: numpy_adapter.cc and cuda_adapter.cc only
// check (arrays.h), convert and call csrc/core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "csrc/core/clip.h"
#include "csrc/core/cpu/kernels.h"
#include "csrc/core/hparams.h"
#include "csrc/core/quant8.h"
#include "csrc/core/rounding.h"
#include "csrc/core/rule_table.h"

namespace py = pybind11;

namespace tfclip {
void DefineNumpy(py::module_& m);
#if TFCLIP_WITH_CUDA
void DefineCuda(py::module_& m);
#endif

namespace {
// The rule table (csrc/core/rule_table.h) for the Python layer (tfclip/_engine/opcall.py): per rule its
// op, slot inputs, hyper-parameter inputs and flag attrs; and each hyper-parameter's default.
py::dict RuleTable() {
  py::dict rules;
  for (const RuleInfo& r : AllRules()) {
    py::list hps, flags;
    for (int k = 0; k < kNumHParams; ++k) {
      if ((r.hparams >> k) & 1u) hps.append(GetHParamInfo(static_cast<HP>(k)).input);
    }
    for (int k = 0; k < kNumFlags; ++k) {
      if ((r.flags >> k) & 1u) flags.append(FlagAttr(static_cast<Flag>(k)));
    }
    py::dict d;
    d["op"] = std::string("TfclipClipApply") + r.op;
    d["ref_op"] = std::string("TfclipClipApplyRef") + r.op;  // TF1 ref variables too (csrc/tf/ops.cc)
    d["slots"] = r.slots();
    d["min_slots"] = r.min_slots;
    py::list unsigned_slots;  // int8 state quantizes these with the unsigned code (quant8.h)
    const std::vector<std::string> names = r.slots();
    for (size_t k = 0; k < names.size(); ++k) {
      if ((r.unsigned_slots >> k) & 1u) unsigned_slots.append(names[k]);
    }
    d["unsigned_slots"] = unsigned_slots;
    d["factored"] = RuleFactored(r.kind);  // slots of other shapes (csrc/core/factored.h)
    d["hparams"] = hps;
    d["flags"] = flags;
    rules[r.name] = d;
  }
  return rules;
}

py::dict HParamTable() {
  py::dict out;
  for (int k = 0; k < kNumHParams; ++k) {
    const HParamInfo i = GetHParamInfo(static_cast<HP>(k));
    py::dict d;
    d["display"] = i.display;
    d["default"] = i.def;
    d["optional"] = i.def != i.def;
    d["lo"] = i.lo;
    d["lo_open"] = i.lo_open;
    d["hi"] = i.hi;
    d["hi_open"] = i.hi_open;
    out[i.input] = d;
  }
  return out;
}
// The numbers the XLA custom calls take for the rule, its flags, the clip mode and the non-finite
// policy (custom_calls.h's attributes), for a runtime other than TF's that calls the handlers
// (tests/xla_jax: JAX). The names are the Python layer's; the numbers the core's enums.
py::dict FfiCodes() {
  py::dict rules, flags, modes, policies;
  for (const RuleInfo& r : AllRules()) rules[r.name] = static_cast<int>(r.kind);
  for (int k = 0; k < kNumFlags; ++k) flags[FlagAttr(static_cast<Flag>(k))] = FlagBit(static_cast<Flag>(k));
  for (const char* name : {"none", "global_norm", "norm", "value", "agc"}) {
    ClipMode m;
    if (ParseClipMode(name, &m)) modes[name] = static_cast<int>(m);
  }
  for (const char* name : {"skip", "propagate", "raise"}) {
    NonFinitePolicy p;
    if (ParseNonFinitePolicy(name, &p)) policies[name] = static_cast<int>(p);
  }
  py::dict out;
  out["rules"] = rules;
  out["flags"] = flags;
  out["modes"] = modes;
  out["policies"] = policies;
  return out;
}

// 8-bit blockwise quantization (csrc/core/quant8.h) on NumPy arrays, for the tests and the
// checkpoint tools: the very functions the fused passes will call.
using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using U8 = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

int64_t CheckBlock(int64_t block) {
  if (block < 1) throw py::value_error("block must be >= 1, got " + std::to_string(block));
  return block;
}

py::tuple QuantizeBlockwisePy(F32 x, bool is_signed, int64_t block) {
  CheckBlock(block);
  const int64_t n = x.size();
  U8 q(x.request().shape);
  F32 absmax(std::vector<py::ssize_t>{static_cast<py::ssize_t>((n + block - 1) / block)});
  if (block == kQuantBlock) {  // the int8 state's block: the active CPU variant's tiles, as the passes run them
    ActiveCpuKernels().q8_narrow(x.data(), DynamicCodeIndex(is_signed), q.mutable_data(), absmax.mutable_data(), n);
  } else {
    QuantizeBlockwise(x.data(), n, block, is_signed, q.mutable_data(), absmax.mutable_data());
  }
  return py::make_tuple(q, absmax);
}

F32 DequantizeBlockwisePy(U8 q, F32 absmax, bool is_signed, int64_t block) {
  CheckBlock(block);
  const int64_t n = q.size();
  if (absmax.ndim() != 1 || absmax.size() != (n + block - 1) / block) {
    throw py::value_error("absmax must hold one value per block of " + std::to_string(block) + " elements: " +
                          std::to_string((n + block - 1) / block) + " for " + std::to_string(n) +
                          " elements, got shape (" + std::to_string(absmax.size()) + ",)");
  }
  F32 out(q.request().shape);
  if (block == kQuantBlock) {
    ActiveCpuKernels().q8_widen(q.data(), absmax.data(), DynamicCodeIndex(is_signed), out.mutable_data(), n);
  } else {
    DequantizeBlockwise(q.data(), absmax.data(), n, block, is_signed, out.mutable_data());
  }
  return out;
}

F32 DynamicCodePy(bool is_signed) {
  F32 out(std::vector<py::ssize_t>{kQuantCodeSize});
  std::copy(DynamicCode(is_signed), DynamicCode(is_signed) + kQuantCodeSize, out.mutable_data());
  return out;
}
}  // namespace
}  // namespace tfclip

PYBIND11_MODULE(_core, m) {
  using namespace tfclip;
  m.doc() = "tfclip's core on NumPy and CUDA arrays (no TensorFlow): the same kernels the TF ops call.";
  m.def("rule_table", &RuleTable, "Each rule's op, slot inputs, hyper-parameters and flags.");
  m.def("hparam_table", &HParamTable, "Each hyper-parameter's name in messages, default and range (lo, hi, open ends).");
  m.def("ffi_codes", &FfiCodes, "The XLA custom calls' numbers for rules, flags, clip modes and non-finite policies.");
  m.def("philox4x32_10",
        [](std::vector<uint32_t> counter, std::vector<uint32_t> key) {
          if (counter.size() != 4 || key.size() != 2) throw py::value_error("philox4x32_10 takes 4 counter and 2 key words");
          const Philox4 r = Philox4x32_10(Philox4{{counter[0], counter[1], counter[2], counter[3]}}, key[0], key[1]);
          return std::vector<uint32_t>{r.v[0], r.v[1], r.v[2], r.v[3]};
        },
        py::arg("counter"), py::arg("key"),
        "The core's Philox4x32-10 (csrc/core/rounding.h), stochastic rounding's generator: four "
        "output words of a counter's four words under a key's two.");
  m.def("dynamic_code", &DynamicCodePy, py::arg("signed"),
        "The 8-bit dynamic code (256 float32 values, ascending; csrc/core/quant8.h).");
  m.def("quantize_blockwise", &QuantizeBlockwisePy, py::arg("x"), py::arg("signed"),
        py::arg("block") = kQuantBlock,
        "x (float32) as (bytes, absmax per block): csrc/core/quant8.h. With the int8 state's block "
        "(256), the active CPU variant's tiles (csrc/core/cpu/pass_state_tiles.cc, set_cpu_isa), else the portable loop.");
  m.def("dequantize_blockwise", &DequantizeBlockwisePy, py::arg("q"), py::arg("absmax"), py::arg("signed"),
        py::arg("block") = kQuantBlock,
        "bytes and absmax back to float32: csrc/core/quant8.h (block 256: as quantize_blockwise).");
  m.def("q8_code_sweep",
        [](bool is_signed, int64_t stride, bool formula) {
          if (stride < 1) throw py::value_error("stride must be >= 1, got " + std::to_string(stride));
          int64_t bad = 0;
          float first_bad = 0.0f;
          int64_t checked = 0;
          {
            py::gil_scoped_release release;
            checked = Q8SweepCode(is_signed, stride, ActiveCpuKernels().q8_narrow, formula, &bad, &first_bad);
          }
          return py::make_tuple(checked, bad, first_bad);
        },
        py::arg("signed"), py::arg("stride") = 1, py::arg("formula") = false,
        "Every stride-th float in [-1, 1] through the active CPU variant's int8 tiles (and, with "
        "formula=True, NearestCodeFormula) against the count of the code's flips below it (csrc/core/quant8.h, "
        "Q8SweepCode): (floats checked, how many differed, the first that did).");
  DefineNumpy(m);
#if TFCLIP_WITH_CUDA
  DefineCuda(m);
#else
  m.attr("cuda") = false;
  m.attr("cuda_emulated") = false;
#endif
}
