"""Drop-in `tf.compat.v1.train` optimizers with clipping fused into `apply_gradients`.

Change one line of TF1 code::

    opt = tf.compat.v1.train.AdamOptimizer(1e-3)                       # before, plus a
    grads, _ = tf.clip_by_global_norm(grads, 5.0)                      # clip in between
    opt = tfclip.compat.v1.AdamOptimizer(1e-3, global_clipnorm=5.0)    # after

`compute_gradients` → `apply_gradients(grads_and_vars, global_step=...)` and
`minimize(loss, var_list=..., global_step=...)` work as with the stock classes, in graph mode
with a `Session` and eagerly. Pairs whose gradient is `None` (`tf.stop_gradient`, variables
outside the loss) are left alone; variables outside `var_list` are never touched.

The optimizer state is the stock class's, variable for variable: the slots (`momentum`, `m`,
`v`, so `get_slot` works) and Adam's `beta1_power` / `beta2_power` accumulators, with the stock
names, so `opt.variables()` is the stock list and a `tf.compat.v1.train.Saver` (or
`tf.train.Checkpoint`) checkpoint moves both ways between the stock classes and these.
tfclip's extras, the pre-clip global norm of the last step (`opt.global_norm()`) and each
gradient's pre-clip norm in it (`opt.tensor_norms()`, aligned with `opt.tensor_norm_names()`),
are local variables: outside `tf.compat.v1.global_variables()`, never saved, and only written
by the step (so code that initializes just the model's variables works, as with the stock
classes). Both come from the op's norm pass, no extra reduction; both are written also when a
non-finite norm skips the step, so the norms say which gradient was inf/NaN.

Differences from the stock classes, on purpose: `nonfinite="skip"` by default (a step whose
global norm is inf/NaN writes nothing, Adam's beta powers included; `global_step` still
advances), a non-finite hyper-parameter is refused (by the op, nothing written), the clip under
`tf.distribute` sees the replicas' summed gradient (the stock classes sum too, and a clip put
between `compute_gradients` and `apply_gradients` would see each replica's own). Under
`tf.distribute` the step runs as the stock one: the replicas' gradients summed, then one update
of every copy. Shared by threads, an optimizer makes its slots once and runs one step at a time.

Resource variables (TF2's) and TF1 ref variables (`tf.disable_v2_behavior()`, or
`use_resource=False`) are both taken, as the stock classes take both, in one step even when a
`var_list` mixes them (one norm pass): a ref variable's slots and Adam's beta powers are ref
variables, made as the stock class makes them, and the step updates refs in place, each under
its variable's lock (always held, in the one address order of every variable the step
locks, as TF's own multi-variable ops lock; an unlocked in-place write would let a concurrent
step or `assign` interleave with half an update). As the stock classes, a ref variable's
gradient must have its dtype.

`IndexedSlices` gradients (embeddings) are applied without densifying them, as the stock
classes apply them: SGD as a scatter, Momentum on the touched rows only (duplicates summed),
Adam on every row (its slots decay everywhere; duplicates summed before squaring for `v`),
RMSProp, Adagrad, Adadelta, Ftrl, ProximalGradientDescent, ProximalAdagrad and AdagradDA on the
touched rows only (duplicates summed, as the stock base class sums them before its sparse kernel).

ProximalGradientDescent, ProximalAdagrad and AdagradDA run TF's kernel arithmetic (the core
rules `proximal_gradient_descent`, `proximal_adagrad`, `adagrad_da`). AdagradDA's update uses
the constructor's `global_step` + 1 as read when the step runs, as the stock class; a missing
one is refused at construction. Their l1/l2 strengths must be >= 0 (stock documents it; its
ProximalAdagrad kernel checks it, with lr > 0, when the step runs: tfclip refuses a number at
construction, a tensor when the step runs, before anything is written). With float64 variables
Python-number hyper-parameters work (the stock proximal classes pass them to their ops as
float32, which fails).

RMSProp runs TF's own kernel order (the core rule `tf_rmsprop`; keras's RMSprop rounds
differently, which a centered RMSProp with a small epsilon shows). Adagrad runs the Keras rule
with epsilon 0: TF's kernel computes `g * lr * rsqrt(accum)` where it computes
`lr * g / sqrt(accum)`, so they agree to float rounding (an ulp or two a step).
"""

