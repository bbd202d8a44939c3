"""Tests for tfdls.FixedLossScale / tfdls.DynamicLossScale (single device).

* differential tests against TensorFlow's own seed implementation,
  `tf.compat.v1.mixed_precision.DynamicLossScale`, bit for bit;
* the extended contract (backoff, min/max, hysteresis, counters) against a
  small plain-Python model computed in np.float32;
* accepted gradient structures, get/serialize/deserialize, argument
  validation, checkpoints and SavedModel.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except
from tests.support.contract_model import ContractModel

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)


# The plain-Python model of the documented contract is ContractModel
# (tests/support/contract_model.py), shared with the property tests.


def _state(ls):
    return (
        F32(ls.current_loss_scale.numpy()),
        int(ls.num_good_steps.numpy()),
        int(ls.hysteresis_budget.numpy()),
        int(ls.num_skipped_steps.numpy()),
        int(ls.steps_since_overflow.numpy()),
    )


def _model_state(model):
    return (model.s, model.g, model.h, model.skipped, model.since)


def _same_f32(a, b):
    """Bit-for-bit float32 equality (also distinguishes nothing else)."""
    return np.asarray(a, np.float32).tobytes() == np.asarray(b, np.float32).tobytes()


def _update_step(ls, run_mode):
    """One traced/compiled step per object: grads in, (should_apply, s, g) out."""

    def step(g0, g1):
        _, should_apply = ls.update([g0, g1])
        return (
            should_apply,
            ls.current_loss_scale.read_value(),
            ls.num_good_steps.read_value(),
        )

    return run_mode(step)


# --------------------------------------------------------------------------
# 1. Differential tests against the TF 2.4 seed implementation.
# --------------------------------------------------------------------------
ORACLE_CASES = [
    # (initial_loss_scale, increment_period, multiplier)
    (2.0**15, 1, 2.0),
    (3e38, 1, 2.0),  # growth overflows float32: the scale must stay
    (2.0**127, 2, 2.0),
    (1000.0, 3, 3.0),
    (3e38, 7, 1.5),
    (12345.678, 2, 10.0),
    (2.0**127, 1, 10.0),
    (1.7, 2, 1.5),  # clamps at 1 quickly
]
ORACLE_SEEDS = (0, 1)
ORACLE_STEPS = 200


def _grad_sequence(seed):
    """Random finite / NaN / +Inf / -Inf gradient pairs, ORACLE_STEPS long."""
    rng = np.random.default_rng(seed)
    p_finite = (0.55, 0.85)[seed % 2]
    seq = []
    for _ in range(ORACLE_STEPS):
        g0 = rng.normal(size=4).astype(np.float32) * F32(1e3)
        g1 = rng.normal(size=(2, 3)).astype(np.float32)
        if rng.random() > p_finite:
            bad = rng.choice([np.nan, np.inf, -np.inf])
            if rng.random() < 0.5:
                g0[rng.integers(4)] = bad
            else:
                g1[rng.integers(2), rng.integers(3)] = bad
        seq.append((g0, g1))
    return seq


_ORACLE_CACHE = {}


def _oracle_trajectory(case, seed):
    """[(should_apply, scale, good_steps)] of the seed implementation, eager."""
    key = (case, seed)
    if key not in _ORACLE_CACHE:
        initial, period, multiplier = case
        oracle = tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=initial, increment_period=period, multiplier=multiplier
        )
        out = []
        for g0, g1 in _grad_sequence(seed):
            _, should_apply = oracle.update([tf.constant(g0), tf.constant(g1)])
            out.append(
                (
                    bool(should_apply.numpy()),
                    F32(oracle().numpy()),
                    int(oracle._num_good_steps.numpy()),
                )
            )
        _ORACLE_CACHE[key] = out
    return _ORACLE_CACHE[key]


@pytest.mark.parametrize(
    "case",
    slow_except(
        [(c,) for c in ORACLE_CASES],
        [((3e38, 1, 2.0),)],
        [f"s{c[0]:g}-p{c[1]}-m{c[2]:g}" for c in ORACLE_CASES],
    ),
)
def test_matches_tf_seed_implementation_bit_for_bit(case, run_mode):
    initial, period, multiplier = case
    for seed in ORACLE_SEEDS:
        expected = _oracle_trajectory(case, seed)
        ls = tfdls.DynamicLossScale(
            initial_loss_scale=initial, increment_period=period, multiplier=multiplier
        )
        step = _update_step(ls, run_mode)
        for i, (g0, g1) in enumerate(_grad_sequence(seed)):
            should_apply, scale, good = step(tf.constant(g0), tf.constant(g1))
            want_apply, want_scale, want_good = expected[i]
            where = f"mode={run_mode.mode} seed={seed} step={i}"
            assert bool(should_apply.numpy()) == want_apply, where
            assert _same_f32(scale.numpy(), want_scale), (
                f"{where}: scale {scale.numpy()!r} != seed {want_scale!r}"
            )
            assert int(good.numpy()) == want_good, where
            # The variables (not just the returned reads) hold the same state.
            assert _same_f32(ls.current_loss_scale.numpy(), want_scale), where
            assert int(ls.num_good_steps.numpy()) == want_good, where


@pytest.mark.slow
def test_oracle_sequences_exercise_growth_overflow_and_clamp():
    """Guards the differential test: the sequences do hit every branch."""
    grew = stayed_at_overflow = clamped = shrank = False
    for case in ORACLE_CASES:
        initial, period, multiplier = case
        for seed in ORACLE_SEEDS:
            traj = _oracle_trajectory(case, seed)
            prev = F32(initial)
            for should_apply, scale, good in traj:
                if should_apply and good == 0:
                    if scale > prev:
                        grew = True
                    else:
                        with np.errstate(over="ignore"):
                            overflows = not np.isfinite(prev * F32(multiplier))
                        if scale == prev and overflows:
                            stayed_at_overflow = True
                if not should_apply:
                    if scale < prev:
                        shrank = True
                    if scale == 1.0 and prev < multiplier:
                        clamped = True
                prev = scale
    assert grew and stayed_at_overflow and clamped and shrank


def test_near_float32_max_growth_keeps_scale(run_mode):
    for initial in (2.0**127, 3e38, F32_MAX):
        ls = tfdls.DynamicLossScale(initial, increment_period=1, multiplier=2.0)
        step = _update_step(ls, run_mode)
        for _ in range(3):
            should_apply, scale, good = step(tf.ones([4]), tf.ones([2, 3]))
            assert bool(should_apply.numpy())
            assert _same_f32(scale.numpy(), initial)
            assert int(good.numpy()) == 0
        assert np.isfinite(ls().numpy())


# --------------------------------------------------------------------------
# 2. The extended contract against the plain-Python model.
# --------------------------------------------------------------------------
CONTRACT_CASES = {
    "backoff": dict(initial_loss_scale=1024.0, increment_period=3, backoff_factor=0.25),
    "backoff_odd": dict(
        initial_loss_scale=777.0, increment_period=2, multiplier=3.0, backoff_factor=0.7
    ),
    "tiny_min": dict(initial_loss_scale=4.0, increment_period=4, min_loss_scale=1e-20),
    "tiny_min_backoff": dict(
        initial_loss_scale=1.0, increment_period=5, backoff_factor=0.1, min_loss_scale=1e-20
    ),
    "max_cap": dict(initial_loss_scale=3.0, increment_period=1, max_loss_scale=100.0),
    "max_cap_odd": dict(
        initial_loss_scale=2.0**20, increment_period=2, multiplier=3.0, max_loss_scale=3e38
    ),
    "hysteresis3": dict(initial_loss_scale=2.0**10, increment_period=3, hysteresis=3),
    "everything": dict(
        initial_loss_scale=50.0,
        increment_period=2,
        multiplier=1.5,
        backoff_factor=0.5,
        min_loss_scale=0.001,
        max_loss_scale=1e4,
        hysteresis=2,
    ),
}


def _decisions(seed, n=120):
    rng = np.random.default_rng(seed)
    # Runs of overflows and runs of finite steps, so that clamps and caps happen.
    out = []
    while len(out) < n:
        out += [bool(rng.random() < 0.5)] * int(rng.integers(1, 9))
    return out[:n]


def _grad_for(finite, i):
    if finite:
        return tf.constant([1.0, -2.0, 3.0])
    return tf.constant([1.0, (np.nan, np.inf, -np.inf)[i % 3], 3.0])


@pytest.mark.parametrize("name", slow_except(sorted(CONTRACT_CASES), ["everything"]))
def test_extended_contract_matches_model(name, run_mode):
    kwargs = CONTRACT_CASES[name]
    ls = tfdls.DynamicLossScale(**kwargs)
    model = ContractModel(**kwargs)
    step = run_mode(lambda g: ls.update([g])[1])
    assert _state(ls) == _model_state(model)
    for seed in (0, 1):
        for i, finite in enumerate(_decisions(seed)):
            should_apply = step(_grad_for(finite, i))
            model.step(finite)
            got = _state(ls)
            where = f"{name} mode={run_mode.mode} seed={seed} step={i}"
            assert bool(should_apply.numpy()) == finite, where
            assert _same_f32(got[0], model.s), f"{where}: {got[0]!r} != {model.s!r}"
            assert got[1:] == _model_state(model)[1:], where
            s = got[0]
            assert np.isfinite(s) and s > 0, where
            assert s >= F32(ls.min_loss_scale), where
            if ls.max_loss_scale is not None:
                assert s <= F32(ls.max_loss_scale), where


def test_min_loss_scale_far_below_one_clamps_and_never_reaches_zero(run_mode):
    ls = tfdls.DynamicLossScale(1.0, increment_period=10, min_loss_scale=1e-20)
    step = run_mode(lambda g: ls.update([g])[1])
    nan = tf.constant([np.nan])
    seen = []
    for _ in range(200):  # 2**-200 would underflow float32 to 0
        assert not bool(step(nan).numpy())
        seen.append(F32(ls().numpy()))
    assert seen[0] == F32(0.5)
    assert seen[9] == F32(2.0**-10)
    assert all(s > 0 for s in seen)
    assert _same_f32(seen[-1], F32(1e-20))
    assert int(ls.num_skipped_steps.numpy()) == 200
    assert int(ls.steps_since_overflow.numpy()) == 0


def test_backoff_factor_used_instead_of_multiplier():
    ls = tfdls.DynamicLossScale(1000.0, increment_period=2, multiplier=4.0, backoff_factor=0.1)
    ls.update([tf.constant(np.inf)])
    assert _same_f32(ls().numpy(), F32(1000.0) * F32(0.1))
    ls.update([tf.constant(1.0)])
    ls.update([tf.constant(1.0)])
    assert _same_f32(ls().numpy(), F32(1000.0) * F32(0.1) * F32(4.0))


def test_max_loss_scale_caps_growth():
    ls = tfdls.DynamicLossScale(3.0, increment_period=1, max_loss_scale=10.0)
    scales = []
    for _ in range(4):
        ls.update([tf.constant(1.0)])
        scales.append(float(ls().numpy()))
    assert scales == [6.0, 10.0, 10.0, 10.0]
    # No overflow-driven infinity: the cap also applies at float32 max.
    ls = tfdls.DynamicLossScale(F32_MAX, increment_period=1, max_loss_scale=F32_MAX)
    ls.update([tf.constant(1.0)])
    assert _same_f32(ls().numpy(), F32_MAX)


def test_hysteresis_three_shrinks_after_third_overflow_since_growth():
    ls = tfdls.DynamicLossScale(64.0, increment_period=2, hysteresis=3)
    nan, one = tf.constant(np.nan), tf.constant(1.0)

    def scale():
        return float(ls().numpy())

    ls.update([nan])
    ls.update([nan])
    assert scale() == 64.0 and int(ls.hysteresis_budget.numpy()) == 1
    ls.update([one])  # a finite step without growth does not refill the budget
    assert int(ls.hysteresis_budget.numpy()) == 1
    ls.update([nan])
    assert scale() == 32.0  # third overflow since the last growth
    ls.update([nan])
    assert scale() == 16.0  # budget exhausted: every further overflow shrinks
    assert int(ls.hysteresis_budget.numpy()) == 0  # and it stays at 0, never negative
    ls.update([nan])
    assert scale() == 8.0 and int(ls.hysteresis_budget.numpy()) == 0
    ls.update([one])
    ls.update([one])
    assert scale() == 16.0
    assert int(ls.hysteresis_budget.numpy()) == 3  # growth refills the budget
    ls.update([nan])
    ls.update([nan])
    assert scale() == 16.0
    ls.update([nan])
    assert scale() == 8.0
    assert int(ls.num_skipped_steps.numpy()) == 8


def test_counters_skipped_and_since_overflow():
    ls = tfdls.DynamicLossScale(8.0, increment_period=100)
    assert int(ls.num_skipped_steps.numpy()) == 0
    assert int(ls.steps_since_overflow.numpy()) == 0
    for i in range(3):
        ls.update([tf.constant(1.0)])
    assert int(ls.steps_since_overflow.numpy()) == 3
    ls.update([tf.constant(-np.inf)])
    assert int(ls.num_skipped_steps.numpy()) == 1
    assert int(ls.steps_since_overflow.numpy()) == 0
    ls.update([tf.constant(1.0)])
    ls.update([tf.constant(np.nan)])
    ls.update([tf.constant(1.0)])
    ls.update([tf.constant(1.0)])
    assert int(ls.num_skipped_steps.numpy()) == 2
    assert int(ls.steps_since_overflow.numpy()) == 2
    assert ls.num_skipped_steps.dtype == tf.int64
    assert ls.steps_since_overflow.dtype == tf.int64


@pytest.mark.parametrize(
    "arg, kwargs",
    [
        ("min_loss_scale", dict(initial_loss_scale=1e-37, min_loss_scale=1e-40)),
        ("initial_loss_scale", dict(initial_loss_scale=1e-40, min_loss_scale=1e-42)),
    ],
    ids=["min", "initial"],
)
def test_subnormal_scales_never_yield_zero(arg, kwargs, run_mode):
    """A float32-subnormal min/initial scale is flushed to 0 by TF's CPU
    kernels; it must either be rejected up front or never produce 0."""
    try:
        ls = tfdls.DynamicLossScale(increment_period=1, **kwargs)
    except ValueError as error:
        assert f"{arg}={kwargs[arg]!r}" in str(error), str(error)
        return
    step = run_mode(lambda g: ls.update([g])[1])
    for i in range(10):
        step(tf.constant([np.nan]))
        s = float(ls().numpy())
        assert s > 0 and math.isfinite(s), f"step {i}: scale became {s!r}"


# --------------------------------------------------------------------------
# 3. Accepted gradient structures; FixedLossScale.
# --------------------------------------------------------------------------
def _mixed(nan_in=None):
    """float16/bfloat16/float32/float64 gradients, optionally one NaN."""
    values = {
        "f16": np.array([1.0, 65504.0, -2.0], np.float32),
        "bf16": np.array([3.0, -1e30, 0.5], np.float32),
        "f32": np.array([[1.0, 2.0], [3.0, 3e38]], np.float32),
        "f64": np.array([1e300, -4.0], np.float64),
    }
    if nan_in is not None:
        values[nan_in].flat[1] = np.nan
    return [
        tf.cast(values["f16"], tf.float16),
        tf.cast(values["bf16"], tf.bfloat16),
        tf.constant(values["f32"]),
        tf.constant(values["f64"]),
    ]


STRUCTURES = {
    "tensor": lambda bad: tf.constant([1.0, bad, 2.0]),
    "list": lambda bad: [tf.constant([1.0]), tf.constant([[2.0, bad]])],
    "nested_dict": lambda bad: {
        "dense": [tf.constant([1.0]), None],
        "inner": {"w": tf.constant([bad]), "b": None},
    },
    "indexed_slices": lambda bad: [
        None,
        tf.IndexedSlices(
            values=tf.constant([[1.0, bad], [3.0, 4.0]]),
            indices=tf.constant([0, 5]),
            dense_shape=tf.constant([10, 2]),
        ),
    ],
    "dict_with_indexed_slices": lambda bad: {
        "emb": tf.IndexedSlices(tf.constant([[bad, 1.0]]), tf.constant([3])),
        "w": tf.constant([1.0]),
        "none": None,
    },
}


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
@pytest.mark.parametrize("bad", [2.0, np.nan, np.inf, -np.inf], ids=["finite", "nan", "inf", "-inf"])
def test_update_accepts_structures(structure, bad, run_mode):
    ls = tfdls.DynamicLossScale(4.0, increment_period=1)
    build = STRUCTURES[structure]

    def step():
        _, should_apply = ls.update(build(bad))
        return should_apply

    should_apply = run_mode(step)()
    finite = math.isfinite(bad)
    assert isinstance(should_apply, tf.Tensor)
    assert should_apply.dtype == tf.bool and should_apply.shape == ()
    assert bool(should_apply.numpy()) == finite
    assert float(ls().numpy()) == (8.0 if finite else 2.0)


@pytest.mark.parametrize("nan_in", [None, "f16", "bf16", "f32", "f64"])
def test_update_mixed_float_dtypes_in_one_call(nan_in, run_mode):
    ls = tfdls.DynamicLossScale(4.0, increment_period=1)
    should_apply = run_mode(lambda: ls.update(_mixed(nan_in))[1])()
    assert should_apply.dtype == tf.bool and should_apply.shape == ()
    assert bool(should_apply.numpy()) == (nan_in is None)
    assert float(ls().numpy()) == (8.0 if nan_in is None else 2.0)


def test_update_returns_scalar_bools_in_graph_and_none_eagerly():
    ls = tfdls.DynamicLossScale(4.0, increment_period=1)
    seen = {}

    @tf.function
    def step(g):
        update_op, should_apply = ls.update([g])
        seen["op"], seen["apply"] = update_op, should_apply
        return tf.identity(update_op)  # TF 2.4 code does this; an Operation fails

    assert bool(step(tf.constant([1.0])).numpy()) is True  # grew, as the seed says
    assert float(ls().numpy()) == 8.0
    assert isinstance(seen["op"], tf.Tensor)
    assert seen["op"].dtype == tf.bool and seen["op"].shape.rank == 0
    assert seen["apply"].dtype == tf.bool and seen["apply"].shape.rank == 0
    # Eager: the update already happened; should_apply is a concrete tensor.
    update_op, should_apply = ls.update(tf.constant([np.nan]))
    assert update_op is None
    assert should_apply.shape == () and not bool(should_apply.numpy())


def test_fixed_loss_scale_value_and_update(run_mode):
    ls = tfdls.FixedLossScale(1024)
    value = ls()
    assert isinstance(value, tf.Tensor) and value.dtype == tf.float32 and value.shape == ()
    assert float(value.numpy()) == 1024.0
    for grads in ([tf.constant([np.nan])], tf.constant(np.inf), [None], {"a": tf.constant(1.0)}):
        result = ls.update(grads)
        assert isinstance(result, tuple) and len(result) == 2
        assert result[1] is True
    seen = {}

    def step():
        op, should_apply = ls.update([tf.constant([np.nan, 1.0])])
        seen["apply"] = should_apply
        seen["op"] = op
        return ls()

    out = run_mode(step)()
    assert seen["apply"] is True
    if run_mode.mode != "eager":
        assert isinstance(seen["op"], tf.Operation)
    assert float(out.numpy()) == 1024.0
    assert ls.loss_scale_value == 1024.0


# --------------------------------------------------------------------------
# 5. get / serialize / deserialize / config round trips.
# --------------------------------------------------------------------------
SEED_DEFAULTS = dict(
    initial_loss_scale=2.0**15,
    increment_period=2000,
    multiplier=2.0,
    backoff_factor=None,
    min_loss_scale=1.0,
    max_loss_scale=None,
    hysteresis=1,
)

FULL_ARGS = dict(
    initial_loss_scale=300.0,
    increment_period=7,
    multiplier=1.5,
    backoff_factor=0.25,
    min_loss_scale=1e-20,
    max_loss_scale=1e30,
    hysteresis=3,
)


def _args_of(ls):
    return {k: getattr(ls, k) for k in SEED_DEFAULTS}


def test_get_dynamic_has_seed_defaults():
    ls = tfdls.get("dynamic")
    assert type(ls) is tfdls.DynamicLossScale
    assert _args_of(ls) == SEED_DEFAULTS
    assert float(ls().numpy()) == 2.0**15
    assert tfdls.get("dynamic") is not ls  # a fresh object each time


@pytest.mark.parametrize("number", [1024, 1024.0, np.float32(1024), np.int64(1024)])
def test_get_number_is_fixed(number):
    ls = tfdls.get(number)
    assert type(ls) is tfdls.FixedLossScale
    assert ls.loss_scale_value == 1024.0 and isinstance(ls.loss_scale_value, float)
    assert float(ls().numpy()) == 1024.0


def test_get_returns_loss_scale_as_is():
    for ls in (tfdls.FixedLossScale(8.0), tfdls.DynamicLossScale(8.0, 3)):
        assert tfdls.get(ls) is ls


def test_serialize_round_trip_all_args():
    ls = tfdls.DynamicLossScale(**FULL_ARGS)
    config = tfdls.serialize(ls)
    assert config["class_name"] == "DynamicLossScale"
    for restored in (tfdls.deserialize(config), tfdls.get(config)):
        assert type(restored) is tfdls.DynamicLossScale and restored is not ls
        assert _args_of(restored) == FULL_ARGS
        assert tfdls.serialize(restored) == config
    fixed = tfdls.FixedLossScale(12.5)
    config = tfdls.serialize(fixed)
    assert config["class_name"] == "FixedLossScale"
    restored = tfdls.get(config)
    assert type(restored) is tfdls.FixedLossScale and restored.loss_scale_value == 12.5


def test_serialized_config_is_json_friendly():
    import json

    config = tfdls.serialize(tfdls.DynamicLossScale(**FULL_ARGS))
    restored = tfdls.deserialize(json.loads(json.dumps(config)))
    assert _args_of(restored) == FULL_ARGS


def test_get_config_from_config_round_trip():
    ls = tfdls.DynamicLossScale(**FULL_ARGS)
    assert ls.get_config() == FULL_ARGS
    again = tfdls.DynamicLossScale.from_config(ls.get_config())
    assert _args_of(again) == FULL_ARGS and again.get_config() == FULL_ARGS
    default = tfdls.DynamicLossScale()
    assert tfdls.DynamicLossScale.from_config(default.get_config()).get_config() == SEED_DEFAULTS
    fixed = tfdls.FixedLossScale(3.0)
    assert tfdls.FixedLossScale.from_config(fixed.get_config()).loss_scale_value == 3.0


# Invalid arguments: one place for all of them, tests/api/test_bad_input.py (the
# table in docs/bad-input.md).


# --------------------------------------------------------------------------
# 7. Checkpoint and SavedModel.
# --------------------------------------------------------------------------
def _ckpt_args():
    return dict(initial_loss_scale=16.0, increment_period=5, hysteresis=2)


def _saved_checkpoint(tmp_path):
    ls = tfdls.DynamicLossScale(**_ckpt_args())
    one, nan = tf.constant(1.0), tf.constant(np.nan)
    for g in (one, one, one, nan, one, one):
        ls.update([g])
    # Mid-period: 2 good steps, budget 1 (one overflow since growth), scale kept.
    assert _state(ls) == (F32(16.0), 2, 1, 1, 2)
    path = tf.train.Checkpoint(ls=ls).save(str(tmp_path / "ckpt"))
    # Move on after saving: restore must bring back the saved state, not this.
    for _ in range(4):
        ls.update([nan])
    return path


def _restored(path):
    fresh = tfdls.DynamicLossScale(**_ckpt_args())
    assert _state(fresh) == (F32(16.0), 0, 2, 0, 0)
    tf.train.Checkpoint(ls=fresh).restore(path).assert_consumed()
    assert _state(fresh) == (F32(16.0), 2, 1, 1, 2)
    return fresh


def test_checkpoint_resumes_growth_on_the_right_step(tmp_path):
    ls = _restored(_saved_checkpoint(tmp_path))
    one = tf.constant(1.0)
    scales = []
    for _ in range(4):
        ls.update([one])
        scales.append(float(ls().numpy()))
    assert scales == [16.0, 16.0, 32.0, 32.0]  # 2 saved + 3 = increment_period
    assert int(ls.hysteresis_budget.numpy()) == 2
    assert int(ls.steps_since_overflow.numpy()) == 6


def test_checkpoint_resumes_hysteresis(tmp_path):
    ls = _restored(_saved_checkpoint(tmp_path))
    ls.update([tf.constant(np.inf)])  # a fresh object (budget 2) would not shrink
    assert float(ls().numpy()) == 8.0
    assert int(ls.num_skipped_steps.numpy()) == 2
    assert int(ls.num_good_steps.numpy()) == 0


class _Holder(tf.Module):
    def __init__(self):
        super().__init__()
        self.ls = tfdls.DynamicLossScale(64.0, increment_period=3, hysteresis=1)

    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def step(self, g):
        _, should_apply = self.ls.update([g])
        return self.ls(), should_apply


def test_saved_model_keeps_updating(tmp_path):
    holder = _Holder()
    one, nan = tf.ones([3]), tf.constant([1.0, np.nan, 2.0])
    holder.step(nan)  # 32
    holder.step(one)  # good steps 1
    assert _state(holder.ls) == (F32(32.0), 1, 0, 1, 1)
    tf.saved_model.save(holder, str(tmp_path / "sm"))
    holder.step(nan)  # must not leak into the saved state

    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    assert float(loaded.ls.current_loss_scale.numpy()) == 32.0
    assert int(loaded.ls.num_good_steps.numpy()) == 1
    assert int(loaded.ls.num_skipped_steps_variable.numpy()) == 1
    assert int(loaded.ls.steps_since_overflow_variable.numpy()) == 1

    scales = []
    for _ in range(3):
        scale, should_apply = loaded.step(one)
        assert bool(should_apply.numpy())
        scales.append(float(scale.numpy()))
    assert scales == [32.0, 64.0, 64.0]  # 1 saved good step + 2 = period 3
    scale, should_apply = loaded.step(nan)
    assert not bool(should_apply.numpy())
    assert float(scale.numpy()) == 32.0
    assert float(loaded.ls.current_loss_scale.numpy()) == 32.0
    assert int(loaded.ls.num_skipped_steps_variable.numpy()) == 2


def _documented_state_names():
    """(Python reader, variable name) per row of the state table in docs/loss-scales.md."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "loss-scales.md").read_text()
    section = page.split("| state | read in Python |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        reader = re.match(r"`([^`]+)`", cells[1]).group(1)
        rows.append((reader, cells[2].strip("`")))
    return rows


def test_docs_name_each_piece_of_state_as_saved(tmp_path):
    rows = _documented_state_names()
    holder = _Holder()
    holder.step(tf.ones([3]))
    ls = holder.ls
    # Every variable of the scale is in the table, once.
    assert sorted(v for _, v in rows) == sorted(
        name for name, value in vars(ls).items() if isinstance(value, tf.Variable)
    )
    tf.saved_model.save(holder, str(tmp_path / "sm"))
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    path = tf.train.Checkpoint(ls=ls).save(str(tmp_path / "ckpt"))
    keys = {name for name, _ in tf.train.list_variables(path)}
    for reader, variable in rows:
        expected = getattr(ls, variable).numpy()
        assert getattr(loaded.ls, variable).numpy() == expected  # SavedModel attribute
        assert f"ls/{variable}/.ATTRIBUTES/VARIABLE_VALUE" in keys  # checkpoint name
        value = ls() if reader == "ls()" else getattr(ls, reader.split(".", 1)[1].split(" ")[0])
        assert tf.convert_to_tensor(value).numpy() == expected  # the Python reader
