"""Jitted DAMCHA (damcha_jax.DamchaAttention) vs jitted flax.nnx.MultiHeadAttention.

Forward and forward+backward wall time at B=4, E=512, H=8 (d=64), self-attention,
no mask, float32, on whatever JAX's default backend is (CPU here). Both layers
end in jax.nn.dot_product_attention, so the ratio is DAMCHA's per-token extra
cost (RMS norm, generator, head mixing) against the attention itself.

    .venv/bin/python benchmarks/bench_jax.py [--sizes 256 1024 4096] [--reps 7 5 3] [--threads T]
    .venv/bin/python benchmarks/bench_jax.py --report [FILE...]   # rewrite the docs table only
    .venv/bin/python benchmarks/bench_jax.py --tiny   # seconds: checks the script, measures nothing

The two jitted calls alternate (A B, then B A: ``_harness.interleaved``) after a
compiling warm-up call. The table gives the median and best (min) time of each
and the DAMCHA / MHA ratio of each; on a shared, loaded machine the min ratio is
the steadier estimate of the intrinsic cost.

Each run writes ``benchmarks/results/jax-<date>-<time>.json`` (``--json FILE``;
``--tiny``: a temporary file unless ``--json`` is given) with the machine,
versions, threads, command, commit, load and every round's wall and CPU time,
then (not with ``--tiny`` or ``--no-docs``) rewrites its block of
docs/benchmarks.md from that file (``_ports_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

import _harness as h  # benchmarks/ is sys.path[0]
import _ports_report as pr

B, E, H = 4, 512, 8
PASSES = ("fwd", "fwd+bwd")
TARGET = 1.10  # this script's own target at N=4096 (median ratio)


def _compiled(module: Any, backward: bool):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(module)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    if not backward:
        return jax.jit(forward), state

    def loss(state, x):
        return jnp.sum(forward(state, x))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), state


def layers() -> dict[str, Any]:
    """The MHA and DAMCHA converted from it, every gate open at 0.5 (a trained layer's work)."""
    import jax.numpy as jnp
    from flax import nnx

    import damcha_jax as dj

    mha = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0))
    damcha = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))  # metric "heads", tied
    for cross in damcha.metric.values():
        cross.gate[...] = jnp.full(cross.gate.shape, 0.5)
    return {"mha": mha, "damcha": damcha}


def measure(modules: dict[str, Any], n: int, backward: bool, repeats: int) -> dict[str, Any]:
    """One entry: every round's wall and CPU seconds of both jitted calls at length ``n``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.asarray(np.random.default_rng(n).normal(size=(B, n, E)), jnp.float32)
    calls = {}
    for name, module in modules.items():
        fn, state = _compiled(module, backward)
        calls[name] = lambda fn=fn, state=state: fn(state, x)
    times = h.interleaved(calls, repeats=repeats, warmup=1, sync=jax.block_until_ready)
    name = PASSES[backward]
    return {
        "id": f"jax/{name}/N={n}",
        "section": "layer",
        "N": n,
        "pass": name,
        "shape": {"B": B, "N": n, "E": E, "H": H},
        "rounds": repeats,
        "times": times,
    }


def table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's table: median and min of each layer's rounds and the DAMCHA / MHA ratios of both."""
    shape = entries[0]["shape"]
    lines = [
        f"B={shape['B']}, E={shape['E']}, H={shape['H']}, float32, {run.get('jax_backend', '?')}, "
        f"{run['threads']} threads; the rounds of both jitted calls alternate after a compiling warm-up call.",
        "",
        "| N | pass | rounds | MHA ms (median) | DAMCHA ms (median) | ratio (median) | ratio (min) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    at_target = []
    for e in sorted(entries, key=lambda e: (e["N"], PASSES.index(e["pass"]))):
        t = e["times"]
        ratio = pr.ratio_of_medians(t, "damcha", "mha")
        best = min(t["damcha"]["wall"]) / min(t["mha"]["wall"])
        lines.append(
            f"| {e['N']} | {e['pass']} | {len(t['mha']['wall'])} | {pr.median_ms(t['mha']['wall']):.1f} | "
            f"{pr.median_ms(t['damcha']['wall']):.1f} | {ratio:.3f} | {best:.3f} |"
        )
        if e["N"] == 4096:
            at_target.append(f"{e['pass']} {ratio:.3f} ({pr.verdict(ratio, TARGET)})")
    lines.append("")
    lines.append(pr.target_sentence(TARGET, at_target, met="median ratio", unmeasured=""))
    return lines


PORT = pr.Port("jax", "bench_jax.py", [pr.Block("jax", "JAX layer", table)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, nargs="+", default=[7, 5, 3], help="timed runs per size")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) of the process")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 run: checks the script, measures nothing")
    PORT.add_output_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    global B, E, H
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    threads = h.fix_threads(args.threads)  # before jax is imported (XLA's pool follows the affinity)
    if args.tiny:
        B, E, H = 2, 32, 4
        args.sizes, args.reps = [16], [1]
    reps = args.reps + [args.reps[-1]] * (len(args.sizes) - len(args.reps))
    with contextlib.ExitStack() as stack:
        results = PORT.open(args, stack)
        if results is None:
            return 2
        import jax

        run = PORT.start(
            results,
            argv,
            tiny=args.tiny,
            threads=args.threads,
            affinity=threads.get("affinity"),
            jax_backend=jax.default_backend(),
            devices=jax.device_count(),
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            shape={"B": B, "E": E, "H": H},
            sizes=args.sizes,
            reps=reps[: len(args.sizes)],
        )
        modules = layers()
        for n, r in zip(args.sizes, reps):
            for backward in (False, True):
                entry = measure(modules, n, backward, r)
                PORT.record(results, run, entry)
                print(f"  {entry['id']}: done", flush=True)
        return PORT.finish(results, run, args)


if __name__ == "__main__":
    sys.exit(main())
