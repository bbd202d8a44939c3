"""Preemption: a training process killed with SIGKILL mid-run and restarted
ends with exactly the state of an uninterrupted run (weights, optimizer
slots, loss scale, counters and hysteresis), for fit + BackupAndRestore and
for a custom loop + tf.train.CheckpointManager."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support import JOBS

pytestmark = pytest.mark.slow  # subprocesses: run by CI, not by the fast loop

JOB = JOBS / "preempt_job.py"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
TIMEOUT = 240


def _run(mode, state_dir, out, slow=0.0):
    result = subprocess.run(
        [sys.executable, str(JOB), mode, str(state_dir), str(out), "--slow", str(slow)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _run_and_kill(mode, state_dir, out, kill_after_lines):
    """Starts the job slowed down and SIGKILLs it after some progress."""
    progress = Path(state_dir) / "progress"
    proc = subprocess.Popen(
        [sys.executable, str(JOB), mode, str(state_dir), str(out), "--slow", "0.15"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            if progress.exists() and len(progress.read_text().splitlines()) >= kill_after_lines:
                break
            assert proc.poll() is None, "the job ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("the job made no progress in time")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not Path(out).exists()
    return len(progress.read_text().splitlines())


def _assert_same_state(resumed_path, reference_path):
    resumed, reference = np.load(resumed_path), np.load(reference_path)
    assert sorted(resumed.files) == sorted(reference.files)
    assert any(k.startswith("inner_") for k in reference.files)
    for key in reference.files:
        np.testing.assert_array_equal(resumed[key], reference[key], err_msg=key)
    # The state is not trivial: the run overflowed and grew.
    assert reference["num_skipped_steps"] > 0
    assert reference["current_loss_scale"] < 2.0**30


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_sigkill_then_resume_equals_uninterrupted_run(mode, tmp_path):
    reference = tmp_path / "reference.npz"
    _run(mode, tmp_path / "uninterrupted", reference)

    resumed = tmp_path / "resumed.npz"
    state_dir = tmp_path / "preempted"
    # Killed in the middle of the third epoch (fit) / around step 20 (loop).
    killed_at = _run_and_kill(mode, state_dir, resumed, kill_after_lines=20)
    assert killed_at < 48
    _run(mode, state_dir, resumed)
    _assert_same_state(resumed, reference)
