"""Whole converted models vs the originals on CPU: time and peak memory ratios.

Usage:
    .venv/bin/python benchmarks/bench_models.py [--models llama vit] [--lengths 512 1024] [--repeats 5]
    .venv/bin/python benchmarks/bench_models.py --tiny   # seconds: checks the script runs
    .venv/bin/python benchmarks/bench_models.py --counts --lengths 64   # aten ops and copies per converted layer

Models (random weights, built from configs):
- "llama": a 4-layer Llama-style causal LM, hidden 512, 8 query heads of 64,
  4 key/value heads (GQA, so separate query/key maps), MLP 1376, vocab 4096,
  B=2, N tokens; sdpa attention.
- "gpt2": a 4-layer GPT-2 (transformers ``GPT2LMHeadModel``: fused ``c_attn``
  Conv1D, weight (in, out)), hidden 512, 8 heads of 64, vocab 4096, B=2, N
  tokens; sdpa attention, dropout 0 (the same masks in both models).
- "vit": ViT-Tiny (timm ``vit_tiny_patch16_224``: 12 blocks, 192 features,
  3 heads, patch 16) at an image size giving N patches (N=576: 384x384), B=4.

"original" is the model as built; "DAMCHA" is the same model after
``damcha_torch.convert(model)`` (metric "heads", coupling auto, recompute on)
with every gate set to 0.5 (an open map costs the same, but is honest).
"forward" is eval mode under ``torch.inference_mode``; "fwd+bwd" is train mode
with a backward of the mean of the output (the logits).

Times: both models are built in this process and called alternately
(``--repeats`` rounds after a warm-up), medians of wall and process CPU time.
Peak memory: each (implementation, model, N, mode) runs once more in a fresh
subprocess: after a warm-up call the high-water mark (VmHWM) is reset and the
RSS noted, then one call runs; glibc mmaps every block >= 64 KiB so the RSS
tracks live memory. Targets (issue 13): time ratio <= 1.10, memory ratio <= 1.05
at N >= 512.
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

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = {
    "llama": dict(hidden=32, heads=4, kv=2, mlp=64, vocab=64, layers=1, batch=2),
    "gpt2": dict(hidden=32, heads=4, vocab=64, layers=1, batch=2),
    "vit": dict(embed=24, depth=1, heads=3, batch=2),
}
FULL = {
    "llama": dict(hidden=512, heads=8, kv=4, mlp=1376, vocab=4096, layers=4, batch=2),
    "gpt2": dict(hidden=512, heads=8, vocab=4096, layers=4, batch=2),
    "vit": dict(embed=192, depth=12, heads=3, batch=4),
}


def _build(model: str, n: int, tiny: bool):
    """(module, input) for ``model`` at N tokens (patches for the ViT)."""
    import torch

    # transformers and timm both import torchvision; see examples/_torchvision_compat.py.
    sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
    from _torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    sizes = (TINY if tiny else FULL)[model]
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=sizes["vocab"],
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["mlp"],
            num_hidden_layers=sizes["layers"],
            num_attention_heads=sizes["heads"],
            num_key_value_heads=sizes["kv"],
            max_position_embeddings=max(n, 64),
            attn_implementation="sdpa",
        )
        module = LlamaForCausalLM(cfg)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], n))
        return (lambda m, x: m(input_ids=x, use_cache=False).logits), module, ids
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=sizes["vocab"],
            n_embd=sizes["hidden"],
            n_layer=sizes["layers"],
            n_head=sizes["heads"],
            n_positions=max(n, 64),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,  # GPT-2's 50256 is outside the small vocabulary
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        module = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], n))
        return (lambda m, x: m(input_ids=x, use_cache=False).logits), module, ids
    import timm

    side = int(round(n**0.5))
    patch = 4 if tiny else 16
    module = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=side * patch,
        patch_size=patch,
        embed_dim=sizes["embed"],
        depth=sizes["depth"],
        num_heads=sizes["heads"],
    )
    images = torch.randn(sizes["batch"], 3, side * patch, side * patch)
    return (lambda m, x: m(x)), module, images


def _make(impl: str, model: str, n: int, mode: str, tiny: bool):
    import torch

    import damcha_torch as dt

    torch.manual_seed(0)
    fn, module, x = _build(model, n, tiny)
    if impl == "damcha":
        dt.convert(module)
        with torch.no_grad():
            for p in dt.damcha_parameters(module, generators=False):
                p.fill_(0.5)
    module.train(mode == "fwd+bwd")

    def call() -> None:
        if mode == "forward":
            with torch.inference_mode():
                fn(module, x)
        else:
            fn(module, x).mean().backward()
            module.zero_grad(set_to_none=True)

    return call


COPIES = ("cat", "clone", "copy_", "_to_copy", "contiguous", "_reshape_copy", "fill_", "zero_")


def op_counts(model: str, n: int, mode: str, tiny: bool) -> dict[str, float]:
    """aten ops (as dispatched below autograd, backward included) per converted
    layer, DAMCHA minus the original: all of them, the copies, and the MACs of
    the 2-D GEMMs (``mm``, ``addmm``, ``addmm_``: projections, their gradients,
    the generators) relative to the original's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import damcha_torch as dt

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}
            self.macs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            # addmm_: the fused nodes accumulate gradient pieces in place (their GEMMs count too).
            if name in ("addmm", "addmm_", "mm"):
                self.macs += args[-2].numel() * args[-1].shape[-1]
            return func(*args, **(kwargs or {}))

    out = {}
    for impl in ("original", "damcha"):
        call = _make(impl, model, n, mode, tiny)
        call()
        with Count() as counter:
            call()
        out[impl] = (counter.counts, counter.macs)
    torch.manual_seed(0)
    layers = len(dt.converted_layers(dt.convert(_build(model, n, tiny)[1])))
    (o, o_macs), (d, d_macs) = out["original"], out["damcha"]
    extra = {"ops": (sum(d.values()) - sum(o.values())) / layers}
    for op in COPIES:
        if d.get(op, 0) != o.get(op, 0):
            extra[op] = (d.get(op, 0) - o.get(op, 0)) / layers
    extra["mm MACs %"] = 100.0 * (d_macs - o_macs) / max(o_macs, 1)
    return extra


