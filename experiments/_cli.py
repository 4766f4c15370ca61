"""``damcha experiment``: train DAMCHA and its baselines, measure their cost, write JSON, plots and a report.

Every flag, output path and optional import is checked before any work;
a bad one exits with status 2 and one line naming the flag. An interrupted
run (Ctrl-C, SIGTERM) saves its checkpoint and exits 130; the same command
resumes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from damcha_core import DamchaValueError
from damcha_core import _cliutil as cu

PROG = "damcha experiment"
REPORT_PROG = f"{PROG} report"  # every line of the report subcommand, its parser's errors included


def _fail(flag: str, message: str) -> NoReturn:
    cu.usage_error(flag, message, prog=PROG)


def _report_fail(flag: str, message: str) -> NoReturn:
    cu.usage_error(flag, message, prog=REPORT_PROG)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number. Received: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0. Received: {text!r}")
    return value


# Adam's update is lr-sized: beyond 10 every weight leaves the float range within a step or two
# (1e300 overflowed at the first update); the presets' grids stay below 1e-2.
LR_MAX = 10.0


def _learning_rate(text: str) -> float:
    value = _positive_float(text)
    if value > LR_MAX:
        raise argparse.ArgumentTypeError(f"must be a learning rate in (0, {LR_MAX:g}]. Received: {text!r}")
    return value


_positive_int = cu.int_arg(minimum=1)


def _train_parser() -> argparse.ArgumentParser:
    from ._tasks import PRESETS, TASK_NAMES
    from ._variants import SUITES, VARIANTS

    p = cu.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} TASK [options]\n       {PROG} report FOLDER [options]",
        description="Train DAMCHA variants and baselines (MHA, talking-heads) at a fixed parameter budget, each "
        "with its own learning-rate sweep, over paired seeds, until the validation curve flattens; measure time "
        "per step and memory; write <out>/<task>.json, plots and <task>_cost.json. Rerun the same command to "
        "resume an interrupted run. 'damcha experiment report DIR' writes the tables and verdicts.",
    )
    p.add_argument("task", choices=TASK_NAMES, help="which experiment")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="default",
        help="sizes and budgets: smoke (CI, seconds), default (minutes), full (the runs behind "
        "docs/results.md, hours on a 2-core CPU), large (GPU sizes, with --device cuda)",
    )
    p.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default="headline",
        help="headline: baselines and DAMCHA couplings (claims 1-3); ablation: claim 4",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"run only these (space or comma separated) from {sorted(VARIANTS)}",
    )
    p.add_argument("--seeds", type=_positive_int, default=None, help="paired seeds per variant (preset's default)")
    p.add_argument(
        "--sweep-seeds",
        type=_positive_int,
        default=None,
        help="seeds trained at every learning rate of the sweep (preset's default)",
    )
    p.add_argument(
        "--lrs",
        type=_learning_rate,
        nargs="+",
        default=None,
        metavar="LR",
        help="learning-rate grid of each variant's sweep (preset's default)",
    )
    p.add_argument("--max-steps", type=_positive_int, default=None, help="hard step limit per run")
    # The first version's name; kept one release (it warns).
    p.add_argument("--steps", type=_positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--eval-size", type=_positive_int, default=None, help="validation and test examples (charlm: windows) each"
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N, mps, xpu or xpu:N (default cpu)")
    # Bounded by the CPUs: torch.set_num_threads(100000) crashed the process (a segfault, no message).
    cpus = os.cpu_count() or 1
    p.add_argument(
        "--threads",
        type=cu.int_arg(minimum=1, maximum=cpus),
        default=1,
        help=f"torch intra-op threads, 1 to this machine's {cpus} CPUs (default 1)",
    )
    p.add_argument(
        "--out",
        default="experiment-results",
        help="output folder (default ./experiment-results); run checkpoints live in <out>/runs",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--no-plots", action="store_true", help="write the JSON only (no matplotlib needed)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--no-cost", action="store_true", help="skip the time-per-step and memory measurement")
    group.add_argument(
        "--cost-only",
        action="store_true",
        help="only measure time per step and memory (on a quiet machine), no training",
    )
    group.add_argument(
        "--from-json",
        metavar="PATH",
        default=None,
        help="do not train: redraw the plots and table from an earlier results JSON into --out",
    )
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = cu.ArgumentParser(
        prog=REPORT_PROG,
        description="Read every results JSON in FOLDER; write the report's tables and a verdict per claim "
        "(markdown and JSON) and redraw the equal-time plots.",
    )
    p.add_argument(
        "folder", metavar="FOLDER", help="folder holding TASK.json, TASK_ablation.json and TASK_cost.json files"
    )
    p.add_argument("--out", default=None, help="markdown file to write (default FOLDER/report.md; JSON beside it)")
    p.add_argument(
        "--tolerance",
        type=_positive_float,
        default=None,
        help="claim 3: DAMCHA cost within this factor of MHA counts as comparable (default 1.25)",
    )
    p.add_argument("--no-plots", action="store_true", help="do not redraw the equal-time plots")
    return p


# ------------------------------------------------------------------ checks


# What to do about a damaged file, by what it is (``_read_json_dict``).
_REDO_RESULTS = (
    "move it away, then rerun the command for every variant it held (finished runs are read back from "
    "runs/, not retrained)"
)
_REDO_COST = "move it away, then measure the cost again (--cost-only)"


def _read_json_dict(path: Path, flag: str, remedy: str = "", *, fields: bool = True) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when there is no such file; exit 2 naming ``flag``, the
    file and what is wrong (and ``remedy``) when it cannot be read, is not valid JSON or is no object.

    Every results and cost file the command reads goes through here, before any work: a file cut off
    mid-write (a machine that died, a copy that stopped) was taken for an absent one and silently
    replaced, and with it the variants or measurements it held. A results or cost file must also
    hold every field the commands read (``check_results_object``) unless ``fields`` is False.
    """
    from ._report import read_json_object

    try:
        obj = read_json_object(path)
    except DamchaValueError as exc:
        _fail(flag, f"{exc}{'; ' + remedy if remedy else ''}")
    if fields:
        _check_fields(path, obj, flag, remedy)
    return obj


