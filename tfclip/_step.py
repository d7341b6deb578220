"""The fused step, said once: every front door (`tfclip.fused_clip_apply` through `tfclip.rules`,
the Keras 3, tf_keras and legacy optimizers, `tfclip.compat.v1`) calls `run`, and keeps only what
is its own: the stock class's variables and names, its arguments, its checkpoint layout, its
distribution hooks, its step counter.

A step is
1. the clip: a fixed mode (Keras's `global_clipnorm` / `clipnorm` / `clipvalue`), AGC (unit-wise,
   inside the apply op's own two passes), or an adaptive clip (`tfclip.clipping.ZClip`,
   `AutoClip`) whose threshold follows the global norm;
2. the norm pass (`TfclipGlobalNorm`), only where the apply op cannot take the norm itself: an
   adaptive clip needs the norm for its threshold, and a step split into several ops (variable
   groups: Keras's weight-decay exclusions, legacy Nadam's per-dtype constants) shares one norm;
3. one apply op per group (`tfclip._opcall.apply`), each with that norm, the clip and the
   non-finite policy;
4. one `StepResult`: the norm, whether the step was applied, each gradient's norm and AGC's
   clipped units in the gradients' order, the clip as the ops ran it, and the adaptive clip's
   state advanced (its assign, after the step; not for a non-finite norm).

A rule's binding to a stock class is data (`Binding`): the rule-table row, and where the stock
class keeps each slot and hyper-parameter. Adding a rule: docs/adding-a-rule.md.

Imports flow one way: the front doors import this module; it imports `_opcall`, `_loader` and
`clipping`, never a front door.
"""
import collections
import contextlib
import math
import numbers
import threading

import tensorflow as tf

from tfclip import _loader, _opcall
from tfclip import clipping as _clipping
from tfclip._opcall import ClipApplyResult

# ---------------------------------------------------------------------------- the step


class Group(collections.namedtuple("Group", ["kind", "var", "slots", "hparams", "flags", "positions",
                                             "refs", "iterations", "absmax"], defaults=(None, None, (), ()))):
    """One apply op of a step: the rule-table row `kind`, the variables' handles `var`, the slot
    handle lists (by the table's slot names, or in its order), the hyper-parameters and flags by
    the table's names (`tfclip._opcall.apply`). `positions`: the gradients it takes (their
    indices; None: all, the one group of a step). `refs`: TF1 ref variables (see
    `_opcall.apply`). `iterations`: `[handle]` where the op owns the step counter (`tfclip.rules`
    on host variables), else empty. `absmax`: int8 state's absmax handles, slot-major (the op's
    `absmax` input; csrc/core/apply_op.h), else empty."""


StepResult = collections.namedtuple(
    "StepResult", ["global_norm", "applied", "tensor_norms", "clipped_units", "clip_mode", "clip",
                   "adaptive", "clip_update"])
StepResult.__doc__ = """What `run` returns: `ClipApplyResult`'s four fields (`outputs`), the clip the
ops ran (`clip_mode`, `clip`: an adaptive clip runs as "global_norm" with its threshold), the
adaptive clip's `ClipStep` (None without one) and the op assigning its state after the step
(graph mode; None eagerly or without one)."""
StepResult.outputs = property(lambda self: ClipApplyResult(*self[:4]))


