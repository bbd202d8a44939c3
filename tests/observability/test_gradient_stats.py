"""gradient_stats=True: where the scaled gradients sit in float16's range.

The figures equal a NumPy computation on known gradients (all-zero,
subnormal, near-overflow; float16, bfloat16, float32; IndexedSlices; None) in
eager, graph and XLA, and under MirroredStrategy (the worst replica); a
skipped step keeps the last finite step's figures.
"""

import glob
import math
import warnings
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

NAN = float("nan")
SCALE = 2.0**10


def _reference(scaled):
    """NumPy: (headroom bits, zero fraction, subnormal fraction) of `scaled`."""
    a = np.abs(np.asarray(scaled, np.float64)).ravel()
    largest = a.max() if a.size else 0.0
    headroom = math.inf if largest == 0 else math.log2(65504.0 / largest)
    zero = float(np.mean(a == 0))
    subnormal = float(np.mean((a > 0) & (a < 2.0**-14)))
    return headroom, zero, subnormal


def _assert_stats(stats, scaled):
    headroom, zero, subnormal = _reference(scaled)
    if math.isinf(headroom):
        assert stats.headroom_bits == math.inf
    else:
        assert stats.headroom_bits == pytest.approx(headroom, abs=1e-5)
    assert stats.zero_fraction == pytest.approx(zero, abs=1e-7)
    assert stats.subnormal_fraction == pytest.approx(subnormal, abs=1e-7)


# Scaled gradient values (what the tape gives for a loss scaled by SCALE).
CASES = {
    "all_zero": np.zeros(6),
    "near_overflow": np.array([65000.0, -1.0, 0.5, 0.0, 2.0**-16, -60000.0]),
    "beyond_float16": np.array([1e6, 3.0, 0.0, -2.0, 1.0, 0.25]),  # negative headroom
    "subnormal": np.array([2.0**-20, -2.0**-15, 2.0**-14, 0.0, 1.0, -3.0]),
    "ordinary": np.array([0.75, -1.5, 3.0, 12.0, -0.125, 100.0]),
}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": tf.bfloat16.as_numpy_dtype}


def _runner(mode, fn):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=mode == "xla")


@pytest.mark.parametrize(
    "mode, dtype",
    slow_except(
        [(m, d) for m in ("eager", "graph", "xla") for d in sorted(DTYPES)],
        [("xla", "float16"), ("graph", "bfloat16")],
    ),
)
def test_figures_equal_numpy(mode, dtype):
    np_dtype = DTYPES[dtype]
    names = sorted(CASES)
    if dtype != "float32":  # 1e6 is beyond float16 itself
        names.remove("beyond_float16")
    variables = [keras.Variable(np.zeros(6, "float32"), name=n) for n in names]
    unused = keras.Variable(np.zeros(2, "float32"), name="unused")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1e-30), tfdls.DynamicLossScale(SCALE), gradient_stats=True
    )
    opt.build(variables + [unused])
    grads = [tf.constant(CASES[n].astype(np_dtype)) for n in names]
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['unused'\]"):
        _runner(mode, lambda g: opt.apply(g + [None], variables + [unused]))(grads)
    stats = opt.gradient_stats()
    assert set(stats) == set(names) | {"unused"}
    for n, g in zip(names, grads):
        _assert_stats(stats[n], np.asarray(g.numpy(), np.float64))
    assert math.isnan(stats["unused"].headroom_bits)  # no gradient yet


@pytest.mark.parametrize("mode", slow_except(["eager", "graph", "xla"], ["graph"]))
def test_indexed_slices_cover_the_rows_present(mode):
    table = keras.Variable(np.zeros((5, 2), "float32"), name="table")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), gradient_stats=True)
    values = np.array([[0.0, 2.0**-20], [512.0, 1.0]], "float32")
    grad = tf.IndexedSlices(tf.constant(values), tf.constant([1, 3]), tf.constant([5, 2]))
    _runner(mode, lambda g: opt.apply([g], [table]))(grad)
    _assert_stats(opt.gradient_stats()["table"], values)


@pytest.mark.parametrize("mode", slow_except(["eager", "graph", "xla"], ["xla"]))
def test_a_skipped_step_keeps_the_last_finite_figures(mode):
    w = keras.Variable(np.zeros(4, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), gradient_stats=True)
    step = _runner(mode, lambda g: opt.apply([g], [w]))
    finite = np.array([4096.0, 0.0, 1.0, -2.0], "float32")
    step(tf.constant(finite))
    step(tf.constant([1e5, NAN, 0.0, 0.0]))
    assert int(opt.loss_scale.num_skipped_steps) == 1
    _assert_stats(opt.gradient_stats()["w"], finite)


