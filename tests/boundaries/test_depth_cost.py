"""A boundary after every layer of a 100-layer MLP: the first `fit` costs a bounded multiple.

Tracing and compiling scale boundaries once grew exponentially with their
nesting depth (20 nested boundaries took minutes and 4 GB), then cubically at
trace time (a parent mask per nesting level, a scan per boundary above each
variable). This compares the first `fit` (trace, compile, 2 steps) of
`Dense(64, sigmoid)` x 100 under mixed_float16 in graph mode, with
`add_scale_boundaries(every=1)` (100 nested boundaries) and with the global
scale alone, each in its own process: process CPU seconds from `compile` to
the end of `fit`, and the process' peak resident set size; in graph mode and
with the whole step compiled by XLA.

Measured on this project's shared 2-core machine (benchmarks/depth.py,
docs/per-layer-scales.md): 1.5x to 1.7x the CPU time and 1.1x the peak in graph
mode, 1.6x and 1.25x to 1.3x under XLA; the bounds leave room for a loaded machine
and catch what grows faster than linearly, not 10%. The peak bounds also catch
per-boundary kernels coming back: in graph mode a compiled apply whose updates are
kernels of their own (1.46x), under XLA a factor write or divisor read at a
constant index (1.44x to 1.46x); the fusion counts below catch them first.
"""

import json
import subprocess
import sys

import pytest

# Per mode: (CPU time, peak memory), at most this multiple of the global scale's.
MAX_RATIOS = {"graph": (3.0, 1.35), "xla": (3.0, 1.4)}

_SCRIPT = """
import json, os, resource, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
import keras, numpy as np, tfdls
keras.mixed_precision.set_global_policy("mixed_float16")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,))]
                         + [keras.layers.Dense(64, activation="sigmoid") for _ in range(100)]
                         + [keras.layers.Dense(10, dtype="float32")])
extra = {}
if sys.argv[1] == "boundaries":
    model = tfdls.add_scale_boundaries(model, every=1)
    extra = {"scale_boundaries": model}
optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1e-3), **extra)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 64)).astype("float32"), rng.integers(0, 10, 64)
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
start = cpu()
model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=sys.argv[2] == "xla")
loss = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history["loss"][-1]
print(json.dumps({"cpu_s": cpu() - start, "loss": loss,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "boundaries": sum(isinstance(l, tfdls.ScaleBoundary) for l in model.layers)}))
"""


def _first_fit(scale, mode):
    result = subprocess.run([sys.executable, "-c", _SCRIPT, scale, mode], capture_output=True,
                            text=True, timeout=600, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_first_fit_of_100_nested_boundaries_costs_a_bounded_multiple_of_the_global_scale(mode):
    plain = _first_fit("global", mode)
    bounded = _first_fit("boundaries", mode)
    assert bounded["boundaries"] == 100
    assert bounded["loss"] == pytest.approx(plain["loss"], rel=1e-3)  # both trained alike
    max_cpu, max_peak = MAX_RATIOS[mode]
    assert bounded["cpu_s"] <= max_cpu * plain["cpu_s"], (bounded, plain)
    assert bounded["peak_mb"] <= max_peak * plain["peak_mb"], (bounded, plain)


def _traced_apply_op_counts(depth, whole_step_xla):
    """Op types of one traced `apply` of `depth` Dense(8) layers with a boundary after each
    (nested functions included)."""
    import collections
    import warnings

    import keras
    import tensorflow as tf

    import tfdls

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(depth)])
    model = tfdls.add_scale_boundaries(model, every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model,
                                         jit_compile=False)
    variables = model.trainable_variables
    optimizer.build(variables)

    def step(*grads):
        optimizer.scale_loss(tf.constant(1.0))  # this step's factors, as a training step records
        optimizer.apply(list(grads), variables)

    specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        concrete = tf.function(step, jit_compile=whole_step_xla).get_concrete_function(*specs)
    counts = collections.Counter(op.type for op in concrete.graph.get_operations())
    for function in concrete.graph._functions.values():
        counts.update(node.op for node in function.cached_definition.node_def)
    return counts


