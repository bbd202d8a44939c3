"""A deterministic mixed_float16 training job that can be killed and resumed.

Used by tests/saving/test_preemption.py (not a test itself):

    python preempt_job.py fit|loop STATE_DIR OUT.npz [--slow SECONDS]

`fit` resumes through keras.callbacks.BackupAndRestore, `loop` (a custom
training loop) through tf.train.CheckpointManager. Progress lines ("step N")
are appended to STATE_DIR/progress so the test knows when to kill. At the end
the weights, every optimizer variable and the loss-scale state go to OUT.npz.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdls  # noqa: E402

EPOCHS = 6
STEPS_PER_EPOCH = 8
BATCH = 16
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 6)).astype("float32")
    y = (np.sin(x).sum(axis=1, keepdims=True)).astype("float32")
    return x, y


def build():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    # Starts far too high and grows often, with hysteresis: the scale,
    # counters and hysteresis budget all change during the run.
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        loss_scale=tfdls.DynamicLossScale(
            initial_loss_scale=2.0**30, increment_period=3, hysteresis=2
        ),
    )
    return model, optimizer


def snapshot(model, optimizer, path):
    ls = optimizer.loss_scale
    arrays = {f"weight_{i}": v.numpy() for i, v in enumerate(model.weights)}
    arrays.update(
        {f"inner_{i}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.inner_optimizer.variables)}
    )
    for name in ("current_loss_scale", "num_good_steps", "hysteresis_budget"):
        arrays[name] = getattr(ls, name).numpy()
    arrays["num_skipped_steps"] = ls.num_skipped_steps.numpy()
    arrays["steps_since_overflow"] = ls.steps_since_overflow.numpy()
    arrays["iterations"] = np.asarray(optimizer.iterations.numpy())
    np.savez(path, **arrays)


class Progress(keras.callbacks.Callback):
    def __init__(self, path, slow):
        super().__init__()
        self.path, self.slow = path, slow

    def on_train_batch_end(self, batch, logs=None):
        with open(self.path, "a") as f:
            f.write(f"step {batch}\n")
        time.sleep(self.slow)


def run_fit(state_dir, out, slow):
    model, optimizer = build()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data()
    model.fit(
        x,
        y,
        epochs=EPOCHS,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(os.path.join(state_dir, "backup")),
            Progress(os.path.join(state_dir, "progress"), slow),
        ],
    )
    snapshot(model, optimizer, out)


def run_loop(state_dir, out, slow):
    model, optimizer = build()
    optimizer.build(model.trainable_variables)
    step_counter = tf.Variable(0, dtype=tf.int64)  # counts skipped steps too
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step_counter)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(state_dir, "ckpt"), max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    x, y = data()

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        step_counter.assign_add(1)

    while int(step_counter.numpy()) < TOTAL_STEPS:
        i = int(step_counter.numpy()) % STEPS_PER_EPOCH
        train_step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        if int(step_counter.numpy()) % 5 == 0:
            manager.save()
        with open(os.path.join(state_dir, "progress"), "a") as f:
            f.write(f"step {int(step_counter.numpy())}\n")
        time.sleep(slow)
    snapshot(model, optimizer, out)


if __name__ == "__main__":
    tf.config.experimental.enable_op_determinism()
    mode, state_dir, out = sys.argv[1:4]
    slow = float(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--slow" else 0.0
    os.makedirs(state_dir, exist_ok=True)
    {"fit": run_fit, "loop": run_loop}[mode](state_dir, out, slow)
