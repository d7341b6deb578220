"""`tfclip.keras.LossScaleOptimizer`: Keras 3's dynamic loss scaling (`mixed_float16`) with the
unscale and the finite check folded into a tfclip optimizer's two passes.

The stock wrapper reads every gradient to check it is finite, writes `g / scale` for every
gradient, and only then runs the inner optimizer's step: two more passes over the gradients
than the step's own. Around a tfclip.keras optimizer this subclass gives the inner step the
factor `1 / scale` instead (the op's `grad_scale`, csrc/core/clip.h: the norm pass and the
apply pass read `g` and scale it, exact for the power-of-two scales dynamic loss scaling keeps)
and takes the op's own non-finite decision (a global norm that is inf or NaN: nothing written)
as the stock wrapper's `check_finite`. The loss scale's state machine is the stock one: after an
applied step the counter advances and, every `dynamic_growth_steps`, the scale doubles; after a
non-finite step the scale halves, the counter restarts, and the inner optimizer's `iterations`
do not advance. So the variables, the slots, `iterations`, `dynamic_scale` and `step_counter`
follow the stock wrapper around the same tfclip optimizer step for step, bit for bit
(tests/test_loss_scale_keras.py).

Under a strategy whose replicas meet in `merge_call` (MirroredStrategy) each replica runs the
folded step on its own copies, and the loss scale is updated once from the cross-replica context
(`_tf_apply`). The stock path runs instead (the same results, the passes unfolded) around an
optimizer that is not tfclip's, and where the fold cannot apply: with `use_ema`,
`gradient_accumulation_steps`, a `loss_scale_factor` of the inner optimizer, variables with
`overwrite_with_gradient` or a constraint (stock leaves them be on a skipped step), AGC
(`clip=tfclip.clipping.AGC(...)`), an `initial_scale` that is no power of two, or an XLA step
tfclip's kernels cannot run.

`model.compile` wraps its optimizer in the stock wrapper under `mixed_float16` unless it is given
a LossScaleOptimizer: pass this one, `model.compile(optimizer=tfclip.keras.LossScaleOptimizer(
tfclip.keras.Adam(...)))`.
"""
import keras
import tensorflow as tf

from tfclip.keras import _dropin
from tfclip._engine import loss_scale as _loss_scale
from tfclip._engine import xla as _xla
from tfclip import clipping as _clipping


class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """keras.optimizers.LossScaleOptimizer, with the unscale folded into a tfclip optimizer's
    passes (see the module docstring). The same constructor: `inner_optimizer`,
    `initial_scale=2**15`, `dynamic_growth_steps=2000`."""

    def fold_refusal(self, grads, trainable_variables=None):
        """Why a step over `grads` runs the stock wrapper's passes, or None where it folds."""
        inner = self.inner_optimizer
        if not isinstance(inner, _dropin._FusedMixin):
            return f"the inner optimizer, {type(inner).__name__}, is not a tfclip.keras one"
        if inner.use_ema:
            return "the inner optimizer has use_ema"
        if inner.gradient_accumulation_steps:
            return "the inner optimizer has gradient_accumulation_steps"
        if inner.loss_scale_factor is not None:
            return "the inner optimizer has a loss_scale_factor"
        if isinstance(inner.clip, _clipping.AGC):
            return "AGC's unit scales count the units they clip, from the unscaled gradients"
        if not _loss_scale.power_of_two(self.initial_scale):
            return (f"initial_scale {self.initial_scale} is not a power of two (the fold's g * (1 / scale) "
                    "is the stock g / scale only for one)")
        tvars = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        if any(getattr(v, "overwrite_with_gradient", False) for v in tvars):
            return "a variable has overwrite_with_gradient (the stock wrapper does not unscale its gradient)"
        if any(getattr(v, "constraint", None) is not None for v in tvars):
            return "a variable has a constraint (stock skips it with the step; the folded step runs it)"
        if _xla.in_context():
            why = _dropin._xla_fallback_reason(inner, [g for g in grads if g is not None],
                                                   [_dropin._tf_var(v) for v in tvars])
            if why is not None:
                return why
        return None

    def _common_apply(self, grads, trainable_variables=None):
        if self.fold_refusal(grads, trainable_variables) is not None:
            return super()._common_apply(grads, trainable_variables)
        self._update_scale(self._folded_step(grads, trainable_variables))

    def _folded_step(self, grads, trainable_variables):
        """The inner step with the unscale folded in; returns whether it was applied."""
        inner = self.inner_optimizer
        # The scale before this step's update (stock divides by it); 1 / scale in float64 is
        # exact for a power of two.
        grad_scale = 1.0 / tf.cast(_dropin._tf_var(self.dynamic_scale), tf.float64)
        applied = _loss_scale.with_loss_scale(inner, grad_scale,
                                        lambda: inner.apply(grads, trainable_variables=trainable_variables))
        # Stock calls the inner step only for finite gradients: a skipped one does not count.
        inner.iterations.assign_add(tf.cast(applied, inner.iterations.dtype) - 1)
        return applied

    def _tf_apply(self, grads, trainable_variables=None):
        # A strategy whose replicas meet in merge_call (MirroredStrategy): stock checks the
        # gradients and steps every replica from the cross-replica context. Folded, each replica
        # runs the folded step on its own copies in its own thread (the unscale is per thread:
        # _loss_scale.with_loss_scale); the gradients are all-reduced, so every replica decides alike,
        # and the loss scale (mirrored) is updated once, in the cross-replica context, by the first
        # replica's outcome.
        if (tf.distribute.in_cross_replica_context() or tf.__internal__.distribute.strategy_supports_no_merge_call()
                or self.fold_refusal(grads, trainable_variables) is not None):
            return super()._tf_apply(grads, trainable_variables)
        applied = self._folded_step(grads, trainable_variables)
        tf.distribute.get_replica_context().merge_call(
            lambda strategy, applied: self._update_scale(strategy.experimental_local_results(applied)[0]),
            args=(applied,))

    def _update_scale(self, applied):
        """The stock loss scale's update by the step's outcome: after an applied step the counter
        advances and every dynamic_growth_steps the scale doubles; after a skipped one the scale
        halves and the counter restarts."""
        def finite():
            def upscale():
                self.step_counter.assign(0)
                self.dynamic_scale.assign(self.dynamic_scale * 2.0)

            def increment():
                self.step_counter.assign_add(1)

            keras.ops.cond(keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1), upscale,
                           increment)

        keras.ops.cond(applied, finite, self._stateful_handle_non_finite_grads)


LossScaleOptimizer.__module__ = "tfclip.keras"  # (where users find it; saved configs name it)
