"""The TensorFlow and Keras versions tfdls needs, and every private name it uses.

Everything tfdls reads from outside the public TensorFlow and Keras APIs is
looked up here, once, when tfdls is imported. If a name is missing (an older
or newer release moved it), `import tfdls` raises an `ImportError` that says
which one, instead of a step silently taking another path later.

`check_versions` runs before anything else imports TensorFlow-dependent code,
so that a too-old installation gets a message naming the versions needed
rather than an `AttributeError` from deep inside.
"""

import enum
import sys

MIN_TENSORFLOW = (2, 16)
# 3.9: the first Keras whose LossScaleOptimizer passes `iterations` through to
# the inner optimizer and whose optimizers keep their step counter in
# `_iterations`, the behaviour tfdls is tested against (see CHANGELOG).
MIN_KERAS = (3, 9)

_INSTALL_HINT = (
    "Install one TensorFlow build next to tfdls: from a checkout of tfdls, "
    'pip install ".[cpu]" (tensorflow-cpu) or pip install ".[gpu]" (tensorflow[and-cuda]); '
    'from a built wheel, pip install "<path to the tfdls wheel>[cpu]". TensorFlow itself '
    "accepts older Keras releases: tfdls requires keras>={0}.{1} "
    '(pip install "keras>={0}.{1}").'.format(*MIN_KERAS)
)


if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # Python 3.10: the same behaviour (equal to, printed and formatted as, its value)

    class StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _need(found):
    return ImportError(
        "tfdls needs TensorFlow >= {}.{} and Keras >= {}.{}; found {}. ".format(
            *MIN_TENSORFLOW, *MIN_KERAS, found
        )
        + _INSTALL_HINT
    )


def configured_keras_backend():
    """The Keras backend in use, or the one Keras will pick when it is imported, and why.

    Keras reads ``KERAS_BACKEND``, else the ``backend`` of its ``keras.json``
    (in ``$KERAS_HOME``, else ``~/.keras``), else uses TensorFlow. Read here
    without importing Keras, because importing Keras with a backend whose
    package is missing fails with an unrelated-looking ImportError.

    Returns:
        ``(backend, source)``, for example ``("jax", "KERAS_BACKEND=jax")``.
    """
    import json
    import os
    import sys

    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend(), "keras.backend.backend()"
    if os.environ.get("KERAS_BACKEND"):
        backend = os.environ["KERAS_BACKEND"]
        return backend, f"KERAS_BACKEND={backend}"
    home = os.environ.get("KERAS_HOME")
    if home is None:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path) as config:
            backend = json.load(config).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow", "Keras' default"
    return backend, f'"backend": "{backend}" in {path}'


def check_backend(backend=None, source=""):
    """Raises ImportError unless Keras runs on its TensorFlow backend.

    Args:
        backend, source: the backend and where it was set (for tests); by
            default `configured_keras_backend()`.
    """
    if backend is None:
        backend, source = configured_keras_backend()
    if backend != "tensorflow":
        raise ImportError(
            f"tfdls needs Keras' TensorFlow backend; Keras is set to the {backend!r} backend "
            f"({source}). Set the environment variable KERAS_BACKEND=tensorflow before "
            "Keras is imported (or change \"backend\" in keras.json)."
        )


def check_versions(tensorflow_version=None, keras_version=None):
    """Raises ImportError unless TensorFlow >= 2.16 and Keras >= 3.9 are importable.

    Args:
        tensorflow_version, keras_version: version strings to check instead of
            the installed modules (for tests).
    """
    if tensorflow_version is None:
        try:
            import tensorflow
        except ImportError as error:
            raise _need(f"no TensorFlow ({error})") from error
        tensorflow_version = tensorflow.__version__
    if _version_tuple(tensorflow_version) < MIN_TENSORFLOW:
        raise _need(f"TensorFlow {tensorflow_version}")
    if keras_version is None:
        check_backend()  # before `import keras`, which fails for a backend not installed
        try:
            import keras
        except ImportError as error:
            raise _need(f"no Keras ({error})") from error
        keras_version = getattr(keras, "__version__", "0")
        check_backend()  # however it was chosen
    if _version_tuple(keras_version) < MIN_KERAS:
        raise _need(f"Keras {keras_version}")


def _missing(what, error=None):
    detail = f" ({error})" if error else ""
    return ImportError(
        f"tfdls relies on {what}, which this TensorFlow/Keras installation does not "
        f"have{detail}. tfdls is tested with TensorFlow >= {MIN_TENSORFLOW[0]}."
        f"{MIN_TENSORFLOW[1]} and Keras >= {MIN_KERAS[0]}.{MIN_KERAS[1]}; when "
        "reporting this, quote this message and the TensorFlow and Keras versions in use "
        "(tf.__version__, keras.__version__)."
    )


