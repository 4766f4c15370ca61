"""tests/_keras_processes.py's supervisor: a Keras process that dies still leaves
its results file, whole, saying how it died, so the items that read it fail with
that message instead of waiting for a file that never comes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_keras_process_that_dies_is_recorded_with_its_output(tmp_path: Path) -> None:
    out = tmp_path / "keras-process-nosuch.json"
    cmd = [
        sys.executable,
        str(TESTS / "_keras_processes.py"),
        "--supervise",
        "nosuch",
        str(out),
        str(tmp_path),
        "layer",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    crashed = json.loads(out.read_text())["crashed"]
    assert crashed.startswith("exit status 1\n"), crashed[:200]
    assert "Unable to import backend : nosuch" in crashed, crashed[-2000:]  # Keras's own error, from the child's stderr
    assert not out.with_suffix(".partial").exists()  # renamed into place, not left beside it
