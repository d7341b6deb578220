"""Drop-in `tf.compat.v1.train` optimizers with clipping fused into `apply_gradients`.

Change one line of TF1 code::

    opt = tf.compat.v1.train.AdamOptimizer(1e-3)                       # before, plus a
    grads, _ = tf.clip_by_global_norm(grads, 5.0)                      # clip in between
    opt = tfclip.compat.v1.AdamOptimizer(1e-3, global_clipnorm=5.0)    # after

`compute_gradients` → `apply_gradients(grads_and_vars, global_step=...)` and
`minimize(loss, var_list=..., global_step=...)` work as with the stock classes, in graph mode
with a `Session` and eagerly. Pairs whose gradient is `None` (`tf.stop_gradient`, variables
outside the loss) are left alone; variables outside `var_list` are never touched.

The optimizer state is the stock class's, variable for variable: the slots (`momentum`, `m`,
`v`, so `get_slot` works) and Adam's `beta1_power` / `beta2_power` accumulators, with the stock
names, so `opt.variables()` is the stock list and a `tf.compat.v1.train.Saver` (or
`tf.train.Checkpoint`) checkpoint moves both ways between the stock classes and these.
tfclip's extras, the pre-clip global norm of the last step (`opt.global_norm()`) and each
gradient's pre-clip norm in it (`opt.tensor_norms()`, aligned with `opt.tensor_norm_names()`),
are local variables: outside `tf.compat.v1.global_variables()`, never saved, and only written
by the step (so code that initializes just the model's variables works, as with the stock
classes). Both come from the op's norm pass, no extra reduction; both are written also when a
non-finite norm skips the step, so the norms say which gradient was inf/NaN.

Differences from the stock classes, on purpose: `nonfinite="skip"` by default (a step whose
global norm is inf/NaN writes nothing, Adam's beta powers included; `global_step` still
advances), a non-finite hyper-parameter is refused (by the op, nothing written), the clip under
`tf.distribute` sees the replicas' summed gradient (the stock classes sum too, and a clip put
between `compute_gradients` and `apply_gradients` would see each replica's own). Under
`tf.distribute` the step runs as the stock one: the replicas' gradients summed, then one update
of every copy. Shared by threads, an optimizer makes its slots once and runs one step at a time.

Resource variables (TF2's) and TF1 ref variables (`tf.disable_v2_behavior()`, or
`use_resource=False`) are both taken, as the stock classes take both, in one step even when a
`var_list` mixes them (one norm pass): a ref variable's slots and Adam's beta powers are ref
variables, made as the stock class makes them, and the step updates refs in place, each under
its variable's lock (always held, in the one address order of every variable the step
locks, as TF's own multi-variable ops lock; an unlocked in-place write would let a concurrent
step or `assign` interleave with half an update). As the stock classes, a ref variable's
gradient must have its dtype.

`IndexedSlices` gradients (embeddings) are applied without densifying them, as the stock
classes apply them: SGD as a scatter, Momentum on the touched rows only (duplicates summed),
Adam on every row (its slots decay everywhere; duplicates summed before squaring for `v`),
RMSProp, Adagrad, Adadelta, Ftrl, ProximalGradientDescent, ProximalAdagrad and AdagradDA on the
touched rows only (duplicates summed, as the stock base class sums them before its sparse kernel).

ProximalGradientDescent, ProximalAdagrad and AdagradDA run TF's kernel arithmetic (the core
rules `proximal_gradient_descent`, `proximal_adagrad`, `adagrad_da`). AdagradDA's update uses
the constructor's `global_step` + 1 as read when the step runs, as the stock class; a missing
one is refused at construction. Their l1/l2 strengths must be >= 0 (stock documents it; its
ProximalAdagrad kernel checks it, with lr > 0, when the step runs: tfclip refuses a number at
construction, a tensor when the step runs, before anything is written). With float64 variables
Python-number hyper-parameters work (the stock proximal classes pass them to their ops as
float32, which fails).

`state_dtype="bfloat16"` (Momentum, Adam, RMSProp, Adagrad, Adadelta; keyword-only) makes the
slots of float32 resource variables bfloat16, as `tfclip.rules` does (docs/low-precision-state.md);
`"int8"` keeps them as uint8 codes, each slot `s` with a float32 slot `s_absmax` beside it (one
value per 256 elements; in a Saver's checkpoint `<variable>/<optimizer>_<s>_absmax`). The default
is the stock layout. Such a checkpoint restores only into the same layout;
`tfclip.convert_checkpoint` moves one between the layouts.

`stochastic_rounding=True` (every class; keyword-only, with `rounding_seed`) rounds bfloat16
variables stochastically (docs/low-precision-state.md), drawing by `global_step + 1` where
`apply_gradients` is given one, else by the optimizer's own count of its steps in the graph (a
local variable, never saved).

`MixedPrecisionLossScaleOptimizer(opt, loss_scale="dynamic")` is TF1's loss-scaling wrapper
(`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`) with the unscale and the
finite check folded into `minimize`'s one fused step (tfclip/compat/_loss_scale.py); the stock
wrapper's results, two passes over the gradients fewer.

RMSProp runs TF's own kernel order (the core rule `tf_rmsprop`; keras's RMSprop rounds
differently, which a centered RMSProp with a small epsilon shows). Adagrad runs the Keras rule
with epsilon 0: TF's kernel computes `g * lr * rsqrt(accum)` where it computes
`lr * g / sqrt(accum)`, so they agree to float rounding (an ulp or two a step).
"""

