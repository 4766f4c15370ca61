"""float16 and float64 stacks, attention weights, padding masks, and the fused mask path.

Every format is checked against the float64 NumPy reference within its
documented tolerance (``damcha_conformance.tolerance``) on catalogue cases:
masks, causal, cross, GQA and decoding.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors
import pytest
from onnx import helper

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import CATALOGUE, DECODE_CATALOGUE, materialise, materialise_decode, tolerance

# What onnxruntime raises when a run's inputs do not fit the graph (a shape check node fails).
ORT_ERRORS = (ort_errors.Fail, ort_errors.InvalidArgument, ort_errors.RuntimeException)

OPSETS = [17, 23]


def _inputs(data, cross=True):
    inputs = {"query": data.query}
    if data.context is not None:
        inputs["context"] = data.context
    if data.value is not None:
        inputs["value"] = data.value
    if data.mask is not None:
        inputs["mask"] = data.mask
    return inputs


def _export(data, opset, dtype, **kw):
    return do.export(
        data.params,
        data.config,
        None,
        opset=opset,
        causal=data.causal,
        cross=data.context is not None,
        mask=data.mask is not None,
        dtype=dtype,
        **kw,
    )


def _decode(model, data, run=do.run_ort):
    session = do.ort_session(model)
    cache, outs = do.empty_kv_cache(model, data.query.shape[0]), []
    for start, stop in data.case.steps:
        step = run(model, {"query": data.query[:, start:stop], **cache}, session=session, all_outputs=True)
        cache = {"past_key": step["present_key"], "past_value": step["present_value"]}
        outs.append(step["output"])
    return np.concatenate(outs[1:], axis=1), step


# ------------------------------------------------------------------ float16


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_float16_catalogue_in_onnxruntime(case, opset):
    data = materialise(case)
    model = _export(data, opset, "float16")
    assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name != "mask"} == {onnx.TensorProto.FLOAT16}
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert all(
        t.data_type != onnx.TensorProto.FLOAT for t in model.graph.initializer if len(t.dims) > 1
    )  # float16 weights
    out = do.run_ort(model, _inputs(data))
    assert out.dtype == np.float16
    _, ratio = tolerance("float16").output_ratio(out, data.expected)
    assert ratio <= 1, ratio


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("case", DECODE_CATALOGUE, ids=lambda c: c.name)
def test_float16_decode(case, opset):
    data = materialise_decode(case)
    model = do.export(data.params, data.config, None, opset=opset, causal=True, kv_cache=True, dtype="float16")
    out, step = _decode(model, data)
    assert step["present_key"].dtype == np.float16
    assert tolerance("float16").output_ratio(out, data.expected)[1] <= 1


@pytest.mark.parametrize("opset", [17, 18, 23], ids=lambda o: f"opset{o}")
def test_float16_accumulates_the_rms_statistic_and_softmax_in_float32(opset):
    # Tokens of magnitude ~300: t^2 ~ 1e5 overflows float16 (max 65504), so a
    # float16 statistic gives phi = 0 and a different map; long rows (M = 600)
    # sum 600 probabilities, which float16 accumulation would round away.
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, coupling="separate", context_dim=16)
    rng = np.random.default_rng(5)
    params = dc.init_params(config, 5)
    for side in ("q", "k"):
        params[f"metric.{side}.gate"] = rng.uniform(0.5, 1.0, 4)
        params[f"metric.{side}.kernel"] *= 4.0
    params["query.kernel"] /= 300.0  # keep the logits O(1): only phi sees the large scale
    params["key.kernel"] /= 300.0
    params["value.kernel"] /= 300.0
    x = rng.normal(size=(1, 4, 16)) * 300.0
    c = rng.normal(size=(1, 600, 16)) * 300.0
    expected = dc.damcha_attention(params, config, x, c)
    model = do.export(params, config, None, opset=opset, cross=True, dtype="float16")
    out = do.run_ort(model, {"query": x, "context": c})
    assert np.all(np.isfinite(out))
    assert tolerance("float16").output_ratio(out, expected)[1] <= 1
    ops = [(n.op_type, n.attribute) for n in model.graph.node]
    if opset >= 23:
        (rms,) = [a for op, a in ops if op == "RMSNormalization"][:1]
        assert helper.get_attribute_value(next(a for a in rms if a.name == "stash_type")) == onnx.TensorProto.FLOAT
        # The whole Attention node runs in float32 (its softmax included): casts around it.
        (attn,) = [n for n in model.graph.node if n.op_type == "Attention"]
        made_by = {o: n for n in model.graph.node for o in n.output}
        for name in attn.input[:3]:
            cast = made_by[name]
            assert cast.op_type == "Cast" and helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.FLOAT
    else:
        casts = [helper.get_attribute_value(a[0]) for op, a in ops if op == "Cast"]
        assert casts.count(onnx.TensorProto.FLOAT) >= 3  # phi_x, phi_c and the logits go to float32


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("hidden_by", ["causal", "padding", "causal-cache"])
def test_float16_hidden_key_whose_logit_overflows_has_no_influence(hidden_by, opset):
    """Tokens 4 and 5 of magnitude ~300: their logits against each other pass
    float16's 65504. Hidden keys (the causal rule's future, padding) must still
    take no weight: the Attention op forms q k^T in its input type before the
    mask applies, and a float16 +inf there won over the mask (query 4 read the
    future token 5)."""
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, seed=1)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 6, 8))
    x[0, 4:] = 300 * rng.normal(size=(2, 8))
    tol = tolerance("float16")
    if hidden_by == "padding":
        # Query 4 may not see key 5 (a padded token holding large values).
        keep = np.ones((1, 1, 1, 6), bool)
        keep[..., 5] = False
        expected, probs = dc.damcha_attention(params, config, x, mask=keep, return_weights=True)
        model = do.export(params, config, None, opset=opset, mask=True, dtype="float16", return_weights=True)
        out = do.run_ort(model, {"query": x, "mask": keep}, all_outputs=True)
        assert np.all(out["weights"][..., 5] == 0)
        assert tol.output_ratio(out["output"], expected)[1] <= 1
        return
    expected, probs = dc.damcha_attention(params, config, x, causal=True, return_weights=True)

    def check(out, want):
        # Row 5 meets its own key, a visible logit past 65504: the decomposed
        # form's float16 product gives NaN there (louder than the reference,
        # allowed: docs/spec.md section 9), the float32 Attention node a value.
        assert tol.output_ratio(out[:, :5], want[:, :5])[1] <= 1
        assert tol.output_ratio(out[:, 6:], want[:, 6:])[1] <= 1
        assert np.all(np.isnan(out[:, 5])) if opset < 23 else tol.output_ratio(out[:, 5], want[:, 5])[1] <= 1

    if hidden_by == "causal":
        model = do.export(params, config, None, opset=opset, causal=True, dtype="float16", return_weights=True)
        out = do.run_ort(model, {"query": x}, all_outputs=True)
        assert np.all(out["weights"][0, :, 4, 5] == 0)
        check(out["output"], expected)
        return
    # One chunk of six tokens into the cache (the causal rule hides key 5 from query 4), then one more.
    model = do.export(params, config, None, opset=opset, causal=True, kv_cache=True, dtype="float16")
    x7 = np.concatenate([x, rng.normal(size=(1, 1, 8))], axis=1)
    first = do.run_ort(model, {"query": x7[:, :6], **do.empty_kv_cache(model, 1)}, all_outputs=True)
    assert first["present_key"].dtype == np.float16
    cache = {"past_key": first["present_key"], "past_value": first["present_value"]}
    second = do.run_ort(model, {"query": x7[:, 6:], **cache}, all_outputs=True)
    full = dc.damcha_attention(params, config, x7, causal=True)
    check(np.concatenate([first["output"], second["output"]], 1), full)


def test_float16_stacks_and_token_model():
    attn = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, coupling="query")
    enc = dc.EncoderConfig(attn, num_layers=2, ffn_dim=24, causal=True)
    tm = dc.TokenModelConfig(enc, vocab_size=30, max_len=12, num_classes=5)
    params = dc.init_token_model_params(tm, 2)
    rng = np.random.default_rng(2)
    for name in params:
        if name.endswith(".gate"):
            params[name] = rng.uniform(-1, 1, params[name].shape)
    tokens = rng.integers(0, 30, (2, 9))
    expected = dc.token_model_forward(params, tm, tokens)
    tol = tolerance("float16")
    for opset in OPSETS:
        model = do.export_token_model(params, tm, None, opset=opset, dtype="float16")
        assert tol.output_ratio(do.run_ort(model, {"tokens": tokens}), expected)[1] <= 1
        step_model = do.export_token_model(params, tm, None, opset=opset, dtype="float16", kv_cache=True)
        cache, outs = do.empty_kv_cache(step_model, 2), []
        for a, b in ((0, 5), (5, 6), (6, 9)):
            out = do.run_ort(step_model, {"tokens": tokens[:, a:b], **cache}, all_outputs=True)
            cache = {k.replace("present_", "past_"): v for k, v in out.items() if k.startswith("present_")}
            outs.append(out["logits"])
        assert tol.output_ratio(np.concatenate(outs, 1), expected)[1] <= 1


def test_bfloat16_is_refused_with_the_reason():
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    with pytest.raises(dc.DamchaValueError, match="no bfloat16 kernels for MatMul"):
        do.export(dc.init_params(config), config, None, dtype="bfloat16")
    enc = dc.EncoderConfig(config, num_layers=1, ffn_dim=8)
    with pytest.raises(dc.DamchaValueError, match="bfloat16"):
        do.export_encoder(dc.init_encoder_params(enc), enc, None, dtype="bfloat16")


# ------------------------------------------------------- float64 stacks, GELU


def test_float64_gelu_decomposition_matches_erf():
    from damcha_onnx._graph import GraphBuilder
    from damcha_onnx._stack import _activation

    g = GraphBuilder("float64", 17)
    g.reserve("x")
    y = _activation(g, "gelu", "x", "gelu")
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(
        g.nodes,
        "gelu",
        [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, ["n"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, ["n"])],
    )
    g.add_initializers(graph)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert "Erf" not in {n.op_type for n in model.graph.node}
    x = np.concatenate([np.linspace(-40, 40, 20001), [0.0, -0.0, 1e-300, -1e-300, 5e-8, -38.5, 38.5]])
    expected = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
    out = do.run_ort(model, {"x": x})
    assert np.max(np.abs(out - expected)) < 1e-14
    assert np.isnan(do.run_ort(model, {"x": np.array([np.nan])})[0])


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
def test_float64_stacks_match_the_reference(opset, activation):
    attn = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, metric="lowrank", metric_rank=2)
    enc = dc.EncoderConfig(attn, num_layers=2, ffn_dim=24, causal=True, activation=activation, norm_first=opset == 23)
    tm = dc.TokenModelConfig(enc, vocab_size=20, max_len=10, num_classes=3)
    params = dc.init_token_model_params(tm, 4)
    rng = np.random.default_rng(4)
    for name in params:
        if name.endswith(".gate"):
            params[name] = rng.uniform(-1, 1, params[name].shape)
    tokens = rng.integers(0, 20, (2, 7))
    mask = rng.random((2, 1, 1, 7)) < 0.8
    model = do.export_token_model(params, tm, None, opset=opset, dtype="float64", mask=True)
    out = do.run_ort(model, {"tokens": tokens, "mask": mask})
    assert out.dtype == np.float64
    expected = dc.token_model_forward(params, tm, tokens, mask=mask)
    assert tolerance("float64").output_ratio(out, expected)[1] <= 1


# ------------------------------------------------------------ attention weights


WEIGHT_CASES = [
    c for c in CATALOGUE if c.group in ("heads", "lowrank", "gqa-mqa", "masks", "causal") or c.name == "mha-none-self"
]


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=lambda c: c.name)
def test_attention_weights_output(case, opset):
    data = materialise(case)
    for dtype in ("float32", "float16"):
        model = _export(data, opset, dtype, return_weights=True)
        out = do.run_ort(model, _inputs(data), all_outputs=True)
        y, w = dc.damcha_attention(
            data.params,
            data.config,
            data.query,
            data.context,
            mask=data.mask,
            causal=data.causal,
            return_weights=True,
            value=data.value,
        )
        tol = tolerance(dtype)
        assert out["weights"].shape == w.shape
        assert tol.output_ratio(out["weights"], w)[1] <= 1
        assert tol.output_ratio(out["output"], y)[1] <= 1
    if case.mask == "all_masked_row":
        assert np.all(out["weights"][0, :, 1] == 0)  # a row with no visible key has probabilities 0


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
def test_attention_weights_of_a_decode_step(opset):
    data = materialise_decode(DECODE_CATALOGUE[2])  # GQA
    model = do.export(data.params, data.config, None, opset=opset, causal=True, kv_cache=True, return_weights=True)
    _, step = _decode(model, data)
    start, stop = data.case.steps[-1]  # the last step's queries sit at positions start.. and see the stop keys
    _, w = dc.damcha_attention(
        data.params,
        data.config,
        data.query[:, start:stop],
        data.query[:, :stop],
        causal=True,
        query_offset=start,
        return_weights=True,
    )
    assert step["weights"].shape == w.shape == (1, 4, stop - start, stop)
    assert tolerance("float32").output_ratio(step["weights"], w)[1] <= 1


_RAW_SESSION = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
# A plain session at onnxruntime's default log level (warnings shown), as users create one.
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
for _ in range(2):
    outs = session.run(None, feeds)
np.savez(sys.argv[3], **{o.name: v for o, v in zip(session.get_outputs(), outs)})
"""