import numbers

import tensorflow as tf

from tfclip import _loader, _opcall
from tfclip import clipping as _clipping
from tfclip.rules import _check_number, _state_scope

__all__ = ["GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer", "RMSPropOptimizer",
           "AdagradOptimizer", "AdadeltaOptimizer", "FtrlOptimizer", "ProximalGradientDescentOptimizer",
           "ProximalAdagradOptimizer", "AdagradDAOptimizer"]


def _is_ref(v):
    """A TF1 ref variable (dtype float32_ref, ...): what tf.get_variable makes without resource
    variables."""
    return isinstance(v, tf.Variable) and v.dtype._is_ref_dtype  # pylint: disable=protected-access


def _check_ref_pair(i, g, v):
    base = v.dtype.base_dtype
    if not base.is_floating:
        raise TypeError(f"grads_and_vars[{i}]: {v.name} is a {base.name} variable; tfclip updates "
                        "float16, bfloat16, float32 and float64 variables")
    gd = g.dtype.base_dtype
    if gd != base:
        raise TypeError(f"grads_and_vars[{i}]: the gradient of {v.name} is {gd.name} but the variable "
                        f"is {base.name}; a ref variable's gradient must have its dtype (as the stock "
                        "TF1 optimizers require)")


def _f64(x, name):
    """A hyper-parameter (number, tensor, or a callable giving one, as TF1 allows) as float64."""
    return _opcall.scalar(x() if callable(x) else x, name)


