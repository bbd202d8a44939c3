"""The branch-free skip for Embedding (sparse) gradients and Keras' own branches.

For every class `keras.optimizers` exports, in graph mode (each `jit_compile`
value that changes the path) and under XLA:

* sparse gradients (`tf.IndexedSlices`, duplicate ids included) take the
  masked path; a skipped step leaves the table, every other variable, every
  optimizer slot and `iterations` bit-identical (-0.0 and subnormal rows
  included); a finite step equals the bare optimizer fed the true gradients;
* with `gradient_accumulation_steps`, a non-finite micro-batch is dropped
  without touching the accumulators (as Keras 3's own optimizer does): the
  run equals the bare optimizer fed the finite micro-batches only;
* with `ema_overwrite_frequency`, the same.

"No branch beyond Keras' own" is counted in test_no_host_wait.py.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.keras_optimizers import EXPORTED, make_optimizer
from tests.optimizer.test_masked_update import COMPILED_ULPS, _bits, _ulps

# Small models: without this, jit_compile="auto" on the CPU would take a cond
# (tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS) and these tests are of the masked step.
pytestmark = pytest.mark.usefixtures("plan_as_on_an_accelerator")

NAN = float("nan")
SCALE = 2.0**10
ROWS, WIDTH = 6, 3
IDS = [1, 4, 1, 5]  # row 1 twice: its two gradients add up, as for the bare optimizer

# (jit_compile of the outer tf.function, the wrapper's jit_compile)
MODES = {
    "graph-auto": (False, "auto"),
    "graph-jit-false": (False, False),
    "xla": (True, "auto"),
}
FAST = {("Adam", "graph-auto"), ("SGD", "xla"), ("Adagrad", "graph-jit-false")}


def _matrix(names):
    return [
        pytest.param(name, mode, marks=() if (name, mode) in FAST else pytest.mark.slow)
        for name in names
        for mode in MODES
    ]


def _variables():
    table = np.arange(ROWS * WIDTH, dtype=np.float64).reshape(ROWS, WIDTH) / 7 - 1
    table[1] = [-0.0, 1e-40, 0.5]  # a looked-up row: -0.0 and a float32 subnormal
    table[3] = [-0.0, -1e-41, 0.0]  # a row no id reaches
    w = np.array([[0.5, -0.0], [1e-40, -2.0], [0.25, 1.0]])
    return [
        keras.Variable(table.astype("float32"), name="table"),
        keras.Variable(w.astype("float32"), name="w"),
    ]


def _true_grads(step):
    rng = np.random.default_rng(step)
    rows = rng.normal(size=(len(IDS), WIDTH)).astype("float32")
    return rows, rng.normal(size=(3, 2)).astype("float32")


def _grads(rows, dense, factor=1.0, poison=False):
    rows = rows * np.float32(factor)
    if poison:
        rows = rows.copy()
        rows[2, 1] = NAN  # a duplicate id's row
    sparse = tf.IndexedSlices(tf.constant(rows), tf.constant(IDS), tf.constant([ROWS, WIDTH]))
    return [sparse, tf.constant(dense * np.float32(factor))]


class _Pair:
    """tfdls and the bare optimizer, each with its own variables, stepped in `mode`."""

    def __init__(self, name, mode, **options):
        xla, jit_compile = MODES[mode]
        self.variables, self.bare_variables = _variables(), _variables()
        self.opt = tfdls.LossScaleOptimizer(
            make_optimizer(name, "w", learning_rate=1e-2, **options),
            tfdls.DynamicLossScale(SCALE, increment_period=1000),
            jit_compile=jit_compile,
        )
        self.bare = make_optimizer(name, "w", learning_rate=1e-2, **options)
        # Built now, as tfdls builds its inner optimizer (`_distribute.built_before_the_trace`):
        # a first build inside the step's trace loses what `build` writes (ScheduleFreeAdamW
        # starts its momentum at the weights).
        self.bare.build(self.bare_variables)
        self.step = tf.function(lambda g: self.opt.apply(g, self.variables), jit_compile=xla)
        # Where tfdls compiles its apply, the bare step is compiled too.
        self.compiled = mode != "graph-jit-false"
        self.bare_step = tf.function(
            lambda g: self.bare.apply(g, self.bare_variables), jit_compile=self.compiled
        )
        self.name = name

    def state(self):
        return self.variables + self.opt.inner_optimizer.variables

    def finite(self, step):
        rows, dense = _true_grads(step)
        self.step(_grads(rows, dense, float(self.opt.loss_scale().numpy())))
        self.bare_step(_grads(rows, dense))

    def skipped(self, step):
        """A non-finite step: returns whether every variable kept its bits."""
        before = _bits(self.state())
        iterations = int(self.opt.iterations.numpy())
        rows, dense = _true_grads(step)
        self.step(_grads(rows, dense, float(self.opt.loss_scale().numpy()), poison=True))
        assert int(self.opt.iterations.numpy()) == iterations
        return _bits(self.state()) == before

    def assert_matches_bare(self, loose=()):
        """Bit-identical uncompiled; compiled, within `COMPILED_ULPS`, or for
        the classes in `loose` within 1 ulp of each variable's largest value."""
        allowed = COMPILED_ULPS.get(self.name, 0) if self.compiled else 0
        pairs = zip(self.state(), self.bare_variables + self.bare.variables)
        for mine, theirs in pairs:
            a, b = keras.ops.convert_to_numpy(mine), keras.ops.convert_to_numpy(theirs)
            if not np.issubdtype(np.asarray(a).dtype, np.floating):
                assert np.array_equal(a, b), mine.path
                continue
            if self.compiled and self.name in loose:
                error = np.max(np.abs(a.astype(np.float64) - b), initial=0.0)
                assert error <= np.spacing(np.max(np.abs(b), initial=0.0)), (mine.path, error)
                continue
            assert _ulps(a, b) <= allowed, (mine.path, _ulps(a, b))
        assert int(self.opt.iterations.numpy()) == int(self.bare.iterations.numpy())


