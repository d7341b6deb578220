"""How a CUDA step's chunks become blocks, and that every kind of block computes what the CPU does.

A chunk of at most cuda_warp_chunk_elems elements is summed and applied by one warp, and up to
cuda_warps_per_block such chunks share a block; a larger chunk has a block to itself. Before this,
blocks were filled to cuda_chunk_elems elements, so 10,000 tensors of a few elements were two
blocks, each paying a 512-thread reduction per chunk, one chunk after another.

No TensorFlow. In CI on the emulated build (scripts/cuda_emulation.sh), on a GPU host on the device.
"""
import numpy as np
import pytest

from gpu_arrays import assert_same_bits, core, full, to_dev, to_host

CHUNK = core.cuda_chunk_elems
WARP = core.cuda_warp_chunk_elems
PER_BLOCK = core.cuda_warps_per_block


@pytest.fixture
def rng():
    return np.random.default_rng(23)


def rand(rng, n, dtype=np.float32):
    return np.asarray(rng.normal(size=n), dtype=dtype)


def np_norms(ts):
    return np.array([np.sqrt(np.sum(np.asarray(t, np.float64) ** 2)) for t in ts])


def packed_blocks(sizes):
    """The packing rule from the sizes alone: each tensor in chunks of CHUNK; a chunk over WARP
    elements is a block; the others go PER_BLOCK to a block in list order, and a large chunk
    closes the open block."""
    blocks, open_ = 0, 0
    for n in sizes:
        for b in range(0, n, CHUNK):
            if min(b + CHUNK, n) - b > WARP:
                blocks += 1 + (open_ > 0)
                open_ = 0
            else:
                open_ += 1
                if open_ == PER_BLOCK:
                    blocks, open_ = blocks + 1, 0
    return blocks + (open_ > 0)


def test_the_constants():
    assert PER_BLOCK == 16 and WARP == 2048 and CHUNK == 32768
    assert WARP * PER_BLOCK <= CHUNK  # a block of small chunks holds no more than one large chunk


@pytest.mark.parametrize("sizes,blocks", [
    ([WARP + 1], 1),
    ([WARP] * 16, 1),
    ([WARP] * 17, 2),
    ([5, WARP + 1, 5], 3),         # a large chunk closes the open block of small ones
    ([CHUNK + 3], 2),              # the 3-element tail is a small chunk of its own
    ([3 * CHUNK], 3),
    ([0, 0, 1], 1),                # empty tensors have no chunk
    ([i % 7 + 1 for i in range(10_000)], 625),
])
def test_block_counts(rng, sizes, blocks):
    assert packed_blocks(sizes) == blocks
    ts = [rand(rng, n) for n in sizes]
    norm = core.cuda_global_norm([to_dev(t) for t in ts])
    assert core.cuda_last_blocks() == blocks
    np.testing.assert_allclose(norm, np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in ts)),
                               rtol=1e-12)


# Chunk sizes on both sides of the warp limit, in packs of small ones and between large ones.
BOUNDARY = [WARP - 1, WARP, WARP + 1, 1, 2 * WARP, 3, CHUNK + WARP, CHUNK + WARP + 1, 13] + \
           [i % 37 + 1 for i in range(40)] + [WARP] * 3


def test_boundary_sizes_global_norm_and_clip(rng):
    ts = [rand(rng, n) for n in BOUNDARY]
    out = full((len(ts),), np.nan, np.float64)
    norm = core.cuda_global_norm([to_dev(t) for t in ts], tensor_norms_out=out)
    assert core.cuda_last_blocks() == packed_blocks(BOUNDARY)
    np.testing.assert_allclose(to_host(out, np.float64), np_norms(ts), rtol=1e-12, atol=0)
    np.testing.assert_allclose(norm, np.sqrt(np.sum(np_norms(ts) ** 2)), rtol=1e-12)
    # The scale pass over the same blocks: every element of every kind of block is written.
    outs = [to_dev(np.full_like(t, np.nan)) for t in ts]
    core.cuda_clip_by_global_norm([to_dev(t) for t in ts], outs, 1.0)
    cpu = core.clip_by_global_norm(ts, 1.0)[0]
    for got, want in zip(outs, cpu):
        np.testing.assert_allclose(to_host(got, np.float32), want, rtol=2.4e-7 * 2, atol=0)


