"""Adaptive clipping: thresholds that follow the gradient norms seen, kept on the device.

A fixed `global_clipnorm` needs a threshold tuned per model, batch size and phase of training.
These clip modes derive it from the global norms of past steps:

- `ZClip` (Kumar et al. 2025, arXiv 2504.02507): an exponential moving mean `mu` and variance
  `s2` of the global norm `g`, set after a warm-up from the norms seen. A step whose z-score
  `z = (g - mu) / (sqrt(s2) + eps)` passes `z_thresh` is clipped to
  `mu + z_thresh * sqrt(s2) / (z / z_thresh)` ("adaptive", the default) or to `mu` ("mean"),
  and that clipped norm, not the spike, feeds the statistics.
- `AutoClip` (Seetharaman et al. 2020, arXiv 2007.14469): the threshold is the `percentile`-th
  percentile (NumPy's linear interpolation) of the global norms of the last `history_size`
  steps, this step's included.
- `AGC` (Brock et al. 2021, the NFNets paper): unit-wise. Each unit's gradient (one index of the
  last axis of a kernel, its norm over every other axis; a tensor of rank <= 1 is one unit) is
  scaled to `clip_factor * max(||W_unit||, eps)` when its norm passes that bound. Stateless; the
  core's norm pass sums each unit's g^2 and w^2 (one extra read of each variable), the
  clip-and-apply pass applies each unit's scale (csrc/core/agc.h).

ZClip and AutoClip clip to their threshold exactly as `global_clipnorm` does (TF's `clip_by_global_norm`:
every gradient times `threshold / max(g, threshold)`), inside the same two passes over memory
as a fixed clip: the norm pass gives `g`, a handful of scalar ops on the device turn it and the
state into the threshold, and the clip-and-apply pass uses it. Nothing waits on the host.

The state (ZClip: the step count, `mu`, `s2` and the warm-up norms; AutoClip: the step count and
the norm history) is float64/int64 variables on the variables' device, made on the first step by
whoever runs it: a Keras optimizer makes them optimizer variables (saved in checkpoints and
`.keras` files), `tfclip.fused_clip_apply` keeps them on the clip object (a `tf.Module`:
`tf.train.Checkpoint(clip=...)` saves them). A step whose global norm is not finite leaves the
state as it was (whatever the `nonfinite` policy does with the step), so one bad batch does not
poison the statistics.

Use one clip object for one training run, like an optimizer::

    clip = tfclip.clipping.ZClip(z_thresh=2.5)
    tfclip.fused_clip_apply(zip(grads, variables), rule, clip=clip)
    optimizer = tfclip.keras.Adam(1e-3, clip="zclip")       # or clip=tfclip.clipping.ZClip(...)
"""
import collections
import math
import numbers
import weakref

import tensorflow as tf

__all__ = ["AdaptiveClip", "ZClip", "AutoClip", "AGC", "ClipStep", "get", "serialize"]

_TINY = 2.2250738585072014e-308  # the least normal double: a clip target of 0 still clips

ClipStep = collections.namedtuple("ClipStep", ["clip", "threshold", "clipped", "updates"])
ClipStep.__doc__ = """One step of an adaptive clip, from the global norm and the state.

clip: float64 scalar for the apply op's `global_norm` clip input: the norm the step is clipped
    to, or 0 (no clip) when the step is not clipped.
threshold: float64 scalar, the norm above which this step would have been clipped (ZClip:
    `mu + z_thresh * (sqrt(s2) + eps)`, capped by `max_norm`, and `max_norm` or inf during the
    warm-up; AutoClip: the percentile), for logs.
clipped: bool scalar, whether the step is clipped.
updates: [(state variable, new value)], to assign once the step has been applied.
"""


def _positive(name, x, integer=False, allow_zero=False):
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    ok = ok and (x >= 0 if allow_zero else x > 0) and (not integer or float(x).is_integer())
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {'>= 0' if allow_zero else '> 0'}, got {x!r}")
    return int(x) if integer else float(x)


