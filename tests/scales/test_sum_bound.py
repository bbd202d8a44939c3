"""The sum guard's bound (`tfdls.finite.sums_may_overflow`): safe, and tight for many rows.

The lemma behind it: rounding to nearest, ``fl(a + b)`` is no farther from ``a + b``
than the representable ``a`` is, so ``|fl(a + b)| <= |a| + 2|b|``, and adding terms one
at a time, in any order, keeps every partial sum within ``|x_1| + 2 * sum_{i>1} |x_i|``
(at most twice the sum of the magnitudes). Checked here on drawn float16, bfloat16 and
float32 sums, worst cases included (every term a hair above half an ulp of the running
sum, so that each addition rounds up by nearly twice the term); then the rule built on
it: whenever it says no sum can overflow, TensorFlow's sums of those rows are finite,
and it decides as its docstring writes (many tiny rows at one index, a padding id, are
applied; the old ``(1 + u)**(n - 1)`` growth alone skipped them forever).
"""

import math

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings, strategies as st

from tfdls import finite

DTYPES = [tf.float16, tf.bfloat16, tf.float32]
# Exact integers: every float16, bfloat16 and float32 value is a multiple of 2**-149.
SCALE = 2.0**160


def _info(dtype):
    info = ml_dtypes.finfo(dtype.as_numpy_dtype)
    return float(info.max), info.nmant + 1, float(info.smallest_normal)


def _exact(values):
    """Python integers: `values` (finite, float16/bfloat16/float32) times 2**160, exactly."""
    return [int(v) for v in (np.asarray(values).astype(np.float64) * SCALE)]


def _partial_sums(values):
    """Left-to-right sums in the values' own dtype, each addition rounded (NumPy's
    accumulate rounds every step to the dtype, as a loop of scalar additions does)."""
    values = np.asarray(values)
    with np.errstate(over="ignore", invalid="ignore"):
        if values.dtype != tf.bfloat16.as_numpy_dtype:
            return np.add.accumulate(values)
        # bfloat16: one scalar addition at a time (the oldest supported pair's
        # ml_dtypes, 0.3, segfaults in np.add.accumulate over bfloat16).
        sums = np.empty_like(values)
        running = values[0] if values.size else None
        for k, value in enumerate(values):
            running = value if k == 0 else values.dtype.type(running + value)
            sums[k] = running
        return sums


def _make_terms(dtype, n, seed, start_log2, ratchet_share, flip_share, big_share=0.0):
    """Up to n values of `dtype` (the first n, or up to the first overflow of their sum
    one at a time): a start near 2**start_log2 * largest, then terms each either a
    hair above half an ulp of the running sum, with its sign (the worst case: every
    addition rounds up by a whole ulp), a drawn value of a few such ulps, either sign, or
    (big_share) one of up to the start's magnitude."""
    largest, precision, smallest_normal = _info(dtype)
    np_type = dtype.as_numpy_dtype
    rng = np.random.default_rng(seed)
    values = np.zeros([n], np_type)
    values[0] = np_type(largest * 2.0**start_log2 * rng.uniform(0.5, 1.0))
    running = float(values[0])
    for k in range(1, n):
        if running != 0.0:
            ulp = 2.0 ** (math.floor(math.log2(abs(running))) - (precision - 1))
        else:
            ulp = 2.0 ** (math.floor(math.log2(largest)) - (precision - 1))
        sign = math.copysign(1.0, running) if running != 0.0 else 1.0
        if rng.uniform() < big_share:
            term = rng.uniform(-1.0, 1.0) * float(values[0])
        elif rng.uniform() < ratchet_share:
            # The next value above half an ulp (half an ulp is a power of two).
            term = sign * ulp / 2 * (1.0 + 2.0 ** (1 - precision))
        else:
            term = rng.uniform(-4.0, 4.0) * ulp
            if rng.uniform() < flip_share:
                term = -sign * abs(term) * rng.uniform(0.0, 64.0)
        term = float(np_type(term))
        if abs(term) < smallest_normal:
            term = 0.0  # CPUs may read subnormals as zeros: keep the bound exact
        values[k] = np_type(term)
        with np.errstate(over="ignore"):
            running = float(np_type(np.float64(running) + term))
        if not math.isfinite(running):
            return values[:k + 1]  # up to the first overflow: the closest cases
    return values


def _terms(dtype):
    return st.builds(
        _make_terms,
        dtype=st.just(dtype),
        n=st.one_of(st.integers(1, 64), st.integers(1000, 5000), st.integers(1, 5000)),
        seed=st.integers(0, 2**32 - 1),
        start_log2=st.integers(-40, 0) if dtype == tf.float32 else st.integers(-8, 0),
        ratchet_share=st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.0]),
        flip_share=st.sampled_from([0.0, 0.01, 0.2]),
        big_share=st.sampled_from([0.0, 0.0, 0.001, 0.01]),
    )


