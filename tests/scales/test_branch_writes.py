"""The state's writes of one outcome (the `tf.cond` plan) against both outcomes selected.

On the ``"cond"`` plan without a strategy, a step writes the loss scale's
state and the overflow record inside the branch taken
(`DynamicLossScale.update_in_branch`, `OverflowRecord.record_in_branch`);
elsewhere both outcomes are computed and selected (`update_from_decision`,
`OverflowRecord.record`). Drawn states and decisions: the two forms must
leave every variable equal, bit for bit, eagerly and traced.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfdls
from tfdls import overflow
from tfdls._decision import Decision
from tests.scales.test_loss_scale import CONTRACT_CASES

F32 = np.float32
CONFIGS = dict(CONTRACT_CASES, default={})


def _scale_variables(ls):
    return [ls.current_loss_scale, ls.num_good_steps, ls.hysteresis_budget,
            ls.num_skipped_steps_variable, ls.steps_since_overflow_variable]


def _bits(values):
    return [np.asarray(v).tobytes() for v in values]


def _scale_states(ls):
    """Drawn values for the five variables: scales at and near the bounds, off the
    powers of two, and above the maximum (a value written from elsewhere)."""
    period, hysteresis = ls.increment_period, ls.hysteresis
    highest = ls.max_loss_scale or float(np.finfo(np.float32).max)
    scales = st.sampled_from([ls.min_loss_scale, highest, ls.initial_loss_scale, 3.0, 1e30,
                              float(np.nextafter(F32(highest), F32(0))), 2.0**-20])
    return st.tuples(scales, st.integers(0, period), st.integers(0, hysteresis),
                     st.integers(0, 50), st.integers(0, 50))


class _Pair:
    """Two equal scales of one configuration: one steps branch-free, one in a branch."""

    def __init__(self, config, traced):
        self.selected = tfdls.DynamicLossScale(**config)
        self.branched = tfdls.DynamicLossScale(**config)

        def select(finite, lowers, pass_scale):
            scale = self.selected() if pass_scale else None
            self.selected.update_from_decision(
                Decision(is_finite=finite, lowers_scale=lowers), scale)

        def branch(finite, lowers, pass_scale):
            scale = self.branched() if pass_scale else None

            def outcome(is_finite):
                def write():
                    self.branched.update_in_branch(is_finite, scale, lowers)
                    return tf.constant(is_finite)
                return write

            tf.cond(finite, outcome(True), outcome(False))

        wrap = (lambda f: tf.function(f, autograph=False)) if traced else (lambda f: f)
        self.select, self.branch = wrap(select), wrap(branch)


@pytest.fixture(scope="module", params=["eager", "graph"])
def pairs(request):
    return {name: _Pair(config, request.param == "graph") for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_branch_writes_the_scale_as_the_selection_does(pairs, name, data):
    pair = pairs[name]
    state = data.draw(_scale_states(pair.selected), label="state")
    finite = data.draw(st.booleans(), label="finite")
    lowers = data.draw(st.sampled_from([None, True, False]), label="lowers_scale")
    pass_scale = data.draw(st.booleans(), label="pass the scale read")
    for ls in (pair.selected, pair.branched):
        for variable, value in zip(_scale_variables(ls), state):
            variable.assign(value)
    lowers_t = None if lowers is None else tf.constant(lowers)
    pair.select(tf.constant(finite), lowers_t, pass_scale)
    pair.branch(tf.constant(finite), lowers_t, pass_scale)
    assert _bits(_scale_variables(pair.branched)) == _bits(_scale_variables(pair.selected))


def _record_variables(record):
    return [record.state]  # every field: one variable (`tfdls._packed_state`)


@pytest.mark.parametrize("attribution", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_branch_writes_the_overflow_record_as_the_selection_does(attribution, data):
    count = 5
    names = [f"v{i}" for i in range(count)]
    positions = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count,
                                   unique=True), label="positions")
    finite = data.draw(st.booleans(), label="finite")
    flags = st.lists(st.booleans(), min_size=len(positions), max_size=len(positions))
    nonfinite = data.draw(flags, label="nonfinite")
    sums = data.draw(st.one_of(st.none(), flags), label="sums_overflow")
    stuck = data.draw(st.booleans(), label="stuck") and not finite
    start = data.draw(st.tuples(st.lists(st.booleans(), min_size=count, max_size=count),
                                *[st.integers(-1, 99)] * 5), label="record before")
    decision = Decision(is_finite=tf.constant(finite), nonfinite=tf.constant(nonfinite),
                        sums_overflow=None if sums is None else tf.constant(sums),
                        lowers_scale=tf.constant(not finite), stuck=tf.constant(stuck))
    applied = tf.constant(7, tf.int64)
    records = [overflow.OverflowRecord(names, attribution, overflow.MinScalePolicy("ignore"))
               for _ in range(2)]
    for record in records:
        mask, steps, last_step, last_applied, stuck, sum_step = start
        record.packed.assign(mask=mask, steps=steps, last_step=last_step,
                             last_applied_steps=last_applied,
                             stuck_overflows=stuck, sum_mask=mask[::-1],
                             sum_step=sum_step)
    records[0].record(decision, positions, applied)

    def write(is_finite):
        def branch():
            records[1].record_in_branch(is_finite, decision, positions,
                                        None if is_finite else applied)
            return tf.constant(is_finite)
        return branch

    tf.cond(decision.is_finite, write(True), write(False))
    assert (_bits(_record_variables(records[1])) == _bits(_record_variables(records[0])))


# -- the plan ------------------------------------------------------------------------


def _consumers_of_captured(concrete, variable):
    """The op types in `concrete`'s own graph (not its branches) that read or write
    `variable` directly."""
    graph = concrete.graph
    for external, internal in graph.captures:
        if external is variable.handle:
            return sorted(consumer.type for consumer in internal.consumers())
    raise AssertionError(f"{variable.name} is not captured by the step")


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
@pytest.mark.parametrize("plan", ["cond", "masked"])
def test_on_the_cond_plan_the_skipped_steps_writes_run_only_in_their_branch(plan):
    """A finite step on the cond plan runs none of the skipped step's writes: in the
    step's graph, the skipped-step count and the overflow record (one variable, which a
    finite step adds one to) are only inputs of the cond. The masked plan writes them
    branch-free."""
    keras.mixed_precision.set_global_policy("float32")
    # On the CPU, jit_compile="auto" runs a small apply on the cond plan; False masks it.
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                   jit_compile="auto" if plan == "cond" else False)
    w = keras.Variable(tf.zeros([8]), name="w")
    step = tf.function(lambda g: opt.apply([g], [w]))
    concrete = step.get_concrete_function(tf.TensorSpec([8]))
    assert opt.step_plan.skip == plan and not opt.step_plan.compile, opt.step_plan
    for variable in (opt.loss_scale.num_skipped_steps_variable, opt._overflow.state):
        consumers = _consumers_of_captured(concrete, variable)
        if plan == "cond":
            assert all(t in ("If", "StatelessIf") for t in consumers), (variable.name,
                                                                         consumers)
        else:
            assert "AssignVariableOp" in consumers, (variable.name, consumers)


def _op_types(concrete):
    """The op types of `concrete`'s own graph, and of each branch of its conds (by
    "then"/"else"), from its GraphDef."""
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    own = [node.op for node in graph_def.node]
    branches = {"then": [], "else": []}
    for node in graph_def.node:
        if node.op in ("If", "StatelessIf"):
            for side in branches:
                name = node.attr[f"{side}_branch"].func.name
                branches[side] += [n.op for n in library[name].node_def]
    return own, branches


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
@pytest.mark.parametrize("plan", ["cond", "masked"])
def test_on_the_cond_plan_the_rest_of_the_decision_is_made_in_the_skipped_branch(plan):
    """Before the cond, a finite step on the cond plan only decides whether to apply (one
    reduction of the gradients' flags); which gradients overflowed and whether the
    scale is stuck at its minimum (`live <= min_loss_scale`, the step's one LessEqual)
    are made inside the skipped branch. The masked plan makes them before the update."""
    keras.mixed_precision.set_global_policy("float32")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                   jit_compile="auto" if plan == "cond" else False)
    w = keras.Variable(tf.zeros([8]), name="w")
    v = keras.Variable(tf.zeros([3]), name="v")
    step = tf.function(lambda g, h: opt.apply([g, h], [w, v]))
    concrete = step.get_concrete_function(tf.TensorSpec([8]), tf.TensorSpec([3]))
    assert opt.step_plan.skip == plan and not opt.step_plan.compile, opt.step_plan
    own, branches = _op_types(concrete)
    if plan == "cond":
        assert "LessEqual" not in own and "LogicalNot" not in own, sorted(own)
        assert "LessEqual" in branches["else"] and "LogicalNot" in branches["else"]
        assert "LessEqual" not in branches["then"], sorted(branches["then"])
        # One reduction decides: the flags are not counted (no cast, sum and compare).
        assert "Sum" not in own and "Equal" not in own, sorted(own)
    else:
        assert "LessEqual" in own and "LogicalNot" in own, sorted(own)


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
def test_the_cond_plan_steps_the_scale_and_record_as_the_masked_plan_does():
    """The same gradients through both plans: equal weights, scale state and record."""
    keras.mixed_precision.set_global_policy("float32")
    results = {}
    for plan in ("cond", "masked"):
        opt = tfdls.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            tfdls.DynamicLossScale(2.0**4, increment_period=2, hysteresis=2),
            jit_compile="auto" if plan == "cond" else False)
        w = keras.Variable(tf.ones([4]), name="w")
        step = tf.function(lambda g: opt.apply([g], [w]))
        rng = np.random.default_rng(3)
        for i in range(24):
            g = rng.standard_normal(4).astype(np.float32) * 8
            if i % 5 in (2, 3):
                g[i % 4] = [np.inf, np.nan][i % 2]
            step(tf.constant(g))
        assert opt.step_plan.skip == plan and not opt.step_plan.compile, opt.step_plan
        assert opt.loss_scale.num_skipped_steps.numpy() > 0
        results[plan] = (
            _bits([w.numpy(), opt.iterations.numpy()]
                  + [v.numpy() for v in opt.inner_optimizer.variables])
            + _bits(_scale_variables(opt.loss_scale)) + _bits(_record_variables(opt._overflow)))
    assert results["cond"] == results["masked"]


# -- where the branches do not write (found by review) ------------------------------


def _train(opt, eager=False, strategy=None, steps=((1.0, 2.0, 3.0, 4.0), (np.inf, 1.0, 1.0, 1.0),
                                                  (1.0, 1.0, 1.0, 1.0), (np.nan, 0.0, 0.0, 0.0))):
    """A few steps of `opt` on one variable; its values after them."""
    with strategy.scope() if strategy else _no_scope():
        w = keras.Variable(tf.ones([4]), name="w")

    def apply(g):
        opt.apply([g], [w])

    step = apply if eager else tf.function(apply)
    for g in steps:
        g = tf.constant(g, tf.float32)
        if strategy:
            strategy.run(step, args=(g,))
        else:
            step(g)
    return [w.numpy(), opt.iterations.numpy(), opt.loss_scale().numpy(),
            opt.loss_scale.skipped_steps.numpy() if opt.loss_scale.skipped_steps is not None
            else None]


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
def test_a_one_replica_mirrored_strategy_takes_the_cond_in_cross_replica_context():
    """One replica still synchronizes through merge_call, which TensorFlow refuses inside
    a branch: the step keeps the cond of `tfdls._distribute.apply_if`, same values."""
    keras.mixed_precision.set_global_policy("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(8.0))
    got = _train(opt, strategy=strategy)
    assert opt.step_plan.skip == "cond"
    plain = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(8.0))
    assert _bits(got) == _bits(_train(plain))


class _CountingScale(tfdls.DynamicLossScale):
    """Overrides the documented one-argument `update_from_decision`; counts the steps
    that ran it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = tf.Variable(0, trainable=False)

    def update_from_decision(self, decision):
        with tf.control_dependencies([self.calls.assign_add(1)]):
            return super().update_from_decision(decision)


class _BranchCountingScale(tfdls.DynamicLossScale):
    """Overrides the public `update_in_branch` (not `update_from_decision`, so the cond
    plan still branches) and reads its `lowers_scale` in both branches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lowering = tf.Variable(0, dtype=tf.int64, trainable=False)

    def update_in_branch(self, finite, scale=None, lowers_scale=None):
        self.lowering.assign_add(tf.cast(lowers_scale, tf.int64))
        return super().update_in_branch(finite, scale, lowers_scale)


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
def test_a_subclass_of_update_in_branch_reads_lowers_scale_in_both_branches():
    """From review: a finite step passes `lowers_scale` as a bool tensor (False, the
    value a finite step's decision has), not None, to an overriding `update_in_branch`."""
    keras.mixed_precision.set_global_policy("float32")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), _BranchCountingScale(8.0))
    got = _train(opt)
    assert opt.step_plan.skip == "cond"
    assert int(opt.loss_scale.lowering.numpy()) == 2  # the two skipped steps of _train
    plain = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(8.0))
    assert _bits(got) == _bits(_train(plain))


