"""damcha_torch.convert on transformers, timm and nn.MultiheadAttention models:
exact at init, every converted layer equals the NumPy reference with the gates
open, generation with a cache, training, checkpoints, tracing and errors."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import logging
import operator

import numpy as np
import pytest
import torch
from _models_zoo import (
    ARCHS,
    BERT_COPIES,
    CAUSAL,
    ENC_DEC,
    HOST_ATTN,
    SIGLIP_HEAD,
    T5_MODELS,
    VOCAB,
    WHISPER_MELS,
    WHISPER_SOURCE,
    _dec,
    _np,
    aten_calls_before_and_after_convert,
    build,
    capture,
    extra_copies,
    inputs,
    layer_params,
    open_gates,
    run,
    timm,
    transformers,
)
from torch import nn

import damcha_core as dc
import damcha_core._layout
import damcha_torch as dt

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal; NaN where the host itself gives NaN (eager float64
    attention over a fully padded query row) counts as equal."""
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def converted(arch, dtype=torch.float64, attn="sdpa", **kw):
    return dt.convert(build(arch, dtype, attn), **kw)


# --------------------------------------------------------------- at init


# timm and nn.MultiheadAttention choose no attention implementation: one run each.
INIT_CASES = [(a, i) for a in ARCHS for i in (("eager", "sdpa") if a in HOST_ATTN else ("sdpa",))]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch,attn", INIT_CASES)
def test_exact_at_init(arch, dtype, attn):
    model = build(arch, DTYPES[dtype], attn)
    kw = inputs(arch, DTYPES[dtype])
    with torch.no_grad():
        before = run(model, arch, kw)
        dt.convert(model)
        after = run(model, arch, kw)
    assert dt.converted_layers(model)
    if arch in ("mha", "siglip"):  # replaced by DamchaAttention, whose SDPA call differs from MHA's kernel
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5 if dtype == "float32" else 1e-12)
    if arch == "siglip":  # the towers' tokens (the SigLIP attention layers): bit-for-bit
        assert same(after[:, :-SIGLIP_HEAD], before[:, :-SIGLIP_HEAD])
    elif arch != "mha":  # residual form y + 0 * (Delta y): bit-for-bit
        assert same(after, before)


def test_exact_at_init_bfloat16_autocast():
    model = build("llama", torch.float32)
    kw = inputs("llama")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = run(model, "llama", kw)
        dt.convert(model)
        after = run(model, "llama", kw)
    assert torch.equal(after, before)


def test_opened_gates_change_the_output():
    model = build("llama", torch.float64)
    kw = inputs("llama", torch.float64)
    with torch.no_grad():
        before = run(model, "llama", kw)
        after = run(open_gates(dt.convert(model)), "llama", kw)
    assert (after - before).abs().max() > 1e-3


# ------------------------------------------------- layers vs the reference


# How a host lays out its rotation, read in its transformers source: the cos and sin it takes
# (position_embeddings), "cat" (Llama's cat(angles, angles)), "repeat" (each angle twice in a
# row) or "gptj" ((sin, cos), one column per angle); and whether it rotates interleaved pairs
# (2i, 2i + 1) of each head's features rather than halves (i, i + R). It rotates the first 2R
# features of each head, R the number of angles (partial rotary where 2R < d). Default: Llama's.
ROPE_LAYOUTS = {
    "cohere": ("repeat", True),
    "cohere2": ("repeat", True),
    "helium": ("cat", True),  # it repeats each angle of the first half of its cat(angles, angles)
    "gptj": ("gptj", True),
    # GLM's, GLM-4's and ERNIE 4.5's: as Helium's (GLM's over its first partial_rotary_factor).
    "glm": ("cat", True),
    "glm4": ("cat", True),
    "ernie4_5": ("cat", True),
    "ernie4_5_moe": ("cat", True),
    "cohere2_moe": ("repeat", True),
    # GLM-4V's and GLM-OCR's multimodal RoPE (each angle repeated, interleaved pairs over the first
    # partial_rotary_factor; GLM-4V-MoE's in halves, the default), ERNIE-4.5-VL's text model's (interleaved
    # pairs over the whole head).
    "glm4v": ("repeat", True),
    "glm_ocr": ("repeat", True),
    "ernie4_5_vl_moe_text": ("repeat", True),
}
# Hosts that turn each pair by minus its angle (NanoChat's rotate_half flips the signs).
ROPE_REVERSED = frozenset({"nanochat"})


def _rope_layout(model):
    return ROPE_LAYOUTS.get(model.config.model_type, ("cat", False))


def _inv_freq(model):
    """The host's inverse frequencies (R,) in float64 and its factor on cos and sin."""
    if model.config.model_type == "gptj":  # a float32 sin/cos table of the classic frequencies over rotary_dim
        rotary_dim = model.config.rotary_dim
        return 10000.0 ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim), 1.0
    emb = model.model.rotary_emb
    return emb.inv_freq.double().numpy(), float(emb.attention_scaling)


def _rotary(model):
    inv_freq, scaling = _inv_freq(model)
    return dc.Rotary(inv_freq, interleaved=_rope_layout(model)[1], scaling=scaling)


def _rope_call(model, module, x):
    """Call a RoPE attention layer with cos/sin computed in float64 (the host's
    rotary module computes its angles in float32 whatever the model's dtype),
    laid out as the host takes them (``ROPE_LAYOUTS``)."""
    inv_freq, scaling = _inv_freq(model)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * torch.from_numpy(inv_freq)[None]
    cos, sin = angles.cos()[None] * scaling, angles.sin()[None] * scaling
    layout = _rope_layout(model)[0]
    if layout == "gptj":
        position_embeddings = (sin, cos)
    elif layout == "repeat":
        position_embeddings = (cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1))
    else:
        position_embeddings = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    mask = None
    if model.config._attn_implementation == "eager":  # causal through the mask only (Gemma 2 has no SDPA path)
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    with torch.no_grad():
        return module(hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask)[0]


def _call_tokens(args, kwargs):
    x = kwargs.get("hidden_states", args[0] if args else None)
    ctx = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None)
    return x, kwargs.get("key_value_states", ctx)  # BART's and Whisper's cross-attention


def _softmax_attend(q, k, v, scale, causal):
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = scale * np.einsum("bnhd,bmhd->bhnm", q, k)
    if causal:
        n, m = logits.shape[-2:]
        logits = np.where(np.arange(m)[None] <= np.arange(n)[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhnm,bmhd->bnhd", p, v)


def _normed_reference(arch, model, module, x):
    """An independent NumPy forward for layers with per-head q/k norms:
    project, map (the reference's l(t)), norm each head, rotate, attend."""
    p, cfg = layer_params(arch, module)
    _, metric = dc.damcha_attention(p, cfg, x, return_metric=True)
    q = np.einsum("bte,ehd->bthd", x, p["query.kernel"]) + p["query.bias"]
    k = np.einsum("bte,ehd->bthd", x, p["key.kernel"]) + p["key.bias"]
    v = np.einsum("bte,ehd->bthd", x, p["value.kernel"]) + p["value.bias"]
    if cfg.metric == "heads":
        q, k = np.einsum("btha,btad->bthd", metric["q"], q), np.einsum("btha,btad->bthd", metric["k"], k)
    else:  # the dense L(t) (B, T, S, d, S, d)
        q, k = np.einsum("bthiaj,btaj->bthi", metric["q"], q), np.einsum("bthiaj,btaj->bthi", metric["k"], k)
    if arch == "qwen3":

        def norm(y, mod):
            w = mod.weight.detach().double().numpy()
            return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + mod.variance_epsilon) * w

        rot = _rotary(model)
        pos = np.arange(x.shape[1], dtype=np.float64)[None]
        q = dc.apply_rotary(norm(q, module.q_norm), rot, pos)
        k = dc.apply_rotary(norm(k, module.k_norm), rot, pos)
        causal = True
    else:

        def norm(y, mod):
            w, b = mod.weight.detach().double().numpy(), mod.bias.detach().double().numpy()
            mu = y.mean(-1, keepdims=True)
            return (y - mu) / np.sqrt(((y - mu) ** 2).mean(-1, keepdims=True) + mod.eps) * w + b

        q, k = norm(q, module.q_norm), norm(k, module.k_norm)
        causal = False
    o = _softmax_attend(q, k, v, cfg.softmax_scale, causal)
    return np.einsum("bnhd,hde->bne", o, p["output.kernel"]) + p["output.bias"]


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "mha"])
def test_layers_equal_reference_with_gates_open(arch, metric):
    _check_layers_against_reference(arch, metric=metric, metric_rank=3 if metric == "lowrank" else None)


# coupling="query" maps the queries only: the keys pass through unchanged (a lookup of
# the missing key map crashed every forward once).
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert-decoder", "vit", "bart"])
def test_query_coupling_equals_reference(arch):
    _check_layers_against_reference(arch, coupling="query")


def _check_layers_against_reference(arch, model=None, call=None, **options):
    """``model``: a float64 model of ``arch``'s layout converted with ``options``
    (default: the zoo's ``arch``); ``call(model)`` runs it once (default: the
    zoo's inputs of ``arch``, unpadded)."""
    model = converted(arch, **options) if model is None else model
    assert all(
        m.damcha.config.coupling == options.get("coupling", m.damcha.config.coupling)
        for m in dt.converted_layers(model).values()
        if not isinstance(m, dt.DamchaAttention)
    )
    open_gates(model)
    calls = capture(model)
    with torch.no_grad():
        if call is None:
            run(model, arch, inputs(arch, torch.float64, padding=False))
        else:
            call(model)
    assert set(calls) == set(dt.converted_layers(model))
    for name, records in calls.items():
        module = dt.converted_layers(model)[name]
        if isinstance(module, dt.DamchaAttention):  # SigLIP's pooling head: nn.MultiheadAttention, tested as "mha"
            continue
        ((args, kwargs, output),) = records
        # Encoder-decoders: the decoder's self-attention is causal, the encoder's is not.
        causal = bool(module.is_causal) if arch in ENC_DEC else arch in (*CAUSAL, "phi3")
        x, ctx = _call_tokens(args, kwargs)
        got = output[0] if isinstance(output, tuple) else output
        if arch.startswith(("llama", "mistral", "qwen", "phi3")):
            got = _rope_call(model, module, x)
        got, x = got.double().numpy(), x.double().numpy()
        if arch in ("qwen3", "vit-qknorm"):
            want = _normed_reference(arch, model, module, x)
            # Qwen3's RMSNorm computes in float32 whatever the model's dtype.
            tol = 1e-6 if arch == "qwen3" else 1e-12
        else:
            p, cfg = layer_params(arch, module)
            if arch == "llama" and module.scaling != cfg.softmax_scale:
                cfg = dataclasses.replace(cfg, scale=float(module.scaling))  # Granite's attention_multiplier
            is_cross = not module.damcha.layout.self_attention
            rotary = _rotary(model) if arch.startswith(("llama", "mistral", "qwen", "phi3")) else None
            want = dc.damcha_attention(
                p, cfg, x, None if not is_cross else ctx.double().numpy(), causal=causal and not is_cross, rotary=rotary
            )
            # transformers' eager attention (Gemma 2's only one) takes its softmax in float32,
            # Cohere's rotation computes in float32 whatever the model's dtype.
            host = getattr(model, "config", None)
            float32 = (
                getattr(host, "_attn_implementation", None) == "eager" or getattr(host, "model_type", "") == "cohere"
            )
            tol = 1e-6 if float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)


# A rotation the reference could get wrong, for a model of each rotary layout: by one position
# (Llama), over the whole head where the host rotates a part of it (Phi, StableLM), in halves
# where the host rotates interleaved pairs (GPT-J, Cohere, Helium).
WRONG_ROTATIONS = [
    ("llama", "positions"),
    ("phi", "width"),
    ("stablelm", "width"),
    ("gptj", "pairs"),
    ("cohere", "pairs"),
    ("helium", "pairs"),
]


@pytest.mark.parametrize("name,wrong", WRONG_ROTATIONS)
def test_rotary_reference_detects_a_wrong_position(name, wrong):
    """The comparisons with the reference above can fail: a layer (gates open,
    float64 angles) equals the reference rotating as the host does, and not
    the reference rotating otherwise."""
    model = converted("llama") if name == "llama" else dt.convert(_rotary_variant(name, torch.float64))
    module = next(iter(dt.converted_layers(open_gates(model)).values()))
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = _rope_call(model, module, x).numpy()
    p, cfg = layer_params("llama", module)
    right = _rotary(model)
    tol = 1e-6 if name == "cohere" else 1e-12  # Cohere rotates in float32
    want = dc.damcha_attention(p, cfg, x.numpy(), causal=True, rotary=right)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    if wrong == "positions":
        bad = dataclasses.replace(right, query_positions=np.arange(7) + 1.0)
    elif wrong == "width":  # partial_rotary_factor ignored: every feature rotates
        bad = dc.Rotary.from_base(cfg.key_dim, model.config.rope_parameters["rope_theta"])
    else:
        bad = dataclasses.replace(right, interleaved=not right.interleaved)
    assert (
        np.abs(got - dc.damcha_attention(p, cfg, x.numpy(), causal=True, rotary=bad)).max() > 1e-3 * np.abs(want).max()
    )


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_rope_shift_invariance(metric):
    """Maps before RoPE keep RoPE's relative-position property for both metrics:
    the same tokens at positions shifted by 37 give the same output (float64
    angles; the host's rotary module computes them in float32)."""
    model = open_gates(converted("llama", metric=metric, metric_rank=3 if metric == "lowrank" else None))
    layer = model.model.layers[0].self_attn
    x = torch.randn(2, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    emb = model.model.rotary_emb

    def call(shift):
        angles = (torch.arange(6, dtype=torch.float64)[:, None] + shift) * emb.inv_freq.double()[None]
        angles = torch.cat([angles, angles], dim=-1)[None]
        with torch.no_grad():
            return layer(hidden_states=x, position_embeddings=(angles.cos(), angles.sin()), attention_mask=None)[0]

    a, b = call(0), call(37)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    # The maps are on: the same call with the gates at 0 gives something else.
    with torch.no_grad():
        for p in dt.damcha_parameters(layer, generators=False):
            p.zero_()
    assert (call(0) - a).abs().max() > 1e-4


def test_metric_penalty_equals_reference():
    model = open_gates(converted("llama-mha"))
    dt.track_metric_penalty(model)
    calls = capture(model)
    with torch.no_grad():
        total = dt.metric_penalty(model)
        assert total.item() == 0.0  # nothing recorded yet
        run(model, "llama-mha", inputs("llama-mha", torch.float64, padding=False))
    want = []
    for name, ((_args, kwargs, _),) in calls.items():
        p, cfg = layer_params("llama-mha", dt.converted_layers(model)[name])
        want.append(dc.metric_penalty(p, cfg, kwargs["hidden_states"].double().numpy()))
    np.testing.assert_allclose(dt.metric_penalty(model).item(), np.mean(want), rtol=1e-12)


# -------------------------------------------------------------- generation


# BERT's decoder with cross-attention needs an EncoderDecoderCache (generate
# builds a plain DynamicCache for it and fails, converted or not), and has no
# static variant.
GEN_CASES = [(a, c) for a in ("llama", "llama-mqa", "qwen3", "gpt2", "opt") for c in ("dynamic", "static")]
GEN_CASES.append(("bert-decoder", "encoder-decoder"))
# BART and Whisper: generate builds their EncoderDecoderCache (dynamic or static
# self-attention cache) and reuses the cross-attention keys computed at step 1.
GEN_CASES += [("bart", "dynamic"), ("bart", "static"), ("whisper", "dynamic"), ("whisper", "static")]
GEN_CASES.append(("t5", "static"))  # dynamic: test_t5_family_converts


@pytest.mark.parametrize("arch,cache", GEN_CASES)
def test_generate_with_cache_equals_without(arch, cache):
    """At gates 0 the converted model's cached generation is the unconverted
    one's (tokens and logits, bit for bit); with the gates open its cached
    generation equals its uncached one (encoder-decoders: the logits too, as
    the tiny models' greedy tokens hardly move with the gates)."""
    model = build(arch, torch.float32)
    kw = inputs(arch, padding=False, length=5)
    kw.pop("attention_mask", None)
    prompt = kw.get("decoder_input_ids", kw.get("input_ids"))
    opts = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    if arch == "bert-decoder":
        opts["bos_token_id"] = 1

    def extra():  # a fresh cache per call
        if cache == "encoder-decoder":
            from transformers.cache_utils import DynamicCache, EncoderDecoderCache

            return {"cache": EncoderDecoderCache(DynamicCache(), DynamicCache())}
        return {"cache_implementation": "static"} if cache == "static" else {}

    logits = {"return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        unconverted = model.generate(**kw, use_cache=True, **extra(), **opts, **logits)
        closed = dt.convert(model).generate(**kw, use_cache=True, **extra(), **opts, **logits)
        open_gates(model, scale=0.8)
        cached = model.generate(**kw, use_cache=True, **extra(), **opts, **logits)
        plain = model.generate(**kw, use_cache=False, **opts, **logits)
        # The converted model's greedy tokens also differ from the plain model's:
        # the cache really stores mapped keys, not a copy of the original ones.
    assert torch.equal(closed.sequences, unconverted.sequences)
    assert all(torch.equal(a, b) for a, b in zip(closed.logits, unconverted.logits, strict=True))
    assert cached.sequences.shape[1] == prompt.shape[1] + 6
    assert torch.equal(cached.sequences, plain.sequences)
    if arch in ENC_DEC or arch in T5_MODELS:  # cached cross-attention keys carry the map once, as recomputed ones do
        for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize(
    "arch,cache,beams",
    [
        ("llama", "dynamic", 1),
        ("llama", "static", 1),
        ("gpt2", "dynamic", 1),
        ("qwen3", "static", 1),
        ("llama", "dynamic", 3),
        ("opt", "dynamic", 1),
    ],
    ids=["llama-dynamic", "llama-static", "gpt2-dynamic", "qwen3-static", "llama-beam3", "opt-dynamic"],
)
def test_left_padded_batched_generate_with_cache_equals_without(arch, cache, beams):
    """Batched generation as users run it: row 0 left-padded with its attention_mask
    (greedy, or beam search, whose cache is reordered between steps); the cached
    steps of the mapped keys give the tokens of uncached generation, and the
    padded row gives what it gives alone."""
    model = open_gates(converted(arch, torch.float64), scale=0.8)
    kw = inputs(arch, padding=True, length=6)
    opts = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "num_beams": beams}
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        cached = model.generate(**kw, use_cache=True, **extra, **opts)
        plain = model.generate(**kw, use_cache=False, **opts)
        alone = model.generate(input_ids=kw["input_ids"][:1, 2:], use_cache=True, **extra, **opts)
    assert torch.equal(cached, plain)
    assert torch.equal(cached[0, 2:], alone[0])


def test_cache_stores_mapped_keys():
    model = open_gates(converted("llama", torch.float64))
    ids = inputs("llama", padding=False)["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    layer = model.model.layers[0].self_attn
    calls = []
    h = layer.k_proj.register_forward_hook(lambda m, a, o: calls.append((a[0], o)))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    x, k_mapped = calls[0]
    k_plain = nn.functional.linear(x, layer.k_proj.weight)
    cached = out.past_key_values.layers[0].keys  # rotated k~
    assert not torch.allclose(k_mapped, k_plain)
    # Undo RoPE on the cache: it holds the mapped keys.
    cos, sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
    B, T = x.shape[:2]
    k = k_mapped.view(B, T, -1, layer.head_dim).transpose(1, 2)
    rot = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)[0]
    torch.testing.assert_close(cached, rot, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ENC_DEC)
def test_cross_attention_cache_holds_keys_mapped_once(arch):
    """The decoder's cross-attention computes its keys from the encoder output
    once (k_proj, with its map) and the EncoderDecoderCache keeps them: the
    cached keys are the mapped ones, later steps call no cross-attention
    k_proj, and a cached step gives the uncached forward's logits."""
    model = open_gates(converted(arch, torch.float64))
    kw = inputs(arch, torch.float64, padding=False)
    ids = kw.pop("decoder_input_ids")
    mask = {k: v for k, v in kw.items() if k == "attention_mask"}
    cross = [layer.encoder_attn for layer in model.model.decoder.layers]
    with torch.no_grad():
        full = model(**kw, decoder_input_ids=ids).logits
        first = model(**kw, decoder_input_ids=ids[:, :-1], use_cache=True)
        enc, cache = first.encoder_last_hidden_state, first.past_key_values
        calls = []
        hooks = [m.k_proj.register_forward_hook(lambda m, a, o: calls.append(m)) for m in cross]
        step = model(**mask, encoder_outputs=(enc,), decoder_input_ids=ids[:, -1:], cache=cache)
        for h in hooks:
            h.remove()
        assert calls == []  # the cached keys are reused, not projected (and mapped) again
        for i, layer in enumerate(cross):
            B, M = enc.shape[:2]
            mapped = layer.k_proj(enc).view(B, M, layer.num_heads, layer.head_dim).transpose(1, 2)
            plain = nn.functional.linear(enc, layer.k_proj.weight, layer.k_proj.bias)
            cached = cache.cross_attention_cache.layers[i].keys
            assert torch.equal(cached, mapped)
            assert not torch.allclose(cached, plain.view(B, M, -1, layer.head_dim).transpose(1, 2))
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=0, atol=1e-12)


