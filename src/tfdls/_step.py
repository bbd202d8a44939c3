"""One `LossScaleOptimizer` step, as one pipeline.

`run` reads top to bottom as the step runs, in two stages. `begin` reads:
the gradients given (None ones set aside once), the scale that multiplied
them (the one `scale_loss` recorded, see `tfdls._record`), summed over the
replicas in float16 where the plan says so (`tfdls._distribute`: the scaled
gradients, before anything else). `finish` divides each by what multiplied
it, decides whether to apply (a `Verdict`), then steps the scale, records
and applies or skips: on the ``cond`` plan without a strategy, each
outcome's writes inside the branch taken for it (`Writes`; the rest of the
`tfdls._decision.Decision` is made in the skipped branch, which alone reads
it), elsewhere both outcomes computed and selected, then the update masked
or branched. It
returns the plan that ran: the `StepPlan` it was given,
or that plan with a ``cond`` where the masked update's audit failed. A
compiled apply (`run_compiled`) runs `finish` as its own XLA cluster.

Per-layer scales plug in through one object, the optimizer's
`BoundaryScales` (None without boundaries): `begin_step` returns this
step's divisors, check and adaptation (`tfdls.boundaries.BoundaryStep`).
Without boundaries nothing of it runs or is traced.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import tensorflow as tf

from tfdls import _compat, _distribute, _division, _masked_update, finite
from tfdls import gradient_stats as stats_lib
from tfdls._decision import Decision
from tfdls._plan import AllReduce, Skip
from tfdls.loss_scale import DynamicLossScale


def run(opt, plan, grads, variables):
    """Executes `plan` for one `apply` of `grads` to `variables`; returns the plan that ran."""
    begun = begin(opt, plan, grads, variables)
    return finish(opt, plan, begun, begun.grads, variables)


@dataclasses.dataclass(frozen=True)
class Begun:
    """What a step reads before it divides (`begin`).

    Attributes:
        present: the indices of the gradients that are not None.
        positions: per variable, its index among the optimizer's.
        live: the loss scale now.
        division: how this step divides by the scale (`tfdls._division.Division`).
        grads: the gradients to divide (summed in float16 where the plan says so).
        boundary: the boundaries' part of the step (`BoundaryStep`), or None.
    """

    present: list
    positions: list
    live: Any
    division: _division.Division
    grads: list
    boundary: Any


def begin(opt, plan, grads, variables, cluster=False):
    """The step's reads: the scale that multiplied the gradients, whether they are already
    unscaled, the boundaries' factors; `cluster`: the rest runs in an XLA cluster of its
    own (see `run_compiled`)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    positions = opt._positions(variables)
    carried = opt._carried.take(opt.loss_scale)
    if carried is not None:
        # This function's scale_loss read it, and nothing wrote the scale, its
        # record or the unscaling flag since (`tfdls._carried_scale`).
        live = scale = carried
        opt._record.mark_applied(positions)
        already_unscaled = tf.constant(False)
    else:
        # The scale the gradients were multiplied by: recorded by scale_loss, not
        # re-read (an earlier apply of this step may have changed it).
        live, scale = opt._scales(positions, applying=True)
        # The unscaling rule, at run time: divide by 1 if get_unscaled_gradients
        # already divided this step's gradients.
        already_unscaled = opt._unscaling.consume()
    division = _division.Division(scale, already_unscaled, plan.division)
    if plan.all_reduce == AllReduce.FLOAT16:
        grads, division = _sum_in_float16(grads, present, plan, division)
    boundary = None
    if opt._boundary_scales is not None:
        boundary = opt._boundary_scales.begin_step(division, positions, opt.iterations, grads,
                                                   cluster=cluster)
    return Begun(present, positions, live, division, list(grads), boundary)


