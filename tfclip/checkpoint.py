"""Move a checkpoint between optimizer-state precisions: `tfclip.convert_checkpoint`.

A checkpoint restores only into variables of the dtypes it was saved with, so a run whose
optimizer changes `state_dtype` (a stock float32 Adam checkpoint resumed with
`tfclip.keras.Adam(state_dtype="bfloat16")`, or back) converts the checkpoint first::

    tfclip.convert_checkpoint(old_path, new_path, like=tf.train.Checkpoint(model=model, optimizer=opt))
    tf.train.Checkpoint(model=model, optimizer=opt).restore(new_path)

`like` says the layout wanted: a `tf.train.Checkpoint` over the objects that will restore it (the
optimizer built: `opt.build(model.trainable_variables)`), or the path of a checkpoint written in
that layout (a TF1 `Saver`'s too). Every tensor of the source is written under its own name; one
that is float32 in one layout and bfloat16 in the other is converted: to bfloat16 rounded to
nearest even (as the fused step stores it), to float32 exactly. The object graph is the source's,
so the new checkpoint restores as the old one did (deferred slot restoration included). Also on
the command line: `python -m tfclip.checkpoint OLD NEW --like PATH`.

int8 state (`state_dtype="int8"`) holds more than a dtype: each slot is uint8 codes with a float32
absmax variable beside it, quantized with the signed or the unsigned code, and the absmax
variables are optimizer variables of their own (Keras lists them among the others). So a layout
with int8 state is described by live objects, a `tf.train.Checkpoint` over them (the optimizer
built, its slots made): `like=` where the wanted layout has it, `src_like=` where the source has
it. Converting into int8 quantizes each slot as the fused step does (`_core.quantize_blockwise`,
the block's absmax, then each element's nearest code); converting out of it dequantizes exactly
(`code[byte] * absmax`), to float32, or on to bfloat16. Then the new checkpoint is written in the
wanted layout (its object graph, its names): every tensor of it must have its counterpart in the
source. Object-based checkpoints (Keras 3, tf_keras, `tfclip.compat.v1` eagerly under
`tf.train.Checkpoint`) and a TF1 `Saver`'s: for it the int8 side is the `tfclip.compat.v1`
optimizer itself, its train op built in the default graph (the layout of `Saver()` there: every
global variable by its name), and the other side a checkpoint path or a second such optimizer.
"""
import argparse
import collections
import os
import sys
import tempfile
import warnings

import numpy as np
import tensorflow as tf

__all__ = ["convert_checkpoint"]

_CONVERTIBLE = {tf.float32, tf.bfloat16}
# What every object-based checkpoint holds: no sign that two checkpoints are of the same objects.
_BOOKKEEPING = {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"}


def _prefix(path):
    """A checkpoint's prefix, given the prefix or its directory (the latest one there)."""
    path = os.fspath(path)
    if tf.io.gfile.isdir(path):  # (gfile: a gs:// directory too)
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"no checkpoint in the directory {path!r}")
        return latest
    if not tf.io.gfile.exists(path + ".index"):
        raise ValueError(f"no checkpoint at {path!r} (no {path}.index)")
    return path


_Layout = collections.namedtuple("_Layout", ["dtypes", "shapes", "bookkeeping", "int8"])
# dtypes, shapes: by tensor name; bookkeeping: the values of _BOOKKEEPING's tensors; int8: {codes
# name: (absmax name, signed)} of the live objects' int8 state (None for a path).
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _read_layout(path, int8=None):
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    return _Layout(dtypes, reader.get_variable_to_shape_map(),
                   {n: reader.get_tensor(n) for n in _BOOKKEEPING if n in dtypes}, int8)


def _layout(like, arg="like"):
    """The layout a checkpoint path or a tf.train.Checkpoint gives (a _Layout)."""
    if isinstance(like, (str, os.PathLike)):
        return _read_layout(_prefix(like))
    if isinstance(like, tf.compat.v1.train.Optimizer) and callable(getattr(like, "tfclip_int8_slots", None)):
        return _saver_layout(like, arg)
    if isinstance(like, tf.train.Checkpoint):
        if not tf.executing_eagerly():
            raise ValueError(f"{arg}= as a tf.train.Checkpoint needs eager execution; in a TF1 graph "
                             "pass the path of a checkpoint saved in the wanted layout, or the "
                             "tfclip.compat.v1 optimizer (a Saver's layout)")
        like.save_counter  # noqa: B018  (made now, as save() makes it: in the layout's object graph)
        with tempfile.TemporaryDirectory() as tmp:
            return _read_layout(like.write(os.path.join(tmp, "layout")), _int8_names(like))
    raise TypeError(f"{arg} must be a tf.train.Checkpoint, a checkpoint path or a tfclip.compat.v1 optimizer, "
                    f"got {type(like).__name__}")


