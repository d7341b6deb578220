"""The one wall-clock measure of the GPU benchmarks (gpu_bench.py, jax_contenders.py), for every
contender alike, PyTorch's, tfclip's and JAX's: seconds per step by the host's clock as a user's
loop sees it (issue and wait included). No framework import: each caller passes its own wait."""
import statistics
import time


def wall_time(step, wait, iters, repeats=5):
    """The median over `repeats` loops of `iters` calls of step(), each loop ended by wait(),
    after two warm-up steps."""
    step()
    step()
    wait()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        wait()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)
