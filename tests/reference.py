"""Independent NumPy float64 references for the clip modes and update rules (never our kernels)."""
import numpy as np


def slot_shape(row, slot, shape):
    """The shape of slot `slot` of a rule-table row (`_core.rule_table()[rule]`) for a variable of
    `shape`: the variable's, but for a factored rule (Adafactor) keras's: r is shape[:-1], c
    shape[:-2] + shape[-1:] (both scalars below rank 2)."""
    shape = tuple(shape)
    if not row.get("factored") or slot == "v":
        return shape
    if len(shape) < 2:
        return ()
    return shape[:-1] if slot == "r" else shape[:-2] + shape[-1:]


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


def step(rule, var, slots, g, hp, t, gsq=None, slot_dtype=None):
    """One update in float64. slots: list of arrays (updated in place); returns the new var.
    gsq: what Adam's v takes as g^2 (default g*g; a sparse row: the sum of its slices' squares).
    slot_dtype: Lamb computes its update from the slots as stored (as keras, from its slot
    variables): with a 16-bit dtype the slots are rounded to it first."""
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
    if rule == "nadam":  # u_product: the running product through step t (given)
        b1, b2, eps = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999), hp.get("epsilon", 1e-7)
        # schedule_decay: 0.96^(schedule_decay * t). legacy_nadam (tf_keras legacy Nadam): its
        # base is tf.cast(0.96, dtype), float32's 0.96 (the Python float becomes a float32
        # tensor before the cast), and its moments are written b*m + (1-b)*g (the same math).
        sd = hp.get("schedule_decay", 1.0)
        base = float(np.float32(0.96)) if hp.get("legacy_nadam") else 0.96
        u_t, u_next = (b1 * (1 - 0.5 * base ** (sd * k)) for k in (t, t + 1))
        up = hp["u_product"]
        slots[0][...] = slots[0] + (g - slots[0]) * (1 - b1)
        slots[1][...] = slots[1] + ((g * g if gsq is None else gsq) - slots[1]) * (1 - b2)
        m_hat = u_next * slots[0] / (1 - up * u_next) + (1 - u_t) * g / (1 - up)
        return var - m_hat * lr / (np.sqrt(slots[1] / (1 - b2 ** t)) + eps)
    if rule in ("ftrl", "ftrl_sqrt"):  # slots: accumulator, linear
        p = 0.5 if rule == "ftrl_sqrt" else -hp.get("lr_power", -0.5)
        l1, l2 = hp.get("l1", 0.0), hp.get("l2", 0.0)
        shrink, beta = hp.get("l2_shrinkage", 0.0), hp.get("beta", 0.0)
        n_new = slots[0] + (g * g if gsq is None else gsq)
        slots[1][...] = slots[1] + (g + 2 * shrink * var) - (n_new ** p - slots[0] ** p) / lr * var
        slots[0][...] = n_new
        quadratic = n_new ** p / lr + 2 * (l2 + beta / (2 * lr))
        return (np.clip(slots[1], -l1, l1) - slots[1]) / quadratic
    if rule == "lamb":  # var, g: a whole tensor (the trust ratio is per tensor)
        b1, b2, eps = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999), hp.get("epsilon", 1e-7)
        slots[0][...] = slots[0] + (g - slots[0]) * (1 - b1)
        slots[1][...] = slots[1] + ((g * g if gsq is None else gsq) - slots[1]) * (1 - b2)
        if slot_dtype is not None:
            for sl in slots:
                sl[...] = sl.astype(slot_dtype).astype(np.float64)
        u = (slots[0] / (1 - b1 ** t)) / (np.sqrt(slots[1] / (1 - b2 ** t)) + eps)
        w_norm, u_norm = np.sqrt(np.sum(var * var)), np.sqrt(np.sum(u * u))
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        return var - ratio * lr * u
    if rule == "schedule_free_adamw":  # slots: momentum (z), velocity
        return schedule_free_adamw(var, slots, g, hp, t, gsq)
    if rule == "muon_momentum":  # var: Muon's momentum m <- momentum m + g
        return hp.get("momentum", 0.0) * var + g
    if rule == "muon_update":  # g: the orthogonalized update, scaled by Moonlight's sqrt(max dim) rms_rate
        return var - lr * g * hp.get("shape_scale", 1.0) * hp.get("rms_rate", 0.2)
    gg = g * g if gsq is None else gsq
    eps = hp.get("epsilon", 1e-7)
    # epsilon_outside_sqrt (ResourceApplyAdagradV2, tf_keras legacy RMSprop): sqrt(x) + eps.
    out = hp.get("epsilon_outside_sqrt", False)
    if rule == "adagrad":
        slots[0][...] = slots[0] + gg
        return var - lr * g / ((np.sqrt(slots[0]) + eps) if out else np.sqrt(slots[0] + eps))
    if rule == "rmsprop":  # slots: velocity, [momentum], [average_gradient]
        rho, mom = hp.get("rho", 0.9), hp.get("momentum", 0.0)
        slots[0][...] = rho * slots[0] + (1 - rho) * gg
        den = slots[0]
        if hp.get("centered"):
            avg = slots[2 if hp.get("has_momentum") else 1]
            avg[...] = rho * avg + (1 - rho) * g
            den = slots[0] - avg * avg
        inc = lr * g / ((np.sqrt(den) + eps) if out else np.sqrt(den + eps))
        if hp.get("has_momentum"):
            slots[1][...] = mom * slots[1] + inc
            return var - slots[1]
        return var - inc
    if rule == "tf_rmsprop":  # TF1 RMSProp's kernel; slots: rms, mom, [mg]
        rho, mom = hp.get("rho", 0.9), hp.get("momentum", 0.0)
        slots[0][...] = slots[0] + (gg - slots[0]) * (1 - rho)
        den = slots[0] + eps
        if hp.get("centered"):
            slots[2][...] = slots[2] + (g - slots[2]) * (1 - rho)
            den = slots[0] - slots[2] * slots[2] + eps
        slots[1][...] = slots[1] * mom + g * lr / np.sqrt(den)
        return var - slots[1]
    if rule == "adadelta":
        rho = hp.get("rho", 0.9)
        slots[0][...] = rho * slots[0] + (1 - rho) * gg
        r = np.sqrt(slots[1] + eps) / np.sqrt(slots[0] + eps)
        d = -r * g
        slots[1][...] = rho * slots[1] + (1 - rho) * (r * r * gg)  # sum of the duplicates' d_j^2
        return var + lr * d
    if rule == "adamax":
        b1, b2 = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999)
        slots[0][...] = slots[0] + (g - slots[0]) * (1 - b1)
        slots[1][...] = np.maximum(b2 * slots[1], np.abs(g) if gsq is None else gsq)  # gsq: sum |g_j|
        return var - lr * slots[0] / ((1 - b1 ** t) * (slots[1] + eps))
    if rule == "lion":
        b1, b2 = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999)
        out = var - lr * np.sign(slots[0] * b1 + g * (1 - b1))
        slots[0][...] = slots[0] * b2 + g * (1 - b2)
        return out
    l1, l2 = hp.get("l1", 0.0), hp.get("l2", 0.0)
    if rule == "proximal_gradient_descent":  # FOBOS (Duchi & Singer 2009) with a fixed step
        p = var - lr * g
        return np.sign(p) * np.maximum(np.abs(p) - lr * l1, 0.0) / (1 + lr * l2)
    if rule == "proximal_adagrad":  # FOBOS with Adagrad's per-element step lr / sqrt(accum)
        slots[0][...] = slots[0] + gg
        a = lr / np.sqrt(slots[0])
        p = var - a * g
        return np.sign(p) * np.maximum(np.abs(p) - a * l1, 0.0) / (1 + a * l2)
    if rule == "adagrad_da":  # dual averaging: var from the sums of g and g^2 at global step t
        t = hp["global_step"]
        slots[0][...] = slots[0] + g
        slots[1][...] = slots[1] + gg
        return -np.sign(slots[0]) * lr * np.maximum(np.abs(slots[0]) - t * l1, 0.0) / (
            t * lr * l2 + np.sqrt(slots[1]))
    raise ValueError(rule)