def run(grads, groups, clip_mode, clip, *, clip_obj=None, use_norm=None, nonfinite="skip", lazy=False,
        keras_sparse_squares=False, all_dense=False, grad_scale=None, rounding=None):
    """One fused step over `grads` (tensors or IndexedSlices, aligned with the groups'
    positions): see the module docstring.

    clip_mode, clip: the fixed clip (`_opcall.clip_config`). clip_obj: an AGC or adaptive clip
    (`tfclip.clipping`; its state built by the caller), which replaces them. use_norm: a global
    norm given by the caller (no norm pass). keras_sparse_squares: Keras 3's stock update of an
    IndexedSlices gradient: a repeated row feeds the sum of its slices' squares, unless a
    global-norm clip scaled (so densified) it. all_dense: the caller checked that every gradient
    is a dense eager tensor (the eager fast path). grad_scale: a factor on every gradient
    folded into the passes (a loss scale's 1 / scale; ClipConfig::grad_scale): the step is the
    one on grads * grad_scale, and the norms it reports are theirs (use_norm, given, is of the
    gradients as given). rounding: None, or (seed, step) where bfloat16 variables round
    stochastically (csrc/core/rounding.h): the seed (`check_rounding`) and the step number (a
    tensor or number, the optimizer's iterations + 1); group k's op takes seed + k * 2^32, so
    no two variables of a step draw the same bits.
    """
    agc, adaptive = {}, None
    if isinstance(clip_obj, _clipping.AGC):  # unit-wise, inside the op's own passes
        clip_mode, clip, agc = clip_obj.op_args()
    if grad_scale is not None:
        if agc:
            raise ValueError("grad_scale (a loss-scale unscale) does not combine with AGC (its unit "
                             "scales count the units they clip); unscale the gradients first")
        grad_scale = _opcall.scalar(grad_scale, "grad_scale")
    given = use_norm is not None
    pass_norms = None
    # A factored rule (Adafactor) takes dense gradients (its row and column means cover every
    # element): IndexedSlices are densified for it, as keras's Adafactor densifies them, after a
    # norm pass over their values (TF's global norm of IndexedSlices, duplicates apart).
    densify = not all_dense and any(_opcall.RULES[g.kind]["factored"] for g in groups) and any(
        isinstance(x, tf.IndexedSlices) for x in grads)
    if given:
        use_norm = _opcall.scalar(use_norm, "use_norm")
    elif len(groups) > 1 or (clip_obj is not None and not agc) or densify:
        # Every group's op takes the norms of one norm pass; so does an adaptive clip, whose
        # threshold comes from it (scalar ops on the device).
        use_norm, pass_norms = norm_pass(grads, all_dense)
        given = True
    if clip_obj is not None and not agc:  # (its threshold follows the scaled gradients' norms)
        adaptive = clip_obj.step(use_norm if grad_scale is None else use_norm * grad_scale)
        clip_mode, clip = "global_norm", adaptive.clip
    op_mode = clip_mode
    if densify and clip_mode == "norm":
        # A per-tensor clipnorm takes an IndexedSlices' norm of its slices (TF's clip_by_norm, as
        # the stock classes clip), which the dense passes cannot see once its duplicate rows are
        # summed: each gradient is clipped here, as TF clips it, and the op clips none.
        grads = [tf.clip_by_norm(g, tf.cast(clip, g.dtype)) for g in grads]
        op_mode = "none"
    clip = _opcall.scalar(clip, "clip")
    norm_input = use_norm if given else _opcall.scalar(0.0, "use_norm")
    squares = keras_sparse_squares and clip_mode != "global_norm"
    if rounding is not None:
        seed, rstep = rounding
        rstep = _opcall.scalar(rstep, "rounding_step")
    outs = []
    for k, g in enumerate(groups):
        part = grads if len(groups) == 1 else [grads[i] for i in g.positions]
        if densify and _opcall.RULES[g.kind]["factored"]:
            part = [tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x for x in part]
        values, sparse_kw = (part, _opcall.NO_SPARSE) if all_dense else _opcall.op_grads(part)
        outs.append(_opcall.apply(g.kind, g.var, g.slots, values, g.hparams, g.flags, refs=g.refs,
                                  iterations=list(g.iterations), absmax=g.absmax, clip=clip, use_norm=norm_input,
                                  clip_mode=op_mode, nonfinite=nonfinite, use_given_norm=given, lazy=lazy,
                                  **({"sum_of_squares": True} if squares else {}), **agc, **sparse_kw,
                                  **({"grad_scale": [grad_scale]} if grad_scale is not None else {}),
                                  **({"rounding": [_opcall.scalar(float(seed + k * 2 ** 32), "rounding_seed"), rstep]}
                                     if rounding is not None else {})))
    if groups:
        norm, applied, tensor_norms, clipped_units = outs[0]
    else:  # the caller makes every update (Muon's matrices): the non-finite policy on the norm
        norm = norm_input if grad_scale is None else norm_input * grad_scale
        tensor_norms = clipped_units = None
        applied = nonfinite_applied(norm, nonfinite)
    if len(groups) > 1:
        order = [i for g in groups for i in g.positions]
        clipped_units = in_order([o[3] for o in outs], order)
        if pass_norms is None:
            tensor_norms = in_order([o[2] for o in outs], order)
    if pass_norms is not None:
        tensor_norms = tf.cast(pass_norms if grad_scale is None else pass_norms * grad_scale, tf.float32)
    update = None
    if adaptive is not None:
        clip_obj._remember(adaptive)
        update = _clipping.assign_updates(adaptive, after=[applied])
    return StepResult(norm, applied, tensor_norms, clipped_units, clip_mode, clip, adaptive, update)