class _Fused(tf.compat.v1.train.Optimizer):
    # The slots in the stock class's creation order: a TF1 slot variable is named after its
    # variable and the optimizer only (w/RMSProp, w/RMSProp_1, ...), so the order is the name.
    _slot_names = ()
    _op_slot_names = None  # the op's order, where it differs

    def __init__(self, use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip=None):
        super().__init__(use_locking, name)
        self._clip_mode, self._clip = _opcall.clip_config(global_clipnorm, clipnorm, clipvalue)
        # An adaptive clip (tfclip.clipping): its state is made with the slots, on the first
        # apply_gradients, as graph variables (global variables: Saver saves them).
        self._adaptive = _clipping.get(clip)
        _clipping.check_exclusive(self._adaptive, global_clipnorm=global_clipnorm, clipnorm=clipnorm,
                                  clipvalue=clipvalue)
        _opcall.check_policy(nonfinite)
        self._nonfinite = nonfinite
        self._tfclip_norms = {}  # graph (None: eager) -> its global-norm variable; not tracked
        self._tfclip_tnorms = {}  # (graph, the step's variables) -> (tensor-norms variable, names)
        self._tfclip_last_tnorms = {}  # graph -> the last step's (tensor-norms variable, names)
        self._tfclip_cunits = {}  # AGC: as _tfclip_tnorms, the clipped-units variable
        self._tfclip_last_cunits = {}  # graph -> the last step's clipped-units variable

    @staticmethod
    def _check_numbers(**named):
        """The hyper-parameters given as numbers, at construction: every finite value (the stock
        classes check none); NaN and inf are refused here, by their TF1 names. Tensors and
        callables are checked by the op when the step runs, before it writes anything."""
        for name, v in named.items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                _check_number(name, float(v))

    @staticmethod
    def _check_strengths(**named):
        """l1/l2 strengths given as numbers: >= 0, as the stock classes document (TF's
        ProximalAdagrad kernel refuses a negative one when the step runs; the op refuses a
        negative tensor value, before it writes anything)."""
        for name, v in named.items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and v < 0.0:
                raise ValueError(f"{name} must be >= 0, got {v}")

    def _create_slots(self, var_list):
        for v in var_list:
            for s in self._slot_names:
                init = self._slot_initial(s)
                if init == 0.0:
                    self._zeros_slot(v, s, self._name)
                else:
                    self._get_or_make_slot_with_initializer(
                        v, tf.compat.v1.constant_initializer(init, dtype=v.dtype.base_dtype), v.shape,
                        v.dtype.base_dtype, s, self._name)

    def _slot_initial(self, name):
        return 0.0

    @staticmethod
    def _graph_key():
        return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()

    def global_norm(self):
        """The pre-clip global norm of the last step (a variable), or None before a step was built.
        A local variable, outside `variables()` and checkpoints; the step writes it."""
        with tf.init_scope():
            return self._tfclip_norms.get(self._graph_key())

    def tensor_norms(self):
        """Each gradient's pre-clip norm in the last step built (a float32 local variable, one
        entry per (gradient, variable) pair given to `apply_gradients`, in that order; 0 for a
        pair whose gradient is None), or None before a step was built. Fetch it with the train
        op or after it: `sess.run(opt.tensor_norms())` reads the variable, it runs no step.
        Outside `variables()` and checkpoints; the step writes it, a skipped one too."""
        with tf.init_scope():
            entry = self._tfclip_last_tnorms.get(self._graph_key())
        return None if entry is None else entry[0]

    def clipped_units(self):
        """With `clip=tfclip.clipping.AGC(...)`: each gradient's count of units AGC scaled down in
        the last step built (an int64 local variable aligned with `tensor_norms()` and
        `tensor_norm_names()`; 0 for a pair whose gradient is None), counted by the fused op.
        None without AGC or before a step was built. Fetch it as `tensor_norms()`; a skipped
        step writes it too."""
        with tf.init_scope():
            return self._tfclip_last_cunits.get(self._graph_key())

    def tensor_norm_names(self):
        """The variable names `tensor_norms()` is aligned with (those of the last step built)."""
        with tf.init_scope():
            entry = self._tfclip_last_tnorms.get(self._graph_key())
        return None if entry is None else list(entry[1])

    def _tnorm_var(self, all_vars):
        # One per graph and list of variables (a second train op over other variables gets its
        # own).
        graph = self._graph_key()
        key = (graph, tuple(id(v) for v in all_vars))
        if key not in self._tfclip_tnorms:
            var = self._local_var(all_vars, tf.zeros([len(all_vars)], tf.float32), "tensor_norms")
            self._tfclip_tnorms[key] = (var, tuple(v.name for v in all_vars))
        self._tfclip_last_tnorms[graph] = self._tfclip_tnorms[key]
        if isinstance(self._adaptive, _clipping.AGC):
            if key not in self._tfclip_cunits:
                self._tfclip_cunits[key] = self._local_var(
                    all_vars, tf.zeros([len(all_vars)], tf.int64), "clipped_units")
            self._tfclip_last_cunits[graph] = self._tfclip_cunits[key]
        else:
            self._tfclip_last_cunits.pop(graph, None)
        return self._tfclip_tnorms[key][0]

    def _norm_var(self, var_list):
        key = self._graph_key()
        if key not in self._tfclip_norms:
            self._tfclip_norms[key] = self._local_var(var_list, 0.0, "global_norm")
        return self._tfclip_norms[key]

    def _local_var(self, var_list, initial, name):
        # A local variable of tfclip's own, created in the variables' graph (the caller is in
        # init_scope), colocated with the first of them.
        first = min(var_list, key=lambda x: x.name)
        with tf.device(first.device), tf.name_scope(self._name + "_tfclip"):
            return tf.compat.v1.Variable(initial, name=name, trainable=False, use_resource=True,
                                         collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def _finish_step(self, applied):
        """State updates after the op (Adam: the beta powers); ops to group with the step."""
        return []

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("No variables provided.")
        for i, pair in enumerate(pairs):
            try:
                _, _ = pair
            except (TypeError, ValueError):
                raise TypeError(f"grads_and_vars[{i}] is not a (gradient, variable) pair") from None
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            # As the stock class: the replicas' gradients summed, then one update of every copy
            # from the cross-replica context (each replica writing its own copy would let them
            # drift apart).
            replica = tf.distribute.get_replica_context()
            if replica is None:
                raise RuntimeError("Use `_distributed_apply()` instead of `apply_gradients()` in a "
                                   "cross-replica context.")
            return replica.merge_call(self._distributed_apply, args=(pairs, global_step, name))
        # One step at a time per optimizer (eager threads sharing it make its slots once).
        with _opcall.state_lock(self):
            return self._apply_pairs(pairs, global_step, name)

    def _distributed_apply(self, strategy, pairs, global_step=None, name=None):
        given = [(g, v) for g, v in pairs if g is not None]
        reduced = iter(strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, given) if given else ())
        pairs = [(None if g is None else next(reduced), v) for g, v in pairs]
        return self._apply_pairs(pairs, global_step, name, strategy)

    def _apply_pairs(self, pairs, global_step, name, strategy=None):
        grads, var_list, all_vars, where = [], [], [], []
        for i, (g, v) in enumerate(pairs):
            all_vars.append(v)
            if g is None:
                where.append(None)
                continue
            where.append(len(var_list))
            ref = _is_ref(v)
            if not (ref or isinstance(v, tf.distribute.DistributedValues) or hasattr(v, "handle")):
                raise TypeError(f"grads_and_vars[{i}]: {getattr(v, 'name', v)!r} is not a variable; tfclip "
                                "updates resource and ref variables")
            if not isinstance(g, (tf.IndexedSlices, tf.distribute.DistributedValues)):
                g = tf.convert_to_tensor(g)
            if ref:
                _check_ref_pair(i, g, v)
            grads.append(g)
            var_list.append(v)
        if not var_list:
            raise ValueError(f"No gradients provided for any variable: {[v.name for _, v in pairs]}")
        with tf.init_scope():
            self._create_slots(var_list)
            if isinstance(self._adaptive, _clipping.AdaptiveClip):
                self._adaptive.bind(self)
                with _state_scope():
                    self._adaptive.build()
            norm_var = self._norm_var(var_list)
            tnorm_var = self._tnorm_var(all_vars)
            cunits_var = self._tfclip_last_cunits.get(self._graph_key())

        def step(grads):
            self._prepare()
            norm, applied, tnorms, adaptive, cunits = self._fused(var_list, grads)
            if len(var_list) < len(all_vars):  # a 0 for each pair without a gradient
                spread = [len(var_list) if k is None else k for k in where]
                tnorms = tf.gather(tf.concat([tnorms, [0.0]], 0), spread)
                cunits = tf.gather(tf.concat([cunits, tf.zeros([1], tf.int64)], 0), spread)
            updates = [norm_var.assign(norm, read_value=False),
                       tnorm_var.assign(tnorms, read_value=False), *self._finish_step(applied)]
            if cunits_var is not None:
                updates.append(cunits_var.assign(cunits, read_value=False))
            if adaptive is not None:
                updates.append(_clipping.assign_updates(adaptive, after=[applied]))
            return [u for u in updates if u is not None]

        with tf.name_scope(name or self._name):
            if strategy is None:
                updates = step(grads)
            else:  # the same op on every device, over its copies
                updates = [strategy.extended.update(
                    var_list[0], lambda _, *gs: tf.group(*step(list(gs))), args=tuple(grads), group=True)]
            with tf.control_dependencies(updates):
                if global_step is None:
                    train_op = tf.group(*updates, name="apply")
                elif strategy is not None:
                    train_op = strategy.extended.update(
                        global_step, lambda g: g.assign_add(1, read_value=False, name="apply"))
                else:
                    train_op = tf.compat.v1.assign_add(global_step, 1, name="apply").op
        if not tf.executing_eagerly():
            # As the stock class: the train op joins GraphKeys.TRAIN_OP, where TF1 programs that
            # export and re-import their meta-graph find it (tf.get_collection("train_op")[0]).
            op = train_op.op if isinstance(train_op, tf.Tensor) else train_op
            collection = tf.compat.v1.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
            if op not in collection:
                collection.append(op)
        return train_op

    # IndexedSlices updates as the stock TF1 class applies them (_resource_apply_sparse).
    _lazy_sparse = False

    def _fused(self, var_list, grads):
        values, sparse_kw = _opcall.op_grads(grads)
        kind, hparams, flags = self._op_inputs()
        hparams = {k: _f64(v, k) for k, v in hparams.items()}
        names = self._op_slot_names or self._slot_names
        positions = [i for i, v in enumerate(var_list) if _is_ref(v)]
        refs = None
        if positions:  # TF1 ref variables: the ref op, which takes them with any resources
            ref_vars = [var_list[i] for i in positions]
            var_list = [v for v in var_list if not _is_ref(v)]
            refs = (positions, ref_vars, [[self._slot_of(v, s, True) for v in ref_vars] for s in names])
        mode, clip, use_norm, adaptive, agc = self._clip_mode, tf.constant(self._clip, tf.float64), None, None, {}
        if isinstance(self._adaptive, _clipping.AGC):  # unit-wise, inside the op's own passes
            mode, factor, agc = self._adaptive.op_args()
            clip = tf.constant(factor, tf.float64)
        elif self._adaptive is not None:  # the norm pass, the threshold, then the apply pass with both
            use_norm, tensor_norms = _loader.ops().tfclip_global_norm(t=values, Tnorm=tf.float64)
            adaptive = self._adaptive.step(use_norm)
            mode, clip = "global_norm", adaptive.clip
        norm, applied, tnorms, cunits = _opcall.apply(
            kind, [v.handle for v in var_list],
            [[self._slot_of(v, s, False).handle for v in var_list] for s in names],
            values,
            hparams, flags, refs=refs, clip=clip,
            use_norm=tf.constant(0.0, tf.float64) if use_norm is None else use_norm, iterations=[],
            clip_mode=mode, nonfinite=self._nonfinite, lazy=self._lazy_sparse,
            use_given_norm=use_norm is not None, **agc, **sparse_kw)
        if adaptive is not None:
            tnorms = tf.cast(tensor_norms, tnorms.dtype)
        return norm, applied, tnorms, adaptive, cunits

    def _slot_of(self, v, name, ref):
        slot = self.get_slot(v, name)
        if _is_ref(slot) != ref:
            kinds = ("a resource variable", "a ref variable")
            raise TypeError(f"slot '{name}' of {v.name} is {kinds[_is_ref(slot)]} but {v.name} is "
                            f"{kinds[ref]}; the step takes a variable's slots of its own kind (as "
                            "slot_creator makes them)")
        return slot

    # The stock per-variable hooks are not used: everything goes through apply_gradients.
    def _apply_dense(self, grad, var):
        raise NotImplementedError("tfclip applies all variables in one fused op")

    _resource_apply_dense = _apply_dense


