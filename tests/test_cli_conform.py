"""``damcha conform`` through the real entry point (a subprocess), one test per
item of the hardening issue: a run that checked nothing or skipped a group
does not pass, undeclared dtypes are stated once, bad arguments exit 2 with
one line naming the flag before any work, outputs are atomic, progress and
time per backend are shown."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import damcha_conformance as dcf

TESTS = Path(__file__).parent


def conform(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # the fixture adapters, as a third party's module
    return subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def one_line_usage_error(proc: subprocess.CompletedProcess, flag: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr that names ``flag``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"damcha conform: error: {flag}"), lines[0]
    return lines[0]


def test_an_adapter_that_declares_every_case_unsupported_fails():
    proc = conform("--adapter", "_conformance_fixtures:Lazy", "--no-progress")
    assert proc.returncode == 1, proc.stdout
    assert "PASSED" not in proc.stdout and proc.stdout.strip().endswith("FAILED")
    assert "FAIL lazy: nothing checked" in proc.stdout
    assert "not implemented yet" in proc.stdout  # the adapter's reason is said


def test_an_adapter_without_gradients_is_partial_unless_asked_for_outputs_only():
    proc = conform("--adapter", "_conformance_fixtures:NoGradients", "--no-progress")
    assert proc.returncode == 1, proc.stdout
    assert "PARTIAL" in proc.stdout and "PASSED" not in proc.stdout
    assert "not checked: no-gradients: gradients: the adapter declares none (supports_gradients=False)" in proc.stdout
    asked = conform("--adapter", "_conformance_fixtures:NoGradients", "--no-gradients", "--no-progress")
    assert asked.returncode == 0, asked.stdout
    assert "subset: no-gradients: no gradients" in asked.stdout and "PASSED" in asked.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--backend", "reference", "--dtype", "float16"], "--backend reference runs in float64 only"),
        (
            ["--backend", "reference", "--dtype", "bfloat16", "--dtype", "float16"],
            "--backend reference runs in float64",
        ),
        (
            ["--backend", "onnxruntime", "--dtype", "bfloat16"],
            "--backend onnxruntime runs in float32, float64, float16",
        ),
        (["--adapter", "_conformance_fixtures:WrongMask", "--dtype", "float32"], "--adapter _conformance_fixtures:Wr"),
        (
            ["--in-process", "--adapter", "_conformance_fixtures:Float16NoUpcast", "--dtype", "float64"],
            "--adapter _conformance_fixtures:Float16NoUpcast runs in float16 only",
        ),
    ],
    ids=["reference-float16", "reference-two-16-bit", "onnxruntime-bfloat16", "adapter", "adapter-in-process"],
)
def test_a_dtype_selection_that_leaves_a_backend_nothing_to_run_exits_2_before_any_work(args, says):
    # `--backend reference --dtype float16` used to run, check nothing and print FAILED (exit 1).
    line = one_line_usage_error(conform(*args, "--no-progress"), "--dtype")
    assert says in line and "(the dtypes its adapter declares), none of the dtypes asked for" in line, line
    assert line.endswith("Received: " + " ".join(a for a in args[args.index("--dtype") :])), line


def test_a_group_selection_the_backend_cannot_have_exits_2_before_any_work():
    # `--backend onnxruntime --group penalty` used to run, check nothing and print FAILED (exit 1).
    line = one_line_usage_error(conform("--backend", "onnxruntime", "--group", "penalty", "--no-progress"), "--group")
    assert "--backend onnxruntime cannot have the checks asked for (penalty: " in line, line
    assert line.endswith("Received: --group penalty"), line
    # A group it can have beside it runs, and the penalty is a stated gap, as before.
    proc = conform("--backend", "onnxruntime", "--group", "penalty", "--group", "mha", "--dtype", "float32")
    assert proc.returncode in (0, 1) and "error:" not in proc.stderr, proc.stderr
    assert "onnxruntime  float32" in proc.stdout, proc.stdout[-800:]


def test_a_port_without_weights_or_penalty_narrows_them_by_flag_instead_of_a_gap():
    """An adapter written before the weights and penalty groups: PARTIAL (exit 1) by default, since
    those checks did not run; --no-weights --no-penalty (like --no-gradients) narrow the run on
    purpose and it passes, saying so."""
    args = ("--adapter", "_conformance_fixtures:OutputsOnly", "--no-progress", "--group", "mha", "--group", "decode")
    gaps = conform(*args, "--group", "weights", "--group", "penalty", "--no-gradients")
    assert gaps.returncode == 1 and gaps.stdout.strip().splitlines()[-1].startswith("PARTIAL"), gaps.stdout[-600:]
    narrowed = conform(*args, "--no-gradients", "--no-weights", "--no-penalty")
    last = narrowed.stdout.strip().splitlines()[-1]
    assert narrowed.returncode == 0 and last.startswith("PASSED on what was asked for, narrowed: "), narrowed.stdout
    assert "no attention weights" in last + narrowed.stdout and "no metric penalty" in narrowed.stdout, narrowed.stdout
    # Asking for a group and leaving it out is a contradiction, refused before any work.
    line = one_line_usage_error(conform(*args, "--group", "weights", "--no-weights"), "--no-weights")
    assert "leaves out the 'weights' group, which --group asks for" in line, line


def test_a_dtype_the_adapter_does_not_declare_beside_one_it_does_is_stated_once_never_computed():
    proc = conform("--backend", "reference", "--dtype", "bfloat16", "--dtype", "float64", "--group", "mha")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reference  bfloat16" not in proc.stdout and "reference  float64" in proc.stdout  # no row of it
    assert proc.stdout.count("not checked: reference: dtype bfloat16: not among the adapter's dtypes (float64)") == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("PARTIAL: ")  # float64 ran; bfloat16 was asked for


def test_a_dtype_torch_does_not_declare_is_no_key_error():
    proc = conform("--backend", "torch", "--dtype", "float16", "--dtype", "float32", "--group", "mha", "--no-progress")
    assert "KeyError" not in proc.stdout + proc.stderr
    assert "dtype float16: not among the adapter's dtypes (float64, float32, bfloat16)" in proc.stdout
    assert "PARTIAL" in proc.stdout and proc.returncode == 1  # float32 ran and passed; float16 was asked for
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PARTIAL: not conformant, not everything asked for was checked: ") and "float16" in last, (
        last
    )


def test_an_explicit_subset_that_passes_exits_0_and_says_so():
    proc = conform("--backend", "reference", "--case", "heads-tied-self", "--no-progress")
    assert proc.returncode == 0, proc.stdout
    assert f"subset: reference: 1 of {len(dcf.CATALOGUE)} catalogue cases" in proc.stdout
    # The last line stands on its own: what the run left out, not "see above".
    assert (
        proc.stdout.strip()
        .splitlines()[-1]
        .startswith(f"PASSED on what was asked for, narrowed: reference: 1 of {len(dcf.CATALOGUE)} catalogue cases")
    ), proc.stdout[-500:]


def test_json_into_a_missing_folder_is_refused_before_any_work(tmp_path):
    line = one_line_usage_error(conform("--json", str(tmp_path / "nonexistent" / "r.json")), "--json")
    assert "does not exist" in line


def test_unknown_case_backend_and_group_are_one_line_errors():
    line = one_line_usage_error(conform("--case", "nosuch"), "--case")
    first = sorted(c.name for c in dcf.CATALOGUE)[0]
    assert "unknown case 'nosuch'" in line and f"e.g. {first}, " in line and "{" not in line, line
    assert "damcha conform --list-cases lists them" in line
    assert "invalid choice: 'nosuch'" in one_line_usage_error(conform("--backend", "nosuch"), "--backend")
    assert "invalid choice: 'nosuch'" in one_line_usage_error(conform("--group", "nosuch"), "--group")
    assert "invalid choice: 'float8'" in one_line_usage_error(conform("--dtype", "float8"), "--dtype")


@pytest.mark.parametrize(
    "spec, says",
    [
        ("nosuchmodule:X", "module 'nosuchmodule' cannot be found"),
        ("_conformance_fixtures:Nope", "has no attribute 'Nope'"),
        ("_conformance_fixtures", "expected module:attr"),
    ],
)
def test_bad_adapter_specs_are_one_line_errors(spec, says):
    assert says in one_line_usage_error(conform("--adapter", spec), "--adapter")


@pytest.mark.parametrize(
    "spec, says",
    [
        ("json:JSONDecoder", "class json.decoder.JSONDecoder has no method unsupported or forward"),
        ("_conformance_fixtures:NoUnsupported", "has no method unsupported ("),
        ("_conformance_fixtures:DtypesString", "its dtypes is one string 'float64'"),
        ("_conformance_fixtures:no_unsupported_instance", "adapter lacks unsupported"),
        ("_conformance_fixtures:needs_an_argument", "calling _conformance_fixtures.needs_an_argument() with no"),
        ("json:decoder", "adapter lacks name"),
    ],
)
def test_an_importable_object_that_is_not_an_adapter_exits_2_before_any_work(spec, says):
    # Used to start a worker and end in FAILED (exit 1): a bad argument, like a missing attribute.
    line = one_line_usage_error(conform("--adapter", spec), "--adapter")
    assert f"{spec} is not a conformance adapter: " in line and says in line, line


def test_export_vectors_into_an_unwritable_folder_is_refused(tmp_path):
    if os.geteuid() == 0:
        locked = Path("/proc")  # root ignores permission bits; /proc refuses new files
    else:
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o555)
    line = one_line_usage_error(conform("--export-vectors", str(locked / "vectors")), "--export-vectors")
    assert "not writable" in line


def test_export_vectors_failing_part_way_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "vectors"
    out.mkdir()
    (out / "index.json").write_text("earlier good index")
    # The real entry point, with the safetensors writer failing on the third case.
    code = (
        "import sys, safetensors.numpy as st\n"
        "from damcha_core._cli import main\n"
        "real, calls = st.save_file, []\n"
        "def flaky(*a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3: raise OSError(28, 'No space left on device')\n"
        "    return real(*a, **k)\n"
        "st.save_file = flaky\n"
        f"sys.exit(main(['conform', '--export-vectors', {str(out)!r}, '--group', 'heads']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "No space left on device" in one_line_usage_error(proc, "--export-vectors")
    assert [p.name for p in out.iterdir()] == ["index.json"] and (
        out / "index.json"
    ).read_text() == "earlier good index"
    assert [p.name for p in tmp_path.iterdir()] == ["vectors"]  # no temporary folder left behind
    ok = conform("--export-vectors", str(out), "--group", "heads")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((out / "index.json").read_text())["cases"] == [c.name for c in dcf.catalogue(groups=["heads"])]


def test_a_narrower_export_removes_the_earlier_exports_other_cases(tmp_path):
    """A second --export-vectors with --case left all of the first export's files beside an index
    listing one case: a runner that globs the folder read stale vectors. Files the earlier index
    did not list (the user's own) stay."""
    out = tmp_path / "vectors"
    first = conform("--export-vectors", str(out), "--group", "heads")
    assert first.returncode == 0, first.stderr
    (out / "notes.txt").write_text("mine")
    case = dcf.catalogue(groups=["heads"])[0].name
    second = conform("--export-vectors", str(out), "--case", case)
    assert second.returncode == 0, second.stderr
    assert json.loads((out / "index.json").read_text())["cases"] == [case]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["index.json", "notes.txt", f"{case}.json", f"{case}.safetensors"]
    )


