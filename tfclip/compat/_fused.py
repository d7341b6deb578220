"""What the `tfclip.compat.v1` optimizers share (`_Fused`): the stock TF1 class's
apply_gradients (pairs, slots, ref variables, distribution, global_step, the train op and its
collection) around the one fused step (tfclip/_engine/step.py), and tfclip's own norm variables. The
classes, each a constructor and a binding row: tfclip/compat/v1.py."""
import numbers

import tensorflow as tf

from tfclip._engine import opcall as _opcall
from tfclip._engine import narrow_state as _narrow
from tfclip._engine import step as _step
from tfclip._engine import checks as _checks
from tfclip._engine import loss_scale as _loss_scale
from tfclip import clipping as _clipping


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
    _tfclip_binding = None  # per class: its rule-table row, as data (tfclip/_engine/step.py, Binding)
    # Whether state_dtype="bfloat16" may store this class's slots as bfloat16 (tfclip.rules).
    low_precision_state = False
    int8_state = True  # (where low_precision_state is: every such class keeps moments only)

    def __init__(self, use_locking, name, global_clipnorm, clipnorm, clipvalue, nonfinite, clip=None,
                 state_dtype=None, stochastic_rounding=False, rounding_seed=0):
        super().__init__(use_locking, name)
        self._state_dtype = _narrow.check_state_dtype(state_dtype, type(self))
        # bfloat16 variables' stochastic rounding (csrc/core/rounding.h): the step it draws by is
        # global_step + 1 where apply_gradients is given one, else the optimizer's own count of
        # its steps in the graph (a local variable, not saved)
        self._stochastic_rounding, self._rounding_seed = _checks.check_rounding(stochastic_rounding, rounding_seed)
        self._tfclip_rounding_steps = {}  # graph -> its step count; not tracked
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
                _checks.check_number(name, float(v))

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
            # The variable's dtype, as the stock class; bfloat16 for a float32 variable under
            # state_dtype="bfloat16", uint8 codes and a float32 absmax slot `<name>_absmax` beside
            # each under "int8" (docs/low-precision-state.md).
            dtype = _narrow.state_slot_dtype(self._state_dtype, v.dtype.base_dtype)
            if dtype == tf.uint8:
                self._create_int8_slots(v)
                continue
            for s in self._slot_names:
                init = self._slot_initial(s)
                if init == 0.0 and dtype == v.dtype.base_dtype:
                    self._zeros_slot(v, s, self._name)
                else:
                    self._get_or_make_slot_with_initializer(
                        v, tf.compat.v1.constant_initializer(init, dtype=dtype), v.shape, dtype, s, self._name)

    def _create_int8_slots(self, v):
        if _is_ref(v):
            raise ValueError(f"{v.name} is a TF1 ref variable: int8 optimizer state is for resource "
                             "variables (tf.compat.v1.enable_resource_variables(), or "
                             "tf.compat.v1.get_variable(..., use_resource=True))")
        unsigned = self._unsigned_slots()
        for s in self._slot_names:
            codes, absmax = _narrow.int8_start(self._slot_initial(s), s not in unsigned)
            slot = self._get_or_make_slot_with_initializer(
                v, tf.compat.v1.constant_initializer(codes, dtype=tf.uint8), v.shape, tf.uint8, s, self._name)
            # Named <variable>/<optimizer>_<slot>_absmax: the codes keep the stock slots' names
            # (w/Adam, w/Adam_1, ...), and a Saver's checkpoint says which absmax is whose.
            a = self._get_or_make_slot_with_initializer(
                v, tf.compat.v1.constant_initializer(absmax, dtype=tf.float32),
                tf.TensorShape([_narrow.int8_blocks(v.shape)]), tf.float32, f"{s}_absmax", f"{self._name}_{s}_absmax")
            _narrow.keep_int8_slot(self, slot, a, s not in unsigned, (v, s))

    def _create_or_restore_slot_variable(self, slot_variable_position, slot_name, variable):
        # A checkpoint restored eagerly before the first step makes each slot as it restores it,
        # in the variable's dtype and shape: int8 state's slots are made here first (codes and
        # absmax, as the step makes them), and restored into.
        if (tf.executing_eagerly() and self._state_dtype == "int8" and not _is_ref(variable)
                and variable.dtype.base_dtype == tf.float32 and self.get_slot(variable, slot_name) is None):
            self._create_int8_slots(variable)
        return super()._create_or_restore_slot_variable(slot_variable_position, slot_name, variable)

    def tfclip_int8_slots(self):
        """int8 state's slots (state_dtype="int8"): `_narrow.Int8Slot`s (tfclip.convert_checkpoint)."""
        return list(getattr(self, "_tfclip_int8_slots", ()))

    def _unsigned_slots(self):
        """The stock names of the slots the rule keeps >= 0 (int8 state's unsigned code)."""
        return _narrow.unsigned_slots(self._tfclip_binding, self)

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
                with _checks.state_scope():
                    self._adaptive.build()
            norm_var = self._norm_var(var_list)
            tnorm_var = self._tnorm_var(all_vars)
            cunits_var = self._tfclip_last_cunits.get(self._graph_key())

        rounding_step, counter = None, None
        if self._stochastic_rounding:
            if global_step is not None:
                rounding_step = tf.cast(global_step, tf.float64) + 1.0
            elif strategy is not None:
                raise ValueError(f"{type(self).__name__}(stochastic_rounding=True) under a strategy draws its "
                                 "bits by the step: pass apply_gradients (or minimize) a global_step")
            else:
                with tf.init_scope():
                    counter = self._rounding_counter(var_list)
                rounding_step = tf.cast(counter, tf.float64) + 1.0

        def step(grads):
            self._prepare()
            result = self._fused(var_list, grads, rounding_step)
            norm, applied, tnorms, cunits = result.outputs
            if len(var_list) < len(all_vars):  # a 0 for each pair without a gradient
                spread = [len(var_list) if k is None else k for k in where]
                tnorms = tf.gather(tf.concat([tnorms, [0.0]], 0), spread)
                cunits = tf.gather(tf.concat([cunits, tf.zeros([1], tf.int64)], 0), spread)
            updates = [norm_var.assign(norm, read_value=False),
                       tnorm_var.assign(tnorms, read_value=False), *self._finish_step(applied)]
            if cunits_var is not None:
                updates.append(cunits_var.assign(cunits, read_value=False))
            if result.clip_update is not None:
                updates.append(result.clip_update)
            return [u for u in updates if u is not None]

        with tf.name_scope(name or self._name):
            if strategy is None:
                updates = step(grads)
            else:  # the same op on every device, over its copies
                updates = [strategy.extended.update(
                    var_list[0], lambda _, *gs: tf.group(*step(list(gs))), args=tuple(grads), group=True)]
            if counter is not None:  # (after the op, which read it)
                with tf.control_dependencies(updates):
                    updates = updates + [counter.assign_add(1, read_value=False)]
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

    def _rounding_counter(self, var_list):
        key = self._graph_key()
        if key not in self._tfclip_rounding_steps:
            self._tfclip_rounding_steps[key] = self._local_var(var_list, tf.constant(0, tf.int64), "rounding_step")
        return self._tfclip_rounding_steps[key]

    def _fused(self, var_list, grads, rounding_step=None):
        """The step through the one fused step (tfclip/_engine/step.py): TF1's part is its ref variables
        and its slots."""
        binding = self._tfclip_binding
        kind = binding.kind(self)
        hparams, flags = binding.values(self, var_list)
        if "weight_decay" in _opcall.RULES[kind]["hparams"]:
            hparams["weight_decay"] = 0.0  # (the TF1 classes have none)
        hparams = {k: _f64(v, k) for k, v in hparams.items()}
        names = [stock for _, stock in binding.slot_names(self)]  # in the op's order
        given = list(var_list)  # (the gradients' order)
        positions = [i for i, v in enumerate(var_list) if _is_ref(v)]
        refs = None
        if positions:  # TF1 ref variables: the ref op, which takes them with any resources
            ref_vars = [var_list[i] for i in positions]
            var_list = [v for v in var_list if not _is_ref(v)]
            refs = (positions, ref_vars, [[self._slot_of(v, s, True) for v in ref_vars] for s in names])
        # int8 state's absmax slots, slot-major (the op's `absmax` input); such a variable's
        # IndexedSlices gradient applied densified (the core requantizes whole blocks), as the
        # other front doors do
        int8 = [self.get_slot(v, names[0]).dtype.base_dtype == tf.uint8 if names and not _is_ref(v) else False
                for v in var_list]
        absmax = [self.get_slot(v, f"{s}_absmax").handle for s in names for v, q in zip(var_list, int8) if q]
        if any(int8):
            dense = {id(v) for v, q in zip(var_list, int8) if q}
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and id(v) in dense else g
                     for g, v in zip(grads, given)]
        group = _step.Group(kind, [v.handle for v in var_list],
                            [[self._slot_of(v, s, False).handle for v in var_list] for s in names],
                            hparams, flags, refs=refs, absmax=absmax)
        # Inside tfclip.compat.v1.MixedPrecisionLossScaleOptimizer's minimize (tfclip/compat/
        # _loss_scale.py): the unscale folded in, a non-finite step skipped whatever `nonfinite`
        # says (the loss scale backs off), as the stock wrapper skips the inner step (`loss_scale_of`).
        return _step.run(grads, [group], self._clip_mode, self._clip, clip_obj=self._adaptive,
                         nonfinite=self._nonfinite, lazy=self._lazy_sparse, loss_scale_of=self,
                         rounding=None if rounding_step is None else (self._rounding_seed, rounding_step))

    def _tfclip_hparam(self, name, var_list):  # (a Binding's source: the attribute)
        return getattr(self, name)

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
