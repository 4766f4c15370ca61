"""DamchaAttention vs nn.MultiheadAttention on CPU: time and peak memory ratios.

Usage:
    .venv/bin/python benchmarks/bench_torch.py [--lengths 256 1024 4096] [--repeats 5] [--threads T]
    .venv/bin/python benchmarks/bench_torch.py --report [FILE...]   # rewrite the docs table only
    .venv/bin/python benchmarks/bench_torch.py --tiny   # seconds: checks the script, measures nothing

Self-attention, float32, B=4, E=512, H=8 (d=64), need_weights=False on both
sides: MHA takes its fused path (the native fused kernel in inference, SDPA
in training) and DamchaAttention its single SDPA call. "forward" is eval mode
under ``torch.inference_mode``; "fwd+bwd" is train mode (dropout 0) with a
backward of sum(output).

Times: both layers are built in this process and called alternately (A B,
then B A: ``_harness.interleaved``), ``--repeats`` rounds after a warm-up
(half as many, at least 3, at N=4096), so load drifts on a shared machine hit
both; the table gives the medians of wall time and of process CPU time (all
threads) and their ratios DAMCHA / MHA.
Peak memory: each (implementation, N, mode) runs once more in a fresh
subprocess; after a warm-up call the kernel's high-water mark (VmHWM) is reset
and the RSS noted, then one call runs. glibc is told to mmap every block >=
64 KiB, so freed tensors leave the RSS at once and the high-water mark tracks
the peak of live memory.

Each run writes ``benchmarks/results/torch-<date>-<time>.json`` (``--json FILE``;
``--tiny``: a temporary file unless ``--json`` is given) with the machine,
versions, threads, command, commit, load and every round's times and every
peak, then (not with ``--tiny`` or ``--no-docs``) rewrites its block of
docs/benchmarks.md from that file (``_ports_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

import _harness as h  # benchmarks/ is sys.path[0]
import _ports_report as pr

B, E, H = 4, 512, 8
MODES = ("forward", "fwd+bwd")
IMPLS = ("mha", "damcha")
TARGET = 1.10  # this script's own targets at N=4096: time and memory ratios
MEMORY_METHOD = "peak RSS increase of one call after a warm-up call, in a fresh process (MALLOC_MMAP_THRESHOLD_=65536)"


def _make(impl: str, n: int, mode: str):
    """The layer and a call running one forward (or forward+backward) on fresh input."""
    import torch
    from torch import nn

    from damcha_torch import DamchaAttention

    torch.manual_seed(0)
    if impl == "mha":
        layer = nn.MultiheadAttention(E, H, batch_first=True)
    else:
        layer = DamchaAttention(E, H, batch_first=True)
        with torch.no_grad():
            layer.metric_gates["qk"].fill_(0.5)  # an open map costs the same, but is honest
    layer.train(mode == "fwd+bwd")
    x = torch.randn(B, n, E, requires_grad=mode == "fwd+bwd")

    def call() -> None:
        if mode == "forward":
            with torch.inference_mode():
                layer(x, x, x, need_weights=False)
        else:
            out, _ = layer(x, x, x, need_weights=False)
            out.sum().backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)

    return call


def rounds(n: int, repeats: int) -> int:
    """Timed rounds at length ``n``: N=4096 calls take seconds, so half as many (at least 3)."""
    return repeats if n < 4096 else max(3, repeats // 2)


def measure(n: int, mode: str, repeats: int, *, tiny: bool, threads: int, memory: bool = True) -> dict[str, Any]:
    """One entry: every round's wall and CPU seconds of both layers and, with ``memory``,
    each layer's peak (``--tiny``: MHA's in a worker process, DAMCHA's here, a check of
    both paths)."""
    r = rounds(n, repeats)
    times = h.interleaved({impl: _make(impl, n, mode) for impl in IMPLS}, repeats=r, warmup=1)
    entry: dict[str, Any] = {
        "id": f"torch/{mode}/N={n}",
        "section": "layer",
        "N": n,
        "mode": mode,
        "shape": {"B": B, "N": n, "E": E, "H": H},
        "rounds": r,
        "times": times,
    }
    if memory:
        peaks = {}
        for impl in IMPLS:
            if tiny and impl != "mha":
                peaks[impl] = h.measure_peak(_make(impl, n, mode))
                continue
            argv = [os.path.abspath(__file__), "--worker", impl, str(n), mode, "--threads", str(threads)]
            peaks[impl] = float(h.peak_in_subprocess(argv + (["--tiny"] if tiny else []))["peak_mib"])
        entry["memory"] = {"method": MEMORY_METHOD, "mib": peaks}
    return entry


def _memory_ratio(entry: dict[str, Any]) -> float | None:
    mib = entry.get("memory", {}).get("mib")
    return mib["damcha"] / mib["mha"] if mib and mib["mha"] > 0 else None  # (tiny sizes can peak at 0 MiB)


def table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's table: medians of each layer's rounds, the ratios of the medians, the peaks."""
    shape = entries[0]["shape"]
    lines = [
        f"B={shape['B']}, E={shape['E']}, H={shape['H']}, float32, CPU, {run['threads']} threads; time: median of "
        "the rounds (both layers called alternately after a warm-up call); peak: RSS increase of one call "
        "in a fresh process.",
        "",
        "| N | mode | rounds | MHA wall ms | DAMCHA wall ms | wall ratio | MHA CPU ms | DAMCHA CPU ms | CPU ratio "
        "| MHA peak MiB | DAMCHA peak MiB | memory ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    at_target = []
    for e in sorted(entries, key=lambda e: (e["N"], MODES.index(e["mode"]))):
        t = e["times"]
        wall, cpu, mem = pr.ratio_of_medians(t, "damcha", "mha"), pr.ratio_of_medians(t, "damcha", "mha", "cpu"), None
        peaks = "- | - | -"
        if "memory" in e:
            mem = _memory_ratio(e)
            mib = e["memory"]["mib"]
            peaks = f"{mib['mha']:.1f} | {mib['damcha']:.1f} | " + ("-" if mem is None else f"{mem:.2f}")
        lines.append(
            f"| {e['N']} | {e['mode']} | {len(t['mha']['wall'])} | {pr.median_ms(t['mha']['wall']):.0f} | "
            f"{pr.median_ms(t['damcha']['wall']):.0f} | {wall:.2f} | {pr.median_ms(t['mha']['cpu']):.0f} | "
            f"{pr.median_ms(t['damcha']['cpu']):.0f} | {cpu:.2f} | {peaks} |"
        )
        if e["N"] == 4096:
            at_target.append(
                f"{e['mode']} wall {wall:.2f} ({pr.verdict(wall, TARGET)}), memory "
                + ("-" if mem is None else f"{mem:.2f}")
                + f" ({pr.verdict(mem, TARGET)})"
            )
    lines.append("")
    lines.append(pr.target_sentence(TARGET, at_target, met="wall and memory ratios", unmeasured="ratios "))
    return lines


PORT = pr.Port("torch", "bench_torch.py", [pr.Block("torch", "PyTorch layer", table)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) of the process")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, 2 repeats: checks the script, measures nothing"
    )
    PORT.add_output_arguments(parser)
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    global B, E, H
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    threads = h.fix_threads(args.threads)  # before torch is imported
    if args.tiny:
        B, E, H = 2, 32, 4
        args.lengths, args.repeats = [16], 2
    if args.worker:
        impl, n, mode = args.worker
        print(json.dumps({"peak_mib": h.measure_peak(_make(impl, int(n), mode))}))
        return 0
    with contextlib.ExitStack() as stack:
        results = PORT.open(args, stack)
        if results is None:
            return 2
        import torch

        run = PORT.start(
            results,
            argv,
            tiny=args.tiny,
            threads=args.threads,
            torch_threads=torch.get_num_threads(),
            affinity=threads.get("affinity"),
            shape={"B": B, "E": E, "H": H},
            lengths=args.lengths,
            repeats=args.repeats,
        )
        for n in args.lengths:
            for mode in MODES:
                # Tiny measures nothing: one pair of peaks checks both memory paths.
                memory = not args.tiny or mode == MODES[0]
                entry = measure(n, mode, args.repeats, tiny=args.tiny, threads=args.threads, memory=memory)
                PORT.record(results, run, entry)
                print(f"  {entry['id']}: done", flush=True)
        return PORT.finish(results, run, args)


if __name__ == "__main__":
    sys.exit(main())
