"""`tfclip.keras.GradientNormLogger`: a Keras 3 callback writing a tfclip optimizer's norms and clip
counts to TensorBoard (documented there; kept apart from the optimizers it reads)."""
import keras
import tensorflow as tf

from tfclip import clipping as _clipping


class GradientNormLogger(keras.callbacks.Callback):
    """Logs where the gradients are large, from a tfclip optimizer's fused step, to TensorBoard.

    Every `every_n_steps` training steps it writes, with `tf.summary`, under `log_dir`:

    - `{prefix}/global_norm`: the pre-clip global norm of the step;
    - `{prefix}/clip_threshold` (with an adaptive `clip=`, tfclip.clipping): the norm above which
      the step would have been clipped;
    - `{prefix}/clip_fraction` and `{prefix}/clip_scale_mean` (with `global_clipnorm`,
      `clipnorm` or an adaptive `clip=`): the share of the steps since the last write that the clip scaled down, and
      their mean clip scale (1 for a step left alone, clip / norm for a clipped one);
    - `{prefix}/agc_clipped_units` and `{prefix}/agc_clipped_fraction` (with
      `clip=tfclip.clipping.AGC(...)`): how many units AGC scaled down at the last step, all
      variables together (`optimizer.clipped_units`, counted by the fused op), and that count over
      the variables' total number of units (a unit: one index of a variable's last axis; a
      variable of rank <= 1 is one unit);
    - `{prefix}/skipped_steps`: steps skipped for a non-finite norm since the last write (and
      `{prefix}/skipped_steps_total`);
    - `{prefix}/{by}/<name>`: the norms of the `top_k` largest layers (`by="layer"`: the norm of
      all the layer's gradients together; `by="variable"`: one per variable), and
      `{prefix}/{by}_norms`, a histogram of all of them.

    The norms come from the optimizer's norm pass (`optimizer.tensor_norms`): logging costs no
    pass over the gradients, only a read of a few small variables every `every_n_steps` steps.

    ```python
    model.compile(optimizer=tfclip.keras.Adam(1e-3, global_clipnorm=1.0), loss="mse")
    model.fit(x, y, callbacks=[tfclip.keras.GradientNormLogger("logs/grads", every_n_steps=50)])
    ```
    """

    def __init__(self, log_dir, every_n_steps=100, top_k=5, by="layer", prefix="gradients"):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        if by not in ("layer", "variable"):
            raise ValueError(f"by must be 'layer' or 'variable', got {by!r}")
        try:
            import tensorboard  # noqa: F401  (tf.summary.scalar and histogram live there)
        except ImportError:
            raise ImportError("GradientNormLogger writes with tf.summary, which needs the tensorboard "
                              "package: pip install tensorboard") from None
        self.log_dir = log_dir
        self.every_n_steps = every_n_steps
        self.top_k = top_k
        self.by = by
        self.prefix = prefix
        self._writer = None

    def _optimizer(self):
        opt = self.model.optimizer
        if getattr(type(opt), "_tfclip_library", None) != "keras":  # (a tfclip.keras optimizer)
            raise TypeError("GradientNormLogger needs a tfclip.keras optimizer (e.g. "
                            f"tfclip.keras.Adam), got {type(opt).__name__}")
        return opt

    def on_train_begin(self, logs=None):
        opt = self._optimizer()
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        self._last = self._counters(opt)
        self._next = (self._last[0] // self.every_n_steps + 1) * self.every_n_steps

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_base = int(self._optimizer().iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        step = self._epoch_base + batch + 1  # (batch: the last step of this call, as Keras counts)
        if step >= self._next:
            self._write(self._optimizer())
            self._next = (step // self.every_n_steps + 1) * self.every_n_steps

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()

    @staticmethod
    def _counters(opt):
        return (int(opt.iterations.numpy()), int(opt.skipped_steps.numpy()),
                int(opt.clipped_steps.numpy()), float(opt.clip_scale_sum.numpy()))

    def group_norms(self, opt):
        """The logged norms, by layer or variable: (names, norms), largest first."""
        norms = opt.tensor_norms.numpy().astype("float64")
        names = opt.tensor_norm_names
        if self.by == "layer":
            sums = {}
            for name, n in zip(names, norms):
                key = name.rsplit("/", 1)[0] if "/" in name else name
                sums[key] = sums.get(key, 0.0) + n * n
            names, norms = list(sums), [s ** 0.5 for s in sums.values()]
        order = sorted(range(len(names)), key=lambda i: -norms[i] if norms[i] == norms[i] else float("-inf"))
        return [names[i] for i in order], [float(norms[i]) for i in order]

    def _write(self, opt):
        now = self._counters(opt)
        steps, skipped, clipped, scale_sum = (a - b for a, b in zip(now, self._last))
        self._last = now
        p, step = self.prefix, now[0]
        mode, _ = opt._clip_mode()
        with self._writer.as_default(step=step):
            tf.summary.scalar(f"{p}/global_norm", float(opt.global_norm.numpy()))
            tf.summary.scalar(f"{p}/skipped_steps", skipped)
            tf.summary.scalar(f"{p}/skipped_steps_total", now[1])
            if (mode in ("global_norm", "norm") or opt.clip is not None) and steps > 0:
                tf.summary.scalar(f"{p}/clip_fraction", clipped / steps)
                tf.summary.scalar(f"{p}/clip_scale_mean", scale_sum / steps)
            if opt.clip is not None:  # the adaptive threshold of the last step, beside its norm
                tf.summary.scalar(f"{p}/clip_threshold", float(opt.adaptive_threshold.numpy()))
            if opt.clipped_units is not None:  # AGC: the last step's clipped units
                total = int(opt.clipped_units.numpy().sum())
                units = sum(_clipping.num_units(v.shape) for v in opt._trainable_variables)
                tf.summary.scalar(f"{p}/agc_clipped_units", total)
                tf.summary.scalar(f"{p}/agc_clipped_fraction", total / units if units else 0.0)
            if opt.tensor_norms is not None:
                names, norms = self.group_norms(opt)
                for name, n in list(zip(names, norms))[:self.top_k]:
                    tf.summary.scalar(f"{p}/{self.by}/{name}", n)
                if norms:
                    tf.summary.histogram(f"{p}/{self.by}_norms", norms)


GradientNormLogger.__module__ = "tfclip.keras"  # (where users find it)
