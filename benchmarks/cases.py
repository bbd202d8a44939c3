"""Every benchmark case and every variant, as declarations.

A case is a family (what is timed), its parameters and its variants, the
first of which is the baseline every ratio is taken against. A variant says
what wraps the case's inner optimizer. benchmarks/README.md explains each.
Pure Python: importing this needs neither TensorFlow nor tfdls.
"""

import dataclasses
import importlib.util

HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a variant runs.

    Attributes:
        label: its column title.
        wrapper: what wraps the inner optimizer: "none", "keras3", "tfdls";
            overhead only: "tf_keras_bare", "tf_keras" (tf_keras' own, on
            `tf.Variable`s), "xla_apply" (the bare apply compiled as tfdls
            compiles its own), "check" (`tfdls.all_finite` alone).
        options: keyword arguments of `tfdls.LossScaleOptimizer`.
        every: first `tfdls.add_scale_boundaries(model, every=every)`; None: the model as it is.
        boundary_options: keyword arguments of every `tfdls.ScaleBoundary`.
        available: False where an optional dependency is missing.
        package: the module that is tfdls for the variant: "tfdls", or a copy of it at
            another commit (`versions.variant_at`: ``--at`` of step_cost.py and run.py).
    """

    label: str
    wrapper: str
    options: tuple = ()
    every: object = None
    boundary_options: tuple = ()
    available: bool = True
    package: str = "tfdls"


_PINNED = (("min_log2_factor", 0), ("max_log2_factor", 0))  # factors that never move
VARIANTS = {
    "bare": Variant("bare", "none"),
    "keras3": Variant("Keras 3 LSO", "keras3"),
    "tf_keras_bare": Variant("tf_keras bare", "tf_keras_bare", available=HAS_TF_KERAS),
    "tf_keras": Variant("tf_keras LSO", "tf_keras", available=HAS_TF_KERAS),
    "bare_xla_apply": Variant("bare, XLA apply", "xla_apply"),
    "tfdls": Variant("tfdls LSO", "tfdls"),
    "tfdls_nojit": Variant("tfdls, jit_compile=False", "tfdls", (("jit_compile", False),)),
    "tfdls_noattr": Variant("tfdls, attribution off", "tfdls",
                            (("overflow_attribution", False),)),
    "tfdls_stats": Variant("tfdls, gradient stats", "tfdls", (("gradient_stats", True),)),
    "check_only": Variant("check alone", "check"),
    "tfdls_f16": Variant("tfdls, float16 all-reduce", "tfdls",
                         (("all_reduce_dtype", "float16"),)),
    "global": Variant("global scale", "tfdls"),
    "boundaries_every2": Variant("boundaries every 2", "tfdls", every=2),
    "boundaries_every1": Variant("boundaries every 1", "tfdls", every=1),
    "pinned_every2": Variant("pinned every 2", "tfdls", every=2, boundary_options=_PINNED),
    "pinned_every1": Variant("pinned every 1", "tfdls", every=1, boundary_options=_PINNED),
}

OVERHEAD = ("bare", "keras3", "tf_keras_bare", "tf_keras", "bare_xla_apply", "tfdls",
            "tfdls_nojit", "tfdls_noattr", "tfdls_stats", "check_only")
LOSS_SCALING = ("bare", "keras3", "tfdls")
BOUNDARIES = ("global", "boundaries_every2", "boundaries_every1")
ALL_REDUCE = ("keras3", "tfdls", "tfdls_f16")
FAMILIES = ("overhead", "boundaries", "fit", "allreduce")
# What --variants may add to a family's cases beyond those they declare.
OPTIONAL = {"overhead": (), "boundaries": ("pinned_every2", "pinned_every1", "bare"),
            "fit": ("tfdls_nojit", "tfdls_noattr", "tfdls_stats"), "allreduce": ()}


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes:
        family: "overhead" (`optimizer.apply` alone, overhead.py), "boundaries"
            (a whole training step, steps.py), "fit" (`model.fit`, fit.py) or
            "allreduce" (a training step under a `workers`-process
            MultiWorkerMirroredStrategy on localhost, allreduce.py).
        name: unique; what `--cases` matches.
        params: the family's parameters (the builder's keyword arguments).
        variants: variant names, the baseline first.
        calls: units per timed call: applies or steps (a fit call runs `calls` steps).
        quick: the smaller case a `--quick` run times instead; None: not in quick runs.
        gpu_only: selected only on a GPU (too slow for a CPU run).
    """

    family: str
    name: str
    params: dict = dataclasses.field(hash=False)
    variants: tuple
    calls: int
    quick: object = None
    gpu_only: bool = False


