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
  must raise), gradient magnitudes, and NaN/Inf injected at random steps;
* several applies per `scale_loss`/`get_scaled_loss` (one tape, the
  variables split over 2-3 `apply`/`apply_gradients` calls in a drawn order,
  NaN/Inf in one of them), a loss multiplied by `opt.loss_scale()` by hand,
  two `LossScaleOptimizer`s updating disjoint variables in one step, each
  scaling its own loss, and partial unscaling (`get_unscaled_gradients` on a
  strict subset, applied with the others raw: a `ValueError` naming a raw
  variable);
* whether the optimizer is built before the first step or by it (inside its
  trace), and a loss multiplied by hand then unscaled by
  `get_unscaled_gradients` (traced before the build: a `ValueError`);
* the traced functions are kept: a later step with the same context, style and
  structure calls the function an earlier one traced, as a training loop does
  (what a trace decided must stay right when it runs again).

The reference (`_Reference`): the scaled gradients as the tape computes them
(``s * c`` rounded to the dtype), divided by the scale in float64 and
rounded once (what the unscaling rule says `apply` divides, and nothing
else), fed to a bare twin of the inner optimizer; the loss scale follows
`contract_model.ContractModel`, one step per `apply`; a misuse the README lists as an error must
raise a ValueError and change nothing (an eager double apply: the first
apply happens). A wrong divisor (1024x too large or too small) shows in the
slots even for scale-invariant updates (Adam's second moment, Lion's
momentum). Which scale `apply` divides by: the one recorded by the last
`scale_loss`/`get_scaled_loss` of that optimizer (not the live one, which
each `apply` steps), unless a variable given to it was already updated by
that optimizer since then (a loss multiplied by `opt.loss_scale()` by hand):
then the scale now.

