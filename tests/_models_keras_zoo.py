"""Tiny random-weight KerasHub models for the damcha_keras.convert tests (no
downloads): builders, inputs, gate opening and the canonical parameters of a
converted attention layer, read from the host's own sublayers."""

from __future__ import annotations

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
}
IMAGES = ("vit", "dinov2")  # archs taking images rather than token ids
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
    if arch in IMAGES:
        return cls(dtype=dtype, **cfg, **overrides)
    return cls(vocabulary_size=V, dtype=dtype, **{**cfg, **overrides})


def causal_lm(arch: str, dtype: str | None = None, **overrides: Any) -> Any:
    lm = ARCHS[arch][1](backbone=backbone(arch, dtype, **overrides), preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def inputs(arch: str, batch: int = 2, length: int = 6, seed: int = 0, padded: bool = True) -> Any:
    """Token ids and padding mask (the last row right-padded), or images for a vision arch."""
    rng = np.random.default_rng(seed)
    if arch in IMAGES:
        images = rng.normal(size=(batch, *ARCHS[arch][2]["image_shape"])).astype("float32")
        return {"images": images} if arch == "dinov2" else images  # DINOv2's functional inputs are a dict
    mask = np.ones((batch, length), bool)
    if padded and batch > 1:
        mask[-1, length - 2 :] = False  # right padding in the last row
    x = {"token_ids": rng.integers(1, V, (batch, length)).astype("int32"), "padding_mask": mask}
    if arch == "bert":
        x["segment_ids"] = np.zeros((batch, length), "int32")
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
        ids[0, i] = int(numpy(lm({"token_ids": ids, "padding_mask": mask}))[0, i - 1].argmax())
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


def _projection(dense: Any) -> tuple[np.ndarray, np.ndarray]:
    """(kernel (E, heads, d), bias (heads, d)) of a q/k/v EinsumDense of any orientation."""
    tokens, kernel, out = _einsum_parts(dense)
    k = np.transpose(numpy(dense.kernel).astype(np.float64), [kernel.index(c) for c in (tokens[2], out[2], out[3])])
    b = np.zeros(k.shape[1:]) if dense.bias is None else numpy(dense.bias).astype(np.float64).reshape(k.shape[1:])
    return k, b


def _output(dense: Any) -> tuple[np.ndarray, np.ndarray]:
    """(kernel (H, d_v, E_o), bias (E_o,)) of an attention output EinsumDense."""
    tokens, kernel, out = _einsum_parts(dense)
    k = np.transpose(numpy(dense.kernel).astype(np.float64), [kernel.index(c) for c in (tokens[2], tokens[3], out[2])])
    b = np.zeros(k.shape[-1]) if dense.bias is None else numpy(dense.bias).astype(np.float64)
    return k, b


# arch -> attribute names of (query, key, value, output) on its attention layer
SUBLAYERS = {
    **dict.fromkeys(
        ("gpt2", "opt", "bert", "llama", "mistral", "qwen", "qwen3", "vit", "dinov2"),
        ("_query_dense", "_key_dense", "_value_dense", "_output_dense"),
    ),
    **dict.fromkeys(
        ("gemma", "gemma3", "mixtral", "phi3"), ("query_dense", "key_dense", "value_dense", "output_dense")
    ),
}
ROTARY = ("llama", "mistral", "qwen", "qwen3", "gemma", "gemma3", "mixtral", "phi3")
NORMED = ("qwen3", "gemma3")  # per-head q/k norms between the maps and RoPE


def layer_params(arch: str, layer: Any) -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    """The canonical parameters of a converted attention layer, read from the
    host's sublayers (the projections) and its DamchaMaps (the metric)."""
    cfg = layer.damcha.config
    params: dict[str, np.ndarray] = {}
    for name, attr in zip(("query", "key", "value"), SUBLAYERS[arch][:3]):
        params[f"{name}.kernel"], params[f"{name}.bias"] = _projection(getattr(layer, attr))
    params["output.kernel"], params["output.bias"] = _output(getattr(layer, SUBLAYERS[arch][3]))
    params.update(layer.damcha.to_canonical())
    config = dc.DamchaConfig(
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
    return params, config


def rotary(arch: str, layer: Any, head_dim: int, **positions: Any) -> dc.Rotary | None:
    """The host's RoPE as a damcha_core.Rotary (KerasHub computes inv_freq in float32)."""
    if arch not in ROTARY:
        return None
    # Gemma 3's layers carry their own wavelength (1e6 global, 1e4 sliding-window layers).
    wavelength = np.float32(layer.rope_wavelength if arch == "gemma3" else 10000.0)
    assert getattr(layer, "rope_scaling_factor", 1.0) == 1.0
    inv = 1.0 / (wavelength ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    return dc.Rotary(inv.astype(np.float64), **positions)


def call_layer(arch: str, layer: Any, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The attention layer on tokens x (B, N, E) with a boolean mask (B, N, N)."""
    if arch in ("gpt2", "opt", "bert", "vit", "dinov2"):
        return numpy(layer(x, x, attention_mask=mask))
    return numpy(layer(x, attention_mask=mask))


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
    return {
        "refused": refused,
        "unchanged": unchanged,
        "recompiled_moved": recompiled_moved,
        "compiled_only_moved": gates_moved(dk.convert(compiled_only)),
    }
