"""The built-in adapters of ``convert``: one small function per attention layout.

Modules are recognised by class name and defining library (any class in the
MRO), so neither transformers nor timm is imported here; a subclass of a
supported class is supported too. Each layout checks the sizes it reads
against the host's own config, so a variant with another head layout (a
q_proj that also emits gates, say) is refused rather than mis-mapped.
"""

from __future__ import annotations

from typing import Any

from damcha_core import DamchaValueError, invalid_argument
from torch import nn

from ._models import AttentionLayout, ModelAdapter, ProjectionSite, _projection_features, register_adapter


def _is(module: nn.Module, library: str, names: frozenset[str]) -> bool:
    return any(c.__name__ in names and c.__module__.split(".")[0] == library for c in type(module).__mro__)


# The modules and projections below are typed Any: they are the libraries'
# classes (known here by name only), whose attributes torch's nn.Module stubs
# type as Tensor | Module.


def _features(projection: Any) -> tuple[int, int]:
    """(in, out) features of a projection (``_projection_features``), or refused."""
    features = _projection_features(projection)
    if features is None:
        raise DamchaValueError(f"Cannot read the feature sizes of projection {type(projection).__name__}.")
    return features


def _heads(name: str, out: int, head_dim: int, expected: int) -> int:
    if out % head_dim or out // head_dim != expected:
        raise DamchaValueError(
            f"`{name}` has {out} output features, expected {expected} heads of {head_dim} "
            "(a variant with another head layout, which this adapter does not know)."
        )
    return expected


# --------------------------------------------------------- transformers decoders

# Llama's attention and the copies of it (or of Mistral's) that transformers builds and calls
# as Llama's: Mixtral's is Mistral's source line for line, PhiMoE's (Phi-3.5-MoE), Arcee's
# (AFM) and Jais 2's Llama's;
# Gemma's differs in one flag
# (is_causal off under its bidirectional option), Granite's and GraniteMoe's in the softmax
# scale (their attention_multiplier), Gemma 2's in its scale, logit soft-capping and sliding
# window, Gemma 3's in those and per-head q/k norms (as Qwen3's), Qwen2-MoE's, Ministral's and
# Starcoder2's in their biases and sliding windows (Starcoder2's residual dropout), OLMo 2's
# in an RMS norm over all the heads' features, all after the maps. Each is tested.
_LLAMA = frozenset(
    {
        "LlamaAttention",
        "MistralAttention",
        "Qwen2Attention",
        "Qwen3Attention",
        "MixtralAttention",
        "GemmaAttention",
        "Gemma2Attention",
        "Gemma3Attention",
        "GraniteAttention",
        "GraniteMoeAttention",
        "Qwen2MoeAttention",
        "MinistralAttention",
        "Starcoder2Attention",
        "Olmo2Attention",
        "PhimoeAttention",
        "ArceeAttention",
        "Jais2Attention",
    }
)


# More copies of Llama's (or Mistral's, Qwen2's, Qwen3's) attention, each read against it in its
# transformers source (5.x): q_proj/k_proj as Llama's, and what differs acts after the maps on
# every head alike or on each head by itself. Aria's text, Emu3's and Solar Open's are Llama's
# line for line (Solar Open's o_proj without bias); Cwm's is Qwen2's without biases; Seed-OSS's
# differs in its biases and residual dropout; GraniteMoeShared's and HyperCLOVAX's in the
# softmax scale (attention_multiplier); VaultGemma's in Gemma 2's scale, soft-cap and sliding
# window; Qwen3-MoE's, Mellum's and Dots1's are Qwen3's (per-head q/k RMS norms, sliding
# windows); HunYuan's (dense and MoE; on the rotated heads), Apertus's and EXAONE 4's add per-head
# q/k RMS norms (EXAONE 4's rotating in its sliding-window layers only, where it has those);
# OLMo 3's, FlexOlmo's and OLMoE's an RMS norm over all the heads' features as OLMo 2's (OLMoE's
# then OLMo's clip_qkv, see _ROTARY; untested here); SmolLM3's leaves out the rotation in its
# NoPE layers, GraniteMoeHybrid's attention layers (scale: attention_multiplier) where its
# position_embedding_type is "nope", Jamba's attention layers (Mistral's) always. Each is tested.
_LLAMA_MORE = frozenset(
    {
        "AriaTextAttention",
        "Emu3Attention",
        "SolarOpenAttention",
        "CwmAttention",
        "SeedOssAttention",
        "GraniteMoeSharedAttention",
        "HyperCLOVAXAttention",
        "VaultGemmaAttention",
        "Qwen3MoeAttention",
        "MellumAttention",
        "Dots1Attention",
        "HunYuanDenseV1Attention",
        "HunYuanMoEV1Attention",
        "ApertusAttention",
        "Exaone4Attention",
        "Olmo3Attention",
        "FlexOlmoAttention",
        "OlmoeAttention",
        "SmolLM3Attention",
        "GraniteMoeHybridAttention",
        "JambaAttention",
    }
)

