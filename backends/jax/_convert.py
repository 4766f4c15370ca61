"""Converting a trained ``nnx.MultiHeadAttention`` into a ``DamchaAttention``."""

from __future__ import annotations

from typing import Any

from flax import nnx

from damcha_core import DamchaTypeError, DamchaValueError, describe

from ._canonical import variables


def from_mha(cls: Any, mha: Any, *, metric: str, metric_rank: int | None, coupling: str | None, rngs: nnx.Rngs) -> Any:
    """``cls`` (``DamchaAttention``) with ``mha``'s projections and gates at 0:
    identical outputs, ready to fine-tune the metric. The generator is fresh."""
    if not isinstance(mha, nnx.MultiHeadAttention):
        raise DamchaTypeError(f"`mha` must be an nnx.MultiHeadAttention. Received: mha={describe(mha)}")
    if mha.normalize_qk:
        raise DamchaValueError(
            "`mha` uses normalize_qk=True (LayerNorm on q and k), which DAMCHA v1 does not define. "
            "Received: mha.normalize_qk=True"
        )
    layer = cls(
        mha.num_heads, mha.in_features, mha.qkv_features, mha.out_features, mha.num_kv_heads,
        mha.in_kv_features, metric=metric, metric_rank=metric_rank, coupling=coupling,
        dtype=mha.dtype, param_dtype=mha.param_dtype, dropout_rate=mha.dropout_rate,
        deterministic=mha.deterministic, use_bias=mha.use_bias, decode=mha.decode, rngs=rngs,
    )
    target = variables(layer)
    for name, module in (("query", mha.query), ("key", mha.key), ("value", mha.value), ("output", mha.out)):
        target[f"{name}.kernel"][...] = module.kernel[...]
        if layer.use_bias:
            target[f"{name}.bias"][...] = module.bias[...]
    return layer
