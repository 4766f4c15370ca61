"""The NumPy float64 reference: DAMCHA v1 as executable math.

Two code paths compute the same function:

* ``path="fast"``: project, apply each token's cross-head map to its own
  query/key heads (q~ = L_q(x) q, k~ = L_k(c) k), then plain scaled dot-product
  attention on (q~, k~, v). Cost beyond MHA is per token, never N x M.
* ``path="explicit"``: build each token's dense (S*d x S*d) map, then every
  head's cross-head metric M_h(i, j) = L_q(x_i)[h]^T L_k(c_j)[g(h)] and the
  N x M logits q_i^T M_h(i, j) k_j directly. Slow; it exists so the tests can
  check that the fast path computes the Mahalanobis form the spec defines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._config import DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._metrics import structure
from ._params import as_numpy, is_real_float, validate_params
from ._policy import check_bool, check_choice, check_config, check_offset, check_shapes
from ._rotary import Rotary, apply_rotary

RMS_EPS = 1e-6
PATHS = ("fast", "explicit")


# --------------------------------------------------------------------- checks


def float_dtype_error(name: str, value: Any) -> DamchaTypeError:
    """The error every backend raises for a non-float input tensor."""
    return DamchaTypeError(
        invalid_argument(name, "a real floating tensor (float16/32/64 or bfloat16)", f"{name}={describe(value)}")
    )


def mask_dtype_error(value: Any, name: str = "mask", expected: str = "boolean (True = may attend)") -> DamchaTypeError:
    """The error every backend raises for a mask of the wrong dtype.

    ``expected`` states the convention of the argument at hand, e.g. a port
    whose masks follow torch's convention passes "boolean (True = masked out)
    or floating (additive)".
    """
    return DamchaTypeError(
        invalid_argument(
            name, f"a mask that is {expected}; convert other masks explicitly", f"{name}={describe(value)}"
        )
    )


def _as_float64(name: str, value: Any) -> np.ndarray:
    array = as_numpy(value, name)
    if not is_real_float(array.dtype):
        raise float_dtype_error(name, value)
    return array.astype(np.float64)


def visibility(
    batch: int,
    heads: int,
    n: int,
    m: int,
    mask: np.ndarray | None = None,
    causal: bool = False,
    query_offset: int = 0,
) -> np.ndarray:
    """Boolean (B, H, N, M): may query i attend key j.

    Causal is top-left aligned (query i sees keys j <= i) as in PyTorch, Keras
    and JAX; ``query_offset=P`` places query i at position P + i, which is how
    a decoder with P cached tokens sees its keys (bottom-right when P = M - N).
    """
    visible = np.ones((batch, heads, n, m), dtype=bool)
    if mask is not None:
        visible &= mask
    if causal:
        rows = np.arange(n)[:, None] + query_offset
        visible &= np.arange(m)[None, :] <= rows
    return visible


# ----------------------------------------------------------------------- math


def rms_normalise(t: np.ndarray) -> np.ndarray:
    """phi(t) = t / sqrt(mean(t^2 over features) + 1e-6): the generator's input."""
    return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + RMS_EPS)


def side_of(config: DamchaConfig, role: str) -> str | None:
    """Canonical metric side that adapts ``role`` ("q" or "k"), or None (identity)."""
    if config.metric == "none":
        return None
    if config.coupling == "tied":
        return "qk"
    if config.coupling == "query" and role == "k":
        return None
    return role


def _leaves(params: Mapping[str, Any], config: DamchaConfig, side: str) -> dict[str, Any]:
    """The tensors of one metric side, by leaf name (the metric table's names)."""
    return {leaf: params[f"metric.{side}.{leaf}"] for leaf in structure(config.metric).leaf_names}


def generator(params: Mapping[str, np.ndarray], config: DamchaConfig, side: str, tokens: np.ndarray) -> np.ndarray:
    """The data-adaptive coefficients of ``side`` for each token.

    Returns A(t) (B, T, S, S) for metric "heads", u(t) (B, T, r) for "lowrank".
    """
    return structure(config.metric).coefficients(np, rms_normalise(tokens), _leaves(params, config, side))


