"""Cost of scale boundaries per training step: `tfdls.add_scale_boundaries` against one global
loss scale, under mixed_float16.

    python benchmarks/bench_boundaries.py --json boundaries.json     # all workloads, 15 rounds
    python benchmarks/bench_boundaries.py --quick                    # smoke run
    python benchmarks/render.py boundaries.json                      # the markdown table

One full training step (forward, backward, `optimizer.apply`) inside a
`tf.function` ("graph") or a `tf.function(jit_compile=True)` ("xla"), per
variant on its own model (same initial weights) and its own optimizer; the
rounds interleave the variants. The timing, the no-retrace check and the
statistics are harness.py's; benchmarks/README.md ("bench_boundaries.py")
explains what is timed.
"""

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import pathlib
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, render

import harness  # noqa: E402
import numpy as np  # noqa: E402
import render  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import tfdls  # noqa: E402

BASELINE = "global"  # every ratio is taken against this variant's run of the same round
CLASSES = 10
LEARNING_RATE = 1e-3
TARGET = 1.10  # the goal: a step with boundaries within 10% of the global-scale step


# -- workloads ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, a batch and a mode.

    kind "mlp": `depth` Dense layers, the first `depth - 1` of `width` units
    with `activation`, the last one the `CLASSES` logits; inputs of `width`
    features. kind "rescnn": a functional residual CNN on `image` x `image` x 3
    inputs: a 3x3 convolution stem of `width` filters, `depth` residual blocks
    (conv-ReLU-conv, add, ReLU), global average pooling, the logits.
    """

    kind: str  # "mlp" or "rescnn"
    depth: int  # Dense layers (mlp) or residual blocks (rescnn)
    width: int  # units (mlp) or filters (rescnn)
    batch: int
    mode: str  # "graph" (tf.function) or "xla" (tf.function(jit_compile=True))
    activation: str = "relu"  # mlp only
    image: int = 32  # rescnn only
    calls: int = 10  # default back-to-back steps per variant per round

    @property
    def name(self):
        if self.kind == "mlp":
            return f"mlp{self.depth}x{self.width}-{self.activation}-b{self.batch}-{self.mode}"
        return f"rescnn{self.depth}x{self.width}-i{self.image}-b{self.batch}-{self.mode}"

    def describe(self):
        if self.kind == "mlp":
            return (f"{self.depth} Dense ({self.depth - 1} x {self.width} units {self.activation}"
                    f" + {CLASSES} logits), batch {self.batch}")
        return (f"residual CNN {self.image}x{self.image}x3: stem conv {self.width} + "
                f"{self.depth} blocks (2 convs 3x3, add), pooling, {CLASSES} logits; batch "
                f"{self.batch}")


def _both_modes(**fields):
    return tuple(Workload(mode=mode, **fields) for mode in ("graph", "xla"))


DEFAULT_WORKLOADS = (
    # Deep and narrow, sigmoid, no normalization: the case per-layer scales are for.
    *_both_modes(kind="mlp", depth=14, width=64, batch=64, activation="sigmoid", calls=50),
    # Wide: the step is dominated by its matrix products.
    *_both_modes(kind="mlp", depth=8, width=512, batch=256, activation="relu", calls=5),
    # Functional, with residual connections: boundaries only after each block's add.
    *_both_modes(kind="rescnn", depth=3, width=16, batch=32, image=32, calls=5),
)

_SPEC = re.compile(
    r"^(?:mlp(\d+)x(\d+)(?:-(relu|sigmoid|tanh))?|rescnn(\d+)x(\d+)(?:-i(\d+))?)"
    r"-b(\d+)-(graph|xla)$"
)


def parse_workload(spec, calls=10):
    """Parses ``mlp<depth>x<width>[-<activation>]-b<batch>-<mode>`` or
    ``rescnn<blocks>x<filters>[-i<image>]-b<batch>-<mode>``; None if `spec` is neither."""
    match = _SPEC.match(spec.strip().lower())
    if not match:
        return None
    depth, width, activation, blocks, filters, image, batch, mode = match.groups()
    if depth is not None:
        if int(depth) < 2:
            return None
        return Workload("mlp", int(depth), int(width), int(batch), mode,
                        activation=activation or "relu", calls=calls)
    return Workload("rescnn", int(blocks), int(filters), int(batch), mode,
                    image=int(image or 32), calls=calls)


def select_workloads(filters, defaults=DEFAULT_WORKLOADS):
    """Comma-separated tokens: substrings of the default names, or full specs (SystemExit if none)."""
    return harness.select_workloads(filters, defaults, parse=parse_workload)


def build_model(workload, seed=0):
    """The model under the current dtype policy; the same initial weights for the same seed."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    if workload.kind == "mlp":
        stack = [keras.Input((workload.width,))]
        stack += [layers.Dense(workload.width, activation=workload.activation, name=f"dense_{i}")
                  for i in range(workload.depth - 1)]
        stack.append(layers.Dense(CLASSES, name=f"dense_{workload.depth - 1}"))
        return keras.Sequential(stack, name=f"mlp{workload.depth}x{workload.width}")
    inputs = keras.Input((workload.image, workload.image, 3))
    x = layers.Conv2D(workload.width, 3, padding="same", activation="relu", name="stem")(inputs)
    for b in range(workload.depth):
        h = layers.Conv2D(workload.width, 3, padding="same", activation="relu",
                          name=f"block{b}_conv1")(x)
        h = layers.Conv2D(workload.width, 3, padding="same", name=f"block{b}_conv2")(h)
        x = layers.Activation("relu", name=f"block{b}_relu")(
            layers.Add(name=f"block{b}_add")([x, h]))
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    logits = layers.Dense(CLASSES, name="logits")(x)
    return keras.Model(inputs, logits, name=f"rescnn{workload.depth}x{workload.width}")


