"""The plug-in: the scale boundaries' part of `LossScaleOptimizer`'s step.

The algorithm is written once, in `tfdls.ScaleBoundary`'s docstring; this
module computes it on the device, branch-free: per block of variables (a
"segment": those directly below one boundary, or above every boundary),
whether a gradient was non-finite and the binary exponent of its largest
element, then every boundary's new exponent and whether the global loss
scale answers the overflow.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import tensorflow as tf

from tfdls import _compat, _distribute, _division, finite
from tfdls.finite import accelerator_visible
from tfdls.boundaries import layers, ownership, registry


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
        # Row k selects k's parent (the sentinel's is itself): `update` reads the
        # parents' totals as a reduction over a row, not a gather (see there).
        self.is_parent = self.parents[:, np.newaxis] == np.arange(count + 1)[np.newaxis, :]
        self.mins = np.array([b.min_log2_factor for b in boundaries], np.float32)
        self.maxs = np.array([b.max_log2_factor for b in boundaries], np.float32)
        self.margins = np.array([b.margin_bits for b in boundaries], np.float32)
        self.periods = np.array([b.adjust_period for b in boundaries], np.int64)


# Nesting levels placed by unrolled operations; deeper chains place theirs in a
# tf.while_loop (see `BoundaryScales.update`). Unrolled, a level is three ops
# and no loop frame: shallow trees keep the form they always had, whose
# compile was never the cost (the loop was measured only at 100 levels).
UNROLLED_LEVELS = 16


class BoundaryScales(tf.Module):
    """The per-step arithmetic of a model's boundaries, for one optimizer.

    The one object through which per-layer scales plug into
    `LossScaleOptimizer` (None there without boundaries): made by
    `set_scale_boundaries` from the model's `BoundaryMap`, built with the
    optimizer's variables; `begin_step` serves one step (`BoundaryStep`),
    `divisors` / `unscale` serve `get_unscaled_gradients`, `check_given` the
    gradients given. Keeps a record of the boundaries lowered on the last
    skipped step (diagnostics, like `tfdls.overflow.OverflowRecord`).

    Args:
        boundary_map: the model's `BoundaryMap`.
    """

    def __init__(self, boundary_map):
        super().__init__(name="scale_boundaries")
        self.map = boundary_map
        self.boundaries = boundary_map.boundaries
        self.names = [b.name for b in self.boundaries]
        self.built = False

    def build(self, variables):
        """Places the optimizer's variables (in its order) below their boundaries; raises
        (naming the variable) before keeping anything for a variable outside the model."""
        positions_of_segment = [[] for _ in range(len(self.boundaries) + 1)]
        segment_of = []
        for position, variable in enumerate(variables):
            chain = self.map.chain_of(variable)
            if chain is None:
                raise ValueError(
                    f"tfdls: the variable {getattr(variable, 'path', variable.name)!r} is not "
                    "in the model given as scale_boundaries, so tfdls does not know which "
                    "boundaries its gradient crossed. Give the optimizer the model that "
                    "holds every variable it updates."
                )
            layers.check_float64_chain(
                f"the variable {getattr(variable, 'path', variable.name)!r}", variable.dtype,
                chain)
            segment = 0 if not chain else 1 + chain[0]
            segment_of.append(segment)
            positions_of_segment[segment].append(position)
        self.lowered = _distribute.state_variable(
            "lowered_on_last_overflow", np.zeros([len(self.boundaries)], np.bool_), tf.bool
        )
        # Segments: 0 above every boundary, 1 + k directly below boundary k.
        self.positions_of_segment = positions_of_segment
        self.segment_of = segment_of
        self.built = True

    @functools.cached_property
    def _tree(self):
        return _Tree(self.map.parents, self.boundaries)

    def exponents(self):
        """This step's exponent per boundary (a float32 vector), read once: each
        factor read as `ScaleBoundary.exponent` reads it, all at once."""
        if not self._tree.count:
            return tf.zeros([0])
        return ownership.current_exponents(self.boundaries)

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
        """In-step, branch-free: writes the new exponents (`adapted`, then `write`); returns
        whether the global scale shrinks."""
        new, lowered, global_shrinks = self.adapted(exponents, totals, is_finite, segment_bad,
                                                    segment_exponent, iterations)
        self.write(new, lowered)
        return global_shrinks

    def write(self, new, lowered):
        """Writes each boundary's new exponent (a float32 vector) and the record of the
        boundaries lowered on the last skipped step (a bool vector)."""
        if not self.boundaries:
            return
        for b, value in zip(self.boundaries, elements(new, len(self.boundaries))):
            b.log2_factor.assign(value)
        self.lowered.assign(lowered)

    def adapted(self, exponents, totals, is_finite, segment_bad, segment_exponent, iterations):
        """In-step, branch-free: the new exponents, the new record of the boundaries lowered,
        and whether the global scale shrinks; writes nothing.

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
            new: per boundary, its new exponent (float32).
            lowered: per boundary, whether the last skipped step (this one, if
                skipped) lowered it.
            global_shrinks: a scalar bool.
        """
        tree = self._tree
        count = tree.count
        if not count:
            return tf.zeros([0]), tf.zeros([0], tf.bool), segment_bad[0]
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
        # One constant for all levels: a numpy bool array converts element by
        # element (TensorFlow has no fast path for bool), so converting the
        # (count + 1)**2 mask at every level cost count**3 at trace time.
        is_parent = tf.constant(tree.is_parent)

        def place_level(new_totals, _):
            # The parents' totals: per row, the largest of the one selected element
            # and -inf, that is the parent's total bit for bit (totals are finite),
            # as a gather would read it. Not a gather: XLA fuses unrolled levels
            # into one loop fusion, a chain of gathers where each level uses its
            # parent's total twice; the HLO stays linear, but the fusion emitter's
            # time and memory about doubled with each level of nesting (16 nested
            # boundaries compiled in seconds, 20 in minutes and 4 GB). A reduction
            # ends a fusion: one small fusion per level.
            parent_total = tf.reduce_max(
                tf.where(is_parent, new_totals[tf.newaxis, :], -np.inf), axis=1)
            values = tf.where(moves, tf.clip_by_value(targets - parent_total, low, high), kept)
            return parent_total + values, values

        levels = (tf.zeros([count + 1]), tf.zeros([count + 1]))
        if tree.depth <= UNROLLED_LEVELS:
            for _ in range(tree.depth):
                levels = place_level(*levels)
        else:
            # Deeper, one loop: the same arithmetic per level, traced and compiled
            # once instead of once per level (at 100 nested boundaries the unrolled
            # levels were about 300 of the compiled apply's fusions).
            levels = tf.while_loop(lambda *_: True, place_level, levels,
                                   maximum_iterations=tree.depth)
        _, values = levels
        finite_values = values[:count]

        skipped_values = tf.where(lower, exponents - 1.0, exponents)
        new = tf.where(is_finite, finite_values, skipped_values)
        return new, tf.where(is_finite, self.lowered, lower), global_shrinks

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

    # -- the plug-in: what a step asks of the boundaries -------------------------------

    @functools.cached_property
    def max_exponent(self):
        """A static bound of |log2(loss scale * boundary factors)|."""
        depth = len(self.boundaries)
        bound = max(abs(layers.MIN_LOG2_FACTOR), layers.MAX_LOG2_FACTOR)
        return 128 + bound * depth

    def divisors(self, divisor, already_unscaled, positions, totals=None, dtypes=(), in_xla=None):
        """Per position: None (no boundary above it), or ``(exponent, pieces, reciprocal)``
        to divide its gradient by with `divide`; and per segment below a boundary, as
        vectors, ``(exponents, pieces)`` (None without such segments).

        The divisor of a variable below boundaries is ``2**(log2(divisor) + T)``,
        T the sum of the exponents of the boundaries above it; 1 where the
        gradients are already unscaled. Computed once per segment, as vectors:
        inside XLA, `pieces` maps an exponent bound (`_division.exponent_bound`
        of each of `dtypes`, the gradients' dtypes) to the
        `_division.reciprocal_pieces_for` that bound (None outside XLA);
        outside XLA, `reciprocal` is `_division.reciprocal_float64` of the
        exponent (None inside). `in_xla`: whether the gradients are divided inside
        XLA (default: whether this trace is).
        """
        if totals is None:
            totals = self.totals(self.recorded_exponents())
        segments = len(self.boundaries)
        if not segments:
            return [None] * len(positions), None
        exponents = _division.exponent_of(divisor) + tf.cast(totals[1:], tf.int32)
        exponents = tf.where(already_unscaled, tf.zeros_like(exponents), exponents)
        # Computed once: every gradient's division reads a segment of these.
        exponents, = _compat.computed_once(exponents)
        # Inside this trace's own XLA cluster (whole-step XLA), not before a compiled
        # apply's (whose cluster takes each segment's pieces as arguments).
        in_cluster = _compat.in_xla_context()
        if in_xla is None:
            in_xla = in_cluster
        # Outside XLA, one float64 power of two per segment, not one per gradient.
        reciprocals = ([None] * segments if in_xla
                       else tf.unstack(_division.reciprocal_float64(exponents), segments))
        by_segment = [(e, {}, r) for e, r in zip(tf.unstack(exponents, segments), reciprocals)]
        pieces = None
        if in_xla:
            pieces = {}
            for dtype in dtypes:
                bound = _division.exponent_bound(dtype, self.max_exponent)
                if bound not in pieces:
                    # [segments, pieces], computed once (`_compat.computed_once`).
                    stacked, = _compat.computed_once(tf.stack(_division.reciprocal_pieces_for(
                        dtype, exponents, self.max_exponent), axis=1))
                    pieces[bound] = tf.unstack(stacked, axis=1)
                    if in_cluster:
                        # Each segment's row read at an index XLA takes as an argument
                        # (see `elements`): every update below a boundary reads its pieces
                        # alike, so the updates of equal layers compile to one kernel.
                        # Without such indices, the rows' own division ends their fusions.
                        rows = (_gathered(stacked, segments)
                                or _rows_of_reciprocals(dtype, exponents, self.max_exponent))
                        for (_, by_bound, _), row in zip(by_segment, rows):
                            by_bound[bound] = tf.unstack(row)
                        continue
                    # Per piece, its segments' values: a few unstacks, not one per segment.
                    per_piece = [tf.unstack(p, segments) for p in pieces[bound]]
                    for k, (_, by_bound, _) in enumerate(by_segment):
                        by_bound[bound] = [p[k] for p in per_piece]
        per_position = [None if self.segment_of[p] == 0 else by_segment[self.segment_of[p] - 1]
                        for p in positions]
        return per_position, (exponents, pieces)

    def divide(self, grad, divisor):
        """`grad` divided by `divisor` (one of `divisors`), recorded as divided: a gradient
        that depends on it (a joint clip by global norm) carries no factor of these
        boundaries."""
        exponent, pieces, reciprocal = divisor
        # Pieces for this dtype's bound, if `divisors` made them; else made here.
        bound = _division.exponent_bound(_division.dtype_of(grad), self.max_exponent)
        pieces = pieces.get(bound)
        divided = _division.divide_by_power_of_two(grad, exponent, self.max_exponent, pieces,
                                                   reciprocal)
        for tensor in registry.tensors_of(divided):
            registry.seen.add(tensor, self.boundaries, divides=True)
        return divided

    def unscale(self, grads, positions, scale, how):
        """`get_unscaled_gradients`: each gradient divided by the scale times its factors."""
        divisors, _ = self.divisors(scale, tf.constant(False), positions,
                                    dtypes=_dtypes_of(grads))
        return [None if g is None
                else _division.divide(g, scale, how) if d is None
                else self.divide(g, d)
                for g, d in zip(grads, divisors)]

    def check_given(self):
        """Refuses a step whose model added a loss below a boundary (read at trace time)."""
        for layer, boundary in self.map.layers_with_losses():
            raise ValueError(
                f"tfdls: the layer {layer.name!r} is below the scale boundary "
                f"{boundary.name!r} "
                "and its last call added a loss (add_loss, or a regularizer of a layer "
                "inside it): that term reaches its variables without crossing the "
                "boundary, so their gradients would mix two scales. Add the term in a "
                "layer above every boundary, or move the boundary below this layer."
            )

    def begin_step(self, division, positions, iterations, grads, cluster=False):
        """This step's part of the boundaries (`BoundaryStep`), for `grads`, the gradients
        of the variables at `positions`; `cluster`: see `BoundaryStep`."""
        return BoundaryStep(self, division, positions, iterations, _dtypes_of(grads), cluster)


class BoundaryStep:
    """The boundaries' part of one `LossScaleOptimizer` step (see `tfdls._step`).

    Reads the factors now (the adaptation starts from these) and the totals
    the backward pass multiplied the gradients by (recorded by `scale_loss`),
    then answers the step's questions: each gradient's divisor, the check
    (each gradient divided by its own divisor, once, through its largest
    magnitude), the adaptation, and the factors for gradient statistics.

    With `cluster`, it is made before the XLA cluster of a compiled apply
    (`tfdls._step.run_compiled`), where the rest of the step runs: the
    divisors are made for XLA, and `adapt` leaves its writes to the caller
    (`written`, for `BoundaryScales.write` after the cluster).
    """

    def __init__(self, scales, division, positions, iterations, dtypes, cluster=False):
        self.scales = scales
        self.division = division
        self.iterations = iterations
        self.cluster = cluster
        self.written = None  # with `cluster`: the new state `adapt` computed
        self.exponents = scales.exponents()
        self.totals = scales.totals(scales.recorded_exponents())
        self.per_position, self.segment_divisors = scales.divisors(
            division.divisor, division.already_unscaled, positions, self.totals, dtypes,
            in_xla=True if cluster else None)
        self.segments = [scales.segment_of[p] for p in positions]

    def divisor_of(self, i):
        """The divisor of gradient `i` (None: above every boundary, divided by the scale)."""
        return self.per_position[i]

    def divide(self, grad, i):
        return self.scales.divide(grad, self.per_position[i])

    def factor_of(self, i):
        """The boundaries' factor gradient `i` carries (None above every boundary)."""
        segment = self.segments[i]
        return tf.pow(2.0, self.totals[segment]) if segment else None

    def check(self, grads, present, divides):
        """Per present gradient: how many replicas saw a non-finite gradient *after* its
        division, and its largest scaled magnitude (float32), both the same on every replica.

        A boundary's factor may be below 1 (a negative exponent, or a loss scale
        below 1), so a finite gradient can overflow when divided. Dividing is
        monotonic in magnitude, so the quotient of the largest magnitude
        (`finite.largest_magnitudes`, +inf for NaN/Inf) by the gradient's own
        divisor is finite exactly when every element's is: one reading of
        each gradient answers both the check and the adaptation. The
        quotients are computed per kind of division and vector of largest
        magnitudes (`finite.largest_magnitude_parts`: one per dtype, and
        inside XLA per shape of small gradients) as vectors (elementwise, the same
        arithmetic as each gradient's), so a step costs a few operations,
        not a few per gradient.
        """
        values = finite.gradient_values([grads[i] for i in present])
        bad, magnitudes, order = [], [], []
        for members, largest in finite.largest_magnitude_parts(values):
            kinds = ["value" if not divides[present[k]]
                     else "scale" if self.per_position[present[k]] is None else "boundaries"
                     for k in members]
            for kind in dict.fromkeys(kinds):
                chosen = [j for j, x in enumerate(kinds) if x == kind]
                stacked = (largest if len(chosen) == len(members)
                           else tf.gather(largest, tf.constant(chosen, tf.int32)))
                chosen = [members[j] for j in chosen]
                if kind == "value":
                    quotient = self.division.as_value(stacked)
                elif kind == "scale":
                    quotient = self.division.by_scale(stacked)
                else:
                    quotient = _division.divide_by_power_of_two(
                        stacked, *self._gather_divisors([self.segments[present[k]] - 1
                                                         for k in chosen], stacked.dtype))
                bad.append(tf.logical_not(tf.math.is_finite(quotient)))
                magnitudes.append(tf.cast(stacked, tf.float32))
                order += chosen
        bad, magnitudes = tf.concat(bad, 0), tf.concat(magnitudes, 0)
        if order != sorted(order):  # back to the order of `present`
            inverse = np.argsort(order).astype(np.int32)
            bad, magnitudes = tf.gather(bad, inverse), tf.gather(magnitudes, inverse)
        counts = _distribute.sum_over_replicas(tf.cast(bad, tf.float32))
        return counts, _distribute.max_over_replicas(magnitudes)

    def _gather_divisors(self, indices, dtype):
        """``(exponent, max_exponent, pieces)`` of segments `indices` (1 below boundary 0),
        as vectors: elementwise what each `dtype` gradient of those segments is divided by."""
        exponents, pieces = self.segment_divisors
        indices = tf.constant(indices, tf.int32)
        pieces = (pieces or {}).get(_division.exponent_bound(dtype, self.scales.max_exponent))
        return (tf.gather(exponents, indices), self.scales.max_exponent,
                None if pieces is None else [tf.gather(p, indices) for p in pieces])

    def adapt(self, is_finite, counts, largest, positions):
        """The boundaries' step (`BoundaryScales.update`); returns whether the loss scale
        answers this step's overflow (no boundary below could go lower)."""
        scales = self.scales
        bad, largest_exponents = scales.segment_figures(counts, largest, positions)
        # Gradients given already unscaled: their scaled values are larger by
        # 2**(log2(scale) + T).
        scale_bits = tf.cast(_division.exponent_of(self.division.scale), tf.float32)
        largest_exponents = largest_exponents + tf.where(
            self.division.already_unscaled, scale_bits + self.totals, 0.0)
        arguments = (self.exponents, self.totals, is_finite, bad, largest_exponents,
                     self.iterations)
        if not self.cluster:
            return scales.update(*arguments)
        new, lowered, global_shrinks = scales.adapted(*arguments)
        self.written = (new, lowered)  # written after the cluster
        return global_shrinks


def _rows_of_reciprocals(dtype, exponents, max_exponent):
    """Per segment, the `_division.reciprocal_pieces_for` `dtype` of its exponent, as a
    vector: each row the reciprocals of its powers of two, divided in the row's own operation.

    Inside the XLA cluster of a whole step, where `elements` has no argument indices (an
    accelerator is visible). XLA copies a cheap producer, such
    as an element of a vector read at a constant index, into each fusion that
    reads it, so every gradient update below a boundary compiled to a kernel
    of its own (at 100 boundaries, 202 of the first `fit`'s 364 kernels); it
    does not copy a division into a fusion that reads each element many
    times. The row's division ends its fusion there, and the updates, which
    read the same constant indices of their rows, compile once per shape.
    Exact, whatever the division's last bits: each power is a normal float32
    ``2**j``, |j| <= 126, whose reciprocal ``2**-j`` is one too, and the
    quotient is rounded to the nearest power of two from its bits
    (`_division.nearest_power_of_two`), the value `reciprocal_pieces` builds.
    """
    powers = tf.stack(_division.reciprocal_pieces_for(dtype, -exponents, max_exponent), axis=1)
    return [_division.nearest_power_of_two(1.0 / row) for row in tf.unstack(powers)]


def elements(vector, count):
    """`tf.unstack(vector, count)`; inside XLA on a machine without accelerators, each
    element read at an index that the computation takes as an argument (a captured
    constant), not at a constant one.

    XLA compiles a kernel per distinct fusion, and an element read at a
    constant index makes each element's fusion distinct: at 100 boundaries a
    kernel per factor written and one per segment's divisor, about 1.7 MB
    each on the CPU backend. Read at an argument, the elements' equal fusions
    compile once. The values are the same either way. Where a GPU or TPU is
    visible, the step may run there, and each captured index (an eager tensor
    on the host) would be copied to it on every call: there the elements are
    unstacked, as before (unmeasured on a GPU; its backend compiles kernels
    into one module).
    """
    if not _compat.in_xla_context():
        return tf.unstack(vector, count)
    return _gathered(vector, count) or tf.unstack(vector, count)


def _gathered(vector, count):
    """The `count` elements of `vector`, each gathered at its argument index; None where
    there are no such indices (`_index_arguments`)."""
    indices = _index_arguments(count)
    return None if indices is None else [tf.gather(vector, k) for k in indices]


_INDEX_ARGUMENTS = []  # eager int32 scalars 0, 1, ...: captured, so arguments
_INDEX_LOCK = threading.Lock()


def _index_arguments(count):
    """Eager constants 0 .. count - 1 on the host; None where there is no eager context to
    make them (a TF1 graph) or an accelerator is visible (see `elements`)."""
    with tf.init_scope(), _INDEX_LOCK:
        if not tf.executing_eagerly() or accelerator_visible():
            return None
        while len(_INDEX_ARGUMENTS) < count:
            _INDEX_ARGUMENTS.append(tf.constant(len(_INDEX_ARGUMENTS), tf.int32))
        return _INDEX_ARGUMENTS[:count]


def _dtypes_of(grads):
    """The distinct dtypes `grads` are divided in (None entries left out), in order."""
    dtypes = []
    for dtype in (_division.dtype_of(g) for g in grads if g is not None):
        if dtype not in dtypes:
            dtypes.append(dtype)
    return dtypes
