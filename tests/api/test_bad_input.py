"""Every invalid argument or input gets a clear error; one test per row of
the "Bad input" table in docs/bad-input.md (and the table lists exactly these rows)."""

import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls


def _built_optimizer():
    w = keras.Variable(np.ones(2, "float32"), name="w")
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    opt.build([w])
    return opt, w


def _apply_int_gradient():
    opt, w = _built_optimizer()
    opt.apply([tf.constant([1, 2])], [w])


def _apply_mismatched():
    opt, w = _built_optimizer()
    opt.apply([tf.ones(2), tf.ones(2)], [w])


def _apply_all_none():
    opt, w = _built_optimizer()
    opt.apply([None], [w])


def _apply_unbuilt_without_variables():
    tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1)).apply([tf.ones(2)])


def _unscaled_traced_unbuilt():
    opt = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    tf.function(lambda g: opt.get_unscaled_gradients([g]))(tf.ones(2))


def _apply_unknown_variable():
    opt, _ = _built_optimizer()
    opt.apply([tf.ones(2)], [keras.Variable(np.ones(2, "float32"), name="other")])


def _monitor_plain_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[tfdls.LossScaleMonitor()])


def _ambiguous_eager_gradients():
    opt, w = _built_optimizer()
    opt.get_unscaled_gradients([tf.ones(2)])
    opt.apply([tf.ones(2) * 2.0], [w])


def _traced(fn):
    """Runs fn(opt, w, scaled) in a tf.function (the misuse raises at trace time)."""
    opt, w = _built_optimizer()
    tf.function(lambda g: fn(opt, w, g))(tf.ones(2))


def _scaled_after_unscaling(opt, w, scaled):
    opt.get_unscaled_gradients([scaled])  # logged
    opt.apply([scaled], [w])


def _apply_twice(opt, w, scaled):
    unscaled = opt.get_unscaled_gradients([scaled])
    opt.apply(unscaled, [w])
    opt.apply(unscaled, [w])


def _apply_in_loop(opt, w, scaled):
    unscaled = opt.get_unscaled_gradients([scaled])
    for _ in tf.range(2):
        opt.apply(unscaled, [w])


def _through_arguments(opt, w, scaled):
    tf.function(lambda grads: opt.apply(grads, [w]))(opt.get_unscaled_gradients([scaled]))


def _stats_not_enabled():
    opt, _ = _built_optimizer()
    opt.gradient_stats()


DLS = tfdls.DynamicLossScale
LSO = tfdls.LossScaleOptimizer
SGD = keras.optimizers.SGD

