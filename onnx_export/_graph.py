"""Graph building blocks: one DAMCHA layer as ONNX nodes, from canonical params.

Everything here is framework-free: the graph is assembled with ``onnx.helper``
from float64 NumPy parameters, which are folded and cast once at export time.

Layouts inside the graph (B batch, N query length, M context length):

* tokens stay (B, T, E) and stacked heads (B, T, S*d), so projections are a
  single MatMul each and the cross-head map never needs a transpose;
* the opset >= 23 form feeds (B, N, H*d) / (B, M, G*d) to ``Attention`` in its
  3-D layout (``q_num_heads``/``kv_num_heads``), which handles GQA natively;
* the opset 17/18 form regroups query heads as (B, G, R*N, d), R = H/G, so one
  batched MatMul against (B, G, d, M) computes every head without repeating
  keys or values.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaValueError
from damcha_core._params import check_params_finite

#: First opset with the standard ``Attention`` operator.
ATTENTION_OPSET = 23
#: Oldest opset the decomposed MatMul/Softmax form targets (LayerNormalization, Shape slicing).
MIN_OPSET = 17

DTYPES: dict[str, int] = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16}


@dataclasses.dataclass(frozen=True)
class KVCacheNames:
    """Graph value names of one layer's key/value cache (incremental decoding).

    ``past_key`` (B, G, P, d) and ``past_value`` (B, G, P, d_v) are graph
    inputs holding the P tokens decoded so far; ``present_key`` (B, G, P+n, d)
    and ``present_value`` (B, G, P+n, d_v) are graph outputs with the n new
    tokens appended. Keys are the transformed k~ = L_k(c) k in spec units (the
    softmax scale is folded into the queries, never into the cache), exactly
    what ``damcha_torch.DamchaKVCache`` holds.
    """

    past_key: str
    past_value: str
    present_key: str
    present_value: str


class GraphBuilder:
    """Accumulates nodes and initialisers with unique names.

    Floating initialisers are cast to the graph's dtype once, here, so the
    exported file stores exactly the weights the runtime multiplies with.
    """

    def __init__(self, dtype: str, opset: int) -> None:
        self.dtype = dtype
        self.np_dtype = np.dtype(dtype)
        self.onnx_dtype = DTYPES[dtype]
        # Reductions that lose accuracy in half precision (the RMS statistic,
        # the softmax) run in float32 in float16 graphs.
        self.acc_dtype = TensorProto.FLOAT if dtype == "float16" else self.onnx_dtype
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        # (name, array) in creation order; turned into TensorProtos only when
        # the model is assembled, inline or as external data (a model over
        # 2 GiB cannot even be held as one protobuf message).
        self.arrays: list[tuple[str, np.ndarray]] = []
        self._names: set[str] = set()
        self._counter = itertools.count()
        self._consts: dict[tuple, str] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of every initialiser: the model's size, give or take the graph itself."""
        return sum(a.nbytes for _, a in self.arrays)

    def add_initializers(
        self, graph: onnx.GraphProto, location: str | None = None, min_bytes: int = 1024
    ) -> list[np.ndarray]:
        """Append the initialisers to ``graph``: inline (``location=None``), or
        those of ``min_bytes`` or more as ONNX external data in the file
        ``location``, laid end to end in creation order. Returns the arrays to
        write to ``location``, in that order. One tensor's bytes are copied at
        a time, so a large model is never held twice."""
        external = []
        offset = 0
        for name, array in self.arrays:
            if location is None or array.nbytes < min_bytes:
                graph.initializer.append(numpy_helper.from_array(array, name))
                continue
            t = graph.initializer.add(
                name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape
            )
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            external.append(array)
            offset += array.nbytes
        return external

    def reserve(self, name: str) -> None:
        """Keep ``name`` (a graph input or output) from ever being handed out by ``fresh``."""
        self._names.add(name)

    def fresh(self, hint: str) -> str:
        name = hint
        while name in self._names:
            name = f"{hint}_{next(self._counter)}"
        self._names.add(name)
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """A floating initialiser in the graph dtype."""
        # Folding (the softmax scale into the query kernel, gates into U) can
        # grow a weight past what the canonical params' own check saw.
        dc.check_params_fit({name: array}, self.np_dtype.name, float(np.finfo(self.np_dtype).max), argument="weight")
        name = self.fresh(name)
        self.arrays.append((name, np.ascontiguousarray(array, dtype=self.np_dtype)))
        return name

    def shared_weight(self, key: str, array: np.ndarray) -> str:
        """A floating initialiser stored once per ``key`` (stack-wise sharing)."""
        ckey = ("shared", key)
        if ckey not in self._consts:
            self._consts[ckey] = self.weight(key, array)
        return self._consts[ckey]

    def ints(self, values: Sequence[int]) -> str:
        """An int64 1-D constant (shapes, axes), shared between nodes."""
        key = ("i64", tuple(int(v) for v in values))
        if key not in self._consts:
            name = self.fresh(
                "const_" + "_".join(str(v).replace("-", "m") for v in key[1]) if key[1] else "const_empty"
            )
            self.arrays.append((name, np.asarray(key[1], dtype=np.int64)))
            self._consts[key] = name
        return self._consts[key]

    def scalar(self, value: float, dtype: int | None = None) -> str:
        """A floating scalar constant in the graph dtype (or ``dtype``), shared between nodes."""
        dtype = self.onnx_dtype if dtype is None else dtype
        key = ("f", float(value), dtype)
        if key not in self._consts:
            name = self.fresh("const_scalar")
            self.arrays.append((name, np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))))
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attrs) -> str:
        out = self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.fresh(f"n_{out}"), **attrs))
        return out

    def named_op(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs) -> None:
        """A node whose outputs get exactly these names (graph outputs, several outputs).

        The caller reserves the names (``_names``), so ``fresh`` never hands them out again.
        """
        self.nodes.append(
            helper.make_node(op_type, list(inputs), list(outputs), name=self.fresh(f"n_{outputs[0]}"), **attrs)
        )

    # -------------------------------------------------------------- helpers

    def reshape(self, x: str, shape: Sequence[int], hint: str) -> str:
        # 0 copies the input's dim (dynamic batch/length), -1 infers one dim.
        return self.op("Reshape", [x, self.ints(shape)], hint)

    def linear(self, x: str, kernel: np.ndarray, bias: np.ndarray | None, hint: str) -> str:
        """x (..., E) @ kernel (E, F) (+ bias (F,))."""
        y = self.op("MatMul", [x, self.weight(f"{hint}.kernel", kernel)], hint if bias is None else f"{hint}_mm")
        if bias is not None:
            y = self.op("Add", [y, self.weight(f"{hint}.bias", bias)], hint)
        return y

    def reduce_mean_last(self, x: str, hint: str) -> str:
        # ReduceMean takes axes as an attribute up to opset 17, as an input from 18.
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.ints([-1])], hint, keepdims=1)
        return self.op("ReduceMean", [x], hint, axes=[-1], keepdims=1)

    def reduce_max(self, x: str, axes: Sequence[int], hint: str, keepdims: int = 1) -> str:
        if self.opset >= 18:
            return self.op("ReduceMax", [x, self.ints(axes)], hint, keepdims=keepdims)
        return self.op("ReduceMax", [x], hint, axes=list(axes), keepdims=keepdims)

    def dim(self, x: str, index: int, hint: str) -> str:
        """A 1-element int64 tensor holding x.shape[index]."""
        end = index + 1 if index != -1 else None
        attrs = {"start": index} if end is None else {"start": index, "end": end}
        return self.op("Shape", [x], hint, **attrs)

    def ones(self, size: int, dtype: int | None = None) -> str:
        """A floating vector of ones in the graph dtype (or ``dtype``), shared between nodes."""
        dtype = self.onnx_dtype if dtype is None else dtype
        key = ("ones", int(size), dtype)
        if key not in self._consts:
            name = self.fresh(f"const_ones_{size}")
            self.arrays.append((name, np.ones(size, dtype=helper.tensor_dtype_to_np_dtype(dtype))))
            self._consts[key] = name
        return self._consts[key]

    def rms_normalise(self, x: str, features: int, hint: str) -> str:
        """phi(t) = t / sqrt(mean(t^2) + 1e-6), the generator's input.

        One RMSNormalization node from opset 23 (float32 and float16, whose
        statistic it accumulates in float32: ``stash_type``); otherwise the
        exact node pattern onnxruntime fuses into one
        SimplifiedLayerNormalization kernel (Pow 2, ReduceMean, Add, Sqrt,
        Div, Mul by a unit scale), in float32 for float16 graphs (t^2
        overflows float16 from |t| = 256). Either way a single kernel
        instead of five passes over the tokens.
        """
        if self.opset >= 23 and self.onnx_dtype in (TensorProto.FLOAT, TensorProto.FLOAT16):
            # float64 keeps the explicit pattern: stash_type=DOUBLE is not
            # implemented everywhere (onnx's ReferenceEvaluator rejects it).
            return self.op(
                "RMSNormalization",
                [x, self.ones(features)],
                hint,
                axis=-1,
                epsilon=dc.RMS_EPS,
                stash_type=int(TensorProto.FLOAT),
            )
        acc = self.acc_dtype
        t = x if acc == self.onnx_dtype else self.op("Cast", [x], f"{hint}_acc", to=acc)
        sq = self.op("Pow", [t, self.scalar(2.0, acc)], f"{hint}_sq")
        ms = self.reduce_mean_last(sq, f"{hint}_ms")
        rms = self.op("Sqrt", [self.op("Add", [ms, self.scalar(dc.RMS_EPS, acc)], f"{hint}_mseps")], f"{hint}_rms")
        y = self.op(
            "Mul",
            [self.op("Div", [t, rms], f"{hint}_div"), self.ones(features, acc)],
            hint if acc == self.onnx_dtype else f"{hint}_f",
        )
        return y if acc == self.onnx_dtype else self.op("Cast", [y], hint, to=self.onnx_dtype)


# --------------------------------------------------------------------- layer


def fold_params(
    params: Mapping[str, np.ndarray], config: DamchaConfig, *, fold_gate: bool = True
) -> dict[str, np.ndarray]:
    """Canonical params -> the matrices the graph multiplies with (float64).

    Folding is exact algebra done once in float64: the softmax scale goes into
    the query projection (L(x) is linear, so L(x)(s q) = s L(x) q), and for
    metric "heads" the gate and the identity go into the generator,
    l(t) = I + diag(g) A(t) = phi(t) (g W_A) + (I + diag(g) b_A), so applying
    the map is one small batched MatMul. Keys:
    ``q/k/v/o.kernel`` (E, S*d) or (H*d_v, E_o), ``q/k/v/o.bias`` or absent,
    and per side ``SIDE.gen.kernel/bias`` plus, for "lowrank", ``SIDE.v``
    (S*d, r) and ``SIDE.ut`` (r, S*d) with the gate folded into U.

    ``fold_gate=False`` (stack-wise sharing) keeps the generator exactly as
    shared by every layer and returns the per-layer gate separately as
    ``SIDE.gate_rows``: (S*S,) for "heads" (with ``SIDE.eye``, the flat
    identity) or (S*d,) for "lowrank", applied to the generator's output.
    """
    return _fold(dc.validate_params(params, config), config, fold_gate=fold_gate)