def _saver_layout(opt, arg):
    """The layout a TF1 `Saver()` of the default graph writes (every global variable, by its op's
    name, as the Saver names it), with the int8 state of `opt` (a tfclip.compat.v1 optimizer whose
    train op is built in that graph)."""
    if tf.executing_eagerly():
        raise ValueError(f"{arg}= as a tfclip.compat.v1 optimizer describes a TF1 Saver's checkpoint, in the "
                         "graph its train op was built in; eagerly pass a tf.train.Checkpoint over it")
    graph = tf.compat.v1.get_default_graph()
    slots = opt.tfclip_int8_slots()
    if any(sl.codes.graph is not graph for sl in slots):
        raise ValueError(f"{arg}=: the optimizer's slots are in another graph than the default one; call "
                         "convert_checkpoint with the graph its train op was built in as the default")
    variables = tf.compat.v1.global_variables()
    return _Layout({v.op.name: v.dtype.base_dtype for v in variables},
                   {v.op.name: v.shape.as_list() for v in variables}, {},
                   {sl.codes.op.name: (sl.absmax.op.name, sl.signed) for sl in slots})


def _int8_names(root):
    """{codes tensor name: (absmax tensor name, signed)} of the int8 state of the optimizers under
    `root` (their `tfclip_int8_slots()`), named as `root.write` names them: each object by its
    path from the root, breadth first, as TF's own saver walks the object graph, and a slot
    variable of OptimizerV2 / TF1 under its variable's `.OPTIMIZER_SLOT`."""
    view = tf.train.TrackableView(root)
    paths, todo = {id(root): ""}, collections.deque([root])
    optimizers = []
    while todo:
        obj = todo.popleft()
        if callable(getattr(obj, "tfclip_int8_slots", None)):
            optimizers.append(obj)
        for name, child in view.children(obj).items():
            if id(child) not in paths:
                escaped = name.replace(".", "..").replace("/", ".S")  # (TF's escape of a local name)
                paths[id(child)] = f"{paths[id(obj)]}/{escaped}" if paths[id(obj)] else escaped
                todo.append(child)

    def name_of(var, opt, slot_of, suffix=""):
        if slot_of is None:
            return paths[id(var)] + _VALUE
        model_var, slot = slot_of
        escaped = (slot + suffix).replace(".", "..").replace("/", ".S")
        return f"{paths[id(model_var)]}/.OPTIMIZER_SLOT/{paths[id(opt)]}/{escaped}{_VALUE}"

    out = {}
    for opt in optimizers:
        for s in opt.tfclip_int8_slots():
            try:
                out[name_of(s.codes, opt, s.slot_of)] = (name_of(s.absmax, opt, s.slot_of, "_absmax"), s.signed)
            except KeyError:  # (not reached from the root: not in this checkpoint)
                continue
    return out


def _uint8_names(layout):
    """The names of a layout's uint8 tensors (int8 state's codes, or a variable's own)."""
    return {n for n, d in layout.dtypes.items() if d == tf.uint8}


