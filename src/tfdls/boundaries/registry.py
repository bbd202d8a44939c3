"""The boundaries' registries, in one place: what tfdls remembers outside the layers.

Every record here is weak (a model, layer, variable or graph that is
released leaves it) and read only at trace time or between steps:

* `seen`: per traced graph, where a boundary's backward pass emitted its
  scaled gradient and where a division undid it (`SeenBoundaries`), for the
  refusal of gradients that crossed boundaries an optimizer was not given;
* `owned_above`: per variable, the owned boundaries above it (set by
  `take_ownership`), for the same refusal by variable, eagerly too;
* `boundaries_above_input`: per `UnscaledInput`, the boundaries above it once
  its model is read, and `traced_unread`, those whose backward pass a
  `tf.function` traced before (such a trace divides by nothing);
* `guarded_layers`, `wrapped_models`, `models_in_call`: the rule that a
  gradient reaches a layer below an owned boundary only through a call of its
  model (`tfdls.boundaries.guard`).
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from tfdls import _compat


class SeenBoundaries:
    """Per traced graph: the ops where a boundary's backward pass emitted its
    scaled gradient, and where an `UnscaledInput`'s emitted its divided one.

    `LossScaleOptimizer.apply` refuses, at trace time, gradients that crossed
    a boundary it was not given on a path where no `UnscaledInput` divided it
    out again (`crossed_undivided`, read from the graph). Eager backward
    passes are not recorded: nothing ties an eager gradient to a later
    `apply`, so eagerly the check goes by variables (`owned_boundaries_above`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        # graph -> {op name: (boundaries, divides)}; op names, not tensors, so
        # the record does not keep the graph alive.
        self._graphs = weakref.WeakKeyDictionary()

    def add(self, tensor, boundaries, divides=False):
        # A captured eager tensor (the indices of an IndexedSlices built from one) has
        # no op in the graph, and nothing flows into it: nothing to record.
        if tf.executing_eagerly() or _compat.is_eager_tensor(tensor):
            return
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            ops = self._graphs.setdefault(graph, {})
            ops[tensor.op.name] = (tuple(weakref.ref(b) for b in boundaries), divides)

    def any_crossed(self):
        """Whether any traced graph still alive holds a boundary's backward pass (cheap:
        without one, no gradient can have crossed a boundary in a graph)."""
        with self._lock:
            return any(any(not divides for _, divides in ops.values())
                       for ops in self._graphs.values())

    def _entries(self, graph):
        with self._lock:
            entries = dict(self._graphs.get(graph, {}))
        return {name: ([b() for b in refs if b() is not None], divides)
                for name, (refs, divides) in entries.items()}

    def crossed_undivided(self, grads):
        """The boundaries whose scaled gradient reaches one of `grads` (tensors of the
        current graph) on a path through no division of it (an `UnscaledInput`, or an
        optimizer dividing its own gradients).

        A walk from `grads` to their inputs, carrying the boundaries divided
        on the way; it follows captured tensors into the enclosing graph.
        Where it reaches an argument of a nested function or loop body, it
        cannot follow: then every boundary crossed and not divided anywhere
        in the enclosing graphs counts.
        """
        if tf.executing_eagerly():
            return []
        found, escaped = self._walk(
            [t for g in grads if g is not None for t in tensors_of(g)])
        if escaped:
            outer = getattr(tf.compat.v1.get_default_graph(), "outer_graph", None)
            while outer is not None:
                found.update(self._undivided_in(outer))
                outer = getattr(outer, "outer_graph", None)
        return list(found.values())

    def crossed_above(self, tensor):
        """The boundaries whose scaled gradient `tensor` (of the current graph) depends
        on, divided or not: what reached an `UnscaledInput`."""
        found, _ = self._walk([tensor], ignore_divisions=True)
        return list(found.values())

    def _walk(self, tensors, ignore_divisions=False):
        entries_of = {}
        found = {}
        escaped = False
        stack = [(t, frozenset()) for t in tensors]
        visited = set()
        while stack:
            tensor, covered = stack.pop()
            if _compat.is_eager_tensor(tensor) or not hasattr(tensor, "op"):
                continue  # a captured eager value: no backward pass behind it
            graph = tensor.graph
            key = (id(graph), tensor.op.name, tensor.value_index, covered)
            if key in visited:
                continue
            visited.add(key)
            if id(graph) not in entries_of:
                entries_of[id(graph)] = (self._entries(graph), _captured(graph))
            entries, captured = entries_of[id(graph)]
            op = tensor.op
            entry = entries.get(op.name)
            if entry is not None:
                boundaries, divides = entry
                if divides and not ignore_divisions:
                    covered = covered | {id(b) for b in boundaries}
                elif not divides:
                    found.update({id(b): b for b in boundaries if id(b) not in covered})
            if op.type == "Placeholder":
                external = captured.get(id(tensor))
                if external is not None:
                    stack.append((external, covered))
                elif getattr(graph, "outer_graph", None) is not None:
                    escaped = True  # an argument: its value comes from elsewhere
                continue
            if op.type == "IdentityN":  # output i is input i
                stack.append((op.inputs[tensor.value_index], covered))
                continue
            if op.type in _FUNCTION_OPS and not ignore_divisions:
                # A branch, loop or function body: its inside is not followed, so
                # every boundary crossed and not divided in the graphs within counts.
                found.update({k: b for k, b in self._undivided_within(graph).items()
                              if k not in covered})
            stack.extend((t, covered) for t in op.inputs)
        return found, escaped

    def _undivided_within(self, graph):
        """The boundaries crossed and not divided in the graphs nested in `graph`."""
        with self._lock:
            graphs = list(self._graphs.keys())
        found = {}
        for inner in graphs:
            outer = getattr(inner, "outer_graph", None)
            while outer is not None and outer is not graph:
                outer = getattr(outer, "outer_graph", None)
            if outer is None:
                continue
            found.update(self._undivided_in(inner))
        return found

    def _undivided_in(self, graph):
        """{id: boundary} crossed in `graph` and divided nowhere in it."""
        crossed, divided = {}, set()
        for boundaries, divides in self._entries(graph).values():
            if divides:
                divided.update(id(b) for b in boundaries)
            else:
                crossed.update({id(b): b for b in boundaries})
        return {k: b for k, b in crossed.items() if k not in divided}


# Ops that run a function body (cond branches, loops, nested tf.functions).
_FUNCTION_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case",
                           "StatelessCase", "PartitionedCall", "StatefulPartitionedCall"})


