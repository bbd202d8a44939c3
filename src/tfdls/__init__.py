"""tfdls: dynamic loss scaling for TensorFlow and Keras 3."""

__version__ = "0.1.0"

# Checks the TensorFlow and Keras versions, and every private name tfdls uses,
# before anything else is imported.
from tfdls import _compat  # noqa: F401

from tfdls.boundaries import ScaleBoundary, UnscaledInput, add_scale_boundaries  # noqa: E402
from tfdls.callbacks import LossScaleMonitor  # noqa: E402
from tfdls.finite import all_finite  # noqa: E402
from tfdls.gradient_stats import GradientStats  # noqa: E402
from tfdls.loss_scale import (  # noqa: E402
    DynamicLossScale,
    FixedLossScale,
    LossScale,
    deserialize,
    get,
    serialize,
)
from tfdls._forgotten_scale import UnscaledLossWarning  # noqa: E402
from tfdls.optimizer import BFloat16Warning, LossScaleOptimizer  # noqa: E402
from tfdls.overflow import LossScaleStuckError, OverflowReport  # noqa: E402
from tfdls._plan import StepPlan  # noqa: E402

__all__ = [
    "BFloat16Warning",
    "DynamicLossScale",
    "FixedLossScale",
    "GradientStats",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LossScaleStuckError",
    "OverflowReport",
    "ScaleBoundary",
    "StepPlan",
    "UnscaledInput",
    "UnscaledLossWarning",
    "add_scale_boundaries",
    "all_finite",
    "deserialize",
    "get",
    "serialize",
]
