"""Observability: overflow attribution, the min-scale policy, LossScaleMonitor,
and the monitoring counters of DynamicLossScale."""

import glob
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

NAN = float("nan")


# -- helpers -------------------------------------------------------------------


def _two_variables():
    with keras.name_scope("block"):
        alpha = keras.Variable(np.full((3,), 0.5, "float32"), name="alpha")
        beta = keras.Variable(np.full((2,), -0.5, "float32"), name="beta")
    assert (alpha.path, beta.path) == ("block/alpha", "block/beta")
    return alpha, beta


def _poisoned_step(opt, variables):
    """A Keras 3 style step; `poison[i]` makes variable i's gradient NaN."""

    def step(poison):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(tf.square(tf.convert_to_tensor(v) - 1.0)) for v in variables)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        grads = [g * tf.where(poison[i], NAN, 1.0) for i, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def _flags(*values):
    return tf.constant(values, tf.bool)


class PoisonGrad(keras.layers.Layer):
    """Multiplies its input by a trainable scalar `gain`.

    The forward pass is always finite; the gradient of `gain` is multiplied by
    the non-trainable `grad_factor` (1 normally, NaN to poison it), so only
    this weight's gradient can be made non-finite.
    """

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones", name="gain")
        self.grad_factor = self.add_weight(
            shape=(), initializer="ones", trainable=False, name="grad_factor"
        )

    def call(self, x):
        factor = tf.convert_to_tensor(self.grad_factor)

        @tf.custom_gradient
        def poisonable(w):
            return tf.identity(w), lambda dw: dw * factor

        return x * tf.cast(poisonable(tf.convert_to_tensor(self.gain)), x.dtype)


class PoisonAt(keras.callbacks.Callback):
    """Sets `layer.grad_factor` to NaN for the given (epoch, batch) steps."""

    def __init__(self, layer, steps):
        super().__init__()
        self.layer, self.steps, self.epoch = layer, set(steps), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        poisoned = (self.epoch, batch) in self.steps
        self.layer.grad_factor.assign(NAN if poisoned else 1.0)


def _xy(n=40, d=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ rng.normal(size=(d, 1))).astype("float32")
    return x, y


def _poisonable_model(opt, jit_compile=False):
    poison = PoisonGrad(name="poison")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="dense"),
            poison,
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    return model, poison


def _stuck_opt(policy, **kwargs):
    return tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=1.0, min_loss_scale=1.0),
        min_scale_policy=policy,
        **kwargs,
    )


def _nan_model(opt, jit_compile):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="lin")])
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    x, y = _xy(n=16)
    x[3, 1] = NAN  # every batch of 16 sees it
    return model, x, y


# -- overflow attribution: custom loops ----------------------------------------


def test_last_overflow_names_the_poisoned_variable(run_mode):
    alpha, beta = _two_variables()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=64.0, increment_period=1000),
    )
    assert opt.last_overflow() is None  # not built yet
    step = run_mode(_poisoned_step(opt, [alpha, beta]))

    for _ in range(2):
        step(_flags(False, False))
    assert int(opt.iterations.numpy()) == 2
    assert opt.last_overflow() is None

    beta_before = beta.numpy().copy()
    step(_flags(False, True))
    report = opt.last_overflow()
    assert isinstance(report, tfdls.OverflowReport)
    assert report.variable_names == ("block/beta",)
    assert report.step == 2 == report.applied_steps == int(opt.iterations.numpy())
    assert report.num_skipped_steps == 1
    assert report.loss_scale == 32.0 == float(opt.loss_scale().numpy())
    np.testing.assert_array_equal(beta.numpy(), beta_before)
    assert "block/beta" in str(report) and "step 2" in str(report)

    # A finite step does not erase the report.
    step(_flags(False, False))
    assert opt.last_overflow() == report
    assert int(opt.iterations.numpy()) == 3

    # A later overflow in the other variable replaces it.
    step(_flags(True, False))
    report = opt.last_overflow()
    assert report.variable_names == ("block/alpha",)
    # Every step counts (the skipped step 2 too); 3 updates were applied before it.
    assert report.step == 4 and report.applied_steps == 3 == int(opt.iterations.numpy())
    assert report.num_skipped_steps == 2
    assert report.loss_scale == 16.0

    # Both at once.
    step(_flags(True, True))
    report = opt.last_overflow()
    assert report.variable_names == ("block/alpha", "block/beta")
    assert (report.step, report.applied_steps) == (5, 3)
    assert (report.num_skipped_steps, report.loss_scale) == (3, 8.0)