def peak_memory(impl: str, model: str, n: int, mode: str, tiny: bool) -> float:
    call = _make(impl, model, n, mode, tiny)
    call()
    reset_peak_rss()
    base = rss_bytes()
    call()
    return (peak_rss_bytes() - base) / 2**20


def time_pair(model: str, n: int, mode: str, repeats: int, tiny: bool) -> dict[str, dict[str, float]]:
    calls = {impl: _make(impl, model, n, mode, tiny) for impl in ("original", "damcha")}
    wall: dict[str, list[float]] = {impl: [] for impl in calls}
    cpu: dict[str, list[float]] = {impl: [] for impl in calls}
    for call in calls.values():
        call()
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
    parser.add_argument("--models", nargs="+", default=["llama", "vit"], choices=["llama", "gpt2", "vit"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[576, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny models, N=16, 2 repeats: a smoke run")
    parser.add_argument(
        "--counts", action="store_true", help="print aten op and copy counts per converted layer instead of timing"
    )
    parser.add_argument("--worker", nargs=4, metavar=("IMPL", "MODEL", "N", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.lengths, args.repeats = [16], 2
    if args.worker:
        impl, model, n, mode = args.worker
        print(json.dumps({"peak_mb": peak_memory(impl, model, int(n), mode, args.tiny)}))
        return 0
    if args.counts:
        for model in args.models:
            for mode in ("forward", "fwd+bwd"):
                extra = op_counts(model, args.lengths[0], mode, args.tiny)
                print(
                    f"{model} {mode}: per converted layer, vs the original: "
                    + ", ".join(f"{k} {v:+.1f}" for k, v in extra.items()),
                    flush=True,
                )
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    import torch

    print(
        f"<!-- {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}{', TINY sizes' if args.tiny else ''} -->"
    )
    print(
        f"float32, CPU; time: median of {args.repeats} alternating calls; "
        "peak: RSS increase of one call in a fresh process\n"
    )
    print(
        "| model | N | mode | original wall ms | DAMCHA wall ms | wall ratio | original CPU ms | DAMCHA CPU ms "
        "| CPU ratio | original peak MiB | DAMCHA peak MiB | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for n in args.lengths:
            for mode in ("forward", "fwd+bwd"):
                peak = {}
                for impl in ("original", "damcha"):
                    if args.tiny and (impl, model, mode) != ("original", args.models[0], "forward"):
                        # Tiny measures nothing: one worker process checks that path, the rest run here.
                        peak[impl] = peak_memory(impl, model, n, mode, True)
                        continue
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, model, str(n), mode]
                    if args.tiny:
                        cmd.append("--tiny")
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    peak[impl] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
                t = time_pair(model, n, mode, args.repeats, args.tiny)
                o, d = t["original"], t["damcha"]
                print(
                    f"| {model} | {n} | {mode} | {o['wall']:.0f} | {d['wall']:.0f} | {d['wall'] / o['wall']:.2f} | "
                    f"{o['cpu']:.0f} | {d['cpu']:.0f} | {d['cpu'] / o['cpu']:.2f} | {peak['original']:.1f} | "
                    f"{peak['damcha']:.1f} | {peak['damcha'] / max(peak['original'], 1e-9):.2f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
