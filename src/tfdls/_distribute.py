"""Everything tfdls does differently under `tf.distribute`, in one place.

Two questions need an answer that every replica shares:

* "are all gradients finite?" - one replica's overflow must make every
  replica skip, or the replicas' weights drift apart;
* "apply the inner optimizer or not?" - a `tf.cond` in replica context may not
  contain a `merge_call`, and Keras' optimizers `merge_call` under strategies
  that need one (MirroredStrategy on CPU), so the branch is taken in
  cross-replica context there.
"""

import tensorflow as tf

from tfdls.finite import finite_flags, gradient_values


def _has_strategy():
    """True under a strategy with more than one replica in sync."""
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


def _local_nonfinite(values):
    """1.0 per gradient that holds NaN/Inf on this replica, else 0.0."""
    return tf.cast(tf.logical_not(finite_flags(values)), tf.float32)


def agreed_nonfinite_counts(values):
    """Per gradient, how many replicas saw a non-finite value (float vector).

    `values` is a list of dense gradient tensors. Without a multi-replica
    strategy this is 0.0/1.0 per gradient; in replica context it is
    all-reduced (tf.distribute reduces only SUM/MEAN and no booleans, hence
    the float count), so every replica (and worker) gets the same vector and
    one replica's overflow is seen by all.
    """
    local = _local_nonfinite(values)
    if not _has_strategy():
        return local
    if tf.distribute.in_cross_replica_context():
        raise ValueError("agreed_nonfinite_counts() needs a replica context")
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)


def agreed_all_finite(grads):
    """`all_finite(grads)`, agreed on by every replica.

    Works in replica context (see `agreed_nonfinite_counts`) and in
    cross-replica context, where `grads` may hold per-replica values: each
    replica's answer is computed and the answers are reduced.
    """
    if _has_strategy() and tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        # Each replica counts locally; the one reduction below combines them.
        per_replica = strategy.extended.call_for_each_replica(
            lambda g: tf.reduce_sum(_local_nonfinite(gradient_values(g))),
            args=(grads,),
        )
        overflowed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return tf.equal(overflowed, 0.0)
    return tf.equal(tf.reduce_sum(agreed_nonfinite_counts(gradient_values(grads))), 0.0)


def apply_if(should_apply, apply_fn, args=()):
    """Runs `apply_fn(*args)` iff the scalar bool `should_apply` is true.

    `should_apply` must already be the same on every replica (see
    `agreed_all_finite`). Must be called in replica context.
    """

    def conditional(pred, *fn_args):
        def apply_branch():
            apply_fn(*fn_args)
            return tf.constant(True)

        return tf.cond(pred, apply_branch, lambda: tf.constant(False))

    if not _has_strategy():
        conditional(should_apply, *args)
        return
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "LossScaleOptimizer.apply() must be called in a replica context "
            "(inside strategy.run or model.fit), not in cross-replica context."
        )
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
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