class AdaptiveClip(tf.Module):
    """Base class: an adaptive clip mode's settings and its state variables."""

    mode = None  # the name `clip=` takes

    def __init__(self, name=None):
        super().__init__(name=name or self.mode)
        self._state = None
        self._owner = None

    # Each subclass: [(name, shape, dtype)] of its state (all start at zero), and the step.
    def state_spec(self):
        raise NotImplementedError

    def _step(self, norm, state):
        raise NotImplementedError

    @property
    def last_step(self):
        """The ClipStep of the last step run (eagerly: its values; in a graph: its tensors)."""
        return self.__dict__.get("_last_step")

    def _remember(self, step):
        self.__dict__["_last_step"] = step  # (not through tf.Module's tracking)

    @property
    def state(self):
        """The state variables by name (None before the first step)."""
        return self._state

    def build(self, make_variable=None):
        """Makes the state variables once: `make_variable(name, shape, dtype)` gives a variable
        initialised to zeros (a Keras optimizer's `add_variable`); by default a `tf.Variable`
        made under `tf.init_scope()` (a first step inside a `tf.function` works)."""
        if self._state is not None:
            return self._state
        if make_variable is None:
            def make_variable(name, shape, dtype):
                with tf.init_scope():
                    return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=f"{self.mode}_{name}",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._state = {n: make_variable(n, shape, dtype) for n, shape, dtype in self.state_spec()}
        return self._state

    def bind(self, owner):
        """Ties the clip to the one rule or optimizer that steps it: a second owner would advance
        the same statistics twice a step."""
        bound = self._owner() if self._owner is not None else None
        if bound is None:
            self._owner = weakref.ref(owner)
        elif bound is not owner:
            raise ValueError(f"this {type(self).__name__} already serves {type(bound).__name__}; its state "
                             "(the norm statistics) belongs to one training run: give each optimizer or "
                             "rule its own clip object")

    def step(self, norm):
        """The `ClipStep` of a step whose global norm is `norm` (a scalar tensor): reads the state,
        changes nothing (assign `updates` once the step is applied; `assign_updates` does)."""
        if self._state is None:
            raise ValueError(f"{type(self).__name__} has no state yet: call build() first")
        g = tf.cast(norm, tf.float64)
        state = {n: tf.convert_to_tensor(v) for n, v in self._state.items()}
        clip, threshold, clipped, new = self._step(g, state)
        # A non-finite norm does not enter the statistics.
        finite = tf.math.is_finite(g)
        updates = [(self._state[n], tf.where(finite, new[n], state[n])) for n in new]
        return ClipStep(clip, threshold, clipped, updates)

    def get_config(self):
        raise NotImplementedError


def assign_updates(step, after=None):
    """Assigns a ClipStep's state updates once `after` (tensors, e.g. the apply op's outputs) has
    run; returns the group op (graph mode) or None."""
    deps = [] if after is None else [t for t in after if t is not None]
    with tf.control_dependencies(deps):
        # (a tf.Variable's assign op itself; a keras.Variable assigns its tf.Variable)
        ops = [v.assign(x, read_value=False) if isinstance(v, tf.Variable) else v.assign(x)
               for v, x in step.updates]
    if tf.executing_eagerly():
        return None
    return tf.group(*[o for o in ops if isinstance(o, (tf.Tensor, tf.Operation))])


