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
3. one apply op per group (`tfclip._engine.opcall.apply`), each with that norm, the clip and the
   non-finite policy;
4. one `StepResult`: the norm, whether the step was applied, each gradient's norm and AGC's
   clipped units in the gradients' order, the clip as the ops ran it, and the adaptive clip's
   state advanced (its assign, after the step; not for a non-finite norm).

A rule's binding to a stock class is data (`tfclip._engine.binding.Binding`). Adding a rule:
docs/architecture.md, "Adding an update rule".

Imports flow one way: the front doors and the engine's upper modules import this module; it
imports `opcall`, `_loader` and `clipping`, never a front door.
"""
import collections

import tensorflow as tf

from tfclip import _loader
from tfclip._engine import loss_scale as _loss_scale
from tfclip._engine import opcall as _opcall
from tfclip._engine import tf_clip as _tf_clip
from tfclip import clipping as _clipping
from tfclip._engine.opcall import ClipApplyResult

# ---------------------------------------------------------------------------- the step


class Group(collections.namedtuple("Group", ["kind", "var", "slots", "hparams", "flags", "positions",
                                             "refs", "iterations", "absmax"], defaults=(None, None, (), ()))):
    """One apply op of a step: the rule-table row `kind`, the variables' handles `var`, the slot
    handle lists (by the table's slot names, or in its order), the hyper-parameters and flags by
    the table's names (`tfclip._engine.opcall.apply`). `positions`: the gradients it takes (their
    indices; None: all, the one group of a step). `refs`: TF1 ref variables (see
    `tfclip._engine.opcall.apply`). `iterations`: `[handle]` where the op owns the step counter (`tfclip.rules`
    on host variables), else empty. `absmax`: int8 state's absmax handles, slot-major (the op's
    `absmax` input; csrc/core/apply_op.h), else empty."""


StepResult = collections.namedtuple(
    "StepResult", ["global_norm", "applied", "tensor_norms", "clipped_units", "clip_mode", "clip",
                   "adaptive", "clip_update", "grad_scale"], defaults=(None,))
StepResult.__doc__ = """What `run` returns: `ClipApplyResult`'s four fields (`outputs`), the clip the
ops ran (`clip_mode`, `clip`: an adaptive clip runs as "global_norm" with its threshold), the
adaptive clip's `ClipStep` (None without one), the op assigning its state after the step
(graph mode; None eagerly or without one), and the loss-scale unscale folded in (None: none)."""
StepResult.outputs = property(lambda self: ClipApplyResult(*self[:4]))

Outside = collections.namedtuple("Outside", ["positions", "variables", "apply"])
Outside.__doc__ = """Gradients of a step that no apply op takes (Muon's matrices, which TF ops step):
`positions` in the step's gradients, their `variables`, and `apply(clipped, norm, nonfinite)`,
which steps them on their gradients clipped as the ops clip theirs (`run`) and returns whether
the step was applied (from `norm`, the step's global norm, under the policy `nonfinite`)."""

Stock = collections.namedtuple("Stock", ["variables", "clip", "update"])
Stock.__doc__ = """A step the stock class's own ops make, where no fused op can take it (`run`; the Keras 3
drop-ins': IndexedSlices on a GPU inside XLA, which densifies them; Adafactor's IndexedSlices
without global_clipnorm; a build without tfclip's XLA kernels): the step's `variables`,
`clip(grads)`, the stock class's own clip of a fixed mode (global_clipnorm, clipnorm,
clipvalue), and `update(clipped)`, its per-variable updates (weight decay included)."""


def run(grads, groups, clip_mode, clip, *, clip_obj=None, use_norm=None, pass_norms=None, nonfinite="skip",
        lazy=False, keras_sparse_squares=False, all_dense=False, grad_scale=None, loss_scale_of=None,
        rounding=None, outside=None, gated=None, stock=None):
    """One fused step over `grads` (tensors or IndexedSlices, aligned with the groups'
    positions): see the module docstring.

    clip_mode, clip: the fixed clip (`tfclip._engine.opcall.clip_config`). clip_obj: an AGC or adaptive clip
    (`tfclip.clipping`; its state built by the caller), which replaces them. use_norm: a global
    norm given by the caller (no norm pass; `pass_norms`: each gradient's, where the caller has
    them: shard_state's). keras_sparse_squares: Keras 3's stock update of an IndexedSlices
    gradient: a repeated row feeds the sum of its slices' squares, unless a global-norm clip
    scaled (so densified) it. all_dense: the caller checked that every gradient is a dense eager
    tensor (the eager fast path). grad_scale: a factor on every gradient folded into the passes
    (a loss scale's 1 / scale; ClipConfig::grad_scale): the step is the one on grads *
    grad_scale, and the norms it reports are theirs (use_norm, given, is of the gradients as
    given). loss_scale_of: an optimizer inside a LossScaleOptimizer's apply
    (`tfclip._engine.loss_scale`): its unscale is `grad_scale`, a non-finite step is skipped
    whatever `nonfinite` says (the wrapper's scale backs off), and the wrapper learns whether the
    step was applied. rounding: None, or (seed, step) where bfloat16 variables round
    stochastically (csrc/core/rounding.h): the seed (`check_rounding`) and the step number (a
    tensor or number, the optimizer's iterations + 1); group k's op takes seed + k * 2^32, so no
    two variables of a step draw the same bits. outside: an `Outside`, gradients no op takes,
    clipped here as the ops clip theirs and stepped by its `apply`. gated: a function run before
    the ops where the step will be applied (a finite norm, unless `nonfinite` is "propagate":
    Muon's decay at another rate than its op's). stock: a `Stock`, the step in the stock class's
    own ops (no group then).
    """
    if loss_scale_of is not None:
        grad_scale = _loss_scale.loss_scale(loss_scale_of)
        if grad_scale is not None:
            nonfinite = "skip"
    if stock is not None:
        result = _stock_step(grads, clip_mode, clip, clip_obj, nonfinite, stock)
    else:
        result = _fused_step(grads, groups, clip_mode, clip, clip_obj, use_norm, pass_norms, nonfinite, lazy,
                             keras_sparse_squares, all_dense, grad_scale, rounding, outside, gated)
    if loss_scale_of is not None and result.grad_scale is not None:
        _loss_scale.loss_scale_applied(loss_scale_of, result.applied)
    return result


def _fused_step(grads, groups, clip_mode, clip, clip_obj, use_norm, pass_norms, nonfinite, lazy,
                keras_sparse_squares, all_dense, grad_scale, rounding, outside, gated):
    agc, adaptive = {}, None
    raw_scale = grad_scale
    if isinstance(clip_obj, _clipping.AGC):  # unit-wise, inside the op's own passes
        clip_mode, clip, agc = clip_obj.op_args()
    if grad_scale is not None:
        if agc:
            raise ValueError("grad_scale (a loss-scale unscale) does not combine with AGC (its unit "
                             "scales count the units they clip); unscale the gradients first")
        grad_scale = _opcall.scalar(grad_scale, "grad_scale")
    given = use_norm is not None
    if outside is not None and given and pass_norms is None:
        raise ValueError("a step with gradients outside its ops and a given norm needs their norms too (pass_norms)")
    # A factored rule (Adafactor) takes dense gradients (its row and column means cover every
    # element): IndexedSlices are densified for it, as keras's Adafactor densifies them, after a
    # norm pass over their values (TF's global norm of IndexedSlices, duplicates apart).
    densify = not all_dense and any(_opcall.RULES[g.kind]["factored"] for g in groups) and any(
        isinstance(x, tf.IndexedSlices) for x in grads)
    if given:
        use_norm = _opcall.scalar(use_norm, "use_norm")
    elif len(groups) > 1 or (clip_obj is not None and not agc) or densify or outside is not None:
        # Every group's op takes the norms of one norm pass; so does an adaptive clip, whose
        # threshold comes from it (scalar ops on the device), and the gradients outside the ops.
        use_norm, pass_norms = norm_pass(grads, all_dense)
        given = True
    if gated is not None:  # (before any op, where the step will be applied)
        gate = nonfinite_applied(use_norm, "skip") if nonfinite != "propagate" else tf.constant(True)
        tf.cond(gate, gated, lambda: None)
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
        part = grads if len(groups) == 1 and outside is None else [grads[i] for i in g.positions]
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
    order = [i for g in groups for i in g.positions] if len(groups) > 1 or outside is not None else None
    unit_parts = [o[3] for o in outs]
    if outside is not None:
        # Outside the ops: clipped as the ops clip (AGC per unit from the variables before the
        # step, its counts also for a skipped step, as the op's), then stepped by their own ops,
        # which take the same non-finite decision from the same norm.
        out_grads = [grads[i] for i in outside.positions]
        counts = None
        if agc:
            out_grads, counts = clip_obj.unfused(out_grads, outside.variables, counts=True)
        elif outside.positions:
            out_grads = _tf_clip.clip_gradients(out_grads, clip_mode, clip, norm_input,
                                                [pass_norms[i] for i in outside.positions], raw_scale)
        if outside.positions:
            out_applied = outside.apply(out_grads, norm_input, nonfinite)
            if not groups:
                applied = out_applied
        order += list(outside.positions)
        unit_parts.append(counts if counts is not None else tf.zeros([len(outside.positions)], tf.int64))
    if order is not None:
        clipped_units = in_order(unit_parts, order) if order else tf.zeros([0], tf.int64)
        if pass_norms is None:
            tensor_norms = in_order([o[2] for o in outs], order)
    if pass_norms is not None:
        tensor_norms = tf.cast(pass_norms if grad_scale is None else pass_norms * grad_scale, tf.float32)
    update = None
    if adaptive is not None:
        clip_obj._remember(adaptive)
        update = _clipping.assign_updates(adaptive, after=[applied])
    return StepResult(norm, applied, tensor_norms, clipped_units, clip_mode, clip, adaptive, update, raw_scale)


def _stock_step(grads, clip_mode, clip, clip_obj, nonfinite, stock):
    """The step of `run(..., stock=)`: the norms, the adaptive clip's threshold or AGC's counts
    and the non-finite decision as the fused step makes them, the clip and the updates the stock
    class's own. `nonfinite` "skip" is honoured without a strategy (a tf.cond cannot hold a
    replica's merge_call); under one the step applies as "propagate" does."""
    # One reduction per gradient gives both its norm and the global one (as the fused pass).
    sumsq = tf.stack([tf.reduce_sum(tf.square(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                                      tf.float32))) for g in grads])
    tensor_norms = tf.sqrt(sumsq)
    norm = tf.sqrt(tf.reduce_sum(sumsq))
    adaptive = clip_obj.step(norm) if isinstance(clip_obj, _clipping.AdaptiveClip) else None
    agc_clipped = counts = None
    if isinstance(clip_obj, _clipping.AGC):  # the counts also for a skipped step, as the op's
        agc_clipped, counts = clip_obj.unfused(grads, stock.variables, counts=True)

    def update():
        if agc_clipped is not None:
            clipped = agc_clipped
        elif adaptive is None:
            clipped = stock.clip(grads)
        else:  # TF's clip_by_global_norm scale, to the adaptive threshold when it clips
            scale = tf.where(adaptive.clipped, adaptive.clip / tf.cast(norm, tf.float64), 1.0)
            clipped = [_tf_clip.scaled(g, scale) for g in grads]
        stock.update(clipped)

    finite = tf.math.is_finite(norm)
    if nonfinite == "skip" and not tf.distribute.has_strategy():
        tf.cond(finite, update, lambda: None)
        applied = finite
    else:
        update()
        applied = tf.constant(True)
    update_op = None
    if adaptive is not None:
        clip_mode, clip = "global_norm", adaptive.clip
        clip_obj._remember(adaptive)
        update_op = _clipping.assign_updates(adaptive, after=[applied])
    return StepResult(norm, applied, tensor_norms, counts, clip_mode, clip, adaptive, update_op)


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
