"""PyTorch's weight tools on DamchaAttention, as on nn.MultiheadAttention:
parametrizations (weight_norm, spectral_norm), pruning, quantize_dynamic and
PEFT LoRA. Each result equals a plain layer (or nn.MultiheadAttention) holding
the effective weights, and the gradients reach the tools' own parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from damcha_torch import DamchaAttention

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
        effective[name] = getattr(module, leaf).detach().clone()
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
}


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
    """kdim != embed_dim: q/k/v_proj_weight are parameters (properties of the class), prunable as on MHA."""
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
