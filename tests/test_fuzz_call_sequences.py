"""A fuzzer for finite steps: hypothesis draws call sequences, and after every
step the weights, every optimizer variable and the loss scale are compared
with a reference of the documented contract.

What is drawn (`_programs`):

* the inner optimizer: every class `keras.optimizers` exports, with or
  without Keras' own `gradient_accumulation_steps`;
* the loss scale: dynamic (powers of two, or not), fixed (a power of two, or
  not), or a `DynamicLossScale` subclass with its own `update`;
* the variable dtype: float16, bfloat16, float32 or float64; a dense
  variable, an embedding table with sparse (`tf.IndexedSlices`) gradients
  and duplicate ids, and a variable whose gradient is sometimes None;
* per step, where it runs (eager, `tf.function`, XLA, a nested
  `tf.function`, a `tf.range` loop, unscaled in one function and applied in
  another, or `strategy.run` under MirroredStrategy), the API style (Keras 3 `scale_loss` + `apply`, tf_keras
  `get_scaled_loss` + `get_unscaled_gradients` + `apply_gradients`, with
  clipping in between, accumulation over micro-batches, and the misuses that
  must raise), gradient magnitudes, and NaN/Inf injected at random steps.

The reference (`_Reference`): the scaled gradients as the tape computes them
(``s * c`` rounded to the dtype), divided by the scale in float64 and
rounded once (what the unscaling rule says `apply` divides, and nothing
else), fed to a bare twin of the inner optimizer; the loss scale follows
`contract_model.ContractModel`; a misuse the README lists as an error must
raise a ValueError and change nothing (an eager double apply: the first
apply happens). A wrong divisor (1024x too large or too small) shows in the
slots even for scale-invariant updates (Adam's second moment, Lion's
momentum).

Budget: a few examples in the fast loop, more in CI's full run;
``HYPOTHESIS_PROFILE=deep python -m pytest tests/test_fuzz_call_sequences.py``
runs hundreds.
"""

import contextlib
import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfdls
from conftest import check_memory_maps
from contract_model import ContractModel
from keras_optimizers import EXPORTED, make_optimizer

# Programs draw None gradients on purpose (see above), and Keras warns "Gradients
# do not exist for variables [...]" for each; whether a drawn program does so
# varies, so the warning is ignored here rather than asserted.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Gradients do not exist for variables:UserWarning"
)

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
FAST_EXAMPLES = 200 if DEEP else 4
FULL_EXAMPLES = 600 if DEEP else 30
# pytest-timeout bounds a whole hypothesis test; a deep run takes hours.
DEEP_TIMEOUT = pytest.mark.timeout(6 * 3600 if DEEP else 600)

DTYPES = ("float32", "float64", "float16", "bfloat16")
CONTEXTS = ("eager", "function", "xla", "nested", "loop", "cross")
STYLES = (
    "keras3",
    "tf_keras",
    "tf_keras_clip",
    "keras3_accumulate",
    "tf_keras_accumulate",
    "log_then_apply_scaled",
    "clip_factor_on_scaled",
    "apply_twice",
)
# Misuses README lists as errors, by where the step runs: "all" raises before
# anything is applied; "second" raises at the second apply.
MISUSES = {"log_then_apply_scaled", "clip_factor_on_scaled", "apply_twice"}
EAGER_ERRORS = {"tf_keras_clip", "tf_keras_accumulate"}  # eager cannot see the computation
TABLE_ROWS, TABLE_WIDTH, IDS = 5, 2, 3
CLIP_NORM = 2.0**30  # a power of two larger than any norm here: clipping is exact identity
LR = 0.01


class SubclassedScale(tfdls.DynamicLossScale):
    """A TF 2.4 style subclass: its update() must be called (issue 18, item 3)."""

    def update(self, grads):
        self.calls = getattr(self, "calls", 0) + 1
        return super().update(grads)


@dataclasses.dataclass(frozen=True)
class Scale:
    kind: str  # dynamic | subclass | fixed
    initial: float
    increment_period: int = 2
    hysteresis: int = 1

    def build(self):
        if self.kind == "fixed":
            return tfdls.FixedLossScale(self.initial)
        cls = SubclassedScale if self.kind == "subclass" else tfdls.DynamicLossScale
        return cls(self.initial, self.increment_period, hysteresis=self.hysteresis)


@dataclasses.dataclass(frozen=True)
class Step:
    context: str
    style: str
    # Per micro-batch: true gradients of the dense variable, of the table's
    # gathered rows, and of `b` (None: `b` is not in the loss).
    w: tuple
    rows: tuple
    b: tuple
    ids: tuple
    poison: str  # "", "w" (NaN), "rows" (Inf)


