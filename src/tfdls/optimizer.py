"""`LossScaleOptimizer`: dynamic loss scaling around any Keras 3 optimizer."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Sequence

import keras
import tensorflow as tf

from tfdls import _compat, _distribute, _masked_update, _plan, finite, overflow
from tfdls import gradient_stats as stats_lib
from tfdls import loss_scale as loss_scale_lib

_KERAS_STYLE_KEYWORDS = ("initial_scale", "dynamic_growth_steps", "dynamic")
# Float types with less range than float32 are divided in float32.
_NARROW_FLOATS = (tf.float16, tf.bfloat16)


def _check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss-scale optimizer "
            f"({type(inner_optimizer).__module__}.{type(inner_optimizer).__name__}); "
            "wrap the plain optimizer instead, or scaling happens twice."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        hint = ""
        if isinstance(inner_optimizer, str):
            hint = f" Use keras.optimizers.get({inner_optimizer!r}) to build one."
        elif "tf_keras" in type(inner_optimizer).__module__:
            hint = " tf_keras (Keras 2) optimizers are not supported; use keras.optimizers."
        raise TypeError(
            "`inner_optimizer` must be a Keras 3 optimizer (an instance of "
            f"keras.optimizers.Optimizer); got inner_optimizer={inner_optimizer!r}.{hint}"
        )
    if inner_optimizer.loss_scale_factor is not None:
        raise ValueError(
            "`inner_optimizer` has its own loss_scale_factor="
            f"{inner_optimizer.loss_scale_factor!r}; it would scale the loss a second "
            "time. Set loss_scale_factor=None on it and give the scale to "
            "LossScaleOptimizer(loss_scale=...) instead."
        )


def _build_loss_scale(loss_scale, keras_style):
    """Resolves the two argument styles into one `LossScale`."""
    if keras_style and loss_scale is not None:
        raise ValueError(
            "Give either `loss_scale` or the Keras-style keywords "
            f"{sorted(keras_style)}, not both; got loss_scale={loss_scale!r} and "
            + ", ".join(f"{k}={v!r}" for k, v in sorted(keras_style.items()))
        )
    if not keras_style:
        return loss_scale_lib.get("dynamic" if loss_scale is None else loss_scale)
    initial_scale = keras_style.get("initial_scale", 2.0**15)
    if keras_style.get("dynamic", True):
        return loss_scale_lib.DynamicLossScale(
            initial_loss_scale=initial_scale,
            increment_period=keras_style.get("dynamic_growth_steps", 2000),
        )
    if "dynamic_growth_steps" in keras_style:
        raise ValueError(
            "`dynamic_growth_steps` only applies to a dynamic loss scale; got "
            f"dynamic=False and dynamic_growth_steps={keras_style['dynamic_growth_steps']!r}"
        )
    return loss_scale_lib.FixedLossScale(initial_scale)


def _reciprocal_factors(scale):
    """Two normal floats whose product is ``1 / scale``, for any normal float32 scale.

    ``1 / scale`` itself is subnormal above 2**126, and CPU kernels flush it
    to zero. Splitting the scale's binary exponent ``e`` as ``2**-(e // 2)``
    and the rest keeps both factors normal; for a power-of-two scale both are
    powers of two, so multiplying by them is exact wherever ``g / scale`` is
    a normal float, and underflows exactly where it does.
    """
    bits = tf.bitcast(tf.cast(scale, tf.float32), tf.int32)
    exponent = tf.bitwise.right_shift(bits, 23) - 127
    half = tf.bitcast(tf.bitwise.left_shift(127 - exponent // 2, 23), tf.float32)
    return half, tf.math.reciprocal(scale * half)


def _divide(grad, scale):
    """`grad / scale`, exactly at every scale.

    Inside XLA as a multiplication by two normal factors (see
    `_reciprocal_factors`): XLA treats a float division as expensive and
    would not fuse it into several consumers (Adam's two moments), so the
    divided gradient would be written and read once more. Elsewhere a plain
    division, one kernel.
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(grad.values, scale), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    narrow = grad.dtype in _NARROW_FLOATS
    wide = tf.cast(grad, tf.float32) if narrow else grad
    if _compat.in_xla_context():
        first, second = _reciprocal_factors(scale)
        result = wide * tf.cast(first, wide.dtype) * tf.cast(second, wide.dtype)
    else:
        result = wide / tf.cast(scale, wide.dtype)
    return tf.cast(result, grad.dtype) if narrow else result


def _multiply(grad, scale):
    """`grad * scale`, the inverse of `_divide`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_multiply(grad.values, scale), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    if grad.dtype in _NARROW_FLOATS:
        return tf.cast(tf.cast(grad, tf.float32) * scale, grad.dtype)
    return grad * tf.cast(scale, grad.dtype)


@keras.saving.register_keras_serializable(package="tfdls")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras 3 optimizer with (dynamic) loss scaling.

    The loss is multiplied by the current scale before differentiation; the
    gradients are divided by it before the inner optimizer sees them. A step
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
            XLA-compiled are unaffected. XLA may round the inner update
            differently in the last bit; skipped steps stay exact.
        gradient_stats: record, on every finite step and per variable, where
            the scaled gradients sit in float16's range: headroom below 65504
            in bits, and the fractions of zero and of subnormal (below
            2**-14) elements (see `gradient_stats()` and
            `tfdls.gradient_stats`). Off by default: it reads every gradient
            a few more times (on XLA's CPU backend about three more passes,
            see README's benchmark). No host call.

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
        **kwargs: Any,
    ):
        keras_style = {k: kwargs.pop(k) for k in _KERAS_STYLE_KEYWORDS if k in kwargs}
        if kwargs:
            raise TypeError(
                f"LossScaleOptimizer got unexpected keyword arguments {sorted(kwargs)}; "
                "optimizer options such as clipnorm or weight_decay belong on the "
                "inner optimizer."
            )
        _check_inner_optimizer(inner_optimizer)
        resolved = _build_loss_scale(loss_scale, keras_style)
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
        self._unscaled_marks = _plan.UnscaledMarks()
        # Made by build():
        self._overflow: overflow.OverflowRecord | None = None
        self._stats: stats_lib.GradientStatsRecord | None = None
        self._fallback_warned = False
        self.step_plan = None

    # -- the loss scale, as Keras 3 and tf_keras name it ---------------------------

    @property
    def dynamic(self):
        return isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)

    @property
    def initial_scale(self):
        if self.dynamic:
            return self.loss_scale.initial_loss_scale
        if isinstance(self.loss_scale, loss_scale_lib.FixedLossScale):
            return self.loss_scale.loss_scale_value
        return None

    @property
    def dynamic_growth_steps(self):
        return self.loss_scale.increment_period if self.dynamic else None

    @property
    def dynamic_scale(self):
        """The current scale, as Keras 3's `LossScaleOptimizer.dynamic_scale`.

        The `DynamicLossScale`'s variable, or a float32 tensor for other scales.
        """
        if self.dynamic:
            return self.loss_scale.current_loss_scale
        return self.loss_scale()

    @property
    def step_counter(self):
        """Finite steps since the scale last grew or shrank, as in Keras 3.

        A dynamic scale's `num_good_steps` variable; 0 for a fixed scale.
        """
        if self.dynamic:
            return self.loss_scale.num_good_steps
        if isinstance(self.loss_scale, loss_scale_lib.FixedLossScale):
            return tf.constant(0, tf.int64)
        raise AttributeError(
            f"step_counter: the custom loss scale {type(self.loss_scale).__name__} "
            "keeps no step counter that tfdls knows of."
        )

    @property
    def variables(self):
        return self._variables + list(self.loss_scale.variables) + self.inner_optimizer.variables

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        # The generic Optimizer.build; Keras' LossScaleOptimizer.build would
        # create its own scale variables.
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        names = [getattr(v, "path", None) or v.name for v in var_list]
        with tf.name_scope(self.name):
            if self.record_gradient_stats:
                self._stats = stats_lib.GradientStatsRecord(names)
            self._overflow = overflow.OverflowRecord(
                names, self.overflow_attribution, self._min_scale_policy, self._stats
            )

    # -- scaling ----------------------------------------------------------------

    def scale_loss(self, loss: Any) -> tf.Tensor:
        """Returns `loss * scale`: the hook Keras 3's `fit` calls."""
        return keras.ops.multiply(loss, self.loss_scale())

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf_keras style `scale_loss`; also accepts a zero-argument callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Divides gradients by the scale (tf_keras style).

        `apply`/`apply_gradients` does not divide these again, nor (inside a
        `tf.function`) anything computed from them, such as clipped
        gradients; other gradients, for example the scaled ones passed to this
        method for logging, are divided as usual. See `tfdls._plan.UnscaledMarks`.
        """
        grads = list(grads)
        scale = self.loss_scale()
        unscaled = [None if g is None else _divide(g, scale) for g in grads]
        self._unscaled_marks.mark(grads, unscaled)
        return unscaled

    # -- applying -----------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Divides `grads` by the scale (unless already divided), updates the
        loss scale, and applies them with the inner optimizer iff all are finite."""
        try:
            grads, trainable_variables = self._arguments(grads, trainable_variables)
            if not grads:
                return
            plan = self._plan(grads, trainable_variables)
            self.step_plan = plan
            if plan.compile:
                self._compiled_step(plan, grads, trainable_variables)
            else:
                self._step(plan, grads, trainable_variables)
        finally:
            # An eager mark lasts until the next apply, also one that raised.
            self._unscaled_marks.clear()

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
        if grads and not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        return grads, trainable_variables

    def _plan(self, grads, trainable_variables):
        loss_scale = self.loss_scale
        if isinstance(loss_scale, loss_scale_lib.DynamicLossScale):
            min_scale = loss_scale.min_loss_scale
        elif isinstance(loss_scale, loss_scale_lib.FixedLossScale):
            min_scale = loss_scale.loss_scale_value
        else:
            min_scale = None
        return _plan.plan_step(
            grads,
            trainable_variables,
            self.inner_optimizer,
            self.jit_compile,
            self._unscaled_marks.classify(grads),
            fixed_scale=isinstance(loss_scale, loss_scale_lib.FixedLossScale),
            dynamic_scale=isinstance(loss_scale, loss_scale_lib.DynamicLossScale),
            min_scale=min_scale,
        )

    def _compiled_step(self, plan, grads, trainable_variables):
        present = [i for i, g in enumerate(grads) if g is not None]
        inside = dataclasses.replace(plan, compile=False)

        def compiled_step(present_grads):
            full = [None] * len(grads)
            for i, g in zip(present, present_grads):
                full[i] = g
            self._step(inside, full, trainable_variables)

        # One XLA cluster: check, division and update fuse.
        tf.function(compiled_step, jit_compile=True)([grads[i] for i in present])

    def _step(self, plan, grads, trainable_variables):
        """Executes `plan`: divide, check, update the scale, apply or skip."""
        scale = self.loss_scale()  # the scale the gradients were multiplied by
        unscaled = [_divide(g, scale) if d else g for g, d in zip(grads, plan.divide)]
        checked = grads if plan.check == "scaled" else unscaled
        should_apply = self._update_loss_scale(checked, unscaled, trainable_variables, scale)
        if self._stats is not None:
            self._record_gradient_stats(plan, grads, checked, trainable_variables, scale,
                                        should_apply)
        if should_apply is True:
            self.inner_optimizer.apply(unscaled, trainable_variables)
            return
        if plan.skip == "masked":
            audit = _masked_update.apply(
                self.inner_optimizer, unscaled, trainable_variables, should_apply
            )
            if audit.exact:
                return
            self._warn_fallback(audit.reason)
        _distribute.apply_if(should_apply, self.inner_optimizer.apply, (unscaled, trainable_variables))

    def _update_loss_scale(self, checked, unscaled, trainable_variables, scale):
        """Decides whether this step applies (replica-agreed) and steps the scale."""
        loss_scale = self.loss_scale
        if isinstance(loss_scale, loss_scale_lib.FixedLossScale):
            return True
        if not isinstance(loss_scale, loss_scale_lib.DynamicLossScale):
            _, should_apply = loss_scale.update(unscaled)
            if should_apply is True:
                return True
            # A custom scale's decision, made the same on every replica.
            vetoes = tf.cast(tf.logical_not(should_apply), tf.float32)
            return tf.equal(_distribute.sum_over_replicas(vetoes), 0.0)
        self._check_variables_are_known(trainable_variables)
        present = [i for i, g in enumerate(checked) if g is not None]
        # Per gradient: how many replicas saw NaN/Inf (the same on all replicas).
        counts = finite.nonfinite_counts(
            finite.gradient_values([checked[i] for i in present]), across_replicas=True
        )
        is_finite = tf.equal(tf.reduce_sum(counts), 0.0)
        loss_scale.update_from_decision(is_finite)
        positions = [self._get_variable_index(trainable_variables[i]) for i in present]
        num_variables = len(self._trainable_variables)
        if positions == list(range(num_variables)):
            mask = counts > 0
        else:
            indices = tf.constant(positions, tf.int32, shape=[len(positions), 1])
            mask = tf.scatter_nd(indices, counts, [num_variables]) > 0
        stuck = tf.logical_and(tf.logical_not(is_finite), scale <= loss_scale.min_loss_scale)
        self._overflow.record(is_finite, mask, tf.cast(self.iterations, tf.int64), stuck)
        return is_finite

    def _record_gradient_stats(self, plan, grads, checked, trainable_variables, scale,
                               should_apply):
        present = [i for i, g in enumerate(grads) if g is not None]
        # The scaled gradients: as given, or multiplied back where they came
        # already divided.
        scaled = [
            grads[i] if plan.divide[i] else _multiply(grads[i], scale) for i in present
        ]
        stats = stats_lib.worst_over_replicas(
            stats_lib.tensor_stats(finite.gradient_values(scaled))
        )
        if should_apply is True:  # a fixed scale: keep finite steps' figures only
            should_apply = finite.all_finite([checked[i] for i in present], across_replicas=True)
        positions = [self._get_variable_index(trainable_variables[i]) for i in present]
        self._stats.record(should_apply, stats, positions)

    def _warn_fallback(self, reason):
        if self._fallback_warned:
            return
        self._fallback_warned = True
        warnings.warn(
            f"tfdls: the update of {type(self.inner_optimizer).__name__} could not be "
            f"shown to skip exactly without a branch ({reason}); this step skips with a "
            "tf.cond instead, which waits for the device on every step.",
            RuntimeWarning,
            stacklevel=4,
        )

    # -- Keras 3 LossScaleOptimizer methods, on tfdls' state ---------------------------

    def check_finite(self, grads: Any) -> tf.Tensor:
        """Keras 3's name for `tfdls.all_finite(grads)` (this replica's gradients)."""
        return finite.all_finite(grads)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError(
            "stateless_apply is not supported by tfdls.LossScaleOptimizer (nor by "
            "Keras' optimizers on the TensorFlow backend, where it conflicts with "
            "tf.distribute); use apply()."
        )

    def _common_apply(self, grads, trainable_variables=None):
        self.apply(grads, trainable_variables)

    def _tf_apply(self, grads, trainable_variables=None):
        self.apply(grads, trainable_variables)

    def _not_used(self, *args, **kwargs):
        raise NotImplementedError(
            "tfdls.LossScaleOptimizer does not use Keras' LossScaleOptimizer step "
            "helpers (its state is in `loss_scale`); call apply()."
        )

    _stateful_handle_finite_grads = _not_used
    _stateful_handle_non_finite_grads = _not_used
    _stateless_handle_finite_grads = _not_used
    _stateless_handle_non_finite_grads = _not_used

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
        step 0: non-finite gradients for w; loss scale now 16384, 1 steps skipped in total
        """
        if self._overflow is None:  # not built yet
            return None
        self.check_min_scale_policy()
        skipped = getattr(self.loss_scale, "num_skipped_steps", None)
        return self._overflow.last_overflow(
            self.loss_scale().numpy(), 0 if skipped is None else skipped.numpy()
        )

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
        GradientStats(headroom_bits=0.99929..., zero_fraction=0.5, subnormal_fraction=0.0)
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
        if self._overflow is not None and isinstance(
            self.loss_scale, loss_scale_lib.DynamicLossScale
        ):
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
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict | None = None) -> LossScaleOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
