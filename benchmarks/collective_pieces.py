"""How TF's CPU collectives across worker processes (gRPC on localhost) take one large message
against the same bytes in pieces: the figures behind tfclip/_engine/collectives.py's `PIECE`.

    python benchmarks/collective_pieces.py [--params 109482240] [--pieces 1,4,16,64] [--repeats 3]

Spawns 2 MultiWorkerMirroredStrategy processes; each times, inside `tf.function(strategy.run)`,
Keras-style `all_reduce` of the whole float32 vector (what an unsharded step does), and the sharded
step's two collectives over half of it, each in 1..k pieces: `CollectiveAllToAllV2` (the
reduce-scatter's) and the replica context's `all_gather` of int32 words (the variables'). The
chief prints medians of interleaved repeats, ms per call.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _ports(n):
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            out.append(s.getsockname()[1])
    return out


def worker(args):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = args.params - args.params % 2
    with strategy.scope():
        g = tf.Variable(tf.ones([n]), trainable=False)
        h = tf.Variable(tf.ones([n // 2], tf.int32), trainable=False)
    keys = [0]

    def all_to_all(pieces):
        def f():
            x = tf.reshape(g.read_value(), [2, n // 2])
            w = n // 2 // pieces
            outs = []
            for p in range(pieces):
                keys[0] += 1
                outs.append(tf.raw_ops.CollectiveAllToAllV2(
                    input=x[:, p * w:(p + 1) * w], group_size=2, group_key=0x7F7E0000, instance_key=keys[0],
                    ordering_token=[]))
            return tf.add_n([tf.reduce_sum(o[:, :1]) for o in outs])
        return f

    def all_gather(pieces):
        def f():
            ctx = tf.distribute.get_replica_context()
            x, w = h.read_value(), n // 2 // pieces
            outs = [ctx.all_gather(x[p * w:(p + 1) * w], axis=0) for p in range(pieces)]
            return tf.add_n([tf.cast(o[0], tf.float32) for o in outs])
        return f

    def all_reduce():
        return tf.distribute.get_replica_context().all_reduce("sum", g.read_value())[0]

    cases = {"all-reduce, whole (4 B/param)": all_reduce}
    for k in args.pieces:
        cases[f"all-to-all of half, {k} pieces"] = all_to_all(k)
    for k in args.pieces:
        cases[f"all-gather of half, {k} pieces"] = all_gather(k)
    calls = {k: tf.function(lambda f=f: strategy.run(f)) for k, f in cases.items()}
    for f in calls.values():
        f()
    times = {k: [] for k in calls}
    for _ in range(args.repeats):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f().numpy()
            times[k].append(time.perf_counter() - t0)
    if args.task == 0:
        print(f"collective_pieces: {n:,} float32 parameters, 2 worker processes on localhost, "
              f"{os.cpu_count()} cores; median of {args.repeats} interleaved calls")
        for k, v in times.items():
            print(f"{k:<36} {statistics.median(v) * 1e3:9.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=109_482_240)
    ap.add_argument("--pieces", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--task", type=int, default=None)
    args = ap.parse_args()
    if args.task is not None:
        return worker(args)
    ports = _ports(2)
    procs = []
    for i in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                                     "task": {"type": "worker", "index": i}}))
        argv = [sys.executable, __file__, "--task", str(i), "--params", str(args.params), "--repeats",
                str(args.repeats), "--pieces", ",".join(map(str, args.pieces))]
        procs.append(subprocess.Popen(argv, env=env, stdout=None if i == 0 else subprocess.DEVNULL))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