def test_export_vectors_refuses_in_process(tmp_path):
    for flag in ("--in-process", "--no-weights", "--no-penalty"):
        line = one_line_usage_error(conform("--export-vectors", str(tmp_path / "v"), flag), "--export-vectors")
        assert "(not --backend, --adapter, --dtype, --no-gradients, --no-weights, --no-penalty, --json or" in line
        assert not (tmp_path / "v").exists()


def test_an_interrupted_run_keeps_the_earlier_json_report(tmp_path):
    out = tmp_path / "report.json"
    out.write_text('{"earlier": "good"}')
    proc = conform(
        "--in-process", "--adapter", "_conformance_fixtures:Interrupted", "--json", str(out), "--no-progress"
    )
    # One line, exit 130 (damcha_core._cli), not a KeyboardInterrupt traceback.
    assert proc.returncode == 130 and proc.stderr.strip().splitlines() == ["damcha conform: interrupted"], proc.stderr
    assert out.read_text() == '{"earlier": "good"}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no partial or temporary file


def test_a_read_only_json_report_is_refused_not_replaced(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("keep")
    out.chmod(0o444)
    assert "read-only" in one_line_usage_error(conform("--backend", "reference", "--json", str(out)), "--json")
    assert out.read_text() == "keep"


def test_progress_per_backend_and_check_and_time_per_backend(tmp_path):
    out = tmp_path / "r.json"
    proc = conform("--backend", "reference", "--group", "masks", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("reference [")]
    n_checks = len(dcf.catalogue(groups=["masks"]))
    assert progress[0].startswith(f"reference [1/{n_checks}] float64 ") and "[output] pass" in progress[0]
    assert progress[-1].startswith(f"reference [{n_checks}/{n_checks}] ")  # not a TTY: plain lines
    assert any(
        line.startswith(f"reference: {n_checks} checks in ") and line.endswith(" s: PASSED")
        for line in proc.stderr.splitlines()
    )
    assert "time per backend: reference " in proc.stdout
    report = dcf.Report.from_json(out.read_text())
    assert report.verdict == "PASSED" and len(report.results) == n_checks


def test_in_process_with_two_backends_is_a_usage_error():
    one_line_usage_error(conform("--in-process", "--backend", "reference", "--backend", "torch"), "--in-process")


def test_a_terminal_gets_a_progress_bar(tmp_path):
    """stderr on a terminal (a pseudo-terminal here): tqdm's bar (damcha[reports]) instead of plain lines."""
    import pty

    import tqdm  # noqa: F401 - the bar needs it; a missing reports extra must fail here, not skip

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "damcha_core._cli", "conform", "--backend", "reference", "--group", "masks"],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
        )
        os.close(slave)
        stdout, _ = proc.communicate(timeout=300)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, stdout
    assert "\r" in terminal and "%|" in terminal and "reference" in terminal  # a redrawn bar
    assert "reference [1/" not in terminal  # not the plain lines
    masks = len(dcf.catalogue(groups=["masks"]))  # the reference checks outputs only: one check per case
    assert f"reference: {masks} checks in " in terminal and "PASSED" in stdout


