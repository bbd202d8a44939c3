"""Unscaling folded into the learning rate, for SGD.

Keras' `SGD` (plain, momentum or Nesterov) touches each gradient only as
``gradient * learning_rate``. Handing it the scaled gradient with a learning
rate of ``learning_rate * (1 / scale)`` therefore applies the same update
without a separate unscaling pass that reads and writes every gradient (in
graph mode TensorFlow fuses nothing, so that pass costs as much as a third of
the bare SGD step).

It is exact: ``1 / scale`` is a power of two for every scale a dynamic loss
scale reaches from a power-of-two start with the default `multiplier` and
`backoff_factor`, and multiplying by a power of two only shifts the exponent,
so ``g * (lr / s)`` and ``(g / s) * lr`` round identically (other scales
differ in the last bit at most; where ``g / s`` would be subnormal the fold is
the more precise). Only the learning rate handed to the update step changes:
weight decay and the schedule still see the real one. The caller folds only
while the scale cannot fall below 1, when checking the scaled gradients is as
good as checking unscaled ones.

Not eligible (they use the gradient before the update step or the learning
rate in narrow floats), keeping the explicit unscale: subclasses of SGD,
gradient clipping, gradient accumulation, sparse gradients, variables that are
not float32/float64 (``lr / scale`` would underflow float16) and
overwrite-with-gradient variables.
"""

import contextlib
import threading
import types

import keras
import tensorflow as tf

_WIDE_FLOATS = (tf.float32, tf.float64)


def eligible(inner_optimizer, grads, trainable_variables):
    """Whether `inner_optimizer` can take scaled `grads` and a scaled learning rate."""
    if type(inner_optimizer) is not keras.optimizers.SGD:
        return False  # a subclass may use the gradient in another way
    if "_backend_update_step" not in vars(inner_optimizer):
        return False  # not installed (see `install`): unscale explicitly
    # These use the gradient before the update step.
    preprocessing = (
        inner_optimizer.clipnorm,
        inner_optimizer.clipvalue,
        inner_optimizer.global_clipnorm,
        inner_optimizer.gradient_accumulation_steps,
    )
    dense = not any(isinstance(g, tf.IndexedSlices) for g in grads)
    return (
        not any(preprocessing)
        and dense
        and all(
            tf.as_dtype(v.dtype) in _WIDE_FLOATS
            and not getattr(v, "overwrite_with_gradient", False)
            for v in trainable_variables
        )
    )


class _ActiveScale(threading.local):
    """Per thread: the scale (a tensor) to fold into the learning rate, or None.

    Thread-local because MirroredStrategy runs each replica's `apply` in its own
    thread; the update step reads it in the thread that calls it.
    """

    scale = None


_active = _ActiveScale()


def install(inner_optimizer):
    """Routes a Keras `SGD`'s update step through the fold (idempotent).

    Other optimizers are left alone. Outside `learning_rate_divided_by` the
    installed step is the plain one. Installed once, at build time, rather
    than per step: replicas run concurrently and must not wrap each other's
    wrapper.
    """
    if type(inner_optimizer) is not keras.optimizers.SGD:
        return
    if "_backend_update_step" in vars(inner_optimizer):
        return
    if not hasattr(type(inner_optimizer), "_backend_update_step"):
        return  # a Keras version without this hook: gradients are unscaled explicitly
    plain_update_step = type(inner_optimizer)._backend_update_step

    def backend_update_step(self, grads, trainable_variables, learning_rate):
        if _active.scale is not None:
            learning_rate = tf.convert_to_tensor(learning_rate)
            reciprocal = tf.math.reciprocal(tf.cast(_active.scale, tf.float32))
            learning_rate = learning_rate * tf.cast(reciprocal, learning_rate.dtype)
        return plain_update_step(self, grads, trainable_variables, learning_rate)

    # object.__setattr__ keeps Keras' attribute tracking out of it.
    bound = types.MethodType(backend_update_step, inner_optimizer)
    object.__setattr__(inner_optimizer, "_backend_update_step", bound)


@contextlib.contextmanager
def learning_rate_divided_by(scale):
    """In this thread, an installed update step uses ``learning_rate / scale``.

    `scale` must be the scale the gradients were multiplied by: read it before
    the loss scale is updated for the next step.
    """
    previous = _active.scale
    _active.scale = scale
    try:
        yield
    finally:
        _active.scale = previous
