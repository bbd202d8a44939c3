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
from tests.support.replicas import copies as _local, the_value as _the_value
from tfdls import _distribute

SCALE = 2.0**12


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
    return _distribute.collective_traffic(graph)


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


# -- what works on Keras' path works here ---------------------------------------------


def _replica_step(strategy, fn):
    return tf.function(lambda *args: strategy.run(fn, args=args))


def test_tf_keras_style_unscaled_gradients_are_summed_scaled(mirrored_strategy):
    """get_unscaled_gradients divided each replica's gradients; apply multiplies them back
    (exact: a power-of-two scale) and sums the scaled values in float16: the same update
    as Keras 3 style, bit for bit."""
    strategy = mirrored_strategy
    # Scaled by 4: 8192 + 12 = 8204 is a float16 rounding tie, rounded to 8208.
    per_replica = np.array([[2048.0, 5.0], [3.0, -1.5]], np.float32)
    results = []
    for style in ("keras3", "tfkeras"):
        with strategy.scope():
            w = keras.Variable([0.0, 0.0], name="w")
            opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                           tfdls.DynamicLossScale(4.0),
                                           all_reduce_dtype="float16")
            opt.build([w])

        def replica_fn(style=style, opt=opt, w=w):
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(tf.constant(per_replica), replica)
                                     * tf.convert_to_tensor(w))
                scaled = opt.scale_loss(loss) if style == "keras3" else opt.get_scaled_loss(loss)
            grads = tape.gradient(scaled, [w])
            if style == "tfkeras":
                grads = opt.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(grads, [w]))

        _replica_step(strategy, replica_fn)()
        results.append(-_the_value(strategy, w))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], np.float32([2052.0, 3.5]))


def test_indexed_slices_are_gathered_in_float16_and_applied_once(mirrored_strategy):
    """Embedding-style gradients: each replica's rows cross in float16 (gathered, as
    Keras gathers them), and the inner optimizer adds rows of one index."""
    strategy = mirrored_strategy
    rows = {0: ([1, 3, 3], [[1.0, 2.0], [4.0, 8.0], [0.5, 0.25]]),
            1: ([3, 0, 5], [[16.0, 1.0], [-2.0, 3.0], [7.0, 7.0]])}
    with strategy.scope():
        table = keras.Variable(np.zeros((6, 2), np.float32), name="table")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(2.0**10),
                                       all_reduce_dtype="float16")
        opt.build([table])

    def replica_fn():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        indices = tf.where(replica == 0, tf.constant(rows[0][0]), tf.constant(rows[1][0]))
        values = tf.where(replica == 0, tf.constant(rows[0][1]), tf.constant(rows[1][1]))
        opt.scale_loss(0.0)
        opt.apply([tf.IndexedSlices(values * 2.0**10, indices, tf.constant([6, 2]))], [table])

    step = tf.function(lambda: strategy.run(replica_fn))
    collectives = _distribute.collective_traffic(step.get_concrete_function().graph)
    step()
    expected = np.zeros((6, 2), np.float64)
    for indices, values in rows.values():
        np.add.at(expected, indices, np.asarray(values, np.float64))
    np.testing.assert_array_equal(-_the_value(strategy, table), expected.astype(np.float32))
    assert int(opt.iterations.numpy()) == 1
    value_collectives = [c for c in collectives if c.elements == 3 * 2]
    assert value_collectives and {c.dtype for c in value_collectives} == {"float16"}


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")  # eager scale_loss outside
def test_gradient_accumulation_sums_each_micro_batch(mirrored_strategy):
    """Eagerly (tf.function refuses accumulation under MirroredStrategy, see
    test_optimizer_mirrored): each micro-batch's float16 sums are accumulated; the
    update is their mean, as on Keras' path."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([1.0, 2.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                                       tfdls.DynamicLossScale(2.0**10),
                                       all_reduce_dtype="float16")
        opt.build([w])
    scale = float(opt.loss_scale().numpy())
    opt.scale_loss(0.0)
    strategy.run(lambda: opt.apply([tf.constant([scale, scale])], [w]))
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    opt.scale_loss(0.0)
    strategy.run(lambda: opt.apply([tf.constant([3 * scale, 3 * scale])], [w]))
    # Sums over two replicas: 2 and 6; their mean 4.
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.1 * 4, 2.0 - 0.1 * 4], rtol=1e-6)
    _the_value(strategy, w)


def test_gradient_stats_read_the_sums(mirrored_strategy):
    """2**14 on each replica sums to 2**15: one bit of headroom below 65504, not two."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([0.0, 0.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0),
                                       gradient_stats=True, all_reduce_dtype="float16")
        opt.build([w])

    def replica_fn():
        opt.scale_loss(0.0)
        opt.apply([tf.constant([0.0, 2.0**14])], [w])

    _replica_step(strategy, replica_fn)()
    stats = opt.gradient_stats()["w"]
    assert stats.headroom_bits == pytest.approx(np.log2(65504 / 2.0**15))
    assert stats.zero_fraction == 0.5


