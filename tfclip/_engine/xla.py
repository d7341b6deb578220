"""The drop-ins' questions about XLA: whether a step is being compiled by XLA (`jit_compile=True`),
whether this build has tfclip's XLA kernels (tfclip._loader.xla_kernels, the one answer: its
kernels registered and their custom-call handlers too), and the once-only warning of a step
that runs stock ops there."""
import warnings

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfclip import _loader


def in_context():
    """Whether the step being built is inside an XLA-compiled function."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def kernels():
    """Whether this build of tfclip has its XLA kernels (tests take them away through
    tfclip._loader._XLA)."""
    return _loader.xla_kernels()


_WARNED = set()


def warn_once(library, message, stacklevel=3):
    """`message` as a warning, once per front door `library`."""
    if library not in _WARNED:
        _WARNED.add(library)
        warnings.warn(message, stacklevel=stacklevel + 1)
