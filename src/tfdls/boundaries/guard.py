"""Losses that enter below a boundary: refused where a gradient would skip its factors.

The rule: a gradient reaches a layer below an owned boundary only through a call
of the model that was given to the optimizer (see the comment below).
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tfdls import _compat
from tfdls.boundaries import registry
from tfdls.boundaries.layers import UnscaledInput

#
# The rule: a gradient reaches a layer below an owned boundary only through a call
# of the model that was given to the optimizer. A loss term computed from an inner
# activation by calling such a layer directly (deep supervision, an auxiliary
# head, a feature extractor sharing the layers) reaches its variables without the
# boundaries' factors, which the optimizer divides out: such a call, made under a
# GradientTape, returns its outputs through an identity whose backward pass
# raises. Eagerly and traced alike; a call whose outputs no gradient flows into
# (inference, a target under `tf.stop_gradient`) and a frozen layer are unaffected.



def _calls_in_progress():
    if not hasattr(registry.models_in_call, "stack"):
        registry.models_in_call.stack = []
    return registry.models_in_call.stack


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
        model_ref, boundary_ref = registry.guarded_layers[layer]
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


def guard_layers_below(model, boundary_map) -> None:
    """Installs the rule above for `model`'s layers below boundaries (see the comment)."""
    if model not in registry.wrapped_models:
        registry.wrapped_models.add(model)
        _wrap_model_call(model)
    for layer, boundary in boundary_map.layers_below:
        wrapped = layer in registry.guarded_layers
        registry.guarded_layers[layer] = (weakref.ref(model), weakref.ref(boundary))
        if not wrapped:
            _wrap_layer_call(layer)

