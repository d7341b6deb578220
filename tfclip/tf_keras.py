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
import threading
import warnings

import tensorflow as tf

try:
    import tf_keras as _tf_keras
except ImportError as _e:  # pragma: no cover - the optional dependency is absent
    raise ImportError("tfclip.tf_keras subclasses the optimizers of the tf-keras package (Keras 2), "
                      f"which is not installed ({_e}): pip install \"tfclip[tf-keras]\" (or "
                      "pip install tf-keras matching your TensorFlow). For Keras 3 use tfclip.keras.") from None

from tensorflow.python.ops import control_flow_util
from tf_keras.src.optimizers import utils as _optimizer_utils

from tfclip import _loader, _opcall, _optstate
from tfclip import clipping as _clipping
from tfclip.rules import _check_number, _state_scope

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "legacy",
           "get"]

_stock = _tf_keras.optimizers


def _in_xla_context():
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


_XLA_KERNELS = None


def _xla_kernels():
    """Whether this build of tfclip has its XLA kernels (asked once of TF's kernel registry)."""
    global _XLA_KERNELS
    if _XLA_KERNELS is None:
        from tensorflow.python.framework import kernels

        _loader.ops()
        found = {k.device_type for k in kernels.get_registered_kernels_for_op("TfclipGlobalNorm").kernel}
        _XLA_KERNELS = "XLA_CPU_JIT" in found
    return _XLA_KERNELS


_XLA_FALLBACK_WARNED = False


def _warn_xla_fallback():
    global _XLA_FALLBACK_WARNED
    if not _XLA_FALLBACK_WARNED:
        _XLA_FALLBACK_WARNED = True
        warnings.warn("tfclip.tf_keras: this build of tfclip has no XLA kernels, so inside "
                      "jit_compile=True the optimizer step runs the stock tf_keras ops (which clip "
                      "after the all-reduce too; nonfinite is not honoured there). Compile with "
                      "jit_compile=False for tfclip's fused kernels.", stacklevel=3)


