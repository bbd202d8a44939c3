"""Smoke tests of benchmarks/: the case list, a quick run of each family's smallest case
(JSON and table), and that the timing loop refuses a variant that did not really run.

No timing assertions. benchmarks/test_gpu.py runs only on a GPU; here it is imported,
which checks its imports and its parametrization over the case list.
"""

import importlib
import json
import math
import pathlib
import sys
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
# The smallest quick case of each family.
SMALLEST = {"overhead": "20x64x64-sgd-graph", "boundaries": "rescnn1x4-i8-b4-xla",
            "fit": "mlp2x64-adam-graph", "allreduce": "mlp2x256-2workers-b8"}


def _import(name):
    # Lazily, so that deselected runs never load these modules.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_the_case_list_parses():
    cases = _import("cases")
    declared = list(cases.CASES) + [c.quick for c in cases.CASES if c.quick is not None]
    names = [c.name for c in cases.CASES]
    assert len(names) == len(set(names))
    for case in declared:
        assert case.family in cases.FAMILIES, case.name
        assert case.calls >= 1 and set(case.variants) <= set(cases.VARIANTS), case.name
    for family in cases.FAMILIES:
        assert SMALLEST[family] in [c.name for c in cases.select(family, quick=True)]
    # The fit cases the follow-up issue asks for.
    fit = [c.name for c in cases.select("fit")]
    assert {f"mlp{d}x64-{o}-{m}" for d in (2, 8, 24) for o in ("adam", "sgd")
            for m in ("graph", "xla")} <= set(fit)
    assert {"embedding100000x64-adam-graph", "transformer2x64-adam-auto",
            "mlp13x64-sigmoid-adam-xla-boundaries"} <= set(fit)
    assert "mlp4x4096-adam-xla" not in fit and "mlp4x4096-adam-xla" in [
        c.name for c in cases.select("fit", gpu=True)]
    assert [c.name for c in cases.select("overhead", "adam-xla")] == [
        "24x1024x1024-adam-xla", "200x64x64-adam-xla", "emb100000x64+8x512x512-adam-xla"]
    with pytest.raises(SystemExit, match="matches no fit case"):
        cases.select("fit", "no-such-case")
    # The baseline always runs, first: every ratio is taken against it.
    case = cases.select("boundaries")[0]
    assert cases.variants_of(case, ["boundaries_every1"]) == ["global", "boundaries_every1"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", sorted(SMALLEST))
def test_a_quick_run_of_the_smallest_case_runs_and_renders(family, tmp_path, capsys):
    cases, run, render = _import("cases"), _import("run"), _import("render")
    path = tmp_path / "report.json"
    report = run.main(["--family", family, "--quick", "--cases", SMALLEST[family],
                       "--rounds", "2", "--json", str(path)])
    printed = capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(report))
    (result,) = saved["results"]
    (case,) = cases.select(family, SMALLEST[family], quick=True)
    assert result["case"] == case.name and list(result["variants"]) == cases.variants_of(case)
    for name, v in result["variants"].items():
        assert len(v["samples_ms"]) == 2 and v["ms"] > 0 and v["first_s"] > 0, name
        assert math.isfinite(v["ratio"]) and v["ratio_p25"] <= v["ratio"] <= v["ratio_p75"]
    assert result["variants"][case.variants[0]]["ratio"] == pytest.approx(1.0)
    table = render.main([str(path)])
    assert table in printed and f"| {case.name} ({case.calls}) | " in table
    assert "| case (calls) | " + cases.VARIANTS[case.variants[0]].label in table
    variants = result["variants"]
    if family == "overhead":
        assert result["floor"]["floor_fused"] == pytest.approx(4 / 3)  # SGD: 3 passes + 1
        assert variants["check_only"]["ms"] > 0
    if family == "boundaries":  # after the stem and after the block's add
        assert [len(variants[n]["factors"]) for n in case.variants] == [0, 1, 2]
    if family == "allreduce":  # read from the traced steps: half the gradient bytes
        parameters = variants["tfdls"]["parameters"]
        assert variants["keras3"]["all_reduce_bytes_by_dtype"]["float32"] >= 4 * parameters
        assert variants["tfdls_f16"]["all_reduce_bytes_by_dtype"]["float16"] == 2 * parameters
        assert variants["tfdls_f16"]["all_reduce_bytes"] < 0.51 * variants["tfdls"][
            "all_reduce_bytes"]
        assert "float16/float32 bytes" in table
    if family == "fit":
        assert variants["bare"]["loss_scale"] is None  # really no loss scaling
        # A 2-layer MLP: without a GPU, jit_compile="auto" takes the uncompiled cond
        # (tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS); with one, the compiled masked step.
        from tfdls import _plan

        expected = "masked" if _plan.accelerator_visible() else "cond"
        assert variants["tfdls"]["step_plan"]["skip"] == expected
        assert "first step tfdls/Keras 3" in table


