"""The fast paths of converted projections (backends/torch/_models_fused.py)
on the sites the first version left to the general path: GPT-2's ``Conv1D``
``c_attn`` (weight stored (in, out)).

Each test checks that the fast path is the one taken (the autograd node of
the projection's output), then that it computes what the general path
computes: gradients equal the path that stores its inputs (float64, 1e-13),
also under the host's gradient checkpointing; the forward without a graph
(maps added in place) equals the training forward bit for bit; and no copy of
an activation is added."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from _models_zoo import (
    aten_calls,
    aten_calls_before_and_after_convert,
    build,
    extra_copies,
    inputs,
    open_gates,
    run,
)
from torch import nn

import damcha_conformance
import damcha_torch as dt
from damcha_torch import _functional as fn

FUSED_NODE = "FusedProjectionMapsBackward"
STORED_NODE = "StoredProjectionMapsBackward"  # its store mode (see OutputRecipe)
FUSED_NODES = {FUSED_NODE, STORED_NODE}


def _no_dropout(model: nn.Module) -> nn.Module:
    """GPT-2 trains with dropout; the comparisons below need the same masks in
    runs that draw different numbers of random values."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _site_nodes(model: nn.Module, arch: str, kw: dict) -> list[str]:
    """The autograd node of each converted site's output in one training forward."""
    names: list[str] = []
    hooks = []
    for layer in dt.converted_layers(model).values():
        for site in layer.damcha.layout.sites:

            def hook(module, args, out):
                names.append(type(out.grad_fn).__name__ if out.grad_fn is not None else "none")

            hooks.append(getattr(layer, site.attr).register_forward_hook(hook))
    try:
        run(model, arch, kw)
    finally:
        for h in hooks:
            h.remove()
    return names


def _loss(model, arch, kw):
    return run(model, arch, kw).float().square().mean()


def _grads(model, arch, kw):
    torch.manual_seed(0)
    model.zero_grad()
    _loss(model, arch, kw).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _set_recompute(model: nn.Module, value: bool) -> None:
    for m in model.modules():
        if isinstance(m, dt.DamchaMaps):
            m.recompute = value


# ------------------------------------------------------------ GPT-2 Conv1D


def test_gpt2_conv1d_training_takes_the_fused_node():
    model = dt.convert(build("gpt2", torch.float32)).train()
    # Store mode: the host's SDPA saves views of c_attn's output, which become recipes.
    assert _site_nodes(model, "gpt2", inputs("gpt2")) == [STORED_NODE] * 2