def _check_fields(path: Path, obj: dict[str, Any] | None, flag: str, remedy: str) -> None:
    """Exit 2 when ``obj``, a results or cost file read from ``path``, lacks a field the commands
    read (``check_results_object``): named now, not as a KeyError traceback after the training."""
    from ._jsonfile import check_results_object
    from ._tasks import RESULTS_FORMAT

    if obj is None or obj.get("format") != RESULTS_FORMAT:
        return
    try:
        check_results_object(path, obj)
    except DamchaValueError as exc:
        _fail(flag, f"{exc}{'; ' + remedy if remedy else ''}")


def _read_results(flag: str, path_text: str, task: str | None) -> dict[str, Any]:
    path = cu.check_input_file(path_text, flag, prog=PROG)
    obj = _read_json_dict(path, flag)
    if obj is None:  # gone since the check
        _fail(flag, f"{path_text!r} does not exist")
    from ._tasks import RESULTS_FORMAT

    if obj.get("kind") == "cost":
        _fail(flag, f"{path_text!r} is a cost file (TASK_cost.json), not a results file (TASK.json)")
    if obj.get("format") != RESULTS_FORMAT:
        _fail(
            flag,
            f"{path_text!r} is not a damcha experiment results file (format {obj.get('format')!r}, "
            f"expected {RESULTS_FORMAT!r})",
        )
    if not obj["variants"]:
        _fail(flag, f"{path_text!r} holds no variant")
    if task is not None and obj["task"] != task:
        _fail(flag, f"{path_text!r} holds task {obj['task']!r}, not {task!r}")
    return obj


def _sibling_cost(path: Path, results: dict[str, Any]) -> dict[str, Any] | None:
    """The cost file written beside a results JSON (``STEM_cost.json``), for the equal-time plot; None if absent."""
    from ._report import output_path, stem

    sibling = output_path(path.parent, stem(results), "cost")
    cost = _read_json_dict(sibling, "--from-json", "move it away or restore it (the equal-time plot reads it)")
    if cost is None or cost.get("kind") != "cost" or cost.get("task") != results["task"]:
        return None
    return cost if isinstance(cost.get("variants"), dict) else None