def convert_checkpoint(src, dst, like, src_like=None):
    """Write `src` as `dst`, each tensor in the dtype `like` gives it (see the module docstring).

    Returns the names of the tensors converted. A tensor whose dtype differs otherwise (other
    than float32 against bfloat16, or int8 state against either), or of another shape, is a
    ValueError naming it; nothing is written then. Without int8 state on either side, `like`'s
    tensors absent from `src` are left out (restoring reports them as any checkpoint does).
    `src_like`: a tf.train.Checkpoint over objects in `src`'s layout, needed where `src` holds
    int8 state (what each slot's absmax and code are)."""
    src = _prefix(src)
    dst = os.fspath(dst)
    target = _layout(like)
    want, want_shapes = target.dtypes, target.shapes
    reader = tf.train.load_checkpoint(src)
    have = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    if {n for n, d in have.items() if d == tf.uint8} != _uint8_names(target):
        return _convert_int8(src, dst, reader, target, src_like)
    if not (set(want) & set(have)) - _BOOKKEEPING:
        raise ValueError(f"convert_checkpoint: {src} and the layout wanted share no tensor name (an "
                         "object-based checkpoint, tf.train.Checkpoint's, against a name-based one, a "
                         "TF1 Saver's? like= must be the same kind as src)")
    converted, problems = [], []
    for name in sorted(have):
        target = want.get(name, have[name])
        if target != have[name]:
            if {target, have[name]} != _CONVERTIBLE:
                problems.append(f"{name}: {have[name].name} in {src}, {target.name} in the layout wanted "
                                "(only float32 and bfloat16 state convert)")
            else:
                converted.append(name)
        if name in want_shapes and want_shapes[name] != shapes[name]:
            problems.append(f"{name}: shape {shapes[name]} in {src}, {want_shapes[name]} in the layout wanted")
    if problems:
        raise ValueError("convert_checkpoint: the checkpoint does not fit the layout wanted:\n  "
                         + "\n  ".join(problems))
    if not converted:
        warnings.warn(f"convert_checkpoint: every tensor of {src} has the dtype the layout wanted gives "
                      f"it already, so {dst} is a copy (is the optimizer of like= built, its slots made?)",
                      stacklevel=2)
    if os.path.dirname(dst):
        tf.io.gfile.makedirs(os.path.dirname(dst))
    _write(dst, {name: reader.get_tensor(name) for name in have}, have, {name: want[name] for name in converted})
    return converted


def _canonical(layout):
    """{name: its name with int8 state's absmax tensors taken out}: Keras keeps the absmax variables
    in the optimizer's variable list (`.../_variables/N`), so a later variable's index there is
    its index in the float32 layout plus the absmax variables before it."""
    absmax = {a for a, _ in (layout.int8 or {}).values()}
    taken = collections.defaultdict(list)  # list path -> absmax indices in it
    for a in absmax:
        if not a.endswith(_VALUE):  # (a TF1 Saver's name: no list index in it)
            continue
        path, _, last = a[:-len(_VALUE)].rpartition("/")
        if last.isdigit():
            taken[path].append(int(last))
    out = {}
    for name in layout.dtypes:
        if name in absmax or name in _BOOKKEEPING:
            continue
        canon = name
        for path, idx in taken.items():
            head, sep, rest = name.partition(path + "/")
            index, _, tail = rest.partition("/")
            if head == "" and sep and index.isdigit():
                canon = f"{path}/{int(index) - sum(i < int(index) for i in idx)}/{tail}"
        out[name] = canon
    return out


