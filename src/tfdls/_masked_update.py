"""Branch-free skipping of an inner Keras optimizer's update.

A `tf.cond` around the inner update costs, on an accelerator, a device-to-host
copy of the decision that the host waits for on every step, and under XLA it
copies the optimizer state into and out of the conditional. Instead the update
always runs and cannot take effect on a skipped step:

* every write the inner optimizer makes through its `assign`, `assign_add`
  or `assign_sub` methods (which Keras' optimizers use for their update
  steps) becomes ``var = where(apply, new_value, var)``; for a sparse value
  (`tf.IndexedSlices`, an Embedding's gradient) on the written rows only
  (`_masked_scatter`);
* every variable it writes any other way (its step counter, weight decay, EMA
  averages, constraints, a `MultiOptimizer`'s sub-optimizers) is read before
  the update and written back as ``where(apply, var, value_before)`` after it.

On a skipped step every variable therefore keeps its value bit for bit, and
XLA fuses the selects into the update.

This is used only where it can be shown exact at trace time:

* the inner optimizer is exactly one of Keras' own classes (`SUPPORTED`);
* the inner update is traced first as a separate function and audited: every
  op that touches a variable must be a read, a masked write, or a plain
  assignment to a variable tfdls restores (the trainable variables and the
  optimizer's own). The branches of Keras' own conditionals (gradient
  accumulation, EMA overwrite) are audited the same way. Any other op on a
  variable (an unknown write, a call or a loop taking a variable) fails the
  audit, and the caller falls back to the `tf.cond`, with a reason that names
  the op, the variable and the cause. The audited function is the one that
  runs.
"""

import contextlib
import dataclasses
import weakref

import keras
import tensorflow as tf

from tfdls import _compat

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
# Sparse writes (Keras' assign* of tf.IndexedSlices): masked, or restored.
_SCATTER_OPS = frozenset({"ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate"})
# Keras' own conditionals, whose branches the audit reads.
_BRANCH_OPS = frozenset({"If", "StatelessIf"})


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


def unsupported_reason(inner_optimizer):
    """Why the masked update cannot be used (static checks), or None."""
    cls = type(inner_optimizer)
    if cls not in SUPPORTED:
        return f"{cls.__module__}.{cls.__name__} is not one of Keras' own optimizer classes"
    optimizers = getattr(inner_optimizer, "optimizers", None) or [inner_optimizer]
    for opt in optimizers:
        if type(opt) not in SUPPORTED:
            return f"sub-optimizer {type(opt).__name__} is not one of Keras' own classes"
    return None


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


@contextlib.contextmanager
def _masked_writes(inner_optimizer, should_apply):
    """Within the block, writes through `assign*` take effect iff `should_apply`.

    Covers the optimizer and, for a `MultiOptimizer`, each sub-optimizer
    (whose updates write through their own methods). Yields the set of the
    ops these writes create, which the audit accepts by identity (not by
    name, which an optimizer's own name scope could imitate).
    """
    own_ops = set()
    optimizers = [inner_optimizer] + list(getattr(inner_optimizer, "optimizers", None) or [])

    def masked(plain_assign, kind):
        def write(variable, value):
            graph = tf.compat.v1.get_default_graph()
            start = len(graph.get_operations())
            with tf.name_scope(_MASKED_SCOPE):
                _masked_write(plain_assign, variable, value, kind, should_apply)
            own_ops.update(graph.get_operations()[start:])

        return write

    for opt in optimizers:
        plain_assign = opt.assign
        # Instance attributes shadow the methods; object.__setattr__ keeps
        # Keras' tracking out of it.
        for name, kind in (("assign", "assign"), ("assign_add", "add"), ("assign_sub", "sub")):
            object.__setattr__(opt, name, masked(plain_assign, kind))
    try:
        yield own_ops
    finally:
        for opt in optimizers:
            for name in ("assign", "assign_add", "assign_sub"):
                object.__delattr__(opt, name)


def _masked_write(plain_assign, variable, value, kind, should_apply):
    tf_variable = _tf_variable(variable)
    value = tf.cast(value, tf_variable.dtype)
    if isinstance(value, tf.IndexedSlices):
        _masked_scatter(tf_variable, value, kind, should_apply)
        return
    current = tf.convert_to_tensor(tf_variable)
    new = {"assign": value, "add": current + value, "sub": current - value}[kind]
    # where(), not a masked addend: var + 0 turns -0.0 into +0.0 and flushes
    # subnormals.
    plain_assign(variable, tf.where(should_apply, new, current))


