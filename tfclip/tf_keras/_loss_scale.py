"""`tfclip.tf_keras.LossScaleOptimizer`: tf_keras's loss scaling (`mixed_float16`) with the
unscale and the finite check folded into a tfclip.tf_keras optimizer's two passes, as
`tfclip.keras.LossScaleOptimizer` does for Keras 3 (tfclip/keras/_loss_scale.py says why).

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
variable with a constraint, an XLA step without tfclip's kernels) run the stock wrapper's passes.
Under a strategy whose replicas meet in merge_call (MirroredStrategy) each replica runs the
folded step on its own copies and the loss scale is updated once, in the cross-replica context.

`LegacyLossScaleOptimizer` does the same for the legacy (OptimizerV2) optimizers, around the V2
wrapper's `minimize` (`tfclip.tf_keras.LossScaleOptimizer(legacy_optimizer)` makes one, as
tf_keras's own wrapper picks its class by the inner optimizer's kind).
"""
import tensorflow as tf
import tf_keras
from tf_keras.src.mixed_precision import loss_scale_optimizer as _lso
from tf_keras.src.optimizers import utils as _optimizer_utils
from tfclip._engine import loss_scale as _loss_scale
from tfclip._engine import xla as _xla
from tfclip.tf_keras import _legacy
from tfclip.tf_keras import _dropin
from tfclip import clipping as _clipping


def _update_loss_scale(state, applied):
    """The stock `_DynamicLossScaleState.update` by the folded step's outcome."""
    return _loss_scale.update_dynamic_scale(state.current_loss_scale, state.counter, state.growth_steps,
                                      state.multiplier, applied)


def _refusal_of(wrapper, inner, mixin):
    """What both wrappers refuse to fold (each adds its own), or None."""
    if not isinstance(inner, mixin):
        return f"the inner optimizer, {type(inner).__name__}, is not a tfclip.tf_keras one"
    if isinstance(inner.clip, _clipping.AGC):
        return "AGC's unit scales count the units they clip, from the unscaled gradients"
    if not wrapper.dynamic:
        return "a fixed loss scale (stock applies every step under the inner optimizer's own policy)"
    if not _loss_scale.power_of_two(wrapper.initial_scale):
        return (f"initial_scale {wrapper.initial_scale} is not a power of two (the fold's g * (1 / scale) "
                "is the stock one only for one)")
    if _xla.in_context() and not _xla.kernels():
        return "this build of tfclip has no XLA kernels and the step is jit-compiled"
    return None


