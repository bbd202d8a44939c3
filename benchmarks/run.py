"""Runs the cases of one benchmark family and prints their markdown table.

    python benchmarks/run.py --family overhead --json overhead.json
    python benchmarks/run.py --family fit --quick
    python benchmarks/run.py --family boundaries --cases sigmoid --variants pinned_every1
    python benchmarks/run.py --family overhead --variants keras3,tfdls --at ab2b52d
    python benchmarks/render.py overhead.json

``--at REV`` (overhead and fit) times tfdls as it was at git revision REV beside the
installed one, in the same rounds (`versions.variant_at`), and adds tfdls' median
per-round ratio to it: a change measured against the code before it, in one process.

The cases and variants are declared in cases.py, timed by timing.py and
rendered by render.py; benchmarks/README.md explains each family.
"""

import argparse
import contextlib
import gc
import json
import os
import sys

import cases
import render

# TensorFlow and what needs it are imported once the family is known (see `main`).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROUNDS = {"overhead": 15, "boundaries": 15, "fit": 5, "allreduce": 5}
QUICK_ROUNDS = 3


@contextlib.contextmanager
def policy(name):
    """The global dtype policy `name` (None: as it is), restored on exit."""
    import keras

    previous = keras.mixed_precision.global_policy()
    if name:
        keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def placement(family, device):
    """Where a case runs: `tf.device(device)`, except `fit` on a GPU, which Keras places
    (a GPU scope would also pull the tf.data pipeline onto it)."""
    import tensorflow as tf

    if family == "fit" and "GPU" in device.upper():
        return contextlib.nullcontext()
    return tf.device(device)


# The families `--at` applies to: those whose cases run the "tfdls" variant in this process.
AT_FAMILIES = ("overhead", "fit")


def run_family(family, chosen, variants=None, rounds=None, warmup=1, device="/CPU:0",
               dtype="float32", log=None, at=()):
    """Times each case of `chosen` (cases of `family`) and returns the JSON-ready report.

    Args:
        family: one of `cases.FAMILIES`.
        chosen: the `cases.Case`s (`cases.select`).
        variants: variant names to run (default: each case's); its baseline always runs.
        rounds: timed rounds per case (default `ROUNDS[family]`).
        warmup: untimed calls per variant before timing.
        device: where the variables and steps live, e.g. "/CPU:0" or "/GPU:0".
        dtype: the gradients' dtype (overhead; variables are float32).
        log: optional ``log(message)`` for progress.
        at: names of variants declared by `versions.variant_at` (tfdls at other commits),
            run beside "tfdls" in each case that runs it (families `AT_FAMILIES`).

    Returns:
        {"benchmark": "tfdls", "family", "environment", "settings", "labels",
        "results": [{"case", "params", "calls", "variants": {name: `timing.measure`'s},
        "floor" (overhead), "tfdls_to" (with `at`: tfdls' median per-round ratio to
        each)}]}.
    """
    import allreduce
    import environment
    import fit
    import overhead
    import steps
    import timing
    import versions

    if at and family not in AT_FAMILIES:
        raise ValueError(f"at={list(at)!r}: only the families {AT_FAMILIES} time tfdls at "
                         f"another commit; got family={family!r}")
    rounds = rounds or ROUNDS[family]
    report = {"benchmark": "tfdls", "family": family, "environment": environment.environment(),
              "settings": {"device": device, "dtype": dtype, "rounds": rounds, "warmup": warmup,
                           "policy": None if family == "overhead" else "mixed_float16",
                           "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
                           # Each copy's package names its commit (tfdls_<commit>).
                           "at": {name: cases.VARIANTS[name].package for name in at}},
              "labels": {name: v.label for name, v in cases.VARIANTS.items()}, "results": []}
    for case in chosen:
        if log:
            log(f"{family}: running {case.name} ...")
        names = cases.variants_of(case, variants)
        beside = list(dict.fromkeys(at)) if "tfdls" in names else []
        names += beside
        if family == "allreduce":  # timed in worker processes, by the same loop
            stats = allreduce.measure_in_cluster(case, names, rounds, warmup, device, log=log)
        else:
            with policy(report["settings"]["policy"]), placement(family, device):
                if family == "overhead":
                    built = overhead.runs(case, names, dtype)
                else:
                    built = (steps if family == "boundaries" else fit).runs(case, names)
                stats = timing.measure(built, rounds, case.calls, warmup)
            del built
        result = {"case": case.name, "params": case.params, "calls": case.calls,
                  "variants": stats}
        if family == "overhead":
            result["floor"] = overhead.floor(case, dtype)
        if beside:
            result["tfdls_to"] = versions.tfdls_to(stats, beside)
        report["results"].append(result)
        gc.collect()  # the next case's variables should not share memory with these
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=cases.FAMILIES)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case "
                        "names (default: all of the family)")
    parser.add_argument("--variants", default="", help="comma-separated variant names "
                        f"({', '.join(cases.VARIANTS)}); each case's baseline always runs")
    parser.add_argument("--quick", action="store_true", help="the quick cases (smaller), "
                        f"{QUICK_ROUNDS} rounds")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timed rounds per case (default: {ROUNDS})")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls per variant after the first (default 1)")
    parser.add_argument("--device", default="/CPU:0", help="e.g. /CPU:0 or /GPU:0 (a GPU "
                        "adds the cases declared gpu_only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="the gradients' dtype in the overhead family")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--at", default="", help="comma-separated git revisions of tfdls to "
                        f"time beside the installed one ({', '.join(AT_FAMILIES)}; see "
                        "benchmarks/versions.py)")
    args = parser.parse_args(argv)
    import versions  # git only: refuses a bad revision before TensorFlow loads

    args.at = versions.revisions(parser, args.at)
    if args.at and args.family not in AT_FAMILIES:
        parser.error(f"--at applies to the families {', '.join(AT_FAMILIES)}, "
                     f"not to --family {args.family}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.at and args.variants and "tfdls" not in args.variants:
        parser.error(f"--at times tfdls at another commit beside the tfdls variant; "
                     f"--variants {','.join(args.variants)} leaves it out")
    unknown = sorted(set(args.variants) - set(cases.VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(cases.VARIANTS)}")
    if (args.rounds is not None and args.rounds < 1) or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    """The CLI; returns the report."""
    args = parse_args(argv)
    if args.family != "overhead" and "tensorflow" not in sys.modules:
        # oneDNN's graph-mode float16 kernels made a 2-layer MLP's fit step ten times as
        # slow on a CPU (a 24-layer one sixty times), hiding what is measured; =1 measures
        # with them. TensorFlow reads it once, when it loads.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    # Each variant's step is its own tf.function of the same code, which
    # TensorFlow reports as "retracing"; timing.measure checks the real thing.
    tf.get_logger().setLevel("ERROR")
    import versions

    at = [versions.variant_at(cases, rev) for rev in args.at]
    chosen = cases.select(args.family, args.cases, args.quick, gpu="GPU" in args.device.upper())
    report = run_family(args.family, chosen, args.variants,
                        args.rounds or (QUICK_ROUNDS if args.quick else None), args.warmup,
                        args.device, args.dtype, log=lambda m: print(m, file=sys.stderr,
                                                                      flush=True), at=at)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(render.markdown(report))
    return report


if __name__ == "__main__":
    main()
