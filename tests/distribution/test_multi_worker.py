"""tfdls under a real two-worker MultiWorkerMirroredStrategy cluster.

Each worker is a separate process (tests/support/jobs/multi_worker_job.py)
with its own TF_CONFIG, one CPU replica each, talking over gRPC on 127.0.0.1.
Starting TensorFlow is the expensive part, so one cluster run serves several
tests:

* ``training_cluster``: `model.fit`, then a custom loop in which worker 0
  alone overflows once, then worker 1 is SIGKILLed and worker 0 must fail;
* ``leader_death_cluster``: one custom-loop step, then worker 0 (the
  collective leader, which also hosts the coordination service) is SIGKILLed
  and worker 1 must fail.

Every wait is bounded (subprocess timeouts, then kill), and every test has a
pytest timeout that covers the cluster start in its fixture.
"""

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import JOBS

pytestmark = pytest.mark.slow  # subprocesses: run by CI, not by the fast loop

JOB_PATH = JOBS / "multi_worker_job.py"
_spec = importlib.util.spec_from_file_location("multi_worker_job", JOB_PATH)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)  # NumPy only: the job imports TensorFlow in main()

NUM_WORKERS = job.NUM_WORKERS
# Collective timeout of every worker: a backstop for a lost peer (the
# coordination service's heartbeat usually notices much earlier).
COLLECTIVE_TIMEOUT_S = 60
# A survivor must fail within this bound after its peer died (a liveness
# bound, not a performance check: without it the survivor would block forever).
SURVIVOR_FAILS_WITHIN_S = COLLECTIVE_TIMEOUT_S + 60
# One whole cluster run: two TensorFlow start-ups on a loaded box, training,
# and the survivor's bounded failure.
CLUSTER_TIMEOUT_S = 240
# A test may have to start a cluster in its fixture.
TEST_TIMEOUT_S = CLUSTER_TIMEOUT_S + 60

_PORT_CLASH_MARKERS = ("Address already in use", "Could not start gRPC server")


def _free_ports(count):
    """Distinct ports that were free on 127.0.0.1 a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ClusterRun:
    """What the workers of one cluster run left behind."""

    def __init__(self, workdir, victim, returncodes, timed_out):
        self.workdir = workdir
        self.victim = victim
        self.survivor = 1 - victim
        self.returncodes = returncodes
        self.timed_out = timed_out

    def log(self, index):
        path = self.workdir / f"worker{index}.log"
        return path.read_text(errors="replace") if path.exists() else "<no log>"

    def describe(self):
        parts = [f"return codes {self.returncodes}, timed out {self.timed_out}"]
        for index in range(NUM_WORKERS):
            parts.append(f"--- worker {index} log (tail) ---\n{self.log(index)[-3000:]}")
        return "\n".join(parts)

    def port_clash(self):
        return any(
            marker in self.log(index)
            for index in range(NUM_WORKERS)
            for marker in _PORT_CLASH_MARKERS
        )

    def _json(self, name):
        path = self.workdir / name
        assert path.exists(), f"{name} was not written.\n{self.describe()}"
        return json.loads(path.read_text())

    def result(self, index):
        return self._json(f"result{index}.json")

    def death(self):
        return self._json(f"death{self.survivor}.json")


def _run_cluster_once(workdir, victim, mode):
    workdir.mkdir(parents=True, exist_ok=True)
    ports = _free_ports(NUM_WORKERS)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    procs, logs = [], []
    returncodes, timed_out = [None] * NUM_WORKERS, []
    try:
        for index in range(NUM_WORKERS):
            env = dict(os.environ)
            env.update(
                TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": index}}
                ),
                TF_CPP_MIN_LOG_LEVEL="2",
                CUDA_VISIBLE_DEVICES="",
            )
            # Logs go to files, not pipes: a full pipe would block a worker
            # while the test waits on the other one.
            logs.append(open(workdir / f"worker{index}.log", "wb"))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(JOB_PATH),
                        str(workdir / f"result{index}.json"),
                        str(workdir / f"death{index}.json"),
                        str(COLLECTIVE_TIMEOUT_S),
                        str(victim),
                        mode,
                    ],
                    env=env,
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        for index, proc in enumerate(procs):
            try:
                proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.append(index)
                proc.kill()
                proc.communicate(timeout=30)
            returncodes[index] = proc.returncode
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for log in logs:
            log.close()
    return ClusterRun(workdir, victim, returncodes, timed_out)


def _run_cluster(tmp_path_factory, name, victim, mode):
    """Runs a cluster; once more on fresh ports if a port was taken meanwhile."""
    run = _run_cluster_once(tmp_path_factory.mktemp(name), victim, mode)
    if run.port_clash():
        run = _run_cluster_once(tmp_path_factory.mktemp(name), victim, mode)
    return run


@pytest.fixture(scope="module")
def training_cluster(tmp_path_factory):
    return _run_cluster(tmp_path_factory, "mwms_train", victim=1, mode="train")


@pytest.fixture(scope="module")
def leader_death_cluster(tmp_path_factory):
    return _run_cluster(tmp_path_factory, "mwms_leader_death", victim=0, mode="death")


def _arrays(values):
    return [np.asarray(v, dtype=np.float32) for v in values]


def _assert_same_arrays(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(_arrays(actual), _arrays(expected))):
        np.testing.assert_array_equal(a, e, err_msg=f"{what}, array {i}")


def _assert_close_arrays(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(_arrays(actual), _arrays(expected))):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6, err_msg=f"{what}, array {i}")


def _max_change(before, after):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(_arrays(before), _arrays(after)))


def _reference_model(initial_weights):
    model = job.build_model(keras)
    model.set_weights(_arrays(initial_weights))
    return model


def _reference_step(model, optimizer, x, y):
    """One single-process step on a whole global batch (mean squared error)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


