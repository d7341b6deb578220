"""What summing the gradients in 16 bits (`reduce_dtype`, docs/distribute.md) costs in training:
a small transformer trained under 2 MultiWorkerMirroredStrategy worker processes on localhost with
float32 sums and with bfloat16 (and float16) sums, several seeds, the same data and start per seed.

    python benchmarks/reduce_accuracy.py [--seeds 5] [--steps 400] [--dtypes bfloat16,float16] [--out FILE.json]

The task is the demo's "adding problem" (tfclip.demo.make_data: sum the two marked values of a
noisy sequence of 40), which an attention layer solves calmly where the demo's LSTM, built to
explode, is chaotic: two blocks of keras.layers.MultiHeadAttention (4 heads, width 32) and an MLP,
pre-norm, learned positions, mean-pooled into a Dense(1); Adam from 1e-3 down a cosine to 0 over
the run (so the end is not an oscillation's snapshot: with a constant rate the held-out error of
one seed moved 3x from run to run), global_clipnorm=1, global batch 64 (32 a worker). Each run ends with the mean squared error on 2,048 held-out sequences
(predicting the mean, 0, scores about 0.667). Printed per seed: that error with each reduce dtype,
its ratio to float32's, and how far the pre-clip global norm trace drifts from float32's (the
largest relative difference over the first 10 steps, and the median over all). --out keeps every
trace.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

LENGTH, WIDTH, HEADS, BLOCKS, BATCH = 40, 32, 4, 2, 64


def _spawn(argv):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
    from procs import free_ports  # (the multi-worker tests' helper)

    cluster = {"worker": [f"localhost:{p}" for p in free_ports(2)]}
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]  # (a full pipe would stall a worker)
    procs = []
    for i, f in enumerate(files):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--task", str(i)],
                                      env=env, stdout=f, stderr=subprocess.STDOUT, text=True))
    for i, (p, f) in enumerate(zip(procs, files)):
        p.wait()
        f.seek(0)
        out = f.read()
        if p.returncode != 0:
            sys.exit(f"worker {i} failed:\n{out[-5000:]}")
        if i == 0:
            print(out, end="")


def _model(keras, seed):
    keras.utils.set_random_seed(seed)
    L = keras.layers
    x_in = keras.Input((LENGTH, 2))
    h = L.Dense(WIDTH)(x_in)
    positions = L.Embedding(LENGTH, WIDTH)(keras.ops.arange(LENGTH))
    h = h + positions
    for _ in range(BLOCKS):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(HEADS, WIDTH // HEADS)(a, a)
        a = L.LayerNormalization()(h)
        h = h + L.Dense(WIDTH)(L.Dense(2 * WIDTH, activation="gelu")(a))
    out = L.Dense(1)(L.GlobalAveragePooling1D()(L.LayerNormalization()(h)))
    return keras.Model(x_in, out)


def _worker(args):
    import numpy as np
    import tensorflow as tf

    ms = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import tfclip
    from tfclip.demo import make_data

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = []
    for seed in range(args.seeds):
        rng = np.random.default_rng(1000 + seed)
        x, y = make_data(rng, BATCH * args.steps, LENGTH)
        xe, ye = make_data(np.random.default_rng(99), 2048, LENGTH)
        row = {"seed": seed}
        for rd in ["float32"] + args.dtypes.split(","):
            with ms.scope():
                model = _model(keras, seed)
                lr = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=args.steps)
                opt = tfclip.keras.Adam(lr, global_clipnorm=1.0, reduce_dtype=None if rd == "float32" else rd)
                opt.build(model.trainable_variables)
            half = BATCH // 2

            @tf.function
            def step(xb, yb):
                def replica(xb, yb):
                    r = tf.distribute.get_replica_context().replica_id_in_sync_group
                    xs, ys = xb[r * half:(r + 1) * half], yb[r * half:(r + 1) * half]  # (this worker's half)
                    with tf.GradientTape() as tape:
                        loss = tf.nn.compute_average_loss(tf.reduce_mean((model(xs, training=True) - ys) ** 2, -1),
                                                          global_batch_size=BATCH)
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables))
                    return opt.global_norm
                return ms.run(replica, (xb, yb))

            norms = []
            for t in range(args.steps):
                n = step(tf.constant(x[t * BATCH:(t + 1) * BATCH]), tf.constant(y[t * BATCH:(t + 1) * BATCH]))
                norms.append(float(ms.experimental_local_results(n)[0]))
            err = float(np.mean((model.predict(xe, batch_size=512, verbose=0) - ye) ** 2))
            row[rd] = {"eval_mse": err, "norms": norms, "skipped": int(opt.skipped_steps.numpy())}
        results.append(row)
        if task == 0:
            f32 = row["float32"]
            for rd in args.dtypes.split(","):
                r = row[rd]
                rel = [abs(a - b) / b for a, b in zip(r["norms"], f32["norms"])]
                print(f"seed {seed}: float32 {f32['eval_mse']:.5f}  {rd} {r['eval_mse']:.5f}  "
                      f"x float32 {r['eval_mse'] / f32['eval_mse']:.3f}  norm drift: first 10 steps max "
                      f"{max(rel[:10]):.2e}, median {statistics.median(rel):.2e}; skipped {r['skipped']}",
                      flush=True)
    if task == 0:
        for rd in args.dtypes.split(","):
            ratios = [row[rd]["eval_mse"] / row["float32"]["eval_mse"] for row in results]
            mean32 = statistics.mean(row["float32"]["eval_mse"] for row in results)
            mean16 = statistics.mean(row[rd]["eval_mse"] for row in results)
            print(f"{rd}: held-out MSE, mean over {len(ratios)} seeds {mean16:.5f} against float32's {mean32:.5f} "
                  f"(x {mean16 / mean32:.3f}); per seed x float32 from {min(ratios):.3f} to {max(ratios):.3f} "
                  f"(geometric mean {statistics.geometric_mean(ratios):.3f})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f)
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--out", default="")
    p.add_argument("--task", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.task is None:
        print(f"reduce_dtype's training cost: a {BLOCKS}-block transformer (width {WIDTH}) on the adding problem "
              f"(length {LENGTH}), 2 worker processes, {args.steps} steps, global batch {BATCH}")
        _spawn(sys.argv[1:])
    else:
        _worker(args)


if __name__ == "__main__":
    main()
