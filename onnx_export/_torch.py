"""``torch.onnx.export`` (dynamo) of PyTorch models, validated like our own exports.

torch is imported only when ``export_torch`` is called.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import onnx

from damcha_core import DamchaTypeError, DamchaValueError
from damcha_core import describe

from ._graph import ATTENTION_OPSET
from ._io import check_path, save_model, validate_model
from ._options import check_opset


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
        opset: ONNX opset (>= 17; default 23).
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
        raise DamchaTypeError(f"`model` must be a torch.nn.Module. Received: model={describe(model)}")
    path = check_path(path)
    opset, _ = check_opset(opset)
    args = tuple(args)
    if dynamic_shapes is not None:
        if not dynamic:
            raise DamchaValueError("`dynamic_shapes` needs dynamic=True. Received: dynamic=False and a dynamic_shapes spec")
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise DamchaValueError(
                f"`dynamic_shapes` must have one entry per positional input ({len(args)}). "
                f"Received: dynamic_shapes={describe(dynamic_shapes)}"
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
    proto = program.model_proto
    validate_model(proto)
    if path is not None:
        save_model(proto, path)  # atomic: a failure keeps an earlier file at path
    return proto


def encoder_from_torch(encoder: Any, *, causal: bool = False) -> tuple[dict[str, Any], Any]:
    """Stack parameters and ``EncoderConfig`` of a trained ``damcha_torch`` encoder.

    Any ``damcha_torch.build_encoder`` stack converts: pre- or post-norm
    layers (``norm_first``), ReLU or GELU (exact or tanh) feed-forward, with or
    without a final LayerNorm, as long as every layer has the same attention
    config, activation, norm placement and LayerNorm epsilon, and biases.
    ``share_metric`` is read from the encoder; a shared generator is stored
    once. Pass the result to ``export_encoder`` (or ``encoder_forward`` for the
    NumPy reference).

    Args:
        encoder: a ``damcha_torch.DamchaTransformerEncoder``.
        causal: whether the exported stack applies the causal rule.

    Returns:
        ``(params, config)`` with float64 NumPy arrays.
    """
    import torch.nn.functional as F
    from torch import nn

    import damcha_torch as dt

    from ._stack import EncoderConfig

    if not isinstance(encoder, dt.DamchaTransformerEncoder):
        raise DamchaTypeError(f"`encoder` must be a damcha_torch.DamchaTransformerEncoder. Received: encoder={describe(encoder)}")

    def activation_name(fn: Any) -> str | None:
        if fn is F.relu or isinstance(fn, nn.ReLU):
            return "relu"
        if fn is F.gelu:
            return "gelu"
        if isinstance(fn, nn.GELU):
            return "gelu" if fn.approximate == "none" else "gelu_tanh"
        return None

    layers = list(encoder.layers)
    first = layers[0]
    eps, act = first.norm1.eps, activation_name(first.activation)
    problems = []
    if encoder.norm is not None and (not isinstance(encoder.norm, nn.LayerNorm) or encoder.norm.eps != eps):
        problems.append("no final norm, or a final LayerNorm with the layers' epsilon")
    for i, layer in enumerate(layers):
        name = activation_name(layer.activation)
        if name is None:
            problems.append(f"ReLU or GELU (layer {i} has activation={getattr(layer.activation, '__name__', layer.activation)})")
        elif name != act or layer.norm_first != first.norm_first:
            problems.append(f"one activation and norm placement (layer {i} differs)")
        if layer.linear1.bias is None or layer.norm1.bias is None:
            problems.append(f"biases in the feed-forward and norms (layer {i} has bias=False)")
        if layer.norm1.eps != eps or layer.norm2.eps != eps:
            problems.append(f"one LayerNorm epsilon (layer {i} differs)")
        if layer.self_attn.config != first.self_attn.config:
            problems.append(f"one attention config (layer {i} differs)")
    if problems:
        raise DamchaValueError(
            "`encoder` does not fit the exported stack format; it needs "
            + "; ".join(dict.fromkeys(problems))
            + f". Received: encoder={describe(encoder)}"
        )
    config = EncoderConfig(first.self_attn.config, num_layers=len(layers), ffn_dim=first.linear1.out_features,
                           share_metric=encoder.share_metric and len(layers) > 1, norm_eps=eps, causal=causal,
                           norm_first=bool(first.norm_first), activation=act, final_norm=encoder.norm is not None)

    from ._frameworks import collect_stack_params

    def np64(t: Any) -> Any:
        return t.detach().to("cpu").double().numpy().copy()  # no alias of the live parameters

    layer_arrays = [{
        "attention": layer.self_attn.to_canonical(),
        "norm1.scale": np64(layer.norm1.weight), "norm1.bias": np64(layer.norm1.bias),
        "norm2.scale": np64(layer.norm2.weight), "norm2.bias": np64(layer.norm2.bias),
        "ffn.in.kernel": np64(layer.linear1.weight).T, "ffn.in.bias": np64(layer.linear1.bias),
        "ffn.out.kernel": np64(layer.linear2.weight).T, "ffn.out.bias": np64(layer.linear2.bias),
    } for layer in layers]
    final = None if encoder.norm is None else (np64(encoder.norm.weight), np64(encoder.norm.bias))
    return collect_stack_params(config, layer_arrays, final), config