def norm_pass(grads, all_dense=False):
    """(the global norm, each gradient's norm), float64, of `grads` (tensors or IndexedSlices,
    whose norm is their values'; all_dense: the caller checked there is none): the one norm pass
    (`TfclipGlobalNorm`)."""
    values = grads if all_dense else _opcall.op_grads(grads)[0]
    return _loader.ops().tfclip_global_norm(t=values, Tnorm=tf.float64)


def nonfinite_applied(norm, nonfinite):
    """Whether a step with this global norm is applied under the non-finite policy, where no
    apply op decides it: "skip" applies a finite norm's step, "propagate" every step, "raise"
    fails a non-finite one with the op's message."""
    finite = tf.math.is_finite(norm)
    if nonfinite == "skip":
        return finite
    if nonfinite == "raise":
        check = tf.debugging.Assert(finite, ["the global norm of the gradients is", norm,
                                             "(non-finite) and nonfinite='raise'; no variable was updated"])
        with tf.control_dependencies([check] if check is not None else []):
            return tf.identity(finite)
    return tf.constant(True)


# The loss-scale unscales being folded into a step, per thread (as a step is built: eagerly or
# traced), by the optimizer's id: [grad_scale, the step's `applied`].
_LOSS_SCALE = threading.local()


def with_loss_scale(opt, grad_scale, apply):
    """Runs `apply()`, the optimizer's own apply call, with a loss scale's unscale `grad_scale`
    folded into its fused step (the drop-ins' step reads it with `loss_scale(opt)` and gives
    back its `applied` with `loss_scale_applied`); returns whether the step was applied (True
    where no fused step ran: no gradients, as stock then counts the step). Eagerly under the
    optimizer's lock: one thread's scale never meets another's step. tfclip.keras's and
    tfclip.tf_keras's LossScaleOptimizer call it."""
    folding = _LOSS_SCALE.__dict__.setdefault("by_id", {})
    entry = folding[id(opt)] = [grad_scale, None]
    lock = _opcall.state_lock(opt) if tf.executing_eagerly() else contextlib.nullcontext()
    try:
        with lock:
            apply()
    finally:
        folding.pop(id(opt), None)
    return tf.constant(True) if entry[1] is None else entry[1]


def graph_op(op):
    """An assign's op in a graph, None eagerly (tf.cond branches must return alike)."""
    return None if tf.executing_eagerly() else op.op if hasattr(op, "op") else op


def update_dynamic_scale(scale, good_steps, growth_steps, multiplier, applied):
    """A dynamic loss scale's update by a folded step's outcome, as tf_keras's
    `_DynamicLossScaleState.update` and TF1's `DynamicLossScale.update` make it: after an applied
    step `good_steps` counts, and once it reaches `growth_steps` the scale grows by `multiplier`
    (if that stays finite) and the count restarts; after a skipped one the scale backs off to at
    least 1 and the count restarts. Returns the update (an op in a graph, None eagerly)."""
    def finite():
        def grow():
            new = scale * multiplier
            grown = tf.cond(tf.math.is_finite(new), lambda: graph_op(scale.assign(new)),
                            lambda: graph_op(tf.no_op()))
            return tf.group(grown, good_steps.assign(0))

        return tf.cond(good_steps + 1 >= growth_steps, grow, lambda: graph_op(good_steps.assign_add(1)))

    def back_off():
        return tf.group(good_steps.assign(0), scale.assign(tf.maximum(scale / multiplier, 1)))

    return graph_op(tf.cond(applied, finite, back_off))


