"""``damcha export``: canonical params (safetensors) -> validated ONNX model."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import damcha_core as dc

from ._export import export
from ._graph import ATTENTION_OPSET
from ._runtime import empty_kv_cache, run_ort, run_reference

#: Chunks of the validation decode with --kv-cache: a prefill, one token, the rest.
DECODE_CHUNKS = (3, 1, 3)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="damcha export",
        description="Export one DAMCHA layer from canonical params to ONNX, then check it "
        "(onnx.checker full check, shape inference) and compare onnxruntime and the ONNX "
        "reference evaluator against the NumPy reference on random inputs.",
    )
    p.add_argument("--config", help="DamchaConfig as a JSON file or inline JSON (default: the config stored in --params)")
    p.add_argument("--params", required=True, help="safetensors file written by damcha_core.save_params")
    p.add_argument("--out", required=True, help="path of the .onnx file to write")
    p.add_argument("--opset", type=int, default=ATTENTION_OPSET, help="17-22: decomposed graph; >= 23: Attention op (default 23)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--causal", action="store_true", help="causal self-attention (top-left)")
    p.add_argument("--cross", action="store_true", help="add a context input (cross-attention)")
    p.add_argument("--mask", action="store_true", help="add a boolean mask input (B|1, H|1, N|1, M), True = may attend")
    p.add_argument("--kv-cache", action="store_true",
                   help="export one incremental decoding step: past_key/past_value in, present_key/present_value out "
                   "(needs --causal, no --cross); validated by decoding in chunks")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation inputs")
    return p


def _load_config(text: str) -> dc.DamchaConfig:
    source = text
    if os.path.exists(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        return dc.DamchaConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, dc.DamchaValueError) as exc:  # not JSON, fields missing or invalid
        raise dc.DamchaValueError(
            f"`--config` must be a DamchaConfig as JSON (a file or inline), e.g. the `config` of "
            f"damcha_core.save_params. Received: --config={source[:200]!r} ({exc})"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params, stored = dc.load_params(args.params)
    except Exception as exc:  # noqa: BLE001 - a missing, corrupt or foreign file is a bad argument (exit 2), not a mismatch
        print(f"damcha export: error: --params {args.params!r} is not a readable damcha_core.save_params file: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        config = stored if args.config is None else _load_config(args.config)
        if config != stored:
            raise dc.DamchaValueError(
                f"`--config` differs from the config stored in {args.params!r}. "
                f"Received: --config={config.to_dict()}, stored={stored.to_dict()}"
            )
        model = export(params, config, args.out, opset=args.opset, causal=args.causal, cross=args.cross,
                       mask=args.mask, dtype=args.dtype, kv_cache=args.kv_cache)
    except (dc.DamchaError, OSError) as exc:
        print(f"damcha export: error: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    B, N, M = 2, 7, 5 if args.cross else 7
    inputs = {"query": rng.normal(size=(B, N, config.query_dim))}
    if args.cross:
        inputs["context"] = rng.normal(size=(B, M, config.context_dim))
    if args.mask:
        inputs["mask"] = rng.random((B, 1, N, M)) < 0.8
    expected = dc.damcha_attention(params, config, inputs["query"], inputs.get("context"),
                                   mask=inputs.get("mask"), causal=args.causal)
    atol = 1e-4 if args.dtype == "float32" else 1e-9
    ok = True
    print(f"wrote {args.out} (opset {args.opset}, {args.dtype}, {len(model.graph.node)} nodes)")
    print("onnx.checker (full_check) and shape inference: ok")
    how = f"decoded in chunks {DECODE_CHUNKS} " if args.kv_cache else ""
    for name, run in (("onnxruntime CPU", run_ort), ("onnx.reference", run_reference)):
        actual = _decode(model, run, inputs, B) if args.kv_cache else run(model, inputs)
        err = float(np.max(np.abs(actual - expected)))
        good = err <= atol * (1.0 + float(np.max(np.abs(expected))))
        ok &= good
        print(f"{name:<16} vs NumPy reference: max |error| = {err:.2e} {how}on (B={B}, N={N}, M={M}) "
              f"-> {'ok' if good else 'MISMATCH'}")
    return 0 if ok else 1


def _decode(model, run, inputs: dict[str, np.ndarray], batch: int) -> np.ndarray:
    """The layer's output on the whole sequence, fed step by step through its cache."""
    cache, outs, start = empty_kv_cache(model, batch), [], 0
    for n in DECODE_CHUNKS:
        stop = start + n
        feeds = {"query": inputs["query"][:, start:stop], **cache}
        if "mask" in inputs:
            feeds["mask"] = inputs["mask"][:, :, start:stop, :stop]  # this step's rows, cached + new keys
        step = run(model, feeds, all_outputs=True)
        cache = {"past_key": step["present_key"], "past_value": step["present_value"]}
        outs.append(step["output"])
        start = stop
    return np.concatenate(outs, axis=1)


if __name__ == "__main__":
    sys.exit(main())
