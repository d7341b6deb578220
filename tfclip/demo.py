"""tfclip demo: train a small LSTM on a synthetic sequence task with exploding gradients.

    python -m tfclip.demo [--steps 40] [--clip 1.0]

The data is generated here (the "adding problem": sum the two marked values of a long noisy
sequence). The LSTM starts with a large recurrent gain, so early gradients are large; every step
clips them by their global norm and applies Adam in one fused op. It prints loss and the pre-clip
global norm per step, then times the update (clip + apply) and the whole training step against
`tf.clip_by_global_norm` + Keras Adam, both in `tf.function`.
"""
import argparse
import os
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
    args = p.parse_args(argv)

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
        return loss, res.global_norm, res.applied

    print(f"tfclip {tfclip.__version__} on TensorFlow {tf.__version__}: LSTM({args.units}) on the "
          f"adding problem, length {args.length}, batch {args.batch}, global_clipnorm={args.clip}")
    print(f"{'step':>5} {'loss':>10} {'global norm':>12}  clipped")
    first_loss = None
    for step in range(args.steps):
        sl = slice(step * args.batch, (step + 1) * args.batch)
        loss, norm, applied = fused_step(x[sl], y[sl])
        first_loss = first_loss if first_loss is not None else float(loss)
        print(f"{step:5d} {float(loss):10.4f} {float(norm):12.4f}  "
              f"{'yes' if float(norm) > args.clip else 'no'}{'' if bool(applied) else ' (skipped: non-finite)'}")
    print(f"loss {first_loss:.4f} -> {float(loss):.4f} over {args.steps} steps")

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


if __name__ == "__main__":
    main()