def _check_lemma(values, dtype):
    largest = _info(dtype)[0]
    magnitudes = np.array(_exact(np.abs(values.astype(np.float64))), dtype=object)
    # |x_1| + 2 * (|x_2| + ... + |x_k|), exactly, for every k; and twice the whole sum.
    prefix_bounds = 2 * np.cumsum(magnitudes) - magnitudes[0]
    total_bound = 2 * int(np.sum(magnitudes))
    partial = _partial_sums(values).astype(np.float64)
    finite_partial = np.isfinite(partial)
    exact = np.array(_exact(np.abs(partial[finite_partial])), dtype=object)
    assert np.all(exact <= prefix_bounds[finite_partial])
    assert np.all(prefix_bounds <= total_bound)
    # Overflow needs a sum beyond the largest value: beyond the bound too.
    assert np.all(prefix_bounds[~finite_partial] > largest * SCALE)
    if total_bound <= largest * SCALE:
        assert np.all(finite_partial)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_partial_sums_stay_within_twice_the_magnitudes(dtype, data):
    values = data.draw(_terms(dtype))
    _check_lemma(values, dtype)
    # In any order.
    permutation = data.draw(st.permutations(range(len(values))))
    _check_lemma(values[np.array(permutation, np.int64)], dtype)


def test_worst_case_sums_do_nearly_double():
    # The factor 2 is needed: float16 terms a hair above half an ulp of the running sum
    # make it grow by nearly twice their sum, past the largest value, from rows whose
    # magnitudes add up to well below it.
    values = _make_terms(tf.float16, 4000, 0, -3, 1.0, 0.0)
    partial = _partial_sums(values).astype(np.float64)
    first_inf = int(np.argmax(~np.isfinite(partial)))
    assert first_inf > 0 and not np.isfinite(partial[first_inf])
    magnitudes = np.sum(np.abs(values[:first_inf + 1].astype(np.float64)))
    assert magnitudes < 0.6 * 65504.0
    assert partial[first_inf - 1] > 1.7 * np.sum(np.abs(values[:first_inf].astype(np.float64)))
    rows = tf.IndexedSlices(tf.constant(values[:first_inf + 1, None]),
                            tf.zeros([first_inf + 1], tf.int32), tf.constant([1, 1]))
    assert finite.sums_may_overflow([rows]).numpy().tolist() == [True]


# -- the rule ---------------------------------------------------------------------------


def reference_rule(bound, n, dtype, replicas=1, extra=0):
    """The docstring's rule in plain Python: bound * min((1 + u)**(n - 1),
    2 * (1 + u)**(ceil(log2(n)) + R - 1 + E)) > largest."""
    largest, precision, _ = _info(dtype)
    u = 2.0**-precision
    growth = min((1 + u) ** (n - 1),
                 2 * (1 + u) ** (math.ceil(math.log2(n)) + replicas - 1 + extra))
    return bound * growth > largest, bound * growth / largest


def old_rule(bound, n, dtype):
    """The rule before: bound * (1 + u)**(n - 1) > largest."""
    largest, precision, _ = _info(dtype)
    return bound * (1 + 2.0**-precision) ** (n - 1) > largest


def _padded_to_a_power_of_two(values):
    """`values` at index 0, then zero rows each at its own index up to a power of two of
    rows (fewer shapes for XLA to compile; neither the bound nor the terms change)."""
    n = len(values)
    rows = 1 << max(n - 1, 1).bit_length()
    padded = np.zeros([rows, 1], values.dtype)
    padded[:n, 0] = values
    indices = np.zeros([rows], np.int32)
    indices[n:] = np.arange(1, rows - n + 1)
    return tf.constant(padded), tf.constant(indices), rows - n + 1


_XLA = {}


def _may_overflow_xla(values, indices, dense_rows):
    key = values.dtype
    if key not in _XLA:
        @tf.function(jit_compile=True, input_signature=[
            tf.TensorSpec([None, 1], values.dtype), tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([], tf.int32)])
        def may_overflow(values, indices, dense_rows):
            shape = tf.stack([dense_rows, 1])
            return finite.sums_may_overflow([tf.IndexedSlices(values, indices, shape)])

        _XLA[key] = may_overflow
    return _XLA[key](values, indices, tf.constant(dense_rows))


@tf.function(jit_compile=True, reduce_retracing=True)
def _segment_sum_xla(values, indices):
    return tf.math.unsorted_segment_sum(values, indices, 1)


