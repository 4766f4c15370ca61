"""damcha_jax: DAMCHA for JAX (pure functions) and Flax NNX (modules)."""

from __future__ import annotations

from ._conformance import ConformanceAdapter
from ._functional import damcha_attention, metric_penalty, transformed_qkv

__all__ = [
    "ConformanceAdapter",
    "damcha_attention",
    "metric_penalty",
    "transformed_qkv",
]
