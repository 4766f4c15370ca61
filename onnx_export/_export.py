"""``export``/``build_model``: one DAMCHA layer as a validated ONNX model."""

from __future__ import annotations

import json
import numbers
import os
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError
from damcha_core import describe

from ._graph import ATTENTION_OPSET, DTYPES, MIN_OPSET, GraphBuilder, attention_layer

FORMS = ("auto", "attention", "decomposed")

#: Input/output names of an exported layer.
QUERY, CONTEXT, MASK, OUTPUT = "query", "context", "mask", "output"


def check_opset(opset: Any, form: str = "auto") -> tuple[int, str]:
    """Validate ``opset``/``form``; returns (opset, resolved form)."""
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, numbers.Integral):
        raise DamchaTypeError(f"`opset` must be an int in [{MIN_OPSET}, {newest}]. Received: opset={describe(opset)}")
    if not MIN_OPSET <= opset <= newest:
        raise DamchaValueError(
            f"`opset` must be in [{MIN_OPSET}, {newest}]: {MIN_OPSET}-{ATTENTION_OPSET - 1} export a decomposed "
            f"MatMul/Softmax graph, >= {ATTENTION_OPSET} the standard Attention op. Received: opset={opset}"
        )
    if form not in FORMS:
        raise DamchaValueError(f"`form` must be one of {FORMS}. Received: form={form!r}")
    if form == "auto":
        form = "attention" if opset >= ATTENTION_OPSET else "decomposed"
    elif form == "attention" and opset < ATTENTION_OPSET:
        raise DamchaValueError(
            f"form='attention' needs opset >= {ATTENTION_OPSET} (the first with the Attention op). "
            f"Received: opset={opset}"
        )
    return int(opset), form


def check_dtype(dtype: Any) -> str:
    if dtype not in DTYPES:
        raise DamchaValueError(f"`dtype` must be one of {tuple(DTYPES)}. Received: dtype={dtype!r}")
    return dtype


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise DamchaTypeError(f"`{name}` must be a bool. Received: {name}={describe(value)}")
    return bool(value)


def _dims(dynamic: bool, name: str, symbol: str, value: int | None) -> str | int:
    if dynamic:
        if value is not None:
            raise DamchaValueError(f"`{name}` fixes a dimension, so it needs dynamic=False. Received: {name}={value}")
        return symbol
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise DamchaValueError(f"dynamic=False needs `{name}` as an int >= 1. Received: {name}={describe(value)}")
    return int(value)


def ir_version_for(opset: int) -> int:
    """The oldest IR version that supports ``opset``: runtimes reject IRs newer than they know."""
    return helper.find_min_ir_version_for([helper.make_opsetid("", opset)])


def make_model(g: GraphBuilder, inputs, outputs, name: str, doc: str) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", g.opset)],
        producer_name="damcha_onnx",
        producer_version=dc.__version__,
        doc_string=doc,
    )
    model.ir_version = ir_version_for(g.opset)
    return model


