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
}


def _step(model, opt, between, split, helpers):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(X) - Y))
        scaled = opt.scale_loss(loss)
    grads = BETWEEN[between](opt, tape.gradient(scaled, variables), helpers)
    if split:  # two applies: the first steps the scale, the second must not see it
        opt.apply(grads[:2], variables[:2])
        opt.apply(grads[2:], variables[2:])
    else:
        opt.apply(grads, variables)


def _run(mode, between, split, steps=2, carry=True, per_call=1):
    whole_step_xla, jit_compile = MODES[mode]
    model, opt = _model(), _optimizer(jit_compile)
    if not carry:
        opt._carried.take = lambda: None
    opt.build(model.trainable_variables)
    helpers = {"grow": tf.function(lambda: _grow_scale(opt)), "split": split}
    helpers["grow"].get_concrete_function()  # traced before the step is

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


# Two steps in one call (as `steps_per_execution`) in graph mode only: the rule is
# per traced function, the same in every mode.
CALLS = [(mode, 1) for mode in MODES] + [("graph", 2)]


@pytest.mark.parametrize("split", [False, True], ids=["one_apply", "two_applies"])
@pytest.mark.parametrize("between", list(BETWEEN))
@pytest.mark.parametrize("mode, per_call", CALLS, ids=[f"{m}-{n}_steps" for m, n in CALLS])
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
