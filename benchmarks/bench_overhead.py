"""Step overhead of loss-scale optimizers, relative to the bare inner optimizer.

What is timed
-------------
One optimizer step, called through a ``tf.function(reduce_retracing=True)``
("graph") or ``tf.function(jit_compile=True, reduce_retracing=True)`` ("xla").
The gradients are fixed, finite random tensors passed as *arguments* of the
function (never captured constants, so XLA cannot fold them); the variables
are captured. Each variant has its own fresh variables (same initial values)
and its own fresh inner optimizer of the same kind:

``bare``
    ``inner.apply(grads, variables)`` - a Keras 3 optimizer on its own.
``keras3``
    ``keras.optimizers.LossScaleOptimizer(inner).apply(grads, variables)``.
``tf_keras``
    (only when ``tf_keras`` is importable) tf_keras' own API:
    ``opt = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.X())``
    on ``tf.Variable``\\ s, and the timed function body is::

        unscaled = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(unscaled, variables))

    (with ``--dtype float16`` the unscaled float16 gradients are then cast to
    float32 in the function, as tf_keras' optimizers need, in ``tf_keras_bare``
    too), i.e. unscaling plus the finiteness check, loss-scale update and the
    conditional inner update, the same work the other loss-scale variants do
    inside ``apply``. The inner tf_keras optimizer is built with
    ``jit_compile=False`` so that the outer ``tf.function`` alone decides
    whether XLA is used (tf_keras would otherwise XLA-compile each variable's
    update on GPUs, also in "graph" mode).
``tf_keras_bare``
    (only with tf_keras) ``tf_keras.optimizers.X().apply_gradients(...)``: the
    baseline that ``tf_keras``'s own overhead should be read against, since
    tf_keras' optimizers are not Keras 3's.
``tfdls``
    ``tfdls.LossScaleOptimizer(inner).apply(grads, variables)`` (dynamic scale,
    default settings). In "graph" mode its default ``jit_compile="auto"``
    runs the apply as its own XLA cluster; with SGD it folds the unscaling
    into the learning rate.
``tfdls_nojit``
    the same with ``jit_compile=False``: the apply stays plain graph-mode
    TensorFlow, like ``bare`` and ``keras3`` ("xla" mode: as ``tfdls``).
``bare_xla_apply``
    the bare inner update compiled the way ``tfdls`` compiles its apply in
    "graph" mode (a nested ``tf.function(jit_compile=True)``): the baseline for
    what ``tfdls``'s loss scaling itself costs there. In "xla" mode it equals
    ``bare``.
``tfdls_noattr``
    ``tfdls`` with ``overflow_attribution=False``, to price the attribution.
``check_only``
    ``tfdls.all_finite(grads)`` and nothing else: the read pass over the
    gradients that every loss-scale optimizer must make before it writes
    anything, measured. ``1 + its ratio`` is what a loss-scale optimizer would
    cost if its check overlapped nothing of the update; an optimizer below that
    reuses gradients the check left in cache. It has no variables: the benchmark
    checks instead that it answered True.

All loss-scale optimizers use a dynamic scale starting at 2**15 that grows every
2000 finite steps; the gradients are finite, so every step is applied. After the
warm-up and again after timing, the benchmark checks that each variant's first
and last variables changed and that no loss-scale optimizer skipped a step (its
scale did not fall below the initial one), so every variant really runs its
update; it also checks that no step function is traced again while timed.

How it is timed
---------------
Variants are interleaved in one process. After a warm-up (``--warmup`` calls
per variant, the first of which traces/compiles), each of ``--rounds`` rounds
times every variant once (the order rotates from round to round): ``--calls``
back-to-back calls followed by a sync (a scalar of one of the variant's variables
is read back with ``.numpy()``). Reported per variant: the median over rounds of
milliseconds per step and the median over rounds of the per-round ratio
``variant time / bare time`` (the bare run of the same round, which cancels
most of the slow drift of a loaded machine); ``[p25-p75]`` of that ratio is
printed too.

Memory-pass floor
-----------------
These optimizer steps are memory bound, so a lower bound on a loss-scale
optimizer's ratio is the memory traffic it must cause, divided by the traffic of
the bare update. Counting full passes (reads and writes) over the N parameters,
assuming the arithmetic of each step is perfectly fused:

* SGD (no momentum): read grad, read var, write var                 = 3 passes
* Adam: read grad, m, v, var; write m, v, var                        = 7 passes
* a loss-scale optimizer must also decide "all gradients finite?" before it
  writes anything: +1 read pass over the gradients (the check);
* if unscaling (``grad * (1/scale)``) is *not* fused into the update, it is a
  separate read + write of the gradients: +2 passes.

With float32 gradients, ``floor fused = (bare + 1) / bare`` (SGD 4/3 = 1.33,
Adam 8/7 = 1.14) and ``floor unfused = (bare + 3) / bare`` (SGD 6/3 = 2.00,
Adam 10/7 = 1.43). The floors are computed in bytes, so with ``--dtype float16``
(float16 gradients; variables and slots stay float32, and Keras casts each
gradient to its variable's dtype in the update) a gradient pass weighs half a
variable pass: SGD 1.20 / 1.60, Adam 1.08 / 1.23. The floors ignore per-op launch
costs, which dominate for many small variables (e.g. 200 x 64x64), and real
graph-mode TensorFlow does not fuse the bare update either (SGD is a multiply
and an ``assign_sub``), so measured ratios can be below the floor there. The
gradient and variable byte counts are printed with the floors.

In "graph" mode ``tfdls`` avoids the unfused cost in two ways: with SGD the
unscaling is folded into the learning rate (no pass at all, exactly the same
numbers), and otherwise ``jit_compile="auto"`` compiles its apply so that XLA
fuses the check and the unscaling into the update. The compiled inner update
is itself faster than Keras' graph-mode one; ``bare_xla_apply`` shows by how
much, and ``tfdls / bare_xla_apply`` is what the loss scaling costs there.

Usage
-----
::

    python benchmarks/bench_overhead.py                      # all default workloads, CPU
    python benchmarks/bench_overhead.py --quick              # smoke run
    python benchmarks/bench_overhead.py --workloads adam-xla --rounds 25
    python benchmarks/bench_overhead.py --workloads 4x8x8-sgd-graph  # ad-hoc workload
    python benchmarks/bench_overhead.py --device /GPU:0 --markdown

A workload is ``<count>x<dim>x<dim>...-<sgd|adam>-<graph|xla>``; ``--workloads``
takes comma-separated substrings of the default names, or full ad-hoc specs.
"""

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import re
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

