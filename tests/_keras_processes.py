"""One Keras process per backend for the checks that need a backend other than
the test process's own: tests/test_keras_backends.py (the layer: ``layer``) and
tests/test_models_keras_backends.py (KerasHub conversion: ``models``).

Keras fixes its backend at import, so those checks run in a subprocess
(``python tests/_keras_processes.py BACKEND OUT WORKDIR``); starting Keras with
its backend costs 5-15 s of CPU, so each backend starts one process per test
session that runs every part it has (tensorflow: the layer only) and writes the
parts' results as JSON; the test process's own backend (tensorflow unless
KERAS_BACKEND says otherwise) runs its parts in the test process, which has
Keras loaded already. Each check is its own pytest item that asserts on its
part's results.

A part that raises is recorded with its traceback and the other parts still run;
a process that dies is recorded with its output. Either way every item of the
failed part fails with that message, and nothing runs twice. Under pytest-xdist
every worker asks for the results: the first one runs the process under a file
lock in the directory the workers share; the others read its JSON. A worker that
finds the backend it needs already running first runs a backend nobody has
started, then waits, so no worker idles while a backend is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
BACKENDS = ("tensorflow", "torch", "jax")
# part -> (test module, the backends it runs on)
PARTS = {
    "layer": ("test_keras_backends", ("tensorflow", "torch", "jax")),
    "models": ("test_models_keras_backends", ("jax", "torch")),
}
TIMEOUT_S = 1200

_RESULTS: dict[str, dict[str, Any]] = {}


def parts_of(backend: str) -> list[str]:
    return [part for part, (_, backends) in PARTS.items() if backend in backends]


def part_results(backend: str, part: str, tmp_path_factory: Any, request: Any) -> dict[str, Any]:
    """The results of ``part`` on ``backend``, computed once per test session."""
    assert part in parts_of(backend), (backend, part)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the workers' common root
    if backend not in _RESULTS:
        if not _run_once(backend, shared, wait=False):
            for other in _needed(request.session):
                if other != backend:
                    _run_once(other, shared, wait=False)
            _run_once(backend, shared, wait=True)
        _RESULTS[backend] = json.loads((shared / f"keras-process-{backend}.json").read_text())
    results = _RESULTS[backend]
    assert "crashed" not in results, f"the {backend} Keras process failed:\n{results.get('crashed')}"
    result = results[part]
    assert "error" not in result, f"{part} on {backend} raised:\n{result['error']}"
    assert result["backend"] == backend, result
    return result


def _needed(session: Any) -> list[str]:
    """The backends some collected item of this module's parts asks for."""
    modules = {module for module, _ in PARTS.values()}
    needed = set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path.stem in modules and "backend" in params:
            needed.add(params["backend"])
    return [b for b in BACKENDS if b in needed]


def _run_once(backend: str, shared: Path, *, wait: bool) -> bool:
    """Run ``backend``'s process unless its results exist; False when another
    worker holds its lock and ``wait`` is False."""
    out = shared / f"keras-process-{backend}.json"
    return run_once_locked(
        out, shared / f"keras-process-{backend}.lock", lambda: _run_process(backend, shared, out), wait=wait
    )


def run_once_locked(out: Path, lock: Path, run: Any, *, wait: bool) -> bool:
    """Call ``run`` (which writes ``out``) unless ``out`` exists, under an
    exclusive lock on ``lock`` shared by the xdist workers; False when another
    worker holds the lock and ``wait`` is False (tests/test_keras_upstream.py
    uses it for Keras's own suite)."""
    if out.exists():
        return True
    with open(lock, "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no sharing between workers
            fcntl = None  # type: ignore[assignment]
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
        if not out.exists():
            run()
    return True


def _in_this_process(backend: str) -> bool:
    """Whether this process's Keras runs on ``backend`` (tensorflow unless
    KERAS_BACKEND says otherwise): then its parts run here, without starting
    Keras again (the test process imports Keras for its own Keras tests anyway)."""
    if backend != os.environ.get("KERAS_BACKEND", "tensorflow"):
        return False
    import keras

    return bool(keras.backend.backend() == backend)


def _run_process(backend: str, shared: Path, out: Path) -> None:
    workdir = shared / f"keras-process-{backend}"
    workdir.mkdir(exist_ok=True)
    if _in_this_process(backend):
        out.write_text(json.dumps(_run_parts(backend, str(workdir))))
        return
    env = {**os.environ, "KERAS_BACKEND": backend}
    if backend == "jax":
        # Every case is a fresh XLA compilation of tiny shapes: compile time, not
        # run time, dominates, and cheaper codegen cuts it by about a third.
        env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    partial = out.with_suffix(".partial")
    try:
        proc = subprocess.run(
            [sys.executable, __file__, backend, str(partial), str(workdir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=TESTS,
        )
        if proc.returncode == 0 and partial.exists():
            partial.replace(out)
            return
        crashed = f"exit status {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    except subprocess.TimeoutExpired as exc:
        crashed = f"timed out after {TIMEOUT_S} s\n{exc.stdout!r:.2000}\n{exc.stderr!r:.4000}"
    # Recorded, so the other items fail with this message instead of running it again.
    out.write_text(json.dumps({"crashed": crashed}))


def _run_parts(backend: str, workdir: str) -> dict[str, Any]:
    import importlib
    import time

    results: dict[str, Any] = {}
    for part in parts_of(backend):
        module = importlib.import_module(PARTS[part][0])
        path = Path(workdir) / part
        path.mkdir(exist_ok=True)
        start = time.process_time()
        try:
            results[part] = module.run(backend, str(path))
            results[part]["cpu_s"] = round(time.process_time() - start, 1)  # this process's CPU, for tuning
        except Exception:  # noqa: BLE001  (recorded: that part's items fail with it, the next part runs)
            results[part] = {"error": traceback.format_exc()[-6000:]}
    return results


def _main(backend: str, out: str, workdir: str) -> None:
    Path(out).write_text(json.dumps(_run_parts(backend, workdir)))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.path.insert(0, str(TESTS))
    _main(sys.argv[1], sys.argv[2], sys.argv[3])