def make_batch(workload, seed=0):
    """A fixed random batch (float32 inputs, int32 labels), passed to the step as arguments."""
    rng = np.random.default_rng(seed)
    if workload.kind == "mlp":
        shape = (workload.batch, workload.width)
    else:
        shape = (workload.batch, workload.image, workload.image, 3)
    x = tf.constant(rng.standard_normal(shape).astype(np.float32))
    y = tf.constant(rng.integers(0, CLASSES, workload.batch).astype(np.int32))
    return x, y


# -- variants -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a variant's model and optimizer are made.

    Attributes:
        name, label: the key (command line, JSON) and the column title.
        every: None for the plain model, else `add_scale_boundaries(model, every=...)`.
        boundary_kwargs: passed to every `tfdls.ScaleBoundary`.
        loss_scaling: False for the plain Keras optimizer (no loss scale at all).
    """

    name: str
    label: str
    every: object = None
    boundary_kwargs: tuple = ()
    loss_scaling: bool = True
    default: bool = True


_PINNED = (("min_log2_factor", 0), ("max_log2_factor", 0))
VARIANTS = {v.name: v for v in (
    Variant("global", "global (ms)"),
    Variant("boundaries_every2", "boundaries every 2", every=2),
    Variant("boundaries_every1", "boundaries every 1", every=1),
    # For profiling (--variants): factors pinned at 1 (same graph, values
    # that never move), and the inner optimizer without any loss scaling.
    Variant("pinned_every2", "pinned every 2", every=2, boundary_kwargs=_PINNED, default=False),
    Variant("pinned_every1", "pinned every 1", every=1, boundary_kwargs=_PINNED, default=False),
    Variant("keras_adam", "Adam, no loss scaling", loss_scaling=False, default=False),
)}


def default_variants():
    return [n for n, v in VARIANTS.items() if v.default]


def resolve_variants(names=None):
    """The variants to run: `names` (default: the defaults), `BASELINE` always first."""
    names = list(names) if names else default_variants()
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    names = [BASELINE] + [n for n in names if n != BASELINE]
    return [VARIANTS[n] for n in dict.fromkeys(names)]


@dataclasses.dataclass
class Built:
    """A variant ready to time (the attributes harness.py's timing and checks read)."""

    name: str
    step: object  # tf.function(batch) -> loss
    variables: list  # the trainable variables, inputs first
    loss_scale: object  # () -> (current, initial); None without loss scaling
    model: object
    optimizer: object
    boundaries: int


def build_variant(variant, workload, seed=0):
    """The variant's model (fresh, `seed`'s weights), its optimizer and its train step."""
    model = build_model(workload, seed)
    if variant.every is not None:
        model = tfdls.add_scale_boundaries(model, every=variant.every,
                                           **dict(variant.boundary_kwargs))
    boundaries = sum(isinstance(layer, tfdls.ScaleBoundary) for layer in model.layers)
    inner = keras.optimizers.Adam(LEARNING_RATE)
    if variant.loss_scaling:
        optimizer = tfdls.LossScaleOptimizer(
            inner, scale_boundaries=model if variant.every is not None else None)
    else:
        optimizer = inner
    variables = list(model.trainable_variables)

    def train_step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, tf.cast(logits, tf.float32), from_logits=True))
            scaled = optimizer.scale_loss(loss) if variant.loss_scaling else loss
        grads = tape.gradient(scaled, variables)
        optimizer.apply(grads, variables)
        return loss

    loss_scale = None
    if variant.loss_scaling:
        def loss_scale():
            # Any skipped step fails harness.check_updated.
            skipped = int(optimizer.loss_scale.num_skipped_steps.numpy())
            current = float(optimizer.loss_scale().numpy()) if skipped == 0 else 0.0
            return current, float(optimizer.initial_scale)

    step = tf.function(train_step, jit_compile=workload.mode == "xla", reduce_retracing=True)
    return Built(variant.name, step, variables, loss_scale, model, optimizer, boundaries)