def _case(family, name, make, args, variants):
    """The `Case` `make(**args)` declares; its quick version is `make` with ``args["quick"]``."""
    quick = args.pop("quick")
    params = {k: v for k, v in args.items() if k not in ("calls", "variants", "gpu_only")}
    return Case(family, name, params, variants, args["calls"],
                None if quick is None else make(**{**args, **quick}),
                args.get("gpu_only", False))


def overhead(count, dim, inner, mode, calls=10, table=(), quick=None):
    """`count` dim x dim variables, after `table` = (rows, width, ids) if given: an
    embedding table whose gradient is a `tf.IndexedSlices` of `ids` rows."""
    args = dict(count=count, dim=dim, inner=inner, mode=mode, calls=calls, table=table,
                quick=quick)
    emb = f"emb{table[0]}x{table[1]}" + (f":{table[2]}" if table[2] != 2048 else "") + "+" \
        if table else ""
    return _case("overhead", f"{emb}{count}x{dim}x{dim}-{inner}-{mode}", overhead, args,
                 OVERHEAD)


def boundaries(model, depth, width, batch, mode, calls, activation="relu", image=32,
               quick=None):
    """A training step of an MLP (`depth` hidden layers) or a residual CNN (`depth` blocks)."""
    args = dict(model=model, depth=depth, width=width, batch=batch, mode=mode, calls=calls,
                activation=activation, image=image, quick=quick)
    detail = activation if model == "mlp" else f"i{image}"
    return _case("boundaries", f"{model}{depth}x{width}-{detail}-b{batch}-{mode}", boundaries,
                 args, BOUNDARIES)


def fit(model, inner, mode, calls, variants=LOSS_SCALING, quick=None, gpu_only=False,
        **sizes):
    """`fit` of a model kind ("mlp", "embedding", "transformer"); mode "graph"
    (jit_compile=False), "xla" (True) or "auto" (Keras' default)."""
    args = dict(model=model, inner=inner, mode=mode, calls=calls, variants=variants,
                quick=quick, gpu_only=gpu_only, **sizes)
    shape = {"mlp": ("depth", "width"), "embedding": ("rows", "width"),
             "transformer": ("blocks", "dim")}[model]
    name = f"{model}{sizes[shape[0]]}x{sizes[shape[1]]}"
    name += f"-{sizes['activation']}" if "activation" in sizes else ""
    name += f"-{inner}-{mode}" + ("-boundaries" if variants == BOUNDARIES else "")
    return _case("fit", name, fit, args, variants)


def allreduce(depth, width, features, classes, batch, calls, workers=2, quick=None, **_):
    """A training step of `mlp` (the GPU check's shape: 58.7M parameters) under a
    `workers`-process MultiWorkerMirroredStrategy; `batch` per worker."""
    args = dict(model="mlp", depth=depth, width=width, features=features, classes=classes,
                batch=batch, calls=calls, workers=workers, mode="graph", quick=quick)
    # (the model and mode are fixed: `**_` takes them back when the quick case is made)
    return _case("allreduce", f"mlp{depth}x{width}-{workers}workers-b{batch}", allreduce, args,
                 ALL_REDUCE)


TRANSFORMER = dict(vocab=20_000, seq_len=128, dim=64, heads=4, ffn=128, blocks=2, batch=64)
TINY_TRANSFORMER = dict(vocab=200, seq_len=16, dim=16, ffn=32, batch=32, calls=4)

