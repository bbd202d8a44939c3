"""Resuming from `.keras`, `tf.train.Checkpoint` and SavedModel is bit-identical
to an uninterrupted run, for every optimizer class `keras.optimizers` exports.

Every variable the inner optimizer creates is tracked (also those Keras
optimizers create without `add_variable`, such as Nadam's `_u_product` and
Adafactor's placeholders, and the sub-optimizers' variables of a
MultiOptimizer, which Keras does not track), so all three formats carry the
whole state.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except
from tests.support.keras_optimizers import EXPORTED, make_optimizer

RNG = np.random.default_rng(3)
X = RNG.normal(size=(8, 3)).astype("float32")
Y = RNG.normal(size=(8, 2)).astype("float32")
BEFORE, AFTER = 3, 3  # steps before saving, and after
FORMATS = ["keras", "checkpoint", "saved_model"]


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4, activation="tanh", name="d1"),
        keras.layers.Dense(2, name="d2"),
    ])


def _optimizer(name, model):
    # MultiOptimizer maps variables by path; a model loaded from `.keras` names
    # its variables without the model's prefix (Keras), so match by pattern.
    inner = make_optimizer(name, ".*d1/kernel", learning_rate=0.01)
    return tfdls.LossScaleOptimizer(
        inner, tfdls.DynamicLossScale(2.0**10, increment_period=2)
    )


class Trainer(tf.Module):
    """A model, its optimizer and a traced training step (exportable)."""

    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.weights = list(model.trainable_variables)
        optimizer.build(self.weights)

    @tf.function(input_signature=[tf.TensorSpec([8, 3]), tf.TensorSpec([8, 2])])
    def step(self, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.model(x) - y))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.weights)
        self.optimizer.apply(grads, self.weights)
        return loss


def _run(trainer, steps, offset):
    for i in range(steps):
        trainer.step(tf.constant(X + 0.1 * (i + offset)), tf.constant(Y))


def _bits(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)).tobytes() for v in variables]


def _resumed(fmt, name, trainer, tmp_path):
    """The trainer's state saved in `fmt` and loaded into a fresh one."""
    if fmt == "keras":
        trainer.model.compile(optimizer=trainer.optimizer, loss="mse")
        trainer.model.save(tmp_path / "m.keras")
        model = keras.models.load_model(tmp_path / "m.keras")
        return Trainer(model, model.optimizer)
    if fmt == "checkpoint":
        path = tf.train.Checkpoint(trainer=trainer).save(str(tmp_path / "ckpt"))
        fresh = _model(seed=9)
        fresh_trainer = Trainer(fresh, _optimizer(name, fresh))
        tf.train.Checkpoint(trainer=fresh_trainer).restore(path).assert_consumed()
        return fresh_trainer
    tf.saved_model.save(trainer, str(tmp_path / "sm"))
    return tf.saved_model.load(str(tmp_path / "sm"))


@pytest.mark.parametrize(
    "name, fmt",
    slow_except(
        [(n, f) for n in EXPORTED for f in FORMATS],
        [("Nadam", "keras"), ("Adafactor", "checkpoint"), ("Adam", "saved_model")],
    ),
)
def test_resume_is_bit_identical_to_an_uninterrupted_run(name, fmt, tmp_path):
    model = _model()
    trainer = Trainer(model, _optimizer(name, model))
    _run(trainer, BEFORE, offset=0)
    resumed = _resumed(fmt, name, trainer, tmp_path)
    _run(trainer, AFTER, offset=BEFORE)
    _run(resumed, AFTER, offset=BEFORE)

    assert _bits(resumed.weights) == _bits(trainer.weights)
    if fmt != "saved_model":  # a loaded SavedModel has no Python optimizer object
        opt, resumed_opt = trainer.optimizer, resumed.optimizer
        assert len(resumed_opt.variables) == len(opt.variables)
        assert _bits(resumed_opt.variables) == _bits(opt.variables)
        assert int(resumed_opt.iterations.numpy()) == BEFORE + AFTER


def test_every_inner_variable_is_among_the_optimizers_variables():
    """Nadam keeps `_u_product`, Adafactor placeholder variables, outside add_variable."""
    for name in ("Nadam", "Adafactor"):
        model = _model()
        opt = _optimizer(name, model)
        opt.build(model.trainable_variables)
        bare = make_optimizer(name, ".*d1/kernel", learning_rate=0.01)
        bare.build(model.trainable_variables)
        assert len(opt.inner_optimizer.variables) == len(bare.variables)
        inner_ids = {id(v) for v in opt.inner_optimizer.variables}
        assert inner_ids <= {id(v) for v in opt.variables}