@pytest.mark.parametrize("variable_dtype", ["bfloat16", "float16"])
def test_sixteen_bit_gradients_keep_their_dtype(mirrored_strategy, variable_dtype):
    """Only float32 gradients are cast: float16 and bfloat16 ones already are 16 bits
    (bfloat16 training needs no loss scale; with one, its sums cross as bfloat16)."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable(np.zeros(4), dtype=variable_dtype, name="w")
        with pytest.warns(tfdls.BFloat16Warning) if variable_dtype == "bfloat16" else _no_op():
            opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                           tfdls.DynamicLossScale(4.0),
                                           all_reduce_dtype="float16")
            opt.build([w])

    def replica_fn():
        opt.scale_loss(0.0)
        opt.apply([tf.fill([4], tf.constant(12.0, variable_dtype))], [w])

    step = _replica_step(strategy, replica_fn)
    collectives = _distribute.collective_traffic(step.get_concrete_function().graph)
    step()
    assert {c.dtype for c in collectives if c.elements == 4} == {variable_dtype}
    np.testing.assert_array_equal(_the_value(strategy, w).astype(np.float32), np.full(4, -6.0))


class _no_op:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_checkpoint_after_a_float16_step_restores_and_resumes(mirrored_strategy, tmp_path):
    strategy = mirrored_strategy

    def make():
        with strategy.scope():
            w = keras.Variable([1.0, 2.0], name="w")
            opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(0.1),
                                           tfdls.DynamicLossScale(2.0**10),
                                           all_reduce_dtype="float16")
            opt.build([w])
        return w, opt

    def stepper(w, opt):
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_sum(tf.square(w)))
            opt.apply(tape.gradient(loss, [w]), [w])
        return _replica_step(strategy, replica_fn)

    w, opt = make()
    step = stepper(w, opt)
    step()
    path = tf.train.Checkpoint(w=w, opt=opt).save(str(tmp_path / "ckpt"))
    step()
    continued = _the_value(strategy, w)
    w2, opt2 = make()
    tf.train.Checkpoint(w=w2, opt=opt2).restore(path).assert_consumed()
    assert int(opt2.iterations.numpy()) == 1
    stepper(w2, opt2)()
    np.testing.assert_array_equal(_the_value(strategy, w2), continued)


def test_a_keras_file_keeps_the_setting(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype="float16"),
                  loss="mse")
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.all_reduce_dtype == "float16"


@pytest.mark.parametrize("first, second, applies", [
    (40000.0, 40000.0, False), (16000.0, 16000.0, True), (30000.0, 10000.0, True)])
def test_scale_boundaries_divide_the_sums(mirrored_strategy, first, second, applies):
    """float16 variables below a boundary at 2**-2 (their gradients given are a quarter of
    what is applied): the sums are divided by the scale times the factor, and a sum
    that overflows (80000) skips the step."""
    strategy = mirrored_strategy
    keras.mixed_precision.set_global_policy("float16")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,)), tfdls.UnscaledInput(),
            keras.layers.Dense(2, use_bias=False, name="d0"),
            tfdls.ScaleBoundary(min_log2_factor=-2, max_log2_factor=-2, initial_log2_factor=-2),
            keras.layers.Dense(1, use_bias=False, name="d1")])
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0),
                                       scale_boundaries=model, all_reduce_dtype="float16",
                                       min_scale_policy="ignore")
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    given = [0.25 if v.path.endswith("d0/kernel") else 1.0 for v in variables]
    for v in variables:
        v.assign(tf.zeros_like(v))

    def replica_fn():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        value = tf.where(replica == 0, first, second)
        opt.scale_loss(0.0)
        opt.apply([tf.fill(v.shape, tf.cast(value * g, v.dtype))
                   for v, g in zip(variables, given)], variables)

    _replica_step(strategy, replica_fn)()
    assert opt.step_plan.all_reduce == "float16"
    assert int(opt.iterations.numpy()) == int(applies)
    for v in variables:
        expected = -(first + second) if applies else 0.0
        np.testing.assert_array_equal(_the_value(strategy, v), np.full(v.shape, expected,
                                                                       "float16"))
    if not applies:
        assert "d1/kernel" in " ".join(opt.last_overflow().variable_names)




def test_gradients_of_several_dtypes_cross_in_one_collective_per_dtype(mirrored_strategy):
    """float32 gradients cross as float16, bfloat16 and float64 ones in their own dtype:
    Keras' single all-reduce call cannot pack mixed dtypes; tfdls makes one per dtype."""
    strategy = mirrored_strategy
    with strategy.scope():
        variables = [keras.Variable(np.zeros(3), dtype=d, name=f"w_{d}")
                     for d in ("float32", "float16", "bfloat16", "float64")]
        with pytest.warns(tfdls.BFloat16Warning):
            opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                           tfdls.DynamicLossScale(4.0),
                                           all_reduce_dtype="float16")
            opt.build(variables)

    def replica_fn():
        opt.scale_loss(0.0)
        opt.apply([tf.fill([3], tf.constant(8.0, v.dtype)) for v in variables], variables)

    step = _replica_step(strategy, replica_fn)
    collectives = _distribute.collective_traffic(step.get_concrete_function().graph)
    step()
    sizes = sorted((c.dtype, c.elements) for c in collectives if c.dtype != "float32")
    assert sizes == sorted([("float16", 6), ("bfloat16", 3), ("float64", 3)] * 2)
    # float32: only the per-gradient finiteness counts.
    assert {c.elements for c in collectives if c.dtype == "float32"} == {len(variables)}
    for v in variables:
        np.testing.assert_array_equal(_the_value(strategy, v).astype(np.float64), [-4.0] * 3)
