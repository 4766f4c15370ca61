"""``damcha export``: canonical params (safetensors) -> validated ONNX model.

Every flag and path is checked before any work (exit 2, one line naming the
flag). The model is exported into a private folder beside ``--out``,
validated there (onnx.checker, shape inference, onnxruntime and the ONNX
reference evaluator against the NumPy reference), and moved into place only
when every check passed: a failed export (exit 1 on a mismatch) never
leaves a partial file and never replaces an earlier good one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile

import numpy as np

import damcha_core as dc
from damcha_core import _cliutil as cu

from ._export import export
from ._graph import ATTENTION_OPSET, DTYPES
from ._io import data_file_name, remove_stale_data
from ._options import check_opset
from ._runtime import empty_kv_cache, run_ort, run_reference

PROG = "damcha export"
#: Chunks of the validation decode with --kv-cache: a prefill, one token, the rest.
DECODE_CHUNKS = (3, 1, 3)
#: Validation allowance per dtype: max |error| <= atol * (1 + max |expected|).
ATOL = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2}
EXTERNAL_DATA = {"auto": None, "always": True, "never": False}
#: An int8 model passes when its relative RMS error against the reference is at most this.
INT8_RTOL = 0.1


def int8_path(out: str) -> str:
    """Where ``--quantize`` writes the int8 model: ``m.onnx`` -> ``m.int8.onnx``."""
    stem = out[: -len(".onnx")] if out.endswith(".onnx") else out
    return stem + ".int8.onnx"


def _parser() -> argparse.ArgumentParser:
    p = cu.ArgumentParser(
        prog=PROG,
        description="Export one DAMCHA layer from canonical params to ONNX, then check it "
        "(onnx.checker full check, shape inference) and compare onnxruntime and the ONNX "
        "reference evaluator against the NumPy reference on random inputs; the file is written "
        "only when every check passes.",
        epilog="Exit status: 0 written and validated, 1 a validation mismatch (nothing written), 2 bad arguments.",
    )
    p.add_argument("--config", help="DamchaConfig as a JSON file or inline JSON (default: the config stored in --params)")
    p.add_argument("--params", required=True, help="safetensors file written by damcha_core.save_params")
    p.add_argument("--out", required=True, help="path of the .onnx file to write")
    p.add_argument("--opset", type=int, default=ATTENTION_OPSET, help="17-22: decomposed graph; >= 23: Attention op (default 23)")
    p.add_argument("--dtype", choices=tuple(d for d in ATOL if d in DTYPES), default="float32",
                   help="inputs, weights and output (float16 accumulates the RMS statistic and softmax in float32)")
    p.add_argument("--causal", action="store_true", help="causal self-attention (top-left)")
    p.add_argument("--cross", action="store_true", help="add a context input (cross-attention)")
    p.add_argument("--mask", action="store_true", help="add a boolean mask input (B|1, H|1, N|1, M), True = may attend")
    p.add_argument("--kv-cache", action="store_true",
                   help="export one incremental decoding step: past_key/past_value in, present_key/present_value out "
                   "(needs --causal, no --cross); validated by decoding in chunks")
    p.add_argument("--external-data", choices=tuple(EXTERNAL_DATA), default="auto",
                   help="weights in <out>.data beside the .onnx file: auto (only past protobuf's 2 GiB limit), "
                   "always or never")
    p.add_argument("--quantize", choices=("dynamic", "static"), default=None,
                   help="also write an int8 model to <out stem>.int8.onnx: dynamic (int8 weights, activations "
                   "quantised at run time) or static QDQ (calibrated on random normal inputs; calibrate on real "
                   "data with damcha_onnx.quantize_static_int8); needs --dtype float32; validated against the "
                   f"reference (relative RMS error <= {INT8_RTOL})")
    p.add_argument("--seed", type=cu.int_arg(minimum=0), default=0, help="seed of the validation inputs (>= 0)")
    return p


def _load_config(text: str) -> dc.DamchaConfig:
    source = text
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            cu.usage_error("--config", f"cannot read {source!r}: {exc}", prog=PROG)
    try:
        return dc.DamchaConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, AttributeError, dc.DamchaError) as exc:  # not JSON, fields missing or invalid
        cu.usage_error("--config", f"must be a DamchaConfig as JSON (a file or inline), e.g. the `config` of "
                       f"damcha_core.save_params. Received: --config={source[:200]!r} ({exc})", prog=PROG)


def _validate(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    """Every flag before any work; returns the params and config."""
    out = cu.check_output_file(args.out, "--out", prog=PROG)
    if args.quantize is not None:
        if args.dtype != "float32":
            cu.usage_error("--quantize", f"needs --dtype float32 (onnxruntime quantises float32 weights). "
                           f"Received: --dtype {args.dtype}", prog=PROG)
        if args.kv_cache:
            cu.usage_error("--quantize", "cannot be combined with --kv-cache", prog=PROG)
        cu.check_output_file(int8_path(args.out), "--quantize", prog=PROG)
    if EXTERNAL_DATA[args.external_data] is not False:
        data = out.with_name(data_file_name(str(out)))
        if data.exists() and cu.read_only(data):
            cu.usage_error("--out", f"its external data file {str(data)!r} is read-only; it is not replaced", prog=PROG)
    try:
        check_opset(args.opset)
    except dc.DamchaError as exc:
        cu.usage_error("--opset", str(exc), prog=PROG)
    if args.kv_cache and not args.causal:
        cu.usage_error("--kv-cache", "needs --causal (a decode step is causal)", prog=PROG)
    if args.kv_cache and args.cross:
        cu.usage_error("--kv-cache", "cannot be combined with --cross (the cache holds the layer's own tokens)", prog=PROG)
    cu.check_input_file(args.params, "--params", prog=PROG)
    try:
        params, stored = dc.load_params(args.params)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is a bad argument (exit 2), not a mismatch
        cu.usage_error("--params", f"{args.params!r} is not a readable damcha_core.save_params file: "
                       f"{type(exc).__name__}: {exc}", prog=PROG)
    config = stored if args.config is None else _load_config(args.config)
    if config != stored:
        cu.usage_error("--config", f"differs from the config stored in {args.params!r}. "
                       f"Received: {config.to_dict()}, stored={stored.to_dict()}", prog=PROG)
    if not args.cross and config.context_dim != config.query_dim:
        cu.usage_error("--cross", f"is needed: the layer's context_dim ({config.context_dim}) differs from its "
                       f"query_dim ({config.query_dim}), so the context is a separate input", prog=PROG)
    return params, config


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (usage errors too: 2)."""
    return cu.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    params, config = _validate(args)
    out = os.path.abspath(args.out)
    staging = tempfile.mkdtemp(prefix=".damcha-export-", dir=os.path.dirname(out))
    try:
        staged = os.path.join(staging, os.path.basename(out))
        try:
            model = export(params, config, staged, opset=args.opset, causal=args.causal, cross=args.cross,
                           mask=args.mask, dtype=args.dtype, kv_cache=args.kv_cache,
                           external_data=EXTERNAL_DATA[args.external_data])
        except dc.DamchaError as exc:  # a combination the exporter refuses: still a bad argument
            cu.usage_error("", str(exc), prog=PROG)
        ok = _check(staged, args, params, config, len(model.graph.node))
        if ok and args.quantize is not None:
            ok = _quantize(staged, os.path.join(staging, os.path.basename(int8_path(out))), args, params, config)
        if not ok:
            print(f"not written: {args.out} (validation failed; an earlier file there is kept)")
            return cu.EXIT_MISMATCH
        written = sorted(os.listdir(staging), key=lambda n: n == os.path.basename(out))  # the data file first
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(os.path.dirname(out), name))
        if data_file_name(out) not in written:
            remove_stale_data(out)
        print("wrote " + ", ".join(os.path.join(os.path.dirname(args.out), n) for n in sorted(written)))
        return cu.EXIT_OK
    except OSError as exc:  # the disk filled up, the folder vanished: nothing was moved into place
        print(f"{PROG}: error: --out: could not write {args.out!r}: {exc}", file=sys.stderr)
        return cu.EXIT_USAGE
    finally:
        for name in os.listdir(staging):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(staging, name))
        with contextlib.suppress(OSError):
            os.rmdir(staging)


