"""``LossScaleOptimizer(all_reduce_dtype="float16")`` under call sequences a user could
pick, against a float64 reference (written as an outside review of the feature).

References are float64 sums of the per-replica *scaled* float16 values, rounded once to
float16 (two replicas: one correctly rounded float16 addition), divided by the scale
recorded by scale_loss. SGD(1.0) from zeros: the weights after a step are minus the
applied update.
"""

import numpy as np
import keras
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tfdls
from tests.support.replicas import the_value as _the_value

F16_MAX = 65504.0


def _wire_sum(per_replica):
    """float64 sum of the replicas' values, rounded once to float16 (as float64)."""
    exact = np.sum(np.asarray(per_replica, np.float64), axis=0)
    with np.errstate(over="ignore"):
        return exact.astype(np.float16).astype(np.float64)


# -- 1. call sequences, against a float64 reference ---------------------------------------

ROWS = (np.array([0, 2, 2]), np.array([2, 4, 0]))  # IndexedSlices indices per replica


@pytest.fixture(scope="module")
def sequence_setup(mirrored_strategy):
    strategy = mirrored_strategy
    with strategy.scope():
        w32 = keras.Variable(np.zeros((2, 3), np.float32), name="w32")
        w16 = keras.Variable(np.zeros((4,), np.float16), dtype="float16", name="w16")
        table = keras.Variable(np.zeros((5, 2), np.float32), name="table")
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(1.0),
            tfdls.DynamicLossScale(2.0**4, increment_period=2),
            all_reduce_dtype="float16", min_scale_policy="ignore")
        variables = [w32, w16, table]
        opt.build(variables)

    @tf.function
    def step(g32, g16, rows, style, split, none):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            indices = tf.where(r == 0, tf.constant(ROWS[0]), tf.constant(ROWS[1]))
            grads = [tf.gather(g32, r), tf.gather(g16, r),
                     tf.IndexedSlices(tf.gather(rows, r), indices, tf.constant([5, 2]))]
            if none is not None:
                grads[none] = None
            groups = [[0, 1, 2]] if not split else [[0], [1, 2]]
            if style == "keras3":
                opt.scale_loss(0.0)
            else:
                opt.get_scaled_loss(0.0)
            for group in groups:
                gs = [grads[i] for i in group]
                vs = [variables[i] for i in group]
                if style == "keras3":
                    opt.apply(gs, vs)
                else:
                    present = [k for k, g in enumerate(gs) if g is not None]
                    unscaled = opt.get_unscaled_gradients([gs[k] for k in present])
                    opt.apply_gradients(zip(unscaled, [vs[k] for k in present]))
        strategy.run(replica_fn)

    return strategy, opt, variables, step


def _values(rng, shape, edge):
    """Scaled gradients k * 2**e (k < 2048): float16 values whose quotient by the scales
    used here is exact in float16."""
    k = rng.integers(-2047, 2048, size=(2,) + shape)
    e = rng.integers(-2, 4, size=(2,) + shape)
    v = k * 2.0**e
    flat = v.reshape(2, -1)
    if edge == "max_finite":  # 32752 + 32752 = 65504: finite, must apply
        flat[:, 0] = 32752.0
    elif edge == "overflow":  # 32768 + 32768 = 65536: Inf in float16
        flat[:, 0] = 32768.0
    elif edge == "tie_overflow":  # 32768 + 32752 = 65520: a tie, rounds to Inf
        flat[0, 0], flat[1, 0] = 32768.0, 32752.0
    return flat.reshape((2,) + shape)


