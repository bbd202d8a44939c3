"""Scale boundaries (per-layer loss scales): the layer, the map, placement, exactness, adaptation.

Exactness is checked two ways: against the same model without boundaries
(power-of-two factors commute with every float16 operation as long as
nothing overflows or underflows, so with integer data the update is
bit-identical), and against a float64 reference of the true gradients.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tfdls import boundaries as boundaries_lib
from tfdls.boundaries import step as _boundary_scales

from tests.support.keras_optimizers import EXPORTED, make_optimizer

# The fast loop (-m "not slow") runs graph mode; CI runs all three.
MODES = [pytest.param("eager", marks=pytest.mark.slow), "graph",
         pytest.param("xla", marks=pytest.mark.slow)]
FAST_CLASSES = ("Adam", "SGD")


# -- helpers ---------------------------------------------------------------------------


def dense_stack(depth, width=4, activation=None, seed=0, integer=False, out=1):
    keras.utils.set_random_seed(seed)
    init = "glorot_uniform"
    if integer:
        init = keras.initializers.RandomUniform(-1.5, 1.5, seed=seed)
    layers = [keras.Input((width,))]
    for i in range(depth - 1):
        layers.append(keras.layers.Dense(width, activation=activation, kernel_initializer=init,
                                         name=f"d{i}"))
    layers.append(keras.layers.Dense(out, kernel_initializer=init, name=f"d{depth - 1}",
                                     dtype="float32" if not integer else None))
    model = keras.Sequential(layers)
    if integer:
        for v in model.trainable_variables:
            v.assign(np.round(v.numpy()))
    return model


def copy_weights(source, target):
    for s, t in zip(source.trainable_variables, target.trainable_variables):
        t.assign(s.numpy())


def train_steps(model, optimizer, batches, mode, loss_fn=None):
    """Runs `optimizer` on `model` for each (x, y) batch: scale_loss, tape, apply."""
    loss_fn = loss_fn or (lambda y, p: tf.reduce_mean(tf.square(tf.cast(p, tf.float32) - y)))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(loss_fn(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    for x, y in batches:
        step(tf.constant(x), tf.constant(y))


def record_factors(boundaries):
    """What a backward pass through `boundaries` records: the exponents in force. Drawn
    gradients given to `apply` stand for gradients a backward pass multiplied by the
    factors assigned by hand; `apply` divides by the recorded ones (`tfdls._record`)."""
    for boundary in boundaries:
        boundary._ownership.recorded_exponent.assign(boundary.exponent())


def values(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def integer_batches(n, width=3, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 2, (8, width)).astype("float32"),
             rng.integers(-2, 3, (8, 1)).astype("float32")) for _ in range(n)]


def pinned(k):
    """Keyword arguments of a boundary whose factor stays 2**k."""
    return dict(initial_log2_factor=k, min_log2_factor=k, max_log2_factor=k)


# -- the layer -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("exponent", [-3, 0, 5])
def test_boundary_is_an_identity_whose_gradient_is_scaled(dtype, exponent):
    boundary = tfdls.ScaleBoundary(**pinned(exponent))
    boundaries_lib.record_factors([boundary])  # as its owner's scale_loss does
    x = tf.constant(np.random.default_rng(0).normal(size=(3, 5)), dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = boundary(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.range(5, dtype=tf.float32))
    grad = tape.gradient(loss, x)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    expected = np.broadcast_to(np.arange(5, dtype=np.float64) * 2.0**exponent, (3, 5))
    np.testing.assert_array_equal(grad.numpy().astype(np.float64), expected)


def test_boundary_multiplies_by_the_factor_scale_loss_recorded():
    """The backward pass reads, when it runs, the factor its owner's last scale_loss
    recorded (`record_factors`); a factor changed since takes effect at the next one."""
    boundary = tfdls.ScaleBoundary(max_log2_factor=15)
    x = tf.ones([2])

    def input_gradient():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(boundary(x))
        return tape.gradient(y, x).numpy().tolist()

    recorded = 0
    for exponent in (0, 7, 15):
        boundary.log2_factor.assign(float(exponent))
        assert input_gradient() == [2.0**recorded] * 2  # not yet recorded
        boundaries_lib.record_factors([boundary])
        recorded = exponent
        assert input_gradient() == [2.0**exponent] * 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_log2_factor=16), "max_log2_factor=16"),
        (dict(min_log2_factor=-15), "min_log2_factor=-15"),
        (dict(min_log2_factor=3, max_log2_factor=2), "min_log2_factor=3"),
        (dict(initial_log2_factor=9, max_log2_factor=8), "initial_log2_factor=9"),
        (dict(initial_log2_factor=1.5), "initial_log2_factor=1.5"),
        (dict(adjust_period=0), "adjust_period=0"),
        (dict(margin_bits=float("nan")), "margin_bits=nan"),
    ],
)
def test_bad_boundary_arguments_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tfdls.ScaleBoundary(**kwargs)


def test_boundary_config_round_trip():
    boundary = tfdls.ScaleBoundary(initial_log2_factor=2, min_log2_factor=-1,
                                   max_log2_factor=9, adjust_period=7, margin_bits=0.5,
                                   name="b")
    clone = tfdls.ScaleBoundary.from_config(boundary.get_config())
    assert clone.get_config() == boundary.get_config()


# -- reading a model: the map ---------------------------------------------------------


def test_sequential_chains_nearest_first():
    model = tfdls.add_scale_boundaries(dense_stack(5), every=1)
    names = [layer.name for layer in model.layers]
    assert names == ["unscaled_input", "d0", "scale_boundary_2", "d1", "scale_boundary_4", "d2",
                     "scale_boundary_6", "d3", "scale_boundary_8", "d4"]
    found = boundaries_lib.read_boundaries(model)
    # Parents first: the top boundary has no parent.
    assert [b.name for b in found.boundaries] == [
        "scale_boundary_8", "scale_boundary_6", "scale_boundary_4", "scale_boundary_2"]
    assert found.parents == (-1, 0, 1, 2)
    by_layer = {v.path.split("/")[-2]: found.chain_of(v) for v in model.trainable_variables}
    assert by_layer == {"d0": (3, 2, 1, 0), "d1": (2, 1, 0), "d2": (1, 0), "d3": (0,), "d4": ()}


def residual_model(boundary_inside):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="stem")(tfdls.UnscaledInput()(inputs))
    branch = keras.layers.Dense(4, name="branch")(h)
    if boundary_inside:
        branch = tfdls.ScaleBoundary(name="inside")(branch)
    h = keras.layers.Add(name="add")([h, branch])
    if not boundary_inside:
        h = tfdls.ScaleBoundary(name="after_add")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inputs, outputs)


def test_residual_around_a_boundary_is_refused_naming_the_layers():
    with pytest.raises(ValueError, match=r"layer 'stem'.*\['inside'\]"):
        boundaries_lib.read_boundaries(residual_model(boundary_inside=True))
    found = boundaries_lib.read_boundaries(residual_model(boundary_inside=False))
    chains = {v.path.split("/")[-2]: found.chain_of(v)
              for v in residual_model(False).trainable_variables}
    assert set(chains.values()) == {None}  # another model's variables are unknown
    model = residual_model(False)
    found = boundaries_lib.read_boundaries(model)
    assert {v.path.split("/")[-2]: found.chain_of(v) for v in model.trainable_variables} == {
        "stem": (0,), "branch": (0,), "head": ()}


def test_optimizer_refuses_a_mixed_model_at_construction():
    with pytest.raises(ValueError, match="residual connection"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(),
                                 scale_boundaries=residual_model(boundary_inside=True))


def test_regularizer_below_a_boundary_is_refused():
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, kernel_regularizer="l2", name="reg"),
        tfdls.ScaleBoundary(name="b"),
        keras.layers.Dense(1, name="head", kernel_regularizer="l2"),
    ])
    with pytest.raises(ValueError, match="layer 'reg' is below the scale boundary 'b'.*kernel_regularizer"):
        boundaries_lib.read_boundaries(model)


def test_boundary_inside_a_nested_layer_is_refused():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), tfdls.ScaleBoundary()],
                             name="inner")
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="'inner' contains a ScaleBoundary"):
        boundaries_lib.read_boundaries(outer)


def test_boundary_above_every_variable_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1), tfdls.ScaleBoundary()])
    with pytest.raises(ValueError, match="every trainable variable of the model is below"):
        boundaries_lib.read_boundaries(model)


def test_subclassed_model_is_refused():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match="scale_boundaries must be a Sequential or functional"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=Sub())


@pytest.mark.parametrize("loss_scale", [tfdls.FixedLossScale(2.0**10),
                                        tfdls.DynamicLossScale(3.0)])
def test_boundaries_need_a_power_of_two_dynamic_scale(loss_scale):
    model = tfdls.add_scale_boundaries(dense_stack(3))
    with pytest.raises(ValueError, match="needs a tfdls.DynamicLossScale whose values are powers"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale, scale_boundaries=model)


# -- automatic placement ----------------------------------------------------------------


def resnet_like():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(6, activation="relu", name="stem")(inputs)
    for block in range(3):
        branch = keras.layers.Dense(6, activation="relu", name=f"b{block}_1")(h)
        branch = keras.layers.Dense(6, name=f"b{block}_2")(branch)
        h = keras.layers.Add(name=f"add{block}")([h, branch])
    outputs = keras.layers.Dense(2, name="head")(h)
    return keras.Model(inputs, outputs)


def test_functional_placement_goes_only_where_every_path_passes():
    model = resnet_like()
    placed = tfdls.add_scale_boundaries(model, every=1)
    found = boundaries_lib.read_boundaries(placed)  # would raise if paths mixed
    # After the stem and after each residual add but the last (the head is above).
    producers = sorted(
        node.operation.name for b in found.boundaries for node in b._inbound_nodes
        for node in [node.input_tensors[0]._keras_history.operation._inbound_nodes[0]]
    )
    assert producers == ["add0", "add1", "add2", "stem"]
    x = np.random.default_rng(0).normal(size=(5, 6)).astype("float32")
    np.testing.assert_array_equal(placed(x).numpy(), model(x).numpy())
    assert all(a is b for a, b in zip(placed.trainable_variables, model.trainable_variables))


@pytest.mark.parametrize("every, expected", [(1, 5), (2, 2), (3, 1), (5, 1)])
def test_sequential_placement_every(every, expected):
    placed = tfdls.add_scale_boundaries(dense_stack(6), every=every)
    assert sum(isinstance(layer, tfdls.ScaleBoundary) for layer in placed.layers) == expected
    assert not isinstance(placed.layers[-1], tfdls.ScaleBoundary)


def test_placement_refuses_an_unbuilt_model_and_no_place():
    unbuilt = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="needs a built model"):
        tfdls.add_scale_boundaries(unbuilt)
    with pytest.raises(ValueError, match="found no place for a boundary.*every=6"):
        tfdls.add_scale_boundaries(dense_stack(6), every=6)


@pytest.mark.parametrize("every", [0, 1.5, True])
def test_bad_every(every):
    with pytest.raises(ValueError, match=f"every={every!r}"):
        tfdls.add_scale_boundaries(dense_stack(3), every=every)


# -- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factors", ["one", "pinned"])
def test_update_is_bit_identical_to_the_model_without_boundaries(mode, factors):
    """Integer data: every float16 value is exact, so a power-of-two factor
    changes no bit of the divided gradient, and the update must equal the
    plain model's exactly. A factor not divided out (or divided twice) would
    change the update by that factor."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    batches = integer_batches(4)
    plain = dense_stack(4, width=3, integer=True)
    start = values(plain)
    reference = tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-6),
                                         tfdls.DynamicLossScale(1.0))
    train_steps(plain, reference, batches, mode)

    boundaries = tfdls.add_scale_boundaries(dense_stack(4, width=3, integer=True), every=1,
                                            **pinned(0 if factors == "one" else 1))
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-6),
                                         tfdls.DynamicLossScale(1.0),
                                         scale_boundaries=boundaries)
    train_steps(boundaries, optimizer, batches, mode)
    for opt in (reference, optimizer):
        assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    assert all(np.any(a != b) for a, b in list(zip(start, values(plain)))[::2])  # kernels moved
    exact = mode != "xla" or _TF_VERSION >= (2, 21)
    for a, b in zip(values(plain), values(boundaries)):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            # TensorFlow 2.16's XLA rounds fused float16 ops differently once
            # the graph changes (its plain model already differs from graph
            # mode from the second step); a factor wrongly divided would be off
            # by a power of two, far outside float16 rounding.
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-4)