@pytest.mark.parametrize(
    "spec, says",
    [
        ("_conformance_fixtures:make_raises", "() with no arguments raised RuntimeError: no such device: cuda:7"),
        ("os:getcwd", "calling os.getcwd() returned str: adapter lacks name"),
        ("_conformance_fixtures:make_dtypes_string", "`adapter.dtypes`: expected a sequence of dtype names"),
        ("_conformance_fixtures:make_no_unsupported", "adapter lacks unsupported"),
        ("_conformance_fixtures:UnknownDtype", "`adapter.dtypes`: expected a non-empty sequence of dtype names"),
        ("_conformance_fixtures:GradientsWithoutMethod", "`adapter.gradients`: expected a method gradients(data"),
    ],
)
@pytest.mark.parametrize("in_process", [False, True])
def test_a_factory_that_raises_or_builds_no_adapter_is_a_usage_error(spec, says, in_process):
    # Nothing can be checked: it used to start the run and end in FAILED (exit 1), like a failed port.
    args = ("--in-process",) if in_process else ()
    proc = conform(*args, "--adapter", spec, "--case", dcf.CATALOGUE[0].name, "--no-progress")
    line = one_line_usage_error(proc, "--adapter")
    assert f"spec={spec!r}" in line and says in line, line
    assert "expected module:attr naming a conformance adapter (" in line, line
    assert "Traceback" not in proc.stderr


