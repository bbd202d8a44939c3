"""How one `LossScaleOptimizer.apply` runs: decided once per trace, as a value.

`plan_step` looks at the gradients, the inner optimizer, the loss scale and
where the step is traced (eager, graph, XLA, under a strategy) and returns a
frozen `StepPlan`; `LossScaleOptimizer.apply` then executes it. Every fast
path is chosen here, only where it is known to be exact, and the plan says
why a path was not taken.

Which gradients are divided by the scale is not decided here but when the
step runs (see `tfdls._unscaling`); the plan says how they are divided.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfdls import _compat, _distribute, _division, _masked_update
from tfdls.finite import accelerator_visible
from tfdls.loss_scale import DynamicLossScale


class Skip(_compat.StrEnum):
    """How a step with non-finite gradients applies nothing (see `StepPlan.skip`)."""

    NONE = "none"
    MASKED = "masked"
    COND = "cond"


class Check(_compat.StrEnum):
    """What the finiteness check reads (see `StepPlan.check`)."""

    SCALED = "scaled"
    UNSCALED = "unscaled"


class AllReduce(_compat.StrEnum):
    """Who sums the gradients over the replicas, and in what (see `StepPlan.all_reduce`)."""

    KERAS = "keras"
    FLOAT16 = "float16"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The decisions of one traced `apply`.

    Attributes:
        divide: per gradient, whether `apply` divides it by the step's
            divisor: the scale, or 1 where `get_unscaled_gradients` already
            divided this step's gradients (decided when the step runs, see
            `tfdls._unscaling`). False for a missing gradient and for a
            variable that takes its gradient as a value
            (`overwrite_with_gradient`).
        division: how it divides, exactly: ``"factors"`` (inside XLA, a
            multiplication by powers of two, for a scale that only takes
            powers of two), ``"divide"`` (a true division, in float32 for
            float16 and bfloat16 gradients) or ``"divide_in_float64"`` (a
            scale that may not be a power of two; see `tfdls._division`).
        check: ``"scaled"``: the finiteness check reads the gradients as
            given (while the scale cannot fall below 1, dividing by it cannot
            turn a finite value non-finite, and under XLA the division then
            fuses into the update); ``"unscaled"``: it reads them after the
            division (a scale below 1 multiplies them up).
        skip: how a step with non-finite gradients applies nothing:
            ``"none"`` (a fixed scale never skips), ``"masked"`` (the update
            runs and its writes are masked, see `tfdls._masked_update`; no
            branch) or ``"cond"`` (a `tf.cond` around the inner update).
        compile: the apply runs as its own XLA cluster: with
            ``jit_compile=True``, or with ``"auto"`` for a masked update of a
            `DynamicLossScale` without a multi-replica strategy or op
            determinism, where a GPU or TPU is visible or the dense gradients
            hold at least `AUTO_COMPILE_MIN_ELEMENTS` elements (a smaller
            apply on the CPU runs uncompiled, with a ``"cond"``; sparse
            `tf.IndexedSlices` gradients do not count there).
        reason: why `skip` is not ``"masked"`` and `compile` is False, in
            words (empty when both fast paths are taken).
        all_reduce: ``"keras"``: the inner optimizer all-reduces the divided
            gradients in their own dtype after the check (or there is one
            replica); ``"float16"``: `apply` all-reduces the scaled gradients
            in float16 first, then divides and checks the sums, and the inner
            optimizer applies them without all-reducing again
            (``all_reduce_dtype="float16"`` under several replicas; see
            `tfdls._distribute`).

    Example:

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    >>> w = keras.Variable(tf.zeros([512, 512]), name="w")  # 262,144 elements
    >>> step = tf.function(lambda g: opt.apply([g], [w]))
    >>> step(tf.ones([512, 512]))
    >>> print(opt.step_plan.skip, opt.step_plan.check, opt.step_plan.compile)
    masked scaled True
    >>> opt.apply([tf.ones([512, 512])], [w])  # eager: no trace to audit
    >>> print(opt.step_plan.skip, "-", opt.step_plan.reason)
    cond - eager execution (the cond runs one branch; no trace to audit)
    >>> small = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    >>> v = keras.Variable([1.0, 2.0], name="v")
    >>> tf.function(lambda g: small.apply([g], [v]))(tf.ones(2))
    >>> print(small.step_plan.skip, small.step_plan.compile)  # on a machine without a GPU
    cond False
    """

    divide: tuple[bool, ...]
    division: _division.Method
    check: Check
    skip: Skip
    compile: bool
    reason: str = ""
    all_reduce: AllReduce = AllReduce.KERAS


