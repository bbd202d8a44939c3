"""Scale boundaries: a loss scale per block of layers, for gradients one global scale cannot hold.

A single loss scale is set by the gradients closest to overflow; gradients
orders of magnitude smaller elsewhere in the network (early layers of deep
networks without normalization, embeddings) still underflow in float16. A
`ScaleBoundary` is an identity in the forward pass whose backward pass
multiplies the incoming gradient by ``2**e``, a power of two held in a
variable: exact, unless it overflows. Every variable's gradient then carries
a known scale, the global loss scale times ``2**T``, where ``T`` is the sum
of the exponents of the boundaries between the variable and the loss, and
`tfdls.LossScaleOptimizer` divides it out per variable, exactly.

The rule, in one sentence: a variable's gradient is divided by the loss scale
times the factors of the boundaries that every path from its layer to the
model's outputs crosses, read from the model's graph when the optimizer is
given the model; a layer whose paths cross different boundaries is an error.

So the gradient of every variable must reach the loss only through the
model's outputs. `read_boundaries` refuses what it can see breaking that: a
residual connection around a boundary, a layer with a regularizer (its loss
term does not cross the boundaries) below one, a boundary inside a nested
model or layer, where the graph cannot be read. `apply` refuses a variable
below a boundary that an optimizer owns but that it was not given, and, at
trace time, gradients that crossed in the same traced function a boundary it
was not given (owned or not yet owned: ownership is read when the step runs)
on a path where no `UnscaledInput` divided it out again.

Gradients that leave a model through an input cross every boundary above
it: an `UnscaledInput` placed directly on each float input divides them out
(`add_scale_boundaries` places them; `read_boundaries` refuses a model
without), so a GAN generator trained through a discriminator with
boundaries, or a saliency map, sees the plain model's gradient. A gradient
of a gradient through a boundary is refused (its terms would mix scales).

Example:

>>> keras.mixed_precision.set_global_policy("mixed_float16")
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
...                           keras.layers.Dense(4), keras.layers.Dense(1)])
>>> model = tfdls.add_scale_boundaries(model)
>>> [type(layer).__name__ for layer in model.layers]
['UnscaledInput', 'Dense', 'ScaleBoundary', 'Dense', 'ScaleBoundary', 'Dense']
>>> opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), scale_boundaries=model)
>>> model.compile(optimizer=opt, loss="mse")
>>> keras.mixed_precision.set_global_policy("float32")
"""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdls import _compat, _factor_readings
from tfdls._division import divide_by_power_of_two
from tfdls._factor_readings import integer_exponent  # noqa: F401 (part of this module's interface)

# The backward multiply is done in the gradient's own dtype, so a factor must
# be a power of two float16 holds as a normal number.
MIN_LOG2_FACTOR = -14
MAX_LOG2_FACTOR = 15
# A float64 gradient is divided by 2**(log2(scale) + T) in one float64
# multiply: |log2(scale)| <= 127 and 15 per boundary keep that exponent a
# normal float64 one only up to this many boundaries above it.
MAX_FLOAT64_CHAIN = (1022 - 127) // max(-MIN_LOG2_FACTOR, MAX_LOG2_FACTOR)


def check_float64_chain(what, dtype, chain):
    """Refuses a float64 gradient below more than `MAX_FLOAT64_CHAIN` boundaries."""
    if tf.as_dtype(dtype) == tf.float64 and len(chain) > MAX_FLOAT64_CHAIN:
        raise ValueError(
            f"tfdls: {what} is float64 and below {len(chain)} nested scale boundaries, "
            f"more than {MAX_FLOAT64_CHAIN}: the power of two it is divided by could "
            "leave float64's range. Use fewer boundaries (add_scale_boundaries(..., "
            "every=k) with a larger k)."
        )


