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

`LossScaleOptimizer` (mixed_float16's dynamic loss scaling; tfclip/_keras_loss_scale.py) is the
stock wrapper with its unscale and finite check folded into a tfclip optimizer's two passes: pass
it to `model.compile`, which keeps a LossScaleOptimizer it is given.

Extra, off by default: `state_dtype="bfloat16"` (SGD with momentum, Adam, AdamW, RMSprop, Adagrad,
Adadelta, Adamax, Nadam, Lion, Lamb) makes the slot variables of float32 variables bfloat16, half
the optimizer state's bytes: each slot is read to float32, updated as a float32 slot, and rounded
to the nearest bfloat16 when stored (docs/low-precision-state.md).

`shard_state=True`: under MirroredStrategy and MultiWorkerMirroredStrategy each
replica keeps the slots of its share of the variables and the updated variables are
all-gathered, the unsharded step's bits (tfclip/_shard.py, docs/distribute.md).

Inside an XLA-compiled function (`jit_compile=True`, Keras 3's default wherever a GPU is
visible) the fused op compiles to tfclip's own XLA custom calls (csrc/xla): the same kernels, the
same bits. A build without them (a TensorFlow other than the one the XLA glue is built for) warns
once and falls back there to the stock Keras ops (still clipping after the all-reduce), with the
same results; `nonfinite="skip"` is then honoured without a strategy, under a strategy the
fallback applies the step as `"propagate"` does, and `"raise"` is an error when the step is built.
"""
import math
import numbers

from tfclip._keras_version import KERAS_PROBLEM as _KERAS_PROBLEM

if _KERAS_PROBLEM is not None:
    raise ImportError(_KERAS_PROBLEM)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfclip import _muon, _opcall, _shard, _step  # noqa: E402
from tfclip import clipping as _clipping  # noqa: E402
from tfclip._keras_logger import GradientNormLogger  # noqa: E402, F401  (tfclip.keras.GradientNormLogger)
from tfclip._keras_loss_scale import LossScaleOptimizer  # noqa: E402, F401  (tfclip.keras.LossScaleOptimizer)
from tfclip._keras_step import _check_betas, _FusedMixin, _tf_var  # noqa: E402
from tfclip._step import STEP, Binding  # noqa: E402

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl",
           "Lamb", "Adafactor", "Muon", "GradientNormLogger", "LossScaleOptimizer", "get"] + (
    ["ScheduleFreeAdamW"] if hasattr(keras.optimizers, "ScheduleFreeAdamW") else [])


# -- the drop-ins: each class's rule binding is one data row (tfclip/_step.py, Binding) -------
def _momentum(opt):
    return opt.momentum != 0


def _positive_momentum(opt):  # (stock Keras RMSprop: a momentum slot only for momentum > 0)
    return opt.momentum > 0


def _general_ftrl(opt):  # (Ftrl's general rule takes the power as an input; the sqrt one, none)
    return bool(_opcall.ftrl_variant(opt.learning_rate_power)[1])


_M_V = (("m", "_momentums"), ("v", "_velocities"))
_BETAS_STEP = (("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"), ("step", STEP))
_ADAM = Binding("adam", slots=_M_V + (("vhat", "_velocity_hats", "amsgrad"),), hparams=_BETAS_STEP,
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


class _Generic(_FusedMixin):
    """A drop-in whose constructor is the stock one verbatim (every argument passed through),
    plus tfclip's keyword-only `nonfinite` and `lazy_sparse`. `_checked`: the attributes checked
    against the op's ranges at construction."""

    _checked = ()

    def __init__(self, *args, nonfinite="skip", lazy_sparse=False, state_dtype=None, **kwargs):
        super().__init__(*args, **kwargs)
        _check_betas(self, self._checked)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)


class RMSprop(_Generic, keras.optimizers.RMSprop):
    """keras.optimizers.RMSprop (rho, momentum, centered) as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding("rmsprop", slots=(("velocity", "_velocities"),
                                                ("momentum_slot", "_momentums", _positive_momentum),
                                                ("average_gradient", "_average_gradients", "centered")),
                              hparams=(("rho", "rho"), ("momentum", "momentum"), ("epsilon", "epsilon")),
                              flags=(("centered", "centered"), ("has_momentum", _positive_momentum)))
    _checked = ("rho", "momentum", "epsilon")


class Adagrad(_Generic, keras.optimizers.Adagrad):
    """keras.optimizers.Adagrad as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding("adagrad", slots=(("accumulator", "_accumulators"),), hparams=(("epsilon", "epsilon"),))
    _checked = ("epsilon", "initial_accumulator_value")


