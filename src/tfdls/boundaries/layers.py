"""The layers: `ScaleBoundary` (multiplies the gradient by its factor) and `UnscaledInput`
(divides the factors above it out of a gradient leaving the model through an input)."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdls._division import divide_by_power_of_two
from tfdls.boundaries import readings, registry
from tfdls.boundaries.readings import integer_exponent  # noqa: F401



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
    both ways, so nothing else ever sees a scaled gradient. The backward
    pass multiplies by the exponent recorded on the device (0 until an
    optimizer owns the boundary), read when it runs, not when it is traced;
    once owned, a boundary stays owned.

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
        the same: `tfdls.boundaries.readings`)."""
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
            factor = readings.factor(boundary, upstream.dtype)
            scaled = _first_order_only(upstream * factor, boundary)
            registry.seen.add(scaled, (boundary,))
            return scaled

        # No tf.identity of our own: tf.custom_gradient already returns an identity
        # of the result (an IdentityN in a graph), one op per boundary fewer to trace.
        return value, backward

    if isinstance(x, (tf.Tensor, tf.Variable)) and not x.dtype.is_floating:
        return x
    return identity(_tensor(x))


def _tensor(x):
    # A variable given as input is read here: `identity` returns its argument.
    return tf.convert_to_tensor(x) if isinstance(x, (tf.Variable, keras.Variable)) else x


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

def _identity_unscaling_gradient(x, layer):
    # Which backward passes of the boundaries above had run when this call
    # went forward: every one of them must run again before this call's
    # backward pass, or the gradient did not cross it.
    above_at_call = registry.boundaries_above_input.get(layer)
    calls_at_forward = None if above_at_call is None else [
        b._ownership.backward_calls for b in above_at_call]

    @tf.custom_gradient
    def identity(value):
        def backward(upstream):
            upstream = _dense(upstream)
            above = registry.boundaries_above_input.get(layer)
            if above is None and not tf.executing_eagerly():
                registry.traced_unread.add(layer)
            if not above:
                return upstream
            check_float64_chain(f"the gradient reaching the UnscaledInput {layer.name!r}",
                                upstream.dtype, above)
            if not tf.executing_eagerly():
                # Traced: exactly the boundaries this call's gradient crossed.
                crossed = {id(b) for b in registry.seen.crossed_above(upstream)}
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
            registry.seen.add(divided, above, divides=True)
            return divided

        return value, backward  # tf.custom_gradient adds the identity

    if isinstance(x, (tf.Tensor, tf.Variable)) and not x.dtype.is_floating:
        return x
    return identity(_tensor(x))


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

        return value, second_order  # tf.custom_gradient adds the identity

    return identity(gradient)


class _Ownership:
    """Holds what the boundary's owner recorded on the device (not trackable)."""

    def __init__(self):
        with tf.init_scope():
            # The exponent of this step: what every backward pass multiplies by and
            # the optimizer divides by. 0 (an identity) until a LossScaleOptimizer
            # owns the boundary; then `exponent()` as recorded when ownership is
            # taken and by the owner's scale_loss (`record_factors`), nothing else;
            # each replica records its own copy (ON_READ), in replica context.
            self.recorded_exponent = tf.Variable(
                0.0, trainable=False, name="recorded_exponent",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Backward passes run (eagerly) or traced so far: a Python count,
        # read by `UnscaledInput` to see that a gradient crossed the boundary.
        self.backward_calls = 0
        # The boundaries its owner reads together (`tfdls.boundaries.readings`).
        self.group = None
