// tfclip._eager: a helper for tfclip/ops.py's repeated eager step. It knows nothing of TF (it
// takes the eager tensor type as an argument) but serves only the TF layer, so it lives outside
// the TF-free _core. Plain CPython API: one function needs no binding library (pybind11's headers
// were 9 s of the build's compile for it, 2026-12-04).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace {
// For tfclip/ops.py's repeated eager step, one pass in C over the (gradient, variable) pairs
// instead of several in Python (benchmarks/NOTES.md, "Figures behind the code": E1).
// Returns the gradients as a list when `pairs` is a list of 2-tuples whose variables are, in
// order, the very objects of the tuple `variables` and whose gradients are all exactly of type
// `grad_type`; else None (the caller then takes its general path). Nothing here knows TF.
PyObject* SplitRepeatedPairs(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"pairs", "variables", "grad_type", nullptr};
  PyObject *p = nullptr, *vs = nullptr, *grad_type = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:split_repeated_pairs", const_cast<char**>(kNames), &p, &vs,
                                   &grad_type)) {
    return nullptr;
  }
  if (!PyList_CheckExact(p) || !PyTuple_CheckExact(vs) || !PyType_Check(grad_type) ||
      PyList_GET_SIZE(p) != PyTuple_GET_SIZE(vs)) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PyList_GET_SIZE(p);
  const auto* type = reinterpret_cast<PyTypeObject*>(grad_type);
  // Allocated first: nothing after it can run Python code (a collection's finalizer) while
  // the loop holds borrowed items. Unfilled slots are NULL, which the list's dealloc allows.
  PyObject* grads = PyList_New(n);
  if (grads == nullptr) return nullptr;
  if (PyList_GET_SIZE(p) != n) {
    Py_DECREF(grads);
    Py_RETURN_NONE;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pair = PyList_GET_ITEM(p, i);
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        PyTuple_GET_ITEM(pair, 1) != PyTuple_GET_ITEM(vs, i) ||
        Py_TYPE(PyTuple_GET_ITEM(pair, 0)) != type) {
      Py_DECREF(grads);
      Py_RETURN_NONE;
    }
    PyObject* g = PyTuple_GET_ITEM(pair, 0);
    Py_INCREF(g);
    PyList_SET_ITEM(grads, i, g);
  }
  return grads;
}

PyMethodDef kMethods[] = {
    {"split_repeated_pairs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(SplitRepeatedPairs)),
     METH_VARARGS | METH_KEYWORDS,
     "split_repeated_pairs(pairs, variables, grad_type)\n\ntfclip.fused_clip_apply's repeated eager step: the "
     "gradients of a list of (gradient, variable) 2-tuples whose variables are, in order, the objects of the "
     "tuple `variables` and whose gradients are exactly of `grad_type`; else None."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_eager",
                       "tfclip's helper for the repeated eager step (tfclip/ops.py).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__eager() { return PyModule_Create(&kModule); }
