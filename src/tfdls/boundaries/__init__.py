"""Scale boundaries: a loss scale per block of layers, for gradients one global scale cannot hold.

The package, one room each: `layers` (`ScaleBoundary`, `UnscaledInput`),
`readings` (how a backward pass reads the factors), `registry` (every
record kept outside the layers, in one place), `reading` (`read_boundaries`:
the boundaries above each variable), `placement` (`add_scale_boundaries`),
`ownership` (an optimizer takes a model's boundaries; each step's record of
the factors), `guard` (losses below a boundary) and `step` (the plug-in
`LossScaleOptimizer` holds: `BoundaryScales` and one step's `BoundaryStep`).

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

from tfdls.boundaries.layers import (
    MAX_FLOAT64_CHAIN, MAX_LOG2_FACTOR, MIN_LOG2_FACTOR, ScaleBoundary, UnscaledInput,
    check_float64_chain)
from tfdls.boundaries.readings import integer_exponent
from tfdls.boundaries.registry import owned_boundaries_above, seen, tensors_of
from tfdls.boundaries.ownership import (
    current_exponents, record_factors, refuse_boundaries_not_given, take_ownership)
from tfdls.boundaries.guard import guard_layers_below
from tfdls.boundaries.reading import BoundaryMap, read_boundaries
from tfdls.boundaries.placement import add_scale_boundaries

__all__ = [
    "MAX_FLOAT64_CHAIN", "MAX_LOG2_FACTOR", "MIN_LOG2_FACTOR", "BoundaryMap", "ScaleBoundary",
    "UnscaledInput", "add_scale_boundaries", "check_float64_chain", "current_exponents",
    "guard_layers_below", "integer_exponent", "owned_boundaries_above", "read_boundaries",
    "record_factors", "refuse_boundaries_not_given", "seen", "take_ownership", "tensors_of",
]
