"""The branch-free (masked) skip used inside XLA steps: a skipped step must
leave every variable bit-identical, including -0.0, and the eligibility rule
must send everything that writes variables directly back to the tf.cond."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tfdls import _masked_update


def _bits(values):
    return [np.asarray(v).tobytes() for v in values]


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.RMSprop(1e-2),
        lambda: keras.optimizers.Adagrad(1e-2),
    ],
    ids=["adam", "sgd_momentum", "rmsprop", "adagrad"],
)
def test_xla_skip_is_bit_identical(make_inner):
    init = np.array([[-0.0, 1.5], [0.0, -2.25]], "float32")
    w = keras.Variable(init, name="w")
    b = keras.Variable(np.array([-0.0, 3.0], "float32"), name="b")
    opt = tfdls.LossScaleOptimizer(make_inner(), loss_scale=tfdls.DynamicLossScale(2.0**4))
    assert _masked_update.eligible(opt.inner_optimizer, [tf.ones(2)], [w, b])

    @tf.function(jit_compile=True)
    def step(gw, gb):
        opt.apply([gw, gb], [w, b])

    step(tf.ones((2, 2)) * 16.0, tf.ones(2) * 16.0)  # a finite step first
    state = [w.numpy(), b.numpy()] + [v.numpy() for v in opt.inner_optimizer.variables]
    iterations = int(opt.iterations.numpy())
    # Plant -0.0 in the variables so that "var + 0" would be caught.
    w.assign(tf.constant([[-0.0, 1.0], [2.0, -0.0]]))
    state[0] = w.numpy()

    step(tf.constant([[1.0, np.nan], [1.0, 1.0]]), tf.ones(2))
    after = [w.numpy(), b.numpy()] + [v.numpy() for v in opt.inner_optimizer.variables]
    assert _bits(after) == _bits(state)
    assert int(opt.iterations.numpy()) == iterations
    assert float(opt.loss_scale()) == 8.0

    step(tf.ones((2, 2)), tf.ones(2))  # and it applies again
    assert int(opt.iterations.numpy()) == iterations + 1
    assert not np.array_equal(b.numpy(), state[1])


def test_masked_finite_step_equals_cond_step():
    """Inside and outside XLA the same finite step gives the same numbers."""
    results = []
    for jit in (True, False):
        w = keras.Variable(np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3), name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        step = tf.function(lambda g: opt.apply([g], [w]), jit_compile=jit)
        for i in range(3):
            step(tf.fill([2, 3], 2.0**15 * (i + 1) * 0.1))
        results.append(w.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


def test_eligibility_excludes_direct_writers():
    w = keras.Variable(np.ones(2, "float32"), name="w")
    g = [tf.ones(2)]
    assert _masked_update.eligible(keras.optimizers.Adam(), g, [w])
    assert not _masked_update.eligible(keras.optimizers.AdamW(weight_decay=0.1), g, [w])
    assert not _masked_update.eligible(keras.optimizers.Adam(use_ema=True), g, [w])
    assert not _masked_update.eligible(
        keras.optimizers.Adam(gradient_accumulation_steps=2), g, [w]
    )
    sparse = [tf.IndexedSlices(tf.ones([1]), tf.constant([0]), tf.constant([2]))]
    assert not _masked_update.eligible(keras.optimizers.Adam(), sparse, [w])
    constrained = keras.Variable(np.ones(2, "float32"))
    constrained.constraint = keras.constraints.NonNeg()  # as Layer.add_weight does
    assert not _masked_update.eligible(keras.optimizers.Adam(), g, [constrained])

    class Custom(keras.optimizers.SGD):
        pass

    assert not _masked_update.eligible(Custom(), g, [w])
