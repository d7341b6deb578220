"""Optimizer state sharded across replicas (ZeRO stage 1): `shard_state=True` on the Keras 3
drop-ins (tfclip/keras/_dropin.py) under a `tf.distribute` strategy with more than one replica.

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
  number of replicas. Across worker processes a slot owned elsewhere is a `RemoteSlot`, and the
  checkpoint gathers it from its owner (`SlotExchange`).

The drop-ins' part is small (tfclip/keras/_dropin.py, tfclip/tf_keras/_dropin.py): `plan` at build;
each slot made on its owner's device (`on_device`; tf_keras: `making_slots`) or as a `RemoteSlot`;
`begin` / `finish` around the fused step of the replica's share; `trackable_children` for
checkpoints. `tfclip.rules` (`fused_clip_apply`): `Rule.state_owners` (`owners`, as variables are
first seen), `on_device` or a `RemoteSlot` per slot, and `rule.variables` listing each slot's proxy
where an exchange exists, in tfclip/rules/_base.py; `begin` / `finish` in tfclip/_engine/replicated.py's `_sharded_step`.

Imports flow one way: the drop-ins, tfclip/rules/_base.py and tfclip/_engine/replicated.py import this module; it imports
tfclip/_engine/step.py, opcall.py and collectives.py (the raw collectives across worker processes).
"""
import collections
import contextlib
import itertools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import numpy_dataset

from tfclip import _loader
from tfclip._engine import collectives as _coll
from tfclip._engine import opcall as _opcall
from tfclip._engine import step as _step

# A bit pattern of each width as int32 (the all-gather's and the broadcast's one dtype); one-byte
# values (int8 state's codes) widened.
_WIDTH = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def replicas():
    """The replicas in sync of the strategy in scope (1 without one)."""
    return tf.distribute.get_strategy().num_replicas_in_sync if tf.distribute.has_strategy() else 1


def owners(nbytes, n, load=None):
    """Each variable's owning replica, for variables of `nbytes` bytes over `n` replicas: the
    largest first (ties: the first), each to the replica with the fewest bytes so far (ties: the
    lowest id). Deterministic: every replica and worker computes the same list. `load`: the
    bytes each replica owns already (a list, updated), for variables added later (tfclip.rules)."""
    load = [0] * n if load is None else load
    out = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += nbytes[i]
    return out


def local_device(strategy, replica, remote_ok=False):
    """The device of the replica with id `replica` in the sync group, where it is in this
    process; for another worker's replica None (remote_ok), else a ValueError."""
    devices = strategy.extended.worker_devices
    first = strategy.extended._get_replica_id_in_sync_group(0) if hasattr(
        strategy.extended, "_get_replica_id_in_sync_group") else 0
    local = replica - first
    if not 0 <= local < len(devices):
        if remote_ok:
            return None
        raise ValueError(
            f"shard_state=True: replica {replica} runs in another worker process; this optimizer "
            f"does not keep state across {type(strategy).__name__}'s processes (tfclip.keras's do; "
            "docs/distribute.md, Sharded optimizer state)")
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


def factored_weights(shapes):
    """Adafactor with factored_state: each variable's state elements per element (`plan`'s
    weights): a matrix (rank >= 2) keeps its row and column sums, a smaller variable its v."""
    out = []
    for shape in shapes:
        shape = [int(d) for d in shape]
        n = max(int(np.prod(shape)), 1)
        out.append(1.0 if len(shape) < 2 else (int(np.prod(shape[:-1])) + int(np.prod(shape[:-2])) * shape[-1]) / n)
    return out


def check(shard_state):
    """`shard_state` as an optimizer or a rule is given it: True or False, else a TypeError
    naming what it got (one check for every front door, as reduce.check for reduce_dtype)."""
    if not isinstance(shard_state, bool):
        raise TypeError(f"shard_state must be True or False, got {shard_state!r}")
    return shard_state


def across_processes(strategy):
    """Whether `strategy` runs replicas in more than one worker process (MultiWorkerMirroredStrategy
    with several workers): then every worker keeps a `SlotExchange`, whichever replicas its own
    variables' owners are, so that every worker's checkpoint makes the same broadcasts."""
    from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended

    ext = strategy.extended
    return isinstance(ext, CollectiveAllReduceExtended) and ext._num_workers > 1


