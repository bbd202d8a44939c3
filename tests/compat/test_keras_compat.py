"""tfdls.LossScaleOptimizer as a drop-in keras.optimizers.LossScaleOptimizer:
the attributes and inherited methods Keras 3 code uses work on tfdls' state
or raise a clear error; and a custom LossScale gets what its docstring says."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

NAN = float("nan")


def _built(loss_scale="dynamic"):
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), loss_scale)
    opt.build([w])
    return w, opt


def test_dynamic_scale_and_step_counter_follow_the_dynamic_loss_scale():
    w, opt = _built(tfdls.DynamicLossScale(8.0, increment_period=2))
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    # What Keras 3 code logs:
    assert float(opt.dynamic_scale) == 8.0 and int(opt.step_counter) == 0
    opt.apply([tf.ones(2) * 8.0], [w])
    assert float(opt.dynamic_scale) == 8.0 and int(opt.step_counter) == 1
    opt.apply([tf.ones(2) * 8.0], [w])
    assert float(opt.dynamic_scale) == 16.0 and int(opt.step_counter) == 0
    opt.apply([tf.fill([2], NAN)], [w])
    assert float(opt.dynamic_scale) == 8.0 and int(opt.step_counter) == 0
    assert opt.dynamic_scale is opt.loss_scale.current_loss_scale
    assert opt.initial_scale == 8.0 and opt.dynamic_growth_steps == 2


def test_fixed_scale_attributes():
    _, opt = _built(128.0)
    assert float(opt.dynamic_scale) == 128.0
    assert int(opt.step_counter) == 0
    assert opt.initial_scale == 128.0 and opt.dynamic_growth_steps is None


def test_keras_learning_rate_and_iterations_pass_through():
    w, opt = _built()
    assert float(opt.learning_rate) == 0.5
    opt.learning_rate = 0.25
    assert float(opt.inner_optimizer.learning_rate) == 0.25
    opt.apply([tf.ones(2) * opt.loss_scale()], [w])
    assert int(opt.iterations) == 1 and opt.iterations is opt.inner_optimizer.iterations


def test_check_finite_is_all_finite():
    _, opt = _built()
    assert bool(opt.check_finite([tf.ones(2), None])) is True
    assert bool(opt.check_finite([tf.constant([1.0, NAN])])) is False
    assert bool(opt.check_finite([tf.constant([3e38, 3e38])])) is True


@pytest.mark.parametrize("method", ["_common_apply", "_tf_apply"])
def test_keras_internal_apply_entry_points_run_tfdls_apply(method):
    w, opt = _built(tfdls.DynamicLossScale(4.0))
    getattr(opt, method)([tf.ones(2) * 4.0], [w])
    np.testing.assert_array_equal(w.numpy(), [-0.5, -0.5])
    getattr(opt, method)([tf.fill([2], NAN)], [w])
    np.testing.assert_array_equal(w.numpy(), [-0.5, -0.5])
    assert float(opt.loss_scale()) == 2.0


def test_stateless_apply_is_a_clear_error():
    w, opt = _built()
    with pytest.raises(ValueError, match="stateless_apply is not supported.*use apply"):
        opt.stateless_apply(opt.variables, [tf.ones(2)], [w])


@pytest.mark.parametrize(
    "method",
    [
        "_stateful_handle_finite_grads",
        "_stateful_handle_non_finite_grads",
        "_stateless_handle_finite_grads",
        "_stateless_handle_non_finite_grads",
    ],
)
def test_keras_step_helpers_that_would_use_keras_state_raise(method):
    _, opt = _built()
    with pytest.raises(NotImplementedError, match="call apply"):
        getattr(opt, method)([tf.ones(2)], None)


# -- a custom LossScale ---------------------------------------------------------------


class RecordingLossScale(tfdls.LossScale):
    """A fixed-value scale that records the gradients update() receives."""

    def __init__(self, value=64.0, agree=True):
        super().__init__()
        self.value = value
        self.agree = agree
        self.received = []

    def __call__(self):
        return tf.constant(self.value)

    def update(self, grads):
        self.received.append(grads)
        ok = tfdls.all_finite(grads, across_replicas=self.agree)
        return tf.no_op(), ok

    def get_config(self):
        return {"value": self.value}


def test_custom_loss_scale_update_receives_unscaled_gradients():
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    ls = RecordingLossScale(64.0)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), ls)
    opt.apply([tf.constant([64.0, -128.0])], [w])
    (grads,) = ls.received
    np.testing.assert_array_equal(grads[0].numpy(), [1.0, -2.0])
    np.testing.assert_array_equal(w.numpy(), [-1.0, 2.0])
    opt.apply([tf.constant([NAN, 1.0])], [w])  # the scale's decision skips
    np.testing.assert_array_equal(w.numpy(), [-1.0, 2.0])


def test_the_docstring_example_of_a_custom_scale_halves_on_overflow():
    class HalvingLossScale(tfdls.LossScale):
        def __init__(self, value=2.0**15):
            super().__init__()
            self.value = tf.Variable(value, trainable=False)

        def __call__(self):
            return tf.convert_to_tensor(self.value)

        def update(self, grads):
            ok = tfdls.all_finite(grads, across_replicas=True)
            op = self.value.assign(tf.where(ok, self.value, self.value / 2))
            return op, ok

        def get_config(self):
            return {"value": float(self.value.numpy())}

    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), HalvingLossScale(8.0))
    step = tf.function(lambda g: opt.apply([g], [w]))
    step(tf.constant([8.0, 8.0]))
    step(tf.constant([NAN, 8.0]))
    np.testing.assert_array_equal(w.numpy(), [-1.0, -1.0])
    assert float(opt.loss_scale()) == 4.0


@pytest.mark.parametrize("agree", [True, False], ids=["agreeing", "local"])
def test_custom_scale_decisions_are_the_same_on_every_replica(mirrored_strategy, agree):
    """A custom scale that checks only its own replica still skips everywhere."""
    with mirrored_strategy.scope():
        w = keras.Variable(np.zeros(2, "float32"), name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), RecordingLossScale(2.0, agree))
        opt.build([w])

    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.where(tf.equal(replica, 1), tf.constant([NAN, 2.0]), tf.constant([2.0, 2.0]))
        opt.apply([grad], [w])

    tf.function(lambda: mirrored_strategy.run(replica_step))()
    for copy in mirrored_strategy.experimental_local_results(w.value):
        np.testing.assert_array_equal(copy.numpy(), [0.0, 0.0])


class VetoingLossScale(tfdls.DynamicLossScale):
    """TF 2.4 style: a DynamicLossScale subclass adding its own skip condition."""

    def __init__(self, *args, limit=2.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit = limit
        self.calls = 0

    def update(self, grads):
        self.calls += 1
        op, ok = super().update(grads)
        small = tf.reduce_max(tf.abs(tfdls.finite.gradient_values(grads)[0])) < self.limit
        return op, tf.logical_and(ok, small)


@pytest.mark.parametrize("mode", slow_except(["eager", "function", "xla"], ["function"]))
def test_a_dynamic_loss_scale_subclass_update_is_honoured(mode):
    w = keras.Variable(np.zeros(3, "float32"), name="w")
    ls = VetoingLossScale(1024.0, increment_period=10**6)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), ls)
    step = lambda g: opt.apply([g], [w])  # noqa: E731
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    step(tf.constant([1024.0, 2048.0, -1024.0]))  # unscaled max 2 < 2.5: applied
    np.testing.assert_array_equal(w.numpy(), [-1.0, -2.0, 1.0])
    step(tf.constant([1024.0, 2048.0, -3072.0]))  # finite, but the subclass vetoes
    np.testing.assert_array_equal(w.numpy(), [-1.0, -2.0, 1.0])
    assert int(opt.iterations.numpy()) == 1
    assert ls.calls >= 1  # traced once, or called twice eagerly
    # Its own (super) update saw finite gradients both times: nothing skipped there.
    assert int(ls.num_skipped_steps.numpy()) == 0
    assert opt.last_overflow().step == 1  # the vetoed step is recorded as skipped


# -- Keras 3 LossScaleOptimizer configs and .keras files ---------------------------------

KERAS_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _keras_config(**extra):
    keras_opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.25, momentum=0.5), initial_scale=512.0,
        dynamic_growth_steps=7, name="lso",
    )
    return {**keras_opt.get_config(), **extra}


@pytest.mark.parametrize("older", [False, True], ids=["keras3.15", "with-base-keys"])
def test_from_config_of_a_keras_config_builds_the_equivalent(older):
    # Keras up to 3.3 also wrote the wrapper's base-optimizer keys (at their
    # defaults; some versions its unused learning rate of 0).
    extra = {**KERAS_BASE_DEFAULTS, "learning_rate": 0.0} if older else {}
    opt = tfdls.LossScaleOptimizer.from_config(_keras_config(**extra))
    assert type(opt) is tfdls.LossScaleOptimizer and opt.name == "lso"
    ls = opt.loss_scale
    assert type(ls) is tfdls.DynamicLossScale
    assert (ls.initial_loss_scale, ls.increment_period) == (512.0, 7)
    assert tfdls.serialize(ls) == tfdls.serialize(tfdls.DynamicLossScale(512.0, 7))
    inner = opt.inner_optimizer
    assert type(inner) is keras.optimizers.SGD
    assert float(inner.learning_rate) == 0.25 and inner.momentum == 0.5


@pytest.mark.parametrize(
    "key, value",
    [("clipnorm", 1.0), ("use_ema", True), ("ema_momentum", 0.5), ("learning_rate", 0.1),
     ("weight_decay", 0.0)],
)
def test_from_config_refuses_a_base_key_that_is_set(key, value):
    with pytest.raises(ValueError, match=rf"{key}={value!r}.*`inner_optimizer`"):
        tfdls.LossScaleOptimizer.from_config(_keras_config(**{key: value}))


def test_base_keywords_at_their_defaults_are_accepted_as_keras_accepts_them():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), **KERAS_BASE_DEFAULTS)
    assert type(opt.loss_scale) is tfdls.DynamicLossScale


def _fit_with_overflow(model, steps):
    """Fits batch by batch; one batch's targets are inf, so that step overflows."""
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)
    for step in range(steps):
        y = np.full((4, 2), np.inf if step == 2 else 0.5, "float32")
        model.train_on_batch(x, y)


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_a_keras_file_saved_with_keras_class_loads_into_tfdls(tmp_path):
    path = str(tmp_path / "keras_lso.keras")
    model = _model()
    keras_opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=64.0, dynamic_growth_steps=4
    )
    model.compile(optimizer=keras_opt, loss="mse", jit_compile=False)
    _fit_with_overflow(model, 6)  # 2 good steps, an overflow (64 -> 32), 3 good steps
    want = (float(keras_opt.dynamic_scale.numpy()), int(keras_opt.step_counter.numpy()))
    assert want == (32.0, 3)
    model.save(path)

    # Keras resolves its own classes by module, so custom_objects cannot swap
    # tfdls' class in for Keras' when loading (README, "Migrating"): this
    # pins that the recipe below is still what it takes.
    loaded = keras.saving.load_model(
        path, custom_objects={"LossScaleOptimizer": tfdls.LossScaleOptimizer}
    )
    assert type(loaded.optimizer) is keras.optimizers.LossScaleOptimizer

    # The recipe: the tfdls optimizer from the file's config, then its state.
    opt = tfdls.LossScaleOptimizer.from_config(loaded.optimizer.get_config())
    loaded.compile(optimizer=opt, loss="mse", jit_compile=False)
    opt.build(loaded.trainable_variables)
    loaded.load_weights(path)
    assert (float(opt.loss_scale().numpy()), int(opt.loss_scale.num_good_steps.numpy())) == want
    assert int(opt.iterations.numpy()) == int(keras_opt.iterations.numpy()) == 5
    for mine, theirs in zip(opt.inner_optimizer.variables, keras_opt.inner_optimizer.variables):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    for mine, theirs in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())

    # From there both go on alike: the 4th good step grows the scale in both.
    x = np.zeros((4, 3), "float32")
    y = np.full((4, 2), 0.5, "float32")
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    assert float(opt.loss_scale().numpy()) == float(keras_opt.dynamic_scale.numpy()) == 64.0
    for mine, theirs in zip(loaded.weights, model.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6)


def test_a_keras_scale_outside_tfdls_bounds_loads_at_the_nearest_bound(tmp_path):
    path = str(tmp_path / "keras_lso.keras")
    model = _model()
    keras_opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=0.5)
    model.compile(optimizer=keras_opt, loss="mse")
    keras_opt.build(model.trainable_variables)
    model.save(path)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), tfdls.DynamicLossScale(8.0))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    model.load_weights(path)
    assert float(opt.loss_scale().numpy()) == 1.0  # min_loss_scale; Keras had 0.5