CASES = (
    # overhead: the optimizer step alone, fixed gradients as arguments.
    overhead(200, 64, "sgd", "graph", calls=50, quick=dict(count=20, calls=10)),
    overhead(24, 1024, "sgd", "graph"),
    overhead(24, 1024, "adam", "graph"),
    overhead(24, 1024, "sgd", "xla"),
    overhead(24, 1024, "adam", "xla", quick=dict(count=4, calls=4)),
    overhead(200, 64, "adam", "xla", calls=50),
    # Embedding-heavy: a 100000x64 table, its gradient 2048 rows, then eight 512x512 kernels.
    *(overhead(8, 512, inner, mode, table=(100_000, 64, 2048),
               quick=dict(count=2, calls=4) if (inner, mode) == ("adam", "xla") else None)
      for mode in ("graph", "xla") for inner in ("sgdm", "adam")),
    # boundaries: a whole step (forward, backward, apply) under mixed_float16.
    # Deep and narrow, sigmoid, no normalization: the case per-layer scales are for.
    *(boundaries("mlp", 13, 64, 64, mode, calls=50, activation="sigmoid",
                 quick=dict(calls=10) if mode == "graph" else None) for mode in ("graph", "xla")),
    # Wide: the step is dominated by its matrix products.
    *(boundaries("mlp", 7, 512, 256, mode, calls=5) for mode in ("graph", "xla")),
    # Functional, residual: boundaries only after each block's add.
    *(boundaries("rescnn", 3, 16, 32, mode, calls=5,
                 quick=dict(depth=1, width=4, image=8, batch=4) if mode == "xla" else None)
      for mode in ("graph", "xla")),
    # fit: ms per step (a fit call of `calls` steps) and the first step (trace + compile).
    *(fit("mlp", inner, mode, calls=20, depth=depth, width=64, batch=64,
          quick=dict(calls=10) if (depth, inner) == (2, "adam") else None)
      for depth in (2, 8, 24) for inner in ("adam", "sgd") for mode in ("graph", "xla")),
    *(fit("embedding", "adam", mode, calls=20, rows=100_000, width=64, tokens=32, hidden=512,
          depth=8, batch=64, quick=dict(rows=2000, hidden=64, calls=5) if mode == "graph"
          else None) for mode in ("graph", "xla")),
    fit("transformer", "adam", "auto", calls=64, **TRANSFORMER, quick=TINY_TRANSFORMER),
    *(fit("mlp", "adam", mode, calls=20, variants=BOUNDARIES, depth=13, width=64, batch=64,
          activation="sigmoid",
          quick=dict(depth=5, width=16, calls=10) if mode == "graph" else None)
      for mode in ("graph", "xla")),
    # The GPU check's MLP: 1024 inputs, four 4096-unit layers, 1000 classes, batch 512.
    fit("mlp", "adam", "xla", calls=200, depth=4, width=4096, features=1024, classes=1000,
        batch=512, gpu_only=True),
    # allreduce: the same MLP's step, two worker processes over gRPC on 127.0.0.1.
    allreduce(4, 4096, 1024, 1000, batch=8, calls=3,
              quick=dict(depth=2, width=256, features=64, classes=10, calls=5)),
)


def select(family, filters="", quick=False, gpu=False):
    """The cases of `family` to run.

    Args:
        family: one of `FAMILIES`.
        filters: comma-separated substrings of case names (empty: all).
        quick: the quick versions of the cases that have one.
        gpu: include the cases meant for a GPU only.

    Returns:
        The cases, in declaration order.

    Raises:
        SystemExit: nothing matched (a CLI error).
    """
    chosen = [c for c in CASES if c.family == family and (gpu or not c.gpu_only)]
    if quick:
        chosen = [c.quick for c in chosen if c.quick is not None]
    tokens = [t.strip().lower() for t in filters.split(",") if t.strip()]
    if tokens:
        chosen = [c for c in chosen if any(t in c.name for t in tokens)]
    if not chosen:
        names = ", ".join(c.name for c in CASES if c.family == family)
        raise SystemExit(f"--cases {filters!r} matches no {family} case; cases: {names}")
    return chosen


def variants_of(case, names=None):
    """The variants of `case` to run: `names` (default: those it declares) that it declares
    or its family allows (`OPTIONAL`) and that are available here, the baseline first."""
    allowed = case.variants + OPTIONAL[case.family]
    chosen = [v for v in names or case.variants if v in allowed and VARIANTS[v].available]
    return list(dict.fromkeys([case.variants[0]] + chosen))
