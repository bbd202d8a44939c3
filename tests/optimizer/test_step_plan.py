"""The step plan: how one apply runs is decided once per trace, and exactly
where the rules say (`tfdls.StepPlan`, `tfdls._plan.plan_step`).

* ``jit_compile="auto"`` runs a graph-mode apply as its own XLA cluster only
  for a dynamic scale, a branch-free (masked) skip, no strategy and no op
  determinism, and, without a GPU or TPU, only for an apply of at least
  `AUTO_COMPILE_MIN_ELEMENTS` dense gradient elements (a smaller one takes a cond,
  uncompiled); it changes nothing but speed.
* the check reads the scaled gradients only while the scale cannot fall
  below 1.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

NAN = float("nan")


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [
        keras.Variable(rng.normal(size=(4, 3)).astype("float32"), name="w"),
        keras.Variable(rng.normal(size=(3,)).astype("float32"), name="b"),
    ]


def _scaled_grads(step, scale):
    """Gradients as the tape would give them for a loss scaled by `scale`."""
    rng = np.random.default_rng(100 + step)
    true = [rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(3,)).astype("float32")]
    return [tf.constant(g * np.float32(scale)) for g in true]


def _bits(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)).tobytes() for v in variables]


def _grad_specs():
    return [tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([3], tf.float32)]


def _xla_clusters(fn, *args):
    """How many calls in `fn`'s traced graph are marked for XLA compilation."""
    if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
        fn = tf.function(fn)
    graph = fn.get_concrete_function(*args).graph
    count = 0
    for op in graph.get_operations():
        try:
            if op.get_attr("_XlaMustCompile"):
                count += 1
        except ValueError:
            pass
    return count


def _plan_of(opt, variables, mode="function"):
    """Traces one apply and returns its plan."""
    step = lambda g: opt.apply(g, variables)  # noqa: E731
    if mode == "eager":
        step([tf.zeros([4, 3]), tf.zeros([3])])
    else:
        tf.function(step, jit_compile=mode == "xla").get_concrete_function(_grad_specs())
    return opt.step_plan


class _OwnSGD(keras.optimizers.SGD):
    """A user's subclass: not one of the classes the audit knows."""


@pytest.mark.parametrize(
    "make_inner, jit_compile, skip, compiled",
    [
        (lambda: keras.optimizers.Adam(1e-2), "auto", "masked", True),
        (lambda: keras.optimizers.SGD(0.1), "auto", "masked", True),
        (lambda: keras.optimizers.Adam(1e-2), False, "masked", False),
        # Weight decay writes the variables directly: restored, still masked.
        (lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1), "auto", "masked", True),
        # Keras' own accumulation cond is audited branch by branch: masked.
        (lambda: keras.optimizers.Adam(gradient_accumulation_steps=2), "auto", "masked", True),
        (lambda: keras.optimizers.Adam(gradient_accumulation_steps=2), False, "masked", False),
        # A class of the user's own: a cond, not compiled by auto, compiled when forced.
        (lambda: _OwnSGD(1e-2), "auto", "cond", False),
        (lambda: _OwnSGD(1e-2), True, "cond", True),
    ],
    ids=["adam-auto", "sgd-auto", "adam-off", "adamw-auto", "accumulation-auto",
         "accumulation-off", "own-class-auto", "own-class-on"],
)
def test_which_graph_steps_mask_and_compile(make_inner, jit_compile, skip, compiled,
                                           plan_as_on_an_accelerator):
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(make_inner(), jit_compile=jit_compile)
    opt.build(variables)
    plan = _plan_of(opt, variables)
    assert isinstance(plan, tfdls.StepPlan)
    assert (plan.skip, plan.compile) == (skip, compiled)
    assert _xla_clusters(lambda g: opt.apply(g, variables), _grad_specs()) == int(compiled)
    if skip == "cond":
        assert "_OwnSGD is not one of Keras' own optimizer classes" in plan.reason


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_auto_on_the_cpu_compiles_only_applies_of_the_threshold_size_or_more(inner):
    """No GPU or TPU here: below the threshold a cond, uncompiled; at it, masked and
    compiled. Counted over the variables that get a gradient."""
    from tfdls import _plan

    assert not _plan.accelerator_visible()  # the CI machine has none
    threshold = _plan.AUTO_COMPILE_MIN_ELEMENTS
    make = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}[inner]
    for extra, skip, compiled in ((-1, "cond", False), (0, "masked", True)):
        variables = [keras.Variable(tf.zeros([threshold + extra - 3])),
                     keras.Variable(tf.zeros([3])), keras.Variable(tf.zeros([1000]))]
        opt = tfdls.LossScaleOptimizer(make(1e-2))
        opt.build(variables)
        specs = [tf.TensorSpec(v.shape, tf.float32) for v in variables[:2]]
        step = tf.function(lambda a, b: opt.apply([a, b, None], variables))
        assert _xla_clusters(step, *specs) == int(compiled)
        plan = opt.step_plan
        assert (plan.skip, plan.compile) == (skip, compiled), plan.reason
        if not compiled:
            assert f"at least {threshold:,} dense gradient elements (this one has " \
                   f"{threshold - 1:,};" in plan.reason
    # jit_compile=False keeps the masked step: only "auto" follows the size.
    variables = _variables()
    off = tfdls.LossScaleOptimizer(make(1e-2), jit_compile=False)
    off.build(variables)
    assert (_plan_of(off, variables).skip, off.step_plan.compile) == ("masked", False)


