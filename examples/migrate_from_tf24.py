"""Migrating TensorFlow 2.4 ``tf.mixed_precision.experimental`` loss-scale code.

TensorFlow removed ``tf.mixed_precision.experimental.DynamicLossScale`` and
``FixedLossScale``; tfdls keeps their constructor arguments, their
``update(grads) -> (update_op, should_apply)`` contract and their configs.
Porting is a one-line import change::

    # TensorFlow 2.4:
    #   from tensorflow.mixed_precision import experimental as mixed_precision
    #   loss_scale = mixed_precision.DynamicLossScale(
    #       initial_loss_scale=2**15, increment_period=2000, multiplier=2.0)
    # tfdls:
    #   import tfdls as mixed_precision
    #   loss_scale = mixed_precision.DynamicLossScale(
    #       initial_loss_scale=2**15, increment_period=2000, multiplier=2.0)

This script runs seed-era code unchanged apart from that import: a custom
loop that scales the loss by hand, calls ``loss_scale.update(grads)`` and
applies the gradients only when ``should_apply`` is true (with ``tf.cond``
inside a ``tf.function``); a `FixedLossScale`; and ``get_config`` /
``from_config`` round trips. Data: scikit-learn's digits (no download).

    python examples/migrate_from_tf24.py [--steps 60]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

# The only change from TF 2.4 (was: from tensorflow.mixed_precision import
# experimental as mixed_precision).
import tfdls as mixed_precision  # noqa: E402


def make_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def batches(steps, batch_size=64):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).repeat()
    return ds.batch(batch_size).take(steps)


def train(loss_scale, steps, poison_step=None):
    """A TF 2.4-style loop: the loss scale object is driven by hand.

    With `poison_step`, that step's loss is multiplied by inf so its
    gradients overflow, to show a skipped step.
    """
    keras.utils.set_random_seed(0)
    model = make_model()
    optimizer = keras.optimizers.SGD(0.5)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y, poison):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            loss = loss * tf.where(poison, np.inf, 1.0)
            scaled_loss = loss * tf.cast(loss_scale(), loss.dtype)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = [g / tf.cast(loss_scale(), g.dtype) for g in scaled_grads]
        update_op, should_apply = loss_scale.update(grads)

        def apply():
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.constant(True)

        # As in TF 2.4, FixedLossScale answers with the Python bool True (there
        # is nothing to decide); DynamicLossScale with a bool tensor. TF 2.4's
        # own optimizer used smart_cond; converting works for both too.
        with tf.control_dependencies([update_op]):
            applied = tf.cond(
                tf.convert_to_tensor(should_apply), apply, lambda: tf.constant(False)
            )
        return loss, applied

    losses, skipped = [], 0
    for step, (x, y) in enumerate(batches(steps)):
        loss, applied = train_step(x, y, tf.constant(step == poison_step))
        if bool(applied):
            losses.append(float(loss))
        else:
            skipped += 1
    return losses, skipped


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")

    # Dynamic: TF 2.4's positional/keyword arguments work as they did.
    dynamic = mixed_precision.DynamicLossScale(
        initial_loss_scale=2**10, increment_period=20, multiplier=2.0
    )
    losses, skipped = train(dynamic, args.steps, poison_step=5)
    print(f"dynamic: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(
        f"dynamic: skipped {skipped} step(s); final loss scale {float(dynamic()):g}, "
        f"good steps {int(dynamic.num_good_steps.numpy())}"
    )

    # Fixed: never skips a step (inf gradients would be applied, as in TF 2.4,
    # so no poisoned step here).
    fixed = mixed_precision.FixedLossScale(128)
    losses, skipped = train(fixed, args.steps)
    print(
        f"fixed: loss {losses[0]:.4f} -> {losses[-1]:.4f}, skipped {skipped}, "
        f"scale {float(fixed()):g}"
    )

    # Configs round-trip, as tf.keras saved them.
    config = dynamic.get_config()
    restored = mixed_precision.DynamicLossScale.from_config(config)
    print(f"config: {config}")
    print(f"from_config round trip equal: {restored.get_config() == config}")
    serialized = mixed_precision.serialize(fixed)
    print(f"serialize(fixed): {serialized}")
    round_trip = mixed_precision.deserialize(serialized)
    print(f"deserialize round trip equal: {round_trip.get_config() == fixed.get_config()}")
    keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
    main()
