"""torch.fx sees DAMCHA's torch modules as it sees torch.nn's: one node per call.

torch.fx's tracers never trace into torch.nn's own modules (nn.MultiheadAttention,
the Transformer layers and stacks): each call is one ``call_module`` node. DAMCHA's
modules live outside torch.nn, and their forward (shape and mask checks) cannot be
traced with proxies, so without ``_functional.traced_call`` a model that
``replace_mha`` converted could no longer be traced: torchvision's
``create_feature_extractor``, FX graph-mode quantization and any ``symbolic_trace``
failed with "Proxy object cannot be iterated". Each test traces the same model
before and after conversion and compares the graphs, and compares the traced
module's outputs with the module's own (gates open, so DAMCHA differs from MHA).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.fx
from torch import nn

from damcha_core import DamchaTypeError
from damcha_torch import (
    DamchaAttention,
    DamchaKVCache,
    build_encoder,
    ensure_torchvision_importable,
    replace_mha,
)

E, H = 16, 4


def _open_gates(model: nn.Module) -> nn.Module:
    # Fresh gates are 0 (DAMCHA computes MHA exactly); opened, a wrong graph shows.
    opened = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".metric_gates." in f".{name}":
                p.fill_(0.5)
                opened += 1
    assert opened, "no DAMCHA gate in the model"
    return model


class _Attend(nn.Module):
    """A model that calls its attention the way torch code does: ``kind`` picks the call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, dropout=0.0)
        self.proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor, pad: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        if self.kind == "default":
            y, w = self.attn(x, x, x)
            return self.proj(y) + w.sum()
        if self.kind == "no-weights":
            return self.proj(self.attn(x, x, x, need_weights=False)[0])
        if self.kind == "mask+hint":
            y, _ = self.attn(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
            return self.proj(y)
        # key_padding_mask, per-head weights, positional need_weights
        y, w = self.attn(x, x, x, pad, True, average_attn_weights=False)
        return self.proj(y) + w.mean()


def _calls(traced: torch.fx.GraphModule, signatures: dict[str, type[nn.Module]]) -> list[tuple]:
    """The graph's nodes, each call of a module in ``signatures`` with its
    arguments bound to that torch class's forward (defaults filled in): the
    same call whether the arguments were recorded by position or keyword."""
    nodes = []
    for n in traced.graph.nodes:
        args, kwargs = tuple(map(str, n.args)), {k: str(v) for k, v in n.kwargs.items()}
        if n.op == "call_module" and n.target in signatures:
            bound = inspect.signature(signatures[n.target].forward).bind(None, *n.args, **n.kwargs)
            bound.apply_defaults()
            args, kwargs = (), {k: str(v) for k, v in bound.arguments.items() if k != "self"}
        nodes.append((n.op, str(n.target), args, kwargs))
    return nodes


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 5, E)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    return x, pad, causal


@pytest.mark.parametrize("kind", ["default", "no-weights", "mask+hint", "padding+positional"])
def test_symbolic_trace_records_damcha_attention_as_it_records_mha(kind: str) -> None:
    model = _Attend(kind).eval()
    signatures = {"attn": nn.MultiheadAttention}
    mha_graph = _calls(torch.fx.symbolic_trace(model), signatures)
    _open_gates(replace_mha(model))
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["attn", "proj"]
    # The same graph, argument for argument, as the MHA model's.
    assert _calls(traced, signatures) == mha_graph
    inputs = _inputs()
    torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_traced_graph_calls_the_layer_so_its_hooks_run_and_it_trains() -> None:
    model = _open_gates(replace_mha(_Attend("no-weights")))
    traced = torch.fx.symbolic_trace(model)
    seen = []
    model.attn.register_forward_hook(lambda m, args, out: seen.append(out[0].shape))
    inputs = _inputs()
    traced(*inputs).sum().backward()
    assert seen == [torch.Size([2, 5, E])]
    # The graph module holds the model's own layer: gradients reach its generator.
    assert traced.attn is model.attn
    grad = model.attn.metric_gates["qk"].grad
    assert grad is not None and grad.abs().sum() > 0


def test_a_cache_under_fx_tracing_is_refused_by_name() -> None:
    class Decode(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = DamchaAttention(E, H, batch_first=True)
            self.cache = DamchaKVCache()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False, kv_cache=self.cache)[0]

    with pytest.raises(DamchaTypeError, match=r"kv_cache.*torch\.fx.*Received: kv_cache=<.*DamchaKVCache"):
        torch.fx.symbolic_trace(Decode())


class _Holds(nn.Module):
    def __init__(self, inner: nn.Module, call: str) -> None:
        super().__init__()
        self.inner = inner
        self.call = call

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        if self.call == "decoder":
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.inner(x, memory, tgt_mask=mask, tgt_is_causal=True)
        return self.inner(x, is_causal=False)


