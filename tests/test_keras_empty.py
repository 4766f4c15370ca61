"""Empty shapes in the Keras port (current backend, tensorflow by default), as
keras.layers.MultiHeadAttention takes them: an empty batch (B = 0) or no
query (N = 0, also self-attention's N = M = 0) gives the empty output and
scores, empty input gradients and zero variable gradients (Keras's MHA, run
side by side); queries over no key (M = 0, N >= 1) are refused naming the
argument that holds the keys."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import damcha_core as dc
from damcha_conformance import case_params
from damcha_keras import DamchaAttention, TransformerDecoder, TransformerEncoder

E, H, D, E_KV = 8, 2, 4, 6

# (B, N, M) with M None for self-attention.
SHAPES = {
    "B0-self": (0, 4, None),
    "B0-cross": (0, 3, 5),
    "N0-cross": (2, 0, 5),
    "N0-self": (2, 0, None),
    "B0-N0-cross": (0, 0, 5),
}


def _inputs(B, N, M):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, N, E))
    return x, x if M is None else rng.normal(size=(B, M, E_KV))


def _built(layer, cross: bool):
    layer(np.ones((1, 3, E)), np.ones((1, 5, E_KV if cross else E)))
    return layer


def _gradients(layer, x, c):
    """d sum(layer(x, c)) / d (x, every trainable variable), on TensorFlow."""
    import tensorflow as tf

    xt, ct = tf.constant(x), tf.constant(c)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = tf.reduce_sum(layer(xt, ct))
    grads = tape.gradient(loss, [xt, *layer.trainable_variables])
    return grads[0], grads[1:]


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_layer_matches_keras_mha_on_empty_shapes(shape) -> None:
    B, N, M = shape
    cross = M is not None
    ours = _built(DamchaAttention(num_heads=H, key_dim=D, dtype="float64"), cross)
    mha = _built(keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, dtype="float64"), cross)
    x, c = _inputs(B, N, M)
    y, scores = ours(x, c, return_attention_scores=True)
    K = N if M is None else M
    assert tuple(y.shape) == (B, N, E)
    assert tuple(scores.shape) == (B, H, N, K)
    assert (
        tuple(y.shape) == dc.damcha_attention(dc.init_params(ours.config), ours.config, x, c if cross else None).shape
    )
    if (B, N) == (0, 0) and keras.backend.backend() == "tensorflow":
        # Keras's own MHA fails here on TensorFlow (its einsum of an empty batch of no query);
        # this layer's output is checked against the reference's shape above.
        assert keras.backend.standardize_dtype(y.dtype) == "float64"
        return
    y_ref, scores_ref = mha(x, c, return_attention_scores=True)
    assert (tuple(y.shape), y.dtype) == (tuple(y_ref.shape), y_ref.dtype)
    assert tuple(scores.shape) == tuple(scores_ref.shape)
    if keras.backend.backend() != "tensorflow":
        return
    g_x, g_vars = _gradients(ours, x, c)
    g_x_ref, g_vars_ref = _gradients(mha, x, c)
    assert tuple(g_x.shape) == tuple(g_x_ref.shape) == x.shape
    # Every variable's gradient is zeros, as every MHA variable's.
    assert all(g is not None and not np.any(g) for g in g_vars_ref)
    assert all(g is not None and not np.any(g) for g in g_vars)


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_layer_masks_causal_and_penalty_on_empty_shapes(shape) -> None:
    B, N, M = shape
    cross = M is not None
    ours = _built(DamchaAttention(num_heads=H, key_dim=D, metric_l2=0.5, dtype="float64"), cross)
    config = ours._built_config
    ours.load_canonical(case_params(config, 0))  # open gates, non-zero generators: a penalty to compute
    x, c = _inputs(B, N, M)
    K = N if M is None else M
    for kw in (dict(attention_mask=np.ones((B, N, K), bool)), dict(use_causal_mask=True), dict(training=True)):
        assert tuple(ours(x, c, **kw).shape) == (B, N, E)
    # The metric penalty is the reference's (x metric_l2): over no token 0, not NaN; with context
    # tokens and no query (N0-cross) the key side's (the check skipped that case, and the layer's
    # zero-initialised generators made every penalty 0 anyway).
    want = 0.5 * dc.metric_penalty(ours.to_canonical(), config, x, c if cross else None)
    assert float(keras.ops.convert_to_numpy(ours.losses[-1])) == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert (want > 0) == (B != 0 and cross and M != 0)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["B0", "N0"])
def test_blocks_on_empty_shapes(shape) -> None:
    x = np.zeros((*shape, E), "float32")
    for block in (
        TransformerEncoder(intermediate_dim=16, num_heads=H),
        TransformerDecoder(intermediate_dim=16, num_heads=H),
    ):
        y = block(x, np.ones(shape, bool))
        assert tuple(y.shape) == x.shape


@pytest.mark.parametrize("B", [0, 2], ids=["B0", "B2"])
def test_cache_with_an_empty_batch_or_step(B) -> None:
    """``init_cache(batch_size=0)`` is an empty cache and a step of no token
    appends nothing: the steps equal one causal pass of the reference."""
    attn = DamchaAttention(num_heads=H, key_dim=D, dtype="float64")
    attn.build((1, 1, E), (1, 1, E))
    x = np.random.default_rng(5).normal(size=(B, 4, E))
    want = dc.damcha_attention(attn.to_canonical(), attn.config, x, causal=True)
    cache = attn.init_cache(batch_size=B, max_length=4)
    for a, b in [(0, 2), (2, 2), (2, 4)]:
        t = x[:, a:b]
        y, cache = attn(t, t, use_causal_mask=True, cache=cache, cache_update_index=a)
        assert tuple(y.shape) == (B, b - a, E)
        got = keras.ops.convert_to_numpy(y)
        tol = 1e-9 if got.dtype == np.float64 else 1e-5  # JAX without x64 computes in float32
        np.testing.assert_allclose(got, want[:, a:b], rtol=tol, atol=tol)


def test_queries_over_no_key_are_refused_naming_the_argument() -> None:
    ours = _built(DamchaAttention(num_heads=H, key_dim=D), True)
    x = np.ones((2, 3, E), "float32")
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `value`: expected at least one key \(M >= 1\).*value.shape=\(2, 0, 6\)",
    ):
        ours(x, np.ones((2, 0, E_KV), "float32"))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `key`: expected at least one key \(M >= 1\).*key.shape=\(0, 0, 6\)",
    ):
        ours(x[:0], np.ones((0, 0, E_KV), "float32"), np.ones((0, 0, E_KV), "float32"))
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `query`: expected 8 features.*query.shape=\(0, 3, 7\)"
    ):
        ours(np.ones((0, 3, 7), "float32"), np.ones((0, 5, E_KV), "float32"))
