"""Every optimizer class keras.optimizers exports, wrapped, in every mode:

* a skipped step leaves the model variables, every inner-optimizer variable
  and `iterations` bit-identical (including -0.0 and subnormal values);
* a finite step equals the bare inner optimizer fed the true gradients: bit
  for bit where the apply is not compiled (eager, ``jit_compile=False``),
  and within `COMPILED_ULPS` of the bare optimizer compiled with XLA where it
  is (README's accuracy claim).

Modes: eager; a graph-mode `tf.function` with each `jit_compile` value of the
wrapper (auto compiles the apply, False keeps plain graph ops, True forces
compilation); and an XLA-compiled step. Plus the trace-time audit that guards
the branch-free (masked) skip: an optimizer that writes a variable behind the
masked methods' back falls back to the cond, loudly.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls
from tests.support.keras_optimizers import EXPORTED, make_optimizer
from tfdls import _masked_update

# Small models: without this, jit_compile="auto" on the CPU would take a cond
# (tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS) and these tests are of the masked step.
pytestmark = pytest.mark.usefixtures("plan_as_on_an_accelerator")

NAN = float("nan")
SCALE = 2.0**12
# A compiled apply fuses the check and the masked writes into the update;
# XLA then rounds a few classes' reductions differently from the bare
# optimizer's own XLA step (measured: Adafactor 2 ulp, Muon 3); every other
# class is bit-identical.
COMPILED_ULPS = {"Adafactor": 4, "Muon": 4}

MODES = {
    "eager": (None, "auto"),
    "graph-auto": (False, "auto"),
    "graph-jit-false": (False, False),
    "graph-jit-true": (False, True),
    "xla": (True, "auto"),
}


def _variables():
    # -0.0 and a float32 subnormal: a skip must keep their exact bits.
    w = np.array([[-0.0, 1e-40, 1.5], [0.25, -2.0, 0.0], [3.0, -0.5, 1e-3], [0.7, 0.1, -1.0]])
    return [
        keras.Variable(w.astype("float32"), name="w"),
        keras.Variable(np.array([0.5, -0.0, 2.0], "float32"), name="b"),
    ]


def _true_grads(step):
    rng = np.random.default_rng(step)
    return [rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(3,)).astype("float32")]


def _step_fn(fn, mode):
    xla, _ = MODES[mode]
    if xla is None:
        return fn
    return tf.function(fn, jit_compile=xla)


def _bits(values):
    return [np.asarray(keras.ops.convert_to_numpy(v)).tobytes() for v in values]


def _ulps(a, b):
    """Largest distance in float32 units in the last place (0: bit-identical)."""
    def ordered(x):
        bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return int(np.max(np.abs(ordered(a) - ordered(b)), initial=0))


def test_every_exported_class_is_listed_as_supported():
    # The matrix below runs them all; a new Keras class must be added on purpose.
    assert sorted(cls.__name__ for cls in _masked_update.SUPPORTED) == EXPORTED


# The fast loop runs Adam in the three traced kinds of step and MultiOptimizer
# once; CI runs every class in every mode.
FAST_CASES = {("Adam", "graph-auto"), ("Adam", "graph-jit-false"), ("Adam", "xla"),
              ("MultiOptimizer", "graph-auto")}
MATRIX = [
    pytest.param(name, mode, marks=() if (name, mode) in FAST_CASES else pytest.mark.slow)
    for name in EXPORTED
    for mode in sorted(MODES)
]


@pytest.mark.parametrize("name, mode", MATRIX)
def test_skipped_step_is_bit_identical_and_finite_steps_match_bare(name, mode):
    _, jit_compile = MODES[mode]
    variables, bare_variables = _variables(), _variables()
    opt = tfdls.LossScaleOptimizer(
        make_optimizer(name, "b", learning_rate=1e-2),
        tfdls.DynamicLossScale(SCALE, increment_period=1000),
        jit_compile=jit_compile,
    )
    bare = make_optimizer(name, "b", learning_rate=1e-2)
    # Built now, as tfdls builds its inner optimizer (`_distribute.built_before_the_trace`):
    # a first build inside the step's trace loses what `build` writes (ScheduleFreeAdamW
    # starts its momentum at the weights).
    bare.build(bare_variables)
    step = _step_fn(lambda g: opt.apply(g, variables), mode)
    # Where tfdls compiles its apply, the bare step is compiled too.
    compiled = mode in ("graph-auto", "graph-jit-true", "xla")
    bare_step = _step_fn(lambda g: bare.apply(g, bare_variables), "xla" if compiled else mode)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        for i in range(2):
            true = _true_grads(i)
            step([tf.constant(g * np.float32(SCALE)) for g in true])
            bare_step([tf.constant(g) for g in true])
        if mode != "eager":
            assert opt.step_plan.skip == "masked", opt.step_plan.reason
        state = variables + opt.inner_optimizer.variables
        before = _bits(state)
        poisoned = [tf.constant(g * np.float32(SCALE)) for g in _true_grads(2)]
        poisoned[0] = tf.tensor_scatter_nd_update(poisoned[0], [[1, 2]], [NAN])
        step(poisoned)

    assert _bits(state) == before
    assert int(opt.iterations.numpy()) == 2
    assert float(opt.loss_scale().numpy()) == SCALE / 2
    allowed = COMPILED_ULPS.get(name, 0) if compiled else 0
    pairs = zip(variables + opt.inner_optimizer.variables, bare_variables + bare.variables)
    for mine, theirs in pairs:
        if not np.issubdtype(np.asarray(keras.ops.convert_to_numpy(mine)).dtype, np.floating):
            assert _bits([mine]) == _bits([theirs])
            continue
        ulps = _ulps(keras.ops.convert_to_numpy(mine), keras.ops.convert_to_numpy(theirs))
        assert ulps <= allowed, (mine.path, ulps)
    step([tf.constant(g * np.float32(SCALE / 2)) for g in _true_grads(3)])
    assert int(opt.iterations.numpy()) == 3  # and it applies again


# -- the audit --------------------------------------------------------------------


class SideCounter(keras.optimizers.SGD):
    """SGD that also counts its updates in a variable it does not report."""

    def build(self, variables):
        super().build(variables)
        with tf.init_scope():
            self.calls = tf.Variable(0, dtype=tf.int64, trainable=False)

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        self.calls.assign_add(1)


class DirectWriter(keras.optimizers.SGD):
    """SGD that writes the variable itself instead of through self.assign_sub."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        variable.assign(variable - tf.cast(gradient, variable.dtype) * lr)