def _check(path: str, args: argparse.Namespace, params: dict[str, np.ndarray], config: dc.DamchaConfig,
           nodes: int) -> bool:
    """Run the staged model in onnxruntime and the reference evaluator against the NumPy reference."""
    inputs = _inputs(args, config, np.random.default_rng(args.seed))
    B, N = inputs["query"].shape[:2]
    M = inputs["context"].shape[1] if args.cross else N
    expected = dc.damcha_attention(params, config, inputs["query"], inputs.get("context"),
                                   mask=inputs.get("mask"), causal=args.causal)
    atol = ATOL[args.dtype]
    ok = True
    print(f"exported {args.out} (opset {args.opset}, {args.dtype}, {nodes} nodes)")
    print("onnx.checker (full_check) and shape inference: ok")
    how = f"decoded in chunks {DECODE_CHUNKS} " if args.kv_cache else ""
    for name, run in (("onnxruntime CPU", run_ort), ("onnx.reference", run_reference)):
        actual = _decode(path, run, inputs, B) if args.kv_cache else run(path, inputs)
        err = float(np.max(np.abs(np.asarray(actual, np.float64) - expected)))
        good = bool(err <= atol * (1.0 + float(np.max(np.abs(expected)))))  # NaN: not good
        ok &= good
        print(f"{name:<16} vs NumPy reference: max |error| = {err:.2e} {how}on (B={B}, N={N}, M={M}) "
              f"-> {'ok' if good else 'MISMATCH'}")
    return ok


