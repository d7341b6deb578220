"""`tfclip.tf_keras.LossScaleOptimizer`: tf_keras's loss scaling (`mixed_float16`) with the
unscale and the finite check folded into a tfclip.tf_keras optimizer's two passes, as
`tfclip.keras.LossScaleOptimizer` does for Keras 3 (tfclip/_keras_loss_scale.py says why).

tf_keras unscales in `compute_gradients` (`get_unscaled_gradients`: every gradient times
1 / scale, written) and checks them all for inf/NaN in `apply_gradients`. This subclass of its
wrapper for the new optimizers (`LossScaleOptimizerV3`) does both inside the inner step when it
runs `minimize` (what `model.fit` calls): the scaled loss's gradients go to the tfclip step with
`grad_scale = 1 / scale`, its non-finite skip is the wrapper's `should_apply_gradients`, and the
loss scale's update is the stock one (`_DynamicLossScaleState.update`: grow by `multiplier` after
`growth_steps` applied steps, back off to at least 1 after a non-finite one; `iterations`
advance either way, as stock). `apply_gradients` given gradients already unscaled (a custom loop
calling `get_unscaled_gradients`) and the cases the fold cannot take (an inner optimizer not
tfclip's, `use_ema`, AGC, a fixed loss scale, an `initial_scale` that is no power of two, a
variable with a constraint, a strategy whose replicas meet in merge_call, an XLA step without
tfclip's kernels) run the stock wrapper's passes.
"""
import tensorflow as tf
import tf_keras
from tf_keras.src.mixed_precision import loss_scale_optimizer as _lso
from tf_keras.src.optimizers import utils as _optimizer_utils

from tfclip import _step, _tf_keras_step
from tfclip import clipping as _clipping


def _graph_op(op):
    """An assign's op in a graph, None eagerly (tf.cond branches must return alike)."""
    return None if tf.executing_eagerly() else op.op if hasattr(op, "op") else op


class LossScaleOptimizer(_lso.LossScaleOptimizerV3):
    """tf_keras.mixed_precision.LossScaleOptimizer for the new tf_keras optimizers, with the
    unscale folded into a tfclip.tf_keras optimizer's passes in `minimize` (see the module
    docstring). The same constructor: `inner_optimizer`, `dynamic=True`, `initial_scale`,
    `dynamic_growth_steps`."""

    def __init__(self, inner_optimizer, *args, **kwargs):
        if not isinstance(inner_optimizer, tf_keras.optimizers.Optimizer) or isinstance(
                inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            raise TypeError("tfclip.tf_keras.LossScaleOptimizer wraps the new tf_keras optimizers "
                            f"(tfclip.tf_keras.Adam, ...), got {type(inner_optimizer).__name__}; for a "
                            "legacy one use tf_keras.mixed_precision.LossScaleOptimizer")
        super().__init__(inner_optimizer, *args, **kwargs)

    def fold_refusal(self):
        """Why `minimize` runs the stock wrapper's passes, or None where it folds."""
        inner = self.inner_optimizer
        if not isinstance(inner, _tf_keras_step._FusedMixin):
            return f"the inner optimizer, {type(inner).__name__}, is not a tfclip.tf_keras one"
        if inner.use_ema:
            return "the inner optimizer has use_ema (stock skips its average on a skipped step)"
        if isinstance(inner.clip, _clipping.AGC):
            return "AGC's unit scales count the units they clip, from the unscaled gradients"
        if not self.dynamic:
            return "a fixed loss scale (stock applies every step under the inner optimizer's own policy)"
        if not _step.power_of_two(self.initial_scale):
            return (f"initial_scale {self.initial_scale} is not a power of two (the fold's g * (1 / scale) "
                    "is the stock one only for one)")
        if inner._mesh or inner._run_with_dtensor:
            return "DTensor"
        if not tf.__internal__.distribute.strategy_supports_no_merge_call():
            return "the strategy's replicas meet in merge_call"
        if _tf_keras_step._in_xla_context() and not _tf_keras_step._xla_kernels():
            return "this build of tfclip has no XLA kernels and the step is jit-compiled"
        return None

    def minimize(self, loss, var_list, tape=None):
        if self.fold_refusal() is not None:
            return super().minimize(loss, var_list, tape)
        tape = tf.GradientTape() if tape is None else tape
        with tape:
            loss = self.get_scaled_loss(loss)
        grads_and_vars = self.inner_optimizer.compute_gradients(loss, var_list, tape=tape)
        if any(getattr(v, "constraint", None) is not None for _, v in grads_and_vars):
            # (stock leaves a constrained variable be on a skipped step; the folded step runs
            # the constraint): the stock passes, as stock minimize
            grads = self.get_unscaled_gradients([g for g, _ in grads_and_vars])
            return self.apply_gradients(zip(grads, [v for _, v in grads_and_vars]))
        self._gradients_have_been_unscaled = True  # (inside the step: no warning)
        return self._apply_scaled(grads_and_vars)

    def _apply_scaled(self, grads_and_vars):
        """The stock apply_gradients, given the scaled loss's gradients: aggregated, then one
        fused step with grad_scale = 1 / scale, then the loss scale updated by its outcome."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        with tf.init_scope():
            self.build([v for _, v in grads_and_vars])
        grads_and_vars = _optimizer_utils.filter_empty_gradients(grads_and_vars)
        grads_and_vars = self.inner_optimizer.aggregate_gradients(grads_and_vars)
        inner = self.inner_optimizer
        grad_scale = 1.0 / tf.cast(self.loss_scale, tf.float64)  # (exact for a power of two)
        # A schedule's value as of the last applied step: stock recomputes it only in the inner
        # apply_gradients, which a skipped step never reaches.
        lr_var = getattr(inner, "_current_learning_rate", None)
        lr_before = tf.identity(lr_var) if isinstance(lr_var, tf.Variable) else None
        applied = _step.with_loss_scale(
            inner, grad_scale, lambda: inner.apply_gradients(grads_and_vars, skip_gradients_aggregation=True))
        if lr_before is not None:
            tf.cond(applied, lambda: _graph_op(tf.no_op()), lambda: _graph_op(lr_var.assign(lr_before)))
        state = self._loss_scale

        def finite():
            def grow():
                new = state.current_loss_scale * state.multiplier
                grown = tf.cond(tf.math.is_finite(new), lambda: _graph_op(state.current_loss_scale.assign(new)),
                                lambda: _graph_op(tf.no_op()))
                return tf.group(grown, state.counter.assign(0))

            return tf.cond(state.counter + 1 >= state.growth_steps, grow,
                           lambda: _graph_op(state.counter.assign_add(1)))

        def back_off():
            return tf.group(state.counter.assign(0), state.current_loss_scale.assign(
                tf.maximum(state.current_loss_scale / state.multiplier, 1)))

        tf.cond(applied, finite, back_off)
        return None
