"""The fused op's clip written in TF ops, for the gradients of a step that no apply op takes (Muon's
matrices, which its Newton–Schulz products read; a step the stock class's own ops make): the
same factors as the op's (csrc/core/clip.h: GlobalClipScale, TensorClipFactor), from the same
norm pass. Imports only TensorFlow."""
import tensorflow as tf


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


def scaled(g, scale):
    """g times `scale` (a tensor or IndexedSlices: its values), in g's dtype."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)