step_strategy = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31),
    "style": st.sampled_from(["keras3", "tfkeras"]),
    "split": st.booleans(),
    "none": st.sampled_from([None, 0, 1]),
    "edge": st.sampled_from(["none", "max_finite", "overflow", "tie_overflow"]),
    "edge_var": st.sampled_from([0, 1]),
})


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(st.lists(step_strategy, min_size=1, max_size=3))
def test_call_sequences_against_float64(sequence_setup, steps):
    strategy, opt, variables, step = sequence_setup
    w32, w16, table = variables
    opt.loss_scale.current_loss_scale.assign(2.0**4)
    for s in steps:
        rng = np.random.default_rng(s["seed"])
        none = s["none"]
        if s["split"] and none == 0:
            none = None  # a group of only None gradients is refused by design
        g32 = _values(rng, (2, 3), s["edge"] if s["edge_var"] == 0 else "none")
        g16 = _values(rng, (4,), s["edge"] if s["edge_var"] == 1 else "none")
        rows = _values(rng, (3, 2), "none")
        for v in variables:
            v.assign(tf.zeros_like(v))
        scale = float(opt.loss_scale().numpy())
        iterations = int(opt.iterations.numpy())
        step(tf.constant(g32, tf.float32), tf.constant(g16, tf.float16),
             tf.constant(rows, tf.float32), style=s["style"], split=s["split"], none=none)
        assert opt.step_plan.all_reduce == "float16"

        # Reference.
        sums = [_wire_sum(g32), _wire_sum(g16)]
        table_ref = np.zeros((5, 2), np.float64)
        for r in range(2):
            np.add.at(table_ref, ROWS[r], rows[r].astype(np.float16).astype(np.float64))
        present = [i for i in range(3) if i != none]
        groups = [present] if not s["split"] else [[i for i in g if i in present]
                                                    for g in ([0], [1, 2])]
        applied_groups = 0
        expected = [np.zeros((2, 3)), np.zeros(4), np.zeros((5, 2))]
        for group in groups:
            finite = all(np.all(np.isfinite(sums[i])) for i in group if i < 2)
            if finite:
                applied_groups += 1
                for i in group:
                    expected[i] = -(sums[i] / scale) if i < 2 else -(table_ref / scale)
        np.testing.assert_array_equal(_the_value(strategy, w32),
                                      expected[0].astype(np.float32), err_msg=str(s))
        np.testing.assert_array_equal(_the_value(strategy, w16),
                                      expected[1].astype(np.float16), err_msg=str(s))
        np.testing.assert_array_equal(_the_value(strategy, table),
                                      expected[2].astype(np.float32), err_msg=str(s))
        assert int(opt.iterations.numpy()) == iterations + applied_groups, s
        new_scale = float(opt.loss_scale().numpy())
        if applied_groups < len(groups):
            assert new_scale <= scale, s
            names = opt.last_overflow().variable_names
            assert names == (("w32",) if s["edge_var"] == 0 else ("w16",)), (names, s)
        else:
            assert new_scale >= scale, s


# -- 2. the hook: no leak, no double or missing all-reduce ---------------------------------


G = np.array([[1.0 + 2.0**-20, 3.0], [2.0, 5.0]], np.float32)  # per replica, unscaled


def _runner(strategy, opt, w, bare=False):
    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        g = tf.gather(tf.constant(G), r)
        if bare:
            opt.apply([g], [w])
            return
        opt.scale_loss(0.0)
        opt.apply([g * opt.loss_scale()], [w])
    return replica_fn


