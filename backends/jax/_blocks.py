"""Transformer blocks with DAMCHA attention as Flax NNX modules: the pre-LN
``DamchaEncoderBlock`` and the ``DamchaEncoder`` stack (stack-wise metric sharing)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from damcha_core import DamchaValueError, describe

from ._generator import MetricGenerator, make_metric_generators
from ._layer import DamchaAttention, attention_config

Array = jax.Array


class DamchaEncoderBlock(nnx.Module):
    """Pre-LN transformer encoder block with DAMCHA self-attention:
    x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))) with a GELU MLP.

    Args:
        in_features: E.
        num_heads: H.
        mlp_features: hidden size of the MLP.
        dropout_rate: residual dropout.
        attention_dropout_rate: attention-probability dropout.
        metric_generator: shared generator(s), see ``DamchaAttention``.
        **attention_kwargs: further ``DamchaAttention`` options (key_dim,
            metric, metric_rank, coupling, num_kv_heads, dtype, param_dtype...).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        mlp_features: int,
        *,
        dropout_rate: float = 0.0,
        attention_dropout_rate: float = 0.0,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        rngs: nnx.Rngs,
        **attention_kwargs: Any,
    ) -> None:
        dtype, param_dtype = attention_kwargs.get("dtype"), attention_kwargs.get("param_dtype", jnp.float32)
        norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(in_features, **norm)
        self.attention = DamchaAttention(
            num_heads, in_features, dropout_rate=attention_dropout_rate,
            metric_generator=metric_generator, rngs=rngs, **attention_kwargs,
        )
        self.mlp_norm = nnx.LayerNorm(in_features, **norm)
        self.mlp_in = nnx.Linear(in_features, mlp_features, **norm)
        self.mlp_out = nnx.Linear(mlp_features, in_features, **norm)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(
        self, x: Array, *, mask: Array | None = None, is_causal: bool = False, deterministic: bool | None = None
    ) -> Array:
        """x (B, N, E) -> (B, N, E)."""
        h = self.attention(self.attention_norm(x), mask=mask, is_causal=is_causal, deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))
        return x + self.dropout(h, deterministic=deterministic)


class DamchaEncoder(nnx.Module):
    """A stack of ``DamchaEncoderBlock``s and a final LayerNorm.

    With ``share_metric=True`` (the paper's stack-wise regulariser) one
    ``MetricGenerator`` per side serves every layer; each layer keeps its own
    gate. ``self.metric_generators`` holds the shared ones (``{}`` otherwise).
    """

    def __init__(
        self,
        num_layers: int,
        in_features: int,
        num_heads: int,
        mlp_features: int,
        *,
        share_metric: bool = True,
        rngs: nnx.Rngs,
        **block_kwargs: Any,
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise DamchaValueError(f"`num_layers` must be an int >= 1. Received: num_layers={describe(num_layers)}")
        if "metric_generator" in block_kwargs:
            raise DamchaValueError("`metric_generator` is managed by DamchaEncoder; use share_metric=True.")
        shared: dict[str, MetricGenerator] = {}
        if share_metric:
            config = attention_config(num_heads, in_features, **_shape_kwargs(block_kwargs))
            shared = make_metric_generators(
                config, param_dtype=block_kwargs.get("param_dtype", jnp.float32), rngs=rngs
            )
        self.metric_generators = nnx.Dict(shared)
        self.layers = nnx.List([
            DamchaEncoderBlock(
                in_features, num_heads, mlp_features, metric_generator=dict(shared) if share_metric else None,
                rngs=rngs, **block_kwargs,
            )
            for _ in range(num_layers)
        ])
        self.final_norm = nnx.LayerNorm(
            in_features, dtype=block_kwargs.get("dtype"),
            param_dtype=block_kwargs.get("param_dtype", jnp.float32), rngs=rngs,
        )

    def __call__(
        self, x: Array, *, mask: Array | None = None, is_causal: bool = False, deterministic: bool | None = None
    ) -> Array:
        """x (B, N, E) -> (B, N, E)."""
        for layer in self.layers:
            x = layer(x, mask=mask, is_causal=is_causal, deterministic=deterministic)
        return self.final_norm(x)


_SHAPE_ARGS = ("qkv_features", "key_dim", "value_dim", "num_kv_heads", "metric", "metric_rank", "coupling", "scale", "use_bias")


def _shape_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _SHAPE_ARGS}