def apply_map(
    params: Mapping[str, np.ndarray], config: DamchaConfig, side: str, tokens: np.ndarray, y: np.ndarray
) -> np.ndarray:
    """L(t) y for stacked heads y (B, T, S, d), without forming L."""
    coeff = generator(params, config, side, tokens)
    return structure(config.metric).apply(np, coeff, y, _leaves(params, config, side))


def dense_map(params: Mapping[str, np.ndarray], config: DamchaConfig, side: str, tokens: np.ndarray) -> np.ndarray:
    """L(t) as a dense (B, T, S, d, S, d) array: L[h, i, a, j] maps y[a, j] to (Ly)[h, i]."""
    S, d = config.side_heads(side), config.key_dim
    coeff = generator(params, config, side, tokens)
    leaves = _leaves(params, config, side)
    delta = structure(config.metric).dense_delta(np, coeff, leaves, d)
    identity = np.eye(S * d).reshape(S, d, S, d)
    return identity + leaves["gate"][:, None, None, None] * delta


def head_map(params: Mapping[str, np.ndarray], config: DamchaConfig, side: str, tokens: np.ndarray) -> np.ndarray:
    """The per-token factor a user inspects: l(t) = I + diag(g) A(t) (B, T, S, S) for
    metric "heads"; the dense L(t) (B, T, S, d, S, d) for "lowrank"."""
    table = structure(config.metric)
    if table.compact_head_map:
        coeff = generator(params, config, side, tokens)
        return table.head_map(np, coeff, _leaves(params, config, side))
    return dense_map(params, config, side, tokens)


