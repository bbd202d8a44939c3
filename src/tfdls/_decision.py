"""`Decision`: what one `LossScaleOptimizer` step decided, as a value.

Made once per step by `tfdls._step` from the gradients it checked and read by
the loss scale (`DynamicLossScale.update_from_decision`, or `update_in_branch`
inside the branch taken) and by the overflow record; nothing recomputes or
changes it afterwards. Only its `is_finite` is needed before the step applies
or skips (`tfdls._step.Verdict`): the whole value is made by the step's
`Writes.make_decision` where it is read, inside the skipped branch where the
step branches.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's verdict, every field agreed by all replicas.

    Attributes:
        is_finite: apply this step (a scalar bool tensor): every gradient was
            finite once divided, and no sum the inner optimizer forms of them
            could overflow.
        nonfinite: per present gradient, a bool: NaN/Inf on some replica.
        sums_overflow: per present gradient, a bool: finite, but a sum the
            inner optimizer forms of it could overflow; None where it forms no
            sum (see `tfdls.finite.sums_may_overflow`).
        lowers_scale: whether a skipped step's overflow is the loss scale's
            to answer (a scalar bool): not where only sums could overflow (a
            lower scale cannot help: they are sums of divided gradients), nor
            where a `tfdls.ScaleBoundary` lowered its factor instead.
        stuck: an overflow the scale cannot answer (scalar bool): at its
            minimum, or a sum that could overflow at any scale;
            ``min_scale_policy`` reports it.
    """

    is_finite: Any = None
    nonfinite: Any = None
    sums_overflow: Any = None
    lowers_scale: Any = None
    stuck: Any = None
