"""The GPU check: what tfdls costs on an NVIDIA GPU, as pytest tests skipped without one.

    python -m pytest -n 0 -m gpu benchmarks/     # writes gpu_check.json ($TFDLS_GPU_JSON)
    python benchmarks/render.py gpu_check.json

Step overhead (the overhead family, float16 gradients), `fit` speed (the fit
family, the Transformer and the GPU-only MLP included), device-to-host copies
per step from a profiler trace, `fit` under MirroredStrategy with XLA, and the
float16 all-reduce's step time and bytes under a two-process
MultiWorkerMirroredStrategy (the allreduce family). The
JSON is rewritten after every test, so a run cut short keeps what it measured.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import cases
import environment
import fit
import profile_trace
import run

GPU = "/GPU:0"
GPU_MLP = next(c for c in cases.CASES if c.gpu_only)
PROFILED_STEPS = (5, 25)  # the difference cancels what every fit call copies once (its logs)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow")]


@pytest.fixture(scope="module")
def reports():
    """The reports so far, by family; `save` adds to them."""
    return {}


def save(reports, report):
    """Adds `report`'s results to `reports` (replacing rows of the same case) and rewrites
    the JSON atomically."""
    kept = reports.setdefault(report["family"], report)
    if kept is not report:
        names = {r["case"] for r in report["results"]}
        kept["results"] = [r for r in kept["results"] if r["case"] not in names] + report[
            "results"]
    path = os.environ.get("TFDLS_GPU_JSON", "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(list(reports.values()), f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def checks_report(name, rows):
    """A report of one GPU check: a row of values per variant, which render.py renders."""
    return {"benchmark": "tfdls", "family": "gpu_checks", "settings": {},
            "environment": environment.environment(),
            "results": [{"case": name, "variants": rows}]}


@pytest.mark.parametrize("case", cases.select("overhead"), ids=lambda c: c.name)
def test_step_overhead(case, reports):
    save(reports, run.run_family("overhead", [case], device=GPU, dtype="float16"))


@pytest.mark.parametrize("case", cases.select("fit", gpu=True), ids=lambda c: c.name)
def test_fit(case, reports):
    report = run.run_family("fit", [case], device=GPU)
    save(reports, report)
    stats = report["results"][0]["variants"]
    plan = stats.get("tfdls", stats.get("global"))["step_plan"]
    # A branch in the step is a host wait on a GPU: tfdls' step must skip by masking.
    assert plan["skip"] == "masked", plan


def test_device_to_host_copies_per_step(reports, tmp_path):
    short, long_ = PROFILED_STEPS
    rows = {}
    with run.policy("mixed_float16"):
        for fitted in fit.runs(GPU_MLP, list(GPU_MLP.variants)):
            fitted.call(GPU_MLP.calls)  # compiled and past the slow first steps
            counts = []
            for steps in PROFILED_STEPS:
                tf.profiler.experimental.start(str(tmp_path / f"{fitted.name}-{steps}"))
                try:
                    fitted.call(steps)
                finally:
                    tf.profiler.experimental.stop()
                counts.append(profile_trace.count_events(
                    profile_trace.find_trace(str(tmp_path / f"{fitted.name}-{steps}"))))
            # Without a GPU plane (CUPTI missing) the count would say nothing.
            assert any(p.startswith("/device:GPU") for p in counts[1]["planes"]), counts[1]
            per_step = (counts[1]["device_to_host"] - counts[0]["device_to_host"]) / (
                long_ - short)
            rows[fitted.name] = {"value": f"{per_step:.2f}", "short": counts[0],
                                 "long": counts[1]}
    save(reports, checks_report(f"{GPU_MLP.name}: device-to-host copies per step", rows))


def test_mirrored_strategy_with_xla(reports):
    devices = [d.name for d in tf.config.list_logical_devices("GPU")][:2]
    assert len(devices) == 2, devices  # conftest.py splits the first GPU
    # NCCL, MirroredStrategy's choice for GPUs, cannot run two ranks on one physical GPU.
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    rows = {}
    # tfdls first, Keras' own last (it fails there: keras-team/keras#21366), so that a
    # failure cannot hide the others.
    for name in ("tfdls", "bare", "keras3"):
        try:
            with run.policy("mixed_float16"), strategy.scope():
                model = fit.build(GPU_MLP, name, jit_compile=True)
            history = model.fit(fit.dataset(GPU_MLP.params), epochs=2, steps_per_epoch=20,
                                verbose=0, shuffle=False)
            losses = [float(x) for x in history.history["loss"]]
            ok = bool(np.all(np.isfinite(losses)))
            rows[name] = {"value": "ok" if ok else f"non-finite loss {losses}", "losses": losses}
        except Exception as e:  # noqa: BLE001 - the failure is the result
            rows[name] = {"value": f"fails: {type(e).__name__}", "error": str(e)[:1000]}
        save(reports, checks_report(f"{GPU_MLP.name}: MirroredStrategy, 2 GPUs, XLA", rows))
    assert rows["tfdls"]["value"] == "ok", rows["tfdls"]


@pytest.mark.parametrize("case", cases.select("allreduce"), ids=lambda c: c.name)
def test_float16_all_reduce_between_two_workers(case, reports):
    """Two worker processes on the first GPU: Keras 3's LossScaleOptimizer, tfdls' with
    Keras' float32 all-reduce, and tfdls' float16 all-reduce, timed in one run."""
    report = run.run_family("allreduce", [case], device=GPU)
    save(reports, report)
    stats = report["results"][0]["variants"]
    f16, f32 = stats["tfdls_f16"], stats["tfdls"]
    # Half the bytes, read from the traced step: the gradients cross as float16.
    assert f16["all_reduce_bytes_by_dtype"]["float16"] == 2 * f16["parameters"]
    assert f16["all_reduce_bytes"] < 0.51 * f32["all_reduce_bytes"], (f16, f32)
