"""Writing results: the JSON file and the PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# Small figures at low dpi: the PNGs are committed to the repository.
_DPI = 72


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json`` and the plots into ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = results["task"]
    paths = {"json": out / f"{task}.json"}
    paths["json"].write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    paths["curves"] = plot_curves(results, out / f"{task}_curves.png")
    paths["final"] = plot_final(results, out / f"{task}_final.png")
    heat = plot_head_maps(results, out / f"{task}_metric.png")
    if heat is not None:
        paths["metric"] = heat
    return paths


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Validation metric vs step: mean over seeds with a +-1 std band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results["variants"].items():
        steps = np.array(r["runs"][0]["curve"]["step"])
        values = np.array([run["curve"]["val_metric"] for run in r["runs"]])
        mean, std = values.mean(0), values.std(0)
        ax.plot(steps, mean, label=name, lw=1.3, ls="--" if r["kind"] != "damcha" else "-")
        ax.fill_between(steps, mean - std, mean + std, alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel(results["metric"].replace("_", " "))
    ax.set_title(f"{results['task']}: validation ({results['seeds']} seeds, mean +- std)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_final(results: dict[str, Any], path: Path) -> Path:
    """Final metric per variant with std error bars and each seed as a dot."""
    plt = _pyplot()
    names = list(results["variants"])
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, name in enumerate(names):
        r = results["variants"][name]
        ax.bar(i, r["mean"], yerr=r["std"], color="C0" if r["kind"] == "damcha" else "C7", alpha=0.7, capsize=3)
        finals = [run["final_metric"] for run in r["runs"]]
        ax.scatter([i] * len(finals), finals, s=8, color="k", zorder=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    values = [run["final_metric"] for r in results["variants"].values() for run in r["runs"]]
    lo, hi = min(values), max(values)
    pad = max(hi - lo, 1e-3) * 0.5
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel(results["metric"].replace("_", " "))
    ax.set_title(f"{results['task']}: final {results['metric']} (bars: mean +- std; dots: seeds)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_head_maps(results: dict[str, Any], path: Path) -> Path | None:
    """Heatmaps of l(t) - I, the token-mean learned cross-head part, per (DAMCHA variant, layer), seed 0.

    The identity (MHA) is subtracted because it would dominate the colour
    scale; what is left is diag(g) A(t) averaged over tokens.
    """
    panels = [(name, i, np.array(m) - np.eye(len(m))) for name, r in results["variants"].items()
              for i, m in enumerate(r.get("head_maps_seed0") or [])]
    if not panels:
        return None
    plt = _pyplot()
    layers = max(i for _, i, _ in panels) + 1
    names = sorted({n for n, _, _ in panels}, key=list(results["variants"]).index)
    fig, axes = plt.subplots(len(names), layers, figsize=(1.6 * layers + 2.6, 1.5 * len(names) + 0.6),
                             squeeze=False)
    vmax = max(max(float(np.abs(m).max()) for _, _, m in panels), 1e-6)
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
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def markdown_table(results: dict[str, Any]) -> str:
    """The results table (markdown) that docs/results.md quotes."""
    cmp = {c["variant"]: c for c in results["comparison_vs_mha"]}
    lines = [
        f"| variant | params | {results['metric']} mean +- std | vs mha (diff, z) | exceeds seed noise | ms/step (wall) | ms/step (CPU) |",
        "| --- | ---: | ---: | ---: | :---: | ---: | ---: |",
    ]
    for name, r in results["variants"].items():
        c = cmp.get(name)
        if c is None:
            vs, noise = "-", "-"
        else:
            vs = f"{c['difference']:+.4f}" + (f" (z={c['z']:+.1f})" if c["z"] is not None else "")
            noise = {None: "n/a (1 seed)", True: "yes, " + c["direction"], False: "no"}[c["exceeds_noise"]]
        lines.append(
            f"| {name} | {r['params']:,} | {r['mean']:.4f} +- {r['std']:.4f} | {vs} | {noise} | "
            f"{1000 * r['time_per_step_s']:.1f} | {1000 * r.get('cpu_per_step_s', float('nan')):.1f} |"
        )
    return "\n".join(lines)