@pytest.mark.parametrize("checkpointing", ["none", "reentrant", "non-reentrant"])
def test_gpt2_conv1d_fused_gradients_equal_the_stored_path(checkpointing):
    """c_attn's fused node (projection addmm with the (in, out) weight, maps,
    backward recomputing the q/k columns) against ``recompute=False`` (autograd
    through the host's Conv1D and the layer's map), with and without the
    host's gradient checkpointing (reentrant: the first forward runs without a
    graph, on the in-place path, then recomputes on the fused node)."""
    model = _no_dropout(open_gates(dt.convert(build("gpt2", torch.float64), recompute=False))).train()
    kw = inputs("gpt2", torch.float64)
    want = _grads(model, "gpt2", kw)
    _set_recompute(model, True)
    if checkpointing != "none":
        model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    got = _grads(model, "gpt2", kw)
    assert set(got) == set(want) and any(".damcha.gates." in n for n in want)
    assert any("c_attn.weight" in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


def test_gpt2_conv1d_fused_gradients_with_a_frozen_host():
    """Only the DAMCHA parameters train: the node's backward skips the host's
    gradients and still gives the stored path's."""
    grads = []
    for recompute in (False, True):
        model = _no_dropout(open_gates(dt.convert(build("gpt2", torch.float64), recompute=recompute))).train()
        own = {id(p) for p in dt.damcha_parameters(model)}
        for p in model.parameters():
            p.requires_grad_(id(p) in own)
        grads.append(_grads(model, "gpt2", inputs("gpt2", torch.float64)))
    want, got = grads
    assert set(got) == set(want) and want and all(".damcha." in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


def test_gpt2_conv1d_double_backward():
    """A gradient penalty through the fused node's backward equals the stored path's (eager attention)."""
    grads = []
    for recompute in (False, True):
        model = _no_dropout(open_gates(dt.convert(build("gpt2", torch.float64, "eager"), recompute=recompute)))
        model.train()
        loss = _loss(model, "gpt2", inputs("gpt2", torch.float64, padding=False))
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, create_graph=True)
        sum(g.square().sum() for g in first).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert set(got) == set(want) and any(".damcha.gates." in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gpt2_conv1d_fast_paths_agree_bit_for_bit(dtype):
    """The forward without a graph (maps added in place to c_attn's output)
    and the fused node's give the same bits (the node computes Conv1D's own
    addmm, then the same in-place maps)."""
    model = _no_dropout(open_gates(dt.convert(build("gpt2", dtype), recompute=True))).train()
    kw = inputs("gpt2", dtype)
    with torch.no_grad():
        want = run(model, "gpt2", kw)
    got = run(model, "gpt2", kw)
    assert got.grad_fn is not None
    assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
@pytest.mark.parametrize("mode", ["no-grad", "train"])
def test_gpt2_conv1d_maps_add_no_copies(mode, metric):
    """Per converted GPT-2 layer: without a graph, no copy at all (the maps
    are added in place to c_attn's output); in training, no copy of c_attn's
    output gradient (the backward takes that gradient in column pieces: the
    mapped q/k blocks, fresh, and a view of the v columns), no join of
    c_attn's weight and bias gradients (each piece's GEMM writes its part of
    them in place), and store mode's mapped output, a new tensor made from
    the kept unmapped one, where backward used to project c_attn's q/k
    columns (2 E of 3 E) again: the projection GEMMs are exactly the
    original's. "heads" copies only the v columns into it (the q/k columns
    are written once, y + bmm(mix, y)); "lowrank" maps a clone of the
    output. In backward, SDPA's saved views are made again from the kept
    output without a copy of it ("heads": the mapped q/k blocks alone, the v
    columns read in place; "lowrank": the whole output again, a second
    copy)."""
    (original, original_gemms, original_copies), (damcha, damcha_gemms, damcha_copies), model = (
        aten_calls_before_and_after_convert(
            "gpt2", mode, prepare=_no_dropout, **({"metric": metric, "metric_rank": 3} if metric == "lowrank" else {})
        )
    )
    layers = len(dt.converted_layers(model))
    E, tokens = model.config.n_embd, inputs("gpt2")["input_ids"].numel()
    # The mapped output's v columns ("heads"), or a clone of the output (and
    # made again, "lowrank"). Before: a clone of the output for "heads" too,
    # and c_attn's weight and bias gradients joined from their pieces
    # (("cat", 3 E), ("cat", 3 E * E)).
    store = [("copy_", tokens * E)] if metric == "heads" else [("clone", tokens * 3 * E)] * 2
    assert extra_copies(damcha_copies, original_copies) == ([] if mode == "no-grad" else sorted(store * layers))
    recomputed = list(damcha_gemms)
    for w in original_gemms:
        recomputed.remove(w)
    assert recomputed == [], recomputed  # store mode: backward projects nothing again


# ------------------------------------------------------------ metric lowrank

LOWRANK = {"metric": "lowrank", "metric_rank": 3}


@pytest.mark.parametrize("arch", ["vit", "llama", "gpt2"])
def test_lowrank_fused_gradients_equal_the_stored_path(arch):
    """Metric "lowrank" on the fused node: a fused qkv Linear (tied maps, two
    blocks), GQA's q_proj/k_proj (separate maps, each covering its output)
    and GPT-2's Conv1D; gradients of ``recompute=False``."""
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float64), recompute=False, **LOWRANK))).train()
    kw = inputs(arch, torch.float64)
    want = _grads(model, arch, kw)
    _set_recompute(model, True)
    assert set(_site_nodes(model, arch, kw)) <= FUSED_NODES
    got = _grads(model, arch, kw)
    assert set(got) == set(want)
    assert all(
        any(n.endswith(leaf) for n in want)
        for leaf in (".u", ".v", "generators.q.weight" if arch == "llama" else "generators.qk.weight")
    )
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


def test_lowrank_fused_gradients_with_a_frozen_host_and_double_backward():
    """Metric "lowrank" with only the DAMCHA parameters training, then a gradient
    penalty through the node's backward (eager attention), against the stored path."""
    frozen, penalty = [], []
    for recompute in (False, True):
        model = open_gates(dt.convert(build("llama", torch.float64, "eager"), recompute=recompute, **LOWRANK))
        model.train()
        kw = inputs("llama", torch.float64, padding=False)
        loss = _loss(model, "llama", kw)
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, create_graph=True)
        sum(g.square().sum() for g in first).backward()
        penalty.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        own = {id(p) for p in dt.damcha_parameters(model)}
        for p in model.parameters():
            p.requires_grad_(id(p) in own)
        frozen.append(_grads(model, "llama", kw))
    for want, got in (frozen, penalty):
        assert set(got) == set(want) and any(".damcha.gates." in n for n in want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


@pytest.mark.parametrize("arch", ["vit", "gpt2"])
def test_lowrank_fast_paths_agree_bit_for_bit(arch):
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float32), recompute=True, **LOWRANK))).train()
    kw = inputs(arch)
    with torch.no_grad():
        want = run(model, arch, kw)
    got = run(model, arch, kw)
    assert got.grad_fn is not None
    assert torch.equal(got.detach(), want)


# ------------------------------------------------- bfloat16 and autocast

# Declared once, for every 16-bit comparison below. A mapped block under
# bfloat16 autocast is one bfloat16 rounding (unit roundoff 2^-8) of y_b +
# g A(t) y_b computed in float32 from the host's bfloat16 projection y_b:
# relative error 2^-8, plus float32's own error on the correction (the atol,
# for entries where y_b and the correction cancel; the tiny models' q/k are O(0.1)).
BF16_ONE_ROUNDING = {"rtol": 2.0**-8, "atol": 1e-6}
# Whole models under autocast against float32: the conformance suite's bfloat16 tolerance.
BF16_MODEL = damcha_conformance.tolerance("bfloat16")

