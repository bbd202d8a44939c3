"""DynamicLossScale under MirroredStrategy over two logical CPUs.

One replica's overflow must make every replica skip and shrink the scale, and
every replica copy of the state must stay identical.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdls


def _local(strategy, value):
    return [np.asarray(v.numpy()) for v in strategy.experimental_local_results(value)]


def _copies(strategy, variable):
    """Every replica's copy of a (mirrored) variable."""
    values = _local(strategy, variable)
    assert len(values) == strategy.num_replicas_in_sync == 2
    return values


def _replica_step(strategy, ls, nan_on_replica):
    """A tf.function running ls.update in replica context via strategy.run."""

    def replica_fn(g):
        replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
        poisoned = tf.tensor_scatter_nd_update(g, [[1]], [np.nan])
        bad = tf.equal(replica_id, nan_on_replica) if nan_on_replica is not None else False
        grads = [tf.where(bad, poisoned, g), tf.ones([2, 2])]
        _, should_apply = ls.update(grads)
        return should_apply, tfdls.all_finite(grads)  # agreed, and this replica's own

    @tf.function
    def step(g):
        return strategy.run(replica_fn, args=(g,))

    def checked_step(g):
        should_apply, locally_finite = step(g)
        local = [bool(v) for v in _local(strategy, locally_finite)]
        # The NaN really was planted on exactly the chosen replica.
        assert local == [i != nan_on_replica for i in range(2)], local
        return should_apply

    return checked_step


@pytest.fixture
def make_ls(mirrored_strategy):
    def make(**kwargs):
        with mirrored_strategy.scope():
            return tfdls.DynamicLossScale(**kwargs)

    return make


def test_state_variables_are_mirrored(mirrored_strategy, make_ls):
    ls = make_ls(initial_loss_scale=64.0, increment_period=2)
    for variable in (
        ls.current_loss_scale,
        ls.num_good_steps,
        ls.hysteresis_budget,
        ls.num_skipped_steps_variable,
        ls.steps_since_overflow_variable,
    ):
        copies = _copies(mirrored_strategy, variable)
        assert copies[0] == copies[1]


@pytest.mark.parametrize("nan_on_replica", [0, 1])
def test_one_replica_nan_skips_on_every_replica(mirrored_strategy, make_ls, nan_on_replica):
    ls = make_ls(initial_loss_scale=64.0, increment_period=2)
    step = _replica_step(mirrored_strategy, ls, nan_on_replica)
    should_apply = _local(mirrored_strategy, step(tf.constant([1.0, 2.0, 3.0])))
    assert [bool(v) for v in should_apply] == [False, False]
    scales = _copies(mirrored_strategy, ls.current_loss_scale)
    assert [float(s) for s in scales] == [32.0, 32.0]
    for variable in (ls.num_good_steps, ls.hysteresis_budget, ls.num_skipped_steps_variable):
        copies = _copies(mirrored_strategy, variable)
        assert copies[0] == copies[1]
    assert [int(v) for v in _copies(mirrored_strategy, ls.num_skipped_steps_variable)] == [1, 1]
    # Reading the scale in replica context gives the same value everywhere.
    per_replica = mirrored_strategy.run(tf.function(lambda: ls()))
    assert [float(v) for v in _local(mirrored_strategy, per_replica)] == [32.0, 32.0]


def test_all_finite_applies_on_every_replica(mirrored_strategy, make_ls):
    ls = make_ls(initial_loss_scale=64.0, increment_period=5)
    step = _replica_step(mirrored_strategy, ls, None)
    should_apply = _local(mirrored_strategy, step(tf.constant([1.0, 2.0, 3.0])))
    assert [bool(v) for v in should_apply] == [True, True]
    assert [float(s) for s in _copies(mirrored_strategy, ls.current_loss_scale)] == [64.0, 64.0]
    assert [int(g) for g in _copies(mirrored_strategy, ls.num_good_steps)] == [1, 1]


def test_growth_across_steps_keeps_replicas_identical(mirrored_strategy, make_ls):
    ls = make_ls(initial_loss_scale=8.0, increment_period=2, multiplier=3.0, hysteresis=2)
    finite = _replica_step(mirrored_strategy, ls, None)
    poisoned = _replica_step(mirrored_strategy, ls, 1)
    g = tf.constant([1.0, 2.0, 3.0])
    history = []
    for fn in (finite, finite, finite, finite, poisoned, poisoned, finite):
        applied = [bool(v) for v in _local(mirrored_strategy, fn(g))]
        assert applied[0] == applied[1]
        scales = _copies(mirrored_strategy, ls.current_loss_scale)
        goods = _copies(mirrored_strategy, ls.num_good_steps)
        budgets = _copies(mirrored_strategy, ls.hysteresis_budget)
        assert scales[0].tobytes() == scales[1].tobytes()
        assert goods[0] == goods[1] and budgets[0] == budgets[1]
        history.append((applied[0], float(scales[0])))
    s = np.float32(8.0)
    grown = float(s * np.float32(3.0))
    grown2 = float(np.float32(grown) * np.float32(3.0))
    assert history == [
        (True, 8.0),
        (True, grown),
        (True, grown),
        (True, grown2),
        (False, grown2),  # hysteresis 2: the first overflow is tolerated
        (False, float(np.float32(grown2) / np.float32(3.0))),
        (True, float(np.float32(grown2) / np.float32(3.0))),
    ]


def _per_replica_grads(strategy, nan_on_replica):
    def value_fn(ctx):
        g = np.array([1.0, 2.0, 3.0], np.float32)
        if ctx.replica_id_in_sync_group == nan_on_replica:
            g[2] = np.nan
        return tf.constant(g)

    return strategy.experimental_distribute_values_from_function(value_fn)


@pytest.mark.parametrize("nan_on_replica", [0, 1, None])
def test_cross_replica_update_with_per_replica_grads(
    mirrored_strategy, make_ls, nan_on_replica
):
    ls = make_ls(initial_loss_scale=64.0, increment_period=1)
    grads = _per_replica_grads(mirrored_strategy, nan_on_replica)
    # The planted NaN sits on exactly one replica.
    finite_per_replica = [bool(np.all(np.isfinite(v))) for v in _local(mirrored_strategy, grads)]
    assert finite_per_replica.count(False) == (0 if nan_on_replica is None else 1)
    with mirrored_strategy.scope():
        assert tf.distribute.in_cross_replica_context()
        _, should_apply = ls.update([grads, None])
    should = [bool(v) for v in _local(mirrored_strategy, should_apply)]
    expected_scale = 128.0 if nan_on_replica is None else 32.0
    assert all(v == (nan_on_replica is None) for v in should), should
    assert [float(s) for s in _copies(mirrored_strategy, ls.current_loss_scale)] == [
        expected_scale,
        expected_scale,
    ]


def test_cross_replica_update_in_tf_function(mirrored_strategy, make_ls):
    ls = make_ls(initial_loss_scale=64.0, increment_period=1)

    @tf.function
    def update(grads):
        return ls.update([grads])[1]

    with mirrored_strategy.scope():
        ok = update(_per_replica_grads(mirrored_strategy, 1))
        assert not any(bool(v) for v in _local(mirrored_strategy, ok))
        ok = update(_per_replica_grads(mirrored_strategy, None))
        assert all(bool(v) for v in _local(mirrored_strategy, ok))
    assert [float(s) for s in _copies(mirrored_strategy, ls.current_loss_scale)] == [64.0, 64.0]