class Adadelta(_Generic, keras.optimizers.Adadelta):
    """keras.optimizers.Adadelta as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding("adadelta", slots=(("accumulated_grad", "_accumulated_grads"),
                                                 ("accumulated_delta_var", "_accumulated_delta_vars")),
                              hparams=(("rho", "rho"), ("epsilon", "epsilon")))
    _checked = ("rho", "epsilon")


class Adamax(_Generic, keras.optimizers.Adamax):
    """keras.optimizers.Adamax as one fused op. Extra: `nonfinite`."""

    _tfclip_binding = Binding("adamax", slots=(("m", "_m"), ("u", "_u")), hparams=_BETAS_STEP)
    _checked = ("beta_1", "beta_2", "epsilon")


class Nadam(_Generic, keras.optimizers.Nadam):
    """keras.optimizers.Nadam as one fused op, its momentum-cache product `_u_product` carried
    across steps as stock Keras carries it. Extra: `nonfinite`."""

    _tfclip_binding = Binding("nadam", slots=_M_V,
                              hparams=_BETAS_STEP + (("u_product", lambda o, _: o._u_next),))
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

    _tfclip_binding = Binding(("ftrl", "ftrl_sqrt"), pick=lambda o: _opcall.ftrl_variant(o.learning_rate_power)[0],
                              slots=(("accumulator", "_accumulators"), ("linear", "_linears")),
                              hparams=(("lr_power", "learning_rate_power", _general_ftrl),
                                       ("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"),
                                       ("l2_shrinkage", "l2_shrinkage_regularization_strength"), ("beta", "beta")))
    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "l2_shrinkage_regularization_strength", "beta", "initial_accumulator_value")
    low_precision_state = False  # (its linear slot is a weight: tfclip.rules says why)


class Lamb(_Generic, keras.optimizers.Lamb):
    """keras.optimizers.Lamb as fused ops: its per-tensor trust ratio |w| / |u| needs every
    update before any variable moves, so a step is three passes over memory (the norm; the
    slots with each tensor's sums of w^2 and u^2; the variables), not two. Extra: `nonfinite`."""

    _tfclip_binding = Binding("lamb", slots=_M_V, hparams=_BETAS_STEP)
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

    _tfclip_binding = _step.ADAFACTOR
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
        # takes the dense gradient instead (tfclip/_step.py, run).
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
        # shard_state (tfclip/_shard.py): keras's Adafactor makes r and c with add_variable (and
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


class Muon(_Generic, keras.optimizers.Muon):
    """keras.optimizers.Muon (momentum with Nesterov, five Newton–Schulz iterations per matrix,
    Moonlight's `rms_rate` scaling; AdamW for every variable that is not 2-D, an embedding, or
    in `exclude_layers`) with the stock arguments, slots and trajectory. One norm pass over every
    gradient; the AdamW variables are one fused Adam op (with the clip, the non-finite policy and
    `adam_weight_decay`); the matrices' momentum is one fused op over all of them (rules.h,
    MuonMomentumRule), their Newton–Schulz iterations TF matrix products (tfclip/_muon.py;
    batched on a GPU over the matrices of one shape, transposed shapes joined: a few batched
    products per distinct shape, not per matrix; on the CPU per matrix, which is faster there),
    and their weight decay and `rms_rate`-scaled update one fused op per matrix size
    (MuonUpdateRule). The clip is the one the AdamW op runs, from the same norm pass. Extra:
    `nonfinite`, and `shard_state=True`, where each replica also runs the Newton–Schulz products
    of its own matrices only. Not `state_dtype` (the matrices' momentum is read by the Nesterov step and the
    products, TF ops) or `stochastic_rounding` (those TF ops round to nearest)."""

    _tfclip_binding = Binding("adam", slots=(("m", "momentums"), ("v", "adam_velocities")),
                              hparams=(("beta_1", "adam_beta_1"), ("beta_2", "adam_beta_2"),
                                       ("epsilon", "epsilon"), ("step", STEP)),
                              flags=(("amsgrad", lambda o: False),))
    # The matrices' two fused ops: the momentum slot as the op's variable, and the update
    # (shape_scale: keras's sqrt(max(rows, cols)), in float32 as keras computes it; a group's
    # matrices share their largest dimension).
    _tfclip_momentum_binding = Binding("muon_momentum", hparams=(("momentum", "momentum"),))
    _tfclip_update_binding = Binding("muon_update", hparams=(
        ("shape_scale", lambda o, vs: 1.0 if o.rms_rate is None else float(np.sqrt(np.float32(max(vs[0].shape))))),
        ("rms_rate", lambda o, vs: 1.0 if o.rms_rate is None else o.rms_rate)))
    _checked = ("epsilon", "momentum")
    low_precision_state = False
    int8_state = False
    # Whether the Newton–Schulz products run batched by shape: None, on a GPU (tfclip/_muon.py).
    _tfclip_batch_products = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, table in (("adam_beta_1", "beta_1"), ("adam_beta_2", "beta_2")):
            _check_number_as(name, table, getattr(self, name))
        for name in ("adam_lr_ratio", "adam_weight_decay", "rms_rate", "muon_a", "muon_b", "muon_c"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number{' or None' if name != 'adam_lr_ratio' else ''}, "
                                     f"got {v!r}")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, numbers.Integral) or self.ns_steps < 0:
            raise ValueError(f"ns_steps must be an int >= 0, got {self.ns_steps!r}")
        if self.stochastic_rounding:
            raise ValueError("Muon does not take stochastic_rounding=True: its matrices' Nesterov step and "
                             "Newton–Schulz products are TF ops (tfclip/_muon.py), which round to nearest")

    def _tfclip_state_weights(self, var_list):
        # (AdamW's variables keep two slots, a matrix one: sharded by state bytes, not variable bytes)
        return [2 if self._should_use_adamw(v) else 1 for v in var_list]

    def _tfclip_is_matrix(self, v):
        """Whether `v` takes Muon's own step (stock keeps no AdamW velocity for it)."""
        return self.adam_velocities[self._get_variable_index(v)] is None

    def _fused_update_step(self, grads, keras_vars, learning_rate):
        # shard_state (tfclip/_shard.py): the norm of every gradient, then this replica's
        # variables only, the Newton–Schulz products of its own matrices too.
        share = _shard.begin(grads, self._tfclip_owners_of(keras_vars))
        own = range(len(keras_vars)) if share is None else share.own
        mats = {i: self._tfclip_is_matrix(keras_vars[i]) for i in own}
        adam = [i for i in own if not mats[i]]
        muon = [i for i in own if mats[i]]
        tvars = [_tf_var(v) for v in keras_vars]
        loss_scale = _step.loss_scale(self)
        nonfinite = self.nonfinite if loss_scale is None else "skip"
        # (IndexedSlices as they are: their norm is of their slices, as stock's)
        norm, pass_norms = _step.norm_pass(grads) if share is None else (share.use_norm, share.pass_norms)
        # The AdamW part: keras's Adam update at learning_rate * adam_lr_ratio, after the decay
        # `w - w * adam_weight_decay * learning_rate` (the op's own where the two rates agree).
        learning_rate = tf.convert_to_tensor(learning_rate)
        ratio = self.adam_lr_ratio
        adam_lr = learning_rate if ratio == 1 else learning_rate * ratio
        wd = self.adam_weight_decay
        decaying = [wd is not None and wd != 0 and self._use_weight_decay(keras_vars[i]) for i in adam]
        if ratio != 1 and any(decaying):
            gate = _step.nonfinite_applied(norm, "skip") if nonfinite != "propagate" else tf.constant(True)
            tf.cond(gate, lambda: _muon_decay([tvars[i] for i, d in zip(adam, decaying) if d], wd, learning_rate),
                    lambda: None)
        groups = _step.optimizer_groups(self, [keras_vars[i] for i in adam], [d and ratio == 1 for d in decaying],
                                        lambda v: _tf_var(v).handle, _opcall.scalar(adam_lr, "learning_rate"), wd)
        mode, clip = self._clip_mode()
        result = _step.run([grads[i] for i in adam], groups, mode, clip, clip_obj=self.clip, use_norm=norm,
                           nonfinite=nonfinite, lazy=self.lazy_sparse, keras_sparse_squares=True,
                           grad_scale=loss_scale)
        applied = result.applied
        # The matrices: clipped as the op clipped the rest (AGC per unit, from the variables
        # before the step; its counts also for a skipped step, as the op's), then stepped by
        # their own ops, which take the same non-finite decision from the same norm.
        mg, counts = [grads[i] for i in muon], None
        if isinstance(self.clip, _clipping.AGC):
            mg, counts = self.clip.unfused(mg, [tvars[i] for i in muon], counts=True)
        elif muon:
            mg = _muon.clip_gradients(mg, result.clip_mode, result.clip, norm,
                                      [pass_norms[i] for i in muon], loss_scale)
        if muon:
            # (dense: stock adds them, clipped, to the dense momentum)
            mg = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in mg]
            matrices_applied = self._tfclip_matrices(mg, [keras_vars[i] for i in muon], learning_rate, norm,
                                                     nonfinite)
            if not adam:
                applied = matrices_applied
        if loss_scale is not None:
            _step.loss_scale_applied(self, applied)
        units = None
        if isinstance(self.clip, _clipping.AGC):  # (this replica's variables', in `own`'s order)
            at = {i: k for k, i in enumerate(own)}
            parts = ([result.clipped_units] if adam else []) + ([counts] if muon else [])
            units = (_step.in_order(parts, [at[i] for i in adam + muon]) if parts
                     else tf.zeros([0], tf.int64))
        if share is not None:
            tensor_norms, units = _shard.finish(share, tvars, result._replace(applied=applied, clipped_units=units),
                                                loss_scale, agc=units is not None)
        else:
            tensor_norms = tf.cast(pass_norms if loss_scale is None else
                                   pass_norms * tf.cast(loss_scale, tf.float64), tf.float32)
        self._record_norms(result.global_norm, applied, tensor_norms, keras_vars, result.clip_mode, result.clip,
                           None if result.adaptive is None else result.adaptive.threshold, units)
        return applied

    def _tfclip_matrices(self, grads, keras_vars, learning_rate, norm, nonfinite):
        """Muon's step of the matrices (stock `_apply_weight_decay` and `_muon_update_step`) on
        their clipped gradients: the momentum op, the Nesterov step and the Newton–Schulz
        iterations (TF ops, batched by shape on a GPU), the update op; both ops skip, raise or
        propagate by `norm` as the step's other op. Returns whether the step was applied."""
        moms = [_tf_var(self.momentums[self._get_variable_index(v)]) for v in keras_vars]
        grads = [tf.cast(g, m.dtype) for g, m in zip(grads, moms)]
        kind, _, hparams, flags = self._tfclip_momentum_binding.inputs(self, keras_vars)
        momentum = _step.run(grads, [_step.Group(kind, [m.handle for m in moms], {}, hparams, flags)], "none", 0.0,
                             use_norm=norm, nonfinite=nonfinite)
        ms = [_muon.read(m.handle, m.dtype) for m in moms]
        updates = [g + self.momentum * m for g, m in zip(grads, ms)] if self.nesterov else ms
        batch = self._tfclip_batch_products
        if batch is None:  # (batched on a GPU, per matrix on the CPU: tfclip/_muon.py says why)
            batch = any("GPU" in _tf_var(v).device.upper() for v in keras_vars)
        ortho = _muon.orthogonalize(updates, lambda x: self.zeropower_via_newtonschulz5(x, self.ns_steps), batch)
        # One update op per (weight decay, largest dimension): keras's decay `w - w * wd * lr`,
        # then `w - lr_adjust(lr * o)`.
        wd = self.weight_decay
        keys = [(wd is not None and wd != 0 and self._use_weight_decay(v), max(v.shape)) for v in keras_vars]
        groups = _step.optimizer_groups(self, keras_vars, keys, lambda v: _tf_var(v).handle,
                                        _opcall.scalar(learning_rate, "learning_rate"), wd,
                                        binding=self._tfclip_update_binding)
        _step.run(ortho, groups, "none", 0.0, use_norm=norm, nonfinite=nonfinite)
        return momentum.applied