def _state_variable(value, name, dtype):
    """One of tfclip's own optimizer variables: not trainable, one value for all replicas."""
    with tf.init_scope():
        return tf.Variable(value, name=name, dtype=dtype, trainable=False,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _outer_graph():
    """The graph variables made now go to (None: eager)."""
    with tf.init_scope():
        return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _check_numbers(opt, names):
    for name in names:
        v = opt._tfclip_value(name)
        if callable(v) or isinstance(v, (tf.Tensor, tf.Variable)):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number, got {v!r}")
        _check_number(name, float(v))


class _FusedMixin(_optstate.NormState):
    """The fused update every tf_keras drop-in shares (see the module docstring)."""

    _checked = ()

    def __init__(self, *args, nonfinite="skip", lazy_sparse=False, clip=None, **kwargs):
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))
        super().__init__(*args, **kwargs)
        lr = getattr(self, "_learning_rate", None)
        if isinstance(lr, tf.Variable) and tf.executing_eagerly():
            _check_number("learning_rate", float(lr.numpy()))
        wd = self.weight_decay
        if isinstance(wd, (int, float)) and not isinstance(wd, bool):
            _check_number("weight_decay", float(wd))
        _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)
        self._tfclip_init(nonfinite, lazy_sparse)

    @property
    def clip(self):
        """The adaptive clip (a tfclip.clipping object), or None."""
        return self._tfclip_clip

    def _tfclip_init(self, nonfinite, lazy_sparse):
        _clipping.check_exclusive(self._tfclip_clip, global_clipnorm=self.global_clipnorm,
                                  clipnorm=self.clipnorm, clipvalue=self.clipvalue)
        _opcall.check_policy(nonfinite)
        _check_numbers(self, self._checked)
        if not isinstance(lazy_sparse, bool):
            raise TypeError(f"lazy_sparse must be True or False, got {lazy_sparse!r}")
        self.nonfinite = nonfinite
        self.lazy_sparse = lazy_sparse
        self._tfclip_make_state()

    def _tfclip_make_state(self):
        # Outside the tracked attributes (object.__setattr__): not in optimizer.variables nor in
        # checkpoints, so both stay the stock class's.
        for attr, name, value, dtype in _optstate.STATE_VARIABLES:
            object.__setattr__(self, attr, _state_variable(value, f"{self._tfclip_scope()}/{name}", dtype))
        object.__setattr__(self, "_tensor_norms", None)
        object.__setattr__(self, "_clipped_units", None)  # with an AGC clip, made with tensor_norms
        object.__setattr__(self, "_tensor_norm_names", [])
        object.__setattr__(self, "_tfclip_state_graph", _outer_graph())

    def build(self, var_list):
        built = getattr(self, "_built", False)
        super().build(var_list)
        if not built and self._tensor_norms is None:
            object.__setattr__(self, "_tensor_norms", _state_variable(
                [0.0] * len(var_list), f"{self._tfclip_scope()}/tensor_norms", tf.float32))
            object.__setattr__(self, "_tensor_norm_names", [v.name for v in var_list])
            self._tfclip_make_clipped_units(len(var_list))
        self._tfclip_build_clip(self._tfclip_add_clip_variable)

    def _tfclip_make_clipped_units(self, n):
        if isinstance(self._tfclip_clip, _clipping.AGC):  # AGC's clipped units, as tensor_norms
            object.__setattr__(self, "_clipped_units", _state_variable(
                [0] * n, f"{self._tfclip_scope()}/clipped_units", tf.int64))

    def _tfclip_add_clip_variable(self, name, shape, dtype):
        # As add_variable, with the aggregation a mirrored copy needs to be assigned per replica.
        v = tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._variables.append(v)
        return v

    def _tfclip_build_clip(self, add):
        """The adaptive clip's state (once): optimizer variables (checkpoints, optimizer.variables),
        made in the strategy's scope, if any."""
        clip = self._tfclip_clip
        if not isinstance(clip, _clipping.AdaptiveClip) or clip.state is not None:
            return
        clip.bind(self)
        with _state_scope():
            clip.build(lambda name, shape, dtype: add(f"{clip.mode}_{name}", shape, dtype))

    def _tfclip_value(self, name):
        """A constructor argument, as given, for the checks."""
        return getattr(self, name)

    def _tfclip_scope(self):
        return getattr(self, "_name", None) or self.name

    # -- tfclip's own state (the properties and _record_norms: tfclip/_optstate.py) --------
    @property
    def tensor_norm_names(self):
        """The variables' names, in the order of `tensor_norms`."""
        return list(self._tensor_norm_names)

    def get_config(self):
        config = super().get_config()
        if self.nonfinite != "skip":
            config["nonfinite"] = self.nonfinite
        if self.lazy_sparse:
            config["lazy_sparse"] = True
        if self._tfclip_clip is not None:
            config["clip"] = _clipping.serialize(self._tfclip_clip)
        return config

    def _clip_mode(self):
        return _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)

    # -- the stock apply_gradients, its update replaced -------------------------------------
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        if self._mesh or self._run_with_dtensor:
            raise NotImplementedError("tfclip.tf_keras optimizers do not run under DTensor; use the "
                                      f"stock tf_keras.optimizers.{type(self).__name__}")
        if _in_xla_context() and not _xla_kernels():
            _warn_xla_fallback()
            return super().apply_gradients(grads_and_vars, name=name,
                                           skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            with _opcall.state_lock(self):
                return self._tfclip_apply_gradients(grads_and_vars, name, skip_gradients_aggregation, kwargs)
        return self._tfclip_apply_gradients(grads_and_vars, name, skip_gradients_aggregation, kwargs)

    def _tfclip_apply_gradients(self, grads_and_vars, name, skip_gradients_aggregation, kwargs):
        # tf_keras Optimizer.apply_gradients: sum across replicas (unless skipped) ...
        experimental_aggregate_gradients = kwargs.pop("experimental_aggregate_gradients", True)
        grads_and_vars = list(grads_and_vars)
        if not skip_gradients_aggregation and experimental_aggregate_gradients:
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        # ... then _BaseOptimizer.apply_gradients, with the clip, the sparse de-duplication, the
        # weight decay and the per-variable updates made one fused step.
        self._compute_current_learning_rate()
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self._iterations
        grads, trainable_variables = zip(*grads_and_vars)
        with tf.name_scope(name or self.name or "optimizer"):
            with tf.init_scope():
                self.build(trainable_variables)
            grads_and_vars = _optimizer_utils.filter_empty_gradients(grads_and_vars)
            if not list(grads_and_vars):
                return self._iterations
            grads, trainable_variables = zip(*grads_and_vars)
            applied = self._fused_step(list(grads), list(trainable_variables))
            with tf.control_dependencies([applied]):
                iteration = tf.__internal__.distribute.interim.maybe_merge_call(
                    self._tfclip_finish, self._distribution_strategy, list(trainable_variables))
            for variable in trainable_variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))
            return iteration

    def _tfclip_finish(self, distribution, var_list):
        """The tail of stock `_distributed_apply_gradients_fn`: EMA, then `iterations += 1`."""
        if self.use_ema:
            self._update_model_variables_moving_average(var_list)
            if self.ema_overwrite_frequency:
                should = (self.iterations + 1) % self.ema_overwrite_frequency == 0
                tf.cond(tf.cast(should, tf.bool),
                        true_fn=lambda: self._overwrite_model_variables_with_average_value(var_list),
                        false_fn=lambda: None)
        return self.iterations.assign_add(1)

    def _index(self, v):
        return self._index_dict[self._var_key(v)]

    def _tfclip_lr(self, tvars):
        return self.learning_rate

    def _tfclip_decay(self):
        return self.weight_decay is not None and not (
            isinstance(self.weight_decay, (int, float)) and self.weight_decay == 0)

    def _tfclip_lazy(self):
        return self.lazy_sparse

    def _slot_handles(self, slot_list, tvars):
        return [slot_list[self._index(v)].handle for v in tvars]

    def _step(self):
        return tf.cast(self.iterations + 1, tf.float64)

    def _fused_step(self, grads, tvars):
        ops = _loader.ops()
        mode, clip = self._clip_mode()
        agc = {}
        if isinstance(self.clip, _clipping.AGC):  # unit-wise, inside the op's own passes
            mode, clip, agc = self.clip.op_args()
        clip = _opcall.scalar(clip, "clip")
        use_norm, given, tensor_norms, adaptive = tf.constant(0.0, tf.float64), False, None, None
        decay = self._tfclip_decay()
        groups = {}
        for i, v in enumerate(tvars):
            groups.setdefault((bool(decay and self._use_weight_decay(v)), self._tfclip_group(v)), []).append(i)
        if len(groups) > 1 or (self.clip is not None and not agc):
            # Every group's op takes the norms of one norm pass; so does an adaptive clip, whose
            # threshold comes from it (scalar ops on the device).
            values, _ = _opcall.op_grads(grads)
            use_norm, tensor_norms = ops.tfclip_global_norm(t=values, Tnorm=tf.float64)
            given = True
            if self.clip is not None and not agc:
                adaptive = self.clip.step(use_norm)
                mode, clip = "global_norm", adaptive.clip
        norm = applied = None
        counts, order = [], []  # each group's clipped_units, and the variables they are of
        for (with_decay, _), idx in sorted(groups.items()):
            values, sparse_kw = _opcall.op_grads([grads[i] for i in idx])
            group = [tvars[i] for i in idx]
            lr = _opcall.scalar(self._tfclip_lr(group), "learning_rate")
            kind, slots, hparams, flags = self._op_inputs(group)
            hparams.update(lr=lr, weight_decay=self.weight_decay if with_decay else 0.0)
            n, a, tn, cu = _opcall.apply(
                kind, [v.handle for v in group], slots, values, hparams, flags,
                clip=clip, use_norm=use_norm, iterations=[], clip_mode=mode,
                nonfinite=self.nonfinite, use_given_norm=given, lazy=self._tfclip_lazy(),
                # Stock tf_keras clips each raw slice, then sums an IndexedSlices' duplicate rows
                # (_deduplicate_sparse_grad) before the update: the op's duplicate sum, clipped
                # slices summed, the rule fed the sum (not the sum of the slices' squares).
                sum_of_squares=False, **agc, **sparse_kw)
            norm = n if norm is None else norm
            applied = a if applied is None else applied
            tensor_norms = tn if tensor_norms is None else tensor_norms
            counts.append(cu)
            order += idx
        self._record_norms(norm, applied, tensor_norms, tvars, mode, clip, adaptive,
                           _optstate.in_order(counts, order))
        return applied

    def _tfclip_group(self, v):
        """What else, beside the weight decay, splits a step into several ops sharing one norm
        pass ("": nothing; legacy Nadam: the dtype, whose constants stock computes per dtype)."""
        return ""

    def _norm_positions(self, tvars):
        idx = [self._index(v) for v in tvars]
        return None if None in idx else (idx, int(self._tensor_norms.shape[0]))


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


