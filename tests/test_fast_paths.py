"""The two speed paths of LossScaleOptimizer.apply and the rules that pick them.

* SGD takes the scaled gradients with ``learning_rate / scale`` instead of an
  unscaling pass (`tfdls._folded_unscale`): it must give the same bits as
  unscaling first, also on the step where the scale grows.
* In a graph-mode step, ``jit_compile="auto"`` runs the apply as its own XLA
  cluster: it must be chosen exactly where the rules say, and change nothing
  but speed (skips stay bit-identical, the stuck-scale policy still raises).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tfdls import _folded_unscale

NAN = float("nan")


class _UnfoldedSGD(keras.optimizers.SGD):
    """SGD that is not eligible for the fold: the reference, unscaled explicitly."""


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


# -- the learning-rate fold ----------------------------------------------------------


@pytest.mark.parametrize(
    "sgd_kwargs",
    [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}],
    ids=["plain", "momentum", "nesterov"],
)
def test_fold_gives_the_bits_of_unscaling_first_while_the_scale_grows(run_mode, sgd_kwargs):
    runs = []
    for sgd_class in (keras.optimizers.SGD, _UnfoldedSGD):
        variables = _variables()
        # increment_period=1: the scale doubles after every step, so a fold that
        # read the scale after its update would be off by 2x.
        opt = tfdls.LossScaleOptimizer(
            sgd_class(0.1, **sgd_kwargs),
            tfdls.DynamicLossScale(initial_loss_scale=2.0**4, increment_period=1),
            jit_compile=False,  # the same graph for both; XLA may round differently
        )
        opt.build(variables)
        step = run_mode(lambda grads: opt.apply(grads, variables))
        folded = _folded_unscale.eligible(opt.inner_optimizer, [tf.ones(3)], variables)
        assert folded == (sgd_class is keras.optimizers.SGD)
        for i in range(4):
            step(_scaled_grads(i, float(opt.loss_scale().numpy())))
        assert float(opt.loss_scale().numpy()) == 2.0**8
        runs.append(_bits(variables) + _bits(opt.inner_optimizer.variables))
    assert runs[0] == runs[1]


def test_fold_skips_a_nonfinite_step_bit_identically(run_mode):
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build(variables)
    step = run_mode(lambda grads: opt.apply(grads, variables))
    step(_scaled_grads(0, 2.0**15))
    before = _bits(variables) + _bits(opt.inner_optimizer.variables)
    poisoned = _scaled_grads(1, 2.0**15)
    poisoned[1] = poisoned[1] * tf.constant([1.0, NAN, 1.0])
    step(poisoned)
    assert _bits(variables) + _bits(opt.inner_optimizer.variables) == before
    assert int(opt.iterations.numpy()) == 1
    assert float(opt.loss_scale().numpy()) == 2.0**14


def test_fold_eligibility():
    w = keras.Variable(np.ones((2,), "float32"), name="w")
    g = [tf.ones(2)]

    def built(inner, variables=(w,)):
        tfdls.LossScaleOptimizer(inner).build(list(variables))
        return inner

    assert _folded_unscale.eligible(built(keras.optimizers.SGD(0.1)), g, [w])
    # Only SGD itself: its update uses the gradient only times the learning rate.
    assert not _folded_unscale.eligible(built(keras.optimizers.Adam()), g, [w])
    assert not _folded_unscale.eligible(built(_UnfoldedSGD(0.1)), g, [w])
    # Options that use the gradient before the update step.
    for option in ({"clipnorm": 1.0}, {"clipvalue": 1.0}, {"global_clipnorm": 1.0},
                   {"gradient_accumulation_steps": 2}):
        assert not _folded_unscale.eligible(built(keras.optimizers.SGD(0.1, **option)), g, [w])
    sgd = built(keras.optimizers.SGD(0.1))
    sparse = [tf.IndexedSlices(tf.ones([1]), tf.constant([0]), tf.constant([2]))]
    assert not _folded_unscale.eligible(sgd, sparse, [w])
    # lr / scale underflows in float16.
    half = keras.Variable(np.ones((2,), "float16"), dtype="float16", name="half")
    assert not _folded_unscale.eligible(built(keras.optimizers.SGD(0.1), [half]), g, [half])
    # An SGD that was never built by a LossScaleOptimizer has no fold installed.
    assert not _folded_unscale.eligible(keras.optimizers.SGD(0.1), g, [w])


def test_fold_is_not_used_when_the_scale_may_fall_below_one(run_mode):
    # With 1/scale > 1 the unscaled gradient can overflow although the scaled
    # one is finite; only an explicit unscale, checked, catches it.
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        tfdls.DynamicLossScale(initial_loss_scale=0.5, min_loss_scale=2.0**-4),
    )
    opt.build(variables)
    step = run_mode(lambda grads: opt.apply(grads, variables))
    before = _bits(variables)
    step([tf.fill([4, 3], 3e38), tf.zeros([3])])  # 3e38 / 0.5 is inf
    assert _bits(variables) == before
    assert float(opt.loss_scale().numpy()) == 0.25
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 1


def test_fold_under_mirrored_strategy_while_the_scale_grows(mirrored_strategy):
    strategy = mirrored_strategy
    results = []
    for sgd_class in (keras.optimizers.SGD, _UnfoldedSGD):
        with strategy.scope():
            variables = _variables()
            opt = tfdls.LossScaleOptimizer(
                sgd_class(0.1, momentum=0.9),
                tfdls.DynamicLossScale(initial_loss_scale=2.0**4, increment_period=1),
            )
            opt.build(variables)

        @tf.function
        def train_step(grads):
            strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

        for i in range(3):
            train_step(_scaled_grads(i, float(opt.loss_scale().numpy())))
        replicas = [
            [np.asarray(c).tobytes() for c in strategy.experimental_local_results(v.value)]
            for v in variables
        ]
        for copies in replicas:
            assert copies[0] == copies[1]
        results.append([copies[0] for copies in replicas])
    assert results[0] == results[1]


# -- the XLA-compiled apply ---------------------------------------------------------------


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


def _grad_specs():
    return [tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([3], tf.float32)]


@pytest.mark.parametrize(
    "make_inner, jit_compile, clusters",
    [
        (lambda: keras.optimizers.Adam(1e-2), "auto", 1),
        (lambda: keras.optimizers.SGD(0.1), "auto", 1),
        (lambda: keras.optimizers.Adam(1e-2), False, 0),
        # Weight decay writes variables outside the masked update: auto keeps
        # the plain graph, True compiles it anyway (with a tf.cond inside).
        (lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1), "auto", 0),
        (lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1), True, 1),
    ],
    ids=["adam-auto", "sgd-auto", "adam-off", "adamw-auto", "adamw-on"],
)
def test_which_graph_steps_compile_the_apply(make_inner, jit_compile, clusters):
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(make_inner(), jit_compile=jit_compile)
    opt.build(variables)
    assert _xla_clusters(lambda g: opt.apply(g, variables), _grad_specs()) == clusters


def test_auto_does_not_compile_a_fixed_scale_or_inside_xla():
    variables = _variables()
    fixed = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), loss_scale=2.0**8)
    fixed.build(variables)
    assert _xla_clusters(lambda g: fixed.apply(g, variables), _grad_specs()) == 0
    dynamic = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    dynamic.build(variables)

    @tf.function(jit_compile=True)
    def xla_step(grads):  # already one cluster: nothing nested
        dynamic.apply(grads, variables)

    assert _xla_clusters(xla_step, _grad_specs()) == 0


@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_no_compiled_apply_under_a_strategy(mirrored_strategy, jit_compile):
    # Replicas agree through merge calls, which an XLA cluster cannot hold.
    with mirrored_strategy.scope():
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), jit_compile=jit_compile)
        opt.build(variables)

    def train_step(grads):
        mirrored_strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

    assert _xla_clusters(train_step, _grad_specs()) == 0


@pytest.mark.parametrize("inner", ["adam", "sgd", "adamw"])
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


def test_compiled_apply_still_raises_a_stuck_scale_in_step():
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(),
        tfdls.DynamicLossScale(initial_loss_scale=1.0, min_loss_scale=1.0),
        min_scale_policy="raise",
    )
    opt.build(variables)
    step = tf.function(lambda g: opt.apply(g, variables))
    assert _xla_clusters(lambda g: opt.apply(g, variables), _grad_specs()) == 1
    with pytest.raises(Exception, match="loss scale is at its minimum") as info:
        step([tf.fill([4, 3], NAN), tf.ones([3])])
    assert "LossScaleStuckError" in str(info.value)
    assert "w" in str(info.value)


@pytest.mark.parametrize("value", ["auto", True, False])
def test_jit_compile_round_trips_through_config(value):
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), jit_compile=value)
    config = opt.get_config()
    assert config["jit_compile"] == value
    assert tfdls.LossScaleOptimizer.from_config(config).jit_compile == value


@pytest.mark.parametrize("value", ["yes", None, 1])
def test_bad_jit_compile(value):
    with pytest.raises(ValueError, match=r"jit_compile=.*" + repr(value)[:3]):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), jit_compile=value)
