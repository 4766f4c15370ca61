"""``torch.onnx.export`` (dynamo) of PyTorch models, validated like our own exports.

torch is imported only when ``export_torch`` is called.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import onnx

from damcha_core import DamchaTypeError
from damcha_core import describe

from ._export import check_opset, validate_model
from ._graph import ATTENTION_OPSET


def export_torch(
    model: Any,
    args: Sequence[Any],
    path: str | os.PathLike | None = None,
    *,
    opset: int = ATTENTION_OPSET,
    dynamic: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """Export a ``torch.nn.Module`` (e.g. one containing ``damcha_torch.DamchaAttention``)
    with the dynamo exporter, then validate it like ``export`` does.

    Args:
        model: the module, put in eval mode by the caller.
        args: example positional inputs (tensors).
        path: where to save; ``None`` only returns the model.
        opset: ONNX opset (>= 17; default 23).
        dynamic: dims 0 and 1 (batch and sequence) of every tensor input are
            dynamic (``torch.export.Dim.DYNAMIC``), so batch and lengths can
            change after export.
        input_names, output_names: graph input/output names.

    Returns:
        The validated ``onnx.ModelProto``.
    """
    import torch  # lazy: the framework-free exporter never needs torch

    if not isinstance(model, torch.nn.Module):
        raise DamchaTypeError(f"`model` must be a torch.nn.Module. Received: model={describe(model)}")
    opset, _ = check_opset(opset)
    args = tuple(args)
    dynamic_shapes = None
    if dynamic:
        Dim = torch.export.Dim
        dynamic_shapes = tuple(
            {0: Dim.DYNAMIC, 1: Dim.DYNAMIC} if isinstance(a, torch.Tensor) and a.ndim >= 2 else None for a in args
        )
    program = torch.onnx.export(
        model,
        args,
        dynamo=True,
        opset_version=opset,
        dynamic_shapes=dynamic_shapes,
        input_names=list(input_names) if input_names else None,
        output_names=list(output_names) if output_names else None,
        verbose=False,
    )
    proto = program.model_proto
    validate_model(proto)
    if path is not None:
        onnx.save_model(proto, os.fspath(path))
    return proto
