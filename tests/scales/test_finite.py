"""Tests for tfdls.all_finite: exactness, structures, dtypes, graph shape."""

import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tfdls import _compat, finite

FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]

# The largest finite value and the smallest positive subnormal of each dtype.
EXTREMES = {
    tf.float16: (65504.0, 2.0**-24),
    tf.bfloat16: (float(tf.bfloat16.max), 2.0**-133),
    tf.float32: (float(np.finfo(np.float32).max), 2.0**-149),
    tf.float64: (float(np.finfo(np.float64).max), 5e-324),
}


def _tensor(values, dtype):
    # Converted by NumPy (ml_dtypes for bfloat16), not by a TF cast: TF's CPU
    # kernels flush subnormals to zero.
    return tf.constant(np.asarray(values, np.float64).astype(dtype.as_numpy_dtype))


def _as_float64(t):
    return np.asarray(t.numpy()).astype(np.float64)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_extreme_finite_values_are_finite(dtype, run_mode):
    big, tiny = EXTREMES[dtype]
    values = [big, -big, tiny, -tiny, 0.0, -0.0, 1.0]
    t = _tensor(values, dtype)
    # The values really are the extremes (and finite) in this dtype.
    as64 = _as_float64(t)
    assert np.all(np.isfinite(as64)) and as64[0] == big
    assert as64[2] == tiny
    result = run_mode(lambda: tfdls.all_finite([t]))()
    assert result.dtype == tf.bool and result.shape == ()
    assert bool(result.numpy()) is True
    assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is True


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_nonfinite_detected(dtype, run_mode):
    big, _ = EXTREMES[dtype]
    other = _tensor([1.0, 2.0], dtype)
    check = run_mode(lambda t: tfdls.all_finite([other, t, None]))
    values = np.full([1000], big / 2, np.float64)
    assert bool(check(tf.reshape(_tensor(values, dtype), [10, 100])).numpy()) is True
    for bad in (np.nan, np.inf, -np.inf):
        for position in (0, 37, 999):
            planted = values.copy()
            planted[position] = bad
            t = tf.reshape(_tensor(planted, dtype), [10, 100])
            assert not np.all(np.isfinite(_as_float64(t)))
            result = check(t)
            assert result.dtype == tf.bool and result.shape == ()
            assert bool(result.numpy()) is False, (bad, position)


def test_large_tensor_single_nan_at_end(run_mode):
    values = np.ones([1 << 20], np.float32)
    values[-1] = np.nan
    t = tf.constant(values)
    assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is False
    values[-1] = np.float32(np.finfo(np.float32).max)
    t = tf.constant(values)
    assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is True


@pytest.mark.parametrize("empty", [[], (), {}, [None], [None, None], {"a": None}])
def test_no_gradients_is_true(empty, run_mode):
    result = run_mode(lambda: tfdls.all_finite(empty))()
    assert result.dtype == tf.bool and result.shape == ()
    assert bool(result.numpy()) is True


def test_empty_tensor_is_finite(run_mode):
    result = run_mode(lambda: tfdls.all_finite([tf.zeros([0, 3]), tf.ones([2])]))()
    assert bool(result.numpy()) is True


def test_indexed_slices_checked_on_values(run_mode):
    def grads(bad):
        return {
            "emb": tf.IndexedSlices(
                values=tf.constant([[1.0, 2.0], [bad, 4.0]]),
                indices=tf.constant([1, 7], tf.int64),
                dense_shape=tf.constant([10, 2], tf.int64),
            ),
            "w": [tf.constant([1.0]), None],
        }

    assert bool(run_mode(lambda: tfdls.all_finite(grads(3.0)))().numpy()) is True
    assert bool(run_mode(lambda: tfdls.all_finite(grads(np.nan)))().numpy()) is False
    assert bool(run_mode(lambda: tfdls.all_finite(grads(-np.inf)))().numpy()) is False


