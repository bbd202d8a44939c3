"""One-shot check of tfdls on an NVIDIA GPU: step overhead, fit speed, device-to-host
copies per step, MirroredStrategy with XLA and a Transformer's fit (bench_fit.py).

    python benchmarks/gpu_check.py --json gpu_check.json          # on a GPU machine
    python benchmarks/gpu_check.py --allow-cpu --quick --json x.json  # same paths, tiny, CPU
    python benchmarks/render.py gpu_check.json                     # markdown tables

What each part measures and how is in benchmarks/README.md ("GPU check").
"""

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

STARTED = time.monotonic()  # --time-budget counts from here, TensorFlow's import included

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __name__ == "__main__" and "--mirrored-child" not in sys.argv:
    # Take GPU memory as it is needed rather than all of it at start: the
    # MirroredStrategy part runs in a second process that needs some too.
    # (An environment variable because it must be set before TensorFlow
    # initializes the GPU, which importing Keras or tfdls might do.)
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, render, bench_overhead

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

import bench_fit  # noqa: E402
import bench_overhead  # noqa: E402
import harness  # noqa: E402
import profile_trace  # noqa: E402
import render  # noqa: E402
import tfdls  # noqa: E402

# In the order they run: the long overhead part last, so that a run cut short
# by a time limit still has the others (the JSON is rewritten after each part).
PARTS = ("fit", "device_to_host", "mirrored", "transformer_fit", "overhead")
LEARNING_RATE = 1e-3
GPU_LOGICAL_MEMORY_MB = 8192  # per logical GPU of the MirroredStrategy part


# -- settings -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitSetup:
    """The `fit` workload: an MLP classifier on synthetic data.

    Attributes:
        features, hidden, depth, classes: the MLP (depth hidden ReLU layers).
        batch_size: global batch size.
        steps: steps per timed `fit` call.
        repeats: timed `fit` calls per optimizer (interleaved, median reported).
        warmup_steps: untimed steps first (the first traces and compiles).
        profile_steps: (short, long) steps of the two profiled `fit` calls.
        mirrored_steps: steps per epoch (two epochs) under MirroredStrategy.
    """

    features: int
    hidden: int
    depth: int
    classes: int
    batch_size: int
    steps: int
    repeats: int
    warmup_steps: int
    profile_steps: tuple
    mirrored_steps: int

    def describe(self):
        return (f"MLP {self.features}-" + f"{self.hidden}-" * self.depth
                + f"{self.classes}, ReLU, Adam")


# Warm-up is generous: the first few hundred steps of a fresh model run slower
# (input pipeline, thread pools), which would favour whichever optimizer is
# timed last.
GPU_FIT = FitSetup(features=1024, hidden=4096, depth=4, classes=1000, batch_size=512,
                   steps=200, repeats=5, warmup_steps=100, profile_steps=(5, 25),
                   mirrored_steps=20)
CPU_FIT = FitSetup(features=16, hidden=32, depth=2, classes=4, batch_size=32,
                   steps=20, repeats=3, warmup_steps=20, profile_steps=(2, 6),
                   mirrored_steps=4)


