"""DamchaAttention with metric "none" or zero gates is nn.MultiheadAttention (and SDPA)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from damcha_torch import DamchaAttention, softmax_attend

B, N, M, E, H = 2, 5, 7, 16, 4


def _mask_kwargs(kind: str, n: int, m: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(3)
    if kind == "none":
        return {}
    if kind == "padding":
        kpm = torch.zeros(B, m, dtype=torch.bool)
        kpm[1, m - 2 :] = True  # True = ignore, torch's convention
        return {"key_padding_mask": kpm}
    if kind == "bool2d":
        am = torch.rand(n, m, generator=g) < 0.3
        am[:, 0] = False
        return {"attn_mask": am}
    if kind == "bool3d":
        am = torch.rand(B * H, n, m, generator=g) < 0.3
        am[..., 0] = False
        return {"attn_mask": am}
    if kind == "float2d":
        return {"attn_mask": torch.randn(n, m, generator=g, dtype=dtype)}
    if kind == "padding+float":
        kpm = torch.zeros(B, m, dtype=torch.bool)
        kpm[0, -1] = True
        return {"key_padding_mask": kpm, "attn_mask": torch.randn(n, m, generator=g, dtype=dtype)}
    raise AssertionError(kind)


def _causal_mask(n: int, m: int) -> torch.Tensor:
    return torch.ones(n, m, dtype=torch.bool).triu(1)  # True = masked out


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("mask", ["none", "padding", "bool2d", "bool3d", "float2d", "padding+float", "causal"])
@pytest.mark.parametrize("variant", ["zero-gates", "metric-none"])
# MHA itself warns when a bool key_padding_mask meets a float attn_mask.
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
def test_self_attention_equals_mha(variant, mask, batch_first, need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=torch.float64).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    layer = DamchaAttention.from_mha(mha, metric="heads" if variant == "zero-gates" else "none").eval()
    if variant == "zero-gates":
        assert torch.all(layer.metric_gates["qk"] == 0)
    x = torch.randn((B, N, E) if batch_first else (N, B, E), dtype=torch.float64)
    kwargs = _mask_kwargs("none" if mask == "causal" else mask, N, N, torch.float64)
    if mask == "causal":
        # MHA needs the mask itself; is_causal is only a hint there.
        kwargs = {"attn_mask": _causal_mask(N, N), "is_causal": True}
    expected, w_expected = mha(x, x, x, need_weights=need_weights, **kwargs)
    out, w = layer(x, x, x, need_weights=need_weights, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(w, w_expected, rtol=1e-10, atol=1e-12)
    else:
        assert w is None


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("mask", ["none", "padding", "bool3d"])
@pytest.mark.parametrize("coupling", ["separate", "query"])
def test_cross_attention_kdim_equals_mha(coupling, mask, batch_first, need_weights):
    torch.manual_seed(1)
    kdim = 12
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=batch_first, dtype=torch.float64).eval()
    layer = DamchaAttention.from_mha(mha, coupling=coupling).eval()
    q = torch.randn((B, N, E) if batch_first else (N, B, E), dtype=torch.float64)
    c = torch.randn((B, M, kdim) if batch_first else (M, B, kdim), dtype=torch.float64)
    kwargs = _mask_kwargs(mask, N, M, torch.float64)
    expected, w_expected = mha(q, c, c, need_weights=need_weights, average_attn_weights=False, **kwargs)
    out, w = layer(q, c, c, need_weights=need_weights, average_attn_weights=False, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(w, w_expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_functional_equals_sdpa(kv_heads, causal):
    """softmax_attend is SDPA on repeated kv heads (h -> h // (H/G)), fused or explicit."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, N, H, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, M, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, M, kv_heads, 6, generator=g, dtype=torch.float64)
    rep = H // kv_heads
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=causal,
    ).transpose(1, 2)
    for need_weights in (False, True):
        out, _ = softmax_attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, need_weights=need_weights
        )
        torch.testing.assert_close(out.transpose(1, 2), expected, rtol=1e-10, atol=1e-12)