Separate tests, each with its own reference, draw what the program
structure above cannot hold: two optimizers given one model with scale
boundaries, each updating some of its variables (each `apply` divides by the
factors the step's `scale_loss` recorded: both are SGD on the true gradient,
in either order), auxiliary losses from inner activations below boundaries
(a `ValueError` that changes nothing, or SGD on the float64 gradient), and a
float16 embedding whose `IndexedSlices` gradient holds thousands of rows at
one index (applied unless twice the sum of the rows' largest magnitudes
exceeds float16's largest value; a vetoed step keeps the loss scale).

Budget: a few examples in the fast loop, more in CI's full run;
``HYPOTHESIS_PROFILE=deep python -m pytest tests/optimizer/test_fuzz_call_sequences.py``
runs hundreds. The fast loop also runs explicit examples of each class above
(`CLASS_EXAMPLES` and the `@example`s of the separate tests): the minimal
programs hypothesis found where the code before these rules updated wrongly.
"""

import contextlib
import dataclasses
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import tfdls
from tests.conftest import check_memory_maps
from tests.support.contract_model import ContractModel
from tests.support.keras_optimizers import EXPORTED, make_optimizer

# Programs draw None gradients on purpose (see above), and Keras warns "Gradients
# do not exist for variables [...]" for each; whether a drawn program does so
# varies, so the warning is ignored here rather than asserted.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Gradients do not exist for variables:UserWarning"
)

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
FAST_EXAMPLES = 200 if DEEP else 4
FULL_EXAMPLES = 600 if DEEP else 30
# The separate tests below (one class each, with its own reference): a few
# seconds per example; in the fast loop each draws two.
SIDE_FAST_EXAMPLES = FAST_EXAMPLES // 2
SIDE_FULL_EXAMPLES = FULL_EXAMPLES // 5
# pytest-timeout bounds a whole hypothesis test; a deep run takes hours.
DEEP_TIMEOUT = pytest.mark.timeout(6 * 3600 if DEEP else 600)

DTYPES = ("float32", "float64", "float16", "bfloat16")
CONTEXTS = ("eager", "function", "xla", "nested", "loop", "cross")
# Several applies per scale_loss / get_scaled_loss: the variables split over
# 2-3 calls (`Step.groups`), each dividing by the scale that call recorded.
SPLIT_STYLES = ("split_keras3", "split_tf_keras")
# Steps whose variables are split into groups, each applied by one call.
GROUPED = SPLIT_STYLES + ("two_optimizers",)
STYLES = (
    "keras3",
    "tf_keras",
    "tf_keras_clip",
    "keras3_accumulate",
    "tf_keras_accumulate",
    "log_then_apply_scaled",
    "clip_factor_on_scaled",
    "apply_twice",
    *SPLIT_STYLES,
    "by_hand",  # loss * opt.loss_scale(), then apply: divided by the scale now
    "by_hand_unscaled",  # the same, divided by get_unscaled_gradients, then apply_gradients
    "two_optimizers",  # a second LossScaleOptimizer updates some variables
    "partial_unscale",  # get_unscaled_gradients on some, the rest applied raw
)
# Misuses README lists as errors, by where the step runs: "all" raises before
# anything is applied; "second" raises at the second apply.
MISUSES = {"log_then_apply_scaled", "clip_factor_on_scaled", "apply_twice", "partial_unscale"}
EAGER_ERRORS = {"tf_keras_clip", "tf_keras_accumulate"}  # eager cannot see the computation
TABLE_ROWS, TABLE_WIDTH, IDS = 5, 2, 3
NAMES = ("w", "table", "b")  # the variables, in the order every step gives them
ALL = (0, 1, 2)
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
    poison: str  # "", "w" (NaN), "rows" (Inf), "b" (Inf)
    # GROUPED styles: ((optimizer, variable indices), ...) in the order they are
    # applied (optimizer 1: the second LossScaleOptimizer); a partition of ALL.
    groups: tuple = ()
    # partial_unscale: the variables whose gradients get_unscaled_gradients divides.
    unscaled: tuple = ()


@dataclasses.dataclass(frozen=True)
class Program:
    optimizer: str
    scale: Scale
    dtype: str
    steps: tuple
    accumulation: int | None = None  # the inner optimizer's gradient_accumulation_steps
    second_scale: Scale | None = None  # the second optimizer's (two_optimizers steps)
    build_first: bool = True  # else the first step's apply builds the optimizer


def _values(draw, n):
    exponents = draw(st.lists(st.integers(-14, 2), min_size=n, max_size=n))
    mantissas = draw(st.lists(st.sampled_from([1.0, 1.25, 1.5, 1.75]), min_size=n, max_size=n))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    zero = draw(st.booleans()) and draw(st.booleans())
    values = [s * m * 2.0**e for s, m, e in zip(signs, mantissas, exponents)]
    if zero:
        values[0] = 0.0
    return tuple(values)


def _partition(draw, present, absent, count):
    """`count` groups in a drawn order, each with at least one of `present`."""
    order = draw(st.permutations(present))
    cuts = sorted(draw(st.lists(st.integers(1, len(order) - 1), min_size=count - 1,
                                max_size=count - 1, unique=True)))
    groups = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)])]
    for i in absent:
        groups[draw(st.integers(0, count - 1))].append(i)
    return [tuple(sorted(g)) for g in groups]


@st.composite
def _steps(draw, dtype, optimizer, contexts=CONTEXTS, styles=STYLES):
    context = draw(st.sampled_from(contexts))
    if context == "cross":
        styles = ("keras3", "tf_keras")
    if context == "strategy":
        # Partial unscaling is promised to raise eagerly, in tf.function and
        # in XLA (and drawn in nested functions and loops); not in strategy.run.
        styles = tuple(s for s in styles if s != "partial_unscale")
    if optimizer == "MultiOptimizer":
        # Keras' MultiOptimizer raises when a sub-optimizer gets no gradient
        # at all (bare too): every apply must hold `w` and `b`.
        styles = tuple(s for s in styles if s not in GROUPED)
    style = draw(st.sampled_from(styles))
    if style == "tf_keras_clip" and dtype in ("float16", "bfloat16"):
        style = "tf_keras"  # a global norm in float16 can overflow by itself
    micro = draw(st.integers(2, 3)) if style.endswith("accumulate") else 1
    # Keras' Adafactor fails on IndexedSlices holding zeros (bare too);
    # Keras 3.15's ScheduleFreeAdamW fails on an IndexedSlices gradient with
    # repeated ids after a step without one (bare too: an InvalidArgumentError
    # from the union of indices in keras/src/backend/tensorflow/sparse.py,
    # found by the deep profile); and Keras' MultiOptimizer raises when a
    # sub-optimizer gets no gradient at all (bare too; `b` is the default
    # sub-optimizer's only dense variable).
    sparse = (
        not style.endswith("accumulate")
        and optimizer not in ("Adafactor", "ScheduleFreeAdamW")
        and draw(st.booleans())
    )
    two_or_more = style in GROUPED or style == "partial_unscale"
    with_b = optimizer == "MultiOptimizer" or two_or_more or draw(st.booleans())
    w = tuple(_values(draw, 3) for _ in range(micro))
    rows = tuple(_values(draw, IDS * TABLE_WIDTH) for _ in range(micro)) if sparse else ()
    b = tuple(_values(draw, 2) for _ in range(micro)) if with_b else ()
    ids = tuple(draw(st.lists(st.integers(0, TABLE_ROWS - 1), min_size=IDS, max_size=IDS)))
    poisons = ["", "", "", "w"] + (["rows"] if sparse else [])
    if style in GROUPED:  # an overflow in one of the applies, more often
        poisons = ["", "", "w", "b"] + (["rows"] if sparse else [])
    poison = draw(st.sampled_from(poisons))
    present = [i for i, there in zip(ALL, (True, sparse, with_b)) if there]
    absent = [i for i in ALL if i not in present]
    groups, unscaled = (), ()
    if style in SPLIT_STYLES:
        count = draw(st.integers(2, min(3, len(present))))
        groups = tuple((0, g) for g in _partition(draw, present, absent, count))
    elif style == "two_optimizers":
        first = draw(st.integers(0, 1))  # the optimizer of the group applied first
        groups = tuple(zip((first, 1 - first), _partition(draw, present, absent, 2)))
    elif style == "partial_unscale":
        unscaled = tuple(sorted(draw(st.lists(
            st.sampled_from(present), min_size=1, max_size=len(present) - 1, unique=True))))
    return Step(context, style, w, rows, b, ids, poison, groups, unscaled)


def _scale(draw, kinds, longest_period=3):
    kind = draw(st.sampled_from(kinds))
    power_of_two = draw(st.booleans())
    if power_of_two:
        initial = 2.0 ** draw(st.integers(2, 15))
    else:
        initial = draw(st.sampled_from([3.0, 1000.0, 3.0 * 2**10]))
    return Scale(
        kind,
        initial,
        increment_period=draw(st.integers(1, longest_period)),
        hysteresis=draw(st.integers(1, 2)),
    )


@st.composite
def _programs(draw, contexts=CONTEXTS, dtypes=DTYPES, optimizers=EXPORTED, accumulate=True,
              styles=STYLES):
    optimizer = draw(st.sampled_from(optimizers))
    # Keras' Muon cannot update float64 variables (the bare optimizer fails in its
    # lr_adjust: float64 times float32), so there is no contract to check there.
    dtype = draw(st.sampled_from(
        [d for d in dtypes if not (optimizer == "Muon" and d == "float64")]))
    steps = tuple(draw(st.lists(_steps(dtype, optimizer, contexts, styles),
                                min_size=1, max_size=5)))
    # With several applies per scale_loss, a period of 1 or 2 grows the scale
    # between them.
    grouped = any(s.style in GROUPED for s in steps)
    scale = _scale(draw, ["dynamic", "dynamic", "subclass", "fixed"], 2 if grouped else 3)
    if scale.kind == "fixed":  # a fixed scale never skips: no poisoned steps
        steps = tuple(dataclasses.replace(s, poison="") for s in steps)
    second_scale = None
    if any(s.style == "two_optimizers" for s in steps):
        second_scale = _scale(draw, ["dynamic", "subclass"], 2)
    accumulation = None
    if accumulate and optimizer != "MultiOptimizer":  # (its sub-optimizers would each accumulate)
        accumulation = draw(st.sampled_from([None, None, 2]))
    # Built by the first apply only where every apply gets every variable (a split step
    # would build it with some of them).
    build_first = any(s.style in GROUPED for s in steps) or draw(st.booleans())
    return Program(optimizer, scale, dtype, steps, accumulation, second_scale, build_first)


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


def _contract(scale):
    if scale.kind == "fixed":
        return None
    return ContractModel(scale.initial, scale.increment_period, hysteresis=scale.hysteresis)


class _Reference:
    """What the contract says each apply of a step applies: gradients for the twin, or a skip.

    Per optimizer a `ContractModel` (None for a fixed scale), stepped once per
    apply. For optimizer 0 it also keeps what decides the divisor of raw
    (scaled) gradients: the scale its last scale_loss recorded, and the
    variables given to its applies since then (`tried`) and those of them
    actually updated (`applied`).
    """

    def __init__(self, program):
        self.program = program
        self.scales = [program.scale] + ([program.second_scale] if program.second_scale else [])
        self.contracts = [_contract(s) for s in self.scales]
        self.contract = self.contracts[0]
        self.recorded = self.scale()
        self.tried, self.applied = set(), set()

    def scale(self, k=0):
        contract = self.contracts[k]
        return np.float32(self.scales[k].initial if contract is None else contract.s)

    def scale_loss(self):
        """Optimizer 0's scale_loss / get_scaled_loss ran."""
        self.recorded = self.scale()
        self.tried, self.applied = set(), set()

    def by_hand_is_ambiguous(self):
        """Whether "already updated since the last scale_loss" decides a by-hand apply of
        every variable differently from "given to an apply since" (that apply skipped).

        Then the step runs as keras3 instead: the contract is not drawn there.
        """
        return not self.applied and bool(self.tried) and self.scale() != self.recorded

    def by_hand_unscaled_is_ambiguous(self):
        """Whether get_unscaled_gradients of a loss scaled by hand could divide by the
        recorded scale or by the scale now (the rule: recorded while a variable awaits its
        apply; tfdls marks every variable given to apply, this reference only those with a
        gradient), with the two different. Then the step runs as keras3 instead."""
        return self.scale() != self.recorded and not set(ALL) <= self.tried

    def _apply(self, k, group, per_var, finite):
        """One apply by optimizer `k` of `group`: steps its scale; the gradients or None."""
        present = {i for i in group if per_var[i] is not None}
        if self.contracts[k] is not None:
            self.contracts[k].step(finite)
        applies = finite or self.contracts[k] is None
        if k == 0:
            self.tried |= present
            if applies:
                self.applied |= present
        if not applies:
            return None
        return [None if per_var[i] is None else per_var[i][1] for i in group]

    def _divided(self, values, s, keras3=True):
        """(given to apply, what it applies) for one variable's micro-batch gradients."""
        dtype = self.program.dtype
        if not values:
            return None
        scaled = [_times(s, c, dtype) for c in values]
        if keras3:
            given = _sum(scaled, dtype)
            return given, _round(given.astype(np.float64) / np.float64(s), dtype)
        parts = [_round(g.astype(np.float64) / np.float64(s), dtype) for g in scaled]
        given = _sum(parts, dtype)
        return given, given

    def step(self, step, inputs):
        """Returns one (optimizer, variable indices, gradients or None for a skip) per apply."""
        values = (inputs["w"], inputs["rows"], inputs["b"])
        if step.style in GROUPED:
            # One tape: every optimizer's gradients carry the scale its scale_loss
            # recorded, and each of its applies divides by that one.
            recorded = {k: self.scale(k) for k, _ in step.groups}
            self.scale_loss()
            events = []
            for k, group in step.groups:
                per_var = [self._divided(values[i], recorded[k]) if i in group else None
                           for i in ALL]
                finite = _finite([p[0] for p in per_var if p is not None])
                events.append((k, group, self._apply(k, group, per_var, finite)))
            return events
        if not step.style.startswith("by_hand"):  # by hand: the scale now, no scale_loss
            self.scale_loss()
        s = self.scale()
        keras3 = step.style.startswith("keras3") or step.style == "by_hand"
        per_var = [self._divided(v, s, keras3) for v in values]
        finite = _finite([p[0] for p in per_var if p is not None])
        return [(0, ALL, self._apply(0, ALL, per_var, finite))]


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


def _names_one_of(message, names):
    """Whether `message` names one of the variables `names` (as a word)."""
    return any(re.search(rf"(?<![\w/]){re.escape(n)}(?![\w])", message) for n in names)


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
            self.opts, self.twins = [], []
            for scale in (program.scale, program.second_scale):
                if scale is None:
                    continue
                opt = tfdls.LossScaleOptimizer(
                    make_optimizer(program.optimizer, "w", learning_rate=LR, **options),
                    scale.build(),
                )
                twin = make_optimizer(program.optimizer, "w", learning_rate=LR, **options)
                if program.build_first or strategy is not None or self.opts:
                    opt.build(self.variables)
                    twin.build(self.twin_variables)
                self.opts.append(opt)
                self.twins.append(twin)
            self.opt, self.twin = self.opts[0], self.twins[0]
        self.reference = _Reference(program)
        self.twin_steps = {}
        self.functions = {}  # what a step traced, kept for the later steps like it

    # The tfdls side ---------------------------------------------------------------

    def _terms(self, inputs, i):
        """Per variable, its term of micro-batch `i`'s loss (None: not in the loss)."""
        w, table, _ = self.variables
        terms = [tf.reduce_sum(w * inputs["w"][i]), None, None]
        if inputs["rows"]:
            rows = tf.gather(table, inputs["ids"])
            terms[1] = tf.reduce_sum(rows * tf.reshape(inputs["rows"][i], [IDS, TABLE_WIDTH]))
        if inputs["b"]:
            terms[2] = tf.reduce_sum(self.variables[2] * inputs["b"][i])
        return terms

    def _tape(self, inputs, i, scale_fn):
        with tf.GradientTape() as tape:
            loss = None
            for term in self._terms(inputs, i):
                if term is not None:
                    loss = term if loss is None else loss + term
            scaled = scale_fn(loss)
        return tape.gradient(scaled, self.variables)

    def _tfdls_step(self, step):
        opt, variables = self.opt, self.variables
        style, micro = step.style, len(step.w)

        def step_fn(inputs):
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
            if style in SPLIT_STYLES:
                keras3 = style == "split_keras3"
                grads = self._tape(inputs, 0, opt.scale_loss if keras3 else opt.get_scaled_loss)
                for _, group in step.groups:
                    part = [grads[i] for i in group]
                    own = [variables[i] for i in group]
                    if keras3:
                        opt.apply(part, own)
                    else:
                        opt.apply_gradients(zip(part, own))
                return
            if style in ("by_hand", "by_hand_unscaled"):
                grads = self._tape(
                    inputs, 0, lambda loss: loss * tf.cast(opt.loss_scale(), loss.dtype))
                if style == "by_hand":
                    opt.apply(grads, variables)
                else:
                    opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), variables))
                return
            if style == "two_optimizers":
                with tf.GradientTape(persistent=True) as tape:
                    terms = self._terms(inputs, 0)
                    scaled = {}
                    for k, group in step.groups:  # each optimizer scales its own loss
                        loss = tf.add_n([terms[i] for i in group if terms[i] is not None])
                        scaled[k] = self.opts[k].scale_loss(loss)
                grads = {k: tape.gradient(scaled[k], [variables[i] for i in group])
                         for k, group in step.groups}
                for k, group in step.groups:
                    self.opts[k].apply(grads[k], [variables[i] for i in group])
                return
            scaled = self._tape(inputs, 0, opt.get_scaled_loss)
            if style == "partial_unscale":
                unscaled = opt.get_unscaled_gradients([scaled[i] for i in step.unscaled])
                mixed = list(scaled)
                for i, g in zip(step.unscaled, unscaled):
                    mixed[i] = g
                opt.apply_gradients(zip(mixed, variables))
                return
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

        return step_fn

    def _run_tfdls(self, step, inputs):
        if step.context == "eager":
            self._tfdls_step(step)(inputs)
            return
        # What the traced Python reads of the step besides `inputs` (whose structure
        # tf.function follows by itself): a later step like it calls the same functions.
        key = (step.context, step.style, len(step.w), step.groups, step.unscaled)
        if key not in self.functions:
            self.functions[key] = self._functions(step)
        run = None
        for fn in self.functions[key]:
            run = fn(inputs if run is None else run)

    def _functions(self, step):
        """The `tf.function`s that run `step` in its context, called in turn (each on what
        the one before returned)."""
        fn = self._tfdls_step(step)
        context = step.context
        if context == "strategy":  # every replica gets the same inputs
            return [tf.function(lambda x: self.strategy.run(fn, args=(x,)))]
        if context in ("function", "xla"):
            return [tf.function(fn, jit_compile=context == "xla")]
        if context == "nested":
            inner = tf.function(fn)
            return [tf.function(lambda x: inner(x))]
        if context == "loop":

            def looped(x):
                for _ in tf.range(1):
                    fn(x)

            return [tf.function(looped)]
        if context == "cross":
            opt, variables = self.opt, self.variables
            if step.style == "keras3":
                produce = tf.function(lambda x: self._tape(x, 0, opt.scale_loss))
            else:
                produce = tf.function(
                    lambda x: opt.get_unscaled_gradients(self._tape(x, 0, opt.get_scaled_loss))
                )
            return [produce, tf.function(lambda g: opt.apply(g, variables))]
        raise AssertionError(context)

    # The twin ----------------------------------------------------------------------------

    def _run_twin(self, k, group, grads, ids, compiled, eager):
        """Bare twin `k` applies `grads` to the variables `group` (None where tfdls got
        None), as tfdls' inner did."""
        twin = self.twins[k]
        if not twin.built:  # with every variable, as tfdls' first apply built its inner
            twin.build(self.twin_variables)
        variables = [self.twin_variables[i] for i in group]
        dense = []
        for i, g in zip(group, grads):
            if g is None:
                dense.append(None)
            elif i == 1:
                values = tf.constant(g.reshape(IDS, TABLE_WIDTH))
                shape = tf.constant(self.twin_variables[1].shape)
                dense.append(tf.IndexedSlices(values, tf.constant(ids), shape))
            else:
                dense.append(tf.constant(g))
        if eager:
            twin.apply(dense, variables)
            return
        key = (k, group, compiled, tuple(g is None for g in grads))
        if self.strategy:
            # Keras' bare optimizer fails on None gradients in strategy.run.
            variables = [v for v, g in zip(variables, dense) if g is not None]
            dense = [g for g in dense if g is not None]
        if key not in self.twin_steps:
            apply = _applier(twin, variables)
            if self.strategy:  # every replica applies them: summed, as tfdls' are
                apply = _per_replica(self.strategy, apply)
            self.twin_steps[key] = tf.function(apply, jit_compile=compiled)
        self.twin_steps[key](dense)

    # One step, checked --------------------------------------------------------------------

    def inputs(self, step):
        dtype = self.program.dtype
        poison = {"w": np.nan, "rows": np.inf, "b": np.inf}.get(step.poison)

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
        if step.style == "by_hand" and self.reference.by_hand_is_ambiguous():
            step = dataclasses.replace(step, style="keras3")
        if (step.style == "by_hand_unscaled"
                and self.reference.by_hand_unscaled_is_ambiguous()):
            step = dataclasses.replace(step, style="keras3")
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
            with pytest.raises(ValueError, match="tfdls") as raised:
                self._run_tfdls(step, inputs)
            if step.style == "partial_unscale":
                raw_names = [NAMES[i] for i, key in zip(ALL, ("w", "rows", "b"))
                             if raw[key] and i not in step.unscaled]
                assert _names_one_of(str(raised.value), raw_names), (
                    f"the error names none of the raw variables {raw_names}: {raised.value}")
            if expected_error == "all" and step.context == "eager":
                self.reference.scale_loss()  # it ran before the apply raised
        if expected_error in (None, "second"):
            # Flattened rows: the reference works on the gathered values.
            ref_inputs = {
                "w": [a.reshape(-1) for a in raw["w"]],
                "rows": [a.reshape(-1) for a in raw["rows"]],
                "b": [a.reshape(-1) for a in raw["b"]],
            }
            for k, group, grads in self.reference.step(step, ref_inputs):
                if grads is None:
                    continue
                plan = self.opts[k].step_plan
                compiled = step.context == "xla" or bool(plan and plan.compile)
                self._run_twin(k, group, grads, raw["ids"], compiled,
                               eager=step.context == "eager")

    def _expected_error(self, step):
        if (step.style == "by_hand_unscaled" and step.context != "eager"
                and not self.opt.built and self.opt.loss_scale.can_skip):
            # Traced before the build, with no scale_loss in the function: the record's
            # answer would depend on applies after the trace (a fixed scale has none).
            return "all"
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
        for opt, twin in zip(self.opts, self.twins):
            if opt.built and not twin.built:  # built by a skipped step: no update yet
                twin.build(self.twin_variables)
            assert len(opt.inner_optimizer.variables) == len(twin.variables)
            pairs += list(zip(opt.inner_optimizer.variables, twin.variables))
        for mine, twin in pairs:
            a = np.asarray(keras.ops.convert_to_numpy(mine), np.float64)
            b = np.asarray(keras.ops.convert_to_numpy(twin), np.float64)
            np.testing.assert_allclose(
                a, b, rtol=rtol, atol=1e-30, equal_nan=True,
                err_msg=f"{where}: {getattr(mine, 'path', mine.name)}",
            )
        for k, (opt, twin) in enumerate(zip(self.opts, self.twins)):
            assert int(opt.iterations.numpy()) == int(twin.iterations.numpy()), (where, k)
            contract = self.reference.contracts[k]
            if contract is not None:
                assert _scale_state(opt.loss_scale) == contract.state(), (where, k)