def schedule_free_adamw(var, slots, g, hp, t, gsq=None, paper=False):
    """ScheduleFreeAdamW (Defazio et al. 2024) as keras.optimizers.ScheduleFreeAdamW writes it: y
    (the variable), z (slot 0, `momentum`), Adam's v (slot 1). The averaged x is recovered from
    y and z; Keras on TensorFlow reads z there after its update (its `momentum.value` is the
    variable), the paper (`paper=True`) before."""
    lr = hp.get("learning_rate", 0.01)
    b1, b2, eps = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999), hp.get("epsilon", 1e-7)
    warmup = hp.get("warmup_steps", 0)
    if warmup > 0:
        lr = lr * min(t / warmup, 1.0)
    z_old = slots[0].copy()
    slots[1][...] = slots[1] + ((g * g if gsq is None else gsq) - slots[1]) * (1 - b2)
    slots[0][...] = slots[0] - lr * g / (np.sqrt(slots[1] / (1 - b2 ** t)) + eps)
    x = (var - (1 - b1) * (z_old if paper else slots[0])) / b1
    x = (1 - 1 / t) * x + (1 / t) * slots[0]
    return (1 - b1) * slots[0] + b1 * x


def adafactor(var, r, c, v, g, hp, t):
    """One Adafactor step in float64 from its definitions (Shazeer & Stern 2018, Algorithms 4 and
    5, with keras 3's choices: rho_t = min(lr, 1/sqrt(t)), beta2_t = 1 - t^beta_2_decay,
    alpha_t = max(epsilon_2, rms(w)) rho_t, the update clipped to rms(u) <= clip_threshold,
    factored over the last two axes for rank >= 2, v = (r / mean(r)) c). Decoupled weight decay
    first (keras). Returns (var, r, c, v); r and c unchanged for rank < 2."""
    lr = hp.get("lr", 0.01)
    var = np.asarray(var, np.float64)
    g = np.asarray(g, np.float64)
    var = var - var * hp.get("weight_decay", 0.0) * lr
    rho = min(lr, 1.0 / np.sqrt(t))
    alpha = max(hp.get("epsilon_2", 1e-3), np.sqrt(np.mean(var ** 2))) * rho
    b = 1.0 - t ** hp.get("beta_2_decay", -0.8)
    q = g * g + hp.get("epsilon_1", 1e-30)
    if var.ndim >= 2:
        r = b * np.asarray(r, np.float64) + (1 - b) * q.mean(axis=-1)
        c = b * np.asarray(c, np.float64) + (1 - b) * q.mean(axis=-2)
        v = (r / r.mean(axis=-1, keepdims=True))[..., None] * c[..., None, :]
    else:
        v = b * np.asarray(v, np.float64) + (1 - b) * q
    u = g / np.sqrt(v)
    u = u / max(1.0, np.sqrt(np.mean(u ** 2)) / hp.get("clip_threshold", 1.0))
    return var - alpha * u, r, c, v


