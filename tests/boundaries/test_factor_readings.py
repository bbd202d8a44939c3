"""One reading of the boundaries' factors per backward pass (`tfdls.boundaries.readings`).

The rule under test: in a traced function a group's reading is reused only
while no operation created after it takes one of the group's variable handles
other than to read it. Hypothesis draws call sequences (gradients, persistent
tapes, assignments by hand, in nested functions and in branches, optimizer
steps) inside one `tf.function`, and every gradient must carry the factors a
reading at that point would give, computed here in Python. The variables read
are the factors `scale_loss` records (`_ownership.recorded_exponent`), which
these programs write directly, with the values `scale_loss` records (integers
within the boundaries' bounds).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfdls
from tfdls.boundaries import readings as _factor_readings

LOW, HIGH = -3, 6  # the boundaries' bounds in these tests


def bounded_model(boundaries=2, seed=0):
    """Input -> UnscaledInput -> Dense -> (ScaleBoundary -> Dense) x boundaries, float32."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((3,)), tfdls.UnscaledInput(),
              keras.layers.Dense(3, kernel_initializer="ones", name="d0")]
    for k in range(boundaries):
        layers += [tfdls.ScaleBoundary(min_log2_factor=LOW, max_log2_factor=HIGH, name=f"b{k}"),
                   keras.layers.Dense(3, kernel_initializer="ones", name=f"d{k + 1}")]
    model = keras.Sequential(layers)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(2.0**-10), scale_boundaries=model)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def boundaries_of(model):
    return [layer for layer in model.layers if isinstance(layer, tfdls.ScaleBoundary)]


X = tf.constant([[1.0, 2.0, 0.5]])


def plain_gradient(boundaries):
    # d sum(out) / d kernel0 with all-ones kernels, zero biases and factors 1.
    return np.array([[1.0], [2.0], [0.5]]) * 3.0**boundaries * np.ones([1, 3])


def first_kernel_gradient(model, tape, total):
    return tape.gradient(total, model.layers[1].kernel)


# -- the op count: one reading per group --------------------------------------------------


def _readings(function, model, *args):
    """The group readings in the traced `function` (each replica's): reads of the first
    boundary's recorded exponent that go into one vector with all the others'."""
    graph = function.get_concrete_function(*args).graph
    boundaries = boundaries_of(model)
    variable = boundaries[0]._ownership.recorded_exponent
    handles = {id(v.handle) for v in getattr(variable, "values", (variable,))}
    inside = {internal.name for external, internal in graph.captures if id(external) in handles}
    return sum(op.type == "ReadVariableOp" and op.inputs[0].name in inside
               and any(c.type == "Pack" and len(c.inputs) == len(boundaries)
                       for c in op.outputs[0].consumers())
               for op in graph.get_operations())


def test_one_reading_for_all_boundaries_of_a_traced_backward_pass():
    model, _ = bounded_model(boundaries=5)

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(model(X))
        return first_kernel_gradient(model, tape, out)

    assert _readings(gradient, model) == 1  # one reading, not one per boundary


def test_a_second_gradient_reuses_the_reading_unless_a_write_came_between():
    model, optimizer = bounded_model(boundaries=3)
    kernel = model.layers[1].kernel

    @tf.function
    def twice(write):
        with tf.GradientTape(persistent=True) as tape:
            out = tf.reduce_sum(model(X))
        first = tape.gradient(out, kernel)
        if write == "assign":
            boundaries_of(model)[1]._ownership.recorded_exponent.assign(2.0)
        elif write == "step":
            optimizer.apply([tf.zeros_like(v) for v in model.trainable_variables],
                            model.trainable_variables)
        return first, tape.gradient(out, kernel)

    assert _readings(twice, model, "none") == 1
    assert _readings(twice, model, "assign") == 2
    # The step's own reading runs inside its compiled function, not here.
    assert _readings(twice, model, "step") == 2