AUTOCAST_CASES = [("gpt2", "heads"), ("vit", "heads"), ("llama", "heads"), ("gpt2", "lowrank"), ("vit", "lowrank")]


def _options(metric: str) -> dict:
    return LOWRANK if metric == "lowrank" else {}


def _site_outputs(model: nn.Module) -> list[tuple[nn.Module, object, nn.Module, list]]:
    """(attention module, site, projection, [(input, output)]) of every converted site, recorded by hooks."""
    out = []
    for layer in dt.converted_layers(model).values():
        for site in layer.damcha.layout.sites:
            proj = getattr(layer, site.attr)
            calls: list = []
            proj.register_forward_hook(lambda m, args, y, calls=calls: calls.append((args[0], y)))
            out.append((layer, site, proj, calls))
    return out


@pytest.mark.parametrize("arch,metric", AUTOCAST_CASES)
def test_bf16_autocast_exact_at_init_on_the_in_place_path(arch, metric):
    """Gates at 0 under bfloat16 autocast: the converted model is the original
    bit for bit, and the maps ran on the in-place path (no split or
    concatenation beyond the original's)."""
    model = build(arch, torch.float32)
    kw = inputs(arch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = run(model, arch, kw)
        (original, _, _) = aten_calls(lambda: run(model, arch, kw))
        dt.convert(model, **_options(metric))
        after = run(model, arch, kw)
        (converted, _, _) = aten_calls(lambda: run(model, arch, kw))
    assert torch.equal(after, before)
    extra = {op: converted.get(op, 0) - original.get(op, 0) for op in ("cat", "split", "split_with_sizes", "clone")}
    assert not any(extra.values()), extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16bit_model_exact_at_init(dtype):
    model = build("gpt2", dtype)
    kw = inputs("gpt2", dtype)
    with torch.no_grad():
        before = run(model, "gpt2", kw)
        after = run(dt.convert(model), "gpt2", kw)
    assert after.dtype == dtype and torch.equal(after, before)


@pytest.mark.parametrize("arch,metric", AUTOCAST_CASES)
def test_bf16_autocast_maps_round_once(arch, metric):
    """Gates open, bfloat16 autocast: each converted projection's output is
    one bfloat16 rounding of the exact map (float64) of the host's own bfloat16
    projection, on the in-place path (no graph) and on the training path
    (autocast keeps the general path: see _run_site), which agree bit for bit."""
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float32), **_options(metric))))
    sites = _site_outputs(model)
    kw = inputs(arch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            want = run(model, arch, kw)
        model.train()
        got = run(model, arch, kw)
    assert got.grad_fn is not None and torch.equal(got.detach(), want)
    for layer, site, proj, calls in sites:
        assert len(calls) == 2
        (x, y), (_, y_train) = calls
        assert y.dtype == torch.bfloat16 and torch.equal(y_train, y)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            host = type(proj).forward(proj, x)  # the host's projection alone, as autocast runs it
        assert host.dtype == torch.bfloat16
        with torch.no_grad():
            exact = layer.damcha.apply_maps(site, x.double(), host.double())
        assert (exact - host.double()).abs().max() > 10 * BF16_ONE_ROUNDING["rtol"] * host.abs().max()  # maps are open
        torch.testing.assert_close(y.double(), exact, **BF16_ONE_ROUNDING)


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_bf16_autocast_model_agrees_with_float32(arch):
    """The converted model with open gates under bfloat16 autocast against the
    same model in float32, within the conformance suite's bfloat16 tolerance
    (outputs scaled to O(1) as the catalogue's are)."""
    model = open_gates(dt.convert(build(arch, torch.float32)))
    kw = inputs(arch)
    with torch.no_grad():
        ref = run(model, arch, kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run(model, arch, kw).float()
    scale = ref.abs().max()
    _, ratio = BF16_MODEL.output_ratio((got / scale).numpy(), (ref / scale).numpy())
    assert ratio <= 1.0, ratio


def test_bf16_autocast_training_keeps_the_general_path():
    """Under autocast the fused node is deliberately not used (the host's
    projection computes its gradients through autocast's 16-bit casts): the
    recompute path's gradients equal those of the path that stores its inputs."""
    grads, nodes = [], []
    for recompute in (False, True):
        model = _no_dropout(open_gates(dt.convert(build("gpt2", torch.float32), recompute=recompute))).train()
        kw = inputs("gpt2")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nodes.append(_site_nodes(model, "gpt2", kw))
            model.zero_grad()
            _loss(model, "gpt2", kw).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert not FUSED_NODES & set(nodes[1])
    want, got = grads
    assert set(got) == set(want) and any(".damcha.gates." in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


# ------------------------------------------------------------- PEFT LoRA


def _peft_model(arch: str, order: str, trainable: str) -> nn.Module:
    """A float64 model with PEFT LoRA (r=2, random A and B) on its q/k projections, converted before or after."""
    import peft

    model = _no_dropout(build(arch, torch.float64))
    targets = {"llama": ["q_proj", "k_proj"], "gpt2": ["c_attn"]}[arch]
    config = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False, fan_in_fan_out=arch == "gpt2")
    if order == "peft-after-convert":
        model = peft.get_peft_model(open_gates(dt.convert(model)), config)
    else:
        model = peft.get_peft_model(model, config)
        open_gates(dt.convert(model))
    for p in model.parameters() if trainable == "all" else dt.damcha_parameters(model):
        p.requires_grad_(True)
    return model.train()


@pytest.mark.parametrize(
    "arch,order,trainable",
    [
        ("llama", "peft-after-convert", "lora+damcha"),
        ("gpt2", "peft-before-convert", "lora+damcha"),
        ("gpt2", "peft-after-convert", "all"),
    ],
)
def test_peft_lora_fused_gradients_equal_the_stored_path(arch, order, trainable):
    """PEFT's LoRA Linear around q_proj/k_proj (nn.Linear) or c_attn (Conv1D)
    runs on the fused node (base projection + LoRA update + maps, backward
    recomputing the q/k rows of both): gradients of ``recompute=False`` (the
    general path through PEFT's own forward), float64, 1e-13."""
    model = _peft_model(arch, order, trainable)
    kw = inputs(arch, torch.float64)
    _set_recompute(model, False)
    want = _grads(model, arch, kw)
    _set_recompute(model, True)
    assert set(_site_nodes(model, arch, kw)) <= FUSED_NODES
    got = _grads(model, arch, kw)
    assert set(got) == set(want)
    assert any(".lora_A." in n for n in want) and any(".lora_B." in n for n in want)
    assert any(".damcha.gates." in n for n in want)
    assert any(".base_layer.weight" in n for n in want) == (trainable == "all")
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


def test_peft_lora_fast_paths_agree_bit_for_bit():
    """The fused node's forward (PEFT's expression for the update, then the
    maps) equals the in-place path under PEFT's own forward, bit for bit."""
    model = _peft_model("gpt2", "peft-before-convert", "lora+damcha")
    kw = inputs("gpt2", torch.float64)
    with torch.no_grad():
        want = run(model, "gpt2", kw)
    got = run(model, "gpt2", kw)
    assert got.grad_fn is not None and torch.equal(got.detach(), want)


def test_peft_lora_variants_keep_the_general_path():
    """A LoRA layer the fused node does not reproduce (dropout on the update,
    a disabled adapter) runs PEFT's own forward under the checkpoint."""
    import peft

    model = build("llama", torch.float64)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(open_gates(dt.convert(model)), config).train()
    for p in dt.damcha_parameters(model):
        p.requires_grad_(True)
    kw = inputs("llama", torch.float64)
    assert not FUSED_NODES & set(_site_nodes(model, "llama", kw))
    with model.disable_adapter():
        assert not FUSED_NODES & set(_site_nodes(model, "llama", kw))


# ------------------------------------------- the node on its own, with gaps


def _reference_maps(sides, transposed, x, weight, bias, *leaves):
    """The projection and its maps written out in float64 with einsum and
    out-of-place slices (autograd differentiates it): phi(t) = sqrt(E) t /
    sqrt(|t|^2 + E eps), A(t) = phi(t) W^T + b; "heads": y_b + diag(g) A(t)
    y_b, "lowrank": y_b + ((y_b V) * A(t)) (u g)^T."""
    import damcha_core as dc

    y = x @ weight if transposed else x @ weight.t()
    if bias is not None:
        y = y + bias
    E = x.shape[-1]
    phi = x * (E**0.5) / (x.square().sum(-1, keepdim=True) + E * dc.RMS_EPS).sqrt()
    cols = list(y.unbind(-1))
    k = 0
    for blocks in sides:
        n = 3 if blocks.metric == "heads" else 5
        w_gen, b_gen, gate, *uv = leaves[k : k + n]
        k += n
        S, d = blocks.heads, blocks.head_dim
        A = phi @ w_gen.t() + b_gen
        # Head h of the block at o: columns o + h*d, or o + h*F/groups on an interleaved output.
        step = d if blocks.groups == 1 else y.shape[-1] // blocks.groups
        for o in blocks.offsets:
            columns = [o + h * step + j for h in range(S) for j in range(d)]
            yb = torch.stack([cols[c] for c in columns], -1).unflatten(-1, (S, d))
            if blocks.metric == "heads":
                out = yb + torch.einsum("i,...ij,...jd->...id", gate, A.unflatten(-1, (S, S)), yb)
            else:
                u, v = uv
                z = torch.einsum("...jd,jdr->...r", yb, v) * A
                out = yb + torch.einsum("...r,idr,i->...id", z, u, gate)
            for c, value in zip(columns, out.flatten(-2).unbind(-1)):
                cols[c] = value
    return torch.stack(cols, -1)


def _node_inputs(sides, E, features, transposed, r=2):
    """Random float64 tokens (2, 5, E), projection weight and bias, and the
    ``side_leaves`` of each of ``sides`` (generator weight, bias, gate; u, v
    for "lowrank" of rank r), for a FusedProjectionMaps call."""
    f64 = {"dtype": torch.float64}
    x = torch.randn(2, 5, E, **f64)
    weight = torch.randn(*((E, features) if transposed else (features, E)), **f64)
    bias = torch.randn(features, **f64)
    leaves = []
    for blocks in sides:
        S, d = blocks.heads, blocks.head_dim
        out = S * S if blocks.metric == "heads" else r
        leaves += [torch.randn(out, E, **f64) / 3, torch.randn(out, **f64) / 3, torch.rand(S, **f64)]
        if blocks.metric == "lowrank":
            leaves += [torch.randn(S, d, r, **f64), torch.randn(S, d, r, **f64)]
    return x, weight, bias, leaves


GAP_CASES = [(m, tr, lay) for m in ("heads", "lowrank") for tr in (False, True) for lay in ("apart", "runs")]
# Block offsets of the two sides ((S*d = 6 columns each) in 40 columns:
# "apart", every block alone; "runs", side q three adjacent blocks and side
# k two (one bmm per run: _models_fused._run_mix).
GAP_LAYOUTS = {"apart": ((4, 16), (26,)), "runs": ((4, 10, 16), (26, 32))}


@pytest.mark.parametrize(
    "metric,transposed,layout",
    GAP_CASES,
    ids=[f"{m}-{'conv1d' if tr else 'linear'}-{lay}" for m, tr, lay in GAP_CASES],
)
def test_fused_node_with_unmapped_columns_between_blocks(metric, transposed, layout):
    """FusedProjectionMaps with mapped blocks that leave unmapped columns
    before, between and after them (the backward's pieces of dL/dy: fresh
    mapped blocks and views of the incoming gradient), two sides: outputs and
    every gradient equal the einsum reference's in float64 (1e-13). The
    weight and bias gradients are written in place by each piece's GEMM
    (sum): no ``cat`` of the pieces in backward (two before)."""
    from damcha_torch._models_fused import FusedProjectionMaps, SideBlocks

    torch.manual_seed(0)
    E, S, d, r, features = 8, 2, 3, 2, 40
    q_offsets, k_offsets = GAP_LAYOUTS[layout]
    sides = (SideBlocks("q", S, d, q_offsets, metric), SideBlocks("k", S, d, k_offsets, metric))
    f64 = {"dtype": torch.float64}
    x, weight, bias, leaves = _node_inputs(sides, E, features, transposed, r)
    inputs_ = [x, weight, bias, *leaves]
    for t in inputs_:
        t.requires_grad_(True)
    probe = torch.randn(2, 5, features, **f64)
    got = FusedProjectionMaps.apply(sides, transposed, 1.0, None, x, weight, bias, None, None, *leaves)
    want = _reference_maps(sides, transposed, x, weight, bias, *leaves)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    grads: list = []
    _, _, copies = aten_calls(lambda: grads.extend(torch.autograd.grad((got * probe).sum(), inputs_)))
    assert [c for c in copies if c[0] == "cat"] == [], copies
    got_grads = tuple(grads)
    want_grads = torch.autograd.grad((want * probe).sum(), inputs_)
    assert len(got_grads) == 3 + len(leaves)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        # rtol too: the "runs" layout has weight gradients of a few hundred.
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=lambda m, i=i: f"input {i}: {m}")


# Interleaved outputs (SideBlocks.groups = S runs, one head of each block per
# run; offsets within a run of F/S columns): GPT-NeoX's tied queries and keys
# beside each head's value, its separate query and key maps, Qwen3-Next's
# query beside each head's output gate.
INTERLEAVED = {
    "neox-tied": ((("qk", (0, 3)),), 9),
    "neox-separate": ((("q", (0,)), ("k", (3,))), 9),
    "gated-query": ((("q", (0,)),), 6),
}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("probe", ["dense", "expanded"])
@pytest.mark.parametrize("layout", list(INTERLEAVED))
def test_fused_node_on_an_interleaved_output(layout, probe, transposed, lora):
    """FusedProjectionMaps on an interleaved projection output (the heads of
    each block F/groups columns apart, unmapped columns between them; in
    backward only each run's mapped rows projected again, LoRA's update
    too): outputs and every gradient equal the einsum reference's in
    float64 (with LoRA, on the weight W + s B A), with a dense incoming
    gradient and with a sum's expanded one (the node reads the gradient's
    heads through its strides)."""
    from damcha_torch._models_fused import FusedProjectionMaps, SideBlocks

    torch.manual_seed(1)
    E, S, d = 8, 4, 3
    spec, run = INTERLEAVED[layout]
    features = S * run
    sides = tuple(SideBlocks(side, S, d, offsets, "heads", S) for side, offsets in spec)
    f64 = {"dtype": torch.float64}
    x, weight, bias, leaves = _node_inputs(sides, E, features, transposed)
    lora_a, lora_b, scaling = (torch.randn(2, E, **f64), torch.randn(features, 2, **f64), 0.5) if lora else (None,) * 3
    inputs_ = [x, weight, bias, *leaves, *([lora_a, lora_b] if lora else [])]
    for t in inputs_:
        t.requires_grad_(True)
    got = FusedProjectionMaps.apply(sides, transposed, scaling or 1.0, None, x, weight, bias, lora_a, lora_b, *leaves)
    effective = weight
    if lora:
        update = scaling * (lora_b @ lora_a)
        effective = weight + (update.t() if transposed else update)
    want = _reference_maps(sides, transposed, x, effective, bias, *leaves)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    weights = torch.randn(2, 5, features, **f64)

    def loss(out):
        return (out * weights).sum() if probe == "dense" else out.sum()  # sum's gradient: ones, expanded

    got_grads = torch.autograd.grad(loss(got), inputs_)
    want_grads = torch.autograd.grad(loss(want), inputs_)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=i: f"input {i}: {m}")


