"""Update rules for `tfclip.fused_clip_apply`: hyper-parameters, step counter and slots.

A rule object is a small optimizer without `minimize`: it owns

- the hyper-parameters (Python numbers, tensors, `tf.Variable`s, or a learning-rate schedule
  — a `keras.optimizers.schedules.LearningRateSchedule` or any callable taking the step);
- `iterations`, an int64 `tf.Variable` counting the steps actually applied (a step skipped for a
  non-finite norm does not count); Adam's bias correction uses `iterations + 1`, as Keras;
- one set of slot variables per model variable, created on first use (zeros, the variable's
  dtype and shape, not trainable), under `tf.init_scope()` so a first call inside
  `tf.function` works. `rule.slots(var)` returns them by name; `rule.variables` lists all.

Reuse one rule object for one set of variables across steps, as you would an optimizer. In
TF1 graph mode, build the step before `tf.compat.v1.global_variables_initializer()`.

The rules match TF's own training ops and the Keras 3 optimizers:

===================  =========================================================================
`SGD`                keras.optimizers.SGD (plain, momentum, nesterov)
`Momentum`           tf.compat.v1.train.MomentumOptimizer (ResourceApplyMomentum)
`Adam`               keras.optimizers.Adam / ResourceApplyAdam (amsgrad too)
`AdamW`              keras.optimizers.AdamW (decoupled weight decay before the step)
`Adagrad`            keras.optimizers.Adagrad / ResourceApplyAdagradV2
`RMSprop`            keras.optimizers.RMSprop (momentum, centered)
`Adadelta`           keras.optimizers.Adadelta
`Adamax`             keras.optimizers.Adamax
`Lion`               keras.optimizers.Lion
`Nadam`              keras.optimizers.Nadam (its momentum-cache product carried across steps)
`Ftrl`               keras.optimizers.Ftrl / ResourceApplyFtrlV2
`Lamb`               keras.optimizers.Lamb (a per-tensor trust ratio: three passes, not two)
`ScheduleFreeAdamW`  keras.optimizers.ScheduleFreeAdamW (warmup_steps; slot `momentum` starts
                     as a copy of the variable)
`ProximalGradient`   tf.compat.v1.train.ProximalGradientDescentOptimizer
`Descent`            (ResourceApplyProximalGradientDescent; no slots)
`ProximalAdagrad`    tf.compat.v1.train.ProximalAdagradOptimizer (ResourceApplyProximalAdagrad)
`AdagradDA`          tf.compat.v1.train.AdagradDAOptimizer (its global_step = iterations)
===================  =========================================================================

Adagrad, RMSprop, Adadelta, Adamax and Lion match stock Keras bit for bit on dense gradients
(clip by value or none; a norm clip differs in the scale's last bit, Keras's norm being
float32). With IndexedSlices they give the densified gradient's update, as the other rules do
here (a row's duplicates summed, every row's slots updated).

The three TF1 proximal rules take no `weight_decay` (the stock classes have none). Their
IndexedSlices gradients are densified by default (every row gets the l1/l2 shrink);
`lazy_sparse=True` gives TF1's sparse kernels' update (the touched rows only).

`weight_decay` on any other rule is Keras's decoupled decay: `var -= var * weight_decay * lr` first.
"""
import contextlib
import math
import numbers

import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable as _BaseResourceVariable

from tfclip import _loader, _opcall
from tfclip import clipping as _clipping
from tfclip._opcall import ClipApplyResult


def _on_host(t):
    return ":CPU:" in t.device


def _pack_handles(handles):
    """One vector of resource handles, for an op input list that takes handles packed."""
    return tf.raw_ops.Pack(values=handles, axis=0)


