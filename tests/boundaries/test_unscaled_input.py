"""Gradients that leave a model with scale boundaries: `UnscaledInput` divides out the
factors of the boundaries above each input, so the gradient with respect to an input (a
saliency map, a GAN generator trained through a discriminator) is the plain model's.

Checked against the same layers without boundaries: power-of-two factors commute with
float32 arithmetic while nothing overflows or underflows, so the gradients are
bit-identical. A factor left in is off by 2**k, k >= 1.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

MODES = ["eager", "graph", "xla"]


def pinned(k):
    return dict(initial_log2_factor=k, min_log2_factor=k, max_log2_factor=k)


def run(fn, mode):
    if mode == "eager":
        return fn()
    return tf.function(fn, jit_compile=mode == "xla")()


def twin_models(depth, places, seed=0, width=4, out=1, name="m"):
    """Two models with the same weights: Dense layers with boundaries (pinned at
    ``2**places[i]`` after layer i) and an UnscaledInput, and without either."""

    def build(with_boundaries):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((width,))
        h = tfdls.UnscaledInput()(inputs) if with_boundaries else inputs
        for i in range(depth - 1):
            h = keras.layers.Dense(width, activation="tanh", name=f"{name}{i}")(h)
            if with_boundaries and i in places:
                h = tfdls.ScaleBoundary(**pinned(places[i]))(h)
        return keras.Model(inputs, keras.layers.Dense(out, name=f"{name}_out")(h))

    return build(True), build(False)


@pytest.fixture(autouse=True)
def float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_drawn_models_give_the_plain_input_gradient():
    """Drawn depth, boundary places and factors, mode: the gradient with respect to the
    input through owned boundaries equals the plain model's, bit for bit."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings, strategies as st

    x = tf.constant(np.random.default_rng(2).normal(size=(3, 4)).astype("float32"))

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(depth=st.integers(2, 5), data=st.data(), mode=st.sampled_from(MODES))
    def check(depth, data, mode):
        places = data.draw(st.dictionaries(st.integers(0, depth - 2), st.integers(-14, 15),
                                           min_size=1))
        with_boundaries, plain = twin_models(depth, places)
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=with_boundaries)

        def input_gradients():
            found = []
            for model in (with_boundaries, plain):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(model(x) * tf.constant([[1.0], [-2.0], [0.5]]))
                found.append(tape.gradient(y, x))
            return found

        scaled, expected = run(input_gradients, mode)
        np.testing.assert_array_equal(scaled.numpy(), expected.numpy())

    check()


def test_placed_functional_model_with_an_input_used_above_and_below_a_boundary():
    """add_scale_boundaries gives every use of an input its own UnscaledInput: one below
    the boundaries, one above them."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh", name="a")(inputs)
    h = keras.layers.Dense(4, activation="tanh", name="b")(h)
    h = keras.layers.Concatenate(name="cat")([h, inputs])
    plain = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    placed = tfdls.add_scale_boundaries(plain, every=1, **pinned(7))
    assert sum(isinstance(layer, tfdls.UnscaledInput) for layer in placed.layers) == 2
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=placed)
    x = tf.constant(np.random.default_rng(4).normal(size=(5, 3)).astype("float32"))
    # The reference: the plain model's own copy (the original shares the placed
    # model's layers, which run under a tape only inside the placed model).
    reference = keras.models.clone_model(plain)
    reference.set_weights(plain.get_weights())
    for mode in MODES:
        def input_gradients():
            found = []
            for model in (placed, reference):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(model(x))
                found.append(tape.gradient(y, x))
            return found

        scaled, expected = run(input_gradients, mode)
        np.testing.assert_array_equal(scaled.numpy(), expected.numpy())


def gan_step(generator, discriminator, g_opt, d_opt, z, real):
    """One step of each model, each with its own optimizer: the generator's gradient
    crosses the discriminator's boundaries and its UnscaledInput."""
    with tf.GradientTape() as tape:
        loss = g_opt.scale_loss(-tf.reduce_mean(discriminator(generator(z))))
    g_grads = tape.gradient(loss, generator.trainable_variables)
    with tf.GradientTape() as tape:
        loss = d_opt.scale_loss(tf.reduce_mean(discriminator(generator(z)))
                                - tf.reduce_mean(discriminator(real)))
    d_grads = tape.gradient(loss, discriminator.trainable_variables)
    return g_grads, d_grads