def _copies_apart(tmp_path, monkeypatch):
    """`versions` and `cases`, with copies of tfdls made under `tmp_path` and the variants
    and import path they add undone after the test."""
    versions, cases = _import("versions"), _import("cases")
    monkeypatch.setattr(versions, "CACHE", tmp_path)
    monkeypatch.setattr(cases, "VARIANTS", dict(cases.VARIANTS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return versions, cases


@pytest.mark.timeout(300)
def test_step_cost_times_tfdls_at_another_commit_beside_the_installed_one(
        tmp_path, capsys, monkeypatch):
    import re

    import keras

    import tfdls

    versions, cases = _copies_apart(tmp_path, monkeypatch)
    optimizers, step_cost = _import("optimizers"), _import("step_cost")
    with pytest.raises(ValueError, match="no commit 'no-such-revision'"):
        versions.copy_at("no-such-revision")
    root = versions.copy_at("HEAD")
    name = versions.package_name(versions.commit_of("HEAD"))
    assert root.name == name and root.is_relative_to(tmp_path)
    sources = sorted((root / name).rglob("*.py"))
    assert sources and not any(re.search(r"\btfdls\b", p.read_text()) for p in sources)
    made = [p.stat().st_mtime_ns for p in sources]
    assert versions.copy_at("HEAD") == root  # made once
    assert [p.stat().st_mtime_ns for p in sources] == made

    copy = versions.import_at("HEAD")
    assert copy.__name__ == name and copy.LossScaleOptimizer is not tfdls.LossScaleOptimizer
    inner = keras.optimizers.SGD(0.1)
    assert optimizers.is_tfdls(copy.LossScaleOptimizer(inner))
    assert not optimizers.is_tfdls(keras.optimizers.LossScaleOptimizer(inner))

    with pytest.raises(SystemExit):
        step_cost.main(["--at", "HEAD,HEAD"])
    assert "names a revision twice" in capsys.readouterr().err
    results = step_cost.main(["--cases", "mlp2x64-sgd-graph", "--rounds", "3", "--steps", "2",
                              "--at", "HEAD"])
    result = results["mlp2x64-sgd-graph"]
    # Each variant ran the package it names.
    assert result["tfdls"]["package"] == "tfdls" and result["tfdls@HEAD"]["package"] == name
    ratios = np.array(result["tfdls"]["samples_ms"]) / np.array(
        result["tfdls@HEAD"]["samples_ms"])
    assert result["tfdls_to"]["tfdls@HEAD"] == pytest.approx(np.median(ratios))
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("| tfdls@HEAD | tfdls / tfdls@HEAD |")
    (row,) = [line for line in lines if line.startswith("| mlp2x64-sgd-graph |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[5:] == [f"{result['tfdls@HEAD']['ratio']:.2f}x",
                         f"{result['tfdls_to']['tfdls@HEAD']:.2f}"]


@pytest.mark.timeout(300)
def test_run_times_tfdls_at_another_commit_beside_the_installed_one(
        tmp_path, capsys, monkeypatch):
    versions, cases = _copies_apart(tmp_path, monkeypatch)
    run, render = _import("run"), _import("render")
    for argv, message in ((["--family", "allreduce", "--at", "HEAD"],
                           "--at applies to the families overhead, fit, not to --family "
                           "allreduce"),
                          (["--family", "overhead", "--at", "HEAD,HEAD"],
                           "--at names a revision twice: 'HEAD,HEAD'"),
                          (["--family", "overhead", "--at", "no-such-revision"],
                           "--at no-such-revision: versions: no commit 'no-such-revision'"),
                          (["--family", "fit", "--variants", "keras3", "--at", "HEAD"],
                           "--variants keras3 leaves it out")):
        with pytest.raises(SystemExit):
            run.main(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"at=\['tfdls@HEAD'\]: .* family='boundaries'"):
        run.run_family("boundaries", cases.select("boundaries", quick=True), at=["tfdls@HEAD"])

    path = tmp_path / "report.json"
    case = SMALLEST["overhead"]
    with warnings.catch_warnings():
        # The overhead family applies without scale_loss, and the copy warns so
        # (UnscaledLossWarning) in a module that only this process can import: pytest-xdist's
        # controller could not rebuild the warning, and its worker would go down.
        warnings.simplefilter("ignore")
        report = run.main(["--family", "overhead", "--quick", "--cases", case, "--variants",
                           "keras3,tfdls", "--rounds", "3", "--at", "HEAD", "--json",
                           str(path)])
    (result,) = report["results"]
    name = versions.package_name(versions.commit_of("HEAD"))
    variants = result["variants"]
    assert list(variants) == ["bare", "keras3", "tfdls", "tfdls@HEAD"]
    # Each variant ran the package it names, and both copies of tfdls trained.
    assert variants["tfdls"]["package"] == "tfdls" and variants["tfdls@HEAD"]["package"] == name
    ratios = np.array(variants["tfdls"]["samples_ms"]) / np.array(
        variants["tfdls@HEAD"]["samples_ms"])
    assert result["tfdls_to"] == {"tfdls@HEAD": pytest.approx(np.median(ratios))}
    assert report["settings"]["at"] == {"tfdls@HEAD": name}
    table = render.main([str(path)])
    header, _, row = [line for line in table.splitlines() if line.startswith("|")][:3]
    assert header.endswith("| tfdls / tfdls at HEAD |")
    assert row.endswith(f"| {result['tfdls_to']['tfdls@HEAD']:.2f} |")
    # A case without the tfdls variant runs no copy beside it.
    (without,) = run.run_family("fit", cases.select("fit", SMALLEST["fit"], quick=True),
                                variants=["keras3"], rounds=1, at=["tfdls@HEAD"])["results"]
    assert list(without["variants"]) == ["bare", "keras3"] and "tfdls_to" not in without


@pytest.mark.timeout(300)
def test_a_variant_that_did_not_run_is_refused():
    import keras
    import tensorflow as tf

    import tfdls

    runs, timing, fit, cases = (_import(n) for n in ("runs", "timing", "fit", "cases"))
    grads = (tf.ones((2, 2)),)

    def variable():
        return keras.Variable(np.ones((2, 2), np.float32))

    w = variable()
    noop = runs.StepRun("noop", lambda g: None, grads, "graph", [w])
    with pytest.raises(RuntimeError, match="noop: variables did not change during warm-up"):
        timing.measure([noop], rounds=1, calls=1)

    # The check alone must answer True for the benchmark's finite gradients.
    poisoned = runs.StepRun("check", tfdls.all_finite, ([tf.constant([np.nan])],), "xla", [])
    with pytest.raises(RuntimeError, match="reported non-finite"):
        timing.measure([poisoned], rounds=1, calls=1)

    # Variables that change, but every step of the optimizer skipped.
    opt, w = tfdls.LossScaleOptimizer(keras.optimizers.SGD(0.1)), variable()

    def skips(g):
        w.assign_add(g)
        opt.apply([g * np.inf], [w])

    with pytest.raises(RuntimeError, match="a step was skipped during warm-up"):
        timing.measure([runs.StepRun("skips", skips, grads, "graph", [w], opt)], 1, 1)

    # A fit whose optimizer applies nothing.
    case = cases.select("fit", "mlp2x64-adam-graph", quick=True)[0]
    model = fit.models.build(case.params)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy")
    idle = runs.FitRun("idle", model, fit.dataset(case.params))
    with pytest.raises(RuntimeError, match="idle: variables did not change"):
        timing.measure([idle], rounds=1, calls=2)


def test_the_gpu_tests_import_and_skip_without_a_gpu():
    import tensorflow as tf

    test_gpu = _import("test_gpu")
    marks = {m.name: m for m in test_gpu.pytestmark}
    assert "gpu" in marks
    assert marks["skipif"].args[0] == (not tf.config.list_physical_devices("GPU"))
    assert test_gpu.GPU_MLP.gpu_only
