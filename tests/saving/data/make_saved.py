"""Writes a `.keras` file and a checkpoint with the tfdls on `PYTHONPATH`, for
`tests/saving/test_saved_by_earlier_code.py`.

The files under `tests/saving/data/<commit>/` were written by the code of that
commit (a `git worktree` of it on `PYTHONPATH`):

    PYTHONPATH=<worktree>/src python tests/saving/data/make_saved.py tests/saving/data/<commit>

Beside them, `expected.json` holds what that code read back: the loss scale's
state, the boundaries' factors, and the weights after one more epoch from the
saved state, so that the current code, loading the same files, must match the
earlier code's behaviour, not only its bytes. XLA rounds a few updates by the
host's vector instructions: `expected_weights_without_avx512.json` holds the
weights that commit's code gives on a CPU without AVX-512, from the same files.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdls

BATCHES, BATCH = 8, 16


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCHES * BATCH, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) > 0).astype("float32")
    return x, y


def model_and_optimizer():
    """Three Dense layers, boundaries after each of the first two, Adam, a dynamic
    scale that starts high (the first steps overflow) with hysteresis and growth."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    base = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
    ])
    model = tfdls.add_scale_boundaries(base, every=1, initial_log2_factor=5, min_log2_factor=2, adjust_period=3)
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**17, increment_period=3,
                                          hysteresis=2),
        scale_boundaries=model,
    )
    model.compile(optimizer=optimizer, loss="binary_crossentropy", jit_compile=False)
    return model


def fit(model, epochs):
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def state(model):
    opt, ls = model.optimizer, model.optimizer.loss_scale
    return {
        "scale": float(ls().numpy()),
        "good_steps": int(ls.num_good_steps.numpy()),
        "hysteresis_budget": int(ls.hysteresis_budget.numpy()),
        "skipped": int(ls.num_skipped_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "factors": {k: float(v) for k, v in sorted(opt.scale_boundary_factors().items())},
    }


def weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(w), np.float64).tolist()
            for w in model.weights]


def main(folder):
    os.makedirs(folder, exist_ok=True)
    model = model_and_optimizer()
    fit(model, epochs=3)
    model.save(os.path.join(folder, "model.keras"))
    tf.train.Checkpoint(optimizer=model.optimizer, model=model).write(
        os.path.join(folder, "ckpt"))
    saved = state(model)
    fit(model, epochs=1)
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump({"tensorflow": tf.__version__, "keras": keras.__version__,
                   "saved": saved, "after_one_epoch": state(model),
                   "weights_after_one_epoch": weights(model)}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
