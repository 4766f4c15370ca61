"""One Keras process per backend for the checks that need a backend other than
the test process's own: tests/test_keras_backends.py (the layer: ``layer``),
tests/test_models_keras_backends.py (KerasHub conversion: ``models``),
tests/test_keras_fastpath.py (that file's tests, run by pytest in the process:
``fastpath``) and tests/test_keras_upstream.py (Keras's own MHA suite, run by
pytest in the process: ``upstream``).

Keras fixes its backend at import, so those checks run in a subprocess
(``python tests/_keras_processes.py BACKEND OUT WORKDIR [PART...]``); starting
Keras with its backend costs 5-15 s of CPU, so each backend starts one process
per test session that runs every part it has that the session's items ask for
and writes the parts' results as JSON; the
test process's own backend (tensorflow unless KERAS_BACKEND says otherwise)
runs its parts in the test process, which has Keras loaded already. Each check
is its own pytest item that asserts on its part's results.

The processes start in the background when the session starts
(``start_in_background``, conftest.py's session fixture: the first xdist worker
to claim a backend starts it, under a small supervisor process that records how
it ended, and ends it if the test run ends first), and the items that read
their results run last (``reads_a_process``, conftest.py's ordering), so the
workers run the rest of the suite while Keras runs beside them rather than
waiting on it. The test process's own backend runs its parts when its first
item asks (under a file lock in the directory the workers share: the first
worker runs them, the others read its JSON).

A part that raises is recorded with its traceback and the other parts still run;
a process that dies is recorded with its output. Either way every item of the
failed part fails with that message, and nothing runs twice.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
PYPROJECT = TESTS.parent / "pyproject.toml"
BACKENDS = ("tensorflow", "torch", "jax")
# part -> (test module, the backends it runs on)
# (in this order: Keras's own suite last, its test case clears Keras's global state)
PARTS = {
    "layer": ("test_keras_backends", ("tensorflow", "torch", "jax")),
    "models": ("test_models_keras_backends", ("jax", "torch")),
    "fastpath": ("test_keras_fastpath", ("jax", "torch")),
    "upstream": ("test_keras_upstream", ("tensorflow", "jax", "torch")),
}
# Parts that are a test file of ours run by pytest: -k expression by backend. Not
# imported before pytest imports it, so pytest rewrites its asserts (a failure
# shows the compared values, as in the test process).
PYTEST_PARTS = {
    "fastpath": lambda backend: (
        "not tf_graph and not tf_eager and not other_keras_backends"
        + ("" if backend == "torch" else " and not torch_aten")
    ),
}
TIMEOUT_S = 2400  # a hung process, not a slow one: jax runs ~300 s of CPU, 2-5x that in wall time on a loaded machine

_RESULTS: dict[str, dict[str, Any]] = {}


def freeze_long_lived() -> None:
    """Collect, then move every object left out of the garbage collector's sight
    (``gc.freeze``): what is alive now (the frameworks' modules, millions of
    objects) lives for the process, and every later full collection would walk
    it again, about 0.2 s each. Keras collects whenever a layer drops a variable
    (``model.quantize``, once per quantized layer) and in ``clear_session``
    (before each test of its own suite). Collecting first keeps garbage that is
    still waiting (a previous test's models) from being frozen with it."""
    gc.collect()
    gc.freeze()


def parts_of(backend: str) -> list[str]:
    return [part for part, (_, backends) in PARTS.items() if backend in backends]


def shared_dir(tmp_path_factory: Any) -> Path:
    """The folder every xdist worker of this session sees (the base temporary
    folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return Path(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


def reads_a_process(item: Any) -> bool:
    """Whether ``item`` asserts on the results of a Keras process of another
    backend than the test process's: conftest.py runs those items last, when the
    process started in the background has long finished."""
    asks = _asks_for(item)
    return asks is not None and asks[0] != _own_backend()


def start_in_background(session: Any, shared: Path) -> None:
    """Start the Keras process of every backend some collected item reads, but
    the test process's own, unless another worker has (``_launch``)."""
    for backend, parts in _needed(session).items():
        if backend != _own_backend():
            _launch(backend, shared, parts)


def part_results(backend: str, part: str, tmp_path_factory: Any, request: Any) -> dict[str, Any]:
    """The results of ``part`` on ``backend``, computed once per test session."""
    assert part in parts_of(backend), (backend, part)
    shared = shared_dir(tmp_path_factory)
    if backend not in _RESULTS:
        parts = _needed(request.session)[backend]
        out = shared / f"keras-process-{backend}.json"
        if backend == _own_backend():
            run_once_locked(
                out, shared / f"keras-process-{backend}.lock", lambda: _run_process(backend, parts, shared, out)
            )
        else:
            _launch(backend, shared, parts)  # started already, unless the session fixture did not run
            _wait_for(out)
        _RESULTS[backend] = json.loads(out.read_text())
    results = _RESULTS[backend]
    assert "crashed" not in results, f"the {backend} Keras process failed:\n{results.get('crashed')}"
    assert part in results, f"the {backend} Keras process did not run {part}: ran {sorted(results)}"
    result = results[part]
    assert "error" not in result, f"{part} on {backend} raised:\n{result['error']}"
    assert result["backend"] == backend, result
    return result


def _needed(session: Any) -> dict[str, list[str]]:
    """backend -> the parts some collected item asks for on it (in PARTS' order):
    a process runs only those, so ``pytest tests/test_keras_fastpath.py`` does
    not run Keras's suite too. Every xdist worker collects the same items."""
    needed: dict[str, set[str]] = {}
    for asks in filter(None, map(_asks_for, session.items)):
        needed.setdefault(asks[0], set()).add(asks[1])
    return {b: [p for p in PARTS if p in needed[b]] for b in BACKENDS if b in needed}


_PART_OF = {module: part for part, (module, _) in PARTS.items()}


def _asks_for(item: Any) -> tuple[str, str] | None:
    """(backend, part) whose results ``item`` asserts on, or None for any other item."""
    backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
    part = _PART_OF.get(item.path.stem)
    return (backend, part) if part is not None and backend in BACKENDS else None


def _own_backend() -> str:
    """The backend of this process's Keras (KERAS_BACKEND, else Keras's config
    file, else tensorflow): its parts run here, without starting Keras again
    (asked only where a collected test module has imported Keras already)."""
    import keras

    return str(keras.backend.backend())


_LAUNCHED: list[subprocess.Popen] = []  # held, so no Popen is collected (and warns) while its process runs


def _launch(backend: str, shared: Path, parts: list[str]) -> None:
    """Start ``backend``'s process under its supervisor (``_supervise``) unless
    some worker of this session has: the first to create the marker file
    starts it. Not waited for: the supervisor writes the results file, which
    the items read (``_wait_for``)."""
    claim = shared / f"keras-process-{backend}.started"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    workdir = shared / f"keras-process-{backend}"
    workdir.mkdir(exist_ok=True)
    out = shared / f"keras-process-{backend}.json"
    # The test run's own process: the xdist controller (a worker's parent) or pytest itself.
    run_pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    cmd = [sys.executable, __file__, "--supervise", backend, str(out), str(workdir), str(run_pid), *parts]
    try:
        _LAUNCHED.append(subprocess.Popen(cmd, cwd=TESTS, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    except BaseException:
        claim.unlink()  # unclaimed: the next to ask starts it (or fails alike)
        raise


def _wait_for(out: Path) -> None:
    """Wait until ``out`` exists (the supervisor writes it whole, with a rename,
    however the process ended)."""
    deadline = time.monotonic() + TIMEOUT_S + 120
    while not out.exists():
        assert time.monotonic() < deadline, f"no {out.name} {TIMEOUT_S + 120} s after the Keras process started"
        time.sleep(0.2)


def run_once_locked(out: Path, lock: Path, run: Any) -> None:
    """Call ``run`` (which writes ``out``) unless ``out`` exists, under an
    exclusive lock on ``lock`` shared by the xdist workers (a worker that finds
    it held waits, then reads what the holder wrote)."""
    if out.exists():
        return
    with open(lock, "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no sharing between workers
            fcntl = None  # type: ignore[assignment]
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        if not out.exists():
            run()


def _run_process(backend: str, parts: list[str], shared: Path, out: Path) -> None:
    """This process's own backend's parts, here."""
    workdir = shared / f"keras-process-{backend}"
    workdir.mkdir(exist_ok=True)
    out.write_text(json.dumps(_run_parts(backend, parts, str(workdir))))


def _supervise(backend: str, out: Path, workdir: str, parts: list[str], run_pid: int) -> None:
    """Run ``backend``'s process (``parts``) and write ``out``: its results, or
    how it failed. A process of its own, so that a crash of the Keras process
    (or the worker that started it ending first) still leaves ``out``. When the
    test run ends before the process does (``run_pid``, the pytest process or
    the xdist controller, is gone: a run stopped by ``-x``, a failed collection,
    a killed CI job), it ends the process and writes nothing: no one is left
    to read it."""
    env = {**os.environ, "KERAS_BACKEND": backend}
    partial = out.with_suffix(".partial")
    # A file, not a pipe: the process never blocks on its output while this one polls.
    with open(Path(workdir) / "process.log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, backend, str(partial), workdir, *parts],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=TESTS,
        )
        deadline = time.monotonic() + TIMEOUT_S
        returncode: int | None = None
        while returncode is None:
            try:
                returncode = proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                run_ended = not _alive(run_pid)
                if not run_ended and time.monotonic() < deadline:
                    continue
                proc.kill()
                proc.wait()
                if run_ended:
                    return
                break
        log.seek(0)
        output = log.read()[-8000:]
    if returncode == 0 and partial.exists():
        partial.replace(out)
        return
    ended = f"timed out after {TIMEOUT_S} s" if returncode is None else f"exit status {returncode}"
    # Recorded, so the items fail with this message (written whole, then renamed: the items poll for the name).
    partial.write_text(json.dumps({"crashed": f"{ended}\n{output}"}))
    partial.replace(out)


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would end the process there: assume the run lasts
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds the pid
        pass
    return True


def _run_parts(backend: str, parts: list[str], workdir: str) -> dict[str, Any]:
    import importlib

    import keras  # noqa: F401  (imported here, so that the freeze below covers it)

    results: dict[str, Any] = {}
    for part in parts:
        path = Path(workdir) / part
        path.mkdir(exist_ok=True)
        freeze_long_lived()  # what the earlier parts imported
        start = time.process_time()
        try:
            if part in PYTEST_PARTS:
                results[part] = run_pytest(
                    [str(TESTS / f"{PARTS[part][0]}.py"), "-c", str(PYPROJECT), "-k", PYTEST_PARTS[part](backend)]
                    + ["-W", "ignore::DeprecationWarning"]
                )
                results[part]["backend"] = backend
            else:
                results[part] = importlib.import_module(PARTS[part][0]).run(backend, str(path))
            results[part]["cpu_s"] = round(time.process_time() - start, 1)  # this process's CPU, for tuning
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001  (recorded, pytest.fail's too: that part's items fail with it, the next part runs)
            results[part] = {"error": traceback.format_exc()[-6000:]}
    return results


def run_pytest(args: list[str], plugins: tuple = ()) -> dict[str, Any]:
    """Run pytest on ``args`` in this process: each test's outcome ("passed",
    "failed" or "skipped") and message by its id (the node id's last part: a
    test method's name without its class), how many tests were deselected, and
    pytest's exit status. A collection error
    is a failed entry named after what failed to collect."""
    import pytest

    class Collector:
        def __init__(self) -> None:
            self.tests: dict[str, dict[str, str]] = {}
            self.deselected = 0

        def pytest_collectreport(self, report: Any) -> None:
            if report.failed:
                self.tests[report.nodeid or "collection"] = {
                    "outcome": "failed",
                    "message": str(report.longrepr)[-4000:],
                }

        def pytest_collection_finish(self, session: Any) -> None:
            freeze_long_lived()  # as conftest.py's hook: what collection imported

        def pytest_deselected(self, items: list) -> None:
            self.deselected += len(items)

        def pytest_runtest_logreport(self, report: Any) -> None:
            test_id = report.nodeid.split("::")[-1]
            entry = self.tests.setdefault(test_id, {"outcome": "passed", "message": ""})
            if report.failed or (report.skipped and entry["outcome"] == "passed"):
                entry["outcome"] = "failed" if report.failed else "skipped"
                if report.skipped and isinstance(report.longrepr, tuple):
                    entry["message"] = str(report.longrepr[2])
                else:
                    entry["message"] = str(report.longrepr)[-4000:]

    collector = Collector()
    base = ["-q", "-p", "no:cacheprovider", "--tb=short", "--no-header", "-o", "console_output_style=classic"]
    status = pytest.main([*args, *base], plugins=[collector, *plugins])
    return {"tests": collector.tests, "deselected": collector.deselected, "exit_status": int(status)}


def _main(backend: str, out: str, workdir: str, parts: list[str]) -> None:
    Path(out).write_text(json.dumps(_run_parts(backend, parts or parts_of(backend), workdir)))


if __name__ == "__main__":
    if sys.argv[1] == "--supervise":
        _supervise(sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[6:], run_pid=int(sys.argv[5]))
        sys.exit()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.path.insert(0, str(TESTS))
    _main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