class GradientDescentOptimizer(_Fused):
    """tf.compat.v1.train.GradientDescentOptimizer with fused clipping."""

    def __init__(self, learning_rate, use_locking=False, name="GradientDescent", *, global_clipnorm=None,
                 clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate)
        self._learning_rate = learning_rate

    def _op_inputs(self):
        return "sgd", {"lr": self._learning_rate, "weight_decay": 0.0}, {}


class MomentumOptimizer(_Fused):
    """tf.compat.v1.train.MomentumOptimizer (slot `momentum`) with fused clipping."""

    _slot_names = ("momentum",)
    _lazy_sparse = True  # ResourceSparseApplyMomentum updates only the touched rows

    def __init__(self, learning_rate, momentum, use_locking=False, name="Momentum", use_nesterov=False, *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, momentum=momentum)
        self._learning_rate, self._momentum, self._use_nesterov = learning_rate, momentum, use_nesterov

    def _op_inputs(self):
        return ("momentum", {"lr": self._learning_rate, "momentum": self._momentum, "weight_decay": 0.0},
                {"use_nesterov": self._use_nesterov})


class AdamOptimizer(_Fused):
    """tf.compat.v1.train.AdamOptimizer (slots `m`, `v`) with fused clipping."""

    _slot_names = ("m", "v")

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, use_locking=False,
                 name="Adam", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon)
        self._lr, self._beta1, self._beta2, self._epsilon = learning_rate, beta1, beta2, epsilon

    def _create_slots(self, var_list):
        # The stock accumulators beta1^t, beta2^t (the bias correction's), as the stock class
        # creates and names them.
        first = min(var_list, key=lambda x: x.name)
        self._create_non_slot_variable(initial_value=self._beta1, name="beta1_power", colocate_with=first)
        self._create_non_slot_variable(initial_value=self._beta2, name="beta2_power", colocate_with=first)
        super()._create_slots(var_list)

    def _beta_powers(self):
        with tf.init_scope():
            graph = self._graph_key()
            return (self._get_non_slot_variable("beta1_power", graph=graph),
                    self._get_non_slot_variable("beta2_power", graph=graph))

    def _get_beta_accumulators(self):
        """The stock class's (beta1_power, beta2_power) variables: beta1^t and beta2^t, which the
        bias correction uses (TF's own Adam tests and user code read them)."""
        return self._beta_powers()

    def _op_inputs(self):
        b1p, b2p = self._beta_powers()
        return ("adam", {"lr": self._lr, "beta_1": self._beta1, "beta_2": self._beta2,
                         "epsilon": self._epsilon, "weight_decay": 0.0, "step": 1.0,
                         "beta_1_power": tf.cast(b1p, tf.float64), "beta_2_power": tf.cast(b2p, tf.float64)},
                {"amsgrad": False})

    def _finish_step(self, applied):
        # As the stock _finish (power *= beta, in the accumulator's dtype), only for an applied step.
        out = []
        for p, beta in zip(self._beta_powers(), (self._beta1, self._beta2)):
            b = tf.cast(beta() if callable(beta) else beta, p.dtype)
            out.append(p.assign(tf.where(applied, p * b, p), read_value=False))
        return out


