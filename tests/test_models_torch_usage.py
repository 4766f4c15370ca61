"""damcha_torch.convert under the host libraries' other ways of running a model:
assisted decoding, sliding-window attention, bfloat16 autocast, generation
that returns attention weights, torch.compile (static-cache generation and
training), PEFT LoRA/DoRA merging, torch.func.functional_call, dynamic
quantization and timm's forward_intermediates.

Each test compares the converted model (gates open, so DAMCHA differs from
plain attention) with an independent computation: the unconverted model at
gates 0, eager against compiled, the NumPy reference, or the host's own other
way of computing the same thing; and checks that the maps matter there, so
that a path which dropped them would fail."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from _models_zoo import (
    _dec,
    build,
    capture,
    inputs,
    layer_params,
    metric_params,
    open_gates,
    run,
    transformers,
)
from torch import nn

import damcha_core as dc
import damcha_core._reference
import damcha_torch as dt


def _no_dropout(model: nn.Module) -> nn.Module:
    """GPT-2 trains with dropout: eager and compiled runs draw different masks."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _greedy(**extra) -> dict:
    return {"do_sample": False, "pad_token_id": 0, **extra}


def _reference_site(maps: dt.DamchaMaps, site, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """The NumPy reference's map of one projection output y (..., F) of the
    tokens x (..., E): each mapped block L(t) y, the other columns as they are."""
    cfg, params = maps.config, metric_params(maps)
    x, out = x.detach().double().numpy(), y.detach().double().numpy().copy()
    for role, offset in site.roles():
        side = dc.side_of(cfg, role)
        if side is None:  # the keys under coupling "query"
            continue
        S, d = cfg.side_heads(side), cfg.key_dim
        block = out[..., offset : offset + S * d].reshape(*out.shape[:-1], S, d)
        mapped = damcha_core._reference.apply_map(params, cfg, side, x, block)
        out[..., offset : offset + S * d] = mapped.reshape(*out.shape[:-1], S * d)
    return out


# ------------------------------------------------------- assisted decoding


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_assisted_decoding_equals_greedy(arch):
    """generate(assistant_model=...) verifies the assistant's candidates with
    one forward of several new tokens through the target's cache (mapped keys
    of earlier steps, a multi-token chunk mapped now) and crops the cache after
    a rejection: its tokens and logits are the converted target's greedy ones.
    The assistant is another converted model (other weights, other gates), so
    candidates are rejected and the cache is cropped."""
    target = open_gates(dt.convert(build(arch, torch.float64)), scale=0.8)
    assistant = open_gates(dt.convert(build(arch, torch.float64, seed=3)), seed=7, scale=0.8)
    ids = inputs(arch, torch.float64, batch=1, length=5, padding=False)["input_ids"]  # assisted decoding: batch 1
    opts = _greedy(max_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = target.generate(input_ids=ids, **opts)
        got = target.generate(input_ids=ids, assistant_model=assistant, **opts)
        proposed = assistant.generate(input_ids=ids, **opts)
        for p in dt.damcha_parameters(target, generators=False):
            p.zero_()
        closed = target.generate(input_ids=ids, **opts)
    assert torch.equal(got.sequences, want.sequences)
    # generate returns float32 logits (of float64 ones here)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-6)
    # The assistant disagrees somewhere, so verification had candidates to reject;
    # and the maps move the target's logits far beyond the tolerance.
    assert not torch.equal(proposed.sequences, want.sequences)
    assert (torch.stack(closed.logits) - torch.stack(want.logits)).abs().max() > 1e-4


# ------------------------------------------------------------ sliding window


def _mistral(window: int | None, attn: str) -> nn.Module:
    torch.manual_seed(0)
    config = _dec(transformers.MistralConfig, sliding_window=window, attn_implementation=attn)
    return transformers.MistralForCausalLM(config).double().eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_mistral_generation(attn, cache):
    """Mistral with a window of 3 tokens, generating 6 after a prompt of 5 (the
    cache drops keys that left the window; static: StaticSlidingWindowLayer).
    At gates 0 the converted model's cached generation is the unconverted
    one's bit for bit; with the gates open its cached tokens equal uncached
    generation and each step's logits equal the full forward's."""
    P, new = 5, 6
    model = _mistral(3, attn)
    ids = inputs("mistral", torch.float64, length=P, padding=False)["input_ids"]
    opts = _greedy(max_new_tokens=new, return_dict_in_generate=True, output_logits=True)
    if cache == "static":
        opts["cache_implementation"] = "static"
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **opts)
        dt.convert(model)
        closed = model.generate(input_ids=ids, **opts)
        open_gates(model, scale=0.8)
        cached = model.generate(input_ids=ids, **opts)
        uncached = model.generate(input_ids=ids, **{**opts, "use_cache": False})
        full = model(cached.sequences).logits
        model.config.sliding_window = None  # the same weights attending to every earlier token
        unwindowed = model(cached.sequences).logits
    assert torch.equal(closed.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(closed.logits, plain.logits))
    assert torch.equal(cached.sequences, uncached.sequences)
    steps = torch.stack(cached.logits, 1)  # generate returns float32 logits
    torch.testing.assert_close(steps, full[:, P - 1 : -1].float(), rtol=0, atol=1e-6)
    # Both can fail: the maps move the logits, and the window is active at this length.
    assert (steps - torch.stack(plain.logits, 1)).abs().max() > 1e-3
    assert (full - unwindowed).abs().max() > 1e-3


# ------------------------------------------------------- bfloat16 autocast


def _dtypes(out) -> list:
    """The dtype of every tensor a transformers model output holds (the cache's keys and values too)."""
    found = []
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            found.append((key, value.dtype))
        elif isinstance(value, tuple):
            found += [(f"{key}.{i}", t.dtype) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
        elif hasattr(value, "layers"):  # a Cache
            found += [(f"{key}.{i}", (layer.keys.dtype, layer.values.dtype)) for i, layer in enumerate(value.layers)]
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen3", "bert", "hf-vit"])
def test_bf16_autocast_forward(arch):
    """A float32 converted model under torch.autocast("cpu", bfloat16): every
    output tensor (logits, hidden states, cached keys and values) has the
    dtype the unconverted model gives under autocast, and the output's error
    against float32 is the host's own bfloat16 error (at most twice the
    unconverted model's under autocast), while the maps move the float32
    output by several times that (so maps skipped or computed in bfloat16
    would fail). Gates wide open (scale 4) for that margin."""
    model = build(arch, torch.float32)
    kw = inputs(arch)
    extra = {"output_hidden_states": True, **({"use_cache": True} if arch in ("llama", "qwen3") else {})}

    def call():
        with torch.no_grad():
            out = model(**kw, **extra)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = model(**kw, **extra)
        key = "logits" if "logits" in out else "last_hidden_state"
        return out[key], low[key], _dtypes(low)

    plain32, plain16, plain_dtypes = call()
    open_gates(dt.convert(model), scale=4.0)
    ours32, ours16, our_dtypes = call()
    assert our_dtypes == plain_dtypes
    assert any(dtype == torch.bfloat16 for _, dtype in our_dtypes)  # autocast was on
    host_error = (plain16.float() - plain32).abs().max()
    assert (ours16.float() - ours32).abs().max() <= 2 * host_error
    assert (ours32 - plain32).abs().max() >= 3 * host_error


# --------------------------------------------------- generate's attentions


def _rotary(model: nn.Module) -> dc.Rotary:
    emb = model.model.rotary_emb
    return dc.Rotary(emb.inv_freq.double().numpy(), scaling=float(emb.attention_scaling))


def _tokens(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


# GPT-2 (learned positions) to float64 precision; Llama's rotary module computes
# its cos/sin in float32, so the float64 reference rotates differently by ~1e-7.
ATTENTION_TOL = {"gpt2": 1e-12, "llama": 1e-6}


@pytest.mark.parametrize("arch", list(ATTENTION_TOL))
def test_generate_output_attentions_are_damcha_weights(arch):
    """generate(output_attentions=True, return_dict_in_generate=True) returns,
    for the prompt and every cached step, DAMCHA's attention probabilities:
    the NumPy reference's weights (q~ k~^T of the mapped heads, causal) over
    the whole sequence each layer saw, row by row. The plain model's weights differ."""
    model = open_gates(dt.convert(build(arch, torch.float64, "eager")), scale=0.8)
    ids = inputs(arch, torch.float64, length=5, padding=False)["input_ids"]
    P, new = ids.shape[1], 4
    opts = _greedy(max_new_tokens=new, output_attentions=True, return_dict_in_generate=True)
    calls = capture(model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, **opts)
    assert len(out.attentions) == new
    for i, (name, module) in enumerate(dt.converted_layers(model).items()):
        # One call per step: the prompt, then one token at a time.
        x = torch.cat([_tokens(args, kwargs) for args, kwargs, _ in calls[name]], dim=1).double().numpy()
        p, cfg = layer_params(arch, module)
        rotary = _rotary(model) if arch == "llama" else None
        _, weights = dc.damcha_attention(p, cfg, x, causal=True, return_weights=True, rotary=rotary)
        for step, per_layer in enumerate(out.attentions):
            got = per_layer[i]
            rows = slice(0, P) if step == 0 else slice(P + step - 1, P + step)
            want = weights[:, :, rows, : got.shape[-1]]
            np.testing.assert_allclose(
                got.numpy(), want, rtol=0, atol=ATTENTION_TOL[arch], err_msg=f"{name} step {step}"
            )
    with torch.no_grad():
        for p in dt.damcha_parameters(model, generators=False):
            p.zero_()
        plain = model.generate(input_ids=ids, **opts)
    assert (plain.attentions[0][-1] - out.attentions[0][-1]).abs().max() > 1e-3


# ------------------------------------------------------------- torch.compile


# aot_eager: Dynamo's trace and AOTAutograd's functionalised graph (where the
# maps' hooks, their in-place adds and the checkpoint would break), run by
# eager kernels. Inductor compiles the same graph (measured: same tokens and
# gradients) but takes 15-35 s per model on this machine's CPUs.
BACKEND = "aot_eager"


def _about_damcha(record: list) -> list[str]:
    """The warnings of ``record`` that name DAMCHA's code. Dynamo warned on
    every compiled forward of a converted model about an ``lru_cache`` it
    traced through (_models_fused.py), an alarm about nothing of the user's."""
    return [str(w.message) for w in record if "_models" in str(w.message) or "damcha" in w.filename]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_generate_with_static_cache(arch):
    """transformers' recipe for compiled decoding (model.forward compiled with
    fullgraph=True, cache_implementation="static"): the eager model's tokens,
    and logits within float32 rounding, from a compiled graph that really ran."""
    model = open_gates(dt.convert(build(arch, torch.float32)), scale=0.8)
    ids = inputs(arch, length=5, padding=False)["input_ids"]
    opts = _greedy(max_new_tokens=5, cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = model.generate(input_ids=ids, **opts)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        eager_forward = model.forward
        model.forward = torch.compile(model.forward, backend=BACKEND, fullgraph=True)
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                got = model.generate(input_ids=ids, **opts)
        finally:
            model.forward = eager_forward
        for p in dt.damcha_parameters(model, generators=False):
            p.zero_()
        plain = model.generate(input_ids=ids, **opts)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not _about_damcha(record)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
    # The maps move the logits by 10x the tolerance above (GPT-2's tiny model: 5e-4).
    assert (torch.stack(plain.logits) - torch.stack(want.logits)).abs().max() > 1e-4


def _grads(model: nn.Module, call) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    call().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "arch,recompute",
    [("llama", True), ("gpt2", True), ("vit", True), ("llama", False)],
    ids=["llama", "gpt2", "vit", "llama-no-recompute"],
)
def test_compiled_training_gradients_equal_eager(arch, recompute):
    """torch.compile(model) in training (recompute: the maps' checkpoint is traced
    too): every gradient, the DAMCHA gates' and generators' included, equals
    the eager model's (float64)."""
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float64), recompute=recompute))).train()
    kw = inputs(arch, torch.float64, padding=False)
    kw.pop("attention_mask", None)
    want = _grads(model, lambda: run(model, arch, kw))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _grads(model, lambda: run(compiled, arch, kw))
        model.eval()  # and the forward without a graph (the maps added in place)
        with torch.no_grad():
            torch.testing.assert_close(run(compiled, arch, kw), run(model, arch, kw), rtol=0, atol=1e-12)
    assert not _about_damcha(record)
    assert set(got) == set(want)
    own = {n for n, p in model.named_parameters() if any(p is q for q in dt.damcha_parameters(model))}
    assert own <= set(want) and any(".gates." in n for n in own) and any(".generators." in n for n in own)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-12, msg=n)
    assert all(want[n].abs().max() > 0 for n in own)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "vit"])
