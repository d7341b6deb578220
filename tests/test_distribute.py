"""tf.distribute: the global norm of the summed gradient, and the same weights as one device.

Strategies configure devices when TF starts, so each case runs harness/distributed_check.py in a
fresh process: MirroredStrategy over 2 logical CPUs (model.fit and a custom loop), and
MultiWorkerMirroredStrategy with 2 worker processes on localhost (TF_CONFIG)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import tfclip
from procs import run_harness, run_workers, shared_once

# The subprocesses import the tfclip this test imported (installed, or the in-place checkout).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "distributed_check.py")


def _harness(mode):
    def produce(folder):
        out = folder / f"{mode}.npz"
        run_harness([HARNESS, mode, str(out)], folder, timeout=300)
        return str(out)
    return produce


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return np.load(shared_once(tmp_path_factory, "distribute_single", _harness("single")))  # (procs.py)


def _same_weights(got, want, prefix):
    keys = sorted(k for k in want.files if k.startswith(prefix + "_") and k != "fit_norm")
    assert keys
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_mirrored_two_replicas(single, tmp_path):
    out = tmp_path / "m.npz"
    run_harness([HARNESS, "mirrored", str(out)], tmp_path, timeout=300)
    m = np.load(out)
    assert int(m["replicas"]) == 2
    tfclip_delta, tfclip_tensor_norm, stock_delta = m["two_replica_clip"]
    assert tfclip_delta == pytest.approx(-1.0)  # clip(3 + 3) to 1
    assert tfclip_tensor_norm == pytest.approx(6.0)  # the norm of the all-reduced gradient
    assert stock_delta == pytest.approx(-2.0)   # stock Keras: clip(3) + clip(3)
    _same_weights(m, single, "fit")
    _same_weights(m, single, "custom")
    # Muon: the fused Adam op on the biases, the fused momentum and update ops around TF products on
    # the matrices, on each replica's copy
    _same_weights(m, single, "muon_fit")
    _same_weights(m, single, "muon_custom")
    np.testing.assert_allclose(m["fit_norm"], single["fit_norm"], rtol=1e-5)
    # Per-tensor norms of the all-reduced gradient: those of the one-device run's.
    assert m["tnorms_fit"].shape == (4,) and np.all(m["tnorms_fit"] > 0)
    np.testing.assert_allclose(m["tnorms_fit"], single["tnorms_fit"], rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(np.sum(m["tnorms_fit"].astype(np.float64) ** 2)), m["fit_norm"],
                               rtol=1e-5)


def test_multi_worker_two_processes(single, tmp_path):
    run_workers(lambda i: [HARNESS, "worker", str(tmp_path / f"w{i}.npz")], tmp_path, timeout=300)
    applied = []
    for i in range(2):
        w = np.load(tmp_path / f"w{i}.npz")
        assert int(w["replicas"]) == 2 and int(w["task"]) == i
        _same_weights(w, single, "custom")
        applied.append(w["fused_clip_apply"])
    # fused_clip_apply inside strategy.run on each worker: the same copies everywhere; the MEAN
    # variable moved by the mean of the workers' gradients (1 and 2 times [1, 2]), twice.
    np.testing.assert_array_equal(applied[0], applied[1])
    np.testing.assert_allclose(applied[0][:2], 1.0 - 2 * 0.1 * 1.5 * np.array([1.0, 2.0]), rtol=1e-6)
    assert applied[0][-1] == 2.0


def test_demo_with_two_workers_trains(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tfclip.demo", "--workers", "2", "--steps", "4", "--units", "16",
                        "--length", "10"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 replicas" in r.stdout and "over 4 steps; 0 skipped" in r.stdout


@pytest.fixture(scope="module")
def replica_apply(tmp_path_factory):
    return np.load(shared_once(tmp_path_factory, "distribute_replica_apply", _harness("replica_apply")))


@pytest.mark.parametrize("how", ["graph", "eager"])
@pytest.mark.parametrize("aggregation,moved", [("MEAN", 1.5), ("SUM", 3.0), ("ONLY_FIRST_REPLICA", 1.0),
                                               ("NONE", 3.0)])
def test_fused_clip_apply_in_a_replica_context_honours_the_aggregation(replica_apply, how, aggregation,
                                                                        moved):
    """Inside strategy.run each replica passes its own gradient ((id + 1) * [1, 2]); SGD lr 0.1,
    two steps. The copies stay identical (checked after every step in the subprocess) and move
    as stock assign_sub moves a variable of that aggregation (MEAN: the mean of the replicas'
    updates; SUM: their sum; ONLY_FIRST_REPLICA: the first's). NONE, where stock assign_sub lets
    the copies differ, takes the stock optimizers' all-reduce (the sum)."""
    r = replica_apply
    got = r[f"agg_{aggregation}_{how}"]
    np.testing.assert_allclose(got, 1.0 - 2 * 0.1 * moved * np.array([1.0, 2.0]), rtol=1e-6)
    if aggregation != "NONE":
        np.testing.assert_array_equal(got, r[f"stock_{aggregation}_{how}"])
    assert int(r[f"iterations_{aggregation}"]) == 2


@pytest.mark.parametrize("rule", ["Adam", "Nadam", "Lamb", "Adafactor"])
def test_fused_clip_apply_in_a_replica_context_is_one_device_on_the_summed_gradient(replica_apply, rule):
    """Keras weights (aggregation NONE), a different gradient per replica, global_clipnorm=1:
    clipped after the sum, three steps, equal to one device given the summed gradient."""
    r = replica_apply
    np.testing.assert_allclose(r[f"{rule}_mirrored"], r[f"{rule}_one_device"], rtol=1e-6, atol=1e-7)
    norm, want = r[f"{rule}_norm"]
    assert norm == pytest.approx(want, rel=1e-6)


def test_fused_clip_apply_in_the_cross_replica_context_moves_every_copy(replica_apply):
    r = replica_apply
    copies = r["cross_replica"]
    assert copies.shape == (2, 2)
    np.testing.assert_array_equal(copies[0], copies[1])
    np.testing.assert_array_equal(copies[0], r["cross_replica_one"])
    assert not np.array_equal(copies[0], [1.0, 1.0])


@pytest.mark.parametrize("key,names", [("error_plain", ["plain_var", "not mirrored", "strategy.scope()"]),
                                       ("error_on_read", ["on_read_var", "SyncOnRead"])])
def test_unmirrored_variables_in_a_replica_context_are_refused_by_name(replica_apply, key, names):
    message = str(replica_apply[key])
    for n in names:
        assert n in message, message
    assert bool(replica_apply[key + "_unchanged"])


def test_compat_v1_in_a_replica_context_sums_like_stock_and_keeps_copies_identical(replica_apply):
    r = replica_apply
    # No clip: stock tf.compat.v1 Adam's result (the replicas' gradients summed).
    np.testing.assert_allclose(r["v1_tfclip_None"], r["v1_stock_None"], rtol=1e-5, atol=5e-6)
    # A global clip: after the sum, so one device given the summed gradient.
    np.testing.assert_allclose(r["v1_tfclip_1.0"], r["v1_one_device_1.0"], rtol=1e-6, atol=1e-7)
    for clip in ("None", "1.0"):
        assert int(r[f"v1_gstep_tensorflow_{clip}"]) == int(r[f"v1_gstep_tfclip_{clip}"]) == 3


@pytest.mark.parametrize("clip", ["zclip", "autoclip"])
@pytest.mark.parametrize("front", ["rule", "keras"])
def test_an_adaptive_clip_takes_the_all_reduced_norm_and_keeps_the_replicas_identical(replica_apply, clip,
                                                                                      front):
    """ZClip / AutoClip inside strategy.run (a different gradient per replica, a x100 spike at
    step 6 of 8): the statistics come from the summed gradient's norm, every copy of the weights
    and of the clip's state is the same bits after every step (checked in the subprocess), and
    the weights equal one device's given the summed gradient."""
    r = replica_apply
    key = f"adaptive_{clip}_{front}"
    np.testing.assert_allclose(r[key + "_mirrored"], r[key + "_one_device"], rtol=1e-6, atol=1e-7)
    assert list(r[key + "_count"]) == [8, 8]