def test_the_hook_does_not_leak_into_other_uses_of_the_inner_optimizer(mirrored_strategy):
    """After a float16 apply, the same inner optimizer in a default LossScaleOptimizer, and
    bare, still all-reduces (in float32: 1 + 2**-20 + 2 is not rounded away), once."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([0.0, 0.0], name="w")
        inner = keras.optimizers.SGD(1.0)
        f16 = tfdls.LossScaleOptimizer(inner, tfdls.DynamicLossScale(4.0),
                                       all_reduce_dtype="float16")
        f16.build([w])
        default = tfdls.LossScaleOptimizer(inner, tfdls.DynamicLossScale(4.0))
        default.build([w])
    exact = -np.sum(G.astype(np.float64), axis=0).astype(np.float32)
    rounded = -_wire_sum(G).astype(np.float32)
    for name, opt, bare, expected in [("f16", f16, False, rounded),
                                      ("default", default, False, exact),
                                      ("bare", inner, True, exact),
                                      ("f16 again", f16, False, rounded)]:
        w.assign([0.0, 0.0])
        tf.function(lambda: strategy.run(_runner(strategy, opt, w, bare)))()
        np.testing.assert_array_equal(_the_value(strategy, w), expected, err_msg=name)
    # Eagerly (replica threads) too.
    for name, opt, bare, expected in [("f16 eager", f16, False, rounded),
                                      ("default eager", default, False, exact)]:
        w.assign([0.0, 0.0])
        with _quiet():
            strategy.run(_runner(strategy, opt, w, bare))
        np.testing.assert_array_equal(_the_value(strategy, w), expected, err_msg=name)


class _quiet:
    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


def test_two_float16_optimizers_on_one_model(mirrored_strategy):
    """Each optimizer owns half the variables; both sum in float16, once."""
    strategy = mirrored_strategy
    with strategy.scope():
        a = keras.Variable([0.0, 0.0], name="a")
        b = keras.Variable([0.0, 0.0], name="b")
        opt_a = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(4.0),
                                         all_reduce_dtype="float16")
        opt_b = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(8.0),
                                         all_reduce_dtype="float16")
        opt_a.build([a])
        opt_b.build([b])

    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        g = tf.gather(tf.constant(G), r)
        opt_a.scale_loss(0.0)
        opt_b.scale_loss(0.0)
        opt_a.apply([g * 4.0], [a])
        opt_b.apply([g * 8.0], [b])

    tf.function(lambda: strategy.run(replica_fn))()
    np.testing.assert_array_equal(_the_value(strategy, a),
                                  (-_wire_sum(G * 4.0) / 4.0).astype(np.float32))
    np.testing.assert_array_equal(_the_value(strategy, b),
                                  (-_wire_sum(G * 8.0) / 8.0).astype(np.float32))


# -- 3. the check reads the sums; skipped steps are exact ----------------------------------


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_skipped_step_is_bit_exact_with_adam_and_names_the_summed_overflow(
        mirrored_strategy, run_eagerly):
    """Only w16's *sum* overflows (40000 + 40000); w32's sum is finite. Nothing moves:
    weights, Adam's slots, iterations; last_overflow names w16 only."""
    strategy = mirrored_strategy
    with strategy.scope():
        w32 = keras.Variable([0.5, -0.25], name="w32")
        w16 = keras.Variable(np.float16([0.5, 1.0]), dtype="float16", name="w16")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(0.1),
                                       tfdls.DynamicLossScale(2.0**8),
                                       all_reduce_dtype="float16")
        opt.build([w32, w16])

    def replica_fn(big):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        opt.scale_loss(0.0)
        g16 = tf.where(r == 0, tf.constant([big, 1.0], tf.float16),
                       tf.constant([big, 2.0], tf.float16))
        opt.apply([tf.constant([100.0, 200.0]), g16], [w32, w16])

    def run(big):
        if run_eagerly:
            with _quiet():
                strategy.run(replica_fn, args=(big,))
        else:
            tf.function(lambda: strategy.run(replica_fn, args=(big,)))()

    run(10.0)  # one finite step: slots hold something
    before = [_the_value(strategy, v) for v in [w32, w16] + opt.inner_optimizer.variables]
    iterations = int(opt.iterations.numpy())
    scale = float(opt.loss_scale().numpy())
    run(40000.0)
    after = [_the_value(strategy, v) for v in [w32, w16] + opt.inner_optimizer.variables]
    for b, a, v in zip(before, after, [w32, w16] + opt.inner_optimizer.variables):
        np.testing.assert_array_equal(a, b, err_msg=v.name)
    assert int(opt.iterations.numpy()) == iterations
    assert float(opt.loss_scale().numpy()) == scale / 2
    assert opt.last_overflow().variable_names == ("w16",)


def test_per_replica_values_beyond_float16_whose_sum_fits(mirrored_strategy):
    """float32 scaled gradients 70000 and -60000 (a float32 layer of a mixed_float16
    model can produce them): their sum 10000 fits float16, but each replica's value is
    cast to float16 (Inf) before the sum. Documents the behaviour: the step is skipped
    (Keras' path would apply 10000 / scale)."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([0.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(4.0),
                                       all_reduce_dtype="float16")
        opt.build([w])

    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        opt.scale_loss(0.0)
        opt.apply([tf.where(r == 0, tf.constant([70000.0]), tf.constant([-60000.0]))], [w])

    tf.function(lambda: strategy.run(replica_fn))()
    assert int(opt.iterations.numpy()) == 0  # skipped
    assert float(opt.loss_scale().numpy()) == 2.0


# -- 4. modes agree -----------------------------------------------------------------------


def test_eager_and_graph_apply_the_same_bits(mirrored_strategy):
    strategy = mirrored_strategy
    rng = np.random.default_rng(3)
    per_replica = (rng.integers(-2047, 2048, size=(2, 16)) * 2.0 ** rng.integers(
        -3, 4, size=(2, 16))).astype(np.float32)
    results = []
    for eager in (False, True):
        with strategy.scope():
            w = keras.Variable(np.zeros(16, np.float32), name="w")
            opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                           tfdls.DynamicLossScale(8.0),
                                           all_reduce_dtype="float16")
            opt.build([w])

        def replica_fn(opt=opt, w=w):
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.scale_loss(0.0)
            opt.apply([tf.gather(tf.constant(per_replica), r)], [w])

        if eager:
            with _quiet():
                strategy.run(replica_fn)
        else:
            tf.function(lambda: strategy.run(replica_fn))()
        assert opt.step_plan.all_reduce == "float16"
        results.append(_the_value(strategy, w))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], (-_wire_sum(per_replica) / 8.0).astype(np.float32))


def test_apply_in_cross_replica_context_is_a_clear_value_error(mirrored_strategy):
    """Keras' path (all_reduce_dtype=None) raises tfdls' ValueError ("must be called in a
    replica context"); the float16 path should too, not an AttributeError."""
    strategy = mirrored_strategy
    messages = {}
    for dtype in (None, "float16"):
        with strategy.scope():
            w = keras.Variable([0.0, 0.0], name="w")
            opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                           tfdls.DynamicLossScale(4.0),
                                           all_reduce_dtype=dtype)
            opt.build([w])
            opt.scale_loss(0.0)
            with pytest.raises(Exception) as info:
                opt.apply([tf.constant([4.0, 4.0])], [w])
        messages[dtype] = info
    assert messages[None].type is ValueError
    assert "replica context" in str(messages[None].value)
    assert messages["float16"].type is ValueError, repr(messages["float16"].value)
    assert "replica context" in str(messages["float16"].value)


