"""The models: one small Transformer per task; only the attention layer changes between variants.

Token tasks (crosshead, charlm, listops) use ``TinyTransformer``, whose
attention comes from an *attention factory* ``factory(layer_index) -> nn.Module``
wrapped to ``forward(x (B, N, E), *, causal, key_padding_mask) -> (B, N, E)``.
The image task (digits) uses ``DigitsViT``: stock ``nn.TransformerEncoderLayer``
blocks whose ``nn.MultiheadAttention`` is swapped for DAMCHA by
``damcha_torch.replace_mha`` (or for talking-heads), exactly as a user would
convert an existing PyTorch model.

Variants also carry the training-side options of the ablations (metric
penalty coefficient, initial gate value, learning-rate multiplier of the
gates and generators); ``prepare_model`` applies the model-side ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from damcha_core import DamchaValueError, invalid_argument

from ._talking_heads import TalkingHeadsAttention
from ._variants import Variant

if TYPE_CHECKING:
    import damcha_torch


def _damcha_options(variant: Variant, embed_dim: int, num_heads: int) -> dict[str, Any]:
    """DamchaAttention keyword options of ``variant``, with the shared generator(s) if any."""
    import damcha_torch  # lazily: the baselines need no DAMCHA port

    options: dict[str, Any] = dict(
        metric=variant.metric, coupling=variant.coupling, metric_rank=variant.metric_rank, recompute=False
    )
    if variant.share_metric:

        def gen() -> nn.Module:
            return damcha_torch.MetricGenerator(
                embed_dim, num_heads, embed_dim // num_heads, variant.metric, variant.metric_rank
            )

        options["metric_generator"] = {"q": gen(), "k": gen()} if variant.coupling == "separate" else gen()
    return options


class AttentionAdapter(nn.Module):
    """Gives every attention module the call ``(x, causal=, key_padding_mask=) -> y``.

    ``key_padding_mask`` is (B, N) bool, True = padding (PyTorch's convention).
    """

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(
        self, x: torch.Tensor, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        N = x.shape[1]
        if self.kind == "talking-heads":
            return self.inner(x, key_padding_mask=key_padding_mask, is_causal=causal)[0]
        if self.kind == "mha":
            # nn.MultiheadAttention treats is_causal as a hint only: it needs the mask too.
            causal_mask = torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1) if causal else None
            return self.inner(
                x, x, x, key_padding_mask=key_padding_mask, attn_mask=causal_mask, need_weights=False, is_causal=causal
            )[0]
        # DamchaAttention applies is_causal itself (no mask tensor needed), which
        # keeps it on SDPA's causal kernel; need_weights=False keeps it fused.
        return self.inner(x, x, x, key_padding_mask=key_padding_mask, need_weights=False, is_causal=causal)[0]


def attention_factory(
    variant: Variant, embed_dim: int, num_heads: int, num_layers: int, dropout: float = 0.0
) -> Callable[[int], nn.Module]:
    """``factory(layer) -> AttentionAdapter`` for ``variant``.

    For a shared-metric DAMCHA variant all layers receive the same
    ``damcha_torch.MetricGenerator`` (a ``{"q", "k"}`` pair for separate
    coupling); each layer keeps its own gates.
    """
    if variant.kind == "mha":
        return lambda layer: AttentionAdapter(
            nn.MultiheadAttention(embed_dim, num_heads, dropout, batch_first=True), "mha"
        )
    if variant.kind == "talking-heads":
        return lambda layer: AttentionAdapter(TalkingHeadsAttention(embed_dim, num_heads, dropout), "talking-heads")
    import damcha_torch

    options = _damcha_options(variant, embed_dim, num_heads)

    def build(layer: int) -> nn.Module:
        # recompute=False: these models are tiny, so storing the maps costs little memory
        # and saves re-running the q/k projections in backward (about 2x faster here).
        return AttentionAdapter(
            damcha_torch.DamchaAttention(embed_dim, num_heads, dropout, batch_first=True, **options), "damcha"
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

    def __init__(
        self,
        vocab_sizes: tuple[int, ...],
        num_outputs: int,
        factory: Callable[[int], nn.Module],
        *,
        embed_dim: int,
        num_layers: int,
        mlp_hidden: int,
        max_len: int = 0,
        causal: bool = False,
        readout: int | None = -1,
        pad_id: int | None = None,
    ) -> None:
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


class DigitsViT(nn.Module):
    """A small ViT for 8x8 images, built from stock ``nn.TransformerEncoderLayer`` blocks.

    Patches of ``patch`` x ``patch`` pixels are embedded linearly, a learned
    CLS token and learned positions are added, then pre-LN encoder layers
    (GELU MLP of width ``mlp_hidden``), a final LayerNorm and a linear head
    on the CLS token. Each layer is built separately (``nn.TransformerEncoder``
    would deep-copy one layer, so every layer would start with the same
    weights). The attention is ``nn.MultiheadAttention``; ``as_variant``
    swaps it.

    Args:
        num_classes: output classes.
        embed_dim, num_heads, num_layers, mlp_hidden: encoder sizes.
        patch: patch side; must divide ``image``.
        image: image side (8 for scikit-learn's digits).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        mlp_hidden: int,
        patch: int = 2,
        image: int = 8,
    ) -> None:
        super().__init__()
        if image % patch:
            raise DamchaValueError(invalid_argument("patch", "a divisor of `image`", f"patch={patch}, image={image}"))
        self.patch, self.image = patch, image
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, embed_dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.positions = nn.Parameter(torch.randn(1, tokens + 1, embed_dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                embed_dim, num_heads, mlp_hidden, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, image, image) float -> logits (B, num_classes)."""
        B, p = images.shape[0], self.patch
        x = images.unfold(1, p, p).unfold(2, p, p).reshape(B, -1, p * p)  # (B, T, p*p), row-major patches
        x = torch.cat([self.cls.expand(B, -1, -1), self.embed(x)], dim=1) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


def as_variant(model: nn.Module, variant: Variant) -> nn.Module:
    """Swap every ``nn.MultiheadAttention`` of ``model`` for ``variant``'s attention (in place).

    DAMCHA goes through ``damcha_torch.replace_mha`` (weights copied, gates
    at 0, so the model computes what it did); talking-heads loads each MHA's
    weights (its mixing matrices start at the identity, where it is MHA).
    """
    if variant.kind == "mha":
        return model
    if variant.kind == "damcha":
        import damcha_torch

        mhas = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        if not mhas:
            return model
        options = _damcha_options(variant, mhas[0].embed_dim, mhas[0].num_heads)
        return damcha_torch.replace_mha(model, **options)

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                th = TalkingHeadsAttention(
                    child.embed_dim, child.num_heads, child.dropout, bias=child.in_proj_bias is not None
                )
                th.load_state_dict(child.state_dict(), strict=False)
                setattr(parent, name, th)
            else:
                visit(child)

    visit(model)
    return model


def damcha_layers(model: nn.Module) -> list[damcha_torch.DamchaAttention]:
    """The ``damcha_torch.DamchaAttention`` modules of ``model``, in module order (none for baselines)."""
    try:
        import damcha_torch
    except ImportError:  # pragma: no cover - a baseline-only model needs no DAMCHA port
        return []
    return [m for m in model.modules() if isinstance(m, damcha_torch.DamchaAttention)]


def prepare_model(model: nn.Module, variant: Variant) -> nn.Module:
    """Apply the model-side ablation options: the initial gate value and penalty tracking."""
    layers = damcha_layers(model)
    if variant.gate_init:
        with torch.no_grad():
            for layer in layers:
                for gate in layer.metric_gates.values():
                    gate.fill_(variant.gate_init)
    if variant.penalty:
        for layer in layers:
            layer.track_metric_penalty = True
    return model


def metric_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``named_parameters``) of the gates and generator weights of every DAMCHA layer."""
    ids = {
        id(p)
        for layer in damcha_layers(model)
        for part in (layer.metric_gates, layer.metric_generators)
        for p in part.parameters()
    }
    return {name for name, p in model.named_parameters() if id(p) in ids}


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def match_width(build: Callable[[int], nn.Module], budget: int, base_width: int) -> tuple[int, int]:
    """MLP width whose model is nearest ``budget`` parameters; returns (width, params).

    ``build(width)`` must make a model whose count grows linearly with the
    width (one hidden unit adds the same parameters in every layer). The
    result is within half a unit's parameters of the budget.
    """
    c0, c1 = count_parameters(build(base_width)), count_parameters(build(base_width + 1))
    per_unit = c1 - c0
    if per_unit <= 0:
        raise DamchaValueError(f"the model's parameter count does not grow with the MLP width ({c0} -> {c1})")
    width = base_width + math.floor((budget - c0) / per_unit + 0.5)
    if width < 1:
        raise DamchaValueError(
            f"parameter budget {budget:,} is too small for this variant: it has {c0:,} parameters at MLP width "
            f"{base_width} and {per_unit} per extra unit"
        )
    return width, c0 + (width - base_width) * per_unit