@keras.saving.register_keras_serializable(package="tfdls")
class ScaleBoundary(keras.layers.Layer):
    """An identity whose backward pass multiplies the gradient by ``2**log2_factor``.

    The exponent is a non-trainable weight of the layer (saved with the
    model, in checkpoints and `.keras` files) that `tfdls.LossScaleOptimizer`
    adapts when it is given the model (``scale_boundaries=model``). Each
    optimizer step, with ``T`` the sum of the exponents of this boundary and
    of the boundaries above it::

        if the step is skipped (some gradient is NaN/Inf):
            for each block with a non-finite gradient, the nearest boundary
            above it whose exponent is above `min_log2_factor` lowers it by 1;
            where none can, the global loss scale shrinks (as it always does
            for a non-finite gradient above every boundary)
        else, every `adjust_period` applied steps (from the first):
            E = binary exponent of the largest scaled gradient element of
                the variables directly below this boundary
            E_top = the same for the variables above every boundary
            T += floor(E_top - E - margin_bits)   # this block's largest element
                                                   # sits margin_bits below the top one's
            log2_factor = clip(T - T of the boundary above, min, max)
            (a block or top whose gradients are all zero keeps its factor)

    A boundary scales the gradient only while a `LossScaleOptimizer` owns it
    (``scale_boundaries=model`` or `set_scale_boundaries`); otherwise, as in
    a freshly loaded model or with any other optimizer, it is an identity
    both ways, so nothing else ever sees a scaled gradient. Ownership is a
    device flag, read when the backward pass runs, not when it is traced;
    once owned, a boundary stays owned (nothing clears the flag).

    No host read and no branch: both outcomes are computed and selected.

    Args:
        initial_log2_factor: the exponent to start from.
        min_log2_factor, max_log2_factor: bounds of the exponent, within
            [-14, 15] (powers of two float16 holds). A boundary with equal
            bounds keeps a fixed factor. The exponent is read within them
            (see `exponent`), also after a value assigned by hand.
        adjust_period: adjust from the headroom every this many applied steps.
        margin_bits: how much more headroom than the top block a block keeps.
        **kwargs: Keras layer arguments (``name``).

    Example:

    >>> boundary = tfdls.ScaleBoundary(initial_log2_factor=3, name="b")
    >>> model = keras.Sequential([keras.Input((2,)), tfdls.UnscaledInput(),
    ...                           keras.layers.Dense(2), boundary, keras.layers.Dense(1)])
    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    >>> x = tf.constant([1.0, 2.0])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = tf.reduce_sum(boundary(x))
    >>> tape.gradient(y, x).numpy()  # forward: identity; backward: times 2**3
    array([8., 8.], dtype=float32)
    """

    def __init__(
        self,
        initial_log2_factor: int = 0,
        min_log2_factor: int = 0,
        max_log2_factor: int = 12,
        adjust_period: int = 100,
        margin_bits: float = 1.0,
        **kwargs: Any,
    ):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        for key, value in (
            ("initial_log2_factor", initial_log2_factor),
            ("min_log2_factor", min_log2_factor),
            ("max_log2_factor", max_log2_factor),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"`{key}` must be an int; got {key}={value!r}")
            if not MIN_LOG2_FACTOR <= value <= MAX_LOG2_FACTOR:
                raise ValueError(
                    f"`{key}` must be in [{MIN_LOG2_FACTOR}, {MAX_LOG2_FACTOR}] (powers of "
                    f"two that float16 holds); got {key}={value!r}"
                )
        if min_log2_factor > max_log2_factor:
            raise ValueError(
                f"`min_log2_factor` must be <= max_log2_factor={max_log2_factor}; "
                f"got min_log2_factor={min_log2_factor!r}"
            )
        if not min_log2_factor <= initial_log2_factor <= max_log2_factor:
            raise ValueError(
                f"`initial_log2_factor` must be in [min_log2_factor, max_log2_factor] = "
                f"[{min_log2_factor}, {max_log2_factor}]; got initial_log2_factor="
                f"{initial_log2_factor!r}"
            )
        if isinstance(adjust_period, bool) or not isinstance(adjust_period, (int, np.integer)) \
                or adjust_period < 1:
            raise ValueError(f"`adjust_period` must be an int >= 1; got adjust_period={adjust_period!r}")
        if isinstance(margin_bits, bool) or not isinstance(margin_bits, (int, float)) \
                or not math.isfinite(margin_bits):
            raise ValueError(f"`margin_bits` must be a finite number; got margin_bits={margin_bits!r}")
        self.initial_log2_factor = int(initial_log2_factor)
        self.min_log2_factor = int(min_log2_factor)
        self.max_log2_factor = int(max_log2_factor)
        self.adjust_period = int(adjust_period)
        self.margin_bits = float(margin_bits)
        self.supports_masking = True
        # A float32 variable of integer values: it stays on the accelerator
        # (TensorFlow keeps int32 tensors in host memory).
        # Not a weight, and out of reach of tracking: a loaded or restored
        # model starts unowned (see the class docstring).
        self._ownership = _Ownership()
        self.log2_factor = self.add_weight(
            shape=(),
            dtype="float32",
            initializer=keras.initializers.Constant(float(initial_log2_factor)),
            trainable=False,
            name="log2_factor",
            aggregation="only_first_replica",
        )

    def build(self, input_shape=None):
        self.built = True

    def call(self, inputs):
        return _identity_scaling_gradient(inputs, self)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype, sparse=inputs.sparse)

    def compute_output_shape(self, input_shape):
        return input_shape

    def exponent(self):
        """This step's exponent: `log2_factor` read as `integer_exponent` within this
        layer's bounds (a float32 scalar tensor). The one reading of the factor: the
        backward pass, the optimizer's division and `UnscaledInput` all use it (a
        traced backward pass reads an optimizer's boundaries together, elementwise
        the same: `tfdls._factor_readings`)."""
        return integer_exponent(self.log2_factor.value, self.min_log2_factor,
                                self.max_log2_factor)

    def factor(self) -> float:
        """The current factor, ``2**exponent()`` (a host read)."""
        return 2.0 ** float(self.exponent().numpy())

    def get_config(self):
        return {
            **super().get_config(),
            "initial_log2_factor": self.initial_log2_factor,
            "min_log2_factor": self.min_log2_factor,
            "max_log2_factor": self.max_log2_factor,
            "adjust_period": self.adjust_period,
            "margin_bits": self.margin_bits,
        }


def _identity_scaling_gradient(x, boundary):
    @tf.custom_gradient
    def identity(value):
        def backward(upstream):
            upstream = _dense(upstream)
            boundary._ownership.backward_calls += 1
            # The factor its owner's last scale_loss recorded: the same for every
            # backward pass and every apply of the step (`tfdls._record`).
            factor = _factor_readings.factor(boundary, upstream.dtype)
            scaled = _first_order_only(upstream * factor, boundary)
            seen.add(scaled, (boundary,))
            return scaled

        return tf.identity(value), backward

    if isinstance(x, (tf.Tensor, tf.Variable)) and not x.dtype.is_floating:
        return x
    return identity(x)


def _dense(upstream):
    # A gather above the layer sends IndexedSlices; the multiply and
    # custom_gradient need a tensor.
    if isinstance(upstream, tf.IndexedSlices):
        return tf.convert_to_tensor(upstream)
    return upstream


