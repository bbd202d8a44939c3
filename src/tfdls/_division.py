"""Dividing gradients by the loss scale, exactly, for every dtype and scale.

"Exactly" means: the result is ``g / scale`` correctly rounded to the
gradient's dtype, the value a float64 reference gives. Two ways get there:

* a true division. Float16 and bfloat16 gradients are widened first: to
  float32 where the scale is a power of two (``"divide"``: the quotient is
  then exact in float32 and rounds once), else to float64
  (``"divide_in_float64"``: a float32 quotient of a float16 value by a
  float32 scale could land near a float16 rounding midpoint and round
  twice). The float64 quotient is rounded "to odd" at float32's precision
  before the cast to float16 or bfloat16, because TensorFlow and XLA cast
  float64 to those through float32, which would round twice again. The scale of
  a `FixedLossScale` is read from a variable, so no compiler sees a constant
  divisor and rewrites ``g / c`` as ``g * (1 / c)``, which is neither
  correctly rounded nor, above 2**126 where ``1 / c`` is subnormal, nonzero.
* a multiplication by exact powers of two (``"factors"``), used only inside
  XLA and only where every value the scale can take is a power of two (see
  `tfdls.LossScale.always_power_of_two`): then ``g * 2**-e`` is ``g / 2**e`` exactly. XLA
  does not fuse a division into several consumers (Adam's two moments), so a
  division would cost the update another pass over the gradients.

`method` picks one of the three for a loss scale and the current trace;
`Division` is one step's division: the divisor (the recorded scale, or 1
where `get_unscaled_gradients` already divided) and that method.

Example:

>>> from tfdls import _division
>>> _division.divide(tf.constant([3.0, 1e-30]), tf.constant(2.0**127), "factors")
<tf.Tensor: shape=(2,), dtype=float32, numpy=array([1.7632415e-38, 0.0000000e+00], dtype=float32)>
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import tensorflow as tf

from tfdls import _compat

# Float types with less precision than float32: divided in float64.
NARROW_FLOATS = (tf.float16, tf.bfloat16)
# The largest |k| for which 2**k and 2**-k are normal float64 values.
FLOAT64_MAX_EXPONENT = 1022
# Float32's largest exponent whose reciprocal power of two is still normal.
_MAX_NORMAL_RECIPROCAL_EXPONENT = 126
# Dividing a float32 value by 2**k (float16 and bfloat16 are divided in
# float32) gives 0 for every k >= 278 and, unless the value is 0, Inf for
# every k <= -278: finite magnitudes lie in [2**-149, 2**128). Clipping k to
# +-278 changes no quotient, and ceil(278 / 126) = 3 pieces divide by it.
FLOAT32_CLIPPED_EXPONENT = 278


def is_power_of_two(value: float) -> bool:
    """True for a positive finite power of two (2**k for an integer k)."""
    if not (value > 0 and math.isfinite(value)):
        return False
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


class Method(_compat.StrEnum):
    """How `divide` divides (see the module docstring); equal to, and printed as, its string."""

    FACTORS = "factors"
    DIVIDE = "divide"
    DIVIDE_IN_FLOAT64 = "divide_in_float64"


def method(power_of_two: bool, in_xla: bool) -> Method:
    """How to divide exactly: ``"factors"``, ``"divide"`` or ``"divide_in_float64"``.

    Args:
        power_of_two: every divisor is a power of two (`LossScale.always_power_of_two`).
        in_xla: the division is traced inside an XLA cluster.
    """
    if not power_of_two:
        return Method.DIVIDE_IN_FLOAT64
    return Method.FACTORS if in_xla else Method.DIVIDE


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


def power_of_two(exponent):
    """``2**exponent`` as float32, built from its bits, for int32 exponents in [-126, 127]."""
    return tf.bitcast(tf.bitwise.left_shift(exponent + 127, 23), tf.float32)


def nearest_power_of_two(value):
    """The float32 power of two nearest `value` (normal, positive float32 values,
    elementwise; from 1.5 ``2**k`` up, ``2**(k + 1)``), from the bits: exact for any
    approximation within a quarter of it, such as a division that is not IEEE's (XLA's
    GPU backend divides float32 to within 2 ulp)."""
    bits = tf.bitcast(tf.cast(value, tf.float32), tf.int32)
    return tf.bitcast(tf.bitwise.bitwise_and(bits + (1 << 22), 0x7F800000), tf.float32)


def exponent_of(power):
    """The int32 exponent ``k`` of a float32 normal power of two ``2**k``."""
    bits = tf.bitcast(tf.cast(power, tf.float32), tf.int32)
    return tf.bitwise.right_shift(bits, 23) - 127


def dtype_of(grad):
    """The dtype `grad` is divided in: its values' for a `tf.IndexedSlices`, and a Python
    list or number's as `tf.convert_to_tensor` gives it."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    return tf.as_dtype(values.dtype) if hasattr(values, "dtype") else tf.convert_to_tensor(
        values).dtype


