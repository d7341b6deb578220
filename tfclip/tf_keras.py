"""Drop-in tf_keras (Keras 2) optimizers whose update is one fused clip-and-apply op over all
variables.

For projects on the `tf-keras` package (Keras 2; `TF_USE_LEGACY_KERAS=1` makes
`tf.keras.optimizers.Adam` the tf_keras class). Change one line::

    optimizer = tf_keras.optimizers.Adam(1e-3, global_clipnorm=1.0)   # before
    optimizer = tfclip.tf_keras.Adam(1e-3, global_clipnorm=1.0)       # after

`SGD`, `Adam`, `AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam`, `Lion` and `Ftrl` subclass
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
`lazy_sparse` (False by default; True updates only the rows an IndexedSlices gradient touches).
`global_norm`, `tensor_norms`, `skipped_steps`, `clipped_steps` and `clip_scale_sum` are tfclip's
own variables, outside `optimizer.variables` and checkpoints.

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
import sys

import tensorflow as tf

from tfclip import _opcall
from tfclip._tf_keras_legacy import _LEGACY_CLASSES, legacy
from tfclip._tf_keras_step import _FusedMixin, _tf_keras

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "legacy",
           "get"]

_stock = _tf_keras.optimizers


class SGD(_FusedMixin, _stock.SGD):
    """tf_keras.optimizers.SGD (momentum, nesterov) as one fused op. Extra: `nonfinite`, `lazy_sparse`."""

    _checked = ("momentum",)

    def _op_inputs(self, tvars):
        # Stock tf_keras SGD writes its `m` slots with momentum 0 too (m = -lr * g): always the
        # Keras momentum rule.
        return ("keras_momentum", [self._slot_handles(self.momentums, tvars)],
                {"momentum": self.momentum}, {"use_nesterov": bool(self.nesterov)})


class Adam(_FusedMixin, _stock.Adam):
    """tf_keras.optimizers.Adam (amsgrad, adaptive_epsilon) as one fused op. Extra: `nonfinite`,
    `lazy_sparse`."""

    _checked = ("beta_1", "beta_2", "epsilon")

    def _op_inputs(self, tvars):
        slots = [self._slot_handles(self._momentums, tvars), self._slot_handles(self._velocities, tvars)]
        if self.amsgrad:
            slots.append(self._slot_handles(self._velocity_hats, tvars))
        epsilon = self.epsilon
        if getattr(self, "adaptive_epsilon", False):
            # stock: epsilon * sqrt(1 - beta_2^t), in the variables' dtype (float32 here)
            dtype = tvars[0].dtype.base_dtype
            beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), tf.cast(self.iterations + 1, dtype))
            epsilon = self.epsilon * tf.sqrt(1 - beta_2_power)
        hparams = {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": epsilon, "step": self._step()}
        return "adam", slots, hparams, {"amsgrad": bool(self.amsgrad)}


class AdamW(_FusedMixin, _stock.AdamW):
    """tf_keras.optimizers.AdamW (decoupled weight decay) as one fused op. Extra: `nonfinite`,
    `lazy_sparse`."""

    _checked = ("beta_1", "beta_2", "epsilon")
    _op_inputs = Adam._op_inputs


class RMSprop(_FusedMixin, _stock.RMSprop):
    """tf_keras.optimizers.RMSprop (rho, momentum, centered) as one fused op."""

    _checked = ("rho", "momentum", "epsilon")

    def _op_inputs(self, tvars):
        slots = {"velocity": self._slot_handles(self._velocities, tvars)}
        if self.momentum > 0:
            slots["momentum_slot"] = self._slot_handles(self._momentums, tvars)
        if self.centered:
            slots["average_gradient"] = self._slot_handles(self._average_gradients, tvars)
        return ("rmsprop", slots, {"rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon},
                {"centered": bool(self.centered), "has_momentum": self.momentum > 0})


class Adagrad(_FusedMixin, _stock.Adagrad):
    """tf_keras.optimizers.Adagrad as one fused op."""

    _checked = ("epsilon", "initial_accumulator_value")

    def _op_inputs(self, tvars):
        return ("adagrad", [self._slot_handles(self._accumulators, tvars)], {"epsilon": self.epsilon}, {})


class Adadelta(_FusedMixin, _stock.Adadelta):
    """tf_keras.optimizers.Adadelta as one fused op."""

    _checked = ("rho", "epsilon")

    def _op_inputs(self, tvars):
        return ("adadelta", [self._slot_handles(self._accumulated_grads, tvars),
                             self._slot_handles(self._accumulated_delta_vars, tvars)],
                {"rho": self.rho, "epsilon": self.epsilon}, {})


class Adamax(_FusedMixin, _stock.Adamax):
    """tf_keras.optimizers.Adamax as one fused op."""

    _checked = ("beta_1", "beta_2", "epsilon")

    def _op_inputs(self, tvars):
        return ("adamax", [self._slot_handles(self._m, tvars), self._slot_handles(self._u, tvars)],
                {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon, "step": self._step()}, {})


class Nadam(_FusedMixin, _stock.Nadam):
    """tf_keras.optimizers.Nadam as one fused op, its momentum-cache product `_u_product` (a
    variable stock tf_keras creates in `build`, saved in checkpoints) advanced once per step.

    Stock tf_keras decides whether to advance it with a Python counter compared with
    `iterations` per variable: eagerly that advances it once per step, as here; inside a
    `tf.function` (model.fit) with more than one variable it advances once per variable from the
    second step on, which this class does not copy (its trajectory is the eager one)."""

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

    def _op_inputs(self, tvars):
        return ("nadam", [self._slot_handles(self._momentums, tvars), self._slot_handles(self._velocities, tvars)],
                {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon, "step": self._step(),
                 "u_product": self._u_next}, {})


class Lion(_FusedMixin, _stock.Lion):
    """tf_keras.optimizers.Lion as one fused op."""

    _checked = ("beta_1", "beta_2")

    def _op_inputs(self, tvars):
        return ("lion", [self._slot_handles(self.momentums, tvars)],
                {"beta_1": self.beta_1, "beta_2": self.beta_2}, {})


class Ftrl(_FusedMixin, _stock.Ftrl):
    """tf_keras.optimizers.Ftrl (l1, l2, l2 shrinkage, learning_rate_power, beta) as one fused op."""

    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "l2_shrinkage_regularization_strength", "beta", "initial_accumulator_value")

    def _op_inputs(self, tvars):
        kind, power = _opcall.ftrl_variant(self.learning_rate_power)
        return (kind, [self._slot_handles(self._accumulators, tvars), self._slot_handles(self._linears, tvars)],
                {**power, "l1": self.l1_regularization_strength, "l2": self.l2_regularization_strength,
                 "l2_shrinkage": self.l2_shrinkage_regularization_strength, "beta": self.beta}, {})


_CLASSES = (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl)

_BY_NAME = {c.__name__.lower(): c for c in _CLASSES}


def get(identifier):
    """tf_keras.optimizers.get, giving tfclip's class where tfclip has one (`get("adam")` is a
    `tfclip.tf_keras.Adam`); a tfclip.keras (Keras 3) optimizer is refused with the class to use."""
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    _refuse_keras3(identifier)
    return _stock.get(identifier)


def _refuse_keras3(obj):
    """A tfclip.keras (Keras 3) optimizer handed to tf_keras: a ValueError naming both libraries
    and the class to use."""
    k3 = sys.modules.get("tfclip.keras")
    if k3 is None or not isinstance(obj, getattr(k3, "_FusedMixin", ())):
        return
    name = next(c.__name__ for c in type(obj).__mro__ if c.__module__ == "tfclip.keras")
    raise ValueError(
        f"tfclip.keras.{name} is an optimizer for Keras 3 (the keras package), but it was given to "
        f"tf_keras (Keras 2, the tf-keras package; TF_USE_LEGACY_KERAS=1 makes tf.keras that): use "
        f"tfclip.tf_keras.{name} with tf_keras models, and tfclip.keras.{name} with Keras 3 models.")


def _refuse_tf_keras(obj):
    """A tfclip.tf_keras (Keras 2) optimizer handed to Keras 3: the same, the other way round."""
    if not isinstance(obj, _FusedMixin):
        return
    name = next(c.__name__ for c in type(obj).__mro__ if c.__module__ == __name__)
    raise ValueError(
        f"tfclip.tf_keras.{name} is an optimizer for tf_keras (Keras 2, the tf-keras package), but "
        f"it was given to Keras 3 (the keras package): use tfclip.keras.{name} with Keras 3 models, "
        f"and tfclip.tf_keras.{name} with tf_keras models (or set TF_USE_LEGACY_KERAS=1 and build "
        "the model with tf_keras).")


# Registered so tf_keras's load_model finds them without custom_objects.
for _cls in _CLASSES:
    _tf_keras.utils.register_keras_serializable(package="tfclip")(_cls)
for _cls in _LEGACY_CLASSES:
    _tf_keras.utils.register_keras_serializable(package="tfclip", name="legacy." + _cls.__name__)(_cls)


def _wrap_get(module, refuse):
    """Wraps `module.get` (what Model.compile calls for its optimizer) so that a tfclip optimizer
    of the other Keras says which class to use, where the stock error would be
    `Could not interpret optimizer identifier`. Everything else goes to the stock `get`."""
    stock_get = module.get
    if getattr(stock_get, "_tfclip_refuses", None) is refuse:
        return
    def get(identifier, *args, **kwargs):
        refuse(identifier)
        return stock_get(identifier, *args, **kwargs)
    get._tfclip_refuses = refuse
    get.__wrapped__ = stock_get
    get.__doc__ = stock_get.__doc__
    module.get = get


def _install_mixup_errors():
    from tf_keras.src import optimizers as tf_keras_optimizers

    _wrap_get(tf_keras_optimizers, _refuse_keras3)
    try:
        import keras

        if int(str(keras.__version__).split(".")[0]) < 3:
            return
        from keras.src import optimizers as keras_optimizers
    except Exception:  # no Keras 3 here: nothing to guard
        return
    _wrap_get(keras_optimizers, _refuse_tf_keras)


_install_mixup_errors()
