"""onnxruntime latency of an exported DAMCHA encoder vs the same exported with
metric "none" (MHA), and vs PyTorch eager; plus int8 accuracy and latency;
then "ONNX at the edge": a layer and a stack in float32, float16, dynamic int8
and static QDQ int8, in onnxruntime CPU (Python) and onnxruntime-web (WASM,
under Node.js), DAMCHA vs MHA, with model sizes and accuracy.

Run: .venv/bin/python benchmarks/bench_onnx.py [--threads 2] [--repeats 7] [--section all|encoder|edge]
     .venv/bin/python benchmarks/bench_onnx.py --report [FILE...]   # rewrite the docs tables only
     .venv/bin/python benchmarks/bench_onnx.py --tiny   # a seconds-long check of the script itself

Ratios compare runs made in the same process: the onnxruntime sessions are
timed alternately with each other (A B C, then C B A: ``_harness.interleaved``,
after two warm-up rounds), then the torch models with each other; the WASM
sessions interleaved in one Node process (js/bench.mjs, which reports every
round; runs before it did store its medians only). The tables give medians and ratios of medians. The
edge section needs Node.js and js/node_modules (`make js-deps`).

Each run writes ``benchmarks/results/onnx-<date>-<time>.json`` (``--json
FILE``; ``--tiny``: a temporary file unless ``--json`` is given) with the
machine, versions, threads, command, commit, load, every round's time of every
onnxruntime session and torch model, the WASM medians, the model sizes and the
errors, then (not with ``--tiny`` or ``--no-docs``) rewrites the two blocks of
docs/benchmarks.md it measured from that file (``_ports_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as h  # benchmarks/ is sys.path[0]
import _ports_report as pr

TARGET = 1.15  # this script's own target: DAMCHA/MHA at every shape
FORMATS = ("float32", "float16", "int8-dynamic", "int8-static")
KINDS = ("layer", "stack")
JS = Path(__file__).resolve().parents[1] / "js"
# The encoder section's sessions and models, in the order they are timed and tabled.
ORT_KEYS = ("ort/heads/23", "ort/none/23", "ort/heads/18", "ort/none/18", "ort/heads-int8/23")
TORCH_KEYS = ("torch/heads", "torch/none", "torch/nn.MHA")


def _encoder(metric: str, args):
    import damcha_core as dc
    import damcha_onnx as do

    attn = dc.DamchaConfig(query_dim=args.width, num_heads=args.heads, key_dim=args.width // args.heads, metric=metric)
    return do.EncoderConfig(attn, num_layers=args.layers, ffn_dim=args.ffn, share_metric=True)


def _params(config, seed: int) -> dict[str, Any]:
    import numpy as np

    import damcha_onnx as do

    params = do.init_encoder_params(config, seed)
    for name in params:
        if name.endswith(".gate"):
            params[name] = np.full(params[name].shape, 0.5)  # open gates: the map is really applied
    return params


def encoder_shapes(tiny: bool) -> list[tuple[int, int]]:
    return [(1, 16)] if tiny else [(B, N) for B in (1, 8) for N in (128, 512)]


def encoder_section(args, record) -> None:
    import numpy as np
    import torch

    import damcha_onnx as do

    torch.set_num_threads(args.threads)
    configs = {m: _encoder(m, args) for m in ("heads", "none")}
    params = {m: _params(c, 0) for m, c in configs.items()}
    sessions = {}
    for m in configs:
        for opset in (23, 18):
            model = do.export_encoder(params[m], configs[m], None, opset=opset)
            sessions[f"ort/{m}/{opset}"] = do.ort_session(model, threads=args.threads, spinning=False)
    q_model = do.quantize_int8(do.export_encoder(params["heads"], configs["heads"], None))
    sessions["ort/heads-int8/23"] = do.ort_session(q_model, threads=args.threads, spinning=False)

    torch_models = {}
    if not args.no_torch:
        import damcha_torch as dt

        for m in ("heads", "none"):
            torch_models[f"torch/{m}"] = dt.build_encoder(
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
        torch_models["torch/nn.MHA"] = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(
                args.width, args.heads, args.ffn, 0.0, "gelu", batch_first=True, norm_first=True
            ),
            args.layers,
            torch.nn.LayerNorm(args.width),
            enable_nested_tensor=False,
        ).eval()

    rng = np.random.default_rng(0)
    for B, N in encoder_shapes(args.tiny):
        x = rng.normal(size=(B, N, args.width)).astype(np.float32)
        xt = torch.from_numpy(x)
        # Small shapes take a few ms: more rounds for a stable median.
        repeats = args.repeats * (4 if B * N <= 1024 else 1)
        # onnxruntime and torch are timed in separate phases: interleaving
        # them put a torch call (and its OpenMP threads winding down) right
        # before some ORT sessions, which skewed the N=128 ratios.
        times = h.interleaved(
            {key: functools.partial(sess.run, None, {"query": x}) for key, sess in sessions.items()},
            repeats=repeats,
            warmup=2,
        )
        if torch_models:
            with torch.inference_mode():
                times.update(
                    h.interleaved(
                        {key: functools.partial(net, xt) for key, net in torch_models.items()},
                        repeats=repeats,
                        warmup=2,
                    )
                )
        record(
            {
                "id": f"encoder/B={B}/N={N}",
                "section": "encoder",
                "B": B,
                "N": N,
                "rounds": repeats,
                "times": times,
            }
        )

    # int8 accuracy on a small input (float64 reference).
    x = rng.normal(size=(2, 64, args.width))
    err = do.quantization_error(
        do.export_encoder(params["heads"], configs["heads"], None),
        q_model,
        {"query": x},
        do.encoder_forward(params["heads"], configs["heads"], x),
    )
    record(
        {
            "id": "encoder/int8-error",
            "section": "encoder",
            "B": 2,
            "N": 64,
            "errors": {k: float(v) for k, v in err.items()},
        }
    )


def encoder_table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's encoder tables: medians of every session's rounds, ratios of medians; the int8 errors."""
    s = run["model"]
    lines = [
        f"E={s['width']}, H={s['heads']}, d={s['width'] // s['heads']}, layers={s['layers']}, FFN={s['ffn']}, "
        f"{run['threads']} threads each (onnxruntime CPU provider, spinning off; torch); median of the rounds.",
        "",
        "| B | N | rounds | ORT DAMCHA (Attention op, opset 23) ms | ORT MHA ms | DAMCHA/MHA | "
        "ORT decomposed (opset 18) DAMCHA/MHA | ORT int8 DAMCHA ms | torch eager DAMCHA ms | torch eager nn.MHA ms | "
        "ORT DAMCHA / torch eager DAMCHA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    timed = sorted((e for e in entries if "errors" not in e), key=lambda e: (e["B"], e["N"]))
    ratios = []
    for e in timed:
        t = e["times"]
        r23, r18 = (
            pr.ratio_of_medians(t, "ort/heads/23", "ort/none/23"),
            pr.ratio_of_medians(t, "ort/heads/18", "ort/none/18"),
        )
        ratios += [r23, r18]
        torch_cells = "- | - | -"
        if "torch/heads" in t:
            torch_cells = (
                f"{pr.median_ms(t['torch/heads']['wall']):.1f} | {pr.median_ms(t['torch/nn.MHA']['wall']):.1f} | "
                f"{pr.ratio_of_medians(t, 'ort/heads/23', 'torch/heads'):.2f}"
            )
        lines.append(
            f"| {e['B']} | {e['N']} | {len(t['ort/heads/23']['wall'])} | {pr.median_ms(t['ort/heads/23']['wall']):.1f} | "
            f"{pr.median_ms(t['ort/none/23']['wall']):.1f} | {r23:.2f} | {r18:.2f} | "
            f"{pr.median_ms(t['ort/heads-int8/23']['wall']):.1f} | {torch_cells} |"
        )
    if ratios:
        lines += [
            "",
            f"This script's target (DAMCHA/MHA <= {TARGET:.2f} at every shape, opsets 23 and 18): "
            f"{pr.verdict(max(ratios), TARGET)} (highest {max(ratios):.2f}).",
        ]
    for e in entries:
        if "errors" in e:
            lines += [
                "",
                f"int8 dynamic quantisation (B={e['B']}, N={e['N']}), errors vs float32 ORT and the float64 reference:",
                "",
                "| measure | value |",
                "|---|---|",
                *(f"| {k} | {v:.3g} |" for k, v in e["errors"].items()),
            ]
    return lines


# ------------------------------------------------------------ ONNX at the edge


def edge_shapes(tiny: bool) -> list[tuple[int, int]]:
    return [(1, 16)] if tiny else [(1, 128), (1, 512), (8, 128)]


def _edge_models(args, directory: Path) -> tuple[dict, dict, dict]:
    """Exports {(kind, metric, fmt): path}, with the configs and params per (kind, metric)."""
    import numpy as np

    import damcha_core as dc
    import damcha_onnx as do

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
        for kind in KINDS:
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


WASM_NEEDS = "Node.js and js/node_modules (`make js-deps`)"


def _wasm_times(files: dict, shapes: list, args, directory: Path) -> dict | None:
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "onnxruntime-web").is_dir():
        return None
    groups = []
    for kind in KINDS:
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