@pytest.mark.parametrize("rule,nslots,hp", [
    ("adam", 2, {"learning_rate": 1e-2, "step": 1}),
    ("momentum", 1, {"learning_rate": 1e-2, "momentum": 0.9}),
    ("lamb", 2, {"learning_rate": 1e-2, "step": 3, "weight_decay": 0.01}),  # per-chunk sums too
])
@pytest.mark.parametrize("mode,clip", [("none", 0.0), ("global_norm", 1.0), ("norm", 0.3)])
def test_boundary_sizes_apply(rng, rule, nslots, hp, mode, clip):
    grads = [rand(rng, n) for n in BOUNDARY]
    vs = [rand(rng, n) for n in BOUNDARY]
    slots = [[np.abs(rand(rng, n)) * 0.1 for n in BOUNDARY] for _ in range(nslots)]
    dv = [to_dev(v) for v in vs]
    ds = [[to_dev(s) for s in sl] for sl in slots]
    rg = core.cuda_clip_apply(rule, dv, [to_dev(g) for g in grads], ds, hp, mode, clip)
    assert core.cuda_last_blocks() == packed_blocks(BOUNDARY)
    rc = core.clip_apply(rule, vs, grads, slots, hp, mode, clip)
    np.testing.assert_allclose(rg[0], rc[0], rtol=1e-12)
    exact = mode == "none" and rule != "lamb"  # no norm in the update: the CPU's bits
    for got, want in zip([*dv, *[s for sl in ds for s in sl]], [*vs, *[s for sl in slots for s in sl]]):
        g = to_host(got, np.float32)
        if exact:
            assert_same_bits(g, want)
        else:
            np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [7, 1000, WARP, WARP + 1, CHUNK + 100, 32 * CHUNK + 1])
def test_a_tensors_norm_bits_do_not_depend_on_its_neighbours(rng, size):
    """Which threads sum a chunk, and in what order, follows from the chunk's size alone, never
    from which block it was packed into: the same values give the same per-tensor norm bits
    alone, first or last in a pack, and between large tensors."""
    x = rand(rng, size)
    lists = [[], [rand(rng, 5)], [rand(rng, 3) for _ in range(15)], [rand(rng, CHUNK + 1)],
             [rand(rng, WARP) for _ in range(31)]]
    want = None
    for before in lists:
        for after in ([], [rand(rng, 9)], [rand(rng, 3 * WARP)]):
            ts = [*before, x, *after]
            out = full((len(ts),), np.nan, np.float64)
            core.cuda_global_norm([to_dev(t) for t in ts], tensor_norms_out=out)
            got = to_host(out, np.float64)[len(before)].tobytes()
            want = got if want is None else want
            assert got == want, (len(before), len(after))
    np.testing.assert_allclose(np.frombuffer(want, np.float64)[0], np_norms([x])[0], rtol=1e-12)


@pytest.mark.parametrize("mode,clip", [("norm", 0.3), ("global_norm", 1.0)])
def test_tensors_of_many_chunks(rng, mode, clip):
    """The finalize kernel sums a tensor's chunk partials in one thread up to 32 chunks and with
    a warp beyond (an embedding has hundreds): per-tensor norms and clipnorm's factors against
    the CPU and NumPy on both sides of that line, beside small tensors."""
    sizes = [32 * CHUNK, 32 * CHUNK + 1, 70 * CHUNK + 11, 5, 3 * WARP]
    grads = [rand(rng, n) for n in sizes]
    vs = [rand(rng, n) for n in sizes]
    m = [np.zeros(n, np.float32) for n in sizes]
    dv, dm = [to_dev(v) for v in vs], [to_dev(x) for x in m]
    out = full((len(sizes),), np.nan, np.float64)
    hp = {"learning_rate": 0.1, "momentum": 0.9}
    core.cuda_clip_apply("keras_momentum", dv, [to_dev(g) for g in grads], [dm], hp, mode, clip,
                         tensor_norms_out=out)
    np.testing.assert_allclose(to_host(out, np.float64), np_norms(grads), rtol=1e-12, atol=0)
    core.clip_apply("keras_momentum", vs, grads, [m], hp, mode, clip)
    for got, want in zip([*dv, *dm], [*vs, *m]):
        np.testing.assert_allclose(to_host(got, np.float32), want, rtol=1e-6, atol=1e-7)