# A second survey (transformers 5.24), each class read against the one it copies: MiniMax's full-attention
# layers are Mistral's (its lightning-attention layers are linear attention, without softmax: refused),
# Bamba's attention layers Llama's with a partial rotation (its Mamba mixers are no attention);
# Qwen2-VL's and Qwen2.5-VL's language models Qwen2's, Qwen3-VL's (dense and MoE) Qwen3's, all four
# under multimodal RoPE (mrope: the sections of each head's angles read the temporal, height and width
# positions of its token; text tokens have the three equal, ordinary RoPE), which still turns every
# head of a token alike; LFM2's (dense and MoE) add per-head q/k RMS norms (q_layernorm, k_layernorm),
# LFM3's Qwen3's with a float32 rotation, a sliding window and a sigmoid gate per head on the
# attention output (g_proj of the tokens, after the attention); Apertus 1.5's text model's and HY-V3's
# are Apertus's line for line, EXAONE-MoE's and Kolibri 1's EXAONE 4's; Nemotron-H's attention layers
# Jamba's (no positions); LaraMini's is Qwen3's rotating only where its model gives it positions (its
# sliding-window layers); NanoChat's rotates each head (by minus the angles) and then normalises it (an RMS
# norm without weights); BitNet's is Llama's with an RMS norm of the attention output before o_proj (its
# checkpoints' quantized BitLinear projections untested); MiniMax-M2's normalises all the query heads'
# and all the key heads' features (OLMo 2's norms: on the mapped heads, before RoPE). Each is tested.
_LLAMA_SURVEY_2 = frozenset(
    {
        "MiniMaxAttention",
        "BambaAttention",
        "Qwen2VLAttention",
        "Qwen2_5_VLAttention",
        "Qwen3VLTextAttention",
        "Qwen3VLMoeTextAttention",
        "Lfm2Attention",
        "Lfm2MoeAttention",
        "Lfm3Attention",
        "Apertus1p5TextAttention",
        "ExaoneMoeAttention",
        "HYV3Attention",
        "NemotronHAttention",
        "Kolibri1Attention",
        "LaraMiniAttention",
        "NanoChatAttention",
        "BitNetAttention",
        "MiniMaxM2Attention",
    }
)

# A third survey (transformers 5.24), each class read against the one it copies (its forward, the
# rotation it calls, the layers that build and call it): EuroBERT's is Llama's built with is_causal
# False (an encoder: its model gives it a bidirectional mask); Qwen3-Omni's thinker text model's is
# Qwen3-MoE's without a sliding window; Cosmos3-Edge's and DeepSeek-OCR2's text models', CSM's (backbone
# and depth decoder) and Higgs-Audio-v2's Llama's line for line; Granite4-Vision's and Granite-Docling's
# text models' Granite's (attention_multiplier); Voxtral-Realtime's text decoder's and causal audio
# encoder's Llama's with the config's sliding window (the encoder's q_proj with a bias, its k_proj
# without). Each is tested. (EXAONE 4.5's Exaone4_5_Attention, EXAONE 4's line for line, is built by no
# model: EXAONE 4.5 builds its language model as an Exaone4Model, whose Exaone4Attention is listed above.)
_LLAMA_SURVEY_3 = frozenset(
    {
        "EuroBertAttention",
        "Qwen3OmniMoeThinkerTextAttention",
        "Cosmos3EdgeTextAttention",
        "DeepseekOcr2TextAttention",
        "CsmAttention",
        "HiggsAudioV2Attention",
        "Granite4VisionTextAttention",
        "GraniteDoclingTextAttention",
        "VoxtralRealtimeTextAttention",
        "VoxtralRealtimeAttention",
    }
)


def _llama_layout(m: Any) -> AttentionLayout:
    cfg = m.config
    H = int(cfg.num_attention_heads)
    return _gqa_layout(m, H, int(getattr(cfg, "num_key_value_heads", None) or H))


def _gqa_layout(m: Any, H: int, G: int) -> AttentionLayout:
    """Maps on ``q_proj`` (H heads of ``m.head_dim``) and ``k_proj`` (G heads), each checked against its size."""
    d = int(m.head_dim)
    (eq, q_out), (ek, k_out) = _features(m.q_proj), _features(m.k_proj)
    _heads("q_proj", q_out, d, H)
    _heads("k_proj", k_out, d, G)
    return AttentionLayout(H, G, d, eq, ek, (ProjectionSite("q_proj", q=0), ProjectionSite("k_proj", k=0)))