@pytest.mark.parametrize("form", ["self", "cross-padding", "decode-step"])
def test_attention_weights_run_without_onnxruntime_warnings(tmp_path, form):
    # onnx infers the Attention op's weights output as (B, H, N, 0); onnxruntime
    # warned on every run of a raw session that the real shape differs.
    import subprocess
    import sys

    config = dc.DamchaConfig(query_dim=16, num_heads=4, num_kv_heads=2, key_dim=4, coupling="query")
    params = dc.init_params(config, seed=1)
    rng = np.random.default_rng(0)
    tokens, c = rng.normal(size=(2, 7, 16)), rng.normal(size=(2, 5, 16))
    x = tokens[:, 4:]  # the queries run; in the decode step the first 4 tokens are the cache
    kw = {"cross": True, "mask": "padding"} if form == "cross-padding" else {"kv_cache": form == "decode-step"}
    model = do.export(params, config, tmp_path / "m.onnx", opset=23, causal=True, return_weights=True, **kw)
    inferred = do.validate_model(model)
    (weights,) = [o for o in inferred.graph.output if o.name == "weights"]
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in weights.type.tensor_type.shape.dim]
    assert weights.name == "weights" and dims[1] == 4 and all(isinstance(d, str) and d for d in dims[2:]), dims
    feeds = {"query": x}
    reference = {"causal": True, "return_weights": True}
    if form == "cross-padding":
        padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
        feeds |= {"context": c, "mask": padding}
        reference |= {"context": c, "mask": padding[:, None, None, :]}
    if form == "decode-step":
        prefix = do.run_ort(model, {"query": tokens[:, :4], **do.empty_kv_cache(model, 2)}, all_outputs=True)
        feeds |= {"past_key": prefix["present_key"], "past_value": prefix["present_value"]}
        reference |= {"context": tokens, "query_offset": 4}
    np.savez(tmp_path / "feeds.npz", **{k: v.astype(np.float32) if v.dtype != bool else v for k, v in feeds.items()})
    proc = subprocess.run(
        [sys.executable, "-c", _RAW_SESSION, tmp_path / "m.onnx", tmp_path / "feeds.npz", tmp_path / "outs.npz"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # was: "[W:onnxruntime ...] Expected shape from model of {-1,4,-1,0} ..."
    outs = np.load(tmp_path / "outs.npz")
    y, w = dc.damcha_attention(params, config, x, **reference)
    assert outs["weights"].shape == w.shape
    assert tolerance("float32").output_ratio(outs["weights"], w)[1] <= 1
    assert tolerance("float32").output_ratio(outs["output"], y)[1] <= 1


# ------------------------------------------------------------- padding masks


@pytest.mark.parametrize("opset", OPSETS, ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_padding_mask_input(opset, causal):
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, coupling="query")
    params = dc.init_params(config, 9)
    params["metric.q.gate"] = np.full(4, 0.7)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(3, 6, 16))
    padding = np.array(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=bool
    )  # right and left padded
    expected = dc.damcha_attention(params, config, x, mask=padding[:, None, None, :], causal=causal)
    model = do.export(params, config, None, opset=opset, causal=causal, mask="padding")
    assert [d.dim_param for d in model.graph.input[1].type.tensor_type.shape.dim] == ["batch", "query_len"]
    assert tolerance("float32").output_ratio(do.run_ort(model, {"query": x, "mask": padding}), expected)[1] <= 1
    # Left padding with causal: rows 0-1 of batch 2 see no key and output the bias.
    enc = dc.EncoderConfig(config, num_layers=2, ffn_dim=8, causal=causal)
    eparams = dc.init_encoder_params(enc, 1)
    stack = do.export_encoder(eparams, enc, None, opset=opset, mask="padding", dynamic=False, batch_size=3, query_len=6)
    out = do.run_ort(stack, {"query": x, "mask": padding})
    assert (
        tolerance("float32").output_ratio(out, dc.encoder_forward(eparams, enc, x, mask=padding[:, None, None, :]))[1]
        <= 1
    )
    with pytest.raises(dc.DamchaValueError, match="mask"):
        do.ExportOptions(mask="pad")


# ------------------------------------------ fused attention path (issue 12)


def _static_shapes(model):
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    shapes = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims)
    return shapes


