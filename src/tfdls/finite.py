"""The finiteness check: is every gradient free of NaN and Inf?

This is the only place that decides whether a step is skipped, so it must be
exact (a finite gradient is never reported non-finite) and cheap (it runs on
every step and reads every gradient once).
"""

import tensorflow as tf


def gradient_values(grads):
    """Flattens a nest of gradients into a list of dense value tensors.

    `None` entries (variables without a gradient) are dropped and
    `tf.IndexedSlices` contribute their `values`, which are the only numbers
    they hold.
    """
    values = []
    for grad in tf.nest.flatten(grads, expand_composites=False):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        values.append(grad)
    return values


def all_finite(grads):
    """Returns a scalar bool tensor: `True` iff every gradient is finite.

    Args:
        grads: a tensor, a list, or any nest of tensors, `tf.IndexedSlices`
            and `None`. Float dtypes may be mixed in one call.

    Returns:
        A scalar `tf.bool` tensor. With no gradients at all it is `True`.

    Example:

    >>> tfdls.all_finite([tf.constant([1.0, 2.0]), None])
    <tf.Tensor: shape=(), dtype=bool, numpy=True>
    >>> tfdls.all_finite({"w": tf.constant([1.0, float("nan")])})
    <tf.Tensor: shape=(), dtype=bool, numpy=False>

    The result is one fused reduction: each gradient contributes a single
    boolean, and the booleans are combined by one `reduce_all`. Nothing is
    read back to the host, so it is safe inside `tf.function` and XLA.
    """
    values = gradient_values(grads)
    for value in values:
        if not value.dtype.is_floating:
            raise TypeError(
                "all_finite() expects floating-point gradients; got a "
                f"gradient of dtype {value.dtype.name}: {value!r}"
            )
    if not values:
        return tf.constant(True)
    per_gradient = [tf.reduce_all(tf.math.is_finite(v)) for v in values]
    if len(per_gradient) == 1:
        return per_gradient[0]
    return tf.reduce_all(tf.stack(per_gradient))
