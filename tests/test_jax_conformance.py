"""The whole conformance catalogue on damcha_jax: outputs and gradients.

float32 and bfloat16 run in-process; float64 needs JAX's x64 mode, which is
process-wide, so it runs in a subprocess with JAX_ENABLE_X64=1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from damcha_conformance import CATALOGUE, run_conformance
from damcha_conformance.adapters import JaxAdapter

_X64_SCRIPT = """
import jax
from damcha_conformance.adapters import JaxAdapter
from damcha_conformance import run_conformance
assert jax.config.jax_enable_x64
adapter = JaxAdapter()
assert "float64" in adapter.dtypes
report = run_conformance(adapter, dtypes=["float64"])
print(report.summary())
raise SystemExit(0 if report.passed and len(report.results) > 26 else 1)
"""


@pytest.fixture(scope="module")
def float64_run():
    """The float64 catalogue in an x64 subprocess, started before the in-process
    runs so that the two overlap (each is mostly single-threaded compiling)."""
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _X64_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_catalogue_passes(dtype: str, float64_run) -> None:
    report = run_conformance(JaxAdapter(), dtypes=[dtype])
    ran = [r for r in report.results if r.status != "unsupported"]
    assert len(ran) == len(report.results), "the JAX backend declares no case unsupported"
    assert sum(r.check == "gradients" for r in ran) == sum(c.gradients for c in CATALOGUE)
    assert report.passed, report.summary()


def test_catalogue_passes_float64_with_x64(float64_run) -> None:
    stdout, stderr = float64_run.communicate(timeout=300)
    assert float64_run.returncode == 0, stdout + stderr[-3000:]


def test_float64_is_refused_without_x64() -> None:
    # Without x64 JAX would quietly compute in float32 under the float64 label.
    import jax

    from damcha_conformance import materialise
    from damcha_core import DamchaValueError

    assert not jax.config.jax_enable_x64
    adapter = JaxAdapter()
    assert "float64" not in adapter.dtypes
    report = run_conformance(adapter, cases=CATALOGUE[:1], dtypes=["float64"], gradients=False)
    assert report.results == [] and report.verdict == "FAILED"  # never a row of float32 numbers
    assert report.gaps == [("jax", "dtype float64: not among the adapter's dtypes (float32, bfloat16)")]
    with pytest.raises(DamchaValueError, match="x64"):
        adapter.forward(materialise(CATALOGUE[0]), "float64")
