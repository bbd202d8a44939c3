"""The optimizer classes `keras.optimizers` exports, built the same way by every test."""

import inspect

import keras

# Every optimizer class of this Keras release (MultiOptimizer, Muon, ... only
# where it has them), so the tests follow what a user can pick.
EXPORTED = sorted(
    name
    for name, obj in vars(keras.optimizers).items()
    if inspect.isclass(obj)
    and issubclass(obj, keras.optimizers.Optimizer)
    and obj not in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer)
)


def make_optimizer(name, other_variable, learning_rate=None, **options):
    """A fresh `keras.optimizers.<name>`.

    Args:
        name: a name from `EXPORTED`.
        other_variable: for ``MultiOptimizer``, the name of the variable that
            gets an SGD with momentum; every other variable gets Adam.
        learning_rate: None for the class default.
        **options: more keyword arguments (e.g. ``gradient_accumulation_steps``),
            given to every optimizer a ``MultiOptimizer`` holds.
    """
    kwargs = {} if learning_rate is None else {"learning_rate": learning_rate}
    kwargs.update(options)
    if name == "MultiOptimizer":
        optimizer_map = keras.optimizers.OptimizerMap(keras.optimizers.Adam(**kwargs))
        optimizer_map[other_variable] = keras.optimizers.SGD(0.1, momentum=0.9, **options)
        return keras.optimizers.MultiOptimizer(optimizer_map)
    return getattr(keras.optimizers, name)(**kwargs)