def _poisoned_run(inner, jit_compile=False):
    variables = _variables()
    opt = tfdls.LossScaleOptimizer(inner, jit_compile=jit_compile)
    step = tf.function(lambda g: opt.apply(g, variables))
    step([tf.ones([4, 3]), tf.ones([3])])
    before = _bits(variables + inner.variables)
    step([tf.fill([4, 3], NAN), tf.ones([3])])
    return opt, variables, before


def test_a_class_not_on_the_list_takes_the_cond():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt, variables, before = _poisoned_run(DirectWriter(0.1))
    assert opt.step_plan.skip == "cond"
    assert "DirectWriter is not one of Keras' own optimizer classes" in opt.step_plan.reason
    assert _bits(variables + opt.inner_optimizer.variables) == before


@pytest.mark.parametrize("jit_compile", [False, True])
def test_an_unknown_write_fails_the_audit_and_falls_back_loudly(monkeypatch, jit_compile):
    # Pretend a future Keras class wrote a variable tfdls does not know of.
    monkeypatch.setattr(_masked_update, "SUPPORTED", _masked_update.SUPPORTED | {SideCounter})
    inner = SideCounter(0.1)
    # (The op's scope is the class name, 'SGD' in older Keras.)
    cause = r"AssignAddVariableOp '\w+/\S+' writes a variable that is neither trainable"
    with pytest.warns(RuntimeWarning,
                      match=r"could not be shown to skip exactly.*" + cause) as caught:
        opt, variables, before = _poisoned_run(inner, jit_compile)
    # Attributed to the user's code (here, this file), not to a tfdls or TensorFlow frame.
    assert [w.filename for w in caught if "could not be shown" in str(w.message)] == [__file__]
    assert opt.step_plan.compile == jit_compile
    # Planned masked, refused by the audit: the plan says what ran.
    assert opt.step_plan.skip == "cond"
    assert "the audit failed" in opt.step_plan.reason
    assert re.search(cause, opt.step_plan.reason), opt.step_plan.reason
    assert _bits(variables + inner.variables) == before
    assert int(inner.calls.numpy()) == 2  # the first step only (two variables)


