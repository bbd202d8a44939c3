"""An optimizer first built inside a `tf.function` makes its variables before the trace goes on.

A `tf.function` whose first trace makes variables traces its Python twice; `fit`
without a strategy builds the optimizer in its first trace
(`tfdls._distribute.built_before_the_trace`). These tests count the traces and check
that the steps are those of an optimizer built before the function, bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except
from tests.support.keras_optimizers import EXPORTED, make_optimizer

SHAPES = [(6, 4), (4,), (4, 1), (1,)]
FAST = ["Adam", "SGD", "MultiOptimizer"]


def _variables():
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.normal(size=s).astype("float32"), name=f"v{i}")
            for i, s in enumerate(SHAPES)]


def _loss(variables, x):
    kernel, bias, head, head_bias = variables
    hidden = tf.tanh(tf.matmul(x, kernel) + bias)
    return tf.reduce_mean(tf.square(tf.matmul(hidden, head) + head_bias))


def _run(inner_name, build_first, jit_compile, steps=3):
    """`steps` steps of a `tf.function` (scale_loss, tape, apply) on fresh variables: the
    number of times its Python ran, the variables and the optimizer's variables after."""
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(make_optimizer(inner_name, "v1", learning_rate=0.05),
                                   initial_scale=2.0**4, dynamic_growth_steps=2)
    if build_first:
        opt.build(variables)
    traces = []

    @tf.function(jit_compile=jit_compile)
    def step(x):
        traces.append(1)
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_loss(variables, x))
        opt.apply(tape.gradient(scaled, variables), variables)

    x = tf.constant(np.random.default_rng(1).normal(size=(8, 6)).astype("float32"))
    for _ in range(steps):
        step(x)
    return (len(traces), [v.numpy() for v in variables],
            [np.asarray(v.numpy()) for v in opt.variables])


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("inner_name", slow_except(EXPORTED, FAST))
def test_first_build_in_a_function_traces_once_and_steps_as_built_before(inner_name, jit_compile):
    traces, weights, state = _run(inner_name, build_first=False, jit_compile=jit_compile)
    assert traces == 1
    ref_traces, ref_weights, ref_state = _run(inner_name, build_first=True,
                                              jit_compile=jit_compile)
    assert ref_traces == 1
    for got, want in zip(weights + state, ref_weights + ref_state, strict=True):
        np.testing.assert_array_equal(got, want)


class CountingModel(keras.Sequential):
    """Counts the traces of its `train_step` (Python runs once per trace)."""

    traces = 0

    def train_step(self, data):
        type(self).traces += 1
        return super().train_step(data)


@pytest.mark.parametrize("boundaries", [False, True], ids=["global", "boundaries"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_fit_traces_train_step_once(jit_compile, boundaries):
    _fit_and_count(jit_compile, boundaries)


def test_fit_under_a_strategy_traces_train_step_once(mirrored_strategy):
    """Keras builds the optimizer before the trace there (the strategy's creator makes
    mirrored variables); `built_before_the_trace` leaves that alone. (One trace runs
    `train_step` once per replica.)"""
    with mirrored_strategy.scope():
        opt = _fit_and_count(False, False, calls=mirrored_strategy.num_replicas_in_sync)
    assert all(isinstance(v._value, tf.distribute.DistributedValues)  # the tf.Variable held
               for v in opt.inner_optimizer.variables)


def _fit_and_count(jit_compile, boundaries, calls=1):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), tfdls.UnscaledInput(), keras.layers.Dense(8, activation="tanh")]
    if boundaries:
        layers.append(tfdls.ScaleBoundary(name="b"))
    layers.append(keras.layers.Dense(1, dtype="float32"))
    CountingModel.traces = 0
    model = CountingModel(layers)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                   scale_boundaries=model if boundaries else None)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert CountingModel.traces == calls
    assert int(opt.iterations.numpy()) == 8 - int(opt.loss_scale.num_skipped_steps.numpy())
    assert np.isfinite(history.history["loss"]).all()
    return opt


def _layer_made_in_the_step(opt, scaled):
    """Two steps of a `tf.function` whose first trace also makes the layer's variables."""
    layer = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="ones")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - 1.0))
            if scaled:
                loss = opt.scale_loss(loss)
        opt.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)

    x = tf.constant(np.random.default_rng(2).normal(size=(8, 3)).astype("float32"))
    step(x)
    step(x)
    return [v.numpy() for v in layer.trainable_variables]


@pytest.mark.parametrize("inner_name",
                         [n for n in ("Adam", "ScheduleFreeAdamW") if n in EXPORTED])
def test_variables_made_in_the_same_trace_build_as_keras_does(inner_name):
    """Variables without a value yet: the build stays in the trace (a `build` that reads
    them could not run before it), and the steps are those of Keras' own optimizer there."""
    opt = tfdls.LossScaleOptimizer(getattr(keras.optimizers, inner_name)(0.01))
    got = _layer_made_in_the_step(opt, scaled=True)
    want = _layer_made_in_the_step(getattr(keras.optimizers, inner_name)(0.01), scaled=False)
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_tf_keras_style_step_with_boundaries_traces_once():
    """`get_unscaled_gradients` with scale boundaries builds the optimizer first: there too."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), tfdls.UnscaledInput(),
                              keras.layers.Dense(8, activation="tanh"),
                              tfdls.ScaleBoundary(name="b"), keras.layers.Dense(1)])
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), scale_boundaries=model)
    traces = []

    @tf.function
    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(tf.reduce_mean(tf.square(model(x) - y)))
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables),
                                           model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    step(x, y)
    step(x, y)
    assert len(traces) == 1
    assert int(opt.iterations.numpy()) == 2


def test_a_first_trace_that_raises_after_apply_leaves_a_working_optimizer():
    """The build's variables exist and hold their values whatever happens to the trace
    after it; before, a first trace that raised left variables no call initialized, and
    every later step silently updated nothing."""
    x = tf.constant(np.random.default_rng(1).normal(size=(8, 6)).astype("float32"))
    results = []
    for build_first in (False, True):
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(0.01))
        if build_first:
            opt.build(variables)
        fail = [not build_first]

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(_loss(variables, x))
            opt.apply(tape.gradient(scaled, variables), variables)
            if fail[0]:
                raise RuntimeError("a later line of the step fails")

        if fail[0]:
            with pytest.raises(RuntimeError, match="later line"):
                step(x)
            fail[0] = False
        step(x)
        step(x)
        assert int(opt.iterations.numpy()) == 2
        results.append([v.numpy() for v in variables] + [np.asarray(v) for v in opt.variables])
    for got, want in zip(*results, strict=True):
        np.testing.assert_array_equal(got, want)