@pytest.mark.parametrize("mode", slow_except(["eager", "function", "xla"], ["function"]))
def test_consecutive_skips_report_consecutive_steps(mode):
    """Batches 5 to 9 skipped: reported as steps 5 to 9, after 5 applied updates."""
    w = keras.Variable(np.zeros(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        tfdls.DynamicLossScale(2.0**20, increment_period=1000),
        min_scale_policy="ignore",
    )
    step = lambda g: opt.apply([g], [w])  # noqa: E731
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    reported = []
    for batch in range(10):
        step(tf.constant([1.0, np.nan if batch >= 5 else 1.0]))
        report = opt.last_overflow()
        reported.append(None if report is None else (report.step, report.applied_steps))
    assert reported == [None] * 5 + [(b, 5) for b in range(5, 10)]
    assert "step 9 (5 updates applied)" in str(opt.last_overflow())


def test_no_report_without_attribution(run_mode):
    alpha, beta = _two_variables()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=64.0),
        overflow_attribution=False,
    )
    step = run_mode(_poisoned_step(opt, [alpha, beta]))
    step(_flags(False, False))
    step(_flags(True, False))
    # The step was skipped (the scale halved) but no report is kept.
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1
    assert float(opt.loss_scale().numpy()) == 32.0
    assert opt.last_overflow() is None


def test_overflow_attribution_must_be_bool():
    with pytest.raises(TypeError, match="overflow_attribution"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), overflow_attribution="yes")


def _mirrored_setup(strategy, build):
    with strategy.scope():
        alpha, beta = _two_variables()
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            loss_scale=tfdls.DynamicLossScale(initial_loss_scale=64.0, increment_period=1000),
        )
        if build:
            opt.build([alpha, beta])
    step = _poisoned_step(opt, [alpha, beta])

    @tf.function
    def distributed_step(poison_alpha_on_replica_1):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            on_one = tf.logical_and(tf.equal(replica, 1), poison_alpha_on_replica_1)
            return step(tf.stack([on_one, tf.constant(False)]))

        return strategy.run(replica_fn)

    return alpha, beta, opt, distributed_step


@pytest.mark.slow
def test_mirrored_custom_loop_builds_on_first_call(mirrored_strategy):
    """As with a plain Keras optimizer, the first apply may build the optimizer
    inside `strategy.run` in a tf.function."""
    alpha, beta, opt, distributed_step = _mirrored_setup(mirrored_strategy, build=False)
    distributed_step(tf.constant(False))
    distributed_step(tf.constant(True))
    assert int(opt.iterations.numpy()) == 1
    report = opt.last_overflow()
    assert report is not None and report.variable_names == ("block/alpha",)
    # SGD(0.1) on sum((v - 1)^2), gradients summed over the 2 replicas, once.
    np.testing.assert_allclose(alpha.numpy(), 0.5 + 0.1 * 2 * 2 * 0.5, rtol=1e-6)


