"""Three MultiWorkerMirroredStrategy worker processes (tests/test_distribute_three.py runs them):
past two replicas the order of a sum matters, and tfclip adds the replicas' parts in replica order
(tfclip/_engine/collectives.py) in the unsharded all-reduce and in shard_state's reduce-scatter
alike. Replica r's gradient is base * SCALES[r] (magnitudes apart, so that (a + b) + c and
a + (b + c) differ in some elements); each worker saves:

- `sum_{i}`: tfclip's all-reduce of the gradients of step 0 (its tensor i), and `ring_{i}`: TF's
  own ring all-reduce of the same (recorded, not compared: its order is TF's);
- `{run}_vars`, `{run}_norm`: tfclip.keras.Adam(global_clipnorm) after STEPS steps, unsharded
  ("mirrored") and with shard_state=True ("sharded"), and the slot bytes this process holds;
- on one device (no strategy), the same optimizer given NumPy's float32 replica-order sums: `one_vars`.

    TF_CONFIG=... python tests/harness/three_workers.py OUT.npz
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfclip  # noqa: E402
from tfclip._engine import collectives  # noqa: E402

STEPS = 3
SHAPES = [(40, 25), (25,), (9, 11), (3,)]
SCALES = [1.0, 3.3e-3, 7.1]


def base(step):
    rng = np.random.default_rng(300 + step)
    return [rng.normal(size=s).astype("float32") for s in SHAPES]


def replica_order_sum(step):
    out = []
    for b in base(step):
        total = b * np.float32(SCALES[0])
        for s in SCALES[1:]:
            total = total + b * np.float32(s)  # (float32 throughout: ((g0 + g1) + g2))
        out.append(total)
    return out


def _grads(step):
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    scale = tf.gather(tf.constant(SCALES, tf.float32), r)
    return [tf.constant(b) * scale for b in base(step)]


def _variables():
    return [tf.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype="float32").reshape(s)) for s in SHAPES]


def _train(strategy, shard):
    with strategy.scope():
        vs = _variables()
        opt = tfclip.keras.Adam(0.01, global_clipnorm=2.0, shard_state=shard)
        opt.build(vs)
    for t in range(STEPS):
        tf.function(lambda t=t: strategy.run(lambda: opt.apply_gradients(zip(_grads(t), vs))))()
    held = sum(int(np.prod(s.shape)) for s in opt._momentums + opt._velocities
               if not isinstance(s, tfclip._engine.shard.RemoteSlot))  # (the slots this process keeps)
    return np.concatenate([v.numpy().ravel() for v in vs]), np.float64(opt.global_norm.numpy()), held


def main(path):
    ms = tf.distribute.MultiWorkerMirroredStrategy()
    out = {"task": json.loads(os.environ["TF_CONFIG"])["task"]["index"], "replicas": ms.num_replicas_in_sync}
    before = collectives.reduce_count
    ours = tf.function(lambda: ms.run(lambda: collectives.all_reduce(_grads(0))))()
    ring = tf.function(lambda: ms.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", _grads(0))))()
    out["reduces"] = collectives.reduce_count - before
    for i in range(len(SHAPES)):
        out[f"sum_{i}"] = ms.experimental_local_results(ours[i])[0].numpy()
        out[f"ring_{i}"] = ms.experimental_local_results(ring[i])[0].numpy()
    for run, shard in (("mirrored", False), ("sharded", True)):
        out[f"{run}_vars"], out[f"{run}_norm"], out[f"{run}_held"] = _train(ms, shard)
    with tf.device("/cpu:0"):
        vs = _variables()
        opt = tfclip.keras.Adam(0.01, global_clipnorm=2.0)
        for t in range(STEPS):
            tf.function(lambda t=t: opt.apply_gradients(zip([tf.constant(g) for g in replica_order_sum(t)], vs)))()
        out["one_vars"] = np.concatenate([v.numpy().ravel() for v in vs])
        out["one_norm"] = np.float64(opt.global_norm.numpy())
    np.savez(path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