# The encoder-decoders whose attention transformers copied from BART's ("Copied
# from BartAttention", the same source line for line) and the transformers-bart
# adapter lists: one compact test each, not in the zoo's ARCHS (every test over
# ARCHS would run them). Built with the zoo's "bart" sizes; checked with its
# layout ("bart" for inputs, run and layer_params).
BART_COPIES = {  # the attention class each layer of the zoo's model holds (_models_zoo.BART_COPY_MODELS)
    "marian": "MarianAttention",
    "pegasus": "PegasusAttention",
    "m2m100": "M2M100Attention",
    "plbart": "PLBartAttention",
    "blenderbot": "BlenderbotAttention",
    "blenderbot-small": "BlenderbotSmallAttention",
    "seamless-m4t": "SeamlessM4TAttention",  # its decoder layers' cross_attention, named so
}


@pytest.mark.parametrize("name", list(BART_COPIES))
def test_bart_copies_convert(name):
    """Every attention layer converted (encoder self-attention and decoder
    self-attention tied, decoder cross-attention separate), exact at init bit
    for bit, each layer equal to the reference with the gates open, and cached
    greedy generation equal to uncached generation with the gates open."""
    model = build(name, torch.float32)
    # The copy itself (its own class, no subclass of BartAttention), in every layer.
    attention = {n: m for n, m in model.named_modules() if type(m).__name__ == BART_COPIES[name]}
    assert all(c.__name__ != "BartAttention" for m in attention.values() for c in type(m).__mro__)
    kw = inputs("bart")
    gen = inputs("bart", padding=False, length=5)
    gen.pop("attention_mask")
    opts = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    opts["output_logits"] = True
    with torch.no_grad():
        before = run(model, "bart", kw)
        unconverted = model.generate(**gen, use_cache=True, **opts)
        dt.convert(model)
        after = run(model, "bart", kw)
    layers = dt.converted_layers(model)
    assert len(attention) == 6 and set(layers) == set(attention)  # 2 encoder, 2 + 2 decoder
    for n, m in layers.items():
        cross = n.endswith(("encoder_attn", "cross_attention"))
        assert set(m.damcha.config.metric_sides) == ({"q", "k"} if cross else {"qk"}), n
    assert same(after, before)
    open_gates(model, scale=0.8)
    with torch.no_grad():
        cached = model.generate(**gen, use_cache=True, **opts)
        plain = model.generate(**gen, use_cache=False, **opts)
    assert cached.sequences.shape[1] == gen["decoder_input_ids"].shape[1] + 6
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert (a - c).abs().max() > 1e-3
    _check_layers_against_reference("bart", model=dt.convert(build(name, torch.float64)))


def _converts_audio_lm_exactly(model, kw):
    """convert() of an audio-language model (two audio encoder and two decoder
    layers): every attention layer converted, the audio tower's with tied maps,
    the language model's separate (GQA), and the logits on ``kw`` unchanged bit
    for bit."""
    with torch.no_grad():
        before = model(**kw).logits
        dt.convert(model)
        after = model(**kw).logits
    layers = dt.converted_layers(model)
    assert sorted(layers) == sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    sides = {n: m.damcha.config.metric_sides for n, m in layers.items()}
    assert len(sides) == 4 and sides == {n: ("qk",) if ".audio_tower." in n else ("q", "k") for n in sides}
    assert same(after, before)


def test_voxtral_realtime_converts():
    """Voxtral-Realtime (a causal audio encoder and a text decoder, both Llama's attention with a
    sliding window wider than these tokens; the audio embeddings added to the text tokens', one
    per token): the encoder's layers converted with tied maps (MHA), the decoder's with separate
    ones (GQA), exact at init bit for bit on a left-padded batch, and each layer (gates open)
    equal to an independent NumPy forward with the host's rotation angles, causal."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8)
    text.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    audio = dict(text, num_key_value_heads=4, num_mel_bins=WHISPER_MELS, sliding_window=32)
    del audio["vocab_size"], audio["pad_token_id"]
    torch.manual_seed(0)
    config = transformers.VoxtralRealtimeConfig(text_config=text, audio_config=audio, default_num_delay_tokens=2)
    model = transformers.VoxtralRealtimeForConditionalGeneration(config).to(torch.float64).eval()
    kw = inputs("llama", torch.float64)  # 7 tokens: 7 audio embeddings of 8 frames each (conv stride 2, 4 per token)
    kw["input_features"] = torch.randn(
        2, WHISPER_MELS, 56, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    _converts_audio_lm_exactly(model, kw)
    kw["attention_mask"][0] = 1
    _check_normed_layers(open_gates(model), _no_norms, call=lambda m: m(**kw))


# Audio-language models whose audio encoder is Whisper's (transformers-bart: encoder self-attention only)
# and whose language model is a supported decoder: name -> (model, config, audio config beyond the zoo's
# Whisper sizes, text model type, audio tokens per clip of 16 frames, the name of its frame mask).
AUDIO_ENCODER_COPIES = {
    "qwen2-audio": ("Qwen2AudioForConditionalGeneration", "Qwen2AudioConfig", {}, "qwen2", 4, "feature_attention_mask"),
    "audioflamingo3": (
        "AudioFlamingo3ForConditionalGeneration",
        "AudioFlamingo3Config",
        {},
        "qwen2",
        4,
        "input_features_mask",
    ),
    # Its projector reads the encoder output in runs of 4 frames (4 * d_model = encoder_ffn_dim).
    "voxtral": ("VoxtralForConditionalGeneration", "VoxtralConfig", dict(encoder_ffn_dim=128), "llama", 2, None),
}


@pytest.mark.parametrize("name", list(AUDIO_ENCODER_COPIES))
def test_audio_encoder_copies_convert(name):
    """Every attention layer converted (the audio encoder's self-attention tied, the
    language model's separate: GQA), exact at init bit for bit on a batch of two clips
    and prompts (row 0's first token padding), and each audio encoder layer equal to
    the reference (not causal) with the gates open."""
    model, config, audio, text, tokens, frames_mask = AUDIO_ENCODER_COPIES[name]
    whisper = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, init_std=0.2)
    whisper.update(num_mel_bins=WHISPER_MELS, max_source_positions=WHISPER_SOURCE, **audio)
    text_config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8)
    text_config.update(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, model_type=text)
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(text_config=text_config, audio_config=whisper, audio_token_id=60)
    model = getattr(transformers, model)(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    kw = {"input_ids": torch.randint(1, 57, (2, 9), generator=g), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    kw["input_ids"][:, 2 : 2 + tokens] = 60
    kw["input_features"] = torch.randn(2, WHISPER_MELS, 2 * WHISPER_SOURCE, generator=g, dtype=torch.float64)
    if frames_mask is not None:
        kw[frames_mask] = torch.ones(2, 2 * WHISPER_SOURCE, dtype=torch.long)
    padded = dict(kw, attention_mask=kw["attention_mask"].clone())
    padded["attention_mask"][0, 0] = 0
    _converts_audio_lm_exactly(model, padded)
    _check_layers_against_reference("bart", model=model.model.audio_tower, call=lambda m: model(**kw))


def _check_converted_lm(model, names, sides):
    """convert() of a float32 causal LM: the layers ``names`` (sorted) converted,
    each with the metric ``sides``; exact at init bit for bit (left-padded
    batch); with the gates open, cached greedy generation equal to uncached
    and away from the unconverted model's."""
    kw = inputs("llama")
    prompt = {"input_ids": kw["input_ids"][1:]}
    opts = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    opts["output_logits"] = True
    with torch.no_grad():
        before = model(**kw).logits
        unconverted = model.generate(**prompt, use_cache=True, **opts)
        dt.convert(model)
        after = model(**kw).logits
    layers = dt.converted_layers(model)
    assert sorted(layers) == names
    assert all(m.damcha.config.metric_sides == sides for m in layers.values())
    assert same(after, before)
    open_gates(model, scale=0.8)
    with torch.no_grad():
        cached = model.generate(**prompt, use_cache=True, **opts)
        plain = model.generate(**prompt, use_cache=False, **opts)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert (a - c).abs().max() > 1e-3


# transformers' copies of Llama's (or Mistral's) attention that the transformers-llama
# adapter lists: one compact test each, not in the zoo's ARCHS. Sizes as the zoo's "llama".
LLAMA_COPIES = {
    # The experts' eager loop: the default grouped product has no float64 kernel on CPU.
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager"),
    ),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=8)),
    # Gemma 2: scale query_pre_attn_scalar**-0.5; its logit soft-capping (the host's, after the
    # maps) off, which the reference does not compute; its sliding window wider than the tokens.
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(head_dim=8, query_pre_attn_scalar=16, attn_logit_softcapping=None),
    ),
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            experts_implementation="eager",
        ),
    ),
    "ministral": ("MinistralForCausalLM", "MinistralConfig", dict(head_dim=8)),
    "phimoe": (
        "PhimoeForCausalLM",
        "PhimoeConfig",
        dict(num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager"),
    ),
    "arcee": ("ArceeForCausalLM", "ArceeConfig", {}),
    "jais2": ("Jais2ForCausalLM", "Jais2Config", {}),
    # Phi-3 (and Phi-4, the same class): q, k and v from one fused qkv_proj.
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(residual_dropout=0.0)),
    # Granite's softmax scale is its attention_multiplier (the reference takes it as the scale).
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(attention_multiplier=0.2)),
    "granitemoe": (
        "GraniteMoeForCausalLM",
        "GraniteMoeConfig",
        dict(attention_multiplier=0.2, num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager"),
    ),
}


def _tiny_lm(model, config, dtype, **extra):
    """A tiny random-weight transformers causal LM ``model`` of ``config``, the
    zoo's decoder sizes (``_dec``) and ``extra``; logits far from 0 (the maps
    move the greedy tokens)."""
    torch.manual_seed(0)
    cfg = _dec(getattr(transformers, config), initializer_range=0.2, pad_token_id=0, **extra)
    return getattr(transformers, model)(cfg).to(dtype).eval()


def _llama_copy(name, dtype):
    model, config, extra = LLAMA_COPIES[name]
    return _tiny_lm(model, config, dtype, **extra)


@pytest.mark.parametrize("name", list(LLAMA_COPIES))
def test_llama_copies_convert(name):
    """Every attention layer converted (GQA: separate maps), exact at init bit
    for bit (left-padded batch), each layer equal to the reference with RoPE
    and the gates open, and cached greedy generation equal to uncached,
    away from the unconverted model's."""
    model = _llama_copy(name, torch.float32)
    _check_converted_lm(model, [f"model.layers.{i}.self_attn" for i in range(2)], ("q", "k"))
    ids = inputs("llama", torch.float64, padding=False)["input_ids"]
    model = dt.convert(_llama_copy(name, torch.float64))
    arch = "phi3" if name == "phi3" else "llama"  # the zoo's parameter layout of its projections
    _check_layers_against_reference(arch, model=model, call=lambda m: m(input_ids=ids))


def _gemma3(dtype):
    """A tiny random-weight ``Gemma3ForCausalLM`` (text): a sliding-window and a global layer."""
    return _tiny_lm(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dtype,
        head_dim=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        attn_implementation="sdpa",
    )


def test_gemma3_converts():
    """Gemma 3 (Llama's layout with per-head q/k RMS norms, Gemma's scale and
    a sliding-window layer beside a global one, each with its own RoPE): both
    layers converted with separate maps (GQA), exact at init bit for bit,
    cached greedy generation equal to uncached and away from the unconverted
    model's, and each layer equal to an independent NumPy forward with the
    gates open: the reference's maps, then Gemma's norm y / rms(y) * (1 + w)
    (random w, as for every norm below), the host's own rotation angles, a causal softmax attention inside the
    window, the output projection."""
    model = _gemma3(torch.float32)
    _check_converted_lm(model, [f"model.layers.{i}.self_attn" for i in range(2)], ("q", "k"))

    model = open_gates(dt.convert(_gemma3(torch.float64)))
    _randomise_qk_norms(model)

    def norms(q, k, module):  # Gemma's RMS norm of each head, y / rms(y) * (1 + w)
        def norm(y, mod):
            w = mod.weight.detach().double().numpy()
            return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + mod.eps) * (1 + w)

        return norm(q, module.q_norm), norm(k, module.k_norm)

    _check_normed_layers(model, norms)
    assert {m.sliding_window for m in dt.converted_layers(model).values()} == {4, None}


