"""Muon's matrix step (keras.optimizers.Muon) in TF ops where no element-wise pass can run it:
the Newton–Schulz iterations, batched on a GPU: the matrices of one shape, and those of its
transpose (transposed first, as stock transposes a tall matrix), are stacked and orthogonalized
as one batch, so a step issues `3 * ns_steps` matrix products per distinct shape, not per matrix
(a GPU step is launch-bound on small products). On the CPU they run per matrix: TF's CPU batched
product is slower than its per-matrix one, whose independent chains TF already runs side by side
(benchmarks/cpu_bench.py --extras muon; docs/benchmarks.md). Also the matrices' clip, the one
the fused op ran on the other variables (`clip_gradients`, from the same norm pass), which the
Nesterov step reads. tfclip/keras.py's `Muon` calls these between its fused ops: the AdamW
variables' Adam rule, and the matrices' momentum and update rules (csrc/core/rules.h,
MuonMomentumRule and MuonUpdateRule).

Imports flow one way: tfclip/keras.py imports this module; it imports only TensorFlow.
"""
import tensorflow as tf


def read(handle, dtype):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def assign(handle, value):
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def global_scale(clip, norm):
    """TF's clip_by_global_norm scale in float64 (csrc/core/clip.h, GlobalClipScale): NaN for a
    non-finite norm; 1 for a clip of 0 (no clip)."""
    clip, norm = tf.cast(clip, tf.float64), tf.cast(norm, tf.float64)
    scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
    return tf.where(clip > 0, scale, tf.ones_like(scale) + (norm - norm))


def _on_values(g, fn):
    """fn applied to a gradient, or to an IndexedSlices' values (its slices, as TF and Keras
    clip them, before a repeated row's slices are summed)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)


def clip_gradients(grads, mode, clip, norm, tensor_norms, grad_scale=None):
    """The gradients clipped as the fused op clips its own (csrc/core/clip.h, TensorClipFactor):
    the global scale from `norm` (float64, the norm pass's), per tensor by its norm from
    `tensor_norms`, by value, or none; times `grad_scale` (a loss scale's unscale) first. An
    IndexedSlices' slices are clipped (its norm is its values'). AGC is the caller's
    (tfclip.clipping.AGC.unfused)."""
    gs = tf.constant(1.0, tf.float64) if grad_scale is None else tf.cast(grad_scale, tf.float64)
    clip = tf.cast(clip, tf.float64)
    out = []
    for k, g in enumerate(grads):
        if mode == "global_norm":
            factor = global_scale(clip, norm * gs) * gs
        elif mode == "norm":
            n = tf.cast(tensor_norms[k], tf.float64) * gs
            m = tf.where(tf.math.is_nan(n), n, tf.maximum(n, clip))
            factor = tf.where(clip > 0, clip / m, tf.ones_like(m) + (n - n)) * gs
        elif mode == "value":
            def by_value(x):
                x = x if grad_scale is None else x * tf.cast(gs, x.dtype)
                c = tf.cast(clip, x.dtype)
                return tf.where(clip > 0, tf.clip_by_value(x, -c, c), x)
            out.append(_on_values(g, by_value))
            continue
        else:  # "none"
            factor = gs
        if mode == "none" and grad_scale is None:
            out.append(g)
        else:
            out.append(_on_values(g, lambda x, f=factor: x * tf.cast(f, x.dtype)))
    return out


def shape_groups(shapes, dtypes=None):
    """The batches of a step: [(key, [(index, transposed)])], key (rows, cols) with rows <= cols
    (and the dtype, where `dtypes` are given: a batch is one tensor), in the order each key first
    appears; a matrix taller than wide joins its transpose's batch."""
    groups = {}
    for i, (r, c) in enumerate(shapes):
        key, t = ((c, r), True) if r > c else ((r, c), False)
        if dtypes is not None:
            key = key + (dtypes[i],)
        groups.setdefault(key, []).append((i, t))
    return list(groups.items())


def orthogonalize(updates, newton_schulz, batch=True):
    """Each 2-D update orthogonalized by `newton_schulz(x)` (the stock
    `zeropower_via_newtonschulz5`, which takes a batch [B, rows, cols] as it takes a matrix),
    one call per shape batch (batch=False: per matrix); in the updates' order and shapes. A batch
    of one is the matrix itself (the stock call, bit for bit)."""
    if not batch:
        return [newton_schulz(u) for u in updates]
    out = [None] * len(updates)
    for _, members in shape_groups([tuple(u.shape) for u in updates], [u.dtype for u in updates]):
        if len(members) == 1:
            out[members[0][0]] = newton_schulz(updates[members[0][0]])
            continue
        ys = tf.unstack(newton_schulz(tf.stack([tf.transpose(updates[i]) if t else updates[i] for i, t in members])))
        for (i, t), y in zip(members, ys):
            out[i] = tf.transpose(y) if t else y
    return out