@pytest.mark.parametrize("whole_step_xla", [False, True], ids=["graph", "xla"])
def test_equal_layers_are_checked_and_divided_together(whole_step_xla):
    """Per gradient below a boundary, the traced step holds its update and its
    multiply by the divisor; the divisors' powers of two (one vector per step) do not
    grow with the number of equal layers. Under XLA neither does the check: one
    reduction per dtype and shape (`finite.STACK_MAX_ELEMENTS`, up to
    `finite.STACK_MAX_MEMBERS` = 16 tensors each), which XLA fuses with its stack. In
    graph mode a stack is a copy of its members every step, so there the check reads
    each gradient alone, in the same few operations each (a minimum, a maximum and a
    finiteness flag)."""
    # 12 and 16 boundaries: both divide by 3 pieces under XLA (`_division.exponent_bound`)
    # and place the factors level by level, unrolled (`UNROLLED_LEVELS`).
    shallow = _traced_apply_op_counts(12, whole_step_xla)
    deep = _traced_apply_op_counts(16, whole_step_xla)
    more_gradients = 8  # a kernel and a bias per layer
    # IsNan: TensorFlow lowers it to XLA through MLIR, about 10 ms of compile each; a
    # boundary's factor reading (`readings.integer_exponent`) holds none.
    per_step = ["LeftShift", "Bitcast", "IsFinite", "All", "Min", "BitwiseAnd", "Pack", "IsNan"]
    per_gradient = {} if whole_step_xla else {"IsFinite": 1, "All": 1, "Min": 1, "Max": 1}
    assert ({op: deep[op] - shallow[op] for op in per_step}
            == {op: more_gradients * per_gradient.get(op, 0) for op in per_step})
    # The other reductions that grow are the adaptation's, one per level of nesting.
    assert deep["Max"] - shallow["Max"] == 4 + more_gradients * per_gradient.get("Max", 0)


def _distinct_whole_step_kernels(depth, *needles):
    """The distinct fused computations whose HLO text holds every one of `needles` ("[5,8]":
    the batch, the forward and backward passes; "f32[8,8]" and "subtract(": the kernels'
    updates) in the optimized HLO of one whole-step XLA compile of `depth` Dense(8,
    sigmoid) layers with a boundary after each, batch 5 (names and metadata left out)."""
    import warnings

    import keras
    import tensorflow as tf

    import tfdls

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="sigmoid")
                                                   for _ in range(depth)])
    model = tfdls.add_scale_boundaries(model, every=1)
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model)
    optimizer.build(model.trainable_variables)

    def step(x):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_sum(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hlo = tf.function(step, jit_compile=True).experimental_get_compiler_ir(
            tf.ones([5, 8]))(stage="optimized_hlo")
    return {b for b in _fused_bodies(hlo) if all(needle in b for needle in needles)}


def _fused_bodies(hlo):
    """The distinct fused computations of optimized HLO text, names and metadata left out:
    XLA's CPU backend compiles one kernel per distinct fusion."""
    import re

    bodies, body = set(), None
    for line in hlo.splitlines():
        if line.startswith(("%fused", "fused")) and line.rstrip().endswith("{"):
            body = []
        elif body is not None and line.startswith("}"):
            bodies.add("\n".join(body))
            body = None
        elif body is not None:
            body.append(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line)))
    return bodies


def test_equal_boundaries_backward_passes_compile_to_one_kernel_under_xla():
    """XLA compiles a kernel per distinct fusion, and reuses one only for an identical
    fusion. Each boundary's backward pass reads its own recorded exponent inside XLA,
    and `scale_loss` records each from its own variable: the backward fusions of equal
    layers are then equal, however many there are. When they read one vector of all the
    factors at a constant index, each was a kernel of its own (at 100 boundaries, 200
    more kernels to compile)."""
    shallow, deep = _distinct_whole_step_kernels(8, "[5,8]"), _distinct_whole_step_kernels(12, "[5,8]")
    assert shallow  # the forward and backward passes were found
    assert len(deep) == len(shallow), (len(shallow), len(deep))


