"""How one `LossScaleOptimizer.apply` runs: decided once per trace, as a value.

`plan_step` looks at the gradients, the inner optimizer, the loss scale and
where the step is traced (eager, graph, XLA, under a strategy) and returns a
frozen `StepPlan`; `LossScaleOptimizer.apply` then executes it. Every fast
path is chosen here, only where it is known to be exact, and the plan says
why a path was not taken.

`UnscaledMarks` remembers what `get_unscaled_gradients` returned, so that
`apply` divides every gradient by the scale exactly once.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import tensorflow as tf

from tfdls import _compat, _distribute, _masked_update


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The decisions of one traced `apply`.

    Attributes:
        divide: per gradient, whether `apply` divides it by the scale (False:
            it came from `get_unscaled_gradients`, or its variable takes the
            gradient as a value, `overwrite_with_gradient`).
        check: ``"scaled"``: the finiteness check reads the gradients as
            given (while the scale cannot fall below 1, dividing by it cannot
            turn a finite value non-finite, and under XLA the division then
            fuses into the update); ``"unscaled"``: it reads them after the
            division (a scale below 1 multiplies them up).
        skip: how a step with non-finite gradients applies nothing:
            ``"none"`` (a fixed scale never skips), ``"masked"`` (the update
            runs and its writes are masked, see `tfdls._masked_update`; no
            branch) or ``"cond"`` (a `tf.cond` around the inner update).
        compile: the apply runs as its own XLA cluster.
        reason: why `skip` is not ``"masked"`` and `compile` is False, in
            words (empty when both fast paths are taken).

    Example:

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    >>> w = keras.Variable([1.0, 2.0], name="w")
    >>> step = tf.function(lambda g: opt.apply([g], [w]))
    >>> step(tf.ones(2))
    >>> opt.step_plan.skip, opt.step_plan.check, opt.step_plan.compile
    ('masked', 'scaled', True)
    >>> opt.apply([tf.ones(2)], [w])  # eager: no trace to audit
    >>> opt.step_plan.skip, opt.step_plan.reason
    ('cond', 'eager execution (the cond runs one branch; no trace to audit)')
    """

    divide: tuple[bool, ...]
    check: str
    skip: str
    compile: bool
    reason: str = ""

    @property
    def unscale(self) -> str:
        """``"explicit"``, ``"already"`` or ``"mixed"``: a summary of `divide`."""
        if all(self.divide):
            return "explicit"
        return "mixed" if any(self.divide) else "already"


def plan_step(
    grads,
    trainable_variables,
    inner_optimizer,
    jit_compile,
    already_unscaled,
    *,
    fixed_scale,
    dynamic_scale,
    min_scale,
):
    """Decides how this `apply` runs; see `StepPlan`.

    Args:
        grads: the gradients as passed to `apply` (None for no gradient).
        trainable_variables: their variables.
        inner_optimizer: the wrapped Keras optimizer.
        jit_compile: the optimizer's ``jit_compile`` setting.
        already_unscaled: per gradient, whether it came from
            `get_unscaled_gradients` (see `UnscaledMarks`).
        fixed_scale: the scale never changes and every step is applied.
        dynamic_scale: a `DynamicLossScale` (compiling the apply pays off).
        min_scale: the smallest scale `loss_scale` can take (None: unknown).
    """
    divide = tuple(
        g is not None
        and not unscaled
        and not getattr(v, "overwrite_with_gradient", False)
        for g, v, unscaled in zip(grads, trainable_variables, already_unscaled)
    )
    check = "scaled" if min_scale is not None and min_scale >= 1 else "unscaled"

    in_function = tf.inside_function()
    in_xla = in_function and _compat.in_xla_context()
    reasons = []
    if fixed_scale:
        skip = "none"
    elif not in_function:
        skip, why = "cond", "eager execution (the cond runs one branch; no trace to audit)"
        reasons.append(why)
    elif _distribute.needs_merge_call():
        skip = "cond"
        reasons.append(
            "the strategy synchronizes replicas with merge_call, which an audited "
            "update function cannot contain; the cond is taken in cross-replica context"
        )
    else:
        unsupported = _masked_update.unsupported_reason(
            inner_optimizer, [g for g in grads if g is not None]
        )
        skip = "cond" if unsupported else "masked"
        if unsupported:
            reasons.append(unsupported)

    if jit_compile is True and in_function and not in_xla and _distribute.has_strategy():
        raise ValueError(
            "LossScaleOptimizer(jit_compile=True) cannot compile apply() on its own under "
            f"a tf.distribute strategy with {_distribute.replicas_in_sync()} replicas: the "
            "replicas agree through cross-replica calls that an XLA cluster cannot hold. "
            "Compile the whole step instead (model.compile(jit_compile=True) or "
            "tf.function(jit_compile=True)), or use jit_compile='auto' or False."
        )
    if jit_compile is False:
        compile_apply = False
    elif not in_function or in_xla:
        compile_apply = False  # eager, or already inside an XLA cluster
    elif jit_compile is True:
        compile_apply = True
    elif _distribute.has_strategy():
        compile_apply = False
        reasons.append("jit_compile='auto' does not compile under a multi-replica strategy")
    elif _compat.op_determinism_enabled():
        compile_apply = False
        reasons.append("jit_compile='auto' does not compile with op determinism enabled")
    elif not dynamic_scale:
        compile_apply = False
        reasons.append("jit_compile='auto' compiles only for a DynamicLossScale")
    else:
        compile_apply = skip == "masked"
        if not compile_apply:
            reasons.append("jit_compile='auto' compiles only a masked (branch-free) update")
    return StepPlan(
        divide=divide, check=check, skip=skip, compile=compile_apply, reason="; ".join(reasons)
    )


