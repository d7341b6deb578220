"""The fused ops: global norm, clip by global norm (with its gradient), and clip-and-apply."""
import collections
import math
import numbers

import tensorflow as tf
from tensorflow.python.framework.ops import EagerTensor

import tfclip._eager as _eager
from tfclip import _loader, clipping
from tfclip._engine import opcall as _opcall
from tfclip._engine import replicated as _replicated
from tfclip._engine import checks as _checks
from tfclip._engine.opcall import ClipApplyResult  # noqa: F401  (tfclip.ClipApplyResult)
from tfclip.rules import Rule

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# The same, as DataType enums: an int set lookup per check, not DType.__eq__ per entry (the
# per-variable checks run on every eager step).
_FLOAT_ENUMS = frozenset(d.as_datatype_enum for d in _FLOAT_DTYPES)

def _check_sequence(t_list, what):
    if not isinstance(t_list, collections.abc.Sequence) or isinstance(t_list, str):
        raise TypeError(f"`{what}` should be a sequence of tensors, got {type(t_list).__name__}")
    return list(t_list)


def _float_values(t_list, what):
    """Tensors (IndexedSlices: their values) of the non-None entries, with their indices."""
    idx, values = [], []
    for i, t in enumerate(t_list):
        if t is None:
            continue
        v = t.values if isinstance(t, tf.IndexedSlices) else t
        v = tf.convert_to_tensor(v, dtype_hint=tf.float32, name=f"t_{i}")
        if v.dtype.as_datatype_enum not in _FLOAT_ENUMS:
            raise ValueError(
                f"{what}[{i}] has dtype {v.dtype.name}; tfclip takes float16, bfloat16, float32 "
                "and float64 tensors"
            )
        idx.append(i)
        values.append(v)
    if not values:
        raise ValueError(f"{what} holds no tensor (it is empty or all None)")
    return idx, values


def _norm_dtype(values):
    return tf.float64 if any(v.dtype == tf.float64 for v in values) else tf.float32


def _result_dtype(values, norm_dtype):
    # As TF: the norm has the tensors' dtype; a mixed list (which TF rejects) gets norm_dtype.
    dtypes = {v.dtype for v in values}
    return dtypes.pop() if len(dtypes) == 1 else norm_dtype


@tf.autograph.experimental.do_not_convert
def global_norm(t_list, name=None):
    """The global L2 norm of a list of tensors: `tf.linalg.global_norm`, in one fused pass.

    `None` entries are skipped and `tf.IndexedSlices` count their `.values`. The sum of squares
    is accumulated in float64, in a fixed order, so the result is the same bits on every run.

    >>> tfclip.global_norm([tf.constant([3.0]), None, tf.constant([[4.0]])]).numpy()
    5.0
    """
    t_list = _check_sequence(t_list, "t_list")
    with tf.name_scope(name or "global_norm"):
        _, values = _float_values(t_list, "t_list")
        nd = _norm_dtype(values)
        norm, _ = _loader.ops().tfclip_global_norm(t=values, Tnorm=nd)
        return tf.cast(norm, _result_dtype(values, nd))


@tf.autograph.experimental.do_not_convert
def fused_clip_by_global_norm(t_list, clip_norm, use_norm=None, name=None, *,
                              return_tensor_norms=False):
    """Drop-in for `tf.clip_by_global_norm`: one norm pass, one scale pass, whatever the list length.

    Returns `(list_clipped, global_norm)`, or with `return_tensor_norms=True`
    `(list_clipped, global_norm, tensor_norms)`: a vector of each tensor's own pre-clip norm,
    aligned with the non-None entries, summed by the same norm pass (no extra pass; the global
    norm's dtype). Each tensor becomes
    `t * clip_norm / max(global_norm, clip_norm)`; `None` entries pass through; `IndexedSlices`
    keep their indices and dense shape; when the norm is inf or NaN every output is NaN, as in
    TF. With `use_norm` the norm pass is skipped and `use_norm` is returned. The op has a
    registered gradient equal to TF's gradient of the unfused composition.

    ```python
    grads = tape.gradient(loss, model.trainable_variables)
    grads, norm = tfclip.fused_clip_by_global_norm(grads, 5.0)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    ```
    """
    t_list = _check_sequence(t_list, "t_list")
    _opcall.check_clip_norm(clip_norm, "clip_norm")
    if return_tensor_norms and use_norm is not None:
        raise ValueError("return_tensor_norms=True needs the norm pass, which use_norm replaces; "
                         "pass one or the other (or take the norms from tfclip.global_norm's pass)")
    with tf.name_scope(name or "clip_by_global_norm"):
        idx, values = _float_values(t_list, "t_list")
        nd = _norm_dtype(values)
        clip_t = tf.cast(clip_norm, nd)
        if use_norm is None:
            use_t, given = tf.zeros([], nd), False
        else:
            use_t, given = tf.cast(use_norm, nd), True
        clipped, norm, tensor_norms = _loader.ops().tfclip_clip_by_global_norm(
            t=values, clip_norm=clip_t, use_norm=use_t, use_given_norm=given
        )
        out = list(t_list)
        for i, c in zip(idx, clipped):
            t = t_list[i]
            out[i] = tf.IndexedSlices(c, t.indices, t.dense_shape) if isinstance(t, tf.IndexedSlices) else c
        if given:
            return out, use_norm
        rd = _result_dtype(values, nd)
        if return_tensor_norms:
            return out, tf.cast(norm, rd), tf.cast(tensor_norms, rd)
        return out, tf.cast(norm, rd)


