"""Everything tfdls does differently under `tf.distribute`, in one place.

Three things need care when several replicas train together:

* state (the loss scale, counters, diagnostics) is one value that every
  replica updates identically: `state_variable`;
* "are all gradients finite?" must get the same answer on every replica, or
  their weights drift apart: `sum_over_replicas` all-reduces the per-gradient
  counts (tf.distribute reduces only SUM/MEAN of numbers, hence counts rather
  than booleans);
* "apply the inner optimizer or not?", where it is a `tf.cond`: a cond in
  replica context may not contain a `merge_call`, and Keras' optimizers call
  one under strategies that need it (MirroredStrategy and
  MultiWorkerMirroredStrategy, except MirroredStrategy on GPUs inside XLA), so
  there the branch is taken in cross-replica context: `apply_if`.

And one thing tfdls does only under a strategy, on request
(``all_reduce_dtype="float16"``, the last section): all-reduce the scaled
gradients in float16 itself, and keep Keras from all-reducing the sums again.

The rule: under a strategy with several replicas, `apply` casts each float32
scaled gradient to float16 (float16, bfloat16 and float64 gradients keep
their dtype), sums the gradients over the replicas in one all-reduce, casts
the sums back, and then divides and checks the *sums*. A sum that overflows
float16 is an Inf the check reads, so the step is skipped and the scale
lowered on every replica alike. Nothing is pre-divided by the number of
replicas: the dynamic scale already keeps the sum in range (an overflow
costs one halving, one bit), while a pre-division would push the smallest
values into float16's subnormals and, for a replica count that is not a
power of two, round every element once more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

import tensorflow as tf

from tfdls import _compat, _division


def replicas_in_sync():
    """Number of replicas of the current strategy (1 without one)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def has_strategy():
    """True under a strategy with more than one replica in sync."""
    return tf.distribute.has_strategy() and replicas_in_sync() > 1


def under_any_strategy():
    """True under any `tf.distribute` strategy, one replica included (a one-device
    `MirroredStrategy` synchronizes through `merge_call` all the same)."""
    return tf.distribute.has_strategy()


def needs_merge_call():
    """True where Keras' optimizers synchronize replicas through `merge_call`: under a
    strategy that does not run updates without it, with one replica too (Keras calls
    `merge_call` under a one-GPU `MirroredStrategy` as well, and TensorFlow refuses one
    inside a nested function or a branch)."""
    return tf.distribute.has_strategy() and not _compat.strategy_supports_no_merge_call()


def in_cross_replica_context():
    return has_strategy() and tf.distribute.in_cross_replica_context()


def state_variable(name, initial_value, dtype):
    """A non-trainable variable that every replica updates to the same value.

    ONLY_FIRST_REPLICA: every replica computes the same new value (decisions
    are all-reduced first), so any copy may be written, and the variable may
    be assigned in replica context. Created in `tf.init_scope`, so that a
    first call inside a `tf.function` (or `strategy.run`) lifts it out.
    """
    with tf.init_scope():
        return tf.Variable(
            initial_value,
            name=name,
            dtype=dtype,
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )


@contextlib.contextmanager
def built_before_the_trace(variables):
    """Where the optimizer of `variables` makes its variables: now, as eager variables,
    when its first `apply` is traced in a `tf.function` and no strategy is set.

    A `tf.function` whose first trace makes variables traces its Python a second
    time and runs that trace, without the `build`: what `build` wrote is lost
    (Keras' `ScheduleFreeAdamW` starts its momentum at the weights), and Keras' `fit`
    builds the optimizer inside its first trace when no strategy is set, so every
    first `fit` traced `train_step` twice. Made in `tf.init_scope` with
    `experimental_enable_variable_lifting=False` (a `tf.Variable` argument), the
    variables are the eager variables a lifted one would be, made and written before
    the trace goes on, and the function traces once.

    Left as it was: under a strategy (its own variable creator makes them, mirrored,
    where it was entered, and Keras builds before the trace there), and where some of
    `variables` were made in the same trace and hold no value yet (the function is
    traced twice for them anyway, and a `build` that reads them could not).
    """
    if under_any_strategy() or not tf.inside_function() or not _all_initialized(variables):
        yield
        return

    def made_now(next_creator, **kwargs):
        kwargs["experimental_enable_variable_lifting"] = False
        return next_creator(**kwargs)

    with tf.init_scope(), tf.variable_creator_scope(made_now):
        yield


def _all_initialized(variables):
    """Whether every one of `variables` holds a value: read once, eagerly, when the
    optimizer is built (not in a step)."""
    with tf.init_scope():
        for variable in variables:
            held = _compat.underlying_variable(variable)  # a Keras variable's tf.Variable
            handle = getattr(variable if held is None else held, "handle", None)
            if handle is not None and not tf.raw_ops.VarIsInitializedOp(resource=handle):
                return False
    return True


