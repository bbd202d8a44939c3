"""Automatic placement: `add_scale_boundaries`."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfdls import _compat
from tfdls.boundaries.layers import ScaleBoundary, UnscaledInput
from tfdls.boundaries.reading import _contains_boundary, _is_graph_model, read_boundaries



def add_scale_boundaries(model, every: int = 1, **boundary_kwargs: Any):
    """A copy of `model` with a `ScaleBoundary` after every `every` layers with weights.

    The copy shares `model`'s layers (and so its weights). Boundaries go only
    where every path from the layers below to the outputs passes: in a
    Sequential model after any layer, in a functional model at a tensor that
    is the only one computed so far and still needed (after a residual add,
    never inside the block it closes), and never between two calls of one
    layer. None goes above the last layer with weights.

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
    calls = {}  # a layer -> the positions of its calls
    for position, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = position
        calls.setdefault(id(node.operation), []).append(position)
    # No cut between two calls of one layer: each call would be below other
    # boundaries, which the optimizer refuses (`read_boundaries`).
    inside_a_shared_layer = {p for places in calls.values()
                             for p in range(places[0], places[-1])}
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
                and position not in inside_a_shared_layer
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