def project(
    params: Mapping[str, np.ndarray], config: DamchaConfig, x: np.ndarray, c: np.ndarray, v: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """q (B, N, H, d), k (B, M, G, d), v (B, M, G, d_v) before any cross-head map;
    the values are projected from ``v`` (default: the context ``c``)."""
    out = []
    for name, tokens in (("query", x), ("key", c), ("value", c if v is None else v)):
        y = np.einsum("bte,ehd->bthd", tokens, params[f"{name}.kernel"])
        if config.use_bias:
            y = y + params[f"{name}.bias"]
        out.append(y)
    return tuple(out)


def softmax_attend(logits: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Masked softmax over the last axis of (B, H, N, M) logits.

    A row with no visible key would be exp(-inf)/0 = NaN; v1 defines its
    probabilities as 0 instead, so that query's attention output is 0.
    """
    logits = np.where(visible, logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True, initial=-np.inf)  # initial: M = 0 (with N = 0) has no key
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(logits - row_max)  # exp(-inf) = 0 at hidden keys
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def attend_values(probs: np.ndarray, visible: np.ndarray, v: np.ndarray) -> np.ndarray:
    """o_i^h = sum over the keys j that query i may see of p_h(i, j) v_j^h, (B, N, H, d_v).

    Hidden keys are outside the sum, not multiplied by p = 0: a non-finite
    value of a hidden key (a padding token full of NaN) would otherwise
    poison every row through 0 * NaN, and an all-masked row's output would not
    be the defined 0. Finite values take the plain product (the same numbers).
    """
    if np.isfinite(v).all():
        return np.einsum("bhnm,bmhd->bnhd", probs, v)
    terms = np.where(visible[..., None], probs[..., None] * np.moveaxis(v, 2, 1)[:, :, None], 0.0)
    return np.moveaxis(terms.sum(axis=3), 1, 2)


def _logits_explicit(
    params: Mapping[str, np.ndarray], config: DamchaConfig, x: np.ndarray, c: np.ndarray, q: np.ndarray, k: np.ndarray
) -> np.ndarray:
    """N x M logits through each head's explicit cross-head metric M_h(i, j)."""
    B, N, H, d = q.shape
    M, G = k.shape[1], k.shape[2]
    sq, sk = side_of(config, "q"), side_of(config, "k")
    Lq = (
        dense_map(params, config, sq, x)
        if sq
        else np.broadcast_to(np.eye(H * d).reshape(H, d, H, d), (B, N, H, d, H, d))
    )
    Lk = (
        dense_map(params, config, sk, c)
        if sk
        else np.broadcast_to(np.eye(G * d).reshape(G, d, G, d), (B, M, G, d, G, d))
    )
    qf, kf = q.reshape(B, N, H * d), k.reshape(B, M, G * d)
    Lq, Lk = Lq.reshape(B, N, H, d, H * d), Lk.reshape(B, M, G, d, G * d)
    logits = np.empty((B, H, N, M))
    for h in range(H):
        g = h // config.group_size
        # M_h(i, j)[a, c] = sum_r Lq(x_i)[h, r, a] Lk(c_j)[g, r, c]: (B, N, M, H*d, G*d)
        metric = np.einsum("bnra,bmrc->bnmac", Lq[:, :, h], Lk[:, :, g])
        logits[:, h] = np.einsum("bna,bnmac,bmc->bnm", qf, metric, kf)
    return config.softmax_scale * logits


def damcha_attention(
    params: Mapping[str, Any],
    config: DamchaConfig,
    query: Any,
    context: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    return_weights: bool = False,
    return_metric: bool = False,
    query_offset: int = 0,
    path: str = "fast",
    value: Any = None,
    rotary: Any = None,
) -> Any:  # the output (B, N, E_o), or a tuple with the weights and/or maps (see Returns)
    """DAMCHA v1 forward pass in float64 (inference: no dropout).

    Args:
        params: canonical parameters (see ``DamchaConfig.param_shapes``).
        config: the layer's ``DamchaConfig``.
        query: x (B, N, E_q), any real float dtype; computed in float64.
        context: c (B, M, E_kv); ``None`` for self-attention (c = x).
        mask: boolean, True = may attend, shape (N, M) or (B, H, N, M) with
            size-1 dims allowed.
        causal: hide key j from query i when j > i + query_offset.
        return_weights: also return the attention probabilities (B, H, N, M).
        return_metric: also return the per-token map factors as a dict
            ``{"q": ..., "k": ...}`` (a role is absent when its map is the
            identity): l(t) (B, T, S, S) for metric "heads", the dense L(t)
            (B, T, S, d, S, d) for "lowrank".
        query_offset: position of query 0 for the causal rule, P when P keys
            were cached before these queries.
        path: "fast" (default) or "explicit" (builds every cross-head metric;
            small inputs only).
        value: the value tokens (B, M, E_v) when they are not the context
            (``config.value_input_dim``); ``None``: the context.
        rotary: a ``damcha_core.Rotary``: rotate q~ and k~ by their positions
            after the maps (spec section 10); fast path only.

    Returns:
        y (B, N, E_o) float64 alone, or a tuple ``(y, weights?, metric?)`` with
        the asked-for extras in that order. A query with no visible key gets
        probabilities 0, so its attention output is 0 and y = output.bias.
    """
    check_config(config)
    p = validate_params(params, config)
    x = _as_float64("query", query)
    c = x if context is None else _as_float64("context", context)
    v_tokens = None if value is None else _as_float64("value", value)
    if mask is not None:
        mask = as_numpy(mask, "mask")
        if mask.dtype != np.bool_:
            raise mask_dtype_error(mask)
    B, N, M = check_shapes(
        config,
        x.shape,
        None if context is None else c.shape,
        None if mask is None else mask.shape,
        value_shape=None if v_tokens is None else v_tokens.shape,
    )
    H = config.num_heads
    causal = check_bool("causal", causal)
    return_weights = check_bool("return_weights", return_weights)
    return_metric = check_bool("return_metric", return_metric)
    query_offset = check_offset("query_offset", query_offset)
    path = check_choice("path", path, PATHS)
    if rotary is not None and (not isinstance(rotary, Rotary) or path != "fast"):
        raise DamchaValueError(
            invalid_argument(
                "rotary", "a damcha_core.Rotary with path='fast', or None", f"rotary={describe(rotary)}, path={path!r}"
            )
        )
    if mask is not None:
        mask = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), (B, H, N, M))

    q, k, v = project(p, config, x, c, v_tokens)
    if path == "fast":
        sq, sk = side_of(config, "q"), side_of(config, "k")
        if sq:
            q = apply_map(p, config, sq, x, q)
        if sk:
            k = apply_map(p, config, sk, c, k)
        if rotary is not None:  # after the maps, as a converted RoPE model rotates q~ and k~
            q = apply_rotary(q, rotary, rotary.positions("q", B, N, query_offset))
            k = apply_rotary(k, rotary, rotary.positions("k", B, M))
        k_h = np.repeat(k, config.group_size, axis=2)  # head h reads kv head h // (H/G)
        logits = config.softmax_scale * np.einsum("bnhd,bmhd->bhnm", q, k_h)
    else:
        logits = _logits_explicit(p, config, x, c, q, k)
    visible = visibility(B, H, N, M, mask, causal, query_offset)
    probs = softmax_attend(logits, visible)
    o = attend_values(probs, visible, np.repeat(v, config.group_size, axis=2))
    y = np.einsum("bnhd,hde->bne", o, p["output.kernel"])
    if config.use_bias:
        y = y + p["output.bias"]
    extras: list[Any] = []
    if return_weights:
        extras.append(probs)
    if return_metric:
        metric = {}
        for role, tokens in (("q", x), ("k", c)):
            side = side_of(config, role)
            if side:
                metric[role] = head_map(p, config, side, tokens)
        extras.append(metric)
    return (y, *extras) if extras else y


