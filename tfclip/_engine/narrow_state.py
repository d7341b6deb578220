"""Narrow optimizer state (`state_dtype`): the names taken (`check_state_dtype`), a slot's dtype
for its variable (`state_slot_dtype`), and int8 state's pieces: a constant slot's codes and
absmax (`int8_start`, `int8_initial`), the absmax count (`int8_blocks`), and the record of an
optimizer's int8 slots (`Int8Slot`, `keep_int8_slot`: what tfclip.convert_checkpoint reads).
Every front door makes its slots with these (tfclip.rules, the Keras 3, tf_keras and TF1
optimizers); the core (csrc/core/quant8.h) defines the code."""
import collections

import tensorflow as tf
from tensorflow.python.distribute.collective_all_reduce_strategy import \
    CollectiveAllReduceExtended as _CollectiveExtended

from tfclip._engine import opcall as _opcall

STATE_DTYPES = (None, "bfloat16", "int8")
QUANT_BLOCK = 256  # int8 state: elements per absmax (csrc/core/quant8.h, kQuantBlock)


def check_state_dtype(state_dtype, owner):
    """`state_dtype` as a name (None: the stock layout), or a ValueError naming what is wrong.
    owner: the rule or optimizer class (its `low_precision_state` says whether it takes one, its
    `int8_state` whether int8 too)."""
    if state_dtype is not None:
        try:
            name = tf.as_dtype(state_dtype).name
        except TypeError:
            name = state_dtype
        if name == "float32":  # the stock layout, said explicitly
            return None
        if name not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be None (the stock layout), 'bfloat16' or 'int8', "
                             f"got {state_dtype!r}")
        if not getattr(owner, "low_precision_state", False):
            raise ValueError(f"{owner.__name__} keeps its state as the stock class does: state_dtype="
                             f"{state_dtype!r} is for the moment-keeping rules (tfclip.rules says which)")
        if name == "int8" and not getattr(owner, "int8_state", False):
            raise ValueError(f"{owner.__name__} does not take state_dtype='int8': "
                             f"{getattr(owner, 'int8_state_why', 'not available here yet')}; "
                             f"state_dtype='bfloat16' is")
        return name
    return None


def state_slot_dtype(state_dtype, var_dtype, sharded=False):
    """A slot's dtype for a variable of var_dtype: bfloat16 for a float32 variable under
    state_dtype 'bfloat16', uint8 (the codes; tfclip.rules keeps an absmax beside each) under
    'int8', else the variable's (the core stores no other pair). A narrow slot about to be made
    mirrored (not `sharded`: on one device by tfclip/_engine/shard.py) across worker processes is
    refused, naming why (`_refuse_mirrored_across_processes`)."""
    var_dtype = tf.as_dtype(var_dtype)
    narrow = None
    if state_dtype == "bfloat16" and var_dtype == tf.float32:
        narrow = tf.bfloat16
    if state_dtype == "int8" and var_dtype == tf.float32:
        narrow = tf.uint8
    if narrow is None:
        return var_dtype
    if not sharded:
        _refuse_mirrored_across_processes(state_dtype)
    return narrow


def _refuse_mirrored_across_processes(state_dtype):
    """MultiWorkerMirroredStrategy makes each mirrored variable with its initial value broadcast
    from the chief by CollectiveBcastSend, whose kernels take bool, half, float, double, int32
    and int64 only: a uint8 or bfloat16 slot fails there with TF's "Value for attr 'T' ... is not
    in the list of allowed values". Sharded slots sit on one device each, with no broadcast, so
    shard_state=True keeps narrow state across processes (tested in tests/test_distribute_shard.py)."""
    if not tf.distribute.has_strategy():
        return
    extended = tf.distribute.get_strategy().extended
    # (MultiWorkerMirroredStrategy's alone: ParameterServerStrategy also counts _num_workers, but
    # its variables live on the parameter servers and are never broadcast)
    workers = extended._num_workers if isinstance(extended, _CollectiveExtended) else 1
    if workers > 1:
        raise ValueError(
            f"state_dtype={state_dtype!r} under MultiWorkerMirroredStrategy ({workers} worker processes) needs "
            f"shard_state=True (tfclip.keras, tfclip.tf_keras, tfclip.rules): TensorFlow broadcasts each "
            f"mirrored variable's initial value between processes with a collective that has no "
            f"{'uint8' if state_dtype == 'int8' else 'bfloat16'} kernel, while a sharded slot lives on one device "
            f"and is never broadcast. Or keep state_dtype='float32'.")