class Rule:
    """Base class: see the module docstring. A rule is declared by its `kind` (a row of the core's
    rule table, `tfclip._core.rule_table()`), its `slot_names` (in the table's slot order) and
    `_op_hparams` / `_op_flags` (its hyper-parameters and flags by the table's names)."""

    kind = None
    slot_names = ()

    def __init__(self, learning_rate, weight_decay=0.0, name=None):
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.name = name or type(self).__name__
        self._slots = {}
        self._iterations = None
        self._handle_cache = None  # see _handles
        self._pairs_cache = None  # see tfclip.ops._repeated_eager_split
        for k, v in self._config_numbers().items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                _check_number(k, v)
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
            with _opcall.state_lock(self), _state_scope():
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
            with _opcall.state_lock(self), _state_scope():
                got = self._slots.get(key)
                if got is None:
                    base = var.name.split(":")[0]
                    got = {
                        s: tf.Variable(self._slot_initial_value(s, var),
                                       trainable=False, name=f"{base}/{self.name}/{s}",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                        for s in self.slot_names
                    }
                    self._slots[key] = got
        return got

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
        return out

    @property
    def variables(self):
        """Every variable this rule owns: iterations, each model variable's slots, then the state
        of the adaptive clips named by `clip="zclip"`-style arguments (tfclip.clipping)."""
        out = [self.iterations]
        for slots in self._slots.values():
            out.extend(slots.values())
        for clip in self.__dict__.get("_named_clips", {}).values():
            out.extend((clip.state or {}).values())
        return out

    def _slot_initial(self, name):
        """A slot's initial value (Adagrad's accumulator: initial_accumulator_value)."""
        return 0.0

    def _slot_initial_value(self, name, var):
        """A slot's initial tensor for `var`: `_slot_initial(name)` everywhere by default."""
        init = self._slot_initial(name)
        # A Python number straight to the variable's dtype (tf.cast would first round it to
        # float32: a float64 slot would start 1e-8 off the stock class's).
        init = (tf.constant(init, var.dtype) if isinstance(init, numbers.Real) and not isinstance(init, bool)
                else tf.cast(init, var.dtype))
        return tf.fill(var.shape, init)

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
            return cache[2], cache[3], cache[4], cache[5]
        ids = tuple(map(id, variables))
        if cacheable and cache is not None and cache[0] == ids:
            return cache[2], cache[3], cache[4], cache[5]
        slot_lists = {s: [] for s in self.slot_names}
        for v in variables:
            for s, var in self.slots(v).items():
                slot_lists[s].append(var.handle)
        var_handles = [v.handle for v in variables]
        host = all(_on_host(v) for v in variables)  # slots live with their variable
        counter = self._host_counter() if host else None
        if cacheable and host:
            with tf.device("/device:CPU:0"):
                var_handles = [_pack_handles(var_handles)]
                slot_lists = {s: [_pack_handles(hs)] for s, hs in slot_lists.items()}
        if cacheable:  # (the counter is made once per rule: it may be kept with the lists)
            self._handle_cache = (ids, variables, var_handles, slot_lists, host, counter)
        return var_handles, slot_lists, host, counter

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
                       all_dense=False):
        if clip_mode != "adaptive":
            return self._apply_step(grads, variables, clip_mode, clip, use_norm, nonfinite, lazy_sparse,
                                    all_dense)
        if isinstance(clip, _clipping.AGC):  # unit-wise, inside the op's own two passes
            mode, factor, extra = clip.op_args()
            return self._apply_step(grads, variables, mode, factor, use_norm, nonfinite, lazy_sparse,
                                    all_dense, **extra)
        # An adaptive clip (tfclip.clipping): the norm pass, the threshold from the norm and the
        # clip's state (scalar ops on the device), then the clip-and-apply pass with that norm
        # and threshold; the state advances once the step is applied (not for a non-finite norm).
        with _opcall.state_lock(self), _state_scope():
            state = clip.build()
        _check_clip_state(clip, self)
        values = grads if all_dense else _opcall.op_grads(grads)[0]
        if use_norm is None:
            norm, tensor_norms = _loader.ops().tfclip_global_norm(t=values, Tnorm=tf.float64)
        else:
            norm, tensor_norms = _opcall.scalar(use_norm, "use_norm"), None
        step = clip.step(norm)
        result = self._apply_step(grads, variables, "global_norm", step.clip, norm, nonfinite, lazy_sparse,
                                  all_dense)
        if tensor_norms is not None:
            result = result._replace(tensor_norms=tf.cast(tensor_norms, tf.float32))
        clip._remember(step)
        done = _clipping.assign_updates(step, after=[result.applied])
        if done is None:
            return result
        with tf.control_dependencies([done]):
            return ClipApplyResult(*[tf.identity(t) for t in result])

    def _apply_step(self, grads, variables, clip_mode, clip, use_norm, nonfinite, lazy_sparse=False,
                    all_dense=False, agc_eps=None):
        # The step counter advances only for an applied step. With host variables and a host
        # counter the op reads it (Adam's step) and advances it under the step's locks: the
        # same count, atomic with the update, without the eager reads, constants and increments
        # (in a tf.function, five small ops and two identities; NOTES.md's P6); else graph
        # ops do it here. (`counter`: its handle then, else None.)
        var_handles, slot_lists, host, counter = self._handles(variables)
        given = use_norm is not None
        # (all_dense: the caller checked that every gradient is an eager tensor.)
        values, sparse_kw = (grads, _opcall.NO_SPARSE) if all_dense else _opcall.op_grads(grads)
        norm, applied, tensor_norms, clipped_units = _opcall.apply(
            self.kind,
            var_handles,
            self._op_slots(slot_lists),
            values,
            self._op_hparams(counter is not None),
            self._op_flags(),
            lazy=lazy_sparse,
            **sparse_kw,
            clip=_opcall.scalar(clip, "clip"),
            use_norm=_opcall.scalar(use_norm if given else 0.0, "use_norm"),
            iterations=[] if counter is None else [counter],
            clip_mode=clip_mode,
            nonfinite=nonfinite,
            use_given_norm=given,
            **({} if agc_eps is None else {"agc_eps": agc_eps}),
        )
        if counter is not None:
            return ClipApplyResult(norm, applied, tensor_norms, clipped_units)
        bump = self.iterations.assign_add(tf.cast(applied, tf.int64), read_value=False)
        if tf.executing_eagerly():
            return ClipApplyResult(norm, applied, tensor_norms, clipped_units)
        with tf.control_dependencies([bump]):
            return ClipApplyResult(tf.identity(norm), tf.identity(applied), tf.identity(tensor_norms),
                                   tf.identity(clipped_units))

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

    def _op_hparams(self, has_counter):
        """The op's hyper-parameters by the rule table's names (the base: lr, weight_decay)."""
        return {"lr": self.current_learning_rate(), "weight_decay": self.weight_decay}

    def _op_flags(self):
        return {}

    def _op_slots(self, slot_lists):
        """The slot handle lists for the op: by the table's names where the rule uses them, else
        in order (Momentum's `momentum` is the op's `accum`)."""
        if set(self.slot_names) <= set(_opcall.RULES[self.kind]["slots"]):
            return {s: slot_lists[s] for s in self.slot_names}
        return [slot_lists[s] for s in self.slot_names]

    def _step(self, has_counter):
        """The `step` input: `iterations + 1` as a float64 scalar, or, when the op is given the
        counter (`iterations`), the 1 it adds to the count."""
        if has_counter:
            return 1.0
        return tf.cast(self.iterations + 1, tf.float64)