# -- 5. saving -----------------------------------------------------------------------------


def test_fit_then_keras_file_round_trip_on_the_float16_path(mirrored_strategy, tmp_path):
    """After fit on the float16 path (the hook installed on the inner optimizer), the model
    saves to .keras, reloads with the setting, and the reloaded weights and optimizer
    state equal the saved ones."""
    strategy = mirrored_strategy
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1, dtype="float32")])
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                       all_reduce_dtype="float16")
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert opt.step_plan.all_reduce == "float16"
    model.save(tmp_path / "m.keras")
    with strategy.scope():
        loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.all_reduce_dtype == "float16"
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(_the_value(strategy, a), _the_value(strategy, b))
    assert int(loaded.optimizer.iterations.numpy()) == int(opt.iterations.numpy())
    assert float(loaded.optimizer.loss_scale().numpy()) == float(opt.loss_scale().numpy())
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert loaded.optimizer.step_plan.all_reduce == "float16"


# -- 6. the argument -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [tf.float16, np.dtype("float16"), np.float16, "float16"])
def test_every_spelling_of_float16_is_accepted_alike(value):
    """tf.float16 and np.dtype('float16') are accepted; np.float16 (the scalar type, which
    numpy, TensorFlow and Keras all accept as a dtype) should be too."""
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype=value)
    assert opt.all_reduce_dtype == "float16"
    assert tfdls.LossScaleOptimizer.from_config(opt.get_config()).all_reduce_dtype == "float16"


@pytest.mark.parametrize("value", ["mixed_float16", keras.DTypePolicy("float16"), "half"])
def test_non_dtypes_are_refused(value):
    """A DTypePolicy is not a dtype: accepting DTypePolicy('float16') while refusing
    DTypePolicy('mixed_float16') is accidental (it has a .name)."""
    with pytest.raises(ValueError, match="all_reduce_dtype"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype=value)


def test_float32_gradients_are_rounded_to_float16_before_the_sum(mirrored_strategy):
    """The documented rule (docs/distribution.md): each replica's scaled gradient is
    rounded to float16, then the float16 values are summed (two replicas: one more
    rounding). Float32 gradients (the float32 layers of a mixed_float16 model) are not
    float16 values: replica 0 sends 1 + 3 * 2**-13, 1 on the wire; replica 1 sends
    3 * 2**-13, exact in float16; the wire's sum 1 + 3 * 2**-13 rounds to 1, where the
    exact sum 1 + 6 * 2**-13 rounded once would be 1 + 2**-10."""
    strategy = mirrored_strategy
    per_replica = np.array([[1.0 + 3 * 2.0**-13], [3 * 2.0**-13]], np.float32)
    with strategy.scope():
        w = keras.Variable([0.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0),
                                       all_reduce_dtype="float16")
        opt.build([w])

    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        opt.scale_loss(0.0)
        opt.apply([tf.gather(tf.constant(per_replica), r)], [w])

    tf.function(lambda: strategy.run(replica_fn))()
    assert opt.step_plan.all_reduce == "float16"
    on_the_wire = per_replica.astype(np.float16).astype(np.float64)
    expected = -_wire_sum(on_the_wire)  # float16 values summed: one rounding (two replicas)
    assert expected[0] != -_wire_sum(per_replica)[0]  # the case tells the two apart
    np.testing.assert_array_equal(_the_value(strategy, w), expected.astype(np.float32))


