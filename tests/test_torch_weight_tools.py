"""PyTorch's weight tools on DamchaAttention, as on nn.MultiheadAttention:
parametrizations (weight_norm, spectral_norm), pruning, quantize_dynamic and
PEFT LoRA. Each result equals a plain layer (or nn.MultiheadAttention) holding
the effective weights, and the gradients reach the tools' own parameters."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from damcha_torch import DamchaAttention
from damcha_torch import _functional as fn

E, H = 16, 4


def _layer(metric: str = "heads", kdim: int | None = None, seed: int = 0) -> DamchaAttention:
    torch.manual_seed(seed)
    layer = DamchaAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True, metric=metric, dtype=torch.float64)
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.normal_()  # open gates: the maps change the result
        if layer.in_proj_bias is not None:
            layer.in_proj_bias.normal_()
            layer.out_proj.bias.normal_()
    return layer


def _plain_copy(layer: nn.Module, template: DamchaAttention) -> DamchaAttention:
    """``template`` loaded with ``layer``'s effective weights, as plain parameters."""
    effective = {}
    for name in template.state_dict():
        owner, _, leaf = name.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        # (The effective tensor as the layer reads it: a pruned tensor's attribute is
        # remade only when its module is called, which the gates and generators never are.)
        effective[name] = fn.tool_entry(module, leaf, power_iteration=False).detach().clone()
    template.load_state_dict(effective)
    return template


TOOLS = {
    "weight_norm(out_proj)": lambda a: weight_norm(a.out_proj),
    "spectral_norm(out_proj)": lambda a: spectral_norm(a.out_proj),
    "prune(out_proj.weight)": lambda a: prune.l1_unstructured(a.out_proj, "weight", 0.3),
    "prune(in_proj_weight)": lambda a: prune.l1_unstructured(a, "in_proj_weight", 0.3),
    "prune(in_proj_bias)": lambda a: prune.l1_unstructured(a, "in_proj_bias", 0.3),
    "weight_norm(in_proj_weight)": lambda a: weight_norm(a, "in_proj_weight"),
    "prune(generator)": lambda a: prune.l1_unstructured(a.metric_generators["qk"], "weight", 0.3),
    # A gate bounded by a parametrization, or pruned (a raw KeyError before: the layer read the registry).
    "tanh(gate)": lambda a: parametrize.register_parametrization(a.metric_gates, "qk", nn.Tanh()),
    "prune(gate)": lambda a: prune.l1_unstructured(a.metric_gates, "qk", 0.5),
    # The old hook-based tools, whose hooks a call of the generator would run (the layer makes no call).
    "old_weight_norm(generator)": lambda a: _old_tool(torch.nn.utils.weight_norm, a.metric_generators["qk"]),
    "old_spectral_norm(generator)": lambda a: _old_tool(torch.nn.utils.spectral_norm, a.metric_generators["qk"]),
}


