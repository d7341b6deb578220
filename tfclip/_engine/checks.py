"""The checks every front door makes of its arguments, against the core's tables: a
hyper-parameter's range (`check_number`), stochastic rounding's arguments (`check_rounding`);
and where state is made (`state_scope`, `check_clip_state`)."""
import contextlib
import math
import numbers

import tensorflow as tf

from tfclip._engine import opcall as _opcall

def check_rounding(stochastic_rounding, rounding_seed):
    """The front doors' `stochastic_rounding` and `rounding_seed`, checked: (bool, int), or a
    TypeError / ValueError naming what is wrong."""
    if not isinstance(stochastic_rounding, bool):
        raise TypeError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, numbers.Integral):
        raise TypeError(f"rounding_seed must be an int, got {rounding_seed!r}")
    if not 0 <= rounding_seed < 2 ** 32:
        raise ValueError(f"rounding_seed must be in [0, 2**32), got {rounding_seed}")
    return stochastic_rounding, int(rounding_seed)


def check_number(name, v):
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


@contextlib.contextmanager
def state_scope():
    """Where a rule's or optimizer's state is made: outside any tf.function (init_scope), and in
    the scope of the strategy in use, if any, so that state used under tf.distribute is mirrored
    like the variables it serves."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    with tf.init_scope():
        if strategy is None or tf.distribute.has_strategy():
            yield
        else:
            with strategy.scope():
                yield


def check_clip_state(clip, owner):
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
