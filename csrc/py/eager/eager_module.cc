// tfclip._eager: a helper for tfclip/ops.py's repeated eager step. It knows nothing of TF (it
// takes the eager tensor type as an argument) but serves only the TF layer, so it lives outside
// the TF-free _core.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace {
// For tfclip/ops.py's repeated eager step, one pass in C over the (gradient, variable) pairs
// instead of several in Python (benchmarks/NOTES.md, "Figures behind the code": E1).
// Returns the gradients as a list when `pairs` is a list of 2-tuples whose variables are, in
// order, the very objects of the tuple `variables` and whose gradients are all exactly of type
// `grad_type`; else None (the caller then takes its general path). Nothing here knows TF.
py::object SplitRepeatedPairs(py::handle pairs, py::handle variables, py::handle grad_type) {
  PyObject* p = pairs.ptr();
  PyObject* vs = variables.ptr();
  if (!PyList_CheckExact(p) || !PyTuple_CheckExact(vs) || !PyType_Check(grad_type.ptr()) ||
      PyList_GET_SIZE(p) != PyTuple_GET_SIZE(vs)) {
    return py::none();
  }
  const Py_ssize_t n = PyList_GET_SIZE(p);
  const auto* type = reinterpret_cast<PyTypeObject*>(grad_type.ptr());
  // Allocated first: nothing after it can run Python code (a collection's finalizer) while
  // the loop holds borrowed items. Unfilled slots are NULL, which the list's dealloc allows.
  py::list grads(n);
  if (PyList_GET_SIZE(p) != n) return py::none();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pair = PyList_GET_ITEM(p, i);
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        PyTuple_GET_ITEM(pair, 1) != PyTuple_GET_ITEM(vs, i) ||
        Py_TYPE(PyTuple_GET_ITEM(pair, 0)) != type) {
      return py::none();
    }
    PyObject* g = PyTuple_GET_ITEM(pair, 0);
    Py_INCREF(g);
    PyList_SET_ITEM(grads.ptr(), i, g);
  }
  return std::move(grads);
}


}  // namespace

PYBIND11_MODULE(_eager, m) {
  m.doc() = "tfclip's helper for the repeated eager step (tfclip/ops.py).";
  m.def("split_repeated_pairs", &SplitRepeatedPairs, py::arg("pairs"), py::arg("variables"),
        py::arg("grad_type"),
        "tfclip.fused_clip_apply's repeated eager step: the gradients of a list of (gradient, "
        "variable) 2-tuples whose variables are, in order, the objects of the tuple `variables` "
        "and whose gradients are exactly of `grad_type`; else None.");
}