def test_jit_trace_in_training_checks_saves_and_trains(arch, tmp_path):
    """torch.jit.trace of a converted model in training mode passes the tracer's
    check (a second trace under no_grad: the sites took the fused node with
    gradients and the in-place map without, so the graphs differed, as the
    unconverted model's do not), torch.jit.save/load writes it, and the traced
    and loaded graphs give the eager model's outputs and every gradient
    (float64)."""
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float64)))).train()
    kw = inputs(arch, torch.float64, padding=False)
    names = list(kw)

    class Positional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return run(self.model, arch, dict(zip(names, args)))

    wrapper = Positional()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(wrapper, tuple(kw.values()))
    torch.jit.save(traced, tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")

    def outputs_and_grads(module: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        params = list(module.parameters())
        out = module(*kw.values())
        return out.detach(), list(torch.autograd.grad(out.square().mean(), params))

    want, want_grads = outputs_and_grads(wrapper)
    for module in (traced, loaded):
        got, got_grads = outputs_and_grads(module)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    unconverted = run(build(arch, torch.float64).train(), arch, kw).detach()
    assert (want - unconverted).abs().max() > 1e-4  # the maps are on (ViT's tiny logits: 5e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_query_coupling_trains_with_recompute(arch):
    """coupling="query" maps no key: Llama's k_proj site then holds no mapped block, and
    training with recompute (the default) failed in backward (min() of no block). Its
    gradients now equal recompute=False's, the gates' included; the keys stay the host's."""
    kw = inputs(arch, torch.float64, padding=False)
    grads = {}
    for recompute in (True, False):
        model = _no_dropout(open_gates(dt.convert(build(arch, torch.float64), coupling="query", recompute=recompute)))
        grads[recompute] = _grads(model.train(), lambda m=model: run(m, arch, kw))
    assert set(grads[True]) == set(grads[False]) and any(".gates.q" in n for n in grads[True])
    assert not any(".gates.k" in n or ".gates.qk" in n for n in grads[True])
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=0, atol=1e-12, msg=n)
    if arch == "llama":
        attention = model.model.layers[0].self_attn
        x = torch.randn(2, 3, attention.k_proj.in_features, dtype=torch.float64)
        torch.testing.assert_close(
            attention.k_proj(x), nn.functional.linear(x, attention.k_proj.weight), rtol=0, atol=0
        )


@pytest.mark.parametrize("share", [False, True], ids=["own", "share_metric"])
def test_siglip_pooling_head_maps_its_probe_and_patches_apart(share):
    """SigLIP's vision pooling head is an nn.MultiheadAttention whose query is a
    learned probe over the patch tokens: tied maps put the probe and the patches
    through one generator (the mha rule ties when kdim == embed_dim); it now gets
    separate maps, as timm's AttentionPoolLatent. Exact at init to rounding; the
    key gate alone moves the output."""
    T = transformers
    torch.manual_seed(0)
    config = T.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=4
    )
    model = T.SiglipVisionModel(config).double().eval()
    pixels = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        before = model(pixel_values=pixels).pooler_output
    dt.convert(model, share_metric=share)
    head = model.get_submodule("head.attention")
    assert isinstance(head, dt.DamchaAttention) and head.config.coupling == "separate"
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=pixels).pooler_output, before, rtol=0, atol=1e-12)
        head.metric_gates["k"].fill_(0.5)
        assert (model(pixel_values=pixels).pooler_output - before).abs().max() > 1e-3


