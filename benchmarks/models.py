"""The models of the boundaries and fit families, and their synthetic data.

Every builder sets the seed first: the same weights for every variant. The
logits are float32 (under mixed_float16 the loss is computed in float32).
"""

import keras
import numpy as np

CLASSES = 10


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="uniform")

    def call(self, x):
        return x + self.positions  # read in the compute dtype (Keras autocasts)


def mlp(depth, width, features=None, classes=CLASSES, activation="relu", **_):
    """Sequential: `depth` Dense(width, activation) layers, then Dense(classes)."""
    layers = [keras.Input((features or width,))]
    layers += [keras.layers.Dense(width, activation=activation) for _ in range(depth)]
    layers += [keras.layers.Dense(classes), keras.layers.Activation("linear", dtype="float32")]
    return keras.Sequential(layers)


def rescnn(depth, width, image, **_):
    """Functional: a 3x3 convolution stem of `width` filters, `depth` residual blocks
    (conv-ReLU-conv, add, ReLU), global average pooling, Dense(CLASSES)."""
    inputs = keras.Input((image, image, 3))
    x = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    for _ in range(depth):
        h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        h = keras.layers.Conv2D(width, 3, padding="same")(h)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, h]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    logits = keras.layers.Activation("linear", dtype="float32")(keras.layers.Dense(CLASSES)(x))
    return keras.Model(inputs, logits)


def embedding(rows, width, tokens, hidden, depth, **_):
    """`tokens` ids into an Embedding(rows, width) (a sparse gradient), mean pooling,
    `depth` Dense(hidden, ReLU), Dense(CLASSES)."""
    ids = keras.Input((tokens,), dtype="int32")
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(rows, width)(ids))
    for _ in range(depth):
        x = keras.layers.Dense(hidden, activation="relu")(x)
    logits = keras.layers.Dense(CLASSES, dtype="float32")(x)
    return keras.Model(ids, logits)


def transformer(vocab, seq_len, dim, heads, ffn, blocks, **_):
    """Embedding + positions, `blocks` x [MultiHeadAttention, add, LayerNormalization,
    FFN, add, LayerNormalization], mean pooling, Dense(CLASSES)."""
    tokens = keras.Input((seq_len,), dtype="int32")
    x = PositionEmbedding()(keras.layers.Embedding(vocab, dim)(tokens))
    for _ in range(blocks):
        attended = keras.layers.MultiHeadAttention(heads, dim // heads)(x, x)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(keras.layers.Add()([x, attended]))
        hidden = keras.layers.Dense(ffn, activation="relu")(x)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(
            keras.layers.Add()([x, keras.layers.Dense(dim)(hidden)]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(CLASSES, dtype="float32")(x))


BUILDERS = {"mlp": mlp, "rescnn": rescnn, "embedding": embedding, "transformer": transformer}


def build(params, seed=0):
    """The model `params["model"]` names, under the current dtype policy."""
    keras.utils.set_random_seed(seed)
    return BUILDERS[params["model"]](**params)


def batch(params, batches=1, seed=0):
    """`batches` random batches as numpy (inputs, int32 labels).

    Features: a random linear teacher's labels (learnable). Tokens: label =
    whether the sequence's mean id is below the vocabulary's middle.
    """
    rng = np.random.default_rng(seed)
    n = batches * params["batch"]
    kind = params["model"]
    if kind in ("embedding", "transformer"):
        rows = params.get("rows") or params["vocab"]
        x = rng.integers(0, rows, (n, params.get("tokens") or params["seq_len"]), np.int32)
        return x, (x.mean(axis=1) < rows / 2).astype(np.int32)
    shape = (params["image"],) * 2 + (3,) if kind == "rescnn" else (
        params.get("features") or params["width"],)
    x = rng.standard_normal((n,) + shape).astype(np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), params.get("classes", CLASSES)))
    return x, np.argmax(x.reshape(n, -1) @ teacher, axis=1).astype(np.int32)
