"""`tfclip.keras.Muon` (keras.optimizers.Muon): one fused step over every gradient
(tfclip._engine.step.run: one norm pass, the AdamW variables one fused Adam op), its matrices
outside the ops: clipped as the op clips (tfclip._engine.tf_clip), then the momentum op
(csrc/core/rules.h, MuonMomentumRule), the Newton–Schulz iterations in TF ops, and the update op
(MuonUpdateRule). The iterations run batched on a GPU: the matrices of one shape, and those of
its transpose (transposed first, as stock transposes a tall matrix), are stacked and
orthogonalized as one batch, so a step issues `3 * ns_steps` matrix products per distinct shape,
not per matrix (a GPU step is launch-bound on small products). On the CPU they run per matrix:
TF's CPU batched product is slower than its per-matrix one, whose independent chains TF already
runs side by side (benchmarks/cpu_bench.py --extras muon; docs/benchmarks.md)."""
import math
import numbers

import keras
import numpy as np
import tensorflow as tf

from tfclip._engine import checks as _checks
from tfclip._engine import opcall as _opcall
from tfclip._engine import shard as _shard
from tfclip._engine import step as _step
from tfclip._engine.binding import STEP, Binding
from tfclip.keras._dropin import _Generic, _tf_var


def read(handle, dtype):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def assign(handle, value):
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def shape_groups(shapes, dtypes=None):
    """The batches of a step: [(key, [(index, transposed)])], key (rows, cols) with rows <= cols
    (and the dtype, where `dtypes` are given: a batch is one tensor), in the order each key first
    appears; a matrix taller than wide joins its transpose's batch."""
    groups = {}
    for i, (r, c) in enumerate(shapes):
        key, t = ((c, r), True) if r > c else ((r, c), False)
        if dtypes is not None:
            key = key + (dtypes[i],)
        groups.setdefault(key, []).append((i, t))
    return list(groups.items())


def orthogonalize(updates, newton_schulz, batch=True):
    """Each 2-D update orthogonalized by `newton_schulz(x)` (the stock
    `zeropower_via_newtonschulz5`, which takes a batch [B, rows, cols] as it takes a matrix),
    one call per shape batch (batch=False: per matrix); in the updates' order and shapes. A batch
    of one is the matrix itself (the stock call, bit for bit)."""
    if not batch:
        return [newton_schulz(u) for u in updates]
    out = [None] * len(updates)
    for _, members in shape_groups([tuple(u.shape) for u in updates], [u.dtype for u in updates]):
        if len(members) == 1:
            out[members[0][0]] = newton_schulz(updates[members[0][0]])
            continue
        ys = tf.unstack(newton_schulz(tf.stack([tf.transpose(updates[i]) if t else updates[i] for i, t in members])))
        for (i, t), y in zip(members, ys):
            out[i] = tf.transpose(y) if t else y
    return out