# Table row of docs/bad-input.md (first cell, verbatim) -> [(call, exception type, message pattern), ...]
CASES = {
    "`DynamicLossScale(initial_loss_scale=0)` / `-1`": [
        (lambda: DLS(initial_loss_scale=0), ValueError, r"initial_loss_scale=0"),
        (lambda: DLS(initial_loss_scale=-1), ValueError, r"initial_loss_scale=-1"),
    ],
    "`DynamicLossScale(initial_loss_scale=nan)` / `inf`": [
        (lambda: DLS(initial_loss_scale=float("nan")), ValueError, r"initial_loss_scale=nan"),
        (lambda: DLS(initial_loss_scale=float("inf")), ValueError, r"initial_loss_scale=inf"),
    ],
    "`DynamicLossScale(initial_loss_scale=\"big\")`": [
        (lambda: DLS(initial_loss_scale="big"), TypeError, r"initial_loss_scale='big'"),
    ],
    "a scale above float32 max or below the smallest normal float32": [
        (lambda: DLS(initial_loss_scale=1e39), ValueError, r"initial_loss_scale=1e\+39"),
        (lambda: DLS(min_loss_scale=1e-39), ValueError, r"min_loss_scale=1e-39"),
    ],
    "`DynamicLossScale(increment_period=0)`": [
        (lambda: DLS(increment_period=0), ValueError, r"increment_period=0"),
    ],
    "`DynamicLossScale(increment_period=2.5)` / `True`": [
        (lambda: DLS(increment_period=2.5), TypeError, r"increment_period=2\.5"),
        (lambda: DLS(increment_period=True), TypeError, r"increment_period=True"),
    ],
    "`DynamicLossScale(multiplier=1.0)` / `0.5`": [
        (lambda: DLS(multiplier=1.0), ValueError, r"multiplier=1\.0"),
        (lambda: DLS(multiplier=0.5), ValueError, r"multiplier=0\.5"),
    ],
    "`DynamicLossScale(backoff_factor=1.5)` / `0` / `1`": [
        (lambda: DLS(backoff_factor=1.5), ValueError, r"backoff_factor=1\.5"),
        (lambda: DLS(backoff_factor=0), ValueError, r"backoff_factor=0"),
        (lambda: DLS(backoff_factor=1), ValueError, r"backoff_factor=1"),
    ],
    "`DynamicLossScale(hysteresis=0)`": [
        (lambda: DLS(hysteresis=0), ValueError, r"hysteresis=0"),
    ],
    "`DynamicLossScale(min_loss_scale=0)`": [
        (lambda: DLS(min_loss_scale=0), ValueError, r"min_loss_scale=0"),
    ],
    "`initial_loss_scale` below `min_loss_scale`": [
        (lambda: DLS(initial_loss_scale=1.0, min_loss_scale=2.0), ValueError,
         r"initial_loss_scale.*min_loss_scale=2\.0.*initial_loss_scale=1\.0"),
    ],
    "`initial_loss_scale` above `max_loss_scale`": [
        (lambda: DLS(initial_loss_scale=8.0, max_loss_scale=4.0), ValueError,
         r"max_loss_scale=4\.0.*initial_loss_scale=8\.0"),
    ],
    "`max_loss_scale` below `min_loss_scale`": [
        (lambda: DLS(initial_loss_scale=4.0, min_loss_scale=4.0, max_loss_scale=2.0),
         ValueError, r"max_loss_scale=2\.0"),
    ],
    "`FixedLossScale(-1)` / `0` / `inf`": [
        (lambda: tfdls.FixedLossScale(-1), ValueError, r"loss_scale_value=-1"),
        (lambda: tfdls.FixedLossScale(0), ValueError, r"loss_scale_value=0"),
        (lambda: tfdls.FixedLossScale(float("inf")), ValueError, r"loss_scale_value=inf"),
    ],
    "`tfdls.get(\"static\")`": [
        (lambda: tfdls.get("static"), ValueError, r"identifier='static'"),
    ],
    "`tfdls.get(None)`": [
        (lambda: tfdls.get(None), ValueError, r"identifier=None"),
    ],
    "`tfdls.deserialize({\"class_name\": \"Nope\"})`": [
        (lambda: tfdls.deserialize({"class_name": "Nope"}), ValueError, r"class_name='Nope'"),
    ],
    "`LossScaleOptimizer(\"adam\")`": [
        (lambda: LSO("adam"), TypeError, r"inner_optimizer='adam'.*keras\.optimizers\.get"),
    ],
    "`LossScaleOptimizer(None)`": [
        (lambda: LSO(None), TypeError, r"inner_optimizer=None"),
    ],
    "inner optimizer already a loss-scale optimizer": [
        (lambda: LSO(keras.optimizers.LossScaleOptimizer(SGD())), ValueError,
         r"already a loss-scale optimizer"),
    ],
    "inner optimizer with `loss_scale_factor` set": [
        (lambda: LSO(SGD(loss_scale_factor=2.0)), ValueError, r"loss_scale_factor=2\.0"),
    ],
    "`loss_scale=` together with `initial_scale=` / `dynamic_growth_steps=` / `dynamic=`": [
        (lambda: LSO(SGD(), loss_scale="dynamic", initial_scale=8.0), ValueError,
         r"not both.*loss_scale='dynamic'.*initial_scale=8\.0"),
    ],
    "`dynamic=False` with `dynamic_growth_steps=`": [
        (lambda: LSO(SGD(), dynamic=False, dynamic_growth_steps=10), ValueError,
         r"dynamic_growth_steps=10"),
    ],
    "a Keras base-optimizer keyword on the wrapper, e.g. `clipnorm=1.0` / `use_ema=True`": [
        (lambda: LSO(SGD(), clipnorm=1.0), ValueError,
         r"clipnorm=1\.0 on the `inner_optimizer`"),
        (lambda: LSO(SGD(), use_ema=True), ValueError, r"use_ema=True on the `inner_optimizer`"),
        (lambda: LSO(SGD(), weight_decay=0.0), ValueError,
         r"weight_decay=0\.0 on the `inner_optimizer`"),
        (lambda: LSO(SGD(), gradient_accumulation_steps=2), ValueError,
         r"gradient_accumulation_steps=2 on the `inner_optimizer`"),
    ],
    "`loss_scale_factor=` on the wrapper": [
        (lambda: LSO(SGD(), loss_scale_factor=0.5), ValueError,
         r"loss_scale_factor=0\.5.*loss_scale=0\.5"),
    ],
    "an unknown keyword, e.g. `foo=True`": [
        (lambda: LSO(SGD(), foo=True, bar=3), ValueError,
         r"arguments: `foo`, `bar` \(got foo=True, bar=3\)"),
    ],
    "`LossScaleOptimizer.from_config` of a config with a base-optimizer key set": [
        (lambda: LSO.from_config({**LSO(SGD()).get_config(), "clipnorm": 1.0}), ValueError,
         r"clipnorm=1\.0 on the `inner_optimizer`"),
        (lambda: LSO.from_config({**LSO(SGD()).get_config(), "learning_rate": 0.1}),
         ValueError, r"learning_rate=0\.1"),
    ],
    "`min_scale_policy=\"explode\"`": [
        (lambda: LSO(SGD(), min_scale_policy="explode"), ValueError,
         r"min_scale_policy='explode'"),
    ],
    "`overflow_attribution=\"yes\"`": [
        (lambda: LSO(SGD(), overflow_attribution="yes"), TypeError,
         r"overflow_attribution='yes'"),
    ],
    "`jit_compile=\"yes\"`": [
        (lambda: LSO(SGD(), jit_compile="yes"), ValueError, r"jit_compile='yes'"),
    ],
    "`gradient_stats=\"yes\"`": [
        (lambda: LSO(SGD(), gradient_stats="yes"), TypeError, r"gradient_stats='yes'"),
    ],
    "`all_reduce_dtype=\"int8\"` (anything but None and float16: `\"float16\"`, `tf.float16`, `np.float16`)": [
        (lambda: LSO(SGD(), all_reduce_dtype="int8"), ValueError, r"all_reduce_dtype='int8'"),
        (lambda: LSO(SGD(), all_reduce_dtype="bfloat16"), ValueError,
         r"all_reduce_dtype='bfloat16'"),
    ],
    "`all_reduce_dtype=\"float16\"` with a loss scale that never skips": [
        (lambda: LSO(SGD(), 128.0, all_reduce_dtype="float16"), ValueError,
         r"needs a loss scale that can skip.*FixedLossScale"),
    ],
    "`opt.gradient_stats()` without `gradient_stats=True`": [
        (_stats_not_enabled, ValueError, r"gradient_stats=True.*gradient_stats=False"),
    ],
    "a non-float gradient (e.g. int32)": [
        (_apply_int_gradient, TypeError, r"floating point.*int32"),
    ],
    "gradient and variable lists of different lengths": [
        (_apply_mismatched, ValueError, r"2 gradients for 1 variables"),
    ],
    "every gradient `None`": [
        (_apply_all_none, ValueError, r"No gradients provided for any variable"),
    ],
    "`apply(grads)` without variables on an unbuilt optimizer": [
        (_apply_unbuilt_without_variables, ValueError, r"trainable_variables"),
    ],
    "`get_unscaled_gradients(grads)` traced before the optimizer is built, with no `scale_loss` running before it whenever it runs": [
        (_unscaled_traced_unbuilt, ValueError, r"get_unscaled_gradients\(\) is traced before "
                                               r"this optimizer is built"),
    ],
    "`apply` with a variable the optimizer was not built with": [
        (_apply_unknown_variable, ValueError, r"other"),
    ],
    "eager `apply`, while a `get_unscaled_gradients` call is pending, of a gradient it did not return": [
        (_ambiguous_eager_gradients, ValueError, r"cannot tell whether to divide"),
    ],
    "`apply` of the scaled gradients (or anything computed from them) after `get_unscaled_gradients`": [
        (lambda: _traced(_scaled_after_unscaling), ValueError, r"computed from the scaled"),
    ],
    "a second `apply` of one `get_unscaled_gradients` call's outputs": [
        (lambda: _traced(_apply_twice), ValueError, r"already closed"),
    ],
    "`apply` in a loop body or nested `tf.function` of gradients unscaled outside it": [
        (lambda: _traced(_apply_in_loop), ValueError, r"loop body or a nested"),
    ],
    "gradients through a nested `tf.function`'s arguments while `get_unscaled_gradients` is pending outside": [
        (lambda: _traced(_through_arguments), ValueError, r"arguments of a nested"),
    ],
    "`LossScaleMonitor(update_freq=0)`": [
        (lambda: tfdls.LossScaleMonitor(update_freq=0), ValueError, r"update_freq=0"),
    ],
    "`LossScaleMonitor` on a model without a tfdls optimizer": [
        (_monitor_plain_optimizer, ValueError, r"tfdls\.LossScaleOptimizer"),
    ],
}


