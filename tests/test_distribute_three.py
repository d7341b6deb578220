"""Three worker processes (tests/harness/three_workers.py): past two replicas the order of a sum
matters. tfclip adds the replicas' parts in replica order (tfclip/_engine/collectives.py), in the
unsharded all-reduce and in shard_state's reduce-scatter alike, so the sharded step keeps the
unsharded step's bits on any number of replicas, and both are one device's given NumPy's float32
sums in replica order, every run."""
import os

import numpy as np
import pytest

from procs import run_workers, shared_once

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "three_workers.py")
pytestmark = pytest.mark.filterwarnings("ignore")


def _three(folder):
    run_workers(lambda i: [HARNESS, str(folder / f"w{i}.npz")], folder, n=3)
    return [str(folder / f"w{i}.npz") for i in range(3)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return [np.load(f) for f in shared_once(tmp_path_factory, "three_workers", _three)]


def _reference():
    import sys

    sys.path.insert(0, os.path.dirname(HARNESS))
    import three_workers

    return three_workers


def test_three_replicas_sum_in_replica_order(workers):
    ref = _reference().replica_order_sum(0)
    differs = 0
    for i, w in enumerate(workers):
        assert int(w["task"]) == i and int(w["replicas"]) == 3 and int(w["reduces"]) == 1
        for k, want in enumerate(ref):
            assert w[f"sum_{k}"].tobytes() == want.tobytes(), k
            # (the sums are order-sensitive: another order rounds some elements differently)
        b = _reference().base(0)
        s = _reference().SCALES
        other = [x * np.float32(s[0]) + (x * np.float32(s[1]) + x * np.float32(s[2])) for x in b]
        differs += sum(int(np.sum(o != r)) for o, r in zip(other, ref))
        np.testing.assert_allclose(np.concatenate([w[f"ring_{k}"].ravel() for k in range(len(ref))]),
                                   np.concatenate([r.ravel() for r in ref]), rtol=1e-6)
    assert differs > 0


def test_three_replicas_sharded_step_is_the_unsharded_and_the_one_device_step_bit_for_bit(workers):
    for w in workers:
        assert w["sharded_vars"].tobytes() == w["mirrored_vars"].tobytes()
        assert w["mirrored_vars"].tobytes() == w["one_vars"].tobytes()
        assert w["sharded_norm"] == w["mirrored_norm"] == w["one_norm"]
        start = np.concatenate([v.numpy().ravel() for v in _reference()._variables()])
        assert np.all(w["one_vars"] != start)  # (every element moved)
    assert workers[0]["sharded_vars"].tobytes() == workers[2]["sharded_vars"].tobytes()
    held = [int(w["sharded_held"]) for w in workers]
    whole = int(workers[0]["mirrored_held"])
    assert sum(held) == whole and all(h < whole for h in held), (held, whole)
