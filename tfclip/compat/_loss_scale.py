"""`tfclip.compat.v1.MixedPrecisionLossScaleOptimizer`: TF1's loss scaling with the unscale and
the finite check folded into a tfclip.compat.v1 optimizer's two passes, as the Keras wrappers fold
them (tfclip/keras/_loss_scale.py says why: two passes over the gradients fewer).

The stock wrapper (`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`, which
`enable_mixed_precision_graph_rewrite` puts around an optimizer): `compute_gradients` scales the
loss and writes every gradient times 1 / scale; `apply_gradients` checks them all for inf/NaN (the
loss scale's update) and runs the inner `apply_gradients` (with `global_step`) only if finite.
This subclass folds both in `minimize` (the one call that sees the scaled gradients and hands them
on): the scaled loss's gradients go to the inner fused step with `grad_scale = 1 / scale`; the
op's non-finite skip is the check (nothing written, Adam's beta powers neither); `global_step`
advances only for an applied step; the loss scale's update is the stock `DynamicLossScale.update`.
`compute_gradients` and `apply_gradients` called apart (a program that clips or logs the
gradients in between) keep the stock wrapper's passes: those gradients are unscaled first, as the
code in between expects. So do the cases the fold cannot take (`fold_refusal`).
"""
import tensorflow as tf
from tensorflow.python.training.experimental import loss_scale as _tf_loss_scale
from tensorflow.python.training.experimental import loss_scale_optimizer as _lso
from tfclip import clipping as _clipping
from tfclip._engine import loss_scale as _loss_scale
from tfclip.compat._fused import _Fused


class MixedPrecisionLossScaleOptimizer(_lso.MixedPrecisionLossScaleOptimizer):
    """tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer with the unscale folded into
    a tfclip.compat.v1 optimizer's step in `minimize` (see the module docstring). The same
    constructor: `opt`, `loss_scale` ("dynamic", a number, or a `tf.compat.v1.mixed_precision`
    loss scale)."""

    def fold_refusal(self):
        """Why `minimize` runs the stock wrapper's passes, or None where it folds."""
        inner = self._optimizer
        if not isinstance(inner, _Fused):
            return f"the inner optimizer, {type(inner).__name__}, is not a tfclip.compat.v1 one"
        if isinstance(inner._adaptive, _clipping.AGC):
            return "AGC's unit scales count the units they clip, from the unscaled gradients"
        ls = self._loss_scale
        if not isinstance(ls, _tf_loss_scale.DynamicLossScale):
            return "a fixed loss scale (stock applies every step under the inner optimizer's own policy)"
        for what, value in (("initial_loss_scale", ls.initial_loss_scale), ("multiplier", ls.multiplier)):
            if not _loss_scale.power_of_two(value):
                return (f"{what} {value} is not a power of two (the fold's g * (1 / scale) is the stock "
                        "one only for one)")
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            return "the strategy's replicas meet in merge_call"
        return None

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=_Fused.GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False, name=None, grad_loss=None):
        if self.fold_refusal() is not None:
            return super().minimize(loss, global_step=global_step, var_list=var_list,
                                    gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                                    colocate_gradients_with_ops=colocate_gradients_with_ops, name=name,
                                    grad_loss=grad_loss)
        # The scaled loss's gradients, as the stock compute_gradients computes them, not unscaled.
        grads_and_vars = self._optimizer.compute_gradients(
            self._scale_loss(loss), var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method, colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss)
        if not [v for g, v in grads_and_vars if g is not None]:
            raise ValueError(f"No gradients provided for any variable, check your graph for ops that do not "
                             f"support gradients, between variables {[str(v) for _, v in grads_and_vars]} "
                             f"and loss {loss}.")
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply_gradients() must be called in a replica context.")
        return self._apply_scaled(grads_and_vars, global_step, name)

    def _apply_scaled(self, grads_and_vars, global_step, name):
        """The inner step with grad_scale = 1 / scale, then global_step (if applied) and the loss
        scale by its outcome: one op (a TF1 train op runs it all; eagerly, after it ran)."""
        inner = self._optimizer
        name = name if name is not None else self.get_name()
        grad_scale = 1.0 / tf.cast(self._loss_scale(), tf.float64)  # (exact for a power of two)
        ops = []
        applied = _loss_scale.with_loss_scale(inner, grad_scale, lambda: ops.append(inner.apply_gradients(
            grads_and_vars, global_step=None, name=name + "-wrapped")))
        deps = [o for o in ops if o is not None and not tf.executing_eagerly()]
        with tf.control_dependencies(deps):
            updates = [self._update_loss_scale(applied)]
            if global_step is not None:
                updates.append(tf.cond(applied, lambda: _loss_scale.graph_op(tf.compat.v1.assign_add(global_step, 1)),
                                       lambda: _loss_scale.graph_op(tf.no_op())))
        if tf.executing_eagerly():
            return None
        return tf.group(*deps, *[u for u in updates if u is not None], name=name)

    def _update_loss_scale(self, applied):
        """The stock `DynamicLossScale.update` by the folded step's outcome."""
        ls = self._loss_scale
        return _loss_scale.update_dynamic_scale(ls._current_loss_scale, ls._num_good_steps, ls._increment_period,
                                          ls._multiplier, applied)