def shrink(workload):
    """A tiny workload of the same kind, for --allow-cpu (200x64x64 -> 4x8x8).

    An embedding table shrinks too: 100000x64, 2048 ids -> 2000x8, 32 ids.
    """
    rows, width, ids = workload.table or (0, 0, 0)
    return dataclasses.replace(
        workload,
        count=max(2, workload.count // 50),
        shape=tuple(max(8, d // 64) for d in workload.shape),
        calls=max(2, workload.calls // 10),
        table=(rows // 50, max(8, width // 64), max(8, ids // 64)) if workload.table else (),
    )


# -- devices ------------------------------------------------------------------------------


def split_device(kind, count=2, memory_limit_mb=None):
    """Splits the first physical `kind` device into `count` logical ones.

    Has to run before TensorFlow initializes its devices. If it already has
    (a test process whose conftest split the CPU), the existing logical devices
    are used when there are enough.

    Args:
        kind: "GPU" or "CPU".
        count: logical devices wanted.
        memory_limit_mb: memory of each logical GPU (required for GPUs).

    Returns:
        The names of `count` logical devices.

    Raises:
        RuntimeError: no such device, or too few logical devices.
    """
    physical = tf.config.list_physical_devices(kind)
    if not physical:
        raise RuntimeError(f"no physical {kind} device")
    config = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)] * count
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError:
        pass  # TensorFlow is initialized: take what it has
    logical = [d.name for d in tf.config.list_logical_devices(kind)]
    if len(logical) < count:
        raise RuntimeError(f"need {count} logical {kind} devices, TensorFlow has {logical}")
    return logical[:count]


# -- models and optimizers ---------------------------------------------------------------


def make_optimizer(name):
    """A fresh optimizer for `fit`: "bare" Adam, "keras3" or "tfdls" loss scaling of Adam."""
    inner = keras.optimizers.Adam(LEARNING_RATE)
    if name == "bare":
        return inner
    if name == "keras3":
        return keras.optimizers.LossScaleOptimizer(inner)
    if name == "tfdls":
        return tfdls.LossScaleOptimizer(inner)
    raise ValueError(f"unknown optimizer {name!r}")


FIT_OPTIMIZERS = ("bare", "keras3", "tfdls")


def loss_scale_of(optimizer):
    """The current loss scale of a tfdls or Keras 3 loss-scale optimizer (None if bare)."""
    if isinstance(optimizer, tfdls.LossScaleOptimizer):  # before Keras': it subclasses it
        value = optimizer.loss_scale()
    elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        value = optimizer.dynamic_scale
    else:
        return None
    return float(tf.convert_to_tensor(value))


def build_model(setup, optimizer_name, jit_compile, seed=0):
    """A compiled MLP under the current dtype policy (mixed_float16 here).

    "bare" means no loss scaling: compiled with ``auto_scale_loss=False``,
    so Keras does not wrap the optimizer in its own LossScaleOptimizer; the
    model computes in float16 all the same. The loss-scale optimizers are
    passed already wrapped (the flag then changes nothing).
    """
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((setup.features,))]
    layers += [keras.layers.Dense(setup.hidden, activation="relu") for _ in range(setup.depth)]
    layers += [keras.layers.Dense(setup.classes),
               keras.layers.Activation("linear", dtype="float32")]  # float32 logits
    model = keras.Sequential(layers)
    model.compile(
        optimizer=make_optimizer(optimizer_name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
        auto_scale_loss=False,
    )
    return model


def synthetic_dataset(setup, seed=0):
    """Eight batches of a random linear teacher's labels, cached and repeated forever."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8 * setup.batch_size, setup.features)).astype("float32")
    teacher = rng.standard_normal((setup.features, setup.classes)).astype("float32")
    y = np.argmax(x @ teacher, axis=1).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(setup.batch_size,
                                                              drop_remainder=True)
    return dataset.cache().repeat().prefetch(2)


def fit_steps(model, dataset, steps):
    """One `fit` epoch of `steps` steps; returns its last loss (which syncs the device)."""
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)
    return float(history.history["loss"][-1])


def device_scope(device):
    """Where `fit` runs: `tf.device(device)`, except on /GPU:0.

    There Keras already places the model on the GPU, and a GPU scope around
    `fit` would also pull the tf.data input pipeline onto it.
    """
    if device.upper() == "/GPU:0":
        return contextlib.nullcontext()
    return tf.device(device)


class mixed_float16:
    """Context manager: the mixed_float16 global policy, restored on exit."""

    def __enter__(self):
        self._previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("mixed_float16")

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy(self._previous)


# -- overhead: the optimizer step alone -------------------------------------------------------


class BudgetSpent(Exception):
    """A part did not start because --time-budget was spent."""


def overhead_part(device, tiny, quick, workloads="", deadline=None, log=print):
    """bench_overhead's default workloads with float16 gradients on `device`.

    Args:
        device: e.g. "/GPU:0".
        tiny: shrink the workloads (CPU smoke runs).
        quick: bench_overhead's --quick settings.
        workloads: optional --workloads filter over the default names.
        deadline: a `time.monotonic()` after which no further workload starts
            (those are listed under "not_run").
        log: progress printer.

    Returns:
        A bench_overhead report (render.py renders it).
    """
    chosen = bench_overhead.select_workloads(workloads)
    # The embedding workloads first: the newest (issue 19), so --time-budget cuts others.
    chosen.sort(key=lambda w: not w.table)
    if tiny:
        chosen = [shrink(w) for w in chosen]
    chosen, rounds, warmup = bench_overhead.quick_settings(chosen, quick=quick)
    report, not_run = None, []
    for workload in chosen:
        if deadline is not None and time.monotonic() > deadline:
            not_run.append(workload.name)
            continue
        one = bench_overhead.run([workload], rounds=rounds, warmup=warmup, dtype="float16",
                                 device=device, progress=log)
        if report is None:
            report = one
        else:
            report["results"] += one["results"]
    if report is None:
        raise BudgetSpent(f"--time-budget spent before its first workload; not run: "
                          f"{', '.join(not_run)}")
    report["settings"]["workloads"] = [w.name for w in chosen]
    report["not_run"] = not_run
    log(render.text_report(report))
    if not_run:
        log(f"not run (--time-budget): {', '.join(not_run)}")
    return report


# -- fit: speed of a training step --------------------------------------------------------------


def build_fit_models(setup, device, jit_compile):
    """One compiled, warmed-up model per optimizer of `FIT_OPTIMIZERS`, on `device`."""
    dataset = synthetic_dataset(setup)
    with device_scope(device), mixed_float16():
        # All models first: building one sets the global seed, which makes
        # TensorFlow retrace (XLA: recompile) the train functions already traced.
        models = {name: build_model(setup, name, jit_compile) for name in FIT_OPTIMIZERS}
        for model in models.values():
            fit_steps(model, dataset, setup.warmup_steps)
    return models, dataset


def fit_part(setup, device, jit_compile, models, dataset):
    """Times `fit` per optimizer: the median of interleaved calls, in ms per step.

    Also records, per optimizer, the final loss, the loss scale and how many
    of the timed steps were applied (a loss-scale optimizer skips overflowing
    steps).
    """
    samples = {name: [] for name in models}
    applied = {name: 0 for name in models}
    losses = {}
    names = list(models)
    with device_scope(device), mixed_float16():
        for r in range(setup.repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                model = models[name]
                before = int(model.optimizer.iterations.numpy())
                start = time.perf_counter()
                losses[name] = fit_steps(model, dataset, setup.steps)
                samples[name].append(1000.0 * (time.perf_counter() - start) / setup.steps)
                applied[name] += int(model.optimizer.iterations.numpy()) - before
    return {
        "model": setup.describe(),
        "batch_size": setup.batch_size,
        "steps": setup.steps,
        "repeats": setup.repeats,
        "jit_compile": jit_compile,
        "device": device,
        "optimizers": {
            name: {
                "ms_per_step": float(np.median(samples[name])),
                "samples_ms": samples[name],
                "final_loss": losses[name],
                "loss_scale": loss_scale_of(models[name].optimizer),
                "applied_steps": applied[name],
                "timed_steps": setup.steps * setup.repeats,
            }
            for name in names
        },
    }


# -- device_to_host: copies per step from a profiler trace ---------------------------------------


def profile_fit(model, dataset, steps, logdir):
    """Runs `fit_steps` under the TensorFlow profiler; returns `profile_trace.count_events`."""
    tf.profiler.experimental.start(logdir)
    try:
        fit_steps(model, dataset, steps)
    finally:
        tf.profiler.experimental.stop()
    return profile_trace.count_events(profile_trace.find_trace(logdir))


def device_to_host_part(setup, device, models, dataset, logdir, on_gpu):
    """Device-to-host copies per steady-state `fit` step, per optimizer.

    Two profiled `fit` calls of `setup.profile_steps` = (short, long) steps on
    the warm models; the difference of their copy counts divided by
    ``long - short`` cancels what every `fit` call copies once (its logs).
    """
    short, long_ = setup.profile_steps
    results = {}
    with device_scope(device), mixed_float16():
        for name, model in models.items():
            runs = [profile_fit(model, dataset, steps, os.path.join(logdir, f"{name}-{steps}"))
                    for steps in (short, long_)]
            per_step = (runs[1]["device_to_host"] - runs[0]["device_to_host"]) / (long_ - short)
            gpu_planes = [p for p in runs[1]["planes"] if p.startswith("/device:GPU")]
            results[name] = {
                # Without a GPU plane (no GPU, or CUPTI missing) the count says nothing.
                "dtoh_per_step": per_step if gpu_planes or not on_gpu else None,
                "dtoh_short": runs[0]["device_to_host"],
                "dtoh_long": runs[1]["device_to_host"],
                "host_dtoh_calls_per_step": (runs[1]["host_device_to_host_calls"]
                                             - runs[0]["host_device_to_host_calls"])
                / (long_ - short),
                "host_events_long": runs[1]["host_events"],
                "device_events_long": runs[1]["device_events"],
                "planes": runs[1]["planes"],
                "memcpy_names_long": runs[1]["memcpy_names"],
            }
    return {"profile_steps": [short, long_], "device": device, "optimizers": results}


# -- mirrored: MirroredStrategy over two logical devices ----------------------------------------


def mirrored_fit(strategy, optimizer_name, setup, jit_compile):
    """Two `fit` epochs under `strategy` and mixed_float16; never raises.

    Returns:
        A dict: ok (fit finished with a finite loss), losses, loss_scale,
        applied_steps; or ok False with error_type and error.
    """
    try:
        with mixed_float16():
            with strategy.scope():
                model = build_model(setup, optimizer_name, jit_compile)
            history = model.fit(synthetic_dataset(setup), epochs=2, shuffle=False,
                                steps_per_epoch=setup.mirrored_steps, verbose=0)
            losses = [float(x) for x in history.history["loss"]]
            return {
                "ok": bool(np.all(np.isfinite(losses))),
                "losses": losses,
                "loss_scale": loss_scale_of(model.optimizer),
                "applied_steps": int(model.optimizer.iterations.numpy()),
            }
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return {"ok": False, "error_type": type(e).__name__, "error": str(e)[:1000]}


def mirrored_runs(devices, setup, jit_compile, optimizers, out_path=None):
    """`mirrored_fit` for each optimizer over `devices`.

    The gradients are all-reduced by copying them to one device: NCCL, which
    MirroredStrategy would pick for GPUs, cannot run two ranks on one
    physical GPU.

    Args:
        devices: logical device names (two).
        setup: the `FitSetup`.
        jit_compile: passed to `compile`.
        optimizers: names from `FIT_OPTIMIZERS`, in the order to run them.
        out_path: if given, the result is rewritten there after every run, so
            that a hard crash of a later run keeps the earlier ones.
    """
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    result = {"devices": list(devices), "jit_compile": jit_compile,
              "cross_device_ops": "ReductionToOneDevice", "runs": {}}
    for name in optimizers:
        result["runs"][name] = mirrored_fit(strategy, name, setup, jit_compile)
        if out_path:
            write_json(out_path, result)
    return result


def _text(output):
    """Captured output as text (TimeoutExpired carries bytes even with text=True)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def mirrored_part(on_gpu, timeout_s, log=print):
    """Runs `mirrored_runs` in a fresh process whose first device is split in two.

    Logical devices can only be configured before TensorFlow initializes, which
    this process has long done. On GPUs jit_compile=True; on logical CPUs
    False (XLA with MirroredStrategy there is a known TensorFlow limitation).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "mirrored.json")
        command = [sys.executable, os.path.abspath(__file__), "--mirrored-child", out_path]
        if not on_gpu:
            command.append("--force-cpu")
        log("starting " + " ".join(command[1:]))
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            returncode, output = "timeout", _text(e.stdout) + _text(e.stderr)
        result = {}
        if os.path.exists(out_path):
            with open(out_path) as f:
                result = json.load(f)
    result["returncode"] = returncode
    if returncode != 0:
        result["output_tail"] = output[-3000:]
    return result


def mirrored_child(out_path, on_gpu):
    """The child process of `mirrored_part`: split the device, then run."""
    kind = "GPU" if on_gpu else "CPU"
    devices = split_device(kind, 2, GPU_LOGICAL_MEMORY_MB if on_gpu else None)
    setup = GPU_FIT if on_gpu else CPU_FIT
    # tfdls first, then the bare baseline, then Keras' own (known to fail:
    # keras-team/keras#21366) so that its failure cannot hide the others.
    return mirrored_runs(devices, setup, jit_compile=on_gpu,
                         optimizers=("tfdls", "bare", "keras3"), out_path=out_path)


# -- main ---------------------------------------------------------------------------------------


def write_json(path, data):
    """Writes `data` to `path` atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def summary(report):
    """A few lines per part for the terminal."""
    lines = ["", "== gpu_check summary =="]
    for part in PARTS:
        status = report["status"].get(part, "not run")
        lines.append(f"{part:<15} {status}")
    overhead = report.get("overhead") or {}
    if overhead.get("results"):
        lines += ["", f"optimizer step on {overhead['settings']['device']}, float16 gradients: "
                  "ratio to bare (median of rounds)"]
        for r in overhead["results"]:
            ratios = ", ".join(f"{name} {v['ratio']:.2f}x" for name, v in r["variants"].items()
                               if name != "bare")
            lines.append(f"  {r['workload']:<24} bare {r['variants']['bare']['ms']:.2f} ms; "
                         + ratios)
    tables = render.gpu_check_markdown(report)
    if tables:
        lines += ["", tables]
    for fit in render.fit_reports(report):
        lines += ["", render.fit_markdown(fit)]
    mirrored = report.get("mirrored") or {}
    for name, run in (mirrored.get("runs") or {}).items():
        if not run.get("ok"):
            lines.append(f"mirrored {name}: {run.get('error_type')}: "
                         f"{str(run.get('error', ''))[:200]}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON (after "
                        "every part, so a run cut short keeps what it measured)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a GPU, run the same code on /CPU:0 with tiny sizes")
    parser.add_argument("--force-cpu", action="store_true",
                        help="take the --allow-cpu path even where a GPU is visible (tests)")
    parser.add_argument("--quick", action="store_true",
                        help="bench_overhead --quick settings and fewer fit repeats")
    parser.add_argument("--workloads", default="",
                        help="filter of bench_overhead's default workloads (default: all ten)")
    parser.add_argument("--skip", default="",
                        help="comma-separated parts to skip: " + ",".join(PARTS))
    parser.add_argument("--mirrored-timeout", type=float, default=240.0,
                        help="seconds for the MirroredStrategy subprocess (default 240)")
    parser.add_argument("--time-budget", type=float, default=420.0,
                        help="seconds from start after which the overhead part starts no "
                        "further workload (default 420)")
    parser.add_argument("--profile-dir", default=None,
                        help="where profiler traces go (default: a temporary directory)")
    parser.add_argument("--mirrored-child", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.skip = {p.strip() for p in args.skip.split(",") if p.strip()}
    unknown = args.skip - set(PARTS)
    if unknown:
        parser.error(f"--skip: unknown parts {sorted(unknown)}; parts: {', '.join(PARTS)}")
    return args


def part_status(name, result, seconds):
    """"ok (12 s)", "FAILED: ..." or "ok, partial ..." for a part that returned."""
    if name == "mirrored":
        # The part is tfdls' check; the other optimizers' runs are context, and
        # one of them hanging until the timeout does not undo tfdls' result.
        if not result.get("runs", {}).get("tfdls", {}).get("ok"):
            return (f"FAILED: tfdls under MirroredStrategy (child exit status "
                    f"{result.get('returncode')})")
        if result.get("returncode") != 0:
            return f"ok ({seconds:.0f} s; child exit status {result['returncode']})"
    if name == "transformer_fit" and not result.get("step_plan_masked"):
        plan = result.get("step_plan", {})
        return f"FAILED: tfdls step_plan.skip is {plan.get('skip')!r} ({plan.get('reason')})"
    if result.get("not_run"):
        left_out = ", ".join(result["not_run"])
        return f"ok, partial ({seconds:.0f} s): --time-budget left out {left_out}"
    return f"ok ({seconds:.0f} s)"


def run_parts(args, report, on_gpu, log):
    """Runs every part not skipped; a failing part is recorded and the next one runs."""
    device = "/GPU:0" if on_gpu else "/CPU:0"
    setup = GPU_FIT if on_gpu else CPU_FIT
    if args.quick:
        setup = dataclasses.replace(setup, repeats=max(1, setup.repeats - 1))
    transformer = bench_fit.DEFAULT if on_gpu else bench_fit.TINY
    if args.quick:
        transformer = dataclasses.replace(transformer, epochs=min(3, transformer.epochs))
    fitted = {}

    def models():
        if not fitted:
            fitted["models"], fitted["dataset"] = build_fit_models(setup, device, True)
        return fitted["models"], fitted["dataset"]

    deadline = STARTED + args.time_budget
    with contextlib.ExitStack() as cleanup:
        profile_dir = args.profile_dir or cleanup.enter_context(
            tempfile.TemporaryDirectory(prefix="gpu_check_profile_"))
        _run_each(args, report, log, {
            "overhead": lambda: overhead_part(device, not on_gpu, args.quick, args.workloads,
                                              deadline, log),
            "fit": lambda: fit_part(setup, device, True, *models()),
            "device_to_host": lambda: device_to_host_part(setup, device, *models(),
                                                          profile_dir, on_gpu),
            "mirrored": lambda: mirrored_part(on_gpu, args.mirrored_timeout, log),
            # jit_compile "auto", Keras' default: XLA on a GPU, none on a CPU.
            "transformer_fit": lambda: bench_fit.run(transformer, "auto",
                                                     None if on_gpu else "/CPU:0", log=log),
        })


def _run_each(args, report, log, parts):
    """Runs `parts` (name -> callable) in `PARTS` order, recording each in `report`."""
    for name in PARTS:
        if name in args.skip:
            report["status"][name] = "skipped"
            continue
        log(f"-- {name} ...")
        start = time.perf_counter()
        try:
            report[name] = parts[name]()
            report["status"][name] = part_status(name, report[name], time.perf_counter() - start)
        except BudgetSpent as e:
            report[name] = {"skipped": str(e)}
            report["status"][name] = f"not run: {e}"
        except Exception as e:  # noqa: BLE001 - report it, go on with the next part
            report[name] = {"error_type": type(e).__name__, "error": str(e)[:1000],
                            "traceback": traceback.format_exc()[-3000:]}
            report["status"][name] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
        log(f"-- {name}: {report['status'][name]}")
        if args.json:
            write_json(args.json, report)


def main(argv=None):
    """The CLI; returns (report, exit status)."""
    args = parse_args(argv)
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    on_gpu = has_gpu and not args.force_cpu
    if args.mirrored_child:
        result = mirrored_child(args.mirrored_child, on_gpu)
        # The exit status is tfdls' alone; the others are context.
        return result, 0 if result["runs"]["tfdls"]["ok"] else 1

    def log(message):
        print(message, file=sys.stderr, flush=True)

    report = {"benchmark": "gpu_check", "environment": harness.environment(),
              "settings": {"gpu": on_gpu, "quick": args.quick, "workloads": args.workloads,
                           "skipped": sorted(args.skip)},
              "status": {}}
    if not on_gpu and not (args.allow_cpu or args.force_cpu):
        report["status"] = {p: "not run: no GPU visible" for p in PARTS}
        if args.json:
            write_json(args.json, report)
        print("no GPU visible to TensorFlow; --allow-cpu runs the same code on the CPU with "
              "tiny sizes", file=sys.stderr)
        return report, 2
    log(f"gpu_check on {'/GPU:0 ' + str(report['environment']['gpus']) if on_gpu else '/CPU:0'}")
    run_parts(args, report, on_gpu, log)
    print(summary(report))
    failed = any(not s.startswith(("ok", "skipped")) for s in report["status"].values())
    return report, 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main()[1])
