"""Canonical parameter I/O of the torch port on layers and stacks that tools have changed:
PEFT LoRA (the effective weight read, loads refused by name), weight tools on a stack's
feed-forward and norms (loads go through the tool), stacks outside the format (norms without
scale or bias, feed-forward without bias, quantized feed-forward: refused by name), keywords
that the config sets, and stacks whose attention has no biases (built, as in the other ports).
Values are checked against the NumPy reference or the module's own forward."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, prune

import damcha_core as dc
import damcha_onnx as do
import damcha_torch as dt
from damcha_torch import DamchaAttention, DamchaTransformerEncoder, build_encoder

E, H, F = 8, 2, 16


def _peft() -> Any:
    dt.ensure_torchvision_importable()
    return pytest.importorskip("peft")


def _open_gates(module: nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "metric_gates" in name:
                p.uniform_(0.3, 1.0)


def _encoder(seed: int = 0, **kw: Any) -> DamchaTransformerEncoder:
    torch.manual_seed(seed)
    kw = {"dropout": 0.0, "dtype": torch.float64, "dim_feedforward": F, **kw}
    enc = build_encoder(E, H, 2, **kw).eval()
    _open_gates(enc)
    return enc


def _x(n: int = 5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).normal(size=(2, n, E)))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The float tensors of ``module``'s state (a quantized layer's packed weights aside)."""
    state = module.state_dict().items()
    return {k: v.detach().clone() for k, v in state if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _state(module)
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)


# ------------------------------------------------------------------ PEFT LoRA


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = DamchaAttention(E, H, batch_first=True, dtype=torch.float64).eval()
        _open_gates(self.attn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _lora_block(**lora: Any) -> tuple[Any, DamchaAttention]:
    peft = _peft()
    config = peft.LoraConfig(r=2, target_modules=["out_proj"], init_lora_weights=False, lora_alpha=4, **lora)
    model = peft.get_peft_model(_Block(), config).eval()
    return model, model.base_model.model.attn


@pytest.mark.parametrize("state", ["active", "merged", "disabled"])
def test_peft_lora_layer_to_canonical_reads_the_weight_the_forward_uses(state: str, tmp_path) -> None:
    model, attn = _lora_block()
    x = _x()
    if state == "merged":
        model.merge_adapter()
    context = model.disable_adapter() if state == "disabled" else warnings.catch_warnings()
    with context, torch.no_grad():
        want = model(x).numpy()
        params = attn.to_canonical()
        attn.save(tmp_path / "layer.safetensors")
    np.testing.assert_allclose(dc.damcha_attention(params, attn.config, x.numpy()), want, rtol=1e-12, atol=1e-12)
    loaded, _ = dc.load_params(tmp_path / "layer.safetensors")
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value)
    lora = attn.out_proj
    delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight * lora.scaling["default"]).detach()
    base = attn.out_proj.base_layer.weight.detach()
    if state != "disabled":  # the update is in what was read (in the base weight itself once merged)
        assert delta.abs().max() > 0.01
        np.testing.assert_allclose(
            params["output.kernel"].reshape(-1, E),
            (base + (0 if state == "merged" else delta)).T.numpy(),
            rtol=1e-12,
            atol=1e-12,
        )


def test_peft_lora_stack_to_canonical_and_onnx_read_the_weights_the_forward_uses() -> None:
    peft = _peft()
    enc = _encoder(norm_first=True, activation="gelu", final_norm=True)
    config = peft.LoraConfig(r=2, target_modules=["out_proj", "linear1", "linear2"], init_lora_weights=False)
    model = peft.get_peft_model(enc, config).eval()
    x = _x()
    with torch.no_grad():
        want = model(x).numpy()
    params, cfg = enc.to_canonical()
    np.testing.assert_allclose(dc.encoder_forward(params, cfg, x.numpy()), want, rtol=1e-12, atol=1e-12)
    exported, _ = do.encoder_from_torch(enc)
    for name, value in params.items():
        np.testing.assert_array_equal(exported[name], value)


def test_peft_lora_variant_is_refused_by_name() -> None:
    _, attn = _lora_block(use_dora=True)
    with pytest.raises(dc.DamchaValueError, match=r"`out_proj`.*LoRA variant \(DoRA.*merge_and_unload\(\)"):
        attn.to_canonical()


