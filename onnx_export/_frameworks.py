"""Trained Keras and JAX encoder stacks as ``EncoderConfig`` stack parameters.

Each converter hands one framework's stack (``damcha_keras`` blocks, a
``damcha_jax.DamchaEncoder``) to that port's public ``to_canonical`` of the
stack, which returns the framework-free stack format that ``export_encoder``
and ``encoder_forward`` take, so a model trained in any port ships through the
same exporter. The framework is imported only inside the converter (the
caller already has it loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from damcha_core import DamchaTypeError, describe, invalid_argument

from ._stack import EncoderConfig


def encoder_from_keras(
    blocks: Sequence[Any], *, causal: bool | None = None
) -> tuple[dict[str, np.ndarray], EncoderConfig]:
    """Stack parameters and ``EncoderConfig`` of built ``damcha_keras`` blocks.

    The blocks' own ``damcha_keras.stack_to_canonical(blocks, causal=causal)``
    (DECISIONS 4, 6): no private attributes are read here.

    Args:
        blocks: ``damcha_keras.TransformerEncoder`` or ``TransformerDecoder``
            blocks (all of one kind), applied in this order, each built (called
            once), optionally followed by a final ``keras.layers.LayerNormalization``.
            They must share one attention config, ``normalize_first``,
            activation ("relu", exact "gelu" or ``damcha_keras.gelu_tanh``) and
            LayerNorm epsilon. A generator shared by every block is stored
            once; otherwise each block's is exported.
        causal: defaults to True for ``TransformerDecoder`` blocks (always
            causal), False for encoder blocks; a decoder cannot be exported
            non-causal.

    Returns:
        ``(params, config)`` with float64 NumPy arrays; ``config.final_norm``
        is True only when a final LayerNormalization follows the blocks.
    """
    import damcha_keras as dk

    return dk.stack_to_canonical(blocks, causal=causal)


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
        raise DamchaTypeError(invalid_argument("encoder", "a damcha_jax.DamchaEncoder", f"encoder={describe(encoder)}"))
    return encoder.to_canonical(causal=causal)