@pytest.mark.parametrize("bad_dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_mixed_dtypes_one_call(bad_dtype, run_mode):
    def grads(with_nan):
        out = []
        for dtype in FLOAT_DTYPES:
            values = [1.0, -3.0, EXTREMES[dtype][0]]
            if with_nan and dtype == bad_dtype:
                values[1] = np.nan
            out.append(_tensor(values, dtype))
        return out

    assert bool(run_mode(lambda: tfdls.all_finite(grads(False)))().numpy()) is True
    assert bool(run_mode(lambda: tfdls.all_finite(grads(True)))().numpy()) is False


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.bool, tf.complex64])
def test_non_float_gradient_type_error_names_dtype(dtype):
    bad = tf.zeros([2], dtype)
    with pytest.raises(TypeError, match=dtype.name):
        tfdls.all_finite([tf.constant([1.0]), bad])
    with pytest.raises(TypeError, match=dtype.name):
        tf.function(lambda: tfdls.all_finite({"x": bad}))()


def test_accepts_nest_with_none_and_tuple(run_mode):
    grads = ((tf.constant([1.0]), None), {"k": [None, tf.constant([[2.0]])]})
    assert bool(run_mode(lambda: tfdls.all_finite(grads))().numpy()) is True


# --------------------------------------------------------------------------
# Graph structure: one fused reduction, no per-gradient branching or syncs.
# --------------------------------------------------------------------------
N_GRADS = 50
CONTROL_FLOW_OR_HOST_OPS = {
    "If",
    "StatelessIf",
    "While",
    "StatelessWhile",
    "Switch",
    "Merge",
    "Enter",
    "Exit",
    "NextIteration",
    "Case",
    "StatelessCase",
    "PyFunc",
    "EagerPyFunc",
    "PyFuncStateless",
    "Print",
    "PrintV2",
    "Assert",
    "_Send",
    "_Recv",
    "_HostSend",
    "_HostRecv",
}
REDUCTIONS = {"All", "Any", "Sum", "Prod", "Max", "Min", "Mean"}


def _graph(n_grads=N_GRADS, shapes=None):
    shapes = shapes or [[i % 4 + 1, 3] for i in range(n_grads)]
    dtypes = [FLOAT_DTYPES[i % 4] for i in range(n_grads)]
    specs = [tf.TensorSpec(s, d) for s, d in zip(shapes, dtypes)]
    concrete = tf.function(tfdls.all_finite).get_concrete_function(specs)
    return concrete


def _ancestors(tensor):
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    return seen


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
def test_graph_reads_each_gradient_once_without_branches(big):
    # Big float32 gradients take the matrix-vector form on a CPU-only host.
    shapes = [[256, 256] if big else [i % 4 + 1, 3] for i in range(N_GRADS)]
    concrete = _graph(shapes=shapes)
    ops = concrete.graph.get_operations()
    types = [op.type for op in ops]
    # No branch, loop or host callback: the step never waits for the host.
    assert not [t for t in types if t in CONTROL_FLOW_OR_HOST_OPS], sorted(set(types))

    placeholders = [op for op in ops if op.type == "Placeholder"]
    assert len(placeholders) == N_GRADS
    for ph in placeholders:
        (consumer,) = ph.outputs[0].consumers()  # read once
        if ph.outputs[0].dtype in (tf.float32, tf.float64) and big:
            assert consumer.type == "Reshape"
            assert [c.type for c in consumer.outputs[0].consumers()] == ["MatMul"]
        else:
            # Read alone: outside XLA a stack of small gradients would be a copy per step.
            assert consumer.type == "IsFinite", (ph.name, consumer.type)

    # One reduction per gradient, plus the combination.
    reductions = [op for op in ops if op.type in REDUCTIONS]
    assert len(reductions) <= N_GRADS + 2
    every_placeholder = {op.name for op in placeholders}
    assert every_placeholder <= _ancestors(concrete.outputs[0])


def test_graph_size_scales_linearly():
    small = len(_graph(10).graph.get_operations())
    large = len(_graph(N_GRADS).graph.get_operations())
    per_grad = (large - small) / (N_GRADS - 10)
    assert per_grad <= 5, per_grad


