"""DAMCHA vs MHA vs talking-heads (head mixing on the attention map): how cost grows with N.

Usage:
    .venv/bin/python benchmarks/bench_headmix.py [--lengths 512 2048 8192] [--repeats 3]
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

B, E, H = 1, 128, 4
IMPLS = ("mha", "damcha", "talking-heads")


def worker(impl: str, n: int, repeats: int) -> dict:
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
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_bytes()
    return {"impl": impl, "n": n, "ms": 1000 * statistics.median(times), "peak_mb": max(0, peak - base) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny lengths, 1 repeat, any failed worker fails the script: checks it, measures nothing",
    )
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.lengths, args.repeats = [16], 1
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.repeats)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows: dict[tuple[str, int], dict] = {}
    for n in args.lengths:
        for impl in IMPLS:
            if args.tiny and impl != IMPLS[0]:
                # Tiny measures nothing: one worker process checks that path, the rest run here.
                rows[(impl, n)] = worker(impl, n, args.repeats)
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", impl, str(n), "--repeats", str(args.repeats)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                rows[(impl, n)] = {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
            else:
                rows[(impl, n)] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"# {impl} N={n}: {rows[(impl, n)]}", file=sys.stderr, flush=True)
    print(
        f"_{datetime.date.today()}, {platform.machine()} {os.cpu_count()} CPUs, torch 1 thread, "
        f"B={B}, E={E}, H={H}, float32, forward+backward, median of {args.repeats}_\n"
    )
    print("| N | impl | fwd+bwd ms | x MHA time | growth vs previous N | peak MB | x MHA memory |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for i, n in enumerate(args.lengths):
        ref = rows[("mha", n)]
        for impl in IMPLS:
            r = rows[(impl, n)]
            if "error" in r:
                print(f"| {n} | {impl} | failed: {r['error'][:60]} | | | | |")
                continue
            prev = rows.get((impl, args.lengths[i - 1])) if i else None
            growth = f"{r['ms'] / prev['ms']:.1f}x" if prev and "ms" in prev else "-"
            t_ratio = f"{r['ms'] / ref['ms']:.2f}" if "ms" in ref else "-"
            m_ratio = f"{r['peak_mb'] / ref['peak_mb']:.1f}" if "peak_mb" in ref and ref["peak_mb"] > 0 else "-"
            print(f"| {n} | {impl} | {r['ms']:.1f} | {t_ratio} | {growth} | {r['peak_mb']:.1f} | {m_ratio} |")
    failed = [key for key, r in rows.items() if "error" in r]
    if args.tiny and failed:
        sys.exit(f"failed workers: {failed}")


if __name__ == "__main__":
    main()
