"""Update rules for `tfclip.fused_clip_apply`: hyper-parameters, step counter and slots.

A rule object is a small optimizer without `minimize`: it owns

- the hyper-parameters (Python numbers, tensors, `tf.Variable`s, or a learning-rate schedule
  — a `keras.optimizers.schedules.LearningRateSchedule` or any callable taking the step);
- `iterations`, an int64 `tf.Variable` counting the steps actually applied (a step skipped for a
  non-finite norm does not count); Adam's bias correction uses `iterations + 1`, as Keras;
- one set of slot variables per model variable, created on first use (zeros, the variable's
  dtype and shape, not trainable), under `tf.init_scope()` so a first call inside
  `tf.function` works. `rule.slots(var)` returns them by name; `rule.variables` lists all.

Reuse one rule object for one set of variables across steps, as you would an optimizer. In
TF1 graph mode, build the step before `tf.compat.v1.global_variables_initializer()`.

The rules match TF's own training ops and the Keras 3 optimizers:

===================  =========================================================================
`SGD`                keras.optimizers.SGD (plain, momentum, nesterov)
`Momentum`           tf.compat.v1.train.MomentumOptimizer (ResourceApplyMomentum)
`Adam`               keras.optimizers.Adam / ResourceApplyAdam (amsgrad too)
`AdamW`              keras.optimizers.AdamW (decoupled weight decay before the step)
`Adagrad`            keras.optimizers.Adagrad / ResourceApplyAdagradV2
`RMSprop`            keras.optimizers.RMSprop (momentum, centered)
`Adadelta`           keras.optimizers.Adadelta
`Adamax`             keras.optimizers.Adamax
`Lion`               keras.optimizers.Lion
`Nadam`              keras.optimizers.Nadam (its momentum-cache product carried across steps)
`Ftrl`               keras.optimizers.Ftrl / ResourceApplyFtrlV2
`Lamb`               keras.optimizers.Lamb (a per-tensor trust ratio: three passes, not two)
`Adafactor`          keras.optimizers.Adafactor (factored second moments: passes of its own;
                     `factored_state=True` keeps no full `v` for a matrix)
`ScheduleFreeAdamW`  keras.optimizers.ScheduleFreeAdamW (warmup_steps; slot `momentum` starts
                     as a copy of the variable)
`ProximalGradient`   tf.compat.v1.train.ProximalGradientDescentOptimizer
`Descent`            (ResourceApplyProximalGradientDescent; no slots)
`ProximalAdagrad`    tf.compat.v1.train.ProximalAdagradOptimizer (ResourceApplyProximalAdagrad)
`AdagradDA`          tf.compat.v1.train.AdagradDAOptimizer (its global_step = iterations)
===================  =========================================================================

Adagrad, RMSprop, Adadelta, Adamax and Lion match stock Keras bit for bit on dense gradients
(clip by value or none; a norm clip differs in the scale's last bit, Keras's norm being
float32). With IndexedSlices they give the densified gradient's update, as the other rules do
here (a row's duplicates summed, every row's slots updated).

The three TF1 proximal rules take no `weight_decay` (the stock classes have none). Their
IndexedSlices gradients are densified by default (every row gets the l1/l2 shrink);
`lazy_sparse=True` gives TF1's sparse kernels' update (the touched rows only).

`weight_decay` on any other rule is Keras's decoupled decay: `var -= var * weight_decay * lr` first.

`state_dtype="bfloat16"` (SGD with momentum, Momentum, Adam, AdamW, Adagrad, RMSprop, Adadelta,
Adamax, Lion, Nadam, Lamb) keeps the slots of float32 variables as bfloat16: half the optimizer
state's bytes. Each slot is read to float32, updated exactly as a float32 slot would be, and
rounded to the nearest bfloat16 when stored (docs/low-precision-state.md). Slots of float16,
bfloat16 and float64 variables keep their variable's dtype. The default, `None`, is the stock
layout. Ftrl, ScheduleFreeAdamW and the TF1 proximal rules keep their state as it is: their slots
are weights or sums the update cannot lose precision in (`state_dtype` there is an error).

`shard_state=True` (every rule): under MirroredStrategy, `fused_clip_apply` inside `strategy.run`
keeps each variable's slots on one replica (`rule.state_owners(variables)`; `rule.build(variables)`
makes them before a first step) and gives the unsharded step's bits, but for stochastic rounding's
draw (docs/distribute.md, Sharded optimizer state).

`reduce_dtype="bfloat16"` (or "float16", every rule): inside `strategy.run` the float32 variables'
gradients are summed across replicas in 16 bits and the step uses that sum
(tfclip/_engine/reduce.py; docs/distribute.md, Gradients summed in 16 bits).
"""
import numbers