# Llama's q_proj/k_proj layout under other rotations and pre-attention steps, each read in its
# transformers source: what these classes do between the projections and the attention kernel
# acts on every head alike or on each head by itself, so it acts on the mapped heads as it acted
# on the plain ones: the converted layer is the host with q := L(t) q, k := L(t) k, the maps
# before the rotation as in Llama's (where RoPE's relative positions survive both metrics).
# Phi's (phi-1, phi-1.5, phi-2) and StableLM's rotate the first partial_rotary_factor of each
# head's features in halves; GPT-J's its first rotary_dim features in interleaved pairs; Cohere's,
# Cohere 2's (sliding-window layers only: its global layers have no positions) and Helium's all
# of them in interleaved pairs; GLM's and GLM-4's the first partial_rotary_factor in interleaved
# pairs, GLM-4-MoE's in halves (its optional per-head q/k RMS norms before), ERNIE 4.5's (dense
# and MoE) all of them in interleaved pairs, in float32; Nemotron's its first partial_rotary_factor
# in halves; Cohere 2 MoE's as Cohere 2's, and in the layers its force_rope names (dense MLP layers under
# prefix_dense_sliding_window_pattern 1) whatever their window. Phi's optional q/k LayerNorm (one weight
# for all heads), StableLM's (a LayerNorm per head) and Cohere's (weights per head and feature) normalise the
# mapped heads, before the rotation. OLMo's clamps q, k and v in place to +-clip_qkv when that is
# set: the mapped q and k then, so the bound holds for what enters attention, as in the host
# (clamping before the map would let the map move them past it). No path of the maps keeps its
# output for backward, so the in-place clamp is safe; the tests check the gradients of a
# clip_qkv model with and without recompute and checkpointing.
_ROTARY = frozenset(
    {
        "PhiAttention",
        "StableLmAttention",
        "GPTJAttention",
        "CohereAttention",
        "Cohere2Attention",
        "HeliumAttention",
        "OlmoAttention",
        "GlmAttention",
        "Glm4Attention",
        "Glm4MoeAttention",
        "Ernie4_5Attention",
        "Ernie4_5_MoeAttention",
        "NemotronAttention",
        "Cohere2MoeAttention",
        # The third survey's (transformers 5.24): GLM-4V's and GLM-OCR's text models' are GLM-4's
        # forward (biased q/k/v in GLM-4V's), GLM-4V-MoE's GLM-4-MoE's without q/k norms, all three
        # rotating the first partial_rotary_factor of each head under multimodal RoPE (GLM-4V's and
        # GLM-OCR's in interleaved pairs, GLM-4V-MoE's in halves); ERNIE-4.5-VL's text model's is ERNIE
        # 4.5's line for line under its 3D RoPE (interleaved pairs, float32). Every head of a token turned
        # alike, after the maps; each is tested.
        "Glm4vTextAttention",
        "Glm4vMoeTextAttention",
        "GlmOcrTextAttention",
        "Ernie4_5_VLMoeTextAttention",
    }
)


def _rotary_layout(m: Any) -> AttentionLayout:
    if _is(m, "transformers", frozenset({"GPTJAttention"})):
        # No GQA: q_proj and k_proj of num_attention_heads heads each (its config has no kv heads).
        return _q_k_proj_layout(m, int(m.num_attention_heads), int(m.head_dim))
    return _llama_layout(m)


def _by_role(attr: str, projection: Any, H: int, G: int, d: int) -> AttentionLayout:
    """A self-attention whose fused ``attr`` output is the H query heads, then
    the G key heads, then the G value heads (Phi-3's; MPT's, DBRX's, ... in
    _models_layouts_qkv)."""
    e, out = _features(projection)
    _heads(attr, out, d, H + 2 * G)
    return AttentionLayout(H, G, d, e, e, (ProjectionSite(attr, q=0, k=H * d),))


def _phi3_layout(m: Any) -> AttentionLayout:
    """Phi-3's (and Phi-4's) attention: q, k and v from one fused ``qkv_proj``
    Linear, H query heads then G key and G value heads of ``head_dim``."""
    cfg = m.config
    return _by_role("qkv_proj", m.qkv_proj, int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(m.head_dim))


