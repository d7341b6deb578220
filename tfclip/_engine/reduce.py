"""`reduce_dtype` (FSDP's name): gradients summed across replicas in 16 bits (issue 68).

Under a strategy of several replicas the dense gradient of each float32 variable is cast to
bfloat16 (or float16) where it is made, TF's all-reduce sums it in that dtype (half the bytes
on the link), and the fused op reads the 16-bit sum as it arrives: the norm, the clip and the
update use the reduced 16-bit gradient; the variables stay float32 (docs/distribute.md,
"Gradients summed in 16 bits").

- A variable already of `reduce_dtype` keeps its gradient as it is; any other dtype (float16
  with bfloat16, bfloat16 with float16, float64) is refused, naming the variable: its gradient
  would either lose range or bits it has, or join the float32 ones in one all-reduce of two
  dtypes, which TF's collective packing cannot do.
- IndexedSlices stay in their dtype: TF all-gathers them (their rows are not summed on the
  link), and its gather has no bfloat16 kernel.
- One replica (no strategy, or a strategy of one): nothing crosses a link, nothing is cast; the
  same bits as `reduce_dtype=None`.
"""
import tensorflow as tf

_DTYPES = {"bfloat16": tf.bfloat16, "float16": tf.float16}


def check(reduce_dtype):
    """`reduce_dtype` as given to an optimizer: None or "float32" (no cast: None), "bfloat16" or
    "float16" (a name or a tf.DType). Anything else: a ValueError naming it."""
    if reduce_dtype is None:
        return None
    name = reduce_dtype.name if isinstance(reduce_dtype, tf.DType) else reduce_dtype
    if not isinstance(name, str) or name not in ("float32", *_DTYPES):
        raise ValueError(f"reduce_dtype must be None, 'bfloat16' or 'float16' (or 'float32': no cast), "
                         f"got {reduce_dtype!r}")
    return None if name == "float32" else name


def replicas():
    """The replicas of the replica context this runs in (1 outside one, or without a strategy)."""
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else ctx.num_replicas_in_sync


def cast(grads, variables, reduce_dtype, owner):
    """The gradients to all-reduce: with `reduce_dtype` and several replicas, each dense gradient
    of a float32 variable cast to it; else `grads` as they are. `owner` names the optimizer in
    the error for a variable of another dtype."""
    grads = list(grads)
    if reduce_dtype is None or replicas() <= 1:
        return grads
    dtype = _DTYPES[reduce_dtype]
    out = []
    for g, v in zip(grads, variables):
        vdtype = tf.as_dtype(v.dtype).base_dtype
        if g is not None and vdtype not in (tf.float32, dtype):
            name = getattr(v, "path", None) or getattr(v, "name", "?")
            raise ValueError(f"{owner}(reduce_dtype={reduce_dtype!r}) sums float32 variables' gradients in "
                             f"{reduce_dtype} (and {reduce_dtype} variables' as they are); variable {name!r} is "
                             f"{vdtype.name}. Use reduce_dtype=None for a model with {vdtype.name} variables.")
        if g is None or isinstance(g, tf.IndexedSlices) or vdtype == dtype:
            out.append(g)
        else:
            out.append(tf.cast(g, dtype))
    return out
