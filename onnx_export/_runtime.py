"""Running exported models: onnxruntime (CPU) and ``onnx.reference``."""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import onnx

from damcha_core import DamchaTypeError, DamchaValueError, float_dtype_error, mask_dtype_error
from damcha_core import describe


def _model_bytes(model: onnx.ModelProto | str | os.PathLike) -> bytes | str:
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    return os.fspath(model)


def ort_session(
    model: onnx.ModelProto | str | os.PathLike, *, threads: int | None = None, optimize: bool = True, spinning: bool = True
):
    """An ``onnxruntime.InferenceSession`` on the CPU provider.

    ``threads`` sets intra-op threads (``None``: onnxruntime's default);
    ``spinning=False`` stops idle worker threads from busy-waiting, which
    matters when other work (another framework, a benchmark) shares the CPUs.
    """
    import onnxruntime as ort  # lazy: building a graph needs no runtime

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors surface as exceptions; no stderr noise
    if threads is not None:
        options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(_model_bytes(model), options, providers=["CPUExecutionProvider"])


def feeds_for(model: onnx.ModelProto, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Cast ``inputs`` to the model's declared input dtypes; names must match exactly."""
    declared = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    unknown = sorted(set(inputs) - set(declared))
    missing = sorted(set(declared) - set(inputs))
    if unknown or missing:
        raise DamchaValueError(
            f"`inputs` must have exactly the model's inputs {sorted(declared)}. "
            f"Received: missing={missing}, unexpected={unknown}"
        )
    out = {}
    for name, value in inputs.items():
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(declared[name])
        array = np.asarray(value)
        if np_dtype == np.bool_ and array.dtype != np.bool_:
            raise mask_dtype_error(value, name)
        if np.issubdtype(np_dtype, np.floating) and not np.issubdtype(array.dtype, np.floating):
            raise float_dtype_error(name, value)
        if np.issubdtype(np_dtype, np.integer) and not np.issubdtype(array.dtype, np.integer):
            raise DamchaTypeError(f"`{name}` must be an integer array. Received: {name}={describe(value)}")
        # Float inputs are cast to the graph's dtype (e.g. float64 data into a float32 export).
        out[name] = array.astype(np_dtype, copy=False)
    return out


def run_ort(model: onnx.ModelProto, inputs: Mapping[str, Any], *, session=None) -> np.ndarray:
    """First output of ``model`` in onnxruntime's CPU provider."""
    session = session or ort_session(model)
    return session.run(None, feeds_for(model, inputs))[0]


def run_reference(model: onnx.ModelProto, inputs: Mapping[str, Any]) -> np.ndarray:
    """First output of ``model`` in ``onnx.reference.ReferenceEvaluator`` (pure Python)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds_for(model, inputs))[0]
