"""tfclip demo: train a small LSTM on a synthetic sequence task with exploding gradients.

    python -m tfclip.demo [--steps 40] [--clip 1.0] [--plot tfclip-demo.png]
    python -m tfclip.demo --workers 2     # the same training on 2 local worker processes

The data is generated here (the "adding problem": sum the two marked values of a long noisy
sequence). The LSTM starts with a large recurrent gain, so early gradients are large; every step
clips them by their global norm and applies Adam in one fused op. It prints loss and the pre-clip
global norm per step, then times the update (clip + apply) and the whole training step against
`tf.clip_by_global_norm` + Keras Adam, both in `tf.function`.

It saves a picture (`--plot`, a PNG; `--plot ""` for none) of the global norm per step against the
clip threshold, the loss, and the five variables with the largest gradient norms, each from the
fused step's own norm pass (`result.tensor_norms`). The picture needs matplotlib
(`pip install "tfclip[plot]"`); without it the demo runs and says so.

It then trains the same model from the same start four more times on the same batches, two of
them corrupted (targets x50: gradient spikes), with a fixed `global_clipnorm` and with the
adaptive clips of `tfclip.clipping` (ZClip, AutoClip, AGC), and saves a second picture
(`--adaptive-plot`) of each run's norm, threshold and loss (`--adaptive ""` skips this part).

With `--workers N` it starts N worker processes on localhost (`TF_CONFIG`,
`MultiWorkerMirroredStrategy`), each with its shard of every global batch, training with
`tfclip.keras.Adam(global_clipnorm=...)`: the clip is applied to the all-reduced gradient, so
the run follows the single-process one.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402


def make_data(rng, n, length):
    values = rng.uniform(-1, 1, size=(n, length)).astype(np.float32)
    marks = np.zeros((n, length), np.float32)
    for row in marks:
        row[rng.choice(length, 2, replace=False)] = 1.0
    x = np.stack([values, marks], axis=-1)
    y = (values * marks).sum(axis=1, keepdims=True).astype(np.float32)
    return x, y


def make_model(seed, length, units):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((length, 2)),
        keras.layers.LSTM(units, recurrent_initializer=keras.initializers.Orthogonal(gain=4.0),
                          kernel_initializer=keras.initializers.RandomNormal(stddev=2.0)),
        keras.layers.Dense(units, activation="tanh"),
        keras.layers.Dense(1),
    ])
    return model


def _time(fn, repeats):
    fn()  # warm up (trace)
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--clip", type=float, default=1.0, help="global_clipnorm")
    p.add_argument("--length", type=int, default=50, help="sequence length")
    p.add_argument("--units", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="train on N local worker processes")
    p.add_argument("--reduce-dtype", default=None, choices=("bfloat16", "float16"),
                   help="with --workers: the gradients summed across the workers in this dtype (reduce_dtype)")
    p.add_argument("--plot", default="tfclip-demo.png",
                   help="where to save the PNG of norms and loss ('' for none; needs matplotlib)")
    p.add_argument("--adaptive", default="zclip,autoclip,agc",
                   help="adaptive clips to compare with the fixed one ('' for none)")
    p.add_argument("--spikes", default="24,31", help="steps whose batch targets are x50 (gradient spikes)")
    p.add_argument("--adaptive-plot", default="tfclip-demo-adaptive.png",
                   help="where to save the comparison PNG ('' for none)")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.worker_index is not None:
        return run_worker(args)
    if args.workers > 1:
        return launch_workers(args, argv if argv is not None else sys.argv[1:])

    rng = np.random.default_rng(args.seed)
    x, y = make_data(rng, args.batch * args.steps, args.length)
    model = make_model(args.seed, args.length, args.units)
    rule = tfclip.rules.Adam(learning_rate=3e-3)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def fused_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        res = tfclip.fused_clip_apply(zip(grads, model.trainable_variables), rule,
                                      global_clipnorm=args.clip)
        return loss, res.global_norm, res.applied, res.tensor_norms

    print(f"tfclip {tfclip.__version__} on TensorFlow {tf.__version__}: LSTM({args.units}) on the "
          f"adding problem, length {args.length}, batch {args.batch}, global_clipnorm={args.clip}")
    print(f"{'step':>5} {'loss':>10} {'global norm':>12}  clipped")
    first_loss = None
    history = {"loss": [], "norm": [], "tensor_norms": []}
    for step in range(args.steps):
        sl = slice(step * args.batch, (step + 1) * args.batch)
        loss, norm, applied, tensor_norms = fused_step(x[sl], y[sl])
        first_loss = first_loss if first_loss is not None else float(loss)
        history["loss"].append(float(loss))
        history["norm"].append(float(norm))
        history["tensor_norms"].append(tensor_norms.numpy())
        print(f"{step:5d} {float(loss):10.4f} {float(norm):12.4f}  "
              f"{'yes' if float(norm) > args.clip else 'no'}{'' if bool(applied) else ' (skipped: non-finite)'}")
    print(f"loss {first_loss:.4f} -> {float(loss):.4f} over {args.steps} steps")
    names = [v.path for v in model.trainable_variables]  # every variable gets a gradient here
    if args.plot:
        print(save_plot(args.plot, history, names, args.clip))
    if args.adaptive:
        compare_adaptive(args, x, y, loss_fn)

    # --- timing: the same model and gradients, fused vs TF's unfused recipe -------------------
    xb, yb = tf.constant(x[: args.batch]), tf.constant(y[: args.batch])
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    variables = model.trainable_variables
    tiny = 1e-12  # keep the weights where they are while timing
    rule_t = tfclip.rules.Adam(tiny)
    keras_adam = keras.optimizers.Adam(tiny)
    keras_adam.build(variables)

    @tf.function
    def update_fused(gs):
        return tfclip.fused_clip_apply(zip(gs, variables), rule_t, global_clipnorm=args.clip).applied

    @tf.function
    def update_tf(gs):
        clipped, _ = tf.clip_by_global_norm(gs, args.clip)
        keras_adam.apply_gradients(zip(clipped, variables))

    @tf.function
    def step_tf(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        gs = tape.gradient(loss, variables)
        clipped, _ = tf.clip_by_global_norm(gs, args.clip)
        keras_adam.apply_gradients(zip(clipped, variables))
        return loss

    t_uf = _time(lambda: update_fused(grads), 50)
    t_ut = _time(lambda: update_tf(grads), 50)
    t_sf = _time(lambda: fused_step(xb, yb), 10)
    t_st = _time(lambda: step_tf(xb, yb), 10)
    n_params = sum(int(np.prod(v.shape)) for v in variables)
    print(f"\nTiming ({len(variables)} variables, {n_params:,} parameters; median, tf.function):")
    print(f"  clip + Adam update:  tfclip {t_uf * 1e3:8.3f} ms   tf.clip_by_global_norm + Keras Adam "
          f"{t_ut * 1e3:8.3f} ms   ratio {t_ut / t_uf:5.2f}x")
    print(f"  whole training step: tfclip {t_sf * 1e3:8.3f} ms   tf.clip_by_global_norm + Keras Adam "
          f"{t_st * 1e3:8.3f} ms   ratio {t_st / t_sf:5.2f}x")


def compare_adaptive(args, x, y, loss_fn):
    """The fixed clip against the adaptive ones, from the same start on the same (spiked) batches."""
    from tfclip import clipping

    spikes = {int(s) for s in args.spikes.split(",") if s.strip()}
    modes = ["fixed"] + [m.strip() for m in args.adaptive.split(",") if m.strip()]
    makers = {"zclip": lambda: clipping.ZClip(warmup_steps=10), "autoclip": lambda: clipping.AutoClip(percentile=10),
              "agc": lambda: clipping.AGC(clip_factor=0.02)}
    for m in modes[1:]:
        if m not in makers:
            raise SystemExit(f"--adaptive: unknown clip {m!r} (zclip, autoclip, agc)")
    runs = {}
    print(f"\nFixed global_clipnorm={args.clip} against adaptive clipping, batches {sorted(spikes)} "
          "with targets x50:")
    for mode in modes:
        model = make_model(args.seed, args.length, args.units)
        rule = tfclip.rules.Adam(learning_rate=3e-3)
        clip = None if mode == "fixed" else makers[mode]()

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            pairs = zip(grads, model.trainable_variables)
            if clip is None:
                res = tfclip.fused_clip_apply(pairs, rule, global_clipnorm=args.clip)
                return loss, res.global_norm, tf.constant(args.clip, tf.float64)
            res = tfclip.fused_clip_apply(pairs, rule, clip=clip)
            if isinstance(clip, clipping.AGC):  # unit-wise: no global threshold
                return loss, res.global_norm, tf.constant(np.nan, tf.float64)
            return loss, res.global_norm, clip.last_step.threshold

        hist = {"loss": [], "norm": [], "threshold": []}
        for i in range(args.steps):
            sl = slice(i * args.batch, (i + 1) * args.batch)
            yb = y[sl] * (50.0 if i in spikes else 1.0)
            loss, norm, thr = step(x[sl], yb)
            hist["loss"].append(float(loss))
            hist["norm"].append(float(norm))
            hist["threshold"].append(float(thr))
        clean = [l for i, l in enumerate(hist["loss"]) if i not in spikes]
        clipped = ("per unit" if mode == "agc" else
                   f"{sum(n > t for n, t in zip(hist['norm'], hist['threshold']))} of {args.steps} steps")
        print(f"  {mode:9s} loss {clean[0]:.4f} -> {clean[-1]:.4f} (spiked batches left out); clipped {clipped}")
        runs[mode] = hist
    if args.adaptive_plot:
        print(save_adaptive_plot(args.adaptive_plot, runs, spikes))
    return runs


def save_adaptive_plot(path, runs, spikes):
    """The comparison picture: per run, the norm and threshold per step, and the losses."""
    try:
        import matplotlib
    except ImportError:
        return "(no comparison plot: matplotlib is not installed)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(8, 3 * (len(runs) + 1)), sharex=True)
    for ax, (mode, hist) in zip(axes, runs.items()):
        steps = np.arange(len(hist["norm"]))
        ax.semilogy(steps, hist["norm"], marker=".", label="global norm (before the clip)")
        thr = np.where(np.isfinite(hist["threshold"]), hist["threshold"], np.nan)
        ax.semilogy(steps, thr, color="tab:red", linestyle="--", label="clip threshold")
        for sp in sorted(spikes):
            ax.axvline(sp, color="gray", alpha=0.3)
        ax.set_ylabel("gradient norm")
        ax.set_title({"fixed": "fixed global_clipnorm",
                      "agc": "clip='agc' (tfclip.clipping; unit-wise, so no global threshold)"}.get(
                          mode, f"clip='{mode}' (tfclip.clipping)"))
        ax.legend(fontsize="small")
    ax = axes[-1]
    for mode, hist in runs.items():
        ax.semilogy(np.arange(len(hist["loss"])), hist["loss"], label=mode)
    for sp in sorted(spikes):
        ax.axvline(sp, color="gray", alpha=0.3)
    ax.set_ylabel("loss (MSE; spiked batches at the gray lines)")
    _finish(fig, ax, path)
    return f"saved the comparison of fixed and adaptive clipping to {os.path.abspath(path)}"


def _finish(fig, ax, path):
    """The last axes' step label and legend, then the PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("step")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save_plot(path, history, names, clip, top=5):
    """Saves the demo's picture; returns the line to print (where it is, or how to get it)."""
    try:
        import matplotlib
    except ImportError:
        return ("(no plot: matplotlib is not installed; pip install \"tfclip[plot]\" or "
                "pip install matplotlib, then run again)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(len(history["norm"]))
    per = np.stack(history["tensor_norms"])  # [steps, tensors]
    biggest = np.argsort(-np.nanmax(per, axis=0))[:top]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.semilogy(steps, history["norm"], marker=".", label="global norm (before the clip)")
    ax.axhline(clip, color="tab:red", linestyle="--", label=f"global_clipnorm = {clip:g}")
    ax.set_ylabel("gradient norm")
    ax.set_title("tfclip demo: LSTM on the adding problem, clip + Adam fused")
    ax.legend()
    axes[1].plot(steps, history["loss"], color="tab:green")
    axes[1].set_ylabel("loss (MSE)")
    ax = axes[2]
    for i in biggest:
        ax.semilogy(steps, per[:, i], label=names[i])
    ax.set_ylabel("gradient norm")
    ax.set_title(f"the {len(biggest)} variables with the largest gradient norms (result.tensor_norms)")
    _finish(fig, ax, path)
    return f"saved the plot of norms and loss to {os.path.abspath(path)}"


def launch_workers(args, argv):
    """Starts args.workers copies of this demo as MultiWorkerMirroredStrategy workers."""
    socks = [socket.socket() for _ in range(args.workers)]
    for sk in socks:
        sk.bind(("localhost", 0))
    cluster = {"worker": [f"localhost:{sk.getsockname()[1]}" for sk in socks]}
    for sk in socks:
        sk.close()
    print(f"tfclip {tfclip.__version__}: {args.workers} worker processes on localhost "
          f"(MultiWorkerMirroredStrategy), global batch {args.batch}")
    procs = []
    for i in range(args.workers):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "tfclip.demo", *argv, "--worker-index", str(i)],
                                      env=env, stdout=None if i == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"worker exit codes: {codes}")


def run_worker(args):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    chief = args.worker_index == 0
    rng = np.random.default_rng(args.seed)
    x, y = make_data(rng, args.batch * args.steps, args.length)
    with strategy.scope():
        model = make_model(args.seed, args.length, args.units)
        opt = tfclip.keras.Adam(3e-3, global_clipnorm=args.clip, reduce_dtype=args.reduce_dtype)
        opt.build(model.trainable_variables)
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch))

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(xb, training=True) - yb) ** 2, axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=args.batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas; LSTM({args.units}), length {args.length}, "
              f"global_clipnorm={args.clip} applied to the all-reduced gradient"
              + (f", summed in {args.reduce_dtype}" if args.reduce_dtype else ""))
        print(f"{'step':>5} {'loss':>10} {'global norm':>12}")
    first = None
    for i, batch in enumerate(ds):
        loss = float(step(batch))
        first = loss if first is None else first
        if chief:
            print(f"{i:5d} {loss:10.4f} {float(opt.global_norm.numpy()):12.4f}")
    if chief:
        print(f"loss {first:.4f} -> {loss:.4f} over {args.steps} steps; "
              f"{int(opt.skipped_steps.numpy())} skipped")


if __name__ == "__main__":
    main()
