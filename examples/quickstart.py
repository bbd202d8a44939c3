"""Quickstart: train a small network in mixed_float16 with tfdls.

Trains an MLP on scikit-learn's bundled digits data set (no download) under
the ``mixed_float16`` policy with `tfdls.LossScaleOptimizer`, prints the test
accuracy, the final loss scale and the number of skipped steps, and saves a
plot of the loss scale over training steps (needs matplotlib).

    python examples/quickstart.py [--epochs 8] [--plot loss_scale.png]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdls  # noqa: E402


class ScaleRecorder(keras.callbacks.Callback):
    """Collects the `loss_scale` that LossScaleMonitor puts into each batch's logs."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(logs["loss_scale"])


def save_plot(scales, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib).")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.semilogy(np.arange(1, len(scales) + 1), scales, drawstyle="steps-post")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss scale (log)")
    ax.set_title("tfdls dynamic loss scale, mixed_float16 on digits")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved plot: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--plot", default="loss_scale.png", help="PNG path ('' to skip)")
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0
    )

    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            # Keep the softmax in float32 for a numerically stable loss.
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    # A deliberately high start and a short growth period, so the plot shows
    # the scale falling to where gradients fit in float16 and then probing up.
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**24, increment_period=40),
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    recorder = ScaleRecorder()
    model.fit(
        x_train,
        y_train,
        epochs=args.epochs,
        batch_size=32,
        verbose=2,
        # update_freq=1 reads the scale every batch: fine for a demo's plot.
        callbacks=[tfdls.LossScaleMonitor(update_freq=1), recorder],
    )

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy: {accuracy:.3f}")
    print(f"final loss scale: {float(optimizer.loss_scale()):g}")
    print(f"skipped steps: {int(optimizer.loss_scale.num_skipped_steps)} of {len(recorder.scales)}")
    report = optimizer.last_overflow()
    if report is not None:
        print(f"last overflow: {report}")
    if args.plot:
        save_plot(recorder.scales, args.plot)
    return accuracy


if __name__ == "__main__":
    main()
