"""Reading a model: which boundaries lie above each variable (`read_boundaries`)."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfdls import _compat
from tfdls.boundaries import registry
from tfdls.boundaries.layers import ScaleBoundary, UnscaledInput



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
            previous = registry.boundaries_above_input.get(layer)
            if previous is None and chain and layer in registry.traced_unread:
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
            registry.boundaries_above_input[layer] = tuple(chain)
    return boundary_map


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

