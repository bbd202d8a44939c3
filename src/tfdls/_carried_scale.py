"""What `apply` takes from `scale_loss` in the same traced function, without reading it back.

The rule, in one sentence:

    In a `tf.function`, `apply` takes the scale that the same function's last
    `scale_loss` read, as the live and the recorded scale alike, and the
    gradients as not unscaled, while the function holds no operation, created
    after that call, that takes the loss scale's variable, the recorded scale
    or the unscaling flag other than to read it.

Why it is exact: in a `tf.function` TensorFlow runs the operations on one
variable in program order, so with no write since `scale_loss` each of them
holds what `scale_loss` left there: the scale it read, that scale recorded,
the flag cleared. `apply` then reads nothing the rule (`tfdls._record`,
`tfdls._unscaling`) would have read: that is 13 operations less in each step of
a `fit`. Anything that may write one of the three (a second `apply`,
`get_unscaled_gradients`, the scale's own `update`, an assignment, or a call
of a function, a branch or a loop that captured one of them) takes its
variable handle as an input, so the next `apply` of the function reads them
as before. Only for `tfdls.DynamicLossScale` itself (whose value is its one
variable, read through `_read_scale`), outside any `tf.distribute` strategy
(replicas hold their own copies) and not eagerly (eager code orders nothing
it has not run already, and reads cost it nothing extra).
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tfdls import _distribute


class CarriedScale:
    """Per traced function, what its last `scale_loss` left (see the module docstring)."""

    def __init__(self):
        # graph -> (the scale's tensor name, {handle tensor name: writes seen}).
        # Names, not tensors: a released graph takes its entry along.
        self._by_graph = weakref.WeakKeyDictionary()

    def scaled(self, scale, variables):
        """`scale_loss` read `scale` and left `variables` (the scale's, the record's, the
        flag) as the rule says; call after its last write."""
        graph = _function_graph()
        if graph is None:
            return
        handles = _handles(graph, variables)
        if handles is None:
            self._by_graph.pop(graph, None)
            return
        self._by_graph[graph] = (scale.name, {h.name: _writes(h) for h in handles})

    def take(self):
        """`apply`: the scale its function's `scale_loss` read, if the rule lets it take
        it without reading (else None)."""
        graph = _function_graph()
        entry = None if graph is None else self._by_graph.get(graph)
        if entry is None:
            return None
        scale_name, writes = entry
        for name, seen in writes.items():
            if _writes(graph.get_tensor_by_name(name)) != seen:
                return None
        return graph.get_tensor_by_name(scale_name)


def _function_graph():
    """The `tf.function` graph being traced, where the rule may hold; else None."""
    if tf.executing_eagerly() or _distribute.under_any_strategy():
        return None
    graph = tf.compat.v1.get_default_graph()
    return graph if getattr(graph, "building_function", False) else None


def _handles(graph, variables):
    """The variables' handles as `graph` holds them (captured), or None if any is not."""
    captured = {id(external): internal for external, internal in graph.captures}
    handles = [captured.get(id(v.handle)) for v in variables]
    return None if any(h is None for h in handles) else handles


def _writes(handle):
    """How many operations take `handle` other than to read it."""
    return sum(op.type != "ReadVariableOp" for op in handle.consumers())
