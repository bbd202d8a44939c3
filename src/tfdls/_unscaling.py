"""Which gradients `apply` divides by the loss scale: one rule, kept on the device.

The rule, in one sentence:

    `apply` divides every gradient by the loss scale, unless
    `get_unscaled_gradients` ran after the last `scale_loss`,
    `get_scaled_loss` or `apply`; then it divides none of them.

(Variables marked `overwrite_with_gradient` take their "gradient" as a value
and are never divided.) The state behind the rule is one boolean variable,
set by `get_unscaled_gradients`, cleared by `scale_loss`/`get_scaled_loss`,
and read and cleared by `apply` when the step runs, not when it is traced. So
the same rule holds in eager code, in `tf.function`s, across functions, in
loops, through variables and under `strategy.run`, and `apply`'s divisor is
``where(flag, 1, scale)``: no branch, no host read.

`UnscaleGuard` adds loud errors, never a different update: where tfdls can see
how an applied gradient was computed (eagerly, the very tensors; traced, the
graph of the function that calls `apply` and, through captures, of the
functions around it), a gradient that the rule would apply wrongly is a
`ValueError`:

* computed from the scaled gradients given to `get_unscaled_gradients` (or
  from what they are copies of: an identity, a cast, a reshape) other than
  through its outputs (applying the scaled gradients after logging the
  unscaled ones, or scaling them by a clip factor computed from the unscaled
  ones);
* computed from the outputs of a `get_unscaled_gradients` call that an
  earlier `apply`, `scale_loss` or `get_scaled_loss` has already closed, with
  no call pending, so that `apply` divides them again (two `apply` calls
  from one `get_unscaled_gradients` call);
* computed, inside a loop body or a nested `tf.function`, from outputs of a
  call outside it, which may be applied more than once (a `tf.cond` branch
  runs at most once: fine, also with an `apply` in each branch);
* taken through the arguments of a nested `tf.function` (or a loop variable)
  while a call is pending in an enclosing function: tfdls cannot see them;
* eagerly, while a call is pending, anything but the tensors it returned:
  eager execution leaves no record of how a tensor was computed.

Where tfdls cannot see (gradients returned by one `tf.function` and passed to
another, read from a variable), the rule alone decides.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import tensorflow as tf

from tfdls import _compat
from tfdls._distribute import state_variable

_RULE = (
    "tfdls' unscaling rule: apply() divides every gradient by the loss scale, unless "
    "get_unscaled_gradients() ran after the last scale_loss(), get_scaled_loss() or "
    "apply(); then it divides none of them."
)


class UnscaleState(tf.Module):
    """The device-side flag behind the rule, and the guard's records.

    Args:
        name: the module name.
    """

    def __init__(self, name="unscale_state"):
        super().__init__(name=name)
        with self.name_scope:
            # True while this step's gradients have been divided by
            # get_unscaled_gradients (see the module docstring).
            self.gradients_unscaled = state_variable("gradients_unscaled", False, tf.bool)
        self._guard = UnscaleGuard()

    def begin_step(self):
        """`scale_loss`/`get_scaled_loss`: a new step; an earlier unscaling is forgotten."""
        self._guard.close()
        self.gradients_unscaled.assign(False)

    def record_unscaled(self, scaled, unscaled):
        """`get_unscaled_gradients` returned `unscaled`, the `scaled` divided by the scale."""
        self._guard.record(scaled, unscaled)
        self.gradients_unscaled.assign(True)

    def check(self, grads, names):
        """Raises ValueError for gradients the rule would visibly apply wrongly (`names`:
        their variables' names, for the message)."""
        self._guard.check(grads, names, self._flag_is_set)

    def _flag_is_set(self):
        # Eager only, and only while an eager get_unscaled_gradients call is
        # pending: a traced scale_loss or apply may have ended that step since,
        # which only the flag knows. (A host read, in eager code alone.)
        return bool(self.gradients_unscaled.numpy())

    def consume(self):
        """In-step: whether this step's gradients are already unscaled; clears the flag."""
        unscaled = tf.convert_to_tensor(self.gradients_unscaled)
        self.gradients_unscaled.assign(False)
        return unscaled

    def end_step(self):
        """After every `apply`, also one that raised: the step is over."""
        self._guard.close()
        if tf.executing_eagerly():
            # An eager apply that raised before its step ran must not leave
            # the flag set for the next one.
            self.gradients_unscaled.assign(False)


EAGER = "eager"


@dataclasses.dataclass
class _Call:
    """One `get_unscaled_gradients` call: the value tensors it was given and returned.

    `closers` are where a `scale_loss` or `apply` closed it: ``EAGER`` or the
    graphs they were traced in.
    """

    scaled: tuple
    unscaled: tuple
    closers: list = dataclasses.field(default_factory=list)

    def open_for(self, viewer):
        """Whether the call is still pending as seen from `viewer` (``EAGER`` or a graph)."""
        return not any(_closes_for(closer, viewer) for closer in self.closers)


def _closes_for(closer, viewer):
    if closer is EAGER or viewer is EAGER:
        return closer is viewer
    if any(closer is g for g in _graph_chain(viewer)):
        return True  # closed here or in a function around the viewer
    # Closed in another graph: a tf.cond branch counts once its cond is built
    # (its sibling branch, traced before that, runs instead of it, not after).
    return not _compat.is_cond_branch(closer) or _cond_built(closer)


def _cond_built(branch):
    outer = getattr(branch, "outer_graph", None)
    return outer is not None and any(
        branch in _compat.cond_branch_graphs(op) for op in outer.get_operations()
    )


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _key(tensor):
    return (tensor.op.name, tensor.value_index)


def _graph_chain(graph):
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


class UnscaleGuard:
    """Trace-time (and eager) checks of the rule's visible misuses; see the module docstring.

    Records are per thread (MirroredStrategy traces each replica in its own
    thread) and, traced, per graph.
    """

    def __init__(self):
        self._local = threading.local()

    def _eager_calls(self):
        if not hasattr(self._local, "eager"):
            self._local.eager = []
        return self._local.eager

    def _graph_calls(self):
        if not hasattr(self._local, "graphs"):
            self._local.graphs = weakref.WeakKeyDictionary()
        return self._local.graphs

    def record(self, scaled, unscaled):
        call = _Call(
            scaled=tuple(_values(g) for g in scaled if g is not None),
            unscaled=tuple(_values(g) for g in unscaled if g is not None),
        )
        if tf.executing_eagerly():
            calls = self._eager_calls()
            # Closed calls are kept only until the next call, to name stale tensors.
            calls[:] = [c for c in calls if c.open_for(EAGER)] + [call]
        else:
            graph = tf.compat.v1.get_default_graph()
            self._graph_calls().setdefault(graph, []).append(call)

    def close(self):
        """Closes every pending call this thread can see (eager, or the graph chain)."""
        if tf.executing_eagerly():
            closer, groups = EAGER, [self._eager_calls()]
        else:
            closer = tf.compat.v1.get_default_graph()
            graphs = self._graph_calls()
            groups = [graphs.get(g, []) for g in _graph_chain(closer)]
        for group in groups:
            for call in group:
                call.closers.append(closer)

    def check(self, grads, names, flag_is_set):
        present = [(_values(g), n) for g, n in zip(grads, names) if g is not None]
        values = [v for v, _ in present]
        names = [n for _, n in present]
        if tf.executing_eagerly():
            self._check_eager(values, names, flag_is_set)
        else:
            self._check_traced(values, names)

    def _check_eager(self, values, names, flag_is_set):
        calls = self._eager_calls()
        if not calls:
            return
        pending = [c for c in calls if c.open_for(EAGER)]
        if pending and not flag_is_set():
            for call in pending:  # a traced scale_loss or apply ended that step
                call.closers.append(EAGER)
            pending = []
        for value, name in zip(values, names):
            if pending:
                if any(value is t for c in calls for t in c.scaled):
                    raise ValueError(_message("bypass", name))
                if not any(value is t for c in pending for t in c.unscaled):
                    raise ValueError(_message("eager", name))
            elif any(value is t for c in calls for t in c.unscaled):
                # Nothing pending: apply divides, a second time for these.
                raise ValueError(_message("closed"))

    def _check_traced(self, values, names):
        graphs = self._graph_calls()
        graph = tf.compat.v1.get_default_graph()
        if not any(graphs.get(g) for g in _graph_chain(graph)):
            return
        labels = _Labels(graphs, graph)
        # With a call pending, apply divides nothing: gradients computed from
        # scaled ones are wrong, outputs of earlier (closed) calls are fine
        # (micro-batches accumulated over several calls). With none pending
        # (that this trace can see), apply divides: outputs of closed calls
        # would be divided twice, scaled gradients are right.
        pending = any(
            c.open_for(graph) for g in _graph_chain(graph) for c in graphs.get(g, ())
        )
        errors = ("bypass", "repeat", "hidden") if pending else ("closed",)
        for value, name in zip(values, names):
            found = labels.used_in(value, graph)
            for label in errors:
                if label in found:
                    raise ValueError(_message(label, name))
        if pending:
            # By position: with a call pending apply divides nothing, so it may
            # receive no more gradients than the pending calls returned; those
            # not computed from their outputs are the undivided ones.
            returned = sum(len(c.unscaled) for g in _graph_chain(graph)
                           for c in graphs.get(g, ()) if c.open_for(graph))
            if len(values) > returned:
                raw = [n for v, n in zip(values, names) if "open" not in labels.used_in(v, graph)]
                raise ValueError(_message("partial", ", ".join(raw) or None))


class _Labels:
    """What each tensor of a graph is computed from, with respect to recorded calls.

    Labels: ``open`` (from a pending call's outputs), ``closed`` (from a
    closed call's outputs), ``bypass`` (from a call's scaled inputs, not
    through its outputs), ``repeat`` (from a pending call's outputs in an
    enclosing graph, across a loop body or nested function), ``hidden``
    (from an argument or loop variable, while a call is pending in an
    enclosing graph).
    """

    def __init__(self, graph_calls, viewer):
        self._graph_calls = graph_calls
        self._viewer = viewer
        self._by_graph = {}

    def of(self, tensor):
        return self._graph_labels(tensor.graph).get(_key(tensor), frozenset())

    def used_in(self, tensor, graph):
        """The labels of `tensor` used in `graph`, which may capture it from an enclosing graph."""
        found = self.of(tensor)
        if tensor.graph is not graph and "open" in found:
            # Captured across the graphs from `graph` out to the tensor's own.
            crossed = []
            inner = graph
            while inner is not None and inner is not tensor.graph:
                crossed.append(inner)
                inner = getattr(inner, "outer_graph", None)
            if any(not _compat.is_cond_branch(g) for g in crossed):
                found = (found - {"open"}) | {"repeat"}
        return found

    def _pending_above(self, graph):
        outer = getattr(graph, "outer_graph", None)
        return any(
            call.open_for(self._viewer)
            for g in _graph_chain(outer)
            for call in self._graph_calls.get(g, [])
        )

    def _graph_labels(self, graph):
        if graph in self._by_graph:
            return self._by_graph[graph]
        calls = self._graph_calls.get(graph, [])
        stops = {_key(t) for call in calls for t in call.unscaled}
        labels = {}
        for call in calls:
            _spread(call.unscaled, "open" if call.open_for(self._viewer) else "closed", labels)
            # The scaled gradients given, and what they are copies of (an
            # identity, a cast, a reshape of a tensor holds its values too).
            _spread(_with_originals(call.scaled), "bypass", labels, stops)
        outer = getattr(graph, "outer_graph", None)
        if outer is not None and any(self._graph_calls.get(g) for g in _graph_chain(outer)):
            repeatable = not _compat.is_cond_branch(graph)
            captured = set()
            for external, internal in getattr(graph, "captures", ()):
                captured.add(_key(internal))
                if not internal.dtype.is_floating:
                    continue
                for label in self.of(external):
                    if label == "open" and repeatable:
                        label = "repeat"
                    _spread([internal], label, labels)
            if self._pending_above(graph):
                arguments = [
                    t
                    for op in graph.get_operations()
                    if op.type == "Placeholder"
                    for t in op.outputs
                    if t.dtype.is_floating and _key(t) not in captured
                ]
                _spread(arguments, "hidden", labels)
        result = {key: frozenset(found) for key, found in labels.items()}
        self._by_graph[graph] = result
        return result


# Ops whose output holds its (first) input's values, only copied or re-typed.
_COPY_OPS = frozenset(
    {"Identity", "IdentityN", "Snapshot", "Cast", "Reshape", "ExpandDims", "Squeeze",
     "StopGradient", "PreventGradient", "EnsureShape"}
)


def _with_originals(tensors):
    """`tensors` and the tensors they are copies of (through `_COPY_OPS`)."""
    found, stack = [], list(tensors)
    while stack:
        tensor = stack.pop()
        if any(tensor is t for t in found):
            continue
        found.append(tensor)
        if tensor.op.type in _COPY_OPS and tensor.op.inputs:
            source = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
            if source.dtype.is_floating:
                stack.append(source)
    return found


def _spread(tensors, label, labels, stops=frozenset()):
    """Adds `label` to every tensor computed from `tensors`, not passing through `stops`."""
    stack = [t for t in tensors if _key(t) not in stops]
    seen = set()
    while stack:
        tensor = stack.pop()
        key = _key(tensor)
        if key in seen:
            continue
        seen.add(key)
        labels.setdefault(key, set()).add(label)
        for op in tensor.consumers():
            stack.extend(t for t in op.outputs if _key(t) not in stops)


_MESSAGES = {
    "bypass": (
        "apply() received a gradient computed from the scaled gradients that were "
        "passed to get_unscaled_gradients() (not through its outputs), for example "
        "the scaled gradients themselves, or scaled gradients times a clip factor "
        "computed from the unscaled ones. Pass get_unscaled_gradients()' outputs "
        "(or what you compute from them), or only the scaled gradients and no "
        "get_unscaled_gradients() call in that step. To look at unscaled values "
        "without unscaling the step (logging), divide by opt.loss_scale() yourself."
    ),
    "closed": (
        "apply() received gradients returned by a get_unscaled_gradients() call that "
        "an earlier apply(), scale_loss() or get_scaled_loss() already closed, so "
        "they would be divided by the scale a second time. Call "
        "get_unscaled_gradients() once per apply(), on that apply's gradients."
    ),
    "repeat": (
        "apply(), inside a loop body or a nested tf.function, received gradients "
        "unscaled by get_unscaled_gradients() outside it: the first apply closes the "
        "call, so a second run would divide them again. Call get_unscaled_gradients() "
        "and apply() in the same function."
    ),
    "hidden": (
        "apply() received gradients through the arguments of a nested tf.function "
        "(or a loop variable) while a get_unscaled_gradients() call is pending in an "
        "enclosing function, so tfdls cannot see whether they are the unscaled "
        "gradients. Call get_unscaled_gradients() and apply() in the same function, "
        "or pass the gradients by closure."
    ),
    "partial": (
        "get_unscaled_gradients() was called since the last scale_loss() or apply() "
        "(so apply() divides none of the gradients), but apply() received more "
        "gradients than it returned: the others were never divided by the loss "
        "scale. Pass every gradient of the step through get_unscaled_gradients(), or "
        "none (Keras 3 style: apply() divides them)."
    ),
    "eager": (
        "get_unscaled_gradients() was called since the last apply() in this thread, "
        "and apply() received a gradient that is not one it returned; in eager mode "
        "tfdls cannot see how that gradient was computed, so cannot tell whether to "
        "divide it by the loss scale. Pass the tensors get_unscaled_gradients() returned unchanged, "
        "clip inside a tf.function, or pass the scaled gradients to apply() (Keras 3 "
        "style) and set clipnorm/global_clipnorm on the inner optimizer, which then "
        "sees unscaled gradients."
    ),
}


def _message(kind, names=None):
    about = "" if names is None else f"the gradient of {names}: "
    return f"tfdls: {about}{_MESSAGES[kind]} ({_RULE})"