def edge_section(args, record) -> None:
    import numpy as np

    import damcha_core as dc
    import damcha_onnx as do

    shapes = edge_shapes(args.tiny)
    with tempfile.TemporaryDirectory(prefix="damcha-bench-") as tmp:
        directory = Path(tmp)
        files, configs, params = _edge_models(args, directory)
        # Latency, onnxruntime CPU (Python): the 8 sessions of a (model, shape) interleaved.
        rng = np.random.default_rng(0)
        for kind in KINDS:
            sessions = {
                f"{metric}|{fmt}": do.ort_session(files[(kind, metric, fmt)], threads=args.threads, spinning=False)
                for metric in ("heads", "none")
                for fmt in FORMATS
            }
            for B, N in shapes:
                x = rng.normal(size=(B, N, args.width))
                feeds = {k: {"query": x.astype(np.float16 if k.endswith("float16") else np.float32)} for k in sessions}
                times = h.interleaved(
                    {k: (lambda s=sess, f=feeds[k]: s.run(None, f)) for k, sess in sessions.items()},
                    repeats=args.repeats,
                    warmup=2,
                )
                record(
                    {
                        "id": f"edge/ort/{kind}/B={B}/N={N}",
                        "section": "edge",
                        "runtime": "ort",
                        "kind": kind,
                        "B": B,
                        "N": N,
                        "rounds": args.repeats,
                        "times": times,
                    }
                )
        wasm = _wasm_times(files, shapes, args, directory)
        if wasm is None:
            record({"id": "edge/wasm", "section": "edge", "runtime": "wasm", "skipped": f"needs {WASM_NEEDS}"})
        else:
            for kind in KINDS:
                for B, N in shapes:
                    record(
                        {
                            "id": f"edge/wasm/{kind}/B={B}/N={N}",
                            "section": "edge",
                            "runtime": "wasm",
                            "kind": kind,
                            "B": B,
                            "N": N,
                            "rounds": args.repeats,
                            # Every round (ms) and js/bench.mjs's own medians (the upper of
                            # the two middle rounds for an even count); the table's medians
                            # are computed here from the rounds.
                            "times_ms": wasm.get("rounds", {}).get(f"{kind}|{B}|{N}"),
                            "median_ms": wasm["groups"][f"{kind}|{B}|{N}"],
                            "ort_versions": wasm.get("versions"),
                        }
                    )
        sizes = {
            kind: {f"{m}|{f}": files[(kind, m, f)].stat().st_size for m in ("heads", "none") for f in FORMATS}
            for kind in KINDS
        }
        record({"id": "edge/sizes", "section": "edge", "bytes": sizes})
        # Accuracy against the float64 reference (DAMCHA models).
        x = np.random.default_rng(99).normal(size=(2, 64, args.width))
        errors: dict[str, dict[str, dict[str, float]]] = {}
        for kind in KINDS:
            cfg, prm = configs[(kind, "heads")], params[(kind, "heads")]
            ref = dc.damcha_attention(prm, cfg, x, causal=True) if kind == "layer" else dc.encoder_forward(prm, cfg, x)
            errors[kind] = {}
            for fmt in FORMATS:
                y = np.asarray(do.run_ort(files[(kind, "heads", fmt)], {"query": x}), dtype=np.float64)
                rel = float(np.sqrt(np.mean((y - ref) ** 2)) / np.sqrt(np.mean(ref**2)))
                errors[kind][fmt] = {"rel_rms": rel, "max_abs": float(np.max(np.abs(y - ref)))}
        record({"id": "edge/accuracy", "section": "edge", "B": 2, "N": 64, "errors": errors})


