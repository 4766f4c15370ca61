"""The per-port sections of docs/benchmarks.md, written from the port scripts' JSON result files.

bench_torch.py, bench_decode.py, bench_jax.py, bench_keras.py, bench_onnx.py and
bench_headmix.py each write one file per run, ``benchmarks/results/<name>-<date>-<time>.json``
(or ``--json FILE``; with ``--tiny`` a temporary file, removed at exit, unless ``--json``
is given), in ``_harness.Results``'s layout, rewritten after every entry:

    {"format": "damcha-bench-<name>/1",
     "runs": [{"command", "argv", "started", "tiny", "threads", <the script's settings>,
               "machine", "versions", "git", "loadavg_start", "finished", "loadavg_end"}],
     "entries": {id: {"id", "section", <what the row is>, "times": {impl: {"wall": [s, ...],
                      "cpu": [s, ...]}}, <memory readings>, "run", "finished", "loadavg"}}}

Every round's time and every memory reading that the script's table is computed from is
in the file, so each number of the doc can be recomputed from it. Each script owns one
or more blocks of the doc between marker comments (``BEGIN``/``END`` below, one pair per
block) and rewrites them from the newest result file that measured them, or from the
files given to ``--report`` (a table per run, under the run's command, date, machine,
load and file). Until a script's first run, its block holds an earlier table copied by
hand and marked as such; the first generated block replaces it, and nothing outside the
markers is touched (the hand-written reading of the numbers stays, dated).

Reading and refusing files is ``_dropin_report.load``'s, replacing a block between its
markers ``_dropin_report.write_section``'s, and refusing ``--tiny`` runs
``_harness.write_report``'s: the drop-in and model sections' machinery, not a copy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import _dropin_report as dr  # benchmarks/ is on sys.path
import _harness as h

RESULTS = h.REPO / "benchmarks" / "results"
DOCS = h.REPO / "docs" / "benchmarks.md"

# One run's lines of a block: (the run's record, its entries of the block) -> Markdown lines.
Table = Callable[[dict[str, Any], list[dict[str, Any]]], list[str]]


def median_ms(values: Sequence[float]) -> float:
    """Median of per-round seconds, in milliseconds (what every port table prints)."""
    return 1e3 * statistics.median(values)


def ratio_of_medians(times: dict[str, dict[str, list[float]]], num: str, den: str, kind: str = "wall") -> float:
    """median(num's rounds) / median(den's rounds): the ratio these scripts have always printed
    (the drop-in section's paired per-round ratios are ``_harness.ratio_stats``)."""
    return statistics.median(times[num][kind]) / statistics.median(times[den][kind])


def verdict(value: float | None, target: float) -> str:
    """ "met" or "**missed**" (a value above ``target``); "not measured" for None."""
    if value is None:
        return "not measured"
    return "met" if value <= target else "**missed**"


def target_sentence(target: float, measured: list[str], *, met: str, unmeasured: str) -> str:
    """The line under a table saying how the run did against the script's own target at
    N=4096: ``met`` names the ratio (``measured``: its values and verdicts), ``unmeasured``
    the bound's words when the run did not measure N=4096."""
    if measured:
        return f"This script's target at N=4096 ({met} <= {target:.2f}): " + "; ".join(measured) + "."
    return f"This script's target ({unmeasured}<= {target:.2f}) applies at N=4096, which this run did not measure."


class Block:
    """One generated block of the doc: the entries of ``section`` (every entry when None)
    of a script's runs, each run's rendered by ``table``. ``what`` names it in messages."""

    def __init__(self, key: str, what: str, table: Table, section: str | None = None) -> None:
        self.key, self.what, self.table, self.section = key, what, table, section
        self.port: Port  # set by the Port that owns the block

    @property
    def begin(self) -> str:
        return f"<!-- bench-{self.key}:begin (written by benchmarks/{self.port.script}; edits here are overwritten) -->"

    @property
    def end(self) -> str:
        return f"<!-- bench-{self.key}:end -->"

    def mine(self, entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in entries if self.section is None or e.get("section") == self.section]

    def result_files(self, folder: str | Path) -> list[Path]:
        """The newest result file in ``folder`` that measured this block (a file that cannot be
        read is returned too, so that ``load`` refuses it by name rather than skip it)."""
        for path in reversed(self.port.result_files(folder)):
            try:
                _, entries = self.port.load([path])
            except ValueError:
                return [path]
            if self.mine(entries):
                return [path]
        return []

    def load(self, paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(every run of ``paths``, their entries of this block); ValueError naming a bad file."""
        runs, entries = self.port.load(paths)
        return runs, self.mine(entries)

    def render(self, runs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> str:
        """The block, markers included: for each run with entries here, its command, run line
        and result file, then its table(s)."""
        out = [self.begin]
        for index, run in enumerate(runs):
            rows = [e for e in entries if e["run"] == index]
            if not rows:
                continue
            extra = ", ".join(f"{d} {run['versions'][d]}" for d in self.port.versions if d in run.get("versions", {}))
            out += [
                f"Command: `{run['command']}`; run {dr._run_line(run)}"
                + (f"; {extra}" if extra else "")
                + f". Every round: `{_shown(run.get('file', '?'))}`.",
                "",
                *self.table(run, rows),
                "",
            ]
        out.append(self.end)
        return "\n".join(out) + "\n"

    def write_section(self, doc: str | Path, text: str) -> None:
        """Replace this block of ``doc`` (between its markers) with ``text``; the rest stays."""
        dr.write_section(doc, text, begin=self.begin, end=self.end)


def _shown(file: str) -> str:
    """A result file as the doc cites it: relative to the repository when inside it."""
    path = Path(file).resolve()
    return str(path.relative_to(h.REPO)) if path.is_relative_to(h.REPO) else str(file)


class Port:
    """One benchmark script: its result files (``<name>-*.json``, format ``damcha-bench-<name>/1``),
    the blocks of the doc it writes, and the extra package versions it records."""

    def __init__(self, name: str, script: str, blocks: Sequence[Block], versions: Sequence[str] = ()) -> None:
        self.name, self.script, self.blocks, self.versions = name, script, tuple(blocks), tuple(versions)
        self.file_format = f"damcha-bench-{name}/1"
        for block in self.blocks:
            block.port = self

    def add_output_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The options every port script shares: ``--json``, ``--docs``, ``--no-docs``, ``--report``."""
        parser.add_argument(
            "--json", type=Path, help=f"results file (default benchmarks/results/{self.name}-<time>.json)"
        )
        parser.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file whose blocks are rewritten")
        parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs blocks after the run")
        parser.add_argument(
            "--report",
            nargs="*",
            type=Path,
            metavar="FILE",
            help=f"only rewrite the docs blocks from these result files (default: the newest {self.name}-*.json "
            "that measured each)",
        )

    # ------------------------------------------------------------------ writing a run

    def output_path(self, json_path: Path | None, tiny: bool, stack: contextlib.ExitStack) -> Path | None:
        """Where this run's results go: ``--json``'s file (None, with a message, when it exists:
        runs never overwrite each other), with ``--tiny`` a temporary folder's file (removed when
        ``stack`` closes: a check writes nothing here), else ``benchmarks/results/<name>-<stamp>.json``."""
        if json_path is not None:
            if json_path.exists():
                print(f"--json: {json_path} exists; choose another file", file=sys.stderr)
                return None
            return json_path
        if tiny:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"damcha-{self.name}-tiny-"))
            return Path(folder) / f"{self.name}.json"
        return RESULTS / f"{self.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"

    def open(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> h.Results | None:
        """The run's results file (``output_path`` of ``args.json`` and ``args.tiny``), or
        None (with a message) when ``--json`` names a file that exists."""
        path = self.output_path(args.json, args.tiny, stack)
        return None if path is None else h.Results(path, resume=False, file_format=self.file_format)

    def start(
        self,
        results: h.Results,
        argv: Sequence[str],
        *,
        tiny: bool,
        threads: int,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> int:
        """Record the run's metadata (``_harness.run_metadata``, plus this port's extra
        versions) in ``results``; returns the run's index."""
        meta = h.run_metadata(self.script, argv, tiny=tiny, threads=threads, env=env, **settings)
        for dist in self.versions:
            with contextlib.suppress(metadata.PackageNotFoundError):
                meta["versions"][dist] = metadata.version(dist)
        return results.start_run(meta)

    @staticmethod
    def record(results: h.Results, run: int, entry: dict[str, Any]) -> dict[str, Any]:
        """Add one entry (saved at once: an interrupted run keeps what it measured)."""
        entry = {**entry, "run": run, "finished": h.now(), "loadavg": h.loadavg()}
        results.add(entry)
        return entry

    def finish(self, results: h.Results, run: int, args: argparse.Namespace, **fields: Any) -> int:
        """Close the run's record, print its tables (the lines the doc gets) and, unless
        ``args.tiny`` or ``args.no_docs``, rewrite this script's blocks of ``args.docs``
        from the file."""
        results.update_run(run, finished=h.now(), loadavg_end=h.loadavg(), **fields)
        record = {**results.data["runs"][run], "file": str(results.path)}
        entries = [e for e in results.data["entries"].values() if e["run"] == run]
        for block in self.blocks:
            rows = block.mine(entries)
            if rows:
                print("\n" + "\n".join(block.table(record, rows)), flush=True)
        print(f"\nresults: {results.path}", flush=True)
        return 0 if args.tiny or args.no_docs else self.report([results.path], args.docs)

    # ------------------------------------------------------------------ reading results

    def result_files(self, folder: str | Path) -> list[Path]:
        """Every ``<name>-*.json`` in ``folder``, oldest run first."""
        return sorted(Path(folder).glob(f"{self.name}-*.json"), key=dr.started_order)

    def load(self, paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(runs, entries) of ``paths``, in order, each file on its own (a later file's entry
        never replaces an earlier one's: every run gets its own table). A file that is not
        this script's (unreadable, not JSON, another format, missing fields) is refused
        with a ValueError naming it."""
        runs: list[dict[str, Any]] = []
        entries: list[dict[str, Any]] = []
        for path in paths:
            file_runs, file_entries = self._load_one(Path(path))
            offset = len(runs)
            runs += file_runs
            entries += [{**e, "run": e["run"] + offset} for e in file_entries]
        return runs, entries

    def _load_one(self, path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        what = f"a {self.script} result file"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON, so not {what} ({exc})") from exc
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        if found != self.file_format:
            raise ValueError(f"{path}: format {found!r}, expected {self.file_format!r} ({what})")
        try:
            runs, entries = dr.load([path], pool=False, file_format=self.file_format)
            if not runs or any(not isinstance(e["run"], int) or not 0 <= e["run"] < len(runs) for e in entries):
                raise ValueError("entries that name no run of the file")
            for block in self.blocks:  # every table renders: a missing field is named here, not in a traceback
                block.render(runs, block.mine(entries))
        except (KeyError, TypeError, AttributeError, IndexError, ValueError, ZeroDivisionError) as exc:
            detail = f"no field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"{path}: malformed, not {what} ({detail})") from exc
        return runs, entries

    def report(self, paths: Sequence[str | Path], docs: Path) -> int:
        """Rewrite this script's blocks of ``docs`` from ``paths`` (none: each block from the
        newest file in benchmarks/results/ that measured it). 0; 2 when a file is refused
        (nothing written); 1 when no file measured any block (nothing written)."""
        given = [Path(p) for p in paths]
        if given:
            try:
                runs, entries = self.load(given)
            except ValueError as exc:
                print(f"--report: {exc}", file=sys.stderr)
                return 2
        written = 0
        for block in self.blocks:
            if given:
                used = {runs[e["run"]]["file"] for e in block.mine(entries)}
                files = [p for p in given if str(p) in used]
            else:
                files = block.result_files(RESULTS)
            if not files:
                print(
                    f"no {self.script} result file measured the {block.what} block; it stays as it is in {docs}",
                    file=sys.stderr,
                )
                continue
            rc = h.write_report(block, files, docs, RESULTS, f"{self.name}-*.json", block.what)
            if rc:
                return rc
            written += 1
        return 0 if written else 1