def int8_start(value, is_signed):
    """int8 state's (code index, absmax) for a slot that starts at the number `value` everywhere:
    csrc/core/quant8.h's quantization of a constant block (absmax |value|; the code of 0, or of
    +-1 at either end of the code: exact for 0 and for value > 0)."""
    value = float(value)
    if value == 0.0:
        return (127 if is_signed else 0), 0.0  # QuantZeroIndex
    if value > 0:
        return 255, value  # 1.0, the top of both codes
    if is_signed:
        return 0, -value  # the signed code's lowest value, -0.99...
    raise ValueError(f"a slot kept >= 0 cannot start at {value}")


def initial_number(initial):
    """A slot's constant start, which int8 state starts from, as the stock slot makers give it:
    None or "zeros" (0), a number, a constant tensor of one value, or an initializer holding a
    number (`.value`: Keras's and TF's Constant)."""
    if initial is None or (isinstance(initial, str) and initial == "zeros"):
        return 0.0
    value = getattr(initial, "value", initial)  # (an initializer's constant)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tf.Tensor):
        a = tf.get_static_value(value)
        if a is not None and a.size and (a == a.flat[0]).all():
            return float(a.flat[0])
    raise ValueError(f"int8 optimizer state starts from a constant; got the initial value {initial!r}")


def int8_blocks(shape):
    """The absmax count of int8 state for a variable of `shape`: one per QUANT_BLOCK elements."""
    return -(-tf.TensorShape(shape).num_elements() // QUANT_BLOCK)


Int8Slot = collections.namedtuple("Int8Slot", ["codes", "absmax", "signed", "slot_of"])
Int8Slot.__doc__ = """One int8-state slot of an optimizer: its codes and absmax variables, whether its
code is the signed one, and `slot_of`: (the model variable, the slot name) where the optimizer
keeps it as a slot of that variable (OptimizerV2, TF1: checkpoints key it under the variable's
`.OPTIMIZER_SLOT`), else None (an optimizer variable of its own). tfclip.convert_checkpoint reads
them to (de)quantize a checkpoint."""


def keep_int8_slot(opt, codes, absmax, signed, slot_of=None):
    """Records an int8-state slot the optimizer `opt` made (`tfclip_int8_slots()`, `tfclip_absmax`),
    outside its tracked attributes: the variables are saved through the stock lists or slots."""
    if getattr(opt, "_tfclip_int8_slots", None) is None:
        object.__setattr__(opt, "_tfclip_int8_slots", [])
        object.__setattr__(opt, "_tfclip_absmax", {})
    if id(codes) not in opt._tfclip_absmax:  # (a slot asked for again: the one made)
        opt._tfclip_int8_slots.append(Int8Slot(codes, absmax, signed, slot_of))
        opt._tfclip_absmax[id(codes)] = absmax


def int8_initial(value, shape, is_signed):
    """int8 state's initial (codes, absmax) tensors for a slot starting at `value` (int8_start)."""
    index, absmax = int8_start(value, is_signed)
    return (tf.fill(shape, tf.constant(index, tf.uint8)),
            tf.fill([int8_blocks(shape)], tf.constant(absmax, tf.float32)))


def unsigned_slots(binding, opt):
    """The stock names (the binding's slot column) of the slots `opt`'s rule keeps >= 0, from the
    rule table (csrc/core/rule_table.h, a rule's unsigned slots): int8 state stores them with the
    unsigned code."""
    table = set(_opcall.RULES[binding.kind(opt)]["unsigned_slots"])
    return {stock for t, stock in binding.slot_names(opt) if t in table}


def made_signed(binding, opt, made, aliases=None):
    """Whether the slot the stock class of `opt` makes under the name `made` takes int8 state's
    signed code, from the rule table: the binding row whose table slot or stock name is `made`
    (tf_keras, OptimizerV2, TF1), or whose table slot `aliases` gives for that name (Keras 3's
    own: "velocity" for Adam's v); a name no row has is signed."""
    unsigned = set(_opcall.RULES[binding.kind(opt)]["unsigned_slots"])
    for t, stock in binding.slot_names(opt):
        if made in (t, stock) or (aliases or {}).get(made) == t:
            return t not in unsigned
    return True