def _scale_state(ls):
    """A DynamicLossScale's state, as `ContractModel.state` gives it."""
    return (
        np.float32(ls.current_loss_scale.numpy()).tobytes(),
        int(ls.num_good_steps.numpy()),
        int(ls.hysteresis_budget.numpy()),
        int(ls.num_skipped_steps.numpy()),
        int(ls.steps_since_overflow.numpy()),
    )


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


_ONES = ((-1.0, -1.0, -1.0),)
# Explicit examples, run in the fast loop before the drawn ones: each class the
# drawn programs gained, in a form the code before these rules got wrong
# (the minimal examples hypothesis found there).
CLASS_EXAMPLES = (
    # Two applies per scale_loss; the scale grows after the first (period 1),
    # the second must divide by the recorded one. Then a loss scaled by hand.
    Program("SGD", Scale("dynamic", 3.0, 1, 1), "float32", (
        Step("eager", "split_keras3", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), "",
             groups=((0, (0, 1)), (0, (2,)))),
        Step("function", "by_hand", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), ""),
    )),
    # An overflow in the first of three applies: skipped, the scale halves; the
    # others divide by the recorded scale.
    Program("Adam", Scale("dynamic", 2.0**10, 2, 1), "float16", (
        Step("xla", "split_tf_keras", ((0.5, -0.25, 2.0),), ((1.0, -1.0, 0.5, 0.25, -2.0, 1.5),),
             ((-1.0, 0.75),), (1, 1, 3), "w", groups=((0, (0,)), (0, (2,)), (0, (1,)))),
    )),
    # get_unscaled_gradients on `w` only, `b` applied raw: a ValueError naming `b`.
    Program("SGD", Scale("dynamic", 3.0, 1, 1), "float32", (
        Step("function", "partial_unscale", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), "",
             unscaled=(0,)),
    )),
    # Two optimizers, each scaling its own loss; the second's group overflows.
    Program("SGD", Scale("dynamic", 2.0**4, 1, 1), "float32", (
        Step("function", "two_optimizers", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), "b",
             groups=((1, (2,)), (0, (0, 1)))),
    ), second_scale=Scale("dynamic", 2.0**6, 1, 1)),
    # A loss scaled by hand, unscaled by get_unscaled_gradients in a function traced
    # before the build: a ValueError (the record's answer would depend on later applies).
    # After a step that built the optimizer and applied every variable, the same
    # function (traced again) divides by the scale now, which has grown since.
    Program("SGD", Scale("dynamic", 3.0, 1, 1), "float32", (
        Step("function", "by_hand_unscaled", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), ""),
        Step("eager", "keras3", _ONES, ((0.5, -0.25, 1.0, 0.75, -1.0, 0.5),), ((-1.0, -1.0),),
             (0, 1, 2), ""),
        Step("function", "by_hand_unscaled", _ONES, (), ((-1.0, -1.0),), (0, 0, 0), ""),
    ), build_first=False),
)