# -- the checks ---------------------------------------------------------------------


def check_trained(built, before, batch, when):
    """`harness.check_updated` (first and last variables changed and finite, no skipped
    step), every variable finite, and one more step's loss finite.

    Returns:
        (snapshot of all variables, that loss, how many variables changed).
    """
    harness.check_updated(built, [before[0], before[-1]], when)
    after = [np.array(tf.convert_to_tensor(v)) for v in built.variables]
    for v, a in zip(built.variables, after):
        if not np.all(np.isfinite(a)):
            raise RuntimeError(f"{built.name}: {v.path} became non-finite {when}")
    changed = sum(not np.array_equal(a, b) for a, b in zip(after, before))
    loss = float(built.step(batch).numpy())  # untimed
    if not np.isfinite(loss):
        raise RuntimeError(f"{built.name}: the loss is {loss} {when}")
    return [np.array(tf.convert_to_tensor(v)) for v in built.variables], loss, changed


def summarize(times):
    """harness.summarize's statistics, every ratio against `BASELINE`'s run of the same round."""
    stats = harness.summarize({harness.BASELINE: times[BASELINE], **times})
    del stats[harness.BASELINE]
    return stats


def optimizer_record(built):
    """What the variant's optimizer did: applied and skipped steps, scale, factors, plan."""
    opt = built.optimizer
    record = {"boundaries": built.boundaries,
              "iterations": int(opt.iterations.numpy())}
    if isinstance(opt, tfdls.LossScaleOptimizer):
        plan = opt.step_plan
        record.update(
            loss_scale=float(opt.loss_scale().numpy()),
            skipped_steps=int(opt.loss_scale.num_skipped_steps.numpy()),
            factors=opt.scale_boundary_factors(),
            step_plan={"skip": plan.skip, "compile": plan.compile, "division": plan.division},
        )
    return record


# -- running ------------------------------------------------------------------------


