"""Gradients are divided by the values their backward pass multiplied by, recorded then.

Rule A (the recorded scale): `scale_loss` / `get_scaled_loss` record the scale
they multiply by, and every `apply` / `apply_gradients` after them divides by
that recorded scale, not by the scale as it is when the apply runs (an earlier
apply of the same step may have grown or shrunk it). Only where a variable
given to apply was already updated by this optimizer since the last
`scale_loss` (a loss multiplied by `loss_scale()` by hand) does apply divide
by the scale now. `get_unscaled_gradients` divides by the recorded scale too.

Rule B (scale boundaries shared by two optimizers): the optimizer given the
model last owns its boundaries; an `apply` of the other either raises a
`ValueError` and changes nothing, or is exact. One owner with two applies
after one `scale_loss` divides both by the factors the backward pass
multiplied by, although the first apply adapted them.

Rule C (partial unscaling): after `get_unscaled_gradients` of some gradients,
an apply that also gets a scaled gradient raises, naming its variable, and
changes nothing.

Rule D (a loss term below a boundary, computed from the model's own inner
layers): refused with nothing changed, or exact.

Every expectation is computed here, in float64 numpy, from the rule: a small
simulator of the dynamic scale (`ScaleReference`) and a hand-written
backward pass of a stack of Dense layers (`dense_gradients`).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except

MODES = ["eager", "function", "xla"]
# "function": a tf.function whose applies run as their own XLA clusters
# (jit_compile="auto", the default); "graph": the same with jit_compile=False,
# the apply uncompiled; "xla": the whole step compiled.
ALL_MODES = ["eager", "function", "graph", "xla"]
INITIAL_SCALE = 2.0**10
INF = float("inf")
# "Another optimizer owns the boundaries" / "the model was given to another optimizer".
ANOTHER_OWNER = r"another\s+(LossScale)?[Oo]ptimizer"


def _wrap(fn, mode):
    return fn if mode == "eager" else tf.function(fn, jit_compile=mode == "xla")


def _jit_compile(mode):
    return False if mode == "graph" else "auto"


def _optimizer(learning_rate=1.0, scale_boundaries=None, jit_compile="auto"):
    """SGD wrapped with a scale that doubles on every finite apply."""
    return tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate),
        tfdls.DynamicLossScale(initial_loss_scale=INITIAL_SCALE, increment_period=1),
        scale_boundaries=scale_boundaries, jit_compile=jit_compile,
    )


class ScaleReference:
    """The dynamic scale of `_optimizer` and rule A, in float64.

    `scale_loss()` records the scale and returns the multiplier; `hand_scale()`
    returns the scale now (records nothing); `apply()` divides by the recorded
    scale unless no `scale_loss` ran yet or one of its variables was updated
    since the last `scale_loss`, then by the scale now. A finite apply doubles
    the scale, a non-finite one skips and halves it (increment_period=1,
    hysteresis 1, min_loss_scale 1).
    """

    def __init__(self, learning_rate=1.0):
        self.scale = INITIAL_SCALE
        self.recorded = None
        self.updated = set()
        self.learning_rate = learning_rate
        self.iterations = 0

    def scale_loss(self):
        self.recorded = self.scale
        self.updated = set()
        return self.scale

    def hand_scale(self):
        return self.scale

    def apply(self, values, scaled_grads):
        """`values`, `scaled_grads`: {name: float64 array}; updates `values` in place."""
        names = set(scaled_grads)
        if self.recorded is None or names & self.updated:
            divisor = self.scale
        else:
            divisor = self.recorded
        if not all(np.all(np.isfinite(g)) for g in scaled_grads.values()):
            self.scale = max(self.scale / 2.0, 1.0)
            return
        for name, grad in scaled_grads.items():
            values[name] = values[name] - self.learning_rate * grad / divisor
        self.updated |= names
        self.scale *= 2.0
        self.iterations += 1


def _variables():
    """a, a scalar, and b, a vector, both 0; distinctive names for messages."""
    a = keras.Variable(np.float32(0.0), name="alpha_weight")
    b = keras.Variable(np.zeros(2, "float32"), name="beta_weight")
    return a, b


def _assert_state(opt, a, b, values, reference):
    np.testing.assert_array_equal(a.numpy().astype(np.float64), values["a"])
    np.testing.assert_array_equal(b.numpy().astype(np.float64), values["b"])
    assert float(opt.loss_scale().numpy()) == reference.scale
    assert int(opt.iterations.numpy()) == reference.iterations


# -- rule A: one scale_loss, two applies ------------------------------------------------

LINEAR = {"a": np.float64(3.0), "b": np.array([5.0, 5.0])}  # d(3a + 5 sum(b)) / d(a, b)


def _split_step(opt, a, b, order, style, overflow):
    """One tape, loss 3a + 5 sum(b) scaled once, then one apply per variable in `order`;
    `overflow`: a's gradient replaced by Inf."""
    variables = {"a": a, "b": b}

    def step():
        with tf.GradientTape() as tape:
            loss = 3.0 * a + 5.0 * tf.reduce_sum(b)
            scaled = opt.scale_loss(loss) if style == "keras3" else opt.get_scaled_loss(loss)
        grads = dict(zip("ab", tape.gradient(scaled, [a, b])))
        if overflow:
            grads["a"] = grads["a"] * INF
        for name in order:
            if style == "keras3":
                opt.apply([grads[name]], [variables[name]])
            else:
                opt.apply_gradients([(grads[name], variables[name])])

    return step