def _stack(regularizer=None, residual=False):
    if residual:
        inputs = keras.Input((2,))
        h = keras.layers.Dense(2, name="stem")(inputs)
        branch = tfdls.ScaleBoundary(name="inside")(keras.layers.Dense(2)(h))
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Add()([h, branch])))
    return keras.Sequential([keras.Input((2,)), tfdls.UnscaledInput(),
                             keras.layers.Dense(2, kernel_regularizer=regularizer, name="low"),
                             tfdls.ScaleBoundary(name="b"), keras.layers.Dense(1)])


class _Subclassed(keras.Model):
    def call(self, x):
        return x


def _boundary_step(model, opt):
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(tf.reduce_sum(model(tf.ones([1, 2]))))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


def _shared_below_two_boundaries():
    shared = keras.layers.Dense(2, name="twice")
    inputs = keras.Input((2,))
    h = shared(keras.layers.Dense(2)(tfdls.UnscaledInput()(inputs)))
    h = shared(keras.layers.Dense(2)(tfdls.ScaleBoundary(name="between")(h)))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    tfdls.LossScaleOptimizer(SGD(0.1), scale_boundaries=model)


def _stranger_with_boundaries():
    model = _stack()
    opt = tfdls.LossScaleOptimizer(SGD(0.1), scale_boundaries=model)
    opt.build(model.trainable_variables)
    opt.apply([tf.ones([1])], [keras.Variable([1.0], name="stranger")])


