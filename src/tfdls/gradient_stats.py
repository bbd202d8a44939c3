"""Where the scaled gradients sit in float16's range: "is my loss scale right?"

A loss scale has one job: put the scaled gradients inside float16's range,
below 65504 (else they overflow) and at or above 2**-14 (below it they lose
precision as subnormals, and below 2**-24 they become 0). With
``LossScaleOptimizer(..., gradient_stats=True)`` every finite step records,
on the device and per variable, from the scaled gradients:

* ``headroom_bits``: ``log2(65504 / max|g * s|)``, how many doublings of the
  scale the largest gradient element could take before it overflows float16
  (``inf`` for an all-zero gradient; negative once it is beyond float16);
* ``zero_fraction``: the fraction of elements that are exactly zero;
* ``subnormal_fraction``: the fraction that are nonzero but below 2**-14 in
  magnitude (float16's subnormal range).

Zeros and small values are counted on the bits, so a float32 value below
float32's own normal range (which XLA and CPU kernels may treat as zero)
counts as small, not as zero.

The figures are float16-relative whatever the gradients' dtype: loss scaling
exists for float16. Under bfloat16 (float32's range, see
`tfdls.BFloat16Warning`) a small headroom or a high subnormal fraction here
points at no problem.

Under a `tf.distribute` strategy each figure is the worst replica's (the
smallest headroom, the largest fractions). Skipped steps leave the last
finite step's figures. For sparse gradients the figures cover the rows
present. The host reads them with `LossScaleOptimizer.gradient_stats()`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from tfdls import _compat, _distribute, finite
from tfdls._distribute import state_variable

FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0**-14
_LOG2_FLOAT16_MAX = math.log2(FLOAT16_MAX)


@dataclasses.dataclass(frozen=True)
class GradientStats:
    """One variable's scaled gradient on the last finite step.

    Attributes:
        headroom_bits: ``log2(65504 / max|g * s|)``; ``inf`` if all zero;
            NaN before the first finite step.
        zero_fraction: fraction of elements exactly 0.
        subnormal_fraction: fraction nonzero but below 2**-14 in magnitude.
        boundary_factor: the product of the factors of the
            `tfdls.ScaleBoundary` layers above the variable, which its scaled
            gradient carried on top of the loss scale (1 without boundaries).

    Example:

    >>> tfdls.GradientStats(headroom_bits=0.3, zero_fraction=0.0, subnormal_fraction=0.25)
    GradientStats(headroom_bits=0.3, zero_fraction=0.0, subnormal_fraction=0.25, boundary_factor=1.0)
    """

    headroom_bits: float
    zero_fraction: float
    subnormal_fraction: float
    boundary_factor: float = 1.0


def tensor_stats(values, factors=None):
    """In-step: a [3, len(values)] float32 tensor of the figures of each scaled tensor.

    Args:
        values: dense gradient tensors (any float dtype).
        factors: per value, a float32 scalar by which it is multiplied to give
            the scaled gradient (the scale, for gradients that came already
            divided by it), or None for 1. The figures are computed from the
            values and the factor, so no element is multiplied (a
            multiplication by 1 would flush subnormals to zero).

    Rows: headroom bits, zero fraction, subnormal fraction. Branch-free.
    """
    columns = []
    in_xla = _compat.in_xla_context()
    on_host = finite.host_only()
    factors = [None] * len(values) if factors is None else factors
    for value, factor in zip(values, factors):
        size = max(int(value.shape.num_elements() or 0), 1)
        if value.dtype in (tf.float16, tf.bfloat16):
            value = tf.cast(value, tf.float32)  # exact, also for their subnormals
        # |scaled| < 2**-14 is |value| < 2**-14 / factor.
        threshold = tf.constant(FLOAT16_MIN_NORMAL, value.dtype)
        if factor is not None:
            threshold = threshold / tf.cast(factor, value.dtype)
        width = finite.matvec_width(value, in_xla, _COUNT_MAX_WIDTH) if in_xla and on_host else None
        if width is not None:
            zeros, subnormals = _counts_by_matvec(value, threshold, width)
        else:
            zero, small = _zero_and_small(value, threshold)
            zeros = tf.reduce_sum(tf.cast(zero, tf.float32))
            subnormals = tf.reduce_sum(tf.cast(small, tf.float32))
        # max(max, -min) rather than max(abs): plain reductions, which XLA's
        # CPU backend runs several times faster. Only finite steps are kept.
        largest = tf.cast(
            tf.maximum(tf.reduce_max(value), -tf.reduce_min(value)), tf.float64
        )
        if factor is not None:
            largest = largest * tf.cast(factor, tf.float64)
        # log2(0) = -inf, so an all-zero gradient has infinite headroom.
        headroom = _LOG2_FLOAT16_MAX - tf.math.log(largest) / math.log(2.0)
        columns.append(tf.stack([tf.cast(headroom, tf.float32), zeros / size, subnormals / size]))
    return tf.stack(columns, axis=1)


# Per float dtype compared: the integer type of its bits and the mask of
# all bits but the sign.
_BITS = {
    tf.float32: (tf.int32, 0x7FFFFFFF),
    tf.float64: (tf.int64, 0x7FFFFFFFFFFFFFFF),
}


def _zero_and_small(value, threshold):
    """Elementwise: exactly zero, and nonzero below `threshold` in magnitude, on the bits.

    Float comparisons are not reliable for subnormals: CPU kernels and XLA
    may treat them as zero (denormals-are-zero), so a float32 value of 1e-40
    would count as zero. The bits of a magnitude order like the magnitude.
    """
    int_dtype, magnitude_mask = _BITS[value.dtype]
    mask = tf.constant(magnitude_mask, int_dtype)
    magnitude = tf.bitwise.bitwise_and(tf.bitcast(value, int_dtype), mask)
    limit = tf.bitwise.bitwise_and(tf.bitcast(threshold, int_dtype), mask)
    zero = tf.equal(magnitude, 0)
    small = tf.logical_and(magnitude > 0, magnitude < limit)
    return zero, small


# Codes summed per row must stay exact float32 integers: width * (4096 + 1) < 2**24.
_COUNT_MAX_WIDTH = 2048


def _counts_by_matvec(value, threshold, width):
    """Zero and subnormal counts of a float32/float64 tensor, for XLA on a CPU.

    XLA's CPU backend runs a fused count as a scalar loop; an elementwise code
    (1 for a zero, 4096 for a subnormal) summed per row by a matrix-vector
    product with ones is several times faster, and exact: every row sum is an
    integer below 2**24, and a row has fewer than 4096 zeros.
    """
    zero, small = _zero_and_small(value, threshold)
    code = tf.cast(zero, value.dtype) + 4096.0 * tf.cast(small, value.dtype)
    rows = tf.linalg.matvec(tf.reshape(code, [-1, width]), tf.ones([width], value.dtype))
    subnormal_rows = tf.floor(rows / 4096.0)
    zeros = tf.reduce_sum(rows - 4096.0 * subnormal_rows)
    return tf.cast(zeros, tf.float32), tf.cast(tf.reduce_sum(subnormal_rows), tf.float32)


def worst_over_replicas(stats):
    """The worst replica's figures: smallest headroom, largest fractions."""
    if not _distribute.has_strategy():
        return stats
    gathered = tf.distribute.get_replica_context().all_gather(stats[tf.newaxis], axis=0)
    return tf.stack(
        [
            tf.reduce_min(gathered[:, 0], axis=0),
            tf.reduce_max(gathered[:, 1], axis=0),
            tf.reduce_max(gathered[:, 2], axis=0),
        ]
    )


