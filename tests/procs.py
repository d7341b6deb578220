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