@pytest.mark.parametrize("target", ["norm1", "norm"], ids=["layer-norm1", "final-norm"])
@pytest.mark.parametrize("call", ["to_canonical", "encoder_from_torch", "load_canonical"])
def test_peft_ln_tuning_on_a_stack_norm_is_refused_by_name(target: str, call: str) -> None:
    """PEFT's LN tuning wraps a norm whose forward uses the adapter's copy:
    refused naming the wrapped norm (a raw AttributeError on norm1 before, a
    message blaming the epsilon on the final norm), and a load writes nothing."""
    peft = _peft()
    enc = _encoder(final_norm=True)
    params, _ = enc.to_canonical()
    peft.get_peft_model(enc, peft.LNTuningConfig(target_modules=[target]))
    before = _state(enc)
    run = {
        "to_canonical": lambda: enc.to_canonical(),
        "encoder_from_torch": lambda: do.encoder_from_torch(enc),
        "load_canonical": lambda: enc.load_canonical(params),
    }[call]
    path = "layers.0.norm1" if target == "norm1" else "norm"
    with pytest.raises(dc.DamchaValueError, match=rf"`{path}`.*a LayerNorm, not a PEFT wrapper.*merge_and_unload"):
        run()
    _assert_unchanged(enc, before)


Target = tuple[nn.Module, Callable[[Any], Any], dict[str, np.ndarray], str]


def _lora_layer_target() -> Target:
    model, attn = _lora_block()
    return model, attn.load_canonical, dc.init_params(attn.config, seed=5), "out_proj"


def _lora_stack_target(module: str) -> Callable[[], Target]:
    def make() -> Target:
        peft = _peft()
        enc = _encoder()
        # Layer 1 only: a refusal found there must come before layer 0 is written.
        config = peft.LoraConfig(r=2, target_modules=[module], layers_to_transform=[1], init_lora_weights=False)
        config.layers_pattern = "layers"
        model = peft.get_peft_model(enc, config)
        path = "layers.1.self_attn.out_proj" if module == "out_proj" else f"layers.1.{module}"
        return model, enc.load_canonical, _encoder(seed=3).to_canonical()[0], path

    return make


@pytest.mark.parametrize(
    "make",
    [_lora_layer_target, _lora_stack_target("out_proj"), _lora_stack_target("linear2")],
    ids=["layer-out_proj", "stack-layer1-out_proj", "stack-layer1-linear2"],
)
def test_peft_lora_load_canonical_is_refused_by_name_and_changes_nothing(make) -> None:
    model, load, params, path = make()  # params: other values than the model's, so a partial load would show
    before = _state(model)
    with pytest.raises(dc.DamchaValueError, match=rf"Invalid argument `{path}`: .*PEFT.*merge_and_unload\(\)"):
        load(params)
    _assert_unchanged(model, before)


# ------------------------------------------------------------------ weight tools on a stack


def _weight_norm(enc: nn.Module) -> None:
    parametrizations.weight_norm(enc.layers[0].linear1)