def metric_penalty(
    params: Mapping[str, Any], config: DamchaConfig, query: Any, context: Any = None, *, value: Any = None
) -> float:
    """Mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d) (0 over no token).

    Roles are the queries (tokens of ``query``) and, unless coupling is
    "query", the keys (tokens of ``context``); tied coupling adapts both with
    one generator. Returns 0.0 for metric "none". ``value`` (B, M, E_v) is
    checked as in ``damcha_attention`` but does not enter the penalty (the
    values are never mapped).
    """
    check_config(config)
    p = validate_params(params, config)
    x = _as_float64("query", query)
    c = x if context is None else _as_float64("context", context)
    v_tokens = None if value is None else _as_float64("value", value)
    check_shapes(
        config, x.shape, None if context is None else c.shape, value_shape=None if v_tokens is None else v_tokens.shape
    )
    per_role = []
    for role, tokens in (("q", x), ("k", c)):
        side = side_of(config, role)
        if side is not None:
            per_role.append(role_penalty(np, p, config, side, generator(p, config, side, tokens)))
    return float(np.mean(per_role)) if per_role else 0.0


def role_penalty(xp: Any, params: Mapping[str, Any], config: DamchaConfig, side: str, coeff: Any) -> Any:
    """mean_t ||L(t) - I||_F^2 / (S*d) of one adapted role, from its generator
    coefficients ``coeff`` (A(t) (B, T, S, S) or u(t) (B, T, r)).

    ``xp`` is the array namespace (``numpy``, ``jax.numpy``, ``keras.ops``):
    the formula is written once and the ports evaluate it with their own
    arrays; it uses only ``sum``, ``mean``, ``reshape`` and ``einsum``.
    """
    d = config.key_dim
    # Ports may pass only the tensors the formula reads (the gate, and U, V for lowrank).
    leaves = {
        leaf: params[f"metric.{side}.{leaf}"]
        for leaf in structure(config.metric).leaf_names
        if f"metric.{side}.{leaf}" in params
    }
    S = leaves["gate"].shape[0]
    sq = structure(config.metric).penalty_sq(xp, coeff, leaves, d)
    # The mean over the tokens, and 0 over none (an empty batch or sequence), not
    # 0/0 = NaN: an empty batch adds nothing to a loss. The count is summed rather
    # than read from the shape, which a traced Keras tensor may leave unknown.
    return xp.sum(sq) / xp.maximum(xp.sum(xp.ones_like(sq)), 1.0) / (S * d)