@keras.saving.register_keras_serializable(package="tfdls")
class UnscaledInput(keras.layers.Layer):
    """An identity at a model input whose backward pass divides out the boundaries above it.

    A `ScaleBoundary` multiplies every gradient that crosses it, and a
    gradient with respect to a model's input crosses every boundary above
    that input: a saliency map, or a GAN generator trained through a
    discriminator with boundaries, would otherwise carry their factors. This layer divides them out again, exactly (powers of
    two), so a gradient leaving the model carries the loss scale alone, as
    it would without boundaries.

    The rule: every floating-point model input whose gradient crosses a
    boundary is used only through an `UnscaledInput` placed directly on it;
    `read_boundaries` (and so ``LossScaleOptimizer(scale_boundaries=model)``)
    refuses a model where one is missing, and `add_scale_boundaries` places
    them. Which boundaries are above it is read from the model's graph when
    the model is read; until then (a model just loaded, never given to an
    optimizer) its boundaries are not owned and it is an identity both ways.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), tfdls.UnscaledInput(),
    ...                           keras.layers.Dense(2), tfdls.ScaleBoundary(initial_log2_factor=3),
    ...                           keras.layers.Dense(1)])
    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    >>> x = tf.constant([[1.0, 2.0]])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = tf.reduce_sum(model(x))
    >>> plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2),
    ...                           keras.layers.Dense(1)])  # no boundary, the same weights
    >>> plain.set_weights([v.numpy() for v in model.trainable_variables])
    >>> with tf.GradientTape() as tape2:
    ...     tape2.watch(x)
    ...     y2 = tf.reduce_sum(plain(x))
    >>> bool(tf.reduce_all(tape.gradient(y, x) == tape2.gradient(y2, x)))
    True
    """

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.built = True

    def call(self, inputs):
        return _identity_unscaling_gradient(inputs, self)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype, sparse=inputs.sparse)

    def compute_output_shape(self, input_shape):
        return input_shape


# {UnscaledInput: the boundaries above it}, set when its model is read. Out of
# the layer, where Keras would track the boundaries as its sublayers.
_boundaries_above_input = weakref.WeakKeyDictionary()
# {UnscaledInput: the graphs that traced its backward pass before its model
# was read}: such a trace divides by nothing, and its boundaries may be owned
# later. Weak both ways: a trace whose graph was released does not count.
_traced_unread = weakref.WeakKeyDictionary()


def _identity_unscaling_gradient(x, layer):
    # Which backward passes of the boundaries above had run when this call
    # went forward: every one of them must run again before this call's
    # backward pass, or the gradient did not cross it.
    above_at_call = _boundaries_above_input.get(layer)
    calls_at_forward = None if above_at_call is None else [
        b._ownership.backward_calls for b in above_at_call]

    @tf.custom_gradient
    def identity(value):
        def backward(upstream):
            upstream = _dense(upstream)
            above = _boundaries_above_input.get(layer)
            if above is None and not tf.executing_eagerly():
                graphs = _traced_unread.setdefault(layer, weakref.WeakSet())
                graphs.add(tf.compat.v1.get_default_graph())
            if not above:
                return upstream
            check_float64_chain(f"the gradient reaching the UnscaledInput {layer.name!r}",
                                upstream.dtype, above)
            if not tf.executing_eagerly():
                # Traced: exactly the boundaries this call's gradient crossed.
                crossed = {id(b) for b in seen.crossed_above(upstream)}
                missed = [b.name for b in above if id(b) not in crossed]
            elif above is above_at_call:
                # Eager: no graph to read; a boundary whose backward pass did not
                # run at all since this call went forward was not crossed.
                missed = [b.name for b, n in zip(above, calls_at_forward)
                          if b._ownership.backward_calls == n]
            else:
                missed = []
            if missed:
                raise ValueError(
                    f"tfdls: the gradient reaching the UnscaledInput {layer.name!r} did not "
                    f"cross the scale boundaries {missed} above it in its model, so it "
                    "cannot divide out the right factors: a model that shares its layers "
                    "but stops below a boundary (a feature extractor), or a loss on inner "
                    "activations. Take such features from a model without scale "
                    "boundaries."
                )
            # What the boundaries above multiplied this gradient by.
            exponents = [b._ownership.recorded_exponent.value() for b in above]
            total = tf.cast(tf.add_n(exponents), tf.int32)
            divided = _first_order_only(
                divide_by_power_of_two(upstream, total, 127 * len(above)), layer)
            seen.add(divided, above, divides=True)
            return divided

        return tf.identity(value), backward

    if isinstance(x, (tf.Tensor, tf.Variable)) and not x.dtype.is_floating:
        return x
    return identity(x)


def _first_order_only(gradient, layer):
    """`gradient`, refusing to be differentiated (a gradient penalty through a boundary).

    A second-order gradient through a boundary mixes scales: the penalty's
    gradient reaches a variable below a boundary without its factor (the
    factors of the inner gradient cancel at `UnscaledInput`), while the
    optimizer divides that variable's gradient by them. Refused, not guessed.
    """
    @tf.custom_gradient
    def identity(value):
        def second_order(upstream):
            raise ValueError(
                f"tfdls: a gradient of a gradient through {type(layer).__name__} {layer.name!r} "
                "(a gradient penalty, a Hessian-vector product): the model's variables' gradients "
                "would mix the scale boundaries' factors with terms that carry none, which "
                "no division can undo. Compute such terms on a model without scale "
                "boundaries."
            )

        return tf.identity(value), second_order

    return identity(gradient)