def plan(var_list, shard_state, remote_ok=False, weights=None):
    """(each variable's owning replica (`owners` by bytes), the `SlotExchange` where some owner is
    in another worker process (else None)), or (None, None): not sharded (shard_state off, or one
    replica). An owner in another process is refused unless remote_ok (its slots are then
    `RemoteSlot`s here). weights: each variable's bytes counted that many times (its slots per
    byte, where they differ between variables: Muon's), else once."""
    if not shard_state or replicas() <= 1:
        return None, None
    strategy = tf.distribute.get_strategy()
    weights = weights or [1] * len(var_list)
    owner = owners([v.shape.num_elements() * tf.as_dtype(v.dtype).size * w for v, w in zip(var_list, weights)],
                   replicas())
    for r in sorted(set(owner)):
        local_device(strategy, r, remote_ok)  # (refuses an owner in another process unless remote_ok)
    return owner, SlotExchange(strategy) if across_processes(strategy) else None


def trackable_children(exchange, children, save_type):
    """An optimizer's trackable children as a checkpoint sees them: each sharded slot, where
    state is kept across worker processes, a proxy saving the owner's value (`SlotExchange`)."""
    return children if exchange is None or save_type != "checkpoint" else exchange.swap(children)


@contextlib.contextmanager
def making_slots(owner, device, exchange):
    """Variables made inside are slots of a variable owned by replica `owner`: on `device` alone,
    or, where the owner is in another worker process (device None), `RemoteSlot`s standing in
    for them; each kept by `exchange` (a `SlotExchange`, or None within one process). For the
    drop-ins whose stock build makes slots with tf.Variable (tf_keras's)."""
    def creator(next_creator, **kwargs):
        if device is None:
            value = kwargs.get("initial_value")
            value = tf.convert_to_tensor(value() if callable(value) else value, dtype=kwargs.get("dtype"))
            name = str(kwargs.get("name") or "slot")
            slot = RemoteSlot(value.shape, value.dtype, name, name, owner)
        else:
            kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
            slot = next_creator(**kwargs)
        if exchange is not None:
            exchange.add(slot, owner)
        return slot

    with tf.variable_creator_scope(creator):
        yield


class RemoteSlot(tf.__internal__.tracking.Trackable):
    """A slot whose owner is a replica in another worker process: its name, shape and dtype, no
    storage. In a checkpoint it stands where the stock slot stands and saves the owner's value
    (`SlotExchange`); restored, it keeps nothing (the owner restores the value)."""

    trainable = False

    def __init__(self, shape, dtype, name, path, owner):
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.name, self.path = name, path
        self.owner = owner

    def _message(self):
        return (f"the optimizer slot {self.path} is kept by replica {self.owner}, in another worker process "
                "(shard_state=True); a tf.train.Checkpoint saved by every worker gathers it")

    def numpy(self):
        raise ValueError(self._message())

    @property
    def value(self):
        raise ValueError(self._message())

    def __repr__(self):
        return f"<RemoteSlot {self.path} shape={self.shape} dtype={self.dtype.name} owner={self.owner}>"