def _muon_decay(tvars, wd, learning_rate):
    """Stock `_apply_weight_decay` on these variables: `w - w * wd * lr` (Muon's AdamW variables
    where adam_lr_ratio != 1, whose op runs at another rate than their decay's)."""
    for var in tvars:
        w = _muon.read(var.handle, var.dtype)
        _muon.assign(var.handle, w - w * tf.cast(wd, w.dtype) * tf.cast(learning_rate, w.dtype))


def _check_number_as(name, table, v):
    """A number checked against the table's range for `table` (its error naming `name`)."""
    if callable(v):
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a number or a callable, got {v!r}")
    try:
        _step.check_number(table, float(v))
    except ValueError as e:
        raise ValueError(str(e).replace(table, name, 1)) from None


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
                                  hparams=_BETAS_STEP + (("warmup_steps", lambda o, _: float(o.warmup_steps)),))

        _checked = ("beta_1", "beta_2", "epsilon")
        low_precision_state = False  # (its momentum slot is the iterate z: tfclip.rules says why)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Stock tests `warmup_steps > 0` in Python at each step: a number (<= 0: no warmup).
            w = self.warmup_steps
            if isinstance(w, bool) or not isinstance(w, numbers.Real):
                raise ValueError(f"warmup_steps must be a number, got {w!r}")
            _step.check_number("warmup_steps", float(w))


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