class _Ownership:
    """Holds the device flag "a LossScaleOptimizer owns this boundary" (not trackable)."""

    def __init__(self):
        with tf.init_scope():
            self.owned = tf.Variable(False, trainable=False, name="owned")
            # The exponent of this step: what every backward pass multiplies by and
            # the optimizer divides by. Recorded from `log2_factor` when ownership
            # is taken and by the owner's scale_loss (`record_factors`); each
            # replica records its own copy (ON_READ), in replica context.
            self.recorded_exponent = tf.Variable(
                0.0, trainable=False, name="recorded_exponent",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Backward passes run (eagerly) or traced so far: a Python count,
        # read by `UnscaledInput` to see that a gradient crossed the boundary.
        self.backward_calls = 0
        # The boundaries its owner reads together (`_factor_readings`).
        self.group = None


class _SeenBoundaries:
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
        if tf.executing_eagerly():
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
            [t for g in grads if g is not None for t in _tensors_of(g)])
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


def _tensors_of(grad):
    if isinstance(grad, tf.IndexedSlices):
        return [grad.values, grad.indices]
    return [grad] if isinstance(grad, tf.Tensor) else []


seen = _SeenBoundaries()


# The attribute that marks a variable with the owned boundaries above it.
_OWNED_ABOVE = "_tfdls_owned_boundaries_above"


def _mark(boundary_map, attribute):
    for variable, indices in boundary_map.variables:
        if not indices:
            continue
        for target in (variable, _compat.underlying_variable(variable)):
            if target is None:
                continue
            marks = getattr(target, attribute, None)
            if marks is None:
                marks = weakref.WeakSet()
                setattr(target, attribute, marks)
            marks.update(boundary_map.boundaries[i] for i in indices)


def _marks(variable, attribute):
    found = []
    for target in (variable, _compat.underlying_variable(variable)):
        found.extend(getattr(target, attribute, None) or ())
    return found


def take_ownership(boundary_map: "BoundaryMap") -> None:
    """Makes `boundary_map`'s boundaries scale, and marks each variable below them.

    The mark lets every `LossScaleOptimizer` refuse a variable whose gradient
    an owned boundary multiplies unless it was given that boundary, eagerly
    as well as traced.
    """
    group = _factor_readings.Group(boundary_map.boundaries)
    for boundary in boundary_map.boundaries:
        with tf.init_scope():  # now, even inside a trace: a group's members are owned
            boundary._ownership.owned.assign(True)
            # Until its owner's first scale_loss records them: the factor in force.
            boundary._ownership.recorded_exponent.assign(boundary.exponent())
        boundary._ownership.group = group
    _mark(boundary_map, _OWNED_ABOVE)


# -- losses that enter below a boundary ---------------------------------------------
#
# The rule: a gradient reaches a layer below an owned boundary only through a call
# of the model that was given to the optimizer. A loss term computed from an inner
# activation by calling such a layer directly (deep supervision, an auxiliary
# head, a feature extractor sharing the layers) reaches its variables without the
# boundaries' factors, which the optimizer divides out: such a call, made under a
# GradientTape, returns its outputs through an identity whose backward pass
# raises. Eagerly and traced alike; a call whose outputs no gradient flows into
# (inference, a target under `tf.stop_gradient`) and a frozen layer are unaffected.

# {layer below a boundary: (its owned model, the boundary above it)}, and the
# owned models whose call is wrapped; weak.
_guarded_layers = weakref.WeakKeyDictionary()
_wrapped_models = weakref.WeakSet()
# Per thread (MirroredStrategy calls replicas in threads): the owned models
# whose call is in progress.
_models_in_call = threading.local()


def _calls_in_progress():
    if not hasattr(_models_in_call, "stack"):
        _models_in_call.stack = []
    return _models_in_call.stack


def _wrap_model_call(model):
    original = model.call

    def call(*args, **kwargs):
        stack = _calls_in_progress()
        stack.append(model)
        try:
            return original(*args, **kwargs)
        finally:
            stack.pop()

    call.__wrapped__ = original
    model.call = call


def _wrap_layer_call(layer):
    original = layer.call

    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        model_ref, boundary_ref = _guarded_layers[layer]
        model = model_ref()
        if (model is None or any(m is model for m in _calls_in_progress())
                or not _compat.tape_may_record()):
            return outputs
        if not layer.trainable_weights and not isinstance(layer, UnscaledInput):
            # Nothing of its own to update wrongly (a frozen layer): layers below
            # it that can be updated are refused by their own calls.
            return outputs
        message = _outside_message(layer, boundary_ref(), model)
        return tf.nest.map_structure(
            lambda t: _refused_gradient(t, message)
            if isinstance(t, tf.Tensor) and t.dtype.is_floating else t, outputs)

    call.__wrapped__ = original
    layer.call = call


def _outside_message(layer, boundary, model):
    return (
        f"tfdls: a gradient flowed into the layer {layer.name!r}, which is below the scale "
        f"boundary {getattr(boundary, 'name', '?')!r}, from a call outside its model "
        f"{model.name!r} (a loss on an inner activation: deep supervision, an auxiliary "
        "head, a feature extractor that shares its layers). Such a term's gradient "
        "reaches the layer's variables without the boundaries' factors that the optimizer "
        "divides out, so their update would be wrong. Compute such terms from a model "
        "without scale boundaries or keep them above every boundary; for a target "
        "(distillation, a perceptual loss), wrap it in tf.stop_gradient or freeze those "
        "layers (trainable=False)."
    )


def _refused_gradient(tensor, message):
    @tf.custom_gradient
    def identity(value):
        def backward(upstream):
            raise ValueError(message)

        return tf.identity(value), backward

    return identity(tensor)


def guard_layers_below(model, boundary_map: "BoundaryMap") -> None:
    """Installs the rule above for `model`'s layers below boundaries (see the comment)."""
    if model not in _wrapped_models:
        _wrapped_models.add(model)
        _wrap_model_call(model)
    for layer, boundary in boundary_map.layers_below:
        wrapped = layer in _guarded_layers
        _guarded_layers[layer] = (weakref.ref(model), weakref.ref(boundary))
        if not wrapped:
            _wrap_layer_call(layer)