def test_direct_writes_to_known_variables_are_restored(monkeypatch):
    monkeypatch.setattr(_masked_update, "SUPPORTED", _masked_update.SUPPORTED | {DirectWriter})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt, variables, before = _poisoned_run(DirectWriter(0.1))
    assert _bits(variables + opt.inner_optimizer.variables) == before


def test_audit_lists_the_restored_variables():
    variables = _variables()
    inner = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    inner.build(variables)
    audits = []

    @tf.function
    def step(grads):
        audits.append(
            _masked_update.apply(inner, grads, variables, tf.constant(True))
        )

    step([tf.ones([4, 3]), tf.ones([3])])
    (audit,) = audits
    assert audit.exact, audit.reason
    # The step counter and the weight-decayed variables are written directly.
    assert any("iteration" in name for name in audit.restored), audit.restored
    assert {"w", "b"} <= {name.split(":")[0].split("/")[-1] for name in audit.restored}




def _count_traces(monkeypatch):
    """Counts the traces of the masked update (calls of tf.function's tracing in
    `_masked_update.apply`)."""
    traces = []
    real = tf.function

    def counting(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "masked_update":
            traces.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_masked_update.tf, "function", counting)
    return traces


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_retrace_starts_from_what_the_last_trace_found(monkeypatch, mode):
    """Graph: two passes on the first trace, one on the next; XLA (dense): one each. The
    function that runs is audited either way, and skips exactly."""
    traces = _count_traces(monkeypatch)
    variables = _variables()
    inner = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    opt = tfdls.LossScaleOptimizer(inner, jit_compile=False)
    opt.build(variables)
    per_trace = []
    for _ in range(2):  # two tf.functions: two traces of the same update
        step = tf.function(lambda g: opt.apply(g, variables), jit_compile=mode == "xla")
        before = len(traces)
        step([tf.ones([4, 3]), tf.ones([3])])
        per_trace.append(len(traces) - before)
        assert opt.step_plan.skip == "masked", opt.step_plan.reason
        kept = _bits(variables + inner.variables)
        step([tf.fill([4, 3], NAN), tf.ones([3])])
        assert _bits(variables + inner.variables) == kept
    assert per_trace == ([2, 1] if mode == "graph" else [1, 1])


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_sparse_update_inside_xla_runs_its_first_trace(monkeypatch, mode):
    """An Embedding-like table with an IndexedSlices gradient, Adam: inside XLA the first
    (audited) trace runs, as for dense gradients (XLA drops the unread snapshots); outside,
    a second pass reads only the variables written directly. Either way a skipped step
    keeps every bit and a finite one equals the bare optimizer's."""
    traces = _count_traces(monkeypatch)

    def setup():
        table = keras.Variable(np.arange(12, dtype="float32").reshape(6, 2), name="table")
        return [table] + _variables()

    def grads(fill):
        rows = tf.IndexedSlices(tf.fill([2, 2], fill), tf.constant([4, 1]), tf.constant([6, 2]))
        return [rows, tf.fill([4, 3], fill), tf.ones([3]) * SCALE]

    variables = setup()
    inner = keras.optimizers.Adam(1e-2)
    opt = tfdls.LossScaleOptimizer(inner, tfdls.DynamicLossScale(SCALE), jit_compile=False)
    opt.build(variables)
    step = tf.function(lambda g: opt.apply(g, variables), jit_compile=mode == "xla")
    step(grads(SCALE))
    assert len(traces) == (1 if mode == "xla" else 2)
    assert opt.step_plan.skip == "masked", opt.step_plan.reason

    bare_variables = setup()
    bare = keras.optimizers.Adam(1e-2)
    bare.build(bare_variables)
    tf.function(lambda g: bare.apply(g, bare_variables), jit_compile=mode == "xla")(
        [tf.IndexedSlices(tf.ones([2, 2]), tf.constant([4, 1]), tf.constant([6, 2])),
         tf.ones([4, 3]), tf.ones([3])])
    for got, want in zip(variables + inner.variables, bare_variables + bare.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got),
                                      keras.ops.convert_to_numpy(want))

    opt_dynamic = tfdls.LossScaleOptimizer(keras.optimizers.Adam(1e-2), jit_compile=False)
    opt_dynamic.build(variables)
    kept = _bits(variables + opt_dynamic.inner_optimizer.variables)
    tf.function(lambda g: opt_dynamic.apply(g, variables), jit_compile=mode == "xla")(
        grads(NAN))
    assert _bits(variables + opt_dynamic.inner_optimizer.variables) == kept


