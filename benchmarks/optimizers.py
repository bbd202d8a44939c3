"""The optimizers of the variants (cases.VARIANTS): the inner optimizer of a case and what
each variant wraps it in, the scale boundaries it adds, and what is recorded of them.
"""

import importlib
import sys

import keras
import tensorflow as tf

import cases
import tfdls

try:  # optional: the tf_keras columns of the overhead family
    import tf_keras
except ImportError:  # pragma: no cover - depends on the environment
    tf_keras = None

LEARNING_RATES = {"sgd": 0.01, "sgdm": 0.01, "adam": 1e-3}
MOMENTUM = 0.9  # inner kind "sgdm"


def inner(kind, module=keras):
    """A fresh optimizer of `kind` ("sgd", "sgdm": with momentum, "adam") from `module`."""
    rate = LEARNING_RATES[kind]
    # tf_keras would XLA-compile each variable's update on a GPU, also in "graph" mode:
    # jit_compile=False lets the outer tf.function alone decide.
    options = {"jit_compile": False} if module is not keras else {}
    if kind == "adam":
        return module.optimizers.Adam(rate, **options)
    return module.optimizers.SGD(rate, momentum=MOMENTUM if kind == "sgdm" else 0.0, **options)


def wrap(variant, optimizer, model=None):
    """`optimizer` wrapped as variant `variant` wraps it ("none", "keras3" or "tfdls").

    Args:
        variant: a `cases.Variant`.
        optimizer: the inner Keras 3 optimizer.
        model: the model given to tfdls when the variant adds scale boundaries.
    """
    if variant.wrapper == "keras3":
        return keras.optimizers.LossScaleOptimizer(optimizer)
    if variant.wrapper == "tfdls":
        boundaries = model if variant.every is not None else None
        package = importlib.import_module(variant.package)
        return package.LossScaleOptimizer(optimizer, scale_boundaries=boundaries,
                                          **dict(variant.options))
    return optimizer


def build(name, inner_kind, model):
    """Variant `name`'s model (with its scale boundaries, if any) and optimizer, for a case
    whose inner optimizer is `inner_kind`."""
    variant = cases.VARIANTS[name]
    if variant.every is not None:
        package = importlib.import_module(variant.package)
        model = package.add_scale_boundaries(model, every=variant.every,
                                             **dict(variant.boundary_options))
    return model, wrap(variant, inner(inner_kind), model)


def is_tfdls(optimizer):
    """Whether `optimizer` is tfdls' `LossScaleOptimizer`, or a copy's (`versions`)."""
    return any(isinstance(optimizer, type_) for type_ in _tfdls_optimizer_types())


def _tfdls_optimizer_types():
    # tfdls and the copies imported so far (each names itself tfdls_<commit>).
    return [tfdls.LossScaleOptimizer] + [
        module.LossScaleOptimizer for name, module in list(sys.modules.items())
        if name.startswith("tfdls_") and "." not in name
        and hasattr(module, "LossScaleOptimizer")]


def loss_scale(optimizer):
    """The current loss scale (None without loss scaling)."""
    if is_tfdls(optimizer):  # before Keras': it subclasses it
        return float(tf.convert_to_tensor(optimizer.loss_scale()))
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(tf.convert_to_tensor(optimizer.dynamic_scale))
    if tf_keras is not None and isinstance(optimizer,
                                           tf_keras.mixed_precision.LossScaleOptimizer):
        return float(tf.convert_to_tensor(optimizer.loss_scale))
    return None


def scale_state(optimizer):
    """(current scale, initial scale) of a loss-scale optimizer, None for others.

    tfdls counts skipped steps: after any, the current scale reads as 0.
    """
    current = loss_scale(optimizer)
    if current is None:
        return None
    if is_tfdls(optimizer) and int(
            optimizer.loss_scale.num_skipped_steps.numpy()):
        current = 0.0
    return current, float(optimizer.initial_scale)


def record(optimizer):
    """Applied steps and the loss scale; for tfdls also the package (tfdls, or a copy of it
    at another commit: `versions`), skipped steps, boundary factors and how its step skips
    (`step_plan`)."""
    result = {"iterations": int(optimizer.iterations.numpy()), "loss_scale": loss_scale(optimizer)}
    if is_tfdls(optimizer):
        result.update(package=type(optimizer).__module__.split(".")[0],
                      skipped_steps=int(optimizer.loss_scale.num_skipped_steps.numpy()))
        # What older commits (`versions`) lack is left out.
        if hasattr(optimizer, "scale_boundary_factors"):
            result.update(factors=optimizer.scale_boundary_factors())
        plan = getattr(optimizer, "step_plan", None)
        if plan is not None:
            result.update(step_plan={"skip": plan.skip, "check": plan.check,
                                     "compile": plan.compile, "reason": plan.reason})
    return result