def _torch_blocks(kind: str) -> nn.Module:
    kw = dict(dim_feedforward=32, dropout=0.0, batch_first=True)
    if kind == "encoder-layer":
        return nn.TransformerEncoderLayer(E, H, **kw)
    if kind == "encoder":
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **kw), 2, enable_nested_tensor=False)
    if kind == "decoder-layer":
        return nn.TransformerDecoderLayer(E, H, **kw)
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **kw), 2)


@pytest.mark.parametrize("kind", ["encoder-layer", "encoder", "decoder-layer", "decoder"])
def test_damcha_transformer_blocks_are_one_node_each(kind: str) -> None:
    """``replace_mha`` turns a plain encoder layer into a DamchaTransformerEncoderLayer
    (torch.nn's class is a leaf, ours must be one too); ``build_encoder``/``build_decoder``
    stacks and layers are recorded as torch's are."""
    torch_block = _torch_blocks(kind)
    call = "decoder" if kind.startswith("decoder") else "encoder"
    signatures = {"inner": type(torch_block)}
    mha_graph = _calls(torch.fx.symbolic_trace(_Holds(torch_block, call)), signatures)
    if kind == "encoder-layer":
        block = replace_mha(torch_block)
        assert type(block).__name__ == "DamchaTransformerEncoderLayer"
    elif kind == "encoder":
        block = build_encoder(E, H, 2, dim_feedforward=32, dropout=0.0)
    else:
        from damcha_torch import build_decoder

        block = build_decoder(E, H, 2, dim_feedforward=32, dropout=0.0)
        if kind == "decoder-layer":
            block = block.layers[0]
    model = _Holds(_open_gates(block), call).eval()
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["inner"]
    assert _calls(traced, signatures) == mha_graph
    x, memory = torch.randn(2, 5, E), torch.randn(2, 3, E)
    torch.testing.assert_close(traced(x, memory), model(x, memory), rtol=0, atol=0)
    # The forward keeps torch's signature (tools read it).
    base = type(torch_block) if kind != "encoder-layer" else nn.TransformerEncoderLayer
    assert inspect.signature(type(block).forward) == inspect.signature(base.forward)


def test_torchvision_feature_extraction_works_on_a_converted_vit() -> None:
    ensure_torchvision_importable()  # PyPI's torchvision beside the CPU torch (docs/models.md)
    from torchvision.models import VisionTransformer
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    torch.manual_seed(0)
    vit = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=H, hidden_dim=E, mlp_dim=32).eval()
    names = get_graph_node_names(vit)
    _open_gates(replace_mha(vit))
    assert get_graph_node_names(vit) == names
    nodes = {"encoder.layers.encoder_layer_1.self_attention": "attention", "encoder.ln": "features"}
    extractor = create_feature_extractor(vit, nodes)
    # The same features read with forward hooks on the converted model itself.
    seen = {}
    vit.encoder.layers.encoder_layer_1.self_attention.register_forward_hook(lambda m, a, out: seen.update(a=out))
    vit.encoder.ln.register_forward_hook(lambda m, a, out: seen.update(f=out))
    image = torch.randn(2, 3, 16, 16)
    vit(image)
    got = extractor(image)
    torch.testing.assert_close(got["attention"][0], seen["a"][0], rtol=0, atol=0)
    torch.testing.assert_close(got["features"], seen["f"], rtol=0, atol=0)


def test_a_model_converted_by_convert_is_refused_under_fx_with_a_clear_error() -> None:
    """``convert`` (transformers, timm) keeps the model's own attention modules and
    computes the maps in hooks around each call, which a symbolic trace runs once
    and never records: the trace is refused by name, not turned into a graph that
    might compute something else. The same model still traces before conversion."""
    import _models_zoo as zoo

    import damcha_torch as dt

    model = zoo.build("vit")
    torch.fx.symbolic_trace(model)  # timm's ViT traces as it is
    dt.convert(model)
    with pytest.raises(DamchaTypeError, match=r"`model`.*damcha_torch\.convert.*Received: timm\..*Attention converted"):
        torch.fx.symbolic_trace(model)


def test_a_graph_traced_before_convert_computes_the_converted_model() -> None:
    """A graph traced from the model before ``convert`` (a feature extractor made
    first, say) keeps calling the same projection modules, which compute each
    token's map from their own input: after conversion the graph gives the
    converted model's outputs, for inputs the model has not just seen (no map
    left over from its last call) and at another batch size."""
    import _models_zoo as zoo

    import damcha_torch as dt

    model = zoo.build("vit", dtype=torch.float64).eval()
    graph = torch.fx.symbolic_trace(model)
    g = torch.Generator().manual_seed(0)
    first, other = (torch.randn(b, 3, 16, 16, generator=g, dtype=torch.float64) for b in (2, 3))
    plain = graph(other)
    dt.convert(model)
    zoo.open_gates(model)
    model(first)  # the model's last call saw other inputs
    converted = model(other)
    assert (converted - plain).abs().max() > 1e-5  # the maps act on these outputs (a tiny model: 3e-4)
    torch.testing.assert_close(graph(other), converted, rtol=1e-12, atol=1e-12)
