"""DamchaAttention vs keras.layers.MultiHeadAttention: time ratio in one run.

    .venv/bin/python benchmarks/bench_keras.py [--backend tensorflow] [--sizes 256 1024 4096] [--repeats 5]
    .venv/bin/python benchmarks/bench_keras.py --report [FILE...]   # rewrite the docs table only
    .venv/bin/python benchmarks/bench_keras.py --tiny   # seconds: checks the script, measures nothing

Self-attention forward pass (inference) at B=4, E=512, H=8 (key_dim 64) for
each N; both layers run eagerly through keras.ops on the backend given
(``--backend``; default ``$KERAS_BACKEND``, else tensorflow), called
alternately (A B, then B A: ``_harness.interleaved``), ``--repeats`` timed
rounds after one warm-up call. The table gives the medians and their ratio
DAMCHA / MHA.

Each run writes ``benchmarks/results/keras-<date>-<time>.json`` (``--json
FILE``; ``--tiny``: a temporary file unless ``--json`` is given) with the
machine, versions, threads, command, commit, load and every round's wall and
CPU time, then (not with ``--tiny`` or ``--no-docs``) rewrites its block of
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
BACKENDS = ("tensorflow", "jax", "torch")
TARGET = 1.15  # this script's own target at N=4096


def measure(n: int, repeats: int, metric: str) -> dict[str, Any]:
    """One entry: every round's wall and CPU seconds of both layers' eager call at length ``n``."""
    import keras
    import numpy as np

    from damcha_keras import DamchaAttention

    keras.utils.set_random_seed(n)
    x = keras.ops.convert_to_tensor(np.random.default_rng(n).normal(size=(B, n, E)).astype("float32"))
    mha = keras.layers.MultiHeadAttention(H, E // H)
    mha(x, x)
    damcha = DamchaAttention.from_mha(mha, metric=metric)
    for var in damcha.canonical_variables().values():  # open gates: the full DAMCHA cost
        if var.path.endswith("gate"):
            var.assign(np.full(var.shape, 0.5, "float32"))
    calls = {"mha": lambda: mha(x, x), "damcha": lambda: damcha(x, x)}
    # Reading one element back waits for the result (asynchronous backends).
    times = h.interleaved(calls, repeats=repeats, warmup=1, sync=lambda out: keras.ops.convert_to_numpy(out[0, 0, 0]))
    return {
        "id": f"keras-{keras.backend.backend()}/N={n}",
        "section": "layer",
        "N": n,
        "backend": keras.backend.backend(),
        "shape": {"B": B, "N": n, "E": E, "H": H},
        "rounds": repeats,
        "times": times,
    }


def table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's table: median of each layer's rounds and their ratio DAMCHA / MHA."""
    shape = entries[0]["shape"]
    lines = [
        f"Keras {run.get('versions', {}).get('keras', '?')}, {run['backend']} backend, metric "
        f'"{run["metric"]}", B={shape["B"]}, E={shape["E"]}, H={shape["H"]}, eager forward calls, '
        f"{run['threads']} threads; median of the rounds (both layers called alternately after a warm-up call).",
        "",
        "| N | rounds | MHA (ms) | DAMCHA (ms) | ratio |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    at_target = []
    for e in sorted(entries, key=lambda e: e["N"]):
        t = e["times"]
        ratio = pr.ratio_of_medians(t, "damcha", "mha")
        lines.append(
            f"| {e['N']} | {len(t['mha']['wall'])} | {pr.median_ms(t['mha']['wall']):.1f} | "
            f"{pr.median_ms(t['damcha']['wall']):.1f} | {ratio:.3f} |"
        )
        if e["N"] == 4096:
            at_target.append(f"{ratio:.3f} ({pr.verdict(ratio, TARGET)})")
    lines.append("")
    lines.append(pr.target_sentence(TARGET, at_target, met="ratio", unmeasured=""))
    return lines


PORT = pr.Port("keras", "bench_keras.py", [pr.Block("keras", "Keras layer", table)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get("KERAS_BACKEND") or "tensorflow",
        help="Keras backend (default $KERAS_BACKEND, else tensorflow)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--metric", default="heads", choices=["heads", "lowrank"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) of the process")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 repeat: checks the script, measures nothing")
    PORT.add_output_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    global B, E, H
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    threads = h.fix_threads(args.threads)  # before keras and its backend are imported
    os.environ["KERAS_BACKEND"] = args.backend  # read once, at keras's import
    if args.tiny:
        B, E, H = 2, 32, 4
        args.sizes, args.repeats = [16], 1
    with contextlib.ExitStack() as stack:
        results = PORT.open(args, stack)
        if results is None:
            return 2
        run = PORT.start(
            results,
            argv,
            tiny=args.tiny,
            threads=args.threads,
            # The command names the backend even when it came from the environment.
            env=None if any(a.split("=")[0] == "--backend" for a in argv) else {"KERAS_BACKEND": args.backend},
            affinity=threads.get("affinity"),
            backend=args.backend,
            metric=args.metric,
            shape={"B": B, "E": E, "H": H},
            sizes=args.sizes,
            repeats=args.repeats,
        )
        for n in args.sizes:
            entry = measure(n, args.repeats, args.metric)
            PORT.record(results, run, entry)
            print(f"  {entry['id']}: done", flush=True)
        return PORT.finish(results, run, args)


if __name__ == "__main__":
    sys.exit(main())