# -- tf_keras.optimizers.legacy (OptimizerV2: TF's training ops) ------------------------------
_legacy_stock = _tf_keras.optimizers.legacy
_LEGACY_WARNED = set()


class _LegacyFusedMixin(_FusedMixin):
    """The fused update for the `tf_keras.optimizers.legacy` (OptimizerV2) classes: the stock
    apply_gradients (filter None gradients, create the slots, `_transform_unaggregated_gradients`,
    `_aggregate_gradients`), then clip and update in one op, then `iterations += 1`.

    Stock cases the one op cannot express run the stock step, with a warning once:
    `gradient_transformers` (they run after the clip), `clipvalue` together with `clipnorm` or
    `global_clipnorm` (stock applies both, one after the other), and a jit-compiled step in a
    build without tfclip's XLA kernels."""

    _lazy_default = False

    def __init__(self, *args, nonfinite="skip", lazy_sparse=None, clip=None, **kwargs):
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))
        super(_FusedMixin, self).__init__(*args, **kwargs)
        if lazy_sparse is None:
            lazy_sparse = self._lazy_default
        set_clips = [k for k in _opcall.CLIP_ARGS if getattr(self, k) is not None]
        if len(set_clips) > 1:
            self._tfclip_stock_reason = f"{' and '.join(set_clips)} are both set"
        else:
            self._tfclip_stock_reason = None
            _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)
        self._tfclip_init(nonfinite, lazy_sparse)

    def get_config(self):
        config = super(_FusedMixin, self).get_config()
        if self.nonfinite != "skip":
            config["nonfinite"] = self.nonfinite
        if self.lazy_sparse != self._lazy_default:
            config["lazy_sparse"] = self.lazy_sparse
        if self._tfclip_clip is not None:
            config["clip"] = _clipping.serialize(self._tfclip_clip)
        return config

    def _clip_mode(self):
        if len([k for k in _opcall.CLIP_ARGS if getattr(self, k) is not None]) > 1:
            return "none", 0.0
        return _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)

    def _no_rule_reason(self):
        """Why this configuration's update matches no tfclip core rule (then the stock step runs)."""
        return None

    def _tfclip_value(self, name):
        # A hyper-parameter as given, from `_hyper`: reading it through the attribute
        # (`_get_hyper`) would make every hyper variable now, in the constructor's graph, where
        # stock makes them at the first step (a graph built later could not use them).
        hyper = self.__dict__.get("_hyper", {})
        return hyper[name] if name in hyper else getattr(self, name)

    def _stock_reason(self, grads_and_vars):
        no_rule = self._no_rule_reason()
        if no_rule is not None:
            return no_rule
        other = sorted({v.dtype.base_dtype.name for _, v in grads_and_vars
                        if v.dtype.base_dtype not in _FLOAT_DTYPES})
        if other:
            return f"tfclip's kernels take float16, bfloat16, float32 and float64 variables, not {', '.join(other)}"
        if self.gradient_transformers:
            return "gradient_transformers are set (stock runs them after the clip)"
        if len([k for k in _opcall.CLIP_ARGS if getattr(self, k) is not None]) > 1:
            return "more than one of clipvalue, clipnorm and global_clipnorm is set"
        if _in_xla_context() and not _xla_kernels():
            return "this build of tfclip has no XLA kernels and the step is jit-compiled"
        return None

    def build(self, var_list):  # legacy: _create_all_weights
        self._create_all_weights(var_list)

    def _create_all_weights(self, var_list):
        super(_FusedMixin, self)._create_all_weights(var_list)
        if self._tfclip_state_graph is not _outer_graph():
            # Made eagerly by the constructor, stepped in a tf.Graph (a TF1-style session): the
            # state anew in that graph, as stock makes its hyper variables at the first step.
            self._tfclip_make_state()
        if self._tensor_norms is None and var_list:
            object.__setattr__(self, "_tensor_norms", _state_variable(
                [0.0] * len(var_list), f"{self._tfclip_scope()}/tensor_norms", tf.float32))
            object.__setattr__(self, "_tensor_norm_names", [v.name for v in var_list])
            self._tfclip_make_clipped_units(len(var_list))
            object.__setattr__(self, "_tfclip_index", {_legacy_var_key(v): i for i, v in enumerate(var_list)})
        self._tfclip_build_clip(self._tfclip_add_clip_weight)

    def _tfclip_add_clip_weight(self, name, shape, dtype):
        # A named checkpoint dependency (add_weight), listed in variables() as the slots are.
        v = self.add_weight(name, shape, dtype, initializer="zeros", trainable=False,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._weights.append(v)
        return v

    def _index(self, v):
        return getattr(self, "_tfclip_index", {}).get(_legacy_var_key(v))

    def _slot_handles(self, slot_name, tvars):
        return [self.get_slot(v, slot_name).handle for v in tvars]

    def _tfclip_lr(self, tvars):
        return self._decayed_lr(tvars[0].dtype.base_dtype)

    def _tfclip_decay(self):
        return False

    @property
    def weight_decay(self):  # (none in OptimizerV2; the fused step reads it)
        return None

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        grads_and_vars = list(grads_and_vars)
        reason = self._stock_reason(grads_and_vars)
        if reason is not None:
            if (type(self).__name__, reason) not in _LEGACY_WARNED:
                _LEGACY_WARNED.add((type(self).__name__, reason))
                warnings.warn(f"tfclip.tf_keras.legacy.{type(self).__name__}: {reason}, so this step "
                              "runs the stock tf_keras ops", stacklevel=2)
            return super(_FusedMixin, self).apply_gradients(grads_and_vars, name, experimental_aggregate_gradients)
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            with _opcall.state_lock(self):
                return self._legacy_apply(grads_and_vars, name, experimental_aggregate_gradients)
        return self._legacy_apply(grads_and_vars, name, experimental_aggregate_gradients)

    def _legacy_apply(self, grads_and_vars, name, experimental_aggregate_gradients):
        # As stock OptimizerV2.apply_gradients, up to the update.
        grads_and_vars = _optimizer_utils.filter_empty_gradients(grads_and_vars)
        var_list = [v for (_, v) in grads_and_vars]
        for v in var_list:
            if isinstance(v, tf.Tensor):  # (stock's error, before anything is made)
                raise NotImplementedError(f"Trying to update a Tensor {v!r}: apply_gradients updates "
                                          "variables (tf.Variable), not tensors")
        with tf.name_scope(self._name):
            with tf.init_scope():
                self._create_all_weights(var_list)
            if not grads_and_vars:
                return tf.no_op()
            if tf.distribute.in_cross_replica_context():
                raise RuntimeError("`apply_gradients() cannot be called in cross-replica context. Use "
                                   "`tf.distribute.Strategy.run` to enter replica context.")
            if experimental_aggregate_gradients:
                grads_and_vars = self._transform_unaggregated_gradients(grads_and_vars)
                grads_and_vars = self._aggregate_gradients(grads_and_vars)
            grads, tvars = zip(*grads_and_vars)
            for g, v in zip(grads, tvars):
                if isinstance(g, tf.IndexedSlices) and v.constraint is not None:
                    raise RuntimeError("Cannot use a constraint function on a sparse variable. Received: "
                                       f"grad={g}, var.constraint={v.constraint}.")
            applied = self._fused_step(list(grads), list(tvars))
            with tf.control_dependencies([applied]):
                updates = [v.assign(v.constraint(v)) for v in tvars if v.constraint is not None]
            with tf.control_dependencies([applied] + updates):
                # As stock: an Operation in a graph (`train_op.run()`), the variable eagerly.
                return tf.__internal__.distribute.interim.maybe_merge_call(
                    lambda distribution: self.iterations.assign_add(1, read_value=tf.executing_eagerly()),
                    tf.distribute.get_strategy())


_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _legacy_var_key(v):
    from tf_keras.src.optimizers.legacy import optimizer_v2

    return optimizer_v2._var_key(v)


class _LegacySGD(_LegacyFusedMixin, _legacy_stock.SGD):
    """tf_keras.optimizers.legacy.SGD as one fused op: ResourceApplyGradientDescent, or
    ResourceApplyKerasMomentum with momentum (and for IndexedSlices, as stock's
    ResourceSparseApplyKerasMomentum, only the rows the gradient touches: `lazy_sparse` defaults
    to True there)."""

    _checked = ()

    _lazy_default = True

    def _tfclip_lazy(self):
        return self.lazy_sparse if self._momentum else False

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        if not self._momentum:
            return "sgd", [], {}, {}
        return ("keras_momentum", [self._slot_handles("momentum", tvars)],
                {"momentum": self._get_hyper("momentum", dtype)}, {"use_nesterov": bool(self.nesterov)})


class _LegacyAdam(_LegacyFusedMixin, _legacy_stock.Adam):
    """tf_keras.optimizers.legacy.Adam as one fused op: ResourceApplyAdam's update (the beta
    powers in the variables' dtype, epsilon added to sqrt(v)), amsgrad too."""

    _checked = ("epsilon",)

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.identity(self._get_hyper("beta_1", dtype))
        beta_2 = tf.identity(self._get_hyper("beta_2", dtype))
        slots = [self._slot_handles("m", tvars), self._slot_handles("v", tvars)]
        if self.amsgrad:
            slots.append(self._slot_handles("vhat", tvars))
        return ("adam", slots, {"beta_1": beta_1, "beta_2": beta_2, "epsilon": self.epsilon,
                                "step": tf.cast(step, tf.float64), "beta_1_power": tf.pow(beta_1, step),
                                "beta_2_power": tf.pow(beta_2, step)}, {"amsgrad": bool(self.amsgrad)})


class _LegacyRMSprop(_LegacyFusedMixin, _legacy_stock.RMSprop):
    """tf_keras.optimizers.legacy.RMSprop as one fused op (slots `rms`, `momentum`, `mg`).

    With momentum: TF's ResourceApplyRMSProp / ResourceApplyCenteredRMSProp (tfclip's
    `tf_rmsprop` rule), and for IndexedSlices, as stock's ResourceSparseApply(Centered)RMSProp,
    only the rows the gradient touches (`lazy_sparse` defaults to True).

    Without momentum (the stock default) stock's own ops: `rms = rho*rms + (1-rho)*g^2` (centered:
    `mg = rho*mg + (1-rho)*g`, the denominator `rms - mg^2`), `var -= lr*g / (sqrt(rms) +
    epsilon)`, epsilon outside the square root (tfclip's `rmsprop` rule with
    `epsilon_outside_sqrt`). Stock's IndexedSlices update decays every row's `rms` (and `mg`) and
    moves only the touched rows of the variable, which is the densified gradient's update (a
    zero gradient moves a variable by 0): `lazy_sparse` defaults to False there (True decays
    only the touched rows' slots, not stock)."""

    _checked = ("rho", "momentum", "epsilon")

    @property
    def _lazy_default(self):
        return bool(self._momentum)

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        # rho in the variables' dtype, as stock: 1 - rho from it is stock's one_minus_rho.
        rho = tf.identity(self._get_hyper("rho", dtype))
        if not self._momentum:
            slots = {"velocity": self._slot_handles("rms", tvars)}
            if self.centered:
                slots["average_gradient"] = self._slot_handles("mg", tvars)
            return ("rmsprop", slots, {"rho": rho, "momentum": 0.0, "epsilon": self.epsilon},
                    {"centered": bool(self.centered), "has_momentum": False, "epsilon_outside_sqrt": True})
        slots = [self._slot_handles("rms", tvars), self._slot_handles("momentum", tvars)]
        if self.centered:
            slots.append(self._slot_handles("mg", tvars))
        return ("tf_rmsprop", slots, {"rho": rho,
                                      "momentum": tf.identity(self._get_hyper("momentum", dtype)),
                                      "epsilon": self.epsilon}, {"centered": bool(self.centered)})


class _LegacyAdagrad(_LegacyFusedMixin, _legacy_stock.Adagrad):
    """tf_keras.optimizers.legacy.Adagrad as one fused op: TF's ResourceApplyAdagradV2,
    `accumulator += g^2; var -= lr*g / (sqrt(accumulator) + epsilon)`, epsilon outside the square
    root (tfclip's `adagrad` rule with `epsilon_outside_sqrt`; slot `accumulator`, starting at
    `initial_accumulator_value`), and for IndexedSlices, as stock's
    ResourceSparseApplyAdagradV2, only the rows the gradient touches (`lazy_sparse` defaults to
    True)."""

    _checked = ("epsilon",)

    _lazy_default = True

    def _op_inputs(self, tvars):
        return ("adagrad", [self._slot_handles("accumulator", tvars)], {"epsilon": self.epsilon},
                {"epsilon_outside_sqrt": True})


class _LegacyAdadelta(_LegacyFusedMixin, _legacy_stock.Adadelta):
    """tf_keras.optimizers.legacy.Adadelta as one fused op: TF's ResourceApplyAdadelta (tfclip's
    `adadelta` rule; slots `accum_grad`, `accum_var`), and for IndexedSlices, as stock's
    ResourceSparseApplyAdadelta, only the rows the gradient touches (`lazy_sparse` defaults to
    True)."""

    _checked = ("rho", "epsilon")

    _lazy_default = True

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        return ("adadelta", [self._slot_handles("accum_grad", tvars), self._slot_handles("accum_var", tvars)],
                {"rho": tf.identity(self._get_hyper("rho", dtype)), "epsilon": self.epsilon}, {})


class _LegacyAdamax(_LegacyFusedMixin, _legacy_stock.Adamax):
    """tf_keras.optimizers.legacy.Adamax as one fused op: TF's ResourceApplyAdaMax (tfclip's
    `adamax` rule, beta_1 and its power in the variables' dtype as stock; slots `m`, `v`), and for
    IndexedSlices, as stock's own sparse update, only the rows the gradient touches
    (`lazy_sparse` defaults to True)."""

    _checked = ("beta_1", "beta_2", "epsilon")

    _lazy_default = True

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.identity(self._get_hyper("beta_1", dtype))
        return ("adamax", [self._slot_handles("m", tvars), self._slot_handles("v", tvars)],
                {"beta_1": beta_1, "beta_2": tf.identity(self._get_hyper("beta_2", dtype)),
                 "epsilon": self.epsilon, "step": tf.cast(step, tf.float64)}, {})


class _LegacyFtrl(_LegacyFusedMixin, _legacy_stock.Ftrl):
    """tf_keras.optimizers.legacy.Ftrl as one fused op: TF's ResourceApplyFtrl / FtrlV2 (l2
    shrinkage), l2 adjusted by beta / (2 lr) as stock (tfclip's `ftrl` / `ftrl_sqrt` rules; slots
    `accumulator`, `linear`), and for IndexedSlices, as stock's ResourceSparseApplyFtrl(V2), only
    the rows the gradient touches (`lazy_sparse` defaults to True)."""

    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "beta")

    _lazy_default = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The power as constructed (a number, or a tensor / callable): it picks the rule.
        self._tfclip_lr_power = self._hyper["learning_rate_power"]

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        kind, power = _opcall.ftrl_variant(self._tfclip_lr_power)
        if power:
            power = {"lr_power": tf.identity(self._get_hyper("learning_rate_power", dtype))}
        return (kind, [self._slot_handles("accumulator", tvars), self._slot_handles("linear", tvars)],
                {**power, "l1": tf.identity(self._get_hyper("l1_regularization_strength", dtype)),
                 "l2": tf.identity(self._get_hyper("l2_regularization_strength", dtype)),
                 "l2_shrinkage": self._l2_shrinkage_regularization_strength,
                 "beta": tf.identity(self._get_hyper("beta", dtype))}, {})