def _randomise_qk_norms(model, seed=2):
    """Random weights (and biases) for the q/k norms of every converted layer: they start
    equal in every head and feature (ones, zero biases; Gemma's zeros, used as 1 + w), where a
    check against a NumPy forward could not tell one head's or feature's weight from another's,
    nor the q norm's from the k norm's, nor a weight from none."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in dt.converted_layers(model).values():
            for attr in ("q_layernorm", "k_layernorm", "q_norm", "k_norm", "query_layernorm", "key_layernorm"):
                for p in getattr(layer, attr).parameters() if hasattr(layer, attr) else ():
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _check_normed_layers(model, norms, *, clip=None, rotated=None, rotate_first=False, call=None, causal=True):
    """Each converted layer of a float64 causal LM (gates open) against an
    independent NumPy forward: project, the reference's maps, q, k and v
    clamped to +-``clip`` if given (OLMo's clip_qkv), ``norms(q, k, module)``
    (the host's q/k norm, written out), the host's own rotation angles
    (pairs and width as ``ROPE_LAYOUTS`` says; only in the layers where
    ``rotated(module)``, default all; before the norms if ``rotate_first``, as
    HunYuan's), a causal softmax attention (inside
    ``module.sliding_window`` where the layer has one) at the host's scale,
    the host's output gate if it has one (``_output_gate``) or BitNet's norm
    of the attention output, the output projection; to 1e-6 (the hosts' norms compute in float32 whatever the
    model's dtype). Not causal where ``causal`` is False (an encoder's). ``call(model)`` runs the model (default: 7 tokens, no
    padding); layers without a ``q_proj`` (Qwen-VL's vision towers) are
    checked by ``_check_qwen_vision_call``."""
    calls = capture(model)
    ids = inputs("llama", torch.float64, padding=False, length=7)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids) if call is None else call(model)
    assert set(calls) == set(dt.converted_layers(model))
    for name in [n for n in calls if not hasattr(dt.converted_layers(model)[n], "q_proj")]:
        ((args, kwargs, output),) = calls.pop(name)
        _check_qwen_vision_call(dt.converted_layers(model)[name], args, kwargs, output, name=name)
    layout, interleaved = _rope_layout(model)

    def angles(position_embeddings):  # cos and sin of each token's R angles, (B, N, 1, R)
        if layout == "gptj":
            sin, cos = position_embeddings
        else:
            cos, sin = position_embeddings
            R = cos.shape[-1] // 2
            cos, sin = (cos[..., ::2], sin[..., ::2]) if layout == "repeat" else (cos[..., :R], sin[..., :R])
        sign = -1 if model.config.model_type in ROPE_REVERSED else 1
        return cos.double().numpy()[:, :, None], sign * sin.double().numpy()[:, :, None]

    def rotate(y, cos, sin):  # the first 2R features of each head, in interleaved pairs or in halves
        R = cos.shape[-1]
        if interleaved:
            a, b = y[..., 0 : 2 * R : 2], y[..., 1 : 2 * R : 2]
            turned = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(*y.shape[:-1], 2 * R)
        else:
            a, b = y[..., :R], y[..., R : 2 * R]
            turned = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
        return np.concatenate([turned, y[..., 2 * R :]], -1)

    for name, (((args, kwargs, output),)) in calls.items():
        module = dt.converted_layers(model)[name]
        x = _call_tokens(args, kwargs)[0].double().numpy()
        p, cfg = layer_params("llama", module)  # a gated q_proj's query columns (the zoo reads them)
        _, metric = dc.damcha_attention(p, cfg, x, return_metric=True)
        q, k, v = (np.einsum("bte,ehd->bthd", x, p[f"{r}.kernel"]) + p[f"{r}.bias"] for r in ("query", "key", "value"))
        q, k = np.einsum("btha,btad->bthd", metric["q"], q), np.einsum("btha,btad->bthd", metric["k"], k)
        if clip is not None:
            q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
        if not rotate_first:
            q, k = norms(q, k, module)
        if rotated is None or rotated(module):
            cos, sin = angles(kwargs["position_embeddings"])
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if rotate_first:
            q, k = norms(q, k, module)
        group = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
        logits = module.scaling * np.einsum("bnhd,bmhd->bhnm", q, k)
        n = logits.shape[-1]
        keep = np.arange(n)[None] <= np.arange(n)[:, None] if causal else np.ones((n, n), dtype=bool)
        window = getattr(module, "sliding_window", None)
        if window is not None:  # a sliding layer: the last `window` keys only
            keep &= np.arange(n)[:, None] - np.arange(n)[None] < window
        logits = np.where(keep, logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        o = np.einsum("bhnm,bmhd->bnhd", probs / probs.sum(-1, keepdims=True), v)
        o = o * _output_gate(module, x, o.shape)
        if hasattr(module, "attn_sub_norm"):  # BitNet's RMS norm of the attention output, all heads together
            flat, norm = o.reshape(*o.shape[:2], -1), module.attn_sub_norm
            flat = flat / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + norm.variance_epsilon) * _np(norm.weight)
            o = flat.reshape(o.shape)
        want = np.einsum("bnhd,hde->bne", o, p["output.kernel"]) + p["output.bias"]
        got = output[0].double().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=name)


def _check_qwen_vision_call(module, args, kwargs, output, *, name):
    """A Qwen-VL vision attention call (gates open) against an independent NumPy
    forward: the fused qkv's q, k and v blocks (H query heads, G key and G value
    heads: EXAONE 4.5's GQA), or Qwen2.5-Omni's q, k and v Linear layers, the
    reference's maps, the host's per-head q/k RMS norms where it has them
    (GLM-OCR's), the host's 2D rotation angles (halves of the whole head), a
    softmax attention inside each image (or window) that ``cu_seqlens``
    delimits, the output projection; to 1e-6 (the host rotates in float32)."""
    x = _call_tokens(args, kwargs)[0].double().numpy()[None]  # (1, N, E): the patches of every image in a row
    p, cfg = layer_params("vl-vision", module)  # q, k and v blocks of qkv (or q, k, v), proj
    _, metric = dc.damcha_attention(p, cfg, x, return_metric=True)
    q, k, v = (np.einsum("bte,ehd->bthd", x, p[f"{r}.kernel"]) + p[f"{r}.bias"] for r in ("query", "key", "value"))
    q, k = np.einsum("btha,btad->bthd", metric["q"], q), np.einsum("btha,btad->bthd", metric["k"], k)
    if hasattr(module, "q_norm"):
        q, k = _rms_norms(q, k, module)
    cos, sin = (t.double().numpy()[None, :, None] for t in kwargs["position_embeddings"])
    R = cos.shape[-1] // 2
    cos, sin = cos[..., :R], sin[..., :R]
    assert q.shape[-1] == 2 * R

    def rotate(y):
        a, b = y[..., :R], y[..., R:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    q, k = rotate(q), rotate(k)
    k, v = (np.repeat(t, q.shape[2] // k.shape[2], axis=2) for t in (k, v))
    logits = module.scaling * np.einsum("bnhd,bmhd->bhnm", q, k)
    bounds = kwargs["cu_seqlens"].tolist()
    segment = np.zeros(x.shape[1], dtype=int)
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        segment[start:stop] = i
    assert len(bounds) > 2  # more than one image (or window): the attention is block-diagonal
    logits = np.where(segment[:, None] == segment[None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    o = np.einsum("bhnm,bmhd->bnhd", probs / probs.sum(-1, keepdims=True), v)
    want = (np.einsum("bnhd,hde->bne", o, p["output.kernel"]) + p["output.bias"])[0]
    got = (output[0] if isinstance(output, tuple) else output).double().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=name)


def _output_gate(module, x, shape):
    """The host's gate on the attention output o (B, N, H, d) of tokens x, written
    out (1 where it has none): Qwen3-Next's sigmoid of the gate features of
    its q_proj (per head, after its query's d features), LFM3's sigmoid of
    g_proj (one per head), Laguna's softplus of g_proj (per head or per
    feature)."""
    B, N, H, d = shape
    if module.q_proj.out_features == 2 * H * d:
        w, b = _np(module.q_proj.weight).reshape(H, 2, d, -1)[:, 1], module.q_proj.bias
        gate = np.einsum("bte,hde->bthd", x, w) + (0 if b is None else _np(b).reshape(H, 2, d)[:, 1])
        return 1 / (1 + np.exp(-gate))
    g_proj = getattr(module, "g_proj", None)
    if g_proj is None:
        return np.ones(1)
    gate = (x @ _np(g_proj.weight).T).reshape(B, N, H, -1)
    if type(module).__name__ == "LagunaAttention":
        return np.logaddexp(0, gate)  # softplus
    return 1 / (1 + np.exp(-gate))


def test_olmo2_converts():
    """OLMo 2 (Llama's layout with an RMS norm over all the query heads' and all
    the key heads' features, after the maps, before RoPE): both layers
    converted with separate maps (GQA), exact at init, cached greedy
    generation equal to uncached and away from the unconverted model's, and
    each layer against an independent NumPy forward (random norm weights)."""
    model = _tiny_lm("Olmo2ForCausalLM", "Olmo2Config", torch.float32)
    _check_converted_lm(model, [f"model.layers.{i}.self_attn" for i in range(2)], ("q", "k"))
    model = open_gates(dt.convert(_tiny_lm("Olmo2ForCausalLM", "Olmo2Config", torch.float64)))
    _randomise_qk_norms(model)

    def norms(q, k, module):  # one RMS norm over the features of all the heads
        def norm(y, mod):
            flat = y.reshape(*y.shape[:2], -1)
            w = mod.weight.detach().double().numpy()
            return (flat / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + mod.variance_epsilon) * w).reshape(y.shape)

        return norm(q, module.q_norm), norm(k, module.k_norm)

    _check_normed_layers(model, norms)


def _layer_norm(y, mod):
    """torch's LayerNorm ``mod`` over the last axis of y (its weight broadcast over the heads)."""
    centred = y - y.mean(-1, keepdims=True)
    out = centred / np.sqrt(np.mean(centred * centred, -1, keepdims=True) + mod.eps) * _np(mod.weight)
    return out if mod.bias is None else out + _np(mod.bias)


def _phi_norms(q, k, module):  # one LayerNorm for every head
    return _layer_norm(q, module.q_layernorm), _layer_norm(k, module.k_layernorm)


def _stablelm_norms(q, k, module):  # a LayerNorm of its own for each head
    def norm(y, per_head):
        return np.stack([_layer_norm(y[:, :, h], mod) for h, mod in enumerate(per_head.norms)], 2)

    return norm(q, module.q_layernorm), norm(k, module.k_layernorm)


def _cohere_norms(q, k, module):  # a mean-centred norm with a weight per head and feature, no bias
    def norm(y, mod):
        centred = y - y.mean(-1, keepdims=True)
        scale = np.sqrt(np.mean(centred * centred, -1, keepdims=True) + mod.variance_epsilon)
        return centred / scale * _np(mod.weight)

    return norm(q, module.q_norm), norm(k, module.k_norm)


def _no_norms(q, k, module):
    return q, k


# Llama's q_proj/k_proj layout under other rotations and steps before attention (the
# transformers-rotary adapter), sizes as the zoo's "llama" (4 query and 2 key heads; GPT-J has no
# GQA): name -> (model, config, extra config, q/k norms). Without norms each layer is checked
# against the reference with the host's rotation (ROPE_LAYOUTS); with them (also OLMo's clamp,
# Cohere 2's global layer without positions and its sliding window) against _check_normed_layers.
ROTARY_VARIANTS = {
    "phi": ("PhiForCausalLM", "PhiConfig", dict(partial_rotary_factor=0.5), None),
    "phi-qk-layernorm": (
        "PhiForCausalLM",
        "PhiConfig",
        dict(partial_rotary_factor=0.5, qk_layernorm=True),
        _phi_norms,
    ),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(partial_rotary_factor=0.25, use_qkv_bias=True), None),
    "stablelm-qk-layernorm": (
        "StableLmForCausalLM",
        "StableLmConfig",
        dict(partial_rotary_factor=0.25, qk_layernorm=True),
        _stablelm_norms,
    ),
    # rotary_dim: the first half of each head's 8 features rotates.
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(rotary_dim=4, num_key_value_heads=None), None),
    "cohere": ("CohereForCausalLM", "CohereConfig", {}, None),
    "cohere-qk-norm": ("CohereForCausalLM", "CohereConfig", dict(use_qk_norm=True), _cohere_norms),
    "cohere2": (
        "Cohere2ForCausalLM",
        "Cohere2Config",
        dict(head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
        _no_norms,
    ),
    "helium": ("HeliumForCausalLM", "HeliumConfig", dict(head_dim=8), None),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", {}, None),
    # About a third of q, k and v clamped at these sizes (bounds the mapped heads: _models_layouts.py says why).
    "olmo-clip-qkv": ("OlmoForCausalLM", "OlmoConfig", dict(clip_qkv=1.0), _no_norms),
}


def _rotary_variant(name, dtype):
    model, config, extra, _ = ROTARY_VARIANTS[name]
    return _tiny_lm(model, config, dtype, **extra)


@pytest.mark.parametrize("name", list(ROTARY_VARIANTS))
def test_rotary_variants_convert(name):
    """Every attention layer converted (GQA: separate maps; GPT-J: tied), exact
    at init bit for bit (left-padded batch), cached greedy generation equal to
    uncached and away from the unconverted model's, and each layer (gates
    open) equal to the reference with the host's rotation, or to an
    independent NumPy forward with its norms, clamp and window."""
    model = _rotary_variant(name, torch.float32)
    names = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    assert len(names) == 2
    _check_converted_lm(model, names, ("qk",) if name == "gptj" else ("q", "k"))
    model = dt.convert(_rotary_variant(name, torch.float64))
    norms = ROTARY_VARIANTS[name][3]
    if norms is None:
        ids = inputs("llama", torch.float64, padding=False)["input_ids"]
        _check_layers_against_reference("llama", model=model, call=lambda m: m(input_ids=ids))
        return
    _randomise_qk_norms(model)
    # Cohere 2 rotates in its sliding-window layers only: its global layers have no positions.
    rotated = (lambda module: module.sliding_window is not None) if name == "cohere2" else None
    _check_normed_layers(open_gates(model), norms, clip=getattr(model.config, "clip_qkv", None), rotated=rotated)
    if name == "cohere2":
        assert {m.sliding_window for m in dt.converted_layers(model).values()} == {4, None}


def _rms_norms(q, k, module):  # an RMS norm of each head (Qwen3's; HunYuan's and LFM2's under other names)
    def norm(y, mod):
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + eps) * _np(mod.weight)

    for q_norm, k_norm in (("query_layernorm", "key_layernorm"), ("q_layernorm", "k_layernorm"), ("q_norm", "k_norm")):
        if hasattr(module, q_norm):
            return norm(q, getattr(module, q_norm)), norm(k, getattr(module, k_norm))
    raise AssertionError(type(module).__name__)


def _rms_norms_no_weight(q, k, module):  # an RMS norm of each head without a weight (NanoChat's)
    def norm(y, mod):
        assert not list(mod.parameters())
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + mod.eps)

    return norm(q, module.q_norm), norm(k, module.k_norm)


def _rms_norms_one_plus(q, k, module):  # an RMS norm of each head, y / rms(y) * (1 + w) (Qwen3-Next's)
    def norm(y, mod):
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + mod.eps) * (1 + _np(mod.weight))

    return norm(q, module.q_norm), norm(k, module.k_norm)


def _rms_norms_all_heads(q, k, module):  # one RMS norm over the features of all the heads (OLMo 2's)
    def norm(y, mod):
        flat = y.reshape(*y.shape[:2], -1)
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        return (flat / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + eps) * _np(mod.weight)).reshape(y.shape)

    return norm(q, module.q_norm), norm(k, module.k_norm)


_GRANITE_MOE = dict(num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager")
_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, experts_implementation="eager")

# More copies of Llama's attention (_LLAMA_MORE and the GLM, ERNIE 4.5 and Nemotron entries of _ROTARY in
# _models_layouts.py), checked at one float64 forward each (generation is the listed classes'
# own, tested above): name -> (model, config, extra config, q/k norms, layers that rotate).
# Without norms against the reference with the host's rotation (ROPE_LAYOUTS), with them (or
# ERNIE's float32 rotation, or layers without positions) against _check_normed_layers.
MORE_LLAMA_COPIES = {
    "aria-text": (
        "AriaTextForCausalLM",
        "AriaTextConfig",
        dict(moe_num_experts=2, moe_topk=1, experts_implementation="eager"),
        None,
        None,
    ),
    "emu3": ("Emu3ForCausalLM", "Emu3TextConfig", {}, None, None),
    "solar-open": (
        "SolarOpenForCausalLM",
        "SolarOpenConfig",
        dict(
            head_dim=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            experts_implementation="eager",
        ),
        None,
        None,
    ),
    "cwm": ("CwmForCausalLM", "CwmConfig", {}, None, None),
    "seed-oss": ("SeedOssForCausalLM", "SeedOssConfig", dict(head_dim=8, attention_bias=True), None, None),
    "granitemoeshared": (
        "GraniteMoeSharedForCausalLM",
        "GraniteMoeSharedConfig",
        dict(attention_multiplier=0.2, num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager"),
        None,
        None,
    ),
    "hyperclovax": ("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", dict(attention_multiplier=0.2), None, None),
    "vaultgemma": (
        "VaultGemmaForCausalLM",
        "VaultGemmaConfig",
        dict(head_dim=8, query_pre_attn_scalar=16, attn_logit_softcapping=None),
        None,
        None,
    ),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=8, **_MOE), _rms_norms, None),
    "mellum": ("MellumForCausalLM", "MellumConfig", dict(head_dim=8, **_MOE), _rms_norms, None),
    "dots1": (
        "Dots1ForCausalLM",
        "Dots1Config",
        dict(head_dim=8, n_routed_experts=2, n_shared_experts=1, **_MOE),
        _rms_norms,
        None,
    ),
    "hunyuan-dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(head_dim=8), _rms_norms, None),
    "hunyuan-moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(head_dim=8, **_MOE), _rms_norms, None),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", {}, _rms_norms, None),
    # Rotates in its sliding-window layers only (window wider than the tokens).
    "exaone4": (
        "Exaone4ForCausalLM",
        "Exaone4Config",
        dict(head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
        _rms_norms,
        lambda module: module.is_sliding,
    ),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", {}, _rms_norms_all_heads, None),
    "flex-olmo": ("FlexOlmoForCausalLM", "FlexOlmoConfig", dict(**_MOE), _rms_norms_all_heads, None),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(**_MOE), _rms_norms_all_heads, None),
    # A NoPE layer beside a rotating one.
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layers=[1, 0]), _no_norms, lambda m: m.use_rope),
    "glm": ("GlmForCausalLM", "GlmConfig", dict(head_dim=8, partial_rotary_factor=0.5), None, None),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(head_dim=8, partial_rotary_factor=0.5), None, None),
    "glm4-moe": (
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        dict(head_dim=8, partial_rotary_factor=0.5, use_qk_norm=True, n_routed_experts=2, **_MOE),
        _rms_norms,
        None,
    ),
    "ernie4.5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(head_dim=8), _no_norms, None),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", dict(partial_rotary_factor=0.5), None, None),
    # Attention layers only (no Mamba): GraniteMoeHybrid's with RoPE, then without; Jamba's have none.
    "granitemoehybrid": (
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        dict(
            layer_types=["attention", "attention"],
            attention_multiplier=0.2,
            mamba_n_heads=4,
            position_embedding_type="rope",
            **_GRANITE_MOE,
        ),
        None,
        None,
    ),
    "granitemoehybrid-nope": (
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        dict(
            layer_types=["attention", "attention"],
            attention_multiplier=0.2,
            mamba_n_heads=4,
            position_embedding_type="nope",
            **_GRANITE_MOE,
        ),
        _no_norms,
        lambda m: False,
    ),
    "jamba": (
        "JambaForCausalLM",
        "JambaConfig",
        dict(attn_layer_period=1, attn_layer_offset=0, num_experts=1, use_mamba_kernels=False),
        _no_norms,
        lambda m: False,
    ),
    "ernie4.5-moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(head_dim=8, **_MOE), _no_norms, None),
    # The second survey (_LLAMA_SURVEY_2, Cohere 2 MoE in _ROTARY, _models_layouts_more.py). Hybrids keep a
    # layer of their other mixer (Mamba, short convolution, linear attention), which convert() leaves as it is.
    # RMS norms over all the query heads' and all the key heads' features, as OLMo 2's.
    "minimax-m2": (
        "MiniMaxM2ForCausalLM",
        "MiniMaxM2Config",
        dict(head_dim=8, num_local_experts=2, **_MOE),
        _rms_norms_all_heads,
        None,
    ),
    "minimax": (
        "MiniMaxForCausalLM",
        "MiniMaxConfig",
        dict(head_dim=8, layer_types=["full_attention"] * 2, num_local_experts=2, **_MOE),
        _no_norms,
        None,
    ),
    # Attention layers 0 and 2 (partial RoPE), a Mamba 2 mixer between.
    "bamba": (
        "BambaForCausalLM",
        "BambaConfig",
        dict(num_hidden_layers=3, attn_layer_indices=[0, 2], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
        _no_norms,
        None,
    ),
    "lfm2": (
        "Lfm2ForCausalLM",
        "Lfm2Config",
        dict(num_hidden_layers=3, layer_types=["full_attention", "conv", "full_attention"]),
        _rms_norms,
        None,
    ),
    "lfm2-moe": (
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        dict(layer_types=["full_attention"] * 2, num_dense_layers=1, **_MOE),
        _rms_norms,
        None,
    ),
    # A sigmoid gate per head on the attention output (g_proj), a sliding window.
    "lfm3": (
        "Lfm3ForCausalLM",
        "Lfm3Config",
        dict(head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
        _rms_norms,
        None,
    ),
    # Cohere 2's rotation in its sliding-window layer, and in the global layer of a dense MLP (force_rope).
    "cohere2-moe": (
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        dict(head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=4, **_MOE),
        _no_norms,
        lambda m: m.sliding_window is not None or m.force_rope,
    ),
    "cohere2-moe-dense": (
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        dict(
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            first_k_dense_replace=2,
            **_MOE,
        ),
        _no_norms,
        lambda m: m.sliding_window is not None or m.force_rope,
    ),
    # Gated queries (q_proj: per head its query, then its output gate), a linear-attention layer first.
    "qwen3-next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(
            head_dim=8,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            shared_expert_intermediate_size=16,
            **_MOE,
        ),
        _rms_norms_one_plus,
        None,
    ),
    "qwen3.5": (
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        dict(head_dim=8, layer_types=["full_attention"] * 2, attention_bias=True),
        _rms_norms_one_plus,
        None,
    ),
    # As many key heads as query heads: tied maps, one generator for the q_proj and k_proj sites.
    "qwen3.5-mha": (
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        dict(head_dim=8, num_key_value_heads=4, layer_types=["full_attention"] * 2),
        _rms_norms_one_plus,
        None,
    ),
    "qwen3.5-moe": (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        dict(head_dim=8, layer_types=["full_attention"] * 2, shared_expert_intermediate_size=16, **_MOE),
        _rms_norms_one_plus,
        None,
    ),
    # 4 query heads in its sliding-window layer, 8 in its global one (2 key heads); a softplus gate per head.
    "laguna": (
        "LagunaForCausalLM",
        "LagunaConfig",
        dict(
            head_dim=8,
            num_attention_heads_per_layer=[4, 8],
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            **_MOE,
        ),
        _rms_norms,
        None,
    ),
    "laguna-gate-per-feature": (
        "LagunaForCausalLM",
        "LagunaConfig",
        dict(head_dim=8, layer_types=["full_attention"] * 2, gating="per-element", **_MOE),
        _rms_norms,
        None,
    ),
    # Two hybrid layers (a Mamba 2 layer and a shared transformer block each), their blocks' weights tied; no RoPE.
    "zamba2": (
        "Zamba2ForCausalLM",
        "Zamba2Config",
        dict(layers_block_type=["hybrid"] * 2, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, chunk_size=8),
        _no_norms,
        lambda m: False,
    ),
    "zamba": (
        "ZambaForCausalLM",
        "ZambaConfig",
        dict(layers_block_type=["hybrid"] * 2, mamba_d_state=8, n_mamba_heads=2),
        _no_norms,
        lambda m: False,
    ),
    "zamba2-rope": (
        "Zamba2ForCausalLM",
        "Zamba2Config",
        dict(
            layers_block_type=["hybrid"] * 2,
            use_mem_rope=True,
            mamba_d_state=8,
            mamba_headdim=8,
            n_mamba_heads=8,
            chunk_size=8,
        ),
        _no_norms,
        None,
    ),
    # Attention layers (no positions) around a Mamba 2 layer.
    "nemotron-h": (
        "NemotronHForCausalLM",
        "NemotronHConfig",
        dict(
            num_hidden_layers=3,
            layers_block_type=["attention", "mamba", "attention"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=8,
        ),
        _no_norms,
        lambda m: False,
    ),
    "apertus1.5": ("Apertus1p5TextForCausalLM", "Apertus1p5TextConfig", {}, _rms_norms, None),
    "exaone-moe": (
        "ExaoneMoeForCausalLM",
        "ExaoneMoeConfig",
        dict(head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **_MOE),
        _rms_norms,
        lambda module: module.is_sliding,
    ),
    "hy-v3": ("HYV3ForCausalLM", "HYV3Config", dict(head_dim=8, **_MOE), _rms_norms, None),
    "kolibri1": (
        "Kolibri1ForCausalLM",
        "Kolibri1Config",
        dict(head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **_MOE),
        _rms_norms,
        lambda module: module.is_sliding,
    ),
    # Rotates in its sliding-window layers only (its global layers get no positions).
    "lara-mini": (
        "LaraMiniForCausalLM",
        "LaraMiniConfig",
        dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"], **_MOE),
        _rms_norms,
        lambda module: module.sliding_window is not None,
    ),
    # Rotates, then normalises each head (an RMS norm without a weight).
    "nanochat": ("NanoChatForCausalLM", "NanoChatConfig", {}, _rms_norms_no_weight, None),
    # An RMS norm of the attention output before o_proj.
    "bitnet": ("BitNetForCausalLM", "BitNetConfig", {}, _no_norms, None),
    # The third survey (_LLAMA_SURVEY_3, GLM-4V's and ERNIE-4.5-VL's text entries of _ROTARY): text models
    # (their last hidden states) where the model is multimodal. EuroBERT: an encoder (not causal).
    "eurobert": ("EuroBertForMaskedLM", "EuroBertConfig", {}, _no_norms, None),
    "cosmos3-edge-text": ("Cosmos3EdgeTextModel", "Cosmos3EdgeTextConfig", {}, _no_norms, None),
    "deepseek-ocr2-text": (
        "DeepseekOcr2TextModel",
        "DeepseekOcr2TextConfig",
        dict(mlp_layer_types=["dense"] * 2),
        _no_norms,
        None,
    ),
    # CSM's depth decoder (over one frame's codebooks; its backbone's layers are the same class).
    "csm-depth-decoder": (
        "CsmDepthDecoderForCausalLM",
        "CsmDepthDecoderConfig",
        dict(backbone_hidden_size=32, num_codebooks=8),
        _no_norms,
        None,
    ),
    "higgs-audio-v2": ("HiggsAudioV2ForConditionalGeneration", "HiggsAudioV2Config", {}, _no_norms, None),
    "granite4-vision-text": (
        "Granite4VisionTextModel",
        "Granite4VisionTextConfig",
        dict(attention_multiplier=0.2),
        _no_norms,
        None,
    ),
    "granite-docling-text": (
        "GraniteDoclingTextModel",
        "GraniteDoclingTextConfig",
        dict(attention_multiplier=0.2),
        _no_norms,
        None,
    ),
    "qwen3-omni-thinker-text": (
        "Qwen3OmniMoeThinkerTextModel",
        "Qwen3OmniMoeTextConfig",
        dict(head_dim=8, **_MOE),
        _rms_norms,
        None,
    ),
    # Text tokens: the three axes of its 3D RoPE (sections of 1, 1 and 2 angles) at the same positions.
    "ernie4.5-vl-text": (
        "Ernie4_5_VLMoeTextModel",
        "Ernie4_5_VLMoeTextConfig",
        dict(
            mlp_layer_types=["dense"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        ),
        _no_norms,
        None,
    ),
}
# Encoders among them: no causal mask.
BIDIRECTIONAL = frozenset({"eurobert"})


def _more_llama_copy(name):
    model, config, extra, _, _ = MORE_LLAMA_COPIES[name]
    return _tiny_lm(model, config, torch.float64, **extra)


@pytest.mark.parametrize("name", list(MORE_LLAMA_COPIES))
def test_more_llama_copies_convert(name):
    """Both attention layers converted (GQA: separate maps; MHA: tied), exact at
    init bit for bit (float64, left-padded batch; a text model's last hidden
    states), and each layer (gates open, random norm weights) equal to the
    reference with the host's rotation, or to an independent NumPy forward with
    its norms, windows, unrotated layers and output gates (Qwen3-Next's from its
    q_proj, LFM3's and Laguna's g_proj), not causal in an encoder's
    (``BIDIRECTIONAL``), hybrids' other mixers left as they are."""
    model = _more_llama_copy(name)
    names = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    assert len(names) == 2
    kw = inputs("llama")

    def hidden(out):  # a text model's last hidden states
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    with torch.no_grad():
        before = hidden(model(**kw))
        dt.convert(model)
        after = hidden(model(**kw))
    layers = dt.converted_layers(model)
    assert sorted(layers) == names
    sides = ("qk",) if name.endswith("-mha") else ("q", "k")
    assert all(m.damcha.config.metric_sides == sides for m in layers.values())
    assert same(after, before)
    _, _, _, norms, rotated = MORE_LLAMA_COPIES[name]
    if norms is None:
        ids = inputs("llama", torch.float64, padding=False)["input_ids"]
        _check_layers_against_reference("llama", model=model, call=lambda m: m(input_ids=ids))
        return
    _randomise_qk_norms(model)
    rotate_first = name.startswith(("hunyuan", "nanochat"))  # they normalise the rotated heads
    causal = name not in BIDIRECTIONAL
    _check_normed_layers(open_gates(model), norms, rotated=rotated, rotate_first=rotate_first, causal=causal)
    if rotated is not None and name in ("exaone4", "smollm3", "exaone-moe", "cohere2-moe", "kolibri1", "lara-mini"):
        assert sorted(bool(rotated(m)) for m in layers.values()) == [False, True]
    # The variants these cases are for: each is there.
    if name == "cohere2-moe-dense":  # the global layer rotates too (force_rope)
        assert all(rotated(m) for m in layers.values()) and any(m.sliding_window is None for m in layers.values())
    if name.startswith("laguna"):
        heads = sorted(m.damcha.config.num_heads for m in layers.values())
        assert heads == ([4, 8] if name == "laguna" else [4, 4])
        assert {m.gate_per_head for m in layers.values()} == {name == "laguna"}
    if name.startswith(("qwen3-next", "qwen3.5")):  # q_proj: H runs of a query head and its gate
        assert all(m.damcha.layout.sites[0].groups == 4 for m in layers.values())


# Qwen's vision-language models (transformers-llama's mrope language models, transformers-gated-query's
# Qwen3.5, transformers-qwen-vision's towers): name -> (model, config, text config, vision config, q/k
# norms). Text as the zoo's decoders (head_dim 8, multimodal RoPE sections 2 + 1 + 1 angles), a vision
# tower of 2 blocks over 2x2 patches merged 2x2 (Qwen2.5-VL's first block attends in windows of 2x2
# merged patches, its second over each whole image).
_VL_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
)
_VL_VISION = dict(depth=2, num_heads=4, patch_size=2, spatial_merge_size=2, temporal_patch_size=2)
_VL_VISION.update(hidden_size=32, intermediate_size=48, out_hidden_size=32, initializer_range=0.2)
_QWEN3_VISION = dict(_VL_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0])
_INTERLEAVED = {"rope_parameters": {**_VL_TEXT["rope_parameters"], "mrope_interleaved": True}}
_QWEN3_5_TEXT = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, **_INTERLEAVED)
_QWEN3_5_TEXT.update(linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
_VL_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
# GLM-4V's text heads are hidden_size / num_attention_heads wide: 16 here, half of them rotated.
_GLM_TEXT = dict(hidden_size=64, intermediate_size=96, head_dim=16, partial_rotary_factor=0.5)
_GLM_VISION = dict(_VL_VISION, out_hidden_size=64, image_size=8)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
QWEN_VL = {
    "qwen2-vl": (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLConfig",
        {},
        dict(_VL_VISION, embed_dim=32, mlp_ratio=2),
        _no_norms,
    ),
    "qwen2.5-vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLConfig",
        {},
        dict(_VL_VISION, window_size=4, fullatt_block_indexes=[1]),
        _no_norms,
    ),
    "qwen3-vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", _INTERLEAVED, _QWEN3_VISION, _rms_norms),
    "qwen3-vl-moe": (
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLMoeConfig",
        dict(_INTERLEAVED, **_VL_MOE),
        _QWEN3_VISION,
        _rms_norms,
    ),
    "qwen3.5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", _QWEN3_5_TEXT, _QWEN3_VISION, _rms_norms_one_plus),
    "qwen3.5-moe": (
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeConfig",
        dict(_QWEN3_5_TEXT, shared_expert_intermediate_size=16, **_VL_MOE),
        _QWEN3_VISION,
        _rms_norms_one_plus,
    ),
    # The third survey's: GLM-4V (dense, MoE) and GLM-OCR, whose text models rotate the first half of each
    # head (16 features: the 2 + 1 + 1 angles of the sections; in interleaved pairs, GLM-4V-MoE's in halves), whose vision
    # towers are Qwen2.5-VL's (GLM-OCR's with per-head q/k norms) over 8x8-pixel images; EXAONE 4.5 (EXAONE
    # 4's text model, rotating in its sliding-window layers, here both; a vision tower with GQA, 2 key heads).
    "glm4v": ("Glm4vForConditionalGeneration", "Glm4vConfig", _GLM_TEXT, _GLM_VISION, _no_norms),
    "glm4v-moe": (
        "Glm4vMoeForConditionalGeneration",
        "Glm4vMoeConfig",
        dict(_GLM_TEXT, n_routed_experts=2, first_k_dense_replace=1, **_VL_MOE),
        _GLM_VISION,
        _no_norms,
    ),
    "glm-ocr": ("GlmOcrForConditionalGeneration", "GlmOcrConfig", _GLM_TEXT, _GLM_VISION, _no_norms),
    "exaone4.5": (
        "Exaone4_5_ForConditionalGeneration",
        "Exaone4_5_Config",
        dict(model_type="exaone4", sliding_window=16, layer_types=["sliding_attention"] * 2, rope_parameters=_ROPE),
        dict(_VL_VISION, num_key_value_heads=2, window_size=4, fullatt_block_indexes=[1]),
        _rms_norms,
    ),
}
# Special tokens of the tiny vocabulary: image, video, vision start and end (GLM's: image start and end).
_VL_IDS = dict(image_token_id=60, video_token_id=59, vision_start_token_id=58, vision_end_token_id=57)
_GLM_IDS = dict(image_token_id=60, video_token_id=59, image_start_token_id=58, image_end_token_id=57)
_GLM_IDS.update(video_start_token_id=56, video_end_token_id=55)


