"""The applied update is exact at every scale and for every variable dtype.

"Exact": the inner optimizer receives ``g / scale`` correctly rounded to the
gradient's dtype, the value a float64 NumPy reference gives, bit for bit:

* at every power-of-two scale in float32's normal range, also above 2**126
  where the reciprocal is subnormal (it used to zero every update);
* at scales that are not powers of two (a true division; float16 and
  bfloat16 gradients divided in float64), fixed ones included (a constant
  divisor would be rewritten ``g * (1 / c)``);
* for float16, bfloat16, float32 and float64 variables;
* in eager, graph (the apply compiled by ``jit_compile="auto"``) and XLA steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tfdls
from tests.support.fast_loop import slow_except

LR = 0.25  # a power of two: the SGD update -LR * g is exact
MODES = ["eager", "function", "xla"]


def _wrap(fn, mode):
    return fn if mode == "eager" else tf.function(fn, jit_compile=mode == "xla")


def _correctly_rounded_quotient(scaled, scale, dtype):
    """``scaled / scale`` in float64, rounded once to `dtype` (the reference)."""
    quotient = np.asarray(scaled, np.float64) / np.float64(np.float32(scale))
    return tf.cast(tf.constant(quotient, tf.float64), dtype).numpy()


class _Pair:
    """A tfdls SGD at a settable scale, and its step on scaled gradients."""

    def __init__(self, mode, powers_of_two, dtype="float32"):
        self.dtype = tf.as_dtype(dtype)
        self.w = keras.Variable(np.zeros(4), dtype=dtype, name="w")
        initial = 1.0 if powers_of_two else 3.0
        self.opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(LR),
            tfdls.DynamicLossScale(initial, increment_period=10**9, min_loss_scale=2.0**-126),
        )
        assert self.opt.loss_scale.powers_of_two is powers_of_two
        self.step = _wrap(lambda g: self.opt.apply([g], [self.w]), mode)

    def run(self, scale, scaled):
        """One step at `scale` on the `scaled` gradients; returns (update, reference)."""
        self.opt.loss_scale.current_loss_scale.assign(scale)
        self.w.assign(tf.zeros([4], self.dtype))
        self.step(tf.constant(scaled, self.dtype))
        assert int(self.opt.loss_scale.num_skipped_steps.numpy()) == 0
        reference = -LR * _correctly_rounded_quotient(
            tf.constant(scaled, self.dtype).numpy(), scale, self.dtype
        ).astype(np.float64)
        return keras.ops.convert_to_numpy(self.w), tf.cast(reference, self.dtype).numpy()


_PAIRS = {}


def _pair(mode, powers_of_two, dtype="float32"):
    key = (mode, powers_of_two, dtype)
    if key not in _PAIRS:
        _PAIRS[key] = _Pair(mode, powers_of_two, dtype)
    return _PAIRS[key]


def _bits(array):
    return np.asarray(array).tobytes()


@st.composite
def _power_of_two_case(draw):
    # A power-of-two scale anywhere in float32's normal range, and true
    # gradients whose scaled values are normal floats too (what loss scaling
    # is for).
    k = draw(st.integers(-126, 127))
    low, high = max(-60, -100 - k), min(60, 100 - k)
    exponents = draw(st.lists(st.integers(low, high), min_size=4, max_size=4))
    mantissas = draw(st.lists(st.floats(1.0, 2.0, exclude_max=True), min_size=4, max_size=4))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=4, max_size=4))
    true = [s * m * 2.0**e for s, m, e in zip(signs, mantissas, exponents)]
    scale = np.float32(2.0**k)
    return scale, (np.asarray(np.float32(true), np.float64) * scale).astype(np.float32)


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
@settings(max_examples=60, deadline=None)
@given(case=_power_of_two_case())
def test_power_of_two_scales_are_exact(mode, case):
    scale, scaled = case
    mine, reference = _pair(mode, True).run(scale, scaled)
    assert _bits(mine) == _bits(reference)


def _normal_float32(values):
    magnitude = np.abs(np.asarray(values, np.float64))
    return bool(np.all((magnitude >= np.finfo(np.float32).tiny) & (magnitude <= 3e38)))


@st.composite
def _any_scale_case(draw):
    scale = np.float32(draw(st.floats(2.0**-126, 2.0**127.9, allow_nan=False)))
    # Scaled gradients anywhere in float32's normal range whose quotients are
    # normal too (what loss scaling is for).
    exponents = draw(st.lists(st.integers(-100, 100), min_size=4, max_size=4))
    mantissas = draw(st.lists(st.floats(1.0, 2.0, exclude_max=True), min_size=4, max_size=4))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=4, max_size=4))
    quotients = [s * m * 2.0**e for s, m, e in zip(signs, mantissas, exponents)]
    with np.errstate(over="ignore"):
        scaled = (np.asarray(quotients) * np.float64(scale)).astype(np.float32)
    assume(_normal_float32(scaled))
    assume(_normal_float32(scaled.astype(np.float64) / np.float64(scale)))
    return scale, scaled


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
@settings(max_examples=40, deadline=None)
@given(case=_any_scale_case())
def test_any_scale_is_exact(mode, case):
    scale, scaled = case
    mine, reference = _pair(mode, False).run(scale, scaled)
    assert _bits(mine) == _bits(reference), (mine, reference)


@pytest.mark.parametrize(
    "dtype, mode",
    slow_except(
        [(d, m) for d in ("float16", "bfloat16", "float32", "float64") for m in MODES],
        [("float16", "function"), ("float64", "xla"), ("bfloat16", "eager")],
    ),
)
@pytest.mark.parametrize("powers_of_two", [True, False])
def test_every_variable_dtype_is_exact(dtype, mode, powers_of_two):
    pair = _pair(mode, powers_of_two, dtype)
    rng = np.random.default_rng(7)
    for scale in (np.float32(2.0**10), np.float32(1000.0), np.float32(3.0), np.float32(2.0**-3)):
        if powers_of_two and scale not in (2.0**10, 2.0**-3):
            continue
        # Scaled values representable in every dtype, quotients normal.
        scaled = (rng.uniform(0.5, 6000.0, size=4) * rng.choice([-1.0, 1.0], 4)).astype(dtype)
        mine, reference = pair.run(scale, scaled)
        assert _bits(mine) == _bits(reference), (dtype, scale, mine, reference)


@pytest.mark.parametrize("style", ["keras3", "tf_keras"])
@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["xla"]))
@pytest.mark.parametrize("value", [2.0**127, 1000.0, 3.0, 2.0**-126])
def test_fixed_scales_are_exact(mode, value, style):
    w = keras.Variable(np.zeros(4, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(LR), tfdls.FixedLossScale(value))
    scaled = np.float32([1.0, 1.5, -1.25, 1.75]) * np.float32(min(value, 2.0**100))

    def step(g):
        if style == "tf_keras":
            opt.apply(opt.get_unscaled_gradients([g]), [w])
        else:
            opt.apply([g], [w])

    _wrap(step, mode)(tf.constant(scaled))
    reference = (-LR * _correctly_rounded_quotient(scaled, value, tf.float32)).astype(np.float32)
    assert _bits(w.numpy()) == _bits(reference), (w.numpy(), reference)
    assert np.all(w.numpy() != 0)


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_power_of_two_scale_restored_with_another_value_stays_exact(mode):
    """A checkpoint of a differently configured scale can write any value into a
    power-of-two scale's variable: the power of two below it is used, to scale
    the loss and to divide the gradients alike."""
    w = keras.Variable(np.zeros(3, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    opt.loss_scale.current_loss_scale.assign(1000.0)  # as a restore would
    assert float(opt.loss_scale().numpy()) == 512.0

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w * tf.constant([1.0, 1.0 / 3.0, -3.0])))
        opt.apply(tape.gradient(loss, [w]), [w])

    _wrap(step, mode)()
    reference = -np.float32([1.0, 1.0 / 3.0, -3.0])
    assert _bits(w.numpy()) == _bits(reference)


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
def test_growth_to_the_cap_keeps_training(mode):
    """Tiny gradients let the scale double up to 2**127; every step still trains."""
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**125, increment_period=1)
    )

    def step():
        opt.apply([tf.constant([1.0, -0.5]) * opt.loss_scale()], [w])

    step = _wrap(step, mode)
    scales = []
    for _ in range(4):
        step()
        scales.append(float(opt.loss_scale().numpy()))
    # 2**128 is inf: growth stops at the largest power of two, nothing is skipped.
    assert scales == [2.0**126, 2.0**127, 2.0**127, 2.0**127]
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    np.testing.assert_allclose(w.numpy(), [-0.4, 0.2], rtol=1e-6)


@pytest.mark.parametrize("exponent", slow_except([-126, -60, 0, 15, 60, 126, 127], [-126, 127]))
def test_adam_matches_bare_at_extreme_scales(exponent):
    scale = 2.0**exponent
    rng = np.random.default_rng(exponent + 200)
    start = rng.normal(size=(3, 4)).astype("float32")
    w, bare_w = keras.Variable(start, name="w"), keras.Variable(start, name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        tfdls.DynamicLossScale(scale, increment_period=10**9, min_loss_scale=2.0**-126),
    )
    bare = keras.optimizers.Adam(1e-2)
    step = tf.function(lambda g: opt.apply([g], [w]))
    bare_step = tf.function(lambda g: bare.apply([g], [bare_w]))
    for _ in range(3):
        # In [1, 2): scaled by 2**-126 they stay normal floats.
        true = rng.uniform(1.0, 2.0, size=(3, 4)).astype("float32")
        step(tf.constant((true.astype(np.float64) * scale).astype("float32")))
        bare_step(tf.constant(true))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    np.testing.assert_allclose(w.numpy(), bare_w.numpy(), rtol=2e-5)


_FLOAT16_NORMALS = np.arange(0x0400, 0x7C00, dtype=np.uint16).view(np.float16)


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
@pytest.mark.parametrize(
    "scale", slow_except([52428.80078125, 0.1, 0.3, 1.2, 819.2], [52428.80078125, 0.3])
)
def test_every_float16_value_divided_by_a_scale_that_is_not_a_power_of_two(mode, scale):
    """All 30720 positive normal float16 values: each quotient rounds once
    (TensorFlow casts float64 to float16 through float32, which would round
    twice for about 5% of them; review of issue 18)."""
    w = keras.Variable(np.zeros(_FLOAT16_NORMALS.shape, "float16"), dtype="float16", name="w")
    ls = tfdls.FixedLossScale(scale)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), ls)
    _wrap(lambda g: opt.apply([g], [w]), mode)(tf.constant(_FLOAT16_NORMALS))
    with np.errstate(over="ignore"):
        # NumPy rounds float64 to float16 once, correctly.
        quotient = (_FLOAT16_NORMALS.astype(np.float64) / np.float64(np.float32(scale)))
        reference = np.float16(0.0) - quotient.astype(np.float16)  # w = 0 - 1.0 * g
    assert opt.step_plan.division == "divide_in_float64"
    assert _bits(w.numpy()) == _bits(reference)


def test_bfloat16_quotients_round_once():
    from fractions import Fraction

    bfloat16 = tf.bfloat16.as_numpy_dtype
    values = np.arange(0x3F00, 0x4700, 7, dtype=np.uint16).view(bfloat16)  # 0.5 to ~32768
    scale = np.float32(0.3)
    w = keras.Variable(np.zeros(values.shape), dtype="bfloat16", name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.FixedLossScale(0.3))
    tf.function(lambda g: opt.apply([g], [w]))(tf.constant(values))
    got = -np.asarray(w.numpy(), np.float64)
    for value, mine in zip(values, got):
        exact = Fraction(float(value)) / Fraction(float(scale))
        below = bfloat16(float(np.float32(float(exact))))
        candidates = [below, np.nextafter(below, bfloat16(0)), np.nextafter(below, bfloat16(1e38))]
        best = min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact),
                                              int(np.array(v).view(np.uint16)) & 1))
        assert float(best) == mine, (value, mine, float(best))


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_restored_scale_below_the_minimum_is_read_at_the_minimum(mode):
    """A checkpoint of a scale allowed below 1 restored into one that is not: the
    check still reads the scaled gradients, so the scale in use must stay >= 1."""
    w = keras.Variable(np.zeros(3, "float16"), dtype="float16", name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1e-3), tfdls.DynamicLossScale(1024.0))
    opt.build([w])
    opt.loss_scale.current_loss_scale.assign(0.25)  # as that restore would
    assert float(opt.loss_scale().numpy()) == 1.0 and opt.step_plan is None
    _wrap(lambda g: opt.apply([g], [w]), mode)(tf.constant([60000.0, 1.0, 1.0], tf.float16))
    # 60000 / 1 is finite: applied, not an Inf written past the check.
    assert np.all(np.isfinite(w.numpy().astype(np.float64)))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0


# (written value, DynamicLossScale keyword arguments, the scale it must be read as)
_FOREIGN_NONFINITE = [
    (float("inf"), {}, 2.0**127),  # the largest float32 power of two
    (-float("inf"), {}, 1.0),  # below the minimum
    (float("nan"), {}, 1024.0),  # the initial scale
    (-float("nan"), {}, 1024.0),
    (float("inf"), {"max_loss_scale": 2.0**20}, 2.0**20),
    (float("inf"), {"multiplier": 1.5}, float(np.finfo(np.float32).max)),  # not powers of two
    (float("nan"), {"multiplier": 1.5}, 1024.0),
]


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
@pytest.mark.parametrize("written, kwargs, read", _FOREIGN_NONFINITE,
                         ids=["inf", "-inf", "nan", "-nan", "inf-max", "inf-1.5", "nan-1.5"])
def test_a_written_nonfinite_scale_is_read_finite_and_training_goes_on(written, kwargs, read,
                                                                       mode):
    """Inf or NaN written into the scale's variable (an assignment, a checkpoint written
    elsewhere) is read as the class docstring says the scale always is: finite, within
    the bounds (inf at the maximum, the largest float32 without one; NaN as the initial
    scale, as the `.keras` loader reads it), and the steps after it apply and divide by it."""
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    ls = tfdls.DynamicLossScale(1024.0, increment_period=10**6, **kwargs)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), ls)
    opt.build([w])
    ls.current_loss_scale.assign(written)
    assert float(_wrap(ls, mode)().numpy()) == read

    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(w) * 2.0**-100)
        opt.apply(tape.gradient(loss, [w]), [w])

    step = _wrap(step, mode)
    for i in range(3):
        step()
        # d loss / dw = 2**-100: scaled by `read` (finite in float32) and divided back.
        np.testing.assert_array_equal(w.numpy(), np.float32(-(i + 1) * 2.0**-100))
    assert int(ls.num_skipped_steps.numpy()) == 0
    assert float(ls().numpy()) == read