class RMSPropOptimizer(_Fused):
    """tf.compat.v1.train.RMSPropOptimizer (slots `rms` starting at 1, `momentum`, and `mg` when
    centered) with fused clipping."""

    _lazy_sparse = True  # ResourceSparseApplyRMSProp updates only the touched rows

    def __init__(self, learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, use_locking=False, centered=False,
                 name="RMSProp", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, decay=decay, momentum=momentum, epsilon=epsilon)
        self._learning_rate, self._decay, self._momentum = learning_rate, decay, momentum
        self._epsilon, self._centered = epsilon, centered
        self._slot_names = ("rms", "mg", "momentum") if centered else ("rms", "momentum")
        self._op_slot_names = ("rms", "momentum", "mg") if centered else None

    def _slot_initial(self, name):
        return 1.0 if name == "rms" else 0.0

    def _op_inputs(self):
        return ("tf_rmsprop", {"lr": self._learning_rate, "rho": self._decay, "momentum": self._momentum,
                               "epsilon": self._epsilon, "weight_decay": 0.0}, {"centered": self._centered})


class AdagradOptimizer(_Fused):
    """tf.compat.v1.train.AdagradOptimizer (slot `accumulator`, starting at
    `initial_accumulator_value`) with fused clipping."""

    _slot_names = ("accumulator",)
    _lazy_sparse = True  # ResourceSparseApplyAdagrad updates only the touched rows

    def __init__(self, learning_rate, initial_accumulator_value=0.1, use_locking=False, name="Adagrad", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        if initial_accumulator_value <= 0.0:
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value)
        self._learning_rate, self._initial = learning_rate, initial_accumulator_value

    def _slot_initial(self, name):
        return self._initial

    def _op_inputs(self):
        return "adagrad", {"lr": self._learning_rate, "epsilon": 0.0, "weight_decay": 0.0}, {}


