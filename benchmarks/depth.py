"""Scale boundaries at depth: the first `fit` (trace, compile, 2 steps) against the global scale.

    python benchmarks/depth.py                      # the whole table, one subprocess each
    python benchmarks/depth.py --model mlp100 --mode graph --scale boundaries   # one, as JSON

Models, under mixed_float16: `mlp100` and `mlp24`, 100 or 24 Dense(64, sigmoid) layers
(models.mlp), batch 32;
`resnet50`, keras.applications.ResNet50(weights=None, input_shape=(IMAGE, IMAGE, 3),
classes=10), batch 4. `boundaries`: `tfdls.add_scale_boundaries(model, every=1)` and
`scale_boundaries=` in the optimizer; `global`: the model as it is. SGD(1e-3);
`jit_compile=False` (graph) or True (whole-step XLA) in `model.compile`.

Reported per configuration (each in a fresh process, from right before `compile` to the end of
the first `fit`): process CPU seconds (user + sys), wall seconds, the process' peak resident
set size (`ru_maxrss`, imports and model included) and its growth over the fit (VmHWM after
less VmRSS before, from a reset of the peak). TF_ENABLE_ONEDNN_OPTS=0 unless set (as run.py
for the mixed_float16 families).
"""

import argparse
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

MODELS, MODES, SCALES = ("mlp24", "mlp100", "resnet50"), ("graph", "xla"), ("global", "boundaries")
IMAGE, STEPS = 64, 2


def _kib(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(model_name, mode, scale):
    """One configuration, in this process: a JSON-ready dict."""
    import keras
    import numpy as np

    import tfdls

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if model_name.startswith("mlp"):
        model, batch = models.mlp(int(model_name[3:]), 64, activation="sigmoid"), 32
        x = np.random.default_rng(0).standard_normal((STEPS * batch, 64)).astype("float32")
    else:
        model, batch = keras.applications.ResNet50(
            weights=None, input_shape=(IMAGE, IMAGE, 3), classes=10), 4
        x = np.random.default_rng(0).standard_normal((STEPS * batch, IMAGE, IMAGE, 3)).astype(
            "float32")
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    extra, placed = {}, 0
    if scale == "boundaries":
        model = tfdls.add_scale_boundaries(model, every=1)
        placed = sum(isinstance(layer, tfdls.ScaleBoundary) for layer in model.layers)
        extra = {"scale_boundaries": model}
    optimizer = tfdls.LossScaleOptimizer(keras.optimizers.SGD(1e-3), **extra)
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
    before_kib, cpu0, wall0 = _kib("VmRSS"), _cpu(), time.perf_counter()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=model_name.startswith("mlp"))
    model.compile(optimizer, loss, jit_compile=mode == "xla")
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    wall, cpu = time.perf_counter() - wall0, _cpu() - cpu0
    loss = history.history["loss"][-1]
    assert np.isfinite(loss), loss
    return {"model": model_name, "mode": mode, "scale": scale, "boundaries": placed,
            "layers": len(model.layers), "cpu_s": cpu, "wall_s": wall,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "growth_mb": (_kib("VmHWM") - before_kib) / 1024, "loss": float(loss)}


def run_once(model_name, mode, scale):
    """One fresh subprocess of one configuration: its JSON-ready dict."""
    out = subprocess.run([sys.executable, __file__, "--model", model_name, "--mode", mode,
                          "--scale", scale], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results):
    """Markdown: one row per model and mode, boundaries against global."""
    rows = ["| model, mode | boundaries placed | global: CPU s, wall s, peak MB (fit +MB) "
            "| boundaries: CPU s, wall s, peak MB (fit +MB) | ratio CPU | ratio wall "
            "| ratio peak | ratio fit growth |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for model_name, mode in itertools.product(MODELS, MODES):
        g = results.get((model_name, mode, "global"))
        b = results.get((model_name, mode, "boundaries"))
        if not (g and b):
            continue
        cell = lambda r: (f"{r['cpu_s']:.1f}, {r['wall_s']:.1f}, {r['peak_mb']:.0f} "
                          f"(+{r['growth_mb']:.0f})")
        rows.append(f"| {model_name}, {mode} | {b['boundaries']} | {cell(g)} | {cell(b)} "
                    f"| {b['cpu_s'] / g['cpu_s']:.2f} | {b['wall_s'] / g['wall_s']:.2f} "
                    f"| {b['peak_mb'] / g['peak_mb']:.2f} "
                    f"| {b['growth_mb'] / max(g['growth_mb'], 1):.2f} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--scale", choices=SCALES)
    parser.add_argument("--repeats", type=int, default=1,
                        help="table: rounds, each a process per configuration")
    parser.add_argument("--json", help="table: also write the results here")
    args = parser.parse_args()
    if args.model and args.mode and args.scale:
        print(json.dumps(measure(args.model, args.mode, args.scale)))
        return
    configs = list(itertools.product([args.model] if args.model else MODELS,
                                     [args.mode] if args.mode else MODES,
                                     [args.scale] if args.scale else SCALES))
    # Round by round, every configuration once, so that a slow spell of a shared host
    # falls on the global scale and the boundaries alike; per configuration, the
    # run with the least CPU time.
    results = {}
    for round_ in range(args.repeats):
        for config in configs:
            print("running", *config, f"(round {round_ + 1})", file=sys.stderr, flush=True)
            run = run_once(*config)
            print(json.dumps(run), file=sys.stderr, flush=True)
            if config not in results or run["cpu_s"] < results[config]["cpu_s"]:
                results[config] = run
    if args.json:
        with open(args.json, "w") as f:
            json.dump(list(results.values()), f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
