"""The first step of `fit` (trace, compile, one step), each variant in its own fresh process.

    python benchmarks/first_step.py                       # every fit case, keras3 and tfdls
    python benchmarks/first_step.py --cases mlp2x64-sgd-xla --repeats 5 --variants bare,keras3,tfdls
    python benchmarks/first_step.py --case mlp2x64-sgd-xla --variant tfdls   # one, as JSON

The fit family (`run.py --family fit`) times each variant's first step in one process, after
the variants before it traced and compiled theirs, so a variant's first step there also pays
for what the others left behind (memory, caches, a busier allocator). Here every measurement
is a new interpreter: TensorFlow imported, the case's model built and compiled
(`fit.build`, the fit family's), then the one timed call, `model.fit` of one step. Processes
alternate between variants (A B A B ...), so a machine's slow drift hits all of them alike.
Reported per variant: the median wall seconds over `--repeats` processes (and their
range), and the ratio of medians to the first variant's. TF_ENABLE_ONEDNN_OPTS=0 unless
set, as run.py for the fit family.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def measure(case_name, variant):
    """One first step, in this process: a JSON-ready dict."""
    import keras
    import numpy as np

    import cases
    import fit

    case = {c.name: c for c in cases.select("fit")}[case_name]
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = fit.build(case, variant)
    data = fit.dataset(case.params)
    start = time.perf_counter()
    history = model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
    seconds = time.perf_counter() - start
    loss = history.history["loss"][-1]
    if not np.isfinite(loss):  # (a first step may overflow and be skipped)
        raise RuntimeError(f"{case_name} {variant}: loss {loss}")
    return {"case": case_name, "variant": variant, "first_s": seconds,
            "jit_compile": str(model.jit_compile)}


def run_case(case_name, variants, repeats):
    """`repeats` fresh processes per variant, alternating: {variant: [seconds, ...]}."""
    times = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--case", case_name, "--variant",
                                  variant], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{case_name} {variant} failed:\n{out.stderr[-4000:]}")
            times[variant].append(json.loads(out.stdout.strip().splitlines()[-1])["first_s"])
    return times


def table(results, variants):
    """Markdown: per case, each variant's median [min-max] seconds and ratio to the first."""
    base = variants[0]
    head = " | ".join(f"{v}: s (range)" for v in variants)
    ratios = " | ".join(f"{v} / {base}" for v in variants[1:])
    rows = [f"| case | {head} | {ratios} |", "|---" * (1 + 2 * len(variants) - 1) + "|"]
    for case_name, times in results.items():
        median = {v: statistics.median(times[v]) for v in variants}
        cells = " | ".join(f"{median[v]:.2f} ({min(times[v]):.2f}-{max(times[v]):.2f})"
                           for v in variants)
        ratio = " | ".join(f"{median[v] / median[base]:.2f}" for v in variants[1:])
        rows.append(f"| {case_name} | {cells} | {ratio} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated substrings of fit case "
                        "names (default: all)")
    parser.add_argument("--variants", default="keras3,tfdls",
                        help="comma-separated; ratios are to the first (default keras3,tfdls)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per variant")
    parser.add_argument("--json", help="also write the seconds here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one measurement (a child process)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.case:
        print(json.dumps(measure(args.case, args.variant)))
        return
    import cases

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in cases.VARIANTS]
    if unknown or args.repeats < 1:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(cases.VARIANTS)}"
                     if unknown else f"--repeats must be >= 1; got {args.repeats}")
    results = {}
    for case in cases.select("fit", args.cases):
        print("running", case.name, file=sys.stderr, flush=True)
        results[case.name] = run_case(case.name, variants, args.repeats)
        print(json.dumps(results[case.name]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results, variants))


if __name__ == "__main__":
    main()
