"""Tiny random-weight KerasHub models for the damcha_keras.convert tests (no
downloads): builders, inputs, gate opening and the canonical parameters of a
converted attention layer, read from the host's own sublayers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import keras_hub
import numpy as np

import damcha_core as dc

V = 64  # vocabulary
# arch -> (backbone class, CausalLM class or None, tiny config)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "gpt2": (
        keras_hub.models.GPT2Backbone,
        keras_hub.models.GPT2CausalLM,
        dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=32),
    ),
    # OPT: KerasHub's CachedMultiHeadAttention with learned positions (no RoPE).
    "opt": (
        keras_hub.models.OPTBackbone,
        keras_hub.models.OPTCausalLM,
        dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=32),
    ),
    "bert": (
        keras_hub.models.BertBackbone,
        None,
        dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=32),
    ),
    "llama": (
        keras_hub.models.LlamaBackbone,
        keras_hub.models.LlamaCausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
    ),
    "mistral": (
        keras_hub.models.MistralBackbone,
        keras_hub.models.MistralCausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
    ),
    "qwen": (
        keras_hub.models.QwenBackbone,
        keras_hub.models.QwenCausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
    ),
    "qwen3": (
        keras_hub.models.Qwen3Backbone,
        keras_hub.models.Qwen3CausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, head_dim=4, hidden_dim=16, intermediate_dim=32),
    ),
    "gemma": (
        keras_hub.models.GemmaBackbone,
        keras_hub.models.GemmaCausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, head_dim=4, hidden_dim=16, intermediate_dim=32),
    ),
    "mixtral": (
        keras_hub.models.MixtralBackbone,
        keras_hub.models.MixtralCausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32, num_experts=2),
    ),
    "phi3": (
        keras_hub.models.Phi3Backbone,
        keras_hub.models.Phi3CausalLM,
        dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
    ),
    # Gemma 3 (text only: image_size is required, no vision encoder): per-head q/k RMS
    # norms between the maps and RoPE, global layers' RoPE at wavelength 1e6.
    "gemma3": (
        keras_hub.models.Gemma3Backbone,
        keras_hub.models.Gemma3CausalLM,
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            hidden_dim=16,
            intermediate_dim=32,
            image_size=16,
        ),
    ),
    # Images (B, 8, 8, 3) in 4x4 patches: 4 patches and the class token.
    "vit": (
        keras_hub.models.ViTBackbone,
        None,
        dict(image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16),
    ),
    # DINOv2's DINOV2Attention wraps a MultiHeadAttention (and a dropout): the MHA is converted.
    "dinov2": (
        keras_hub.models.DINOV2Backbone,
        None,
        dict(
            image_shape=(8, 8, 3),
            position_embedding_shape=(8, 8, 3),
            patch_size=4,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
        ),
    ),
    # ALiBi (Bloom: in the layer; Falcon: built by its decoder block from the padding mask).
    "bloom": (
        keras_hub.models.BloomBackbone,
        keras_hub.models.BloomCausalLM,
        dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16),
    ),
    "falcon": (
        keras_hub.models.FalconBackbone,
        keras_hub.models.FalconCausalLM,
        dict(num_layers=2, num_attention_heads=2, hidden_dim=8, intermediate_dim=16),
    ),
    # GQA, YaRN RoPE, attention sinks, sliding window; MoE feed-forward.
    "gpt_oss": (
        keras_hub.models.GptOssBackbone,
        keras_hub.models.GptOssCausalLM,
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            hidden_dim=16,
            intermediate_dim=16,
            num_experts=2,
        ),
    ),
    # Dense projections, GQA; RoPE in its first layer, none (NoPE) in its second.
    "smollm3": (
        keras_hub.models.SmolLM3Backbone,
        keras_hub.models.SmolLM3CausalLM,
        dict(
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            attention_bias=False,
            attention_dropout=0.0,
            rope_layer_enabled_list=[True, False],
            layer_types=["attention", "attention"],
            mlp_bias=False,
            layer_norm_epsilon=1e-6,
            max_position_embeddings=64,
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
        ),
    ),
    # Qwen3's attention (per-head q/k norms) under another class.
    "qwen3_moe": (
        keras_hub.models.Qwen3MoeBackbone,
        keras_hub.models.Qwen3MoeCausalLM,
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            hidden_dim=16,
            intermediate_dim=32,
            moe_intermediate_dim=8,
            num_experts=2,
            top_k=1,
        ),
    ),
    # Gemma 4 text (image_size is required, no vision encoder): per-head q/k RMS norms, value
    # norm, attention scale 1; layer 0 sliding-window, layer 1 global (sliding_window_pattern).
    "gemma4": (
        keras_hub.models.Gemma4Backbone,
        keras_hub.models.Gemma4CausalLM,
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            hidden_dim=16,
            intermediate_dim=32,
            image_size=16,
            sliding_window_size=3,
            sliding_window_pattern=2,
        ),
    ),
    # ESM-2: RoformerAttention's Dense projections, RoPE; bidirectional.
    "esm": (
        keras_hub.models.ESMBackbone,
        None,
        dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0),
    ),
    # DINOv3: Dense projections, 2-D RoPE on the patch tokens (not on the class and register tokens).
    "dinov3": (
        keras_hub.models.DINOV3Backbone,
        None,
        dict(
            image_shape=(8, 8, 3),
            patch_size=4,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            num_register_tokens=1,
        ),
    ),
    # Gemma 3n's text model (Gemma3nTextAttention: Dense projections, per-head q/k norms, RoPE,
    # value norm, scale 1; AltUp and Laurel around it); layer 0 sliding-window (3), layer 1 global.
    "gemma3n": (
        keras_hub.models.Gemma3nBackbone,
        None,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            text_hidden_size=16,
            intermediate_size=[32, 32],
            pad_token_id=0,
            hidden_activation="gelu_approximate",
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=3,
            rope_theta=10000.0,
            max_position_embeddings=32,
            vocab_size_per_layer_input=V,
            hidden_size_per_layer_input=2,
            altup_num_inputs=2,
            laurel_rank=1,
        ),
    ),
    # Qwen3.5: a linear-attention layer (Gated DeltaNet, no softmax: left as it is), then a
    # full-attention layer whose query projection holds each head's query and output gate.
    "qwen3_5": (
        keras_hub.models.Qwen3_5Backbone,
        None,
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            hidden_dim=16,
            intermediate_dim=32,
            layer_types=["linear_attention", "full_attention"],
            partial_rotary_factor=0.5,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=4,
            linear_value_head_dim=4,
            linear_conv_kernel_dim=4,
        ),
    ),
    # MiT (SegFormer's encoder), (B, 16, 16, 3) images: stage 0 of 4x4 patches whose keys are
    # reduced to 2x2 (sr_ratio 2: keys of other tokens than the queries), stage 1 of 2x2 (sr_ratio 1).
    "mit": (
        keras_hub.models.MiTBackbone,
        None,
        dict(
            image_shape=(16, 16, 3),
            layerwise_depths=[1, 1],
            hidden_dims=[8, 8],
            num_layers=2,
            layerwise_num_heads=[2, 2],
            layerwise_sr_ratios=[2, 1],
            max_drop_path_rate=0.0,
            layerwise_patch_sizes=[7, 3],
            layerwise_strides=[4, 2],
        ),
    ),
}
IMAGES = ("vit", "dinov2", "dinov3", "mit")  # archs taking images rather than token ids
CAUSAL = tuple(a for a, (_, lm, _) in ARCHS.items() if lm is not None)


# Options that make a layout's own attention features act at sequence lengths <= 8
# (the defaults leave them inert): Mistral's sliding window; Gemma 2's logit
# soft-capping, query scaling by hidden_dim / heads and alternating sliding window.
# Qwen's output embedding untied: with tied ones a tiny random Qwen greedily
# repeats its last token, which makes a weak generation test.
ACTIVE = {
    "mistral": dict(sliding_window=3),
    "mixtral": dict(sliding_window=3),
    "qwen": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False),
    "gemma": dict(
        attention_logit_soft_cap=0.5,
        query_head_dim_normalize=False,
        use_sliding_window_attention=True,
        sliding_window_size=3,
    ),
}


def backbone(arch: str, dtype: str | None = None, **overrides: Any) -> Any:
    cls, _, cfg = ARCHS[arch]
    if arch in ("smollm3", "mit") and dtype is not None:
        # SmolLM3's attention builds its projections with the global dtype policy, not the
        # model's, and MiT all its layers (KerasHub 0.32): float64 needs it as the global policy too.
        with global_dtype_policy(dtype):
            return _build(arch, cls, dtype, {**cfg, **overrides})
    return _build(arch, cls, dtype, {**cfg, **overrides})


def _build(arch: str, cls: Any, dtype: str | None, cfg: dict[str, Any]) -> Any:
    if arch in IMAGES:
        return cls(dtype=dtype, **cfg)
    return cls(**{"text_vocab_size" if arch == "gemma3n" else "vocabulary_size": V}, dtype=dtype, **cfg)


def attention_layers(arch: str) -> int:
    """How many attention layers convert() converts in ``backbone(arch)``."""
    cfg = ARCHS[arch][2]
    if arch == "qwen3_5":  # its full-attention layers only
        return cfg["layer_types"].count("full_attention")
    if arch == "mit":
        return sum(cfg["layerwise_depths"])
    return cfg["num_hidden_layers" if arch == "gemma3n" else "num_layers"]


@contextlib.contextmanager
def global_dtype_policy(policy: str) -> Iterator[None]:
    """Keras's global dtype policy set to ``policy`` within."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def causal_lm(arch: str, dtype: str | None = None, **overrides: Any) -> Any:
    lm = ARCHS[arch][1](backbone=backbone(arch, dtype, **overrides), preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def inputs(arch: str, batch: int = 2, length: int = 6, seed: int = 0, padded: bool = True) -> Any:
    """Token ids and padding mask (the last row right-padded), or images for a vision arch."""
    rng = np.random.default_rng(seed)
    if arch in IMAGES:
        images = rng.normal(size=(batch, *ARCHS[arch][2]["image_shape"])).astype("float32")
        # DINOv2's and DINOv3's functional inputs are dicts.
        return {"images": images} if arch == "dinov2" else {"pixel_values": images} if arch == "dinov3" else images
    ids = rng.integers(1, V, (batch, length)).astype("int32")
    if arch == "esm":
        # ESM takes no padding mask (it masks its pad token id, 0); its layers mask padded
        # *queries* rather than keys (KerasHub 0.32), so its inputs are never padded here.
        return {"token_ids": ids}
    mask = np.ones((batch, length), bool)
    if padded and batch > 1:
        mask[-1, length - 2 :] = False  # right padding in the last row
    x = {"token_ids": ids, "padding_mask": mask}
    if arch == "bert":
        x["segment_ids"] = np.zeros((batch, length), "int32")
    return with_positions(arch, x)


def lm_inputs(lm: Any, token_ids: np.ndarray, padding_mask: np.ndarray) -> dict[str, Any]:
    """A causal LM's full-forward inputs (Gemma 4's with position ids)."""
    x = {"token_ids": token_ids, "padding_mask": padding_mask}
    return with_positions("gemma4", x) if "position_ids" in lm.input else x


def with_positions(arch: str, x: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's functional inputs include position ids (0, 1, ... in every row)."""
    if arch == "gemma4" and "position_ids" not in x:
        B, L = np.shape(x["token_ids"])
        x = {**x, "position_ids": np.arange(L, dtype="int32")[None].repeat(B, 0)}
    return x


def numpy(x: Any) -> np.ndarray:
    return keras.ops.convert_to_numpy(x)


def output(model: Any, x: dict[str, np.ndarray]) -> np.ndarray:
    y = model(x)
    return numpy(y["sequence_output"] if isinstance(y, dict) else y)


def open_gates(model: Any, seed: int = 1, gate: float = 0.5, scale: float = 0.5) -> None:
    """Random metric weights (gates of size about ``gate``) in every converted layer."""
    import damcha_keras as dk

    rng = np.random.default_rng(seed)
    for layer in dk.converted_layers(model).values():
        maps = layer.damcha
        maps.load_canonical(
            {
                k: rng.normal(size=v.shape) * (gate if k.endswith(".gate") else scale)
                for k, v in maps.to_canonical().items()
            }
        )


def greedy_without_cache(lm: Any, prompt: list[int], max_length: int) -> list[int]:
    """Greedy decoding by full forwards of the whole sequence (no cache).

    Every forward has the shape (1, max_length): the logits at position i of a
    causal LM do not depend on the (zero) tokens after it, and one shape keeps
    JAX's op-by-op compilation cache warm."""
    ids = np.zeros((1, max_length), "int32")
    ids[0, : len(prompt)] = prompt
    mask = np.ones((1, max_length), bool)
    for i in range(len(prompt), max_length):
        ids[0, i] = int(numpy(lm(lm_inputs(lm, ids, mask)))[0, i - 1].argmax())
    return [int(t) for t in ids[0]]


def greedy_generate(lm: Any, prompt: list[int], max_length: int) -> list[int]:
    """KerasHub's generate() (greedy sampler, KV cache) from an unpadded prompt."""
    ids = np.zeros((1, max_length), "int32")
    ids[0, : len(prompt)] = prompt
    mask = np.zeros((1, max_length), bool)
    mask[0, : len(prompt)] = True
    out = lm.generate({"token_ids": ids, "padding_mask": mask}, max_length=max_length, stop_token_ids=None)
    return [int(t) for t in np.asarray(out["token_ids"])[0]]


def generate_batch(lm: Any, prompts: list[list[int]], max_length: int) -> np.ndarray:
    """KerasHub's generate() (greedy sampler, KV cache) from right-padded prompts: (B, max_length)."""
    ids = np.zeros((len(prompts), max_length), "int32")
    mask = np.zeros((len(prompts), max_length), bool)
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)], mask[b, : len(prompt)] = prompt, True
    out = lm.generate({"token_ids": ids, "padding_mask": mask}, max_length=max_length, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def greedy_mismatches(prompts: list[list[int]], generated: np.ndarray, full_logits: np.ndarray) -> int:
    """How many generated tokens differ from greedy decoding without a cache.

    ``full_logits`` (B, L, V) are one full forward of ``generated`` (B, L). In a
    causal LM the logits at position i - 1 depend only on tokens < i, so if every
    token after the prompt is the argmax of the previous position's full-forward
    logits, then by induction the sequence equals greedy decoding by repeated
    full forwards, token for token; this needs one forward instead of one per token."""
    return sum(
        int(generated[b, i] != full_logits[b, i - 1].argmax())
        for b, prompt in enumerate(prompts)
        for i in range(len(prompt), generated.shape[1])
    )


def cached_logits(lm: Any, token_ids: np.ndarray) -> np.ndarray:
    """Logits of ``token_ids`` (B, L) computed token by token with call_with_cache."""
    import damcha_keras as dk

    layers = list(dk.converted_layers(lm).values())
    cfg = layers[0].damcha.config
    B, L = token_ids.shape
    cache = keras.ops.zeros((B, len(layers), 2, L, cfg.num_kv_heads, cfg.key_dim), dtype=lm.backbone.compute_dtype)
    steps = []
    for i in range(L):
        logits, _, cache = lm.call_with_cache(
            keras.ops.convert_to_tensor(token_ids[:, i : i + 1]), cache, keras.ops.convert_to_tensor(i, "int32")
        )
        steps.append(numpy(logits)[:, 0])
    return np.stack(steps, axis=1)


def _einsum_parts(dense: Any) -> tuple[str, str, str]:
    inputs, _, out = dense.equation.replace(" ", "").partition("->")
    tokens, _, kernel = inputs.partition(",")
    return tokens, kernel, out


def _bias(dense: Any, shape: tuple[int, ...]) -> np.ndarray:
    bias = getattr(dense, "bias", None)
    return np.zeros(shape) if bias is None else numpy(bias).astype(np.float64).reshape(shape)


def _projection(dense: Any, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(kernel (E, heads, d), bias (heads, d)) of a q/k/v projection: an EinsumDense of
    any orientation, a Dense whose flat features the host splits head by head into
    ``heads`` heads, or Gemma 4's clippable projection (its EinsumDense's kernel)."""
    if isinstance(dense, keras.layers.Dense):
        E, F = dense.kernel.shape
        k = numpy(dense.kernel).astype(np.float64).reshape(E, heads, F // heads)
        return k, _bias(dense, k.shape[1:])
    dense = getattr(dense, "dense", dense)
    tokens, kernel, out = _einsum_parts(dense)
    k = np.transpose(numpy(dense.kernel).astype(np.float64), [kernel.index(c) for c in (tokens[2], out[2], out[3])])
    return k, _bias(dense, k.shape[1:])


def projection(dense: Any, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(kernel (E, heads, d), bias (heads, d)) of a query/key/value projection, as
    ``layer_params`` reads them."""
    return _projection(dense, heads)


def _output(dense: Any, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(kernel (H, d_v, E_o), bias (E_o,)) of an attention output projection: an
    EinsumDense, or a Dense of the flat heads (H * d_v, E_o)."""
    if isinstance(dense, keras.layers.Dense):
        F, E = dense.kernel.shape
        return numpy(dense.kernel).astype(np.float64).reshape(heads, F // heads, E), _bias(dense, (E,))
    dense = getattr(dense, "dense", dense)
    tokens, kernel, out = _einsum_parts(dense)
    k = np.transpose(numpy(dense.kernel).astype(np.float64), [kernel.index(c) for c in (tokens[2], tokens[3], out[2])])
    return k, _bias(dense, k.shape[-1:])


# arch -> attribute names of (query, key, value, output) on its attention layer
SUBLAYERS = {
    **dict.fromkeys(
        ("gpt2", "opt", "bert", "llama", "mistral", "qwen", "qwen3", "vit", "dinov2", "bloom", "qwen3_moe"),
        ("_query_dense", "_key_dense", "_value_dense", "_output_dense"),
    ),
    **dict.fromkeys(
        ("gemma", "gemma3", "mixtral", "phi3", "falcon", "gpt_oss", "gemma4", "dinov3"),
        ("query_dense", "key_dense", "value_dense", "output_dense"),
    ),
    "smollm3": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gemma3n": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qwen3_5": ("_query_dense", "_key_dense", "_value_dense", "_output_dense"),
    "mit": ("q", "k", "v", "proj"),
    # PaliGemma's PaliGemmaVitAttention, Gemma 3's Gemma3VisionAttention (CLIP's layout).
    "clip_vit": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "videoprism": ("query_dense", "key_dense", "value_dense", "output_dense"),
    "esm": ("q_dense", "k_dense", "v_dense", "o_dense"),
    "t5": ("query_projector", "key_projector", "value_projector", "output_projector"),
}
ROTARY = ("llama", "mistral", "qwen", "qwen3", "gemma", "gemma3", "mixtral", "phi3", "qwen3_moe", "esm", "smollm3")
NORMED = ("qwen3", "gemma3", "qwen3_moe")  # per-head q/k norms between the maps and RoPE
# Layers with the host's own position scheme, checked against the host itself with its query
# and key projections followed by the reference's maps (host_with_reference_maps):
# GPT-OSS's sinks and YaRN RoPE, Gemma 4's norms and value norm (both EinsumDense
# projections, whose equations fix the heads), Gemma 3n's norms, value norm and sliding window,
# Qwen3.5's norms, partial RoPE and output gate, MiT's sequence reduction (its keys and values
# project the tokens after a strided convolution and a norm).
HOSTED = ("gpt_oss", "gemma4", "gemma3n", "qwen3_5", "mit")
# The couplings convert(coupling="auto") gives each converted layer, in layer order, where a
# layout's rule decides them: MiT's stage-0 keys project the sequence-reduced tokens (separate).
COUPLINGS = {"mit": ["separate", "tied"], "qwen3_5": ["separate"]}
# Query projections that emit, for each query head, its query then its output gate (H, 2d):
# the maps act on the queries, the gates pass as they are.
GATED = ("qwen3_5",)
# Position terms of their own that depend on positions only (positional_reference): ALiBi,
# T5's bucketed bias, DINOv3's 2-D RoPE of the patch tokens.
POSITIONAL = ("bloom", "falcon", "t5", "dinov3")


def layer_params(arch: str, layer: Any) -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    """The canonical parameters of a converted attention layer, read from the
    host's sublayers (the projections) and its DamchaMaps (the metric)."""
    cfg = layer.damcha.config
    params: dict[str, np.ndarray] = {}
    for name, attr, heads in zip(
        ("query", "key", "value"), SUBLAYERS[arch][:3], (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
    ):
        params[f"{name}.kernel"], params[f"{name}.bias"] = _projection(getattr(layer, attr), heads)
        if name == "query" and arch in GATED:  # the query half of each head's (query, gate)
            params["query.kernel"] = params["query.kernel"][..., : cfg.key_dim]
            params["query.bias"] = params["query.bias"][..., : cfg.key_dim]
    params["output.kernel"], params["output.bias"] = _output(getattr(layer, SUBLAYERS[arch][3]), cfg.num_heads)
    params.update(layer.damcha.to_canonical())
    return params, reference_config(cfg)


def reference_config(cfg: dc.DamchaConfig) -> dc.DamchaConfig:
    """The reference's config of a converted layer's DamchaConfig, with projection biases."""
    return dc.DamchaConfig(
        query_dim=cfg.query_dim,
        context_dim=cfg.context_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        key_dim=cfg.key_dim,
        metric=cfg.metric,
        metric_rank=cfg.metric_rank,
        coupling=cfg.coupling,
        use_bias=True,
    )


def rotary(arch: str, layer: Any, head_dim: int, **positions: Any) -> dc.Rotary | None:
    """The host's RoPE as a damcha_core.Rotary (KerasHub computes inv_freq in float32)."""
    if arch not in ROTARY or (arch == "smollm3" and not layer.use_rope):  # SmolLM3's NoPE layers
        return None
    if arch == "smollm3":  # its inv_freq is a variable of its rotary layer (default rope: no scaling)
        assert layer.rotary_embedding.attention_scaling == 1.0
        return dc.Rotary(numpy(layer.rotary_embedding.inv_freq).astype(np.float64), **positions)
    # Gemma 3's layers carry their own wavelength (1e6 global, 1e4 sliding-window layers).
    wavelength = np.float32(layer.rope_wavelength if arch == "gemma3" else 10000.0)
    assert getattr(layer, "rope_scaling_factor", 1.0) == 1.0
    inv = 1.0 / (wavelength ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    return dc.Rotary(inv.astype(np.float64), **positions)


def falcon_alibi(heads: int, n: int) -> np.ndarray:
    """An ALiBi bias (1, heads, 1, n) for Falcon's attention layer (its decoder block
    builds one from the padding mask and hands it to the layer): slopes per head
    times the key position."""
    return (-(2.0 ** -np.arange(1, heads + 1)))[None, :, None, None] * np.arange(n)[None, None, None, :]


def call_layer(arch: str, layer: Any, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The attention layer on tokens x (B, N, E) with a boolean mask (B, N, N)."""
    if arch in ("gpt2", "opt", "bert", "vit", "dinov2"):
        return numpy(layer(x, x, attention_mask=mask))
    if arch == "falcon":
        return numpy(layer(x, falcon_alibi(layer.num_heads, x.shape[1]).astype(x.dtype), attention_mask=mask))
    if arch == "esm":  # its (B, N) padding mask (it masks queries, KerasHub 0.32): all visible here
        assert mask.all()
        return numpy(layer(x, attention_mask=np.ones(x.shape[:2], bool)))
    if arch == "t5":
        return numpy(layer(x, mask=mask)[0])
    if arch == "dinov3":  # x: class, register and patch tokens; bidirectional
        assert mask.all()
        cos, sin = dinov3_rope(layer, x.dtype.name)
        return numpy(layer(x, position_embeddings=(cos, sin), num_prefix_tokens=x.shape[1] - cos.shape[0]))
    return numpy(layer(x, attention_mask=mask))


def dinov3_rope(layer: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) (patches, head_dim) of DINOv3's 2-D RoPE for ARCHS' 8x8 images,
    from the host's own rope layer (they depend on patch positions only)."""
    from keras_hub.src.models.dinov3.dinov3_layers import DINOV3RopePositionEmbedding

    cfg = ARCHS["dinov3"][2]
    rope = DINOV3RopePositionEmbedding(
        layer.hidden_dim, layer.num_heads, rope_theta=100.0, patch_size=cfg["patch_size"]
    )
    cos, sin = rope(np.zeros((1, *cfg["image_shape"]), dtype))
    return numpy(cos).astype(np.float64), numpy(sin).astype(np.float64)


def positional_reference(arch: str, layer: Any, params: dict[str, np.ndarray], config: Any, x: Any, mask: Any) -> Any:
    """Bloom, Falcon, T5 or DINOv3 attention in NumPy float64: the reference's maps
    of the projected heads, then the host's position terms, which depend on
    positions only (the host's own numbers): ALiBi added to the logits (Bloom's
    AlibiBias layer; Falcon's as call_layer passes it), T5's bucketed bias table
    (a stack's first layer), DINOv3's 2-D RoPE (rotate-half by dinov3_rope's
    cos/sin) on the patch tokens after the class and register tokens; softmax
    attention at the host's scale (1/sqrt(d) on the dot products for Bloom and
    DINOv3, on dot products plus ALiBi for Falcon, none for T5)."""
    from damcha_core._reference import apply_map as reference_map

    n = x.shape[1]
    q, k, v = (
        np.einsum("bte,ehd->bthd", x, params[f"{r}.kernel"]) + params[f"{r}.bias"] for r in ("query", "key", "value")
    )
    q, k = (
        y if side is None else reference_map(params, config, side, x, y)
        for y, side in ((q, dc.side_of(config, "q")), (k, dc.side_of(config, "k")))
    )
    if arch == "dinov3":
        cos, sin = dinov3_rope(layer, "float64")
        prefix = n - cos.shape[0]

        def rotate(t: np.ndarray) -> np.ndarray:
            half = t.shape[-1] // 2
            turned = np.concatenate([-t[..., half:], t[..., :half]], axis=-1)
            patches = t[:, prefix:] * cos[None, :, None] + turned[:, prefix:] * sin[None, :, None]
            return np.concatenate([t[:, :prefix], patches], axis=1)

        q, k = rotate(q), rotate(k)
    logits = np.einsum("bnhd,bmhd->bhnm", q, k)
    scale = 1 / np.sqrt(config.key_dim)
    if arch == "bloom":
        logits = logits * scale + numpy(layer._alibi_layer(np.zeros((1, config.num_heads, n, n)))).astype(np.float64)
    elif arch == "falcon":
        logits = (logits + falcon_alibi(config.num_heads, n)) * scale
    elif arch == "dinov3":
        logits = logits * scale
    elif layer.use_relative_attention_bias:  # T5: only a stack's first layer holds the table
        logits = logits + numpy(layer.compute_bias(n, n)).astype(np.float64)
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhnm,bmhd->bnhd", probs, v)
    return np.einsum("bnhd,hde->bne", o, params["output.kernel"]) + params["output.bias"]


@contextlib.contextmanager
def reference_maps(arch: str, model: Any) -> Iterator[None]:
    """Within: every converted layer of ``model`` projects its queries and keys with
    the host's projection followed by the NumPy reference's map (float64), in
    place of its DAMCHA site. A converted model is, by definition, its host with
    q := L(t) q and k := L(t) k; the model run so is that definition with the
    reference's maps, whatever the host does after its projections."""
    import damcha_keras as dk
    from damcha_core._reference import apply_map as reference_map

    installed = []
    for layer in dk.converted_layers(model).values():
        params, config = layer_params(arch, layer)
        for role, attr in zip(("q", "k"), SUBLAYERS[arch][:2]):
            projection, side = getattr(layer, attr), dc.side_of(config, role)

            def site(
                tokens: Any,
                *args: Any,
                _p: Any = projection,
                _side: Any = side,
                _params: Any = params,
                _config: Any = config,
                _gated: bool = arch in GATED and role == "q",
                **kwargs: Any,
            ) -> Any:
                y0 = type(_p).call(_p, tokens, *args, **kwargs)
                y = numpy(y0).astype(np.float64)
                d = _config.key_dim
                heads = y[..., :d] if _gated else y.reshape(*y.shape[:2], -1, d)
                if _side is not None:
                    heads = reference_map(_params, _config, _side, numpy(tokens).astype(np.float64), heads)
                out = np.concatenate([heads, y[..., d:]], axis=-1) if _gated else heads.reshape(y.shape)
                return keras.ops.convert_to_tensor(out, dtype=y0.dtype)

            installed.append((projection, projection.__dict__["call"]))
            projection.call = site
    try:
        yield
    finally:
        for projection, call in installed:
            projection.call = call


def convert_after_fit() -> dict[str, Any]:
    """convert() of a model whose optimizer is built (fitted once) is refused and
    leaves it unconverted; compiled again (a new optimizer), it converts and fit()
    trains the gates; compiled but not yet run, it converts and trains too."""
    import damcha_keras as dk

    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype("float32")

    def model() -> Any:
        inp = keras.Input((None, 8))
        return keras.Model(inp, keras.layers.MultiHeadAttention(2, 4)(inp, inp))

    def gates_moved(m: Any) -> bool:
        m.fit(x, x, epochs=2, verbose=0)
        return all(bool(np.abs(numpy(g)).max() > 0) for g in dk.damcha_variables(m, generators=False))

    fitted = model()
    fitted.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    fitted.fit(x, x, verbose=0)
    n = len(fitted.weights)
    try:
        dk.convert(fitted)
        refused = ""
    except dc.DamchaValueError as exc:
        refused = str(exc)
    unchanged = len(fitted.weights) == n and not dk.converted_layers(fitted)
    fitted.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    recompiled_moved = gates_moved(dk.convert(fitted))
    compiled_only = model()
    compiled_only.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    # A model inside a fitted one (KerasHub's `lm.backbone` after `lm.fit()`): accepted before,
    # and TensorFlow's fit then never trained the new variables.
    inner = model()
    outer_in = keras.Input((None, 8))
    outer = keras.Model(outer_in, inner(outer_in))
    outer.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    outer.fit(x, x, verbose=0)
    try:
        dk.convert(inner)
        inner_refused = ""
    except dc.DamchaValueError as exc:
        inner_refused = str(exc)
    return {
        "inner_refused": inner_refused,
        "inner_unchanged": not dk.converted_layers(inner),
        "refused": refused,
        "unchanged": unchanged,
        "recompiled_moved": recompiled_moved,
        "compiled_only_moved": gates_moved(dk.convert(compiled_only)),
    }
