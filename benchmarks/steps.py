"""Family "boundaries": one whole training step (forward, backward, `optimizer.apply`) under
mixed_float16, per variant on its own model (same initial weights) and optimizer.

The batch is fixed and passed as an argument. Variants with scale boundaries
against the global scale alone; benchmarks/README.md ("boundaries") says more.
"""

import keras
import numpy as np
import tensorflow as tf

import models
import optimizers
from runs import StepRun


def train_step(model, optimizer, variables):
    """One step: the loss scaled (when the optimizer scales), its gradient, `apply`."""
    scales = hasattr(optimizer, "scale_loss")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
            scaled = optimizer.scale_loss(loss) if scales else loss
        optimizer.apply(tape.gradient(scaled, variables), variables)
        return loss

    return step


def runs(case, names, seed=0):
    """The `StepRun`s of variants `names` on boundaries `case`.

    Raises:
        RuntimeError: a variant's initial weights differ from the baseline's.
    """
    p = case.params
    x, y = models.batch(p, seed=seed)
    args = (tf.constant(x), tf.constant(y))
    # Every model first: building one sets the global seed, which makes
    # TensorFlow retrace (XLA: recompile) the steps already traced.
    built = [optimizers.build(name, "adam", models.build(p, seed)) for name in names]
    result, first = [], None
    for name, (model, optimizer) in zip(names, built):
        variables = list(model.trainable_variables)
        values = [np.array(tf.convert_to_tensor(v)) for v in variables]
        first = first or values
        if len(values) != len(first) or not all(map(np.array_equal, values, first)):
            raise RuntimeError(f"{name}: its initial weights differ from {names[0]}'s")
        result.append(StepRun(name, train_step(model, optimizer, variables), args, p["mode"],
                              variables, optimizer))
    return result