class SlotExchange:
    """The checkpoint side of sharding across worker processes: every sharded slot, in build
    order, stands in the saved object graph as a `_SlotProxy`, which on save broadcasts the
    owner's value to every worker (one eager collective broadcast per slot, as bit patterns;
    every worker must save, as tf.distribute asks under MultiWorkerMirroredStrategy) and on
    restore lets the owner restore its slot. The layout is the stock one: the chief's file holds
    every slot's value under its stock key."""

    _GROUP_KEY = 0x7F7C0000  # (apart from the strategy's own collective group keys, small numbers)
    # One count for every exchange of the process (several optimizers and rules may save in one
    # checkpoint): each broadcast a fresh instance key, the same on every worker, which makes the
    # same broadcasts in the same order.
    _instances = itertools.count(1)

    def __init__(self, strategy):
        ext = strategy.extended
        self.device = ext.worker_devices[0]  # one device per worker takes part
        self.group_size = ext._num_workers
        self.local = len(ext.worker_devices)
        self.first = ext._get_replica_id_in_sync_group(0)
        # The strategy's collective timeout (CommunicationOptions.timeout_seconds; 0: none), as its
        # own all-reduces have it: a worker that hangs while a checkpoint is saved then fails the
        # others' broadcasts with TF's DeadlineExceededError instead of holding them forever.
        self.timeout = _coll.timeout(strategy)
        self.slots = []  # (slot: a variable or a RemoteSlot, owner replica)
        self.proxies = {}  # id(slot) -> _SlotProxy
        self.lists = {}  # (child name, its elements' ids) -> the list with proxies

    def add(self, slot, owner):
        if not any(s is slot for s, _ in self.slots):
            self.slots.append((slot, owner))

    def proxy(self, slot):
        if id(slot) not in self.proxies:
            owner = next((o for s, o in self.slots if s is slot), None)
            if owner is None:
                return slot
            self.proxies[id(slot)] = _SlotProxy(self, slot, owner)
        return self.proxies[id(slot)]

    def swap(self, children):
        """An optimizer's trackable children with every sharded slot (in lists too) a proxy."""
        from tensorflow.python.trackable import data_structures

        ids = {id(s) for s, _ in self.slots}
        out = {}
        for name, c in children.items():
            if isinstance(c, data_structures.ListWrapper) and any(id(x) in ids for x in c):
                # The same list object on every call while the list is unchanged (a checkpoint's
                # walk over the object graph finds each child by identity).
                key = (name, tuple(id(x) for x in c))
                if key not in self.lists:
                    self.lists[key] = data_structures.ListWrapper([self.proxy(x) if id(x) in ids else x for x in c])
                out[name] = self.lists[key]
            else:
                out[name] = self.proxy(c) if id(c) in ids else c
        return out

    def broadcast(self, value, owner, shape, dtype):
        """The owner's `value` on every worker (bit for bit)."""
        instance = next(SlotExchange._instances)
        words = _words(dtype, shape.num_elements())
        with tf.device(self.device):
            if (owner - self.first) in range(self.local):
                sent = _bits(value)
                tf.raw_ops.CollectiveBcastSendV2(input=sent, group_size=self.group_size, group_key=self._GROUP_KEY,
                                                 instance_key=instance, timeout_seconds=self.timeout)
                return value
            got = tf.raw_ops.CollectiveBcastRecvV2(group_size=self.group_size, group_key=self._GROUP_KEY,
                                                   instance_key=instance, shape=[words], T=tf.int32,
                                                   timeout_seconds=self.timeout)
            return _from_bits(got, dtype, shape)


class _SlotProxy(tf.__internal__.tracking.Trackable):
    """A sharded slot as a checkpoint sees it (`SlotExchange`); its other public attributes are
    the slot's own (`numpy()`, `name`, `shape`, ...: tfclip.rules lists these in `variables`)."""

    def __init__(self, exchange, slot, owner):
        self._exchange, self._slot, self._owner = exchange, slot, owner

    def __getattr__(self, name):
        if name.startswith("_"):  # (not the slot's: Trackable's own, looked up on the proxy)
            raise AttributeError(name)
        return getattr(self._slot, name)

    def __repr__(self):
        return f"<checkpoint proxy of {self._slot!r}>"

    def _serialize_to_tensors(self):
        slot = self._slot
        local = not isinstance(slot, RemoteSlot)
        value = None
        if local:  # (a keras.Variable's `value` is its tf.Variable; a tf.Variable's, a method)
            value = slot.value
            value = tf.identity(value() if callable(value) else value)
        return {"VARIABLE_VALUE": self._exchange.broadcast(value, self._owner, slot.shape, tf.as_dtype(slot.dtype))}

    def _restore_from_tensors(self, restored_tensors):
        if isinstance(self._slot, RemoteSlot):
            return tf.no_op()
        return self._slot._restore_from_tensors(restored_tensors)


# -- the reduce-scatter (across worker processes) ------------------------------------------

_SCATTERED = threading.local()
_CHUNK = 1 << 16  # (csrc/core/chunk_plan.h's kChunkElems: a tensor's chunks, from its first element)
scatter_count = 0  # reduce_scatter's calls in this process (tests/harness/sharded_check.py reads it)


def scatters(grads, owner):
    """Whether a sharded step over `grads` (owner: each one's replica, or None: not sharded)
    reduce-scatters its gradients instead of all-reducing them: across worker processes
    (MultiWorkerMirroredStrategy; within one process the all-reduce crosses no link), on CPUs
    (CollectiveAllToAllV2's implementation; on GPUs NCCL's all-reduce stays), every gradient a
    dense tensor (IndexedSlices are all-gathered by TF, not summed), outside XLA."""
    return owner is not None and _coll.in_step(grads)


