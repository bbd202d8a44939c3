"""TF 2.4 code in TF1-style graph mode: `tf.compat.v1` graphs and sessions.

TF 2.4's users built a graph once, initialized its variables and ran
`session.run(update_op)` step after step, often through
`tf.identity(update_op)` under control dependencies. Each test here runs
that program twice, once with the seed class
`tf.compat.v1.mixed_precision.DynamicLossScale` (or `FixedLossScale`) and
once with tfdls', and compares everything each step returns: the value of
`update_op`, `should_apply_gradients`, the scale bit for bit and the
good-step counter. It also checks what `update` returns in each mode.
"""

import numpy as np
import pytest
import tensorflow as tf

from tensorflow.core.protobuf import rewriter_config_pb2

import tfdls
from tests.support.fast_loop import slow_except

SEED_DYNAMIC = tf.compat.v1.mixed_precision.DynamicLossScale
SEED_FIXED = tf.compat.v1.mixed_precision.FixedLossScale

# (initial_loss_scale, increment_period, multiplier)
CASES = [
    (1.0, 2, 2.0),
    (2.0**15, 1, 2.0),
    (np.finfo(np.float32).max / 4, 2, 2.0),  # growth caps, then stays
    (16.0, 3, 2.0),  # falls to the floor of 1
    (4.0, 2, 3.0),
    (1000.0, 1, 1.5),
]
CASE_IDS = [f"s{c[0]:g}-p{c[1]}-m{c[2]:g}" for c in CASES]
STEPS = 40


def _decisions(seed):
    """Which steps have finite gradients: runs of each, random, STEPS long."""
    rng = np.random.default_rng(seed)
    return [bool(x) for x in rng.random(STEPS) < (0.5, 0.85)[seed % 2]]


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32).item()


# The seed divides the scale by the multiplier with a float32 division, which
# Grappler's constant folding turns into a multiplication by 1 / multiplier in
# a session (not in eager mode): for a multiplier that is not a power of two
# the seed's own scale is then 1 ulp off its eager value. tfdls gives the
# correctly rounded quotient in every mode, so the seed runs without that pass.
_SEED_SESSION_CONFIG = tf.compat.v1.ConfigProto(
    graph_options=tf.compat.v1.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(
            constant_folding=rewriter_config_pb2.RewriterConfig.OFF
        )
    )
)


def _graph_trajectory(make_loss_scale, finite_steps, good_steps, strategy=None, config=None):
    """Runs TF 2.4-style graph code; one (update value, apply, scale bits, good) per step."""
    out = []
    with tf.Graph().as_default():
        finite = tf.compat.v1.placeholder(tf.bool, shape=[])
        scope = strategy.scope() if strategy is not None else _nothing()
        with scope:
            ls = make_loss_scale()
            grad = tf.where(finite, tf.constant([1.0, -2.0]), tf.constant([1.0, np.nan]))
            if strategy is not None:
                # Only the first replica overflows: the decision is still shared.
                def per_replica():
                    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                    return tf.where(tf.equal(replica, 0), grad, tf.ones([2]))

                grad = strategy.extended.call_for_each_replica(per_replica)
            update_op, should_apply = ls.update([grad])
            check = tf.debugging.assert_equal(should_apply, finite)
            with tf.control_dependencies([check]):
                step = tf.identity(update_op)
            scale = ls()
            good = good_steps(ls)
        with tf.compat.v1.Session(config=config) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for is_finite in finite_steps:
                value, applied = session.run([step, should_apply], {finite: is_finite})
                out.append((bool(value), bool(applied), _bits(session.run(scale)),
                            int(session.run(good))))
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _seed_dynamic(case):
    initial, period, multiplier = case
    return lambda: SEED_DYNAMIC(initial_loss_scale=initial, increment_period=period,
                                multiplier=multiplier)


def _tfdls_dynamic(case):
    initial, period, multiplier = case
    return lambda: tfdls.DynamicLossScale(initial_loss_scale=initial,
                                          increment_period=period, multiplier=multiplier)


def _seed_good(ls):
    return tf.convert_to_tensor(ls._num_good_steps)


def _tfdls_good(ls):
    return tf.convert_to_tensor(ls.num_good_steps)