def _gpt2_layout(m: Any) -> AttentionLayout:
    H, d, E = int(m.num_heads), int(m.head_dim), int(m.embed_dim)
    if getattr(m, "is_cross_attention", False):
        (eq, q_out), (ek, kv_out) = _features(m.q_attn), _features(m.c_attn)
        _heads("q_attn", q_out, d, H)
        _heads("c_attn", kv_out, d, 2 * H)
        return AttentionLayout(
            H, H, d, eq, ek, (ProjectionSite("q_attn", q=0), ProjectionSite("c_attn", k=0)), self_attention=False
        )
    e, out = _features(m.c_attn)
    _heads("c_attn", out, d, 3 * H)
    return AttentionLayout(H, H, d, e, e, (ProjectionSite("c_attn", q=0, k=E),))


# BERT's self- and cross-attention and transformers' copies of them ("Copied
# from transformers.models.bert.modeling_bert.BertSelfAttention with
# Bert->Electra", ...: the same query/key/value layout, cache handling and
# attention dispatch). Listed by name, not matched by structure: other classes
# with query/key/value Linear layers (LayoutLM's, relative position variants)
# compute differently and stay refused.
_BERT_FAMILY = ("Bert", "Roberta", "Electra", "XLMRoberta", "Camembert")
_BERT_SELF = frozenset(f"{n}SelfAttention" for n in _BERT_FAMILY)
_BERT_CROSS = frozenset(f"{n}CrossAttention" for n in _BERT_FAMILY)


def _distilbert_layout(m: Any) -> AttentionLayout:
    """DistilBERT's self-attention: q_lin/k_lin/v_lin/out_lin Linear layers of n_heads heads."""
    return _separate_q_k_layout(m, "q_lin", "k_lin", int(m.n_heads), int(m.attention_head_size))


def _bert_layout(m: Any) -> AttentionLayout:
    cross = _is(m, "transformers", _BERT_CROSS)
    H, d = int(m.num_attention_heads), int(m.attention_head_size)
    return _separate_q_k_layout(m, "query", "key", H, d, self_attention=not cross)


# The ViT family of transformers 5 (one attention class, copied per model):
# q_proj/k_proj/v_proj/o_proj Linear layers of num_attention_heads heads of
# head_dim, no RoPE, no cache, no GQA. (Before transformers 5 these models had
# BERT's ViTSelfAttention query/key/value layout; this package needs >= 5.)
_VIT = frozenset(
    {
        "ViTAttention",
        "DeiTAttention",
        "ViTMAEAttention",
        "ViTMSNAttention",
        "Dinov2Attention",
        "Dinov2WithRegistersAttention",
        "IJepaAttention",
        "ASTAttention",
        "VivitAttention",
        # Dinov2's line for line (transformers 5.24): Pixio's, RF-DETR's backbone's and TIPSv2's vision tower's.
        "PixioAttention",
        "RfDetrDinov2Attention",
        "Tipsv2VisionAttention",
    }
)


def _q_k_proj_layout(m: Any, H: int, d: int, *, self_attention: bool = True) -> AttentionLayout:
    """Maps on separate ``q_proj``/``k_proj`` Linear layers of ``H`` heads of ``d``."""
    return _separate_q_k_layout(m, "q_proj", "k_proj", H, d, self_attention=self_attention)


def _separate_q_k_layout(m: Any, q: str, k: str, H: int, d: int, *, self_attention: bool = True) -> AttentionLayout:
    """Maps on separate query and key Linear layers ``q`` and ``k`` of ``H`` heads of ``d`` each."""
    (eq, q_out), (ek, k_out) = _features(getattr(m, q)), _features(getattr(m, k))
    _heads(q, q_out, d, H)
    _heads(k, k_out, d, H)
    sites = (ProjectionSite(q, q=0), ProjectionSite(k, k=0))
    return AttentionLayout(H, H, d, eq, ek, sites, self_attention=self_attention)


def _vit_layout(m: Any) -> AttentionLayout:
    return _q_k_proj_layout(m, int(m.num_attention_heads), int(m.head_dim))