def _captured(graph):
    """{id(internal placeholder): external tensor} of a function graph's captures."""
    try:
        return {id(internal): external for external, internal in graph.captures}
    except (AttributeError, TypeError):
        return {}


def tensors_of(grad):
    if isinstance(grad, tf.IndexedSlices):
        return [grad.values, grad.indices]
    return [grad] if isinstance(grad, tf.Tensor) else []


seen = SeenBoundaries()


class _ByIdentity:
    """A weak mapping keyed by object identity, for keys that are not hashable as
    themselves (a Keras variable compares elementwise)."""

    def __init__(self):
        self._entries = {}

    def setdefault(self, key, make):
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            ident = id(key)
            ref = weakref.ref(key, lambda _, ident=ident: self._entries.pop(ident, None))
            entry = (ref, make())
            self._entries[ident] = entry
        return entry[1]

    def get(self, key, default=None):
        entry = self._entries.get(id(key))
        return default if entry is None or entry[0]() is not key else entry[1]


# {variable: WeakSet of the owned boundaries above it} (also under the
# tf.Variable a Keras variable holds, which gradients are taken against).
owned_above = _ByIdentity()


def mark_owned_above(boundary_map):
    """Records, per variable of `boundary_map`, the boundaries above it as owned."""
    for variable, indices in boundary_map.variables:
        if not indices:
            continue
        for target in (variable, _compat.underlying_variable(variable)):
            if target is not None:
                owned_above.setdefault(target, weakref.WeakSet).update(
                    boundary_map.boundaries[i] for i in indices)


def owned_boundaries_above(variable) -> list:
    """The owned boundaries above `variable` in the models optimizers were given."""
    found = []
    for target in (variable, _compat.underlying_variable(variable)):
        if target is not None:
            found.extend(owned_above.get(target, ()))
    return found


# {UnscaledInput: the boundaries above it}, set when its model is read. Out of
# the layer, where Keras would track the boundaries as its sublayers.
boundaries_above_input = weakref.WeakKeyDictionary()
# The UnscaledInputs whose backward pass a tf.function traced before their
# model was read: such a trace divides by nothing, and its boundaries may be
# owned later. Any such trace counts, released or not: whether a graph is
# still alive is up to the garbage collector, and the refusal must not be.
traced_unread = weakref.WeakSet()

# {layer below a boundary: (its owned model, the boundary above it)}, and the
# owned models whose call is wrapped; weak.
guarded_layers = weakref.WeakKeyDictionary()
wrapped_models = weakref.WeakSet()
# Per thread (MirroredStrategy calls replicas in threads): the owned models
# whose call is in progress.
models_in_call = threading.local()