def _latency(title: str, rows: list[dict[str, Any]], cell) -> list[str]:
    lines = [f"Latency, {title}: DAMCHA ms (DAMCHA/MHA)", ""]
    lines += ["| model | B | N | " + " | ".join(FORMATS) + " |", "|---|---:|---:|" + "---:|" * len(FORMATS)]
    for e in sorted(rows, key=lambda e: (KINDS.index(e["kind"]), e["B"], e["N"])):
        lines.append(f"| {e['kind']} | {e['B']} | {e['N']} | " + " | ".join(cell(e, f) for f in FORMATS) + " |")
    return lines + [""]


def _ort_cell(e: dict[str, Any], fmt: str) -> str:
    t = e["times"]
    return (
        f"{pr.median_ms(t[f'heads|{fmt}']['wall']):.2f} ({pr.ratio_of_medians(t, f'heads|{fmt}', f'none|{fmt}'):.2f})"
    )


def _wasm_cell(e: dict[str, Any], fmt: str) -> str:
    # Runs that stored the rounds: their medians; older runs: js/bench.mjs's own.
    rounds = e.get("times_ms")
    ms = {k: statistics.median(v) for k, v in rounds.items()} if rounds else e["median_ms"]
    return f"{ms[f'heads|{fmt}']:.2f} ({ms[f'heads|{fmt}'] / ms[f'none|{fmt}']:.2f})"