try:  # tf_keras is optional.
    import tf_keras  # noqa: E402
except ImportError:  # pragma: no cover - depends on the environment
    tf_keras = None

import tfdls  # noqa: E402

BARE_PASSES = {"sgd": 3, "adam": 7}
CHECK_PASSES = 1
UNSCALE_PASSES = 2
SGD_LEARNING_RATE = 0.01
ADAM_LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class Workload:
    count: int  # number of variables
    shape: tuple  # shape of each variable
    inner: str  # "sgd" or "adam"
    mode: str  # "graph" or "xla"
    calls: int = 10  # default calls per timed round

    @property
    def name(self):
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.count}x{dims}-{self.inner}-{self.mode}"

    @property
    def num_elements(self):
        return self.count * int(np.prod(self.shape))


DEFAULT_WORKLOADS = (
    Workload(200, (64, 64), "sgd", "graph", calls=50),
    Workload(24, (1024, 1024), "sgd", "graph", calls=10),
    Workload(24, (1024, 1024), "adam", "graph", calls=10),
    Workload(24, (1024, 1024), "sgd", "xla", calls=10),
    Workload(24, (1024, 1024), "adam", "xla", calls=10),
    Workload(200, (64, 64), "adam", "xla", calls=50),
)

_SPEC = re.compile(r"^(\d+)x(\d+(?:x\d+)*)-(sgd|adam)-(graph|xla)$")