# Self-attention with q_proj/k_proj/v_proj/out_proj Linear layers of num_heads
# heads of head_dim, no RoPE, no GQA: CLIP's (text, causal through the mask
# CLIPTextTransformer builds, and vision), SigLIP's (text and vision) and OPT's
# (a causal decoder with a KV cache; OPT scales q_proj's output, after the map).
# (BART's, its copies' and Whisper's attention classes have this layout too, but
# also serve as cross-attention: their own adapter below.)
# MetaCLIP 2's and CLIPSeg's are CLIP's line for line (CLIPSeg's decoder layers too), SigLIP 2's SigLIP's.
# The vision towers of Idefics2, Idefics3 and SmolVLM are SigLIP's (its line for line, an attribute in
# another place), AIMv2's SigLIP's with its qkv_bias option (its text tower's too, causal through the
# mask its model builds: a mask it leaves out where no token is padding while the layers pass the kernel
# is_causal=False, so under SDPA an unpadded batch attends both ways, the host's doing, maps or not; its
# vision tower's pooling head, Aimv2AttentionPoolingHead, a learned query without projection, is refused
# as an unknown layout); Kosmos-2's, GIT's and Chinese-CLIP's vision towers are CLIP's, passing its
# is_causal (False) to the kernel (transformers 5.24).
_OUT_PROJ = frozenset(
    {
        "CLIPAttention",
        "SiglipAttention",
        "OPTAttention",
        "MetaClip2Attention",
        "CLIPSegAttention",
        "Siglip2Attention",
        "Idefics2VisionAttention",
        "Idefics3VisionAttention",
        "SmolVLMVisionAttention",
        "Aimv2Attention",
        "Kosmos2VisionAttention",
        "GitVisionAttention",
        "ChineseCLIPVisionAttention",
    }
)


def _out_proj_layout(m: Any) -> AttentionLayout:
    return _q_k_proj_layout(m, int(m.config.num_attention_heads), int(m.head_dim))


# Encoder-decoder attention of BART and its copies, and of Whisper: one class serves the
# encoder's self-attention (is_decoder False), the decoder's causal
# self-attention (is_decoder, is_causal) and the decoder's cross-attention
# over the encoder output (is_decoder, not is_causal; built without
# is_causal). The cross-attention's k_proj reads the encoder states: its map
# runs where the host computes the keys, once per encoder output, and the
# host's EncoderDecoderCache stores those mapped keys and reuses them at later
# steps without calling k_proj again. Whisper scales q_proj's output, after
# the map. Sizes come from the module (BART's decoder may have other head
# counts than its encoder). The copies listed (mBART, Marian, Pegasus, M2M100,
# PLBart, Blenderbot, BlenderbotSmall, BioGPT (a decoder only) and
# TimeSeriesTransformer: "Copied from BartAttention") have BART's source line
# for line, and their layers build and call them as BART's do, a decoder's
# self-attention with is_causal=True; each is tested. The other copies are
# refused by name: Informer's decoder builds its self-attention without
# is_causal (causal through its mask), which the rule above would take for a
# cross-attention; PegasusX, BigBirdPegasus and PPFormulaNet pair theirs with
# encoder attention of other layouts.
_ENC_DEC = frozenset(
    {
        "BartAttention",
        "MBartAttention",
        "MarianAttention",
        "PegasusAttention",
        "M2M100Attention",
        "PLBartAttention",
        "BlenderbotAttention",
        "BlenderbotSmallAttention",
        "BioGptAttention",
        "TimeSeriesTransformerAttention",
        "WhisperAttention",
        # Whisper's line for line (transformers 5.24): AudioFlamingo3's audio encoder's; Qwen2-Audio's and
        # Voxtral's audio encoders' without the cache and cross-attention paths (the encoder's self-attention
        # only, built with is_decoder False); SeamlessM4T's (v1) text encoder's and decoders' BART's, the
        # context named encoder_hidden_states (its speech encoder's conformer attention is another layout,
        # refused; SeamlessM4T v2's text-to-unit decoder builds its self-attention with is_decoder=True and
        # no is_causal, which the rule above would read as a cross-attention: not listed).
        "AudioFlamingo3Attention",
        "Qwen2AudioAttention",
        "VoxtralAttention",
        "SeamlessM4TAttention",
    }
)


def _enc_dec_layout(m: Any) -> AttentionLayout:
    cross = bool(m.is_decoder) and not bool(m.is_causal)
    return _q_k_proj_layout(m, int(m.num_heads), int(m.head_dim), self_attention=not cross)


# ALBERT's attention: BERT's query/key/value layout (num_attention_heads heads of
# attention_head_size, scale 1/sqrt(d)), self-attention only, its output projection, residual and
# LayerNorm inside the module, after the attention. ALBERT shares its layers' weights across depth:
# one AlbertAttention (per layer group and inner layer) is called at every depth it serves, so its
# maps are shared the same way, one gate and generator for all those calls (DAMCHA's stack-wise
# sharing of the metric generator, here along with ALBERT's own). Each call maps the tokens it is
# given, as any attention call: the maps keep nothing from one call to the next.
def _albert_layout(m: Any) -> AttentionLayout:
    return _separate_q_k_layout(m, "query", "key", int(m.num_attention_heads), int(m.attention_head_size))