# ------------------------------------------------------------------ PEFT


PEFT_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj"], "gpt2": ["c_attn"]}


@pytest.mark.parametrize("variant", ["lora", "dora"])
@pytest.mark.parametrize("arch", list(PEFT_TARGETS))
def test_peft_merge_and_unmerge_keep_the_maps(arch, variant):
    """PEFT LoRA/DoRA (random A, B and, for DoRA, magnitudes) on the q/k(/v)
    projections of a converted model: merge_adapter, unmerge_adapter and
    merge_and_unload (weights W' computed by PEFT, the map then on the plain
    projection) give the adapted model's outputs (the adapter's forward, the
    map on its wrapper), and leave every DAMCHA parameter as it was."""
    import peft

    model = open_gates(dt.convert(build(arch, torch.float64)), scale=0.8)
    kw = inputs(arch, torch.float64)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".damcha." in n}
    config = peft.LoraConfig(
        r=2,
        target_modules=PEFT_TARGETS[arch],
        init_lora_weights=False,
        use_dora=variant == "dora",
        fan_in_fan_out=arch == "gpt2",  # Conv1D stores its weight (in, out)
    )
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_magnitude_vector" in name:  # PEFT starts it at ||W + BA||, where DoRA equals LoRA
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        adapted = run(wrapped, arch, kw)
        with wrapped.disable_adapter():
            assert (run(wrapped, arch, kw) - adapted).abs().max() > 1e-2  # the adapter matters
        wrapped.merge_adapter()
        merged = run(wrapped, arch, kw)
        wrapped.unmerge_adapter()
        unmerged = run(wrapped, arch, kw)
        unloaded = copy.deepcopy(wrapped).merge_and_unload()
        plain_projection = all(
            isinstance(getattr(m, PEFT_TARGETS[arch][0]), (nn.Linear, transformers.pytorch_utils.Conv1D))
            for m in dt.converted_layers(unloaded).values()
        )
        unloaded_out = run(unloaded, arch, kw)
        for p in dt.damcha_parameters(unloaded, generators=False):
            p.zero_()
        unloaded_closed = run(unloaded, arch, kw)
    assert plain_projection
    for got in (merged, unmerged, unloaded_out):
        torch.testing.assert_close(got, adapted, rtol=0, atol=1e-12)
    assert (unloaded_closed - unloaded_out).abs().max() > 1e-3  # the merged model still maps
    after = {n.removeprefix("base_model.model."): p for n, p in wrapped.named_parameters() if ".damcha." in n}
    assert set(after) == set(before)
    assert all(torch.equal(after[n], before[n]) for n in before)


