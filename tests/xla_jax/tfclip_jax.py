"""tfclip's XLA custom calls made from JAX: the handlers TF's XLA calls (csrc/xla/ffi/host_handlers.cc,
cuda_handlers.cc), built against JAX's typed-FFI headers into `_jax_ffi` (CMakeLists.txt), run
under JAX's XLA runtime: on its CPU backend (CI, against the TF op) and on a GPU (the lent hosts
have JAX but no TF; scripts/gpu_session.sh, benchmarks/gpu_bench.py).

The step is the one the TF XLA kernel (csrc/xla/tf/kernels.cc) builds, call for call: one
`tfclip_norm` call over every gradient, then one `tfclip_apply` call per group of at most 64
variables (custom_calls.h), each given the norm and updating its variables and slots in place
(results aliased to operands). Attributes and operand order are custom_calls.h's; the numbers
for rules, flags, modes and policies come from the core (`_core.ffi_codes()`), the
hyper-parameters' order from its rule table.

    tj = TfclipJax(core)                       # core: tfclip._core (or tests/core_loader.py's)
    step = tj.step_fn("adam", hparams, clip_mode="global_norm", clip=1.0)
    vars, slots, counter, applied, norm = step(vars, slots, grads, counter)   # jitted, donated
"""
import ctypes
import math
import os

import numpy as np

import jax

# The calls take f64 scalars (hyper-parameters, norm) and an s64 step counter.
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

GROUP_VARS = 64  # custom_calls.h: kGroupVars
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REGISTERED = {}


def find_module():
    """The built `_jax_ffi.so`: TFCLIP_JAX_FFI_MODULE, else the in-place build's (tfclip/)."""
    path = os.environ.get("TFCLIP_JAX_FFI_MODULE")
    if path:
        return path
    path = os.path.join(ROOT, "tfclip", "_jax_ffi.so")
    return path if os.path.exists(path) else None


def register(path):
    """Loads the module and registers its handlers with JAX (once per process): "cpu" always,
    "CUDA" where it was built with CUDA. Returns the platforms registered."""
    if path in _REGISTERED:
        return _REGISTERED[path]
    lib = ctypes.CDLL(path)
    platforms = []
    for plat, suffix in (("cpu", "host"), ("CUDA", "cuda")):
        try:
            fns = [getattr(lib, f"tfclip_{t}_{suffix}") for t in ("norm", "clip", "apply")]
        except AttributeError:
            continue
        for t, fn in zip(("norm", "clip", "apply"), fns):
            jax.ffi.register_ffi_target(f"tfclip_{t}", jax.ffi.pycapsule(fn), platform=plat)
        platforms.append(plat)
    _REGISTERED[path] = (lib, platforms)
    return _REGISTERED[path]


def _i64s(xs):
    return np.asarray(list(xs), dtype=np.int64)


