"""A training step that never waits for the host, counted structurally.

On an accelerator every data-dependent branch costs a device-to-host copy
that the host waits for: XLA's conditionals read their predicate on the
host, and a graph-mode `If` or `py_function` holds the step until its input
arrives. Counted here from the compiled HLO (``conditional(`` ops) and from
the graph-mode function's GraphDef including its function library, for
`opt.apply(grads, variables)` on four variables:

| step                         | bare | Keras 3 LSO | tfdls default | tfdls ignore |
|------------------------------|------|-------------|---------------|--------------|
| XLA: conditionals            | 0    | >= 1        | 0             | 0            |
| graph: If ops / py_functions | 0/0  | >= 1 / 0    | 0 / 0         | 0 / 0        |

Embedding (`tf.IndexedSlices`) gradients and Keras' own gradient
accumulation branch (or, for Adagrad's sparse update, branch twice) inside the
bare optimizer already; tfdls adds none to them, for every exported class, in
graph mode (`jit_compile` "auto" and False) and under XLA.

Under MirroredStrategy on two logical CPUs the minimum is one `If`: the
strategy synchronizes replicas through `merge_call`, the skip is then a
`tf.cond` taken in cross-replica context (see `tfdls._distribute`).
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.fast_loop import slow_except
from tests.support.keras_optimizers import EXPORTED, make_optimizer

# Small models: without this, jit_compile="auto" on the CPU would take a cond
# (tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS) and these tests are of the masked step.
pytestmark = pytest.mark.usefixtures("plan_as_on_an_accelerator")

BRANCH_OPS = {"If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile"}
HOST_OPS = {"EagerPyFunc", "PyFunc", "PyFuncStateless"}
SHAPES = [(8, 4), (4,), (4, 2), (2,)]


def _variables():
    return [keras.Variable(np.ones(s, "float32"), name=f"v{i}") for i, s in enumerate(SHAPES)]


def _grads():
    return [tf.ones(s) for s in SHAPES]


def _optimizer(kind, inner_name, variables, **options):
    inner = make_optimizer(inner_name, "v1", **options)
    if kind == "bare":
        opt = inner
    elif kind == "keras3":
        opt = keras.optimizers.LossScaleOptimizer(inner)
    elif kind == "tfdls":
        opt = tfdls.LossScaleOptimizer(inner)
    elif kind == "tfdls_ignore":
        opt = tfdls.LossScaleOptimizer(inner, min_scale_policy="ignore")
    elif kind == "tfdls_nojit":
        opt = tfdls.LossScaleOptimizer(inner, jit_compile=False)
    opt.build(variables)
    return opt


def xla_conditionals(fn, *args):
    """Number of ``conditional`` ops in the HLO of ``fn`` compiled with XLA."""
    hlo = tf.function(fn, jit_compile=True).experimental_get_compiler_ir(*args)(stage="hlo")
    return hlo.count(" conditional(")


def graph_ops(fn, *args):
    """Op types of ``fn``'s graph-mode function, its function library included."""
    graph_def = tf.function(fn).get_concrete_function(*args).graph.as_graph_def()
    types = [node.op for node in graph_def.node]
    for function in graph_def.library.function:
        types += [node.op for node in function.node_def]
    return types


def _counts(types):
    return (
        sum(t in BRANCH_OPS for t in types),
        sum(t in HOST_OPS for t in types),
    )


