"""Independent NumPy float64 references for the clip modes and update rules (never our kernels)."""
import numpy as np


def global_norm(grads):
    return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads)))


def clip(grads, mode, c, use_norm=None):
    """The gradients tfclip applies, in float64: global / per-tensor norm / value / none."""
    g64 = [np.asarray(g, np.float64) for g in grads]
    if mode == "global_norm":
        n = global_norm(g64) if use_norm is None else use_norm
        scale = c * min(1.0 / n, 1.0 / c) if n else 1.0
        return [g * scale for g in g64]
    if mode == "norm":
        return [g * c / max(np.sqrt(np.sum(g * g)), c) for g in g64]
    if mode == "value":
        return [np.clip(g, -c, c) for g in g64]
    return g64


def step(rule, var, slots, g, hp, t, gsq=None):
    """One update in float64. slots: list of arrays (updated in place); returns the new var.
    gsq: what Adam's v takes as g^2 (default g*g; a sparse row: the sum of its slices' squares)."""
    lr, wd = hp.get("learning_rate", 0.01), hp.get("weight_decay", 0.0)
    var = var - var * wd * lr
    if rule == "sgd":
        return var - lr * g
    if rule == "momentum":  # TF1 ResourceApplyMomentum
        mom = hp["momentum"]
        slots[0][...] = slots[0] * mom + g
        if hp.get("nesterov"):
            return var - (g * lr + slots[0] * mom * lr)
        return var - slots[0] * lr
    if rule == "keras_momentum":
        mom = hp["momentum"]
        slots[0][...] = -g * lr + slots[0] * mom
        if hp.get("nesterov"):
            return var + (-g * lr + slots[0] * mom)
        return var + slots[0]
    if rule == "adam":
        b1, b2, eps = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999), hp.get("epsilon", 1e-7)
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        slots[0][...] = slots[0] + (g - slots[0]) * (1 - b1)
        slots[1][...] = slots[1] + ((g * g if gsq is None else gsq) - slots[1]) * (1 - b2)
        v = slots[1]
        if hp.get("amsgrad"):
            slots[2][...] = np.maximum(slots[2], slots[1])
            v = slots[2]
        return var - slots[0] * alpha / (np.sqrt(v) + eps)
    raise ValueError(rule)


def num_slots(rule, hp):
    return {"sgd": 0, "momentum": 1, "keras_momentum": 1}.get(rule, 3 if hp.get("amsgrad") else 2)
