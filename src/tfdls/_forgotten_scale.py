"""A loss nobody scaled: `apply` warns once instead of training with tiny updates.

A custom loop that forgets `scale_loss` (or an optimizer that wraps this one
and scales with a scale of its own, such as Keras' `LossScaleOptimizer`)
hands `apply` gradients that were never multiplied by the loss scale: divided
by it, the updates come out 2**15 times too small, and nothing fails.

The rule, checked in Python when `apply` runs eagerly or is traced (no device
read): `apply` expects a `scale_loss`, `get_scaled_loss` or
`get_unscaled_gradients` call in the same traced function (or one enclosing
it), or an eager one in the same thread since it last updated these
variables. `fit` always
calls `scale_loss` in its train step. Where the loss was multiplied by
`loss_scale()` by hand, silence it with
``warnings.filterwarnings("ignore", category=tfdls.UnscaledLossWarning)``.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import tensorflow as tf

from tfdls import _compat


class UnscaledLossWarning(UserWarning):
    """`apply` received gradients of a loss that this optimizer's `scale_loss` did not scale.

    Warned once per optimizer. See `tfdls._forgotten_scale` for the rule.

    Example:

    >>> opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    >>> w = keras.Variable([1.0], name="w")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     with tf.GradientTape() as tape:
    ...         loss = tf.reduce_sum(w)  # opt.scale_loss(...) forgotten
    ...     opt.apply(tape.gradient(loss, [w]), [w])
    >>> [w.category.__name__ for w in caught]
    ['UnscaledLossWarning']
    """


class ScaledLossWatch:
    """Whether a scaled loss preceded an `apply` (Python state, read at trace time)."""

    def __init__(self):
        # Graphs in which scale_loss (or get_unscaled_gradients) was traced.
        self._graphs = weakref.WeakSet()
        # Eagerly, per thread (an eager strategy.run runs each replica's
        # scale_loss and apply in a thread of its own, interleaved): whether
        # scale_loss ran, and the variables (by id) updated since it last did.
        self._eager = threading.local()
        self._warned = False

    def _eager_state(self):
        if not hasattr(self._eager, "applied_since"):
            self._eager.scaled, self._eager.applied_since = False, set()
        return self._eager

    def scaled(self):
        """`scale_loss`, `get_scaled_loss` or `get_unscaled_gradients` ran."""
        if tf.inside_function():
            self._graphs.add(tf.compat.v1.get_default_graph())
        else:
            eager = self._eager_state()
            eager.scaled = True
            eager.applied_since.clear()

    def check(self, variables):
        """`apply` of `variables`: warns once where no scaled loss preceded it."""
        keys = {id(v) for v in variables}
        eager = self._eager_state()
        eager_ok = eager.scaled and not (keys & eager.applied_since)
        if tf.inside_function():
            ok = eager_ok or self._traced_in_enclosing_graph()
        else:
            ok = eager_ok
            eager.applied_since |= keys
        if ok or self._warned:
            return
        self._warned = True
        warnings.warn(
            "tfdls: apply() received gradients of a loss that this LossScaleOptimizer did "
            "not scale: no scale_loss(), get_scaled_loss() or get_unscaled_gradients() call "
            "preceded it, so dividing by the loss scale makes every update about "
            "loss_scale() times too small. Compute the gradients of opt.scale_loss(loss) "
            "(Keras 3 style) or opt.get_scaled_loss(loss) (tf_keras style); do not wrap this "
            "optimizer in another loss-scale optimizer (keras.optimizers."
            "LossScaleOptimizer). If you multiplied the loss by opt.loss_scale() yourself, "
            "silence this with warnings.filterwarnings('ignore', "
            "category=tfdls.UnscaledLossWarning).",
            UnscaledLossWarning,
            stacklevel=_compat.user_stacklevel(),
        )

    def _traced_in_enclosing_graph(self):
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if graph in self._graphs:
                return True
            graph = getattr(graph, "outer_graph", None)
        return False
