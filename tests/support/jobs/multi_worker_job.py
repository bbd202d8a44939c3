"""One worker of a two-worker MultiWorkerMirroredStrategy cluster.

Started by tests/distribution/test_multi_worker.py; a plain script (pytest
never collects it and it never imports conftest.py). The cluster comes from the
TF_CONFIG environment variable; the arguments are:

    multi_worker_job.py RESULT_JSON DEATH_JSON COLLECTIVE_TIMEOUT_S VICTIM MODE

MODE "train" runs, in one process (TensorFlow start-up is the expensive part):

1. ``model.fit`` with a `tfdls.LossScaleOptimizer(SGD)`;
2. a custom loop (`strategy.run` in a `tf.function`, `scale_loss` +
   `apply_gradients`) with a `tfdls.LossScaleOptimizer(Adam)`, in which worker
   `POISON_WORKER` alone multiplies one gradient by NaN at step `POISON_STEP`;

and writes what it saw to RESULT_JSON. MODE "death" runs only one step of the
custom loop (no results). Then, in both modes, worker VICTIM kills itself with
SIGKILL and the other worker (the survivor) runs one more training step, whose
collectives can never complete: it must fail, not hang. The survivor records
the error (or that there was none) in DEATH_JSON and leaves with `os._exit`,
so that no exit-time cluster shutdown can hang it.

The data helpers use NumPy only, so the test can import this file (without
TensorFlow being imported by it) to rebuild the same data for its
single-process references.
"""

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

NUM_WORKERS = 2
FEATURES = 4
HIDDEN = 3
GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // NUM_WORKERS

FIT_EXAMPLES = 48
FIT_INITIAL_SCALE = 2.0**10
FIT_GROWTH_STEPS = 2
FIT_LEARNING_RATE = 0.05

LOOP_STEPS = 5
POISON_STEP = 2
POISON_WORKER = 0
LOOP_INITIAL_SCALE = 2.0**12
LOOP_GROWTH_STEPS = 1000
LOOP_LEARNING_RATE = 0.01

# Exit codes of the survivor (a crash exits with 1 or a signal).
SURVIVOR_FAILED = 3
SURVIVOR_DID_NOT_FAIL = 4


def fit_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(FIT_EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(FIT_EXAMPLES, 1))).astype(np.float32)
    return x, y


def loop_batch(step):
    """The global batch of custom-loop step `step` (the same on every worker)."""
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (np.sin(x).sum(axis=1, keepdims=True)).astype(np.float32)
    return x, y


def local_rows(task_index):
    """The rows of a global batch that worker `task_index` trains on."""
    return slice(task_index * LOCAL_BATCH, (task_index + 1) * LOCAL_BATCH)