@DEEP_TIMEOUT
@settings(max_examples=FAST_EXAMPLES, **_SETTINGS)
@given(program=_programs())
@example(program=CLASS_EXAMPLES[0])
@example(program=CLASS_EXAMPLES[1])
@example(program=CLASS_EXAMPLES[2])
@example(program=CLASS_EXAMPLES[3])
@example(program=CLASS_EXAMPLES[4])
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
# CPUs (tfdls raises, distribution/test_optimizer_mirrored.py).
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


# -- a float16 embedding with thousands of rows at one index ------------------------------
#
# The rows of an IndexedSlices gradient that share an index are added by the
# update; the sum guard vetoes a step only where twice the sum of those rows'
# largest magnitudes (the divided gradient's, in float64) exceeds float16's
# largest value. Such a step is skipped without lowering the loss scale;
# every other step applies, however many rows one index has (padding ids).

F16_MAX = 65504.0
PAD_ROWS, PAD_WIDTH = 4, 2


@dataclasses.dataclass(frozen=True)
class PaddingStep:
    heavy: int  # rows at `PaddingProgram.index`
    pattern: tuple  # row values, repeated over those rows
    others: tuple  # ((id, row values), ...): one row each at other indices


@dataclasses.dataclass(frozen=True)
class PaddingProgram:
    context: str
    momentum: float
    exponent: int  # the initial scale is 2**exponent
    increment_period: int
    hysteresis: int
    index: int
    steps: tuple


