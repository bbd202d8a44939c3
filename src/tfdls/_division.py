"""Dividing gradients by the loss scale, exactly, for every dtype and scale.

"Exactly" means: the result is ``g / scale`` correctly rounded to the
gradient's dtype, the value a float64 reference gives. Two ways get there:

* a true division. Float16 and bfloat16 gradients are widened first: to
  float32 where the scale is a power of two (``"divide"``: the quotient is
  then exact in float32 and rounds once), else to float64
  (``"divide_in_float64"``: a float32 quotient of a float16 value by a
  float32 scale could land on a float16 rounding midpoint and round twice; a
  float64 one cannot, its error, below 2**-53, being smaller than the
  distance of any such quotient from a midpoint, about 2**-37). The scale of
  a `FixedLossScale` is read from a variable, so no compiler sees a constant
  divisor and rewrites ``g / c`` as ``g * (1 / c)``, which is neither
  correctly rounded nor, above 2**126 where ``1 / c`` is subnormal, nonzero.
* a multiplication by exact powers of two (``"factors"``), used only inside
  XLA and only where every value the scale can take is a power of two (see
  `scale_is_power_of_two`): then ``g * 2**-e`` is ``g / 2**e`` exactly. XLA
  does not fuse a division into several consumers (Adam's two moments), so a
  division would cost the update another pass over the gradients.

`method` picks one of the three for a loss scale and the current trace.

Example:

>>> from tfdls import _division
>>> _division.divide(tf.constant([3.0, 1e-30]), tf.constant(2.0**127), "factors")
<tf.Tensor: shape=(2,), dtype=float32, numpy=array([1.7632415e-38, 0.0000000e+00], dtype=float32)>
"""

from __future__ import annotations

import math

import tensorflow as tf

# Float types with less precision than float32: divided in float64.
NARROW_FLOATS = (tf.float16, tf.bfloat16)
# Float32's largest exponent whose reciprocal power of two is still normal.
_MAX_NORMAL_RECIPROCAL_EXPONENT = 126


def is_power_of_two(value: float) -> bool:
    """True for a positive finite power of two (2**k for an integer k)."""
    if not (value > 0 and math.isfinite(value)):
        return False
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


def scale_is_power_of_two(loss_scale) -> bool:
    """True if every value `loss_scale` uses is a power of two (known statically).

    A `FixedLossScale` or `DynamicLossScale` (not a subclass, which may
    compute its scale differently) whose `powers_of_two` is True; their
    `__call__` returns a power of two whatever their variable holds. A
    custom scale is unknown: False.
    """
    from tfdls import loss_scale as loss_scale_lib

    exact_types = (loss_scale_lib.FixedLossScale, loss_scale_lib.DynamicLossScale)
    return type(loss_scale) in exact_types and loss_scale.powers_of_two


def method(power_of_two: bool, in_xla: bool) -> str:
    """How to divide exactly: ``"factors"``, ``"divide"`` or ``"divide_in_float64"``.

    Args:
        power_of_two: every divisor is a power of two (`scale_is_power_of_two`).
        in_xla: the division is traced inside an XLA cluster.
    """
    if not power_of_two:
        return "divide_in_float64"
    return "factors" if in_xla else "divide"


def reciprocal_factors(divisor):
    """Two powers of two whose product is ``1 / divisor``, for a power-of-two float32 divisor.

    ``2**-e`` is normal for ``e <= 126``: then the factors are ``2**-e`` and
    1, one rounding. Above, ``2**-e`` is subnormal (flushed to zero by CPU
    kernels), so the exponent is split in two halves of at least 63: if the
    first product is already subnormal, the quotient is below 2**-189 and
    rounds to zero either way; otherwise the first product is exact and the
    second rounds once.
    """
    bits = tf.bitcast(tf.cast(divisor, tf.float32), tf.int32)
    exponent = tf.bitwise.right_shift(bits, 23) - 127
    split = exponent > _MAX_NORMAL_RECIPROCAL_EXPONENT
    first = tf.where(split, exponent // 2, exponent)
    second = tf.where(split, exponent - exponent // 2, tf.zeros_like(exponent))

    def power_of_two(k):  # 2**-k, built from its bits
        return tf.bitcast(tf.bitwise.left_shift(127 - k, 23), tf.float32)

    return power_of_two(first), power_of_two(second)


def divide(grad, divisor, how: str):
    """``grad / divisor`` correctly rounded to ``grad``'s dtype.

    Args:
        grad: a float tensor or `tf.IndexedSlices`.
        divisor: a positive float32 scalar tensor.
        how: ``"divide_in_float64"`` (always exact), ``"divide"`` or
            ``"factors"`` (exact only for a power-of-two divisor; see the
            module docstring and `method`).
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(divide(grad.values, divisor, how), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    narrow = grad.dtype in NARROW_FLOATS
    if how == "factors":
        wide = tf.cast(grad, tf.float32) if narrow else grad
        first, second = reciprocal_factors(divisor)
        result = wide * tf.cast(first, wide.dtype) * tf.cast(second, wide.dtype)
    elif how in ("divide", "divide_in_float64"):
        wide_dtype = tf.float32 if how == "divide" else tf.float64
        wide = tf.cast(grad, wide_dtype) if narrow else grad
        result = wide / tf.cast(divisor, wide.dtype)
    else:
        raise ValueError(
            f"`how` must be 'factors', 'divide' or 'divide_in_float64'; got how={how!r}"
        )
    return tf.cast(result, grad.dtype) if narrow else result


def multiply(grad, factor):
    """``grad * factor`` (in float32 for float16 and bfloat16), the inverse of `divide`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(multiply(grad.values, factor), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    if grad.dtype in NARROW_FLOATS:
        return tf.cast(tf.cast(grad, tf.float32) * factor, grad.dtype)
    return grad * tf.cast(factor, grad.dtype)