import tensorflow as tf

from tfclip._engine import opcall as _opcall
from tfclip._engine import shard as _shard
from tfclip._engine import checks as _checks
from tfclip._engine.opcall import ClipApplyResult  # noqa: F401  (tfclip.rules.ClipApplyResult)
from tfclip.rules._base import Rule
from tfclip._engine.binding import STEP, Binding


def _check_range(name, v, lo, hi, lo_open=False, hi_open=False):
    """A stock class's own constructor check, for the rule that mirrors it (numbers only)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}"
                         f"{')' if hi_open else ']'} (as the stock class checks it), got {v}")


def _has_momentum(rule):
    return rule._has_momentum()


_BETAS_EPSILON_STEP = (("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"), ("step", STEP))
_L1_L2 = (("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"))


class SGD(Rule):
    """Keras SGD: `var -= lr * g`; with `momentum`: `m = momentum*m - lr*g; var += m` (nesterov:
    `var += momentum*m - lr*g`). Slot `momentum` exists only when momentum is not the number 0."""

    binding = Binding(("sgd", "keras_momentum"), pick=lambda r: "keras_momentum" if r._has_momentum() else "sgd",
                      slots=(("accum", "momentum", _has_momentum),), hparams=(("momentum", "momentum", _has_momentum),),
                      flags=(("use_nesterov", "nesterov", _has_momentum),))

    low_precision_state = True

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, weight_decay=0.0, name=None,
                 state_dtype=None, shard_state=False, reduce_dtype=None):
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _check_stock_ranges(self):
        _check_range("momentum", self.momentum, 0.0, 1.0)  # keras.optimizers.SGD's

    def _has_momentum(self):
        return not (isinstance(self.momentum, numbers.Real) and self.momentum == 0)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "momentum": self.momentum,
                "weight_decay": self.weight_decay}


class Momentum(Rule):
    """tf.compat.v1 MomentumOptimizer: `accum = momentum*accum + g; var -= lr*accum` (nesterov:
    `var -= lr*g + lr*momentum*accum`). Slot: `momentum`."""

    binding = Binding("momentum", slots=(("accum", "momentum"),), hparams=(("momentum", "momentum"),),
                      flags=(("use_nesterov", "use_nesterov"),))

    low_precision_state = True

    def __init__(self, learning_rate, momentum, use_nesterov=False, weight_decay=0.0, name=None,
                 state_dtype=None, shard_state=False, reduce_dtype=None):
        self.momentum = momentum
        self.use_nesterov = bool(use_nesterov)
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "momentum": self.momentum,
                "weight_decay": self.weight_decay}


class Adam(Rule):
    """Keras Adam / ResourceApplyAdam, epsilon outside the sqrt, bias correction from
    `iterations + 1`. Slots: `m`, `v` (and `vhat` with amsgrad)."""

    binding = Binding("adam", slots=(("m", "m"), ("v", "v"), ("vhat", "vhat", "amsgrad")), hparams=_BETAS_EPSILON_STEP,
                      flags=(("amsgrad", "amsgrad"),))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, weight_decay=0.0, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.amsgrad = bool(amsgrad)
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1,
                "beta_2": self.beta_2, "epsilon": self.epsilon, "weight_decay": self.weight_decay}


class AdamW(Adam):
    """Keras AdamW: Adam with decoupled weight decay (default 0.004, as Keras)."""

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, amsgrad=False, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)


class Adagrad(Rule):
    """Keras Adagrad / ResourceApplyAdagradV2: `accumulator += g^2; var -= lr*g /
    sqrt(accumulator + epsilon)`. Slot `accumulator`, starting at `initial_accumulator_value`."""

    binding = Binding("adagrad", slots=(("accumulator", "accumulator"),), hparams=(("epsilon", "epsilon"),))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                 weight_decay=0.0, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "epsilon": self.epsilon,
                "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value


class RMSprop(Rule):
    """Keras RMSprop (`rho`, `momentum`, `centered`). Slots `velocity`, `momentum` (when momentum
    is not the number 0) and `average_gradient` (centered)."""

    binding = Binding("rmsprop", slots=(("velocity", "velocity"), ("momentum_slot", "momentum", _has_momentum),
                                        ("average_gradient", "average_gradient", "centered")),
                      hparams=(("rho", "rho"), ("momentum", "momentum"), ("epsilon", "epsilon")),
                      flags=(("centered", "centered"), ("has_momentum", _has_momentum)))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False,
                 weight_decay=0.0, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        self.rho, self.momentum, self.epsilon = rho, momentum, epsilon
        self.centered = bool(centered)
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _has_momentum(self):
        # As Keras: a momentum slot only for momentum > 0 (a number <= 0 is no momentum).
        return not (isinstance(self.momentum, numbers.Real) and self.momentum <= 0)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "rho": self.rho, "momentum": self.momentum,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}


class Adadelta(Rule):
    """Keras Adadelta. Slots `accumulated_grad`, `accumulated_delta_var`."""

    binding = Binding("adadelta", slots=(("accumulated_grad", "accumulated_grad"),
                                         ("accumulated_delta_var", "accumulated_delta_var")),
                      hparams=(("rho", "rho"), ("epsilon", "epsilon")))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-7, weight_decay=0.0, name=None,
                 state_dtype=None, shard_state=False, reduce_dtype=None):
        self.rho, self.epsilon = rho, epsilon
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "rho": self.rho, "epsilon": self.epsilon,
                "weight_decay": self.weight_decay}


class _BetasEpsilonStep(Rule):
    """A rule taking beta_1, beta_2 and epsilon, its bias correction from `iterations + 1`."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.0, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}