@dataclasses.dataclass(frozen=True)
class Program:
    optimizer: str
    scale: Scale
    dtype: str
    steps: tuple
    accumulation: int | None = None  # the inner optimizer's gradient_accumulation_steps


def _values(draw, n):
    exponents = draw(st.lists(st.integers(-14, 2), min_size=n, max_size=n))
    mantissas = draw(st.lists(st.sampled_from([1.0, 1.25, 1.5, 1.75]), min_size=n, max_size=n))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    zero = draw(st.booleans()) and draw(st.booleans())
    values = [s * m * 2.0**e for s, m, e in zip(signs, mantissas, exponents)]
    if zero:
        values[0] = 0.0
    return tuple(values)


@st.composite
def _steps(draw, dtype, optimizer, contexts=CONTEXTS):
    context = draw(st.sampled_from(contexts))
    styles = ("keras3", "tf_keras") if context == "cross" else STYLES
    style = draw(st.sampled_from(styles))
    if style == "tf_keras_clip" and dtype in ("float16", "bfloat16"):
        style = "tf_keras"  # a global norm in float16 can overflow by itself
    micro = draw(st.integers(2, 3)) if style.endswith("accumulate") else 1
    # Keras' Adafactor fails on IndexedSlices holding zeros (bare too), and
    # Keras' MultiOptimizer raises when a sub-optimizer gets no gradient at
    # all (bare too; `b` is the default sub-optimizer's only dense variable).
    sparse = (
        not style.endswith("accumulate") and optimizer != "Adafactor" and draw(st.booleans())
    )
    with_b = optimizer == "MultiOptimizer" or draw(st.booleans())
    w = tuple(_values(draw, 3) for _ in range(micro))
    rows = tuple(_values(draw, IDS * TABLE_WIDTH) for _ in range(micro)) if sparse else ()
    b = tuple(_values(draw, 2) for _ in range(micro)) if with_b else ()
    ids = tuple(draw(st.lists(st.integers(0, TABLE_ROWS - 1), min_size=IDS, max_size=IDS)))
    poison = draw(st.sampled_from(["", "", "", "w"] + (["rows"] if sparse else [])))
    return Step(context, style, w, rows, b, ids, poison)


@st.composite
def _programs(draw, contexts=CONTEXTS, dtypes=DTYPES, optimizers=EXPORTED, accumulate=True):
    optimizer = draw(st.sampled_from(optimizers))
    # Keras' Muon cannot update float64 variables (the bare optimizer fails in its
    # lr_adjust: float64 times float32), so there is no contract to check there.
    dtype = draw(st.sampled_from(
        [d for d in dtypes if not (optimizer == "Muon" and d == "float64")]))
    kind = draw(st.sampled_from(["dynamic", "dynamic", "subclass", "fixed"]))
    power_of_two = draw(st.booleans())
    if power_of_two:
        initial = 2.0 ** draw(st.integers(2, 15))
    else:
        initial = draw(st.sampled_from([3.0, 1000.0, 3.0 * 2**10]))
    scale = Scale(
        kind,
        initial,
        increment_period=draw(st.integers(1, 3)),
        hysteresis=draw(st.integers(1, 2)),
    )
    steps = tuple(draw(st.lists(_steps(dtype, optimizer, contexts), min_size=1, max_size=5)))
    if kind == "fixed":  # a fixed scale never skips: no poisoned steps
        steps = tuple(dataclasses.replace(s, poison="") for s in steps)
    accumulation = None
    if accumulate and optimizer != "MultiOptimizer":  # (its sub-optimizers would each accumulate)
        accumulation = draw(st.sampled_from([None, None, 2]))
    return Program(optimizer, scale, dtype, steps, accumulation)


# -- the reference --------------------------------------------------------------------


def _np_dtype(dtype):
    return tf.as_dtype(dtype).as_numpy_dtype


def _round(values, dtype):
    """float64 values rounded once to `dtype`."""
    return tf.cast(tf.constant(np.asarray(values, np.float64), tf.float64), dtype).numpy()


def _times(scale, c, dtype):
    """The tape's gradient of ``scale * sum(v * c)``: ``fl(fl(scale) * c)`` in `dtype`."""
    dt = _np_dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(np.float32(scale)).astype(dt)
        return (s * np.asarray(c).astype(dt)).astype(dt)


def _sum(parts, dtype):
    """Parts added in order in `dtype`, as ``p0 + p1 + ...`` does."""
    dt = _np_dtype(dtype)
    total = np.asarray(parts[0]).astype(dt)
    with np.errstate(over="ignore", invalid="ignore"):
        for part in parts[1:]:
            total = (total + np.asarray(part).astype(dt)).astype(dt)
    return total