class UnscaledMarks:
    """Which gradients `get_unscaled_gradients` has already divided by the scale.

    The rule: `apply` divides a gradient by the scale unless it was returned by
    `get_unscaled_gradients` in the same step, or (inside a `tf.function`)
    computed from such a gradient. So a mark never outlives its step: in a
    traced function it belongs to that function's graph, and in eager mode it
    lasts until the next `apply` of the thread (which clears it, also when it
    raises). Eager gradients that are neither the marked tensors nor the
    tensors `get_unscaled_gradients` was given cannot be classified while a
    mark is pending: `apply` raises a ValueError then.
    """

    def __init__(self):
        self._graph_marks = weakref.WeakKeyDictionary()  # graph -> {tensor key}
        self._eager = threading.local()  # .outputs/.inputs: lists of tensors

    def mark(self, inputs, outputs):
        """Records that `outputs` are `inputs` divided by the scale."""
        inputs = [_values(g) for g in inputs if g is not None]
        outputs = [_values(g) for g in outputs if g is not None]
        if tf.executing_eagerly():
            self._eager.inputs = getattr(self._eager, "inputs", []) + inputs
            self._eager.outputs = getattr(self._eager, "outputs", []) + outputs
            return
        graph = tf.compat.v1.get_default_graph()
        self._graph_marks.setdefault(graph, set()).update(_key(t) for t in outputs)

    def clear(self):
        """Forgets this thread's eager marks (called by every `apply`)."""
        self._eager.inputs = []
        self._eager.outputs = []

    def classify(self, grads):
        """Per gradient: True if it is (computed from) a `get_unscaled_gradients` output."""
        if tf.executing_eagerly():
            return self._classify_eager(grads)
        return self._classify_traced(grads)

    def _classify_eager(self, grads):
        outputs = getattr(self._eager, "outputs", [])
        if not outputs:
            return tuple(False for _ in grads)
        inputs = getattr(self._eager, "inputs", [])
        result = []
        for grad in grads:
            if grad is None:
                result.append(False)
                continue
            value = _values(grad)
            if any(value is t for t in outputs):
                result.append(True)
            elif any(value is t for t in inputs):
                result.append(False)
            else:
                raise ValueError(
                    "tfdls: get_unscaled_gradients() was called since the last apply() in "
                    "this thread, but apply() received a gradient that is neither one it "
                    "returned nor one it was given, so tfdls cannot tell whether to divide "
                    "it by the loss scale. In eager mode pass the tensors "
                    "get_unscaled_gradients() returned unchanged, or pass the scaled "
                    "gradients to apply() (Keras 3 style) and set clipnorm/global_clipnorm "
                    "on the inner optimizer, which then sees unscaled gradients."
                )
        return tuple(result)

    def _classify_traced(self, grads):
        graph = tf.compat.v1.get_default_graph()
        if not any(self._graph_marks.get(g) for g in _graph_chain(graph)):
            return tuple(False for _ in grads)
        closures = {}

        def derived_keys(g):
            # Everything computed from a marked tensor of graph `g`.
            if g not in closures:
                closures[g] = _forward_closure(g, self._graph_marks.get(g, ()))
            return closures[g]

        return tuple(
            grad is not None and self._derived(_values(grad), derived_keys) for grad in grads
        )

    def _derived(self, tensor, derived_keys):
        # A tensor of an enclosing function (not yet captured) is looked up there.
        graph = tensor.graph
        if _key(tensor) in derived_keys(graph):
            return True
        outer = getattr(graph, "outer_graph", None)
        if outer is None or not any(self._graph_marks.get(g) for g in _graph_chain(outer)):
            return False
        # Marks in an enclosing function: follow this function's captured
        # inputs out to it. A function argument cannot be followed.
        captured = {_key(internal): external for external, internal in graph.captures}
        for placeholder in _float_placeholders(tensor):
            external = captured.get(_key(placeholder))
            if external is None:
                raise ValueError(
                    "tfdls: apply() received gradients through the arguments of a "
                    "nested tf.function while get_unscaled_gradients() was used in an "
                    "enclosing one, so tfdls cannot tell whether to divide them by the "
                    "loss scale. Call get_unscaled_gradients() in the same function "
                    "as apply(), or pass the scaled gradients to apply()."
                )
            if self._derived(external, derived_keys):
                return True
        return False


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _key(tensor):
    return (tensor.op.name, tensor.value_index)


def _graph_chain(graph):
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


def _forward_closure(graph, keys):
    """The keys of every tensor of `graph` computed from the tensors `keys`."""
    closure = set()
    stack = [graph.get_tensor_by_name(f"{name}:{index}") for name, index in keys]
    while stack:
        tensor = stack.pop()
        key = _key(tensor)
        if key in closure:
            continue
        closure.add(key)
        for op in tensor.consumers():
            stack.extend(op.outputs)
    return closure


def _float_placeholders(tensor):
    """The floating-point placeholders (function inputs) `tensor` is computed from."""
    found, seen, stack = [], set(), [tensor]
    while stack:
        t = stack.pop()
        if _key(t) in seen:
            continue
        seen.add(_key(t))
        if t.op.type == "Placeholder":
            if t.dtype.is_floating:
                found.append(t)
            continue
        stack.extend(t.op.inputs)
    return found
