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

from collections.abc import Mapping
from typing import Any

import keras
from damcha_core import DamchaValueError, describe, invalid_argument

from ._models import AttentionLayout, ModelAdapter, ProjectionSite, register_adapter


def _is(layer: Any, library: str, names: frozenset[str]) -> bool:
    return any(c.__name__ in names and c.__module__.split(".")[0] == library for c in type(layer).__mro__)


def _heads(layer: Any, attr: str) -> tuple[int, int, int]:
    """(E, heads, head_dim) of a projection of tokens (B, T, E) to stacked
    heads (B, T, heads, head_dim), read from its EinsumDense equation and kernel."""
    return _einsum_heads(attr, getattr(layer, attr, None))


def _einsum_heads(attr: str, dense: Any) -> tuple[int, int, int]:
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


def _dense_heads(layer: Any, attr: str, heads: int | None) -> tuple[int, int, int]:
    """(E, heads, head_dim) of a ``keras.layers.Dense`` projecting tokens (B, T, E)
    to flat features (B, T, heads * head_dim), which its host reshapes to
    (B, T, heads, head_dim): the kernel gives E and the features, the host's
    declared head count the split (a flat output cannot tell it)."""
    dense = getattr(layer, attr, None)
    if not isinstance(dense, keras.layers.Dense):
        raise DamchaValueError(invalid_argument(attr, "a keras.layers.Dense", f"{attr}={describe(dense)}"))
    E, F = (int(n) for n in dense.kernel.shape)
    if heads is None or heads < 1 or F % heads:
        raise DamchaValueError(
            f"`{attr}` projects {F} features, which the layer's declared head count ({heads}) does not split "
            "into whole heads (a variant with another head layout, which this adapter does not know)."
        )
    return E, heads, F // heads


