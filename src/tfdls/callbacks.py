"""`LossScaleMonitor`: the loss scale in `fit` logs, History and TensorBoard."""

from __future__ import annotations

import dataclasses
import math

import keras
import tensorflow as tf

from tfdls import _compat
from tfdls.optimizer import LossScaleOptimizer

# tf.summary.scalar needs the tensorboard package, which tensorflow-cpu does
# not install; writing with the scalars plugin's metadata needs nothing more.
_SCALAR_METADATA = _compat.summary_pb2.SummaryMetadata(
    plugin_data=_compat.summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def _find_loss_scale_optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, LossScaleOptimizer):
        raise ValueError(
            "LossScaleMonitor needs a model compiled with tfdls.LossScaleOptimizer; "
            f"got model.optimizer={optimizer!r}"
        )
    return optimizer


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds the loss scale and skipped-step counts to `fit`'s logs.

    Keys added: ``loss_scale``, ``skipped_steps`` (total so far) and
    ``steps_since_overflow``, so they show in the progress bar, in `History`
    and in any `keras.callbacks.TensorBoard` placed after this callback.
    With `log_dir`, they are also written as TensorBoard scalars (tag
    ``loss_scale/...``), once per point, at step = the number of training
    batches run in this `fit` call: the batch axis of Keras' `TensorBoard`
    callback (skipped steps count; the optimizer's `iterations` do not).

    With an optimizer built with ``gradient_stats=True`` it also adds
    ``min_headroom_bits`` (the smallest headroom below float16's maximum of
    any variable's scaled gradient, in bits) and ``subnormal_fraction`` (the
    largest fraction of subnormal elements of any variable), and with
    `log_dir` writes every variable's figures as scalars (tags
    ``gradient_stats/<variable>/headroom_bits``, ``.../zero_fraction``,
    ``.../subnormal_fraction``).

    With scale boundaries (``LossScaleOptimizer(..., scale_boundaries=model)``)
    it adds ``boundary_factor/<boundary name>``: each `tfdls.ScaleBoundary`'s
    current factor.

    Device values are read only at the logging frequency: every `update_freq`
    batches, and at the end of each epoch. At the same points it applies the
    optimizer's `min_scale_policy` (`check_min_scale_policy()`), so with
    ``update_freq=1`` a stuck scale stops `fit` after the batch it happened in.

    Args:
        log_dir: optional directory for TensorBoard scalars.
        update_freq: ``"epoch"`` (default) or an int: also log every that
            many batches.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
    ...               loss="mse")
    >>> x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    >>> history = model.fit(x, y, epochs=2, verbose=0, callbacks=[tfdls.LossScaleMonitor()])
    >>> history.history["loss_scale"], history.history["skipped_steps"]
    ([32768.0, 32768.0], [0, 0])
    """

    def __init__(self, log_dir: str | None = None, update_freq: int | str = "epoch"):
        super().__init__()
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"`update_freq` must be 'epoch' or an int >= 1; got update_freq={update_freq!r}"
            )
        self.log_dir = log_dir
        self.update_freq = update_freq
        self._writer = None
        self._batches = 0  # training batches run in this fit (Keras TensorBoard's axis)
        self._last_written = None

    def on_train_begin(self, logs=None):
        self._optimizer = _find_loss_scale_optimizer(self.model)
        self._batches = 0
        self._last_written = None
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_train_batch_begin(self, batch, logs=None):
        self._batches += 1

    def _read(self):
        """One host read of the scale state (the only sync this callback makes).

        Returns:
            (values for the logs, per-variable scalars for TensorBoard only)
        """
        optimizer = self._optimizer
        optimizer.check_min_scale_policy()
        loss_scale = optimizer.loss_scale
        values = {"loss_scale": float(loss_scale().numpy())}
        if hasattr(loss_scale, "num_skipped_steps"):
            values["skipped_steps"] = int(loss_scale.num_skipped_steps.numpy())
            values["steps_since_overflow"] = int(loss_scale.steps_since_overflow.numpy())
        for name, factor in optimizer.scale_boundary_factors().items():
            values[f"boundary_factor/{name}"] = factor
        per_variable = {}
        if optimizer.record_gradient_stats:
            stats = optimizer.gradient_stats()
            # The worst variable; NaN until a finite step was recorded.
            values["min_headroom_bits"] = _ignoring_nan(
                min, [s.headroom_bits for s in stats.values()]
            )
            values["subnormal_fraction"] = _ignoring_nan(
                max, [s.subnormal_fraction for s in stats.values()]
            )
            for name, figures in stats.items():
                for key, value in dataclasses.asdict(figures).items():
                    per_variable[f"gradient_stats/{name}/{key}"] = value
        return values, per_variable

    def _log(self, logs):
        values, per_variable = self._read()
        if logs is not None:
            logs.update(values)
        if self._writer is not None and self._last_written != self._batches:
            # An epoch that ends on a logged batch is written once.
            self._last_written = step = self._batches
            scalars = {f"loss_scale/{key}": value for key, value in values.items()}
            scalars.update(per_variable)
            with self._writer.as_default():
                for tag, value in scalars.items():
                    tf.summary.write(
                        tag,
                        tf.constant(value, tf.float32),
                        step=step,
                        metadata=_SCALAR_METADATA,
                    )
            self._writer.flush()
        return values

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq != "epoch" and (batch + 1) % self.update_freq == 0:
            self._log(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._log(logs)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _ignoring_nan(pick, values):
    numbers = [v for v in values if not math.isnan(v)]
    return pick(numbers) if numbers else math.nan