_TF_VERSION = tuple(int(p) for p in tf.__version__.split(".")[:2])


def _plain_and_bounded(prepare):
    """Trains the plain stack and the stack with pinned boundaries (2**1) on
    integer data in graph mode, after `prepare(bounded_model)`; returns both
    models' values."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    batches = integer_batches(3)
    plain = dense_stack(4, width=3, integer=True)
    train_steps(plain, tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-6),
                                                tfdls.DynamicLossScale(1.0)), batches, "graph")
    bounded = tfdls.add_scale_boundaries(dense_stack(4, width=3, integer=True), every=1,
                                         **pinned(1))
    optimizer = prepare(bounded)
    train_steps(bounded, optimizer, batches, "graph")
    assert int(optimizer.loss_scale.num_skipped_steps.numpy()) == 0
    return values(plain), values(bounded)


def test_hand_assigned_fractions_are_read_the_same_backward_and_in_the_division():
    # d0 is below three boundaries: 3 * 1.5 = 4.5 would divide by 2**4 what
    # the backward passes multiplied by 2**3 (each truncated to 1).
    def prepare(model):
        for layer in model.layers:
            if isinstance(layer, tfdls.ScaleBoundary):
                layer.log2_factor.assign(1.5)
        return tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-6),
                                        tfdls.DynamicLossScale(1.0), scale_boundaries=model)

    for a, b in zip(*_plain_and_bounded(prepare)):
        np.testing.assert_array_equal(a, b)


def test_a_layer_unfrozen_after_the_optimizer_read_the_model_trains_exactly():
    def prepare(model):
        model.get_layer("d0").trainable = False
        optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-6),
                                             tfdls.DynamicLossScale(1.0), scale_boundaries=model)
        model.get_layer("d0").trainable = True
        return optimizer

    for a, b in zip(*_plain_and_bounded(prepare)):
        np.testing.assert_array_equal(a, b)


def test_a_variable_the_optimizer_was_not_built_with_is_named():
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    optimizer.build(model.trainable_variables)
    stranger = keras.Variable(np.ones([2], "float32"), name="stranger")
    with pytest.raises(ValueError, match="'stranger' is not one this optimizer was built with"):
        optimizer.apply([tf.ones([2])], [stranger])


class AddsLoss(keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            self.add_loss(1e-3 * tf.reduce_mean(tf.square(tf.cast(x, tf.float32))))
        return x


@pytest.mark.parametrize("where", ["below", "above"])
def test_a_loss_added_below_a_boundary_is_refused_above_it_trains(where):
    layers = [keras.Input((4,)), tfdls.UnscaledInput(), keras.layers.Dense(4, name="d0")]
    layers += [AddsLoss(name="adds")] if where == "below" else []
    layers += [tfdls.ScaleBoundary(name="b"), keras.layers.Dense(4, name="d1")]
    layers += [AddsLoss(name="adds")] if where == "above" else []
    model = keras.Sequential(layers + [keras.layers.Dense(1, name="d2")])
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.predict(x, verbose=0)  # a call without the loss first: the check reads the last call
    if where == "below":
        with pytest.raises(ValueError, match="layer 'adds' is below the scale boundary 'b'"):
            model.fit(x, y, verbose=0)
    else:
        model.fit(x, y, verbose=0)
        assert int(optimizer.iterations.numpy()) == 1


def _shared_layer_model(boundary=False, twice_in_a_row=False):
    """a -> shared -> b -> shared -> head (or a -> shared -> shared -> head), optionally
    with a boundary placed by hand between the two calls of `shared`."""
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    h = shared(keras.layers.Dense(4, name="a")(inputs))
    if boundary:
        h = tfdls.ScaleBoundary(name="between")(h)
    h = shared(h if twice_in_a_row else keras.layers.Dense(4, name="b")(h))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def test_a_layer_shared_below_different_boundaries_is_refused_by_name():
    with pytest.raises(ValueError, match="layer 'shared' is called at more than one place"):
        boundaries_lib.read_boundaries(_shared_layer_model(boundary=True))


@pytest.mark.parametrize("twice_in_a_row", [False, True])
def test_placement_never_cuts_between_two_calls_of_one_layer(twice_in_a_row):
    """add_scale_boundaries leaves out the cuts between the calls (where its own check
    would refuse the boundary it placed) and keeps the others: after `a` and above the
    second call."""
    model = _shared_layer_model(twice_in_a_row=twice_in_a_row)
    placed = tfdls.add_scale_boundaries(model, every=1)
    found = boundaries_lib.read_boundaries(placed)
    below = sorted(node.input_tensors[0]._keras_history.operation.name
                   for b in found.boundaries for node in b._inbound_nodes)
    assert below == ["a", "shared"]
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    np.testing.assert_array_equal(placed(x).numpy(), model(x).numpy())


@pytest.mark.parametrize(
    "name", [n if n in FAST_CLASSES else pytest.param(n, marks=pytest.mark.slow) for n in EXPORTED]
)
def test_factors_at_one_are_bit_identical_for_every_optimizer_class(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(3)
    batches = [(rng.normal(size=(8, 4)).astype("float32"),
                rng.normal(size=(8, 1)).astype("float32")) for _ in range(3)]
    plain = dense_stack(3, activation="tanh")
    boundaries = tfdls.add_scale_boundaries(dense_stack(3, activation="tanh"), every=1,
                                            **pinned(0))
    runs = []
    for model in (plain, boundaries):
        optimizer = tfdls.LossScaleOptimizer(
            make_optimizer(name, "d0/kernel", learning_rate=0.01),
            scale_boundaries=model if model is boundaries else None,
        )
        train_steps(model, optimizer, batches, "graph")
        runs.append(values(model) + [v.numpy() for v in optimizer.inner_optimizer.variables])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


class RecordingSGD(keras.optimizers.SGD):
    """Keeps the gradients it was given (a subclass: tfdls skips it with a cond)."""

    def build(self, variables):
        super().build(variables)
        self.recorded = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                         for v in variables]

    def apply(self, grads, trainable_variables=None):
        for slot, grad in zip(self.recorded, grads):
            slot.assign(grad)
        super().apply(grads, trainable_variables)


def attenuated_model(with_boundaries=False, depth=3, attenuation=2.0**-10, seed=0):
    """Tanh layers, each followed by a fixed gradient attenuation (the forward
    value passes): the gradient shrinks by `attenuation` per layer on its way
    down, as in a network with vanishing gradients. With boundaries, one
    pinned at 1 / attenuation after each layer."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = tfdls.UnscaledInput()(inputs) if with_boundaries else inputs
    for i in range(depth):
        h = keras.layers.Dense(8, activation="tanh", name=f"low{i}")(h)
        if with_boundaries:
            h = tfdls.ScaleBoundary(**pinned(int(-math.log2(attenuation))), name=f"b{i}")(h)
        h = keras.layers.Lambda(
            lambda t: t * attenuation + tf.stop_gradient(t) * (1 - attenuation),
            name=f"attenuate{i}")(h)
    outputs = keras.layers.Dense(1, name="head", dtype="float32")(h)
    return keras.Model(inputs, outputs)


