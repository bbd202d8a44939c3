"""What `apply` takes from `scale_loss` in the same traced function, without reading it back.

The rule, in one sentence:

    In a `tf.function`, `apply` takes the scale that the same function's last
    `scale_loss` read, as the live and the recorded scale alike, and the
    gradients as not unscaled, while every operation created in the function
    since that call is either stateless or an operation on the variables it
    takes, and none but a read takes the loss scale's variable, the recorded
    scale or the unscaling flag.

Why it is exact: in a `tf.function` TensorFlow runs the operations on one
variable in program order, so with no write since `scale_loss` each of them
holds what `scale_loss` left there: the scale it read, that scale recorded,
the flag cleared. `apply` then reads nothing the rule (`tfdls._record`,
`tfdls._unscaling`) would have read: 13 operations less in each step of a
`fit`. A write to one of the three takes its handle (a second `apply`,
`get_unscaled_gradients`, the scale's own `update`, an assignment); code the
graph does not show may write anything (a call of a function, a branch or a
loop, `tf.py_function`, a `tf.data` iterator running a dataset's function:
stateful operations that are not operations on the variables they take).
After either, `apply` reads them as before. Only for the
`tfdls.DynamicLossScale` that `scale_loss` read (whose value is its one
variable, read through `_read_scale`), outside any `tf.distribute` strategy
(replicas hold their own copies) and not eagerly (eager code orders nothing
it has not run already, and reads cost it nothing extra).
"""

from __future__ import annotations

import dataclasses
import weakref

import tensorflow as tf

from tfdls import _distribute, _masked_update

# Stateful operations that act on the variables they take and on nothing else: the
# masked update's audit's reads and plain writes (its Identity is not stateful), and
# the scatters and the fused optimizer kernels.
_VARIABLE_OPS = _masked_update._READ_OPS | _masked_update._WRITE_OPS
_VARIABLE_OP_PREFIXES = ("ResourceScatter", "ResourceApply", "ResourceSparseApply")


class CarriedScale:
    """Per traced function, what its last `scale_loss` left (see the module docstring)."""

    def __init__(self):
        # graph -> _Entry. Names, not tensors: a released graph takes its entry along.
        self._by_graph = weakref.WeakKeyDictionary()

    def scaled(self, loss_scale, scale, variables):
        """`scale_loss` read `scale` from `loss_scale` and left `variables` (the scale's,
        the record's, the flag) as the rule says; call after its last write."""
        graph = _function_graph()
        if graph is None:
            return
        handles = _handles(graph, variables)
        if handles is None:
            self._by_graph.pop(graph, None)
            return
        self._by_graph[graph] = _Entry(weakref.ref(loss_scale), scale.name,
                                       frozenset(h.name for h in handles),
                                       len(graph.get_operations()))

    def take(self, loss_scale):
        """`apply` with `loss_scale`: the scale its function's `scale_loss` read, if the rule
        lets it take it without reading (else None)."""
        graph = _function_graph()
        entry = None if graph is None else self._by_graph.get(graph)
        if entry is None or entry.loss_scale() is not loss_scale:
            return None
        for op in graph.get_operations()[entry.operations:]:
            if op.type != "ReadVariableOp" and any(t.name in entry.handles for t in op.inputs):
                return None
            if op.op_def.is_stateful and not (op.type in _VARIABLE_OPS
                                              or op.type.startswith(_VARIABLE_OP_PREFIXES)):
                return None
        return graph.get_tensor_by_name(entry.scale)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """What one `scale_loss` left, in names (a released graph takes its entry along)."""

    loss_scale: weakref.ref  # the loss scale it read, weakly
    scale: str  # the scale it read: a tensor's name
    handles: frozenset  # the three variables' handles as the graph holds them: names
    operations: int  # how many operations the graph held after it


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