def _masked_scatter(variable, slices, kind, should_apply):
    """A sparse write (Keras' scatter_update/add/sub) that takes effect iff `should_apply`.

    Only the rows at ``slices.indices`` are read and written, never the whole
    table. A scatter_update writes ``where(apply, new rows, current rows)``.
    A scatter_add/sub runs as Keras runs it (duplicate indices accumulate, in
    the same op), then writes back ``where(apply, rows after, rows before)``:
    the rows it wrote itself when applying, their old bits (-0.0 and
    subnormals included) when skipping.
    """
    indices = slices.indices
    before = tf.gather(variable, indices)
    if kind == "assign":
        new = tf.where(should_apply, slices.values, before)
        variable.scatter_update(tf.IndexedSlices(new, indices, slices.dense_shape))
        return
    if _compat.in_xla_context():
        # XLA copies the whole table when a read of it precedes a scatter_add
        # or scatter_sub in the same cluster; writing the rows just read back
        # (a bitwise no-op) lets it update the table in place again.
        variable.scatter_update(tf.IndexedSlices(before, indices, slices.dense_shape))
    if kind == "add":
        variable.scatter_add(slices)
    else:
        variable.scatter_sub(slices)
    after = tf.gather(variable, indices)
    kept = tf.where(should_apply, after, before)
    variable.scatter_update(tf.IndexedSlices(kept, indices, slices.dense_shape))


def _resource_key(tensor):
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return (tensor.op.name, tensor.value_index)


def _variable_name(tensor, known):
    """A readable name for the variable a resource tensor refers to, or None.

    Args:
        tensor: a resource tensor of the traced update (or of a branch).
        known: ``{id(eager handle): name}`` of the variables tfdls knows.
    """
    key, graph = _resource_key(tensor), tensor.graph
    first_graph = graph
    while True:
        op = graph.get_operation_by_name(key[0])
        if op.type == "VarHandleOp":
            return op.get_attr("shared_name").decode() or None
        captured = {_resource_key(i): e for e, i in getattr(graph, "captures", ())}
        external = captured.get(key)
        if external is None:
            return None
        if not tf.is_symbolic_tensor(external):  # a variable's eager handle
            return known.get(id(external)) or _accessed_variable_name(first_graph, external)
        key, graph = _resource_key(external), external.graph


def _accessed_variable_name(graph, handle):
    """The name of the variable with eager `handle` that a function read or wrote."""
    for g in _graph_chain(graph):
        for variable in getattr(g, "variables", ()):
            if getattr(variable, "handle", None) is handle:
                return variable.name
    return None


def _graph_chain(graph):
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


def _audit(graph, resolve, known, own_ops):
    """Classifies every op on a variable, looking into `tf.cond` branches.

    Args:
        graph: the graph of the traced update (or of a branch in it).
        resolve: maps a resource tensor of `graph` to the key of a
            variable read before the update (a snapshot), or None.
        known: ``{id(eager handle): name}`` of the variables tfdls knows,
            for messages.
        own_ops: the ops of the masked writes (see `_masked_writes`).

    Returns:
        (failure reason or "", keys of the variables written directly).
    """
    direct = []
    for op in graph.get_operations():
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        if not resources:
            continue
        if op.type in _READ_OPS:
            continue
        if op.type in _BRANCH_OPS:
            # Keras' own conditionals (gradient accumulation, EMA overwrite):
            # audit both branches, their inputs mapped to this graph's.
            for branch in _compat.cond_branch_graphs(op):
                outer = {_resource_key(inner): t for inner, t in zip(branch.inputs, op.inputs[1:])}

                def branch_resolve(tensor, outer=outer):
                    external = outer.get(_resource_key(tensor))
                    return None if external is None else resolve(external)

                reason, found = _audit(branch, branch_resolve, known, own_ops)
                if reason:
                    return f"{reason} (in a branch of {op.type} {op.name!r})", []
                direct.extend(k for k in found if k not in direct)
            continue
        if op.type in _WRITE_OPS or op.type in _SCATTER_OPS:
            if op in own_ops:
                continue
            key = resolve(op.inputs[0])
            if key is None:
                name = _variable_name(op.inputs[0], known)
                what = "a variable" if name is None else f"the variable {name!r}"
                return (
                    f"{op.type} {op.name!r} writes {what} that is neither trainable nor one "
                    "of the inner optimizer's, so tfdls cannot restore it"
                ), []
            if key not in direct:
                direct.append(key)
            continue
        names = [_variable_name(t, known) for t in resources]
        what = ", ".join(repr(n) if n else "an unknown variable" for n in names)
        return f"{op.type} {op.name!r} takes {what}, which the audit cannot follow", []
    return "", direct


