"""``damcha export`` through the real entry point (a subprocess): bad flags exit
2 with one line naming the flag before any work; a failed export writes
nothing and keeps an earlier good file; exit 0 only for a validated model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import damcha_core as dc

CONFIG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)


@pytest.fixture
def params_file(tmp_path) -> str:
    path = tmp_path / "p.safetensors"
    dc.save_params(path, dc.init_params(CONFIG, 1), CONFIG)
    return str(path)


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "damcha_core._cli", "export", *args], capture_output=True, text=True)


def one_line_usage_error(proc: subprocess.CompletedProcess, flag: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"damcha export: error: {flag}"), lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, flag, says", [
    (["--seed", "-1"], "--seed", "must be an integer >= 0. Received: -1"),
    (["--seed", "x"], "--seed", "must be an integer. Received: 'x'"),
    (["--opset", "12"], "--opset", "Received: opset=12"),
    (["--dtype", "bfloat16"], "--dtype", "invalid choice: 'bfloat16'"),
    (["--kv-cache"], "--kv-cache", "needs --causal"),
    (["--kv-cache", "--causal", "--cross"], "--kv-cache", "cannot be combined with --cross"),
    (["--external-data", "sometimes"], "--external-data", "invalid choice"),
    (["--quantize", "static", "--dtype", "float64"], "--quantize", "needs --dtype float32"),
    (["--quantize", "int4"], "--quantize", "invalid choice"),
], ids=["seed-negative", "seed-not-int", "opset-12", "dtype-bfloat16", "kv-cache-no-causal", "kv-cache-cross",
        "external-data", "quantize-float64", "quantize-int4"])
def test_bad_flags_exit_2_in_one_line(params_file, tmp_path, flags, flag, says):
    out = tmp_path / "m.onnx"
    assert says in one_line_usage_error(export("--params", params_file, "--out", str(out), *flags), flag)
    assert not out.exists()


def test_empty_out_names_the_flag_not_the_functions_argument(params_file):
    line = one_line_usage_error(export("--params", params_file, "--out", ""), "--out")
    assert "needs a file path. Received: ''" in line and "`path`" not in line


@pytest.mark.parametrize("where, says", [("missing-folder", "does not exist"), ("a-folder", "is a directory")])
def test_unusable_out_paths_exit_2_before_any_work(params_file, tmp_path, where, says):
    out = tmp_path / "no" / "m.onnx" if where == "missing-folder" else tmp_path
    assert says in one_line_usage_error(export("--params", params_file, "--out", str(out)), "--out")


def test_missing_or_foreign_params_exit_2(tmp_path):
    assert "does not exist" in one_line_usage_error(
        export("--params", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "m.onnx")), "--params")
    (tmp_path / "bad.safetensors").write_text("text")
    assert "not a readable damcha_core.save_params file" in one_line_usage_error(
        export("--params", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "m.onnx")), "--params")


def test_a_layer_with_a_separate_context_needs_cross(tmp_path):
    cross = CONFIG.replace(context_dim=6, coupling="separate")
    dc.save_params(tmp_path / "c.safetensors", dc.init_params(cross, 0), cross)
    line = one_line_usage_error(export("--params", str(tmp_path / "c.safetensors"), "--out", str(tmp_path / "m.onnx")),
                                "--cross")
    assert "context_dim (6) differs from its query_dim (8)" in line


def test_a_read_only_out_is_refused(params_file, tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"old")
    out.chmod(0o444)
    assert "read-only" in one_line_usage_error(export("--params", params_file, "--out", str(out)), "--out")
    assert out.read_bytes() == b"old"


_MISMATCH = """
import sys
import numpy as np
import damcha_onnx._cli as cli
real = cli.run_ort
cli.run_ort = lambda model, feeds, **kw: real(model, feeds, **kw) + 1e-2  # a runtime that computes wrong numbers
from damcha_core._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_validation_mismatch_exits_1_and_keeps_the_earlier_good_file(params_file, tmp_path):
    out = tmp_path / "m.onnx"
    good = export("--params", params_file, "--out", str(out))
    assert good.returncode == 0, good.stderr
    before = out.read_bytes()
    onnx.checker.check_model(str(out), full_check=True)
    proc = subprocess.run([sys.executable, "-c", _MISMATCH, "export", "--params", params_file, "--out", str(out),
                           "--causal"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stdout and "not written" in proc.stdout
    assert out.read_bytes() == before  # the earlier, validated model is still there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "p.safetensors"]  # nothing staged is left


def test_external_data_and_float16_and_a_stale_data_file(params_file, tmp_path):
    out = tmp_path / "m.onnx"
    proc = export("--params", params_file, "--out", str(out), "--external-data", "always", "--dtype", "float16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "m.onnx.data").exists() and "-> ok" in proc.stdout
    assert onnx.load(str(out)).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    proc = export("--params", params_file, "--out", str(out), "--external-data", "never")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "m.onnx.data").exists()  # the new single-file model does not leave a stale data file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "p.safetensors"]


def test_exit_0_and_the_validation_report(params_file, tmp_path):
    proc = export("--params", params_file, "--out", str(tmp_path / "m.onnx"), "--mask", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("-> ok") == 2 and f"wrote {tmp_path / 'm.onnx'}" in proc.stdout
    assert Path(tmp_path / "m.onnx").stat().st_size > 0


@pytest.mark.parametrize("how", ["dynamic", "static"])
def test_quantize_writes_a_validated_int8_model_beside_the_float_one(params_file, tmp_path, how):
    out = tmp_path / "m.onnx"
    proc = export("--params", params_file, "--out", str(out), "--quantize", how, "--mask")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"int8 ({how}) vs NumPy reference" in proc.stdout and proc.stdout.count("-> ok") == 3
    assert proc.stderr == ""  # onnxruntime's quantiser warnings are not passed on
    int8 = onnx.load(str(tmp_path / "m.int8.onnx"))
    ops = {n.op_type for n in int8.graph.node}
    assert ({"DynamicQuantizeLinear", "MatMulInteger"} & ops) if how == "dynamic" else ("QuantizeLinear" in ops)


def test_an_int8_model_outside_its_allowance_writes_neither_file(params_file, tmp_path):
    code = ("import sys\nimport damcha_onnx._cli as cli\ncli.INT8_RTOL = 0.0  # no int8 model is that exact\n"
            "from damcha_core._cli import main\nsys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "export", "--params", params_file, "--out",
                           str(tmp_path / "m.onnx"), "--quantize", "dynamic"], capture_output=True, text=True)
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]
