"""The pytest plugin, run as a third party runs it: ``pytest -p
damcha_conformance.pytest_plugin --damcha-adapter module:Class`` in a folder of
their own (a subprocess), with -k selection, an expected-failures file,
XPASS reporting, xdist, and a run that checks nothing failing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import damcha_conformance as dcf

TESTS = Path(__file__).parent


def run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # the fixture adapters stand in for a third party's module
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "damcha_conformance.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-v",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )


def outcomes(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """check id -> PASSED/FAILED/SKIPPED/XFAIL/XPASS from the verbose (-v) lines."""
    found = re.findall(r"^damcha-conformance::(\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS)", proc.stdout, re.M)
    return dict(found)


def test_each_check_is_a_test_and_k_selects(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "reference", "-k", "forward and masks")
    assert proc.returncode == 0, proc.stdout[-3000:]
    expected = {f"forward-float64-{c.name}" for c in dcf.catalogue(groups=["masks"])}
    assert outcomes(proc) == dict.fromkeys(expected, "PASSED")
    collected = run_pytest(tmp_path, "--damcha-adapter", "reference", "--collect-only", "-qq")  # -v -qq: ids
    # Listing the ids checks nothing by design: exit 0 (it exited 1, "FAILED: nothing checked").
    assert collected.returncode == 0 and "FAILED" not in collected.stdout, collected.stdout[-2000:]
    ids = {line.split("::", 1)[1] for line in collected.stdout.splitlines() if line.startswith("damcha-conformance::")}
    in_float64 = [c for c in dcf.CATALOGUE if c.runs_in("float64")]  # not the float16-only cases
    outputs = 2 * len(in_float64) - sum(not c.gradients for c in in_float64)
    penalty = 2 * len(dcf.PENALTY_CASES) - sum(not c.gradients for c in dcf.PENALTY_CASES)  # values, gradients
    others = len(dcf.DECODE_CATALOGUE) + len(dcf.ERROR_CATALOGUE) + len(dcf.WEIGHTS_CASES)
    assert len(ids) == outputs + penalty + others
    assert "errors-float64-context-empty:heads-separate-cross" in ids and "decode-float64-decode-heads-tied" in ids
    assert "weights-float64-heads-tied-all-masked-row" in ids and "penalty-gradients-float64-heads-tied-self" in ids
    # The weights and penalty checks are groups of their own: -k weights selects them alone.
    weights = run_pytest(tmp_path, "--damcha-adapter", "reference", "-k", "weights")
    assert outcomes(weights) == {f"weights-float64-{c.name}": "PASSED" for c in dcf.WEIGHTS_CASES}, weights.stdout


def test_a_wrong_port_fails_with_the_runners_detail(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "_conformance_fixtures:WrongMask", "-k", "forward and padding")
    assert proc.returncode == 1
    assert set(outcomes(proc).values()) == {"FAILED"}
    assert "FAIL wrong-mask/float64 heads-tied-padding [output]" in proc.stdout
    assert "not conformant: wrong-mask" in proc.stdout  # the summary section


def test_expected_failures_file_reports_xfail_and_xpass(tmp_path):
    xfails = tmp_path / "damcha-xfails.txt"
    xfails.write_text(
        "# known failures of the wrong-mask port\n"
        "forward-float64-heads-tied-padding  # reads the mask inverted\n"
        "damcha-conformance::forward-float64-heads-separate-per-*-cross  # the full id's form, as a pattern\n"
        "forward-float64-lowrank-query-gqa-padding\n"
        "forward-float64-heads-tied-all-masked-row\n"
        "forward-float64-*-mask-*  # the size-1-axis masks of session 30\n"
        "forward-float64-heads-query-gqa-per-head\n"
        "forward-float64-heads-separate-gqa-all-masked-row-cross\n"
        "forward-float64-heads-tied-self  # listed, but it passes: XPASS\n"
        "forward-float64-no-such-case\n"
    )
    proc = run_pytest(
        tmp_path,
        "--damcha-adapter",
        "_conformance_fixtures:WrongMask",
        "--damcha-xfails",
        str(xfails),
        "-k",
        "forward and (masks or heads-tied-self)",
        "-W",
        "default",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    got = outcomes(proc)
    assert got["forward-float64-heads-tied-padding"] == "XFAIL"
    # A pattern with the prefix --collect-only prints matched nothing (only the short id was matched).
    assert got["forward-float64-heads-separate-per-head-cross"] == "XFAIL"
    assert got["forward-float64-heads-tied-self"] == "XPASS"
    assert "reads the mask inverted" in proc.stdout
    assert "XPASS: 1 checks listed in --damcha-xfails now pass" in proc.stdout
    assert "match no check: forward-float64-no-such-case" in proc.stdout


def test_a_run_that_checks_nothing_fails(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "_conformance_fixtures:Lazy", "-k", "forward and mha")
    assert proc.returncode == 1
    assert set(outcomes(proc).values()) == {"SKIPPED"} and "not implemented yet" in proc.stdout
    assert "FAILED: nothing checked on lazy" in proc.stdout


def test_gradients_of_an_adapter_without_them_are_skipped_and_said(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "_conformance_fixtures:NoGradients", "-k", "mha-none-self")
    assert proc.returncode == 0
    assert outcomes(proc) == {
        "forward-float64-mha-none-self": "PASSED",
        "gradients-float64-mha-none-self": "SKIPPED",
        "penalty-float64-mha-none-self": "PASSED",
        "penalty-gradients-float64-mha-none-self": "SKIPPED",
    }
    assert "no gradients (supports_gradients=False)" in proc.stdout
    # ... said once, not counted as unsupported cases in the table (it showed "(1 unsup)").
    assert "unsup)" not in proc.stdout.split("damcha conformance")[-1] and "checks unsupported" not in proc.stdout


def test_under_xdist_the_controller_gathers_the_results(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "reference", "-k", "decode", "-n", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"reference\s+float64\s+4/4", proc.stdout), proc.stdout[-3000:]


def test_bad_options_are_usage_errors(tmp_path):
    proc = run_pytest(tmp_path, "--damcha-adapter", "nosuchmodule:X")
    assert proc.returncode == 4 and "--damcha-adapter" in proc.stderr and "not importable" in proc.stderr
    assert "is it on PYTHONPATH?" in proc.stderr  # as damcha conform says
    proc = run_pytest(tmp_path, "--damcha-adapter", "reference", "--damcha-dtype", "bfloat16")
    assert proc.returncode == 4 and "bfloat16 not among the adapter's dtypes (float64)" in proc.stderr
    proc = run_pytest(tmp_path, "--damcha-xfails", "x.txt")
    assert proc.returncode == 4 and "--damcha-xfails needs --damcha-adapter" in proc.stderr


def test_a_factory_that_raises_or_builds_no_adapter_is_a_usage_error(tmp_path):
    # Used to end in INTERNALERROR with a traceback from pytest_configure (exit 3).
    for spec, says in [
        ("_conformance_fixtures:make_raises", "() with no arguments raised RuntimeError: no such device: cuda:7"),
        ("os:getcwd", "calling os.getcwd() returned str: adapter lacks name"),
        ("_conformance_fixtures:make_no_unsupported", "adapter lacks unsupported"),
        ("_conformance_fixtures_broken:Port", "importing it raised RuntimeError: this port needs CUDA 13"),
    ]:
        proc = run_pytest(tmp_path, "--damcha-adapter", spec)
        assert proc.returncode == 4, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "INTERNALERROR" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
        [line] = [x for x in proc.stderr.splitlines() if x.startswith("ERROR: --damcha-adapter: ")]
        assert f"spec={spec!r}" in line and says in line, line


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="pytest11") if e.value == "damcha_conformance.pytest_plugin"]
    assert ep.name == "damcha_conformance.pytest_plugin"  # the name -p uses: loading both ways is one plugin


def test_no_weights_and_no_penalty_leave_those_checks_out(tmp_path):
    """An adapter written before the weights and penalty groups (no weights(), no metric_penalty())
    can leave them out on purpose, as --damcha-no-gradients does for gradients."""

    def ids(*flags: str) -> set[str]:
        proc = run_pytest(
            tmp_path, "--damcha-adapter", "_conformance_fixtures:OutputsOnly", *flags, "--collect-only", "-qq"
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return {line.split("::", 1)[1] for line in proc.stdout.splitlines() if line.startswith("damcha-conformance::")}

    every, narrowed = ids(), ids("--damcha-no-weights", "--damcha-no-penalty")
    left_out = every - narrowed
    assert left_out and all(i.startswith(("weights-", "penalty-")) for i in left_out), sorted(left_out)[:5]
    assert not any(i.startswith(("weights-", "penalty-")) for i in narrowed)
    # Gradient checks are collected (and skipped for an adapter without gradients), so they go too.
    penalty = len(dcf.PENALTY_CASES) + sum(c.gradients for c in dcf.PENALTY_CASES)
    assert len(left_out) == len(dcf.WEIGHTS_CASES) + penalty
