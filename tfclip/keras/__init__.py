"""Drop-in Keras 3 optimizers whose update is one fused clip-and-apply op over all variables.

Change one line::

    optimizer = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)   # before
    optimizer = tfclip.keras.Adam(1e-3, global_clipnorm=1.0)        # after

`SGD`, `Adam`, `AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam`, `Lion`, `Ftrl`,
`Lamb`, `Adafactor`, `Muon` and `ScheduleFreeAdamW` (with a Keras that has it) subclass the stock Keras classes and
take the same constructor arguments (learning-rate schedules, `clipnorm`, `clipvalue`, `global_clipnorm`,
`weight_decay`, `use_ema`, `loss_scale_factor`, `gradient_accumulation_steps`, ...), create the
same slot variables, and follow the same trajectories step by step. `optimizer.variables` is the
stock list (tfclip's `global_norm`, `tensor_norms`, `skipped_steps`, `clipped_steps` and
`clip_scale_sum` are attributes outside it), so checkpoints move both ways between stock Keras and
tfclip. `GradientNormLogger` writes them to TensorBoard. Differences, on purpose:

- **Clipping under `tf.distribute` uses the summed gradient.** Stock Keras clips each replica's
  gradient before the cross-replica all-reduce, so two replicas with gradient 3 and
  `global_clipnorm=1` move a variable by 2 × lr. tfclip all-reduces first and clips the sum, as
  single-device training of the same global batch would.
- **`nonfinite="skip"` by default**: a step whose global norm is inf/NaN writes no variable or
  slot and counts in `skipped_steps` (the step counter `iterations` still advances, as in
  stock Keras). `"propagate"` gives stock behaviour (NaN spreads); `"raise"` fails the step.
- **`global_norm`** (a variable) holds the pre-clip global norm of the last step, for logging,
  and **`tensor_norms`** each variable's gradient norm (by `tensor_norm_names`), from the same
  norm pass.
- **`lazy_sparse=True`** (off by default) updates only the embedding rows an `IndexedSlices`
  gradient touches, and only their slots: stock Keras decays every row's slots. By default
  IndexedSlices are applied without densifying them, with stock Keras's results.
- **A non-finite hyper-parameter** (NaN, inf) is refused: at construction when it is a number,
  by the op at run time (schedules, variables) with nothing written. Every finite value the stock
  class takes is taken, with the stock arithmetic (a negative learning rate ascends).
- **`apply(grads, variables)` with lists of unequal length** applies the pairs it has, as stock
  Keras does, and warns with both lengths.
- **Threads**: one optimizer stepped eagerly by several threads builds once and runs one step
  at a time (stock Keras builds in each thread that finds it unbuilt).

`LossScaleOptimizer` (mixed_float16's dynamic loss scaling; tfclip/keras/_loss_scale.py) is the
stock wrapper with its unscale and finite check folded into a tfclip optimizer's two passes: pass
it to `model.compile`, which keeps a LossScaleOptimizer it is given.

Extra, off by default: `state_dtype="bfloat16"` (SGD with momentum, Adam, AdamW, RMSprop, Adagrad,
Adadelta, Adamax, Nadam, Lion, Lamb) makes the slot variables of float32 variables bfloat16, half
the optimizer state's bytes: each slot is read to float32, updated as a float32 slot, and rounded
to the nearest bfloat16 when stored (docs/low-precision-state.md).

`shard_state=True`: under MirroredStrategy and MultiWorkerMirroredStrategy each
replica keeps the slots of its share of the variables and the updated variables are
all-gathered, the unsharded step's bits (tfclip/_engine/shard.py, docs/distribute.md).

`reduce_dtype="bfloat16"` (or "float16"): under a strategy of several replicas the float32
variables' gradients are summed across replicas in 16 bits, half the bytes on the link, and the
fused step uses that sum (tfclip/_engine/reduce.py, docs/distribute.md).

Inside an XLA-compiled function (`jit_compile=True`, Keras 3's default wherever a GPU is
visible) the fused op compiles to tfclip's own XLA custom calls (csrc/xla): the same kernels, the
same bits. A build without them (a TensorFlow other than the one the XLA glue is built for) warns
once and falls back there to the stock Keras ops (still clipping after the all-reduce), with the
same results; `nonfinite="skip"` is then honoured without a strategy, under a strategy the
fallback applies the step as `"propagate"` does, and `"raise"` is an error when the step is built.
"""
import numbers

from tfclip._keras_version import KERAS_PROBLEM as _KERAS_PROBLEM