class LossScaleOptimizer(_lso.LossScaleOptimizerV3):
    """tf_keras.mixed_precision.LossScaleOptimizer for the new tf_keras optimizers, with the
    unscale folded into a tfclip.tf_keras optimizer's passes in `minimize` (see the module
    docstring). The same constructor: `inner_optimizer`, `dynamic=True`, `initial_scale`,
    `dynamic_growth_steps`."""

    def __new__(cls, inner_optimizer, *args, **kwargs):
        # A legacy (OptimizerV2) inner optimizer gets the legacy wrapper, as tf_keras's own
        # LossScaleOptimizer picks one by the inner optimizer's kind.
        if cls is LossScaleOptimizer and isinstance(inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            return LegacyLossScaleOptimizer(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, inner_optimizer, *args, **kwargs):
        if not isinstance(inner_optimizer, tf_keras.optimizers.Optimizer):
            raise TypeError("tfclip.tf_keras.LossScaleOptimizer wraps a tf_keras optimizer (tfclip.tf_keras.Adam, "
                            f"tfclip.tf_keras.legacy.Adam, ...), got {type(inner_optimizer).__name__}")
        super().__init__(inner_optimizer, *args, **kwargs)

    def fold_refusal(self):
        """Why `minimize` runs the stock wrapper's passes, or None where it folds."""
        inner = self.inner_optimizer
        if isinstance(inner, _dropin._FusedMixin) and inner.use_ema:
            return "the inner optimizer has use_ema (stock skips its average on a skipped step)"
        if isinstance(inner, _dropin._FusedMixin) and (inner._mesh or inner._run_with_dtensor):
            return "DTensor"
        return _refusal_of(self, inner, _dropin._FusedMixin)

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
        applied = _loss_scale.with_loss_scale(
            inner, grad_scale, lambda: inner.apply_gradients(grads_and_vars, skip_gradients_aggregation=True))
        def update(applied):
            if lr_before is not None:
                tf.cond(applied, lambda: _loss_scale.graph_op(tf.no_op()), lambda: _loss_scale.graph_op(lr_var.assign(lr_before)))
            _update_loss_scale(self._loss_scale, applied)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            update(applied)
        else:
            # A strategy whose replicas meet in merge_call (MirroredStrategy): each replica ran the
            # folded step on its own copies (the unscale is per thread, so per replica), and the
            # all-reduced gradients made every replica decide alike; the mirrored loss scale (and
            # a schedule's value) is updated once, in the cross-replica context, by the first
            # replica's outcome.
            tf.distribute.get_replica_context().merge_call(
                lambda strategy, applied: update(strategy.experimental_local_results(applied)[0]), args=(applied,))
        return None


class LegacyLossScaleOptimizer(_lso.LossScaleOptimizer):
    """tf_keras.mixed_precision.LossScaleOptimizer for tf_keras's legacy (OptimizerV2) optimizers,
    with the unscale folded into a `tfclip.tf_keras.legacy` optimizer's step in `minimize` (what
    `model.fit` and a TF1-style `train_op = opt.minimize(loss)` call), as `LossScaleOptimizer`
    folds it for the new ones. `tfclip.tf_keras.LossScaleOptimizer(legacy_optimizer)` makes one.

    Stock (the V2 wrapper): the scaled loss's gradients times 1 / scale, written; aggregated; all
    checked for inf/NaN (the loss scale's update); the inner `apply_gradients` if finite, else
    `iterations += 1` alone. Folded: the aggregated scaled gradients go to the fused step with
    `grad_scale = 1 / scale`; its non-finite skip is the check (the inner `apply_gradients` counts
    `iterations` either way, as stock); the loss scale's update is the stock one. The stock passes
    run where the fold cannot (`fold_refusal`; and a step whose variables have a constraint, or
    one the inner optimizer itself runs with the stock ops), and for `apply_gradients` given
    gradients already unscaled."""

    def __init__(self, inner_optimizer, *args, **kwargs):
        if not isinstance(inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            raise TypeError("tfclip.tf_keras.LossScaleOptimizer's legacy wrapper takes a legacy (OptimizerV2) "
                            f"optimizer (tfclip.tf_keras.legacy.Adam, ...), got {type(inner_optimizer).__name__}")
        super().__init__(inner_optimizer, *args, **kwargs)

    def fold_refusal(self):
        """Why `minimize` runs the stock wrapper's passes, or None where it folds."""
        return _refusal_of(self, self.inner_optimizer, _legacy._LegacyFusedMixin)

    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        if self.fold_refusal() is not None:
            return super().minimize(loss, var_list, grad_loss=grad_loss, name=name, tape=tape)
        tape = tf.GradientTape() if tape is None else tape
        with tape:
            loss = self.get_scaled_loss(loss)
        grads_and_vars = self._optimizer._compute_gradients(loss, var_list, grad_loss, tape=tape)
        inner = self._optimizer
        if (any(getattr(v, "constraint", None) is not None for _, v in grads_and_vars)
                or inner._stock_reason(list(grads_and_vars)) is not None):
            # (stock leaves a constrained variable be on a skipped step; the inner step's stock
            # ops take no grad_scale): the stock passes, as stock minimize
            grads = self.get_unscaled_gradients([g for g, _ in grads_and_vars])
            return self.apply_gradients(list(zip(grads, [v for _, v in grads_and_vars])), name=name)
        self._gradients_have_been_unscaled = True  # (inside the step: no warning)
        return self._apply_scaled(grads_and_vars, name)

    def _apply_scaled(self, grads_and_vars, name):
        """The stock apply_gradients, given the scaled loss's gradients: aggregated, then the
        inner step with grad_scale = 1 / scale folded in, then the loss scale updated by its
        outcome. Returns the stock's result: an op in a graph (a TF1 train op runs it all)."""
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply_gradients() must be called in a replica context.")
        _lso._raise_if_strategy_unsupported()
        grads_and_vars = _optimizer_utils.filter_empty_gradients(grads_and_vars)
        inner = self._optimizer
        grads_and_vars = inner._transform_unaggregated_gradients(grads_and_vars)
        grads_and_vars = inner._aggregate_gradients(grads_and_vars)
        grad_scale = 1.0 / tf.cast(self.loss_scale, tf.float64)  # (exact for a power of two)
        ops = []
        applied = _loss_scale.with_loss_scale(inner, grad_scale, lambda: ops.append(inner.apply_gradients(
            list(grads_and_vars), name=name, experimental_aggregate_gradients=False)))
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            update = _update_loss_scale(self._loss_scale, applied)
        else:  # (MirroredStrategy: once, in the cross-replica context; LossScaleOptimizer's)
            update = tf.distribute.get_replica_context().merge_call(
                lambda strategy, applied: _update_loss_scale(
                    self._loss_scale, strategy.experimental_local_results(applied)[0]), args=(applied,))
        if tf.executing_eagerly():
            return None
        return tf.group(*[o for o in ops if o is not None], update)



# Where users find them, and the module saved configs name (tf_keras imports it to find the class
# where tfclip.tf_keras has not registered it yet; configs saved before 2026-12-04 name
# tfclip._tf_keras_loss_scale, which still holds them).
LossScaleOptimizer.__module__ = LegacyLossScaleOptimizer.__module__ = "tfclip.tf_keras"