def _padding_rows(index, step):
    """(ids, row values as float64, twice the guard's bound at the heavy index)."""
    heavy = np.asarray(step.pattern, np.float64)[np.arange(step.heavy) % len(step.pattern)]
    ids = [index] * step.heavy + [i for i, _ in step.others]
    values = np.concatenate([heavy, np.asarray([v for _, v in step.others],
                                                np.float64).reshape(-1, PAD_WIDTH)])
    return np.asarray(ids, np.int32), values, 2.0 * float(np.sum(np.max(np.abs(heavy), axis=1)))


def _small_value(draw, low=-8, high=3):
    return draw(st.sampled_from([-1.0, 1.0])) * draw(
        st.sampled_from([1.0, 1.25, 1.5, 1.75])) * 2.0 ** draw(st.integers(low, high))


@st.composite
def _padding_programs(draw):
    index = draw(st.integers(0, PAD_ROWS - 1))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        pattern = tuple(tuple(_small_value(draw) for _ in range(PAD_WIDTH))
                        for _ in range(draw(st.integers(1, 3))))
        others = tuple(
            (draw(st.sampled_from([i for i in range(PAD_ROWS) if i != index])),
             tuple(_small_value(draw) for _ in range(PAD_WIDTH)))
            for _ in range(draw(st.integers(0, 3)))
        )
        step = PaddingStep(draw(st.integers(1000, 20000)), pattern, others)
        bound = _padding_rows(index, step)[2]
        # Not within 2% of the limit: the guard's own float64 sum may round there.
        assume(abs(bound - F16_MAX) > 0.02 * F16_MAX)
        steps.append(step)
    return PaddingProgram(
        context=draw(st.sampled_from(["eager", "function", "xla"])),
        momentum=draw(st.sampled_from([0.0, 0.5])),
        exponent=draw(st.integers(0, 6)),
        increment_period=draw(st.integers(1, 2)),
        hysteresis=draw(st.integers(1, 2)),
        index=index,
        steps=tuple(steps),
    )


