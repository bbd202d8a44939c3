"""Custom training loops with tfdls, in both API styles.

Trains two small MLPs on scikit-learn's bundled digits data (no download)
under the ``mixed_float16`` policy, each with its own
`tfdls.LossScaleOptimizer` and a `tf.function` training step:

* Keras 3 style: ``opt.scale_loss(loss)`` before differentiating, then
  ``opt.apply_gradients(...)``, which unscales, checks for NaN/Inf and
  applies (or skips the step);
* tf_keras / TensorFlow 2.4 style: ``opt.get_scaled_loss(loss)``,
  ``opt.get_unscaled_gradients(grads)``, then ``opt.apply_gradients(...)``
  (which knows the gradients are already unscaled).

Prints the mean loss per epoch (going down) and the final loss scale; the
two styles do the same arithmetic, so their losses match.

    python examples/custom_training_loop.py [--epochs 4]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfdls  # noqa: E402


def make_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
            # Keep the last activation (and so the loss) in float32.
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def make_dataset(batch_size=64):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(batch_size)


loss_fn = keras.losses.SparseCategoricalCrossentropy()


def keras3_step_fn(model, opt):
    """Keras 3 style: scale_loss + apply_gradients (unscaling happens inside)."""

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = opt.scale_loss(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def tf24_step_fn(model, opt):
    """tf_keras / TF 2.4 style: get_scaled_loss, get_unscaled_gradients, apply_gradients."""

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = opt.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = opt.get_unscaled_gradients(scaled_grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def train(name, step_fn, epochs):
    keras.utils.set_random_seed(0)
    model = make_model()
    opt = tfdls.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        loss_scale=tfdls.DynamicLossScale(initial_loss_scale=2.0**15, increment_period=50),
    )
    train_step = step_fn(model, opt)
    losses = []
    for epoch in range(epochs):
        batch_losses = [float(train_step(x, y)) for x, y in make_dataset()]
        losses.append(float(np.mean(batch_losses)))
        print(f"[{name}] epoch {epoch + 1}: loss {losses[-1]:.4f}")
    print(
        f"[{name}] final loss scale: {float(opt.loss_scale()):g}, "
        f"skipped steps: {int(opt.loss_scale.num_skipped_steps)}, "
        f"applied steps: {int(opt.iterations.numpy())}"
    )
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy("mixed_float16")
    results = {
        "keras3": train("keras3", keras3_step_fn, args.epochs),
        "tf24": train("tf24", tf24_step_fn, args.epochs),
    }
    keras.mixed_precision.set_global_policy("float32")
    same = np.allclose(results["keras3"], results["tf24"], rtol=1e-3)
    print(f"both styles trained identically: {same}")
    return results


if __name__ == "__main__":
    main()
