"""Trained Keras and JAX encoder stacks as ``EncoderConfig`` stack parameters.

Each converter reads one framework's stack (``damcha_keras`` blocks, a
``damcha_jax.DamchaEncoder``) into the framework-free stack format that
``export_encoder`` and ``encoder_forward`` take, so a model trained in any
port ships through the same exporter. The framework is imported only inside
the converter (the caller already has it loaded).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from damcha_core import DamchaTypeError, DamchaValueError, describe

from ._stack import SHARED, EncoderConfig


def _check_architecture(problems: list[str], name: str, value: Any) -> None:
    if problems:
        raise DamchaValueError(
            f"`{name}` does not fit the exported stack format; it needs " + "; ".join(dict.fromkeys(problems))
            + f". Received: {name}={describe(value)}"
        )


def _sharing(generators: list[dict[str, Any]]) -> bool:
    """True when every layer uses layer 0's generator objects (stack-wise sharing).

    Any other pattern exports per-layer copies: exact for inference, since a
    shared generator only differs from copies of it in training.
    """
    first = generators[0]
    return bool(first) and len(generators) > 1 and all(
        all(g.get(side) is gen for side, gen in first.items()) for g in generators[1:]
    )


def collect_stack_params(
    config: EncoderConfig, layers: list[dict[str, Any]], final_norm: tuple[Any, Any] | None = None
) -> dict[str, np.ndarray]:
    """Float64 stack params from per-layer dicts of canonical attention params
    (``"attention"``), norms and FFN arrays (``"norm1.scale"``, ...,
    ``"ffn.out.bias"``), plus the final norm's (scale, bias) when the config has one."""
    params: dict[str, np.ndarray] = {}
    shapes = config.param_shapes()
    for i, layer in enumerate(layers):
        pre = f"layers.{i}."
        for key, value in layer["attention"].items():
            if SHARED + key in shapes:
                params.setdefault(SHARED + key, value)  # the shared generator, once (from layer 0)
            else:
                params[f"{pre}attention.{key}"] = value
        for key in ("norm1.scale", "norm1.bias", "norm2.scale", "norm2.bias",
                    "ffn.in.kernel", "ffn.in.bias", "ffn.out.kernel", "ffn.out.bias"):
            params[pre + key] = layer[key]
    if final_norm is not None:
        params["final_norm.scale"], params["final_norm.bias"] = final_norm
    return {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}


def encoder_from_keras(blocks: Sequence[Any], *, causal: bool | None = None) -> tuple[dict[str, np.ndarray], EncoderConfig]:
    """Stack parameters and ``EncoderConfig`` of built ``damcha_keras`` blocks.

    Args:
        blocks: ``damcha_keras.TransformerEncoder`` or ``TransformerDecoder``
            blocks (all of one kind), applied in this order, each built (called
            once). They must share one attention config, ``normalize_first``,
            activation ("relu", or exact "gelu") and LayerNorm epsilon. A
            generator shared by every block is stored once; otherwise each
            block's is exported.
        causal: defaults to True for ``TransformerDecoder`` blocks (always
            causal), False for encoder blocks; a decoder cannot be exported
            non-causal.

    Returns:
        ``(params, config)`` with float64 NumPy arrays; ``config.final_norm`` is
        False (KerasHub-style blocks have no final LayerNorm).
    """
    import keras

    import damcha_keras as dk

    if isinstance(blocks, (dk.TransformerEncoder, dk.TransformerDecoder)) or not isinstance(blocks, Sequence) or not blocks:
        raise DamchaTypeError(
            f"`blocks` must be a non-empty list of damcha_keras TransformerEncoder/TransformerDecoder blocks. "
            f"Received: blocks={describe(blocks)}"
        )
    kinds = {type(b) for b in blocks}
    if not kinds <= {dk.TransformerEncoder, dk.TransformerDecoder} or len(kinds) != 1:
        raise DamchaTypeError(
            "`blocks` must all be damcha_keras.TransformerEncoder or all TransformerDecoder. "
            f"Received: {sorted(k.__name__ for k in kinds)}"
        )
    decoder = kinds == {dk.TransformerDecoder}
    causal = decoder if causal is None else causal
    if decoder and not causal:
        raise DamchaValueError("TransformerDecoder blocks are always causal. Received: causal=False")
    problems = []
    first = blocks[0]
    activations = {keras.activations.relu: "relu", keras.activations.gelu: "gelu"}
    if any(not b.built for b in blocks):
        problems.append("built blocks (call the model once)")
    else:
        for i, b in enumerate(blocks):
            if b.activation not in activations:
                problems.append(f"activation relu or exact gelu (block {i} has {getattr(b.activation, '__name__', b.activation)})")
            if b.activation is not first.activation or b.normalize_first != first.normalize_first:
                problems.append(f"one activation and normalize_first (block {i} differs)")
            if b.layer_norm_epsilon != first.layer_norm_epsilon:
                problems.append(f"one layer_norm_epsilon (block {i} differs)")
            if b._attention.config != first._attention.config:
                problems.append(f"one attention config (block {i} differs)")
    _check_architecture(problems, "blocks", blocks)
    share = _sharing([dict(b._attention.metric_generators) for b in blocks])
    config = EncoderConfig(
        first._attention.config, num_layers=len(blocks), ffn_dim=first.intermediate_dim, share_metric=share,
        norm_eps=float(first.layer_norm_epsilon), causal=bool(causal), norm_first=bool(first.normalize_first),
        activation=activations[first.activation], final_norm=False,
    )
    np_ = lambda v: np.asarray(keras.ops.convert_to_numpy(v))  # noqa: E731
    layers = [{
        "attention": b._attention.to_canonical(),
        "norm1.scale": np_(b._attention_norm.gamma), "norm1.bias": np_(b._attention_norm.beta),
        "norm2.scale": np_(b._ffn_norm.gamma), "norm2.bias": np_(b._ffn_norm.beta),
        "ffn.in.kernel": np_(b._ffn_in.kernel), "ffn.in.bias": np_(b._ffn_in.bias),
        "ffn.out.kernel": np_(b._ffn_out.kernel), "ffn.out.bias": np_(b._ffn_out.bias),
    } for b in blocks]
    return collect_stack_params(config, layers), config


def encoder_from_jax(encoder: Any, *, causal: bool = False) -> tuple[dict[str, np.ndarray], EncoderConfig]:
    """Stack parameters and ``EncoderConfig`` of a ``damcha_jax.DamchaEncoder``.

    The encoder's own ``to_canonical(causal=causal)`` (DECISIONS 4, 6): its
    blocks are pre-norm with Flax's default ``nnx.gelu`` (the tanh
    approximation: ``activation="gelu_tanh"``) and a final LayerNorm; the
    epsilon is read from the norms (Flax's default is 1e-6).

    Args:
        encoder: a ``damcha_jax.DamchaEncoder``.
        causal: whether the exported stack applies the causal rule (the JAX
            encoder takes ``is_causal`` per call).

    Returns:
        ``(params, config)`` with float64 NumPy arrays.
    """
    import damcha_jax as dj

    if not isinstance(encoder, dj.DamchaEncoder):
        raise DamchaTypeError(f"`encoder` must be a damcha_jax.DamchaEncoder. Received: encoder={describe(encoder)}")
    return encoder.to_canonical(causal=causal)