def float64_gradients(model, x, y):
    """The true gradients: the same weights and graph, in float64."""
    keras.mixed_precision.set_global_policy("float64")
    try:
        clone = attenuated_model()
        for s, t in zip(model.trainable_variables, clone.trainable_variables):
            t.assign(s.numpy().astype("float64"))
        x64, y64 = tf.constant(x, tf.float64), tf.constant(y, tf.float64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(clone(x64), tf.float64) - y64))
        return [g.numpy() for g in tape.gradient(loss, clone.trainable_variables)]
    finally:
        keras.mixed_precision.set_global_policy("mixed_float16")


@pytest.mark.parametrize("mode", MODES)
def test_applied_gradient_matches_float64_where_the_global_scale_loses_it(mode):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    results = {}
    for kind in ("global", "boundaries"):
        model = attenuated_model(with_boundaries=kind == "boundaries")
        inner = RecordingSGD(0.0)
        optimizer = tfdls.LossScaleOptimizer(
            inner, tfdls.DynamicLossScale(2.0**10, increment_period=10**6),
            scale_boundaries=model if kind == "boundaries" else None)
        train_steps(model, optimizer, [(x, y)], mode)
        reference = float64_gradients(model, x, y)
        errors = []
        for got, want in zip(inner.recorded, reference):
            got = got.numpy().astype(np.float64)
            errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
        results[kind] = errors
    # Global scale: the first layer's scaled gradient sits near 2**-20 * 2**10 * 0.1,
    # among float16's smallest subnormals: most of its bits are lost.
    assert min(results["global"][0:2]) > 0.05, results
    # With the boundaries every layer's is a normal float16: float16 rounding only.
    assert max(results["boundaries"]) < 5e-3, results


# -- adaptation ----------------------------------------------------------------------------


def reference_update(exponents, parents, mins, maxs, margins, segment_bad, segment_exponent,
                     is_finite, due):
    """The algorithm of ScaleBoundary's docstring, in plain Python."""
    count = len(exponents)

    def chain(k):
        found = []
        while k >= 0:
            found.append(k)
            k = parents[k]
        return found

    new = list(exponents)
    if not is_finite:
        lower = [False] * count
        global_shrinks = segment_bad[0]
        for segment in range(1, count + 1):
            if not segment_bad[segment]:
                continue
            for k in chain(segment - 1):
                if exponents[k] > mins[k]:
                    lower[k] = True
                    break
            else:
                global_shrinks = True
        return [e - 1 if lo else e for e, lo in zip(exponents, lower)], global_shrinks
    totals = [sum(exponents[i] for i in chain(k)) for k in range(count)]
    new_totals = {-1: 0}
    for k in range(count):
        parent_total = new_totals[parents[k]]
        top, mine = segment_exponent[0], segment_exponent[k + 1]
        if math.isfinite(top) and math.isfinite(mine):
            target = totals[k] + math.floor(top - mine - margins[k])
        else:
            target = parent_total + exponents[k]
        adjusted = min(max(target - parent_total, mins[k]), maxs[k])
        if due[k]:
            new[k] = adjusted
        new_totals[k] = parent_total + new[k]
    return new, False


@pytest.fixture(scope="module")
def hypothesis():
    return pytest.importorskip("hypothesis")


@pytest.mark.parametrize("mode,levels", [("eager", "unrolled"), ("xla", "unrolled"),
                                         ("eager", "loop"), ("graph", "loop"),
                                         ("xla", "loop")])
def test_adaptation_matches_the_written_algorithm(hypothesis, mode, levels, monkeypatch):
    """Drawn trees of up to 8 boundaries against the reference, with their nesting levels
    unrolled (as up to `UNROLLED_LEVELS`) and in a tf.while_loop (as deeper chains)."""
    from hypothesis import given, settings, strategies as st

    if levels == "loop":
        monkeypatch.setattr(_boundary_scales, "UNROLLED_LEVELS", 0)

    @settings(max_examples=60 if mode == "eager" else 20, deadline=None)
    @given(st.data())
    def check(data):
        count = data.draw(st.integers(1, 8))
        parents = [-1] + [data.draw(st.integers(-1, k - 1)) for k in range(1, count)]
        mins = [data.draw(st.integers(-3, 2)) for _ in range(count)]
        maxs = [m + data.draw(st.integers(0, 8)) for m in mins]
        exponents = [data.draw(st.integers(lo, hi)) for lo, hi in zip(mins, maxs)]
        margins = [data.draw(st.sampled_from([0.0, 1.0, 1.5])) for _ in range(count)]
        bad = [data.draw(st.booleans()) for _ in range(count + 1)]
        is_finite = not any(bad) if data.draw(st.booleans()) else True
        if is_finite:
            bad = [False] * (count + 1)
        seg_exp = [data.draw(st.sampled_from([-float("inf"), -30.0, -12.0, -3.0, 0.0, 4.0, 9.0]))
                   for _ in range(count + 1)]
        due = [data.draw(st.booleans()) for _ in range(count)]

        class FakeMap:
            pass

        fake = FakeMap()
        fake.parents = tuple(parents)
        layers = []
        for k in range(count):
            b = tfdls.ScaleBoundary(initial_log2_factor=exponents[k], min_log2_factor=mins[k],
                                    max_log2_factor=maxs[k], margin_bits=margins[k],
                                    adjust_period=1 if due[k] else 10**6)
            layers.append(b)
        scales = _boundary_scales.BoundaryScales.__new__(_boundary_scales.BoundaryScales)
        tf.Module.__init__(scales)
        scales.map = fake
        scales.boundaries = tuple(layers)
        scales.lowered = tf.Variable(np.zeros([count], np.bool_))
        def update():
            exponent_vector = tf.constant([float(e) for e in exponents])
            return scales.update(
                exponent_vector, scales.totals(exponent_vector), tf.constant(is_finite),
                tf.constant(bad), tf.constant(seg_exp, tf.float32), tf.constant(3, tf.int64),
            )

        if mode != "eager":
            update = tf.function(update, jit_compile=mode == "xla")
        global_shrinks = update()
        want, want_global = reference_update(exponents, parents, mins, maxs, margins, bad,
                                             seg_exp, is_finite, due)
        got = [float(b.log2_factor.numpy()) for b in layers]
        assert got == [float(w) for w in want]
        assert bool(global_shrinks.numpy()) == bool(want_global)

    check()



