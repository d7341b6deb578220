"""shard_state=True (tfclip/_engine/shard.py) under MirroredStrategy over 2 logical CPUs, in a fresh
process (strategies configure devices at start-up; tests/test_distribute_shard.py runs this and reads OUT).

    python tests/harness/sharded_check.py OUT.npz
    TF_CONFIG=... python tests/harness/sharded_check.py OUT.npz worker   # one of 2 worker processes

Every case steps the same variables with the same gradients three ways: sharded on 2 replicas,
unsharded (mirrored slots) on 2 replicas, and on one device given the summed gradient. Replica r's
gradient is (r + 1) * base, so the all-reduced one is base + 2 * base, one float addition, which
the one-device run adds the same way: all three must give the same bits. Saved per case:
`{case}_{run}_vars` / `_slots` (every variable's and slot's values, flattened and concatenated as
float64), the norms, the slot bytes per device, and the checkpoint cases' results.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if sys.argv[2:] != ["worker"]:  # (MirroredStrategy over 2 logical CPUs; a worker has one)
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tfclip  # noqa: E402
import tfclip.tf_keras  # noqa: E402, F401

STEPS = 4
SHAPES = [(200, 40), (40,), (40, 150), (150,), (30, 60), (64, 16)]


def _base(step, nan_at=None):
    rng = np.random.default_rng(100 + step)
    out = [rng.normal(size=s).astype("float32") * (0.05 if i == 1 else 1.0) for i, s in enumerate(SHAPES)]
    if nan_at is not None and step == nan_at[0]:
        out[nan_at[1]][0, 0] = np.nan
    return out


# The cases whose variables are bfloat16 (pure bfloat16 training; stock Keras's all-reduce packs
# the gradients together, so they share one dtype).
BF16 = ("rounding", "bf16_vars")


def _variables(dtype="float32", tf_keras=False):
    rng = np.random.default_rng(7)
    names = ["w0", "b0", "w1", "b1", "wx", "emb"]
    if tf_keras:  # (tf_keras's model variables are tf.Variables)
        return [tf.Variable(tf.cast(rng.normal(size=s).astype("float32"), dtype), name=n) for s, n in zip(SHAPES, names)]
    return [keras.Variable(rng.normal(size=s).astype("float32"), dtype=dtype, name=n) for s, n in zip(SHAPES, names)]


def _unproxied(v):
    """A slot for the slot's checkpoint proxy (tfclip.rules' `variables` across processes)."""
    return v._slot if isinstance(v, tfclip._engine.shard._SlotProxy) else v


def _values(vs):
    out = []
    for v in map(_unproxied, vs):
        if isinstance(v, tfclip._engine.shard.RemoteSlot):  # (kept by another worker process)
            continue
        x = v.value if isinstance(v, keras.Variable) else v
        if isinstance(x, tf.distribute.DistributedValues):
            copies = [c.numpy() for c in x.values]
            for c in copies[1:]:  # every copy the same bits (NaN-aware)
                assert np.asarray(copies[0]).tobytes() == np.asarray(c).tobytes(), v.path
            arr = copies[0]
        else:
            arr = x.numpy()
        out.append(np.asarray(arr, dtype=np.float64).ravel())

    return np.concatenate(out) if out else np.zeros(0)


def _slots(opt):
    skip = {"iteration", "learning_rate", "iterations"}
    return [v for v in opt.variables
            if getattr(v, "path", v.name).split("/")[-1].split(":")[0] not in skip]


def _slot_bytes_by_device(opt):
    by = {}
    for v in map(_unproxied, _slots(opt)):
        if isinstance(v, tfclip._engine.shard.RemoteSlot):
            continue
        x = v.value if isinstance(v, keras.Variable) else v
        n = v.shape.num_elements() * tf.as_dtype(v.dtype).size if v.shape.rank is not None else 0
        devs = [c.device for c in x.values] if isinstance(x, tf.distribute.DistributedValues) else [x.device]
        for d in devs:
            by[d] = by.get(d, 0) + n
    return [by.get(d, 0) for d in sorted(by)]


def _train(strategy, make_opt, *, steps=STEPS, nan_at=None, fn=True, vs=None, opt=None, start=0, dtype="float32",
           tf_keras=False, drop=None):
    """Steps of `make_opt()` on the variables; strategy None: one device, the summed gradient.
    drop: the position of a variable given no gradient (None)."""
    scope = strategy.scope() if strategy is not None else tf.device("/cpu:0")
    with scope:
        vs = vs or _variables(dtype, tf_keras)
        opt = opt or make_opt()
        opt.build(vs)

    def replica_step(t):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        grads = [tf.cast(tf.constant(b) * tf.cast(r + 1, tf.float32), v.dtype) for b, v in zip(_base(t, nan_at), vs)]
        if drop is not None:
            grads[drop] = None
        opt.apply_gradients(zip(grads, vs))

    def one_step(t):
        grads = [tf.cast(tf.constant(b) * 1.0, v.dtype) + tf.cast(tf.constant(b) * 2.0, v.dtype)
                 for b, v in zip(_base(t, nan_at), vs)]
        if drop is not None:
            grads[drop] = None
        opt.apply_gradients(zip(grads, vs))

    for t in range(start, start + steps):
        if strategy is None:
            call = (lambda t=t: one_step(t))
        else:
            call = (lambda t=t: strategy.run(replica_step, (t,)))
        (tf.function(call) if fn else call)()
    return vs, opt


def _record(out, key, vs, opt):
    out[key + "_vars"] = _values(vs)
    out[key + "_slots"] = _values(_slots(opt))
    out[key + "_norm"] = np.float64(opt.global_norm.numpy())
    out[key + "_tnorms"] = opt.tensor_norms.numpy()
    out[key + "_skipped"] = int(opt.skipped_steps.numpy())
    if opt.clipped_units is not None:
        out[key + "_units"] = opt.clipped_units.numpy()
    out[key + "_bytes"] = np.array(_slot_bytes_by_device(opt))
    if getattr(opt, "state_owners", None) is not None:
        out[key + "_owners"] = np.array(opt.state_owners)


CASES = {
    "adam": lambda s: tfclip.keras.Adam(0.01, global_clipnorm=5.0, shard_state=s),
    "adam_amsgrad": lambda s: tfclip.keras.Adam(0.01, amsgrad=True, clipnorm=2.0, shard_state=s),
    "adamw_excluded": lambda s: _adamw_excluding(s),
    "sgd_nesterov": lambda s: tfclip.keras.SGD(0.01, momentum=0.9, nesterov=True, global_clipnorm=1.0, shard_state=s),
    "rmsprop": lambda s: tfclip.keras.RMSprop(0.001, momentum=0.5, centered=True, shard_state=s),
    "adagrad": lambda s: tfclip.keras.Adagrad(0.05, shard_state=s),
    "adadelta": lambda s: tfclip.keras.Adadelta(1.0, shard_state=s),
    "adamax": lambda s: tfclip.keras.Adamax(0.01, shard_state=s),
    "nadam": lambda s: tfclip.keras.Nadam(0.01, shard_state=s),
    "lion": lambda s: tfclip.keras.Lion(0.001, global_clipnorm=1.0, shard_state=s),
    "ftrl": lambda s: tfclip.keras.Ftrl(0.05, l1_regularization_strength=0.01, shard_state=s),
    "lamb": lambda s: tfclip.keras.Lamb(0.01, shard_state=s),
    "adafactor": lambda s: tfclip.keras.Adafactor(0.01, global_clipnorm=1.0, shard_state=s),
    "adafactor_factored": lambda s: tfclip.keras.Adafactor(0.01, factored_state=True, shard_state=s),
    "zclip": lambda s: tfclip.keras.Adam(0.01, clip=tfclip.clipping.ZClip(warmup_steps=2), shard_state=s),
    "agc": lambda s: tfclip.keras.SGD(0.05, momentum=0.9, clip=tfclip.clipping.AGC(0.01), shard_state=s),
    "int8": lambda s: tfclip.keras.Adam(0.01, global_clipnorm=5.0, state_dtype="int8", shard_state=s),
    "bf16_state": lambda s: tfclip.keras.AdamW(0.01, state_dtype="bfloat16", shard_state=s),
    "rounding": lambda s: tfclip.keras.Adam(0.01, stochastic_rounding=True, rounding_seed=5, shard_state=s),
    "bf16_vars": lambda s: tfclip.keras.Adam(0.01, global_clipnorm=5.0, shard_state=s),
    # Muon: the 2-D variables Muon's (each replica the Newton–Schulz products of its own), the rest AdamW
    "muon": lambda s: tfclip.keras.Muon(0.01, global_clipnorm=5.0, shard_state=s),
    "muon_agc": lambda s: tfclip.keras.Muon(0.01, clip=tfclip.clipping.AGC(0.01), shard_state=s),
    # tf_keras (Keras 2) drop-ins, on tf.Variables
    "tfk_adam": lambda s: tfclip.tf_keras.Adam(0.01, global_clipnorm=5.0, shard_state=s),
    "tfk_adamw": lambda s: tfclip.tf_keras.AdamW(0.01, weight_decay=0.1, shard_state=s),
    "tfk_adafactor": lambda s: tfclip.tf_keras.Adafactor(0.01, global_clipnorm=1.0, shard_state=s),
    "tfk_agc": lambda s: tfclip.tf_keras.SGD(0.05, momentum=0.9, clip=tfclip.clipping.AGC(0.01), shard_state=s),
    "tfk_int8": lambda s: tfclip.tf_keras.Adam(0.01, state_dtype="int8", shard_state=s),
}


class _RuleSteps:
    """A tfclip.rules rule stepped by tfclip.fused_clip_apply (in strategy.run: a replica
    context), seen through the optimizer interface the harness reads: the step's outputs kept in
    variables (mirrored, the first replica's: every replica's are the same bits)."""

    def __init__(self, rule, **clip):
        self.rule, self.clip, self.vs = rule, clip, None

    def build(self, vs):
        self.vs = vs
        agg = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.global_norm = tf.Variable(0.0, **agg)
        self.tensor_norms = tf.Variable(tf.zeros([len(vs)]), **agg)
        self.skipped_steps = tf.Variable(0, dtype=tf.int64, **agg)
        agc = isinstance(self.clip.get("clip"), tfclip.clipping.AGC)
        self.clipped_units = tf.Variable(tf.zeros([len(vs)], tf.int64), **agg) if agc else None

    def apply_gradients(self, pairs):
        r = tfclip.fused_clip_apply(pairs, self.rule, **self.clip)
        self.global_norm.assign(r.global_norm)
        self.tensor_norms.assign(r.tensor_norms)
        self.skipped_steps.assign_add(1 - tf.cast(r.applied, tf.int64))
        if self.clipped_units is not None:
            self.clipped_units.assign(r.clipped_units)

    @property
    def variables(self):
        return self.rule.variables

    @property
    def state_owners(self):
        return [self.rule._owner[v.ref()] for v in self.vs] if self.rule._owner else None


CASES.update({
    # tfclip.rules through fused_clip_apply in a replica context
    "rules_adam": lambda s: _RuleSteps(tfclip.rules.Adam(0.01, shard_state=s), global_clipnorm=5.0),
    "rules_nadam": lambda s: _RuleSteps(tfclip.rules.Nadam(0.01, shard_state=s), clipnorm=2.0),
    "rules_agc": lambda s: _RuleSteps(tfclip.rules.Momentum(0.05, 0.9, shard_state=s), clip=tfclip.clipping.AGC(0.01)),
    "rules_zclip": lambda s: _RuleSteps(tfclip.rules.Lamb(0.01, shard_state=s), clip=tfclip.clipping.ZClip(warmup_steps=2)),
    "rules_int8": lambda s: _RuleSteps(tfclip.rules.AdamW(0.01, state_dtype="int8", shard_state=s), global_clipnorm=5.0),
    "rules_adafactor": lambda s: _RuleSteps(tfclip.rules.Adafactor(0.01, factored_state=True, shard_state=s),
                                            global_clipnorm=1.0),
})


def _adamw_excluding(s):
    opt = tfclip.keras.AdamW(0.01, weight_decay=0.1, global_clipnorm=5.0, shard_state=s)
    opt.exclude_from_weight_decay(var_names=["b0", "b1"])
    return opt


def _checkpoints(out, ms, tmp):
    """A sharded optimizer's checkpoint restores into stock Keras on one device and back; a stock
    mirrored one restores into a sharded optimizer; a .keras file loads without a strategy."""
    make = lambda s: tfclip.keras.Adam(0.01, global_clipnorm=5.0, shard_state=s)  # noqa: E731
    # The reference: 4 steps sharded, uninterrupted.
    vs, opt = _train(ms, lambda: make(True), steps=4)
    out["ckpt_want"] = _values(vs)
    # 2 steps sharded, saved; restored into stock keras.optimizers.Adam on one device: 2 more steps.
    vs, opt = _train(ms, lambda: make(True), steps=2)
    path = tf.train.Checkpoint(v=vs, opt=opt).write(os.path.join(tmp, "sharded"))
    with tf.device("/cpu:0"):
        vs1 = _variables()
        stock = keras.optimizers.Adam(0.01, global_clipnorm=5.0)
        stock.build(vs1)
    tf.train.Checkpoint(v=vs1, opt=stock).read(path).assert_consumed()
    out["ckpt_sharded_slots"] = _values(_slots(opt))
    out["ckpt_into_stock_slots"] = _values(_slots(stock))
    # ... and tfclip unsharded on one device continues to the sharded run's bits.
    with tf.device("/cpu:0"):
        vs2 = _variables()
        one = make(False)
        one.build(vs2)
    tf.train.Checkpoint(v=vs2, opt=one).read(path).assert_consumed()
    _train(None, None, steps=2, vs=vs2, opt=one, start=2)
    out["ckpt_sharded_to_one"] = _values(vs2)
    # A stock mirrored checkpoint (2 steps unsharded on 2 replicas) into a sharded optimizer.
    vs3, opt3 = _train(ms, lambda: make(False), steps=2)
    path3 = tf.train.Checkpoint(v=vs3, opt=opt3).write(os.path.join(tmp, "mirrored"))
    with ms.scope():
        vs4 = _variables()
        sharded = make(True)
        sharded.build(vs4)
    tf.train.Checkpoint(v=vs4, opt=sharded).read(path3).assert_consumed()
    _train(ms, None, steps=2, vs=vs4, opt=sharded, start=2)
    out["ckpt_mirrored_to_sharded"] = _values(vs4)
    # tf_keras: a sharded tfclip.tf_keras.Adam's checkpoint into stock tf_keras Adam on one device.
    import tf_keras

    vs5, opt5 = _train(ms, lambda: tfclip.tf_keras.Adam(0.01, shard_state=True), steps=2, tf_keras=True)
    path5 = tf.train.Checkpoint(v=vs5, opt=opt5).write(os.path.join(tmp, "tf_keras"))
    with tf.device("/cpu:0"):
        vs6 = _variables(tf_keras=True)
        stock6 = tf_keras.optimizers.Adam(0.01)
        stock6.build(vs6)
    tf.train.Checkpoint(v=vs6, opt=stock6).read(path5).assert_consumed()
    out["ckpt_tfk_sharded"] = _values(vs5 + _slots(opt5))
    out["ckpt_tfk_into_stock"] = _values(vs6 + _slots(stock6))
    # tfclip.rules: a sharded rule's `variables` (the stock layout: one variable per slot) restore
    # into an unsharded rule on one device, which carries on to the uninterrupted sharded run's bits.
    make_rule = CASES["rules_adam"]
    vs7, o7 = _train(ms, lambda: make_rule(True), steps=2, tf_keras=True)
    path7 = tf.train.Checkpoint(v=vs7, rule=o7.variables).write(os.path.join(tmp, "rule"))
    with tf.device("/cpu:0"):
        vs8 = _variables(tf_keras=True)
        o8 = make_rule(False)
        o8.rule.build(vs8)
    tf.train.Checkpoint(v=vs8, rule=o8.variables).read(path7).assert_consumed()
    _train(None, None, steps=2, vs=vs8, opt=o8, start=2, tf_keras=True)
    out["ckpt_rule_sharded_to_one"] = _values(vs8)
    out["ckpt_rule_want"] = _values(_train(ms, lambda: make_rule(True), steps=4, tf_keras=True)[0])
    # model.fit with a sharded optimizer, saved as .keras, loaded without a strategy.
    x = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    y = x @ np.random.default_rng(2).normal(size=(8, 1)).astype("float32")

    def fit(s):
        with ms.scope():
            keras.utils.set_random_seed(3)
            inp = keras.Input((8,))
            m = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inp)))
            m.compile(optimizer=make(s), loss="mse", jit_compile=False)
        m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        return m

    fs, fu = fit(True), fit(False)
    out["fit_sharded"] = _values(fs.trainable_variables + _slots(fs.optimizer))
    out["fit_unsharded"] = _values(fu.trainable_variables + _slots(fu.optimizer))
    out["fit_owners"] = np.array(fs.optimizer.state_owners)
    fs.save(os.path.join(tmp, "m.keras"))
    loaded = keras.models.load_model(os.path.join(tmp, "m.keras"))
    out["fit_loaded"] = _values(loaded.trainable_variables + _slots(loaded.optimizer))
    out["fit_loaded_config"] = str(loaded.optimizer.get_config().get("shard_state"))


def _edges(out, ms):
    """The sharded step where a replica owns nothing (one variable on 2 replicas: tfclip.rules and
    Keras), with a `use_norm` each replica gives differently (the first replica's is used, as
    unsharded), and with int8 state and IndexedSlices gradients (densified before the norm pass,
    as unsharded): each against the unsharded run (and one device)."""
    rng = np.random.default_rng(11)
    w0 = rng.normal(size=(50, 8)).astype("float32")
    base = [rng.normal(size=(50, 8)).astype("float32") for _ in range(3)]

    def run(strategy, make, steps=3, use_norm=None, sparse=False, nvars=1):
        with strategy.scope() if strategy is not None else tf.device("/cpu:0"):
            stepper = make()
            rule = isinstance(stepper, tfclip.rules.Rule)
            vs = [tf.Variable(w0 * (k + 1)) if rule else keras.Variable(w0 * (k + 1)) for k in range(nvars)]
            if not rule:  # (built lazily in strategy.run, stock Keras fails too)
                stepper.build(vs)

        def grad(t, r, k):
            g = tf.constant(base[t]) * tf.cast((r + 1) * (k + 1), tf.float32)
            if sparse:  # rows 0..9 twice, from each replica
                idx = tf.constant(list(range(10)) * 2)
                return tf.IndexedSlices(tf.gather(g, idx), idx, tf.constant([50, 8]))
            return g

        def apply(grads):
            if rule:
                return tfclip.fused_clip_apply(zip(grads, vs), stepper, global_clipnorm=1.0, **kw).global_norm
            stepper.apply_gradients(zip(grads, vs))
            return stepper.global_norm

        def replica_step(t):
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            if use_norm is not None:  # (each replica its own: the first replica's counts)
                kw["use_norm"] = use_norm * tf.cast(r + 1, tf.float32)
            return apply([grad(t, r, k) for k in range(nvars)])

        def one_step(t):
            return apply([tf.convert_to_tensor(grad(t, 0, k)) + tf.convert_to_tensor(grad(t, 1, k))
                          for k in range(nvars)])

        kw = {}
        for t in range(steps):
            norm = tf.function(lambda t=t: strategy.run(replica_step, (t,)) if strategy is not None
                               else one_step(t))()
        norm = ms.experimental_local_results(norm)[0] if strategy is not None else norm
        if rule and stepper.shard_state:  # (the share of each replica: one owns nothing with one variable)
            assert sorted({stepper._owner[v.ref()] for v in vs}) == list(range(min(nvars, 2)))
        return np.concatenate([_values(vs), np.asarray(norm, np.float64).ravel()])

    adam = lambda s: lambda: tfclip.rules.Adam(0.01, shard_state=s)  # noqa: E731
    keras_adam = lambda s: lambda: tfclip.keras.Adam(0.01, global_clipnorm=1.0, shard_state=s)  # noqa: E731
    out["edge_one_var_rule"] = np.stack([run(ms, adam(True)), run(ms, adam(False)), run(None, adam(False))])
    out["edge_one_var_keras"] = np.stack([run(ms, keras_adam(True)), run(ms, keras_adam(False)),
                                          run(None, keras_adam(False))])
    out["edge_use_norm"] = np.stack([run(ms, adam(True), use_norm=2.0, nvars=2),
                                     run(ms, adam(False), use_norm=2.0, nvars=2)])
    int8 = lambda s: lambda: tfclip.rules.AdamW(0.01, state_dtype="int8", shard_state=s)  # noqa: E731
    out["edge_int8_sparse"] = np.stack([run(ms, int8(True), sparse=True, nvars=2),
                                        run(ms, int8(False), sparse=True, nvars=2)])


def _refusals(out, ms):
    """shard_state's refusals, by message."""
    msgs = []
    for make in (lambda: tfclip.keras.Adam(shard_state=1),):
        try:
            make()
            msgs.append("no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    # In the cross-replica context (apply_gradients outside strategy.run): refused, nothing written.
    with ms.scope():
        vs = _variables()
        opt = tfclip.keras.Adam(0.01, shard_state=True)
        opt.build(vs)
    before = _values(vs)
    try:
        opt.apply_gradients(zip([tf.ones(v.shape, v.dtype) for v in vs], vs))
        msgs.append("no error")
    except ValueError as e:
        msgs.append(f"ValueError: {e}")
    out["refusal_unchanged"] = np.array_equal(before, _values(vs))
    out["refusals"] = np.array(msgs)
    # tfclip.rules: the same two, from the rule's constructor and from fused_clip_apply
    msgs = []
    try:
        tfclip.rules.Adam(shard_state=1)
        msgs.append("no error")
    except TypeError as e:
        msgs.append(f"TypeError: {e}")
    with ms.scope():
        vs = [tf.Variable(np.ones(s, np.float32)) for s in SHAPES]
    rule = tfclip.rules.Adam(0.01, shard_state=True)
    try:
        with ms.scope():  # (the cross-replica context)
            tfclip.fused_clip_apply(zip([tf.ones(v.shape) for v in vs], vs), rule, global_clipnorm=1.0)
        msgs.append("no error")
    except ValueError as e:
        msgs.append(f"ValueError: {e}")
    out["rule_refusal_unchanged"] = all(np.array_equal(v.numpy(), np.ones(v.shape)) for v in vs) and not rule._slots
    out["rule_refusals"] = np.array(msgs)


def _chief_wrote(ms):
    """A barrier: an all-reduce every worker joins, so no worker reads the chief's checkpoint
    before the chief has finished writing it. A checkpoint's write broadcasts sharded slots, but
    a worker leaves its last broadcast before the chief's files are on disk (a loaded CI machine
    lost that race)."""
    ms.reduce("SUM", ms.run(lambda: tf.constant(1.0)), axis=None).numpy()


def _scatters():
    return tfclip._engine.shard.scatter_count


def _reduces():
    return tfclip._engine.collectives.reduce_count


def _against_the_ring(out, ms):
    """tfclip's all-reduce in pieces (tfclip/_engine/collectives.py) against TF's own (the
    strategy's ring all-reduce) on the same per-replica tensors: float32, bfloat16 and float16 in
    one call (each dtype its own parts), sizes that split unevenly, one piece and many (PIECE 7),
    a tensor of no elements. (TF's packing takes one dtype per call: one call each.)"""
    from tfclip._engine import collectives

    shapes = [(3, 5), (1,), (0,), (1000,), (2, 2, 2)]
    dtypes = (tf.float32, tf.bfloat16, tf.float16)

    def values(dtype):
        r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        return [tf.cast(tf.sin(tf.reshape(tf.range(float(np.prod(s))), s) * (1.7 + r) + 0.25) * (3.0 + r), dtype)
                for s in shapes]

    def ring():
        ctx = tf.distribute.get_replica_context()
        return [t for d in dtypes for t in ctx.all_reduce("SUM", values(d))]

    for piece in (collectives.PIECE, 7):
        saved, collectives.PIECE = collectives.PIECE, piece
        try:
            ours = tf.function(lambda: ms.run(lambda: collectives.all_reduce([t for d in dtypes for t in values(d)])))()
            theirs = tf.function(lambda: ms.run(ring))()
        finally:
            collectives.PIECE = saved

        def flat(ts):
            return np.concatenate([np.asarray(tf.cast(ms.experimental_local_results(t)[0], tf.float64)).ravel()
                                   for t in ts])
        out[f"ring_{piece}_ours"], out[f"ring_{piece}_tf"] = flat(ours), flat(theirs)
        out[f"ring_{piece}_kinds"] = np.array([list(ms.experimental_local_results(t)[0].shape) == list(s)
                                               and ms.experimental_local_results(t)[0].dtype == d
                                               for t, (d, s) in zip(ours, [(d, s) for d in dtypes for s in shapes])])


def worker(path):
    """One of 2 MultiWorkerMirroredStrategy processes (TF_CONFIG): sharded across the processes,
    each keeps the slots of its share; the weights against the unsharded run's and one device's,
    and a checkpoint every worker saves (the chief's file: every slot under its stock key) read
    into stock Keras on one device and into a fresh sharded optimizer that carries on."""
    import json

    ms = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = {"task": task, "replicas": ms.num_replicas_in_sync}
    for case in ("adam", "adafactor", "agc", "muon", "tfk_adam", "tfk_adafactor"):
        for run, strategy, shard in (("sharded", ms, True), ("mirrored", ms, False), ("one", None, False)):
            before, reduces = _scatters(), _reduces()
            vs, opt = _train(strategy, lambda: CASES[case](shard), tf_keras=case.startswith("tfk_"))
            _record(out, f"{case}_{run}", vs, opt)
            out[f"{case}_{run}_scatters"] = _scatters() - before
            out[f"{case}_{run}_reduces"] = _reduces() - reduces
    _against_the_ring(out, ms)
    # tf_keras with a variable given no gradient: the others summed in pieces, None kept in its place
    for run, strategy in (("mirrored", ms), ("one", None)):
        reduces = _reduces()
        vs, opt = _train(strategy, lambda: CASES["tfk_adam"](False), tf_keras=True, drop=1)
        _record(out, f"tfk_none_{run}", vs, opt)
        out[f"tfk_none_{run}_reduces"] = _reduces() - reduces
    # Across processes the sharded step reduce-scatters (tfclip/_engine/shard.py): a non-finite
    # step is skipped on every replica, and with gradients summed in bfloat16 the sharded step is
    # the unsharded one's bits too (TF's bfloat16 ring sum, a + b rounded, as the all-to-all's).
    scatters = tfclip._engine.shard.scatter_count
    for run, strategy, shard in (("sharded", ms, True), ("mirrored", ms, False)):
        vs, opt = _train(strategy, lambda: CASES["adam"](shard), nan_at=(2, 0))
        _record(out, f"nan_{run}", vs, opt)
        vs, opt = _train(strategy, lambda: tfclip.keras.Adam(0.01, global_clipnorm=5.0, reduce_dtype="bfloat16",
                                                             shard_state=shard))
        _record(out, f"bf16_reduce_{run}", vs, opt)
    out["scatters"] = tfclip._engine.shard.scatter_count - scatters
    # The collectives in many pieces (777 elements a piece: uneven, and
    # the all-gather's shorter replica padded), AGC's counts gathered beside the variables.
    piece, tfclip._engine.collectives.PIECE = tfclip._engine.collectives.PIECE, 777
    try:
        for case in ("adam", "agc"):
            vs, opt = _train(ms, lambda: CASES[case](True))
            _record(out, f"{case}_pieces", vs, opt)
        for case in ("adam", "tfk_adam"):  # (unsharded: the all-reduce in pieces)
            vs, opt = _train(ms, lambda: CASES[case](False), tf_keras=case.startswith("tfk_"))
            _record(out, f"{case}_pieces_unsharded", vs, opt)
    finally:
        tfclip._engine.collectives.PIECE = piece
    # int8 and bfloat16 state: sharded across the processes against one device; mirrored across
    # processes TF cannot make them (no uint8 / bfloat16 collective broadcast), refused naming why
    refusals = []
    for case in ("int8", "bf16_state", "tfk_int8"):
        for run, strategy, shard in (("sharded", ms, True), ("one", None, False)):
            before = _scatters()
            vs, opt = _train(strategy, lambda: CASES[case](shard), tf_keras=case.startswith("tfk_"))
            _record(out, f"{case}_{run}", vs, opt)
            out[f"{case}_{run}_scatters"] = _scatters() - before
        try:
            _train(ms, lambda: CASES[case](False), tf_keras=case.startswith("tfk_"), steps=1)
            refusals.append("no error")
        except ValueError as e:
            refusals.append(str(e))
    # tfclip.rules makes its slots on its first step, in the strategy's scope: refused the same way
    with ms.scope():
        v = tf.Variable(np.ones(300, np.float32))
        try:
            tfclip.rules.Adam(0.01, state_dtype="int8").slots(v)
            refusals.append("no error")
        except ValueError as e:
            refusals.append(str(e))
    out["narrow_mirrored_refusals"] = np.array(refusals)
    # tfclip.rules through fused_clip_apply: sharded across the processes (a slot kept elsewhere a
    # RemoteSlot here), int8 state too
    for case in ("rules_adam", "rules_int8"):
        runs = (("sharded", ms, True), ("one", None, False)) + ((("mirrored", ms, False),) if case == "rules_adam" else ())
        for run, strategy, shard in runs:
            before, reduces = _scatters(), _reduces()
            vs, opt = _train(strategy, lambda: CASES[case](shard), tf_keras=True)
            _record(out, f"{case}_{run}", vs, opt)
            out[f"{case}_{run}_scatters"] = _scatters() - before
            out[f"{case}_{run}_reduces"] = _reduces() - reduces
    # ... and its checkpoint: every worker saves `rule.variables`; the chief's file holds every
    # slot (stock layout): an unsharded rule on one device restores it whole and matches the
    # unsharded run's slots, and a fresh sharded rule (built first) carries on to the
    # uninterrupted run's bits.
    tmp = os.path.dirname(os.path.abspath(path))
    make_rule = CASES["rules_adam"]
    out["rules_ckpt_want"] = _values(_train(ms, lambda: make_rule(True), steps=4, tf_keras=True)[0])
    vs7, o7 = _train(ms, lambda: make_rule(True), steps=2, tf_keras=True)
    out["rules_remote_slots"] = sum(isinstance(_unproxied(v), tfclip._engine.shard.RemoteSlot) for v in o7.variables)
    tf.train.Checkpoint(v=vs7, rule=o7.variables).write(os.path.join(tmp, "rk" if task == 0 else f"rk_worker{task}"))
    _chief_wrote(ms)
    vs_m, o_m = _train(ms, lambda: make_rule(False), steps=2, tf_keras=True)
    out["rules_ckpt_mirrored_slots"] = _values(_slots(o_m))
    with tf.device("/cpu:0"):
        vs8 = _variables(tf_keras=True)
        o8 = make_rule(False)
        o8.rule.build(vs8)
    tf.train.Checkpoint(v=vs8, rule=o8.variables).read(os.path.join(tmp, "rk")).assert_consumed()
    out["rules_ckpt_into_one_slots"] = _values(_slots(o8))
    with ms.scope():
        vs9 = _variables(tf_keras=True)
        o9 = make_rule(True)
        o9.rule.build(vs9)
    tf.train.Checkpoint(v=vs9, rule=o9.variables).read(os.path.join(tmp, "rk")).assert_consumed()
    _train(ms, None, steps=2, vs=vs9, opt=o9, start=2, tf_keras=True)
    out["rules_ckpt_resumed"] = _values(vs9)
    # One variable: worker 0 keeps all of the rule's state, and each worker still keeps an exchange,
    # so both checkpoints make the same broadcasts (else worker 1 waits for a broadcast worker 0
    # never sends). The chief's file restores on one device to that device's own run.
    shape = (40, 8)
    with ms.scope():
        v1 = tf.Variable(np.ones(shape, np.float32))
    rule1 = tfclip.rules.Adam(0.01, shard_state=True)
    step1 = tf.function(lambda: ms.run(lambda: tfclip.fused_clip_apply(
        [(tf.fill(shape, 0.5), v1)], rule1, global_clipnorm=1.0).applied))
    step1()
    step1()
    tf.train.Checkpoint(rule=rule1.variables).write(os.path.join(tmp, "r1" if task == 0 else f"r1_worker{task}"))
    _chief_wrote(ms)
    with tf.device("/cpu:0"):
        w1, w2 = tf.Variable(np.ones(shape, np.float32)), tf.Variable(np.ones(shape, np.float32))
        into, ref = tfclip.rules.Adam(0.01), tfclip.rules.Adam(0.01)
        into.build([w1])
        for _ in range(2):  # (0.5 from each worker: 1.0)
            tfclip.fused_clip_apply([(tf.fill(shape, 1.0), w2)], ref, global_clipnorm=1.0)
    tf.train.Checkpoint(rule=into.variables).read(os.path.join(tmp, "r1")).assert_consumed()
    out["one_var"] = np.stack([_values([v1]), _values([w2])])
    out["one_var_slots"] = np.stack([_values(into.variables), _values(ref.variables)])
    make = CASES["adam"]
    vs, opt = _train(ms, lambda: make(True), steps=4)
    out["ckpt_want"] = _values(vs)
    vs, opt = _train(ms, lambda: make(True), steps=2)
    out["remote_slots"] = sum(isinstance(v, tfclip._engine.shard.RemoteSlot) for v in opt.variables)
    try:
        opt.variables[[isinstance(v, tfclip._engine.shard.RemoteSlot) for v in opt.variables].index(True)].numpy()
    except ValueError as e:
        out["remote_numpy"] = str(e)
    prefix = os.path.join(tmp, "ck" if task == 0 else f"ck_worker{task}")  # (the chief's is the one)
    tf.train.Checkpoint(v=vs, opt=opt).write(prefix)
    _chief_wrote(ms)
    vs_m, opt_m = _train(ms, lambda: make(False), steps=2)  # (also every worker past the chief's write)
    out["ckpt_mirrored_slots"] = _values(_slots(opt_m))
    chief = os.path.join(tmp, "ck")
    with tf.device("/cpu:0"):
        vs1 = _variables()
        stock = keras.optimizers.Adam(0.01, global_clipnorm=5.0)
        stock.build(vs1)
    tf.train.Checkpoint(v=vs1, opt=stock).read(chief).assert_consumed()
    out["ckpt_into_stock_slots"] = _values(_slots(stock))
    out["ckpt_into_stock_vars"] = _values(vs1)
    out["ckpt_sharded_vars"] = _values(vs)
    # tf_keras: every worker saves a sharded tfclip.tf_keras.Adam; stock tf_keras Adam reads the chief's
    import tf_keras

    vs5, opt5 = _train(ms, lambda: tfclip.tf_keras.Adam(0.01, shard_state=True), steps=2, tf_keras=True)
    tf.train.Checkpoint(v=vs5, opt=opt5).write(os.path.join(tmp, "tk" if task == 0 else f"tk_worker{task}"))
    _chief_wrote(ms)
    vs_t, opt_t = _train(ms, lambda: tfclip.tf_keras.Adam(0.01), steps=2, tf_keras=True)
    with tf.device("/cpu:0"):
        vs6 = _variables(tf_keras=True)
        stock6 = tf_keras.optimizers.Adam(0.01)
        stock6.build(vs6)
    tf.train.Checkpoint(v=vs6, opt=stock6).read(os.path.join(tmp, "tk")).assert_consumed()
    out["ckpt_tfk_into_stock"] = _values(vs6 + _slots(stock6))
    out["ckpt_tfk_mirrored"] = _values(vs_t + _slots(opt_t))
    with ms.scope():
        vs2 = _variables()
        again = make(True)
        again.build(vs2)
    tf.train.Checkpoint(v=vs2, opt=again).read(chief).assert_consumed()
    _train(ms, None, steps=2, vs=vs2, opt=again, start=2)
    out["ckpt_resumed"] = _values(vs2)
    np.savez(path, **out)


def main(path):
    ms = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert ms.num_replicas_in_sync == 2
    out = {}
    only = os.environ.get("SHARD_CASES")
    for case, make in CASES.items():
        if only and case not in only.split(","):
            continue
        for run, strategy, shard in (("sharded", ms, True), ("mirrored", ms, False), ("one", None, False)):
            vs, opt = _train(strategy, lambda: make(shard), dtype="bfloat16" if case in BF16 else "float32",
                             tf_keras=case.startswith(("tfk_", "rules_")))
            _record(out, f"{case}_{run}", vs, opt)
    vs, opt = _train(ms, lambda: CASES["adam"](True), fn=False)
    _record(out, "eager_sharded", vs, opt)
    if not only or "rules_adam" in only:
        vs, opt = _train(ms, lambda: CASES["rules_adam"](True), fn=False, tf_keras=True)
        _record(out, "eager_rules_sharded", vs, opt)
    for run, strategy, shard in (("sharded", ms, True), ("mirrored", ms, False)):
        vs, opt = _train(strategy, lambda: CASES["adam"](shard), nan_at=(2, 0))
        _record(out, f"nan_{run}", vs, opt)
        if not only or "rules_adam" in only:  # (tfclip.rules: the same through fused_clip_apply)
            vs, opt = _train(strategy, lambda: CASES["rules_adam"](shard), nan_at=(2, 0), tf_keras=True)
            _record(out, f"rules_nan_{run}", vs, opt)
    if not only:
        _checkpoints(out, ms, os.path.dirname(os.path.abspath(path)))
        _refusals(out, ms)
        _edges(out, ms)
    np.savez(path, **out)


if __name__ == "__main__":
    (worker if sys.argv[2:] == ["worker"] else main)(sys.argv[1])
