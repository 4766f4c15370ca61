"""``damcha export`` through the real entry point (a subprocess): bad flags exit
2 with one line naming the flag before any work; a failed export writes
nothing and keeps an earlier good file; exit 0 only for a validated model."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import damcha_core as dc
import damcha_onnx as do

CONFIG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
#: A cross-attention layer whose values have their own feature size (value_input_dim != context_dim).
VALUE_CONFIG = CONFIG.replace(context_dim=6, value_input_dim=5, coupling="separate")


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


@pytest.mark.parametrize(
    "flags, flag, says",
    [
        (["--seed", "-1"], "--seed", "must be an integer >= 0. Received: -1"),
        (["--seed", "x"], "--seed", "must be an integer. Received: 'x'"),
        (["--opset", "12"], "--opset", "Received: opset=12"),
        (["--dtype", "bfloat16"], "--dtype", "invalid choice: 'bfloat16'"),
        (["--kv-cache"], "--kv-cache", "needs --causal"),
        (["--kv-cache", "--causal", "--cross"], "--kv-cache", "cannot be combined with --cross"),
        (["--external-data", "sometimes"], "--external-data", "invalid choice"),
        (["--quantize", "static", "--dtype", "float64"], "--quantize", "needs --dtype float32"),
        (["--quantize", "int4"], "--quantize", "invalid choice"),
        (["--mask", "3d"], "--mask", "invalid choice: '3d' (choose from 'none', '4d', 'padding')"),
        (["--return-weights=yes"], "--return-weights", "ignored explicit argument 'yes'"),
        (["--ort-dir", ""], "--ort-dir", "needs a folder path"),
    ],
    ids=[
        "seed-negative",
        "seed-not-int",
        "opset-12",
        "dtype-bfloat16",
        "kv-cache-no-causal",
        "kv-cache-cross",
        "external-data",
        "quantize-float64",
        "quantize-int4",
        "mask-3d",
        "return-weights-value",
        "ort-dir-empty",
    ],
)
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
        export("--params", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "m.onnx")), "--params"
    )
    (tmp_path / "bad.safetensors").write_text("text")
    assert "not a readable damcha_core.save_params file" in one_line_usage_error(
        export("--params", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "m.onnx")), "--params"
    )


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"context_dim": 6}, "context_dim (6) differs from its query_dim (8)"),
        ({"value_input_dim": 5}, "value_input_dim (5) differs from its context_dim (8)"),
    ],
    ids=["context", "value"],
)
def test_a_layer_with_a_separate_context_or_value_needs_cross(tmp_path, fields, says):
    cross = CONFIG.replace(coupling="separate", **fields)
    dc.save_params(tmp_path / "c.safetensors", dc.init_params(cross, 0), cross)
    line = one_line_usage_error(
        export("--params", str(tmp_path / "c.safetensors"), "--out", str(tmp_path / "m.onnx")), "--cross"
    )
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


@pytest.mark.parametrize(
    "where, says",
    [("a-file", "exists and is not a folder"), ("read-only-ort", "read-only"), ("ort-is-a-folder", "is a directory")],
    ids=["a-file", "read-only-ort", "ort-is-a-folder"],
)
def test_unusable_ort_dirs_exit_2_before_any_work(params_file, tmp_path, where, says):
    ort_dir = tmp_path / "ort"
    if where == "a-file":
        ort_dir.write_text("not a folder")
    elif where == "read-only-ort":
        ort_dir.mkdir()
        (ort_dir / "m.ort").write_bytes(b"old")
        (ort_dir / "m.ort").chmod(0o444)
    else:
        (ort_dir / "m.int8.ort").mkdir(parents=True)  # where --quantize's .ort file would go
    proc = export(
        "--params", params_file, "--out", str(tmp_path / "m.onnx"), "--ort-dir", str(ort_dir), "--quantize", "dynamic"
    )
    assert says in one_line_usage_error(proc, "--ort-dir")
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "m.int8.onnx").exists()


def test_without_onnxruntime_exit_2_naming_the_onnx_extra(params_file, tmp_path):
    code = (
        "import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'onnxruntime':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\nfrom damcha_core._cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "export", "--params", params_file, "--out", str(tmp_path / "m.onnx")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("damcha export: error: needs onnxruntime") and line.endswith('pip install "damcha[onnx]"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


@pytest.mark.parametrize("external", ["auto", "always"])
def test_a_read_only_external_data_file_is_refused(params_file, tmp_path, external):
    out = tmp_path / "m.onnx"
    data = tmp_path / "m.onnx.data"
    data.write_bytes(b"old")
    data.chmod(0o444)
    message = one_line_usage_error(
        export("--params", params_file, "--out", str(out), "--external-data", external), "--out"
    )
    assert "read-only" in message and "m.onnx.data" in message
    assert data.read_bytes() == b"old" and not out.exists()


def test_a_read_only_out_is_refused(params_file, tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"old")
    out.chmod(0o444)
    assert "read-only" in one_line_usage_error(export("--params", params_file, "--out", str(out)), "--out")
    assert out.read_bytes() == b"old"


def test_a_read_only_stale_data_file_is_refused_also_without_external_data(params_file, tmp_path):
    # --external-data never removes the stale <out>.data of an earlier export: not a read-only one.
    out = tmp_path / "m.onnx"
    data = tmp_path / "m.onnx.data"
    data.write_bytes(b"old")
    data.chmod(0o444)
    message = one_line_usage_error(
        export("--params", params_file, "--out", str(out), "--external-data", "never"), "--out"
    )
    assert "read-only" in message and "m.onnx.data" in message
    assert data.read_bytes() == b"old" and not out.exists()


def test_sigterm_while_exporting_cleans_up_and_exits_143(tmp_path):
    # A scheduler's or `timeout`'s SIGTERM unwinds like Ctrl-C: the staging folder beside --out is
    # removed (it was left behind, holding the model), one line, 143.
    import signal
    import time

    config = dc.DamchaConfig(query_dim=768, num_heads=8, key_dim=96)
    params = tmp_path / "big.safetensors"
    dc.save_params(params, dc.init_params(config, 2), config)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "damcha_core._cli",
            "export",
            "--params",
            str(params),
            "--out",
            str(tmp_path / "m.onnx"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".damcha-export-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the export ended before it was signalled"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "damcha export: terminated", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_replaced_outputs_keep_their_permissions(params_file, tmp_path):
    out = tmp_path / "m.onnx"
    assert export("--params", params_file, "--out", str(out), "--quantize", "dynamic").returncode == 0
    for name in ("m.onnx", "m.int8.onnx"):
        (tmp_path / name).chmod(0o600)
    proc = export("--params", params_file, "--out", str(out), "--quantize", "dynamic")
    assert proc.returncode == 0, proc.stderr
    for name in ("m.onnx", "m.int8.onnx"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
def test_an_out_where_no_file_can_be_created_is_refused(params_file, tmp_path):
    """/proc/self/fd takes no file, even from root (for whom os.access always says
    writable): one line, exit 2, before any work."""
    line = one_line_usage_error(export("--params", params_file, "--out", "/proc/self/fd/m.onnx"), "--out")
    assert line == (
        "damcha export: error: --out: folder '/proc/self/fd' is not writable. Received: '/proc/self/fd/m.onnx'"
    )
    line = one_line_usage_error(
        export("--params", params_file, "--out", str(tmp_path / "m.onnx"), "--ort-dir", "/proc/self/fd"), "--ort-dir"
    )
    assert "folder '/proc/self/fd' is not writable" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


# A runtime that computes one output wrong: onnxruntime (run_ort) as the validation calls it, or the
# sessions of the .ort files (ort_session), which the .onnx validation does not use.
_MISMATCH = """
import sys
import damcha_onnx._cli as cli
WHERE, OUTPUT = sys.argv.pop(1), sys.argv.pop(1)
if WHERE == "onnx":
    real = cli.run_ort
    def run_ort(model, feeds, **kw):
        out = real(model, feeds, **kw)
        out[OUTPUT] = out[OUTPUT] + 1e-2
        return out
    cli.run_ort = run_ort