def _split_reference(order, overflow, steps=1):
    reference = ScaleReference()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    for _ in range(steps):
        multiplier = reference.scale_loss()
        for name in order:
            grad = LINEAR[name] * multiplier
            if overflow and name == "a":
                grad = grad * INF
            reference.apply(values, {name: grad})
    return values, reference


@pytest.mark.parametrize("style", ["keras3", "tf_keras"])
@pytest.mark.parametrize("order", ["ab", "ba"])
@pytest.mark.parametrize("mode", slow_except(ALL_MODES, ["function"]))
def test_a_second_apply_divides_by_the_scale_the_loss_was_multiplied_by(mode, order, style):
    # The first apply doubles the scale; the second must still divide by the
    # recorded one: a == -3 and b == -5 exactly (the original divided the
    # second by the grown scale: -2.5).
    a, b = _variables()
    opt = _optimizer(jit_compile=_jit_compile(mode))
    opt.build([a, b])
    step = _wrap(_split_step(opt, a, b, order, style, overflow=False), mode)
    values, reference = _split_reference(order, overflow=False)
    step()
    _assert_state(opt, a, b, values, reference)
    # A second step: scale_loss records the grown scale.
    step()
    values, reference = _split_reference(order, overflow=False, steps=2)
    _assert_state(opt, a, b, values, reference)


@pytest.mark.parametrize("order", ["ab", "ba"])
@pytest.mark.parametrize("mode", slow_except(ALL_MODES, ["function"]))
def test_an_overflowing_first_apply_leaves_the_second_divided_by_the_recorded_scale(mode, order):
    # a's apply is skipped and halves the scale; b still moves by exactly -5
    # (the original divided it by the halved scale: -10).
    a, b = _variables()
    opt = _optimizer(jit_compile=_jit_compile(mode))
    opt.build([a, b])
    step = _wrap(_split_step(opt, a, b, order, "keras3", overflow=True), mode)
    step()
    values, reference = _split_reference(order, overflow=True)
    assert values["a"] == 0.0 and reference.iterations == 1
    _assert_state(opt, a, b, values, reference)


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_get_unscaled_gradients_after_an_apply_divides_by_the_recorded_scale(mode, named):
    # scale_loss records 1024; a's apply grows the scale to 2048; b's gradient,
    # unscaled afterwards, is still 5 * 1024 / 1024 (the original: 2.5). Named
    # (trainable_variables=): b was not updated since the scale_loss, so the
    # recorded scale applies to it. Not named: the recorded scale while any
    # variable (here b) awaits its update since the scale_loss.
    a, b = _variables()
    opt = _optimizer()
    opt.build([a, b])

    def step():
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(3.0 * a + 5.0 * tf.reduce_sum(b))
        g_a, g_b = tape.gradient(scaled, [a, b])
        opt.apply_gradients([(g_a, a)])
        (u_b,) = opt.get_unscaled_gradients([g_b], trainable_variables=[b] if named else None)
        opt.apply_gradients([(u_b, b)])
        return u_b

    u_b = _wrap(step, mode)()
    reference = ScaleReference()
    recorded = reference.scale_loss()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    reference.apply(values, {"a": LINEAR["a"] * recorded})
    unscaled = LINEAR["b"] * recorded / recorded
    np.testing.assert_array_equal(u_b.numpy().astype(np.float64), unscaled)
    # Already unscaled: applied as given; the scale grows on this finite apply.
    values["b"] = values["b"] - unscaled
    reference.scale *= 2.0
    reference.iterations += 1
    _assert_state(opt, a, b, values, reference)


