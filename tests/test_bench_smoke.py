"""Smoke test of benchmarks/bench_overhead.py: it runs and reports sane numbers.

No timing assertions: only the structure of the result and that every variant
really ran (the benchmark itself raises if a variant's variables do not change
or a loss-scale optimizer skips a step).
"""

import importlib.util
import math
import pathlib

import pytest

BENCH_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_tiny_workload_reports_every_variant(bench):
    workload = bench.parse_workload("4x8x8-sgd-graph")
    assert (workload.count, workload.shape, workload.inner, workload.mode) == (
        4, (8, 8), "sgd", "graph"
    )
    expected = bench.available_variants()
    assert {"bare", "keras3", "tfdls"} <= set(expected)

    result = bench.run_workload(workload, rounds=2, calls=2, warmup=2)

    assert result["workload"] == "4x8x8-sgd-graph"
    assert set(result["variants"]) == set(expected)
    for name, stats in result["variants"].items():
        assert len(stats["samples_ms"]) == 2, name
        assert all(t > 0 and math.isfinite(t) for t in stats["samples_ms"]), name
        assert stats["ms"] > 0, name
        assert stats["ratio"] > 0 and math.isfinite(stats["ratio"]), name
        assert stats["ratio_p25"] <= stats["ratio"] <= stats["ratio_p75"], name
    assert result["variants"]["bare"]["ratio"] == pytest.approx(1.0)

    floor = result["floor"]
    assert floor["grad_bytes"] == 4 * 8 * 8 * 4
    assert floor["floor_fused"] == pytest.approx(4 / 3)
    assert floor["floor_unfused"] == pytest.approx(2.0)

    text = bench.format_text([result])
    assert "4x8x8-sgd-graph" in text and "floor fused" in text


@pytest.mark.timeout(300)
def test_main_xla_float16_markdown(bench, capsys):
    results = bench.main(
        ["--workloads", "2x8x8-adam-xla", "--rounds", "2", "--calls", "1",
         "--warmup", "1", "--dtype", "float16", "--markdown"]
    )
    assert len(results) == 1
    result = results[0]
    assert result["dtype"] == "float16"
    assert all(v["ratio"] > 0 for v in result["variants"].values())
    # float16 gradients, float32 variables: Adam moves 2 + 6*4 bytes per
    # parameter, the check reads 2 more and an unfused unscale 4 more.
    assert result["floor"]["floor_fused"] == pytest.approx(28 / 26)
    assert result["floor"]["floor_unfused"] == pytest.approx(32 / 26)
    out = capsys.readouterr().out
    assert "| 2x8x8-adam-xla" in out
    assert "TensorFlow" in out and "Keras" in out


def test_workload_selection(bench):
    names = [w.name for w in bench.select_workloads("adam-xla")]
    assert names == ["24x1024x1024-adam-xla", "200x64x64-adam-xla"]
    assert len(bench.select_workloads("")) == 6
    assert [w.name for w in bench.select_workloads("3x5-adam-graph")] == ["3x5-adam-graph"]
    with pytest.raises(SystemExit):
        bench.select_workloads("no-such-workload")


def test_check_only_variant_reads_the_gradients_and_is_verified(bench):
    import numpy as np
    import tensorflow as tf

    workload = bench.parse_workload("3x4x4-sgd-xla")
    initial = [np.zeros((4, 4), np.float32)] * 3
    variant = bench.build_variant("check_only", workload, initial)
    assert variant.variables == []
    finite = [tf.ones((4, 4))] * 3
    poisoned = finite[:2] + [tf.constant(np.full((4, 4), np.nan, np.float32))]

    out = variant.step(finite)
    assert bool(out.numpy()) is True
    bench._sync(variant, out)  # a True answer passes

    out = variant.step(poisoned)
    assert bool(out.numpy()) is False
    # A check that says "non-finite" for the benchmark's finite gradients
    # would be timing the wrong thing: the benchmark refuses it.
    with pytest.raises(RuntimeError, match="reported non-finite"):
        bench._sync(variant, out)
