"""What the tf_keras (Keras 2) drop-ins share: `_FusedMixin` (tfclip.tf_keras's optimizers) and
what `_LegacyFusedMixin` (tfclip/tf_keras/_legacy.py, the OptimizerV2 ones) builds on: tfclip's
own state variables, the stock apply_gradients with its update replaced by the one fused step
(tfclip._engine.dropin, around tfclip._engine.step.run; one op per group of variables), and the
sources a class's binding reads. The public classes and their docs: tfclip/tf_keras/__init__.py."""
import contextlib
import functools

import tensorflow as tf

try:
    import tf_keras as _tf_keras
except ImportError as _e:  # pragma: no cover - the optional dependency is absent
    raise ImportError("tfclip.tf_keras subclasses the optimizers of the tf-keras package (Keras 2), "
                      f"which is not installed ({_e}): pip install \"tfclip[tf-keras]\" (or "
                      "pip install tf-keras matching your TensorFlow). For Keras 3 use tfclip.keras.") from None

from tf_keras.src.optimizers import utils as _optimizer_utils

from tfclip import clipping as _clipping
from tfclip._engine import checks as _checks
from tfclip._engine import collectives as _coll
from tfclip._engine import dropin as _dropin
from tfclip._engine import narrow_state as _narrow
from tfclip._engine import opcall as _opcall
from tfclip._engine import reduce as _reduce
from tfclip._engine import shard as _shard
from tfclip._engine import xla as _xla

@contextlib.contextmanager
def _slots_as(dtype):
    """The variables made inside get `dtype` (state_dtype's slots, made by the stock code that
    gives them their variable's dtype): as a variable creator, so the strategy's own creators
    (MirroredStrategy's copies, its colocation) still run below it. An initializer called with
    a dtype (OptimizerV2.add_slot's, also when it restores a checkpoint) is called with this one;
    any other initial value is cast."""
    def creator(next_creator, **kwargs):
        init = kwargs.get("initial_value")
        if isinstance(init, functools.partial) and "dtype" in init.keywords:
            kwargs["initial_value"] = functools.partial(init.func, *init.args, **dict(init.keywords, dtype=dtype))
        elif callable(init):
            kwargs["initial_value"] = lambda: tf.cast(init(), dtype)
        elif init is not None:
            kwargs["initial_value"] = tf.cast(init, dtype)
        kwargs["dtype"] = dtype
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def _warn_xla_fallback():
    _xla.warn_once("tf_keras", "tfclip.tf_keras: this build of tfclip has no XLA kernels, so inside "
                   "jit_compile=True the optimizer step runs the stock tf_keras ops (which clip "
                   "after the all-reduce too; nonfinite is not honoured there). Compile with "
                   "jit_compile=False for tfclip's fused kernels.", stacklevel=4)


def _refuse_stock_step(opt, reason):
    """A stock step cannot run on state_dtype's slots (the stock ops take slots of their
    variable's dtype): the error, naming why the fused op is not used here."""
    if getattr(opt, "state_dtype", None) is not None:
        raise ValueError(f"{type(opt).__name__}(state_dtype={opt.state_dtype!r}) needs tfclip's fused op, "
                         f"which cannot run this step ({reason}); leave state_dtype at None for it")
    if getattr(opt, "_tfclip_owner", None) is not None:
        raise ValueError(f"{type(opt).__name__}(shard_state=True) needs tfclip's fused op, which "
                         f"cannot run this step ({reason}); leave shard_state off for it")
    if getattr(opt, "stochastic_rounding", False):
        raise ValueError(f"{type(opt).__name__}(stochastic_rounding=True) needs tfclip's fused op, which "
                         f"cannot run this step ({reason}); leave stochastic_rounding off for it")


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
        _checks.check_number(name, float(v))