@pytest.mark.parametrize("mode", MODES + ["split"])
def test_two_models_with_boundaries_and_their_own_optimizers_match_the_plain_ones(mode):
    """A GAN: both models with owned boundaries, each with its own optimizer, both applied
    in one traced step (or gradients from one tf.function applied eagerly: "split"). The
    weights after two steps equal those of the same models without boundaries."""
    rng = np.random.default_rng(6)
    z = tf.constant(rng.normal(size=(6, 4)).astype("float32"))
    real = tf.constant(rng.normal(size=(6, 4)).astype("float32"))
    g_b, g_plain = twin_models(3, {0: 5, 1: -3}, seed=1, out=4, name="g")
    d_b, d_plain = twin_models(4, {0: 9, 2: 4}, seed=2, name="d")
    runs = []
    for generator, discriminator, boundaries in ((g_b, d_b, True), (g_plain, d_plain, False)):
        start = [v.numpy() for v in generator.trainable_variables + discriminator.trainable_variables]
        make = lambda model: tfdls.LossScaleOptimizer(  # noqa: E731
            keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**10),
            scale_boundaries=model if boundaries else None)
        g_opt, d_opt = make(generator), make(discriminator)

        def step():
            g_grads, d_grads = gan_step(generator, discriminator, g_opt, d_opt, z, real)
            g_opt.apply(g_grads, generator.trainable_variables)
            d_opt.apply(d_grads, discriminator.trainable_variables)

        for _ in range(2):
            if mode == "split":
                g_grads, d_grads = tf.function(
                    lambda: gan_step(generator, discriminator, g_opt, d_opt, z, real))()
                g_opt.apply(g_grads, generator.trainable_variables)
                d_opt.apply(d_grads, discriminator.trainable_variables)
            else:
                run(step, mode)
        runs.append([v.numpy() for v in generator.trainable_variables + discriminator.trainable_variables])
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(runs[1], start))  # the steps moved the weights


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("through", ["ScaleBoundary", "UnscaledInput"])
def test_a_gradient_penalty_through_boundaries_is_refused(mode, through):
    """A gradient of a gradient through a boundary mixes scales: refused, naming it."""
    model, _ = twin_models(3, {0: 4})
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    boundary = tfdls.ScaleBoundary(**pinned(4), name="alone")
    boundary._ownership.recorded_exponent.assign(4.0)  # as an optimizer given it records
    head = keras.layers.Dense(1)
    x = tf.ones([2, 4])

    def penalty():
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner_tape:
                inner_tape.watch(x)
                if through == "ScaleBoundary":
                    y = tf.reduce_sum(head(boundary(x)))  # no UnscaledInput on the way
                else:
                    y = tf.reduce_sum(model(x))
            grad = inner_tape.gradient(y, x)
            loss = y + tf.reduce_sum(tf.square(grad))
        variables = head.trainable_variables if through == "ScaleBoundary" else \
            model.trainable_variables
        return tape.gradient(loss, variables)

    with pytest.raises(ValueError, match=f"a gradient of a gradient through {through}"):
        run(penalty, mode)


def test_the_input_rule_is_enforced():
    hand_built = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="low"),
                                   tfdls.ScaleBoundary(name="b"), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"model input '.*' is used by layer 'low', below the "
                                         r"scale boundaries \['b'\].*UnscaledInput"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=hand_built)
    misplaced = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2),
                                  tfdls.UnscaledInput(name="late"), tfdls.ScaleBoundary(),
                                  keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="UnscaledInput 'late' is not the first layer"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=misplaced)
    inputs = keras.Input((2,))
    h = keras.layers.Dense(2)(inputs)
    h = tfdls.UnscaledInput(name="inner")(h)
    functional = keras.Model(inputs, keras.layers.Dense(1)(tfdls.ScaleBoundary()(h)))
    with pytest.raises(ValueError, match="UnscaledInput 'inner' is not placed directly on a model input"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=functional)
    # An integer input has no gradient: no UnscaledInput needed.
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(10, 2)(ids))
    h = tfdls.ScaleBoundary()(keras.layers.Dense(2)(h))
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(),
                             scale_boundaries=keras.Model(ids, keras.layers.Dense(1)(h)))


def test_an_unscaled_input_in_two_models_below_different_boundaries_is_refused():
    unscale = tfdls.UnscaledInput(name="shared_unscale")
    dense = keras.layers.Dense(2)
    inputs = keras.Input((2,))
    h = dense(unscale(inputs))
    one = keras.Model(inputs, keras.layers.Dense(1)(tfdls.ScaleBoundary(name="first")(h)))
    two = keras.Model(inputs, keras.layers.Dense(1)(tfdls.ScaleBoundary(name="second")(h)))
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=one)
    with pytest.raises(ValueError, match=r"UnscaledInput 'shared_unscale' is below the scale "
                                         r"boundaries \['first'\] in one model and \['second'\]"):
        tfdls.boundaries.read_boundaries(two)


