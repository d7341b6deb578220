"""fused_clip_apply under tf.distribute (tfclip/ops.py calls `mirrored_step`): a rule's step in a
replica context or across replicas, every copy of every variable updated alike, or (shard_state)
each replica's share of the state, the gradients all-reduced or, across worker processes,
reduce-scattered (tfclip/_engine/shard.py)."""
import tensorflow as tf
from tensorflow.python.distribute import values as _dist_values

from tfclip import clipping
from tfclip._engine import collectives as _coll
from tfclip._engine import reduce as _reduce
from tfclip._engine import shard as _shard
from tfclip._engine.opcall import ClipApplyResult

# A replica writing its own copy of a mirrored variable would let the copies drift apart for
# good. Stock assignments in a replica context aggregate across replicas by the variable's
# `aggregation`; the stock optimizers all-reduce the gradients (a sum) and apply once, in the
# cross-replica context, to every copy. tfclip does the same: the gradients of the replicas are
# aggregated as each variable asks (MEAN: their mean, SUM: their sum, ONLY_FIRST_REPLICA: the
# first replica's; NONE, the default of tf.Variable and Keras weights: the sum, as Keras's and
# TF1's optimizers all-reduce), then clipped (after the aggregation, as tfclip's Keras
# optimizers clip) and applied by one fused op per device, with the same inputs on every device,
# so every copy gets the same bits. Variables that are not mirrored are refused, by name.


def mirrored_step(grads, variables, rule, clip_mode, clip, use_norm, nonfinite, lazy, name, scale_kw):
    """The step under a strategy of more than one replica, or None where a plain step serves
    (no strategy, one replica, or, in the cross-replica context, no distributed variable)."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync <= 1:
        return None
    replica = tf.distribute.get_replica_context()  # None in the cross-replica context
    if replica is None and not any(isinstance(v, tf.distribute.DistributedValues) for v in variables):
        return None
    _check_mirrored(variables, strategy, replica is not None)
    step = dict(clip_mode=clip_mode, clip=clip, nonfinite=nonfinite, lazy_sparse=lazy, **scale_kw)
    scope = name or f"clip_apply_{rule.kind}"
    if rule.shard_state:
        if replica is None:
            raise ValueError(f"{rule.name}(shard_state=True): fused_clip_apply steps inside strategy.run; in the "
                             "cross-replica context no replica owns a share of the state")
        return _sharded_step(replica, grads, variables, rule, step, use_norm, scope)

    def merge(strategy, grads, use_norm):
        use_norm = _first_replica(strategy, use_norm)
        with tf.name_scope(scope):
            return _update_every_copy(strategy, _aggregate(strategy, grads, variables), variables, rule,
                                      dict(step, use_norm=use_norm))

    if replica is None:  # given in the cross-replica context: one gradient for every copy
        result = merge(strategy, [(g, None) for g in grads], use_norm)
        return ClipApplyResult(*[strategy.experimental_local_results(t)[0] for t in result])
    return ClipApplyResult(*replica.merge_call(merge, args=(_replica_contributions(replica, grads, variables, rule),
                                                            use_norm)))


def _sharded_step(replica, grads, variables, rule, step, use_norm, scope):
    """shard_state=True (tfclip/_engine/shard.py): the gradients aggregated as unsharded, then on each
    replica the norm pass over every one of them (or `use_norm`), the fused op over the variables
    whose state the replica keeps, and the all-gather of the updated variables into every copy."""
    def merge(strategy, contributions, use_norm):
        rule.build(variables)  # (each variable's owner, then its slots, made there)
        _check_mirrored_state(strategy, rule, rule._state_variables([]))  # (the counter, Nadam's product)
        return _aggregate(strategy, contributions, variables), _first_replica(strategy, use_norm)

    # Across worker processes, where every gradient is summed (no MEAN or ONLY_FIRST_REPLICA
    # variable) and the norm is the step's own: a reduce-scatter (each replica receives only its
    # own variables' sums, and the norms: tfclip/_engine/shard.py) instead of the all-reduce.
    owners = None
    if use_norm is None and _coll.available(tf.distribute.get_strategy()) and all(
            v.aggregation in (tf.VariableAggregation.NONE, tf.VariableAggregation.SUM) for v in variables):
        replica.merge_call(lambda strategy: merge(strategy, [], None))  # (builds the rule: its owners)
        owners = rule.state_owners(variables)
        cast = _reduce.cast(grads, variables, rule.reduce_dtype, rule.name)
        owners = owners if _shard.scatters(cast, owners) else None
    if owners is not None:
        return _shard.scattered_step(cast, owners, lambda summed: _sharded_apply(summed, variables, rule, step,
                                                                                 None, scope))
    grads, use_norm = replica.merge_call(merge, args=(_replica_contributions(replica, grads, variables, rule),
                                                      use_norm))
    return _sharded_apply(grads, variables, rule, step, use_norm, scope)


def _sharded_apply(grads, variables, rule, step, use_norm, scope):
    """The sharded step after the gradients' sums: the replica's share of the fused op, the
    all-gather of the updated variables."""
    # int8 state takes dense gradients, densified before the norm pass as the unsharded op does
    grads = rule._int8_dense(grads, variables)
    with tf.name_scope(scope):
        share = _shard.begin(grads, rule.state_owners(variables), use_norm)
        result = rule._apply([grads[i] for i in share.own], [variables[i] for i in share.own],
                             **dict(step, use_norm=share.use_norm))
        agc = isinstance(step["clip"], clipping.AGC)
        norms, units = _shard.finish(share, variables, result, step.get("grad_scale"), agc=agc)
        units = tf.cast(units, tf.int64) if agc else tf.zeros([len(grads)], tf.int64)
        if tf.executing_eagerly():
            return ClipApplyResult(result.global_norm, result.applied, norms, units)
        with tf.control_dependencies([norms]):  # (the norms depend on the all-gather's writes)
            return ClipApplyResult(tf.identity(result.global_norm), tf.identity(result.applied), norms, units)


def _first_replica(strategy, value):
    """A value given per replica (use_norm), as the step takes it: the first replica's."""
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _check_mirrored_state(strategy, rule, state):
    for s in state:
        if not isinstance(s, tf.distribute.DistributedValues):
            raise ValueError(
                f"{rule.name}'s state variable {s.name} was made outside {type(strategy).__name__}'s "
                "scope, so it is not mirrored: use a new rule under the strategy (a rule's state is "
                "made on its first step).")


