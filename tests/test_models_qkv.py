"""damcha_torch.convert on transformers models whose attention has one fused
qkv projection (backends/torch/_models_layouts_qkv.py): GPT-NeoX, Persimmon,
BLOOM, Falcon (its three splits), GPTBigCode (multi-query and per head), MPT,
DBRX, ModernBERT.

Each host's split of its projection's output is written out here from the
host's own code (``_split_heads``, ``view(..., H, 3 * d)``), independently of
the adapters' ``ProjectionSite``s, and every check reads the heads through it:
- exact at init, bit for bit;
- with the gates open, the query and key heads each layer's projection gives
  are the NumPy reference's maps of the unconverted heads, to 1e-12, and the
  value heads are untouched;
- causal LMs: cached greedy generation equals uncached and moves away from
  the unconverted model's;
- GPT-NeoX (partial RoPE) and Falcon's grouped split (GQA, RoPE): each whole
  layer equals ``damcha_core.damcha_attention`` with the host's weights read
  through the split, so the heads the maps mix are the heads attention uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kernel import KernelCalls
from _models_zoo import VOCAB, metric_params, open_gates

import damcha_core as dc
import damcha_torch as dt
from damcha_core._layout import ProjectionSite
from damcha_core._reference import apply_map

dt.ensure_torchvision_importable()
transformers = pytest.importorskip("transformers")

E, H = 32, 4
D = E // H


def _per_head(y, H, G):
    """(..., H, 3, d): each head's query, key, value (GPT-NeoX, Persimmon, BLOOM, ...)."""
    heads = y.reshape(*y.shape[:-1], H, 3, D)
    return heads[..., 0, :], heads[..., 1, :], heads[..., 2, :]


def _by_role(y, H, G):
    """The H query heads, then G key heads, then G value heads (MPT, DBRX, ModernBERT, multi-query)."""
    q, k, v = np.split(y, [H * D, (H + G) * D], axis=-1)
    return (t.reshape(*t.shape[:-1], -1, D) for t in (q, k, v))


def _per_group(y, H, G):
    """Falcon's new decoder architecture: per key/value group, its H/G queries, its key, its value."""
    heads = y.reshape(*y.shape[:-1], G, H // G + 2, D)
    q = heads[..., : H // G, :].reshape(*y.shape[:-1], H, D)
    return q, heads[..., H // G, :], heads[..., H // G + 1, :]


def _falcon(**kw):
    return transformers.FalconForCausalLM(
        transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=E, num_hidden_layers=2, num_attention_heads=H, pad_token_id=0, **kw
        )
    )


def _bigcode(multi_query):
    cfg = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=E, n_layer=2, n_head=H, multi_query=multi_query, pad_token_id=0
    )
    cfg.bos_token_id = cfg.eos_token_id = 1
    return transformers.GPTBigCodeForCausalLM(cfg)


# name -> (build, projection attribute, split, key/value heads, causal LM)
HOSTS = {
    "gpt-neox": (
        lambda: transformers.GPTNeoXForCausalLM(
            transformers.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=E,
                num_hidden_layers=2,
                num_attention_heads=H,
                intermediate_size=37,
                rotary_pct=0.5,  # Pythia's 0.25 would leave one channel pair of 8
                pad_token_id=0,
            )
        ),
        "query_key_value",
        _per_head,
        H,
        True,
    ),
    "persimmon": (
        lambda: transformers.PersimmonForCausalLM(
            transformers.PersimmonConfig(
                vocab_size=VOCAB,
                hidden_size=E,
                num_hidden_layers=2,
                num_attention_heads=H,
                intermediate_size=37,
                qk_layernorm=True,
                pad_token_id=0,
            )
        ),
        "query_key_value",
        _per_head,
        H,
        True,
    ),
    "bloom": (
        lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(vocab_size=VOCAB, hidden_size=E, n_layer=2, n_head=H, pad_token_id=0)
        ),
        "query_key_value",
        _per_head,
        H,
        True,
    ),
    "falcon": (lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2), "query_key_value", _per_group, 2, True),
    "falcon-mqa": (
        lambda: _falcon(new_decoder_architecture=False, multi_query=True),
        "query_key_value",
        _by_role,
        1,
        True,
    ),
    "falcon-alibi": (
        lambda: _falcon(new_decoder_architecture=False, multi_query=False, alibi=True),
        "query_key_value",
        _per_head,
        H,
        True,
    ),
    "gpt-bigcode-mqa": (lambda: _bigcode(True), "c_attn", _by_role, 1, True),
    "gpt-bigcode": (lambda: _bigcode(False), "c_attn", _per_head, H, True),
    "mpt": (
        lambda: transformers.MptForCausalLM(
            transformers.MptConfig(
                vocab_size=VOCAB, d_model=E, n_layers=2, n_heads=H, attn_config={"clip_qkv": 0.6}, pad_token_id=0
            )
        ),
        "Wqkv",
        _by_role,
        H,
        True,
    ),
    "dbrx": (
        lambda: transformers.DbrxForCausalLM(
            transformers.DbrxConfig(
                vocab_size=VOCAB,
                d_model=E,
                n_layers=2,
                n_heads=H,
                attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 2, "moe_top_k": 1},
                pad_token_id=0,
            )
        ),
        "Wqkv",
        _by_role,
        2,
        True,
    ),
    "modernbert": (
        lambda: transformers.ModernBertModel(
            transformers.ModernBertConfig(
                vocab_size=VOCAB,
                hidden_size=E,
                num_hidden_layers=2,
                num_attention_heads=H,
                intermediate_size=37,
                global_attn_every_n_layers=2,
                local_attention=4,  # the first layer's sliding window is narrower than the tokens
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                cls_token_id=1,
                sep_token_id=2,
            )
        ),
        "Wqkv",
        _by_role,
        H,
        False,
    ),
}