def test_works_under_xla_with_many_gradients():
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=[3]).astype(np.float32)) for _ in range(N_GRADS)]
    fn = tf.function(tfdls.all_finite, jit_compile=True)
    assert bool(fn(grads).numpy()) is True
    bad = list(grads)
    bad[31] = tf.constant([0.0, np.inf, 1.0], tf.float32)
    assert bool(fn(bad).numpy()) is False


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "shape", [[2048], [64, 64], [3, 1000], [1 << 16], [5, 7, 8, 13]], ids=str
)
def test_huge_finite_tensors_of_every_shape_are_finite(shape, dtype, run_mode):
    """Every element at +-max: any sum of two overflows, the check must not."""
    big = float(np.finfo(dtype.as_numpy_dtype).max)
    size = int(np.prod(shape))
    signs = np.where(np.arange(size) % 3 == 0, -1.0, 1.0)
    for values in (np.full(size, big), np.full(size, -big), signs * big):
        t = tf.constant(values.reshape(shape).astype(dtype.as_numpy_dtype))
        assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is True
    for bad in (np.nan, np.inf, -np.inf):
        for position in (0, size // 2, size - 1):
            values = np.full(size, big / 2)
            values[position] = bad
            t = tf.constant(values.reshape(shape).astype(dtype.as_numpy_dtype))
            assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is False, (bad, position)
    # +Inf and -Inf together: their sum is NaN, still non-finite.
    values = np.zeros(size)
    values[0], values[-1] = np.inf, -np.inf
    t = tf.constant(values.reshape(shape).astype(dtype.as_numpy_dtype))
    assert bool(run_mode(lambda: tfdls.all_finite(t))().numpy()) is False


@pytest.mark.parametrize("variable", finite.FPMATH_VARIABLES)
@pytest.mark.parametrize(
    "value, strict", [("", True), ("STRICT", True), ("strict", True), ("ANY", False),
                      ("BF16", False), ("TF32", False)]
)
def test_matvec_check_only_with_strict_float32_matmuls(monkeypatch, variable, value, strict):
    """oneDNN's ANY, BF16 or TF32 fpmath modes may round a finite value near
    float32's maximum up to Inf in a matmul: then the check is is_finite."""
    for name in finite.FPMATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    assert finite.host_only() is strict


# -- largest_magnitudes -----------------------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_SPECIALS = [0.0, -0.0, float("nan"), float("inf"), -float("inf")]
SMALLEST_NORMAL = {tf.float16: 2.0**-14, tf.bfloat16: 2.0**-126, tf.float32: 2.0**-126,
                   tf.float64: 2.0**-1022}


def _largest_reference(values):
    """The definition, in float64: +inf if any NaN/Inf, else max |x| (0 if empty)."""
    values = np.asarray(values, np.float64)
    if values.size and not np.all(np.isfinite(values)):
        return float("inf")
    return float(np.max(np.abs(values))) if values.size else 0.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # run_mode only wraps
@given(data=st.data())
def test_largest_magnitudes_match_the_definition(dtype, data, run_mode):
    big, tiny = EXTREMES[dtype]
    element = st.one_of(
        st.sampled_from(_SPECIALS + [big, -big, tiny, -tiny]),
        st.floats(-big, big, allow_nan=False, allow_infinity=False),
        st.floats(-64 * tiny, 64 * tiny, allow_nan=False, allow_infinity=False),
    )
    arrays = data.draw(st.lists(st.lists(element, max_size=7), min_size=1, max_size=4))
    if data.draw(st.booleans()):
        # Past 32768 elements XLA takes the float form for float32/float64:
        # a large tensor with a few drawn elements at drawn places.
        big_array = np.zeros([40000])
        for value in data.draw(st.lists(element, min_size=1, max_size=3)):
            big_array[data.draw(st.integers(0, 39999))] = value
        arrays.append(big_array)
    values = [_tensor(a, dtype) for a in arrays]
    # What each tensor holds in `dtype` (rounded by NumPy, as _tensor does).
    held = [_as_float64(v) for v in values]

    found = run_mode(finite.largest_magnitudes)(values)

    for got, exact in zip(found, held):
        assert got.dtype == dtype
        want = _largest_reference(exact)
        got = float(np.asarray(got.numpy()).astype(np.float64))
        # Float maxima on CPUs compare subnormals as zeros (any of them, or 0,
        # may come out): TensorFlow's kernels outside XLA, and XLA's fused
        # reduction of large float32/float64 tensors; the bits do not.
        float_form = run_mode.mode != "xla" or (
            dtype in (tf.float32, tf.float64) and exact.size > 32768)
        if float_form and 0 < want < SMALLEST_NORMAL[dtype]:
            assert got == 0.0 or got in np.abs(exact), (exact, got)
        else:
            assert got == want, (exact, got, want)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_largest_magnitudes_of_a_tensor_of_unknown_size(jit_compile):
    # An empty one reads 0 (an empty IndexedSlices, a replica's empty batch):
    # +inf would skip the step.
    @tf.function(jit_compile=jit_compile, input_signature=[tf.TensorSpec([None], tf.float16)])
    def largest(value):
        return finite.largest_magnitudes([value])[0]

    assert float(largest(tf.zeros([0], tf.float16))) == 0.0
    assert float(largest(_tensor([-3.0, 2.0], tf.float16))) == 3.0
    assert float(largest(_tensor([1.0, float("nan")], tf.float16))) == float("inf")


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # run_mode only wraps
@given(data=st.data())
def test_tensors_of_one_shape_read_together_answer_each_for_itself(data, run_mode):
    """Small tensors of one dtype and shape are reduced as one stack
    (`finite.STACK_MAX_ELEMENTS`): every answer must still be its own tensor's,
    in its place, whatever the mix of shapes, dtypes and sizes around it."""
    shapes = [(3,), (2, 2), (1,), (32, 64), (40000,)]  # (32, 64): the matrix-vector form
    kinds = data.draw(st.lists(st.tuples(st.sampled_from(FLOAT_DTYPES), st.sampled_from(shapes)),
                               min_size=1, max_size=3, unique=True))
    # Up to 40: runs of more than `finite.STACK_MAX_MEMBERS` equal tensors, read in stacks.
    picks = data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=40))
    values, held = [], []
    for dtype, shape in picks:
        big, tiny = EXTREMES[dtype]
        element = st.one_of(st.sampled_from(_SPECIALS + [big, -big, -tiny]),
                            st.floats(-big, big, allow_nan=False, allow_infinity=False))
        array = np.zeros(shape)
        for _ in range(data.draw(st.integers(0, 3))):  # a few drawn values at drawn places
            array.flat[data.draw(st.integers(0, array.size - 1))] = data.draw(element)
        values.append(_tensor(array, dtype))
        held.append(_as_float64(values[-1]))

    def answers(values):
        parts = finite.largest_magnitude_parts(values)
        return finite.largest_magnitudes(values), finite.finite_flags(values), parts

    largest, flags, parts = run_mode(answers)(values)

    wanted = [_largest_reference(h) for h in held]
    for k, (got, want, h) in enumerate(zip(largest, wanted, held)):
        got = float(np.asarray(got.numpy()).astype(np.float64))
        # Subnormal largest magnitudes: see test_largest_magnitudes_match_the_definition.
        if 0 < want < SMALLEST_NORMAL[values[k].dtype]:
            assert got == 0.0 or got in np.abs(h), (k, h, got)
        else:
            assert got == want, (k, picks[k], got, want)
    np.testing.assert_array_equal(flags.numpy(), [np.all(np.isfinite(h)) for h in held])
    members = [i for indices, _ in parts for i in indices]
    assert sorted(members) == list(range(len(values)))  # each tensor once
    for indices, vector in parts:
        assert {values[i].dtype for i in indices} == {vector.dtype}
        np.testing.assert_array_equal(np.asarray(vector.numpy()).astype(np.float64),
                                      [float(np.asarray(largest[i].numpy())) for i in indices])