# T5's attention (T5, mT5, ByT5 and Flan-T5 checkpoints: T5's or mT5's classes) and transformers'
# copies of it, each read in its source: MT5's, SwitchTransformers', Pop2Piano's and Udop's are
# T5's line for line under their names; UMT5's computes the same (its own forward signature, a
# relative bias in every self-attention). q, k, v and o Linear layers without bias, n_heads heads
# of key_value_proj_dim (n_heads * d_kv need not be d_model), logits q.k unscaled plus a relative
# position bias that depends on the positions only: added after the maps, the converted layer is
# the host with q := L(t) q, k := L(t) k. One class serves the encoder's self-attention, the
# decoder's causal self-attention (a cache) and the decoder's cross-attention over the encoder
# output (keys projected and mapped once, then kept by the EncoderDecoderCache, as BART's), and its
# forward tells them apart by its arguments only. Since transformers 5.15 the layers build the
# self-attention with is_causal=config.is_decoder and the cross-attention with is_causal=False,
# and the host's SDPA path relies on that flag (the decoder's causal mask may be left to it): a
# decoder module with is_causal False is the cross-attention. Before 5.15 both are built alike and
# no attribute tells them apart, so decoder layers are refused there (the encoder's, is_decoder
# False, are self-attention in every version). UMT5's layers give every self-attention a relative
# bias of its own and the cross-attention none, in every transformers 5 (its is_causal came later
# than T5's): that tells UMT5's apart. LongT5Attention, also T5's line for line, is not listed:
# LongT5's encoder attends with other classes (local and transient-global blocks), so listing the
# decoder's alone would convert no LongT5 model.
_T5 = frozenset(
    {
        "T5Attention",
        "MT5Attention",
        "SwitchTransformersAttention",
        "Pop2PianoAttention",
        "UdopAttention",
        "UMT5Attention",
    }
)


def _t5_cross(m: Any, is_decoder: bool) -> bool:
    """Whether a T5-family attention module, of a decoder if ``is_decoder``, is its cross-attention (see above)."""
    if not is_decoder:
        return False
    if _is(m, "transformers", frozenset({"UMT5Attention"})):
        return not bool(m.has_relative_attention_bias)
    is_causal = getattr(m, "is_causal", None)
    relative = bool(m.has_relative_attention_bias)
    # A decoder module with a relative bias is the first self-attention, never the cross-attention:
    # is_causal False there means the flag does not say what this adapter reads it for.
    if not isinstance(is_causal, bool) or (relative and not is_causal):
        flag = "no is_causal attribute" if is_causal is None else f"is_causal={is_causal!r}"
        raise DamchaValueError(
            invalid_argument(
                "is_causal",
                "True on a decoder's self-attention and False on its cross-attention, as transformers >= 5.15 "
                "builds T5's layers (nothing else on the module tells the two apart, and the cross-attention needs "
                "maps of its own, its keys projected from the encoder output: upgrade transformers to convert T5 "
                "decoders)",
                f"{type(m).__name__} of a decoder, with has_relative_attention_bias={relative} and {flag}",
            )
        )
    return not is_causal


def _t5_layout(m: Any) -> AttentionLayout:
    cross = _t5_cross(m, bool(m.is_decoder))
    return _separate_q_k_layout(m, "q", "k", int(m.n_heads), int(m.key_value_proj_dim), self_attention=not cross)


# Pix2Struct's attention. Its text decoder's is T5's forward under other names (query, key, value
# and output Linear layers without bias, n_heads heads of key_value_proj_dim filling hidden_size),
# its relative bias one-way, and no is_decoder of its own: its layers build the self-attention with
# is_causal=config.is_decoder (True by default: the text model is a decoder) and the
# cross-attention over the image encoder with is_causal=False, read as T5's are (transformers >=
# 5.15; with config.is_decoder False the self-attention's flag would read as a cross-attention's,
# refused). Its vision encoder's: unscaled self-attention over the patches, the same names, no bias.
_PIX2STRUCT_TEXT = frozenset({"Pix2StructTextAttention"})


def _pix2struct_layout(m: Any) -> AttentionLayout:
    H, d = int(m.n_heads), int(m.key_value_proj_dim)
    if not _is(m, "transformers", _PIX2STRUCT_TEXT):
        return _separate_q_k_layout(m, "query", "key", H, d)
    if not bool(m.config.is_decoder):
        raise DamchaValueError(
            invalid_argument(
                "config.is_decoder",
                "True (a Pix2Struct text model is a decoder: its layers build the self-attention with "
                "is_causal=config.is_decoder, which must tell it from the cross-attention, built with is_causal=False)",
                f"{type(m).__name__} with config.is_decoder={m.config.is_decoder!r}",
            )
        )
    return _separate_q_k_layout(m, "query", "key", H, d, self_attention=not _t5_cross(m, True))


