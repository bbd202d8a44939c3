"""Runs every script in examples/ in a subprocess and checks what it prints.

Each example runs with small arguments (they are demos, not benchmarks);
the assertions parse the numbers the scripts print, so a script that runs
but trains nothing, loses its checkpoint state or lets replicas drift fails.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SUBPROCESS_TIMEOUT = 150

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)]


def _run(args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("MPLBACKEND", None)
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )
    assert proc.returncode == 0, (
        f"{args} exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n"
        f"{proc.stderr[-5000:]}"
    )
    return proc.stdout


def _one(pattern, text):
    matches = re.findall(pattern, text, flags=re.MULTILINE)
    assert len(matches) == 1, f"expected one line matching {pattern!r} in:\n{text}"
    return matches[0]


def _float(pattern, text):
    return float(_one(pattern, text))


# -- each example ----------------------------------------------------------------


def check_quickstart(out, tmp_path):
    accuracy = _float(r"^test accuracy: ([0-9.]+)$", out)
    assert 0.5 < accuracy <= 1.0
    scale = _float(r"^final loss scale: ([0-9.e+]+)$", out)
    # Starts at 2**24 and must come down to where float16 gradients fit.
    assert 1.0 <= scale < 2.0**24
    skipped, steps = map(int, _one(r"^skipped steps: (\d+) of (\d+)$", out))
    assert 1 <= skipped < steps
    png = tmp_path / "scale.png"
    assert f"saved plot: {png}" in out
    data = png.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def check_custom_training_loop(out, tmp_path):
    for style in ("keras3", "tf24"):
        losses = [
            float(v) for v in re.findall(rf"^\[{style}\] epoch \d+: loss ([0-9.]+)$", out, re.M)
        ]
        assert len(losses) == 2, out
        assert losses[-1] < losses[0] - 0.1, (style, losses)
        scale, skipped, applied = _one(
            rf"^\[{style}\] final loss scale: ([0-9.e+]+), skipped steps: (\d+), "
            r"applied steps: (\d+)$",
            out,
        )
        # 2 epochs of ceil(1797 / 64) = 29 batches; a scale of 2**15 fits this
        # model's gradients, so nothing is skipped and it doubles after 50 steps.
        assert (int(applied), int(skipped)) == (58, 0)
        assert float(scale) == 2.0**16
    assert "both styles trained identically: True" in out


def check_distributed(out, tmp_path):
    assert _one(r"^replicas in sync: (\d+)$", out) == "2"
    copies = [float(c) for c in _one(r"^replica loss scales: (.+)$", out).split(", ")]
    assert len(copies) == 2
    assert copies[0] == copies[1]
    assert 1.0 <= copies[0] < 2.0**24
    assert "replicas agree: True" in out
    assert int(_one(r"^skipped steps: (\d+)$", out)) >= 1
    assert _one(r"^all-reduce: (\w+)$", out) == "float16"
    assert _float(r"^test accuracy: ([0-9.]+)$", out) > 0.5


def check_migrate_from_tf24(out, tmp_path):
    first, last = map(float, _one(r"^dynamic: loss ([0-9.]+) -> ([0-9.]+)$", out))
    assert last < first
    skipped, scale, good = _one(
        r"^dynamic: skipped (\d+) step\(s\); final loss scale ([0-9.e+]+), good steps (\d+)$", out
    )
    # 40 steps, step 5 poisoned: 1024 -> 512, then 34 finite steps grow it once.
    assert int(skipped) == 1
    assert float(scale) == 1024.0
    assert int(good) == 34 - 20
    first, last, skipped, scale = _one(
        r"^fixed: loss ([0-9.]+) -> ([0-9.]+), skipped (\d+), scale ([0-9.e+]+)$", out
    )
    assert float(last) < float(first)
    assert int(skipped) == 0
    assert float(scale) == 128.0
    assert "from_config round trip equal: True" in out
    assert "deserialize round trip equal: True" in out
    assert "'increment_period': 20" in out


def check_checkpoint_resume(out, tmp_path):
    def state(label):
        text = _one(rf"^{label}: (.+)$", out)
        return {k: float(v) for k, v in (item.split("=") for item in text.split(", "))}

    saved, fresh, restored, continued = (
        state(k) for k in ("saved", "fresh", "restored", "continued")
    )
    assert restored == saved
    assert fresh != saved
    assert saved["iterations"] > 0 and saved["loss_scale"] < 2.0**24
    assert "state equal: True" in out
    assert "weights equal: True" in out
    assert continued["iterations"] > restored["iterations"]
    assert continued["skipped_steps"] >= restored["skipped_steps"]
    ckpt = pathlib.Path(_one(r"^checkpoint: (.+)$", out))
    assert ckpt.parent == tmp_path / "ckpt"
    assert list(ckpt.parent.glob(ckpt.name + ".index"))


def check_diagnose_scale(out, tmp_path):
    runs = {}
    for run in ("scale 1", "dynamic"):
        accuracy, scale = _one(
            rf"^{run}: test accuracy ([0-9.]+), final loss scale ([0-9.e+]+)$", out
        )
        assert float(accuracy) > 0.5
        layers = re.findall(
            rf"^  {run} (\S+): median headroom ([-0-9.inf]+) bits, "
            r"median subnormal fraction ([0-9.]+)$",
            out,
            re.M,
        )
        assert len(layers) == 3, out
        runs[run] = {name: (float(h), float(f)) for name, h, f in layers}
    assert float(_one(r"^scale 1: test accuracy [0-9.]+, final loss scale ([0-9.e+]+)$", out)) == 1
    for name, (low_headroom, low_subnormal) in runs["scale 1"].items():
        headroom, subnormal = runs["dynamic"][name]
        # A scale of 1 leaves ~20 bits unused at the top and pushes gradients
        # into float16's subnormal range; the dynamic scale does neither.
        assert low_headroom > headroom + 8, (name, low_headroom, headroom)
        assert low_subnormal > subnormal, (name, low_subnormal, subnormal)
        assert 0 < headroom < 16
    png = tmp_path / "diagnose.png"
    assert f"saved plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_per_layer_scales(out, tmp_path):
    runs = {}
    for run in ("float32", "global", "per-layer"):
        accuracy, loss = _one(rf"^ *{run}: test accuracy ([0-9.]+), final loss ([0-9.]+)", out)
        runs[run] = (float(accuracy), float(loss))
    kernels = re.findall(
        r"^ +(dense_\d+): ([0-9.]+) \(([0-9.]+)\) -> ([0-9.]+) \(([0-9.]+)\)$", out, re.M
    )
    assert len(kernels) == 8, out
    first = {name: tuple(map(float, rest)) for name, *rest in kernels}
    # Global: the first blocks' scaled gradients are all zero or subnormal.
    # Per-layer: only the exact zeros of always-zero input pixels stay, and
    # the run follows float32 while the global run falls behind.
    for name in ("dense_1", "dense_2"):
        global_small, _, per_layer_small, _ = first[name]
        assert global_small > 0.9 and per_layer_small < 0.05, (name, first[name])
    assert abs(runs["per-layer"][1] - runs["float32"][1]) < 0.1 * runs["float32"][1], runs
    assert runs["global"][1] > runs["float32"][1] * 1.3, runs
    png = tmp_path / "per_layer.png"
    assert f"saved {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CASES = {
    "per_layer_scales.py": (["--epochs", "3", "--plot", "{tmp}/per_layer.png"],
                            check_per_layer_scales),
    "diagnose_scale.py": (["--epochs", "2", "--plot", "{tmp}/diagnose.png"], check_diagnose_scale),
    "quickstart.py": (["--epochs", "2", "--plot", "{tmp}/scale.png"], check_quickstart),
    "custom_training_loop.py": (["--epochs", "2"], check_custom_training_loop),
    "distributed.py": (["--epochs", "3"], check_distributed),
    "migrate_from_tf24.py": (["--steps", "40"], check_migrate_from_tf24),
    "checkpoint_resume.py": (["--dir", "{tmp}/ckpt", "--steps", "20"], check_checkpoint_resume),
}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name, tmp_path):
    args, check = CASES[name]
    args = [a.format(tmp=tmp_path) for a in args]
    out = _run([str(EXAMPLES / name), *args])
    check(out, tmp_path)


_WITHOUT_MATPLOTLIB = r"""
import runpy, sys

class BlockMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, BlockMatplotlib())
sys.argv = ["examples/quickstart.py"] + sys.argv[1:]
runpy.run_path("examples/quickstart.py", run_name="__main__")
"""


def test_quickstart_without_matplotlib_skips_the_plot(tmp_path):
    png = tmp_path / "scale.png"
    out = _run(["-c", _WITHOUT_MATPLOTLIB, "--epochs", "1", "--plot", str(png)])
    assert "matplotlib is not installed: skipping the plot" in out
    assert "saved plot" not in out
    assert not png.exists()
    assert _float(r"^test accuracy: ([0-9.]+)$", out) > 0.3


def test_per_layer_plot_keeps_each_runs_colour_and_shows_float32(tmp_path):
    """docs/per_layer_scales.png: a run has one colour in both panels, and the float32 loss
    curve is drawn above the per-layer one that follows it closely."""
    import importlib.util
    import types

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = importlib.util.spec_from_file_location("per_layer_scales",
                                                  EXAMPLES / "per_layer_scales.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    kernels = ["dense/kernel", "dense_1/kernel"]
    recorder = types.SimpleNamespace(kernels=kernels, losses=[1.0] * 40,
                                     small={k: [0.1] for k in kernels})
    example.plot({run: (0.9, recorder, {}) for run in example.RUNS}, tmp_path / "p.png")
    left, right = plt.gcf().axes
    colours = {}
    for axis in (left, right):
        for line in axis.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(example.RUNS)
    by_label = {line.get_label(): line for line in right.get_lines()}
    assert by_label["float32"].get_zorder() > by_label["per-layer"].get_zorder()
    plt.close("all")