def _finite(arrays):
    return all(np.all(np.isfinite(np.asarray(a, np.float64))) for a in arrays)


class _Reference:
    """What the contract says a step applies: gradients for the twin, or a skip."""

    def __init__(self, program):
        self.program = program
        scale = program.scale
        self.contract = None if scale.kind == "fixed" else ContractModel(
            scale.initial, scale.increment_period, hysteresis=scale.hysteresis
        )

    def scale(self):
        return np.float32(self.program.scale.initial if self.contract is None else self.contract.s)

    def step(self, step, inputs):
        """Returns the unscaled gradients (w, rows, b) to apply, or None for a skip."""
        dtype, s = self.program.dtype, self.scale()
        per_var = []
        for values in (inputs["w"], inputs["rows"], inputs["b"]):
            if not values:
                per_var.append(None)
                continue
            scaled = [_times(s, c, dtype) for c in values]
            if step.style.startswith("keras3"):
                given = _sum(scaled, dtype)
                unscaled = _round(given.astype(np.float64) / np.float64(s), dtype)
            else:
                parts = [_round(g.astype(np.float64) / np.float64(s), dtype) for g in scaled]
                given = unscaled = _sum(parts, dtype)
            per_var.append((given, unscaled))
        finite = _finite([g for pair in per_var if pair is not None for g in pair[:1]])
        if self.contract is not None:
            self.contract.step(finite)
            if not finite:
                return None
        return [None if pair is None else pair[1] for pair in per_var]


# -- running a program --------------------------------------------------------------------


def _applier(optimizer, variables):
    return lambda grads: optimizer.apply(grads, variables)


def _per_replica(strategy, fn):
    def replica_fn(grads):
        # A tensor from outside strategy.run is one value on every replica;
        # an identity per replica makes it per-replica, as Keras' all-reduce needs.
        return fn([_identity(g) for g in grads])

    return lambda grads: strategy.run(replica_fn, args=(grads,))


def _identity(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def _times_tensor(grad, factor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def _bits(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)).tobytes() for v in variables]