# {inner optimizer: {(variables, gradients present, sparse or not): the variables its
# update wrote directly when last traced}}, the start of its next trace (see `apply`).
_written_directly = weakref.WeakKeyDictionary()


def apply(inner_optimizer, grads, trainable_variables, should_apply):
    """Runs ``inner_optimizer.apply(grads, trainable_variables)`` masked by `should_apply`.

    Returns the `Audit`; when it is not exact nothing was run and the caller
    must skip another way.

    The update is traced with every variable it may write read beforehand,
    to find (by the audit) the ones it writes directly. Inside XLA that trace
    is the function that runs: XLA drops the reads no restore uses (also
    before an embedding table's scatter: tests/optimizer/test_sparse_memory.py).
    Otherwise it is traced again with only those variables read beforehand,
    which is the function that runs: outside XLA each read is an op per step,
    and a read of a variable written in place later (an embedding table's
    scatter_add) would make TensorFlow copy the whole variable. A later
    trace of the same update (Keras traces a train step more than once; a
    notebook retraces) starts from the variables the last one found: one
    trace, audited like any other, and the passes above again only where
    that audit fails.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    candidates = []
    for variable in list(trainable_variables) + list(inner_optimizer.variables):
        tf_variable = _tf_variable(variable)
        if all(tf_variable is not c for c in candidates):
            candidates.append(tf_variable)
    present_grads = [grads[i] for i in present]
    known = {id(v.handle): v.name for v in candidates if hasattr(v, "handle")}

    def trace(snapshot):
        outcome = {}

        def masked_update(should_apply, present_grads):
            full = [None] * len(grads)
            for i, g in zip(present, present_grads):
                full[i] = g
            graph = tf.compat.v1.get_default_graph()
            # Read the variables the update may write directly before it runs;
            # each read's handle identifies its variable in the audit.
            handles = {}
            with tf.name_scope("tfdls_snapshot"):
                for variable in snapshot:
                    before = tf.convert_to_tensor(variable)
                    handles[_resource_key(before.op.inputs[0])] = (variable, before)
            with _masked_writes(inner_optimizer, should_apply) as own_ops:
                inner_optimizer.apply(full, trainable_variables)
            reason, direct = _audit(
                graph,
                lambda t: _resource_key(t) if _resource_key(t) in handles else None,
                known,
                own_ops,
            )
            outcome["direct"] = [handles[k][0] for k in direct]
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
                    variable.assign(
                        tf.where(should_apply, tf.convert_to_tensor(variable), before)
                    )

        # No AutoGraph: the update is Keras code and tfdls code without tensor-
        # dependent Python control flow.
        function = tf.function(masked_update, autograph=False).get_concrete_function(
            should_apply, present_grads
        )
        return function, outcome

    key = (tuple(id(v) for v in trainable_variables), tuple(present),
           tuple(isinstance(grads[i], tf.IndexedSlices) for i in present))
    found_before = _written_directly.setdefault(inner_optimizer, {})
    if key in found_before:
        update, again = trace(found_before[key])
        if again["audit"].exact:
            update(should_apply, present_grads)
            return again["audit"]
    update, first = trace(candidates)
    if not first["audit"].exact:
        return first["audit"]
    if _compat.in_xla_context():
        found_before[key] = first["direct"]
        update(should_apply, present_grads)
        return first["audit"]
    update, second = trace(first["direct"])
    if second["audit"].exact:
        found_before[key] = first["direct"]
        update(should_apply, present_grads)
    return second["audit"]
