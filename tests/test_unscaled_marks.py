"""`get_unscaled_gradients` and `apply`: every gradient is divided by the
scale exactly once, whatever the call order.

The rule (README): apply divides a gradient unless it was returned by
get_unscaled_gradients in the same step or, inside a tf.function, computed
from one; in eager mode a gradient that is neither is an error while a mark
is pending.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from fast_loop import slow_except

SCALE = 1024.0


def _setup(lr=1.0):
    w = keras.Variable(np.zeros(3, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(lr), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )
    opt.build([w])
    return w, opt


def _scaled(true=(1.0, 2.0, -3.0)):
    return tf.constant(np.asarray(true, "float32") * np.float32(SCALE))


def _expected(steps=1, lr=1.0, true=(1.0, 2.0, -3.0)):
    return -steps * lr * np.asarray(true, "float32")


@pytest.mark.parametrize("mode", slow_except(["eager", "function", "xla"], ["eager", "function"]))
def test_a_stray_eager_call_does_not_leak_into_later_steps(mode):
    w, opt = _setup()
    opt.get_unscaled_gradients([_scaled()])  # e.g. logging a norm after a restore
    step = lambda g: opt.apply([g], [w])  # noqa: E731
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    else:
        # In eager mode the next apply sees the mark: passing it a new tensor
        # is ambiguous, and says so.
        with pytest.raises(ValueError, match="cannot tell whether to divide"):
            step(_scaled())
        np.testing.assert_array_equal(w.numpy(), np.zeros(3, "float32"))
    for _ in range(2):
        step(_scaled())
    np.testing.assert_array_equal(w.numpy(), _expected(steps=2))


def test_a_mark_does_not_survive_an_apply_that_raised():
    w, opt = _setup()
    unscaled = opt.get_unscaled_gradients([_scaled()])
    with pytest.raises(ValueError, match="must match one to one"):
        opt.apply(unscaled + [None], [w])
    opt.apply([_scaled()], [w])  # scaled, Keras 3 style: divided once
    np.testing.assert_array_equal(w.numpy(), _expected())


@pytest.mark.parametrize("mode", slow_except(["eager", "function", "xla"], ["function"]))
def test_logging_unscaled_then_applying_the_scaled_gradients(mode):
    w, opt = _setup()
    norms = []

    def step(scaled):
        unscaled = opt.get_unscaled_gradients([scaled])
        norms.append(tf.norm(unscaled[0]))  # used only for logging
        opt.apply_gradients(zip([scaled], [w]))  # the scaled gradients

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    step(_scaled())
    np.testing.assert_array_equal(w.numpy(), _expected())


@pytest.mark.parametrize("mode", slow_except(["eager", "function", "xla"], ["xla"]))
def test_tf_keras_workflow_divides_once(mode):
    w, opt = _setup()

    def step(scaled):
        grads = opt.get_unscaled_gradients([scaled])
        opt.apply_gradients(zip(grads, [w]))

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    for _ in range(2):
        step(_scaled())
    np.testing.assert_array_equal(w.numpy(), _expected(steps=2))


@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_gradients_computed_from_unscaled_ones_are_not_divided_again(mode):
    w, opt = _setup()

    @tf.function(jit_compile=mode == "xla")
    def step(scaled):
        grads = opt.get_unscaled_gradients([scaled])
        clipped, _ = tf.clip_by_global_norm(grads, 1.0)
        opt.apply_gradients(zip(clipped, [w]))

    step(_scaled())
    true = np.array([1.0, 2.0, -3.0], "float32")
    np.testing.assert_allclose(w.numpy(), -true / np.linalg.norm(true), rtol=1e-6)


def test_eager_gradients_derived_from_unscaled_ones_are_an_error():
    w, opt = _setup()
    grads = opt.get_unscaled_gradients([_scaled()])
    clipped, _ = tf.clip_by_global_norm(grads, 1.0)
    with pytest.raises(ValueError, match="clipnorm"):
        opt.apply_gradients(zip(clipped, [w]))
    np.testing.assert_array_equal(w.numpy(), np.zeros(3, "float32"))


def test_mixed_gradients_are_divided_one_by_one():
    w, opt = _setup()
    b = keras.Variable(np.zeros(2, "float32"), name="b")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )

    @tf.function
    def step(scaled_w, scaled_b):
        (unscaled_w,) = opt.get_unscaled_gradients([scaled_w])
        opt.apply([unscaled_w, scaled_b], [w, b])
        return opt.step_plan.unscale

    step(_scaled(), tf.constant([SCALE, -SCALE]))
    np.testing.assert_array_equal(w.numpy(), _expected())
    np.testing.assert_array_equal(b.numpy(), np.array([-1.0, 1.0], "float32"))
    assert opt.step_plan.divide == (False, True)
    assert opt.step_plan.unscale == "mixed"


def test_unscaled_gradients_passed_into_a_nested_function_are_an_error():
    w, opt = _setup()

    @tf.function
    def apply_step(grads):
        opt.apply_gradients(zip(grads, [w]))

    @tf.function
    def step(scaled):
        apply_step(opt.get_unscaled_gradients([scaled]))

    with pytest.raises(ValueError, match="nested tf.function"):
        step(_scaled())


def test_unscaled_gradients_captured_by_a_nested_function_are_recognized():
    w, opt = _setup()

    @tf.function
    def step(scaled):
        grads = opt.get_unscaled_gradients([scaled])
        tf.function(lambda: opt.apply_gradients(zip(grads, [w])))()

    step(_scaled())
    np.testing.assert_array_equal(w.numpy(), _expected())


@pytest.mark.slow
def test_fit_after_a_stray_eager_call_trains_like_without_it():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    results = []
    for stray in (False, True):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05))
        model.compile(optimizer=opt, loss="mse")
        if stray:
            opt.get_unscaled_gradients([tf.ones([4, 1]) * opt.loss_scale()])
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        results.append((history.history["loss"], [v.numpy() for v in model.weights]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)