def _declared(layer: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(layer, name, None)
        if value is not None:
            return int(value)
    return None


def _qk_layout(
    layer: Any,
    q_attr: str,
    k_attr: str,
    heads: tuple[str, ...],
    kv_heads: tuple[str, ...],
    self_attention: bool | None,
    *,
    flat: bool = False,
    inner: str | None = None,
) -> AttentionLayout:
    """The layout of a layer projecting queries and keys with two sublayers.

    ``flat``: the projections are ``Dense`` (flat features; the head counts are
    the layer's declared ones). ``inner``: the projections are wrappers whose
    kernel is the EinsumDense held under that attribute (Gemma 4's clippable
    projections, whose own ``call`` uses that kernel); the maps go on the
    wrappers, after everything their ``call`` does."""
    if flat:
        eq, H, d = _dense_heads(layer, q_attr, _declared(layer, *heads))
        ek, G, dk = _dense_heads(layer, k_attr, _declared(layer, *kv_heads))
    elif inner is not None:
        eq, H, d = _einsum_heads(f"{q_attr}.{inner}", getattr(getattr(layer, q_attr, None), inner, None))
        ek, G, dk = _einsum_heads(f"{k_attr}.{inner}", getattr(getattr(layer, k_attr, None), inner, None))
    else:
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

# Qwen3-MoE's Qwen3MoeAttention is Qwen3's source (per-head q/k norms) under another class name.
_LLAMA = frozenset({"LlamaAttention", "CachedMistralAttention", "QwenAttention", "Qwen3Attention", "Qwen3MoeAttention"})
_GEMMA = frozenset({"CachedGemmaAttention", "CachedGemma3Attention"})
_MERGED = frozenset({"T5Gemma2MergedAttention"})
# Llama's layout under public sublayer names: Mixtral's attention is Mistral's source with
# them (and its sliding window), Phi-3's the same projections and RoPE (its "su" scaling
# acts on the rotation, after the maps); Qwen-MoE's QwenMoeAttention is Qwen's source with them.
_PUBLIC_QK = frozenset({"CachedMixtralAttention", "Phi3Attention", "QwenMoeAttention"})
# ALiBi: the bias is added to the logits of the mapped heads, per head (Bloom adds it in the
# layer, Falcon receives it from its decoder block).
_ALIBI = frozenset({"BloomAttention", "FalconAttention"})
_GPT_OSS = frozenset({"GptOssAttention"})
# Projections by Dense (flat features, reshaped by the host to (B, T, heads, head_dim), head
# by head): attr of the query and key projections, the attributes declaring the query and
# key head counts. Everything after the reshape is per head: DINOv3's 2-D RoPE on the patch
# tokens, RoFormer V2's and ESM's RoPE, T5's relative position bias added to the logits,
# SmolLM3's RoPE (off in its NoPE layers), Gemma 3n's per-head q/k norms, RoPE and value norm
# (scale 1), SAM 3's additive box bias. PaliGemma's and Gemma 3's vision attention: plain
# softmax attention at 1/sqrt(d) (CLIP's). SegFormer's (MiT's): its keys and values project
# the tokens after a strided convolution and a norm (sequence reduction, sr_ratio > 1): the
# key maps act on those tokens, as a cross-attention's on its context.
_FLAT = {
    "DINOV3Attention": ("query_dense", "key_dense", ("num_heads",), ("num_heads",)),
    "RoformerAttention": ("q_dense", "k_dense", ("heads",), ("heads",)),  # and ESM's EsmSelfAttention
    "T5MultiHeadAttention": ("query_projector", "key_projector", ("num_heads",), ("num_heads",)),
    "SmolLM3Attention": ("q_proj", "k_proj", ("num_attention_heads",), ("num_key_value_heads",)),
    "Gemma3nTextAttention": ("q_proj", "k_proj", ("num_attention_heads",), ("num_key_value_heads",)),
    "PaliGemmaVitAttention": ("query_proj", "key_proj", ("num_heads",), ("num_heads",)),
    "Gemma3VisionAttention": ("query_proj", "key_proj", ("num_heads",), ("num_heads",)),
    "SegFormerMultiheadAttention": ("q", "k", ("num_heads",), ("num_heads",)),
    "SAM3Attention": ("q_proj", "k_proj", ("num_heads",), ("num_heads",)),
    # SAM 3's vision encoder attention: image tokens (B, H, W, E) (the maps read each alone),
    # 2-D RoPE, windowed or global self-attention, after the maps.
    "SAM3RoPEAttention": ("q_proj", "k_proj", ("num_heads",), ("num_heads",)),
}
# Projections by EinsumDense to (B, T, heads, head_dim) under public names, as _FLAT: VideoPrism's
# attention (per-dimension query scale, the same for every head, and logit soft-cap, after the
# maps; its pooler's queries are a learned probe), D-FINE's encoder and decoder self-attention
# (positions added to the tokens its query and key projections see).
_EINSUM_QK = {
    "VideoPrismAttention": ("query_dense", "key_dense", ("num_heads",), ("num_heads",)),
    "DFineMultiheadAttention": ("q_proj", "k_proj", ("num_heads",), ("num_heads",)),
}
# Qwen3.5's full-attention layers: `_query_dense` (EinsumDense, (B, T, H, 2d)) holds, for each
# query head in turn, its query and then its output gate (the host slices [..., :d] and
# [..., d:]); per-head (1 + w) RMS norms, partial RoPE (or M-RoPE), softmax attention, then the
# output times sigmoid(gate): all after the maps. Its linear-attention layers (Gated DeltaNet) are
# no softmax attention and are left as they are (as damcha_torch leaves them).
_GATED_QUERY = frozenset({"Qwen3_5Attention"})
# Swin's WindowAttention: one Dense `qkv` whose output the host views (B, N, 3, H, d): the H
# query heads, then the H key heads; a learned relative position bias per head on the logits
# (positions only) and the shifted-window mask, after the maps.
# Qwen3.5's vision attention: the same fused `qkv` over the patches of all its images as one
# sequence (N, E) without a batch axis (the maps read each patch token alone); 2-D RoPE and
# attention inside each frame (cu_seqlens) after the maps.
_FUSED_QKV = frozenset({"WindowAttention", "Qwen3_5VisionAttention"})
# Refused by name, with the reason (the expected part of the message; the layer is named after
# it): layers that compute attention convert() cannot map faithfully. Matching a block claims its
# sublayers, so a block whose attention is not attention-named (Stable Diffusion 3's MMDiTBlock)
# is refused rather than skipped while the model's other attention layers convert.
_TOKENWISE = "query and key projections of each token by a Dense or EinsumDense layer, which convert()'s maps wrap"
_RELATIVE = "an attention layer whose logits compare its queries with its keys (plus terms of positions only); "
_REFUSED = {
    "MMDiTBlock": (
        "an attention layer that projects its queries and keys once each; Stable Diffusion 3's MMDiTBlock "
        "attends jointly over its text and image streams, each projected by a qkv Dense of its own (in its "
        "DismantledBlocks), and convert() maps one query and one key projection per attention layer"
    ),
    "DoubleStreamBlock": (
        "an attention layer that projects its queries and keys once each; Flux's DoubleStreamBlock attends "
        "jointly over its text and image streams, each projected by a qkv Dense of its own, and convert() "
        "maps one query and one key projection per attention layer"
    ),
    "DFineMultiscaleDeformableAttention": (
        "softmax attention of queries against keys; D-FINE's multi-scale deformable attention has no keys: "
        "it samples the values at offsets from reference points and weighs them by a softmax of a "
        "projection of the queries alone, so there is no q k^T for the maps to act on"
    ),
    "MultiHeadAttentionWithRelativePE": (
        f"{_RELATIVE}ViTDet's attention (SAM's image encoder) projects image tokens (B, H, W, E) with one "
        "qkv Dense and, with use_rel_pos=True, adds to its logits its queries' products with learned "
        "relative-position tables (decomposed relative positions), which no key map would reach (as "
        "XLNet's relative attention)"
    ),
    "MultiQueryAttention2d": (
        f"{_TOKENWISE}; MobileNetV5's multi-query attention projects feature maps (B, H, W, C) with "
        "convolutions (after pooling the queries and strided depthwise convolutions of the keys, when set)"
    ),
    "Conv2DMultiHeadAttention": (
        f"{_TOKENWISE}; the VAE's attention (Stable Diffusion 3, Flux) projects feature maps (B, H, W, C) "
        "with 1x1 convolutions"
    ),
    "Gemma3nAudioAttention": (
        f"{_RELATIVE}Gemma 3n's audio attention adds its queries' products with relative-position "
        "embeddings projected by its own pos_proj (Transformer-XL's relative attention, over chunked local "
        "context), which no key map would reach (as XLNet's relative attention)"
    ),
    "Gemma4AudioAttention": (
        f"{_RELATIVE}Gemma 4's audio attention adds its queries' products with relative-position "
        "embeddings projected by its own pos_proj (Transformer-XL's relative attention, over chunked local "
        "context), which no key map would reach (as XLNet's relative attention)"
    ),
}
# The blocks of norms around some of them (attention-named, holding them): matched first, they
# claim them and are refused with their reason, rather than listed as unknown layouts beside them.
_REFUSED["Gemma3nAudioConformerAttention"] = _REFUSED["Gemma3nAudioAttention"]
_REFUSED["Gemma4AudioConformerAttention"] = _REFUSED["Gemma4AudioAttention"]
_REFUSED["MobileAttention"] = _REFUSED["MultiQueryAttention2d"]  # MobileNetV5's norm around it
_GEMMA4_TEXT = frozenset({"Gemma4TextAttention"})
_GEMMA4_VISION = frozenset({"Gemma4VisionAttention"})
_DEBERTA = frozenset({"DisentangledSelfAttention", "DisentangledAttentionEncoder"})
_GPT_NEOX = frozenset({"GPTNeoXAttention"})


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
    # T5Gemma's T5GemmaAttention (a subclass) is self- or cross-attention by `attention_type`;
    # T5Gemma 2's decoder attention (T5Gemma2MergedAttention) attends over its own keys and the
    # encoder's, both projected by its key_dense: keys of other tokens than its queries.
    self_attention = getattr(layer, "attention_type", "self") != "cross" and not _is(layer, "keras_hub", _MERGED)
    return _qk_layout(layer, "query_dense", "key_dense", ("num_query_heads",), ("num_key_value_heads",), self_attention)


def _alibi_layout(layer: Any) -> AttentionLayout:
    q_attr, k_attr = ("_query_dense", "_key_dense") if hasattr(layer, "_query_dense") else ("query_dense", "key_dense")
    return _qk_layout(layer, q_attr, k_attr, ("num_heads",), ("num_heads",), True)


def _table_class(layer: Any, table: Mapping[str, Any] | frozenset[str]) -> str | None:
    """The name of the first KerasHub class in ``layer``'s MRO that ``table`` names, or None."""
    return next(
        (c.__name__ for c in type(layer).__mro__ if c.__name__ in table and c.__module__.split(".")[0] == "keras_hub"),
        None,
    )


def _flat_class(layer: Any) -> str | None:
    """The name of the class in ``layer``'s MRO that _FLAT describes, or None."""
    return _table_class(layer, _FLAT)


def _named_side(layer: Any) -> bool | None:
    """Self- (True) or cross-attention (False) as the layer's name says ("self_attn",
    "cross_attn", "text_cross_attn", "pooling_attention"), None when it says neither."""
    lowered = layer.name.lower()
    return False if "cross" in lowered or "pool" in lowered else True if "self" in lowered else None


_Entry = tuple[str, str, tuple[str, ...], tuple[str, ...]]


def _table_layout(layer: Any, table: Mapping[str, _Entry]) -> tuple[str, str, str, tuple[str, ...], tuple[str, ...]]:
    name = _table_class(layer, table) or ""
    if name not in table:  # matches() accepted the layer: only a class changed since would get here
        raise DamchaValueError(
            invalid_argument("layer", f"a KerasHub layer of {sorted(table)}", f"{type(layer).__name__} {layer.name!r}")
        )
    return (name, *table[name])


def _flat_layout(layer: Any) -> AttentionLayout:
    name, q_attr, k_attr, heads, kv_heads = _table_layout(layer, _FLAT)
    self_attention: bool | None = True
    if name in ("T5MultiHeadAttention", "SAM3Attention"):
        # One class serves self- and cross-attention (keys from another sequence, a call
        # argument); T5's transformer layers name them "self_attention"/"cross_attention",
        # SAM 3's encoders and decoders "self_attn", "cross_attn", "text_cross_attn", ...
        self_attention = _named_side(layer)
    elif name == "SegFormerMultiheadAttention":
        # sr_ratio > 1: keys and values project the tokens reduced by a strided convolution.
        self_attention = int(getattr(layer, "sr_ratio", 1)) <= 1
    elif name == "Gemma3nTextAttention":
        _refuse_kv_shared(layer, "Gemma 3n", "its k_proj is not called")
    return _qk_layout(layer, q_attr, k_attr, heads, kv_heads, self_attention, flat=True)


def _einsum_qk_layout(layer: Any) -> AttentionLayout:
    name, q_attr, k_attr, heads, kv_heads = _table_layout(layer, _EINSUM_QK)
    # VideoPrism's pooler calls its attention on a learned query probe ("pooling_attention");
    # D-FINE's layer is self-attention only.
    self_attention = _named_side(layer) if name == "VideoPrismAttention" else True
    return _qk_layout(layer, q_attr, k_attr, heads, kv_heads, self_attention)


def _refuse_kv_shared(layer: Any, model: str, projection: str) -> None:
    if getattr(layer, "is_kv_shared_layer", False):
        raise DamchaValueError(
            invalid_argument(
                "layer",
                f"a layer that projects its own keys; this KV-shared layer (is_kv_shared_layer=True, {model}'s "
                "num_kv_shared_layers) attends over the keys and values of an earlier layer's cache, and "
                "convert() maps a layer's queries and keys together",
                f"{type(layer).__name__} {layer.name!r} ({projection})",
            )
        )


def _gated_query_layout(layer: Any) -> AttentionLayout:
    """Qwen3.5's ``_query_dense`` (B, T, H, 2d): per query head its query, then its
    output gate; the maps read the queries as a site of H runs (``groups=H``)."""
    E, H, width = _heads(layer, "_query_dense")
    d, declared = _declared(layer, "head_dim"), _declared(layer, "num_query_heads")
    if d is None or width != 2 * d or declared != H:
        raise DamchaValueError(
            invalid_argument(
                "_query_dense",
                f"Qwen3.5's layout, num_query_heads={declared} heads of a query and its output gate, "
                f"2 * head_dim={None if d is None else 2 * d} features each (a variant this adapter does not know)",
                f"{H} heads of {width} features",
            )
        )
    ek, G, dk = _heads(layer, "_key_dense")
    if dk != d or _declared(layer, "num_key_value_heads") != G or H % G:
        raise DamchaValueError(
            invalid_argument(
                "_key_dense",
                f"num_key_value_heads={_declared(layer, 'num_key_value_heads')} key heads of head_dim={d} "
                f"features, dividing the {H} query heads",
                f"{G} heads of {dk} features",
            )
        )
    sites = (ProjectionSite("_query_dense", q=0, groups=H), ProjectionSite("_key_dense", k=0))
    return AttentionLayout(H, G, d, E, ek, sites, self_attention=True)


def _fused_qkv_layout(layer: Any) -> AttentionLayout:
    """Swin's ``qkv`` Dense, viewed (B, N, 3, H, d) by the host: queries, keys, values."""
    heads, d = _declared(layer, "num_heads"), _declared(layer, "head_dim")
    E, parts, width = _dense_heads(layer, "qkv", None if heads is None else 3 * heads)
    if width != d:
        raise DamchaValueError(
            invalid_argument(
                "qkv",
                f"Swin's layout, 3 * num_heads={parts} heads of head_dim={d} features (a variant this adapter does "
                "not know)",
                f"{parts} heads of {width} features",
            )
        )
    H = parts // 3  # the query heads, then the key heads, then the value heads
    return AttentionLayout(H, H, width, E, E, (ProjectionSite("qkv", q=0, k=H * width),), self_attention=True)


def _refused_layout(layer: Any) -> AttentionLayout:
    name = _table_class(layer, _REFUSED) or ""
    expected = _REFUSED.get(name, f"a KerasHub layer of {sorted(_REFUSED)}")  # matches() checked the name
    raise DamchaValueError(invalid_argument("layer", expected, f"{type(layer).__name__} {layer.name!r}"))


def _gemma4_text_layout(layer: Any) -> AttentionLayout:
    if getattr(layer, "is_kv_shared_layer", False):
        raise DamchaValueError(
            invalid_argument(
                "layer",
                "a layer that projects its own keys; this KV-shared layer (is_kv_shared_layer=True, Gemma 4's "
                "num_kv_shared_layers) has no key projection and attends over the keys and values of an earlier "
                "layer's cache, and convert() maps a layer's queries and keys together",
                f"{type(layer).__name__} {layer.name!r} with key_dense=None",
            )
        )
    if getattr(layer, "attention_k_eq_v", False):
        raise DamchaValueError(
            invalid_argument(
                "layer",
                "a layer whose values have a projection of their own; this layer's key projection also gives its "
                "values (attention_k_eq_v=True, Gemma 4's global layers with num_global_key_value_heads), so a map "
                "on its keys would map its values too",
                f"{type(layer).__name__} {layer.name!r} with value_dense=None",
            )
        )
    return _qk_layout(
        layer, "query_dense", "key_dense", ("num_query_heads",), ("effective_num_kv_heads", "num_key_value_heads"), True
    )


def _gemma4_vision_layout(layer: Any) -> AttentionLayout:
    # Gemma4ClippableEinsumDense clips its input and output around an einsum with the kernel
    # of its EinsumDense `dense` (which it never calls): the maps go on the clippable layer,
    # after the output clip, before the per-head q/k norms and the 2-D RoPE.
    return _qk_layout(
        layer, "query_dense", "key_dense", ("num_query_heads",), ("num_key_value_heads",), True, inner="dense"
    )


def _deberta_layout(layer: Any) -> AttentionLayout:
    raise DamchaValueError(
        invalid_argument(
            "layer",
            "an attention layer whose query and key projections project tokens only; DeBERTa V3's "
            "DisentangledSelfAttention also passes the relative position embeddings through its query and key "
            "projections (the content-to-position and position-to-content scores), where the maps would act with "
            "maps generated from position embeddings rather than from the tokens (a model the DAMCHA definition, "
            "one map per token on that token's query and key heads, does not cover; the metric penalty would "
            "count them as tokens too)",
            f"{type(layer).__name__} {layer.name!r}",
        )
    )


def _gpt_neox_layout(layer: Any) -> AttentionLayout:
    """KerasHub GPT-NeoX's fused ``_qkv_dense`` (EinsumDense 'abc,cde->abde', output
    (B, T, H, 3d)): per head its query, key and value side by side (the host slices
    [..., :d], [..., d:2d], [..., 2d:]), one run of features per head. Its partial
    RoPE acts on the mapped heads."""
    E, H, width = _heads(layer, "_qkv_dense")
    d = _declared(layer, "attn_head_size")
    if d is None or width != 3 * d or _declared(layer, "num_heads") != H:
        raise DamchaValueError(
            invalid_argument(
                "_qkv_dense",
                f"GPT-NeoX's layout, num_heads={_declared(layer, 'num_heads')} heads of 3 * attn_head_size={d} "
                "features (a variant this adapter does not know)",
                f"{H} heads of {width} features",
            )
        )
    return AttentionLayout(H, H, d, E, E, (ProjectionSite("_qkv_dense", q=0, k=d, groups=H),))


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
        "KerasHub LlamaAttention, CachedMistralAttention, QwenAttention, Qwen3Attention, Qwen3MoeAttention (RoPE; "
        "MHA, GQA, MQA; Qwen3's per-head q/k norms) (_query_dense/_key_dense)",
        lambda layer: _is(layer, "keras_hub", _LLAMA),
        _llama_layout,
    ),
    ModelAdapter(
        "keras-hub-gemma",
        "KerasHub CachedGemmaAttention (Gemma, Gemma 2) and CachedGemma3Attention (Gemma 3; per-head q/k "
        "norms; T5Gemma's and T5Gemma 2's, whose decoder attends over its own and the encoder's keys) (RoPE; "
        "MHA, GQA, MQA) (query_dense/key_dense, kernels (heads, E, d))",
        lambda layer: _is(layer, "keras_hub", _GEMMA),
        _gemma_layout,
    ),
    ModelAdapter(
        "keras-hub-mixtral-phi3",
        "KerasHub CachedMixtralAttention (Mixtral; sliding window), Phi3Attention (Phi-3) and QwenMoeAttention "
        "(Qwen-MoE) (RoPE; MHA, GQA, MQA) (query_dense/key_dense)",
        lambda layer: _is(layer, "keras_hub", _PUBLIC_QK),
        _public_qk_layout,
    ),
    ModelAdapter(
        "keras-hub-gpt-oss",
        "KerasHub GptOssAttention (GPT-OSS: YaRN RoPE, attention sinks, sliding window; MHA, GQA, MQA) "
        "(query_dense/key_dense)",
        lambda layer: _is(layer, "keras_hub", _GPT_OSS),
        _public_qk_layout,
    ),
    ModelAdapter(
        "keras-hub-alibi",
        "KerasHub BloomAttention (_query_dense/_key_dense) and FalconAttention (query_dense/key_dense) (ALiBi "
        "biases on the logits)",
        lambda layer: _is(layer, "keras_hub", _ALIBI),
        _alibi_layout,
    ),
    ModelAdapter(
        "keras-hub-dense-qk",
        "KerasHub attention projecting with Dense (flat features): DINOV3Attention (2-D RoPE; query_dense/"
        "key_dense), RoformerAttention and ESM's EsmSelfAttention (RoPE; q_dense/k_dense), T5MultiHeadAttention "
        "(relative position bias; query_projector/key_projector), SmolLM3Attention (RoPE or NoPE; GQA; "
        "q_proj/k_proj), Gemma 3n's Gemma3nTextAttention (per-head q/k norms, RoPE; GQA; not its KV-shared layers; "
        "q_proj/k_proj), PaliGemma's PaliGemmaVitAttention and Gemma 3's Gemma3VisionAttention (query_proj/"
        "key_proj), SegFormer's (MiT's) SegFormerMultiheadAttention (keys of the sequence-reduced tokens; q/k), "
        "SAM 3's SAM3Attention (q_proj/k_proj)",
        lambda layer: _flat_class(layer) is not None,
        _flat_layout,
    ),
    ModelAdapter(
        "keras-hub-gemma4",
        "KerasHub Gemma4TextAttention (per-head q/k norms, RoPE, partial RoPE; MHA, GQA, MQA; not its "
        "KV-shared layers nor those whose keys are their values) and Gemma4VisionAttention (clipped "
        "projections, 2-D RoPE) (query_dense/key_dense)",
        lambda layer: _is(layer, "keras_hub", _GEMMA4_TEXT | _GEMMA4_VISION),
        lambda layer: (
            _gemma4_vision_layout(layer) if _is(layer, "keras_hub", _GEMMA4_VISION) else _gemma4_text_layout(layer)
        ),
    ),
    ModelAdapter(
        "keras-hub-deberta-v3",
        "KerasHub DeBERTa V3's DisentangledSelfAttention and its encoder layer: refused (relative positions "
        "projected through the query and key projections)",
        lambda layer: _is(layer, "keras_hub", _DEBERTA),
        _deberta_layout,
    ),
    ModelAdapter(
        "keras-hub-einsum-qk",
        "KerasHub attention projecting with EinsumDense under public names: VideoPrismAttention (per-dimension "
        "query scale, logit soft-cap; its pooler's learned query probe) (query_dense/key_dense) and D-FINE's "
        "DFineMultiheadAttention (q_proj/k_proj)",
        lambda layer: _table_class(layer, _EINSUM_QK) is not None,
        _einsum_qk_layout,
    ),
    ModelAdapter(
        "keras-hub-gated-query",
        "KerasHub Qwen3_5Attention (Qwen3.5's full-attention layers: each query head followed by its output gate "
        "in _query_dense; per-head q/k norms, partial RoPE; MHA, GQA, MQA) (_query_dense/_key_dense); its "
        "linear-attention layers (Gated DeltaNet) are no softmax attention and stay as they are",
        lambda layer: _is(layer, "keras_hub", _GATED_QUERY),
        _gated_query_layout,
    ),
    ModelAdapter(
        "keras-hub-fused-qkv",
        "KerasHub Swin WindowAttention (one qkv Dense, the query heads then the key heads; relative position "
        "bias, shifted windows) and Qwen3.5's Qwen3_5VisionAttention (the same over patch tokens (N, E); 2-D "
        "RoPE, attention per frame) (qkv)",
        lambda layer: _is(layer, "keras_hub", _FUSED_QKV),
        _fused_qkv_layout,
    ),
    ModelAdapter(
        "keras-hub-refused",
        "KerasHub layers refused with the reason: Stable Diffusion 3's MMDiTBlock and Flux's DoubleStreamBlock "
        "(joint attention over two streams, each projected by its own qkv), D-FINE's deformable attention (no "
        "keys), the attention of ViTDet (SAM: relative positions from the queries), MobileNetV5 and the VAE "
        "(convolutions of feature maps), the audio attention of Gemma 3n and Gemma 4 (relative positions "
        "projected apart from the keys)",
        lambda layer: _table_class(layer, _REFUSED) is not None,
        _refused_layout,
    ),
    ModelAdapter(
        "keras-hub-gpt-neox",
        "KerasHub GPTNeoXAttention (one fused qkv projection, each head's query, key and value side by side; "
        "partial RoPE) (_qkv_dense)",
        lambda layer: _is(layer, "keras_hub", _GPT_NEOX),
        _gpt_neox_layout,
    ),
):
    register_adapter(_adapter)
