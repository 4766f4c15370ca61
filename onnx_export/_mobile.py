"""ORT format for mobile and minimal builds, with onnxruntime's own converter."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence

from damcha_core import DamchaTypeError, DamchaValueError, check_bool, describe, invalid_argument
from damcha_core._cliutil import writable_dir

from ._io import data_file_name
from ._runtime import as_model

PLATFORMS = (None, "arm", "amd64")


@dataclasses.dataclass(frozen=True)
class OrtConversion:
    """What ``convert_to_ort`` wrote.

    Attributes:
        models: ``{name: path of <name>.ort}``, one per input model.
        config: the reduced operator config (``required_operators[_and_types].config``)
            covering every converted model: the ``--include_ops_by_config`` file of
            an onnxruntime minimal build that runs exactly these models.
        operators: ``{(domain, opset): {op types}}`` read from ``config``.
    """

    models: dict[str, pathlib.Path]
    config: pathlib.Path
    operators: dict[tuple[str, int], frozenset[str]]


def _parse_config(path: pathlib.Path) -> dict[tuple[str, int], frozenset[str]]:
    # onnxruntime's own parser of the file its minimal build reads.
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    required, _ = parse_config(str(path))
    return {
        (domain, int(opset)): frozenset(ops) for domain, by_opset in required.items() for opset, ops in by_opset.items()
    }


def convert_to_ort(
    models: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    target_platform: str | None = None,
    type_reduction: bool = True,
) -> OrtConversion:
    """Convert exported ``.onnx`` files to ORT format (``.ort``) for onnxruntime
    Mobile and minimal builds, with ``onnxruntime.tools.convert_onnx_models_to_ort``.

    The models are optimised by onnxruntime ("Fixed" style: the graph
    optimisations are applied once, at conversion) and saved as flatbuffers;
    one reduced operator config lists the operators (and, with
    ``type_reduction``, the types) they use, for building onnxruntime with
    ``--minimal_build --include_ops_by_config <config>``.

    Args:
        models: one ``.onnx`` path or several (external data files beside them
            are read too); each converts to ``<output_dir>/<stem>.ort``.
        output_dir: where the ``.ort`` files and the config go (created if needed).
        target_platform: None, "arm" (phones: allows the int8 QDQ fusions
            that arm kernels take) or "amd64".
        type_reduction: list the types of each operator too
            (``required_operators_and_types.config``), for a smaller build.

    Returns:
        An ``OrtConversion`` (paths and the operator sets).

    Raises:
        DamchaValueError: a path that is not a readable ONNX model, two
            models with one file name, a conversion onnxruntime refuses.
    """
    with _root_handlers_kept():
        # Importing the tool calls logging.basicConfig (onnxruntime.tools.logger).
        from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    paths = [models] if isinstance(models, (str, os.PathLike)) else models
    if not isinstance(paths, Sequence) or not paths:
        raise DamchaTypeError(
            invalid_argument("models", "an .onnx path or a non-empty list of them", f"models={describe(models)}")
        )
    sources = []
    for i, item in enumerate(paths):
        if not isinstance(item, (str, os.PathLike)):
            # A ModelProto has no file name to name its .ort file after (os.fspath raised a raw TypeError).
            raise DamchaTypeError(
                invalid_argument(
                    f"models[{i}]",
                    "the path of a saved .onnx file (each becomes <output_dir>/<its stem>.ort; save an in-memory "
                    "model first, e.g. with damcha_onnx.export(..., path))",
                    f"models[{i}]={describe(item)}",
                )
            )
        as_model(item, f"models[{i}]", load_weights=False)  # a clear error for anything unreadable
        sources.append(pathlib.Path(os.fspath(item)).resolve())
    stems = [p.stem for p in sources]
    if len(set(stems)) != len(stems):
        raise DamchaValueError(
            invalid_argument(
                "models", "distinct file names (each becomes <name>.ort)", f"models with file names {stems}"
            )
        )
    if target_platform not in PLATFORMS:
        raise DamchaValueError(
            invalid_argument("target_platform", f"one of {PLATFORMS}", f"target_platform={target_platform!r}")
        )
    type_reduction = check_bool("type_reduction", type_reduction)
    out = _output_dir(output_dir)
    with tempfile.TemporaryDirectory(prefix="damcha-ort-") as tmp:
        # A folder of exactly these models (the tool converts every .onnx of a
        # folder, and writes one config for all of them).
        for src in sources:
            shutil.copy2(src, pathlib.Path(tmp) / src.name)
            data = src.parent / data_file_name(str(src))
            if data.exists():
                shutil.copy2(data, pathlib.Path(tmp) / data.name)
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), _quiet_tool_logs(), _root_handlers_kept():
                convert_onnx_models_to_ort(
                    pathlib.Path(tmp),
                    output_dir=out.resolve(),
                    optimization_styles=[OptimizationStyle.Fixed],
                    target_platform=target_platform,
                    enable_type_reduction=type_reduction,
                )
        except Exception as exc:
            raise DamchaValueError(
                f"onnxruntime could not convert `models` to ORT format: {type(exc).__name__}: {exc}"
            ) from exc
    converted = {stem: out / f"{stem}.ort" for stem in stems}
    missing = [str(p) for p in converted.values() if not p.is_file()]
    if missing:
        raise DamchaValueError(f"onnxruntime did not write {missing}; its log: {log.getvalue()[-500:]}")
    config = out / ("required_operators_and_types.config" if type_reduction else "required_operators.config")
    return OrtConversion(converted, config, _parse_config(config))


#: What ``convert_to_ort``'s ``output_dir`` must be.
OUTPUT_DIR_RULE = "the path of a writable directory, existing or one that can be created (str or os.PathLike)"


def _output_dir(output_dir: object) -> pathlib.Path:
    """``output_dir`` as an existing directory a file can be created in (made
    with its parents when missing): checked before onnxruntime's converter
    runs, which otherwise failed after its work with a raw OSError or TypeError."""
    if not isinstance(output_dir, (str, os.PathLike)):
        raise DamchaTypeError(invalid_argument("output_dir", OUTPUT_DIR_RULE, f"output_dir={describe(output_dir)}"))
    path = os.fspath(output_dir)
    if not isinstance(path, str):  # a PathLike of bytes: the .ort names are str
        raise DamchaTypeError(invalid_argument("output_dir", OUTPUT_DIR_RULE, f"output_dir={describe(path)}"))
    if not path:
        raise DamchaValueError(invalid_argument("output_dir", OUTPUT_DIR_RULE, "output_dir=''"))
    out = pathlib.Path(path)
    if out.exists() and not out.is_dir():
        raise DamchaValueError(invalid_argument("output_dir", OUTPUT_DIR_RULE, f"output_dir={path!r} (a file)"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:  # a file on the way, /proc, no permission, a NUL byte, a name too long
        reason = getattr(exc, "strerror", None) or str(exc)
        raise DamchaValueError(
            invalid_argument("output_dir", OUTPUT_DIR_RULE, f"output_dir={path!r} (it cannot be created: {reason})")
        ) from exc
    # Probed by creating a file, as the export paths are: permission bits say yes to root also in /proc.
    if not writable_dir(out):
        raise DamchaValueError(
            invalid_argument("output_dir", OUTPUT_DIR_RULE, f"output_dir={path!r} (no file can be created in it)")
        )
    return out


@contextlib.contextmanager
def _quiet_tool_logs():
    logger = logging.getLogger("ort_format_model.utils")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _root_handlers_kept():
    """Remove the handlers onnxruntime's tools add to the root logger.

    ``onnxruntime.tools.logger.get_logger`` calls ``logging.basicConfig``, which
    installs a stderr handler on the root logger when it has none: every later
    log record of the application would then print to stderr in onnxruntime's
    format. Whatever the block adds to the root logger is taken off again.
    """
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
            handler.close()  # a StreamHandler leaves its stream (stderr) open
