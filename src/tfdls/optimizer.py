"""`LossScaleOptimizer`: dynamic loss scaling around any Keras 3 optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import keras
import tensorflow as tf

from tfdls import _bfloat16, _compat, _distribute, _division, _keras_style, _plan
from tfdls import _carried_scale, _forgotten_scale, _record, _step, _unscaling
from tfdls._bfloat16 import BFloat16Warning  # noqa: F401 (tfdls.optimizer.BFloat16Warning)
from tfdls import boundaries as boundaries_lib
from tfdls.boundaries.step import BoundaryScales
from tfdls import overflow
from tfdls import gradient_stats as stats_lib
from tfdls import loss_scale as loss_scale_lib

# The step path has no tensor-dependent Python control flow: AutoGraph need
# not rewrite it (as Keras' own trainer code is not), which also keeps
# tracebacks readable.
_NOT_CONVERTED = tf.autograph.experimental.do_not_convert


@keras.saving.register_keras_serializable(package="tfdls")
class LossScaleOptimizer(_keras_style.KerasNames, keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras 3 optimizer with (dynamic) loss scaling.

    The loss is multiplied by the current scale before differentiation; the
    gradients are divided by that scale, as `scale_loss` recorded it (see
    `tfdls._record`), before the inner optimizer sees them. A step
    whose gradients hold any NaN/Inf applies nothing (weights, optimizer slots
    and `iterations` stay exactly as they were) and the loss scale shrinks.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        loss_scale: a `tfdls.LossScale`, ``"dynamic"`` (the default), a
            positive number (a fixed scale) or a loss-scale config dict.
        initial_scale, dynamic_growth_steps, dynamic: Keras / tf_keras style
            alternative to `loss_scale` (``dynamic=False`` means a fixed scale
            of `initial_scale`). Do not combine with `loss_scale`.
        name: optional name.
        overflow_attribution: record, on the device, which variables had
            non-finite gradients in the last skipped step (see
            `last_overflow()`). On by default; it costs a few scalar ops.
        min_scale_policy: what to do when a step overflows although the
            dynamic scale is already at `min_loss_scale`: ``"warn"`` (once,
            with the step and variable names), ``"raise"``
            (`tfdls.LossScaleStuckError`) or ``"ignore"``. The step records
            such overflows on the device without waiting for the host; the
            policy acts when the host reads the record: in
            `check_min_scale_policy()` and `last_overflow()`, in
            `tfdls.LossScaleMonitor` at its logging frequency, and at the end
            of `fit`. The same in eager, graph and XLA execution.
        jit_compile: whether `apply`, called inside a `tf.function` that is
            not itself XLA-compiled, runs as its own XLA cluster, so that the
            finiteness check, the unscaling and the inner update fuse (Adam's
            step then takes about half the time of Keras' graph-mode step).
            ``"auto"`` (the default) does so for a dynamic scale without a
            multi-replica strategy or op determinism when the inner update
            can be skipped without a branch (see `step_plan`); ``True``
            always (a `ValueError` under a multi-replica strategy, where it
            cannot), ``False`` never. Eager calls and steps that are already
            XLA-compiled are unaffected. A compiled apply rounds as the
            inner optimizer compiled with XLA does (README: bit-identical
            for most classes, within 4 ulp for all); skipped steps stay
            exact.
        gradient_stats: record, on every finite step and per variable, where
            the scaled gradients sit in float16's range: headroom below 65504
            in bits, and the fractions of zero and of subnormal (below
            2**-14) elements (see `gradient_stats()` and
            `tfdls.gradient_stats`). Off by default: it reads every gradient
            a few more times (on XLA's CPU backend about three more passes,
            see README's benchmark). No host call.
        scale_boundaries: a Sequential or functional model holding
            `tfdls.ScaleBoundary` layers (see `tfdls.add_scale_boundaries`):
            each variable's gradient is then divided by the loss scale times
            the factors of the boundaries between its layer and the outputs,
            and the optimizer adapts those factors (`tfdls.boundaries`).
            Needs a `DynamicLossScale` whose values are powers of two. Not
            part of `get_config`: after loading a saved model, give it again
            with `set_scale_boundaries(model)` (until then `apply` raises).
        all_reduce_dtype: None (the default) or ``"float16"``. None keeps
            Keras' own all-reduce: each replica divides and checks its
            gradients, and the inner optimizer sums them over the replicas in
            their own dtype (float32 for the float32 variables of
            mixed_float16). ``"float16"``, under MirroredStrategy or
            MultiWorkerMirroredStrategy with several replicas, sums the
            *scaled* gradients over the replicas cast to float16 (half the
            bytes of float32), then divides and checks the sums, so a sum
            that overflows float16 skips the step and lowers the scale on
            every replica alike; the inner optimizer applies the sums without
            a second all-reduce (and clips, with ``clipnorm`` and the like,
            the sum rather than each replica's gradient). Without such a
            strategy it changes nothing. The default is None because the
            float16 sums round float32 gradients to float16's 11 bits and
            their range is the loss scale's to keep (README, "Distribution").
            Needs a loss scale that can skip steps.

    Attributes:
        inner_optimizer: the wrapped Keras optimizer.
        loss_scale: the `tfdls.LossScale` (a `tf.Module`); ``loss_scale()`` is
            the current scale, a float32 scalar tensor.
        step_plan: the `tfdls.StepPlan` of the last traced (or eager) `apply`:
            how it divides, checks, skips and compiles, and why a fast path
            was not taken; None before the first `apply`.

    The properties `dynamic`, `initial_scale`, `dynamic_growth_steps`,
    `dynamic_scale` and `step_counter` are the Keras 3 / tf_keras names for
    the scale's settings and state (see their docstrings).

    How a step runs is decided once per trace and kept in `step_plan` (a
    `StepPlan`): inside a `tf.function` a step with one of Keras' own inner
    optimizer classes and dense gradients has no branch and no host call (its
    inner update is audited at trace time, see `tfdls._masked_update`);
    otherwise a `tf.cond` skips the update.

    A fixed loss scale never skips a step (as in TensorFlow 2.4).

    Example, Keras 3 style (what `fit` does):

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    >>> w = keras.Variable([1.0, 2.0], name="w")
    >>> with tf.GradientTape() as tape:
    ...     loss = opt.scale_loss(tf.reduce_sum(w))
    >>> opt.apply(tape.gradient(loss, [w]), [w])  # divides by the scale, checks, applies
    >>> w.numpy()
    array([0.5, 1.5], dtype=float32)

    Example, tf_keras / TF 2.4 style:

    >>> with tf.GradientTape() as tape:
    ...     scaled_loss = opt.get_scaled_loss(tf.reduce_sum(w))
    >>> grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, [w]))
    >>> _ = opt.apply_gradients(zip(grads, [w]))  # not divided a second time
    >>> w.numpy()
    array([0., 1.], dtype=float32)
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        loss_scale: loss_scale_lib.LossScale | str | float | dict | None = None,
        name: str | None = None,
        *,
        overflow_attribution: bool = True,
        min_scale_policy: str = "warn",
        jit_compile: bool | str = "auto",
        gradient_stats: bool = False,
        scale_boundaries: keras.Model | None = None,
        all_reduce_dtype: str | None = None,
        **kwargs: Any,
    ):
        resolved = _keras_style.loss_scale_from_arguments(inner_optimizer, loss_scale, kwargs)
        if not isinstance(overflow_attribution, bool):
            raise TypeError(
                "`overflow_attribution` must be True or False; "
                f"got overflow_attribution={overflow_attribution!r}"
            )
        policy = overflow.MinScalePolicy(min_scale_policy)
        if not isinstance(gradient_stats, bool):
            raise TypeError(
                f"`gradient_stats` must be True or False; got gradient_stats={gradient_stats!r}"
            )
        if not (isinstance(jit_compile, bool) or jit_compile == "auto"):
            raise ValueError(
                "`jit_compile` must be True, False or 'auto'; "
                f"got jit_compile={jit_compile!r}"
            )
        all_reduce_dtype = _distribute.all_reduce_dtype_from(all_reduce_dtype)
        _distribute.check_all_reduce_loss_scale(all_reduce_dtype, resolved)
        # Skip keras.optimizers.LossScaleOptimizer.__init__: it would build a
        # second, Keras-owned scale. Our state lives in `self.loss_scale`.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        _compat.check_optimizer_instance(self)
        self.inner_optimizer = inner_optimizer
        self.loss_scale = resolved
        self.overflow_attribution = overflow_attribution
        self._min_scale_policy = policy
        self.jit_compile = jit_compile
        self.record_gradient_stats = gradient_stats
        self.all_reduce_dtype = all_reduce_dtype
        # The flag behind the unscaling rule (see `get_unscaled_gradients`).
        self._unscaling = _unscaling.UnscaleState()
        # The scale scale_loss multiplied by, which apply divides by (`tfdls._record`).
        self._record = _record.ScaleRecord()
        # What apply may take from its function's scale_loss unread (`tfdls._carried_scale`).
        self._carried = _carried_scale.CarriedScale()
        # Whether a scaled loss preceded each apply (`tfdls._forgotten_scale`).
        self._scaled_loss_watch = _forgotten_scale.ScaledLossWatch()
        # Made by build():
        self._overflow: overflow.OverflowRecord | None = None
        self._stats: stats_lib.GradientStatsRecord | None = None
        self._fallback_warned = False
        self.step_plan = None
        # Scale boundaries (see `set_scale_boundaries`): the one object through
        # which per-layer scales plug into the step; None without them.
        self._boundary_scales: BoundaryScales | None = None
        self._boundaries_expected = False
        if scale_boundaries is not None:
            self.set_scale_boundaries(scale_boundaries)

    def set_scale_boundaries(self, model: keras.Model) -> None:
        """Reads `model`'s `tfdls.ScaleBoundary` layers: the boundaries above each variable.

        Call it once, before the first `apply` (the constructor's
        ``scale_boundaries=model`` does), or after loading a model saved with
        scale boundaries. Raises `ValueError` for a model whose paths mix
        boundaries (see `tfdls.boundaries.read_boundaries`) and for a loss
        scale that is not a `DynamicLossScale` of powers of two.
        """
        ls = self.loss_scale
        if not (self.dynamic and ls.always_power_of_two):
            raise ValueError(
                "scale_boundaries needs a tfdls.DynamicLossScale whose values are powers "
                f"of two (every factor is one, and overflows must be able to skip a step); "
                f"got loss_scale={ls!r}"
            )
        boundary_map = boundaries_lib.read_boundaries(model)
        scales = BoundaryScales(boundary_map)
        if self.built:
            # Raises before anything is kept, the boundaries' ownership included: a
            # boundary owned by no working optimizer would still scale its gradients.
            scales.build(self._trainable_variables)
        boundaries_lib.take_ownership(boundary_map)
        boundaries_lib.guard_layers_below(model, boundary_map)
        if self.built:
            self._boundary_scales = scales
        else:
            # Held untracked until build(): a checkpoint of an unbuilt optimizer has
            # the same objects with or without boundaries (as before the plug-in).
            object.__setattr__(self, "_boundary_scales", scales)
        self._boundaries_expected = True

    def scale_boundary_factors(self) -> dict[str, float]:
        """``{boundary name: factor}`` now (a host read); empty without scale boundaries."""
        if self._boundary_scales is None:
            return {}
        return {b.name: b.factor() for b in self._boundary_scales.boundaries}

    @property
    def variables(self):
        return self._variables + list(self.loss_scale.variables) + self.inner_optimizer.variables

    def build(self, var_list):
        _bfloat16.warn_if_bfloat16(var_list)
        if self._boundary_scales is not None:
            # First: a variable outside the model raises before any state is made.
            scales = self._boundary_scales
            with tf.name_scope(self.name):
                scales.build(var_list)
            # Tracked from here (see set_scale_boundaries). Deleted first: assigning the
            # object already held is a no-op for TensorFlow's tracking, which would
            # leave it out of checkpoints.
            object.__delattr__(self, "_boundary_scales")
            self._boundary_scales = scales
        # Outside Keras' no-tracking scope: variables the inner optimizer
        # creates without add_variable (Nadam's `_u_product`, Adafactor's
        # placeholders) are tracked, so `variables`, `.keras` files and
        # checkpoints carry them.
        self.inner_optimizer.build(var_list)
        # Checkpoints and SavedModels find variables by tracking; not every
        # Keras optimizer tracks all of its own (MultiOptimizer does not track
        # its sub-optimizers'), so every variable of the inner optimizer is
        # tracked from here too (shared, not copied).
        self._inner_optimizer_state = _keras_style.TrackedVariables(self.inner_optimizer.variables)
        # The generic Optimizer.build; Keras' LossScaleOptimizer.build would
        # create its own scale variables.
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        names = [getattr(v, "path", None) or v.name for v in var_list]
        self._record.build(len(var_list))
        with tf.name_scope(self.name):
            if self.record_gradient_stats:
                self._stats = stats_lib.GradientStatsRecord(names)
            self._overflow = overflow.OverflowRecord(
                names, self.overflow_attribution, self._min_scale_policy, self._stats
            )

    # -- scaling ----------------------------------------------------------------

    @_NOT_CONVERTED
    def scale_loss(self, loss: Any) -> tf.Tensor:
        """Returns `loss * scale`: the hook Keras 3's `fit` calls.

        Records the scale it multiplies by: `apply` divides by that record,
        not by the scale as it is when `apply` runs (see `tfdls._record`).
        Also starts a new step for the unscaling rule (see
        `get_unscaled_gradients`): an earlier `get_unscaled_gradients` call
        no longer counts.
        """
        self._unscaling.begin_step()
        self._scaled_loss_watch.scaled()
        scale = self.loss_scale()
        if self.loss_scale.can_skip:  # a scale that never skips never changes
            self._record.record(scale)
        if type(self.loss_scale) is loss_scale_lib.DynamicLossScale:
            self._carried.scaled(self.loss_scale, scale, [
                self.loss_scale.current_loss_scale, self._record.scale,
                self._unscaling.gradients_unscaled])
        if self._boundary_scales is not None:
            # The factors this step's backward passes multiply by and its
            # applies divide by: an adaptation takes effect from here.
            boundaries_lib.record_factors(self._boundary_scales.boundaries)
        return keras.ops.multiply(loss, scale)

    def _scales(self, positions=None, applying=False):
        """The scale now, and the scale that multiplied the gradients of the variables at
        `positions` (all of the optimizer's, if None) by the rule of `tfdls._record`;
        `applying`: `apply` receives them (the record notes it)."""
        live = self.loss_scale()
        if not self.loss_scale.can_skip:  # fixed: the same when recorded and when read
            return live, live
        if applying:
            return live, self._record.take(live, positions)
        return live, self._record.scale_for(live, positions)

    def _positions(self, trainable_variables):
        """The indices of `trainable_variables` among the optimizer's; a ValueError naming
        one it was not built with."""
        if self._boundary_scales is None:
            self._check_variables_are_known(trainable_variables)  # Keras' own error
        positions = []
        for variable in trainable_variables:
            try:
                positions.append(self._get_variable_index(variable))
            except KeyError:
                raise ValueError(
                    f"tfdls: the variable {getattr(variable, 'path', None) or variable.name!r} "
                    "is not one this optimizer was built with, so it does not know which "
                    "scale boundaries its gradient crossed. An optimizer updates the "
                    "variables it was built with; make a new one for other variables."
                ) from None
        return positions

    @_NOT_CONVERTED
    def get_scaled_loss(self, loss: Any) -> Any:
        """tf_keras style `scale_loss`; also accepts a zero-argument callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    @_NOT_CONVERTED
    def get_unscaled_gradients(
        self, grads: Iterable[Any], trainable_variables: Sequence[Any] | None = None
    ) -> list[Any]:
        """Divides gradients by the scale (tf_keras style), exactly.

        The unscaling rule: `apply` (and `apply_gradients`) divides every
        gradient by the loss scale, unless `get_unscaled_gradients` ran after
        the last `scale_loss`, `get_scaled_loss` or `apply`; then it divides
        none of them. The rule is kept in a variable and applied when the step
        runs, so it holds alike in eager code, `tf.function`s, loops, across
        functions and under `strategy.run`. So after this call pass `apply`
        its outputs, or what you compute from them (clipped gradients, sums
        over micro-batches), and only those.

        Misuses tfdls can see raise a `ValueError` instead of a wrong update:
        applying the scaled gradients (or scaled gradients times a factor
        computed from the unscaled ones) after this call; applying one call's
        outputs in two `apply` calls; applying, in a loop body or a nested
        `tf.function`, outputs of a call made outside it; and, in eager mode,
        applying anything but the tensors this returned. To only look at
        unscaled values (logging), divide by `loss_scale()` yourself.

        With `scale_boundaries`, pass the variables too
        (``trainable_variables``, in the order of `grads`): each gradient is
        divided by the loss scale times its boundaries' factors. Traced in a
        `tf.function` before the optimizer is built, it needs a
        `scale_loss`/`get_scaled_loss` that runs before it in that function,
        else it raises a `ValueError` (docs/optimizer.md, "What apply divides
        by").

        Example:

        >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0))
        >>> w = keras.Variable([0.0], name="w")
        >>> with tf.GradientTape() as tape:
        ...     loss = opt.get_scaled_loss(3.0 * tf.reduce_sum(w))
        >>> grads = opt.get_unscaled_gradients(tape.gradient(loss, [w]))
        >>> grads[0].numpy()
        array([3.], dtype=float32)
        >>> _ = opt.apply_gradients(zip(grads, [w]))  # not divided again
        >>> w.numpy()
        array([-3.], dtype=float32)
        >>> opt.apply_gradients(zip(grads, [w]))  # a second apply would divide them
        Traceback (most recent call last):
          ...
        ValueError: tfdls: apply() received gradients returned by a get_unscaled_gradients() call that an earlier apply()...
        """
        grads = list(grads)
        variables = None if trainable_variables is None else list(trainable_variables)
        if variables is not None and len(variables) != len(grads):
            raise ValueError(
                f"get_unscaled_gradients got {len(grads)} gradients for {len(variables)} "
                "trainable_variables; they must match one to one."
            )
        if variables is not None and self._boundary_scales is not None and not self.built:
            self._build_first(variables)
        positions = None if variables is None or not self.built else self._positions(variables)
        _, scale = self._scales(positions)
        how = _division.method(self.loss_scale.always_power_of_two, _compat.in_xla_context())
        if self._boundary_scales is None:
            unscaled = [None if g is None else _division.divide(g, scale, how) for g in grads]
        else:
            if variables is None:
                raise ValueError(
                    "With scale_boundaries, get_unscaled_gradients needs the variables of "
                    "the gradients (each is divided by its own boundaries' factors): pass "
                    "trainable_variables=[...] in the order of grads; got "
                    f"trainable_variables={trainable_variables!r}"
                )
            _distribute.refuse_unscaling_with_boundaries(self.all_reduce_dtype)
            unscaled = self._boundary_scales.unscale(grads, positions, scale, how)
        self._unscaling.record_unscaled(grads, unscaled)
        self._scaled_loss_watch.scaled()
        return unscaled

    # -- applying -----------------------------------------------------------------

    @_NOT_CONVERTED
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    @_NOT_CONVERTED
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Divides `grads` by the scale `scale_loss` recorded (see `tfdls._record`;
        and `get_unscaled_gradients` for when not at all), updates the loss
        scale, and applies them with the inner optimizer iff all are finite."""
        try:
            grads, trainable_variables = self._arguments(grads, trainable_variables)
            if not grads:
                return
            self._scaled_loss_watch.check(trainable_variables)
            self._unscaling.check(
                grads, [getattr(v, "path", None) or v.name for v in trainable_variables])
            self._check_boundaries_given(grads, trainable_variables)
            plan = _plan.plan_step(grads, trainable_variables, self.inner_optimizer,
                                   self.jit_compile, self.loss_scale, self.all_reduce_dtype)
            run = _step.run_compiled if plan.compile else _step.run
            self.step_plan = run(self, plan, grads, trainable_variables)
        finally:
            self._unscaling.end_step()

    def _check_boundaries_given(self, grads, trainable_variables):
        """Refuses gradients that crossed scale boundaries this optimizer cannot divide out."""
        if self._boundaries_expected and self._boundary_scales is None:
            raise ValueError(
                "tfdls: this optimizer was saved with scale boundaries; give it the model "
                "again with optimizer.set_scale_boundaries(model) before training."
            )
        if self._boundary_scales is not None:
            self._boundary_scales.check_given()
        boundaries_lib.refuse_boundaries_not_given(
            grads, trainable_variables,
            () if self._boundary_scales is None else self._boundary_scales.boundaries)

    def _arguments(self, grads, trainable_variables):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without `trainable_variables` needs a built optimizer; "
                    "call optimizer.build(variables) first or pass the variables."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(trainable_variables)} variables; "
                "they must match one to one."
            )
        if grads and all(g is None for g in grads):
            raise ValueError(
                f"No gradients provided for any variable: all {len(grads)} gradients are None."
            )
        # A gradient given as a Python list or number is one tensor in its variable's
        # dtype, as Keras takes it (not a nest of scalar gradients).
        grads = [tf.convert_to_tensor(g, dtype=v.dtype)
                 if g is not None and not isinstance(g, tf.IndexedSlices)
                 and not hasattr(g, "dtype") else g
                 for g, v in zip(grads, trainable_variables)]
        if grads and not self.built:
            self._build_first(trainable_variables)
        return grads, trainable_variables

    def _build_first(self, variables):
        """The first build, from `apply` or `get_unscaled_gradients`: in a trace, its
        variables made (and written) now, not when the function has been traced
        (`_distribute.built_before_the_trace`)."""
        with _distribute.built_before_the_trace(variables), \
                keras.name_scope(self.name, caller=self):
            self.build(variables)
        self.built = True

    def finalize_variable_values(self, var_list):
        """Called by `fit` at the end of training: also applies `min_scale_policy`."""
        self.inner_optimizer.finalize_variable_values(var_list)
        self.check_min_scale_policy()

    # -- diagnostics (host reads: call between steps) ------------------------------------

    def last_overflow(self) -> overflow.OverflowReport | None:
        """Describes the last skipped step, or returns None if there was none.

        Reads a few device values (a host sync): call it between steps, not
        inside one. Applies `min_scale_policy` first (see
        `check_min_scale_policy`).

        Returns:
            A `tfdls.OverflowReport` with the step, the names of the
            variables whose gradients were non-finite, the loss scale and the
            skipped-step count; None before the first overflow or when
            `overflow_attribution=False`.

        Example:

        >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
        >>> w = keras.Variable([1.0], name="w")
        >>> opt.apply([tf.constant([float("inf")])], [w])
        >>> print(opt.last_overflow())
        step 0 (0 updates applied): non-finite gradients for w; loss scale now 16384, 1 steps skipped in total
        """
        if self._overflow is None:  # not built yet
            return None
        self.check_min_scale_policy()
        skipped = self.loss_scale.skipped_steps
        report = self._overflow.last_overflow(
            self.loss_scale().numpy(), 0 if skipped is None else skipped.numpy()
        )
        if report is not None and self._boundary_scales is not None:
            report = dataclasses.replace(
                report, boundaries=self._boundary_scales.lowered_names()
            )
        return report

    def gradient_stats(self) -> dict[str, stats_lib.GradientStats]:
        """Where the scaled gradients sat in float16's range on the last finite step.

        A host read (call between steps). Needs ``gradient_stats=True``.

        Returns:
            ``{variable path: tfdls.GradientStats}`` with the headroom below
            float16's maximum in bits and the fractions of zero and subnormal
            elements (NaN before the first finite step).

        Example:

        >>> opt = tfdls.LossScaleOptimizer(
        ...     keras.optimizers.SGD(), tfdls.DynamicLossScale(2.0**10), gradient_stats=True)
        >>> w = keras.Variable([0.0, 0.0], name="w")
        >>> opt.apply([tf.constant([0.0, 32.0]) * 2.0**10], [w])  # 32 * 1024 = 2**15
        >>> opt.gradient_stats()["w"]
        GradientStats(headroom_bits=0.99929..., zero_fraction=0.5, subnormal_fraction=0.0, boundary_factor=1.0)
        """
        if not self.record_gradient_stats:
            raise ValueError(
                "gradient_stats() needs LossScaleOptimizer(..., gradient_stats=True); "
                "got gradient_stats=False"
            )
        if self._stats is None:  # not built yet
            return {}
        return self._stats.read()

    def check_min_scale_policy(self) -> None:
        """Applies `min_scale_policy` to overflows-at-minimum not yet reported.

        A host read of one counter. `tfdls.LossScaleMonitor` calls it at its
        logging frequency, `fit` at the end of training; in a custom loop,
        call it as often as you want to hear of a stuck scale.
        """
        if self._overflow is not None and self.dynamic:
            self._overflow.check_policy(self.loss_scale.min_loss_scale)

    # -- saving -------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": loss_scale_lib.serialize(self.loss_scale),
            "overflow_attribution": self.overflow_attribution,
            "min_scale_policy": self._min_scale_policy.policy,
            "jit_compile": self.jit_compile,
            "gradient_stats": self.record_gradient_stats,
            "scale_boundaries": self._boundaries_expected,
            "all_reduce_dtype": self.all_reduce_dtype,
        }

    def load_own_variables(self, store: Any) -> None:
        """Restores the state `save_own_variables` wrote, tfdls' or Keras 3's (see
        `tfdls._keras_style.load_keras_layout`)."""
        if not _keras_style.load_keras_layout(self, store):
            super().load_own_variables(store)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict | None = None) -> LossScaleOptimizer:
        """Builds the optimizer from `get_config()`'s output, tfdls' or Keras 3's.

        A Keras 3 `LossScaleOptimizer` config (``inner_optimizer``,
        ``initial_scale``, ``dynamic_growth_steps``, ``name``, and the base
        optimizer keys older Keras versions wrote at their defaults) builds
        the equivalent tfdls optimizer, with a `DynamicLossScale` (README,
        "Migrating", shows how to continue a `.keras` file saved with
        Keras' class). A base key at any other value is a `ValueError`.
        """
        config = dict(config)
        # A model is not part of the config: set_scale_boundaries(model) again.
        expects_boundaries = bool(config.pop("scale_boundaries", False))
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        optimizer = cls(inner, **_keras_style.drop_unused_learning_rate(config))
        optimizer._boundaries_expected = expects_boundaries
        return optimizer
