"""One small pre-LN Transformer; only its attention layer changes between variants.

An *attention factory* ``factory(layer_index) -> nn.Module`` builds each
layer's attention. Every attention module is wrapped to the signature
``forward(x (B, N, E), *, causal, key_padding_mask) -> (B, N, E)`` so the
model code is identical for MHA, talking-heads and every DAMCHA variant.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from damcha_core import DamchaValueError

from ._talking_heads import TalkingHeadsAttention


@dataclasses.dataclass(frozen=True)
class Variant:
    """An attention variant: ``kind`` is "mha", "talking-heads" or "damcha"."""

    name: str
    kind: str
    metric: str = "none"
    coupling: str = "tied"
    metric_rank: int | None = None
    share_metric: bool = False
    description: str = ""


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("mha", "mha", description="nn.MultiheadAttention"),
        Variant("talking-heads", "talking-heads", description="static HxH mixing of logits and weights"),
        Variant("damcha-heads-tied", "damcha", "heads", "tied", description="per-layer generator, tied q/k"),
        Variant("damcha-heads-tied-shared", "damcha", "heads", "tied", share_metric=True,
                description="one generator shared by the stack, per-layer gates"),
        Variant("damcha-heads-separate", "damcha", "heads", "separate", description="q and k generators"),
        Variant("damcha-heads-query", "damcha", "heads", "query", description="queries only"),
        Variant("damcha-lowrank-tied", "damcha", "lowrank", "tied", metric_rank=8, description="rank-8 map, tied"),
    )
}


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise DamchaValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    return VARIANTS[name]


class AttentionAdapter(nn.Module):
    """Gives every attention module the call ``(x, causal=, key_padding_mask=) -> y``.

    ``key_padding_mask`` is (B, N) bool, True = padding (PyTorch's convention).
    """

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x: torch.Tensor, *, causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        N = x.shape[1]
        if self.kind == "talking-heads":
            return self.inner(x, key_padding_mask=key_padding_mask, is_causal=causal)[0]
        if self.kind == "mha":
            # nn.MultiheadAttention treats is_causal as a hint only: it needs the mask too.
            causal_mask = torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1) if causal else None
            return self.inner(x, x, x, key_padding_mask=key_padding_mask, attn_mask=causal_mask,
                              need_weights=False, is_causal=causal)[0]
        # DamchaAttention applies is_causal itself (no mask tensor needed), which
        # keeps it on SDPA's causal kernel; need_weights=False keeps it fused.
        return self.inner(x, x, x, key_padding_mask=key_padding_mask, need_weights=False, is_causal=causal)[0]


def attention_factory(variant: Variant, embed_dim: int, num_heads: int, num_layers: int,
                      dropout: float = 0.0) -> Callable[[int], nn.Module]:
    """``factory(layer) -> AttentionAdapter`` for ``variant``.

    For a shared-metric DAMCHA variant all layers receive one
    ``damcha_torch.MetricGenerator``; each layer keeps its own gate.
    """
    if variant.kind == "mha":
        return lambda layer: AttentionAdapter(nn.MultiheadAttention(embed_dim, num_heads, dropout, batch_first=True), "mha")
    if variant.kind == "talking-heads":
        return lambda layer: AttentionAdapter(TalkingHeadsAttention(embed_dim, num_heads, dropout), "talking-heads")
    import damcha_torch  # lazily: the baselines need no DAMCHA port

    options = dict(metric=variant.metric, coupling=variant.coupling, metric_rank=variant.metric_rank)
    shared = None
    if variant.share_metric:
        if variant.coupling == "separate":
            raise DamchaValueError(f"variant {variant.name!r}: stack sharing is wired for tied/query coupling only")
        shared = damcha_torch.MetricGenerator(embed_dim, num_heads, embed_dim // num_heads, variant.metric,
                                              variant.metric_rank)

    def build(layer: int) -> nn.Module:
        extra = {"metric_generator": shared} if shared is not None else {}
        # recompute=False: these models are tiny, so storing the maps costs little memory
        # and saves re-running the q/k projections in backward (about 2x faster here).
        return AttentionAdapter(
            damcha_torch.DamchaAttention(embed_dim, num_heads, dropout, batch_first=True, recompute=False,
                                         **options, **extra),
            "damcha",
        )

    return build


class Block(nn.Module):
    def __init__(self, attention: nn.Module, embed_dim: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, embed_dim))

    def forward(self, x: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), causal=causal, key_padding_mask=key_padding_mask)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Field embeddings (+ learned positions) -> pre-LN blocks -> LayerNorm -> linear head.

    Args:
        vocab_sizes: one vocabulary per input field; a token's embedding is
            the sum of its fields' embeddings.
        num_outputs: classes (classification) or vocabulary (language model).
        factory: ``factory(layer) -> attention`` (see ``attention_factory``).
        readout: token position whose state is classified, or ``None`` for a
            per-position output (language modelling).
        max_len: positions for learned position embeddings; 0 = none (a set).
        pad_id: field-0 id treated as padding (keys hidden), or ``None``.
    """

    def __init__(self, vocab_sizes: tuple[int, ...], num_outputs: int, factory: Callable[[int], nn.Module], *,
                 embed_dim: int, num_layers: int, mlp_hidden: int, max_len: int = 0, causal: bool = False,
                 readout: int | None = -1, pad_id: int | None = None) -> None:
        super().__init__()
        self.fields = nn.ModuleList(nn.Embedding(v, embed_dim) for v in vocab_sizes)
        self.positions = nn.Embedding(max_len, embed_dim) if max_len else None
        self.blocks = nn.ModuleList(Block(factory(i), embed_dim, mlp_hidden) for i in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_outputs)
        self.causal, self.readout, self.pad_id = causal, readout, pad_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N, F) int64 -> logits (B, C) or (B, N, V) for a language model."""
        x = sum(emb(tokens[..., f]) for f, emb in enumerate(self.fields))
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        pad = tokens[..., 0] == self.pad_id if self.pad_id is not None else None
        for block in self.blocks:
            x = block(x, self.causal, pad)
        x = self.norm(x)
        return self.head(x if self.readout is None else x[:, self.readout])


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