def _producers(model):
    return {out: node for node in model.graph.node for out in node.output}


@pytest.mark.parametrize("mask", ["padding", True], ids=["padding-mask", "4d-mask"])
@pytest.mark.parametrize("kv_cache", [False, True], ids=["full", "decode-step"])
def test_causal_and_padding_masks_take_the_fused_attention_path(mask, kv_cache):
    B, H, N = 2, 4, 5
    config = dc.DamchaConfig(query_dim=16, num_heads=H, key_dim=4, num_kv_heads=2, coupling="query")
    # A padding mask is (B, M) even with static sizes; a 4-D mask keeps its
    # broadcast dims symbolic (a static one is declared (B, H, N, M) by the user's choice).
    static = dict(dynamic=False, batch_size=B, query_len=N) if mask == "padding" else {}
    model = do.export(dc.init_params(config), config, None, causal=True, mask=mask, kv_cache=kv_cache, **static)
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["is_causal"] == 1  # the causal rule is the op's own fused path
    ops = [n.op_type for n in model.graph.node]
    # No explicit causal (N, M) matrix: no Range over keys compared with rows.
    assert "LessOrEqual" not in ops or all(
        n.input[1].endswith("rows") for n in model.graph.node if n.op_type == "LessOrEqual"
    )
    # The attn_mask input comes from the user's mask through shape-only checks and one Expand of the query axis.
    producers = _producers(model)
    expand = producers[attention.input[3]]
    assert expand.op_type == "Expand"
    node, chain = producers.get(expand.input[0]), []
    while node is not None:
        chain.append(node.op_type)
        node = producers.get(node.input[0])
    assert set(chain) <= {"Reshape", "Unsqueeze"}, chain
    if not kv_cache:
        shapes = _static_shapes(model)
        if mask == "padding":
            assert shapes[attention.input[3]] == (B, 1, N, N)
        else:
            assert shapes[attention.input[3]][:2] == ("mask_batch", "mask_heads")
        # Nothing with a head axis of H is built from the mask (only the op's own output layout has H).
        full = [name for name, s in shapes.items() if len(s) == 4 and s[1] == H]
        assert full == [], full
        # The empty-row rule is computed per row, (B, 1, N, 1), not per key.
        assert shapes[_rows_name(model)][-1] == 1