class Adamax(_BetasEpsilonStep):
    """Keras Adamax, bias correction from `iterations + 1`. Slots `m`, `u`."""

    binding = Binding("adamax", slots=(("m", "m"), ("u", "u")), hparams=_BETAS_EPSILON_STEP)
    low_precision_state = True

class Lion(Rule):
    """Keras Lion: `var -= lr * sign(m*beta_1 + g*(1 - beta_1)); m = m*beta_2 + g*(1 - beta_2)`.
    Slot `m`."""

    binding = Binding("lion", slots=(("m", "m"),), hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2")))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.99, weight_decay=0.0, name=None,
                 state_dtype=None, shard_state=False, reduce_dtype=None):
        self.beta_1, self.beta_2 = beta_1, beta_2
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _check_stock_ranges(self):
        _check_range("beta_1", self.beta_1, 0.0, 1.0, lo_open=True)  # keras.optimizers.Lion's

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "weight_decay": self.weight_decay}


class Nadam(Rule):
    """Keras Nadam. Slots `m`, `v`; the momentum-cache product `u_product` (a variable of the first
    variable's dtype, as Keras keeps it) advances only with an applied step."""

    binding = Binding("nadam", slots=(("m", "m"), ("v", "v")),
                      hparams=_BETAS_EPSILON_STEP + (("u_product", lambda r, _: r._advanced_u_product()),))

    low_precision_state = True

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.0, name=None, state_dtype=None, shard_state=False, reduce_dtype=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.u_product = None  # made on the first step
        self._next_u_product = None
        super().__init__(learning_rate, weight_decay, name, state_dtype,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}

    @property
    def variables(self):
        return super().variables + ([self.u_product] if self.u_product is not None else [])

    def _host_counter(self):
        return None  # the product needs t before the op: the step is counted here

    def _advanced_u_product(self):
        """The product through this step (the op's `u_product`; stored once the op ran): as
        Keras, u_product * beta_1 * (1 - 0.5 * 0.96^t), in u_product's dtype."""
        u = self.u_product
        t = tf.cast(self._tfclip_step(), u.dtype)
        self._next_u_product = u * tf.cast(self.beta_1, u.dtype) * (1.0 - 0.5 * tf.pow(tf.constant(0.96, u.dtype), t))
        return self._next_u_product

    def _make_state(self, variables):
        super()._make_state(variables)
        if self.u_product is None:
            with _opcall.state_lock(self), _checks.state_scope():
                if self.u_product is None:
                    self.u_product = tf.Variable(
                        tf.ones([], variables[0].dtype), trainable=False, name=f"{self.name}/u_product",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _state_variables(self, variables):
        self._make_state(variables)
        return super()._state_variables(variables) + [self.u_product]

    def _before_step(self, variables):
        if self.u_product is None:
            self._make_state(variables)

    def _after_step(self, applied):
        nxt = tf.where(applied, self._next_u_product, self.u_product)
        return [self.u_product.assign(nxt, read_value=False)]


class Ftrl(Rule):
    """Keras Ftrl / ResourceApplyFtrlV2 (`learning_rate_power`, `l1_regularization_strength`,
    `l2_regularization_strength`, `l2_shrinkage_regularization_strength`, `beta`). Slots
    `accumulator` (starting at `initial_accumulator_value`) and `linear`."""

    binding = Binding(("ftrl", "ftrl_sqrt"), pick=lambda r: _opcall.ftrl_variant(r.learning_rate_power)[0],
                      slots=(("accumulator", "accumulator"), ("linear", "linear")),
                      hparams=(("lr_power", "learning_rate_power", lambda r: r.kind == "ftrl"),
                               ("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"),
                               ("l2_shrinkage", "l2_shrinkage_regularization_strength"), ("beta", "beta")))

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l2_shrinkage_regularization_strength=0.0, beta=0.0, weight_decay=0.0, name=None,
                 shard_state=False, reduce_dtype=None):
        self.learning_rate_power = learning_rate_power
        self.initial_accumulator_value = initial_accumulator_value
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.l2_shrinkage_regularization_strength = l2_shrinkage_regularization_strength
        self.beta = beta
        if initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}")
        super().__init__(learning_rate, weight_decay, name, shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "learning_rate_power": self.learning_rate_power,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength,
                "l2_shrinkage_regularization_strength": self.l2_shrinkage_regularization_strength,
                "beta": self.beta, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value if name == "accumulator" else 0.0


class Lamb(_BetasEpsilonStep):
    """Keras Lamb: Adam's moments, the update `u = m_hat / (sqrt(v_hat) + epsilon)` scaled per
    tensor by `|w| / |u|` (1 if either is 0), bias correction from `iterations + 1`. Slots `m`,
    `v`. The ratio needs every update before a variable moves: a third pass over memory."""

    binding = Binding("lamb", slots=(("m", "m"), ("v", "v")), hparams=_BETAS_EPSILON_STEP)
    low_precision_state = True
    int8_state = False
    int8_state_why = "its trust ratio reads the slots back a pass later (csrc/core/step.cc)"

class Adafactor(Rule):
    """Keras Adafactor (Shazeer & Stern 2018): for a variable of rank >= 2, second moments
    factored over its last two axes (slot `r`: a mean per row, shape[:-1]; slot `c`: a mean per
    column, shape[:-2] + shape[-1:]), else a full `v`; the update `g / sqrt(v)` clipped to
    rms <= `clip_threshold` and scaled by `max(epsilon_2, rms(var)) * min(lr, 1/sqrt(t))`.
    Slots `r`, `c`, `v` as keras makes them (r and c of a variable of rank < 2 are scalar
    placeholders); keras writes the full `v` of a factored variable every step without reading
    it back: `factored_state=True` keeps it as a scalar placeholder instead, so the state is
    R + C numbers for an R x C matrix, not R C (the memory Adafactor was designed for). Three
    passes after the norm (csrc/core/factored.h), on CPU and CUDA alike. An IndexedSlices
    gradient is applied as the dense gradient it stands for (duplicate rows summed; its global
    norm, and a per-tensor clipnorm's, is of its slices, as TF's)."""

    binding = Binding("adafactor", slots=(("r", "r"), ("c", "c"), ("v", "v")),
                      hparams=(("beta_2_decay", "beta_2_decay"), ("epsilon_1", "epsilon_1"),
                               ("epsilon_2", "epsilon_2"), ("clip_threshold", "clip_threshold"),
                               ("step", STEP)))

    def __init__(self, learning_rate=0.001, beta_2_decay=-0.8, epsilon_1=1e-30, epsilon_2=1e-3,
                 clip_threshold=1.0, weight_decay=0.0, name=None, factored_state=False,
                 shard_state=False, reduce_dtype=None):
        self.beta_2_decay, self.epsilon_1, self.epsilon_2 = beta_2_decay, epsilon_1, epsilon_2
        self.clip_threshold = clip_threshold
        self.factored_state = bool(factored_state)
        super().__init__(learning_rate, weight_decay, name, shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_2_decay": self.beta_2_decay,
                "epsilon_1": self.epsilon_1, "epsilon_2": self.epsilon_2,
                "clip_threshold": self.clip_threshold, "weight_decay": self.weight_decay}

    def _state_weights(self, variables):
        # factored_state: a matrix keeps its row and column sums (r, c) and no full v
        if not self.factored_state:
            return super()._state_weights(variables)
        return _shard.factored_weights([v.shape for v in variables])

    def _slot_initial_value(self, name, var):
        shape = var.shape
        if len(shape) < 2:
            return tf.zeros(shape if name == "v" else [], var.dtype)
        if name == "r":
            return tf.zeros(shape[:-1], var.dtype)
        if name == "c":
            return tf.zeros(shape[:-2] + shape[-1:], var.dtype)
        return tf.zeros([] if self.factored_state else shape, var.dtype)


class ScheduleFreeAdamW(_BetasEpsilonStep):
    """Keras ScheduleFreeAdamW (Defazio et al. 2024) as stock Keras runs it on TensorFlow: the
    variable is the interpolation y, slot `momentum` the sequence z the gradient steps move
    (a copy of the variable when the slots are made, as Keras's build makes it), slot
    `velocity` Adam's second moment; `warmup_steps` > 0 scales the learning rate by
    min(t / warmup_steps, 1). Weight decay (decoupled, first) uses the learning rate without
    warmup, as Keras. The averaged sequence x, for evaluation, is
    (var - (1 - beta_1) * momentum) / beta_1. See csrc/core/rules.h, ScheduleFreeAdamWRule, for
    the one place it departs from the paper (with stock Keras)."""

    binding = Binding("schedule_free_adamw", slots=(("momentum_slot", "momentum"), ("velocity", "velocity")),
                      hparams=_BETAS_EPSILON_STEP + (("warmup_steps", "warmup_steps"),))

    def __init__(self, learning_rate=0.0025, beta_1=0.9, beta_2=0.999, epsilon=1e-8, warmup_steps=0,
                 weight_decay=0.0, name=None, shard_state=False, reduce_dtype=None):
        self.warmup_steps = warmup_steps
        super().__init__(learning_rate, beta_1, beta_2, epsilon, weight_decay, name,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {**super()._config_numbers(), "warmup_steps": self.warmup_steps}

    def _slot_initial_value(self, name, var):
        if name != "momentum":
            return super()._slot_initial_value(name, var)
        if tf.executing_eagerly():
            return tf.identity(var.read_value())
        # A TF1 graph: global_variables_initializer runs the initializers in no set order, so the
        # slot's reads the variable once that one is initialized, else its initial value.
        return tf.cond(tf.compat.v1.is_variable_initialized(var), var.read_value,
                       lambda: tf.convert_to_tensor(var.initial_value))


class _Proximal(Rule):
    """A TF1 proximal rule (no weight decay: the stock classes have none). l1/l2 strengths given
    as numbers must be >= 0 (the core's table; a tensor is checked by the op when the step runs,
    before it writes anything). IndexedSlices: densified by default (rows no slice touches
    still get the l1/l2 shrink); `lazy_sparse=True` updates only the touched rows, each
    duplicate in turn, as TF1's sparse kernels do."""

    def __init__(self, learning_rate, l1_regularization_strength, l2_regularization_strength, name,
                 shard_state=False, reduce_dtype=None):
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        super().__init__(learning_rate, 0.0, name, shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength}


class ProximalGradientDescent(_Proximal):
    """tf.compat.v1.train.ProximalGradientDescentOptimizer (FOBOS; ResourceApplyProximalGradientDescent):
    `prox = var - lr*g; var = sign(prox) * max(|prox| - lr*l1, 0) / (1 + lr*l2)`. No slots."""

    binding = Binding("proximal_gradient_descent", hparams=_L1_L2)

    def __init__(self, learning_rate, l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 name=None, shard_state=False, reduce_dtype=None):
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)


class ProximalAdagrad(_Proximal):
    """tf.compat.v1.train.ProximalAdagradOptimizer (ResourceApplyProximalAdagrad): `accumulator
    += g^2`, then the proximal step with the learning rate `lr / sqrt(accumulator)`. Slot
    `accumulator`, starting at `initial_accumulator_value` (> 0, as the stock class checks). As
    TF's kernel, a learning rate <= 0 is refused: a number at construction (ValueError), a
    tensor when the step runs (InvalidArgumentError, nothing written)."""

    binding = Binding("proximal_adagrad", slots=(("accumulator", "accumulator"),),
                      hparams=(("lr", lambda r, _: r._positive_learning_rate()),) + _L1_L2)

    def __init__(self, learning_rate, initial_accumulator_value=0.1, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, name=None, shard_state=False, reduce_dtype=None):
        if initial_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        self.initial_accumulator_value = initial_accumulator_value
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _check_stock_ranges(self):
        lr = self.learning_rate
        if isinstance(lr, numbers.Real) and not isinstance(lr, bool) and lr <= 0:
            raise ValueError(f"learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it), got {lr}")

    def _positive_learning_rate(self):
        lr = self.current_learning_rate()
        if not isinstance(self.learning_rate, numbers.Real):  # a tensor, variable or schedule
            check = tf.debugging.assert_positive(
                lr, message="learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it)")
            with tf.control_dependencies([check]):
                lr = tf.identity(lr)
        return lr

    def _config_numbers(self):
        return {**super()._config_numbers(), "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value


class AdagradDA(_Proximal):
    """tf.compat.v1.train.AdagradDAOptimizer (ResourceApplyAdagradDA), its `global_step` the
    rule's own count: step t (from 1) is given t, as the stock class given a global step that
    starts at 0 and advances with each applied step. Slots `gradient_accumulator` and
    `gradient_squared_accumulator` (starting at `initial_gradient_squared_accumulator_value`,
    > 0 as the stock class checks)."""

    binding = Binding("adagrad_da", slots=(("gradient_accumulator", "gradient_accumulator"),
                                           ("gradient_squared_accumulator", "gradient_squared_accumulator")),
                      hparams=_L1_L2 + (("global_step", STEP),))

    def __init__(self, learning_rate, initial_gradient_squared_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, name=None,
                 shard_state=False, reduce_dtype=None):
        if initial_gradient_squared_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError("initial_gradient_squared_accumulator_value must be positive: "
                             f"{initial_gradient_squared_accumulator_value}")
        self.initial_gradient_squared_accumulator_value = initial_gradient_squared_accumulator_value
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name,
                         shard_state=shard_state, reduce_dtype=reduce_dtype)

    def _config_numbers(self):
        return {**super()._config_numbers(),
                "initial_gradient_squared_accumulator_value": self.initial_gradient_squared_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_gradient_squared_accumulator_value if name == "gradient_squared_accumulator" else 0.0

    def _host_counter(self):
        return None  # global_step is iterations + 1, read before the op: the step is counted here