@pytest.mark.slow
def test_unscaled_gradients_are_scaled_back_for_the_figures():
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(SCALE), gradient_stats=True
    )
    opt.build([w])  # get_unscaled_gradients is traced with no scale_loss before it

    @tf.function
    def step(scaled):
        opt.apply_gradients(zip(opt.get_unscaled_gradients([scaled]), [w]))

    step(tf.constant([2048.0, 2.0**-20]))
    _assert_stats(opt.gradient_stats()["w"], [2048.0, 2.0**-20])


def test_fixed_scale_records_finite_steps_only():
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.0), 8.0, gradient_stats=True)
    opt.apply([tf.constant([8.0, 0.0])], [w])
    opt.apply([tf.constant([NAN, 1.0])], [w])  # a fixed scale applies it, but it is no figure
    _assert_stats(opt.gradient_stats()["w"], [8.0, 0.0])


def test_worst_replica_under_mirrored_strategy(mirrored_strategy):
    with mirrored_strategy.scope():
        w = keras.Variable(np.zeros(4, "float32"), name="w")
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), gradient_stats=True)
        opt.build([w])
    per_replica = [
        np.array([1.0, 0.0, 2.0**-20, 4.0], "float32"),  # more subnormal, less zero
        np.array([30000.0, 0.0, 0.0, 1.0], "float32"),  # less headroom, more zero
    ]

    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.where(tf.equal(replica, 0), per_replica[0], per_replica[1])
        opt.apply([grad], [w])

    tf.function(lambda: mirrored_strategy.run(replica_step))()
    stats = opt.gradient_stats()["w"]
    assert stats.headroom_bits == pytest.approx(math.log2(65504.0 / 30000.0), abs=1e-5)
    assert stats.zero_fraction == 0.5
    assert stats.subnormal_fraction == 0.25


def test_off_by_default_and_asking_is_a_clear_error():
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    opt.apply([tf.ones(2)], [w])
    assert opt._stats is None
    assert not any("gradient_stats" in v.name for v in opt.variables)
    with pytest.raises(ValueError, match="gradient_stats=True"):
        opt.gradient_stats()
    with pytest.raises(TypeError, match="gradient_stats='yes'"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), gradient_stats="yes")


def test_config_round_trip():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), gradient_stats=True)
    assert tfdls.LossScaleOptimizer.from_config(opt.get_config()).record_gradient_stats


def test_overflow_report_and_stuck_warning_quote_the_headroom():
    alpha = keras.Variable(np.zeros(2, "float32"), name="alpha")
    beta = keras.Variable(np.zeros(2, "float32"), name="beta")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.0),
        tfdls.DynamicLossScale(1.0, min_loss_scale=1.0),
        gradient_stats=True,
    )
    opt.apply([tf.constant([52000.0, 1.0]), tf.constant([1.0, 1.0])], [alpha, beta])
    opt.apply([tf.constant([NAN, 1.0]), tf.constant([1.0, 1.0])], [alpha, beta])
    with pytest.warns(RuntimeWarning, match=r"alpha had 0\.3 bits"):
        report = opt.last_overflow()
    assert report.variable_names == ("alpha",)
    assert report.headroom_bits == pytest.approx((math.log2(65504 / 52000),), abs=1e-5)
    assert "headroom on the last finite step: alpha had 0.3 bits" in str(report)


def test_with_no_finite_step_the_report_quotes_no_headroom():
    alpha = keras.Variable(np.zeros(2, "float32"), name="alpha")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), tfdls.DynamicLossScale(1.0, min_loss_scale=1.0),
        gradient_stats=True, min_scale_policy="ignore",
    )
    for _ in range(2):  # NaN in every batch: no finite step at all
        opt.apply([tf.constant([NAN, 1.0])], [alpha])
    text = str(opt.last_overflow())
    assert "nan bits" not in text and "headroom on the last finite step" not in text
    assert "no finite step yet" in text


def _event_scalars(log_dir):
    values = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                values.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return values


