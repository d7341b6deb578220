"""The JAX side of benchmarks/gpu_bench.py (no PyTorch here): one clip(global 1.0) + optimizer
step under `jax.jit`, the variables and state donated, by
  - "xla": tfclip's XLA custom-call handlers, the calls TF's XLA kernel makes (one norm call, an
    apply call per 64 variables; tests/xla_jax/tfclip_jax.py), built into _jax_ffi;
  - "optax": optax.clip_by_global_norm + optax.adam / adamw / sgd(momentum), which XLA fuses.
Times are wall-clock per step as a user runs it (dispatch included): the median of `repeats`
loops of `iters` steps, each loop ended by waiting for its last result.

    python benchmarks/jax_contenders.py --platform cpu --sets tiny   # the code path, on a CPU
"""
import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # beside PyTorch on one GPU
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "tests", "xla_jax"), os.path.join(_ROOT, "tests")]

from tfclip_jax import TfclipJax  # noqa: E402 (turns on jax_enable_x64)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from timing import wall_time  # noqa: E402

# gpu_bench.py's rules: (tfclip rule, its hyper-parameters, slots), and optax's equivalent.
TFCLIP_RULES = {
    "adam": ("adam", dict(lr=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.0, step=1.0), 2),
    "adamw": ("adam", dict(lr=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.01, step=1.0), 2),
    "sgdm": ("keras_momentum", dict(lr=1e-2, momentum=0.9, weight_decay=0.0), 1),
}
JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _optax_tx(rule):
    import optax

    opt = {"adam": lambda: optax.adam(1e-3, eps=1e-7),
           "adamw": lambda: optax.adamw(1e-3, eps=1e-7, weight_decay=0.01),
           "sgdm": lambda: optax.sgd(1e-2, momentum=0.9)}[rule]()
    return optax.chain(optax.clip_by_global_norm(1.0), opt)


def _data(shapes, grad_dtype, device, seed=0):
    key = jax.random.PRNGKey(seed)
    with jax.default_device(device):
        params, grads = [], []
        for i, s in enumerate(shapes):
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            params.append(jax.random.normal(k1, s, jnp.float32) * 0.02)
            grads.append(jax.random.normal(k2, s, jnp.float32).astype(JNP[grad_dtype]))
    return params, grads


def contenders(core, shapes, rule, grad_dtype, device, which=("xla", "optax")):
    """{name: (step, wait, compile_seconds)}: step() runs one step in place, wait() blocks on
    its last result."""
    out = {}
    if "xla" in which:
        tj = TfclipJax(core)
        core_rule, hp, nslots = TFCLIP_RULES[rule]
        params, grads = _data(shapes, grad_dtype, device)
        with jax.default_device(device):
            slots = [[jnp.zeros_like(p) for p in params] for _ in range(nslots)]
            counter = jnp.zeros((), jnp.int64)
        fn = tj.step_fn(core_rule, hp, clip_mode="global_norm", clip=1.0)
        t0 = time.perf_counter()
        fn = fn.lower(params, slots, grads, counter).compile()
        t_compile = time.perf_counter() - t0
        st = {"v": params, "s": slots, "c": counter, "g": grads}

        def xla_step():
            st["v"], st["s"], st["c"], st["applied"], _ = fn(st["v"], st["s"], st["g"], st["c"])

        out["xla"] = (xla_step, lambda: jax.block_until_ready(st["v"]), t_compile)
    if "optax" in which:
        import optax

        tx = _optax_tx(rule)
        params, grads = _data(shapes, grad_dtype, device)
        with jax.default_device(device):
            state = tx.init(params)

        def ostep(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        t0 = time.perf_counter()
        ofn = jax.jit(ostep, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        t_compile = time.perf_counter() - t0
        ost = {"p": params, "s": state, "g": grads}

        def optax_step():
            ost["p"], ost["s"] = ofn(ost["p"], ost["s"], ost["g"])

        out["optax"] = (optax_step, lambda: jax.block_until_ready(ost["p"]), t_compile)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--sets", default="tiny")
    ap.add_argument("--rules", default="adam,sgdm")
    ap.add_argument("--grad-dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    from core_loader import load_core

    core = load_core()
    sets = {"tiny": [(64, 33), (129,), (7, 5, 3)] * 30}
    device = jax.devices(args.platform)[0]
    print(f"# {device}, jax {jax.__version__}")
    for rule in args.rules.split(","):
        for gd in args.grad_dtypes.split(","):
            for s in args.sets.split(","):
                c = contenders(core, sets[s], rule, gd, device)
                times = {k: wall_time(st, w, args.iters) for k, (st, w, _) in c.items()}
                print(f"{s} {rule} {gd}: " + ", ".join(
                    f"{k} {t * 1e3:.3f} ms/step (compile {c[k][2]:.1f} s)" for k, t in times.items()))


if __name__ == "__main__":
    main()