def test_eager_backward_passes_read_each_boundary():
    model, _ = bounded_model(boundaries=2)
    for value in (1.0, 3.0):
        for boundary in boundaries_of(model):
            boundary._ownership.recorded_exponent.assign(value)
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(model(X))
        got = first_kernel_gradient(model, tape, out).numpy()
        np.testing.assert_array_equal(got, plain_gradient(2) * 2.0**(2 * value))


# -- call sequences against Python ---------------------------------------------------------

_VALUES = st.integers(LOW, HIGH).map(float)  # what scale_loss records


def _action(boundaries):
    index = st.integers(0, boundaries - 1)
    return st.one_of(
        st.just(("forward_and_gradient",)),
        st.just(("gradient_again",)),
        st.tuples(st.just("assign"), index, _VALUES),
        st.tuples(st.just("assign_in_function"), index, _VALUES),
        st.tuples(st.just("assign_in_branch"), index, _VALUES),
        st.tuples(st.just("assign_add"), index, st.integers(-2, 2).map(float)),
        st.just(("read_only",)),
        st.just(("optimizer_step",)),
    )


@st.composite
def _programs(draw):
    boundaries = draw(st.integers(1, 3))
    actions = draw(st.lists(_action(boundaries), min_size=1, max_size=7))
    start = draw(st.lists(st.integers(LOW, HIGH).map(float), min_size=boundaries,
                          max_size=boundaries))
    return boundaries, start, actions


def _run(program, mode):
    """Runs the program; returns each gradient and the Python reading it must carry."""
    boundaries, start, actions = program
    model, optimizer = bounded_model(boundaries)
    layers = boundaries_of(model)
    kernel = model.layers[1].kernel
    yes = tf.Variable(True)

    # The gradient with every factor 1, as recorded when ownership was taken (a
    # multiple of the input: exact in float32).
    assert all(layer._ownership.recorded_exponent.numpy() == 0.0 for layer in layers)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(X))
    plain = first_kernel_gradient(model, tape, out).numpy()
    for layer, value in zip(layers, start):
        layer._ownership.recorded_exponent.assign(value)

    assign_in_function = tf.function(lambda layer, value: layer._ownership.recorded_exponent.assign(value))

    def body():
        gradients = []
        tape = out = None
        for action in actions:
            kind = action[0]
            if kind == "forward_and_gradient" or (kind == "gradient_again" and tape is None):
                with tf.GradientTape(persistent=True) as tape:
                    out = tf.reduce_sum(model(X))
                gradients.append(tape.gradient(out, kernel))
            elif kind == "gradient_again":
                gradients.append(tape.gradient(out, kernel))
            elif kind == "assign":
                layers[action[1]]._ownership.recorded_exponent.assign(action[2])
            elif kind == "assign_in_function":
                assign_in_function(layers[action[1]], action[2])
            elif kind == "assign_in_branch":
                layer, value = layers[action[1]], action[2]

                def write(layer=layer, value=value):
                    layer._ownership.recorded_exponent.assign(value)
                    return tf.constant(0.0)

                tf.cond(yes, write, lambda: tf.constant(0.0))
            elif kind == "assign_add":
                layers[action[1]]._ownership.recorded_exponent.assign_add(action[2])
            elif kind == "read_only":
                # Reads the factors (an operation that must not end a reading).
                read = tf.add_n([layer._ownership.recorded_exponent.value() for layer in layers])
                gradients.append(tf.zeros_like(kernel) * tf.cast(tf.math.is_nan(read), tf.float32))
            elif kind == "optimizer_step":
                # All-zero gradients: an applied step that changes no weight, and,
                # on its first step, the factors' headroom adjustment.
                optimizer.apply([tf.zeros_like(v) for v in model.trainable_variables],
                                model.trainable_variables)
        return gradients, [layer._ownership.recorded_exponent.value() for layer in layers]

    if mode != "eager":
        body = tf.function(body, jit_compile=mode == "xla")
    # The Python twin: what a fresh reading gives at each gradient.
    expected = []
    state = list(start)
    for action in actions:
        kind = action[0]
        if kind in ("forward_and_gradient", "gradient_again"):
            expected.append(plain * 2.0**sum(state))
        elif kind in ("assign", "assign_in_function", "assign_in_branch"):
            state[action[1]] = action[2]
        elif kind == "assign_add":
            state[action[1]] = float(np.float32(state[action[1]]) + np.float32(action[2]))
        elif kind == "read_only":
            expected.append(np.zeros_like(plain))
        elif kind == "optimizer_step":
            state = None  # the step's adjustment moves the factors: read them back
            break
    gradients, final = body()
    return gradients, expected, [float(v) for v in final], state


