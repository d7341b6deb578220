"""`tfclip.rules.Rule`, what every rule object is: its state (the step counter, each variable's
slots, made once under a lock, mirrored under tf.distribute), the op's resource inputs (kept for
a repeated eager step), and its step through the one fused step (tfclip/_engine/step.py). The rules
themselves, each a constructor and a binding row: tfclip/rules/__init__.py."""
import collections
import contextlib
import numbers

import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable as _BaseResourceVariable

from tfclip._engine import narrow_state as _narrow
from tfclip._engine import opcall as _opcall
from tfclip._engine import reduce as _reduce
from tfclip._engine import shard as _shard
from tfclip._engine import step as _step
from tfclip._engine import checks as _checks
from tfclip import clipping as _clipping
from tfclip._engine.opcall import ClipApplyResult


def _on_host(t):
    return ":CPU:" in t.device


def _pack_handles(handles):
    """One vector of resource handles, for an op input list that takes handles packed."""
    return tf.raw_ops.Pack(values=handles, axis=0)


class Rule:
    """Base class: see the module docstring. A rule is declared by its `binding` (data,
    tfclip/_engine/step.py's `Binding`): its row of the core's rule table (`tfclip._core.rule_table()`),
    its slots by name and its hyper-parameters and flags by the attributes that hold them."""

    binding = None
    # Whether `state_dtype="bfloat16"` may keep this rule's slots in bfloat16 (the moment-keeping
    # element-wise rules; tfclip/rules/__init__.py says which and why), and `state_dtype="int8"`.
    low_precision_state = False
    int8_state = True

    @property
    def kind(self):
        """The rule-table row a step runs."""
        return self.binding.kind(self)

    @property
    def slot_names(self):
        """The names of the slots (`slots(var)`), in the table's order."""
        return tuple(stock for _, stock in self.binding.slot_names(self))

    def __init__(self, learning_rate, weight_decay=0.0, name=None, state_dtype=None, shard_state=False,
                 reduce_dtype=None):
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.name = name or type(self).__name__
        self.state_dtype = _narrow.check_state_dtype(state_dtype, type(self))
        self.shard_state = _shard.check(shard_state)
        # reduce_dtype (tfclip/_engine/reduce.py): in a replica context, the float32 variables'
        # gradients summed across replicas in 16 bits.
        self.reduce_dtype = _reduce.check(reduce_dtype)
        # shard_state under a strategy of more than one replica (tfclip/_engine/shard.py): var.ref() ->
        # its owning replica, and the bytes each replica owns so far (`state_owners`).
        # Across worker processes, the checkpoint side (`_shard.SlotExchange`; None within one).
        self._owner, self._owner_load, self._exchange = {}, None, None
        self._slots = {}
        self._absmax = {}  # int8 state: var.ref() -> {slot: its absmax variable}
        self._iterations = None
        self._handle_cache = None  # see _handles
        self._pairs_cache = None  # see tfclip.ops._repeated_eager_split
        for k, v in self._config_numbers().items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                _checks.check_number(k, v)
        self._check_stock_ranges()

    def _check_stock_ranges(self):
        """The checks the stock class this rule mirrors makes in its constructor (beyond the
        shared table's): none by default."""

    # -- state --------------------------------------------------------------------------
    # State is made once, under the rule's lock: threads that start stepping one rule at once
    # must not each make their own counter or slots (the updates written to the losing copies
    # would be lost). Under tf.distribute it is made in the strategy's scope, so a rule first
    # used in a replica function gets mirrored state (see tfclip.ops, _mirrored_step).
    @property
    def iterations(self):
        it = self._iterations
        if it is None:
            with _opcall.state_lock(self), _checks.state_scope():
                if self._iterations is None:
                    self._iterations = tf.Variable(
                        0, dtype=tf.int64, trainable=False, name=f"{self.name}/iterations",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                it = self._iterations
        return it

    def slots(self, var):
        """The slot variables of `var`, by name (created, as zeros, on first call)."""
        key = var.ref()
        got = self._slots.get(key)
        if got is None:
            self.state_owners([var])  # shard_state: its owner, if not given yet
            with _opcall.state_lock(self), _checks.state_scope():
                got = self._slots.get(key)
                if got is None:
                    base = var.name.split(":")[0]
                    # shard_state: made on its owner's device alone; an owner in another worker
                    # process keeps it, and here a `_shard.RemoteSlot` stands for it.
                    owner = self._owner.get(key)
                    device = None if owner is None else _shard.local_device(tf.distribute.get_strategy(), owner,
                                                                            remote_ok=True)

                    def make(value, name):
                        name = f"{base}/{self.name}/{name}"
                        if owner is not None and device is None:
                            value = tf.convert_to_tensor(value)
                            slot = _shard.RemoteSlot(value.shape, value.dtype, name, name, owner)
                        else:
                            with contextlib.nullcontext() if owner is None else _shard.on_device(device):
                                slot = tf.Variable(value, trainable=False, name=name,
                                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                        if owner is not None and self._exchange is not None:
                            self._exchange.add(slot, owner)
                        return slot

                    if self.slot_dtype(var) == tf.uint8:  # int8: the codes, and an absmax beside each
                        unsigned = self._unsigned_slots()
                        got, absmax = {}, {}
                        for s in self.slot_names:
                            codes, am = _narrow.int8_initial(self._slot_initial(s), var.shape, s not in unsigned)
                            got[s], absmax[s] = make(codes, s), make(am, f"{s}_absmax")
                        self._absmax[key] = absmax
                    else:
                        got = {s: make(self._slot_initial_value(s, var), s) for s in self.slot_names}
                    self._slots[key] = got
        return got

    def _int8(self, var):
        """Whether `var`'s slots are int8 state (state_dtype='int8', a float32 variable)."""
        return self.state_dtype == "int8" and var.dtype == tf.float32

    def _int8_dense(self, grads, variables):
        """The gradients as int8 state takes them: dense (an IndexedSlices summed per row, as TF's
        dense conversion; the core requantizes whole blocks), the others as they are."""
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and self._int8(v) else g
                for g, v in zip(grads, variables)]

    def _unsigned_slots(self):
        """The stock names of the slots the rule keeps >= 0 (int8 state's unsigned code)."""
        return _narrow.unsigned_slots(self.binding, self)

    def absmax(self, var):
        """int8 state's absmax variables of `var`, by slot name (float32, one value per 256
        elements; csrc/core/quant8.h); {} for a variable whose state is not int8."""
        self.slots(var)
        return self._absmax.get(var.ref(), {})

    def _make_state(self, variables):
        """Makes (once) the counter and the slots of `variables` now."""
        self.iterations  # noqa: B018  (made on first read)
        for v in variables:
            self.slots(v)

    def _state_variables(self, variables):
        """The state a step over `variables` writes."""
        out = [self.iterations]
        for v in variables:
            out.extend(self.slots(v).values())
            out.extend(self.absmax(v).values())
        return out

    @property
    def variables(self):
        """Every variable this rule owns: iterations, each model variable's slots, then the state
        of the adaptive clips named by `clip="zclip"`-style arguments (tfclip.clipping)."""
        out = [self.iterations]
        for key, slots in self._slots.items():
            out.extend(slots.values())
            out.extend(self._absmax.get(key, {}).values())
        for clip in self.__dict__.get("_named_clips", {}).values():
            out.extend((clip.state or {}).values())
        # Sharded across worker processes: each slot as its proxy (`_shard._SlotProxy`: the slot's own
        # attributes; a checkpoint of the list saves every slot from its owner, the stock layout).
        return out if self._exchange is None else [self._exchange.proxy(v) for v in out]

    def build(self, variables):
        """Makes the step counter and the slots of `variables` now, not at the first step: as
        `keras.optimizers.Optimizer.build`, before restoring a checkpoint into `rule.variables`.
        With shard_state=True under a strategy, call it in the strategy's scope: each variable
        gets its owner (`state_owners`) from the whole list, as a first step over it would."""
        self.state_owners(variables)
        self._make_state(variables)

    def _slot_initial(self, name):
        """A slot's initial value (Adagrad's accumulator: initial_accumulator_value)."""
        return 0.0

    def _slot_initial_value(self, name, var):
        """A slot's initial tensor for `var`: `_slot_initial(name)` everywhere by default, in the
        slot's dtype (`slot_dtype`)."""
        init = self._slot_initial(name)
        # A Python number straight to the variable's dtype (tf.cast would first round it to
        # float32: a float64 slot would start 1e-8 off the stock class's).
        init = (tf.constant(init, var.dtype) if isinstance(init, numbers.Real) and not isinstance(init, bool)
                else tf.cast(init, var.dtype))
        return tf.cast(tf.fill(var.shape, init), self.slot_dtype(var))

    def slot_dtype(self, var):
        """The dtype of `var`'s slots: bfloat16 for a float32 variable under
        `state_dtype="bfloat16"`, else the variable's."""
        return _narrow.state_slot_dtype(self.state_dtype, var.dtype, sharded=var.ref() in self._owner)

    def state_owners(self, variables):
        """With shard_state=True under a strategy of more than one replica: the replica that keeps
        each of `variables`' slots (ids in the sync group), each variable given one the first
        time it is seen (tfclip/_engine/shard.py's `owners`: the largest first, each to the replica
        owning the fewest bytes so far; the same on every replica and worker for the same
        variables in the same order). None without sharding."""
        n = _shard.replicas()
        if not self.shard_state or n <= 1:
            return None
        if any(v.ref() not in self._owner for v in variables):
            with _opcall.state_lock(self):
                new = list({v.ref(): v for v in variables if v.ref() not in self._owner}.values())
                if self._owner_load is None:
                    self._owner_load = [0] * n
                elif len(self._owner_load) != n:
                    raise ValueError(f"{self.name} (shard_state=True) keeps state for {len(self._owner_load)} "
                                     f"replicas, and this strategy has {n}: use a new rule (its checkpoint "
                                     "restores into it)")
                sizes = [v.shape.num_elements() * tf.as_dtype(v.dtype).size * w
                         for v, w in zip(new, self._state_weights(new))]
                strategy = tf.distribute.get_strategy()
                if self._exchange is None and _shard.across_processes(strategy):
                    # (on every worker, before any slot: each lists the same slots as proxies)
                    self._exchange = _shard.SlotExchange(strategy)
                for v, r in zip(new, _shard.owners(sizes, n, self._owner_load)):
                    self._owner[v.ref()] = r
        return [self._owner[v.ref()] for v in variables]

    def _state_weights(self, variables):
        """shard_state: each variable's slots per byte, where they differ between variables
        (`state_owners` balances by bytes of state): the same for all by default."""
        return [1] * len(variables)

    # -- hyper-parameters ---------------------------------------------------------------
    def current_learning_rate(self):
        lr = self.learning_rate
        if callable(lr) and not isinstance(lr, (tf.Variable, tf.Tensor)):
            try:
                import keras

                is_schedule = isinstance(lr, keras.optimizers.schedules.LearningRateSchedule)
            except ImportError:  # keras is optional here
                is_schedule = False
            if is_schedule:
                lr = lr(self.iterations)
            else:
                import inspect

                lr = lr(self.iterations) if len(inspect.signature(lr).parameters) else lr()
        return _opcall.scalar(lr, "learning_rate")

    def _config_numbers(self):
        return {"weight_decay": self.weight_decay}

    # -- the step -----------------------------------------------------------------------
    def _handles(self, variables):
        """The op's resource inputs: the variables' handles and each slot's list of handles.

        Eagerly and outside `tf.distribute` (where a handle depends on the replica context) they
        are kept for the last list of variables, so a repeated step pays no per-variable Python
        here; the entry holds the variables themselves, so their ids cannot be reused while it
        stands. For host variables each list is kept packed into one vector of handles (the op
        takes either form): TF's eager dispatch costs per resource input, and 600 of them were
        most of a 200-variable step's fixed cost (benchmarks/NOTES.md, "Figures behind the
        code": P5). Graph code keeps one input per variable,
        which is what automatic control dependencies order the step by. Also returns whether
        every variable (and so every slot) is in host memory, where the CPU kernel runs, and
        the step counter's handle where the op may own the count (see _host_counter).
        """
        cache = self._handle_cache  # read once: another thread may replace it meanwhile
        cacheable = tf.executing_eagerly() and not tf.distribute.has_strategy()
        if cacheable and cache is not None and cache[1] is variables:  # the repeated step's list
            return cache[2:]
        ids = tuple(map(id, variables))
        if cacheable and cache is not None and cache[0] == ids:
            return cache[2:]
        slot_lists = {s: [] for s in self.slot_names}
        absmax = {s: [] for s in self.slot_names}  # int8 state's, slot-major (the op's order)
        for v in variables:
            for s, var in self.slots(v).items():
                slot_lists[s].append(var.handle)
            for s, var in self.absmax(v).items():
                absmax[s].append(var.handle)
        absmax = [h for s in self.slot_names for h in absmax[s]]
        var_handles = [v.handle for v in variables]
        host = all(_on_host(v) for v in variables)  # slots live with their variable
        counter = self._host_counter() if host else None
        if cacheable and host:
            with tf.device("/device:CPU:0"):
                var_handles = [_pack_handles(var_handles)]
                slot_lists = {s: [_pack_handles(hs)] for s, hs in slot_lists.items()}
                absmax = [_pack_handles(absmax)] if absmax else []
        if cacheable:  # (the counter is made once per rule: it may be kept with the lists)
            self._handle_cache = (ids, variables, var_handles, slot_lists, host, counter, absmax)
        return var_handles, slot_lists, host, counter, absmax

    def _apply(self, grads, variables, *args, **kwargs):
        # Eagerly, one step of a rule at a time: threads stepping one rule end in the state of
        # a serial order (the counter read, the op and the count, and Nadam's product, as one).
        # Not under tf.distribute, whose replica threads meet in merge_call (a lock held there
        # would deadlock); in a graph the op's locks and the op-owned counter order the steps.
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            with _opcall.state_lock(self):
                return self._clip_and_step(grads, variables, *args, **kwargs)
        return self._clip_and_step(grads, variables, *args, **kwargs)

    def _clip_and_step(self, grads, variables, clip_mode, clip, use_norm, nonfinite, lazy_sparse=False,
                       all_dense=False, grad_scale=None, rounding_seed=None):
        """The rule's step through the one fused step (tfclip/_engine/step.py): the rule's own part is its
        state (slots, counter, Nadam's product) and its hyper-parameters."""
        clip_obj = None
        if clip_mode == "adaptive":  # a tfclip.clipping object: AGC, or a clip with state
            clip_obj, clip_mode, clip = clip, "none", 0.0
            if not isinstance(clip_obj, _clipping.AGC):
                with _opcall.state_lock(self), _checks.state_scope():
                    clip_obj.build()
                _checks.check_clip_state(clip_obj, self)
        self._before_step(variables)
        # The step counter advances only for an applied step. With host variables and a host
        # counter the op reads it (Adam's step) and advances it under the step's locks: the
        # same count, atomic with the update, without the eager reads, constants and increments
        # (in a tf.function, five small ops and two identities; NOTES.md's P6); else graph
        # ops do it here. (`counter`: its handle then, else None.)
        var_handles, slot_lists, host, counter, absmax = self._handles(variables)
        hparams, flags = self._op_inputs(counter is not None)
        if absmax:
            grads = self._int8_dense(grads, variables)
        group = _step.Group(self.kind, var_handles, self._op_slots(slot_lists), hparams, flags,
                            iterations=() if counter is None else (counter,), absmax=absmax)
        # (no variables: a sharded replica that owns none of the step's; the norm alone decides
        # `applied`, and the counter advances with the others')
        result = _step.run(grads, [group] if variables else [], clip_mode, clip, clip_obj=clip_obj,
                           use_norm=use_norm, nonfinite=nonfinite, lazy=lazy_sparse, all_dense=all_dense,
                           grad_scale=grad_scale,
                           rounding=None if rounding_seed is None else (rounding_seed, self._rounding_step(counter)))
        after = self._after_step(result.applied)
        if counter is None:
            after.append(self.iterations.assign_add(tf.cast(result.applied, tf.int64), read_value=False))
        if result.clip_update is not None:
            after.append(result.clip_update)
        if tf.executing_eagerly():
            return result.outputs
        with tf.control_dependencies(after):
            return ClipApplyResult(*[None if t is None else tf.identity(t) for t in result.outputs])

    def _rounding_step(self, counter):
        """Stochastic rounding's step (iterations + 1): where the op owns the counter, 1, to which
        the op adds the count it reads under its locks (as to Adam's `step`: two concurrent steps
        draw by their own counts); else iterations + 1, read before the counter advances."""
        if counter is not None:
            return 1.0
        return tf.cast(self.iterations, tf.float64) + 1.0

    def _before_step(self, variables):
        """State a step needs made before its hyper-parameters are read: none by default."""

    def _after_step(self, applied):
        """The rule's own state updates once the op ran (Nadam's product): a list of ops."""
        return []

    def _host_counter(self):
        """The step counter's handle where the op may own the count: outside tf.distribute
        (a replica's counter is not the variable's), a resource variable in host memory.
        Else None. (A TF1 graph's variable has no device yet: None.)"""
        it = self.iterations
        # (A counter first made while a tf.function traces is an UnliftedInitializerVariable,
        # a resource variable with a plain handle; distributed variables are not these.)
        if isinstance(it, _BaseResourceVariable) and _on_host(it) and not tf.distribute.has_strategy():
            return it.handle
        return None

    def _op_inputs(self, has_counter):
        """The op's hyper-parameters and flags by the rule table's names, from the binding; lr
        (the schedule's value) and weight_decay where the row takes them. has_counter: the op
        owns the count, and `step` is the 1 it adds."""
        hparams, flags = self.binding.values(self, None, step=1.0 if has_counter else None)
        if "lr" not in hparams:
            hparams["lr"] = self.current_learning_rate()
        if "weight_decay" in _opcall.RULES[self.kind]["hparams"]:
            hparams["weight_decay"] = self.weight_decay
        return hparams, flags

    def _op_slots(self, slot_lists):
        """The slot handle lists for the op, by the table's names."""
        return {table: slot_lists[stock] for table, stock in self.binding.slot_names(self)}

    # The binding's sources (tfclip/_engine/step.py, Binding): an attribute, the step.
    def _tfclip_hparam(self, name, variables):
        return getattr(self, name)

    def _tfclip_step(self):
        """`iterations + 1` as a float64 scalar."""
        return tf.cast(self.iterations + 1, tf.float64)


Rule.__module__ = "tfclip.rules"  # (where users find it)
