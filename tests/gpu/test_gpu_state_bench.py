"""benchmarks/gpu_state_bench.py (issue 47's GPU figures for bfloat16 and int8 state) proven on
this host before a lease spends device time on it: its whole run on the tiny set, through the
same array backend and _core as on the GPU (the emulated build in CI). The script checks each
state's first two steps against the core's CPU steps, bit for bit, before it times anything; a planted fault
in the int8 quantization (TFCLIP_PLANT=Q8_CODE, Q8_WARP_MAX) fails that check."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import gpu_state_bench  # noqa: E402


def test_state_bench_runs_and_checks_every_state(capsys):
    gpu_state_bench.main(["--sets", "tiny", "--rules", "adam,sgdm", "--iters", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    assert [(r[1], r[2]) for r in rows] == [(rule, s) for rule in ("adam", "sgdm")
                                            for s in ("float32", "bfloat16", "int8")]
    for r in rows:
        assert r[-1] == "yes"
        assert float(r[5]) > 0  # ms per step
    # The same launches a step whatever the state's dtype (the narrow state is converted inside
    # the apply kernel, not by kernels of its own).
    assert len({int(r[-2]) for r in rows}) == 1 and int(rows[0][-2]) > 0
    # The floor's bytes per parameter: Adam 32 / 24 / 20 + 2 x 2 x 4/256 (absmax), SGD momentum
    # 24 / 20 / 18 + 2 x 4/256.
    assert [float(r[9]) for r in rows] == pytest.approx([32, 24, 20 + 16 / 256, 24, 20, 18 + 8 / 256], abs=0.006)


def test_state_bench_refuses_an_unknown_state(capsys):
    with pytest.raises(SystemExit):
        gpu_state_bench.main(["--sets", "tiny", "--states", "float32,fp8"])
    assert "'fp8' is not one of float32, bfloat16, int8" in capsys.readouterr().err
