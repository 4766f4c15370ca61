"""Defects a review of the ONNX exporter found, each pinned against the NumPy
reference or onnxruntime: padding masks a raw session broadcast, sessions of
another export, unchecked paths and arguments, float64 LayerNorm epsilon."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors
import pytest
from onnx import numpy_helper

import damcha_core as dc
import damcha_onnx as do
from damcha_onnx import _io
from damcha_onnx._cli import main as cli_main

# What onnxruntime raises when a shape check node of the graph fails.
ORT_ERRORS = (ort_errors.Fail, ort_errors.InvalidArgument, ort_errors.RuntimeException)
NEWEST = onnx.defs.onnx_opset_version()
CFG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
JS = pathlib.Path(__file__).resolve().parent.parent / "js"


def _params(config: dc.DamchaConfig, seed: int) -> dict[str, np.ndarray]:
    # Open gates and random weights: a fresh layer (gates 0) would hide a wrong map.
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.4, v.shape) for k, v in dc.init_params(config, seed).items()}


def _raw(model: onnx.ModelProto, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _padding(batch: int, keys: int) -> np.ndarray:
    mask = np.ones((batch, keys), bool)
    mask[0, -1] = False  # a hidden key, so a broadcast of row 0 would change batch 1's answer
    return mask


# ------------------------------------------------------ 1: padding masks


def _padding_case(kind: str, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray], int, np.ndarray | None]:
    """(model, good feeds without the mask, key count M, the reference's output or None)."""
    rng = np.random.default_rng(3)
    B, N = 2, 3
    x = rng.normal(size=(B, N, 8))
    padding = _padding(B, N)
    enc = do.EncoderConfig(CFG, num_layers=2, ffn_dim=16, causal=True)
    tm = do.TokenModelConfig(enc, vocab_size=11, max_len=8, num_classes=5)
    if kind == "layer":
        p = _params(CFG, 1)
        model = do.export(p, CFG, None, opset=opset, mask="padding")
        return model, {"query": x}, N, dc.damcha_attention(p, CFG, x, mask=padding[:, None, None, :])
    if kind == "cross":
        config = dc.DamchaConfig(query_dim=8, context_dim=6, num_heads=2, key_dim=4)
        p = _params(config, 2)
        c = rng.normal(size=(B, 5, 6))
        model = do.export(p, config, None, opset=opset, cross=True, mask="padding")
        ref = dc.damcha_attention(p, config, x, c, mask=_padding(B, 5)[:, None, None, :])
        return model, {"query": x, "context": c}, 5, ref
    if kind == "decode":
        p = _params(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), 4)
        model = do.export(p, CFG, None, opset=opset, causal=True, kv_cache=True, mask="padding")
        past = rng.normal(size=(B, 2, 2, 4))
        return model, {"query": x, "past_key": past, "past_value": past}, 2 + N, None
    if kind == "encoder":
        p = do.init_encoder_params(enc, 5)
        model = do.export_encoder(p, enc, None, opset=opset, mask="padding")
        return model, {"query": x}, N, do.encoder_forward(p, enc, x, mask=padding[:, None, None, :])
    tp = do.init_token_model_params(tm, 6)
    tokens = rng.integers(0, 11, (B, N))
    if kind == "tokens":
        model = do.export_token_model(tp, tm, None, opset=opset, mask="padding")
        return model, {"tokens": tokens}, N, do.token_model_forward(tp, tm, tokens, mask=padding[:, None, None, :])
    model = do.export_token_model(tp, tm, None, opset=opset, kv_cache=True, mask="padding")
    return model, {"tokens": tokens, **do.empty_kv_cache(model, B)}, N, None


@pytest.mark.parametrize("opset", [17, 23, NEWEST])
@pytest.mark.parametrize("kind", ["layer", "cross", "decode", "encoder", "tokens", "tokens-decode"])
def test_a_padding_mask_of_another_batch_or_key_count_fails_in_a_raw_session(kind, opset):
    """A (1, M) or (B, 1) padding mask ran in a raw onnxruntime session, broadcast
    over the batch or the keys: the 4-D check each layer makes lets any dim be 1."""
    model, feeds, M, expected = _padding_case(kind, opset)
    dtype = np.float32
    feeds = {k: v.astype(dtype) if v.dtype == np.float64 else v for k, v in feeds.items()}
    B = next(iter(feeds.values())).shape[0]
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        session = _raw(model, level)
        got = session.run(None, {**feeds, "mask": _padding(B, M)})[0]
        checked = do.run_ort(model, {**feeds, "mask": _padding(B, M)})
        np.testing.assert_allclose(got, checked, rtol=1e-5, atol=1e-6)  # fused kernels round apart
        if expected is not None:
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        for shape in [(1, M), (B, 1), (B, M + 1)]:
            with pytest.raises(ORT_ERRORS):
                session.run(None, {**feeds, "mask": _padding(*shape)})


