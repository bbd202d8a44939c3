"""Smoke tests of benchmarks/: the harness, the variant registry, JSON -> markdown, gpu_check,
bench_boundaries.

No timing assertions: only the structure of the results and that every variant
really ran (the harness itself raises if a variant's variables do not change,
a loss-scale optimizer skips a step or a step is retraced while timed).
gpu_check runs its --force-cpu path (tiny sizes on /CPU:0, even where a GPU is
visible).
"""

import importlib
import json
import math
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _import(name):
    # Imported lazily (not at collection) so that deselected runs never load
    # TensorFlow through these modules.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def harness():
    return _import("harness")


@pytest.fixture(scope="module")
def bench():
    return _import("bench_overhead")


@pytest.fixture(scope="module")
def boundaries_bench():
    return _import("bench_boundaries")


@pytest.fixture(scope="module")
def render():
    return _import("render")


@pytest.fixture(scope="module")
def gpu_check():
    return _import("gpu_check")


@pytest.fixture(scope="module")
def profile_trace():
    return _import("profile_trace")


def _assert_sane_stats(result, rounds):
    for name, stats in result["variants"].items():
        assert len(stats["samples_ms"]) == rounds, name
        assert all(t > 0 and math.isfinite(t) for t in stats["samples_ms"]), name
        assert stats["ms"] > 0, name
        assert stats["ratio"] > 0 and math.isfinite(stats["ratio"]), name
        assert stats["ratio_p25"] <= stats["ratio"] <= stats["ratio_p75"], name
    assert result["variants"]["bare"]["ratio"] == pytest.approx(1.0)


# -- harness and variants ----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_every_available_variant_runs_and_is_verified(harness, bench, render):
    workload = harness.parse_workload("2x8x8-sgd-graph")
    assert (workload.count, workload.shape, workload.inner, workload.mode) == (
        2, (8, 8), "sgd", "graph"
    )
    expected = bench.available_variants()
    assert expected[0] == "bare"
    assert {"keras3", "bare_xla_apply", "tfdls", "tfdls_nojit", "tfdls_noattr",
            "check_only"} <= set(expected)

    result = harness.run_workload(workload, bench.VARIANTS, rounds=2, calls=2, warmup=2)

    assert result["workload"] == "2x8x8-sgd-graph"
    assert list(result["variants"]) == expected
    _assert_sane_stats(result, rounds=2)
    floor = result["floor"]
    assert floor["grad_bytes"] == 2 * 8 * 8 * 4
    assert floor["floor_fused"] == pytest.approx(4 / 3)
    assert floor["floor_unfused"] == pytest.approx(2.0)
    text = render.text_table([result])
    assert "2x8x8-sgd-graph" in text and "floor fused" in text


@pytest.mark.timeout(300)
def test_embedding_workload_takes_sparse_gradients(harness, bench):
    import tensorflow as tf

    default = harness.parse_workload("emb100000x64+8x512x512-adam-xla")
    assert default.table == (100_000, 64, 2048) and default.inner == "adam"
    assert default in bench.DEFAULT_WORKLOADS
    workload = harness.parse_workload("emb300x8:16+2x8x8-sgdm-graph")
    assert workload.name == "emb300x8:16+2x8x8-sgdm-graph"
    assert (workload.count, workload.shape, workload.table) == (2, (8, 8), (300, 8, 16))
    initial, grads = harness.make_inputs(workload, "float32")
    assert [v.shape for v in initial] == [(300, 8), (8, 8), (8, 8)]
    assert isinstance(grads[0], tf.IndexedSlices) and grads[0].values.shape == (16, 8)

    # Every variant takes the IndexedSlices; the harness checks that the table
    # (the first variable) and the last kernel changed.
    result = harness.run_workload(workload, bench.VARIANTS, rounds=2, calls=1, warmup=2,
                                  dtype="float16")
    assert list(result["variants"]) == bench.available_variants()
    _assert_sane_stats(result, rounds=2)
    floor = result["floor"]
    assert floor["grad_bytes"] == (16 * 8 + 2 * 64) * 2
    assert floor["var_bytes"] == (300 * 8 + 2 * 64) * 4  # momentum: the whole table
    assert floor["bare_passes"] == 5


