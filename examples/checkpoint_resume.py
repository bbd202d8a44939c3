"""Checkpoint and resume a mixed-precision custom loop, loss scale included.

The dynamic loss scale is state (the scale, the count of good steps since
the last change, the skipped-step counter...): a run resumed without it
starts again from the initial scale and re-does the overflow search. tfdls
keeps that state in `tf.Variable`s tracked by `LossScaleOptimizer`, so a
`tf.train.Checkpoint` of the optimizer saves and restores it.

This script trains a few steps on scikit-learn's digits data (no download),
saves with `tf.train.CheckpointManager`, builds a fresh model and optimizer,
restores, checks that the loss scale, ``num_good_steps``, the skipped-step
count, ``iterations`` and the weights are equal, then continues training.

    python examples/checkpoint_resume.py [--dir CKPT_DIR] [--steps 30]
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfdls  # noqa: E402


def make_model_and_optimizer():
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(2e-3),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=7),
    )
    # Build the optimizer's variables now, so a restore fills them in place.
    optimizer.build(model.trainable_variables)
    return model, optimizer


def make_step(model, optimizer):
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def batches(steps, seed):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=seed).repeat()
    return ds.batch(64).take(steps)


def state(model, optimizer):
    ls = optimizer.loss_scale
    return {
        "loss_scale": float(ls().numpy()),
        "num_good_steps": int(ls.num_good_steps.numpy()),
        "skipped_steps": int(ls.num_skipped_steps.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
    }


def describe(label, s):
    return f"{label}: " + ", ".join(f"{k}={v:g}" for k, v in s.items())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    ckpt_dir = args.dir or tempfile.mkdtemp(prefix="tfdls_ckpt_")

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")

    # 1. Train and save.
    model, optimizer = make_model_and_optimizer()
    step = make_step(model, optimizer)
    for x, y in batches(args.steps, seed=0):
        loss = step(x, y)
    before = state(model, optimizer)
    print(f"trained {args.steps} steps, loss {float(loss):.4f}")
    print(describe("saved", before))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2)
    path = manager.save()
    print(f"checkpoint: {path}")

    # 2. A fresh model and optimizer (a new process would start here).
    keras.utils.set_random_seed(1)
    new_model, new_optimizer = make_model_and_optimizer()
    print(describe("fresh", state(new_model, new_optimizer)))
    new_checkpoint = tf.train.Checkpoint(model=new_model, optimizer=new_optimizer)
    new_manager = tf.train.CheckpointManager(new_checkpoint, ckpt_dir, max_to_keep=2)
    new_checkpoint.restore(new_manager.latest_checkpoint).assert_existing_objects_matched()
    after = state(new_model, new_optimizer)
    print(describe("restored", after))

    weights_equal = all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(model.weights, new_model.weights)
    )
    print(f"state equal: {after == before}")
    print(f"weights equal: {weights_equal}")

    # 3. Continue training from where the first run stopped.
    new_step = make_step(new_model, new_optimizer)
    for x, y in batches(args.steps, seed=1):
        loss = new_step(x, y)
    print(f"continued {args.steps} steps, loss {float(loss):.4f}")
    print(describe("continued", state(new_model, new_optimizer)))
    keras.mixed_precision.set_global_policy("float32")
    return before, after, weights_equal


if __name__ == "__main__":
    main()
