"""Empty shapes in the PyTorch port, as nn.MultiheadAttention takes them: an
empty batch (B = 0) or no query (N = 0, also self-attention's N = M = 0)
gives the empty output, weights of the empty shape, empty input gradients and
zero parameter gradients (nn.MultiheadAttention's, run side by side); queries
over no key (M = 0, N >= 1) are refused naming `key`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import damcha_core as dc
import damcha_torch as dt
from damcha_conformance import case_params

E, H, E_KV = 8, 2, 6

# (B, N, M) with M None for self-attention.
SHAPES = {"B0-self": (0, 4, None), "B0-cross": (0, 3, 5), "N0-cross": (2, 0, 5), "N0-self": (2, 0, None)}


def _pair(cross: bool, batch_first: bool = True) -> tuple[dt.DamchaAttention, nn.MultiheadAttention]:
    """A DAMCHA layer with open gates (loaded from the reference's params) and
    torch's MHA of the same sizes, both float64."""
    kw = dict(kdim=E_KV, vdim=E_KV) if cross else {}
    layer = dt.DamchaAttention(E, H, batch_first=batch_first, dtype=torch.float64, **kw)
    layer.load_canonical(case_params(layer.config, 0))
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=torch.float64, **kw)
    return layer, mha


def _inputs(B: int, N: int, M: int | None, seq_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(B, N, E, dtype=torch.float64, requires_grad=True)
    c = x if M is None else torch.randn(B, M, E_KV, dtype=torch.float64, requires_grad=True)
    if seq_first:
        x, c = x.detach().transpose(0, 1).requires_grad_(), c.detach().transpose(0, 1).requires_grad_()
    return x, c


def _run(module: nn.Module, x, c, **kw):
    module.zero_grad(set_to_none=True)
    for t in (x, c):
        t.grad = None
    y, w = module(x, c, c, **kw)
    y.sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y, w, x.grad, c.grad, grads


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_layer_matches_torch_mha_on_empty_shapes(shape, batch_first, need_weights) -> None:
    B, N, M = shape
    layer, mha = _pair(M is not None, batch_first)
    x, c = _inputs(B, N, M, seq_first=not batch_first)
    kw = dict(need_weights=need_weights, average_attn_weights=False)
    y, w, gx, gc, grads = _run(layer, x, c, **kw)
    y_ref, w_ref, gx_ref, gc_ref, grads_ref = _run(mha, x, c, **kw)
    assert (y.shape, y.dtype) == (y_ref.shape, y_ref.dtype)
    assert (w is None) == (w_ref is None) and (w is None or w.shape == w_ref.shape)
    assert gx.shape == gx_ref.shape == x.shape and gc.shape == gc_ref.shape == c.shape
    # Every parameter gets a gradient of zeros, as every MHA parameter does.
    assert all(g is not None and not g.any() for g in grads_ref.values())
    assert all(g is not None and not g.any() for g in grads.values()), [n for n, g in grads.items() if g is None]
    # The reference (the spec) gives the same empty output.
    x_bf, c_bf = (x, c) if batch_first else (x.transpose(0, 1), c.transpose(0, 1))
    want = dc.damcha_attention(
        case_params(layer.config, 0), layer.config, x_bf.detach().numpy(), None if M is None else c_bf.detach().numpy()
    )
    assert tuple(y.shape) == (want.shape if batch_first else (want.shape[1], want.shape[0], want.shape[2]))


MASKED = [
    (name, masks)
    for name, shape in SHAPES.items()
    for masks in ("key_padding_mask", "attn_mask", "float-key_padding_mask", "is_causal")
    if masks != "is_causal" or shape[2] is None  # a causal attn_mask is square: self-attention
]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("name, masks", MASKED, ids=[f"{n}-{m}" for n, m in MASKED])
def test_layer_with_masks_on_empty_shapes(name, masks, grad) -> None:
    """Masks of the empty shapes (a self-attention N = M = 0 mask has no key
    column: the empty-row pass used to index key 0 and reduce over no key)."""
    B, N, M = SHAPES[name]
    layer, mha = _pair(M is not None)
    layer.eval(), mha.eval()
    K = N if M is None else M
    x, c = _inputs(B, N, M)
    kw: dict = {}
    if masks == "key_padding_mask":
        kw["key_padding_mask"] = torch.zeros(B, K, dtype=torch.bool)
    elif masks == "float-key_padding_mask":
        kw["key_padding_mask"] = torch.zeros(B, K, dtype=torch.float64)
    elif masks == "attn_mask":
        kw["attn_mask"] = torch.zeros(N, K, dtype=torch.bool)
    else:
        kw.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64), is_causal=True)
    with torch.set_grad_enabled(grad):
        y, w = layer(x, c, c, **kw)
        y_ref, w_ref = mha(x, c, c, **kw)
    assert (y.shape, y.dtype) == (y_ref.shape, y_ref.dtype)
    # Weights averaged over the heads, (B, N, M). torch's eval fast path (no grad, self-attention)
    # returns None for them on an empty batch although need_weights=True; this layer returns
    # the empty weights in every mode.
    assert tuple(w.shape) == (B, N, K) and (w_ref is None or w_ref.shape == w.shape)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["B0", "N0"])