def test_registry_order_labels_and_errors(harness, bench):
    names = bench.available_variants()
    labels = bench.VARIANTS.labels()
    assert set(names) <= set(labels)
    assert labels["bare"] == "bare (ms)" and labels["tfdls"] == "tfdls LSO"
    if bench.tf_keras is None:
        assert "tf_keras" not in names and "tf_keras_bare" not in names
    # bare always runs, first: every ratio is taken against it.
    assert [s.name for s in bench.VARIANTS.resolve(["tfdls"])] == ["bare", "tfdls"]
    with pytest.raises(ValueError, match="unknown or unavailable"):
        bench.VARIANTS.resolve(["no_such_variant"])
    registry = harness.Registry()
    registry.variant("x", "X")(lambda workload, variables: None)
    with pytest.raises(ValueError, match="twice"):
        registry.variant("x", "X again")(lambda workload, variables: None)
    registry.variant("y", "Y", available=False)(lambda workload, variables: None)
    assert registry.available() == ["x"]


@pytest.mark.timeout(300)
def test_adding_a_variant_is_one_registration_and_the_harness_checks_it(harness, bench):
    import keras

    registry = harness.Registry()
    registry.variant("bare", "bare (ms)")(bench.bare)

    @registry.variant("sgd_again", "SGD again")
    def sgd_again(workload, variables):
        opt = keras.optimizers.SGD(0.1)
        return harness.Step(lambda grads: opt.apply(grads, variables))

    @registry.variant("does_nothing", "no-op")
    def does_nothing(workload, variables):
        return harness.Step(lambda grads: None)

    @registry.variant("skips", "skips a step")
    def skips(workload, variables):
        opt = keras.optimizers.SGD(0.1)
        return harness.Step(lambda grads: opt.apply(grads, variables), lambda: (1.0, 2.0))

    workload = harness.parse_workload("2x4x4-sgd-graph")
    result = harness.run_workload(workload, registry, ["sgd_again"], rounds=2, calls=1, warmup=1)
    assert list(result["variants"]) == ["bare", "sgd_again"]
    _assert_sane_stats(result, rounds=2)
    with pytest.raises(RuntimeError, match="did not change during warm-up"):
        harness.run_workload(workload, registry, ["does_nothing"], rounds=1, calls=1, warmup=1)
    with pytest.raises(RuntimeError, match="a step was skipped"):
        harness.run_workload(workload, registry, ["skips"], rounds=1, calls=1, warmup=1)


def test_workload_selection(bench):
    names = [w.name for w in bench.select_workloads("adam-xla")]
    assert names == ["24x1024x1024-adam-xla", "200x64x64-adam-xla",
                     "emb100000x64+8x512x512-adam-xla"]
    assert [w.name for w in bench.select_workloads("")] == [
        "200x64x64-sgd-graph", "24x1024x1024-sgd-graph", "24x1024x1024-adam-graph",
        "24x1024x1024-sgd-xla", "24x1024x1024-adam-xla", "200x64x64-adam-xla",
        "emb100000x64+8x512x512-sgdm-graph", "emb100000x64+8x512x512-adam-graph",
        "emb100000x64+8x512x512-sgdm-xla", "emb100000x64+8x512x512-adam-xla",
    ]
    assert [w.calls for w in bench.select_workloads("")] == [50, 10, 10, 10, 10, 50] + [10] * 4
    assert [w.name for w in bench.select_workloads("3x5-adam-graph")] == ["3x5-adam-graph"]
    assert [w.name for w in bench.select_workloads("sgd-xla,sgd-xla")] == [
        "24x1024x1024-sgd-xla"
    ]
    with pytest.raises(SystemExit):
        bench.select_workloads("no-such-workload")


