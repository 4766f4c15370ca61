"""A suite: every variant of a task with its own learning-rate sweep and paired seeds.

For each variant, seeds ``0..sweep_seeds-1`` train at every learning rate of
the preset's grid; the rate with the best mean validation score (the best
validation metric of each run, i.e. after early stopping) is chosen; then
the remaining seeds train at that rate only. The test metric is read at each
run's best-validation evaluation, so the test set never takes part in a
decision. Every run lives in its own folder under ``<out>/runs`` and is
resumable; rerunning the same command skips finished runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._models import Variant
from ._provenance import code_version, utc_now
from ._stats import describe
from ._tasks import RESULTS_FORMAT, TaskConfig, TaskData
from ._train import check_run_dir, model_width, run_environment, run_identity, train_run
from ._variants import get_variant


def run_group(out: Path, cfg: TaskConfig, device_type: str) -> Path:
    """The folder of ``cfg``'s task and preset's runs on a device type: ``out/runs/TASK-PRESET-DEVICE``."""
    return out / "runs" / f"{cfg.task}-{cfg.preset}-{device_type}"


def run_folder(out: Path, cfg: TaskConfig, device: torch.device, variant: str, lr: float, seed: int) -> Path:
    return run_group(out, cfg, device.type) / variant / f"lr{lr:g}" / f"seed{seed}"


def runs_by_device(out: Path, cfg: TaskConfig, variants: list[str]) -> dict[str, int]:
    """How many run folders of ``variants`` (any rate and seed) at ``cfg``'s task and preset hold a
    result or a checkpoint, per device type (from the folder names, ``run_group``); types with none
    are left out. Reads no file, so it needs no GPU."""
    prefix = f"{cfg.task}-{cfg.preset}-"  # task and preset names hold no "-"
    counts: dict[str, int] = {}
    for group in sorted((out / "runs").glob(f"{prefix}*")):
        n = sum(
            (folder / "result.json").exists() or (folder / "checkpoint.pt").exists()
            for name in variants
            for folder in (group / name).glob("lr*/seed*")
        )
        if n:
            counts[group.name[len(prefix) :]] = n
    return counts


def choose_lr(cfg: TaskConfig, sweep: dict[float, list[dict[str, Any]]]) -> float:
    """The rate with the best mean best-validation score over the sweep seeds; ties -> lower val loss, then lower rate.

    A rate where any sweep run diverged is only chosen if every rate diverged.
    """

    def key(lr: float) -> tuple:
        runs = sweep[lr]
        vals = np.array([r["best_val_metric"] for r in runs], dtype=float)
        losses = np.array([r["best_val_loss"] for r in runs], dtype=float)
        ok = all(not r["diverged"] for r in runs) and np.isfinite(vals).all()
        score = vals.mean() if cfg.higher_is_better else -vals.mean()
        return (
            ok,
            score if np.isfinite(score) else -math.inf,
            -losses.mean() if np.isfinite(losses).all() else -math.inf,
            -lr,
        )

    return max(sweep, key=key)


def check_resumable(data: TaskData, variants: list[str], out: Path, device: torch.device) -> None:
    """Raise ``RunSettingsMismatch`` if any run folder this suite could resume holds another run's files.

    Every (variant, rate, seed) folder of the grid is checked before the first
    step, so a stale ``--out`` fails at once rather than after the runs before
    it have trained. A folder of a rate outside the grid is never read by this
    suite and is left alone.
    """
    cfg = data.cfg
    for name in variants:
        variant = get_variant(name)
        width = None
        for lr in cfg.lrs:
            for seed in range(cfg.seeds):
                folder = run_folder(out, cfg, device, name, lr, seed)
                if not ((folder / "result.json").exists() or (folder / "checkpoint.pt").exists()):
                    continue
                if width is None:
                    width, _ = model_width(data, variant)
                check_run_dir(folder, run_identity(cfg, variant, lr, seed, width, device))


def run_variant(
    data: TaskData,
    variant: Variant,
    *,
    out: Path | None,
    device: torch.device,
    should_stop: Callable[[int], bool] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Sweep, choose and train all seeds of one variant; returns its results entry."""
    cfg = data.cfg
    width, params = model_width(data, variant)

    def one(lr: float, seed: int) -> dict[str, Any]:
        folder = run_folder(out, cfg, device, variant.name, lr, seed) if out is not None else None
        r = train_run(
            data,
            variant,
            lr,
            seed,
            width,
            device=device,
            run_dir=folder,
            should_stop=should_stop,
            head_maps=(seed == 0 and variant.kind == "damcha"),
        )
        if progress is not None:
            progress(
                f"{variant.name} lr={lr:g} seed={seed}: best val {cfg.metric} {r['best_val_metric']:.4f} "
                f"at step {r['best_step']}, stopped at {r['steps']} ({r['stop_reason']})"
            )
        return r

    sweep_seeds = range(cfg.sweep_seeds)
    sweep = {lr: [one(lr, s) for s in sweep_seeds] for lr in cfg.lrs}
    chosen = choose_lr(cfg, sweep) if len(cfg.lrs) > 1 else cfg.lrs[0]
    runs = list(sweep[chosen]) + [one(chosen, s) for s in range(cfg.sweep_seeds, cfg.seeds)]
    maps = runs[0].pop("head_maps", None)
    for r in runs:
        r.pop("head_maps", None)
        r.pop("identity", None)
    tests = [r["test_metric"] for r in runs]
    return {
        "variant": dataclasses.asdict(variant),
        "kind": variant.kind,
        "description": variant.description,
        "params": params,
        "mlp_hidden": width,
        "lr_sweep": {
            "lrs": list(cfg.lrs),
            "seeds": list(sweep_seeds),
            "chosen_lr": chosen,
            "runs": [
                {
                    "lr": lr,
                    "seed": r["seed"],
                    "best_val_metric": r["best_val_metric"],
                    "best_val_loss": r["best_val_loss"],
                    "best_step": r["best_step"],
                    "steps": r["steps"],
                    "stop_reason": r["stop_reason"],
                    "steps_to_threshold": r["steps_to_threshold"],
                }
                for lr, rs in sweep.items()
                for r in rs
            ],
        },
        "chosen_lr": chosen,
        "test": describe(tests),
        "val": describe([r["best_val_metric"] for r in runs]),
        "steps": describe([r["steps"] for r in runs]),
        "divergences": int(sum(r["diverged"] for r in runs)),
        "sweep_divergences": int(sum(r["diverged"] for rs in sweep.values() for r in rs)),
        "loss_spikes": int(sum(r["loss_spikes"] for r in runs)),
        "time_per_step_s": float(np.mean([r["time_per_step_s"] for r in runs])),
        "cpu_per_step_s": float(np.mean([r["cpu_per_step_s"] for r in runs])),
        "runs": runs,
        "head_maps_seed0": maps,
    }


