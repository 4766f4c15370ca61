"""The whole conformance catalogue on damcha_jax, one test per check (forward,
gradients, decode, bad input) and dtype, through the suite's pytest
parametrisation.

float32 and bfloat16 run in-process; float64 needs JAX's x64 mode, which is
process-wide, so its checks run in one x64 worker process per pytest process,
compiled with XLA's default code generation (the suite's other JAX programs take
conftest.py's cheaper one).
Without xdist the worker is handed every selected float64 check at once and
computes them while the in-process checks run (each is mostly single-threaded
compiling); under xdist each float64 test asks for its own check, so no check
is computed twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from damcha_conformance import CATALOGUE, PENALTY_CASES, WEIGHTS_CASES, Result, materialise, run_conformance
from damcha_conformance.adapters import BUILTIN, JaxAdapter
from damcha_conformance.pytest_plugin import assert_check, check_id, checks
from damcha_core import DamchaValueError

IN_PROCESS = ("float32", "bfloat16")
CHECKS = checks(IN_PROCESS) + checks(["float64"], errors=False)  # bad input in float32 and bfloat16 (x64 worker: none)
BY_ID = {c.id: c for c in CHECKS}

_X64_WORKER = """
import json, sys
import jax
from damcha_conformance.adapters import JaxAdapter
from damcha_conformance.pytest_plugin import checks
assert jax.config.jax_enable_x64
adapter = JaxAdapter()
assert "float64" in adapter.dtypes
by_id = {c.id: c for c in checks(["float64"], errors=False)}
for line in sys.stdin:
    print(json.dumps(by_id[line.strip()].run(adapter).to_dict()), flush=True)
"""


class X64Worker:
    """A JAX_ENABLE_X64=1 process that runs float64 checks by id, in order."""

    def __init__(self) -> None:
        env = {**os.environ, "JAX_ENABLE_X64": "1"}
        if env.get("XLA_FLAGS") == env.get("DAMCHA_TESTS_XLA_FLAGS"):
            del env["XLA_FLAGS"]  # XLA's default code generation, not conftest.py's cheaper one: see there
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _X64_WORKER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.sent: list[str] = []
        self.results: dict[str, Result] = {}

    def send(self, ids: list[str]) -> None:
        for check_id_ in ids:
            if check_id_ not in self.sent:
                self.sent.append(check_id_)
                self.proc.stdin.write(check_id_ + "\n")
        self.proc.stdin.flush()

    def result(self, check_id_: str) -> Result:
        self.send([check_id_])
        while check_id_ not in self.results:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.kill()
                raise AssertionError("the x64 worker died: " + self.proc.stderr.read()[-3000:])
            result = Result(**json.loads(line))
            kind = "forward" if result.check == "output" else result.check
            self.results[f"{kind}-float64-{result.case}"] = result
        return self.results[check_id_]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def x64_worker(request):
    worker = X64Worker()
    if "PYTEST_XDIST_WORKER" not in os.environ:
        # One process runs every selected test: hand over all float64 checks now, so the worker
        # computes them while this process runs the float32 and bfloat16 checks.
        selected = [
            item.callspec.params["check"].id
            for item in request.session.items
            if item.module is request.module and "check" in getattr(getattr(item, "callspec", None), "params", {})
        ]
        worker.send([i for i in selected if BY_ID[i].dtype == "float64"])
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def adapter():
    return JaxAdapter()


@pytest.mark.parametrize("check", sorted(CHECKS, key=lambda c: c.dtype == "float64"), ids=check_id)
def test_conformance(check, adapter, x64_worker):
    if check.dtype != "float64":
        assert_check(adapter, check)
        return
    result = x64_worker.result(check.id)
    assert result.status == "pass", (
        f"{result.status}: err={result.max_error:.3g} ratio={result.ratio:.3g} {result.detail}"
    )


def test_the_plan_covers_every_case_with_gradients_and_float64():
    ids = set(BY_ID)
    # The adapter declares what `damcha conform` expects of it (float64 with its x64 worker).
    assert set(JaxAdapter().dtypes) | {"float64"} == set(BUILTIN["jax"].dtypes)
    for dtype in ("float32", "bfloat16", "float64"):
        for case in CATALOGUE:
            runs = case.runs_in(dtype)  # the float16-only cases are not JAX's
            assert (f"forward-{dtype}-{case.name}" in ids) == runs
            assert (f"gradients-{dtype}-{case.name}" in ids) == (runs and case.gradients)
        assert all(f"weights-{dtype}-{case.name}" in ids for case in WEIGHTS_CASES)
        for case in PENALTY_CASES:
            assert f"penalty-{dtype}-{case.name}" in ids and f"penalty-gradients-{dtype}-{case.name}" in ids


def test_float64_is_refused_without_x64() -> None:
    # Without x64 JAX would quietly compute in float32 under the float64 label.
    assert not jax.config.jax_enable_x64
    adapter = JaxAdapter()
    assert "float64" not in adapter.dtypes
    report = run_conformance(adapter, cases=CATALOGUE[:1], dtypes=["float64"], gradients=False)
    assert report.results == [] and report.verdict == "FAILED"  # never a row of float32 numbers
    assert report.gaps == [("jax", "dtype float64: not among the adapter's dtypes (float32, bfloat16)")]
    with pytest.raises(DamchaValueError, match="x64"):
        adapter.forward(materialise(CATALOGUE[0]), "float64")
