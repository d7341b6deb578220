"""What the Keras 3 drop-ins (tfclip.keras) and the Keras 2 ones (tfclip.tf_keras) share, `Dropin`:
their one fused step (`_tfclip_fused_step`, around tfclip._engine.step.run: int8's dense
gradients, shard_state's share, the variable groups, the loss scale, the norms recorded), and
tfclip's own optimizer state: the variables' names and dtypes, their read-only properties, and
the recording of a step's norms and clip counts into them.

Each library makes the variables with its own factory (keras.Variable / tf.Variable, outside
what the stock optimizer lists and checkpoints), and gives the hooks the step reads: where a
variable sits (`_tfclip_position`), its op handle and TF variable, whether weight decay applies,
what else splits a step into groups, `lazy_sparse`, and where a step's variables sit in
`tensor_norms` (`_norm_positions`)."""
import tensorflow as tf

from tfclip import clipping
from tfclip._engine import checks as _checks
from tfclip._engine import opcall as _opcall
from tfclip._engine import shard as _shard
from tfclip._engine import step as _step

# (attribute, variable name, initial value, dtype): made at construction.
STATE_VARIABLES = (("_global_norm", "global_norm", 0.0, "float32"),
                   ("_skipped_steps", "skipped_steps", 0, "int64"),
                   ("_clipped_steps", "clipped_steps", 0, "int64"),
                   ("_clip_scale_sum", "clip_scale_sum", 0.0, "float64"),
                   ("_clip_threshold", "clip_threshold", float("nan"), "float64"))