@pytest.mark.timeout(300)
def test_check_only_refuses_a_false_answer(harness, bench):
    import numpy as np
    import tensorflow as tf

    workload = harness.parse_workload("3x4x4-sgd-xla")
    initial = [np.zeros((4, 4), np.float32)] * 3
    variant = harness.build_variant(bench.VARIANTS["check_only"], workload, initial)
    assert variant.variables == []
    finite = [tf.ones((4, 4))] * 3
    poisoned = finite[:2] + [tf.constant(np.full((4, 4), np.nan, np.float32))]

    out = variant.step(finite)
    assert bool(out.numpy()) is True
    harness.sync(variant, out)  # a True answer passes

    out = variant.step(poisoned)
    assert bool(out.numpy()) is False
    # A check that says "non-finite" for the benchmark's finite gradients
    # would be timing the wrong thing: the harness refuses it.
    with pytest.raises(RuntimeError, match="reported non-finite"):
        harness.sync(variant, out)


# -- JSON and rendering ----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_main_writes_json_that_render_turns_into_markdown(bench, render, tmp_path, capsys):
    path = tmp_path / "results.json"
    report = bench.main(
        ["--workloads", "2x8x8-adam-xla", "--variants", "keras3,tfdls", "--rounds", "2",
         "--calls", "1", "--warmup", "1", "--dtype", "float16", "--json", str(path)]
    )
    out = capsys.readouterr().out
    assert "2x8x8-adam-xla" in out and "memory-pass floors" in out

    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["benchmark"] == "bench_overhead"
    assert {"date", "machine", "tensorflow", "keras", "tfdls"} <= set(saved["environment"])
    assert saved["settings"]["dtype"] == "float16"
    assert saved["settings"]["variants"] == ["bare", "keras3", "tfdls"]
    (result,) = saved["results"]
    assert list(result["variants"]) == ["bare", "keras3", "tfdls"]
    # float16 gradients, float32 variables: Adam moves 2 + 6*4 bytes per
    # parameter, the check reads 2 more and an unfused unscale 4 more.
    assert result["floor"]["floor_fused"] == pytest.approx(28 / 26)
    assert result["floor"]["floor_unfused"] == pytest.approx(32 / 26)

    markdown = render.main([str(path)])
    lines = markdown.splitlines()
    assert lines[0].startswith("Date: ") and "TensorFlow" in lines[0] and "tfdls" in lines[0]
    assert ("| workload | bare (ms) | Keras 3 LSO | tfdls LSO | tfdls/Keras 3 overhead "
            "| floor fused | floor unfused |") in lines
    assert any(line.startswith("| 2x8x8-adam-xla (calls 1) | ") for line in lines)
    assert capsys.readouterr().out.strip() == markdown.strip()

    # Two result files of the same machine and settings make one table.
    merged = render.markdown([saved, saved]).splitlines()
    assert sum(line.startswith("| workload |") for line in merged) == 1
    assert sum(line.startswith("| 2x8x8-adam-xla") for line in merged) == 2


def test_render_cells_and_overhead_ratio(render):
    env = {"date": "2026-01-01T00:00", "machine": "test CPU", "gpus": [], "python": "3",
           "tensorflow": "2", "keras": "3", "tf_keras": None, "tfdls": "0"}

    def stats(ms, ratio):
        return {"ms": ms, "ratio": ratio, "ratio_p25": ratio, "ratio_p75": ratio,
                "samples_ms": [ms]}

    report = {
        "benchmark": "bench_overhead", "environment": env,
        "settings": {"device": "/CPU:0", "dtype": "float32", "rounds": 1},
        "labels": {"bare": "bare (ms)", "keras3": "Keras 3 LSO", "tfdls": "tfdls LSO"},
        "results": [{
            "workload": "1x2-sgd-graph", "calls": 3,
            "floor": {"floor_fused": 4 / 3, "floor_unfused": 2.0, "grad_bytes": 8,
                      "var_bytes": 8, "bare_passes": 3, "bare_bytes": 24},
            "variants": {"bare": stats(2.0, 1.0), "keras3": stats(3.0, 1.5),
                         "tfdls": stats(2.5, 1.25)},
        }],
    }
    lines = render.markdown([report]).splitlines()
    assert lines[0] == ("Date: 2026-01-01T00:00; machine: test CPU; Python 3; TensorFlow 2; "
                        "Keras 3; tfdls 0.")
    assert lines[-1] == ("| 1x2-sgd-graph (calls 3) | 2.00 | 3.00 (1.50x) | 2.50 (1.25x) "
                         "| 0.50 | 1.33x | 2.00x |")