def num_slots(rule, hp):
    if rule == "rmsprop":
        return 1 + bool(hp.get("has_momentum")) + bool(hp.get("centered"))
    if rule == "tf_rmsprop":
        return 3 if hp.get("centered") else 2
    fixed = {"sgd": 0, "momentum": 1, "keras_momentum": 1, "adagrad": 1, "adadelta": 2, "adamax": 2,
             "lion": 1, "nadam": 2, "ftrl": 2, "ftrl_sqrt": 2, "lamb": 2, "proximal_gradient_descent": 0,
             "proximal_adagrad": 1, "adagrad_da": 2, "schedule_free_adamw": 2,
             "muon_momentum": 0, "muon_update": 0}
    return fixed.get(rule, 3 if hp.get("amsgrad") else 2)


def zclip_targets(norms, alpha=0.97, z_thresh=2.5, warmup_steps=25, clip_to="adaptive", max_norm=None,
                  eps=1e-6, skip_update_on_spike=False):
    """ZClip (Kumar et al. 2025) in float64, from the paper's definitions: per step the norm the
    gradients are clipped to (None: not clipped; a non-finite norm is left out of the
    statistics), and the (mu, s2) after the step."""
    buf, mu, s2, out = [], None, None, []
    for g in norms:
        if not np.isfinite(g):
            out.append((None, mu, s2))
            continue
        if mu is None:  # warm-up: gather, clip by the cap only
            buf.append(g)
            target = max_norm if max_norm is not None and g > max_norm else None
            if len(buf) == warmup_steps:
                mu = float(np.mean(buf))
                s2 = float(np.var(buf))  # the population variance
            out.append((target, mu, s2))
            continue
        z = (g - mu) / (np.sqrt(s2) + eps)
        spike = z > z_thresh
        x = (mu + z_thresh ** 2 * np.sqrt(s2) / z if clip_to == "adaptive" else mu) if spike else g
        target = x if spike else None
        if max_norm is not None and min(x, max_norm) < g:
            target = min(x, max_norm)
        if not (skip_update_on_spike and spike):
            mu = alpha * mu + (1 - alpha) * x
            s2 = alpha * s2 + (1 - alpha) * (x - mu) ** 2
        out.append((target, mu, s2))
    return out


def autoclip_targets(norms, percentile=10.0, history_size=1000):
    """AutoClip (Seetharaman et al. 2020) in float64: per step the norm the gradients are
    clipped to (None: not clipped), the threshold being the percentile of the last
    history_size finite norms, this step's included."""
    hist, out = [], []
    for g in norms:
        if not np.isfinite(g):
            out.append(None)
            continue
        hist = (hist + [g])[-history_size:]
        thr = float(np.percentile(hist, percentile))
        out.append(thr if thr < g else None)
    return out