def finish(opt, plan, begun, grads, variables):
    """Divides, decides, steps the scale, records, then applies or skips; returns the plan
    that ran."""
    present, positions, division, boundary = (begun.present, begun.positions, begun.division,
                                               begun.boundary)
    # What `overwrite_with_gradient` variables take (never all-reduced, as in Keras).
    as_value = division.as_value
    summed = plan.all_reduce == AllReduce.FLOAT16
    unscaled = [None] * len(grads)
    for i in present:
        if not plan.divide[i]:
            unscaled[i] = as_value(grads[i])
        elif boundary is None or boundary.divisor_of(i) is None:
            unscaled[i] = division.by_scale(grads[i])
        else:
            unscaled[i] = boundary.divide(grads[i], i)
    checked = grads if plan.check == "scaled" else unscaled
    verdict = _decide(opt, grads, checked, unscaled, variables, present, positions,
                      begun.live, boundary, plan)
    if opt._stats is not None:
        _record_stats(opt, plan, grads, checked, present, positions, division, boundary,
                      verdict)
    with _distribute.keras_all_reduce_skipped(opt.inner_optimizer, skip=summed):
        return _apply_or_skip(opt, plan, verdict, unscaled, variables)


def _sum_in_float16(grads, present, plan, division):
    """The scaled gradients summed over the replicas in float16 (`tfdls._distribute`), and
    the `Division` of the sums: by the scale, since they are scaled whatever
    `get_unscaled_gradients` did (it divided them per replica: multiplied back here)."""
    summed_positions = [i for i in present if plan.divide[i]]
    if not summed_positions:
        return grads, division
    sums = _distribute.sum_scaled_in_float16([
        _distribute.rescaled(grads[i], division.scale, division.already_unscaled)
        for i in summed_positions])
    grads = list(grads)
    for i, s in zip(summed_positions, sums):
        grads[i] = s
    return grads, _division.Division(division.scale, tf.constant(False), division.how)


def run_compiled(opt, plan, grads, variables):
    """`run` with its division, check and update as their own XLA cluster, where they fuse.

    The step's reads (`begin`) run before the cluster and the boundaries' new
    factors are written after it, so every value per boundary enters and
    leaves the cluster as an argument or a result. XLA compiles a kernel per
    distinct fusion: a divisor sliced from a vector at a constant index made
    each update below a boundary a kernel of its own, and each boundary's
    write another (at 100 boundaries about 300 kernels, a third of the first
    `fit`'s memory); read as arguments, equal updates compile once.
    """
    inner = dataclasses.replace(plan, compile=False)
    begun = begin(opt, inner, grads, variables, cluster=True)
    ran = []

    def compiled_step(present_grads):
        full = [None] * len(grads)
        for i, g in zip(begun.present, present_grads):
            full[i] = g
        ran.append(finish(opt, inner, begun, full, variables))
        boundary = begun.boundary
        return () if boundary is None or boundary.written is None else boundary.written

    # The gradients as `begin` left them (summed in float16, where the plan says so).
    written = tf.function(compiled_step, jit_compile=True, autograph=False)(
        [begun.grads[i] for i in begun.present])
    if written:
        opt._boundary_scales.write(*written)
    return dataclasses.replace(ran[-1], compile=True)