def _sums_of_one_index(values):
    """The sums an optimizer forms of `values`' rows all at index 0, in their dtype."""
    zeros = tf.zeros([1, 1], values.dtype)
    at_zero = tf.zeros([values.shape[0]], tf.int32)
    return {
        "unsorted_segment_sum": tf.math.unsorted_segment_sum(values, at_zero, 1),
        "unsorted_segment_sum (XLA)": _segment_sum_xla(values, at_zero),
        "tensor_scatter_nd_add": tf.tensor_scatter_nd_add(zeros, at_zero[:, None], values),
        "scatter_add": tf.Variable(zeros).scatter_add(tf.IndexedSlices(values, at_zero)),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_the_rule_lets_through_sum_to_finite_values(dtype, data):
    values = data.draw(_terms(dtype))
    n = len(values)
    padded, indices, dense_rows = _padded_to_a_power_of_two(values)
    rows = tf.IndexedSlices(padded, indices, tf.constant([dense_rows, 1]))
    eager = bool(finite.sums_may_overflow([rows]).numpy()[0])
    assert bool(_may_overflow_xla(padded, indices, dense_rows).numpy()[0]) == eager

    # It decides as the docstring writes (away from the threshold's float64 roundings).
    bound = float(np.sum(np.abs(values.astype(np.float64))))
    want, ratio = reference_rule(bound, n, dtype)
    if abs(ratio - 1.0) > 1e-9:
        assert eager == want, (bound, n, ratio)

    if not eager:
        # Then every sum of the rows is finite: TensorFlow's, and one at a time in the
        # drawn order and in another.
        for name, total in _sums_of_one_index(padded).items():
            assert np.all(np.isfinite(tf.cast(total, tf.float64).numpy())), name
        assert np.all(np.isfinite(_partial_sums(values).astype(np.float64)))
        permutation = np.array(data.draw(st.permutations(range(n))), np.int64)
        assert np.all(np.isfinite(_partial_sums(values[permutation]).astype(np.float64)))


# -- the padding case and cases that must still be reported -----------------------------


def _padding_batch(pad_magnitude):
    """A float16 Embedding gradient of a 256x128 batch (32768 rows of width 8): 30720
    padding ids (index 0, no mask) with rows of at most `pad_magnitude`, the rest at
    drawn ids."""
    rng = np.random.default_rng(7)
    rows, width, padding, vocabulary = 32768, 8, 30720, 5000
    values = rng.normal(0.0, 0.05, [rows, width])
    values[:padding] = rng.uniform(-1.0, 1.0, [padding, width]) * pad_magnitude
    values[:padding, 0] = pad_magnitude  # each padding row's largest magnitude
    indices = rng.integers(1, vocabulary, [rows]).astype(np.int32)
    indices[:padding] = 0
    order = rng.permutation(rows)  # padding scattered over the batch
    return (tf.constant(values[order], tf.float16), tf.constant(indices[order]),
            tf.constant([vocabulary, width]))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
@pytest.mark.parametrize("pad_magnitude", [4.5e-6, 2.0**-13, 1.0])
def test_many_tiny_rows_at_one_index_are_not_reported(jit_compile, pad_magnitude):
    values, indices, shape = _padding_batch(pad_magnitude)

    def check(values, indices):
        rows = tf.IndexedSlices(values, indices, shape)
        return finite.sum_bounds([rows]), finite.sums_may_overflow([rows])

    (bounds, terms), may_overflow = (
        tf.function(check, jit_compile=True) if jit_compile else check)(values, indices)
    bound, n = float(bounds.numpy()[0]), int(terms.numpy()[0])
    assert n == 30720
    # The old rule's growth, (1 + 2**-11)**30719 (about e**15), skipped every such step:
    # its limit was 0.02, and the padding rows alone add 0.14 for 4.5e-6.
    assert old_rule(bound, n, tf.float16)
    assert may_overflow.numpy().tolist() == [False]
    dense = tf.math.unsorted_segment_sum(values, indices, shape[0])
    assert np.all(np.isfinite(dense.numpy()))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
def test_padding_rows_whose_sum_could_overflow_are_reported(jit_compile):
    # The same batch with padding rows of 1.3 (30720 of them: 39936 added, twice that
    # beyond float16's 65504).
    values, indices, shape = _padding_batch(1.3)
    may_overflow = (tf.function(finite.sums_may_overflow, jit_compile=True)
                    if jit_compile else finite.sums_may_overflow)
    assert may_overflow([tf.IndexedSlices(values, indices, shape)]).numpy().tolist() == [True]


def _one_index(values, dtype=tf.float16):
    values = tf.constant(np.asarray(values, np.float64)[:, None], dtype)
    indices = tf.zeros([values.shape[0]], tf.int32)
    return values, indices


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
def test_two_rows_that_overflow_together_are_reported(jit_compile):
    values, indices = _one_index([40000.0, 40000.0])
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.float16(40000.0) + np.float16(40000.0))
    may_overflow = (tf.function(finite.sums_may_overflow, jit_compile=True)
                    if jit_compile else finite.sums_may_overflow)
    rows = tf.IndexedSlices(values, indices, tf.constant([1, 1]))
    assert may_overflow([rows]).numpy().tolist() == [True]


