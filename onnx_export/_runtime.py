"""Running exported models: onnxruntime (CPU) and ``onnx.reference``."""

from __future__ import annotations

import numbers
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


def _first_or_all(model: onnx.ModelProto, outputs: list, all_outputs: bool) -> np.ndarray | dict[str, np.ndarray]:
    if not all_outputs:
        return outputs[0]
    return {o.name: value for o, value in zip(model.graph.output, outputs)}


def run_ort(
    model: onnx.ModelProto, inputs: Mapping[str, Any], *, session=None, all_outputs: bool = False
) -> np.ndarray | dict[str, np.ndarray]:
    """First output of ``model`` in onnxruntime's CPU provider.

    ``all_outputs=True`` returns every output by name instead (a decode step's
    ``present_key``/``present_value`` next to ``output``).
    """
    session = session or ort_session(model)
    return _first_or_all(model, session.run(None, feeds_for(model, inputs)), all_outputs)


def run_reference(
    model: onnx.ModelProto, inputs: Mapping[str, Any], *, evaluator=None, all_outputs: bool = False
) -> np.ndarray | dict[str, np.ndarray]:
    """First output of ``model`` in ``onnx.reference.ReferenceEvaluator`` (pure Python).

    ``evaluator`` reuses a ``ReferenceEvaluator(model)`` across calls;
    ``all_outputs`` as for ``run_ort``.
    """
    if evaluator is None:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
    return _first_or_all(model, evaluator.run(None, feeds_for(model, inputs)), all_outputs)


def empty_kv_cache(model: onnx.ModelProto, batch_size: int) -> dict[str, np.ndarray]:
    """Zero-length ``past_*`` inputs (P = 0) of a ``kv_cache=True`` export: the first decode step's cache.

    Args:
        model: a layer, encoder or token model exported with ``kv_cache=True``.
        batch_size: B.

    Returns:
        ``{"past_key[.i]": (B, G, 0, d), "past_value[.i]": (B, G, 0, d_v)}`` in the model's dtype.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise DamchaValueError(f"`batch_size` must be an int >= 1. Received: batch_size={describe(batch_size)}")
    cache = {}
    for value in model.graph.input:
        if value.name.startswith(("past_key", "past_value")):
            t = value.type.tensor_type
            dims = [d.dim_value for d in t.shape.dim]
            cache[value.name] = np.zeros((int(batch_size), dims[1], 0, dims[3]), onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    if not cache:
        raise DamchaValueError(
            "`model` has no past_key/past_value inputs; export it with kv_cache=True. "
            f"Received: inputs={[v.name for v in model.graph.input]}"
        )
    return cache
