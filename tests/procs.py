"""Helpers for the tests that start worker processes (tf.distribute's multi-worker runs)."""
import socket


def free_ports(n):
    """n TCP ports on localhost that were free a moment ago (bound, read, closed together)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def shared_once(tmp_path_factory, name, produce):
    """`produce(folder)`'s result (a JSON-able value, e.g. file paths in `folder`), made once per
    test run: under pytest-xdist every worker that needs it asks, the first makes it while the
    others wait on a file lock, and they read what it left (xdist's own recipe for a fixture run
    once; its `loadgroup` grouping does not reach a module's tests on pytest 9.2: xdist 3.8 sets
    a node id attribute pytest 9.2 no longer reads). The distributed harnesses take minutes,
    and a module-scoped fixture ran them once per worker. If `produce` raises, the next asker
    runs it again (and fails the same way, with its own report)."""
    import fcntl
    import json
    import os

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return produce(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # (shared by this run's workers)
    folder, done = root / f"shared-{name}", root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return json.loads(done.read_text())
        folder.mkdir(exist_ok=True)
        value = produce(folder)
        done.write_text(json.dumps(value))
        return value


def _env(extra=None):
    """The environment a harness runs in: the tfclip these tests import first on its path."""
    import os

    import tfclip

    root = os.path.dirname(os.path.dirname(os.path.abspath(tfclip.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def run_harness(args, folder, timeout=900):
    """`python *args` in `folder` (a harness, in a fresh process); fails with its output's tail."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, *args], env=_env(), cwd=str(folder), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:]


def run_workers(args_of, folder, n=2, timeout=900):
    """n MultiWorkerMirroredStrategy worker processes on localhost (TF_CONFIG), worker i running
    `python *args_of(i)` in `folder`; fails with the tail of the first that fails."""
    import json
    import subprocess
    import sys

    cluster = {"worker": [f"localhost:{p}" for p in free_ports(n)]}
    procs = [subprocess.Popen([sys.executable, *args_of(i)], cwd=str(folder), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env({"TF_CONFIG": json.dumps({"cluster": cluster,
                                                                 "task": {"type": "worker", "index": i}})}))
             for i in range(n)]
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-4000:]
