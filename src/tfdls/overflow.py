"""Overflow attribution and the policy for a scale stuck at its minimum.

After a skipped step, `LossScaleOptimizer.last_overflow()` names the
variables whose gradients were non-finite. The mask behind it is written on
the device in the same step (no host round trip); names are attached only
when a user asks.

A scale that sits at `min_loss_scale` and still overflows cannot be rescued
by loss scaling: it is the usual sign of a real divergence (a learning rate
too high, a bad batch, a bug), not of float16's range. `MinScalePolicy`
decides what happens then: ``"warn"`` (once, the default), ``"raise"`` or
``"ignore"``.
"""

import dataclasses
import warnings

import numpy as np

MIN_SCALE_POLICIES = ("warn", "raise", "ignore")


class LossScaleStuckError(RuntimeError):
    """Training keeps overflowing although the loss scale is at its minimum.

    Raised with ``min_scale_policy="raise"``. Inside a `tf.function` or `fit`
    it reaches you wrapped in a TensorFlow error whose message starts with
    ``LossScaleStuckError``:

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), min_scale_policy="raise")
    >>> model.compile(optimizer=opt, loss="mse")
    >>> model.fit(x_with_nans, y)
    UnknownError: ... LossScaleStuckError: tfdls: the loss scale is at its minimum ...
    """


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """What the last skipped step looked like (see `LossScaleOptimizer.last_overflow`).

    Example:

    >>> report = opt.last_overflow()
    >>> report.variable_names
    ('sequential/dense_2/kernel',)
    >>> print(report)
    step 308: non-finite gradients for sequential/dense_2/kernel; loss scale now 262144, ...

    Attributes:
        step: the optimizer's `iterations` when the step was skipped (skipped
            steps do not advance it, so this is also the next step's number).
        variable_names: paths of the variables whose gradients held NaN/Inf
            (on any replica).
        loss_scale: the scale after the step's update.
        num_skipped_steps: total skipped steps so far.
    """

    step: int
    variable_names: tuple
    loss_scale: float
    num_skipped_steps: int

    def __str__(self):
        names = ", ".join(self.variable_names) or "(none recorded)"
        return (
            f"step {self.step}: non-finite gradients for {names}; loss scale now "
            f"{self.loss_scale:g}, {self.num_skipped_steps} steps skipped in total"
        )


def _stuck_message(step, names, min_loss_scale):
    return (
        f"tfdls: the loss scale is at its minimum ({min_loss_scale:g}) and step {step} "
        f"still produced non-finite gradients for: {', '.join(names) or '(unknown)'}. "
        "Lowering the scale cannot fix this: the model is likely diverging (learning "
        "rate too high, bad input data, or an op overflowing in the forward pass). "
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

    def __call__(self, step, names, min_loss_scale):
        """Reports a stuck overflow at `step` for the variables `names`."""
        if self.policy == "ignore":
            return
        message = _stuck_message(int(step), list(names), float(min_loss_scale))
        if self.policy == "raise":
            raise LossScaleStuckError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def names_from_mask(mask, variable_names):
    """The names whose entries in the boolean `mask` are set."""
    return tuple(name for name, hit in zip(variable_names, np.asarray(mask)) if hit)