_NADAM_STEPS = threading.local()  # legacy Nadam's product within a step, per thread (replica)


class _LegacyNadam(_LegacyFusedMixin, _legacy_stock.Nadam):
    """tf_keras.optimizers.legacy.Nadam as one fused op: stock's own update (tfclip's `nadam`
    rule with `legacy_nadam` and `schedule_decay`): the momentum schedule
    `m_t = beta_1 * (1 - 0.5 * 0.96^(schedule_decay * t))`, its running product kept in stock's
    `momentum_cache` weight (`_m_cache`, advanced once per step, also by a skipped one, as
    `iterations`), `m = beta_1*m + (1-beta_1)*g`, `v = beta_2*v + (1-beta_2)*g^2`, epsilon
    added to sqrt(v / (1 - beta_2^t)); the learning rate not decayed (stock passes
    `schedule_decay` as OptimizerV2's `decay` but does not use it on the learning rate). The
    constants in each variable's dtype, as stock (a step over several dtypes is one op per dtype
    on one norm pass; the product is stored from the `momentum_cache`'s dtype, as stock).

    IndexedSlices: stock decays every row's `m` and `v` but moves only the touched rows of the
    variable, which is neither the dense update (it moves every row) nor the lazy one (it leaves
    the other rows' slots alone): such a step runs the stock ops, with a warning once, unless
    `lazy_sparse=True` (then only the touched rows and their slots, not stock)."""

    _checked = ("beta_1", "beta_2", "epsilon")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self._initial_decay, (int, float)) and not isinstance(self._initial_decay, bool):
            _check_number("schedule_decay", float(self._initial_decay))

    def _stock_reason(self, grads_and_vars):
        reason = super()._stock_reason(grads_and_vars)
        if reason is None and not self.lazy_sparse and any(isinstance(g, tf.IndexedSlices) for g, _ in grads_and_vars):
            return ("an IndexedSlices gradient: stock decays every row's m and v but moves only the touched "
                    "rows of the variable, which no fused update does (lazy_sparse=True: only the touched "
                    "rows and their slots)")
        return reason

    def _tfclip_group(self, v):
        return v.dtype.base_dtype.name

    def _tfclip_lr(self, tvars):
        # Stock's _prepare_local: the learning rate as set, in the variables' dtype (not
        # _decayed_lr: `decay` holds the schedule_decay).
        return tf.identity(self._get_hyper("learning_rate", tvars[0].dtype.base_dtype))

    def _fused_step(self, grads, tvars):
        # Stock's _prepare: the product as it was before this step, read once for every dtype.
        # Kept per thread, not on the optimizer: under a MirroredStrategy every replica runs this
        # at once, each in its own thread.
        step = _NADAM_STEPS.__dict__.setdefault("by_opt", {})
        step[id(self)] = {"read": tf.identity(self._m_cache), "new": None}
        try:
            applied = super()._fused_step(grads, tvars)
        finally:
            new = step.pop(id(self))["new"]
        if new is None:
            return applied
        # Stored after the op ran (a step that fails writes nothing), and the step's result waits
        # for it (a TF1 train op runs it).
        with tf.control_dependencies([applied]):
            stored = self._m_cache.assign(new)
        with tf.control_dependencies([stored]):
            return tf.identity(applied)

    def _op_inputs(self, tvars):
        dtype = tvars[0].dtype.base_dtype
        t = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.identity(self._get_hyper("beta_1", dtype))
        beta_2 = tf.identity(self._get_hyper("beta_2", dtype))
        # Stock's m_schedule_new, in the dtype and order of its _prepare_local; the rule computes
        # m_t and m_t_1 itself from the same numbers.
        m_t = beta_1 * (1.0 - 0.5 * tf.pow(tf.cast(0.96, dtype), self._initial_decay * t))
        step = _NADAM_STEPS.by_opt[id(self)]
        product = tf.cast(step["read"], dtype) * m_t
        if dtype == self._m_cache.dtype.base_dtype:
            step["new"] = product
        return ("nadam", [self._slot_handles("m", tvars), self._slot_handles("v", tvars)],
                {"beta_1": beta_1, "beta_2": beta_2, "epsilon": self.epsilon, "step": tf.cast(t, tf.float64),
                 "u_product": product, "schedule_decay": self._initial_decay}, {"legacy_nadam": True})


