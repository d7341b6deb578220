"""The apply ops' registered signature (TfclipClipApply<Op>, TfclipClipApplyRef<Op>) against
references that do not come from the C++ description it is generated from
(csrc/core/apply_op.h): the outputs of `tfclip._engine.opcall.ClipApplyResult`, the keywords every Python
caller of `tfclip._engine.opcall.apply` passes (read from the source), the rule table as `_core` reports it, and
the defaults saved graphs rely on (written out here). A new attribute or output that one side
lacks fails here; docs/architecture.md ("Adding an apply-op attribute or output") lists the places.
"""
import ast
import inspect
import os
import re

import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from tfclip import _loader, clipping
from tfclip._engine import opcall as _opcall

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DESCRIPTION = os.path.join(ROOT, "csrc", "core", "apply_op.h")

# The outputs' dtypes and shapes as ClipApplyResult's docstring gives them (n: the gradients).
OUTPUTS = {"global_norm": (tf.float32, "scalar"), "applied": (tf.bool, "scalar"),
           "tensor_norms": (tf.float32, "per_grad"), "clipped_units": (tf.int64, "per_grad")}
_NO_DEFAULT = object()
# The common attributes, in the ops' order, after the inputs' own attrs and the rule's flags, with
# their defaults (None: a list(type) or count attr TF infers from the inputs).
COMMON_ATTRS = [("N", _NO_DEFAULT), ("Niterations", 0), ("Tgrad", _NO_DEFAULT),
                ("clip_mode", b"none"), ("agc_eps", 0.001), ("nonfinite", b"skip"),
                ("use_given_norm", False), ("Tindices", _NO_DEFAULT), ("sparse", []),
                ("lazy", False), ("sum_of_squares", False)]
REF_ATTRS = [("ref", [])]  # the ref op's, last
RESOURCE_ATTRS = [("Nabsmax", 0)]  # the resource op's, last (int8 state's absmax count)
COMMON_INPUTS_AFTER_HPARAMS = ["indices", "clip", "use_norm", "iterations"]
RESOURCE_INPUTS = ["absmax"]  # the resource op's, last: int8 state (a ref op's slots stay as they are)
TAIL_ATTRS = [("Ngrad_scale", 0), ("Nrounding", 0)]  # both ops', after those: the loss-scale unscale's
# count, stochastic rounding's (0 or 2)
LAST_ATTRS = [("var_offsets", [])]  # the resource op's, last: a range of each variable (-1 whole)
TAIL_INPUTS = ["grad_scale", "rounding"]  # both ops', last: [] or [the loss-scale unscale], [] or
# [seed, step]


def _ops():
    _loader.ops()  # registers the ops
    out = []
    for rule, row in sorted(_opcall.RULES.items()):
        for key, ref_op in (("op", False), ("ref_op", True)):
            name = row[key]
            op_def = op_def_registry.get(name)
            assert op_def is not None, f"{name} (rule {rule}) is not registered"
            out.append((rule, row, ref_op, op_def))
    return out


OPS = _ops()
IDS = [op_def.name for _, _, _, op_def in OPS]


def _default(attr):
    if not attr.HasField("default_value"):
        return _NO_DEFAULT
    v = attr.default_value
    which = v.WhichOneof("value")
    if which == "list":
        return list(v.list.i)
    return getattr(v, which)


@pytest.mark.parametrize("rule,row,ref_op,op_def", OPS, ids=IDS)
def test_outputs_are_clip_apply_result(rule, row, ref_op, op_def):
    assert [a.name for a in op_def.output_arg] == list(_opcall.ClipApplyResult._fields)
    for a in op_def.output_arg:
        assert tf.dtypes.as_dtype(a.type) == OUTPUTS[a.name][0], a.name


@pytest.mark.parametrize("rule,row,ref_op,op_def", OPS, ids=IDS)
def test_inputs_in_order(rule, row, ref_op, op_def):
    want = ["var"] + (["var_ref"] if ref_op else [])
    for s in row["slots"]:
        want += [s] + ([s + "_ref"] if ref_op else [])
    want += ["grad"] + list(row["hparams"]) + COMMON_INPUTS_AFTER_HPARAMS + ([] if ref_op else RESOURCE_INPUTS)
    want += TAIL_INPUTS
    assert [a.name for a in op_def.input_arg] == want


@pytest.mark.parametrize("rule,row,ref_op,op_def", OPS, ids=IDS)
def test_attrs_in_order_with_defaults(rule, row, ref_op, op_def):
    want = ["Tvar_ref"] if ref_op else []
    for s in row["slots"]:
        want += ["N_" + s] + (["T" + s + "_ref"] if ref_op else [])
    want += list(row["flags"])
    common = COMMON_ATTRS + (REF_ATTRS if ref_op else RESOURCE_ATTRS) + TAIL_ATTRS + ([] if ref_op else LAST_ATTRS)
    want += [n for n, _ in common]
    assert [a.name for a in op_def.attr] == want
    attrs = {a.name: a for a in op_def.attr}
    for name, default in common:
        got = _default(attrs[name])
        if isinstance(default, float):
            assert got == pytest.approx(default), name
        else:
            assert got is default if default is _NO_DEFAULT else got == default, name
    for f in row["flags"]:
        assert _default(attrs[f]) is False, f
    assert attrs["N"].minimum == (0 if ref_op else 1)