# -- bench_boundaries ---------------------------------------------------------------------


def test_boundaries_workload_specs_and_variants(boundaries_bench):
    names = [w.name for w in boundaries_bench.select_workloads("")]
    assert names == ["mlp14x64-sigmoid-b64-graph", "mlp14x64-sigmoid-b64-xla",
                     "mlp8x512-relu-b256-graph", "mlp8x512-relu-b256-xla",
                     "rescnn3x16-i32-b32-graph", "rescnn3x16-i32-b32-xla"]
    assert [w.name for w in boundaries_bench.select_workloads("sigmoid")] == names[:2]
    w = boundaries_bench.parse_workload("mlp5x16-tanh-b8-xla")
    assert (w.kind, w.depth, w.width, w.activation, w.batch, w.mode) == (
        "mlp", 5, 16, "tanh", 8, "xla")
    w = boundaries_bench.parse_workload("rescnn2x8-b4-graph")
    assert (w.kind, w.depth, w.width, w.image, w.batch) == ("rescnn", 2, 8, 32, 4)
    assert boundaries_bench.parse_workload("24x1024x1024-adam-xla") is None
    with pytest.raises(SystemExit):
        boundaries_bench.select_workloads("no-such-workload")
    # global always runs, first: every ratio is taken against it.
    assert [v.name for v in boundaries_bench.resolve_variants(["boundaries_every1"])] == [
        "global", "boundaries_every1"]
    assert boundaries_bench.default_variants() == [
        "global", "boundaries_every2", "boundaries_every1"]
    with pytest.raises(ValueError, match="unknown variants"):
        boundaries_bench.resolve_variants(["no_such_variant"])