def _qwen_vl(name):
    model, config, text, vision, _ = QWEN_VL[name]
    torch.manual_seed(0)
    ids = _GLM_IDS if name.startswith("glm") else _VL_IDS
    cfg = getattr(transformers, config)(
        text_config={**_VL_TEXT, **text}, vision_config=vision, experts_implementation="eager", **ids
    )
    return getattr(transformers, model)(cfg).to(torch.float64).eval()


def _qwen_vl_inputs(padding):
    """Two prompts of 12 tokens, each with an image between its vision start and end
    tokens: a 4x4-patch image (4 merged tokens) after two tokens that are padding
    in row 0 if ``padding``, a 2x4-patch one (2 tokens) in row 1."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[1, 2, 58, *[60] * 4, 57, 5, 6, 7, 8], [3, 4, 58, 60, 60, 57, 9, 10, 11, 12, 13, 14]])
    mask = torch.ones_like(ids)
    if padding:
        ids[0, :2], mask[0, :2] = 0, 0
    # 16 + 8 patches of 3 channels x 2 frames x 2 x 2 pixels.
    pixels = torch.randn(24, 24, generator=g, dtype=torch.float64)
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=(ids == 60).int(),
    )


@pytest.mark.parametrize("name", list(QWEN_VL))
def test_qwen_vl_family_converts(name):
    """Every attention layer of the vision tower (tied maps on its fused qkv) and
    of the language model (separate maps; Qwen3.5's on its gated q_proj)
    converted, exact at init bit for bit on a left-padded batch of images and
    text; with the gates open (random q/k norm weights) each vision layer
    equal to a NumPy forward with the host's 2D angles inside each image or
    window, each language layer to one with the host's multimodal RoPE angles
    (image tokens at their 3D positions)."""
    model = _qwen_vl(name)
    names = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    kw = _qwen_vl_inputs(padding=True)
    with torch.no_grad():
        before = model(**kw).logits
        dt.convert(model)
        after = model(**kw).logits
    layers = dt.converted_layers(model)
    assert sorted(layers) == names and len(names) == (3 if name.startswith("qwen3.5") else 4)
    sides = {n: m.damcha.config.metric_sides for n, m in layers.items()}
    tied = ("qk",) if name != "exaone4.5" else ("q", "k")  # EXAONE 4.5's vision tower: GQA
    assert sides == {n: tied if ".visual." in n else ("q", "k") for n in names}
    assert same(after, before)
    _randomise_qk_norms(model)
    kw = _qwen_vl_inputs(padding=False)
    _check_normed_layers(open_gates(model), QWEN_VL[name][4], call=lambda m: m(**kw))


# Vision towers of the third survey whose models hold attention of other layouts (Qwen2.5-Omni's and
# Qwen3-Omni's audio encoders) or take other inputs (ERNIE-4.5-VL's resampler), built by themselves:
# name -> (the tower's module and class, config, config sizes, features per patch). Qwen2.5-Omni's
# projects q, k and v with three Linear layers and attends in windows (its first block) as Qwen2.5-VL's,
# Qwen3-Omni's is Qwen3-VL's, ERNIE-4.5-VL's Qwen2.5-VL's (whole images, patches of one frame).
QWEN_VISION_TOWERS = {
    "qwen2.5-omni": (
        "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder",
        "Qwen2_5OmniVisionEncoderConfig",
        dict(_VL_VISION, window_size=4, fullatt_block_indexes=[1]),
        24,
    ),
    "qwen3-omni": (
        "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder",
        "Qwen3OmniMoeVisionEncoderConfig",
        _QWEN3_VISION,
        24,
    ),
    "ernie4.5-vl": (
        "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeVisionTransformerPretrainedModel",
        "Ernie4_5_VLMoeVisionConfig",
        {k: v for k, v in _VL_VISION.items() if k not in ("temporal_patch_size", "out_hidden_size")},
        12,
    ),
}


@pytest.mark.parametrize("name", list(QWEN_VISION_TOWERS))
def test_qwen_vision_towers_convert(name):
    """Both blocks of a vision tower converted with tied maps, exact at init bit
    for bit on two images of 4x4 and 2x4 patches, and each block (gates open)
    equal to a NumPy forward with the host's 2D angles inside each image or
    window (``_check_qwen_vision_call``)."""
    path, config, sizes, features = QWEN_VISION_TOWERS[name]
    module, cls = path.rsplit(".", 1)
    torch.manual_seed(0)
    tower = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    model = tower(getattr(transformers, config)(**sizes)).to(torch.float64).eval()
    pixels = torch.randn(24, features, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kw = {"hidden_states": pixels, "grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}

    def hidden(out):
        return out if isinstance(out, torch.Tensor) else out.last_hidden_state

    with torch.no_grad():
        before = hidden(model(**kw))
        dt.convert(model)
        after = hidden(model(**kw))
    layers = dt.converted_layers(model)
    assert sorted(layers) == ["blocks.0.attn", "blocks.1.attn"]
    assert all(m.damcha.config.metric_sides == ("qk",) for m in layers.values())
    assert same(after, before)
    open_gates(model)
    calls = capture(model)
    with torch.no_grad():
        model(**kw)
    for layer, ((args, kwargs, output),) in calls.items():
        _check_qwen_vision_call(layers[layer], args, kwargs, output, name=layer)


# Copies of CLIP's and SigLIP's attention (transformers-clip) and of Dinov2's (transformers-vit): name ->
# (model, config, what it runs on, the zoo's layout whose reference each tower's layers follow). CLIPSeg:
# its text tower (causal), its vision tower and its decoder layer (neither causal), each checked by
# itself. A model of a module path (under transformers.models) is its class there; ``CLIP_PARTS`` names
# the tower converted and run where the model holds attention of other layouts (Idefics2's perceiver,
# Kosmos-2's text decoder).
_CLIP_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
_CLIP_TEXT.update(max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
_CLIP_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
# Idefics-style models: 16x16 images of 4x4-pixel patches, shuffled 2x2 into 4 image tokens.
_IDEFICS = dict(
    text_config=dict(_CLIP_VISION, vocab_size=VOCAB, num_key_value_heads=2, pad_token_id=0, model_type="llama"),
    vision_config=dict(_CLIP_VISION, image_size=16, patch_size=4),
    scale_factor=2,
    image_token_id=60,
)
CLIP_COPIES = {
    "metaclip2-text": ("MetaClip2TextModel", "MetaClip2TextConfig", _CLIP_TEXT, "text"),
    "metaclip2-vision": (
        "MetaClip2VisionModel",
        "MetaClip2VisionConfig",
        dict(_CLIP_VISION, image_size=16, patch_size=8),
        "image",
    ),
    "siglip2-text": ("Siglip2TextModel", "Siglip2TextConfig", _CLIP_TEXT, "text"),
    # Variable resolution: 16 patches of 4x4 pixels per image (row 0's last 4 are padding).
    "siglip2-vision": (
        "Siglip2VisionModel",
        "Siglip2VisionConfig",
        dict(_CLIP_VISION, patch_size=4, num_patches=16),
        "patches",
    ),
    "clipseg": (
        "CLIPSegForImageSegmentation",
        "CLIPSegConfig",
        dict(
            text_config=_CLIP_TEXT,
            vision_config=dict(_CLIP_VISION, image_size=16, patch_size=8),
            projection_dim=16,
            reduce_dim=16,
            extract_layers=[1],
            decoder_num_attention_heads=4,
            decoder_intermediate_size=32,
        ),
        "text and image",
    ),
    # The third survey's: SmolVLM's and Idefics3's vision towers (SigLIP's) in their whole models (a
    # Llama text model), Idefics2's and Kosmos-2's by themselves, AIMv2's two towers (the text tower causal
    # through its mask; the CLIP-style model needs the vision tower's pooling head), GIT's and Chinese-CLIP's vision towers (CLIP's), Pixio, TIPSv2's vision tower and
    # RF-DETR's backbone (Dinov2's; RF-DETR's first block attends inside 2x2 windows of the patches).
    "smolvlm": ("SmolVLMForConditionalGeneration", "SmolVLMConfig", _IDEFICS, "text and images"),
    "idefics3": ("Idefics3ForConditionalGeneration", "Idefics3Config", _IDEFICS, "text and images"),
    "idefics2-vision": (
        "Idefics2ForConditionalGeneration",
        "Idefics2Config",
        dict(
            text_config=dict(_IDEFICS["text_config"], model_type="mistral"),
            vision_config=_IDEFICS["vision_config"],
            perceiver_config=dict(hidden_size=32, resampler_n_latents=4, resampler_depth=1, num_key_value_heads=2),
        ),
        "patch mask",
    ),
    "kosmos2-vision": (
        "Kosmos2Model",
        "Kosmos2Config",
        dict(
            text_config=dict(vocab_size=VOCAB, embed_dim=32, layers=1, attention_heads=4, ffn_dim=48),
            vision_config=dict(_CLIP_VISION, image_size=16, patch_size=8),
            latent_query_num=4,
        ),
        "image",
    ),
    # Eager: its model leaves the causal mask out where no token is padding, and its layers pass the kernel
    # is_causal=False, so under SDPA an unpadded batch attends both ways (the host's, maps or not).
    "aimv2-text": ("Aimv2TextModel", "Aimv2TextConfig", dict(_CLIP_TEXT, attn_implementation="eager"), "text"),
    # Without its pooling head (a learned query without projection, refused as timm's AttentionPoolLatent is).
    "aimv2-vision": (
        "Aimv2VisionModel",
        "Aimv2VisionConfig",
        dict(_CLIP_VISION, image_size=16, patch_size=8, use_head=False),
        "image",
    ),
    "git-vision": ("GitVisionModel", "GitVisionConfig", dict(_CLIP_VISION, image_size=16, patch_size=8), "image"),
    "chinese-clip-vision": (
        "ChineseCLIPVisionModel",
        "ChineseCLIPVisionConfig",
        dict(_CLIP_VISION, image_size=16, patch_size=8),
        "image",
    ),
    "pixio": ("PixioModel", "PixioConfig", dict(_CLIP_VISION, image_size=16, patch_size=8), "image"),
    "tipsv2-vision": (
        "Tipsv2VisionModel",
        "Tipsv2VisionConfig",
        dict(_CLIP_VISION, image_size=16, patch_size=8),
        "image",
    ),
    "rf-detr-backbone": (
        "rf_detr.modeling_rf_detr.RfDetrDinov2Backbone",
        "RfDetrDinov2Config",
        dict(_CLIP_VISION, image_size=16, patch_size=4, num_windows=2, window_block_indexes=[0], out_indices=[2]),
        "image",
    ),
}
# The towers converted and run by themselves, by attribute path.
CLIP_PARTS = {"idefics2-vision": "model.vision_model", "kosmos2-vision": "vision_model"}


def _clip_copy_inputs(name, padding):
    """Keyword inputs of a ``CLIP_COPIES`` model: 7 tokens (row 0 left-padded by two if
    ``padding``), 16x16 images, or 16 patches (row 0's last 4 padding); with images
    (Idefics-style), an image of 4 image tokens in each row's tokens 3 to 6; a patch
    mask (row 0's last row of 4x4-pixel patches padding)."""
    g = torch.Generator().manual_seed(1)
    kw = {}
    runs_on = CLIP_COPIES[name][3]
    if "text" in runs_on:
        kw["input_ids"] = torch.randint(1, 57, (2, 7), generator=g)
        kw["attention_mask"] = torch.ones(2, 7, dtype=torch.long)
        if padding:
            kw["attention_mask"][0, :2] = 0
    if runs_on.endswith("image") or runs_on == "patch mask":
        kw["pixel_values"] = torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)
    if runs_on == "patch mask":
        kw["patch_attention_mask"] = torch.ones(2, 4, 4, dtype=torch.bool)
        if padding:
            kw["patch_attention_mask"][0, -1] = False
    if runs_on.endswith("images"):
        kw["input_ids"][:, 3:7] = CLIP_COPIES[name][2]["image_token_id"]
        kw["pixel_values"] = torch.randn(2, 1, 3, 16, 16, generator=g, dtype=torch.float64)
    if runs_on == "patches":
        kw["pixel_values"] = torch.randn(2, 16, 3 * 4 * 4, generator=g, dtype=torch.float64)
        kw["pixel_attention_mask"] = torch.ones(2, 16, dtype=torch.long)
        if padding:
            kw["pixel_attention_mask"][0, -4:] = 0
        kw["spatial_shapes"] = torch.tensor([[4, 4], [4, 4]])
    return kw


def _clip_copy(name):
    model, config, sizes, _ = CLIP_COPIES[name]
    torch.manual_seed(0)
    if "." in model:
        module, model = model.rsplit(".", 1)
        build = getattr(importlib.import_module(f"transformers.models.{module}"), model)
    else:
        build = getattr(transformers, model)
    built = build(getattr(transformers, config)(**sizes)).to(torch.float64).eval()
    return operator.attrgetter(CLIP_PARTS[name])(built) if name in CLIP_PARTS else built


@pytest.mark.parametrize("name", list(CLIP_COPIES))
def test_clip_and_siglip_copies_convert(name):
    """Every attention layer converted (tied maps; SigLIP 2's pooling head's
    nn.MultiheadAttention replaced), exact at init bit for bit on a padded batch,
    and each layer (gates open) equal to the reference: causal in the text
    towers of CLIP's kind, not in SigLIP's, vision towers and CLIPSeg's decoder."""
    model = _clip_copy(name)
    kw = _clip_copy_inputs(name, padding=True)

    def hidden(out):
        if hasattr(out, "feature_maps"):  # a backbone's
            return out.feature_maps[-1]
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    with torch.no_grad():
        before = hidden(model(**kw))
        dt.convert(model)
        after = hidden(model(**kw))
    layers = dt.converted_layers(model)
    assert sorted(layers) == sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    # Tied maps but in the Idefics-style models' Llama text layers (GQA: separate).
    assert all(
        m.damcha.config.metric_sides == (("q", "k") if n.startswith("model.text_model.") else ("qk",))
        for n, m in layers.items()
        if not isinstance(m, dt.DamchaAttention)
    )
    assert len(layers) == {"clipseg": 5, "siglip2-vision": 3, "smolvlm": 4, "idefics3": 4}.get(name, 2)
    assert same(after, before)
    kw = _clip_copy_inputs(name, padding=False)
    if name == "clipseg":
        towers = [("clip-text", model.clip.text_model), ("clip-vision", model.clip.vision_model)]
        towers.append(("clip-vision", model.decoder))
    elif name in ("smolvlm", "idefics3"):
        towers = [("siglip", model.model.vision_model)]
    else:
        towers = [("clip-text" if name in ("metaclip2-text", "aimv2-text") else "siglip", model)]
    for arch, tower in towers:
        _check_layers_against_reference(arch, model=tower, call=lambda m: model(**kw))


def test_gated_query_maps_train_alike_with_and_without_recompute():
    """The maps of Qwen3.5's gated q_proj (a query-only site of H runs of a
    query head and its gate: with recompute, the fused node's interleaved
    blocks) train: a loss's gradients with recompute equal those without (the
    general path's autograd), and every gate gets one."""
    grads = []
    for recompute in (True, False):
        model = open_gates(dt.convert(_more_llama_copy("qwen3.5"), recompute=recompute)).train()
        kw = inputs("llama", torch.float64)
        nodes: list[str] = []
        hooks = [
            layer.q_proj.register_forward_hook(lambda m, a, out, nodes=nodes: nodes.append(type(out.grad_fn).__name__))
            for layer in dt.converted_layers(model).values()
        ]
        model(**kw, labels=kw["input_ids"]).loss.backward()
        for hook in hooks:
            hook.remove()
        assert nodes and all((n == "FusedProjectionMapsBackward") == recompute for n in nodes), nodes
        gates = {n: p.grad for n, p in model.named_parameters() if ".gates." in n}
        assert len(gates) == 4 and all(g is not None and g.abs().max() > 0 for g in gates.values())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", ["zamba", "zamba2"])
def test_zamba_blocks_with_tied_weights_share_their_maps(tmp_path, name):
    """Zamba's hybrid layers each hold a transformer block whose host weights are
    tied to the first's (_tied_weights_keys): their maps are tied too, the same
    gate and generator parameters registered in each block, as the host's. The
    host re-ties by module prefix in tie_weights() and resize_token_embeddings(),
    which used to merge maps that had been kept apart (and trained apart) into
    the first block's, changing the logits silently; now it finds them tied. The
    checkpoint loads back bit for bit, still tied."""
    model = open_gates(dt.convert(_more_llama_copy(name)))
    first, second = dt.converted_layers(model).values()
    assert first.q_proj.weight is second.q_proj.weight and first.damcha is not second.damcha
    for side, gate in first.damcha.gates.items():
        assert second.damcha.gates[side] is gate and second.damcha.generator(side) is first.damcha.generator(side)
    with torch.no_grad():
        for gate in first.damcha.gates.values():
            gate.copy_(torch.linspace(-0.6, 0.7, gate.numel(), dtype=gate.dtype))  # not the open_gates value
    kw = inputs("llama")
    with torch.no_grad():
        before = model(**kw).logits
        model.resize_token_embeddings(VOCAB + 3)
        torch.testing.assert_close(model(**kw).logits[..., :VOCAB], before, rtol=0, atol=1e-12)
    model.save_pretrained(tmp_path)
    loaded, info = dt.from_pretrained(type(model), tmp_path, dtype=torch.float64, output_loading_info=True)
    assert not info["missing_keys"], info  # the later block's maps come back tied, not "newly initialized"
    loaded_first, second = dt.converted_layers(loaded.eval()).values()
    assert (
        loaded_first.q_proj.weight is second.q_proj.weight
        and second.damcha.gates["q"] is loaded_first.damcha.gates["q"]
    )
    assert torch.equal(loaded_first.damcha.gates["q"], first.damcha.gates["q"])
    with torch.no_grad():  # (the resized embeddings reload to within a rounding)
        torch.testing.assert_close(loaded(**kw).logits, model(**kw).logits, rtol=0, atol=1e-12)


def test_minimax_lightning_attention_is_refused_by_name():
    """MiniMax's lightning-attention layers are linear attention (no softmax of q k^T)
    and no layout convert() knows: a model with one is refused, naming it, and
    nothing is converted (a MiniMax of full-attention layers only converts:
    test_more_llama_copies_convert)."""
    model = _tiny_lm(
        "MiniMaxForCausalLM",
        "MiniMaxConfig",
        torch.float32,
        **dict(MORE_LLAMA_COPIES["minimax"][2], layer_types=["linear_attention", "full_attention"]),
    )
    pattern = r"unknown layouts: model\.layers\.0\.self_attn \(transformers\.\S+\.MiniMaxLightningAttention\)"
    with pytest.raises(dc.DamchaValueError, match=pattern):
        dt.convert(model)
    assert not dt.converted_layers(model)


def test_zamba2_with_shared_attention_adapters_is_refused_by_name():
    """Zamba2's use_shared_attention_adapter adds a low-rank adapter of the tokens to
    the queries and keys after q_proj and k_proj: refused, naming the layer and
    the flag, and nothing is converted."""
    extra = dict(MORE_LLAMA_COPIES["zamba2"][2], use_shared_attention_adapter=True, adapter_rank=4)
    model = _tiny_lm("Zamba2ForCausalLM", "Zamba2Config", torch.float32, **extra)
    pattern = (
        r"Cannot convert layer `model\.layers\.0\.shared_transformer\.self_attn` \(transformers-zamba\): "
        r"Invalid argument `config\.use_shared_attention_adapter`: expected False"
    )
    with pytest.raises(dc.DamchaValueError, match=pattern):
        dt.convert(model)
    assert not dt.converted_layers(model)


def _biogpt(dtype):
    """A tiny random-weight ``BioGptForCausalLM`` (transformers' decoder-only copy of BART's attention)."""
    torch.manual_seed(0)
    config = transformers.BioGptConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        initializer_range=0.2,  # logits far from 0, as the zoo's "bart" (init_std=0.2)
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.BioGptForCausalLM(config).to(dtype).eval()


def test_biogpt_converts():
    """BioGPT (a causal decoder built from BART's attention with
    ``is_causal=True``): every self-attention converted with tied maps, exact
    at init bit for bit (left-padded batch), each layer equal to the
    reference (causal) with the gates open, and cached greedy generation equal
    to uncached generation, away from the unconverted model's."""
    model = _biogpt(torch.float32)
    _check_converted_lm(model, [f"biogpt.layers.{i}.self_attn" for i in range(2)], ("qk",))
    ids = inputs("llama", torch.float64, padding=False)["input_ids"]
    _check_layers_against_reference("bart", model=dt.convert(_biogpt(torch.float64)), call=lambda m: m(input_ids=ids))


def test_distilbert_converts():
    """DistilBERT (an encoder; its self-attention has q_lin/k_lin/v_lin/out_lin):
    every layer converted with tied maps, exact at init bit for bit (padded
    batch), each layer equal to the reference (not causal) with the gates
    open, and the outputs move."""
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=48,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.DistilBertModel(config).eval()
    kw = inputs("bert")
    with torch.no_grad():
        before = model(**kw).last_hidden_state
        dt.convert(model)
        after = model(**kw).last_hidden_state
    layers = dt.converted_layers(model)
    assert sorted(layers) == [f"transformer.layer.{i}.attention" for i in range(2)]
    assert all(m.damcha.config.metric_sides == ("qk",) for m in layers.values())
    assert same(after, before)
    open_gates(model)
    with torch.no_grad():
        assert (model(**kw).last_hidden_state - before).abs().max() > 1e-3
    torch.manual_seed(0)
    model = dt.convert(transformers.DistilBertModel(config).double().eval())
    ids = inputs("bert", torch.float64, padding=False)["input_ids"]
    _check_layers_against_reference("distilbert", model=model, call=lambda m: m(input_ids=ids))


def test_time_series_transformer_converts():
    """TimeSeriesTransformer (an encoder-decoder over a series, built from
    BART's attention as BART builds it): encoder and decoder self-attention
    tied, cross-attention separate, exact at init bit for bit, and each layer
    equal to the reference with the gates open (the decoder's self-attention
    causal)."""
    sizes = dict(d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2)
    config = transformers.TimeSeriesTransformerConfig(
        prediction_length=4,
        context_length=6,
        lags_sequence=[1, 2],
        num_time_features=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        init_std=0.2,
        **sizes,
    )
    g = torch.Generator().manual_seed(1)
    past, future = config.context_length + max(config.lags_sequence), config.prediction_length
    kw = {
        "past_values": torch.randn(2, past, generator=g, dtype=torch.float64),
        "past_time_features": torch.randn(2, past, 2, generator=g, dtype=torch.float64),
        "past_observed_mask": torch.ones(2, past, dtype=torch.float64),
        "future_values": torch.randn(2, future, generator=g, dtype=torch.float64),
        "future_time_features": torch.randn(2, future, 2, generator=g, dtype=torch.float64),
    }
    torch.manual_seed(0)
    model = transformers.TimeSeriesTransformerModel(config).double().eval()
    with torch.no_grad():
        before = model(**kw).last_hidden_state
        dt.convert(model)
        after = model(**kw).last_hidden_state
    assert same(after, before)
    sides = {n: m.damcha.config.metric_sides for n, m in dt.converted_layers(model).items()}
    assert sides == {
        **{f"encoder.layers.{i}.self_attn": ("qk",) for i in range(2)},
        **{f"decoder.layers.{i}.self_attn": ("qk",) for i in range(2)},
        **{f"decoder.layers.{i}.encoder_attn": ("q", "k") for i in range(2)},
    }
    _check_layers_against_reference("bart", model=model, call=lambda m: m(**kw))


def test_albert_converts():
    """ALBERT (its one attention module called at each of the 3 depths, weights
    shared): that module converted once with tied maps, shared by every depth
    as its weights are; exact at init bit for bit (padded batch), the outputs
    move with the gates open, and every call, one per depth, equal to the
    reference inside ALBERT's LayerNorm(x + attention(x)), with the gates open."""
    model = build("albert", torch.float32)
    kw = inputs("albert")
    with torch.no_grad():
        before = run(model, "albert", kw)
        dt.convert(model)
        after = run(model, "albert", kw)
    layers = dt.converted_layers(model)
    assert list(layers) == ["encoder.albert_layer_groups.0.albert_layers.0.attention"]
    assert layers[next(iter(layers))].damcha.config.metric_sides == ("qk",)
    assert same(after, before)
    with torch.no_grad():
        assert (run(open_gates(model), "albert", kw) - before).abs().max() > 1e-3
    model = open_gates(dt.convert(build("albert", torch.float64)))
    calls = capture(model)
    with torch.no_grad():
        run(model, "albert", inputs("albert", torch.float64, padding=False))
    ((name, records),) = calls.items()
    module = dt.converted_layers(model)[name]
    assert len(records) == 3  # one call per depth
    p, cfg = layer_params("albert", module)
    for depth, (args, kwargs, output) in enumerate(records):
        x = _call_tokens(args, kwargs)[0].double().numpy()
        want = _layer_norm(x + dc.damcha_attention(p, cfg, x), module.LayerNorm)
        np.testing.assert_allclose(output[0].double().numpy(), want, rtol=0, atol=1e-12, err_msg=f"depth {depth}")


# T5's attention and transformers' copies of it (the transformers-t5 adapter) and Pix2Struct's
# (transformers-pix2struct), one compact test each, not in the zoo's ARCHS: name -> the attention
# classes the layers of the zoo's model hold.
T5_FAMILY = {
    "t5": ("T5Attention",),
    "mt5": ("MT5Attention",),
    "umt5": ("UMT5Attention",),
    "switch-transformers": ("SwitchTransformersAttention",),
    "pop2piano": ("Pop2PianoAttention",),
    "udop": ("UdopAttention",),
    "pix2struct": ("Pix2StructVisionAttention", "Pix2StructTextAttention"),
}
assert set(T5_FAMILY) == set(T5_MODELS)
# The names under which the decoders' layers hold their cross-attention.
T5_CROSS = ("EncDecAttention", "encoder_decoder_attention.attention")


def _t5_key(module):
    return module.key if hasattr(module, "key") else module.k  # Pix2Struct's names, T5's


def _t5_generate(model, name, kw, **opts):
    if name == "pop2piano":
        # Its own generate() prepends a composer token to audio features (a generation config the tiny
        # model lacks), then runs transformers' loop, called here directly on token ids.
        return super(type(model), model).generate(**kw, **opts)
    return model.generate(**kw, **opts)


def _check_t5_layers(model, name, call):
    """Each converted layer of a float64 T5-family model (gates open) against an
    independent NumPy forward: project, the reference's maps (a cross-attention's
    keys mapped by the encoder output's; each layer's role checked first, so a
    cross-attention converted as self-attention fails), unscaled logits plus the host's relative
    position bias (the one it returns, or for UMT5, which returns none, its
    compute_bias), causal in the decoder's self-attention (by the layer's
    place, not its flags), the output projection."""
    open_gates(model)
    calls = capture(model)
    with torch.no_grad():
        call(model)
    assert set(calls) == set(dt.converted_layers(model))
    for layer, ((args, kwargs, output),) in calls.items():
        module = dt.converted_layers(model)[layer]
        x, ctx = _call_tokens(args, kwargs)
        cross = ctx is not None
        assert cross == (module.damcha.layout.self_attention is False), layer
        x = x.double().numpy()
        c = x if ctx is None else ctx.double().numpy()
        p, cfg = layer_params(name, module)
        _, metric = dc.damcha_attention(p, cfg, x, None if ctx is None else c, return_metric=True)
        q = np.einsum("btha,btad->bthd", metric["q"], np.einsum("bte,ehd->bthd", x, p["query.kernel"]))
        k = np.einsum("btha,btad->bthd", metric["k"], np.einsum("bte,ehd->bthd", c, p["key.kernel"]))
        v = np.einsum("bte,ehd->bthd", c, p["value.kernel"])
        n, m = x.shape[1], c.shape[1]
        if len(output) == 3:  # (output, position bias, weights)
            bias = _np(output[1])
        elif getattr(module, "has_relative_attention_bias", False):
            bias = _np(module.compute_bias(n, m))
        else:
            bias = np.zeros((1, 1, n, m))
        logits = np.einsum("bnhd,bmhd->bhnm", q, k) + bias  # T5 does not scale q.k
        if layer.startswith("decoder.") and not cross:
            logits = np.where(np.arange(m)[None] <= np.arange(n)[:, None], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        o = np.einsum("bhnm,bmhd->bnhd", probs / probs.sum(-1, keepdims=True), v)
        want = np.einsum("bnhd,hde->bne", o, p["output.kernel"])
        np.testing.assert_allclose(output[0].double().numpy(), want, rtol=0, atol=1e-12, err_msg=layer)


@pytest.mark.parametrize("name", list(T5_FAMILY))
def test_t5_family_converts(name):
    """Every attention layer converted (encoder and decoder self-attention tied,
    decoder cross-attention separate), exact at init bit for bit (padded
    batch), cached greedy generation equal to uncached with the gates open and
    away from the unconverted model's, a cached step reusing the
    cross-attention keys mapped once, and each layer against an independent
    NumPy forward with the host's relative position bias."""
    model = build(name, torch.float32)
    attention = {n: m for n, m in model.named_modules() if type(m).__name__ in T5_FAMILY[name]}
    kw = inputs(name)
    gen = inputs(name, padding=False, length=5)
    gen.pop("attention_mask")
    opts = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        before = run(model, name, kw)
        unconverted = _t5_generate(model, name, gen, use_cache=True, **opts)
        dt.convert(model)
        after = run(model, name, kw)
    layers = dt.converted_layers(model)
    assert len(attention) == 6 and set(layers) == set(attention)  # 2 encoder, 2 + 2 decoder
    for n, m in layers.items():
        cross = n.endswith(T5_CROSS)
        assert m.damcha.config.metric_sides == (("q", "k") if cross else ("qk",)), n
    assert same(after, before)
    open_gates(model, scale=0.8)
    with torch.no_grad():
        cached = _t5_generate(model, name, gen, use_cache=True, **opts)
        plain = _t5_generate(model, name, gen, use_cache=False, **opts)
    assert cached.sequences.shape[1] == gen["decoder_input_ids"].shape[1] + 6
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert (a - c).abs().max() > 1e-3

    model = dt.convert(build(name, torch.float64))
    kw = inputs(name, torch.float64, padding=False)
    _check_t5_layers(model, name, lambda m: m(**kw))
    # A cached step: the cross-attention keys of the encoder output, projected and mapped at the
    # first step, come from the cache (no k call), mapped once.
    ids = kw.pop("decoder_input_ids")
    cross = [m for n, m in dt.converted_layers(model).items() if n.endswith(T5_CROSS)]
    with torch.no_grad():
        full = model(**kw, decoder_input_ids=ids).logits
        # The encoder once, as generate runs it (SwitchTransformers would pass use_cache on to it).
        encoded = model.get_encoder()(**kw)
        mask = {"attention_mask": kw["attention_mask"]}
        first = model(**mask, encoder_outputs=encoded, decoder_input_ids=ids[:, :-1], use_cache=True)
        enc, cache = encoded.last_hidden_state, first.past_key_values
        calls = []
        hooks = [_t5_key(m).register_forward_hook(lambda m, a, o: calls.append(m)) for m in cross]
        step = model(**mask, encoder_outputs=encoded, decoder_input_ids=ids[:, -1:], cache=cache)
        for h in hooks:
            h.remove()
        assert calls == []
        for layer in cross:
            B, M = enc.shape[:2]
            mapped = _t5_key(layer)(enc).view(B, M, layer.n_heads, -1).transpose(1, 2)
            plain_keys = nn.functional.linear(enc, _t5_key(layer).weight).view(B, M, layer.n_heads, -1).transpose(1, 2)
            cached_keys = cache.cross_attention_cache.layers[layer.layer_idx].keys
            assert torch.equal(cached_keys, mapped)
            assert not torch.allclose(cached_keys, plain_keys)
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=0, atol=1e-12)


def _t5gemma(dtype):
    """A tiny random-weight ``T5GemmaForConditionalGeneration``: encoder and decoder of 2 layers (a
    sliding-window layer of 4 tokens, then a global one), MHA (4 heads of 8), Gemma 2's scale
    (query_pre_attn_scalar 16), no soft-capping."""
    stack = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    stack.update(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, max_position_embeddings=64)
    stack.update(query_pre_attn_scalar=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    stack.update(attn_logit_softcapping=None, final_logit_softcapping=None, initializer_range=0.2)
    ids = dict(pad_token_id=0, eos_token_id=2, bos_token_id=1, decoder_start_token_id=1)
    config = transformers.T5GemmaConfig(encoder=stack, decoder=dict(stack), vocab_size=VOCAB, **ids)
    torch.manual_seed(0)
    return transformers.T5GemmaForConditionalGeneration(config).to(dtype).eval()


def _converts_exactly_and_generates(model, count, sides_of):
    """An encoder-decoder converted: every attention-named module, ``count`` of them, with the
    metric sides ``sides_of(name)``; exact at init bit for bit on a padded batch; with the gates
    open, cached greedy generation equal to uncached and away from the unconverted model's."""
    kw = inputs("t5")
    gen = inputs("t5", padding=False, length=5)
    gen.pop("attention_mask")
    opts = {"max_new_tokens": 5, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        before = model(**kw).logits
        unconverted = model.generate(**gen, use_cache=True, **opts)
        dt.convert(model)
        after = model(**kw).logits
    layers = dt.converted_layers(model)
    assert sorted(layers) == sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    sides = {n: m.damcha.config.metric_sides for n, m in layers.items()}
    assert len(sides) == count and sides == {n: sides_of(n) for n in sides}
    assert same(after, before)
    open_gates(model, scale=0.8)
    with torch.no_grad():
        cached = model.generate(**gen, use_cache=True, **opts)
        plain = model.generate(**gen, use_cache=False, **opts)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert (a - c).abs().max() > 1e-3


def test_t5gemma_converts():
    """T5Gemma (Gemma 2's self-attention in an encoder and a decoder, a cross-attention class of its own):
    the self-attention layers converted with tied maps, the cross-attention layers (told apart by
    their class) with separate maps; exact at init bit for bit on a padded batch; cached greedy
    generation equal to uncached with the gates open and away from the unconverted model's (the
    cross-attention keys mapped once, then cached); and each layer against an independent NumPy forward:
    the reference's maps (a cross-attention's keys mapped by the encoder output's), the host's rotation
    angles (self-attention only), the host's scale, the encoder's two-way window (|i - j| <= 4) or the
    decoder's causal one (i - j < 4) in the sliding layers, the output projection."""
    _converts_exactly_and_generates(
        _t5gemma(torch.float32), 6, lambda n: ("q", "k") if n.endswith("cross_attn") else ("qk",)
    )

    model = open_gates(dt.convert(_t5gemma(torch.float64)))
    calls = capture(model)
    with torch.no_grad():
        model(**inputs("t5", torch.float64, padding=False))
    assert set(calls) == set(dt.converted_layers(model))
    for layer, ((args, kwargs, output),) in calls.items():
        module = dt.converted_layers(model)[layer]
        x, ctx = _call_tokens(args, kwargs)
        cross = ctx is not None
        assert cross == layer.endswith("cross_attn") == (module.damcha.layout.self_attention is False), layer
        x = x.double().numpy()
        c = x if ctx is None else ctx.double().numpy()
        p, cfg = layer_params("llama", module)
        _, metric = dc.damcha_attention(p, cfg, x, None if ctx is None else c, return_metric=True)
        q = np.einsum("bte,ehd->bthd", x, p["query.kernel"]) + p["query.bias"]
        k = np.einsum("bte,ehd->bthd", c, p["key.kernel"]) + p["key.bias"]
        v = np.einsum("bte,ehd->bthd", c, p["value.kernel"]) + p["value.bias"]
        q, k = np.einsum("btha,btad->bthd", metric["q"], q), np.einsum("btha,btad->bthd", metric["k"], k)
        n, m = x.shape[1], c.shape[1]
        keep = np.ones((n, m), dtype=bool)
        if not cross:  # RoPE in halves, the host's angles
            cos, sin = (t.double().numpy()[:, :, None] for t in kwargs["position_embeddings"])
            R = cos.shape[-1] // 2
            cos, sin = cos[..., :R], sin[..., :R]

            def rotate(y, cos=cos, sin=sin, R=R):
                return np.concatenate([y[..., :R] * cos - y[..., R:] * sin, y[..., R:] * cos + y[..., :R] * sin], -1)

            q, k = rotate(q), rotate(k)
            distance = np.arange(n)[:, None] - np.arange(m)[None]
            decoder = layer.startswith("model.decoder.")
            if decoder:
                keep &= distance >= 0
            if module.sliding_window is not None:
                keep &= (distance < module.sliding_window) if decoder else (np.abs(distance) <= module.sliding_window)
        logits = np.where(keep, module.scaling * np.einsum("bnhd,bmhd->bhnm", q, k), -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        o = np.einsum("bhnm,bmhd->bnhd", probs / probs.sum(-1, keepdims=True), v)
        want = np.einsum("bnhd,hde->bne", o, p["output.kernel"]) + p["output.bias"]
        # The host's eager attention (its default) takes its softmax in float32.
        np.testing.assert_allclose(
            output[0].double().numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=layer
        )
    assert {getattr(m, "sliding_window", None) for m in dt.converted_layers(model).values()} == {4, None}


def _t5gemma2(dtype):
    """A tiny random-weight ``T5Gemma2ForConditionalGeneration``: a text encoder and a decoder of 2
    layers (a sliding-window layer, wider than these tokens, with its own RoPE, then a global one),
    MHA (4 heads of 8), per-head q/k norms, Gemma 3's scale (query_pre_attn_scalar 16); the
    encoder's SigLIP vision tower of one layer, without its pooling head."""
    stack = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    stack.update(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, max_position_embeddings=64)
    stack.update(query_pre_attn_scalar=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    stack.update(initializer_range=0.2)
    vision = dict(_CLIP_VISION, num_hidden_layers=1, image_size=16, patch_size=8, vision_use_head=False)
    image = dict(mm_tokens_per_image=1, boi_token_index=57, eoi_token_index=58, image_token_index=59)
    encoder = dict(text_config=stack, vision_config=vision, **image)
    ids = dict(pad_token_id=0, eos_token_id=2, bos_token_id=1, decoder_start_token_id=1, image_token_index=59)
    config = transformers.T5Gemma2Config(encoder=encoder, decoder=dict(stack), vocab_size=VOCAB, **ids)
    torch.manual_seed(0)
    return transformers.T5Gemma2ForConditionalGeneration(config).to(dtype).eval()


def test_t5gemma2_converts():
    """T5Gemma 2: the text encoder's self-attention (Gemma 3's, not causal) and the SigLIP tower's
    converted with tied maps, the decoder's merged attention (its own keys and the encoder
    output's, from one k_proj) with separate maps; exact at init bit for bit on a padded batch;
    cached greedy generation equal to uncached with the gates open and away from the unconverted
    model's; and each text layer against an independent NumPy forward: the reference's maps (in the
    decoder, the queries and its own keys mapped by the decoder tokens, the encoder output's keys by
    the encoder's), Gemma's per-head norms y / rms(y) * (1 + w) (random w) on the queries and on both
    kinds of keys, the host's rotation angles on the queries and the decoder's own keys only, a
    softmax over the decoder's keys (causal) and the encoder's together, the output projection."""
    _converts_exactly_and_generates(
        _t5gemma2(torch.float32), 5, lambda n: ("q", "k") if n.startswith("model.decoder.") else ("qk",)
    )

    model = open_gates(dt.convert(_t5gemma2(torch.float64)))
    _randomise_qk_norms(model)
    calls = capture(model)
    with torch.no_grad():
        model(**inputs("t5", torch.float64, padding=False))
    # The vision tower's layer is not called: no image.
    assert set(calls) == set(dt.converted_layers(model)) - {"model.encoder.vision_tower.encoder.layers.0.self_attn"}

    def norm(y, mod):
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + mod.eps) * (1 + _np(mod.weight))

    for layer, ((args, kwargs, output),) in calls.items():
        module = dt.converted_layers(model)[layer]
        x, ctx = _call_tokens(args, kwargs)
        decoder = layer.startswith("model.decoder.")
        assert (ctx is not None) == decoder == (module.damcha.layout.self_attention is False), layer
        x = x.double().numpy()
        p, cfg = layer_params("llama", module)

        def project(tokens, role, side, p=p, cfg=cfg, x=x):  # a role's heads of the tokens, mapped by the tokens
            _, metric = dc.damcha_attention(p, cfg, x, tokens, return_metric=True)
            y = np.einsum("bte,ehd->bthd", tokens, p[f"{role}.kernel"]) + p[f"{role}.bias"]
            return y if side is None else np.einsum("btha,btad->bthd", metric[side], y)

        q, k, v = (
            norm(project(x, "query", "q"), module.q_norm),
            norm(project(x, "key", "k"), module.k_norm),
            project(x, "value", None),
        )
        cos, sin = (t.double().numpy()[:, :, None] for t in kwargs["position_embeddings"])
        R = cos.shape[-1] // 2
        cos, sin = cos[..., :R], sin[..., :R]

        def rotate(y, cos=cos, sin=sin, R=R):
            return np.concatenate([y[..., :R] * cos - y[..., R:] * sin, y[..., R:] * cos + y[..., :R] * sin], -1)

        q, k = rotate(q), rotate(k)
        n = x.shape[1]
        keep = np.arange(n)[None] <= np.arange(n)[:, None] if decoder else np.ones((n, n), dtype=bool)
        if decoder:  # then the encoder output's keys (not rotated) and values, all visible
            c = ctx.double().numpy()
            k = np.concatenate([k, norm(project(c, "key", "k"), module.k_norm)], 1)
            v = np.concatenate([v, project(c, "value", None)], 1)
            keep = np.concatenate([keep, np.ones((n, c.shape[1]), dtype=bool)], 1)
        logits = np.where(keep, module.scaling * np.einsum("bnhd,bmhd->bhnm", q, k), -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        o = np.einsum("bhnm,bmhd->bnhd", probs / probs.sum(-1, keepdims=True), v)
        want = np.einsum("bnhd,hde->bne", o, p["output.kernel"]) + p["output.bias"]
        # Gemma's norms compute in float32 whatever the model's dtype.
        np.testing.assert_allclose(
            output[0].double().numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=layer
        )


# ---------------------------------------------------------------- training


def _loss(model, arch, kw):
    out = run(model, arch, kw)
    return out.float().square().mean()


@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_moves_gates(arch):
    model = dt.convert(build(arch, torch.float32)).train()
    kw = inputs(arch)
    opt = torch.optim.SGD([{"params": dt.damcha_parameters(model), "lr": 1.0}], lr=0.0)
    before = [p.detach().clone() for p in dt.damcha_parameters(model, generators=False)]
    _loss(model, arch, kw).backward()
    opt.step()
    after = dt.damcha_parameters(model, generators=False)
    assert len(after) == len(before) > 0
    assert all(not torch.equal(a, b) for a, b in zip(after, before))


def _grads(model, arch, kw):
    torch.manual_seed(0)  # the same dropout masks in every run (checkpoint replays them)
    model.zero_grad()
    _loss(model, arch, kw).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "arch",
    [
        *("llama", "gpt2", "qwen3", "bert", "roberta", *BERT_COPIES, "hf-vit", "bert-decoder", "opt", "clip-text"),
        *("siglip", "bart", "whisper", "t5"),
        # ALBERT calls its one attention module at every depth.
        "albert",
        # OLMo clamps the mapped q and k in place (clip_qkv): no path may keep them for backward.
        "olmo-clip",
    ],
)
def test_recompute_and_gradient_checkpointing_give_identical_gradients(arch):
    base = open_gates(dt.convert(build(arch, torch.float64), recompute=False)).train()
    kw = inputs(arch, torch.float64)
    want = _grads(base, arch, kw)
    for m in base.modules():
        if isinstance(m, dt.DamchaMaps):
            m.recompute = True
    got = _grads(base, arch, kw)
    if arch != "albert":  # ALBERT's layers do not support activation checkpointing
        base.activation_checkpointing_enable()
    got_ckpt = _grads(base, arch, kw)
    assert set(got) == set(want) == set(got_ckpt)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)
        torch.testing.assert_close(got_ckpt[n], want[n], rtol=0, atol=1e-13, msg=n)


def _saved_activation_bytes(model, arch, kw):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, arch, kw)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "vit"])
def test_recompute_keeps_activation_memory(arch):
    """Saved activations (tensors autograd keeps for backward, parameters
    excluded) of the converted model with recompute equal the original's."""
    model = build(arch, torch.float32).train()
    kw = inputs(arch, length=16)
    original = _saved_activation_bytes(model, arch, kw)
    dt.convert(model, recompute=True)
    with_recompute = _saved_activation_bytes(model, arch, kw)
    model_store = dt.convert(build(arch, torch.float32).train(), recompute=False)
    stored = _saved_activation_bytes(model_store, arch, kw)
    assert with_recompute == original
    assert stored > original  # the check can fail: without recompute the maps' inputs are kept


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_fused_qkv_recompute_and_timm_checkpointing_give_identical_gradients(reentrant):
    """timm's fused qkv Linear under recompute runs one autograd node for the
    projection and its maps (backward recomputes the q/k rows and writes the
    mixing's gradients itself): the gradients of the path that stores its
    inputs, also inside timm's gradient checkpointing (reentrant: the first
    forward runs without a graph, on the in-place path)."""
    base = open_gates(dt.convert(build("vit", torch.float64), recompute=False)).train()
    kw = inputs("vit", torch.float64)
    want = _grads(base, "vit", kw)
    for m in base.modules():
        if isinstance(m, dt.DamchaMaps):
            m.recompute = True
    got = _grads(base, "vit", kw)
    before = timm.layers.use_reentrant_ckpt()
    timm.layers.set_reentrant_ckpt(reentrant)
    try:
        base.set_grad_checkpointing(True)
        got_ckpt = _grads(base, "vit", kw)
    finally:
        timm.layers.set_reentrant_ckpt(before)
    assert set(got) == set(want) == set(got_ckpt)
    assert any(".damcha.gates." in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)
        torch.testing.assert_close(got_ckpt[n], want[n], rtol=0, atol=1e-13, msg=n)


@pytest.mark.parametrize("arch", ["vit", "llama"])
def test_fused_projection_gradients_with_a_frozen_host(arch):
    """Only the DAMCHA parameters train (the host frozen, so the first layer's
    tokens need no gradient and no projection weight does): the recompute
    path's gradients equal the stored path's."""
    grads = []
    for recompute in (False, True):
        model = open_gates(dt.convert(build(arch, torch.float64), recompute=recompute)).train()
        own = {id(p) for p in dt.damcha_parameters(model)}
        for p in model.parameters():
            p.requires_grad_(id(p) in own)
        grads.append(_grads(model, arch, inputs(arch, torch.float64)))
    want, got = grads
    assert set(got) == set(want) and all(".damcha." in n for n in want) and want
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


def test_fused_projection_double_backward():
    """A gradient penalty differentiates the fused node's backward (written
    with differentiable ops): the same second-order gradients as the path that
    stores its inputs (eager attention: the CPU sdpa kernel has no double
    backward)."""
    grads = []
    for recompute in (False, True):
        model = open_gates(dt.convert(build("llama", torch.float64, "eager"), recompute=recompute)).train()
        loss = _loss(model, "llama", inputs("llama", torch.float64, padding=False))
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, create_graph=True)
        sum(g.square().sum() for g in first).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert set(got) == set(want) and any(".damcha.gates." in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


@pytest.mark.parametrize("arch", ["vit", "llama"])
def test_fast_paths_agree_bit_for_bit(arch):
    """In training with recompute, the forward without a graph (the maps added
    in place) and with one (the fused autograd node) give the same bits: a
    reentrant checkpoint runs the first, then recomputes with the second."""
    model = open_gates(dt.convert(build(arch, torch.float32), recompute=True)).train()  # no dropout in either
    kw = inputs(arch)
    with torch.no_grad():
        want = run(model, arch, kw)
    got = run(model, arch, kw)
    assert got.requires_grad and same(got.detach(), want)


@pytest.mark.parametrize("mode", ["no-grad", "train"])
def test_fused_qkv_maps_add_no_copies(mode):
    """The converted timm ViT: without a graph the maps are added in place to
    the fused qkv output (no copy); in training one autograd node per layer,
    in store mode: the mapped output a new tensor made from the kept
    unmapped one (its q/k columns written once, y + bmm(mix, y); only its v
    columns copied), SDPA saves views of it as recipes, made again in
    backward without a copy of the output (q~ and k~ from their blocks
    alone, v read in place), one gradient buffer (no split, concatenation
    or contiguous copies of strided q/k slices; the weight and bias
    gradients written in place by each piece's GEMM, not joined), and no
    projection again. Counted per converted layer."""
    (original, original_gemms, original_copies), (damcha, damcha_gemms, damcha_copies), model = (
        aten_calls_before_and_after_convert("vit", mode)
    )
    layers = len(dt.converted_layers(model))
    E, tokens = model.embed_dim, 2 * (model.patch_embed.num_patches + model.num_prefix_tokens)
    # In training store mode's copy of the qkv output's v columns. Before:
    # a clone of the whole qkv output, and the qkv weight and bias gradients
    # joined from the pieces (("cat", 3 E), ("cat", 3 E * E)).
    extra = extra_copies(damcha_copies, original_copies)
    assert extra == ([] if mode == "no-grad" else [("copy_", tokens * E)] * layers), extra
    # The projections run exactly as often as in the original (store mode:
    # backward projects nothing again).
    recomputed = list(damcha_gemms)
    for w in original_gemms:
        recomputed.remove(w)
    assert recomputed == [], recomputed


# ------------------------------------------------------------ checkpoints


SAVE_CASES = [("llama", False), ("llama", True), ("gpt2", False), ("bert-decoder", True), ("bart", False)]
SAVE_CASES.append(("whisper", True))


@pytest.mark.parametrize("arch,share", SAVE_CASES, ids=[f"{a}-{'shared' if s else 'own'}" for a, s in SAVE_CASES])
def test_save_pretrained_round_trip(tmp_path, arch, share):
    model = open_gates(converted(arch, torch.float32, share_metric=share))
    kw = inputs(arch)
    model.save_pretrained(tmp_path)
    cls = type(model)
    loaded = dt.from_pretrained(cls, tmp_path)
    assert type(loaded) is cls
    assert set(dt.converted_layers(loaded)) == set(dt.converted_layers(model))
    with torch.no_grad():
        assert torch.equal(run(loaded, arch, kw), run(model, arch, kw))
    state = loaded.state_dict()
    gens = [k for k in state if ".generators." in k]
    if share:
        # Each side's generator is stored by one layer only (the first that has the side).
        holders: dict[str, set] = {}
        for k in gens:
            layer, rest = k.split(".damcha.generators.")
            holders.setdefault(rest.split(".")[0], set()).add(layer)
        assert holders and all(len(v) == 1 for v in holders.values())
        owners = {
            id(m.damcha.generator(side))
            for m in dt.converted_layers(loaded).values()
            for side in m.damcha.config.metric_sides
        }
        assert len(owners) == len(
            {side for m in dt.converted_layers(loaded).values() for side in m.damcha.config.metric_sides}
        )
    else:
        assert len({k.split(".damcha.")[0] for k in gens}) == len(dt.converted_layers(loaded))


def test_from_pretrained_with_an_auto_class(tmp_path):
    model = open_gates(converted("llama", torch.float32))
    model.save_pretrained(tmp_path)
    loaded = dt.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, dtype=torch.float64)
    assert type(loaded) is transformers.LlamaForCausalLM and loaded.dtype == torch.float64
    assert dt.converted_layers(loaded)
    kw = inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, "llama", kw).float(), run(model, "llama", kw), rtol=1e-5, atol=1e-5)


