"""Drop-in Keras 3 optimizers whose update is one fused clip-and-apply op over all variables.

Change one line::

    optimizer = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)   # before
    optimizer = tfclip.keras.Adam(1e-3, global_clipnorm=1.0)        # after

`SGD`, `Adam`, `AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam`, `Lion`, `Ftrl`,
`Lamb` and `ScheduleFreeAdamW` (with a Keras that has it) subclass the stock Keras classes and
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

Extra, off by default: `state_dtype="bfloat16"` (SGD with momentum, Adam, AdamW, RMSprop, Adagrad,
Adadelta, Adamax, Nadam, Lion, Lamb) makes the slot variables of float32 variables bfloat16, half
the optimizer state's bytes: each slot is read to float32, updated as a float32 slot, and rounded
to the nearest bfloat16 when stored (docs/low-precision-state.md).

Inside an XLA-compiled function (`jit_compile=True`, Keras 3's default wherever a GPU is
visible) the fused op compiles to tfclip's own XLA custom calls (csrc/xla): the same kernels, the
same bits. A build without them (a TensorFlow other than the one the XLA glue is built for) warns
once and falls back there to the stock Keras ops (still clipping after the all-reduce), with the
same results; `nonfinite="skip"` is then honoured without a strategy, under a strategy the
fallback applies the step as `"propagate"` does, and `"raise"` is an error when the step is built.
"""
import contextlib
import numbers
import threading
import warnings

from tfclip._keras_version import KERAS_PROBLEM as _KERAS_PROBLEM

if _KERAS_PROBLEM is not None:
    raise ImportError(_KERAS_PROBLEM)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.ops import control_flow_util

from tfclip import _loader, _mixup, _opcall, _optstate, _rule, _step
from tfclip import clipping as _clipping
from tfclip._keras_logger import GradientNormLogger  # noqa: F401  (tfclip.keras.GradientNormLogger)
from tfclip._step import STEP, Binding

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl",
           "Lamb", "GradientNormLogger", "get"] + (
    ["ScheduleFreeAdamW"] if hasattr(keras.optimizers, "ScheduleFreeAdamW") else [])


def _in_xla_context():
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _xla_kernels():
    """Whether this build of tfclip has its XLA kernels (tfclip._loader.xla_kernels); a module
    attribute so that tests can take them away."""
    return _loader.xla_kernels() if _XLA_KERNELS is None else _XLA_KERNELS


_XLA_KERNELS = None  # None: ask the build


_XLA_FALLBACK_WARNED = False


def _warn_xla_fallback(why):
    global _XLA_FALLBACK_WARNED
    if not _XLA_FALLBACK_WARNED:
        _XLA_FALLBACK_WARNED = True
        warnings.warn(
            f"tfclip.keras: {why}, so inside jit_compile=True the optimizer step runs stock Keras ops "
            "(clipping after the all-reduce, the same results). Compile the model with "
            "jit_compile=False for tfclip's fused kernels.", stacklevel=2)


def _xla_fallback_reason(opt, grads, tvars):
    """Why this XLA-compiled step cannot run tfclip's kernels, or None."""
    if not _xla_kernels():
        import tfclip._build_info as _build_info

        return (f"this build of tfclip has no XLA kernels (built against TensorFlow "
                f"{_build_info.TF_VERSION}: {_build_info.XLA_WHY_NOT or 'the build left them out'}; "
                f"docs/xla.md, Versions)")
    # On GPU the XLA kernel densifies IndexedSlices (XLA keeps their indices on the device), which
    # cannot give lazy_sparse's rows or stock Keras's sum of a repeated row's squares.
    if (any(isinstance(g, tf.IndexedSlices) for g in grads) and any("GPU" in v.device for v in tvars)
            and (opt.lazy_sparse or (opt._clip_mode()[0] != "global_norm" and opt.clip is None))):
        return ("IndexedSlices on the GPU are densified inside XLA, which cannot give "
                + ("lazy_sparse's touched rows" if opt.lazy_sparse else
                   "stock Keras's sum of a repeated row's squares (without global_clipnorm)"))
    return None


def _tf_var(v):
    return v.value if isinstance(v, keras.Variable) else v


# The optimizers whose fused step this thread is building: inside it, the stock clip and weight
# decay hooks step aside (the op does both, after the all-reduce); called directly they are the
# stock methods. Per thread: MirroredStrategy builds each replica's step in a thread of its own.
_IN_FUSED_STEP = threading.local()


@contextlib.contextmanager
def _fused_step(opt):
    ids = _IN_FUSED_STEP.__dict__.setdefault("ids", set())
    ids.add(id(opt))
    try:
        yield
    finally:
        ids.discard(id(opt))


def _in_fused_step(opt):
    return id(opt) in getattr(_IN_FUSED_STEP, "ids", ())


