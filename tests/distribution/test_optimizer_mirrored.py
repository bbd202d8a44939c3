"""tfdls.LossScaleOptimizer under tf.distribute.MirroredStrategy (two logical CPUs).

jit_compile is off throughout: XLA together with MirroredStrategy over logical
CPU devices is a TensorFlow limitation that fails for Keras' own optimizer too.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.replicas import copies as _local

NAN = float("nan")


def _assert_replicas_identical(strategy, variables):
    for variable in variables:
        copies = _local(strategy, variable)
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=str(variable.name))


def _loss_scale_state_per_replica(strategy, opt):
    ls = opt.loss_scale
    variables = [ls.current_loss_scale, ls.num_good_steps, ls.hysteresis_budget,
                 ls.num_skipped_steps_variable, ls.steps_since_overflow_variable]
    return [[float(c) for c in _local(strategy, v)] for v in variables]


def test_strategy_has_two_replicas(mirrored_strategy):
    assert mirrored_strategy.num_replicas_in_sync == 2


# -- fit ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("all_reduce_dtype", [None, "float16"])
def test_fit_under_mirrored_strategy(mirrored_strategy, all_reduce_dtype):
    strategy = mirrored_strategy
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    margin = x @ rng.normal(size=(8,)).astype("float32")
    y = (margin > 0).astype("float32")[:, None]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
        ])
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**30,
                                       dynamic_growth_steps=5,
                                       all_reduce_dtype=all_reduce_dtype)
        model.compile(optimizer=opt, loss="binary_crossentropy", jit_compile=False)
    assert model.optimizer is opt
    assert isinstance(opt.loss_scale.current_loss_scale, tf.distribute.DistributedValues)

    def bce():
        pred = np.clip(keras.ops.convert_to_numpy(model(x)).astype("float64"), 1e-7, 1 - 1e-7)
        return float(-np.mean(y * np.log(pred) + (1 - y) * np.log(1 - pred)))

    initial = bce()
    model.fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
    assert opt.step_plan.all_reduce == (all_reduce_dtype or "keras")
    final = bce()
    assert final < 0.5 * initial, (initial, final)
    skipped = int(opt.loss_scale.num_skipped_steps.numpy())
    assert skipped > 0
    assert float(opt.loss_scale().numpy()) < 2.0**30
    assert int(opt.iterations.numpy()) == 5 * 8 - skipped
    _assert_replicas_identical(strategy, model.weights)
    _assert_replicas_identical(strategy, opt.inner_optimizer.variables)
    for copies in _loss_scale_state_per_replica(strategy, opt):
        assert copies[0] == copies[1]


# -- custom loop with strategy.run ------------------------------------------------------


_RNG = np.random.default_rng(1)
_X = _RNG.normal(size=(2, 16, 3)).astype("float32")  # one half per replica
_Y = (_X @ _RNG.normal(size=(3, 1)) + 0.5).astype("float32")


def _half_loss(variables, xs, ys):
    w, b = variables
    pred = tf.matmul(xs, tf.convert_to_tensor(w)) + tf.convert_to_tensor(b)
    # Each replica's mean over its half, divided by the replica count: the sum
    # over replicas (what the optimizer all-reduces) is the full-batch mean.
    return tf.reduce_mean(tf.square(pred - ys)) / 2.0


def _full_loss(variables):
    return _half_loss(variables, _X[0], _Y[0]) + _half_loss(variables, _X[1], _Y[1])


def _init_values():
    rng = np.random.default_rng(2)
    return rng.normal(size=(3, 1)).astype("float32") * 0.1, np.zeros((1,), "float32")


def _make_vars():
    w0, b0 = _init_values()
    return [keras.Variable(w0, name="w"), keras.Variable(b0, name="b")]


@pytest.fixture(params=["keras3", "tfkeras"])
def distributed_setup(request, mirrored_strategy):
    strategy = mirrored_strategy
    workflow = request.param
    with strategy.scope():
        variables = _make_vars()
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            tfdls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=1000),
        )
        opt.build(variables)
    xs = tf.constant(_X)
    ys = tf.constant(_Y)

    def replica_fn(poison):
        ctx = tf.distribute.get_replica_context()
        rid = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
        x_half = tf.gather(xs, rid)
        y_half = tf.gather(ys, rid)
        with tf.GradientTape() as tape:
            loss = _half_loss(variables, x_half, y_half)
            if workflow == "keras3":
                scaled = opt.scale_loss(loss)
            else:
                scaled = opt.get_scaled_loss(loss)
        grads = tape.gradient(scaled, variables)
        # Replica 1 alone sees a NaN in the first gradient when poisoned.
        bad = tf.logical_and(poison, tf.equal(rid, 1))
        grads[0] = grads[0] * tf.where(bad, tf.constant(NAN), tf.constant(1.0))
        if workflow == "tfkeras":
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, variables))

    @tf.function
    def train_step(poison):
        strategy.run(replica_fn, args=(poison,))

    return strategy, variables, opt, train_step


def test_custom_loop_finite_steps_match_plain_optimizer(distributed_setup):
    strategy, variables, opt, train_step = distributed_setup
    ref_vars = [keras.Variable(v) for v in _init_values()]
    ref = keras.optimizers.SGD(0.05, momentum=0.9)
    ref.build(ref_vars)
    before = _local(strategy, variables[0])
    for step in range(3):
        train_step(tf.constant(False))
        with tf.GradientTape() as tape:
            loss = _full_loss(ref_vars)
        ref.apply(tape.gradient(loss, ref_vars), ref_vars)
        _assert_replicas_identical(strategy, variables)
        for variable, ref_variable in zip(variables, ref_vars):
            for copy in _local(strategy, variable):
                np.testing.assert_allclose(copy, ref_variable.numpy(), rtol=1e-6, atol=1e-7)
        assert int(opt.iterations.numpy()) == step + 1
    after = _local(strategy, variables[0])
    assert not np.allclose(after[0], before[0])
    assert float(opt.loss_scale().numpy()) == 2.0**10


def test_custom_loop_one_replica_nan_skips_everywhere(distributed_setup):
    strategy, variables, opt, train_step = distributed_setup
    train_step(tf.constant(False))
    train_step(tf.constant(False))
    assert int(opt.iterations.numpy()) == 2
    weights_before = [_local(strategy, v) for v in variables]
    slots_before = [_local(strategy, v) for v in opt.inner_optimizer.variables]
    scale_before = _loss_scale_state_per_replica(strategy, opt)[0]
    assert scale_before == [2.0**10, 2.0**10]

    train_step(tf.constant(True))

    for before, variable in zip(weights_before, variables):
        after = _local(strategy, variable)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a, b)
    for before, variable in zip(slots_before, opt.inner_optimizer.variables):
        for b, a in zip(before, _local(strategy, variable)):
            np.testing.assert_array_equal(a, b)
    assert int(opt.iterations.numpy()) == 2
    state = _loss_scale_state_per_replica(strategy, opt)
    assert state[0] == [2.0**9, 2.0**9]  # halved on both replicas
    assert state[1] == [0.0, 0.0]  # good steps reset
    assert state[3] == [1.0, 1.0]  # one skipped step, on both
    # A finite step applies again, identically on both replicas.
    train_step(tf.constant(False))
    assert int(opt.iterations.numpy()) == 3
    _assert_replicas_identical(strategy, variables)
    after = _local(strategy, variables[0])
    assert not np.array_equal(after[0], weights_before[0][0])
    assert np.all(np.isfinite(after[0]))
    assert _loss_scale_state_per_replica(strategy, opt)[0] == [2.0**9, 2.0**9]


# -- gradient accumulation ------------------------------------------------------------


def _accumulating_step(strategy, opt, w):
    return tf.function(lambda: strategy.run(lambda: opt.apply([tf.ones(2)], [w])))


def test_gradient_accumulation_under_merge_call_raises_naming_the_setting(mirrored_strategy):
    """Keras all-reduces accumulated gradients inside its own tf.cond, where
    MirroredStrategy's merge_call is refused: the bare optimizer fails with
    TensorFlow's RuntimeError; tfdls says why, before anything runs."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([1.0, 2.0], name="w")
        bare = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
        bare.build([w])
        opt.build([w])
    with pytest.raises(RuntimeError, match="merge_call"):
        _accumulating_step(strategy, bare, w)()
    with pytest.raises(ValueError, match=r"SGD\(gradient_accumulation_steps=2\).*MirroredStrategy"):
        _accumulating_step(strategy, opt, w)()
    assert np.array_equal(w.numpy(), [1.0, 2.0]) and int(opt.iterations.numpy()) == 0
    # Eagerly (each replica's cond runs as Python) it works, as Keras' does:
    # scaled gradients 1 and 3 on each replica, summed over two replicas and
    # averaged over the two micro-batches: 4.
    scale = float(opt.loss_scale().numpy())
    strategy.run(lambda: opt.apply([tf.constant([scale, scale])], [w]))
    strategy.run(lambda: opt.apply([tf.constant([3 * scale, 3 * scale])], [w]))
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.1 * 4, 2.0 - 0.1 * 4], rtol=1e-6)