def reduce_scatter(grads, owner):
    """Each replica's gradients summed on their owner only: `grads` (this replica's, dense) with
    the positions this replica owns replaced by the sum over every replica, the others as they
    were (the owner's step reads only its own). Per dtype, one all-to-all of N equal parts (part r:
    replica r's variables' gradients, flat, in index order, zero-padded to the largest part), then
    the N received parts added in replica order (two replicas: the all-reduce's bits; more: a fixed
    order, the same every run). Then the norm pass's chunk partials of the owned sums, all-gathered
    (a few KB) and added in the unsharded pass's order (`TfclipNormFromPartials`): every replica
    gets the unsharded step's global norm and each gradient's norm, bit for bit. Those wait in this
    thread for the step's `begin` (called through `scattered_step`)."""
    global scatter_count
    scatter_count += 1
    ctx = tf.distribute.get_replica_context()
    n, rid = ctx.num_replicas_in_sync, replica_id()
    grads = list(grads)
    sizes = [g.shape.num_elements() for g in grads]
    out = list(grads)
    for dtype in sorted({g.dtype for g in grads}, key=lambda d: d.name):
        parts = [[i for i in range(len(grads)) if owner[i] == r and grads[i].dtype == dtype] for r in range(n)]
        lengths = [sum(sizes[i] for i in part) for part in parts]
        width = max(lengths)
        if width == 0:
            continue
        mine = _coll.sum_parts(lambda r: _coll.Flat([grads[i] for i in parts[r]], width, dtype), width, dtype)
        at = 0
        for i in parts[rid]:
            out[i] = tf.reshape(mine.span(at, at + sizes[i]), grads[i].shape)
            at += sizes[i]
    mine = [i for i in range(len(grads)) if owner[i] == rid]
    ops = _loader.ops()
    sent = ops.tfclip_norm_partials(t=[out[i] for i in mine]) if mine else tf.zeros([0], tf.float64)
    got = ctx.all_gather(sent, axis=0)
    norm, norms = ops.tfclip_norm_from_partials(partials=tf.gather(got, partials_order(sizes, owner, n)), sizes=sizes)
    _SCATTERED.norms = (tuple(owner), tuple(sizes), norm, norms)
    return out


