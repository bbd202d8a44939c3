"""Loss scales: a small state machine that keeps float16 gradients in range.

A loss scale multiplies the loss before differentiation, so that small
gradients do not underflow in float16, and decides after each step whether the
gradients are usable. Every loss scale has the same interface:

* ``loss_scale()`` - the current scale, a float32 scalar tensor;
* ``loss_scale.update(grads)`` - returns ``(update_op, should_apply_gradients)``;
* ``get_config()`` / ``Class.from_config(config)``.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import numpy as np
import tensorflow as tf

from tfdls import _compat, finite
from tfdls._distribute import state_variable
from tfdls._division import is_power_of_two

_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Smallest normal float32: TensorFlow's CPU kernels flush subnormals to zero,
# so a subnormal scale could silently become 0.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _check_scale(name, value, allow_none=False):
    """Validates a positive, finite, float32-representable scale argument."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"`{name}` must be a positive number; got {name}={value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive, finite number; got {name}={value!r}")
    if value > _FLOAT32_MAX or value < _FLOAT32_TINY:
        raise ValueError(
            f"`{name}` must be a normal positive float32 (between {_FLOAT32_TINY!r} and "
            f"{_FLOAT32_MAX!r}); got {name}={value!r}"
        )
    return value


def _floor_to_power_of_two(value):
    """The largest power of two <= `value`, a positive normal float32: its exponent bits."""
    bits = tf.bitcast(value, tf.int32)
    sign_and_exponent = tf.constant(-(1 << 23), tf.int32)  # 0xFF800000
    return tf.bitcast(tf.bitwise.bitwise_and(bits, sign_and_exponent), tf.float32)


def _read_scale(variable, powers_of_two, minimum=None, maximum=None, if_nan=None):
    """A scale variable's value, as the scale's configuration allows it to be.

    The variable holds such a value unless something else wrote it (a
    checkpoint of a differently configured scale, an assignment). What is
    used then, to scale the loss and to divide the gradients alike, is the
    value clamped to ``[minimum, maximum]`` (so that a check of the scaled
    gradients, chosen because the scale cannot fall below 1, stays right)
    and, for a scale that only takes powers of two, the power of two below
    it (so that dividing by a multiplication stays exact). With `minimum`
    given, the scale is a dynamic one, which is never inf or NaN: without
    `maximum` it is clamped to the largest finite float32, and a NaN reads as
    `if_nan` (Keras' layout of a `.keras` file is read the same way).
    """
    value = tf.convert_to_tensor(variable)
    if minimum is None:
        return _floor_to_power_of_two(value) if powers_of_two else value
    # NaN passes through maximum and minimum: replaced first.
    value = tf.where(tf.math.is_nan(value), tf.constant(if_nan, value.dtype), value)
    value = tf.minimum(tf.maximum(value, minimum), _LARGEST_FLOAT32 if maximum is None
                       else maximum)
    return _floor_to_power_of_two(value) if powers_of_two else value


_LARGEST_FLOAT32 = float(np.finfo(np.float32).max)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int >= {minimum}; got {name}={value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {name}={value!r}")
    return int(value)


class LossScale(tf.Module, metaclass=abc.ABCMeta):
    """Base class of loss scales: a `tf.Module` whose state is `tf.Variable`s.

    Subclasses implement `__call__`, `update` and `get_config`; a custom loss
    scale passed to `LossScaleOptimizer` is driven through `update(grads)`,
    which receives the *unscaled* gradients (as in TensorFlow 2.4) and must
    return the same decision on every replica.

    Example, a scale that halves on overflow and never grows:

    >>> class HalvingLossScale(tfdls.LossScale):
    ...     def __init__(self, value=2.0**15):
    ...         super().__init__()
    ...         self.value = tf.Variable(value, trainable=False)
    ...     def __call__(self):
    ...         return tf.convert_to_tensor(self.value)
    ...     def update(self, grads):
    ...         # across_replicas: one replica's overflow skips the step everywhere.
    ...         ok = tfdls.all_finite(grads, across_replicas=True)
    ...         op = self.value.assign(tf.where(ok, self.value, self.value / 2))
    ...         return op, ok
    ...     def get_config(self):
    ...         return {"value": float(self.value.numpy())}
    >>> ls = HalvingLossScale()
    >>> _, ok = ls.update([tf.constant([1.0, float("inf")])])
    >>> bool(ok), float(ls())
    (False, 16384.0)
    """

    @abc.abstractmethod
    def __call__(self) -> tf.Tensor:
        """Returns the current loss scale as a float32 scalar tensor."""

    @abc.abstractmethod
    def update(self, grads: Any) -> tuple[Any, tf.Tensor | bool]:
        """Updates the state from this step's gradients.

        Args:
            grads: a nest of unscaled gradient tensors, `tf.IndexedSlices` or
                `None` (`LossScaleOptimizer` passes the gradients it is about
                to apply, already divided by the scale). Under a
                `tf.distribute` strategy these are one replica's gradients:
                the decision must be agreed on by all replicas (see
                `tfdls.all_finite(grads, across_replicas=True)`).

        Returns:
            `(update_op, should_apply_gradients)`: what updates the state
            when evaluated in a graph (`None` in eager mode, where the update
            has happened) and whether the gradients may be applied (a scalar
            bool tensor, or the Python bool `True`). As in TF 2.4,
            `DynamicLossScale` returns a scalar bool tensor as `update_op` in
            a graph (`tf.identity` and `session.run` accept it) and
            `FixedLossScale` returns `tf.no_op()`.
        """

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments as a JSON-friendly dict."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        return cls(**config)

    # -- what `LossScaleOptimizer` asks of a scale, answered when a step is traced --

    @property
    def min_value(self) -> float | None:
        """The smallest value this scale takes; None where unknown (a custom scale)."""
        return None

    @property
    def can_skip(self) -> bool:
        """Whether a step may be skipped; a scale that never skips never changes."""
        return True

    @property
    def always_power_of_two(self) -> bool:
        """Whether every value `__call__` returns is a power of two (dividing is exact
        as a multiplication). False unless the class says so: a subclass may compute
        its value otherwise."""
        return False

    @property
    def decides_from_gradients(self) -> bool:
        """Whether `update(unscaled_grads)` decides the step (TF 2.4 style); False for a
        scale driven by `update_from_decision`, whose check the optimizer shares with
        overflow attribution."""
        return True

    @property
    def skipped_steps(self) -> tf.Tensor | None:
        """Steps skipped so far (int64 tensor); None where the scale does not count them.
        A custom scale may count them under `DynamicLossScale`'s name, `num_skipped_steps`."""
        return getattr(self, "num_skipped_steps", None)


class FixedLossScale(LossScale):
    """A loss scale that never changes; every step's gradients are applied.

    The value is kept in a non-trainable variable, `current_loss_scale`, as
    a `DynamicLossScale` keeps its own: a constant divisor would let
    TensorFlow's and XLA's compilers rewrite ``g / c`` as ``g * (1 / c)``,
    which is not correctly rounded (and zero above 2**126, where ``1 / c``
    is subnormal). Checkpoints carry it like any variable.

    Args:
        loss_scale_value: the constant scale, a positive finite number.

    Example:

    >>> ls = tfdls.FixedLossScale(128.0)
    >>> float(ls())
    128.0
    >>> ls.update([tf.constant(float("inf"))])[1]
    True
    """

    def __init__(self, loss_scale_value: float, name: str | None = None):
        super().__init__(name=name)
        self._loss_scale_value = _check_scale("loss_scale_value", loss_scale_value)
        self._powers_of_two = is_power_of_two(self._loss_scale_value)
        with self.name_scope:
            self.current_loss_scale = state_variable(
                "current_loss_scale", self._loss_scale_value, tf.float32
            )

    @property
    def loss_scale_value(self) -> float:
        return self._loss_scale_value

    @property
    def powers_of_two(self) -> bool:
        """True if the value is a power of two (dividing by it is a multiplication)."""
        return self._powers_of_two

    min_value = property(lambda self: self._loss_scale_value)
    can_skip = property(lambda self: False)
    decides_from_gradients = property(lambda self: False)

    @property
    def always_power_of_two(self) -> bool:
        return type(self) is FixedLossScale and self._powers_of_two

    def __call__(self) -> tf.Tensor:
        return _read_scale(self.current_loss_scale, self._powers_of_two)

    def update(self, grads: Any) -> tuple[Any, bool]:
        del grads
        # A Python True lets callers skip the tf.cond entirely.
        return tf.no_op(), True

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": self._loss_scale_value}

    def __repr__(self):
        return f"FixedLossScale({self._loss_scale_value})"


class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients are finite and shrinks on overflow.

    State: scale ``s``, good-step counter ``g`` and hysteresis budget ``h``
    (starts at ``hysteresis``). Each ``update(grads)`` does::

        if all gradients are finite:
            g += 1
            if g >= increment_period:
                c = s * multiplier
                if max_loss_scale is set: c = min(c, max_loss_scale)
                if c is finite: s = c        # an infinite product keeps s
                g = 0
                h = hysteresis
            should_apply = True
        else:
            g = 0
            h = max(h - 1, 0)
            if h == 0:
                if backoff_factor is set: s = max(s * backoff_factor, min_loss_scale)
                else:                     s = max(s / multiplier, min_loss_scale)
            should_apply = False

    With every keyword-only argument at its default this is, bit for bit, the
    TensorFlow 2.4 ``tf.mixed_precision.experimental.DynamicLossScale``. The
    scale can never become 0, inf or NaN: it stays within
    ``[min_loss_scale, max_loss_scale]``.

    When the initial scale, multiplier, bounds and backoff factor are all
    powers of two (the defaults are), every scale the algorithm reaches is
    one too (`powers_of_two`), and the scale in use is always a power of two:
    a value written into ``current_loss_scale`` from elsewhere (a checkpoint
    of a differently configured scale) is read as the power of two below it.
    Dividing gradients by the scale is then an exact multiplication. Such a
    value is also read clamped to ``[min_loss_scale, max_loss_scale]`` (inf,
    without ``max_loss_scale``, as the largest finite float32) and a NaN as
    ``initial_loss_scale``: the scale in use always respects the bounds.

    Two counters are kept for monitoring (they do not affect the algorithm):
    ``num_skipped_steps`` (total steps with non-finite gradients) and
    ``steps_since_overflow``.

    Args:
        initial_loss_scale: the starting scale. Start high: a scale that is too
            high falls by ``multiplier`` per step, one that is too low rises
            only once per ``increment_period`` steps.
        increment_period: grow after this many consecutive finite steps.
        multiplier: growth factor (> 1); also the shrink divisor unless
            ``backoff_factor`` is given.
        backoff_factor: optional shrink factor in (0, 1), as in PyTorch.
        min_loss_scale: the scale never falls below this (may be far below 1).
        max_loss_scale: optional cap on growth.
        hysteresis: how many overflow steps (since the last growth) it takes
            to shrink the scale; 1 shrinks on every overflow.

    Example:

    >>> ls = tfdls.DynamicLossScale(initial_loss_scale=8.0, increment_period=2)
    >>> _ = ls.update([tf.constant(1.0)]); _ = ls.update([tf.constant(1.0)])
    >>> float(ls())
    16.0
    >>> _, should_apply = ls.update([tf.constant(float("nan"))])
    >>> bool(should_apply), float(ls())
    (False, 8.0)
    """

    def __init__(
        self,
        initial_loss_scale: float = 2**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
        *,
        backoff_factor: float | None = None,
        min_loss_scale: float = 1.0,
        max_loss_scale: float | None = None,
        hysteresis: int = 1,
        name: str | None = None,
    ):
        super().__init__(name=name)
        self._initial_loss_scale = _check_scale("initial_loss_scale", initial_loss_scale)
        self._increment_period = _check_int("increment_period", increment_period, 1)
        self._multiplier = _check_scale("multiplier", multiplier)
        if self._multiplier <= 1:
            raise ValueError(f"`multiplier` must be > 1; got multiplier={multiplier!r}")
        if backoff_factor is not None:
            if isinstance(backoff_factor, bool) or not isinstance(
                backoff_factor, (int, float, np.number)
            ):
                raise TypeError(
                    "`backoff_factor` must be a number in (0, 1) or None; "
                    f"got backoff_factor={backoff_factor!r}"
                )
            if not 0 < float(backoff_factor) < 1:
                raise ValueError(
                    "`backoff_factor` must be in (0, 1); "
                    f"got backoff_factor={backoff_factor!r}"
                )
            backoff_factor = float(backoff_factor)
        self._backoff_factor = backoff_factor
        self._min_loss_scale = _check_scale("min_loss_scale", min_loss_scale)
        self._max_loss_scale = _check_scale("max_loss_scale", max_loss_scale, allow_none=True)
        if self._max_loss_scale is not None and self._max_loss_scale < self._min_loss_scale:
            raise ValueError(
                f"`max_loss_scale` must be >= min_loss_scale={self._min_loss_scale}; "
                f"got max_loss_scale={max_loss_scale!r}"
            )
        self._hysteresis = _check_int("hysteresis", hysteresis, 1)
        self._powers_of_two = all(
            v is None or is_power_of_two(v)
            for v in (
                self._initial_loss_scale,
                self._multiplier,
                self._backoff_factor,
                self._min_loss_scale,
                self._max_loss_scale,
            )
        )
        if self._initial_loss_scale < self._min_loss_scale:
            raise ValueError(
                f"`initial_loss_scale` must be >= min_loss_scale={self._min_loss_scale}; "
                f"got initial_loss_scale={initial_loss_scale!r}"
            )
        if self._max_loss_scale is not None and self._initial_loss_scale > self._max_loss_scale:
            raise ValueError(
                f"`initial_loss_scale` must be <= max_loss_scale={self._max_loss_scale}; "
                f"got initial_loss_scale={initial_loss_scale!r}"
            )

        with self.name_scope:
            self.current_loss_scale = state_variable(
                "current_loss_scale", self._initial_loss_scale, tf.float32
            )
            # Consecutive finite steps since the last overflow or growth.
            self.num_good_steps = state_variable("good_steps", 0, tf.int64)
            # Overflows still tolerated before the scale shrinks.
            self.hysteresis_budget = state_variable(
                "hysteresis_budget", self._hysteresis, tf.int64
            )
            # Monitoring only: never read by the algorithm.
            self.num_skipped_steps_variable = state_variable("skipped_steps", 0, tf.int64)
            self.steps_since_overflow_variable = state_variable(
                "steps_since_overflow", 0, tf.int64
            )

    initial_loss_scale = property(lambda self: self._initial_loss_scale)
    increment_period = property(lambda self: self._increment_period)
    multiplier = property(lambda self: self._multiplier)
    backoff_factor = property(lambda self: self._backoff_factor)
    min_loss_scale = property(lambda self: self._min_loss_scale)
    max_loss_scale = property(lambda self: self._max_loss_scale)
    hysteresis = property(lambda self: self._hysteresis)

    @property
    def powers_of_two(self) -> bool:
        """True if every scale this can reach is a power of two (see the class docstring)."""
        return self._powers_of_two

    min_value = property(lambda self: self._min_loss_scale)

    @property
    def always_power_of_two(self) -> bool:
        return type(self) is DynamicLossScale and self._powers_of_two

    @property
    def decides_from_gradients(self) -> bool:
        # A subclass that overrides update() decides from the gradients, as in TF 2.4.
        return type(self).update is not DynamicLossScale.update

    @property
    def skipped_steps(self) -> tf.Tensor:
        return self.num_skipped_steps

    @property
    def num_skipped_steps(self) -> tf.Tensor:
        """Total number of steps skipped for non-finite gradients (int64 tensor)."""
        return tf.convert_to_tensor(self.num_skipped_steps_variable)

    @property
    def steps_since_overflow(self) -> tf.Tensor:
        """Steps since the last skipped step, or since the start (int64 tensor)."""
        return tf.convert_to_tensor(self.steps_since_overflow_variable)

    def __call__(self) -> tf.Tensor:
        return self._current()

    def _current(self):
        return _read_scale(
            self.current_loss_scale, self._powers_of_two, self._min_loss_scale,
            self._max_loss_scale, if_nan=self._initial_loss_scale,
        )

    def update(self, grads: Any) -> tuple[Any, tf.Tensor]:
        is_finite = finite.all_finite(grads, across_replicas=True)
        return self.update_from_decision(is_finite), is_finite

    def update_from_decision(self, decision: Any, scale: Any = None) -> Any:
        """Advances the state machine given an already-agreed decision.

        Branch-free: both outcomes are computed on a handful of scalars and
        selected with `tf.where`, so there is no `tf.cond` (cheap under XLA,
        and safe to run in replica context under any strategy). Returns
        `update`'s `update_op`.

        Args:
            decision: whether every gradient was finite (on every replica), a
                scalar bool; or a `LossScaleOptimizer` step's decision, with
                ``is_finite`` and ``lowers_scale``: whether a skipped step's
                overflow is the scale's to answer. A skipped step that does not
                lower the scale (a `tfdls.ScaleBoundary` lowered its factor
                instead, or only the sums of finite gradients could overflow)
                still counts as skipped and resets the good-step count, but
                leaves the scale and the hysteresis budget.
            scale: the scale as this step read it (``self()``), if it has;
                read again otherwise.
        """
        is_finite = getattr(decision, "is_finite", decision)
        lowers = getattr(decision, "lowers_scale", None)
        state = self._read_state(scale)
        after_finite = self._transition(state, finite=True)
        after_skipped = self._transition(state, finite=False, lowers_scale=lowers)
        updated = self._write({
            name: tf.where(is_finite, after_finite.get(name, value),
                           after_skipped.get(name, value))
            for name, value in state.items()})
        # The seed's value: its nested conds return their predicates, so a
        # finite step that reached increment_period reads True.
        grew = state["good_steps"] + 1 >= self._increment_period
        return _update_op(updated, tf.logical_and(is_finite, grew))

    def update_in_branch(self, finite: bool, scale: Any = None, lowers_scale: Any = None):
        """`update_from_decision` for one outcome, known when traced: the writes of a
        `tf.cond` branch taken where the step was finite (`finite`) or skipped.

        Args:
            finite: which outcome this branch is (a Python bool).
            scale: the scale as this step read it, if it has.
            lowers_scale: for a skipped step, as in `update_from_decision`.
        """
        if finite and not _compat.in_xla_context():
            return self._finite_step_in_branch(scale)
        state = self._read_state(scale, finite)
        return self._write(self._transition(state, finite, lowers_scale))

    def _finite_step_in_branch(self, scale):
        """A finite step's writes, with the growth in a branch of its own: most finite steps
        only count (two increments and the scale written back as read), a few grow.

        The same values as `_transition`'s finite outcome, bit for bit. Used outside XLA
        (graph mode, where each operation is a task of TensorFlow's executor and a branch
        not taken costs nothing, and eagerly); inside XLA the selection fuses into one
        kernel and stays.
        """
        good_steps = self.num_good_steps.assign_add(1)
        counted = self.steps_since_overflow_variable.assign_add(1)
        s = self._current() if scale is None else scale

        def grow():
            return self._write({"scale": self._grown(s), "good_steps": tf.constant(0, tf.int64),
                                "hysteresis_budget": tf.constant(self._hysteresis, tf.int64)})

        def count():
            # Written back as read: a value written from elsewhere leaves the
            # variable as the scale in use (see `_read_scale`), as the selection does.
            return self._write({"scale": s})

        # Every write in what is returned: a TF1 graph runs only what its caller runs.
        return tf.group(counted, tf.cond(good_steps >= self._increment_period, grow, count))

    def _read_state(self, scale=None, finite=None):
        """The state, by name: all of it, or what the `finite` outcome's transition reads.
        The scale is read for use (see `_read_scale`), unless this step's read is given."""
        variables = self._variables_by_name()
        if finite:  # a finite step leaves the skipped-step count
            del variables["skipped_steps"]
        state = {name: tf.convert_to_tensor(v) for name, v in variables.items()
                 if name != "scale"}
        state["scale"] = self._current() if scale is None else scale
        return state

    def _variables_by_name(self):
        return {
            "scale": self.current_loss_scale,
            "good_steps": self.num_good_steps,
            "hysteresis_budget": self.hysteresis_budget,
            "skipped_steps": self.num_skipped_steps_variable,
            "steps_since_overflow": self.steps_since_overflow_variable,
        }

    def _transition(self, state, finite, lowers_scale=None):
        """The state after a finite (`finite`) or skipped step: the values that may change,
        by name. The algorithm of the class docstring, once for each outcome."""
        s, g, h = state["scale"], state["good_steps"], state["hysteresis_budget"]
        if finite:
            grow = g + 1 >= self._increment_period
            return {
                "scale": tf.where(grow, self._grown(s), s),
                "good_steps": tf.where(grow, tf.zeros_like(g), g + 1),
                "hysteresis_budget": tf.where(grow, tf.constant(self._hysteresis, tf.int64), h),
                "steps_since_overflow": state["steps_since_overflow"] + 1,
            }
        # Clamped at 0: the budget counts overflows still tolerated, never
        # negative; at 0 every further overflow shrinks the scale.
        h_skipped = tf.maximum(h - 1, 0)
        if self._backoff_factor is None:
            # A true division, to match the seed bit for bit. Grappler and XLA
            # rewrite x / const into x * (1 / const), which is not correctly
            # rounded in float32; in float64 that error is far below float32
            # rounding, so the cast back gives the correctly rounded s / m.
            shrunk = tf.cast(
                tf.cast(s, tf.float64) / np.float64(np.float32(self._multiplier)), tf.float32
            )
        else:
            shrunk = s * tf.constant(self._backoff_factor, tf.float32)
        shrunk = tf.maximum(shrunk, self._min_loss_scale)
        s_skipped = tf.where(tf.equal(h_skipped, 0), shrunk, s)
        if lowers_scale is not None:
            s_skipped = tf.where(lowers_scale, s_skipped, s)
            h_skipped = tf.where(lowers_scale, h_skipped, h)
        return {
            "scale": s_skipped,
            "good_steps": tf.zeros_like(g),
            "hysteresis_budget": h_skipped,
            "skipped_steps": state["skipped_steps"] + 1,
            "steps_since_overflow": tf.zeros_like(state["steps_since_overflow"]),
        }

    def _grown(self, s):
        """The scale after growing from `s`: capped, and `s` where the product is infinite."""
        grown = s * tf.constant(self._multiplier, tf.float32)
        if self._max_loss_scale is not None:
            grown = tf.minimum(grown, self._max_loss_scale)
        return tf.where(tf.math.is_finite(grown), grown, s)

    def _write(self, values):
        variables = self._variables_by_name()
        return tf.group(*[variables[name].assign(value) for name, value in values.items()])

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_loss_scale": self._initial_loss_scale,
            "increment_period": self._increment_period,
            "multiplier": self._multiplier,
            "backoff_factor": self._backoff_factor,
            "min_loss_scale": self._min_loss_scale,
            "max_loss_scale": self._max_loss_scale,
            "hysteresis": self._hysteresis,
        }

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        if tf.executing_eagerly():
            args = f"current_loss_scale={float(self.current_loss_scale.numpy())}, " + args
        return f"DynamicLossScale({args})"


def _update_op(updated: Any, value: tf.Tensor) -> tf.Tensor | None:
    """The `update_op` TF 2.4's `DynamicLossScale.update` returns, for `updated`.

    Eagerly the update has happened: None, as the seed documents. In a graph
    (a `tf.function` or a TF1 graph) the seed returns the output of its
    `tf.cond`, a scalar bool tensor, and TF 2.4 code passes it to
    `tf.identity` or `session.run`, which an Operation from `tf.group`
    cannot go through; so `value`, read after the update.
    """
    if tf.executing_eagerly():
        return None
    with tf.control_dependencies([updated]):
        return tf.identity(value)


_CLASSES: dict[str, type[LossScale]] = {"FixedLossScale": FixedLossScale, "DynamicLossScale": DynamicLossScale}


def serialize(loss_scale: LossScale) -> dict[str, Any]:
    """Returns `{"class_name": ..., "config": ...}` for a loss scale.

    Example:

    >>> tfdls.serialize(tfdls.FixedLossScale(8))
    {'class_name': 'FixedLossScale', 'config': {'loss_scale_value': 8.0}}
    """
    if not isinstance(loss_scale, LossScale):
        raise TypeError(f"`loss_scale` must be a tfdls.LossScale; got loss_scale={loss_scale!r}")
    return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
    """Builds a loss scale from the output of `serialize`.

    Example:

    >>> ls = tfdls.deserialize(tfdls.serialize(tfdls.DynamicLossScale(hysteresis=2)))
    >>> ls.hysteresis
    2
    """
    if not isinstance(config, dict) or "class_name" not in config:
        raise ValueError(
            "`config` must be a dict with 'class_name' and 'config' keys, as returned "
            f"by tfdls.serialize; got config={config!r}"
        )
    cls = _CLASSES.get(config["class_name"])
    if cls is None:
        raise ValueError(
            f"Unknown loss scale class_name={config['class_name']!r}; "
            f"expected one of {sorted(_CLASSES)}"
        )
    return cls.from_config(dict(config.get("config", {})))


def get(identifier: str | float | dict[str, Any] | LossScale) -> LossScale:
    """Returns a loss scale for `identifier`.

    Args:
        identifier: ``"dynamic"`` (a default `DynamicLossScale`), a positive
            number (a `FixedLossScale`), a dict from `serialize`, or a
            `LossScale` (returned as is).

    Example:

    >>> tfdls.get("dynamic")
    DynamicLossScale(...)
    >>> tfdls.get(1024)
    FixedLossScale(1024.0)
    """
    if isinstance(identifier, LossScale):
        return identifier
    if isinstance(identifier, str):
        if identifier == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            f"Unknown loss scale identifier={identifier!r}; expected 'dynamic', a "
            "positive number, a config dict or a tfdls.LossScale"
        )
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, (int, float, np.number)) and not isinstance(identifier, bool):
        return FixedLossScale(identifier)
    raise ValueError(
        f"Could not interpret loss scale identifier={identifier!r}; expected 'dynamic', "
        "a positive number, a config dict or a tfdls.LossScale"
    )
