"""``LossScaleOptimizer(all_reduce_dtype="float16")`` under MirroredStrategy (two logical CPUs).

The scaled gradients are summed over the replicas in float16, then divided
and checked; the inner optimizer applies the sums without a second
all-reduce. References are computed in float64 from the per-replica values.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfdls
from tfdls import _all_reduce

SCALE = 2.0**12


def _local(strategy, variable):
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return [np.array(v.numpy()) for v in strategy.experimental_local_results(variable)]


def _the_value(strategy, variable):
    """The variable's value, asserting both replicas hold the same bits."""
    first, second = _local(strategy, variable)
    np.testing.assert_array_equal(first, second, err_msg=str(variable.name))
    return first


def _float16_sum_reference(per_replica, scale, dtype):
    """What the step must apply: the float64 sum of the per-replica scaled values,
    rounded once to float16 (two replicas: one float16 addition, correctly rounded),
    then divided by the scale and rounded to the variable's dtype."""
    exact = np.sum(np.asarray(per_replica, np.float64), axis=0)
    wire = exact.astype(np.float16).astype(np.float64)
    return (wire / scale).astype(dtype)


# -- the argument ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["int8", "float32", "bfloat16", tf.float32, 16])
def test_an_unknown_all_reduce_dtype_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=re.escape(f"got all_reduce_dtype={value!r}")):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype=value)


def test_a_scale_that_never_skips_is_refused():
    with pytest.raises(ValueError, match="all_reduce_dtype='float16' needs a loss scale that can skip"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), 128.0, all_reduce_dtype="float16")


def test_the_default_is_none_and_the_config_round_trips():
    assert tfdls.LossScaleOptimizer(keras.optimizers.SGD()).all_reduce_dtype is None
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype=tf.float16)
    assert opt.all_reduce_dtype == "float16"
    config = opt.get_config()
    assert config["all_reduce_dtype"] == "float16"
    assert tfdls.LossScaleOptimizer.from_config(config).all_reduce_dtype == "float16"


def test_without_a_strategy_nothing_changes():
    w = keras.Variable([0.0, 0.0], name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0),
                                   all_reduce_dtype="float16")
    # 1 + 2**-20 is not a float16: a float16 all-reduce would round it to 1.
    opt.scale_loss(0.0)
    tf.function(lambda: opt.apply([tf.constant([1.0 + 2.0**-20, 3.0])], [w]))()
    assert opt.step_plan.all_reduce == "keras"
    np.testing.assert_array_equal(w.numpy(), np.float32([-(1.0 + 2.0**-20), -3.0]))


# -- the update: float16 sums, divided exactly ----------------------------------------


@pytest.fixture(scope="module")
def summing_setup(mirrored_strategy):
    """A float32 and a float16 variable, SGD(1.0) from zeros: what is applied is
    minus the unscaled gradient, read exactly."""
    strategy = mirrored_strategy
    with strategy.scope():
        w32 = keras.Variable(np.zeros((3, 5), np.float32), name="w32")
        w16 = keras.Variable(np.zeros((7,), np.float16), dtype="float16", name="w16")
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(1.0),
            tfdls.DynamicLossScale(SCALE, increment_period=10**6),
            all_reduce_dtype="float16",
        )
        opt.build([w32, w16])
    variables = [w32, w16]

    @tf.function
    def step(g32, g16):  # g*: [replica, ...] scaled gradients
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.scale_loss(0.0)  # records the scale apply divides by
            opt.apply([tf.gather(g32, replica), tf.gather(g16, replica)], variables)
        strategy.run(replica_step)

    def run(g32, g16):
        for v in variables:
            v.assign(tf.zeros_like(v))
        step(tf.constant(g32, tf.float32), tf.constant(g16, tf.float16))
        return [-_the_value(strategy, v) for v in variables]

    return strategy, opt, variables, run, step


def test_the_applied_update_is_the_float16_sum_divided(summing_setup):
    """Values chosen so that the float16 sum is not the exact sum: the update is the
    rounded one (Keras' float32 all-reduce would apply the exact sum)."""
    strategy, opt, variables, run, _ = summing_setup
    g32 = np.zeros((2, 3, 5), np.float32)
    g32[0] = 2048.0
    g32[1] = 1.0  # 2049 is not a float16: rounds to 2048
    g32[1, 0, 0] = 3.0  # 2051 rounds to 2052
    g16 = np.stack([np.full(7, 1000.0), np.full(7, 0.25)]).astype(np.float16)
    applied = run(g32, g16)
    assert opt.step_plan.all_reduce == "float16"
    np.testing.assert_array_equal(applied[0], _float16_sum_reference(g32, SCALE, np.float32))
    np.testing.assert_array_equal(applied[1], _float16_sum_reference(g16, SCALE, np.float16))
    assert applied[0][0, 1] == np.float32(2048.0 / SCALE)  # not 2049 / SCALE
    assert applied[0][0, 0] == np.float32(2052.0 / SCALE)
    assert int(opt.iterations.numpy()) >= 1


