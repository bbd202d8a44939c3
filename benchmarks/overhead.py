"""Family "overhead": one optimizer step, ``apply(grads, variables)``, per variant.

The gradients are fixed, finite random tensors passed as arguments (never
captured, so XLA cannot fold them); each variant has its own fresh variables
with the same initial values. benchmarks/README.md ("overhead") says more.
"""

import keras
import numpy as np
import tensorflow as tf

import cases
import optimizers
import tfdls
from runs import StepRun

BARE_PASSES = {"sgd": 3, "sgdm": 5, "adam": 7}  # full passes over the parameters of the update
CHECK_PASSES = 1  # the "all gradients finite?" read
UNSCALE_PASSES = 2  # an unfused `grad * (1/scale)`: read and write


def make_inputs(count, dim, table, dtype, seed=0):
    """Initial values (numpy float32) and gradients (tensors of `dtype`).

    A table's gradient is a `tf.IndexedSlices` of `ids` random rows, repeats
    included as in a real batch.
    """
    rng = np.random.default_rng(seed)
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    initial, grads = [], []
    if table:
        rows, width, ids = table
        initial.append((rng.standard_normal((rows, width)) * 0.1).astype(np.float32))
        grads.append(tf.IndexedSlices(
            tf.constant(rng.standard_normal((ids, width)).astype(np_dtype)),
            tf.constant(rng.integers(0, rows, ids), tf.int32),
            tf.constant([rows, width], tf.int32)))
    initial += [(rng.standard_normal((dim, dim)) * 0.1).astype(np.float32) for _ in range(count)]
    grads += [tf.constant(rng.standard_normal((dim, dim)).astype(np_dtype))
              for _ in range(count)]
    return initial, grads


def to_float32(grads):
    """tf_keras' optimizers, unlike Keras 3's, do not cast gradients to the variables' dtype."""
    return [g if g.dtype == tf.float32 else tf.cast(g, tf.float32) for g in grads]


def build(name, inner, mode, initial, grads):
    """Variant `name`'s fresh variables, optimizer and step, as a `StepRun`."""
    wrapper = cases.VARIANTS[name].wrapper
    if wrapper == "check":  # no variables: the run requires the answer True
        return StepRun(name, tfdls.all_finite, (grads,), mode, [])
    if wrapper.startswith("tf_keras"):
        variables = [tf.Variable(v) for v in initial]
        opt = optimizers.inner(inner, optimizers.tf_keras)
        if wrapper == "tf_keras_bare":
            def step(g):
                opt.apply_gradients(zip(to_float32(g), variables))
        else:
            opt = optimizers.tf_keras.mixed_precision.LossScaleOptimizer(opt)
            # What a real step does before differentiating; also silences tf_keras'
            # "you forgot to call get_scaled_loss()" warning.
            opt.get_scaled_loss(tf.constant(1.0))

            def step(g):
                opt.apply_gradients(zip(to_float32(opt.get_unscaled_gradients(g)), variables))
        return StepRun(name, step, (grads,), mode, variables, opt)
    variables = [keras.Variable(v) for v in initial]
    opt = optimizers.wrap(cases.VARIANTS[name], optimizers.inner(inner))
    step = lambda g: opt.apply(g, variables)  # noqa: E731
    if wrapper == "xla_apply":  # nested, as tfdls compiles its apply in graph mode
        step = tf.function(step, jit_compile=True)
    return StepRun(name, step, (grads,), mode, variables, opt)


def runs(case, names, dtype="float32", seed=0):
    """The `StepRun`s of variants `names` on overhead `case`, sharing one set of gradients."""
    p = case.params
    initial, grads = make_inputs(p["count"], p["dim"], p["table"], dtype, seed)
    return [build(name, p["inner"], p["mode"], initial, grads) for name in names]


def floor(case, dtype):
    """Bytes one step must move and the memory-pass floor ratios (README: floors).

    Returns:
        A dict: grad_bytes, var_bytes, bare_passes, bare_bytes, floor_fused, floor_unfused.
    """
    p = case.params
    rows, width, ids = p["table"] or (0, 0, 0)
    dense = p["count"] * p["dim"] ** 2
    grad_bytes = (width * ids + dense) * tf.as_dtype(dtype).size
    # A table's sparse gradient: plain SGD writes only its rows; Keras' SGD with
    # momentum and Adam update their dense slots, and so the whole table.
    var_bytes = 4 * (dense + (width * ids if p["inner"] == "sgd" else rows * width))
    bare_passes = BARE_PASSES[p["inner"]]
    bare_bytes = grad_bytes + (bare_passes - 1) * var_bytes  # one of them reads the gradient
    return {"grad_bytes": grad_bytes, "var_bytes": var_bytes, "bare_passes": bare_passes,
            "bare_bytes": bare_bytes,
            "floor_fused": (bare_bytes + CHECK_PASSES * grad_bytes) / bare_bytes,
            "floor_unfused": (bare_bytes + (CHECK_PASSES + UNSCALE_PASSES) * grad_bytes)
            / bare_bytes}
