"""A trained damcha_torch encoder becomes an ONNX stack: the converted params
reproduce torch's output in the NumPy stack reference and in onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import damcha_core as dc
import damcha_onnx as do
import damcha_torch as dt


def _encoder(share: bool, **kw) -> dt.DamchaTransformerEncoder:
    torch.manual_seed(0)
    options = dict(
        dim_feedforward=32,
        dropout=0.0,
        activation="gelu",
        norm_first=True,
        final_norm=True,
        share_metric=share,
        dtype=torch.float64,
    )
    options.update(kw)
    enc = dt.build_encoder(16, 4, 2, **options).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "gate" in name:
                p.uniform_(0.3, 1.0)  # open gates: the metric is really exported
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # non-trivial norm affine params
    return enc


ARCHITECTURES = {
    "pre-norm-gelu-final": {},
    "post-norm-relu": dict(norm_first=False, activation="relu", final_norm=False),  # build_encoder's defaults
    "pre-norm-gelu-tanh": dict(activation=torch.nn.GELU(approximate="tanh"), final_norm=False),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-layer"])
def test_torch_encoder_converts_to_onnx_stack(share, arch):
    enc = _encoder(share, **ARCHITECTURES[arch])
    params, config = do.encoder_from_torch(enc)
    assert config.share_metric == share and config.num_layers == 2 and config.ffn_dim == 32
    assert (config.norm_first, config.final_norm) == (enc.layers[0].norm_first, enc.norm is not None)
    assert any(k.startswith("shared.") for k in params) == share
    x = np.random.default_rng(0).normal(size=(2, 5, 16))
    with torch.no_grad():
        expected = enc(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(do.encoder_forward(params, config, x), expected, rtol=1e-10, atol=1e-10)
    model = do.export_encoder(params, config, None)
    got = do.run_ort(model, {"query": x.astype(np.float32)})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_causal_flag_is_carried_into_the_export():
    enc = _encoder(True)
    params, config = do.encoder_from_torch(enc, causal=True)
    x = np.random.default_rng(1).normal(size=(1, 6, 16))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    with torch.no_grad():
        expected = enc(torch.from_numpy(x), mask=mask, is_causal=True).numpy()
    np.testing.assert_allclose(do.encoder_forward(params, config, x), expected, rtol=1e-10, atol=1e-10)


def _mixed_eps() -> dt.DamchaTransformerEncoder:
    enc = _encoder(True)
    enc.layers[1].norm2.eps = 1e-3
    return enc


def _mixed_norm_placement() -> dt.DamchaTransformerEncoder:
    enc = _encoder(True)
    enc.layers[1].norm_first = False
    return enc


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: _encoder(True, activation=torch.nn.functional.silu), r"ReLU or GELU \(layer 0 has activation=silu\)"),
        (_mixed_eps, r"one LayerNorm epsilon \(layer 1 differs\)"),
        (_mixed_norm_placement, r"one activation and norm placement \(layer 1 differs\)"),
    ],
    ids=["silu", "mixed-eps", "mixed-norm-placement"],
)
def test_other_architectures_are_rejected_clearly(make, pattern):
    with pytest.raises(dc.DamchaValueError, match=pattern + r".*Received: encoder="):
        do.encoder_from_torch(make())
    with pytest.raises(dc.DamchaTypeError, match="DamchaTransformerEncoder"):
        do.encoder_from_torch(torch.nn.Linear(2, 2))
