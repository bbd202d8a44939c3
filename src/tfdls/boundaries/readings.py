"""Reading the scale boundaries' factors in the backward pass: once per group, where exact.

A boundary's factor is ``2**e``, ``e`` its recorded exponent: 0 until an
optimizer owns the boundary, then what its owner's last `scale_loss` recorded
(`boundaries.take_ownership`, `boundaries.record_factors`), each time
`ScaleBoundary.exponent`, an integer within the layer's bounds. Nothing else
writes it, so the backward pass multiplies by ``2**e`` as read, and every
backward pass of a step multiplies by the same factors, which `apply` divides by.
The recorded exponent is device state, read when the backward pass runs: a
pass traced before ownership scales once the boundary is owned.
Outside XLA each TensorFlow operation costs about a microsecond to dispatch:
a model with a boundary after every layer paid the reading per boundary, in
the backward pass. In a traced function the first boundary of an optimizer's
group to run its backward pass reads the whole group's factors as one vector
instead, and the others take their element.

The rule, in one sentence: a reading is reused only while the traced graph
holds no operation, created after it, that takes one of the group's variable
handles other than to read it (an assignment, or a call of a function, a
branch or a loop that captured it); otherwise the group is read again. In a
`tf.function` TensorFlow runs a resource's reads and writes in program order,
so a reused reading holds the values a new one would read. Eagerly, outside a
`tf.function` (TF1 graphs order nothing), and for a boundary no optimizer has
claimed, every boundary reads its own factor. Inside XLA too, where nothing is
dispatched: there an element of a vector is read at a constant index, which
makes each boundary's backward fusion a kernel of its own, while equal
boundaries reading their own variables compile to one kernel.

The recorded exponents are not saved with the model: a loaded model starts
unowned, and a SavedModel cannot capture a traced backward pass of an owned
model (export fails on the untracked variable, rather than save a gradient
that carries factors nobody divides out).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from tfdls import _compat
from tfdls._division import power_of_two


def integer_exponent(log2_factor, low=-126, high=127):
    """`log2_factor` as a float32 integer: truncated toward zero, clipped to [low, high],
    NaN read as `low` (elementwise; the bounds may be arrays of the same shape).

    The one reading of a factor (`ScaleBoundary.exponent`, with the layer's
    bounds), in the backward pass and in the division alike, so a value
    assigned by hand (a fraction, a value beyond the bounds, NaN) cannot make
    them disagree, and the division's exponent keeps its static bound. NaN is
    replaced before the clip: TensorFlow's and XLA's minimum and maximum treat
    NaN differently, and their float-to-int casts of NaN differ too.
    """
    value = tf.cast(tf.convert_to_tensor(log2_factor), tf.float32)
    low, high = np.float32(low), np.float32(high)  # scalars, or one bound per element
    # NaN is the one value unequal to itself. Not `tf.math.is_nan`: inside XLA,
    # TensorFlow lowers that through MLIR, about 10 ms of compile per reading
    # (a boundary's backward pass reads its own: 1 s at 100 boundaries).
    value = tf.where(tf.not_equal(value, value), low, value)
    value = tf.clip_by_value(value, low, high)
    return tf.cast(tf.cast(value, tf.int32), tf.float32)  # the cast truncates


def factor(boundary, dtype):
    """`boundary`'s factor for this backward pass, a scalar of `dtype` (see the module
    docstring)."""
    group = boundary._ownership.group
    if group is None or tf.executing_eagerly() or _compat.in_xla_context():
        return _read_one(boundary, dtype)
    graph = tf.compat.v1.get_default_graph()
    if not getattr(graph, "building_function", False):
        return _read_one(boundary, dtype)
    try:
        # Under a distribution strategy these are the replica's own copies.
        handles = tuple(b._ownership.recorded_exponent.handle for b in group.boundaries)
    except (ValueError, AttributeError):  # no replica's copy here: cross-replica context
        return _read_one(boundary, dtype)
    readings = _readings.setdefault(graph, {})
    key = (id(group), tuple(id(h) for h in handles))
    reading = readings.get(key)
    if reading is None or not reading.reusable(graph, group, handles):
        reading = _GroupReading(group, handles)
        readings[key] = reading
    return reading.factor(graph, boundary, dtype)


class Group:
    """The boundaries one optimizer owns: read together in the backward pass."""

    def __init__(self, boundaries):
        self.boundaries = tuple(boundaries)
        self.index = {id(b): k for k, b in enumerate(self.boundaries)}


# graph -> {(group, handles): _GroupReading}. A reading names its graph's
# tensors instead of holding them, so a released graph takes its entry along.
_readings = weakref.WeakKeyDictionary()


class _GroupReading:
    """One reading of a group's variables in the current graph, and its factors per dtype."""

    def __init__(self, group, handles):
        self.group = group
        self.handles = handles
        reads = [tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32) for h in handles]
        # The variables' handles as this graph holds them (captured or passed in).
        self.graph_handles = [r.op.inputs[0].name for r in reads]
        self.created = max(_compat.op_creation_order(r.op) for r in reads)
        self.factors = power_of_two(tf.cast(tf.stack(reads), tf.int32)).name
        self.by_dtype = {}  # dtype -> the names of the factors in that dtype

    def reusable(self, graph, group, handles):
        if self.group is not group or any(a is not b for a, b in zip(self.handles, handles)):
            return False
        return not any(_compat.op_creation_order(op) > self.created and op.type != "ReadVariableOp"
                       for name in self.graph_handles
                       for op in graph.get_tensor_by_name(name).consumers())

    def factor(self, graph, boundary, dtype):
        if dtype not in self.by_dtype:
            factors = tf.cast(graph.get_tensor_by_name(self.factors), dtype)
            self.by_dtype[dtype] = [t.name for t in tf.unstack(factors, len(self.group.boundaries))]
        return graph.get_tensor_by_name(self.by_dtype[dtype][self.group.index[id(boundary)]])


def _read_one(boundary, dtype):
    exponent = boundary._ownership.recorded_exponent.value()
    return tf.cast(power_of_two(tf.cast(exponent, tf.int32)), dtype)