# --------------------------------------------------- torch.func.functional_call


@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("arch", ["llama", "vit"])
def test_functional_call_with_damcha_parameters(arch, share):
    """torch.func.functional_call with a dict of every parameter equals the
    module call; with other values for the DAMCHA parameters (a shared
    generator's too) it equals a copy of the model holding those values, and
    in training its gradients with respect to the dict's tensors equal that
    copy's (the fused training node reads the substituted weights)."""
    model = open_gates(dt.convert(build(arch, torch.float64), share_metric=share))
    kw = inputs(arch, torch.float64)
    args, kwargs = ((kw["x"],), {}) if arch == "vit" else ((), kw)

    def call(module, params):
        out = torch.func.functional_call(module, params, args, kwargs)
        return out if isinstance(out, torch.Tensor) else out.logits

    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    new = {
        n: p.detach() + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in params.items()
        if ".damcha." in n
    }
    assert len(new) == len(dt.damcha_parameters(model))
    other = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in other.named_parameters():
            if n in new:
                p.copy_(new[n])
        want = run(model, arch, kw)
        assert torch.equal(call(model, params), want)
        moved = call(model, {**params, **new})
        assert torch.equal(moved, run(other, arch, kw))
        assert (moved - want).abs().max() > 1e-4
        assert torch.equal(run(model, arch, kw), want)  # the module's own parameters are back
    model.train(), other.train()
    leaves = {n: t.clone().requires_grad_(True) for n, t in new.items()}
    call(model, {**params, **leaves}).square().mean().backward()
    want_grads = _grads(other, lambda: run(other, arch, kw))
    for n, leaf in leaves.items():
        torch.testing.assert_close(leaf.grad, want_grads[n], rtol=0, atol=1e-13, msg=n)
    assert all(p.grad is None for n, p in params.items() if n in new)