def _run_padding(program):
    check_memory_maps("this example")
    start = np.random.default_rng(1).normal(size=(PAD_ROWS, PAD_WIDTH)).astype(np.float16)
    table = keras.Variable(start, dtype="float16", name="table")
    twin_table = keras.Variable(start, dtype="float16", name="table")
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(LR, momentum=program.momentum),
        tfdls.DynamicLossScale(2.0**program.exponent, program.increment_period,
                               hysteresis=program.hysteresis),
    )
    twin = keras.optimizers.SGD(LR, momentum=program.momentum)
    opt.build([table])
    twin.build([twin_table])
    contract = ContractModel(2.0**program.exponent, program.increment_period,
                             hysteresis=program.hysteresis)

    def step_fn(ids, values):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * values)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, [table]), [table])

    def twin_fn(ids, values):
        twin.apply([tf.IndexedSlices(values, ids, tf.constant([PAD_ROWS, PAD_WIDTH]))],
                   [twin_table])

    eager = program.context == "eager"
    run = step_fn if eager else tf.function(step_fn, jit_compile=program.context == "xla")
    twin_run = None
    mine = [table, *opt.inner_optimizer.variables]
    theirs = [twin_table, *twin.variables]
    for i, step in enumerate(program.steps):
        where = f"after step {i} ({step.heavy} rows at one index)"
        ids, values, bound = _padding_rows(program.index, step)
        ids, values = tf.constant(ids), tf.constant(values.astype(np.float16))
        before, scale_before = _bits(mine), float(opt.loss_scale().numpy())
        run(ids, values)
        if bound > F16_MAX:  # vetoed by the sum guard: skipped, the scale not lowered
            assert _bits(mine) == before, f"{where}: a vetoed step changed the variables"
            scale_after = float(opt.loss_scale().numpy())
            assert scale_after >= scale_before, (
                f"{where}: the sum guard's veto lowered the loss scale "
                f"{scale_before} -> {scale_after}")
            # What else a veto does to the counters is not drawn: go on from there.
            contract.s = np.float32(scale_after)
            contract.g = int(opt.loss_scale.num_good_steps.numpy())
            contract.h = int(opt.loss_scale.hysteresis_budget.numpy())
            contract.skipped = int(opt.loss_scale.num_skipped_steps.numpy())
            contract.since = int(opt.loss_scale.steps_since_overflow.numpy())
            continue
        contract.step(True)
        if eager:
            twin_fn(ids, values)
        else:
            if twin_run is None:
                plan = opt.step_plan
                compiled = program.context == "xla" or bool(plan and plan.compile)
                twin_run = tf.function(twin_fn, jit_compile=compiled)
            twin_run(ids, values)
        assert int(opt.iterations.numpy()) == int(twin.iterations.numpy()), (
            f"{where}: skipped (the rows' sum cannot overflow: it must apply)")
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(
                np.asarray(a.numpy(), np.float64), np.asarray(b.numpy(), np.float64),
                rtol=2e-3, atol=1e-30, err_msg=f"{where}: {a.path}")
        assert _scale_state(opt.loss_scale) == contract.state(), where


@DEEP_TIMEOUT
@settings(max_examples=SIDE_FAST_EXAMPLES, **_SETTINGS)
@given(program=_padding_programs())
# 5194 rows of 1 at one index: must apply. 13363 rows of up to 4: vetoed, the
# scale kept (the minimal examples hypothesis found in the code before).
@example(program=PaddingProgram("eager", 0.0, 0, 1, 1, 0, (
    PaddingStep(5194, ((-1.0, -1.0),), ()),)))
@example(program=PaddingProgram("function", 0.0, 1, 1, 1, 0, (
    PaddingStep(13363, ((-4.0, -1.0), (-1.0, -1.0)), ((1, (-1.0, -1.0)),)),
    PaddingStep(3000, ((2.0, -1.0),), ()),)))
def test_padding_heavy_embedding(program):
    _run_padding(program)


@pytest.mark.slow
@DEEP_TIMEOUT
@settings(max_examples=SIDE_FULL_EXAMPLES, **_SETTINGS)
@given(program=_padding_programs())
def test_padding_heavy_embedding_full_budget(program):
    _run_padding(program)


# -- scale boundaries: two optimizers, auxiliary losses -----------------------------------
#
# A small float32 MLP (`WIDTHS`, tanh) with a boundary after every layer
# (`tfdls.add_scale_boundaries(model, every=1)`), its boundaries' factors
# drawn (2**1 to 2**5, so a gradient that did not cross one is divided
# wrongly by at least 2), and a float64 reference: SGD on the true gradient
# of the same network, computed in float64 from the weights before the step.

WIDTHS = (3, 4, 3, 2)
BATCH = 2
BOUNDARY_LR = 0.125
# "compiled_apply": a tf.function whose optimizers compile apply() as an XLA cluster
# of its own (jit_compile=True), which reads the factors before and writes them after.
BOUNDARY_MODES = ("eager", "function", "xla", "compiled_apply")


