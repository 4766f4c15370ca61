"""``DamchaAttention.from_mha`` copies the MHA's weights, never shares them.

On the JAX backend a jitted train step (``model.fit``) donates its variables'
buffers; weights shared between the MHA and the converted layer would be
deleted under the layer that was not trained ("Array has been deleted").
Keras fixes its backend at import, so the check runs as a script in a
subprocess with ``KERAS_BACKEND=jax`` (as tests/test_keras_backends.py does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_from_mha_does_not_share_buffers_on_jax():
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax"
    assert result["damcha_trained"] and result["mha_trained"], result
    assert result["mha_unchanged_after_damcha_fit"], result
    assert result["damcha_unchanged_after_mha_fit"], result


def _fit_one_step(keras, np, layer, x):
    """Train ``layer`` (self-attention on ``x``) one step with ``model.fit``;
    return whether its weights moved."""
    inputs = keras.Input(x.shape[1:])
    model = keras.Model(inputs, layer(inputs, inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [np.array(keras.ops.convert_to_numpy(v.value)) for v in layer.trainable_variables]
    model.fit(x, np.zeros_like(x), epochs=1, batch_size=len(x), verbose=0)
    after = [keras.ops.convert_to_numpy(v.value) for v in layer.trainable_variables]
    return any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def main() -> None:
    import keras
    import numpy as np

    from damcha_keras import DamchaAttention

    x = np.random.default_rng(0).normal(size=(4, 5, 8)).astype("float32")
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, seed=0)
    y_mha = keras.ops.convert_to_numpy(mha(x, x))
    damcha = DamchaAttention.from_mha(mha)
    result = {"backend": keras.backend.backend()}
    result["damcha_trained"] = _fit_one_step(keras, np, damcha, x)
    result["mha_unchanged_after_damcha_fit"] = bool(np.array_equal(keras.ops.convert_to_numpy(mha(x, x)), y_mha))
    y_damcha = keras.ops.convert_to_numpy(damcha(x, x))
    result["mha_trained"] = _fit_one_step(keras, np, mha, x)
    result["damcha_unchanged_after_mha_fit"] = bool(np.array_equal(keras.ops.convert_to_numpy(damcha(x, x)), y_damcha))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
