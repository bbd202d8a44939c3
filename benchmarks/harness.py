"""Shared timing harness of the optimizer-step benchmarks.

Workloads, a registry of variants, interleaved timing with the checks that
every variant really ran, and the environment record. What is timed and why is
explained in benchmarks/README.md.
"""

import dataclasses
import datetime
import gc
import os
import platform
import re
import statistics
import time
from typing import Callable, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BASELINE = "bare"  # every ratio is taken against this variant's run of the same round
# Full passes over the parameters of the bare update ("sgdm": SGD with momentum 0.9).
BARE_PASSES = {"sgd": 3, "sgdm": 5, "adam": 7}
CHECK_PASSES = 1  # the "all gradients finite?" read
UNSCALE_PASSES = 2  # an unfused `grad * (1/scale)`: read and write


# -- workloads ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """One optimizer step to time: `count` variables of `shape`, one inner optimizer.

    With `table` = (rows, width, ids), a rows x width embedding table comes
    first, its gradient a `tf.IndexedSlices` of `ids` random rows.
    """

    count: int  # number of dense variables
    shape: tuple  # shape of each dense variable
    inner: str  # "sgd", "sgdm" (SGD with momentum 0.9) or "adam"
    mode: str  # "graph" (tf.function) or "xla" (tf.function(jit_compile=True))
    calls: int = 10  # default back-to-back calls per timed round
    table: tuple = ()  # () or (rows, width, ids): an embedding table with a sparse gradient

    @property
    def name(self):
        dims = "x".join(str(d) for d in self.shape)
        table = ""
        if self.table:
            rows, width, ids = self.table
            table = f"emb{rows}x{width}" + (f":{ids}" if ids != TABLE_IDS else "") + "+"
        return f"{table}{self.count}x{dims}-{self.inner}-{self.mode}"

    @property
    def num_elements(self):
        """Elements of all variables."""
        table = self.table[0] * self.table[1] if self.table else 0
        return table + self.count * int(np.prod(self.shape))

    @property
    def grad_elements(self):
        """Elements of all gradients (a table's: its ids' rows)."""
        table = self.table[1] * self.table[2] if self.table else 0
        return table + self.count * int(np.prod(self.shape))


TABLE_IDS = 2048  # ids of a table's gradient when its name does not say (emb<rows>x<width>:<ids>)
_WORKLOAD_SPEC = re.compile(
    r"^(?:emb(\d+)x(\d+)(?::(\d+))?\+)?(\d+)x(\d+(?:x\d+)*)-(sgdm?|adam)-(graph|xla)$"
)


def parse_workload(spec, calls=10):
    """Parses a full workload spec.

    Args:
        spec: e.g. ``"24x1024x1024-adam-xla"`` or ``"emb100000x64+8x512x512-sgdm-xla"``
            (``emb<rows>x<width>[:<ids>]+``: an embedding table first; ids 2048).
        calls: default calls per timed round of the parsed workload.

    Returns:
        A `Workload`, or None if `spec` is not a full spec.
    """
    match = _WORKLOAD_SPEC.match(spec.strip().lower())
    if not match:
        return None
    rows, width, ids, count, dims, inner, mode = match.groups()
    shape = tuple(int(d) for d in dims.split("x"))
    table = (int(rows), int(width), int(ids or TABLE_IDS)) if rows else ()
    return Workload(int(count), shape, inner, mode, calls=calls, table=table)


def select_workloads(filters, defaults, parse=None):
    """Picks workloads by name.

    Args:
        filters: comma-separated tokens; a token selects every default whose
            name contains it, or, matching none, is parsed as a full spec.
            Empty: all defaults.
        defaults: the sequence of default `Workload`\\ s.
        parse: the parser of full specs (default: `parse_workload`).

    Returns:
        The chosen workloads, in order, without duplicates.

    Raises:
        SystemExit: nothing matched (a CLI error).
    """
    if not filters:
        return list(defaults)
    chosen = []
    for token in (t.strip() for t in filters.split(",")):
        if not token:
            continue
        matches = [w for w in defaults if token.lower() in w.name]
        if not matches:
            custom = (parse or parse_workload)(token)
            matches = [custom] if custom is not None else []
        chosen += [w for w in matches if w not in chosen]
    if not chosen:
        names = ", ".join(w.name for w in defaults)
        raise SystemExit(f"--workloads {filters!r} matches nothing; defaults: {names}")
    return chosen


def memory_floor(workload, dtype):
    """Bytes one step must move and the memory-pass floor ratios (README: floors).

    Args:
        workload: the `Workload`.
        dtype: the gradients' dtype; variables and optimizer slots are float32.

    Returns:
        A dict: grad_bytes, var_bytes, bare_passes, bare_bytes, floor_fused,
        floor_unfused.
    """
    grad_bytes = workload.grad_elements * tf.as_dtype(dtype).size
    # A table's sparse gradient: plain SGD writes only its rows; Keras' SGD
    # with momentum and Adam update their dense slots, and so the whole table.
    var_elements = workload.num_elements
    if workload.table and workload.inner == "sgd":
        var_elements = workload.grad_elements
    var_bytes = var_elements * 4
    bare_passes = BARE_PASSES[workload.inner]
    bare_bytes = grad_bytes + (bare_passes - 1) * var_bytes  # one of them reads the gradient
    check_bytes = CHECK_PASSES * grad_bytes
    unscale_bytes = UNSCALE_PASSES * grad_bytes
    return {
        "grad_bytes": grad_bytes,
        "var_bytes": var_bytes,
        "bare_passes": bare_passes,
        "bare_bytes": bare_bytes,
        "floor_fused": (bare_bytes + check_bytes) / bare_bytes,
        "floor_unfused": (bare_bytes + check_bytes + unscale_bytes) / bare_bytes,
    }


# -- variants -------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """What a variant builder returns.

    Attributes:
        body: ``body(grads)``, the work of one step; it becomes the timed
            `tf.function`. What it returns is what the step returns.
        loss_scale: for loss-scale optimizers, ``() -> (current, initial)``;
            the harness requires ``current >= initial`` (no step skipped). A
            builder whose optimizer counts skipped steps reports any skip as
            ``current = 0``.
    """

    body: Callable
    loss_scale: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """A registered variant.

    Attributes:
        name: the key used on the command line and in results.
        label: the column title in the markdown table.
        build: ``build(workload, variables) -> Step``.
        variables: "keras" (`keras.Variable`), "tf" (`tf.Variable`) or "none"
            (the step writes nothing and must return True; see `sync`).
        available: False when an optional dependency is missing.
    """

    name: str
    label: str
    build: Callable
    variables: str = "keras"
    available: bool = True


class Registry:
    """Variants by name, in registration order (the order of the table's columns)."""

    def __init__(self):
        self._specs = {}

    def variant(self, name, label, *, variables="keras", available=True):
        """Decorator registering ``build(workload, variables) -> Step`` as `name`.

        Args:
            name: the variant's name.
            label: its column title in the markdown table.
            variables: see `VariantSpec.variables`.
            available: False to list it as unavailable (optional dependency).
        """
        if variables not in ("keras", "tf", "none"):
            raise ValueError(f"variables must be 'keras', 'tf' or 'none'; got {variables!r}")

        def register(build):
            if name in self._specs:
                raise ValueError(f"variant {name!r} registered twice")
            self._specs[name] = VariantSpec(name, label, build, variables, bool(available))
            return build

        return register

    def __getitem__(self, name):
        return self._specs[name]

    def available(self):
        """Names of the variants that can run here, in registration order."""
        return [n for n, s in self._specs.items() if s.available]

    def labels(self):
        """Column titles of all registered variants, by name."""
        return {n: s.label for n, s in self._specs.items()}

    def resolve(self, names=None):
        """The specs to run: `names` (all available if None), `BASELINE` always first.

        Raises:
            ValueError: a name is unknown or its variant unavailable.
        """
        names = list(names) if names else self.available()
        unknown = [n for n in names if n not in self.available()]
        if unknown:
            raise ValueError(
                f"unknown or unavailable variants {unknown}; available: {self.available()}"
            )
        if BASELINE not in names:
            names.insert(0, BASELINE)
        return [self._specs[n] for n in names]


@dataclasses.dataclass
class BuiltVariant:
    """A variant ready to time: its traced step, its own variables, its scale check."""

    name: str
    step: object  # tf.function taking the list of gradients
    variables: list
    loss_scale: Optional[Callable] = None


def make_variables(kind, initial_values):
    """Fresh float32 variables holding `initial_values` (see `VariantSpec.variables`)."""
    if kind == "none":
        return []
    make = tf.Variable if kind == "tf" else _keras_variable
    return [make(v, dtype="float32") for v in initial_values]


def _keras_variable(value, dtype):
    import keras  # deferred: the harness itself does not need Keras

    return keras.Variable(value, dtype=dtype)


def build_variant(spec, workload, initial_values):
    """Fresh variables, the variant's step and its `tf.function` (XLA in "xla" mode).

    Args:
        spec: the `VariantSpec`.
        workload: the `Workload` (its inner optimizer and mode).
        initial_values: numpy arrays, one per variable.
    """
    variables = make_variables(spec.variables, initial_values)
    step = spec.build(workload, variables)
    traced = tf.function(step.body, jit_compile=workload.mode == "xla", reduce_retracing=True)
    return BuiltVariant(spec.name, traced, variables, step.loss_scale)


def make_inputs(workload, dtype, seed=0):
    """Initial variable values (numpy float32) and gradients (tensors, on the current device).

    The gradients are finite random tensors passed to the step as arguments,
    never captured, so that XLA cannot constant-fold them. A table's gradient
    is a `tf.IndexedSlices` (a composite tensor, also an argument) of `ids`
    random rows (repeats included, as in a real batch).
    """
    rng = np.random.default_rng(seed)
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    shapes = [workload.shape] * workload.count
    initial_values, grads = [], []
    if workload.table:
        rows, width, ids = workload.table
        initial_values.append((rng.standard_normal((rows, width)) * 0.1).astype(np.float32))
        grads.append(tf.IndexedSlices(
            tf.constant(rng.standard_normal((ids, width)).astype(np_dtype)),
            tf.constant(rng.integers(0, rows, ids), tf.int32),
            tf.constant([rows, width], tf.int32)))
    initial_values += [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in shapes]
    grads += [tf.constant(rng.standard_normal(s).astype(np_dtype)) for s in shapes]
    return initial_values, grads


# -- the checks -------------------------------------------------------------------


def sync(variant, last_output):
    """Blocks until every queued step of `variant` has run.

    Reads one scalar of the variant's last variable back to the host. A
    variant without variables is synced on `last_output`, what its last step
    returned, which must be True (the gradients are finite).

    Raises:
        RuntimeError: a variant without variables answered False.
    """
    if not variant.variables:
        if not bool(last_output.numpy()):
            raise RuntimeError(f"{variant.name}: finite gradients were reported non-finite")
        return None
    flat = tf.reshape(tf.convert_to_tensor(variant.variables[-1]), [-1])
    return flat[0].numpy()


def snapshot(variant):
    """Host copies of the variant's first and last variables (none if it has none)."""
    if not variant.variables:
        return []
    return [np.array(tf.convert_to_tensor(variant.variables[i])) for i in (0, -1)]


def check_updated(variant, before, when):
    """Checks that the steps since `before` really updated `variant`.

    Its first and last variables changed and stayed finite, and a loss-scale
    variant skipped no step (its scale is not below the initial one).

    Args:
        variant: the `BuiltVariant`.
        before: its `snapshot` before the steps.
        when: for the error message, e.g. "during warm-up".

    Returns:
        The new snapshot.

    Raises:
        RuntimeError: one of the checks failed.
    """
    after = snapshot(variant)
    for b, a in zip(before, after):
        if np.array_equal(a, b):
            raise RuntimeError(f"{variant.name}: variables did not change {when}")
        if not np.all(np.isfinite(a.astype(np.float32))):
            raise RuntimeError(f"{variant.name}: variables became non-finite {when}")
    if variant.loss_scale is not None:
        current, initial = variant.loss_scale()
        if not current >= initial:
            raise RuntimeError(
                f"{variant.name}: a step was skipped {when} (scale {current} < initial {initial})"
            )
    return after


def tracing_counts(built):
    """How often each variant's step has been traced so far, by name."""
    return {v.name: v.step.experimental_get_tracing_count() for v in built}


def check_no_retrace(built, counts_before):
    """Raises RuntimeError if a step was traced again since `counts_before`."""
    for name, count in tracing_counts(built).items():
        if count != counts_before[name]:
            raise RuntimeError(f"{name}: the step was retraced while being timed")


# -- timing -------------------------------------------------------------------------


def warm_up(built, grads, calls):
    """Runs `calls` untimed steps per variant (the first traces/compiles) and checks them.

    Returns:
        The snapshots after warm-up, by name.
    """
    snapshots = {}
    for v in built:
        before = snapshot(v)
        for _ in range(max(1, calls)):
            out = v.step(grads)
        sync(v, out)
        snapshots[v.name] = check_updated(v, before, "during warm-up")
    return snapshots


def time_rounds(built, grads, rounds, calls):
    """Interleaved timing: each round times every variant once, in a rotating order.

    A variant's time in a round is `calls` back-to-back steps plus one sync.

    Returns:
        Seconds per step, one sample per round, by name.
    """
    times = {v.name: [] for v in built}
    for r in range(rounds):
        shift = r % len(built)
        for v in built[shift:] + built[:shift]:
            start = time.perf_counter()
            for _ in range(calls):
                out = v.step(grads)
            sync(v, out)
            times[v.name].append((time.perf_counter() - start) / calls)
    return times


def summarize(times):
    """Per-variant medians of ms/step and of the per-round ratio to `BASELINE`.

    Args:
        times: seconds per step, one sample per round, by name (`time_rounds`).

    Returns:
        By name: ms, ratio, ratio_p25, ratio_p75, samples_ms.
    """
    baseline = times[BASELINE]
    summary = {}
    for name, samples in times.items():
        ratios = [t / b for t, b in zip(samples, baseline)]
        if len(ratios) > 1:
            quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
        else:
            quartiles = ratios * 3
        summary[name] = {
            "ms": 1000.0 * statistics.median(samples),
            "ratio": statistics.median(ratios),
            "ratio_p25": quartiles[0],
            "ratio_p75": quartiles[-1],
            "samples_ms": [1000.0 * t for t in samples],
        }
    return summary


def run_workload(workload, registry, variants=None, rounds=15, calls=None, warmup=3,
                 dtype="float32", device="/CPU:0", seed=0):
    """Times the variants on one workload, checking that each really ran.

    Args:
        workload: the `Workload`.
        registry: the `Registry` of variants.
        variants: names to run (default: all available); `BASELINE` always runs.
        rounds: timed rounds.
        calls: calls per variant per round (default: the workload's).
        warmup: untimed calls per variant before timing.
        dtype: the gradients' dtype ("float32" or "float16").
        device: where the variables, gradients and steps live.
        seed: for the initial values and gradients.

    Returns:
        A JSON-ready dict: workload, rounds, calls, dtype, device, floor,
        variants (by name, see `summarize`).
    """
    specs = registry.resolve(variants)
    calls = calls or workload.calls
    with tf.device(device):
        initial_values, grads = make_inputs(workload, dtype, seed)
        built = [build_variant(s, workload, initial_values) for s in specs]
        del initial_values
        snapshots = warm_up(built, grads, warmup)
        # A first trace that creates variables is traced twice by TensorFlow;
        # what matters is that timing never traces.
        counts = tracing_counts(built)
        times = time_rounds(built, grads, rounds, calls)
        for v in built:
            check_updated(v, snapshots[v.name], "during timing")
        check_no_retrace(built, counts)
    del built, grads
    gc.collect()  # the next workload's variables should not share memory with these
    return {
        "workload": workload.name,
        "rounds": rounds,
        "calls": calls,
        "dtype": dtype,
        "device": device,
        "floor": memory_floor(workload, dtype),
        "variants": summarize(times),
    }


def run_benchmark(workloads, registry, progress=None, **options):
    """`run_workload` on each workload.

    Args:
        workloads: the `Workload`\\ s.
        registry: the `Registry` of variants.
        progress: optional ``progress(message)`` called before each workload.
        **options: passed to `run_workload` (variants, rounds, calls, ...).
    """
    results = []
    for w in workloads:
        if progress:
            progress(f"running {w.name} ...")
        results.append(run_workload(w, registry, **options))
    return results


# -- environment ----------------------------------------------------------------


def cpu_name():
    """The CPU's model name, as far as the platform tells it."""
    name = platform.processor()
    if not name or name == platform.machine():
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    return name or platform.machine()


def gpu_names():
    """Names of the visible GPUs (empty without one)."""
    names = []
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(gpu)
            names.append(details.get("device_name", gpu.name))
        except Exception:  # noqa: BLE001 - details are best effort
            names.append(gpu.name)
    return names


def package_version(module_name):
    """`module.__version__`, or None if the module is not importable."""
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return getattr(module, "__version__", "unknown")


def environment():
    """Date, machine and versions, for the record (JSON-ready)."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.machine()}",
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": package_version("keras"),
        "tf_keras": package_version("tf_keras"),
        "tfdls": package_version("tfdls"),
    }