def _fold(p: Mapping[str, np.ndarray], config: DamchaConfig, *, fold_gate: bool) -> dict[str, np.ndarray]:
    """``fold_params`` of checked params (NumPy arrays of any real floating
    dtype). The products are computed in float64; a weight that needs none
    (the key, value and output projections) comes back as the caller's array
    in its own dtype, reshaped, not copied: a large layer is then not held
    once more in float64 while it is exported. Casting it straight to the
    graph dtype rounds exactly as casting its float64 copy would (the widening
    is exact), so the exported weights are the same."""

    def f64(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.float64)

    H, d_v = config.num_heads, cast(int, config.value_dim)
    s = config.softmax_scale
    out: dict[str, np.ndarray] = {}
    for short, name, factor in (("q", "query", s), ("k", "key", 1.0), ("v", "value", 1.0)):
        kernel = p[f"{name}.kernel"].reshape(p[f"{name}.kernel"].shape[0], -1)
        out[f"{short}.kernel"] = kernel if factor == 1.0 else factor * f64(kernel)
        if config.use_bias:
            bias = p[f"{name}.bias"].reshape(-1)
            out[f"{short}.bias"] = bias if factor == 1.0 else factor * f64(bias)
    out["o.kernel"] = p["output.kernel"].reshape(H * d_v, -1)
    if config.use_bias:
        out["o.bias"] = p["output.bias"]
    for side in config.metric_sides:
        pre = f"metric.{side}"
        g = f64(p[f"{pre}.gate"])
        S = g.shape[0]
        gate = g if fold_gate else np.ones_like(g)
        if config.metric == "heads":
            kernel = gate[None, :, None] * f64(p[f"{pre}.kernel"])  # (E, S, S): row h scaled by g_h
            out[f"{side}.gen.kernel"] = kernel.reshape(kernel.shape[0], S * S)
            bias = gate[:, None] * f64(p[f"{pre}.bias"])
            out[f"{side}.gen.bias"] = ((np.eye(S) + bias) if fold_gate else bias).reshape(S * S)
            if not fold_gate:
                out[f"{side}.gate_rows"] = np.repeat(g, S)
                out[f"{side}.eye"] = np.eye(S).reshape(S * S)
        else:
            r = cast(int, config.metric_rank)
            out[f"{side}.gen.kernel"] = p[f"{pre}.kernel"]
            out[f"{side}.gen.bias"] = p[f"{pre}.bias"]
            out[f"{side}.v"] = p[f"{pre}.v"].reshape(-1, r)
            out[f"{side}.ut"] = (gate[:, None, None] * f64(p[f"{pre}.u"])).reshape(-1, r).T
            if not fold_gate:
                out[f"{side}.gate_rows"] = np.repeat(g, config.key_dim)
    return out


def check_scaled_query(params: Mapping[str, Any], config: DamchaConfig, dtype: str) -> None:
    """Refuse a softmax scale that takes the query projection past ``dtype``'s
    range: the export folds the scale into ``query.kernel``/``query.bias``, and
    the folded weight's own check named that internal weight (``q.kernel``)
    rather than the config's ``scale`` at fault.

    Raises:
        DamchaValueError: naming ``config.scale``, the largest scaled weight and ``dtype``.
    """
    scale = abs(float(config.softmax_scale))
    limit = np.finfo(dtype).max
    for name in ("query.kernel", "query.bias"):
        if name not in params or not np.size(params[name]):
            continue
        largest = float(np.max(np.abs(np.asarray(params[name], dtype=np.float64))))
        with np.errstate(over="ignore"):
            # The product is monotonic in each factor: the largest weight gives the largest folded one.
            scaled = np.float64(scale) * np.float64(largest)
            overflows = bool(np.isinf(np.asarray(scaled).astype(dtype)))
        if overflows:
            raise DamchaValueError(
                dc.invalid_argument(
                    "config.scale",
                    f"a softmax scale whose product with the query projection rounds to a finite {dtype} "
                    f"(|x| <= {float(limit):g}): the export folds the scale into query.kernel and query.bias; "
                    "use a smaller scale or a wider dtype",
                    f"config.scale={config.scale!r} and max |{name}| = {largest:g}: scaled weights up to "
                    f"{float(scaled):g} in dtype {dtype}",
                )
            )


