"""The division by a deep chain's power of two, its exponent clipped to +-278 for float32,
float16 and bfloat16 (`tfdls._division.FLOAT32_CLIPPED_EXPONENT`): against numpy's float64
ldexp, against a model without boundaries, float64 and float32 side by side, sparse
gradients below deep chains (written by an outside review of that change)."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdls
from tfdls import _division


@pytest.fixture(scope="module")
def hypothesis():
    return pytest.importorskip("hypothesis")


def _small_boundary_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="a"),
                              keras.layers.Dense(1, name="b")])
    return tfdls.add_scale_boundaries(model, every=1)


@pytest.mark.parametrize("as_list", [False, True])
def test_get_unscaled_gradients_with_boundaries_takes_python_values(as_list):
    """A gradient given as a Python list is converted as the division converts it (the
    pieces are chosen by each gradient's dtype, which a list does not have: the first
    version of the clip raised AttributeError)."""
    model = _small_boundary_model()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), scale_boundaries=model)
    variables = model.trainable_variables
    arrays = [np.full(v.shape, 2.0**15, np.float32) for v in variables]
    grads = [a.tolist() for a in arrays] if as_list else arrays
    got = opt.get_unscaled_gradients(grads, variables)
    for g in got:
        np.testing.assert_array_equal(np.asarray(g), 1.0)


@pytest.mark.parametrize("as_list", [False, True])
def test_apply_with_boundaries_takes_python_values(as_list):
    model = _small_boundary_model()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), scale_boundaries=model)
    variables = model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    arrays = [np.full(v.shape, 2.0**15, np.float32) for v in variables]
    opt.apply([a.tolist() for a in arrays] if as_list else arrays, variables)
    for b, v in zip(before, variables):
        np.testing.assert_array_equal(v.numpy(), b - 0.5)


def _reference(values, exponent, dtype):
    """numpy: value * 2**-exponent in float64 (exact: |exponent| clipped to 1100 changes
    no float32 result), rounded once to `dtype`; None where the CPU's flush of float32
    subnormals makes the device's answer differ (subnormal float32 input or result)."""
    tiny = np.finfo(np.float32).tiny
    v64 = values.astype(np.float64)
    e = np.clip(exponent, -1100, 1100)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        q64 = np.ldexp(v64, -e)
        if dtype == "bfloat16":
            want = tf.cast(tf.constant(q64.astype(np.float32)), tf.bfloat16).numpy().astype(
                np.float64)
        else:
            want = q64.astype(dtype).astype(np.float64)
    skip = (np.abs(v64) < tiny) & (v64 != 0)
    skip |= (np.abs(q64) < tiny) & (q64 != 0) & (dtype != "float16")
    return want, skip


def test_clamped_xla_division_against_float64_ldexp(hypothesis):
    """Inside XLA, divide_by_power_of_two(g, e, 128 + 15 * 100) (the clamped pieces)
    against numpy's float64 ldexp rounded once, for float32 bit patterns near every
    extreme (max finite, smallest normal, +-0, Inf, NaN) and exponents about +-277/278
    and beyond, scalar and vector exponents."""
    from hypothesis import given, settings, strategies as st

    bound = 128 + 15 * 100

    @tf.function(jit_compile=True)
    def divide(values, exponents):
        return _division.divide_by_power_of_two(values, exponents, bound)

    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max,
                         -np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1.0,
                         1.5 * 2.0**-126, np.nextafter(np.float32(2.0**-125), 0)], np.float32)

    @settings(max_examples=120, deadline=None)
    @given(st.sampled_from(["float32", "float16", "bfloat16"]),
           st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6),
           st.lists(st.one_of(st.integers(-bound, bound), st.integers(-300, 300),
                              st.integers(250, 290), st.integers(-290, -250)),
                    min_size=1, max_size=4))
    def check(dtype, bit_patterns, exponents):
        drawn = np.array(bit_patterns, np.uint32).view(np.float32)
        values32 = np.concatenate([specials, drawn])
        values = tf.cast(tf.constant(values32), dtype)
        exact = values.numpy().astype(np.float64)  # the value the device divides
        for e in exponents:
            got = divide(values, tf.fill(values.shape, e)).numpy().astype(np.float64)
            want, skip = _reference(exact, np.full(exact.shape, e), dtype)
            keep = ~skip
            np.testing.assert_array_equal(got[keep], want[keep], err_msg=f"{dtype} / 2**{e}")
            np.testing.assert_array_equal(np.signbit(got[keep]), np.signbit(want[keep]))
        # one vector of exponents, as a step divides its segments
        es = np.resize(np.array(exponents, np.int32), exact.shape)
        got = divide(values, tf.constant(es)).numpy().astype(np.float64)
        want, skip = _reference(exact, es, dtype)
        np.testing.assert_array_equal(got[~skip], want[~skip])

    check()


def _mixed_model(n64, n32, f64, f32, boundaries=True):
    keras.utils.set_random_seed(0)
    init = keras.initializers.RandomUniform(-1.0, 1.0, seed=0)
    layers = [keras.Input((4,), dtype="float64")]
    if boundaries:
        layers.append(tfdls.UnscaledInput())
    # n64 float64 layers, then n32 float32 ones, each below a boundary pinned at its factor.
    for count, dtype, factor in ((n64, "float64", f64), (n32, "float32", f32)):
        for i in range(count):
            layers.append(keras.layers.Dense(4, activation="tanh", kernel_initializer=init,
                                             dtype=dtype, name=f"f{dtype[-2:]}_{i}"))
            if boundaries:
                layers.append(tfdls.ScaleBoundary(initial_log2_factor=factor,
                                                  min_log2_factor=factor,
                                                  max_log2_factor=factor))
    layers.append(keras.layers.Dense(1, kernel_initializer=init, dtype="float32", name="out"))
    return keras.Sequential(layers)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("f64", [15, -14])