def _apply_jit(mode):
    """The optimizers' jit_compile in a boundary mode."""
    return True if mode == "compiled_apply" else "auto"


def _boundary_model(seed, exponents):
    rng = np.random.default_rng(seed)
    top = len(WIDTHS) - 2
    plain = keras.Sequential([keras.Input((WIDTHS[0],))] + [
        keras.layers.Dense(n, activation=None if i == top else "tanh", name=f"d{i}")
        for i, n in enumerate(WIDTHS[1:])
    ])
    plain.set_weights([
        (rng.normal(size=shape) * 0.5).astype(np.float32)
        for a, b in zip(WIDTHS, WIDTHS[1:]) for shape in ((a, b), (b,))
    ])
    placed = tfdls.add_scale_boundaries(plain, every=1)
    boundaries = [layer for layer in placed.layers if isinstance(layer, tfdls.ScaleBoundary)]
    assert len(boundaries) == len(exponents)
    for boundary, exponent in zip(boundaries, exponents):
        boundary.log2_factor.assign(float(exponent))
    return placed


def _activations64(weights, x):
    """The plain network in float64: every Dense layer's output."""
    h, outputs = tf.constant(np.asarray(x, np.float64)), []
    for i in range(0, len(weights), 2):
        h = tf.matmul(h, weights[i]) + weights[i + 1]
        if i + 2 < len(weights):
            h = tf.tanh(h)
        outputs.append(h)
    return outputs


def _sgd_deltas(variables, loss64):
    """-lr * the float64 gradient of `loss64(weights)` at `variables`' values."""
    weights = [tf.Variable(np.asarray(v.numpy(), np.float64)) for v in variables]
    with tf.GradientTape() as tape:
        loss = loss64(weights)
    return [-BOUNDARY_LR * g.numpy() for g in tape.gradient(loss, weights)]


def _check_deltas(variables, before, expected, where):
    for v, old, delta in zip(variables, before, expected):
        np.testing.assert_allclose(
            np.asarray(v.numpy(), np.float64) - old, delta, rtol=1e-4, atol=1e-6,
            err_msg=f"{where}: {v.path} is not SGD on the float64 gradient")


def _state_bits(model, opts):
    """Everything a refused step must leave alone: weights, factors, optimizers, scales."""
    bits = _bits(model.weights)
    for opt in opts:
        bits += _bits([*opt.inner_optimizer.variables, opt.iterations])
        bits.append(repr(_scale_state(opt.loss_scale)))
    return bits


def _matrix(draw, rows, cols):
    return tuple(tuple(_small_value(draw, -2, 1) for _ in range(cols)) for _ in range(rows))


@dataclasses.dataclass(frozen=True)
class OwnersProgram:
    mode: str
    given: tuple  # how optimizers 0 and 1 are given the model, in that order
    split: tuple  # per trainable variable, the optimizer that updates it
    orders: tuple  # per step, the optimizer that applies first
    exponents: tuple
    scales: tuple  # the optimizers' initial log2 scales
    seed: int
    x: tuple
    cy: tuple


@st.composite
def _owners_programs(draw):
    count = 2 * (len(WIDTHS) - 1)
    split = tuple(draw(st.lists(st.integers(0, 1), min_size=count, max_size=count)))
    assume(0 < sum(split) < count)
    return OwnersProgram(
        mode=draw(st.sampled_from(BOUNDARY_MODES)),
        given=tuple(draw(st.sampled_from(["constructor", "set"])) for _ in range(2)),
        split=split,
        orders=tuple(draw(st.lists(st.integers(0, 1), min_size=1, max_size=2))),
        exponents=tuple(draw(st.integers(1, 5)) for _ in range(len(WIDTHS) - 2)),
        scales=tuple(draw(st.integers(0, 8)) for _ in range(2)),
        seed=draw(st.integers(0, 3)),
        x=_matrix(draw, BATCH, WIDTHS[0]),
        cy=_matrix(draw, BATCH, WIDTHS[-1]),
    )


def _run_owners(program):
    """Two optimizers given one model, each updating its own variables: each apply
    divides by the factors its step's scale_loss recorded, so each is SGD on the
    true gradient, whichever applies first and whichever adapted the factors."""
    check_memory_maps("this example")
    model = _boundary_model(program.seed, program.exponents)
    variables = model.trainable_variables
    groups = [[v for v, k in zip(variables, program.split) if k == opt] for opt in (0, 1)]
    opts = []
    for k, how in enumerate(program.given):
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(BOUNDARY_LR), tfdls.DynamicLossScale(2.0 ** program.scales[k]),
            scale_boundaries=model if how == "constructor" else None,
            jit_compile=_apply_jit(program.mode))
        if how == "set":
            opt.set_scale_boundaries(model)
        opt.build(groups[k])
        opts.append(opt)
    x = tf.constant(np.asarray(program.x, np.float32))
    cy = tf.constant(np.asarray(program.cy, np.float32))

    def step_of(k):
        def step_fn(x):
            # One tape, each optimizer scaling its own loss; optimizer k applies.
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.reduce_sum(model(x) * cy)
                scaled = [opt.scale_loss(loss) for opt in opts]
            opts[k].apply(tape.gradient(scaled[k], groups[k]), groups[k])

        if program.mode == "eager":
            return step_fn
        return tf.function(step_fn, jit_compile=program.mode == "xla")

    steps = [step_of(0), step_of(1)]
    cy64 = np.asarray(program.cy, np.float64)
    for i, first in enumerate(program.orders):
        for k in (first, 1 - first):
            where = f"step {i}, optimizer {k} ({program.mode})"
            before = [np.asarray(v.numpy(), np.float64) for v in variables]
            expected = _sgd_deltas(
                variables, lambda w: tf.reduce_sum(_activations64(w, program.x)[-1] * cy64))
            steps[k](x)
            for j, group in enumerate(program.split):
                if group != k:
                    expected[j] = np.zeros_like(expected[j])
            _check_deltas(variables, before, expected, where)


_BOUNDARY_ONES = dict(x=((-1.0,) * WIDTHS[0],) * BATCH, cy=((-1.0,) * WIDTHS[-1],) * BATCH)