def plan_step(
    grads,
    trainable_variables,
    inner_optimizer,
    jit_compile,
    loss_scale,
    all_reduce_dtype=None,
):
    """Decides how this `apply` runs; see `StepPlan`.

    Args:
        grads: the gradients as passed to `apply` (None for no gradient).
        trainable_variables: their variables.
        inner_optimizer: the wrapped Keras optimizer.
        jit_compile: the optimizer's ``jit_compile`` setting.
        loss_scale: the `tfdls.LossScale`, which answers whether it can skip,
            its minimum and whether its values are powers of two.
        all_reduce_dtype: the optimizer's ``all_reduce_dtype`` (None or ``"float16"``).
    """
    min_scale = loss_scale.min_value
    divide = tuple(
        g is not None and not getattr(v, "overwrite_with_gradient", False)
        for g, v in zip(grads, trainable_variables)
    )
    check = Check.SCALED if min_scale is not None and min_scale >= 1 else Check.UNSCALED

    in_function = tf.inside_function()
    in_xla = in_function and _compat.in_xla_context()
    reasons = []
    if not loss_scale.can_skip:
        skip = Skip.NONE
    elif not in_function:
        skip, why = Skip.COND, "eager execution (the cond runs one branch; no trace to audit)"
        reasons.append(why)
    elif _distribute.needs_merge_call():
        skip = Skip.COND
        reasons.append(
            "the strategy synchronizes replicas with merge_call, which an audited "
            "update function cannot contain; the cond is taken in cross-replica context"
        )
    else:
        unsupported = _masked_update.unsupported_reason(inner_optimizer)
        skip = Skip.COND if unsupported else Skip.MASKED
        if unsupported:
            reasons.append(unsupported)

    if in_function and _distribute.needs_merge_call():
        _check_accumulation_under_merge_call(inner_optimizer)
    if jit_compile is True and in_function and not in_xla and (
            _distribute.has_strategy() or _distribute.needs_merge_call()):
        raise ValueError(
            "LossScaleOptimizer(jit_compile=True) cannot compile apply() on its own under "
            f"a tf.distribute strategy with {_replicas(_distribute.replicas_in_sync())}: the "
            "replicas agree through cross-replica calls that an XLA cluster cannot hold. "
            "Compile the whole step instead (model.compile(jit_compile=True) or "
            "tf.function(jit_compile=True)), or use jit_compile='auto' or False."
        )
    if jit_compile is False:
        compile_apply = False
    elif not in_function or in_xla:
        compile_apply = False  # eager, or already inside an XLA cluster
    elif jit_compile is True:
        compile_apply = True
    elif _distribute.has_strategy():
        compile_apply = False
        reasons.append("jit_compile='auto' does not compile under a multi-replica strategy")
    elif _compat.op_determinism_enabled():
        compile_apply = False
        reasons.append("jit_compile='auto' does not compile with op determinism enabled")
    elif not isinstance(loss_scale, DynamicLossScale):
        compile_apply = False
        reasons.append("jit_compile='auto' compiles only for a DynamicLossScale")
    else:
        compile_apply = skip == Skip.MASKED
        if not compile_apply:
            reasons.append("jit_compile='auto' compiles only a masked (branch-free) update")
        elif not accelerator_visible():
            elements = _gradient_elements(grads, trainable_variables)
            if elements < AUTO_COMPILE_MIN_ELEMENTS:
                compile_apply, skip = False, Skip.COND
                reasons.append(
                    "jit_compile='auto' on the CPU compiles an apply of at least "
                    f"{AUTO_COMPILE_MIN_ELEMENTS:,} dense gradient elements (this one has "
                    f"{elements:,}; sparse gradients do not count): a smaller one does not "
                    "pay back its XLA compile and launch, and a tf.cond on the CPU waits "
                    "for no device")
    all_reduce = AllReduce.KERAS
    if all_reduce_dtype == _distribute.FLOAT16 and _distribute.has_strategy():
        _distribute.check_all_reduce_strategy()
        all_reduce = AllReduce.FLOAT16
    return StepPlan(
        divide=divide,
        division=_division.method(loss_scale.always_power_of_two, in_xla or compile_apply),
        check=check,
        skip=skip,
        compile=compile_apply,
        reason="; ".join(reasons),
        all_reduce=all_reduce,
    )


# jit_compile="auto" on a machine without a GPU or TPU: the smallest apply it
# compiles, in gradient elements. Below it (on 2 CPU cores, apply alone, see
# docs/benchmarks.md) the compiled masked step and the uncompiled tf.cond step
# are within about 10% of each other per step, while compiling costs the first
# step 1 to 3 s more; above it the compiled step pulls ahead (Adam: 0.43x
# Keras 3's step against 0.76x at 524,288 elements). Sparse gradients (an
# Embedding's tf.IndexedSlices) do not count: a 20,000x64 table's compiled
# Adam update saved about 4 ms per step (2 cores), while compiling an apply
# of a Transformer's 36 variables cost its first step 5 to 6 s.
AUTO_COMPILE_MIN_ELEMENTS = 2**18


def _replicas(count):
    return f"{count} replica" if count == 1 else f"{count} replicas"


def _gradient_elements(grads, trainable_variables):
    """Elements of the variables that get a dense gradient (a large number if a shape is
    unknown)."""
    total = 0
    for g, v in zip(grads, trainable_variables):
        if g is None or isinstance(g, tf.IndexedSlices):
            continue
        n = tf.TensorShape(v.shape).num_elements()
        if n is None:
            return AUTO_COMPILE_MIN_ELEMENTS
        total += n
    return total


def _check_accumulation_under_merge_call(inner_optimizer):
    """Raises where Keras' own gradient accumulation cannot run (see below)."""
    for opt in getattr(inner_optimizer, "optimizers", None) or [inner_optimizer]:
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            # Keras all-reduces the accumulated gradients inside its own
            # tf.cond, in replica context; TensorFlow refuses a merge_call
            # there, and the bare optimizer fails the same way.
            raise ValueError(
                f"The inner {type(opt).__name__}(gradient_accumulation_steps={steps}) cannot "
                f"run in a tf.function under {type(tf.distribute.get_strategy()).__name__}: "
                "Keras all-reduces the accumulated gradients inside its own tf.cond, where "
                "this strategy's merge_call is not allowed (the bare Keras optimizer fails "
                "the same way). Accumulate gradients in your own train step, or train "
                "without gradient_accumulation_steps under this strategy."
            )