def _check_results_files(out: Path, name: str, preset: Any, device_type: Any) -> None:
    """Exit 2 when ``out`` holds this command's results or cost file (``NAME.json``,
    ``NAME_cost.json``) of another preset or device type.

    The run folders are kept apart by preset and device type (``runs/TASK-PRESET-DEVICE``), but
    these files are named by task and suite only: writing them replaced, say, a CUDA ``large``
    run's results with a CPU smoke run's, and a results file beside a cost file of another run
    made the report pair them. The same preset and device type (a rerun, another ``--variants``
    subset) replace (or merge into) them as before, and so is a file that records neither. A file
    that cannot be read, is not valid JSON or holds no object exits 2 too (``_read_json_dict``).
    """
    from ._report import OUTPUT_SUFFIXES, output_path

    # The files this command writes into --out (results, cost, plots): each must be replaceable
    # (not read-only, not a folder) now, not after hours of training.
    # (A folder still to be created holds nothing to replace; check_output_dir checked that it can be.)
    for kind in OUTPUT_SUFFIXES if out.is_dir() else ():
        cu.check_output_file(output_path(out, name, kind), "--out", prog=PROG)
    for path, remedy in ((output_path(out, name, "json"), _REDO_RESULTS), (output_path(out, name, "cost"), _REDO_COST)):
        obj = _read_json_dict(path, "--out", remedy, fields=False)  # another run's file: say that first
        if obj is None:
            continue
        differ = [
            f"{label} {obj[key]!r} there, {mine!r} here"
            for key, label, mine in (("preset", "preset", preset), ("device", "device type", device_type))
            if obj.get(key) is not None and mine is not None and obj[key] != mine
        ]
        if differ:
            _fail(
                "--out",
                f"{path} holds the results of another run ({'; '.join(differ)}); results files are named by task, "
                "not by preset or device, so this command would replace them: give it another --out",
            )
        _check_fields(path, obj, "--out", remedy)  # merged into after the training: every field it reads now


def _suite_order(names: Iterable[str], suite: str) -> list[str]:
    """``names`` in the suite's own order (that of a command running all its variants), then any
    others as found."""
    from ._variants import SUITES

    names = list(names)
    return [n for n in SUITES[suite] if n in names] + [n for n in names if n not in SUITES[suite]]


def _merge_subset(path: Path, results: dict[str, Any], suite: str) -> dict[str, Any]:
    """``results`` with the variants of the results file at ``path`` that it does not train added back,
    when that file records the same task, suite, preset, device type and config.

    The project (and users) train a task's variants in several processes, each with a
    ``--variants`` subset, against one ``--out``: writing each subset's results alone left the file
    with the subset that finished last, and the report silently dropped the others. Only plain
    variant entries are merged: the paired comparisons, Holm corrections and tables are computed
    from the variants when a report or table is drawn, so they cover the merged set; ``commands``
    lists the commands whose variants the file holds and ``wall_s``/``cpu_s`` are their sums
    (``_merged_commands``), not the last command's time alone. A file of another config is
    replaced as before; one that cannot be read exits 2 (``_read_json_dict``; it
    was checked before the training, so only a file damaged since gets here).
    """
    from ._tasks import RESULTS_FORMAT
    from ._train import identity_differences

    old = _read_json_dict(path, "--out", _REDO_RESULTS)
    if old is None or old.get("format") != RESULTS_FORMAT or old.get("kind") == "cost":
        return results
    if not isinstance(old.get("variants"), dict):
        return results
    # Compared through JSON: the config's tuples are lists in the file.
    mine = json.loads(json.dumps({k: results[k] for k in ("task", "suite", "preset", "device", "config")}))
    differ = identity_differences({k: old.get(k) for k in mine}, mine)
    if differ:
        dropped = [n for n in old["variants"] if n not in results["variants"]]
        if dropped:  # they were replaced without a word; their runs stay in runs/, under their own config
            print(
                f"{PROG}: note: {path} held {', '.join(dropped)} of another run (differing: {', '.join(differ)}): "
                "replaced by this command's variants only (the runs of those stay in runs/; the same command with their "
                "settings writes them back)",
                file=sys.stderr,
            )
        return results
    kept = {n: v for n, v in old["variants"].items() if n not in results["variants"]}
    if not kept:
        return results
    merged = kept | results["variants"]
    order = _suite_order(merged, suite)
    print(
        f"{PROG}: note: {path} already holds {', '.join(kept)} of this task, preset, device type and config: "
        "kept beside this command's variants",
        file=sys.stderr,
    )
    commands = _merged_commands(old, kept, results)
    return results | {"variants": {n: merged[n] for n in order}, "commands": commands} | _summed_times(commands)


