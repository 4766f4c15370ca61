"""Transformer blocks with DAMCHA attention as Flax NNX modules: the pre-LN
``DamchaEncoderBlock`` and the ``DamchaEncoder`` stack (stack-wise metric sharing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

import jax
import jax.numpy as jnp
from damcha_core import (
    DamchaTypeError,
    DamchaValueError,
    EncoderConfig,
    check_bool,
    check_int,
    check_params_fit,
    check_rate,
    check_real,
    describe,
    float_dtype_error,
    invalid_argument,
    validate_stack_params,
)

from ._canonical import check_compute_fit
from ._canonical import variables as canonical_variables
from ._functional import is_real_floating_dtype
from ._generator import MetricGenerator, make_metric_generators
from ._layer import DamchaAttention, attention_config, check_token_shape

Array = jax.Array


def _check_x(x: Any, features: int) -> None:
    """The blocks' ``x`` (..., N, E), checked here so that a mistake is named
    ``x`` (the attention inside calls it ``inputs_q``) and is not a LayerNorm
    reshape error; the shape rules are the attention's own (``check_token_shape``)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise DamchaTypeError(invalid_argument("x", "an array (..., N, E)", f"x={describe(x)}"))
    # Int or bool tokens would be silently promoted by the norm (the attention
    # and every other port's stack refuse them).
    if not is_real_floating_dtype(getattr(x, "dtype", None)):
        raise float_dtype_error("x", x)
    check_token_shape("x", shape, features)


class DamchaEncoderBlock(nnx.Module):
    """Pre-LN transformer encoder block with DAMCHA self-attention:
    x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))) with a GELU MLP.

    Args:
        in_features: E.
        num_heads: H.
        mlp_features: hidden size of the MLP.
        dropout_rate: residual dropout.
        attention_dropout_rate: attention-probability dropout.
        deterministic: the default of both dropouts (the residual
            ``nnx.Dropout`` and the attention's), as in Flax's modules: a
            call's ``deterministic`` overrides it, and ``eval()``,
            ``train()``, ``set_attributes(deterministic=...)`` and
            ``nnx.view(..., deterministic=...)`` set it. ``None`` (default)
            decides nothing: a call with a dropout rate > 0 then needs one of
            those, else a DamchaValueError (as ``nnx.MultiHeadAttention``).
        metric_generator: shared generator(s), see ``DamchaAttention``.
        norm_epsilon: the LayerNorms' epsilon (Flax's default, 1e-6).
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
        norm_epsilon: float = 1e-6,
        deterministic: bool | None = None,
        rngs: nnx.Rngs,
        **attention_kwargs: Any,
    ) -> None:
        mlp_features = check_int("mlp_features", mlp_features)
        check_rate("dropout_rate", dropout_rate)
        if deterministic is not None:
            deterministic = check_bool("deterministic", deterministic)
        norm_epsilon = _check_epsilon(norm_epsilon)
        dtype, param_dtype = attention_kwargs.get("dtype"), attention_kwargs.get("param_dtype", jnp.float32)
        norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(in_features, epsilon=norm_epsilon, **norm)
        self.attention = DamchaAttention(
            num_heads,
            in_features,
            dropout_rate=attention_dropout_rate,
            deterministic=deterministic,
            metric_generator=metric_generator,
            rngs=rngs,
            **attention_kwargs,
        )
        self.mlp_norm = nnx.LayerNorm(in_features, epsilon=norm_epsilon, **norm)
        self.mlp_in = nnx.Linear(in_features, mlp_features, **norm)
        self.mlp_out = nnx.Linear(mlp_features, in_features, **norm)
        # Each dropout holds its own ``deterministic`` (the attribute eval()/train() and nnx.view set).
        self.dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)

    def __call__(
        self,
        x: Array,
        *,
        mask: Array | None = None,
        is_causal: bool = False,
        deterministic: bool | None = None,
        mask_hint: str | None = None,
    ) -> Array:
        """x (B, N, E) -> (B, N, E); ``mask_hint`` as in ``DamchaAttention``;
        ``deterministic`` overrides the dropouts' own setting for this call."""
        _check_x(x, self.mlp_norm.num_features)
        deterministic = self._check_deterministic(deterministic)
        h = self.attention(
            self.attention_norm(x), mask=mask, is_causal=is_causal, deterministic=deterministic, mask_hint=mask_hint
        )
        x = x + self._drop(h, deterministic)
        h = self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))
        return x + self._drop(h, deterministic)

    def _check_deterministic(self, deterministic: Any) -> bool | None:
        """The call's ``deterministic``; with None, each active dropout must
        have its own (one rule for the residual and the attention dropout)."""
        if deterministic is not None:
            return check_bool("deterministic", deterministic)
        for name, rate, default in (
            ("dropout_rate", self.dropout.rate, self.dropout.deterministic),
            ("attention_dropout_rate", self.attention.dropout_rate, self.attention.deterministic),
        ):
            if rate > 0 and default is None:
                raise DamchaValueError(
                    invalid_argument(
                        "deterministic",
                        f"a bool when {name}={rate} > 0: given to __call__ or the constructor, or set by "
                        "eval()/train() or nnx.view(..., deterministic=...)",
                        "deterministic=None",
                    )
                )
        return None

    def _drop(self, h: Array, deterministic: bool | None) -> Array:
        # nnx.Dropout asks for a deterministic even at rate 0: skip it then, as the attention does.
        return h if self.dropout.rate == 0.0 else self.dropout(h, deterministic=deterministic)

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
    ``block_kwargs`` go to every block (``dropout_rate``, ``deterministic``,
    the attention options, ...).
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
        # Kept apart from the generators: metric "none" has none, yet the stack's
        # EncoderConfig still records share_metric as built (it round-trips).
        self.share_metric = share_metric
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
            epsilon=_check_epsilon(block_kwargs.get("norm_epsilon", 1e-6)),
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
        _check_x(x, self.final_norm.num_features)
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
        # damcha_core's rule: shared.* whenever the stack shares, one layer too.
        return _stack_canonical(layers, self.final_norm, share=self.share_metric, causal=causal, name="encoder")

    def load_canonical(self, params: Mapping[str, Any]) -> DamchaEncoder:
        """Copy stack params in (validated against this encoder's own
        ``EncoderConfig``: names, shapes, finite values), each cast to its
        variable's dtype; returns self. A shared generator is loaded once, into
        the generator every layer holds."""
        layers = list(self.layers)
        config = _stack_config(layers, self.final_norm, share=self.share_metric, causal=False, name="encoder")
        checked = validate_stack_params(params, config)
        targets: dict[str, Any] = {}  # name -> its variable (None-free: _stack_config checks)
        for i, block in enumerate(layers):
            for key, var in canonical_variables(block.attention).items():
                name = f"layers.{i}.attention.{key}"
                targets[name if name in checked else f"shared.{key}"] = var
            targets.update({f"layers.{i}.{key}": var for key, var in _block_variables(block).items()})
        targets.update({"final_norm.scale": self.final_norm.scale, "final_norm.bias": self.final_norm.bias})
        # Every value is checked against its variable's dtype before anything is
        # assigned: a refusal must not leave the first layers loaded.
        for name, var in targets.items():
            dtype = jnp.dtype(var[...].dtype)
            check_params_fit({name: checked[name]}, dtype.name, float(jnp.finfo(dtype).max))
        # Every block is built with the attention's compute dtype (norms and FFN too).
        check_compute_fit(checked, getattr(layers[0].attention, "dtype", None))
        for name, var in targets.items():
            var[...] = jnp.asarray(checked[name], var[...].dtype)
        return self

    @classmethod
    def from_canonical(
        cls, params: Mapping[str, Any], config: EncoderConfig, *, rngs: nnx.Rngs | None = None, **kwargs: Any
    ) -> DamchaEncoder:
        """An encoder built for ``config`` (a ``damcha_core.EncoderConfig``)
        holding ``params``; ``kwargs`` are what the config does not hold
        (``dtype``, ``param_dtype``, ``dropout_rate``, ...). The encoder is
        pre-norm with ``nnx.gelu`` and a final LayerNorm, so the config must
        say ``norm_first=True``, ``activation="gelu_tanh"``, ``final_norm=True``."""
        if not isinstance(config, EncoderConfig):
            raise DamchaTypeError(
                invalid_argument("config", "a damcha_core.EncoderConfig", f"config={describe(config)}")
            )
        fixed = {"norm_first": True, "activation": "gelu_tanh", "final_norm": True}
        wrong = {k: getattr(config, k) for k, v in fixed.items() if getattr(config, k) != v}
        if wrong:
            raise DamchaValueError(
                invalid_argument(
                    "config",
                    "an EncoderConfig that DamchaEncoder computes: norm_first=True, activation='gelu_tanh', "
                    "final_norm=True",
                    ", ".join(f"config.{k}={v!r}" for k, v in wrong.items()),
                )
            )
        a = config.attention
        encoder = cls(
            config.num_layers,
            a.query_dim,
            a.num_heads,
            config.ffn_dim,
            share_metric=config.share_metric,
            rngs=rngs or nnx.Rngs(0),
            norm_epsilon=config.norm_eps,
            attention_dropout_rate=a.dropout,
            key_dim=a.key_dim,
            value_dim=a.value_dim,
            num_kv_heads=a.num_kv_heads,
            metric=a.metric,
            metric_rank=a.metric_rank,
            coupling=a.coupling,
            scale=a.scale,
            use_bias=a.use_bias,
            **kwargs,
        )
        return encoder.load_canonical(params)