def _build(name, dtype):
    torch.manual_seed(0)
    model = HOSTS[name][0]()
    with torch.no_grad():  # weights far from 0, so that the maps move the greedy tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(dtype).eval()


def _ids(batch=2, n=9):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(3))


def _out(model, **kw):
    out = model(**kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", list(HOSTS))
def test_fused_qkv_hosts_convert(name):
    """Exact at init bit for bit (a padded batch); with the gates open each
    layer's query and key heads are the reference's maps of the unconverted
    ones, its value heads untouched; causal LMs: cached greedy generation
    equal to uncached, away from the unconverted model's."""
    _, attr, split, G, causal = HOSTS[name]
    model = _build(name, torch.float64)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        before = _out(model, input_ids=ids, attention_mask=mask)
        if causal:
            opts = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
            opts |= {"return_dict_in_generate": True, "output_logits": True}
            unconverted = _build(name, torch.float32).generate(ids[:1], use_cache=True, **opts)
        dt.convert(model)
        # (ALiBi hosts give the padded rows NaN, converted or not.)
        torch.testing.assert_close(
            _out(model, input_ids=ids, attention_mask=mask), before, rtol=0, atol=0, equal_nan=True
        )
    layers = dt.converted_layers(model)
    assert len(layers) == 2
    open_gates(model)

    seen = {}
    for layer_name, module in layers.items():
        projection = getattr(module, attr)

        def hook(mod, args, output, layer_name=layer_name):
            seen[layer_name] = (args[0], output)

        projection.register_forward_hook(hook)
    with torch.no_grad():
        after = _out(model, input_ids=ids)
    assert set(seen) == set(layers)
    for layer_name, (x, y) in seen.items():
        module = layers[layer_name]
        projection, maps = getattr(module, attr), module.damcha
        cfg, params = maps.config, metric_params(maps)
        assert (cfg.num_heads, cfg.num_kv_heads) == (H, G)
        # The unconverted projection: the host's Linear (Falcon's FalconLinear) computed plainly.
        y0 = torch.nn.functional.linear(x, projection.weight, projection.bias).detach().numpy()
        x = x.numpy()
        q0, k0, v0 = split(y0, H, G)
        q, k, v = split(y.numpy(), H, G)
        want_q = apply_map(params, cfg, dc.side_of(cfg, "q"), x, q0)
        want_k = apply_map(params, cfg, dc.side_of(cfg, "k"), x, k0)
        assert np.abs(want_q - q0).max() > 1e-3 and np.abs(want_k - k0).max() > 1e-3  # the maps are open
        np.testing.assert_allclose(q, want_q, rtol=0, atol=1e-12, err_msg=layer_name)
        np.testing.assert_allclose(k, want_k, rtol=0, atol=1e-12, err_msg=layer_name)
        np.testing.assert_array_equal(v, v0)
    assert (after - _out_unconverted(name, ids)).abs().max() > 1e-3
    if causal:
        model = model.float()
        with torch.no_grad():
            cached = model.generate(ids[:1], use_cache=True, **opts)
            plain = model.generate(ids[:1], use_cache=False, **opts)
        assert torch.equal(cached.sequences, plain.sequences)
        for a, b, c in zip(cached.logits, plain.logits, unconverted.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert (a - c).abs().max() > 1e-3


def _out_unconverted(name, ids):
    with torch.no_grad():
        return _out(_build(name, torch.float64), input_ids=ids)


def _canonical(module, attr, split, G):
    """The layer's weights as the reference's parameters, read through the host's split."""
    projection, maps = getattr(module, attr), module.damcha
    w = projection.weight.detach().double().numpy().T  # (E, F)
    b = projection.bias.detach().double().numpy() if projection.bias is not None else np.zeros(w.shape[1])
    p = {}
    for role, kernel, bias in zip(("query", "key", "value"), split(w, H, G), split(b, H, G)):
        p[f"{role}.kernel"], p[f"{role}.bias"] = kernel, bias
    dense = module.dense
    p["output.kernel"] = dense.weight.detach().double().numpy().T.reshape(H, D, E)
    p["output.bias"] = dense.bias.detach().double().numpy() if dense.bias is not None else np.zeros(E)
    cfg = maps.config
    config = dc.DamchaConfig(
        query_dim=E, num_heads=H, num_kv_heads=G, key_dim=D, use_bias=True, metric=cfg.metric, coupling=cfg.coupling
    )
    p.update(metric_params(maps))
    return p, config


def _layer_and_reference(name, model, module, split, x):
    """(the converted RoPE layer ``module`` of ``model`` on x, the reference's
    damcha_attention on x with the layer's weights read through ``split``):
    causal, rotated by the host's (partial) RoPE after the maps, the angles in
    float64 (the host's rotary module computes them in float32)."""
    _, attr, _, G, _ = HOSTS[name]
    emb = (model.gpt_neox if name == "gpt-neox" else model.transformer).rotary_emb
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * emb.inv_freq.double()[None]
    angles = torch.cat([angles, angles], dim=-1)[None]
    positions = {"position_embeddings": (angles.cos(), angles.sin()), "attention_mask": None}
    with torch.no_grad():
        got = module(x, **positions)[0] if name == "gpt-neox" else module(x, alibi=None, **positions)[0]
    p, cfg = _canonical(module, attr, split, G)
    want = dc.damcha_attention(p, cfg, x.numpy(), causal=True, rotary=dc.Rotary(emb.inv_freq.double().numpy()))
    return got.numpy(), want


@pytest.mark.parametrize("name", ["gpt-neox", "falcon"])
def test_fused_qkv_layers_equal_reference(name):
    """Each whole layer (gates open) equals the reference's DAMCHA attention
    with the host's weights read through its split, causal, rotated by the
    host's (partial) RoPE after the maps."""
    model = open_gates(dt.convert(_build(name, torch.float64)))
    x = torch.randn(2, 7, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer_name, module in dt.converted_layers(model).items():
        got, want = _layer_and_reference(name, model, module, HOSTS[name][2], x)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=layer_name)


def test_a_wrong_split_fails_the_reference_check():
    """The check above is not blind to the head order: reading Falcon's grouped
    output as if it were laid out role by role breaks it."""
    model = open_gates(dt.convert(_build("falcon", torch.float64)))
    module = next(iter(dt.converted_layers(model).values()))
    x = torch.randn(1, 5, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, want = _layer_and_reference("falcon", model, module, _by_role, x)
    assert np.abs(got - want).max() > 1e-3


# Hosts whose query_key_value holds each head's query, key and value in turn
# (groups = H), and Falcon's two: its FalconLinear (a matmul, then the bias
# added: not F.linear's bits) keeps the general path, as does a group of
# several query heads (its new decoder architecture, GQA: separate maps).
INTERLEAVED = [
    ("gpt-neox", "auto"),
    ("gpt-neox", "separate"),
    ("bloom", "auto"),
    ("persimmon", "auto"),
    ("falcon-alibi", "auto"),
    ("falcon", "auto"),
]


@pytest.mark.parametrize(("name", "coupling"), INTERLEAVED, ids=[f"{n}-{c}" for n, c in INTERLEAVED])
def test_fused_qkv_training_step_moves_the_gates(name, coupling):
    """A training step of a converted host with an interleaved qkv: each
    projection and its maps are one fused node where each run of the output
    holds one head of each role (with recompute; the general path
    checkpointed the projection and every op of the maps), the step reaches
    every gate, and its gradients equal those of the same step without
    recompute (the general path's autograd), every parameter, to 1e-12."""
    grads = []
    for recompute in (True, False):
        model = _build(name, torch.float64).train()
        model = open_gates(dt.convert(model, recompute=recompute, coupling=coupling))
        nodes: list[str] = []
        hooks = [
            layer.query_key_value.register_forward_hook(
                lambda m, a, out, nodes=nodes: nodes.append(type(out.grad_fn).__name__)
            )
            for layer in dt.converted_layers(model).values()
        ]
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
        for hook in hooks:
            hook.remove()
        fused = recompute and not name.startswith("falcon")
        assert (nodes == ["FusedProjectionMapsBackward"] * 2) == fused, nodes
        gates = {n: p.grad for n, p in model.named_parameters() if ".gates." in n}
        assert len(gates) == 2 * (2 if coupling == "separate" or name == "falcon" else 1)
        assert all(g is not None and g.abs().max() > 0 for g in gates.values())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=1e-12, msg=n)


# (host, coupling, kernel calls per layer): Falcon's new decoder architecture has
# several query heads in each run, which the kernel's one head per run does not read.
INTERLEAVED_KERNEL = [
    ("gpt-neox", "auto", 1),
    ("gpt-neox", "separate", 2),
    ("bloom", "auto", 1),
    ("persimmon", "auto", 1),
    ("falcon-alibi", "auto", 1),
    ("gpt-bigcode", "auto", 1),
    ("falcon", "auto", 0),
]


@pytest.mark.parametrize(
    ("name", "coupling", "calls"), INTERLEAVED_KERNEL, ids=[f"{n}-{c}" for n, c, _ in INTERLEAVED_KERNEL]
)
def test_interleaved_site_maps_few_tokens_with_the_kernel(name, coupling, calls, monkeypatch):
    """In eval mode without a graph (a generate step), an interleaved site's
    few tokens (at most 16) are mapped in place by the C kernel with the heads
    a run apart, one call per side (a tied query and key: one call for both
    blocks), where the torch ops mapped them; the outputs equal the torch
    ops' (float64, 1e-12)."""
    from damcha_torch import _functional as fn

    if fn._HEADMIX is None:
        pytest.skip("damcha_torch._headmix not installed (built without a C compiler)")
    model = open_gates(dt.convert(_build(name, torch.float64), coupling=coupling))
    ids = _ids(batch=1, n=7)
    recorder = KernelCalls()
    monkeypatch.setattr(fn, "_HEADMIX", recorder)
    with torch.no_grad():
        got = _out(model, input_ids=ids)
    assert recorder.calls == 2 * calls  # two layers
    monkeypatch.setattr(fn, "_HEADMIX", None)
    with torch.no_grad():
        want = _out(model, input_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - _out_unconverted(name, ids)).abs().max() > 1e-3  # the maps are on


def test_gpt_bigcode_cross_attention_is_refused_by_name():
    """GPTBigCode's cross-attention (its c_attn split gives one key and one value
    head) is refused, naming the layer and why, and nothing is converted."""
    cfg = transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=E, n_layer=1, n_head=H, multi_query=False)
    module = transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention(
        cfg, is_cross_attention=True, layer_idx=0
    )
    holder = torch.nn.Sequential(module)
    with pytest.raises(dc.DamchaValueError, match=r"Cannot convert layer `0` \(transformers-gpt-bigcode\).*one key"):
        dt.convert(holder)
    assert not dt.converted_layers(holder)


@pytest.mark.parametrize(
    ("site", "pattern"),
    [
        (ProjectionSite("qkv", q=0, k=D, groups=3), r"groups=3 for `qkv` with 96 features, 4 query heads"),
        (ProjectionSite("qkv", q=0, k=3 * D, groups=H), r"Invalid argument `k`.*\(24 features\).*k=24"),
        (ProjectionSite("qkv", q=0, k=0, groups=H), r"Invalid argument `k`.*after the other role's.*k=0"),
    ],
    ids=["groups-not-dividing", "k-outside-run", "overlap"],
)
def test_a_grouped_site_that_does_not_fit_is_refused_before_converting(site, pattern):
    """An adapter's grouped site that does not fit its projection is refused at
    convert(), naming the argument and the value, and nothing is converted."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(E, 3 * E)

        def forward(self, x):
            return self.qkv(x)

    name = f"grouped-test-{site.groups}-{site.q}-{site.k}"
    dt.register_adapter(
        dt.ModelAdapter(
            name,
            "a test layout",
            lambda m: type(m) is Attention,
            lambda m: dt.AttentionLayout(H, H, D, E, E, (site,)),
        )
    )
    try:
        model = torch.nn.Sequential(Attention())
        with pytest.raises(dc.DamchaValueError, match=pattern):
            dt.convert(model)
        assert not dt.converted_layers(model)
    finally:
        from damcha_torch import _models

        _models._ADAPTERS[:] = [a for a in _models._ADAPTERS if a.name != name]


def test_interleaved_site_compiles_with_its_in_place_map():
    """torch.compile (fullgraph, AOTAutograd's functionalised graph) of a
    converted GPT-NeoX without a graph: the in-place map of its interleaved
    query_key_value (strided head views of the output) traces, and the
    compiled logits equal the eager ones. A view made by ``as_strided`` was
    refused there (AOTAutograd cannot functionalise a write through it)."""
    model = open_gates(dt.convert(_build("gpt-neox", torch.float32)))
    ids = _ids()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
