"""Family "fit": `model.fit` under mixed_float16, per variant on its own model (same initial
weights): ms per step and the first step (trace, compile and one step).

"bare" means no loss scaling: under mixed_float16 `compile` wraps any optimizer
that is not a `keras.optimizers.LossScaleOptimizer` in one unless
``auto_scale_loss=False`` (keras/src/trainers/trainer.py, `compile`); the model
still computes in float16. The loss-scale optimizers come wrapped already
(tfdls' subclasses Keras'), so the flag changes nothing for them.
"""

import keras
import tensorflow as tf

import cases
import models
import optimizers
from runs import FitRun

JIT_COMPILE = {"graph": False, "xla": True, "auto": "auto"}
BATCHES = 8  # distinct batches in the (cached, repeated) dataset


def dataset(params, seed=0):
    """`BATCHES` random batches, cached and repeated forever."""
    data = tf.data.Dataset.from_tensor_slices(models.batch(params, BATCHES, seed))
    return data.batch(params["batch"], drop_remainder=True).cache().repeat().prefetch(2)


def build(case, name, jit_compile=None, seed=0):
    """The compiled model of variant `name` on fit `case` (under the current policy).

    Args:
        case: the `cases.Case`.
        name: the variant.
        jit_compile: passed to `compile` (default: the case's mode).
        seed: for the initial weights.

    Raises:
        RuntimeError: "bare" came out wrapped in a loss-scale optimizer.
    """
    p = case.params
    model, optimizer = optimizers.build(name, p["inner"], models.build(p, seed))
    model.compile(optimizer=optimizer, auto_scale_loss=False,
                  jit_compile=JIT_COMPILE[p["mode"]] if jit_compile is None else jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if cases.VARIANTS[name].wrapper == "none" and isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer):
        raise RuntimeError(f"{name}: compile wrapped the optimizer in a LossScaleOptimizer")
    return model


def runs(case, names, seed=0):
    """The `FitRun`s of variants `names` on fit `case`, sharing one dataset."""
    data = dataset(case.params, seed)
    # Every model first: building one sets the global seed, which makes
    # TensorFlow retrace (XLA: recompile) the train functions already traced.
    built = [build(case, name, seed=seed) for name in names]
    return [FitRun(name, model, data) for name, model in zip(names, built)]