# --------------------------------------------------- dynamic quantization


@pytest.mark.parametrize("arch", ["llama", "bert", "vit"])
def test_quantize_dynamic(arch):
    """torch.ao.quantization.quantize_dynamic swaps every nn.Linear, the q/k
    projections included, for an int8 one: the maps move onto the new
    modules. At gates 0 the quantized converted model is the quantized
    unconverted one bit for bit; with the gates open each quantized
    projection's output is the reference's map of that int8 projection's own
    output, and the model stays close to the float converted model."""
    quantize = torch.ao.quantization.quantize_dynamic
    model = build(arch, torch.float32)
    kw = inputs(arch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization's move to torchao
        float_plain = run(model, arch, kw)
        plain = run(quantize(model, {nn.Linear}, dtype=torch.qint8), arch, kw)
        dt.convert(model)
        closed = run(quantize(model, {nn.Linear}, dtype=torch.qint8), arch, kw)
        float_ours = run(open_gates(model, scale=0.8), arch, kw)
        quantized = quantize(model, {nn.Linear}, dtype=torch.qint8)
        sites = [
            (layer.damcha, site, getattr(layer, site.attr))
            for layer in dt.converted_layers(quantized).values()
            for site in layer.damcha.layout.sites
        ]
        records = {id(p): [] for _, _, p in sites}
        for _, _, proj in sites:
            proj.register_forward_hook(lambda m, a, y: records[id(m)].append((a[0], y)))
        ours = run(quantized, arch, kw)
    assert torch.equal(closed, plain)
    assert all(isinstance(p, torch.ao.nn.quantized.dynamic.Linear) for _, _, p in sites)
    for maps, site, proj in sites:
        ((x, y),) = records[id(proj)]
        with torch.no_grad():
            raw = type(proj).forward(proj, x)  # the int8 projection alone
        want = _reference_site(maps, site, x, raw)
        assert np.abs(want - raw.double().numpy()).max() > 1e-3  # the maps are open
        np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-5, atol=1e-6)
    # int8 rounding moves the model as much as it moves the unconverted one.
    assert (ours - float_ours).abs().max() <= 3 * (plain - float_plain).abs().max()