@pytest.mark.parametrize("kwargs", [
    dict(dynamic=False, initial_scale=128.0),
    dict(loss_scale=tfdls.FixedLossScale(128.0)) if hasattr(tfdls, "FixedLossScale") else
    dict(loss_scale=128.0),
    dict(loss_scale={"class_name": "FixedLossScale", "config": {"loss_scale_value": 128.0}}),
])
def test_every_spelling_of_a_fixed_scale_is_refused(kwargs):
    with pytest.raises(ValueError, match="all_reduce_dtype='float16' needs a loss scale"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), all_reduce_dtype="float16", **kwargs)


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
def test_gradient_accumulation_with_an_overflowing_micro_batch(mirrored_strategy):
    """Eagerly (see test_float16_all_reduce): micro-batch sums 2, then a sum that
    overflows float16 (40000 + 40000: skipped, nothing accumulated, scale halved), then 6:
    the window applies the mean of 2 and 6, on both replicas alike."""
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([1.0, 2.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5, gradient_accumulation_steps=2),
                                       tfdls.DynamicLossScale(2.0**10),
                                       all_reduce_dtype="float16")
        opt.build([w])

    def micro(unscaled=None, scaled=None):
        def fn():
            opt.scale_loss(0.0)
            g = scaled if scaled is not None else unscaled * opt.loss_scale()
            opt.apply([tf.fill([2], tf.cast(g, tf.float32))], [w])
        strategy.run(fn)

    micro(unscaled=1.0)
    accumulators = [_the_value(strategy, v) for v in opt.inner_optimizer.variables]
    micro(scaled=40000.0)
    assert float(opt.loss_scale().numpy()) == 2.0**9
    for a, v in zip(accumulators, opt.inner_optimizer.variables):
        np.testing.assert_array_equal(_the_value(strategy, v), a, err_msg=v.name)
    np.testing.assert_array_equal(_the_value(strategy, w), [1.0, 2.0])
    micro(unscaled=3.0)
    np.testing.assert_array_equal(_the_value(strategy, w), np.float32([1.0 - 2.0, 2.0 - 2.0]))


def test_a_checkpoint_of_the_float16_path_restores_into_the_default_path(mirrored_strategy,
                                                                         tmp_path):
    """'Nothing else changes' in checkpoints: a float16-path checkpoint restores into an
    all_reduce_dtype=None optimizer (every value consumed) and vice versa."""
    strategy = mirrored_strategy

    def make(dtype):
        with strategy.scope():
            w = keras.Variable([1.0, 2.0], name="w")
            opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(0.1),
                                           tfdls.DynamicLossScale(2.0**10),
                                           all_reduce_dtype=dtype)
            opt.build([w])

        def replica_fn():
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_sum(tf.square(w)))
            opt.apply(tape.gradient(loss, [w]), [w])
        return w, opt, tf.function(lambda: strategy.run(replica_fn))

    for a, b in [("float16", None), (None, "float16")]:
        w, opt, step = make(a)
        step()
        path = tf.train.Checkpoint(w=w, opt=opt).save(str(tmp_path / f"ckpt_{a}"))
        w2, opt2, step2 = make(b)
        tf.train.Checkpoint(w=w2, opt=opt2).restore(path).assert_consumed()
        np.testing.assert_array_equal(_the_value(strategy, w2), _the_value(strategy, w))
        assert int(opt2.iterations.numpy()) == 1
        step2()
        assert int(opt2.iterations.numpy()) == 2


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_eager_strategy_run_does_not_warn_of_an_unscaled_loss(mirrored_strategy, dtype):
    """scale_loss precedes apply in the replica function; the first eager strategy.run
    still warns UnscaledLossWarning (on both paths: not specific to float16)."""
    import warnings
    strategy = mirrored_strategy
    with strategy.scope():
        w = keras.Variable([0.0, 0.0], name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(4.0),
                                       all_reduce_dtype=dtype)
        opt.build([w])

    def replica_fn():
        opt.scale_loss(0.0)
        opt.apply([tf.constant([4.0, 8.0])], [w])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(replica_fn)
    np.testing.assert_array_equal(_the_value(strategy, w), [-2.0, -4.0])
    assert not [c for c in caught if issubclass(c.category, tfdls.UnscaledLossWarning)]
