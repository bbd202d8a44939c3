"""The scale boundaries' arithmetic inside `LossScaleOptimizer`'s step.

The algorithm is written once, in `tfdls.ScaleBoundary`'s docstring; this
module computes it on the device, branch-free: per block of variables (a
"segment": those directly below one boundary, or above every boundary),
whether a gradient was non-finite and the binary exponent of its largest
element, then every boundary's new exponent and whether the global loss
scale answers the overflow.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdls import _distribute
from tfdls import boundaries as boundaries_lib


def binary_exponent(value):
    """floor(log2(value)) of float32 values >= 0 (elementwise), from the bits, as float32; -inf for 0 and below.

    Exact, so replicas and reruns agree bit for bit (a float32 log2 is not).
    Subnormals read as -127.
    """
    bits = tf.bitcast(tf.cast(value, tf.float32), tf.int32)
    exponent = tf.cast(tf.bitwise.right_shift(bits, 23), tf.float32) - 127.0
    return tf.where(bits > 0, exponent, tf.fill(tf.shape(exponent), -float("inf")))


class BoundaryScales(tf.Module):
    """The per-step arithmetic of a model's boundaries, for one optimizer.

    Made by `LossScaleOptimizer.build` from a `BoundaryMap` and the variables
    it was built with; keeps a record of the boundaries lowered on the last
    skipped step (diagnostics, like `tfdls.overflow.OverflowRecord`).

    Args:
        boundary_map: the model's `BoundaryMap`.
        variables: the variables the optimizer was built with.
    """

    def __init__(self, boundary_map, variables):
        super().__init__(name="scale_boundaries")
        self.map = boundary_map
        self.boundaries = boundary_map.boundaries
        self.lowered = _distribute.state_variable(
            "lowered_on_last_overflow", np.zeros([len(self.boundaries)], np.bool_), tf.bool
        )
        # Segments: 0 above every boundary, 1 + k directly below boundary k.
        self.positions_of_segment = [[] for _ in range(len(self.boundaries) + 1)]
        self.segment_of = []
        for position, variable in enumerate(variables):
            chain = boundary_map.chain_of(variable)
            if chain is None:
                raise ValueError(
                    f"tfdls: the variable {getattr(variable, 'path', variable.name)!r} is not "
                    "in the model given as scale_boundaries, so tfdls does not know which "
                    "boundaries its gradient crossed. Give the optimizer the model that "
                    "holds every variable it updates."
                )
            boundaries_lib.check_float64_chain(
                f"the variable {getattr(variable, 'path', variable.name)!r}", variable.dtype,
                chain)
            segment = 0 if not chain else 1 + chain[0]
            self.segment_of.append(segment)
            self.positions_of_segment[segment].append(position)
        self.names = [b.name for b in self.boundaries]

    def chain(self, boundary):
        """Boundary indices from `boundary` up to the top."""
        found = []
        while boundary >= 0:
            found.append(boundary)
            boundary = self.map.parents[boundary]
        return found

    def exponents(self):
        """This step's exponent per boundary (float32 scalars), read once."""
        return [b.exponent() for b in self.boundaries]

    def totals(self, exponents):
        """Per segment, the exponent sum of the boundaries above it (float32 scalars)."""
        totals = [tf.constant(0.0)]
        for k in range(len(self.boundaries)):
            totals.append(tf.add_n([exponents[i] for i in self.chain(k)]))
        return totals

    def update(self, exponents, is_finite, segment_bad, segment_exponent, iterations):
        """In-step, branch-free: the new exponents, and whether the global scale shrinks.

        Args:
            exponents: `exponents()`, read before the gradients were divided.
            is_finite: the replica-agreed decision of this step.
            segment_bad: per segment, a bool: a non-finite gradient in it.
            segment_exponent: per segment, the float32 binary exponent of
                the largest element of its scaled gradients (-inf where all
                zero or empty).
            iterations: the optimizer's applied steps before this one.

        Returns:
            global_shrinks: a scalar bool.
        """
        count = len(self.boundaries)
        lower = [tf.constant(False)] * count
        global_shrinks = segment_bad[0]
        for segment in range(1, count + 1):
            still = segment_bad[segment]
            for k in self.chain(segment - 1):
                can = exponents[k] > self.boundaries[k].min_log2_factor
                lower[k] = tf.logical_or(lower[k], tf.logical_and(still, can))
                still = tf.logical_and(still, tf.logical_not(can))
            global_shrinks = tf.logical_or(global_shrinks, still)

        totals = self.totals(exponents)
        top = segment_exponent[0]
        # Totals after this step, parents first: a boundary not due this step
        # keeps its exponent, and a due one is placed against its parent's
        # total as it will be (moved or not), not as it would be if moved.
        new_totals = {-1: tf.constant(0.0)}
        finite_values = [None] * count
        for k in range(count):
            b = self.boundaries[k]
            parent_total = new_totals[self.map.parents[k]]
            exponent = segment_exponent[k + 1]
            known = tf.logical_and(tf.math.is_finite(exponent), tf.math.is_finite(top))
            move = tf.floor(tf.where(known, top - exponent - b.margin_bits, 0.0))
            target = tf.where(known, totals[k + 1] + move, parent_total + exponents[k])
            adjusted = tf.clip_by_value(
                target - parent_total, float(b.min_log2_factor), float(b.max_log2_factor)
            )
            due = tf.equal(tf.math.floormod(iterations, b.adjust_period), 0)
            finite_values[k] = tf.where(due, adjusted, exponents[k])
            new_totals[k] = parent_total + finite_values[k]

        for k, b in enumerate(self.boundaries):
            skipped_value = tf.where(lower[k], exponents[k] - 1.0, exponents[k])
            b.log2_factor.assign(tf.where(is_finite, finite_values[k], skipped_value))
        if count:
            self.lowered.assign(tf.where(is_finite, self.lowered, tf.stack(lower)))
        return global_shrinks

    def segment_figures(self, counts, largest, positions):
        """Per segment: any non-finite gradient, and the binary exponent of its largest element.

        Args:
            counts: per present gradient, its replica-agreed non-finite count.
            largest: per present gradient, its largest scaled magnitude
                (float32), the same on every replica.
            positions: per present gradient, its variable's index.
        """
        segments = len(self.positions_of_segment)
        ids = tf.constant([self.segment_of[p] for p in positions], tf.int32)
        # One reduction each over all segments (an empty segment gets the
        # dtype's lowest value: not bad, and no largest element).
        bad = tf.unstack(tf.math.unsorted_segment_max(counts, ids, segments) > 0, segments)
        found = tf.unstack(
            binary_exponent(tf.math.unsorted_segment_max(largest, ids, segments)), segments
        )
        return bad, found

    def lowered_names(self):
        """Host read: the boundaries lowered on the last skipped step."""
        return tuple(n for n, hit in zip(self.names, self.lowered.numpy()) if hit)
