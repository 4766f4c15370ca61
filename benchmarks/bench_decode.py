"""Incremental decoding with a KV cache on CPU: DamchaAttention vs MHA, per token.

Usage:
    .venv/bin/python benchmarks/bench_decode.py [--batch 1 8] [--prompt 512] [--steps 64] [--repeats 5] [--compile]
    .venv/bin/python benchmarks/bench_decode.py --tiny   # seconds: checks the script, measures nothing

One self-attention layer, float32, E=512, H=8 (d=64), eval mode under
``torch.inference_mode``. Each run fills the cache with a prompt of
``--prompt`` tokens in one call, then decodes ``--steps`` tokens one at a time
(``is_causal=True``, ``need_weights=False``); the time per decoded token is
reported. Three implementations, built from the same MHA weights:

- ``mha-sdpa``: a hand-written MHA decode step, the usual recipe: packed
  q/k/v projection, cache by concatenation, one SDPA call, output projection.
- ``mha-prealloc``: the same hand-written step with its cache in
  ``DamchaKVCache``'s preallocated storage (in-place appends, as DAMCHA's
  steps do): DAMCHA's own per-token work is ``damcha`` / ``mha-prealloc``.
- ``damcha-none``: ``DamchaAttention(metric="none")`` with ``DamchaKVCache``,
  the same code path as DAMCHA without the cross-head map.
- ``damcha``: ``DamchaAttention`` (tied "heads" metric, gates open) with
  ``DamchaKVCache``; the cache stores k~, so a step maps only its own token.

The three run alternately, ``--repeats`` rounds after a warm-up, so load
drifts hit all of them; medians of wall time per token are reported with
ratios to ``mha-sdpa`` from the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

E, H = 512, 8


def _layers(compile_steps: bool = False):
    import torch
    from _counts import mha_decode_step  # benchmarks/ is sys.path[0]
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


def _decode_time(step, new_cache, prompt, tokens) -> float:
    import torch

    with torch.inference_mode():
        cache = new_cache()
        step(prompt, cache)
        start = time.perf_counter()
        for i in range(tokens.shape[1]):
            step(tokens[:, i : i + 1], cache)
        return (time.perf_counter() - start) / tokens.shape[1]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decode step (inductor)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 repeat: checks the script, measures nothing")
    args = parser.parse_args()
    if args.tiny:
        global E, H
        E, H = 32, 4
        args.batch, args.prompt, args.steps, args.repeats = [1], 8, 2, 1
    layers = _layers(args.compile)
    rows = []
    for B in args.batch:
        g = torch.Generator().manual_seed(B)
        prompt = torch.randn(B, args.prompt, E, generator=g)
        tokens = torch.randn(B, args.steps, E, generator=g)
        times: dict[str, list[float]] = {name: [] for name in layers}
        for r in range(args.repeats + 1):
            for name, (step, new_cache) in layers.items():
                t = _decode_time(step, new_cache, prompt, tokens)
                if r:  # round 0 warms up
                    times[name].append(t)
        base = statistics.median(times["mha-sdpa"])
        for name, ts in times.items():
            median = statistics.median(ts)
            rows.append({"batch": B, "impl": name, "ms_per_token": 1e3 * median, "ratio_vs_mha": median / base})
    print(
        f"prompt {args.prompt}, {args.steps} decoded tokens, E={E}, H={H}, float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads" + (", compiled steps" if args.compile else ", eager")
    )
    print(f"{'B':>3}  {'impl':<12} {'ms/token':>9} {'vs mha':>7}")
    for row in rows:
        print(f"{row['batch']:>3}  {row['impl']:<12} {row['ms_per_token']:>9.3f} {row['ratio_vs_mha']:>7.2f}")
    if args.json:
        meta = {
            "date": datetime.date.today().isoformat(),
            "machine": platform.platform(),
            "torch": torch.__version__,
            "prompt": args.prompt,
            "steps": args.steps,
            "repeats": args.repeats,
            "compile": args.compile,
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
