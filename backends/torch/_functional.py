"""Functional core: scaled dot-product attention that never NaNs, and the
DAMCHA attention step on already projected heads.

Tensor layouts follow the projections, token-major: q (B, N, H, d),
k (B, M, G, d), v (B, M, G, d_v). The cross-head maps act on a token's
stacked heads, so they run in this layout; only the attention itself
transposes (views, no copies) to SDPA's (B, H, N, d).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

import damcha_core as dc
from damcha_core import DamchaValueError

if TYPE_CHECKING:  # pragma: no cover
    from ._metric import MetricGenerator

__all__ = ["causal_visibility", "damcha_attention", "safe_attention"]


def causal_visibility(n: int, m: int, query_offset: int = 0, device: torch.device | None = None) -> Tensor:
    """Bool (N, M), True = may attend: query i sits at position ``query_offset + i``
    and sees keys j <= query_offset + i (top-left for offset 0, bottom-right with
    a cache of ``query_offset = M - N`` earlier tokens)."""
    rows = torch.arange(n, device=device).unsqueeze(-1) + query_offset
    return torch.arange(m, device=device) <= rows


def _combine(mask: Tensor | None, visible: Tensor) -> Tensor:
    """Hide what ``visible`` (bool, True = attend) hides in a bool or additive mask."""
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


def safe_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention in SDPA layout with v1's all-masked rule.

    Args:
        q: (B, H, N, d) queries.
        k: (B, G, M, d) keys; G divides H and query head h reads kv head
            h // (H / G).
        v: (B, G, M, d_v) values.
        mask: bool (True = may attend) or additive float, broadcastable to
            (B, H, N, M). Already validated by the caller.
        is_causal: hide key j from query i when j > i + query_offset.
        query_offset: position of query 0 (the cache length when decoding).
        scale: logit scale; ``None`` is 1/sqrt(d).
        dropout_p: attention-probability dropout (pass 0.0 outside training).
        need_weights: compute explicitly and also return the probabilities
            (B, H, N, M); otherwise one fused SDPA call, no N x M tensor
            beyond the mask the caller passed.

    Returns:
        ``(o, weights)``: o (B, H, N, d_v); weights or ``None``. A query that
        sees no key gets probabilities 0 and output 0, in value and gradient.
    """
    n, m = q.shape[-2], k.shape[-2]
    heads, kv_heads = q.shape[1], k.shape[1]
    if is_causal and query_offset >= m - 1:
        # Query 0 already sees every key (a one-token decoding step, or M = 1),
        # so the rule hides nothing: skip building a mask on the hot path.
        is_causal = False
    if is_causal and (mask is not None or query_offset or need_weights):
        mask = _combine(mask, causal_visibility(n, m, query_offset, q.device))
        is_causal = False
    row_ok = None
    if mask is not None:
        # SDPA turns a row with no visible key into NaN (0/0), forward and
        # backward. Unhide such rows for the kernel and zero them after.
        visible = mask if mask.dtype == torch.bool else mask > float("-inf")
        row_ok = visible.any(dim=-1, keepdim=True)
        if mask.dtype == torch.bool:
            mask = mask | ~row_ok
        else:
            mask = mask.masked_fill(~row_ok, 0.0).to(q.dtype)
    if not need_weights:
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=kv_heads != heads,
        )
        return (o if row_ok is None else o * row_ok.to(o.dtype)), None
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1)
    if row_ok is not None:
        probs = probs * row_ok.to(probs.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v), probs


def damcha_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_tokens: Tensor | None = None,
    k_tokens: Tensor | None = None,
    q_generator: MetricGenerator | None = None,
    k_generator: MetricGenerator | None = None,
    q_gate: Tensor | None = None,
    k_gate: Tensor | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """DAMCHA on projected heads: q~ = L_q(x) q, k~ = L_k(c) k, then one SDPA call.

    Args:
        q: (B, N, H, d) projected queries.
        k: (B, M, G, d) projected keys.
        v: (B, M, G, d_v) projected values.
        q_tokens: x (B, N, E_q), the tokens that drive the query-side map.
        k_tokens: c (B, M, E_kv), the tokens that drive the key-side map.
        q_generator, k_generator: ``MetricGenerator`` of each side, or ``None``
            for the identity (pass the same one twice for tied coupling).
        q_gate, k_gate: (S,) gates of each side.
        mask: bool, True = may attend (the reference's convention), shape
            (N, M) or (B, H, N, M) with size-1 dims; or an additive float mask
            of those shapes.
        is_causal, query_offset, scale, dropout_p, need_weights: as in
            ``safe_attention``.

    Returns:
        ``(o, weights)``: o (B, N, H, d_v), weights (B, H, N, M) or ``None``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise dc.float_dtype_error(name, t)
        if t.dim() != 4:
            raise DamchaValueError(f"`{name}` must have rank 4, (batch, length, heads, head_dim). Received: {name}.shape={tuple(t.shape)}")
    (B, N, H, d), (Bk, M, G, dk) = q.shape, k.shape
    if Bk != B or dk != d or H % G or v.shape[:3] != k.shape[:3]:
        raise DamchaValueError(
            "`q`, `k`, `v` must be (B, N, H, d), (B, M, G, d), (B, M, G, d_v) with G dividing H. "
            f"Received: q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if mask is not None:
        if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise dc.mask_dtype_error(mask)
        if mask.dim() not in (2, 4) or any(s not in (1, t) for s, t in zip(mask.shape[::-1], (B, H, N, M)[::-1])):
            raise DamchaValueError(
                f"`mask` must have shape (N, M) or (B, H, N, M) with size-1 dims allowed, expected broadcastable "
                f"to {(B, H, N, M)}. Received: mask.shape={tuple(mask.shape)}"
            )
    for role, gen, gate, tokens, y in (("q", q_generator, q_gate, q_tokens, q), ("k", k_generator, k_gate, k_tokens, k)):
        if gen is None:
            continue
        if tokens is None or gate is None:
            raise DamchaValueError(f"`{role}_tokens` and `{role}_gate` are required with `{role}_generator`. Received: {role}_tokens={tokens is not None}, {role}_gate={gate is not None}")
        mapped = gen(tokens, y, gate)
        if role == "q":
            q = mapped
        else:
            k = mapped
    o, weights = safe_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask, is_causal=is_causal,
        query_offset=query_offset, scale=scale, dropout_p=dropout_p, need_weights=need_weights,
    )
    return o.transpose(1, 2), weights