# Per converted layer of a fused qkv (timm's ViT: the tied q/k maps, two
# adjacent blocks of one projection), beyond the original's ops: the
# per-token S x S mixing is one batched product (``bmm``; measured faster than
# S broadcast multiply-adds, one broadcast product or ``einsum`` for S in
# 3..16, so there is no switch on S) for both blocks at once, (T, 2S, 2S)
# block-diagonal times (T, 2S, d) (at S = 3 MKL's batched GEMM costs about the
# same per 6 x 6 matrix as per 3 x 3, so one call instead of two; ViT-Tiny
# shapes, T = 2308: see _models_fused._run_mix). Without a graph: one bmm
# and one in-place add. In training: store mode's forward writes the mapped
# q/k columns once (a bmm and an ``add`` into the new output); the two
# blocks are made again once, together, in backward from the kept unmapped
# output for SDPA's saved views of q~ and k~ (a bmm and an ``add``; the v
# columns are read from the kept output, no copy); backward one ``baddbmm``
# (dL/dy of both blocks, fresh) and one ``bmm`` per block (dL/d(mix), the
# second added to the first: one (T, 2S, 2S) product measured slower).
# Before: a bmm and a baddbmm per block everywhere, 6 bmm and 2 baddbmm per
# training step.
# The generator around it: in training the tokens' norm (``linalg_vector_norm``)
# and the generator's product P = t W^T are made once, in forward, and kept
# (S*S + 1 floats a token) for the remake and the node's backward, which
# made both again (2 norms, and 4 ``mm``: P twice, the generator's weight
# gradient and one extra piece of the projection's dx). The block-diagonal
# mix (``_run_mix``) is built twice, by a ``new_zeros`` and one ``mul`` into
# its diagonal (forward, remake); the node's backward takes the remake's
# (it built a third, each by ``eye`` and two broadcast ``mul``).
VIT_MIXING = {
    "no-grad": {"bmm": 1, "add_": 1, "linalg_vector_norm": 1, "mm": 1, "new_zeros": 1},
    "train": {"bmm": 4, "baddbmm": 1, "add_": 1, "add": 2, "linalg_vector_norm": 1, "mm": 3, "new_zeros": 2},
}