@pytest.mark.timeout(300)
def test_boundaries_bench_trains_every_variant_and_renders(boundaries_bench, render, tmp_path,
                                                           capsys):
    path = tmp_path / "boundaries.json"
    report = boundaries_bench.main(
        ["--workloads", "mlp5x8-sigmoid-b8-graph,rescnn1x4-i8-b4-xla", "--quick",
         "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert report["benchmark"] == "bench_boundaries"
    assert report["settings"]["rounds"] == 3 and report["settings"]["policy"] == "mixed_float16"
    assert report["environment"]["tfdls_source_sha256"]
    expected_boundaries = {
        # Sequential: after every 2nd / every Dense but the last (4 of 5 have none above).
        "mlp5x8-sigmoid-b8-graph": {"boundaries_every2": 2, "boundaries_every1": 4},
        # Functional: after the stem (every 1) and after the block's add.
        "rescnn1x4-i8-b4-xla": {"boundaries_every2": 1, "boundaries_every1": 2},
    }
    for result in report["results"]:
        _assert_sane_stats_against(result, "global", rounds=3)
        variants = result["variants"]
        assert list(variants) == ["global", "boundaries_every2", "boundaries_every1"]
        for name, v in variants.items():
            assert v["variables_changed"] == v["variables"], name  # every weight trained
            assert math.isfinite(v["final_loss"]), name
            assert v["skipped_steps"] == 0 and v["iterations"] > 3 * 2, name
            assert v["step_plan"]["skip"] == "masked", name
            assert v["boundaries"] == expected_boundaries[result["workload"]].get(name, 0)
            assert len(v["factors"]) == v["boundaries"], name
        # Same initial weights, and power-of-two scales are exact: the same first loss.
        losses = {v["loss_after_warmup"] for v in variants.values()}
        assert max(losses) - min(losses) < 1e-3, losses
    out = capsys.readouterr().out
    assert "| workload (calls) | global (ms) | boundaries every 2 | boundaries every 1 |" in out
    markdown = render.main([str(path)])
    assert "| mlp5x8-sigmoid-b8-graph (2) | " in markdown
    assert "| rescnn1x4-i8-b4-xla (2) | " in markdown and ", 2 b)" in markdown


@pytest.mark.timeout(300)
def test_boundaries_bench_refuses_a_variant_that_does_not_train(boundaries_bench):
    import keras
    import numpy as np
    import tensorflow as tf

    workload = boundaries_bench.parse_workload("mlp3x4-b4-graph")
    variant = boundaries_bench.VARIANTS["boundaries_every1"]
    built = boundaries_bench.build_variant(variant, workload)
    model, batch = built.model, boundaries_bench.make_batch(workload)

    def forward_only(batch):
        x, y = batch
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x), from_logits=True))

    built.step = tf.function(forward_only)
    before = [np.array(tf.convert_to_tensor(v)) for v in built.variables]
    built.step(batch)
    with pytest.raises(RuntimeError, match="did not change"):
        boundaries_bench.check_trained(built, before, batch, "during the test")


def _assert_sane_stats_against(result, baseline, rounds):
    for name, stats in result["variants"].items():
        assert len(stats["samples_ms"]) == rounds, name
        assert all(t > 0 and math.isfinite(t) for t in stats["samples_ms"]), name
        assert stats["ratio"] > 0 and math.isfinite(stats["ratio"]), name
        assert stats["ratio_p25"] <= stats["ratio"] <= stats["ratio_p75"], name
    assert result["variants"][baseline]["ratio"] == pytest.approx(1.0)


# -- gpu_check ----------------------------------------------------------------------------


def test_device_to_host_names(profile_trace):
    for name in ("MemcpyD2H", "memcpy DtoH", "Memcpy DtoH (Device -> Pinned)",
                 "cuMemcpyDtoHAsync_v2"):
        assert profile_trace.is_device_to_host(name), name
    for name in ("MemcpyH2D", "cuMemcpyHtoDAsync_v2", "MemcpyD2D", "fusion.12", ""):
        assert not profile_trace.is_device_to_host(name), name


@pytest.mark.timeout(300)
def test_trace_parser_reads_a_cpu_trace(profile_trace, tmp_path):
    import tensorflow as tf

    step = tf.function(lambda x: tf.reduce_sum(x * 2.0))
    x = tf.ones([16, 16])
    step(x)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        for _ in range(3):
            step(x).numpy()
    finally:
        tf.profiler.experimental.stop()

    path = profile_trace.find_trace(str(tmp_path))
    assert path.endswith(".xplane.pb")
    counts = profile_trace.count_events(path)
    assert any(p.startswith("/host:") for p in counts["planes"])
    assert counts["host_events"] > 0  # it really parsed the trace
    assert counts["device_to_host"] == 0  # nothing leaves a device on a CPU
    with pytest.raises(FileNotFoundError):
        profile_trace.find_trace(str(tmp_path / "empty"))


