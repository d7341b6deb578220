"""The tf_keras.optimizers.legacy (OptimizerV2) drop-ins, `tfclip.tf_keras.legacy.*`: the stock
classes' apply_gradients around one fused op (tfclip/tf_keras/_dropin.py), on the core rules that
compute TF's training ops. Documented with the rest in tfclip/tf_keras/__init__.py, whose `legacy`
namespace this module's classes are (their __module__ says tfclip.tf_keras, as they are named)."""
import threading
import warnings

import tensorflow as tf

from tfclip._engine import opcall as _opcall
from tfclip._engine import narrow_state as _narrow
from tfclip._engine import step as _step
from tfclip._engine import checks as _checks
from tfclip._engine import loss_scale as _loss_scale
from tfclip._engine import xla as _xla
from tfclip import clipping as _clipping
from tfclip._engine.binding import Binding
from tfclip.tf_keras._dropin import (_FusedMixin, _optimizer_utils, _outer_graph,
                                   _refuse_stock_step, _slots_as, _state_variable, _tf_keras)

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

    def __init__(self, *args, nonfinite="skip", lazy_sparse=None, clip=None, state_dtype=None,
                 stochastic_rounding=False, rounding_seed=0, **kwargs):
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))
        self._tfclip_rounding_init(stochastic_rounding, rounding_seed)
        super(_FusedMixin, self).__init__(*args, **kwargs)
        if lazy_sparse is None:
            lazy_sparse = self._lazy_default
        set_clips = [k for k in _opcall.CLIP_ARGS if getattr(self, k) is not None]
        if len(set_clips) > 1:
            self._tfclip_stock_reason = f"{' and '.join(set_clips)} are both set"
        else:
            self._tfclip_stock_reason = None
            _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)

    def get_config(self):
        return self._tfclip_config(super(_FusedMixin, self).get_config(), self._lazy_default)

    def add_slot(self, var, slot_name, initializer="zeros", shape=None):
        # With state_dtype="bfloat16" a float32 variable's slots are bfloat16 (also those a
        # checkpoint restores when they are made). A mixed-precision variable's true dtype: inside
        # an autocast scope (a lazily built model's first call restoring its slots) its dtype
        # says float16.
        # With state_dtype="int8" the slot is uint8 codes, with a float32 slot
        # `<slot_name>_absmax` beside it (made here; when a checkpoint restores them as they are
        # made, each is restored on its own).
        true = tf.as_dtype(getattr(var, "true_dtype", var.dtype)).base_dtype
        dtype = _narrow.state_slot_dtype(self.state_dtype, true)
        if dtype == true or (dtype == tf.uint8 and slot_name.endswith("_absmax")):
            return super().add_slot(var, slot_name, initializer, shape)
        if dtype != tf.uint8:
            with _slots_as(dtype):
                return super().add_slot(var, slot_name, initializer, shape)
        absmax = 0.0  # (restored with the codes)
        signed = _narrow.made_signed(self._tfclip_binding, self, slot_name)
        if not isinstance(initializer, tf.__internal__.tracking.CheckpointInitialValueCallable):
            index, absmax = _narrow.int8_start(_narrow.initial_number(initializer), signed)
            initializer = _tf_keras.initializers.Constant(index)
        with _slots_as(dtype):
            slot = super().add_slot(var, slot_name, initializer, shape)
        a = super().add_slot(var, f"{slot_name}_absmax", _tf_keras.initializers.Constant(absmax),
                             [_narrow.int8_blocks(var.shape)])
        _narrow.keep_int8_slot(self, slot, a, signed, (var, slot_name))
        return slot

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
        if _xla.in_context() and not _xla.kernels():
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

    # The binding's sources (tfclip/_engine/step.py, Binding): a slot by its name; a hyper-parameter
    # from `_hyper` in the variables' dtype, as stock reads it (`_get_hyper`), else the attribute.
    def _tfclip_slot_var(self, slot_name, v):
        return self.get_slot(v, slot_name)

    def _tfclip_hparam(self, name, tvars):
        if name in self._hyper:
            return tf.identity(self._get_hyper(name, tvars[0].dtype.base_dtype))
        return getattr(self, name)

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
            _refuse_stock_step(self, reason)
            if _loss_scale.loss_scale(self) is not None:  # (its wrapper checks first: a bug if reached)
                raise RuntimeError(f"tfclip.tf_keras.LossScaleOptimizer folded its unscale into a step that "
                                   f"runs the stock ops: {reason}")
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


# -- the drop-ins: each class's rule binding is one data row (tfclip/_engine/step.py, Binding); the
# stock legacy classes compute their constants in the variables' dtype, so these do too.
def _step_in_f64(opt, tvars):
    """iterations + 1 in the variables' dtype, as stock's local_step, given as float64."""
    return tf.cast(tf.cast(opt.iterations + 1, tvars[0].dtype.base_dtype), tf.float64)


