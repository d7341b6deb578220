"""Drop-in tf_keras (Keras 2) optimizers whose update is one fused clip-and-apply op over all
variables.

For projects on the `tf-keras` package (Keras 2; `TF_USE_LEGACY_KERAS=1` makes
`tf.keras.optimizers.Adam` the tf_keras class). Change one line::

    optimizer = tf_keras.optimizers.Adam(1e-3, global_clipnorm=1.0)   # before
    optimizer = tfclip.tf_keras.Adam(1e-3, global_clipnorm=1.0)       # after

`SGD`, `Adam`, `AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam`, `Lion`, `Ftrl` and `Adafactor` subclass
the stock `tf_keras.optimizers` classes and take the same constructor arguments (learning-rate
schedules, `clipnorm`, `clipvalue`, `global_clipnorm`, `weight_decay`, `use_ema`, `jit_compile`,
Adam's `adaptive_epsilon`, ...), create the same variables (`optimizer.variables` is the stock
list, so `tf.train.Checkpoint`s move both ways between stock tf_keras and tfclip) and keep the
stock `apply_gradients(grads_and_vars, name=None, skip_gradients_aggregation=False)`: the
gradients are summed across replicas first (tf_keras does too), then the global norm, the clip,
the weight decay and the update of every variable are one fused op. IndexedSlices gradients
(embeddings) go to the op without densifying: each raw slice clipped, the duplicate rows summed
before the update, as stock tf_keras does, so they follow the stock trajectory.

Extra keyword-only arguments, as in `tfclip.keras`: `nonfinite` ("skip" by default: a step whose
global norm is inf/NaN writes no variable or slot and counts in `skipped_steps`, `iterations`
still advances; "propagate": stock behaviour; "raise": the step fails, nothing written) and
`lazy_sparse` (False by default; True updates only the rows an IndexedSlices gradient touches),
`clip` (adaptive clipping, tfclip.clipping) and `state_dtype` ("bfloat16": a float32 variable's
slots stored as bfloat16; "int8": as uint8 codes with a float32 absmax variable per slot, one
value per 256 elements, `tfclip_absmax(slot)`, saved with the optimizer; all classes but Ftrl;
docs/low-precision-state.md).
`global_norm`, `tensor_norms`, `skipped_steps`, `clipped_steps` and `clip_scale_sum` are tfclip's
own variables, outside `optimizer.variables` and checkpoints. `LossScaleOptimizer` folds
mixed_float16's unscale and finite check into `minimize`'s one fused step, for the new optimizers
and (as tf_keras's own wrapper, by the inner optimizer's kind) the legacy ones
(tfclip/tf_keras/_loss_scale.py).

`Nadam` follows stock tf_keras's eager trajectory also inside a `tf.function` (see its docstring:
stock advances its momentum-cache product once per variable there).

`tfclip.tf_keras.legacy.SGD`, `Adam`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Ftrl` and
`Nadam` subclass the `tf_keras.optimizers.legacy` (OptimizerV2) classes, on the core rules that
compute TF's training ops and stock's own update (see `legacy`). Complex variables,
`gradient_transformers`, more than one clip argument and legacy Nadam's IndexedSlices gradients
(stock's update there is neither the dense nor the lazy one) run the stock step (a warning once).

Inside an XLA-compiled function (`model.compile(..., jit_compile=True)`) the fused op compiles to
tfclip's own XLA custom calls; a build of tfclip without them warns once and runs the stock
tf_keras step there (which also clips after the all-reduce).
"""
import tensorflow as tf

from tfclip._engine import mixup as _mixup
from tfclip._engine import opcall as _opcall
from tfclip._engine import shard as _shard
from tfclip._engine import step as _step
from tfclip._engine import keras_bindings as _kb
from tfclip._engine.binding import STEP, Binding
from tfclip.tf_keras._legacy import _LEGACY_CLASSES, legacy
from tfclip.tf_keras._dropin import _FusedMixin, _tf_keras

__all__ = ["LossScaleOptimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl",
           "Adafactor", "legacy", "get"]

_stock = _tf_keras.optimizers