@tf.RegisterGradient("TfclipClipByGlobalNorm")
def _clip_by_global_norm_grad(op, *out_grads):
    """TF's gradient of `clip_by_global_norm`'s unfused composition, written out.

    scale = c * min(1/n, 1/c) + (n - n); out_i = t_i * cast(scale); n = sqrt(2 * sum l2_loss(t_i)).
    Ties in the min go to 1/n (TF's Minimum gradient), and n = 0 gives NaN as TF's SqrtGrad does.
    The per-tensor norms n_i (the last output) add t_i * g_i / n_i, as tf.norm's gradient.
    """
    k = len(op.outputs) - 2
    ts, c, given = op.inputs[:k], op.inputs[k], op.get_attr("use_given_norm")
    n = op.outputs[k]
    nd = n.dtype
    g_out, g_norm, g_tn = out_grads[:k], out_grads[k], out_grads[k + 1]
    inv_n = 1.0 / n
    inv_c = tf.constant(1.0, nd) / c
    mn = tf.minimum(inv_n, inv_c)
    scale = c * mn + (n - n)
    dscale = tf.zeros([], nd)
    grads_t = []
    for t, g in zip(ts, g_out):
        if g is None:
            grads_t.append(None)
            continue
        dscale += tf.cast(tf.reduce_sum(g * t), nd)
        grads_t.append(g * tf.cast(scale, t.dtype))
    take_n = inv_n <= inv_c
    zero = tf.zeros([], nd)
    d_mn = dscale * c
    d_c = dscale * mn + tf.where(take_n, zero, d_mn) * ((-1.0 / c) / c)
    d_n = tf.where(take_n, d_mn, zero) * ((-1.0 / n) / n) + dscale - dscale
    if g_norm is not None:
        d_n += g_norm
    if given:
        return grads_t + [d_c, d_n]
    d_half_sq = 2.0 * (d_n * 0.5 / n)  # sqrt(2h): SqrtGrad, then the constant 2
    out = []
    for i, (t, g) in enumerate(zip(ts, grads_t)):
        via_norm = t * tf.cast(d_half_sq, t.dtype)  # L2LossGrad
        if g_tn is not None:
            via_norm += t * tf.cast(g_tn[i] / op.outputs[k + 1][i], t.dtype)
        out.append(via_norm if g is None else g + via_norm)
    return out + [d_c, None]