# ------------------------------------------------- timm forward_intermediates


@pytest.mark.parametrize("arch", ["vit", "vit-qknorm"])
def test_timm_forward_intermediates(arch):
    """timm's forward_intermediates on a converted ViT: at gates 0 the
    unconverted model's intermediates and final features bit for bit; with
    the gates open each block's intermediate is what a forward hook on that
    block records in a plain forward (prefix tokens dropped), the final
    features are forward_features', and a model pruned to the first block
    (prune_intermediate_layers) gives the same first intermediate."""
    model = build(arch, torch.float64)
    x = inputs(arch, torch.float64)["x"]
    with torch.no_grad():
        plain_final, plain_inter = model.forward_intermediates(x, output_fmt="NLC")
        dt.convert(model)
        final, inter = model.forward_intermediates(x, output_fmt="NLC")
        assert torch.equal(final, plain_final) and all(torch.equal(a, b) for a, b in zip(inter, plain_inter))
        open_gates(model)
        hooked: list[torch.Tensor] = []
        handles = [b.register_forward_hook(lambda m, a, y: hooked.append(y)) for b in model.blocks]
        features = model.forward_features(x)
        for h in handles:
            h.remove()
        final, inter = model.forward_intermediates(x, output_fmt="NLC")
        pruned = copy.deepcopy(model)
        pruned.prune_intermediate_layers(indices=[0])
        (first,) = pruned.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)
    assert len(inter) == len(hooked) == len(model.blocks)
    assert torch.equal(final, features)
    for got, block_out in zip(inter, hooked):
        assert torch.equal(got, block_out[:, model.num_prefix_tokens :])
    assert len(pruned.blocks) == 1 and dt.converted_layers(pruned)
    assert torch.equal(first, inter[0])
    assert (final - plain_final).abs().max() > 1e-4  # the maps act on the intermediates


