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

Imports flow one way: tfclip/_keras_step.py imports this module; it imports only TensorFlow.
"""
import contextlib

import tensorflow as tf
from tensorflow.python.distribute import numpy_dataset

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