@pytest.mark.parametrize("mode", ["no-grad", "train"])
def test_vit_fused_qkv_mixing_ops_per_layer(mode, monkeypatch):
    # zero_grad: no accumulation into .grad (an add_) in the counted call. The torch
    # ops' path (the C kernel, eval mode with <= 16 tokens, has its own tests:
    # tests/test_torch_headmix.py).
    monkeypatch.setattr(fn, "_HEADMIX", None)
    (original, _, _), (damcha, _, _), model = aten_calls_before_and_after_convert("vit", mode, zero_grad=True)
    layers = len(dt.converted_layers(model))
    ops = ("bmm", "baddbmm", "add_", "add", "linalg_vector_norm", "mm", "new_zeros", "eye")
    extra = {op: (damcha.get(op, 0) - original.get(op, 0)) / layers for op in ops}
    assert {op: n for op, n in extra.items() if n} == VIT_MIXING[mode], extra


@pytest.mark.parametrize("arch", ["llama", "vit"])
def test_inference_mode_equals_no_grad(arch):
    """Under ``torch.inference_mode`` (inference tensors: no version counter,
    so the sites do not share the tokens' norm there) the converted model
    gives the bits it gives under ``torch.no_grad``."""
    model = open_gates(dt.convert(build(arch, torch.float32))).eval()
    kw = inputs(arch)
    with torch.no_grad():
        want = run(model, arch, kw)
    with torch.inference_mode():
        got = run(model, arch, kw)
    assert torch.equal(got, want)