def test_auto_on_the_cpu_does_not_count_sparse_gradients():
    """An Embedding table's tf.IndexedSlices gradient does not count toward the size:
    a table over the threshold with small dense gradients takes the cond, uncompiled;
    the same table's gradient given dense compiles. Both steps are exact."""
    from tfdls import _plan

    threshold = _plan.AUTO_COMPILE_MIN_ELEMENTS
    rows = threshold // 64 + 1  # the table alone is over the threshold
    ids = tf.constant([3, 3, 7])
    values = tf.constant(np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 64.0)
    small = [tf.constant([1.0, -2.0, 4.0])]
    for sparse, skip, compiled in ((True, "cond", False), (False, "masked", True)):
        table, bias = keras.Variable(tf.zeros([rows, 64])), keras.Variable(tf.zeros([3]))
        bare_table, bare_bias = keras.Variable(tf.zeros([rows, 64])), keras.Variable(
            tf.zeros([3]))
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                       tfdls.DynamicLossScale(2.0**3, increment_period=1000))
        bare = keras.optimizers.Adam(1e-2)

        def grads(scale):
            g = tf.IndexedSlices(values * scale, ids, tf.constant([rows, 64]))
            return [g if sparse else tf.convert_to_tensor(g), small[0] * scale]

        step = tf.function(lambda: opt.apply(grads(2.0**3), [table, bias]))
        step()
        tf.function(lambda: bare.apply(grads(1.0), [bare_table, bare_bias]))()
        plan = opt.step_plan
        assert (plan.skip, plan.compile) == (skip, compiled), plan.reason
        if sparse:
            assert "sparse gradients do not count" in plan.reason
            assert "(this one has 3;" in plan.reason
            # Uncompiled: bit-identical to the bare optimizer's step.
            np.testing.assert_array_equal(table.numpy(), bare_table.numpy())
            np.testing.assert_array_equal(bias.numpy(), bare_bias.numpy())
        else:
            np.testing.assert_allclose(table.numpy(), bare_table.numpy(), rtol=1e-6, atol=1e-7)
        assert np.any(table.numpy() != 0)


def test_a_small_cpu_step_with_a_cond_is_exact_and_skips_bit_identically():
    """The small CPU plan (a cond) against the bare optimizer: same finite steps, a
    skipped step leaves every variable as it was."""
    variables, bare_vars = _variables(), _variables()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                   tfdls.DynamicLossScale(2.0**4, increment_period=1000))
    bare = keras.optimizers.Adam(1e-2)
    opt.build(variables)
    bare.build(bare_vars)
    step = tf.function(lambda g: opt.apply(g, variables))
    bare_step = tf.function(lambda g: bare.apply(g, bare_vars))
    for k in range(3):
        grads = _scaled_grads(k, 2.0**4)
        step(grads)
        bare_step([g / 2.0**4 for g in grads])
        assert opt.step_plan.skip == "cond" and not opt.step_plan.compile
    assert _bits(variables) == _bits(bare_vars)
    before = _bits(variables + list(opt.inner_optimizer.variables))
    bad = _scaled_grads(9, 2.0**4)
    step([bad[0] * NAN, bad[1]])
    assert _bits(variables + list(opt.inner_optimizer.variables)) == before
    assert float(opt.loss_scale()) == 2.0**3


