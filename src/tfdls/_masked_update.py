"""Branch-free skipping of an inner Keras optimizer's update, for XLA.

Under XLA a `tf.cond` around the inner optimizer's update makes the compiler
copy the optimizer state into and out of the conditional (measured: Adam's
step took twice as long). Instead the update always runs, and every write it
makes becomes ``var = where(apply, new_value, var)``: on a skipped step every
variable is rewritten with its own value, bit for bit, and XLA fuses the
select into the update.

This relies on the optimizer routing all writes through its
`assign`/`assign_add`/`assign_sub` methods, which Keras' built-in optimizers
do for their `update_step`. Features that write variables directly (weight
decay, EMA, gradient accumulation, constraints, overwrite-with-gradient
variables) and sparse gradients are not eligible: they keep the `tf.cond`.
"""

import contextlib

import keras
import tensorflow as tf


def eligible(inner_optimizer, grads, trainable_variables):
    """Whether every write of this inner update goes through the masked methods."""
    module = type(inner_optimizer).__module__
    if not (module.startswith("keras.src.optimizers") or module.startswith("keras.optimizers")):
        return False  # a user-defined optimizer may write variables directly
    if (
        inner_optimizer.weight_decay is not None
        or inner_optimizer.use_ema
        or inner_optimizer.gradient_accumulation_steps
    ):
        return False
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return False
    for variable in trainable_variables:
        if getattr(variable, "constraint", None) is not None:
            return False
        if getattr(variable, "overwrite_with_gradient", False):
            return False
    return True


def _read(variable):
    return tf.convert_to_tensor(variable.value if isinstance(variable, keras.Variable) else variable)


@contextlib.contextmanager
def masked_writes(inner_optimizer, should_apply):
    """Within the block, the inner optimizer's writes take effect iff `should_apply`."""
    plain_assign = inner_optimizer.assign

    def assign(variable, value):
        current = _read(variable)
        plain_assign(variable, tf.where(should_apply, tf.cast(value, current.dtype), current))

    def assign_add(variable, value):
        current = _read(variable)
        # where(), not a masked addend: var + 0 would turn -0.0 into +0.0.
        new = current + tf.cast(value, current.dtype)
        plain_assign(variable, tf.where(should_apply, new, current))

    def assign_sub(variable, value):
        current = _read(variable)
        new = current - tf.cast(value, current.dtype)
        plain_assign(variable, tf.where(should_apply, new, current))

    iterations = inner_optimizer._iterations
    iterations_before = _read(iterations)
    # Instance attributes shadow the methods; object.__setattr__ keeps Keras'
    # tracking out of it.
    for name, fn in (("assign", assign), ("assign_add", assign_add), ("assign_sub", assign_sub)):
        object.__setattr__(inner_optimizer, name, fn)
    try:
        yield
    finally:
        for name in ("assign", "assign_add", "assign_sub"):
            object.__delattr__(inner_optimizer, name)
    # The inner apply counted the step unconditionally.
    iterations.assign(
        tf.where(should_apply, iterations_before + 1, iterations_before)
    )
