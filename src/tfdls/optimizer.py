"""`LossScaleOptimizer`: dynamic loss scaling around any Keras 3 optimizer."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdls import _compat, _distribute, _division, _masked_update, _plan, _record, _unscaling
from tfdls import _boundary_scales
from tfdls import boundaries as boundaries_lib
from tfdls import finite, overflow
from tfdls import gradient_stats as stats_lib
from tfdls import loss_scale as loss_scale_lib

_KERAS_STYLE_KEYWORDS = ("initial_scale", "dynamic_growth_steps", "dynamic")
# Keras' base-optimizer keywords, at the values that mean "not set". Keras 3's
# LossScaleOptimizer accepts them at these values (older Keras 3 configs hold
# them, so `.keras` files may) and refuses any other value.
_BASE_OPTIMIZER_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
# The step path has no tensor-dependent Python control flow: AutoGraph need
# not rewrite it (as Keras' own trainer code is not), which also keeps
# tracebacks readable.
_NOT_CONVERTED = tf.autograph.experimental.do_not_convert


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


def _is_unset(value, default):
    if default is None or isinstance(default, bool):
        return value is default
    # A number (ema_momentum): by value, as Keras compares; but True is not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default


def _check_base_optimizer_keywords(kwargs):
    """Drops Keras' base-optimizer keywords at their defaults; raises for the rest.

    ValueError, as Keras 3 raises, so that code catching Keras' error still
    catches tfdls'.
    """
    for key, default in _BASE_OPTIMIZER_DEFAULTS.items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        if _is_unset(value, default):
            continue
        if key == "loss_scale_factor":
            raise ValueError(
                f"LossScaleOptimizer does not take loss_scale_factor={value!r}, and its "
                "`inner_optimizer` may not have one either (the loss would be scaled "
                f"twice); for a fixed scale give LossScaleOptimizer(loss_scale={value!r})."
            )
        raise ValueError(
            f"LossScaleOptimizer does not take `{key}`; got {key}={value!r}. It is an "
            f"option of the optimizer that applies the gradients: set {key}={value!r} "
            "on the `inner_optimizer` (it receives the unscaled gradients)."
        )
    if kwargs:
        names = "`, `".join(kwargs)  # in the order given, as Keras lists them
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{names}` (got {given}); "
            "options of the optimizer itself belong on the `inner_optimizer`."
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


def _as_value(grad, scale, already_unscaled):
    """The "gradient" of an `overwrite_with_gradient` variable, a value never divided.

    get_unscaled_gradients, which does not know the variables, divided it
    when the step is unscaled: multiplied back, exactly for a power-of-two
    scale.
    """
    if grad is None:
        return None
    grad = tf.convert_to_tensor(grad)
    return tf.where(already_unscaled, _division.multiply(grad, scale), grad)


@dataclasses.dataclass(frozen=True)
class _Divisions:
    """How `LossScaleOptimizer._step` divides each gradient (see `_check_with_boundaries`).

    kinds: per gradient, ``"value"`` (`as_value`), ``"scale"`` (`by_scale`)
    or ``"boundaries"`` (`by_boundaries`, with the divisor of its segment:
    `segments` per gradient, `segment_divisors` the vectors
    ``(exponents, pieces)`` of `LossScaleOptimizer._boundary_divisors`).
    """

    as_value: Any
    by_scale: Any
    by_boundaries: Any
    kinds: list
    segments: list | None
    segment_divisors: tuple | None

    def gather_divisors(self, indices):
        """The ``(exponent, pieces)`` of segments `indices` (1 below boundary 0), as vectors:
        elementwise the values each gradient of those segments is divided by."""
        exponents, pieces = self.segment_divisors
        indices = tf.constant(indices, tf.int32)
        return (tf.gather(exponents, indices),
                None if pieces is None else [tf.gather(p, indices) for p in pieces])


class BFloat16Warning(UserWarning):
    """Loss scaling a bfloat16 model: harmless, but it does nothing useful.

    bfloat16 has float32's exponent range, so its gradients neither overflow
    nor underflow where float32's would not: it needs no loss scale. tfdls
    still scales, checks and skips as configured, and its gradient
    statistics stay float16-relative. Warned once per optimizer, when it is
    built under a ``mixed_bfloat16`` policy or for bfloat16 variables.
    Silence it with ``warnings.filterwarnings("ignore", category=tfdls.BFloat16Warning)``.

    Example:

    >>> keras.mixed_precision.set_global_policy("mixed_bfloat16")
    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     opt.build([keras.Variable([1.0])])
    >>> [w.category.__name__ for w in caught]
    ['BFloat16Warning']
    >>> keras.mixed_precision.set_global_policy("float32")
    """


def _warn_if_bfloat16(var_list):
    compute_dtype = keras.mixed_precision.global_policy().compute_dtype
    dtypes = {tf.as_dtype(getattr(v, "dtype", tf.float32)) for v in var_list}
    if compute_dtype == "bfloat16" or tf.bfloat16 in dtypes:
        warnings.warn(
            "tfdls: this model computes in bfloat16, which has float32's range and needs "
            "no loss scaling; LossScaleOptimizer still scales, checks and skips as "
            "configured, and its gradient statistics are float16-relative. Use the inner "
            "optimizer alone, or silence this with warnings.filterwarnings('ignore', "
            "category=tfdls.BFloat16Warning).",
            BFloat16Warning,
            stacklevel=3,
        )


class _TrackedVariables(tf.Module):
    """Holds variables so that `tf.train.Checkpoint` and SavedModel track them."""

    def __init__(self, variables):
        super().__init__(name="inner_optimizer_state")
        self.tracked = list(variables)


@keras.saving.register_keras_serializable(package="tfdls")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
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

    Attributes:
        inner_optimizer: the wrapped Keras optimizer.
        loss_scale: the `tfdls.LossScale` (a `tf.Module`); ``loss_scale()`` is
            the current scale, a float32 scalar tensor.
        step_plan: the `tfdls.StepPlan` of the last traced (or eager) `apply`:
            how it divides, checks, skips and compiles, and why a fast path
            was not taken; None before the first `apply`.
        dynamic, initial_scale, dynamic_growth_steps, dynamic_scale,
            step_counter: Keras 3 / tf_keras names for the scale's settings
            and state (see their docstrings).

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
        **kwargs: Any,
    ):
        keras_style = {k: kwargs.pop(k) for k in _KERAS_STYLE_KEYWORDS if k in kwargs}
        _check_base_optimizer_keywords(kwargs)
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
        # The flag behind the unscaling rule (see `get_unscaled_gradients`).
        self._unscaling = _unscaling.UnscaleState()
        # The scale scale_loss multiplied by, which apply divides by (`tfdls._record`).
        self._record = _record.ScaleRecord()
        # Made by build():
        self._overflow: overflow.OverflowRecord | None = None
        self._stats: stats_lib.GradientStatsRecord | None = None
        self._fallback_warned = False
        self.step_plan = None
        # Scale boundaries (see `set_scale_boundaries`): the model's map, and
        # the per-step arithmetic made by build().
        self._boundary_map: boundaries_lib.BoundaryMap | None = None
        self._boundary_scales: _boundary_scales.BoundaryScales | None = None
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
        if type(ls) is not loss_scale_lib.DynamicLossScale or not ls.powers_of_two:
            raise ValueError(
                "scale_boundaries needs a tfdls.DynamicLossScale whose values are powers "
                f"of two (every factor is one, and overflows must be able to skip a step); "
                f"got loss_scale={ls!r}"
            )
        boundary_map = boundaries_lib.read_boundaries(model)
        boundaries_lib.take_ownership(boundary_map)
        boundaries_lib.guard_layers_below(model, boundary_map)
        self._boundary_map = boundary_map
        self._boundaries_expected = True
        if self.built:
            self._boundary_scales = _boundary_scales.BoundaryScales(
                boundary_map, self._trainable_variables
            )

    def scale_boundary_factors(self) -> dict[str, float]:
        """``{boundary name: factor}`` now (a host read); empty without scale boundaries."""
        if self._boundary_map is None:
            return {}
        return {b.name: b.factor() for b in self._boundary_map.boundaries}

    # -- the loss scale, as Keras 3 and tf_keras name it ---------------------------

    @property
    def dynamic(self) -> bool:
        """True for a `DynamicLossScale` (Keras 3's and tf_keras' ``dynamic``)."""
        return isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)

    @property
    def initial_scale(self) -> float | None:
        """The dynamic scale's initial value, or the fixed scale's value; None for a custom scale."""
        if self.dynamic:
            return self.loss_scale.initial_loss_scale
        if isinstance(self.loss_scale, loss_scale_lib.FixedLossScale):
            return self.loss_scale.loss_scale_value
        return None

    @property
    def dynamic_growth_steps(self) -> int | None:
        """The dynamic scale's `increment_period`; None for other scales."""
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

    def build(self, var_list):
        _warn_if_bfloat16(var_list)
        # Outside Keras' no-tracking scope: variables the inner optimizer
        # creates without add_variable (Nadam's `_u_product`, Adafactor's
        # placeholders) are tracked, so `variables`, `.keras` files and
        # checkpoints carry them.
        self.inner_optimizer.build(var_list)
        # Checkpoints and SavedModels find variables by tracking; not every
        # Keras optimizer tracks all of its own (MultiOptimizer does not track
        # its sub-optimizers'), so every variable of the inner optimizer is
        # tracked from here too (shared, not copied).
        self._inner_optimizer_state = _TrackedVariables(self.inner_optimizer.variables)
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
            if self._boundary_map is not None:
                self._boundary_scales = _boundary_scales.BoundaryScales(
                    self._boundary_map, var_list
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
        scale = self.loss_scale()
        if not self._scale_is_fixed():
            self._record.record(scale)
        if self._boundary_map is not None:
            # The factors this step's backward passes multiply by and its
            # applies divide by: an adaptation takes effect from here.
            boundaries_lib.record_factors(self._boundary_map.boundaries)
        return keras.ops.multiply(loss, scale)

    def _scale_is_fixed(self):
        # A fixed scale is the same when recorded and when read: nothing to record.
        return isinstance(self.loss_scale, loss_scale_lib.FixedLossScale)

    def _scales(self, trainable_variables=None):
        """The scale now, and the scale that multiplied the gradients of
        `trainable_variables` (all of the optimizer's, if None) by the rule of
        `tfdls._record`."""
        live = self.loss_scale()
        if self._scale_is_fixed():
            return live, live
        positions = None if trainable_variables is None else self._positions(trainable_variables)
        return live, self._record.scale_for(live, positions)

    def _positions(self, trainable_variables):
        """The indices of `trainable_variables` among the optimizer's; a ValueError naming
        one it was not built with."""
        if self._boundary_map is None:
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
        divided by the loss scale times its boundaries' factors.

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
        if variables is not None and self._boundary_map is not None and not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        _, scale = self._scales(variables if self.built else None)
        how = _division.method(
            _division.scale_is_power_of_two(self.loss_scale), _compat.in_xla_context()
        )
        if self._boundary_map is None:
            unscaled = [None if g is None else _division.divide(g, scale, how) for g in grads]
        else:
            if variables is None:
                raise ValueError(
                    "With scale_boundaries, get_unscaled_gradients needs the variables of "
                    "the gradients (each is divided by its own boundaries' factors): pass "
                    "trainable_variables=[...] in the order of grads; got "
                    f"trainable_variables={trainable_variables!r}"
                )
            divisors, _ = self._boundary_divisors(scale, tf.constant(False), variables)
            unscaled = [
                None if g is None
                else _division.divide(g, scale, how) if d is None
                else self._divide_by_boundaries(g, d, self._boundary_map.boundaries)
                for g, d in zip(grads, divisors)
            ]
        self._unscaling.record_unscaled(grads, unscaled)
        return unscaled

    def _max_exponent(self):
        """A static bound of |log2(loss scale * boundary factors)|."""
        depth = len(self._boundary_map.boundaries) if self._boundary_map else 0
        return 128 + max(abs(boundaries_lib.MIN_LOG2_FACTOR), boundaries_lib.MAX_LOG2_FACTOR) * depth

    def _boundary_divisors(self, divisor, already_unscaled, trainable_variables, totals=None):
        """Per variable: None (no boundary above it), or ``(exponent, pieces)`` to divide its
        gradient by with `_division.divide_by_power_of_two`; and the same per segment below
        a boundary as vectors ``(exponents, pieces)`` (None without such segments).

        The divisor of a variable below boundaries is ``2**(log2(divisor) + T)``,
        T the sum of the exponents of the boundaries above it; 1 where the
        gradients are already unscaled. Computed once per segment, as vectors;
        `pieces` (`_division.reciprocal_pieces`) only inside XLA.
        """
        scales = self._boundary_scales
        if totals is None:
            totals = scales.totals(scales.recorded_exponents())
        positions = self._positions(trainable_variables)
        segments = len(scales.boundaries)
        if not segments:
            return [None] * len(positions), None
        exponents = _division.exponent_of(divisor) + tf.cast(totals[1:], tf.int32)
        exponents = tf.where(already_unscaled, tf.zeros_like(exponents), exponents)
        by_segment = [(e, None) for e in tf.unstack(exponents, segments)]
        pieces = None
        if _compat.in_xla_context():
            pieces = _division.reciprocal_pieces(exponents, self._max_exponent())
            # [pieces, segments] -> per segment, its pieces.
            per_segment = tf.unstack(tf.stack(pieces, axis=1), segments)
            by_segment = [(e, tf.unstack(p)) for (e, _), p in zip(by_segment, per_segment)]
        per_variable = [None if scales.segment_of[p] == 0 else by_segment[scales.segment_of[p] - 1]
                        for p in positions]
        return per_variable, (exponents, pieces)

    def _divide_by_boundaries(self, grad, divisor, boundaries):
        exponent, pieces = divisor
        divided = _division.divide_by_power_of_two(grad, exponent, self._max_exponent(), pieces)
        # Recorded: a gradient that depends on this one (a joint clip by global
        # norm) carries no factor of these boundaries through it.
        for tensor in boundaries_lib._tensors_of(divided):
            boundaries_lib.seen.add(tensor, boundaries, divides=True)
        return divided

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
            self._unscaling.check(
                grads, [getattr(v, "path", None) or v.name for v in trainable_variables])
            self._check_boundaries_seen(grads, trainable_variables)
            plan = self._plan(grads, trainable_variables)
            self.step_plan = plan
            if plan.compile:
                self._compiled_step(plan, grads, trainable_variables)
            else:
                self._step(plan, grads, trainable_variables)
        finally:
            self._unscaling.end_step()

    def _check_boundaries_seen(self, grads, trainable_variables):
        """Refuses gradients that crossed scale boundaries this optimizer was not given."""
        if self._boundaries_expected and self._boundary_map is None:
            raise ValueError(
                "tfdls: this optimizer was saved with scale boundaries; give it the model "
                "again with optimizer.set_scale_boundaries(model) before training."
            )
        known = () if self._boundary_map is None else self._boundary_map.boundaries
        if self._boundary_map is not None:
            for layer, boundary in self._boundary_map.layers_with_losses():
                raise ValueError(
                    f"tfdls: the layer {layer.name!r} is below the scale boundary "
                    f"{boundary.name!r} "
                    "and its last call added a loss (add_loss, or a regularizer of a layer "
                    "inside it): that term reaches its variables without crossing the "
                    "boundary, so their gradients would mix two scales. Add the term in a "
                    "layer above every boundary, or move the boundary below this layer."
                )

        def unknown(boundaries):
            return sorted({b.name for b in boundaries if not any(b is k for k in known)})

        for variable in trainable_variables:
            names = unknown(boundaries_lib.owned_boundaries_above(variable))
            if names:
                path = getattr(variable, "path", None) or variable.name
                raise ValueError(
                    f"tfdls: the variable {path!r} is below the scale boundaries {names}, "
                    "which another LossScaleOptimizer owns (they multiply its gradient) and "
                    "this optimizer was not given, so it cannot divide out their factors. "
                    "Give it the model: LossScaleOptimizer(..., scale_boundaries=model), or "
                    "optimizer.set_scale_boundaries(model)."
                )
        # Gradients that crossed, in this trace, boundaries not given (owned or
        # not: another optimizer could take them after the trace), on a path
        # where no UnscaledInput divided them out again (as for a GAN
        # generator trained through a discriminator with boundaries).
        names = unknown(boundaries_lib.seen.crossed_undivided(grads))
        if names:
            raise ValueError(
                f"tfdls: the gradients crossed the scale boundaries {names}, which this "
                "optimizer was not given, so it cannot divide out their factors. Give it "
                "the model: LossScaleOptimizer(..., scale_boundaries=model), or "
                "optimizer.set_scale_boundaries(model) after loading a saved model."
            )

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
            fixed_scale=isinstance(loss_scale, loss_scale_lib.FixedLossScale),
            dynamic_scale=isinstance(loss_scale, loss_scale_lib.DynamicLossScale),
            min_scale=min_scale,
            power_of_two_scale=_division.scale_is_power_of_two(loss_scale),
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
        tf.function(compiled_step, jit_compile=True, autograph=False)(
            [grads[i] for i in present]
        )

    def _step(self, plan, grads, trainable_variables):
        """Executes `plan`: divide, check, update the scale, apply or skip."""
        # The scale the gradients were multiplied by: recorded by scale_loss,
        # not re-read (an earlier apply of this step may have changed it).
        live, scale = self._scales(trainable_variables)
        if not self._scale_is_fixed():
            self._record.mark_applied(self._positions(trainable_variables))
        # The unscaling rule, at run time: divide by 1 if get_unscaled_gradients
        # already divided this step's gradients.
        already_unscaled = self._unscaling.consume()
        divisor = tf.where(already_unscaled, tf.ones_like(scale), scale)
        boundary = None
        if self._boundary_scales is not None:
            # The boundaries' exponents now (the adaptation starts from these)
            # and the totals the backward pass multiplied the gradients by.
            exponents = self._boundary_scales.exponents()
            totals = self._boundary_scales.totals(self._boundary_scales.recorded_exponents())
            boundary = (exponents, totals, already_unscaled)
            per_variable, segment_divisors = self._boundary_divisors(
                divisor, already_unscaled, trainable_variables, totals
            )
            segments = [self._boundary_scales.segment_of[self._get_variable_index(v)]
                        for v in trainable_variables]
        else:
            per_variable = [None] * len(grads)
            segment_divisors = segments = None

        # How each gradient is divided; with boundaries the check divides each
        # gradient's largest magnitude the same way.
        divisions = _Divisions(
            as_value=lambda g: _as_value(g, scale, already_unscaled),
            by_scale=lambda g: _division.divide(g, divisor, plan.division),
            by_boundaries=lambda g, d: _division.divide_by_power_of_two(
                g, d[0], self._max_exponent(), d[1]),
            kinds=["value" if not d else "scale" if b is None else "boundaries"
                   for d, b in zip(plan.divide, per_variable)],
            segments=segments,
            segment_divisors=segment_divisors,
        )
        unscaled = [
            divisions.as_value(g) if kind == "value"
            else divisions.by_scale(g) if kind == "scale"
            else self._divide_by_boundaries(g, b, self._boundary_map.boundaries)
            for g, kind, b in zip(grads, divisions.kinds, per_variable)
        ]
        if boundary is not None:
            boundary = boundary + (divisions,)
        checked = grads if plan.check == "scaled" else unscaled
        should_apply = self._update_loss_scale(
            checked, unscaled, trainable_variables, scale, live, grads, boundary
        )
        if self._stats is not None:
            # Figures of the scaled gradients: the gradients as given, times
            # the scale where get_unscaled_gradients divided them.
            factor = tf.where(already_unscaled, scale, tf.ones_like(scale))
            factors = [factor if d else None for d in plan.divide]
            boundary_factors = [None] * len(grads)
            if boundary is not None:
                for i, variable in enumerate(trainable_variables):
                    segment = self._boundary_scales.segment_of[self._get_variable_index(variable)]
                    if segment:
                        boundary_factors[i] = tf.pow(2.0, totals[segment])
                        if factors[i] is not None:
                            factors[i] = factor * tf.where(
                                already_unscaled, boundary_factors[i], 1.0
                            )
            self._record_gradient_stats(grads, factors, checked, trainable_variables,
                                        should_apply, boundary_factors)
        if should_apply is True:
            self.inner_optimizer.apply(unscaled, trainable_variables)
            return
        if plan.skip == "masked":
            audit = _masked_update.apply(
                self.inner_optimizer, unscaled, trainable_variables, should_apply
            )
            if audit.exact:
                return
            # What actually runs: a cond (inside the compiled apply, if any).
            self.step_plan = dataclasses.replace(
                self.step_plan, skip="cond", reason=f"the audit failed: {audit.reason}"
            )
            self._warn_fallback(audit.reason)
        _distribute.apply_if(should_apply, self.inner_optimizer.apply, (unscaled, trainable_variables))

    def _update_loss_scale(self, checked, unscaled, trainable_variables, scale, live_scale,
                           grads=None, boundary=None):
        """Decides whether this step applies (replica-agreed) and steps the scale.

        With scale boundaries (`boundary`: this step's exponents, segment
        totals, unscaled flag and per-gradient dividers) the check reads each
        gradient once (`_check_with_boundaries`) and the factors adapt.
        """
        loss_scale = self.loss_scale
        if isinstance(loss_scale, loss_scale_lib.FixedLossScale):
            return True
        custom = loss_scale_lib.has_custom_update(loss_scale)
        if custom:
            # A custom scale (or a DynamicLossScale subclass with its own
            # update()) decides from the unscaled gradients, as in TF 2.4.
            _, should_apply = loss_scale.update(unscaled)
            if should_apply is True:
                return True
        self._check_variables_are_known(trainable_variables)
        present = [i for i, g in enumerate(checked) if g is not None]
        positions = [self._get_variable_index(trainable_variables[i]) for i in present]
        with_boundaries = boundary is not None and not custom
        if with_boundaries:
            counts, largest = self._check_with_boundaries(grads, present, boundary[-1])
        else:
            # Per gradient: how many replicas saw NaN/Inf (the same on all replicas).
            counts = finite.nonfinite_counts(
                finite.gradient_values([checked[i] for i in present]), across_replicas=True
            )
        # A step whose sums could overflow is skipped too (naming its variables),
        # whatever a custom scale decided; but a lower scale cannot help (the
        # sums are of divided gradients), so such a veto leaves the scale.
        may_overflow = self._sums_may_overflow([unscaled[i] for i in present],
                                               [trainable_variables[i] for i in present])
        vetoed = tf.constant(False) if may_overflow is None else tf.reduce_any(may_overflow)
        global_shrinks = None
        if custom:
            # The custom decision, made the same on every replica.
            vetoes = tf.cast(tf.logical_not(should_apply), tf.float32)
            all_finite = tf.equal(_distribute.sum_over_replicas(vetoes), 0.0)
            is_finite = tf.logical_and(all_finite, tf.logical_not(vetoed))
        else:
            all_finite = tf.equal(tf.reduce_sum(counts), 0.0)
            is_finite = tf.logical_and(all_finite, tf.logical_not(vetoed))
            if with_boundaries:
                global_shrinks = self._update_boundaries(
                    boundary, is_finite, counts, largest, positions, scale
                )
            # A skipped step resets the good-step count; only non-finite
            # gradients the global scale answers for shrink it.
            shrink = global_shrinks
            if may_overflow is not None:
                shrink = tf.logical_not(all_finite)
                if global_shrinks is not None:
                    shrink = tf.logical_and(shrink, global_shrinks)
            loss_scale.update_from_decision(is_finite, shrink=shrink)
        num_variables = len(self._trainable_variables)

        def over_all_variables(flags):  # a bool vector over `present` -> over every variable
            if positions == list(range(num_variables)):
                return flags
            indices = tf.constant(positions, tf.int32, shape=[len(positions), 1])
            return tf.scatter_nd(indices, tf.cast(flags, tf.float32), [num_variables]) > 0

        mask = over_all_variables(counts > 0)
        sum_mask = None
        if may_overflow is not None:
            # Reported apart: finite gradients whose sums could overflow.
            sum_mask = over_all_variables(tf.logical_and(may_overflow, counts == 0))
        min_loss_scale = getattr(loss_scale, "min_loss_scale", None)
        if min_loss_scale is None:
            stuck = tf.constant(False)
        else:
            stuck = tf.logical_and(tf.logical_not(all_finite), live_scale <= min_loss_scale)
            if global_shrinks is not None:
                stuck = tf.logical_and(stuck, global_shrinks)
        if may_overflow is not None:
            # A veto is stuck at any scale: min_scale_policy reports it.
            stuck = tf.logical_or(stuck, vetoed)
        self._overflow.record(is_finite, mask, tf.cast(self.iterations, tf.int64), stuck,
                              sum_mask)
        return is_finite

    def _sums_may_overflow(self, unscaled, variables):
        """Per gradient, whether a sum the inner optimizer forms from it could overflow (a bool
        vector, the same on every replica); None where it forms none.

        The rule: a step applies only if the sums the inner optimizer forms of
        the divided gradients are finite too: the replicas' sum (several
        replicas), the rows of one index (`tf.IndexedSlices`) and the window's
        accumulated gradient (``gradient_accumulation_steps``). See
        `finite.sums_may_overflow`; with one replica the accumulated sum is
        read exactly, as Keras adds it.
        """
        replicas = _distribute.replicas_in_sync()
        count = len(unscaled)
        accumulators = [self._accumulator_of(v) for v in variables]
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
                [unscaled[k] for k in summed], across_replicas=replicas > 1,
                extra_bounds=extra)))
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

    def _accumulator_of(self, variable):
        """The inner optimizer's gradient accumulator of `variable` (that of the
        sub-optimizer updating it, in a `MultiOptimizer`), or None."""
        if getattr(variable, "overwrite_with_gradient", False):
            return None  # Keras keeps the micro-batches' maximum, not their sum
        inner = self.inner_optimizer
        if getattr(inner, "_var_to_optimizer_idx", None) is not None:  # MultiOptimizer
            inner = inner.optimizers[inner._var_to_optimizer_idx[inner._var_key(variable)]]
        if not getattr(inner, "gradient_accumulation_steps", None):
            return None
        return inner._accumulated_gradients[inner._get_variable_index(variable)]

    def _check_with_boundaries(self, grads, present, divisions):
        """Per present gradient: how many replicas saw a non-finite gradient *after* its
        division, and its largest scaled magnitude (float32), both the same on every replica.

        A boundary's factor may be below 1 (a negative exponent, or a loss scale
        below 1), so a finite gradient can overflow when divided. Dividing is
        monotonic in magnitude, so the quotient of the largest magnitude
        (`finite.largest_magnitudes`, +inf for NaN/Inf) by the gradient's own
        divisor is finite exactly when every element's is: one reading of
        each gradient answers both the check and the adaptation. The
        quotients are computed per kind of division and dtype as vectors
        (elementwise, the same arithmetic as each gradient's), so a step
        costs a few operations, not a few per gradient.
        """
        largest = finite.largest_magnitudes(finite.gradient_values([grads[i] for i in present]))
        groups = {}
        for k, i in enumerate(present):
            groups.setdefault((divisions.kinds[i], largest[k].dtype), []).append(k)
        bad, magnitudes, order = [], [], []
        for (kind, _), members in groups.items():
            stacked = tf.stack([largest[k] for k in members])
            if kind == "value":
                quotient = divisions.as_value(stacked)
            elif kind == "scale":
                quotient = divisions.by_scale(stacked)
            else:
                quotient = divisions.by_boundaries(stacked, divisions.gather_divisors(
                    [divisions.segments[present[k]] - 1 for k in members]))
            bad.append(tf.logical_not(tf.math.is_finite(quotient)))
            magnitudes.append(tf.cast(stacked, tf.float32))
            order += members
        bad, magnitudes = tf.concat(bad, 0), tf.concat(magnitudes, 0)
        if order != sorted(order):  # back to the order of `present`
            inverse = np.argsort(order).astype(np.int32)
            bad, magnitudes = tf.gather(bad, inverse), tf.gather(magnitudes, inverse)
        counts = _distribute.sum_over_replicas(tf.cast(bad, tf.float32))
        return counts, _distribute.max_over_replicas(magnitudes)

    def _update_boundaries(self, boundary, is_finite, counts, largest, positions, scale):
        """The scale boundaries' step; returns whether the global scale answers an overflow."""
        exponents, totals, already_unscaled, _ = boundary
        scales = self._boundary_scales
        bad, largest_exponents = scales.segment_figures(counts, largest, positions)
        # Gradients given already unscaled: their scaled values are larger by
        # 2**(log2(scale) + T).
        scale_bits = tf.cast(_division.exponent_of(scale), tf.float32)
        largest_exponents = largest_exponents + tf.where(already_unscaled, scale_bits + totals, 0.0)
        return scales.update(exponents, totals, is_finite, bad, largest_exponents,
                             self.iterations)

    def _record_gradient_stats(self, grads, factors, checked, trainable_variables,
                               should_apply, boundary_factors=None):
        present = [i for i, g in enumerate(grads) if g is not None]
        stats = stats_lib.worst_over_replicas(
            stats_lib.tensor_stats(
                finite.gradient_values([grads[i] for i in present]),
                [factors[i] for i in present],
            )
        )
        ones = tf.constant(1.0)
        boundary_row = tf.stack([
            ones if boundary_factors is None or boundary_factors[i] is None
            else tf.cast(boundary_factors[i], tf.float32)
            for i in present
        ])
        stats = tf.concat([stats, boundary_row[tf.newaxis]], axis=0)
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
        step 0 (0 updates applied): non-finite gradients for w; loss scale now 16384, 1 steps skipped in total
        """
        if self._overflow is None:  # not built yet
            return None
        self.check_min_scale_policy()
        skipped = getattr(self.loss_scale, "num_skipped_steps", None)
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
            "scale_boundaries": self._boundaries_expected,
        }

    def load_own_variables(self, store: Any) -> None:
        """Restores the state `save_own_variables` wrote, tfdls' or Keras 3's.

        Keras 3's `LossScaleOptimizer` writes its iterations and learning
        rate, its step counter and scale, then the inner optimizer's
        variables. With a `DynamicLossScale`, such a store restores the
        scale and the good-step count (Keras' step counter counts the same
        steps); the hysteresis budget starts full and the monitoring
        counters keep their values, as Keras keeps neither.
        """
        own = len(self._variables)
        keras_layout = own + 2 + len(self.inner_optimizer.variables)
        if not (
            isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)
            and len(store.keys()) == keras_layout != len(self.variables)
        ):
            super().load_own_variables(store)
            return
        values = [np.asarray(store[str(i)]) for i in range(keras_layout)]
        ls = self.loss_scale
        for variable, value in zip(self._variables, values[:own]):
            variable.assign(value)
        ls.num_good_steps.assign(int(values[own]))
        # Keras' scale has no bounds (it can reach 0 or inf); tfdls' scale
        # stays within them, so a value outside is moved to the nearest bound.
        scale = float(values[own + 1])
        upper = ls.max_loss_scale or float(np.finfo(np.float32).max)
        ls.current_loss_scale.assign(
            ls.initial_loss_scale if np.isnan(scale) else min(max(scale, ls.min_loss_scale), upper)
        )
        ls.hysteresis_budget.assign(ls.hysteresis)
        for variable, value in zip(self.inner_optimizer.variables, values[own + 2:]):
            variable.assign(value)

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
        if "learning_rate" in config:
            # Older Keras configs may hold the wrapper's own rate, which Keras
            # fixes at 0 (the inner optimizer's rate is the one that acts).
            learning_rate = config.pop("learning_rate")
            if not _is_unset(learning_rate, 0.0):
                raise ValueError(
                    "LossScaleOptimizer.from_config: the config's learning_rate="
                    f"{learning_rate!r} is not the wrapper's unused rate of 0; set "
                    "learning_rate on the `inner_optimizer` config."
                )
        optimizer = cls(inner, **config)
        optimizer._boundaries_expected = expects_boundaries
        return optimizer
