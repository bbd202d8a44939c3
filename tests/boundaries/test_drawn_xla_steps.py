"""Scale boundaries inside XLA, where the segments' divisors go through an optimization
barrier (`_compat.computed_once`): drawn factors, loss scales, gradients and call styles on
one model of float64, float32, bfloat16 and float16 layers (and an Embedding's
IndexedSlices) against a float64 numpy reference, bit for bit; a skipped step changes
nothing (from an outside review of that change)."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdls

# layer name, dtype; the boundaries above layer k are the model's boundaries[k:]. Top to
# bottom the chain
# out <- b3 <- d(float16) <- b2 <- c(bfloat16) <- b1 <- b(float32) <- b0 <- a(float64)
# <- be <- emb(float32, IndexedSlices).
LAYERS = [("emb", "float32"), ("a", "float64"), ("b", "float32"), ("c", "bfloat16"),
          ("d", "float16"), ("out", "float32")]
NP_DTYPE = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
            "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def hypothesis():
    return pytest.importorskip("hypothesis")


def _model():
    keras.utils.set_random_seed(0)
    bounds = dict(initial_log2_factor=0, min_log2_factor=-14, max_log2_factor=15)
    inputs = keras.Input((2,), dtype="int32")
    h = keras.layers.Embedding(6, 2, dtype="float32", name="emb")(inputs)
    h = keras.layers.Flatten(dtype="float32")(h)
    h = tfdls.ScaleBoundary(**bounds, name="be")(h)
    for k, (name, dtype) in enumerate(LAYERS[1:-1]):
        h = keras.layers.Dense(2, dtype=dtype, name=name)(h)
        h = tfdls.ScaleBoundary(**bounds, name=f"b{k}")(h)
    out = keras.layers.Dense(1, dtype="float32", name="out")(h)
    return keras.Model(inputs, out)


@pytest.mark.filterwarnings("ignore::tfdls.BFloat16Warning")  # the bfloat16 layer, on purpose
def test_drawn_xla_steps_match_float64(hypothesis):
    from hypothesis import HealthCheck, assume, given, settings, strategies as st

    model = _model()
    boundaries = [l for l in model.layers if isinstance(l, tfdls.ScaleBoundary)]
    assert [b.name for b in boundaries] == ["be", "b0", "b1", "b2", "b3"]
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tfdls.DynamicLossScale(1.0, min_loss_scale=2.0**-20),
        scale_boundaries=model)
    variables = model.trainable_variables
    opt.build(variables)
    layer_index = {name: i for i, (name, _) in enumerate(LAYERS)}
    # boundaries above a variable of layer i: boundaries[i:] (emb is below all five).
    above = [layer_index[v.path.split("/")[0]] for v in variables]
    def as_grads(values):
        # Unique rows: SGD adds each once.
        ids = tf.constant([4, 1], tf.int32)
        grads = []
        for v, g in zip(variables, values):
            if v.path.startswith("emb"):
                grads.append(tf.IndexedSlices(g, ids, tf.constant(list(v.shape), tf.int32)))
            else:
                grads.append(g)
        return grads

    @tf.function(jit_compile=True)
    def apply_step(values):
        opt.apply(as_grads(values), variables)

    @tf.function(jit_compile=True)
    def tf_keras_step(values):
        unscaled = opt.get_unscaled_gradients(as_grads(values), variables)
        opt.apply_gradients(zip(unscaled, variables))

    @tf.function(jit_compile=True)
    def unscaled_only(values):
        return opt.get_unscaled_gradients(as_grads(values), variables)

    def shape_of(v):
        return (2, 2) if v.path.startswith("emb") else tuple(v.shape)

    def value(dtype):
        low, high = (-20, 15) if dtype == "float16" else (-30, 40)
        return st.tuples(st.integers(1, 255), st.integers(low, high), st.booleans())

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.integers(-14, 15), min_size=5, max_size=5), st.integers(-20, 20),
           st.sampled_from(["apply", "tf_keras", "unscaled"]),
           st.sampled_from([None] * 4 + [np.inf, -np.inf, np.nan]), st.data())
    def check(factors, s, style, poison, data):
        for v in variables:
            v.assign(tf.zeros_like(v))
        for b, f in zip(boundaries, factors):
            b.log2_factor.assign(float(f))
        opt.loss_scale.current_loss_scale.assign(2.0**s)
        # A new step: records the scale and the factors, and ends an earlier example's
        # get_unscaled_gradients (after which, by the unscaling rule, apply divides none).
        opt.scale_loss(tf.constant(1.0))
        values, want = [], []
        for v, i in zip(variables, above):
            dtype_name = tf.as_dtype(v.dtype).name
            np_dtype = NP_DTYPE[dtype_name]
            shape = shape_of(v)
            drawn = data.draw(st.lists(value(dtype_name), min_size=int(np.prod(shape)),
                                       max_size=int(np.prod(shape))))
            g64 = np.array([(-1.0 if neg else 1.0) * m * 2.0**(e - 8) for m, e, neg in drawn],
                           np.float64).reshape(shape)
            if poison is not None and data.draw(st.integers(0, 5)) == 0:
                g64.flat[data.draw(st.integers(0, g64.size - 1))] = poison
            with np.errstate(over="ignore", invalid="ignore"):
                g = g64.astype(np.float32).astype(np_dtype)  # representable; may be Inf
                exponent = s + sum(factors[i:])
                q = np.ldexp(g.astype(np.float64), -exponent)
                if np_dtype is ml_dtypes.bfloat16:
                    r = q.astype(np.float32).astype(np_dtype)
                else:
                    r = q.astype(np_dtype)
            if np_dtype is not np.float16:  # CPUs flush subnormal float32/bf16/f64 results
                tiny = np.finfo(np.float32 if np_dtype is not np.float64 else np.float64).tiny
                assume(not np.any((np.abs(q) < tiny) & (q != 0)))
            values.append(tf.constant(g, v.dtype))
            want.append(r)
        if style == "unscaled":
            got = unscaled_only(values)
            for v, gv, r in zip(variables, got, want):
                gv = gv.values if isinstance(gv, tf.IndexedSlices) else gv
                np.testing.assert_array_equal(
                    np.asarray(gv.numpy()).astype(np.float64), r.astype(np.float64),
                    err_msg=f"{v.path} {factors} {s}")
            return
        applies = all(np.all(np.isfinite(r.astype(np.float64))) for r in want)
        iterations = int(opt.iterations.numpy())
        (apply_step if style == "apply" else tf_keras_step)(values)
        assert int(opt.iterations.numpy()) == iterations + applies
        for v, r in zip(variables, want):
            got = v.numpy().astype(np.float64)
            if not applies:
                np.testing.assert_array_equal(got, 0.0, err_msg=v.path)
                continue
            if v.path.startswith("emb"):
                expected = np.zeros(v.shape)
                expected[[4, 1]] = -r.astype(np.float64)
            else:
                expected = -r.astype(np.float64)
            np.testing.assert_array_equal(got, expected,
                                          err_msg=f"{v.path} {factors} {s} {style}")

    check()