import numbers

import tensorflow as tf

from tfclip._engine import opcall as _opcall
from tfclip._engine.binding import Binding
from tfclip.compat._fused import _f64, _Fused
from tfclip.compat._loss_scale import MixedPrecisionLossScaleOptimizer  # noqa: F401  (the loss-scale fold)

__all__ = ["GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer", "RMSPropOptimizer",
           "AdagradOptimizer", "AdadeltaOptimizer", "FtrlOptimizer", "ProximalGradientDescentOptimizer",
           "ProximalAdagradOptimizer", "AdagradDAOptimizer", "MixedPrecisionLossScaleOptimizer"]


def _positive_lr(opt, var_list):
    """ProximalAdagrad's learning rate: as TF's kernel, <= 0 is refused (a number at
    construction; a tensor or callable when the step runs, before anything is written)."""
    lr = opt._learning_rate
    if isinstance(lr, numbers.Real):
        return lr
    lr = _f64(lr, "learning_rate")
    check = tf.debugging.assert_positive(
        lr, message="learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it)")
    with tf.control_dependencies([check]):
        return tf.identity(lr)


def _global_step_plus_one(opt, var_list):
    """AdagradDA's global_step input: the stock class's global_step + 1, read when the step runs."""
    gs = opt._global_step
    return tf.cast(gs() if callable(gs) else gs, tf.float64) + 1.0


