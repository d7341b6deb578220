"""The one place the Python layer builds a clip-and-apply op call, and checks the clip and
non-finite arguments every entry point shares (`fused_clip_apply`, the Keras and TF1 optimizers).

The ops and their inputs come from the core's rule table (`csrc/core/rule_table.h`, read through
`tfclip._core.rule_table()`): per rule its op, its slot inputs, its hyper-parameter inputs and its
flags. A caller gives a rule's name, its slot handle lists in the table's order, and its
hyper-parameters and flags by the table's names; a name the rule does not take, or one it needs
that is missing, is an error here, before any op is built.
"""
import collections
import math
import numbers
import re
import threading
import weakref

import tensorflow as tf
from tensorflow.python.framework.ops import EagerTensor

import tfclip._core as _core
from tfclip import _loader

RULES = _core.rule_table()
HPARAMS = _core.hparam_table()

ClipApplyResult = collections.namedtuple("ClipApplyResult",
                                         ["global_norm", "applied", "tensor_norms", "clipped_units"])
ClipApplyResult.__doc__ = """What `fused_clip_apply` returns (a namedtuple: it can be returned from a
`tf.function` and fetched with `Session.run` whole).

global_norm: float32 scalar, the global norm of the gradients before clipping (or `use_norm`).
applied: bool scalar; False only when `nonfinite="skip"` met a non-finite norm and nothing was
    written.
tensor_norms: float32 vector, each gradient's own pre-clip L2 norm (an IndexedSlices': its
    values'), aligned with the pairs whose gradient is not None, from the same norm pass (no
    extra pass over memory; float64 sums in a fixed order). Given also for a skipped step, to
    tell which tensor was not finite. NaN when `use_norm` replaced the norm pass.
clipped_units: int64 vector aligned with `tensor_norms`: with `clip=tfclip.clipping.AGC(...)`
    (clip_mode 'agc'), each gradient's count of units the clip scaled down (units: the
    variable's last axis, the whole tensor for rank <= 1; a unit counts when
    `||G_u|| > clip_factor * max(||W_u||, eps)`, and every unit of a non-finite gradient), counted
    by the op from its own unit norms (on a GPU, on the device). 0 for every gradient in the
    other clip modes. Given also for a skipped step (the units the step would have clipped).
"""

_STATE_LOCKS = weakref.WeakKeyDictionary()
_STATE_LOCKS_GUARD = threading.Lock()


def state_lock(owner):
    """The re-entrant lock of a rule or optimizer, under which its state is made (once, whatever
    the threads) and an eager step runs. Kept beside the object, not on it, so that copying,
    pickling or Keras's attribute tracking never meet a lock."""
    lock = _STATE_LOCKS.get(owner)
    if lock is None:
        with _STATE_LOCKS_GUARD:
            lock = _STATE_LOCKS.setdefault(owner, threading.RLock())
    return lock


CLIP_ARGS = ("global_clipnorm", "clipnorm", "clipvalue")  # Keras's (the drop-ins read these)
_ALL_CLIP_ARGS = CLIP_ARGS + ("agc_clip_factor",)
_CLIP_MODES = {"global_clipnorm": "global_norm", "clipnorm": "norm", "clipvalue": "value",
               "agc_clip_factor": "agc"}
POLICIES = ("skip", "propagate", "raise")
AGC_EPS = 1e-3  # the paper's (and optax's) floor of a unit's weight norm


def clip_config(global_clipnorm=None, clipnorm=None, clipvalue=None, agc_clip_factor=None):
    """(clip_mode, clip) for the op from Keras's three clip arguments and AGC's clip factor (at
    most one set).

    One rule everywhere, as Keras: None or 0 is no clip; otherwise a finite number > 0.
    agc_clip_factor: adaptive gradient clipping, unit-wise (clip_mode "agc", the paper's lambda;
    csrc/core/agc.h); its eps goes to the op as the `agc_eps` attr (check_agc_eps).
    """
    given = {k: v for k, v in zip(_ALL_CLIP_ARGS, (global_clipnorm, clipnorm, clipvalue, agc_clip_factor))
             if v is not None}
    if len(given) > 1:
        raise ValueError(f"set at most one of global_clipnorm, clipnorm, clipvalue, agc_clip_factor; "
                         f"got {sorted(given)}")
    for k, v in given.items():
        if isinstance(v, (tf.Tensor, tf.Variable)):
            return _CLIP_MODES[k], v  # checked by the op (0: no clip there too)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{k} must be a finite number >= 0 (None or 0: no clip), got {v!r}")
        if v > 0:
            return _CLIP_MODES[k], float(v)
    return "none", 0.0


