"""tfclip's own optimizer state, shared by the Keras 3 drop-ins (tfclip.keras) and the Keras 2
ones (tfclip.tf_keras): the variables' names and dtypes, their read-only properties, and the
recording of a fused step's norms and clip counts into them.

Each library makes the variables with its own factory (keras.Variable / tf.Variable, outside
what the stock optimizer lists and checkpoints) and says where a step's variables sit in
`tensor_norms` (`_norm_positions`)."""
import tensorflow as tf

from tfclip import _step, clipping

# (attribute, variable name, initial value, dtype): made at construction.
STATE_VARIABLES = (("_global_norm", "global_norm", 0.0, "float32"),
                   ("_skipped_steps", "skipped_steps", 0, "int64"),
                   ("_clipped_steps", "clipped_steps", 0, "int64"),
                   ("_clip_scale_sum", "clip_scale_sum", 0.0, "float64"),
                   ("_clip_threshold", "clip_threshold", float("nan"), "float64"))


class NormState:
    """The properties of tfclip's own state and `_record_norms`, for the drop-in mixins; and
    `_tfclip_config`, their get_config's part."""

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
        if getattr(self, "shard_state", False):  # (tfclip/_shard.py)
            config["shard_state"] = True
        return config

    def _tfclip_rounding_init(self, stochastic_rounding, rounding_seed):
        """`stochastic_rounding` and `rounding_seed`, checked, as plain attributes (not tracked)."""
        sr, seed = _step.check_rounding(stochastic_rounding, rounding_seed)
        object.__setattr__(self, "stochastic_rounding", sr)
        object.__setattr__(self, "rounding_seed", seed)

    def _tfclip_rounding(self):
        """The fused step's `rounding` (tfclip/_step.py, run): (seed, iterations + 1) with
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