@DEEP_TIMEOUT
@settings(max_examples=SIDE_FAST_EXAMPLES, **_SETTINGS)
@given(program=_owners_programs())
@example(program=OwnersProgram("function", ("constructor", "set"), (0, 0, 0, 0, 1, 1), (1, 0),
                               (1, 2), (0, 3), 0, **_BOUNDARY_ONES))
@example(program=OwnersProgram("compiled_apply", ("constructor", "set"), (0, 1, 1, 0, 1, 0),
                               (1, 0), (3, 2), (2, 0), 1, **_BOUNDARY_ONES))
def test_two_optimizers_given_one_model_with_boundaries(program):
    _run_owners(program)


@pytest.mark.slow
@DEEP_TIMEOUT
@settings(max_examples=SIDE_FULL_EXAMPLES, **_SETTINGS)
@given(program=_owners_programs())
def test_two_optimizers_given_one_model_with_boundaries_full_budget(program):
    _run_owners(program)


@dataclasses.dataclass(frozen=True)
class AuxProgram:
    mode: str
    api: str  # keras3 (scale_loss + apply) | tf_keras (get_scaled_loss + apply_gradients)
    variant: str  # how the inner activation is computed (see `_run_aux`)
    cut: int  # the Dense layer whose output the auxiliary term reads (below the top)
    exponents: tuple
    scale: int  # the initial log2 scale
    seed: int
    steps: int
    x: tuple
    cy: tuple
    ca: tuple


@st.composite
def _aux_programs(draw):
    cut = draw(st.integers(0, len(WIDTHS) - 3))
    return AuxProgram(
        mode=draw(st.sampled_from(BOUNDARY_MODES)),
        api=draw(st.sampled_from(["keras3", "tf_keras"])),
        variant=draw(st.sampled_from(["layers", "placed_layers", "submodel"])),
        cut=cut,
        exponents=tuple(draw(st.integers(1, 5)) for _ in range(len(WIDTHS) - 2)),
        scale=draw(st.integers(0, 8)),
        seed=draw(st.integers(0, 3)),
        steps=draw(st.integers(1, 2)),
        x=_matrix(draw, BATCH, WIDTHS[0]),
        cy=_matrix(draw, BATCH, WIDTHS[-1]),
        ca=_matrix(draw, BATCH, WIDTHS[cut + 1]),
    )


def _run_aux(program):
    """A loss term from an inner activation, through the model's own lower layers, in
    the same tape: the step raises ValueError and changes nothing, or is SGD on the
    float64 gradient of the whole loss."""
    check_memory_maps("this example")
    model = _boundary_model(program.seed, program.exponents)
    variables = model.trainable_variables
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(BOUNDARY_LR), tfdls.DynamicLossScale(2.0**program.scale),
        scale_boundaries=model, jit_compile=_apply_jit(program.mode))
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    cut_layer = dense[program.cut]
    if program.variant == "layers":  # the Dense layers below the cut, called by hand
        lower = dense[: program.cut + 1]
    elif program.variant == "placed_layers":  # the model's layers up to the cut, boundaries too
        lower = model.layers[: model.layers.index(cut_layer) + 1]
    else:  # a feature extractor sharing the model's input and its UnscaledInput
        # (the layers are shared with the model without boundaries, whose graph
        # their `.output` would read: the extractor is traced from this model's input)
        features = model.inputs[0]
        for layer in model.layers[: model.layers.index(cut_layer) + 1]:
            features = layer(features)
        lower = [keras.Model(model.inputs, features)]
    x = tf.constant(np.asarray(program.x, np.float32))
    cy = tf.constant(np.asarray(program.cy, np.float32))
    ca = tf.constant(np.asarray(program.ca, np.float32))

    def step_fn(x):
        with tf.GradientTape() as tape:
            inner = x
            for layer in lower:
                inner = layer(inner)
            loss = tf.reduce_sum(model(x) * cy) + tf.reduce_sum(inner * ca)
            if program.api == "keras3":
                scaled = opt.scale_loss(loss)
            else:
                scaled = opt.get_scaled_loss(loss)
        grads = tape.gradient(scaled, variables)
        if program.api == "keras3":
            opt.apply(grads, variables)
        else:
            opt.apply_gradients(zip(grads, variables))

    run = step_fn if program.mode == "eager" else tf.function(
        step_fn, jit_compile=program.mode == "xla")
    cy64, ca64 = np.asarray(program.cy, np.float64), np.asarray(program.ca, np.float64)

    def loss64(weights):
        outputs = _activations64(weights, program.x)
        return tf.reduce_sum(outputs[-1] * cy64) + tf.reduce_sum(outputs[program.cut] * ca64)

    for i in range(program.steps):
        where = f"step {i} ({program.mode}, {program.variant}, cut {program.cut})"
        state = _state_bits(model, [opt])
        before = [np.asarray(v.numpy(), np.float64) for v in variables]
        expected = _sgd_deltas(variables, loss64)
        try:
            run(x)
        except ValueError:
            assert _state_bits(model, [opt]) == state, f"{where}: the refused step changed state"
            return
        _check_deltas(variables, before, expected, where)


@DEEP_TIMEOUT
@settings(max_examples=SIDE_FAST_EXAMPLES, **_SETTINGS)
@given(program=_aux_programs())
@example(program=AuxProgram("eager", "keras3", "layers", 1, (1, 1), 0, 0, 1,
                            ca=((-1.0,) * WIDTHS[2],) * BATCH, **_BOUNDARY_ONES))
@example(program=AuxProgram("function", "tf_keras", "submodel", 0, (2, 1), 3, 1, 2,
                            ca=((0.5,) * WIDTHS[1],) * BATCH, **_BOUNDARY_ONES))
@example(program=AuxProgram("compiled_apply", "keras3", "placed_layers", 1, (4, 2), 2, 2, 2,
                            ca=((-1.0,) * WIDTHS[2],) * BATCH, **_BOUNDARY_ONES))
def test_auxiliary_loss_below_boundaries(program):
    _run_aux(program)


@pytest.mark.slow
@DEEP_TIMEOUT
@settings(max_examples=SIDE_FULL_EXAMPLES, **_SETTINGS)
@given(program=_aux_programs())
def test_auxiliary_loss_below_boundaries_full_budget(program):
    _run_aux(program)
