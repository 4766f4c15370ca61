"""Drop-in speed (issue 12): the calls users already write, DAMCHA vs their framework's MHA.

    .venv/bin/python benchmarks/bench_dropin.py                      # everything (hours; idle machine)
    .venv/bin/python benchmarks/bench_dropin.py --port torch --section decode
    .venv/bin/python benchmarks/bench_dropin.py --resume benchmarks/results/dropin-<stamp>.json
    .venv/bin/python benchmarks/bench_dropin.py --tiny              # checks the script in ~a minute
    .venv/bin/python benchmarks/bench_dropin.py --report [FILE...]  # rewrite the docs section only

Ports (``--port``, repeatable): ``torch``, ``jax`` (Flax NNX), ``keras`` (=
``keras-tensorflow``, ``keras-jax``, ``keras-torch``). Sections
(``--section``, repeatable): ``layer`` (the attention calls of issue 12 at
N in {256, 1024, 4096}), ``decode`` (greedy decoding with a KV cache, B=1
and 8, one layer and a 4-block LM, 512-token prompt + 32 steps, per token),
``model`` (a 6-layer encoder and a 6-layer causal LM: one training step and
one inference pass, time and peak memory). ``--only REGEX`` keeps the
entries whose id matches (ids look like ``torch/layer/mask+hint/fwd+bwd/N=1024``).

Each port runs in its own worker process (Keras picks its backend per
process; thread pools of other frameworks stay out of the timings), pinned
to ``--threads`` cores. Every measurement is written to the JSON file as
soon as it is done (machine, versions, threads, command line, every raw
timing); ``--resume FILE`` continues a run, skipping what the file has.
After a full run (not ``--tiny``) the "Drop-in speed" section of
docs/benchmarks.md is rewritten from the file, with the command of each
table and the issue-12 target beside each ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402  (benchmarks/ on sys.path first)

PORTS = ("torch", "jax", "keras-tensorflow", "keras-jax", "keras-torch")
SECTIONS = ("layer", "decode", "model")
RESULTS = HERE / "results"
DOCS = h.REPO / "docs" / "benchmarks.md"


def _expand_ports(given: list[str] | None) -> list[str]:
    if not given:
        return list(PORTS)
    out: list[str] = []
    for p in given:
        for q in [x for x in PORTS if x.startswith("keras-")] if p == "keras" else [p]:
            if q not in out:
                out.append(q)
    return out


def _module(port: str):
    if port == "torch":
        import _dropin_torch as mod
    elif port == "jax":
        import _dropin_jax as mod
    else:
        import _dropin_keras as mod
    return mod


def _port_env(port: str) -> dict[str, str]:
    env = dict(os.environ)
    if port.startswith("keras-"):
        env["KERAS_BACKEND"] = port.split("-", 1)[1]
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--port", action="append", choices=PORTS + ("keras",), help="repeatable; default all")
    p.add_argument("--section", action="append", choices=SECTIONS, help="repeatable; default all")
    p.add_argument("--only", metavar="REGEX", help="measure only the entries whose id matches")
    p.add_argument("--tiny", action="store_true", help="tiny sizes, 2 rounds: checks the script, measures nothing")
    p.add_argument("--lengths", type=int, nargs="+", help="override the sequence lengths (layer and model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) per process")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses of whole models")
    p.add_argument(
        "--json",
        type=Path,
        help="results file (default benchmarks/results/dropin-<time>.json; --tiny: a temporary file)",
    )
    p.add_argument("--resume", type=Path, metavar="FILE", help="continue FILE, skipping the entries it has")
    p.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file whose drop-in section is rewritten")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite the docs section after the run")
    p.add_argument(
        "--report",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="only rewrite the docs section from these result files (default: those the section lists, else the newest)",
    )
    # Internal: one port's worker, and one peak-memory measurement in a fresh process.
    p.add_argument("--worker", choices=PORTS, help=argparse.SUPPRESS)
    p.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--memory-worker", nargs=5, metavar=("PORT", "KIND", "IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    return p


def _command(argv: list[str]) -> str:
    return shlex.join([".venv/bin/python", "benchmarks/bench_dropin.py", *argv])


def report(paths: list[Path], docs: Path, *, allow_tiny: bool = False) -> int:
    import _dropin_report as rep

    if not paths:
        # The files the section was written from: it pools many runs (ports, sections, machines),
        # and the newest file alone rewrote it as that one run's few rows.
        paths = rep.listed_files(docs)
        if not paths:
            found = sorted(RESULTS.glob("dropin-*.json"))
            if not found:
                print(f"no results in {RESULTS}; writing the 'not yet measured' section", file=sys.stderr)
            paths = found[-1:]
    runs, entries = rep.load(paths)
    if not allow_tiny and any(r.get("tiny") for r in runs):
        print("refusing to write --tiny results into the docs (they measure nothing)", file=sys.stderr)
        return 2
    rep.write_section(docs, rep.render(runs, entries))
    print(f"wrote the drop-in section of {docs} from {len(entries)} entries ({', '.join(map(str, paths))})")
    return 0


def worker(args: argparse.Namespace, path: Path) -> int:
    threads = h.fix_threads(args.threads)  # before any framework is imported
    mod = _module(args.worker)
    env = {"port": args.worker, **threads, **mod.setup(args.threads), "versions": h.versions(), "pid": os.getpid()}
    sizes = h.Sizes(args.tiny, args.lengths)
    results = h.Results(path, resume=True)
    ses = h.Session(
        port=args.worker,
        sizes=sizes,
        results=results,
        run=args.run_index,
        env=env,
        only=args.only,
        memory=not args.no_memory,
        script=str(Path(__file__).resolve()),
    )
    failed = []
    for section in args.section or SECTIONS:
        print(f"## {args.worker} / {section}", flush=True)
        try:
            mod.SECTIONS[section](ses)
        except Exception:  # noqa: BLE001 - one broken section must not cost the others
            traceback.print_exc()
            failed.append(section)
    if failed:
        print(f"{args.worker}: failed sections {failed}", file=sys.stderr)
    return 1 if failed else 0


def memory_worker(args: argparse.Namespace) -> int:
    port, kind, impl, n, mode = args.memory_worker
    h.fix_threads(args.threads)
    mod = _module(port)
    mod.setup(args.threads)
    print(json.dumps(mod.memory_worker(kind, impl, int(n), mode, h.Sizes(args.tiny, args.lengths))))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.memory_worker:
        return memory_worker(args)
    if args.report is not None:
        return report(list(args.report), args.docs)
    if args.resume and args.json and args.resume != args.json:
        print("give --resume FILE or --json FILE, not both", file=sys.stderr)
        return 2
    if args.resume:
        if not args.resume.exists():
            print(f"--resume: no such file {args.resume}", file=sys.stderr)
            return 2
        path = args.resume
    elif args.json:
        path = args.json
    elif args.tiny:
        path = Path(tempfile.gettempdir()) / f"damcha-dropin-tiny-{os.getpid()}.json"
    else:
        path = RESULTS / f"dropin-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    if args.worker:
        return worker(args, path)
    if args.json and args.json.exists() and not args.resume:
        print(
            f"--json: {args.json} exists; continue it with --resume {args.json} or choose another file", file=sys.stderr
        )
        return 2

    results = h.Results(path, resume=bool(args.resume))
    ports = _expand_ports(args.port)
    run = results.start_run(
        {
            "command": _command(argv),
            "argv": argv,
            "started": h.now(),
            "tiny": args.tiny,
            "threads": args.threads,
            "ports": ports,
            "sections": args.section or list(SECTIONS),
            "sizes": h.Sizes(args.tiny, args.lengths).as_dict(),
            "machine": h.machine(),
            "versions": h.versions(),
            "git": h.git_commit(),
            "git_dirty": h.git_dirty_files(),
            "loadavg_start": h.loadavg(),
        }
    )
    print(f"results: {path}", flush=True)
    # Re-pass the options a worker needs; the file and the run index are always explicit.
    common = ["--threads", str(args.threads), "--run-index", str(run), "--json", str(path)]
    for section in args.section or []:
        common += ["--section", section]
    if args.only:
        common += ["--only", args.only]
    if args.tiny:
        common.append("--tiny")
    if args.no_memory:
        common.append("--no-memory")
    if args.lengths:
        common += ["--lengths", *map(str, args.lengths)]
    failed = []
    for port in ports:
        print(f"\n# {port}", flush=True)
        rc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", port, *common], env=_port_env(port)
        ).returncode
        if rc:
            failed.append(port)
    results.update_run(run, finished=h.now(), loadavg_end=h.loadavg(), failed=failed)
    print(f"\nresults: {path}" + (f"; failed: {failed}" if failed else ""), flush=True)
    if not args.tiny and not args.no_docs:
        report([path], args.docs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
