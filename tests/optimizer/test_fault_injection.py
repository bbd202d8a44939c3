"""Fault injection in real training: NaN/Inf planted in random variables'
gradients at random steps of a mixed_float16 run.

Promise checked: every injected step is skipped, no clean step is skipped,
weights and optimizer slots never become non-finite, and the scale recovers.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

STEPS = 2000
FAULT_RATE = 0.03
GROWTH_PERIOD = 25
# Capped so that clean steps never overflow by themselves: any skipped step
# must then be an injected one.
MAX_SCALE = 2.0**12
# From the minimum (1.0) back to the cap takes 12 growths of GROWTH_PERIOD.
RECOVERY_STEPS = 13 * GROWTH_PERIOD


def _data(seed=0, n=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
    return x, y


def _model():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )


def _fault_plan(num_variables, steps, seed):
    """Per step: 0 clean, 1 NaN, 2 +Inf, 3 -Inf; and which variable gets it."""
    rng = np.random.default_rng(seed)
    kind = np.where(rng.random(steps) < FAULT_RATE, rng.integers(1, 4, steps), 0)
    kind[:5] = 0  # let the run start cleanly
    kind[-RECOVERY_STEPS:] = 0  # and end with room to recover
    variable = rng.integers(0, num_variables, steps)
    return kind.astype("int32"), variable.astype("int32")


def _poison(grads, kind, index):
    """Plants the fault in gradient `index` (branch-free, works in graph)."""
    bad = tf.gather(tf.constant([0.0, np.nan, np.inf, -np.inf], tf.float32), kind)
    out = []
    for i, g in enumerate(grads):
        hit = tf.logical_and(kind > 0, tf.equal(index, i))
        # One element of the gradient becomes NaN/Inf.
        flat = tf.reshape(g, [-1])
        planted = tf.tensor_scatter_nd_update(flat, [[0]], tf.cast(tf.reshape(bad, [1]), g.dtype))
        out.append(tf.where(hit, tf.reshape(planted, tf.shape(g)), g))
    return out


def _all_finite_state(model, optimizer):
    values = [v.numpy() for v in model.trainable_variables]
    values += [np.asarray(v.numpy()) for v in optimizer.inner_optimizer.variables]
    return all(np.all(np.isfinite(v.astype("float64"))) for v in values)


def _check_outcome(kind, skipped_per_step, scales, model, optimizer):
    injected = kind > 0
    assert injected.sum() >= FAULT_RATE * len(kind) / 2, "the plan must inject enough faults"
    # Every injected step skipped, no clean step skipped.
    np.testing.assert_array_equal(skipped_per_step.astype(bool), injected)
    assert int(optimizer.loss_scale.num_skipped_steps) == injected.sum()
    assert _all_finite_state(model, optimizer)
    assert np.all(np.isfinite(scales)) and np.all(scales >= 1.0) and np.all(scales <= MAX_SCALE)
    # The scale recovers: after the last fault it climbs back to the cap,
    # one growth per GROWTH_PERIOD clean steps.
    last_fault = np.flatnonzero(injected)[-1]
    at_fault = scales[last_fault]
    growths = int(np.log2(MAX_SCALE / at_fault))
    recovered_at = last_fault + growths * GROWTH_PERIOD
    assert scales[recovered_at] == MAX_SCALE
    assert growths == 0 or scales[recovered_at - 1] < MAX_SCALE


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_single_device_faults_are_skipped_and_nothing_is_lost():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    x, y = _data()
    model = _model()
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        loss_scale=tfdls.DynamicLossScale(
            initial_loss_scale=MAX_SCALE, increment_period=GROWTH_PERIOD, max_loss_scale=MAX_SCALE
        ),
        min_scale_policy="ignore",
    )
    variables = model.trainable_variables
    kind, index = _fault_plan(len(variables), STEPS, seed=7)

    @tf.function
    def step(xb, yb, fault_kind, fault_index):
        before = optimizer.loss_scale.num_skipped_steps
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = optimizer.scale_loss(loss)
        grads = _poison(tape.gradient(scaled, variables), fault_kind, fault_index)
        optimizer.apply_gradients(zip(grads, variables))
        return optimizer.loss_scale.num_skipped_steps - before, optimizer.loss_scale(), loss

    skipped, scales, losses = [], [], []
    for i in range(STEPS):
        b = (i * 32) % len(x)
        s, scale, loss = step(x[b : b + 32], y[b : b + 32], kind[i], index[i])
        skipped.append(s)
        scales.append(scale)
        losses.append(loss)
    skipped = np.array([int(s) for s in skipped])
    scales = np.array([float(s) for s in scales])
    _check_outcome(kind, skipped, scales, model, optimizer)
    # And it still learned.
    assert np.mean([float(v) for v in losses[-50:]]) < 0.5 * np.mean([float(v) for v in losses[:50]])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mirrored_fault_on_one_replica_skips_everywhere(mirrored_strategy):
    steps = STEPS // 2
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(2)
    x, y = _data(seed=3)
    strategy = mirrored_strategy
    with strategy.scope():
        model = _model()
        optimizer = tfdls.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3),
            loss_scale=tfdls.DynamicLossScale(
                initial_loss_scale=MAX_SCALE,
                increment_period=GROWTH_PERIOD,
                max_loss_scale=MAX_SCALE,
            ),
            min_scale_policy="ignore",
        )
        # As with any Keras optimizer, build before the first strategy.run.
        optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    kind, index = _fault_plan(len(variables), steps, seed=11)

    def replica_step(xb, yb, fault_kind, fault_index):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        # The fault lands on replica 1 only.
        local_kind = tf.where(tf.equal(replica, 1), fault_kind, 0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = optimizer.scale_loss(loss / strategy.num_replicas_in_sync)
        grads = _poison(tape.gradient(scaled, variables), local_kind, fault_index)
        optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def step(xb, yb, fault_kind, fault_index):
        before = optimizer.loss_scale.num_skipped_steps
        strategy.run(replica_step, args=(xb, yb, fault_kind, fault_index))
        return optimizer.loss_scale.num_skipped_steps - before, optimizer.loss_scale()

    def batches():
        for i in range(steps):
            b = (i * 32) % len(x)
            yield x[b : b + 32], y[b : b + 32]

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_generator(
            batches,
            output_signature=(
                tf.TensorSpec([32, 8], tf.float32),
                tf.TensorSpec([32, 1], tf.float32),
            ),
        )
    )
    skipped, scales = [], []
    for i, (xb, yb) in enumerate(dataset):
        s, scale = step(xb, yb, kind[i], index[i])
        skipped.append(s)
        scales.append(scale)
    skipped = np.array([int(s) for s in skipped])
    scales = np.array([float(s) for s in scales])
    _check_outcome(kind, skipped, scales, model, optimizer)
    # Replicas hold identical weights and scale.
    for v in model.trainable_variables:
        copies = strategy.experimental_local_results(v.value)
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
    scale_copies = strategy.experimental_local_results(optimizer.loss_scale.current_loss_scale)
    assert float(scale_copies[0]) == float(scale_copies[1])


def test_permanent_overflow_drives_scale_to_minimum_and_policy_raises():
    """A scale driven to min_loss_scale by permanent overflow follows the policy."""
    w = keras.Variable(np.ones(3, "float32"), name="stuck_weight")
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**6, min_loss_scale=0.25),
        min_scale_policy="raise",
    )

    @tf.function
    def step():
        optimizer.apply([tf.constant([1.0, np.nan, 1.0])], [w])

    for _ in range(8):  # 64 -> 0.25 takes 8 halvings, none of them "stuck"
        step()
    assert float(optimizer.loss_scale()) == 0.25
    optimizer.check_min_scale_policy()  # nothing to report yet
    step()  # the step records the stuck overflow without waiting for the host
    with pytest.raises(tfdls.LossScaleStuckError, match="at its minimum.*stuck_weight"):
        optimizer.check_min_scale_policy()
    np.testing.assert_array_equal(w.numpy(), np.ones(3, "float32"))
    assert int(optimizer.iterations.numpy()) == 0