class AdadeltaOptimizer(_Fused):
    """tf.compat.v1.train.AdadeltaOptimizer (slots `accum`, `accum_update`; ResourceApplyAdadelta)
    with fused clipping. The core's Adadelta rule is TF's arithmetic but for TF's
    `sqrt(accum_update + eps) * rsqrt(accum + eps) * g`, computed as a quotient of square roots:
    float rounding apart (an ulp or two a step)."""

    _slot_names = ("accum", "accum_update")
    _lazy_sparse = True  # ResourceSparseApplyAdadelta updates only the touched rows

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-8, use_locking=False, name="Adadelta", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, rho=rho, epsilon=epsilon)
        self._learning_rate, self._rho, self._epsilon = learning_rate, rho, epsilon

    def _op_inputs(self):
        return "adadelta", {"lr": self._learning_rate, "rho": self._rho, "epsilon": self._epsilon,
                            "weight_decay": 0.0}, {}


class FtrlOptimizer(_Fused):
    """tf.compat.v1.train.FtrlOptimizer (slots `accum`, starting at `initial_accumulator_value`, and
    `linear`; ResourceApplyFtrl / ResourceApplyFtrlV2 with `l2 + beta / (2 * lr)`) with fused
    clipping. The stock class's argument checks, names (`accum_name`, `linear_name`) included."""

    _slot_names = ("accum", "linear")
    _lazy_sparse = True  # ResourceSparseApplyFtrl updates only the touched rows

    def __init__(self, learning_rate, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, use_locking=False,
                 name="Ftrl", accum_name=None, linear_name=None, l2_shrinkage_regularization_strength=0.0,
                 beta=None, *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        for what, v in (("initial_accumulator_value", initial_accumulator_value),
                        ("l1_regularization_strength", l1_regularization_strength),
                        ("l2_regularization_strength", l2_regularization_strength),
                        ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength)):
            if v < 0.0:  # the stock class's checks and words
                raise ValueError(f"{what} {v:f} needs to be positive or zero")
        if learning_rate_power > 0.0:
            raise ValueError(f"learning_rate_power {learning_rate_power:f} needs to be negative or zero")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        beta = 0.0 if beta is None else beta
        self._check_numbers(learning_rate=learning_rate, learning_rate_power=learning_rate_power,
                            initial_accumulator_value=initial_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength,
                            l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength,
                            beta=beta)
        self._learning_rate, self._power, self._initial = learning_rate, learning_rate_power, initial_accumulator_value
        self._l1, self._l2, self._l2_shrinkage, self._beta = (
            l1_regularization_strength, l2_regularization_strength, l2_shrinkage_regularization_strength, beta)
        self._accum_name, self._linear_name = accum_name, linear_name

    def _create_slots(self, var_list):
        # As the stock class: accum (named after accum_name or the optimizer), then linear.
        for v in var_list:
            self._get_or_make_slot_with_initializer(
                v, tf.compat.v1.constant_initializer(self._initial, dtype=v.dtype.base_dtype), v.shape,
                v.dtype.base_dtype, "accum", self._accum_name or self._name)
            self._zeros_slot(v, "linear", self._linear_name or self._name)

    def _op_inputs(self):
        kind, power = _opcall.ftrl_variant(self._power)
        return kind, {"lr": self._learning_rate, **power, "l1": self._l1, "l2": self._l2,
                      "l2_shrinkage": self._l2_shrinkage, "beta": self._beta, "weight_decay": 0.0}, {}


