"""``damcha export``: canonical params (safetensors) -> validated ONNX model.

Every flag and path is checked before any work (exit 2, one line naming the
flag). The model is exported into a private folder beside ``--out``,
validated there (onnx.checker, shape inference, onnxruntime and the ONNX
reference evaluator against the NumPy reference), and moved into place only
when every check passed: a failed export (exit 1 on a mismatch) never
leaves a partial file and never replaces an earlier good one. The same
holds for the int8 model of ``--quantize`` and the ORT files of ``--ort-dir``.
After a successful run, a stale ``<out>.data`` is removed (``--out`` owns that
name); ``<out stem>.int8.onnx`` and ``<out stem>.int8.ort`` (in ``--ort-dir``)
that this run did not write are named in a warning, not removed: nothing shows
whether an earlier export or their owner wrote them.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx

import damcha_core as dc
from damcha_core import _cliutil as cu

from ._export import export
from ._graph import ATTENTION_OPSET, DTYPES, MIN_OPSET, check_scaled_query
from ._io import ONNX_PATH_RULE, data_file_name, is_onnx_path, read_only_data_file, remove_stale_data
from ._options import check_opset
from ._runtime import empty_kv_cache, ort_session, run_ort, run_reference

PROG = "damcha export"
#: Chunks of the validation decode with --kv-cache: a prefill, one token, the rest.
DECODE_CHUNKS = (3, 1, 3)
#: Validation allowance per dtype: max |error| <= atol * (1 + max |expected|).
ATOL = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2}
EXTERNAL_DATA = {"auto": None, "always": True, "never": False}
#: --mask choice -> the exporter's ``mask=``: none, a 4-D (B|1, H|1, N|1, M) mask, a (B, M) padding mask.
MASKS: dict[str, bool | str] = {"none": False, "4d": True, "padding": "padding"}
#: An int8 model passes when its relative RMS error against the reference is at most this.
INT8_RTOL = 0.1
#: The reduced operator config ``convert_to_ort`` writes beside the .ort files (with type reduction).
ORT_CONFIG = "required_operators_and_types.config"

#: Output name -> array: "output", and "weights" with --return-weights.
Outputs = dict[str, np.ndarray]


def int8_path(out: str) -> str:
    """Where ``--quantize`` writes the int8 model: ``m.onnx`` -> ``m.int8.onnx``."""
    stem = out[: -len(".onnx")] if out.lower().endswith(".onnx") else out
    return stem + ".int8.onnx"


def ort_names(out: str, quantize: bool) -> list[str]:
    """The files ``--ort-dir`` receives: ``<stem>.ort`` of each model (``convert_to_ort`` names
    them by the ``.onnx`` file's stem), then the reduced operator config."""
    models = [out] + ([int8_path(out)] if quantize else [])
    return [Path(m).stem + ".ort" for m in models] + [ORT_CONFIG]


def _parser() -> argparse.ArgumentParser:
    p = cu.ArgumentParser(
        prog=PROG,
        description="Export one DAMCHA layer from canonical params to ONNX, then check it "
        "(onnx.checker full check, shape inference) and compare onnxruntime and the ONNX "
        "reference evaluator against the NumPy reference on random inputs; the file is written "
        "only when every check passes.",
        epilog="Exit status: 0 written and validated, 1 a validation mismatch (nothing written), 2 bad arguments.",
    )
    p.add_argument(
        "--config",
        help="DamchaConfig as a JSON file or inline JSON: a check, it must equal the config stored in --params "
        "(which is used without it)",
    )
    required = p.add_argument_group("required")
    required.add_argument("--params", required=True, help="safetensors file written by damcha_core.save_params")
    required.add_argument(
        "--out",
        required=True,
        help="path of the .onnx file to write; a stale <out>.data is removed after a successful run, and "
        "<out stem>.int8.onnx / <out stem>.int8.ort (in --ort-dir) that this run did not write are named in a "
        "warning (an earlier export's would no longer match), never removed",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=ATTENTION_OPSET,
        help=f"an integer in [{MIN_OPSET}, {onnx.defs.onnx_opset_version()}] (the installed onnx's newest): "
        f"{MIN_OPSET}-{ATTENTION_OPSET - 1} a decomposed graph, >= {ATTENTION_OPSET} the Attention op "
        f"(default {ATTENTION_OPSET})",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(d for d in ATOL if d in DTYPES),
        default="float32",
        help="inputs, weights and output (float16 accumulates the RMS statistic and softmax in float32)",
    )
    p.add_argument("--causal", action="store_true", help="causal self-attention (top-left)")
    p.add_argument(
        "--cross",
        action="store_true",
        help="add a context input (cross-attention); a config whose value_input_dim differs from its "
        "context_dim also gets a value input (B, M, E_v)",
    )
    # `--mask` alone keeps its meaning from before the choices existed: a 4-D mask.
    p.add_argument(
        "--mask",
        nargs="?",
        choices=tuple(MASKS),
        const="4d",
        default="none",
        help="a boolean mask input, True = may attend: 4d (the default of a bare --mask) "
        "(B|1, H|1, N|1, M), padding (B, M) as a tokenizer's attention mask, or none (default)",
    )
    p.add_argument(
        "--return-weights",
        action="store_true",
        help="add an output 'weights' (B, H, N, M), the attention probabilities; validated against "
        "damcha_core.damcha_attention(..., return_weights=True)",
    )
    p.add_argument(
        "--kv-cache",
        action="store_true",
        help="export one incremental decoding step: past_key/past_value in, present_key/present_value out "
        "(needs --causal, no --cross); validated by decoding in chunks",
    )
    p.add_argument(
        "--external-data",
        choices=tuple(EXTERNAL_DATA),
        default="auto",
        help="weights in <out>.data beside the .onnx file: auto (only past protobuf's 2 GiB limit), always or never",
    )
    p.add_argument(
        "--quantize",
        choices=("dynamic", "static"),
        default=None,
        help="also write an int8 model to <out stem>.int8.onnx: dynamic (int8 weights, activations "
        "quantised at run time) or static QDQ (calibrated on random normal inputs; calibrate on real "
        "data with damcha_onnx.quantize_static_int8); needs --dtype float32; validated against the "
        f"reference (relative RMS error <= {INT8_RTOL}; a --kv-cache step decoded through its cache)",
    )
    p.add_argument(
        "--ort-dir",
        metavar="DIR",
        default=None,
        help="also write the ORT format for onnxruntime Mobile and minimal builds into DIR (created if "
        f"needed): <out stem>.ort (and <out stem>.int8.ort with --quantize) and {ORT_CONFIG}, the "
        "reduced operator config of a minimal build (damcha_onnx.convert_to_ort); each .ort file is "
        "loaded and validated like the .onnx one",
    )
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
    elif os.path.isdir(text):
        cu.usage_error("--config", f"is a folder, expected a JSON file or inline JSON. Received: {source!r}", prog=PROG)
    elif os.path.exists(text):  # a device, a pipe: not read, it could block or never end
        cu.usage_error("--config", f"is not a regular file. Received: {source!r}", prog=PROG)
    elif text.lstrip().startswith("["):
        cu.usage_error("--config", f"inline JSON must be an object ('{{...}}'). Received: {source[:200]!r}", prog=PROG)
    elif not text.lstrip().startswith("{"):
        # Neither a file nor inline JSON (an object): a path that does not exist, most likely.
        cu.usage_error("--config", f"no such file {source!r} (inline JSON is an object: '{{...}}')", prog=PROG)
    try:
        return dc.DamchaConfig.from_dict(json.loads(text))
    except (
        json.JSONDecodeError,
        TypeError,
        AttributeError,
        dc.DamchaError,
    ) as exc:  # not JSON, fields missing or invalid
        cu.usage_error(
            "--config",
            f"must be a DamchaConfig as JSON (a file or inline), e.g. the `config` of "
            f"damcha_core.save_params. Received: --config={source[:200]!r} ({exc})",
            prog=PROG,
        )


def _check_ort_dir(args: argparse.Namespace) -> None:
    folder = cu.check_output_dir(args.ort_dir, "--ort-dir", prog=PROG)
    if folder.is_dir():  # files it would replace: not a folder, not read-only
        for name in ort_names(args.out, args.quantize is not None):
            cu.check_output_file(folder / name, "--ort-dir", prog=PROG)


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def _check_not_an_input(args: argparse.Namespace) -> None:
    """No file this command writes may be one it reads: the export would replace the weights."""
    inputs = [("--params", args.params)]
    if args.config is not None and os.path.isfile(args.config):
        inputs.append(("--config", args.config))
    outputs = [
        ("--out", args.out),
        ("--out", os.path.join(os.path.dirname(os.path.abspath(args.out)), data_file_name(args.out))),
    ]
    if args.quantize is not None:
        outputs.append(("--quantize", int8_path(args.out)))
    if args.ort_dir is not None:
        outputs += [
            ("--ort-dir", os.path.join(args.ort_dir, n)) for n in ort_names(args.out, args.quantize is not None)
        ]
    for flag, written in outputs:
        for source, read in inputs:
            if _same_file(written, read):
                cu.usage_error(
                    flag,
                    f"would overwrite the {source} file {read!r}; expected a path other than the input. "
                    f"Received: {flag} {written!r}",
                    prog=PROG,
                )


def _validate(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    """Every flag before any work; returns the params and config."""
    out = cu.check_output_file(args.out, "--out", prog=PROG)
    if not is_onnx_path(str(args.out)):  # the Python API's rule (damcha_onnx._io.check_path)
        cu.usage_error("--out", f"expected {ONNX_PATH_RULE}. Received: {args.out!r}", prog=PROG)
    if args.quantize is not None:
        if args.dtype != "float32":
            cu.usage_error(
                "--quantize",
                f"needs --dtype float32 (onnxruntime quantises float32 weights). Received: --dtype {args.dtype}",
                prog=PROG,
            )
        cu.check_output_file(int8_path(args.out), "--quantize", prog=PROG)
    if args.ort_dir is not None:
        _check_ort_dir(args)
    if EXTERNAL_DATA[args.external_data] is not False:
        # The data file is an output too (read-only, a folder, a name the OS refuses: refused here).
        data_path = out.with_name(data_file_name(str(out)))
        if os.path.isdir(data_path):  # False, not OSError, for a name the OS refuses (checked next)
            # The generic check said "--out: is a directory ... Received: 'm.onnx.data'", a path the
            # user never typed: say that the folder sits where --out's data file goes, and the ways out.
            never = ""
            if args.external_data == "auto":
                never = ", or pass --external-data never (the weights in the .onnx file, up to protobuf's 2 GiB)"
            cu.usage_error(
                "--out",
                f"{str(data_path)!r} is a folder, where the external data file of --out goes "
                f"(<out>.data, --external-data {args.external_data}); expected no folder there: move or rename "
                f"it, or choose another --out{never}. Received: --out {args.out!r}",
                prog=PROG,
            )
        try:
            os.lstat(data_path)
        except OSError as exc:
            # A name the OS refuses (a 248-byte --out stem: its data file's name passes 255 bytes) was
            # reported as "--out: is not a usable path ... Received: '<out>.data'", a path the user never
            # typed: name it as --out's data file, when it is written, and the ways out.
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                never = ""
                if args.external_data == "auto":
                    never = ", or pass --external-data never (the weights in the .onnx file, up to protobuf's 2 GiB)"
                when = "written for a model past 2 GiB" if args.external_data == "auto" else "always written"
                cu.usage_error(
                    "--out",
                    f"its external data file {str(data_path)!r} (<out>.data, --external-data {args.external_data}: "
                    f"{when}) is not a usable path ({exc.strerror}); expected a --out whose data file the OS "
                    f"takes: choose a shorter --out{never}. Received: --out {args.out!r}",
                    prog=PROG,
                )
        cu.check_output_file(data_path, "--out", prog=PROG)
    elif (data := read_only_data_file(str(out))) is not None:  # a one-file export removes a stale data file
        cu.usage_error(
            "--out",
            f"{data!r} is read-only; an export without external data removes the stale data file of an "
            "earlier one, and a read-only file is never replaced or removed",
            prog=PROG,
        )
    try:
        check_opset(args.opset)
    except dc.DamchaError as exc:
        cu.usage_error("--opset", str(exc), prog=PROG)
    cu.require("onnxruntime", prog=PROG, why="the validation, --quantize and --ort-dir")
    if args.quantize == "static":
        from ._quantize import static_opset_rule

        rule = static_opset_rule(args.opset, dynamic="--quantize dynamic")
        if rule is not None:
            cu.usage_error("--quantize", f"static needs {rule}. Received: --opset {args.opset}", prog=PROG)
    if args.kv_cache and not args.causal:
        cu.usage_error("--kv-cache", "needs --causal (a decode step is causal)", prog=PROG)
    if args.kv_cache and args.cross:
        cu.usage_error(
            "--kv-cache", "cannot be combined with --cross (the cache holds the layer's own tokens)", prog=PROG
        )
    cu.check_input_file(args.params, "--params", prog=PROG)
    _check_not_an_input(args)
    try:
        params, stored = dc.load_params(args.params)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is a bad argument (exit 2), not a mismatch
        cu.usage_error(
            "--params",
            f"{args.params!r} is not a readable damcha_core.save_params file: {type(exc).__name__}: {exc}",
            prog=PROG,
        )
    config = stored if args.config is None else _load_config(args.config)
    # Compared as computed: scale None is 1/sqrt(key_dim), so a --config that
    # writes that number out describes the stored layer.
    if config.replace(scale=config.softmax_scale) != stored.replace(scale=stored.softmax_scale):
        given, kept = config.to_dict(), stored.to_dict()
        # The fields written differently (scale only where the numbers differ too).
        fields = ", ".join(
            f"{k}={given[k]!r} (stored {kept[k]!r})"
            for k in given
            if given[k] != kept[k] and (k != "scale" or config.softmax_scale != stored.softmax_scale)
        )
        cu.usage_error(
            "--config",
            f"differs from the config stored in {args.params!r} in: {fields}. Omit --config to use the stored one",
            prog=PROG,
        )
    _check_dtype_holds(args, params, config)
    if not args.cross and config.context_dim != config.query_dim:
        cu.usage_error(
            "--cross",
            f"is needed: the layer's context_dim ({config.context_dim}) differs from its "
            f"query_dim ({config.query_dim}), so the context is a separate input",
            prog=PROG,
        )
    if not args.cross and config.value_input_dim != config.context_dim:
        cu.usage_error(
            "--cross",
            f"is needed: the layer's value_input_dim ({config.value_input_dim}) differs from "
            f"its context_dim ({config.context_dim}), so the values are a separate input",
            prog=PROG,
        )
    return params, config


def _check_dtype_holds(args: argparse.Namespace, params: dict[str, np.ndarray], config: dc.DamchaConfig) -> None:
    """Exit 2 naming ``--dtype`` when a weight would round to inf in it, and the narrowest choice that
    holds every weight: the exporter's own refusal named ``params[...]`` alone, not the flag that fixes it.
    The query weights count as the export folds them, times the config's ``scale`` (a large one took them
    past the dtype's range, and the exporter named its internal weight ``q.kernel``)."""

    def fits(dtype: str) -> dc.DamchaValueError | None:
        try:
            dc.check_params_fit(params, dtype, float(np.finfo(dtype).max))
            check_scaled_query(params, config, dtype)
        except dc.DamchaValueError as exc:
            return exc
        return None

    problem = fits(args.dtype)
    if problem is None:
        return
    limit = float(np.finfo(args.dtype).max)
    wider = sorted((d for d in ATOL if d in DTYPES and float(np.finfo(d).max) > limit), key=lambda d: np.finfo(d).max)
    holding = next((d for d in wider if fits(d) is None), None)
    remedy = (
        f"pass --dtype {holding}, the narrowest choice that holds them"
        if holding is not None
        else "no --dtype choice holds them; rescale the weights"
    )
    cu.usage_error(
        "--dtype",
        f"{args.dtype} cannot hold the weights of --params {args.params!r} ({problem}); {remedy}. "
        f"Received: --dtype {args.dtype}",
        prog=PROG,
    )


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (usage errors too: 2)."""
    return cu.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    params, config = _validate(args)
    out = os.path.abspath(args.out)
    # A one-file model is written through a link to --out, as damcha_onnx.export writes it (the CLI
    # had replaced the link itself); staged beside the link's file, so that its rename stays on one
    # file system.
    through = os.path.realpath(out) if os.path.islink(out) else out
    staging = tempfile.mkdtemp(prefix=".damcha-export-", dir=os.path.dirname(through))
    try:
        staged = os.path.join(staging, os.path.basename(out))
        try:
            model = export(
                params,
                config,
                staged,
                opset=args.opset,
                causal=args.causal,
                cross=args.cross,
                mask=MASKS[args.mask],
                dtype=args.dtype,
                kv_cache=args.kv_cache,
                return_weights=args.return_weights,
                external_data=EXTERNAL_DATA[args.external_data],
            )
        except dc.DamchaError as exc:  # a combination the exporter refuses: still a bad argument
            cu.usage_error("", str(exc), prog=PROG)
        nodes = len(model.graph.node)
        del model  # the checks read the written file: the in-memory copy of the weights is not needed
        inputs = _inputs(args, config, np.random.default_rng(args.seed))
        expected = _reference(args, params, config, inputs)
        print(f"exported {args.out} (opset {args.opset}, {args.dtype}, {nodes} nodes)")
        print("onnx.checker (full_check) and shape inference: ok")
        ok = _check(staged, args, inputs, expected)
        staged_int8 = os.path.join(staging, os.path.basename(int8_path(out)))
        if ok and args.quantize is not None:
            ok = _quantize(staged, staged_int8, args, params, config, inputs, expected)
        ort_stage = os.path.join(staging, "ort")  # a folder: only the files beside it go to --out's folder
        if ok and args.ort_dir is not None:
            models = [staged] + ([staged_int8] if args.quantize is not None else [])
            ok = _ort(models, ort_stage, args, inputs, expected)
        if not ok:
            print(f"not written: {args.out} (validation failed; an earlier file there is kept)")
            return cu.EXIT_MISMATCH
        moved = []
        if args.ort_dir is not None:
            # Renamed into place, file by file, only now that every check passed (copied first when
            # --ort-dir is on another file system than --out).
            try:
                with cu.atomic_dir(args.ort_dir) as tmp:
                    for name in sorted(os.listdir(ort_stage)):
                        shutil.move(os.path.join(ort_stage, name), tmp / name)
            except OSError as exc:
                print(
                    f"{PROG}: error: --ort-dir: could not write into {args.ort_dir!r}: {exc} (nothing else was "
                    "written)",
                    file=sys.stderr,
                )
                return cu.EXIT_USAGE
            moved += [os.path.join(args.ort_dir, n) for n in ort_names(args.out, args.quantize is not None)]
        written = sorted(
            (n for n in os.listdir(staging) if os.path.isfile(os.path.join(staging, n))),
            key=lambda n: n == os.path.basename(out),
        )  # the data file first
        # With a data file, the .onnx file finds it beside itself by name: a link at --out is then
        # replaced; without one, the model is written through it, as the API writes it.
        one_file = data_file_name(out) not in written
        cu.replace_synced(
            [
                (
                    os.path.join(staging, n),
                    through if one_file and n == os.path.basename(out) else os.path.join(os.path.dirname(out), n),
                )
                for n in written
            ]
        )
        if one_file:
            remove_stale_data(through)
        moved = [os.path.join(os.path.dirname(args.out), n) for n in sorted(written)] + moved
        print("wrote " + ", ".join(moved))
        _warn_stale_companions(args, written)
        return cu.EXIT_OK
    except OSError as exc:  # the disk filled up, the folder vanished: nothing was moved into place
        print(f"{PROG}: error: --out: could not write {args.out!r}: {exc}", file=sys.stderr)
        return cu.EXIT_USAGE
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _warn_stale_companions(args: argparse.Namespace, written: list[str]) -> None:
    """Name, on stderr, the files an earlier run may have derived from the same ``--out`` that
    this run did not write (``<out stem>.int8.onnx`` and its data file, and in ``--ort-dir`` the
    ``.ort`` file of the int8 model): if an earlier export wrote them, they no longer match.
    They are only named, never removed: the names are the ones people give their own files
    (``m.int8.onnx`` from onnxruntime's quantizer), and nothing in such a file shows who wrote
    it. (``<out>.data`` is different: the new ``--out`` owns that name, and an external-data
    reader of ``--out`` would pick a stale one up, so it is removed.)"""
    folder = os.path.dirname(os.path.abspath(args.out))
    int8 = int8_path(os.path.basename(args.out))
    stale = [os.path.join(folder, n) for n in (int8, data_file_name(int8)) if n not in written]
    if args.ort_dir is not None:
        done = set(ort_names(args.out, args.quantize is not None))
        stale += [os.path.join(args.ort_dir, n) for n in ort_names(args.out, True) if n not in done]
    for path in stale:
        if os.path.isfile(path):
            print(
                f"{PROG}: warning: {path} was not written by this run; if an earlier export of {args.out} "
                "wrote it, it no longer matches the new model: remove or replace it",
                file=sys.stderr,
            )


def _inputs(args: argparse.Namespace, config: dc.DamchaConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random feeds named as the model's inputs."""
    B, N, M = 2, 7, 5 if args.cross else 7
    inputs: dict[str, np.ndarray] = {"query": rng.normal(size=(B, N, config.query_dim))}
    if args.cross:
        E_kv, E_v = cast(int, config.context_dim), cast(int, config.value_input_dim)
        inputs["context"] = rng.normal(size=(B, M, E_kv))
        if E_v != E_kv:  # value tokens of their own size (the export's `value`)
            inputs["value"] = rng.normal(size=(B, M, E_v))
    if args.mask == "4d":
        inputs["mask"] = rng.random((B, 1, N, M)) < 0.8
    elif args.mask == "padding":
        inputs["mask"] = rng.random((B, M)) < 0.8
    return inputs


def _reference(
    args: argparse.Namespace, params: dict[str, np.ndarray], config: dc.DamchaConfig, inputs: dict[str, np.ndarray]
) -> Outputs:
    """The NumPy reference's outputs on ``inputs``, named as the model's."""
    mask = inputs.get("mask")
    if mask is not None and args.mask == "padding":  # (B, M): every head and query row of a batch sees the same keys
        mask = mask[:, None, None, :]
    result = dc.damcha_attention(
        params,
        config,
        inputs["query"],
        inputs.get("context"),
        value=inputs.get("value"),
        mask=mask,
        causal=args.causal,
        return_weights=args.return_weights,
    )
    if args.return_weights:
        return {"output": result[0], "weights": result[1]}
    return {"output": result}


def _errors(actual: Outputs, expected: Outputs, dtype: str) -> tuple[str, bool]:
    """``max |error| = ...`` of each output, and whether all are within ``ATOL[dtype]``."""
    atol, parts, good = ATOL[dtype], [], True
    for name, want in expected.items():
        err = float(np.max(np.abs(np.asarray(actual[name], np.float64) - want)))
        good &= bool(err <= atol * (1.0 + float(np.max(np.abs(want)))))  # NaN: not good
        parts.append(f"{err:.2e}" if name == "output" else f"{err:.2e} ({name})")
    return ", ".join(parts), good


def _check(path: str, args: argparse.Namespace, inputs: dict[str, np.ndarray], expected: Outputs) -> bool:
    """Run the staged model in onnxruntime and the reference evaluator against the NumPy reference."""
    B, N = inputs["query"].shape[:2]
    M = inputs["context"].shape[1] if args.cross else N
    how = f"decoded in chunks {DECODE_CHUNKS} " if args.kv_cache else ""
    ok = True
    for name, run in (("onnxruntime CPU", run_ort), ("onnx.reference", run_reference)):
        errors, good = _errors(_outputs(path, run, args, inputs), expected, args.dtype)
        ok &= good
        print(
            f"{name:<16} vs NumPy reference: max |error| = {errors} {how}on (B={B}, N={N}, M={M}) "
            f"-> {'ok' if good else 'MISMATCH'}"
        )
    return ok


def _outputs(model: str, run: Callable, args: argparse.Namespace, inputs: dict[str, np.ndarray]) -> Outputs:
    """The model's outputs on ``inputs`` (decoded step by step through the cache with --kv-cache)."""
    if args.kv_cache:
        return _decode(model, run, inputs, inputs["query"].shape[0], args.mask)
    return run(model, inputs, all_outputs=True)


def _quantize(
    staged: str,
    target: str,
    args: argparse.Namespace,
    params: dict[str, np.ndarray],
    config: dc.DamchaConfig,
    inputs: dict[str, np.ndarray],
    expected: Outputs,
) -> bool:
    """Write the int8 model of the staged float32 one to ``target`` and judge it against the
    reference (a decode step: decoded through its cache, as the float model is)."""
    # The library drops onnxruntime's "consider pre-processing" warning itself (_quantize.py).
    from ._quantize import quantize_int8, quantize_static_int8

    if args.quantize == "dynamic":
        quantize_int8(staged, target)
    else:  # calibrated on inputs drawn like the validation inputs, from another seed
        calibration = [_inputs(args, config, np.random.default_rng([args.seed, 1, i])) for i in range(4)]
        if args.kv_cache:
            # A decode step is calibrated on what it sees: each step's feeds (query chunk,
            # the float model's cache, mask) while the float model decodes the inputs.
            steps: list[dict[str, np.ndarray]] = []

            def recording(model: str, feeds: dict[str, np.ndarray], **kw: Any) -> dict[str, np.ndarray]:
                steps.append(dict(feeds))
                return run_ort(model, feeds, **kw)

            for feeds in calibration:
                _decode(staged, recording, feeds, feeds["query"].shape[0], args.mask)
            calibration = steps
        quantize_static_int8(staged, calibration, target)
    rel, max_abs = _int8_error(_outputs(target, run_ort, args, inputs)["output"], expected["output"])
    good = bool(rel <= INT8_RTOL)
    how = f" decoded in chunks {DECODE_CHUNKS}" if args.kv_cache else ""
    print(
        f"int8 ({args.quantize}) vs NumPy reference: relative RMS error = {rel:.2e}, max |error| = "
        f"{max_abs:.2e}{how} -> {'ok' if good else 'MISMATCH'} (allowed {INT8_RTOL})"
    )
    return good


def _int8_error(actual: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Relative RMS and max absolute error of an int8 model's output against the reference."""
    diff = np.asarray(actual, np.float64) - ref
    rms = float(np.sqrt(np.mean(ref**2))) or 1.0
    return float(np.sqrt(np.mean(diff**2))) / rms, float(np.max(np.abs(diff)))


def _ort(
    models: list[str], folder: str, args: argparse.Namespace, inputs: dict[str, np.ndarray], expected: Outputs
) -> bool:
    """Convert the staged models to ORT format in ``folder`` and run each ``.ort`` file (through its
    ``.onnx`` file's declarations) against the reference: the float model within the dtype's
    allowance, the int8 one within ``INT8_RTOL``."""
    from ._mobile import convert_to_ort

    try:
        result = convert_to_ort(models, folder)
    except dc.DamchaError as exc:  # onnxruntime's converter refused the model: not a usable ORT file
        print(f"ORT format: conversion failed: {' '.join(str(exc).split())} -> MISMATCH")
        return False
    # The config's header names the converted files: name them where they will be, not in the staging folder.
    header = result.config.read_text(encoding="utf-8")
    result.config.write_text(
        header.replace(str(Path(folder).resolve()), str(Path(args.ort_dir).resolve())), encoding="utf-8"
    )
    ok = True
    for source, (stem, ort_file) in zip(models, result.models.items()):
        run = functools.partial(run_ort, session=ort_session(str(ort_file)))
        actual = _outputs(source, run, args, inputs)
        if source == models[0]:
            errors, good = _errors(actual, expected, args.dtype)
            what = f"max |error| = {errors}"
        else:  # the int8 model: judged as the .onnx int8 model is
            rel = _int8_error(actual["output"], expected["output"])[0]
            good = bool(rel <= INT8_RTOL)  # NaN: not good
            what = f"relative RMS error = {rel:.2e} (allowed {INT8_RTOL})"
        ok &= good
        how = f" decoded in chunks {DECODE_CHUNKS}" if args.kv_cache else ""
        print(f"ORT format {stem}.ort vs NumPy reference: {what}{how} -> {'ok' if good else 'MISMATCH'}")
    return ok


def _decode(model: str, run: Callable, inputs: dict[str, np.ndarray], batch: int, mask: str) -> Outputs:
    """The layer's outputs on the whole sequence, fed step by step through its cache. Each step's
    ``weights`` (B, H, n, P + n) are the rows of the full (B, H, N, N) ones, whose later columns
    the causal rule leaves at 0."""
    cache, start = empty_kv_cache(model, batch), 0
    outs: dict[str, list[np.ndarray]] = {}
    total = inputs["query"].shape[1]
    for n in DECODE_CHUNKS:
        stop = start + n
        feeds = {"query": inputs["query"][:, start:stop], **cache}
        if mask == "4d":
            feeds["mask"] = inputs["mask"][:, :, start:stop, :stop]  # this step's rows, cached + new keys
        elif mask == "padding":
            feeds["mask"] = inputs["mask"][:, :stop]  # cached + new keys
        step = run(model, feeds, all_outputs=True)
        cache = {"past_key": step["present_key"], "past_value": step["present_value"]}
        outs.setdefault("output", []).append(step["output"])
        if "weights" in step:
            w = step["weights"]
            outs.setdefault("weights", []).append(np.pad(w, [(0, 0)] * 3 + [(0, total - w.shape[-1])]))
        start = stop
    return {name: np.concatenate(parts, axis=2 if name == "weights" else 1) for name, parts in outs.items()}


if __name__ == "__main__":
    sys.exit(main())
