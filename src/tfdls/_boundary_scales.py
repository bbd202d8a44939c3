"""The scale boundaries' arithmetic inside `LossScaleOptimizer`'s step.

The algorithm is written once, in `tfdls.ScaleBoundary`'s docstring; this
module computes it on the device, branch-free: per block of variables (a
"segment": those directly below one boundary, or above every boundary),
whether a gradient was non-finite and the binary exponent of its largest
element, then every boundary's new exponent and whether the global loss
scale answers the overflow.
"""

from __future__ import annotations

import functools

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


class _Tree:
    """The boundaries' tree as constant arrays, so each step's arithmetic is a few vector ops.

    Index ``count`` is a sentinel: the "boundary" above the top ones, with
    exponent 0, never lowered, never moved.
    """

    def __init__(self, parents, boundaries):
        count = len(boundaries)
        self.count = count
        chains = []
        for k in range(count):
            chain = []
            while k >= 0:
                chain.append(k)
                k = parents[k]
            chains.append(chain)
        self.depth = max((len(c) for c in chains), default=0)
        # Per boundary, the boundaries from it up to the top (nearest first),
        # padded with the sentinel.
        self.chains = np.full([count, max(self.depth, 1)], count, np.int32)
        for k, chain in enumerate(chains):
            self.chains[k, :len(chain)] = chain
        self.parents = np.array([count if p < 0 else p for p in parents] + [count], np.int32)
        self.mins = np.array([b.min_log2_factor for b in boundaries], np.float32)
        self.maxs = np.array([b.max_log2_factor for b in boundaries], np.float32)
        self.margins = np.array([b.margin_bits for b in boundaries], np.float32)
        self.periods = np.array([b.adjust_period for b in boundaries], np.int64)


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

    @functools.cached_property
    def _tree(self):
        return _Tree(self.map.parents, self.boundaries)

    def exponents(self):
        """This step's exponent per boundary (a float32 vector), read once: each
        factor read as `ScaleBoundary.exponent` reads it, all at once."""
        if not self._tree.count:
            return tf.zeros([0])
        return boundaries_lib.current_exponents(self.boundaries)

    def recorded_exponents(self):
        """The exponent per boundary that this step's backward passes multiplied by (a
        float32 vector, recorded by the last `scale_loss`): what the gradients carry."""
        if not self._tree.count:
            return tf.zeros([0])
        return tf.stack([b._ownership.recorded_exponent.value() for b in self.boundaries])

    def totals(self, exponents):
        """Per segment, the exponent sum of the boundaries above it (a float32 vector;
        segment 0, above every boundary, has 0). Sums of small integers: exact."""
        tree = self._tree
        with_sentinel = tf.concat([exponents, [0.0]], 0)
        below = tf.reduce_sum(tf.gather(with_sentinel, tree.chains), axis=1)[:tree.count]
        return tf.concat([[0.0], below], 0)

    def update(self, exponents, totals, is_finite, segment_bad, segment_exponent, iterations):
        """In-step, branch-free: the new exponents, and whether the global scale shrinks.

        Vector operations over all boundaries: a handful to lower on a skipped
        step, a handful per level of nesting to place the factors.

        Args:
            exponents: `exponents()`, the factors now, which the step adapts.
            totals: `totals(recorded_exponents())`, what the gradients carry.
            is_finite: the replica-agreed decision of this step.
            segment_bad: per segment, a bool: a non-finite gradient in it.
            segment_exponent: per segment, the float32 binary exponent of
                the largest element of its scaled gradients (-inf where all
                zero or empty).
            iterations: the optimizer's applied steps before this one.

        Returns:
            global_shrinks: a scalar bool.
        """
        tree = self._tree
        count = tree.count
        if not count:
            return segment_bad[0]
        bad_below = segment_bad[1:]

        # Skipped step: for each bad block, along its chain (nearest first),
        # the first boundary that can go lower does; where none can, the
        # global scale shrinks.
        can = tf.concat([exponents > tree.mins, [False]], 0)
        can_along = tf.gather(can, tree.chains)
        nearer_can = tf.cumsum(tf.cast(can_along, tf.float32), axis=1, exclusive=True)
        first = tf.logical_and(can_along, tf.equal(nearer_can, 0.0))
        hits = tf.cast(tf.logical_and(first, bad_below[:, tf.newaxis]), tf.float32)
        lower = tf.math.unsorted_segment_max(hits, tree.chains, count + 1)[:count] > 0.0
        none_can = tf.logical_not(tf.reduce_any(can_along, axis=1))
        global_shrinks = tf.logical_or(
            segment_bad[0], tf.reduce_any(tf.logical_and(bad_below, none_can)))

        # Finite step: a due boundary whose block and top have a largest
        # element moves its total to its target, placed against its parent's
        # total as it will be (moved or not), within its bounds; the others
        # keep their exponent. After level d, every boundary at depth <= d
        # is placed (the sentinel stays 0: never moves, exponent 0).
        top = segment_exponent[0]
        block = segment_exponent[1:]
        known = tf.logical_and(tf.math.is_finite(block), tf.math.is_finite(top))
        move = tf.floor(tf.where(known, top - block - tree.margins, 0.0))
        due = tf.equal(tf.math.floormod(iterations, tree.periods), 0)
        moves = tf.concat([tf.logical_and(due, known), [False]], 0)
        targets = tf.concat([totals[1:] + move, [0.0]], 0)
        kept = tf.concat([exponents, [0.0]], 0)
        low = np.append(tree.mins, 0.0).astype(np.float32)
        high = np.append(tree.maxs, 0.0).astype(np.float32)
        new_totals = tf.zeros([count + 1])
        for _ in range(tree.depth):
            parent_total = tf.gather(new_totals, tree.parents)
            values = tf.where(moves, tf.clip_by_value(targets - parent_total, low, high), kept)
            new_totals = parent_total + values
        finite_values = values[:count]

        skipped_values = tf.where(lower, exponents - 1.0, exponents)
        new = tf.where(is_finite, finite_values, skipped_values)
        for b, value in zip(self.boundaries, tf.unstack(new, count)):
            b.log2_factor.assign(value)
        self.lowered.assign(tf.where(is_finite, self.lowered, lower))
        return global_shrinks

    def segment_figures(self, counts, largest, positions):
        """Per segment (vectors): any non-finite gradient, and the binary exponent of its
        largest element.

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
        bad = tf.math.unsorted_segment_max(counts, ids, segments) > 0
        found = binary_exponent(tf.math.unsorted_segment_max(largest, ids, segments))
        return bad, found

    def lowered_names(self):
        """Host read: the boundaries lowered on the last skipped step."""
        return tuple(n for n, hit in zip(self.names, self.lowered.numpy()) if hit)
