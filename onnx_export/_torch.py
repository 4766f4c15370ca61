"""``torch.onnx.export`` (dynamo) of PyTorch models, validated like our own exports.

torch is imported only when ``export_torch`` is called.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import onnx

from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument

from ._graph import ATTENTION_OPSET
from ._io import check_path, save_model, validate_model
from ._options import check_opset

#: The oldest opset torch.onnx.export(dynamo=True) writes: its op library (torchlib) is
#: built at opset 18, and an older request came back as an opset-18 model, silently.
TORCH_MIN_OPSET = 18


def _default_opset(proto: onnx.ModelProto) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def export_torch(
    model: Any,
    args: Sequence[Any],
    path: str | os.PathLike | None = None,
    *,
    opset: int = ATTENTION_OPSET,
    dynamic: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_shapes: Any = None,
) -> onnx.ModelProto:
    """Export a ``torch.nn.Module`` (e.g. one containing ``damcha_torch.DamchaAttention``)
    with the dynamo exporter, then validate it like ``export`` does.

    Args:
        model: the module, put in eval mode by the caller.
        args: example positional inputs (tensors).
        path: where to save (checked first, written atomically); ``None`` only returns the model.
        opset: ONNX opset (>= 18, torch's oldest; default 23). A request that
            torch's version converter does not reach (it stops below the
            newest opset onnx knows) is refused, never exported at another opset.
        dynamic: dims 0 and 1 (batch and sequence) of every tensor input are
            dynamic (``torch.export.Dim.DYNAMIC``), so batch and lengths can
            change after export.
        input_names, output_names: graph input/output names.
        dynamic_shapes: ``torch.export``'s own spec (one entry per positional
            input), used instead of the default above, e.g. to make a mask's
            key-length dim dynamic: ``({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
            {0: Dim.DYNAMIC, 2: Dim.DYNAMIC, 3: Dim.DYNAMIC})``.

    Returns:
        The validated ``onnx.ModelProto``.
    """
    import torch  # lazy: the framework-free exporter never needs torch

    if not isinstance(model, torch.nn.Module):
        raise DamchaTypeError(invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    path = check_path(path)
    opset, _ = check_opset(opset)
    if opset < TORCH_MIN_OPSET:
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an int >= {TORCH_MIN_OPSET} for export_torch (torch.onnx.export's dynamo exporter writes opset "
                f"{TORCH_MIN_OPSET} at the oldest; damcha_onnx.export builds opsets from 17 without torch)",
                f"opset={opset}",
            )
        )
    args = tuple(args)
    if dynamic_shapes is not None:
        if not dynamic:
            raise DamchaValueError(
                invalid_argument(
                    "dynamic_shapes", "None unless dynamic=True", "dynamic=False and a dynamic_shapes spec"
                )
            )
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise DamchaValueError(
                invalid_argument(
                    "dynamic_shapes",
                    f"one entry per positional input ({len(args)})",
                    f"dynamic_shapes={describe(dynamic_shapes)}",
                )
            )
        dynamic_shapes = tuple(dynamic_shapes)
    elif dynamic:
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
    if program is None:  # torch.onnx.export returns None only when it writes to a file itself
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNXProgram")
    proto = program.model_proto
    written = _default_opset(proto)
    if written != opset:
        # torch's version converter leaves the model at opset 18 where it cannot
        # convert an op (the Attention op past opset 25 with torch 2.13): onnx.checker
        # then failed on that op, with a raw ValidationError.
        raise DamchaValueError(
            invalid_argument(
                "opset",
                f"an opset torch.onnx.export can convert this model to (torch {torch.__version__} wrote opset "
                f"{written} instead: its version converter stops at an op it cannot convert; torch 2.13 takes "
                "DamchaAttention's Attention op to opset 25 at most)",
                f"opset={opset}",
            )
        )
    _name_dynamic_dims(proto)
    validate_model(proto)
    if path is not None:
        save_model(proto, path)  # atomic: a failure keeps an earlier file at path
    return proto


#: torch.export's own symbols for dynamic dims (s77, s27): named after the input they size instead.
_TORCH_SYMBOL = re.compile(r"\bs\d+\b")


def _name_dynamic_dims(proto: onnx.ModelProto) -> None:
    """Rename torch.export's dynamic dims (``s77``) as the native exporter names
    them: dim 0 ``batch``, dim 1 ``<input>_len`` (``query_len``, ``context_len``),
    others ``<input>_dim<k>``; one symbol keeps one name everywhere (inputs,
    outputs, value_info, expressions such as ``s48*s83``), and a name already
    taken by another symbol gets the input's name appended."""
    inputs = [v for v in proto.graph.input if v.type.HasField("tensor_type")]
    used = {
        d.dim_param
        for v in inputs
        for d in v.type.tensor_type.shape.dim
        if d.dim_param and not _TORCH_SYMBOL.fullmatch(d.dim_param)
    }
    names: dict[str, str] = {}
    for value in inputs:
        for k, dim in enumerate(value.type.tensor_type.shape.dim):
            symbol = dim.dim_param
            if not _TORCH_SYMBOL.fullmatch(symbol) or symbol in names:
                continue
            base = "batch" if k == 0 else f"{value.name}_len" if k == 1 else f"{value.name}_dim{k}"
            name = base if base not in used else f"{base}_{value.name}"
            n = 2
            while name in used:
                name, n = f"{base}_{n}", n + 1
            names[symbol] = name
            used.add(name)
    if not names:
        return
    graph = proto.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = _TORCH_SYMBOL.sub(lambda m: names.get(m.group(), m.group()), dim.dim_param)


def encoder_from_torch(encoder: Any, *, causal: bool = False) -> tuple[dict[str, Any], Any]:
    """Stack parameters and ``EncoderConfig`` of a trained ``damcha_torch`` encoder.

    The encoder's own public ``to_canonical(causal=...)`` (damcha_core's stack
    format): any ``damcha_torch.build_encoder`` stack converts, pre- or
    post-norm layers (``norm_first``), ReLU or GELU (exact or tanh)
    feed-forward, with or without a final LayerNorm, as long as every layer
    has the same attention config, activation, norm placement and LayerNorm
    epsilon, and biases (otherwise a DamchaValueError saying what differs).
    ``share_metric`` is read from the encoder; a shared generator is stored
    once. Pass the result to ``export_encoder`` (or ``encoder_forward`` for the
    NumPy reference).

    Args:
        encoder: a ``damcha_torch.DamchaTransformerEncoder``.
        causal: whether the exported stack applies the causal rule.

    Returns:
        ``(params, config)`` with float64 NumPy arrays.
    """
    import damcha_torch as dt

    if not isinstance(encoder, dt.DamchaTransformerEncoder):
        raise DamchaTypeError(
            invalid_argument("encoder", "a damcha_torch.DamchaTransformerEncoder", f"encoder={describe(encoder)}")
        )
    return encoder.to_canonical(causal=causal)