# -- the replicas' sum ----------------------------------------------------------------


class _DelegatingScale(tfdls.DynamicLossScale):
    """A custom scale (its own `update`) that decides as the parent does."""

    def update(self, grads):
        return super().update(grads)


@pytest.mark.parametrize("boundaries, custom", [(False, False), (True, False), (False, True)])
def test_a_replica_sum_that_could_overflow_skips_the_step(mirrored_strategy, boundaries, custom):
    """float16 variables: each replica's gradient of 40000 is finite, their sum
    (80000) is not, and Keras sums them before applying: the step used to
    apply Inf (found by review). 16000 each sums to 32000 and applies exactly.
    Replica-dependent gradients: 30000 and 10000 sum to 40000 (applies)."""
    strategy = mirrored_strategy
    keras.mixed_precision.set_global_policy("float16")
    with strategy.scope():
        layers = [keras.Input((2,)), tfdls.UnscaledInput(),
                  keras.layers.Dense(2, use_bias=False, name="d0")]
        if boundaries:
            layers.append(tfdls.ScaleBoundary(min_log2_factor=-2, max_log2_factor=-2,
                                              initial_log2_factor=-2))
        model = keras.Sequential(layers + [keras.layers.Dense(1, use_bias=False, name="d1")])
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(1.0),
            _DelegatingScale(1.0) if custom else tfdls.DynamicLossScale(1.0),
            scale_boundaries=model if boundaries else None)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    # Below a boundary at 2**-2 the gradient given is a quarter of what is applied.
    given = [0.25 if boundaries and v.path.endswith("d0/kernel") else 1.0 for v in variables]

    @tf.function
    def step(first, second):
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            value = tf.where(replica == 0, first, second)
            grads = [tf.fill(v.shape, tf.cast(value * g, v.dtype)) for v, g in zip(variables, given)]
            opt.apply(grads, variables)
        strategy.run(replica_step)

    for v in variables:
        v.assign(tf.zeros_like(v))
    step(tf.constant(40000.0), tf.constant(40000.0))
    assert int(opt.iterations.numpy()) == 0
    if not custom:  # a custom scale keeps its own count
        assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1
        report = opt.last_overflow()
        assert report.variable_names == ()
        assert sorted(report.sum_overflow_names) == sorted(v.path for v in variables)
    for v in variables:
        for copy in _local(strategy, v):
            np.testing.assert_array_equal(copy, np.zeros(v.shape, "float16"))
    for first, second in ((16000.0, 16000.0), (30000.0, 10000.0)):
        for v in variables:
            v.assign(tf.zeros_like(v))
        iterations = int(opt.iterations.numpy())
        step(tf.constant(first), tf.constant(second))
        assert int(opt.iterations.numpy()) == iterations + 1
        for v in variables:
            for copy in _local(strategy, v):
                np.testing.assert_array_equal(
                    copy, np.full(v.shape, -(first + second), "float16"))