for _cls, _name in ((_LegacySGD, "SGD"), (_LegacyAdam, "Adam"), (_LegacyRMSprop, "RMSprop"),
                    (_LegacyAdagrad, "Adagrad"), (_LegacyAdadelta, "Adadelta"), (_LegacyAdamax, "Adamax"),
                    (_LegacyFtrl, "Ftrl"), (_LegacyNadam, "Nadam")):
    # (qualname: reprs say tfclip.tf_keras.legacy.Adam, not tfclip.tf_keras.Adam)
    _cls.__name__, _cls.__qualname__ = _name, "legacy." + _name


class legacy:  # noqa: N801 (a namespace, as tf_keras.optimizers.legacy)
    """Drop-ins for tf_keras.optimizers.legacy.SGD, Adam, RMSprop, Adagrad, Adadelta, Adamax, Ftrl
    and Nadam."""

    SGD = _LegacySGD
    Adam = _LegacyAdam
    RMSprop = _LegacyRMSprop
    Adagrad = _LegacyAdagrad
    Adadelta = _LegacyAdadelta
    Adamax = _LegacyAdamax
    Ftrl = _LegacyFtrl
    Nadam = _LegacyNadam


_LEGACY_CLASSES = (legacy.SGD, legacy.Adam, legacy.RMSprop, legacy.Adagrad, legacy.Adadelta, legacy.Adamax,
                   legacy.Ftrl, legacy.Nadam)
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
