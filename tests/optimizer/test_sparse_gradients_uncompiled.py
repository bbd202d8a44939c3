"""jit_compile="auto" on a CPU does not count tf.IndexedSlices gradients toward
`tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS` (written by an outside review of that rule).

An Embedding + Dense model whose table alone is over the threshold takes the
uncompiled cond; finite steps must equal the bare Keras optimizer's graph-mode
step bit for bit, skipped steps must leave weights, slots and iterations
bit-identical."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdls
from tfdls import _plan

ROWS, DIM = _plan.AUTO_COMPILE_MIN_ELEMENTS // 32 + 7, 32  # table alone over 2**18


def _model(seed=0, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(ROWS, DIM, name="emb", dtype=dtype),
        keras.layers.Flatten(),
        keras.layers.Dense(4, activation="tanh", name="d0", dtype=dtype),
        keras.layers.Dense(1, name="d1", dtype=dtype),
    ])


def _bits(variables):
    return [np.asarray(v.numpy()).tobytes() for v in variables]


INNERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(1e-1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2),
}


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_embedding_model_cond_step_equals_bare_and_skips_exactly(inner):
    model, bare_model = _model(), _model()
    variables, bare_vars = model.trainable_variables, bare_model.trainable_variables
    opt = tfdls.LossScaleOptimizer(INNERS[inner](),
                                   tfdls.DynamicLossScale(2.0**6, increment_period=1000))
    bare = INNERS[inner]()
    # repeated ids (3 and 11 twice in a row and across rows)
    x = tf.constant([[3, 3, 11, 0, ROWS - 1], [11, 3, 7, 7, 7]], tf.int32)
    y = tf.constant([[0.5], [-1.0]])

    @tf.function
    def step(poison):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        grads = [grads[0]] + [g * poison for g in grads[1:]]
        opt.apply(grads, variables)

    @tf.function
    def bare_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((bare_model(x) - y) ** 2)
        bare.apply(tape.gradient(loss, bare_vars), bare_vars)

    for _ in range(3):
        step(tf.constant(1.0))
        bare_step()
        assert (opt.step_plan.skip, opt.step_plan.compile) == ("cond", False), opt.step_plan
        assert "sparse gradients do not count" in opt.step_plan.reason
        assert _bits(variables) == _bits(bare_vars)
        assert _bits(opt.inner_optimizer.variables) == _bits(bare.variables)
    before = _bits(variables + list(opt.inner_optimizer.variables))
    iterations = int(opt.iterations.numpy())
    step(tf.constant(float("inf")))
    assert _bits(variables + list(opt.inner_optimizer.variables)) == before
    assert int(opt.iterations.numpy()) == iterations
    assert float(opt.loss_scale()) == 2.0**5
    # and it goes on equal to bare after the skip
    step(tf.constant(1.0))
    bare_step()
    assert _bits(variables) == _bits(bare_vars)


@pytest.mark.parametrize("inner", ["adam", "sgd_momentum", "adagrad"])
def test_fit_mixed_float16_cond_equals_masked_uncompiled(inner):
    """Under model.fit (jit_compile=False) with mixed_float16: the auto plan (a cond,
    the table not counted) against jit_compile=False (masked, uncompiled): both exact,
    so bit-identical weights and slots, including an overflowing batch."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    results = []
    plans = []
    for jit in ("auto", False):
        model = _model(seed=1)
        opt = tfdls.LossScaleOptimizer(INNERS[inner](), tfdls.DynamicLossScale(
            2.0**10, increment_period=1000), jit_compile=jit)
        model.compile(opt, loss="mse", jit_compile=False)
        rng = np.random.default_rng(0)
        x = rng.integers(0, ROWS, size=(16, 5)).astype(np.int32)
        x[:, 1] = x[:, 0]  # repeated ids
        y = rng.normal(size=(16, 1)).astype(np.float32)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        # a batch whose loss overflows float16 after scaling: skipped
        scale = float(opt.loss_scale())
        big = np.full((8, 1), 6e4, np.float32)
        model.fit(x[:8], big, batch_size=8, epochs=1, shuffle=False, verbose=0)
        plans.append((opt.step_plan.skip, opt.step_plan.compile))
        results.append((_bits(model.trainable_variables), _bits(opt.inner_optimizer.variables),
                        int(opt.iterations.numpy()), float(opt.loss_scale()), scale))
    assert plans[0] == ("cond", False), plans
    assert plans[1] == ("masked", False), plans
    assert results[0] == results[1]
    assert results[0][3] == results[0][4] / 2, results[0][3:]  # the big batch skipped
