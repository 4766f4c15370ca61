"""damcha_torch: DAMCHA for PyTorch, a drop-in for ``nn.MultiheadAttention``.

``DamchaAttention`` mixes each token's query/key heads with a per-token
cross-head map, then runs one fused ``scaled_dot_product_attention`` call.
See docs/torch.md.
"""

from __future__ import annotations

from typing import Any

from damcha_core._imports import require as _require

_require("torch", "torch", "damcha_torch")  # one-line ImportError naming the extra

from ._attention import DamchaAttention, DamchaKVCache, replace_mha
from ._functional import causal_visibility, damcha_attention, safe_attention
from ._metric import MetricGenerator
from ._transformer import (
    DamchaTransformerDecoder,
    DamchaTransformerDecoderLayer,
    DamchaTransformerEncoder,
    DamchaTransformerEncoderLayer,
    build_decoder,
    build_encoder,
    metric_penalty,
    shard_stack,
)

__all__ = [
    "DamchaAttention",
    "DamchaKVCache",
    "DamchaTransformerDecoder",
    "DamchaTransformerDecoderLayer",
    "DamchaTransformerEncoder",
    "DamchaTransformerEncoderLayer",
    "MetricGenerator",
    "build_decoder",
    "build_encoder",
    "causal_visibility",
    "damcha_attention",
    "metric_penalty",
    "replace_mha",
    "safe_attention",
    "shard_stack",
]


def __getattr__(name: str) -> Any:
    # Deprecated for one release: the adapter moved to the conformance suite.
    if name == "ConformanceAdapter":
        import warnings

        warnings.warn(
            "damcha_torch.ConformanceAdapter is deprecated; use damcha_conformance.adapters.TorchAdapter",
            DeprecationWarning,
            stacklevel=2,
        )
        from damcha_conformance.adapters import TorchAdapter

        return TorchAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