# -- the drop-ins: each class's rule binding is one data row (tfclip/_engine/step.py, Binding) -------
def _adam_epsilon(opt, tvars):
    """Adam's epsilon; with `adaptive_epsilon`, stock's epsilon * sqrt(1 - beta_2^t), in the
    variables' dtype."""
    if not getattr(opt, "adaptive_epsilon", False):
        return opt.epsilon
    dtype = tvars[0].dtype.base_dtype
    beta_2_power = tf.pow(tf.cast(opt.beta_2, dtype), tf.cast(opt.iterations + 1, dtype))
    return opt.epsilon * tf.sqrt(1 - beta_2_power)


_ADAM = Binding("adam", slots=_kb.M_V + (("vhat", "_velocity_hats", "amsgrad"),),
                hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", _adam_epsilon), ("step", STEP)),
                flags=(("amsgrad", "amsgrad"),))


class SGD(_FusedMixin, _stock.SGD):
    """tf_keras.optimizers.SGD (momentum, nesterov) as one fused op. Extra: `nonfinite`, `lazy_sparse`."""

    # Stock tf_keras SGD writes its `m` slots with momentum 0 too (m = -lr * g): always the
    # Keras momentum rule.
    _tfclip_binding = Binding("keras_momentum", slots=(("accum", "momentums"),), hparams=(("momentum", "momentum"),),
                              flags=(("use_nesterov", "nesterov"),))
    _checked = ("momentum",)


class Adam(_FusedMixin, _stock.Adam):
    """tf_keras.optimizers.Adam (amsgrad, adaptive_epsilon) as one fused op. Extra: `nonfinite`,
    `lazy_sparse`."""

    _tfclip_binding = _ADAM
    _checked = ("beta_1", "beta_2", "epsilon")


class AdamW(_FusedMixin, _stock.AdamW):
    """tf_keras.optimizers.AdamW (decoupled weight decay) as one fused op. Extra: `nonfinite`,
    `lazy_sparse`."""

    _tfclip_binding = _ADAM
    _checked = ("beta_1", "beta_2", "epsilon")


class RMSprop(_FusedMixin, _stock.RMSprop):
    """tf_keras.optimizers.RMSprop (rho, momentum, centered) as one fused op."""

    _tfclip_binding = _kb.RMSPROP
    _checked = ("rho", "momentum", "epsilon")


class Adagrad(_FusedMixin, _stock.Adagrad):
    """tf_keras.optimizers.Adagrad as one fused op."""

    _tfclip_binding = _kb.ADAGRAD
    _checked = ("epsilon", "initial_accumulator_value")


class Adadelta(_FusedMixin, _stock.Adadelta):
    """tf_keras.optimizers.Adadelta as one fused op."""

    _tfclip_binding = _kb.ADADELTA
    _checked = ("rho", "epsilon")


class Adamax(_FusedMixin, _stock.Adamax):
    """tf_keras.optimizers.Adamax as one fused op."""

    _tfclip_binding = _kb.ADAMAX
    _checked = ("beta_1", "beta_2", "epsilon")


class Nadam(_FusedMixin, _stock.Nadam):
    """tf_keras.optimizers.Nadam as one fused op, its momentum-cache product `_u_product` (a
    variable stock tf_keras creates in `build`, saved in checkpoints) advanced once per step.

    Stock tf_keras decides whether to advance it with a Python counter compared with
    `iterations` per variable: eagerly that advances it once per step, as here; inside a
    `tf.function` (model.fit) with more than one variable it advances once per variable from the
    second step on, which this class does not copy (its trajectory is the eager one)."""

    _tfclip_binding = _kb.NADAM
    _checked = ("beta_1", "beta_2", "epsilon")

    def _fused_step(self, grads, tvars):
        dtype = self._u_product.dtype
        t = tf.cast(self.iterations + 1, dtype)
        u_t = tf.cast(self.beta_1, dtype) * (1.0 - 0.5 * tf.pow(tf.cast(0.96, dtype), t))
        # The product through this step goes to the op; it is stored only after the op ran (a
        # step that fails writes nothing). A skipped step advances it, as it advances iterations.
        self._u_next = self._u_product * u_t
        applied = super()._fused_step(grads, tvars)
        with tf.control_dependencies([applied]):
            self._u_product.assign(self._u_next)
        return applied