def parse_workload(spec, calls=10):
    """`"24x1024x1024-adam-xla"` -> Workload, or None if `spec` is no full spec."""
    match = _SPEC.match(spec.strip().lower())
    if not match:
        return None
    count, dims, inner, mode = match.groups()
    shape = tuple(int(d) for d in dims.split("x"))
    return Workload(int(count), shape, inner, mode, calls=calls)


def select_workloads(filters):
    """Default workloads whose name contains any filter; full specs are added as is."""
    if not filters:
        return list(DEFAULT_WORKLOADS)
    tokens = [t.strip() for t in filters.split(",") if t.strip()]
    chosen = []
    for token in tokens:
        custom = parse_workload(token)
        matches = [w for w in DEFAULT_WORKLOADS if token.lower() in w.name]
        if custom is not None and not matches:
            matches = [custom]
        for w in matches:
            if w not in chosen:
                chosen.append(w)
    if not chosen:
        names = ", ".join(w.name for w in DEFAULT_WORKLOADS)
        raise SystemExit(f"--workloads {filters!r} matches nothing; defaults: {names}")
    return chosen


def memory_floor(workload, dtype):
    """Bytes moved and the memory-pass floor ratios (see the module docstring)."""
    n = workload.num_elements
    grad_bytes = n * tf.as_dtype(dtype).size
    var_bytes = n * 4  # variables (and optimizer slots) are always float32
    var_passes = BARE_PASSES[workload.inner] - 1  # all but the gradient read
    bare_bytes = grad_bytes + var_passes * var_bytes
    check_bytes = CHECK_PASSES * grad_bytes
    unscale_bytes = UNSCALE_PASSES * grad_bytes
    return {
        "grad_bytes": grad_bytes,
        "var_bytes": var_bytes,
        "bare_passes": BARE_PASSES[workload.inner],
        "bare_bytes": bare_bytes,
        "floor_fused": (bare_bytes + check_bytes) / bare_bytes,
        "floor_unfused": (bare_bytes + check_bytes + unscale_bytes) / bare_bytes,
    }


# -- variants -------------------------------------------------------------------


def available_variants():
    names = ["bare", "keras3"]
    if tf_keras is not None:
        names += ["tf_keras_bare", "tf_keras"]
    names += ["bare_xla_apply", "tfdls", "tfdls_nojit", "tfdls_noattr", "check_only"]
    return names


def _keras_inner(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=SGD_LEARNING_RATE)
    return keras.optimizers.Adam(learning_rate=ADAM_LEARNING_RATE)


def _tf_keras_inner(kind):
    if kind == "sgd":
        return tf_keras.optimizers.SGD(learning_rate=SGD_LEARNING_RATE, jit_compile=False)
    return tf_keras.optimizers.Adam(learning_rate=ADAM_LEARNING_RATE, jit_compile=False)


def _to_float32(grads):
    # tf_keras' optimizers, unlike Keras 3's, do not cast gradients to the
    # variables' dtype; with --dtype float16 the tf_keras variants do it here.
    return [g if g.dtype == tf.float32 else tf.cast(g, tf.float32) for g in grads]


@dataclasses.dataclass
class Variant:
    name: str
    step: object  # tf.function taking the list of gradients
    variables: list
    min_scale: object = None  # () -> (current scale, initial scale), for LSOs


