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