if _KERAS_PROBLEM is not None:
    raise ImportError(_KERAS_PROBLEM)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfclip._engine import checks as _checks  # noqa: E402
from tfclip._engine import keras_bindings as _kb  # noqa: E402
from tfclip._engine import shard as _shard  # noqa: E402
from tfclip._engine.binding import Binding  # noqa: E402
from tfclip.keras._dropin import _check_betas, _FusedMixin, _Generic  # noqa: E402
from tfclip.keras._logger import GradientNormLogger  # noqa: E402, F401  (tfclip.keras.GradientNormLogger)
from tfclip.keras._loss_scale import LossScaleOptimizer  # noqa: E402, F401  (tfclip.keras.LossScaleOptimizer)
from tfclip.keras._muon import Muon  # noqa: E402

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl",
           "Lamb", "Adafactor", "Muon", "GradientNormLogger", "LossScaleOptimizer", "get"] + (
    ["ScheduleFreeAdamW"] if hasattr(keras.optimizers, "ScheduleFreeAdamW") else [])


# -- the drop-ins: each class's rule binding is one data row (tfclip/_engine/step.py, Binding) -------
def _momentum(opt):
    return opt.momentum != 0


_ADAM = Binding("adam", slots=_kb.M_V + (("vhat", "_velocity_hats", "amsgrad"),), hparams=_kb.BETAS_STEP,
                flags=(("amsgrad", "amsgrad"),))


class SGD(_FusedMixin, keras.optimizers.SGD):
    """keras.optimizers.SGD (momentum, nesterov) as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding(("sgd", "keras_momentum"), pick=lambda o: "keras_momentum" if _momentum(o) else "sgd",
                              slots=(("accum", "momentums", _momentum),),
                              hparams=(("momentum", "momentum", _momentum),),
                              flags=(("use_nesterov", "nesterov", _momentum),))

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, *, nonfinite="skip",
                 lazy_sparse=False, state_dtype=None, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)
        _check_betas(self, ("momentum",))
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)


class Adam(_FusedMixin, keras.optimizers.Adam):
    """keras.optimizers.Adam (amsgrad too) as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _ADAM

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False, *,
                 nonfinite="skip", lazy_sparse=False, state_dtype=None, **kwargs):
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                         amsgrad=amsgrad, **kwargs)
        _check_betas(self)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)


class AdamW(_FusedMixin, keras.optimizers.AdamW):
    """keras.optimizers.AdamW (decoupled weight decay) as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _ADAM

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, *, nonfinite="skip", lazy_sparse=False, state_dtype=None, **kwargs):
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1,
                         beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad, **kwargs)
        _check_betas(self)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)


class RMSprop(_Generic, keras.optimizers.RMSprop):
    """keras.optimizers.RMSprop (rho, momentum, centered) as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _kb.RMSPROP
    _checked = ("rho", "momentum", "epsilon")


class Adagrad(_Generic, keras.optimizers.Adagrad):
    """keras.optimizers.Adagrad as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _kb.ADAGRAD
    _checked = ("epsilon", "initial_accumulator_value")


class Adadelta(_Generic, keras.optimizers.Adadelta):
    """keras.optimizers.Adadelta as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _kb.ADADELTA
    _checked = ("rho", "epsilon")


class Adamax(_Generic, keras.optimizers.Adamax):
    """keras.optimizers.Adamax as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = _kb.ADAMAX
    _checked = ("beta_1", "beta_2", "epsilon")


class Nadam(_Generic, keras.optimizers.Nadam):
    """keras.optimizers.Nadam as one fused op, its momentum-cache product `_u_product` carried
    across steps as stock Keras carries it. Extra: `nonfinite`."""

    _tfclip_binding = _kb.NADAM
    _checked = ("beta_1", "beta_2", "epsilon")

    def _next_u_product(self):
        # As stock Nadam's _backend_update_step: u_product * beta_1 * (1 - 0.5 * 0.96^t).
        dtype = self._u_product.dtype
        return self._u_product * self.beta_1 * (
            1.0 - 0.5 * keras.ops.power(0.96, keras.ops.cast(self.iterations + 1, dtype)))

    def _stock_update_step(self, grads, keras_vars, tvars, learning_rate):
        self.assign(self._u_product, self._next_u_product())  # before the stock steps, as stock
        return super()._stock_update_step(grads, keras_vars, tvars, learning_rate)

    def _fused_update_step(self, grads, keras_vars, learning_rate):
        # The op takes the advanced product; it is stored only after the op ran (a step that
        # fails writes nothing). A skipped step advances it, as it advances `iterations`.
        self._u_next = self._next_u_product()
        applied = super()._fused_update_step(grads, keras_vars, learning_rate)
        with tf.control_dependencies([applied]):
            self.assign(self._u_product, self._u_next)
        return applied


class Lion(_Generic, keras.optimizers.Lion):
    """keras.optimizers.Lion as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding("lion", slots=(("m", "_momentums"),), hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2")))
    _checked = ("beta_1", "beta_2")


class Ftrl(_Generic, keras.optimizers.Ftrl):
    """keras.optimizers.Ftrl (l1, l2, l2 shrinkage, learning_rate_power, beta) as one fused op.
    Extra: `nonfinite`."""

    _tfclip_binding = _kb.FTRL
    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "l2_shrinkage_regularization_strength", "beta", "initial_accumulator_value")
    low_precision_state = False  # (its linear slot is a weight: tfclip.rules says why)


