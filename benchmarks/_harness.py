"""Shared measurement machinery of the drop-in benchmarks (``bench_dropin.py``).

Timing rule: DAMCHA and the framework's own MHA are built in one process and
called alternately (A B, then B A, ...) after warm-up calls, so a load drift
on a shared machine hits both; the statistic is the median of the per-round
ratios DAMCHA/MHA, with its quartiles as the spread. Results go to a JSON
file, one entry per (port, section, case, mode, size), written after every
entry, so a long run can be resumed (``--resume``) and partial results are
never lost.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = "damcha-dropin/1"
REPO = Path(__file__).resolve().parent.parent

# The issue-12 targets (DAMCHA/MHA ratios on the CPU the lead measures on).
TARGET_LONG = 1.05  # layer and whole-model time at N >= 1024
TARGET_SHORT = 1.10  # layer and whole-model time at N < 1024 (N = 256)
TARGET_DECODE_B1 = 1.15  # eager decode step, B = 1
TARGET_DECODE = 1.05  # decode step, B > 1
TARGET_MEMORY = 1.05  # peak-memory ratio


def time_target(n: int) -> float:
    """The issue-12 time target of a layer or whole-model ratio at sequence length ``n``."""
    return TARGET_LONG if n >= 1024 else TARGET_SHORT


def decode_target(batch: int) -> float:
    """The issue-12 target of a per-token decode ratio at batch size ``batch``."""
    return TARGET_DECODE_B1 if batch == 1 else TARGET_DECODE


# --------------------------------------------------------------------- threads


def fix_threads(threads: int) -> dict[str, Any]:
    """Pin this process to ``threads`` cores and tell the thread pools so.

    Call before importing a framework: the environment variables are read at
    import (OpenMP, MKL, TensorFlow, XLA's pool size follows the affinity).
    Returns what was set, for the record.
    """
    info: dict[str, Any] = {"threads": threads}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(threads)
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > threads:
            os.sched_setaffinity(0, cores[:threads])
        info["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        info["affinity"] = None
    return info


# --------------------------------------------------------------------- timing


def interleaved(
    calls: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
    self_timed: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """Time each call ``repeats`` times, alternating the order every round.

    Args:
        calls: name -> a call doing one unit of work (its result goes to ``sync``).
        repeats: timed rounds; each round calls every entry once.
        warmup: untimed rounds first (compilation, lazy loading, first touch).
        sync: waits for a result (asynchronous frameworks); default none.
        self_timed: each call times its own region and returns ``(wall, cpu)``
            seconds (e.g. the decode steps after an untimed prompt).

    Returns:
        name -> {"wall": [seconds...], "cpu": [process CPU seconds...]}, one
        value per round, in round order (so ratios can be paired by round).
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            out = calls[name]()
            if sync is not None and not self_timed:
                sync(out)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            c0, w0 = time.process_time(), time.perf_counter()
            out = calls[name]()
            if sync is not None and not self_timed:
                sync(out)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if self_timed:
                wall, cpu = out
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
    return times


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Median and quartiles of the paired (per-round) ratios num/den, plus the
    ratio of the medians and of the minima."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired timings must have one equal, non-zero length; got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den)]
    return {
        "median": statistics.median(ratios),
        "q1": _quantile(ratios, 0.25),
        "q3": _quantile(ratios, 0.75),
        "min": min(ratios),
        "max": max(ratios),
        "of_medians": statistics.median(num) / statistics.median(den),
        "of_minima": min(num) / min(den),
        "rounds": len(ratios),
    }


def summary(times: Mapping[str, Mapping[str, list[float]]], num: str, den: str) -> dict[str, Any]:
    """Median ms of both and the paired-ratio statistics of wall and CPU time."""
    return {
        "ms": {name: 1e3 * statistics.median(times[name]["wall"]) for name in (num, den)},
        "ratio": ratio_stats(times[num]["wall"], times[den]["wall"]),
        "cpu_ratio": ratio_stats(times[num]["cpu"], times[den]["cpu"]),
    }


# --------------------------------------------------------------------- memory


def peak_in_subprocess(argv: Sequence[str], *, timeout: float | None = None) -> dict[str, Any]:
    """Run a memory worker (a fresh interpreter) and return its JSON line.

    glibc is told to mmap every block >= 64 KiB, so freed tensors leave the
    resident set at once and the high-water mark (VmHWM) tracks the peak of
    live memory (the method of ``bench_torch.py``).
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"memory worker failed ({out.returncode}): {' '.join(argv)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compiled_memory(compiled: Any) -> dict[str, float]:
    """XLA's ``memory_analysis()`` of a compiled program in MiB: ``temp`` (the
    buffers XLA allocates while it runs: activations, saved residuals),
    ``argument`` and ``output`` (parameters, optimizer state, inputs, results),
    ``alias`` (outputs that reuse a donated argument), ``total`` = argument
    + output + temp - alias, the memory the call needs at its peak, and ``own``
    (``xla_own``), what the call allocates beyond its arguments."""
    stats = compiled.memory_analysis()
    mib = {k: getattr(stats, f"{k}_size_in_bytes") / 2**20 for k in ("temp", "argument", "output", "alias")}
    return {**mib, "total": mib["argument"] + mib["output"] + mib["temp"] - mib["alias"], "own": xla_own(mib)}


def xla_own(parts: Mapping[str, float]) -> float:
    """What a compiled call allocates beyond its arguments: temp + output - alias. The
    arguments (parameters, optimizer state, inputs) exist before the call, as they do
    before a torch call whose resident-set increase the other ports compare: one
    definition of a call's memory for every port (counting the arguments, XLA's total
    diluted the ratio with the parameters, the same on both sides)."""
    return parts["temp"] + parts["output"] - parts["alias"]


def xla_memory_record(method: str, mems: Mapping[str, dict[str, float]]) -> dict[str, Any]:
    """A whole-model entry's ``memory`` from XLA's estimates (``compiled_memory``) of the
    "damcha" and "mha" programs: what each allocates (``xla_own``) compared, every part
    kept (``xla_mib``)."""
    return {
        "method": method,
        **memory_comparison({impl: xla_own(m) for impl, m in mems.items()}, "damcha", "mha"),
        "xla_mib": dict(mems),
    }


def measure_peak(call: Callable[[], Any]) -> float:
    """Peak RSS increase (MiB) of one ``call()`` after a warm-up call, in this process."""
    from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    call()  # warm-up: lazy loading, compilation and first-touch pages stay out of the peak
    reset_peak_rss()
    base = rss_bytes()
    call()
    return (peak_rss_bytes() - base) / 2**20


# --------------------------------------------------------------------- records


def versions() -> dict[str, str]:
    """Installed versions of the packages the benchmarks use (absent ones left out)."""
    out = {"python": platform.python_version()}
    for dist in (
        "numpy",
        "torch",
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "keras",
        "tensorflow-cpu",
        "tensorflow",
        "keras-hub",
        "transformers",
        "timm",
        "damcha",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    name: str | None = None
    flags: set[str] | None = None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and name is None:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and flags is None:
                    flags = set(line.split(":", 1)[1].split())
                if name is not None and flags is not None:
                    break
    except OSError:
        pass
    cpu = name if name is not None else platform.processor() or ""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }
    # VMs sold under one CPU name differ in these (AVX2 only, or AVX-512 with VNNI), and
    # CPU kernels' speeds with them: a run line says which the run had.
    if flags is not None:
        info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    try:
        with open("/proc/meminfo") as fh:
            info["mem_total_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def git_dirty_files() -> list[str] | None:
    """The tracked files that differ from HEAD (a "+dirty" run's difference, by name:
    docs and result files only, or code)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "diff", "HEAD", "--name-only"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # "+dirty": tracked files differ from HEAD, the files git_dirty_files lists.
    return (head + ("+dirty" if git_dirty_files() else "")) or None


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def run_metadata(
    script: str,
    argv: Sequence[str],
    *,
    tiny: bool,
    threads: int,
    env: Mapping[str, str] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """A run's record, as bench_models.py writes it: the command that reproduces the run
    (``env``: variables it needs, written before the interpreter, e.g. KERAS_BACKEND), its
    arguments, start time, ``--tiny``, thread count, the script's own ``settings``, then the
    machine, package versions, git commit ("+dirty" when the tracked files differ from it)
    and load average at the start. The caller adds ``finished`` and ``loadavg_end``."""
    prefix = [f"{k}={v}" for k, v in (env or {}).items()]
    return {
        "command": shlex.join([*prefix, ".venv/bin/python", f"benchmarks/{script}", *argv]),
        "argv": list(argv),
        "started": now(),
        "tiny": tiny,
        "threads": threads,
        **settings,
        "machine": machine(),
        "versions": versions(),
        "git": git_commit(),
        "git_dirty": git_dirty_files(),
        "loadavg_start": loadavg(),
    }


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Results:
    """The JSON file of one run (``--json``), rewritten atomically after every entry.

    ``{"format", "runs": [run metadata...], "entries": {id: entry}}``. A run
    continued with ``--resume`` appends its metadata to ``runs`` and skips
    the ids already in ``entries``; each entry names the run that made it.
    ``file_format`` names the benchmark that writes the file (bench_dropin.py's
    ``FORMAT``, bench_models.py's own), so one never resumes the other's file.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume: bool, file_format: str = FORMAT) -> None:
        self.path = Path(path)
        if resume and self.path.exists():
            with open(self.path) as fh:
                self.data = json.load(fh)
            if self.data.get("format") != file_format:
                raise SystemExit(f"{self.path}: format {self.data.get('format')!r}, expected {file_format!r}")
        else:
            self.data = {"format": file_format, "runs": [], "entries": {}}

    def start_run(self, meta: dict[str, Any]) -> int:
        self.data["runs"].append(meta)
        self.save()
        return len(self.data["runs"]) - 1

    def update_run(self, index: int, **fields: Any) -> None:
        self.reload()
        self.data["runs"][index].update(fields)
        self.save()

    def reload(self) -> None:
        if self.path.exists():
            with open(self.path) as fh:
                self.data = json.load(fh)

    def has(self, entry_id: str) -> bool:
        return entry_id in self.data["entries"]

    def add(self, entry: dict[str, Any]) -> None:
        self.reload()  # a worker process may have written entries since
        self.data["entries"][entry["id"]] = entry
        self.save()

    def save(self) -> None:
        # The core's atomic writer: the file is synced before its rename and its folder after,
        # so a crash (or power loss) mid-run leaves the previous entries, never an empty file.
        from damcha_core._cliutil import atomic_write

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.path) as fh:
            json.dump(self.data, fh, indent=1, sort_keys=False, allow_nan=True)
            fh.write("\n")


def max_rel_diff(a: Any, b: Any) -> float:
    """max |a - b| / max(|b|, tiny): how far DAMCHA (gates 0) is from MHA."""
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)
    return float(np.max(np.abs(a - b))) / scale if a.size else 0.0


EQUAL_TOL = 1e-4  # float32: DAMCHA with closed gates must compute MHA's output to rounding


def closed_gate_check(damcha: Any, mha: Any, rows: Any = None, *, nonzero: bool = False) -> dict[str, Any]:
    """The ``check`` of an entry: DAMCHA's output with closed gates against MHA's.

    Args:
        damcha, mha: the two outputs, as NumPy arrays (or what ``np.asarray`` reads).
        rows: optional boolean index of the query rows that see some key; only those
            are compared (an all-masked row: MHA averages uniformly, DAMCHA gives 0).
        nonzero: MHA's values must not be all zero (gradients, weight changes: a step
            that changed nothing would otherwise pass as equal).
    """
    import numpy as np

    a, b = np.asarray(damcha), np.asarray(mha)
    if rows is not None:
        a, b = a[rows], b[rows]
    diff = max_rel_diff(a, b)
    if nonzero and not np.any(b):
        return {"max_rel_diff": diff, "ok": False, "note": "MHA's values are all zero: nothing was compared"}
    return {"max_rel_diff": diff, "ok": diff <= EQUAL_TOL}


def parameter_check(damcha: dict, mha: dict, keys: list | None = None) -> dict[str, Any]:
    """Gradients (or weight changes) of MHA's parameters, ``mha``: key -> array, against
    DAMCHA's under the same keys, compared as one vector (``closed_gate_check`` with
    ``nonzero``); ``keys``: only those (default: all of ``mha``'s)."""
    import numpy as np

    keys = list(mha) if keys is None else keys
    if not keys:
        raise RuntimeError("no parameters to compare")
    missing = [k for k in keys if k not in damcha]
    if missing:
        raise RuntimeError(f"DAMCHA lacks MHA's parameters {missing[:3]}")
    a, b = (np.concatenate([np.asarray(side[k]).ravel() for k in keys]) for side in (damcha, mha))
    return closed_gate_check(a, b, nonzero=True)


def padded(n: int, row: int) -> int:
    """How many trailing tokens batch row ``row`` of ``n`` pads: 0, 3%, 6% or 9% of
    them by row, at least one where the share is not 0 (--tiny's rows pad too)."""
    share = row % 4
    return max((n * share) // 32, 1) if share else 0


def combined_check(**parts: dict[str, Any]) -> dict[str, Any]:
    """One entry's ``check`` from several ``closed_gate_check`` results (output,
    gradients, a second baseline): the largest difference, ok only if every part is,
    and what was compared (``checked``: part name -> its difference)."""
    out = {
        "max_rel_diff": max(c["max_rel_diff"] for c in parts.values()),
        "ok": all(c["ok"] for c in parts.values()),
        "checked": {name: c["max_rel_diff"] for name, c in parts.items()},
    }
    notes = {name: c["note"] for name, c in parts.items() if "note" in c}
    if notes:
        out["notes"] = notes
    return out


# --------------------------------------------------------------------- sizes


class Sizes:
    """Problem sizes of a run: the issue-12 sizes, or tiny ones that only check the scripts."""

    def __init__(self, tiny: bool, lengths: Sequence[int] | None = None) -> None:
        self.tiny = tiny
        if tiny:
            # One length, one-layer models, a few decode steps: every code path, little compiling.
            self.B, self.E, self.H, self.ffn = 2, 32, 4, 64
            self.lengths = self.lengths_slow = self.model_lengths = [16]
            self.model_layers, self.vocab = 1, 50
            self.decode_batches, self.prompt, self.steps, self.stack_layers = [1, 2], 4, 2, 2
        else:
            self.B, self.E, self.H, self.ffn = 4, 512, 8, 2048
            self.lengths = [256, 1024, 4096]
            # Keras on JAX/torch backends (a subprocess each): 4096 adds an hour for
            # little information; XLA's and TF's CPU attention build (B, H, N, N) scores,
            # 2 GiB per layer at N=4096, so 6-layer training does not fit in memory.
            self.lengths_slow = [256, 1024]
            self.model_lengths = [256, 1024, 4096]
            self.model_layers, self.vocab = 6, 1024
            self.decode_batches, self.prompt, self.steps, self.stack_layers = [1, 8], 512, 32, 4
        if lengths:
            self.lengths = self.lengths_slow = self.model_lengths = list(lengths)

    def repeats(self, n: int) -> int:
        """Timed rounds at length ``n`` (each round calls DAMCHA and MHA once)."""
        if self.tiny:
            return 2
        return 11 if n <= 256 else 7 if n <= 1024 else 3

    def model_repeats(self, n: int) -> int:
        if self.tiny:
            return 2
        return 7 if n <= 256 else 5 if n <= 1024 else 3

    def decode_repeats(self) -> int:
        """Timed decodes per implementation (each: an untimed prompt, then timed steps).

        21, not 7: a round at B=1 is 32 steps of ~0.5 ms, and MHA's own rounds move
        by 50% within one run on a 2-core VM, so the median of 7 paired ratios moved
        by more than the targets' margins between idle runs of one commit."""
        return 2 if self.tiny else 21

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def layer_shape(self, n: int) -> dict[str, Any]:
        """The ``shape`` of a layer entry at length ``n``."""
        return {"B": self.B, "N": n, "E": self.E, "H": self.H}

    def model_shape(self, n: int, kind: str) -> dict[str, Any]:
        """The ``shape`` of a whole-model entry (``kind`` "encoder" or "lm") at length ``n``."""
        return {
            "B": self.B,
            "N": n,
            "E": self.E,
            "H": self.H,
            "layers": self.model_layers,
            "ffn": self.ffn,
            **({"vocab": self.vocab} if kind == "lm" else {}),
        }

    def decode_shape(self, batch: int, depth: str) -> dict[str, Any]:
        """The ``shape`` of a decode entry (``depth`` "layer" or "stack") at batch size ``batch``."""
        return {
            "B": batch,
            "E": self.E,
            "H": self.H,
            "prompt": self.prompt,
            "steps": self.steps,
            "layers": 1 if depth == "layer" else self.stack_layers,
        }


def _short(exc: BaseException) -> str:
    """The gist of an exception: Keras wraps the layer's own message in call reports and ANSI bold."""
    import re

    msg = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split("Arguments received by")[0]
    msg = re.sub(
        r"Could not automatically infer the output shape / dtype of .*?Error encountered:\s*", "", msg, flags=re.S
    )
    msg = re.sub(r"Exception encountered when calling [\w.]+\(\)\.", "", msg)
    return " ".join(msg.split())[:600]


def each_case(
    ses: Session,
    section: str,
    cases: Mapping[str, Any],
    lengths: Sequence[int],
    modes: Sequence[str],
    measure: Callable[[str, Any, int, dict[str, str]], None],
) -> None:
    """The loop of a layer or model section: ``measure(case, info, n, todo)`` for each
    case of ``cases`` (name -> its info) and length with modes still wanted (``todo``:
    mode -> entry id), under ``ses.attempt`` (an error is recorded, the loop goes on)."""
    for case, info in cases.items():
        for n in lengths:
            todo = ses.todo(section, case, n, modes)
            if not todo:
                continue
            with ses.attempt(list(todo.values()), section=section, case=case):
                measure(case, info, n, todo)


def each_decode(ses: Session, measure: Callable[[str, int, str], None]) -> None:
    """The loop of a decode section: ``measure(depth, batch, entry_id)`` for the depths
    "layer" and "stack" at each decode batch size, under ``ses.attempt``."""
    for depth in ("layer", "stack"):
        for batch in ses.sizes.decode_batches:
            entry_id = f"{ses.port}/decode/{depth}/B={batch}"
            if not ses.wanted(entry_id):
                continue
            with ses.attempt([entry_id], section="decode", case=depth):
                measure(depth, batch, entry_id)


class Session:
    """What a port's sections need: sizes, the results file, this run's index and environment."""

    def __init__(
        self,
        *,
        port: str,
        sizes: Sizes,
        results: Results,
        run: int,
        env: dict[str, Any],
        only: str | None = None,
        memory: bool = True,
        script: str = "",
    ) -> None:
        import re

        self.port, self.sizes, self.results, self.run, self.env = port, sizes, results, run, env
        self.only = re.compile(only) if only else None
        self._memory = memory
        self._memory_done = False
        self.script = script  # the bench_dropin.py path, for memory workers
        self.skipped = 0
        self.errors = 0

    @property
    def tiny(self) -> bool:
        return self.sizes.tiny

    @property
    def memory(self) -> bool:
        """Whether to measure peak memory now: always, unless ``--no-memory``; with
        ``--tiny`` only once per worker (it checks the subprocess path, not the numbers)."""
        if not self._memory or (self.tiny and self._memory_done):
            return False
        self._memory_done = True
        return True

    def todo(self, section: str, case: str, n: int, modes: Sequence[str]) -> dict[str, str]:
        """mode -> entry id (``port/section/case/mode/N=n``) of the ``modes`` still
        wanted (``wanted``), in the order given; empty when there is nothing to do."""
        ids = {mode: f"{self.port}/{section}/{case}/{mode}/N={n}" for mode in modes}
        return {mode: entry_id for mode, entry_id in ids.items() if self.wanted(entry_id)}

    def model_memory(
        self,
        kind: str,
        n: int,
        mode: str,
        method: str,
        in_process: Callable[[str], dict[str, Any]] | None = None,
        also: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The ``memory`` of a whole-model entry: the peak of one call of each model
        ("damcha", "mha", and the baselines in ``also``, each compared with DAMCHA
        under ``also``), each in a fresh ``--memory-worker`` process.

        Args:
            kind, n, mode: the entry's model, length and mode (the worker's arguments).
            method: how the worker measures, in words (recorded).
            in_process: optional ``impl -> {"peak_mib": ...}`` run in this process
                for the MHA model instead of a worker (``--tiny``: only one worker
                process checks the subprocess path).
        """
        peaks = {}
        for impl in ("damcha", "mha", *also):
            if in_process is not None and impl != "damcha":
                peaks[impl] = in_process(impl)["peak_mib"]
            else:
                argv = [self.script, "--memory-worker", self.port, kind, impl, str(n), mode]
                peaks[impl] = peak_in_subprocess(argv + (["--tiny"] if self.tiny else []))["peak_mib"]
        record = {"method": method, **memory_comparison({k: peaks[k] for k in ("damcha", "mha")}, "damcha", "mha")}
        if also:
            record["mib"] = dict(peaks)
            record["also"] = {impl: memory_comparison(peaks, "damcha", impl) for impl in also}
        return record

    def record_timed(
        self,
        entry_id: str,
        section: str,
        case: str,
        mode: str,
        n: int,
        *,
        call: str,
        baseline: str,
        times: Mapping[str, Mapping[str, list[float]]],
        check: dict[str, Any],
        memory: str | None = None,
        in_process: Callable[[str], dict[str, Any]] | None = None,
        memory_in_process: Callable[[], dict[str, Any]] | None = None,
        also: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Record a layer or whole-model entry at length ``n``, timed against MHA (a model
        entry's ``case`` is its kind, "encoder" or "lm"). With ``memory`` (how the memory
        workers measure, in words), also the models' peaks (``model_memory``) when memory
        is measured now; with ``memory_in_process`` instead, the ``memory`` record that
        function returns (a port whose memory is not a resident set: XLA's estimate).
        ``also``: (label, implementation) of further baselines timed in ``times``,
        each compared with DAMCHA against the same target (and, with ``memory``,
        measured by the memory workers too)."""
        shape = self.sizes.model_shape(n, case) if section == "model" else self.sizes.layer_shape(n)
        record = entry(
            entry_id,
            section,
            case,
            mode,
            shape=shape,
            call=call,
            baseline=baseline,
            times=times,
            check=check,
            comparisons=[comparison("time", times, "damcha", "mha", time_target(n))]
            + [comparison(label, times, "damcha", impl, time_target(n)) for label, impl in also],
        )
        if memory is not None and self.memory:
            record["memory"] = self.model_memory(case, n, mode, memory, in_process, also=[i for _, i in also])
        elif memory_in_process is not None and self.memory:
            record["memory"] = memory_in_process()
        self.record(record)

    def wanted(self, entry_id: str) -> bool:
        """False when ``--only`` excludes the entry or the file already has it (resume;
        an entry that failed with an error is tried again)."""
        if self.only is not None and not self.only.search(entry_id):
            return False
        if self.results.has(entry_id) and "error" not in self.results.data["entries"][entry_id]:
            self.skipped += 1
            print(f"  {entry_id}: already in {self.results.path.name}, skipped", flush=True)
            return False
        return True

    @contextlib.contextmanager
    def attempt(self, ids: Sequence[str], **info: Any) -> Iterator[None]:
        """Run the measurements of ``ids``; if one raises, record an error entry for each id
        not yet measured and go on with the next ones. A DAMCHA port that cannot run a call
        pattern shows as an error in the table instead of stopping the whole run."""
        before = {i: self.results.data["entries"].get(i) for i in ids}
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported, recorded, and the run goes on
            traceback.print_exc()
            from damcha_core import DamchaError

            message = f"{type(exc).__name__}: {_short(exc)}"
            # A DamchaError is the port refusing the call pattern (a gap to report); anything
            # else is a bug of the benchmark or of a framework (tests/test_benchmarks_quick.py
            # fails on those).
            kind = "damcha" if isinstance(exc, DamchaError) else "other"
            for i in ids:
                current = self.results.data["entries"].get(i)
                if current is None or current == before[i]:
                    self.record({"id": i, **info, "error": message, "error_kind": kind})
            self.errors += 1

    def record(self, entry: dict[str, Any]) -> None:
        entry.setdefault("port", self.port)
        entry["run"] = self.run
        entry["env"] = self.env
        entry["finished"] = now()
        entry["loadavg"] = loadavg()
        self.results.add(entry)
        parts = []
        for c in entry.get("comparisons", []):
            r = c["ratio"]
            flag = "" if c.get("met") is None else ("  ok" if c["met"] else "  MISSED")
            parts.append(
                f"{c['label']} {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"
                + (f" target {c['target']:.2f}" if c.get("target") else "")
                + flag
            )
        if "error" in entry:
            parts.append("ERROR " + entry["error"][:200])
        check = entry.get("check")
        if check and not check.get("ok", True):
            parts.append(f"CHECK FAILED (rel diff {check.get('max_rel_diff')})")
        print(f"  {entry['id']}: " + "; ".join(parts), flush=True)


def entry(
    entry_id: str,
    section: str,
    case: str,
    mode: str,
    *,
    shape: dict[str, Any],
    call: str,
    baseline: str,
    times: Mapping[str, Mapping[str, list[float]]],
    check: dict[str, Any],
    comparisons: list[dict[str, Any]],
    **more: Any,
) -> dict[str, Any]:
    """One result entry, its fields in the order of the JSON file; ``more`` (e.g.
    ``unit``, compile statistics) stands between ``baseline`` and ``times``."""
    return {
        "id": entry_id,
        "section": section,
        "case": case,
        "mode": mode,
        "shape": shape,
        "call": call,
        "baseline": baseline,
        **more,
        "times": times,
        "check": check,
        "comparisons": comparisons,
    }


def decode_entry(
    entry_id: str,
    depth: str,
    batch: int,
    sizes: Sizes,
    *,
    call: str,
    baseline: str,
    times: Mapping[str, Mapping[str, list[float]]],
    check: dict[str, Any],
    comparisons: list[dict[str, Any]],
    **more: Any,
) -> dict[str, Any]:
    """A decode entry (``depth`` "layer" or "stack") at batch size ``batch``, timed per token."""
    return entry(
        entry_id,
        "decode",
        depth,
        f"B={batch}",
        shape=sizes.decode_shape(batch, depth),
        call=call,
        baseline=baseline,
        unit="per token",
        **more,
        times=times,
        check=check,
        comparisons=comparisons,
    )


def comparison(
    label: str, times: Mapping[str, Mapping[str, list[float]]], num: str, den: str, target: float | None
) -> dict[str, Any]:
    """One ratio num/den of an entry, with its target (None: informative only)."""
    s = summary(times, num, den)
    met = None if target is None else bool(s["ratio"]["median"] <= target)
    return {"label": label, "num": num, "den": den, "target": target, "met": met, **s}


def memory_comparison(
    peaks: Mapping[str, float], num: str, den: str, target: float | None = TARGET_MEMORY
) -> dict[str, Any]:
    ratio = peaks[num] / peaks[den] if peaks[den] > 0 else None  # (tiny sizes can peak at 0 MiB)
    return {
        "mib": dict(peaks),
        "ratio": ratio,
        "target": target,
        "met": None if target is None or ratio is None else bool(ratio <= target),
    }


def write_report(rep: Any, paths: list[Path], docs: Path, results: Path, files: str, what: str) -> int:
    """Rewrite the section of ``docs`` that the report module ``rep`` writes (its
    ``result_files``, ``load``, ``render``, ``write_section``) from the result files
    ``paths`` (none: every one in ``results``, ``files`` naming them in the message),
    refusing --tiny runs (they measure nothing); ``what`` names the section. 0, or 2
    for files the report cannot take."""
    if not paths:
        paths = rep.result_files(results)
        if not paths:
            print(f"no {files} in {results}; writing the 'not yet measured' section", file=sys.stderr)
    try:
        runs, entries = rep.load(paths)
    except ValueError as exc:
        print(f"--report: {exc}", file=sys.stderr)
        return 2
    tiny = sorted({r["file"] for r in runs if r.get("tiny")})
    if tiny:
        print(f"refusing to write --tiny results into the docs (they measure nothing): {tiny}", file=sys.stderr)
        return 2
    rep.write_section(docs, rep.render(runs, entries))
    print(f"wrote the {what} section of {docs} from {len(entries)} entries ({len(paths)} files)")
    return 0