@pytest.mark.parametrize("count", [12, 32])
def test_deeply_nested_boundaries_compile_in_linear_time(count):
    """32 nested boundaries (a chain, as `add_scale_boundaries(every=1)` places them)
    adapt exactly under XLA, and compile in seconds: the levels of the placement
    once fused into one XLA loop whose code doubled with each level (20 nested
    boundaries took minutes and gigabytes, 24 ran out of memory). 12 levels are
    unrolled, 32 placed in a tf.while_loop (`UNROLLED_LEVELS`)."""
    import time

    assert 12 <= _boundary_scales.UNROLLED_LEVELS < 32
    parents = list(range(-1, count - 1))
    mins, maxs = [-2] * count, [6] * count
    exponents = [(3 * k) % 9 - 2 for k in range(count)]
    margins = [1.0] * count
    # Blocks far below and far above the top, and some with no largest element,
    # so that moves are clipped at both bounds and some boundaries keep theirs.
    seg_exp = [0.0] + [[-9.0, 5.0, -float("inf"), -3.0][k % 4] for k in range(count)]
    bad = [False] * (count + 1)

    class FakeMap:
        pass

    fake = FakeMap()
    fake.parents = tuple(parents)
    layers = [tfdls.ScaleBoundary(initial_log2_factor=e, min_log2_factor=lo, max_log2_factor=hi,
                                  margin_bits=m, adjust_period=1)
              for e, lo, hi, m in zip(exponents, mins, maxs, margins)]
    scales = _boundary_scales.BoundaryScales.__new__(_boundary_scales.BoundaryScales)
    tf.Module.__init__(scales)
    scales.map = fake
    scales.boundaries = tuple(layers)
    scales.lowered = tf.Variable(np.zeros([count], np.bool_))

    # Arguments, not constants, which XLA would fold.
    @tf.function(jit_compile=True)
    def update(exponent_vector, segment_exponent):
        return scales.update(
            exponent_vector, scales.totals(exponent_vector), tf.constant(True),
            tf.constant(bad), segment_exponent, tf.constant(3, tf.int64),
        )

    start = time.perf_counter()
    update(tf.constant([float(e) for e in exponents]), tf.constant(seg_exp, tf.float32))
    elapsed = time.perf_counter() - start
    want, _ = reference_update(exponents, parents, mins, maxs, margins, bad, seg_exp, True,
                               [True] * count)
    assert [float(b.log2_factor.numpy()) for b in layers] == [float(w) for w in want]
    assert want != exponents  # the case moves boundaries
    assert elapsed < 60, f"tracing and compiling 32 nested levels took {elapsed:.0f} s"


def test_nesting_levels_share_one_parent_mask():
    """The placement's levels read one (count + 1)**2 parent mask, made once per trace:
    a numpy bool array converts element by element, so one mask per level cost
    count**3 at trace time (a 200-deep chain spent about 25 s converting them)."""
    count = 24
    layers = [tfdls.ScaleBoundary() for _ in range(count)]
    scales = _boundary_scales.BoundaryScales.__new__(_boundary_scales.BoundaryScales)
    tf.Module.__init__(scales)
    scales.map = type("FakeMap", (), {"parents": tuple(range(-1, count - 1))})()
    scales.boundaries = tuple(layers)
    scales.lowered = tf.Variable(np.zeros([count], np.bool_))
    assert scales._tree.depth == count

    @tf.function
    def update(exponents, segment_exponent):
        return scales.update(exponents, scales.totals(exponents), tf.constant(True),
                             tf.zeros([count + 1], tf.bool), segment_exponent,
                             tf.constant(0, tf.int64))

    graph = update.get_concrete_function(
        tf.TensorSpec([count], tf.float32), tf.TensorSpec([count + 1], tf.float32)).graph
    masks = [op for op in graph.get_operations() if op.type == "Const"
             and op.get_attr("dtype") == tf.bool
             and op.outputs[0].shape.as_list() == [count + 1, count + 1]]
    assert len(masks) == 1, len(masks)

def crafted_step(optimizer, model, magnitudes):
    """Applies gradients whose elements are all `magnitudes[layer]` (per kernel and bias)."""
    grads = []
    for v in model.trainable_variables:
        layer = v.path.split("/")[-2]
        grads.append(tf.fill(v.shape, tf.constant(magnitudes[layer], v.dtype)))
    optimizer.apply(grads, model.trainable_variables)


def snapshot(model, optimizer):
    return ([v.numpy().copy() for v in model.trainable_variables]
            + [v.numpy().copy() for v in optimizer.inner_optimizer.variables]
            + [optimizer.iterations.numpy()])


# "compiled_apply": graph mode, the apply compiled as an XLA cluster of its own, which
# reads the factors before it and writes the new ones after it (`tfdls._step.run_compiled`).
@pytest.mark.parametrize("mode", MODES + ["compiled_apply"])
def test_overflow_below_a_boundary_lowers_it_and_skips_exactly(mode):
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1, initial_log2_factor=3,
                                       min_log2_factor=0)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.Adam(0.1), tfdls.DynamicLossScale(2.0**10),
                                         scale_boundaries=model,
                                         jit_compile=True if mode == "compiled_apply" else "auto")
    b_low, b_top = [layer for layer in model.layers if isinstance(layer, tfdls.ScaleBoundary)]

    def step(magnitudes):
        fn = lambda: crafted_step(optimizer, model, magnitudes)  # noqa: E731
        if mode != "eager":
            fn = tf.function(fn, jit_compile=mode == "xla")
        fn()
        assert optimizer.step_plan.compile == (mode == "compiled_apply")

    finite = {"d0": 1.0, "d1": 1.0, "d2": 1.0}
    step(finite)  # builds; first adjustment
    before = snapshot(model, optimizer)
    factors = (b_low.log2_factor.numpy(), b_top.log2_factor.numpy())
    scale = optimizer.loss_scale().numpy()
    step({**finite, "d0": float("inf")})
    for a, b in zip(before, snapshot(model, optimizer)):
        np.testing.assert_array_equal(a, b)
    assert b_low.log2_factor.numpy() == factors[0] - 1
    assert b_top.log2_factor.numpy() == factors[1]
    assert optimizer.loss_scale().numpy() == scale
    assert int(optimizer.loss_scale.num_skipped_steps.numpy()) == 1
    report = optimizer.last_overflow()
    assert report.boundaries == (b_low.name,)
    assert b_low.name in str(report)
    # At its minimum, the next boundary up answers; then the global scale.
    b_low.log2_factor.assign(0.0)
    b_top.log2_factor.assign(0.0)
    step({**finite, "d0": float("nan")})
    assert b_low.log2_factor.numpy() == 0.0 and b_top.log2_factor.numpy() == 0.0
    assert optimizer.loss_scale().numpy() == scale / 2
    assert optimizer.last_overflow().boundaries == ()
    # An overflow above every boundary: the global scale, no boundary.
    b_top.log2_factor.assign(2.0)
    step({**finite, "d2": float("inf")})
    assert b_top.log2_factor.numpy() == 2.0
    assert optimizer.loss_scale().numpy() == scale / 4


@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_headroom_adjustment_in_a_real_step(jit_compile):
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1, margin_bits=1.0)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.0), tfdls.DynamicLossScale(2.0**10),
                                         scale_boundaries=model, jit_compile=jit_compile)
    b_low, b_top = [layer for layer in model.layers if isinstance(layer, tfdls.ScaleBoundary)]
    # Largest scaled elements: top 2**3 * 1.5, middle 2**-4, low 2**-9 * 1.2.
    tf.function(lambda: crafted_step(optimizer, model,
                                     {"d2": 12.0, "d1": 2.0**-4, "d0": 2.0**-9 * 1.2}))()
    assert optimizer.step_plan.compile == (jit_compile is True)
    # Top moves its block from exponent -4 to 3 - 1 = 2: +6; the low block
    # from -9 to 2: +11 in total, 5 of them its own.
    assert b_top.log2_factor.numpy() == 6.0
    assert b_low.log2_factor.numpy() == 5.0


