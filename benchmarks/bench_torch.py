"""DamchaAttention vs nn.MultiheadAttention on CPU: time and peak memory ratios.

Usage:
    .venv/bin/python benchmarks/bench_torch.py [--lengths 256 1024 4096] [--repeats 5]
    .venv/bin/python benchmarks/bench_torch.py --tiny   # seconds: checks the script, measures nothing

Self-attention, float32, B=4, E=512, H=8 (d=64), need_weights=False on both
sides: MHA takes its fused path (the native fused kernel in inference, SDPA
in training) and DamchaAttention its single SDPA call. "forward" is eval mode
under ``torch.inference_mode``; "fwd+bwd" is train mode (dropout 0) with a
backward of sum(output).

Times: both layers are built in this process and called alternately
(``--repeats`` rounds after a warm-up; half as many, at least 3, at N=4096),
so load drifts on a shared machine hit both; the medians of wall time and of
process CPU time (all threads) are reported.
Peak memory: each (implementation, N, mode) runs once more in a fresh
subprocess; after a warm-up call the kernel's high-water mark (VmHWM) is reset
and the RSS noted, then one call runs. glibc is told to mmap every block >=
64 KiB, so freed tensors leave the RSS at once and the high-water mark tracks
the peak of live memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # benchmarks/ is sys.path[0]

B, E, H = 4, 512, 8


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


def peak_memory(impl: str, n: int, mode: str) -> float:
    """Peak RSS increase (MiB) of one call after a warm-up, in this (fresh) process."""
    call = _make(impl, n, mode)
    call()  # warm-up: lazy library loading and first-touch pages stay out of the peak
    reset_peak_rss()
    base = rss_bytes()
    call()
    return (peak_rss_bytes() - base) / 2**20


def time_pair(n: int, mode: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU ms of MHA and DAMCHA, calls alternating so that load
    drifts hit both. CPU time (all threads of this process) is the steadier
    measure on a shared machine: waiting for a core is not counted."""
    calls = {impl: _make(impl, n, mode) for impl in ("mha", "damcha")}
    wall: dict[str, list[float]] = {impl: [] for impl in calls}
    cpu: dict[str, list[float]] = {impl: [] for impl in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(repeats):
        for impl, call in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            call()
            wall[impl].append(time.perf_counter() - w0)
            cpu[impl].append(time.process_time() - c0)
    return {
        impl: {"wall": 1e3 * statistics.median(wall[impl]), "cpu": 1e3 * statistics.median(cpu[impl])} for impl in calls
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, 2 repeats: checks the script, measures nothing"
    )
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        global B, E, H
        B, E, H = 2, 32, 4
        args.lengths, args.repeats = [16], 2
    if args.worker:
        impl, n, mode = args.worker
        print(json.dumps({"peak_mb": peak_memory(impl, int(n), mode)}))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    import torch  # only for the header

    print(
        f"<!-- {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()} -->"
    )
    print(
        f"B={B}, E={E}, H={H}, float32, CPU; time: median of {args.repeats} alternating calls "
        f"({max(3, args.repeats // 2)} at N=4096); "
        "peak: RSS increase of one call in a fresh process\n"
    )
    print(
        "| N | mode | MHA wall ms | DAMCHA wall ms | wall ratio | MHA CPU ms | DAMCHA CPU ms | CPU ratio "
        "| MHA peak MiB | DAMCHA peak MiB | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        for mode in ("forward", "fwd+bwd"):
            peak = {"mha": float("nan"), "damcha": float("nan")}
            for impl in () if args.tiny and mode != "forward" else ("mha", "damcha"):  # tiny: one pair
                if args.tiny and impl != "mha":
                    # Tiny measures nothing: one worker process checks that path, the rest run here.
                    peak[impl] = peak_memory(impl, n, mode)
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, str(n), mode]
                cmd += ["--tiny"] if args.tiny else []
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                peak[impl] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
            t = time_pair(n, mode, args.repeats if n < 4096 else max(3, args.repeats // 2))
            m, d = t["mha"], t["damcha"]
            print(
                f"| {n} | {mode} | {m['wall']:.0f} | {d['wall']:.0f} | {d['wall'] / m['wall']:.2f} | "
                f"{m['cpu']:.0f} | {d['cpu']:.0f} | {d['cpu'] / m['cpu']:.2f} | "
                f"{peak['mha']:.1f} | {peak['damcha']:.1f} | "
                + (f"{peak['damcha'] / peak['mha']:.2f} |" if peak["mha"] > 0 else "- |"),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