def _rows_name(model):
    return next(o for n in model.graph.node for o in n.output if o.endswith("row_ok"))


def test_a_mask_of_the_wrong_shape_fails_in_the_graph_itself():
    # Raw onnxruntime (no feed checks, as from JavaScript): the shape guard,
    # not a silent broadcast, rejects the mask; the right shapes still run.
    import onnxruntime as ort

    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    x = np.zeros((2, 3, 8), np.float32)
    for opset in OPSETS:
        model = do.export(dc.init_params(config), config, None, opset=opset, causal=True, mask=True)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for good in [(2, 1, 1, 3), (1, 2, 3, 3), (2, 2, 1, 3)]:
            session.run(None, {"query": x, "mask": np.ones(good, bool)})
        for bad in [(2, 1, 1, 4), (3, 1, 1, 3), (2, 3, 1, 3), (2, 1, 2, 3)]:
            with pytest.raises(ORT_ERRORS):
                session.run(None, {"query": x, "mask": np.ones(bad, bool)})


@pytest.mark.parametrize("kind", ["self-causal", "cross", "decode"])
def test_a_mask_broadcast_over_the_keys_runs_through_run_ort(kind):
    # A 4-D mask whose key axis is 1 (the reference's rule: any dim may be 1):
    # the graph's own check takes it, and run_ort/run_reference used to refuse
    # it because the declared key dim is the context's. Same answer as the
    # mask expanded over the keys, and as the reference.
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, coupling="separate")
    params = dc.init_params(config, 5)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    rows = np.array([True, False, True]).reshape(1, 1, 3, 1)  # query 1 sees no key
    if kind == "decode":
        model = do.export(params, config, None, causal=True, kv_cache=True, mask=True)
        past = rng.normal(size=(2, 2, 2, 4)).astype(np.float32)
        feeds = {"query": x, "past_key": past, "past_value": past}
        M = 5
    else:
        model = do.export(params, config, None, causal=kind == "self-causal", cross=kind == "cross", mask=True)
        feeds = {"query": x}
        if kind == "cross":
            feeds["context"] = rng.normal(size=(2, 4, 8)).astype(np.float32)
        M = 4 if kind == "cross" else 3
    full = {**feeds, "mask": np.broadcast_to(rows, (1, 1, 3, M)).copy()}
    narrow = {**feeds, "mask": rows}
    expected = do.run_ort(model, full)
    got = do.run_ort(model, narrow)
    for a, b in zip(got, expected) if kind == "decode" else [(got, expected)]:
        np.testing.assert_array_equal(a, b)
    if kind != "decode":
        reference = dc.damcha_attention(
            params, config, x, feeds.get("context"), mask=rows, causal=kind == "self-causal"
        )
        assert tolerance("float32").output_ratio(expected, reference)[1] <= 1
        np.testing.assert_allclose(do.run_reference(model, narrow), reference, atol=1e-5)