def test_gpu_check_without_gpu_stops_cleanly(gpu_check, tmp_path, capsys):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible")
    path = tmp_path / "none.json"
    report, status = gpu_check.main(["--json", str(path)])
    assert status == 2
    assert all(s.startswith("not run") for s in report["status"].values())
    assert json.loads(path.read_text())["status"] == report["status"]
    assert "--allow-cpu" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_gpu_check_cpu_run_end_to_end(gpu_check, render, tmp_path, capsys):
    path = tmp_path / "gpu_check.json"
    report, status = gpu_check.main(
        ["--force-cpu", "--quick", "--workloads", "200x64x64-sgd,sgdm-graph", "--json", str(path)]
    )
    assert status == 0, report["status"]
    assert all(report["status"][p].startswith("ok") for p in gpu_check.PARTS)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report, default=str))

    fit = report["fit"]
    assert fit["jit_compile"] is True
    assert list(fit["optimizers"]) == ["bare", "keras3", "tfdls"]
    for name, run in fit["optimizers"].items():
        assert run["ms_per_step"] > 0, name
        assert math.isfinite(run["final_loss"]), name
        assert 0 < run["applied_steps"] <= run["timed_steps"], name
    assert fit["optimizers"]["bare"]["loss_scale"] is None
    assert fit["optimizers"]["tfdls"]["loss_scale"] >= 1

    for name, run in report["device_to_host"]["optimizers"].items():
        assert run["dtoh_per_step"] == 0, name  # no GPU: nothing is copied to the host
        assert run["host_events_long"] > 0, name  # the trace was found and parsed

    mirrored = report["mirrored"]
    assert mirrored["returncode"] == 0
    assert mirrored["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert mirrored["jit_compile"] is False
    assert mirrored["runs"]["tfdls"]["ok"] is True
    assert mirrored["runs"]["tfdls"]["loss_scale"] >= 1

    overhead = report["overhead"]
    assert overhead["settings"]["dtype"] == "float16"
    # The embedding workloads run first; shrunk: a 2000x8 table, 32 ids.
    assert [r["workload"] for r in overhead["results"]] == ["emb2000x8:32+2x8x8-sgdm-graph",
                                                            "4x8x8-sgd-graph"]

    transformer = report["transformer_fit"]
    assert transformer["benchmark"] == "bench_fit" and transformer["settings"]["epochs"] == 2
    assert transformer["step_plan_masked"] is True
    assert list(transformer["optimizers"]) == ["bare", "keras3", "tfdls"]
    for name, run in transformer["optimizers"].items():
        assert run["ms"] > 0 and math.isfinite(run["final_loss"]), name
        assert 0 < run["applied_steps"] <= run["timed_steps"], name
    assert transformer["optimizers"]["bare"]["loss_scale"] is None  # really no loss scaling
    assert transformer["optimizers"]["bare"]["ratio"] == pytest.approx(1.0)

    out = capsys.readouterr().out
    assert "gpu_check summary" in out and "| tfdls |" in out
    markdown = render.main([str(path)])
    assert "| 4x8x8-sgd-graph (calls " in markdown
    assert "| emb2000x8:32+2x8x8-sgdm-graph (calls " in markdown
    assert "| tfdls | " in markdown and "DtoH copies/step" in markdown
    assert "tfdls step_plan.skip: masked" in markdown and "| epoch (s) |" in markdown


def test_gpu_check_flags_a_transformer_fit_without_masked_skip(gpu_check):
    result = {"step_plan_masked": False, "step_plan": {"skip": "cond", "reason": "why"}}
    assert gpu_check.part_status("transformer_fit", result, 1.0).startswith(
        "FAILED: tfdls step_plan.skip is 'cond'")
    assert gpu_check.part_status("transformer_fit", dict(result, step_plan_masked=True),
                                 1.0).startswith("ok")


def test_gpu_check_time_budget_leaves_the_overhead_part_out(gpu_check, tmp_path):
    path = tmp_path / "budget.json"
    report, status = gpu_check.main(
        ["--force-cpu", "--skip", "fit,device_to_host,mirrored,transformer_fit",
         "--time-budget", "0",
         "--json", str(path)]
    )
    assert status == 1
    assert report["status"]["fit"] == "skipped"
    assert report["status"]["overhead"].startswith("not run: --time-budget spent")
    assert json.loads(path.read_text())["status"] == report["status"]