def _check_clip_state(clip, owner):
    """An adaptive clip's state serves one rule or optimizer, and under tf.distribute is mirrored
    (made on its first step, in the strategy's scope)."""
    clip.bind(owner)
    state = clip.state
    if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        for v in state.values():
            if not isinstance(v, tf.distribute.DistributedValues):
                raise ValueError(
                    f"the adaptive clip's state variable {v.name} was made outside "
                    f"{type(tf.distribute.get_strategy()).__name__}'s scope, so it is not mirrored: "
                    "use a new clip object under the strategy (its state is made on its first step)")


@contextlib.contextmanager
def _state_scope():
    """Where a rule's state is made: outside any tf.function (init_scope), and in the scope of
    the strategy in use, if any, so that the state of a rule used under tf.distribute is
    mirrored like the variables it serves."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    with tf.init_scope():
        if strategy is None or tf.distribute.has_strategy():
            yield
        else:
            with strategy.scope():
                yield


def _check_range(name, v, lo, hi, lo_open=False, hi_open=False):
    """A stock class's own constructor check, for the rule that mirrors it (numbers only)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}"
                         f"{')' if hi_open else ']'} (as the stock class checks it), got {v}")


def _check_number(name, v):
    """A hyper-parameter given as a Python number, checked at construction against the range the
    core's table gives it (csrc/core/hparams.h, through tfclip._core.hparam_table())."""
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    info = _opcall.HPARAMS.get("lr" if name == "learning_rate" else name) or next(
        (i for i in _opcall.HPARAMS.values() if i["display"] == name), None)
    if info is None:
        return
    lo, hi = info["lo"], info["hi"]
    ok = (v > lo if info["lo_open"] else v >= lo) and (v < hi if info["hi_open"] else v <= hi)
    if not ok:
        if math.isinf(hi):
            raise ValueError(f"{name} must be {'>' if info['lo_open'] else '>='} {lo:g}, got {v}")
        raise ValueError(f"{name} must be in {'(' if info['lo_open'] else '['}{lo:g}, {hi:g}"
                         f"{')' if info['hi_open'] else ']'}, got {v}")