def _description():
    """The rows of csrc/core/apply_op.h's tables: attribute names, output names, input names."""
    with open(DESCRIPTION, encoding="utf-8") as f:
        text = f.read()

    def table(name):
        m = re.search(r"inline constexpr \w+ " + name + r"\[\] = \{(.*?)\n\};", text, re.S)
        assert m, f"{name} not found in {DESCRIPTION}"
        return m.group(1)

    attrs = re.findall(r"\b\w+Attr\(\"(\w+)\"", table("kApplyAttrs"))
    outputs = re.findall(r"\{\"(\w+)\", \"\w+\", ApplyOutputShape", table("kApplyOutputs"))
    inputs = re.findall(r"ApplyInputKind::kInput, \"(\w+)\"", table("kApplyInputs"))
    return attrs, outputs, inputs


def test_description_lists_what_the_ops_have():
    attrs, outputs, inputs = _description()
    assert attrs == [n for n, _ in COMMON_ATTRS + REF_ATTRS + RESOURCE_ATTRS + TAIL_ATTRS + LAST_ATTRS]
    assert outputs == list(_opcall.ClipApplyResult._fields)
    assert inputs == ["var", "var_ref", "grad"] + COMMON_INPUTS_AFTER_HPARAMS + RESOURCE_INPUTS + TAIL_INPUTS


def _splat_keys(node):
    """The keys a `**expr` argument of an _opcall.apply call brings."""
    if isinstance(node, ast.Name) and node.id == "sparse_kw":  # _opcall.op_grads / NO_SPARSE
        keys = set(_opcall.NO_SPARSE)
        assert set(_opcall.op_grads([tf.constant([1.0])])[1]) == keys
        return keys
    if isinstance(node, ast.Name) and node.id == "agc":  # clipping.AGC.op_args()
        return set(clipping.AGC(0.01).op_args()[2])
    keys = {k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys
            if isinstance(k, ast.Constant)}
    assert keys or isinstance(node, (ast.Dict, ast.IfExp)), f"unknown **{ast.dump(node)}"
    return keys


def _python_calls():
    """Per call of `tfclip._engine.opcall.apply` in tfclip/: (where, the keywords it passes to the op: not
    apply's own parameters, `refs`)."""
    own = {n for n, p in inspect.signature(_opcall.apply).parameters.items()
           if p.kind is not inspect.Parameter.VAR_KEYWORD}
    calls = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "tfclip")):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "apply" and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "_opcall"):
                    kws = set()
                    for k in node.keywords:
                        kws |= {k.arg} if k.arg is not None else _splat_keys(k.value)
                    calls.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", kws - own))
    return calls


def test_python_callers_pass_what_the_ops_take():
    calls = _python_calls()
    # The one caller: the fused step (tfclip/_engine/step.py, run), which every front door goes through.
    assert [where.split(":")[0] for where, _ in calls] == ["tfclip/_engine/step.py"], calls
    common_attrs = {n for n, _ in COMMON_ATTRS}
    for rule, row, ref_op, op_def in OPS:
        inputs = {a.name for a in op_def.input_arg}
        names = inputs | {a.name for a in op_def.attr}
        for where, kws in calls:
            # Everything a caller passes is an input or attr of every apply op (`absmax`, the
            # resource op's alone, _opcall.apply gives only to it) ...
            if ref_op:
                kws = kws - set(RESOURCE_INPUTS)
            assert kws <= names, f"{where} passes {sorted(kws - names)}, which {op_def.name} lacks"
            # ... and it passes every common input (they have no defaults).
            missing = set(COMMON_INPUTS_AFTER_HPARAMS) - kws
            assert not missing, f"{where} does not pass {sorted(missing)} to {op_def.name}"
            assert kws - set(COMMON_INPUTS_AFTER_HPARAMS + RESOURCE_INPUTS + TAIL_INPUTS) <= common_attrs, where


def test_output_shapes():
    """The shape function sets each output by its kind: scalar, or one entry per gradient."""
    with tf.Graph().as_default():
        n = 3
        vs = [tf.Variable(tf.zeros([2, 2])) for _ in range(n)]
        grads = [tf.ones([2, 2]) for _ in range(n)]
        out = _opcall.apply("sgd", [v.handle for v in vs], [], grads, {"lr": 0.1, "weight_decay": 0.0},
                            clip=_opcall.scalar(0.0, "clip"), use_norm=_opcall.scalar(0.0, "use_norm"),
                            iterations=[], **_opcall.NO_SPARSE)
        for name, t in zip(_opcall.ClipApplyResult._fields, out):
            want = [] if OUTPUTS[name][1] == "scalar" else [n]
            assert t.shape.as_list() == want, name