# ------------------------------------------------------------------- timm


def _timm_vit_like(m: Any) -> bool:
    """timm names many attention classes ``Attention``; the ViT layout's has a
    fused ``qkv`` projection it calls, ``num_heads`` and ``head_dim``. The others
    (BEiT: a qkv bias added with ``F.linear``, bypassing the module; PVTv2, TNT:
    separate q and kv; LeViT, TinyViT, NesT, EfficientFormer, VOLO: other sizes
    or no ``head_dim``; Visformer: a 1x1 ``Conv2d`` qkv over channels-first
    maps, whose features are not the last dimension) stay unmatched, so
    convert() refuses them by name."""
    return (
        _is(m, "timm", frozenset({"Attention"}))
        and all(hasattr(m, a) for a in ("qkv", "num_heads", "head_dim"))
        and getattr(m, "q_bias", None) is None
        and _has_features(m.qkv)
    )


def _has_features(projection: Any) -> bool:
    try:
        _features(projection)
    except DamchaValueError:
        return False
    return True


def _timm_layout(m: Any) -> AttentionLayout:
    H, d = int(m.num_heads), int(m.head_dim)
    e, out = _features(m.qkv)
    _heads("qkv", out, d, 3 * H)
    return AttentionLayout(H, H, d, e, e, (ProjectionSite("qkv", q=0, k=H * d),))


def _timm_pool_like(m: Any) -> bool:
    """timm's ``AttentionPoolLatent`` (the ``global_pool="map"`` head of SigLIP
    and other ViTs): a learned latent query attending over the tokens. Without
    a query projection (``q_proj=False``, ``q`` is an Identity) there is no
    module to carry the query map, so it stays unmatched and is refused by name."""
    return (
        _is(m, "timm", frozenset({"AttentionPoolLatent"}))
        and all(hasattr(m, a) for a in ("q", "kv", "num_heads", "head_dim"))
        and _has_features(m.q)
        and _has_features(m.kv)
    )


def _timm_pool_layout(m: Any) -> AttentionLayout:
    H, d = int(m.num_heads), int(m.head_dim)
    (eq, q_out), (ek, kv_out) = _features(m.q), _features(m.kv)
    _heads("q", q_out, d, H)
    _heads("kv", kv_out, d, 2 * H)
    # Queries read the latent, keys the tokens: cross-attention (separate maps).
    return AttentionLayout(H, H, d, eq, ek, (ProjectionSite("q", q=0), ProjectionSite("kv", k=0)), self_attention=False)