def _replica_contributions(replica, grads, variables, rule):
    """Each gradient as this replica contributes it to the all-reduce: (value, reduction). A
    fresh tensor per replica (merge_call sees one value per replica, never a shared object), and
    for an ONLY_FIRST_REPLICA variable the first replica's gradient alone (the others send zeros,
    so a sum across every worker is the first replica's, exactly). With the rule's reduce_dtype,
    a float32 variable's dense gradient in 16 bits (tfclip/_engine/reduce.py). Across worker
    processes on CPUs, where every gradient is dense and summed: the sums themselves (reduction
    None), by tfclip's all-reduce in pieces (tfclip/_engine/collectives.py)."""
    grads = _reduce.cast(grads, variables, rule.reduce_dtype, rule.name)
    if all(v.aggregation in (tf.VariableAggregation.NONE, tf.VariableAggregation.SUM) for v in variables) \
            and _coll.in_step(grads):
        return [(g, None) for g in _coll.all_reduce(grads)]
    first = tf.equal(replica.replica_id_in_sync_group, 0)
    out = []
    for g, v in zip(grads, variables):
        if v.aggregation == tf.VariableAggregation.MEAN:
            op, keep = tf.distribute.ReduceOp.MEAN, None
        else:
            op = tf.distribute.ReduceOp.SUM
            keep = first if v.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA else None
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        values = tf.identity(values) if keep is None else values * tf.cast(keep, values.dtype)
        out.append((tf.IndexedSlices(values, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
                    else values, op))
    return out


def _check_mirrored(variables, strategy, in_replica):
    where = (f"in a replica context of {type(strategy).__name__} ({strategy.num_replicas_in_sync} "
             "replicas)" if in_replica else f"under {type(strategy).__name__}")
    for v in variables:
        if not isinstance(v, tf.distribute.DistributedValues):
            raise ValueError(
                f"variable {v.name} is not mirrored, but this step runs {where}: each replica would "
                "apply its own update to it. Create the variable under `strategy.scope()`, or apply "
                "outside the strategy.")
        if v.synchronization == tf.VariableSynchronization.ON_READ:
            raise ValueError(
                f"variable {v.name} is a SyncOnRead variable (synchronization=ON_READ), whose "
                f"copies are kept apart on purpose; tfclip applies one update to every copy of a "
                "mirrored variable. Train it as an ON_WRITE (mirrored) variable.")


def _aggregate(strategy, contributions, variables):
    """The replicas' gradients reduced as `_replica_contributions` said (in one batched all-reduce
    per reduction), placed with the variables' copies. Reduction None: the value given is the
    gradient (the cross-replica context's one value, or sums tfclip's all-reduce made already)."""
    out = [g for g, _ in contributions]
    groups = {}
    for i, (_, op) in enumerate(contributions):
        if op is not None:
            groups.setdefault(op, []).append(i)
    for op, idx in groups.items():
        # (With one replica per worker a contribution arrives as a plain tensor: this worker's.)
        reduced = strategy.extended.batch_reduce_to(op, [(out[i], variables[i]) for i in idx])
        for i, r in zip(idx, reduced):
            out[i] = r
    return out


def _update_every_copy(strategy, grads, variables, rule, step):
    """One fused op per device of the variables, each over that device's copies, with the same
    aggregated gradients: every copy of every variable and slot gets the same update."""
    rule._make_state(variables)  # mirrored (made in the strategy's scope), before any device's op
    _check_mirrored_state(strategy, rule, rule._state_variables(variables))

    def on_device(_, *gs):
        return tuple(rule._apply(list(gs), variables, **step))

    # (group=False gives each output as a tuple of the devices' values: made Mirrored again, so
    # that merge_call hands each replica its own device's.)
    per_device = strategy.extended.update(variables[0], on_device, args=tuple(grads), group=False)
    return [_dist_values.Mirrored(list(t)) for t in per_device]
