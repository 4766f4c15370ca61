"""damcha_onnx: DAMCHA layers, encoder stacks and small models as ONNX graphs.

The exporter builds graphs from canonical parameters with ``onnx.helper``
alone (no deep-learning framework): opset >= 23 uses the standard
``Attention`` op, opsets 17-22 a decomposed MatMul/Softmax graph with the same
semantics. ``export_torch`` wraps ``torch.onnx.export`` for PyTorch models;
``encoder_from_torch``/``encoder_from_keras``/``encoder_from_jax`` turn trained
stacks of each port into the stack format (``damcha_core``'s, whose names
are re-exported here). Frameworks are imported only when those are called.
"""

from __future__ import annotations

from damcha_core._deprecation import moved_names as _moved_names
from damcha_core._imports import require as _require

_require("onnx", "onnx", "damcha_onnx")  # one-line ImportError naming the extra

from ._export import build_model, export
from ._frameworks import encoder_from_jax, encoder_from_keras
from ._graph import ATTENTION_OPSET, MIN_OPSET, fold_params
from ._io import validate_model
from ._mobile import OrtConversion, convert_to_ort
from ._options import ExportOptions, check_opset
from ._quantize import quantization_error, quantize_int8, quantize_static_int8
from ._runtime import empty_kv_cache, ort_session, run_ort, run_reference
from ._stack import (
    EncoderConfig,
    TokenModelConfig,
    encoder_forward,
    export_encoder,
    export_token_model,
    init_encoder_params,
    init_token_model_params,
    token_model_forward,
    validate_stack_params,
)
from ._torch import encoder_from_torch, export_torch

__all__ = [
    "ATTENTION_OPSET",
    "EncoderConfig",
    "ExportOptions",
    "MIN_OPSET",
    "OrtConversion",
    "TokenModelConfig",
    "build_model",
    "check_opset",
    "convert_to_ort",
    "empty_kv_cache",
    "encoder_forward",
    "encoder_from_jax",
    "encoder_from_keras",
    "encoder_from_torch",
    "export",
    "export_encoder",
    "export_token_model",
    "export_torch",
    "fold_params",
    "init_encoder_params",
    "init_token_model_params",
    "ort_session",
    "quantization_error",
    "quantize_int8",
    "quantize_static_int8",
    "run_ort",
    "run_reference",
    "token_model_forward",
    "validate_model",
    "validate_stack_params",
]


# Deprecated for one release: the adapter moved to the conformance suite.
__getattr__ = _moved_names(__name__, {"ConformanceAdapter": "damcha_conformance.adapters.OnnxAdapter"})