def test_plain_class_loading_is_loud(tmp_path, caplog):
    model = open_gates(converted("llama", torch.float32))
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert not dt.converted_layers(plain)
    assert "damcha" in caplog.text  # the unexpected DAMCHA tensors are reported


def test_from_pretrained_initialises_damcha_tensors_the_checkpoint_lacks(tmp_path):
    """A converted checkpoint without its DAMCHA tensors: transformers reports them
    "newly initialized" but initialises only module types it knows, so the gates
    held whatever the memory held (values like -5.7e19). Now gates 0 (the plain
    model's outputs) and fresh generators."""
    from safetensors.torch import load_file, save_file

    model = open_gates(converted("llama", torch.float32))
    model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if ".damcha." not in k}, file, metadata={"format": "pt"})
    loaded, info = dt.from_pretrained(transformers.LlamaForCausalLM, tmp_path, output_loading_info=True)
    assert info["missing_keys"] and all(".damcha." in k for k in info["missing_keys"])
    gates = [p for n, p in loaded.named_parameters() if ".damcha.gates." in n]
    assert gates and all(torch.equal(g, torch.zeros_like(g)) for g in gates)
    generators = [p for n, p in loaded.named_parameters() if ".damcha.generators." in n]
    assert generators and all(torch.isfinite(p).all() and p.abs().max() < 10 for p in generators)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    kw = inputs("llama")
    with torch.no_grad():
        assert torch.equal(run(loaded, "llama", kw), run(plain, "llama", kw))
    assert not isinstance(dt.from_pretrained(transformers.LlamaForCausalLM, tmp_path), tuple)