def test_a_long_run_of_equal_tensors_is_read_in_stacks_of_at_most_16():
    """XLA's CPU backend compiles a stack of n tensors in time growing faster than n
    (`finite.STACK_MAX_MEMBERS`): inside XLA 40 equal small tensors are read as stacks of
    16, 16 and 8, each tensor once and in order, and each answers for itself. Outside
    XLA (eager here) each is read alone: a stack would copy them."""
    values = [tf.fill([3], float(k)) for k in range(40)]
    values[21] = tf.constant([1.0, float("inf"), 2.0])
    eager_units = finite._units(values, _compat.in_xla_context())
    assert [unit.members for unit in eager_units] == [[k] for k in range(40)]
    seen = []

    @tf.function(jit_compile=True)
    def read(values):
        seen.append(finite._units(values, _compat.in_xla_context()))
        return finite.finite_flags(values), finite.largest_magnitudes(values)

    compiled_flags, compiled_largest = read(values)
    (units,) = seen
    assert [unit.members for unit in units] == [list(range(0, 16)), list(range(16, 32)),
                                                list(range(32, 40))]
    assert [unit.value.shape.as_list() for unit in units] == [[16, 3], [16, 3], [8, 3]]
    expected_largest = [float("inf") if k == 21 else float(k) for k in range(40)]
    for flags, largest in [(finite.finite_flags(values), finite.largest_magnitudes(values)),
                           (compiled_flags, compiled_largest)]:
        assert flags.numpy().tolist() == [k != 21 for k in range(40)]
        assert [float(x) for x in largest] == expected_largest


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_equal_wide_tensors_stacked_inside_xla_answer_each_for_itself(dtype, monkeypatch):
    """Five equal 32x64 tensors inside XLA on a CPU-only host: one stack, checked by the
    matrix-vector form (`finite.matvec_width`). Each flag is its own tensor's, and the
    largest finite values (every element, either sign) do not overflow the products."""
    monkeypatch.setattr(finite, "host_only", lambda: True)
    big = EXTREMES[dtype][0]
    values = [tf.fill([32, 64], tf.constant(sign * big, dtype)) for sign in (1, -1)]
    values += [tf.tensor_scatter_nd_update(tf.ones([32, 64], dtype), [[31, 63]],
                                           tf.constant([bad], dtype))
               for bad in (float("nan"), -float("inf"), 2.0)]
    units = []

    @tf.function(jit_compile=True)
    def flags(values):
        units.extend(finite._units(values, _compat.in_xla_context()))
        assert finite.matvec_width(values[0], _compat.in_xla_context()) == 64
        return finite.finite_flags(values)

    assert flags(values).numpy().tolist() == [True, True, False, False, True]
    assert [unit.members for unit in units] == [[0, 1, 2, 3, 4]]