def build_model(keras):
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _work_around_keras_20585(model, strategy, local_batch):
    """Lets Keras 3's `fit` run under a multi-worker strategy.

    Keras 3 (3.15 at least; keras-team/keras#20585) cannot `fit` under
    MultiWorkerMirroredStrategy, for two reasons that have nothing to do with
    the optimizer:

    * `Trainer._maybe_symbolic_build` calls `strategy.reduce` on the first
      (x, y) batch, a tuple of PerReplica values, which the strategy rejects;
      the model is built from one local batch instead;
    * `reduce_per_replica` reduces each scalar log with
      `strategy.reduce("MEAN", v, axis=0)`, an invalid axis for a scalar; the
      logs are averaged over replicas with `axis=None` instead.

    The training step itself (`train_step`: `scale_loss`, gradients,
    `optimizer.apply`) is untouched.
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def symbolic_build(iterator=None, data_batch=None):
        del iterator, data_batch
        with strategy.scope():
            model._symbolic_build(data_batch=local_batch)

    model._maybe_symbolic_build = symbolic_build

    original = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "auto" and tf_trainer._collective_all_reduce_multi_worker(strategy):

            def mean(value):
                if isinstance(value, tf.distribute.DistributedValues):
                    return strategy.reduce("MEAN", value, axis=None)
                return value

            return tree.map_structure(mean, values)
        return original(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica


def _values(variables):
    return [np.asarray(v.numpy()).tolist() for v in variables]


def _write_json(path, payload):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def main(result_path, death_path, collective_timeout, victim, mode):
    import keras
    import tensorflow as tf

    import tfdls

    task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    # Different seeds per worker: the strategy must broadcast worker 0's
    # initial values, or the workers start (and stay) apart.
    keras.utils.set_random_seed(1234 + task_index)

    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout
        )
    )
    result = {
        "task_index": task_index,
        "num_replicas_in_sync": int(strategy.num_replicas_in_sync),
    }

    # -- 1. model.fit ---------------------------------------------------------
    if mode == "train":
        x, y = fit_data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = dataset.with_options(options)
        with strategy.scope():
            model = build_model(keras)
            opt = tfdls.LossScaleOptimizer(
                keras.optimizers.SGD(FIT_LEARNING_RATE),
                initial_scale=FIT_INITIAL_SCALE,
                dynamic_growth_steps=FIT_GROWTH_STEPS,
            )
            model.compile(optimizer=opt, loss="mse")
        _work_around_keras_20585(model, strategy, (x[:LOCAL_BATCH], y[:LOCAL_BATCH]))
        initial = _values(model.weights)
        history = model.fit(dataset, epochs=1, shuffle=False, verbose=0)
        result["fit"] = {
            "initial_weights": initial,
            "weights": _values(model.weights),
            "loss": [float(v) for v in history.history["loss"]],
            "loss_scale": float(opt.loss_scale().numpy()),
            "num_skipped_steps": int(opt.loss_scale.num_skipped_steps.numpy()),
            "iterations": int(opt.iterations.numpy()),
        }

    # -- 2. custom loop, one worker overflows once -------------------------------
    with strategy.scope():
        loop_model = build_model(keras)
        loop_opt = tfdls.LossScaleOptimizer(
            keras.optimizers.Adam(LOOP_LEARNING_RATE),
            loss_scale=tfdls.DynamicLossScale(
                initial_loss_scale=LOOP_INITIAL_SCALE,
                increment_period=LOOP_GROWTH_STEPS,
            ),
        )
        loop_opt.build(loop_model.trainable_variables)

    def replica_step(x, y, poison):
        with tf.GradientTape() as tape:
            prediction = loop_model(x, training=True)
            per_example = tf.reduce_mean(tf.square(prediction - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            scaled_loss = loop_opt.scale_loss(loss)
        grads = tape.gradient(scaled_loss, loop_model.trainable_variables)
        grads = [grads[0] * poison] + list(grads[1:])
        loop_opt.apply_gradients(zip(grads, loop_model.trainable_variables))
        return loss

    @tf.function
    def train_step(x, y, poison):
        per_replica = strategy.run(replica_step, args=(x, y, poison))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def snapshot():
        return {
            "weights": _values(loop_model.trainable_variables),
            "inner_optimizer_variables": _values(loop_opt.inner_optimizer.variables),
            "loss_scale": float(loop_opt.loss_scale().numpy()),
            "num_skipped_steps": int(loop_opt.loss_scale.num_skipped_steps.numpy()),
            "iterations": int(loop_opt.iterations.numpy()),
        }

    def run_step(step, poisoned):
        gx, gy = loop_batch(step)
        rows = local_rows(task_index)
        poison = float("nan") if poisoned else 1.0
        return train_step(
            tf.constant(gx[rows]), tf.constant(gy[rows]), tf.constant(poison, tf.float32)
        )

    steps = LOOP_STEPS if mode == "train" else 1
    snapshots = [snapshot()]
    losses = []
    for step in range(steps):
        poisoned = mode == "train" and step == POISON_STEP and task_index == POISON_WORKER
        losses.append(float(run_step(step, poisoned).numpy()))
        snapshots.append(snapshot())
    result["loop"] = {"snapshots": snapshots, "losses": losses}
    _write_json(result_path, result)

    # -- 3. a worker dies ---------------------------------------------------------
    sys.stdout.flush()
    sys.stderr.flush()
    if task_index == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    death = {"error_type": None, "message": None, "is_tf_op_error": False}
    try:
        run_step(steps, poisoned=False).numpy()
    except Exception as error:  # noqa: BLE001 - recorded for the test to judge
        death["error_type"] = f"{type(error).__module__}.{type(error).__name__}"
        death["message"] = str(error)[:2000]
        death["is_tf_op_error"] = isinstance(error, tf.errors.OpError)
    death["seconds_to_fail"] = time.monotonic() - started
    _write_json(death_path, death)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown: the cluster is broken and must not be awaited.
    os._exit(SURVIVOR_FAILED if death["error_type"] else SURVIVOR_DID_NOT_FAIL)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