def _trained_results(run):
    assert not run.timed_out, f"a worker hung.\n{run.describe()}"
    results = [run.result(index) for index in range(NUM_WORKERS)]
    for index, result in enumerate(results):
        assert result["task_index"] == index
        assert result["num_replicas_in_sync"] == NUM_WORKERS, run.describe()
    return results


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_fit_keeps_workers_identical_and_matches_single_process_sgd(training_cluster):
    results = _trained_results(training_cluster)
    fits = [result["fit"] for result in results]
    expected_steps = job.FIT_EXAMPLES // job.GLOBAL_BATCH

    # The workers seeded their initializers differently; the strategy must
    # have broadcast worker 0's values, and every update must agree.
    _assert_same_arrays(fits[1]["initial_weights"], fits[0]["initial_weights"], "initial weights")
    _assert_same_arrays(fits[1]["weights"], fits[0]["weights"], "weights after fit")
    for index, fit in enumerate(fits):
        assert fit["iterations"] == expected_steps, f"worker {index}"
        assert fit["num_skipped_steps"] == 0, f"worker {index}"
        growths = expected_steps // job.FIT_GROWTH_STEPS
        assert fit["loss_scale"] == job.FIT_INITIAL_SCALE * 2.0**growths, f"worker {index}"
        assert all(math.isfinite(v) for v in fit["loss"]), f"worker {index}: {fit['loss']}"
    assert _max_change(fits[0]["initial_weights"], fits[0]["weights"]) > 1e-3

    # Scaled, all-reduced, unscaled: the same as plain SGD on the global batch.
    model = _reference_model(fits[0]["initial_weights"])
    optimizer = keras.optimizers.SGD(job.FIT_LEARNING_RATE)
    x, y = job.fit_data()
    for step in range(expected_steps):
        rows = slice(step * job.GLOBAL_BATCH, (step + 1) * job.GLOBAL_BATCH)
        _reference_step(model, optimizer, x[rows], y[rows])
    _assert_close_arrays(fits[0]["weights"], model.get_weights(), "fit vs single-process SGD")


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_overflow_on_one_worker_skips_the_step_on_every_worker(training_cluster):
    results = _trained_results(training_cluster)
    all_snapshots = [result["loop"]["snapshots"] for result in results]
    assert [len(s) for s in all_snapshots] == [job.LOOP_STEPS + 1] * NUM_WORKERS

    # Bit-identical state on both workers after every step, the skipped one included.
    for step, (s0, s1) in enumerate(zip(*all_snapshots)):
        what = f"after {step} steps"
        _assert_same_arrays(s1["weights"], s0["weights"], f"weights {what}")
        _assert_same_arrays(
            s1["inner_optimizer_variables"], s0["inner_optimizer_variables"], f"Adam state {what}"
        )
        for key in ("loss_scale", "num_skipped_steps", "iterations"):
            assert s1[key] == s0[key], f"{key} {what}: {s0[key]} vs {s1[key]}"

    for index, snapshots in enumerate(all_snapshots):
        assert all(math.isfinite(v) for v in results[index]["loop"]["losses"])
        for step in range(job.LOOP_STEPS):
            before, after = snapshots[step], snapshots[step + 1]
            what = f"worker {index}, step {step}"
            if step == job.POISON_STEP:
                # Only worker 0 saw the NaN; worker 1 must skip all the same.
                _assert_same_arrays(after["weights"], before["weights"], f"{what}: weights")
                _assert_same_arrays(
                    after["inner_optimizer_variables"],
                    before["inner_optimizer_variables"],
                    f"{what}: Adam state",
                )
                assert after["iterations"] == before["iterations"], what
                assert after["loss_scale"] == before["loss_scale"] / 2, what
                assert after["num_skipped_steps"] == before["num_skipped_steps"] + 1, what
            else:
                assert _max_change(before["weights"], after["weights"]) > 0, what
                assert after["iterations"] == before["iterations"] + 1, what
                assert after["loss_scale"] == before["loss_scale"], what
                assert after["num_skipped_steps"] == before["num_skipped_steps"], what
        assert snapshots[0]["loss_scale"] == job.LOOP_INITIAL_SCALE
        assert snapshots[-1]["loss_scale"] == job.LOOP_INITIAL_SCALE / 2
        assert snapshots[-1]["num_skipped_steps"] == 1
        assert snapshots[-1]["iterations"] == job.LOOP_STEPS - 1


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_custom_loop_matches_single_process_adam_without_the_skipped_step(training_cluster):
    results = _trained_results(training_cluster)
    snapshots = results[0]["loop"]["snapshots"]
    model = _reference_model(snapshots[0]["weights"])
    optimizer = keras.optimizers.Adam(job.LOOP_LEARNING_RATE)
    for step in range(job.LOOP_STEPS):
        if step != job.POISON_STEP:
            _reference_step(model, optimizer, *job.loop_batch(step))
        # Adam's moments and step count (its bias correction) must not have
        # seen the skipped step either, or every later step would differ.
        _assert_close_arrays(
            snapshots[step + 1]["weights"],
            model.get_weights(),
            f"custom loop vs single-process Adam after step {step}",
        )


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(
    "cluster_fixture", ["training_cluster", "leader_death_cluster"], ids=["worker1_dies", "worker0_dies"]
)
def test_survivor_fails_instead_of_hanging_when_a_worker_dies(cluster_fixture, request):
    run = request.getfixturevalue(cluster_fixture)
    assert not run.timed_out, f"a worker hung after its peer died.\n{run.describe()}"
    # Both workers trained together before the death, so the cluster worked.
    for index in range(NUM_WORKERS):
        assert run.result(index)["loop"]["snapshots"][1]["iterations"] == 1, run.describe()
    assert run.returncodes[run.victim] == -signal.SIGKILL, run.describe()
    assert run.returncodes[run.survivor] == job.SURVIVOR_FAILED, run.describe()
    death = run.death()
    assert death["is_tf_op_error"], death
    assert death["error_type"] and death["message"], death
    assert death["seconds_to_fail"] < SURVIVOR_FAILS_WITHIN_S, death
