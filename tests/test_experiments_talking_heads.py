"""Talking-heads baseline: identity mixing is exactly nn.MultiheadAttention;
general mixing matches an independent NumPy implementation of Shazeer et al. 2020."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from damcha_core import DamchaTypeError, DamchaValueError
from damcha_experiments import TalkingHeadsAttention

E, H, B, N, M = 12, 3, 2, 5, 4


def _pair(seed: int) -> tuple[nn.MultiheadAttention, TalkingHeadsAttention]:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, batch_first=True).double()
    with torch.no_grad():  # non-zero biases so they are checked too
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    th = TalkingHeadsAttention(E, H).double()
    missing, unexpected = th.load_state_dict(mha.state_dict(), strict=False)
    assert sorted(missing) == ["logit_mix", "weight_mix"] and not unexpected
    return mha, th


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "keypad"])
def test_identity_mixing_equals_mha_self_attention(causal, padding):
    mha, th = _pair(0)
    x = torch.randn(B, N, E, dtype=torch.float64)
    kpm = torch.tensor([[False] * N, [False, False, False, True, True]]) if padding else None
    attn_mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    want, want_w = mha(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    got, got_w = th(x, key_padding_mask=kpm, is_causal=causal, need_weights=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)


def test_identity_mixing_equals_mha_cross_attention_with_gradients():
    mha, th = _pair(1)
    x = torch.randn(B, N, E, dtype=torch.float64, requires_grad=True)
    c = torch.randn(B, M, E, dtype=torch.float64, requires_grad=True)
    want = mha(x, c, c)[0]
    got = th(x, c, c)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_want = torch.autograd.grad(want.square().sum(), [x, c, mha.in_proj_weight])
    g_got = torch.autograd.grad(got.square().sum(), [x, c, th.in_proj_weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _numpy_talking_heads(th: TalkingHeadsAttention, x: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Shazeer et al. 2020, eq. by eq., in float64 NumPy with per-head loops."""
    P = {k: v.detach().numpy() for k, v in th.state_dict().items()}
    w_q, w_k, w_v = np.split(P["in_proj_weight"], 3)
    b_q, b_k, b_v = np.split(P["in_proj_bias"], 3)
    d = E // H
    heads = lambda t: t.reshape(t.shape[0], t.shape[1], H, d)  # noqa: E731
    q, k, v = heads(x @ w_q.T + b_q), heads(x @ w_k.T + b_k), heads(x @ w_v.T + b_v)
    out = np.zeros((x.shape[0], x.shape[1], H, d))
    for b in range(x.shape[0]):
        logits = np.stack([q[b, :, h] @ k[b, :, h].T / np.sqrt(d) for h in range(H)])
        mixed = np.stack([sum(P["logit_mix"][h, a] * logits[a] for a in range(H)) for h in range(H)])
        probs = np.zeros_like(mixed)
        for h in range(H):
            for i in range(x.shape[1]):
                if visible[b, i].any():
                    e = np.exp(mixed[h, i] - mixed[h, i][visible[b, i]].max()) * visible[b, i]
                    probs[h, i] = e / e.sum()
        probs = np.stack([sum(P["weight_mix"][h, a] * probs[a] for a in range(H)) for h in range(H)])
        for h in range(H):
            out[b, :, h] = probs[h] @ v[b, :, h]
    return out.reshape(x.shape[0], x.shape[1], E) @ P["out_proj.weight"].T + P["out_proj.bias"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_mixing_matches_independent_numpy(causal):
    _, th = _pair(2)
    with torch.no_grad():
        th.logit_mix.normal_()
        th.weight_mix.normal_()
    x = torch.randn(B, N, E, dtype=torch.float64)
    kpm = torch.tensor([[False] * N, [False, True, False, False, True]])
    visible = np.broadcast_to(~kpm.numpy()[:, None, :], (B, N, N)).copy()
    if causal:
        visible &= np.tril(np.ones((N, N), dtype=bool))
    got = th(x, key_padding_mask=kpm, is_causal=causal)[0].detach().numpy()
    np.testing.assert_allclose(got, _numpy_talking_heads(th, x.numpy(), visible), rtol=1e-10, atol=1e-10)
    # And mixing does matter: with the identity the output differs.
    with torch.no_grad():
        th.logit_mix.copy_(torch.eye(H))
        th.weight_mix.copy_(torch.eye(H))
    assert not np.allclose(th(x, key_padding_mask=kpm, is_causal=causal)[0].detach().numpy(), got, atol=1e-6)


def test_all_masked_query_gives_zero_attention_not_nan():
    _, th = _pair(3)
    with torch.no_grad():
        th.logit_mix.normal_()
    x = torch.randn(1, N, E, dtype=torch.float64, requires_grad=True)
    attn_mask = torch.zeros(N, N, dtype=torch.bool)
    attn_mask[2] = True  # query 2 may attend nothing
    y, w = th(x, attn_mask=attn_mask, need_weights=True)
    assert torch.isfinite(y).all() and torch.all(w[0, :, 2] == 0)
    torch.testing.assert_close(y[0, 2], th.out_proj.bias)
    (grad,) = torch.autograd.grad(y.sum(), [x])
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda th: th(torch.ones(1, N, E, dtype=torch.long)),
            DamchaTypeError,
            "Invalid argument `query`: expected a real floating",
        ),
        (lambda th: th(torch.ones(1, N, E + 1, dtype=torch.float64)), DamchaValueError, r"query.shape=\(1, 5, 13\)"),
        (
            lambda th: th(torch.ones(1, N, E, dtype=torch.float64), attn_mask=torch.zeros(N, N)),
            DamchaTypeError,
            "Invalid argument `attn_mask`: expected a mask that is boolean",
        ),
        (
            lambda th: th(
                torch.ones(2, N, E, dtype=torch.float64), key_padding_mask=torch.zeros(1, N, dtype=torch.bool)
            ),
            DamchaValueError,
            "Invalid argument `key_padding_mask`: expected shape",
        ),
        (
            lambda th: TalkingHeadsAttention(10, 3),
            DamchaValueError,
            "Invalid argument `embed_dim`: expected a multiple of `num_heads`",
        ),
    ],
    ids=["int-query", "wrong-width", "float-mask", "padding-shape", "heads-divide"],
)
def test_bad_input_is_named(call, error, match):
    _, th = _pair(4)
    with pytest.raises(error, match=match):
        call(th)