def build_variant(name, workload, initial_values):
    """Builds fresh variables, a fresh optimizer and the traced step of one variant."""
    jit = workload.mode == "xla"
    if name == "check_only":
        variables = []  # reads the gradients, writes nothing
    elif name.startswith("tf_keras"):
        variables = [tf.Variable(v, dtype="float32") for v in initial_values]
    else:
        variables = [keras.Variable(v, dtype="float32") for v in initial_values]
    scale = None

    if name == "bare":
        opt = _keras_inner(workload.inner)

        def body(grads):
            opt.apply(grads, variables)

    elif name == "keras3":
        opt = keras.optimizers.LossScaleOptimizer(_keras_inner(workload.inner))

        def body(grads):
            opt.apply(grads, variables)

        def scale():
            return float(opt.dynamic_scale.numpy()), float(opt.initial_scale)

    elif name == "bare_xla_apply":
        opt = _keras_inner(workload.inner)
        compiled_apply = tf.function(lambda grads: opt.apply(grads, variables), jit_compile=True)

        def body(grads):
            compiled_apply(grads)

    elif name in ("tfdls", "tfdls_nojit", "tfdls_noattr"):
        opt = tfdls.LossScaleOptimizer(
            _keras_inner(workload.inner),
            overflow_attribution=name != "tfdls_noattr",
            jit_compile=False if name == "tfdls_nojit" else "auto",
        )

        def body(grads):
            opt.apply(grads, variables)

        def scale():
            skipped = int(opt.loss_scale.num_skipped_steps.numpy())
            # Any skipped step counts as a scale below the initial one.
            current = float(opt.loss_scale().numpy()) if skipped == 0 else 0.0
            return current, float(opt.initial_scale)

    elif name == "check_only":

        def body(grads):
            return tfdls.all_finite(grads)

    elif name == "tf_keras_bare":
        opt = _tf_keras_inner(workload.inner)

        def body(grads):
            opt.apply_gradients(zip(_to_float32(grads), variables))

    elif name == "tf_keras":
        opt = tf_keras.mixed_precision.LossScaleOptimizer(_tf_keras_inner(workload.inner))
        # What a real step does before differentiating; also silences its
        # "you forgot to call get_scaled_loss()" warning.
        opt.get_scaled_loss(tf.constant(1.0))

        def body(grads):
            unscaled = opt.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(_to_float32(unscaled), variables))

        def scale():
            return float(opt.loss_scale.numpy()), float(opt.initial_scale)

    else:
        raise ValueError(f"unknown variant {name!r}")

    step = tf.function(body, jit_compile=jit, reduce_retracing=True)
    return Variant(name, step, variables, scale)


def _sync(variant, last_output):
    """Blocks until every queued step of `variant` has run (reads one scalar).

    `last_output` is what the last step returned; a variant without variables
    (``check_only``) is synced on it, and it must say the gradients are finite.
    """
    if not variant.variables:
        if not bool(last_output.numpy()):
            raise RuntimeError(f"{variant.name}: finite gradients were reported non-finite")
        return
    flat = tf.reshape(tf.convert_to_tensor(variant.variables[-1]), [-1])
    return flat[0].numpy()


def _snapshot(variant):
    if not variant.variables:
        return []
    return [np.array(tf.convert_to_tensor(variant.variables[i])) for i in (0, -1)]


def _check_updates(variant, before, when):
    after = _snapshot(variant)
    for b, a in zip(before, after):
        if np.array_equal(a, b):
            raise RuntimeError(f"{variant.name}: variables did not change {when}")
        if not np.all(np.isfinite(a.astype(np.float32))):
            raise RuntimeError(f"{variant.name}: variables became non-finite {when}")
    if variant.min_scale is not None:
        current, initial = variant.min_scale()
        if not current >= initial:
            raise RuntimeError(
                f"{variant.name}: a step was skipped {when} "
                f"(scale {current} < initial {initial})"
            )
    return after


# -- running ------------------------------------------------------------------------