@tf.autograph.experimental.do_not_convert
def fused_clip_apply(
    grads_and_vars,
    rule,
    *,
    global_clipnorm=None,
    clipnorm=None,
    clipvalue=None,
    clip=None,
    use_norm=None,
    nonfinite="skip",
    lazy_sparse=False,
    grad_scale=None,
    stochastic_rounding=False,
    rounding_seed=0,
    name=None,
):
    """Clip gradients and apply an update rule to their variables, in one fused step.

    The classic three steps — `compute_gradients`, clip, `apply_gradients` — with the last two
    fused: one pass computes the global norm of all gradients, one pass clips each gradient and
    updates its variable and slots in place. Clip arguments are named as in Keras (at most one):

    - `global_clipnorm`: scale all gradients by `min(1, global_clipnorm / global_norm)`
      (`tf.clip_by_global_norm`);
    - `clipnorm`: clip each gradient to that norm on its own (`tf.clip_by_norm`);
    - `clipvalue`: clip each element to `[-clipvalue, clipvalue]` (`tf.clip_by_value`);
    - `clip`: an adaptive clip (`tfclip.clipping`): "zclip" or "autoclip" (their defaults, the
      state kept on `rule`), or a `tfclip.clipping.ZClip(...)` / `AutoClip(...)` object (the
      state kept on it). The threshold follows the global norms of past steps; the step is
      clipped to it as `global_clipnorm` clips, in the same two passes.

    Args:
      grads_and_vars: (gradient, variable) pairs, as `compute_gradients` or `zip(grads, vars)`
        give. Pairs whose gradient is `None` (`tf.stop_gradient`, unused variables) are skipped
        and are not part of the norm; only the listed variables are touched. `IndexedSlices`
        gradients (embeddings) are applied without densifying them; their `.values` join the
        global norm, as in TF. The update is the one the densified gradient would give: SGD
        scatters (duplicate rows applied one after another); Momentum, Adam and AdamW sum a
        row's duplicates and decay every row's slots, as the stock optimizers do.
      rule: a `tfclip.rules` object (`SGD`, `Momentum`, `Adam`, `AdamW`). It holds the
        hyper-parameters, the step counter and the optimizer slots (see `tfclip.rules`).
      use_norm: a global norm computed elsewhere (e.g. all-reduced across shards) to use
        instead of the norm pass.
      nonfinite: what a non-finite global norm does. "skip" (default): nothing is written, the
        step counter does not advance, `applied` is False. "propagate": TF's semantics (the
        clipped gradients are NaN, and so become the variables). "raise": an
        InvalidArgumentError, nothing written.
      lazy_sparse: for `IndexedSlices` gradients, update only the rows they touch (and those
        rows' slots), like TF1's `LazyAdamOptimizer`: much less memory traffic for a large
        embedding table, but not the stock result (untouched rows' slots do not decay and
        weight decay skips them).
      grad_scale: a factor on every gradient, folded into the two passes: with loss scaling
        (`mixed_float16`), `1 / loss_scale`, instead of unscaling the gradients first. The step
        is the one on `g * grad_scale` (bit for bit for a power of two, as every dynamic loss
        scale is), its norms are theirs, and an inf/NaN in the scaled gradients is a non-finite
        step (`nonfinite="skip"`: the loss scale's back-off case). A number or a scalar tensor,
        finite and > 0; not with AGC. (`use_norm`, if given, is the norm of the gradients as
        given.)
      stochastic_rounding: for bfloat16 variables (pure-bf16 training, no float32 master
        weights): each updated value is rounded to bfloat16 stochastically, up with probability
        its distance from the value below over the gap, so an update below half a bf16 ulp
        survives on average instead of vanishing. The random bits are Philox4x32-10's of
        (rounding_seed, the rule's step, the variable's position, the element): reproducible, the
        same on CPU, CUDA and under XLA. Other variables are stored as always.
      rounding_seed: stochastic rounding's seed, an int in [0, 2**32).

    Returns:
      `ClipApplyResult(global_norm, applied, tensor_norms, clipped_units)`: the pre-clip global
      norm, whether the step was applied, each gradient's own pre-clip norm (aligned with the
      pairs whose gradient is not None; NaN with `use_norm`), all from the one norm pass, and
      with `clip=tfclip.clipping.AGC(...)` each gradient's count of units AGC scaled down (int64,
      aligned as tensor_norms; 0 in the other clip modes). In graph mode,
      running any of them runs the step.

    ```python
    rule = tfclip.rules.Adam(learning_rate=1e-3)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    grads = tape.gradient(loss, model.trainable_variables)
    result = tfclip.fused_clip_apply(zip(grads, model.trainable_variables), rule,
                                     global_clipnorm=1.0)
    tf.summary.scalar("grad_norm", result.global_norm)
    tf.summary.histogram("tensor_norms", result.tensor_norms)
    ```
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a tfclip.rules object (e.g. tfclip.rules.Adam()), got {type(rule).__name__}")
    adaptive = _adaptive_clip(clip, rule, global_clipnorm=global_clipnorm, clipnorm=clipnorm,
                              clipvalue=clipvalue)
    if adaptive is None:
        clip_mode, clip = _opcall.clip_config(global_clipnorm, clipnorm, clipvalue)
    else:
        clip_mode, clip = "adaptive", adaptive
    _opcall.check_policy(nonfinite)
    if isinstance(use_norm, numbers.Real) and use_norm < 0:  # NaN is the nonfinite policy's
        raise ValueError(f"use_norm must be >= 0, got {use_norm}")
    if isinstance(grad_scale, numbers.Real) and not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be finite and > 0 (1 / the loss scale), got {grad_scale}")
    scale_kw = {} if grad_scale is None else {"grad_scale": grad_scale}
    stochastic_rounding, rounding_seed = _checks.check_rounding(stochastic_rounding, rounding_seed)
    if stochastic_rounding:
        scale_kw["rounding_seed"] = rounding_seed

    pairs = list(grads_and_vars)
    if not pairs:
        raise ValueError("grads_and_vars is empty")
    split = _repeated_eager_split(pairs, rule)
    fast = split is not None
    if not fast:
        split = _split_pairs(pairs)
        _remember_eager_split(pairs, split, rule)
    grads, variables = split
    if not fast:
        mirrored = _replicated.mirrored_step(grads, variables, rule, clip_mode, clip, use_norm, nonfinite,
                                  bool(lazy_sparse), name, scale_kw)
        if mirrored is not None:
            return mirrored
    if fast:  # eager: no name scope (eager ops keep no names)
        try:
            return rule._apply(grads, variables, clip_mode, clip, use_norm, nonfinite,
                               bool(lazy_sparse), all_dense=True, **scale_kw)
        except (tf.errors.InvalidArgumentError, TypeError, ValueError):
            error = _pairs_error(pairs)  # the full check's error naming the bad pair, if any
            if error is None:
                raise
        raise error
    with tf.name_scope(name or f"clip_apply_{rule.kind}"):
        return rule._apply(grads, variables, clip_mode, clip, use_norm, nonfinite,
                           bool(lazy_sparse), **scale_kw)


def _adaptive_clip(clip, rule, **fixed):
    """The clip object of `clip=` (None for none); a mode's name gets one kept on the rule."""
    if clip is None:
        return None
    if isinstance(clip, str):
        named = rule.__dict__.setdefault("_named_clips", {})
        obj = named.get(clip)
        if obj is None:
            obj = named[clip] = clipping.get(clip)
    else:
        obj = clipping.get(clip)
    clipping.check_exclusive(obj, **fixed)
    return obj