class _Run:
    def __init__(self, program, strategy=None):
        self.program = program
        self.strategy = strategy
        dtype = program.dtype
        rng = np.random.default_rng(0)
        start_w = rng.normal(size=3)
        start_table = rng.normal(size=(TABLE_ROWS, TABLE_WIDTH))
        start_b = rng.normal(size=2)

        def variables():
            return [
                keras.Variable(start_w.astype(_np_dtype(dtype)), dtype=dtype, name="w"),
                keras.Variable(start_table.astype(_np_dtype(dtype)), dtype=dtype, name="table"),
                keras.Variable(start_b.astype(_np_dtype(dtype)), dtype=dtype, name="b"),
            ]

        with strategy.scope() if strategy else contextlib.nullcontext():
            self.variables = variables()
            self.twin_variables = variables()
            options = {}
            if program.accumulation:
                options["gradient_accumulation_steps"] = program.accumulation
            self.opt = tfdls.LossScaleOptimizer(
                make_optimizer(program.optimizer, "w", learning_rate=LR, **options),
                program.scale.build(),
            )
            self.twin = make_optimizer(program.optimizer, "w", learning_rate=LR, **options)
            self.opt.build(self.variables)
            self.twin.build(self.twin_variables)
        self.reference = _Reference(program)
        self.twin_steps = {}

    # The tfdls side ---------------------------------------------------------------

    def _tape(self, inputs, i, scale_fn):
        w, table, b = self.variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * inputs["w"][i])
            if inputs["rows"]:
                rows = tf.gather(table, inputs["ids"])
                loss += tf.reduce_sum(rows * tf.reshape(inputs["rows"][i], [IDS, TABLE_WIDTH]))
            if inputs["b"]:
                loss += tf.reduce_sum(b * inputs["b"][i])
            scaled = scale_fn(loss)
        return tape.gradient(scaled, self.variables)

    def _tfdls_step(self, style, micro):
        opt, variables = self.opt, self.variables

        def step(inputs):
            if style in ("keras3", "keras3_accumulate"):
                total = None
                for i in range(micro):
                    grads = self._tape(inputs, i, opt.scale_loss)
                    total = grads if total is None else [
                        None if t is None else t + g for t, g in zip(total, grads)
                    ]
                opt.apply(total, variables)
                return
            if style == "tf_keras_accumulate":
                total = None
                for i in range(micro):
                    grads = opt.get_unscaled_gradients(self._tape(inputs, i, opt.get_scaled_loss))
                    total = grads if total is None else [
                        None if t is None else t + g for t, g in zip(total, grads)
                    ]
                opt.apply_gradients(zip(total, variables))
                return
            scaled = self._tape(inputs, 0, opt.get_scaled_loss)
            unscaled = opt.get_unscaled_gradients(scaled)
            if style == "tf_keras":
                opt.apply_gradients(zip(unscaled, variables))
            elif style == "tf_keras_clip":
                clipped, _ = tf.clip_by_global_norm(unscaled, CLIP_NORM)
                opt.apply_gradients(zip(clipped, variables))
            elif style == "log_then_apply_scaled":
                opt.apply(scaled, variables)
            elif style == "clip_factor_on_scaled":
                norm = tf.linalg.global_norm([g for g in unscaled if g is not None])
                factor = tf.minimum(tf.constant(1.0, norm.dtype), CLIP_NORM / norm)
                opt.apply([_times_tensor(g, factor) for g in scaled], variables)
            elif style == "apply_twice":
                opt.apply(unscaled, variables)
                opt.apply(unscaled, variables)
            else:
                raise AssertionError(style)

        return step

    def _run_tfdls(self, step, inputs):
        fn = self._tfdls_step(step.style, len(step.w))
        context = step.context
        if context == "strategy":  # every replica gets the same inputs
            tf.function(lambda x: self.strategy.run(fn, args=(x,)))(inputs)
        elif context == "eager":
            fn(inputs)
        elif context in ("function", "xla"):
            tf.function(fn, jit_compile=context == "xla")(inputs)
        elif context == "nested":
            inner = tf.function(fn)
            tf.function(lambda x: inner(x))(inputs)
        elif context == "loop":

            def looped(x):
                for _ in tf.range(1):
                    fn(x)

            tf.function(looped)(inputs)
        elif context == "cross":
            opt, variables = self.opt, self.variables
            if step.style == "keras3":
                produce = tf.function(lambda x: self._tape(x, 0, opt.scale_loss))
            else:
                produce = tf.function(
                    lambda x: opt.get_unscaled_gradients(self._tape(x, 0, opt.get_scaled_loss))
                )
            tf.function(lambda g: opt.apply(g, variables))(produce(inputs))
        else:
            raise AssertionError(context)

    # The twin ----------------------------------------------------------------------------

    def _run_twin(self, grads, ids, compiled, eager):
        """The bare twin applies `grads` (None where tfdls got None), as tfdls' inner did."""
        w, table, b = self.twin_variables
        dense = [None if g is None else tf.constant(g) for g in grads]
        if grads[1] is not None:
            values = tf.constant(grads[1].reshape(IDS, TABLE_WIDTH))
            dense[1] = tf.IndexedSlices(values, tf.constant(ids), tf.constant(table.shape))
        if eager:
            self.twin.apply(dense, self.twin_variables)
            return
        key = (compiled, tuple(g is None for g in grads))
        variables = self.twin_variables
        if self.strategy:
            # Keras' bare optimizer fails on None gradients in strategy.run.
            variables = [v for v, g in zip(variables, dense) if g is not None]
            dense = [g for g in dense if g is not None]
        if key not in self.twin_steps:
            apply = _applier(self.twin, variables)
            if self.strategy:  # every replica applies them: summed, as tfdls' are
                apply = _per_replica(self.strategy, apply)
            self.twin_steps[key] = tf.function(apply, jit_compile=compiled)
        self.twin_steps[key](dense)

    # One step, checked --------------------------------------------------------------------

    def inputs(self, step):
        dtype = self.program.dtype
        poison = {"w": np.nan, "rows": np.inf}.get(step.poison)

        def tensors(values, name):
            arrays = [np.asarray(v, np.float64) for v in values]
            if arrays and step.poison == name:
                arrays[-1] = arrays[-1].copy()
                arrays[-1][0] = poison
            return arrays

        return {
            "w": tensors(step.w, "w"),
            "rows": tensors(step.rows, "rows"),
            "b": tensors(step.b, "b"),
            "ids": np.asarray(step.ids, np.int32),
            "dtype": dtype,
        }

    def run(self, step):
        raw = self.inputs(step)
        dtype = self.program.dtype
        inputs = {
            key: [tf.constant(a.astype(_np_dtype(dtype))) for a in raw[key]]
            for key in ("w", "rows", "b")
        }
        inputs["ids"] = tf.constant(raw["ids"])
        expected_error = self._expected_error(step)
        if expected_error is None:
            self._run_tfdls(step, inputs)
        else:
            with pytest.raises(ValueError, match="tfdls"):
                self._run_tfdls(step, inputs)
        if expected_error in (None, "second"):
            # Flattened rows: the reference works on the gathered values.
            ref_inputs = {
                "w": [a.reshape(-1) for a in raw["w"]],
                "rows": [a.reshape(-1) for a in raw["rows"]],
                "b": [a.reshape(-1) for a in raw["b"]],
            }
            grads = self.reference.step(step, ref_inputs)
            if grads is not None:
                compiled = step.context == "xla" or bool(
                    self.opt.step_plan and self.opt.step_plan.compile
                )
                self._run_twin(grads, raw["ids"], compiled, eager=step.context == "eager")

    def _expected_error(self, step):
        if step.style == "apply_twice":
            return "second" if step.context == "eager" else "all"
        if step.style in MISUSES:
            return "all"
        if step.style in EAGER_ERRORS and step.context == "eager":
            return "all"
        return None

    def check(self, where):
        rtol = {"float16": 2e-3, "bfloat16": 2e-2}.get(self.program.dtype, 2e-5)
        pairs = list(zip(self.variables, self.twin_variables))
        pairs += list(zip(self.opt.inner_optimizer.variables, self.twin.variables))
        assert len(self.opt.inner_optimizer.variables) == len(self.twin.variables)
        for mine, twin in pairs:
            a = np.asarray(keras.ops.convert_to_numpy(mine), np.float64)
            b = np.asarray(keras.ops.convert_to_numpy(twin), np.float64)
            np.testing.assert_allclose(
                a, b, rtol=rtol, atol=1e-30, equal_nan=True,
                err_msg=f"{where}: {getattr(mine, 'path', mine.name)}",
            )
        assert int(self.opt.iterations.numpy()) == int(self.twin.iterations.numpy()), where
        contract = self.reference.contract
        if contract is not None:
            ls = self.opt.loss_scale
            state = (
                np.float32(ls.current_loss_scale.numpy()).tobytes(),
                int(ls.num_good_steps.numpy()),
                int(ls.hysteresis_budget.numpy()),
                int(ls.num_skipped_steps.numpy()),
                int(ls.steps_since_overflow.numpy()),
            )
            assert state == contract.state(), where


