"""A loss scale's unscale folded into a fused step (mixed_float16's dynamic loss scaling): the
LossScaleOptimizers of tfclip.keras, tfclip.tf_keras and tfclip.compat.v1 run their inner
optimizer's apply with `with_loss_scale`; the drop-ins' step reads the unscale (`loss_scale`),
folds it into its passes (`grad_scale`) and gives back whether the step was applied
(`loss_scale_applied`); the wrappers then update their scale (`update_dynamic_scale`)."""
import contextlib
import math
import threading

import tensorflow as tf

from tfclip._engine import opcall as _opcall

# The loss-scale unscales being folded into a step, per thread (as a step is built: eagerly or
# traced), by the optimizer's id: [grad_scale, the step's `applied`].
_LOSS_SCALE = threading.local()


def with_loss_scale(opt, grad_scale, apply):
    """Runs `apply()`, the optimizer's own apply call, with a loss scale's unscale `grad_scale`
    folded into its fused step (the drop-ins' step reads it with `loss_scale(opt)` and gives
    back its `applied` with `loss_scale_applied`); returns whether the step was applied (True
    where no fused step ran: no gradients, as stock then counts the step). Eagerly under the
    optimizer's lock: one thread's scale never meets another's step. tfclip.keras's and
    tfclip.tf_keras's LossScaleOptimizer call it."""
    folding = _LOSS_SCALE.__dict__.setdefault("by_id", {})
    entry = folding[id(opt)] = [grad_scale, None]
    lock = _opcall.state_lock(opt) if tf.executing_eagerly() else contextlib.nullcontext()
    try:
        with lock:
            apply()
    finally:
        folding.pop(id(opt), None)
    return tf.constant(True) if entry[1] is None else entry[1]


def graph_op(op):
    """An assign's op in a graph, None eagerly (tf.cond branches must return alike)."""
    return None if tf.executing_eagerly() else op.op if hasattr(op, "op") else op


def update_dynamic_scale(scale, good_steps, growth_steps, multiplier, applied):
    """A dynamic loss scale's update by a folded step's outcome, as tf_keras's
    `_DynamicLossScaleState.update` and TF1's `DynamicLossScale.update` make it: after an applied
    step `good_steps` counts, and once it reaches `growth_steps` the scale grows by `multiplier`
    (if that stays finite) and the count restarts; after a skipped one the scale backs off to at
    least 1 and the count restarts. Returns the update (an op in a graph, None eagerly)."""
    def finite():
        def grow():
            new = scale * multiplier
            grown = tf.cond(tf.math.is_finite(new), lambda: graph_op(scale.assign(new)),
                            lambda: graph_op(tf.no_op()))
            return tf.group(grown, good_steps.assign(0))

        return tf.cond(good_steps + 1 >= growth_steps, grow, lambda: graph_op(good_steps.assign_add(1)))

    def back_off():
        return tf.group(good_steps.assign(0), scale.assign(tf.maximum(scale / multiplier, 1)))

    return graph_op(tf.cond(applied, finite, back_off))


def power_of_two(x):
    """Whether the number x is a power of two (a loss scale whose unscale folds exactly)."""
    m, _ = math.frexp(float(x))
    return m == 0.5


def loss_scale(opt):
    """The unscale `with_loss_scale` is folding into `opt`'s step in this thread, or None."""
    entry = getattr(_LOSS_SCALE, "by_id", {}).get(id(opt))
    return None if entry is None else entry[0]


def loss_scale_applied(opt, applied):
    """The folded step's `applied`, for `with_loss_scale`."""
    getattr(_LOSS_SCALE, "by_id", {})[id(opt)][1] = applied