def exponent_bound(dtype, max_exponent: int) -> int:
    """The static bound of |exponent| that dividing a `dtype` value by ``2**exponent`` needs,
    for exponents bounded by `max_exponent`: `FLOAT32_CLIPPED_EXPONENT` at most, except
    for float64 (see `reciprocal_pieces_for`)."""
    if tf.as_dtype(dtype) == tf.float64:
        return max_exponent
    return min(max_exponent, FLOAT32_CLIPPED_EXPONENT)


def reciprocal_pieces_for(dtype, exponent, max_exponent: int) -> list:
    """`reciprocal_pieces` for dividing `dtype` values: the exponent clipped to
    `exponent_bound` first (exact: see `FLOAT32_CLIPPED_EXPONENT`), so a deep chain of
    scale boundaries costs float32, float16 and bfloat16 gradients 3 multiplies, not
    ``ceil(max_exponent / 126)``."""
    bound = exponent_bound(dtype, max_exponent)
    if bound < max_exponent:
        exponent = tf.clip_by_value(tf.cast(exponent, tf.int32), -bound, bound)
    return reciprocal_pieces(exponent, bound)


def reciprocal_pieces(exponent, max_exponent: int) -> list:
    """Float32 powers of two whose product is ``2**-exponent``, exactly applied one after another.

    For int32 exponents (a scalar or a vector, elementwise) with
    |exponent| <= `max_exponent`: ``2**-e`` in ``n = ceil(|e| / 126)`` equal
    pieces of at most 126 (each a normal float32), padded with ones to the
    static count ``ceil(max_exponent / 126)``. Once a partial product is
    subnormal, the pieces left divide by at least 2**63, so the quotient
    rounds to zero either way; before, every partial product is exact.
    """
    count = max(1, math.ceil(max_exponent / _MAX_NORMAL_RECIPROCAL_EXPONENT))
    exponent = tf.cast(exponent, tf.int32)
    if count == 1:
        return [power_of_two(-exponent)]
    # n pieces in use: ceil(|e| / 126), at least 1; the first `extra` get one more.
    size = tf.abs(exponent)
    used = tf.maximum((size + _MAX_NORMAL_RECIPROCAL_EXPONENT - 1) // _MAX_NORMAL_RECIPROCAL_EXPONENT, 1)
    share = size // used
    extra = size - share * used
    sign = tf.where(exponent < 0, -1, 1)
    return [
        power_of_two(-sign * tf.where(i < used, share + tf.cast(i < extra, tf.int32), 0))
        for i in range(count)
    ]


def multiply_by_pieces(grad, pieces):
    """`grad` times each of `pieces` (float32 scalars from `reciprocal_pieces`), in order.

    For float16 and bfloat16 gradients the pieces are applied in float32 and
    the result cast once.
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(multiply_by_pieces(grad.values, pieces), grad.indices,
                                grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    narrow = grad.dtype in NARROW_FLOATS
    result = tf.cast(grad, tf.float32) if narrow else grad
    for piece in pieces:
        result = result * tf.cast(piece, result.dtype)
    return tf.cast(result, grad.dtype) if narrow else result


def power_of_two_float64(exponent):
    """``2**exponent`` as float64, built from its bits, for int exponents in [-1022, 1023]."""
    exponent = tf.cast(exponent, tf.int64)
    return tf.bitcast(tf.bitwise.left_shift(exponent + 1023, tf.constant(52, tf.int64)), tf.float64)


def reciprocal_float64(exponent):
    """``2**-exponent`` as float64 for int exponents (elementwise), clipped to +-1022
    (`FLOAT64_MAX_EXPONENT`): what `divide_in_float64_by_power_of_two` multiplies by.

    Beyond float64's normal powers of two the quotient of any float32,
    float16 or bfloat16 value is already 0 (e > 1022) or, unless the value
    is 0, Inf (e < -1022): the clip changes no result. A float64 gradient's
    exponent stays within +-1022 (`tfdls.boundaries.layers.MAX_FLOAT64_CHAIN`).
    """
    exponent = tf.clip_by_value(tf.cast(exponent, tf.int32), -FLOAT64_MAX_EXPONENT,
                                FLOAT64_MAX_EXPONENT)
    return power_of_two_float64(-exponent)


def divide_in_float64_by_power_of_two(grad, exponent, reciprocal=None):
    """``grad / 2**exponent`` correctly rounded: one float64 multiply (exact), one rounding.

    The form for steps outside XLA: TensorFlow's graph optimizer regroups a
    chain of multiplies (``g * p1 * p2`` into ``g * (p1 * p2)``), and the
    product of `multiply_by_pieces`' pieces underflows or overflows float32;
    a single multiply cannot be regrouped. float16 and bfloat16 results are
    rounded to odd at float32's precision first (see `divide`).
    `reciprocal`: `reciprocal_float64(exponent)`, if already computed (the
    gradients below one boundary share it).
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(divide_in_float64_by_power_of_two(grad.values, exponent,
                                                                  reciprocal),
                                grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    if reciprocal is None:
        reciprocal = reciprocal_float64(exponent)
    quotient = tf.cast(grad, tf.float64) * reciprocal
    if grad.dtype == tf.float64:
        return quotient
    if grad.dtype in NARROW_FLOATS:
        return tf.cast(_to_float32_round_to_odd(quotient), grad.dtype)
    return tf.cast(quotient, grad.dtype)


def divide_by_power_of_two(grad, exponent, max_exponent: int, pieces=None, reciprocal=None):
    """``grad / 2**exponent`` correctly rounded, for an int32 `exponent` with |exponent| <= `max_exponent`.

    Inside XLA (which does not regroup float multiplies): `grad` times the
    pieces of `reciprocal_pieces_for` its dtype (given, or computed here),
    fused into one pass. Elsewhere: `divide_in_float64_by_power_of_two`, by
    `reciprocal` if given. Subnormal float32,
    bfloat16 and float64 results are flushed to zero on CPUs, as all
    TensorFlow arithmetic there does.
    """
    if not _compat.in_xla_context():
        return divide_in_float64_by_power_of_two(grad, exponent, reciprocal)
    if pieces is None:
        pieces = reciprocal_pieces_for(dtype_of(grad), exponent, max_exponent)
    return multiply_by_pieces(grad, pieces)


def divide(grad, divisor, how: str, factors=None):
    """``grad / divisor`` correctly rounded to ``grad``'s dtype.

    Args:
        grad: a float tensor or `tf.IndexedSlices`.
        divisor: a positive float32 scalar tensor.
        how: ``"divide_in_float64"`` (always exact), ``"divide"`` or
            ``"factors"`` (exact only for a power-of-two divisor; see the
            module docstring and `method`).
        factors: for ``"factors"``, `reciprocal_factors(divisor)` if already
            computed (one step divides every gradient by the same divisor).
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(divide(grad.values, divisor, how, factors), grad.indices,
                                grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    narrow = grad.dtype in NARROW_FLOATS
    if how == Method.FACTORS:
        wide = tf.cast(grad, tf.float32) if narrow else grad
        first, second = reciprocal_factors(divisor) if factors is None else factors
        result = wide * tf.cast(first, wide.dtype) * tf.cast(second, wide.dtype)
    elif how == Method.DIVIDE:
        wide = tf.cast(grad, tf.float32) if narrow else grad
        result = wide / tf.cast(divisor, wide.dtype)
    elif how == Method.DIVIDE_IN_FLOAT64:
        if not narrow:
            return grad / tf.cast(divisor, grad.dtype)
        quotient = tf.cast(grad, tf.float64) / tf.cast(divisor, tf.float64)
        # TensorFlow and XLA cast float64 to float16/bfloat16 through float32,
        # rounding twice; rounding *to odd* at float32's precision first makes
        # the float32 step exact and the last rounding the correct one.
        result = _to_float32_round_to_odd(quotient)
    else:
        raise ValueError(
            f"`how` must be 'factors', 'divide' or 'divide_in_float64'; got how={how!r}"
        )
    return tf.cast(result, grad.dtype) if narrow else result


def _to_float32_round_to_odd(value):
    """A float64 tensor rounded "to odd" at float32's precision, still float64.

    Rounding to odd to a precision of at least p + 2 bits and then to nearest
    at p bits gives the nearest p-bit value (Boldo and Melquiond): float32's
    24 bits cover float16 (11) and bfloat16 (8). The rounding is done on the
    float64 bits with integer operations (the dropped bits are cut off and,
    if any was set, the last kept bit is set), not by a float64 -> float32 ->
    float64 round trip: XLA may keep "excess precision" and remove such a
    round trip (TensorFlow 2.16's XLA does). The result is representable in
    float32 (below float32's normal range, at its subnormals' precision), so
    any later cast through float32 is exact there.
    """
    bits = tf.bitcast(value, tf.int64)
    sign = tf.bitwise.bitwise_and(bits, tf.constant(-(2**63), tf.int64))
    magnitude = tf.bitwise.bitwise_xor(bits, sign)
    exponent = tf.bitwise.right_shift(magnitude, 52) - 1023
    # float64 keeps 52 fraction bits, float32 23: drop 29, and below float32's
    # smallest normal exponent (-126) one more per binade, as its subnormals do.
    dropped = 29 + tf.clip_by_value(-126 - exponent, 0, 23)
    low_mask = tf.bitwise.left_shift(tf.ones_like(dropped), dropped) - 1
    low = tf.bitwise.bitwise_and(magnitude, low_mask)
    kept = tf.bitwise.bitwise_xor(magnitude, low)
    sticky = tf.where(tf.not_equal(low, 0), tf.bitwise.left_shift(tf.ones_like(dropped), dropped), 0)
    odd = tf.bitwise.bitwise_or(kept, sticky)
    # Infinities and NaN (exponent 1024) pass unchanged.
    odd = tf.where(tf.equal(exponent, 1024), magnitude, odd)
    return tf.bitcast(tf.bitwise.bitwise_or(sign, odd), tf.float64)


def multiply(grad, factor):
    """``grad * factor`` (in float32 for float16 and bfloat16), the inverse of `divide`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(multiply(grad.values, factor), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    if grad.dtype in NARROW_FLOATS:
        return tf.cast(tf.cast(grad, tf.float32) * factor, grad.dtype)
    return grad * tf.cast(factor, grad.dtype)


@dataclasses.dataclass(frozen=True)
class Division:
    """How this step divides a gradient: by `divisor`, the recorded scale (1 where
    `get_unscaled_gradients` already divided this step's gradients), the way `how`
    says (`divide`). `already_unscaled` is a scalar bool tensor: a constant False
    where the step knows when traced that nothing was divided (`tfdls._carried_scale`)."""

    scale: Any
    already_unscaled: Any
    how: str

    @functools.cached_property  # one op per step, not one per gradient divided
    def divisor(self):
        known = tf.get_static_value(self.already_unscaled)  # a constant when traced
        if known is not None and not known:
            return self.scale
        return tf.where(self.already_unscaled, tf.ones_like(self.scale), self.scale)

    @functools.cached_property  # likewise: one set of ops per step
    def reciprocal_factors(self):
        return reciprocal_factors(self.divisor)

    def by_scale(self, grad):
        factors = self.reciprocal_factors if self.how == Method.FACTORS else None
        return divide(grad, self.divisor, self.how, factors)

    def as_value(self, grad):
        """The "gradient" of an `overwrite_with_gradient` variable, a value never divided:
        multiplied back where get_unscaled_gradients divided it (exact for a power of two)."""
        if grad is None:
            return None
        grad = tf.convert_to_tensor(grad)
        return tf.where(self.already_unscaled, multiply(grad, self.scale), grad)
