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


def _check_floating(values):
    for value in values:
        if not value.dtype.is_floating:
            raise TypeError(
                "Gradients must be floating point; got a gradient of dtype "
                f"{value.dtype.name}: {value!r}"
            )


def finite_flags(values):
    """Returns a bool vector: entry `i` is True iff `values[i]` is all finite.

    Args:
        values: a list of dense float tensors (see `gradient_values`).

    One `is_finite`+`reduce_all` per tensor, stacked into one vector; the
    vector is what overflow attribution records and what replicas all-reduce.
    """
    _check_floating(values)
    if not values:
        return tf.ones([0], tf.bool)
    return tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values])


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

    Each gradient contributes one boolean and a single `reduce_all` combines
    them. Nothing is read back to the host, so it is safe inside
    `tf.function` and XLA; `is_finite` is exact, so finite values (however
    large) are never reported non-finite.
    """
    return tf.reduce_all(finite_flags(gradient_values(grads)))
