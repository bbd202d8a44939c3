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
"""

import tensorflow as tf

from tfdls import _compat


def replicas_in_sync():
    """Number of replicas of the current strategy (1 without one)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def has_strategy():
    """True under a strategy with more than one replica in sync."""
    return tf.distribute.has_strategy() and replicas_in_sync() > 1


def needs_merge_call():
    """True where Keras' optimizers synchronize replicas through `merge_call`."""
    return has_strategy() and not _compat.strategy_supports_no_merge_call()


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

    if not has_strategy():
        conditional(should_apply, *args)
        return
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "LossScaleOptimizer.apply() must be called in a replica context "
            "(inside strategy.run or model.fit), not in cross-replica context."
        )
    if not needs_merge_call():
        conditional(should_apply, *args)
        return

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