def sum_over_replicas(value):
    """All-reduces `value` (SUM) over the replicas; identity without a strategy.

    Must be called in replica context.
    """
    if not has_strategy():
        return value
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "tfdls: this must be called in a replica context (inside strategy.run "
            "or model.fit), not in cross-replica context."
        )
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def max_over_replicas(value):
    """All-reduces `value` (MAX) over the replicas; identity without a strategy."""
    if not has_strategy():
        return value
    # tf.distribute reduces only SUM and MEAN: gather, then take the maximum.
    gathered = tf.distribute.get_replica_context().all_gather(value[tf.newaxis], axis=0)
    return tf.reduce_max(gathered, axis=0)


def sum_of_per_replica(fn, per_replica_args):
    """In cross-replica context: `fn` on each replica's values, summed (a scalar)."""
    strategy = tf.distribute.get_strategy()
    per_replica = strategy.extended.call_for_each_replica(fn, args=(per_replica_args,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def _check_replica_context():
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "LossScaleOptimizer.apply() must be called in a replica context "
            "(inside strategy.run or model.fit), not in cross-replica context."
        )


def apply_if(should_apply, apply_fn, args=()):
    """Runs `apply_fn(*args)` iff the scalar bool `should_apply` is true (a `tf.cond`).

    `should_apply` must already be the same on every replica. Must be called
    in replica context.
    """

    def conditional(pred, *fn_args):
        def apply_branch():
            apply_fn(*fn_args)
            return tf.constant(True)

        return tf.cond(pred, apply_branch, lambda: tf.constant(False))

    if not needs_merge_call():
        if has_strategy():
            _check_replica_context()
        conditional(should_apply, *args)
        return
    _check_replica_context()

    def cross_replica_conditional(strategy, pred, *per_replica_args):
        # Every replica holds the same decision; take the first one.
        decision = strategy.experimental_local_results(pred)[0]

        def apply_branch():
            strategy.extended.call_for_each_replica(apply_fn, args=per_replica_args)
            return tf.constant(True)

        tf.cond(decision, apply_branch, lambda: tf.constant(False))

    # merge_call turns a tensor that is the same object on every replica (a
    # gradient passed in unchanged) into one plain value, which the inner
    # optimizer's all-reduce then rejects; an identity per replica keeps it
    # per-replica.
    args = tf.nest.map_structure(
        lambda x: tf.identity(x) if isinstance(x, tf.Tensor) else x, tuple(args)
    )
    tf.distribute.get_replica_context().merge_call(
        cross_replica_conditional, args=(should_apply,) + args
    )


# -- all_reduce_dtype="float16" -------------------------------------------------------

FLOAT16 = "float16"
# The strategies whose replica context all-reduces as this path needs (one
# collective, the same sums on every replica).
_SUPPORTED_STRATEGIES = ("MirroredStrategy", "MultiWorkerMirroredStrategy",
                         "CollectiveAllReduceStrategy")
# Collective ops that sum values between replicas (CPU and GPU).
ALL_REDUCE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                  "NcclAllReduce", "NcclReduce", "CollectiveAllToAllV2")
GATHER_OPS = ("CollectiveGather", "CollectiveGatherV2")


def all_reduce_dtype_from(all_reduce_dtype):
    """The validated setting: None (Keras' own all-reduce) or ``"float16"``."""
    if all_reduce_dtype is None:
        return None
    if isinstance(all_reduce_dtype, str):
        name = all_reduce_dtype
    else:
        try:  # a dtype: tf.float16, np.float16, np.dtype("float16")
            name = tf.as_dtype(all_reduce_dtype).name
        except TypeError:  # not a dtype (a DTypePolicy, a number)
            name = None
    if name == FLOAT16:
        return FLOAT16
    raise ValueError(
        "`all_reduce_dtype` must be None (the default: Keras all-reduces each gradient in "
        "its own dtype, unscaled) or 'float16' (the scaled gradients, in half the bytes); "
        f"got all_reduce_dtype={all_reduce_dtype!r}"
    )


def check_all_reduce_loss_scale(all_reduce_dtype, loss_scale):
    """Raises for ``"float16"`` with a loss scale that never skips a step."""
    if all_reduce_dtype is not None and not loss_scale.can_skip:
        raise ValueError(
            "all_reduce_dtype='float16' needs a loss scale that can skip a step: a sum "
            "of float16 gradients may overflow, and only a skipped step keeps the Inf "
            f"out of the weights; got loss_scale={loss_scale!r}, which never skips. Use a "
            "dynamic loss scale, or all_reduce_dtype=None."
        )


def refuse_unscaling_with_boundaries(all_reduce_dtype):
    """`get_unscaled_gradients` with scale boundaries cannot feed the float16 all-reduce."""
    if all_reduce_dtype is not None and has_strategy():
        raise ValueError(
            "get_unscaled_gradients with both scale_boundaries and "
            "all_reduce_dtype='float16' under a multi-replica strategy: apply() "
            "must all-reduce the scaled gradients, and cannot scale gradients "
            "divided by their boundaries' factors back. Pass the scaled gradients "
            "to apply() (Keras 3 style), or use all_reduce_dtype=None."
        )


