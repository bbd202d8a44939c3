"""Step overhead of loss-scale optimizers, relative to the bare inner optimizer.

The workloads and variants below are declarations; the timing and checks are
in harness.py, the markdown table in render.py. benchmarks/README.md explains
what is timed, how, and the memory-pass floors.

    python benchmarks/bench_overhead.py --quick --json results.json
    python benchmarks/render.py results.json
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, render

import harness  # noqa: E402
import render  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

try:  # tf_keras is optional.
    import tf_keras  # noqa: E402
except ImportError:  # pragma: no cover - depends on the environment
    tf_keras = None

import tfdls  # noqa: E402

from harness import Step, Workload  # noqa: E402

DEFAULT_WORKLOADS = (
    Workload(200, (64, 64), "sgd", "graph", calls=50),
    Workload(24, (1024, 1024), "sgd", "graph", calls=10),
    Workload(24, (1024, 1024), "adam", "graph", calls=10),
    Workload(24, (1024, 1024), "sgd", "xla", calls=10),
    Workload(24, (1024, 1024), "adam", "xla", calls=10),
    Workload(200, (64, 64), "adam", "xla", calls=50),
    # Embedding-heavy: a 100000x64 table whose gradient is a tf.IndexedSlices
    # of 2048 ids, then eight 512x512 kernels.
    Workload(8, (512, 512), "sgdm", "graph", calls=10, table=(100_000, 64, 2048)),
    Workload(8, (512, 512), "adam", "graph", calls=10, table=(100_000, 64, 2048)),
    Workload(8, (512, 512), "sgdm", "xla", calls=10, table=(100_000, 64, 2048)),
    Workload(8, (512, 512), "adam", "xla", calls=10, table=(100_000, 64, 2048)),
)

SGD_LEARNING_RATE = 0.01
SGD_MOMENTUM = 0.9  # inner kind "sgdm"
ADAM_LEARNING_RATE = 1e-3

VARIANTS = harness.Registry()
variant = VARIANTS.variant


# -- inner optimizers -------------------------------------------------------------


def keras_inner(kind):
    """A fresh Keras 3 optimizer of `kind` ("sgd", "sgdm" or "adam")."""
    if kind in ("sgd", "sgdm"):
        return keras.optimizers.SGD(learning_rate=SGD_LEARNING_RATE,
                                    momentum=SGD_MOMENTUM if kind == "sgdm" else 0.0)
    return keras.optimizers.Adam(learning_rate=ADAM_LEARNING_RATE)


def tf_keras_inner(kind):
    """A fresh tf_keras optimizer of `kind`.

    Built with jit_compile=False so that the outer tf.function alone decides
    whether XLA is used (tf_keras would otherwise compile each variable's
    update on GPUs, also in "graph" mode).
    """
    if kind in ("sgd", "sgdm"):
        return tf_keras.optimizers.SGD(learning_rate=SGD_LEARNING_RATE, jit_compile=False,
                                       momentum=SGD_MOMENTUM if kind == "sgdm" else 0.0)
    return tf_keras.optimizers.Adam(learning_rate=ADAM_LEARNING_RATE, jit_compile=False)


def to_float32(grads):
    """tf_keras' optimizers, unlike Keras 3's, do not cast gradients to float32 variables."""
    return [g if g.dtype == tf.float32 else tf.cast(g, tf.float32) for g in grads]


def tfdls_step(workload, variables, **options):
    """A step of ``tfdls.LossScaleOptimizer(inner, **options)``, with its skip check.

    Args:
        workload: the `Workload` (its inner optimizer).
        variables: the variables to update.
        **options: keyword arguments of `tfdls.LossScaleOptimizer`.
    """
    opt = tfdls.LossScaleOptimizer(keras_inner(workload.inner), **options)

    def loss_scale():
        skipped = int(opt.loss_scale.num_skipped_steps.numpy())
        current = float(opt.loss_scale().numpy()) if skipped == 0 else 0.0
        return current, float(opt.initial_scale)

    return Step(lambda grads: opt.apply(grads, variables), loss_scale)


# -- variants (registration order = column order) --------------------------------


@variant("bare", "bare (ms)")
def bare(workload, variables):
    opt = keras_inner(workload.inner)
    return Step(lambda grads: opt.apply(grads, variables))


@variant("keras3", "Keras 3 LSO")
def keras3(workload, variables):
    opt = keras.optimizers.LossScaleOptimizer(keras_inner(workload.inner))
    return Step(lambda grads: opt.apply(grads, variables),
                lambda: (float(opt.dynamic_scale.numpy()), float(opt.initial_scale)))


@variant("tf_keras_bare", "tf_keras bare", variables="tf", available=tf_keras is not None)
def tf_keras_bare(workload, variables):
    opt = tf_keras_inner(workload.inner)
    return Step(lambda grads: opt.apply_gradients(zip(to_float32(grads), variables)))


@variant("tf_keras", "tf_keras LSO", variables="tf", available=tf_keras is not None)
def tf_keras_lso(workload, variables):
    opt = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras_inner(workload.inner))
    # What a real step does before differentiating; also silences tf_keras'
    # "you forgot to call get_scaled_loss()" warning.
    opt.get_scaled_loss(tf.constant(1.0))

    def body(grads):
        unscaled = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(to_float32(unscaled), variables))

    return Step(body, lambda: (float(opt.loss_scale.numpy()), float(opt.initial_scale)))


@variant("bare_xla_apply", "bare, XLA apply")
def bare_xla_apply(workload, variables):
    # Compiled the way tfdls compiles its apply in graph mode: a nested
    # XLA function (in "xla" mode this is the same as `bare`).
    opt = keras_inner(workload.inner)
    compiled_apply = tf.function(lambda grads: opt.apply(grads, variables), jit_compile=True)
    return Step(lambda grads: compiled_apply(grads))


@variant("tfdls", "tfdls LSO")
def tfdls_default(workload, variables):
    return tfdls_step(workload, variables)


@variant("tfdls_nojit", "tfdls, jit_compile=False")
def tfdls_nojit(workload, variables):
    return tfdls_step(workload, variables, jit_compile=False)


@variant("tfdls_noattr", "tfdls, attribution off")
def tfdls_noattr(workload, variables):
    return tfdls_step(workload, variables, overflow_attribution=False)


@variant("tfdls_stats", "tfdls, gradient stats")
def tfdls_stats(workload, variables):
    return tfdls_step(workload, variables, gradient_stats=True)


@variant("check_only", "check alone", variables="none")
def check_only(workload, variables):
    # Returns the answer: `harness.sync` requires it to be True.
    return Step(lambda grads: tfdls.all_finite(grads))


# -- running ------------------------------------------------------------------------


def available_variants():
    """Names of the variants that can run here."""
    return VARIANTS.available()


def select_workloads(filters):
    """`harness.select_workloads` over `DEFAULT_WORKLOADS`."""
    return harness.select_workloads(filters, DEFAULT_WORKLOADS)


def run(workloads, variants=None, rounds=15, calls=None, warmup=3, dtype="float32",
        device="/CPU:0", progress=None):
    """Times `workloads` and returns the JSON-ready report (see README: JSON).

    Args:
        workloads: the `harness.Workload`\\ s.
        variants: names to run (default: all available; "bare" always runs).
        rounds, calls, warmup, dtype, device: see `harness.run_workload`
            (calls=None: each workload's default).
        progress: optional ``progress(message)``.
    """
    env = harness.environment()  # the date the run started
    results = harness.run_benchmark(
        workloads, VARIANTS, progress=progress, variants=variants, rounds=rounds,
        calls=calls, warmup=warmup, dtype=dtype, device=device,
    )
    return {
        "benchmark": "bench_overhead",
        "environment": env,
        "settings": {"device": device, "dtype": dtype, "rounds": rounds, "warmup": warmup,
                     "calls": calls, "workloads": [w.name for w in workloads],
                     "variants": [s.name for s in VARIANTS.resolve(variants)]},
        "labels": VARIANTS.labels(),
        "results": results,
    }


def quick_settings(workloads, rounds=None, calls=None, warmup=None, quick=False):
    """Applies the --quick defaults: 3 rounds, 2 warm-up calls, a fifth of the calls.

    Returns:
        (workloads, rounds, warmup) with the defaults filled in.
    """
    rounds = rounds or (3 if quick else 15)
    warmup = warmup if warmup is not None else (2 if quick else 3)
    if quick and calls is None:
        workloads = [dataclasses.replace(w, calls=max(2, w.calls // 5)) for w in workloads]
    return workloads, rounds, warmup


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="",
                        help="comma-separated name substrings or full specs such as "
                        "4x8x8-sgd-graph (default: all defaults)")
    parser.add_argument("--variants", default="",
                        help="comma-separated subset of " + ",".join(available_variants())
                        + " (bare always runs; default: all available)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per workload (default 15; --quick: 3)")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per variant per round (default: per workload)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed calls per variant before timing (default 3)")
    parser.add_argument("--device", default="/CPU:0", help="e.g. /CPU:0 or /GPU:0")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="dtype of the gradients (variables are float32)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 rounds, fewer calls, 2 warm-up calls")
    parser.add_argument("--json", metavar="PATH",
                        help="write results, environment and settings as JSON")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the markdown table (as render.py does)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] or None
    unknown = sorted(set(args.variants or ()) - set(available_variants()))
    if unknown:
        parser.error(f"unknown or unavailable variants {unknown}; "
                     f"available: {available_variants()}")
    if (args.rounds is not None and args.rounds < 1) or (args.calls is not None
                                                         and args.calls < 1):
        parser.error("--rounds and --calls must be >= 1")
    return args


def main(argv=None):
    """The CLI; returns the report (see `run`)."""
    args = parse_args(argv)
    workloads, rounds, warmup = quick_settings(
        select_workloads(args.workloads), args.rounds, args.calls, args.warmup, args.quick
    )
    env = harness.environment()
    print(f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, tf_keras "
          f"{env['tf_keras'] or 'not installed'}, tfdls {env['tfdls']}; {env['machine']}",
          file=sys.stderr)
    report = run(workloads, args.variants, rounds, args.calls, warmup, args.dtype, args.device,
                 progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(render.text_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        print()
        print(render.markdown([report]))
    return report


if __name__ == "__main__":
    main()
