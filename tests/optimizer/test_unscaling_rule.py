"""The unscaling rule, and the misuses that raise instead of applying wrongly.

The rule (README, `get_unscaled_gradients`): apply() divides every gradient by
the loss scale, unless get_unscaled_gradients() ran after the last
scale_loss(), get_scaled_loss() or apply(); then it divides none of them. It
is kept in a variable and applied when the step runs.

Every case: true gradient [1, 2, -3], SGD(1.0), scale 1024, weights from 0;
the right weights are [-1, -2, 3] (issue 18's reproductions and variants).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

SCALE = 1024.0
TRUE = np.array([1.0, 2.0, -3.0], "float32")
RIGHT = -TRUE
MODES = ["eager", "function", "xla"]


def _setup():
    w = keras.Variable(np.zeros(3, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )
    opt.build([w])
    return w, opt


def _scaled():
    return tf.constant(TRUE * np.float32(SCALE))


def _wrap(fn, mode):
    return fn if mode == "eager" else tf.function(fn, jit_compile=mode == "xla")


def _assert_untouched(w, opt):
    np.testing.assert_array_equal(w.numpy(), np.zeros(3, "float32"))
    assert int(opt.iterations.numpy()) == 0


# -- the rule holds wherever the step runs --------------------------------------------


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_keras3_style_divides(mode):
    w, opt = _setup()
    _wrap(lambda g: opt.apply([g], [w]), mode)(_scaled())
    np.testing.assert_array_equal(w.numpy(), RIGHT)


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
def test_tf_keras_style_divides_once(mode):
    w, opt = _setup()

    def step(scaled):
        opt.apply_gradients(zip(opt.get_unscaled_gradients([scaled]), [w]))

    step = _wrap(step, mode)
    for _ in range(2):
        step(_scaled())
    np.testing.assert_array_equal(w.numpy(), 2 * RIGHT)


@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_clipped_unscaled_gradients_are_not_divided_again(mode):
    w, opt = _setup()

    def step(scaled):
        clipped, _ = tf.clip_by_global_norm(opt.get_unscaled_gradients([scaled]), 1.0)
        opt.apply_gradients(zip(clipped, [w]))

    _wrap(step, mode)(_scaled())
    np.testing.assert_allclose(w.numpy(), RIGHT / np.linalg.norm(TRUE), rtol=1e-6)


def test_unscaled_in_one_function_applied_eagerly():
    w, opt = _setup()
    unscale = tf.function(lambda g: opt.get_unscaled_gradients([g]))
    opt.apply_gradients(zip(unscale(_scaled()), [w]))
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_unscaled_in_one_function_applied_in_another():
    w, opt = _setup()
    unscale = tf.function(lambda g: opt.get_unscaled_gradients([g]))
    apply = tf.function(lambda u: opt.apply(u, [w]))
    for _ in range(2):
        apply(unscale(_scaled()))
    np.testing.assert_array_equal(w.numpy(), 2 * RIGHT)


@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_unscaled_gradients_accumulated_in_a_loop(mode):
    w, opt = _setup()

    def step(scaled):
        total = tf.zeros([3])
        for _ in tf.range(4):
            total += opt.get_unscaled_gradients([scaled])[0] / 4.0
        opt.apply([total], [w])

    _wrap(step, mode)(_scaled())
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_unscaled_gradients_passed_through_a_variable():
    w, opt = _setup()
    buffer = tf.Variable(tf.zeros([3]))
    store = tf.function(lambda g: buffer.assign(opt.get_unscaled_gradients([g])[0]))
    apply = tf.function(lambda: opt.apply([buffer.read_value()], [w]))
    store(_scaled())
    apply()
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_a_mark_lasts_until_scale_loss():
    """A stray call (logging after a restore) is forgotten at the next scale_loss."""
    w, opt = _setup()
    opt.get_unscaled_gradients([_scaled()])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w * TRUE))
        opt.apply(tape.gradient(loss, [w]), [w])

    step()
    np.testing.assert_array_equal(w.numpy(), RIGHT)


@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_micro_batches_unscaled_one_by_one_and_summed(mode):
    """tf_keras-style accumulation: each micro-batch starts a step with
    get_scaled_loss, so earlier calls are closed; the last one is pending and
    apply divides none of the sum."""
    w, opt = _setup()

    def step():
        total = tf.zeros([3])
        for part in (0.25, 0.75):
            with tf.GradientTape() as tape:
                loss = opt.get_scaled_loss(part * tf.reduce_sum(w * TRUE))
            total += opt.get_unscaled_gradients(tape.gradient(loss, [w]))[0]
        opt.apply([total], [w])

    _wrap(step, mode)()
    np.testing.assert_array_equal(w.numpy(), RIGHT)


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_logging_call_closed_by_scale_loss_leaves_the_step_scaled(mode):
    w, opt = _setup()

    def step():
        opt.get_unscaled_gradients([_scaled()])  # logged after the previous step
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w * TRUE))
        opt.apply(tape.gradient(loss, [w]), [w])

    _wrap(step, mode)()
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_after_get_unscaled_gradients_apply_divides_none():
    """The rule, not the tensors' history: after get_unscaled_gradients, apply
    divides nothing (the run-time divisor is 1), here in another function."""
    w, opt = _setup()
    b = keras.Variable(np.zeros(2, "float32"), name="b")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )
    # Traced with no scale_loss before it, get_unscaled_gradients needs a built optimizer.
    opt.build([w, b])

    @tf.function
    def unscale(scaled_w, scaled_b):
        return opt.get_unscaled_gradients([scaled_w, scaled_b])

    @tf.function
    def step(unscaled_w, given_b):
        opt.apply([unscaled_w, given_b], [w, b])

    unscaled_w, unscaled_b = unscale(_scaled(), tf.constant([SCALE, -SCALE]))
    step(unscaled_w, unscaled_b)
    np.testing.assert_array_equal(w.numpy(), RIGHT)
    np.testing.assert_array_equal(b.numpy(), np.array([-1.0, 1.0], "float32"))
    assert opt.step_plan.divide == (True, True)  # by the run-time divisor, here 1


def test_a_gradient_applied_beside_unscaled_ones_but_never_unscaled_is_refused():
    """Partial unscaling: with a call pending apply divides nothing, so a gradient it did
    not return (b's, scaled) would be applied undivided: refused, naming b, in a
    traced step as eagerly, and nothing changes."""
    w, opt = _setup()
    b = keras.Variable(np.zeros(2, "float32"), name="b")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )
    opt.build([w, b])  # as above

    @tf.function
    def step(scaled_w, given_b):
        (unscaled_w,) = opt.get_unscaled_gradients([scaled_w])
        opt.apply([unscaled_w, given_b], [w, b])

    before = (w.numpy().copy(), b.numpy().copy())
    with pytest.raises(ValueError, match=r"the gradient of b: .*more gradients than it returned"):
        step(_scaled(), tf.constant([SCALE, -SCALE]))
    np.testing.assert_array_equal(w.numpy(), before[0])
    np.testing.assert_array_equal(b.numpy(), before[1])


def test_an_eager_apply_that_raised_clears_the_mark():
    w, opt = _setup()
    unscaled = opt.get_unscaled_gradients([_scaled()])
    with pytest.raises(ValueError, match="must match one to one"):
        opt.apply(unscaled + [None], [w])
    opt.apply([_scaled()], [w])  # a new step, Keras 3 style: divided
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_apply_under_strategy_run(mirrored_strategy):
    with mirrored_strategy.scope():
        w, opt = _setup()

    @tf.function
    def step(scaled):
        def replica_step(g):
            opt.apply_gradients(zip(opt.get_unscaled_gradients([g]), [w]))

        mirrored_strategy.run(replica_step, args=(scaled,))

    step(_scaled())
    # Keras sums the replicas' gradients: two replicas, the same gradient each.
    for copy in mirrored_strategy.experimental_local_results(w.value):
        np.testing.assert_array_equal(copy.numpy(), 2 * RIGHT)


# -- misuses the rule would get wrong raise (issue 18, item 1 and 2) -----------------------


def _clip_factor_step(opt, w):
    def step(g):
        norm = tf.linalg.global_norm(opt.get_unscaled_gradients([g]))
        opt.apply_gradients(zip([g * tf.minimum(1.0, 100.0 / norm)], [w]))

    return step


def _where_finite_step(opt, w):
    def step(g):
        finite = tfdls.all_finite(opt.get_unscaled_gradients([g]))
        opt.apply_gradients(zip([tf.where(finite, g, tf.zeros_like(g))], [w]))

    return step


def _use_norm_step(opt, w):
    def step(g):
        norm = tf.linalg.global_norm(opt.get_unscaled_gradients([g]))
        clipped, _ = tf.clip_by_global_norm([g], 100.0, use_norm=norm)
        opt.apply_gradients(zip(clipped, [w]))

    return step


def _logging_step(opt, w):
    def step(g):
        tf.norm(opt.get_unscaled_gradients([g])[0])  # logged only
        opt.apply_gradients(zip([g], [w]))

    return step


SCALED_AFTER_UNSCALING = {
    "clip-factor": _clip_factor_step,
    "where-finite": _where_finite_step,
    "use-norm": _use_norm_step,
    "logging": _logging_step,
}


@pytest.mark.parametrize("mode", slow_except(MODES, ["eager", "function"]))
@pytest.mark.parametrize("case", sorted(SCALED_AFTER_UNSCALING))
def test_scaled_gradients_applied_after_unscaling_raise(case, mode):
    w, opt = _setup()
    step = _wrap(SCALED_AFTER_UNSCALING[case](opt, w), mode)
    with pytest.raises(ValueError, match="tfdls"):
        step(_scaled())
    _assert_untouched(w, opt)


def test_scaled_gradients_applied_after_unscaling_raise_under_strategy_run(mirrored_strategy):
    with mirrored_strategy.scope():
        w, opt = _setup()
    replica_step = _clip_factor_step(opt, w)

    @tf.function
    def step(scaled):
        mirrored_strategy.run(replica_step, args=(scaled,))

    with pytest.raises(ValueError, match="scaled gradients that were passed"):
        step(_scaled())


@pytest.mark.parametrize("mode", slow_except(MODES, ["eager", "function"]))
def test_two_applies_from_one_call_raise(mode):
    w, opt = _setup()

    def step(g):
        unscaled = opt.get_unscaled_gradients([g])
        opt.apply(unscaled, [w])
        opt.apply(unscaled, [w])

    with pytest.raises(ValueError, match="already closed"):
        _wrap(step, mode)(_scaled())


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_applying_after_a_new_scale_loss_raises(mode):
    w, opt = _setup()

    def step(g):
        unscaled = opt.get_unscaled_gradients([g])
        opt.scale_loss(tf.constant(1.0))
        opt.apply(unscaled, [w])

    with pytest.raises(ValueError, match="already closed"):
        _wrap(step, mode)(_scaled())


def test_apply_in_a_loop_of_gradients_unscaled_outside_raises():
    w, opt = _setup()

    @tf.function
    def step(g):
        unscaled = opt.get_unscaled_gradients([g])
        for _ in tf.range(2):
            opt.apply(unscaled, [w])

    with pytest.raises(ValueError, match="loop body or a nested tf.function"):
        step(_scaled())


def test_apply_in_a_nested_function_of_captured_unscaled_gradients_raises():
    w, opt = _setup()

    @tf.function
    def step(g):
        unscaled = opt.get_unscaled_gradients([g])
        tf.function(lambda: opt.apply(unscaled, [w]))()

    with pytest.raises(ValueError, match="loop body or a nested tf.function"):
        step(_scaled())


def test_gradients_through_nested_function_arguments_raise():
    w, opt = _setup()
    apply = tf.function(lambda grads: opt.apply(grads, [w]))

    @tf.function
    def step(g):
        apply(opt.get_unscaled_gradients([g]))

    with pytest.raises(ValueError, match="arguments of a nested tf.function"):
        step(_scaled())


def test_apply_in_a_cond_branch_is_allowed():
    w, opt = _setup()

    @tf.function
    def step(g, now):
        unscaled = opt.get_unscaled_gradients([g])
        tf.cond(now, lambda: opt.apply(unscaled, [w]) or tf.constant(0), lambda: tf.constant(0))

    step(_scaled(), tf.constant(True))
    np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_eager_gradients_computed_from_unscaled_ones_raise():
    w, opt = _setup()
    clipped, _ = tf.clip_by_global_norm(opt.get_unscaled_gradients([_scaled()]), 1.0)
    with pytest.raises(ValueError, match="clipnorm"):
        opt.apply_gradients(zip(clipped, [w]))
    _assert_untouched(w, opt)


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


# -- found by review: copies, cond branches, stray eager calls, overwritten values --------


@pytest.mark.parametrize("copy", ["cast", "identity"])
@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_scaled_gradients_applied_after_unscaling_copies_of_them_raise(copy, mode):
    w, opt = _setup()
    norm = tf.Variable(0.0)

    def step(scaled):
        copies = [tf.identity(scaled) if copy == "identity" else tf.cast(scaled, tf.float32)]
        norm.assign(tf.linalg.global_norm(opt.get_unscaled_gradients(copies)))
        opt.apply([scaled], [w])

    with pytest.raises(ValueError, match="scaled gradients that were passed"):
        _wrap(step, mode)(_scaled())
    _assert_untouched(w, opt)


@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_apply_in_both_branches_of_a_cond(mode):
    """One branch runs: each may apply the call's outputs."""
    for take in (True, False):
        w, opt = _setup()

        def step(scaled, clip):
            unscaled = opt.get_unscaled_gradients([scaled])
            if clip:  # AutoGraph: a tf.cond with an apply in each branch
                opt.apply([tf.clip_by_norm(unscaled[0], 100.0)], [w])
            else:
                opt.apply(unscaled, [w])

        _wrap(step, mode)(_scaled(), tf.constant(take))
        np.testing.assert_array_equal(w.numpy(), RIGHT)


def test_after_both_branches_another_apply_of_the_outputs_raises():
    w, opt = _setup()

    @tf.function
    def step(scaled, now):
        unscaled = opt.get_unscaled_gradients([scaled])
        tf.cond(now, lambda: opt.apply(unscaled, [w]) or tf.constant(0), lambda: tf.constant(0))
        opt.apply(unscaled, [w])

    with pytest.raises(ValueError, match="already closed"):
        step(_scaled(), tf.constant(True))


def test_a_stray_eager_call_ended_by_a_traced_scale_loss():
    """The traced scale_loss clears the flag; the eager apply that follows divides."""
    w, opt = _setup()
    opt.get_unscaled_gradients([_scaled()])  # a stray logging call

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w * TRUE))
        return tape.gradient(loss, [w])

    opt.apply(gradients(), [w])
    np.testing.assert_array_equal(w.numpy(), RIGHT)


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_overwrite_with_gradient_values_are_never_divided(mode):
    w, _ = _setup()
    value = keras.Variable(np.zeros(3, "float32"), name="value")
    value.overwrite_with_gradient = True
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(SCALE, increment_period=10**6)
    )
    opt.build([w, value])

    def tf_keras_step(scaled):
        unscaled = opt.get_unscaled_gradients([scaled, tf.constant([5.0, 6.0, 7.0])])
        opt.apply(unscaled, [w, value])

    _wrap(tf_keras_step, mode)(_scaled())
    np.testing.assert_array_equal(w.numpy(), RIGHT)
    np.testing.assert_array_equal(value.numpy(), [5.0, 6.0, 7.0])
    _wrap(lambda g: opt.apply([g, tf.constant([8.0, 9.0, 10.0])], [w, value]), mode)(_scaled())
    np.testing.assert_array_equal(value.numpy(), [8.0, 9.0, 10.0])
