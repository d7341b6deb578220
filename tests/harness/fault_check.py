"""Faults across 2 MultiWorkerMirroredStrategy worker processes (issue 68, item 6), one run per
mode, each worker writing its own `{mode}_w{task}.json` / `.npz` in FOLDER
(tests/test_distribute_faults.py starts them and reads what they leave):

    TF_CONFIG=... python tests/harness/fault_check.py FOLDER dead|hung|resume

- dead: both workers train a sharded (`shard_state=True`) and an unsharded `tfclip.keras.Adam`
  two steps, write a checkpoint of both (every worker writes; the chief's file is the one), then
  worker 1 exits abruptly (as a crash does) 3 s after worker 0 went into step 2; worker 0
  records the error step 2 ends with and how long it took. No collective timeout is set: TF's coordination
  service, which every MultiWorkerMirroredStrategy worker heartbeats to, is what notices.
- hung: the same, the strategy given a collective timeout (`CommunicationOptions`), and worker 1
  stops (sleeps) instead: it still heartbeats, so only the timeout can end worker 0's wait.
- resume: two fresh workers restore each fault run's checkpoint (the chief's file) into fresh
  optimizers and variables, take steps 2 and 3, and beside them take steps 0 to 3 without a
  break: the bits to compare.

Replica r's gradient at step t is (r + 1) times a fixed draw, so the summed gradient is the same
on every run.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HUNG_TIMEOUT_S = 45.0  # (long enough that a loaded machine's slow first steps never meet it)
SHAPES = [(64, 32), (32,), (32, 48), (48,), (300, 16)]
TASK = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def _strategy(timeout=None):
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def _models(ms):
    """A sharded and an unsharded Adam, each on its own variables, built."""
    import keras

    import tfclip

    out = {}
    with ms.scope():
        for key, shard in (("sharded", True), ("unsharded", False)):
            rng = np.random.default_rng(7)
            vs = [keras.Variable(rng.normal(size=s).astype("float32"), name=f"{key}{i}") for i, s in enumerate(SHAPES)]
            opt = tfclip.keras.Adam(0.01, global_clipnorm=1.0, shard_state=shard)
            opt.build(vs)
            out[key] = (vs, opt)
    return out


def _stepper(ms, vs, opt):
    @tf.function
    def step(t):
        def replica():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)
            grads = [tf.random.stateless_normal(s, seed=tf.stack([t, i])) * r for i, s in enumerate(SHAPES)]
            opt.apply_gradients(zip(grads, vs))
        ms.run(replica)
    return lambda t: step(tf.constant(t, tf.int32))


def _checkpoint(models):
    objs = {}
    for key, (vs, opt) in models.items():
        objs[f"{key}_vars"], objs[f"{key}_opt"] = vs, opt
    return tf.train.Checkpoint(**objs)


def _values(models):
    """Each model's variables and optimizer state as one float64 vector (the slots this worker
    keeps; every copy checked equal)."""
    import tfclip

    out = {}
    for key, (vs, opt) in models.items():
        parts = []
        for v in list(vs) + list(opt.variables):
            if isinstance(v, tfclip._engine.shard.RemoteSlot):
                continue
            x = getattr(v, "value", v)
            copies = [c.numpy() for c in x.values] if isinstance(x, tf.distribute.DistributedValues) else [x.numpy()]
            assert all(np.asarray(c).tobytes() == np.asarray(copies[0]).tobytes() for c in copies)
            parts.append(np.asarray(copies[0], np.float64).ravel())
        out[key] = np.concatenate(parts)
    return out


def fault(folder, mode):
    ms = _strategy(HUNG_TIMEOUT_S if mode == "hung" else None)
    models = _models(ms)
    steps = {k: _stepper(ms, *m) for k, m in models.items()}
    for t in range(2):
        for k in models:
            steps[k](t)
    _checkpoint(models).write(os.path.join(folder, f"{mode}_ck" if TASK == 0 else f"{mode}_ck_worker{TASK}"))
    # every worker past the chief's write before anyone goes on (and the file whole on disk)
    ms.reduce("SUM", ms.run(lambda: tf.constant(1.0)), axis=None).numpy()
    if TASK == 0:  # (the test may start the resume run now, while this one waits out its fault)
        with open(os.path.join(folder, f"{mode}_ck.written"), "w") as f:
            f.write("the chief's checkpoint is whole on disk")
    if TASK == 1:
        sys.stdout.flush()
        if mode == "dead":
            time.sleep(3)  # (worker 0 is waiting inside step 2's all-reduce by now)
            os._exit(17)  # (no cleanup, no goodbye to the coordination service: a crash)
        time.sleep(3600)  # (the test kills it once worker 0 has reported)
    # (the sharded optimizer's checkpoint broadcasts carry the strategy's timeout too)
    got = {"mode": mode, "exchange_timeout": models["sharded"][1]._tfclip_exchange.timeout}
    start = time.monotonic()
    try:
        steps["sharded"](2)
        got["error"] = None
    except tf.errors.OpError as e:
        got["error"], got["message"] = type(e).__name__, str(e)
    got["seconds"] = time.monotonic() - start
    with open(os.path.join(folder, f"{mode}_w{TASK}.json"), "w") as f:
        json.dump(got, f)
    sys.stdout.flush()
    os._exit(0)  # (a normal exit would wait at the coordination service's shutdown barrier for the lost worker)


def resume(folder):
    ms = _strategy()
    out = {}
    for src in ("dead", "hung"):
        models = _models(ms)
        _checkpoint(models).read(os.path.join(folder, f"{src}_ck")).assert_consumed()
        steps = {k: _stepper(ms, *m) for k, m in models.items()}
        for t in (2, 3):
            for k in models:
                steps[k](t)
        for k, v in _values(models).items():
            out[f"{src}_{k}"] = v
    models = _models(ms)
    steps = {k: _stepper(ms, *m) for k, m in models.items()}
    for t in range(4):
        for k in models:
            steps[k](t)
    for k, v in _values(models).items():
        out[f"uninterrupted_{k}"] = v
    np.savez(os.path.join(folder, f"resume_w{TASK}.npz"), **out)


if __name__ == "__main__":
    folder, mode = sys.argv[1], sys.argv[2]
    resume(folder) if mode == "resume" else fault(folder, mode)