def checked_arrays(params: Mapping[str, Any], config: Any) -> dict[str, np.ndarray]:
    """``validate_params``' checks (names, shapes, dtypes, finiteness) against
    ``config`` (a ``DamchaConfig`` or a stack's config), returning the caller's
    values, each read once, as NumPy arrays in their own dtypes: no
    float64 copy of every weight at once (``_fold`` makes the few it
    multiplies). A dtype wider than float64 (``np.longdouble``) is rounded to
    float64 here, as ``validate_params`` does, so every weight is cast to the
    graph dtype from the same float64 value as before."""
    arrays = check_params_finite(params, config)
    return {n: a.astype(np.float64) if a.dtype.itemsize > 8 else a for n, a in arrays.items()}


def _gen_weight(g: GraphBuilder, f: Mapping[str, np.ndarray], key: str, shared: str | None, prefix: str) -> str:
    # A shared generator is stored once and read by every layer of the stack;
    # a layer's own generator is stored once per layer (tied cross-attention
    # runs it on the query and on the context).
    return g.shared_weight(f"{prefix if shared is None else shared}{key}", f[key])


def _generator(
    g: GraphBuilder,
    f: Mapping[str, np.ndarray],
    config: DamchaConfig,
    side: str,
    phi: str,
    hint: str,
    shared: str | None,
    prefix: str,
) -> str:
    """l(t) flattened (B, T, S*S) for "heads"; u(t) (B, T, r) for "lowrank"."""
    mm = g.op("MatMul", [phi, _gen_weight(g, f, f"{side}.gen.kernel", shared, prefix)], f"{hint}_mm")
    if shared is not None and config.metric == "heads":
        # The layer's own gate on the shared A(t): l(t) = I + diag(g) A(t)
        # = (phi W_A) * g_rows + (I + b_A * g_rows). The offset is folded here,
        # in float64, into one small per-layer initialiser: runtimes do not
        # all fold it at load (onnxruntime's CPU provider has no float16 Mul
        # kernel for constant folding, and warned per layer). W_A stays one
        # stored initialiser (quantisable, stored once).
        rows = g.weight(f"{hint}.gate_rows", f[f"{side}.gate_rows"])
        offset = g.weight(f"{hint}.offset", f[f"{side}.eye"] + f[f"{side}.gen.bias"] * f[f"{side}.gate_rows"])
        return g.op("Add", [g.op("Mul", [mm, rows], f"{hint}_gated"), offset], hint)
    bias = _gen_weight(g, f, f"{side}.gen.bias", shared, prefix)
    return g.op("Add", [mm, bias], hint)


def _apply_map(
    g: GraphBuilder,
    f: Mapping[str, np.ndarray],
    config: DamchaConfig,
    side: str,
    coeff: str,
    y: str,
    S: int,
    hint: str,
    shared: str | None,
    prefix: str,
) -> str:
    """L(t) y on stacked heads y (B, T, S*d) -> (B, T, S*d)."""
    d = config.key_dim
    if config.metric == "heads":
        # Tied self-attention maps q and k with the same l(t): reshape it once.
        l_t = g._consts.get(("l", coeff)) or g.reshape(coeff, [0, 0, S, S], f"{hint}_l")
        g._consts[("l", coeff)] = l_t
        heads = g.reshape(y, [0, 0, S, d], f"{hint}_heads")
        mixed = g.op("MatMul", [l_t, heads], f"{hint}_mixed")  # (B, T, S, d)
        return g.reshape(mixed, [0, 0, S * d], hint)
    z = g.op("MatMul", [y, _gen_weight(g, f, f"{side}.v", shared, prefix)], f"{hint}_z")  # (B, T, r)
    uz = g.op("Mul", [coeff, z], f"{hint}_uz")
    delta = g.op("MatMul", [uz, _gen_weight(g, f, f"{side}.ut", shared, prefix)], f"{hint}_delta")
    if shared is not None:
        delta = g.op("Mul", [delta, g.weight(f"{hint}.gate_rows", f[f"{side}.gate_rows"])], f"{hint}_gated")
    return g.op("Add", [y, delta], hint)


def _query_batch(g: GraphBuilder, query: str, tokens: str, hints: tuple[str, str, str, str]) -> str:
    """``tokens`` (B', T, F) reshaped to (B, T, F) with the query's batch B: a
    batch that differs fails in this Reshape (element count) instead of
    broadcasting later. ``hints``: names of the batch dim, the tokens' other
    dims, the target shape and the result."""
    batch, rest, target, out = hints
    shape = g.op("Concat", [g.dim(query, 0, batch), g.op("Shape", [tokens], rest, start=1)], target, axis=0)
    return g.op("Reshape", [tokens, shape], out)