# ---------------------------------------------------------------- 8-bit blockwise quantization
def dynamic_code(signed):
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), written
    out: per exponent i, the midpoints of linspace(0.1, 1, k + 1) (k = 2^i signed, 2^(i+1)
    unsigned) times 10^(i - 6), negated too when signed; then 0 and 1; float32, ascending."""
    data = []
    for i in range(7):
        k = 2 ** i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, k + 1)  # float64
        means = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (i - 6)
        data += list(means) + (list(-means) if signed else [])
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.sort(np.asarray(data, dtype=np.float64).astype(np.float32))


def quantize_blockwise(x, signed, block=256):
    code = dynamic_code(signed)
    zero = int(np.flatnonzero(code == 0)[0])
    x = np.asarray(x, np.float32).ravel()
    q = np.empty(x.size, np.uint8)
    absmax = []
    for b in range(0, x.size, block):
        xb = x[b:b + block]
        m = np.float32(np.max(np.abs(xb))) if np.all(np.isfinite(xb)) else np.float32(np.nan)
        absmax.append(m)
        if not m > 0:
            q[b:b + block] = zero
            continue
        y = (xb / m).astype(np.float32)  # float32 division
        dist = np.abs(code[None, :].astype(np.float64) - y[:, None].astype(np.float64))
        q[b:b + block] = np.argmin(dist, axis=1)  # the first minimum: ties to the lower index
    return q, np.asarray(absmax, np.float32)


def dequantize_blockwise(q, absmax, signed, block=256):
    """code[q] * the block's absmax, in float32."""
    q = np.asarray(q).ravel()
    return (dynamic_code(signed)[q] * np.repeat(np.asarray(absmax, np.float32), block)[:q.size]).astype(np.float32)


# ---------------------------------------------------------------- stochastic rounding
# Philox4x32-10 (Salmon et al., SC 2011) and bfloat16 stochastic rounding from their definitions,
# in NumPy, independent of csrc/core/rounding.h (tests/test_stochastic_rounding.py).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """The four output words (uint32 arrays) of counters `counter` (four uint32 arrays or ints)
    under key (k0, k1)."""
    c = [np.asarray(x, np.uint64) & np.uint64(_U32) for x in counter]
    k0, k1 = int(key[0]) & _U32, int(key[1]) & _U32
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
        p0 = c[0] * np.uint64(_PHILOX_M[0])
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(_U32),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(_U32)]
    return [x.astype(np.uint32) for x in c]


def stochastic_round_bf16(x, seed, step, tensor):
    """float32 array x rounded to bfloat16 bits (uint16) as tfclip rounds a variable's update:
    elements 8q .. 8q + 7 share Philox's draw of counter (q mod 2^32, q >> 32, tensor, step mod
    2^32) under key (seed mod 2^32, seed >> 32), element i taking its 16-bit half i mod 8 (word
    (i mod 8) // 2, the low half for an even i); the bits are added to x's low 16 bits and the
    high half kept; NaN rounds to nearest (quiet)."""
    x = np.ascontiguousarray(x, np.float32).ravel()
    i = np.arange(x.size, dtype=np.uint64)
    q = i >> np.uint64(3)
    words = np.stack(philox4x32_10([q & np.uint64(_U32), q >> np.uint64(32), np.full_like(q, tensor),
                                    np.full_like(q, step & _U32)], (seed & _U32, seed >> 32))).astype(np.uint64)
    h = (i & np.uint64(7)).astype(np.int64)
    r = (words[h >> 1, np.arange(x.size)] >> (np.uint64(16) * (h & 1).astype(np.uint64))) & np.uint64(0xFFFF)
    u = x.view(np.uint32).astype(np.uint64)
    out = ((u + r) >> np.uint64(16)).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((u[nan] >> np.uint64(16)) | np.uint64(0x40)).astype(np.uint16)
    return out


def muon_orthogonalize(x, a=3.4445, b=-4.7750, c=2.0315, steps=5, eps=1e-7):
    """Muon's quintic Newton–Schulz iteration (Jordan et al.'s Muon; Keras's docstring), float64:
    X / (||X||_F + eps), then `X <- a X + (b A + c A^2) X` with `A = X X^T`, on the wide
    orientation (a tall matrix transposed, and back)."""
    x = np.asarray(x, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def muon_matrix(w, m, g, lr, momentum=0.95, nesterov=True, weight_decay=0.0, rms_rate=0.2, **ns):
    """One Muon step of a matrix (Keras's Muon, Moonlight's `rms_rate` scale), float64: decoupled
    decay `w - w wd lr`, `m <- momentum m + g`, the update `g + momentum m` (Nesterov) or `m`
    orthogonalized, times `sqrt(max(rows, cols)) rms_rate`. Returns (w, m)."""
    w, m, g = (np.asarray(a, np.float64) for a in (w, m, g))
    w = w - w * weight_decay * lr
    m = momentum * m + g
    o = muon_orthogonalize(g + momentum * m if nesterov else m, **ns)
    if rms_rate is not None:
        o = o * np.sqrt(max(w.shape)) * rms_rate
    return w - lr * o, m