@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "graph",
                                  pytest.param("xla", marks=pytest.mark.slow)])
@settings(max_examples=30, deadline=None)
@given(program=_programs())
def test_drawn_call_sequences_carry_the_factors_read_at_each_backward_pass(program, mode):
    gradients, expected, final, state = _run(program, mode)
    # Up to an optimizer step, whose adjustment the Python twin does not model.
    for got, want in zip(gradients, expected):
        np.testing.assert_array_equal(got.numpy(), want)
    if state is not None:
        np.testing.assert_array_equal(final, np.float32(state))


def test_a_drawn_program_after_an_optimizer_step_matches_eager():
    # After a step the factors are whatever the adaptation made them: the
    # traced program must agree with the eager one, where every boundary reads
    # its own factor.
    program = (2, [1.0, 2.0], [("forward_and_gradient",), ("optimizer_step",),
                               ("gradient_again",), ("forward_and_gradient",),
                               ("assign", 0, 4.0), ("gradient_again",)])
    eager, _, eager_final, _ = _run(program, "eager")
    traced, _, traced_final, _ = _run(program, "graph")
    np.testing.assert_array_equal(eager_final, traced_final)
    for a, b in zip(eager, traced):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_mirrored_replicas_read_their_own_copies(mirrored_strategy):
    with mirrored_strategy.scope():
        model, _ = bounded_model(boundaries=3)
    for k, layer in enumerate(boundaries_of(model)):
        layer._ownership.recorded_exponent.assign(float(k))
    kernel = model.layers[1].kernel

    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                out = tf.reduce_sum(model(X))
            return tape.gradient(out, kernel)
        return mirrored_strategy.run(replica_fn)

    per_replica = mirrored_strategy.experimental_local_results(step())
    assert len(per_replica) == 2
    for got in per_replica:
        np.testing.assert_array_equal(got.numpy(), plain_gradient(3) * 2.0**(0 + 1 + 2))
    assert _readings(step, model) == 2  # one reading per replica


def test_group_is_set_by_ownership():
    model, _ = bounded_model(boundaries=2)
    groups = {id(layer._ownership.group) for layer in boundaries_of(model)}
    assert len(groups) == 1
    assert tfdls.ScaleBoundary()._ownership.group is None
    assert _factor_readings.integer_exponent(float("nan"), -2, 3).numpy() == -2.0


def test_an_exported_owned_model_never_carries_a_factor(tmp_path):
    # A SavedModel traces the boundaries' backward passes. The group's reading
    # must not let it save a gradient times 2**e that nobody divides out: the
    # export fails on the untracked recorded exponents, or the loaded model's
    # gradient is the plain one.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((2,), dtype="int32"), keras.layers.Embedding(5, 3, name="emb"),
        keras.layers.Flatten(), keras.layers.Dense(3, name="d1"),
        tfdls.ScaleBoundary(initial_log2_factor=3, name="b0"), keras.layers.Dense(1, name="d2")])
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1), scale_boundaries=model)
    x = tf.constant([[1, 2]])
    path = str(tmp_path / "exported")
    try:
        model.export(path, verbose=False)
    except (KeyError, ValueError) as error:
        # The untracked ownership state: the recorded factors.
        assert "recorded_exponent" in str(error)
        return
    loaded = tf.saved_model.load(path)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(loaded.serve(x))
    kernel = [v for v in tape.watched_variables() if v.shape == (6, 3)][0]
    got = tape.gradient(out, kernel)
    model.get_layer("b0")._ownership.recorded_exponent.assign(0.0)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(x))
    np.testing.assert_array_equal(got.numpy(), tape.gradient(out, model.get_layer("d1").kernel))