def _decide(opt, grads, checked, unscaled, variables, present, positions, live, boundary,
            plan):
    """Checks the gradients, agrees across replicas and steps the boundaries; returns the
    step's `Verdict`."""
    loss_scale = opt.loss_scale
    if not loss_scale.can_skip:
        return ALWAYS
    custom = loss_scale.decides_from_gradients
    summed = plan.all_reduce == AllReduce.FLOAT16
    if custom:
        # A custom scale (or a DynamicLossScale subclass with its own update())
        # decides from the unscaled gradients, as in TF 2.4.
        _, verdict = loss_scale.update(unscaled)
        if verdict is True and summed:
            raise ValueError(
                f"LossScaleOptimizer(all_reduce_dtype='float16') needs a loss scale that "
                f"skips steps whose float16 sums overflow; {type(loss_scale).__name__}.update() "
                "returned True (never skip). Return a boolean tensor, or use "
                "all_reduce_dtype=None."
            )
        if verdict is True:
            return ALWAYS
    flags = counts = largest = None
    if boundary is not None and not custom:
        # Each gradient divided by its own divisor can overflow (a factor below 1).
        counts, largest = boundary.check(grads, present, plan.divide)
    else:
        values = finite.gradient_values([checked[i] for i in present])
        if custom or _distribute.has_strategy():
            # Per gradient: how many replicas saw NaN/Inf (the same on all replicas).
            counts = finite.nonfinite_counts(values, across_replicas=True)
        else:
            # One replica: its per-gradient flags decide, with one reduction.
            flags = finite.finite_flags(values)
    # A step whose sums could overflow is skipped too, whatever a custom scale
    # decided; a lower scale cannot help (they are sums of divided gradients).
    may_overflow = _sums_may_overflow(opt.inner_optimizer, [unscaled[i] for i in present],
                                      [variables[i] for i in present], summed)
    if custom:
        vetoes = tf.cast(tf.logical_not(verdict), tf.float32)  # the same on every replica
        all_finite = tf.equal(_distribute.sum_over_replicas(vetoes), 0.0)
    elif flags is not None:
        all_finite = tf.reduce_all(flags)
    else:
        all_finite = tf.equal(tf.reduce_sum(counts), 0.0)
    is_finite = all_finite
    if may_overflow is not None:
        vetoed = tf.reduce_any(may_overflow)
        is_finite = tf.logical_and(all_finite, tf.logical_not(vetoed))
    answered_by_scale = None
    if boundary is not None and not custom:
        # A boundary that can go lower answers its block's overflow instead.
        answered_by_scale = boundary.adapt(is_finite, counts, largest,
                                           [positions[i] for i in present])

    def make_decision():
        # The whole Decision, from the values above. Only a skipped step's writes
        # read more than `is_finite`: where the step branches, this is made inside
        # the skipped branch; where it selects, before the update.
        nonfinite = tf.logical_not(flags) if flags is not None else counts > 0
        lowers_scale = tf.logical_not(all_finite)
        stuck = tf.constant(False)
        if loss_scale.min_value is not None:
            stuck = tf.logical_and(lowers_scale, live <= loss_scale.min_value)
        if answered_by_scale is not None:
            lowers_scale = tf.logical_and(lowers_scale, answered_by_scale)
            stuck = tf.logical_and(stuck, answered_by_scale)
        if may_overflow is not None:
            stuck = tf.logical_or(stuck, vetoed)  # a veto is stuck at any scale
        return Decision(
            is_finite=is_finite,
            nonfinite=nonfinite,
            sums_overflow=None if may_overflow is None
            else tf.logical_and(may_overflow, tf.logical_not(nonfinite)),
            lowers_scale=lowers_scale,
            stuck=stuck,
        )

    # A custom scale stepped in its own update().
    return Verdict(is_finite, Writes(opt, make_decision, [positions[i] for i in present],
                                     live, steps_scale=not custom))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a step decided: `is_finite` (a scalar bool tensor; None where it always
    applies), and the `Writes` that record it (None where it always applies).

    Only `is_finite` is made before the step applies or skips; the rest of the
    `Decision` (which gradients overflowed, whether the scale answers, whether it
    is stuck) is made by `Writes` where it is read: inside the skipped branch
    where the step branches, so a finite step runs none of it.
    """

    is_finite: Any
    writes: Any

    @property
    def always_applies(self):
        return self.writes is None


ALWAYS = Verdict(None, None)


@dataclasses.dataclass(frozen=True)
class Writes:
    """A step's writes to the loss scale's state and the overflow record, for either outcome.

    `select` writes both outcomes' values selected by the decision, with no
    branch; `branch` writes one outcome's, inside the `tf.cond` branch taken
    for it. The algorithm is written once (`DynamicLossScale._transition`,
    `OverflowRecord._after_skipped`), but for the finite outcome in a branch
    outside XLA, which grows the scale in a branch of its own
    (`DynamicLossScale._finite_step_in_branch`, sharing `_grown`); a step on
    the ``"cond"`` plan without a strategy runs the finite step's few writes
    and none of the skipped one's.
    """

    opt: Any
    make_decision: Any  # () -> the step's Decision, made where it is called
    positions: list
    live: Any
    steps_scale: bool

    @property
    def branchable(self):
        """Whether `branch` can write this step: not where the scale steps by an
        `update_from_decision` of its own (a subclass's, or another `LossScale`'s), which
        is called as documented instead, both outcomes selected."""
        return not self.steps_scale or _own_transitions(self.opt.loss_scale)

    def select(self):
        decision = self.make_decision()
        if self.steps_scale:
            loss_scale = self.opt.loss_scale
            if _own_transitions(loss_scale):
                loss_scale.update_from_decision(decision, self._scale())
            else:
                loss_scale.update_from_decision(decision)
        self.opt._overflow.record(decision, self.positions, self._applied_steps())

    def branch(self, finite):
        # A finite step's writes read nothing of the decision but its outcome (a finite
        # step never lowers the scale: the constant is the value the decision has there).
        decision = None if finite else self.make_decision()
        lowers_scale = tf.constant(False) if finite else decision.lowers_scale
        if self.steps_scale:
            self.opt.loss_scale.update_in_branch(finite, self._scale(), lowers_scale)
        # Read in the skipped branch only, where the update did not advance it.
        applied_steps = None if finite else self._applied_steps()
        self.opt._overflow.record_in_branch(finite, decision, self.positions, applied_steps)

    def _applied_steps(self):
        return tf.cast(self.opt.iterations, tf.int64)

    def _scale(self):
        # The scale as the step read it, where that is the scale's own read (not a
        # subclass's __call__); else read again by the scale.
        own_read = type(self.opt.loss_scale).__call__ is DynamicLossScale.__call__
        return self.live if own_read else None


def _own_transitions(loss_scale):
    """A `DynamicLossScale` whose `update_from_decision` is tfdls' own."""
    return (isinstance(loss_scale, DynamicLossScale) and
            type(loss_scale).update_from_decision is DynamicLossScale.update_from_decision)


