"""A small functional-API text classifier with DAMCHA, fitted, exported to a
TensorFlow SavedModel and reloaded for inference.

Run (TensorFlow backend, the one `model.export` targets here):

    KERAS_BACKEND=tensorflow .venv/bin/python examples/keras_text_classifier.py

The task is synthetic: a sequence is positive when it holds more 1 tokens
than 2 tokens. Two encoder blocks share one metric generator (stack-wise sharing);
padding (token 0) is masked automatically through Embedding(mask_zero=True).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np

from damcha_keras import MetricGenerator, TransformerEncoder

VOCAB, LENGTH, HIDDEN, HEADS = 12, 16, 32, 4


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, size=(n, LENGTH))
    labels = rng.integers(0, 2, size=n)
    for i in range(n):
        length = rng.integers(6, LENGTH + 1)
        many, few = (1, 2) if labels[i] else (2, 1)
        slots = rng.choice(length, size=5, replace=False)
        tokens[i, slots[:3]], tokens[i, slots[3:]] = many, few
        tokens[i, length:] = 0  # padding
    return tokens.astype("int32"), labels.astype("float32")


def build_model() -> keras.Model:
    generator = MetricGenerator(HEADS, name="shared_metric")
    inputs = keras.Input((LENGTH,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, HIDDEN, mask_zero=True)(inputs)
    h = h + keras.layers.Embedding(LENGTH, HIDDEN)(keras.ops.arange(LENGTH))
    for i in range(2):
        h = TransformerEncoder(2 * HIDDEN, HEADS, metric_generator=generator, name=f"encoder_{i}")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    return keras.Model(inputs, outputs)


def main(epochs: int = 8, export_dir: str | None = None, samples: int = 2048) -> float:
    keras.utils.set_random_seed(0)
    x, y = make_data(samples, seed=0)
    x_test, y_test = make_data(256, seed=1)
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=epochs, batch_size=64, verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy: {accuracy:.3f}")

    export_dir = export_dir or os.path.join(tempfile.mkdtemp(), "damcha_classifier")
    # verbose=False: Keras would print the endpoint and a TensorSpec line per captured variable.
    model.export(export_dir, format="tf_saved_model", verbose=False)
    reloaded = keras.layers.TFSMLayer(export_dir, call_endpoint="serve")
    expected = keras.ops.convert_to_numpy(model(x_test[:8]))
    served = keras.ops.convert_to_numpy(reloaded(x_test[:8]))
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    print(f"SavedModel at {export_dir} reloaded; predictions match: {served[:4, 0].round(3)}")
    return float(accuracy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--export-dir", default=None)
    args = parser.parse_args()
    main(args.epochs, args.export_dir)