# -- unknown shapes: from an outside review -------------------------------------------

import ml_dtypes  # noqa: E402

_NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
                 "float64": np.float64}
_SIGNATURE_SHAPES = [(3, 4), (3, 4), (), (), (0, 4), (3, 4), (5,), (), (0,)]


@pytest.mark.parametrize("signature", ["none_dims", "unknown_rank", "static"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_parts_match_numpy_under_signatures(signature, jit, seed):
    """Unknown dimensions and rank (nothing stacks then), scalars (they stack) and empty
    tensors, traced and under XLA: `largest_magnitude_parts` reassembled, `largest_magnitudes`
    and `finite_flags` against numpy (from an outside review of the stacked reductions)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape in _SIGNATURE_SHAPES:
        dtype = _NUMPY_DTYPES[rng.choice(list(_NUMPY_DTYPES))]
        a = rng.normal(size=shape).astype(np.float32)
        special = rng.choice([None, None, np.inf, np.nan, -np.inf])
        if special is not None and a.size:
            a.flat[rng.integers(0, a.size)] = special
        arrays.append(a.astype(dtype))
    tensors = [tf.constant(a) for a in arrays]
    spec = {"none_dims": lambda t: tf.TensorSpec([None] * t.shape.rank, t.dtype),
            "unknown_rank": lambda t: tf.TensorSpec(None, t.dtype),
            "static": lambda t: tf.TensorSpec(t.shape, t.dtype)}[signature]

    @tf.function(input_signature=[spec(t) for t in tensors], jit_compile=jit)
    def f(*xs):
        xs = list(xs)
        full = [None] * len(xs)
        for members, vector in finite.largest_magnitude_parts(xs):
            for j, i in enumerate(members):
                full[i] = tf.cast(vector[j], tf.float64)
        return (finite.finite_flags(xs),
                tf.stack([tf.cast(m, tf.float64) for m in finite.largest_magnitudes(xs)]),
                tf.stack(full))

    flags, largest, parts = (x.numpy() for x in f(*tensors))
    wide = [a.astype(np.float64) for a in arrays]
    want_flags = np.array([np.all(np.isfinite(a)) for a in wide])
    want = np.array([np.max(np.abs(a)) if a.size and ok else (0.0 if ok else np.inf)
                     for a, ok in zip(wide, want_flags)])
    np.testing.assert_array_equal(flags, want_flags)
    np.testing.assert_array_equal(largest, want)
    assert parts.tobytes() == largest.tobytes()
