"""The fixed cost of a training step: `fit`'s step function, many calls per round, in one process.

    python benchmarks/step_cost.py                               # the graph-mode MLP fit cases
    python benchmarks/step_cost.py --cases mlp2x64-sgd-graph --rounds 100 --steps 30

The fit family (`run.py --family fit`) times `model.fit`, 20 steps per round, and its rows
move by tens of percent between runs on a small model, where a step is about a millisecond
and the loss-scale optimizer's part of it a tenth of that. Here each variant's model
(`fit.build`, the fit family's) runs its own `train_step` in a `tf.function` (the body of
`fit`'s step, without the dataset iterator and the callbacks) on one fixed batch,
`--steps` calls per round, the variants interleaved round by round: short rounds, so
that the machine's slow phases fall on all variants alike. Reported per case:
each variant's median ms per step over the rounds and the median of its per-round ratios
to bare Keras (no loss scaling), and tfdls' median per-round ratio to Keras 3's
`LossScaleOptimizer`. TF_ENABLE_ONEDNN_OPTS=0 unless set, as run.py for the fit family.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

VARIANTS = ("bare", "keras3", "tfdls")


def step_function(case, variant):
    """The compiled model's train step on one fixed batch, warmed up: a zero-argument call."""
    import tensorflow as tf

    import fit
    import models

    model = fit.build(case, variant)
    x, y = models.batch(case.params, 1)
    data = (tf.constant(x), tf.constant(y))
    model.fit(x, y, batch_size=case.params["batch"], epochs=1, verbose=0)  # builds everything
    step = tf.function(model.train_step, jit_compile=model.jit_compile is True)
    for _ in range(20):
        step(data)
    return lambda: step(data)


def measure(case, rounds, steps):
    """{variant: per-round ms per step}, the variants interleaved round by round."""
    calls = {name: step_function(case, name) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(steps):
                out = call()
            float(out["loss"])  # the last step has run
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def ratio(times, name, baseline):
    return statistics.median(a / b for a, b in zip(times[name], times[baseline]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(
        f"mlp{depth}x64-{opt}-graph" for depth in (2, 8, 24) for opt in ("adam", "sgd")),
                        help="comma-separated substrings of fit case names")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=30, help="calls per round")
    args = parser.parse_args()

    import keras

    import cases

    keras.mixed_precision.set_global_policy("mixed_float16")
    print(f"{args.rounds} rounds of {args.steps} steps; ms per step (median), ratio to bare "
          "(median per round)\n")
    print("| case | bare ms | Keras 3 | tfdls | tfdls / Keras 3 |")
    print("|---|---:|---:|---:|---:|")
    for case in cases.select("fit", args.cases):
        times = measure(case, args.rounds, args.steps)
        print(f"| {case.name} | {statistics.median(times['bare']):.3f} "
              f"| {ratio(times, 'keras3', 'bare'):.2f}x | {ratio(times, 'tfdls', 'bare'):.2f}x "
              f"| {ratio(times, 'tfdls', 'keras3'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