def edge_table(run: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One run's edge tables: latency in onnxruntime CPU (medians of the rounds) and in
    onnxruntime-web (medians of the rounds js/bench.mjs reports; a run before it reported
    them holds its medians only), model sizes, accuracy."""
    s = run["model"]
    by_id = {e["id"]: e for e in entries}
    ort = [e for e in entries if e.get("runtime") == "ort"]
    wasm = [e for e in entries if e.get("runtime") == "wasm" and "skipped" not in e]
    lines = [
        f"E={s['width']}, H={s['heads']}, d={s['width'] // s['heads']}; layer: one causal self-attention layer; "
        f'stack: {s["layers"]} pre-norm layers, FFN {s["ffn"]}; DAMCHA = metric "heads" (tied, gates 0.5) vs '
        f'MHA = the same exported with metric "none". onnxruntime CPU: {run["threads"]} threads, spinning off, '
        "the 8 sessions of a (model, shape) alternating, median of the rounds; onnxruntime-web: WASM, 1 thread, "
        f"under Node.js {run.get('node') or '(absent)'}, the 8 sessions interleaved, "
        + (
            "median of the rounds."
            if any(e.get("times_ms") for e in wasm)
            else "the medians js/bench.mjs reported (this run stored no per-round times)."
        ),
        "",
    ]
    if ort:
        lines += _latency(f"onnxruntime CPU (Python), {ort[0]['rounds']} rounds", ort, _ort_cell)
    if wasm:
        lines += _latency(f"onnxruntime-web WASM (Node.js), {wasm[0]['rounds']} rounds", wasm, _wasm_cell)
    if "edge/wasm" in by_id:
        lines += [f"onnxruntime-web: not measured ({by_id['edge/wasm']['skipped']}).", ""]
    if "edge/sizes" in by_id:
        sizes = by_id["edge/sizes"]["bytes"]
        lines += ["Model size, KiB (DAMCHA / MHA)", "", "| model | " + " | ".join(FORMATS) + " |"]
        lines.append("|---|" + "---:|" * len(FORMATS))
        for kind in KINDS:
            cells = [f"{sizes[kind][f'heads|{f}'] / 1024:.0f} / {sizes[kind][f'none|{f}'] / 1024:.0f}" for f in FORMATS]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    if "edge/accuracy" in by_id:
        acc = by_id["edge/accuracy"]
        lines += [
            f"Accuracy of DAMCHA (B={acc['B']}, N={acc['N']}, fresh normal inputs; static int8 calibrated on 8 other "
            "batches): relative RMS error vs the float64 reference (max abs error)",
            "",
            "| model | " + " | ".join(FORMATS) + " |",
            "|---|" + "---:|" * len(FORMATS),
        ]
        for kind in KINDS:
            err = acc["errors"][kind]
            cells = [f"{err[f]['rel_rms']:.2e} ({err[f]['max_abs']:.1e})" for f in FORMATS]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    while lines and not lines[-1]:
        lines.pop()
    return lines


PORT = pr.Port(
    "onnx",
    "bench_onnx.py",
    [
        pr.Block("onnx", "ONNX Runtime encoder", encoder_table, section="encoder"),
        pr.Block("onnx-edge", "ONNX at the edge", edge_table, section="edge"),
    ],
    versions=("onnx", "onnxruntime"),
)


def _node_version() -> str | None:
    node = shutil.which("node")
    return subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip() if node else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--section", choices=("all", "encoder", "edge"), default="all")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and 2 repeats: checks the script, measures nothing")
    PORT.add_output_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return PORT.report(args.report, args.docs)
    threads = h.fix_threads(args.threads)  # before numpy, onnxruntime and torch are imported
    if args.tiny:
        args.width, args.heads, args.ffn, args.repeats = 32, 4, 64, 2
    with contextlib.ExitStack() as stack:
        results = PORT.open(args, stack)
        if results is None:
            return 2
        run = PORT.start(
            results,
            argv,
            tiny=args.tiny,
            threads=args.threads,
            affinity=threads.get("affinity"),
            section=args.section,
            model={"width": args.width, "heads": args.heads, "layers": args.layers, "ffn": args.ffn},
            repeats=args.repeats,
            torch=not args.no_torch,
            node=_node_version(),
        )

        def record(entry: dict[str, Any]) -> None:
            PORT.record(results, run, entry)
            print(f"  {entry['id']}: done", flush=True)

        if args.section in ("all", "encoder"):
            encoder_section(args, record)
        if args.section in ("all", "edge"):
            edge_section(args, record)
        return PORT.finish(results, run, args)


if __name__ == "__main__":
    sys.exit(main())
