"""Dynamic loss scaling under tf.distribute.MirroredStrategy.

Splits the CPU into two logical devices (this must happen before TensorFlow
initializes, hence at the top of the file), builds and compiles a small
mixed_float16 model inside ``strategy.scope()`` with
`tfdls.LossScaleOptimizer`, and trains it with ``model.fit`` on scikit-learn's
digits data (no download). The replicas agree on every skip/apply decision,
so each replica's copy of the loss scale stays identical; the script prints
those copies and the test accuracy.

``all_reduce_dtype="float16"`` (the default here; ``--all-reduce-dtype none``
gives Keras' float32 all-reduce): the replicas sum their *scaled* gradients in
float16, half the bytes, and the sums are divided and checked; a sum that
overflows float16 skips the step and lowers the scale like any overflow.

``jit_compile=False``: XLA with MirroredStrategy over logical CPU devices is
not supported by TensorFlow (on GPUs it works).

    python examples/distributed.py [--epochs 5] [--all-reduce-dtype float16|none]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Before anything touches a device: two logical CPUs stand in for two GPUs.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdls  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--all-reduce-dtype", default="float16", choices=("float16", "none"))
    args = parser.parse_args(argv)
    all_reduce_dtype = None if args.all_reduce_dtype == "none" else args.all_reduce_dtype

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0
    )

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print(f"replicas in sync: {strategy.num_replicas_in_sync}")

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )
        # Start high so that a few steps overflow and are skipped (on all
        # replicas together) while the scale comes down.
        optimizer = tfdls.LossScaleOptimizer(
            keras.optimizers.Adam(2e-3),
            loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=100),
            # Sum the scaled gradients over the replicas in float16: half the traffic.
            all_reduce_dtype=all_reduce_dtype,
        )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,
        )

    model.fit(x_train, y_train, epochs=args.epochs, batch_size=64, verbose=2)

    # Each replica holds its own copy of the scale variable.
    copies = [
        float(v.numpy())
        for v in strategy.experimental_local_results(optimizer.loss_scale.current_loss_scale)
    ]
    print("replica loss scales: " + ", ".join(f"{c:g}" for c in copies))
    print(f"replicas agree: {len(set(copies)) == 1}")
    print(f"skipped steps: {int(optimizer.loss_scale.num_skipped_steps)}")
    print(f"all-reduce: {optimizer.step_plan.all_reduce}")
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy: {accuracy:.3f}")
    keras.mixed_precision.set_global_policy("float32")
    return copies, accuracy


if __name__ == "__main__":
    main()