@pytest.mark.parametrize("case", slow_except([(c,) for c in CASES], [(CASES[2],)], CASE_IDS))
def test_session_trajectories_match_the_seed(case):
    for seed in (0, 1):
        steps = _decisions(seed)
        expected = _graph_trajectory(_seed_dynamic(case), steps, _seed_good,
                                     config=_SEED_SESSION_CONFIG)
        got = _graph_trajectory(_tfdls_dynamic(case), steps, _tfdls_good)
        for i, (want, have) in enumerate(zip(expected, got)):
            assert have == want, (
                f"seed={seed} step={i} finite={steps[i]}: (update_op, should_apply, "
                f"scale bits, good steps) {have} != seed {want}"
            )
        assert len(got) == STEPS


@pytest.mark.slow
def test_the_sequences_grow_shrink_and_hold():
    """Guards the differential test: its steps reach every branch of the seed."""
    seen = set()
    for case in CASES:
        for seed in (0, 1):
            trajectory = _graph_trajectory(_seed_dynamic(case), _decisions(seed), _seed_good,
                                           config=_SEED_SESSION_CONFIG)
            previous = _bits(case[0])
            for grew_flag, applied, scale, _ in trajectory:
                if grew_flag and scale == previous:
                    seen.add("capped")
                elif grew_flag:
                    seen.add("grew")
                elif not applied and scale == previous:
                    seen.add("floor")
                elif not applied:
                    seen.add("shrank")
                else:
                    seen.add("counted")
                previous = scale
    assert seen == {"capped", "grew", "floor", "shrank", "counted"}


def test_session_trajectory_under_a_strategy_matches_the_seed(mirrored_strategy):
    case = CASES[0]
    steps = _decisions(0)[:12]
    # A session makes its own devices: as many CPUs as the strategy's replicas.
    seed_config = tf.compat.v1.ConfigProto()
    seed_config.CopyFrom(_SEED_SESSION_CONFIG)
    seed_config.device_count["CPU"] = 2
    expected = _graph_trajectory(_seed_dynamic(case), steps, _seed_good, mirrored_strategy,
                                 seed_config)
    got = _graph_trajectory(_tfdls_dynamic(case), steps, _tfdls_good, mirrored_strategy,
                            tf.compat.v1.ConfigProto(device_count={"CPU": 2}))
    assert got == expected
    assert {applied for _, applied, _, _ in got} == {True, False}


def test_update_op_in_a_graph_is_a_scalar_bool_tensor_like_the_seeds():
    with tf.Graph().as_default():
        seed_op, _ = SEED_DYNAMIC().update([tf.constant(1.0)])
        ours, _ = tfdls.DynamicLossScale().update([tf.constant(1.0)])
        assert isinstance(seed_op, tf.Tensor)  # what tfdls copies
        assert isinstance(ours, tf.Tensor)
        assert (ours.dtype, ours.shape.rank) == (seed_op.dtype, seed_op.shape.rank)


def test_update_op_in_a_tf_function_matches_the_seeds_value():
    def run(make):
        ls = make()
        step = tf.function(lambda g: tf.identity(ls.update([g])[0]))
        return [bool(step(tf.constant(g)).numpy()) for g in (1.0, 1.0, np.inf, 1.0, 1.0)]

    case = (8.0, 2, 2.0)
    assert run(_tfdls_dynamic(case)) == run(_seed_dynamic(case)) == [
        False, True, False, False, True]


def test_update_op_eagerly_is_none():
    # The seed documents None; on a finite step that does not grow it actually
    # returns the good-step counter's assign result, which no caller can use.
    ls = tfdls.DynamicLossScale(8.0, increment_period=2)
    for g in (1.0, 1.0, np.nan):
        update_op, _ = ls.update([tf.constant(g)])
        assert update_op is None


def test_fixed_loss_scale_returns_what_the_seed_returns():
    # Eagerly: (None, True), as tf.no_op() is None there.
    for make in (lambda: SEED_FIXED(4.0), lambda: tfdls.FixedLossScale(4.0)):
        assert make().update([tf.constant(np.nan)]) == (None, True)
    # In a graph: a NoOp Operation that session.run accepts, and the bool True.
    results = []
    for make in (lambda: SEED_FIXED(4.0), lambda: tfdls.FixedLossScale(4.0)):
        with tf.Graph().as_default():
            ls = make()
            update_op, should_apply = ls.update([tf.constant(np.nan)])
            scale = ls()
            with tf.compat.v1.Session() as session:
                # tfdls keeps the value in a variable: initialize it first.
                session.run(tf.compat.v1.global_variables_initializer())
                results.append((type(update_op), update_op.type, should_apply,
                                session.run(update_op), session.run(scale)))
    assert results[0] == results[1] == (tf.Operation, "NoOp", True, None, 4.0)