# -- one replica ------------------------------------------------------------------------


@pytest.mark.parametrize("jit_compile", ["auto", False])
def test_one_replica_mirrored_strategy_steps_and_skips(jit_compile):
    """`MirroredStrategy()` on a one-GPU machine has one replica, and Keras' optimizers
    call `merge_call` there too: the step takes the cross-replica cond, as with several
    replicas (a masked update's audit traced the `merge_call` in a nested function, which
    TensorFlow refuses: every step raised)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        w = keras.Variable(np.ones(3, np.float32), name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), jit_compile=jit_compile)
        opt.build([w])

    @tf.function
    def step(factor):
        def replica():
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_sum(w * w) * factor)
            opt.apply(tape.gradient(loss, [w]), [w])

        strategy.run(replica)

    step(tf.constant(0.25))  # gradient 0.5 * w: w becomes 0.75
    np.testing.assert_array_equal(w.numpy(), np.full(3, 0.75, np.float32))
    scale = float(opt.loss_scale().numpy())
    step(tf.constant(np.inf))
    assert opt.step_plan.skip == "cond"
    np.testing.assert_array_equal(w.numpy(), np.full(3, 0.75, np.float32))  # skipped
    assert float(opt.loss_scale().numpy()) == scale / 2
    assert int(opt.iterations.numpy()) == 1


def test_one_replica_mirrored_strategy_fit_trains():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.arange(1.0, 5.0, dtype="float32")[:, None]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05)), "mse",
                      jit_compile=False)
    losses = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] / 4, losses


def test_one_replica_mirrored_strategy_refuses_a_compiled_apply():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        w = keras.Variable(np.ones(3, np.float32), name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), jit_compile=True)
        opt.build([w])

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_sum(w * w))
            opt.apply(tape.gradient(loss, [w]), [w])

        strategy.run(replica)

    with pytest.raises(ValueError, match=r"jit_compile=True.*with 1 replica:"):
        step()
