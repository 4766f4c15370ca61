"""damcha_onnx: DAMCHA layers, encoder stacks and small models as ONNX graphs.

The exporter builds graphs from canonical parameters with ``onnx.helper``
alone (no deep-learning framework): opset >= 23 uses the standard
``Attention`` op, opsets 17-22 a decomposed MatMul/Softmax graph with the same
semantics. ``export_torch`` wraps ``torch.onnx.export`` for PyTorch models and
imports torch only when called.
"""

from __future__ import annotations

from ._adapter import ConformanceAdapter
from ._export import build_model, check_opset, export, validate_model
from ._graph import ATTENTION_OPSET, MIN_OPSET, fold_params
from ._runtime import ort_session, run_ort, run_reference

__all__ = [
    "ATTENTION_OPSET",
    "MIN_OPSET",
    "ConformanceAdapter",
    "build_model",
    "check_opset",
    "export",
    "fold_params",
    "ort_session",
    "run_ort",
    "run_reference",
    "validate_model",
]