def partials_order(sizes, owner, n):
    """Where each chunk's partial of tensors of `sizes` elements sits in the owners' partials
    all-gathered (replica by replica, its tensors in index order, each one's chunks), in the norm
    pass's order (tensor by tensor): `TfclipNormFromPartials`'s input is the gathered ones at these."""
    chunks = [-(-s // _CHUNK) for s in sizes]
    first, at = {}, 0
    for r in range(n):
        for i in range(len(sizes)):
            if owner[i] == r:
                first[i] = at
                at += chunks[i]
    return [first[i] + c for i in range(len(sizes)) for c in range(chunks[i])]


def scattered_step(grads, owner, step):
    """`step(gradients)` given `reduce_scatter(grads, owner)`, whose norms wait in this thread for
    the step's `begin`; forgotten after it, so a step that failed before `begin` leaves none behind
    for the next. (Every front door's reduce-scattered step goes through here.)"""
    try:
        return step(reduce_scatter(grads, owner))
    finally:
        _SCATTERED.norms = None


Share = collections.namedtuple("Share", ["rid", "owner", "own", "use_norm", "pass_norms"])
Share.__doc__ = """A replica's share of a sharded step: its id, the step's variables' owners, the
positions it owns, and the norm pass over every gradient (global norm, each gradient's norm)."""


def begin(grads, owner, use_norm=None):
    """The replica's `Share` of a step over `grads` whose variables' owners are `owner` (None:
    not sharded, returns None): the norm of every gradient, the same bits on every replica; or,
    given `use_norm` (the same on every replica), that norm and no norm pass (each gradient's
    norm NaN, as the op reports it with use_norm); after `reduce_scatter` in this thread, its
    norms (the same bits as the norm pass)."""
    if owner is None:
        return None
    rid = replica_id()
    if rid is None:
        raise ValueError("shard_state=True steps inside strategy.run (as model.fit does): in the "
                         "cross-replica context no replica owns a share")
    scattered = getattr(_SCATTERED, "norms", None)
    if scattered is not None:  # (the norms of this step's `reduce_scatter`, in this thread)
        _SCATTERED.norms = None
        if scattered[:2] != (tuple(owner), tuple(g.shape.num_elements() for g in grads)) or use_norm is not None:
            raise RuntimeError("tfclip internal: a reduce-scattered step's norms met another step")
        use_norm, pass_norms = scattered[2], scattered[3]
    elif use_norm is None:
        use_norm, pass_norms = _step.norm_pass(grads)
    else:
        pass_norms = tf.fill([len(grads)], tf.constant(float("nan"), tf.float64))
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
        counts, writes = gather([v.handle for v in tvars], [tf.as_dtype(v.dtype) for v in tvars],
                                [v.shape for v in tvars], share.owner, share.rid, extra=units)
    with tf.control_dependencies(writes):  # (in a TF1 graph, fetching the norms runs the writes)
        return tf.cast(norms, tf.float32), counts


def _bits(x):
    """x's bit pattern as a flat int32 vector (floats of 2, 4 or 8 bytes)."""
    width = _WIDTH.get(x.dtype.size)
    if width is None or not (x.dtype.is_floating or x.dtype.is_integer):
        raise ValueError(f"shard_state=True: cannot gather a variable of dtype {x.dtype.name}")
    if width == tf.uint8:
        return tf.reshape(tf.cast(tf.bitcast(x, tf.uint8) if x.dtype != tf.uint8 else x, tf.int32), [-1])
    b = x if x.dtype == width else tf.bitcast(x, width)
    if width == tf.int16:
        b = tf.cast(b, tf.int32)
    elif width == tf.int64:
        b = tf.bitcast(b, tf.int32)
    return tf.reshape(b, [-1])


def _from_bits(b, dtype, shape):
    width = _WIDTH[dtype.size]
    if width == tf.uint8:
        b = tf.cast(b, tf.uint8)
        return tf.reshape(b if dtype == tf.uint8 else tf.bitcast(b, dtype), shape)
    if width == tf.int16:
        b = tf.cast(b, tf.int16)
    elif width == tf.int64:
        b = tf.bitcast(tf.reshape(b, [-1, 2]), tf.int64)
    x = b if dtype == width else tf.bitcast(b, dtype)
    return tf.reshape(x, shape)


def _words(dtype, n):
    return n * (2 if dtype.size == 8 else 1)  # (one int32 word per element of 1, 2 or 4 bytes)


def gather(handles, dtypes, shapes, owner, rid, extra=None):
    """After the owners' updates, every replica's copy of every variable holds the owner's bits.

    handles, dtypes, shapes: the variables (this replica's copies' handles), owner: each one's
    replica, rid: this replica's id. extra: int32 vectors, one per variable (its entry on the
    owner kept, the others' ignored), gathered beside the variables (AGC's counts); returns them
    in the variables' order as one int32 tensor (None without), and the writes (ops; in a graph,
    what a consumer must depend on). An all-gather of int32 words (bit patterns: every bit
    kept, NaN payloads and -0.0 too), each replica sending its own variables', in index order:
    across worker processes on CPUs, TF's raw all-gather in pieces (tfclip/_engine/collectives.py)
    of equal width, each replica's words zero-padded to the widest; else the replica context's."""
    ctx = tf.distribute.get_replica_context()
    n = ctx.num_replicas_in_sync
    mine = [i for i in range(len(handles)) if owner[i] == rid]
    parts = [_bits(tf.raw_ops.ReadVariableOp(resource=handles[i], dtype=dtypes[i])) for i in mine]
    if extra is not None:
        parts += [tf.reshape(tf.cast(extra[i], tf.int32), [1]) for i in mine]
    sizes = [_words(dtypes[i], shapes[i].num_elements()) for i in range(len(handles))]
    lengths = [sum(sizes[i] for i in range(len(handles)) if owner[i] == r) + (0 if extra is None else owner.count(r))
               for r in range(n)]
    if _coll.available(tf.distribute.get_strategy()):
        width = max(lengths)  # (each replica's words zero-padded to the widest)
        own = [sizes[i] for i in mine] + ([1] * len(mine) if extra is not None else [])
        every = _coll.gather(_coll.Flat(parts, width, tf.int32, sizes=own), width)

        def words(r, a, b):
            return every[r].span(a, b)
    else:
        got = ctx.all_gather(tf.concat(parts, 0) if parts else tf.zeros([0], tf.int32), axis=0)

        def words(r, a, b):
            start = sum(lengths[:r])
            return got[start + a:start + b]
    # Where each variable's words sit among its owner's: its variables in index order, then the extras.
    offsets, extra_at = {}, {}
    for r in range(n):
        theirs = [i for i in range(len(handles)) if owner[i] == r]
        at = 0
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
            value = _from_bits(words(owner[i], offsets[i], offsets[i] + sizes[i]), dtypes[i], shapes[i])
            writes.append(tf.raw_ops.AssignVariableOp(resource=handles[i], value=value))
    counts = None
    if extra is not None:
        counts = tf.concat([words(owner[i], extra_at[i], extra_at[i] + 1) for i in range(len(handles))], 0) \
            if handles else tf.zeros([0], tf.int32)
    return counts, [w for w in writes if w is not None]