def test_a_factory_that_exits_silently_is_said_so():
    """The message ended in ": " (the process's empty stderr)."""
    proc = conform("--adapter", "_conformance_fixtures:make_exits", "--no-progress")
    line = one_line_usage_error(proc, "--adapter")
    assert "ended its process with exit 3: it printed nothing (sys.exit() or a signal?)" in line, line


def test_a_bad_factory_stops_the_run_before_any_backend(tmp_path):
    out = tmp_path / "r.json"
    proc = conform("--backend", "reference", "--adapter", "os:getcwd", "--json", str(out), "--no-progress")
    assert "returned str: adapter lacks name" in one_line_usage_error(proc, "--adapter")
    assert not out.exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--backend", "reference", "--adapter", "_conformance_fixtures:Unnamed"],
            "_conformance_fixtures:Unnamed reports as 'reference', as --backend reference does",
        ),
        (
            ["--adapter", "_conformance_fixtures:WrongMask", "--adapter", "_conformance_fixtures:SameNameAsWrongMask"],
            "_conformance_fixtures:SameNameAsWrongMask reports as 'wrong-mask', as _conformance_fixtures:WrongMask does",
        ),
    ],
)
def test_two_adapters_with_one_name_are_refused_before_any_work(args, says):
    # The table and the JSON key results by the adapter's name: the two runs used to be merged into one row.
    line = one_line_usage_error(conform(*args, "--no-progress"), "--adapter")
    assert says in line and "a name of its own" in line, line