# -- rule A: several steps in one function ----------------------------------------------

# loss = sum(K / 2 * (v - TARGET)**2): gradient K * (v - TARGET). Powers of two
# and small integers: every value below is exact in float32 and float64.
K = {"a": 0.5, "b": 0.25}
TARGET = {"a": np.float64(3.0), "b": np.array([2.0, -6.0])}
STEPS = 3
OVERFLOW_STEP = 1  # a's gradient is Inf on this step


def _quadratic_loss(a, b):
    return (K["a"] / 2 * tf.square(a - float(TARGET["a"]))
            + tf.reduce_sum(K["b"] / 2 * tf.square(b - TARGET["b"].astype("float32"))))


def _loop_reference():
    reference = ScaleReference()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    for step in range(STEPS):
        multiplier = reference.scale_loss()
        grads = {n: K[n] * (values[n] - TARGET[n]) * multiplier for n in "ab"}
        if step == OVERFLOW_STEP:
            grads["a"] = grads["a"] * INF
        for name in "ab":
            reference.apply(values, {name: grads[name]})
    return values, reference


@pytest.mark.parametrize("loop", ["python", "tf_range"])
@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_steps_of_a_loop_in_one_function_divide_by_their_recorded_scales(mode, loop):
    a, b = _variables()
    opt = _optimizer()
    opt.build([a, b])

    def one_step(i):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_quadratic_loss(a, b))
        g_a, g_b = tape.gradient(scaled, [a, b])
        g_a = g_a * tf.where(tf.equal(i, OVERFLOW_STEP), INF, 1.0)
        opt.apply([g_a], [a])
        opt.apply([g_b], [b])

    def steps():
        if loop == "python":
            for i in range(STEPS):
                one_step(tf.constant(i))
        else:
            for i in tf.range(STEPS):
                one_step(i)

    _wrap(steps, mode)()
    values, reference = _loop_reference()
    _assert_state(opt, a, b, values, reference)


# -- rule A: losses scaled by hand divide by the scale now ------------------------------


def _hand_scaled_step(opt, a, b):
    def step():
        with tf.GradientTape() as tape:
            scaled = _quadratic_loss(a, b) * opt.loss_scale()
        opt.apply(tape.gradient(scaled, [a, b]), [a, b])

    return step


def _hand_reference_step(reference, values):
    multiplier = reference.hand_scale()
    reference.apply(values, {n: K[n] * (values[n] - TARGET[n]) * multiplier for n in "ab"})


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_losses_scaled_by_hand_without_scale_loss_are_exact(mode):
    a, b = _variables()
    opt = _optimizer()
    opt.build([a, b])
    step = _wrap(_hand_scaled_step(opt, a, b), mode)
    reference = ScaleReference()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    for _ in range(STEPS):
        step()
        _hand_reference_step(reference, values)
        _assert_state(opt, a, b, values, reference)


@pytest.mark.parametrize("first", ["one_apply", "split_applies"])
@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_hand_scaled_step_after_a_scale_loss_step_divides_by_the_scale_now(mode, first):
    # The step with scale_loss updated a and b (in one apply, or one apply
    # each: the original divided the second by the grown scale); the
    # hand-scaled steps after it multiply by the scale now, and divide by it
    # (their variables were updated since the last scale_loss, whose recorded
    # scale is 4 times smaller by then).
    a, b = _variables()
    opt = _optimizer()
    opt.build([a, b])
    groups = ["ab"] if first == "one_apply" else ["a", "b"]
    variables = {"a": a, "b": b}

    def recorded_step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_quadratic_loss(a, b))
        grads = dict(zip("ab", tape.gradient(scaled, [a, b])))
        for group in groups:
            opt.apply([grads[n] for n in group], [variables[n] for n in group])

    hand = _hand_scaled_step(opt, a, b)

    def steps():
        recorded_step()
        hand()
        hand()

    _wrap(steps, mode)()
    reference = ScaleReference()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    multiplier = reference.scale_loss()
    grads = {n: K[n] * (values[n] - TARGET[n]) * multiplier for n in "ab"}
    for group in groups:
        reference.apply(values, {n: grads[n] for n in group})
    _hand_reference_step(reference, values)
    _hand_reference_step(reference, values)
    _assert_state(opt, a, b, values, reference)


# -- rule A: get_unscaled_gradients traced before the optimizer is built -----------------