def power_of_two(x):
    """Whether the number x is a power of two (a loss scale whose unscale folds exactly)."""
    m, _ = math.frexp(float(x))
    return m == 0.5


def loss_scale(opt):
    """The unscale `with_loss_scale` is folding into `opt`'s step in this thread, or None."""
    entry = getattr(_LOSS_SCALE, "by_id", {}).get(id(opt))
    return None if entry is None else entry[0]


def loss_scale_applied(opt, applied):
    """The folded step's `applied`, for `with_loss_scale`."""
    getattr(_LOSS_SCALE, "by_id", {})[id(opt)][1] = applied


def check_rounding(stochastic_rounding, rounding_seed):
    """The front doors' `stochastic_rounding` and `rounding_seed`, checked: (bool, int), or a
    TypeError / ValueError naming what is wrong."""
    if not isinstance(stochastic_rounding, bool):
        raise TypeError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, numbers.Integral):
        raise TypeError(f"rounding_seed must be an int, got {rounding_seed!r}")
    if not 0 <= rounding_seed < 2 ** 32:
        raise ValueError(f"rounding_seed must be in [0, 2**32), got {rounding_seed}")
    return stochastic_rounding, int(rounding_seed)


def partition(keys):
    """The groups of a step: [(key, [indices])] for the variables' keys, sorted by key (one op
    each, in that order)."""
    groups = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return sorted(groups.items())


def optimizer_groups(opt, variables, keys, handle, lr, weight_decay, absmax=None, binding=None):
    """A drop-in optimizer's step groups (Keras 3's, tf_keras's, Muon's AdamW part and its
    matrices' update): `variables` partitioned by `keys` (`partition`; a key, or a key's first
    item, says whether weight decay applies), each group's op inputs from `binding` (default the
    optimizer's, `opt._tfclip_binding`), with `lr` (a tensor, or a function of the group's
    variables), `weight_decay` where it applies, each variable's op handle `handle(v)`, and int8
    state's absmax handles `absmax(group)`."""
    binding = binding or opt._tfclip_binding
    out = []
    for key, idx in partition(keys):
        group = [variables[i] for i in idx]
        kind, slots, hparams, flags = binding.inputs(opt, group)
        with_decay = key[0] if isinstance(key, tuple) else key
        hparams.update(lr=lr(group) if callable(lr) else lr, weight_decay=weight_decay if with_decay else 0.0)
        out.append(Group(kind, [handle(v) for v in group], slots, hparams, flags, idx,
                         absmax=absmax(group) if absmax is not None else ()))
    return out


def in_order(parts, order):
    """The groups' per-variable vectors `parts` (of the variables `order`, group by group) in
    the variables' order."""
    v = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    if order == list(range(len(order))):
        return v
    inverse = [0] * len(order)
    for k, i in enumerate(order):
        inverse[i] = k
    return tf.gather(v, inverse)


# ---------------------------------------------------------------------------- bindings

STEP = "<iterations + 1>"  # a Binding's hyper-parameter source: the front door's `_tfclip_step()`