def test_cross_key_value_node_joins_no_weight_gradient():
    """DamchaAttention(x, c, c) in training: keys and values are one
    ``SplitLinearMaps`` node over the packed k/v weight, whose output
    gradient comes back in two pieces (k~'s, mapped, fresh; v's as SDPA
    returns it). Each piece's GEMM writes its rows of the k/v weight
    gradient, and its column sums its part of the bias gradient, in place:
    the only joins left are autograd's, of the packed ``in_proj`` weight and
    bias split into the query and key/value projections (before, the k/v
    weight and bias gradients were each a ``cat`` of the pieces' too).
    Gradients: ``recompute=False`` (the composite path), float64."""
    E = 32
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 4, batch_first=True, dtype=torch.float64)
    x, c = torch.randn(2, 8, E, dtype=torch.float64), torch.randn(2, 4, E, dtype=torch.float64)
    grads = []
    for recompute in (True, False):
        torch.manual_seed(1)  # the same generator weights in both
        layer = open_gates(dt.DamchaAttention.from_mha(mha, recompute=recompute)).train()

        def step(layer=layer):
            layer.zero_grad(set_to_none=True)
            layer(x, c, c, need_weights=False)[0].square().mean().backward()

        step()
        if recompute:
            _, _, copies = aten_calls(step)
            assert sorted(n for op, n in copies if op == "cat") == [3 * E, 3 * E * E], copies
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    got, want = grads
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-13, msg=n)


