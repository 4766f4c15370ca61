"""onnxruntime latency of an exported DAMCHA encoder vs the same exported with
metric "none" (MHA), and vs PyTorch eager; plus int8 accuracy and latency;
then "ONNX at the edge": a layer and a stack in float32, float16, dynamic int8
and static QDQ int8, in onnxruntime CPU (Python) and onnxruntime-web (WASM,
under Node.js), DAMCHA vs MHA, with model sizes and accuracy.

Run: .venv/bin/python benchmarks/bench_onnx.py [--threads 2] [--repeats 7] [--section all|encoder|edge]
     .venv/bin/python benchmarks/bench_onnx.py --tiny   # a seconds-long check of the script itself
Prints markdown tables. Ratios compare runs made in the same process; the
onnxruntime sessions are timed interleaved with each other, then the torch
models with each other; the WASM sessions interleaved in one Node process.
The edge section needs Node.js and js/node_modules (`make js-deps`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import damcha_core as dc
import damcha_onnx as do


def _time_interleaved(fns: dict, repeats: int) -> dict:
    """Median ms per callable. Rounds alternate between the callables so a
    load change on a shared machine hits every variant alike."""
    for fn in fns.values():
        fn()  # warm-up (allocations, kernel selection)
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _encoder(metric: str, args) -> do.EncoderConfig:
    attn = dc.DamchaConfig(query_dim=args.width, num_heads=args.heads, key_dim=args.width // args.heads, metric=metric)
    return do.EncoderConfig(attn, num_layers=args.layers, ffn_dim=args.ffn, share_metric=True)


def _params(config: do.EncoderConfig, seed: int) -> dict[str, np.ndarray]:
    params = do.init_encoder_params(config, seed)
    for name in params:
        if name.endswith(".gate"):
            params[name] = np.full(params[name].shape, 0.5)  # open gates: the map is really applied
    return params


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--section", choices=("all", "encoder", "edge"), default="all")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and 2 repeats: checks the script, measures nothing")
    args = p.parse_args()
    if args.tiny:
        args.width, args.heads, args.ffn, args.repeats = 32, 4, 64, 2
    if args.section in ("all", "encoder"):
        encoder_section(args)
    if args.section in ("all", "edge"):
        edge_section(args)


def encoder_section(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    configs = {m: _encoder(m, args) for m in ("heads", "none")}
    params = {m: _params(c, 0) for m, c in configs.items()}
    sessions = {}
    for m in configs:
        for opset in (23, 18):
            model = do.export_encoder(params[m], configs[m], None, opset=opset)
            sessions[(m, opset)] = do.ort_session(model, threads=args.threads, spinning=False)
    q_model = do.quantize_int8(do.export_encoder(params["heads"], configs["heads"], None))
    sessions[("heads-int8", 23)] = do.ort_session(q_model, threads=args.threads, spinning=False)

    torch_models = {}
    if not args.no_torch:
        import damcha_torch as dt

        for m in ("heads", "none"):
            net = dt.build_encoder(
                args.width,
                args.heads,
                args.layers,
                dim_feedforward=args.ffn,
                dropout=0.0,
                activation="gelu",
                norm_first=True,
                final_norm=True,
                metric=m,
            ).eval()
            torch_models[m] = net
        torch_models["nn.MHA"] = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(
                args.width, args.heads, args.ffn, 0.0, "gelu", batch_first=True, norm_first=True
            ),
            args.layers,
            torch.nn.LayerNorm(args.width),
            enable_nested_tensor=False,
        ).eval()

    print(
        f"E={args.width}, H={args.heads}, d={args.width // args.heads}, layers={args.layers}, FFN={args.ffn}, "
        f"threads={args.threads}, median of {args.repeats} (x4 when B*N <= 1024); {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; onnxruntime CPU provider\n"
    )
    print(
        "| B | N | ORT DAMCHA (Attention op, opset 23) ms | ORT MHA ms | DAMCHA/MHA | "
        "ORT decomposed (opset 18) DAMCHA/MHA | ORT int8 DAMCHA ms | torch eager DAMCHA ms | torch eager nn.MHA ms | "
        "ORT DAMCHA / torch eager DAMCHA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for B in (1,) if args.tiny else (1, 8):
        for N in (16,) if args.tiny else (128, 512):
            x = rng.normal(size=(B, N, args.width)).astype(np.float32)
            xt = torch.from_numpy(x)
            # Small shapes take a few ms: more rounds for a stable median.
            repeats = args.repeats * (4 if B * N <= 1024 else 1)
            # onnxruntime and torch are timed in separate phases: interleaving
            # them put a torch call (and its OpenMP threads winding down) right
            # before some ORT sessions, which skewed the N=128 ratios.
            t = _time_interleaved(
                {key: functools.partial(sess.run, None, {"query": x}) for key, sess in sessions.items()}, repeats
            )
            with torch.inference_mode():
                row_t = _time_interleaved(
                    {key: functools.partial(net, xt) for key, net in torch_models.items()}, repeats
                )
            fmt = lambda v: f"{v:.1f}"  # noqa: E731
            cells = [
                B,
                N,
                fmt(t[("heads", 23)]),
                fmt(t[("none", 23)]),
                f"{t[('heads', 23)] / t[('none', 23)]:.2f}",
                f"{t[('heads', 18)] / t[('none', 18)]:.2f}",
                fmt(t[("heads-int8", 23)]),
                fmt(row_t.get("heads", float("nan"))),
                fmt(row_t.get("nn.MHA", float("nan"))),
                f"{t[('heads', 23)] / row_t.get('heads', float('nan')):.2f}",
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)

    # int8 accuracy on a small input (float64 reference).
    x = rng.normal(size=(2, 64, args.width))
    err = do.quantization_error(
        do.export_encoder(params["heads"], configs["heads"], None),
        q_model,
        {"query": x},
        do.encoder_forward(params["heads"], configs["heads"], x),
    )
    print("\nint8 dynamic quantisation (B=2, N=64), errors vs float32 ORT and the float64 reference:\n")
    print("| metric | value |\n|---|---|")
    for k, v in err.items():
        print(f"| {k} | {v:.3g} |")


# ------------------------------------------------------------ ONNX at the edge

FORMATS = ("float32", "float16", "int8-dynamic", "int8-static")
JS = Path(__file__).resolve().parents[1] / "js"


def _edge_models(args, directory: Path) -> tuple[dict, dict, dict]:
    """Exports {(kind, metric, fmt): path}, with the configs and params per (kind, metric)."""
    rng = np.random.default_rng(3)
    files, configs, params = {}, {}, {}
    for metric in ("heads", "none"):
        attn = dc.DamchaConfig(
            query_dim=args.width, num_heads=args.heads, key_dim=args.width // args.heads, metric=metric
        )
        layer_params = dc.init_params(attn, 0)
        for name in layer_params:
            if name.endswith(".gate"):
                layer_params[name] = np.full(layer_params[name].shape, 0.5)
        enc = _encoder(metric, args)
        configs[("layer", metric)], params[("layer", metric)] = attn, layer_params
        configs[("stack", metric)], params[("stack", metric)] = enc, _params(enc, 0)
        for kind in ("layer", "stack"):
            for dtype in ("float32", "float16"):
                path = directory / f"{kind}-{metric}-{dtype}.onnx"
                if kind == "layer":
                    do.export(layer_params, attn, path, causal=True, dtype=dtype)
                else:
                    do.export_encoder(params[(kind, metric)], enc, path, dtype=dtype)
                files[(kind, metric, dtype)] = path
            f32 = files[(kind, metric, "float32")]
            files[(kind, metric, "int8-dynamic")] = directory / f"{kind}-{metric}-int8-dynamic.onnx"
            do.quantize_int8(f32, files[(kind, metric, "int8-dynamic")])
            calibration = [{"query": rng.normal(size=(2, 64, args.width))} for _ in range(8)]
            files[(kind, metric, "int8-static")] = directory / f"{kind}-{metric}-int8-static.onnx"
            do.quantize_static_int8(f32, calibration, files[(kind, metric, "int8-static")])
    return files, configs, params


def _wasm_times(files: dict, shapes: list, args, directory: Path) -> dict | None:
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "onnxruntime-web").is_dir():
        print("\n(onnxruntime-web skipped: needs Node.js and js/node_modules, `make js-deps`)\n")
        return None
    groups = []
    for kind in ("layer", "stack"):
        for B, N in shapes:
            models = [
                {
                    "id": f"{metric}|{fmt}",
                    "file": files[(kind, metric, fmt)].name,
                    "feeds": {
                        "query": {"dtype": "float16" if fmt == "float16" else "float32", "shape": [B, N, args.width]}
                    },
                }
                for metric in ("heads", "none")
                for fmt in FORMATS
            ]
            groups.append({"id": f"{kind}|{B}|{N}", "models": models})
    manifest = directory / "bench.json"
    manifest.write_text(json.dumps({"repeats": args.repeats, "warmup": 2, "groups": groups}))
    proc = subprocess.run(
        [node, "bench.mjs", "--runtime", "web", str(manifest)], cwd=JS, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"node bench.mjs failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def edge_section(args) -> None:
    shapes = [(1, 16)] if args.tiny else [(1, 128), (1, 512), (8, 128)]
    with tempfile.TemporaryDirectory(prefix="damcha-bench-") as tmp:
        directory = Path(tmp)
        files, configs, params = _edge_models(args, directory)
        print(
            f"\n### ONNX at the edge\n\nE={args.width}, H={args.heads}, d={args.width // args.heads}; layer: one causal "
            f'self-attention layer; stack: {args.layers} pre-norm layers, FFN {args.ffn}; DAMCHA = metric "heads" '
            f'(tied, gates 0.5) vs MHA = the same exported with metric "none". Median ms of {args.repeats} rounds, '
            f"the 16 sessions of a (model, shape) interleaved. onnxruntime CPU: {args.threads} threads, spinning off; "
            f"onnxruntime-web: WASM, 1 thread, under Node.js {_node_version()}.\n"
        )
        # Latency, onnxruntime CPU (Python).
        ort_times = {}
        rng = np.random.default_rng(0)
        for kind in ("layer", "stack"):
            sessions = {
                (metric, fmt): do.ort_session(files[(kind, metric, fmt)], threads=args.threads, spinning=False)
                for metric in ("heads", "none")
                for fmt in FORMATS
            }
            for B, N in shapes:
                x = rng.normal(size=(B, N, args.width))
                feeds = {k: {"query": x.astype(np.float16 if k[1] == "float16" else np.float32)} for k in sessions}
                ort_times[(kind, B, N)] = _time_interleaved(
                    {k: (lambda s=sess, f=feeds[k]: s.run(None, f)) for k, sess in sessions.items()}, args.repeats
                )
        wasm = _wasm_times(files, shapes, args, directory)
        for title, times in (("onnxruntime CPU (Python)", ort_times), ("onnxruntime-web WASM (Node.js)", wasm)):
            if times is None:
                continue
            print(f"Latency, {title}: DAMCHA ms (DAMCHA/MHA)\n")
            print("| model | B | N | " + " | ".join(FORMATS) + " |")
            print("|---|---|---|" + "---|" * len(FORMATS))
            for kind in ("layer", "stack"):
                for B, N in shapes:
                    if title.startswith("onnxruntime CPU"):
                        row = {
                            fmt: (times[(kind, B, N)][("heads", fmt)], times[(kind, B, N)][("none", fmt)])
                            for fmt in FORMATS
                        }
                    else:
                        group = times["groups"][f"{kind}|{B}|{N}"]
                        row = {fmt: (group[f"heads|{fmt}"], group[f"none|{fmt}"]) for fmt in FORMATS}
                    cells = [f"{d:.2f} ({d / m:.2f})" for d, m in row.values()]
                    print(f"| {kind} | {B} | {N} | " + " | ".join(cells) + " |")
            print()
        # Model sizes.
        print("Model size, KiB (DAMCHA / MHA)\n")
        print("| model | " + " | ".join(FORMATS) + " |")
        print("|---|" + "---|" * len(FORMATS))
        for kind in ("layer", "stack"):
            cells = [
                f"{files[(kind, 'heads', f)].stat().st_size / 1024:.0f} / {files[(kind, 'none', f)].stat().st_size / 1024:.0f}"
                for f in FORMATS
            ]
            print(f"| {kind} | " + " | ".join(cells) + " |")
        # Accuracy against the float64 reference (DAMCHA models).
        print(
            "\nAccuracy of DAMCHA (B=2, N=64, fresh normal inputs; static int8 calibrated on 8 other batches): "
            "relative RMS error vs the float64 reference (max abs error)\n"
        )
        print("| model | " + " | ".join(FORMATS) + " |")
        print("|---|" + "---|" * len(FORMATS))
        x = np.random.default_rng(99).normal(size=(2, 64, args.width))
        for kind in ("layer", "stack"):
            cfg, prm = configs[(kind, "heads")], params[(kind, "heads")]
            ref = dc.damcha_attention(prm, cfg, x, causal=True) if kind == "layer" else dc.encoder_forward(prm, cfg, x)
            cells = []
            for fmt in FORMATS:
                y = np.asarray(do.run_ort(files[(kind, "heads", fmt)], {"query": x}), dtype=np.float64)
                rel = np.sqrt(np.mean((y - ref) ** 2)) / np.sqrt(np.mean(ref**2))
                cells.append(f"{rel:.2e} ({np.max(np.abs(y - ref)):.1e})")
            print(f"| {kind} | " + " | ".join(cells) + " |")
        print(f"\nonnxruntime {_ort_version()}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")


def _node_version() -> str:
    node = shutil.which("node")
    return subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip() if node else "(absent)"


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    main()
