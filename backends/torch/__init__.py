"""damcha_torch: DAMCHA for PyTorch, a drop-in for ``nn.MultiheadAttention``.

``DamchaAttention`` mixes each token's query/key heads with a per-token
cross-head map, then runs one fused ``scaled_dot_product_attention`` call.
The math lives in free functions named after the reference's steps
(``damcha_attention``, ``rms_normalise``, ``generator``, ``apply_map``,
``visibility``, ``softmax_attend``), which the layer calls. See docs/torch.md.
"""

from __future__ import annotations

from damcha_core._deprecation import moved_names as _moved_names
from damcha_core._imports import require as _require

_require("torch", "torch", "damcha_torch")  # one-line ImportError naming the extra

from ._blocks import (
    DamchaTransformerDecoder,
    DamchaTransformerDecoderLayer,
    DamchaTransformerEncoder,
    DamchaTransformerEncoderLayer,
    build_decoder,
    build_encoder,
    metric_penalty,
    shard_stack,
)
from ._cache import DamchaKVCache
from ._convert import replace_mha
from ._functional import (
    apply_map,
    causal_visibility,
    damcha_attention,
    generator,
    has_decode_kernel,
    rms_normalise,
    safe_attention,
    softmax_attend,
    visibility,
)
from ._generator import MetricGenerator
from ._layer import DamchaAttention
from ._models import (
    AttentionLayout,
    DamchaMaps,
    ModelAdapter,
    ProjectionSite,
    convert,
    converted_layers,
    damcha_parameters,
    from_pretrained,
    register_adapter,
    supported_layouts,
    track_metric_penalty,
)
from ._torchvision_compat import ensure_torchvision_importable

__all__ = [
    "AttentionLayout",
    "DamchaAttention",
    "DamchaKVCache",
    "DamchaMaps",
    "DamchaTransformerDecoder",
    "DamchaTransformerDecoderLayer",
    "DamchaTransformerEncoder",
    "DamchaTransformerEncoderLayer",
    "MetricGenerator",
    "ModelAdapter",
    "ProjectionSite",
    "apply_map",
    "build_decoder",
    "build_encoder",
    "causal_visibility",
    "convert",
    "converted_layers",
    "damcha_attention",
    "damcha_parameters",
    "ensure_torchvision_importable",
    "from_pretrained",
    "generator",
    "has_decode_kernel",
    "metric_penalty",
    "register_adapter",
    "replace_mha",
    "rms_normalise",
    "safe_attention",
    "shard_stack",
    "softmax_attend",
    "supported_layouts",
    "track_metric_penalty",
    "visibility",
]


# Deprecated for one release: the adapter moved to the conformance suite.
__getattr__ = _moved_names(__name__, {"ConformanceAdapter": "damcha_conformance.adapters.TorchAdapter"})
