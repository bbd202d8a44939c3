"""Which gradients the optimizer checks: the scaled ones while the scale
cannot fall below 1 (unscaling cannot overflow then), the unscaled ones when
it can (a scale below 1 multiplies gradients up)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except


@pytest.mark.parametrize("jit", slow_except([False, True], [True]))
def test_unscaling_overflow_below_one_is_skipped(jit):
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**-8, min_loss_scale=2.0**-20),
    )
    step = tf.function(lambda g: opt.apply([g], [w]), jit_compile=jit)
    # Finite as scaled; times 2**8 it overflows float32.
    step(tf.constant([3e37, 1.0]))
    np.testing.assert_array_equal(w.numpy(), np.zeros(2, "float32"))
    assert int(opt.loss_scale.num_skipped_steps) == 1
    assert float(opt.loss_scale()) == 2.0**-9  # the skip halved it
    step(tf.constant([2.0**-8, 1.0]))
    np.testing.assert_array_equal(w.numpy(), np.array([-2.0, -512.0], "float32"))


@pytest.mark.parametrize("jit", slow_except([False, True], [False]))
def test_huge_finite_gradients_are_applied(jit):
    """Sums of these overflow float32; the exact re-check must still pass them."""
    w = keras.Variable(np.zeros(4, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-20), loss_scale=tfdls.DynamicLossScale(1.0))
    step = tf.function(lambda g: opt.apply([g], [w]), jit_compile=jit)
    big = np.float32(3e38)
    step(tf.constant([big, big, big, big]))
    assert int(opt.loss_scale.num_skipped_steps) == 0
    assert np.all(np.isfinite(w.numpy())) and np.all(w.numpy() < 0)