@pytest.mark.parametrize("mode", ["no-grad", "train"])
def test_llama_sites_share_the_norm_of_their_input(mode, monkeypatch):
    """Llama's q_proj and k_proj project the same hidden states: the RMS
    denominator of those tokens (the generators' phi) is computed once per
    layer in forward and once in backward (``SharedNorm``), where each site
    computed its own in each (2 without a graph, 4 in a training step).
    The gradients and outputs these feed are pinned bit for bit / to 1e-13
    by the fused-path tests above and in test_models_torch.py. The torch
    ops' path (the C kernel computes each site's norm itself, in one call)."""
    monkeypatch.setattr(fn, "_HEADMIX", None)
    (original, _, _), (damcha, _, _), model = aten_calls_before_and_after_convert("llama", mode, zero_grad=True)
    layers = len(dt.converted_layers(model))
    extra = (damcha.get("linalg_vector_norm", 0) - original.get("linalg_vector_norm", 0)) / layers
    assert extra == (1 if mode == "no-grad" else 2), extra


# -------------------------------------------------------------- store mode


# Store mode's saved-tensor hooks (``saved_as_recipes``) open after the
# converted projection's node, not with the attention module: nothing saved
# before it can be a view of its output, and each tensor packed under the
# hooks costs a ``detach`` (only those with an autograd node are detached).
# Extra ``detach`` calls per converted layer in a training step, hooks and
# autograd's own (the layer's new parameters) together: ViT 23 and GPT-2 26
# when the hooks opened with the attention module and detached every tensor.
STORE_DETACHES = {"vit": 10, "gpt2": 11}


@pytest.mark.parametrize("arch", ["vit", "gpt2"])
def test_store_mode_hooks_pack_only_what_follows_the_projection(arch):
    (original, _, _), (damcha, _, _), model = aten_calls_before_and_after_convert(
        arch, "train", prepare=_no_dropout, zero_grad=True
    )
    assert set(_site_nodes(model, arch, inputs(arch))) == {STORED_NODE}
    layers = len(dt.converted_layers(model))
    extra = (damcha.get("detach", 0) - original.get("detach", 0)) / layers
    assert extra <= STORE_DETACHES[arch], extra


