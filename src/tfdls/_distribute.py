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

from tfdls.finite import all_finite


def _has_strategy():
    """True under a strategy with more than one replica in sync."""
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


def _count_nonfinite(grads):
    # tf.distribute reduces only SUM and MEAN, and no booleans: count the
    # replicas that saw a non-finite gradient instead.
    return tf.cast(tf.logical_not(all_finite(grads)), tf.float32)


def agreed_all_finite(grads):
    """`all_finite(grads)`, agreed on by every replica.

    In replica context the local answer is all-reduced (a count of replicas
    that overflowed, which must be zero), so a single
    non-finite gradient on any replica (or worker) makes the answer `False`
    everywhere. In cross-replica context `grads` may hold per-replica values;
    each replica's answer is computed and the same reduction applied.
    """
    if not _has_strategy():
        return all_finite(grads)
    if tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        per_replica = strategy.extended.call_for_each_replica(
            _count_nonfinite, args=(grads,)
        )
        overflowed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    else:
        context = tf.distribute.get_replica_context()
        overflowed = context.all_reduce(tf.distribute.ReduceOp.SUM, _count_nonfinite(grads))
    return tf.equal(overflowed, 0.0)


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

    tf.distribute.get_replica_context().merge_call(
        cross_replica_conditional, args=(should_apply,) + tuple(args)
    )