def test_no_branch_and_no_host_call_in_the_step():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = tfdls.add_scale_boundaries(dense_stack(4, activation="tanh"), every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.Adam(), scale_boundaries=model,
                                         jit_compile=False)
    x, y = tf.ones([4, 4]), tf.ones([4, 1])

    def body():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    step = tf.function(body)
    graph = step.get_concrete_function().graph
    types = []

    def collect(g):
        for op in g.get_operations():
            types.append(op.type)
        for f in g._functions.values():
            collect(f.graph) if hasattr(f, "graph") else None

    collect(graph)
    assert not {"If", "StatelessIf", "PyFunc", "EagerPyFunc", "While"} & set(types)
    assert "Mul" in types and "AssignVariableOp" in types  # the collector sees the step
    assert optimizer.step_plan.skip == "masked"
    # Under XLA: no conditional in the compiled step.
    hlo = tf.function(body, jit_compile=True).experimental_get_compiler_ir()(stage="hlo")
    assert hlo.count(" conditional(") == 0 and "multiply" in hlo


# -- the guard, saving, observability ------------------------------------------------------


def test_gradients_through_boundaries_the_optimizer_was_not_given_raise():
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1)
    batches = integer_batches(1, width=4)
    # Traced: any boundary the step crossed (owned or not: ownership is read
    # when the step runs, and another optimizer could take it later).
    with pytest.raises(ValueError, match=r"crossed the scale boundaries \['scale_boundary_2', 'scale_boundary_4'\]"):
        train_steps(model, tfdls.LossScaleOptimizer(keras.optimizers.SGD()), batches, "graph")
    # Eagerly an unowned boundary is an identity, so the update is right.
    before = values(model)
    train_steps(model, tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0)), batches, "eager")
    assert any((a != b).any() for a, b in zip(before, values(model)))
    # Once an optimizer owns the boundaries, every other one refuses the
    # variables below them, eagerly and traced.
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    for mode in ("eager", "graph"):
        with pytest.raises(ValueError, match=r"d0/kernel' is below the scale boundaries \['scale_boundary_2', 'scale_boundary_4'\]"):
            train_steps(model, tfdls.LossScaleOptimizer(keras.optimizers.SGD()), batches, mode)


def test_an_eager_gradient_never_applied_does_not_reach_another_optimizer():
    # CI drew this: an eager backward pass through owned boundaries, never
    # applied, then an unrelated optimizer's apply on unrelated variables.
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1)
    owner = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    x = tf.ones([2, 4])
    with tf.GradientTape() as tape:
        loss = owner.scale_loss(tf.reduce_sum(tf.cast(model(x), tf.float32)))
    tape.gradient(loss, model.trainable_variables)
    w = tf.Variable(1.0)
    other = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(4.0))
    other.apply([tf.constant(8.0)], [w])
    assert w.numpy() == -1.0


def test_fit_and_keras_file_round_trip(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    model = tfdls.add_scale_boundaries(dense_stack(4, activation="tanh"), every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-3), scale_boundaries=model,
                                         gradient_stats=True)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        callbacks=[tfdls.LossScaleMonitor()])
    factors = optimizer.scale_boundary_factors()
    assert set(factors) == {"scale_boundary_2", "scale_boundary_4", "scale_boundary_6"}
    assert any(f != 1.0 for f in factors.values())
    for name, factor in factors.items():
        assert history.history[f"boundary_factor/{name}"][-1] == factor
    stats = optimizer.gradient_stats()
    by_layer = {path.split("/")[-2]: s.boundary_factor for path, s in stats.items()
                if path.endswith("kernel")}
    # The factor each kernel's gradient carried on the last step: the product
    # of the boundaries above it (the factors were read before that step's update,
    # so compare what is fixed: the top has none, and the order of products).
    assert by_layer["d3"] == 1.0
    assert all(f >= 1.0 and math.log2(f) == int(math.log2(f)) for f in by_layer.values())

    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.get_config()["scale_boundaries"] is True
    with pytest.raises(ValueError, match="saved with scale boundaries"):
        loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    loaded.optimizer.set_scale_boundaries(loaded)
    assert loaded.optimizer.scale_boundary_factors() == factors
    # Continuing the loaded model equals continuing the original.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert loaded.optimizer.scale_boundary_factors() == optimizer.scale_boundary_factors()


def test_checkpoint_restores_the_factors(tmp_path):
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    for layer in model.layers:
        if isinstance(layer, tfdls.ScaleBoundary):
            layer.log2_factor.assign(4.0)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    for layer in model.layers:
        if isinstance(layer, tfdls.ScaleBoundary):
            layer.log2_factor.assign(0.0)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
    assert set(optimizer.scale_boundary_factors().values()) == {16.0}


@pytest.mark.parametrize("given", ["before_build", "after_build"])
def test_checkpoint_carries_the_boundaries_lowered_on_the_last_overflow(tmp_path, given):
    """The plug-in's own state (which boundaries the last overflow lowered, read by
    last_overflow()) is saved and restored, however the model was given."""
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD())
    if given == "before_build":
        optimizer.set_scale_boundaries(model)
        optimizer.build(model.trainable_variables)
    else:
        optimizer.build(model.trainable_variables)
        optimizer.set_scale_boundaries(model)
    lowered = optimizer._boundary_scales.lowered
    lowered.assign([True, False])
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    keys = [name for name, _ in tf.train.list_variables(path)]
    assert any("_boundary_scales/lowered" in k for k in keys), keys
    lowered.assign([False, False])
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path).assert_consumed()
    assert lowered.numpy().tolist() == [True, False]


def test_get_unscaled_gradients_needs_the_variables_and_divides_per_variable():
    model = tfdls.add_scale_boundaries(dense_stack(3, integer=True), every=1, **pinned(3))
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), tfdls.DynamicLossScale(2.0**4),
                                         scale_boundaries=model)
    grads = [tf.ones(v.shape) * 2.0**10 for v in model.trainable_variables]
    with pytest.raises(ValueError, match="trainable_variables=None"):
        optimizer.get_unscaled_gradients(grads)
    unscaled = optimizer.get_unscaled_gradients(grads, trainable_variables=model.trainable_variables)
    expected = {"d0": 2.0**(10 - 4 - 6), "d1": 2.0**(10 - 4 - 3), "d2": 2.0**(10 - 4)}
    for v, g in zip(model.trainable_variables, unscaled):
        assert set(np.unique(g.numpy())) == {expected[v.path.split("/")[-2]]}


