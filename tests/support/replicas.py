"""Reading a variable's copies under a `tf.distribute` strategy, in tests."""

import keras
import numpy as np


def copies(strategy, variable):
    """Every replica's copy of `variable` (a Keras or TensorFlow variable), as numpy."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return [np.array(v.numpy()) for v in strategy.experimental_local_results(variable)]


def the_value(strategy, variable):
    """The variable's value, asserting that every replica holds the same bits."""
    first, *others = copies(strategy, variable)
    for other in others:
        np.testing.assert_array_equal(first, other,
                                      err_msg=f"replicas diverge: {variable.name}")
    return first