class _HalvingScale(tfdls.LossScale):
    """Not a DynamicLossScale: steps by its own `update_from_decision`."""

    def __init__(self):
        super().__init__()
        self.value = tf.Variable(2.0**10, trainable=False)

    def __call__(self):
        return tf.convert_to_tensor(self.value)

    def update(self, grads):
        ok = tfdls.all_finite(grads, across_replicas=True)
        return self.update_from_decision(ok), ok

    @property
    def decides_from_gradients(self):
        return False

    def update_from_decision(self, decision):
        ok = getattr(decision, "is_finite", decision)
        return self.value.assign(tf.where(ok, self.value, self.value / 2))

    def get_config(self):
        return {}


@pytest.mark.filterwarnings("ignore::tfdls.UnscaledLossWarning")
@pytest.mark.parametrize("how", ["eager", "cond", "masked"])
def test_a_scale_with_its_own_update_from_decision_steps_by_it(how):
    """A subclass's (or another LossScale's) `update_from_decision(decision)` is called on
    every plan, as documented, and gives what the base class gives."""
    keras.mixed_precision.set_global_policy("float32")
    jit = False if how == "masked" else "auto"
    counting = _CountingScale(8.0)
    got = _train(tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), counting, jit_compile=jit),
                 eager=how == "eager")
    assert counting.calls.numpy() == 4
    base = _train(tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                           tfdls.DynamicLossScale(8.0), jit_compile=jit),
                  eager=how == "eager")
    assert _bits(got) == _bits(base)
    halving = _HalvingScale()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), halving, jit_compile=jit)
    w, iterations, scale, _ = _train(opt, eager=how == "eager")
    assert (iterations, scale) == (2, 2.0**8)
    lr = np.float32(0.1)  # SGD: w - lr * (g / scale), the skipped steps left out
    first = np.float32(1) - lr * (np.float32([1, 2, 3, 4]) / np.float32(1024))
    np.testing.assert_array_equal(w, first - lr * (np.float32(1) / np.float32(512)))


@pytest.mark.parametrize("finite", [True, False])
def test_what_a_branch_returns_runs_every_write_in_a_tf1_graph(finite):
    """In a `tf.compat.v1` graph nothing orders or runs a write that the op run does not
    depend on: `update_in_branch` returns one op that runs them all, as
    `update_from_decision`'s does."""
    config = dict(initial_loss_scale=8.0, increment_period=2, hysteresis=2)
    with tf.Graph().as_default():
        branched = tfdls.DynamicLossScale(**config)
        selected = tfdls.DynamicLossScale(**config)
        steps = [branched.update_in_branch(finite, lowers_scale=tf.constant(True)),
                 selected.update_from_decision(Decision(is_finite=tf.constant(finite),
                                                        lowers_scale=tf.constant(True)))]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(3):
                for step in steps:
                    session.run(step)
            values = [session.run(_scale_variables(ls)) for ls in (branched, selected)]
    assert _bits(values[0]) == _bits(values[1])