class Lamb(_Generic, keras.optimizers.Lamb):
    """keras.optimizers.Lamb as fused ops: its per-tensor trust ratio |w| / |u| needs every
    update before any variable moves, so a step is three passes over memory (the norm; the
    slots with each tensor's sums of w^2 and u^2; the variables), not two. Extra: `nonfinite`."""

    _tfclip_binding = Binding("lamb", slots=_kb.M_V, hparams=_kb.BETAS_STEP)
    int8_state = False
    int8_state_why = "its trust ratio reads the slots back a pass later (csrc/core/step.cc)"
    _checked = ("beta_1", "beta_2", "epsilon")


class Adafactor(_Generic, keras.optimizers.Adafactor):
    """keras.optimizers.Adafactor (Shazeer & Stern 2018) as fused ops: the norm pass, then
    Adafactor's own passes (csrc/core/factored.h): each matrix's row and column means of
    g^2 + epsilon_1 with rms(w), then rms(u), then the update. The stock slots `_r`, `_c`
    (factored over the last two axes) and `_v`, the stock arguments (`beta_2_decay`,
    `epsilon_1`, `epsilon_2`, `clip_threshold`, `relative_step`). Extra: `nonfinite`, and
    `factored_state=True`, which keeps the `velocity` of each variable of rank >= 2 as a scalar
    placeholder: keras writes it every step and never reads it back, so the optimizer then
    keeps R + C numbers for an R x C matrix, not R C (its checkpoints are then not the stock
    layout). An IndexedSlices gradient (an embedding's) without `global_clipnorm` runs stock's own
    step (stock squares each slice apart, the fused passes take dense gradients); with
    `factored_state` it is applied as the dense gradient it stands for (duplicate rows summed,
    as tf_keras does). `clip_threshold` is Adafactor's bound on rms(u); an adaptive `clip=`'s
    threshold is `adaptive_threshold`."""

    _tfclip_binding = _kb.ADAFACTOR
    _checked = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold")
    low_precision_state = False
    int8_state = False
    # Adafactor's own argument, a number (the stock attribute), over tfclip's property of that
    # name: an adaptive clip's threshold is `adaptive_threshold` here.
    clip_threshold = 1.0

    def __init__(self, *args, factored_state=False, **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "factored_state", bool(factored_state))

    def _tfclip_stock_semantics(self, grads):
        # Stock Keras 3 squares an IndexedSlices gradient's slices apart (a repeated row feeds
        # the sum of their squares to r, c and rms(u)) and scatters each slice's update, unless
        # global_clipnorm's scale densified it first; its per-tensor clipnorm takes the norm of
        # the slices. tfclip's factored passes take dense gradients (the duplicates summed), so
        # such a step runs the stock class's own ops. factored_state=True (tfclip's layout)
        # takes the dense gradient instead (tfclip/_engine/step.py, run).
        if self.factored_state or not any(isinstance(g, tf.IndexedSlices) for g in grads):
            return None
        if self._clip_mode()[0] == "global_norm" or self.clip is not None:
            return None
        return ("keras's Adafactor squares an IndexedSlices gradient's slices apart (without "
                "global_clipnorm), which tfclip's dense factored passes cannot; set global_clipnorm, "
                "or factored_state=True for the dense gradient's step")

    def _tfclip_state_weights(self, var_list):
        # factored_state: a matrix keeps its row and column sums (r, c) and no full v
        return _shard.factored_weights([v.shape for v in var_list]) if self.factored_state else None

    def _tfclip_build_slots(self, var_list):
        if self._tfclip_owner is None or self.built:
            return super()._tfclip_build_slots(var_list)
        # shard_state (tfclip/_engine/shard.py): keras's Adafactor makes r and c with add_variable (and
        # a rank < 2 variable's with keras.Variable), not from the reference variable; the same
        # variables, names and order here, each variable's three on its owner's device.
        keras.optimizers.Optimizer.build(self, var_list)
        self._r, self._c, self._v = [], [], []
        for var in var_list:
            with self._tfclip_slot_scope(var):
                if len(var.shape) < 2:  # (placeholders; a RemoteSlot where another worker owns var)
                    for slots in (self._r, self._c):
                        slots.append(self._tfclip_slot_or_remote(lambda: keras.Variable(0, name=var.name, trainable=False),
                                                       (), "int32", var.name))
                elif self._overwrite_variable_with_gradient(var):
                    self._r.append(None)
                    self._c.append(None)
                else:
                    self._r.append(self.add_variable(shape=var.shape[:-1], dtype=var.dtype, name=var.name))
                    self._c.append(self.add_variable(shape=var.shape[:-2] + (var.shape[-1],), dtype=var.dtype,
                                                     name=var.name))
            self._v.append(None if self._overwrite_variable_with_gradient(var) else
                           self.add_variable_from_reference(reference_variable=var, name="velocity"))

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        # factored_state: the `velocity` of a factored variable (rank >= 2), which keras writes
        # every step and never reads back, is a scalar placeholder (tfclip.rules.Adafactor).
        if name == "velocity" and self.factored_state and len(reference_variable.shape) >= 2:
            ref = reference_variable
            base = (ref.path.replace("/", "_") if hasattr(ref, "path")
                    else str(ref.name).replace("/", "_").replace(":", "_"))  # (the stock name)
            with self._tfclip_slot_scope(ref):
                return self.add_variable(shape=(), dtype=ref.dtype, name=f"{base}_velocity",
                                         initializer=initializer)
        return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)


