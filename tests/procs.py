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
    and a module-scoped fixture ran them once per worker. If `produce` raises, every later asker
    fails with the first one's error rather than spend minutes failing again."""
    import fcntl
    import json
    import os

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return produce(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # (shared by this run's workers)
    folder, done = root / f"shared-{name}", root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failed = root / f"shared-{name}.failed"
        if done.exists():
            return json.loads(done.read_text())
        if failed.exists():
            raise AssertionError(f"{name}, made once for this run by another pytest worker, failed:\n"
                                 + failed.read_text())
        folder.mkdir(exist_ok=True)
        try:
            value = produce(folder)
        except BaseException as e:
            failed.write_text(f"{type(e).__name__}: {e}"[-12000:])
            raise
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


def start_workers(args_of, folder, n=2):
    """n MultiWorkerMirroredStrategy worker processes on localhost (TF_CONFIG), worker i running
    `python *args_of(i)` in `folder`, its output in folder/worker{i}.log (a pipe nobody reads while
    the test waits on another worker fills, and the two would wait on each other). Returns the
    Popens; `worker_tail(folder, i)` reads a log's end."""
    import json
    import os
    import subprocess
    import sys

    cluster = {"worker": [f"localhost:{p}" for p in free_ports(n)]}
    procs = []
    for i in range(n):
        with open(os.path.join(str(folder), f"worker{i}.log"), "w") as log:
            procs.append(subprocess.Popen([sys.executable, *args_of(i)], cwd=str(folder), stdout=log,
                                          stderr=subprocess.STDOUT, text=True,
                                          env=_env({"TF_CONFIG": json.dumps({"cluster": cluster,
                                                                             "task": {"type": "worker", "index": i}})})))
    return procs


def worker_tail(folder, i, chars=3000):
    import os

    with open(os.path.join(str(folder), f"worker{i}.log")) as f:
        return f.read()[-chars:]


def stop(procs):
    """Kill what is still running of `procs` (a test's workers, when it is done with them)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def run_workers(args_of, folder, n=2, timeout=900):
    """start_workers, then wait for all of them; fails with the tail of every one that failed:
    when one crashes, the others only report that a peer stopped sending heartbeats, so the
    crashed one's own output is the one that says why."""
    procs = start_workers(args_of, folder, n)
    failures = []
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=timeout)
            if p.returncode != 0:
                failures.append(f"--- worker {i} exited {p.returncode}; its output's tail:\n{worker_tail(folder, i)}")
    finally:
        stop(procs)
    assert not failures, "\n".join(failures)