def _split_pairs(pairs):
    """The gradients and tf.Variables of the pairs whose gradient is not None, every pair
    checked, with an error that names the pair."""
    grads, variables, seen = [], [], {}
    for i, pair in enumerate(pairs):
        try:
            g, v = pair
        except (TypeError, ValueError):
            raise TypeError(f"grads_and_vars[{i}] is not a (gradient, variable) pair") from None
        v = _as_tf_variable(v)
        if v is None:
            raise TypeError(f"grads_and_vars[{i}] holds a {type(pair[1]).__name__}, not a "
                            "resource tf.Variable or keras.Variable")
        if v.dtype.as_datatype_enum not in _FLOAT_ENUMS:
            raise TypeError(f"grads_and_vars[{i}]: variable {v.name} has dtype {v.dtype.name}; "
                            "only float16, bfloat16, float32 and float64 variables can be trained")
        if g is None:
            continue
        key = v.ref()
        if key in seen:
            raise ValueError(f"grads_and_vars[{i}] and grads_and_vars[{seen[key]}] hold the same "
                             f"variable {v.name}; each variable may appear once")
        seen[key] = i
        if isinstance(g, tf.IndexedSlices):
            g = _check_indexed_slices(g, v, i)
        else:
            if not isinstance(g, tf.Tensor):
                g = tf.convert_to_tensor(g, dtype_hint=v.dtype)
            gs, vs = g.shape, v.shape
            if gs != vs and gs.is_fully_defined() and vs.is_fully_defined():
                what = "shape" if gs.num_elements() == vs.num_elements() else "element count"
                raise ValueError(f"grads_and_vars[{i}]: gradient {what} differs: gradient "
                                 f"{gs} vs variable {v.name} {vs}")
        if g.dtype.as_datatype_enum not in _FLOAT_ENUMS:
            # Any float dtype is fine: it is clipped in its own dtype, then cast to the
            # variable's, as stock Keras casts a gradient in update_step.
            raise TypeError(f"grads_and_vars[{i}]: gradient dtype {g.dtype.name} for variable "
                            f"{v.name}; gradients must be float16, bfloat16, float32 or float64")
        grads.append(g)
        variables.append(v)
    if not grads:
        raise ValueError("No gradients provided for any variable (every gradient is None): "
                         f"{[v.name for _, v in pairs]}")
    return grads, variables


