"""`apply` takes the scale its own function's `scale_loss` read, unread, only where nothing wrote.

The rule (`tfdls._carried_scale`): in a `tf.function`, `apply` takes the
scale the same function's last `scale_loss` read, as the live and the
recorded scale, and the gradients as not unscaled, while the function holds
no operation created after that call that takes the loss scale's variable,
the recorded scale or the unscaling flag other than to read it.

Each sequence below runs traced (graph, a compiled apply, the whole step
under XLA) twice: as it is, and with nothing carried, every value read as the
rules of `tfdls._record` and `tfdls._unscaling` say (tested against float64
references in test_recorded_values.py and test_unscaling_rule.py). The scale
grows on every finite apply, so a scale carried past a write would divide by
the wrong value. Both runs must agree bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

INITIAL_SCALE = 2.0**10
MODES = {  # the step's tf.function (jit_compile) and the optimizer's jit_compile
    "graph": (False, False),
    "compiled_apply": (False, True),
    "xla": (True, "auto"),
}


def _model():
    rng = np.random.default_rng(0)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.Constant(
            rng.standard_normal((3, 4)).astype("float32"))),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(
            rng.standard_normal((4, 2)).astype("float32"))),
    ])
    return model


def _optimizer(jit_compile):
    return tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(0.25),
        tfdls.DynamicLossScale(initial_loss_scale=INITIAL_SCALE, increment_period=1),
        jit_compile=jit_compile)


X = tf.constant(np.random.default_rng(1).standard_normal((5, 3)).astype("float32"))
Y = tf.constant(np.random.default_rng(2).standard_normal((5, 2)).astype("float32"))


def _grow_scale(opt):
    opt.loss_scale.current_loss_scale.assign(opt.loss_scale.current_loss_scale * 4.0)


# What runs between scale_loss and apply (given the optimizer and the scaled
# gradients; returns the gradients to apply). Each but "nothing" writes one of
# the three variables, or may.
BETWEEN = {
    "nothing": lambda opt, grads, helpers: grads,
    # With two applies, the first one's gradients only (the second divides the rest).
    "get_unscaled_gradients": lambda opt, grads, helpers: (
        opt.get_unscaled_gradients(grads[:2]) + list(grads[2:]) if helpers["split"]
        else opt.get_unscaled_gradients(grads)),
    "assignment": lambda opt, grads, helpers: (_grow_scale(opt), grads)[1],
    "nested_function": lambda opt, grads, helpers: (helpers["grow"](), grads)[1],
    "scale_update": lambda opt, grads, helpers: (
        opt.loss_scale.update([tf.constant([float("inf")])]), grads)[1],
    "branch": lambda opt, grads, helpers: (tf.cond(
        tf.reduce_sum(X) < 1e9, lambda: (_grow_scale(opt), tf.constant(0))[1],
        lambda: tf.constant(0)), grads)[1],
    # Code the graph does not show: a Python function, a dataset's map function (built
    # outside the step).
    "py_function": lambda opt, grads, helpers: _hidden(grads, helpers, lambda: tf.py_function(
        lambda: (_grow_scale(opt), 0.0)[1], [], tf.float32)),
    "dataset_iterator": lambda opt, grads, helpers: _hidden(
        grads, helpers, lambda: next(helpers["iterator"])),
}


def _hidden(grads, helpers, write):
    """Runs `write` after the gradients (so after `scale_loss`), and `apply` after it:
    TensorFlow orders neither against the variable it writes."""
    with tf.control_dependencies([grads[0]]):
        helpers["after"].append(write())
    return grads
# What XLA cannot compile: run in graph mode and with a compiled apply only.
NOT_IN_XLA = ("py_function", "dataset_iterator")


def _step(model, opt, between, split, helpers):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(X) - Y))
        scaled = opt.scale_loss(loss)
    helpers["after"] = []
    grads = BETWEEN[between](opt, tape.gradient(scaled, variables), helpers)
    with tf.control_dependencies(helpers["after"]):
        if split:  # two applies: the first steps the scale, the second must not see it
            opt.apply(grads[:2], variables[:2])
            opt.apply(grads[2:], variables[2:])
        else:
            opt.apply(grads, variables)


def _run(mode, between, split, steps=2, carry=True, per_call=1):
    whole_step_xla, jit_compile = MODES[mode]
    model, opt = _model(), _optimizer(jit_compile)
    if not carry:
        opt._carried.take = lambda loss_scale: None
    opt.build(model.trainable_variables)
    helpers = {"grow": tf.function(lambda: _grow_scale(opt)), "split": split}
    helpers["grow"].get_concrete_function()  # traced before the step is
    scale = opt.loss_scale.current_loss_scale
    # Run when asked for, not ahead (tf.data prefetches by default).
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    helpers["iterator"] = iter(tf.data.Dataset.range(100).map(
        lambda _: scale.assign(scale * 4.0)).with_options(options))

    def steps_of_one_call():  # several steps in one function, as steps_per_execution
        for _ in range(per_call):
            _step(model, opt, between, split, helpers)

    step = tf.function(steps_of_one_call, jit_compile=whole_step_xla)
    for _ in range(steps):
        step()
    state = [v.numpy() for v in model.trainable_variables]
    state += [opt.loss_scale.current_loss_scale.numpy(), opt._record.scale.numpy(),
              opt._unscaling.gradients_unscaled.numpy(), opt.iterations.numpy()]
    return state, step, opt


# Every write in every mode with one apply; with two applies (the record's own rule), the
# writes that take the variables; two steps in one call (as `steps_per_execution`) in
# graph mode: the rule is per traced function, the same in every mode.
SEQUENCES = (
    [(mode, 1, between, False) for mode in MODES for between in BETWEEN
     if not (mode == "xla" and between in NOT_IN_XLA)]
    + [(mode, 1, between, True) for mode in MODES
       for between in ("nothing", "get_unscaled_gradients", "assignment", "scale_update")]
    + [("graph", 2, between, False)
       for between in ("nothing", "get_unscaled_gradients", "py_function", "dataset_iterator")]
)


@pytest.mark.parametrize(
    "mode, per_call, between, split", SEQUENCES,
    ids=[f"{m}-{n}_steps-{b}-{'two_applies' if t else 'one_apply'}"
         for m, n, b, t in SEQUENCES])
def test_a_step_matches_the_one_that_reads_everything(mode, per_call, between, split):
    carried, _, _ = _run(mode, between, split, per_call=per_call)
    read, _, _ = _run(mode, between, split, carry=False, per_call=per_call)
    for c, r in zip(carried, read):
        np.testing.assert_array_equal(c, r)


def _reads(graph, variable):
    """How many reads of `variable` the traced function itself holds."""
    (handle,) = [internal for external, internal in graph.captures
                 if external is variable.handle]
    return sum(op.type == "ReadVariableOp" for op in handle.consumers())


@pytest.mark.parametrize("mode", list(MODES))
def test_apply_reads_neither_the_record_nor_the_flag_after_its_scale_loss(mode):
    _, step, opt = _run(mode, "nothing", split=False, steps=1)
    graph = step.get_concrete_function().graph
    assert _reads(graph, opt._record.scale) == 0
    assert _reads(graph, opt._unscaling.gradients_unscaled) == 0
    # The live scale: read once, by scale_loss.
    assert _reads(graph, opt.loss_scale.current_loss_scale) == 1


def test_a_loss_scale_replaced_between_scale_loss_and_apply_is_read():
    """`apply` steps the scale it has now; only the one `scale_loss` read is carried."""
    results = []
    for carry in (True, False):
        model, opt = _model(), _optimizer(False)
        if not carry:
            opt._carried.take = lambda loss_scale: None
        opt.build(model.trainable_variables)
        first = opt.loss_scale
        second = tfdls.DynamicLossScale(initial_loss_scale=2.0**5, increment_period=1)

        @tf.function
        def step():
            opt.loss_scale = first
            variables = model.trainable_variables
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(tf.reduce_mean(tf.square(model(X) - Y)))
            grads = tape.gradient(scaled, variables)
            opt.loss_scale = second
            opt.apply(grads, variables)

        step()
        results.append([first.current_loss_scale.numpy(), second.current_loss_scale.numpy()]
                       + [v.numpy() for v in model.trainable_variables])
    for carried, read in zip(*results):
        np.testing.assert_array_equal(carried, read)
