"""Sums the inner optimizer forms of finite gradients: the rows of one index, the window.

Every divided gradient can be finite and a sum the update forms of it Inf:
the rows of a `tf.IndexedSlices` gradient that share an index are added by
the update (a scatter-add, or the dense gradient's segment sum), and
``gradient_accumulation_steps`` adds each micro-batch to the window's
accumulator. The rule (`tfdls.finite.sums_may_overflow`): a step applies only
if those sums cannot overflow; otherwise it is skipped exactly, like a
non-finite gradient. (The replicas' sum is tested in
distribution/test_optimizer_mirrored.py.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

F16_MAX = 65504.0
F16_ROUNDING = 2.0**-11


def state(opt, variables):
    return ([np.array(v.numpy()) for v in variables]
            + [np.array(v.numpy()) for v in opt.inner_optimizer.variables]
            + [opt.iterations.numpy()])


def assert_same_bits(before, after):
    for a, b in zip(before, after):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


def sparse_setup(run_mode, rows=8, width=2):
    table = keras.Variable(np.zeros([rows, width], np.float16), dtype="float16", name="table")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0))
    opt.build([table])

    @run_mode
    def step(values, indices):
        opt.apply([tf.IndexedSlices(values, indices, tf.constant([rows, width]))], [table])

    return table, opt, step


def test_rows_of_one_index_that_could_overflow_skip_the_step(run_mode):
    table, opt, step = sparse_setup(run_mode)
    step(tf.constant([[1.0, 2.0]], tf.float16), tf.constant([0]))
    before = state(opt, [table])
    # Each row finite; rows 3 add up to 80000 > 65504 (the update gave -inf before).
    step(tf.constant([[40000.0, 1.0], [40000.0, 1.0], [1.0, 1.0]], tf.float16),
         tf.constant([3, 3, 5]))
    assert_same_bits(before, state(opt, [table]))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1
    # A sum veto is reported by min_scale_policy at any scale (the scale stays).
    with pytest.warns(RuntimeWarning, match="whose sums could overflow for"):
        report = opt.last_overflow()
    assert (report.variable_names, report.sum_overflow_names) == ((), ("table",))
    assert f"sums of finite gradients could overflow for table;" in str(report)
    # Rows that fit once added are applied, as the bare optimizer applies them.
    step(tf.constant([[30000.0, 1.0], [30000.0, 1.0], [1.0, 1.0]], tf.float16),
         tf.constant([3, 3, 5]))
    np.testing.assert_array_equal(table.numpy()[3], [-60000.0, -2.0])
    np.testing.assert_array_equal(table.numpy()[5], [-1.0, -1.0])
    np.testing.assert_array_equal(table.numpy()[0], [-1.0, -2.0])
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1


def test_a_sum_veto_leaves_the_loss_scale(run_mode):
    """A lower scale cannot change a sum of divided gradients: a step skipped for a sum
    alone keeps the scale (and counts as skipped, resetting the good steps); a
    non-finite gradient still lowers it."""
    table = keras.Variable(np.zeros([4, 2], np.float16), dtype="float16", name="table")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0),
        tfdls.DynamicLossScale(0.5, increment_period=2, min_loss_scale=2.0**-4),
        min_scale_policy="ignore")
    opt.build([table])

    @run_mode
    def step(values, indices):
        opt.apply([tf.IndexedSlices(values, indices, tf.constant([4, 2]))], [table])

    step(tf.constant([[1.0, 1.0]], tf.float16), tf.constant([0]))  # one good step
    before = state(opt, [table])
    # Scaled rows of 20000, divided by 0.5: two rows of 40000 at index 1 sum past 65504.
    step(tf.constant([[20000.0, 1.0], [20000.0, 1.0]], tf.float16), tf.constant([1, 1]))
    assert_same_bits(before, state(opt, [table]))
    assert float(opt.loss_scale()) == 0.5
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1
    assert int(opt.loss_scale.num_good_steps.numpy()) == 0
    assert opt.last_overflow().sum_overflow_names == ("table",)
    step(tf.constant([[float("inf"), 1.0]], tf.float16), tf.constant([2]))
    assert float(opt.loss_scale()) == 0.25


def test_a_single_row_at_the_largest_value_is_applied(run_mode):
    # One row per index is never reported, however large (no addition).
    table, opt, step = sparse_setup(run_mode)
    step(tf.constant([[F16_MAX, -F16_MAX], [F16_MAX, 1.0]], tf.float16), tf.constant([2, 6]))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    np.testing.assert_array_equal(table.numpy()[2], [-F16_MAX, F16_MAX])
    np.testing.assert_array_equal(table.numpy()[6], [-F16_MAX, -1.0])


def reference_may_overflow(values, indices):
    """The rule, in plain Python: per index, the sum of the rows' largest magnitudes, grown by
    one rounding per addition, against the largest value (the largest such sum, with the most
    rows one index has)."""
    sums, counts = {}, {}
    for row, index in zip(values, indices):
        sums[index] = sums.get(index, 0.0) + float(np.max(np.abs(row.astype(np.float64))))
        counts[index] = counts.get(index, 0) + 1
    most = max(counts.values())
    return max(sums.values()) * (1.0 + F16_ROUNDING) ** (most - 1) > F16_MAX


def test_shared_index_sums_follow_the_rule(run_mode):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, strategies as st

    rows, width, count = 4, 2, 4
    table, opt, step = sparse_setup(run_mode, rows, width)
    magnitudes = st.sampled_from([0.0, 1.0, 3.0, 1000.0, 16384.0, 30000.0, 32752.0, 32768.0,
                                  40000.0, 65504.0])
    signs = st.sampled_from([1.0, -1.0])

    @hypothesis.settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(0, rows - 1), min_size=count, max_size=count),
           st.lists(st.tuples(magnitudes, signs), min_size=count * width,
                    max_size=count * width))
    def check(indices, drawn):
        values = np.array([m * s for m, s in drawn], np.float16).reshape(count, width)
        table.assign(np.zeros([rows, width], np.float16))
        before = state(opt, [table])
        skipped = int(opt.loss_scale.num_skipped_steps.numpy())
        step(tf.constant(values), tf.constant(indices))
        after = table.numpy()
        # Never a non-finite weight; skipped exactly when the rule says so.
        assert np.all(np.isfinite(after))
        may_overflow = reference_may_overflow(values, indices)
        assert int(opt.loss_scale.num_skipped_steps.numpy()) - skipped == int(may_overflow)
        if may_overflow:
            assert_same_bits(before, state(opt, [table]))
            return
        # Applied: the float64 sum of the rows, within one float16 rounding per addition of
        # the partial sums (bounded by the sum of the magnitudes), in whatever order.
        want, magnitude = np.zeros([rows, width]), np.zeros([rows, width])
        for row, index in zip(values.astype(np.float64), indices):
            want[index] -= row
            magnitude[index] += np.abs(row)
        error = np.abs(after.astype(np.float64) - want)
        assert np.all(error <= count * F16_ROUNDING * magnitude), (after, want)

    check()


@pytest.mark.parametrize("sparse", [False, True])
def test_a_window_that_would_overflow_drops_the_micro_batch(run_mode, sparse):
    v = keras.Variable(np.zeros([4], np.float16), dtype="float16", name="v")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2),
                                   tfdls.DynamicLossScale(1.0))
    opt.build([v])

    @run_mode
    def step(x):
        g = tf.fill([4], x)
        if sparse:
            g = tf.IndexedSlices(g[:2], tf.constant([0, 1]), tf.constant([4]))
        opt.apply([g], [v])

    step(tf.constant(40000.0, tf.float16))  # accumulated: 40000
    before = state(opt, [v])
    step(tf.constant(40000.0, tf.float16))  # 40000 + 40000 = Inf: dropped (was -inf weights)
    assert_same_bits(before, state(opt, [v]))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1
    # A sum veto is reported by min_scale_policy at any scale (the scale stays).
    with pytest.warns(RuntimeWarning, match="whose sums could overflow for"):
        report = opt.last_overflow()
    assert (report.variable_names, report.sum_overflow_names) == ((), ("v",))
    assert f"sums of finite gradients could overflow for v;" in str(report)
    step(tf.constant(1.0, tf.float16))  # closes the window: (40000 + 1) / 2 in float16
    reached = 2 if sparse else 4
    want = np.zeros([4], np.float16)
    want[:reached] = -np.float16(np.float16(40001.0) / np.float16(2.0))
    np.testing.assert_array_equal(v.numpy(), want)
    accumulator = opt.inner_optimizer._accumulated_gradients[0].numpy()
    np.testing.assert_array_equal(accumulator, np.zeros([4], np.float16))


def test_sum_bounds_of_dense_and_sparse_gradients():
    dense = tf.constant([[1.0, -7.0]], tf.float16)
    rows = tf.IndexedSlices(tf.constant([[1.0, -2.0], [3.0, 0.5], [-4.0, 1.0], [0.0, 0.0]]),
                            tf.constant([2, 0, 2, 2]), tf.constant([3, 2]))
    empty = tf.IndexedSlices(tf.zeros([0, 2]), tf.zeros([0], tf.int32), tf.constant([3, 2]))
    bounds, terms = tfdls.finite.sum_bounds([dense, rows, empty])
    # Index 2: rows 0, 2, 3 -> 2 + 4 + 0; index 0: 3.
    np.testing.assert_array_equal(bounds.numpy(), [7.0, 6.0, 0.0])
    np.testing.assert_array_equal(terms.numpy(), [1.0, 3.0, 1.0])


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"),
                    reason="this Keras has no MultiOptimizer (added after 3.9)")
def test_a_multi_optimizer_window_that_would_overflow_drops_the_micro_batch(run_mode):
    # The accumulators belong to the sub-optimizer updating each variable.
    a = keras.Variable(np.zeros([2], np.float16), dtype="float16", name="a")
    b = keras.Variable(np.zeros([2], np.float16), dtype="float16", name="b")
    optimizer_map = keras.optimizers.OptimizerMap(keras.optimizers.SGD(1.0))
    optimizer_map["b"] = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    opt = tfdls.LossScaleOptimizer(keras.optimizers.MultiOptimizer(optimizer_map),
                                   tfdls.DynamicLossScale(1.0))
    opt.build([a, b])

    @run_mode
    def step(x):
        opt.apply([tf.fill([2], tf.constant(1.0, tf.float16)), tf.fill([2], x)], [a, b])

    step(tf.constant(40000.0, tf.float16))
    before = state(opt, [a, b])
    step(tf.constant(40000.0, tf.float16))  # b's window: 40000 + 40000 = Inf
    assert_same_bits(before, state(opt, [a, b]))
    # A sum veto is reported by min_scale_policy at any scale (the scale stays).
    with pytest.warns(RuntimeWarning, match="whose sums could overflow for"):
        report = opt.last_overflow()
    assert (report.variable_names, report.sum_overflow_names) == ((), ("b",))
    assert f"sums of finite gradients could overflow for b;" in str(report)
    step(tf.constant(1.0, tf.float16))
    np.testing.assert_array_equal(a.numpy(), [-2.0, -2.0])
    np.testing.assert_array_equal(b.numpy(), np.full([2], -np.float16(np.float16(40001.0) / 2)))


@pytest.mark.parametrize("dtype, rows", [("float16", 2049), ("float16", 20000), ("bfloat16", 300)])
def test_many_zero_rows_at_one_index_are_applied(run_mode, dtype, rows):
    # A padding id repeated all over a batch: its rows are zero, no sum can overflow (the
    # limit once fell to 0 and below at 2049 float16 rows, and every step was skipped).
    table = keras.Variable(np.zeros([4, 2]), dtype=dtype, name="table")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0))
    opt.build([table])

    @run_mode
    def step(values, indices):
        opt.apply([tf.IndexedSlices(values, indices, tf.constant([4, 2]))], [table])

    values = np.zeros([rows + 1, 2], np.float32)
    values[-1] = [1.0, 2.0]
    indices = np.zeros([rows + 1], np.int32)
    indices[-1] = 3
    step(tf.constant(values, dtype), tf.constant(indices))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    np.testing.assert_array_equal(table.numpy().astype(np.float32)[3], [-1.0, -2.0])


def test_accumulation_of_an_overwritten_variable_keeps_the_maximum(run_mode):
    # Keras keeps the micro-batches' maximum for overwrite_with_gradient variables: no sum.
    # (With a second, ordinary variable: Keras 3.9 refuses a step whose only variables are
    # overwritten.)
    w = keras.Variable(np.zeros([2], np.float16), dtype="float16", name="w")
    w.overwrite_with_gradient = True
    u = keras.Variable(np.zeros([2], np.float16), dtype="float16", name="u")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2),
                                   tfdls.DynamicLossScale(1.0))
    opt.build([w, u])

    @run_mode
    def step(g):
        opt.apply([g, tf.ones([2], tf.float16)], [w, u])

    step(tf.constant([60000.0, 1.0], tf.float16))
    step(tf.constant([60000.0, 0.5], tf.float16))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    np.testing.assert_array_equal(w.numpy(), [60000.0, 1.0])
    np.testing.assert_array_equal(u.numpy(), [-1.0, -1.0])


def test_report_keeps_non_finite_gradients_and_overflowing_sums_apart(run_mode):
    # One step, both causes: a NaN gradient for `bad`, finite rows of `table`
    # that could overflow once added. The next skip has a NaN only: the sums'
    # record of the earlier step must not show up in its report.
    table = keras.Variable(np.zeros([4, 2], np.float16), name="table")
    bad = keras.Variable(np.zeros([2], np.float16), name="bad")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0))
    opt.build([table, bad])

    def apply(rows, indices, other):
        opt.apply([tf.IndexedSlices(rows, indices, tf.constant([4, 2])), other], [table, bad])

    step = run_mode(apply)
    big = tf.constant([[40000.0, 1.0], [40000.0, 1.0]], tf.float16)
    small = tf.constant([[1.0, 1.0], [1.0, 1.0]], tf.float16)
    nan = tf.constant([float("nan"), 1.0], tf.float16)
    finite = tf.constant([1.0, 1.0], tf.float16)
    step(big, tf.constant([2, 2]), nan)
    # A sum veto is reported by min_scale_policy at any scale (the scale stays).
    with pytest.warns(RuntimeWarning, match="whose sums could overflow for"):
        report = opt.last_overflow()
    assert (report.variable_names, report.sum_overflow_names) == (("bad",), ("table",))
    assert "non-finite gradients for bad; sums of finite gradients could overflow for table;" \
        in str(report)
    step(small, tf.constant([2, 2]), finite)  # applies
    step(small, tf.constant([2, 2]), nan)
    report = opt.last_overflow()
    assert (report.step, report.variable_names, report.sum_overflow_names) == (2, ("bad",), ())


def test_stuck_warning_names_a_variable_whose_sums_could_overflow():
    table = keras.Variable(np.zeros([4, 2], np.float16), name="table")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                   tfdls.DynamicLossScale(1.0, min_loss_scale=1.0),
                                   min_scale_policy="raise")
    opt.build([table])
    rows = tf.constant([[40000.0, 1.0], [40000.0, 1.0]], tf.float16)
    opt.apply([tf.IndexedSlices(rows, tf.constant([1, 1]), tf.constant([4, 2]))], [table])
    with pytest.raises(tfdls.LossScaleStuckError,
                       match=r"still produced finite gradients whose sums could overflow for: "
                             r"table\. ") as stuck:
        opt.check_min_scale_policy()
    assert "non-finite" not in str(stuck.value)
    assert "diverging" not in str(stuck.value)


def test_stuck_warning_keeps_non_finite_gradients_and_overflowing_sums_apart():
    table = keras.Variable(np.zeros([4, 2], np.float16), name="table")
    bad = keras.Variable(np.zeros([2], np.float16), name="bad")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                   tfdls.DynamicLossScale(1.0, min_loss_scale=1.0),
                                   min_scale_policy="raise")
    opt.build([table, bad])
    rows = tf.constant([[40000.0, 1.0], [40000.0, 1.0]], tf.float16)
    opt.apply([tf.IndexedSlices(rows, tf.constant([1, 1]), tf.constant([4, 2])),
               tf.constant([float("nan"), 1.0], tf.float16)], [table, bad])
    with pytest.raises(tfdls.LossScaleStuckError,
                       match=r"step 0 still produced non-finite gradients for: bad; and finite "
                             r"gradients whose sums could overflow for: table\. Lowering the "
                             r"scale cannot fix this: the model is likely diverging .*; sums of "
                             r"finite gradients overflow those variables' dtype"):
        opt.check_min_scale_policy()