_TIMES = ("wall_s", "cpu_s")
# Which code ran a command and when (``run_suite``): kept per command in a merged file's ``commands``.
_PROVENANCE = ("code_version", "started_utc", "finished_utc")


def _merged_commands(old: dict[str, Any], kept: dict[str, Any], results: dict[str, Any]) -> list[dict[str, Any]]:
    """The commands whose variants a merged results file holds, oldest first: ``{"variants": [...],
    "wall_s": s, "cpu_s": s}`` each, with its ``code_version``, ``started_utc`` and ``finished_utc``
    (None, or absent from an old file's own list, for commands run before they were recorded). The
    old file's own list, or (a file of one command) one entry made of its variants, times and
    provenance; an old command keeps its entry, with the variants it still provides, while any of
    them is kept, and ``results``' command comes last. A command whose variants were partly
    retrained keeps its whole time (it was not timed per variant). The merged file's own
    provenance fields are the last command's."""
    listed = old.get("commands")
    if not (isinstance(listed, list) and all(isinstance(c, dict) and "variants" in c for c in listed)):
        listed = [{"variants": list(old["variants"])} | {k: old.get(k) for k in (*_TIMES, *_PROVENANCE)}]
    commands = []
    for command in listed:
        still = [n for n in command["variants"] if n in kept]
        if still:
            commands.append(command | {"variants": still})
    last = {"variants": list(results["variants"])} | {k: results[k] for k in _TIMES}
    return [*commands, last | {k: results.get(k) for k in _PROVENANCE}]


def _summed_times(commands: list[dict[str, Any]]) -> dict[str, float | None]:
    """``wall_s``/``cpu_s`` of a merged file: the sums over its commands (None if one was not timed,
    say a hand-edited file: a partial sum would read as the whole)."""
    sums: dict[str, float | None] = {}
    for key in _TIMES:
        values = [c.get(key) for c in commands]
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        sums[key] = math.fsum(numbers) if len(numbers) == len(values) else None
    return sums


# What two cost measurements must share for their entries to stand in one TASK_cost.json: the same
# models and batch, timed on the same schedule, clock and thread count. The training-only settings
# (seeds, rates, step limits, evaluation sizes) do not change a step's time and are not compared.
_COST_MATCH = (
    "format",
    "kind",
    "task",
    "suite",
    "preset",
    "device",
    "cost_format",
    "schedule",
    "batch",
    "cost_rounds",
    "cost_steps",
    "torch_threads",
    "clock",
)


def _merge_cost(path: Path, cost: dict[str, Any], suite: str) -> dict[str, Any]:
    """``cost`` with the variants of the cost file at ``path`` that it did not measure added back,
    when that file was measured alike (``_COST_MATCH``); like ``_merge_subset`` for ``TASK.json``.

    Every cost command wrote ``TASK_cost.json`` with its own variants only, so ``--cost-only
    --variants a b`` after a measurement of all of them dropped the others. A variant's time ratio
    is the median of its per-round ratios to the MHA rounds of its own interleaved measurement, so
    entries of separate commands remain valid ratios, provided each keeps those MHA rounds: in a
    merged file every entry records ``mha_round_s_per_step`` (what ``_analysis.time_ratio`` pairs
    its rounds with) and ``environment`` (when and where it was measured, load included), and the
    ``code_version``/``started_utc``/``finished_utc`` of its measurement where that recorded them, so
    the file does not claim one measurement for all. The file's own ``environment``, provenance and
    clock fields are the last command's. A file measured otherwise, or whose clock could not time
    the steps (its ``unusable_clocks`` is file-wide), is replaced as before.
    """
    from ._analysis import no_time_ratio

    old = _read_json_dict(path, "--out", _REDO_COST)
    if old is None or not isinstance(old.get("variants"), dict) or any(old.get(k) != cost.get(k) for k in _COST_MATCH):
        return cost
    if no_time_ratio(old) is not None or no_time_ratio(cost) is not None:
        return cost
    kept = [n for n in old["variants"] if n not in cost["variants"]]
    if not kept:
        return cost

    def own(file: dict[str, Any], name: str) -> dict[str, Any]:
        entry = dict(file["variants"][name])
        entry.setdefault("environment", file.get("environment"))
        for key in _PROVENANCE:  # which code measured it, and when (a file from before: none recorded)
            if key in file:
                entry.setdefault(key, file[key])
        mha = file["variants"].get("mha") or {}
        if entry.get("time_ratio_vs_mha") is not None and mha.get("round_s_per_step") is not None:
            entry.setdefault("mha_round_s_per_step", mha["round_s_per_step"])
        return entry

    merged = {n: own(old, n) for n in kept} | {n: own(cost, n) for n in cost["variants"]}
    order = _suite_order(merged, suite)
    checks = (old.get("params_check") or {}) | (cost.get("params_check") or {})
    print(
        f"{PROG}: note: {path} already holds the cost of {', '.join(kept)}, measured alike: kept beside this "
        "command's variants (each with its own MHA rounds and environment)",
        file=sys.stderr,
    )
    return cost | {
        "variants": {n: merged[n] for n in order},
        "params_check": {n: checks[n] for n in order if n in checks},
    }