def _f16_near(x, direction):
    """The float16 value next to x (below for direction -1, above for +1), as a float."""
    value = np.float16(x)
    if (float(value) - x) * direction <= 0:
        value = np.nextafter(value, np.float16(direction * np.inf))
    return float(value)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
def test_the_twice_the_sum_limit_decides_for_many_rows(jit_compile):
    # 2048 float16 rows at one index: the (1 + u)**2047 growth (about 2.7) would report
    # any bound above 24100; the limit is 2 * (1 + u)**11 (the lemma, and balanced blocks
    # of at most 2048 rows). Bounds just below and just above it, and 2 * bound just
    # above 65504.
    n = 2048
    _, ratio_per_bound = reference_rule(1.0, n, tf.float16)
    threshold = 1.0 / ratio_per_bound  # the largest bound applied
    common = _f16_near(threshold / n, -1)
    rest = threshold - (n - 1) * common
    cases = {
        "just below": (_f16_near(rest, -1), False),
        "just above": (_f16_near(rest, +1), True),
        "twice the sum just above 65504": (_f16_near(65504.0 / 2 - (n - 1) * common, +1), True),
    }
    may_overflow = (tf.function(finite.sums_may_overflow, jit_compile=True)
                    if jit_compile else finite.sums_may_overflow)
    for name, (last, want) in cases.items():
        values, indices = _one_index([common] * (n - 1) + [last])
        bound = (n - 1) * common + last
        if name == "just below":
            assert old_rule(bound, n, tf.float16)  # the lemma decides, not (1 + u)**(n - 1)
            assert 2 * bound < 65504.0
        rows = tf.IndexedSlices(values, indices, tf.constant([1, 1]))
        assert may_overflow([rows]).numpy().tolist() == [want], name


def test_a_bound_of_zero_is_never_reported_and_nan_or_inf_always():
    zeros, indices = _one_index(np.zeros([100000]))
    nan, _ = _one_index([1.0, float("nan")])
    inf, _ = _one_index([1.0, float("inf")])
    rows = [tf.IndexedSlices(zeros, indices, tf.constant([1, 1])),
            tf.IndexedSlices(nan, indices[:2], tf.constant([1, 1])),
            tf.IndexedSlices(inf, indices[:2], tf.constant([1, 1]))]
    assert finite.sums_may_overflow(rows).numpy().tolist() == [False, True, True]
    assert finite.sums_may_overflow(rows[:1], extra_bounds=[
        tf.constant(0.0, tf.float64)]).numpy().tolist() == [False]


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64],
                         ids=lambda d: d.name)
def test_lone_largest_values_are_never_reported(dtype):
    # No addition, no rounding: one row per index and a dense gradient at the largest
    # finite value apply as they are.
    largest = float(dtype.max)
    rows = tf.IndexedSlices(tf.constant([[largest], [-largest]], dtype), tf.constant([0, 1]),
                            tf.constant([2, 1]))
    dense = tf.constant([largest, -largest], dtype)
    assert finite.sums_may_overflow([rows, dense]).numpy().tolist() == [False, False]


def test_replicas_and_an_accumulator_follow_the_rule(mirrored_strategy):
    # Two replicas, each 2048 float16 rows at one index, and an accumulator term: the
    # limit grows by (1 + u) per replica total and accumulator added after the rows.
    strategy = mirrored_strategy
    n = 2048

    def run(common, extra):
        def replica_fn():
            values, indices = _one_index([common] * n)
            rows = tf.IndexedSlices(values, indices, tf.constant([1, 1]))
            return finite.sums_may_overflow([rows], across_replicas=True,
                                            extra_bounds=[tf.constant(extra, tf.float64)])

        flags = strategy.experimental_local_results(
            tf.function(lambda: strategy.run(replica_fn))())
        decided = {tuple(f.numpy().tolist()) for f in flags}
        assert len(decided) == 1  # the same on every replica
        return decided.pop()[0]

    for common in (3.9, 7.9, 7.97, 8.0, 8.1):
        common = float(np.float16(common))
        extra = 100.0
        bound = 2 * n * common + extra
        want, ratio = reference_rule(bound, 2 * n + 1, tf.float16, replicas=2, extra=1)
        assert abs(ratio - 1.0) > 1e-6
        assert run(common, extra) == want, (common, ratio)