def record_factors(boundaries) -> None:
    """`scale_loss`: the factors now (`ScaleBoundary.exponent`) become this step's, which
    every backward pass multiplies by and `apply` divides by until the next call."""
    if not boundaries:
        return
    exponents = current_exponents(boundaries)
    for boundary, exponent in zip(boundaries, tf.unstack(exponents, len(boundaries))):
        boundary._ownership.recorded_exponent.assign(exponent)


def current_exponents(boundaries):
    """The factors now, one vector read: each `log2_factor` read as `ScaleBoundary.exponent`
    reads it, within its layer's bounds."""
    values = tf.stack([b.log2_factor.value for b in boundaries])
    low = np.array([b.min_log2_factor for b in boundaries], np.float32)
    high = np.array([b.max_log2_factor for b in boundaries], np.float32)
    return integer_exponent(values, low, high)


def owned_boundaries_above(variable) -> list:
    """The owned boundaries above `variable` in the models optimizers were given."""
    return _marks(variable, _OWNED_ABOVE)


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
    def unknown(boundaries):
        return sorted({b.name for b in boundaries if not any(b is k for k in known)})

    for variable in variables:
        names = unknown(owned_boundaries_above(variable))
        if names:
            path = getattr(variable, "path", None) or variable.name
            raise ValueError(
                f"tfdls: the variable {path!r} is below the scale boundaries {names}, "
                "which another LossScaleOptimizer owns (they multiply its gradient) and "
                "this optimizer was not given, so it cannot divide out their factors. "
                "Give it the model: LossScaleOptimizer(..., scale_boundaries=model), or "
                "optimizer.set_scale_boundaries(model)."
            )
    if tf.executing_eagerly() or not seen.any_crossed():
        return
    names = unknown(seen.crossed_undivided(grads))
    if names:
        raise ValueError(
            f"tfdls: the gradients crossed the scale boundaries {names}, which this "
            "optimizer was not given, so it cannot divide out their factors. Give it "
            "the model: LossScaleOptimizer(..., scale_boundaries=model), or "
            "optimizer.set_scale_boundaries(model) after loading a saved model."
        )


# -- reading a model's boundaries ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BoundaryMap:
    """The boundaries of a model and, per variable, the boundaries above it.

    Attributes:
        boundaries: the `ScaleBoundary` layers, every one after the boundary
            above it (parents first).
        parents: per boundary, the index of the nearest boundary above it,
            or -1.
        chains: ``{variable key: indices of the boundaries above it, nearest
            first}``; a variable above every boundary has ``()``.
        names: ``{variable key: variable path}``.
        variables: ``(variable, chain)`` pairs, one per weight.
        layers_below: ``(layer, nearest boundary above it)`` pairs.
    """

    boundaries: tuple
    parents: tuple
    chains: dict
    names: dict
    variables: tuple = ()
    layers_below: tuple = ()

    def layers_with_losses(self):
        """The layers below a boundary whose last call added a loss (`add_loss`, or a
        regularizer of a layer inside them); a Python read, at trace time."""
        return [(layer, b) for layer, b in self.layers_below if layer.losses]

    def chain_of(self, variable):
        """The boundary indices above `variable` (nearest first), or None if unknown."""
        for key in _keys(variable):
            if key in self.chains:
                return self.chains[key]
        return None


def _keys(variable):
    keys = [id(variable)]
    inner = _compat.underlying_variable(variable)
    if inner is not None:
        keys.append(id(inner))
    return keys


def _contains_boundary(layer):
    if isinstance(layer, ScaleBoundary):
        return True
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:
        return False
    return any(isinstance(sub, ScaleBoundary) for sub in flatten(include_self=False))


def _is_graph_model(model):
    return isinstance(model, keras.Sequential) or (
        isinstance(model, keras.Model) and _compat.nodes_by_depth(model) is not None
    )