class Muon(_Generic, keras.optimizers.Muon):
    """keras.optimizers.Muon (momentum with Nesterov, five Newton–Schulz iterations per matrix,
    Moonlight's `rms_rate` scaling; AdamW for every variable that is not 2-D, an embedding, or
    in `exclude_layers`) with the stock arguments, slots and trajectory. One norm pass over every
    gradient; the AdamW variables are one fused Adam op (with the clip, the non-finite policy and
    `adam_weight_decay`); the matrices' momentum is one fused op over all of them (rules.h,
    MuonMomentumRule), their Newton–Schulz iterations TF matrix products (tfclip/keras/_muon.py;
    batched on a GPU over the matrices of one shape, transposed shapes joined: a few batched
    products per distinct shape, not per matrix; on the CPU per matrix, which is faster there),
    and their weight decay and `rms_rate`-scaled update one fused op per matrix size
    (MuonUpdateRule). The clip is the one the AdamW op runs, from the same norm pass. Extra:
    `nonfinite`, and `shard_state=True`, where each replica also runs the Newton–Schulz products
    of its own matrices only. Not `state_dtype` (the matrices' momentum is read by the Nesterov step and the
    products, TF ops) or `stochastic_rounding` (those TF ops round to nearest)."""

    _tfclip_binding = Binding("adam", slots=(("m", "momentums"), ("v", "adam_velocities")),
                              hparams=(("beta_1", "adam_beta_1"), ("beta_2", "adam_beta_2"),
                                       ("epsilon", "epsilon"), ("step", STEP)),
                              flags=(("amsgrad", lambda o: False),))
    # The matrices' two fused ops: the momentum slot as the op's variable, and the update
    # (shape_scale: keras's sqrt(max(rows, cols)), in float32 as keras computes it; a group's
    # matrices share their largest dimension).
    _tfclip_momentum_binding = Binding("muon_momentum", hparams=(("momentum", "momentum"),))
    _tfclip_update_binding = Binding("muon_update", hparams=(
        ("shape_scale", lambda o, vs: 1.0 if o.rms_rate is None else float(np.sqrt(np.float32(max(vs[0].shape))))),
        ("rms_rate", lambda o, vs: 1.0 if o.rms_rate is None else o.rms_rate)))
    _checked = ("epsilon", "momentum")
    low_precision_state = False
    int8_state = False
    # Whether the Newton–Schulz products run batched by shape: None, on a GPU (tfclip/keras/_muon.py).
    _tfclip_batch_products = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, table in (("adam_beta_1", "beta_1"), ("adam_beta_2", "beta_2")):
            _check_number_as(name, table, getattr(self, name))
        for name in ("adam_lr_ratio", "adam_weight_decay", "rms_rate", "muon_a", "muon_b", "muon_c"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number{' or None' if name != 'adam_lr_ratio' else ''}, "
                                     f"got {v!r}")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, numbers.Integral) or self.ns_steps < 0:
            raise ValueError(f"ns_steps must be an int >= 0, got {self.ns_steps!r}")
        if self.stochastic_rounding:
            raise ValueError("Muon does not take stochastic_rounding=True: its matrices' Nesterov step and "
                             "Newton–Schulz products are TF ops (tfclip/keras/_muon.py), which round to nearest")

    def _tfclip_state_weights(self, var_list):
        # (AdamW's variables keep two slots, a matrix one: sharded by state bytes, not variable bytes)
        return [2 if self._should_use_adamw(v) else 1 for v in var_list]

    def _tfclip_is_matrix(self, v):
        """Whether `v` takes Muon's own step (stock keeps no AdamW velocity for it)."""
        return self.adam_velocities[self._get_variable_index(v)] is None

    def _fused_update_step(self, grads, keras_vars, learning_rate):
        # One step (tfclip._engine.step.run) over every gradient: one norm pass; the AdamW
        # variables one fused Adam op; the matrices outside the ops, clipped as the op clips
        # its variables and stepped by `_tfclip_matrices`. shard_state (tfclip._engine.shard):
        # the norm of every gradient, then this replica's variables only, the Newton–Schulz
        # products of its own matrices too.
        share = _shard.begin(grads, self._tfclip_owners_of(keras_vars))
        own = list(range(len(keras_vars))) if share is None else list(share.own)
        mats = [self._tfclip_is_matrix(keras_vars[i]) for i in own]
        adam = [k for k, m in enumerate(mats) if not m]  # (positions in `own`)
        muon = [k for k, m in enumerate(mats) if m]
        tvars = [_tf_var(v) for v in keras_vars]
        # The AdamW part: keras's Adam update at learning_rate * adam_lr_ratio, after the decay
        # `w - w * adam_weight_decay * learning_rate` (the op's own where the two rates agree).
        learning_rate = tf.convert_to_tensor(learning_rate)
        ratio = self.adam_lr_ratio
        adam_lr = learning_rate if ratio == 1 else learning_rate * ratio
        wd = self.adam_weight_decay
        decaying = [wd is not None and wd != 0 and self._use_weight_decay(keras_vars[own[k]]) for k in adam]
        gated = None
        if ratio != 1 and any(decaying):
            decayed = [tvars[own[k]] for k, d in zip(adam, decaying) if d]
            gated = lambda: _decay(decayed, wd, learning_rate)  # noqa: E731
        groups = _step.optimizer_groups(self, [keras_vars[own[k]] for k in adam], [d and ratio == 1 for d in decaying],
                                        lambda v: _tf_var(v).handle, _opcall.scalar(adam_lr, "learning_rate"), wd)
        groups = [g._replace(positions=[adam[p] for p in g.positions]) for g in groups]
        mvars = [keras_vars[own[k]] for k in muon]

        def matrices(clipped, norm, nonfinite):
            # (dense: stock adds them, clipped, to the dense momentum)
            clipped = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in clipped]
            return self._tfclip_matrices(clipped, mvars, learning_rate, norm, nonfinite)

        mode, clip = self._clip_mode()
        # (IndexedSlices as they are: their norm is of their slices, as stock's)
        result = _step.run([grads[i] for i in own], groups, mode, clip, clip_obj=self.clip,
                           use_norm=None if share is None else share.use_norm,
                           pass_norms=None if share is None else share.pass_norms, nonfinite=self.nonfinite,
                           lazy=self.lazy_sparse, keras_sparse_squares=True, loss_scale_of=self,
                           outside=_step.Outside(muon, [tvars[own[k]] for k in muon], matrices), gated=gated)
        self._tfclip_record(result, keras_vars, share)
        return result.applied

    def _tfclip_matrices(self, grads, keras_vars, learning_rate, norm, nonfinite):
        """Muon's step of the matrices (stock `_apply_weight_decay` and `_muon_update_step`) on
        their clipped gradients: the momentum op, the Nesterov step and the Newton–Schulz
        iterations (TF ops, batched by shape on a GPU), the update op; both ops skip, raise or
        propagate by `norm` as the step's other op. Returns whether the step was applied."""
        moms = [_tf_var(self.momentums[self._get_variable_index(v)]) for v in keras_vars]
        grads = [tf.cast(g, m.dtype) for g, m in zip(grads, moms)]
        kind, _, hparams, flags = self._tfclip_momentum_binding.inputs(self, keras_vars)
        momentum = _step.run(grads, [_step.Group(kind, [m.handle for m in moms], {}, hparams, flags)], "none", 0.0,
                             use_norm=norm, nonfinite=nonfinite)
        ms = [read(m.handle, m.dtype) for m in moms]
        updates = [g + self.momentum * m for g, m in zip(grads, ms)] if self.nesterov else ms
        batch = self._tfclip_batch_products
        if batch is None:  # (batched on a GPU, per matrix on the CPU: tfclip/keras/_muon.py says why)
            batch = any("GPU" in _tf_var(v).device.upper() for v in keras_vars)
        ortho = orthogonalize(updates, lambda x: self.zeropower_via_newtonschulz5(x, self.ns_steps), batch)
        # One update op per (weight decay, largest dimension): keras's decay `w - w * wd * lr`,
        # then `w - lr_adjust(lr * o)`.
        wd = self.weight_decay
        keys = [(wd is not None and wd != 0 and self._use_weight_decay(v), max(v.shape)) for v in keras_vars]
        groups = _step.optimizer_groups(self, keras_vars, keys, lambda v: _tf_var(v).handle,
                                        _opcall.scalar(learning_rate, "learning_rate"), wd,
                                        binding=self._tfclip_update_binding)
        _step.run(ortho, groups, "none", 0.0, use_norm=norm, nonfinite=nonfinite)
        return momentum.applied


def _decay(tvars, wd, learning_rate):
    """Stock `_apply_weight_decay` on these variables: `w - w * wd * lr` (Muon's AdamW variables
    where adam_lr_ratio != 1, whose op runs at another rate than their decay's)."""
    for var in tvars:
        w = read(var.handle, var.dtype)
        assign(var.handle, w - w * tf.cast(wd, w.dtype) * tf.cast(learning_rate, w.dtype))


def _check_number_as(name, table, v):
    """A number checked against the table's range for `table` (its error naming `name`)."""
    if callable(v):
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a number or a callable, got {v!r}")
    try:
        _checks.check_number(table, float(v))
    except ValueError as e:
        raise ValueError(str(e).replace(table, name, 1)) from None


Muon.__module__ = "tfclip.keras"  # (where users find it; saved configs name it)
