"""The module path that tf_keras configs saved before 2026-12-04 name for tfclip.tf_keras's
LossScaleOptimizers (tf_keras imports it to find the class where tfclip.tf_keras has not
registered it yet): the classes now live in tfclip/tf_keras/_loss_scale.py."""
from tfclip.tf_keras._loss_scale import LegacyLossScaleOptimizer, LossScaleOptimizer  # noqa: F401