# ------------------------------------------------------- accelerate offload


@pytest.mark.parametrize(
    "arch,share,how",
    [
        ("llama", False, "cpu_offload"),
        ("gpt2", True, "cpu_offload"),
        ("llama", True, "disk_offload"),
        ("llama", False, "from_pretrained-device-map"),
    ],
    ids=["llama-cpu_offload", "gpt2-shared-cpu_offload", "llama-shared-disk_offload", "llama-device-map"],
)
def test_accelerate_offload(tmp_path, arch, share, how):
    """accelerate's offloading puts every parameter on the meta device and
    hooks each module that owns parameters to load them when it is called.
    The maps read the gates and generators inside the projections' forward,
    never calling their modules, so they stayed on meta and the first call
    raised "Tensor on device cpu is not on the expected device meta!"; the
    projections' forward now runs those hooks. The offloaded model gives the
    in-memory model's outputs and tokens bit for bit, its parameters still
    offloaded after the call (a shared generator, borrowed from layer 0, too)."""
    from accelerate import cpu_offload, disk_offload

    model = open_gates(dt.convert(build(arch, torch.float32), share_metric=share), scale=0.8)
    kw = inputs(arch, padding=False, length=5)
    opts = _greedy(max_new_tokens=4)
    with torch.no_grad():
        want = run(model, arch, kw)
        want_tokens = model.generate(input_ids=kw["input_ids"], **opts)
    if how == "cpu_offload":
        cpu_offload(model, execution_device=torch.device("cpu"))
    elif how == "disk_offload":
        disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("cpu"))
    else:  # transformers' loading with a device map that puts layer 0 on disk (the rest stays in memory)
        model.save_pretrained(tmp_path / "model")
        device_map = {
            "model.embed_tokens": "cpu",
            "model.layers.0": "disk",
            "model.layers.1": "cpu",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",
        }
        model = dt.from_pretrained(
            transformers.LlamaForCausalLM,
            tmp_path / "model",
            device_map=device_map,
            offload_folder=tmp_path / "offload",
        )
    offloaded = {n for n, p in model.named_parameters() if ".damcha." in n and p.device.type == "meta"}
    assert offloaded and any(".gates." in n for n in offloaded) and any(".generators." in n for n in offloaded)
    with torch.no_grad():
        got = run(model, arch, kw)
        tokens = model.generate(input_ids=kw["input_ids"], **opts)
    assert torch.equal(got, want)
    assert torch.equal(tokens, want_tokens)
    assert offloaded == {n for n, p in model.named_parameters() if ".damcha." in n and p.device.type == "meta"}