def run_workload(
    workload, rounds, calls, warmup=3, dtype="float32", device="/CPU:0", variants=None, seed=0
):
    """Times every variant on one workload; returns a result dict."""
    variants = list(variants or available_variants())
    if "bare" not in variants:
        variants.insert(0, "bare")
    rng = np.random.default_rng(seed)
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    with tf.device(device):
        initial_values = [
            (rng.standard_normal(workload.shape) * 0.1).astype(np.float32)
            for _ in range(workload.count)
        ]
        grads = [
            tf.constant(rng.standard_normal(workload.shape).astype(np_dtype))
            for _ in range(workload.count)
        ]
        built = [build_variant(n, workload, initial_values) for n in variants]
        del initial_values

        snapshots = {}
        for v in built:
            before = _snapshot(v)
            for _ in range(max(1, warmup)):
                out = v.step(grads)
            _sync(v, out)
            snapshots[v.name] = _check_updates(v, before, "during warm-up")
        # A first trace that creates variables is traced twice by TensorFlow;
        # what matters is that timing never traces.
        traces_after_warmup = {
            v.name: v.step.experimental_get_tracing_count() for v in built
        }

        times = {v.name: [] for v in built}
        for r in range(rounds):
            shift = r % len(built)
            for v in built[shift:] + built[:shift]:
                start = time.perf_counter()
                for _ in range(calls):
                    out = v.step(grads)
                _sync(v, out)
                times[v.name].append((time.perf_counter() - start) / calls)

        for v in built:
            _check_updates(v, snapshots[v.name], "during timing")
            traces = v.step.experimental_get_tracing_count()
            if traces != traces_after_warmup[v.name]:
                raise RuntimeError(f"{v.name}: the step was retraced while being timed")

    bare = times["bare"]
    result = {
        "workload": workload.name,
        "rounds": rounds,
        "calls": calls,
        "dtype": dtype,
        "device": device,
        "floor": memory_floor(workload, dtype),
        "variants": {},
    }
    for name, samples in times.items():
        ratios = [t / b for t, b in zip(samples, bare)]
        if len(ratios) > 1:
            q = statistics.quantiles(ratios, n=4, method="inclusive")
        else:
            q = ratios * 3
        result["variants"][name] = {
            "ms": 1000.0 * statistics.median(samples),
            "ratio": statistics.median(ratios),
            "ratio_p25": q[0],
            "ratio_p75": q[-1],
            "samples_ms": [1000.0 * t for t in samples],
        }
    del built, grads
    gc.collect()
    return result


def run_benchmark(workloads, rounds=15, calls=None, warmup=3, dtype="float32",
                  device="/CPU:0", variants=None, progress=None):
    """Runs `run_workload` on each workload (calls=None: each workload's default)."""
    results = []
    for w in workloads:
        if progress:
            progress(f"running {w.name} ...")
        results.append(
            run_workload(w, rounds, calls or w.calls, warmup, dtype, device, variants)
        )
    return results


# -- reporting ------------------------------------------------------------------


def _overhead_vs_keras(result):
    v = result["variants"]
    if "keras3" not in v or "tfdls" not in v:
        return None
    keras_over = v["keras3"]["ratio"] - 1.0
    if keras_over <= 0:
        return None
    return (v["tfdls"]["ratio"] - 1.0) / keras_over


def _columns(results):
    names = []
    for r in results:
        for n in r["variants"]:
            if n not in names:
                names.append(n)
    return names


def format_text(results):
    names = _columns(results)
    lines = []
    header = f"{'workload':<26}" + "".join(f"{n:>28}" for n in names)
    header += f"{'tfdls/keras3 over':>19}"
    lines.append(header)
    for r in results:
        row = f"{r['workload']:<26}"
        for n in names:
            v = r["variants"].get(n)
            if v is None:
                row += f"{'-':>28}"
            else:
                cell = (
                    f"{v['ms']:.2f}ms {v['ratio']:.3f}x "
                    f"[{v['ratio_p25']:.2f}-{v['ratio_p75']:.2f}]"
                )
                row += f"{cell:>28}"
        rel = _overhead_vs_keras(r)
        row += f"{'-' if rel is None else f'{rel:.2f}':>19}"
        lines.append(row)
    lines.append("")
    lines.append("memory-pass floors (ratio to bare; see module docstring):")
    for r in results:
        f = r["floor"]
        lines.append(
            f"  {r['workload']:<26} grads {f['grad_bytes'] / 2**20:8.1f} MiB, "
            f"vars {f['var_bytes'] / 2**20:8.1f} MiB, bare {f['bare_passes']} passes "
            f"({f['bare_bytes'] / 2**20:.0f} MiB); floor fused {f['floor_fused']:.3f}x, "
            f"unfused {f['floor_unfused']:.3f}x"
        )
    return "\n".join(lines)


def _cpu_name():
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


def environment():
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{_cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.machine()}",
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "tf_keras": getattr(tf_keras, "__version__", None) if tf_keras else None,
        "tfdls": tfdls.__version__,
    }