def _convert_int8(src, dst, reader, target, src_like):
    """convert_checkpoint where int8 state is on one side (or is quantized otherwise): `dst` in the
    wanted layout, each tensor from its counterpart in `src` (see the module docstring)."""
    from tfclip import _core

    source = _Layout(reader.get_variable_to_dtype_map(), reader.get_variable_to_shape_map(), {}, None)
    # A side whose uint8 tensors the other side lacks holds int8 state (a uint8 variable of the
    # model's own is on both): described by live objects.
    for layout, given, arg, other in ((source, src_like, "src_like", target), (target, None, "like", source)):
        if not _uint8_names(layout) - _uint8_names(other):
            continue
        if arg == "src_like":
            if given is None:
                raise ValueError(f"convert_checkpoint: {src} holds int8 optimizer state (uint8 codes); pass "
                                 "src_like=tf.train.Checkpoint(...) over objects in its layout (the optimizer "
                                 "built with state_dtype='int8'; a TF1 Saver's: that tfclip.compat.v1 optimizer, "
                                 "its train op built): it says each slot's absmax and code")
            layout = source._replace(int8=_layout(given, "src_like").int8)
            source = layout
        if layout.int8 is None:
            raise ValueError("convert_checkpoint: the layout wanted holds int8 optimizer state (uint8 codes); "
                             "pass like= as a tf.train.Checkpoint over the objects that will restore it (a TF1 "
                             "Saver's: the tfclip.compat.v1 optimizer), not a path: a path does not say each "
                             "slot's absmax and code")
        if not layout.int8:
            raise ValueError(f"convert_checkpoint: {arg}= holds no tfclip optimizer with int8 state, yet the "
                             f"checkpoint has uint8 tensors ({', '.join(sorted(_uint8_names(layout)))}); for a "
                             "TF1 Saver's checkpoint pass the tfclip.compat.v1 optimizer built with "
                             "state_dtype='int8'")
        # (any other uint8 tensor is a variable of its own: copied as it is)
    by_canon = {c: n for n, c in _canonical(source).items()}
    values, converted, problems, used = {}, [], [], set()
    dtypes, casts = dict(target.dtypes), {}  # (what each value is fed as, and cast to)
    for name, canon in _canonical(target).items():
        s = by_canon.get(canon)
        if s is None:
            problems.append(f"{name}: no counterpart in {src}")
            continue
        used.add(s)
        td, sd = target.dtypes[name], source.dtypes[s]
        if source.shapes[s] != target.shapes[name]:
            problems.append(f"{name}: shape {source.shapes[s]} in {src}, {target.shapes[name]} in the layout wanted")
            continue
        q_src, q_tgt = s in (source.int8 or {}), name in (target.int8 or {})  # int8 state's codes?
        if td == sd and not q_src and not q_tgt:
            values[name] = reader.get_tensor(s)
            continue
        kinds = {"int8 state" if q else d.name for q, d in ((q_src, sd), (q_tgt, td))}
        if not kinds <= {"float32", "bfloat16", "int8 state"}:
            problems.append(f"{name}: {'int8 state' if q_src else sd.name} in {src}, "
                            f"{'int8 state' if q_tgt else td.name} in the layout wanted (only float32, "
                            "bfloat16 and int8 state convert)")
            continue
        value = reader.get_tensor(s)
        if q_src:  # dequantized: code[byte] * absmax, float32
            absmax, signed = source.int8[s]
            if q_tgt and target.int8[name][1] == signed:  # the same state: as it is
                values[name], values[target.int8[name][0]] = value, reader.get_tensor(absmax)
                continue
            value = _core.dequantize_blockwise(value, reader.get_tensor(absmax), signed)
        if q_tgt:
            absmax, signed = target.int8[name]
            value = np.ascontiguousarray(np.asarray(value).astype(np.float32))  # (bfloat16 widens exactly)
            values[name], values[absmax] = _core.quantize_blockwise(value, signed)
        else:
            values[name] = value
            dtypes[name] = tf.float32 if q_src else sd
            casts[name] = td
        converted.append(name)
    lost = sorted(set(_canonical(source)) - used)
    if lost:
        problems.append(f"not in the layout wanted, so not carried over: {', '.join(lost)}")
    if problems:
        raise ValueError("convert_checkpoint: the checkpoint does not fit the layout wanted:\n  " + "\n  ".join(problems))
    for name, value in target.bookkeeping.items():  # the wanted layout's object graph (its names)
        values[name] = value
    counter = "save_counter" + _VALUE
    if counter in source.dtypes and counter in values:
        values[counter] = reader.get_tensor(counter)
    if os.path.dirname(dst):
        tf.io.gfile.makedirs(os.path.dirname(dst))
    _write(dst, values, dtypes, casts)
    return sorted(converted)


def _write(dst, values, dtypes, casts=None):
    """The tensors `values` (NumPy, by name) into the checkpoint dst, those in `casts` cast (TF's
    Cast: to bfloat16 rounded to nearest even). In a graph and session of its own, fed from
    NumPy: the same eagerly and inside a TF1 program's graph, and no tensor is embedded in a
    graph."""
    names, casts = sorted(values), casts or {}
    with tf.Graph().as_default() as graph, tf.device("CPU:0"):
        feeds, tensors = {}, []
        for name in names:
            ph = tf.compat.v1.placeholder(dtypes[name], shape=np.shape(values[name]))
            feeds[ph] = values[name]
            tensors.append(tf.cast(ph, casts[name]) if name in casts else ph)
        save = tf.raw_ops.SaveV2(prefix=dst, tensor_names=names, shape_and_slices=[""] * len(names),
                                 tensors=tensors)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(save, feeds)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfclip.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the checkpoint to convert (its prefix, or a directory: its latest)")
    p.add_argument("dst", help="the prefix to write")
    p.add_argument("--like", required=True, help="a checkpoint in the layout wanted (its prefix or directory); "
                   "int8 state on either side needs the Python API (tfclip.convert_checkpoint with live objects)")
    args = p.parse_args(argv)
    try:
        converted = convert_checkpoint(args.src, args.dst, args.like)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {args.dst}: {len(converted)} tensors converted")
    for name in converted:
        print(" ", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