def build_model(
    params: Mapping[str, Any],
    config: DamchaConfig,
    *,
    opset: int = ATTENTION_OPSET,
    causal: bool = False,
    cross: bool = False,
    mask: bool = False,
    dynamic: bool = True,
    dtype: str = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    context_len: int | None = None,
) -> onnx.ModelProto:
    """Build (without saving or validating) the ONNX model of one DAMCHA layer.

    Inputs of the model: ``query`` (B, N, E_q); ``context`` (B, M, E_kv) when
    ``cross``; ``mask`` bool (B|1, H|1, N|1, M), True = may attend, when
    ``mask``. Output: ``output`` (B, N, E_o). See ``export`` for the arguments.
    """
    if not isinstance(config, DamchaConfig):
        raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
    params = dc.validate_params(params, config)
    opset, form = check_opset(opset, form)
    dtype = check_dtype(dtype)
    causal, cross, mask, dynamic = (_check_flag(n, v) for n, v in (("causal", causal), ("cross", cross), ("mask", mask), ("dynamic", dynamic)))
    if not cross and config.context_dim != config.query_dim:
        raise DamchaValueError(
            "A self-attention export reuses the query as context, so it needs config.context_dim == "
            f"config.query_dim; pass cross=True for a separate context input. Received: "
            f"query_dim={config.query_dim}, context_dim={config.context_dim}"
        )
    B = _dims(dynamic, "batch_size", "batch", batch_size)
    N = _dims(dynamic, "query_len", "query_len", query_len)
    if cross:
        M = _dims(dynamic, "context_len", "context_len", context_len)
    else:
        if context_len is not None:
            raise DamchaValueError(f"`context_len` needs cross=True. Received: context_len={context_len}")
        M = N
    g = GraphBuilder(dtype, opset)
    inputs = [helper.make_tensor_value_info(QUERY, g.onnx_dtype, [B, N, config.query_dim])]
    if cross:
        inputs.append(helper.make_tensor_value_info(CONTEXT, g.onnx_dtype, [B, M, config.context_dim]))
    if mask:
        m_dims = ["mask_batch", "mask_heads", "mask_query", M] if dynamic else [B, config.num_heads, N, M]
        inputs.append(helper.make_tensor_value_info(MASK, TensorProto.BOOL, m_dims))
    for name in (QUERY, CONTEXT, MASK):
        g._names.add(name)
    y = attention_layer(
        g, params, config, QUERY, CONTEXT if cross else None, mask=MASK if mask else None, causal=causal, form=form, prefix=""
    )
    g.nodes.append(helper.make_node("Identity", [y], [OUTPUT], name="n_output"))
    outputs = [helper.make_tensor_value_info(OUTPUT, g.onnx_dtype, [B, N, config.output_dim])]
    doc = (
        f"DAMCHA v1 layer ({form} form, causal={causal}); config: {config.to_dict()}. "
        "mask: True = may attend; a query with no visible key outputs output.bias."
    )
    model = make_model(g, inputs, outputs, "damcha_attention", doc)
    helper.set_model_props(model, {"damcha_config": json.dumps(config.to_dict(), sort_keys=True), "damcha_form": form, "damcha_causal": str(causal)})
    return model


def validate_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.checker`` (full check) and strict shape inference; returns the inferred model.

    Raises ``onnx.checker.ValidationError`` or ``onnx.shape_inference.InferenceError``.
    """
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise DamchaValueError(f"`path` must be a non-empty file path. Received: path={path!r}")
    onnx.save_model(model, path)


def export(
    params: Mapping[str, Any],
    config: DamchaConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    causal: bool = False,
    dynamic: bool = True,
    cross: bool = False,
    mask: bool = False,
    dtype: str = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    context_len: int | None = None,
) -> onnx.ModelProto:
    """Export one DAMCHA layer from canonical parameters to ONNX, validated.

    No deep-learning framework is involved: the graph is built with
    ``onnx.helper`` from the (float64) canonical params, then checked with
    ``onnx.checker.check_model(full_check=True)`` and strict shape inference.

    Args:
        params: canonical parameters (``config.param_shapes()``), any float dtype.
        config: the layer's ``DamchaConfig``.
        path: where to save the ``.onnx`` file; ``None`` only returns the model.
        opset: 17-22 export a decomposed MatMul/Softmax graph; >= 23 (default)
            one standard ``Attention`` op.
        causal: hide key j from query i when j > i (top-left, as the reference).
        dynamic: symbolic batch and sequence dims; ``False`` fixes them to
            ``batch_size``, ``query_len`` (and ``context_len``).
        cross: add a ``context`` (B, M, E_kv) input; otherwise self-attention.
        mask: add a boolean ``mask`` input (B|1, H|1, N|1, M), True = may
            attend. A query row with no visible key outputs ``output.bias``.
        dtype: "float32" (default) or "float64" for inputs, weights and output.
        form: "auto" (by opset), "attention" or "decomposed" (also allowed at
            opset >= 23, e.g. for runtimes without an Attention kernel).

    Returns:
        The validated ``onnx.ModelProto`` (also written to ``path``).

    Raises:
        DamchaValueError / DamchaTypeError: params not matching the config,
            opset out of range, inconsistent options.
    """
    model = build_model(
        params,
        config,
        opset=opset,
        causal=causal,
        cross=cross,
        mask=mask,
        dynamic=dynamic,
        dtype=dtype,
        form=form,
        batch_size=batch_size,
        query_len=query_len,
        context_len=context_len,
    )
    validate_model(model)
    if path is not None:
        save_model(model, path)
    return model