def _apply_or_skip(opt, plan, verdict, unscaled, variables):
    writes = verdict.writes
    if verdict.always_applies:
        opt.inner_optimizer.apply(unscaled, variables)
        return plan
    if (plan.skip == Skip.COND and writes.branchable
            and not _distribute.under_any_strategy()):
        _apply_in_branches(opt, verdict, unscaled, variables)
        return plan
    # Written before the update runs: the record reads the optimizer's iterations.
    writes.select()
    if plan.skip == Skip.MASKED:
        audit = _masked_update.apply(opt.inner_optimizer, unscaled, variables, verdict.is_finite)
        if audit.exact:
            return plan
        # What runs instead: a cond (inside the compiled apply, if any).
        plan = dataclasses.replace(plan, skip=Skip.COND,
                                   reason=f"the audit failed: {audit.reason}")
        _warn_fallback(opt, audit.reason)
    _distribute.apply_if(verdict.is_finite, opt.inner_optimizer.apply, (unscaled, variables))
    return plan


def _apply_in_branches(opt, verdict, unscaled, variables):
    """The ``"cond"`` plan without a strategy: the update and each outcome's writes in the
    branch taken for it (a finite step runs none of a skipped step's writes)."""

    writes = verdict.writes

    def finite_step():
        writes.branch(finite=True)
        opt.inner_optimizer.apply(unscaled, variables)
        return tf.constant(True)

    def skipped_step():
        writes.branch(finite=False)
        return tf.constant(False)

    tf.cond(verdict.is_finite, finite_step, skipped_step)