def _note_runs_elsewhere(out: Path, cfg, variants: list[str], device_type: str) -> None:
    """One line on stderr when ``out`` holds no run of this command on its device type to resume
    but runs of it on another: those are never resumed here (another device gives other numbers),
    so training starts over; said, since a forgotten ``--device`` would otherwise retrain silently."""
    from ._suite import run_group, runs_by_device

    found = runs_by_device(out, cfg, variants)
    others = {d: n for d, n in found.items() if d != device_type}
    if not others or found.get(device_type):
        return
    where = ", ".join(f"{n} on {d} ({run_group(out, cfg, d).name})" for d, n in others.items())
    print(
        f"{PROG}: note: no run of {cfg.task} ({cfg.preset}) on {device_type} to resume in {out / 'runs'}, but "
        f"{where}: this command starts over on {device_type} in {run_group(out, cfg, device_type).name} and "
        f"leaves those alone (--device {next(iter(others))} resumes them)",
        file=sys.stderr,
    )


def _check_device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps|xpu(:\d+)?|meta", text):
        _fail("--device", f"expected cpu, cuda, cuda:N, mps, xpu or xpu:N. Received: {text!r}")
    if text == "meta":
        _fail("--device", "the meta device holds no data, so nothing can train on it")
    if text == "cpu":
        return text
    cu.require("torch", "torch", "--device", prog=PROG, why="a device other than cpu")
    import torch

    kind, _, index = text.partition(":")
    backend = getattr(torch, kind, None)
    if backend is None or not backend.is_available():
        _fail("--device", f"{text!r} is not available on this machine")
    if index and int(index) >= backend.device_count():
        _fail("--device", f"{text!r}: this machine has {backend.device_count()} {kind} device(s)")
    return text


def _variants(args: argparse.Namespace) -> list[str]:
    from ._variants import SUITES, VARIANTS

    if not args.variants:
        return list(SUITES[args.suite])
    names = [v for item in args.variants for v in item.split(",") if v]
    if not names:
        _fail("--variants", f"names no variant; expected names from {sorted(VARIANTS)}. Received: {args.variants!r}")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        _fail("--variants", f"unknown variant(s) {unknown}; expected from {sorted(VARIANTS)}")
    if len(set(names)) != len(names):
        _fail("--variants", f"a variant is named twice: {names}")
    return names


def _config(args: argparse.Namespace):
    from ._tasks import eval_size_limit, task_config

    overrides: dict[str, Any] = {"seeds": args.seeds, "sweep_seeds": args.sweep_seeds, "max_steps": args.max_steps}
    if args.lrs:
        if len(set(args.lrs)) != len(args.lrs):
            _fail("--lrs", f"a learning rate is given twice: {args.lrs}")
        overrides["lrs"] = tuple(sorted(args.lrs))
    if args.eval_size is not None:
        overrides["val_size"] = overrides["test_size"] = args.eval_size
    cfg = task_config(args.task, args.preset, **overrides)
    if args.eval_size is not None:
        limit = eval_size_limit(cfg.task, cfg.train_size, cfg.seq_len)
        if args.eval_size > limit:
            what = {
                "digits": "validation and test images",
                "charlm": f"distinct {cfg.seq_len}-byte windows in its validation and test text at this preset",
            }.get(cfg.task, "examples at most (generated evaluation sets)")
            _fail("--eval-size", f"{cfg.task} has {limit} {what}; expected <= {limit}, got {args.eval_size}")
    if args.sweep_seeds is not None and args.sweep_seeds > cfg.seeds:
        _fail("--sweep-seeds", f"must be at most --seeds ({cfg.seeds}), got {args.sweep_seeds}")
    return cfg


