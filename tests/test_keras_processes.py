"""tests/_keras_processes.py's supervisor of a Keras process started in the
background: a process that dies still leaves its results file, whole, saying how
it died, so the items that read it fail with that message instead of waiting for
a file that never comes; a test run that ends first takes the process with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def supervise(backend: str, out: Path, workdir: Path, run_pid: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TESTS / "_keras_processes.py"), "--supervise", backend]
    cmd += [str(out), str(workdir), str(run_pid), "layer"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_keras_process_that_dies_is_recorded_with_its_output(tmp_path: Path) -> None:
    out = tmp_path / "keras-process-nosuch.json"
    proc = supervise("nosuch", out, tmp_path, os.getpid())
    assert proc.returncode == 0, proc.stderr
    crashed = json.loads(out.read_text())["crashed"]
    assert crashed.startswith("exit status 1\n"), crashed[:200]
    assert "Unable to import backend : nosuch" in crashed, crashed[-2000:]  # Keras's own error, from its output
    assert not out.with_suffix(".partial").exists()  # renamed into place, not left beside it


@pytest.mark.skipif(sys.platform != "linux", reason="finds the Keras process by its command line in /proc")
def test_a_run_that_has_ended_takes_its_keras_process_with_it(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no process holds now: the test run that wanted the results
    out = tmp_path / "keras-process-torch.json"
    proc = supervise("torch", out, tmp_path, gone.pid)
    assert proc.returncode == 0, proc.stderr
    # Nothing written (a process run to its end writes its results): ended, no one being left to read it.
    assert not out.exists() and not out.with_suffix(".partial").exists()
    partial = str(out.with_suffix(".partial"))
    running = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if partial in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                running.append(pid)
        except OSError:
            pass
    assert not running, f"the Keras process outlived its supervisor: {running}"
