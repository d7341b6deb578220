"""The GPU benchmarks' parameter sets (gpu_bench.py, gpu_state_bench.py): lists of shapes. No
framework import, so a torch-free script (and its CPU proof on the emulated CUDA build) uses them."""


def bert_like(h, ff, layers, vocab=30522):
    shapes = [(vocab, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (h, ff), (ff,), (ff, h), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]
    return shapes


SETS = {
    "bert_base": lambda: bert_like(768, 3072, 12),        # ~110M params, ~200 tensors
    "bert_large": lambda: bert_like(1024, 4096, 24),      # ~335M params, ~390 tensors
    "small2000": lambda: [(64, 64 if i % 2 else 62) for i in range(2000)],  # ~8.1M params
    "one_tensor": lambda: [(sum(64 * (64 if i % 2 else 62) for i in range(2000)),)],  # same count, 1 tensor
    # A few thousand elements with short last quantization blocks: the emulated build's CPU proof
    # of the scripts (tests/gpu/test_gpu_state_bench.py), not a speed figure.
    "tiny": lambda: [(33, 70), (70,), (1000,), (5,)],
}