def test_float32_fresh_layer_equals_mha_fused():
    """A fresh layer (gates 0) in float32 on the fused path: MHA to float32 rounding."""
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    x = torch.randn(B, N, E)
    kpm = torch.zeros(B, N, dtype=torch.bool)
    kpm[0, -2:] = True
    expected, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    out, _ = layer(x, x, x, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _unbatched_masks(kind: str, n: int, m: int) -> dict:
    g = torch.Generator().manual_seed(5)
    if kind == "none":
        return {}
    if kind == "padding":
        kpm = torch.zeros(m, dtype=torch.bool)
        kpm[-2:] = True
        return {"key_padding_mask": kpm}
    if kind in ("bool2d", "bool3d"):
        am = torch.rand(*((H,) if kind == "bool3d" else ()), n, m, generator=g) < 0.3
        am[..., 0] = False
        return {"attn_mask": am}
    if kind == "padding+float":
        kpm = torch.zeros(m, dtype=torch.bool)
        kpm[-1] = True
        return {"key_padding_mask": kpm, "attn_mask": torch.randn(n, m, generator=g, dtype=torch.float64)}
    raise AssertionError(kind)


@pytest.mark.parametrize("average", [True, False], ids=["avg-weights", "head-weights"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("mask", ["none", "padding", "bool2d", "bool3d", "padding+float"])
@pytest.mark.parametrize("attention", ["self", "cross-kdim"])
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
def test_unbatched_inputs_equal_mha(attention, mask, need_weights, average):
    """(N, E) inputs, (M,) padding and (H, N, M) masks, as nn.MultiheadAttention takes them."""
    torch.manual_seed(6)
    kdim = None if attention == "self" else 12
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, dtype=torch.float64).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    layer = DamchaAttention.from_mha(mha).eval()
    x = torch.randn(N, E, dtype=torch.float64)
    c = x if attention == "self" else torch.randn(M, 12, dtype=torch.float64)
    kwargs = _unbatched_masks(mask, N, c.shape[0])
    expected, w_expected = mha(x, c, c, need_weights=need_weights, average_attn_weights=average, **kwargs)
    out, w = layer(x, c, c, need_weights=need_weights, average_attn_weights=average, **kwargs)
    assert out.shape == (N, E)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    if need_weights:
        assert w.shape == w_expected.shape
        torch.testing.assert_close(w, w_expected, rtol=1e-10, atol=1e-12)
    else:
        assert w is None


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bool, torch.float32),
        (torch.float32, torch.bool),
        (torch.bool, torch.bool),
        (torch.float32, torch.float32),
    ],
    ids=["bool-pad+float-attn", "float-pad+bool-attn", "both-bool", "both-float"],
)
def test_mismatched_mask_dtypes_warn_as_mha_does(dtypes):
    """A bool mask beside a float one: MHA warns (a deprecation) and applies both; so does DAMCHA.

    The message starts as MHA's, so a filter written for MHA's warning silences ours too.
    """
    import warnings

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()  # zero gates: MHA's outputs
    x = torch.randn(B, N, E)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -2:] = True
    attn = torch.ones(N, N, dtype=torch.bool).triu(1)
    to = {torch.bool: lambda m: m, torch.float32: lambda m: torch.zeros(m.shape).masked_fill(m, float("-inf"))}
    kpm, am = to[dtypes[0]](pad), to[dtypes[1]](attn)
    outs, caught = {}, {}
    for name, module in (("mha", mha), ("damcha", layer)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            outs[name] = module(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)[0]
        caught[name] = [str(i.message) for i in w if "mismatched key_padding_mask" in str(i.message)]
    assert bool(caught["damcha"]) == bool(caught["mha"]) == (dtypes[0] != dtypes[1])
    if caught["damcha"]:
        assert f"key_padding_mask.dtype={dtypes[0]}, attn_mask.dtype={dtypes[1]}" in caught["damcha"][0]
    torch.testing.assert_close(outs["damcha"], outs["mha"], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        # A filter on MHA's whole message (warnings match from its start) silences ours too.
        warnings.filterwarnings("ignore", re.escape(caught["mha"][0]) if caught["mha"] else "Support for mismatched")
        layer(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)  # MHA's filter applies


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_unbatched_equals_batch_of_one_with_open_gates(batch_first):
    """With the map active, unbatched input is the batch-of-one call, gradients included."""
    torch.manual_seed(7)
    layer = DamchaAttention(E, H, batch_first=batch_first, dtype=torch.float64)
    with torch.no_grad():
        layer.metric_gates["qk"].normal_()
    x = torch.randn(N, E, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([False] * (N - 1) + [True])
    out, w = layer(x, x, x, key_padding_mask=kpm, is_causal=True, average_attn_weights=False)
    xb = x.unsqueeze(0 if batch_first else 1)
    ref, w_ref = layer(xb, xb, xb, key_padding_mask=kpm[None], is_causal=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref.squeeze(0 if batch_first else 1), rtol=0, atol=0)
    torch.testing.assert_close(w, w_ref.squeeze(0), rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    penalty = layer.metric_penalty(x)
    torch.testing.assert_close(penalty, layer.metric_penalty(xb), rtol=0, atol=0)
    assert penalty > 0


def test_unbatched_encoder_layer_equals_torch():
    """nn.TransformerEncoderLayer takes (N, E); the DAMCHA layer (gates 0) agrees."""
    from damcha_torch import DamchaTransformerEncoderLayer

    torch.manual_seed(8)
    ours = DamchaTransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, dtype=torch.float64).eval()
    ref = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, dtype=torch.float64).eval()
    ref.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("self_attn.metric_")})
    x = torch.randn(N, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64)
    torch.testing.assert_close(
        ours(x, src_mask=mask, is_causal=True), ref(x, src_mask=mask, is_causal=True), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("dims", [(12, 8), (16, 8), (12, 16)], ids=["kdim12-vdim8", "kdim16-vdim8", "kdim12-vdim16"])
def test_key_and_value_of_different_sizes_equal_mha(dims, need_weights):
    """kdim != vdim (DECISIONS 8): keys and values from inputs of their own sizes,
    from_mha a copy, coupling chosen automatically (separate: E_kv != E_q or inputs differ)."""
    torch.manual_seed(9)
    kdim, vdim = dims
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    layer = DamchaAttention.from_mha(mha).eval()
    assert (layer.kdim, layer.vdim) == (kdim, vdim) and layer.in_proj_weight is None
    q = torch.randn(B, N, E, dtype=torch.float64)
    k, v = torch.randn(B, M, kdim, dtype=torch.float64), torch.randn(B, M, vdim, dtype=torch.float64)
    kpm = torch.zeros(B, M, dtype=torch.bool)
    kpm[1, -3:] = True
    expected, w_expected = mha(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    out, w = layer(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(w, w_expected, rtol=1e-10, atol=1e-12)


def test_plain_constructor_with_other_sizes_picks_its_coupling():
    """coupling=None (the default) is automatic: kdim != embed_dim or GQA give
    'separate' (they raised before), MHA-shaped layers 'tied'."""
    assert DamchaAttention(E, H).config.coupling == "tied"
    assert DamchaAttention(E, H, kdim=12, vdim=12).config.coupling == "separate"
    assert DamchaAttention(E, H, num_kv_heads=2).config.coupling == "separate"
    layer = DamchaAttention(E, H, kdim=12, vdim=6, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.fill_(0.5)
    q, k, v = (torch.randn(B, M, n, dtype=torch.float64) for n in (E, 12, 6))
    out, _ = layer(q, k, v, need_weights=False)
    import damcha_core as dc

    want = dc.damcha_attention(layer.to_canonical(), layer.config, q.numpy(), k.numpy(), value=v.numpy())
    torch.testing.assert_close(out, torch.from_numpy(want), rtol=1e-10, atol=1e-12)


EXTRA_KEYS = {
    "bias-kv": dict(add_bias_kv=True),
    "zero-attn": dict(add_zero_attn=True),
    "both": dict(add_bias_kv=True, add_zero_attn=True),
}


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("mask", ["none", "padding", "bool3d", "padding+float", "causal"])
@pytest.mark.parametrize("extra", list(EXTRA_KEYS))
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
def test_add_bias_kv_and_add_zero_attn_equal_mha(extra, mask, need_weights):
    """MHA appends a learned key/value and/or a zero key/value after the keys
    (visible to every query); from_mha copies bias_k/bias_v; with gates 0 and
    metric 'none' the outputs and the (B, N, M + extra) weights are MHA's."""
    torch.manual_seed(10)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **EXTRA_KEYS[extra]).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x = torch.randn(B, N, E, dtype=torch.float64)
    kwargs = _mask_kwargs("none" if mask == "causal" else mask, N, N, torch.float64)
    if mask == "causal":
        kwargs = {"attn_mask": _causal_mask(N, N), "is_causal": True}
    expected, w_expected = mha(x, x, x, need_weights=need_weights, **kwargs)
    if mask == "causal" and not need_weights:
        # MHA's own paths disagree here: its fused path drops the mask and hands
        # SDPA is_causal over the extended keys, hiding the appended keys from
        # all but the last queries; its other paths show them to every query,
        # as DamchaAttention does on every path (docs/torch.md).
        expected, _ = mha(x, x, x, need_weights=True, **kwargs)
    for metric in ("heads", "none"):
        layer = DamchaAttention.from_mha(mha, metric=metric).eval()
        out, w = layer(x, x, x, need_weights=need_weights, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        if need_weights:
            torch.testing.assert_close(w, w_expected, rtol=1e-10, atol=1e-12)


def _reference_with_extra_keys(layer: DamchaAttention, x: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """An independent composition of the reference's steps: project, map q and
    k, append bias_k (a transformed key, unmapped) and/or a zero key, then the
    reference's masked softmax with the appended keys visible to every query."""
    from damcha_core import _reference as ref

    twin = DamchaAttention(E, H, batch_first=True, dtype=torch.float64)  # the same weights, no extra keys
    twin.load_state_dict({k: t for k, t in layer.state_dict().items() if k not in ("bias_k", "bias_v")})
    params, cfg = twin.to_canonical(), twin.config
    q, k, v = ref.project(params, cfg, x, x)
    side = cfg.metric_sides[0]
    q, k = ref.apply_map(params, cfg, side, x, q), ref.apply_map(params, cfg, side, x, k)
    G, d, dv = cfg.num_kv_heads, cfg.key_dim, cfg.value_dim
    extra_k, extra_v = [], []
    if layer.bias_k is not None:
        extra_k.append(layer.bias_k.detach().numpy().reshape(1, 1, G, d))
        extra_v.append(layer.bias_v.detach().numpy().reshape(1, 1, G, dv))
    if layer.add_zero_attn:
        extra_k.append(np.zeros((1, 1, G, d)))
        extra_v.append(np.zeros((1, 1, G, dv)))
    Bx = x.shape[0]
    k = np.concatenate([k] + [np.broadcast_to(e, (Bx, 1, G, d)) for e in extra_k], axis=1)
    v = np.concatenate([v] + [np.broadcast_to(e, (Bx, 1, G, dv)) for e in extra_v], axis=1)
    vis = np.concatenate([visible, np.ones((*visible.shape[:-1], len(extra_k)), bool)], axis=-1)
    logits = cfg.softmax_scale * np.einsum("bnhd,bmhd->bhnm", q, k)
    probs = ref.softmax_attend(logits, vis)
    o = np.einsum("bhnm,bmhd->bnhd", probs, v)
    return np.einsum("bnhd,hde->bne", o, params["output.kernel"]) + params["output.bias"]


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("extra", list(EXTRA_KEYS))
def test_extra_keys_with_open_gates_follow_their_definition(extra, need_weights):
    """With the map on: queries are mapped, keys are mapped token by token,
    the bias key is appended in k~ space and every query sees it; the causal
    rule and the padding mask cover the real keys only."""
    torch.manual_seed(11)
    layer = DamchaAttention(E, H, batch_first=True, dtype=torch.float64, **EXTRA_KEYS[extra]).eval()
    with torch.no_grad():
        layer.metric_gates["qk"].uniform_(0.3, 1.0)
        layer.in_proj_bias.normal_()
        layer.out_proj.bias.normal_()
    x = torch.randn(B, N, E, dtype=torch.float64)
    kpm = torch.zeros(B, N, dtype=torch.bool)
    kpm[1, :] = True  # batch 1 sees no real key at all: only the appended ones
    out, _ = layer(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=need_weights)
    visible = np.tril(np.ones((N, N), bool))[None, None] & ~kpm.numpy()[:, None, None, :]
    want = _reference_with_extra_keys(layer, x.numpy(), np.broadcast_to(visible, (B, H, N, N)))
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("extra", list(EXTRA_KEYS))
def test_extra_keys_are_not_cached_and_decoding_equals_the_full_forward(extra):
    from damcha_torch import DamchaKVCache

    torch.manual_seed(12)
    layer = DamchaAttention(E, H, batch_first=True, dtype=torch.float64, **EXTRA_KEYS[extra]).eval()
    with torch.no_grad():
        layer.metric_gates["qk"].fill_(0.5)
    x = torch.randn(B, 6, E, dtype=torch.float64)
    full, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache, steps = DamchaKVCache(), []
    for i in range(6):
        t = x[:, i : i + 1]
        steps.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
    assert len(cache) == 6  # the bias and zero keys are appended per call, never stored
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def test_extra_keys_have_no_canonical_form():
    import damcha_core as dc

    layer = DamchaAttention(E, H, add_bias_kv=True)
    with pytest.raises(dc.DamchaValueError, match=r"add_bias_kv or add_zero_attn has no canonical form"):
        layer.to_canonical()
    with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `add_zero_attn`: expected a bool"):
        DamchaAttention(E, H, add_zero_attn="yes")


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("layout", ["packed", "kdim-vdim"])
@pytest.mark.parametrize("extra", ["plain", "bias-kv+zero-attn", "no-bias"])
def test_functional_mha_forward_on_the_layers_attributes_equals_the_layer(layout, extra, need_weights):
    """Code written for nn.MultiheadAttention calls F.multi_head_attention_forward
    with the module's attributes, choosing weights by `_qkv_same_embed_dim`:
    a fresh DamchaAttention (gates 0) hands it MHA's parameters in MHA's places
    (q/k/v_proj_weight are views of in_proj_weight when packed) and the layer
    computes the same thing, with key padding and a float mask."""
    torch.manual_seed(13)
    kw = {"kdim": 12, "vdim": 6} if layout == "kdim-vdim" else {}
    if extra == "bias-kv+zero-attn":
        kw.update(add_bias_kv=True, add_zero_attn=True)
    if extra == "no-bias":
        kw["bias"] = False
    layer = DamchaAttention(E, H, dtype=torch.float64, **kw).eval()
    if layout == "packed":
        for i, name in enumerate(("q_proj_weight", "k_proj_weight", "v_proj_weight")):
            view = getattr(layer, name)
            assert view.data_ptr() == layer.in_proj_weight[i * E].data_ptr()  # a view, not a copy
    q = torch.randn(N, B, E, dtype=torch.float64)
    k = torch.randn(M, B, kw.get("kdim", E), dtype=torch.float64)
    v = torch.randn(M, B, kw.get("vdim", E), dtype=torch.float64)
    kpm = torch.zeros(B, M, dtype=torch.bool)
    kpm[0, -2:] = True
    am = torch.randn(N, M, dtype=torch.float64)
    want, w_want = F.multi_head_attention_forward(
        q,
        k,
        v,
        E,
        H,
        layer.in_proj_weight,
        layer.in_proj_bias,
        layer.bias_k,
        layer.bias_v,
        layer.add_zero_attn,
        layer.dropout,
        layer.out_proj.weight,
        layer.out_proj.bias,
        training=False,
        key_padding_mask=kpm,
        need_weights=need_weights,
        attn_mask=am,
        use_separate_proj_weight=not layer._qkv_same_embed_dim,
        q_proj_weight=layer.q_proj_weight,
        k_proj_weight=layer.k_proj_weight,
        v_proj_weight=layer.v_proj_weight,
    )
    out, w = layer(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(w, w_want, rtol=1e-10, atol=1e-12)


def test_torch_jit_trace_works_and_script_is_refused_by_torchscript():
    """torch.jit.trace records the layer (as for MHA); torch.jit.script cannot
    compile it (docs/torch.md says why)."""
    torch.manual_seed(14)
    layer = DamchaAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        layer.metric_gates["qk"].fill_(0.5)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False, is_causal=True)[0]

    block = Block()
    x = torch.randn(B, N, E)
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(block, (x,))
    other = torch.randn(3, 7, E)  # another batch and length than the example
    torch.testing.assert_close(traced(other), block(other), rtol=1e-6, atol=1e-6)
    # TorchScript's own error (no DamchaError to give: it never runs our code); today a ValueError
    # from its annotation parser, a RuntimeError from its compiler in other torch versions
    with pytest.raises((ValueError, RuntimeError)):
        torch.jit.script(layer)


@pytest.mark.parametrize("coupling", ["tied", "separate"])
def test_torch_jit_trace_of_a_training_layer_checks_saves_and_trains(coupling, tmp_path):
    """A layer in training mode traces as MHA does: torch.jit.trace's check
    (a second trace under no_grad) passes (the layer took its fused training
    node only with gradients on, so the graphs differed: TracingCheckError, a
    reviewer's find), torch.jit.save/load writes the graph, and the traced and
    loaded graphs give the eager layer's outputs and gradients (float64)."""
    torch.manual_seed(15)
    layer = DamchaAttention(E, H, batch_first=True, coupling=coupling, dtype=torch.float64).train()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.normal_()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    block = Block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(block, (torch.randn(B, N, E, dtype=torch.float64),))
    torch.jit.save(traced, tmp_path / "block.pt")
    loaded = torch.jit.load(tmp_path / "block.pt")
    other = torch.randn(3, 7, E, dtype=torch.float64)

    def run(module: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        params = list(module.parameters())
        out = module(other)
        return out.detach(), list(torch.autograd.grad(out.square().sum(), params))

    want, want_grads = run(block)
    for module in (traced, loaded):
        got, got_grads = run(module)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
