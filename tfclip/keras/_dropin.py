"""What the Keras 3 drop-ins (tfclip/keras/__init__.py) share: `_FusedMixin`, the stock optimizer
with its update replaced by the one fused step (tfclip._engine.dropin, around
tfclip._engine.step.run), tfclip's own state variables, the narrow slots of state_dtype, the
steps that run stock ops (`_stock_update_step`), the sources a class's binding reads, and
`_Generic`, the base of the classes whose constructor is the stock one verbatim."""
import contextlib
import threading
import warnings

import keras
import tensorflow as tf

from tfclip import clipping as _clipping
from tfclip._engine import checks as _checks
from tfclip._engine import collectives as _coll
from tfclip._engine import dropin as _dropin
from tfclip._engine import loss_scale as _loss_scale
from tfclip._engine import mixup as _mixup
from tfclip._engine import narrow_state as _narrow
from tfclip._engine import opcall as _opcall
from tfclip._engine import reduce as _reduce
from tfclip._engine import shard as _shard
from tfclip._engine import step as _step
from tfclip._engine import xla as _xla


def _xla_fallback_reason(opt, grads, tvars):
    """Why this XLA-compiled step cannot run tfclip's kernels, or None."""
    if not _xla.kernels():
        import tfclip._build_info as _build_info

        return (f"this build of tfclip has no XLA kernels (built against TensorFlow "
                f"{_build_info.TF_VERSION}: {_build_info.XLA_WHY_NOT or 'the build left them out'}; "
                f"docs/xla.md, Versions)")
    # On GPU the XLA kernel densifies IndexedSlices (XLA keeps their indices on the device), which
    # cannot give lazy_sparse's rows or stock Keras's sum of a repeated row's squares.
    # (Adafactor with factored_state takes them densified anyway: tfclip._engine.step, run.)
    if (any(isinstance(g, tf.IndexedSlices) for g in grads) and any("GPU" in v.device for v in tvars)
            and not getattr(opt, "factored_state", False)
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
        _checks.check_number(name, float(v))


# Keras 3's own names for the slots it makes (add_variable_from_reference's `name`) where they are
# not the rule table's: int8 state's code (signed or not) is the table's slot's
# (tfclip._engine.narrow_state.made_signed).
_KERAS_SLOT_NAMES = {"momentum": "m", "velocity": "v", "velocity_hat": "vhat", "norm": "u"}


class _FusedMixin(_dropin.Dropin):
    """The fused update every drop-in shares (see the module docstring)."""

    _tfclip_library = "keras"  # (tfclip._engine.mixup)

    def __init__(self, *args, clip=None, stochastic_rounding=False, rounding_seed=0, shard_state=False,
                 reduce_dtype=None, **kwargs):
        # `clip`: an adaptive clip (tfclip.clipping), bfloat16 variables' stochastic rounding
        # (csrc/core/rounding.h) and `shard_state` (tfclip/_engine/shard.py), taken here for every class;
        # the stock class gets the rest.
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_tfclip_clip", _clipping.get(clip))
        self._tfclip_rounding_init(stochastic_rounding, rounding_seed)
        object.__setattr__(self, "shard_state", _shard.check(shard_state))
        # reduce_dtype (tfclip/_engine/reduce.py): the gradients summed across replicas in 16 bits.
        object.__setattr__(self, "reduce_dtype", _reduce.check(reduce_dtype))
        object.__setattr__(self, "_tfclip_owner", None)  # each variable's owning replica, by build

    def _tfclip_init(self, nonfinite, lazy_sparse, state_dtype=None):
        # A tf_keras (Keras 2) program handing this optimizer to its model: the error names
        # tfclip.tf_keras.<Class> (tfclip/_engine/mixup.py; only where tf_keras is loaded already).
        _mixup.install()
        _opcall.check_policy(nonfinite)
        # Before the stock build makes any slot (object.__setattr__: not a tracked attribute).
        object.__setattr__(self, "state_dtype", _narrow.check_state_dtype(state_dtype, type(self)))
        # The learning rate and weight decay as numbers (a schedule or callable: per step, by
        # the op): finite, the one refusal of tfclip's own (docs/differences.md).
        lr = getattr(self, "_learning_rate", None)
        if isinstance(lr, keras.Variable) and tf.executing_eagerly():
            _checks.check_number("learning_rate", float(lr.numpy()))
        wd = self.weight_decay
        if isinstance(wd, (int, float)) and not isinstance(wd, bool):
            _checks.check_number("weight_decay", float(wd))
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
            for attr, name, value, dtype in _dropin.STATE_VARIABLES:
                object.__setattr__(self, attr, _state_variable(value, name, dtype))
        object.__setattr__(self, "_tensor_norms", None)  # made by build (one per variable)
        object.__setattr__(self, "_clipped_units", None)  # made by build with an AGC clip

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        # The stock build makes every slot here, in its variable's dtype; with
        # state_dtype="bfloat16" a float32 variable's slots are bfloat16 (add_variable below).
        # Not the base class's own: use_ema's averages and gradient_accumulation_steps's sums
        # stay in the variable's dtype (stock code updates them, in that dtype).
        if name in ("average", "gradient_accumulator"):  # (stock code updates them on every copy)
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        with self._tfclip_slot_scope(reference_variable):
            return self._tfclip_add_slot(reference_variable, name, initializer)

    @contextlib.contextmanager
    def _tfclip_slot_scope(self, reference_variable):
        """Where a slot of `reference_variable` is made: on its owning replica's device alone with
        shard_state (tfclip/_engine/shard.py), a `_shard.RemoteSlot` where that replica is in another
        worker process (`add_variable`), else where the stock class makes it."""
        if self._tfclip_owner is None:
            yield
            return
        owner = self._tfclip_owner[self._get_variable_index(reference_variable)]
        device = _shard.local_device(tf.distribute.get_strategy(), owner, remote_ok=True)
        object.__setattr__(self, "_tfclip_making", (owner, device))
        try:
            with _shard.on_device(device) if device is not None else contextlib.nullcontext():
                yield
        finally:
            object.__setattr__(self, "_tfclip_making", None)

    def _tfclip_slot_or_remote(self, make, shape, dtype, name):
        """A slot `make()` makes, or its `_shard.RemoteSlot` (owned in another worker process),
        kept for the checkpoint exchange, inside `_tfclip_slot_scope`."""
        making = getattr(self, "_tfclip_making", None)
        exchange = getattr(self, "_tfclip_exchange", None)
        if making is None or exchange is None:
            return make()
        owner, device = making
        slot = make() if device is not None else _shard.RemoteSlot(shape, dtype, name, f"{self.name}/{name}", owner)
        exchange.add(slot, owner)
        return slot

    def _tfclip_add_slot(self, reference_variable, name, initializer):
        dtype = _narrow.state_slot_dtype(getattr(self, "state_dtype", None), reference_variable.dtype,
                                       sharded=self._tfclip_owner is not None)
        if dtype == tf.as_dtype(reference_variable.dtype):
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        if dtype == tf.uint8:  # int8 state: the codes, and their absmax beside them
            signed = _narrow.made_signed(self._tfclip_binding, self, name, _KERAS_SLOT_NAMES)
            index, absmax = _narrow.int8_start(_narrow.initial_number(initializer), signed)
            initializer = keras.initializers.Constant(index)
        object.__setattr__(self, "_tfclip_slot_dtype", dtype.name)
        try:
            slot = super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        finally:
            object.__setattr__(self, "_tfclip_slot_dtype", None)
        if dtype == tf.uint8:
            a = self.add_variable((_narrow.int8_blocks(reference_variable.shape),),
                                  initializer=keras.initializers.Constant(absmax), dtype="float32",
                                  name=f"{slot.name}_absmax")
            _narrow.keep_int8_slot(self, slot, a, signed)
        return slot

    def add_variable(self, *args, **kwargs):
        slot_dtype = getattr(self, "_tfclip_slot_dtype", None)
        if slot_dtype is not None:  # (a slot made by add_variable_from_reference above)
            kwargs["dtype"] = slot_dtype
        shape = kwargs.get("shape", args[0] if args else None)
        if getattr(self, "_tfclip_making", None) is not None and getattr(self, "_tfclip_exchange", None):
            def remote_or_real():
                return super(_FusedMixin, self).add_variable(*args, **kwargs)

            slot = self._tfclip_slot_or_remote(remote_or_real, shape, kwargs.get("dtype") or "float32", kwargs.get("name"))
            if isinstance(slot, _shard.RemoteSlot):
                self._track_variable(slot)
            return slot
        return super().add_variable(*args, **kwargs)

    def build(self, var_list):
        # shard_state: each variable's owner, before the stock build makes the slots there; an
        # owner in another worker process: a RemoteSlot here, and the checkpoint exchange.
        owner, exchange = _shard.plan(var_list, self.shard_state, remote_ok=True,
                                      weights=self._tfclip_state_weights(var_list))
        object.__setattr__(self, "_tfclip_owner", owner)
        object.__setattr__(self, "_tfclip_exchange", exchange)
        self._tfclip_build_slots(var_list)
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
        return self._tfclip_config(super().get_config())

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

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        tvars = [_tf_var(v) for v in trainable_variables]
        # Sum across replicas first (a no-op without a strategy), then clip the sum; with
        # reduce_dtype the float32 variables' gradients cross the link in 16 bits.
        grads = _reduce.cast(grads, tvars, self.reduce_dtype, type(self).__name__)
        # shard_state across worker processes: each replica receives only the sums of its own
        # variables' gradients (a reduce-scatter, below: half the all-reduce's bytes) and the norms.
        owners = self._tfclip_owners_of(trainable_variables)
        scatter = _shard.scatters(grads, owners)
        if not scatter and _coll.in_step(grads):  # (across worker processes on CPUs: in pieces, the ring's
            grads = _coll.all_reduce(grads)        # bytes; tfclip/_engine/collectives.py)
        elif not scatter:
            reduced = self._all_reduce_sum_gradients(list(zip(grads, tvars)))
            grads = [g for g, _ in reduced]
        # Under jit_compile=True the fused op compiles to tfclip's custom calls (csrc/xla); a step
        # they cannot take (IndexedSlices on a GPU; a build without them) runs stock ops, said once.
        why = _xla_fallback_reason(self, grads, tvars) if _xla.in_context() else None
        if why is not None:
            if _loss_scale.loss_scale(self) is not None:  # (its wrapper checked first)
                raise RuntimeError(f"tfclip.keras.LossScaleOptimizer folded its unscale into a step that "
                                   f"cannot run tfclip's kernels: {why}")
            _xla.warn_once("keras", f"tfclip.keras: {why}, so inside jit_compile=True the optimizer step runs "
                           "stock Keras ops (clipping after the all-reduce, the same results). Compile the model "
                           "with jit_compile=False for tfclip's fused kernels.")
            return self._stock_update_step(grads, trainable_variables, tvars, learning_rate)
        why = self._tfclip_stock_semantics(grads)
        if why is not None:
            if _loss_scale.loss_scale(self) is not None:
                raise RuntimeError(f"tfclip.keras.LossScaleOptimizer folded its unscale into a step that "
                                   f"runs stock ops: {why}")
            return self._stock_update_step(grads, trainable_variables, tvars, learning_rate, cannot=why)
        if scatter:
            return _shard.scattered_step(grads, owners, lambda summed: self._fused_update_step(
                summed, trainable_variables, learning_rate))
        return self._fused_update_step(grads, trainable_variables, learning_rate)

    def _tfclip_stock_semantics(self, grads):
        """Why these gradients need the stock class's own step to get its result (a class whose
        stock arithmetic on them the fused op does not have: Adafactor's), or None."""
        return None

    # -- the fused op -------------------------------------------------------------------
    def _fused_update_step(self, grads, keras_vars, learning_rate):
        # The one fused step (tfclip._engine.dropin). Keras applies weight decay per variable
        # (exclude_from_weight_decay): one op per group, the global norm computed once for both.
        # IndexedSlices (embeddings) go to the op as they are: their norm is the norm of
        # `.values` (as tf.linalg.global_norm and Keras count it), and they are applied without
        # densifying, with stock Keras's results (or only their rows, with lazy_sparse). Stock
        # Keras's Adam feeds v the sum of a duplicated row's squared slices, except after
        # global_clipnorm, whose `g * scale` densifies (summing the duplicates) first.
        return self._tfclip_fused_step(grads, keras_vars, _opcall.scalar(learning_rate, "learning_rate"),
                                       keras_sparse_squares=True)

    def _tfclip_decay(self):
        return self.weight_decay is not None and self.weight_decay != 0

    def _tfclip_position(self, v):
        return self._get_variable_index(v)

    def _tfclip_tf_var(self, v):
        return _tf_var(v)

    def _tfclip_absmax_handles(self, keras_vars):
        """int8 state's absmax handles of `keras_vars`, slot-major (the op's `absmax` input)."""
        out = []
        for _, attr in self._tfclip_binding.slot_names(self):
            slot_list = getattr(self, attr)
            for v in keras_vars:
                a = self._tfclip_absmax.get(id(slot_list[self._get_variable_index(v)]))
                if a is not None:
                    out.append(_tf_var(a).handle)
        return out

    # The binding's sources (tfclip/_engine/step.py, Binding): a slot list by its attribute, a
    # hyper-parameter by its attribute (a callable one called, as Keras does), the step.
    def _tfclip_slot(self, attr, keras_vars):
        slot_list = getattr(self, attr)
        return [_tf_var(slot_list[self._get_variable_index(v)]).handle for v in keras_vars]

    def _tfclip_hparam(self, name, keras_vars):
        v = getattr(self, name)
        return v() if callable(v) else v

    # -- a step in stock Keras ops (clipping after the all-reduce) ---------------------------
    def _stock_update_step(self, grads, keras_vars, tvars, learning_rate, cannot=None):
        # cannot: why the fused op cannot take this step (default: XLA's fallback).
        cannot = cannot or ("this build cannot compile inside an XLA-compiled function (jit_compile=True); "
                            "compile the model with jit_compile=False")
        for on, what in ((self.state_dtype is not None, f"state_dtype={self.state_dtype!r}"),
                         (self._tfclip_owner is not None, "shard_state=True"),
                         (self.stochastic_rounding, "stochastic_rounding=True"),
                         (getattr(self, "factored_state", False), "factored_state=True")):
            if on:
                raise ValueError(f"{what} needs tfclip's fused op, and this step runs stock Keras ops: {cannot}")
        if self.nonfinite == "raise":
            raise ValueError(f"nonfinite='raise' needs tfclip's fused op, and this step runs stock Keras ops: "
                             f"{cannot}; use 'skip' or 'propagate'")
        base = super(_FusedMixin, self)

        def update(clipped):
            base._apply_weight_decay(keras_vars)
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step, self._distribution_strategy,
                list(zip(clipped, tvars)), learning_rate)

        mode, clip = self._clip_mode()
        result = _step.run(grads, [], mode, clip, clip_obj=self.clip, nonfinite=self.nonfinite,
                           stock=_step.Stock(tvars, base._clip_gradients, update))
        self._tfclip_record(result, keras_vars)


class _Generic(_FusedMixin):
    """A drop-in whose constructor is the stock one verbatim (every argument passed through),
    plus tfclip's keyword-only `nonfinite` and `lazy_sparse`. `_checked`: the attributes checked
    against the op's ranges at construction."""

    _checked = ()

    def __init__(self, *args, nonfinite="skip", lazy_sparse=False, state_dtype=None, **kwargs):
        super().__init__(*args, **kwargs)
        _check_betas(self, self._checked)
        self._tfclip_init(nonfinite, lazy_sparse, state_dtype)