for _adapter in (
    ModelAdapter(
        "transformers-llama",
        "transformers Llama/Mistral/Ministral/Mixtral/Qwen2/Qwen2-MoE/Qwen3/Gemma/Gemma2/Gemma3/Granite/"
        "GraniteMoe/Starcoder2/OLMo2/PhiMoE/Arcee/Jais2 attention and their copies in Aria (text), Emu3, Solar Open, "
        "CWM, Seed-OSS, GraniteMoeShared, HyperCLOVAX, VaultGemma, Qwen3-MoE, Mellum, dots.llm1, HunYuan (dense, MoE), "
        "Apertus, EXAONE 4, OLMo3, FlexOlmo, OLMoE, SmolLM3, GraniteMoeHybrid, Jamba, MiniMax (full-attention "
        "layers), Bamba, Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense, MoE) language models (multimodal RoPE), LFM2 "
        "(dense, MoE), LFM3, Apertus 1.5 (text), EXAONE-MoE, HY-V3, Nemotron-H, Kolibri 1, LaraMini, NanoChat, "
        "BitNet, EuroBERT (an encoder), Qwen3-Omni (thinker text), Cosmos3-Edge (text), DeepSeek-OCR2 (text), CSM, "
        "Higgs-Audio-v2, Granite4-Vision (text), Granite-Docling (text) and Voxtral-Realtime (audio encoder, text) "
        "(q_proj/k_proj; MHA, GQA, MQA; per-head q/k norms, OLMo2's over all heads; NoPE layers; output gates)",
        lambda m: _is(m, "transformers", _LLAMA | _LLAMA_MORE | _LLAMA_SURVEY_2 | _LLAMA_SURVEY_3),
        _llama_layout,
    ),
    ModelAdapter(
        "transformers-rotary",
        "transformers Phi (phi-1/phi-2), StableLM, GPT-J, Cohere, Cohere2, Cohere2-MoE, Helium, OLMo, GLM, GLM-4, "
        "GLM-4-MoE, ERNIE 4.5 (dense, MoE), Nemotron, GLM-4V (text; dense, MoE), GLM-OCR (text) and ERNIE-4.5-VL "
        "(text) attention (q_proj/k_proj; "
        "MHA, GQA; partial or interleaved RoPE, per-head q/k norms and OLMo's clip_qkv after the maps)",
        lambda m: _is(m, "transformers", _ROTARY),
        _rotary_layout,
    ),
    ModelAdapter(
        "transformers-phi3",
        "transformers Phi-3 and Phi-4 attention (fused qkv_proj Linear; MHA, GQA; RoPE)",
        lambda m: _is(m, "transformers", frozenset({"Phi3Attention"})),
        _phi3_layout,
    ),
    ModelAdapter(
        "transformers-gpt2",
        "transformers GPT-2 attention (fused c_attn Conv1D; cross-attention q_attn + c_attn)",
        lambda m: _is(m, "transformers", frozenset({"GPT2Attention"})),
        _gpt2_layout,
    ),
    ModelAdapter(
        "transformers-bert",
        "transformers BERT/RoBERTa/ELECTRA/XLM-RoBERTa/CamemBERT self- and cross-attention (query/key/value)",
        lambda m: _is(m, "transformers", _BERT_SELF | _BERT_CROSS),
        _bert_layout,
    ),
    ModelAdapter(
        "transformers-distilbert",
        "transformers DistilBERT self-attention (q_lin/k_lin/v_lin/out_lin)",
        lambda m: _is(m, "transformers", frozenset({"DistilBertSelfAttention"})),
        _distilbert_layout,
    ),
    ModelAdapter(
        "transformers-vit",
        "transformers ViT-family attention: ViT, DeiT, ViTMAE, ViTMSN, Dinov2 (with registers), I-JEPA, AST, "
        "ViViT, Pixio, RF-DETR (backbone), TIPSv2 (vision) (q_proj/k_proj)",
        lambda m: _is(m, "transformers", _VIT),
        _vit_layout,
    ),
    ModelAdapter(
        "transformers-clip",
        "transformers CLIP (text and vision), MetaCLIP 2, CLIPSeg, SigLIP, SigLIP 2, OPT, AIMv2 and the vision "
        "towers of Idefics2, Idefics3, SmolVLM, Kosmos-2, GIT and Chinese-CLIP: self-attention "
        "(q_proj/k_proj/v_proj/out_proj)",
        lambda m: _is(m, "transformers", _OUT_PROJ),
        _out_proj_layout,
    ),
    ModelAdapter(
        "transformers-bart",
        "transformers BART, mBART, Marian, Pegasus, M2M100, PLBart, Blenderbot, BlenderbotSmall, BioGPT, "
        "TimeSeriesTransformer, Whisper and SeamlessM4T (text) attention and the audio encoders of Qwen2-Audio, "
        "Voxtral and AudioFlamingo3: encoder self-attention, decoder causal self-attention with cache, decoder "
        "cross-attention over the encoder output (q_proj/k_proj/v_proj/out_proj)",
        lambda m: _is(m, "transformers", _ENC_DEC),
        _enc_dec_layout,
    ),
    ModelAdapter(
        "transformers-albert",
        "transformers ALBERT self-attention (query/key/value; one module called at every depth it serves, "
        "its maps shared as its weights are)",
        lambda m: _is(m, "transformers", frozenset({"AlbertAttention"})),
        _albert_layout,
    ),
    ModelAdapter(
        "transformers-t5",
        "transformers T5 (T5, mT5, ByT5, Flan-T5), UMT5, SwitchTransformers, Pop2Piano and Udop attention: "
        "encoder self-attention, decoder causal self-attention with cache, decoder cross-attention over the "
        "encoder output (q/k/v/o, relative position bias after the maps; decoders need transformers >= 5.15)",
        lambda m: _is(m, "transformers", _T5),
        _t5_layout,
    ),
    ModelAdapter(
        "transformers-pix2struct",
        "transformers Pix2Struct attention: the vision encoder's self-attention, the text decoder's causal "
        "self-attention with cache and cross-attention over the image (query/key/value/output, the text's relative "
        "position bias after the maps; the decoder needs transformers >= 5.15)",
        lambda m: _is(m, "transformers", _PIX2STRUCT_TEXT | {"Pix2StructVisionAttention"}),
        _pix2struct_layout,
    ),
    ModelAdapter(
        "timm-attention",
        "timm Attention of ViTs (fused qkv Linear, with or without qk_norm)",
        _timm_vit_like,
        _timm_layout,
    ),
    ModelAdapter(
        "timm-attention-pool",
        "timm AttentionPoolLatent (global_pool='map': latent query projection q, fused kv Linear)",
        _timm_pool_like,
        _timm_pool_layout,
    ),
):
    register_adapter(_adapter)
