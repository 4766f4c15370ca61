"""Built-in adapters of ``convert`` for layouts beyond Llama's ``q_proj``/``k_proj``.

Each class below was read in its transformers source (5.24), forward and the
layers that build and call it:

* gated queries (Qwen3-Next, Qwen3.5 dense and MoE): ``q_proj`` emits, for
  each query head in turn, its d query features and then d features of an
  output gate (viewed (..., H, 2d) and chunked), so the maps read the query
  heads as an interleaved site, ``ProjectionSite("q_proj", q=0, groups=H)``,
  and leave the gate features as they are; the host then normalises each
  query and key head ((1 + w) RMS norm), rotates the first
  partial_rotary_factor of each head, attends with softmax, and multiplies
  the attention output by sigmoid(gate): all after the maps, per head.
  Their linear-attention layers (GatedDeltaNet) are no softmax attention and
  are left as they are, as Mamba mixers are.
* the vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and
  Qwen3.5 (dense and MoE): one fused ``qkv`` Linear viewed (..., 3, H, d):
  the H query heads, then the H key heads (a site by role, as Phi-3's), over
  the patches of all the images as one sequence (tokens (N, E), no batch
  axis), a 2D rotation of every head alike (in float32), then softmax
  attention inside each image (or window: Qwen2.5-VL), by cu_seqlens.
* Laguna: Llama's layout with a head count per layer
  (``num_attention_heads_per_layer``, the module's ``num_heads``), per-head
  q/k RMS norms, a partial rotation per layer type, a sliding window in its
  local layers, and a softplus gate (per head or per feature) on the
  attention output.
* Zamba and Zamba2: Mistral's attention with the scale (d/2)^-0.5 (Zamba2's
  with optional RoPE, Zamba's without positions), over the concatenation of
  the hidden states and the embeddings (2 * hidden_size features), in each
  hybrid layer's shared transformer block. transformers 5 builds one block
  per hybrid layer and ties their weights (``_tied_weights_keys``; Zamba2's
  every ``num_mem_blocks`` layers): the tied blocks' maps are tied too
  (``_models._share_tied``: the same gates and generators in each block, as
  the host's weights, so one block applied at several depths has one set of
  maps, and transformers' own re-tying finds them tied). With Zamba2's
  ``use_shared_attention_adapter`` the host adds a per-layer low-rank adapter
  of the tokens to the projected queries and keys after ``q_proj`` and
  ``k_proj``: the maps would act on a part of each query and key only, so
  that variant is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from damcha_core import DamchaValueError, invalid_argument
from torch import nn

from ._models import AttentionLayout, ModelAdapter, ProjectionSite, register_adapter
from ._models_layouts import _by_role, _features, _gqa_layout, _heads, _is, _separate_q_k_layout


def _gated_query_layout(m: Any) -> AttentionLayout:
    """Qwen3-Next's ``q_proj``: H runs of 2d features, a query head then its gate."""
    cfg, d = m.config, int(m.head_dim)
    H, G = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    (eq, q_out), (ek, k_out) = _features(m.q_proj), _features(m.k_proj)
    if q_out != H * 2 * d:
        raise DamchaValueError(
            invalid_argument(
                "q_proj",
                f"a projection of {H * 2 * d} output features, {H} runs of a query head and its output gate of "
                f"{d} features each (a variant with another head layout, which this adapter does not know)",
                f"q_proj with {q_out} output features",
            )
        )
    _heads("k_proj", k_out, d, G)
    sites = (ProjectionSite("q_proj", q=0, groups=H), ProjectionSite("k_proj", k=0))
    return AttentionLayout(H, G, d, eq, ek, sites)


_GATED_QUERY = frozenset({"Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention"})

# Qwen2-VL's vision attention is named VisionAttention, read only in its own module.
_QWEN2_VL_VISION = "transformers.models.qwen2_vl.modeling_qwen2_vl"
_QWEN_VISION = frozenset(
    {
        "Qwen2_5_VLVisionAttention",
        "Qwen3VLVisionAttention",
        "Qwen3VLMoeVisionAttention",
        "Qwen3_5VisionAttention",
        "Qwen3_5MoeVisionAttention",
        # The third survey's (transformers 5.24): Qwen3-Omni's vision encoder's is Qwen3-VL's line for
        # line, ERNIE-4.5-VL's Qwen2.5-VL's; GLM-4V's (dense, MoE) differ in their biases (attention_bias,
        # no bias on proj), GLM-OCR's also in per-head q/k RMS norms after the maps, before the rotation;
        # EXAONE 4.5's in GQA (the H query heads, then G key and G value heads; its kernel repeats the key
        # heads); Qwen2.5-Omni's projects q, k and v with three Linear layers (q, k, v) of H heads each.
        "Qwen3OmniMoeVisionAttention",
        "Ernie4_5_VLMoeVisionAttention",
        "Glm4vVisionAttention",
        "Glm4vMoeVisionAttention",
        "GlmOcrVisionAttention",
        "Exaone4_5_VisionAttention",
        "Qwen2_5OmniVisionAttention",
    }
)


def _is_qwen_vision(m: nn.Module) -> bool:
    return _is(m, "transformers", _QWEN_VISION) or any(
        c.__name__ == "VisionAttention" and c.__module__ == _QWEN2_VL_VISION for c in type(m).__mro__
    )