def test_a_start_that_misses_a_direct_write_fails_its_audit_and_traces_again(monkeypatch):
    """The remembered start is a guess the audit checks: one that misses the step counter
    (written directly) fails, and the update is traced from every variable again."""
    traces = _count_traces(monkeypatch)
    variables = _variables()
    inner = keras.optimizers.Adam(1e-2)
    opt = tfdls.LossScaleOptimizer(inner, jit_compile=False)
    opt.build(variables)
    tf.function(lambda g: opt.apply(g, variables))([tf.ones([4, 3]), tf.ones([3])])
    (starts,) = _masked_update._written_directly[inner].values()
    assert any("iteration" in v.name for v in starts)
    for key in _masked_update._written_directly[inner]:
        _masked_update._written_directly[inner][key] = []  # forget the step counter
    before = len(traces)
    step = tf.function(lambda g: opt.apply(g, variables))
    step([tf.ones([4, 3]), tf.ones([3])])
    assert len(traces) - before == 3  # the failed start, then both passes
    assert opt.step_plan.skip == "masked", opt.step_plan.reason
    kept = _bits(variables + inner.variables)
    step([tf.fill([4, 3], NAN), tf.ones([3])])
    assert _bits(variables + inner.variables) == kept


@pytest.mark.skipif("MultiOptimizer" not in EXPORTED, reason="this Keras has no MultiOptimizer")
def test_a_multi_optimizers_sub_optimizer_writes_are_masked_not_restored():
    """A MultiOptimizer's sub-optimizers write through their own assign
    methods: masked in place, not snapshotted and written back whole (an
    Embedding table would be copied on every step)."""
    variables = _variables()
    inner = make_optimizer("MultiOptimizer", "b", learning_rate=1e-2)
    inner.build(variables)
    audits = []
    table_grad = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([1, 1]), tf.constant([4, 3]))
    tf.function(lambda g: audits.append(
        _masked_update.apply(inner, g, variables, tf.constant(True))
    ))([table_grad, tf.ones([3])])
    (audit,) = audits
    assert audit.exact, audit.reason
    # Only the step counters are written directly.
    assert audit.restored and all("iteration" in name for name in audit.restored), audit.restored


@pytest.mark.parametrize("name", ["tfdls_masked_write", "tfdls_restore_sgd"])
def test_an_optimizer_named_like_tfdls_own_scopes_is_audited_all_the_same(monkeypatch, name):
    """The audit knows tfdls' own writes by the ops it created, not by name."""
    monkeypatch.setattr(_masked_update, "SUPPORTED", _masked_update.SUPPORTED | {SideCounter})
    inner = SideCounter(0.1, name=name)
    with pytest.warns(RuntimeWarning, match="could not be shown to skip exactly"):
        opt, variables, before = _poisoned_run(inner)
    assert opt.step_plan.skip == "cond"
    assert _bits(variables + inner.variables) == before
    assert int(inner.calls.numpy()) == 2  # the skipped step did not count