def run_workload(workload, variants=None, rounds=15, calls=None, warmup=3, seed=0,
                 device="/CPU:0"):
    """Times the variants on one workload, checking that each really trained.

    Returns:
        A JSON-ready dict: workload, description, mode, rounds, calls,
        variants (by name: harness' statistics, ratio to `BASELINE`, the
        losses, how many variables changed, the optimizer's record).
    """
    specs = resolve_variants(variants)
    calls = calls or workload.calls
    with tf.device(device):
        batch = make_batch(workload, seed)
        # Every model first: building one sets the global seed, which makes
        # TensorFlow retrace (XLA: recompile) the steps already traced.
        built = [build_variant(s, workload, seed) for s in specs]
        initial = [[np.array(tf.convert_to_tensor(v)) for v in b.variables] for b in built]
        for b, values in zip(built[1:], initial[1:]):
            if len(values) != len(initial[0]) or not all(
                    np.array_equal(x, y) for x, y in zip(values, initial[0])):
                raise RuntimeError(f"{b.name}: its initial weights differ from {BASELINE}'s")
        harness.warm_up(built, batch, warmup)  # checks the first and last variables
        records = {}
        for b, values in zip(built, initial):
            values, loss, _ = check_trained(b, values, batch, "during warm-up")
            records[b.name] = {"snapshot": values, "loss_after_warmup": loss}
        counts = harness.tracing_counts(built)
        times = harness.time_rounds(built, batch, rounds, calls)
        harness.check_no_retrace(built, counts)
        for b in built:
            r = records[b.name]
            _, r["final_loss"], r["changed"] = check_trained(b, r.pop("snapshot"), batch,
                                                             "during timing")
        stats = summarize(times)
        result = {
            "workload": workload.name,
            "description": workload.describe(),
            "mode": workload.mode,
            "rounds": rounds,
            "calls": calls,
            "variants": {
                b.name: dict(stats[b.name], loss_after_warmup=records[b.name]["loss_after_warmup"],
                             final_loss=records[b.name]["final_loss"],
                             variables=len(b.variables),
                             variables_changed=records[b.name]["changed"],
                             **optimizer_record(b))
                for b in built
            },
        }
    del built
    gc.collect()
    return result


def source_digest():
    """sha256 (first 12 hex digits) of the imported tfdls' .py files: which code was timed."""
    digest = hashlib.sha256()
    root = pathlib.Path(tfdls.__file__).parent
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def run(workloads, variants=None, rounds=15, calls=None, warmup=3, seed=0, device="/CPU:0",
        progress=None):
    """Times `workloads` under mixed_float16; returns the JSON-ready report."""
    env = harness.environment()
    env["tfdls_source_sha256"] = source_digest()
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    results = []
    try:
        for w in workloads:
            if progress:
                progress(f"running {w.name} ...")
            results.append(run_workload(w, variants, rounds, calls, warmup, seed, device))
    finally:
        keras.mixed_precision.set_global_policy(previous)
    names = [v.name for v in resolve_variants(variants)]
    return {
        "benchmark": "bench_boundaries",
        "environment": env,
        "settings": {"device": device, "policy": "mixed_float16", "rounds": rounds,
                     "warmup": warmup, "calls": calls, "seed": seed,
                     "optimizer": f"Adam {LEARNING_RATE:g}", "target": TARGET,
                     "workloads": [w.name for w in workloads], "variants": names},
        "labels": {n: VARIANTS[n].label for n in names},
        "results": results,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="",
                        help="comma-separated name substrings or full specs such as "
                        "mlp6x32-sigmoid-b16-graph or rescnn1x8-i16-b8-xla (default: all)")
    parser.add_argument("--variants", default="",
                        help=f"comma-separated subset of {','.join(VARIANTS)} ({BASELINE} "
                        f"always runs; default: {','.join(default_variants())})")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per workload (default 15; --quick: 3)")
    parser.add_argument("--calls", type=int, default=None,
                        help="steps per variant per round (default: per workload)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per variant before timing (default 3)")
    parser.add_argument("--device", default="/CPU:0", help="e.g. /CPU:0 or /GPU:0")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 rounds, a fifth of the calls, 2 warm-up steps")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] or None
    unknown = sorted(set(args.variants or ()) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if any(n is not None and n < 1 for n in (args.rounds, args.calls)):
        parser.error("--rounds and --calls must be >= 1")
    return args


def main(argv=None):
    """The CLI; returns the report."""
    args = parse_args(argv)
    # Each variant's step is its own tf.function of the same code, which
    # TensorFlow reports as "retracing"; harness.check_no_retrace checks the real thing.
    tf.get_logger().setLevel("ERROR")
    workloads = select_workloads(args.workloads)
    rounds = args.rounds or (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if args.quick and args.calls is None:
        workloads = [dataclasses.replace(w, calls=max(2, w.calls // 5)) for w in workloads]
    env = harness.environment()
    print(f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, tfdls {env['tfdls']}; "
          f"{env['machine']}", file=sys.stderr)
    report = run(workloads, args.variants, rounds, args.calls, warmup, device=args.device,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(render.boundaries_markdown(report))
    return report


if __name__ == "__main__":
    main()