else:
    real_session = cli.ort_session
    class Off:
        def __init__(self, session):
            self.session = session
        def __getattr__(self, name):
            return getattr(self.session, name)
        def run(self, names, feeds):
            names_out = [o.name for o in self.session.get_outputs()]
            return [v + 1e-2 if n == OUTPUT else v for n, v in zip(names_out, self.session.run(names, feeds))]
    cli.ort_session = lambda *a, **kw: Off(real_session(*a, **kw))
from damcha_core._cli import main
sys.exit(main(sys.argv[1:]))
"""


def mismatch(where: str, output: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _MISMATCH, where, output, "export", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "where, output, flags",
    [
        ("onnx", "output", ["--causal"]),
        ("onnx", "weights", ["--causal", "--return-weights", "--mask", "padding"]),
        ("ort", "output", ["--ort-dir", "ort"]),
    ],
    ids=["output", "weights-only", "ort-format-only"],
)
def test_a_validation_mismatch_exits_1_and_keeps_the_earlier_good_file(params_file, tmp_path, where, output, flags):
    out = tmp_path / "m.onnx"
    good = export("--params", params_file, "--out", str(out))
    assert good.returncode == 0, good.stderr
    before = out.read_bytes()
    onnx.checker.check_model(str(out), full_check=True)
    flags = [str(tmp_path / f) if f == "ort" else f for f in flags]
    proc = mismatch(where, output, "--params", params_file, "--out", str(out), *flags)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stdout and "not written" in proc.stdout
    if where == "ort":  # the .onnx model itself was fine: only the ORT file failed
        assert "ORT format m.ort vs NumPy reference" in proc.stdout and proc.stdout.count("-> ok") == 2
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


def test_static_quantize_at_an_opset_onnxruntime_cannot_run_is_refused_before_any_work(params_file, tmp_path):
    from damcha_onnx._quantize import static_opset_runs

    newest = onnx.defs.onnx_opset_version()
    if static_opset_runs(newest):
        pytest.fail(f"onnxruntime now runs QDQ at opset {newest}: pick an opset it cannot run, or drop this test")
    proc = export(
        "--params", params_file, "--out", str(tmp_path / "m.onnx"), "--quantize", "static", "--opset", str(newest)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert "--quantize: static needs an export at an opset whose QuantizeLinear/DequantizeLinear" in proc.stderr
    assert f"or quantise dynamically (--quantize dynamic). Received: --opset {newest}" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


@pytest.mark.parametrize("how", ["dynamic", "static"])
def test_quantize_a_decode_step_judged_through_its_cache(params_file, tmp_path, how):
    # The API quantises decode steps (it only needs float32); the CLI refused --kv-cache with --quantize.
    out = tmp_path / "step.onnx"
    flags = ["--causal", "--kv-cache", "--mask", "padding", "--quantize", how]
    proc = export("--params", params_file, "--out", str(out), *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"int8 ({how}) vs NumPy reference" in proc.stdout and proc.stdout.count("-> ok") == 3
    assert "decoded in chunks (3, 1, 3) -> ok (allowed 0.1)" in proc.stdout
    # The written int8 step, decoded here through its own cache against the full causal reference.
    params, _ = dc.load_params(params_file)
    rng = np.random.default_rng(5)
    x, padding = rng.normal(size=(2, 6, 8)), rng.random((2, 6)) < 0.8
    padding[:, 0] = True
    int8 = str(tmp_path / "step.int8.onnx")
    cache, outs = do.empty_kv_cache(int8, 2), []
    for start, stop in [(0, 4), (4, 5), (5, 6)]:
        step = do.run_ort(int8, {"query": x[:, start:stop], "mask": padding[:, :stop], **cache}, all_outputs=True)
        cache = {"past_key": step["present_key"], "past_value": step["present_value"]}
        outs.append(step["output"])
    ref = dc.damcha_attention(params, CONFIG, x, causal=True, mask=padding[:, None, None, :])
    rel = np.sqrt(np.mean((np.concatenate(outs, axis=1) - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    assert rel <= 0.1


def test_an_int8_model_outside_its_allowance_writes_neither_file(params_file, tmp_path):
    code = (
        "import sys\nimport damcha_onnx._cli as cli\ncli.INT8_RTOL = 0.0  # no int8 model is that exact\n"
        "from damcha_core._cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "export",
            "--params",
            params_file,
            "--out",
            str(tmp_path / "m.onnx"),
            "--quantize",
            "dynamic",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


def _feeds(model: onnx.ModelProto, rng: np.random.Generator, B: int = 3, N: int = 6, M: int = 4) -> dict:
    """Random feeds for every declared input (a length of its own, not the CLI's validation sizes)."""
    feeds = {}
    M = M if "context" in [v.name for v in model.graph.input] else N  # self-attention: the query's keys
    for value in model.graph.input:
        dims = [d.dim_value or None for d in value.type.tensor_type.shape.dim]
        if value.name == "mask":
            feeds["mask"] = rng.random((B, M) if len(dims) == 2 else (B, 1, N, M)) < 0.7
        else:
            feeds[value.name] = rng.normal(size=(B, N if value.name == "query" else M, dims[-1]))
    return feeds


def _reference(params, config, feeds, causal=False):
    mask = feeds.get("mask")
    if mask is not None and mask.ndim == 2:
        mask = mask[:, None, None, :]
    return dc.damcha_attention(
        params,
        config,
        feeds["query"],
        feeds.get("context"),
        value=feeds.get("value"),
        mask=mask,
        causal=causal,
        return_weights=True,
    )


@pytest.mark.parametrize(
    "flags, mask_rank",
    [
        (["--mask"], 4),  # a bare --mask is the 4-D mask, as before the choices
        (["--mask", "4d", "--opset", "17"], 4),
        (["--mask", "padding"], 2),
        (["--mask", "none"], None),
    ],
    ids=["bare-mask", "4d-opset17", "padding", "none"],
)
def test_mask_choices_and_return_weights(params_file, tmp_path, flags, mask_rank):
    out = tmp_path / "m.onnx"
    proc = export("--params", params_file, "--out", str(out), "--causal", "--return-weights", *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(weights) on (B=2, N=7, M=7) -> ok") == 2
    model = onnx.load(str(out))
    inputs = {v.name: len(v.type.tensor_type.shape.dim) for v in model.graph.input}
    assert inputs == {"query": 3, **({"mask": mask_rank} if mask_rank else {})}
    assert [o.name for o in model.graph.output] == ["output", "weights"]
    # The written file, run here on other sizes, against the reference's return_weights.
    params, config = dc.load_params(params_file)
    feeds = _feeds(model, np.random.default_rng(5), M=6)
    got = do.run_ort(str(out), feeds, all_outputs=True)
    want, weights = _reference(params, config, feeds, causal=True)
    np.testing.assert_allclose(got["output"], want, atol=1e-5)
    np.testing.assert_allclose(got["weights"], weights, atol=1e-6)


def test_a_padding_mask_and_weights_through_the_cache(params_file, tmp_path):
    out = tmp_path / "step.onnx"
    proc = export(
        "--params",
        params_file,
        "--out",
        str(out),
        "--causal",
        "--kv-cache",
        "--mask",
        "padding",
        "--return-weights",
        "--dtype",
        "float64",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(weights) decoded in chunks (3, 1, 3) on (B=2, N=7, M=7) -> ok") == 2
    model = onnx.load(str(out))
    assert [(v.name, len(v.type.tensor_type.shape.dim)) for v in model.graph.input] == [
        ("query", 3),
        ("past_key", 4),
        ("past_value", 4),
        ("mask", 2),
    ]
    assert [o.name for o in model.graph.output] == ["output", "present_key", "present_value", "weights"]


def test_value_tokens_of_their_own_size_are_fed_and_validated(tmp_path):
    params_file = tmp_path / "v.safetensors"
    params = dc.init_params(VALUE_CONFIG, 2)
    dc.save_params(params_file, params, VALUE_CONFIG)
    out = tmp_path / "v.onnx"
    proc = export(
        "--params",
        str(params_file),
        "--out",
        str(out),
        "--cross",
        "--mask",
        "padding",
        "--return-weights",
        "--quantize",
        "dynamic",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("-> ok") == 3 and "on (B=2, N=7, M=5)" in proc.stdout
    model = onnx.load(str(out))
    assert {v.name: v.type.tensor_type.shape.dim[-1].dim_value for v in model.graph.input if v.name != "mask"} == {
        "query": 8,
        "context": 6,
        "value": 5,
    }
    feeds = _feeds(model, np.random.default_rng(6))
    want, weights = _reference(params, VALUE_CONFIG, feeds)
    got = do.run_ort(str(out), feeds, all_outputs=True)
    np.testing.assert_allclose(got["output"], want, atol=1e-5)
    np.testing.assert_allclose(got["weights"], weights, atol=1e-6)
    # Values matter: the same context with other value tokens gives another output.
    other = dict(feeds, value=feeds["value"] + 1.0)
    assert np.max(np.abs(do.run_ort(str(out), other) - got["output"])) > 1e-2


def test_ort_dir_writes_validated_ort_files_and_their_operator_config(params_file, tmp_path):
    out, ort_dir = tmp_path / "m.onnx", tmp_path / "mobile" / "ort"  # created, with its parent
    proc = export(
        "--params",
        params_file,
        "--out",
        str(out),
        "--mask",
        "padding",
        "--quantize",
        "dynamic",
        "--ort-dir",
        str(ort_dir),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ORT format m.ort vs NumPy reference" in proc.stdout and proc.stdout.count("-> ok") == 5
    assert proc.stderr == ""
    assert sorted(p.name for p in ort_dir.iterdir()) == ["m.int8.ort", "m.ort", "required_operators_and_types.config"]
    # The reduced operator config, read with onnxruntime's own parser, covers both models.
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    config_file = ort_dir / "required_operators_and_types.config"
    required, _ = parse_config(str(config_file))
    assert {"Attention", "RMSNormalization"} <= set(required["ai.onnx"][23])  # keyed by the ops' since-versions
    assert {"MatMul", "MatMulInteger"} <= set().union(*required["ai.onnx"].values())  # MatMulInteger: the int8 model
    assert f"# - {ort_dir.resolve() / 'm.ort'}" in config_file.read_text()  # names the files where they now are
    params, config = dc.load_params(params_file)
    feeds = _feeds(onnx.load(str(out)), np.random.default_rng(7))
    want, _ = _reference(params, config, feeds)
    got = do.run_ort(str(out), feeds, session=do.ort_session(str(ort_dir / "m.ort")))
    np.testing.assert_allclose(got, want, atol=1e-5)
    int8 = do.run_ort(str(tmp_path / "m.int8.onnx"), feeds, session=do.ort_session(str(ort_dir / "m.int8.ort")))
    assert np.sqrt(np.mean((int8 - want) ** 2) / np.mean(want**2)) <= 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.int8.onnx", "m.onnx", "mobile", "p.safetensors"]


@pytest.mark.parametrize("how", ["same-path", "relative-vs-absolute", "symlink", "config"])
def test_out_that_is_an_input_exits_2_and_keeps_it(tmp_path, monkeypatch, how):
    """`--out` naming the --params (or --config) file used to replace the weights with the model, exit 0."""
    # Inputs named .onnx, so that the suffix rule does not refuse --out first.
    params = tmp_path / "w.onnx"
    dc.save_params(params, dc.init_params(CONFIG, 1), CONFIG)
    config = tmp_path / "c.onnx"
    config.write_text(json.dumps(CONFIG.to_dict()))
    args = ["--params", str(params), "--out", str(params)]
    if how == "relative-vs-absolute":
        monkeypatch.chdir(tmp_path)
        args = ["--params", "./w.onnx", "--out", str(params)]
    elif how == "symlink":
        (tmp_path / "link.onnx").symlink_to(params)
        args[-1] = str(tmp_path / "link.onnx")
    elif how == "config":
        args = ["--params", str(params), "--config", str(config), "--out", str(config)]
    before = {p: p.read_bytes() for p in (params, config)}
    line = one_line_usage_error(export(*args), "--out")
    assert "would overwrite the " + ("--config" if how == "config" else "--params") in line
    assert {p: p.read_bytes() for p in (params, config)} == before


def test_out_that_is_a_link_is_written_through_as_the_api_writes(params_file, tmp_path):
    """`--out lnk.onnx` (a link to real/target.onnx) replaced the link by a file and left the target
    as it was; damcha_onnx.export writes a one-file model through the link."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "target.onnx").write_bytes(b"old")
    link = tmp_path / "lnk.onnx"
    link.symlink_to(real / "target.onnx")
    result = export("--params", params_file, "--out", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.path.realpath(link) == str(real / "target.onnx")
    api = tmp_path / "api.onnx"
    do.export(*dc.load_params(params_file), api)
    assert (real / "target.onnx").read_bytes() == api.read_bytes()
    assert sorted(p.name for p in real.iterdir()) == ["target.onnx"]  # no staging folder left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api.onnx", "lnk.onnx", "p.safetensors", "real"]


@pytest.mark.parametrize("name", ["m.ort", "m.json", "m.textproto", "m.onnxtxt", "m.st", ".onnx", ".ONNX"])
def test_out_not_onnx_exits_2_before_any_work(params_file, tmp_path, name):
    """onnx.save writes text for .json/.textproto/.onnxtxt; .ort used to die after the export (exit 1);
    a bare .onnx has no stem for the .int8.onnx/.ort names. The Python API's rule, word for word."""
    out = tmp_path / name
    line = one_line_usage_error(export("--params", params_file, "--out", str(out)), "--out")
    assert "expected a .onnx file path with a name before the suffix (any case" in line
    assert f"Received: {str(out)!r}" in line
    with pytest.raises(dc.DamchaValueError) as api:
        do.export(dc.load_params(params_file)[0], CONFIG, out)
    assert line.split("expected ", 1)[1].split(". Received")[0] in str(api.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


def test_out_suffix_check_ignores_case(params_file, tmp_path):
    """onnx.save writes protobuf for .ONNX as for .onnx: only the text suffixes are refused."""
    out = tmp_path / "M.ONNX"
    result = export("--params", params_file, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert onnx.load(str(out)).graph.node


def test_a_later_export_names_the_companions_it_did_not_write(tmp_path):
    """An E=8 export with --quantize and --ort-dir, then an E=16 one to the same --out: the
    second used to leave m.int8.onnx and ort/m.int8.ort of the first without a word. They
    are named in a warning, and kept: the name m.int8.onnx is also what people call their
    own quantized model, and nothing in the file says who wrote it."""
    small, large = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    dc.save_params(small, dc.init_params(CONFIG, 1), CONFIG)
    wide = CONFIG.replace(query_dim=16)
    dc.save_params(large, dc.init_params(wide, 2), wide)
    out, ort_dir = tmp_path / "m.onnx", tmp_path / "ort"
    first = export("--params", str(small), "--out", str(out), "--quantize", "dynamic", "--ort-dir", str(ort_dir))
    assert first.returncode == 0, first.stdout + first.stderr
    before = {p: p.read_bytes() for p in (tmp_path / "m.int8.onnx", ort_dir / "m.int8.ort")}
    # --ort-dir without --quantize: the int8 files beside --out and in --ort-dir may be stale.
    second = export("--params", str(large), "--out", str(out), "--ort-dir", str(ort_dir))
    assert second.returncode == 0, second.stdout + second.stderr
    for path in before:
        assert f"warning: {path} was not written by this run; if an earlier export of {out}" in second.stderr
    assert {p: p.read_bytes() for p in before} == before
    assert "m.onnx" not in second.stderr.replace(f"earlier export of {out}", "")  # only the companions are named
    dim = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    assert dim == 16  # the second model, and the .ort file beside it is of the same model
    feeds = {"query": np.random.default_rng(0).normal(size=(1, 3, 16)).astype(np.float32)}
    np.testing.assert_allclose(
        do.run_ort(str(out), feeds, session=do.ort_session(str(ort_dir / "m.ort"))), do.run_ort(str(out), feeds), atol=0
    )
    # A run that writes the int8 model names nothing.
    third = export("--params", str(large), "--out", str(out), "--quantize", "dynamic", "--ort-dir", str(ort_dir))
    assert third.returncode == 0 and "was not written by this run" not in third.stderr, third.stderr


def test_a_users_own_file_named_like_a_companion_is_never_removed(params_file, tmp_path):
    """A user's own m.int8.onnx (onnxruntime's quantizer, say) beside a first export to m.onnx:
    cced8b2 removed it and said it was "left by an earlier export"."""
    out = tmp_path / "m.onnx"
    mine = tmp_path / "m.int8.onnx"
    mine.write_bytes(b"the user's own model")
    proc = export("--params", params_file, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mine.read_bytes() == b"the user's own model"
    assert f"warning: {mine} was not written by this run" in proc.stderr


def test_help_shows_the_required_flags_as_required_and_the_opset_range():
    proc = export("--help")
    assert proc.returncode == 0, proc.stderr
    usage = " ".join(proc.stdout.split("\n\n")[0].split())
    # --help is handled while the required flags are relaxed (unknown flags are found first): shown as required anyway.
    assert "--params PARAMS --out OUT" in usage and "[--params" not in usage and "[--out" not in usage, usage
    assert "\nrequired:\n  --params PARAMS" in proc.stdout
    text = " ".join(proc.stdout.split())
    assert f"--opset OPSET an integer in [17, {onnx.defs.onnx_opset_version()}]" in text
    # Still one line for a missing one.
    assert "the following arguments are required: --params" in one_line_usage_error(export("--out", "x.onnx"), "")


@pytest.mark.parametrize("external", ["auto", "always"])
def test_an_out_name_whose_data_file_name_is_too_long_is_refused_before_any_work(params_file, tmp_path, external):
    """A valid 251-byte --out: its `<out>.data` name passes the OS's 255-byte limit, which
    raised a traceback (ENAMETOOLONG from pathlib) before; now one usage line naming --out."""
    out = tmp_path / ("e" * 246 + ".onnx")
    proc = export("--params", params_file, "--out", str(out), "--external-data", external)
    message = one_line_usage_error(proc, "--out")
    assert "File name too long" in message and ".onnx.data" in message
    assert not out.exists()


def test_without_external_data_an_out_name_whose_data_file_name_is_too_long_is_exported(params_file, tmp_path):
    """With --external-data never the data file is never written: a --out whose `<out>.data` name
    the OS refuses is fine (the read-only check of a stale data file raised ENAMETOOLONG there)."""
    out = tmp_path / ("e" * 246 + ".onnx")
    proc = export("--params", params_file, "--out", str(out), "--external-data", "never")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "p.safetensors"])


def test_external_data_export_to_the_longest_name_its_data_file_allows(params_file, tmp_path):
    """A 250-byte --out with --external-data always: its data file's name is 255 bytes, and the
    export is written and validated (the shape-inference copy was named `<out>.inferred`, over
    the limit: the export failed after its work)."""
    out = tmp_path / ("e" * 245 + ".onnx")
    proc = export("--params", params_file, "--out", str(out), "--external-data", "always")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.exists() and (tmp_path / (out.name + ".data")).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, out.name + ".data", "p.safetensors"])


@pytest.mark.parametrize(
    "value, dtype, holding",
    [(1e6, "float16", "float32"), (1e39, "float32", "float64"), (1e39, "float16", "float64")],
    ids=["float16-needs-float32", "float32-needs-float64", "float16-needs-float64"],
)
def test_weights_past_the_dtype_name_dtype_and_the_choice_that_holds_them(tmp_path, value, dtype, holding):
    """Weights that round to inf in --dtype were refused naming `params['query.kernel']` only, not the
    flag: now --dtype, the value it refuses and the narrowest --dtype that holds every weight."""
    params = dc.init_params(CONFIG, 1)
    params["query.kernel"] = params["query.kernel"].copy()
    params["query.kernel"].flat[3] = -value
    dc.save_params(tmp_path / "big.safetensors", params, CONFIG)
    line = one_line_usage_error(
        export("--params", str(tmp_path / "big.safetensors"), "--out", str(tmp_path / "m.onnx"), "--dtype", dtype),
        "--dtype",
    )
    assert f"--dtype: {dtype} cannot hold the weights of --params" in line, line
    assert f"params['query.kernel']`: expected values that round to a finite {dtype}" in line, line
    assert f"max |value| = {value!r}" in line and f"pass --dtype {holding}, the narrowest choice" in line, line
    assert line.endswith(f"Received: --dtype {dtype}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


@pytest.mark.parametrize("external", ["auto", "always"])
def test_a_folder_where_the_data_file_goes_is_named_as_the_problem(params_file, tmp_path, external):
    """A folder at `<out>.data` was refused as "--out: is a directory, expected a file path. Received:
    'm.onnx.data'": a path the user never typed, read as if --out were that folder. Now the folder is
    named as what stands where the data file goes, with --out as received and the ways out."""
    out = tmp_path / "m.onnx"
    (tmp_path / "m.onnx.data").mkdir()
    line = one_line_usage_error(
        export("--params", params_file, "--out", str(out), "--external-data", external), "--out"
    )
    assert f"--out: {str(tmp_path / 'm.onnx.data')!r} is a folder, where the external data file of --out goes" in line
    assert f"--external-data {external}); expected no folder there: move or rename it" in line, line
    assert ("pass --external-data never" in line) == (external == "auto"), line
    assert line.endswith(f"Received: --out {str(out)!r}"), line
    assert not out.exists()
