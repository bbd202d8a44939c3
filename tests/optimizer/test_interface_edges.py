"""Edges of the optimizer's interface an outside review of the step refactor found:
custom scales that borrow DynamicLossScale's names, the order of argument checks, and
scale boundaries on a model that does not hold every variable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tfdls.boundaries import registry as boundaries_lib

NAN = float("nan")


class BorrowedNamesScale(tfdls.LossScale):
    """A custom scale that calls itself dynamic and counts skips under Dynamic's names."""

    dynamic = True  # a class attribute, as Keras' scale has it

    def __init__(self):
        super().__init__()
        self.value = tf.Variable(8.0, trainable=False)
        self.skips = tf.Variable(0, dtype=tf.int64, trainable=False)

    def __call__(self):
        return tf.convert_to_tensor(self.value)

    @property
    def num_skipped_steps(self):
        return tf.convert_to_tensor(self.skips)

    def update(self, grads):
        ok = tfdls.all_finite(grads, across_replicas=True)
        self.skips.assign_add(tf.cast(tf.logical_not(ok), tf.int64))
        return None, ok

    def get_config(self):
        return {}


def test_a_custom_scale_with_borrowed_names_is_driven_as_a_custom_scale():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), BorrowedNamesScale())
    w = keras.Variable([1.0], name="w")
    opt.apply([tf.constant([NAN])], [w])
    opt.apply([tf.constant([NAN])], [w])
    assert not opt.dynamic  # it is not a DynamicLossScale
    report = opt.last_overflow()  # no AttributeError for Dynamic-only names
    assert report.num_skipped_steps == 2 and "2 steps skipped" in str(report)
    opt.check_min_scale_policy()
    opt.finalize_variable_values([w])
    assert opt.initial_scale is None and opt.dynamic_growth_steps is None
    tf.function(lambda g: opt.apply([g], [w]))(tf.constant([8.0]))
    assert not opt.step_plan.compile  # 'auto' compiles only for a DynamicLossScale
    np.testing.assert_array_equal(w.numpy(), [0.0])


def test_the_inner_optimizer_is_checked_before_the_scale():
    with pytest.raises(TypeError, match="inner_optimizer"):
        tfdls.LossScaleOptimizer("sgd", loss_scale=-1.0)


def _plain_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def _model():
    return tfdls.add_scale_boundaries(_plain_model())


@pytest.mark.parametrize("order", ["outside_last", "outside_first"])
def test_a_variable_outside_the_boundaries_model_keeps_being_refused(order):
    model = _model()
    outside = keras.Variable([1.0], name="outside")
    variables = list(model.trainable_variables)
    variables = variables + [outside] if order == "outside_last" else [outside] + variables
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), scale_boundaries=model)
    grads = [tf.ones_like(v) for v in variables]
    for _ in range(2):  # the same error again: nothing half-built was kept
        with pytest.raises(ValueError, match="'outside' is not in the model"):
            opt.apply(grads, variables)


def test_set_scale_boundaries_after_build_keeps_nothing_when_it_fails():
    """Nothing kept, the boundaries' ownership included: owned, they would multiply every
    gradient that crosses them by 2**3 with no optimizer to divide it out."""
    model = tfdls.add_scale_boundaries(_plain_model(), initial_log2_factor=3)
    outside = keras.Variable([1.0], name="outside")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    opt.build(list(model.trainable_variables) + [outside])
    with pytest.raises(ValueError, match="'outside' is not in the model"):
        opt.set_scale_boundaries(model)
    assert opt._boundary_scales is None
    assert not any(boundaries_lib.owned_boundaries_above(v) for v in model.trainable_variables)
    x = tf.constant([[1.0, 2.0]])
    plain = _plain_model()
    for variable, value in zip(plain.trainable_variables, model.trainable_variables):
        variable.assign(value)
    gradients = []
    for m in (model, plain):
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(m(x))
        gradients.append(tape.gradient(out, m.trainable_variables))
    for got, want in zip(*gradients):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def _checkpoint_keys(optimizer, tmp_path, name):
    path = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / name))
    return {key for key, _ in tf.train.list_variables(path)}


def test_an_unbuilt_optimizer_checkpoints_the_same_objects_with_boundaries(tmp_path):
    plain = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with_boundaries = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                               scale_boundaries=_model())
    assert (_checkpoint_keys(plain, tmp_path, "plain")
            == _checkpoint_keys(with_boundaries, tmp_path, "boundaries"))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gradients_given_as_python_lists_are_one_tensor_each_as_keras_takes_them(mode):
    """A list gradient is one gradient in its variable's dtype, not a nest of scalars
    (that failed with a shape mismatch in the overflow mask); the step equals bare SGD's."""
    v, bare_v = keras.Variable([1.0, -1.0]), keras.Variable([1.0, -1.0])
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                   tfdls.DynamicLossScale(2.0**3, increment_period=1000))
    bare = keras.optimizers.SGD(0.5)
    step = lambda: opt.apply([[2.0**3, 3 * 2.0**3]], [v])  # noqa: E731
    (tf.function(step) if mode == "graph" else step)()
    bare.apply([[1.0, 3.0]], [bare_v])
    np.testing.assert_array_equal(v.numpy(), bare_v.numpy())
    np.testing.assert_array_equal(v.numpy(), [0.5, -2.5])