class ZClip(AdaptiveClip):
    """Z-score clipping of the global norm (ZClip, arXiv 2504.02507); see the module docstring.

    Args:
      alpha: the EMA factor of the norm's mean and variance (0 < alpha < 1).
      z_thresh: the z-score above which a step is clipped.
      warmup_steps: steps that only gather norms (not clipped, but by `max_norm`); the mean and
        (population) variance of their norms start the EMA.
      clip_to: "adaptive" (`mu + z_thresh * sqrt(s2) / (z / z_thresh)`, the paper's default)
        or "mean" (`mu`).
      max_norm: None, or a fixed cap on the norm as well (during the warm-up too).
      eps: added to `sqrt(s2)` in the z-score.
      skip_update_on_spike: a clipped step leaves the statistics as they are (the reference
        code's option; default False: the clipped norm enters them).
    """

    mode = "zclip"

    def __init__(self, alpha=0.97, z_thresh=2.5, warmup_steps=25, clip_to="adaptive", max_norm=None,
                 eps=1e-6, skip_update_on_spike=False, name=None):
        super().__init__(name)
        self.alpha = _positive("alpha", alpha)
        if not self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        self.z_thresh = _positive("z_thresh", z_thresh)
        self.warmup_steps = _positive("warmup_steps", warmup_steps, integer=True)
        if clip_to not in ("adaptive", "mean"):
            raise ValueError(f"clip_to must be 'adaptive' or 'mean', got {clip_to!r}")
        self.clip_to = clip_to
        self.max_norm = None if max_norm is None else _positive("max_norm", max_norm)
        self.eps = _positive("eps", eps, allow_zero=True)
        self.skip_update_on_spike = bool(skip_update_on_spike)

    def get_config(self):
        return dict(alpha=self.alpha, z_thresh=self.z_thresh, warmup_steps=self.warmup_steps,
                    clip_to=self.clip_to, max_norm=self.max_norm, eps=self.eps,
                    skip_update_on_spike=self.skip_update_on_spike)

    def state_spec(self):
        return [("count", [], tf.int64), ("mean", [], tf.float64), ("var", [], tf.float64),
                ("warmup_norms", [self.warmup_steps], tf.float64)]

    def _step(self, g, s):
        w = self.warmup_steps
        count, mu, s2, buf = s["count"], s["mean"], s["var"], s["warmup_norms"]
        warming = count < w
        slot = tf.minimum(count, w - 1)
        buf_new = tf.tensor_scatter_nd_update(buf, tf.reshape(slot, [1, 1]), tf.reshape(g, [1]))
        init_now = tf.equal(count, w - 1)
        mean_w = tf.reduce_sum(buf_new) / w
        var_w = tf.reduce_sum(tf.square(buf_new - mean_w)) / w

        std = tf.sqrt(s2)
        z = (g - mu) / (std + self.eps)
        spike = tf.logical_and(tf.logical_not(warming), z > self.z_thresh)
        if self.clip_to == "adaptive":
            target = mu + (self.z_thresh * std) / (z / self.z_thresh)
        else:
            target = mu
        effective = tf.where(spike, target, g)
        threshold = tf.where(warming, tf.constant(math.inf, tf.float64), mu + self.z_thresh * (std + self.eps))
        if self.max_norm is not None:
            effective = tf.minimum(effective, self.max_norm)
            threshold = tf.minimum(threshold, self.max_norm)
        clipped = effective < g
        clip = tf.where(clipped, tf.maximum(effective, _TINY), tf.constant(0.0, tf.float64))

        x = tf.where(spike, target, g)
        a = self.alpha
        mu_ema = a * mu + (1 - a) * x
        s2_ema = a * s2 + (1 - a) * tf.square(x - mu_ema)
        update = tf.logical_not(warming)
        if self.skip_update_on_spike:
            update = tf.logical_and(update, tf.logical_not(spike))
        new = {
            "count": count + 1,
            "mean": tf.where(init_now, mean_w, tf.where(update, mu_ema, mu)),
            "var": tf.where(init_now, var_w, tf.where(update, s2_ema, s2)),
            "warmup_norms": tf.where(warming, buf_new, buf),
        }
        return clip, threshold, clipped, new


class AutoClip(AdaptiveClip):
    """Percentile clipping of the global norm (AutoClip, arXiv 2007.14469); see the module
    docstring.

    Args:
      percentile: in [0, 100]; the paper's experiments favour 10.
      history_size: how many past norms are kept (a ring buffer; the paper keeps every one, a
        bound keeps the state and the per-step sort small).
    """

    mode = "autoclip"

    def __init__(self, percentile=10.0, history_size=1000, name=None):
        super().__init__(name)
        self.percentile = _positive("percentile", percentile, allow_zero=True)
        if self.percentile > 100:
            raise ValueError(f"percentile must be in [0, 100], got {percentile!r}")
        self.history_size = _positive("history_size", history_size, integer=True)

    def get_config(self):
        return dict(percentile=self.percentile, history_size=self.history_size)

    def state_spec(self):
        return [("count", [], tf.int64), ("history", [self.history_size], tf.float64)]

    def _step(self, g, s):
        h = self.history_size
        count, hist = s["count"], s["history"]
        slot = tf.math.floormod(count, h)
        hist_new = tf.tensor_scatter_nd_update(hist, tf.reshape(slot, [1, 1]), tf.reshape(g, [1]))
        n = tf.minimum(count + 1, h)
        seen = tf.range(h, dtype=tf.int64) < n
        ordered = tf.sort(tf.where(seen, hist_new, tf.constant(math.inf, tf.float64)))
        # NumPy's "linear" percentile: position p/100 * (n - 1) between two order statistics.
        pos = self.percentile / 100.0 * tf.cast(n - 1, tf.float64)
        lo = tf.cast(tf.floor(pos), tf.int64)
        hi = tf.minimum(lo + 1, n - 1)
        t = pos - tf.floor(pos)
        a, b = tf.gather(ordered, lo), tf.gather(ordered, hi)
        d = b - a
        threshold = tf.where(t >= 0.5, b - d * (1 - t), a + d * t)
        clipped = threshold < g
        clip = tf.where(clipped, tf.maximum(threshold, _TINY), tf.constant(0.0, tf.float64))
        return clip, threshold, clipped, {"count": count + 1, "history": hist_new}


