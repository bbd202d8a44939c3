"""Property tests (hypothesis): DynamicLossScale vs a plain-Python model of
its documented contract, and all_finite vs NumPy."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tfdls
from tests.support.contract_model import ContractModel

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32

SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Every example of the traced modes costs a trace/compile: report the first
# failing example (the assertion message has all details) without shrinking.
NO_SHRINK = dict(SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate])




@st.composite
def loss_scale_args(draw):
    # Normal float32 numbers only: subnormals are flushed to zero by TF's CPU
    # kernels (covered separately in test_loss_scale.py).
    min_scale = draw(
        st.one_of(
            st.sampled_from([1.0, 1e-20, 1e-30, 0.5]),
            st.floats(-30, 3).map(lambda e: float(F32(10.0**e))),
        )
    )
    max_scale = draw(
        st.one_of(
            st.none(),
            st.floats(0, 8).map(lambda e: float(F32(min_scale * 10.0**e))),
            st.just(F32_MAX),
        )
    )
    upper = F32_MAX if max_scale is None else max_scale
    initial = draw(
        st.one_of(
            st.floats(min_scale, upper, allow_nan=False, allow_infinity=False),
            st.sampled_from([min_scale, upper]),
        )
    )
    multiplier = draw(
        st.one_of(st.sampled_from([2.0, 1.5, 3.0, 10.0]), st.floats(1.0625, 16.0))
    )
    backoff = draw(st.one_of(st.none(), st.sampled_from([0.5, 0.1]), st.floats(0.01, 0.99)))
    return dict(
        initial_loss_scale=initial,
        increment_period=draw(st.integers(1, 5)),
        multiplier=multiplier,
        backoff_factor=backoff,
        min_loss_scale=min_scale,
        max_loss_scale=max_scale,
        hysteresis=draw(st.integers(1, 4)),
    )


# Runs of finite / non-finite steps, so that growth, caps, clamps at the
# minimum and hysteresis all get exercised.
decision_sequences = st.lists(
    st.tuples(st.booleans(), st.integers(1, 10)), min_size=2, max_size=12
).map(lambda runs: [finite for finite, length in runs for _ in range(length)])
BAD_VALUES = (np.nan, np.inf, -np.inf)


def _state(ls):
    return (
        F32(ls.current_loss_scale.numpy()).tobytes(),
        int(ls.num_good_steps.numpy()),
        int(ls.hysteresis_budget.numpy()),
        int(ls.num_skipped_steps.numpy()),
        int(ls.steps_since_overflow.numpy()),
    )


def _check_against_model(kwargs, decisions, mode):
    ls = tfdls.DynamicLossScale(**kwargs)
    model = ContractModel(**kwargs)

    def update(g):
        return ls.update([g, None])[1]

    if mode != "eager":
        # One trace per object: the gradient is an input of fixed signature.
        update = tf.function(
            update,
            input_signature=[tf.TensorSpec([3], tf.float32)],
            jit_compile=mode == "xla",
        )
    lo = F32(kwargs["min_loss_scale"])
    hi = None if kwargs["max_loss_scale"] is None else F32(kwargs["max_loss_scale"])
    assert _state(ls) == model.state()
    for i, finite in enumerate(decisions):
        g = np.array([1.0, -2.0, 3.0], np.float32)
        if not finite:
            g[i % 3] = BAD_VALUES[i % 3]
        should_apply = update(tf.constant(g))
        model.step(finite)
        where = f"{mode} step {i} {kwargs}"
        assert bool(should_apply.numpy()) == finite, where
        got = _state(ls)
        assert got == model.state(), (
            f"{where}: scale {np.frombuffer(got[0], np.float32)[0]!r} vs {model.s!r}; "
            f"{got[1:]} vs {model.state()[1:]}"
        )
        s = F32(ls().numpy())
        assert np.isfinite(s) and s > 0, where
        assert s >= lo, where
        if hi is not None:
            assert s <= hi, where
    if mode == "function":
        assert update.experimental_get_tracing_count() == 1


@pytest.mark.slow
@settings(max_examples=35, **SETTINGS)
@given(kwargs=loss_scale_args(), decisions=decision_sequences)
def test_dynamic_loss_scale_matches_model_eager(kwargs, decisions):
    _check_against_model(kwargs, decisions, "eager")


@pytest.mark.slow
@settings(max_examples=30, **NO_SHRINK)
@given(kwargs=loss_scale_args(), decisions=decision_sequences)
def test_dynamic_loss_scale_matches_model_function(kwargs, decisions):
    _check_against_model(kwargs, decisions, "function")


@pytest.mark.slow
@settings(max_examples=12, **NO_SHRINK)
@given(kwargs=loss_scale_args(), decisions=decision_sequences)
def test_dynamic_loss_scale_matches_model_xla(kwargs, decisions):
    _check_against_model(kwargs, decisions, "xla")


# --------------------------------------------------------------------------
# all_finite vs NumPy.
# --------------------------------------------------------------------------
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


@st.composite
def gradient_leaf(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    size = int(np.prod(shape)) if shape else 1
    magnitude = draw(st.sampled_from([1.0, 1e4, 6e4, 1e30, 3e38, 1e300]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    values = rng.uniform(-1, 1, size) * magnitude
    n_bad = draw(st.sampled_from([0, 0, 1, 2]))
    for _ in range(n_bad):
        values[rng.integers(size)] = draw(st.sampled_from(BAD_VALUES))
    # NumPy does the conversion (huge values may legitimately become inf in
    # narrow dtypes); the NumPy reference is computed on the converted values.
    with np.errstate(over="ignore"):
        array = values.astype(dtype.as_numpy_dtype).reshape(shape)
    tensor = tf.constant(array)
    if shape and draw(st.booleans()):
        # As IndexedSlices: only `values` carry numbers.
        indices = tf.constant(np.arange(shape[0]) * 2, tf.int64)
        dense_shape = tf.constant([shape[0] * 2] + shape[1:], tf.int64)
        tensor = tf.IndexedSlices(tensor, indices, dense_shape)
    finite = bool(np.all(np.isfinite(array.astype(np.float64))))
    return tensor, finite


@st.composite
def gradient_nest(draw):
    leaves = draw(st.lists(st.one_of(gradient_leaf(), st.none()), min_size=0, max_size=6))
    expected = all(leaf[1] for leaf in leaves if leaf is not None)
    tensors = [None if leaf is None else leaf[0] for leaf in leaves]
    shape = draw(st.sampled_from(["list", "dict", "nested"]))
    if shape == "list":
        nest = tensors
    elif shape == "dict":
        nest = {f"v{i}": t for i, t in enumerate(tensors)}
    else:
        half = len(tensors) // 2
        nest = {"a": tuple(tensors[:half]), "b": {"c": tensors[half:], "d": None}}
    return nest, expected


@settings(max_examples=40, **SETTINGS)
@given(case=gradient_nest())
def test_all_finite_matches_numpy(case):
    nest, expected = case
    result = tfdls.all_finite(nest)
    assert result.dtype == tf.bool and result.shape == ()
    assert bool(result.numpy()) == expected


@settings(max_examples=15, **SETTINGS)
@given(case=gradient_nest())
def test_all_finite_matches_numpy_in_function(case):
    nest, expected = case
    result = tf.function(lambda n: tfdls.all_finite(n))(nest)
    assert bool(result.numpy()) == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_all_finite_every_position(dtype):
    """Exhaustive over positions: a single NaN/Inf anywhere is found."""
    check = tf.function(tfdls.all_finite, input_signature=[tf.TensorSpec([7, 5], dtype)])
    base = np.linspace(-1, 1, 35).astype(dtype.as_numpy_dtype).reshape(7, 5)
    assert bool(check(tf.constant(base)).numpy()) is True
    for position in range(35):
        for bad in BAD_VALUES:
            planted = base.copy()
            planted.flat[position] = bad
            assert bool(check(tf.constant(planted)).numpy()) is False, (position, bad)