def read_boundaries(model) -> BoundaryMap:
    """Reads `model`'s `ScaleBoundary` layers and the boundaries above each variable.

    Raises:
        ValueError: `model` is not a Sequential or functional Keras model; a
            layer reaches the outputs on paths crossing different boundaries;
            a layer below a boundary has a regularizer or a variable with
            ``overwrite_with_gradient``; a boundary is inside a nested layer;
            no boundary above a variable has a trainable variable above it.
    """
    if not isinstance(model, keras.Model) or not _is_graph_model(model):
        raise ValueError(
            "scale_boundaries must be a Sequential or functional keras.Model, whose "
            f"graph tfdls can read; got scale_boundaries={model!r}"
        )
    if isinstance(model, keras.Sequential):
        layer_chains, order, input_uses = _sequential_chains(model)
    else:
        layer_chains, order, input_uses = _functional_chains(model)
    for layer in layer_chains:
        if not isinstance(layer, ScaleBoundary) and _contains_boundary(layer):
            raise ValueError(
                f"tfdls: the layer {layer.name!r} contains a ScaleBoundary inside it, where "
                "tfdls cannot read which variables are below it; place boundaries in the "
                "outermost Sequential or functional model."
            )
    # Parents first: a boundary has fewer boundaries above it than those below it.
    boundaries = sorted(
        (b for b in order if isinstance(b, ScaleBoundary)), key=lambda b: len(layer_chains[b])
    )
    index = {id(b): i for i, b in enumerate(boundaries)}
    parents = []
    for b in boundaries:
        chain = layer_chains[b]
        parents.append(index[id(chain[0])] if chain else -1)
    chains, names, variables, layers_below = {}, {}, [], []
    for layer, chain in layer_chains.items():
        if isinstance(layer, ScaleBoundary):
            continue
        if chain:
            _check_below_boundary(layer, chain)
            layers_below.append((layer, chain[0]))
        # Every weight, frozen or not: a layer may be unfrozen after this read.
        for variable in layer.weights:
            indices = tuple(index[id(b)] for b in chain)
            for key in _keys(variable):
                previous = chains.get(key)
                if previous is not None and previous != indices:
                    raise ValueError(
                        f"tfdls: the variable {names[key]!r} is used by layers below different "
                        f"scale boundaries ({[boundaries[i].name for i in previous]} and "
                        f"{[boundaries[i].name for i in indices]}, the second at layer "
                        f"{layer.name!r}); its gradient would mix two scales. Share no "
                        "variable across a boundary."
                    )
                chains[key] = indices
                names[key] = getattr(variable, "path", None) or variable.name
            variables.append((variable, indices))
    if boundaries and not any(not c for v, c in variables if v.trainable):
        raise ValueError(
            "tfdls: every trainable variable of the model is below a scale boundary; the "
            "top boundary then does what the global loss scale does and has no block to "
            "compare with. Remove it, or move it below a layer with weights."
        )
    _check_inputs_unscaled(input_uses)
    for layer, chain in layer_chains.items():
        if isinstance(layer, UnscaledInput):
            previous = _boundaries_above_input.get(layer)
            if previous is None and chain and _live_traces(layer):
                raise ValueError(
                    f"tfdls: the gradient through the UnscaledInput {layer.name!r} was traced "
                    "in a tf.function before its model was given to an optimizer (or to "
                    "add_scale_boundaries), so that trace does not divide out the scale "
                    f"boundaries {[b.name for b in chain]}, which this optimizer would make "
                    "scale. Give the model to the optimizer first, then trace; rebuild or "
                    "reload the model to start over."
                )
            if previous is not None and [id(b) for b in previous] != [id(b) for b in chain]:
                raise ValueError(
                    f"tfdls: the UnscaledInput {layer.name!r} is below the scale boundaries "
                    f"{[b.name for b in previous]} in one model and {[b.name for b in chain]} "
                    "in another; it can divide out only one set. Give each model its own."
                )
    boundary_map = BoundaryMap(tuple(boundaries), tuple(parents), chains, names,
                               tuple(variables), tuple(layers_below))
    # Read and checked: now the model's inputs divide out the boundaries above them.
    for layer, chain in layer_chains.items():
        if isinstance(layer, UnscaledInput):
            _boundaries_above_input[layer] = tuple(chain)
    return boundary_map


def _live_traces(layer):
    if layer not in _traced_unread:
        return False
    gc.collect()  # a failed trace's graph is garbage, not a trace to refuse
    return len(_traced_unread.get(layer, ())) > 0


def _check_inputs_unscaled(input_uses):
    """Refuses a float model input used, below a boundary, other than through an `UnscaledInput`.

    `input_uses`: ``(input name, dtype, consuming layer, chain)`` per use of a
    model input, ``chain`` the boundaries above the use (None: no path to the
    outputs); a boundary consuming the input directly counts as above it.
    """
    for name, dtype, layer, chain in input_uses:
        if isinstance(layer, UnscaledInput) or not chain:
            continue
        if not tf.as_dtype(dtype).is_floating:
            continue  # no gradient with respect to it (token ids, masks)
        raise ValueError(
            f"tfdls: the model input {name!r} is used by layer {layer.name!r}, below the "
            f"scale boundaries {[b.name for b in chain]}: the gradient with respect to that "
            "input (a saliency map, a GAN generator trained through this model) would "
            "carry their factors. Use the input only through a tfdls.UnscaledInput() placed "
            "directly on it (add_scale_boundaries places one), which divides them out."
        )


def _check_below_boundary(layer, chain):
    below = f"layer {layer.name!r} is below the scale boundary {chain[0].name!r}"
    for attribute in ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                      "embeddings_regularizer", "depthwise_regularizer",
                      "pointwise_regularizer", "recurrent_regularizer", "gamma_regularizer",
                      "beta_regularizer"):
        if getattr(layer, attribute, None) is not None:
            raise ValueError(
                f"tfdls: the {below} and has {attribute}={getattr(layer, attribute)!r}: its "
                "loss term reaches the variables without crossing the boundary, so their "
                "gradients would mix two scales. Remove the regularizer (use the inner "
                "optimizer's weight_decay) or move the boundary below this layer."
            )
    for variable in layer.weights:
        if getattr(variable, "overwrite_with_gradient", False):
            raise ValueError(
                f"tfdls: the {below} and its variable {variable.path!r} takes its gradient "
                "as a value (overwrite_with_gradient), which a boundary would scale. Move "
                "the boundary below this layer."
            )


def _sequential_chains(model):
    layers = list(model.layers)
    chains = {}
    above = ()
    for layer in reversed(layers):
        if layer in chains:
            raise ValueError(
                f"tfdls: the layer {layer.name!r} appears twice in the Sequential model; "
                "tfdls cannot tell which boundaries are above its variables."
            )
        chains[layer] = above
        if isinstance(layer, ScaleBoundary):
            above = (layer,) + above
    for position, layer in enumerate(layers):
        if isinstance(layer, UnscaledInput) and position > 0:
            raise ValueError(
                f"tfdls: the UnscaledInput {layer.name!r} is not the first layer of the "
                "Sequential model; it divides the gradient of the model's input, so it goes "
                "directly on the input."
            )
    input_uses = []
    if layers:
        first = layers[0]
        inputs = getattr(model, "inputs", None) or []
        dtype = inputs[0].dtype if inputs else "float32"
        name = _input_name(inputs[0]) if inputs else "input"
        chain = chains[first] + ((first,) if isinstance(first, ScaleBoundary) else ())
        input_uses.append((name, dtype, first, chain))
    return chains, layers, input_uses


