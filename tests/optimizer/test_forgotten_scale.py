"""A loss nobody scaled: `apply` warns once (`tfdls.UnscaledLossWarning`); `fit` never does."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

MODES = ["eager", "graph", "xla"]


def _caught(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [w for w in caught if w.category is tfdls.UnscaledLossWarning]


def _loop(mode, opt, w, scale, steps=3, style="keras3"):
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
            if scale and style == "keras3":
                loss = opt.scale_loss(loss)
            elif scale:
                loss = opt.get_scaled_loss(loss)
        grads = tape.gradient(loss, [w])
        if scale and style == "tf_keras":
            grads = opt.get_unscaled_gradients(grads)
        opt.apply(grads, [w])

    fn = step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")
    for _ in range(steps):
        fn()


@pytest.mark.parametrize("mode", MODES)
def test_forgetting_scale_loss_warns_once_with_the_fix(mode):
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, 2.0], name="w")
    caught = _caught(_loop, mode, opt, w, False)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "scale_loss" in message and "UnscaledLossWarning" in message
    # Attributed to the user's code (this file), not to a tfdls or TensorFlow frame.
    assert caught[0].filename == __file__


@pytest.mark.parametrize("style", ["keras3", "tf_keras"])
@pytest.mark.parametrize("mode", MODES)
def test_a_scaled_loss_never_warns(mode, style):
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, 2.0], name="w")
    assert _caught(_loop, mode, opt, w, True, 3, style) == []


def test_eagerly_a_second_step_without_scale_loss_warns():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, 2.0], name="w")
    assert _caught(_loop, "eager", opt, w, True, 1) == []
    assert len(_caught(_loop, "eager", opt, w, False, 1)) == 1


def test_split_applies_after_one_scale_loss_do_not_warn():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    a, b = keras.Variable([1.0], name="a"), keras.Variable([2.0], name="b")
    opt.build([a, b])

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(a * b))
        ga, gb = tape.gradient(loss, [a, b])
        opt.apply([ga], [a])
        opt.apply([gb], [b])

    assert _caught(step) == []
    assert _caught(tf.function(step)) == []


def test_scale_loss_in_an_enclosing_function_counts():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, 2.0], name="w")
    inner = tf.function(lambda g: opt.apply([g], [w]))

    @tf.function
    def outer():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w))
        inner(tape.gradient(loss, [w])[0])

    assert _caught(outer) == []


def test_silenced_where_the_loss_was_scaled_by_hand():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, 2.0], name="w")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=tfdls.UnscaledLossWarning)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w) * opt.loss_scale()
        opt.apply(tape.gradient(loss, [w]), [w])
    assert caught == []
    np.testing.assert_array_equal(w.numpy(), np.float32([1.0, 2.0]) - np.float32(0.1))


@pytest.mark.parametrize("jit_compile", [True, False])
def test_fit_never_warns(jit_compile):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=tfdls.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse",
                      jit_compile=jit_compile)
        x, y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")
        assert _caught(lambda: model.fit(x, y, batch_size=4, epochs=2, verbose=0)) == []
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_keras_loss_scale_optimizer_wrapping_tfdls_is_caught():
    opt = keras.optimizers.LossScaleOptimizer(tfdls.LossScaleOptimizer(keras.optimizers.SGD()))
    w = keras.Variable([1.0, 2.0], name="w")

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w))  # Keras' scale, not tfdls'
        opt.apply(tape.gradient(loss, [w]), [w])

    assert len(_caught(step)) == 1