class _FusedMixin(_dropin.Dropin):
    """The fused update every tf_keras drop-in shares (see the module docstring)."""

    _tfclip_library = "tf_keras"  # (tfclip._engine.mixup)
    _checked = ()
    # shard_state (tfclip/_engine/shard.py): off, and no owners, unless the constructor says so (the
    # legacy classes, tfclip/tf_keras/_legacy.py, do not take it).
    shard_state = False
    reduce_dtype = None  # (tfclip/_engine/reduce.py; nor do the legacy classes take it)
    _tfclip_owner = None
    _tfclip_exchange = None

    def __init__(self, *args, nonfinite="skip", lazy_sparse=False, clip=None, state_dtype=None,
                 stochastic_rounding=False, rounding_seed=0, shard_state=False, reduce_dtype=None, **kwargs):
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))
        self._tfclip_rounding_init(stochastic_rounding, rounding_seed)
        object.__setattr__(self, "shard_state", _shard.check(shard_state))  # (tfclip/_engine/shard.py)
        object.__setattr__(self, "reduce_dtype", _reduce.check(reduce_dtype))  # (tfclip/_engine/reduce.py)
        object.__setattr__(self, "_tfclip_owner", None)  # each variable's owning replica, by build
        super().__init__(*args, **kwargs)
        lr = getattr(self, "_learning_rate", None)
        if isinstance(lr, tf.Variable) and tf.executing_eagerly():
            _checks.check_number("learning_rate", float(lr.numpy()))
        wd = self.weight_decay
        if isinstance(wd, (int, float)) and not isinstance(wd, bool):
            _checks.check_number("weight_decay", float(wd))
        _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)

    def _tfclip_init(self, nonfinite, lazy_sparse, state_dtype):
        object.__setattr__(self, "state_dtype", _narrow.check_state_dtype(state_dtype, type(self)))
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
        for attr, name, value, dtype in _dropin.STATE_VARIABLES:
            object.__setattr__(self, attr, _state_variable(value, f"{self._tfclip_scope()}/{name}", dtype))
        object.__setattr__(self, "_tensor_norms", None)
        object.__setattr__(self, "_clipped_units", None)  # with an AGC clip, made with tensor_norms
        object.__setattr__(self, "_tensor_norm_names", [])
        object.__setattr__(self, "_tfclip_state_graph", _outer_graph())

    def build(self, var_list):
        built = getattr(self, "_built", False)
        if not built:  # shard_state: each variable's owner, before the stock build makes the slots there
            owner, exchange = _shard.plan(var_list, self.shard_state, remote_ok=True,
                                          weights=self._tfclip_state_weights(var_list))
            object.__setattr__(self, "_tfclip_owner", owner)
            object.__setattr__(self, "_tfclip_exchange", exchange)
        self._tfclip_build_slots(var_list)
        if not built and self._tensor_norms is None:
            object.__setattr__(self, "_tensor_norms", _state_variable(
                [0.0] * len(var_list), f"{self._tfclip_scope()}/tensor_norms", tf.float32))
            object.__setattr__(self, "_tensor_norm_names", [v.name for v in var_list])
            self._tfclip_make_clipped_units(len(var_list))
        self._tfclip_build_clip(self._tfclip_add_clip_variable)

    def _tfclip_slot_scope(self, model_variable):
        """Where `model_variable`'s slots are made: its owner's device alone with shard_state, a
        `_shard.RemoteSlot` where the owner is in another worker process (tfclip/_engine/shard.py)."""
        if self._tfclip_owner is None:
            return contextlib.nullcontext()
        owner = self._tfclip_owner[self._index(model_variable)]
        device = _shard.local_device(tf.distribute.get_strategy(), owner, remote_ok=True)
        return _shard.making_slots(owner, device, self._tfclip_exchange)

    def add_variable_from_reference(self, model_variable, variable_name, shape=None, initial_value=None):
        if variable_name == "average":
            return super().add_variable_from_reference(model_variable, variable_name, shape, initial_value)
        with self._tfclip_slot_scope(model_variable):
            return self._tfclip_add_slot(model_variable, variable_name, shape, initial_value)

    def _tfclip_add_slot(self, model_variable, variable_name, shape, initial_value):
        # The stock build makes every slot here in its variable's dtype (a mixed-precision
        # variable's true one); with state_dtype="bfloat16" a float32 variable's slots are
        # bfloat16. use_ema's "average" stays in the variable's dtype (stock code updates it).
        true = tf.as_dtype(getattr(model_variable, "true_dtype", model_variable.dtype))
        dtype = _narrow.state_slot_dtype(getattr(self, "state_dtype", None), true, sharded=self._tfclip_owner is not None)
        if dtype == true or variable_name == "average":
            return super().add_variable_from_reference(model_variable, variable_name, shape, initial_value)
        if dtype == tf.uint8:  # int8 state: the codes (an index into the code), then their absmax
            signed = _narrow.made_signed(self._tfclip_binding, self, variable_name)
            index, absmax = _narrow.int8_start(_narrow.initial_number(initial_value), signed)
            with _slots_as(dtype):
                slot = super().add_variable_from_reference(
                    model_variable, variable_name, None, tf.fill(model_variable.shape, float(index)))
            blocks = _narrow.int8_blocks(model_variable.shape)
            _narrow.keep_int8_slot(self, slot, super().add_variable_from_reference(
                model_variable, f"{variable_name}_absmax", [blocks], tf.fill([blocks], absmax)), signed)
            return slot
        with _slots_as(dtype):
            return super().add_variable_from_reference(model_variable, variable_name, shape, initial_value)

    def tfclip_absmax(self, slot):
        """The absmax variable of an int8-state slot variable (state_dtype="int8"), or None."""
        return (getattr(self, "_tfclip_absmax", None) or {}).get(id(slot))

    def tfclip_int8_slots(self):
        """int8 state's slots (state_dtype="int8"): `_narrow.Int8Slot`s (tfclip.convert_checkpoint)."""
        return list(getattr(self, "_tfclip_int8_slots", ()))

    def _tfclip_absmax_handles(self, tvars):
        """int8 state's absmax handles of `tvars`, slot-major (the op's `absmax` input)."""
        found = getattr(self, "_tfclip_absmax", None) or {}
        slots = (self._tfclip_slot_var(src, v) for _, src in self._tfclip_binding.slot_names(self) for v in tvars)
        return [found[id(s)].handle for s in slots if id(s) in found]

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
        with _checks.state_scope():
            clip.build(lambda name, shape, dtype: add(f"{clip.mode}_{name}", shape, dtype))

    def _tfclip_value(self, name):
        """A constructor argument, as given, for the checks."""
        return getattr(self, name)

    def _tfclip_scope(self):
        return getattr(self, "_name", None) or self.name

    # -- tfclip's own state (the properties and _record_norms: tfclip/_engine/dropin.py) --------
    @property
    def tensor_norm_names(self):
        """The variables' names, in the order of `tensor_norms`."""
        return list(self._tensor_norm_names)

    def get_config(self):
        return self._tfclip_config(super().get_config())

    # -- the stock apply_gradients, its update replaced -------------------------------------
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        if self._mesh or self._run_with_dtensor:
            raise NotImplementedError("tfclip.tf_keras optimizers do not run under DTensor; use the "
                                      f"stock tf_keras.optimizers.{type(self).__name__}")
        if _xla.in_context() and not _xla.kernels():
            _refuse_stock_step(self, "this build of tfclip has no XLA kernels and the step is jit-compiled")
            _warn_xla_fallback()
            return super().apply_gradients(grads_and_vars, name=name,
                                           skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            with _opcall.state_lock(self):
                return self._tfclip_apply_gradients(grads_and_vars, name, skip_gradients_aggregation, kwargs)
        return self._tfclip_apply_gradients(grads_and_vars, name, skip_gradients_aggregation, kwargs)

    def aggregate_gradients(self, grads_and_vars):
        # reduce_dtype: the float32 variables' gradients cross the link in 16 bits (the loss-scale
        # wrapper's step comes here too, through its inner optimizer).
        grads_and_vars = list(grads_and_vars)
        if self.reduce_dtype is not None:
            variables = [v for _, v in grads_and_vars]
            grads = _reduce.cast([g for g, _ in grads_and_vars], variables, self.reduce_dtype, type(self).__name__)
            grads_and_vars = list(zip(grads, variables))
        present = [g for g, _ in grads_and_vars if g is not None]
        if present and _coll.in_step(present):  # (across worker processes on CPUs: in pieces, the ring's
            summed = iter(_coll.all_reduce(present))  # bytes; tfclip/_engine/collectives.py)
            return [(None if g is None else next(summed), v) for g, v in grads_and_vars]
        return super().aggregate_gradients(grads_and_vars)

    def _tfclip_apply_gradients(self, grads_and_vars, name, skip_gradients_aggregation, kwargs):
        # tf_keras Optimizer.apply_gradients: sum across replicas (unless skipped) ...
        experimental_aggregate_gradients = kwargs.pop("experimental_aggregate_gradients", True)
        grads_and_vars = list(grads_and_vars)
        if not skip_gradients_aggregation and experimental_aggregate_gradients:
            # shard_state across worker processes: a reduce-scatter (each replica receives only
            # its own variables' sums, and the norms: tfclip/_engine/shard.py) instead.
            plan = self._tfclip_scatter_plan(grads_and_vars, name)
            if plan is not None:
                grads, variables, owners = plan
                return _shard.scattered_step(grads, owners, lambda summed: self._tfclip_apply_gradients(
                    list(zip(summed, variables)), name, True, kwargs))
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

    def _tfclip_scatter_plan(self, grads_and_vars, name):
        """(gradients to reduce-scatter, their variables, their owners): the pairs with a gradient,
        where shard_state steps across worker processes (tfclip/_engine/shard.py); else None. (Its
        wrapper's step, tfclip.tf_keras's loss scale, comes summed: the all-reduce.)"""
        if not self.shard_state or _shard.replicas() <= 1 or _shard.replica_id() is None:
            return None
        if not _coll.available(tf.distribute.get_strategy()):
            return None
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            return None
        variables = [v for _, v in grads_and_vars]
        with tf.name_scope(name or self.name or "optimizer"), tf.init_scope():
            self.build(variables)
        owners = self._tfclip_owners_of(variables)
        grads = _reduce.cast([g for g, _ in grads_and_vars], variables, self.reduce_dtype, type(self).__name__)
        if not _shard.scatters(grads, owners):
            return None
        return grads, variables, owners

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

    def _tfclip_position(self, v):
        return self._index(v)

    def _tfclip_lr(self, tvars):
        return self.learning_rate

    def _tfclip_decay(self):
        return self.weight_decay is not None and not (
            isinstance(self.weight_decay, (int, float)) and self.weight_decay == 0)

    # The binding's sources (tfclip/_engine/step.py, Binding): a slot list by its attribute, a
    # hyper-parameter by its attribute, the step.
    def _tfclip_slot(self, src, tvars):
        return [self._tfclip_slot_var(src, v).handle for v in tvars]

    def _tfclip_slot_var(self, attr, v):
        return getattr(self, attr)[self._index(v)]

    def _tfclip_hparam(self, name, tvars):
        return getattr(self, name)

    def _fused_step(self, grads, tvars):
        """The one fused step (tfclip._engine.dropin), one op per group of variables (weight
        decay, `_tfclip_group`), each group at its learning rate (`_tfclip_lr`)."""
        return self._tfclip_fused_step(grads, tvars, lambda group: _opcall.scalar(self._tfclip_lr(group), "learning_rate"))

    def _norm_positions(self, tvars):
        idx = [self._index(v) for v in tvars]
        return None if None in idx else (idx, int(self._tensor_norms.shape[0]))