class SGD(Rule):
    """Keras SGD: `var -= lr * g`; with `momentum`: `m = momentum*m - lr*g; var += m` (nesterov:
    `var += momentum*m - lr*g`). Slot `momentum` exists only when momentum is not the number 0."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, weight_decay=0.0, name=None):
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        super().__init__(learning_rate, weight_decay, name)

    def _check_stock_ranges(self):
        _check_range("momentum", self.momentum, 0.0, 1.0)  # keras.optimizers.SGD's

    @property
    def kind(self):
        return "keras_momentum" if self._has_momentum() else "sgd"

    def _has_momentum(self):
        return not (isinstance(self.momentum, numbers.Real) and self.momentum == 0)

    @property
    def slot_names(self):
        return ("momentum",) if self._has_momentum() else ()

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "momentum": self.momentum,
                "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        hp = super()._op_hparams(has_counter)
        if self._has_momentum():
            hp["momentum"] = self.momentum
        return hp

    def _op_flags(self):
        return {"use_nesterov": self.nesterov} if self._has_momentum() else {}


class Momentum(Rule):
    """tf.compat.v1 MomentumOptimizer: `accum = momentum*accum + g; var -= lr*accum` (nesterov:
    `var -= lr*g + lr*momentum*accum`). Slot: `momentum`."""

    kind = "momentum"
    slot_names = ("momentum",)

    def __init__(self, learning_rate, momentum, use_nesterov=False, weight_decay=0.0, name=None):
        self.momentum = momentum
        self.use_nesterov = bool(use_nesterov)
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "momentum": self.momentum,
                "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "momentum": self.momentum}

    def _op_flags(self):
        return {"use_nesterov": self.use_nesterov}


class Adam(Rule):
    """Keras Adam / ResourceApplyAdam, epsilon outside the sqrt, bias correction from
    `iterations + 1`. Slots: `m`, `v` (and `vhat` with amsgrad)."""

    kind = "adam"

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, weight_decay=0.0, name=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.amsgrad = bool(amsgrad)
        super().__init__(learning_rate, weight_decay, name)

    @property
    def slot_names(self):
        return ("m", "v", "vhat") if self.amsgrad else ("m", "v")

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1,
                "beta_2": self.beta_2, "epsilon": self.epsilon, "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "step": self._step(has_counter)}

    def _op_flags(self):
        return {"amsgrad": self.amsgrad}


class AdamW(Adam):
    """Keras AdamW: Adam with decoupled weight decay (default 0.004, as Keras)."""

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, amsgrad=False, name=None):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay, name)


class Adagrad(Rule):
    """Keras Adagrad / ResourceApplyAdagradV2: `accumulator += g^2; var -= lr*g /
    sqrt(accumulator + epsilon)`. Slot `accumulator`, starting at `initial_accumulator_value`."""

    kind = "adagrad"
    slot_names = ("accumulator",)

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                 weight_decay=0.0, name=None):
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "epsilon": self.epsilon,
                "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "epsilon": self.epsilon}


class RMSprop(Rule):
    """Keras RMSprop (`rho`, `momentum`, `centered`). Slots `velocity`, `momentum` (when momentum
    is not the number 0) and `average_gradient` (centered)."""

    kind = "rmsprop"

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False,
                 weight_decay=0.0, name=None):
        self.rho, self.momentum, self.epsilon = rho, momentum, epsilon
        self.centered = bool(centered)
        super().__init__(learning_rate, weight_decay, name)

    def _has_momentum(self):
        # As Keras: a momentum slot only for momentum > 0 (a number <= 0 is no momentum).
        return not (isinstance(self.momentum, numbers.Real) and self.momentum <= 0)

    @property
    def slot_names(self):
        return ("velocity",) + (("momentum",) if self._has_momentum() else ()) + (
            ("average_gradient",) if self.centered else ())

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "rho": self.rho, "momentum": self.momentum,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "rho": self.rho, "momentum": self.momentum,
                "epsilon": self.epsilon}

    def _op_slots(self, slot_lists):
        names = {"momentum": "momentum_slot"}  # the op's input; `momentum` is the hyper-parameter
        return {names.get(s, s): slot_lists[s] for s in self.slot_names}

    def _op_flags(self):
        return {"centered": self.centered, "has_momentum": self._has_momentum()}


class Adadelta(Rule):
    """Keras Adadelta. Slots `accumulated_grad`, `accumulated_delta_var`."""

    kind = "adadelta"
    slot_names = ("accumulated_grad", "accumulated_delta_var")

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-7, weight_decay=0.0, name=None):
        self.rho, self.epsilon = rho, epsilon
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "rho": self.rho, "epsilon": self.epsilon,
                "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "rho": self.rho, "epsilon": self.epsilon}


class _BetasEpsilonStep(Rule):
    """A rule taking beta_1, beta_2 and epsilon, its bias correction from `iterations + 1`."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.0, name=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "step": self._step(has_counter)}