@pytest.mark.parametrize("name, mode", _matrix(EXPORTED))
def test_sparse_steps_are_masked_skips_bit_identical_finite_steps_match_bare(name, mode):
    pair = _Pair(name, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pair.finite(0)
        assert pair.opt.step_plan.skip == "masked", pair.opt.step_plan.reason
        untouched = _bits([pair.variables[0]])
        assert pair.skipped(1)
        assert float(pair.opt.loss_scale().numpy()) == SCALE / 2
        pair.finite(2)
        pair.finite(3)
    pair.assert_matches_bare()
    # The row no id reaches kept its -0.0 and subnormal bits through finite steps.
    assert np.asarray(pair.variables[0].numpy())[3].tobytes() == (
        np.frombuffer(untouched[0], np.float32).reshape(ROWS, WIDTH)[3].tobytes()
    )


# MultiOptimizer: its sub-optimizers would each accumulate (not a combination
# Keras documents); every other class.
ACCUMULATING = [name for name in EXPORTED if name != "MultiOptimizer"]


@pytest.mark.parametrize("name, mode", _matrix(ACCUMULATING))
def test_a_bad_micro_batch_leaves_the_accumulators_untouched(name, mode):
    """Micro-batches 0, bad, 2, 3, 4 with gradient_accumulation_steps=2 equal
    the bare optimizer fed 0, 2, 3, 4: the bad one is dropped, the window
    goes on (as Keras 3's own LossScaleOptimizer does; PyTorch would skip
    the whole window)."""
    pair = _Pair(name, mode, gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pair.finite(0)  # accumulates
        assert pair.opt.step_plan.skip == "masked", pair.opt.step_plan.reason
        assert pair.skipped(1)  # inside the window: accumulators, slots, weights kept
        pair.finite(2)  # completes the window: applies
        assert pair.skipped(5)  # at a window's start
        pair.finite(3)
        pair.finite(4)
    # XLA fuses Lion's averaged accumulated gradient differently with the
    # masked writes (also without any skip): 1 ulp of the largest momentum.
    pair.assert_matches_bare(loose={"Lion"})
    assert int(pair.opt.loss_scale.num_skipped_steps.numpy()) == 2


@pytest.mark.parametrize("name, mode", _matrix(["Adam", "SGD", "Lion", "Nadam"]))
def test_ema_overwrite_skips_bit_identical_and_matches_bare(name, mode):
    pair = _Pair(name, mode, use_ema=True, ema_overwrite_frequency=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pair.finite(0)
        assert pair.opt.step_plan.skip == "masked", pair.opt.step_plan.reason
        assert pair.skipped(1)  # the next applied step overwrites: not this one
        pair.finite(2)  # overwrites the weights with their averages
        pair.finite(3)
    pair.assert_matches_bare()