def _old_weight_norm(enc: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm's deprecation
        torch.nn.utils.weight_norm(enc.layers[1].linear2)


def _prune(enc: nn.Module) -> None:
    prune.l1_unstructured(enc.layers[0].linear2, "weight", amount=0.0)  # a mask of ones
    prune.l1_unstructured(enc.layers[1].norm2, "weight", amount=0.0)
    prune.l1_unstructured(enc.norm, "bias", amount=0.0)


@pytest.mark.parametrize(
    "tool", [_weight_norm, _old_weight_norm, _prune], ids=["weight_norm", "old-weight_norm", "prune-ffn-norms"]
)
def test_stack_load_canonical_writes_through_weight_tools(tool) -> None:
    source = _encoder(seed=1, final_norm=True)
    params, config = source.to_canonical()
    enc = _encoder(seed=2, final_norm=True)
    tool(enc)
    enc.load_canonical(params)
    got, _ = enc.to_canonical()
    for name, value in params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-14, atol=1e-14, err_msg=name)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(enc(x), source(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dc.encoder_forward(params, config, x.numpy()), enc(x).detach().numpy(), atol=1e-12)


# ------------------------------------------------------------------ stacks outside the format


def _set(path: str, module: nn.Module) -> Callable[[nn.Module], None]:
    def change(enc: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        setattr(enc.get_submodule(parent) if parent else enc, name, module)

    return change


def _no_bias_linear2(enc: nn.Module) -> None:
    enc.layers[0].linear2 = nn.Linear(F, E, bias=False, dtype=torch.float64)


def _quantize(enc: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        return torch.ao.quantization.quantize_dynamic(enc.float(), {nn.Linear}, dtype=torch.qint8)


def _plain_norm(**kw: Any) -> nn.LayerNorm:
    return nn.LayerNorm(E, dtype=torch.float64, **kw)


@pytest.mark.parametrize(
    "change, pattern",
    [
        (_set("norm", _plain_norm(elementwise_affine=False)), r"final LayerNorm with a scale and a bias \(norm has "),
        (_set("norm", _plain_norm(bias=False)), r"final LayerNorm with a scale and a bias \(norm has bias=None\)"),
        (_set("layers.1.norm1", _plain_norm(elementwise_affine=False)), r"layers.1 has norm1.weight=None, norm1.bias"),
        (_set("layers.1.norm2", _plain_norm(bias=False)), r"\(layers.1 has norm2.bias=None\)"),
        (_no_bias_linear2, r"\(layers.0 has linear2.bias=None\)"),
        (_quantize, r"quantized feed-forward layers.0.linear1, .*: take canonical weights before quantizing"),
    ],
    ids=[
        "final-norm-no-affine",
        "final-norm-no-bias",
        "norm1-no-affine",
        "norm2-no-bias",
        "linear2-no-bias",
        "quantized",
    ],
)
def test_stack_outside_the_format_is_refused_by_name(change, pattern) -> None:
    params, _ = _encoder(seed=3, final_norm=True).to_canonical()
    enc = _encoder(final_norm=True)
    enc = change(enc) or enc
    before = _state(enc)
    full = r"Invalid argument `encoder`: expected a stack that fits the stack format .*" + pattern
    for call in (enc.to_canonical, lambda: enc.load_canonical(params), lambda: do.encoder_from_torch(enc)):
        with pytest.raises(dc.DamchaValueError, match=full):
            call()
    _assert_unchanged(enc, before)


# ------------------------------------------------------------------ from_canonical's keywords


@pytest.mark.parametrize(
    "kwargs",
    [{"num_heads": 4}, {"metric": "none"}, {"num_kv_heads": 1}, {"bias": False}, {"kdim": 6}],
    ids=lambda kw: next(iter(kw)),
)
@pytest.mark.parametrize("entry", ["from_canonical", "load"])
def test_from_canonical_refuses_a_keyword_the_config_sets(entry: str, kwargs: dict[str, Any], tmp_path) -> None:
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=4)
    params = dc.init_params(config)
    name = next(iter(kwargs))
    pattern = rf"Invalid argument `{name}`: expected no keyword the config sets .*Received: {name}="
    with pytest.raises(dc.DamchaTypeError, match=pattern):
        if entry == "load":
            dc.save_params(tmp_path / "p.safetensors", params, config)
            DamchaAttention.load(tmp_path / "p.safetensors", **kwargs)
        else:
            DamchaAttention.from_canonical(params, config, **kwargs)


def test_from_canonical_names_an_unknown_keyword_and_takes_its_own() -> None:
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=4)
    params = dc.init_params(config)
    with pytest.raises(dc.DamchaTypeError, match=r"`colour`: expected the keywords from_canonical takes .*batch_first"):
        DamchaAttention.from_canonical(params, config, colour="red")
    layer = DamchaAttention.from_canonical(params, config, batch_first=True, dtype=torch.float64)
    assert layer.batch_first and layer.config == config


# ------------------------------------------------------------------ stacks without attention biases


@pytest.mark.parametrize(
    "arch",
    [
        dict(norm_first=False, activation="relu", final_norm=False),
        dict(norm_first=True, activation="gelu_tanh", final_norm=True, share_metric=False),
    ],
    ids=["post-norm-relu", "pre-norm-gelu-tanh-final"],
)
def test_stack_from_canonical_with_attention_without_biases(arch: dict[str, Any]) -> None:
    attention = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=4, use_bias=False)
    config = dc.EncoderConfig(attention, num_layers=2, ffn_dim=F, norm_eps=1e-6, causal=True, **arch)
    rng = np.random.default_rng(0)
    params = {n: v + 0.2 * rng.normal(size=v.shape) for n, v in dc.init_encoder_params(config).items()}
    enc = DamchaTransformerEncoder.from_canonical(params, config, dtype=torch.float64).eval()
    for layer in enc.layers:
        assert layer.self_attn.in_proj_bias is None and layer.self_attn.out_proj.bias is None
        assert layer.linear1.bias is not None and layer.norm2.bias is not None
    x = _x()
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    with torch.no_grad():
        got = enc(x, mask=mask, is_causal=True).numpy()
    np.testing.assert_allclose(got, dc.encoder_forward(params, config, x.numpy()), rtol=1e-12, atol=1e-12)
    back, back_config = enc.to_canonical(causal=True)
    assert back_config == config
    for name, value in params.items():
        np.testing.assert_array_equal(back[name], value)
    twin = copy.deepcopy(enc)
    twin.load_canonical(back)  # and it loads into its own kind


def test_a_wrapper_in_place_of_the_metric_generator_is_named() -> None:
    """PEFT's target_parameters on a generator's weight puts a wrapper in the
    generator's place; the layer reads its generator's weights itself, so the
    wrapper would not apply: the call is refused naming the generator (a bare
    AssertionError before)."""
    peft = _peft()
    torch.manual_seed(0)
    attn = DamchaAttention(E, H, batch_first=True, dtype=torch.float64)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    config = peft.LoraConfig(r=2, target_modules=[], target_parameters=["attn.metric_generators.qk.weight"])
    model = peft.get_peft_model(Holder(), config)
    assert not isinstance(attn.metric_generators["qk"], dt.MetricGenerator)
    with pytest.raises(dc.DamchaTypeError, match=r"`metric_generators\.qk`.*MetricGenerator.*not applied"):
        model(_x())