def _unscaled_step(opt, a, b, how):
    """A tf_keras style step whose get_unscaled_gradients is traced before apply_gradients
    builds the optimizer. The loss multiplied by loss_scale() by hand ("hand";
    "hand_named": the variables passed) or by get_scaled_loss: in the same function
    ("scaled"), in a tf.function it calls ("scaled_in_helper"), before a tf.cond whose
    branch unscales and applies ("scaled_then_cond"), before a loop or a nested
    tf.function that does ("scaled_then_loop", "scaled_then_nested")."""

    def scaled_loss():
        loss = _quadratic_loss(a, b)
        return loss * opt.loss_scale() if how.startswith("hand") else opt.get_scaled_loss(loss)

    def unscale_and_apply(grads):
        named = [a, b] if how == "hand_named" else None
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads, named), [a, b]))

    helper = tf.function(scaled_loss)
    nested = tf.function(unscale_and_apply)

    def step():
        with tf.GradientTape() as tape:
            scaled = helper() if how == "scaled_in_helper" else scaled_loss()
        grads = tape.gradient(scaled, [a, b])
        if how == "scaled_then_cond":
            tf.cond(tf.reduce_sum(b) < 1e9, lambda: unscale_and_apply(grads) or tf.no_op(),
                    tf.no_op)
        elif how == "scaled_then_loop":
            for _ in tf.range(1):
                unscale_and_apply(grads)
        elif how == "scaled_then_nested":
            nested(grads)
        else:
            unscale_and_apply(grads)

    return step


def _unscaled_reference_step(how, reference, values):
    multiplier = reference.hand_scale() if how.startswith("hand") else reference.scale_loss()
    reference.apply(values, {n: K[n] * (values[n] - TARGET[n]) * multiplier for n in "ab"})


def _after_an_unapplied_scale_loss():
    """Fresh variables, an unbuilt optimizer and its reference, after one scale_loss that
    no apply follows (a look at a scaled loss): the record that may go stale."""
    a, b = _variables()
    opt = _optimizer()
    reference = ScaleReference()
    opt.scale_loss(tf.constant(0.0))
    reference.scale_loss()
    return a, b, opt, reference


# Where a record runs before the read whenever the read runs, with no apply between.
EXACT_UNBUILT = ["scaled", "scaled_in_helper", "scaled_then_cond"]
# Where the read could run after an apply that followed the record: a loss scaled by
# hand, a loop body, a nested function (a later iteration or call).
REFUSED_UNBUILT = ["hand", "hand_named", "scaled_then_loop", "scaled_then_nested"]
UNBUILT_CASES = ([("eager", how) for how in ["hand", "hand_named", "scaled"]]
                 + [(mode, how) for mode in ["function", "xla"] for how in EXACT_UNBUILT])


@pytest.mark.parametrize("mode, how", slow_except(UNBUILT_CASES, [
    ("eager", "hand"), ("function", "scaled"), ("function", "scaled_in_helper"),
    ("function", "scaled_then_cond")]))
def test_get_unscaled_gradients_traced_before_the_build_divides_by_what_multiplied(mode, how):
    """After a scale_loss that was never applied (a look at a scaled loss), every step
    divides by the scale that multiplied its loss: by hand, the scale now (the record
    is stale once the variables were updated); by get_scaled_loss, its record. (The
    trace read the record before apply built the optimizer and is not traced again.)"""
    a, b, opt, reference = _after_an_unapplied_scale_loss()
    step = _wrap(_unscaled_step(opt, a, b, how), mode)
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    for _ in range(STEPS):
        step()
        _unscaled_reference_step(how, reference, values)
        _assert_state(opt, a, b, values, reference)


@pytest.mark.parametrize("how", REFUSED_UNBUILT)
@pytest.mark.parametrize("mode", slow_except(["function", "xla"], ["function"]))
def test_get_unscaled_gradients_traced_before_the_build_without_its_record_is_refused(
        mode, how):
    """Traced before the build where no record runs before the read whenever the read
    runs: what the trace would read depends on applies after it (here, one that makes
    the earlier scale_loss's record stale). Refused, nothing changed; built first, the
    step is exact."""
    a, b, opt, reference = _after_an_unapplied_scale_loss()
    step = _wrap(_unscaled_step(opt, a, b, how), mode)
    with pytest.raises(ValueError, match=r"get_unscaled_gradients\(\) is traced before this "
                                         r"optimizer is built.*optimizer\.build\("):
        step()
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    _assert_state(opt, a, b, values, reference)
    opt.build([a, b])
    step = _wrap(_unscaled_step(opt, a, b, how), mode)
    for _ in range(STEPS):
        step()
        _unscaled_reference_step(how, reference, values)
    _assert_state(opt, a, b, values, reference)


