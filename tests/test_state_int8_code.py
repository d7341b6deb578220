"""8-bit blockwise dynamic quantization, the core's definition (csrc/core/quant8.h; issue 47's int8
optimizer state), against NumPy float64 references written here from the paper (Dettmers et al.,
"8-bit Optimizers via Block-wise Quantization", ICLR 2022) and bitsandbytes' create_dynamic_map:
the code, the bytes and absmax of every block, and the dequantized values, bit for bit."""
import numpy as np
import pytest

from reference import quantize_blockwise as reference_quantize
from reference import dynamic_code as reference_code
from reference import dequantize_blockwise as reference_dequantize
from tfclip import _core


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("signed", [True, False])
def test_code_is_the_papers_dynamic_code(signed):
    code = _core.dynamic_code(signed)
    _same_bits(code, reference_code(signed))
    # 1 is in the code, -1 is not (bitsandbytes': the signed code's lowest value is the
    # negated largest midpoint); the unsigned code starts at 0.
    assert code[0] == (-code[-2] if signed else 0.0)
    assert code[-1] == 1.0 and 0.0 in code and np.all(np.diff(code) > 0)
    # The smallest nonzero magnitude is the first exponent's first midpoint times 10^-6 (0.55
    # signed, one interval; 0.325 unsigned, two): seven decades of dynamic range, as the paper's.
    assert np.min(np.abs(code[code != 0])) == np.float32((0.55 if signed else 0.325) * 1e-6)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [256, 64, 7])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_quantize_and_dequantize_against_numpy(rng, signed, block, n):
    x = rng.normal(size=n).astype(np.float32) * np.float32(10.0 ** rng.uniform(-8, 2))
    if not signed:
        x = x * x  # second moments: >= 0
    q, absmax = _core.quantize_blockwise(x, signed, block)
    rq, rabsmax = reference_quantize(x, signed, block)
    _same_bits(q, rq)
    _same_bits(absmax, rabsmax)
    out = _core.dequantize_blockwise(q, absmax, signed, block)
    code = reference_code(signed)
    _same_bits(out, (code[rq] * np.repeat(rabsmax, block)[:n]).astype(np.float32))
    # Each value is within half the widest gap of the code around it, times its block's absmax:
    # 0.1 * 10^0 / 2 / 2^k at the top decade, the largest error the code allows.
    err = np.abs(out.astype(np.float64) - x) / np.repeat(absmax, block)[:n]
    gaps = np.diff(code.astype(np.float64))
    assert np.all(err <= gaps.max() / 2 + 1e-7)
    # A block's largest element, when positive, is exact (it maps to 1).
    for k in range(absmax.size):
        i = k * block + int(np.argmax(np.abs(x[k * block:(k + 1) * block])))
        if x[i] > 0:
            assert out[i] == x[i], (out[i], x[i])


def test_ties_go_to_the_lower_index():
    """An input exactly halfway between two code values (in float32) takes the lower one."""
    code = _core.dynamic_code(True).astype(np.float64)
    ties = [k for k in range(255)
            if np.float64(np.float32((code[k] + code[k + 1]) / 2)) == (code[k] + code[k + 1]) / 2]
    assert len(ties) > 10
    mids = np.array([(code[k] + code[k + 1]) / 2 for k in ties] + [1.0], np.float32)
    q, absmax = _core.quantize_blockwise(mids, True)
    assert absmax[0] == 1.0
    np.testing.assert_array_equal(q[:-1], ties)


def test_zero_and_non_finite_blocks():
    x = np.zeros(300, np.float32)
    x[260] = np.inf
    q, absmax = _core.quantize_blockwise(x, True, 256)
    assert absmax[0] == 0.0 and np.isnan(absmax[1])
    out = _core.dequantize_blockwise(q, absmax, True, 256)
    assert np.all(out[:256] == 0.0) and np.all(np.isnan(out[256:]))


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        _core.quantize_blockwise(np.ones(3, np.float32), True, 0)
    q, absmax = _core.quantize_blockwise(np.ones(300, np.float32), True, 256)
    with pytest.raises(ValueError, match=r"absmax must hold one value per block of 256 elements: 2 for 300"):
        _core.dequantize_blockwise(q, absmax[:1], True, 256)


