"""Transformer blocks with DAMCHA attention as Flax NNX modules: the pre-LN
``DamchaEncoderBlock`` and the ``DamchaEncoder`` stack (stack-wise metric sharing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

import jax
import jax.numpy as jnp
from damcha_core import DamchaValueError, EncoderConfig, check_bool, check_int, check_rate, describe, invalid_argument

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
        mlp_features = check_int("mlp_features", mlp_features)
        check_rate("dropout_rate", dropout_rate)
        dtype, param_dtype = attention_kwargs.get("dtype"), attention_kwargs.get("param_dtype", jnp.float32)
        norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(in_features, **norm)
        self.attention = DamchaAttention(
            num_heads,
            in_features,
            dropout_rate=attention_dropout_rate,
            metric_generator=metric_generator,
            rngs=rngs,
            **attention_kwargs,
        )
        self.mlp_norm = nnx.LayerNorm(in_features, **norm)
        self.mlp_in = nnx.Linear(in_features, mlp_features, **norm)
        self.mlp_out = nnx.Linear(mlp_features, in_features, **norm)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(
        self,
        x: Array,
        *,
        mask: Array | None = None,
        is_causal: bool = False,
        deterministic: bool | None = None,
        mask_hint: str | None = None,
    ) -> Array:
        """x (B, N, E) -> (B, N, E); ``mask_hint`` as in ``DamchaAttention``."""
        h = self.attention(
            self.attention_norm(x), mask=mask, is_causal=is_causal, deterministic=deterministic, mask_hint=mask_hint
        )
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))
        return x + self.dropout(h, deterministic=deterministic)

    def to_canonical(self, *, causal: bool = False) -> tuple[dict[str, np.ndarray], EncoderConfig]:
        """This block as a one-layer stack in ``damcha_core``'s stack format
        (``EncoderConfig`` with ``final_norm=False``): float64 params and config.

        Args:
            causal: whether the stack applies the causal rule (the block
                takes ``is_causal`` per call).
        """
        return _stack_canonical([self], None, share=False, causal=causal, name="block")


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
        num_layers = check_int("num_layers", num_layers)
        share_metric = check_bool("share_metric", share_metric)
        if "metric_generator" in block_kwargs:
            raise DamchaValueError(
                invalid_argument(
                    "metric_generator",
                    "no metric_generator: DamchaEncoder manages its generators (use share_metric=True)",
                    f"metric_generator={describe(block_kwargs['metric_generator'])}",
                )
            )
        shared: dict[str, MetricGenerator] = {}
        if share_metric:
            config = attention_config(num_heads, in_features, **_shape_kwargs(block_kwargs))
            shared = make_metric_generators(config, param_dtype=block_kwargs.get("param_dtype", jnp.float32), rngs=rngs)
        self.metric_generators = nnx.Dict(shared)
        self.layers = nnx.List(
            [
                DamchaEncoderBlock(
                    in_features,
                    num_heads,
                    mlp_features,
                    metric_generator=dict(shared) if share_metric else None,
                    rngs=rngs,
                    **block_kwargs,
                )
                for _ in range(num_layers)
            ]
        )
        self.final_norm = nnx.LayerNorm(
            in_features,
            dtype=block_kwargs.get("dtype"),
            param_dtype=block_kwargs.get("param_dtype", jnp.float32),
            rngs=rngs,
        )

    def __call__(
        self,
        x: Array,
        *,
        mask: Array | None = None,
        is_causal: bool = False,
        deterministic: bool | None = None,
        mask_hint: str | None = None,
    ) -> Array:
        """x (B, N, E) -> (B, N, E); ``mask_hint`` as in ``DamchaAttention`` (the mask is checked in each layer)."""
        for layer in self.layers:
            x = layer(x, mask=mask, is_causal=is_causal, deterministic=deterministic, mask_hint=mask_hint)
        return self.final_norm(x)

    def to_canonical(self, *, causal: bool = False) -> tuple[dict[str, np.ndarray], EncoderConfig]:
        """The stack in ``damcha_core``'s stack format: ``(params, EncoderConfig)``
        with float64 NumPy params. A generator shared by every layer
        (``share_metric=True``) is stored once as ``shared.metric.*``.

        The blocks are pre-norm with Flax's ``nnx.gelu`` (the tanh
        approximation: ``activation="gelu_tanh"``) and a final LayerNorm; the
        epsilon is read from the norms.

        Args:
            causal: whether the stack applies the causal rule (the encoder
                takes ``is_causal`` per call).
        """
        layers = list(self.layers)
        share = bool(len(self.metric_generators)) and len(layers) > 1
        return _stack_canonical(layers, self.final_norm, share=share, causal=causal, name="encoder")


def _stack_canonical(
    blocks: Sequence[DamchaEncoderBlock], final_norm: nnx.LayerNorm | None, *, share: bool, causal: Any, name: str
) -> tuple[dict[str, np.ndarray], EncoderConfig]:
    """Blocks (and a final norm) as stack params and their ``EncoderConfig``."""
    causal = check_bool("causal", causal)
    first = blocks[0]
    eps = first.attention_norm.epsilon
    norms = [n for b in blocks for n in (b.attention_norm, b.mlp_norm)] + ([final_norm] if final_norm else [])
    problems = []
    if any(n.epsilon != eps for n in norms):
        problems.append("one LayerNorm epsilon")
    if any(n.scale is None or n.bias is None for n in norms) or any(
        b.mlp_in.bias is None or b.mlp_out.bias is None for b in blocks
    ):
        problems.append("LayerNorm scales and biases and MLP biases")
    if any(b.attention.config != first.attention.config for b in blocks):
        problems.append("one attention config")
    if problems:
        raise DamchaValueError(
            invalid_argument(
                name,
                "a stack that fits the stack format (damcha_core.EncoderConfig), with " + "; ".join(problems),
                f"{name} with {len(blocks)} block(s)",
            )
        )
    config = EncoderConfig(
        first.attention.config,
        num_layers=len(blocks),
        ffn_dim=int(first.mlp_in.out_features),
        share_metric=share,
        norm_eps=float(eps),
        causal=causal,
        norm_first=True,
        activation="gelu_tanh",
        final_norm=final_norm is not None,
    )
    shared = set(config.shared_names()) if share else set()
    f64 = lambda v: np.asarray(v[...], dtype=np.float64)  # noqa: E731
    params: dict[str, np.ndarray] = {}
    for i, block in enumerate(blocks):
        pre = f"layers.{i}."
        for key, value in block.attention.to_canonical().items():
            if key in shared:
                params.setdefault("shared." + key, value)  # the shared generator, once
            else:
                params[f"{pre}attention.{key}"] = value
        for key, var in (
            ("norm1.scale", block.attention_norm.scale),
            ("norm1.bias", block.attention_norm.bias),
            ("norm2.scale", block.mlp_norm.scale),
            ("norm2.bias", block.mlp_norm.bias),
            ("ffn.in.kernel", block.mlp_in.kernel),
            ("ffn.in.bias", block.mlp_in.bias),
            ("ffn.out.kernel", block.mlp_out.kernel),
            ("ffn.out.bias", block.mlp_out.bias),
        ):
            params[pre + key] = f64(var)
    if final_norm is not None:
        params["final_norm.scale"], params["final_norm.bias"] = f64(final_norm.scale), f64(final_norm.bias)
    return {key: params[key] for key in config.param_shapes()}, config


_SHAPE_ARGS = (
    "qkv_features",
    "key_dim",
    "value_dim",
    "num_kv_heads",
    "metric",
    "metric_rank",
    "coupling",
    "scale",
    "use_bias",
    "in_v_features",
)


def _shape_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _SHAPE_ARGS}
