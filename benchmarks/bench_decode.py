"""Incremental decoding with a KV cache on CPU: DamchaAttention vs MHA, per token.

Usage:
    .venv/bin/python benchmarks/bench_decode.py [--batch 1 8] [--prompt 512] [--steps 64] [--repeats 5]
                                                [--modes eager compiled] [--threads T]
    .venv/bin/python benchmarks/bench_decode.py --report [FILE...]   # rewrite the docs table only
    .venv/bin/python benchmarks/bench_decode.py --tiny   # seconds: checks the script, measures nothing

One self-attention layer, float32, E=512, H=8 (d=64), eval mode under
``torch.inference_mode``. Each decode fills the cache with a prompt of
``--prompt`` tokens in one call, then decodes ``--steps`` tokens one at a time
(``is_causal=True``, ``need_weights=False``); the time per decoded token is
reported. Four implementations, built from the same MHA weights:

- ``mha-sdpa``: a hand-written MHA decode step, the usual recipe: packed
  q/k/v projection, cache by concatenation, one SDPA call, output projection.
- ``mha-prealloc``: the same hand-written step with its cache in
  ``DamchaKVCache``'s preallocated storage (in-place appends, as DAMCHA's
  steps do): DAMCHA's own per-token work is ``damcha`` / ``mha-prealloc``.
- ``damcha-none``: ``DamchaAttention(metric="none")`` with ``DamchaKVCache``,
  the same code path as DAMCHA without the cross-head map.
- ``damcha``: ``DamchaAttention`` (tied "heads" metric, gates open) with
  ``DamchaKVCache``; the cache stores k~, so a step maps only its own token.

Each mode of ``--modes`` (``eager`` steps, ``compiled``: each step
``torch.compile``d with inductor; ``--compile`` is ``--modes compiled``) and
batch size is one entry: the four decode alternately (A B C D, then D C B A:
``_harness.interleaved``), ``--repeats`` rounds after a warm-up round, so load
drifts hit all of them; the table gives the median time per token of each and
its ratio to ``mha-sdpa``'s.

Each run writes ``benchmarks/results/decode-<date>-<time>.json`` (``--json
FILE``; ``--tiny``: a temporary file unless ``--json`` is given) with the
machine, versions, threads, command, commit, load and every round's per-token
wall and CPU time, then (not with ``--tiny`` or ``--no-docs``) rewrites its
block of docs/benchmarks.md from that file (``_ports_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import _harness as h  # benchmarks/ is sys.path[0]
import _ports_report as pr

E, H = 512, 8
IMPLS = ("mha-sdpa", "mha-prealloc", "damcha-none", "damcha")
MODES = ("eager", "compiled")


def _layers(compile_steps: bool = False):
    import torch
    from _counts import mha_decode_step
    from torch import nn

    from damcha_torch import DamchaAttention, DamchaKVCache

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    plain = DamchaAttention.from_mha(mha, metric="none").eval()
    damcha = DamchaAttention.from_mha(mha).eval()
    with torch.no_grad():
        damcha.metric_gates["qk"].fill_(0.5)  # an open map: the honest cost

    def mha_step(x, cache):
        # The usual hand-written decode step around nn.MultiheadAttention's weights.
        return mha_decode_step(mha, x, cache)

    def damcha_step(layer):
        def step(x, cache):
            return layer(x, x, x, is_causal=True, need_weights=False, kv_cache=cache)[0]

        return step

    steps = {
        "mha-sdpa": (mha_step, list),
        "mha-prealloc": (mha_step, DamchaKVCache),
        "damcha-none": (damcha_step(plain), DamchaKVCache),
        "damcha": (damcha_step(damcha), DamchaKVCache),
    }
    if compile_steps:
        # The cache length becomes a dynamic dim after two sizes: no per-token recompiles.
        steps = {name: (torch.compile(step), new) for name, (step, new) in steps.items()}
    return steps


def _decode_time(step, new_cache, prompt, tokens) -> tuple[float, float]:
    """(wall, CPU) seconds per decoded token of one decode: an untimed prompt, then the timed steps."""
    import torch

    with torch.inference_mode():
        cache = new_cache()
        step(prompt, cache)
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(tokens.shape[1]):
            step(tokens[:, i : i + 1], cache)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return wall / tokens.shape[1], cpu / tokens.shape[1]


def measure(layers: dict[str, Any], mode: str, batch: int, prompt: int, steps: int, repeats: int) -> dict[str, Any]:
    """One entry: every round's per-token wall and CPU seconds of the four implementations."""
    import torch

    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, prompt, E, generator=g)
    tokens = torch.randn(batch, steps, E, generator=g)
    calls = {name: (lambda s=step, n=new: _decode_time(s, n, x, tokens)) for name, (step, new) in layers.items()}
    times = h.interleaved(calls, repeats=repeats, warmup=1, self_timed=True)
    return {
        "id": f"decode/{mode}/B={batch}",
        "section": "decode",
        "mode": mode,
        "B": batch,
        "shape": {"B": batch, "E": E, "H": H, "prompt": prompt, "steps": steps},
        "unit": "seconds per decoded token",
        "rounds": repeats,
        "times": times,
    }