class AGC:
    """Adaptive gradient clipping, unit-wise (Brock et al. 2021, "High-Performance Large-Scale
    Image Recognition Without Normalization", the NFNets paper).

    For each unit of each gradient — one index of the last axis (a Dense kernel's output unit, a
    conv kernel's output channel), its norm taken over every other axis; a bias or any tensor of
    rank <= 1 is one unit — with `W_u` the same unit of the variable before the step:
    `bound = clip_factor * max(||W_u||, eps)`; a unit whose `||G_u||` passes it is scaled by
    `bound / ||G_u||`. (optax's `adaptive_grad_clip` reduces only axis 0 of a rank-3 kernel; the
    paper, and tfclip, every axis but the output one.) An IndexedSlices gradient's units are the
    densified gradient's. The paper leaves the final linear layer unclipped: pass that variable
    in a step of its own, or clip it with the other modes, where that matters.

    Fused: the norm pass also reads each variable once (its unit norms), the clip-and-apply pass
    scales each unit; no pass of its own, no state.

    Args:
      clip_factor: lambda (the paper uses 0.01 to 0.16, smaller for larger batches).
      eps: the floor of a unit's weight norm (1e-3, as the paper; the op holds it as float32).
    """

    mode = "agc"
    state = None  # (stateless)

    def __init__(self, clip_factor=0.01, eps=1e-3):
        self.clip_factor = _positive("clip_factor", clip_factor)
        self.eps = _positive("eps", eps, allow_zero=True)

    def get_config(self):
        return dict(clip_factor=self.clip_factor, eps=self.eps)

    def op_args(self):
        """The apply op's clip arguments: (clip_mode, clip (lambda), the other op kwargs)."""
        return "agc", self.clip_factor, {"agc_eps": self.eps}

    def __repr__(self):
        return f"AGC(clip_factor={self.clip_factor}, eps={self.eps})"

    def unfused(self, grads, variables, counts=False):
        """The same clip in stock TF ops (unit norms by tf.norm, several passes): for a step that
        cannot run the fused op (the Keras XLA fallback) and for the benchmark's comparison.
        Each gradient (tensors or IndexedSlices, densified) clipped per unit, in its dtype.
        counts=True: also each gradient's count of clipped units (an int64 vector, as the op's
        `clipped_units`: a unit whose scale is not 1, NaN included), as `(clipped, counts)`."""
        out, clipped = [], []
        for g, v in zip(grads, variables):
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            w = tf.convert_to_tensor(v)
            axes = None if g.shape.rank <= 1 else list(range(g.shape.rank - 1))
            gn = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(g, tf.float64)), axis=axes, keepdims=axes is not None))
            wn = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(w, tf.float64)), axis=axes, keepdims=axes is not None))
            bound = self.clip_factor * tf.maximum(wn, tf.cast(tf.constant(self.eps, tf.float32), tf.float64))
            scale = tf.where(gn > bound, bound / gn, tf.ones_like(gn))
            out.append(g * tf.cast(scale, g.dtype))
            if counts:  # not (gn <= bound): a NaN unit counts, as the op's (its scale is NaN)
                clipped.append(tf.reduce_sum(tf.cast(tf.logical_not(gn <= bound), tf.int64)))
        if counts:
            return out, (tf.stack(clipped) if clipped else tf.zeros([0], tf.int64))
        return out


_MODES = {c.mode: c for c in (ZClip, AutoClip, AGC)}


def num_units(shape):
    """AGC's unit count of a variable of `shape` (its last axis; 1 for rank <= 1)."""
    shape = tf.TensorShape(shape)
    return 1 if shape.rank <= 1 else int(shape[-1])


def serialize(clip):
    """A clip object as a config dict (`get` makes it again): its mode and settings."""
    return dict(mode=clip.mode, **clip.get_config())


def get(clip):
    """A clip object from `clip=`: None, a mode's name ("zclip", "autoclip") for its defaults, a
    `serialize` dict, or an `AdaptiveClip` (returned as is)."""
    if clip is None or isinstance(clip, (AdaptiveClip, AGC)):
        return clip
    if isinstance(clip, str) and clip in _MODES:
        return _MODES[clip]()
    if isinstance(clip, dict) and clip.get("mode") in _MODES:
        config = dict(clip)
        return _MODES[config.pop("mode")](**config)
    raise ValueError(f"clip must be one of {sorted(_MODES)} or a tfclip.clipping object "
                     f"(ZClip(...), AutoClip(...), AGC(...)), got {clip!r}")


def check_exclusive(clip, **fixed):
    """An adaptive clip replaces the fixed clip arguments: setting both is an error."""
    given = sorted(k for k, v in fixed.items() if v is not None and not (isinstance(v, numbers.Real) and v == 0))
    if clip is not None and given:
        raise ValueError(f"clip={getattr(clip, 'mode', clip)!r} is a clip mode of its own; it cannot be "
                         f"combined with {', '.join(given)} (ZClip's max_norm caps the norm as well)")
