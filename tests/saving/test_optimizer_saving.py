"""Saving and restoring tfdls.LossScaleOptimizer: configs, .keras files,
tf.train.Checkpoint and BackupAndRestore."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

EPOCH_BATCHES = 8
BATCH = 16


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EPOCH_BATCHES * BATCH, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) > 0).astype("float32")
    return x, y


X, Y = _data()


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
    ])


def _optimizer():
    # Starts high so the first steps overflow; hysteresis 2 so the budget
    # carries real state; growth every 3 good steps.
    return tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        loss_scale=tfdls.DynamicLossScale(
            initial_loss_scale=2.0**28, increment_period=3, hysteresis=2
        ),
    )


def _compiled(seed=0, optimizer=None):
    model = _model(seed)
    model.compile(optimizer=optimizer or _optimizer(), loss="binary_crossentropy",
                  jit_compile=False)
    return model


def _fit(model, epochs=1, **kwargs):
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def _scale_state(opt):
    ls = opt.loss_scale
    return {
        "scale": float(ls().numpy()),
        "good_steps": int(ls.num_good_steps.numpy()),
        "hysteresis_budget": int(ls.hysteresis_budget.numpy()),
        "skipped": int(ls.num_skipped_steps.numpy()),
        "since_overflow": int(ls.steps_since_overflow.numpy()),
        "iterations": int(opt.iterations.numpy()),
    }


def _numpy(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _assert_same(a, b):
    a, b = _numpy(a), _numpy(b)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x, y, err_msg=f"variable {i}")


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield


# -- configs --------------------------------------------------------------------------


LOSS_SCALES = {
    "dynamic": lambda: tfdls.DynamicLossScale(
        initial_loss_scale=64.0, increment_period=5, multiplier=4.0,
        backoff_factor=0.5, min_loss_scale=2.0, max_loss_scale=2.0**20, hysteresis=3
    ),
    "fixed": lambda: tfdls.FixedLossScale(128.0),
}


@pytest.mark.parametrize("kind", sorted(LOSS_SCALES))
def test_get_config_from_config_round_trip(kind):
    inner = keras.optimizers.SGD(0.03, momentum=0.7, clipnorm=1.5, nesterov=True)
    opt = tfdls.LossScaleOptimizer(inner, loss_scale=LOSS_SCALES[kind](), name="lso")
    config = opt.get_config()
    restored = tfdls.LossScaleOptimizer.from_config(config)
    assert type(restored) is tfdls.LossScaleOptimizer
    assert restored.name == "lso"
    assert type(restored.inner_optimizer) is keras.optimizers.SGD
    assert restored.inner_optimizer.get_config() == inner.get_config()
    assert type(restored.loss_scale) is type(opt.loss_scale)
    assert restored.loss_scale.get_config() == opt.loss_scale.get_config()
    assert restored.loss_scale is not opt.loss_scale
    assert float(restored.loss_scale()) == float(opt.loss_scale())
    assert restored.get_config() == config
    # from_config must not consume the caller's dict.
    assert tfdls.LossScaleOptimizer.from_config(config).get_config() == config


@pytest.mark.parametrize("kind", sorted(LOSS_SCALES))
def test_keras_serialize_deserialize_round_trip(kind):
    inner = keras.optimizers.AdamW(2e-3, weight_decay=0.01, beta_1=0.8)
    opt = tfdls.LossScaleOptimizer(inner, loss_scale=LOSS_SCALES[kind]())
    serialized = keras.optimizers.serialize(opt)
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is tfdls.LossScaleOptimizer
    assert type(restored.inner_optimizer) is keras.optimizers.AdamW
    assert restored.inner_optimizer.get_config() == inner.get_config()
    assert restored.loss_scale.get_config() == opt.loss_scale.get_config()
    assert type(restored.loss_scale) is type(opt.loss_scale)
    # Also through keras.saving (what model.save uses), with a JSON round trip.
    import json

    blob = json.dumps(keras.saving.serialize_keras_object(opt))
    again = keras.saving.deserialize_keras_object(json.loads(blob))
    assert type(again) is tfdls.LossScaleOptimizer
    assert again.loss_scale.get_config() == opt.loss_scale.get_config()
    assert again.inner_optimizer.get_config() == inner.get_config()


def test_keras_style_config_round_trip():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=256.0,
                                   dynamic_growth_steps=9)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert restored.initial_scale == 256.0
    assert restored.dynamic_growth_steps == 9
    assert restored.dynamic is True


# -- model.save / load_model ---------------------------------------------------------


@pytest.mark.slow
def test_model_save_and_load_resumes_exactly(tmp_path):
    model = _compiled()
    _fit(model, epochs=2)
    opt = model.optimizer
    state = _scale_state(opt)
    # The saved state is not trivial: overflows happened, and the scale moved.
    assert state["skipped"] > 0
    assert state["iterations"] > 0
    assert state["scale"] != 2.0**28
    path = tmp_path / "m.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert type(lopt) is tfdls.LossScaleOptimizer
    assert type(lopt.inner_optimizer) is keras.optimizers.Adam
    assert lopt.loss_scale.get_config() == opt.loss_scale.get_config()
    assert _scale_state(lopt) == state
    _assert_same(loaded.weights, model.weights)
    _assert_same(lopt.inner_optimizer.variables, opt.inner_optimizer.variables)
    _assert_same(lopt.loss_scale.variables, opt.loss_scale.variables)

    _fit(model, epochs=1)
    _fit(loaded, epochs=1)
    _assert_same(loaded.weights, model.weights)
    assert _scale_state(lopt) == _scale_state(opt)
    _assert_same(lopt.inner_optimizer.variables, opt.inner_optimizer.variables)


@pytest.mark.slow
def test_model_save_keeps_mid_hysteresis_state(tmp_path):
    """A hysteresis budget of 1 (one overflow since the last growth) survives."""
    model = _compiled()
    opt = model.optimizer
    opt.build(model.trainable_variables)
    ls = opt.loss_scale
    ls.current_loss_scale.assign(1024.0)
    ls.num_good_steps.assign(2)
    ls.hysteresis_budget.assign(1)
    ls.num_skipped_steps_variable.assign(5)
    ls.steps_since_overflow_variable.assign(7)
    path = tmp_path / "m.keras"
    model.save(path)
    lopt = keras.models.load_model(path).optimizer
    assert _scale_state(lopt) == _scale_state(opt)
    assert _scale_state(lopt)["hysteresis_budget"] == 1


# -- tf.train.Checkpoint ------------------------------------------------------------


def _checkpoint_roundtrip(tmp_path, build_before_restore):
    model = _compiled()
    _fit(model, epochs=2)
    opt = model.optimizer
    state = _scale_state(opt)
    assert state["skipped"] > 0
    path = tf.train.Checkpoint(optimizer=opt, model=model).save(str(tmp_path / "ckpt"))

    fresh = _compiled(seed=5)  # different initial weights
    fopt = fresh.optimizer
    if build_before_restore:
        fopt.build(fresh.trainable_variables)
    status = tf.train.Checkpoint(optimizer=fopt, model=fresh).restore(path)
    if build_before_restore:
        status.assert_existing_objects_matched()
        assert _scale_state(fopt) == state
        _assert_same(fopt.inner_optimizer.variables, opt.inner_optimizer.variables)
    # The loss scale's variables exist from construction: restored at once.
    assert float(fopt.loss_scale().numpy()) == state["scale"]
    assert int(fopt.loss_scale.num_good_steps.numpy()) == state["good_steps"]
    assert int(fopt.loss_scale.hysteresis_budget.numpy()) == state["hysteresis_budget"]
    _assert_same(fresh.weights, model.weights)

    _fit(model, epochs=1)
    _fit(fresh, epochs=1)
    assert _scale_state(fopt) == _scale_state(opt)
    _assert_same(fresh.weights, model.weights)
    _assert_same(fopt.inner_optimizer.variables, opt.inner_optimizer.variables)


@pytest.mark.slow
def test_tf_checkpoint_restore_into_built_optimizer(tmp_path):
    _checkpoint_roundtrip(tmp_path, build_before_restore=True)


@pytest.mark.slow
def test_tf_checkpoint_deferred_restore(tmp_path):
    _checkpoint_roundtrip(tmp_path, build_before_restore=False)


# -- BackupAndRestore ---------------------------------------------------------------


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_epoch):
        super().__init__()
        self.at_epoch = at_epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at_epoch:
            raise RuntimeError("simulated preemption")


@pytest.mark.slow
def test_backup_and_restore_resumes_loss_scale(tmp_path):
    backup_dir = str(tmp_path / "backup")
    epochs = 4

    reference = _compiled()
    _fit(reference, epochs=epochs)
    ref_state = _scale_state(reference.optimizer)
    assert ref_state["skipped"] > 0

    interrupted = _compiled()
    with pytest.raises(RuntimeError, match="simulated preemption"):
        _fit(interrupted, epochs=epochs,
             callbacks=[keras.callbacks.BackupAndRestore(backup_dir), _Interrupt(2)])
    assert _scale_state(interrupted.optimizer)["iterations"] < ref_state["iterations"]

    resumed = _compiled()
    history = _fit(resumed, epochs=epochs,
                   callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])
    assert len(history.epoch) == epochs - 2  # it really resumed at epoch 2
    assert _scale_state(resumed.optimizer) == ref_state
    _assert_same(resumed.weights, reference.weights)
    _assert_same(resumed.optimizer.inner_optimizer.variables,
                 reference.optimizer.inner_optimizer.variables)