# keras.optimizers.ScheduleFreeAdamW is recent (Keras 3.15 has it): with a Keras without it tfclip.keras has
# no ScheduleFreeAdamW either (the module's __getattr__ says why).
_StockScheduleFree = getattr(keras.optimizers, "ScheduleFreeAdamW", None)
if _StockScheduleFree is not None:
    class ScheduleFreeAdamW(_Generic, _StockScheduleFree):
        """keras.optimizers.ScheduleFreeAdamW (warmup_steps, decoupled weight decay) as one fused
        op, on the trajectory stock Keras follows on TensorFlow (csrc/core/rules.h,
        ScheduleFreeAdamWRule). Its `momentum` slots start as copies of the variables, made by
        the stock build. Extra: `nonfinite`."""

        _tfclip_binding = Binding("schedule_free_adamw", slots=(("momentum_slot", "_momentums"), ("velocity", "_velocities")),
                                  hparams=_kb.BETAS_STEP + (("warmup_steps", lambda o, _: float(o.warmup_steps)),))

        _checked = ("beta_1", "beta_2", "epsilon")
        low_precision_state = False  # (its momentum slot is the iterate z: tfclip.rules says why)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Stock tests `warmup_steps > 0` in Python at each step: a number (<= 0: no warmup).
            w = self.warmup_steps
            if isinstance(w, bool) or not isinstance(w, numbers.Real):
                raise ValueError(f"warmup_steps must be a number, got {w!r}")
            _checks.check_number("warmup_steps", float(w))


def __getattr__(name):
    if name == "ScheduleFreeAdamW":
        raise AttributeError(f"tfclip.keras.ScheduleFreeAdamW subclasses keras.optimizers.ScheduleFreeAdamW, "
                             f"which this Keras ({keras.__version__}) does not have")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(identifier):
    """keras.optimizers.get, giving tfclip's class where tfclip has one: `get("adam")` is a
    `tfclip.keras.Adam`, `get("lion")` a `tfclip.keras.Lion`; configs and instances as Keras."""
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    if isinstance(identifier, dict) and str(identifier.get("class_name", "")).lower() in _BY_NAME \
            and identifier.get("module") in (None, "keras.optimizers"):
        return _BY_NAME[identifier["class_name"].lower()].from_config(identifier.get("config", {}))
    return keras.optimizers.get(identifier)


_CLASSES = (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl, Lamb, Adafactor, Muon) + (
    (ScheduleFreeAdamW,) if _StockScheduleFree is not None else ())
_BY_NAME = {c.__name__.lower(): c for c in _CLASSES}

# Registered so model.save / keras.models.load_model find them without custom_objects.
for _cls in _CLASSES + (LossScaleOptimizer,):
    keras.saving.register_keras_serializable(package="tfclip")(_cls)