def test_an_adapter_name_that_is_not_a_string_is_refused():
    line = one_line_usage_error(conform("--adapter", "_conformance_fixtures:NameNotAString"), "--adapter")
    assert "`adapter.name`: expected a non-empty string" in line and "Received: adapter.name=None" in line, line


@pytest.mark.parametrize(
    "spec, says",
    [
        (
            "DtypesTwice",
            "`adapter.dtypes`: expected each dtype name once. Received: adapter.dtypes=('float64', 'float64')",
        ),
        ("BlankName", "`adapter.name`: expected a non-empty string, e.g. 'my-port'. Received: adapter.name='"),
        (
            "SupportsGradientsString",
            "`adapter.supports_gradients`: expected a bool. Received: adapter.supports_gradients='no'",
        ),
    ],
)
def test_malformed_adapter_attributes_exit_2_before_any_work(spec, says):
    # Each ran before: every check twice, a blank table column, gradient checks that errored.
    line = one_line_usage_error(conform("--adapter", f"_conformance_fixtures:{spec}"), "--adapter")
    assert says in line, line


def test_a_worker_that_dies_keeps_its_results_and_says_where_it_died(tmp_path):
    # Read "worker exited -6: " with nothing after it, 0 checks, and the JSON held no result.
    out = tmp_path / "r.json"
    proc = conform(
        "--adapter", "_conformance_fixtures:CrashesOnCross", "--group", "mha", "--no-progress", "--json", str(out)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    kept = [r for r in report["results"] if r["status"] == "pass"]
    assert kept and all(r["case"].endswith("-self") for r in kept), report["results"]
    assert report["verdict"] == "FAILED"
    last = kept[-1]
    said = (
        "FAIL _conformance_fixtures:CrashesOnCross: the worker ended without its report (signal SIGABRT) "
        f"after {len(kept)} of "
    )
    assert said in proc.stdout, proc.stdout
    assert (
        f"in the check after {last['dtype']} {last['case']} [{last['check']}] (its results so far are kept)"
        in proc.stdout
    )


def test_case_and_group_that_select_nothing_exit_2_before_any_work():
    case = dcf.CATALOGUE[0]
    other = next(g for g in dcf.GROUPS if g != case.group)
    line = one_line_usage_error(conform("--case", case.name, "--group", other), "--group")
    assert f"{case.name} is in group {case.group!r}" in line


def _sleeping_workers(monkeypatch) -> list:
    """conform's backend workers replaced by one that reports one check and would then run
    for ten minutes; returns the list of the processes started."""
    from damcha_conformance import _cli as ccli

    started = []
    real_popen = subprocess.Popen

    def worker(cmd, **kw):
        channel = cmd[cmd.index("--progress-file") + 1]
        line = json.dumps({"done": 1, "total": 2, "what": "float64 case [output] pass", "result": None})
        code = f"open({channel!r}, 'a').write({line!r} + '\\n'); import time; time.sleep(600)"
        proc = real_popen([sys.executable, "-c", code], **kw)
        started.append(proc)
        return proc

    monkeypatch.setattr(ccli.subprocess, "Popen", worker)
    return started


def test_sigterm_to_the_parent_terminates_its_backend_worker_and_exits_143(monkeypatch, capsys):
    """SIGTERM delivered to the parent alone (kill PID) ended it at once and left the worker
    running; now it goes through the same cleanup as Ctrl-C: worker terminated and reaped, exit 143."""
    import signal

    from damcha_conformance import _cli as ccli
    from damcha_core import _cli as dcli
    from damcha_core import _cliutil as cu

    started = _sleeping_workers(monkeypatch)

    class TerminatedProgress(cu.Progress):
        def step(self, what, *, force=False):  # SIGTERM arrives while the parent shows progress
            signal.raise_signal(signal.SIGTERM)

    def not_handled(signum, frame):
        # What the test process does when the command installs no handler: stop the run (exit 130, not
        # 143) instead of dying with the default action or sleeping on with the worker.
        raise KeyboardInterrupt

    original = signal.signal(signal.SIGTERM, not_handled)
    try:
        monkeypatch.setattr(ccli.cu, "Progress", TerminatedProgress)
        status = dcli.main(["conform", "--backend", "reference", "--no-progress"])
        assert signal.getsignal(signal.SIGTERM) is not_handled  # the command's handler lasts for the run only
    finally:
        signal.signal(signal.SIGTERM, original)
    assert status == 143
    assert len(started) == 1 and started[0].poll() is not None  # terminated and reaped, not left running
    assert capsys.readouterr().err.strip().splitlines()[-1] == "damcha conform: terminated"


def test_sigterm_while_an_adapter_is_built_terminates_the_probe_and_exits_143(tmp_path):
    """The probe that builds a third party's adapter ran before the SIGTERM handler was set: SIGTERM
    ended the command at once and left a constructor that hangs running."""
    import signal
    import time

    pid_file = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "DAMCHA_TEST_PID_FILE": str(pid_file)}
    cmd = [sys.executable, "-m", "damcha_core._cli", "conform", "--adapter", "_conformance_fixtures:make_slowly"]
    parent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        probe = int(pid_file.read_text())
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=30)
        assert parent.returncode == 143, (parent.returncode, err)
        assert err.strip().splitlines()[-1] == "damcha conform: terminated"
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
            os.kill(probe, 0)
    finally:
        parent.kill()
        if probe is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(probe, signal.SIGKILL)