def _run_program(program, strategy=None):
    # Deep runs compile thousands of XLA steps in one test, whose code stays
    # mapped: fail with conftest's message, not with TensorFlow's segfault.
    check_memory_maps("this example")
    run = _Run(program, strategy)
    run.check("start")
    applied = 0
    for i, step in enumerate(program.steps):
        run.run(step)
        run.check(f"after step {i} ({step.context}, {step.style})")
        applied += run._expected_error(step) in (None, "second")
    if program.scale.kind == "subclass" and applied:
        # The subclass' own update() decided (traced once per function, or per eager call).
        assert getattr(run.opt.loss_scale, "calls", 0) >= 1


_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=not DEEP,
    print_blob=True,
)


@DEEP_TIMEOUT
@settings(max_examples=FAST_EXAMPLES, **_SETTINGS)
@given(program=_programs())
def test_call_sequences_follow_the_contract(program):
    _run_program(program)


@pytest.mark.slow
@DEEP_TIMEOUT
@settings(max_examples=FULL_EXAMPLES, **_SETTINGS)
@given(program=_programs())
def test_call_sequences_follow_the_contract_full_budget(program):
    _run_program(program)


# MultiOptimizer needs every variable in every apply, which Keras' bare
# optimizers under a strategy cannot give the twin (None gradients). Keras'
# gradient accumulation cannot run in strategy.run under MirroredStrategy on
# CPUs (tfdls raises, test_optimizer_mirrored.py).
STRATEGY_PROGRAMS = _programs(
    contexts=("strategy",),
    dtypes=("float32",),
    optimizers=[name for name in EXPORTED if name != "MultiOptimizer"],
    accumulate=False,
)


@DEEP_TIMEOUT
@settings(max_examples=FAST_EXAMPLES // 2, **_SETTINGS)
@given(program=STRATEGY_PROGRAMS)
def test_call_sequences_under_mirrored_strategy(program, mirrored_strategy):
    _run_program(program, mirrored_strategy)


@pytest.mark.slow
@DEEP_TIMEOUT
@settings(max_examples=FULL_EXAMPLES // 3, **_SETTINGS)
@given(program=STRATEGY_PROGRAMS)
def test_call_sequences_under_mirrored_strategy_full_budget(program, mirrored_strategy):
    _run_program(program, mirrored_strategy)