def test_mirrored_nan_on_one_replica_is_attributed(mirrored_strategy):
    alpha, beta, opt, distributed_step = _mirrored_setup(mirrored_strategy, build=True)
    distributed_step(tf.constant(False))
    assert opt.last_overflow() is None
    alpha_before = [v.numpy() for v in mirrored_strategy.experimental_local_results(alpha)]
    distributed_step(tf.constant(True))

    report = opt.last_overflow()
    assert report is not None
    assert report.variable_names == ("block/alpha",)
    assert report.step == 1 == int(opt.iterations.numpy())
    assert report.num_skipped_steps == 1
    assert report.loss_scale == 32.0
    # Both replicas skipped the step and hold the same scale.
    copies = mirrored_strategy.experimental_local_results(opt.loss_scale.current_loss_scale)
    assert [float(c.numpy()) for c in copies] == [32.0, 32.0]
    after = [v.numpy() for v in mirrored_strategy.experimental_local_results(alpha)]
    for a, b in zip(after, alpha_before):
        np.testing.assert_array_equal(a, b)


# -- overflow attribution: model.fit -------------------------------------------


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [False], ["graph", "xla"]))
def test_fit_attribution_names_the_layer_weight(jit_compile):
    keras.utils.set_random_seed(0)
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=1024.0, increment_period=1000),
    )
    model, poison = _poisonable_model(opt, jit_compile=jit_compile)
    x, y = _xy()
    # 5 batches per epoch; poison epoch 0, batch 2 (global step 2).
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[PoisonAt(poison, [(0, 2)])])
    report = opt.last_overflow()
    assert report is not None
    assert report.variable_names == (poison.gain.path,)
    assert poison.gain.path.endswith("poison/gain")
    assert report.step == 2
    assert report.num_skipped_steps == 1
    assert report.loss_scale == 512.0
    assert int(opt.iterations.numpy()) == 4


# -- DynamicLossScale counters in checkpoints ----------------------------------


def test_counters_are_checkpointed_variables(tmp_path):
    ls = tfdls.DynamicLossScale(initial_loss_scale=16.0, increment_period=100)
    for var in (ls.num_skipped_steps_variable, ls.steps_since_overflow_variable):
        assert isinstance(var, tf.Variable)
        assert any(var is v for v in ls.variables)
    for grad in (1.0, NAN, 1.0, NAN, 1.0, 1.0, 1.0):
        ls.update([tf.constant(grad)])
    assert int(ls.num_skipped_steps.numpy()) == 2
    assert int(ls.steps_since_overflow.numpy()) == 3
    path = tf.train.Checkpoint(ls=ls).save(str(tmp_path / "ckpt"))

    restored = tfdls.DynamicLossScale(initial_loss_scale=16.0, increment_period=100)
    tf.train.Checkpoint(ls=restored).restore(path).assert_consumed()
    assert int(restored.num_skipped_steps.numpy()) == 2
    assert int(restored.steps_since_overflow.numpy()) == 3
    assert float(restored().numpy()) == 4.0
    assert int(restored.num_good_steps.numpy()) == 3
    # They resume counting from the restored values.
    restored.update([tf.constant(1.0)])
    restored.update([tf.constant(NAN)])
    assert int(restored.num_skipped_steps.numpy()) == 3
    assert int(restored.steps_since_overflow.numpy()) == 0


@pytest.mark.slow
def test_counters_restore_through_the_optimizer(tmp_path):
    def make():
        var = keras.Variable(np.ones((2,), "float32"), name="v")
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            loss_scale=tfdls.DynamicLossScale(initial_loss_scale=8.0, increment_period=100),
        )
        opt.build([var])
        return var, opt

    var, opt = make()
    for grad in (NAN, 1.0, 1.0):
        opt.apply([tf.fill([2], grad) * opt.loss_scale()], [var])
    path = tf.train.Checkpoint(opt=opt).save(str(tmp_path / "ckpt"))
    var2, opt2 = make()
    tf.train.Checkpoint(opt=opt2).restore(path)
    assert int(opt2.loss_scale.num_skipped_steps.numpy()) == 1
    assert int(opt2.loss_scale.steps_since_overflow.numpy()) == 2
    assert float(opt2.loss_scale().numpy()) == 4.0


# -- min-scale policy -------------------------------------------------------------


STEP_MODES = ["eager", "graph", "xla"]


