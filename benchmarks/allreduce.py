"""Family "allreduce": a training step under a MultiWorkerMirroredStrategy of `workers`
processes on this machine (gRPC on 127.0.0.1), per variant on its own model (same initial
weights): Keras 3's LossScaleOptimizer, tfdls' (Keras' float32 all-reduce) and tfdls'
with ``all_reduce_dtype="float16"``.

`measure_in_cluster` (called by run.py) starts the workers: each runs this
file as a script, builds every variant and times them with the one timing
loop (timing.measure; every worker makes the same calls in the same order, so
their collectives pair up), and worker 0's figures are the result. Each
variant also records the bytes its traced step all-reduces per worker, read
from the step's collective ops (dtype x elements, `tfdls._distribute.collective_traffic`).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

CLUSTER_TIMEOUT_S = 1800  # a whole case: start-up, every variant's warm-up and rounds


def _free_ports(count):
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


def measure_in_cluster(case, names, rounds, warmup, device="/CPU:0", log=None):
    """Times variants `names` of allreduce `case` in `case.params["workers"]` processes;
    returns worker 0's `timing.measure` result. On a GPU `device` every worker uses the
    first GPU (memory growth on) and all-reduces over the gRPC ring (NCCL cannot run two
    ranks on one GPU); on a CPU the workers see no GPU.

    Raises:
        RuntimeError: a worker failed or the cluster ran past `CLUSTER_TIMEOUT_S`.
    """
    workers = case.params["workers"]
    ports = _free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    with tempfile.TemporaryDirectory() as workdir:
        procs = []
        for index in range(workers):
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            args = [sys.executable, __file__, case.name, ",".join(names), str(rounds),
                    str(warmup), os.path.join(workdir, f"worker{index}.json"), device]
            log_file = open(os.path.join(workdir, f"worker{index}.log"), "w")
            procs.append((subprocess.Popen(args, env=env, stdout=log_file,
                                           stderr=subprocess.STDOUT), log_file))
        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        codes = [None] * workers
        # Poll: a worker that fails leaves the others waiting on collectives forever.
        while None in codes and time.monotonic() < deadline and not any(codes):
            time.sleep(1.0)
            codes = [proc.poll() for proc, _ in procs]
        for proc, log_file in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log_file.close()
        failed = [i for i, (proc, _) in enumerate(procs) if proc.returncode != 0]
        if failed:
            tails = "\n".join(
                f"--- worker {i} ---\n"
                + open(os.path.join(workdir, f"worker{i}.log")).read()[-3000:] for i in failed)
            raise RuntimeError(f"{case.name}: workers {failed} failed or timed out\n{tails}")
        if log:
            log(f"{case.name}: {workers} workers done")
        with open(os.path.join(workdir, "worker0.json")) as f:
            return json.load(f)


def _bytes_per_step(run):
    """Bytes the traced step all-reduces on this worker, by dtype, and the op count."""
    from tfdls import _distribute

    graph = run.step.get_concrete_function(*run.args).graph
    by_dtype, ops = {}, 0
    for c in _distribute.collective_traffic(graph):
        by_dtype[c.dtype] = by_dtype.get(c.dtype, 0) + (c.bytes or 0)
        ops += 1
    return {"all_reduce_bytes": sum(by_dtype.values()), "all_reduce_bytes_by_dtype": by_dtype,
            "collective_ops": ops}


def runs(case, names, strategy, seed=0):
    """The `StepRun`s of variants `names` on allreduce `case`, each step a `strategy.run`
    of steps.py's training step on this worker's batch."""
    import numpy as np
    import tensorflow as tf

    import models
    import optimizers
    import steps
    from runs import StepRun

    p = case.params
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x, y = models.batch(p, seed=seed + task)  # each worker its own batch
    args = (tf.constant(x), tf.constant(y))
    with strategy.scope():
        built = [optimizers.build(name, "adam", models.build(p, seed)) for name in names]
    result = []
    for name, (model, optimizer) in zip(names, built):
        variables = list(model.trainable_variables)
        step = steps.train_step(model, optimizer, variables)

        def distributed(x, y, step=step):
            return strategy.run(step, args=(x, y))

        run = StepRun(name, distributed, args, "graph", variables, optimizer)
        run.skips_allowed = True  # a fresh model's first scaled steps may overflow
        record = run.record
        run.record = lambda run=run, record=record: dict(record(), **_bytes_per_step(run),
                                                         parameters=int(sum(
                                                             np.prod(v.shape)
                                                             for v in run.variables)))
        result.append(run)
    return result


def _worker(case_name, names, rounds, warmup, out_path, device):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # as run.py, for mixed_float16
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras
    import tensorflow as tf

    import cases
    import timing

    tf.get_logger().setLevel("ERROR")
    case = next(c for c in cases.CASES + tuple(c.quick for c in cases.CASES if c.quick)
                if c.family == "allreduce" and c.name == case_name)
    gpus = tf.config.list_physical_devices("GPU")
    if "GPU" in device.upper():
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
    else:
        tf.config.set_visible_devices([], "GPU")
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    keras.mixed_precision.set_global_policy("mixed_float16")
    built = runs(case, names.split(","), strategy)
    stats = timing.measure(built, rounds, case.calls, warmup)
    with open(out_path + ".tmp", "w") as f:
        json.dump(stats, f, default=str)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    os._exit(0)  # no exit-time cluster shutdown to wait for


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
            sys.argv[6])