def test_mirrored_strategy_is_exact_and_replicas_agree(mirrored_strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    batches = integer_batches(3)
    results = []
    for with_boundaries in (False, True):
        with mirrored_strategy.scope():
            model = dense_stack(4, width=3, integer=True)
            if with_boundaries:
                model = tfdls.add_scale_boundaries(model, every=1, **pinned(1))
            optimizer = tfdls.LossScaleOptimizer(
                keras.optimizers.SGD(2.0**-6), tfdls.DynamicLossScale(1.0),
                scale_boundaries=model if with_boundaries else None)

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    prediction = tf.cast(model(x, training=True), tf.float32)
                    loss = tf.reduce_sum(tf.square(prediction - y)) / 16.0
                    loss = optimizer.scale_loss(loss)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)

            mirrored_strategy.run(replica_step, args=(x, y))

        for x, y in batches:
            dataset = mirrored_strategy.experimental_distribute_values_from_function(
                lambda ctx, x=x, y=y: (x[ctx.replica_id_in_sync_group::2],
                                       y[ctx.replica_id_in_sync_group::2]))
            step(*dataset)
        results.append(values(model))
        if with_boundaries:
            for layer in model.layers:
                if isinstance(layer, tfdls.ScaleBoundary):
                    copies = {float(v.numpy()) for v in layer.log2_factor.value.values} \
                        if hasattr(layer.log2_factor.value, "values") else None
                    assert copies is None or len(copies) == 1
            assert any(f != 1.0 for f in optimizer.scale_boundary_factors().values())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_placement_goes_after_layers_without_weights():
    """Below the next layer with weights: after a residual add's activation, not between
    them (XLA would copy the multiply into the add's consumers)."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(6, name="stem")(inputs)
    branch = keras.layers.Dense(6, name="branch")(h)
    h = keras.layers.Add(name="add")([h, branch])
    h = keras.layers.Activation("relu", name="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    placed = tfdls.add_scale_boundaries(model).layers
    assert isinstance(placed[1], tfdls.UnscaledInput)
    names = [layer.name for layer in placed[2:]]
    assert names == ["stem", "scale_boundary_1", "branch", "add", "relu", "scale_boundary_2", "head"]
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, name="a"),
                                   keras.layers.Activation("relu", name="r"),
                                   keras.layers.Dropout(0.1, name="drop"),
                                   keras.layers.Dense(1, name="b")])
    names = [layer.name for layer in tfdls.add_scale_boundaries(sequential).layers]
    assert names[:4] == ["unscaled_input", "a", "r", "drop"] and names[-1] == "b"
    assert isinstance(tfdls.add_scale_boundaries(sequential).layers[4], tfdls.ScaleBoundary)


def test_drawn_models_and_call_styles_match_float64(hypothesis):
    """Drawn depth, boundary places and factors, loss scale, call style and mode:
    the gradient the inner optimizer receives equals the float64 true gradient
    within float16 rounding. A factor not divided out, or divided twice, is off
    by at least a factor of 2."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")

    def build(depth, places, policy):
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        h = tfdls.UnscaledInput()(inputs)
        for i in range(depth - 1):
            h = keras.layers.Dense(4, activation="tanh", name=f"h{i}")(h)
            if i in places:
                h = tfdls.ScaleBoundary(**pinned(places[i]), name=f"b{i}")(h)
        return keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(h))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(depth=st.integers(2, 4), data=st.data(),
           scale_bits=st.integers(0, 12), style=st.sampled_from(["keras", "tf_keras"]),
           mode=st.sampled_from(["eager", "graph"]))
    def check(depth, data, scale_bits, style, mode):
        places = {i: data.draw(st.integers(0, 6)) for i in range(depth - 1)
                  if data.draw(st.booleans())}
        model = build(depth, places, "mixed_float16")
        reference_model = build(depth, {}, "float64")
        for source, target in zip(model.trainable_variables, reference_model.trainable_variables):
            target.assign(source.numpy().astype(np.float64))
        x64 = tf.constant(x, tf.float64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(reference_model(x64), tf.float64) - y))
        reference = [g.numpy() for g in tape.gradient(loss, reference_model.trainable_variables)]
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            inner = RecordingSGD(0.0)
            optimizer = tfdls.LossScaleOptimizer(
                inner, tfdls.DynamicLossScale(2.0**scale_bits, increment_period=10**6),
                scale_boundaries=model if places else None)
            variables = model.trainable_variables

            def step():
                with tf.GradientTape() as tape:
                    prediction = tf.cast(model(tf.constant(x)), tf.float32)
                    loss = tf.reduce_mean(tf.square(prediction - y))
                    scaled = (optimizer.scale_loss(loss) if style == "keras"
                              else optimizer.get_scaled_loss(loss))
                grads = tape.gradient(scaled, variables)
                if style == "tf_keras":
                    grads = optimizer.get_unscaled_gradients(grads, trainable_variables=variables)
                    optimizer.apply_gradients(zip(grads, variables))
                else:
                    optimizer.apply(grads, variables)

            (tf.function(step) if mode == "graph" else step)()
            if int(optimizer.loss_scale.num_skipped_steps.numpy()):
                # The drawn scale times the factors overflowed float16: the step
                # was skipped, and the inner optimizer received nothing.
                assert not any(np.any(r.numpy()) for r in inner.recorded)
                return
            for got, want, v in zip(inner.recorded, reference, variables):
                got = got.numpy().astype(np.float64)
                error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
                assert error < 2e-2, (v.path, error, places, scale_bits, style, mode)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    check()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_boundary_no_optimizer_owns_is_an_identity_both_ways(mode, tmp_path):
    """Gradients computed where the guard cannot see (another function), a
    loaded model, or any other optimizer: an unowned boundary scales nothing."""
    model = tfdls.add_scale_boundaries(dense_stack(3), every=1, **pinned(3))
    x = tf.ones([2, 4])

    def gradients(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x))
        return tape.gradient(loss, m.trainable_variables)

    if mode == "graph":
        gradients = tf.function(gradients)
    plain = dense_stack(3)
    copy_weights(model, plain)
    unowned = gradients(model)
    for a, b in zip(unowned, gradients(plain)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Owned (the same traced function): the factors apply, read at run time.
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    owned = gradients(model)
    assert np.array_equal(owned[0].numpy(), 4.0 * 2.0**6 * unowned[0].numpy() / 4.0)
    # A saved and loaded model starts unowned, whatever its factors.
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    eager = gradients.python_function if mode == "graph" else gradients
    for a, b in zip(eager(loaded), unowned):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- the division by 2**(log2 scale + T), in every mode ------------------------------------


def _division_functions():
    from tfdls import _division

    def divide(g, e):
        return _division.divide_by_power_of_two(g, e, 1300)

    return {"eager": divide, "graph": tf.function(divide),
            "xla": tf.function(divide, jit_compile=True)}


def test_division_by_a_power_of_two_is_correctly_rounded_in_every_mode(hypothesis):
    """Against numpy's float64 quotient rounded once to the dtype, exponents
    across float32's range and beyond (up to 1300, past float64's own: a loss
    scale times 78 boundaries at 2**15; float64 gradients within +-1022, where
    deeper chains are refused). TensorFlow's graph optimizer regroups a chain of
    multiplies, which made the graph-mode quotient 0 from exponent 127 on.
    CPUs flush float32 subnormal results to zero (all TensorFlow arithmetic
    there does), so those are left out for float32, and for float64 (whose
    results reach its subnormals from exponent 1022 on)."""
    from hypothesis import given, settings, strategies as st

    functions = _division_functions()
    tiny = {np.float32: np.finfo(np.float32).tiny, np.float16: 0.0,
            np.float64: np.finfo(np.float64).tiny}

    @settings(max_examples=150, deadline=None)
    @given(st.sampled_from([np.float32, np.float16, np.float64]),
           st.integers(1, 2**11 - 1), st.integers(-160, 160),
           st.one_of(st.integers(-323, 323), st.integers(-1300, 1300)),
           st.sampled_from(sorted(functions)), st.booleans())
    def check(dtype, mantissa, shift, exponent, mode, negative):
        if dtype is np.float16:
            shift = max(-24, min(shift, 4))
        g = np.array([(-1.0 if negative else 1.0) * mantissa * 2.0**shift], np.float64)
        value = dtype(g[0])
        if dtype is np.float64:
            exponent = max(-1022, min(exponent, 1022))
        if not np.isfinite(value) or value == 0:
            return
        with np.errstate(over="ignore", under="ignore"):
            want = np.array([np.ldexp(np.float64(value), -exponent)]).astype(dtype)
        if abs(float(value)) < tiny[dtype] or 0 < abs(float(want[0])) < tiny[dtype]:
            return  # float32 and float64 subnormal inputs and results are flushed on CPUs
        got = functions[mode](tf.constant([value], dtype), tf.constant(exponent, tf.int32)).numpy()
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want, err_msg=f"{mode}: {value!r} / 2**{exponent}")

    check()