float16_values = st.floats(-30000.0, 30000.0, width=16, allow_subnormal=True)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(float16_values, min_size=2 * 15 + 2 * 7, max_size=2 * 15 + 2 * 7))
def test_against_float64_sums(summing_setup, values):
    """Per-replica scaled gradients are float16 values (what the backward pass of a
    mixed_float16 model produced); the update is their float64 sum rounded once to
    float16, divided by the scale."""
    strategy, opt, variables, run, _ = summing_setup
    values = np.asarray(values, np.float64)
    g32 = values[:30].reshape(2, 3, 5).astype(np.float32)
    g16 = values[30:].reshape(2, 7).astype(np.float16)
    iterations = int(opt.iterations.numpy())
    applied = run(g32, g16)
    assert int(opt.iterations.numpy()) == iterations + 1  # |sum| <= 60000: finite
    np.testing.assert_array_equal(applied[0], _float16_sum_reference(g32, SCALE, np.float32))
    np.testing.assert_array_equal(applied[1], _float16_sum_reference(g16, SCALE, np.float16))


def test_a_sum_that_overflows_float16_skips_and_names_its_variable(summing_setup):
    strategy, opt, variables, run, step = summing_setup
    scale = float(opt.loss_scale().numpy())
    skipped = int(opt.loss_scale.num_skipped_steps.numpy())
    iterations = int(opt.iterations.numpy())
    g32 = np.full((2, 3, 5), 40000.0, np.float32)  # finite on each replica; sums to 80000
    g16 = np.full((2, 7), 1.0, np.float16)
    for v in variables:
        v.assign(tf.ones_like(v))
    before = [_the_value(strategy, v) for v in variables]
    step(tf.constant(g32), tf.constant(g16))
    for b, v in zip(before, variables):
        np.testing.assert_array_equal(_the_value(strategy, v), b)
    assert int(opt.iterations.numpy()) == iterations
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == skipped + 1
    for copy in _local(strategy, opt.loss_scale.current_loss_scale):
        assert float(copy) == scale / 2
    report = opt.last_overflow()
    assert report.variable_names == ("w32",)  # the summed gradient that overflowed
    assert report.sum_overflow_names == ()
    opt.loss_scale.current_loss_scale.assign(SCALE)


# -- the traced step: one float16 all-reduce --------------------------------------------


def _traced_collectives(strategy, opt, model, x):
    @tf.function
    def train_step(x):
        def replica_step(x):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32))))
            opt.apply(tape.gradient(loss, model.trainable_variables),
                      model.trainable_variables)
        strategy.run(replica_step, args=(x,))

    graph = train_step.get_concrete_function(tf.TensorSpec(x.shape, tf.float32)).graph
    return _all_reduce.collective_traffic(graph)


@pytest.mark.parametrize("all_reduce_dtype", [None, "float16"])
def test_the_step_all_reduces_the_gradients_once_in_float16(mirrored_strategy,
                                                           all_reduce_dtype):
    """One collective per replica carries the gradients: float16 on the new path,
    float32 on Keras'; the only other collectives are the per-gradient finiteness
    counts (and, on Keras' path, the bound on the replicas' sum)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = mirrored_strategy
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32),
                                  keras.layers.Dense(8)])
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(),
                                       all_reduce_dtype=all_reduce_dtype)
        opt.build(model.trainable_variables)
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    collectives = _traced_collectives(strategy, opt, model, np.zeros((4, 16), np.float32))
    gradient_sized = [c for c in collectives if c.elements == parameters]
    assert len(gradient_sized) == 2  # one per replica
    assert {c.dtype for c in gradient_sized} == {
        "float16" if all_reduce_dtype else "float32"}
    assert {c.type for c in gradient_sized} == {"CollectiveReduceV2"}
    others = [c for c in collectives if c.elements != parameters]
    # A few scalars per gradient (and Keras' path its sum bound in float64).
    assert all(c.elements <= 2 * len(model.trainable_variables) for c in others), others
    if all_reduce_dtype:
        assert opt.step_plan.all_reduce == "float16"
        assert [c.dtype for c in others] == ["float32", "float32"]  # the counts