def _qwen_vision_layout(m: Any) -> AttentionLayout:
    H, d = int(m.num_heads), int(m.head_dim)
    if _is(m, "transformers", frozenset({"Qwen2_5OmniVisionAttention"})):
        return _separate_q_k_layout(m, "q", "k", H, d)
    return _by_role("qkv", m.qkv, H, int(getattr(m, "num_key_value_heads", H)), d)


# T5Gemma's (transformers 5.24): its encoder's and decoder's self-attention is Gemma 2's (scale
# query_pre_attn_scalar^-0.5, logit soft-capping, a sliding window in its sliding layers, RoPE) built with
# is_causal=config.is_decoder; its decoder's cross-attention is a class of its own, T5GemmaCrossAttention:
# Gemma 2's q_proj over the decoder tokens, k_proj and v_proj over the encoder output
# (cross_attention_hidden_size features), no rotation, no window, and BART's cache (the keys projected, so
# mapped, once per encoder output; the EncoderDecoderCache keeps them). The class tells the two apart: the
# cross-attention gets maps of its own under coupling "auto" (separate), as BART's and T5's. T5Gemma 2's
# encoder self-attention is Gemma 3's (per-head q/k RMS norms after the maps, before RoPE) with is_causal
# False; its decoder attends once, with T5Gemma2MergedAttention, over its own keys (causal, rotated) and the
# encoder output's (not rotated) together, both from one k_proj and k_norm: each key is mapped by the token
# it is projected from (the encoder's once, then cached), the queries by the decoder's, so the layer is
# DAMCHA's over the joined context; its keys come partly from another sequence, so it is a cross-attention
# for coupling "auto" (separate maps), as the Keras converter takes it.
_T5GEMMA_CROSS = frozenset({"T5GemmaCrossAttention", "T5Gemma2MergedAttention"})
_T5GEMMA = frozenset({"T5GemmaSelfAttention", "T5Gemma2SelfAttention"}) | _T5GEMMA_CROSS


def _t5gemma_layout(m: Any) -> AttentionLayout:
    cfg = m.config
    layout = _gqa_layout(m, int(cfg.num_attention_heads), int(cfg.num_key_value_heads))
    if _is(m, "transformers", _T5GEMMA_CROSS):
        return dataclasses.replace(layout, self_attention=False)
    return layout


def _laguna_layout(m: Any) -> AttentionLayout:
    return _gqa_layout(m, int(m.num_heads), int(m.config.num_key_value_heads))


def _zamba2_layout(m: Any) -> AttentionLayout:
    cfg = m.config
    if bool(getattr(cfg, "use_shared_attention_adapter", False)):
        raise DamchaValueError(
            invalid_argument(
                "config.use_shared_attention_adapter",
                "False (with it, Zamba2 adds a low-rank adapter of the tokens to the queries and keys after q_proj "
                "and k_proj, so maps on those projections would act on a part of each query and key only)",
                f"{type(m).__name__} with use_shared_attention_adapter=True",
            )
        )
    return _gqa_layout(m, int(cfg.num_attention_heads), int(cfg.num_key_value_heads))


for _adapter in (
    ModelAdapter(
        "transformers-gated-query",
        "transformers Qwen3-Next and Qwen3.5 (dense, MoE) attention (q_proj of a query head and its output gate "
        "per head, k_proj; GQA; per-head q/k norms, partial RoPE, the gate after the attention)",
        lambda m: _is(m, "transformers", _GATED_QUERY),
        _gated_query_layout,
    ),
    ModelAdapter(
        "transformers-qwen-vision",
        "transformers Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5 (dense, MoE), Qwen2.5-Omni, "
        "Qwen3-Omni, GLM-4V (dense, MoE), GLM-OCR, ERNIE-4.5-VL and EXAONE 4.5 vision attention (fused qkv "
        "Linear, q, k, v blocks, EXAONE 4.5's with GQA; Qwen2.5-Omni's q/k/v Linear layers; 2D RoPE; attention "
        "inside each image or window)",
        _is_qwen_vision,
        _qwen_vision_layout,
    ),
    ModelAdapter(
        "transformers-t5gemma",
        "transformers T5Gemma and T5Gemma 2 attention: encoder self-attention, decoder causal self-attention "
        "with cache (Gemma 2's; T5Gemma 2's encoder Gemma 3's), decoder cross-attention over the encoder output "
        "(T5GemmaCrossAttention) and T5Gemma 2's merged decoder attention over its own and the encoder's keys "
        "(q_proj/k_proj; GQA; separate maps for the cross-attention)",
        lambda m: _is(m, "transformers", _T5GEMMA),
        _t5gemma_layout,
    ),
    ModelAdapter(
        "transformers-laguna",
        "transformers Laguna attention (q_proj/k_proj with a head count per layer; GQA; per-head q/k norms, "
        "partial RoPE, sliding windows, a softplus output gate)",
        lambda m: _is(m, "transformers", frozenset({"LagunaAttention"})),
        _laguna_layout,
    ),
    ModelAdapter(
        "transformers-zamba",
        "transformers Zamba and Zamba2 attention of the hybrid layers' shared blocks (q_proj/k_proj; GQA; RoPE or "
        "none; the blocks whose host weights are tied share their maps; not with use_shared_attention_adapter)",
        lambda m: _is(m, "transformers", frozenset({"ZambaAttention", "Zamba2Attention"})),
        _zamba2_layout,
    ),
):
    register_adapter(_adapter)