@pytest.mark.parametrize("kind", ["bare", "keras3", "tfdls", "tfdls_ignore"])
@pytest.mark.parametrize("inner_name", ["SGD", "Adam"])
def test_the_table(kind, inner_name):
    variables = _variables()
    opt = _optimizer(kind, inner_name, variables)
    step = lambda grads: opt.apply(grads, variables)  # noqa: E731
    conditionals = xla_conditionals(step, _grads())
    branches, host_calls = _counts(graph_ops(step, _grads()))
    if kind == "keras3":  # the reference: Keras 3 branches on every step
        assert conditionals >= 1 and branches >= 1 and host_calls == 0
    else:
        assert (conditionals, branches, host_calls) == (0, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("inner_name", EXPORTED)
@pytest.mark.parametrize("kind", ["tfdls", "tfdls_nojit"])
def test_no_branch_or_host_call_for_every_exported_class(kind, inner_name):
    variables = _variables()
    opt = _optimizer(kind, inner_name, variables)
    step = lambda grads: opt.apply(grads, variables)  # noqa: E731
    assert _counts(graph_ops(step, _grads())) == (0, 0), opt.step_plan
    assert opt.step_plan.skip == "masked"


@pytest.mark.slow
@pytest.mark.parametrize(
    "inner_name", [n for n in ("SGD", "Adam", "MultiOptimizer", "AdamW") if n in EXPORTED]
)
def test_no_conditional_in_the_compiled_step_for_more_classes(inner_name):
    variables = _variables()
    opt = _optimizer("tfdls", inner_name, variables)
    assert xla_conditionals(lambda grads: opt.apply(grads, variables), _grads()) == 0


def _applier(opt, variables):
    return lambda grads: opt.apply(grads, variables)


def _embedding_step_inputs():
    variables = [keras.Variable(np.ones((10, 4), "float32"), name="table"),
                 keras.Variable(np.ones((4, 2), "float32"), name="v1")]
    # An Embedding's gradient: the looked-up rows, row 1 twice.
    grads = [tf.IndexedSlices(tf.ones([3, 4]), tf.constant([1, 3, 1]), tf.constant([10, 4])),
             tf.ones([4, 2])]
    return variables, grads


STEPS = {
    "embedding": ({}, _embedding_step_inputs),
    "accumulation": ({"gradient_accumulation_steps": 2}, lambda: (_variables(), _grads())),
}
FAST_STEPS = {("Adam", "embedding"), ("Adagrad", "embedding"), ("SGD", "accumulation")}
# MultiOptimizer: its sub-optimizers would each accumulate.
STEP_CASES = [
    pytest.param(name, step, marks=() if (name, step) in FAST_STEPS else pytest.mark.slow)
    for step in STEPS
    for name in EXPORTED
    if not (step == "accumulation" and name == "MultiOptimizer")
]


@pytest.mark.parametrize("mode", ["graph-auto", "graph-jit-false", "xla"])
@pytest.mark.parametrize("inner_name, step_name", STEP_CASES)
def test_embedding_and_accumulation_steps_branch_only_where_keras_does(inner_name, step_name, mode):
    options, inputs = STEPS[step_name]
    counts = {}
    for kind in ("bare", "tfdls_nojit" if mode == "graph-jit-false" else "tfdls"):
        variables, grads = inputs()
        opt = _optimizer(kind, inner_name, variables, **options)
        step = _applier(opt, variables)
        if mode == "xla":
            counts[kind != "bare"] = xla_conditionals(step, grads)
        else:
            counts[kind != "bare"] = _counts(graph_ops(step, grads))
    assert opt.step_plan.skip == "masked", opt.step_plan.reason
    assert counts[True] == counts[False], counts


@pytest.mark.parametrize("jit_compile", slow_except([False, True], [], ["graph", "xla"]))
def test_fit_plans_a_branch_free_step(jit_compile):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
    assert opt.step_plan.skip == "masked"
    assert opt.step_plan.compile is (not jit_compile)  # fit's XLA step is one cluster already


def test_mirrored_strategy_minimum_is_one_cross_replica_cond(mirrored_strategy):
    with mirrored_strategy.scope():
        variables = _variables()
        opt = tfdls.LossScaleOptimizer(keras.optimizers.Adam())
        opt.build(variables)

    def train_step(grads):
        mirrored_strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

    assert _counts(graph_ops(train_step, _grads())) == (1, 0)
    assert opt.step_plan.skip == "cond" and "merge_call" in opt.step_plan.reason
