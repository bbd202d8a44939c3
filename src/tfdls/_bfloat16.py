"""`BFloat16Warning`: loss scaling a bfloat16 model is harmless, and does nothing useful."""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from tfdls import _compat


class BFloat16Warning(UserWarning):
    """Loss scaling a bfloat16 model: harmless, but it does nothing useful.

    bfloat16 has float32's exponent range, so its gradients neither overflow
    nor underflow where float32's would not: it needs no loss scale. tfdls
    still scales, checks and skips as configured, and its gradient
    statistics stay float16-relative. Warned once per optimizer, when it is
    built under a ``mixed_bfloat16`` policy or for bfloat16 variables.
    Silence it with ``warnings.filterwarnings("ignore", category=tfdls.BFloat16Warning)``.

    Example:

    >>> keras.mixed_precision.set_global_policy("mixed_bfloat16")
    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     opt.build([keras.Variable([1.0])])
    >>> [w.category.__name__ for w in caught]
    ['BFloat16Warning']
    >>> keras.mixed_precision.set_global_policy("float32")
    """


def warn_if_bfloat16(var_list):
    compute_dtype = keras.mixed_precision.global_policy().compute_dtype
    dtypes = {tf.as_dtype(getattr(v, "dtype", tf.float32)) for v in var_list}
    if compute_dtype == "bfloat16" or tf.bfloat16 in dtypes:
        warnings.warn(
            "tfdls: this model computes in bfloat16, which has float32's range and needs "
            "no loss scaling; LossScaleOptimizer still scales, checks and skips as "
            "configured, and its gradient statistics are float16-relative. Use the inner "
            "optimizer alone, or silence this with warnings.filterwarnings('ignore', "
            "category=tfdls.BFloat16Warning).",
            BFloat16Warning,
            stacklevel=_compat.user_stacklevel(),
        )
