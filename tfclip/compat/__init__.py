"""TF1-style optimizers: `tfclip.compat.v1`."""
from tfclip.compat import v1  # noqa: F401