class Lion(_FusedMixin, _stock.Lion):
    """tf_keras.optimizers.Lion as one fused op."""

    _tfclip_binding = Binding("lion", slots=(("m", "momentums"),), hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2")))
    _checked = ("beta_1", "beta_2")


class Ftrl(_FusedMixin, _stock.Ftrl):
    """tf_keras.optimizers.Ftrl (l1, l2, l2 shrinkage, learning_rate_power, beta) as one fused op."""

    low_precision_state = False  # (its linear slot is a weight: tfclip.rules says why)

    _tfclip_binding = _kb.FTRL
    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "l2_shrinkage_regularization_strength", "beta", "initial_accumulator_value")


class Adafactor(_FusedMixin, _stock.Adafactor):
    """tf_keras.optimizers.Adafactor as fused ops: Adafactor's own passes after the norm
    (csrc/core/factored.h; tfclip.keras.Adafactor says more), the stock slots `_r`, `_c`, `_v`.
    Extra: `factored_state=True` (a scalar placeholder for the `v` of each variable of rank >= 2,
    which stock writes every step and never reads back). `clip_threshold` is Adafactor's bound
    on rms(u); an adaptive `clip=`'s threshold is `adaptive_threshold`."""

    _tfclip_binding = _kb.ADAFACTOR
    _checked = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold")
    low_precision_state = False
    int8_state = False
    clip_threshold = 1.0  # (the stock attribute, over tfclip's property of that name)

    def __init__(self, *args, factored_state=False, **kwargs):
        object.__setattr__(self, "factored_state", bool(factored_state))
        super().__init__(*args, **kwargs)

    def _tfclip_state_weights(self, var_list):
        # factored_state: a matrix keeps its row and column sums (r, c) and no full v
        return _shard.factored_weights([v.shape for v in var_list]) if self.factored_state else None

    def _tfclip_build_slots(self, var_list):
        if self._tfclip_owner is None or getattr(self, "_built", False):
            return super()._tfclip_build_slots(var_list)
        # shard_state (tfclip/_engine/shard.py): tf_keras's Adafactor makes r and c with add_variable (a
        # rank < 2 variable's with tf.Variable), not from the reference variable; the same
        # variables, names and order here, each variable's three on its owner's device.
        _tf_keras.optimizers.Optimizer.build(self, var_list)
        self._built = True
        self._r, self._c, self._v = [], [], []
        for var in var_list:
            with self._tfclip_slot_scope(var):
                if len(var.shape) < 2:  # (placeholders; RemoteSlots where another worker owns var)
                    self._r.append(tf.Variable(0, name=f"r/{var._shared_name}"))
                    self._c.append(tf.Variable(0, name=f"r/{var._shared_name}"))
                else:
                    self._r.append(self.add_variable(shape=var.shape[:-1], dtype=var.dtype,
                                                     name=f"r/{var._shared_name}"))
                    self._c.append(self.add_variable(shape=var.shape[:-2] + var.shape[-1], dtype=var.dtype,
                                                     name=f"c/{var._shared_name}"))
            self._v.append(self.add_variable_from_reference(model_variable=var, variable_name="v"))

    def add_variable_from_reference(self, model_variable, variable_name, shape=None, initial_value=None):
        if variable_name == "v" and self.factored_state and len(model_variable.shape) >= 2:
            shape = ()
        return super().add_variable_from_reference(model_variable, variable_name, shape, initial_value)


_CLASSES = (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl, Adafactor)

_BY_NAME = {c.__name__.lower(): c for c in _CLASSES}


def get(identifier):
    """tf_keras.optimizers.get, giving tfclip's class where tfclip has one (`get("adam")` is a
    `tfclip.tf_keras.Adam`); a tfclip.keras (Keras 3) optimizer is refused with the class to use."""
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    _mixup.check(identifier, "tf_keras")
    return _stock.get(identifier)


# (tfclip.tf_keras.LossScaleOptimizer; given a legacy optimizer it makes the legacy wrapper)
from tfclip.tf_keras._loss_scale import LegacyLossScaleOptimizer, LossScaleOptimizer  # noqa: E402

# Registered so tf_keras's load_model finds them without custom_objects.
for _cls in _CLASSES + (LossScaleOptimizer, LegacyLossScaleOptimizer):
    _tf_keras.utils.register_keras_serializable(package="tfclip")(_cls)
for _cls in _LEGACY_CLASSES:
    _tf_keras.utils.register_keras_serializable(package="tfclip", name="legacy." + _cls.__name__)(_cls)


_mixup.install()
