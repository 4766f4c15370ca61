"""``damcha conform``: run the catalogue on every installed backend.

Each backend runs in its own subprocess: Keras fixes its backend at import
(one per process), and frameworks that bundle different OpenMP runtimes are
kept apart. A worker streams its progress into a file of its own (never its
stdout, where an adapter may print anything) and writes its report as JSON;
the parent shows the progress, then prints one table and the verdict.

Exit status: 0 every backend checked everything asked for and passed;
1 a check failed, or the run was PARTIAL (something asked for was not
checked: a backend not installed, a dtype or gradients an adapter does not
have, unsupported cases); 2 bad arguments (nothing is run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from damcha_core import DamchaError
from damcha_core import _cliutil as cu

from ._adapter import BackendAdapter
from ._cases import (
    CATALOGUE,
    DECODE_CATALOGUE,
    ERROR_CATALOGUE,
    GROUPS,
    PENALTY_CASES,
    WEIGHTS_CASES,
    Case,
    catalogue,
)
from ._runner import Report, Result, check_adapter, run_conformance
from ._tolerances import DTYPES
from .adapters import BUILTIN, load_adapter

PROG = "damcha conform"
BACKENDS = [name for name, b in BUILTIN.items() if not b.on_request]
ON_REQUEST = [name for name, b in BUILTIN.items() if b.on_request]
# Worker -> parent: one JSON object per line ({"done", "total", "what", "result"}) in the file that
# --progress-file names. It was a "@damcha-progress" prefix on the worker's stdout, where an adapter
# printing a line that started so crashed the parent: nothing an adapter prints can reach this file.
_POLL_S = 0.05


def _parser() -> argparse.ArgumentParser:
    p = cu.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].splitlines()[0],
        epilog="Exit status: 0 passed, 1 failed or partial, 2 bad arguments.",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        choices=list(BUILTIN),
        metavar="NAME",
        help=f"built-in backend, repeatable: {', '.join(BACKENDS)} (default: all); also "
        f"{', '.join(ON_REQUEST)} on request",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="a third-party adapter as module:attr (class or factory called with no arguments, or an instance; "
        "checked before anything runs), repeatable",
    )
    p.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="only these dtypes (default: each adapter's own); a --backend or --adapter that declares none of "
        "them is a usage error",
    )
    p.add_argument(
        "--case", action="append", metavar="NAME", help="only these catalogue cases (--list-cases lists them)"
    )
    p.add_argument("--group", action="append", choices=GROUPS, help="only these case groups")
    p.add_argument("--no-gradients", action="store_true", help="check outputs only")
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="leave out the attention-weights checks (a port that returns no weights: narrowed, not a gap)",
    )
    p.add_argument(
        "--no-penalty",
        action="store_true",
        help="leave out the metric-penalty checks (a port that computes no penalty: narrowed, not a gap)",
    )
    p.add_argument(
        "--list-cases",
        action="store_true",
        help="print the cases of each group (the names --case and --group take) and exit; --case and --group "
        "narrow the list",
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    p.add_argument(
        "--export-vectors", metavar="DIR", help="write the catalogue as language-neutral test vectors and exit"
    )
    p.add_argument(
        "--require-all",
        action="store_true",
        default=os.environ.get("DAMCHA_REQUIRE_ALL_BACKENDS") == "1",
        help="a backend that is not installed is a failure, not only a gap "
        "(default when DAMCHA_REQUIRE_ALL_BACKENDS=1)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar: one line as each backend starts and one as it ends"
    )
    p.add_argument("--in-process", action="store_true", help="run in this process (one backend or adapter only)")
    p.add_argument("--progress-file", metavar="PATH", help=argparse.SUPPRESS)  # worker mode: _POLL_S's protocol
    p.add_argument("--probe-adapter", metavar="SPEC", help=argparse.SUPPRESS)  # build and check SPEC (_probe)
    return p


def _validate(args: argparse.Namespace) -> None:
    """Every argument, before any work: exit 2 with one line naming the flag."""
    known = {c.name for c in CATALOGUE}
    for name in args.case or ():
        if name not in known:
            cu.usage_error(
                "--case",
                f"unknown case {name!r}; expected catalogue case names (damcha conform --list-cases lists them), "
                f"e.g. {', '.join(sorted(known)[:3])}, ...",
                prog=PROG,
            )
    if args.case and args.group and not catalogue(args.case, args.group):
        groups = {c.name: c.group for c in CATALOGUE}
        cu.usage_error(
            "--group",
            f"selects none of the --case cases (each filter narrows the other): "
            f"{', '.join(f'{n} is in group {groups[n]!r}' for n in args.case)}. Received: --group "
            f"{' --group '.join(args.group)}",
            prog=PROG,
        )
    if args.list_cases:
        others = (
            ("--backend", args.backend),
            ("--adapter", args.adapter),
            ("--dtype", args.dtype),
            ("--no-gradients", args.no_gradients),
            ("--no-weights", args.no_weights),
            ("--no-penalty", args.no_penalty),
            ("--json", args.json is not None),
            ("--export-vectors", args.export_vectors is not None),
            ("--in-process", args.in_process),
        )
        received = [flag for flag, given in others if given]
        if received:
            cu.usage_error(
                "--list-cases",
                "prints the catalogue and runs nothing; of the options that choose what runs it takes only --case "
                "and --group, which narrow the list. "
                f"Received: {' '.join(received)}",
                prog=PROG,
            )
        return
    if args.json is not None:
        cu.check_output_file(args.json, "--json", prog=PROG)
    if args.export_vectors is not None:
        cu.check_output_dir(args.export_vectors, "--export-vectors", prog=PROG)
        run_options = (args.backend, args.adapter, args.dtype, args.no_gradients, args.no_weights, args.no_penalty)
        if any(run_options) or args.json or args.in_process:
            cu.usage_error(
                "--export-vectors",
                "writes the catalogue and runs nothing; of the options that choose what runs it takes only --case "
                "and --group (not --backend, --adapter, --dtype, --no-gradients, --no-weights, --no-penalty, "
                "--json or --in-process)",
                prog=PROG,
            )
        return
    for flag, group in (("--no-weights", "weights"), ("--no-penalty", "penalty")):
        if getattr(args, flag[2:].replace("-", "_")) and args.group and group in args.group:
            cu.usage_error(
                flag,
                f"leaves out the {group!r} group, which --group asks for. Received: --group "
                f"{' --group '.join(args.group)} {flag}",
                prog=PROG,
            )
    if args.in_process and len(args.backend) + len(args.adapter) != 1:
        cu.usage_error(
            "--in-process",
            f"runs exactly one --backend or --adapter. Received: {len(args.backend) + len(args.adapter)}",
            prog=PROG,
        )
    for name in args.backend:
        builtin = BUILTIN[name]
        missing = builtin.missing()
        if missing:
            cu.usage_error(
                "--backend",
                f"{name} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
                f"{cu.install_hint(missing[0], builtin.extra)}",
                prog=PROG,
            )
    if "torch-cuda" in args.backend and not importlib.import_module("torch").cuda.is_available():
        cu.usage_error("--backend", "torch-cuda was asked for, but torch sees no CUDA device", prog=PROG)
    for name in args.backend:
        _refuse_dtypes(f"--backend {name}", BUILTIN[name].dtypes, args.dtype)
        _refuse_groups(name, args.group)
    for spec in args.adapter:
        module_name, sep, attr = spec.partition(":")
        if not (sep and module_name and attr):
            cu.usage_error("--adapter", f"expected module:attr naming an adapter. Received: {spec!r}", prog=PROG)
        if not cu.available(module_name):
            cu.usage_error(
                "--adapter",
                f"module {module_name!r} cannot be found (is it on PYTHONPATH?). Received: {spec!r}",
                prog=PROG,
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - the user's module failed to import: say why, in one line
            cu.usage_error("--adapter", f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", prog=PROG)
        if not hasattr(module, attr):
            cu.usage_error(
                "--adapter", f"module {module_name!r} has no attribute {attr!r}. Received: {spec!r}", prog=PROG
            )
        problem = _not_an_adapter(getattr(module, attr))
        if problem is not None:
            cu.usage_error("--adapter", f"{spec} is not a conformance adapter: {problem}", prog=PROG)
    if args.json is not None:  # after the --adapter modules were imported above
        _check_not_a_source(args.json)
    if not args.in_process:  # in-process, _main builds the adapter itself and refuses it the same way
        # The report keys results by the adapter's name: two adapters with one name would share a row.
        names = {b: f"--backend {b}" for b in args.backend}  # a built-in backend reports as its own name
        for spec in dict.fromkeys(args.adapter):
            name, dtypes = _probe(spec)
            _refuse_dtypes(f"--adapter {spec}", dtypes, args.dtype)
            if name in names:
                cu.usage_error(
                    "--adapter",
                    f"{spec} reports as {name!r}, as {names[name]} does: their results would be merged into one "
                    "row; give each adapter a name of its own (its name attribute)",
                    prog=PROG,
                )
            names[name] = spec


def _case_line(case: Case) -> str:
    """One catalogue case in a line: its sizes, metric and inputs."""
    cfg = case.config
    what = [f"B={case.batch} N={case.query_len}"]
    what.append("self-attention" if case.context_len is None else f"cross-attention M={case.context_len}")
    what.append(f"E={cfg.query_dim} H={cfg.num_heads}")
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        what.append(f"kv heads {cfg.num_kv_heads}")
    what.append(f"metric {cfg.metric}" + ("" if cfg.metric == "none" else f", coupling {cfg.coupling}"))
    if case.mask is not None:
        what.append(f"mask {case.mask}")
    if case.causal:
        what.append("causal")
    if case.inputs is not None:
        what.append(f"inputs {case.inputs}")
    if case.dtypes is not None:
        what.append("only " + ", ".join(case.dtypes))
    if not case.gradients:
        what.append("outputs only")
    return ", ".join(what)


def list_cases(names: Sequence[str] | None = None, groups: Sequence[str] | None = None) -> str:
    """What ``damcha conform --list-cases`` prints: each group's cases, one per line,
    narrowed as ``--case`` and ``--group`` narrow a run (a run given ``--case`` checks
    those catalogue cases only: no decoding, weights, penalty or bad-input checks)."""
    # One column width for the catalogue's blocks (they read as one table); the others their own.
    width = max(len(c.name) for c in CATALOGUE)
    blocks = []
    for group in dict.fromkeys(groups or GROUPS):
        if group == "decode":
            head, rows = (
                "cached decoding: a prefix, then new tokens",
                [
                    (
                        c.name,
                        f"B={c.batch}, {c.prefix_len} + {c.new_len} tokens, E={c.config.query_dim} "
                        f"H={c.config.num_heads}, metric {c.config.metric}, coupling {c.config.coupling}",
                    )
                    for c in DECODE_CATALOGUE
                ],
            )
        elif group == "errors":
            head, rows = (
                "bad input: a valid case with one input corrupted; the error must name the argument",
                [(c.name, f"{c.corruption} of {c.base.name}") for c in ERROR_CATALOGUE],
            )
        elif group in ("weights", "penalty"):
            picked = WEIGHTS_CASES if group == "weights" else PENALTY_CASES
            head = "attention weights" if group == "weights" else "metric penalty"
            head, rows = f"the {head} checked on these cases", [(c.name, f"group {c.group}") for c in picked]
        else:
            head, rows = "", [(c.name, _case_line(c)) for c in catalogue(list(names or ()), [group])]
        if names and group in ("decode", "errors", "weights", "penalty"):
            continue  # --case runs the catalogue cases named, and none of these checks
        if rows:
            title = f"{group} ({len(rows)}{', ' + head if head else ''}):"
            w = max(width, *(len(name) for name, _ in rows))
            blocks.append("\n".join([title, *(f"  {name:<{w}}  {text}" for name, text in rows)]))
    lead = (
        f"{len(CATALOGUE)} catalogue cases in {len(GROUPS) - 4} groups (--case takes their names), and the "
        "groups decode, weights, penalty and errors (--group takes every group's name):"
    )
    return "\n\n".join([lead, *blocks])


def _check_not_a_source(path: str) -> None:
    """Exit 2 when ``--json`` names the source file of a module this process has imported: an
    ``--adapter``'s own module (``--json myport.py`` replaced the port's code with the report), or
    any other, as ``damcha export`` refuses an output that is one of its inputs. Compared by device
    and inode (``os.path.samefile``), so ``./m.py``, an absolute path and a link are the same."""
    try:
        written = os.stat(path)
    except (OSError, ValueError):
        return  # no file there yet: nothing of anyone's to replace
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None)
        if not isinstance(source, str):
            continue
        try:
            same = os.path.samestat(written, os.stat(source))
        except (OSError, ValueError):
            continue
        if same:
            cu.usage_error(
                "--json",
                f"would overwrite {source!r}, the source of the module {name!r} (imported to run the adapters); "
                f"expected a path other than a module's file. Received: --json {path!r}",
                prog=PROG,
            )


_NAME = "@damcha-adapter-name"  # probe -> parent: the name the adapter reports as
_DTYPES = "@damcha-adapter-dtypes"  # probe -> parent: the dtypes it declares, comma-separated


def _refuse_groups(name: str, asked: Sequence[str] | None) -> None:
    """Exit 2 when every ``--group`` asked for is one the built-in backend ``name`` declares it
    cannot have (``--backend onnxruntime --group penalty``: an inference graph computes no
    training loss), as for ``--dtype``: the run would check nothing and print FAILED."""
    limits = BUILTIN[name].limits
    if asked and all(group in limits for group in asked):
        why = "; ".join(f"{group}: {limits[group]}" for group in dict.fromkeys(asked))
        cu.usage_error(
            "--group",
            f"--backend {name} cannot have the checks asked for ({why}). "
            f"Received: --group {' --group '.join(dict.fromkeys(asked))}",
            prog=PROG,
        )


def _refuse_dtypes(what: str, declared: Sequence[str], asked: Sequence[str] | None) -> None:
    """Exit 2 when ``--dtype`` leaves the backend or adapter ``what`` nothing to run: it declares
    none of the dtypes asked for (``--backend reference --dtype float16`` used to run, check
    nothing and print FAILED). A selection it declares in part runs that part, and the rest is a
    gap (PARTIAL), as before."""
    if asked and not set(asked) & set(declared):
        cu.usage_error(
            "--dtype",
            f"{what} runs in {', '.join(declared)} only (the dtypes its adapter declares), none of the dtypes "
            f"asked for. Received: --dtype {' --dtype '.join(dict.fromkeys(asked))}",
            prog=PROG,
        )


def _probe(spec: str) -> tuple[str, list[str]]:
    """Build the adapter ``spec`` in a short process of its own and check what it is, before any
    backend runs: a factory that raises, or returns something that is not an adapter, leaves
    nothing to check, so it is a usage error (exit 2), not a FAILED run. Built apart from this
    process for the reason the workers are (a constructor may import a framework, pick a Keras
    backend or take a GPU). Returns the name the adapter reports as and the dtypes it declares."""
    cmd = [sys.executable, "-m", "damcha_conformance._cli", "--probe-adapter", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    said_name = [line[len(_NAME) + 1 :] for line in proc.stdout.splitlines() if line.startswith(_NAME + " ")]
    said_dtypes = [line[len(_DTYPES) + 1 :] for line in proc.stdout.splitlines() if line.startswith(_DTYPES + " ")]
    if proc.returncode == 0 and said_name and said_dtypes:
        return said_name[-1], said_dtypes[-1].split(",")
    head = f"{PROG}: error: --adapter: "
    said = [line for line in proc.stderr.splitlines() if line.startswith(head)]
    if proc.returncode == cu.EXIT_USAGE and said:
        cu.usage_error("--adapter", said[-1][len(head) :], prog=PROG)
    # A constructor that calls sys.exit() or is killed may print nothing: say so, not ": ".
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or "it printed nothing (sys.exit() or a signal?)"
    cu.usage_error("--adapter", f"building {spec} ended its process with exit {proc.returncode}: {tail}", prog=PROG)


def _not_an_adapter(obj: object) -> str | None:
    """Why ``obj`` (what ``module:attr`` names) cannot be an adapter, or None when it may be.

    Checked without building it: the adapter is built in its worker (a constructor may import a
    framework or pick a Keras backend). An instance gets ``check_adapter``'s full check; a class
    must define ``unsupported`` and ``forward`` and be callable with no arguments, as
    ``load_adapter`` calls it; a factory must be callable with no arguments (what it returns is
    checked in the worker)."""
    if not callable(obj):  # load_adapter calls what is callable, takes the rest as the adapter
        try:
            check_adapter(obj)
        except DamchaError as exc:
            return str(exc)
        return None
    if isinstance(obj, type):
        lacks = [m for m in ("unsupported", "forward") if not callable(getattr(obj, m, None))]
        if lacks:
            return (
                f"class {obj.__module__}.{obj.__qualname__} has no method {' or '.join(lacks)} (an adapter has "
                "name, dtypes, supports_gradients, unsupported(case) and forward(data, dtype); see "
                "damcha_conformance.BackendAdapter)"
            )
        dtypes = getattr(obj, "dtypes", None)
        if isinstance(dtypes, (str, bytes)):
            return f"its dtypes is one string {dtypes!r}; expected a sequence of dtype names, e.g. ('float64',)"
    try:
        inspect.signature(obj).bind()
    except ValueError:  # no signature to read (a builtin): left to the worker
        return None
    except TypeError as exc:
        name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
        return f"the adapter is built by calling {name}() with no arguments, which it refuses ({exc})"
    return None


def _filters(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, values in (("--dtype", args.dtype), ("--case", args.case), ("--group", args.group)):
        for v in values or ():
            out += [flag, v]
    for flag in ("--no-gradients", "--no-weights", "--no-penalty"):
        if getattr(args, flag[2:].replace("-", "_")):
            out.append(flag)
    return out


def _build_adapter(spec: str) -> BackendAdapter:
    """The third-party adapter ``spec``, or exit 2 with ``load_adapter``'s one line (it names the
    spec, what the factory raised or returned and what an adapter needs)."""
    try:
        return load_adapter(spec)
    except DamchaError as exc:
        cu.usage_error("--adapter", str(exc), prog=PROG)


def _run_in_process(spec: str, args: argparse.Namespace, adapter: BackendAdapter | None = None) -> Report:
    try:
        adapter = load_adapter(spec) if adapter is None else adapter
    except Exception as exc:  # noqa: BLE001 - a built-in adapter's constructor may raise anything
        return Report(notes=[f"FAIL {spec}: the adapter could not be built: {type(exc).__name__}: {exc}"])
    try:
        check_adapter(adapter)
    except DamchaError as exc:
        return Report(notes=[f"FAIL {spec}: not a usable adapter: {exc}"])
    cases = catalogue(args.case, args.group)
    # The bad-input checks are the "errors" group: on unless the run is narrowed to other cases;
    # likewise the decode, weights and penalty groups.
    errors, decoding, weights, penalty = (
        not args.case and (not args.group or group in args.group)
        for group in ("errors", "decode", "weights", "penalty")
    )
    limits = dict(BUILTIN[spec].limits) if spec in BUILTIN else {}
    gradients = not args.no_gradients and "gradients" not in limits
    weights = weights and not args.no_weights and "weights" not in limits
    penalty = penalty and not args.no_penalty and "penalty" not in limits

    bar = None
    stack = contextlib.ExitStack()
    channel = None
    if args.progress_file is not None:
        channel = stack.enter_context(open(args.progress_file, "a", encoding="utf-8"))  # noqa: SIM115 - closed below

    def progress(result: Result, done: int, total: int) -> None:
        nonlocal bar
        what = f"{result.dtype} {result.case} [{result.check}] {result.status}"
        if channel is not None:
            # The result rides along: a worker that dies later keeps it. ASCII (json.dumps escapes the
            # rest), so a line the parent reads in two parts never splits a character.
            line = {"done": done, "total": total, "what": what, "result": result.to_dict()}
            channel.write(json.dumps(line) + "\n")
            channel.flush()
            return
        if bar is None:
            bar = cu.Progress(total, adapter.name, enabled=not args.no_progress, every=5.0)
        bar.step(what, force=result.status in ("fail", "error"))

    try:
        report = run_conformance(
            adapter,
            cases,
            args.dtype,
            gradients=gradients,
            errors=errors,
            decoding=decoding,
            progress=progress,
            weights=weights,
            penalty=penalty,
        )
    finally:
        stack.close()
        if bar is not None:
            bar.close()
    # What the backend cannot have is said with its reason (the run left it out for that reason).
    reasons = {
        text: limits[key]
        for key, text in (
            ("gradients", "no gradients"),
            ("weights", "no attention weights"),
            ("penalty", "no metric penalty"),
        )
        if key in limits and not (key == "gradients" and args.no_gradients)
    }
    report.subset = [(b, f"{how}: {reasons[how]}" if how in reasons else how) for b, how in report.subset]
    return report


def _follow(path: Path, proc: subprocess.Popen[bytes]) -> Iterator[str]:
    """The complete lines appended to ``path`` while ``proc`` runs, as they arrive, then the rest
    (read after ``proc`` ended, so nothing it wrote is missed); a last line without its newline (a
    worker killed while writing it) is dropped."""
    pending = ""
    with open(path, encoding="utf-8", errors="replace") as stream:
        while True:
            ended = proc.poll() is not None
            chunk = stream.read()
            *lines, pending = (pending + chunk).split("\n")
            yield from lines
            if ended:
                return
            if not chunk:
                time.sleep(_POLL_S)


def _progress_line(line: str) -> tuple[int, str, Result | None] | None:
    """(checks planned, what was checked, its result) from one line of the worker's progress file,
    or None for a line that is not one (defensive: only the worker writes that file)."""
    try:
        item = json.loads(line)
        result = item.get("result")
        return int(item["total"]), str(item["what"]), None if result is None else Result(**result)
    except (ValueError, TypeError, KeyError):
        return None


def _run_subprocess(spec: str, args: argparse.Namespace, env_extra: dict[str, str]) -> Report:
    """One backend in a worker process, its progress shown as it streams in."""
    flag = "--backend" if spec in BUILTIN else "--adapter"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        channel = Path(tmp) / "progress.jsonl"
        channel.touch()
        cmd = [
            sys.executable,
            "-m",
            "damcha_conformance._cli",
            "--in-process",
            "--progress-file",
            str(channel),
            flag,
            spec,
            "--json",
            str(out),
        ] + _filters(args)
        bar: cu.Progress | None = None
        arrived: list[Result] = []
        total = 0
        with open(Path(tmp) / "stderr.txt", "w+") as err:
            # What an adapter prints is not shown (as before): the command's output is the report.
            proc = subprocess.Popen(cmd, env={**os.environ, **env_extra}, stdout=subprocess.DEVNULL, stderr=err)
            try:
                for line in _follow(channel, proc):
                    parsed = _progress_line(line)
                    if parsed is None:
                        continue
                    total, what, result = parsed
                    if result is not None:
                        arrived.append(result)
                    if bar is None:
                        bar = cu.Progress(total, spec, enabled=not args.no_progress, every=5.0)
                    bar.total = total
                    bar.step(what, force=what.endswith((" fail", " error")))
                returncode = proc.wait()
            finally:
                # Interrupted here (Ctrl-C or SIGTERM to this process alone, not its group): the worker
                # must not outlive it, still computing and holding its temporary folder.
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                if bar is not None:
                    bar.close()
            err.seek(0)
            stderr = err.read()
        if out.exists():
            return Report.from_json(out.read_text())
        return Report(results=arrived, notes=[_died(spec, returncode, stderr, arrived, total)])


def _died(spec: str, returncode: int, stderr: str, arrived: list[Result], total: int) -> str:
    """The note of a worker that ended without its report (a crash in the
    backend's native code, os.abort(), sys.exit()): how it ended, the check it
    was running (the one after the last that arrived), and its stderr's tail.
    The results that arrived are kept in the report."""
    how = f"exit status {returncode}"
    if returncode < 0:
        try:
            how = f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"signal {-returncode}"
    if arrived:
        last = arrived[-1]
        where = (
            f"after {len(arrived)} of {total} checks, in the check after "
            f"{last.dtype} {last.case} [{last.check}] (its results so far are kept)"
        )
    else:
        where = "before its first check finished"
    tail = stderr.strip().splitlines()[-8:]
    said = ": " + " | ".join(tail) if tail else " (nothing on stderr)"
    return f"FAIL {spec}: the worker ended without its report ({how}) {where}{said}"


# 128 + SIGTERM, what a shell reports for a process that SIGTERM ended.
EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(BaseException):
    """SIGTERM in the parent, raised where it was waiting so the ``finally``
    that terminates and reaps the worker runs, as it does for Ctrl-C. A
    BaseException like KeyboardInterrupt: no ``except Exception`` swallows it."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` for the duration (Python's default ends the
    parent at once, leaving its worker running). Only the main thread can set a
    handler; elsewhere (main() called from a thread) the default is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        # Once: a second SIGTERM must not break off the cleanup the first one started.
        if not fired:
            fired.append(signum)
            raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (usage errors too: 2; 143 when
    SIGTERM ended it, after its worker was terminated and reaped)."""
    try:
        return cu.run_main(_main, argv)
    except _Terminated:
        print(f"{PROG}: terminated", file=sys.stderr, flush=True)
        return EXIT_TERMINATED


def _run_backends(specs: list[str], args: argparse.Namespace, report: Report, timings: list[str]) -> None:
    """Each backend in its worker process, in turn; parts and timings go into ``report`` and ``timings``."""
    for spec in specs or BACKENDS:
        builtin = BUILTIN.get(spec)
        missing = builtin.missing() if builtin else []
        if missing:  # only in the default run: an explicit --backend was checked in _validate
            hint = cu.install_hint(missing[0], builtin.extra if builtin else None)
            if args.require_all:
                report.notes.append(f"FAIL {spec}: {', '.join(missing)} not installed ({hint})")
            else:
                report.gaps.append((spec, f"{', '.join(missing)} not installed ({hint})"))
            continue
        start = time.perf_counter()
        if args.no_progress:
            print(f"running {spec} ...", file=sys.stderr, flush=True)
        part = _run_subprocess(spec, args, dict(builtin.env) if builtin else {})
        elapsed = time.perf_counter() - start
        timings.append(f"{spec} {elapsed:.0f} s")
        print(
            f"{spec}: {sum(r.status != 'unsupported' for r in part.results)} checks in {elapsed:.1f} s: {part.verdict}",
            file=sys.stderr,
            flush=True,
        )
        report.extend(part)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.probe_adapter is not None:
        probed = _build_adapter(args.probe_adapter)
        print(_NAME, probed.name, flush=True)
        print(_DTYPES, ",".join(probed.dtypes), flush=True)
        return 0
    with _sigterm_raises():  # the probes of _validate build third-party adapters in processes of their own
        _validate(args)
    if args.list_cases:
        print(list_cases(args.case, args.group))
        return 0
    if args.export_vectors is not None:
        from ._vectors import export_vectors, vector_files

        with_decode = not args.case and (not args.group or "decode" in args.group)
        with_errors = not args.case and (not args.group or "errors" in args.group)
        earlier = vector_files(args.export_vectors)
        try:
            with cu.atomic_dir(args.export_vectors) as tmp:
                paths = export_vectors(
                    tmp,
                    catalogue(args.case, args.group),
                    DECODE_CATALOGUE if with_decode else (),
                    ERROR_CATALOGUE if with_errors else (),
                )
        except OSError as exc:  # a full disk, a folder removed meanwhile: the target folder is as it was
            print(f"{PROG}: error: --export-vectors: could not write {args.export_vectors!r}: {exc}", file=sys.stderr)
            return cu.EXIT_USAGE
        # An earlier export's cases that this one does not hold: a runner that globs the folder
        # would read them beside an index that does not list them. Only files that index named go.
        for stale in sorted(earlier - vector_files(args.export_vectors)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        print(f"wrote {len(paths)} cases to {args.export_vectors} (index.json describes the format)")
        return 0
    specs = list(dict.fromkeys(list(args.backend) + list(args.adapter)))
    if args.in_process:
        adapter = _build_adapter(specs[0]) if specs[0] in args.adapter else None
        if adapter is not None:
            _refuse_dtypes(f"--adapter {specs[0]}", list(adapter.dtypes), args.dtype)
        report = _run_in_process(specs[0], args, adapter)
    else:
        report = Report()
        timings: list[str] = []
        with _sigterm_raises():  # the parent of the workers (a worker keeps SIGTERM's default: it ends at once)
            _run_backends(specs, args, report, timings)
        if timings:
            report.notes.append("time per backend: " + ", ".join(timings))
    if args.json is not None:
        try:
            cu.atomic_write_text(args.json, report.to_json())
        except OSError as exc:  # the folder vanished or filled up during the run
            print(f"{PROG}: error: --json: could not write {args.json!r}: {exc}", file=sys.stderr)
            return cu.EXIT_USAGE
    if not args.in_process or args.progress_file is None:
        print(report.summary())
        print(report.verdict_line())
    return 0 if report.conformant else 1


if __name__ == "__main__":
    sys.exit(main())