def _state_variable(value, name, dtype):
    """One of tfclip's own optimizer variables: not trainable, one value for all replicas."""
    return keras.Variable(value, name=name, dtype=dtype, trainable=False,
                          aggregation="only_first_replica")


def _check_betas(opt, names=("beta_1", "beta_2", "epsilon")):
    """A rule's numbers, at construction: the ranges the op accepts (csrc/core/hparams.h: every
    finite value the stock classes take; the stock constructor has run its own checks already).
    Callables are checked per step, by the op."""
    for name in names:
        v = getattr(opt, name)
        if callable(v):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number or a callable, got {v!r}")
        _step.check_number(name, float(v))


class _FusedMixin(_optstate.NormState):
    """The fused update every drop-in shares (see the module docstring)."""

    _tfclip_library = "keras"  # (tfclip/_mixup.py)
    _tfclip_binding = None  # per class: its rule-table row, as data (tfclip/_step.py, Binding)
    # Whether state_dtype="bfloat16" may store this class's slots as bfloat16 (tfclip.rules).
    low_precision_state = True

    def __init__(self, *args, clip=None, **kwargs):
        # `clip`: an adaptive clip (tfclip.clipping), taken here for every class; the stock
        # class gets the rest.
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))

    @property
    def clip(self):
        """The adaptive clip (a tfclip.clipping object), or None."""
        return self._tfclip_clip

    def _tfclip_init(self, nonfinite, lazy_sparse, state_dtype=None):
        # A tf_keras (Keras 2) program handing this optimizer to its model: the error names
        # tfclip.tf_keras.<Class> (tfclip/_mixup.py; only where tf_keras is loaded already).
        _mixup.install()
        _opcall.check_policy(nonfinite)
        # Before the stock build makes any slot (object.__setattr__: not a tracked attribute).
        object.__setattr__(self, "state_dtype", _rule.check_state_dtype(state_dtype, type(self)))
        # The learning rate and weight decay as numbers (a schedule or callable: per step, by
        # the op): finite, the one refusal of tfclip's own (docs/differences.md).
        lr = getattr(self, "_learning_rate", None)
        if isinstance(lr, keras.Variable) and tf.executing_eagerly():
            _step.check_number("learning_rate", float(lr.numpy()))
        wd = self.weight_decay
        if isinstance(wd, (int, float)) and not isinstance(wd, bool):
            _step.check_number("weight_decay", float(wd))
        # Keras allows one of the three (it raises first otherwise); each None or 0 is no clip.
        _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)
        _clipping.check_exclusive(self._tfclip_clip, global_clipnorm=self.global_clipnorm,
                                  clipnorm=self.clipnorm, clipvalue=self.clipvalue)
        if not isinstance(lazy_sparse, bool):
            raise TypeError(f"lazy_sparse must be True or False, got {lazy_sparse!r}")
        self.nonfinite = nonfinite
        self.lazy_sparse = lazy_sparse
        # tfclip's own state stays outside what Keras lists, saves and loads (optimizer.variables,
        # .keras / .weights.h5, tf.train.Checkpoint): the list equals the stock class's, so
        # checkpoints move both ways between stock Keras and tfclip.
        # object.__setattr__: neither Keras's variable tracker nor TF's checkpoint dependencies
        # (both hook the optimizer's __setattr__) see them.
        with keras.name_scope(self.name):
            for attr, name, value, dtype in _optstate.STATE_VARIABLES:
                object.__setattr__(self, attr, _state_variable(value, name, dtype))
        object.__setattr__(self, "_tensor_norms", None)  # made by build (one per variable)
        object.__setattr__(self, "_clipped_units", None)  # made by build with an AGC clip

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        # The stock build makes every slot here, in its variable's dtype; with
        # state_dtype="bfloat16" a float32 variable's slots are bfloat16 (add_variable below).
        # Not the base class's own: use_ema's averages and gradient_accumulation_steps's sums
        # stay in the variable's dtype (stock code updates them, in that dtype).
        dtype = _rule.state_slot_dtype(getattr(self, "state_dtype", None), reference_variable.dtype)
        if dtype == tf.as_dtype(reference_variable.dtype) or name in ("average", "gradient_accumulator"):
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        object.__setattr__(self, "_tfclip_slot_dtype", dtype.name)
        try:
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        finally:
            object.__setattr__(self, "_tfclip_slot_dtype", None)

    def add_variable(self, *args, **kwargs):
        slot_dtype = getattr(self, "_tfclip_slot_dtype", None)
        if slot_dtype is not None:  # (a slot made by add_variable_from_reference above)
            kwargs["dtype"] = slot_dtype
        return super().add_variable(*args, **kwargs)

    def build(self, var_list):
        super().build(var_list)
        object.__setattr__(self, "_tensor_norms", _state_variable(
            [0.0] * len(var_list), "tensor_norms", "float32"))
        clip = self._tfclip_clip
        if isinstance(clip, _clipping.AGC):  # AGC's clipped units, aligned with tensor_norms
            object.__setattr__(self, "_clipped_units", _state_variable(
                [0] * len(var_list), "clipped_units", "int64"))
        if isinstance(clip, _clipping.AdaptiveClip):
            # The adaptive clip's state: optimizer variables (checkpoints, .keras files), on the
            # variables' device, the same on every replica.
            clip.bind(self)
            clip.build(lambda name, shape, dtype: self.add_variable(
                shape, initializer="zeros", dtype=dtype, aggregation="only_first_replica",
                name=f"{clip.mode}_{name}"))

    @property
    def tensor_norm_names(self):
        """The variables' paths (`variable.path`), in the order of `tensor_norms`."""
        return [getattr(v, "path", v.name) for v in self._trainable_variables]

    def _norm_positions(self, keras_vars):
        return [self._get_variable_index(v) for v in keras_vars], len(self._trainable_variables)

    def get_config(self):
        # tfclip's own arguments only when they differ from their defaults: a default config is
        # the stock class's, so a saved model loads with the stock class where tfclip is absent
        # (custom_objects={"tfclip>Adam": keras.optimizers.Adam}; see docs/keras.md).
        config = super().get_config()
        if self.nonfinite != "skip":
            config["nonfinite"] = self.nonfinite
        if self.lazy_sparse:
            config["lazy_sparse"] = True
        if self._tfclip_clip is not None:
            config["clip"] = _clipping.serialize(self._tfclip_clip)
        if self.state_dtype is not None:
            config["state_dtype"] = self.state_dtype
        return config

    def apply(self, grads, trainable_variables=None):
        # Eagerly, one step at a time per optimizer: threads that share one optimizer build it
        # once and end in the state of a serial order (stock Keras builds it in each thread that
        # finds it unbuilt, and the updates written to the losing slots are lost). Not under
        # tf.distribute, whose replica threads meet in merge_call; a tf.function step is traced
        # once, under TF's own lock.
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            with _opcall.state_lock(self):
                return super().apply(grads, trainable_variables)
        return super().apply(grads, trainable_variables)

    # Clipping and weight decay happen inside the fused step, after the all-reduce; called
    # directly (or by the XLA fallback) these are the stock methods.
    def _backend_apply_gradients(self, grads, trainable_variables):
        grads, trainable_variables = list(grads), list(trainable_variables)
        if len(grads) != len(trainable_variables):
            # Stock Keras zips the two lists, so it applies the pairs it has: the same here, said.
            n = min(len(grads), len(trainable_variables))
            warnings.warn(f"{type(self).__name__}.apply got {len(grads)} gradients for "
                          f"{len(trainable_variables)} variables; applying the first {n} pairs, as "
                          "stock Keras does", stacklevel=3)
            grads, trainable_variables = grads[:n], trainable_variables[:n]
        with _fused_step(self):
            return super()._backend_apply_gradients(grads, trainable_variables)

    def _clip_gradients(self, grads):
        if _in_fused_step(self):
            return grads
        return super()._clip_gradients(grads)

    def _apply_weight_decay(self, variables):
        if _in_fused_step(self):
            return
        return super()._apply_weight_decay(variables)

    def _clip_mode(self):
        # Re-read: Keras lets a user set optimizer.clipnorm etc. after construction.
        return _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        tvars = [_tf_var(v) for v in trainable_variables]
        # Sum across replicas first (a no-op without a strategy), then clip the sum.
        reduced = self._all_reduce_sum_gradients(list(zip(grads, tvars)))
        grads = [g for g, _ in reduced]
        # Under jit_compile=True the fused op compiles to tfclip's custom calls (csrc/xla); only a
        # build without them takes the stock ops there, and says so once.
        why = _xla_fallback_reason(self, grads, tvars) if _in_xla_context() else None
        if why is not None:
            _warn_xla_fallback(why)
            return self._stock_update_step(grads, trainable_variables, tvars, learning_rate)
        return self._fused_update_step(grads, trainable_variables, learning_rate)

    # -- the fused op -------------------------------------------------------------------
    def _fused_update_step(self, grads, keras_vars, learning_rate):
        # The one fused step (tfclip/_step.py). Keras applies weight decay per variable
        # (exclude_from_weight_decay): one op per group, the global norm computed once for both.
        # IndexedSlices (embeddings) go to the op as they are: their norm is the norm of
        # `.values` (as tf.linalg.global_norm and Keras count it), and they are applied without
        # densifying, with stock Keras's results (or only their rows, with lazy_sparse). Stock
        # Keras's Adam feeds v the sum of a duplicated row's squared slices, except after
        # global_clipnorm, whose `g * scale` densifies (summing the duplicates) first.
        decay = self.weight_decay is not None and self.weight_decay != 0
        lr = _opcall.scalar(learning_rate, "learning_rate")
        groups = []
        for with_decay, idx in _step.partition([bool(decay and self._use_weight_decay(v)) for v in keras_vars]):
            group = [keras_vars[i] for i in idx]
            kind, slots, hparams, flags = self._tfclip_binding.inputs(self, group)
            hparams.update(lr=lr, weight_decay=self.weight_decay if with_decay else 0.0)
            groups.append(_step.Group(kind, [_tf_var(v).handle for v in group], slots, hparams, flags, idx))
        mode, clip = self._clip_mode()
        result = _step.run(grads, groups, mode, clip, clip_obj=self.clip, nonfinite=self.nonfinite,
                           lazy=self.lazy_sparse, keras_sparse_squares=True)
        self._record_norms(result.global_norm, result.applied, result.tensor_norms, keras_vars,
                           result.clip_mode, result.clip,
                           None if result.adaptive is None else result.adaptive.threshold, result.clipped_units)
        return result.applied

    # The binding's sources (tfclip/_step.py, Binding): a slot list by its attribute, a
    # hyper-parameter by its attribute (a callable one called, as Keras does), the step.
    def _tfclip_slot(self, attr, keras_vars):
        slot_list = getattr(self, attr)
        return [_tf_var(slot_list[self._get_variable_index(v)]).handle for v in keras_vars]

    def _tfclip_hparam(self, name, keras_vars):
        v = getattr(self, name)
        return v() if callable(v) else v

    def _tfclip_step(self):
        return tf.cast(self.iterations + 1, tf.float64)

    # -- the XLA fallback: stock Keras ops, clipping after the all-reduce -------------------
    def _stock_update_step(self, grads, keras_vars, tvars, learning_rate):
        if self.state_dtype is not None:
            raise ValueError(f"state_dtype={self.state_dtype!r} needs tfclip's fused op, which this build "
                             "cannot compile inside an XLA-compiled function (jit_compile=True); compile "
                             "the model with jit_compile=False, or leave state_dtype at None")
        if self.nonfinite == "raise":
            raise ValueError("nonfinite='raise' needs tfclip's fused op, which cannot run inside an "
                             "XLA-compiled function (jit_compile=True); use 'skip' or 'propagate', "
                             "or compile the model with jit_compile=False")
        # One reduction per gradient gives both its norm and the global one (as the fused pass).
        sumsq = tf.stack([tf.reduce_sum(tf.square(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                                          tf.float32))) for g in grads])
        tensor_norms = tf.sqrt(sumsq)
        norm = tf.sqrt(tf.reduce_sum(sumsq))
        base = super(_FusedMixin, self)
        adaptive = self.clip.step(norm) if isinstance(self.clip, _clipping.AdaptiveClip) else None

        agc_clipped = counts = None
        if isinstance(self.clip, _clipping.AGC):  # the counts also for a skipped step, as the op's
            agc_clipped, counts = self.clip.unfused(grads, tvars, counts=True)

        def update():
            if agc_clipped is not None:
                clipped = agc_clipped
            elif adaptive is None:
                clipped = base._clip_gradients(grads)
            else:  # TF's clip_by_global_norm scale, to the adaptive threshold when it clips
                scale = tf.where(adaptive.clipped, adaptive.clip / tf.cast(norm, tf.float64), 1.0)
                clipped = [_scaled(g, scale) for g in grads]
            base._apply_weight_decay(keras_vars)
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step, self._distribution_strategy,
                list(zip(clipped, tvars)), learning_rate)

        finite = tf.math.is_finite(norm)
        if self.nonfinite == "skip" and not tf.distribute.has_strategy():
            tf.cond(finite, update, lambda: None)
            applied = finite
        else:
            update()
            applied = tf.constant(True)
        mode, clip = self._clip_mode() if adaptive is None else ("global_norm", adaptive.clip)
        if adaptive is not None:
            _clipping.assign_updates(adaptive, after=[applied])
        self._record_norms(norm, applied, tensor_norms, keras_vars, mode, clip,
                           None if adaptive is None else adaptive.threshold, counts)


def _scaled(g, scale):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)


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
    _checked = ("beta_1", "beta_2", "epsilon")


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


_CLASSES = (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion, Ftrl, Lamb) + (
    (ScheduleFreeAdamW,) if _StockScheduleFree is not None else ())
_BY_NAME = {c.__name__.lower(): c for c in _CLASSES}

# Registered so model.save / keras.models.load_model find them without custom_objects.
for _cls in _CLASSES:
    keras.saving.register_keras_serializable(package="tfclip")(_cls)
