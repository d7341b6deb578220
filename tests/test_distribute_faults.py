"""A worker that dies or hangs mid-step (issue 68, item 6): the other worker fails with TF's error
within its collective timeout instead of waiting forever, and the checkpoint written before the
fault resumes, sharded and unsharded, to the bits of the run that never stopped.

Two MultiWorkerMirroredStrategy worker processes on localhost per run (tests/harness/fault_check.py
says what each does): a `dead` run and a `hung` run side by side, then a `resume` run from both of
their checkpoints while the hung run waits out its timeout. About a minute, once per test run
(procs.py's shared_once)."""
import json
import os
import time

import numpy as np
import pytest

from procs import run_workers, shared_once, start_workers, stop, worker_tail

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "fault_check.py")
HUNG_TIMEOUT_S = 45.0  # (fault_check.py's)


def _wait_for(path, writer, timeout=300):
    """Until `path` exists (the marker `writer`, a worker, leaves), failing if that worker ends
    first or time runs out. (Only the writer's end counts: the dead run's worker 1 exits 3 s after
    the barrier the marker follows, and a loaded machine may delay the marker past that.)"""
    start = time.monotonic()
    while not os.path.exists(path):
        assert writer.poll() is None, f"worker 0 ended before {path} was written"
        assert time.monotonic() - start < timeout, f"no {path} after {timeout} s"
        time.sleep(0.5)


def _runs(folder):
    started = {}
    for mode in ("dead", "hung"):
        os.makedirs(folder / mode)
        started[mode] = start_workers(lambda i, mode=mode: [HARNESS, str(folder), mode], folder / mode)
    try:
        # The resume run needs only the checkpoints written before the faults: it runs while the
        # hung run waits out its timeout.
        for mode, procs in started.items():
            _wait_for(folder / f"{mode}_ck.written", procs[0])
        os.makedirs(folder / "resume")
        run_workers(lambda i: [HARNESS, str(folder), "resume"], folder / "resume", timeout=300)
        for mode, procs in started.items():
            # worker 0 ends on its own (the error, then its result); worker 1 is dead or asleep
            procs[0].wait(timeout=300)
            assert procs[0].returncode == 0, f"{mode}: worker 0 exited {procs[0].returncode}:\n" + \
                worker_tail(folder / mode, 0) + "\n--- worker 1:\n" + worker_tail(folder / mode, 1)
        assert started["dead"][1].wait(timeout=60) == 17, worker_tail(folder / "dead", 1)
        assert started["hung"][1].poll() is None  # (still asleep: nothing ended it but the test)
    finally:
        for procs in started.values():
            stop(procs)
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_once(tmp_path_factory, "faults", _runs)


def _result(runs, mode):
    with open(os.path.join(runs, f"{mode}_w0.json")) as f:
        return json.load(f)


def test_a_worker_that_dies_mid_step_fails_the_other_at_once(runs):
    """No collective timeout set (TF's default: none). Worker 1 exits 3 s into step 2, without a
    word to anyone; worker 0, waiting in step 2's all-reduce, gets TF's UnavailableError naming
    the lost task (the broken connection, or the coordination service's missed heartbeats)
    seconds later, not never."""
    got = _result(runs, "dead")
    assert got["error"] == "UnavailableError", got
    assert "task:1" in got["message"] and "Collective" in got["message"], got["message"]
    assert got["seconds"] < 60, got


def test_a_worker_that_hangs_mid_step_fails_the_other_at_the_collective_timeout(runs):
    """A hung worker keeps heartbeating, so only a timeout ends the wait: with
    CommunicationOptions(timeout_seconds=45), worker 0 gets TF's DeadlineExceededError from step 2's
    all-reduce 45 s in (the timeout, not much later)."""
    got = _result(runs, "hung")
    assert got["error"] == "DeadlineExceededError", got
    assert "Collective has timed out" in got["message"], got["message"]
    assert HUNG_TIMEOUT_S - 1 <= got["seconds"] < HUNG_TIMEOUT_S + 30, got
    # and the sharded optimizer's checkpoint broadcasts (tfclip's own collectives) wait as long
    assert got["exchange_timeout"] == HUNG_TIMEOUT_S
    assert _result(runs, "dead")["exchange_timeout"] == 0


@pytest.mark.parametrize("fault", ["dead", "hung"])
@pytest.mark.parametrize("model", ["sharded", "unsharded"])
def test_the_checkpoint_written_before_the_fault_resumes_to_the_uninterrupted_bits(runs, fault, model):
    """Two fresh workers restore the chief's checkpoint from before the fault (the sharded
    optimizer's slots broadcast into it by their owners) and take steps 2 and 3: every variable
    and every slot each worker keeps is bit for bit the run's that took steps 0 to 3 unbroken."""
    for i in range(2):
        r = np.load(os.path.join(runs, f"resume_w{i}.npz"))
        got, want = r[f"{fault}_{model}"], r[f"uninterrupted_{model}"]
        assert got.size == want.size > 0
        assert got.tobytes() == want.tobytes(), (i, int(np.sum(got != want)))
