"""``damcha experiment TASK``: train DAMCHA and its baselines, write JSON and plots."""

from __future__ import annotations

import argparse
import sys

from ._train import DEFAULT_VARIANTS, TASKS
from ._models import VARIANTS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="damcha experiment",
        description="Train DAMCHA variants and baselines (MHA, talking-heads) at matched parameter count "
        "over several seeds; write <out>/<task>.json, learning-curve, final-metric and metric-heatmap PNGs.",
    )
    p.add_argument("task", choices=sorted(TASKS), help="which experiment")
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help=f"variants (space or comma separated) from {sorted(VARIANTS)}; default: {' '.join(DEFAULT_VARIANTS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (default 3)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the task's)")
    p.add_argument("--eval-size", type=int, default=None, help="evaluation examples/windows (default: the task's)")
    p.add_argument("--out", default="experiment-results", help="output folder (default ./experiment-results)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--from-json", metavar="PATH", default=None,
                   help="do not train: redraw the plots and table from an earlier results JSON into --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    variants = None
    if args.variants:
        variants = [v for item in args.variants for v in item.split(",") if v]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            print(f"damcha experiment: error: unknown variant(s) {unknown}; expected from {sorted(VARIANTS)}",
                  file=sys.stderr)
            return 2
    for name in ("seeds", "threads"):
        if getattr(args, name) < 1:
            print(f"damcha experiment: error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.steps is not None and args.steps < 1:
        print(f"damcha experiment: error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.from_json:
        import json

        from ._report import markdown_table, write_results

        with open(args.from_json) as f:
            results = json.load(f)
        if results.get("task") != args.task:
            print(f"damcha experiment: error: {args.from_json} holds task {results.get('task')!r}, not {args.task!r}",
                  file=sys.stderr)
            return 2
        paths = write_results(results, args.out)
        print(markdown_table(results))
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    import torch

    from ._report import markdown_table, write_results
    from ._train import run_experiment

    torch.set_num_threads(args.threads)
    results = run_experiment(args.task, variants, args.seeds, args.steps, args.eval_size, progress=not args.no_progress)
    paths = write_results(results, args.out)
    print(markdown_table(results))
    print(f"\nwall time {results['wall_s']:.0f} s (CPU {results['cpu_s']:.0f} s); wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