@pytest.mark.parametrize("arch", ["vit"])
def test_meta_device_recipe_leaves_the_gates_at_zero(arch):
    """torch's recipe: build on meta, convert, to_empty, reset_parameters() on
    every module that has one, then load the plain checkpoint. DamchaMaps had no
    reset_parameters, so its gates kept uninitialised memory. (timm's ViT: the
    transformers models keep non-persistent buffers, rotary frequencies and
    position ids, that this recipe does not restore, with or without DAMCHA.)"""
    plain = build(arch, torch.float32)
    with torch.device("meta"):
        model = dt.convert(build(arch, torch.float32))
    model.to_empty(device="cpu")
    torch.nn.init.constant_(next(p for n, p in model.named_parameters() if ".damcha.gates." in n), float("nan"))
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.load_state_dict(plain.state_dict(), strict=False)
    kw = inputs(arch)
    with torch.no_grad():
        assert torch.equal(run(model.eval(), arch, kw), run(plain.eval(), arch, kw))


def test_from_pretrained_refuses_a_plain_checkpoint(tmp_path):
    build("llama").save_pretrained(tmp_path)
    with pytest.raises(dc.DamchaValueError, match="expected a DAMCHA checkpoint; its config.json records no"):
        dt.from_pretrained(transformers.LlamaForCausalLM, tmp_path)


