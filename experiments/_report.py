"""Writing results: the JSON files, the plots (matplotlib, Agg) and the report's markdown.

Every file is written to a temporary name in its folder and renamed into
place, so an interrupted or failed write never leaves half a file and never
destroys an earlier good one.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from damcha_core import DamchaValueError
from damcha_core import _cliutil as cu

from . import _analysis as an
from ._jsonfile import (
    RESULT_FIELDS,
    JsonFileError,
    NotAJsonObject,
    check_results_object,
    read_json_object,
    require_fields,
)
from ._tasks import RESULTS_FORMAT

# Small figures at low dpi: the PNGs are committed to the repository.
_DPI = 72


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# What ``damcha experiment`` writes into its folder for a stem (``TASK`` or ``TASK_SUITE``): the
# results, the cost measurement and the plots. One table, so that the command's up-front check that
# each file can be replaced and the writers below cannot drift apart.
OUTPUT_SUFFIXES: dict[str, str] = {
    "json": ".json",
    "cost": "_cost.json",
    "curves": "_curves.png",
    "final": "_final.png",
    "lr": "_lr.png",
    "time": "_time.png",
    "metric": "_metric.png",
}


def output_path(folder: Path, file_stem: str, kind: str) -> Path:
    """``folder / (file_stem + OUTPUT_SUFFIXES[kind])``."""
    return folder / f"{file_stem}{OUTPUT_SUFFIXES[kind]}"


def results_file_names() -> set[str]:
    """The names ``damcha experiment`` gives its results and cost files: ``TASK.json``,
    ``TASK_ablation.json``, ``TASK_cost.json``, ``TASK_ablation_cost.json``."""
    from ._tasks import TASK_NAMES

    return {f"{t}{s}{OUTPUT_SUFFIXES[k]}" for t in TASK_NAMES for s in ("", "_ablation") for k in ("json", "cost")}


def write_json(obj: Any, path: Path) -> Path:
    cu.atomic_write_text(path, json.dumps(obj, indent=1, allow_nan=True) + "\n")
    return path


def _savefig(fig, path: Path) -> Path:
    plt = _pyplot()
    try:
        with cu.atomic_write(path, "wb") as f:
            fig.savefig(f, dpi=_DPI, format="png")
    finally:
        plt.close(fig)
    return path


def stem(results: dict[str, Any]) -> str:
    """File stem of a results JSON: ``TASK`` (headline suite) or ``TASK_SUITE``."""
    suite = results.get("suite", "headline")
    return results["task"] if suite == "headline" else f"{results['task']}_{suite}"


def write_results(results: dict[str, Any], out_dir: str | Path, cost: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write ``STEM.json`` and its plots into ``out_dir`` (which must exist); returns name -> path."""
    out = Path(out_dir)
    s = stem(results)
    paths = {"json": write_json(results, output_path(out, s, "json"))}
    paths["curves"] = plot_curves(results, output_path(out, s, "curves"))
    paths["final"] = plot_final(results, output_path(out, s, "final"))
    if any(len(r["lr_sweep"]["lrs"]) > 1 for r in results["variants"].values()):
        paths["lr"] = plot_lr_sweep(results, output_path(out, s, "lr"))
    if cost is not None or any(
        r["runs"] and r["runs"][0]["curve"]["train_time_s"] for r in results["variants"].values()
    ):
        paths["time"] = plot_time_curves(results, output_path(out, s, "time"), cost)
    heat = plot_head_maps(results, output_path(out, s, "metric"))
    if heat is not None:
        paths["metric"] = heat
    return paths


def _label(results: dict[str, Any], which: str = "metric") -> str:
    return results["metric"].replace("_", " ")


def _measured_time(run: dict[str, Any]) -> Any:
    """A run's x values: its measured training time."""
    return run["curve"]["train_time_s"]


def _steps_times(run: dict[str, Any], seconds_per_step: float) -> list[float]:
    """A run's x values: its steps times the interleaved cost measurement's seconds per step."""
    return [step * seconds_per_step for step in run["curve"]["step"]]