class GradientDescentOptimizer(_Fused):
    """tf.compat.v1.train.GradientDescentOptimizer with fused clipping."""

    _tfclip_binding = Binding("sgd", hparams=(("lr", "_learning_rate"),))

    def __init__(self, learning_rate, use_locking=False, name="GradientDescent", *, global_clipnorm=None,
                 clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        self._check_numbers(learning_rate=learning_rate)
        self._learning_rate = learning_rate


class MomentumOptimizer(_Fused):
    """tf.compat.v1.train.MomentumOptimizer (slot `momentum`) with fused clipping."""

    low_precision_state = True
    _tfclip_binding = Binding("momentum", slots=(("accum", "momentum"),),
                              hparams=(("lr", "_learning_rate"), ("momentum", "_momentum")),
                              flags=(("use_nesterov", "_use_nesterov"),))

    _slot_names = ("momentum",)
    _lazy_sparse = True  # ResourceSparseApplyMomentum updates only the touched rows

    def __init__(self, learning_rate, momentum, use_locking=False, name="Momentum", use_nesterov=False, *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0,
                 state_dtype=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip, state_dtype,
                         stochastic_rounding, rounding_seed)
        self._check_numbers(learning_rate=learning_rate, momentum=momentum)
        self._learning_rate, self._momentum, self._use_nesterov = learning_rate, momentum, use_nesterov


class AdamOptimizer(_Fused):
    """tf.compat.v1.train.AdamOptimizer (slots `m`, `v`) with fused clipping."""

    low_precision_state = True
    _tfclip_binding = Binding("adam", slots=(("m", "m"), ("v", "v")),
                              hparams=(("lr", "_lr"), ("beta_1", "_beta1"), ("beta_2", "_beta2"),
                                       ("epsilon", "_epsilon"), ("step", lambda o, _: 1.0),
                                       ("beta_1_power", lambda o, _: o._beta_powers()[0]),
                                       ("beta_2_power", lambda o, _: o._beta_powers()[1])),
                              flags=(("amsgrad", lambda o: False),))

    _slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, use_locking=False,
                 name="Adam", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0,
                 state_dtype=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip, state_dtype,
                         stochastic_rounding, rounding_seed)
        self._check_numbers(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon)
        self._lr, self._beta1, self._beta2, self._epsilon = learning_rate, beta1, beta2, epsilon

    def _create_slots(self, var_list):
        # The stock accumulators beta1^t, beta2^t (the bias correction's), as the stock class
        # creates and names them.
        first = min(var_list, key=lambda x: x.name)
        self._create_non_slot_variable(initial_value=self._beta1, name="beta1_power", colocate_with=first)
        self._create_non_slot_variable(initial_value=self._beta2, name="beta2_power", colocate_with=first)
        super()._create_slots(var_list)

    def _beta_powers(self):
        with tf.init_scope():
            graph = self._graph_key()
            return (self._get_non_slot_variable("beta1_power", graph=graph),
                    self._get_non_slot_variable("beta2_power", graph=graph))

    def _get_beta_accumulators(self):
        """The stock class's (beta1_power, beta2_power) variables: beta1^t and beta2^t, which the
        bias correction uses (TF's own Adam tests and user code read them)."""
        return self._beta_powers()

    def _finish_step(self, applied):
        # As the stock _finish (power *= beta, in the accumulator's dtype), only for an applied step.
        out = []
        for p, beta in zip(self._beta_powers(), (self._beta1, self._beta2)):
            b = tf.cast(beta() if callable(beta) else beta, p.dtype)
            out.append(p.assign(tf.where(applied, p * b, p), read_value=False))
        return out


class RMSPropOptimizer(_Fused):
    """tf.compat.v1.train.RMSPropOptimizer (slots `rms` starting at 1, `momentum`, and `mg` when
    centered) with fused clipping."""

    low_precision_state = True
    _tfclip_binding = Binding("tf_rmsprop", slots=(("rms", "rms"), ("mom", "momentum"), ("mg", "mg", "_centered")),
                              hparams=(("lr", "_learning_rate"), ("rho", "_decay"), ("momentum", "_momentum"),
                                       ("epsilon", "_epsilon")),
                              flags=(("centered", "_centered"),))

    _lazy_sparse = True  # ResourceSparseApplyRMSProp updates only the touched rows

    def __init__(self, learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, use_locking=False, centered=False,
                 name="RMSProp", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0,
                 state_dtype=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip, state_dtype,
                         stochastic_rounding, rounding_seed)
        self._check_numbers(learning_rate=learning_rate, decay=decay, momentum=momentum, epsilon=epsilon)
        self._learning_rate, self._decay, self._momentum = learning_rate, decay, momentum
        self._epsilon, self._centered = epsilon, centered
        self._slot_names = ("rms", "mg", "momentum") if centered else ("rms", "momentum")

    def _slot_initial(self, name):
        return 1.0 if name == "rms" else 0.0


class AdagradOptimizer(_Fused):
    """tf.compat.v1.train.AdagradOptimizer (slot `accumulator`, starting at
    `initial_accumulator_value`) with fused clipping."""

    low_precision_state = True
    _tfclip_binding = Binding("adagrad", slots=(("accumulator", "accumulator"),),
                              hparams=(("lr", "_learning_rate"), ("epsilon", lambda o, _: 0.0)))

    _slot_names = ("accumulator",)
    _lazy_sparse = True  # ResourceSparseApplyAdagrad updates only the touched rows

    def __init__(self, learning_rate, initial_accumulator_value=0.1, use_locking=False, name="Adagrad", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0,
                 state_dtype=None):
        if initial_accumulator_value <= 0.0:
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip, state_dtype,
                         stochastic_rounding, rounding_seed)
        self._check_numbers(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value)
        self._learning_rate, self._initial = learning_rate, initial_accumulator_value

    def _slot_initial(self, name):
        return self._initial