@pytest.mark.parametrize(
    "case, error, pattern",
    [
        ("none", dc.DamchaTypeError, r"`path`: expected a folder path \(str or os\.PathLike\)\. Received: path=None"),
        ("int", dc.DamchaTypeError, r"`path`: expected a folder path.*Received: path=123"),
        (
            "missing",
            dc.DamchaValueError,
            r"`path`: expected a local folder written by save_pretrained.*\(no such folder\)",
        ),
        ("empty-folder", dc.DamchaValueError, r"holding config\.json.*\(a folder without config\.json\)"),
        ("bad-json", dc.DamchaValueError, r"`path`: expected a folder whose config\.json is JSON"),
    ],
)
def test_from_pretrained_names_a_bad_path(tmp_path, case, error, pattern):
    """None or an int raised a raw TypeError; a folder that does not exist (or a
    Hub id) was told its config.json "records no 'damcha' conversion"."""
    path = {"none": None, "int": 123, "missing": tmp_path / "nothing"}.get(case, tmp_path)
    if case == "bad-json":
        (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(error, match=pattern):
        dt.from_pretrained(transformers.LlamaForCausalLM, path)


@pytest.mark.parametrize(
    "arch", ["llama", "gpt2", "bert", *BERT_COPIES, "vit", "opt", "clip-text", "clip-vision", "bart", "whisper"]
)
def test_mha_checkpoint_loads_into_converted_model(arch):
    plain = build(arch, torch.float32)
    state = plain.state_dict()
    model = dt.convert(build(arch, torch.float32, seed=9))
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(".damcha." in k for k in result.missing_keys)
    kw = inputs(arch)
    with torch.no_grad():
        assert torch.equal(run(model, arch, kw), run(plain, arch, kw))


def test_converted_state_dict_into_plain_model_strict_raises():
    state = dt.convert(build("vit")).state_dict()
    with pytest.raises(RuntimeError, match="damcha"):
        build("vit").load_state_dict(state)


@pytest.mark.parametrize("arch", ["llama", "vit", "gpt2"])
def test_deepcopy_and_pickle_keep_the_conversion(arch):
    model = open_gates(converted(arch))
    kw = inputs(arch, torch.float64)
    with torch.no_grad():
        want = run(model, arch, kw)
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for other in (twin, loaded):
            assert torch.equal(run(other, arch, kw), want)
            # The copy's maps are its own: changing them leaves the original alone.
            for p in dt.damcha_parameters(other, generators=False):
                p.zero_()
            assert not torch.equal(run(other, arch, kw), want)
        assert torch.equal(run(model, arch, kw), want)


# ------------------------------------------------------------------ LoRA


class LoraStyle(nn.Module):
    """A LoRA-style wrapper (W x + B A x), as PEFT builds around a projection."""

    def __init__(self, base: nn.Linear, rank: int = 2, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        dtype = base.weight.dtype
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=g, dtype=dtype) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank, generator=g, dtype=dtype) * 0.3)

    def forward(self, x):
        return self.base_layer(x) + x @ self.lora_A.T @ self.lora_B.T

    def merged(self) -> torch.Tensor:
        return self.base_layer.weight + self.lora_B @ self.lora_A


@pytest.mark.parametrize("order", ["lora-after-convert", "lora-before-convert"])
def test_lora_passes_through_the_map(order):
    """LoRA on q_proj/k_proj, applied before or after convert, is inside the
    map: the output equals a converted model whose weights merge the LoRA update."""
    kw = inputs("llama", torch.float64)
    model = build("llama", torch.float64)
    if order == "lora-after-convert":
        open_gates(dt.convert(model))
    attn = model.model.layers[0].self_attn
    attn.q_proj, attn.k_proj = LoraStyle(attn.q_proj, seed=1), LoraStyle(attn.k_proj, seed=2)
    if order == "lora-before-convert":
        open_gates(dt.convert(model))
    with torch.no_grad():
        got = run(model, "llama", kw)
        merged = copy.deepcopy(model)
        ma = merged.model.layers[0].self_attn
        for name in ("q_proj", "k_proj"):
            wrapper = getattr(ma, name)
            wrapper.base_layer.weight.copy_(wrapper.merged())
            setattr(ma, name, wrapper.base_layer)
        want = run(merged, "llama", kw)
        # The LoRA update matters: dropping it changes the output.
        for name in ("q_proj", "k_proj"):
            getattr(attn, name).lora_B.zero_()
        without = run(model, "llama", kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (without - got).abs().max() > 1e-4


@pytest.mark.parametrize("order", ["peft-after-convert", "peft-before-convert"])
def test_peft_lora_passes_through_the_map(order):
    """PEFT's own LoRA layers on q_proj/k_proj: the converted model equals the
    same model with the adapters merged into the weights, and the adapters and
    the gates both matter."""
    import peft

    kw = inputs("llama", torch.float64)
    model = build("llama", torch.float64)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    if order == "peft-after-convert":
        model = peft.get_peft_model(open_gates(dt.convert(model)), config)
    else:
        model = peft.get_peft_model(model, config)
        open_gates(dt.convert(model))
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        got = run(model, "llama", kw)
        q_lora = attn.q_proj(x)  # LoRA layer's forward, map included
        with model.disable_adapter():
            assert (run(model, "llama", kw) - got).abs().max() > 1e-3
        merged = copy.deepcopy(model).merge_and_unload()
        mq = merged.model.layers[0].self_attn.q_proj
        assert isinstance(mq, nn.Linear)
        torch.testing.assert_close(run(merged, "llama", kw), got, rtol=0, atol=1e-12)
        torch.testing.assert_close(mq(x), q_lora, rtol=0, atol=1e-12)
        unmapped = nn.functional.linear(x, mq.weight)
        assert (unmapped - q_lora).abs().max() > 1e-2  # the map acts on the LoRA layer's output
    assert len(dt.damcha_parameters(model)) == 2 * (2 + 2 * 2)  # 2 layers x (2 gates + 2 generators x 2)


def test_a_reset_projection_forward_is_reattached():
    """Code that resets a projection's forward (accelerate removing its hooks
    restores the old one) does not silently drop the map."""
    model = open_gates(converted("llama"))
    kw = inputs("llama", torch.float64)
    with torch.no_grad():
        want = run(model, "llama", kw)
        q_proj = model.model.layers[0].self_attn.q_proj
        del q_proj.__dict__["forward"]
        assert torch.equal(run(model, "llama", kw), want)


@pytest.mark.parametrize("hook", ["noop", "align-devices"])
def test_an_accelerate_hook_added_after_convert_keeps_one_map(hook):
    """accelerate wraps a projection's forward (keeping ours as ``_old_forward``,
    which its hook calls): the attention module's sync hook took that for a
    reset forward and installed a second map on top, so q was mapped twice
    (logits off by 3e-4 to 7e-3, silently). Removing the hooks later still
    leaves one map."""
    from accelerate.hooks import ModelHook, add_hook_to_module, attach_align_device_hook, remove_hook_from_submodules

    model = open_gates(converted("llama"))
    kw = inputs("llama", torch.float64)
    with torch.no_grad():
        want = run(model, "llama", kw)
        if hook == "noop":
            add_hook_to_module(model.model.layers[0].self_attn.q_proj, ModelHook())
        else:
            attach_align_device_hook(model, execution_device=torch.device("cpu"))
        for _ in range(2):  # the sync hook runs on every call
            torch.testing.assert_close(run(model, "llama", kw), want, rtol=0, atol=1e-12)
        remove_hook_from_submodules(model)
        torch.testing.assert_close(run(model, "llama", kw), want, rtol=0, atol=1e-12)


def test_peft_modules_to_save_of_the_maps_is_refused_by_name():
    """PEFT's ``modules_to_save=["damcha"]`` puts trainable copies of the maps
    where they were, while the projections go on reading the originals: the
    copies trained and saved while nothing read them (0 DAMCHA tensors moved in
    3 steps). The first call now raises, naming the module and the way to train them."""
    import peft

    model = converted("llama", torch.float32)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["damcha"])
    wrapped = peft.get_peft_model(model, config)
    with pytest.raises(dc.DamchaTypeError, match=r"`LlamaAttention\.damcha`.*damcha_parameters.*Received: damcha="):
        run(wrapped, "llama", inputs("llama"))


def test_a_data_parallel_replica_is_refused_naming_data_parallel(monkeypatch):
    """nn.DataParallel's replicate copies every module but not the maps'
    installation (the replicas' projections and hooks still read the original's
    maps): a replica's call is refused, naming DataParallel and the alternative,
    and the original model is unaffected. Simulated on CPU: torch's replicate
    with its broadcast replaced by plain copies (what each GPU would hold)."""
    import importlib

    replicate_module = importlib.import_module("torch.nn.parallel.replicate")  # the module, not its function

    monkeypatch.setattr(
        replicate_module,
        "_broadcast_coalesced_reshape",
        lambda tensors, devices, detach=False: [[t.detach().clone() for t in tensors] for _ in devices],
    )
    monkeypatch.setattr(replicate_module, "_get_device_index", lambda device, optional=False: 0)
    model = open_gates(converted("llama"))
    kw = inputs("llama", torch.float64)
    with torch.no_grad():
        want = run(model, "llama", kw)
        replica = replicate_module.replicate(model, [0, 1], detach=True)[1]
        with pytest.raises(
            dc.DamchaTypeError, match=r"`LlamaAttention\.damcha`.*nn\.DataParallel.*DistributedDataParallel"
        ):
            run(replica, "llama", kw)
        assert torch.equal(run(model, "llama", kw), want)


def test_a_model_converted_in_eval_mode_stays_in_eval_mode():
    """from_pretrained returns eval-mode models: the maps and their generators
    follow the attention module's mode (they stayed in training mode, so an
    eval call with gradients enabled took the training paths)."""
    model = build("llama", torch.float64).eval()
    dt.convert(model)
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    assert not any(m.training for m in dt.convert(build("vit", torch.float64).eval()).modules())


# ------------------------------------------------------- compile / export


@pytest.mark.parametrize("arch", ["llama", "gpt2", "vit-qknorm"])
def test_torch_compile_fullgraph(arch):
    model = open_gates(converted(arch, torch.float32))
    kw = inputs(arch, padding=False)
    if "attention_mask" in kw:
        kw.pop("attention_mask")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = run(model, arch, kw)
        got = run(compiled, arch, kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "vit"])
def test_torch_export(arch):
    model = open_gates(converted(arch, torch.float32))
    kw = inputs(arch, padding=False)
    if arch == "llama":
        kw = {"input_ids": kw["input_ids"], "use_cache": False}
        exported = torch.export.export(model, (), kw)
    else:
        exported = torch.export.export(model, (kw["x"],))
    with torch.no_grad():
        want = run(model, arch, kw)
        got = run(exported.module(), arch, kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- errors


class MyAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = (w(x).view(B, T, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(B, T, E))


def test_unknown_layout_is_refused_and_nothing_converted():
    model = nn.Sequential(build("vit"), MyAttention())
    with pytest.raises(
        dc.DamchaValueError,
        match=r"expected attention layers of a layout convert\(\) knows \(one of the \d+ that "
        r"damcha_torch\.supported_layouts\(\) lists; .*register_adapter\).*Received: .*MyAttention",
    ) as refused:
        dt.convert(model)
    assert not dt.converted_layers(model)
    # The layer is named near the start: the layouts' descriptions (~6,000 characters) came first.
    assert str(refused.value).index("MyAttention") < 500, str(refused.value)


def test_a_refusal_names_the_known_layers_that_cannot_be_converted_too():
    """A layer of no known layout beside layers of a known one that cannot take
    the options (tied maps on Llama's GQA): the refusal names both kinds (it
    named only the unknown one), as the Keras converter's does."""
    model = nn.Sequential(build("llama"), MyAttention())
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Received: model with layers of unknown layouts: 1 \(test_models_torch\.MyAttention\); and layers "
        r"of known layouts that cannot be converted: Cannot convert layer `0\.model\.layers\.0\.self_attn` "
        r"\(transformers-llama\): .*coupling.*; Cannot convert layer `0\.model\.layers\.1\.self_attn`",
    ):
        dt.convert(model, coupling="tied")
    assert not dt.converted_layers(model)


@pytest.mark.parametrize(
    "make",
    [
        lambda: timm.models.beit.Attention(16, num_heads=4, qkv_bias=True),  # qkv bias added with F.linear
        lambda: timm.models.pvt_v2.Attention(16, num_heads=4),  # separate q and kv, no qkv
        lambda: timm.models.nest.Attention(16, num_heads=4),  # no head_dim
        lambda: timm.models.tnt.Attention(16, 16, num_heads=4),
        # a 1x1 Conv2d qkv over channels-first maps: matched once, then failed
        # with "Cannot read the feature sizes of projection Conv2d"
        lambda: timm.models.visformer.Attention(16, num_heads=4),
    ],
    ids=["beit", "pvt_v2", "nest", "tnt", "visformer"],
)
def test_timm_attention_classes_of_other_layouts_are_refused_by_name(make):
    """timm names many attention classes ``Attention``: only the ViT layout's
    (a fused qkv it calls, num_heads, head_dim) is converted; the others are
    refused as unknown layouts (they raised AttributeError, or, like BEiT, would
    run without the maps)."""
    model = nn.Sequential(make())
    with pytest.raises(
        dc.DamchaValueError, match=r"layout convert\(\) knows.*Received: .*0 \(timm\.models\.\w+\.Attention\)"
    ):
        dt.convert(model)
    assert not dt.converted_layers(model)


def test_an_unlisted_copy_of_bart_attention_is_refused_by_name():
    """Informer's attention is "Copied from BartAttention" (its full-attention
    variant), but its decoder builds the self-attention without
    ``is_causal`` (causal through the mask), which the transformers-bart
    adapter's flags would take for a cross-attention: not listed, so refused,
    every layer named (the decoder's cross-attention included), nothing
    converted."""
    sizes = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    model = transformers.InformerModel(
        transformers.InformerConfig(
            prediction_length=4, attention_type="full", encoder_ffn_dim=16, decoder_ffn_dim=16, **sizes
        )
    )
    decoder_self = model.decoder.layers[0].self_attn
    assert decoder_self.is_decoder and not decoder_self.is_causal  # why it is not listed
    module = "informer.modeling_informer.InformerAttention"
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"unknown layouts: encoder\.layers\.0\.self_attn \(transformers\.models\.{module}\), "
        rf"decoder\.layers\.0\.encoder_attn .*, decoder\.layers\.0\.self_attn \(transformers\.models\.{module}\)$",
    ):
        dt.convert(model)
    assert not dt.converted_layers(model)


@pytest.mark.parametrize("flag", ["missing", "contradicted"])
def test_a_t5_decoder_whose_is_causal_cannot_tell_its_role_is_refused(flag):
    """Before transformers 5.15, T5's layers built the decoder's self- and
    cross-attention alike, without ``is_causal`` ("missing"); a decoder layer
    whose flag contradicts its relative bias (only the first self-attention
    has one) is not read either ("contradicted"). Refused, naming the layer,
    the flag and why; nothing converted. An encoder (no decoder) converts
    without the flag."""
    model = build("t5", torch.float32)
    first = model.decoder.block[0].layer[0].SelfAttention
    if flag == "missing":
        for m in model.decoder.modules():
            if isinstance(m, transformers.models.t5.modeling_t5.T5Attention):
                del m.is_causal
    else:
        first.is_causal = False
    received = "no is_causal attribute" if flag == "missing" else "is_causal=False"
    with pytest.raises(
        dc.DamchaValueError,
        match=r"`decoder\.block\.0\.layer\.0\.SelfAttention` \(transformers-t5\): Invalid argument `is_causal`",
    ) as error:
        dt.convert(model)
    assert "cross-attention needs maps of its own" in str(error.value)
    assert str(error.value).endswith(f"has_relative_attention_bias=True and {received}")
    assert not dt.converted_layers(model)
    encoder = transformers.T5EncoderModel(model.config)
    for m in encoder.modules():
        if isinstance(m, transformers.models.t5.modeling_t5.T5Attention):
            del m.is_causal
    assert len(dt.converted_layers(dt.convert(encoder))) == 2


