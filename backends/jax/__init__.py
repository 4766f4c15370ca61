"""damcha_jax: DAMCHA for JAX (pure functions) and Flax NNX (modules).

Pure functions take the canonical flat parameter dict of ``damcha_core`` and a
static ``DamchaConfig``; ``DamchaAttention`` mirrors ``nnx.MultiHeadAttention``.
"""

from __future__ import annotations

from damcha_core._deprecation import moved_names as _moved_names
from damcha_core._imports import require as _require

_require("jax", "jax", "damcha_jax")  # one-line ImportError naming the extra
_require("flax", "jax", "damcha_jax")

from ._blocks import DamchaEncoder, DamchaEncoderBlock
from ._cache import decode_step, init_cache
from ._functional import coefficients, damcha_attention, metric_penalty, transformed_qkv
from ._generator import CrossHeadMap, MetricGenerator, make_metric_generators
from ._layer import DamchaAttention, attention_config, replace_mha

__all__ = [
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
    "replace_mha",
    "transformed_qkv",
]


# Deprecated for one release: the adapter moved to the conformance suite.
__getattr__ = _moved_names(__name__, {"ConformanceAdapter": "damcha_conformance.adapters.JaxAdapter"})