def _stuck_run(policy, mode="graph", stuck_steps=4):
    """Two finite steps, then `stuck_steps` NaN steps at the minimum scale."""
    alpha, beta = _two_variables()
    opt = _stuck_opt(policy)
    step = _poisoned_step(opt, [alpha, beta])
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    step(_flags(False, False))
    step(_flags(False, False))
    for _ in range(stuck_steps):
        step(_flags(False, True))
    return opt


def _runtime_warnings(record):
    return [w for w in record if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("mode", slow_except(STEP_MODES, ["graph"]))
def test_warn_policy_warns_once_at_the_host_check_in_every_mode(mode):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = _stuck_run("warn", mode)
        assert _runtime_warnings(record) == []  # the steps never call the host
        opt.check_min_scale_policy()
        opt.check_min_scale_policy()
        opt.last_overflow()
    stuck = _runtime_warnings(record)
    assert len(stuck) == 1, [str(w.message) for w in stuck]
    message = str(stuck[0].message)
    assert "loss scale is at its minimum" in message
    assert "step 5" in message  # the last of steps 2 to 5, every step counted
    assert "block/beta" in message and "block/alpha" not in message
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 4
    assert float(opt.loss_scale().numpy()) == 1.0


@pytest.mark.parametrize("mode", slow_except(STEP_MODES, ["xla"]))
def test_raise_policy_raises_the_plain_error_at_the_host_check_in_every_mode(mode):
    opt = _stuck_run("raise", mode, stuck_steps=2)  # the steps themselves do not raise
    with pytest.raises(tfdls.LossScaleStuckError, match=r"minimum \(1\).*step 3.*block/beta"):
        opt.check_min_scale_policy()
    opt.check_min_scale_policy()  # reported once: nothing new since
    opt = _stuck_run("raise", mode, stuck_steps=1)
    with pytest.raises(tfdls.LossScaleStuckError):
        opt.last_overflow()


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [True], ["graph", "xla"]))
def test_raise_policy_from_fit_without_a_monitor_at_the_end(jit_compile):
    model, x, y = _nan_model(_stuck_opt("raise"), jit_compile=jit_compile)
    epochs = []
    logger = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: epochs.append(epoch))
    with pytest.raises(tfdls.LossScaleStuckError, match="loss scale is at its minimum"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[logger])
    assert epochs == [0, 1]  # heard at the end of fit, after the last epoch


def test_no_policy_event_above_the_minimum():
    """Overflows while the scale can still fall are normal: no report."""
    alpha, beta = _two_variables()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=8.0, min_loss_scale=1.0),
        min_scale_policy="raise",
    )
    step = tf.function(_poisoned_step(opt, [alpha, beta]))
    for _ in range(3):  # 8 -> 4 -> 2 -> 1: the scale was above the minimum each time
        step(_flags(True, False))
    assert float(opt.loss_scale().numpy()) == 1.0
    opt.check_min_scale_policy()
    step(_flags(True, False))
    with pytest.raises(tfdls.LossScaleStuckError, match="loss scale is at its minimum"):
        opt.check_min_scale_policy()


def test_ignore_policy_is_silent():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = _stuck_run("ignore")
        opt.check_min_scale_policy()
        opt.last_overflow()
    assert _runtime_warnings(record) == []
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 4


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [False], ["graph", "xla"]))
def test_fit_raise_policy_via_monitor_at_the_first_logged_batch(jit_compile):
    model, x, y = _nan_model(_stuck_opt("raise"), jit_compile=jit_compile)
    batches = []
    logger = keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: batches.append(batch))
    monitor = tfdls.LossScaleMonitor(update_freq=1)
    with pytest.raises(tfdls.LossScaleStuckError, match="loss scale is at its minimum"):
        model.fit(
            np.concatenate([x, x]), np.concatenate([y, y]), batch_size=16, epochs=2,
            verbose=0, callbacks=[monitor, logger], shuffle=False,
        )
    assert batches == []  # the monitor ran first and stopped fit after batch 0


