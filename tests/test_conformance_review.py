"""What a read-only review of the conformance suite and ``damcha conform`` found (session 32), one
test or two per defect: value tokens of another batch passed as good input; no NaN in a context
token; bad input checked in the first dtype only; a decode check that left the prefill unchecked
said PASSED; an adapter printing the worker's progress prefix crashed the command; ``--json``
replaced the file the table went to (``/dev/stdout > log.txt``) or the adapter's own source; and
``--collect-only`` said "no tests collected" under the ids it listed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import damcha_conformance as dcf
import damcha_core as dc

TESTS = Path(__file__).parent
ONLY = dict(decoding=False, weights=False, penalty=False)  # the checks each test is about, nothing else

# A third party's adapter module, written where the command imports it from (PYTHONPATH).
THIRD_PARTY = '''
from damcha_conformance import ReferenceAdapter


class Chatty(ReferenceAdapter):
    """Prints what the worker's progress used to look like, and a line of the new format."""

    name = "chatty"

    def forward(self, data, dtype):
        print("@damcha-progress debugging", data.case.name, flush=True)
        print("@damcha-progress 1 2 x\\t{not json", flush=True)
        print('{"done": 1, "total": 1, "what": "fake", "result": null}', flush=True)
        return super().forward(data, dtype)


class Plain(ReferenceAdapter):
    name = "plain"


class DecodedOnly(ReferenceAdapter):
    """Returns the decoded tokens' outputs alone (B, N, E_o), as adapters written before did."""

    name = "decoded-only"

    def decode(self, data, dtype):
        return super().decode(data, dtype)[:, data.case.prefix_len :]