def attention_layer(
    g: GraphBuilder,
    params: Mapping[str, np.ndarray],
    config: DamchaConfig,
    query: str,
    context: str | None,
    *,
    mask: str | None,
    causal: bool,
    form: str,
    prefix: str,
    shared: str | None = None,
    cache: KVCacheNames | None = None,
    weights: str | None = None,
    value: str | None = None,
) -> str:
    """Nodes of one DAMCHA layer; returns the name of y (B, N, E_o).

    ``params`` are checked by the caller (``checked_arrays`` or ``validate_params``).

    ``query`` is x (B, N, E_q); ``context`` is c (B, M, E_kv) or ``None`` for
    self-attention; ``mask`` is a boolean (B|1, H|1, N|1, M) graph value or
    ``None``; ``form`` is "attention" (standard op, opset >= 23) or
    "decomposed" (MatMul/Softmax). ``shared`` names the stack-wise shared
    metric generator: its weights are stored once under that prefix.

    ``cache`` (causal self-attention only) turns the layer into a decode step:
    the new keys k~ and values are appended to ``cache.past_key``/``past_value``
    (B, G, P, d/d_v), written to ``cache.present_key``/``present_value``, and
    query i of the step attends keys j <= P + i of the P + N (bottom-right). A
    ``mask`` then has M = P + N columns. ``weights`` names a graph output
    that receives the attention probabilities (B, H, N, M). ``value`` is
    value tokens (B, M, E_v) of their own (cross-attention); by default the
    values are projected from the context.
    """
    if cache is not None and (context is not None or not causal):
        raise DamchaValueError(
            dc.invalid_argument(
                "cache", "None unless the attention is causal self-attention", f"context={context!r}, causal={causal}"
            )
        )
    check_scaled_query(params, config, g.np_dtype.name)
    f = _fold(params, config, fold_gate=shared is None)
    H, G, d, d_v = config.num_heads, config.side_heads("k"), config.key_dim, cast(int, config.value_dim)
    R = config.group_size
    P = prefix
    self_attn = context is None
    if context is not None:
        # Reshape to (B_query, M, E_kv): a context whose batch differs from the
        # query's fails here (element count) instead of broadcasting in MatMul.
        context = _query_batch(g, query, context, (f"{P}batch", f"{P}ctx_shape", f"{P}ctx_target", f"{P}context"))
    c = query if context is None else context
    if value is not None:
        # The same guard for the value tokens; their length must be the
        # context's, which the attention (or the value MatMul) enforces.
        value = _query_batch(g, query, value, (f"{P}vbatch", f"{P}val_shape", f"{P}val_target", f"{P}value_tokens"))

    q = g.linear(query, f["q.kernel"], f.get("q.bias"), f"{P}q")  # (B, N, H*d), pre-scaled
    k = g.linear(c, f["k.kernel"], f.get("k.bias"), f"{P}k")  # (B, M, G*d)
    v = g.linear(c if value is None else value, f["v.kernel"], f.get("v.bias"), f"{P}v")  # (B, M, G*d_v)

    sq, sk = dc.side_of(config, "q"), dc.side_of(config, "k")
    coeff_x: dict[str, str] = {}
    phi_x = g.rms_normalise(query, config.query_dim, f"{P}phi_x") if (sq or (sk and self_attn)) else None
    if sq:
        assert phi_x is not None  # computed above whenever a side reads the query
        coeff_x[sq] = _generator(g, f, config, sq, phi_x, f"{P}{sq}_coeff_x", shared, P)
        q = _apply_map(g, f, config, sq, coeff_x[sq], q, H, f"{P}q_mapped", shared, P)
    if sk:
        if self_attn and sk in coeff_x:
            coeff_c = coeff_x[sk]  # tied self-attention: one generator pass serves q and k
        else:
            phi_c = (
                phi_x
                if phi_x is not None and self_attn
                else g.rms_normalise(c, cast(int, config.context_dim), f"{P}phi_c")
            )
            coeff_c = _generator(g, f, config, sk, phi_c, f"{P}{sk}_coeff_c", shared, P)
        k = _apply_map(g, f, config, sk, coeff_c, k, config.side_heads(sk), f"{P}k_mapped", shared, P)

    # Key count M (1-element int64) and, with a cache, the causal offset P,
    # both from input shapes: the mask feeds the Attention node, so it cannot
    # be sized from that node's present_key.
    offset = None
    if cache is None:
        key_len = g.dim(c, 1, f"{P}mM")
    else:
        past_len = g.dim(cache.past_key, 2, f"{P}past_len")
        key_len = g.op("Add", [past_len, g.dim(query, 1, f"{P}new_len")], f"{P}total_len")
        offset = g.op("Squeeze", [past_len], f"{P}past_len_s")

    visible = rows_ok = None
    if mask is not None:
        # The mask keeps its broadcast dims (B|1, H|1, N|1, M): nothing here
        # builds a (B, H, N, M) tensor from it, or an N x M causal one.
        visible = _checked_mask(
            g, mask, [g.dim(query, 0, f"{P}mB"), g.ints([H]), g.dim(query, 1, f"{P}mN"), key_len], P
        )
        rows_ok = _rows_with_key(g, visible, causal, query, offset, P)

    if form == "attention":
        attn_mask = ""
        if visible is not None:
            # onnxruntime's kernel needs the mask's query dim to be N (batch
            # and head dims broadcast): expand that one, nothing else.
            shape = g.op("Concat", [g.ints([1, 1]), g.dim(query, 1, f"{P}aN"), key_len], f"{P}attn_mask_shape", axis=0)
            attn_mask = g.op("Expand", [visible, shape], f"{P}attn_mask")
        # float16 graphs run the Attention node in float32 (casts around it):
        # the op forms q k^T in its input type before it applies the mask and
        # the causal rule, so a hidden key whose logit overflows float16 (from
        # 65504) came out +inf, and +inf plus the kernel's mask value is +inf
        # or NaN: the hidden key took all the weight (a future key read through
        # the causal rule). softmax_precision covers the softmax only. In
        # float32 no product of float16 values overflows (64 terms of 65504^2
        # reach 3e11); the decomposed form hides logits with a Where instead.
        upcast = g.onnx_dtype == TensorProto.FLOAT16
        if upcast:
            q, k, v = (
                g.op("Cast", [t], f"{P}{n}_f32", to=TensorProto.FLOAT) for t, n in ((q, "q"), (k, "k"), (v, "v"))
            )
        inputs = [q, k, v, attn_mask]
        outputs = [g.fresh(f"{P}attn")]
        if cache is not None:
            # is_causal with past_key is bottom-right (j <= P + i) in the ONNX
            # spec (errata onnx/onnx#8068), in onnx.reference and in
            # onnxruntime's CPU kernel; checked empirically (onnx 1.23,
            # onnxruntime 1.32) and pinned by tests/test_onnx_kv_cache.py, so
            # no explicit (N, P+N) mask is materialised for the fused kernel.
            if upcast:
                # The cache keeps the model's dtype at the graph's inputs and outputs.
                inputs += [
                    g.op("Cast", [t], f"{P}{n}_f32", to=TensorProto.FLOAT)
                    for t, n in ((cache.past_key, "past_key"), (cache.past_value, "past_value"))
                ]
                outputs += [g.fresh(f"{P}present_key_f32"), g.fresh(f"{P}present_value_f32")]
            else:
                inputs += [cache.past_key, cache.past_value]
                outputs += [cache.present_key, cache.present_value]
        attrs = {}
        if weights is not None:
            # qk_matmul_output_mode=3: the softmax output (B, H, N, M).
            outputs += [""] * (3 - len(outputs)) + [g.fresh(f"{P}probs_raw")]
            attrs["qk_matmul_output_mode"] = 3
        while inputs[-1] == "":
            inputs.pop()  # trailing optional inputs are omitted, not named ""
        g.named_op(
            "Attention", inputs, outputs, q_num_heads=H, kv_num_heads=G, scale=1.0, is_causal=int(causal), **attrs
        )
        o = outputs[0]  # (B, N, H*d_v); scale already folded into q
        if upcast:
            o = g.op("Cast", [o], f"{P}attn_f16", to=TensorProto.FLOAT16)
            if cache is not None:
                for temp, name in zip(outputs[1:3], (cache.present_key, cache.present_value)):
                    g.named_op("Cast", [temp], [name], to=TensorProto.FLOAT16)
        if rows_ok is not None:
            o = _zero_empty_rows_3d(g, o, rows_ok, H, d_v, P)
        if weights is not None:
            # onnx's shape inference for Attention types this output with a
            # static key count of 0 (B, H, N, 0); onnxruntime re-infers it at
            # load and then warns on every run that the real (B, H, N, M)
            # differs. A Reshape to the shape read from the inputs (free in
            # onnxruntime: it aliases) gives the output its real, symbolic dims.
            full = g.op(
                "Concat",
                [g.dim(query, 0, f"{P}wB"), g.ints([H]), g.dim(query, 1, f"{P}wN"), key_len],
                f"{P}weights_shape",
                axis=0,
            )
            probs = g.op("Reshape", [outputs[-1], full], f"{P}probs")
            if upcast:
                probs = g.op("Cast", [probs], f"{P}probs_f16", to=TensorProto.FLOAT16)
            if rows_ok is not None:
                probs = g.op("Where", [rows_ok, probs, g.scalar(0.0)], f"{P}probs_safe")
            g.named_op("Identity", [probs], [weights])
    else:
        o = _decomposed_attention(
            g, q, k, v, visible, rows_ok, causal, query, key_len, offset, cache, H, G, R, d, d_v, P, weights
        )
    return g.linear(o, f["o.kernel"], f.get("o.bias"), f"{P}out")