def _staged(out: Path, write) -> dict[str, Path]:
    """``write(folder)`` into a temporary folder; on success its files move into ``out`` (``cu.atomic_dir``).

    A failure leaves ``out`` as it was: no partial file, earlier files kept.
    """
    with cu.atomic_dir(out) as stage:
        paths = write(stage)
    return {key: out / path.name for key, path in paths.items()}


# -------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "report":
            return _report_main(argv[1:])
        return _train_main(argv)
    except SystemExit as exc:  # usage errors (exit 2) and --help (exit 0) end here, not the interpreter
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


#: Suffixes of the files ``damcha experiment`` draws: the report's markdown never goes there.
_IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def _check_report_outputs(out: Path, given: str | None) -> None:
    """Refuse an ``--out`` whose markdown or JSON summary would replace the experiment's own files:
    ``--out exp/crosshead.md`` wrote its summary over ``exp/crosshead.json`` (the results the report
    reads), ``--out exp/crosshead_curves.png`` wrote markdown over a plot; both exited 0."""
    from ._jsonfile import JsonFileError, read_json_object
    from ._tasks import RESULTS_FORMAT

    if out.suffix.lower() in _IMAGE_SUFFIXES:
        _report_fail("--out", f"names the report's markdown file, not an image. Received: {given!r}")
    for path in (out, out.with_suffix(".json")):
        try:
            obj = read_json_object(path)
        except JsonFileError:
            continue  # not a results file; cu.check_output_file judged whether it can be replaced
        if isinstance(obj, dict) and obj.get("format") == RESULTS_FORMAT:
            _report_fail(
                "--out",
                f"would replace {str(path)!r}, which holds experiment results (the report's JSON summary is "
                f"written to {str(out.with_suffix('.json'))!r}); choose another name. Received: {given!r}",
            )


def _report_main(argv: list[str]) -> int:
    args = _report_parser().parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        _report_fail("FOLDER", f"is not a folder. Received: {args.folder!r}")
    out = cu.check_output_file(args.out if args.out else folder / "report.md", "--out", prog=REPORT_PROG)
    if out.suffix.lower() == ".json":  # the summary goes to <out>.json: it would replace the report itself
        _report_fail(
            "--out", f"names the report's markdown file; its JSON summary is written beside it. Received: {args.out!r}"
        )
    cu.check_output_file(out.with_suffix(".json"), "--out", prog=REPORT_PROG)
    _check_report_outputs(out, args.out)
    if not args.no_plots:  # the time plots go into FOLDER
        cu.check_output_dir(str(folder), "FOLDER", prog=REPORT_PROG)
        cu.require("matplotlib", prog=REPORT_PROG, why="the plots; or pass --no-plots")
    from . import _analysis as an
    from ._report import build_report, load_folder, output_path, plot_time_curves, stem, write_json

    skipped: list[tuple[Path, str]] = []
    try:
        headline, ablation, cost, ablation_cost = load_folder(folder, skipped)
    except DamchaValueError as exc:
        _report_fail("FOLDER", str(exc))
    if not args.no_plots:  # a read-only plot or a folder in its place failed after the report was written
        for res in headline.values():
            cu.check_output_file(output_path(folder, stem(res), "time"), "FOLDER", prog=REPORT_PROG)
    why = "; ".join(f"{path.name} {reason}" for path, reason in skipped)
    if not (headline or ablation or cost or ablation_cost):
        _report_fail(
            "FOLDER",
            f"holds no damcha experiment results JSON{f' (skipped: {why})' if why else ''}. Received: {args.folder!r}",
        )
    for path, reason in skipped:
        print(f"{REPORT_PROG}: warning: skipped {path}: it {reason}", file=sys.stderr)
    text, summary = build_report(folder, args.tolerance or an.OVERHEAD_TOLERANCE)
    for path, why in summary["damaged_run_results"]:
        print(
            f"{REPORT_PROG}: note: skipped {path}: it {why}; that run counts as unfinished (its command, rerun, "
            "resumes or retrains it and rewrites the file)",
            file=sys.stderr,
        )
    cu.atomic_write_text(out, text)
    write_json(summary, out.with_suffix(".json"))
    if not args.no_plots:
        for task, res in headline.items():
            plot_time_curves(res, output_path(folder, stem(res), "time"), cost.get(task))
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