def check_agc_eps(eps):
    """AGC's eps as the op's `agc_eps` attr: a Python number, finite and >= 0 (a float attr, so
    the op holds it as float32)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"agc_eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_policy(nonfinite):
    """The non-finite policy check every entry point shares."""
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {nonfinite!r}")


def check_clip_norm(x, what):
    """tf.clip_by_global_norm's clip_norm (the clip op, not the apply ops): finite and > 0."""
    if type(x) is float:  # the common case, without NumPy's scalar machinery
        ok = math.isfinite(x) and x > 0
    else:
        ok = not isinstance(x, numbers.Real) or (math.isfinite(x) and x > 0)
    if not ok:
        raise ValueError(f"{what} must be finite and > 0, got {x}")


def scalar(x, name):
    """A float64 scalar tensor for an op input (Python numbers converted exactly)."""
    if type(x) in (float, int) and tf.executing_eagerly():
        cached = _eager_number(x)
        if cached is not None:
            return cached
    if isinstance(x, tf.Tensor) and x.dtype == tf.float64 and x.shape.rank == 0:
        return x
    t = tf.convert_to_tensor(x, dtype_hint=tf.float64, name=name)
    if not t.dtype.is_floating and not t.dtype.is_integer:
        raise TypeError(f"{name} must be a number, got dtype {t.dtype.name}")
    if t.shape.rank is not None and t.shape.rank != 0:
        raise ValueError(f"{name} must be a scalar, got shape {t.shape}")
    return tf.cast(t, tf.float64)


# Eager float64 constants of the Python numbers a step passes (hyper-parameters, clip): making
# and checking one anew is a visible part of an eager step's fixed cost (benchmarks/NOTES.md,
# "Figures behind the code": P1). Keyed by value and sign, so -0.0 stays -0.0 (and NaN, an optional input's "not
# given", by its own key); bounded, for a number that changes every step. (Host constants: on
# GPU TF copies them to the device without a wait, where the kernel reads them.)
_EAGER_NUMBERS = {}


def _eager_number(x):
    try:
        f = float(x)
    except OverflowError:
        return None  # the general path names the problem
    key = ("nan",) if f != f else (f, math.copysign(1.0, f))
    t = _EAGER_NUMBERS.get(key)
    if t is None:
        if len(_EAGER_NUMBERS) >= 256:
            _EAGER_NUMBERS.clear()
        with tf.device("/device:CPU:0"):
            t = tf.constant(f, tf.float64)
        _EAGER_NUMBERS[key] = t
    return t


def op_grads(grads):
    """The `grad`, `indices` and `sparse` inputs of the apply ops for a gradient list:
    IndexedSlices travel as their values, with their indices and positions."""
    values, indices, sparse = [], [], []
    for i, g in enumerate(grads):
        # (An eager tensor is told apart first: the IndexedSlices check is an ABC instance
        # check, slow per gradient on an eager step; NOTES.md's P2.)
        if type(g) is not EagerTensor and isinstance(g, tf.IndexedSlices):
            values.append(g.values)
            indices.append(g.indices)
            sparse.append(i)
        else:
            values.append(g)
    return values, {"indices": indices, "sparse": sparse}


NO_SPARSE = {"indices": (), "sparse": ()}  # the op's sparse inputs for all-dense gradients


def ftrl_variant(power):
    """Ftrl's core rule for a learning_rate_power: the sqrt variant for the default -0.5 given as
    a number (vectorized; csrc/core/rules.h, FtrlRule), else the general one. Returns the rule
    and the power input it takes ({} or {"lr_power": power})."""
    if isinstance(power, numbers.Real) and power == -0.5:
        return "ftrl_sqrt", {}
    return "ftrl", {"lr_power": power}


