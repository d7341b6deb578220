"""Training with bfloat16 and int8 optimizer state against float32 state: the loss a user would judge by.

    python benchmarks/state_accuracy.py [--steps 400] [--seeds 0,1,2] [--state-dtypes bfloat16,int8]
    python benchmarks/state_accuracy.py --bf16-weights [--steps 400] [--seeds 0,1,2] [--lr 1e-3]

Two tasks, each trained from the same seed with tfclip.keras optimizers that differ only in
`state_dtype` (None, the stock float32 layout, "bfloat16" and "int8"), model.fit-style steps in one
tf.function:
  lstm         the demo's task (tfclip/demo.py: sum the two marked values of a length-50 sequence,
               an LSTM of 128 units with a large recurrent gain, Adam(3e-3), global_clipnorm=1)
  transformer  a 2-block transformer encoder (d=64, 4 heads, length 32) predicting the running
               sum of its tokens' values mod 1, AdamW(1e-3, weight_decay=0.01), global_clipnorm=1
For each: the mean loss over the last 10% of steps with each state dtype, and each over fp32's
(issue 47's target: within 2%). Data is generated here; nothing is downloaded.

--bf16-weights: pure-bfloat16 training instead (the dtype policy "bfloat16": every weight, and
the optimizer state with it, in bf16, no float32 master copy), with round to nearest and with
`stochastic_rounding=True`, against the float32 model's run (the same seed, data and optimizer);
the transformer task (the LSTM's orthogonal initializer needs a QR, which TF has no bfloat16
kernel for).
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tfclip.keras  # noqa: E402
from tfclip import demo  # noqa: E402


def lstm_task(seed, steps):
    rng = np.random.default_rng(seed)
    x, y = demo.make_data(rng, 64 * steps, 50)
    model = demo.make_model(seed, 50, 128)
    return model, x, y, 64, lambda sd, lr=3e-3, **kw: tfclip.keras.Adam(lr, global_clipnorm=1.0, state_dtype=sd, **kw)


def transformer_task(seed, steps, length=32, d=64):
    rng = np.random.default_rng(seed)
    vals = rng.uniform(0, 1, size=(32 * steps, length)).astype(np.float32)
    x = vals[..., None]
    y = (np.cumsum(vals, axis=1) % 1.0)[..., None].astype(np.float32)
    keras.utils.set_random_seed(seed)
    inp = keras.Input((length, 1))
    h = keras.layers.Dense(d)(inp)
    h = h + keras.layers.Embedding(length, d)(keras.ops.arange(length))
    mask = np.tril(np.ones((length, length), bool))
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, d // 4)(h, h, attention_mask=mask)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(4 * d, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(f))
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    return model, x, y, 32, lambda sd, lr=1e-3, **kw: tfclip.keras.AdamW(lr, weight_decay=0.01, global_clipnorm=1.0,
                                                                       state_dtype=sd, **kw)


def train(task, seed, steps, state_dtype, policy="float32", **opt_kw):
    keras.config.set_dtype_policy(policy)  # (the layers made by `task` take it)
    try:
        model, x, y, batch, make_opt = task(seed, steps)
    finally:
        keras.config.set_dtype_policy("float32")
    opt = make_opt(state_dtype, **opt_kw)
    opt.build(model.trainable_variables)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.cast(model(xb, training=True), tf.float32) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return np.array([float(step(xb, yb)) for xb, yb in ds])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tasks", default="lstm,transformer")
    p.add_argument("--state-dtypes", default="bfloat16,int8")
    p.add_argument("--bf16-weights", action="store_true")
    p.add_argument("--lr", type=float, default=None, help="the optimizer's learning rate (default: the task's)")
    args = p.parse_args(argv)
    tasks = {"lstm": lstm_task, "transformer": transformer_task}
    if args.bf16_weights:
        if args.tasks == p.get_default("tasks"):
            args.tasks = "transformer"
        return bf16_weights(args, tasks)
    low = args.state_dtypes.split(",")
    print(f"TensorFlow {tf.__version__}, keras {keras.__version__}; {args.steps} steps; final loss = mean "
          f"of the last {max(1, args.steps // 10)} steps")
    print(f"{'task':<12} {'seed':>4} {'first':>9} {'fp32 final':>11} " +
          " ".join(f"{sd + ' final':>12} {sd + '/fp32':>13}" for sd in low))
    for name in args.tasks.split(","):
        ratios = {sd: [] for sd in low}
        for seed in map(int, args.seeds.split(",")):
            curves = {sd: train(tasks[name], seed, args.steps, sd) for sd in [None] + low}
            tail = max(1, args.steps // 10)
            final = {sd: float(np.mean(curves[sd][-tail:])) for sd in curves}
            cols = []
            for sd in low:
                ratios[sd].append(final[sd] / final[None])
                cols.append(f"{final[sd]:12.5f} {final[sd] / final[None]:13.3f}")
            print(f"{name:<12} {seed:4d} {curves[None][0]:9.4f} {final[None]:11.5f} " + " ".join(cols), flush=True)
        print(f"{name:<12} {'all':>4} {'':>9} {'':>11} " +
              " ".join(f"{'':>12} {np.mean(ratios[sd]):13.3f}" for sd in low) + " (mean)")


def bf16_weights(args, tasks):
    print(f"TensorFlow {tf.__version__}, keras {keras.__version__}; {args.steps} steps; final loss = mean "
          f"of the last {max(1, args.steps // 10)} steps; bf16: the \"bfloat16\" dtype policy, no float32 masters; "
          f"learning rate {'the task default' if args.lr is None else args.lr}")
    print(f"{'task':<12} {'seed':>4} {'fp32 final':>11} {'bf16 nearest':>13} {'/fp32':>7} {'bf16 stoch.':>12} {'/fp32':>7}")
    for name in args.tasks.split(","):
        ratios = {False: [], True: []}
        for seed in map(int, args.seeds.split(",")):
            tail = max(1, args.steps // 10)
            lr = {} if args.lr is None else {"lr": args.lr}
            fp32 = float(np.mean(train(tasks[name], seed, args.steps, None, **lr)[-tail:]))
            cols = []
            for sr in (False, True):
                final = float(np.mean(train(tasks[name], seed, args.steps, None, "bfloat16",
                                            stochastic_rounding=sr, rounding_seed=seed, **lr)[-tail:]))
                ratios[sr].append(final / fp32)
                cols.append(f"{final:13.5f} {final / fp32:7.3f}" if not sr else f"{final:12.5f} {final / fp32:7.3f}")
            print(f"{name:<12} {seed:4d} {fp32:11.5f} " + " ".join(cols), flush=True)
        print(f"{name:<12} {'all':>4} {'':>11} {'':>13} {np.mean(ratios[False]):7.3f} {'':>12} "
              f"{np.mean(ratios[True]):7.3f} (mean)")


if __name__ == "__main__":
    main()
