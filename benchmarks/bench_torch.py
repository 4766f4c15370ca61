"""DamchaAttention vs nn.MultiheadAttention on CPU: time and peak memory ratios.

Usage:
    .venv/bin/python benchmarks/bench_torch.py [--lengths 256 1024 4096] [--repeats 3]

Self-attention, float32, B=4, E=512, H=8 (d=64), need_weights=False on both
sides: MHA takes its fused path (the native fused kernel in inference, SDPA
in training) and DamchaAttention its single SDPA call. "forward" is eval mode
under ``torch.inference_mode``; "fwd+bwd" is train mode (dropout 0) with a
backward of sum(output).

Every (implementation, N, mode) runs in a fresh subprocess. Peak memory is
the peak resident-set increase over the timed calls: after a warm-up call,
the kernel's high-water mark (VmHWM) is reset and the RSS noted; glibc is
told to mmap every block >= 64 KiB, so freed tensors leave the RSS at once
and the high-water mark tracks the peak of live memory. Times are the median of ``--repeats`` calls after one warm-up.
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

B, E, H = 4, 512, 8


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    # Linux >= 4.0: writing 5 resets VmHWM, the process's peak RSS, to its current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(impl: str, n: int, mode: str, repeats: int) -> dict:
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

    layer.train(mode == "fwd+bwd")
    call()  # warm-up: lazy library loading and first-touch pages stay out of the peak
    _reset_peak_rss()
    base = _rss_bytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    peak = _peak_rss_bytes() - base
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        impl, n, mode = args.worker
        print(json.dumps(worker(impl, int(n), mode, args.repeats)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    import torch  # only for the header

    print(f"<!-- {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()} -->")
    print(f"B={B}, E={E}, H={H}, float32, CPU; median of {args.repeats}; peak = RSS increase\n")
    print("| N | mode | MHA ms | DAMCHA ms | time ratio | MHA peak MiB | DAMCHA peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        for mode in ("forward", "fwd+bwd"):
            res = {}
            for impl in ("mha", "damcha"):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, str(n), mode, "--repeats", str(args.repeats)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
            m, d = res["mha"], res["damcha"]
            print(f"| {n} | {mode} | {m['ms']:.1f} | {d['ms']:.1f} | {d['ms'] / m['ms']:.2f} | "
                  f"{m['peak_mb']:.1f} | {d['peak_mb']:.1f} | {d['peak_mb'] / m['peak_mb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