class AdadeltaOptimizer(_Fused):
    """tf.compat.v1.train.AdadeltaOptimizer (slots `accum`, `accum_update`; ResourceApplyAdadelta)
    with fused clipping. The core's Adadelta rule is TF's arithmetic but for TF's
    `sqrt(accum_update + eps) * rsqrt(accum + eps) * g`, computed as a quotient of square roots:
    float rounding apart (an ulp or two a step)."""

    low_precision_state = True
    _tfclip_binding = Binding("adadelta", slots=(("accumulated_grad", "accum"), ("accumulated_delta_var", "accum_update")),
                              hparams=(("lr", "_learning_rate"), ("rho", "_rho"), ("epsilon", "_epsilon")))

    _slot_names = ("accum", "accum_update")
    _lazy_sparse = True  # ResourceSparseApplyAdadelta updates only the touched rows

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-8, use_locking=False, name="Adadelta", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0,
                 state_dtype=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip, state_dtype,
                         stochastic_rounding, rounding_seed)
        self._check_numbers(learning_rate=learning_rate, rho=rho, epsilon=epsilon)
        self._learning_rate, self._rho, self._epsilon = learning_rate, rho, epsilon


class FtrlOptimizer(_Fused):
    """tf.compat.v1.train.FtrlOptimizer (slots `accum`, starting at `initial_accumulator_value`, and
    `linear`; ResourceApplyFtrl / ResourceApplyFtrlV2 with `l2 + beta / (2 * lr)`) with fused
    clipping. The stock class's argument checks, names (`accum_name`, `linear_name`) included."""

    _tfclip_binding = Binding(("ftrl", "ftrl_sqrt"), pick=lambda o: _opcall.ftrl_variant(o._power)[0],
                              slots=(("accumulator", "accum"), ("linear", "linear")),
                              hparams=(("lr", "_learning_rate"),
                                       ("lr_power", "_power", lambda o: _opcall.ftrl_variant(o._power)[0] == "ftrl"),
                                       ("l1", "_l1"), ("l2", "_l2"), ("l2_shrinkage", "_l2_shrinkage"), ("beta", "_beta")))

    _slot_names = ("accum", "linear")
    _lazy_sparse = True  # ResourceSparseApplyFtrl updates only the touched rows

    def __init__(self, learning_rate, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, use_locking=False,
                 name="Ftrl", accum_name=None, linear_name=None, l2_shrinkage_regularization_strength=0.0,
                 beta=None, *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0):
        for what, v in (("initial_accumulator_value", initial_accumulator_value),
                        ("l1_regularization_strength", l1_regularization_strength),
                        ("l2_regularization_strength", l2_regularization_strength),
                        ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength)):
            if v < 0.0:  # the stock class's checks and words
                raise ValueError(f"{what} {v:f} needs to be positive or zero")
        if learning_rate_power > 0.0:
            raise ValueError(f"learning_rate_power {learning_rate_power:f} needs to be negative or zero")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        beta = 0.0 if beta is None else beta
        self._check_numbers(learning_rate=learning_rate, learning_rate_power=learning_rate_power,
                            initial_accumulator_value=initial_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength,
                            l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength,
                            beta=beta)
        self._learning_rate, self._power, self._initial = learning_rate, learning_rate_power, initial_accumulator_value
        self._l1, self._l2, self._l2_shrinkage, self._beta = (
            l1_regularization_strength, l2_regularization_strength, l2_shrinkage_regularization_strength, beta)
        self._accum_name, self._linear_name = accum_name, linear_name

    def _create_slots(self, var_list):
        # As the stock class: accum (named after accum_name or the optimizer), then linear.
        for v in var_list:
            self._get_or_make_slot_with_initializer(
                v, tf.compat.v1.constant_initializer(self._initial, dtype=v.dtype.base_dtype), v.shape,
                v.dtype.base_dtype, "accum", self._accum_name or self._name)
            self._zeros_slot(v, "linear", self._linear_name or self._name)


