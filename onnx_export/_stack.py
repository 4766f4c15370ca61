"""Encoder stacks and the token model as ONNX graphs.

The stack format itself (``EncoderConfig``, ``TokenModelConfig``, their
parameters and NumPy references) is the core's, ``damcha_core._stack``; this
module builds their graphs and re-exports those names for existing imports.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument
from damcha_core._stack import (
    ACTIVATIONS,
    SHARED,
    EncoderConfig,
    TokenModelConfig,
    encoder_forward,
    init_encoder_params,
    init_token_model_params,
    token_model_forward,
    validate_stack_params,
)

from ._export import (
    PAST_KEY,
    WEIGHTS,
    Draft,
    cache_names,
    cache_value_info,
    check_paths,
    finish,
    mask_node,
    mask_value_info,
    option_props,
    weights_value_info,
)
from ._graph import ATTENTION_OPSET, GraphBuilder, attention_layer, checked_arrays
from ._io import check_path
from ._options import ExportOptions

__all__ = [
    "ACTIVATIONS",
    "SHARED",
    "EncoderConfig",
    "TokenModelConfig",
    "encoder_forward",
    "export_encoder",
    "export_token_model",
    "init_encoder_params",
    "init_token_model_params",
    "token_model_forward",
    "validate_stack_params",
]


# ------------------------------------------------------------------ graphs


def _encoder_nodes(
    g: GraphBuilder,
    p: Mapping[str, np.ndarray],
    config: EncoderConfig,
    x: str,
    mask: str | None,
    form: str,
    prefix: str,
    kv_cache: bool = False,
    weights: bool = False,
) -> str:
    """Nodes of the stack on x (B, N, E); with ``kv_cache`` layer i reads
    ``past_key.{i}``/``past_value.{i}`` and writes ``present_key.{i}``/``present_value.{i}``;
    with ``weights`` its attention probabilities go to the output ``weights.{i}``."""
    eps = float(config.norm_eps)

    def norm(h: str, name: str) -> str:
        scale = g.weight(f"{prefix}{name}.scale", p[f"{name}.scale"])
        bias = g.weight(f"{prefix}{name}.bias", p[f"{name}.bias"])
        hint = f"{prefix}{name}"
        if g.onnx_dtype != TensorProto.DOUBLE:
            return g.op("LayerNormalization", [h, scale, bias], hint, axis=-1, epsilon=eps)
        # LayerNormalization's epsilon is a float32 attribute: 1e-5 becomes
        # 9.9999997e-06, an error far above float64's. float64 graphs spell the
        # reference's formula out instead, with epsilon a float64 constant.
        centred = g.op("Sub", [h, g.reduce_mean_last(h, f"{hint}_mean")], f"{hint}_centred")
        var = g.reduce_mean_last(g.op("Mul", [centred, centred], f"{hint}_sq"), f"{hint}_var")
        std = g.op("Sqrt", [g.op("Add", [var, g.scalar(eps)], f"{hint}_vareps")], f"{hint}_std")
        normed = g.op("Div", [centred, std], f"{hint}_normed")
        return g.op("Add", [g.op("Mul", [normed, scale], f"{hint}_scaled"), bias], hint)

    h = x
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        a_in = norm(h, f"{pre}norm1") if config.norm_first else h
        attn = attention_layer(
            g,
            config.layer_params(p, i),
            config.attention,
            a_in,
            None,
            mask=mask,
            causal=config.causal,
            form=form,
            prefix=f"{prefix}{pre}attn_",
            shared=f"{prefix}{SHARED}" if config.share_metric else None,
            cache=cache_names(f".{i}") if kv_cache else None,
            weights=f"{WEIGHTS}.{i}" if weights else None,
        )
        h = g.op("Add", [h, attn], f"{prefix}{pre}res1")
        if not config.norm_first:
            h = norm(h, f"{pre}norm1")
        f_in = norm(h, f"{pre}norm2") if config.norm_first else h
        hidden = g.linear(f_in, p[f"{pre}ffn.in.kernel"], p[f"{pre}ffn.in.bias"], f"{prefix}{pre}ffn_in")
        act = _activation(g, config.activation, hidden, f"{prefix}{pre}act")
        out = g.linear(act, p[f"{pre}ffn.out.kernel"], p[f"{pre}ffn.out.bias"], f"{prefix}{pre}ffn_out")
        h = g.op("Add", [h, out], f"{prefix}{pre}res2")
        if not config.norm_first:
            h = norm(h, f"{pre}norm2")
    return norm(h, "final_norm") if config.final_norm else h


#: Chebyshev coefficients c_k of h(y) = log(erfc(z) / t) + z^2 on y in (-1, 1],
#: t = (y + 1) / 2 = 2 / (2 + z), so erfc(z) = t exp(-z^2 + sum_k c_k T_k(y))
#: for z >= 0. Computed for this package by Chebyshev interpolation at 60
#: nodes in 50-digit arithmetic (mpmath) and truncated where |c_k| < 1e-16:
#: erfc to ~1e-13 relative on [0, 27] (the rounding of z^2 dominates), GELU
#: to ~2e-15 absolute; tests/test_onnx_edge.py checks it against math.erf.
ERFC_CHEBYSHEV = (
    -0.6513268598908547,
    0.6419697923564902,
    0.019476473204185836,
    -0.009561514786808632,
    -0.0009465953444820369,
    0.00036683949785276145,
    4.252332480690777e-05,
    -2.0278578112534242e-05,
    -1.6242900046470256e-06,
    1.3036558355805232e-06,
    1.5626441722066142e-08,
    -8.523809591492654e-08,
    6.5290544390988515e-09,
    5.059343495551469e-09,
    -9.91364156493033e-10,
    -2.273651222931836e-10,
    9.646791102015527e-11,
    2.3940380830391146e-12,
    -6.886027526497553e-12,
    8.944879273090725e-13,
    3.130921399342958e-13,
    -1.1270822361367252e-13,
    3.810905255189232e-16,
    7.106097613609237e-15,
    -1.5230282014571043e-15,
    -9.457494571291233e-17,
    1.210237189224279e-16,
    -2.816663087747177e-17,
)


def _half_erfc(g: GraphBuilder, z: str, name: str) -> str:
    """0.5 erfc(z) for z >= 0 from Add/Mul/Div/Exp only (Clenshaw on ``ERFC_CHEBYSHEV``)."""
    t = g.op("Div", [g.scalar(2.0), g.op("Add", [z, g.scalar(2.0)], f"{name}_2pz")], f"{name}_t")
    y = g.op("Sub", [g.op("Mul", [t, g.scalar(2.0)], f"{name}_2t"), g.scalar(1.0)], f"{name}_y")
    y2 = g.op("Add", [y, y], f"{name}_y2")
    b1, b2 = g.scalar(ERFC_CHEBYSHEV[-1]), None  # b_n = c_n
    for k in range(len(ERFC_CHEBYSHEV) - 2, 0, -1):
        # b_k = c_k + 2y b_{k+1} - b_{k+2}
        acc = g.op("Mul", [y2, b1], f"{name}_m{k}")
        if b2 is not None:
            acc = g.op("Sub", [acc, b2], f"{name}_s{k}")
        b1, b2 = g.op("Add", [acc, g.scalar(ERFC_CHEBYSHEV[k])], f"{name}_b{k}"), b1
    assert b2 is not None  # ERFC_CHEBYSHEV has more than two terms
    series = g.op(
        "Add",
        [g.op("Sub", [g.op("Mul", [y, b1], f"{name}_yb1"), b2], f"{name}_yb"), g.scalar(ERFC_CHEBYSHEV[0])],
        f"{name}_series",
    )
    exponent = g.op("Sub", [series, g.op("Mul", [z, z], f"{name}_zz")], f"{name}_exponent")
    return g.op(
        "Mul",
        [g.op("Mul", [t, g.op("Exp", [exponent], f"{name}_exp")], f"{name}_erfc"), g.scalar(0.5)],
        f"{name}_half_erfc",
    )


def _activation(g: GraphBuilder, kind: str, x: str, name: str) -> str:
    """The FFN activation from primitive ops (the Gelu op exists only from opset 20).

    The exact GELU is x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); onnxruntime has
    no float64 ``Erf`` kernel, so float64 graphs compute it as
    x (1 - h) for x >= 0 and x h otherwise, h = 0.5 erfc(|x| / sqrt 2), with
    erfc from a Chebyshev series (``_half_erfc``): the same function to ~1e-15.
    """
    if kind == "relu":
        return g.op("Relu", [x], name)
    if kind == "gelu" and g.onnx_dtype == TensorProto.DOUBLE:
        z = g.op("Mul", [g.op("Abs", [x], f"{name}_abs"), g.scalar(1.0 / math.sqrt(2.0))], f"{name}_z")
        h = _half_erfc(g, z, name)
        positive = g.op("GreaterOrEqual", [x, g.scalar(0.0)], f"{name}_pos")
        phi = g.op("Where", [positive, g.op("Sub", [g.scalar(1.0), h], f"{name}_1mh"), h], f"{name}_phi")
        return g.op("Mul", [x, phi], name)
    if kind == "gelu":
        inner = g.op("Erf", [g.op("Mul", [x, g.scalar(1.0 / math.sqrt(2.0))], f"{name}_s")], f"{name}_erf")
    else:  # gelu_tanh: tanh(sqrt(2/pi) (x + 0.044715 x^3))
        cube = g.op("Mul", [g.op("Mul", [x, x], f"{name}_x2"), x], f"{name}_x3")
        poly = g.op("Add", [x, g.op("Mul", [cube, g.scalar(0.044715)], f"{name}_c")], f"{name}_poly")
        inner = g.op("Tanh", [g.op("Mul", [poly, g.scalar(math.sqrt(2.0 / math.pi))], f"{name}_s")], f"{name}_tanh")
    gate = g.op("Mul", [g.op("Add", [inner, g.scalar(1.0)], f"{name}_1p"), g.scalar(0.5)], f"{name}_h")
    return g.op("Mul", [x, gate], name)


def _stack_model(kind: str, params: Mapping[str, Any], config: Any, o: ExportOptions) -> Draft:
    encoder = config if kind == "encoder" else config.encoder
    B, N = o.batch_dim, o.query_dim
    if kind == "token_model" and isinstance(N, int) and config.max_len < N:
        raise DamchaValueError(
            invalid_argument(
                "query_len",
                f"an int <= max_len={config.max_len}: the token model's positions come from its position table, so a longer fixed length could never run",
                f"query_len={N}",
            )
        )
    p = checked_arrays(params, config)  # no float64 copy of the stack (see checked_arrays)
    g = GraphBuilder(o.dtype_name, o.opset)
    inputs = []
    if kind == "encoder":
        inputs.append(
            helper.make_tensor_value_info(
                "query", g.onnx_dtype, [B, N, encoder.width], doc_string="input tokens (batch, query_len, width)"
            )
        )
        x = "query"
        out_name, out_shape = "output", [B, N, encoder.width]
        out_doc = "the stack's output (batch, query_len, width)"
    else:
        inputs.append(
            helper.make_tensor_value_info(
                "tokens", TensorProto.INT64, [B, N], doc_string="token ids in [0, vocab_size) (batch, query_len)"
            )
        )
        out_name, out_shape = "logits", [B, N, config.num_classes]
        out_doc = "class logits per token (batch, query_len, num_classes)"
    outputs = [helper.make_tensor_value_info(out_name, g.onnx_dtype, out_shape, doc_string=out_doc)]
    if o.kv_cache:
        for i in range(encoder.num_layers):
            cache_in, cache_out = cache_value_info(g.onnx_dtype, encoder.attention, B, f".{i}")
            inputs += cache_in
            outputs += cache_out
    if o.mask:
        inputs.append(mask_value_info(o, encoder.attention.num_heads))
    if o.return_weights:
        outputs += [
            weights_value_info(g.onnx_dtype, o, encoder.attention.num_heads, f".{i}") for i in range(encoder.num_layers)
        ]
    for value in inputs + outputs:
        g.reserve(value.name)
    tokens = "query" if kind == "encoder" else "tokens"
    mask = mask_node(g, o, tokens, tokens, f"{PAST_KEY}.0" if o.kv_cache else None)
    if kind == "token_model":
        # Gather reads a negative id as counted from the end (-1: the last
        # row), a silent wrong answer in a runtime that does not check feeds
        # (run_ort does); send them past the table, where Gather fails.
        negative = g.op("Less", ["tokens", g.ints([0])], "tokens_negative")
        ids = g.op("Where", [negative, g.ints([config.vocab_size]), "tokens"], "token_ids")
        emb = g.op("Gather", [g.weight("embedding.table", p["embedding.table"]), ids], "embedded", axis=0)
        n = g.op("Squeeze", [g.dim("tokens", 1, "seq_len")], "seq_len_s")
        zero, one = g.op("Constant", [], "pos0", value_int=0), g.op("Constant", [], "pos1", value_int=1)
        positions = g.op("Range", [zero, n, one], "positions")
        if o.kv_cache:
            # Token i of a decode step sits at position P + i; P is read from
            # the first layer's cache, so callers pass no extra input. Added
            # after the Range, not Range(P, P + N): onnxruntime rewrites
            # Gather(table, Range) into a Slice, which clamps silently, and a
            # clamped 1-row (or empty) table would broadcast in the Add below.
            start = g.op("Squeeze", [g.dim(f"{PAST_KEY}.0", 2, "past_len")], "pos_start")
            positions = g.op("Add", [positions, start], "positions_cached")
        # P + N > max_len fails in the runtime (the Gather), never clamps.
        # The indices are (1, N), not the Range itself: onnxruntime rewrites
        # Gather(table, Range) into a Slice (extended optimisation level),
        # which clamps silently; with max_len = 1 the clamped 1-row table
        # broadcast over every token in the Add below, and the Reshape guard
        # one would add after it is folded away by the same symbolic shapes.
        positions = g.op("Unsqueeze", [positions, g.ints([0])], "positions_row")
        pos = g.op("Gather", [g.weight("position.table", p["position.table"]), positions], "pos_embedded", axis=0)
        x = g.op("Add", [emb, pos], "x")
        enc = {k[len("encoder.") :]: v for k, v in p.items() if k.startswith("encoder.")}
        h = _encoder_nodes(g, enc, encoder, x, mask, o.form, "encoder.", o.kv_cache, o.return_weights)
        y = g.linear(h, p["head.kernel"], p["head.bias"], "head")
    else:
        y = _encoder_nodes(g, p, config, x, mask, o.form, "", o.kv_cache, o.return_weights)
    g.nodes.append(helper.make_node("Identity", [y], [out_name], name=f"n_{out_name}"))
    cache_doc = ", kv_cache: past_key.{i}/past_value.{i} -> present_key.{i}/present_value.{i})"
    doc = f"DAMCHA {kind} ({o.form} form" + (cache_doc if o.kv_cache else ")")
    props = {
        "damcha_attention_config": json.dumps(encoder.attention.to_dict(), sort_keys=True),
        "damcha_num_layers": str(encoder.num_layers),
        "damcha_causal": str(encoder.causal),
        "damcha_kv_cache": str(o.kv_cache),
        **option_props(o),
    }
    if kind == "token_model":
        props.update({"damcha_vocab_size": str(config.vocab_size), "damcha_max_len": str(config.max_len)})
    return Draft(g, inputs, outputs, f"damcha_{kind}", doc, props)


def _stack_options(kind: str, causal: bool, options: ExportOptions | None, keywords: dict[str, Any]) -> ExportOptions:
    if options is None:
        return ExportOptions(kind=kind, causal=causal, **keywords)
    options = ExportOptions.resolve(options, kind, **keywords)
    if options.causal != causal:
        raise DamchaValueError(
            invalid_argument(
                "options",
                f"options.causal == config.causal={causal} (a stack's causal rule is its config's)",
                f"options.causal={options.causal}",
            )
        )
    return options


def export_encoder(
    params: Mapping[str, Any],
    config: EncoderConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    mask: bool | str = False,
    dynamic: bool = True,
    dtype: npt.DTypeLike = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    kv_cache: bool = False,
    return_weights: bool = False,
    external_data: bool | None = None,
    options: ExportOptions | None = None,
) -> onnx.ModelProto:
    """Export an encoder stack; input ``query`` (B, N, E) [+ ``mask``], output ``output`` (B, N, E).

    With ``config.share_metric`` the shared generator is stored once in the
    file. ``dtype`` float32, float16 or float64 (the exact GELU then as an
    Erf-free decomposition: onnxruntime has no float64 Erf). ``kv_cache=True`` (needs ``config.causal``) exports a
    decode step: inputs ``past_key.{i}`` (B, G, P, d) and ``past_value.{i}``
    (B, G, P, d_v) per layer i, outputs ``present_key.{i}``/``present_value.{i}``
    with P + N tokens; a ``mask`` has P + N columns. ``return_weights`` adds
    each layer's attention probabilities as ``weights.{i}`` (B, H, N, M).
    Other arguments (``mask="padding"``, ``external_data``, ``options``, ...)
    as for ``export``.
    """
    if not isinstance(config, EncoderConfig):
        raise DamchaTypeError(invalid_argument("config", "an EncoderConfig", f"config={describe(config)}"))
    path = check_path(path)
    keywords = ExportOptions.keywords(locals())
    options = _stack_options("encoder", config.causal, options, keywords)
    check_paths(path, options)
    return finish(_stack_model("encoder", params, config, options), path, options)


def export_token_model(
    params: Mapping[str, Any],
    config: TokenModelConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    mask: bool | str = False,
    dynamic: bool = True,
    dtype: npt.DTypeLike = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    kv_cache: bool = False,
    return_weights: bool = False,
    external_data: bool | None = None,
    options: ExportOptions | None = None,
) -> onnx.ModelProto:
    """Export embedding -> encoder -> head; input ``tokens`` (B, N) int64 [+ ``mask``],
    output ``logits`` (B, N, C).

    ``kv_cache=True`` adds the encoder's per-layer cache as for
    ``export_encoder``; the step's tokens take learned positions P .. P+N-1,
    P read from ``past_key.0``'s shape, so decoding token by token gives the
    logits of the full sequence. P + N > ``max_len`` fails in the runtime.
    """
    if not isinstance(config, TokenModelConfig):
        raise DamchaTypeError(invalid_argument("config", "a TokenModelConfig", f"config={describe(config)}"))
    path = check_path(path)
    keywords = ExportOptions.keywords(locals())
    options = _stack_options("token_model", config.encoder.causal, options, keywords)
    check_paths(path, options)
    return finish(_stack_model("token_model", params, config, options), path, options)
