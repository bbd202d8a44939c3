"""What multiplied a step's gradients: the scale `apply` divides by, recorded, not re-read.

The rule, in one sentence:

    `apply` divides by the scale that the last `scale_loss` (or
    `get_scaled_loss`) multiplied by, unless one of the variables it is given
    was already updated by this optimizer since that call; then (a loss
    multiplied by `loss_scale()` by hand, which tfdls cannot see) by the
    scale as it is now. (`get_unscaled_gradients` without its variables:
    the recorded scale while any variable of the optimizer has not been
    updated since that call; traced before the optimizer is built, only where
    a `scale_loss` runs before it whenever it runs, else it raises:
    `_check_unbuilt_answer_holds`.)

`apply` changes the scale (one step of its state machine per `apply`), so the
live scale is not what multiplied gradients that a second `apply` of the same
step receives (the variables split between two calls, two optimizers on one
loss). The record is three variables, written by `scale_loss` and by `apply`
when the step runs, not when it is traced: the same rule in eager code,
`tf.function`s, XLA, loops and across functions, with no branch and no host
read. Scale boundaries' factors are recorded by `scale_loss` too, and every
backward pass of the step multiplies by them (`tfdls.boundaries.record_factors`).
In a `tf.function` whose `scale_loss` left the record as it wrote it, `apply`
takes that call's scale without reading the record back (`tfdls._carried_scale`).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from tfdls import _compat
from tfdls._distribute import state_variable


class ScaleRecord(tf.Module):
    """The recorded scale and, per variable, whether it may divide that variable's gradient.

    Args:
        name: the module name.
    """

    def __init__(self, name="scale_record"):
        super().__init__(name=name)
        with self.name_scope:
            self.scale = state_variable("recorded_scale", 1.0, tf.float32)
            # How many scale_loss calls recorded a scale; per variable, the
            # count when it was last given to apply (made by `build`).
            self.records = state_variable("records", 0, tf.int64)
        self.applied_at = None
        # The graphs (functions being traced, TF1 graphs) whose every run runs a
        # `record`: see `_check_unbuilt_answer_holds`.
        self._recorded_in = weakref.WeakSet()

    def build(self, count):
        """Makes the per-variable state for an optimizer of `count` variables."""
        with self.name_scope:
            self.applied_at = state_variable("applied_at", np.zeros([count], np.int64), tf.int64)

    def record(self, scale):
        """`scale_loss`: `scale` multiplies this step's loss."""
        self.scale.assign(scale)
        self.records.assign_add(1)
        if not tf.executing_eagerly():
            self._recorded_in.update(_graphs_that_run_it(tf.compat.v1.get_default_graph()))

    def scale_for(self, live_scale, positions=None):
        """The scale the gradients of the variables at `positions` (all, if None) were
        multiplied by, as the rule says: the recorded one, or `live_scale`."""
        return self._scale_for(tf.convert_to_tensor(self.records), live_scale, positions)

    def take(self, live_scale, positions):
        """`apply`: `scale_for(live_scale, positions)`, and the variables at `positions`
        are marked as given to `apply` (as of the same read of the record count)."""
        records = tf.convert_to_tensor(self.records)
        scale = self._scale_for(records, live_scale, positions)
        self._mark_applied(positions, records)
        return scale

    def mark_applied(self, positions):
        """`apply`, knowing its scale without `take` (`tfdls._carried_scale`): the variables
        at `positions` are marked as given to `apply`."""
        self._mark_applied(positions, tf.convert_to_tensor(self.records))

    def _mark_applied(self, positions, records):
        if self._all(positions):
            self.applied_at.assign(tf.fill(self.applied_at.shape, records))
        else:
            mask = np.zeros(self.applied_at.shape, np.bool_)
            mask[list(positions)] = True
            self.applied_at.assign(tf.where(mask, records, self.applied_at))

    def _scale_for(self, records, live_scale, positions):
        if self.applied_at is None:  # not built: nothing applied yet
            self._check_unbuilt_answer_holds()
            fresh = records > 0
        else:
            applied_at = tf.convert_to_tensor(self.applied_at)
            if positions is None:
                # Gradients of unknown variables (`get_unscaled_gradients`
                # without them): recorded while any variable awaits its update.
                fresh = tf.reduce_any(applied_at < records)
            else:
                if not self._all(positions):
                    applied_at = tf.gather(applied_at, tf.constant(positions, tf.int32))
                fresh = tf.reduce_all(applied_at < records)
        return tf.where(fresh, tf.convert_to_tensor(self.scale), live_scale)

    def _check_unbuilt_answer_holds(self):
        """Raises where "nothing applied since the record" would be a guess.

        Unbuilt, no `apply` has run or been traced (it builds first). Eagerly that is
        the answer. A graph (a function being traced) runs later, maybe after applies
        it does not contain, and keeps what it read now: the answer holds only where a
        record runs before this read whenever the read runs, with no apply between
        (one would have built the optimizer): this graph recorded before it (its own
        `scale_loss`, or a `tf.function` it called that did), or the graph around a
        `tf.cond` branch did. Else it raises rather than guess (an earlier `scale_loss`
        and later applies made it divide by a stale recorded scale). A loop body or a
        nested `tf.function` that reads is not covered by a record around it: it may
        run again (a later iteration, a later call) after an apply.
        """
        if tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        while graph not in self._recorded_in and _compat.is_cond_branch(graph):
            graph = graph.outer_graph
        if graph in self._recorded_in:
            return
        raise ValueError(
            "tfdls: get_unscaled_gradients() is traced before this optimizer is built, in "
            f"a graph ({getattr(graph, 'name', graph)!r}) where no scale_loss() or "
            "get_scaled_loss() of it runs before: which scale multiplied these gradients "
            "depends on apply() calls that may run between them, which this trace cannot "
            "see. Build the optimizer first (optimizer.build(model.trainable_variables)), "
            "or call get_scaled_loss() earlier in the same function (not outside a loop "
            "or a nested tf.function that calls get_unscaled_gradients)."
        )

    def _all(self, positions):
        return sorted(positions) == list(range(self.applied_at.shape[0]))


def _graphs_that_run_it(graph):
    """`graph`, and each graph around it whose every run runs it: a `tf.function`'s graph
    is called where it was traced, as a whole; a `tf.cond` branch or a loop body may not
    run (or run again), so the graph around it is not included."""
    graphs = [graph]
    while (getattr(graph, "building_function", False) and not _compat.is_control_flow(graph)
           and getattr(graph, "outer_graph", None) is not None):
        graph = graph.outer_graph
        graphs.append(graph)
    return graphs