def _snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_OP_FUNCS = {}


def _op(rule, key="op"):
    f = _OP_FUNCS.get((rule, key))
    if f is None:
        f = _OP_FUNCS[(rule, key)] = getattr(_loader.ops(), _snake(RULES[rule][key]))
    return f


def apply(rule, var, slots, grad, hparams, flags=None, *, refs=None, **common):
    """Calls the rule's apply op.

    rule: a name of the rule table ("sgd", "adam", ...). var: the variables' handles. slots: the
    handle lists of the slots the step uses, in the table's order (Adam: [m, v] or [m, v, vhat]),
    or a dict by the table's slot names.
    refs: TF1 ref variables (graph mode), None when there are none: (positions, variables,
    slot lists), the gradient positions whose variable is a ref (ascending), those variables and
    their slots' lists (ref variables, in the order of `slots`); `var` and `slots` then hold the
    other positions' handles. The rule's ref op (TfclipClipApplyRef<Op>) runs the step.
    grad: the gradient values (see op_grads). hparams: every hyper-parameter the rule takes, by
    the table's name (numbers, tensors or variables; optional ones, Adam's beta powers, may be
    left out); flags: its bool options by attr name. common: the inputs and attrs every apply op
    has (clip, use_norm, iterations, clip_mode, nonfinite, indices, sparse, lazy, ...), int8
    state's `absmax` handles (slot-major; the resource op only), `grad_scale` ([] or [the
    loss-scale unscale, a float64 scalar]) and `rounding` ([] or [seed, step], float64 scalars:
    bfloat16 variables round stochastically, csrc/core/rounding.h).
    """
    row = RULES[rule]
    names = row["hparams"]
    unknown = set(hparams) - set(names)
    missing = [n for n in names if n not in hparams and not HPARAMS[n]["optional"]]
    if unknown or missing:
        raise TypeError(f"rule '{rule}' takes the hyper-parameters {names}; "
                        f"missing {missing}, unknown {sorted(unknown)}")
    slots = _slot_dict(rule, row, slots)
    if refs is not None:
        positions, ref_vars, ref_slots = refs
        ref_slots = _slot_dict(rule, row, ref_slots)
    flags = flags or {}
    if set(flags) - set(row["flags"]):
        raise TypeError(f"rule '{rule}' takes the flags {row['flags']}, got {sorted(flags)}")
    kw = {n: scalar(hparams.get(n, math.nan), HPARAMS[n]["display"]) for n in names}
    for s in row["slots"]:
        kw[s] = slots.get(s, [])
    for f in row["flags"]:
        kw[f] = bool(flags.get(f, False))
    absmax = list(common.pop("absmax", ()))  # int8 state's (csrc/core/apply_op.h): the resource op's
    grad_scale = list(common.pop("grad_scale", ()))  # [] or [the loss-scale unscale] (apply_op.h)
    rounding = list(common.pop("rounding", ()))  # [] or [seed, step] (apply_op.h)
    if refs is None:
        return _op(rule)(var=var, grad=grad, absmax=absmax, grad_scale=grad_scale, rounding=rounding, **kw,
                         **common)
    if absmax:
        raise ValueError("int8 optimizer state is for resource variables; TF1 ref variables keep their slots")
    for s in row["slots"]:
        kw[s + "_ref"] = ref_slots.get(s, [])
    return _op(rule, "ref_op")(var=var, var_ref=list(ref_vars), grad=grad, ref=list(positions),
                               grad_scale=grad_scale, rounding=rounding, **kw, **common)


def _slot_dict(rule, row, slots):
    if isinstance(slots, dict):  # by the table's slot names (the ones the flags leave out absent)
        if set(slots) - set(row["slots"]):
            raise TypeError(f"rule '{rule}' has the slots {row['slots']}, got {sorted(slots)}")
        return slots
    if not row["min_slots"] <= len(slots) <= len(row["slots"]):
        raise TypeError(f"rule '{rule}' takes {row['min_slots']} to {len(row['slots'])} slot lists "
                        f"({row['slots']}), got {len(slots)}")
    return dict(zip(row["slots"], slots))
