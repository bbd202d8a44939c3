"""Keras 3's and tf_keras' ways of calling a loss-scale optimizer, on tfdls' state.

`LossScaleOptimizer` (in `tfdls.optimizer`) is the Keras-facing class; this
module holds what lets code written for Keras 3's or tf_keras'
`LossScaleOptimizer` call it unchanged: their argument styles
(`loss_scale_from_arguments`), their names for the scale's settings and state
and the Keras step helpers tfdls does not use (`KerasNames`), Keras 3's
variable-store layout in `.keras` files (`load_keras_layout`) and the keys
older Keras configs hold (`drop_unused_learning_rate`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdls import finite
from tfdls import loss_scale as loss_scale_lib

KERAS_STYLE_KEYWORDS = ("initial_scale", "dynamic_growth_steps", "dynamic")
# Keras' base-optimizer keywords, at the values that mean "not set". Keras 3's
# LossScaleOptimizer accepts them at these values (older Keras 3 configs hold
# them, so `.keras` files may) and refuses any other value.
_BASE_OPTIMIZER_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
def check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss-scale optimizer "
            f"({type(inner_optimizer).__module__}.{type(inner_optimizer).__name__}); "
            "wrap the plain optimizer instead, or scaling happens twice."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        hint = ""
        if isinstance(inner_optimizer, str):
            hint = f" Use keras.optimizers.get({inner_optimizer!r}) to build one."
        elif "tf_keras" in type(inner_optimizer).__module__:
            hint = " tf_keras (Keras 2) optimizers are not supported; use keras.optimizers."
        raise TypeError(
            "`inner_optimizer` must be a Keras 3 optimizer (an instance of "
            f"keras.optimizers.Optimizer); got inner_optimizer={inner_optimizer!r}.{hint}"
        )
    if inner_optimizer.loss_scale_factor is not None:
        raise ValueError(
            "`inner_optimizer` has its own loss_scale_factor="
            f"{inner_optimizer.loss_scale_factor!r}; it would scale the loss a second "
            "time. Set loss_scale_factor=None on it and give the scale to "
            "LossScaleOptimizer(loss_scale=...) instead."
        )


def _is_unset(value, default):
    if default is None or isinstance(default, bool):
        return value is default
    # A number (ema_momentum): by value, as Keras compares; but True is not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default


def check_base_optimizer_keywords(kwargs):
    """Drops Keras' base-optimizer keywords at their defaults; raises for the rest.

    ValueError, as Keras 3 raises, so that code catching Keras' error still
    catches tfdls'.
    """
    for key, default in _BASE_OPTIMIZER_DEFAULTS.items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        if _is_unset(value, default):
            continue
        if key == "loss_scale_factor":
            raise ValueError(
                f"LossScaleOptimizer does not take loss_scale_factor={value!r}, and its "
                "`inner_optimizer` may not have one either (the loss would be scaled "
                f"twice); for a fixed scale give LossScaleOptimizer(loss_scale={value!r})."
            )
        raise ValueError(
            f"LossScaleOptimizer does not take `{key}`; got {key}={value!r}. It is an "
            f"option of the optimizer that applies the gradients: set {key}={value!r} "
            "on the `inner_optimizer` (it receives the unscaled gradients)."
        )
    if kwargs:
        names = "`, `".join(kwargs)  # in the order given, as Keras lists them
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{names}` (got {given}); "
            "options of the optimizer itself belong on the `inner_optimizer`."
        )


def _build_loss_scale(loss_scale, keras_style):
    """Resolves the two argument styles into one `LossScale`."""
    if keras_style and loss_scale is not None:
        raise ValueError(
            "Give either `loss_scale` or the Keras-style keywords "
            f"{sorted(keras_style)}, not both; got loss_scale={loss_scale!r} and "
            + ", ".join(f"{k}={v!r}" for k, v in sorted(keras_style.items()))
        )
    if not keras_style:
        return loss_scale_lib.get("dynamic" if loss_scale is None else loss_scale)
    initial_scale = keras_style.get("initial_scale", 2.0**15)
    if keras_style.get("dynamic", True):
        return loss_scale_lib.DynamicLossScale(
            initial_loss_scale=initial_scale,
            increment_period=keras_style.get("dynamic_growth_steps", 2000),
        )
    if "dynamic_growth_steps" in keras_style:
        raise ValueError(
            "`dynamic_growth_steps` only applies to a dynamic loss scale; got "
            f"dynamic=False and dynamic_growth_steps={keras_style['dynamic_growth_steps']!r}"
        )
    return loss_scale_lib.FixedLossScale(initial_scale)


def loss_scale_from_arguments(inner_optimizer, loss_scale, kwargs):
    """The `LossScale` of a constructor call, tfdls style (`loss_scale`) or Keras style
    (``initial_scale``, ``dynamic_growth_steps``, ``dynamic`` in `kwargs`, popped).

    Checks in this order: Keras' base-optimizer keywords left in `kwargs`,
    `inner_optimizer`, then the scale's arguments.
    """
    keras_style = {k: kwargs.pop(k) for k in KERAS_STYLE_KEYWORDS if k in kwargs}
    check_base_optimizer_keywords(kwargs)
    check_inner_optimizer(inner_optimizer)
    return _build_loss_scale(loss_scale, keras_style)


def drop_unused_learning_rate(config):
    """`config` without the wrapper's own learning rate older Keras configs hold (Keras
    fixes it at 0; the inner optimizer's rate is the one that acts); a ValueError for any
    other value."""
    config = dict(config)
    if "learning_rate" in config:
        learning_rate = config.pop("learning_rate")
        if not _is_unset(learning_rate, 0.0):
            raise ValueError(
                "LossScaleOptimizer.from_config: the config's learning_rate="
                f"{learning_rate!r} is not the wrapper's unused rate of 0; set "
                "learning_rate on the `inner_optimizer` config."
            )
    return config


def load_keras_layout(optimizer, store) -> bool:
    """Restores a store Keras 3's `LossScaleOptimizer` wrote; False for another layout.

    Keras 3 writes its iterations and learning rate, its step counter and
    scale, then the inner optimizer's variables. With a `DynamicLossScale`,
    such a store restores the scale and the good-step count (Keras' step
    counter counts the same steps); the hysteresis budget starts full and
    the monitoring counters keep their values, as Keras keeps neither.
    """
    own = len(optimizer._variables)
    inner = optimizer.inner_optimizer
    keras_layout = own + 2 + len(inner.variables)
    ls = optimizer.loss_scale
    dynamic = isinstance(ls, loss_scale_lib.DynamicLossScale)
    if not (dynamic and len(store.keys()) == keras_layout != len(optimizer.variables)):
        return False
    values = [np.asarray(store[str(i)]) for i in range(keras_layout)]
    for variable, value in zip(optimizer._variables, values[:own]):
        variable.assign(value)
    ls.num_good_steps.assign(int(values[own]))
    # Keras' scale has no bounds (it can reach 0 or inf); tfdls' scale
    # stays within them, so a value outside is moved to the nearest bound.
    scale = float(values[own + 1])
    upper = ls.max_loss_scale or float(np.finfo(np.float32).max)
    ls.current_loss_scale.assign(
        ls.initial_loss_scale if np.isnan(scale) else min(max(scale, ls.min_loss_scale), upper)
    )
    ls.hysteresis_budget.assign(ls.hysteresis)
    for variable, value in zip(inner.variables, values[own + 2:]):
        variable.assign(value)
    return True


class TrackedVariables(tf.Module):
    """Holds variables so that `tf.train.Checkpoint` and SavedModel track them."""

    def __init__(self, variables):
        super().__init__(name="inner_optimizer_state")
        self.tracked = list(variables)


class KerasNames:
    """Keras 3's and tf_keras' `LossScaleOptimizer` names, read from tfdls' `loss_scale`,
    and the Keras step helpers tfdls replaces by `apply` (a mixin of `LossScaleOptimizer`)."""

    @property
    def dynamic(self) -> bool:
        """True for a `DynamicLossScale` (Keras 3's and tf_keras' ``dynamic``)."""
        return isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)

    @property
    def initial_scale(self) -> float | None:
        """The dynamic scale's initial value, or the fixed scale's value; None for a custom scale."""
        if self.dynamic:
            return self.loss_scale.initial_loss_scale
        if not self.loss_scale.can_skip:  # a fixed scale
            return self.loss_scale.min_value
        return None

    @property
    def dynamic_growth_steps(self) -> int | None:
        """The dynamic scale's `increment_period`; None for other scales."""
        return self.loss_scale.increment_period if self.dynamic else None

    @property
    def dynamic_scale(self):
        """The current scale, as Keras 3's `LossScaleOptimizer.dynamic_scale`.

        The `DynamicLossScale`'s variable, or a float32 tensor for other scales.
        """
        if self.dynamic:
            return self.loss_scale.current_loss_scale
        return self.loss_scale()

    @property
    def step_counter(self):
        """Finite steps since the scale last grew or shrank, as in Keras 3.

        A dynamic scale's `num_good_steps` variable; 0 for a fixed scale.
        """
        if self.dynamic:
            return self.loss_scale.num_good_steps
        if not self.loss_scale.can_skip:  # a fixed scale
            return tf.constant(0, tf.int64)
        raise AttributeError(
            f"step_counter: the custom loss scale {type(self.loss_scale).__name__} "
            "keeps no step counter that tfdls knows of."
        )

    def check_finite(self, grads: Any) -> tf.Tensor:
        """Keras 3's name for `tfdls.all_finite(grads)` (this replica's gradients)."""
        return finite.all_finite(grads)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError(
            "stateless_apply is not supported by tfdls.LossScaleOptimizer (nor by "
            "Keras' optimizers on the TensorFlow backend, where it conflicts with "
            "tf.distribute); use apply()."
        )

    def _common_apply(self, grads, trainable_variables=None):
        self.apply(grads, trainable_variables)

    def _tf_apply(self, grads, trainable_variables=None):
        self.apply(grads, trainable_variables)

    def _not_used(self, *args, **kwargs):
        raise NotImplementedError(
            "tfdls.LossScaleOptimizer does not use Keras' LossScaleOptimizer step "
            "helpers (its state is in `loss_scale`); call apply()."
        )

    _stateful_handle_finite_grads = _not_used
    _stateful_handle_non_finite_grads = _not_used
    _stateless_handle_finite_grads = _not_used
    _stateless_handle_non_finite_grads = _not_used

