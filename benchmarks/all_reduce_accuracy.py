"""Accuracy of ``all_reduce_dtype="float16"``: the quickstart's training (examples/quickstart.py:
digits, an MLP of two 128-unit layers, Adam 1e-3, batch 32, mixed_float16) under
MirroredStrategy over two logical CPUs, with Keras' float32 all-reduce (None) and the
float16 one, for several seeds; final training loss and test accuracy per run, and the
spread over seeds of each.

    python benchmarks/all_reduce_accuracy.py [--seeds 0,1,2,3,4] [--epochs 8] [--json PATH]

Not a timing: it runs in one process, both settings on the same seeds.
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdls  # noqa: E402

SETTINGS = (None, "float16")


def train(strategy, all_reduce_dtype, seed, epochs):
    """One quickstart training; returns the final training loss, the test accuracy and the
    optimizer's skipped steps."""
    keras.utils.set_random_seed(seed)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ])
        optimizer = tfdls.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3),
            loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=40),
            all_reduce_dtype=all_reduce_dtype)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    history = model.fit(x_train, y_train, epochs=epochs, batch_size=32, verbose=0,
                        shuffle=True)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert optimizer.step_plan.all_reduce == (all_reduce_dtype or "keras")
    return {"loss": float(history.history["loss"][-1]), "accuracy": float(accuracy),
            "skipped": int(optimizer.loss_scale.num_skipped_steps.numpy())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    runs = {str(d): [train(strategy, d, seed, args.epochs) for seed in seeds] for d in SETTINGS}
    print("| all_reduce_dtype | " + " | ".join(f"seed {s}" for s in seeds)
          + " | mean | stdev |")
    print("|---|" + "---:|" * (len(seeds) + 2))
    for metric in ("loss", "accuracy", "skipped"):
        for setting, results in runs.items():
            values = [r[metric] for r in results]
            print(f"| {setting}: {metric} | " + " | ".join(f"{v:.4f}" for v in values)
                  + f" | {statistics.mean(values):.4f} | {statistics.stdev(values):.4f} |")
    differences = [f["loss"] - k["loss"] for f, k in zip(runs["float16"], runs["None"])]
    print(f"\nper-seed loss difference (float16 - None): mean {statistics.mean(differences):+.4f}, "
          f"stdev {statistics.stdev(differences):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": seeds, "epochs": args.epochs, "runs": runs}, f, indent=1)
    return runs


if __name__ == "__main__":
    main()
