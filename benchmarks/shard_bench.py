"""shard_state=True (ZeRO-1, tfclip/_engine/shard.py) against the unsharded step, under MirroredStrategy
over N logical CPU devices of this machine: optimizer-state bytes per replica, and the whole
`tf.function` call of `strategy.run(step)` as a custom loop runs it (the all-reduce of the
gradients, Keras's apply_gradients with the fused step, the all-gather of the updated variables),
medians of interleaved repeats, as ratios in the same run; and the sharded step's two extra
parts each alone (the norm pass over every gradient, the all-gather of the updated variables).

    python benchmarks/shard_bench.py [--layers 12] [--replicas 2 | --workers 2] [--repeats 5] [--iters 3]
                                     [--optimizer adam | muon] [--reduce-dtype]

--layers: BERT-base's embeddings and that many of its transformer layers (12: BERT-base, 110M
parameters). The gradients are fixed per replica (made once, outside the timed call), float32,
Adam with global_clipnorm=1. Logical CPU devices share this machine's cores: the times say what
the extra norm pass and all-gather cost here, not what N GPUs would gain. --workers N runs the same
under MultiWorkerMirroredStrategy over N processes on localhost (the collectives over gRPC), the
chief's times and each process's own state. --optimizer muon: Muon instead (the three embeddings
AdamW, as stock's exclude_embeddings; the layers' matrices Muon's): sharded, each replica runs the
Newton–Schulz products of its own matrices only, where unsharded every replica runs all of them.
--reduce-dtype: also `reduce_dtype="bfloat16"` (the gradients summed in bfloat16), unsharded and
sharded. Each row: its time as a ratio to the unsharded tfclip step and to stock Keras's, and the
bytes each replica sends per step (computed for a ring).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _spawn_workers(args):
    """--workers N: N processes of this script on localhost under MultiWorkerMirroredStrategy
    (TF_CONFIG), each timing the same loop (its collectives keep them in step); the chief's
    table, then each process's optimizer state."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
    from procs import free_ports  # (the multi-worker tests' helper)

    cluster = {"worker": [f"localhost:{p}" for p in free_ports(args.workers)]}
    procs = []
    # (into files: a worker blocked on a full pipe would stall the others in its collectives)
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(args.workers)]
    for i, (out, err) in enumerate(files):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--task", str(i)],
                                      env=env, stdout=out, stderr=err))
    outs = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        p.wait()
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            sys.exit(f"worker {i} failed:\n{err.read()[-5000:]}")
        outs.append(out.read())
    print("\n".join(line for line in outs[0].splitlines() if not line.startswith("state of ")))
    for out in outs:
        print("\n".join(line for line in out.splitlines() if line.startswith("state of ")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0,
                    help="N > 1: MultiWorkerMirroredStrategy over N processes on localhost (not --replicas)")
    ap.add_argument("--task", type=int, default=None, help=argparse.SUPPRESS)  # (a spawned worker)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--optimizer", choices=("adam", "muon"), default="adam")
    ap.add_argument("--reduce-dtype", action="store_true",
                    help='also reduce_dtype="bfloat16", unsharded and with shard_state=True')
    args = ap.parse_args()
    if args.workers > 1 and args.task is None:
        return _spawn_workers(args)

    import numpy as np
    import tensorflow as tf

    if args.task is None:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tfclip
    from cpu_bench import bert_layers

    shapes = bert_layers(args.layers)
    n_params = sum(int(np.prod(s)) for s in shapes)
    if args.task is None:
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
        where = f"MirroredStrategy over {args.replicas} logical CPUs"
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        where = f"MultiWorkerMirroredStrategy over {args.workers} processes on localhost, one CPU device each"
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s).astype("float32") * 0.02 for s in shapes]
    # The gradients: one fixed set per replica, kept as (mirrored) variables and read inside each
    # replica's step (per-replica tensors given to strategy.run fail under
    # MultiWorkerMirroredStrategy: Keras's all-reduce finds their device empty).
    with strategy.scope():
        grad_vars = [tf.Variable(rng.normal(size=s).astype("float32") * 1e-3, trainable=False) for s in shapes]

    name = "Muon" if args.optimizer == "muon" else "Adam"
    stock, ours = getattr(keras.optimizers, name), getattr(tfclip.keras, name)
    unsharded, sharded = f"tfclip.keras.{name}", f"tfclip.keras.{name}(shard_state=True)"
    stock_label = f"stock keras.optimizers.{name}"
    contenders = {
        stock_label: lambda: stock(1e-4, global_clipnorm=1.0),
        unsharded: lambda: ours(1e-4, global_clipnorm=1.0),
        sharded: lambda: ours(1e-4, global_clipnorm=1.0, shard_state=True),
    }
    # reduce_dtype (tfclip/_engine/reduce.py): the gradients summed in bfloat16, unsharded and sharded.
    bf16, both = f'{unsharded}(reduce_dtype="bfloat16")', f'{unsharded}(shard_state=True, reduce_dtype="bfloat16")'
    if args.reduce_dtype:
        contenders[bf16] = lambda: ours(1e-4, global_clipnorm=1.0, reduce_dtype="bfloat16")
        contenders[both] = lambda: ours(1e-4, global_clipnorm=1.0, shard_state=True, reduce_dtype="bfloat16")
    # The bytes each replica sends per step, computed for a ring (TF's collectives over N
    # replicas): an all-reduce of B bytes sends 2 (N - 1) / N B, an all-gather (N - 1) / N of
    # the gathered bytes (shard_state's: the float32 variables, as int32 words).
    # Across worker processes shard_state reduce-scatters instead (tfclip/_engine/shard.py): an
    # all-to-all of N parts as wide as the largest owner's share, of which each replica sends N - 1.
    n_rep = strategy.num_replicas_in_sync
    ring = (n_rep - 1) / n_rep
    gathered = ring * 4  # (per parameter; refined below from the owners' shares, across processes)
    sent = {stock_label: 2 * ring * 4, unsharded: 2 * ring * 4, sharded: 2 * ring * 4 + gathered,
            bf16: 2 * ring * 2, both: 2 * ring * 2 + gathered}
    steps, state, built = {}, {}, {}
    for label, make in contenders.items():
        with strategy.scope():
            # (named: Muon leaves the three embeddings to AdamW, as stock's exclude_embeddings)
            vs = [keras.Variable(x, name=("embedding" if k < 3 else "w") + str(k)) for k, x in enumerate(init)]
            opt = make()
            opt.build(vs)

        def step(vs=vs, opt=opt):
            opt.apply_gradients(zip([tf.identity(g) for g in grad_vars], vs))

        steps[label] = tf.function(lambda step=step: strategy.run(step))
        built[label] = (vs, opt)
        by = {}
        for v in opt.variables:
            if isinstance(v, tfclip._engine.shard.RemoteSlot) or v.path.split("/")[-1] in ("iteration", "learning_rate"):
                continue  # (a RemoteSlot: kept by another worker process)
            x = v.value
            n = v.shape.num_elements() * tf.as_dtype(v.dtype).size
            for d in ([c.device for c in x.values] if isinstance(x, tf.distribute.DistributedValues) else [x.device]):
                by[d] = by.get(d, 0) + n
        state[label] = [by.get(d, 0) / n_params for d in sorted(by)]
        steps[label]()  # trace and warm up
        steps[label]()

    if args.workers > 1:  # (the reduce-scatter and the all-gather, each padded to the widest share)
        sizes = [int(np.prod(x.shape)) for x in init]
        widest = max(sum(n for n, o in zip(sizes, built[sharded][1].state_owners) if o == r) for r in range(n_rep))
        part = (n_rep - 1) * widest / n_params
        sent[sharded] = part * 4 + part * 4
        sent[both] = part * 2 + part * 4
    # The sharded step's two extra parts, each alone in its own strategy.run: the norm pass over
    # every summed gradient (_step.norm_pass), and the all-gather of the updated variables into
    # every copy (_shard.gather, as int32 words), with the sharded optimizer's owners.
    from tfclip._engine import shard as _shard
    from tfclip._engine import step as _step
    from tfclip.keras._dropin import _tf_var

    svs, sopt = built[sharded]

    def gather_alone():
        tv = [_tf_var(v) for v in svs]
        _shard.gather([v.handle for v in tv], [tf.as_dtype(v.dtype) for v in tv], [v.shape for v in tv],
                      sopt.state_owners, _shard.replica_id())

    def norm_alone():
        return _step.norm_pass([tf.identity(g) for g in grad_vars])[0]

    parts = {
        "  its norm pass over every gradient, alone": tf.function(lambda: strategy.run(norm_alone)),
        "  its all-gather of the variables, alone": tf.function(lambda: strategy.run(gather_alone)),
    }
    for f in parts.values():
        f()
        f()
    steps.update(parts)
    times = {label: [] for label in steps}
    for _ in range(args.repeats):
        for label, f in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = f()
            tf.nest.map_structure(lambda t: t, out)
            times[label].append((time.perf_counter() - t0) / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[unsharded]
    print(f"shard_bench: BERT-base embeddings + {args.layers} layers, {n_params:,} parameters, {len(shapes)} "
          f"tensors, {name} float32, global_clipnorm=1, {where} ({os.cpu_count()} cores); median of "
          f"{args.repeats} x {args.iters} whole tf.function calls")
    print(f"{'':<66} {'ms/step':>9} {'x unsharded':>12} {'x stock':>8} {'MB sent':>8}   optimizer state, "
          "bytes/param on each replica")
    for label in contenders:
        per = "  ".join(f"{b:5.2f}" for b in state[label])
        print(f"{label:<66} {med[label] * 1e3:9.1f} {med[label] / base:12.2f} {med[label] / med[stock_label]:8.2f} "
              f"{sent[label] * n_params / 1e6:8.0f}   {per}")
    for label in parts:
        print(f"{label:<66} {med[label] * 1e3:9.1f} {med[label] / base:12.2f}")
    print(f"(MB sent: per replica per step, computed for a ring over {n_rep} replicas: the gradients' "
          "all-reduce, and shard_state's all-gather of the float32 variables; across worker processes "
          "shard_state's reduce-scatter instead of the all-reduce, its parts as wide as the widest share)")
    if args.task is not None:  # (this process's devices only; _spawn_workers prints every worker's)
        for label in contenders:
            print(f"state of worker {args.task}, {label}: " + "  ".join(f"{b:5.2f}" for b in state[label])
                  + " bytes/param")


if __name__ == "__main__":
    main()
