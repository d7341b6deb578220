"""The norm pass split across owners (sharded state's reduce-scatter, tfclip/_engine/shard.py):
`TfclipNormPartials` gives each chunk's sum of squares of a list, `TfclipNormFromPartials` adds a
whole list's partials in the norm pass's order. Owners that each hold some of the tensors, their
partials put back in list order, must give TfclipGlobalNorm's global norm and per-tensor norms bit
for bit (the sharded step's promise), and both must agree with NumPy float64 to rounding. The
two-process step that uses them is in tests/test_distribute_shard.py.
"""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfclip import _loader
from tfclip._engine import collectives
from tfclip._engine import shard as _shard

CHUNK = 1 << 16  # (csrc/core/chunk_plan.h's kChunkElems)
SIZES = [(300, 500), (7,), (0,), (CHUNK,), (2 * CHUNK + 1,), (), (17, 5)]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.float32, np.float16]


def _grads(seed=0, nan_at=None):
    rng = np.random.default_rng(seed)
    out = [tf.constant(rng.normal(size=s).astype(d)) for s, d in zip(SIZES, DTYPES)]
    if nan_at is not None:
        x = out[nan_at].numpy().reshape(-1)
        x[-1] = np.nan
        out[nan_at] = tf.constant(x.reshape(SIZES[nan_at]))
    return out


def _chunks(n):
    return -(-n // CHUNK)


def _split_and_combine(grads, owner, owners):
    """Each owner's partials of its own tensors (index order), concatenated owner by owner, then
    put back in list order and added: what the sharded step does across replicas."""
    ops = _loader.ops()
    sizes = [int(np.prod(g.shape)) for g in grads]
    got = []
    for r in range(owners):
        mine = [i for i in range(len(grads)) if owner[i] == r]
        if mine:
            got.append(ops.tfclip_norm_partials(t=[grads[i] for i in mine]))
    order = _shard.partials_order(sizes, owner, owners)
    return ops.tfclip_norm_from_partials(partials=tf.gather(tf.concat(got, 0), order), sizes=sizes)


@pytest.mark.parametrize("owner", [[0] * 7, [0, 1, 0, 1, 1, 0, 1], [2, 0, 1, 2, 0, 1, 0], [1, 1, 1, 0, 1, 1, 1]])
def test_owners_partials_give_the_norm_pass_bits(owner):
    grads = _grads()
    want_norm, want_norms = _loader.ops().tfclip_global_norm(t=grads, Tnorm=tf.float64)
    norm, norms = _split_and_combine(grads, owner, max(owner) + 1)
    assert norm.numpy().tobytes() == want_norm.numpy().tobytes()
    assert norms.numpy().tobytes() == want_norms.numpy().tobytes()
    ref = [np.sqrt(np.sum(np.asarray(g.numpy(), np.float64) ** 2)) for g in grads]
    np.testing.assert_allclose(norms.numpy(), ref, rtol=1e-12)
    np.testing.assert_allclose(norm.numpy(), np.sqrt(np.sum(np.square(ref))), rtol=1e-12)


def test_the_partials_order_by_hand():
    # sizes 70000 (2 chunks), 5 (1), 0 (none), 65536 (1); owners 1, 0, 0, 1: replica 0 sends
    # tensor 1's chunk, replica 1 tensor 0's two and tensor 3's one
    assert _shard.partials_order([70000, 5, 0, CHUNK], [1, 0, 0, 1], 2) == [1, 2, 0, 3]
    assert _shard.partials_order([], [], 2) == []
    assert collectives.pieces(0) == [] and collectives.pieces(5) == [(0, 5)]
    assert collectives.pieces(2 * collectives.PIECE + 1) == [(0, 1398102), (1398102, 2796204), (2796204, 4194305)]


def test_a_partial_is_a_chunks_sum_of_squares():
    grads = _grads(1)
    p = _loader.ops().tfclip_norm_partials(t=grads).numpy()
    want = []
    for g in grads:
        flat = np.asarray(g.numpy(), np.float64).reshape(-1)
        want += [np.sum(flat[b:b + CHUNK] ** 2) for b in range(0, flat.size, CHUNK)]
    assert p.shape == (len(want),) == (sum(_chunks(int(np.prod(s))) for s in SIZES),)
    np.testing.assert_allclose(p, want, rtol=1e-12)


def test_a_nonfinite_gradient_makes_the_norm_nonfinite_on_every_owner():
    grads = _grads(2, nan_at=4)
    norm, norms = _split_and_combine(grads, [0, 1, 0, 1, 1, 0, 1], 2)
    assert np.isnan(norm.numpy()) and np.isnan(norms.numpy()[4])
    assert np.isfinite(np.delete(norms.numpy(), 4)).all()


def test_partials_that_do_not_fit_the_sizes_are_refused():
    ops = _loader.ops()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"partials has shape \[3\]; the sizes' 2 chunks need \[2\]"):
        ops.tfclip_norm_from_partials(partials=tf.zeros([3], tf.float64), sizes=[5, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"sizes\[1\] is -4, below 0"):
        ops.tfclip_norm_from_partials(partials=tf.zeros([1], tf.float64), sizes=[5, -4])


def test_a_flat_vector_and_its_received_pieces_give_every_span():
    # (tfclip/_engine/collectives.py: a collective's pieces made from the tensors, its results cut
    # from the pieces; every span of both against NumPy's concatenation, zero-padded)
    tensors = [np.arange(6, dtype=np.float32).reshape(2, 3) + 1, np.zeros([0], np.float32),
               np.arange(5, dtype=np.float32) + 10, np.array([7.5], np.float32)]
    whole = np.concatenate([t.ravel() for t in tensors] + [np.zeros(4, np.float32)])
    flat = collectives.Flat([tf.constant(t) for t in tensors], whole.size, tf.float32)
    cuts = [(0, 3), (3, 5), (5, 9), (9, whole.size)]
    received = collectives.received([(a, b, tf.constant(whole[a:b])) for a, b in cuts], tf.float32)
    for a in range(whole.size + 1):
        for b in range(a, whole.size + 1):
            assert flat.span(a, b).numpy().tolist() == whole[a:b].tolist(), (a, b)
            assert received.span(a, b).numpy().tolist() == whole[a:b].tolist(), (a, b)
    with pytest.raises(ValueError, match="16 elements in a flat vector of 15"):
        collectives.Flat([tf.zeros([16])], 15, tf.float32)
