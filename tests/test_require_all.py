"""tests/_require_all.py: a skip for a missing dependency fails when every dependency is required."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import importlib.util
import pytest

def test_importorskip():
    pytest.importorskip("no_such_module_xyz")

@pytest.mark.skipif(importlib.util.find_spec("no_such_module_xyz") is None, reason="no_such_module_xyz not installed")
def test_skipif_find_spec():
    pass

def test_other_skip():
    pytest.skip("Flash attention is not supported on tensorflow")
"""


def _run(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "DAMCHA_REQUIRE_ALL_BACKENDS"}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    if require is not None:
        env["DAMCHA_REQUIRE_ALL_BACKENDS"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "_require_all", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("require", ["1", None], ids=["required", "not-required"])
def test_a_skip_for_a_missing_dependency_fails_only_when_every_dependency_is_required(tmp_path, require):
    proc = _run(tmp_path, require)
    summary = proc.stdout.strip().splitlines()[-1]
    if require == "1":
        # A skipif acts in setup, where pytest calls a failure an error.
        assert proc.returncode == 1 and "1 failed, 1 skipped, 1 error" in summary, proc.stdout[-2000:]
        assert "FAILED test_probe.py::test_importorskip" in proc.stdout
        assert "ERROR test_probe.py::test_skipif_find_spec" in proc.stdout
        assert "SKIPPED [1] test_probe.py:13: Flash attention is not supported" in proc.stdout
    else:
        assert proc.returncode == 0 and "3 skipped" in summary, proc.stdout[-2000:]