def test_plan_outside_a_graph_step():
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    opt.build(variables)
    eager = _plan_of(opt, variables, "eager")
    assert (eager.skip, eager.compile) == ("cond", False) and "eager" in eager.reason
    xla = _plan_of(opt, variables, "xla")  # already one cluster: nothing nested
    assert (xla.skip, xla.compile) == ("masked", False)
    fixed = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), loss_scale=2.0**8)
    fixed.build(variables)
    plan = _plan_of(fixed, variables)
    assert (plan.skip, plan.compile) == ("none", False)
    assert "DynamicLossScale" in plan.reason


def test_check_reads_scaled_gradients_only_while_the_scale_stays_at_least_one():
    variables = _variables()
    default = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    below_one = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(), tfdls.DynamicLossScale(1.0, min_loss_scale=0.25)
    )
    assert _plan_of(default, variables).check == "scaled"
    assert _plan_of(below_one, variables).check == "unscaled"
    assert _plan_of(default, variables).divide == (True, True)


def test_op_determinism_keeps_the_plain_graph(monkeypatch):
    from tfdls import _compat

    monkeypatch.setattr(_compat, "op_determinism_enabled", lambda: True)
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    opt.build(variables)
    plan = _plan_of(opt, variables)
    assert (plan.skip, plan.compile) == ("masked", False) and "determinism" in plan.reason


@pytest.mark.parametrize("jit_compile", ["auto", False])
def test_no_compiled_apply_under_a_strategy(mirrored_strategy, jit_compile):
    # Replicas agree through merge calls, which an XLA cluster cannot hold.
    with mirrored_strategy.scope():
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), jit_compile=jit_compile)
        opt.build(variables)

    def train_step(grads):
        mirrored_strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

    assert _xla_clusters(train_step, _grad_specs()) == 0
    assert (opt.step_plan.skip, opt.step_plan.compile) == ("cond", False)
    assert "merge_call" in opt.step_plan.reason


def test_forcing_jit_compile_under_a_strategy_is_an_error(mirrored_strategy):
    with mirrored_strategy.scope():
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), jit_compile=True)
        opt.build(variables)

    @tf.function
    def train_step(grads):
        mirrored_strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

    with pytest.raises(ValueError, match=r"jit_compile=True.*2 replicas"):
        train_step([tf.zeros([4, 3]), tf.zeros([3])])


@pytest.mark.parametrize("inner", slow_except(["adam", "sgd", "adamw"], ["adam"]))
def test_compiled_apply_matches_the_graph_apply(inner):
    make = {
        "adam": lambda: keras.optimizers.Adam(1e-2),
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    }[inner]
    runs = []
    for jit_compile in (True, False):
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(
            make(), tfdls.DynamicLossScale(2.0**4, increment_period=2), jit_compile=jit_compile
        )
        opt.build(variables)
        step = tf.function(lambda g: opt.apply(g, variables))
        for i in range(4):
            step(_scaled_grads(i, float(opt.loss_scale().numpy())))
        assert opt.step_plan.compile is jit_compile
        poisoned = _scaled_grads(9, float(opt.loss_scale().numpy()))
        poisoned[0] = poisoned[0] * NAN
        before = _bits(variables) + _bits(opt.inner_optimizer.variables)
        step(poisoned)
        assert _bits(variables) + _bits(opt.inner_optimizer.variables) == before
        assert int(opt.iterations.numpy()) == 4
        assert float(opt.loss_scale().numpy()) == 2.0**5
        runs.append([keras.ops.convert_to_numpy(v) for v in variables])
    for compiled, graph in zip(*runs):
        np.testing.assert_allclose(compiled, graph, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value", ["auto", True, False])
def test_jit_compile_round_trips_through_config(value):
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), jit_compile=value)
    config = opt.get_config()
    assert config["jit_compile"] == value
    assert tfdls.LossScaleOptimizer.from_config(config).jit_compile == value