def test_no_kernel_per_boundary_under_whole_step_xla():
    """The whole step compiles the same number of distinct kernels at 20 nested
    boundaries as at 40 (both place their factors in one loop, `UNROLLED_LEVELS`):
    every per-boundary value is read from a vector at an index the computation takes
    as an argument (`boundaries.step.elements`), so equal fusions of different
    boundaries compile once. Each factor written and each segment's divisor read at a
    constant index was a kernel of its own (at 100 boundaries, 201 of 272 distinct
    kernels, each about 1.7 MB on the CPU backend). Up to 2 more: a few fusions
    take the shape of the boundaries' vectors."""
    shallow, deep = _distinct_whole_step_kernels(20), _distinct_whole_step_kernels(40)
    assert shallow
    assert len(deep) <= len(shallow) + 2, (len(shallow), len(deep))


def test_with_an_accelerator_visible_no_index_is_captured(monkeypatch):
    """Where a GPU or TPU is visible the step may run there, and a captured index (an
    eager tensor on the host) would be copied to it on every call: none is made, the
    factors' writes are unstacked and each segment's row of pieces is divided in an
    operation of its own (`_rows_of_reciprocals`), as before indices were captured. The
    updates of equal layers still compile to one kernel; the writes and the divisions
    are a kernel per boundary again. Checked on the CPU by making
    `accelerator_visible` (`tfdls.finite`'s, as the step reads it) say so."""
    from tfdls.boundaries import step as boundary_step

    cpu = len(_distinct_whole_step_kernels(20))
    monkeypatch.setattr(boundary_step, "accelerator_visible", lambda: True)
    assert boundary_step._index_arguments(3) is None
    assert len(_distinct_whole_step_kernels(20)) >= cpu + 2 * 20 - 5
    shallow = _distinct_whole_step_kernels(12, "f32[8,8]", "subtract(")
    deep = _distinct_whole_step_kernels(20, "f32[8,8]", "subtract(")
    assert shallow and len(deep) == len(shallow), (len(shallow), len(deep))


def test_equal_boundaries_updates_compile_to_one_kernel_under_whole_step_xla():
    """Under whole-step XLA the divisors are computed in the step's one cluster: each
    segment's row of reciprocal powers of two is read at an index the computation takes
    as an argument (`boundaries.step.elements`), so the updates of equal layers below
    different boundaries are equal fusions, compiled once. When each update read
    its divisor at a constant index of one vector, each was a kernel of its own (at 100
    boundaries, 202 of the first `fit`'s 364 kernels)."""
    shallow = _distinct_whole_step_kernels(12, "f32[8,8]", "subtract(")
    deep = _distinct_whole_step_kernels(20, "f32[8,8]", "subtract(")
    assert shallow  # the updates were found
    assert len(deep) == len(shallow), (len(shallow), len(deep))


# One graph-mode step whose apply is compiled on its own (jit_compile=True), its
# optimized HLO dumped by XLA (XLA_FLAGS is read when TensorFlow starts: a process of its own).
_COMPILED_APPLY = """
import glob, os, sys, tempfile
dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, tensorflow as tf, tfdls
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="sigmoid")
                                               for _ in range(int(sys.argv[1]))])
model = tfdls.add_scale_boundaries(model, every=1)
optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(), scale_boundaries=model,
                                     jit_compile=True)
@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(tf.reduce_sum(model(x)))
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
step(tf.ones([5, 8]))
assert optimizer.step_plan.compile, optimizer.step_plan
for name in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
    print(open(name).read())
"""


def _compiled_apply_kernels(depth):
    result = subprocess.run([sys.executable, "-c", _COMPILED_APPLY, str(depth)],
                            capture_output=True, text=True, timeout=300, check=True)
    assert "compiled_step" in result.stdout  # the apply's cluster was dumped
    return _fused_bodies(result.stdout)


def test_equal_boundaries_updates_compile_to_one_kernel_in_a_compiled_apply():
    """In graph mode a compiled apply is an XLA cluster of its own: the divisors per
    boundary enter it as arguments and the new factors leave it as results, so the
    updates of equal layers are equal fusions, compiled once. When the cluster sliced
    each divisor from a vector and each new factor for its write at a constant index,
    both were a kernel per boundary (at 100 boundaries, about 300 kernels: a third of
    the first `fit`'s peak memory)."""
    shallow, deep = _compiled_apply_kernels(8), _compiled_apply_kernels(12)
    assert shallow
    assert len(deep) == len(shallow), (len(shallow), len(deep))
