"""Overflow attribution and the policy for a scale stuck at its minimum.

Every step records on the device, without a branch or a host call: which
variables had non-finite gradients in the last skipped step, at which step,
and how many overflows happened with the scale already at its minimum
(`OverflowRecord`). The host reads that record only when asked: by
`LossScaleOptimizer.last_overflow()`, by `check_min_scale_policy()`, by
`tfdls.LossScaleMonitor` at its logging frequency and at the end of `fit`.

A scale that sits at `min_loss_scale` and still overflows cannot be rescued
by loss scaling: it is the usual sign of a real divergence (a learning rate
too high, a bad batch, a bug), not of float16's range. `MinScalePolicy`
decides what happens when the host sees one: ``"warn"`` (once, the default),
``"raise"`` (`LossScaleStuckError`) or ``"ignore"``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import tensorflow as tf

from tfdls import _compat, _packed_state

MIN_SCALE_POLICIES = ("warn", "raise", "ignore")


class LossScaleStuckError(RuntimeError):
    """Training keeps overflowing although the loss scale is at its minimum.

    Raised with ``min_scale_policy="raise"`` by the host-side checks
    (`LossScaleOptimizer.check_min_scale_policy()`, `last_overflow()`,
    `tfdls.LossScaleMonitor` and the end of `fit`), always as this exception
    itself, in eager, graph and XLA alike:

    >>> opt = tfdls.LossScaleOptimizer(
    ...     keras.optimizers.SGD(),
    ...     tfdls.DynamicLossScale(initial_loss_scale=1.0),
    ...     min_scale_policy="raise")
    >>> w = keras.Variable([1.0], name="w")
    >>> opt.apply([tf.constant([float("nan")])], [w])
    >>> opt.check_min_scale_policy()
    Traceback (most recent call last):
      ...
    tfdls.overflow.LossScaleStuckError: tfdls: the loss scale is at its minimum (1) and step 0 ...
    """


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """What the last skipped step looked like (see `LossScaleOptimizer.last_overflow`).

    Attributes:
        step: the skipped step's number, counting every step from 0, skipped
            ones included (the batch axis of `fit` and TensorBoard, for a
            record that began with the run).
        variable_names: paths of the variables whose gradients held NaN/Inf
            (on any replica), or, once divided, overflowed.
        loss_scale: the scale after the step's update.
        num_skipped_steps: total skipped steps so far.
        headroom_bits: with ``gradient_stats=True``, the headroom (in bits,
            below float16's maximum) each named variable's scaled gradient
            had on the last finite step; empty otherwise.
        applied_steps: the optimizer's `iterations` at the skipped step: the
            updates applied before it (skipped steps do not advance it).
        boundaries: with scale boundaries, the `tfdls.ScaleBoundary` layers
            that lowered their factor for this overflow (empty where the
            global loss scale shrank alone).
        sum_overflow_names: paths of the variables whose gradients were
            finite but a sum the inner optimizer forms of them could overflow
            (the replicas' sum, rows of one index of a `tf.IndexedSlices`,
            the accumulated gradient of ``gradient_accumulation_steps``).

    Example:

    >>> report = tfdls.OverflowReport(
    ...     step=308, variable_names=("sequential/dense_2/kernel",),
    ...     loss_scale=262144.0, num_skipped_steps=3, applied_steps=305)
    >>> print(report)
    step 308 (305 updates applied): non-finite gradients for sequential/dense_2/kernel; loss scale now 262144, 3 steps skipped in total
    """

    step: int
    variable_names: tuple[str, ...]
    loss_scale: float
    num_skipped_steps: int
    headroom_bits: tuple[float, ...] = ()
    applied_steps: int | None = None
    boundaries: tuple[str, ...] = ()
    sum_overflow_names: tuple[str, ...] = ()

    def __str__(self):
        names = ", ".join(self.variable_names) or "(none recorded)"
        causes = f"non-finite gradients for {names}"
        if self.sum_overflow_names:
            sums = f"sums of finite gradients could overflow for {', '.join(self.sum_overflow_names)}"
            causes = f"{causes}; {sums}" if self.variable_names else sums
        applied = "" if self.applied_steps is None else f" ({self.applied_steps} updates applied)"
        return (
            f"step {self.step}{applied}: {causes}; loss scale now "
            f"{self.loss_scale:g}, {self.num_skipped_steps} steps skipped in total"
            + _headroom_text(self.variable_names, self.headroom_bits)
            + (f"; scale boundaries lowered: {', '.join(self.boundaries)}" if self.boundaries else "")
        )


def _headroom_text(names, headroom_bits):
    if not headroom_bits:
        return ""
    # NaN: no finite step has been recorded yet, so there is no headroom to show.
    parts = [f"{name} had {bits:.1f} bits" for name, bits in zip(names, headroom_bits)
             if not math.isnan(bits)]
    if not parts:
        return "; no finite step yet, so no headroom figures"
    return "; headroom on the last finite step: " + ", ".join(parts)


def _stuck_message(step, names, min_loss_scale, headroom_bits=(), sum_names=()):
    causes, advice = [], []
    if names or not sum_names:
        causes.append(f"non-finite gradients for: {', '.join(names) or '(unknown)'}"
                      f"{_headroom_text(names, headroom_bits)}")
        advice.append("the model is likely diverging (learning rate too high, bad input "
                      "data, or an op overflowing in the forward pass)")
    if sum_names:
        causes.append(f"finite gradients whose sums could overflow for: {', '.join(sum_names)}")
        advice.append("sums of finite gradients overflow those variables' dtype (keep them in "
                      "float32, as mixed_float16 does, or make the gradients smaller)")
    # Sums are vetoed at any scale; non-finite gradients alone are stuck at the minimum.
    situation = (f"step {step} still produced" if sum_names else
                 f"the loss scale is at its minimum ({min_loss_scale:g}) and step {step} "
                 "still produced")
    return (
        f"tfdls: {situation} {'; and '.join(causes)}. Lowering the scale cannot fix this: "
        f"{'; '.join(advice)}. "
        "Set min_scale_policy='ignore' on LossScaleOptimizer to silence this."
    )


class MinScalePolicy:
    """Applies the ``min_scale_policy`` of a `LossScaleOptimizer` on the host.

    Args:
        policy: ``"warn"`` (warn once), ``"raise"`` (raise
            `LossScaleStuckError`) or ``"ignore"``.
    """

    def __init__(self, policy):
        if policy not in MIN_SCALE_POLICIES:
            raise ValueError(
                f"`min_scale_policy` must be one of {MIN_SCALE_POLICIES}; "
                f"got min_scale_policy={policy!r}"
            )
        self.policy = policy
        self._warned = False

    def __call__(self, step, names, min_loss_scale, headroom_bits=(), sum_names=()):
        """Reports a stuck overflow at `step` for the variables `names` (non-finite
        gradients) and `sum_names` (finite gradients whose sums could overflow)."""
        if self.policy == "ignore":
            return
        message = _stuck_message(int(step), list(names), float(min_loss_scale), headroom_bits,
                                 list(sum_names))
        if self.policy == "raise":
            raise LossScaleStuckError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=_compat.user_stacklevel())


def names_from_mask(mask, variable_names):
    """The names whose entries in the boolean `mask` are set."""
    return tuple(name for name, hit in zip(variable_names, np.asarray(mask)) if hit)


class OverflowRecord(_packed_state.PackedModule):
    """The device-side record of overflows and its host-side readers.

    Args:
        variable_names: the paths of the variables the optimizer was built
            with, in order.
        attribution: whether to record which variables overflowed (the step
            of the last overflow is always recorded).
        policy: the `MinScalePolicy` applied by `check_policy`.
        gradient_stats: an optional `tfdls.gradient_stats.GradientStatsRecord`
            whose headroom figures reports and warnings quote.

    The record is diagnostics, not training state: it is not in the optimizer's
    `variables` (nor in `.keras` files, where a loaded model starts a new
    record). Its fields are one variable (`tfdls._packed_state`: one argument
    of every step), tracked so that a SavedModel can export a training step;
    `tf.train.Checkpoint` carries each field under its own name.
    """

    def __init__(self, variable_names, attribution, policy, gradient_stats=None):
        super().__init__(name="overflow_record")
        self.variable_names = tuple(variable_names)
        self.attribution = attribution
        self.policy = policy
        self.gradient_stats = gradient_stats
        unmarked = np.zeros([len(self.variable_names)], np.bool_)
        # The fields under the names checkpoints have held them by (as variables).
        # In this order, a skipped step's writes are few pieces (`PackedState.replace`).
        self._pack(
            "overflow_record",
            # Every step, skipped ones included; and the last skipped one's number
            # and the optimizer's iterations then.
            steps=np.int64(0),
            last_step=np.int64(-1),
            last_applied_steps=np.int64(-1),
            stuck_overflows=np.int64(0),
            mask=unmarked,
            # Variables whose finite gradients' sums could overflow, and the step
            # that wrote them: written only by steps that form such sums, so a
            # report shows them only if they are the last skipped step's.
            sum_step=np.int64(-1),
            sum_mask=unmarked,
        )
        self._stuck_overflows_seen = 0

    def record(self, decision, positions, applied_steps):
        """In-step, branch-free: counts the step; records a skipped step's attribution.

        Args:
            decision: the step's (replica-agreed) `tfdls._decision.Decision`:
                ``is_finite``, per gradient ``nonfinite`` and ``sums_overflow``
                (None where the inner optimizer forms no sums of the
                gradients), and ``stuck``.
            positions: per gradient of the decision, its index in
                `variable_names`.
            applied_steps: the optimizer's iterations (int64 scalar).
        """
        vector = tf.convert_to_tensor(self.state)
        # A finite step is counted; only a skipped step is stuck (as `record_in_branch`).
        counted = vector + self.packed.delta(steps=1)
        skipped = self._after_skipped(vector, decision, positions, applied_steps)
        return self.state.assign(tf.where(decision.is_finite, counted, skipped))

    def record_in_branch(self, finite, decision, positions, applied_steps):
        """`record` for one outcome, known when traced: the writes of a `tf.cond` branch
        taken where the step was finite (`finite`) or skipped. Arguments as `record`'s;
        a finite step reads neither `decision` nor `applied_steps` (they may be None)."""
        if finite:
            return self.packed.add(steps=1)
        vector = tf.convert_to_tensor(self.state)
        return self.state.assign(self._after_skipped(vector, decision, positions, applied_steps))

    def _after_skipped(self, vector, decision, positions, applied_steps):
        """The record after a skipped step, from its read `vector`: the step counted, its
        number and `applied_steps` as the last overflow's, its attribution."""
        step = self.packed.get(vector, "steps")
        stuck = self.packed.get(vector, "stuck_overflows") + tf.cast(decision.stuck, tf.int64)
        values = dict(steps=step + 1, last_step=step, last_applied_steps=applied_steps,
                      stuck_overflows=stuck)
        if self.attribution:
            values["mask"] = self._over_variables(decision.nonfinite, positions)
            if decision.sums_overflow is not None:
                values["sum_step"] = step
                values["sum_mask"] = self._over_variables(decision.sums_overflow, positions)
        return self.packed.replace(vector, **values)

    def _over_variables(self, flags, positions):
        """A bool vector over `positions` -> over every variable (False elsewhere)."""
        count = len(self.variable_names)
        if list(positions) == list(range(count)):
            return flags
        indices = tf.constant(positions, tf.int32, shape=[len(positions), 1])
        return tf.scatter_nd(indices, tf.cast(flags, tf.float32), [count]) > 0

    def last_overflow(self, loss_scale, num_skipped_steps):
        """Host read: an `OverflowReport`, or None (no overflow, or attribution off)."""
        if not self.attribution:
            return None
        fields = self.packed.numpy()
        step = int(fields["last_step"])
        if step < 0:
            return None
        names = names_from_mask(fields["mask"], self.variable_names)
        return OverflowReport(
            step=step,
            variable_names=names,
            loss_scale=float(loss_scale),
            num_skipped_steps=int(num_skipped_steps),
            headroom_bits=self._headroom(names),
            applied_steps=int(fields["last_applied_steps"]),
            sum_overflow_names=self._sum_names(fields, step),
        )

    def _sum_names(self, fields, step):
        if int(fields["sum_step"]) != step:
            return ()
        return names_from_mask(fields["sum_mask"], self.variable_names)

    def _headroom(self, names):
        if self.gradient_stats is None:
            return ()
        figures = self.gradient_stats.read()
        return tuple(figures[name].headroom_bits for name in names)

    def check_policy(self, min_loss_scale):
        """Host read: applies the policy to stuck overflows not reported yet."""
        fields = self.packed.numpy()
        stuck = int(fields["stuck_overflows"])
        if stuck <= self._stuck_overflows_seen:
            return
        self._stuck_overflows_seen = stuck
        step = int(fields["last_step"])
        names = names_from_mask(fields["mask"], self.variable_names)
        self.policy(step, names, min_loss_scale, self._headroom(names),
                    self._sum_names(fields, step))
