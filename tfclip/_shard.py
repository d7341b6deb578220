"""Optimizer state sharded across replicas (ZeRO stage 1): `shard_state=True` on the Keras 3
drop-ins (tfclip/_keras_step.py) under a `tf.distribute` strategy with more than one replica.

- **Owners.** At build each trainable variable gets one owning replica (`owners`: the largest
  first, each to the replica holding the fewest bytes so far). Its slots are made on the owner's
  device only (`on_device`: the strategy's own single-device placement), not mirrored: each
  replica keeps the state of its share.
- **The step** (inside `strategy.run`, after the all-reduce every replica has every summed
  gradient): the global norm of *all* gradients (the norm pass; the same bits on every replica),
  then the fused op over the replica's own variables with that norm (the clip, the non-finite
  decision: a skipped step is skipped everywhere), then `gather`: each replica's updated
  variables, as integer bit patterns, all-gathered, and written into every other replica's copy.
  The copies hold the same bits as the unsharded step (the op is element-wise given the norm).
- **Checkpoints**: a slot is one variable under its stock name, wherever it lives, so the layout
  is the stock (mirrored) one: sharded, unsharded and stock Keras restore each other's, on any
  number of replicas.

The drop-ins' part is small: `plan` at build, `slot_scope` around each slot's creation, and
`begin` / `finish` around the fused step of the replica's share (tfclip/_keras_step.py and
tfclip/_tf_keras_step.py).

Imports flow one way: the drop-ins import this module; it imports tfclip/_step.py.
"""
import collections
import contextlib

import tensorflow as tf
from tensorflow.python.distribute import numpy_dataset

from tfclip import _opcall, _step

# A bit pattern of each float width as int32 (the all-gather's one dtype).
_WIDTH = {2: tf.int16, 4: tf.int32, 8: tf.int64}


def replicas():
    """The replicas in sync of the strategy in scope (1 without one)."""
    return tf.distribute.get_strategy().num_replicas_in_sync if tf.distribute.has_strategy() else 1


def owners(nbytes, n):
    """Each variable's owning replica, for variables of `nbytes` bytes over `n` replicas: the
    largest first (ties: the first), each to the replica with the fewest bytes so far (ties: the
    lowest id). Deterministic: every replica and worker computes the same list."""
    load = [0] * n
    out = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += nbytes[i]
    return out


def local_device(strategy, replica):
    """The device of the replica with id `replica` in the sync group, where it is in this
    process; a ValueError where it is not (another worker's)."""
    devices = strategy.extended.worker_devices
    first = strategy.extended._get_replica_id_in_sync_group(0) if hasattr(
        strategy.extended, "_get_replica_id_in_sync_group") else 0
    local = replica - first
    if not 0 <= local < len(devices):
        raise ValueError(
            f"shard_state=True: replica {replica} runs in another worker process; "
            f"{type(strategy).__name__} with replicas in several processes is not supported yet "
            "(docs/distribute.md, Sharded optimizer state)")
    return devices[local]


