"""int8 quantisation through ``onnxruntime.quantization``: dynamic, and static QDQ
calibrated on data the caller passes."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx

from damcha_core import DamchaTypeError, DamchaValueError, check_bool, invalid_argument

from ._export import ir_version_for
from ._io import (
    DIGEST_KEY,
    check_path,
    content_digest,
    derived_digest,
    is_large,
    save_model,
    set_metadata,
    write_staged,
)
from ._runtime import as_model, check_weights_inline, describe_value, external_data_files, feeds_for, run_ort

#: Activation/weight integer types of ``quantize_static``.
QUANT_TYPES = ("int8", "uint8")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")


def _check_float32(m: onnx.ModelProto) -> None:
    others = [
        i.name
        for i in m.graph.input
        if i.type.tensor_type.elem_type in (onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    ]
    if others:
        raise DamchaValueError(
            invalid_argument(
                "model",
                "a float32 export to quantise (onnxruntime quantises float32 weights)",
                f"a float64/float16 model (inputs {others})",
            )
        )


@functools.cache
def static_opset_runs(opset: int) -> bool:
    """Whether this onnxruntime's CPU provider runs QuantizeLinear and
    DequantizeLinear at ``opset``, the ops a static (QDQ) model holds at its
    export's opset: onnxruntime 1.32 has none at 28, so a QDQ model of an
    opset-28 export could be written but never loaded. Asked of onnxruntime
    itself (a two-node model, about a millisecond), so a release that adds
    them is taken as it comes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
    ]
    constants = [
        numpy_helper.from_array(np.array(1.0, np.float32), "scale"),
        numpy_helper.from_array(np.array(0, np.int8), "zero"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        constants,
    )
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    probe.ir_version = ir_version_for(opset)  # as the exports declare it
    try:
        ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - NOT_IMPLEMENTED (or an opset it does not know): it cannot run them
        return False
    return True


def static_opset_rule(opset: int, dynamic: str = "quantize_int8") -> str | None:
    """Why a static (QDQ) quantisation of an export at ``opset`` would not
    run here, or None when it would; ``dynamic`` names the dynamic quantiser
    as the caller knows it (the CLI's ``--quantize dynamic``)."""
    if static_opset_runs(opset):
        return None
    import onnxruntime as ort

    runs = [o for o in range(opset - 1, 16, -1) if static_opset_runs(o)]
    fallback = f"; opset {runs[0]} and below run" if runs else ""
    return (
        f"an export at an opset whose QuantizeLinear/DequantizeLinear onnxruntime {ort.__version__} runs on CPU "
        f"(the static model holds them at its export's opset{fallback}); export at a lower opset, or quantise "
        f"dynamically ({dynamic})"
    )


def _default_opset(m: onnx.ModelProto) -> int:
    return next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)