def _pairs_error(pairs):
    try:
        _split_pairs(pairs)
    except (TypeError, ValueError) as e:
        return e
    return None


# A repeated eager step (the same variable objects, every gradient a dense eager tensor) skips
# the per-pair Python above (most of a 200-variable eager step: benchmarks/NOTES.md, "Figures
# behind the code": P3). What it
# checked of the variables (unwrapping, dtype, duplicates) still holds for the same objects;
# a gradient's dtype and shape are checked by the op before it writes anything, and an op
# error reruns the full check so the error still names the pair. The entry holds the variable
# objects, so no other object can take one's place (identity) while it stands; it lives on the
# rule, one entry, as the rule's handle lists do. Not under tf.distribute, where a variable
# stands for replicas. The check is one pass in C over a list of 2-tuples (what zip() and
# compute_gradients give; other pairs take the full path): in Python it was four passes (zip,
# ids, types, list) that ran cache-cold after each op (E1).


def _repeated_eager_split(pairs, rule):
    cache = rule._pairs_cache  # read once: another thread may replace it meanwhile
    if cache is None or not tf.executing_eagerly():
        return None
    gs = _eager.split_repeated_pairs(pairs, cache[0], EagerTensor)
    if gs is None or tf.distribute.has_strategy():
        return None
    return gs, cache[1]


_EAGER_ONLY = {EagerTensor}


def _all_eager_tensors(ts):
    """Whether every entry is a dense eager tensor (a whole-list check in C rather than a
    per-gradient Python loop; benchmarks/NOTES.md's P4)."""
    return set(map(type, ts)) == _EAGER_ONLY


def _remember_eager_split(pairs, split, rule):
    grads, variables = split
    if (len(grads) == len(pairs) and tf.executing_eagerly() and not tf.distribute.has_strategy()
            and _all_eager_tensors(grads)):
        vs = tuple(v for _, v in pairs)
        rule._pairs_cache = (vs, variables)


def _check_indexed_slices(g, v, i):
    """An IndexedSlices gradient of `v`, with what can be checked before the op (static
    shapes, dtypes); the op checks the rest, indices' range included, before writing."""
    values = tf.convert_to_tensor(g.values, dtype_hint=v.dtype)
    indices = tf.convert_to_tensor(g.indices)
    if indices.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"grads_and_vars[{i}]: IndexedSlices indices have dtype "
                        f"{indices.dtype.name}; int32 or int64 expected")
    if v.shape.rank == 0:
        raise ValueError(f"grads_and_vars[{i}]: IndexedSlices gradient for the scalar variable "
                         f"{v.name}; sparse gradients need a variable of rank >= 1")
    if indices.shape.rank is not None and indices.shape.rank != 1:
        raise ValueError(f"grads_and_vars[{i}]: IndexedSlices indices must be a vector, got "
                         f"shape {indices.shape}")
    if values.shape.rank is not None and v.shape.rank is not None:
        if values.shape.rank != v.shape.rank or not values.shape[1:].is_compatible_with(v.shape[1:]):
            raise ValueError(f"grads_and_vars[{i}]: IndexedSlices values of shape {values.shape} "
                             f"do not fit variable {v.name} of shape {v.shape} (rows must be "
                             f"{v.shape[1:]})")
    return tf.IndexedSlices(values, indices, g.dense_shape)


def _as_tf_variable(v):
    """The resource tf.Variable behind a tf.Variable or a Keras 3 variable, else None."""
    for x in (v, getattr(v, "value", None)):  # keras.Variable (TF backend) wraps a tf.Variable
        # (A mirrored variable's handle is per replica: it has none in the cross-replica context.)
        if isinstance(x, tf.Variable) and (isinstance(x, tf.distribute.DistributedValues)
                                           or hasattr(x, "handle")):
            return x
    return None