def _inputs(args: argparse.Namespace, config: dc.DamchaConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    B, N, M = 2, 7, 5 if args.cross else 7
    inputs = {"query": rng.normal(size=(B, N, config.query_dim))}
    if args.cross:
        inputs["context"] = rng.normal(size=(B, M, config.context_dim))
    if args.mask:
        inputs["mask"] = rng.random((B, 1, N, M)) < 0.8
    return inputs


def _quantize(staged: str, target: str, args: argparse.Namespace, params: dict[str, np.ndarray],
              config: dc.DamchaConfig) -> bool:
    """Write the int8 model of the staged float32 one to ``target`` and judge it against the reference."""
    from ._quantize import quantization_error, quantize_int8, quantize_static_int8

    # onnxruntime's quantiser logs a generic "consider pre-processing" warning on the root logger.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        if args.quantize == "dynamic":
            model = quantize_int8(staged, target)
        else:  # calibrated on inputs drawn like the validation inputs, from another seed
            calibration = [_inputs(args, config, np.random.default_rng([args.seed, 1, i])) for i in range(4)]
            model = quantize_static_int8(staged, calibration, target)
    finally:
        logging.disable(previous)
    inputs = _inputs(args, config, np.random.default_rng(args.seed))
    expected = dc.damcha_attention(params, config, inputs["query"], inputs.get("context"),
                                   mask=inputs.get("mask"), causal=args.causal)
    errors = quantization_error(staged, model, inputs, expected)
    rel = errors["rel_rms_int8_vs_reference"]
    good = bool(rel <= INT8_RTOL)
    print(f"int8 ({args.quantize}) vs NumPy reference: relative RMS error = {rel:.2e}, max |error| = "
          f"{errors['max_abs_int8_vs_reference']:.2e} -> {'ok' if good else 'MISMATCH'} (allowed {INT8_RTOL})")
    return good


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
