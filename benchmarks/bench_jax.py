"""Jitted DAMCHA (damcha_jax.DamchaAttention) vs jitted flax.nnx.MultiHeadAttention.

Forward and forward+backward wall time at B=4, E=512, H=8 (d=64), self-attention,
no mask, float32, on whatever JAX's default backend is (CPU here). Both layers
end in jax.nn.dot_product_attention, so the ratio is DAMCHA's per-token extra
cost (RMS norm, generator, head mixing) against the attention itself.

    .venv/bin/python benchmarks/bench_jax.py [--sizes 256 1024 4096] [--reps 5 3 2]
    .venv/bin/python benchmarks/bench_jax.py --tiny   # seconds: checks the script, measures nothing

Prints a markdown table: median and best (min) time over interleaved runs, and
the DAMCHA / MHA ratio of each. On a shared, loaded machine the min ratio is
the steadier estimate of the intrinsic cost.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import damcha_jax as dj

B, E, H = 4, 512, 8


def _compiled(module: nnx.Module, backward: bool):
    graphdef, state = nnx.split(module)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    if not backward:
        return jax.jit(forward), state

    def loss(state, x):
        return jnp.sum(forward(state, x))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), state


def _time(fn, state, x) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(state, x))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, nargs="+", default=[7, 5, 3], help="timed runs per size")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 run: checks the script, measures nothing")
    args = parser.parse_args(argv)
    if args.tiny:
        global B, E, H
        B, E, H = 2, 32, 4
        args.sizes, args.reps = [16], [1]
    reps = args.reps + [args.reps[-1]] * (len(args.sizes) - len(args.reps))

    mha = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0))
    damcha = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))  # metric "heads", tied
    for cross in damcha.metric.values():  # open gates: the same work as a trained layer
        cross.gate[...] = jnp.full(cross.gate.shape, 0.5)

    print(
        f"date: {datetime.date.today()}, machine: {platform.machine()} {platform.processor() or ''}"
        f" ({jax.default_backend()}, {jax.device_count()} device(s), {__import__('os').cpu_count()} cpus),"
        f" jax {jax.__version__}"
    )
    print()
    print("| N | pass | MHA ms (median) | DAMCHA ms (median) | ratio (median) | ratio (min) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n, r in zip(args.sizes, reps):
        x = jnp.asarray(np.random.default_rng(n).normal(size=(B, n, E)), jnp.float32)
        for backward in (False, True):
            fm, sm = _compiled(mha, backward)
            fd, sd = _compiled(damcha, backward)
            _time(fm, sm, x), _time(fd, sd, x)  # compile and warm up
            tm, td = [], []
            for i in range(r):  # interleaved, alternating order, against load drift
                if i % 2:
                    td.append(_time(fd, sd, x))
                    tm.append(_time(fm, sm, x))
                else:
                    tm.append(_time(fm, sm, x))
                    td.append(_time(fd, sd, x))
            m, d = statistics.median(tm) * 1e3, statistics.median(td) * 1e3
            name = "fwd+bwd" if backward else "fwd"
            best = min(td) / min(tm)
            print(f"| {n} | {name} | {m:.1f} | {d:.1f} | {d / m:.3f} | {best:.3f} |", flush=True)


if __name__ == "__main__":
    main()