def test_an_interrupted_parent_terminates_its_backend_worker(monkeypatch):
    """Ctrl-C delivered to the parent alone (kill -INT PID) left the worker process running."""
    import argparse

    from damcha_conformance import _cli as ccli
    from damcha_core import _cliutil as cu

    started = _sleeping_workers(monkeypatch)

    class InterruptedProgress(cu.Progress):
        def step(self, what, *, force=False):  # the Ctrl-C arrives while the parent shows progress
            raise KeyboardInterrupt

    monkeypatch.setattr(ccli.cu, "Progress", InterruptedProgress)
    args = argparse.Namespace(no_progress=True, case=[], group=[], dtype=[], no_gradients=False)
    monkeypatch.setattr(ccli, "_filters", lambda args: [])
    with pytest.raises(KeyboardInterrupt):
        ccli._run_subprocess("reference", args, {})
    assert len(started) == 1 and started[0].poll() is not None  # terminated and reaped, not left running


def test_json_report_with_a_long_valid_name_is_written(tmp_path):
    """A 250-byte --json name passed the checks, the backends ran, and the report then failed
    to be written (its temporary name was over the 255-byte limit): exit 2 after the work."""
    out = tmp_path / ("r" * 245 + ".json")
    proc = conform("--backend", "reference", "--case", "heads-tied-self", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_json_name_too_long_is_refused_before_any_work(tmp_path):
    line = one_line_usage_error(conform("--json", str(tmp_path / ("r" * 300 + ".json"))), "--json")
    assert "is not a usable path (File name too long)" in line


@pytest.mark.parametrize(
    "absent, says",
    [
        (("jax", "flax"), "jax needs jax, flax, which are not installed"),
        (("flax",), "jax needs flax, which is not installed"),
    ],
    ids=["two-missing", "one-missing"],
)
def test_a_backend_whose_modules_are_missing_names_them_in_one_sentence(monkeypatch, capsys, absent, says):
    from damcha_conformance import _cli as conform_cli
    from damcha_conformance.adapters import Builtin

    monkeypatch.setattr(Builtin, "missing", lambda self: [m for m in self.requires if m in absent])
    assert conform_cli.main(["--backend", "jax"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"damcha conform: error: --backend: {says}: "), line
    assert 'pip install "damcha[jax]"' in line, line


def test_a_port_with_wrong_attention_weights_fails_the_weights_group():
    proc = conform("--adapter", "_conformance_fixtures:AveragedWeights", "--group", "weights", "--no-progress")
    assert proc.returncode == 1 and proc.stdout.strip().endswith("FAILED"), proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("averaged-weights"))
    # passed/run: only the empty-shape cases (no row to average) pass
    assert f"FAIL 2/{len(dcf.WEIGHTS_CASES)}" in row, row
    assert "FAIL averaged-weights/float64 heads-tied-self [weights]" in proc.stdout


def test_onnxruntime_states_why_it_has_no_metric_penalty():
    proc = conform("--backend", "onnxruntime", "--group", "weights", "--dtype", "float32", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("onnxruntime"))
    assert f"{len(dcf.WEIGHTS_CASES)}/{len(dcf.WEIGHTS_CASES)}" in row, row
    assert "subset: onnxruntime: no metric penalty: exported ONNX inference graphs compute no training loss" in (
        proc.stdout
    )


def _listed(text: str) -> dict[str, list[str]]:
    """--list-cases's output as group -> the case names listed under it."""
    blocks = text.strip().split("\n\n")
    assert blocks[0].startswith(f"{len(dcf.CATALOGUE)} catalogue cases in "), blocks[0]
    out = {}
    for block in blocks[1:]:
        title, *rows = block.splitlines()
        group = title.split(" (", 1)[0]
        assert title.startswith(f"{group} ({len(rows)}") and group not in out, title
        out[group] = [row.split()[0] for row in rows]
    return out


def test_list_cases_lists_every_case_by_group_and_runs_nothing():
    """Every name --case accepts, under the group --group selects it by, and each special
    group's cases (decoding, bad inputs, the weights and penalty picks), read from the
    catalogue itself; every line describes its case."""
    from damcha_conformance._cases import PENALTY_CASES, WEIGHTS_CASES

    proc = conform("--list-cases")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    listed = _listed(proc.stdout)
    assert list(listed) == list(dcf.GROUPS)
    for group in dict.fromkeys(c.group for c in dcf.CATALOGUE):
        assert listed[group] == [c.name for c in dcf.CATALOGUE if c.group == group], group
    assert listed["decode"] == [c.name for c in dcf.DECODE_CATALOGUE]
    assert listed["errors"] == [c.name for c in dcf.ERROR_CATALOGUE]
    assert listed["weights"] == [c.name for c in WEIGHTS_CASES]
    assert listed["penalty"] == [c.name for c in PENALTY_CASES]
    # Each case's first line: its catalogue group's (the weights and penalty blocks name it again).
    lines: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("  "):
            lines.setdefault(line.split()[0], line)
    cross = next(c for c in dcf.CATALOGUE if c.context_len is not None and c.mask is None and not c.causal)
    assert f"B={cross.batch} N={cross.query_len}, cross-attention M={cross.context_len}" in lines[cross.name]
    causal = next(c for c in dcf.CATALOGUE if c.causal)
    assert "causal" in lines[causal.name] and f"metric {causal.config.metric}" in lines[causal.name]


def test_list_cases_is_narrowed_by_case_and_group():
    masks = _listed(conform("--list-cases", "--group", "masks", "--group", "decode", "--group", "masks").stdout)
    assert list(masks) == ["masks", "decode"]
    assert masks["masks"] == [c.name for c in dcf.CATALOGUE if c.group == "masks"]
    # A run given --case checks those catalogue cases only: no decoding, weights or error group.
    first, last = dcf.CATALOGUE[0], dcf.CATALOGUE[-1]
    named = _listed(conform("--list-cases", "--case", last.name, "--case", first.name).stdout)
    assert named == {first.group: [first.name], last.group: [last.name]} or named == {
        first.group: [first.name, last.name]
    }


def test_list_cases_refuses_the_options_of_a_run(tmp_path):
    for args in (["--backend", "reference"], ["--json", str(tmp_path / "r.json")], ["--no-gradients"]):
        line = one_line_usage_error(conform("--list-cases", *args), "--list-cases")
        assert f"Received: {args[0]}" in line and "it takes only --case and --group" in line
    assert not (tmp_path / "r.json").exists()