def _beta_power(name):
    """ResourceApplyAdam's beta^t, in the variables' dtype."""
    def power(opt, tvars):
        dtype = tvars[0].dtype.base_dtype
        return tf.pow(opt._tfclip_hparam(name, tvars), tf.cast(opt.iterations + 1, dtype))
    return power


def _no_momentum(opt):
    return not opt._momentum


def _legacy_nadam_product(opt, tvars):
    """Stock's m_schedule_new for this dtype: the product read before the step times
    m_t = beta_1 * (1 - 0.5 * 0.96^(schedule_decay * t)), in the dtype and order of stock's
    _prepare_local (the rule computes m_t and m_t_1 itself from the same numbers)."""
    dtype = tvars[0].dtype.base_dtype
    t = tf.cast(opt.iterations + 1, dtype)
    m_t = opt._tfclip_hparam("beta_1", tvars) * (1.0 - 0.5 * tf.pow(tf.cast(0.96, dtype), opt._initial_decay * t))
    step = _NADAM_STEPS.by_opt[id(opt)]
    product = tf.cast(step["read"], dtype) * m_t
    if dtype == opt._m_cache.dtype.base_dtype:
        step["new"] = product
    return product


class _LegacySGD(_LegacyFusedMixin, _legacy_stock.SGD):
    """tf_keras.optimizers.legacy.SGD as one fused op: ResourceApplyGradientDescent, or
    ResourceApplyKerasMomentum with momentum (and for IndexedSlices, as stock's
    ResourceSparseApplyKerasMomentum, only the rows the gradient touches: `lazy_sparse` defaults
    to True there)."""

    _tfclip_binding = Binding(("sgd", "keras_momentum"), pick=lambda o: "keras_momentum" if o._momentum else "sgd",
                              slots=(("accum", "momentum", "_momentum"),), hparams=(("momentum", "momentum", "_momentum"),),
                              flags=(("use_nesterov", "nesterov", "_momentum"),))

    _checked = ()

    _lazy_default = True

    def _tfclip_lazy(self):
        return self.lazy_sparse if self._momentum else False


class _LegacyAdam(_LegacyFusedMixin, _legacy_stock.Adam):
    """tf_keras.optimizers.legacy.Adam as one fused op: ResourceApplyAdam's update (the beta
    powers in the variables' dtype, epsilon added to sqrt(v)), amsgrad too."""

    _tfclip_binding = Binding("adam", slots=(("m", "m"), ("v", "v"), ("vhat", "vhat", "amsgrad")),
                              hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"),
                                       ("step", _step_in_f64), ("beta_1_power", _beta_power("beta_1")),
                                       ("beta_2_power", _beta_power("beta_2"))),
                              flags=(("amsgrad", "amsgrad"),))

    _checked = ("epsilon",)


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

    _tfclip_binding = Binding(
        ("rmsprop", "tf_rmsprop"), pick=lambda o: "tf_rmsprop" if o._momentum else "rmsprop",
        slots=(("velocity", "rms", _no_momentum), ("average_gradient", "mg", lambda o: not o._momentum and o.centered),
               ("rms", "rms", "_momentum"), ("mom", "momentum", "_momentum"),
               ("mg", "mg", lambda o: o._momentum and o.centered)),
        hparams=(("rho", "rho"), ("momentum", lambda o, tvars: o._tfclip_hparam("momentum", tvars) if o._momentum else 0.0),
                 ("epsilon", "epsilon")),
        flags=(("centered", "centered"), ("has_momentum", lambda o: False, _no_momentum),
               ("epsilon_outside_sqrt", lambda o: True, _no_momentum)))

    _checked = ("rho", "momentum", "epsilon")

    @property
    def _lazy_default(self):
        return bool(self._momentum)


class _LegacyAdagrad(_LegacyFusedMixin, _legacy_stock.Adagrad):
    """tf_keras.optimizers.legacy.Adagrad as one fused op: TF's ResourceApplyAdagradV2,
    `accumulator += g^2; var -= lr*g / (sqrt(accumulator) + epsilon)`, epsilon outside the square
    root (tfclip's `adagrad` rule with `epsilon_outside_sqrt`; slot `accumulator`, starting at
    `initial_accumulator_value`), and for IndexedSlices, as stock's
    ResourceSparseApplyAdagradV2, only the rows the gradient touches (`lazy_sparse` defaults to
    True)."""

    _tfclip_binding = Binding("adagrad", slots=(("accumulator", "accumulator"),), hparams=(("epsilon", "epsilon"),),
                              flags=(("epsilon_outside_sqrt", lambda o: True),))

    _checked = ("epsilon",)

    _lazy_default = True


