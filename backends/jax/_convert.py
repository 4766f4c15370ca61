"""Converting a trained ``nnx.MultiHeadAttention`` into a ``DamchaAttention``."""

from __future__ import annotations

from typing import Any

from flax import nnx

import jax.numpy as jnp
from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument

# Bound once: code that swaps nnx.MultiHeadAttention for DamchaAttention
# (e.g. to run Flax's own tests against it) still converts real Flax layers.
_FlaxMHA = nnx.MultiHeadAttention


def _metadata(variable: Any) -> dict[str, Any]:
    """What a variable's constructor was given as ``*_metadata`` (or by
    ``nnx.with_partitioning``): its metadata less the entries every fresh
    variable has (the sharding names are what matters: a converted layer keeps
    its parameters' sharding, and under an explicit-sharding mesh the copy of a
    sharded kernel into an unsharded one is a JAX type error)."""
    defaults = nnx.Param(jnp.zeros(())).get_metadata()
    return {k: v for k, v in variable.get_metadata().items() if k not in defaults or defaults[k] != v}


def from_mha(cls: Any, mha: Any, *, metric: str, metric_rank: int | None, coupling: str | None, rngs: nnx.Rngs) -> Any:
    """``cls`` (``DamchaAttention``) with ``mha``'s projections (and q/k norms)
    and every option it has, gates at 0: ``mha``'s outputs (except in rows
    that see no key, see ``DamchaAttention.from_mha``), ready to fine-tune
    the metric. The generator is fresh; ``coupling=None`` is automatic."""
    if not isinstance(mha, _FlaxMHA):
        raise DamchaTypeError(invalid_argument("mha", "an nnx.MultiHeadAttention", f"mha={describe(mha)}"))
    if type(mha).__call__ is not _FlaxMHA.__call__:
        # The copy reproduces nnx.MultiHeadAttention.__call__ only: a subclass
        # with its own __call__ would convert to a layer with other outputs.
        raise DamchaValueError(
            invalid_argument(
                "mha",
                "an nnx.MultiHeadAttention whose __call__ is nnx.MultiHeadAttention.__call__ (a subclass with its "
                "own __call__ computes something from_mha cannot copy)",
                f"mha={type(mha).__module__}.{type(mha).__qualname__}, which overrides __call__",
            )
        )
    attention_fn = None if mha.attention_fn is nnx.dot_product_attention else mha.attention_fn
    metadata = dict(kernel_metadata=_metadata(mha.query.kernel), out_kernel_metadata=_metadata(mha.out.kernel))
    if mha.use_bias:
        metadata.update(bias_metadata=_metadata(mha.query.bias), out_bias_metadata=_metadata(mha.out.bias))
    if mha.normalize_qk:
        assert mha.query_ln is not None and mha.key_ln is not None  # built by normalize_qk
        metadata.update(
            query_ln_scale_metadata=_metadata(mha.query_ln.scale), key_ln_scale_metadata=_metadata(mha.key_ln.scale)
        )
    layer = cls(
        mha.num_heads,
        mha.in_features,
        mha.qkv_features,
        mha.out_features,
        mha.num_kv_heads,
        mha.in_kv_features,
        metric=metric,
        metric_rank=metric_rank,
        coupling=coupling,
        dtype=mha.dtype,
        param_dtype=mha.param_dtype,
        broadcast_dropout=mha.broadcast_dropout,
        dropout_rate=mha.dropout_rate,
        deterministic=mha.deterministic,
        precision=mha.precision,
        use_bias=mha.use_bias,
        attention_fn=attention_fn,
        decode=mha.decode,
        normalize_qk=mha.normalize_qk,
        qkv_promote_dtype=mha.qkv_promote_dtype,
        out_promote_dtype=mha.out_promote_dtype,
        ln_promote_dtype=mha.ln_promote_dtype,
        qkv_dot_general=mha.qkv_dot_general,
        out_dot_general=mha.out_dot_general,
        qkv_dot_general_cls=mha.qkv_dot_general_cls,
        out_dot_general_cls=mha.out_dot_general_cls,
        keep_rngs=mha.rngs is not None,
        rngs=rngs,
        **metadata,
    )
    for name in ("query", "key", "value", "out"):
        source, target = getattr(mha, name), getattr(layer, name)
        target.kernel[...] = source.kernel[...]
        if layer.use_bias:
            target.bias[...] = source.bias[...]
    if mha.normalize_qk:
        # normalize_qk builds both LayerNorms, with a scale (as the layer's, built from mha's flags).
        for ln in ("query_ln", "key_ln"):
            source_ln, target_ln = getattr(mha, ln), getattr(layer, ln)
            assert source_ln.scale is not None and target_ln.scale is not None
            target_ln.scale[...] = source_ln.scale[...]
    return layer