def test_unscaling_some_variables_eagerly_leaves_the_optimizer_unbuilt():
    """Eagerly, the gradients unscaled group by group with their variables named: the
    first call does not build the optimizer with its group alone (the apply of both
    would be refused), and the step is exact."""
    a, b = _variables()
    opt = _optimizer()
    reference = ScaleReference()
    with tf.GradientTape() as tape:
        scaled = opt.get_scaled_loss(_quadratic_loss(a, b))
    g_a, g_b = tape.gradient(scaled, [a, b])
    (u_a,) = opt.get_unscaled_gradients([g_a], [a])
    (u_b,) = opt.get_unscaled_gradients([g_b], [b])
    opt.apply_gradients(zip([u_a, u_b], [a, b]))
    values = {"a": np.float64(0.0), "b": np.zeros(2)}
    _unscaled_reference_step("scaled", reference, values)
    _assert_state(opt, a, b, values, reference)


# -- rule C: partial unscaling -----------------------------------------------------------


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_scaled_gradient_applied_with_unscaled_ones_is_refused_by_name(mode):
    # get_unscaled_gradients divided g_a only; g_b is still scaled. The original
    # raised eagerly without naming b and applied g_b undivided in a graph
    # (b moved by 5 * 1024).
    a, b = _variables()
    opt = _optimizer()
    opt.build([a, b])

    def step():
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(3.0 * a + 5.0 * tf.reduce_sum(b))
        g_a, g_b = tape.gradient(scaled, [a, b])
        unscaled = opt.get_unscaled_gradients([g_a])
        opt.apply([unscaled[0], g_b], [a, b])

    with pytest.raises(ValueError, match=re.escape(b.path)):
        _wrap(step, mode)()
    values, reference = {"a": np.float64(0.0), "b": np.zeros(2)}, ScaleReference()
    _assert_state(opt, a, b, values, reference)


# -- rules B and D: models with scale boundaries ------------------------------------------

WIDTH = 4
BOUNDARY_RATE = 0.25  # SGD's learning rate in these tests (a power of two)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(7)
    return (rng.normal(size=(8, 3)).astype("float32"),
            rng.normal(size=(8, 1)).astype("float32"))


def _bounded_model(layers=3, **boundary_kwargs):
    """Dense layers d0..d{layers-1} (linear), a boundary below each one but d0
    (`add_scale_boundaries(every=1)`), an `UnscaledInput` on the float input."""
    keras.utils.set_random_seed(3)
    stack = [keras.Input((3,))]
    stack += [keras.layers.Dense(WIDTH, name=f"d{i}") for i in range(layers - 1)]
    stack.append(keras.layers.Dense(1, name=f"d{layers - 1}"))
    model = tfdls.add_scale_boundaries(keras.Sequential(stack), every=1, **boundary_kwargs)
    expected = ["unscaled_input"]
    for i in range(layers):
        expected += [f"d{i}"] + ([] if i == layers - 1 else [f"scale_boundary_{2 * i + 2}"])
    assert [layer.name for layer in model.layers] == expected
    return model


def _dense_layers(model):
    return [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]


def _mse(prediction, y):
    return tf.reduce_mean(tf.square(prediction - y))


def dense_gradients(model, x, y, aux_after=None):
    """The true gradients of mean((model(x) - y)**2) (+ mean(h**2) of the output h of
    Dense layer `aux_after - 1`), in float64 at the model's current weights, per
    variable of `model.trainable_variables` (a kernel and a bias per layer)."""
    params = [(layer.kernel.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64))
              for layer in _dense_layers(model)]
    acts = [x.astype(np.float64)]
    for kernel, bias in params:
        acts.append(acts[-1] @ kernel + bias)
    upstream = 2.0 * (acts[-1] - y.astype(np.float64)) / acts[-1].size
    grads = [None] * len(params)
    for i in reversed(range(len(params))):
        grads[i] = (acts[i].T @ upstream, upstream.sum(axis=0))
        upstream = upstream @ params[i][0].T
        if aux_after == i:
            upstream = upstream + 2.0 * acts[i] / acts[i].size
    flat = [g for pair in grads for g in pair]
    assert len(flat) == len(model.trainable_variables)
    return flat


def _numpy(variables):
    return [v.numpy().astype(np.float64) for v in variables]


def _factors(model):
    return [float(layer.exponent().numpy()) for layer in model.layers
            if isinstance(layer, tfdls.ScaleBoundary)]