class Adamax(_BetasEpsilonStep):
    """Keras Adamax, bias correction from `iterations + 1`. Slots `m`, `u`."""

    kind = "adamax"
    slot_names = ("m", "u")


class Lion(Rule):
    """Keras Lion: `var -= lr * sign(m*beta_1 + g*(1 - beta_1)); m = m*beta_2 + g*(1 - beta_2)`.
    Slot `m`."""

    kind = "lion"
    slot_names = ("m",)

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.99, weight_decay=0.0, name=None):
        self.beta_1, self.beta_2 = beta_1, beta_2
        super().__init__(learning_rate, weight_decay, name)

    def _check_stock_ranges(self):
        _check_range("beta_1", self.beta_1, 0.0, 1.0, lo_open=True)  # keras.optimizers.Lion's

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "weight_decay": self.weight_decay}

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "beta_1": self.beta_1, "beta_2": self.beta_2}


class Nadam(Rule):
    """Keras Nadam. Slots `m`, `v`; the momentum-cache product `u_product` (a variable of the first
    variable's dtype, as Keras keeps it) advances only with an applied step."""

    kind = "nadam"
    slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.0, name=None):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.u_product = None  # made on the first step
        self._next_u_product = None
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay}

    @property
    def variables(self):
        return super().variables + ([self.u_product] if self.u_product is not None else [])

    def _host_counter(self):
        return None  # the product needs t before the op: the step is counted here

    def _op_hparams(self, has_counter):
        step = self._step(False)
        u = self.u_product
        # As keras: u_product * beta_1 * (1 - 0.5 * 0.96^t), in u_product's dtype.
        t = tf.cast(step, u.dtype)
        self._next_u_product = u * tf.cast(self.beta_1, u.dtype) * (1.0 - 0.5 * tf.pow(tf.constant(0.96, u.dtype), t))
        return {**super()._op_hparams(has_counter), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "step": step, "u_product": self._next_u_product}

    def _make_state(self, variables):
        super()._make_state(variables)
        if self.u_product is None:
            with _opcall.state_lock(self), _state_scope():
                if self.u_product is None:
                    self.u_product = tf.Variable(
                        tf.ones([], variables[0].dtype), trainable=False, name=f"{self.name}/u_product",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _state_variables(self, variables):
        self._make_state(variables)
        return super()._state_variables(variables) + [self.u_product]

    def _apply_step(self, grads, variables, *args, **kwargs):
        if self.u_product is None:
            self._make_state(variables)
        result = super()._apply_step(grads, variables, *args, **kwargs)
        nxt = tf.where(result.applied, self._next_u_product, self.u_product)
        bump = self.u_product.assign(nxt, read_value=False)
        if tf.executing_eagerly():
            return result
        with tf.control_dependencies([bump]):
            return ClipApplyResult(*[tf.identity(t) for t in result])


class Ftrl(Rule):
    """Keras Ftrl / ResourceApplyFtrlV2 (`learning_rate_power`, `l1_regularization_strength`,
    `l2_regularization_strength`, `l2_shrinkage_regularization_strength`, `beta`). Slots
    `accumulator` (starting at `initial_accumulator_value`) and `linear`."""

    slot_names = ("accumulator", "linear")

    @property
    def kind(self):
        return _opcall.ftrl_variant(self.learning_rate_power)[0]

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l2_shrinkage_regularization_strength=0.0, beta=0.0, weight_decay=0.0, name=None):
        self.learning_rate_power = learning_rate_power
        self.initial_accumulator_value = initial_accumulator_value
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.l2_shrinkage_regularization_strength = l2_shrinkage_regularization_strength
        self.beta = beta
        if initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}")
        super().__init__(learning_rate, weight_decay, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate, "learning_rate_power": self.learning_rate_power,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength,
                "l2_shrinkage_regularization_strength": self.l2_shrinkage_regularization_strength,
                "beta": self.beta, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value if name == "accumulator" else 0.0

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), **_opcall.ftrl_variant(self.learning_rate_power)[1],
                "l1": self.l1_regularization_strength, "l2": self.l2_regularization_strength,
                "l2_shrinkage": self.l2_shrinkage_regularization_strength, "beta": self.beta}