def _functional_chains(model):
    """Per layer: the boundaries every path from its outputs to the model's outputs crosses."""
    depths = sorted(_compat.nodes_by_depth(model).keys())  # 0: the output nodes
    outputs = {id(t) for t in model.outputs}
    consumers = {}
    nodes = []
    for depth in depths:
        for node in _compat.nodes_by_depth(model)[depth]:
            nodes.append(node)
            for tensor in node.input_tensors:
                consumers.setdefault(id(tensor), []).append(node)
    tensor_chain = {}  # id(tensor) -> tuple of boundaries, or None (no path to the loss)
    node_chain = {}

    def combine(found, candidate, where):
        if candidate is None:
            return found
        if found is None or found == candidate:
            return candidate
        raise _MixedPaths(where, found, candidate)

    def chain_of_tensor(tensor):
        key = id(tensor)
        if key in tensor_chain:
            return tensor_chain[key]
        found = () if key in outputs else None
        history = getattr(tensor, "_keras_history", None)
        producer = history.operation if history is not None else None
        for node in consumers.get(key, ()):
            candidate = node_chain_of(node)
            if candidate is not None and isinstance(node.operation, ScaleBoundary):
                candidate = (node.operation,) + candidate
            found = combine(found, candidate, producer or node.operation)
        tensor_chain[key] = found
        return found

    def node_chain_of(node):
        if id(node) in node_chain:
            return node_chain[id(node)]
        found = None
        for tensor in node.output_tensors:
            found = combine(found, chain_of_tensor(tensor), node.operation)
        node_chain[id(node)] = found
        return found

    layer_chains = {}
    order = []
    input_ids = {id(t) for t in model.inputs}
    input_uses = []
    # Nodes from the outputs down: a node's consumers are resolved first.
    for node in nodes:
        layer = node.operation
        if layer is None or getattr(node, "is_input", False):
            continue
        try:
            chain = node_chain_of(node)
        except _MixedPaths as mixed:
            raise ValueError(_mixed_names(mixed.layer, mixed.first, mixed.second)) from None
        if chain is None:
            continue
        if not isinstance(layer, keras.layers.Layer):
            # An operation (keras.ops, slicing): no weights, but a use of an
            # input all the same.
            for tensor in node.input_tensors:
                if id(tensor) in input_ids:
                    input_uses.append((_input_name(tensor), tensor.dtype, layer, chain))
            continue
        if layer in layer_chains and layer_chains[layer] != chain:
            raise ValueError(_mixed_names(layer, layer_chains[layer], chain, shared=True))
        if layer not in layer_chains:
            order.append(layer)
        layer_chains[layer] = chain
        if isinstance(layer, UnscaledInput) and not all(
                id(t) in input_ids for t in node.input_tensors):
            raise ValueError(
                f"tfdls: the UnscaledInput {layer.name!r} is not placed directly on a model "
                "input; it divides the gradient of the model's input, so it goes directly on "
                "the input."
            )
        use_chain = chain + ((layer,) if isinstance(layer, ScaleBoundary) else ())
        for tensor in node.input_tensors:
            if id(tensor) in input_ids:
                input_uses.append((_input_name(tensor), tensor.dtype, layer, use_chain))
    return layer_chains, order, input_uses


def _input_name(tensor):
    history = getattr(tensor, "_keras_history", None)
    operation = history.operation if history is not None else None
    return getattr(operation, "name", None) or getattr(tensor, "name", "input")


class _MixedPaths(Exception):
    def __init__(self, layer, first, second):
        super().__init__()
        self.layer, self.first, self.second = layer, first, second


def _mixed_names(layer, first, second, shared=False):
    if shared:
        return (
            f"tfdls: the layer {layer.name!r} is called at more than one place in the model, "
            f"below different scale boundaries ({[b.name for b in first]} at one, "
            f"{[b.name for b in second]} at another); its gradient would mix two scales. "
            "Place boundaries so every call of a shared layer is below the same ones "
            "(add_scale_boundaries cannot for this model), or share no layer across one."
        )
    return (
        f"tfdls: the gradient of layer {layer.name!r} reaches the model's outputs on paths "
        f"that cross different scale boundaries ({[b.name for b in first]} on one, "
        f"{[b.name for b in second]} on another), for example through a residual "
        "connection around a boundary; its gradient would mix two scales. Move the "
        "boundary to a point every path crosses (after the residual add) or remove it."
    )


# -- automatic placement -------------------------------------------------------------