def test_a_padding_mask_of_another_shape_throws_in_javascript(tmp_path):
    """The same rule in onnxruntime-node and -web, where no Python checks the feeds."""
    node = shutil.which("node")
    assert node is not None, "Node.js (>= 20) is required (make test runs `npm ci` in js/)"
    for opset in (17, 23):
        do.export(_params(CFG, 1), CFG, tmp_path / f"pad{opset}.onnx", opset=opset, mask="padding")
    script = tmp_path / "padding.mjs"
    script.write_text(
        """import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
const [, , jsdir, ...models] = process.argv;
const require = createRequire(jsdir + '/package.json');
const out = {};
for (const name of ['onnxruntime-node', 'onnxruntime-web']) {
  const ort = await import(pathToFileURL(require.resolve(name)).href);
  if (name === 'onnxruntime-web') ort.env.wasm.numThreads = 1;
  for (const model of models) {
    const s = await ort.InferenceSession.create(model);
    const q = new ort.Tensor('float32', new Float32Array(2 * 3 * 8).fill(0.5), [2, 3, 8]);
    for (const dims of [[1, 3], [2, 1], [2, 3]]) {
      const m = new ort.Tensor('bool', new Uint8Array(dims[0] * dims[1]).fill(1), dims);
      const key = `${name} ${model.slice(-11)} ${dims.join('x')}`;
      try { await s.run({ query: q, mask: m }); out[key] = 'ran'; } catch (e) { out[key] = 'threw'; }
    }
  }
}
console.log(JSON.stringify(out));
"""
    )
    models = [str(tmp_path / f"pad{o}.onnx") for o in (17, 23)]
    proc = subprocess.run([node, str(script), str(JS), *models], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 12, report
    for key, result in report.items():
        assert result == ("ran" if key.endswith("2x3") else "threw"), (key, report)


# ------------------------------------------------------ 3: foreign sessions


def test_run_ort_refuses_a_session_of_another_export_with_the_same_names(tmp_path):
    """Only the input and output names were compared: a session of another export
    (same config, other weights) ran, and its outputs came back as the model's."""
    pa, pb = _params(CFG, 1), _params(CFG, 2)
    a = do.export(pa, CFG, tmp_path / "a.onnx")
    do.export(pb, CFG, tmp_path / "b.onnx")
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    with pytest.raises(dc.DamchaValueError, match=r"`session`: expected a session of this model.*damcha_model_digest"):
        do.run_ort(tmp_path / "a.onnx", {"query": x}, session=do.ort_session(tmp_path / "b.onnx"))
    # Same names, other dims (query_dim 6): named with the dims, before onnxruntime runs.
    small = dc.DamchaConfig(query_dim=6, num_heads=2, key_dim=3)
    other = do.export(_params(small, 3), small, None)
    with pytest.raises(
        dc.DamchaValueError, match=r"query tensor\(float\) \(batch, query_len, 8\).*Received: .*query_len, 6\)"
    ):
        do.run_ort(a, {"query": x}, session=do.ort_session(other))
    # Another dtype, same names and dims.
    with pytest.raises(dc.DamchaValueError, match=r"tensor\(double\)"):
        do.run_ort(a, {"query": x}, session=do.ort_session(do.export(pa, CFG, None, dtype="float64")))
    # The int8 model is another model: its session does not pass for the float one's, nor the reverse.
    int8 = do.quantize_int8(a)
    with pytest.raises(dc.DamchaValueError, match="damcha_model_digest"):
        do.run_ort(a, {"query": x}, session=do.ort_session(int8))
    with pytest.raises(dc.DamchaValueError, match="damcha_model_digest"):
        do.run_ort(int8, {"query": x}, session=do.ort_session(a))
    # Its own session, from memory, from the file and as an .ort file, is taken.
    expected = dc.damcha_attention(pa, CFG, x)
    for session in (do.ort_session(a), do.ort_session(tmp_path / "a.onnx")):
        np.testing.assert_allclose(do.run_ort(a, {"query": x}, session=session), expected, rtol=1e-4, atol=1e-5)
    converted = do.convert_to_ort([tmp_path / "a.onnx"], tmp_path / "ort")
    got = do.run_ort(tmp_path / "a.onnx", {"query": x}, session=do.ort_session(converted.models["a"]))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_run_ort_takes_a_session_of_the_model_that_fixes_a_symbolic_dim_or_infers_an_output_shape(tmp_path):
    """The session check compared dims exactly: a session with onnxruntime's free
    dimension overrides (batch and query_len fixed for serving) and a session of
    a graph whose output declares no shape (onnxruntime reports the inferred one)
    were refused as another model's."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    p = _params(CFG, 1)
    path = tmp_path / "a.onnx"
    model = do.export(p, CFG, path)
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    options = ort.SessionOptions()
    options.add_free_dimension_override_by_name("batch", 2)
    options.add_free_dimension_override_by_name("query_len", 3)
    fixed = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert fixed.get_inputs()[0].shape == [2, 3, 8]
    got = do.run_ort(model, {"query": x}, session=fixed)
    np.testing.assert_allclose(got, dc.damcha_attention(p, CFG, x), rtol=1e-4, atol=1e-5)
    # A fixed size that differs from the graph's still tells another model apart.
    small = dc.DamchaConfig(query_dim=6, num_heads=2, key_dim=3)
    with pytest.raises(dc.DamchaValueError, match=r"`session`: expected a session of this model"):
        do.run_ort(model, {"query": x}, session=do.ort_session(do.export(_params(small, 3), small, None)))
    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [inp], [out])
    relu = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    relu.ir_version = 8
    session = ort.InferenceSession(relu.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape == ["batch", 4]  # inferred, where the graph declares none
    feed = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    np.testing.assert_array_equal(do.run_ort(relu, {"x": feed}, session=session), np.maximum(feed, 0))


def test_the_model_digest_is_deterministic_and_tells_weights_apart():
    digest = lambda m: {p.key: p.value for p in m.metadata_props}[_io.DIGEST_KEY]  # noqa: E731
    p = _params(CFG, 1)
    assert digest(do.build_model(p, CFG)) == digest(do.export(p, CFG, None))
    q = {k: v.copy() for k, v in p.items()}
    q["output.bias"].flat[0] += 1e-3
    assert digest(do.build_model(q, CFG)) != digest(do.build_model(p, CFG))
    assert digest(do.build_model(p, CFG, opset=22)) != digest(do.build_model(p, CFG, opset=21))


# ------------------------------------------------------ 2: convert_to_ort's output_dir


@pytest.mark.parametrize(
    "output_dir, error, received",
    [
        (None, dc.DamchaTypeError, "output_dir=None"),
        (5, dc.DamchaTypeError, "output_dir=5"),
        (b"/tmp/x", dc.DamchaTypeError, "output_dir=b'/tmp/x'"),
        ("", dc.DamchaValueError, "output_dir=''"),
        ("/proc/damcha_ort_out", dc.DamchaValueError, "output_dir='/proc/damcha_ort_out' (it cannot be created"),
        ("UNDER_FILE", dc.DamchaValueError, "/layer.onnx/sub' (it cannot be created"),
        ("FILE", dc.DamchaValueError, "/layer.onnx' (a file)"),
    ],
    ids=["None", "int", "bytes", "empty", "proc", "under-a-file", "a-file"],
)
def test_convert_to_ort_checks_output_dir_by_name(tmp_path, output_dir, error, received):
    source = tmp_path / "layer.onnx"
    do.export(_params(CFG, 1), CFG, source)
    output_dir = {"UNDER_FILE": str(source / "sub"), "FILE": str(source)}.get(output_dir, output_dir)
    with pytest.raises(
        error, match=r"Invalid argument `output_dir`: expected the path of a writable directory"
    ) as info:
        do.convert_to_ort([source], output_dir)
    assert received in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.onnx"]


# ------------------------------------------------------ 4: a folder at <path>.data


def test_an_external_data_export_refuses_a_folder_at_its_data_file_before_any_work(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    (tmp_path / "m.onnx.data").mkdir()
    p = _params(CFG, 1)
    enc = do.EncoderConfig(CFG, num_layers=1, ffn_dim=8)
    exports = [
        lambda: do.export(p, CFG, path, external_data=True),
        lambda: do.export_encoder(do.init_encoder_params(enc, 1), enc, path, external_data=True),
        lambda: _io.save_model(do.build_model(p, CFG), path, external_data=True),
    ]
    for run in exports:
        with pytest.raises(dc.DamchaValueError, match=r"`path`: expected a path whose external data file") as info:
            run()
        assert f"{str(tmp_path / 'm.onnx.data')!r} is a folder" in str(info.value)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx.data"]
    # external_data=None (automatic): a one-file model is written beside the folder...
    do.export(p, CFG, path)
    np.testing.assert_allclose(
        do.run_ort(path, {"query": np.ones((1, 2, 8))}),
        dc.damcha_attention(p, CFG, np.ones((1, 2, 8))),
        rtol=1e-4,
        atol=1e-5,
    )
    path.unlink()
    # ...and one that turns out to need external data is refused before it is written.
    monkeypatch.setattr(_io, "EXTERNAL_DATA_THRESHOLD", 1024)
    with pytest.raises(dc.DamchaValueError, match=r"is a folder"):
        do.export(p, CFG, path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx.data"]


# ------------------------------------------------------ 6: validate_model


def test_validate_model_takes_a_path_and_refuses_other_arguments_by_name(tmp_path):
    p = _params(CFG, 1)
    one = tmp_path / "one.onnx"
    model = do.export(p, CFG, one)
    ext = tmp_path / "ext.onnx"
    do.export(p, CFG, ext, external_data=True)
    expected = do.validate_model(model)
    for path in (str(one), one, ext):
        checked = do.validate_model(path)
        assert isinstance(checked, onnx.ModelProto)
        assert {v.name for v in checked.graph.value_info} == {v.name for v in expected.graph.value_info}
        weights = {t.name: numpy_helper.to_array(t) for t in checked.graph.initializer}  # held in memory
        for t in expected.graph.initializer:
            np.testing.assert_array_equal(weights[t.name], numpy_helper.to_array(t))
    (tmp_path / "garbage.onnx").write_bytes(b"\xff\x00not a model")
    cases = [
        (None, dc.DamchaTypeError, "model=None"),
        (5, dc.DamchaTypeError, "model=5"),
        (tmp_path / "missing.onnx", dc.DamchaValueError, "(no such file)"),
        (tmp_path, dc.DamchaValueError, "(a directory)"),
        (tmp_path / "garbage.onnx", dc.DamchaValueError, "garbage.onnx' ("),
    ]
    for arg, error, received in cases:
        with pytest.raises(error, match=r"Invalid argument `model`: expected an onnx.ModelProto or the path") as info:
            do.validate_model(arg)
        assert received in str(info.value)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].input[0] = "nowhere"
    onnx.save(broken, tmp_path / "broken.onnx")
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError)):
        do.validate_model(tmp_path / "broken.onnx")


# ------------------------------------------------------ 7, 8: export_torch


def test_export_torch_refuses_a_default_dynamic_export_the_model_fixes():
    """A (B, 1, N, M) mask input: the default dims 0 and 1 dynamic failed with a raw TorchExportError."""
    import torch

    import damcha_torch as dt

    class Masked(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            return self.layer(x, x, x, attn_mask=hidden, need_weights=False)[0]

    model = Masked(dt.DamchaAttention.from_canonical(_params(CFG, 2), CFG, batch_first=True)).eval()
    example = (torch.randn(2, 6, 8), torch.zeros(2, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(dc.DamchaValueError, match=r"`dynamic`: expected dynamic=True only for a model") as info:
        do.export_torch(model, example, input_names=["query", "hidden"])
    text = str(info.value)
    assert "pass dynamic_shapes=" in text and "or dynamic=False" in text and "torch.export:" in text
    with pytest.raises(dc.DamchaTypeError, match=r"`dynamic`: expected a bool"):
        do.export_torch(model, example, dynamic="yes")


def test_export_torch_takes_one_tensor_and_a_str_as_one_name():
    """args=tensor became one input per batch row; input_names="query" named the input "q"."""
    import torch

    import damcha_torch as dt

    class Self(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return self.layer(q, q, q, need_weights=False)[0]

    p = _params(CFG, 2)
    model = Self(dt.DamchaAttention.from_canonical(p, CFG, batch_first=True)).eval()
    for bad, error, name in [
        (dict(input_names=[1]), dc.DamchaTypeError, "input_names"),
        (dict(output_names=["a", "a"]), dc.DamchaValueError, "output_names"),
        (dict(input_names=[""]), dc.DamchaValueError, "input_names"),
    ]:
        with pytest.raises(error, match=rf"Invalid argument `{name}`"):
            do.export_torch(model, (torch.randn(2, 5, 8),), **bad)
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `args`: expected a tuple"):
        do.export_torch(model, 5)
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `args`: expected a tuple"):
        do.export_torch(model, {"q": torch.randn(2, 5, 8)})  # a mapping iterates its keys
    proto = do.export_torch(model, torch.randn(2, 5, 8), input_names="query", output_names="y")
    assert [i.name for i in proto.graph.input] == ["query"] and [o.name for o in proto.graph.output] == ["y"]
    x = np.random.default_rng(1).normal(size=(3, 4, 8))
    np.testing.assert_allclose(do.run_ort(proto, {"query": x}), dc.damcha_attention(p, CFG, x), rtol=1e-4, atol=1e-5)
    # Other iterables, as list()/tuple() took them before the checks: one's feeds' keys and values.
    feeds = {"query": torch.randn(2, 5, 8)}
    proto = do.export_torch(model, feeds.values(), input_names=feeds.keys())
    assert [i.name for i in proto.graph.input] == ["query"]
    np.testing.assert_allclose(do.run_ort(proto, {"query": x}), dc.damcha_attention(p, CFG, x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------ 5, 9: feeds and caches


def test_a_bfloat16_feed_is_refused_with_what_onnxruntime_takes():
    model = do.build_model(_params(CFG, 1), CFG)
    with pytest.raises(
        dc.DamchaTypeError, match=r"`query`: expected a real floating tensor: float16, float32 or float64"
    ) as info:
        do.run_ort(model, {"query": np.zeros((1, 2, 8), ml_dtypes.bfloat16)})
    assert "onnxruntime takes no bfloat16 feeds" in str(info.value)
    assert "or bfloat16)" not in str(info.value)  # damcha_core's message, which lists it as accepted


def test_empty_kv_cache_refuses_a_batch_the_model_fixes():
    p = _params(CFG, 1)
    model = do.build_model(p, CFG, causal=True, kv_cache=True, dynamic=False, batch_size=1, query_len=1)
    with pytest.raises(dc.DamchaValueError, match=r"`batch_size`: expected the model's fixed batch size 1") as info:
        do.empty_kv_cache(model, 2)
    assert info.value.args[0].endswith("Received: batch_size=2")
    cache = do.empty_kv_cache(model, 1)
    x = np.random.default_rng(2).normal(size=(1, 1, 8))
    got = do.run_ort(model, {"query": x, **cache})
    np.testing.assert_allclose(got, dc.damcha_attention(p, CFG, x, causal=True), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------ 10: float64 LayerNorm


@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_float64_stacks_use_the_exact_layernorm_epsilon(eps):
    """LayerNormalization.epsilon is a float32 attribute: 1e-5 became 9.9999997e-06
    (an error of 1e-12, 4e-9 with eps=0.1) in a graph documented to match to ~1e-15."""
    attn = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="none")
    enc = do.EncoderConfig(attn, num_layers=1, ffn_dim=16, norm_eps=eps, final_norm=True)
    p = do.init_encoder_params(enc, 1)
    x = np.random.default_rng(1).normal(size=(2, 5, 8))
    for opset in (17, 23):
        model = do.export_encoder(p, enc, None, dtype="float64", opset=opset)
        assert np.max(np.abs(do.run_ort(model, {"query": x}) - do.encoder_forward(p, enc, x))) < 1e-13
    tm = do.TokenModelConfig(enc, vocab_size=7, max_len=6, num_classes=3)
    tp = do.init_token_model_params(tm, 2)
    tokens = np.array([[1, 2, 3], [6, 0, 5]])
    model = do.export_token_model(tp, tm, None, dtype="float64")
    assert np.max(np.abs(do.run_ort(model, {"tokens": tokens}) - do.token_model_forward(tp, tm, tokens))) < 1e-13


# ------------------------------------------------------ 11: bool and int arguments


def test_bool_and_int_arguments_follow_one_rule(tmp_path):
    p = _params(CFG, 1)
    model = do.export(p, CFG, tmp_path / "m.onnx")
    feeds = {"query": np.ones((1, 2, 8), np.float32)}
    for call, name in [
        (lambda: do.run_ort(model, feeds, all_outputs="no"), "all_outputs"),
        (lambda: do.run_reference(model, feeds, all_outputs=1), "all_outputs"),
        (lambda: do.ort_session(model, optimize="no"), "optimize"),
        (lambda: do.ort_session(model, spinning=0), "spinning"),
        (lambda: do.quantize_static_int8(model, [feeds], per_channel="yes"), "per_channel"),
        (lambda: do.convert_to_ort([tmp_path / "m.onnx"], tmp_path / "ort", type_reduction="yes"), "type_reduction"),
        (lambda: _io.save_model(model, tmp_path / "n.onnx", external_data="yes"), "external_data"),
        (lambda: do.export(p, CFG, None, dynamic=False, batch_size=2.0, query_len=3), "batch_size"),
        (lambda: do.export(p, CFG, None, dynamic=False, batch_size="2", query_len=3), "batch_size"),
        (lambda: do.export(p, CFG, None, opset=23.0), "opset"),
        (lambda: do.ExportOptions(dynamic=False, batch_size=1, query_len=1.5), "query_len"),
    ]:
        with pytest.raises(dc.DamchaTypeError, match=rf"Invalid argument `{name}`"):
            call()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx"]
    with pytest.raises(dc.DamchaValueError, match=r"`batch_size`: expected an int >= 1"):
        do.export(p, CFG, None, dynamic=False, batch_size=0, query_len=3)
    # NumPy bools are bools everywhere, as the exporter's own options take them.
    expected = dc.damcha_attention(p, CFG, feeds["query"])
    outputs = do.run_ort(model, feeds, all_outputs=np.True_)
    np.testing.assert_allclose(outputs["output"], expected, rtol=1e-4, atol=1e-5)
    session = do.ort_session(model, optimize=np.False_, spinning=np.False_)
    np.testing.assert_allclose(do.run_ort(model, feeds, session=session), expected, rtol=1e-4, atol=1e-5)
    per_tensor = do.quantize_static_int8(model, [feeds], per_channel=np.False_)
    by_tensor = do.quantize_static_int8(model, [feeds], per_channel=False)
    assert per_tensor.SerializeToString() == by_tensor.SerializeToString()


# ------------------------------------------------------ 12: damcha export's messages


def test_export_names_the_config_scale_that_takes_the_query_weights_past_the_dtype(tmp_path, capsys):
    config = CFG.replace(scale=1e300)
    p = _params(config, 1)
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `config.scale`: .*finite float32") as info:
        do.export(p, config, None)
    assert "q.kernel" not in str(info.value) and "config.scale=1e+300" in str(info.value)
    model = do.export(p, config, None, dtype="float64")  # float64 holds it
    x = np.random.default_rng(1).normal(size=(1, 3, 8))
    np.testing.assert_allclose(do.run_ort(model, {"query": x}), dc.damcha_attention(p, config, x), rtol=1e-9)
    dc.save_params(tmp_path / "p.safetensors", p, config)
    status = cli_main(["--params", str(tmp_path / "p.safetensors"), "--out", str(tmp_path / "m.onnx")])
    line = capsys.readouterr().err.strip()
    assert status == 2 and len(line.splitlines()) == 1, line
    assert line.startswith("damcha export: error: --dtype: float32 cannot hold the weights"), line
    assert "`config.scale`" in line and "pass --dtype float64" in line and "q.kernel" not in line, line


def test_export_names_a_data_file_name_the_os_refuses_as_the_data_file_of_out(tmp_path, capsys):
    out = tmp_path / ("e" * 248 + ".onnx")  # <out>.data is 258 bytes, past the OS's 255
    dc.save_params(tmp_path / "p.safetensors", _params(CFG, 1), CFG)
    status = cli_main(["--params", str(tmp_path / "p.safetensors"), "--out", str(out)])
    line = capsys.readouterr().err.strip()
    assert status == 2 and len(line.splitlines()) == 1, line
    assert line.startswith(f"damcha export: error: --out: its external data file {str(out) + '.data'!r}"), line
    assert "(File name too long)" in line and "pass --external-data never" in line, line
    assert line.endswith(f"Received: --out {str(out)!r}"), line
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.safetensors"]


def test_a_two_d_mask_fed_to_a_four_d_mask_input_points_to_the_padding_export():
    """A tokenizer's (B, M) mask fed to a model exported with a 4-D mask input: the
    refusal names the input and says which export takes it (a new user's review)."""
    p = _params(CFG, 1)
    model = do.export(p, CFG, None, mask=True)
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `mask`: expected rank 4.*mask='padding'"):
        do.run_ort(model, {"query": x, "mask": np.ones((2, 3), bool)})
    with pytest.raises(dc.DamchaValueError, match=r"expected rank 4") as info:
        do.run_ort(model, {"query": x, "mask": np.ones((2, 3, 3), bool)})
    assert "padding" not in str(info.value)  # a 3-D mask is not a padding mask
