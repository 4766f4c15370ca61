"""DamchaAttention vs keras.layers.MultiHeadAttention: time ratio in one run.

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench_keras.py [--sizes 256 1024 4096] [--repeats 5]
    .venv/bin/python benchmarks/bench_keras.py --tiny   # seconds: checks the script, measures nothing

Self-attention forward pass (inference) at B=4, E=512, H=8 (key_dim 64) for
each N; both layers run eagerly through keras.ops on the current backend
(default tensorflow), interleaved, median of ``--repeats`` timed calls after
one warm-up call. Prints a markdown table; the ratio is DAMCHA time / MHA time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np

from damcha_keras import DamchaAttention

B, E, H = 4, 512, 8


def _timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    keras.ops.convert_to_numpy(out[0, 0, 0])  # wait for the result
    return time.perf_counter() - start


def bench(n: int, repeats: int, metric: str) -> tuple[float, float]:
    keras.utils.set_random_seed(n)
    x = keras.ops.convert_to_tensor(np.random.default_rng(n).normal(size=(B, n, E)).astype("float32"))
    mha = keras.layers.MultiHeadAttention(H, E // H)
    mha(x, x)
    damcha = DamchaAttention.from_mha(mha, metric=metric)
    for var in damcha.canonical_variables().values():  # open gates: the full DAMCHA cost
        if var.path.endswith("gate"):
            var.assign(np.full(var.shape, 0.5, "float32"))
    runs = {"mha": lambda: mha(x, x), "damcha": lambda: damcha(x, x)}
    for fn in runs.values():
        _timed(fn)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():  # interleaved, so load drifts hit both
            times[name].append(_timed(fn))
    return statistics.median(times["mha"]), statistics.median(times["damcha"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--metric", default="heads", choices=["heads", "lowrank"])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 repeat: checks the script, measures nothing")
    args = parser.parse_args()
    if args.tiny:
        global B, E, H
        B, E, H = 2, 32, 4
        args.sizes, args.repeats = [16], 1
    print(
        f"backend={keras.backend.backend()} keras={keras.__version__} machine={platform.machine()} "
        f"cpus={os.cpu_count()} B={B} E={E} H={H} metric={args.metric} repeats={args.repeats}\n"
    )
    print("| N | MHA (ms) | DAMCHA (ms) | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for n in args.sizes:
        t_mha, t_damcha = bench(n, args.repeats, args.metric)
        print(f"| {n} | {1e3 * t_mha:.1f} | {1e3 * t_damcha:.1f} | {t_damcha / t_mha:.3f} |", flush=True)


if __name__ == "__main__":
    main()
