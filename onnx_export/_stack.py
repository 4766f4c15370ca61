"""Encoder stacks with stack-wise metric sharing, and a small token model.

damcha_core defines one layer; the stack and model formats here are this
package's (documented in docs/onnx.md), each with a NumPy float64 reference
that calls ``damcha_core.damcha_attention`` per layer, so the exported graphs
are checked against the spec rather than against themselves.

Encoder layer (pre-norm, as in most current transformers)::

    h = h + DAMCHA(LN_1(h));  h = h + W_2 GELU(W_1 LN_2(h) + b_1) + b_2

followed by a final LayerNorm. GELU is the exact erf form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError
from damcha_core import describe

from ._export import (
    PAST_KEY,
    TOTAL_LEN,
    _check_flag,
    _dims,
    cache_names,
    cache_value_info,
    check_kv_cache,
    check_opset,
    make_model,
    save_model,
    validate_model,
)
from ._graph import ATTENTION_OPSET, GraphBuilder, attention_layer

SHARED = "shared."


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise DamchaValueError(f"`{name}` must be an int >= {minimum}. Received: {name}={describe(value)}")
    return int(value)


def _generator_leaves(config: DamchaConfig) -> tuple[str, ...]:
    return ("kernel", "bias") if config.metric == "heads" else ("kernel", "bias", "u", "v")


ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A stack of DAMCHA encoder layers (pre-norm by default).

    Each layer is ``h + Attn(LN1(h))`` then ``h + FFN(LN2(h))`` (``norm_first``,
    the default), or ``LN1(h + Attn(h))`` then ``LN2(h + FFN(h))`` (post-norm,
    ``nn.TransformerEncoderLayer``'s and KerasHub's default); FFN is
    ``act(h W_in + b_in) W_out + b_out``.

    Args:
        attention: the (self-attention) layer config shared by every layer;
            needs context_dim == output_dim == query_dim.
        num_layers: L, layers in the stack.
        ffn_dim: F, hidden size of each feed-forward block.
        share_metric: stack-wise sharing of the metric generator (W_A, b_A or
            W_u, b_u, U, V) by every layer; each layer keeps its own gate.
        norm_eps: LayerNorm epsilon.
        causal: causal self-attention in every layer.
        norm_first: pre-norm (True) or post-norm (False) layers.
        activation: "gelu" (exact, erf), "gelu_tanh" (the tanh
            approximation, JAX's default) or "relu".
        final_norm: a LayerNorm after the last layer (``final_norm.*`` params).
    """

    attention: DamchaConfig
    num_layers: int
    ffn_dim: int
    share_metric: bool = True
    norm_eps: float = 1e-5
    causal: bool = False
    norm_first: bool = True
    activation: str = "gelu"
    final_norm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.attention, DamchaConfig):
            raise DamchaTypeError(f"`attention` must be a DamchaConfig. Received: attention={describe(self.attention)}")
        a = self.attention
        if not (a.context_dim == a.output_dim == a.query_dim):
            raise DamchaValueError(
                "An encoder layer is residual self-attention, so it needs context_dim == output_dim == "
                f"query_dim. Received: query_dim={a.query_dim}, context_dim={a.context_dim}, output_dim={a.output_dim}"
            )
        object.__setattr__(self, "num_layers", _check_int("num_layers", self.num_layers))
        object.__setattr__(self, "ffn_dim", _check_int("ffn_dim", self.ffn_dim))
        _check_flag("share_metric", self.share_metric)
        _check_flag("causal", self.causal)
        _check_flag("norm_first", self.norm_first)
        _check_flag("final_norm", self.final_norm)
        if self.activation not in ACTIVATIONS:
            raise DamchaValueError(f"`activation` must be one of {ACTIVATIONS}. Received: activation={describe(self.activation)}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, numbers.Real) or not self.norm_eps > 0:
            raise DamchaValueError(f"`norm_eps` must be a number > 0. Received: norm_eps={describe(self.norm_eps)}")

    @property
    def width(self) -> int:
        return self.attention.query_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stack parameter names and shapes.

        ``layers.{i}.attention.<canonical name>`` per layer, except that with
        ``share_metric`` the generator is stored once as
        ``shared.metric.<side>.<leaf>`` (gates stay per layer); then
        ``layers.{i}.norm1/norm2.scale|bias`` (E,), ``layers.{i}.ffn.in.kernel``
        (E, F), ``.ffn.in.bias`` (F,), ``.ffn.out.kernel`` (F, E), ``.ffn.out.bias``
        (E,), and ``final_norm.scale|bias`` (E,) with ``final_norm``.
        """
        a, E, F = self.attention, self.width, self.ffn_dim
        layer = a.param_shapes()
        shared_names = self._shared_names()
        shapes: dict[str, tuple[int, ...]] = {}
        if self.share_metric:
            for name in shared_names:
                shapes[SHARED + name] = layer[name]
        for i in range(self.num_layers):
            pre = f"layers.{i}."
            for name, shape in layer.items():
                if name not in shared_names or not self.share_metric:
                    shapes[f"{pre}attention.{name}"] = shape
            for norm in ("norm1", "norm2"):
                shapes[f"{pre}{norm}.scale"] = (E,)
                shapes[f"{pre}{norm}.bias"] = (E,)
            shapes[f"{pre}ffn.in.kernel"] = (E, F)
            shapes[f"{pre}ffn.in.bias"] = (F,)
            shapes[f"{pre}ffn.out.kernel"] = (F, E)
            shapes[f"{pre}ffn.out.bias"] = (E,)
        if self.final_norm:
            shapes["final_norm.scale"] = (E,)
            shapes["final_norm.bias"] = (E,)
        return shapes

    def _shared_names(self) -> list[str]:
        a = self.attention
        return [f"metric.{side}.{leaf}" for side in a.metric_sides for leaf in _generator_leaves(a)]

    def layer_params(self, params: Mapping[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        """Canonical parameters of layer ``index`` (shared generator filled in)."""
        out = {}
        for name in self.attention.param_shapes():
            key = f"layers.{index}.attention.{name}"
            out[name] = params[SHARED + name] if (self.share_metric and name in self._shared_names()) else params[key]
        return out


@dataclasses.dataclass(frozen=True)
class TokenModelConfig:
    """Embedding -> DAMCHA encoder -> per-token linear head.

    Params: ``embedding.table`` (V, E), ``position.table`` (P, E) (learned
    positions; inputs longer than P fail in the runtime), ``encoder.<stack
    name>``, ``head.kernel`` (E, C), ``head.bias`` (C,). Input token ids
    (B, N) int64, output logits (B, N, C).
    """

    encoder: EncoderConfig
    vocab_size: int
    max_len: int
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.encoder, EncoderConfig):
            raise DamchaTypeError(f"`encoder` must be an EncoderConfig. Received: encoder={describe(self.encoder)}")
        for name in ("vocab_size", "max_len", "num_classes"):
            object.__setattr__(self, name, _check_int(name, getattr(self, name)))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        E = self.encoder.width
        shapes = {"embedding.table": (self.vocab_size, E), "position.table": (self.max_len, E)}
        shapes.update({f"encoder.{k}": v for k, v in self.encoder.param_shapes().items()})
        shapes["head.kernel"] = (E, self.num_classes)
        shapes["head.bias"] = (self.num_classes,)
        return shapes


# ------------------------------------------------------------ params and checks


def validate_stack_params(params: Mapping[str, Any], config: EncoderConfig | TokenModelConfig) -> dict[str, np.ndarray]:
    """Names, shapes, dtypes and finiteness against ``config``; float64 copies
    (``damcha_core.validate_params``'s rules, on the stack's names)."""
    return dc.validate_params(params, config)


def init_encoder_params(config: EncoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 stack params: each layer from ``damcha_core.init_params`` (gates 0),
    LayerNorm scale 1 / bias 0, Glorot-uniform FFN kernels, zero FFN biases."""
    if not isinstance(config, EncoderConfig):
        raise DamchaTypeError(f"`config` must be an EncoderConfig. Received: config={describe(config)}")
    seed = _check_int("seed", seed, minimum=0)
    rng = np.random.default_rng([seed, 7])
    params: dict[str, np.ndarray] = {}
    shared = config._shared_names()
    for i in range(config.num_layers):
        layer = dc.init_params(config.attention, seed + i)
        for name, value in layer.items():
            if config.share_metric and name in shared:
                params.setdefault(SHARED + name, value)
            else:
                params[f"layers.{i}.attention.{name}"] = value
    E, F = config.width, config.ffn_dim
    limit = math.sqrt(6.0 / (E + F))
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for norm in ("norm1", "norm2"):
            params[f"{pre}{norm}.scale"] = np.ones(E)
            params[f"{pre}{norm}.bias"] = np.zeros(E)
        params[f"{pre}ffn.in.kernel"] = rng.uniform(-limit, limit, (E, F))
        params[f"{pre}ffn.in.bias"] = np.zeros(F)
        params[f"{pre}ffn.out.kernel"] = rng.uniform(-limit, limit, (F, E))
        params[f"{pre}ffn.out.bias"] = np.zeros(E)
    params["final_norm.scale"] = np.ones(E)
    params["final_norm.bias"] = np.zeros(E)
    return {name: params[name] for name in config.param_shapes()}  # final_norm.* only where configured


def init_token_model_params(config: TokenModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 token-model params: N(0, 1) embeddings, N(0, 0.1) positions, the
    encoder from ``init_encoder_params``, a Glorot-uniform head with zero bias."""
    if not isinstance(config, TokenModelConfig):
        raise DamchaTypeError(f"`config` must be a TokenModelConfig. Received: config={describe(config)}")
    seed = _check_int("seed", seed, minimum=0)
    rng = np.random.default_rng([seed, 8])
    E, C = config.encoder.width, config.num_classes
    params = {
        "embedding.table": rng.normal(0.0, 1.0, (config.vocab_size, E)),
        "position.table": rng.normal(0.0, 0.1, (config.max_len, E)),
    }
    params.update({f"encoder.{k}": v for k, v in init_encoder_params(config.encoder, seed).items()})
    limit = math.sqrt(6.0 / (E + C))
    params["head.kernel"] = rng.uniform(-limit, limit, (E, C))
    params["head.bias"] = np.zeros(C)
    return params


# ------------------------------------------------------------ NumPy reference

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


_ACTIVATION_FNS = {
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "relu": lambda x: np.maximum(x, 0.0),
}


def encoder_forward(params: Mapping[str, Any], config: EncoderConfig, x: Any, *, mask: Any = None) -> np.ndarray:
    """The stack in float64 NumPy, each attention by ``damcha_core.damcha_attention``.

    x (B, N, E); mask as for one layer (True = may attend), used by every layer.
    """
    p = validate_stack_params(params, config)
    h = np.asarray(x, dtype=np.float64)
    eps, act = config.norm_eps, _ACTIVATION_FNS[config.activation]

    def norm(t: np.ndarray, name: str) -> np.ndarray:
        return _layer_norm(t, p[f"{name}.scale"], p[f"{name}.bias"], eps)

    for i in range(config.num_layers):
        pre = f"layers.{i}."
        a_in = norm(h, f"{pre}norm1") if config.norm_first else h
        h = h + dc.damcha_attention(config.layer_params(p, i), config.attention, a_in, mask=mask, causal=config.causal)
        if not config.norm_first:
            h = norm(h, f"{pre}norm1")
        f_in = norm(h, f"{pre}norm2") if config.norm_first else h
        hidden = act(f_in @ p[f"{pre}ffn.in.kernel"] + p[f"{pre}ffn.in.bias"])
        h = h + hidden @ p[f"{pre}ffn.out.kernel"] + p[f"{pre}ffn.out.bias"]
        if not config.norm_first:
            h = norm(h, f"{pre}norm2")
    return norm(h, "final_norm") if config.final_norm else h


def token_model_forward(params: Mapping[str, Any], config: TokenModelConfig, tokens: Any, *, mask: Any = None) -> np.ndarray:
    """Logits (B, N, C) of the token model for int token ids (B, N)."""
    p = validate_stack_params(params, config)
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 2:
        raise DamchaValueError(f"`tokens` must be integer ids of shape (B, N). Received: tokens={describe(tokens)}")
    if tokens.shape[1] > config.max_len:
        raise DamchaValueError(f"`tokens` is longer than max_len={config.max_len}. Received: tokens.shape={tokens.shape}")
    if tokens.size and not (0 <= tokens.min() and tokens.max() < config.vocab_size):
        # NumPy indexing would read -1 as the last row: a silent wrap, as Gather's.
        raise DamchaValueError(
            f"`tokens` must be ids in [0, {config.vocab_size}) (the vocabulary). "
            f"Received: tokens in [{tokens.min()}, {tokens.max()}]"
        )
    x = p["embedding.table"][tokens] + p["position.table"][: tokens.shape[1]]
    enc = {k[len("encoder."):]: v for k, v in p.items() if k.startswith("encoder.")}
    h = encoder_forward(enc, config.encoder, x, mask=mask)
    return h @ p["head.kernel"] + p["head.bias"]


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
) -> str:
    """Nodes of the stack on x (B, N, E); with ``kv_cache`` layer i reads
    ``past_key.{i}``/``past_value.{i}`` and writes ``present_key.{i}``/``present_value.{i}``."""
    eps = float(config.norm_eps)

    def norm(h: str, name: str) -> str:
        return g.op(
            "LayerNormalization",
            [h, g.weight(f"{prefix}{name}.scale", p[f"{name}.scale"]), g.weight(f"{prefix}{name}.bias", p[f"{name}.bias"])],
            f"{prefix}{name}",
            axis=-1,
            epsilon=eps,
        )

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


def _activation(g: GraphBuilder, kind: str, x: str, name: str) -> str:
    """The FFN activation from primitive ops (the Gelu op exists only from opset 20)."""
    if kind == "relu":
        return g.op("Relu", [x], name)
    if kind == "gelu":
        inner = g.op("Erf", [g.op("Mul", [x, g.scalar(1.0 / math.sqrt(2.0))], f"{name}_s")], f"{name}_erf")
    else:  # gelu_tanh: tanh(sqrt(2/pi) (x + 0.044715 x^3))
        cube = g.op("Mul", [g.op("Mul", [x, x], f"{name}_x2"), x], f"{name}_x3")
        poly = g.op("Add", [x, g.op("Mul", [cube, g.scalar(0.044715)], f"{name}_c")], f"{name}_poly")
        inner = g.op("Tanh", [g.op("Mul", [poly, g.scalar(math.sqrt(2.0 / math.pi))], f"{name}_s")], f"{name}_tanh")
    gate = g.op("Mul", [g.op("Add", [inner, g.scalar(1.0)], f"{name}_1p"), g.scalar(0.5)], f"{name}_h")
    return g.op("Mul", [x, gate], name)


def _stack_export(kind: str, params, config, path, *, opset, mask, dynamic, dtype, form, batch_size, query_len, kv_cache):
    opset, form = check_opset(opset, form)
    if dtype != "float32":
        # onnxruntime's CPU provider has no float64 Erf kernel (exact GELU);
        # single layers (``export``) do support float64.
        raise DamchaValueError(f"Stacks and token models export in float32 only. Received: dtype={dtype!r}")
    mask, dynamic = _check_flag("mask", mask), _check_flag("dynamic", dynamic)
    encoder = config if kind == "encoder" else config.encoder
    kv_cache = check_kv_cache(kv_cache, causal=encoder.causal)
    B = _dims(dynamic, "batch_size", "batch", batch_size)
    N = _dims(dynamic, "query_len", "query_len", query_len)
    if kind == "token_model" and isinstance(N, int) and N > config.max_len:
        raise DamchaValueError(
            f"`query_len` must be <= max_len={config.max_len}: the token model's positions come from its "
            f"position table, so a longer fixed length could never run. Received: query_len={N}"
        )
    # With a cache the mask covers the P cached keys too; P changes every step.
    M = TOTAL_LEN if kv_cache else N
    p = validate_stack_params(params, config)
    g = GraphBuilder(dtype, opset)
    H = encoder.attention.num_heads
    inputs = []
    if kind == "encoder":
        inputs.append(helper.make_tensor_value_info("query", g.onnx_dtype, [B, N, encoder.width]))
        x = "query"
        out_name, out_shape = "output", [B, N, encoder.width]
    else:
        inputs.append(helper.make_tensor_value_info("tokens", TensorProto.INT64, [B, N]))
        out_name, out_shape = "logits", [B, N, config.num_classes]
    outputs = [helper.make_tensor_value_info(out_name, g.onnx_dtype, out_shape)]
    if kv_cache:
        for i in range(encoder.num_layers):
            cache_in, cache_out = cache_value_info(g.onnx_dtype, encoder.attention, B, f".{i}")
            inputs += cache_in
            outputs += cache_out
    if mask:
        m_dims = ["mask_batch", "mask_heads", "mask_query", M] if dynamic else [B, H, N, M]
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, m_dims))
    for value in inputs + outputs:
        g._names.add(value.name)
    if kind == "token_model":
        emb = g.op("Gather", [g.weight("embedding.table", p["embedding.table"]), "tokens"], "embedded", axis=0)
        n = g.op("Squeeze", [g.dim("tokens", 1, "seq_len")], "seq_len_s")
        zero, one = g.op("Constant", [], "pos0", value_int=0), g.op("Constant", [], "pos1", value_int=1)
        positions = g.op("Range", [zero, n, one], "positions")
        if kv_cache:
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
        enc = {k[len("encoder."):]: v for k, v in p.items() if k.startswith("encoder.")}
        h = _encoder_nodes(g, enc, encoder, x, "mask" if mask else None, form, "encoder.", kv_cache)
        y = g.linear(h, p["head.kernel"], p["head.bias"], "head")
    else:
        y = _encoder_nodes(g, p, config, x, "mask" if mask else None, form, "", kv_cache)
    g.nodes.append(helper.make_node("Identity", [y], [out_name], name=f"n_{out_name}"))
    doc = f"DAMCHA {kind} ({form} form" + (", kv_cache: past_key.{i}/past_value.{i} -> present_key.{i}/present_value.{i})" if kv_cache else ")")
    model = make_model(g, inputs, outputs, f"damcha_{kind}", doc)
    props = {"damcha_attention_config": json.dumps(encoder.attention.to_dict(), sort_keys=True),
             "damcha_num_layers": str(encoder.num_layers), "damcha_causal": str(encoder.causal),
             "damcha_kv_cache": str(kv_cache)}
    if kind == "token_model":
        props.update({"damcha_vocab_size": str(config.vocab_size), "damcha_max_len": str(config.max_len)})
    helper.set_model_props(model, props)
    validate_model(model)
    if path is not None:
        save_model(model, path)
    return model


def export_encoder(
    params: Mapping[str, Any],
    config: EncoderConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    mask: bool = False,
    dynamic: bool = True,
    dtype: str = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    kv_cache: bool = False,
) -> onnx.ModelProto:
    """Export an encoder stack; input ``query`` (B, N, E) [+ ``mask``], output ``output`` (B, N, E).

    With ``config.share_metric`` the shared generator is stored once in the
    file. float32 only. ``kv_cache=True`` (needs ``config.causal``) exports a
    decode step: inputs ``past_key.{i}`` (B, G, P, d) and ``past_value.{i}``
    (B, G, P, d_v) per layer i, outputs ``present_key.{i}``/``present_value.{i}``
    with P + N tokens; a ``mask`` has P + N columns. Other arguments as for ``export``.
    """
    if not isinstance(config, EncoderConfig):
        raise DamchaTypeError(f"`config` must be an EncoderConfig. Received: config={describe(config)}")
    return _stack_export("encoder", params, config, path, opset=opset, mask=mask, dynamic=dynamic, dtype=dtype,
                         form=form, batch_size=batch_size, query_len=query_len, kv_cache=kv_cache)


def export_token_model(
    params: Mapping[str, Any],
    config: TokenModelConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    mask: bool = False,
    dynamic: bool = True,
    dtype: str = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    kv_cache: bool = False,
) -> onnx.ModelProto:
    """Export embedding -> encoder -> head; input ``tokens`` (B, N) int64 [+ ``mask``],
    output ``logits`` (B, N, C).

    ``kv_cache=True`` adds the encoder's per-layer cache as for
    ``export_encoder``; the step's tokens take learned positions P .. P+N-1,
    P read from ``past_key.0``'s shape, so decoding token by token gives the
    logits of the full sequence. P + N > ``max_len`` fails in the runtime.
    """
    if not isinstance(config, TokenModelConfig):
        raise DamchaTypeError(f"`config` must be a TokenModelConfig. Received: config={describe(config)}")
    return _stack_export("token_model", params, config, path, opset=opset, mask=mask, dynamic=dynamic, dtype=dtype,
                         form=form, batch_size=batch_size, query_len=query_len, kv_cache=kv_cache)