class ProximalGradientDescentOptimizer(_Fused):
    """tf.compat.v1.train.ProximalGradientDescentOptimizer (FOBOS: a gradient step, then the l1
    and l2 proximal steps; ResourceApplyProximalGradientDescent) with fused clipping. No slots.
    IndexedSlices: the touched rows, each duplicate in turn, as TF's sparse kernel."""

    _lazy_sparse = True  # ResourceSparseApplyProximalGradientDescent updates only the touched rows

    def __init__(self, learning_rate, l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 use_locking=False, name="ProximalGradientDescent", *, global_clipnorm=None, clipnorm=None,
                 clipvalue=None, nonfinite="skip", clip=None):
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate = learning_rate
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength

    def _op_inputs(self):
        return "proximal_gradient_descent", {"lr": self._learning_rate, "l1": self._l1, "l2": self._l2}, {}


class ProximalAdagradOptimizer(_Fused):
    """tf.compat.v1.train.ProximalAdagradOptimizer (slot `accumulator`, starting at
    `initial_accumulator_value`; ResourceApplyProximalAdagrad) with fused clipping. As TF's
    kernel, a learning rate <= 0 is refused: a number at construction (ValueError), a tensor
    when the step runs (InvalidArgumentError, nothing written). IndexedSlices: the touched rows,
    each duplicate in turn, as TF's sparse kernel."""

    _slot_names = ("accumulator",)
    _lazy_sparse = True  # ResourceSparseApplyProximalAdagrad updates only the touched rows

    def __init__(self, learning_rate, initial_accumulator_value=0.1, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, use_locking=False, name="ProximalAdagrad", *,
                 global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        if initial_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        if isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool) and learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it), got {learning_rate}")
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate, self._initial = learning_rate, initial_accumulator_value
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength

    def _slot_initial(self, name):
        return self._initial

    def _op_inputs(self):
        lr = self._learning_rate
        if not isinstance(lr, numbers.Real):  # a tensor or callable: checked when the step runs
            lr = _f64(lr, "learning_rate")
            check = tf.debugging.assert_positive(
                lr, message="learning_rate must be > 0 (TF's ProximalAdagrad kernel refuses it)")
            with tf.control_dependencies([check]):
                lr = tf.identity(lr)
        return "proximal_adagrad", {"lr": lr, "l1": self._l1, "l2": self._l2}, {}