def _quantizer_input(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """The float32 model to quantise, checked: a ModelProto as given (weights
    in memory), or a path's graph and declarations only (its weights stay in
    the file, which onnxruntime's quantiser reads itself)."""
    m = as_model(model, load_weights=False)
    if isinstance(model, onnx.ModelProto):
        check_weights_inline(m)
    _check_float32(m)
    return m


def _stage(model: onnx.ModelProto | str | os.PathLike, m: onnx.ModelProto, directory: str) -> tuple[str, bool]:
    """The float32 model as a file for onnxruntime's quantiser: (its path,
    whether it uses external data). A path is read by the quantiser through
    symbolic links in ``directory`` (loading it here would hold its weights
    beside the quantiser's own copies; see ``_linked_into``). An in-memory
    model is written to ``directory``; one over protobuf's 2 GiB limit, which
    cannot be written as one file (``onnx.save_model`` raises a raw
    ``EncodeError``), with its weights beside it, and the quantiser is told to
    do the same."""
    if not isinstance(model, onnx.ModelProto):
        external = _linked_into(os.fspath(model), m, directory)
        if external is not None:
            return os.path.join(directory, "linked", "model.onnx"), external
        m = as_model(model)  # no symbolic links here: the weights are staged as for an in-memory model
    if is_large(m):
        return write_staged(m, directory, "model.onnx"), True
    src = os.path.join(directory, "model.onnx")
    onnx.save_model(m, src)
    return src, False


def _linked_into(path: str, m: onnx.ModelProto, directory: str) -> bool | None:
    """A symbolic link in ``directory`` to the model file ``path`` (as
    ``model.onnx``) and a copy of each external data file it names, in a
    subfolder of ``directory`` that is removed whole if any fails (onnx
    refuses a data file that is a symbolic or hard link; the copy is made by
    the OS, file to file, not through memory); returns whether it has any, or
    ``None`` where the link cannot be made (an OS without symbolic links).
    The quantiser reads the model there and writes its scratch copy
    (``<stem>-inferred.onnx``) beside the link, not into the user's folder,
    which may be read-only or hold a file of that name."""
    source = os.path.dirname(os.path.abspath(path))
    locations = external_data_files(m)
    linked = os.path.join(directory, "linked")
    try:
        os.mkdir(linked)
        os.symlink(os.path.abspath(path), os.path.join(linked, "model.onnx"))
        for location in locations:  # relative to the model's folder (checked by onnx.checker when it was read)
            copy = os.path.join(linked, location)
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            shutil.copyfile(os.path.join(source, location), copy)
    except (OSError, NotImplementedError):  # a file system or OS without symbolic links
        shutil.rmtree(linked, ignore_errors=True)
        return None
    return bool(locations)


def quantize_int8(model: onnx.ModelProto | str | os.PathLike, path: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Dynamic int8 quantisation (int8 weights of 7 bits, activations quantised
    per batch at run time) of the MatMul weights; returns the quantised model.

    Only float32 models: onnxruntime quantises float32 weights. The cross-head
    maps multiply activations by activations, so they stay float32; only
    weight MatMuls (projections, generator, FFN, head) become int8.

    onnxruntime's "consider pre-processing" warning, which it logs on the root
    logger for every model, is dropped while it runs (nothing else is): on
    these exports, which are already shape-inferred, the pre-processing it
    recommends changes nothing (see ``_quiet_pre_processing_hint``).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = check_path(path)
    m = _quantizer_input(model)
    with tempfile.TemporaryDirectory() as tmp:
        src, large = _stage(model, m, tmp)
        dst = os.path.join(tmp, "model.int8.onnx")
        with _quiet_pre_processing_hint():
            quantize_dynamic(
                src,
                dst,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                use_external_data_format=large,
                # 7-bit weights: no saturation of VPMADDUBSW on AVX2-only CPUs (docs/onnx.md).
                reduce_range=True,
            )
        out = onnx.load(dst)  # weights read into memory (from beside dst with external data)
    # The quantiser copies the float model's metadata, its identity too: the int8
    # model gets its own, so neither model's session passes for the other's (run_ort).
    set_metadata(out, DIGEST_KEY, derived_digest(m, "quantize_int8 reduce_range=True"))
    if path is not None:
        save_model(out, path)
    return out


#: What onnxruntime's quantisers log on the root logger for every model that did not go through
#: ``onnxruntime.quantization.quant_pre_process`` ("Please consider to run pre-processing before quantization").
PRE_PROCESSING_HINT = "pre-processing before quantization"


class _DropPreProcessingHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return PRE_PROCESSING_HINT not in record.getMessage()


@contextlib.contextmanager
def _quiet_pre_processing_hint():
    """Drop onnxruntime's pre-processing hint for the duration of a quantisation, and nothing else.

    Why it is harmless: ``quant_pre_process`` runs symbolic shape inference and
    onnxruntime's graph optimisations before quantising. These exports are
    already fully shape-inferred (strict shape inference at export) and their
    weight MatMuls read initialisers directly: on a layer export the int8
    error is the same with and without it (1.3% relative RMS at opsets 17 and
    23, checked with onnxruntime 1.32), and its symbolic shape inference even
    fails on these graphs (an assertion in its ``Reshape`` rule) unless skipped.

    How: onnxruntime logs it with ``logging.warning``, on the root logger,
    which also installs a stderr handler (``logging.basicConfig``) on a root
    logger that has none. A filter on the root logger drops that one message
    (records of named loggers and every other warning still reach the user's
    handlers), and the root logger's filters and handlers are restored
    afterwards. Not ``logging.disable``: it is process-wide and would hide
    every logger's warnings, from every thread, while the quantiser runs.
    """
    root = logging.getLogger()
    handlers = list(root.handlers)
    hint = _DropPreProcessingHint()
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)
        for handler in [h for h in root.handlers if h not in handlers]:  # basicConfig's, from logging.warning
            root.removeHandler(handler)


def weight_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMul nodes whose second input is an initialiser (a weight)."""
    weights = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


class _Calibration:
    """``onnxruntime.quantization.CalibrationDataReader`` over checked feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def quantize_static_int8(
    model: onnx.ModelProto | str | os.PathLike,
    calibration: Iterable[Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    per_channel: bool = True,
    activation_type: str = "int8",
    method: str = "minmax",
) -> onnx.ModelProto:
    """Static int8 quantisation in QDQ form (QuantizeLinear/DequantizeLinear
    pairs), calibrated on ``calibration``; returns the quantised model.

    What becomes int8: the weight MatMuls (projections, metric generator,
    FFN, head), weights symmetric and per output channel, activations entering
    them calibrated on the data given. What stays float32: the attention
    itself (the ``Attention`` op or the decomposed logits/softmax/value
    products), the per-token cross-head maps (activation-by-activation
    products), the RMS normalisation, LayerNorms and residual adds, where an
    8-bit grid would cost the accuracy the metric exists for.

    Args:
        model: a float32 export (ModelProto or ``.onnx`` path).
        calibration: feed dicts (input name -> array) as for ``run_ort``,
            representative of the data the model will see (a few batches).
        path: where to save the quantised model (checked first, atomic);
            ``None`` only returns it.
        per_channel: per-output-channel weight scales (default) or one per tensor.
        activation_type: "int8" (default, symmetric-capable S8S8 as most NPUs
            take) or "uint8" (U8S8, faster on x86 without VNNI-int8).
        method: calibration: "minmax" (default), "entropy" or "percentile".

    The calibrator's progress prints are swallowed and onnxruntime's
    "consider pre-processing" warning on the root logger is dropped while it
    runs (nothing else is): on these exports, which are already
    shape-inferred, the pre-processing it recommends changes nothing (see
    ``_quiet_pre_processing_hint``).

    Raises:
        DamchaValueError / DamchaTypeError: a non-float32 model, an empty or
            malformed calibration set, an unknown option.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    path = check_path(path)
    m = _quantizer_input(model)
    opset = _default_opset(m)
    rule = static_opset_rule(opset)
    if rule is not None:
        raise DamchaValueError(invalid_argument("model", rule, f"a model at opset {opset}"))
    per_channel = check_bool("per_channel", per_channel)
    if activation_type not in QUANT_TYPES:
        raise DamchaValueError(
            invalid_argument("activation_type", f"one of {QUANT_TYPES}", f"activation_type={activation_type!r}")
        )
    if method not in CALIBRATION_METHODS:
        raise DamchaValueError(invalid_argument("method", f"one of {CALIBRATION_METHODS}", f"method={method!r}"))
    if isinstance(calibration, Mapping) or not isinstance(calibration, Iterable):
        raise DamchaTypeError(
            invalid_argument(
                "calibration",
                "an iterable of feed dicts (input name -> array), e.g. a list of batches",
                f"calibration={describe_value(calibration)}",
            )
        )
    feeds = []
    for i, item in enumerate(calibration):
        try:
            feed = feeds_for(m, item)
        except (DamchaValueError, DamchaTypeError) as exc:
            raise type(exc)(f"`calibration[{i}]`: {exc}") from exc
        _check_calibration_batch(i, feed)
        feeds.append(feed)
    if not feeds:
        raise DamchaValueError(invalid_argument("calibration", "at least one feed dict", "an empty iterable"))
    quant = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    weighted = weight_matmuls(m)
    with tempfile.TemporaryDirectory() as tmp:
        src, large = _stage(model, m, tmp)
        dst = os.path.join(tmp, "model.qdq.onnx")
        # The calibrator prints progress on stdout; the pre-processing hint is dropped (see below).
        with contextlib.redirect_stdout(io.StringIO()), _quiet_pre_processing_hint():
            quantize_static(
                src,
                dst,
                _Calibration(feeds),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=["MatMul"],
                nodes_to_quantize=weighted,
                per_channel=per_channel,
                activation_type=quant[activation_type],
                weight_type=QuantType.QInt8,
                reduce_range=True,  # as quantize_int8's
                calibrate_method=methods[method],
                use_external_data_format=large,
                # DedicatedQDQPair: a token tensor read by a quantised MatMul and by
                # a float node (the RMS normalisation, a residual add) gets its own
                # Q/DQ pair per consumer, so the float nodes read it unrounded.
                # OpTypesToExcludeOutputQuantization: a MatMul's output (q, k, v,
                # the generator's) stays float; the quantiser would otherwise
                # round it to int8 where no bias Add follows, and the attention
                # and cross-head maps would read the rounded tensor.
                extra_options={
                    "WeightSymmetric": True,
                    "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
                    "DedicatedQDQPair": True,
                    "OpTypesToExcludeOutputQuantization": ["MatMul"],
                },
            )
        out = onnx.load(dst)
    how = f"quantize_static_int8 {per_channel=} {activation_type=} {method=} calibration={_feeds_digest(feeds)}"
    set_metadata(out, DIGEST_KEY, derived_digest(m, how))
    if path is not None:
        save_model(out, path)
    return out


def _feeds_digest(feeds: list[dict[str, np.ndarray]]) -> str:
    """SHA-256 of the calibration data (names, dtypes, shapes, values): another
    calibration gives another static model, so another identity."""
    return content_digest(b"", ((f"{i}.{name}", feed[name]) for i, feed in enumerate(feeds) for name in sorted(feed)))


def _check_calibration_batch(i: int, feed: Mapping[str, np.ndarray]) -> None:
    """A calibration batch must hold tokens (onnxruntime refuses an empty batch
    inside the calibrator) and finite values (a NaN makes every range NaN: the
    quantiser fails on an assertion)."""
    for name, array in feed.items():
        if array.size == 0 and not name.startswith("past_"):  # an empty cache is a decode step's first state
            raise DamchaValueError(
                invalid_argument(
                    f"calibration[{i}]", "batches with at least one token", f"{name}.shape={tuple(array.shape)}"
                )
            )
        bad = int(np.size(array) - np.isfinite(array).sum()) if np.issubdtype(array.dtype, np.floating) else 0
        if bad:
            raise DamchaValueError(
                invalid_argument(
                    f"calibration[{i}]",
                    "finite values (a NaN or inf sets no range)",
                    f"{name} with {bad} non-finite values",
                )
            )


def quantization_error(
    float_model: onnx.ModelProto | str,
    int8_model: onnx.ModelProto | str,
    inputs: Mapping[str, Any],
    reference: np.ndarray | None = None,
) -> dict[str, float]:
    """Accuracy loss of the int8 model: max and relative RMS error against the
    float32 model's output (and against ``reference`` when given)."""
    y32 = np.asarray(run_ort(as_model(float_model, "float_model"), inputs), dtype=np.float64)
    if y32.size == 0:
        # Maxima and means of nothing: no error to measure.
        raise DamchaValueError(
            invalid_argument("inputs", "a batch with at least one token", f"an empty output of shape {y32.shape}")
        )
    y8 = np.asarray(run_ort(as_model(int8_model, "int8_model"), inputs), dtype=np.float64)
    ref = None if reference is None else np.asarray(reference)
    if ref is not None:
        if not (np.issubdtype(ref.dtype, np.floating) or np.issubdtype(ref.dtype, np.integer)):
            raise DamchaTypeError(
                invalid_argument("reference", "a real numeric array", f"reference={describe_value(reference)}")
            )
        if ref.shape != y32.shape:
            raise DamchaValueError(
                invalid_argument("reference", f"the model's output shape {y32.shape}", f"reference.shape={ref.shape}")
            )
        bad = int(ref.size - np.isfinite(ref).sum())
        if bad:
            raise DamchaValueError(
                invalid_argument(
                    "reference",
                    "finite values (a NaN would make every error against it NaN)",
                    f"reference with {bad} non-finite values",
                )
            )
        ref = ref.astype(np.float64)
    scale = float(np.sqrt(np.mean(y32**2))) or 1.0
    out = {
        "max_abs_vs_float32": float(np.max(np.abs(y8 - y32))),
        "rel_rms_vs_float32": float(np.sqrt(np.mean((y8 - y32) ** 2)) / scale),
    }
    if ref is not None:
        out["max_abs_float32_vs_reference"] = float(np.max(np.abs(y32 - ref)))
        out["max_abs_int8_vs_reference"] = float(np.max(np.abs(y8 - ref)))
        out["rel_rms_int8_vs_reference"] = float(
            np.sqrt(np.mean((y8 - ref) ** 2)) / (float(np.sqrt(np.mean(ref**2))) or 1.0)
        )
    return out