class Lamb(_BetasEpsilonStep):
    """Keras Lamb: Adam's moments, the update `u = m_hat / (sqrt(v_hat) + epsilon)` scaled per
    tensor by `|w| / |u|` (1 if either is 0), bias correction from `iterations + 1`. Slots `m`,
    `v`. The ratio needs every update before a variable moves: a third pass over memory."""

    kind = "lamb"
    slot_names = ("m", "v")


class ScheduleFreeAdamW(_BetasEpsilonStep):
    """Keras ScheduleFreeAdamW (Defazio et al. 2024) as stock Keras runs it on TensorFlow: the
    variable is the interpolation y, slot `momentum` the sequence z the gradient steps move
    (a copy of the variable when the slots are made, as Keras's build makes it), slot
    `velocity` Adam's second moment; `warmup_steps` > 0 scales the learning rate by
    min(t / warmup_steps, 1). Weight decay (decoupled, first) uses the learning rate without
    warmup, as Keras. The averaged sequence x, for evaluation, is
    (var - (1 - beta_1) * momentum) / beta_1. See csrc/core/rules.h, ScheduleFreeAdamWRule, for
    the one place it departs from the paper (with stock Keras)."""

    kind = "schedule_free_adamw"
    slot_names = ("momentum", "velocity")

    def __init__(self, learning_rate=0.0025, beta_1=0.9, beta_2=0.999, epsilon=1e-8, warmup_steps=0,
                 weight_decay=0.0, name=None):
        self.warmup_steps = warmup_steps
        super().__init__(learning_rate, beta_1, beta_2, epsilon, weight_decay, name)

    def _config_numbers(self):
        return {**super()._config_numbers(), "warmup_steps": self.warmup_steps}

    def _slot_initial_value(self, name, var):
        if name != "momentum":
            return super()._slot_initial_value(name, var)
        if tf.executing_eagerly():
            return tf.identity(var.read_value())
        # A TF1 graph: global_variables_initializer runs the initializers in no set order, so the
        # slot's reads the variable once that one is initialized, else its initial value.
        return tf.cond(tf.compat.v1.is_variable_initialized(var), var.read_value,
                       lambda: tf.convert_to_tensor(var.initial_value))

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "warmup_steps": self.warmup_steps}


