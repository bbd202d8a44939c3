"""`LossScaleOptimizer`: dynamic loss scaling around any Keras 3 optimizer."""

import threading

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import tracking

from tfdls import _distribute
from tfdls import _folded_unscale
from tfdls import _masked_update
from tfdls import loss_scale as loss_scale_lib
from tfdls import overflow
from tfdls.finite import gradient_values

_KERAS_STYLE_KEYWORDS = ("initial_scale", "dynamic_growth_steps", "dynamic")
# Float types with less range than float32 are unscaled in float32: the
# reciprocal of a large scale is not representable in float16.
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


def _in_xla_context():
    """True while tracing inside an XLA-compiled function (no host calls there)."""
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _op_determinism_enabled():
    # Keras' jit_compile="auto" reads the same private flag.
    from tensorflow.python.framework import config  # no public getter

    return config.is_op_determinism_enabled()


class _UnscaledMarks(threading.local):
    """Per-thread flag: the next `apply` receives already-unscaled gradients.

    Thread-local because MirroredStrategy runs each replica in its own thread.
    """

    pending = False


@keras.saving.register_keras_serializable(package="tfdls")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras 3 optimizer with (dynamic) loss scaling.

    The loss is multiplied by the current scale before differentiation; the
    gradients are multiplied by its reciprocal before the inner optimizer sees
    them. A step whose gradients hold any NaN/Inf applies nothing (weights,
    optimizer slots and `iterations` stay exactly as they were) and the loss
    scale shrinks.

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
            (`tfdls.LossScaleStuckError`) or ``"ignore"``. Inside an XLA
            (``jit_compile``) step the host cannot be called, so there the
            policy is applied by `check_min_scale_policy()`, which
            `tfdls.LossScaleMonitor` calls at its logging frequency.
        jit_compile: whether `apply`, called inside a `tf.function` that is
            not itself XLA-compiled, runs as its own XLA cluster, so that the
            finiteness check, the unscaling and the inner update fuse (Adam's
            step then takes about half the time of Keras' graph-mode step).
            ``"auto"`` (the default) does so for a dynamic scale, without a
            `tf.distribute` strategy or op determinism, when the inner
            optimizer is a built-in Keras optimizer without weight decay,
            EMA, gradient accumulation, constraints or sparse gradients;
            ``True`` always, ``False`` never. Eager `apply`, steps that are
            already XLA-compiled and multi-replica strategies are unaffected.
            XLA may round the inner update differently in the last bit;
            skipped steps stay exact.

    With a Keras `SGD` as inner optimizer the gradients are not unscaled in a
    separate pass: SGD receives them scaled, with ``learning_rate / scale``
    (the same bits; see `tfdls._folded_unscale`).

    A fixed loss scale never skips a step (as in TensorFlow 2.4).

    Example, Keras 3 style (what `fit` does):

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    >>> with tf.GradientTape() as tape:
    ...     loss = opt.scale_loss(compute_loss())
    >>> opt.apply(tape.gradient(loss, model.trainable_variables),
    ...           model.trainable_variables)   # unscales, checks, applies

    Example, tf_keras / TF 2.4 style:

    >>> with tf.GradientTape() as tape:
    ...     scaled_loss = opt.get_scaled_loss(compute_loss())
    >>> grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables))
    >>> opt.apply_gradients(zip(grads, variables))  # not unscaled a second time
    """

    def __init__(
        self,
        inner_optimizer,
        loss_scale=None,
        name=None,
        *,
        overflow_attribution=True,
        min_scale_policy="warn",
        jit_compile="auto",
        **kwargs,
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
        if not (isinstance(jit_compile, bool) or jit_compile == "auto"):
            raise ValueError(
                "`jit_compile` must be True, False or 'auto'; "
                f"got jit_compile={jit_compile!r}"
            )
        # Skip keras.optimizers.LossScaleOptimizer.__init__: it would build a
        # second, Keras-owned scale. Our state lives in `self.loss_scale`.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.loss_scale = resolved
        self.overflow_attribution = overflow_attribution
        self._min_scale_policy = policy
        self.jit_compile = jit_compile
        self._unscaled_marks = _UnscaledMarks()
        self._stuck_overflows_seen = 0

    # -- pass-throughs --------------------------------------------------------

    @property
    def dynamic(self):
        return isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)

    @property
    def initial_scale(self):
        if self.dynamic:
            return self.loss_scale.initial_loss_scale
        return self.loss_scale.loss_scale_value

    @property
    def dynamic_growth_steps(self):
        return self.loss_scale.increment_period if self.dynamic else None

    @property
    def variables(self):
        return self._variables + list(self.loss_scale.variables) + self.inner_optimizer.variables

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        _folded_unscale.install(self.inner_optimizer)
        # The generic Optimizer.build; Keras' LossScaleOptimizer.build would
        # create its own scale variables.
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        # Diagnostics only (not checkpointed): which variables overflowed in
        # the last skipped step, at which step, and how many overflows
        # happened with the scale already at its minimum.
        self._variable_names = [getattr(v, "path", None) or v.name for v in var_list]
        # init_scope lifts them out of a tf.function (a first apply inside
        # strategy.run); a lifted variable needs a host initial value.
        with tf.init_scope(), tf.name_scope(self.name):
            self._overflow_mask = loss_scale_lib.state_variable(
                "overflow_mask", np.zeros([len(var_list)], np.bool_), tf.bool
            )
            self._last_overflow_step = loss_scale_lib.state_variable(
                "last_overflow_step", -1, tf.int64
            )
            self._stuck_overflows = loss_scale_lib.state_variable(
                "stuck_overflows", 0, tf.int64
            )

    # -- scaling ----------------------------------------------------------------

    def scale_loss(self, loss):
        """Returns `loss * scale`: the hook Keras 3's `fit` calls."""
        return keras.ops.multiply(loss, self.loss_scale())

    def get_scaled_loss(self, loss):
        """tf_keras style `scale_loss`; also accepts a zero-argument callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Divides gradients by the scale (tf_keras style).

        The next `apply`/`apply_gradients` in this thread then takes its
        gradients as already unscaled, so they are not divided twice.
        """
        unscaled = self._unscale(list(grads))
        self._unscaled_marks.pending = True
        return unscaled

    def _unscale(self, grads):
        # One reciprocal per step, then a multiply per gradient.
        reciprocal = tf.math.reciprocal(self.loss_scale())
        by_dtype = {}

        def unscale(values):
            if values.dtype in _NARROW_FLOATS:
                return tf.cast(tf.cast(values, tf.float32) * reciprocal, values.dtype)
            if values.dtype not in by_dtype:
                by_dtype[values.dtype] = tf.cast(reciprocal, values.dtype)
            return values * by_dtype[values.dtype]

        result = []
        for grad in grads:
            if grad is None:
                result.append(None)
            elif isinstance(grad, tf.IndexedSlices):
                result.append(tf.IndexedSlices(unscale(grad.values), grad.indices, grad.dense_shape))
            else:
                result.append(unscale(tf.convert_to_tensor(grad)))
        return result

    # -- applying -----------------------------------------------------------------

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Unscales `grads` (unless already unscaled), updates the loss scale,
        and applies them with the inner optimizer iff all are finite."""
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
        if not grads:
            return
        if all(g is None for g in grads):
            raise ValueError(
                f"No gradients provided for any variable: all {len(grads)} gradients are None."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True

        arrived_unscaled = self._unscaled_marks.pending
        self._unscaled_marks.pending = False
        if self._compiles_apply(grads, trainable_variables):
            present = [i for i, g in enumerate(grads) if g is not None]

            def compiled_apply(present_grads):
                full = [None] * len(grads)
                for i, g in zip(present, present_grads):
                    full[i] = g
                return self._loss_scaled_apply(full, trainable_variables, arrived_unscaled)

            # One XLA cluster: check, unscale and update fuse; the stuck-scale
            # report calls the host, so it runs after it, outside.
            stuck_report = tf.function(compiled_apply, jit_compile=True)(
                [grads[i] for i in present]
            )
        else:
            stuck_report = self._loss_scaled_apply(grads, trainable_variables, arrived_unscaled)
        if stuck_report is not None and not _in_xla_context():
            self._report_if_stuck(*stuck_report)

    def _compiles_apply(self, grads, trainable_variables):
        """Whether this apply runs as its own XLA cluster (see `jit_compile`)."""
        if self.jit_compile is False or not tf.inside_function() or _in_xla_context():
            return False
        if _distribute._has_strategy():
            return False  # replicas agree through merge calls, which XLA cannot hold
        if self.jit_compile is True:
            return True
        # "auto": where it is known to compile and to be faster.
        return (
            not tf.distribute.has_strategy()
            and not _op_determinism_enabled()
            and isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale)
            and _masked_update.eligible(self.inner_optimizer, grads, trainable_variables)
        )

    def _loss_scaled_apply(self, grads, trainable_variables, arrived_unscaled):
        """Checks, updates the scale, applies; returns the stuck-report arguments or None."""
        checked = grads  # what the finiteness check reads
        may_fall_below_one = self._scale_may_fall_below_one()
        fold = (
            not arrived_unscaled
            and not may_fall_below_one
            and _folded_unscale.eligible(self.inner_optimizer, grads, trainable_variables)
        )
        if fold:
            # SGD takes the scaled gradients and learning_rate / scale: no
            # unscaling pass (see _folded_unscale). Checking the scaled
            # gradients decides the same, as below. The scale is read before
            # the update below can grow it.
            scale = self.loss_scale()
        elif not arrived_unscaled:
            unscaled = self._unscale(grads)
            if may_fall_below_one:
                # Multiplying by 1/scale > 1 can overflow: check the result.
                checked = unscaled
            # Otherwise 1/scale <= 1 cannot turn a finite gradient non-finite,
            # so checking the scaled gradients decides the same; under XLA it
            # also leaves the unscaling multiply a single reader, the update,
            # into which it fuses instead of being materialized.
            grads = unscaled

        stuck_report = None
        if isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale):
            should_apply, stuck_report = self._update_dynamic_scale(checked, trainable_variables)
        else:
            _, should_apply = self.loss_scale.update(grads)
        if fold:
            inner_apply, args = self._apply_folded, (scale, grads, trainable_variables)
        else:
            inner_apply, args = self.inner_optimizer.apply, (grads, trainable_variables)
        if should_apply is True:  # a fixed scale: no condition to evaluate
            inner_apply(*args)
        elif _in_xla_context() and _masked_update.eligible(
            self.inner_optimizer, grads, trainable_variables
        ):
            with _masked_update.masked_writes(self.inner_optimizer, should_apply):
                inner_apply(*args)
        else:
            _distribute.apply_if(should_apply, inner_apply, args)
        return stuck_report

    def _apply_folded(self, scale, scaled_grads, trainable_variables):
        # Entered in the thread that runs the inner apply (a replica's thread
        # under MirroredStrategy), where the update step reads it.
        with _folded_unscale.learning_rate_divided_by(scale):
            self.inner_optimizer.apply(scaled_grads, trainable_variables)

    def _scale_may_fall_below_one(self):
        loss_scale = self.loss_scale
        if isinstance(loss_scale, loss_scale_lib.DynamicLossScale):
            return loss_scale.min_loss_scale < 1
        if isinstance(loss_scale, loss_scale_lib.FixedLossScale):
            return loss_scale.loss_scale_value < 1
        return True

    def _update_dynamic_scale(self, grads, trainable_variables):
        """Checks `grads`, steps the scale, records attribution; returns the decision."""
        self._check_variables_are_known(trainable_variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        # Per gradient: how many replicas saw NaN/Inf (the same on all replicas).
        counts = _distribute.agreed_nonfinite_counts(
            gradient_values([grads[i] for i in present])
        )
        is_finite = tf.equal(tf.reduce_sum(counts), 0.0)
        scale_before = self.loss_scale()
        self.loss_scale.update_from_decision(is_finite)

        positions = [self._get_variable_index(trainable_variables[i]) for i in present]
        num_variables = len(self._trainable_variables)
        if positions == list(range(num_variables)):
            mask = counts > 0
        else:
            indices = tf.constant(positions, tf.int32, shape=[len(positions), 1])
            mask = tf.scatter_nd(indices, counts, [num_variables]) > 0
        step = tf.cast(self.iterations, tf.int64)
        stuck = tf.logical_and(
            tf.logical_not(is_finite), scale_before <= self.loss_scale.min_loss_scale
        )
        if self.overflow_attribution:
            self._overflow_mask.assign(tf.where(is_finite, self._overflow_mask, mask))
            self._last_overflow_step.assign(tf.where(is_finite, self._last_overflow_step, step))
        self._stuck_overflows.assign_add(tf.cast(stuck, tf.int64))
        stuck_report = None
        if self._min_scale_policy.policy != "ignore":
            stuck_report = (stuck, step, mask)
        return is_finite, stuck_report

    def _report_if_stuck(self, stuck, step, mask):
        """Applies `min_scale_policy` in-step, through the host, iff `stuck`."""

        def report():
            tf.py_function(
                self._report_stuck,
                [step, mask, tf.convert_to_tensor(self._stuck_overflows)],
                [],
            )
            return tf.constant(True)

        tf.cond(stuck, report, lambda: tf.constant(False))

    def _report_stuck(self, step, mask, stuck_overflows):
        # The device count, not a host tally: every replica runs this report
        # for the same overflow.
        self._stuck_overflows_seen = max(self._stuck_overflows_seen, int(stuck_overflows))
        names = overflow.names_from_mask(mask.numpy(), self._variable_names)
        self._min_scale_policy(int(step), names, self.loss_scale.min_loss_scale)

    # -- diagnostics ----------------------------------------------------------------

    def last_overflow(self):
        """Describes the last skipped step, or returns None if there was none.

        Reads a few device values (a host sync): call it between steps, not
        inside one.

        Returns:
            A `tfdls.OverflowReport` with the step, the names of the
            variables whose gradients were non-finite, the loss scale and the
            skipped-step count; None before the first overflow or when
            `overflow_attribution=False`.

        Example:

        >>> model.fit(x, y)
        >>> report = model.optimizer.last_overflow()
        >>> if report: print(report)
        step 12: non-finite gradients for dense/kernel; loss scale now 16384, ...
        """
        if not self.built or not self.overflow_attribution:
            return None
        step = int(self._last_overflow_step.numpy())
        if step < 0:
            return None
        return overflow.OverflowReport(
            step=step,
            variable_names=overflow.names_from_mask(
                self._overflow_mask.numpy(), self._variable_names
            ),
            loss_scale=float(self.loss_scale().numpy()),
            num_skipped_steps=int(self.loss_scale.num_skipped_steps.numpy()),
        )

    def check_min_scale_policy(self):
        """Applies `min_scale_policy` to overflows-at-minimum not yet reported.

        Needed only where the step could not call the host (XLA); harmless
        elsewhere. `tfdls.LossScaleMonitor` calls it at its logging frequency.
        """
        if not self.built or not isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale):
            return
        stuck = int(self._stuck_overflows.numpy())
        if stuck > self._stuck_overflows_seen:
            self._stuck_overflows_seen = stuck
            names = overflow.names_from_mask(self._overflow_mask.numpy(), self._variable_names)
            step = int(self._last_overflow_step.numpy())
            self._min_scale_policy(step, names, self.loss_scale.min_loss_scale)

    # -- saving -------------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": loss_scale_lib.serialize(self.loss_scale),
            "overflow_attribution": self.overflow_attribution,
            "min_scale_policy": self._min_scale_policy.policy,
            "jit_compile": self.jit_compile,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