@pytest.mark.slow
def test_fit_warn_policy_via_monitor():
    model, x, y = _nan_model(_stuck_opt("warn"), jit_compile=True)
    with pytest.warns(RuntimeWarning, match=r"minimum.*lin/kernel"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[tfdls.LossScaleMonitor()])


def test_the_warn_policy_points_at_the_users_line(run_mode):
    """The stuck-scale warning names the line that asked for the check, in any mode."""
    opt = _stuck_opt("warn")
    w = keras.Variable([1.0, 2.0], name="w")
    step = run_mode(lambda g: opt.apply([g], [w]))
    step(tf.constant([NAN, 1.0]))
    with pytest.warns(RuntimeWarning, match=r"minimum.*w") as record:
        opt.check_min_scale_policy()
    assert [r.filename for r in record] == [__file__]


@pytest.mark.parametrize("policy", ["sometimes", "Raise", None])
def test_invalid_policy(policy):
    with pytest.raises(ValueError, match=rf"min_scale_policy.*{policy!r}"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), min_scale_policy=policy)


def test_stuck_error_is_a_runtime_error():
    assert issubclass(tfdls.LossScaleStuckError, RuntimeError)


# -- LossScaleMonitor --------------------------------------------------------------


def _monitored_fit(jit_compile, monitor, extra_callbacks=(), epochs=2, strategy=None):
    """5 batches per epoch; steps (0, 1) and (0, 3) overflow."""
    keras.utils.set_random_seed(0)

    def build():
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            loss_scale=tfdls.DynamicLossScale(initial_loss_scale=1024.0, increment_period=1000),
        )
        model, poison = _poisonable_model(opt, jit_compile=jit_compile)
        return opt, model, poison

    if strategy is None:
        opt, model, poison = build()
    else:
        with strategy.scope():
            opt, model, poison = build()
    x, y = _xy()
    callbacks = [PoisonAt(poison, [(0, 1), (0, 3)]), monitor, *extra_callbacks]
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
    return opt, history


def _state(opt):
    ls = opt.loss_scale
    return {
        "loss_scale": float(ls().numpy()),
        "skipped_steps": int(ls.num_skipped_steps.numpy()),
        "steps_since_overflow": int(ls.steps_since_overflow.numpy()),
    }


EXPECTED_HISTORY = {
    "loss_scale": [256.0, 256.0],
    "skipped_steps": [2, 2],
    "steps_since_overflow": [1, 6],
}


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [], ["graph", "xla"]))
def test_monitor_history_per_epoch(jit_compile):
    opt, history = _monitored_fit(jit_compile, tfdls.LossScaleMonitor())
    for key, expected in EXPECTED_HISTORY.items():
        assert history.history[key] == expected, key
        assert history.history[key][-1] == _state(opt)[key]
    assert int(opt.iterations.numpy()) == 8


@pytest.mark.slow
def test_monitor_under_mirrored_strategy(mirrored_strategy):
    opt, history = _monitored_fit(False, tfdls.LossScaleMonitor(), strategy=mirrored_strategy)
    for key, expected in EXPECTED_HISTORY.items():
        assert history.history[key] == expected, key
        assert history.history[key][-1] == _state(opt)[key]
    copies = mirrored_strategy.experimental_local_results(opt.loss_scale.current_loss_scale)
    assert [float(c.numpy()) for c in copies] == [256.0, 256.0]


class BatchRecorder(keras.callbacks.Callback):
    """Placed after the monitor: what each batch's logs held, and the truth."""

    def __init__(self):
        super().__init__()
        self.logged, self.actual = [], []

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        self.logged.append({k: logs[k] for k in EXPECTED_HISTORY if k in logs})
        self.actual.append(_state(self.model.optimizer))