def test_clipped_exponents_divide_bit_identically_to_the_full_chain(hypothesis):
    """A deep chain's bound (128 + 15 x boundaries) is clipped to +-278 for float32,
    float16 and bfloat16 gradients (3 multiplies instead of ceil(bound / 126)): inside
    XLA, every quotient equals the unclipped pieces' one bit for bit, for values from
    the smallest subnormal to the largest finite, zeros, Inf and NaN, exponents to
    +-1628 (100 boundaries). float64 keeps its bound. (CPUs flush subnormal results,
    so here a clip from 254 on would pass too; 278 is the bound where subnormals are
    kept, as XLA keeps them on GPUs. 250 fails.)"""
    from hypothesis import given, settings, strategies as st

    from tfdls import _division

    bound = 128 + 15 * 100
    assert len(_division.reciprocal_pieces_for(tf.float32, tf.constant(5), bound)) == 3
    assert len(_division.reciprocal_pieces_for(tf.float16, tf.constant(5), bound)) == 3
    assert len(_division.reciprocal_pieces_for(tf.float64, tf.constant(5), bound)) == 13
    assert len(_division.reciprocal_pieces_for(tf.float32, tf.constant(5), 200)) == 2

    def divide(values, exponents, clipped):
        pieces = (_division.reciprocal_pieces_for(values.dtype, exponents, bound) if clipped
                  else _division.reciprocal_pieces(exponents, bound))
        return _division.multiply_by_pieces(values, pieces)

    compiled = tf.function(divide, jit_compile=True)
    # Per dtype: (smallest normal, largest finite, smallest subnormal), from IEEE 754's
    # layouts (8, 5 and 8 exponent bits; 23, 10 and 7 fraction bits).
    limits = {"float32": (2.0**-126, (2 - 2.0**-23) * 2.0**127, 2.0**-149),
              "float16": (2.0**-14, 65504.0, 2.0**-24),
              "bfloat16": (2.0**-126, (2 - 2.0**-7) * 2.0**127, 2.0**-133)}
    extremes = {name: [0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny, -tiny,
                       largest, -largest, 1.0, -3.0, subnormal, -subnormal]
                for name, (tiny, largest, subnormal) in limits.items()}
    for name, (tiny, largest, subnormal) in limits.items():  # the layouts are the dtypes'
        assert tf.cast(tf.constant(largest, tf.float64), name).numpy() == largest
        assert tf.cast(tf.constant(largest * 2, tf.float64), name).numpy() == np.inf

    @settings(max_examples=60, deadline=None)
    @given(st.sampled_from(sorted(extremes)),
           st.lists(st.one_of(st.integers(-bound, bound), st.integers(-300, 300),
                              st.sampled_from([-279, -278, -277, 277, 278, 279])),
                    min_size=1, max_size=8),
           st.lists(st.floats(width=32, allow_nan=False), max_size=4))
    def check(dtype, exponents, drawn):
        values = tf.constant(extremes[dtype] + drawn, tf.float32)
        values = tf.cast(values, dtype)
        for e in exponents:
            e = tf.fill(values.shape, e)
            got = compiled(values, e, True).numpy().astype(np.float64)
            want = compiled(values, e, False).numpy().astype(np.float64)
            np.testing.assert_array_equal(got, want, err_msg=f"{dtype} / 2**{e[0]}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

    check()


@pytest.mark.parametrize("jit", [False, True])
def test_nearest_power_of_two_corrects_an_approximate_division(jit):
    """The rows' quotients are rounded to the nearest power of two from their bits, so
    they are exact even where a division is not IEEE's (XLA's GPU backend divides
    float32 to within 2 ulp): every normal power of two, and values up to 8 ulp and
    20% either side of it, give it back; 1.5 times it rounds up."""
    from tfdls import _division

    exact = np.ldexp(np.float32(1.0), np.arange(-126, 127)).astype(np.float32)
    bits = exact.view(np.int32)
    near = [(bits + ulps).view(np.float32) for ulps in (-8, -2, -1, 0, 1, 2, 8)]
    near += [exact * np.float32(0.8), exact[:-1] * np.float32(1.2)]
    snap = tf.function(_division.nearest_power_of_two, jit_compile=jit)
    for values in near:
        got = snap(tf.constant(values)).numpy()
        assert got.view(np.int32).tolist() == exact[:len(values)].view(np.int32).tolist()
    up = snap(tf.constant(exact[:-1] * np.float32(1.5))).numpy()
    assert up.tolist() == exact[1:].tolist()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_reciprocals_are_the_bit_built_pieces_under_xla(dtype):
    """Under whole-step XLA with an accelerator visible (no argument indices, see
    `elements`) each segment's pieces are divided, `1.0 / row`, so that XLA keeps them
    out of the updates' fusions: bit for bit the pieces `reciprocal_pieces`
    builds from their bits, for every normal power of two and exponents to +-1628
    (100 boundaries; float32 clipped to 3 pieces, float64 in 13)."""
    from tfdls import _division

    bound = 128 + 15 * 100

    def reciprocals(j):  # every exponent of a piece
        return 1.0 / _division.power_of_two(j)

    every = tf.range(-126, 127)
    got = tf.function(reciprocals, jit_compile=True)(every).numpy()
    want = _division.power_of_two(-every).numpy()
    assert got.view(np.int32).tolist() == want.view(np.int32).tolist()

    exponents = tf.constant([0, 1, -1, 125, 126, 127, -126, -127, 252, 253, -253, 278, 279,
                             -279, 300, -300, 1000, -1000, bound, -bound], tf.int32)

    def both(e):
        rows = _boundary_scales._rows_of_reciprocals(tf.as_dtype(dtype), e, bound)
        return tf.stack(rows), tf.stack(_division.reciprocal_pieces_for(tf.as_dtype(dtype), e,
                                                                        bound), axis=1)

    rows, pieces = tf.function(both, jit_compile=True)(exponents)
    assert rows.shape == pieces.shape == (len(exponents), 3 if dtype == "float32" else 13)
    assert rows.numpy().view(np.int32).tolist() == pieces.numpy().view(np.int32).tolist()


@pytest.mark.parametrize("jit", [False, True])
def test_elements_are_the_unstacked_values_bit_for_bit(jit):
    """`elements` reads each element (or row) at an index XLA takes as an argument:
    the same values, in the same order, as `tf.unstack`, bit for bit (-0.0 and a NaN's
    payload included), for a vector and for the segments' rows of pieces."""
    vector = np.array([1.5, -0.0, np.inf, 2.0**-149, -3.0, 7.0], np.float32)
    vector = np.append(vector, np.array([0x7FC00123], np.int32).view(np.float32))
    rows = np.ldexp(1.0, np.arange(-60, 60).reshape(8, 15)).astype(np.float64)

    def both(values):
        return (tf.stack(_boundary_scales.elements(values, values.shape[0])),
                tf.stack(tf.unstack(values, values.shape[0])))

    for values in (vector, rows):
        got, want = tf.function(both, jit_compile=jit)(tf.constant(values))
        assert got.numpy().tobytes() == want.numpy().tobytes() == values.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_division_beyond_float64_exponents_gives_zero_or_inf(dtype):
    """Past 2**+-1022 (a chain of 60 or more boundaries) the float64 multiply's
    power of two is out of range: its bits made a garbage divisor."""
    from tfdls import _division

    functions = _division_functions()
    values = tf.constant([3.0, -0.5, 0.0, -0.0], dtype)
    for exponent in (1023, 1100, 2000, -1023, -1100, -2000):
        for mode, divide in functions.items():
            got = divide(values, tf.constant(exponent, tf.int32)).numpy().astype(np.float64)
            with np.errstate(over="ignore", under="ignore"):
                want = np.ldexp(values.numpy().astype(np.float64), -exponent).astype(
                    values.numpy().dtype).astype(np.float64)
            np.testing.assert_array_equal(got, want, err_msg=f"{mode}: 2**{exponent}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert _division.FLOAT64_MAX_EXPONENT == 1022


def test_a_float64_variable_below_too_many_boundaries_is_refused():
    keras.mixed_precision.set_global_policy("float64")
    depth = boundaries_lib.MAX_FLOAT64_CHAIN + 2
    model = tfdls.add_scale_boundaries(dense_stack(depth, width=1), every=1)
    with pytest.raises(ValueError, match=r"'sequential.*/d0/kernel' is float64 and below 60 nested scale boundaries, more than 59"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model).build(
            model.trainable_variables)
    shallow = tfdls.add_scale_boundaries(dense_stack(3, width=1), every=1)
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=shallow).build(
        shallow.trainable_variables)


@pytest.mark.parametrize("jit_compile", [False, "auto"])
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_float32_model_with_a_scale_beyond_2_127_gets_the_float64_update(mode, jit_compile):
    """Loss scale 2**120 and a boundary at 2**10: the gradient below the
    boundary is divided by 2**130 (the graph optimizer's regrouping made it 0
    with jit_compile=False)."""
    keras.mixed_precision.set_global_policy("float32")
    model = keras.Sequential([
        keras.Input((2,)), tfdls.UnscaledInput(), keras.layers.Dense(2, use_bias=False, name="d0"),
        tfdls.ScaleBoundary(**pinned(10)), keras.layers.Dense(1, use_bias=False, name="d1"),
    ])
    k0 = np.array([[1.0, 2.0], [3.0, -1.0]])
    k1 = np.array([[2.0], [-1.0]])
    model.get_layer("d0").kernel.assign(k0)
    model.get_layer("d1").kernel.assign(k1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(2.0**120),
                                         scale_boundaries=model, jit_compile=jit_compile)
    x = np.array([[1 / 64, 1 / 64]])
    train_steps(model, optimizer, [(x.astype("float32"), np.zeros((1, 1), "float32"))], mode,
                loss_fn=lambda y, p: tf.reduce_sum(0.5 * tf.square(p - y)))
    residual = x @ k0 @ k1
    want0, want1 = k0 - x.T @ (residual @ k1.T), k1 - (x @ k0).T @ residual
    np.testing.assert_array_equal(model.get_layer("d0").kernel.numpy(), want0.astype("float32"))
    np.testing.assert_array_equal(model.get_layer("d1").kernel.numpy(), want1.astype("float32"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("mode", MODES)
def test_a_finite_gradient_whose_division_overflows_is_skipped(hypothesis, mode, dtype):
    """A factor below 1 (a negative exponent) makes the division multiply: a
    finite scaled gradient can become Inf once divided. Drawn gradients,
    factors and scales against the float64 reference: the step applies iff
    every divided gradient is finite, then each weight is the correctly
    rounded quotient (SGD, learning rate 1, weights 0); otherwise nothing
    changes. The check read the scaled gradients only: Inf reached the weights.
    Factors are also assigned by hand, beyond the bounds, fractional or NaN:
    each is read truncated and clipped to its layer's bounds (NaN as the
    lower one); read only within [-126, 127], XLA's division dropped the
    pieces of exponents beyond its static bound."""
    from hypothesis import assume, given, settings, strategies as st

    keras.mixed_precision.set_global_policy("float16" if dtype == "float16" else "float32")
    model = tfdls.add_scale_boundaries(dense_stack(3, width=2), every=1, initial_log2_factor=0,
                                       min_log2_factor=-14, max_log2_factor=15)
    b_low, b_top = [layer for layer in model.layers if isinstance(layer, tfdls.ScaleBoundary)]
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0, min_loss_scale=2.0**-20),
        scale_boundaries=model)
    variables = model.trainable_variables
    layer_of = [v.path.split("/")[-2] for v in variables]
    step = lambda grads: optimizer.apply(grads, variables)  # noqa: E731
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    top_bit = 15 if dtype == "float16" else 127  # the last layer is float32 either way

    @settings(max_examples=30 if mode == "graph" else 12, deadline=None)
    @given(st.lists(st.tuples(st.integers(1, 2047), st.integers(-24, top_bit), st.booleans(),
                              st.sampled_from(["finite"] * 8 + ["inf", "nan"])),
                    min_size=len(variables), max_size=len(variables)),
           st.lists(st.one_of(st.integers(-130, 130).map(float), st.floats(-20, 20),
                              st.just(float("nan"))), min_size=2, max_size=2),
           st.integers(-20, 20))
    def check(drawn, factors, s):
        for v in variables:
            v.assign(tf.zeros_like(v))
        for boundary, value in zip((b_low, b_top), factors):
            boundary.log2_factor.assign(value)
        record_factors((b_low, b_top))
        e_low, e_top = [int(-14 if math.isnan(v) else np.trunc(np.clip(np.float32(v), -14, 15)))
                        for v in factors]
        optimizer.loss_scale.current_loss_scale.assign(2.0**s)
        exponent = {"d0": s + e_low + e_top, "d1": s + e_top, "d2": s}
        grads, want = [], []
        for v, layer, (mantissa, shift, negative, kind) in zip(variables, layer_of, drawn):
            g = {"finite": (-1.0 if negative else 1.0) * mantissa * 2.0**(shift - 11),
                 "inf": float("inf"), "nan": float("nan")}[kind]
            np_dtype = np.dtype(v.dtype).type
            g = np_dtype(g)  # may overflow to Inf: a non-finite gradient
            with np.errstate(over="ignore", invalid="ignore"):
                q = np.array([float(g) / 2.0**exponent[layer]]).astype(np_dtype)[0]
            if np_dtype is np.float32:  # CPUs flush float32 subnormal results
                assume(not 0 < abs(q) < np.finfo(np.float32).tiny)
            grads.append(tf.fill(v.shape, tf.constant(g, v.dtype)))
            want.append(q)
        applies = all(np.isfinite(q) for q in want)
        iterations = int(optimizer.iterations.numpy())
        step(grads)
        assert int(optimizer.iterations.numpy()) == iterations + applies
        for v, q in zip(variables, want):
            expected = np.full(v.shape, -q if applies else 0.0, v.dtype)
            np.testing.assert_array_equal(v.numpy(), expected, err_msg=f"{v.path}: {q!r}")

    check()


@pytest.mark.parametrize("mode", MODES)
def test_the_check_names_the_overflowing_variables_with_mixed_dtypes(hypothesis, mode):
    """float16 and float32 layers interleaved below boundaries: the check
    divides the largest magnitudes per dtype as vectors and must put each
    answer back on its own variable (the overflow report names exactly the
    variables whose divided gradient is non-finite)."""
    from hypothesis import given, settings, strategies as st

    keras.mixed_precision.set_global_policy("float32")
    stack = [keras.Input((2,)), tfdls.UnscaledInput()]
    for i, dtype in enumerate(["float16", "float32", "float16"]):
        stack += [keras.layers.Dense(2, dtype=dtype, name=f"d{i}"),
                  tfdls.ScaleBoundary(min_log2_factor=-14, max_log2_factor=15, name=f"b{i}")]
    model = keras.Sequential(stack + [keras.layers.Dense(1, name="d3")])
    boundaries = [layer for layer in model.layers if isinstance(layer, tfdls.ScaleBoundary)]
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0),
                                         scale_boundaries=model)
    variables = model.trainable_variables
    step = lambda grads: optimizer.apply(grads, variables)  # noqa: E731
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    layer_index = [int(v.path.split("/")[-2][1:]) for v in variables]

    @settings(max_examples=25 if mode == "graph" else 8, deadline=None)
    @given(st.lists(st.integers(-14, 15), min_size=3, max_size=3),
           st.lists(st.sampled_from([1.0, 2.0**10, 3.0e4, 2.0**100]), min_size=len(variables),
                    max_size=len(variables)))
    def check(factors, magnitudes):
        for boundary, f in zip(boundaries, factors):
            boundary.log2_factor.assign(float(f))
        record_factors(boundaries)
        grads, bad = [], []
        for v, layer, m in zip(variables, layer_index, magnitudes):
            exponent = sum(factors[layer:])  # the boundaries above layer `layer`
            np_dtype = np.dtype(v.dtype).type
            with np.errstate(over="ignore"):
                g = np_dtype(m)
                q = np.array([np.ldexp(np.float64(g), -exponent)]).astype(np_dtype)[0]
            grads.append(tf.fill(v.shape, tf.constant(g, v.dtype)))
            if not np.isfinite(q):
                bad.append(v.path)
        skipped = int(optimizer.loss_scale.num_skipped_steps.numpy())
        step(grads)
        assert int(optimizer.loss_scale.num_skipped_steps.numpy()) == skipped + bool(bad)
        if bad:
            assert sorted(optimizer.last_overflow().variable_names) == sorted(bad)

    check()


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_batch_without_ids_is_applied(jit_compile):
    # The Embedding's gradient is an IndexedSlices with no rows, of a size
    # unknown when traced: its largest magnitude is 0, and the step applies
    # (a replica's empty last batch under MirroredStrategy is the same case).
    keras.utils.set_random_seed(0)
    ids = keras.Input((), dtype="int32")
    h = keras.layers.Dense(4, name="d0")(keras.layers.Embedding(10, 4, name="emb")(ids))
    h = tfdls.ScaleBoundary(initial_log2_factor=2, name="b0")(h)
    model = keras.Model(ids, keras.layers.Dense(1, name="d1")(h))
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**10),
                                   scale_boundaries=model, jit_compile=jit_compile)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def step(x):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(model(x)))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    step(tf.constant([1, 2], tf.int32))
    step(tf.constant([], tf.int32))
    assert int(opt.loss_scale.num_skipped_steps.numpy()) == 0
    assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("jit_compile", [False, True])
def test_indexed_slices_with_captured_eager_indices(jit_compile):
    """A gradient built in the step from indices captured from outside it (an eager tensor,
    with no op in the graph) is divided like one whose indices the step computed."""

    def run(captured):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(6, 2, name="emb")(inputs))
        h = tfdls.ScaleBoundary(initial_log2_factor=3, name="b")(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
        opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1.0), scale_boundaries=model)
        variables = model.trainable_variables
        opt.build(variables)
        eager_ids = tf.constant([4, 1])

        @tf.function(jit_compile=jit_compile)
        def step():
            opt.scale_loss(tf.constant(1.0))
            ids = eager_ids if captured else tf.constant([4, 1])
            grads = [tf.IndexedSlices(tf.fill([2, 2], 2.0**18), ids, tf.constant([6, 2]))]
            opt.apply(grads + [tf.ones_like(v) * 2.0**15 for v in variables[1:]], variables)

        step()
        assert int(opt.iterations.numpy()) == 1
        return [v.numpy() for v in variables]

    for got, want in zip(run(captured=True), run(captured=False)):
        np.testing.assert_array_equal(got, want)
