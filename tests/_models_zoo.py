"""Tiny random-weight models of every architecture damcha_torch.convert supports,
built from config objects (no downloads), the canonical parameters of their
converted attention layers for comparisons with the NumPy reference, and the
aten op counts of a model before and after conversion."""

from __future__ import annotations

import collections

import numpy as np
import torch
from torch import nn

import damcha_core as dc
import damcha_torch as dt

dt.ensure_torchvision_importable()  # timm imports torchvision (docs/models.md, "Installing on a CPU-only machine")

import timm  # noqa: E402
import transformers  # noqa: E402

VOCAB = 61
CAUSAL = ("llama", "llama-mha", "llama-mqa", "mistral", "qwen2", "qwen3", "gpt2", "bert-decoder", "opt", "clip-text")
# BERT's self-attention copied into other models ("Copied from ... with Bert->Electra").
BERT_COPIES = ("electra", "xlm-roberta", "camembert")
# Encoder-decoders: non-causal encoder self-attention, causal decoder self-attention, cross-attention.
ENC_DEC = ("bart", "mbart", "whisper")
ARCHS = CAUSAL + ("bert", "roberta", *BERT_COPIES, "vit", "vit-qknorm", "hf-vit", "clip-vision", "siglip", "mha")
ARCHS += ENC_DEC
# Encoder-decoders whose attention is a copy of BART's (transformers-bart): built as "bart" is,
# tested by one compact test each (tests/test_models_torch.py), not over ARCHS.
BART_COPY_MODELS = {
    "marian": ("MarianMTModel", "MarianConfig"),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig"),
    "m2m100": ("M2M100ForConditionalGeneration", "M2M100Config"),
    "plbart": ("PLBartForConditionalGeneration", "PLBartConfig"),
    "blenderbot": ("BlenderbotForConditionalGeneration", "BlenderbotConfig"),
    "blenderbot-small": ("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallConfig"),
    # SeamlessM4T's text-to-text model (its text encoder and decoder; its config names d_model hidden_size).
    "seamless-m4t": ("SeamlessM4TForTextToText", "SeamlessM4TConfig"),
}
# Encoder-decoders with T5's attention or a copy of it (transformers-t5): built with the zoo's
# "bart" sizes (T5's names) and d_kv=6, so that n_heads * d_kv (24) differs from d_model as in
# T5-11B (Pix2Struct, transformers-pix2struct: d_kv=8, its text attention's heads fill its
# hidden size); tested by one compact test each (tests/test_models_torch.py), not over ARCHS.
T5_MODELS = {
    "t5": ("T5ForConditionalGeneration", "T5Config", {}),
    "mt5": ("MT5ForConditionalGeneration", "MT5Config", {}),
    "umt5": ("UMT5ForConditionalGeneration", "UMT5Config", {}),
    "switch-transformers": (
        "SwitchTransformersForConditionalGeneration",
        "SwitchTransformersConfig",
        # One sparse (mixture-of-experts) block in each stack; capacity for every token.
        dict(num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    ),
    "pop2piano": ("Pop2PianoForConditionalGeneration", "Pop2PianoConfig", dict(composer_vocab_size=2)),
    # Text and layout (bounding boxes) only: its image patches change the encoder's tokens, not its attention.
    "udop": ("UdopForConditionalGeneration", "UdopConfig", dict(image_size=16, patch_size=8)),
    # A vision encoder over flattened patches (its own attention class) and T5's text decoder under other names.
    "pix2struct": ("Pix2StructForConditionalGeneration", "Pix2StructConfig", {}),
}
# Pix2Struct's patches: a row and a column index, then PIX2STRUCT_PATCH features.
PIX2STRUCT_PATCH = 12
# Whisper's tiny config: log-mel features of WHISPER_MELS bins over 2 * WHISPER_SOURCE frames.
WHISPER_MELS, WHISPER_SOURCE = 8, 8
# The trailing features of run("siglip", ...): its pooling head's, computed by an nn.MultiheadAttention.
SIGLIP_HEAD = 32
# The models whose attention implementation transformers selects (eager or sdpa).
HOST_ATTN = tuple(a for a in ARCHS if a not in ("vit", "vit-qknorm", "mha"))


def _dec(cls_cfg, **kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    base.update(kw)
    return cls_cfg(**base)


def build(arch: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """A tiny model of ``arch`` in eval mode."""
    torch.manual_seed(seed)
    T = transformers
    if arch == "llama":
        m = T.LlamaForCausalLM(_dec(T.LlamaConfig, attn_implementation=attn))
    elif arch == "llama-mha":
        m = T.LlamaForCausalLM(_dec(T.LlamaConfig, num_key_value_heads=4, attn_implementation=attn))
    elif arch == "llama-mqa":
        m = T.LlamaForCausalLM(_dec(T.LlamaConfig, num_key_value_heads=1, attn_implementation=attn))
    elif arch == "mistral":
        m = T.MistralForCausalLM(_dec(T.MistralConfig, attn_implementation=attn))
    elif arch == "qwen2":
        m = T.Qwen2ForCausalLM(_dec(T.Qwen2Config, attn_implementation=attn))
    elif arch == "qwen3":
        m = T.Qwen3ForCausalLM(_dec(T.Qwen3Config, head_dim=8, attn_implementation=attn))
    elif arch == "olmo-clip":  # OLMo clamps q, k and v to +-clip_qkv: a third of them at these sizes
        m = T.OlmoForCausalLM(_dec(T.OlmoConfig, clip_qkv=0.1, attn_implementation=attn))
    elif arch == "gpt2":
        m = T.GPT2LMHeadModel(
            T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn)
        )
    elif arch in ("bert", "bert-decoder"):
        cfg = T.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
            attn_implementation=attn,
        )
        if arch == "bert-decoder":
            cfg.is_decoder, cfg.add_cross_attention = True, True
            m = T.BertLMHeadModel(cfg)
        else:
            m = T.BertModel(cfg)
    elif arch in ("roberta", *BERT_COPIES):
        cls, cls_cfg = {
            "roberta": (T.RobertaModel, T.RobertaConfig),
            "electra": (T.ElectraModel, T.ElectraConfig),
            "xlm-roberta": (T.XLMRobertaModel, T.XLMRobertaConfig),
            "camembert": (T.CamembertModel, T.CamembertConfig),
        }[arch]
        extra = {"embedding_size": 16} if arch == "electra" else {}  # ELECTRA projects its embeddings up
        m = cls(
            cls_cfg(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=70,
                attn_implementation=attn,
                **extra,
            )
        )
    elif arch == "opt":
        m = T.OPTForCausalLM(
            T.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                word_embed_proj_dim=32,
                ffn_dim=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                attn_implementation=attn,
            )
        )
    elif arch in ("clip-text", "clip-vision", "siglip"):
        text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
        vision = dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
        )
        if arch == "clip-text":
            m = T.CLIPTextModel(T.CLIPTextConfig(**text, max_position_embeddings=64, attn_implementation=attn))
        elif arch == "clip-vision":
            m = T.CLIPVisionModel(T.CLIPVisionConfig(**vision, attn_implementation=attn))
        else:  # both towers; the vision tower's pooling head holds an nn.MultiheadAttention (the mha adapter's)
            m = T.SiglipModel(
                T.SiglipConfig(
                    text_config={**text, "max_position_embeddings": 64}, vision_config=vision, attn_implementation=attn
                )
            )
    elif arch in ("vit", "vit-qknorm"):
        m = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=16,
            patch_size=8,
            embed_dim=32,
            depth=2,
            num_heads=4,
            num_classes=5,
            qk_norm=arch == "vit-qknorm",
        )
    elif arch == "hf-vit":  # transformers' ViT (timm's is "vit")
        m = T.ViTModel(
            T.ViTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                image_size=16,
                patch_size=8,
                attn_implementation=attn,
            )
        )
    elif arch in ENC_DEC or arch in BART_COPY_MODELS:
        cls, cls_cfg = {
            "bart": (T.BartForConditionalGeneration, T.BartConfig),
            "mbart": (T.MBartForConditionalGeneration, T.MBartConfig),
            "whisper": (T.WhisperForConditionalGeneration, T.WhisperConfig),
            **{name: (getattr(T, model), getattr(T, config)) for name, (model, config) in BART_COPY_MODELS.items()},
        }[arch]
        sizes = dict(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            # Ids inside the tiny vocabulary (Whisper's defaults, 50256 and up, are not).
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            forced_eos_token_id=None,
            # 10x the default weights: attention logits far from 0, so maps change
            # the attention weights (at 0.02 they move the logits by ~1e-4).
            init_std=0.2,
            attn_implementation=attn,
        )
        if arch == "whisper":
            sizes.update(
                num_mel_bins=WHISPER_MELS,
                max_source_positions=WHISPER_SOURCE,
                max_target_positions=64,
                suppress_tokens=None,
                begin_suppress_tokens=None,
            )
        else:
            sizes.update(max_position_embeddings=64)
        if arch == "seamless-m4t":
            sizes["hidden_size"], sizes["initializer_range"] = sizes.pop("d_model"), sizes.pop("init_std")
            del sizes["forced_eos_token_id"]
            sizes.update(dropout=0.0, attention_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
        m = cls(cls_cfg(**sizes))
    elif arch == "pix2struct":
        text = dict(vocab_size=VOCAB, hidden_size=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
        text.update(pad_token_id=0, eos_token_id=2, decoder_start_token_id=1)
        vision = dict(hidden_size=32, patch_embed_hidden_size=PIX2STRUCT_PATCH, d_ff=48, d_kv=8, seq_len=16)
        vision.update(num_hidden_layers=2, num_attention_heads=4)
        config = T.Pix2StructConfig(text_config=text, vision_config=vision, attn_implementation=attn)
        m = T.Pix2StructForConditionalGeneration(config)
    elif arch in T5_MODELS:
        model, config, extra = T5_MODELS[arch]
        m = getattr(T, model)(
            getattr(T, config)(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=6,
                d_ff=48,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                pad_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=1,
                attn_implementation="eager" if arch == "switch-transformers" else attn,  # its only one
                **extra,
            )
        )
    elif arch == "albert":  # one attention module, shared by the 3 layers it is called for
        m = T.AlbertModel(
            T.AlbertConfig(
                vocab_size=VOCAB,
                embedding_size=16,
                hidden_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
                initializer_range=0.2,  # attention logits far from 0: the maps move the outputs
                attn_implementation=attn,
            )
        )
    elif arch == "mha":
        layer = nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, batch_first=True)
        m = nn.Sequential(nn.Embedding(VOCAB, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    else:
        raise AssertionError(arch)
    return m.to(dtype).eval()


def inputs(
    arch: str, dtype: torch.dtype = torch.float32, batch: int = 2, length: int = 7, padding: bool = True, seed: int = 1
) -> dict:
    """Keyword inputs of ``arch``'s forward; row 0 left-padded by two tokens."""
    g = torch.Generator().manual_seed(seed)
    if arch.startswith("vit"):
        return {"x": torch.randn(batch, 3, 16, 16, generator=g, dtype=dtype)}
    if arch in ("hf-vit", "clip-vision"):
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g, dtype=dtype)}
    if arch == "whisper":
        return {
            "input_features": torch.randn(batch, WHISPER_MELS, 2 * WHISPER_SOURCE, generator=g, dtype=dtype),
            "decoder_input_ids": torch.randint(3, VOCAB, (batch, 4), generator=g),
        }
    if arch == "pix2struct":  # patches in rows of 4 (indices from 1), row 0's last two padding
        n = torch.arange(length, dtype=dtype)
        where = torch.stack([n // 4 + 1, n % 4 + 1], -1).expand(batch, length, 2)
        patches = torch.cat([where, torch.randn(batch, length, PIX2STRUCT_PATCH, generator=g, dtype=dtype)], -1)
        mask = torch.ones(batch, length, dtype=dtype)
        if padding:
            patches[0, -2:], mask[0, -2:] = 0, 0
        return {"flattened_patches": patches, "attention_mask": mask, "decoder_input_ids": _prompt(batch, g)}
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    if arch == "mha":
        kpm = torch.zeros(batch, length, dtype=torch.bool)
        if padding:
            kpm[0, :2] = True
        return {"input": ids, "src_key_padding_mask": kpm}
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding:
        mask[0, :2] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if arch == "siglip":
        out["pixel_values"] = torch.randn(batch, 3, 16, 16, generator=g, dtype=dtype)
    if arch in ENC_DEC or arch in T5_MODELS:
        out["decoder_input_ids"] = _prompt(batch, g)
    if arch == "udop":  # a box (x0, y0, x1, y1) in [0, 1] per token
        out["bbox"] = torch.rand(batch, length, 2, generator=g, dtype=dtype).repeat(1, 1, 2)
        out["bbox"][..., 2:] += 0.1
    if arch == "bert-decoder":
        out["encoder_hidden_states"] = torch.randn(batch, 5, 32, generator=g, dtype=dtype)
    return out


def _prompt(batch: int, g: torch.Generator) -> torch.Tensor:
    """An encoder-decoder's decoder prompt: the start token (1), then 3 tokens."""
    return torch.cat([torch.ones(batch, 1, dtype=torch.long), torch.randint(3, VOCAB, (batch, 3), generator=g)], 1)


def run(model: nn.Module, arch: str, kw: dict) -> torch.Tensor:
    if arch.startswith("vit"):
        return model(kw["x"])
    if arch == "mha":
        emb, enc = model
        return enc(emb(kw["input"]), src_key_padding_mask=kw["src_key_padding_mask"])
    out = model(**kw)
    if arch == "siglip":  # both towers' tokens, then the vision pooling head's output (SIGLIP_HEAD features)
        text, vision = out.text_model_output, out.vision_model_output
        return torch.cat(
            [text.last_hidden_state.flatten(1), vision.last_hidden_state.flatten(1), vision.pooler_output], 1
        )
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def open_gates(model: nn.Module, seed: int = 5, scale: float = 0.5) -> nn.Module:
    """Random gates and generator biases, so every map is far from the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gates." in f".{name}" or ".metric_gates." in f".{name}":
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
            elif ".generators." in f".{name}" and name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return model


# ----------------------------------------------------------- canonical params


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy().copy()


def metric_params(maps: dt.DamchaMaps) -> dict[str, np.ndarray]:
    cfg = maps.config
    out = {}
    for side in cfg.metric_sides:
        S, E, gen = cfg.side_heads(side), cfg.side_features(side), maps.generator(side)
        out[f"metric.{side}.gate"] = _np(maps.gates[side])
        if cfg.metric == "heads":
            out[f"metric.{side}.kernel"] = _np(gen.weight).T.reshape(E, S, S)
            out[f"metric.{side}.bias"] = _np(gen.bias).reshape(S, S)
        else:
            out[f"metric.{side}.kernel"] = _np(gen.weight).T
            out[f"metric.{side}.bias"] = _np(gen.bias)
            out[f"metric.{side}.u"] = _np(gen.u)
            out[f"metric.{side}.v"] = _np(gen.v)
    return out


def _linear(lin, E: int, S: int, d: int, cols: slice | np.ndarray | None = None, conv1d: bool = False):
    w = _np(lin.weight)
    w = w if conv1d else w.T  # (in, out)
    b = None if lin.bias is None else _np(lin.bias)
    if cols is not None:
        w, b = w[:, cols], (None if b is None else b[cols])
    return w.reshape(E, S, d), (np.zeros((S, d)) if b is None else b.reshape(S, d))


def layer_params(arch: str, module: nn.Module) -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    """Canonical params and config of a converted attention module (its output
    projection included; BERT's self-attention has none: the identity)."""
    maps = module.damcha
    c = maps.config
    E, Ekv, H, G, d = c.query_dim, c.context_dim, c.num_heads, c.num_kv_heads, c.key_dim
    p: dict[str, np.ndarray] = {}
    if arch.startswith(("llama", "mistral", "qwen", "clip")) or arch in ("hf-vit", "siglip", "opt", *ENC_DEC):
        projs = {"query": (module.q_proj, E, H), "key": (module.k_proj, Ekv, G), "value": (module.v_proj, Ekv, G)}
        for n, (lin, e, s) in projs.items():
            # Qwen3-Next's q_proj holds, per head, its query and then d features of its output gate.
            gated = n == "query" and lin.out_features == 2 * H * d
            cols = np.arange(2 * H * d).reshape(H, 2, d)[:, 0].ravel() if gated else None
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, e, s, d, cols)
        out = next(getattr(module, a) for a in ("o_proj", "out_proj", "dense") if hasattr(module, a))  # Phi: dense
        # (Zamba2's attention reads 2 * hidden_size features and gives hidden_size.)
        p["output.kernel"] = _np(out.weight).T.reshape(H, d, -1)
        p["output.bias"] = np.zeros(out.out_features) if out.bias is None else _np(out.bias)
    elif arch in T5_MODELS:  # q, k, v and o without biases (Pix2Struct: query, key, value and output)
        names = ("query", "key", "value", "output") if arch == "pix2struct" else ("q", "k", "v", "o")
        q, k, v, o = (getattr(module, a) for a in names)
        for n, lin, e in (("query", q, E), ("key", k, Ekv), ("value", v, Ekv)):
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, e, H, d)
        p["output.kernel"] = _np(o.weight).T.reshape(H, d, E)
        p["output.bias"] = np.zeros(E)
    elif arch == "albert":  # BERT's names; its output projection (dense) is part of the module
        for n, lin in (("query", module.query), ("key", module.key), ("value", module.value)):
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, E, H, d)
        p["output.kernel"] = _np(module.dense.weight).T.reshape(H, d, E)
        p["output.bias"] = _np(module.dense.bias)
    elif arch == "distilbert":
        projs = {"query": module.q_lin, "key": module.k_lin, "value": module.v_lin}
        for n, lin in projs.items():
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, E, H, d)
        p["output.kernel"] = _np(module.out_lin.weight).T.reshape(H, d, E)
        p["output.bias"] = _np(module.out_lin.bias)
    elif arch == "phi3":  # one fused qkv_proj: H query heads, then G key and G value heads
        for i, (n, s) in enumerate((("query", H), ("key", G), ("value", G))):
            start = (0, H * d, (H + G) * d)[i]
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(module.qkv_proj, E, s, d, slice(start, start + s * d))
        p["output.kernel"] = _np(module.o_proj.weight).T.reshape(H, d, E)
        p["output.bias"] = np.zeros(E)
    elif arch == "gpt2":
        if maps.layout.self_attention:
            for i, n in enumerate(("query", "key", "value")):
                p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(
                    module.c_attn, E, H, d, slice(i * E, (i + 1) * E), conv1d=True
                )
        else:
            p["query.kernel"], p["query.bias"] = _linear(module.q_attn, E, H, d, conv1d=True)
            for i, n in enumerate(("key", "value")):
                p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(
                    module.c_attn, Ekv, H, d, slice(i * E, (i + 1) * E), conv1d=True
                )
        p["output.kernel"] = _np(module.c_proj.weight).reshape(H, d, E)
        p["output.bias"] = _np(module.c_proj.bias)
    elif arch.startswith(("bert", "roberta")) or arch in BERT_COPIES:
        for n, lin, e in (("query", module.query, E), ("key", module.key, Ekv), ("value", module.value, Ekv)):
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, e, H, d)
        p["output.kernel"] = np.eye(H * d).reshape(H, d, H * d)
        p["output.bias"] = np.zeros(H * d)
    elif arch == "vl-vision":  # Qwen-VL-like vision towers: a fused qkv (H query, G key, G value heads) or q, k, v
        if hasattr(module, "qkv"):
            starts = np.cumsum([0, H * d, G * d])
            for n, s, start in zip(("query", "key", "value"), (H, G, G), starts):
                p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(module.qkv, E, s, d, slice(start, start + s * d))
        else:
            for n, lin in (("query", module.q), ("key", module.k), ("value", module.v)):
                p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(lin, E, lin.out_features // d, d)
        p["output.kernel"] = _np(module.proj.weight).T.reshape(H, d, -1)
        p["output.bias"] = np.zeros(module.proj.out_features) if module.proj.bias is None else _np(module.proj.bias)
    elif arch.startswith("vit"):
        for i, n in enumerate(("query", "key", "value")):
            p[f"{n}.kernel"], p[f"{n}.bias"] = _linear(module.qkv, E, H, d, slice(i * H * d, (i + 1) * H * d))
        p["output.kernel"] = _np(module.proj.weight).T.reshape(H, d, -1)
        p["output.bias"] = _np(module.proj.bias)
    else:
        raise AssertionError(arch)
    config = dc.DamchaConfig(
        query_dim=E,
        context_dim=Ekv,
        num_heads=H,
        num_kv_heads=G,
        key_dim=d,
        output_dim=p["output.bias"].shape[0],
        use_bias=True,
        metric=c.metric,
        metric_rank=c.metric_rank,
        coupling=c.coupling,
    )
    p.update(metric_params(maps))
    return p, config


def capture(model: nn.Module) -> dict[str, list]:
    """Record (args, kwargs, output) of every converted attention module's calls."""
    calls: dict[str, list] = {}
    for name, module in dt.converted_layers(model).items():

        def hook(mod, args, kwargs, output, name=name):
            calls.setdefault(name, []).append((args, kwargs, output))

        module.register_forward_hook(hook, with_kwargs=True)
    return calls


# ----------------------------------------------------------- aten op counts

# The aten ops that copy data (their output is new memory holding old values).
COPIES = ("cat", "clone", "copy_", "_to_copy", "contiguous", "_reshape_copy")


def aten_calls(call) -> tuple[dict[str, int], list[int], list[tuple[str, int]]]:
    """Runs ``call()`` and returns what it dispatched below autograd (backward
    included): aten op name -> number of calls, the output widths of the GEMMs
    with a bias vector (the projections; an ``addmm`` accumulating into a
    block is not one), and (op, output numel) of every copy (``COPIES``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}
    widths: list[int] = []
    copies: list[tuple[str, int]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts[name] = counts.get(name, 0) + 1
            out = func(*args, **(kwargs or {}))
            if name == "addmm" and args[0].dim() == 1:
                widths.append(out.shape[-1])
            if name in COPIES:
                copies.append((name, out.numel()))
            return out

    with Count():
        call()
    return counts, widths, copies


def extra_copies(converted: list[tuple[str, int]], original: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (op, numel) copies of ``converted`` beyond ``original``'s, sorted."""
    return sorted((collections.Counter(converted) - collections.Counter(original)).elements())


def aten_calls_before_and_after_convert(arch: str, mode: str, *, prepare=None, zero_grad: bool = False, **options):
    """``aten_calls`` of one step of ``arch``'s float32 model, unconverted and
    then converted (``recompute=True``, ``options``, gates open), each counted
    on its second call so one-time work (caches, lazy set-up) stays out.

    Args:
        arch: a name of ``ARCHS``.
        mode: "no-grad" (a forward under ``torch.no_grad`` in eval mode) or
            "train" (train mode, forward and backward of the squared mean).
        prepare: ``model -> model``, applied to each fresh model first.
        zero_grad: in "train", set the gradients to None before each call, so
            the counted backward does not accumulate into the warm-up's.

    Returns:
        (original counts, converted counts, the converted model).
    """
    counts = []
    for convert in (False, True):
        model = build(arch, torch.float32)
        if prepare is not None:
            model = prepare(model)
        if convert:
            open_gates(dt.convert(model, recompute=True, **options))
        kw = inputs(arch)
        if mode == "no-grad":
            model.eval()

            def call(model=model, kw=kw):
                with torch.no_grad():
                    run(model, arch, kw)
        elif mode == "train":
            model.train()

            def call(model=model, kw=kw):
                if zero_grad:
                    model.zero_grad(set_to_none=True)
                run(model, arch, kw).square().mean().backward()
        else:
            raise AssertionError(mode)
        call()
        counts.append(aten_calls(call))
    return counts[0], counts[1], model