class Dropin:
    """The fused step, tfclip's own state (its properties, `_record_norms`) and `_tfclip_config`
    (get_config's part), for both libraries' drop-in mixins."""

    _tfclip_binding = None  # per class: its rule-table row, as data (tfclip._engine.binding)
    # Whether state_dtype="bfloat16" may store this class's slots as bfloat16 (tfclip.rules), and
    # state_dtype="int8" as uint8 codes with a float32 absmax variable beside each.
    low_precision_state = True
    int8_state = True

    @property
    def clip(self):
        """The adaptive clip (a tfclip.clipping object), or None."""
        return self._tfclip_clip

    def _clip_mode(self):
        # Re-read at each step: Keras lets a user set optimizer.clipnorm etc. after construction.
        return _opcall.clip_config(self.global_clipnorm, self.clipnorm, self.clipvalue)

    def _tfclip_state_weights(self, var_list):
        """shard_state: each variable's slots per byte, where a class's differ between variables
        (`shard.plan`); None: the same for all."""
        return None

    def _tfclip_build_slots(self, var_list):
        """The stock build: its slots made by add_variable_from_reference (each on its owner's
        device with shard_state; a class making slots otherwise places them itself)."""
        super().build(var_list)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # shard_state across worker processes: the slots another process keeps, in the stock
        # checkpoint layout (shard.SlotExchange).
        return _shard.trackable_children(getattr(self, "_tfclip_exchange", None),
                                         super()._trackable_children(save_type, **kwargs), save_type)

    def _tfclip_fused_step(self, grads, variables, lr, keras_sparse_squares=False):
        """The one fused step (tfclip._engine.step.run) over `variables`, one op per group of
        variables (the weight decay applying or not, `_tfclip_group`), at the learning rate `lr`
        (a tensor, or a function of a group's variables); returns whether it was applied.
        keras_sparse_squares: Keras 3's stock update of a repeated IndexedSlices row
        (`run`). Stock tf_keras instead clips each raw slice, then sums an IndexedSlices'
        duplicate rows (_deduplicate_sparse_grad) before the update: the op's duplicate sum,
        clipped slices summed, the rule fed the sum."""
        decay = self._tfclip_decay()
        int8 = getattr(self, "_tfclip_absmax", None)
        if int8:  # int8 state: dense gradients (an IndexedSlices' duplicate rows summed, as TF's
            # conversion; the core requantizes whole blocks of 256)
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices)
                     and tf.as_dtype(v.dtype).base_dtype == tf.float32 else g for g, v in zip(grads, variables)]
        # shard_state (tfclip._engine.shard): the norm of every gradient, then this replica's variables.
        share = _shard.begin(grads, self._tfclip_owners_of(variables))
        own = range(len(variables)) if share is None else share.own
        step_vars = [variables[i] for i in own]
        keys = [(bool(decay and self._use_weight_decay(v)), self._tfclip_group(v)) for v in step_vars]
        groups = _step.optimizer_groups(self, step_vars, keys, self._tfclip_handle, lr, self.weight_decay,
                                        absmax=self._tfclip_absmax_handles if int8 else None)
        mode, clip = self._clip_mode()
        result = _step.run([grads[i] for i in own], groups, mode, clip, clip_obj=self.clip,
                           use_norm=None if share is None else share.use_norm, nonfinite=self.nonfinite,
                           lazy=self._tfclip_lazy(), keras_sparse_squares=keras_sparse_squares,
                           loss_scale_of=self, rounding=self._tfclip_rounding())
        self._tfclip_record(result, variables, share)
        return result.applied

    def _tfclip_record(self, result, variables, share=None):
        """A step's result into tfclip's state (shard_state: the updated variables gathered
        first, every gradient's norm from the share's norm pass)."""
        tensor_norms, clipped_units = result.tensor_norms, result.clipped_units
        if share is not None:
            tensor_norms, clipped_units = _shard.finish(
                share, [self._tfclip_tf_var(v) for v in variables], result, result.grad_scale,
                agc=isinstance(self.clip, clipping.AGC))
        self._record_norms(result.global_norm, result.applied, tensor_norms, variables, result.clip_mode,
                           result.clip, None if result.adaptive is None else result.adaptive.threshold,
                           clipped_units)

    def _tfclip_owners_of(self, variables):
        """The owners of `variables` with shard_state (tfclip._engine.shard), else None."""
        if getattr(self, "_tfclip_owner", None) is None:
            return None
        return [self._tfclip_owner[self._tfclip_position(v)] for v in variables]

    def _tfclip_group(self, v):
        """What else, beside the weight decay, splits a step into several ops sharing one norm
        pass ("": nothing; legacy Nadam: the dtype, whose constants stock computes per dtype)."""
        return ""

    def _tfclip_tf_var(self, v):
        """The TF variable of a step variable (Keras 3's keras.Variable holds one)."""
        return v

    def _tfclip_handle(self, v):
        return self._tfclip_tf_var(v).handle

    def _tfclip_lazy(self):
        return self.lazy_sparse

    def _tfclip_step(self):
        return tf.cast(self.iterations + 1, tf.float64)

    def tfclip_absmax(self, slot):
        """The absmax variable of an int8-state slot variable (state_dtype="int8"), or None."""
        return (getattr(self, "_tfclip_absmax", None) or {}).get(id(slot))

    def tfclip_int8_slots(self):
        """int8 state's slots (state_dtype="int8"): `tfclip._engine.narrow_state.Int8Slot`s
        (tfclip.convert_checkpoint)."""
        return list(getattr(self, "_tfclip_int8_slots", ()))

    def _tfclip_config(self, config, lazy_default=False):
        """config with tfclip's own arguments where they differ from their defaults: a default
        config is the stock class's, so a saved model loads with the stock class where tfclip is
        absent (docs/keras.md)."""
        if self.nonfinite != "skip":
            config["nonfinite"] = self.nonfinite
        if self.lazy_sparse != lazy_default:
            config["lazy_sparse"] = self.lazy_sparse
        if self._tfclip_clip is not None:
            config["clip"] = clipping.serialize(self._tfclip_clip)
        if self.state_dtype is not None:
            config["state_dtype"] = self.state_dtype
        if getattr(self, "factored_state", False):  # (Adafactor's)
            config["factored_state"] = True
        if getattr(self, "stochastic_rounding", False):
            config["stochastic_rounding"] = True
            config["rounding_seed"] = self.rounding_seed
        if getattr(self, "shard_state", False):  # (tfclip/_engine/shard.py)
            config["shard_state"] = True
        if getattr(self, "reduce_dtype", None) is not None:  # (tfclip/_engine/reduce.py)
            config["reduce_dtype"] = self.reduce_dtype
        return config

    def _tfclip_rounding_init(self, stochastic_rounding, rounding_seed):
        """`stochastic_rounding` and `rounding_seed`, checked, as plain attributes (not tracked)."""
        sr, seed = _checks.check_rounding(stochastic_rounding, rounding_seed)
        object.__setattr__(self, "stochastic_rounding", sr)
        object.__setattr__(self, "rounding_seed", seed)

    def _tfclip_rounding(self):
        """The fused step's `rounding` (tfclip/_engine/step.py, run): (seed, iterations + 1) with
        stochastic rounding on, else None."""
        if not getattr(self, "stochastic_rounding", False):
            return None
        return self.rounding_seed, self._tfclip_step()

    @property
    def state_owners(self):
        """With shard_state under a strategy of several replicas: each trainable variable's
        owning replica (the one keeping its slots), in `tensor_norm_names`' order; else None."""
        owner = getattr(self, "_tfclip_owner", None)
        return None if owner is None else list(owner)

    @property
    def global_norm(self):
        """The pre-clip global norm of the gradients of the last step (a variable)."""
        return self._global_norm

    @property
    def skipped_steps(self):
        """How many steps were skipped for a non-finite global norm (a variable)."""
        return self._skipped_steps

    @property
    def tensor_norms(self):
        """Each trainable variable's pre-clip gradient norm at the last step (a float32 variable
        aligned with `tensor_norm_names`; 0 for a variable that got no gradient), from the fused
        step's norm pass: no extra pass over memory. Not saved in checkpoints. None until the
        optimizer is built (its first step, or `build(variables)`)."""
        return self._tensor_norms

    @property
    def clipped_units(self):
        """With `clip=tfclip.clipping.AGC(...)`: each trainable variable's count of units AGC
        scaled down at the last step (an int64 variable aligned with `tensor_norm_names`, not
        trainable, not saved; 0 for a variable that got no gradient), counted by the fused op
        from its own unit norms. None without AGC, or until the optimizer is built."""
        return getattr(self, "_clipped_units", None)

    @property
    def clipped_steps(self):
        """How many applied steps the clip scaled down (global_clipnorm: the global norm above
        it; clipnorm: some tensor's norm above it). Not counted for clipvalue, whose firing would
        take another pass to see."""
        return self._clipped_steps

    @property
    def clip_scale_sum(self):
        """The sum over steps of the clip's scale (1 for a step it left alone, else
        clip / norm; clipnorm: the smallest tensor's): its change over N steps / N is how hard
        the clip fired on average (tfclip.keras.GradientNormLogger logs it)."""
        return self._clip_scale_sum

    @property
    def clip_threshold(self):
        """With an adaptive clip (`clip=`): the norm above which the last step would have been
        clipped (tfclip.clipping.ClipStep.threshold); NaN without one (a variable)."""
        return self._clip_threshold

    @property
    def adaptive_threshold(self):
        """`clip_threshold` by another name, for Adafactor, whose `clip_threshold` is its own
        (stock) argument, the bound on rms(u)."""
        return self._clip_threshold

    def _norm_positions(self, tvars):
        """Where the step's variables sit in `tensor_norms`: (their indices, its length), or None
        where that is not known (then `tensor_norms` keeps its value)."""
        raise NotImplementedError

    def _record_norms(self, norm, applied, tensor_norms, tvars, mode, clip, threshold=None,
                      clipped_units=None):
        """The step's norms and clip counts into the optimizer's state variables: a few scalar
        ops, no pass over the gradients. `threshold`: an adaptive clip's (into `clip_threshold`).
        `clipped_units`: AGC's counts, aligned with `tensor_norms` (into `clipped_units`, where
        the optimizer keeps it)."""
        self._global_norm.assign(tf.cast(norm, tf.float32))
        self._skipped_steps.assign_add(1 - tf.cast(applied, tf.int64))
        where = self._norm_positions(tvars) if self._tensor_norms is not None else None
        if where is not None:
            idx, total = where
            tn = tf.cast(tensor_norms, tf.float32)
            if idx != list(range(total)):  # some variable got no gradient: its norm is 0
                tn = tf.scatter_nd(tf.constant(idx, tf.int32)[:, None], tn, [total])
            self._tensor_norms.assign(tn)
        units = getattr(self, "_clipped_units", None)
        if units is not None and clipped_units is not None:
            where = self._norm_positions(tvars)
            if where is not None:
                idx, total = where
                cu = tf.cast(clipped_units, tf.int64)
                if idx != list(range(total)):
                    cu = tf.scatter_nd(tf.constant(idx, tf.int32)[:, None], cu, [total])
                units.assign(cu)
        if threshold is not None:
            self._clip_threshold.assign(threshold)
        if mode not in ("global_norm", "norm"):
            return
        clip = tf.cast(clip, tf.float64)
        measure = tf.cast(norm if mode == "global_norm" else tf.reduce_max(tensor_norms), tf.float64)
        fired = tf.logical_and(tf.logical_and(applied, clip > 0), measure > clip)
        self._clipped_steps.assign_add(tf.cast(fired, tf.int64))
        self._clip_scale_sum.assign_add(tf.where(fired, clip / measure, tf.constant(1.0, tf.float64)))