def _require(module_name, attribute=None):
    """Imports `module_name` and checks that it has `attribute`; else ImportError naming it."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise _missing(module_name, error) from error
    if attribute is not None and not hasattr(module, attribute):
        raise _missing(f"{module_name}.{attribute}")
    return module


def _lookup():
    """Resolves every private name once; raises ImportError naming a missing one."""
    import keras
    import tensorflow as tf

    control_flow_util = _require(
        "tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext"
    )
    tf_config = _require("tensorflow.python.framework.config", "is_op_determinism_enabled")
    func_graphs = _require(
        "tensorflow.python.ops.control_flow_v2_func_graphs", "CondBranchFuncGraph"
    )
    internal = getattr(getattr(tf, "__internal__", None), "distribute", None)
    if not hasattr(internal, "strategy_supports_no_merge_call"):  # pragma: no cover
        raise _missing("tf.__internal__.distribute.strategy_supports_no_merge_call")
    summary_pb2 = _require("tensorflow.core.framework.summary_pb2")
    record = _require("tensorflow.python.eager.record", "could_possibly_record")
    trackable = _require("tensorflow.python.trackable.base", "VARIABLE_VALUE_KEY")
    if not hasattr(getattr(tf.__internal__, "tracking", None), "Trackable"):  # pragma: no cover
        raise _missing("tf.__internal__.tracking.Trackable")
    # Optional: without it `computed_once` changes nothing but XLA's compile time.
    try:
        xla_ops = _require("tensorflow.compiler.tf2xla.ops.gen_xla_ops",
                           "xla_optimization_barrier")
    except ImportError:  # pragma: no cover - present from TF 2.16 to 2.21 at least
        xla_ops = None
    for name in OPTIMIZER_METHODS:
        if not callable(getattr(keras.optimizers.Optimizer, name, None)):  # pragma: no cover
            raise _missing(f"keras.optimizers.Optimizer.{name}")
    return (control_flow_util, tf_config, func_graphs, internal, summary_pb2, record, xla_ops,
            tf.__internal__.tracking.Trackable, trackable.VARIABLE_VALUE_KEY)


# Private members of keras.optimizers.Optimizer that tfdls' subclass uses,
# as any Keras optimizer subclass would.
OPTIMIZER_METHODS = (
    "_get_variable_index",  # positions of variables (overflow attribution)
    "_check_variables_are_known",  # Keras' own "unknown variable" error
    # Keras' all-reduce of the gradients before the update (TF backend's
    # TFOptimizer._backend_update_step calls it; Keras 3.9.2 too):
    # all_reduce_dtype="float16" hands over sums instead.
    "_all_reduce_sum_gradients",
)
OPTIMIZER_ATTRIBUTES = (
    "_trainable_variables",  # set in Optimizer.__init__
    "_variables",  # the optimizer's own variables (iterations, learning rate)
)


def check_optimizer_instance(optimizer):
    """Raises ImportError if a freshly initialized optimizer lacks an attribute tfdls reads."""
    for name in OPTIMIZER_ATTRIBUTES:
        if not hasattr(optimizer, name):  # pragma: no cover - depends on Keras
            raise _missing(f"keras.optimizers.Optimizer().{name}")


check_versions()
(
    _control_flow_util,
    _tf_config,
    _func_graphs,
    _internal_distribute,
    summary_pb2,
    _record,
    _xla_ops,
    # The base of objects a checkpoint saves (`_serialize_to_tensors`), and the name a
    # variable's value has there: `tfdls._packed_state` saves fields as variables.
    Trackable,
    VARIABLE_VALUE_KEY,
) = _lookup()


def user_stacklevel():
    """The `warnings.warn` stacklevel, for its caller, of the first frame outside tfdls,
    TensorFlow, Keras and AutoGraph's generated code: the user's line (a `fit` or a
    step function's call), however many of their frames lie between."""
    import os

    import keras
    import tensorflow as tf

    internal = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                     for path in (tf.__file__, keras.__file__, __file__))
    # tf_keras (Keras 2), where installed beside TensorFlow.
    internal += (os.path.join(os.path.dirname(internal[0].rstrip(os.sep)), "tf_keras") + os.sep,)
    frame, level = sys._getframe(1), 1  # level 1: the caller of warnings.warn
    while frame is not None and (frame.f_code.co_filename.startswith(internal)
                                 or "__autograph_generated_file" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def in_xla_context():
    """True while tracing inside an XLA-compiled function (no public equivalent)."""
    import tensorflow as tf

    return _control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def computed_once(*tensors):
    """`tensors`, unchanged; inside XLA behind an optimization barrier, so that XLA computes
    them once instead of copying their computation into every fusion that reads them.

    XLA duplicates cheap elementwise producers into each consumer fusion. A vector of
    per-segment divisors read by every gradient's update was recomputed, whole, in each of
    those fusions, each then a different kernel (it slices another element): at 100 scale
    boundaries that was about 25% of the apply's compile time. The values are the same
    either way, so a TensorFlow without the (private) barrier op just compiles slower.
    """
    if _xla_ops is None or not in_xla_context():
        return tensors
    return tuple(_xla_ops.xla_optimization_barrier(list(tensors)))


def tape_may_record():
    """True while a `tf.GradientTape` (or another tape) is recording (no public equivalent)."""
    return _record.could_possibly_record()


def is_cond_branch(graph):
    """True for the graph of a `tf.cond` branch (runs at most once per call of its parent)."""
    return isinstance(graph, _func_graphs.CondBranchFuncGraph)


def is_control_flow(graph):
    """True for the graph of a `tf.cond` branch or a `tf.while_loop` body or condition."""
    return isinstance(graph, (_func_graphs.CondBranchFuncGraph, _func_graphs.WhileBodyFuncGraph,
                              _func_graphs.WhileCondFuncGraph))


def op_determinism_enabled():
    """`tf.config.experimental.enable_op_determinism()` is on (no public getter)."""
    return _tf_config.is_op_determinism_enabled()


def strategy_supports_no_merge_call():
    """The current strategy can run optimizer updates without `merge_call`."""
    return _internal_distribute.strategy_supports_no_merge_call()


# -- private members of Keras and TensorFlow objects, read where tfdls needs them --
# (attributes, so looked up when used; each names what breaks if Keras moves it)


def gradient_accumulator(optimizer, variable):
    """The gradient accumulator Keras keeps for `variable` in `optimizer` (that of the
    sub-optimizer updating it, in a `MultiOptimizer`), or None where it accumulates none.

    Keras keeps the micro-batches' maximum, not their sum, for an
    ``overwrite_with_gradient`` variable: no accumulator to read.
    """
    if getattr(variable, "overwrite_with_gradient", False):
        return None
    if getattr(optimizer, "_var_to_optimizer_idx", None) is not None:  # MultiOptimizer
        index = optimizer._var_to_optimizer_idx[optimizer._var_key(variable)]
        optimizer = optimizer.optimizers[index]
    if not getattr(optimizer, "gradient_accumulation_steps", None):
        return None
    return optimizer._accumulated_gradients[optimizer._get_variable_index(variable)]


def cond_branch_graphs(op):
    """The (true, false) branch graphs of an ``If`` / ``StatelessIf`` op (None for another op)."""
    return getattr(op, "_true_graph", None), getattr(op, "_false_graph", None)


def op_creation_order(op):
    """An op's creation counter in its graph (later ops have larger values)."""
    return op._id


def nodes_by_depth(model):
    """A functional model's ``{depth: [node]}`` (depth 0: the output nodes); None for
    a model that is not a graph of layers."""
    return getattr(model, "_nodes_by_depth", None)


def outputs_structure(model):
    """A functional model's outputs, in the structure it returns them (None if unknown)."""
    return getattr(model, "_outputs_struct", None)


def underlying_variable(variable):
    """The `tf.Variable` a Keras variable holds (None for a plain `tf.Variable`)."""
    return getattr(variable, "_value", None)


def is_eager_tensor(value):
    """An eager tensor (a captured value with no op behind it)."""
    import tensorflow as tf

    return isinstance(value, tf.__internal__.EagerTensor)


def keras_gradient_all_reduce(optimizer):
    """The method by which a Keras optimizer all-reduces its gradients (see
    `OPTIMIZER_METHODS`), as `optimizer` will call it."""
    return optimizer._all_reduce_sum_gradients


def set_keras_gradient_all_reduce(optimizer, fn):
    """Makes `optimizer` all-reduce its gradients with `fn(grads_and_vars)` (an instance
    attribute, untracked: not part of checkpoints or configs)."""
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", fn)


def graph_and_function_graphs(graph):
    """`graph` and the graphs of every function it (transitively) calls: cond branches,
    loop bodies, nested `tf.function`s (no public listing of a graph's functions)."""
    seen, order = set(), []

    def visit(g):
        if id(g) in seen:
            return
        seen.add(id(g))
        order.append(g)
        for function in getattr(g, "_functions", {}).values():
            inner = getattr(function, "graph", None)
            if inner is not None:
                visit(inner)

    visit(graph)
    return order
