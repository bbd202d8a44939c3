"""The fixed cost of a training step: `fit`'s step function, many calls per round, in one process.

    python benchmarks/step_cost.py                               # the graph-mode MLP fit cases
    python benchmarks/step_cost.py --cases mlp2x64-sgd-graph --rounds 100 --steps 30
    python benchmarks/step_cost.py --cases mlp2x64-sgd --at HEAD~1   # before/after a change

The fit family (`run.py --family fit`) times `model.fit`, 20 steps per round, and its rows
move by tens of percent between runs on a small model, where a step is about a millisecond
and the loss-scale optimizer's part of it a tenth of that. Here each variant's model
(`fit.build`, the fit family's) runs its own `train_step` in a `tf.function` (the body of
`fit`'s step, without the dataset iterator and the callbacks) on one fixed batch,
`--steps` calls per round, timed by the one timing loop (`timing.measure`: variants
interleaved round by round, each checked to train): short rounds, so that the machine's
slow phases fall on all variants alike. Reported per case:
each variant's median ms per step over the rounds and the median of its per-round ratios
to bare Keras (no loss scaling), and tfdls' median per-round ratio to Keras 3's
`LossScaleOptimizer`. `--at REV` adds tfdls as it was at git revision REV
(`versions.import_at`) as one more variant, and tfdls' median per-round ratio to it: a
change measured against the code before it, in one process. TF_ENABLE_ONEDNN_OPTS=0
unless set, as run.py for the fit family.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

VARIANTS = ("bare", "keras3", "tfdls")


def step_run(case, variant):
    """Variant `variant`'s compiled model on fit `case`, its train step on one fixed batch as
    a `runs.StepRun` (checked as every timed step is: it trains)."""
    import tensorflow as tf

    import fit
    import models
    from runs import StepRun

    model = fit.build(case, variant)
    x, y = models.batch(case.params, 1)
    model.fit(x, y, batch_size=case.params["batch"], epochs=1, verbose=0)  # builds everything
    run = StepRun(variant, model.train_step, ((tf.constant(x), tf.constant(y)),),
                  "xla" if model.jit_compile is True else "graph",
                  model.trainable_variables, model.optimizer)
    run.skips_allowed = True  # a mixed_float16 start may overflow
    return run


def main(argv=None):
    """Prints the table; returns per case `timing.measure`'s result, with ``tfdls_to``: tfdls'
    median per-round ratio to Keras 3 and to each ``--at`` variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(
        f"mlp{depth}x64-{opt}-graph" for depth in (2, 8, 24) for opt in ("adam", "sgd")),
                        help="comma-separated substrings of fit case names")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=30, help="calls per round")
    parser.add_argument("--at", default="", help="comma-separated git revisions of tfdls to "
                        "time beside the installed one (see benchmarks/versions.py)")
    args = parser.parse_args(argv)
    import versions

    revisions = versions.revisions(parser, args.at)

    import keras

    import cases
    import timing
    keras.mixed_precision.set_global_policy("mixed_float16")
    earlier = [versions.variant_at(cases, rev) for rev in revisions]
    names = list(VARIANTS) + earlier
    print(f"{args.rounds} rounds of {args.steps} steps; ms per step (median), ratio to bare "
          "(median per round)\n")
    print("| case | bare ms | Keras 3 | tfdls | tfdls / Keras 3 |"
          + "".join(f" {name} | tfdls / {name} |" for name in earlier))
    print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(earlier))
    results = {}
    for case in cases.select("fit", args.cases):
        result = timing.measure([step_run(case, name) for name in names], args.rounds,
                                args.steps)
        # tfdls' median per-round ratio to each other variant but bare.
        result["tfdls_to"] = versions.tfdls_to(result, ["keras3"] + earlier)
        results[case.name] = result
        print(f"| {case.name} | {result['bare']['ms']:.3f} "
              f"| {result['keras3']['ratio']:.2f}x | {result['tfdls']['ratio']:.2f}x "
              f"| {result['tfdls_to']['keras3']:.2f} |"
              + "".join(f" {result[name]['ratio']:.2f}x | {result['tfdls_to'][name]:.2f} |"
                        for name in earlier), flush=True)
    return results


if __name__ == "__main__":
    main()