def test_monitor_logs_the_worst_variable_and_writes_every_variable(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="d1"), keras.layers.Dense(1, name="d2")]
    )
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.01), gradient_stats=True)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    log_dir = str(tmp_path / "logs")
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[tfdls.LossScaleMonitor(log_dir)]
    )
    stats = opt.gradient_stats()
    assert history.history["min_headroom_bits"][-1] == pytest.approx(
        min(s.headroom_bits for s in stats.values())
    )
    assert history.history["subnormal_fraction"][-1] == max(
        s.subnormal_fraction for s in stats.values()
    )
    scalars = _event_scalars(log_dir)
    for name in stats:
        for key in ("headroom_bits", "zero_fraction", "subnormal_fraction"):
            assert [step for step, _ in scalars[f"gradient_stats/{name}/{key}"]] == [4, 8]
    (kernel,) = [name for name in stats if name.endswith("d1/kernel")]
    assert scalars[f"gradient_stats/{kernel}/headroom_bits"][-1][1] == pytest.approx(
        stats[kernel].headroom_bits
    )


@pytest.mark.parametrize(
    "shape, dtype",
    [((8, 2048), np.float32), ((3, 4096), np.float32), ((64, 64), np.float64), ((5000,), np.float32)],
    ids=str,
)
def test_large_tensors_under_xla_equal_numpy(shape, dtype):
    """Large gradients take the matrix-vector count under XLA on a CPU: still exact."""
    rng = np.random.default_rng(7)
    values = rng.normal(size=shape) * 100.0
    flat = values.reshape(-1)
    flat[rng.random(flat.size) < 0.3] = 0.0  # some rows with many zeros
    flat[rng.random(flat.size) < 0.2] = 2.0**-20 * rng.choice([-1.0, 1.0])
    flat[:2048] = 0.0  # a full row of zeros
    variable = keras.Variable(np.zeros(shape, "float32"), name="v")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.0), gradient_stats=True)
    tf.function(lambda g: opt.apply([g], [variable]), jit_compile=True)(
        tf.constant(values.astype(dtype))
    )
    _assert_stats(opt.gradient_stats()["v"], values.astype(dtype))


def test_xla_on_a_cpu_counts_by_matrix_vector_product(monkeypatch):
    from tfdls import gradient_stats

    calls = []
    original = gradient_stats._counts_by_matvec
    monkeypatch.setattr(
        gradient_stats, "_counts_by_matvec", lambda *a: calls.append(a[2]) or original(*a)
    )
    values = np.zeros((4, 512), "float32")
    values[0, :3] = [2.0**-20, 1.0, 70000.0]
    variable = keras.Variable(np.zeros((4, 512), "float32"), name="v")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.0), gradient_stats=True)
    opt.build([variable])  # so that the step is traced once
    tf.function(lambda g: opt.apply([g], [variable]), jit_compile=True)(tf.constant(values))
    assert calls == [512]
    _assert_stats(opt.gradient_stats()["v"], values)


@pytest.mark.parametrize("mode", slow_except(["eager", "graph", "xla"], ["xla"]))
@pytest.mark.parametrize("shape", [(6,), (4, 512)], ids=["small", "matvec"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_values_below_the_dtypes_normal_range_count_as_small_not_zero(mode, shape, dtype):
    """A float32 1e-40 is a subnormal that XLA and CPU kernels may read as 0:
    counted on the bits, it is nonzero and below 2**-14."""
    values = np.zeros(shape, dtype)
    flat = values.reshape(-1)
    flat[:4] = [1e-40, -1e-42, np.finfo(dtype).tiny, 1.0]
    variable = keras.Variable(np.zeros(shape, "float32"), name="v")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.0), gradient_stats=True)
    _runner(mode, lambda g: opt.apply([g], [variable]))(tf.constant(values))
    stats = opt.gradient_stats()["v"]
    assert stats.subnormal_fraction == pytest.approx(3 / values.size)
    assert stats.zero_fraction == pytest.approx((values.size - 4) / values.size)


def test_bfloat16_is_warned_once_and_measured_against_float16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**10), gradient_stats=True
    )
    with pytest.warns(tfdls.BFloat16Warning, match="needs no loss scaling") as record:
        opt.build([w])
    assert record[0].filename == __file__  # the user's line, not tfdls'
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfdls.BFloat16Warning)  # once: not again
        opt.apply([tf.constant([32.0, 0.0]) * 2.0**10], [w])
    # 2**15 is one bit below float16's maximum, whatever bfloat16 could hold.
    assert opt.gradient_stats()["w"].headroom_bits == pytest.approx(math.log2(65504 / 2**15))


def test_float32_and_float16_policies_do_not_warn():
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tfdls.BFloat16Warning)
            tfdls.LossScaleOptimizer(keras.optimizers.SGD()).build([keras.Variable([1.0])])
