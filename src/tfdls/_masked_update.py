"""Branch-free skipping of an inner Keras optimizer's update.

A `tf.cond` around the inner update costs, on an accelerator, a device-to-host
copy of the decision that the host waits for on every step, and under XLA it
copies the optimizer state into and out of the conditional. Instead the update
always runs and cannot take effect on a skipped step:

* every write the inner optimizer makes through its `assign`, `assign_add`
  or `assign_sub` methods (which Keras' optimizers use for their update
  steps) becomes ``var = where(apply, new_value, var)``;
* every variable it writes any other way (its step counter, weight decay, EMA
  averages, constraints, a `MultiOptimizer`'s sub-optimizers) is read before
  the update and written back as ``where(apply, var, value_before)`` after it.

On a skipped step every variable therefore keeps its value bit for bit, and
XLA fuses the selects into the update.

This is used only where it can be shown exact at trace time:

* the inner optimizer is exactly one of Keras' own classes (`SUPPORTED`), and
  has no gradient accumulation or EMA overwrite (which branch internally);
* the gradients are dense;
* the inner update is traced first as a separate function and audited: every
  op that touches a variable must be a read, a masked write, or a plain
  assignment to a variable tfdls restores (the trainable variables and the
  optimizer's own). Any other op on a variable (an unknown write, a call or
  control flow taking a variable) fails the audit, and the caller falls back
  to the `tf.cond`. The audited function is the one that runs.
"""

import contextlib
import dataclasses

import keras
import tensorflow as tf

# Keras' optimizer classes whose updates are known to be made of the
# operations the audit accepts; checked for every class by the test suite.
SUPPORTED_CLASS_NAMES = (
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "Lamb",
    "Lion",
    "MultiOptimizer",
    "Muon",
    "Nadam",
    "RMSprop",
    "SGD",
    "ScheduleFreeAdamW",
)
SUPPORTED = frozenset(
    getattr(keras.optimizers, name)
    for name in SUPPORTED_CLASS_NAMES
    if hasattr(keras.optimizers, name)
)

_MASKED_SCOPE = "tfdls_masked_write"
_RESTORE_SCOPE = "tfdls_restore"
# Ops that read a variable, or pass its handle on, without writing it.
_READ_OPS = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
     "VarIsInitializedOp", "Identity"}
)
# Plain whole-variable writes, which the restore undoes.
_WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


@dataclasses.dataclass(frozen=True)
class Audit:
    """Whether the traced inner update can be skipped exactly.

    Attributes:
        exact: True if every write is masked or restored.
        reason: why not, when not exact.
        restored: names of the variables written outside the masked methods
            (and restored on a skipped step).
    """

    exact: bool
    reason: str = ""
    restored: tuple = ()


def unsupported_reason(inner_optimizer, grads):
    """Why the masked update cannot be used (static checks), or None."""
    cls = type(inner_optimizer)
    if cls not in SUPPORTED:
        return f"{cls.__module__}.{cls.__name__} is not one of Keras' own optimizer classes"
    optimizers = getattr(inner_optimizer, "optimizers", None) or [inner_optimizer]
    for opt in optimizers:
        if type(opt) not in SUPPORTED:
            return f"sub-optimizer {type(opt).__name__} is not one of Keras' own classes"
        if opt.gradient_accumulation_steps:
            return "gradient accumulation branches inside the update"
        if opt.use_ema and opt.ema_overwrite_frequency:
            return "ema_overwrite_frequency branches inside the update"
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return "sparse gradients are written with scatter operations"
    return None


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _read(variable):
    return tf.convert_to_tensor(_tf_variable(variable))


@contextlib.contextmanager
def _masked_writes(inner_optimizer, should_apply):
    """Within the block, writes through `assign*` take effect iff `should_apply`."""
    plain_assign = inner_optimizer.assign

    def masked(combine):
        def write(variable, value):
            with tf.name_scope(_MASKED_SCOPE):
                current = _read(variable)
                new = combine(current, tf.cast(value, current.dtype))
                # where(), not a masked addend: var + 0 turns -0.0 into +0.0
                # and flushes subnormals.
                plain_assign(variable, tf.where(should_apply, new, current))

        return write

    writes = {
        "assign": masked(lambda current, value: value),
        "assign_add": masked(lambda current, value: current + value),
        "assign_sub": masked(lambda current, value: current - value),
    }
    # Instance attributes shadow the methods; object.__setattr__ keeps Keras'
    # tracking out of it.
    for name, fn in writes.items():
        object.__setattr__(inner_optimizer, name, fn)
    try:
        yield
    finally:
        for name in writes:
            object.__delattr__(inner_optimizer, name)


def _resource_key(tensor):
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return (tensor.op.name, tensor.value_index)


def _in_scope(op, scope):
    return any(part.startswith(scope) for part in op.name.split("/")[:-1])


def _audit(graph, handles):
    """Classifies every op on a variable; returns (failure reason or "", written keys)."""
    direct = []
    for op in graph.get_operations():
        if not any(t.dtype == tf.resource for t in op.inputs):
            continue
        if op.type in _READ_OPS or _in_scope(op, _RESTORE_SCOPE):
            continue
        if op.type in _WRITE_OPS:
            if _in_scope(op, _MASKED_SCOPE):
                continue
            key = _resource_key(op.inputs[0])
            if key not in handles:
                return f"{op.type} {op.name!r} writes a variable tfdls does not know", []
            if key not in direct:
                direct.append(key)
            continue
        return f"{op.type} {op.name!r} takes a variable", []
    return "", direct


def apply(inner_optimizer, grads, trainable_variables, should_apply):
    """Runs ``inner_optimizer.apply(grads, trainable_variables)`` masked by `should_apply`.

    Returns the `Audit`; when it is not exact nothing was run and the caller
    must skip another way.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    candidates = []
    for variable in list(trainable_variables) + list(inner_optimizer.variables):
        tf_variable = _tf_variable(variable)
        if all(tf_variable is not c for c in candidates):
            candidates.append(tf_variable)
    outcome = {}

    def masked_update(should_apply, present_grads):
        full = [None] * len(grads)
        for i, g in zip(present, present_grads):
            full[i] = g
        graph = tf.compat.v1.get_default_graph()
        # Read every variable the update may write before it runs; each read's
        # handle identifies its variable in the audit.
        handles = {}
        with tf.name_scope("tfdls_snapshot"):
            for variable in candidates:
                before = tf.convert_to_tensor(variable)
                handles[_resource_key(before.op.inputs[0])] = (variable, before)
        with _masked_writes(inner_optimizer, should_apply):
            inner_optimizer.apply(full, trainable_variables)
        reason, direct = _audit(graph, handles)
        outcome["audit"] = Audit(
            exact=not reason,
            reason=reason,
            restored=tuple(handles[k][0].name for k in direct) if not reason else (),
        )
        if reason:
            return
        with tf.name_scope(_RESTORE_SCOPE):
            for key in direct:
                variable, before = handles[key]
                variable.assign(tf.where(should_apply, tf.convert_to_tensor(variable), before))

    # No AutoGraph: the update is Keras code and tfdls code without tensor-
    # dependent Python control flow.
    update = tf.function(masked_update, autograph=False).get_concrete_function(
        should_apply, [grads[i] for i in present]
    )
    audit = outcome["audit"]
    if audit.exact:
        update(should_apply, [grads[i] for i in present])
    return audit