def test_blocks_on_empty_shapes(shape) -> None:
    """The encoder and decoder blocks (padding masks, the causal rule) pass the empty batch through.
    (torch's own nn.TransformerEncoder fails on them in training mode with a padding mask, in a
    reshape of its merged mask, so the expected shape is the input's.)"""
    B, N = shape
    enc = dt.build_encoder(E, H, 2, dim_feedforward=16, dropout=0.0, dtype=torch.float64)
    dec = dt.build_decoder(E, H, 1, dim_feedforward=16, dropout=0.0, dtype=torch.float64)
    x = torch.randn(B, N, E, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, 5, E, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    outs = [
        enc(x, src_key_padding_mask=pad),
        enc(x, mask=nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64), is_causal=True),
        dec(x, memory, tgt_key_padding_mask=pad),
    ]
    for y in outs:
        assert (y.shape, y.dtype) == (x.shape, x.dtype)
    sum(y.sum() for y in outs).backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_functional_matches_the_reference_on_empty_shapes(shape) -> None:
    B, N, M = shape
    config = dc.DamchaConfig(
        query_dim=E, num_heads=H, key_dim=4, context_dim=E if M is None else E_KV, coupling="separate"
    )
    params = case_params(config, 1)
    x = np.random.default_rng(0).normal(size=(B, N, E))
    c = None if M is None else np.random.default_rng(1).normal(size=(B, M, E_KV))
    tensors = {k: torch.tensor(v) for k, v in params.items()}
    y, w, maps = dt.damcha_attention(
        tensors,
        config,
        torch.tensor(x),
        None if c is None else torch.tensor(c),
        return_weights=True,
        return_metric=True,
    )
    y_ref, w_ref, maps_ref = dc.damcha_attention(params, config, x, c, return_weights=True, return_metric=True)
    assert (tuple(y.shape), tuple(w.shape)) == (y_ref.shape, w_ref.shape) and y.dtype == torch.float64
    for role in maps_ref:
        np.testing.assert_allclose(maps[role].numpy(), maps_ref[role], rtol=1e-12, atol=1e-12)
    # The penalty over no token is 0 (not NaN), as the reference's.
    got = float(dt.metric_penalty(tensors, config, torch.tensor(x), None if c is None else torch.tensor(c)))
    assert got == pytest.approx(dc.metric_penalty(params, config, x, c), rel=1e-12, abs=1e-15)


def test_tracked_penalty_of_an_empty_batch_is_zero() -> None:
    layer, _ = _pair(False)
    layer.track_metric_penalty = True
    x = torch.randn(0, 3, E, dtype=torch.float64)
    layer(x, x, x)
    assert float(dt.metric_penalty(layer).detach()) == 0.0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("B", [0, 2], ids=["B0", "B2"])
def test_kv_cache_with_an_empty_batch_or_step(B, grad) -> None:
    """A cache decodes an empty batch (every step's output empty) and an empty
    step appends nothing: the later steps equal one causal pass of the reference."""
    layer, _ = _pair(False)
    layer.eval()
    params = case_params(layer.config, 0)
    x = np.random.default_rng(4).normal(size=(B, 5, E))
    want = dc.damcha_attention(params, layer.config, x, causal=True)
    cache = dt.DamchaKVCache()
    steps = [(0, 2), (2, 2), (2, 3), (3, 3), (3, 5)]
    with torch.set_grad_enabled(grad):
        for a, b in steps:
            t = torch.tensor(x[:, a:b])
            y, _ = layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
            assert tuple(y.shape) == (B, b - a, E)
            np.testing.assert_allclose(y.detach().numpy(), want[:, a:b], rtol=1e-10, atol=1e-12)


def test_queries_over_no_key_are_refused_naming_key() -> None:
    layer, _ = _pair(True)
    for B in (2, 0):
        x, c = torch.randn(B, 3, E, dtype=torch.float64), torch.randn(B, 0, E_KV, dtype=torch.float64)
        with pytest.raises(
            dc.DamchaValueError,
            match=rf"^Invalid argument `key`: expected at least one key \(M >= 1\).*Received: key.shape=\({B}, 0, 6\)$",
        ):
            layer(x, c, c)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `query`: expected 8 features \(embed_dim\).*query.shape=\(0, 3, 7\)",
    ):
        layer(torch.randn(0, 3, 7, dtype=torch.float64), c, c)