def test_a_pix2struct_text_model_that_is_no_decoder_is_refused():
    """Pix2Struct's text layers build the self-attention with
    is_causal=config.is_decoder: with is_decoder False it would read as a
    cross-attention, so the text attention is refused naming the config flag."""
    model = build("pix2struct", torch.float32)
    model.decoder.config.is_decoder = False  # the text attention modules' config
    with pytest.raises(
        dc.DamchaValueError, match=r"\(transformers-pix2struct\): Invalid argument `config\.is_decoder`"
    ):
        dt.convert(model)
    assert not dt.converted_layers(model)


class MHSA(MyAttention):
    """Attention under a name without "Attention" in it (timm's convit and
    nextvit, many user models): found by its query/key projections."""


class _FusionAttention(nn.Module):
    """A wrapper around a supported layer that also attends with query/key
    projections of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = timm.layers.Attention(16, num_heads=2)
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        x = self.inner(x)
        return x + nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))


class _WrapperAttention(nn.Module):
    """A wrapper whose only attention is the supported layer it holds (an
    output projection beside it, as transformers' BertAttention)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = timm.layers.Attention(16, num_heads=2)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.attention(x))


@pytest.mark.parametrize(
    "make, layer",
    [
        (lambda: timm.models.convit.GPSA(16, num_heads=4), r"1 \(timm\.models\.convit\.GPSA\)"),
        (lambda: timm.models.convit.MHSA(16, num_heads=4), r"1 \(timm\.models\.convit\.MHSA\)"),
        (lambda: timm.models.xcit.XCA(16, num_heads=4), r"1 \(timm\.models\.xcit\.XCA\)"),
        (MHSA, r"1 \(test_models_torch\.MHSA\)"),
        (_FusionAttention, r"1 \(test_models_torch\._FusionAttention\)"),
    ],
    ids=["convit-gpsa", "convit-mhsa", "xcit-xca", "user-mhsa", "wrapper-with-own-qk"],
)
def test_attention_under_another_name_is_refused_by_name(make, layer):
    """A layer that attends with query/key projections of its own but whose
    class name has no "Attention" in it (or a wrapper of a supported layer)
    was skipped: convert() converted the ViT beside it and returned, leaving
    that layer without maps, or named no layer at all ("it has no attention
    layer convert() supports. Received: model=ConVit")."""
    model = nn.Sequential(timm.layers.Attention(16, num_heads=2), make())
    with pytest.raises(dc.DamchaValueError, match=rf"layout convert\(\) knows.*Received: .*unknown layouts: {layer}$"):
        dt.convert(model)
    assert not dt.converted_layers(model)


class _NamedProjections(nn.Module):
    """Attention under a class name without "Attention", its projections under ``names``."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, nn.Linear(16, 16))

    def forward(self, x):
        return x + sum(getattr(self, name)(x) for name in self._modules)


_PROJECTION_NAMES = [(n,) for n in dc._layout.FUSED_QK_NAMES] + list(dc._layout.QUERY_KEY_NAMES)


@pytest.mark.parametrize("names", _PROJECTION_NAMES, ids=["+".join(n) for n in _PROJECTION_NAMES])
def test_every_query_key_projection_name_marks_attention(names):
    """Each name damcha_core._layout lists for query/key projections (one table for
    both converters) makes a module attention: refused by name beside a supported
    layer; a query projection alone does not."""
    model = nn.Sequential(timm.layers.Attention(16, num_heads=2), _NamedProjections(names))
    with pytest.raises(dc.DamchaValueError, match=r"unknown layouts: 1 \(test_models_torch\._NamedProjections\)$"):
        dt.convert(model)
    assert not dt.converted_layers(model)
    if len(names) == 2:
        fine = nn.Sequential(timm.layers.Attention(16, num_heads=2), _NamedProjections(names[:1]))
        dt.convert(fine)
        assert list(dt.converted_layers(fine)) == ["0"]


class _MambaLikeMixer(nn.Module):
    """A state-space mixer (as transformers' Mamba, Jamba, Zamba): in_proj, a
    depthwise conv and out_proj, no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(16, 32)
        self.conv1d = nn.Conv1d(32, 32, 3, padding=1, groups=32)
        self.out_proj = nn.Linear(32, 16)

    def forward(self, x):
        return self.out_proj(self.conv1d(self.in_proj(x).transpose(1, 2)).transpose(1, 2))


def test_a_state_space_mixer_beside_attention_is_not_taken_for_attention():
    """Its in_proj child made convert() refuse the hybrid model ("unknown
    layouts: 1 (..._MambaLikeMixer)") where it had converted the attention."""
    model = nn.Sequential(timm.layers.Attention(16, num_heads=2), _MambaLikeMixer()).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        dt.convert(model)
        assert torch.equal(model(x), before)
    assert list(dt.converted_layers(model)) == ["0"]


def test_a_wrapper_of_a_supported_layer_converts_through_it():
    model = nn.Sequential(_WrapperAttention()).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        dt.convert(model)
        assert torch.equal(model(x), before)
    assert list(dt.converted_layers(model)) == ["0.attention"]


def _pool_reference(pool, tokens: torch.Tensor) -> np.ndarray:
    """The reference's attention (with ``proj``) of an AttentionPoolLatent: the
    latent queries over ``tokens``, each side with its own map."""
    from _models_zoo import metric_params

    c = pool.damcha.config
    H, d, E = c.num_heads, c.key_dim, c.query_dim

    def kernel(lin, cols=slice(None)):
        w, b = lin.weight.detach().numpy().T[:, cols], lin.bias.detach().numpy()[cols]
        return w.reshape(-1, H, d), b.reshape(H, d)

    p = dict(zip(("query.kernel", "query.bias"), kernel(pool.q)))
    p.update(zip(("key.kernel", "key.bias"), kernel(pool.kv, slice(0, H * d))))
    p.update(zip(("value.kernel", "value.bias"), kernel(pool.kv, slice(H * d, None))))
    p["output.kernel"] = pool.proj.weight.detach().numpy().T.reshape(H, d, -1)
    p["output.bias"] = pool.proj.bias.detach().numpy()
    p.update(metric_params(pool.damcha))
    cfg = dc.DamchaConfig(
        query_dim=E,
        context_dim=c.context_dim,
        num_heads=H,
        num_kv_heads=H,
        key_dim=d,
        output_dim=p["output.bias"].shape[0],
        use_bias=True,
        coupling=c.coupling,
    )
    latent = np.repeat(pool.latent.detach().numpy(), tokens.shape[0], axis=0)
    return dc.damcha_attention(p, cfg, latent, tokens.detach().numpy())


def test_timm_attention_pool_head_converts():
    """timm ViTs with global_pool="map" (SigLIP's) were refused whole: the
    AttentionPoolLatent head is an attention layer no adapter knew. Its latent
    queries and the tokens' keys get separate maps: exact at init, the
    reference's attention with the gates open, trained, saved and loaded."""

    def make():
        torch.manual_seed(0)
        return timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=16,
            patch_size=8,
            embed_dim=32,
            depth=1,
            num_heads=4,
            num_classes=5,
            global_pool="map",
        ).double()

    model = make().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
        dt.convert(model)
        assert torch.equal(model(x), before)
    assert sorted(dt.converted_layers(model)) == ["attn_pool", "blocks.0.attn"]
    pool = model.attn_pool
    assert pool.damcha.config.coupling == "separate"
    open_gates(model)
    seen = []
    pool.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    pool.proj.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        opened = model(x)
    tokens, got = seen
    np.testing.assert_allclose(got.numpy(), _pool_reference(pool, tokens), rtol=0, atol=1e-12)
    model.train()
    model(x).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in pool.damcha.parameters())
    model.eval()
    again = dt.convert(make()).eval()
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x), opened)


def test_timm_attention_pool_without_a_query_projection_is_refused_by_name():
    model = nn.Sequential(timm.layers.AttentionPoolLatent(16, num_heads=2, q_proj=False))
    with pytest.raises(
        dc.DamchaValueError, match=r"unknown layouts: 0 \(timm\.layers\.attention_pool\.AttentionPoolLatent\)$"
    ):
        dt.convert(model)


class _ViTAndMHA(nn.Module):
    """A timm ViT attention beside an nn.MultiheadAttention (the adapters' layers
    are planned first, the MHA replaced last)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = timm.layers.Attention(32, num_heads=4)
        self.cross = mha


@pytest.mark.parametrize(
    "mha, options, pattern",
    [
        (
            lambda: nn.MultiheadAttention(32, 4, kdim=16, vdim=16, batch_first=True),
            dict(coupling="tied"),
            r"^Invalid argument .*coupling.*\(in layer `cross`, an nn\.MultiheadAttention\)$",
        ),
        (
            lambda: nn.MultiheadAttention(64, 4, batch_first=True),
            dict(share_metric=True),
            r"^Invalid argument `metric_generator`.*\(in layer `cross`, an nn\.MultiheadAttention\)$",
        ),
    ],
    ids=["tied-coupling-needs-kdim", "shared-generator-sizes"],
)
def test_a_layer_that_cannot_be_converted_leaves_the_whole_model_as_it_was(mha, options, pattern):
    """An nn.MultiheadAttention that cannot take the options failed only after
    the other layers were converted: the model was left half converted and a
    second convert() refused it as converted already."""
    model = _ViTAndMHA(mha())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dc.DamchaValueError, match=pattern):
        dt.convert(model, **options)
    assert not dt.converted_layers(model)
    assert type(model.cross) is nn.MultiheadAttention and not hasattr(model.attn, "damcha")
    assert "forward" not in model.attn.qkv.__dict__  # no map left on the projection
    assert model.state_dict().keys() == state.keys()
    dt.convert(model)  # the same model converts with options it can take
    assert sorted(dt.converted_layers(model)) == ["attn", "cross"]


def test_replace_mha_names_the_layer_and_replaces_nothing_when_one_fails():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument .*\(in layer `1`, an nn\.MultiheadAttention\)$"):
        dt.replace_mha(model, coupling="tied")
    assert all(type(m) is nn.MultiheadAttention for m in model)


def test_a_projection_shared_by_two_attention_layers_is_refused_before_anything_is_converted():
    """Two layers calling one qkv module: its forward can carry one layer's maps,
    so the other's gates would never act. The install refused the second layer
    after converting the first ("converted twice?")."""
    first, second = timm.layers.Attention(32, num_heads=4), timm.layers.Attention(32, num_heads=4)
    second.qkv = first.qkv
    model = nn.Sequential(first, second)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `model`: expected attention layers with projection modules of their own .*"
        r"Nothing was converted\. Received: one Linear at 0\.qkv and 1\.qkv",
    ):
        dt.convert(model)
    assert not dt.converted_layers(model) and "forward" not in first.qkv.__dict__


class RegisteredAttention(MyAttention):
    """Only the registration test teaches convert this class (registration is
    process-wide; MyAttention stays unknown for the other tests)."""


def test_register_adapter_for_another_layout():
    adapter = dt.ModelAdapter(
        "test-my-attention",
        "RegisteredAttention (wq/wk)",
        lambda m: type(m) is RegisteredAttention,
        lambda m: dt.AttentionLayout(
            m.heads, m.heads, m.head_dim, 16, 16, (dt.ProjectionSite("wq", q=0), dt.ProjectionSite("wk", k=0))
        ),
    )
    if "test-my-attention" not in " ".join(dt.supported_layouts()):
        dt.register_adapter(adapter)
    with pytest.raises(
        dc.DamchaValueError, match="Invalid argument `adapter`: expected an adapter whose name is not registered yet"
    ):
        dt.register_adapter(adapter)
    with pytest.raises(dc.DamchaTypeError, match="ModelAdapter"):
        dt.register_adapter("not an adapter")
    model = nn.Sequential(RegisteredAttention()).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        dt.convert(model)
        assert torch.equal(model(x), before)
        open_gates(model)
        assert not torch.equal(model(x), before)
    assert model[0].damcha.config.coupling == "tied"


class _Checked(MyAttention):
    """Taught to convert() by a test's own adapter (one class per layout under test)."""


_CHECKED_LAYOUTS = {
    # A custom adapter's layout that does not fit its module: refused at convert(), naming the field.
    "query-features-not-the-projections": (
        lambda m: dt.AttentionLayout(2, 2, 8, 32, 16, (dt.ProjectionSite("wq", q=0), dt.ProjectionSite("wk", k=0))),
        dc.DamchaValueError,
        r"Invalid argument `query_features`: expected the input features of `wq`.*query_features=32 with "
        r"`wq` taking 16 input features",
    ),
    "no-key-site": (
        lambda m: dt.AttentionLayout(2, 2, 8, 16, 16, (dt.ProjectionSite("wq", q=0),)),
        dc.DamchaValueError,
        r"Invalid argument `sites`: expected sites that project the queries \(q\) and the keys \(k\) once each.*"
        r"roles \['q'\] in \['wq'\]",
    ),
    "a-site-of-no-role": (
        lambda m: dt.AttentionLayout(2, 2, 8, 16, 16, (dt.ProjectionSite("wq"), dt.ProjectionSite("wk", k=0))),
        dc.DamchaValueError,
        r"Invalid argument `q`: expected the feature offset of the queries.*ProjectionSite\('wq', q=None, k=None\)",
    ),
    "layout-not-a-layout": (
        lambda m: None,
        dc.DamchaTypeError,
        r"Invalid argument `layout`: expected an AttentionLayout",
    ),
    "attr-not-a-str": (
        lambda m: dt.AttentionLayout(2, 2, 8, 16, 16, (dt.ProjectionSite(0, q=0), dt.ProjectionSite("wk", k=0))),
        dc.DamchaTypeError,
        r"Invalid argument `attr`: expected the projection's attribute name.*attr=0",
    ),
}


@pytest.mark.parametrize("case", list(_CHECKED_LAYOUTS))
def test_a_custom_layout_that_does_not_fit_its_module_is_refused(case):
    """Accepted before: a query_features other than the projection's input
    converted and failed in the forward with a raw shape error; a layout
    without a key site (or with a site of no role) converted "tied" and mapped
    one side only; a layout() returning None or a site named by an int raised
    raw AttributeError/TypeError."""
    layout, error, pattern = _CHECKED_LAYOUTS[case]
    cls = type(f"_Checked_{case.replace('-', '_')}", (_Checked,), {})
    name = f"test-checked-{case}"
    if name not in " ".join(dt.supported_layouts()):
        dt.register_adapter(dt.ModelAdapter(name, case, lambda m, c=cls: type(m) is c, layout))
    model = nn.Sequential(cls())
    with pytest.raises(error, match=rf"Cannot convert layer `0` \({name}\): {pattern}"):
        dt.convert(model)
    assert not dt.converted_layers(model)


def test_a_bad_adapter_is_refused_at_construction_and_leaves_convert_working():
    """A ModelAdapter with a non-callable `matches` was registered, and every
    convert() in the process then failed with "'bool' object is not callable"."""
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `matches`: expected a callable.*matches=True"):
        dt.ModelAdapter("test-bad-matches", "bad", True, lambda m: None)
    model = nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True))
    dt.convert(model)
    assert isinstance(model[0], dt.DamchaAttention)


@pytest.mark.parametrize("pool", ["avg", "map"])
def test_timm_parallel_scaling_blocks_are_refused_by_name(pool):
    """timm's ParallelScalingBlock computes attention and MLP from one fused
    `in_proj`: with an attention-pool head (global_pool="map") convert()
    converted the head alone and left every block's attention without maps;
    with "avg" it said the model had no attention layer."""
    model = timm.create_model(
        "vit_base_patch16_xp_224",
        pretrained=False,
        global_pool=pool,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=5,
    )
    with pytest.raises(
        dc.DamchaValueError,
        match=r"unknown layouts: blocks\.0 \(timm\.models\.vision_transformer\.ParallelScalingBlock\)",
    ):
        dt.convert(model)
    assert not dt.converted_layers(model)


class FlaggedAttention(MyAttention):
    """Registered with an adapter whose layout reports `self_attention` as the
    module's flag: True, False or None (unknown)."""

    def __init__(self, self_attention):
        super().__init__()
        self.self_attention = self_attention


FLAGGED = dt.ModelAdapter(
    "test-flagged-attention",
    "FlaggedAttention (wq/wk, self_attention from the module)",
    lambda m: type(m) is FlaggedAttention,
    lambda m: dt.AttentionLayout(
        m.heads,
        m.heads,
        m.head_dim,
        16,
        16,
        (dt.ProjectionSite("wq", q=0), dt.ProjectionSite("wk", k=0)),
        self_attention=m.self_attention,
    ),
)


@pytest.mark.parametrize(
    "self_attention,coupling", [(True, "tied"), (None, "tied"), (False, "separate")], ids=["true", "none", "false"]
)
def test_layout_self_attention_decides_auto_coupling(self_attention, coupling):
    # One definition of AttentionLayout serves both ports (damcha_core._layout):
    # None (unknown, as for a Keras MultiHeadAttention) ties like True in torch too.
    assert dt.AttentionLayout is damcha_core._layout.AttentionLayout
    assert dt.ProjectionSite is damcha_core._layout.ProjectionSite
    assert dt.ModelAdapter is damcha_core._layout.ModelAdapter
    if FLAGGED.name not in " ".join(dt.supported_layouts()):
        dt.register_adapter(FLAGGED)
    model = dt.convert(nn.Sequential(FlaggedAttention(self_attention)))
    assert model[0].damcha.config.coupling == coupling


def test_errors():
    with pytest.raises(dc.DamchaValueError, match="no attention layer"):
        dt.convert(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(dc.DamchaTypeError, match="model"):
        dt.convert("llama")
    with pytest.raises(
        dc.DamchaValueError, match=r"`metric`: expected one of \('heads', 'lowrank'\)\. Received: metric='none'"
    ):
        dt.convert(build("vit"), metric="none")
    with pytest.raises(
        dc.DamchaTypeError, match=r"`metric`: expected one of \('heads', 'lowrank'\)\. Received: metric=2$"
    ):
        dt.convert(build("vit"), metric=2)
    with pytest.raises(dc.DamchaValueError, match="coupling"):
        dt.convert(build("vit"), coupling="both")
    with pytest.raises(dc.DamchaTypeError, match="share_metric"):
        dt.convert(build("vit"), share_metric=1)
    model = dt.convert(build("llama"))
    with pytest.raises(dc.DamchaValueError, match="already converted"):
        dt.convert(model)
    mha = dt.convert(build("mha"))
    with pytest.raises(dc.DamchaValueError, match="already converted"):
        dt.convert(mha)
    # Tied maps need as many key heads as query heads: the layer is named.
    with pytest.raises(dc.DamchaValueError, match=r"model\.layers\.0\.self_attn.*coupling"):
        dt.convert(build("llama"), coupling="tied")
    # Sharing needs equal sizes across layers.
    mixed = nn.ModuleList(
        [
            build("vit"),
            timm.create_model(
                "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=48, depth=1, num_heads=4
            ),
        ]
    )
    with pytest.raises(dc.DamchaValueError, match="share_metric"):
        dt.convert(mixed, share_metric=True)
    assert not dt.converted_layers(mixed)


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("llama", {"q", "k"}),
        ("llama-mha", {"qk"}),
        ("gpt2", {"qk"}),
        ("bert-decoder", {"qk", "q", "k"}),
        ("vit", {"qk"}),
        ("hf-vit", {"qk"}),
        ("electra", {"qk"}),
        ("opt", {"qk"}),
        ("clip-text", {"qk"}),
        ("clip-vision", {"qk"}),
        ("bart", {"qk", "q", "k"}),  # self-attention tied, cross-attention separate
        ("whisper", {"qk", "q", "k"}),
    ],
)
def test_auto_coupling(arch, expected):
    model = converted(arch)
    sides = set()
    for m in dt.converted_layers(model).values():
        sides |= set(m.damcha.config.metric_sides)
    assert sides == expected


def test_share_metric_shares_one_generator_per_side():
    model = converted("vit", share_metric=True)
    gens = {id(m.damcha.generator("qk")) for m in dt.converted_layers(model).values()}
    assert len(gens) == 1
    assert len(dt.damcha_parameters(model, gates=False)) == 2  # weight and bias, once