def _old_tool(tool, module: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates them for the parametrizations
        tool(module, "weight")


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("need_weights", [True, False])
def test_tool_result_is_the_layer_with_effective_weights(tool: str, need_weights: bool) -> None:
    layer = _layer()
    TOOLS[tool](layer)
    layer.eval()  # spectral_norm's power iteration runs in training only: fixed weights
    x = torch.randn(2, 5, E, dtype=torch.float64)
    got, got_w = layer(x, x, x, need_weights=need_weights)
    want, want_w = _plain_copy(layer, _layer(seed=1).eval())(x, x, x, need_weights=need_weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_decode_step_uses_effective_weights(tool: str) -> None:
    """The flat decoding step reads the registry: with no entry, the general path runs."""
    from damcha_torch import DamchaKVCache

    layer = _layer()
    TOOLS[tool](layer)
    layer.eval()
    plain = _plain_copy(layer, _layer(seed=1).eval())
    x = torch.randn(1, 4, E, dtype=torch.float64)
    caches = DamchaKVCache(), DamchaKVCache()
    with torch.no_grad():
        for t in range(4):
            step = x[:, t : t + 1]
            got, _ = layer(step, step, step, need_weights=False, is_causal=True, kv_cache=caches[0])
            want, _ = plain(step, step, step, need_weights=False, is_causal=True, kv_cache=caches[1])
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pruned_separate_projection_weight() -> None:
    """kdim != embed_dim: q/k/v_proj_weight are registered parameters, prunable as on MHA."""
    layer = _layer(kdim=12)
    prune.l1_unstructured(layer, "k_proj_weight", 0.4)
    assert "k_proj_weight" not in layer._parameters and (layer.k_proj_weight == 0).any()
    x, c = torch.randn(2, 5, E, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64)
    torch.manual_seed(1)
    plain = DamchaAttention(E, H, kdim=12, vdim=12, batch_first=True, dtype=torch.float64)
    want = _plain_copy(layer, plain)(x, c, c)[0]
    torch.testing.assert_close(layer(x, c, c)[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "tool", ["weight_norm(out_proj)", "prune(in_proj_weight)", "prune(in_proj_bias)", "weight_norm(in_proj_weight)"]
)
def test_tool_matches_multihead_attention(tool: str) -> None:
    """metric "none" with a tool applied is nn.MultiheadAttention with the same tool applied."""
    layer = _layer(metric="none")
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    mha.load_state_dict(layer.state_dict())
    TOOLS[tool](layer)
    TOOLS[tool](mha)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mask = torch.randn(5, 5, dtype=torch.float64)  # a mask keeps MHA off its fused kernel
    torch.testing.assert_close(layer(x, x, x, attn_mask=mask)[0], mha(x, x, x, attn_mask=mask)[0])


def test_training_forward_computes_a_spectral_norm_weight_once_as_mha_does() -> None:
    """In training, each read of a spectral_norm weight is a power-iteration
    step: the dtype check read out_proj.weight before the projection did, so
    the estimate moved twice per forward (MHA: once) and the outputs drifted
    from MHA's (1.6e-6 after 3 forwards, float64)."""
    layer = _layer(metric="none")
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    mha.load_state_dict(layer.state_dict())
    for module in (layer, mha):
        torch.manual_seed(1)  # the same initial u, v
        spectral_norm(module.out_proj)
        module.train()
    computed = {"layer": 0, "mha": 0}
    for key, module in (("layer", layer), ("mha", mha)):
        parametrization = module.out_proj.parametrizations.weight[0]
        parametrization.register_forward_hook(lambda *_, key=key: computed.__setitem__(key, computed[key] + 1))
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mask = torch.randn(5, 5, dtype=torch.float64)  # a mask keeps MHA off its fused kernel
    for _ in range(3):
        ours, theirs = layer(x, x, x, attn_mask=mask)[0], mha(x, x, x, attn_mask=mask)[0]
    assert computed["layer"] == computed["mha"] == 3, computed
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_gradients_reach_parametrization_and_pruning_parameters() -> None:
    """Training calls run the fused projection node (custom backward); gradcheck
    in float64 through weight_norm's and pruning's own parameters."""
    torch.manual_seed(0)
    layer = DamchaAttention(8, 2, batch_first=True, dtype=torch.float64).train()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.normal_()
    prune.l1_unstructured(layer, "in_proj_weight", 0.3)
    weight_norm(layer.out_proj)
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    leaves = {
        "in_proj_weight_orig": layer.in_proj_weight_orig,
        "out_proj.parametrizations.weight.original0": layer.out_proj.parametrizations.weight.original0,
        "out_proj.parametrizations.weight.original1": layer.out_proj.parametrizations.weight.original1,
    }
    names = list(leaves)

    def f(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names, values))
        return torch.func.functional_call(layer, params, (x, x, x), {"need_weights": False})[0]

    inputs = (x, *(t.detach().clone().requires_grad_(True) for t in leaves.values()))
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("tool", ["tanh(gate)", "prune(gate)", "prune(generator)", "old_weight_norm(generator)"])
def test_gradients_reach_a_gate_or_generator_tools_parameter(tool: str) -> None:
    """A gate or generator weight under a parametrization or pruning trains
    through the tool's own parameter: gradcheck in float64 (training's fused
    node), a gradient that is not zero, two training steps in a row, and an
    update of that parameter reaches the next forward, which equals a plain
    layer holding the effective weights. Pruning makes the effective tensor
    in a forward pre-hook of the module holding it, which the layer never
    calls for the gates' ParameterDict or a generator: the pruned tensor was
    read as of the pruning, frozen (the second backward raised, a reviewer's
    find; the old hook-based weight_norm alike), and canonical I/O reads the
    effective gate."""
    layer = _layer().train()
    TOOLS[tool](layer)
    leaf = {
        "tanh(gate)": "metric_gates.parametrizations.qk.original",
        "prune(gate)": "metric_gates.qk_orig",
        "prune(generator)": "metric_generators.qk.weight_orig",
        "old_weight_norm(generator)": "metric_generators.qk.weight_v",
    }[tool]
    original = layer.get_parameter(leaf)
    x = torch.randn(1, 3, E, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, {leaf: value}, (x, x, x), {"need_weights": False})[0]

    assert torch.autograd.gradcheck(f, (x, original.detach().clone().requires_grad_(True)))
    y = torch.randn(2, 5, E, dtype=torch.float64)
    for _ in range(2):  # two steps: nothing of the first graph is reused
        layer.zero_grad()
        layer(y, y, y, need_weights=False)[0].square().sum().backward()
        assert original.grad is not None and original.grad.abs().max() > 0
        with torch.no_grad():
            original.sub_(0.1 * original.grad)
    got = layer(y, y, y, need_weights=False)[0]
    want = _plain_copy(layer, _layer(seed=1))(y, y, y, need_weights=False)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if "gate" in tool:
        effective = fn.tool_entry(layer.metric_gates, "qk").detach().numpy()
        np.testing.assert_array_equal(layer.to_canonical()["metric.qk.gate"], effective)


def test_quantize_dynamic_leaves_out_proj_as_multihead_attention_does() -> None:
    layer = _layer().float()
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    want = layer(x, x, x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        model = torch.ao.quantization.quantize_dynamic(nn.Sequential(layer), {nn.Linear})
        mha_model = torch.ao.quantization.quantize_dynamic(nn.Sequential(mha), {nn.Linear})
    assert type(model[0].out_proj) is type(mha_model[0].out_proj) is type(mha.out_proj)
    torch.testing.assert_close(model[0](x, x, x)[0], want, rtol=0, atol=0)


def test_peft_lora_on_out_proj() -> None:
    from damcha_torch import ensure_torchvision_importable

    ensure_torchvision_importable()
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = _layer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    model = peft.get_peft_model(
        Block(), peft.LoraConfig(r=2, target_modules=["out_proj"], init_lora_weights=False, lora_alpha=4)
    )
    lora = model.base_model.model.attn.out_proj
    x = torch.randn(2, 5, E, dtype=torch.float64)
    got = model(x)
    plain = _layer(seed=1)
    state = {n: t for n, t in model.base_model.model.attn.state_dict().items() if "lora" not in n}
    state = {n.replace("base_layer.", ""): t for n, t in state.items()}
    plain.load_state_dict(state)
    with torch.no_grad():
        delta = lora.lora_B["default"].weight @ lora.lora_A["default"].weight * lora.scaling["default"]
        assert delta.abs().max() > 0
        plain.out_proj.weight += delta
    torch.testing.assert_close(got, plain(x, x, x, need_weights=False)[0], rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert lora.lora_B["default"].weight.grad is not None and lora.lora_B["default"].weight.grad.abs().max() > 0


# Not ("encoder", "eval"): torch's own encoder layer fails there under this wrapper
# (its fast-path check reads self_attn.batch_first), and the converted layer runs torch's forward.
@pytest.mark.parametrize(("kind", "mode"), [("encoder", "train"), ("decoder", "train"), ("decoder", "eval")])
def test_peft_target_parameters_in_a_converted_transformer_layer(kind: str, mode: str) -> None:
    """PEFT's ``target_parameters=[..."in_proj_weight"]`` replaces the layer's
    ``self_attn`` (and ``multihead_attn``) by a wrapper holding the attention as
    its base layer; torch's own layer runs that way, so the converted layer
    must too (its shape checks read the attention's sizes through the wrapper:
    a raw AttributeError before), with the same result as torch's layer."""
    from damcha_torch import ensure_torchvision_importable, replace_mha

    ensure_torchvision_importable()
    peft = pytest.importorskip("peft")
    cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    targets = ["0.self_attn.in_proj_weight"] + (["0.multihead_attn.in_proj_weight"] if kind == "decoder" else [])
    g = torch.Generator().manual_seed(3)
    x, memory = torch.randn(2, 5, E, generator=g), torch.randn(2, 4, E, generator=g)
    outs = {}
    for impl in ("mha", "damcha"):
        torch.manual_seed(0)
        model = nn.Sequential(cls(E, H, 16, dropout=0.0, batch_first=True))
        if impl == "damcha":
            model = replace_mha(model)
        torch.manual_seed(1)  # the same adapter weights on both sides
        config = peft.LoraConfig(r=2, target_modules=[], target_parameters=targets, init_lora_weights=False)
        wrapped = getattr(peft.get_peft_model(model, config), mode)()
        layer = wrapped.base_model.model[0]
        assert type(layer.self_attn).__name__ == "ParamWrapper"
        out = layer(x) if kind == "encoder" else layer(x, memory)
        outs[impl] = out
        if mode == "train":
            out.sum().backward()
            grads = [p.grad for n, p in wrapped.named_parameters() if "lora_B" in n]
            assert len(grads) == len(targets) and all(g is not None and g.abs().max() > 0 for g in grads)
    assert isinstance(layer.self_attn.get_base_layer(), DamchaAttention)  # the converted side ran DAMCHA
    torch.testing.assert_close(outs["damcha"], outs["mha"], rtol=1e-5, atol=1e-6)


# ------------------------------------------------ each tool on each projection weight, against MHA
# Small sizes of their own; kdim/vdim differ from embed_dim in the "separate" layout, so
# q/k/v_proj_weight are the registered parameters (as in nn.MultiheadAttention).
E8, H2, KDIM, VDIM = 8, 2, 6, 5
WEIGHTS = [("packed", "in_proj_weight"), ("separate", "q_proj_weight"), ("separate", "k_proj_weight")]


class _Bend(nn.Module):
    """A parametrization of our own (no right_inverse): w -> 1.5 w - 0.2 w^2."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 1.5 * w - 0.2 * w * w


def _quiet(call):  # the old-style weight_norm warns that it is deprecated
    def apply(module: nn.Module, name: str) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call(module, name)

    return apply


# tool: (apply, remove, names of the tool's own parameters for `name`)
WEIGHT_TOOLS = {
    "weight_norm": (
        weight_norm,
        lambda m, n: parametrize.remove_parametrizations(m, n),
        lambda n: [f"parametrizations.{n}.original0", f"parametrizations.{n}.original1"],
    ),
    "spectral_norm": (
        spectral_norm,
        lambda m, n: parametrize.remove_parametrizations(m, n),
        lambda n: [f"parametrizations.{n}.original"],
    ),
    "register_parametrization": (
        lambda m, n: parametrize.register_parametrization(m, n, _Bend()),
        lambda m, n: parametrize.remove_parametrizations(m, n),
        lambda n: [f"parametrizations.{n}.original"],
    ),
    "prune": (lambda m, n: prune.l1_unstructured(m, n, amount=0.3), prune.remove, lambda n: [f"{n}_orig"]),
    "old weight_norm": (
        _quiet(nn.utils.weight_norm),
        _quiet(nn.utils.remove_weight_norm),
        lambda n: [f"{n}_g", f"{n}_v"],
    ),
    "old spectral_norm": (nn.utils.spectral_norm, nn.utils.remove_spectral_norm, lambda n: [f"{n}_orig"]),
}


def _pair(layout: str) -> tuple[nn.MultiheadAttention, DamchaAttention]:
    """An MHA and its DamchaAttention copy (gates 0: DAMCHA is MHA)."""
    torch.manual_seed(3)
    dims = {"kdim": KDIM, "vdim": VDIM} if layout == "separate" else {}
    mha = nn.MultiheadAttention(E8, H2, batch_first=True, dtype=torch.float64, **dims)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    return mha, DamchaAttention.from_mha(mha)


def _inputs(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, E8, dtype=torch.float64, generator=g)
    k = torch.randn(2, 5, KDIM if layout == "separate" else E8, dtype=torch.float64, generator=g)
    v = torch.randn(2, 5, VDIM if layout == "separate" else E8, dtype=torch.float64, generator=g)
    mask = torch.randn(4, 5, dtype=torch.float64, generator=g)  # keeps MHA off its fused kernel
    return x, k, v, mask


def _apply(tool: str, module: nn.Module, name: str) -> None:
    """The tool, then its parameters moved (the same in every module): weight
    norms start at the weight itself, so without it their effective weight
    would be the original one and a module ignoring the tool would pass."""
    torch.manual_seed(5)  # spectral norms start their power iteration from a random vector
    WEIGHT_TOOLS[tool][0](module, name)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n in WEIGHT_TOOLS[tool][2](name):
            p = module.get_parameter(n)
            p.mul_(1 + 0.5 * torch.randn(p.shape, dtype=p.dtype, generator=g))


def _run(module: nn.Module, layout: str) -> torch.Tensor:
    x, k, v, mask = _inputs(layout)
    return module(x, k, v, attn_mask=mask)[0]


def _metric_keys(layer: DamchaAttention) -> set[str]:
    return {n for n in layer.state_dict() if n.startswith(("metric_gates.", "metric_generators."))}


@pytest.mark.parametrize("tool", list(WEIGHT_TOOLS))
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_weight_tool_on_projection_weight_equals_multihead_attention(layout: str, name: str, tool: str) -> None:
    """Each tool on in_proj_weight (packed) or q/k_proj_weight (separate: kdim,
    vdim != embed_dim) applies as on nn.MultiheadAttention, the forward uses the
    effective weight (output and every gradient equal MHA's under the same
    tool, in training: spectral norms step their power iteration once per
    forward in both), the tool's parameters get gradients, and state_dict
    has MHA's keys plus the metric ones."""
    mha, layer = _pair(layout)
    for module in (mha, layer):
        _apply(tool, module, name)
    names = WEIGHT_TOOLS[tool][2](name)
    own = dict(layer.named_parameters())
    assert set(names) <= set(own) and name not in layer._parameters
    assert set(layer.state_dict()) - _metric_keys(layer) == set(mha.state_dict())
    want, got = _run(mha, layout), _run(layer, layout)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    (want * want).sum().backward()
    (got * got).sum().backward()
    for n, p in mha.named_parameters():
        assert p.grad is not None and own[n].grad is not None, n
        torch.testing.assert_close(own[n].grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)
    assert all(own[n].grad.abs().max() > 0 for n in names)
    # The effective weight differs from the original one, so the outputs above
    # could not have matched with the tool ignored by one of the two modules.
    plain, _ = _pair(layout)
    assert (_run(plain, layout) - want).abs().max() > 1e-6


@pytest.mark.parametrize("tool", list(WEIGHT_TOOLS))
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_weight_tool_removal_leaves_a_plain_parameter(layout: str, name: str, tool: str) -> None:
    """prune.remove, remove_parametrizations (leave_parametrized) and the old
    remove_* register the effective weight again as a plain parameter, as on
    MHA: the class is DamchaAttention again and the output is unchanged."""
    mha, layer = _pair(layout)
    for module in (mha, layer):
        _apply(tool, module, name)
        module.eval()  # spectral norms: no power-iteration step, the weight stays put
    before = _run(layer, layout).detach()
    for module in (mha, layer):
        WEIGHT_TOOLS[tool][1](module, name)
    assert type(layer) is DamchaAttention and type(mha) is nn.MultiheadAttention
    assert type(layer._parameters[name]) is nn.Parameter
    assert set(layer.state_dict()) - _metric_keys(layer) == set(mha.state_dict())
    assert not any(n.endswith(("_orig", "_g", "_v", "_mask", "_u")) for n in layer.state_dict())
    torch.testing.assert_close(_run(layer, layout), before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_run(layer, layout), _run(mha, layout), rtol=1e-10, atol=1e-12)
    # Registered as before: the tool applies again.
    _apply(tool, layer, name)
    assert name not in layer._parameters


@pytest.mark.parametrize("tool", list(WEIGHT_TOOLS))
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_weight_tool_state_dict_round_trips_and_loads_mha_state(layout: str, name: str, tool: str) -> None:
    """The state_dict of a layer under a tool loads into a fresh layer under
    the same tool (and MHA's into it, strict=False: only the metric keys are
    missing); copy.deepcopy works where it works on MHA (pruning and the old
    tools keep a computed, non-leaf tensor that deepcopy refuses on both)."""
    mha, layer = _pair(layout)
    for module in (mha, layer):
        _apply(tool, module, name)
        module.eval()
    want = _run(mha, layout).detach()
    torch.testing.assert_close(_run(layer, layout), want, rtol=1e-10, atol=1e-12)  # both ran a forward
    for state, strict in ((layer.state_dict(), True), (mha.state_dict(), False)):
        _, fresh = _pair(layout)
        with torch.no_grad():
            fresh.in_proj_bias.zero_()  # differs from the source until loaded
        _apply(tool, fresh, name)
        result = fresh.load_state_dict(state, strict=strict)
        if not strict:
            assert set(result.missing_keys) == _metric_keys(fresh) and not result.unexpected_keys
        torch.testing.assert_close(_run(fresh.eval(), layout), want, rtol=1e-10, atol=1e-12)
    try:
        copy.deepcopy(mha)
        mha_copies = True
    except RuntimeError:
        mha_copies = False
    if mha_copies:
        torch.testing.assert_close(_run(copy.deepcopy(layer), layout), want, rtol=1e-10, atol=1e-12)
    else:
        with pytest.raises(RuntimeError, match="deepcopy"):
            copy.deepcopy(layer)


@pytest.mark.parametrize("tool", ["weight_norm", "prune", "old spectral_norm"])
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_from_mha_copies_the_effective_weight_of_a_tool(layout: str, name: str, tool: str) -> None:
    mha, _ = _pair(layout)
    _apply(tool, mha, name)
    mha.eval()
    # Pruning and the old tools recompute the weight they set on the module in a
    # forward pre-hook (so, on MHA too, it is current after a forward).
    want = _run(mha, layout)
    layer = DamchaAttention.from_mha(mha)
    assert type(layer._parameters[name]) is nn.Parameter  # the weight, not the tool
    torch.testing.assert_close(_run(layer, layout), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tool", ["weight_norm", "prune", "old weight_norm"])
def test_packed_views_follow_a_tool_on_in_proj_weight(tool: str) -> None:
    """Code written for MHA reads q/k/v_proj_weight (`_qkv_same_embed_dim` is
    False here): on a packed layer under a tool they are the effective weight's
    rows, and F.multi_head_attention_forward on them equals the layer."""
    mha, layer = _pair("packed")
    for module in (mha, layer):
        _apply(tool, module, "in_proj_weight")
        _run(module, "packed")  # see test_from_mha_copies_the_effective_weight_of_a_tool
    effective = mha.in_proj_weight.detach()
    assert "q_proj_weight" in layer._parameters and layer._parameters["q_proj_weight"] is None  # as MHA
    for i, n in enumerate(("q_proj_weight", "k_proj_weight", "v_proj_weight")):
        torch.testing.assert_close(getattr(layer, n), effective[i * E8 : (i + 1) * E8], rtol=0, atol=0)
    x, k, v, mask = _inputs("packed")
    q_, k_, v_ = (t.transpose(0, 1) for t in (x, k, v))
    want = nn.functional.multi_head_attention_forward(
        q_, k_, v_, E8, H2, None, layer.in_proj_bias, None, None, False, 0.0,
        layer.out_proj.weight, layer.out_proj.bias, training=False, attn_mask=mask,
        use_separate_proj_weight=True, q_proj_weight=layer.q_proj_weight,
        k_proj_weight=layer.k_proj_weight, v_proj_weight=layer.v_proj_weight,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(_run(layer, "packed"), want, rtol=1e-10, atol=1e-12)


def test_separate_weight_names_are_absent_where_mha_lacks_them() -> None:
    """A separate layer whose q_proj_weight a tool has just removed has no such
    attribute (the tools check hasattr before registering it again); MHA's error."""
    _, layer = _pair("separate")
    del layer.q_proj_weight
    assert not hasattr(layer, "q_proj_weight")
    with pytest.raises(AttributeError, match="'DamchaAttention' object has no attribute 'q_proj_weight'"):
        layer.q_proj_weight  # noqa: B018


@pytest.mark.parametrize("tool", list(WEIGHT_TOOLS))
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_reset_parameters_reinitialises_what_a_tool_trains(layout: str, name: str, tool: str) -> None:
    """reset_parameters with a tool on a projection weight keeps the tool and
    gives its trained tensors the values that applying the tool to a freshly
    reset layer gives them (nn.MultiheadAttention's reset writes into the
    tool's computed weight and changes nothing); the attribute shows the new
    effective weight at once."""
    _, layer = _pair(layout)
    _apply(tool, layer, name)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    torch.manual_seed(11)
    layer.reset_parameters()
    _, fresh = _pair(layout)
    torch.manual_seed(11)
    fresh.reset_parameters()
    WEIGHT_TOOLS[tool][0](fresh, name)
    own, want = dict(layer.named_parameters()), dict(fresh.named_parameters())
    assert set(own) == set(want) == set(before)
    for n in WEIGHT_TOOLS[tool][2](name):
        assert not torch.equal(own[n], before[n]), n  # the reset reached the tool's tensor
    for n, p in want.items():
        if not n.startswith("metric_generators."):  # the layer's reset leaves shared generators alone
            torch.testing.assert_close(own[n], p, rtol=1e-12, atol=0, msg=n)
    if tool == "prune":
        mask = getattr(layer, f"{name}_mask")
        torch.testing.assert_close(getattr(layer, name), own[f"{name}_orig"] * mask, rtol=0, atol=0)
    elif "spectral" not in tool:  # spectral norms' power-iteration vectors are the tool's own state
        torch.testing.assert_close(getattr(layer, name), getattr(fresh, name), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("tool", ["weight_norm", "prune", "old weight_norm"])
def test_reset_parameters_under_a_tool_on_out_proj_and_generator(tool: str) -> None:
    """The same for out_proj.weight (weight_norm on an output projection is
    common) and for a generator's kernel under the generator's own reset."""
    layer = _layer()
    gen = layer.metric_generators["qk"]
    _apply(tool, layer.out_proj, "weight")
    _apply(tool, gen, "weight")
    torch.manual_seed(12)
    layer.reset_parameters()
    gen.reset_parameters()
    fresh = _layer()
    torch.manual_seed(12)
    fresh.reset_parameters()
    fresh.metric_generators["qk"].reset_parameters()
    WEIGHT_TOOLS[tool][0](fresh.out_proj, "weight")
    WEIGHT_TOOLS[tool][0](fresh.metric_generators["qk"], "weight")
    want = dict(fresh.named_parameters())
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-12, atol=0, msg=n)
    assert all(not g.detach().any() for g in layer.metric_gates.values())


class _Double(nn.Module):
    """A parametrization with an exact right_inverse: w -> 2 w."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / 2


@pytest.mark.parametrize(
    "chain",
    [("weight_norm", "bend"), ("double", "bend"), ("bend", "double"), ("double", "double")],
    ids="+".join,
)
def test_reset_parameters_under_a_chain_of_parametrizations(chain: tuple[str, str]) -> None:
    """Two parametrizations on one weight, with and without right_inverse (or
    several originals): the reset leaves what registering the chain on a freshly
    reset layer leaves, parameter for parameter, so the effective weights agree."""
    make = {"bend": _Bend, "double": _Double}

    def apply(module: nn.Module) -> None:
        for tool in chain:
            if tool == "weight_norm":
                weight_norm(module, "in_proj_weight")
            else:
                parametrize.register_parametrization(module, "in_proj_weight", make[tool]())

    _, layer = _pair("packed")
    apply(layer)
    torch.manual_seed(13)
    layer.reset_parameters()
    _, fresh = _pair("packed")
    torch.manual_seed(13)
    fresh.reset_parameters()
    apply(fresh)
    want = dict(fresh.named_parameters())
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-12, atol=0, msg=n)
    torch.testing.assert_close(layer.in_proj_weight, fresh.in_proj_weight, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("tool", ["weight_norm", "old weight_norm", "prune", "double"])
@pytest.mark.parametrize("layout, name", WEIGHTS)
def test_canonical_io_under_a_tool_reads_and_writes_the_effective_weight(layout: str, name: str, tool: str) -> None:
    """to_canonical, save, load_canonical and canonical_grads read named_parameters() by
    name and raised a bare KeyError ('q_proj_weight', 'out_proj.weight') under any tool.
    Now the effective weight is exported (equal to a plain layer holding it, checked against
    the reference forward) and loaded through the tool as reset_parameters writes it."""
    import damcha_core as dc

    _, layer = _pair(layout)
    if tool == "double":
        parametrize.register_parametrization(layer, name, _Double())
    else:
        _apply(tool, layer, name)
    layer.train(False)
    _run(layer, layout)  # the old tools and pruning set the effective weight in a pre-hook
    params = layer.to_canonical()
    _, plain = _pair(layout)
    plain = _plain_copy(layer, plain)
    want = plain.to_canonical()
    for key in want:
        assert (params[key] == want[key]).all(), key
    torch.testing.assert_close(_run(plain, layout), _run(layer, layout), rtol=1e-12, atol=1e-13)
    # Load other values: the effective weight becomes them (exactly where the tool is invertible).
    _, other = _pair(layout)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    new = other.to_canonical()
    layer.load_canonical(new)
    _run(layer, layout)
    got = layer.to_canonical()
    pruned = {"in_proj_weight": ("query", "key", "value"), "q_proj_weight": ("query",), "k_proj_weight": ("key",)}
    for key in new:
        if tool == "prune" and key.endswith(".kernel") and key.split(".")[0] in pruned[name]:
            assert (got[key][new[key] != got[key]] == 0).all()  # the mask is kept: pruned entries read 0
            continue
        torch.testing.assert_close(
            torch.from_numpy(got[key]), torch.from_numpy(new[key]), rtol=1e-12, atol=1e-14, msg=key
        )
    with pytest.raises(dc.DamchaValueError, match=r"canonical_grads reads .* Received: a tool on"):
        layer.canonical_grads()


def test_load_canonical_into_a_meta_layer_is_refused() -> None:
    """Copying into meta tensors does nothing: load_canonical returned the layer still on meta
    and its first forward raised torch's own error."""
    import damcha_core as dc

    cfg = dc.DamchaConfig(8, 2, 4)
    layer = DamchaAttention(8, 2, device="meta")
    with pytest.raises(dc.DamchaValueError, match=r"on the meta device and hold no values; materialise them first"):
        layer.load_canonical(dc.init_params(cfg))


def test_old_spectral_norm_on_a_generator_trains_its_original() -> None:
    """The old hook-based spectral_norm on a generator weight: its hook would
    normalise the weight on a call of the generator, which the layer never
    makes, so the forward read the weight as of the tool's application and
    weight_orig got no gradient (a reviewer's find). The layer computes the
    normalised weight itself, with the hook's power iteration in training:
    weight_orig trains, and the output equals a plain layer holding W / sigma."""
    layer = _layer().train()
    TOOLS["old_spectral_norm(generator)"](layer)
    generator = layer.metric_generators["qk"]
    x = torch.randn(2, 5, E, dtype=torch.float64)
    for _ in range(2):
        layer.zero_grad()
        layer(x, x, x, need_weights=False)[0].square().sum().backward()
        assert generator.weight_orig.grad is not None and generator.weight_orig.grad.abs().max() > 0
        with torch.no_grad():
            generator.weight_orig.sub_(0.1 * generator.weight_orig.grad)
    layer.eval()  # no power iteration: W / sigma with sigma = u . (W v), the tool's definition
    with torch.no_grad():
        sigma = torch.dot(generator.weight_u, generator.weight_orig @ generator.weight_v)
        plain = _plain_copy(layer, _layer(seed=1).eval())
        plain.metric_generators["qk"].weight.copy_(generator.weight_orig / sigma)
    want = plain(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(layer(x, x, x, need_weights=False)[0], want, rtol=1e-12, atol=1e-12)