#: Options that choose what trains and where: --from-json trains nothing, it redraws a results file.
_NOT_WITH_FROM_JSON = (
    "--preset",
    "--variants",
    "--suite",
    "--device",
    "--threads",
    "--seeds",
    "--sweep-seeds",
    "--lrs",
    "--max-steps",
    "--steps",
    "--eval-size",
)


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options ``argv`` gives explicitly (by their first long name), abbreviations included:
    the same parse with every default suppressed."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
    return {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest in given}


def _train_main(argv: list[str]) -> int:
    if not argv:
        _train_parser().print_help(sys.stderr)
        return 2
    args = _train_parser().parse_args(argv)
    given = _given(_train_parser(), argv)
    # Silently ignored before: `--from-json r.json --seeds 7 --device cuda` exited 0 on a machine
    # without CUDA. (--cost-only reads --lrs, its optimizer's rate; the run-count options are
    # harmless there, and reusing a training command line with --cost-only is the documented way.)
    clash = [f for f in _NOT_WITH_FROM_JSON if f in given]
    if args.from_json and clash:
        _fail(
            clash[0],
            "does not apply with --from-json, which redraws an earlier results file without training (its "
            f"runs' settings are in it). Received: {' '.join(clash)} with --from-json",
        )
    if args.steps is not None:
        if args.max_steps is not None:
            _fail("--steps", "is the deprecated name of --max-steps; give only --max-steps")
        print(
            f"{PROG}: warning: --steps is deprecated, use --max-steps (a hard limit; runs stop earlier at a "
            "validation plateau)",
            file=sys.stderr,
        )
        args.max_steps = args.steps
    variants = _variants(args)
    cfg = _config(args)
    out = cu.check_output_dir(args.out, "--out", prog=PROG)
    if not args.no_plots:
        cu.require("matplotlib", prog=PROG, why="the plots; or pass --no-plots")
    if args.from_json:
        results = _read_results("--from-json", args.from_json, args.task)
        from ._report import markdown_table, output_path, stem, write_json, write_results

        # This command's preset and device are those of the results it writes (--preset is not read).
        _check_results_files(out, stem(results), results.get("preset"), results.get("device"))
        try:
            table = markdown_table(results)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            _fail("--from-json", f"{args.from_json!r} is incomplete ({type(exc).__name__}: {exc})")
        cost = _sibling_cost(Path(args.from_json), results)
        try:
            paths = _staged(
                out,
                lambda d: (
                    {"json": write_json(results, output_path(d, stem(results), "json"))}
                    if args.no_plots
                    else write_results(results, d, cost)
                ),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            _fail("--from-json", f"{args.from_json!r} is incomplete ({type(exc).__name__}: {exc})")
        print(table)
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    cu.require("torch", "torch", prog=PROG, why="training")
    if args.task == "digits":
        cu.require("sklearn", "experiments", "TASK", prog=PROG, why="scikit-learn's bundled 8x8 digits")
    device = _check_device(args.device)
    name = cfg.task if args.suite == "headline" else f"{cfg.task}_{args.suite}"
    _check_results_files(out, name, cfg.preset, device.partition(":")[0])
    if not args.cost_only:  # a file named runs there ended the first run with NotADirectoryError
        from ._suite import run_group

        cu.check_output_dir(run_group(out, cfg, device.partition(":")[0]), "--out", prog=PROG)

    import torch

    if device.startswith("cuda"):
        # Bitwise-resumable runs on a GPU need deterministic kernels (cuBLAS reads this before its first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(args.threads)
    stop = {"signal": None}

    def request_stop(signum, frame):
        # The first signal: finish the current step, checkpoint, exit 130. A second one: stop now.
        if stop["signal"] is not None:
            raise KeyboardInterrupt
        stop["signal"] = signum

    from ._train import ResumedElsewhereWarning, UnreadableResultWarning

    def show_warning(message, category, filename, lineno, file=None, line=None):
        # A damaged result.json, or a run resumed on another machine, is a note on the command's
        # progress, not a warning about code: one line, without Python's file:line and source line.
        if issubclass(category, (UnreadableResultWarning, ResumedElsewhereWarning)):
            print(f"{PROG}: note: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with warnings.catch_warnings():
            shown, warnings.showwarning = warnings.showwarning, show_warning
            return _train(args, cfg, variants, out, torch.device(device), lambda step: stop["signal"] is not None)
    except KeyboardInterrupt:
        print(
            f"{PROG}: stopped at once; every unfinished run resumes from its last evaluation's checkpoint in "
            f"{out / 'runs'} when the same command runs again",
            file=sys.stderr,
        )
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _train(args, cfg, variants, out, device, should_stop) -> int:
    from ._cost import measure_cost
    from ._report import cost_caption, cost_table, markdown_table, output_path, stem, write_json, write_results
    from ._suite import run_suite
    from ._train import RunInterrupted, RunSettingsMismatch

    name = cfg.task if args.suite == "headline" else f"{cfg.task}_{args.suite}"
    if args.cost_only:
        try:
            cost = measure_cost(cfg, variants, device=device, should_stop=lambda: should_stop(0)) | {
                "suite": args.suite
            }
        except RunInterrupted:
            print(f"{PROG}: interrupted while measuring the cost; nothing was written", file=sys.stderr)
            return 130
        cost = _merge_cost(output_path(out, name, "cost"), cost, args.suite)
        existing = output_path(out, name, "json")

        def write_cost(folder: Path) -> dict[str, Path]:
            paths = {"cost": write_json(cost, output_path(folder, name, "cost"))}
            results = None if args.no_plots else _read_json_dict(existing, "--out", _REDO_RESULTS)
            if results is not None and isinstance(results.get("variants"), dict) and results["variants"]:
                from ._report import plot_time_curves

                paths["time"] = plot_time_curves(results, output_path(folder, stem(results), "time"), cost)
            return paths

        written = _staged(out, write_cost)
        print(f"{cost_caption(cost)}\n\n{cost_table(cost)}")
        print("\nwrote " + ", ".join(str(p) for p in written.values()))
        return 0
    _note_runs_elsewhere(out, cfg, variants, device.type)
    runs_per_variant = len(cfg.lrs) * cfg.sweep_seeds + cfg.seeds - cfg.sweep_seeds
    bar = cu.Progress(len(variants) * runs_per_variant, f"{cfg.task} ({cfg.preset})", enabled=not args.no_progress)
    try:
        results = run_suite(
            cfg,
            variants,
            args.suite,
            out=out,
            device=device,
            should_stop=should_stop,
            progress=lambda text: bar.step(text, force=True),
        )
    except RunInterrupted as exc:
        print(
            f"{PROG}: interrupted ({exc}); checkpoints are in {out / 'runs'}: run the same command to resume",
            file=sys.stderr,
        )
        return 130
    except RunSettingsMismatch as exc:
        bar.close()
        _fail("--out", f"{exc} (every run folder this command could resume is checked before any training)")
    finally:
        bar.close()
    own_time = {k: results[k] for k in _TIMES}  # the line printed below is this command's, not the file's
    results = _merge_subset(output_path(out, name, "json"), results, args.suite)
    run_cost: dict[str, Any] | None = None
    if not args.no_cost:
        try:
            run_cost = measure_cost(cfg, variants, device=device, should_stop=lambda: should_stop(0)) | {
                "suite": args.suite
            }
        except RunInterrupted:
            print(
                f"{PROG}: interrupted while measuring the cost; nothing was written (the finished runs are in "
                f"{out / 'runs'}: the same command reads them back and measures the cost again)",
                file=sys.stderr,
            )
            return 130
        run_cost = _merge_cost(output_path(out, name, "cost"), run_cost, args.suite)

    def write(folder: Path) -> dict[str, Path]:
        paths = {}
        if run_cost is not None:
            paths["cost"] = write_json(run_cost, output_path(folder, name, "cost"))
        if args.no_plots:
            paths["json"] = write_json(results, output_path(folder, stem(results), "json"))
        else:
            paths |= write_results(results, folder, run_cost)
        return paths

    paths = _staged(out, write)
    print(markdown_table(results, run_cost))
    if run_cost is not None:
        print()
        print(cost_table(run_cost))
    print(
        f"\nwall time {own_time['wall_s']:.0f} s (CPU {own_time['cpu_s']:.0f} s); wrote "
        + ", ".join(str(p) for p in paths.values())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