def test_unscaled_input_saves_and_loads(tmp_path):
    model, _ = twin_models(3, {0: 6})
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert sum(isinstance(layer, tfdls.UnscaledInput) for layer in loaded.layers) == 1
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=loaded)
    x = tf.ones([2, 4])
    grads = []
    for m in (loaded, model):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(m(x))
        grads.append(tape.gradient(y, x).numpy())
    # `model` is not owned (identity both ways), `loaded` is (factor and division).
    np.testing.assert_array_equal(*grads)


def test_an_input_gradient_traced_before_the_model_was_read_is_refused():
    """A trace made before the optimizer owned the boundaries divides by nothing, and
    would keep doing so once they scale: the optimizer refuses the model."""
    model, _ = twin_models(3, {0: 6})
    x = tf.ones([2, 4])

    @tf.function
    def saliency():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(model(x))
        return tape.gradient(y, x)

    saliency()
    with pytest.raises(ValueError, match=r"UnscaledInput '.*' was traced in a tf.function "
                                         r"before its model was given to an optimizer"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    # Eagerly the division is read when the backward pass runs: nothing to refuse.
    fresh, plain = twin_models(3, {0: 6}, seed=1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fresh(x))
    before = tape.gradient(y, x)
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=fresh)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fresh(x))
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), before.numpy())