def _assert_sgd_update(before, after, grads, what):
    """`after` is SGD's step from `before` on the float64 `grads`, to float32 rounding
    (the errors these tests look for are factors of 2 and more)."""
    errors = [float(np.linalg.norm((new - old) + BOUNDARY_RATE * grad)
                    / np.linalg.norm(BOUNDARY_RATE * grad))
              for old, new, grad in zip(before, after, grads)]
    for k, (old, new, grad) in enumerate(zip(before, after, grads)):
        np.testing.assert_allclose(
            new, old - BOUNDARY_RATE * grad, rtol=1e-5, atol=1e-6,
            err_msg=f"{what}, variable {k}; relative errors of the updates: "
                    f"{[round(e, 6) for e in errors]}")


def _split_model(model, head_layers):
    """(backbone variables, head variables): the last `head_layers` Dense layers are the head."""
    layers = _dense_layers(model)
    backbone = [v for layer in layers[:-head_layers] for v in layer.trainable_variables]
    head = [v for layer in layers[-head_layers:] for v in layer.trainable_variables]
    assert backbone + head == list(model.trainable_variables)
    return backbone, head


def _two_optimizers(model, owner):
    """Two optimizers given `model`; `owner` ("backbone" or "head") is given it last."""
    first = "head" if owner == "backbone" else "backbone"
    optimizers = {first: _optimizer(BOUNDARY_RATE, scale_boundaries=model, jit_compile=False)}
    # Uncompiled applies (jit_compile=False): compiling four per test doubled the
    # file's time; the compiled division by recorded factors is the one-owner
    # test's ("function" and "xla").
    optimizers[owner] = _optimizer(BOUNDARY_RATE, scale_boundaries=model, jit_compile=False)
    return optimizers


def _optimizer_state(opt):
    return int(opt.iterations.numpy()), float(opt.loss_scale().numpy())


def _run_two_optimizer_steps(mode, owner, order, head_layers, steps, batch, **boundary_kwargs):
    """`steps` steps of the backbone's and the head's optimizer on one model (one tape,
    each optimizer scales the loss), applied in `order`; checks every apply."""
    x, y = batch
    model = _bounded_model(**boundary_kwargs)
    variables = dict(zip(("backbone", "head"), _split_model(model, head_layers)))
    optimizers = _two_optimizers(model, owner)
    for role, opt in optimizers.items():
        opt.build(variables[role])

    def gradients(roles):
        with tf.GradientTape(persistent=True) as tape:
            loss = _mse(model(x), y)
            scaled = {role: optimizers[role].scale_loss(loss) for role in roles}
        return {role: tape.gradient(scaled[role], variables[role]) for role in roles}

    def apply(role, grads):
        optimizers[role].apply(grads[role], variables[role])

    def both():
        grads = gradients(order)
        for role in order:
            apply(role, grads)

    def owner_only():
        apply(owner, gradients([owner]))

    traced_both, traced_owner = _wrap(both, mode), _wrap(owner_only, mode)
    factors_at_start = _factors(model)
    for step in range(steps):
        truth = dict(zip(("backbone", "head"),
                         _split_model_grads(dense_gradients(model, x, y), variables)))
        before = {role: _numpy(variables[role]) for role in variables}
        states = {role: _optimizer_state(opt) for role, opt in optimizers.items()}
        factors = _factors(model)
        raised = {}
        if mode == "eager":
            grads = gradients(order)
            for role in order:
                try:
                    apply(role, grads)
                except ValueError as error:
                    raised[role] = str(error)
        else:
            try:
                traced_both()
            except ValueError as error:
                # Refused while tracing: nothing ran, the owner's apply neither.
                assert _factors(model) == factors
                for role in variables:
                    _assert_unchanged(role, before, variables, states, optimizers)
                raised = {role: str(error) for role in variables if role != owner}
                traced_owner()
        assert owner not in raised, (
            f"step {step}: the owner's ({owner}) apply raised: {raised.get(owner)}")
        for role in variables:
            if role in raised:
                assert re.search(ANOTHER_OWNER, raised[role]), raised[role]
                _assert_unchanged(role, before, variables, states, optimizers)
            else:
                _assert_sgd_update(before[role], _numpy(variables[role]), truth[role],
                                   f"step {step}, the {role}'s apply (owner: {owner}, "
                                   f"order: {order}, factors {factors} -> {_factors(model)})")
    return model, factors_at_start


def _split_model_grads(grads, variables):
    count = len(variables["backbone"])
    return grads[:count], grads[count:]