def test_zero_index_is_the_cores_constant():
    """QuantZeroIndex (quant8.h), which the passes use in place of a search: the index of 0 is
    127 in the signed code (127 negative values below it) and 0 in the unsigned one."""
    assert int(np.flatnonzero(reference_code(True) == 0)[0]) == 127
    assert int(np.flatnonzero(reference_code(False) == 0)[0]) == 0
    for signed, zero in [(True, 127), (False, 0)]:
        q, absmax = _core.quantize_blockwise(np.zeros(5, np.float32), signed)
        assert absmax[0] == 0.0 and np.all(q == zero)


@pytest.mark.parametrize("signed", [True, False])
def test_every_instruction_set_variant_rounds_at_the_same_points(signed):
    """The int8 state's block (256) runs the active CPU variant's tiles (csrc/core/cpu/pass_state_tiles.cc:
    a bucket walk element by element, the code's formula on 8 AVX2 lanes, or AVX-512's in-register search
    tree). Every code value,
    every midpoint between neighbours and the floats a few ulps either side of it (where the
    nearest code flips), 0 and -0, in blocks whose absmax is 1 (so the quotient is the value
    itself): each variant this machine runs gives the NumPy reference's bytes, and its
    dequantized values, bit for bit."""
    code = reference_code(signed).astype(np.float64)
    mids = np.float32((code[:-1] + code[1:]) / 2)
    near = [mids]
    for k in (1, 2, 3):
        up, down = mids.copy(), mids.copy()
        for _ in range(k):
            up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        near += [up, down]
    values = np.concatenate(near + [code.astype(np.float32), np.float32([0.0, -0.0])])
    if not signed:
        values = values[values >= 0]
    values = np.random.default_rng(7).permutation(values)
    # Blocks of 255 values and a 1.0 (each block's absmax), the last one short.
    blocks = [np.append(values[b:b + 255], np.float32(1.0)) for b in range(0, values.size, 255)]
    x = np.concatenate(blocks).astype(np.float32)
    assert x.size % 256 != 0 and x.size > 2000
    rq, rabsmax = reference_quantize(x, signed, 256)
    assert np.all(rabsmax == 1.0)
    old = _core.cpu_isa()
    try:
        for isa in _core.cpu_isas():
            _core.set_cpu_isa(isa)
            q, absmax = _core.quantize_blockwise(x, signed, 256)
            np.testing.assert_array_equal(q, rq, err_msg=isa)
            _same_bits(absmax, rabsmax)
            _same_bits(_core.dequantize_blockwise(q, absmax, signed, 256),
                       reference_dequantize(rq, rabsmax, signed, 256))
            # A NaN quotient takes the code's 0 (the block's absmax is NaN then, too).
            nan_block = x[:256].copy()
            nan_block[5] = np.nan
            q, absmax = _core.quantize_blockwise(nan_block, signed, 256)
            assert np.isnan(absmax[0]) and np.all(q == (127 if signed else 0)), isa
    finally:
        _core.set_cpu_isa(old)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("isa", _core.cpu_isas())
def test_every_float_in_the_range_quantizes_as_the_search(signed, isa):
    """The proof that the code's formula (quant8.h, NearestCodeFormula; issue 69) is the
    definition: every float32 in [-1, 1], about 2^31 of them (the quotients x / absmax that int8
    state quantizes, signed zeros included), through this variant's tiles in blocks whose absmax
    is 1, against the count of the code's flips at or below it (the definition's index for every
    float, the search being monotone), and every 4099th float, each flip and the float below each
    flip against the binary search over the code itself (Q8SweepCode). The baseline case also
    sweeps NearestCodeFormula, the exact test that the CUDA kernel runs on every element and the
    AVX2 tiles on the lanes near a midpoint. 10-40 s a case."""
    old = _core.cpu_isa()
    try:
        _core.set_cpu_isa(isa)
        checked, bad, first_bad = _core.q8_code_sweep(signed, 1, formula=isa == "baseline")
    finally:
        _core.set_cpu_isa(old)
    # 2 * (127 * 2^23) + 2 floats: both signs' binades from 2^-126 up to 1 (and the subnormals
    # and zeros below them), 1.0 itself.
    assert checked == 2 * (127 << 23) + 2, checked
    assert bad == 0, f"{bad} floats differ from the search, the first {first_bad!r} ({isa})"


def test_the_sweep_strides_and_refuses_a_bad_stride():
    checked, bad, first_bad = _core.q8_code_sweep(True, 1 << 20)
    assert 2000 < checked < 2100 and bad == 0 and np.isnan(first_bad)
    with pytest.raises(ValueError, match="stride must be >= 1, got 0"):
        _core.q8_code_sweep(True, 0)