def environment(device: torch.device) -> dict[str, Any]:
    """A run's environment (``run_environment``) with the date and the load average at this moment."""
    env = run_environment(device) | {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if hasattr(os, "getloadavg"):
        env["loadavg"] = list(os.getloadavg())
    return env


def run_suite(
    cfg: TaskConfig,
    variants: list[str],
    suite: str,
    *,
    out: Path | None,
    device: torch.device | str = "cpu",
    should_stop: Callable[[int], bool] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train ``variants`` on ``cfg``'s task; returns the plain-JSON results of the suite.

    Beside the results: ``code_version`` (git commit and dirty flag of this package's checkout, or
    None; ``_provenance``) and ``started_utc``/``finished_utc`` of this call."""
    device = torch.device(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    started_utc, code = utc_now(), code_version()
    env = environment(device)
    data = TaskData(cfg)
    if out is not None:
        check_resumable(data, variants, Path(out), device)
    results = {
        name: run_variant(data, get_variant(name), out=out, device=device, should_stop=should_stop, progress=progress)
        for name in variants
    }
    return {
        "format": RESULTS_FORMAT,
        "task": cfg.task,
        "suite": suite,
        "preset": cfg.preset,
        "device": device.type,
        "config": dataclasses.asdict(cfg),
        "metric": cfg.metric,
        "higher_is_better": cfg.higher_is_better,
        "seeds": cfg.seeds,
        "data": data.info,
        "variants": results,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "environment": env,
        # Provenance of this command (each run records its own too): docs/experiments.md, "Provenance".
        "code_version": code,
        "started_utc": started_utc,
        "finished_utc": utc_now(),
    }


def run_experiment(
    task: str,
    variants: list[str] | None = None,
    seeds: int = 3,
    steps: int | None = None,
    eval_size: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Deprecated (one release): ``run_suite(task_config(task, "default", ...), variants, "headline", out=None)``.

    Kept so that code written against the first version keeps running; it
    returns the current results format. ``steps`` is now the hard step limit
    (``max_steps``) of the plateau rule, ``eval_size`` the validation and test
    size.
    """
    import warnings

    from ._tasks import task_config
    from ._variants import HEADLINE

    warnings.warn(
        "damcha_experiments.run_experiment is deprecated; use run_suite(task_config(task, preset, ...), "
        "variants, suite, out=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    cfg = task_config(task, "default", seeds=seeds, max_steps=steps, val_size=eval_size, test_size=eval_size)
    return run_suite(cfg, list(variants or HEADLINE), "headline", out=None)
