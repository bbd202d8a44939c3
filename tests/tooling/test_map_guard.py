"""conftest.py's guard: a test process that nears the kernel's memory-map limit
stops with a message (XLA's CPU compiler never unmaps what it compiled, and
TensorFlow segfaults past vm.max_map_count)."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import MAPS_HEADROOM, memory_maps

pytestmark = pytest.mark.slow  # subprocesses: run by CI, not by the fast loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
A_SMALL_TEST = "tests/scales/test_loss_scale.py::test_oracle_sequences_exercise_growth_overflow_and_clamp"


def _pytest(max_maps, workers):
    env = dict(os.environ, TFDLS_TESTS_MAX_MAPS=str(max_maps))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
         A_SMALL_TEST],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_this_process_counts_its_maps():
    held, most = memory_maps()
    assert 100 < held < most


# "0": in the pytest process itself; "2": in xdist workers, as the suite runs.
@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.timeout(600)
def test_a_process_near_the_limit_stops_with_a_message(workers):
    # A limit one map above the headroom: any process is past it at its
    # first test's setup. Then a limit no process reaches: the test runs.
    stopped = _pytest(MAPS_HEADROOM + 1, workers)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 2, output  # interrupted
    assert f"Interrupted: stopped before {A_SMALL_TEST}" in stopped.stdout, output
    assert "vm.max_map_count" in stopped.stdout
    assert "INTERNALERROR" not in output
    assert " passed" not in stopped.stdout
    ran = _pytest(10**9, workers)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout
