"""The built-in adapters of ``damcha_keras.convert``: one small function per
attention layout.

KerasHub classes are recognised by class name and defining library (any class
in the MRO), so keras_hub is not imported here; a subclass of a supported
class is supported too. Each layout reads the head sizes from the projections'
``EinsumDense`` equations and kernels and checks them against the host's own
numbers, so a variant with another head layout is refused rather than
mis-mapped.
"""

from __future__ import annotations

from typing import Any

import keras
from damcha_core import DamchaValueError, describe, invalid_argument

from ._models import AttentionLayout, ModelAdapter, ProjectionSite, register_adapter


def _is(layer: Any, library: str, names: frozenset[str]) -> bool:
    return any(c.__name__ in names and c.__module__.split(".")[0] == library for c in type(layer).__mro__)


def _heads(layer: Any, attr: str) -> tuple[int, int, int]:
    """(E, heads, head_dim) of a projection of tokens (B, T, E) to stacked
    heads (B, T, heads, head_dim), read from its EinsumDense equation and kernel."""
    dense = getattr(layer, attr, None)
    if not isinstance(dense, keras.layers.EinsumDense):
        raise DamchaValueError(invalid_argument(attr, "a keras.layers.EinsumDense", f"{attr}={describe(dense)}"))
    equation = dense.equation.replace(" ", "")
    inputs, _, out = equation.partition("->")
    tokens, _, kernel = inputs.partition(",")
    if (
        len(tokens) != 3
        or len(out) != 4
        or out[:2] != tokens[:2]
        or len(kernel) != 3
        or set(kernel) != {tokens[2], out[2], out[3]}
    ):
        raise DamchaValueError(
            f"`{attr}` computes {dense.equation!r}; convert() maps projections of tokens (B, T, E) to "
            "stacked heads (B, T, heads, head_dim) (inputs of rank 3, no attention_axes)."
        )
    # Keras's `kernel` is the logical kernel in every quantization mode (int4's packed one
    # unpacked), so a projection quantized after convert() (a .keras file loading) reads as
    # its float original did; convert() itself refuses quantized projections (_check_sites).
    shape = tuple(int(n) for n in dense.kernel.shape)
    return shape[kernel.index(tokens[2])], shape[kernel.index(out[2])], shape[kernel.index(out[3])]


def _declared(layer: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(layer, name, None)
        if value is not None:
            return int(value)
    return None


def _qk_layout(
    layer: Any, q_attr: str, k_attr: str, heads: tuple[str, ...], kv_heads: tuple[str, ...], self_attention: bool | None
) -> AttentionLayout:
    eq, H, d = _heads(layer, q_attr)
    ek, G, dk = _heads(layer, k_attr)
    if dk != d:
        raise DamchaValueError(
            f"query and key heads must have one size. Received: {q_attr} head_dim={d}, {k_attr} head_dim={dk}"
        )
    for attr, found, declared in ((q_attr, H, _declared(layer, *heads)), (k_attr, G, _declared(layer, *kv_heads))):
        if declared is not None and found != declared:
            raise DamchaValueError(
                f"`{attr}` projects {found} heads, the layer declares {declared} (a variant with another "
                "head layout, which this adapter does not know)."
            )
    if H % G:
        raise DamchaValueError(f"the key heads must divide the query heads. Received: {H} query heads, {G} key heads")
    return AttentionLayout(
        H, G, d, eq, ek, (ProjectionSite(q_attr, q=0), ProjectionSite(k_attr, k=0)), self_attention=self_attention
    )


# ----------------------------------------------------------------- Keras MHA


_MHA_SUBLAYERS = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")
_MOONSHINE = frozenset({"MoonshineMultiHeadAttention"})


def _mha_layout(layer: Any) -> AttentionLayout:
    # A subclass holding weights beyond the four projections computes something more than
    # MHA from them (XLNet's TwoStreamRelativeAttention: relative-position keys from
    # `_encoding_dense`, which no map would reach): refused rather than half mapped.
    covered = {id(v) for attr in _MHA_SUBLAYERS for v in getattr(getattr(layer, attr, None), "weights", [])}
    extra = [v.path for v in layer.weights if id(v) not in covered]
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise DamchaValueError(
            invalid_argument(
                "layer",
                "a MultiHeadAttention whose only weights are its query, key, value and output projections "
                f"({', '.join(_MHA_SUBLAYERS)}); this {type(layer).__name__} also holds weights the maps would "
                "not reach (relative positions, extra projections)",
                f"weights {shown}",
            )
        )
    # A MultiHeadAttention can be called on one sequence or two; KerasHub names
    # its cross-attention layers "cross_attention" (TransformerDecoder, Whisper).
    # Moonshine's decoder leaves its cross-attention a default name, but builds it
    # (alone) without rotary embeddings.
    cross = "cross" in layer.name.lower() or (
        _is(layer, "keras_hub", _MOONSHINE) and not getattr(layer, "apply_rotary_embedding", True)
    )
    if isinstance(layer, keras.layers.GroupQueryAttention):
        return _qk_layout(
            layer,
            "_query_dense",
            "_key_dense",
            ("num_query_heads",),
            ("num_key_value_heads",),
            False if cross else None,
        )
    return _qk_layout(layer, "_query_dense", "_key_dense", ("_num_heads",), ("_num_heads",), False if cross else None)


# ------------------------------------------------------------------ KerasHub

_LLAMA = frozenset({"LlamaAttention", "CachedMistralAttention", "QwenAttention", "Qwen3Attention"})
_GEMMA = frozenset({"CachedGemmaAttention", "CachedGemma3Attention"})
# Llama's layout under public sublayer names: Mixtral's attention is Mistral's source with
# them (and its sliding window), Phi-3's the same projections and RoPE (its "su" scaling
# acts on the rotation, after the maps).
_PUBLIC_QK = frozenset({"CachedMixtralAttention", "Phi3Attention"})


def _llama_layout(layer: Any) -> AttentionLayout:
    return _qk_layout(
        layer,
        "_query_dense",
        "_key_dense",
        ("num_query_heads", "_num_query_heads"),
        ("num_key_value_heads", "_num_key_value_heads"),
        True,
    )


def _public_qk_layout(layer: Any) -> AttentionLayout:
    return _qk_layout(layer, "query_dense", "key_dense", ("num_query_heads",), ("num_key_value_heads",), True)


def _gemma_layout(layer: Any) -> AttentionLayout:
    # T5Gemma's T5GemmaAttention (a subclass) is self- or cross-attention by `attention_type`.
    self_attention = getattr(layer, "attention_type", "self") != "cross"
    return _qk_layout(layer, "query_dense", "key_dense", ("num_query_heads",), ("num_key_value_heads",), self_attention)


for _adapter in (
    ModelAdapter(
        "keras-mha",
        "keras.layers.MultiHeadAttention and GroupQueryAttention, and subclasses: KerasHub's "
        "CachedMultiHeadAttention (GPT-2, OPT, BART, ...; Moonshine's, with RoPE) and the MHA of its "
        "TransformerEncoder/Decoder (BERT, RoBERTa, ...) and of its ViT encoder blocks, rank-3 inputs "
        "(_query_dense/_key_dense)",
        lambda layer: isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)),
        _mha_layout,
    ),
    ModelAdapter(
        "keras-hub-llama",
        "KerasHub LlamaAttention, CachedMistralAttention, QwenAttention, Qwen3Attention (RoPE; MHA, GQA, "
        "MQA; Qwen3's per-head q/k norms) (_query_dense/_key_dense)",
        lambda layer: _is(layer, "keras_hub", _LLAMA),
        _llama_layout,
    ),
    ModelAdapter(
        "keras-hub-gemma",
        "KerasHub CachedGemmaAttention (Gemma, Gemma 2) and CachedGemma3Attention (Gemma 3; per-head q/k "
        "norms) (RoPE; MHA, GQA, MQA) (query_dense/key_dense, kernels (heads, E, d))",
        lambda layer: _is(layer, "keras_hub", _GEMMA),
        _gemma_layout,
    ),
    ModelAdapter(
        "keras-hub-mixtral-phi3",
        "KerasHub CachedMixtralAttention (Mixtral; sliding window) and Phi3Attention (Phi-3) (RoPE; MHA, GQA, "
        "MQA) (query_dense/key_dense)",
        lambda layer: _is(layer, "keras_hub", _PUBLIC_QK),
        _public_qk_layout,
    ),
):
    register_adapter(_adapter)