def add_scale_boundaries(model, every: int = 1, **boundary_kwargs: Any):
    """A copy of `model` with a `ScaleBoundary` after every `every` layers with weights.

    The copy shares `model`'s layers (and so its weights). Boundaries go only
    where every path from the layers below to the outputs passes: in a
    Sequential model after any layer, in a functional model at a tensor that
    is the only one computed so far and still needed (after a residual add,
    never inside the block it closes). None goes above the last layer with
    weights.

    Args:
        model: a Sequential or functional `keras.Model` without boundaries.
        every: how many layers with trainable weights each block holds.
        **boundary_kwargs: passed to every `ScaleBoundary`.

    Returns:
        A new model of the same kind, to compile with
        ``tfdls.LossScaleOptimizer(..., scale_boundaries=new_model)``.

    Example:

    >>> inputs = keras.Input((4,), name="x")
    >>> h = keras.layers.Dense(4, name="stem")(inputs)
    >>> branch = keras.layers.Dense(4, name="branch")(h)
    >>> h = keras.layers.Add(name="add")([h, branch])
    >>> model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    >>> placed = tfdls.add_scale_boundaries(model)
    >>> [layer.name for layer in placed.layers[1:]]  # never between stem and add
    ['unscaled_x', 'stem', 'scale_boundary_1', 'branch', 'add', 'scale_boundary_2', 'head']
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"`every` must be an int >= 1; got every={every!r}")
    if not isinstance(model, keras.Model) or not _is_graph_model(model):
        raise ValueError(
            "add_scale_boundaries needs a Sequential or functional keras.Model; "
            f"got model={model!r}"
        )
    if any(_contains_boundary(layer) for layer in model.layers):
        raise ValueError(
            f"the model {model.name!r} already has scale boundaries; add them once."
        )
    if not model.built or not model.trainable_variables:
        raise ValueError(
            f"add_scale_boundaries needs a built model with trainable weights (start it with "
            f"keras.Input, or call model.build); got model={model.name!r}, built={model.built}"
        )
    if isinstance(model, keras.Sequential):
        placed = _add_to_sequential(model, every, boundary_kwargs)
    else:
        placed = _add_to_functional(model, every, boundary_kwargs)
    if not any(isinstance(layer, ScaleBoundary) for layer in placed.layers):
        raise ValueError(
            f"add_scale_boundaries found no place for a boundary in {model.name!r} with "
            f"every={every}: it needs more than `every` layers with weights, and a point "
            "every path passes between them."
        )
    # What the optimizer would refuse (a layer called at two depths, a
    # regularizer below a boundary) is refused here, naming the cause.
    read_boundaries(placed)
    return placed


def _has_weights(layer):
    return bool(layer.trainable_variables)


def _add_to_sequential(model, every, boundary_kwargs):
    new_layers = []
    if getattr(model, "_functional", None) is not None:
        new_layers.append(keras.Input(batch_shape=model.inputs[0].shape, dtype=model.inputs[0].dtype))
        unscaled = int(tf.as_dtype(model.inputs[0].dtype).is_floating)
    else:
        unscaled = 1  # it passes integer inputs through
    if unscaled:
        new_layers.append(UnscaledInput(name="unscaled_input"))
    since, pending = 0, False
    for layer in model.layers:
        if _has_weights(layer) and pending:
            # Right below the next layer with weights, after any without
            # (activations, dropout): XLA then need not copy the multiply
            # into several consumers of a residual sum.
            new_layers.append(ScaleBoundary(name=f"scale_boundary_{len(new_layers) - unscaled}", **boundary_kwargs))
            since, pending = 0, False
        new_layers.append(layer)
        if _has_weights(layer):
            since += 1
            pending = since >= every
    return keras.Sequential(new_layers, name=f"{model.name}_with_boundaries")


def _add_to_functional(model, every, boundary_kwargs):
    depths = sorted(_compat.nodes_by_depth(model).keys(), reverse=True)  # inputs first
    nodes = [n for d in depths for n in _compat.nodes_by_depth(model)[d]
             if n.operation is not None and not getattr(n, "is_input", False)]
    inputs = {id(t) for t in model.inputs}
    outputs = {id(t) for t in model.outputs}
    last_use = {}
    for position, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = position
    # Cut points: after a node, the only live tensor (computed, not a model
    # input, still needed later) is its single output. A boundary goes at the
    # last cut before the next layer with weights, once `every` such layers
    # are below it (as in a Sequential model, after any layer without weights).
    cuts = set()
    live = set()
    since, pending = 0, None
    for position, node in enumerate(nodes):
        weighted = isinstance(node.operation, keras.layers.Layer) and _has_weights(node.operation)
        if weighted and pending is not None:
            cuts.add(pending)
            since, pending = 0, None
        for tensor in node.output_tensors:
            if last_use.get(id(tensor), -1) > position or id(tensor) in outputs:
                live.add(id(tensor))
        live = {k for k in live if last_use.get(k, -1) > position or k in outputs}
        if weighted:
            since += 1
        outs = node.output_tensors
        if (since >= every and len(outs) == 1 and live == {id(outs[0])}
                and id(outs[0]) not in outputs and id(outs[0]) not in inputs
                and "float" in str(outs[0].dtype)):
            pending = id(outs[0])
    new_inputs = [
        keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history.operation.name)
        for t in model.inputs
    ]
    values = {id(old): new for old, new in zip(model.inputs, new_inputs)}
    input_names = {id(old): new.name for old, new in zip(model.inputs, new_inputs)}
    uses = {}
    count = 0
    for node in nodes:
        node_values = values
        # Each use of a float input through its own UnscaledInput: one used
        # below a boundary and also above it divides each path by its own.
        for tensor in node.input_tensors:
            if id(tensor) in input_names and "float" in str(tensor.dtype):
                if node_values is values:
                    node_values = dict(values)
                name = f"unscaled_{input_names[id(tensor)]}"
                uses[name] = uses.get(name, 0) + 1
                if uses[name] > 1:
                    name = f"{name}_{uses[name]}"
                node_values[id(tensor)] = UnscaledInput(name=name)(values[id(tensor)])
        args, kwargs = node.arguments.fill_in(node_values)
        result = node.operation(*args, **kwargs)
        flat = keras.tree.flatten(result)
        for old, new in zip(node.output_tensors, flat):
            if id(old) in cuts:
                count += 1
                new = ScaleBoundary(name=f"scale_boundary_{count}", **boundary_kwargs)(new)
            values[id(old)] = new
    structure = _compat.outputs_structure(model)
    new_outputs = ([values[id(t)] for t in model.outputs] if structure is None
                   else keras.tree.map_structure(lambda t: values[id(t)], structure))
    return keras.Model(new_inputs if len(new_inputs) > 1 else new_inputs[0], new_outputs,
                       name=f"{model.name}_with_boundaries")