def feature_model():
    """D with boundaries b1, b2 (2**3 each), owned; a feature extractor sharing its layers
    up to d1 (it crosses b1 only); a head from d0's output (no UnscaledInput)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((4,))
    h = keras.layers.Dense(4, activation="tanh", name="d0")(tfdls.UnscaledInput()(x))
    h = keras.layers.Dense(4, activation="tanh", name="d1")(
        tfdls.ScaleBoundary(name="b1", **pinned(3))(h))
    d = keras.Model(x, keras.layers.Dense(1, name="dout")(
        tfdls.ScaleBoundary(name="b2", **pinned(3))(h)))
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=d)
    features = keras.Model(d.input, d.get_layer("d1").output)
    head = keras.Model(d.get_layer("d0").output, d.output)
    return d, features, head


@pytest.mark.parametrize("mode", MODES)
def test_a_feature_extractor_sharing_the_layers_is_refused(mode):
    """Its gradient crosses b1 only; the UnscaledInput would divide by b1 and b2."""
    d, features, _ = feature_model()
    x = tf.ones([2, 4])

    def saliency():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(features(x))
        return tape.gradient(y, x)

    # Refused when the gradient flows into a layer below a boundary called outside its
    # model (the rule of tfdls.boundaries), before the UnscaledInput sees the missing b2.
    with pytest.raises(ValueError, match=r"a gradient flowed into the layer '\w+', which is "
                                         r"below the scale boundary 'b\d', from a call "
                                         r"outside its model"):
        run(saliency, mode)

    def full():  # the whole model, through the same layers: fine
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(d(x))
        return tape.gradient(y, x)

    assert run(full, mode).shape == (2, 4)
    assert features(x).shape == (2, 4)  # outside a tape: inference is fine


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_generator_trained_through_a_head_without_unscaled_input_is_refused(mode):
    """The head starts at an inner tensor: nothing divides its boundaries out again."""
    d, _, head = feature_model()
    keras.utils.set_random_seed(7)
    z_in = keras.Input((2,))
    generator = keras.Model(z_in, keras.layers.Dense(4)(z_in))
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    z = tf.ones([3, 2])

    def step():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(-tf.reduce_mean(head(generator(z))))
        optimizer.apply(tape.gradient(loss, generator.trainable_variables),
                        generator.trainable_variables)

    with pytest.raises(ValueError, match=r"a gradient flowed into the layer '\w+', which is below "
                                         r"the scale boundary 'b\d', from a call outside"):
        run(step, mode)

    def mixed_step():  # through the whole model (divided) and the head (not): refused
        with tf.GradientTape() as tape:
            fake = generator(z)
            loss = optimizer.scale_loss(-tf.reduce_mean(d(fake)) - tf.reduce_mean(head(fake)))
        optimizer.apply(tape.gradient(loss, generator.trainable_variables),
                        generator.trainable_variables)

    with pytest.raises(ValueError, match=r"a gradient flowed into the layer '\w+', which is below "
                                         r"the scale boundary 'b\d', from a call outside"):
        run(mixed_step, mode)

    head_gradients = tf.function(lambda: _head_gradients(head, generator, optimizer, z))

    def inside_control_flow():  # computed in a cond branch / a nested function, applied out
        in_branch = tf.cond(tf.constant(True),
                            lambda: _head_gradients(head, generator, optimizer, z),
                            lambda: [tf.zeros_like(v) for v in generator.trainable_variables])
        optimizer.apply(in_branch, generator.trainable_variables)
        optimizer.apply(head_gradients(), generator.trainable_variables)

    with pytest.raises(ValueError, match=r"a gradient flowed into the layer '\w+', which is below "
                                         r"the scale boundary 'b\d', from a call outside"):
        run(inside_control_flow, mode)


def _head_gradients(head, generator, optimizer, z):
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(-tf.reduce_mean(head(generator(z))))
    return tape.gradient(loss, generator.trainable_variables)


def test_an_input_used_through_an_operation_is_refused():
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="low")(x * 2.0 - 1.0)
    model = keras.Model(x, keras.layers.Dense(1)(tfdls.ScaleBoundary(name="b")(h)))
    with pytest.raises(ValueError, match=r"model input 'x' is used by layer '.*', below the "
                                         r"scale boundaries \['b'\]"):
        tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    placed = tfdls.add_scale_boundaries(
        keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(4)(x[:, :2] * 2.0))))
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=placed)  # placed: fine


@pytest.mark.parametrize("mode", MODES)
def test_a_gather_above_the_layers_sends_indexed_slices(mode):
    """A row gather right above UnscaledInput or a boundary: the gradient arrives as
    IndexedSlices."""
    table = tf.Variable(np.random.default_rng(8).normal(size=(6, 4)).astype("float32"))
    with_boundaries, plain = twin_models(3, {0: 4, 1: 2})
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=with_boundaries)
    ids = tf.constant([0, 3, 3])

    def gradients():
        found = []
        for model in (with_boundaries, plain):
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(model(tf.gather(table, ids)))
            found.append(tf.convert_to_tensor(tape.gradient(y, table)))
        return found

    scaled, expected = run(gradients, mode)
    np.testing.assert_array_equal(scaled.numpy(), expected.numpy())


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_feature_matching_with_the_whole_model_in_one_tape_is_refused_traced(mode):
    """The whole model's call runs b2's backward pass too, but the feature call's gradient
    does not cross it: read from the graph, per call. (Eagerly this is not seen: README.)"""
    d, features, _ = feature_model()
    fake = tf.ones([2, 4])

    def generator_side():
        with tf.GradientTape() as tape:
            tape.watch(fake)
            loss = -tf.reduce_mean(d(fake)) + tf.reduce_sum(tf.square(features(fake)))
        return tape.gradient(loss, fake)

    with pytest.raises(ValueError, match=r"which is below the scale boundary 'b\d', from a call "
                                         r"outside its model"):
        run(generator_side, mode)


@pytest.mark.parametrize("mode", ["graph", "xla"])
@pytest.mark.parametrize("between", ["identity_n", "joint_clip"])
def test_gan_gradients_mixed_before_apply_match_the_plain_models(mode, between):
    """Both gradient lists through one tf.identity_n, or unscaled by each optimizer and
    clipped by one global norm: the walk follows each tensor (identity_n) and the
    optimizer's own division (clip); the weights equal the plain models'."""
    rng = np.random.default_rng(9)
    z = tf.constant(rng.normal(size=(6, 4)).astype("float32"))
    real = tf.constant(rng.normal(size=(6, 4)).astype("float32"))
    runs = []
    for with_boundaries in (True, False):
        generator = twin_models(3, {}, seed=1, out=4, name="g")[1]
        discriminator = twin_models(4, {0: 9, 2: 4}, seed=2, name="d")[0 if with_boundaries else 1]
        g_opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**10))
        d_opt = tfdls.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), tfdls.DynamicLossScale(2.0**10),
            scale_boundaries=discriminator if with_boundaries else None)
        g_vars, d_vars = generator.trainable_variables, discriminator.trainable_variables

        def step():
            g_grads, d_grads = gan_step(generator, discriminator, g_opt, d_opt, z, real)
            if between == "identity_n":
                both = tf.identity_n(list(g_grads) + list(d_grads))
                g_grads, d_grads = both[:len(g_vars)], both[len(g_vars):]
            else:
                g_grads = g_opt.get_unscaled_gradients(g_grads, trainable_variables=g_vars)
                d_grads = d_opt.get_unscaled_gradients(d_grads, trainable_variables=d_vars)
                clipped, _ = tf.clip_by_global_norm(list(g_grads) + list(d_grads), 1.0)
                g_grads, d_grads = clipped[:len(g_vars)], clipped[len(g_vars):]
            d_opt.apply(d_grads, d_vars)
            g_opt.apply(g_grads, g_vars)

        run(step, mode)
        runs.append([v.numpy() for v in g_vars + d_vars])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