class AdagradDAOptimizer(_Fused):
    """tf.compat.v1.train.AdagradDAOptimizer (slots `gradient_accumulator` and
    `gradient_squared_accumulator`, the latter starting at
    `initial_gradient_squared_accumulator_value`; ResourceApplyAdagradDA) with fused clipping.
    As the stock class, the step is given `global_step + 1`, read when the step runs (the
    constructor's `global_step`, a tensor or variable; required). IndexedSlices: the touched
    rows, each duplicate accumulated in turn, as TF's sparse kernel."""

    _slot_names = ("gradient_accumulator", "gradient_squared_accumulator")
    _lazy_sparse = True  # ResourceSparseApplyAdagradDA updates only the touched rows

    def __init__(self, learning_rate, global_step, initial_gradient_squared_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0, use_locking=False,
                 name="AdagradDA", *, global_clipnorm=None, clipnorm=None, clipvalue=None, nonfinite="skip", clip=None):
        if initial_gradient_squared_accumulator_value <= 0.0:  # the stock class's check and words
            raise ValueError("initial_gradient_squared_accumulator_value must be positive: "
                             f"{initial_gradient_squared_accumulator_value}")
        if global_step is None:
            # The stock class fails only when the step is built, converting None to a tensor.
            raise ValueError("AdagradDAOptimizer needs global_step, the training step counter (a tensor or "
                             "variable, e.g. tf.compat.v1.train.get_or_create_global_step()): its update "
                             "uses global_step + 1; got None")
        super().__init__(use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip)
        self._check_numbers(learning_rate=learning_rate,
                            initial_gradient_squared_accumulator_value=initial_gradient_squared_accumulator_value,
                            l1_regularization_strength=l1_regularization_strength,
                            l2_regularization_strength=l2_regularization_strength)
        self._check_strengths(l1_regularization_strength=l1_regularization_strength,
                              l2_regularization_strength=l2_regularization_strength)
        self._learning_rate, self._initial = learning_rate, initial_gradient_squared_accumulator_value
        self._l1, self._l2 = l1_regularization_strength, l2_regularization_strength
        self._global_step = global_step

    def _slot_initial(self, name):
        return self._initial if name == "gradient_squared_accumulator" else 0.0

    def _op_inputs(self):
        gs = self._global_step
        gs = tf.cast(gs() if callable(gs) else gs, tf.float64) + 1.0  # the stock class's global_step + 1
        return "adagrad_da", {"lr": self._learning_rate, "l1": self._l1, "l2": self._l2, "global_step": gs}, {}