def _checked_mask(g: GraphBuilder, mask: str, target: Sequence[str], P: str) -> str:
    """``mask`` unchanged, after a shape check that fails in the runtime when a
    dim is neither 1 nor its target (B, H, N, M: 1-element int64 tensors).

    The check works on the 4 dims alone (a mask one key too long, or with a
    batch the query does not have, must fail rather than broadcast), so the
    mask itself is never expanded: an explicit error in any runtime, onnxruntime
    Web included, where no Python code checks the feeds first.
    """
    shape = g.op("Shape", [mask], f"{P}mask_dims")
    full = g.op("Concat", list(target), f"{P}mask_target", axis=0)
    fits = g.op(
        "Or",
        [g.op("Equal", [shape, g.ints([1, 1, 1, 1])], f"{P}mask_dim1"), g.op("Equal", [shape, full], f"{P}mask_dimeq")],
        f"{P}mask_fits",
    )
    return _fail_unless(g, mask, shape, fits, f"{P}mask")


def checked_padding_mask(g: GraphBuilder, mask: str, batch: str, key_len: str) -> str:
    """A (B, M) key padding mask as (B, 1, 1, M), after a check that fails in
    the runtime unless its two dims are exactly the batch and the key count
    (1-element int64 tensors read from the other inputs' shapes).

    The 4-D check of each layer lets any dim be 1, so a (1, M) or (B, 1)
    padding mask would pass it once unsqueezed and be broadcast: a tokenizer's
    mask of the wrong batch or length is a caller's bug, never a broadcast.
    Checked here, on the 2-D feed, whatever dims the input declares.
    """
    shape = g.op("Shape", [mask], "padding_mask_dims")
    full = g.op("Concat", [batch, key_len], "padding_mask_target", axis=0)
    fits = g.op("Equal", [shape, full], "padding_mask_fits")
    checked = _fail_unless(g, mask, shape, fits, "padding_mask")
    return g.op("Unsqueeze", [checked, g.ints([1, 2])], "mask_4d")