class _LegacyAdadelta(_LegacyFusedMixin, _legacy_stock.Adadelta):
    """tf_keras.optimizers.legacy.Adadelta as one fused op: TF's ResourceApplyAdadelta (tfclip's
    `adadelta` rule; slots `accum_grad`, `accum_var`), and for IndexedSlices, as stock's
    ResourceSparseApplyAdadelta, only the rows the gradient touches (`lazy_sparse` defaults to
    True)."""

    _tfclip_binding = Binding("adadelta", slots=(("accumulated_grad", "accum_grad"), ("accumulated_delta_var", "accum_var")),
                              hparams=(("rho", "rho"), ("epsilon", "epsilon")))

    _checked = ("rho", "epsilon")

    _lazy_default = True


class _LegacyAdamax(_LegacyFusedMixin, _legacy_stock.Adamax):
    """tf_keras.optimizers.legacy.Adamax as one fused op: TF's ResourceApplyAdaMax (tfclip's
    `adamax` rule, beta_1 and its power in the variables' dtype as stock; slots `m`, `v`), and for
    IndexedSlices, as stock's own sparse update, only the rows the gradient touches
    (`lazy_sparse` defaults to True)."""

    _tfclip_binding = Binding("adamax", slots=(("m", "m"), ("u", "v")),
                              hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"),
                                       ("step", _step_in_f64)))

    _checked = ("beta_1", "beta_2", "epsilon")

    _lazy_default = True


class _LegacyFtrl(_LegacyFusedMixin, _legacy_stock.Ftrl):
    """tf_keras.optimizers.legacy.Ftrl as one fused op: TF's ResourceApplyFtrl / FtrlV2 (l2
    shrinkage), l2 adjusted by beta / (2 lr) as stock (tfclip's `ftrl` / `ftrl_sqrt` rules; slots
    `accumulator`, `linear`), and for IndexedSlices, as stock's ResourceSparseApplyFtrl(V2), only
    the rows the gradient touches (`lazy_sparse` defaults to True)."""

    low_precision_state = False  # (its linear slot is a weight: tfclip.rules says why)

    _tfclip_binding = Binding(("ftrl", "ftrl_sqrt"), pick=lambda o: _opcall.ftrl_variant(o._tfclip_lr_power)[0],
                              slots=(("accumulator", "accumulator"), ("linear", "linear")),
                              hparams=(("lr_power", "learning_rate_power",
                                        lambda o: _opcall.ftrl_variant(o._tfclip_lr_power)[0] == "ftrl"),
                                       ("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"),
                                       ("l2_shrinkage", "_l2_shrinkage_regularization_strength"), ("beta", "beta")))

    _checked = ("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
                "beta")

    _lazy_default = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The power as constructed (a number, or a tensor / callable): it picks the rule.
        self._tfclip_lr_power = self._hyper["learning_rate_power"]


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

    _tfclip_binding = Binding("nadam", slots=(("m", "m"), ("v", "v")),
                              hparams=(("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"),
                                       ("step", _step_in_f64), ("u_product", _legacy_nadam_product),
                                       ("schedule_decay", "_initial_decay")),
                              flags=(("legacy_nadam", lambda o: True),))

    _checked = ("beta_1", "beta_2", "epsilon")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self._initial_decay, (int, float)) and not isinstance(self._initial_decay, bool):
            _checks.check_number("schedule_decay", float(self._initial_decay))

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
        read = tf.identity(self._m_cache)
        step[id(self)] = {"read": read, "new": None}
        try:
            applied = super()._fused_step(grads, tvars)
        finally:
            new = step.pop(id(self))["new"]
        if new is None:
            return applied
        # Stored after the op ran (a step that fails writes nothing), and the step's result waits
        # for it (a TF1 train op runs it). A skipped step advances it with `iterations` (the
        # schedule follows them), but under a loss scale's fold, whose skip is the stock
        # wrapper's: stock never reaches the inner step there, and the product stays.
        if _loss_scale.loss_scale(self) is not None:
            new = tf.where(applied, new, read)
        with tf.control_dependencies([applied]):
            stored = self._m_cache.assign(new)
        with tf.control_dependencies([stored]):
            return tf.identity(applied)


for _cls, _name in ((_LegacySGD, "SGD"), (_LegacyAdam, "Adam"), (_LegacyRMSprop, "RMSprop"),
                    (_LegacyAdagrad, "Adagrad"), (_LegacyAdadelta, "Adadelta"), (_LegacyAdamax, "Adamax"),
                    (_LegacyFtrl, "Ftrl"), (_LegacyNadam, "Nadam")):
    # (qualname and module: reprs say tfclip.tf_keras.legacy.Adam, not tfclip.tf_keras.Adam, and
    # pickles and the cross-library errors find them where users do)
    _cls.__name__, _cls.__qualname__ = _name, "legacy." + _name
    _cls.__module__ = "tfclip.tf_keras"


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
