"""TF's raw collectives across worker processes on CPUs, in pieces: the sharded step's
reduce-scatter and all-gather (tfclip/_engine/shard.py) and the unsharded step's all-reduce
(`all_reduce`), which every tfclip optimizer takes there instead of the strategy's one packed
all-reduce.

Why: under MultiWorkerMirroredStrategy on CPUs TF's collectives go over gRPC, one message per op,
and one message of BERT-base's 219 MB a replica is slow: on the 2-core EPYC Keras's packed
all-reduce of the gradients took 2,278 ms; an all-to-all of half of them in 64 pieces 510 ms and
an all-gather of half in 64 pieces 659 ms (`python benchmarks/collective_pieces.py --pieces
1,16,64`, 2026-12-05, benchmarks/results/shard-2026-12-05-scatter.txt; docs/distribute.md).
A ring all-reduce is a reduce-scatter and an all-gather; here the reduce-scatter is
`CollectiveAllToAllV2` (TF's `CollectiveReduceScatterV2` has only NCCL's implementation) and a
local sum of the N received parts in replica order: with 2 replicas `a + b`, the ring's bits
(addition commutes); with more a fixed order, the same every run, which may round differently
from the ring's.

Every collective here is in one group (`GROUP`, apart from the strategy's own keys and
shard.SlotExchange's); each replica counts its instances (`instance`), and every replica builds
the same collectives in the same order, as the strategy's own keys assume.
"""
import collections
import itertools

import tensorflow as tf

GROUP = 0x7F7D0000
# A collective moves its bytes in pieces of at most this many elements (BERT-base's half, 54.7M
# elements, in 27): in two runs on the 2-core EPYC (2026-12-05, benchmarks/results/
# shard-2026-12-05-scatter.txt) 16 and 64 pieces took 0.31-0.45x one piece's time, each within
# 20% of the other, the all-to-all and the all-gather alike.
PIECE = 1 << 21
_keys = collections.defaultdict(itertools.count)
reduce_count = 0  # all_reduce's calls in this process (tests/harness/sharded_check.py reads it)


def available(strategy):
    """Whether this module's collectives serve `strategy`: across worker processes
    (MultiWorkerMirroredStrategy with several workers: within one process nothing crosses a link),
    on CPUs (CollectiveAllToAllV2's only implementation; on GPUs NCCL's ops stay)."""
    from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended

    ext = strategy.extended
    if not (isinstance(ext, CollectiveAllReduceExtended) and ext._num_workers > 1):
        return False
    return all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in ext.worker_devices)


def in_step(grads):
    """Whether a step over `grads` inside `strategy.run` can take these collectives: `available`,
    outside XLA (XLA on CPUs compiles no collective), every gradient a dense tensor of a static
    size (IndexedSlices are all-gathered by TF, not summed)."""
    if not tf.distribute.has_strategy() or not available(tf.distribute.get_strategy()):
        return False
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.get_static_value(ctx.replica_id_in_sync_group) is None:
        return False
    from tfclip._engine import xla as _xla
    if _xla.in_context():
        return False
    return all(isinstance(g, tf.Tensor) and g.shape.num_elements() is not None for g in grads)


def timeout(strategy):
    """The strategy's collective timeout (CommunicationOptions.timeout_seconds; 0: none): a worker
    that dies or hangs fails the others' collectives with TF's DeadlineExceededError then."""
    return float(getattr(getattr(strategy.extended, "_communication_options", None), "timeout_seconds", None) or 0)


