"""tf.distribute: the global norm of the summed gradient, and the same weights as one device.

Strategies configure devices when TF starts, so each case runs tfclip.distributed_check in a
fresh process: MirroredStrategy over 2 logical CPUs (model.fit and a custom loop), and
MultiWorkerMirroredStrategy with 2 worker processes on localhost (TF_CONFIG)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import tfclip

# The subprocesses import the tfclip this test imported (installed, or the in-place checkout).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))


def _run(mode, out, env_extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    # cwd away from the checkout: `python -m` puts cwd first on sys.path.
    return subprocess.Popen([sys.executable, "-m", "tfclip.distributed_check", mode, str(out)], env=env,
                            cwd=os.path.dirname(str(out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait(p, timeout=300):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "s.npz"
    _wait(_run("single", out))
    return np.load(out)


def _same_weights(got, want, prefix):
    keys = sorted(k for k in want.files if k.startswith(prefix + "_") and k != "fit_norm")
    assert keys
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_mirrored_two_replicas(single, tmp_path):
    out = tmp_path / "m.npz"
    _wait(_run("mirrored", out))
    m = np.load(out)
    assert int(m["replicas"]) == 2
    tfclip_delta, tfclip_tensor_norm, stock_delta = m["two_replica_clip"]
    assert tfclip_delta == pytest.approx(-1.0)  # clip(3 + 3) to 1
    assert tfclip_tensor_norm == pytest.approx(6.0)  # the norm of the all-reduced gradient
    assert stock_delta == pytest.approx(-2.0)   # stock Keras: clip(3) + clip(3)
    _same_weights(m, single, "fit")
    _same_weights(m, single, "custom")
    np.testing.assert_allclose(m["fit_norm"], single["fit_norm"], rtol=1e-5)
    # Per-tensor norms of the all-reduced gradient: those of the one-device run's.
    assert m["tnorms_fit"].shape == (4,) and np.all(m["tnorms_fit"] > 0)
    np.testing.assert_allclose(m["tnorms_fit"], single["tnorms_fit"], rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(np.sum(m["tnorms_fit"].astype(np.float64) ** 2)), m["fit_norm"],
                               rtol=1e-5)


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_multi_worker_two_processes(single, tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [_run("worker", tmp_path / f"w{i}.npz",
                  {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})})
             for i in range(2)]
    for p in procs:
        _wait(p)
    for i in range(2):
        w = np.load(tmp_path / f"w{i}.npz")
        assert int(w["replicas"]) == 2 and int(w["task"]) == i
        _same_weights(w, single, "custom")


def test_demo_with_two_workers_trains(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tfclip.demo", "--workers", "2", "--steps", "4", "--units", "16",
                        "--length", "10"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 replicas" in r.stdout and "over 4 steps; 0 skipped" in r.stdout
