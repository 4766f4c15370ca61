"""Talking-heads attention (Shazeer et al. 2020), the head-mixing baseline.

It mixes heads on the N x M attention map: logits are mixed by a static
H x H matrix before the softmax and the probabilities by another after it.
That costs O(N * M * H^2) and forces the map to be materialised, which is the
cost DAMCHA avoids by mixing per token before the dot product.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from damcha_core import DamchaTypeError, DamchaValueError, float_dtype_error, invalid_argument, mask_dtype_error


class TalkingHeadsAttention(nn.Module):
    """Self/cross attention with talking-heads mixing, shaped like ``nn.MultiheadAttention``.

    Parameters use ``nn.MultiheadAttention``'s names (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj``) so an MHA ``state_dict`` loads with
    ``strict=False``; ``logit_mix`` and ``weight_mix`` (H, H) start as the
    identity, where the layer *is* MHA.

    Args:
        embed_dim: E, model width.
        num_heads: H; must divide ``embed_dim``.
        dropout: attention-probability dropout, training only.
        bias: whether the projections have biases.
        batch_first: must be True: inputs are (B, N, E).
    """

    # nn.TransformerEncoderLayer reads this before choosing its fused native
    # kernel (which would use in_proj_weight directly and skip the mixing):
    # False keeps it on the path that calls forward().
    _qkv_same_embed_dim = False

    def __init__(
        self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, batch_first: bool = True
    ) -> None:
        super().__init__()
        if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or num_heads < 1 or embed_dim < 1:
            bad = "embed_dim" if not isinstance(embed_dim, int) or embed_dim < 1 else "num_heads"
            raise DamchaTypeError(
                invalid_argument(bad, "an int >= 1", f"embed_dim={embed_dim!r}, num_heads={num_heads!r}")
            )
        if embed_dim % num_heads:
            raise DamchaValueError(
                invalid_argument(
                    "embed_dim", "a multiple of `num_heads`", f"embed_dim={embed_dim}, num_heads={num_heads}"
                )
            )
        if batch_first is not True:
            raise DamchaValueError(
                invalid_argument("batch_first", "True (inputs are (B, N, E))", f"batch_first={batch_first!r}")
            )
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.batch_first = float(dropout), True
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.logit_mix = nn.Parameter(torch.eye(num_heads))
        self.weight_mix = nn.Parameter(torch.eye(num_heads))
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend; returns ``(output (B, N, E), weights (B, H, N, M) or None)``.

        Masks follow ``nn.MultiheadAttention``'s boolean convention (True =
        *not* allowed): ``key_padding_mask`` (B, M), ``attn_mask`` (N, M).
        ``is_causal`` hides keys j > i. A query that sees no key gets zero
        probabilities (output = out_proj bias), never NaN.
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not torch.is_floating_point(t):
                raise float_dtype_error(name, t)
            if t.dim() != 3 or t.shape[-1] != self.embed_dim:
                raise DamchaValueError(
                    invalid_argument(name, f"shape (B, T, {self.embed_dim})", f"{name}.shape={tuple(t.shape)}")
                )
        B, N, E = query.shape
        M = key.shape[1]
        H, d = self.num_heads, self.head_dim
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q = F.linear(query, w_q, b_q).view(B, N, H, d).transpose(1, 2)
        k = F.linear(key, w_k, b_k).view(B, M, H, d).transpose(1, 2)
        v = F.linear(value, w_v, b_v).view(B, M, H, d).transpose(1, 2)
        logits = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)  # (B, H, N, M)
        # Mixing before masking: a hidden key must stay hidden in every head.
        logits = torch.einsum("hg,bgnm->bhnm", self.logit_mix, logits)
        visible = torch.ones(N, M, dtype=torch.bool, device=query.device)
        if is_causal:
            visible = visible.tril()
        visible = visible[None, None]
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise mask_dtype_error(attn_mask, "attn_mask")
            if attn_mask.shape != (N, M):
                raise DamchaValueError(
                    invalid_argument(
                        "attn_mask", f"shape (N, M) = {(N, M)}", f"attn_mask.shape={tuple(attn_mask.shape)}"
                    )
                )
            visible = visible & ~attn_mask[None, None]
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                raise mask_dtype_error(key_padding_mask, "key_padding_mask")
            if key_padding_mask.shape != (B, M):
                raise DamchaValueError(
                    invalid_argument(
                        "key_padding_mask",
                        f"shape (B, M) = {(B, M)}",
                        f"key_padding_mask.shape={tuple(key_padding_mask.shape)}",
                    )
                )
            visible = visible & ~key_padding_mask[:, None, None, :]
        logits = logits.masked_fill(~visible, float("-inf"))
        # An all-hidden row is -inf everywhere: softmax would give NaN, v1 gives 0.
        any_visible = visible.any(-1, keepdim=True)
        probs = torch.softmax(logits.masked_fill(~any_visible, 0.0), dim=-1) * any_visible
        probs = torch.einsum("hg,bgnm->bhnm", self.weight_mix, probs)
        probs = F.dropout(probs, self.dropout, self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, N, E)
        return self.out_proj(out), (probs if need_weights else None)
