"""Trained Keras and JAX encoder stacks become ONNX stacks: the converted params
reproduce each framework's own output in the NumPy stack reference and in
onnxruntime (the torch converter has its own file)."""

from __future__ import annotations

import numpy as np
import pytest

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import TOLERANCES

F32 = TOLERANCES["float32"]


def _check(params, config, x, expected, causal_mask=None):
    """NumPy stack reference and onnxruntime (opsets 17 and 23) against the framework's output."""
    _, ratio = F32.output_ratio(do.encoder_forward(params, config, x), expected)
    assert ratio <= 1, ratio
    for opset in (17, 23):
        got = do.run_ort(do.export_encoder(params, config, None, opset=opset), {"query": x})
        _, ratio = F32.output_ratio(got, expected)
        assert ratio <= 1, (opset, ratio)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize(
    "normalize_first, activation, final_norm",
    [(False, "relu", False), (True, "gelu", False), (True, "gelu_tanh", True)],
    ids=["post-norm-relu", "pre-norm-gelu", "pre-norm-gelu_tanh-final-norm"],
)
@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-block"])
def test_keras_blocks_convert(kind, normalize_first, activation, share, final_norm):
    import warnings

    import keras

    import damcha_keras as dk

    rng = np.random.default_rng(0)
    block = dk.TransformerEncoder if kind == "encoder" else dk.TransformerDecoder
    gen = dk.MetricGenerator(2) if share else None
    act = dk.gelu_tanh if activation == "gelu_tanh" else activation
    blocks = [
        block(16, 2, normalize_first=normalize_first, activation=act, metric_generator=gen, seed=i) for i in range(2)
    ]
    if final_norm:
        blocks.append(keras.layers.LayerNormalization(epsilon=1e-5))
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    h = x
    for b in blocks:
        h = b(h)  # builds them
    for b in blocks[:2]:  # open the gates and move the norms off identity: everything is exported
        b._attention._gates["qk"].assign(rng.uniform(0.3, 1.0, size=2))
        b._attention_norm.gamma.assign(1 + 0.1 * rng.normal(size=8))
    if final_norm:
        blocks[-1].gamma.assign(1 + 0.1 * rng.normal(size=8))
    h = x
    for b in blocks:
        h = b(h)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, config = do.encoder_from_keras(blocks)
    # Only the blocks' public stack method: no deprecated damcha alias is reached
    # (TensorFlow's own NumPy-2 DeprecationWarning comes from site-packages).
    ours = [
        str(w.message)
        for w in caught
        if issubclass(w.category, DeprecationWarning) and "site-packages" not in w.filename
    ]
    assert not ours, ours
    own, own_config = dk.stack_to_canonical(blocks)
    assert own_config == config and own.keys() == params.keys()
    assert all(np.array_equal(own[k], params[k]) for k in own)
    assert (config.norm_first, config.activation, config.share_metric, config.final_norm) == (
        normalize_first,
        activation,
        share,
        final_norm,
    )
    assert config.causal == (kind == "decoder")
    _check(params, config, x, np.asarray(keras.ops.convert_to_numpy(h), dtype=np.float64))


def test_keras_converter_errors():
    import damcha_keras as dk

    built = dk.TransformerEncoder(16, 2)
    built(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `blocks`: expected a non-empty list"):
        do.encoder_from_keras(built)
    with pytest.raises(
        dc.DamchaTypeError,
        match=r"expected blocks of one kind, all TransformerEncoder or all TransformerDecoder.*Received: ",
    ):
        do.encoder_from_keras([built, dk.TransformerDecoder(16, 2)])
    with pytest.raises(dc.DamchaValueError, match=r"built blocks.*Received: blocks="):
        do.encoder_from_keras([built, dk.TransformerEncoder(16, 2)])
    silu = dk.TransformerEncoder(16, 2, activation="silu")
    silu(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(dc.DamchaValueError, match=r"activation relu, gelu or gelu_tanh \(block 0 has silu\)"):
        do.encoder_from_keras([silu])
    decoder = dk.TransformerDecoder(16, 2)
    decoder(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `causal`: expected True or None for TransformerDecoder blocks \(always causal\)\. Received: causal=False",
    ):
        do.encoder_from_keras([decoder], causal=False)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-block"])
def test_jax_encoder_converts(share):
    from flax import nnx

    import damcha_jax as dj

    rng = np.random.default_rng(1)
    enc = dj.DamchaEncoder(2, 8, 2, 16, share_metric=share, rngs=nnx.Rngs(0))
    for block in enc.layers:
        p = block.attention.to_canonical()
        p["metric.qk.gate"] = rng.uniform(0.3, 1.0, size=2)
        block.attention.load_canonical(p)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    expected = np.asarray(enc(x, is_causal=True), dtype=np.float64)
    params, config = do.encoder_from_jax(enc, causal=True)
    own, own_config = enc.to_canonical(causal=True)
    assert own_config == config and own.keys() == params.keys()
    assert all(np.array_equal(own[k], params[k]) for k in own)
    assert (config.activation, config.norm_eps, config.share_metric, config.final_norm) == (
        "gelu_tanh",
        1e-6,
        share,
        True,
    )
    _check(params, config, x, expected)
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `encoder`: expected a damcha_jax.DamchaEncoder"):
        do.encoder_from_jax(enc.layers[0])


def test_stack_format_options_change_the_function():
    """Each new EncoderConfig option is real: the NumPy reference and the graph both change with it."""
    base = do.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), num_layers=1, ffn_dim=16)
    params = do.init_encoder_params(base, 3)
    x = np.random.default_rng(2).normal(size=(1, 4, 8)).astype("float32")
    y0 = do.encoder_forward(params, base, x)
    import dataclasses

    for change in (
        dict(norm_first=False),
        dict(activation="relu"),
        dict(activation="gelu_tanh"),
        dict(final_norm=False),
    ):
        config = dataclasses.replace(base, **change)
        p = {k: v for k, v in params.items() if k in config.param_shapes()}
        y = do.encoder_forward(p, config, x)
        assert np.abs(y - y0).max() > 1e-4, change
        _, ratio = F32.output_ratio(do.run_ort(do.export_encoder(p, config, None), {"query": x}), y)
        assert ratio <= 1, change
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `activation`: expected one of \('gelu', 'gelu_tanh', 'relu'\)"
    ):
        dataclasses.replace(base, activation="silu")