@contextlib.contextmanager
def on_device(device):
    """Variables made inside are made on `device` alone, not mirrored (a creator in front of the
    strategy's own, asking for its single-device placement)."""
    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def replica_id():
    """This replica's id in the sync group as a Python int, inside `strategy.run`; None in the
    cross-replica context."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not tf.distribute.has_strategy():
        return None
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    return None if rid is None else int(rid)


def plan(var_list, shard_state):
    """Each variable's owning replica (`owners` by bytes), or None: not sharded (shard_state off,
    or one replica). Refused where an owner runs in another process."""
    if not shard_state or replicas() <= 1:
        return None
    owner = owners([v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in var_list], replicas())
    for r in sorted(set(owner)):
        local_device(tf.distribute.get_strategy(), r)
    return owner


def slot_scope(owner, index):
    """Where variable `index`'s slots are made: its owner's device alone (`owner` from `plan`),
    or where the stock class makes them (owner None)."""
    if owner is None:
        return contextlib.nullcontext()
    return on_device(local_device(tf.distribute.get_strategy(), owner[index]))


Share = collections.namedtuple("Share", ["rid", "owner", "own", "use_norm", "pass_norms"])
Share.__doc__ = """A replica's share of a sharded step: its id, the step's variables' owners, the
positions it owns, and the norm pass over every gradient (global norm, each gradient's norm)."""


def begin(grads, owner):
    """The replica's `Share` of a step over `grads` whose variables' owners are `owner` (None:
    not sharded, returns None): the norm of every gradient, the same bits on every replica."""
    if owner is None:
        return None
    rid = replica_id()
    if rid is None:
        raise ValueError("shard_state=True steps inside strategy.run (as model.fit does): in the "
                         "cross-replica context no replica owns a share")
    use_norm, pass_norms = _step.norm_pass(grads)
    return Share(rid, owner, [i for i, r in enumerate(owner) if r == rid], use_norm, pass_norms)


def finish(share, tvars, result, grad_scale=None, agc=False):
    """After the share's fused op (`result`, a `_step.StepResult`): every replica's updated
    variables into every copy (`gather`); returns (each gradient's norm, float32, from the norm
    pass; AGC's counts gathered from their owners, or None)."""
    norms = share.pass_norms
    if grad_scale is not None:
        norms = norms * _opcall.scalar(grad_scale, "grad_scale")
    units = None
    if agc and result.clipped_units is not None:
        mine = tf.unstack(tf.cast(result.clipped_units, tf.int32)) if share.own else []
        units = [tf.constant(0, tf.int32)] * len(tvars)
        for k, i in enumerate(share.own):
            units[i] = mine[k]
    with tf.control_dependencies([result.applied]):
        _, counts = gather([v.handle for v in tvars], [tf.as_dtype(v.dtype) for v in tvars],
                           [v.shape for v in tvars], share.owner, share.rid, extra=units)
    return tf.cast(norms, tf.float32), counts


def _bits(x):
    """x's bit pattern as a flat int32 vector (floats of 2, 4 or 8 bytes)."""
    width = _WIDTH.get(x.dtype.size)
    if width is None or not (x.dtype.is_floating or x.dtype.is_integer):
        raise ValueError(f"shard_state=True: cannot gather a variable of dtype {x.dtype.name}")
    b = x if x.dtype == width else tf.bitcast(x, width)
    if width == tf.int16:
        b = tf.cast(b, tf.int32)
    elif width == tf.int64:
        b = tf.bitcast(b, tf.int32)
    return tf.reshape(b, [-1])


def _from_bits(b, dtype, shape):
    width = _WIDTH[dtype.size]
    if width == tf.int16:
        b = tf.cast(b, tf.int16)
    elif width == tf.int64:
        b = tf.bitcast(tf.reshape(b, [-1, 2]), tf.int64)
    x = b if dtype == width else tf.bitcast(b, dtype)
    return tf.reshape(x, shape)


def _words(dtype, n):
    return n * (2 if dtype.size == 8 else 1)


def gather(handles, dtypes, shapes, owner, rid, extra=None):
    """After the owners' updates, every replica's copy of every variable holds the owner's bits.

    handles, dtypes, shapes: the variables (this replica's copies' handles), owner: each one's
    replica, rid: this replica's id. extra: int32 vectors, one per variable (its entry on the
    owner kept, the others' ignored), gathered beside the variables (AGC's counts); returns them
    in the variables' order as one int32 tensor (None without). One all-gather of int32 words
    (bit patterns: every bit kept, NaN payloads and -0.0 too), each replica sending its own
    variables', in index order."""
    ctx = tf.distribute.get_replica_context()
    n = ctx.num_replicas_in_sync
    mine = [i for i in range(len(handles)) if owner[i] == rid]
    parts = [_bits(tf.raw_ops.ReadVariableOp(resource=handles[i], dtype=dtypes[i])) for i in mine]
    if extra is not None:
        parts += [tf.reshape(tf.cast(extra[i], tf.int32), [1]) for i in mine]
    sent = tf.concat(parts, 0) if parts else tf.zeros([0], tf.int32)
    got = ctx.all_gather(sent, axis=0)
    # Where each replica's words sit in `got`: replica by replica, its variables in index order.
    sizes = [_words(dtypes[i], shapes[i].num_elements()) for i in range(len(handles))]
    offsets, at = {}, 0
    extra_at = {}
    for r in range(n):
        theirs = [i for i in range(len(handles)) if owner[i] == r]
        for i in theirs:
            offsets[i] = at
            at += sizes[i]
        if extra is not None:
            for i in theirs:
                extra_at[i] = at
                at += 1
    writes = []
    for i in range(len(handles)):
        if owner[i] != rid:
            value = _from_bits(got[offsets[i]:offsets[i] + sizes[i]], dtypes[i], shapes[i])
            writes.append(tf.raw_ops.AssignVariableOp(resource=handles[i], value=value))
    counts = None
    if extra is not None:
        counts = tf.stack([got[extra_at[i]] for i in range(len(handles))]) if handles else tf.zeros([0], tf.int32)
    return writes, counts