def table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's table: median ms per token of ``mha-sdpa``, the others as ratios of medians to it."""
    shape = entries[0]["shape"]
    lines = [
        f"prompt {shape['prompt']}, {shape['steps']} decoded tokens, E={shape['E']}, H={shape['H']}, float32, CPU, "
        f"{run['threads']} threads; median wall time per token of the rounds (the four decode alternately after "
        "a warm-up round); the other columns as ratios to `mha-sdpa`'s median:",
        "",
        "| B | step | rounds | mha-sdpa ms/token | mha-prealloc | damcha-none | damcha | damcha / mha-prealloc |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in sorted(entries, key=lambda e: (MODES.index(e["mode"]), e["B"])):
        t = e["times"]
        step = "eager" if e["mode"] == "eager" else "`torch.compile`"
        ratios = " | ".join(f"{pr.ratio_of_medians(t, impl, 'mha-sdpa'):.2f}x" for impl in IMPLS[1:])
        lines.append(
            f"| {e['B']} | {step} | {len(t['damcha']['wall'])} | {pr.median_ms(t['mha-sdpa']['wall']):.3f} | "
            f"{ratios} | {pr.ratio_of_medians(t, 'damcha', 'mha-prealloc'):.2f} |"
        )
    return lines


PORT = pr.Port("decode", "bench_decode.py", [pr.Block("decode", "PyTorch decoding", table)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, help="eager and/or compiled steps (default both)")
    parser.add_argument("--compile", action="store_true", help="compiled steps only (--modes compiled)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) of the process")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 repeat: checks the script, measures nothing")
    PORT.add_output_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    global E, H
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    if args.compile and args.modes and args.modes != ["compiled"]:
        print("--compile is --modes compiled; give one of them", file=sys.stderr)
        return 2
    # Tiny checks the eager path only: compiling the four steps takes minutes.
    modes = ["compiled"] if args.compile else args.modes or (["eager"] if args.tiny else list(MODES))
    threads = h.fix_threads(args.threads)  # before torch is imported
    if args.tiny:
        E, H = 32, 4
        args.batch, args.prompt, args.steps, args.repeats = [1], 8, 2, 1
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
            shape={"E": E, "H": H},
            batch=args.batch,
            prompt=args.prompt,
            steps=args.steps,
            repeats=args.repeats,
            modes=modes,
        )
        for mode in modes:
            layers = _layers(mode == "compiled")
            for batch in args.batch:
                entry = measure(layers, mode, batch, args.prompt, args.steps, args.repeats)
                PORT.record(results, run, entry)
                print(f"  {entry['id']}: done", flush=True)
        return PORT.finish(results, run, args)


if __name__ == "__main__":
    sys.exit(main())