def test_mixed_float64_float32_unscaled_gradients_equal_the_bare_ones(jit, f64):
    """float64 Dense layers below 30 boundaries at 2**f64 (float64 gradients divided by
    up to 2**(15 + 450), past the float32 clamp) under 3 float32 ones at 2**1: inside
    XLA the step's pieces are keyed per dtype bound. get_unscaled_gradients and the
    gradient at the (float64) input equal the model without boundaries bit for bit."""
    model = _mixed_model(30, 3, f64, 1)
    bare = _mixed_model(30, 3, f64, 1, boundaries=False)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), tfdls.DynamicLossScale(2.0**15),
                                   scale_boundaries=model)
    variables = model.trainable_variables
    opt.build(variables)
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)))
    y = tf.constant(np.random.default_rng(1).normal(size=(8, 1)), tf.float32)

    @tf.function(jit_compile=jit)
    def scaled_step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled = opt.get_scaled_loss(loss)
        grads = tape.gradient(scaled, variables + [x])
        unscaled = opt.get_unscaled_gradients(grads[:-1], variables)
        return unscaled, grads[-1] / 2.0**15

    @tf.function(jit_compile=jit)
    def bare_step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_mean((bare(x) - y) ** 2)
        grads = tape.gradient(loss, bare.trainable_variables + [x])
        return grads[:-1], grads[-1]

    got, got_x = scaled_step()
    want, want_x = bare_step()
    assert any(g.dtype == tf.float64 for g in got) and any(g.dtype == tf.float32 for g in got)
    nonzero = 0
    for g, w, v in zip(got, want, variables):
        np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=v.path)
        nonzero += int(np.any(w.numpy() != 0))
    assert nonzero > 40
    np.testing.assert_array_equal(got_x.numpy(), want_x.numpy())


@pytest.mark.parametrize("f64", [15, -14])
def test_mixed_float64_float32_xla_apply_equals_bare_sgd(f64):
    """The same model, one apply inside XLA (BoundaryStep: divisors keyed per dtype bound,
    the check's largest magnitudes, the division) against bare SGD inside XLA."""
    model = _mixed_model(30, 3, f64, 1)
    bare = _mixed_model(30, 3, f64, 1, boundaries=False)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), tfdls.DynamicLossScale(2.0**15),
                                   scale_boundaries=model)
    bare_opt = keras.optimizers.SGD(0.5)
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)))
    y = tf.constant(np.random.default_rng(1).normal(size=(8, 1)), tf.float32)

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    @tf.function(jit_compile=True)
    def bare_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((bare(x) - y) ** 2)
        bare_opt.apply(tape.gradient(loss, bare.trainable_variables), bare.trainable_variables)

    before = [v.numpy().copy() for v in model.trainable_variables]
    for _ in range(2):
        step()
        bare_step()
    assert int(opt.iterations.numpy()) == 2
    changed = 0
    for v, w, b in zip(model.trainable_variables, bare.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)
        changed += int(np.any(v.numpy() != b))
    assert changed > 40


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_embedding_indexed_slices_below_deep_boundaries_xla(dtype):
    """An Embedding (IndexedSlices gradient, repeated ids) below 25 boundaries: float64 at
    2**15 each (divided by 2**390, past the clamp), float32 at 2**3 (2**90), against the
    model without boundaries, both steps inside XLA with SGD."""
    factor = 15 if dtype == "float64" else 3

    def build(boundaries):
        keras.utils.set_random_seed(0)
        init = keras.initializers.RandomUniform(-1.0, 1.0, seed=0)
        layers = [keras.Input((3,), dtype="int32"),
                  keras.layers.Embedding(50, 4, dtype=dtype, name="emb"),
                  keras.layers.Flatten(dtype=dtype)]
        for i in range(25):
            if boundaries:
                layers.append(tfdls.ScaleBoundary(initial_log2_factor=factor,
                                                  min_log2_factor=factor,
                                                  max_log2_factor=factor))
            layers.append(keras.layers.Dense(4 if i < 24 else 1, activation="tanh",
                                             kernel_initializer=init, dtype=dtype))
        return keras.Sequential(layers)

    model, bare = build(True), build(False)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5), tfdls.DynamicLossScale(2.0**15),
                                   scale_boundaries=model)
    bare_opt = keras.optimizers.SGD(0.5)
    x = tf.constant([[1, 1, 7], [7, 3, 1]], tf.int32)
    y = tf.constant([[0.3], [-0.2]], dtype)

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        opt.apply(grads, model.trainable_variables)

    @tf.function(jit_compile=True)
    def bare_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((bare(x) - y) ** 2)
        bare_opt.apply(tape.gradient(loss, bare.trainable_variables), bare.trainable_variables)

    table = model.trainable_variables[0].numpy().copy()
    step()
    bare_step()
    assert int(opt.iterations.numpy()) == 1
    assert np.any(model.trainable_variables[0].numpy() != table)
    for v, w in zip(model.trainable_variables, bare.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)