def _warn_fallback(opt, reason):
    if opt._fallback_warned:
        return
    opt._fallback_warned = True
    warnings.warn(
        f"tfdls: the update of {type(opt.inner_optimizer).__name__} could not be "
        f"shown to skip exactly without a branch ({reason}); this step skips with a "
        "tf.cond instead, which waits for the device on every step.",
        RuntimeWarning,
        stacklevel=_compat.user_stacklevel(),
    )


def _sums_may_overflow(inner_optimizer, unscaled, variables, already_summed=False):
    """Per gradient, whether a sum the inner optimizer forms from it could overflow (a bool
    vector, the same on every replica); None where it forms none.

    The rule: a step applies only if the sums the inner optimizer forms of
    the divided gradients are finite too: the replicas' sum (several
    replicas), the rows of one index (`tf.IndexedSlices`) and the window's
    accumulated gradient (``gradient_accumulation_steps``). See
    `finite.sums_may_overflow`; with one replica the accumulated sum is
    read exactly, as Keras adds it. Where the gradients are the replicas' sums
    already (`already_summed`: the float16 all-reduce), the check read the sums
    themselves: as with one replica, only the other sums remain.
    """
    replicas = 1 if already_summed else _distribute.replicas_in_sync()
    count = len(unscaled)
    accumulators = [_compat.gradient_accumulator(inner_optimizer, v) for v in variables]
    accumulating = [k for k, a in enumerate(accumulators) if a is not None]
    found = []  # (positions, bool vector over them)
    # With one replica a dense gradient's elements are applied as they are:
    # only the IndexedSlices are read again.
    summed = (list(range(count)) if replicas > 1 else
              [k for k, g in enumerate(unscaled) if isinstance(g, tf.IndexedSlices)])
    if summed:
        extra = None
        if accumulating and replicas > 1:
            # The accumulator is added to the replicas' sum: one more term.
            largest = iter(finite.largest_magnitudes(
                [tf.convert_to_tensor(accumulators[k]) for k in accumulating]))
            extra = [tf.constant(0.0, tf.float64) if accumulators[k] is None
                     else tf.cast(next(largest), tf.float64) for k in summed]
        found.append((summed, finite.sums_may_overflow(
            [unscaled[k] for k in summed], across_replicas=replicas > 1, extra_bounds=extra)))
    if accumulating and replicas == 1:
        found.append((accumulating, tf.logical_not(finite.accumulated_sums_finite(
            [unscaled[k] for k in accumulating], [accumulators[k] for k in accumulating]))))
    if not found:
        return None
    flags = tf.zeros([count])
    for positions, bad in found:
        if positions != list(range(count)):
            bad = tf.scatter_nd(tf.constant([[k] for k in positions], tf.int32),
                                tf.cast(bad, tf.float32), [count])
        flags = flags + tf.cast(bad, tf.float32)
    return flags > 0.0


def _record_stats(opt, plan, grads, checked, present, positions, division, boundary, verdict):
    """Figures of the scaled gradients: the gradients as given, times the scale (and the
    boundaries' factors) where get_unscaled_gradients divided them."""
    already_unscaled = division.already_unscaled
    factor = tf.where(already_unscaled, division.scale, tf.ones_like(division.scale))
    factors, boundary_factors = [], []
    for i in present:
        f = factor if plan.divide[i] else None
        b = None if boundary is None else boundary.factor_of(i)
        if b is not None and f is not None:
            f = factor * tf.where(already_unscaled, b, 1.0)
        factors.append(f)
        boundary_factors.append(tf.constant(1.0) if b is None else tf.cast(b, tf.float32))
    stats = stats_lib.worst_over_replicas(stats_lib.tensor_stats(
        finite.gradient_values([grads[i] for i in present]), factors))
    stats = tf.concat([stats, tf.stack(boundary_factors)[tf.newaxis]], axis=0)
    is_finite = verdict.is_finite
    if verdict.always_applies:  # keep finite steps' figures only
        is_finite = finite.all_finite([checked[i] for i in present], across_replicas=True)
    opt._stats.record(is_finite, stats, [positions[i] for i in present])
