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
"""
import argparse
import os
import sys
import tempfile
import warnings

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


def _read_layout(path):
    reader = tf.train.load_checkpoint(path)
    return reader.get_variable_to_dtype_map(), reader.get_variable_to_shape_map()


def _layout(like):
    """({tensor name: dtype}, {tensor name: shape}) of the wanted layout."""
    if isinstance(like, (str, os.PathLike)):
        return _read_layout(_prefix(like))
    if isinstance(like, tf.train.Checkpoint):
        if not tf.executing_eagerly():
            raise ValueError("like= as a tf.train.Checkpoint needs eager execution; in a TF1 graph "
                             "pass the path of a checkpoint saved in the wanted layout")
        with tempfile.TemporaryDirectory() as tmp:
            return _read_layout(like.write(os.path.join(tmp, "layout")))
    raise TypeError(f"like must be a tf.train.Checkpoint or a checkpoint path, got {type(like).__name__}")


def convert_checkpoint(src, dst, like):
    """Write `src` as `dst`, each tensor in the dtype `like` gives it (see the module docstring).

    Returns the names of the tensors converted. A tensor whose dtype differs otherwise (other
    than float32 against bfloat16), or of another shape, is a ValueError naming it; nothing is
    written then. `like`'s tensors absent from `src` are left out (restoring reports them as
    any checkpoint does)."""
    src = _prefix(src)
    dst = os.fspath(dst)
    want, want_shapes = _layout(like)
    reader = tf.train.load_checkpoint(src)
    have = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
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
    _write(dst, reader, have, {name: want[name] for name in converted})
    return converted


def _write(dst, reader, dtypes, casts):
    """Every tensor of reader under its name into dst, those in casts cast (TF's Cast: to
    bfloat16 rounded to nearest even). In a graph and session of its own, fed from NumPy: the
    same eagerly and inside a TF1 program's graph, and no tensor is embedded in a graph."""
    names = sorted(dtypes)
    with tf.Graph().as_default() as graph, tf.device("CPU:0"):
        feeds, tensors = {}, []
        for name in names:
            value = reader.get_tensor(name)
            ph = tf.compat.v1.placeholder(dtypes[name], shape=getattr(value, "shape", ()))
            feeds[ph] = value
            tensors.append(tf.cast(ph, casts[name]) if name in casts else ph)
        save = tf.raw_ops.SaveV2(prefix=dst, tensor_names=names, shape_and_slices=[""] * len(names),
                                 tensors=tensors)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(save, feeds)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfclip.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the checkpoint to convert (its prefix, or a directory: its latest)")
    p.add_argument("dst", help="the prefix to write")
    p.add_argument("--like", required=True, help="a checkpoint in the layout wanted (its prefix or directory)")
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
