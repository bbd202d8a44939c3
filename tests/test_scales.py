"""The applied update is right at every scale a DynamicLossScale can reach.

Scaled gradients are divided by the scale, never multiplied by its
reciprocal: above 2**126 the reciprocal is subnormal and CPU kernels flush it
to zero, which used to zero every update. Each test compares the update with
the bare inner optimizer fed the true gradients.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfdls
from fast_loop import slow_except

LR = 0.25
MODES = ["eager", "function", "xla"]


class _Pair:
    """A tfdls SGD and a bare SGD on equal variables, with traced steps."""

    def __init__(self, mode, min_loss_scale=2.0**-126):
        self.w = keras.Variable(np.zeros(4, "float32"), name="w")
        self.bare_w = keras.Variable(np.zeros(4, "float32"), name="w")
        self.opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(LR),
            tfdls.DynamicLossScale(1.0, increment_period=10**9, min_loss_scale=min_loss_scale),
        )
        self.bare = keras.optimizers.SGD(LR)
        step = lambda g: self.opt.apply([g], [self.w])  # noqa: E731
        bare_step = lambda g: self.bare.apply([g], [self.bare_w])  # noqa: E731
        if mode != "eager":
            step = tf.function(step, jit_compile=mode == "xla")
            bare_step = tf.function(bare_step, jit_compile=mode == "xla")
        self.step, self.bare_step = step, bare_step

    def run(self, scale, true):
        """One step at `scale` on scaled `true` gradients; returns both updates."""
        self.opt.loss_scale.current_loss_scale.assign(scale)
        start = np.zeros(4, "float32")  # so that the update is exactly -lr * g
        self.w.assign(start)
        self.bare_w.assign(start)
        scaled = np.asarray(true, np.float64) * scale
        assert np.all(np.isfinite(scaled.astype(np.float32)))
        self.step(tf.constant(scaled.astype(np.float32)))
        self.bare_step(tf.constant(np.asarray(true, np.float32)))
        assert int(self.opt.loss_scale.num_skipped_steps.numpy()) == 0
        return self.w.numpy() - start, self.bare_w.numpy() - start


_PAIRS = {}


def _pair(mode):
    if mode not in _PAIRS:
        _PAIRS[mode] = _Pair(mode)
    return _PAIRS[mode]


@st.composite
def _scale_and_gradients(draw):
    # A power-of-two scale anywhere in float32's normal range, and true
    # gradients whose scaled values are normal floats too (what loss scaling
    # is for), so that dividing back is exact.
    k = draw(st.integers(-126, 127))
    low, high = max(-60, -100 - k), min(60, 100 - k)
    exponents = draw(st.lists(st.integers(low, high), min_size=4, max_size=4))
    mantissas = draw(st.lists(st.floats(1.0, 2.0, exclude_max=True), min_size=4, max_size=4))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=4, max_size=4))
    true = [np.float32(s * m * 2.0**e) for s, m, e in zip(signs, mantissas, exponents)]
    return 2.0**k, true


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
@settings(max_examples=60, deadline=None)
@given(case=_scale_and_gradients())
def test_power_of_two_scales_give_the_bare_update_bit_for_bit(mode, case):
    scale, true = case
    mine, bare = _pair(mode).run(np.float32(scale), true)
    np.testing.assert_array_equal(mine, bare)


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
@settings(max_examples=30, deadline=None)
@given(
    scale=st.floats(2.0**-126, 2.0**127.9, allow_nan=False),
    true=st.lists(st.floats(-4.0, 4.0).filter(lambda v: abs(v) > 1e-3), min_size=4, max_size=4),
)
def test_any_scale_gives_the_bare_update_within_rounding(mode, scale, true):
    scale = np.float32(scale)
    scaled = (np.asarray(true, np.float64) * scale).astype(np.float32)
    if not np.all(np.isfinite(scaled)) or np.any(np.abs(scaled) < np.finfo(np.float32).tiny):
        return  # the scaled gradient itself is out of float32's normal range
    mine, bare = _pair(mode).run(scale, true)
    # Scaling rounds once and dividing once: two float32 roundings.
    np.testing.assert_allclose(mine, bare, rtol=3e-7, atol=1e-30)


@pytest.mark.parametrize("mode", slow_except(MODES, ["xla"]))
def test_growth_to_the_cap_keeps_training(mode):
    """Tiny gradients let the scale double up to 2**127; every step still trains."""
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**125, increment_period=1)
    )

    def step():
        opt.apply([tf.constant([1.0, -0.5]) * opt.loss_scale()], [w])

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
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
