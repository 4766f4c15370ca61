"""int8 dynamic quantisation through ``onnxruntime.quantization``."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Mapping

import numpy as np
import onnx

from damcha_core import DamchaValueError

from ._runtime import as_model, run_ort


def quantize_int8(model: onnx.ModelProto | str | os.PathLike, path: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Dynamic int8 quantisation (int8 weights, activations quantised per batch
    at run time) of the MatMul weights; returns the quantised model.

    Only float32 models: onnxruntime quantises float32 weights. The cross-head
    maps multiply activations by activations, so they stay float32; only
    weight MatMuls (projections, generator, FFN, head) become int8.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    m = as_model(model)
    doubles = [i.name for i in m.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE]
    if doubles:
        raise DamchaValueError(f"`model` must be a float32 export to quantise. Received: a float64 model (inputs {doubles})")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "model.onnx")
        dst = os.fspath(path) if path is not None else os.path.join(tmp, "model.int8.onnx")
        onnx.save_model(m, src)
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        return onnx.load(dst)


def quantization_error(
    float_model: onnx.ModelProto, int8_model: onnx.ModelProto, inputs: Mapping[str, Any], reference: np.ndarray | None = None
) -> dict[str, float]:
    """Accuracy loss of the int8 model: max and relative RMS error against the
    float32 model's output (and against ``reference`` when given)."""
    y32 = np.asarray(run_ort(as_model(float_model, "float_model"), inputs), dtype=np.float64)
    y8 = np.asarray(run_ort(as_model(int8_model, "int8_model"), inputs), dtype=np.float64)
    if reference is not None and np.shape(reference) != y32.shape:
        raise DamchaValueError(
            f"`reference` must have the model's output shape {y32.shape}. Received: reference.shape={np.shape(reference)}"
        )
    scale = float(np.sqrt(np.mean(y32 ** 2))) or 1.0
    out = {
        "max_abs_vs_float32": float(np.max(np.abs(y8 - y32))),
        "rel_rms_vs_float32": float(np.sqrt(np.mean((y8 - y32) ** 2)) / scale),
    }
    if reference is not None:
        ref = np.asarray(reference, dtype=np.float64)
        out["max_abs_float32_vs_reference"] = float(np.max(np.abs(y32 - ref)))
        out["max_abs_int8_vs_reference"] = float(np.max(np.abs(y8 - ref)))
    return out
