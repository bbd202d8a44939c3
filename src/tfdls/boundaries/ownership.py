"""Ownership: the boundaries an optimizer was given scale, and record each step's factors.

`take_ownership` makes a model's boundaries scale (before, they are
identities) and marks the variables below them; `record_factors` is
`scale_loss`' record of this step's factors; `refuse_boundaries_not_given`
is every `apply`'s check that the gradients crossed no boundary the optimizer
cannot divide out.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdls import _compat
from tfdls.boundaries import readings, registry
from tfdls.boundaries.readings import integer_exponent


def take_ownership(boundary_map) -> None:
    """Makes `boundary_map`'s boundaries scale, and marks each variable below them.

    The mark lets every `LossScaleOptimizer` refuse a variable whose gradient
    an owned boundary multiplies unless it was given that boundary, eagerly
    as well as traced.
    """
    group = readings.Group(boundary_map.boundaries)
    for boundary in boundary_map.boundaries:
        with tf.init_scope():  # now, even inside a trace: a group's members are owned
            # Owned from here: until its owner's first scale_loss records them, the
            # factor in force (before, 0: an identity).
            boundary._ownership.recorded_exponent.assign(boundary.exponent())
        boundary._ownership.group = group
    registry.mark_owned_above(boundary_map)


def record_factors(boundaries) -> None:
    """`scale_loss`: the factors now (`ScaleBoundary.exponent`) become this step's, which
    every backward pass multiplies by and `apply` divides by until the next call."""
    if not boundaries:
        return
    if _compat.in_xla_context():
        # Each from its own variable. XLA hands a value written in the cluster to
        # the reads after it: an element of one vector, read at a constant index,
        # made every boundary's backward pass a kernel of its own, while equal
        # boundaries' own scalar readings compile to one kernel.
        exponents = [boundary.exponent() for boundary in boundaries]
    else:
        exponents = tf.unstack(current_exponents(boundaries), len(boundaries))
    for boundary, exponent in zip(boundaries, exponents):
        boundary._ownership.recorded_exponent.assign(exponent)


def current_exponents(boundaries):
    """The factors now, one vector read: each `log2_factor` read as `ScaleBoundary.exponent`
    reads it, within its layer's bounds."""
    values = tf.stack([b.log2_factor.value for b in boundaries])
    low = np.array([b.min_log2_factor for b in boundaries], np.float32)
    high = np.array([b.max_log2_factor for b in boundaries], np.float32)
    return integer_exponent(values, low, high)




def refuse_boundaries_not_given(grads, variables, known) -> None:
    """Raises where `grads` crossed boundaries outside `known` (the optimizer's own).

    Two rules: a variable below a boundary another optimizer owns (its
    gradient is multiplied by that boundary's factor), and, at trace time, a
    gradient that crossed a boundary not given (owned or not: another
    optimizer could take it after the trace) on a path where no
    `UnscaledInput` divided it out again (as for a GAN generator trained
    through a discriminator with boundaries). Where no boundary was ever
    traced or owned in this process, neither can apply: nothing is walked.
    """
    known_ids = {id(k) for k in known}  # by identity; a lookup, not a scan per boundary

    def unknown(boundaries):
        return sorted({b.name for b in boundaries if id(b) not in known_ids})

    for variable in variables:
        names = unknown(registry.owned_boundaries_above(variable))
        if names:
            path = getattr(variable, "path", None) or variable.name
            raise ValueError(
                f"tfdls: the variable {path!r} is below the scale boundaries {names}, "
                "which another LossScaleOptimizer owns (they multiply its gradient) and "
                "this optimizer was not given, so it cannot divide out their factors. "
                "Give it the model: LossScaleOptimizer(..., scale_boundaries=model), or "
                "optimizer.set_scale_boundaries(model)."
            )
    if tf.executing_eagerly() or not registry.seen.any_crossed():
        return
    names = unknown(registry.seen.crossed_undivided(grads))
    if names:
        raise ValueError(
            f"tfdls: the gradients crossed the scale boundaries {names}, which this "
            "optimizer was not given, so it cannot divide out their factors. Give it "
            "the model: LossScaleOptimizer(..., scale_boundaries=model), or "
            "optimizer.set_scale_boundaries(model) after loading a saved model."
        )