def _banded(runs: list[dict[str, Any]], key: str, xs_of) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std over runs on the union of their x values; a stopped run keeps its last value."""
    per_run = [(np.asarray(xs_of(r), dtype=float), np.asarray(r["curve"][key], dtype=float)) for r in runs]
    grid = np.unique(np.concatenate([x for x, _ in per_run])) if per_run else np.zeros(0)
    stack = []
    for x, y in per_run:
        idx = np.searchsorted(x, grid, side="right") - 1
        vals = np.where(idx >= 0, y[np.clip(idx, 0, None)], np.nan)
        stack.append(vals)
    arr = np.array(stack)
    with np.errstate(invalid="ignore"):
        return grid, np.nanmean(arr, 0), np.nanstd(arr, 0)


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Validation metric vs step: mean over seeds with a +-1 std band (a stopped run keeps its last value)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, r in results["variants"].items():
        x, mean, std = _banded(r["runs"], "val_metric", lambda run: run["curve"]["step"])
        ax.plot(x, mean, label=name, lw=1.2, ls="--" if r["kind"] != "damcha" else "-")
        ax.fill_between(x, mean - std, mean + std, alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"validation {_label(results)}")
    ax.set_title(
        f"{results['task']} ({results.get('preset', '?')}): validation, {results['seeds']} seeds, mean +- std",
        fontsize=9,
    )
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _savefig(fig, path)


def plot_time_curves(results: dict[str, Any], path: Path, cost: dict[str, Any] | None = None) -> Path:
    """Validation metric vs training time: steps x the cost file's median s/step, else each run's own clock."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    source = "interleaved cost measurement"
    for name, r in results["variants"].items():
        sps = an._s_per_step(cost, name)
        if sps is None:
            source = "each run's measured training time"
            xs: Callable[[dict[str, Any]], Any] = _measured_time
        else:
            xs = functools.partial(_steps_times, seconds_per_step=sps)
        x, mean, std = _banded(r["runs"], "val_metric", xs)
        ax.plot(x, mean, label=name, lw=1.2, ls="--" if r["kind"] != "damcha" else "-")
        ax.fill_between(x, mean - std, mean + std, alpha=0.15)
    names = list(results["variants"])
    b = an.budgets(results, names, cost)
    if math.isfinite(b["time_s"]):
        ax.axvline(b["time_s"], color="k", lw=0.8, ls=":", label="equal-time budget")
    ax.set_xlabel(f"training time (s; {source})")
    ax.set_ylabel(f"validation {_label(results)}")
    ax.set_title(f"{results['task']}: validation vs training time, mean +- std over seeds", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _savefig(fig, path)


def plot_final(results: dict[str, Any], path: Path) -> Path:
    """Test metric at the best validation point per variant: bar = mean, error bar = std, dots = seeds."""
    plt = _pyplot()
    names = list(results["variants"])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    values = []
    for i, name in enumerate(names):
        r = results["variants"][name]
        finals = [run["test_metric"] for run in r["runs"]]
        values += [v for v in finals if math.isfinite(v)]
        std = r["test"]["std"] or 0.0
        ax.bar(i, r["test"]["mean"], yerr=std, color="C0" if r["kind"] == "damcha" else "C7", alpha=0.7, capsize=3)
        ax.scatter([i] * len(finals), finals, s=8, color="k", zorder=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    if values:
        lo, hi = min(values), max(values)
        pad = max(hi - lo, 1e-3) * 0.5
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel(f"test {_label(results)}")
    ax.set_title(
        f"{results['task']}: test {results['metric']} at the best validation step (bars: mean +- std; dots: seeds)",
        fontsize=8,
    )
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _savefig(fig, path)


def plot_lr_sweep(results: dict[str, Any], path: Path) -> Path:
    """Best validation metric vs learning rate per variant (mean over the sweep seeds); the chosen rate circled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, r in results["variants"].items():
        sweep = r["lr_sweep"]
        lrs = sweep["lrs"]
        means = [np.mean([x["best_val_metric"] for x in sweep["runs"] if x["lr"] == lr]) for lr in lrs]
        (line,) = ax.plot(lrs, means, marker=".", label=name, lw=1, ls="--" if r["kind"] != "damcha" else "-")
        ax.scatter(
            [sweep["chosen_lr"]],
            [means[lrs.index(sweep["chosen_lr"])]],
            s=60,
            facecolors="none",
            edgecolors=line.get_color(),
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"best validation {_label(results)}")
    ax.set_title(f"{results['task']}: learning-rate sweep (circle: chosen)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _savefig(fig, path)


def plot_head_maps(results: dict[str, Any], path: Path) -> Path | None:
    """Heatmaps of l(t) - I, the token-mean learned cross-head part, per (DAMCHA variant, layer), seed 0.

    The identity (MHA) is subtracted because it would dominate the colour
    scale; what is left is diag(g) A(t) averaged over tokens.
    """
    panels = [
        (name, i, np.array(m) - np.eye(len(m)))
        for name, r in results["variants"].items()
        for i, m in enumerate(r.get("head_maps_seed0") or [])
    ]
    if not panels:
        return None
    plt = _pyplot()
    layers = max(i for _, i, _ in panels) + 1
    names = sorted({n for n, _, _ in panels}, key=list(results["variants"]).index)
    fig, axes = plt.subplots(len(names), layers, figsize=(1.6 * layers + 2.6, 1.5 * len(names) + 0.6), squeeze=False)
    vmax = max(max(float(np.abs(m).max()) for _, _, m in panels), 1e-6)
    im = None
    for name, i, m in panels:
        ax = axes[names.index(name), i]
        im = ax.imshow(m, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
        ax.set_xticks(range(m.shape[1]))
        ax.set_yticks(range(m.shape[0]))
        ax.tick_params(labelsize=5)
        if names.index(name) == 0:
            ax.set_title(f"layer {i}", fontsize=7)
        if i == 0:
            ax.set_ylabel(name.replace("damcha-", ""), fontsize=6)
    for ax in axes.flat:
        if not ax.images:
            ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.7).ax.tick_params(labelsize=5)
    fig.suptitle(f"{results['task']}: mean l(t) - I (row: head formed, col: head read), seed 0", fontsize=7)
    return _savefig(fig, path)


# ----------------------------------------------------------------- markdown


def _f(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a" if v is None else str(v)
    return f"{v:.{digits}f}"


def _ci(c: dict[str, Any], digits: int = 4) -> str:
    return "n/a" if c.get("ci") is None else f"[{c['ci'][0]:+.{digits}f}, {c['ci'][1]:+.{digits}f}]"


def sign_flip_cell(row: dict[str, Any]) -> str:
    """A comparison row's sign-flip test: "p [Holm p]", "(floor F)" when its seeds are too few for it to reach
    the rule's alpha, and "-> D" when its Holm-adjusted decision differs from the t test's (the rule's)."""
    sf = row.get("sign_flip")
    if sf is None or sf.get("p") is None:
        return "n/a"
    cell = f"{_f3(sf['p'])} [{_f3(sf.get('p_holm'))}]"
    if sf["method"] != "exact":
        cell += f" (MC {sf['resamples']:,})"
    if sf["floor"] >= an.ALPHA:
        cell += f" (floor {sf['floor']:.3g})"
    if sf.get("decision") is not None and sf["decision"] != row["decision"]:
        cell += f" -> {sf['decision']}"
    return cell


def _f3(p: float | None) -> str:
    return "n/a" if p is None else format(p, ".3g")


# What the sign-flip column of every comparison table holds (the analysis module's docstring has the detail).
SIGN_FLIP_NOTE = (
    "sign-flip: the exact paired sign-flip permutation test's two-sided p [Holm over the same family], "
    "deciding nothing; '(floor F)': with these few seeds it cannot go below F, and '-> D' where its Holm p "
    "would decide D"
)


def markdown_table(results: dict[str, Any], cost: dict[str, Any] | None = None) -> str:
    """Per variant: params, chosen lr, test metric (mean +- std, 95% CI), steps, stops, and the paired gain vs MHA."""
    vs = {}
    if "mha" in results["variants"]:
        # The same Holm families as the verdicts: the DAMCHA variants together, each other
        # baseline (talking-heads) on its own.
        damcha = an.damcha_names(results)
        others = [n for n in results["variants"] if n != "mha" and n not in damcha]
        for family in [damcha] + [[n] for n in others]:
            if family:
                vs.update({r["variant"]: r for r in an.compare(results, family, "mha", cost=cost)})
    m = results["metric"]
    lines = [
        f"| variant | params | lr | test {m} mean +- std | 95% CI | steps (mean) | plateau/max/div | "
        "gain vs mha [95% CI] | Holm p (t) | decision (t) | sign-flip p [Holm] |",
        "| --- | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: | :---: | ---: |",
    ]
    for name, r in results["variants"].items():
        t = r["test"]
        stops = "/".join(
            str(sum(run["stop_reason"] == k for run in r["runs"])) for k in ("plateau", "max_steps", "diverged")
        )
        c = vs.get(name)
        gain = "-" if c is None else f"{c['mean']:+.4f} {_ci(c)}"
        p = "-" if c is None or c["p_holm"] is None else f"{c['p_holm']:.3g}"
        dec = "-" if c is None else c["decision"]
        flip = "-" if c is None else sign_flip_cell(c)
        edge = an.at_grid_edge(results, name)
        lr = f"{r['chosen_lr']:g}" + (f" ({edge} of the grid)" if edge else "")
        lines.append(
            f"| {name} | {r['params']:,} | {lr} | {_f(t['mean'])} +- {_f(t['std'])} | {_ci(t)} | "
            f"{r['steps']['mean']:.0f} | {stops} | {gain} | {p} | {dec} | {flip} |"
        )
    return "\n".join(lines)


def comparison_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | vs | budget | gain mean +- std | 95% CI | p (t) | Holm p (t) | decision (t) | "
        "no gain (< margin) | sign-flip p [Holm] |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | :---: | :---: | ---: |",
    ]
    for r in rows:
        budget = r["budget"] if r["budget_value"] is None else f"{r['budget']} = {r['budget_value']:.4g}"
        lines.append(
            f"| {r['variant']} | {r['baseline']} | {budget} | {r['mean']:+.4f} +- {_f(r['std'])} | {_ci(r)} | "
            f"{_f3(r['p'])} | {_f3(r['p_holm'])} | {r['decision']} | "
            f"{'yes' if r['no_gain'] else 'no'} | {sign_flip_cell(r)} |"
        )
    return "\n".join(lines)


_CLOCK_NAMES = an.CLOCK_NAMES


def _cost_loads(cost: dict[str, Any]) -> str:
    """The load average before and after the measurement; per measurement (with its variants and
    date) in a file merging several (``an.cost_environments``)."""
    groups = an.cost_environments(cost)
    parts = [f"load average {env.get('loadavg')} before, {env.get('loadavg_after')} after" for _, env in groups]
    if len(groups) == 1:
        return parts[0]
    return "measured in separate commands: " + "; ".join(
        f"{', '.join(names)} on {env.get('date')}, {part}" for (names, env), part in zip(groups, parts)
    )


def cost_caption(cost: dict[str, Any]) -> str:
    """How a cost file was measured: schedule, rounds x steps, clock, interval, load, MHA's round spread."""
    clock = an.recorded_clock(cost)
    if cost.get("cost_format"):
        schedule = "the variants alternating step by step"
    else:
        schedule = "each round one variant's steps in a row"
    spread = an.round_spread(cost)
    trouble, caveat, untimed = an.timing_trouble(cost), an.timing_caveat(cost), an.no_time_ratio(cost)
    return (
        f"batch {cost['batch']}, {cost['cost_rounds']} interleaved rounds x {cost['cost_steps']} steps, "
        f"{schedule}; a round's time the median of its steps"
        + ("" if any(e.get("round_statistic") == "median step" for e in cost["variants"].values()) else " (mean)")
        + f"; clock: {_CLOCK_NAMES.get(clock, clock)}; ratio: median of the per-round ratios to MHA, "
        f"{an.RATIO_CONFIDENCE:.0%} bootstrap interval over rounds (seed {an.RATIO_SEED}); "
        + _cost_loads(cost)
        + ("" if spread is None else f"; MHA's slowest / fastest round {spread:.2f}x (diagnostic)")
        + (f"; **cannot decide: {trouble}**" if trouble else "")
        + (f"; caveat: {caveat}" if caveat else "")
        + (f"; **no time ratio: {untimed}** (the clock could not time the steps)" if untimed else "")
    )


def cost_table(cost: dict[str, Any]) -> str:
    """Per variant: params, time per step, its ratio to MHA with the interval, wall-clock ratio, memory ratios."""
    clock = _CLOCK_NAMES.get(an.recorded_clock(cost), an.recorded_clock(cost))
    lines = [
        f"| variant | params | ms/step ({clock}, median) | time vs mha | 95% CI | time vs mha (wall) | "
        "activations (KiB) | activations vs mha | train memory vs mha | CUDA peak vs mha |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in cost["variants"].items():
        ratio = an.time_ratio(cost, name)
        ci = "n/a" if ratio is None or ratio["ci"] is None else f"[{ratio['ci'][0]:.2f}, {ratio['ci'][1]:.2f}]"
        # Files before cost_format 2 timed on the wall clock: their ratio is the wall ratio.
        wall = e.get("wall_time_ratio_vs_mha", None if cost.get("cost_format") else e.get("time_ratio_vs_mha"))
        lines.append(
            f"| {name} | {e['params']:,} | {_f(None if e['s_per_step'] is None else 1000 * e['s_per_step'], 2)} | "
            f"{_f(None if ratio is None else ratio['median'], 2)} | {ci} | {_f(wall, 2)} | "
            f"{e['activation_bytes'] / 1024:.0f} | {_f(e.get('activation_ratio_vs_mha'), 2)} | "
            f"{_f(e.get('train_bytes_ratio_vs_mha'), 2)} | {_f(e.get('cuda_peak_ratio_vs_mha'), 2)} |"
        )
    return "\n".join(lines)


def stability_table(results: dict[str, Any]) -> str:
    lines = [
        "| variant | runs | divergences (chosen lr / whole sweep) | failed to learn (chosen lr / whole sweep) "
        "| loss spikes | seed std | seed range |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in an.stability(results):
        stuck = "-" if r["not_learned"] is None else f"{r['not_learned']} / {r['sweep_not_learned']}"
        lines.append(
            f"| {r['variant']} | {r['runs']} | {r['divergences']} / {r['sweep_divergences']} | {stuck} | "
            f"{r['loss_spikes']} | {_f(r['seed_std'])} | {_f(r['seed_range'][0])} - {_f(r['seed_range'][1])} |"
        )
    thresholds = results.get("config", {}).get("thresholds") or []
    if thresholds:
        lines += [
            "",
            f"Failed to learn: runs whose validation {results.get('metric', 'metric')} never reached "
            f"{float(thresholds[0]):g} (the task's first threshold); such a run neither diverges nor spikes.",
        ]
    return "\n".join(lines)


def threshold_table(results: dict[str, Any]) -> str:
    rows = an.threshold_summary(results)
    if not rows:
        return ""
    lines = [
        "| variant | val threshold | seeds reaching | median steps | steps saved vs mha [95% CI] |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        c = r.get("vs_mha")
        vs = "-" if c is None else f"{c['mean']:+.0f} {_ci(c, 0)}"
        median = "-" if r["median_steps"] is None else f"{r['median_steps']:.0f}"
        lines.append(f"| {r['variant']} | {r['threshold']:g} | {r['reached']}/{r['n']} | {median} | {vs} |")
    return "\n".join(lines)


def sweep_threshold_table(results: dict[str, Any]) -> str:
    rows = an.sweep_thresholds(results)
    if not rows:
        return ""
    lrs = sorted({lr for r in rows for lr in r["median_steps_by_lr"]})
    lines = [
        "| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | fastest |",
        "| --- | " + " | ".join("---:" for _ in lrs) + " | ---: |",
    ]
    for r in rows:
        cells = []
        for lr in lrs:
            if lr not in r["median_steps_by_lr"]:
                cells.append("-")  # not in this variant's sweep
                continue
            m = r["median_steps_by_lr"][lr]
            cell = "never" if m is None else f"{m:.0f}"
            cells.append(f"**{cell}**" if lr == r["chosen_lr"] else cell)
        fastest = "never" if r["fastest"] is None else f"{r['fastest']:.0f}"
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {fastest} |")
    return "\n".join(lines)


def changed_environments(
    folder: Path, results: list[dict[str, Any]], damaged: list[tuple[str, str]] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """The runs that ran in more than one environment (resumed from a checkpoint on another
    machine or other versions), from the results files' runs and every ``runs/**/result.json``
    under ``folder`` (the sweep's other rates are only there), each once; and how many runs
    record no environment (written before runs recorded theirs). A ``result.json`` that is not
    valid JSON (cut off mid-write), no object, or an object lacking one of ``RESULT_FIELDS`` is
    skipped, and appended to ``damaged`` as (path, why) when that is a list: an unfinished run,
    which its command recreates."""
    seen: set[tuple] = set()
    rows: list[dict[str, Any]] = []
    unrecorded = 0

    def add(task: Any, preset: Any, run: dict[str, Any]) -> None:
        nonlocal unrecorded
        key = (task, preset, run.get("variant"), run.get("lr"), run.get("seed"))
        if key in seen:
            return
        seen.add(key)
        changes = an.environment_changes(run)
        if changes is None:
            unrecorded += 1
        elif changes:
            rows.append(dict(zip(("task", "preset", "variant", "lr", "seed"), key), changes=changes))

    for res in results:
        for name, entry in res.get("variants", {}).items():
            for run in entry.get("runs", []):
                add(res.get("task"), res.get("preset"), {"variant": name, **run})
    for path in sorted((folder / "runs").glob("**/result.json")):
        try:
            run = read_json_object(path)
            if run is None:  # removed since the glob listed it
                continue
            # A field missing: its command treats the run as unfinished (_train._read_result), so
            # the report must not count it as a whole run either.
            require_fields(path, run, RESULT_FIELDS)
            if not isinstance(run["identity"], dict):
                raise JsonFileError(path, f"holds an identity that is not a JSON object ({run['identity']!r})")
        except JsonFileError as exc:
            if damaged is not None:
                damaged.append((str(path), exc.reason))
            continue
        config = run["identity"].get("config", {})
        if isinstance(config, dict) and "task" in config:
            add(config["task"], config.get("preset"), run)
    rows.sort(key=lambda r: tuple(str(r[k]) for k in ("task", "preset", "variant", "lr", "seed")))
    return rows, unrecorded


def environment_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| task | variant | lr | seed | what changed |", "| --- | --- | ---: | ---: | --- |"]
    for r in rows:
        task = r["task"] if r["preset"] is None else f"{r['task']} ({r['preset']})"
        lr = "?" if r["lr"] is None else f"{r['lr']:g}"
        lines.append(f"| {task} | {r['variant']} | {lr} | {r['seed']} | {'; '.join(r['changes'])} |")
    return "\n".join(lines)


def load_folder(
    folder: Path, skipped: list[tuple[Path, str]] | None = None
) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict], dict[str, dict]]:
    """(headline, ablation, cost, ablation_cost) results found in ``folder``, keyed by task.

    ``cost`` holds the headline suite's cost files (``TASK_cost.json``; a file that records no suite
    is a headline one, as every cost file was before suites), ``ablation_cost`` the ablation suite's
    (``TASK_ablation_cost.json``): claim 3 and the headline tables read the first only.

    JSON files of other kinds (this report's own ``report.json``, notes) are
    ignored; such a ``*.json`` that cannot be read or parsed is skipped and, when
    ``skipped`` is a list, appended to it as (path, why). A file named as a
    results or cost file (``results_file_names``) that cannot be read, is not
    valid JSON (cut off mid-write) or holds no JSON object raises
    ``DamchaValueError``, as does a file of the results format without a task or
    without variants: the report would silently lack that task, or show an empty
    table.
    """
    headline: dict[str, dict] = {}
    ablation: dict[str, dict] = {}
    cost: dict[str, dict] = {}
    ablation_cost: dict[str, dict] = {}
    ours = results_file_names()
    for path in sorted(folder.glob("*.json")):
        try:
            obj = read_json_object(path)
        except JsonFileError as exc:
            if path.name in ours:
                raise DamchaValueError(
                    f"{exc}: the report would lack it; restore it, or rerun the command that writes it "
                    "(finished runs are read back from runs/)"
                ) from None
            # Valid JSON of another kind (notes) is ignored; a damaged file is named.
            if skipped is not None and not isinstance(exc, NotAJsonObject):
                skipped.append((path, exc.reason))
            continue
        if not isinstance(obj, dict) or obj.get("format") != RESULTS_FORMAT:
            if path.name in ours:
                # Named as a results or cost file but of another kind (a hand edit, a file of an older
                # format): skipping it would silently draw the verdicts without that task.
                raise DamchaValueError(
                    f"{path} is named as a results file but holds no {RESULTS_FORMAT} results (format "
                    f"{obj.get('format') if isinstance(obj, dict) else None!r}): the report would lack it; "
                    "restore it, or rerun the command that writes it (finished runs are read back from runs/)"
                )
            continue
        variants = obj.get("variants")
        if not isinstance(obj.get("task"), str) or not isinstance(variants, dict) or not variants:
            raise DamchaValueError(
                f"{path} is a {RESULTS_FORMAT} file with no results (task {obj.get('task')!r}, "
                f"{len(variants) if isinstance(variants, dict) else 'no'} variants); expected a task and at "
                "least one variant: delete it or rerun the experiment"
            )
        check_results_object(path, obj)  # a field the report reads is missing: named, not a KeyError
        if obj.get("kind") == "cost":
            (ablation_cost if obj.get("suite") == "ablation" else cost)[obj["task"]] = obj
        elif obj.get("suite") == "ablation":
            ablation[obj["task"]] = obj
        elif obj.get("suite") == "headline":
            headline[obj["task"]] = obj
    return headline, ablation, cost, ablation_cost


def build_report(folder: str | Path, tolerance: float = an.OVERHEAD_TOLERANCE) -> tuple[str, dict[str, Any]]:
    """The markdown tables and verdicts for every results file in ``folder``, and the same as JSON."""
    folder = Path(folder)
    headline, ablation, cost, ablation_cost = load_folder(folder)
    verdicts = an.verdicts(headline, ablation, cost, tolerance)
    md = ["# Experiment report (generated by `damcha experiment report`)", ""]
    md.append("## Verdicts")
    md.append("")
    md.append("| claim | verdict | why |")
    md.append("| --- | :---: | --- |")
    for v in verdicts:
        md.append(f"| {v['claim']}. {v['title']} | **{v['verdict']}** | {v['reason']} |")
    md.append("")
    md.append("Rules:")
    md.append("")
    for v in verdicts:
        md.append(f"* Claim {v['claim']}: {v['rule']}")
    md.append("")
    secondary = [(v["claim"], v[key]) for v in verdicts for key in ("secondary", "sign_flip") if v.get(key)]
    if secondary:
        md += ["Secondary analyses (questions a reviewer may ask of the rules; the verdicts above are the rules'):", ""]
        md += [f"* Claim {claim}, {s['question']}: {s['text']}." for claim, s in secondary]
        md.append("")
    md.append(an.__doc__.split("Decisions (the rules the report states):")[1].strip().replace("\n\n", "\n"))
    damaged: list[tuple[str, str]] = []
    changed, unrecorded = changed_environments(folder, [*headline.values(), *ablation.values()], damaged)
    md += [
        "",
        "## Runs whose environment changed",
        "",
        "A run resumed from its checkpoint in another environment (versions, CPU, threads, device) equals an "
        "uninterrupted one only up to the last bits.",
        "",
        environment_table(changed) if changed else "None.",
    ]
    if unrecorded:
        md += ["", f"Runs that record no environment (written before runs recorded theirs; unknown): {unrecorded}."]
    if damaged:
        md += [
            "",
            f"Run results that could not be read (cut off mid-write?) or lack a field (not listed above, recreated "
            f"when their command reruns): {', '.join(f'`{Path(p).relative_to(folder)}` ({why})' for p, why in damaged)}.",
        ]
    summary: dict[str, Any] = {
        "verdicts": verdicts,
        "environment_changes": changed,
        "runs_without_environment": unrecorded,
        "damaged_run_results": damaged,
        "tasks": {},
    }
    for task, res in headline.items():
        c = cost.get(task)
        s = stem(res)
        md += [
            "",
            f"## {task} ({res['preset']}, {res['device']}): {res['config']['description']}",
            "",
            f"Metric: test {res['metric']} ({'higher' if res['higher_is_better'] else 'lower'} is better) at each "
            f"run's best validation step; {res['seeds']} paired seeds; parameter budget "
            f"{res['config']['param_budget']:,}; margin {res['config']['margin']:g}. Data: {res['data']}.",
            "",
            markdown_table(res, c),
            "",
        ]
        names = [n for n in res["variants"] if n not in an.BASELINES]
        rows = []
        for base in an.BASELINES:
            if base in res["variants"] and names:
                for budget in ("converged", "steps", "time"):
                    rows += an.compare(res, names, base, budget=budget, cost=c)
        if rows:
            md += [
                "Paired comparisons (converged, equal steps, equal training time; the decision is the paired t "
                f"test's, Holm-adjusted, as the rules read it; {SIGN_FLIP_NOTE}):",
                "",
                comparison_table(rows),
                "",
            ]
        fresh = an.fresh_seeds(res)
        fresh_rows = []
        if fresh is not None:
            for base in an.BASELINES:
                if base in fresh["variants"] and names:
                    fresh_rows += an.compare(fresh, names, base)
        if fresh_rows:
            md += [
                "Selection-bias check: the same converged comparison on the seeds that took no part in any "
                "variant's learning-rate choice (fewer seeds, wider intervals):",
                "",
                comparison_table(fresh_rows),
                "",
            ]
        thr = threshold_table(res)
        if thr:
            md += ["Steps to reach a validation threshold:", "", thr, ""]
        sweep_thr = sweep_threshold_table(res)
        if sweep_thr:
            md += [
                f"Steps to validation {res['metric']} {max(res['config']['thresholds']):g} at every rate of "
                "each variant's sweep (median of the sweep seeds; the chosen rate in bold; 'never': some sweep "
                "seed did not reach it):",
                "",
                sweep_thr,
                "",
            ]
        md += ["Stability:", "", stability_table(res), ""]
        if c is not None:
            md += [
                f"Cost per training step ({cost_caption(c)}):",
                "",
                cost_table(c),
                "",
            ]
        md += [f"![{task} curves]({s}_curves.png) ![{task} time]({s}_time.png) ![{task} final]({s}_final.png)", ""]
        summary["tasks"][task] = {
            "comparisons": rows,
            "fresh_seed_comparisons": fresh_rows,
            "stability": an.stability(res),
            "thresholds": an.threshold_summary(res),
            "sweep_thresholds": an.sweep_thresholds(res),
        }
    for task, res in ablation.items():
        s = stem(res)
        md += ["", f"## Ablations on {task} ({res['preset']})", "", markdown_table(res, ablation_cost.get(task)), ""]
        from ._variants import ABLATION_REFERENCE

        rows = []
        by_ref: dict[str, list[str]] = {}
        for name, ref in ABLATION_REFERENCE.items():
            if name in res["variants"] and ref in res["variants"]:
                by_ref.setdefault(ref, []).append(name)
        for ref, names in by_ref.items():
            rows += an.compare(res, names, ref)
        if rows:
            md += [
                "Each ablation against the variant it changes (paired, converged, Holm within each reference):",
                "",
                comparison_table(rows),
                "",
            ]
        md += ["Stability:", "", stability_table(res), "", f"![{task} ablation]({s}_final.png)", ""]
        summary.setdefault("ablations", {})[task] = {"comparisons": rows, "stability": an.stability(res)}
    return "\n".join(md) + "\n", summary