class _AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(tf.reduce_sum(x))
        return x


def _add_loss_below():
    model = keras.Sequential([keras.Input((2,)), tfdls.UnscaledInput(), keras.layers.Dense(2),
                              _AddsLoss(name="adds"),
                              tfdls.ScaleBoundary(name="b"), keras.layers.Dense(1)])
    _boundary_step(model, tfdls.LossScaleOptimizer(SGD(0.1), scale_boundaries=model))


def _gradient_penalty():
    model = _stack()
    LSO(SGD(0.1), scale_boundaries=model)
    x = tf.ones([1, 2])
    with tf.GradientTape() as tape:
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(model(x))
        loss = tf.reduce_sum(tf.square(inner.gradient(y, x)))
    tape.gradient(loss, model.trainable_variables)


def _feature_extractor():
    model = _stack()
    LSO(SGD(0.1), scale_boundaries=model)
    features = keras.Model(model.inputs, model.get_layer("low").output)
    x = tf.ones([1, 2])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(features(x))
    tape.gradient(y, x)


def _unknown_boundaries():
    # Traced: the function's gradients crossed the boundary.
    model = _stack()
    tf.function(_boundary_step)(model, tfdls.LossScaleOptimizer(SGD(0.1)))


def _owned_elsewhere():
    # Eager: the variable is below a boundary another optimizer owns.
    model = _stack()
    tfdls.LossScaleOptimizer(SGD(0.1), scale_boundaries=model)
    _boundary_step(model, tfdls.LossScaleOptimizer(SGD(0.1)))


def _unscaled_without_variables():
    model = _stack()
    opt = tfdls.LossScaleOptimizer(SGD(0.1), scale_boundaries=model)
    opt.get_unscaled_gradients([tf.ones(v.shape) for v in model.trainable_variables])