def _check_epsilon(value: Any) -> float:
    if not check_real("norm_epsilon", value) > 0:  # NaN fails too
        raise DamchaValueError(invalid_argument("norm_epsilon", "a number > 0", f"norm_epsilon={describe(value)}"))
    return float(value)


def _block_variables(block: DamchaEncoderBlock) -> dict[str, Any]:
    """Stack names of one block's norm and MLP variables."""
    return {
        "norm1.scale": block.attention_norm.scale,
        "norm1.bias": block.attention_norm.bias,
        "norm2.scale": block.mlp_norm.scale,
        "norm2.bias": block.mlp_norm.bias,
        "ffn.in.kernel": block.mlp_in.kernel,
        "ffn.in.bias": block.mlp_in.bias,
        "ffn.out.kernel": block.mlp_out.kernel,
        "ffn.out.bias": block.mlp_out.bias,
    }


def _stack_config(
    blocks: Sequence[DamchaEncoderBlock], final_norm: nnx.LayerNorm | None, *, share: bool, causal: Any, name: str
) -> EncoderConfig:
    """The ``EncoderConfig`` of blocks (and a final norm), or a DamchaValueError
    listing what does not fit the stack format."""
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
    return EncoderConfig(
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


def _stack_canonical(
    blocks: Sequence[DamchaEncoderBlock], final_norm: nnx.LayerNorm | None, *, share: bool, causal: Any, name: str
) -> tuple[dict[str, np.ndarray], EncoderConfig]:
    """Blocks (and a final norm) as stack params and their ``EncoderConfig``."""
    config = _stack_config(blocks, final_norm, share=share, causal=causal, name=name)
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
        for key, var in _block_variables(block).items():
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