# ------------------------------------------------- value tokens of their own size


def test_value_input_of_its_own_size():
    # E_v != E_kv (DECISIONS 8): a third input; the catalogue case heads-separate-cross-value-dim
    # checks the numbers, here the rules around it.
    import onnxruntime as ort

    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, context_dim=6, value_input_dim=5, coupling="separate")
    params = dc.init_params(config, 3)
    model = do.export(params, config, None, cross=True, opset=17)
    assert [i.name for i in model.graph.input] == ["query", "context", "value"]
    rng = np.random.default_rng(3)
    x, c, v = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 4, 6)), rng.normal(size=(2, 4, 5))
    out = do.run_ort(model, {"query": x, "context": c, "value": v})
    assert tolerance("float32").output_ratio(out, dc.damcha_attention(params, config, x, c, value=v))[1] <= 1
    self_config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, value_input_dim=5)
    with pytest.raises(dc.DamchaValueError, match="value_input_dim == config.query_dim"):
        do.export(dc.init_params(self_config), self_config, None)
    with pytest.raises(dc.DamchaValueError, match="`value`"):
        do.run_ort(model, {"query": x, "context": c, "value": v[:, :3]})  # fewer values than keys
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    for bad in (v[:, :3], np.concatenate([v, v[:1]]), v[:1]):  # another length, batch + 1, batch 1
        with pytest.raises(ORT_ERRORS):
            session.run(None, {"query": f32(x), "context": f32(c), "value": f32(bad)})