class GradientStatsRecord(tf.Module):
    """The device-side figures of every variable, and their host-side reader.

    Diagnostics, tracked but not among the optimizer's `variables` (see
    `tfdls.overflow.OverflowRecord`).

    Args:
        variable_names: the paths of the variables the optimizer was built with.
    """

    def __init__(self, variable_names):
        super().__init__(name="gradient_stats_record")
        self.variable_names = tuple(variable_names)
        self.figures = state_variable(
            "gradient_stats", np.full([4, len(self.variable_names)], np.nan, np.float32),
            tf.float32,
        )

    def record(self, is_finite, stats, positions):
        """In-step, branch-free: keeps `stats` (for the variables at `positions`) iff finite."""
        current = tf.convert_to_tensor(self.figures)
        if positions == list(range(len(self.variable_names))):
            new = stats
        else:
            indices = tf.constant(positions, tf.int32, shape=[len(positions), 1])
            new = tf.transpose(
                tf.tensor_scatter_nd_update(tf.transpose(current), indices, tf.transpose(stats))
            )
        self.figures.assign(tf.where(is_finite, new, current))

    def read(self):
        """Host read: ``{variable name: GradientStats}``."""
        figures = self.figures.numpy()
        return {
            name: GradientStats(*(float(x) for x in figures[:, i]))
            for i, name in enumerate(self.variable_names)
        }
