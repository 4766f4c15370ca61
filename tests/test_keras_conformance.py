"""The conformance catalogue on damcha_keras under each Keras backend, one test
per backend and check (forward, gradients, decode, bad input) and dtype, so a
failure names its case (``-k "jax and gradients"`` selects).

Keras fixes its backend at import, so each backend's checks run in a worker
process of their own (``KERAS_BACKEND=...``) that runs checks by id and sends
back each result. Without xdist the worker is handed every selected check of
its backend at once (it computes while the earlier results are asserted);
under xdist each test asks for its own check, so no check is computed twice.
A worker is closed when the tests move on to the next backend (the tests are
ordered by backend), so at most one Keras process per pytest process runs.

tensorflow and torch run float32 and float64; jax runs float32 (float64 needs
JAX_ENABLE_X64=1 and is run by ``damcha conform``, kept out of this suite for
time: each case is a separate XLA compilation).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import pytest

from damcha_conformance import CATALOGUE, PENALTY_CASES, WEIGHTS_CASES, Report, Result
from damcha_conformance.adapters import BUILTIN
from damcha_conformance.pytest_plugin import checks

BACKENDS = {"tensorflow": ("float32", "float64"), "torch": ("float32", "float64"), "jax": ("float32",)}


PLAN = [
    pytest.param(backend, check, id=f"{backend}-{check.id}")
    for backend, dtypes in BACKENDS.items()
    for check in checks(dtypes)
]
TIMEOUT_S = 300  # one check; a whole-catalogue run takes a few minutes per backend

_WORKER = """
import json, sys
import keras
from damcha_conformance.adapters import KerasAdapter
from damcha_conformance.pytest_plugin import checks
adapter = KerasAdapter()
print(json.dumps({"backend": keras.backend.backend(), "dtypes": list(adapter.dtypes)}), flush=True)
by_id = {c.id: c for c in checks(sys.argv[1].split(","))}
for line in sys.stdin:
    check_id = line.strip()
    print(json.dumps({"id": check_id, "result": by_id[check_id].run(adapter).to_dict()}), flush=True)
"""


class Worker:
    """A process with ``KERAS_BACKEND=backend`` that runs checks by id, in order."""

    def __init__(self, backend: str) -> None:
        env = {**os.environ, "KERAS_BACKEND": backend}
        self.backend = backend
        # A file, not a pipe: framework logs could fill a pipe and block the worker.
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, ",".join(BACKENDS[backend])],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = json.loads(self._next_line("start"))
        self.sent: list[str] = []
        self.results: dict[str, Result] = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):  # the worker's messages; anything a framework prints is not one
                self.lines.put(line)
        self.lines.put("")  # end of output: the process is gone

    def _next_line(self, waiting_for: str) -> str:
        try:
            line = self.lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            self.close()
            raise AssertionError(f"the keras-{self.backend} worker took over {TIMEOUT_S} s on {waiting_for}") from None
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            raise AssertionError(
                f"the keras-{self.backend} worker died (exit {self.proc.returncode}) on {waiting_for}: "
                + self.stderr.read()[-3000:]
            )
        return line

    def send(self, ids: list[str]) -> None:
        for id_ in ids:
            if id_ not in self.sent:
                self.sent.append(id_)
                self.proc.stdin.write(id_ + "\n")
        self.proc.stdin.flush()

    def result(self, check_id: str) -> Result:
        self.send([check_id])
        while check_id not in self.results:
            message = json.loads(self._next_line(check_id))
            self.results[message["id"]] = Result(**message["result"])
        return self.results[check_id]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()


class Workers:
    """One worker per backend, started on first use; starting one closes the others."""

    def __init__(self, selected: dict[str, list[str]] | None) -> None:
        self.selected = selected  # backend -> the check ids to hand over at start (None: one by one)
        self.running: dict[str, Worker] = {}

    def get(self, backend: str) -> Worker:
        if backend not in self.running:
            self.close()
            worker = self.running[backend] = Worker(backend)
            if self.selected is not None:
                worker.send(self.selected.get(backend, []))
        return self.running[backend]

    def close(self) -> None:
        while self.running:
            self.running.popitem()[1].close()


@pytest.fixture(scope="module")
def workers(request):
    selected = None
    if "PYTEST_XDIST_WORKER" not in os.environ:
        # One process runs every selected test: each worker gets all of its checks at once.
        selected = {}
        for item in request.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.module is request.module and "check" in params:
                selected.setdefault(params["backend"], []).append(params["check"].id)
    pool = Workers(selected)
    yield pool
    pool.close()


@pytest.mark.parametrize(("backend", "check"), PLAN)
def test_conformance(backend, check, workers):
    worker = workers.get(backend)
    assert worker.hello == {"backend": backend, "dtypes": list(BACKENDS[backend])}  # the adapter's own dtypes
    result = worker.result(check.id)
    assert (result.case, result.dtype) == (check.case.name, check.dtype), result
    if result.status == "unsupported":  # the Keras port claims every case
        pytest.fail(f"keras-{backend} declares {check.id} unsupported: {result.detail}", pytrace=False)
    if result.status != "pass":
        pytest.fail(Report([result]).summary().splitlines()[-1], pytrace=False)


def test_the_plan_covers_every_case_with_gradients_in_every_dtype():
    ids = {(backend, check.id) for backend, check in (p.values for p in PLAN)}
    for backend, dtypes in BACKENDS.items():
        # What `damcha conform` expects of each backend (keras-jax: float64 with JAX_ENABLE_X64=1, as it runs it).
        assert set(dtypes) | ({"float64"} if backend == "jax" else set()) == set(BUILTIN[f"keras-{backend}"].dtypes)
        for dtype in dtypes:
            for case in CATALOGUE:
                runs = case.runs_in(dtype)  # the float16-only cases are not Keras's
                assert ((backend, f"forward-{dtype}-{case.name}") in ids) == runs
                assert ((backend, f"gradients-{dtype}-{case.name}") in ids) == (runs and case.gradients)
            assert all((backend, f"weights-{dtype}-{case.name}") in ids for case in WEIGHTS_CASES)
            assert all((backend, f"penalty-gradients-{dtype}-{case.name}") in ids for case in PENALTY_CASES)