class ProximalGradientDescentOptimizer(_Fused):
    """tf.compat.v1.train.ProximalGradientDescentOptimizer (FOBOS: a gradient step, then the l1
    and l2 proximal steps; ResourceApplyProximalGradientDescent) with fused clipping. No slots.
    IndexedSlices: the touched rows, each duplicate in turn, as TF's sparse kernel."""

    _tfclip_binding = Binding("proximal_gradient_descent", hparams=(("lr", "_learning_rate"), ("l1", "_l1"), ("l2", "_l2")))

    _lazy_sparse = True  # ResourceSparseApplyProximalGradientDescent updates only the touched rows

    def __init__(self, learning_rate, l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 use_locking=False, name="ProximalGradientDescent", *, global_clipnorm=None, clipnorm=None,
                 clipvalue=None, nonfinite="skip", clip=None, stochastic_rounding=False, rounding_seed=0):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        self._check_numbers(learning_rate=learning_rate, l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate = learning_rate
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength


class ProximalAdagradOptimizer(_Fused):
    """tf.compat.v1.train.ProximalAdagradOptimizer (slot `accumulator`, starting at
    `initial_accumulator_value`; ResourceApplyProximalAdagrad) with fused clipping. As TF's
    kernel, a learning rate <= 0 is refused: a number at construction (ValueError), a tensor
    when the step runs (InvalidArgumentError, nothing written). IndexedSlices: the touched rows,
    each duplicate in turn, as TF's sparse kernel."""

    _tfclip_binding = Binding("proximal_adagrad", slots=(("accumulator", "accumulator"),),
                              hparams=(("lr", _positive_lr), ("l1", "_l1"), ("l2", "_l2")))

    _slot_names = ("accumulator",)
    _lazy_sparse = True  # ResourceSparseApplyProximalAdagrad updates only the touched rows

    def __init__(self, learning_rate, initial_accumulator_value=0.1, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, use_locking=False, name="ProximalAdagrad", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0):
        if initial_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        self._check_numbers(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        if isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool) and learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it), got {learning_rate}")
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate, self._initial = learning_rate, initial_accumulator_value
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength

    def _slot_initial(self, name):
        return self._initial


class AdagradDAOptimizer(_Fused):
    """tf.compat.v1.train.AdagradDAOptimizer (slots `gradient_accumulator` and
    `gradient_squared_accumulator`, the latter starting at
    `initial_gradient_squared_accumulator_value`; ResourceApplyAdagradDA) with fused clipping.
    As the stock class, the step is given `global_step + 1`, read when the step runs (the
    constructor's `global_step`, a tensor or variable; required). IndexedSlices: the touched
    rows, each duplicate accumulated in turn, as TF's sparse kernel."""

    _tfclip_binding = Binding("adagrad_da", slots=(("gradient_accumulator", "gradient_accumulator"),
                                                   ("gradient_squared_accumulator", "gradient_squared_accumulator")),
                              hparams=(("lr", "_learning_rate"), ("l1", "_l1"), ("l2", "_l2"),
                                       ("global_step", _global_step_plus_one)))

    _slot_names = ("gradient_accumulator", "gradient_squared_accumulator")
    _lazy_sparse = True  # ResourceSparseApplyAdagradDA updates only the touched rows

    def __init__(self, learning_rate, global_step, initial_gradient_squared_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, use_locking=False,
                 name="AdagradDA", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None,
                 stochastic_rounding=False, rounding_seed=0):
        if initial_gradient_squared_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError("initial_gradient_squared_accumulator_value must be positive: "
                             f"{initial_gradient_squared_accumulator_value}")
        if global_step is None:
            # The stock class fails only when the step is built, converting None to a tensor.
            raise ValueError("AdagradDAOptimizer needs global_step, the training step counter (a tensor or "
                             "variable, e.g. tf.compat.v1.train.get_or_create_global_step()): its update "
                             "uses global_step + 1; got None")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        self._check_numbers(learning_rate=learning_rate,
                            initial_gradient_squared_accumulator_value=initial_gradient_squared_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate, self._initial = learning_rate, initial_gradient_squared_accumulator_value
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength
        self._global_step = global_step

    def _slot_initial(self, name):
        return self._initial if name == "gradient_squared_accumulator" else 0.0



# The drop-in optimizers (each bound to its rule-table row; tests/test_rules_adding.py), without
# the loss-scale wrapper.
_CLASSES = tuple(globals()[n] for n in __all__ if n != "MixedPrecisionLossScaleOptimizer")