class TfclipJax:
    def __init__(self, core, path=None):
        path = path or find_module()
        if path is None:
            raise FileNotFoundError("no _jax_ffi.so: build it (CMake, with jaxlib in the build's Python) "
                                    "or point TFCLIP_JAX_FFI_MODULE at it")
        self.lib, self.platforms = register(path)
        self.codes = core.ffi_codes()
        self.table = core.rule_table()
        self.hparam_table = core.hparam_table()

    # ------------------------------------------------------------ the calls, as xla_kernels.cc makes them
    def norm(self, grads):
        """tfclip_norm over `grads`: (norm f64[], tensor norms f32[n])."""
        n = len(grads)
        out = jax.ffi.ffi_call(
            "tfclip_norm",
            (jax.ShapeDtypeStruct((), jnp.float64), jax.ShapeDtypeStruct((), jnp.float32),
             jax.ShapeDtypeStruct((n,), jnp.float32)),
        )(*grads, sparse=_i64s(()), rows=_i64s(()), widths=_i64s(()), f64_norm=np.int64(1))
        return out[0], out[2]

    def clip(self, grads, clip_norm):
        """tfclip_clip (tfclip.fused_clip_by_global_norm): (clipped list, norm f32[])."""
        n = len(grads)
        outs = [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in grads]
        outs += [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)]
        r = jax.ffi.ffi_call("tfclip_clip", outs)(
            *grads, jnp.asarray(clip_norm, jnp.float32), jnp.asarray(math.nan, jnp.float32),
            use_given_norm=np.int64(0))
        return list(r[:n]), r[n]

    def scalars(self, rule, hparams, clip, norm64):
        """The apply calls' f64 vector: the rule's hyper-parameters in the table's order (an
        optional one left out: NaN), clip, then the norm."""
        names = self.table[rule]["hparams"]
        unknown = set(hparams) - set(names)
        if unknown:
            raise TypeError(f"rule '{rule}' takes {names}, not {sorted(unknown)}")
        hp = [float(hparams.get(k, math.nan)) for k in names]
        return jnp.concatenate([jnp.asarray(hp + [float(clip)], jnp.float64),
                                jnp.reshape(norm64, (1,)).astype(jnp.float64)])

    def apply(self, rule, variables, slots, grads, hparams, *, flags=None, clip_mode="global_norm",
              clip=0.0, nonfinite="skip", counter=None, agc_eps=1e-3):
        """One step: the norm call, then the apply calls. Returns (variables, slots, counter,
        applied, norm f32, tensor norms f32[n])."""
        n = len(variables)
        nslots = len(slots)
        norm64, tnorms = self.norm(grads)
        scal = self.scalars(rule, hparams, clip, norm64)
        flag_bits = 0
        for f, on in (flags or {}).items():
            if f not in self.table[rule]["flags"]:
                raise TypeError(f"rule '{rule}' takes the flags {self.table[rule]['flags']}, not {f}")
            flag_bits |= self.codes["flags"][f] if on else 0
        attrs = dict(
            rule=np.int64(self.codes["rules"][rule]), flags=np.int64(flag_bits),
            mode=np.int64(self.codes["modes"][clip_mode]),
            agc_eps_bits=np.asarray(agc_eps, np.float64).view(np.int64)[()],
            policy=np.int64(self.codes["policies"][nonfinite]), has_use_norm=np.int64(1),
            lazy=np.int64(0), sum_of_squares=np.int64(0), nslots=np.int64(nslots),
            has_iterations=np.int64(counter is not None), sparse=_i64s(()))
        new_vars, new_slots = list(variables), [list(s) for s in slots]
        applied = norm = new_counter = None
        lists = [variables] + list(slots)
        for g0 in range(0, n, GROUP_VARS):
            gn = min(GROUP_VARS, n - g0)
            ops = [x for lst in lists for x in lst[g0:g0 + gn]]
            outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ops]
            aliases = {k: k for k in range(len(ops))}  # in place
            ops += list(grads[g0:g0 + gn]) + [scal]
            r0 = len(outs)
            outs += [jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.float32),
                     jax.ShapeDtypeStruct((gn,), jnp.float32), jax.ShapeDtypeStruct((gn,), jnp.int64)]
            if counter is not None:
                if g0 == 0:  # group 0's advanced counter is the counter's new value
                    aliases[len(ops)] = len(outs)
                ops.append(counter)
                outs.append(jax.ShapeDtypeStruct((), jnp.int64))
            r = jax.ffi.ffi_call("tfclip_apply", outs, input_output_aliases=aliases,
                                 has_side_effect=True)(*ops, **attrs)
            for li in range(len(lists)):
                got = r[li * gn:(li + 1) * gn]
                if li == 0:
                    new_vars[g0:g0 + gn] = got
                else:
                    new_slots[li - 1][g0:g0 + gn] = got
            if g0 == 0:
                applied, norm = r[r0], r[r0 + 1]
                if counter is not None:
                    new_counter = r[r0 + 4]
        return new_vars, new_slots, new_counter, applied, norm, tnorms

    def step_fn(self, rule, hparams, donate=True, **kw):
        """A jitted step (variables, slots, grads, counter) -> (variables, slots, counter,
        applied, norm), the variables, slots and counter donated (updated in place)."""

        def step(variables, slots, grads, counter):
            v, s, c, applied, norm, _ = self.apply(rule, variables, slots, grads, hparams, counter=counter, **kw)
            return v, s, c, applied, norm

        return jax.jit(step, donate_argnums=(0, 1, 3) if donate else ())
