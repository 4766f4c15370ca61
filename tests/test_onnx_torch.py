"""torch.onnx.export (dynamo, opset 23) of a model containing damcha_torch.DamchaAttention."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch

import damcha_core as dc
import damcha_onnx as do
import damcha_torch as dt
from damcha_conformance import case_params, tolerance


def _dims(values) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


def _torch_symbols(proto) -> set[str]:
    values = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    return {d.dim_param for v in values for d in v.type.tensor_type.shape.dim if re.search(r"\bs\d+\b", d.dim_param)}


class _Block(torch.nn.Module):
    """A small model around the layer: DAMCHA self-attention -> residual -> linear head."""

    def __init__(self, layer: dt.DamchaAttention, causal: bool) -> None:
        super().__init__()
        self.attn = layer
        self.causal = causal
        self.head = torch.nn.Linear(layer.config.output_dim, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False, is_causal=self.causal)
        return self.head(x + y)


def test_torch_dynamo_export_matches_reference_with_dynamic_shapes(tmp_path):
    # One export only: dynamo tracing costs tens of seconds. The config covers
    # an open cross-head map, GQA and the causal rule at once.
    torch.manual_seed(0)
    causal = True
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, metric="heads", coupling="query", num_kv_heads=2)
    params = case_params(config, 11)
    layer = dt.DamchaAttention.from_canonical(params, config, batch_first=True, dtype=torch.float64)
    model = _Block(layer, causal).eval()
    path = tmp_path / "torch.onnx"
    proto = do.export_torch(
        model, (torch.randn(2, 6, 16, dtype=torch.float64),), path, input_names=["query"], output_names=["logits"]
    )
    assert 23 in {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")}
    # The dynamic dims carry the native exporter's names, not torch.export's s77/s27.
    assert _dims(proto.graph.input) == {"query": ["batch", "query_len", 16]}
    assert _dims(proto.graph.output) == {"logits": ["batch", "query_len", 3]}
    assert not _torch_symbols(proto)
    assert _dims(onnx.load(path).graph.input) == {"query": ["batch", "query_len", 16]}  # the file too
    session = do.ort_session(str(path))
    w, b = model.head.weight.detach().numpy(), model.head.bias.detach().numpy()
    rng = np.random.default_rng(1)
    for B, N in [(2, 6), (3, 11), (1, 1)]:  # batch and length differ from the example input
        x = rng.normal(size=(B, N, 16))
        out = session.run(None, {"query": x})[0]
        expected = (x + dc.damcha_attention(params, config, x, causal=causal)) @ w.T + b
        _, ratio = tolerance("float32").output_ratio(out, expected)
        assert ratio <= 1, (B, N, ratio)


class _Masked(torch.nn.Module):
    def __init__(self, layer: dt.DamchaAttention) -> None:
        super().__init__()
        self.attn = layer

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, attn_mask=hidden, need_weights=False)[0]  # torch convention: True = masked out


def test_torch_export_with_a_4d_mask_and_a_dynamic_shapes_spec():
    """A (B, 1, N, M) mask needs its length dims dynamic too: the caller's
    torch.export spec is used instead of the batch/sequence default."""
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4)
    params = case_params(config, 12)
    model = _Masked(dt.DamchaAttention.from_canonical(params, config, batch_first=True)).eval()
    Dim = torch.export.Dim
    example = (torch.randn(2, 6, 16), torch.zeros(2, 1, 6, 6, dtype=torch.bool))
    spec = ({0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, {0: Dim.DYNAMIC, 2: Dim.DYNAMIC, 3: Dim.DYNAMIC})
    proto = do.export_torch(model, example, input_names=["query", "hidden"], dynamic_shapes=spec)
    # torch.export found the mask's dims equal to the query's: one symbol, one name.
    assert _dims(proto.graph.input) == {
        "query": ["batch", "query_len", 16],
        "hidden": ["batch", 1, "query_len", "query_len"],
    }
    assert not _torch_symbols(proto)
    session = do.ort_session(proto)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 9, 16)).astype(np.float32)
    hidden = rng.random((3, 1, 9, 9)) < 0.3
    hidden[..., 0] = False
    out = session.run(None, {"query": x, "hidden": hidden})[0]
    expected = dc.damcha_attention(params, config, x.astype(np.float64), mask=~hidden)
    _, ratio = tolerance("float32").output_ratio(out, expected)
    assert ratio <= 1, ratio
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `dynamic_shapes`: expected one entry per positional input \(2\)"
    ):
        do.export_torch(model, example, dynamic_shapes=spec[:1])


def test_torch_dim_names_keep_distinct_symbols_distinct():
    # Two inputs whose batch dims torch.export left independent must not both read "batch".
    from onnx import TensorProto, helper

    from damcha_onnx._torch import _name_dynamic_dims

    graph = helper.make_graph(
        [helper.make_node("Identity", ["query"], ["out"])],
        "g",
        [
            helper.make_tensor_value_info("query", TensorProto.FLOAT, ["s3", "s5", 4]),
            helper.make_tensor_value_info("context", TensorProto.FLOAT, ["s7", "s11", 4]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["s3", "s3*s5", 4])],
    )
    proto = helper.make_model(graph)
    _name_dynamic_dims(proto)
    assert _dims(proto.graph.input) == {
        "query": ["batch", "query_len", 4],
        "context": ["batch_context", "context_len", 4],
    }
    assert _dims(proto.graph.output) == {"out": ["batch", "batch*query_len", 4]}


def test_torch_opset_below_torchs_oldest_is_refused_before_tracing(monkeypatch):
    # opset=17 came back as an opset-18 model, silently: a runtime limited to opset 17 then refused it.
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: pytest.fail("traced before the opset check"))
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `opset`: expected an int >= 18 for export_torch.*opset=17"
    ):
        do.export_torch(torch.nn.Linear(4, 2), (torch.randn(2, 3, 4),), opset=17)


def test_torch_opset_past_its_version_converter_is_refused_by_name():
    # torch 2.13 converts the Attention op to opsets 18-25; at 26-28 it left the model at opset 18
    # with that op, and onnx.checker raised a raw ValidationError. The newest opset onnx knows
    # either comes back as asked (a later torch) or is refused naming `opset`, never another opset.
    newest = onnx.defs.onnx_opset_version()
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    layer = dt.DamchaAttention.from_canonical(case_params(config, 3), config, batch_first=True)
    model = _Block(layer, causal=False).float().eval()
    try:
        proto = do.export_torch(model, (torch.randn(2, 3, 8),), opset=newest, input_names=["x"])
    except dc.DamchaValueError as exc:
        assert re.search(rf"Invalid argument `opset`: .*wrote opset \d+ instead.*opset={newest}", str(exc)), exc
    else:
        assert {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {newest}
        x = torch.randn(1, 5, 8)
        out = do.run_ort(proto, {"x": x.numpy()})
        np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
