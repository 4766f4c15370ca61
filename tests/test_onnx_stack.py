"""Encoder stacks, the token model, int8 quantisation and the CLI, against NumPy references."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import tolerance


def _open(params, rng):
    # Fresh params have gates at 0 (plain MHA); open them so the metric matters.
    out = dict(params)
    for name, value in params.items():
        if name.endswith(".gate") or name.endswith("norm1.bias") or name.endswith("ffn.in.bias"):
            out[name] = rng.uniform(-1.0, 1.0, value.shape)
    return out


METRICS = {
    "heads": dict(metric="heads"),
    "lowrank": dict(metric="lowrank", metric_rank=3),
    "none": dict(metric="none"),
}


def _encoder(metric, share, causal=False, layers=2):
    attn = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, **METRICS[metric])
    return do.EncoderConfig(attn, num_layers=layers, ffn_dim=24, share_metric=share, causal=causal)


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("metric", list(METRICS))
def test_encoder_matches_reference(metric, share, opset):
    rng = np.random.default_rng(0)
    config = _encoder(metric, share, causal=metric == "heads")
    params = _open(do.init_encoder_params(config, 1), rng)
    model = do.export_encoder(params, config, None, opset=opset, mask=True)
    session = do.ort_session(model)
    for B, N in [(2, 5), (1, 9)]:  # batch and length change after export
        x = rng.normal(size=(B, N, 16))
        mask = rng.random((B, 1, 1, N)) < 0.7
        expected = do.encoder_forward(params, config, x, mask=mask)
        _, ratio = tolerance("float32").output_ratio(
            do.run_ort(model, {"query": x, "mask": mask}, session=session), expected
        )
        assert ratio <= 1, (B, N, ratio)
    if opset == 23:
        out = do.run_reference(model, {"query": x, "mask": mask})
        assert tolerance("float32").output_ratio(out, expected)[1] <= 1


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_shared_generator_is_stored_once_and_gates_stay_per_layer(metric):
    rng = np.random.default_rng(1)
    shared, unshared = _encoder(metric, True, layers=3), _encoder(metric, False, layers=3)
    params = _open(do.init_encoder_params(shared, 2), rng)
    assert sum(k.startswith("shared.metric.qk.") for k in params) == (2 if metric == "heads" else 4)
    assert all(f"layers.{i}.attention.metric.qk.gate" in params for i in range(3))
    # The same weights in the unshared format: every layer copies the generator.
    copied = {}
    for name, value in params.items():
        if name.startswith("shared."):
            for i in range(3):
                copied[f"layers.{i}.attention.{name[len('shared.') :]}"] = value
        else:
            copied[name] = value
    x = rng.normal(size=(2, 6, 16))
    np.testing.assert_allclose(
        do.encoder_forward(params, shared, x), do.encoder_forward(copied, unshared, x), rtol=1e-12, atol=1e-12
    )
    m_shared = do.export_encoder(params, shared, None)
    m_unshared = do.export_encoder(copied, unshared, None)
    size = lambda m: sum(np.prod(t.dims) for t in m.graph.initializer)  # noqa: E731
    gen = sum(np.prod(v.shape) for k, v in params.items() if k.startswith("shared."))
    # Two of the three copies are saved; each layer adds at most 2*16 gate/identity rows.
    assert size(m_unshared) - size(m_shared) >= 2 * gen - 3 * 2 * 16 > 0
    np.testing.assert_allclose(do.run_ort(m_shared, {"query": x}), do.run_ort(m_unshared, {"query": x}), atol=1e-5)


def test_shared_generator_offset_is_folded_at_export(tmp_path):
    # (I + g b_A) was a Mul/Add on initialisers left to the runtime: onnxruntime's
    # CPU provider cannot constant-fold a float16 Mul and warned per layer at load.
    import subprocess
    import sys

    rng = np.random.default_rng(3)
    config = _encoder("heads", True)
    params = _open(do.init_encoder_params(config, 4), rng)
    x = rng.normal(size=(2, 5, 16))
    expected = do.encoder_forward(params, config, x)
    for dtype in ("float32", "float16"):
        path = tmp_path / f"{dtype}.onnx"
        model = do.export_encoder(params, config, path, dtype=dtype)
        stored = {t.name for t in model.graph.initializer}
        assert not [n.name for n in model.graph.node if n.input and set(n.input) <= stored]
        np.save(tmp_path / "x.npy", x.astype(dtype))
        code = (
            "import sys, numpy as np, onnxruntime as ort\n"
            "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])  # default log level\n"
            "np.save(sys.argv[3], s.run(None, {'query': np.load(sys.argv[2])})[0])\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, path, tmp_path / "x.npy", tmp_path / "y.npy"], capture_output=True, text=True
        )
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert tolerance(dtype).output_ratio(np.load(tmp_path / "y.npy"), expected)[1] <= 1, dtype


def test_gates_zero_stack_equals_mha_stack():
    # Identity anchoring through a whole stack: gates 0 -> the metric "none" stack.
    rng = np.random.default_rng(3)
    damcha, mha = _encoder("heads", True), _encoder("none", True)
    params = do.init_encoder_params(damcha, 4)
    mha_params = {k: v for k, v in params.items() if ".metric." not in k and not k.startswith("shared.")}
    x = rng.normal(size=(2, 7, 16))
    out = do.run_ort(do.export_encoder(params, damcha, None), {"query": x})
    ref = do.run_ort(do.export_encoder(mha_params, mha, None), {"query": x})
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
def test_token_model_end_to_end(opset, tmp_path):
    rng = np.random.default_rng(5)
    config = do.TokenModelConfig(_encoder("heads", True, causal=True), vocab_size=13, max_len=10, num_classes=3)
    params = _open(do.init_token_model_params(config, 6), rng)
    path = tmp_path / "model.onnx"
    do.export_token_model(params, config, path, opset=opset)
    model = onnx.load(path)
    for B, N in [(2, 4), (3, 10)]:
        tokens = rng.integers(0, 13, size=(B, N))
        out = do.run_ort(model, {"tokens": tokens})
        assert out.shape == (B, N, 3)
        _, ratio = tolerance("float32").output_ratio(out, do.token_model_forward(params, config, tokens))
        assert ratio <= 1
    too_long = rng.integers(0, 13, size=(1, 11))  # longer than max_len
    with pytest.raises(Exception, match="ONNXRuntimeError"):
        do.ort_session(model).run(None, {"tokens": too_long})  # the graph itself refuses, for raw onnxruntime users
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `tokens`: expected positions within the position table \(max_len=10\); they reach 10",
    ):
        do.run_ort(model, {"tokens": too_long})
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `tokens`: expected ids in \[0, 13\).*Received: tokens in \[-1, "
    ):
        do.run_ort(model, {"tokens": np.array([[0, -1, 3]])})  # Gather would wrap -1 to the last row


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (
            lambda: do.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, output_dim=6), 2, 8),
            dc.DamchaValueError,
            "context_dim == value_input_dim == output_dim == query_dim",
        ),
        (
            lambda: do.EncoderConfig(dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), 0, 8),
            dc.DamchaValueError,
            "Invalid argument `num_layers`: expected an int >= 1. Received: num_layers=0",
        ),
        (
            lambda: do.export_encoder(do.init_encoder_params(_encoder("heads", True)), _encoder("heads", False), None),
            dc.DamchaValueError,
            r"expected exactly the config's parameter names .*Received: params with missing \['layers.0.attention.metric.qk.kernel'",
        ),
        (
            lambda: do.export_encoder(
                do.init_encoder_params(_encoder("none", True)), _encoder("none", True), None, dtype="bfloat16"
            ),
            dc.DamchaValueError,
            "no bfloat16 kernels",
        ),
        (
            lambda: do.export_encoder(
                do.init_encoder_params(_encoder("none", True)), _encoder("none", True), None, opset=16
            ),
            dc.DamchaValueError,
            "Invalid argument `opset`: expected an int in",
        ),
    ],
    ids=["encoder-dims", "num-layers", "shared-params-for-unshared-config", "stack-bfloat16", "stack-opset"],
)
def test_stack_errors(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_int8_quantisation_accuracy_is_measured():
    rng = np.random.default_rng(7)
    config = do.EncoderConfig(dc.DamchaConfig(query_dim=32, num_heads=4, key_dim=8), 2, 64)
    params = _open(do.init_encoder_params(config, 8), rng)
    x = rng.normal(size=(2, 12, 32))
    model = do.export_encoder(params, config, None)
    q = do.quantize_int8(model)
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeLinear") for n in q.graph.node)
    assert sum(t.data_type == onnx.TensorProto.INT8 for t in q.graph.initializer) >= 6
    errors = do.quantization_error(model, q, {"query": x}, do.encoder_forward(params, config, x))
    assert errors["max_abs_float32_vs_reference"] < 1e-4
    # int8 changes the output (it is really quantised) but stays close: a few % RMS.
    assert 1e-4 < errors["rel_rms_vs_float32"] < 0.1, errors


def test_cli_exports_and_validates(tmp_path, capsys):
    from damcha_onnx._cli import main

    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, coupling="separate", context_dim=6)
    params = dc.init_params(config, 3)
    params["metric.q.gate"] = np.full(2, 0.7)
    dc.save_params(tmp_path / "p.safetensors", params, config)
    out = tmp_path / "m.onnx"
    rc = main(["--params", str(tmp_path / "p.safetensors"), "--out", str(out), "--opset", "18", "--cross", "--mask"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "shape inference: ok" in text and text.count("-> ok") == 2
    assert "Softmax" in {n.op_type for n in onnx.load(out).graph.node}
    other = config.replace(key_dim=2, num_kv_heads=1)  # value_dim follows key_dim
    rc = main(
        [
            "--config",
            str(other.to_dict()).replace("'", '"').replace("True", "true").replace("None", "null"),
            "--params",
            str(tmp_path / "p.safetensors"),
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    # The fields that differ, and only those, with both values.
    assert rc == 2 and f"differs from the config stored in {str(tmp_path / 'p.safetensors')!r} in: " in err, err
    assert "key_dim=2 (stored 4), value_dim=2 (stored 4), num_kv_heads=1 (stored 2). Omit --config to use the" in err
    assert "query_dim" not in err
    rc = main(["--params", str(tmp_path / "p.safetensors"), "--out", str(out), "--opset", "12"])
    assert rc == 2 and "Invalid argument `opset`: expected an int in" in capsys.readouterr().err


@pytest.mark.parametrize("opset", [17, 23], ids=lambda o: f"opset{o}")
def test_one_row_position_table_never_broadcasts(opset):
    # onnxruntime (extended optimisation) rewrites Gather(table, Range) into a
    # clamping Slice: with max_len = 1 the clamped 1-row table used to
    # broadcast over every token and the model ran silently on 3 tokens.
    config = do.TokenModelConfig(_encoder("heads", True), vocab_size=5, max_len=1, num_classes=2)
    params = do.init_token_model_params(config, 9)
    model = do.export_token_model(params, config, None, opset=opset)
    tokens = np.array([[1, 2, 3]])
    for optimize in (True, False):
        session = do.ort_session(model, optimize=optimize)
        one = do.run_ort(model, {"tokens": tokens[:, :1]}, session=session)  # within the table: runs
        _, ratio = tolerance("float32").output_ratio(one, do.token_model_forward(params, config, tokens[:, :1]))
        assert ratio <= 1
        with pytest.raises(Exception, match="ONNXRuntimeError"):
            session.run(None, {"tokens": tokens})
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `query_len`: expected an int <= max_len=1.*Received: query_len=2"
    ):
        do.export_token_model(params, config, None, opset=opset, dynamic=False, batch_size=1, query_len=2)


@pytest.mark.parametrize("bad", [-1, 5], ids=["negative", "past-vocab"])
def test_token_model_reference_rejects_ids_outside_the_vocabulary(bad):
    # The NumPy reference checks what run_ort checks: -1 used to read the last
    # embedding row silently, 5 raised a raw IndexError.
    config = do.TokenModelConfig(_encoder("none", False, layers=1), vocab_size=5, max_len=4, num_classes=2)
    params = do.init_token_model_params(config, 1)
    tokens = np.array([[0, bad, 2]])
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `tokens`: expected ids in \[0, 5\).*Received: tokens in \[{min(bad, 0)}, {max(bad, 2)}\]",
    ):
        do.token_model_forward(params, config, tokens)


@pytest.mark.parametrize(
    "which, pattern",
    [
        ("params-not-safetensors", r"--params: '.*bad.safetensors' is not a readable damcha_core.save_params file"),
        ("config-lacks-fields", r"--config: must be a DamchaConfig as JSON.*Received: --config='\{\"query_dim\": 8\}'"),
        ("config-not-json", r"--config: must be a DamchaConfig as JSON.*Received: --config='.*bad.safetensors'"),
        ("config-missing-file", r"--config: no such file '.*missing.json' \(inline JSON is an object: '\{\.\.\.\}'\)"),
        # These three read "no such file" too: a folder, a device, a JSON list.
        ("config-folder", r"--config: is a folder, expected a JSON file or inline JSON. Received: '.*'"),
        ("config-device", r"--config: is not a regular file. Received: '/dev/null'"),
        ("config-list", r"--config: inline JSON must be an object \('\{\.\.\.\}'\). Received: '\[\]'"),
    ],
    ids=[
        "params-not-safetensors",
        "config-lacks-fields",
        "config-not-json",
        "config-missing-file",
        "config-folder",
        "config-device",
        "config-list",
    ],
)
def test_cli_bad_files_exit_2_not_1(tmp_path, capsys, which, pattern):
    # Exit 1 means "the export does not match the reference"; a file that cannot
    # be read is a bad argument (2). These used to end in a traceback (exit 1).
    from damcha_onnx._cli import main

    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    good, bad = tmp_path / "p.safetensors", tmp_path / "bad.safetensors"
    dc.save_params(good, dc.init_params(config), config)
    bad.write_text("not a safetensors file")
    args = {
        "params-not-safetensors": ["--params", str(bad)],
        "config-lacks-fields": ["--params", str(good), "--config", '{"query_dim": 8}'],
        "config-not-json": ["--params", str(good), "--config", str(bad)],
        "config-missing-file": ["--params", str(good), "--config", str(tmp_path / "missing.json")],
        "config-folder": ["--params", str(good), "--config", str(tmp_path)],
        "config-device": ["--params", str(good), "--config", "/dev/null"],
        "config-list": ["--params", str(good), "--config", "[]"],
    }[which]
    rc = main([*args, "--out", str(tmp_path / "m.onnx")])
    assert rc == 2 and not (tmp_path / "m.onnx").exists()
    assert re.search(pattern, capsys.readouterr().err)


def test_config_check_compares_the_scale_as_computed(tmp_path, capsys):
    import json

    from damcha_onnx._cli import main

    """--config with scale written out as 1/sqrt(key_dim) describes a layer stored
    with scale None (the same scale): accepted; another scale is named."""
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    dc.save_params(tmp_path / "p.safetensors", dc.init_params(config, 0), config)
    common = ["--params", str(tmp_path / "p.safetensors"), "--out", str(tmp_path / "m.onnx"), "--opset", "18"]
    for scale, ok in ((0.5, True), (0.25, False)):
        rc = main(["--config", json.dumps({**config.to_dict(), "scale": scale}), *common])
        err = capsys.readouterr().err
        assert (rc == 0) == ok, err
        if not ok:
            assert "in: scale=0.25 (stored None). Omit --config" in err, err
