"""damcha_jax: DAMCHA for JAX (pure functions) and Flax NNX (modules).

Pure functions take the canonical flat parameter dict of ``damcha_core`` and a
static ``DamchaConfig``; ``DamchaAttention`` mirrors ``nnx.MultiHeadAttention``.
"""

from __future__ import annotations

from ._conformance import ConformanceAdapter
from ._functional import (
    coefficients,
    damcha_attention,
    decode_step,
    init_cache,
    metric_penalty,
    transformed_qkv,
)
from ._module import (
    CrossHeadMap,
    DamchaAttention,
    DamchaEncoder,
    DamchaEncoderBlock,
    MetricGenerator,
    attention_config,
    make_metric_generators,
)

__all__ = [
    "ConformanceAdapter",
    "CrossHeadMap",
    "DamchaAttention",
    "DamchaEncoder",
    "DamchaEncoderBlock",
    "MetricGenerator",
    "attention_config",
    "coefficients",
    "damcha_attention",
    "decode_step",
    "init_cache",
    "make_metric_generators",
    "metric_penalty",
    "transformed_qkv",
]
