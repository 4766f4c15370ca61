"""onnxruntime latency of an exported DAMCHA encoder vs the same exported with
metric "none" (MHA), and vs PyTorch eager; plus int8 accuracy and latency.

Run: .venv/bin/python benchmarks/bench_onnx.py [--threads 2] [--repeats 7]
Prints markdown tables. Ratios compare runs made in the same process; the
onnxruntime sessions are timed interleaved with each other, then the torch
models with each other.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

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
    args = p.parse_args()

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
            net = dt.build_encoder(args.width, args.heads, args.layers, dim_feedforward=args.ffn, dropout=0.0,
                                   activation="gelu", norm_first=True, final_norm=True, metric=m).eval()
            torch_models[m] = net
        torch_models["nn.MHA"] = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(args.width, args.heads, args.ffn, 0.0, "gelu", batch_first=True, norm_first=True),
            args.layers, torch.nn.LayerNorm(args.width), enable_nested_tensor=False,
        ).eval()

    print(f"E={args.width}, H={args.heads}, d={args.width // args.heads}, layers={args.layers}, FFN={args.ffn}, "
          f"threads={args.threads}, median of {args.repeats} (x4 when B*N <= 1024); {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; onnxruntime CPU provider\n")
    print("| B | N | ORT DAMCHA (Attention op, opset 23) ms | ORT MHA ms | DAMCHA/MHA | "
          "ORT decomposed (opset 18) DAMCHA/MHA | ORT int8 DAMCHA ms | torch eager DAMCHA ms | torch eager nn.MHA ms | "
          "ORT DAMCHA / torch eager DAMCHA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for B in (1, 8):
        for N in (128, 512):
            x = rng.normal(size=(B, N, args.width)).astype(np.float32)
            xt = torch.from_numpy(x)
            # Small shapes take a few ms: more rounds for a stable median.
            repeats = args.repeats * (4 if B * N <= 1024 else 1)
            # onnxruntime and torch are timed in separate phases: interleaving
            # them put a torch call (and its OpenMP threads winding down) right
            # before some ORT sessions, which skewed the N=128 ratios.
            t = _time_interleaved({key: (lambda s=sess: s.run(None, {"query": x})) for key, sess in sessions.items()}, repeats)
            with torch.inference_mode():
                row_t = _time_interleaved({key: (lambda n=net: n(xt)) for key, net in torch_models.items()}, repeats)
            fmt = lambda v: f"{v:.1f}"  # noqa: E731
            cells = [B, N, fmt(t[("heads", 23)]), fmt(t[("none", 23)]), f"{t[('heads', 23)] / t[('none', 23)]:.2f}",
                     f"{t[('heads', 18)] / t[('none', 18)]:.2f}", fmt(t[("heads-int8", 23)]),
                     fmt(row_t.get("heads", float("nan"))), fmt(row_t.get("nn.MHA", float("nan"))),
                     f"{t[('heads', 23)] / row_t.get('heads', float('nan')):.2f}"]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)

    # int8 accuracy on a small input (float64 reference).
    x = rng.normal(size=(2, 64, args.width))
    err = do.quantization_error(do.export_encoder(params["heads"], configs["heads"], None), q_model, {"query": x},
                                do.encoder_forward(params["heads"], configs["heads"], x))
    print("\nint8 dynamic quantisation (B=2, N=64), errors vs float32 ORT and the float64 reference:\n")
    print("| metric | value |\n|---|---|")
    for k, v in err.items():
        print(f"| {k} | {v:.3g} |")


if __name__ == "__main__":
    main()
