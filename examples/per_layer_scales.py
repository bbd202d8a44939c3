"""Per-layer loss scales: a deep float16 network whose early gradients one global scale loses.

An 8-block MLP (tanh) learns digits (scikit-learn's 8x8 digits). Each block
ends in a `GradientAttenuation` layer: the forward value passes unchanged,
the gradient is multiplied by 2**-6 on its way down, a controlled stand-in
for vanishing gradients (sigmoid and tanh stacks without normalization do
this by a varying, data-dependent factor). The first block's gradient is
then about 2**-42 of the head's: no single float16 scale holds both. The
optimizer is Lion, whose update is the sign of its momentum: every nonzero
gradient counts fully, however small, so a gradient float16 rounds to zero
is a lost update. Three runs, same seed:

* "float32": the reference;
* "global": ``mixed_float16`` with tfdls' global dynamic loss scale: the
  scale is set by the head, and the first blocks' scaled gradients are zero;
* "per-layer": the same, with `tfdls.add_scale_boundaries`: a
  `tfdls.ScaleBoundary` in every block, whose factors the optimizer adapts.

It prints the test accuracy, the final loss and, per layer kernel, the mean
zero-plus-subnormal fraction of the scaled gradient over training, and saves
a PNG of those fractions and the three loss curves.

    python examples/per_layer_scales.py [--epochs 6] [--plot per_layer_scales.png]

``--model sigmoid`` runs the plain case instead: 14 Dense layers of 64
sigmoid units (vanishing gradients, no attenuation layers) with Adam and a
boundary every two layers; there, float32 itself stays at chance level.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdls  # noqa: E402

BLOCKS = 8
WIDTH = 64
ATTENUATION = 2.0**-6
RUNS = ("float32", "global", "per-layer")


class GradientAttenuation(keras.layers.Layer):
    """Identity forward; the gradient is multiplied by `factor` backward."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor + tf.stop_gradient(x) * (1.0 - self.factor)

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def build_model(kind="attenuated"):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((64,))]
    if kind == "sigmoid":
        layers += [keras.layers.Dense(WIDTH, activation="sigmoid", name=f"dense_{i}")
                   for i in range(13)]
        layers.append(keras.layers.Dense(10, name="dense_13"))
        layers.append(keras.layers.Activation("softmax", dtype="float32", name="softmax"))
        return keras.Sequential(layers, name="sigmoid_mlp")
    for i in range(BLOCKS - 1):
        layers.append(keras.layers.Dense(WIDTH, activation="tanh", name=f"dense_{i}"))
        layers.append(GradientAttenuation(ATTENUATION, name=f"attenuation_{i}"))
    layers.append(keras.layers.Dense(10, name=f"dense_{BLOCKS - 1}"))
    layers.append(keras.layers.Activation("softmax", dtype="float32", name="softmax"))
    return keras.Sequential(layers, name="attenuated_mlp")


class Recorder(keras.callbacks.Callback):
    """Per batch: the loss, and each kernel's zero + subnormal fraction (host reads)."""

    def __init__(self, kernels):
        super().__init__()
        self.kernels = kernels
        self.losses = []
        self.small = {name: [] for name in kernels}
        self.zero = {name: [] for name in kernels}

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        optimizer = self.model.optimizer
        if not isinstance(optimizer, tfdls.LossScaleOptimizer):
            return
        stats = optimizer.gradient_stats()
        for name in self.kernels:
            s = stats[name]
            if not np.isnan(s.zero_fraction):
                self.small[name].append(s.zero_fraction + s.subnormal_fraction)
                self.zero[name].append(s.zero_fraction)


def train(run, epochs, kind, x_train, x_test, y_train, y_test):
    policy = "float32" if run == "float32" else "mixed_float16"
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = build_model(kind)
        if run == "per-layer":
            model = tfdls.add_scale_boundaries(model, every=2 if kind == "sigmoid" else 1)
        if kind == "sigmoid":
            inner = keras.optimizers.Adam(1e-3)
        else:
            inner = keras.optimizers.Lion(3e-4)
        if run == "float32":
            optimizer = inner
        else:
            optimizer = tfdls.LossScaleOptimizer(
                inner, gradient_stats=True,
                scale_boundaries=model if run == "per-layer" else None,
            )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        kernels = [v.path for v in model.trainable_variables if v.path.endswith("kernel")]
        recorder = Recorder(kernels)
        model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0,
                  callbacks=[recorder])
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        factors = optimizer.scale_boundary_factors() if run == "per-layer" else {}
        return accuracy, recorder, factors
    finally:
        keras.mixed_precision.set_global_policy("float32")


def smooth(values, width=20):
    values = np.asarray(values)
    if len(values) < width:
        return values
    return np.convolve(values, np.ones(width) / width, mode="valid")


# One colour per run in both panels; float32 dashed and drawn on top, so that the
# per-layer curve, which follows it closely, does not hide it.
STYLE = {
    "float32": {"color": "tab:green", "linestyle": "--", "zorder": 3},
    "global": {"color": "tab:blue"},
    "per-layer": {"color": "tab:orange"},
}


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib).")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in ("global", "per-layer"):
        recorder = results[run][1]
        fractions = [np.mean(recorder.small[name]) for name in recorder.kernels]
        left.plot(range(len(fractions)), fractions, marker="o", label=run, **STYLE[run])
    left.set_xlabel("layer (0 = first)")
    left.set_ylabel("zero + subnormal fraction of the scaled gradient")
    left.set_title("Gradient elements float16 loses, mean over training")
    left.legend()
    for run in RUNS:
        right.plot(smooth(results[run][1].losses), label=run, **STYLE[run])
    right.set_xlabel("batch")
    right.set_ylabel("training loss (moving average of 20)")
    right.set_title("Loss curves")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--plot", default="per_layer_scales.png")
    parser.add_argument("--model", choices=("attenuated", "sigmoid"), default="attenuated")
    args = parser.parse_args()
    split = data()
    results = {run: train(run, args.epochs, args.model, *split) for run in RUNS}
    for run in RUNS:
        accuracy, recorder, factors = results[run]
        line = f"{run:>9}: test accuracy {accuracy:.3f}, final loss {np.mean(recorder.losses[-20:]):.4f}"
        if run != "float32":
            first = recorder.kernels[0]
            line += f", first kernel's zero+subnormal fraction {np.mean(recorder.small[first]):.3f}"
        print(line)
    factors = {name: int(f) for name, f in results["per-layer"][2].items()}
    print("per-layer boundary factors at the end:", factors)
    print("per kernel, mean over training, global -> per-layer: zero+subnormal fraction "
          "(of which exactly zero)")
    for name in results["global"][1].kernels:
        g, p = results["global"][1], results["per-layer"][1]
        print(f"  {name.split('/')[-2]:>9}: {np.mean(g.small[name]):.3f} ({np.mean(g.zero[name]):.3f})"
              f" -> {np.mean(p.small[name]):.3f} ({np.mean(p.zero[name]):.3f})")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