def _fail_unless(g: GraphBuilder, x: str, shape: str, fits: str, hint: str) -> str:
    """``x`` reshaped to its own ``shape``, with an empty vector appended to the
    target shape that only has length 0 when every entry of ``fits`` is True:
    the Reshape fails in any runtime otherwise, and changes nothing when it passes."""
    bad = g.op(
        "ReduceSum",
        [g.op("Cast", [g.op("Not", [fits], f"{hint}_unfit")], f"{hint}_unfit_i", to=TensorProto.INT64)],
        f"{hint}_bad",
        keepdims=1,
    )  # (1,): how many dims do not fit
    # A vector of `bad` zeros, reshaped to length 0: fails unless bad == 0.
    zeros = g.op("ConstantOfShape", [bad], f"{hint}_bad_zeros", value=numpy_helper.from_array(np.zeros(1, np.int64)))
    empty = g.op("Reshape", [zeros, g.ints([0])], f"{hint}_check", allowzero=1)
    return g.op("Reshape", [x, g.op("Concat", [shape, empty], f"{hint}_shape", axis=0)], f"{hint}_checked")


def _rows_with_key(g: GraphBuilder, visible: str, causal: bool, query: str, offset: str | None, P: str) -> str:
    """(B|1, H|1, N|1, 1) bool: does a query row see at least one key.

    Computed from the mask alone, never from an N x M causal matrix: with the
    causal rule row i (at position i + offset) sees a key iff the first key
    its mask row allows is at most i + offset.
    """
    as_int = g.op("Cast", [visible], f"{P}vis_i", to=TensorProto.INT32)
    any_key = g.op("Cast", [g.reduce_max(as_int, [3], f"{P}row_any_i")], f"{P}row_any", to=TensorProto.BOOL)
    if not causal:
        return any_key
    first = g.op("ArgMax", [as_int], f"{P}row_first", axis=3, keepdims=1)  # the first True (select_last_index=0)
    n = g.op("Squeeze", [g.dim(query, 1, f"{P}rN")], f"{P}rN_s")
    zero, one = g.op("Constant", [], f"{P}r0", value_int=0), g.op("Constant", [], f"{P}r1", value_int=1)
    rows = g.op("Range", [zero, n, one], f"{P}rows_r")
    if offset is not None:
        rows = g.op("Add", [rows, offset], f"{P}rows_pos")  # query i sits at position P + i
    rows = g.op("Unsqueeze", [rows, g.ints([1])], f"{P}rows")  # (N, 1)
    reachable = g.op("LessOrEqual", [first, rows], f"{P}row_reach")  # (B|1, H|1, N, 1)
    return g.op("And", [any_key, reachable], f"{P}row_ok")


def _causal_visible(g: GraphBuilder, query: str, key_len: str, offset: str | None, P: str) -> str:
    """(N, M) bool, key j visible to query i iff j <= i + offset (decomposed form only).

    ``key_len`` is M as a 1-element int64 tensor; ``offset`` a scalar int64
    (P cached tokens: bottom-right) or ``None`` for 0 (top-left, as the reference).
    """
    n = g.op("Squeeze", [g.dim(query, 1, f"{P}cN")], f"{P}cN_s")
    m = g.op("Squeeze", [key_len], f"{P}cM_s")
    zero, one = g.op("Constant", [], f"{P}c0", value_int=0), g.op("Constant", [], f"{P}c1", value_int=1)
    rows = g.op("Range", [zero, n, one], f"{P}rows_c")
    if offset is not None:
        rows = g.op("Add", [rows, offset], f"{P}rows_cpos")
    rows = g.op("Unsqueeze", [rows, g.ints([1])], f"{P}rows_col")
    cols = g.op("Range", [zero, m, one], f"{P}cols")
    return g.op("LessOrEqual", [cols, rows], f"{P}causal_visible")