class Binding(collections.namedtuple("Binding", ["kinds", "slots", "hparams", "flags", "pick"],
                                     defaults=((), (), (), None))):
    """A stock optimizer class bound to rule-table rows, as data: what `inputs` reads.

    kinds: the rule-table rows it may run (a name, or a tuple of names with `pick`, a function of
        the optimizer giving the one a step runs: SGD's "sgd" or "keras_momentum").
    slots: (table slot, stock slot[, when]): the stock slot is what the front door's
        `_tfclip_slot(stock_slot, variables)` looks up (Keras 3: the attribute listing the slot
        variables; legacy: the slot name); `when`, an attribute name or a function of the
        optimizer, says whether the slot exists (Adam's vhat: "amsgrad").
    hparams: (table name, source[, when]): the source is an attribute name, read by the front
        door's `_tfclip_hparam(name, variables)`, `STEP` (iterations + 1), or a function
        (optimizer, variables) -> value. lr and weight_decay come from the front door.
    flags: (flag, source[, when]): an attribute name or a function of the optimizer.
    """

    def kind(self, opt):
        return self.pick(opt) if self.pick is not None else self.kinds

    def inputs(self, opt, tvars):
        """(kind, slot handle lists by table name, hyper-parameters, flags) for `tvars`."""
        slots = {name: opt._tfclip_slot(stock, tvars) for name, stock in self.slot_names(opt)}
        hparams, flags = self.values(opt, tvars)
        return self.kind(opt), slots, hparams, flags

    def slot_names(self, opt):
        """[(table slot, stock slot)] of the slots `opt` has, in the table's order."""
        return [(row[0], row[1]) for row in self.slots if _holds(opt, row)]

    def values(self, opt, tvars, step=None):
        """(hyper-parameters, flags) by the table's names. step: the value `STEP` takes where the
        front door gives it (an op owning the count takes the 1 it adds), else `_tfclip_step()`."""
        hparams = {}
        for row in self.hparams:
            if _holds(opt, row):
                src = row[1]
                hparams[row[0]] = ((opt._tfclip_step() if step is None else step) if src is STEP else src(opt, tvars) if callable(src)
                                   else opt._tfclip_hparam(src, tvars))
        flags = {row[0]: bool(row[1](opt) if callable(row[1]) else getattr(opt, row[1]))
                 for row in self.flags if _holds(opt, row)}
        return hparams, flags

    def all_kinds(self):
        return (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)


# Adafactor's binding, the same for keras 3 and tf_keras (their attributes share names).
ADAFACTOR = Binding("adafactor", slots=(("r", "_r"), ("c", "_c"), ("v", "_v")),
                    hparams=(("beta_2_decay", "beta_2_decay"), ("epsilon_1", "epsilon_1"),
                             ("epsilon_2", "epsilon_2"), ("clip_threshold", "clip_threshold"), ("step", STEP)))


def _holds(opt, row):
    if len(row) < 3 or row[2] is None:
        return True
    when = row[2]
    return bool(when(opt) if callable(when) else getattr(opt, when))


# ---------------------------------------------------------------------------- shared checks


def check_number(name, v):
    """A hyper-parameter given as a Python number, checked at construction against the range the
    core's table gives it (csrc/core/hparams.h, through tfclip._core.hparam_table())."""
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    info = _opcall.HPARAMS.get("lr" if name == "learning_rate" else name) or next(
        (i for i in _opcall.HPARAMS.values() if i["display"] == name), None)
    if info is None:
        return
    lo, hi = info["lo"], info["hi"]
    ok = (v > lo if info["lo_open"] else v >= lo) and (v < hi if info["hi_open"] else v <= hi)
    if not ok:
        if math.isinf(hi):
            raise ValueError(f"{name} must be {'>' if info['lo_open'] else '>='} {lo:g}, got {v}")
        raise ValueError(f"{name} must be in {'(' if info['lo_open'] else '['}{lo:g}, {hi:g}"
                         f"{')' if info['hi_open'] else ']'}, got {v}")


@contextlib.contextmanager
def state_scope():
    """Where a rule's or optimizer's state is made: outside any tf.function (init_scope), and in
    the scope of the strategy in use, if any, so that state used under tf.distribute is mirrored
    like the variables it serves."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    with tf.init_scope():
        if strategy is None or tf.distribute.has_strategy():
            yield
        else:
            with strategy.scope():
                yield


def check_clip_state(clip, owner):
    """An adaptive clip's state serves one rule or optimizer, and under tf.distribute is mirrored
    (made on its first step, in the strategy's scope)."""
    clip.bind(owner)
    state = clip.state
    if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        for v in state.values():
            if not isinstance(v, tf.distribute.DistributedValues):
                raise ValueError(
                    f"the adaptive clip's state variable {v.name} was made outside "
                    f"{type(tf.distribute.get_strategy()).__name__}'s scope, so it is not mirrored: "
                    "use a new clip object under the strategy (its state is made on its first step)")