def _assert_unchanged(role, before, variables, states, optimizers):
    for old, new in zip(before[role], _numpy(variables[role])):
        np.testing.assert_array_equal(new, old)
    assert _optimizer_state(optimizers[role]) == states[role], role


TWO_OPTIMIZER_CASES = [(owner, order) for owner in ("head", "backbone")
                       for order in (("backbone", "head"), ("head", "backbone"))]
TWO_OPTIMIZER_IDS = [f"owner_{owner}-{order[0]}_first" for owner, order in TWO_OPTIMIZER_CASES]


@pytest.mark.parametrize("owner, order", TWO_OPTIMIZER_CASES, ids=TWO_OPTIMIZER_IDS)
@pytest.mark.parametrize("mode", slow_except(["eager", "graph"], ["graph"]))
def test_two_optimizers_on_one_model_with_boundaries(mode, owner, order, batch):
    # Factors of 2**3 (the default adjust_period: the first step adapts them).
    _run_two_optimizer_steps(mode, owner, order, head_layers=1, steps=2, batch=batch,
                             initial_log2_factor=3)


@pytest.mark.parametrize("owner, order", TWO_OPTIMIZER_CASES, ids=TWO_OPTIMIZER_IDS)
@pytest.mark.parametrize("mode", slow_except(["eager", "graph"], ["graph"]))
def test_two_optimizers_when_the_heads_adaptation_changes_the_factors(mode, owner, order, batch):
    # The head holds the top layer and the block directly below the top
    # boundary, so its apply moves that boundary's factor (adjust_period=1,
    # starting far too high at 2**12); the backbone's gradient crossed the old
    # factor. The original divided the backbone's by the moved factors when
    # the head applied first (d0's update 2**12 times too small).
    model, at_start = _run_two_optimizer_steps(
        mode, owner, order, head_layers=2, steps=2, batch=batch,
        initial_log2_factor=12, adjust_period=1)
    if owner == "head":
        assert _factors(model) != at_start, "the head's adaptation should have moved a factor"


@pytest.mark.parametrize("order", [("head", "backbone"), ("backbone", "head")],
                         ids=["head_first", "backbone_first"])
@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_one_owner_two_applies_after_one_scale_loss_divide_by_the_backward_factors(
        mode, order, batch):
    # One optimizer, one scale_loss, two applies: the head's (top layer and the
    # block below the top boundary) adapts the factors (adjust_period=1) and
    # grows the scale; the backbone's must still divide by what its backward
    # pass multiplied by.
    x, y = batch
    model = _bounded_model(initial_log2_factor=12, adjust_period=1)
    backbone, head = _split_model(model, head_layers=2)
    variables = {"backbone": backbone, "head": head}
    opt = _optimizer(BOUNDARY_RATE, scale_boundaries=model)
    opt.build(model.trainable_variables)

    def step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_mse(model(x), y))
        grads = dict(zip(("backbone", "head"),
                         _split_model_grads(tape.gradient(scaled, backbone + head), variables)))
        for role in order:
            opt.apply(grads[role], variables[role])

    traced = _wrap(step, mode)
    at_start = _factors(model)
    for number in range(2):
        truth = dense_gradients(model, x, y)
        before = _numpy(model.trainable_variables)
        factors = _factors(model)
        traced()
        _assert_sgd_update(before, _numpy(model.trainable_variables), truth,
                           f"step {number}, order {order}, factors {factors} -> {_factors(model)}")
    assert _factors(model) != at_start, "the head's apply should have moved a factor"


@pytest.mark.parametrize("mode", slow_except(["eager", "function"], ["function"]))
def test_a_backward_pass_between_two_applies_leaves_their_factors(mode, batch):
    # Found by review: the head's apply adapts a factor (2**12 -> 1), then an
    # input-gradient (saliency) pass runs through the model, then the backbone's
    # apply: its gradients were multiplied by the factors of the step's
    # scale_loss, and every backward pass of the step multiplies by those too
    # (with factors read per backward pass, the saliency pass re-recorded the
    # new factor and the backbone moved 4096x too far).
    x, y = batch
    model = _bounded_model(initial_log2_factor=12, adjust_period=1)
    backbone, head = _split_model(model, head_layers=2)
    opt = _optimizer(BOUNDARY_RATE, scale_boundaries=model)
    opt.build(model.trainable_variables)
    x_tensor = tf.constant(x)

    def step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_mse(model(x), y))
        grads = tape.gradient(scaled, backbone + head)
        opt.apply(grads[len(backbone):], head)
        with tf.GradientTape() as saliency_tape:
            saliency_tape.watch(x_tensor)
            out = tf.reduce_sum(model(x_tensor))
        saliency = saliency_tape.gradient(out, x_tensor)
        opt.apply(grads[:len(backbone)], backbone)
        return saliency

    traced = _wrap(step, mode)
    at_start = _factors(model)
    for number in range(2):
        truth = dense_gradients(model, x, y)
        before = _numpy(model.trainable_variables)
        saliency = traced()
        _assert_sgd_update(before, _numpy(model.trainable_variables), truth,
                           f"step {number}, factors -> {_factors(model)}")
        assert np.all(np.isfinite(saliency.numpy()))
    assert _factors(model) != at_start, "the head's apply should have moved a factor"