def _deep_float64():
    keras.mixed_precision.set_global_policy("float64")
    try:
        stack = [keras.Input((1,)), tfdls.UnscaledInput()]
        for i in range(61):
            stack += [keras.layers.Dense(1), tfdls.ScaleBoundary()]
        model = keras.Sequential(stack + [keras.layers.Dense(1)])
        LSO(SGD(0.1), scale_boundaries=model).build(model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")


CASES.update({
    "`ScaleBoundary(max_log2_factor=16)` / `min_log2_factor=-15` / `min_log2_factor` above `max_log2_factor`": [
        (lambda: tfdls.ScaleBoundary(max_log2_factor=16), ValueError, r"max_log2_factor=16"),
        (lambda: tfdls.ScaleBoundary(min_log2_factor=-15), ValueError, r"min_log2_factor=-15"),
        (lambda: tfdls.ScaleBoundary(min_log2_factor=3, max_log2_factor=2), ValueError,
         r"min_log2_factor=3"),
    ],
    "`ScaleBoundary(adjust_period=0)` / `margin_bits=nan`": [
        (lambda: tfdls.ScaleBoundary(adjust_period=0), ValueError, r"adjust_period=0"),
        (lambda: tfdls.ScaleBoundary(margin_bits=float("nan")), ValueError, r"margin_bits=nan"),
    ],
    "`add_scale_boundaries(model, every=0)` or a subclassed model": [
        (lambda: tfdls.add_scale_boundaries(_stack(), every=0), ValueError, r"every=0"),
        (lambda: tfdls.add_scale_boundaries(_Subclassed()), ValueError,
         r"Sequential or functional.*model=<"),
    ],
    "`scale_boundaries=` a model with a residual connection around a boundary": [
        (lambda: LSO(SGD(0.1), scale_boundaries=_stack(residual=True)), ValueError,
         r"layer 'stem'.*\['inside'\]"),
    ],
    "`scale_boundaries=` a model with a regularizer below a boundary": [
        (lambda: LSO(SGD(0.1), scale_boundaries=_stack(regularizer="l2")), ValueError,
         r"layer 'low' is below the scale boundary 'b'.*kernel_regularizer"),
    ],
    "`scale_boundaries=` with a fixed or non-power-of-two loss scale": [
        (lambda: LSO(SGD(0.1), 1024.0, scale_boundaries=_stack()), ValueError,
         r"DynamicLossScale whose values are powers of two.*loss_scale="),
        (lambda: LSO(SGD(0.1), DLS(3.0), scale_boundaries=_stack()), ValueError,
         r"loss_scale=DynamicLossScale"),
    ],
    "`apply` of gradients that crossed boundaries the optimizer was not given": [
        (_unknown_boundaries, ValueError, r"crossed the scale boundaries \['b'\]"),
    ],
    "`scale_boundaries=` a model calling one layer below different boundaries (placed by hand; `add_scale_boundaries` places none there)": [
        (_shared_below_two_boundaries, ValueError, r"layer 'twice' is called at more than one place"),
    ],
    "`apply` after a layer below a boundary added a loss (`add_loss`)": [
        (_add_loss_below, ValueError, r"layer 'adds' is below the scale boundary 'b' and its last call added a loss"),
    ],
    "`apply` with scale boundaries of a variable the optimizer was not built with": [
        (_stranger_with_boundaries, ValueError, r"'stranger' is not one this optimizer was built with"),
    ],
    "`apply` of a variable below boundaries another optimizer owns": [
        (_owned_elsewhere, ValueError, r"low/kernel' is below the scale boundaries \['b'\]"),
    ],
    "`get_unscaled_gradients(grads)` with scale boundaries, without `trainable_variables=`": [
        (_unscaled_without_variables, ValueError, r"trainable_variables=None"),
    ],
    "`scale_boundaries=` a model whose float input is used below a boundary without `UnscaledInput`": [
        (lambda: LSO(SGD(0.1), scale_boundaries=keras.Sequential(
            [keras.Input((2,), name="x"), keras.layers.Dense(2, name="low"),
             tfdls.ScaleBoundary(name="b"), keras.layers.Dense(1)])), ValueError,
         r"model input 'x' is used by layer 'low', below the scale boundaries \['b'\]"),
    ],
    "`UnscaledInput` not directly on a model input": [
        (lambda: LSO(SGD(0.1), scale_boundaries=keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(2), tfdls.UnscaledInput(name="late"),
             tfdls.ScaleBoundary(), keras.layers.Dense(1)])), ValueError,
         r"UnscaledInput 'late' is not the first layer"),
    ],
    "a gradient of a gradient through a boundary (a gradient penalty)": [
        (_gradient_penalty, ValueError, r"gradient of a gradient through UnscaledInput '.*'"),
    ],
    "an input gradient through a feature extractor sharing a boundary model's `UnscaledInput` but stopping below a boundary": [
        (_feature_extractor, ValueError, r"a gradient flowed into the layer 'low', which is below "
                                         r"the scale boundary 'b', from a call outside its model"),
    ],    "a float64 variable below more than 59 nested boundaries": [
        (_deep_float64, ValueError, r"variable '.*/kernel' is float64 and below 61 nested scale boundaries, more than 59"),
    ],
})


@pytest.mark.parametrize("row", sorted(CASES))
def test_bad_input_raises_clear_error(row):
    for call, error, pattern in CASES[row]:
        with pytest.raises(error, match=pattern):
            call()


def _documented_rows():
    page = (Path(__file__).parents[2] / "docs" / "bad-input.md").read_text()
    section = page.split("# Bad input", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not re.fullmatch(r"-+", cells[0]):
            rows.append(cells[0])
    return rows[1:]  # drop the header


def test_docs_table_lists_exactly_these_rows():
    assert sorted(_documented_rows()) == sorted(CASES)
