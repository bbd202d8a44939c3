"""Tests for tfdls.LossScaleOptimizer: API, custom training loops, skipping."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

NAN = float("nan")
INF = float("inf")


# -- helpers -------------------------------------------------------------------


def _data(seed=0, n=32, d=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w_true = rng.normal(size=(d, 1)).astype("float32")
    y = (x @ w_true + 0.25).astype("float32")
    return tf.constant(x), tf.constant(y)


X, Y = _data()


def _make_vars(dtype="float32", seed=1):
    rng = np.random.default_rng(seed)
    w = keras.Variable(rng.normal(size=(3, 1)).astype("float32") * 0.1, dtype=dtype, name="w")
    b = keras.Variable(np.zeros((1,), "float32"), dtype=dtype, name="b")
    return [w, b]


def _loss(variables, scale=1.0):
    """A scalar float32 loss of the two variables (w, b)."""
    w, b = variables[0], variables[1]
    w = tf.cast(tf.convert_to_tensor(w), tf.float32)
    b = tf.cast(tf.convert_to_tensor(b), tf.float32)
    pred = tf.matmul(X, w) + b
    return scale * tf.reduce_mean(tf.square(pred - Y))


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _assert_vars_close(actual, expected, rtol=1e-6, atol=1e-7):
    actual, expected = _values(actual), _values(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def _assert_bitwise_equal(before, after):
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.dtype == a.dtype, i
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i} changed")


def _keras3_step(opt, variables, loss_fn):
    """Keras 3 style: scale_loss, then apply_gradients with the scaled grads."""
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_fn())
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))


def _tfkeras_step(opt, variables, loss_fn):
    """tf_keras style: get_scaled_loss, get_unscaled_gradients, apply_gradients."""
    with tf.GradientTape() as tape:
        scaled = opt.get_scaled_loss(loss_fn())
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
    opt.apply_gradients(zip(grads, variables))


def _tfkeras_callable_step(opt, variables, loss_fn):
    """tf_keras style with a zero-argument callable loss."""
    scaled_fn = opt.get_scaled_loss(loss_fn)
    assert callable(scaled_fn)
    with tf.GradientTape() as tape:
        scaled = scaled_fn()
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
    opt.apply_gradients(zip(grads, variables))


WORKFLOWS = {
    "keras3": _keras3_step,
    "tfkeras": _tfkeras_step,
    "tfkeras_callable": _tfkeras_callable_step,
}


def _plain_step(opt, variables, loss_fn):
    with tf.GradientTape() as tape:
        loss = loss_fn()
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))


def _scale(opt):
    return float(opt.loss_scale().numpy())


# -- A. API ----------------------------------------------------------------------


def test_is_a_keras_loss_scale_optimizer():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert isinstance(opt, keras.optimizers.Optimizer)


def test_compile_under_mixed_float16_keeps_the_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt


def test_loss_scale_instance_is_used_as_is():
    ls = tfdls.DynamicLossScale(initial_loss_scale=64.0, increment_period=7)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=ls)
    assert opt.loss_scale is ls
    fixed = tfdls.FixedLossScale(8.0)
    assert tfdls.LossScaleOptimizer(keras.optimizers.SGD(), fixed).loss_scale is fixed


def test_default_and_dynamic_string():
    for opt in (
        tfdls.LossScaleOptimizer(keras.optimizers.SGD()),
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale="dynamic"),
    ):
        assert type(opt.loss_scale) is tfdls.DynamicLossScale
        assert opt.dynamic is True
        assert opt.initial_scale == 2.0**15
        assert opt.dynamic_growth_steps == 2000
        assert _scale(opt) == 2.0**15


@pytest.mark.parametrize("value", [128, 256.0, np.float32(4.0)])
def test_number_gives_fixed_loss_scale(value):
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=value)
    assert type(opt.loss_scale) is tfdls.FixedLossScale
    assert opt.loss_scale.loss_scale_value == float(value)
    assert opt.dynamic is False
    assert opt.initial_scale == float(value)
    assert opt.dynamic_growth_steps is None
    assert _scale(opt) == float(value)


def test_config_dict_loss_scale():
    cfg = tfdls.serialize(
        tfdls.DynamicLossScale(initial_loss_scale=32.0, increment_period=3, hysteresis=2)
    )
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=cfg)
    assert type(opt.loss_scale) is tfdls.DynamicLossScale
    assert opt.loss_scale.get_config() == cfg["config"]
    assert _scale(opt) == 32.0
    opt2 = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(), loss_scale={"class_name": "FixedLossScale",
                                            "config": {"loss_scale_value": 16.0}}
    )
    assert type(opt2.loss_scale) is tfdls.FixedLossScale
    assert _scale(opt2) == 16.0


def test_keras_style_keywords():
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=512.0, dynamic_growth_steps=11
    )
    assert type(opt.loss_scale) is tfdls.DynamicLossScale
    assert opt.loss_scale.initial_loss_scale == 512.0
    assert opt.loss_scale.increment_period == 11
    assert opt.initial_scale == 512.0
    assert opt.dynamic_growth_steps == 11
    assert opt.dynamic is True
    assert _scale(opt) == 512.0

    only_growth = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=5)
    assert only_growth.loss_scale.increment_period == 5
    assert only_growth.initial_scale == 2.0**15

    explicit = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=True, initial_scale=4.0
    )
    assert type(explicit.loss_scale) is tfdls.DynamicLossScale
    assert explicit.initial_scale == 4.0


def test_keras_style_dynamic_false_is_fixed():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=64.0)
    assert type(opt.loss_scale) is tfdls.FixedLossScale
    assert opt.loss_scale.loss_scale_value == 64.0
    assert opt.dynamic is False
    assert opt.initial_scale == 64.0
    assert _scale(opt) == 64.0


@pytest.mark.parametrize(
    "keywords",
    [{"initial_scale": 8.0}, {"dynamic_growth_steps": 3}, {"dynamic": False}],
)
def test_both_argument_styles_is_an_error(keywords):
    with pytest.raises(ValueError, match="not both"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale="dynamic", **keywords)
    with pytest.raises(ValueError, match="not both"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), tfdls.FixedLossScale(2.0), **keywords)


def test_learning_rate_passes_through():
    inner = keras.optimizers.SGD(0.25)
    opt = tfdls.LossScaleOptimizer(inner)
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == 0.25
    opt.learning_rate = 0.125
    assert float(keras.ops.convert_to_numpy(inner.learning_rate)) == 0.125
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == 0.125


def test_iterations_is_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.1)
    opt = tfdls.LossScaleOptimizer(inner, loss_scale=8.0)
    assert opt.iterations is inner.iterations
    variables = _make_vars()
    opt.build(variables)
    assert opt.iterations is inner.iterations
    for _ in range(3):
        _keras3_step(opt, variables, lambda: _loss(variables))
    assert int(inner.iterations.numpy()) == 3
    assert int(opt.iterations.numpy()) == 3


def test_variables_include_loss_scale_and_inner_state():
    inner = keras.optimizers.Adam(1e-2)
    opt = tfdls.LossScaleOptimizer(inner)
    variables = _make_vars()
    opt.build(variables)
    ids = {id(v) for v in opt.variables}
    for v in opt.loss_scale.variables:
        assert id(v) in ids
    for v in inner.variables:
        assert id(v) in ids


# -- B. Both workflows match the plain inner optimizer ---------------------------


INNER_FACTORIES = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
}


@pytest.mark.parametrize(
    "workflow, inner_name",
    slow_except(
        [(w, i) for w in sorted(WORKFLOWS) for i in sorted(INNER_FACTORIES)],
        [("keras3", "adam"), ("tfkeras", "sgd_momentum")],
    ),
)
def test_workflow_matches_plain_optimizer(run_mode, workflow, inner_name):
    make_inner = INNER_FACTORIES[inner_name]
    variables = _make_vars()
    ref_variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(
        make_inner(), tfdls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    )
    ref = make_inner()
    opt.build(variables)
    ref.build(ref_variables)
    step_fn = WORKFLOWS[workflow]
    step = run_mode(lambda: step_fn(opt, variables, lambda: _loss(variables)))
    ref_step = run_mode(lambda: _plain_step(ref, ref_variables, lambda: _loss(ref_variables)))

    initial = _values(variables)
    for i in range(5):
        step()
        ref_step()
        _assert_vars_close(variables, ref_variables)
        assert int(opt.iterations.numpy()) == i + 1
    # The variables moved, and the loss went down.
    assert not np.allclose(_values(variables)[0], initial[0])
    assert float(_loss(variables)) < float(_loss([keras.Variable(v) for v in initial]))
    # Scale grew at steps 2 and 4 and nothing was skipped.
    assert _scale(opt) == 2.0**12
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    # Every inner optimizer variable (slots, iterations) matches too.
    _assert_vars_close(opt.inner_optimizer.variables, ref.variables)


@pytest.mark.parametrize("workflow", slow_except(["keras3", "tfkeras"], ["tfkeras"]))
def test_fixed_scale_workflow_matches_plain_optimizer(run_mode, workflow):
    variables = _make_vars()
    ref_variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), loss_scale=2.0**7)
    ref = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(variables)
    ref.build(ref_variables)
    step = run_mode(lambda: WORKFLOWS[workflow](opt, variables, lambda: _loss(variables)))
    ref_step = run_mode(lambda: _plain_step(ref, ref_variables, lambda: _loss(ref_variables)))
    for _ in range(3):
        step()
        ref_step()
    _assert_vars_close(variables, ref_variables)
    assert _scale(opt) == 2.0**7


def test_scaled_loss_and_unscaled_gradients_values():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=2.0**5)
    loss = tf.constant(3.0)
    assert float(opt.scale_loss(loss)) == 96.0
    assert float(opt.get_scaled_loss(loss)) == 96.0
    assert float(opt.get_scaled_loss(lambda: loss)()) == 96.0
    grads = opt.get_unscaled_gradients([tf.constant([64.0, 32.0]), None])
    np.testing.assert_array_equal(grads[0].numpy(), [2.0, 1.0])
    assert grads[1] is None


def test_apply_without_unscaled_mark_divides_once():
    """get_unscaled_gradients + apply must not divide twice, plain apply once."""
    variables = [keras.Variable(np.zeros((2,), "float32"))]
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), loss_scale=2.0**4)
    opt.apply([tf.constant([16.0, 32.0])], variables)  # scaled grads
    np.testing.assert_array_equal(variables[0].numpy(), [-1.0, -2.0])
    grads = opt.get_unscaled_gradients([tf.constant([16.0, 32.0])])
    opt.apply(grads, variables)
    np.testing.assert_array_equal(variables[0].numpy(), [-2.0, -4.0])
    opt.apply([tf.constant([16.0, 32.0])], variables)
    np.testing.assert_array_equal(variables[0].numpy(), [-3.0, -6.0])


# -- C. Non-finite gradients skip the whole step ---------------------------------


@pytest.mark.parametrize("workflow", ["keras3", "tfkeras"])
def test_nonfinite_step_applies_nothing(run_mode, workflow):
    variables = _make_vars()
    inner = keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9)
    opt = tfdls.LossScaleOptimizer(
        inner, tfdls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=1000)
    )
    opt.build(variables)
    # The EMA copies, slots and iterations are all in inner.variables.
    assert len(inner.variables) >= 1 + 2 * len(variables) + len(variables)

    def step(factor):
        def loss_fn():
            return _loss(variables)

        if workflow == "keras3":
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(loss_fn())
            grads = tape.gradient(loss, variables)
        else:
            with tf.GradientTape() as tape:
                scaled = opt.get_scaled_loss(loss_fn())
            grads = tape.gradient(scaled, variables)
        # Poison one element of one gradient (factor is 1.0 for finite steps).
        mask = tf.one_hot(1, 3, dtype=tf.float32)[:, None]
        grads[0] = grads[0] * (1.0 - mask) + grads[0] * mask * factor
        if workflow == "tfkeras":
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, variables))

    step = run_mode(step)

    def state():
        return _values(variables) + _values(inner.variables)

    for _ in range(3):
        step(tf.constant(1.0))
    assert int(inner.iterations.numpy()) == 3
    for bad in (NAN, INF, -INF):
        before = state()
        iters_before = int(inner.iterations.numpy())
        scale_before = _scale(opt)
        skipped_before = int(opt.loss_scale.num_skipped_steps.numpy())
        step(tf.constant(bad))
        _assert_bitwise_equal(before, state())
        assert int(inner.iterations.numpy()) == iters_before
        assert int(opt.iterations.numpy()) == iters_before
        assert _scale(opt) == scale_before / 2
        assert int(opt.loss_scale.num_skipped_steps.numpy()) == skipped_before + 1
        # A finite step applies again.
        iters = int(inner.iterations.numpy())
        step(tf.constant(1.0))
        assert int(inner.iterations.numpy()) == iters + 1
        after = _values(variables)
        assert not np.array_equal(after[0], before[0])
        assert np.all(np.isfinite(after[0]))
        assert _scale(opt) == scale_before / 2


def test_nonfinite_iterations_unchanged_eager():
    variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**8)
    opt.build(variables)
    opt.apply([tf.ones((3, 1)), tf.ones((1,))], variables)
    assert int(opt.iterations.numpy()) == 1
    w_before = variables[0].numpy().copy()
    opt.apply([tf.fill((3, 1), NAN), tf.ones((1,))], variables)
    assert int(opt.iterations.numpy()) == 1
    np.testing.assert_array_equal(variables[0].numpy(), w_before)
    assert _scale(opt) == 2.0**7


# -- D. The inner optimizer's options act on the true gradients -------------------


def _true_grad_norm(variables):
    with tf.GradientTape() as tape:
        loss = _loss(variables)
    grads = tape.gradient(loss, variables)
    return float(tf.linalg.global_norm(grads)), [float(tf.reduce_max(tf.abs(g))) for g in grads]


_NORM, _MAXABS = _true_grad_norm(_make_vars())

INNER_OPTIONS = {
    "clipnorm_no_clip": lambda: keras.optimizers.SGD(0.1, clipnorm=2.0 * _NORM),
    "clipnorm_clips": lambda: keras.optimizers.SGD(0.1, clipnorm=_NORM / 4),
    "global_clipnorm_no_clip": lambda: keras.optimizers.SGD(0.1, global_clipnorm=2.0 * _NORM),
    "global_clipnorm_clips": lambda: keras.optimizers.SGD(0.1, global_clipnorm=_NORM / 4),
    "clipvalue_no_clip": lambda: keras.optimizers.SGD(0.1, clipvalue=2.0 * max(_MAXABS)),
    "clipvalue_clips": lambda: keras.optimizers.SGD(0.1, clipvalue=min(_MAXABS) / 4),
    "adam_clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=_NORM / 4),
    "adamw_weight_decay": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.5),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.1, momentum=0.5, weight_decay=0.5),
    "grad_accumulation": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=2
    ),
    "use_ema": lambda: keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.5),
    "adam_use_ema_accumulation": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, gradient_accumulation_steps=2
    ),
}


@pytest.mark.parametrize(
    "option",
    slow_except(sorted(INNER_OPTIONS), ["clipnorm_clips", "adamw_weight_decay"]),
)
def test_inner_options_see_true_gradients(option):
    make_inner = INNER_OPTIONS[option]
    variables = _make_vars()
    ref_variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(make_inner(), loss_scale=tfdls.DynamicLossScale(2.0**10, 2))
    ref = make_inner()
    opt.build(variables)
    ref.build(ref_variables)
    step = tf.function(lambda: _keras3_step(opt, variables, lambda: _loss(variables)))
    ref_step = tf.function(lambda: _plain_step(ref, ref_variables, lambda: _loss(ref_variables)))
    initial = _values(variables)
    for _ in range(4):
        step()
        ref_step()
        _assert_vars_close(variables, ref_variables)
    assert not np.allclose(_values(variables)[0], initial[0])
    _assert_vars_close(opt.inner_optimizer.variables, ref.variables)
    assert _scale(opt) == 2.0**12


def test_clipnorm_setup_discriminates():
    """Sanity check of the D setup: scaled gradients would have been clipped."""
    true_fed, scaled_fed = _make_vars(), _make_vars()
    with tf.GradientTape() as tape:
        loss = _loss(true_fed)
    keras.optimizers.SGD(0.1, clipnorm=2.0 * _NORM).apply(
        tape.gradient(loss, true_fed), true_fed
    )
    with tf.GradientTape() as tape:
        loss = _loss(scaled_fed, scale=2.0**10)
    # Clipping before unscaling (the wrong order) clips the scaled gradients.
    grads = [tf.clip_by_norm(g, 2.0 * _NORM) / 2.0**10
             for g in tape.gradient(loss, scaled_fed)]
    keras.optimizers.SGD(0.1).apply(grads, scaled_fed)
    assert not np.allclose(_values(true_fed)[0], _values(scaled_fed)[0], rtol=1e-3)


# -- E. None gradients, IndexedSlices, mixed dtypes, float16 policies --------------


def test_none_gradient(run_mode):
    variables = _make_vars()
    unused = keras.Variable(np.ones((2,), "float32"), name="unused")
    ref_variables = _make_vars()
    ref_unused = keras.Variable(np.ones((2,), "float32"), name="unused")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), tfdls.DynamicLossScale(2.0**8, 100))
    ref = keras.optimizers.Adam(1e-2)
    all_vars = variables + [unused]
    ref_all = ref_variables + [ref_unused]
    opt.build(all_vars)
    ref.build(ref_all)

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(_loss(variables))
        grads = tape.gradient(loss, all_vars)
        opt.apply_gradients(zip(grads, all_vars))

    def ref_step():
        with tf.GradientTape() as tape:
            loss = _loss(ref_variables)
        grads = tape.gradient(loss, ref_all)
        ref.apply_gradients(zip(grads, ref_all))

    step, ref_step = run_mode(step), run_mode(ref_step)
    # Keras warns about the None gradient, for tfdls' inner optimizer as for the bare one.
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['unused'\]"):
        for _ in range(3):
            step()
            ref_step()
    _assert_vars_close(all_vars, ref_all)
    np.testing.assert_array_equal(unused.numpy(), [1.0, 1.0])
    assert int(opt.iterations.numpy()) == 3
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0


def test_apply_to_a_subset_of_the_built_variables(run_mode):
    """Built for (w, b, c) but stepping (w, b) only, as Keras allows."""
    def make():
        return _make_vars() + [keras.Variable(np.ones((2,), "float32"), name="c")]

    variables, ref_variables = make(), make()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                   tfdls.DynamicLossScale(2.0**8, 100))
    ref = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(variables)
    ref.build(ref_variables)
    step = run_mode(lambda: _keras3_step(opt, variables[:2], lambda: _loss(variables)))
    ref_step = run_mode(lambda: _plain_step(ref, ref_variables[:2],
                                            lambda: _loss(ref_variables)))
    for _ in range(3):
        step()
        ref_step()
    _assert_vars_close(variables, ref_variables)
    np.testing.assert_array_equal(variables[2].numpy(), [1.0, 1.0])
    # A non-finite gradient for the subset still skips.
    before = _values(variables)
    opt.apply([tf.fill((3, 1), NAN), tf.ones((1,))], variables[:2])
    _assert_bitwise_equal(before, _values(variables))
    assert _scale(opt) == 2.0**7


@pytest.mark.parametrize("loss_scale", ["dynamic", 4.0])
def test_all_none_gradients_is_a_clear_error(loss_scale):
    """Like the bare Keras optimizer: a ValueError, and nothing is applied."""
    variables = _make_vars()
    bare = keras.optimizers.SGD(0.1)
    bare.build(variables)
    with pytest.raises(ValueError, match="No gradients"):
        bare.apply([None, None], variables)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=loss_scale)
    opt.build(variables)
    before = _values(variables)
    with pytest.raises(ValueError, match="[Gg]radient"):
        opt.apply([None, None], variables)
    _assert_bitwise_equal(before, _values(variables))
    assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("make_inner", [
    lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    lambda: keras.optimizers.Adam(1e-1),
], ids=["sgd", "adam"])
def test_indexed_slices_gradient(run_mode, make_inner):
    def build():
        emb = keras.layers.Embedding(10, 4, embeddings_initializer=keras.initializers.RandomNormal(seed=3))
        emb.build((None,))
        return emb

    emb, ref_emb = build(), build()
    _assert_vars_close(emb.trainable_variables, ref_emb.trainable_variables, 0, 0)
    ids = tf.constant([1, 3, 3, 7])
    target = tf.constant(np.linspace(-1, 1, 16).reshape(4, 4).astype("float32"))
    opt = tfdls.LossScaleOptimizer(make_inner(), tfdls.DynamicLossScale(2.0**12, 100))
    ref = make_inner()
    opt.build(emb.trainable_variables)
    ref.build(ref_emb.trainable_variables)
    seen = []

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_mean(tf.square(emb(ids) - target)))
        grads = tape.gradient(loss, emb.trainable_variables)
        seen.append(type(grads[0]))
        opt.apply_gradients(zip(grads, emb.trainable_variables))

    def ref_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref_emb(ids) - target))
        grads = tape.gradient(loss, ref_emb.trainable_variables)
        ref.apply_gradients(zip(grads, ref_emb.trainable_variables))

    step, ref_step = run_mode(step), run_mode(ref_step)
    before = _values(emb.trainable_variables)[0]
    for _ in range(3):
        step()
        ref_step()
    assert issubclass(seen[0], tf.IndexedSlices)
    _assert_vars_close(emb.trainable_variables, ref_emb.trainable_variables)
    after = _values(emb.trainable_variables)[0]
    # Looked-up rows changed, the others did not.
    assert not np.allclose(after[[1, 3, 7]], before[[1, 3, 7]])
    if isinstance(ref, keras.optimizers.SGD):
        np.testing.assert_array_equal(after[[0, 2, 4, 5, 6, 8, 9]], before[[0, 2, 4, 5, 6, 8, 9]])


def test_indexed_slices_nonfinite_skips():
    emb = keras.layers.Embedding(10, 4)
    emb.build((None,))
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), tfdls.DynamicLossScale(2.0**4, 100))
    opt.build(emb.trainable_variables)
    before = _values(emb.trainable_variables)
    grad = tf.IndexedSlices(
        tf.constant([[1.0, NAN, 0.0, 0.0]]), tf.constant([2]), tf.constant([10, 4])
    )
    opt.apply([grad], emb.trainable_variables)
    _assert_bitwise_equal(before, _values(emb.trainable_variables))
    assert _scale(opt) == 2.0**3


def test_mixed_dtype_gradients(run_mode):
    def make():
        w16 = keras.Variable(np.full((3, 1), 0.1, "float32"), dtype="float16", name="w16")
        b32 = keras.Variable(np.zeros((1,), "float32"), dtype="float32", name="b32")
        return [w16, b32]

    variables, ref_variables = make(), make()
    assert variables[0].dtype == "float16"
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.5),
                                   tfdls.DynamicLossScale(2.0**8, 100))
    ref = keras.optimizers.SGD(0.05, momentum=0.5)
    opt.build(variables)
    ref.build(ref_variables)
    dtypes = []

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(_loss(variables))
        grads = tape.gradient(loss, variables)
        dtypes.append([g.dtype for g in grads])
        opt.apply_gradients(zip(grads, variables))

    step = run_mode(step)
    ref_step = run_mode(lambda: _plain_step(ref, ref_variables, lambda: _loss(ref_variables)))
    loss0 = float(_loss(variables))
    for _ in range(4):
        step()
        ref_step()
    assert dtypes[0] == [tf.float16, tf.float32]
    _assert_vars_close(variables, ref_variables, rtol=1e-3, atol=1e-4)
    assert variables[0].dtype == "float16"
    assert float(_loss(variables)) < loss0


def test_mixed_dtype_nonfinite_in_float16_gradient_skips():
    w16 = keras.Variable(np.ones((2,), "float32"), dtype="float16")
    b32 = keras.Variable(np.ones((2,), "float32"))
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**6, 100))
    opt.build([w16, b32])
    opt.apply([tf.constant([INF, 1.0], tf.float16), tf.constant([1.0, 1.0])], [w16, b32])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(w16), [1.0, 1.0])
    np.testing.assert_array_equal(b32.numpy(), [1.0, 1.0])
    assert _scale(opt) == 2.0**5
    # A float16 gradient that is only finite once unscaled in float32 is fine.
    opt.apply([tf.constant([2.0**5, 2.0**5], tf.float16), tf.constant([32.0, 32.0])], [w16, b32])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(w16).astype("float32"), [0.9, 0.9],
                               rtol=1e-3)
    np.testing.assert_allclose(b32.numpy(), [0.9, 0.9], rtol=1e-6)


def test_float16_unscale_of_large_scale_is_exact():
    """1/2**20 underflows in float16; unscaling must not go through it."""
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=2.0**20)
    grads = opt.get_unscaled_gradients([tf.constant([2.0**12, 2.0**10], tf.float16)])
    assert grads[0].dtype == tf.float16
    np.testing.assert_array_equal(grads[0].numpy().astype("float32"), [2.0**-8, 2.0**-10])
    grads = opt.get_unscaled_gradients([tf.constant([2.0**12], tf.bfloat16)])
    assert grads[0].dtype == tf.bfloat16
    assert float(tf.cast(grads[0], tf.float32)[0]) == 2.0**-8


@pytest.mark.parametrize(
    "policy", slow_except(["float16", "mixed_float16", "mixed_bfloat16"], [])
)
def test_small_model_trains_under_policy(policy):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) * 0.5).astype("float32")
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1),
    ])
    compute_dtype = {"float16": "float16", "mixed_float16": "float16",
                     "mixed_bfloat16": "bfloat16"}[policy]
    assert model.layers[0].compute_dtype == compute_dtype
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**15)
    opt.build(model.trainable_variables)
    xs, ys = tf.constant(x), tf.constant(y)

    def loss_fn():
        return tf.reduce_mean(tf.square(tf.cast(model(xs), tf.float32) - ys))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn()
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    initial = float(loss_fn())
    for _ in range(40):
        step()
    final = float(loss_fn())
    assert np.isfinite(final)
    assert final < 0.5 * initial, (initial, final)
    assert int(opt.iterations.numpy()) > 0
    for v in model.trainable_variables:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(v).astype("float32")))


@pytest.mark.slow
def test_float16_variables_overflow_then_recover():
    """Pure float16 weights: a huge initial scale overflows and is reduced."""
    keras.mixed_precision.set_global_policy("float16")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    assert model.trainable_variables[0].dtype == "float16"
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**30)
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(1)
    xs = tf.constant(rng.normal(size=(32, 4)).astype("float32"))
    ys = tf.constant(rng.normal(size=(32, 1)).astype("float32"))

    def loss_fn():
        return tf.reduce_mean(tf.square(tf.cast(model(xs), tf.float32) - ys))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn())
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    initial = float(loss_fn())
    for _ in range(40):
        step()
    skipped = int(opt.loss_scale.num_skipped_steps.numpy())
    assert skipped > 0
    assert _scale(opt) == 2.0**30 / 2**skipped  # fell once per skip, no growth
    assert int(opt.iterations.numpy()) == 40 - skipped
    assert float(loss_fn()) < initial


# -- I. Bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inner, exc, match",
    [
        ("adam", TypeError, "keras.optimizers.get"),
        (None, TypeError, "inner_optimizer"),
        (object(), TypeError, "Keras 3 optimizer"),
    ],
    ids=["string", "none", "object"],
)
def test_bad_inner_optimizer(inner, exc, match):
    with pytest.raises(exc, match=match):
        tfdls.LossScaleOptimizer(inner)


def test_already_wrapped_inner_optimizer():
    keras_wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a loss-scale optimizer"):
        tfdls.LossScaleOptimizer(keras_wrapped)
    ours = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a loss-scale optimizer"):
        tfdls.LossScaleOptimizer(ours)


def test_inner_with_loss_scale_factor():
    with pytest.raises(ValueError, match="loss_scale_factor"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(loss_scale_factor=2.0))


@pytest.mark.parametrize("kwargs", [{"clipnorm": 1.0}, {"foo": 1}, {"weight_decay": 0.1}])
def test_unknown_kwargs(kwargs):
    # ValueError, as Keras 3 raises (code catching Keras' error catches ours).
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"{key}={value!r}"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_dynamic_growth_steps_with_fixed_scale():
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, dynamic_growth_steps=3)


@pytest.mark.parametrize("loss_scale", ["static", -1.0, 0, float("inf"), [1.0]])
def test_bad_loss_scale(loss_scale):
    with pytest.raises((TypeError, ValueError)):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=loss_scale)


def test_mismatched_gradient_and_variable_counts():
    variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="2 variables"):
        opt.apply([tf.ones((3, 1))], variables)
    with pytest.raises(ValueError, match="must match"):
        opt.apply([tf.ones((3, 1)), tf.ones((1,)), tf.ones((1,))], variables)


def test_apply_without_variables_unbuilt():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="build"):
        opt.apply([tf.ones((3, 1))])


def test_apply_without_variables_after_build():
    variables = _make_vars()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), loss_scale=2.0)
    opt.build(variables)
    opt.apply([tf.fill((3, 1), 2.0), tf.fill((1,), 2.0)])
    np.testing.assert_allclose(variables[1].numpy(), [-1.0])


def test_non_float_gradient():
    variables = [keras.Variable(np.zeros((2,), "float32"))]
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="floating"):
        opt.apply([tf.constant([1, 2], tf.int32)], variables)
