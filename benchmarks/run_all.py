"""Run every benchmark script in turn (`make bench`), each in its own process.

    .venv/bin/python benchmarks/run_all.py            # the real sizes: hours; run on an idle machine
    .venv/bin/python benchmarks/run_all.py --quick    # every script at tiny sizes: checks, measures nothing
    .venv/bin/python benchmarks/run_all.py --only bench_dropin.py

Every ``benchmarks/bench_*.py`` is run (a new script joins by existing; each
must accept ``--tiny``). Each writes its JSON results to ``benchmarks/results/``
(``<name>-<date>-<time>.json``: the machine, versions, thread count, command
line, commit, load average and every raw timing) and rewrites its own
section of docs/benchmarks.md from them, with the command, date, machine and
load of the run above each table; ``--report`` rewrites a section from the
stored files without measuring. ``bench_dropin.py``, ``bench_models.py`` and
``bench_models_keras.py`` pool every run of the same commit found there (so
running ``make bench`` twice on unchanged code reports both runs' rounds);
the per-port scripts (``bench_torch.py``, ``bench_decode.py``,
``bench_jax.py``, ``bench_keras.py``, ``bench_onnx.py``, ``bench_headmix.py``:
``_ports_report.py``) table their newest run. With ``--quick`` nothing is
written to either place. Run on an otherwise idle machine: the ratios are
robust to a steady load, not to a fluctuating one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Quick checks first, the long drop-in run last; scripts not listed run before it, by name.
ORDER = [
    "bench_torch.py",
    "bench_decode.py",
    "bench_jax.py",
    "bench_keras.py",
    "bench_onnx.py",
    "bench_headmix.py",
    "bench_models.py",
    "bench_dropin.py",
]


def scripts() -> list[str]:
    """Every benchmark script in benchmarks/, in run order."""
    found = sorted(p.name for p in HERE.glob("bench_*.py"))
    first = [s for s in ORDER[:-1] if s in found]
    extra = [s for s in found if s not in ORDER]
    return first + extra + [s for s in ORDER[-1:] if s in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run each script with --tiny (a check, not a measurement)")
    parser.add_argument("--only", nargs="+", metavar="SCRIPT", help="run only these scripts")
    args = parser.parse_args(argv)
    todo = scripts()
    if args.only:
        unknown = sorted(set(args.only) - set(todo))
        if unknown:
            parser.error(f"unknown scripts {unknown}; known: {todo}")
        todo = [s for s in todo if s in args.only]
    failed = []
    for script in todo:
        print(f"\n## {script}\n", flush=True)
        start = time.perf_counter()
        cmd = [sys.executable, str(HERE / script)] + (["--tiny"] if args.quick else [])
        rc = subprocess.run(cmd).returncode
        print(f"\n({script}: exit {rc}, {time.perf_counter() - start:.0f} s)", flush=True)
        if rc:
            failed.append(script)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