def _zero_empty_rows_3d(g: GraphBuilder, o: str, rows_ok: str, H: int, d_v: int, P: str) -> str:
    # v1 defines a query with no visible key to have probabilities 0, so output
    # 0. Runtimes disagree on this corner (NaN, uniform, 0), so force it here.
    row = g.op("Transpose", [rows_ok], f"{P}row_ok_t", perm=[0, 2, 1, 3])  # (B|1, N|1, H|1, 1)
    heads = g.reshape(o, [0, 0, H, d_v], f"{P}attn_heads")
    zeroed = g.op("Where", [row, heads, g.scalar(0.0)], f"{P}attn_zeroed")
    return g.reshape(zeroed, [0, 0, H * d_v], f"{P}attn_masked")


def _decomposed_attention(
    g, q, k, v, visible, rows_ok, causal, query, key_len, offset, cache, H, G, R, d, d_v, P, weights
):
    """Scaled dot-product attention from MatMul/Softmax for opsets without Attention."""
    # Query head h = g*R + r reads kv head g: group query heads by kv head.
    qg = g.op("Transpose", [g.reshape(q, [0, 0, G, R, d], f"{P}q5")], f"{P}q5t", perm=[0, 2, 3, 1, 4])
    qg = g.reshape(qg, [0, 0, -1, d], f"{P}qg")  # (B, G, R*N, d)
    if cache is None:
        kt = g.op("Transpose", [g.reshape(k, [0, 0, G, d], f"{P}k4")], f"{P}kt", perm=[0, 2, 3, 1])  # (B, G, d, M)
        vg = g.op("Transpose", [g.reshape(v, [0, 0, G, d_v], f"{P}v4")], f"{P}vg", perm=[0, 2, 1, 3])  # (B, G, M, d_v)
    else:
        # The cache layout (B, G, P, d) is the Attention op's past_key layout.
        k_new = g.op("Transpose", [g.reshape(k, [0, 0, G, d], f"{P}k4")], f"{P}k_new", perm=[0, 2, 1, 3])
        v_new = g.op("Transpose", [g.reshape(v, [0, 0, G, d_v], f"{P}v4")], f"{P}v_new", perm=[0, 2, 1, 3])
        g.named_op("Concat", [cache.past_key, k_new], [cache.present_key], axis=2)  # (B, G, P+N, d)
        g.named_op("Concat", [cache.past_value, v_new], [cache.present_value], axis=2)  # (B, G, P+N, d_v)
        kt = g.op("Transpose", [cache.present_key], f"{P}kt", perm=[0, 1, 3, 2])  # (B, G, d, M)
        vg = cache.present_value
    logits = g.reshape(g.op("MatMul", [qg, kt], f"{P}logits_g"), [0, H, -1, 0], f"{P}logits")  # (B, H, N, M)
    # float16 graphs take the softmax (max, exp, sum over M keys) in float32.
    acc = g.acc_dtype
    if acc != g.onnx_dtype:
        logits = g.op("Cast", [logits], f"{P}logits_acc", to=acc)
    if causal:
        # Causal never hides every key of a row (key 0 is visible to every
        # query, also at offset P), so only a user mask can produce an empty row.
        cv = _causal_visible(g, query, key_len, offset, P)
        visible = cv if visible is None else g.op("And", [visible, cv], f"{P}vis_all")
    if visible is not None:
        # The lowest finite value rather than -inf: exp(lowest - max) is still
        # exactly 0, and an all-hidden row stays finite (uniform) instead of
        # NaN in runtimes that compute x - max; it is zeroed just below.
        lowest = float(np.finfo(helper.tensor_dtype_to_np_dtype(acc)).min)
        logits = g.op("Where", [visible, logits, g.scalar(lowest, acc)], f"{P}logits_masked")
    probs = g.op("Softmax", [logits], f"{P}probs", axis=-1)
    if rows_ok is not None:
        # v1 defines a query with no visible key to have probabilities 0.
        probs = g.op("Where", [rows_ok, probs, g.scalar(0.0, acc)], f"{P}probs_safe")
    if acc != g.onnx_dtype:
        probs = g.op("Cast", [probs], f"{P}probs_cast", to=g.onnx_dtype)
    if weights is not None:
        g.named_op("Identity", [probs], [weights])
    pg = g.reshape(probs, [0, G, -1, 0], f"{P}probs_g")  # (B, G, R*N, M)
    o = g.reshape(g.op("MatMul", [pg, vg], f"{P}o_g"), [0, H, -1, d_v], f"{P}o4")  # (B, H, N, d_v)
    o = g.op("Transpose", [o], f"{P}o_t", perm=[0, 2, 1, 3])
    return g.reshape(o, [0, 0, H * d_v], f"{P}o")