@pytest.mark.slow
def test_monitor_update_freq_batches():
    recorder = BatchRecorder()
    opt, history = _monitored_fit(
        False, tfdls.LossScaleMonitor(update_freq=2), extra_callbacks=[recorder]
    )
    assert len(recorder.logged) == 10
    for i, (logged, actual) in enumerate(zip(recorder.logged, recorder.actual)):
        if (i % 5) % 2 == 1:  # batches 1 and 3 of each 5-batch epoch
            assert logged == actual, i
        else:
            assert logged == {}, i
    # Batches 1 and 3 of epoch 0 overflowed: the scale halves at each.
    assert [r["loss_scale"] for r in recorder.logged if r] == [512.0, 256.0, 256.0, 256.0]
    assert [r["skipped_steps"] for r in recorder.logged if r] == [1, 2, 2, 2]
    assert history.history["loss_scale"] == [256.0, 256.0]


def _event_scalars(log_dir):
    values = {}
    files = glob.glob(os.path.join(log_dir, "events.out.tfevents*"))
    assert files, os.listdir(log_dir)
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                values.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return values


@pytest.mark.slow
def test_monitor_writes_tensorboard_scalars(tmp_path):
    log_dir = str(tmp_path / "logs")
    opt, history = _monitored_fit(False, tfdls.LossScaleMonitor(log_dir=log_dir))
    scalars = _event_scalars(log_dir)
    assert sorted(scalars) == sorted(f"loss_scale/{k}" for k in EXPECTED_HISTORY)
    for key in EXPECTED_HISTORY:
        steps, values = zip(*sorted(scalars[f"loss_scale/{key}"]))
        # Step = training batches run, skipped ones included (Keras
        # TensorBoard's batch axis), not optimizer iterations (3 and 8 here).
        assert steps == (5, 10)
        assert list(values) == [float(v) for v in history.history[key]]


class TensorBoardBatchAxis(keras.callbacks.Callback):
    """Counts batches as keras.callbacks.TensorBoard numbers its batch points."""

    def on_train_begin(self, logs=None):
        self.batch = 0
        self.steps = []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch += 1  # as TensorBoard's _global_train_batch

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(self.batch)


def test_monitor_batch_points_line_up_with_tensorboard_and_are_written_once(tmp_path):
    log_dir = str(tmp_path / "logs")
    axis = TensorBoardBatchAxis()
    # 5 batches per epoch: update_freq=5 logs the last batch, then the epoch end.
    _monitored_fit(False, tfdls.LossScaleMonitor(log_dir=log_dir, update_freq=5), [axis])
    scalars = _event_scalars(log_dir)
    steps = [step for step, _ in scalars["loss_scale/loss_scale"]]
    assert steps == [5, 10]  # no duplicate point at an epoch end
    assert set(steps) <= set(axis.steps)


@pytest.mark.slow
def test_monitor_reads_only_at_epoch_end(monkeypatch):
    monitor = tfdls.LossScaleMonitor()
    reads = []
    original = monitor._read

    def counting_read():
        reads.append(1)
        return original()

    monkeypatch.setattr(monitor, "_read", counting_read)
    _monitored_fit(False, monitor, epochs=3)
    assert len(reads) == 3


@pytest.mark.slow
def test_monitor_reads_every_n_batches(monkeypatch):
    monitor = tfdls.LossScaleMonitor(update_freq=2)
    reads = []
    original = monitor._read
    monkeypatch.setattr(monitor, "_read", lambda: reads.append(1) or original())
    _monitored_fit(False, monitor, epochs=2)
    assert len(reads) == 2 * 2 + 2  # batches 1 and 3 of each epoch, plus each epoch end


def test_monitor_needs_a_loss_scale_optimizer():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    x, y = _xy(n=8)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[tfdls.LossScaleMonitor()])


@pytest.mark.parametrize("update_freq", [0, -1, "batch", 1.5, True])
def test_monitor_bad_update_freq(update_freq):
    with pytest.raises(ValueError, match="update_freq"):
        tfdls.LossScaleMonitor(update_freq=update_freq)
