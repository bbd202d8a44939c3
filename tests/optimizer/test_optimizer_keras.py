"""tfdls.LossScaleOptimizer inside Keras' compile/fit under mixed precision."""

import keras
import numpy as np
import pytest

import tfdls
from tests.support.fast_loop import slow_except


def _separable_data(n=256, d=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w = rng.normal(size=(d,)).astype("float32")
    margin = x @ w
    keep = np.abs(margin) > 0.3  # a clear margin: linearly separable
    x, margin = x[keep], margin[keep]
    return x, (margin > 0).astype("float32")[:, None]


def _bce(model, x, y):
    """The model's mean binary cross-entropy, computed eagerly (no compiled eval step)."""
    pred = keras.ops.convert_to_numpy(model(x)).astype("float64")
    pred = np.clip(pred, 1e-7, 1 - 1e-7)
    loss = -np.mean(y * np.log(pred) + (1 - y) * np.log(1 - pred))
    accuracy = np.mean((pred > 0.5) == (y > 0.5))
    return float(loss), float(accuracy)


def _binary_model(d=8, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
    ])


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [], ["nojit", "jit"]))
def test_fit_mixed_float16_learns(jit_compile):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _separable_data()
    model = _binary_model()
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[0].kernel.dtype == "float32"
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=4)
    model.compile(optimizer=opt, loss="binary_crossentropy", jit_compile=jit_compile)
    assert model.optimizer is opt
    initial_loss, _ = _bce(model, x, y)
    history = model.fit(x, y, batch_size=32, epochs=6, shuffle=False, verbose=0)
    assert model.optimizer is opt
    losses = history.history["loss"]
    # The logged loss is the unscaled one.
    assert losses[0] < 2.0 * initial_loss
    final_loss, accuracy = _bce(model, x, y)
    assert final_loss < 0.5 * initial_loss, (initial_loss, final_loss)
    assert accuracy > 0.9
    assert abs(losses[-1] - final_loss) < 0.5 * initial_loss
    steps = 6 * int(np.ceil(len(x) / 32))
    skipped = int(opt.loss_scale.num_skipped_steps.numpy())
    assert int(opt.iterations.numpy()) == steps - skipped
    # With finite steps and growth every 4 steps, the scale went up.
    assert float(opt.loss_scale().numpy()) > 2.0**15 or skipped > 0


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True], ids=["nojit", "jit"])
def test_fit_with_overflowing_initial_scale_recovers(jit_compile):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _separable_data(seed=1)
    model = _binary_model(seed=1)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**40)
    model.compile(optimizer=opt, loss="binary_crossentropy", jit_compile=jit_compile)
    assert model.optimizer is opt
    initial_loss, _ = _bce(model, x, y)
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    skipped = int(opt.loss_scale.num_skipped_steps.numpy())
    scale = float(opt.loss_scale().numpy())
    assert skipped > 0
    assert scale < 2.0**40
    # Without growth (2000 steps) the scale halves exactly once per skip.
    assert scale == 2.0**40 / 2.0**skipped
    steps = 4 * int(np.ceil(len(x) / 16))
    assert int(opt.iterations.numpy()) == steps - skipped
    assert int(opt.iterations.numpy()) > 0
    final_loss, _ = _bce(model, x, y)
    assert np.isfinite(final_loss)
    assert final_loss < 0.5 * initial_loss, (initial_loss, final_loss)
    for w in model.weights:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(w)))


@pytest.mark.slow
def test_fit_digits_multiclass():
    from sklearn.datasets import load_digits

    keras.mixed_precision.set_global_policy("mixed_float16")
    digits = load_digits()
    x = (digits.data[:600] / 16.0).astype("float32")
    y = digits.target[:600].astype("int32")
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),
    ])
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    initial_loss, _ = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
    final_loss, accuracy = model.evaluate(x, y, verbose=0)
    assert model.optimizer is opt
    assert final_loss < 0.3 * initial_loss, (initial_loss, final_loss)
    assert accuracy > 0.85


@pytest.mark.slow
def test_fit_matches_manual_loop_float32():
    """fit() with the wrapper gives the same weights as fit() with the bare optimizer
    (power-of-two scale, float32: scaling is exact)."""
    x, y = _separable_data(seed=3)

    def train(optimizer):
        model = _binary_model(seed=3)
        model.compile(optimizer=optimizer, loss="binary_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return [keras.ops.convert_to_numpy(w) for w in model.weights]

    wrapped = train(tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                             loss_scale=tfdls.DynamicLossScale(2.0**10, 3)))
    bare = train(keras.optimizers.SGD(0.1, momentum=0.9))
    assert not np.allclose(wrapped[0], _binary_model(seed=3).weights[0].numpy())
    for a, b in zip(wrapped, bare):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