class _Proximal(Rule):
    """A TF1 proximal rule (no weight decay: the stock classes have none). l1/l2 strengths given
    as numbers must be >= 0 (the core's table; a tensor is checked by the op when the step runs,
    before it writes anything). IndexedSlices: densified by default (rows no slice touches
    still get the l1/l2 shrink); `lazy_sparse=True` updates only the touched rows, each
    duplicate in turn, as TF1's sparse kernels do."""

    def __init__(self, learning_rate, l1_regularization_strength, l2_regularization_strength, name):
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        super().__init__(learning_rate, 0.0, name)

    def _config_numbers(self):
        return {"learning_rate": self.learning_rate,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength}

    def _op_hparams(self, has_counter):
        return {"lr": self.current_learning_rate(), "l1": self.l1_regularization_strength,
                "l2": self.l2_regularization_strength}


class ProximalGradientDescent(_Proximal):
    """tf.compat.v1.train.ProximalGradientDescentOptimizer (FOBOS; ResourceApplyProximalGradientDescent):
    `prox = var - lr*g; var = sign(prox) * max(|prox| - lr*l1, 0) / (1 + lr*l2)`. No slots."""

    kind = "proximal_gradient_descent"

    def __init__(self, learning_rate, l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 name=None):
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name)


class ProximalAdagrad(_Proximal):
    """tf.compat.v1.train.ProximalAdagradOptimizer (ResourceApplyProximalAdagrad): `accumulator
    += g^2`, then the proximal step with the learning rate `lr / sqrt(accumulator)`. Slot
    `accumulator`, starting at `initial_accumulator_value` (> 0, as the stock class checks). As
    TF's kernel, a learning rate <= 0 is refused: a number at construction (ValueError), a
    tensor when the step runs (InvalidArgumentError, nothing written)."""

    kind = "proximal_adagrad"
    slot_names = ("accumulator",)

    def __init__(self, learning_rate, initial_accumulator_value=0.1, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, name=None):
        if initial_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        self.initial_accumulator_value = initial_accumulator_value
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name)

    def _check_stock_ranges(self):
        lr = self.learning_rate
        if isinstance(lr, numbers.Real) and not isinstance(lr, bool) and lr <= 0:
            raise ValueError(f"learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it), got {lr}")

    def _config_numbers(self):
        return {**super()._config_numbers(), "initial_accumulator_value": self.initial_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_accumulator_value

    def _op_hparams(self, has_counter):
        hp = super()._op_hparams(has_counter)
        if not isinstance(self.learning_rate, numbers.Real):  # a tensor, variable or schedule
            check = tf.debugging.assert_positive(
                hp["lr"], message="learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it)")
            with tf.control_dependencies([check]):
                hp["lr"] = tf.identity(hp["lr"])
        return hp


class AdagradDA(_Proximal):
    """tf.compat.v1.train.AdagradDAOptimizer (ResourceApplyAdagradDA), its `global_step` the
    rule's own count: step t (from 1) is given t, as the stock class given a global step that
    starts at 0 and advances with each applied step. Slots `gradient_accumulator` and
    `gradient_squared_accumulator` (starting at `initial_gradient_squared_accumulator_value`,
    > 0 as the stock class checks)."""

    kind = "adagrad_da"
    slot_names = ("gradient_accumulator", "gradient_squared_accumulator")

    def __init__(self, learning_rate, initial_gradient_squared_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, name=None):
        if initial_gradient_squared_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError("initial_gradient_squared_accumulator_value must be positive: "
                             f"{initial_gradient_squared_accumulator_value}")
        self.initial_gradient_squared_accumulator_value = initial_gradient_squared_accumulator_value
        super().__init__(learning_rate, l1_regularization_strength, l2_regularization_strength, name)

    def _config_numbers(self):
        return {**super()._config_numbers(),
                "initial_gradient_squared_accumulator_value": self.initial_gradient_squared_accumulator_value}

    def _slot_initial(self, name):
        return self.initial_gradient_squared_accumulator_value if name == "gradient_squared_accumulator" else 0.0

    def _host_counter(self):
        return None  # global_step is iterations + 1, read before the op: the step is counted here

    def _op_hparams(self, has_counter):
        return {**super()._op_hparams(has_counter), "global_step": self._step(False)}
