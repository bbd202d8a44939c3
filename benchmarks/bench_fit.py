"""Epoch time of `fit` under mixed_float16: a small Transformer text classifier, loss-scale
optimizers against no loss scaling.

    python benchmarks/bench_fit.py --json fit.json      # 4096 sequences of 128 tokens
    python benchmarks/bench_fit.py --tiny --quick       # smoke run
    python benchmarks/render.py fit.json

The timing statistics are harness.py's, the table render.py's; benchmarks/README.md
("bench_fit.py") explains what is timed.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, render

import harness  # noqa: E402
import numpy as np  # noqa: E402
import render  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import tfdls  # noqa: E402

OPTIMIZERS = ("bare", "keras3", "tfdls")  # "bare" first: every ratio is taken against it
LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class FitSetup:
    """The model, the synthetic data and how many epochs are run."""

    vocab: int = 20_000
    seq_len: int = 128
    dim: int = 64  # embedding and attention width
    heads: int = 4
    ffn: int = 128  # hidden width of each block's feed-forward part
    blocks: int = 2
    samples: int = 4096
    batch_size: int = 64
    epochs: int = 5  # timed epochs per optimizer, interleaved (median reported)
    warmup_epochs: int = 1  # untimed (the first traces and compiles)

    def describe(self):
        return (f"Transformer classifier: Embedding({self.vocab}, {self.dim}) + positions, "
                f"{self.blocks} x [MultiHeadAttention({self.heads} heads), FFN {self.ffn}, "
                f"LayerNormalization], mean pooling, Dense(2); Adam {LEARNING_RATE:g}")


DEFAULT = FitSetup()
TINY = FitSetup(vocab=200, seq_len=16, dim=16, ffn=32, samples=128, batch_size=32, epochs=2)


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (a positional embedding)."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="uniform")

    def call(self, x):
        return x + self.positions  # read in the compute dtype (Keras autocasts)


def build_model(setup, optimizer_name, jit_compile, seed=0):
    """The compiled classifier under the current dtype policy, same initial weights per seed.

    No loss scaling for "bare": under mixed_float16 `compile` wraps any optimizer
    that is not a `keras.optimizers.LossScaleOptimizer` in one, unless
    ``auto_scale_loss=False`` (keras/src/trainers/trainer.py, `compile`); the
    model still computes in float16. The loss-scale optimizers come wrapped
    already (tfdls' subclasses Keras'), so the flag changes nothing for them.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((setup.seq_len,), dtype="int32")
    x = keras.layers.Embedding(setup.vocab, setup.dim)(tokens)
    x = PositionEmbedding()(x)
    for _ in range(setup.blocks):
        attended = keras.layers.MultiHeadAttention(setup.heads, setup.dim // setup.heads)(x, x)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(keras.layers.Add()([x, attended]))
        hidden = keras.layers.Dense(setup.ffn, activation="relu")(x)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(
            keras.layers.Add()([x, keras.layers.Dense(setup.dim)(hidden)]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(2, dtype="float32")(x)  # float32 logits and loss
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    if optimizer_name == "keras3":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    elif optimizer_name == "tfdls":
        optimizer = tfdls.LossScaleOptimizer(optimizer)
    model = keras.Model(tokens, logits)
    model.compile(optimizer=optimizer, jit_compile=jit_compile, auto_scale_loss=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if optimizer_name == "bare" and isinstance(model.optimizer,
                                               keras.optimizers.LossScaleOptimizer):
        raise RuntimeError("bare: compile wrapped the optimizer in a LossScaleOptimizer")
    return model


def synthetic_dataset(setup, seed=0):
    """Random tokens; label: more than half of them in the lower half of the vocabulary."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, setup.vocab, (setup.samples, setup.seq_len)).astype("int32")
    y = ((x < setup.vocab // 2).sum(axis=1) > setup.seq_len // 2).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(setup.batch_size,
                                                              drop_remainder=True)
    return dataset.cache().prefetch(2)


def loss_scale_of(optimizer):
    """The current loss scale (None without loss scaling)."""
    if isinstance(optimizer, tfdls.LossScaleOptimizer):  # before Keras': it subclasses it
        return float(optimizer.loss_scale().numpy())
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(optimizer.dynamic_scale.numpy())
    return None


def run(setup=DEFAULT, jit_compile="auto", device=None, seed=0, log=None):
    """Builds one model per optimizer, warms each up, then times interleaved epochs.

    Args:
        setup: the `FitSetup`.
        jit_compile: passed to `compile` (the resolved value is recorded).
        device: a `tf.device` for everything, or None (Keras' placement).
        seed: for the initial weights and the data.
        log: optional ``log(message)``.

    Returns:
        A JSON-ready report (benchmark "bench_fit"). `step_plan_masked` is
        False if tfdls' step skips through a `tf.cond` instead of masked writes.
    """
    env = harness.environment()
    dataset = synthetic_dataset(setup, seed)
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with tf.device(device) if device else contextlib.nullcontext():
            # All models first: building one sets the global seed, which makes
            # TensorFlow retrace (XLA: recompile) the train functions already traced.
            models = {name: build_model(setup, name, jit_compile, seed) for name in OPTIMIZERS}
            for name, model in models.items():
                if log:
                    log(f"bench_fit: warming up {name} ...")
                model.fit(dataset, epochs=setup.warmup_epochs, verbose=0, shuffle=False)
            times = {name: [] for name in OPTIMIZERS}
            losses, applied = {}, {name: 0 for name in OPTIMIZERS}
            for r in range(setup.epochs):
                for name in OPTIMIZERS[r % 3:] + OPTIMIZERS[:r % 3]:
                    model = models[name]
                    before = int(model.optimizer.iterations.numpy())
                    start = time.perf_counter()
                    history = model.fit(dataset, epochs=1, verbose=0, shuffle=False)
                    times[name].append(time.perf_counter() - start)
                    losses[name] = float(history.history["loss"][-1])
                    applied[name] += int(model.optimizer.iterations.numpy()) - before
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    steps = setup.samples // setup.batch_size
    summary = harness.summarize(times)
    results = {}
    for name, model in models.items():
        if not (np.isfinite(losses[name]) and applied[name] > 0):
            raise RuntimeError(f"{name}: loss {losses[name]}, {applied[name]} steps applied")
        results[name] = dict(summary[name], final_loss=losses[name], applied_steps=applied[name],
                             timed_steps=steps * setup.epochs,
                             loss_scale=loss_scale_of(model.optimizer))
    plan = models["tfdls"].optimizer.step_plan
    return {
        "benchmark": "bench_fit",
        "environment": env,
        "settings": dict(dataclasses.asdict(setup), model=setup.describe(),
                         steps_per_epoch=steps, policy="mixed_float16", device=device,
                         jit_compile=models["tfdls"].jit_compile),
        "optimizers": results,  # ms: per epoch; ratio: per round, to bare
        "step_plan": {"skip": plan.skip, "check": plan.check, "compile": plan.compile,
                      "reason": plan.reason},
        "step_plan_masked": plan.skip == "masked",
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and data (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="3 timed epochs")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs (default 5)")
    parser.add_argument("--jit-compile", default="auto", choices=("auto", "true", "false"),
                        help="passed to compile (default auto: Keras' default)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    return parser.parse_args(argv)


def main(argv=None):
    """The CLI; returns the report. Exit status 1 if tfdls' step was not masked."""
    args = parse_args(argv)
    setup = TINY if args.tiny else DEFAULT
    epochs = args.epochs or (min(3, setup.epochs) if args.quick else setup.epochs)
    setup = dataclasses.replace(setup, epochs=epochs)
    jit_compile = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    report = run(setup, jit_compile, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(render.fit_markdown(report))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["step_plan_masked"] else 1)