def _alive_after(call, model: nn.Module) -> tuple[collections.Counter, object]:
    """The storages ``call()`` allocates that are still alive when it returns
    (what autograd keeps for backward, the result; the storages of
    ``model``'s parameters and gradients, which ``detach`` aliases, left
    out), as a Counter of their sizes in bytes, and the result (kept alive
    while counted)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made: dict[int, tuple[StorageWeakRef, int]] = {}

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()  # a reused address holds the newer storage
                    made[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
            return out

    with Allocations():
        out = call()
    gc.collect()
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return collections.Counter(n for ptr, (ref, n) in made.items() if ptr not in own and not ref.expired()), out


def _held_after_forward(model: nn.Module, arch: str, kw: dict) -> tuple[collections.Counter, object]:
    return _alive_after(lambda: run(model, arch, kw), model)


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_store_mode_holds_what_the_original_holds(arch):
    """Store mode keeps the unmapped projection output where the original
    kept its output (SDPA's saved views of it become recipes): the storages
    a training forward leaves alive are the original model's, size for size
    (a mapped copy left alive would be one (T, 3E) more per layer), and per
    converted layer the generator's norm r (T, 1) and product P (T, S*S),
    kept so that backward does not make them again."""
    model = _no_dropout(build(arch, torch.float32)).train()
    kw = inputs(arch)
    run(model, arch, kw)  # warm-up: lazy caches out of the counts
    theirs, _a = _held_after_forward(model, arch, kw)
    open_gates(dt.convert(model))
    run(model, arch, kw)
    assert set(_site_nodes(model, arch, kw)) == {STORED_NODE}
    ours, _b = _held_after_forward(model, arch, kw)
    layers = len(dt.converted_layers(model))
    tokens = {"gpt2": 2 * 7, "vit": 2 * (4 + 1)}[arch]  # inputs(arch): B * N (ViT: 4 patches and the class token)
    S = 4
    kept = collections.Counter({4 * tokens: layers, 4 * tokens * S * S: layers})
    want = theirs + kept
    assert ours == want, (sorted((ours - want).items()), sorted((want - ours).items()))


def test_store_mode_turns_off_where_nothing_is_saved():
    """Llama's kernel saves q and k after RoPE, never the projections'
    outputs: the first training call finds that and later calls take the
    recomputing node, with no copy of the outputs."""
    model = open_gates(dt.convert(build("llama", torch.float32))).train()
    kw = inputs("llama")
    assert set(_site_nodes(model, "llama", kw)) == {STORED_NODE}
    assert set(_site_nodes(model, "llama", kw)) == {FUSED_NODE}


@pytest.mark.parametrize(
    "arch, options",
    [("vit", {}), ("gpt2", {}), ("gpt2", LOWRANK)],
    ids=["vit-heads", "gpt2-heads", "gpt2-lowrank"],
)
def test_store_mode_views_made_again_bit_for_bit(monkeypatch, arch, options):
    """Every view of a stored node's output that the host saved (SDPA's q~,
    k~, v, or some of them) comes back in backward equal, bit for bit, to what the forward
    made: "heads" makes each mapped block again alone and reads the v
    columns from the kept unmapped output; "lowrank" makes the whole output
    again."""
    import damcha_torch._models_fused as fused

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    made = fused.saved_as_recipes

    def checking(recipes):
        hooks = made(recipes)
        pack, unpack = hooks.pack_hook, hooks.unpack_hook

        def pack_and_note(t):
            packed = pack(t)
            return (packed, t.detach().clone()) if isinstance(packed, fused._PackedOutput) else packed

        def unpack_and_note(packed):
            if isinstance(packed, tuple):
                packed, forward = packed
                seen.append((unpack(packed), forward))
                return seen[-1][0]
            return unpack(packed)

        return torch.autograd.graph.saved_tensors_hooks(pack_and_note, unpack_and_note)

    monkeypatch.setattr(fused, "saved_as_recipes", checking)
    model = _no_dropout(open_gates(dt.convert(build(arch, torch.float32), **options))).train()
    kw = inputs(arch)
    assert set(_site_nodes(model, arch, kw)) == {STORED_NODE}
    seen.clear()
    _loss(model, arch, kw).backward()
    # ViT's SDPA saves q~, k~ and v of each layer; GPT-2's (with a padding mask) one of them.
    assert len(seen) == (3 if arch == "vit" else 1) * len(dt.converted_layers(model))
    for got, want in seen:
        assert got.shape == want.shape and torch.equal(got, want)


def _hold_outputs(model: nn.Module, held: list) -> None:
    for layer in dt.converted_layers(model).values():
        layer.c_attn.register_forward_hook(lambda m, a, out: held.append(out))


@pytest.mark.parametrize("case", ["retain-graph", "output-held-elsewhere"])
def test_store_mode_gradients(case):
    """Store mode's gradients equal ``recompute=False``'s (float64, 1e-13)
    when a second backward reads the graph again (``retain_graph``: the
    recipes make the output again; the second gives the first's bits) and
    when the mapped output stays referenced after the forward (a hook keeps
    it: then it is its own recipe and backward projects again)."""
    model = _no_dropout(open_gates(dt.convert(build("gpt2", torch.float64), recompute=False))).train()
    kw = inputs("gpt2", torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(_loss(model, "gpt2", kw), params)
    _set_recompute(model, True)
    held: list = []
    if case == "output-held-elsewhere":
        _hold_outputs(model, held)
    loss = _loss(model, "gpt2", kw)
    got = torch.autograd.grad(loss, params, retain_graph=case == "retain-graph")
    if case == "retain-graph":
        again = torch.autograd.grad(loss, params)
        assert all(torch.equal(a, b) for a, b in zip(again, got))
    else:
        assert len(held) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def _step(model: nn.Module, forward) -> torch.Tensor:
    """A training step that keeps its loss (and so the graph object) alive, as
    a loop keeps the last loss while the next forward runs."""
    model.zero_grad(set_to_none=True)
    loss = forward().float().square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("case", ["gpt2-convert", "layer"])
def test_store_mode_keeps_nothing_after_backward(case):
    """After backward, with the loss still alive, store mode holds nothing the
    original does not (the kept projection output and tokens go with the
    saved recipes, or when the node's backward has read them): converted
    GPT-2 against the original, and ``DamchaAttention``'s own store mode
    (``MapRecipes``) against nn.MultiheadAttention."""
    torch.manual_seed(0)
    if case == "layer":
        theirs_model = nn.MultiheadAttention(32, 4, batch_first=True)
        ours_model = dt.DamchaAttention.from_mha(theirs_model)
        open_gates(ours_model)
        x = torch.randn(2, 9, 32, requires_grad=True)

        def forward(m):
            return lambda: m(x, x, x, need_weights=False)[0]
    else:
        kw = inputs("gpt2")
        theirs_model = _no_dropout(build("gpt2", torch.float32))
        ours_model = open_gates(dt.convert(_no_dropout(build("gpt2", torch.float32))))

        def forward(m):
            return lambda: run(m, "gpt2", kw)

    counts = []
    for model in (theirs_model, ours_model):
        model.train()
        _step(model, forward(model))  # warm-up
        counts.append(_alive_after(lambda model=model: _step(model, forward(model)), model))
    (theirs, _a), (ours, _b) = counts
    assert ours == theirs, (sorted((ours - theirs).items()), sorted((theirs - ours).items()))


# torch's own vmap fallback for SDPA warns; the comparison is what matters here.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_vit_inference_under_vmap_equals_a_loop():
    """The no-graph forward writes the ViT's block-diagonal mixes with a strided
    ``out=`` that torch.func has no batching rule for: under a transform it
    takes the broadcast product, so ``torch.func.vmap`` over a batch of
    batches computes what a loop over them computes."""
    model = open_gates(dt.convert(build("vit", torch.float64)))
    x = torch.randn(3, 2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = torch.func.vmap(model)(x)
        want = torch.stack([model(xi) for xi in x])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
