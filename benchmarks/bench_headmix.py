"""DAMCHA vs MHA vs talking-heads (head mixing on the attention map): how cost grows with N.

Usage:
    .venv/bin/python benchmarks/bench_headmix.py [--lengths 512 2048 8192] [--repeats 3]
    .venv/bin/python benchmarks/bench_headmix.py --report [FILE...]   # rewrite the docs table only
    .venv/bin/python benchmarks/bench_headmix.py --tiny   # seconds: checks the script, measures nothing

Self-attention training step (forward + backward of sum(output)), float32,
B=1, E=128, H=4 (d=32), one torch thread, CPU:

* ``mha``: ``nn.MultiheadAttention(need_weights=False)``, which runs SDPA.
* ``damcha``: ``damcha_torch.DamchaAttention`` (metric "heads", tied, gates
  opened to 0.5 so the map is really applied), one SDPA call.
* ``talking-heads``: ``damcha_experiments.TalkingHeadsAttention`` with random
  mixing; it must materialise the (B, H, N, N) logits and probabilities.

Each (implementation, N) runs in a fresh subprocess. Peak memory is the
resident high-water mark (VmHWM, reset through /proc/self/clear_refs after the
warm-up) minus the resident size before the timed steps: the step's own
activations and gradients. glibc is told to mmap blocks >= 64 KiB so freed
tensors leave the RSS at once.
Times are the median of ``--repeats`` calls after one warm-up.

Each run writes ``benchmarks/results/headmix-<date>-<time>.json`` (``--json
FILE``; ``--tiny``: a temporary file unless ``--json`` is given) with the
machine, versions, command, commit, load, every step's wall and CPU time and
each worker's resident sizes, then (not with ``--tiny`` or ``--no-docs``)
rewrites its block of docs/benchmarks.md from that file (``_ports_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import _ports_report as pr
from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes

B, E, H = 1, 128, 4
IMPLS = ("mha", "damcha", "talking-heads")


def worker(impl: str, n: int, repeats: int) -> dict[str, Any]:
    """Every timed step's wall and CPU seconds and the resident sizes around them, in this process."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if impl == "mha":
        layer = nn.MultiheadAttention(E, H, batch_first=True)
        call = lambda x: layer(x, x, x, need_weights=False)[0]  # noqa: E731
    elif impl == "damcha":
        from damcha_torch import DamchaAttention

        layer = DamchaAttention(E, H, batch_first=True)
        with torch.no_grad():
            layer.metric_gates["qk"].fill_(0.5)
        call = lambda x: layer(x, x, x, need_weights=False)[0]  # noqa: E731
    else:
        from damcha_experiments import TalkingHeadsAttention

        layer = TalkingHeadsAttention(E, H)
        with torch.no_grad():
            layer.logit_mix.normal_()
            layer.weight_mix.normal_()
        call = lambda x: layer(x)[0]  # noqa: E731
    x = torch.randn(B, n, E, requires_grad=True)

    def step() -> None:
        call(x).sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    step()
    # One-time allocations (kernel caches, lazy imports) belong to the warm-up:
    # measure from the steady state, with the kernel's high-water mark reset.
    base = rss_bytes()
    reset_peak_rss()
    wall, cpu = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    peak = peak_rss_bytes()
    return {"wall": wall, "cpu": cpu, "base_bytes": base, "peak_bytes": peak}


def measure(impl: str, n: int, repeats: int, *, in_process: bool) -> dict[str, Any]:
    """One entry: a worker's rounds and resident sizes (in a fresh process unless ``in_process``),
    or the error that stopped it (talking-heads can run out of memory at long N)."""
    entry: dict[str, Any] = {
        "id": f"headmix/{impl}/N={n}",
        "section": "headmix",
        "impl": impl,
        "N": n,
        "shape": {"B": B, "N": n, "E": E, "H": H},
        "rounds": repeats,
    }
    if in_process:
        out = worker(impl, n, repeats)
    else:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", impl, str(n), "--repeats", str(repeats)],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            return {**entry, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        **entry,
        "times": {"wall": out["wall"], "cpu": out["cpu"]},
        "memory": {"base_bytes": out["base_bytes"], "peak_bytes": out["peak_bytes"]},
    }


def step_ms(entry: dict[str, Any]) -> float:
    return pr.median_ms(entry["times"]["wall"])


def peak_mib(entry: dict[str, Any]) -> float:
    """The step's own memory: the high-water mark above the resident size before the steps."""
    m = entry["memory"]
    return max(0, m["peak_bytes"] - m["base_bytes"]) / 2**20


def table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's table: median step time, its ratio to MHA's and growth from the previous N; peak memory."""
    shape = entries[0]["shape"]
    rows = {(e["impl"], e["N"]): e for e in entries}
    lengths = sorted({e["N"] for e in entries})
    lines = [
        f"B={shape['B']}, E={shape['E']}, H={shape['H']}, float32, forward+backward, torch 1 thread, each cell a "
        f"fresh process; median of {entries[0]['rounds']} steps after a warm-up step; peak: resident high-water "
        "mark of the timed steps above the resident size before them.",
        "",
        "| N | impl | fwd+bwd ms | x MHA time | growth vs previous N | peak MiB | x MHA memory |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, n in enumerate(lengths):
        ref = rows.get(("mha", n))
        ref_ok = ref is not None and "error" not in ref
        for impl in IMPLS:
            r = rows.get((impl, n))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {n} | {impl} | failed: {r['error'][:60]} | | | | |")
                continue
            prev = rows.get((impl, lengths[i - 1])) if i else None
            growth = f"{step_ms(r) / step_ms(prev):.1f}x" if prev and "error" not in prev else "-"
            t_ratio = f"{step_ms(r) / step_ms(ref):.2f}" if ref_ok else "-"
            m_ratio = f"{peak_mib(r) / peak_mib(ref):.1f}" if ref_ok and peak_mib(ref) > 0 else "-"
            lines.append(f"| {n} | {impl} | {step_ms(r):.1f} | {t_ratio} | {growth} | {peak_mib(r):.1f} | {m_ratio} |")
    return lines


PORT = pr.Port("headmix", "bench_headmix.py", [pr.Block("headmix", "head-mixing peers", table)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny lengths, 1 repeat, any failed worker fails the script: checks it, measures nothing",
    )
    PORT.add_output_arguments(parser)
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    if args.tiny:
        args.lengths, args.repeats = [16], 1
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.repeats)))
        return 0
    with contextlib.ExitStack() as stack:
        results = PORT.open(args, stack)
        if results is None:
            return 2
        # One torch thread in every worker (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
        run = PORT.start(
            results,
            argv,
            tiny=args.tiny,
            threads=1,
            shape={"B": B, "E": E, "H": H},
            lengths=args.lengths,
            repeats=args.repeats,
        )
        failed = []
        for n in args.lengths:
            for impl in IMPLS:
                # Tiny measures nothing: one worker process checks that path, the rest run here.
                entry = measure(impl, n, args.repeats, in_process=args.tiny and impl != IMPLS[0])
                PORT.record(results, run, entry)
                print(f"  {entry['id']}: " + entry.get("error", "done"), file=sys.stderr, flush=True)
                if "error" in entry:
                    failed.append(entry["id"])
        rc = PORT.finish(results, run, args, failed=failed)
    if args.tiny and failed:
        print(f"failed workers: {failed}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