'''


def conform(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", *args], text=True, cwd=cwd, env=env, **kw
    )


@pytest.fixture
def third_party(tmp_path: Path) -> Path:
    (tmp_path / "thirdparty.py").write_text(THIRD_PARTY)
    return tmp_path


# ---------------------------------------------------------------- D1: the value tokens' batch


class _ValueBatchLax(dcf.ReferenceAdapter):
    """Checks the value tokens' length and features but not their batch: batch 1 is broadcast over
    B (as torch.einsum does), B + 1 rows are cut to B."""

    name = "value-batch-lax"

    def forward(self, data, dtype):
        if data.value is not None:
            B = data.query.shape[0]
            value = (
                data.value[:B] if data.value.shape[0] != 1 else np.broadcast_to(data.value, (B, *data.value.shape[1:]))
            )
            data = dataclasses.replace(data, value=np.array(value))
        return super().forward(data, dtype)


def test_value_tokens_of_another_batch_are_bad_input():
    report = dcf.run_conformance(_ValueBatchLax(), cases=[], **ONLY)
    failed = {r.case.split(":")[0]: r.detail for r in report.failures()}
    assert set(failed) == {"value-batch", "value-batch-one"}, report.summary()
    assert all(d.startswith("bad input accepted") for d in failed.values()), failed
    # The reference refuses both, naming `value` and the shapes it received.
    cases = [c for c in dcf.ERROR_CATALOGUE if c.corruption in ("value-batch", "value-batch-one")]
    honest = dcf.run_conformance(dcf.ReferenceAdapter(), cases=[], errors=cases, **ONLY)
    assert [r.status for r in honest.results] == ["pass", "pass"], honest.summary()
    for result, batch in zip(honest.results, (3, 1)):
        assert "Invalid argument `value`: expected the batch size and length of `context`" in result.detail
        assert f"value.shape=({batch}, 7, 6)" in result.detail, result.detail


# ---------------------------------------------------------------- D2: NaN in a context token


class _ContextNanToZero(dcf.ReferenceAdapter):
    """Replaces NaN in the context (keys and values) by 0: quieter than the reference, a bug by
    spec section 9."""

    name = "nan-context-zero"

    def forward(self, data, dtype):
        if data.context is not None:
            data = dataclasses.replace(data, context=np.nan_to_num(data.context, nan=0.0))
        return super().forward(data, dtype)


def test_a_port_that_zeroes_nan_in_the_context_fails():
    # The catalogue's only NaN was in a query token: this port passed every case.
    report = dcf.run_conformance(_ContextNanToZero(), cases=dcf.catalogue(groups=["shapes"]), errors=False, **ONLY)
    [failure] = report.failures()
    assert failure.case == "heads-separate-gqa-nan-context-cross", report.summary()
    assert failure.detail.startswith(
        "80 finite values where the reference is NaN or inf (NaN in must give NaN out), in 5 query rows"
    ), failure.detail


def test_the_nan_context_token_makes_every_row_that_sees_it_nan_and_no_other():
    [case] = [c for c in dcf.CATALOGUE if c.inputs == "nan-context"]
    data = dcf.materialise(case)
    assert np.argwhere(np.isnan(data.context)).tolist() == [[0, 3, 2]]
    # Visible to every query of batch row 0 (no mask, not causal): a fused kernel has no "louder"
    # allowance here, so the exact non-finite check is what the spec asks for.
    assert case.mask is None and not case.causal and not case.gradients
    rows = ~np.isfinite(data.expected).all(-1)
    assert rows[0].all() and not rows[1].any() and np.isnan(data.expected[0]).all()


@pytest.mark.parametrize("where", [dict(context_len=None), dict(mask="padding"), dict(causal=True)])
def test_a_nan_context_case_must_be_cross_attention_seen_by_every_query(where):
    kw = dict(
        name="x", group="shapes", config=dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4), batch=2, query_len=3
    )
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `inputs`: expected inputs=\"nan-context\" in"):
        dcf.Case(**{**kw, "context_len": 4, **where}, inputs="nan-context")


# ---------------------------------------------------------------- D3: bad input in every dtype


class _LaxMaskFloat32(dcf.ReferenceAdapter):
    """Its float32 path skips the mask's validation and cuts the mask to (B|1, H|1, N|1, M)."""

    name = "lax-mask-float32"
    dtypes = ("float64", "float32")

    def forward(self, data, dtype):
        if dtype == "float32" and data.mask is not None:
            B, N = data.query.shape[-3], data.query.shape[-2]
            M = (data.query if data.context is None else data.context).shape[-2]
            cut = data.mask[:B, : data.config.num_heads, :N, :M]
            data = dataclasses.replace(data, mask=np.array(cut))
        return super().forward(data, dtype)


def test_bad_input_is_checked_in_every_dtype():
    report = dcf.run_conformance(_LaxMaskFloat32(), cases=[], **ONLY)
    n = len(dcf.ERROR_CATALOGUE)
    assert [r.dtype for r in report.results] == ["float64"] * n + ["float32"] * n
    failed = {(r.dtype, r.case.split(":")[0]) for r in report.failures()}
    assert failed == {("float32", k) for k in ("mask-keys", "mask-heads", "mask-queries", "mask-batch")}, failed
    # One id per dtype, as every other check's.
    from damcha_conformance.pytest_plugin import checks

    ids = {c.id for c in checks(("float64", "float32")) if c.kind == "errors"}
    assert len(ids) == 2 * n and "errors-float32-mask-keys:heads-tied-padding" in ids


def test_an_xfails_entry_of_the_first_dtype_only_ids_still_matches():
    from damcha_conformance import pytest_plugin

    check = dcf.Check("errors", dcf.ERROR_CATALOGUE[0], "float32")
    assert check.id == f"errors-float32-{dcf.ERROR_CATALOGUE[0].name}"
    assert f"errors-{dcf.ERROR_CATALOGUE[0].name}" in pytest_plugin._xfail_ids(check)


class _RefusesFloat32(dcf.ReferenceAdapter):
    name = "refuses-float32"
    dtypes = ("float64", "float32")

    def forward(self, data, dtype):
        if dtype == "float32":
            raise TypeError("float32 is not implemented yet")
        return super().forward(data, dtype)


class _ForwardOnlyRefusesFloat32(_RefusesFloat32):
    """Most third-party ports: no weights(), metric_penalty() or decode(), so their
    checks are "unsupported" in every dtype, the refused one too (which counted as
    a usable dtype: its 15 bad-input checks ran and failed)."""

    weights = None
    metric_penalty = None
    metric_penalty_gradients = None
    decode = None


@pytest.mark.parametrize(
    "adapter, flags",
    [(_RefusesFloat32, ONLY), (_ForwardOnlyRefusesFloat32, {})],
    ids=["forward-checks-only", "forward-only-port-default-run"],
)
def test_a_dtype_refused_outright_leaves_its_bad_input_unchecked_and_says_so(adapter, flags):
    report = dcf.run_conformance(adapter(), cases=[dcf.CATALOGUE[0]], **flags)
    assert {r.dtype for r in report.results if r.check == "rejects"} == {"float64"}
    assert report.verdict == "FAILED"  # its float32 output check errored
    assert (
        "refuses-float32",
        "errors in float32: the bad-input checks did not run, every other check in that dtype ended in an error or "
        "is unsupported",
    ) in report.gaps, report.gaps


# ---------------------------------------------------------------- D4: the decode prefill, unchecked


def test_conform_says_partial_when_the_prefill_went_unchecked(third_party):
    proc = conform("--adapter", "thirdparty:DecodedOnly", "--group", "decode", cwd=third_party, capture_output=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("PARTIAL: not conformant"), proc.stdout
    assert "not checked: decoded-only: decode prefill: 4 decode cases (float64) returned" in proc.stdout


# ---------------------------------------------------------------- D5: an adapter's own output


def test_what_an_adapter_prints_is_never_read_as_the_workers_progress(third_party):
    out = third_party / "r.json"
    proc = conform(
        "--adapter", "thirdparty:Chatty", "--group", "mha", "--no-gradients", "--no-progress", "--json", str(out),
        cwd=third_party, capture_output=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr  # was a traceback (ValueError: not enough values)
    assert "Traceback" not in proc.stderr and "@damcha-progress" not in proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASSED" and len(report["results"]) == len(dcf.catalogue(groups=["mha"]))


def test_a_malformed_progress_line_is_skipped():
    from damcha_conformance import _cli as ccli

    assert ccli._progress_line("@damcha-progress debugging heads-tied-self") is None
    assert ccli._progress_line('{"total": 2}') is None
    result = dcf.Result("b", "c", "g", "float64", "output", "pass", 0.0, 0.0)
    line = json.dumps({"done": 1, "total": 2, "what": "w", "result": result.to_dict()})
    assert ccli._progress_line(line) == (2, "w", result)


# ---------------------------------------------------------------- D6: a standard stream's file


@pytest.mark.parametrize("json_path", ["/dev/stdout", "log.txt"])
def test_json_into_the_file_standard_output_goes_to_is_refused(tmp_path, json_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as stdout:
        proc = conform(
            "--backend", "reference", "--group", "errors", "--json", json_path,
            cwd=tmp_path, stdout=stdout, stderr=subprocess.PIPE,
        )  # fmt: skip
    # Was exit 0 with the JSON renamed over log.txt: the table printed to it was lost.
    assert proc.returncode == 2 and log.read_text() == "", (proc.returncode, log.read_text()[:300])
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("damcha conform: error: --json: expected a file of its own"), line
    assert (
        f"it is the file of standard output (fd 1), whose output would be lost; write to another path. Received: '{json_path}'"
        in line
    )


def test_the_atomic_writers_and_damcha_export_refuse_a_standard_streams_file(tmp_path):
    err = tmp_path / "err.txt"
    code = (
        "from damcha_core import _cliutil as cu\n"
        "try:\n    cu.atomic_write_text('/proc/self/fd/2', 'x')\n"
        "except PermissionError as exc:\n    print(exc)\n"
    )
    with open(err, "w") as stderr:
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert "is the file of this process's standard error (fd 2); not replacing it" in proc.stdout, proc.stdout
    assert err.read_text() == ""
    # The export's --out goes through the same check (cu.check_output_file), before any work.
    params = tmp_path / "p.safetensors"
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    dc.save_params(params, dc.init_params(config, 0), config)
    out = tmp_path / "m.onnx"
    cmd = [sys.executable, "-m", "damcha_core._cli", "export", "--params", str(params), "--out", str(out)]
    with open(out, "w") as stdout:
        proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2 and out.read_text() == "", proc.stderr
    assert "damcha export: error: --out: expected a file of its own" in proc.stderr
    assert "standard output (fd 1)" in proc.stderr


# ---------------------------------------------------------------- D7: the adapter's own source


def test_json_onto_the_adapters_own_module_is_refused(third_party):
    source = third_party / "thirdparty.py"
    proc = conform(
        "--adapter", "thirdparty:Plain", "--group", "mha", "--no-gradients", "--json", "./thirdparty.py",
        cwd=third_party, capture_output=True,
    )  # fmt: skip
    assert proc.returncode == 2 and source.read_text() == THIRD_PARTY, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        f"damcha conform: error: --json: would overwrite {str(source)!r}, the source of the module 'thirdparty' "
        "(imported to run the adapters); expected a path other than a module's file. Received: --json './thirdparty.py'"
    )


# ---------------------------------------------------------------- the plugin's --collect-only count


def test_collect_only_counts_the_conformance_checks(tmp_path):
    from damcha_conformance.pytest_plugin import checks

    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["--damcha-adapter", "reference", "--collect-only", "-q", "-k", "errors"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    total, selected = len(checks(["float64"])), len(dcf.ERROR_CATALOGUE)
    assert "no tests collected" not in proc.stdout, proc.stdout[-500:]
    assert f"{selected}/{total} tests collected ({total - selected} deselected)" in proc.stdout, proc.stdout[-500:]