def format_markdown(results, settings):
    env = environment()
    names = _columns(results)
    labels = {
        "bare": "bare (ms)",
        "keras3": "Keras 3 LSO",
        "tf_keras_bare": "tf_keras bare",
        "tf_keras": "tf_keras LSO",
        "bare_xla_apply": "bare, XLA apply",
        "tfdls": "tfdls LSO",
        "tfdls_nojit": "tfdls, jit_compile=False",
        "tfdls_noattr": "tfdls, attribution off",
        "check_only": "check alone",
    }
    lines = [
        f"Date: {env['date']}; machine: {env['machine']}; Python {env['python']}; "
        f"TensorFlow {env['tensorflow']}; Keras {env['keras']}"
        + (f"; tf_keras {env['tf_keras']}" if env["tf_keras"] else "")
        + f"; tfdls {env['tfdls']}.",
        "",
        f"Device {settings['device']}, dtype {settings['dtype']}, median of "
        f"{settings['rounds']} interleaved rounds. Cells: ms/step and ratio to bare "
        "Keras 3 optimizer.",
        "",
        "| workload | "
        + " | ".join(labels.get(n, n) for n in names)
        + " | tfdls/Keras 3 overhead | floor fused | floor unfused |",
        "|---|" + "---:|" * (len(names) + 3),
    ]
    for r in results:
        cells = []
        for n in names:
            v = r["variants"].get(n)
            if v is None:
                cells.append("-")
            elif n == "bare":
                cells.append(f"{v['ms']:.2f}")
            else:
                cells.append(f"{v['ms']:.2f} ({v['ratio']:.2f}x)")
        rel = _overhead_vs_keras(r)
        f = r["floor"]
        lines.append(
            f"| {r['workload']} (calls {r['calls']}) | "
            + " | ".join(cells)
            + f" | {'-' if rel is None else f'{rel:.2f}'}"
            + f" | {f['floor_fused']:.2f}x | {f['floor_unfused']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workloads", default="",
                        help="comma-separated name substrings or full specs such as "
                        "4x8x8-sgd-graph (default: all defaults)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per workload (default 15; --quick: 3)")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per variant per round (default: per workload)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed calls per variant before timing (default 3)")
    parser.add_argument("--variants", default="",
                        help="comma-separated subset of " + ",".join(available_variants())
                        + " (bare is always run; default: all available)")
    parser.add_argument("--device", default="/CPU:0", help="e.g. /CPU:0 or /GPU:0")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="dtype of the gradients (variables are float32)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 rounds, fewer calls, 2 warm-up calls")
    parser.add_argument("--markdown", action="store_true",
                        help="also print a markdown table with the environment")
    args = parser.parse_args(argv)

    workloads = select_workloads(args.workloads)
    variants = None
    if args.variants:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(variants) - set(available_variants()))
        if unknown:
            parser.error(f"unknown or unavailable variants {unknown}; "
                         f"available: {available_variants()}")
    rounds = args.rounds or (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if args.quick and args.calls is None:
        workloads = [dataclasses.replace(w, calls=max(2, w.calls // 5)) for w in workloads]
    if rounds < 1 or (args.calls is not None and args.calls < 1):
        parser.error("--rounds and --calls must be >= 1")

    env = environment()
    print(
        f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, tf_keras "
        f"{env['tf_keras'] or 'not installed'}, tfdls {env['tfdls']}; {env['machine']}",
        file=sys.stderr,
    )
    results = run_benchmark(
        workloads, rounds=rounds, calls=args.calls, warmup=warmup, dtype=args.dtype,
        device=args.device, variants=variants,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(
        f"\ndevice {args.device}, dtype {args.dtype}, {rounds} rounds; "
        "cells: median ms/step, median ratio to bare [p25-p75]"
    )
    print(format_text(results))
    if args.markdown:
        print()
        print(format_markdown(results, {"device": args.device, "dtype": args.dtype,
                                        "rounds": rounds}))
    return results


if __name__ == "__main__":
    main()