def check_all_reduce_strategy():
    """Raises for a multi-replica strategy this path has not been built for."""
    strategy = tf.distribute.get_strategy()
    kinds = {cls.__name__ for cls in type(strategy).__mro__}
    if not kinds & set(_SUPPORTED_STRATEGIES):
        raise ValueError(
            "LossScaleOptimizer(all_reduce_dtype='float16') all-reduces under "
            "MirroredStrategy and MultiWorkerMirroredStrategy; got "
            f"{type(strategy).__name__} with {replicas_in_sync()} replicas. "
            "Use all_reduce_dtype=None under this strategy."
        )


def wire_dtype(dtype):
    """The dtype a gradient of `dtype` crosses the network in."""
    return tf.float16 if dtype == tf.float32 else dtype


def _cast(grad, dtype):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def sum_scaled_in_float16(grads):
    """Sums the scaled gradients `grads` over the replicas, in float16 on the wire.

    One `all_reduce` call per dtype on the wire (tf.distribute packs each
    call into one collective; `tf.IndexedSlices` are gathered, as Keras' own
    all-reduce does). Each sum comes back in its gradient's dtype, so that the
    division by the scale that follows is exact. Must be called in replica
    context.
    """
    _check_replica_context()
    grads = [g if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g) for g in grads]
    dtypes = [g.dtype for g in grads]
    wire = [_cast(g, wire_dtype(d)) for g, d in zip(grads, dtypes)]
    # tf.distribute packs one call's tensors into one buffer, which needs one dtype:
    # one call per wire dtype (one in all for mixed_float16 and float16 models).
    by_dtype = {}
    for k, w in enumerate(wire):
        by_dtype.setdefault(w.dtype, []).append(k)
    summed = [None] * len(wire)
    context = tf.distribute.get_replica_context()
    for positions in by_dtype.values():
        sums = context.all_reduce(tf.distribute.ReduceOp.SUM, [wire[k] for k in positions])
        for k, s in zip(positions, sums):
            summed[k] = s
    return [_cast(s, d) for s, d in zip(summed, dtypes)]


def rescaled(grad, scale, already_unscaled):
    """`grad` multiplied back by `scale` where `get_unscaled_gradients` divided it (exact
    for a power-of-two scale): only scaled values fit float16."""
    factor = tf.where(already_unscaled, scale, tf.ones_like(scale))
    return _division.multiply(grad, factor)


# -- the hook into Keras --------------------------------------------------------------

_lock = threading.Lock()
_active = collections.Counter()  # id(optimizer) -> applies in progress on this path


def _passing_through(optimizer):
    original = _compat.keras_gradient_all_reduce(optimizer)

    def all_reduce_sum_gradients(grads_and_vars):
        # Inside a float16-path apply the gradients are sums already.
        if _active[id(optimizer)]:
            return list(grads_and_vars)
        return original(grads_and_vars)

    all_reduce_sum_gradients.tfdls_passthrough = True
    return all_reduce_sum_gradients


@contextlib.contextmanager
def keras_all_reduce_skipped(inner_optimizer, skip=True):
    """While active, `inner_optimizer` (each sub-optimizer of a MultiOptimizer) applies
    the gradients it is given without all-reducing them.

    The inner update may run in other threads (MirroredStrategy runs each
    replica in its own), so the hook is installed once per optimizer and
    counts the applies in progress rather than being swapped in and out.
    """
    if not skip:
        yield
        return
    optimizers = getattr(inner_optimizer, "optimizers", None) or [inner_optimizer]
    with _lock:
        for optimizer in optimizers:
            if not getattr(_compat.keras_gradient_all_reduce(optimizer),
                           "tfdls_passthrough", False):
                _compat.set_keras_gradient_all_reduce(optimizer, _passing_through(optimizer))
            _active[id(optimizer)] += 1
    try:
        yield
    finally:
        with _lock:
            for optimizer in optimizers:
                _active[id(optimizer)] -= 1
                if not _active[id(optimizer)]:
                    del _active[id(optimizer)]


# -- reading a traced step ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a traced step: its type, dtype and element count (None
    where the shape is not static)."""

    type: str
    dtype: str
    elements: int | None
    device: str

    @property
    def bytes(self):
        return None if self.elements is None else self.elements * tf.as_dtype(self.dtype).size


def collective_traffic(graph):
    """The collective ops (sums and gathers) of `graph` and every function it calls.

    MirroredStrategy traces one op per replica; `device` tells them apart.
    """
    found = []
    for g in _compat.graph_and_function_graphs(graph):
        for op in g.get_operations():
            if op.type not in ALL_REDUCE_OPS + GATHER_OPS:
                continue
            value = op.inputs[0]
            shape = value.shape
            elements = shape.num_elements() if shape.is_fully_defined() else None
            found.append(Collective(op.type, value.dtype.name, elements, op.device))
    return found
