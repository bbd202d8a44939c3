"""Is my loss scale right? Where the scaled gradients sit in float16's range.

Trains the quickstart model (an MLP on scikit-learn's digits, mixed_float16)
twice with ``LossScaleOptimizer(..., gradient_stats=True)``:

* "scale 1": a loss scale far too low (``min_loss_scale = max_loss_scale =
  1``): small float16 gradients fall into the subnormal range or to zero;
* "dynamic": tfdls' dynamic default, which rides just below overflow.

It prints each run's test accuracy and a summary per layer, and saves one PNG
showing, per layer kernel over training, the headroom below float16's maximum
(in bits) and the fraction of subnormal gradient elements for both runs.

    python examples/diagnose_scale.py [--epochs 6] [--plot diagnose_scale.png]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdls  # noqa: E402

RUNS = {
    "scale 1": lambda: tfdls.DynamicLossScale(1.0, min_loss_scale=1.0, max_loss_scale=1.0),
    "dynamic": lambda: tfdls.DynamicLossScale(),
}


class StatsRecorder(keras.callbacks.Callback):
    """Reads the optimizer's gradient figures after every batch (a host read each)."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.headroom = {name: [] for name in names}
        self.subnormal = {name: [] for name in names}

    def on_train_batch_end(self, batch, logs=None):
        stats = self.model.optimizer.gradient_stats()
        for name in self.names:
            self.headroom[name].append(stats[name].headroom_bits)
            self.subnormal[name].append(stats[name].subnormal_fraction)


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def train(loss_scale, epochs, x_train, x_test, y_train, y_test):
    """One run; returns (test accuracy, StatsRecorder, final loss scale)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", name="dense_1"),
            keras.layers.Dense(128, activation="relu", name="dense_2"),
            keras.layers.Dense(10, name="dense_3"),
            keras.layers.Activation("softmax", dtype="float32"),
        ],
        name="mlp",  # the same variable paths in both runs
    )
    optimizer = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), loss_scale=loss_scale, gradient_stats=True
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    kernels = [v.path for v in model.trainable_variables if v.path.endswith("/kernel")]
    recorder = StatsRecorder(kernels)  # "mlp/dense_1/kernel", ...
    model.fit(x_train, y_train, epochs=epochs, batch_size=32, verbose=0, callbacks=[recorder])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return accuracy, recorder, float(optimizer.loss_scale())


def save_plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib).")
        return
    names = next(iter(results.values()))[1].names
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6), sharex=True)
    styles = {"scale 1": ("tab:red", "--"), "dynamic": ("tab:blue", "-")}
    for column, name in enumerate(names):
        for run, (accuracy, recorder, _) in results.items():
            color, line = styles[run]
            label = f"{run} (test acc {accuracy:.2f})"
            steps = np.arange(1, len(recorder.headroom[name]) + 1)
            axes[0, column].plot(steps, recorder.headroom[name], line, color=color, label=label)
            axes[1, column].plot(steps, recorder.subnormal[name], line, color=color, label=label)
        axes[0, column].set_title(name.split("/", 1)[-1])
        axes[0, column].axhline(0.0, color="black", linewidth=0.8)
        axes[1, column].set_xlabel("training step")
    axes[0, 0].set_ylabel("headroom below 65504 (bits)")
    axes[1, 0].set_ylabel("subnormal fraction")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Scaled gradients in float16's range: a scale too low vs the dynamic scale")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"saved plot: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--plot", default="diagnose_scale.png", help="PNG path ('' to skip)")
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")
    x_train, x_test, y_train, y_test = data()
    results = {}
    for run, make_scale in RUNS.items():
        results[run] = train(make_scale(), args.epochs, x_train, x_test, y_train, y_test)
        accuracy, recorder, scale = results[run]
        print(f"{run}: test accuracy {accuracy:.3f}, final loss scale {scale:g}")
        for name in recorder.names:
            # The second half of training, once the dynamic scale has settled.
            half = len(recorder.headroom[name]) // 2
            headroom = np.median(recorder.headroom[name][half:])
            subnormal = np.median(recorder.subnormal[name][half:])
            print(
                f"  {run} {name}: median headroom {headroom:.1f} bits, "
                f"median subnormal fraction {subnormal:.3f}"
            )
    if args.plot:
        save_plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
