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

from ._graph import ATTENTION_OPSET, DTYPES, MIN_OPSET, GraphBuilder, KVCacheNames, attention_layer

FORMS = ("auto", "attention", "decomposed")

#: Input/output names of an exported layer.
QUERY, CONTEXT, MASK, OUTPUT = "query", "context", "mask", "output"
#: Cache inputs/outputs of a ``kv_cache=True`` layer (stacks add ``.{layer}``).
PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE = "past_key", "past_value", "present_key", "present_value"
#: Symbolic dims of the cache: P cached tokens, P + N after the step.
PAST_LEN, TOTAL_LEN = "past_len", "total_len"


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


def check_kv_cache(kv_cache: Any, *, causal: bool, cross: bool | None = None) -> bool:
    """Validate ``kv_cache``: a decode-step graph needs causal self-attention.

    ``cross`` is ``None`` for stacks (always self-attention); their ``causal``
    is ``config.causal``, named so in the error.
    """
    kv_cache = _check_flag("kv_cache", kv_cache)
    if not kv_cache:
        return False
    causal_name = "causal" if cross is not None else "config.causal"
    if not causal:
        raise DamchaValueError(
            f"`kv_cache` exports an autoregressive decode step, so it needs {causal_name}=True (query i of a step "
            f"sees cached and new keys j <= P + i). Received: kv_cache=True, {causal_name}={causal}"
        )
    if cross:
        raise DamchaValueError(
            "`kv_cache` caches the layer's own keys and values, so it needs self-attention; a cross-attention "
            "context is not a growing sequence. Received: kv_cache=True, cross=True"
        )
    return True


def cache_value_info(onnx_dtype: int, config: DamchaConfig, batch: str | int, suffix: str = "") -> tuple[list, list]:
    """(inputs, outputs) value infos of one layer's cache: past (B, G, P, d|d_v) -> present (B, G, P+N, d|d_v)."""
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    inputs = [
        helper.make_tensor_value_info(PAST_KEY + suffix, onnx_dtype, [batch, G, PAST_LEN, d]),
        helper.make_tensor_value_info(PAST_VALUE + suffix, onnx_dtype, [batch, G, PAST_LEN, d_v]),
    ]
    outputs = [
        helper.make_tensor_value_info(PRESENT_KEY + suffix, onnx_dtype, [batch, G, TOTAL_LEN, d]),
        helper.make_tensor_value_info(PRESENT_VALUE + suffix, onnx_dtype, [batch, G, TOTAL_LEN, d_v]),
    ]
    return inputs, outputs


def cache_names(suffix: str = "") -> KVCacheNames:
    return KVCacheNames(PAST_KEY + suffix, PAST_VALUE + suffix, PRESENT_KEY + suffix, PRESENT_VALUE + suffix)


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
    kv_cache: bool = False,
) -> onnx.ModelProto:
    """Build (without saving or validating) the ONNX model of one DAMCHA layer.

    Inputs of the model: ``query`` (B, N, E_q); ``context`` (B, M, E_kv) when
    ``cross``; with ``kv_cache``, ``past_key`` (B, G, P, d) and ``past_value``
    (B, G, P, d_v); ``mask`` bool (B|1, H|1, N|1, M), True = may attend, when
    ``mask`` (M = P + N with a cache). Outputs: ``output`` (B, N, E_o), and
    with ``kv_cache`` ``present_key`` (B, G, P+N, d), ``present_value``
    (B, G, P+N, d_v). See ``export`` for the arguments.
    """
    if not isinstance(config, DamchaConfig):
        raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
    params = dc.validate_params(params, config)
    opset, form = check_opset(opset, form)
    dtype = check_dtype(dtype)
    causal, cross, mask, dynamic = (_check_flag(n, v) for n, v in (("causal", causal), ("cross", cross), ("mask", mask), ("dynamic", dynamic)))
    kv_cache = check_kv_cache(kv_cache, causal=causal, cross=cross)
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
        # With a cache the keys are the P cached tokens plus the N new ones;
        # P changes every step, so it stays symbolic even when dynamic=False.
        M = TOTAL_LEN if kv_cache else N
    g = GraphBuilder(dtype, opset)
    inputs = [helper.make_tensor_value_info(QUERY, g.onnx_dtype, [B, N, config.query_dim])]
    outputs = [helper.make_tensor_value_info(OUTPUT, g.onnx_dtype, [B, N, config.output_dim])]
    if cross:
        inputs.append(helper.make_tensor_value_info(CONTEXT, g.onnx_dtype, [B, M, config.context_dim]))
    cache = None
    if kv_cache:
        cache_in, cache_out = cache_value_info(g.onnx_dtype, config, B)
        inputs += cache_in
        outputs += cache_out
        cache = cache_names()
    if mask:
        m_dims = ["mask_batch", "mask_heads", "mask_query", M] if dynamic else [B, config.num_heads, N, M]
        inputs.append(helper.make_tensor_value_info(MASK, TensorProto.BOOL, m_dims))
    for value in inputs + outputs:
        g._names.add(value.name)
    y = attention_layer(
        g, params, config, QUERY, CONTEXT if cross else None, mask=MASK if mask else None, causal=causal, form=form,
        prefix="", cache=cache,
    )
    g.nodes.append(helper.make_node("Identity", [y], [OUTPUT], name="n_output"))
    doc = (
        f"DAMCHA v1 layer ({form} form, causal={causal}, kv_cache={kv_cache}); config: {config.to_dict()}. "
        "mask: True = may attend; a query with no visible key outputs output.bias."
    )
    if kv_cache:
        doc += (" Decode step: past_key (B, G, P, d) holds k~ = L_k(c) k (no softmax scale), query i sits at "
                "position P + i and sees keys j <= P + i; present_* = past_* with the new tokens appended.")
    model = make_model(g, inputs, outputs, "damcha_attention", doc)
    helper.set_model_props(model, {
        "damcha_config": json.dumps(config.to_dict(), sort_keys=True), "damcha_form": form, "damcha_causal": str(causal),
        "damcha_kv_cache": str(kv_cache),
    })
    return model


def validate_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.checker`` (full check) and strict shape inference; returns the inferred model.

    Raises ``onnx.checker.ValidationError`` or ``onnx.shape_inference.InferenceError``.
    """
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise DamchaTypeError(f"`path` must be a file path or None. Received: path={describe(path)}")
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
    kv_cache: bool = False,
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
        kv_cache: export one step of incremental decoding (needs ``causal``,
            no ``cross``): extra inputs ``past_key`` (B, G, P, d) and
            ``past_value`` (B, G, P, d_v), P >= 0 tokens decoded before, and
            outputs ``present_key`` (B, G, P+N, d), ``present_value``
            (B, G, P+N, d_v). Query i of the step sits at position P + i and
            sees keys j <= P + i (bottom-right); the ``mask`` then has P + N
            columns. Cached keys are k~ = L_k(c) k in spec units, as in
            ``damcha_torch.DamchaKVCache``.

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
        kv_cache=kv_cache,
    )
    validate_model(model)
    if path is not None:
        save_model(model, path)
    return model