def pieces(width):
    """[(start, stop)]: `width` elements in about equal pieces of at most PIECE."""
    if width <= 0:
        return []
    k = -(-width // PIECE)
    step = -(-width // k)
    return [(a, min(a + step, width)) for a in range(0, width, step)]


def instance(rid):
    """The next collective instance key of replica `rid`."""
    return next(_keys[rid]) + 1


def _context():
    ctx = tf.distribute.get_replica_context()
    return ctx.num_replicas_in_sync, int(tf.get_static_value(ctx.replica_id_in_sync_group)), \
        timeout(tf.distribute.get_strategy())


class Flat:
    """Tensors of one dtype end to end in one flat vector of `length` elements (zeros after them),
    never made whole: `span(a, b)` makes elements [a, b) only, so a collective's pieces are made
    from the tensors directly (one copy) and a tensor within one piece is a slice of it."""

    def __init__(self, tensors, length, dtype, sizes=None):
        # sizes: each tensor's elements where its static shape may not say (else read from it)
        self.parts, at = [], 0  # (start, the tensor flat, its size)
        for k, t in enumerate(tensors):
            size = t.shape.num_elements() if sizes is None else sizes[k]
            if size:
                self.parts.append((at, tf.reshape(t, [-1]), size))
            at += size
        if at > length:
            raise ValueError(f"tfclip internal: {at} elements in a flat vector of {length}")
        self.length, self.dtype = length, dtype

    def span(self, a, b):
        out, at = [], a
        for start, t, size in self.parts:
            stop = start + size
            if stop <= a or start >= b:
                continue
            lo, hi = max(a, start), min(b, stop)
            if lo > at:
                out.append(tf.zeros([lo - at], self.dtype))
            out.append(t if (lo, hi) == (start, stop) else t[lo - start:hi - start])
            at = hi
        if at < b:
            out.append(tf.zeros([b - at], self.dtype))
        return out[0] if len(out) == 1 else tf.concat(out, 0) if out else tf.zeros([0], self.dtype)


def received(pieces, dtype):
    """A flat vector as a collective's pieces brought it ([(start, stop, tensor)], end to end from
    0): a `Flat` of the pieces, whose `span` is a piece itself where they are one."""
    return Flat([t for _, _, t in pieces], pieces[-1][1] if pieces else 0, dtype,
                sizes=[stop - start for start, stop, _ in pieces])


def sum_parts(part, width, dtype):
    """`part(r)`: a source of `width` elements (a `Flat`: this replica's contribution to replica
    r's sum); returns the sum (a `received` `Flat`) of every replica's part for this one, the N
    parts added in replica order. An all-to-all per piece."""
    n, rid, wait = _context()
    parts = [part(r) for r in range(n)]
    out = []
    for a, b in pieces(width):
        got = tf.raw_ops.CollectiveAllToAllV2(input=tf.stack([p.span(a, b) for p in parts]), group_size=n,
                                              group_key=GROUP, instance_key=instance(rid), ordering_token=[],
                                              timeout_seconds=wait)
        piece = got[0]
        for s in range(1, n):  # (in replica order)
            piece = piece + got[s]
        out.append((a, b, piece))
    return received(out, dtype)


def gather(sent, width):
    """sent: a source of `width` elements (a `Flat`), as wide on every replica;
    returns each replica's, a `received` `Flat` per replica in replica order. An all-gather per piece."""
    n, rid, wait = _context()
    dtype = sent.dtype
    out = [[] for _ in range(n)]
    for a, b in pieces(width):
        x = sent.span(a, b)
        if dtype == tf.bfloat16:  # (TF's gather has no bfloat16 kernel: its bits travel as float16's, copied)
            x = tf.bitcast(x, tf.float16)
        got = tf.raw_ops.CollectiveGatherV2(input=x, group_size=n, group_key=GROUP, instance_key=instance(rid),
                                            ordering_token=[], timeout_seconds=wait)
        if dtype == tf.bfloat16:
            got = tf.bitcast(got, tf.bfloat16)
        for r in range(n):
            out[r].append((a, b, got[r * (b - a):(r + 1) * (b - a)]))
    return [received(pieces_r, dtype) for pieces_r in out]


def all_reduce(grads):
    """Each gradient summed over every replica (dense tensors, `in_step`), as the strategy's
    all-reduce sums them: per dtype, the gradients flat and end to end, cut into N equal parts
    (the last zero-padded), part r summed on replica r (`sum_parts`), the sums all-gathered
    (`gather`). The same bytes on the link as a ring all-reduce, in pieces, and no copy of the
    whole: each piece made from the gradients, each sum cut from the pieces."""
    global reduce_count
    reduce_count += 1
    n = tf.distribute.get_replica_context().num_replicas_in_sync
    grads = list(grads)
    out = list(grads)
    for dtype in sorted({g.dtype for g in grads}, key=lambda d: d.name):
        which = [i for i, g in enumerate(grads) if g.dtype == dtype]
        sizes = [grads[i].shape.num_elements() for i in which]
        length = sum(sizes)
        if length == 0:
            continue
        width = -(-length // n)
        whole = Flat([grads[i] for i in which], n * width, dtype)
        mine = sum_parts(lambda r: _Window(whole, r * width), width, dtype)
        every = gather(mine, width)
        at = 0
        for i, size in zip(which, sizes):
            segments = []  # (elements [at, at + size) of the whole: replica r's part holds r * width on)
            for r in range(at // width, -(-(at + size) // width) if size else at // width):
                lo, hi = max(at, r * width), min(at + size, (r + 1) * width)
                segments.append(every[r].span(lo - r * width, hi - r * width))
            flat = segments[0] if len(segments) == 1 else tf.concat(segments, 0) if segments else tf.zeros([0], dtype)
            out[i] = tf.reshape(flat, grads[i].shape)
            at += size
    return out


class _Window:
    """Elements [start, start + width) of a `Flat`, as a source of its own."""

    def __init__(self, flat, start):
        self.flat, self.start, self.dtype = flat, start, flat.dtype

    def span(self, a, b):
        return self.flat.span(self.start + a, self.start + b)
