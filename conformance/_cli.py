"""``damcha conform``: run the catalogue on every installed backend.

Each backend runs in its own subprocess: Keras fixes its backend at import
(one per process), and frameworks that bundle different OpenMP runtimes are
kept apart. A worker writes its report as JSON; the parent prints one table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ._cases import DECODE_CATALOGUE, GROUPS, catalogue
from ._runner import Report, run_conformance
from ._tolerances import DTYPES
from .adapters import BUILTIN, load_adapter

BACKENDS = [name for name, b in BUILTIN.items() if not b.on_request]
ON_REQUEST = [name for name, b in BUILTIN.items() if b.on_request]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="damcha conform", description=__doc__.splitlines()[0])
    p.add_argument("--backend", action="append", default=[], help=f"built-in backend, repeatable: {', '.join(BACKENDS)} (default: all); also "
                   f"{', '.join(ON_REQUEST)} on request")
    p.add_argument("--adapter", action="append", default=[], help="a third-party adapter as module:attr, repeatable")
    p.add_argument("--dtype", action="append", choices=DTYPES, help="dtypes to run (default: each adapter's own)")
    p.add_argument("--case", action="append", help="only these case names")
    p.add_argument("--group", action="append", choices=GROUPS, help="only these case groups")
    p.add_argument("--no-gradients", action="store_true", help="check outputs only")
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    p.add_argument("--export-vectors", metavar="DIR", help="write the catalogue as language-neutral test vectors and exit")
    p.add_argument("--require-all", action="store_true", default=os.environ.get("DAMCHA_REQUIRE_ALL_BACKENDS") == "1",
                   help="a backend that is not installed is a failure (default when DAMCHA_REQUIRE_ALL_BACKENDS=1)")
    p.add_argument("--in-process", action="store_true", help="run in this process (one backend or adapter only)")
    return p


def _filters(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, values in (("--dtype", args.dtype), ("--case", args.case), ("--group", args.group)):
        for v in values or ():
            out += [flag, v]
    if args.no_gradients:
        out.append("--no-gradients")
    return out


def _run_in_process(spec: str, args: argparse.Namespace) -> Report:
    adapter = load_adapter(spec)
    cases = catalogue(args.case, args.group)
    # The bad-input checks are the "errors" group: on unless the run is narrowed to other cases.
    errors = not args.case and (not args.group or "errors" in args.group)
    decoding = not args.case and (not args.group or "decode" in args.group)
    return run_conformance(adapter, cases, args.dtype, gradients=not args.no_gradients, errors=errors,
                           decoding=decoding)


def _run_subprocess(spec: str, args: argparse.Namespace, env_extra: dict[str, str]) -> Report:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        flag = "--backend" if spec in BUILTIN else "--adapter"
        cmd = [sys.executable, "-m", "damcha_conformance._cli", "--in-process", flag, spec, "--json", str(out)] + _filters(args)
        proc = subprocess.run(cmd, env={**os.environ, **env_extra}, capture_output=True, text=True)
        if out.exists():
            return Report.from_json(out.read_text())
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        return Report(notes=[f"FAIL {spec}: worker exited {proc.returncode}: " + " | ".join(tail)])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.export_vectors:
        from ._vectors import export_vectors

        with_decode = not args.case and (not args.group or "decode" in args.group)
        paths = export_vectors(args.export_vectors, catalogue(args.case, args.group),
                               DECODE_CATALOGUE if with_decode else ())
        print(f"wrote {len(paths)} cases to {args.export_vectors} (index.json describes the format)")
        return 0
    specs = list(args.backend) + list(args.adapter)
    if args.in_process:
        if len(specs) != 1:
            raise SystemExit("damcha conform --in-process runs exactly one --backend or --adapter")
        report = _run_in_process(specs[0], args)
    else:
        report = Report()
        for spec in specs or list(BACKENDS):
            builtin = BUILTIN.get(spec)
            missing = builtin.missing() if builtin else []
            if missing:
                verdict = "FAIL" if args.require_all else "skipped"
                report.notes.append(f"{verdict} {spec}: {', '.join(missing)} not installed")
                continue
            env_extra = dict(builtin.env) if builtin else {}
            if spec == "torch-cuda" and not importlib.import_module("torch").cuda.is_available():
                report.notes.append(f"FAIL {spec}: asked for, but torch sees no CUDA device")
                continue
            print(f"running {spec} ...", file=sys.stderr, flush=True)
            report.extend(_run_subprocess(spec, args, env_extra))
    if args.json:
        Path(args.json).write_text(report.to_json())
    if not args.in_process:
        print(report.summary())
        print("PASSED" if report.passed else "FAILED")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