@pytest.mark.parametrize("how", ["stop_gradient", "frozen"])
@pytest.mark.parametrize("mode", slow_except(["eager", "function"], ["function"]))
def test_a_teacher_sharing_the_layers_may_give_targets(mode, how, batch):
    # Found by review: features of a model whose layers sit below owned
    # boundaries, used as a student's targets (distillation), under the
    # student's tape: no gradient reaches the teacher (tf.stop_gradient, or
    # its layers frozen), so nothing is refused; the student's update is SGD
    # on its own gradient.
    x, _ = batch
    teacher = _bounded_model()
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=teacher)
    # Its layers up to d1 (below the top boundary), outside the teacher.
    features = keras.Sequential([keras.Input((3,))] + teacher.layers[:4])
    assert features.layers[-1].name == "d1"
    if how == "frozen":
        teacher.trainable = False
    student = keras.layers.Dense(WIDTH)
    student.build((None, 3))
    student_opt = keras.optimizers.SGD(BOUNDARY_RATE)

    def step():
        with tf.GradientTape() as tape:
            target = features(x)
            if how == "stop_gradient":
                target = tf.stop_gradient(target)
            loss = _mse(student(x), target)
        student_opt.apply(tape.gradient(loss, student.trainable_variables),
                          student.trainable_variables)
        return target

    before = _numpy(student.trainable_variables)
    target = _wrap(step, mode)().numpy().astype(np.float64)
    kernel, bias = before
    upstream = 2.0 * (x.astype(np.float64) @ kernel + bias - target) / target.size
    truth = [x.astype(np.float64).T @ upstream, upstream.sum(axis=0)]
    for old, new, grad in zip(before, _numpy(student.trainable_variables), truth):
        np.testing.assert_allclose(new, old - BOUNDARY_RATE * grad, rtol=1e-5, atol=1e-6)


# -- rule D: a loss term below a boundary --------------------------------------------------
#
# Kept apart from the rest: the hardest of these rules to implement (it may be
# the last to pass). An auxiliary loss computed from an inner activation by
# calling the model's own first layers (its UnscaledInput and d0) directly:
# its gradient reaches d0 without crossing the boundaries above d0, so
# dividing d0's whole gradient by their factors is wrong. The original applied
# it silently: d0's kernel and bias updates 11% and 14% off (relative norm of
# the error; elementwise up to 8 times) with factors of 2**3, in eager, graph
# and XLA alike.


@pytest.mark.parametrize("mode", slow_except(MODES, ["function"]))
def test_a_loss_below_a_boundary_is_refused_or_exact(mode, batch):
    x, y = batch
    model = _bounded_model(initial_log2_factor=3, min_log2_factor=3, max_log2_factor=3)
    unscaled_input, first = model.layers[0], model.layers[1]
    assert isinstance(unscaled_input, tfdls.UnscaledInput) and first.name == "d0"
    opt = _optimizer(BOUNDARY_RATE, scale_boundaries=model)
    variables = model.trainable_variables
    opt.build(variables)

    def step():
        with tf.GradientTape() as tape:
            main = _mse(model(x), y)
            inner = first(unscaled_input(x))
            total = main + tf.reduce_mean(tf.square(inner))
            scaled = opt.scale_loss(total)
        opt.apply(tape.gradient(scaled, variables), variables)

    truth = dense_gradients(model, x, y, aux_after=1)
    before, state, factors = _numpy(variables), _optimizer_state(opt), _factors(model)
    try:
        _wrap(step, mode)()
    except ValueError:
        for old, new in zip(before, _numpy(variables)):
            np.testing.assert_array_equal(new, old)
        assert _optimizer_state(opt) == state and _factors(model) == factors
        return
    _assert_sgd_update(before, _numpy(variables), truth, f"{mode}: loss below a boundary")
