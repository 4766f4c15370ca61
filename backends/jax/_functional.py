"""DAMCHA as pure JAX functions over the canonical flat parameter dict.

Every function here is jit-compatible with the ``DamchaConfig`` static (it is a
frozen, hashable dataclass), differentiable, and vmap-able over extra leading
axes. Shapes use the spec's names: B batch, N query length, M key length, H
query heads, G key/value heads, d key size, d_v value size, E feature size.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from damcha_core import (
    RMS_EPS,
    DamchaConfig,
    DamchaTypeError,
    DamchaValueError,
    check_params,
    check_shapes,
    describe,
    float_dtype_error,
    mask_dtype_error,
    role_penalty,
    side_of,
)

Array = jax.Array
Params = Mapping[str, Any]

# --------------------------------------------------------------------- checks


def _check_config(config: Any) -> DamchaConfig:
    if not isinstance(config, DamchaConfig):
        raise DamchaTypeError(f"`config` must be a DamchaConfig. Received: config={describe(config)}")
    return config


def _check_bool(name: str, value: Any) -> bool:
    # The flags choose the traced program, so they must be Python bools, not arrays.
    if not isinstance(value, (bool, np.bool_)):
        raise DamchaTypeError(f"`{name}` must be a bool. Received: {name}={describe(value)}")
    return bool(value)


def _check_float(name: str, value: Any) -> Array:
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise float_dtype_error(name, value)
    return jnp.asarray(value)


def _check_offset(query_offset: Any) -> Any:
    """A Python int >= 0, or an integer scalar array (a decode cache index)."""
    if isinstance(query_offset, numbers.Integral) and not isinstance(query_offset, bool) and query_offset >= 0:
        return int(query_offset)
    dtype = getattr(query_offset, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and getattr(query_offset, "shape", None) == ():
        if isinstance(query_offset, jax.core.Tracer) or int(query_offset) >= 0:
            return query_offset  # a traced offset cannot be checked (as a traced cache index)
        raise DamchaValueError(
            f"`query_offset` must be an int >= 0. Received: query_offset={int(query_offset)} "
            f"({describe(query_offset)})"
        )
    raise DamchaValueError(f"`query_offset` must be an int >= 0. Received: query_offset={describe(query_offset)}")


def _compute_dtype(dtype: Any, *arrays: Any) -> Any:
    if dtype is not None:
        if not jnp.issubdtype(dtype, jnp.floating):
            raise DamchaTypeError(f"`dtype` must be a floating dtype or None. Received: dtype={describe(dtype)}")
        return jnp.dtype(dtype)
    # Like flax's promote_dtype: the widest of inputs and parameters.
    return jnp.result_type(*[a.dtype for a in arrays])


# ----------------------------------------------------------------------- math


def _acc(dtype: Any) -> Any:
    """Accumulation dtype: at least float32, as mixed-precision matmuls do."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_normalise(t: Array) -> Array:
    """phi(t) = t / sqrt(mean(t^2 over features) + 1e-6), in at least float32."""
    t = t.astype(_acc(t.dtype))
    return t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + RMS_EPS)


def coefficients(metric: str, kernel: Array, bias: Array, tokens: Array) -> Array:
    """phi(tokens) (B, T, E) through a generator: A(t) (B, T, S, S) for metric
    "heads", u(t) (B, T, r) for "lowrank", in at least float32 (16-bit inputs
    keep float32 intermediates until the attention kernel: rounding q and k
    twice would double their error)."""
    if metric not in ("heads", "lowrank"):
        raise DamchaValueError(f"`metric` must be one of ('heads', 'lowrank'). Received: metric={metric!r}")
    phi = rms_normalise(tokens)
    spec = "bte,ehk->bthk" if metric == "heads" else "bte,er->btr"
    return jnp.einsum(spec, phi, kernel, preferred_element_type=phi.dtype) + bias


def generator(params: Params, config: DamchaConfig, side: str, tokens: Array) -> Array:
    """The data-adaptive coefficients of ``side`` for tokens (B, T, E)."""
    p = f"metric.{side}"
    return coefficients(config.metric, params[f"{p}.kernel"], params[f"{p}.bias"], tokens)


def apply_map(
    params: Params, config: DamchaConfig, side: str, y: Array, coeff: Array
) -> Array:
    """L(t) y for stacked heads y (B, T, S, d) given ``generator``'s coefficients."""
    p = f"metric.{side}"
    acc = _acc(y.dtype)
    if config.metric == "heads":
        delta = jnp.einsum("btha,btad->bthd", coeff, y, preferred_element_type=acc)
    else:
        z = jnp.einsum("btad,adr->btr", y, params[f"{p}.v"], preferred_element_type=acc)
        delta = jnp.einsum("hdr,btr->bthd", params[f"{p}.u"], coeff * z, preferred_element_type=acc)
    return y + params[f"{p}.gate"][:, None] * delta


def _project(params: Params, config: DamchaConfig, name: str, tokens: Array) -> Array:
    """tokens (B, T, E) -> heads (B, T, S, d), accumulated in at least float32."""
    y = jnp.einsum("bte,ehd->bthd", tokens, params[f"{name}.kernel"], preferred_element_type=_acc(tokens.dtype))
    if config.use_bias:
        y = y + params[f"{name}.bias"]
    return y


def _qkv(params: Params, config: DamchaConfig, x: Array, c: Array | None, v_tokens: Array | None):
    """q~ (B, N, H, d), k~ (B, M, G, d), v (B, M, G, d_v); c=None is self-attention."""
    ctx = x if c is None else c
    q = _project(params, config, "query", x)
    k = _project(params, config, "key", ctx)
    v = _project(params, config, "value", ctx if v_tokens is None else v_tokens)
    sq, sk = side_of(config, "q"), side_of(config, "k")
    coeff_q = generator(params, config, sq, x) if sq else None
    if sq:
        q = apply_map(params, config, sq, q, coeff_q)
    if sk:
        # Tied self-attention feeds the same tokens to the same generator: reuse it.
        coeff_k = coeff_q if (sk == sq and c is None) else generator(params, config, sk, ctx)
        k = apply_map(params, config, sk, k, coeff_k)
    dt = x.dtype
    return q.astype(dt), k.astype(dt), v.astype(dt)


def _mask4(mask: Array | None) -> Array | None:
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def visibility(mask: Array | None, n: int, m: int, *, is_causal: bool = False, query_offset: Any = 0) -> Array | None:
    """The boolean may-attend mask, broadcastable to (B, H, N, M): the user's
    mask and, with ``is_causal``, query i (at position offset + i) sees keys
    j <= offset + i. ``None`` means every key is visible."""
    if not is_causal:
        return mask
    rows = jnp.arange(n)[:, None] + query_offset
    causal = (jnp.arange(m)[None, :] <= rows)[None, None]
    return causal if mask is None else mask & causal


def _row_visible(mask: Array | None, is_causal: bool, n: int, query_offset: Any) -> Array | None:
    """(b, h, N) bool: does each query row see at least one key? None = always.

    Uses only the mask's own (possibly broadcast) shape, never a full N x M:
    under the causal rule a row sees a key iff the mask's first visible key
    is at or before the row's position.
    """
    if mask is None:
        return None  # with no mask, causal rows always see key 0 (offset >= 0)
    has_key = jnp.any(mask, axis=-1)
    if not is_causal:
        return has_key
    first = jnp.argmax(mask, axis=-1)  # first True; 0 when none (has_key covers it)
    return has_key & (first <= jnp.arange(n) + query_offset)


def softmax_attend(logits: Array, visible: Array) -> Array:
    """Masked softmax in float32 where rows with no visible key get probabilities 0."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # A finite fill (not -inf) keeps every gradient finite in hidden rows.
    filled = jnp.where(visible, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(filled, axis=-1)
    return jnp.where(jnp.any(visible, axis=-1, keepdims=True), probs, 0.0)


def _attend(
    config: DamchaConfig,
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None,
    is_causal: bool,
    query_offset: Any,
    return_weights: bool,
    dropout_rng: Array | None,
) -> tuple[Array, Array | None]:
    """Scaled dot-product attention on transformed heads; o (B, N, H, d_v).

    Without weights or dropout this is ``jax.nn.dot_product_attention`` (no
    N x M tensor is built here; XLA's kernel builds what it needs). float64
    uses the equivalent einsum path, see below.
    """
    N, d = q.shape[1], q.shape[-1]
    M, d_v = k.shape[1], v.shape[-1]
    mask = _mask4(mask)
    static_offset = isinstance(query_offset, int)
    # jax.nn.dot_product_attention always takes its softmax in float32
    # (its XLA path builds the logits too), so float64 gets the einsum path.
    explicit = return_weights or dropout_rng is not None or q.dtype == jnp.float64
    if is_causal and (explicit or not (static_offset and query_offset == 0)):
        visible, fused_causal = visibility(mask, N, M, is_causal=True, query_offset=query_offset), False
    else:
        visible, fused_causal = mask, is_causal
    rows = _row_visible(mask, is_causal, N, query_offset)

    if explicit:
        k_h = jnp.repeat(k, config.group_size, axis=2)  # head h reads kv head h // (H/G)
        v_h = jnp.repeat(v, config.group_size, axis=2)
        logits = config.softmax_scale * jnp.einsum("bnhd,bmhd->bhnm", q, k_h, preferred_element_type=_acc(q.dtype))
        full = jnp.ones((1, 1, 1, 1), bool) if visible is None else visible
        probs = softmax_attend(logits, jnp.broadcast_to(full, logits.shape))
        weights = probs
        if dropout_rng is not None:
            keep = jax.random.bernoulli(dropout_rng, 1.0 - config.dropout, probs.shape)
            probs = jnp.where(keep, probs / (1.0 - config.dropout), 0.0)
        o = jnp.einsum("bhnm,bmhd->bnhd", probs.astype(v.dtype), v_h)
        return o, (weights if return_weights else None)

    # jax.nn.dot_product_attention needs d == d_v; zero-padding the narrower
    # side changes neither the logits (explicit scale) nor the kept channels.
    width = max(d, d_v)
    if d < width:
        pad = ((0, 0), (0, 0), (0, 0), (0, width - d))
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if d_v < width:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, width - d_v)))
    o = jax.nn.dot_product_attention(
        q, k, v, mask=visible, scale=config.softmax_scale, is_causal=fused_causal
    )[..., :d_v]
    if rows is not None:
        # The fused kernel turns a row with no visible key into a uniform
        # average; v1 defines it as 0 (and this also zeroes its gradients).
        keep = jnp.moveaxis(rows, 1, 2)[..., None]  # (b, N, h, 1)
        o = jnp.where(keep, o, jnp.zeros((), o.dtype))
    return o, None


def _output(params: Params, config: DamchaConfig, o: Array) -> Array:
    """o (B, N, H, d_v) -> y (B, N, E_o) in o's dtype."""
    y = jnp.einsum("bnhd,hde->bne", o, params["output.kernel"], preferred_element_type=_acc(o.dtype))
    if config.use_bias:
        y = y + params["output.bias"]
    return y.astype(o.dtype)


def _head_map(params: Params, config: DamchaConfig, side: str, tokens: Array) -> Array:
    coeff = generator(params, config, side, tokens)
    gate = params[f"metric.{side}.gate"]
    if config.metric == "heads":
        return (jnp.eye(coeff.shape[-1], dtype=coeff.dtype) + gate[:, None] * coeff).astype(tokens.dtype)
    S, d = config.side_heads(side), config.key_dim
    delta = jnp.einsum("hir,btr,ajr->bthiaj", params[f"metric.{side}.u"], coeff, params[f"metric.{side}.v"])
    identity = jnp.eye(S * d, dtype=coeff.dtype).reshape(S, d, S, d)
    return (identity + gate[:, None, None, None] * delta).astype(tokens.dtype)


def _prepare(params, config, query, context, value, mask, dtype):
    """Validate everything once and cast to the computation dtype."""
    config = _check_config(config)
    # Values may be tracers: names, shapes and dtypes only, no finiteness check.
    check_params(params, config)
    x = _check_float("query", query)
    c = None if context is None else _check_float("context", context)
    v_tokens = None if value is None else _check_float("value", value)
    if value is not None and context is None:
        raise DamchaValueError(
            "`value` needs `context` (self-attention takes keys and values from the query). "
            f"Received: context=None, value={describe(value)}"
        )
    if mask is not None:
        if getattr(mask, "dtype", None) is None or jnp.dtype(mask.dtype) != jnp.bool_:
            raise mask_dtype_error(mask)
    check_shapes(config, x.shape, None if c is None else c.shape, None if mask is None else mask.shape)
    if v_tokens is not None and v_tokens.shape != c.shape:
        raise DamchaValueError(
            f"`value` must have the shape of `context`. Received: value.shape={tuple(v_tokens.shape)}, "
            f"context.shape={tuple(c.shape)}"
        )
    arrays = [x] + [t for t in (c, v_tokens) if t is not None] + [jnp.asarray(p) for p in params.values()]
    dt = _compute_dtype(dtype, *arrays)
    cast = {n: jnp.asarray(p, dt) for n, p in params.items()}
    x = x.astype(dt)
    c = None if c is None else c.astype(dt)
    v_tokens = None if v_tokens is None else v_tokens.astype(dt)
    return cast, config, x, c, v_tokens, (None if mask is None else jnp.asarray(mask))


# ------------------------------------------------------------------ public API


def damcha_attention(
    params: Params,
    config: DamchaConfig,
    query: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    query_offset: int | Array = 0,
    return_weights: bool = False,
    return_metric: bool = False,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    dtype: Any = None,
):
    """DAMCHA forward pass: cross-head maps, then ``jax.nn.dot_product_attention``.

    Args:
        params: canonical parameters, name -> array (see ``config.param_shapes()``).
        config: the layer's ``damcha_core.DamchaConfig``; pass it as a static
            argument under ``jax.jit``.
        query: x (B, N, E_q).
        context: c (B, M, E_kv); ``None`` for self-attention (c = x).
        value: optional separate value tokens (B, M, E_kv), as
            ``nnx.MultiHeadAttention``'s ``inputs_v``; default ``context``.
        mask: bool, True = may attend, shape (N, M) or (B, H, N, M) with size-1
            dims allowed. 3-D masks are rejected (use ``mask[:, None]``).
        is_causal: hide key j from query i when j > i + query_offset
            (top-left aligned when query_offset = 0).
        query_offset: position of query 0, the number of cached keys before
            these queries; an int or an integer scalar array (a cache index).
        return_weights: also return the probabilities (B, H, N, M); this
            builds the N x M tensor, so use it for inspection only.
        return_metric: also return the per-token map factors
            ``{"q": ..., "k": ...}`` like the reference (l(t) (B, T, S, S) for
            "heads", dense L(t) (B, T, S, d, S, d) for "lowrank").
        dropout_rng: PRNG key for attention-probability dropout with rate
            ``config.dropout``; used only when ``deterministic`` is False.
        deterministic: no dropout when True (inference).
        dtype: computation dtype; default promotes inputs and params.

    Returns:
        y (B, N, E_o), or ``(y, weights?, metric?)`` with the asked-for extras
        in that order. A query with no visible key gets attention output 0, so
        y = output.bias there, with finite gradients.
    """
    is_causal = _check_bool("is_causal", is_causal)
    return_weights = _check_bool("return_weights", return_weights)
    return_metric = _check_bool("return_metric", return_metric)
    deterministic = _check_bool("deterministic", deterministic)
    query_offset = _check_offset(query_offset)
    p, config, x, c, v_tokens, mask = _prepare(params, config, query, context, value, mask, dtype)
    use_dropout = not deterministic and config.dropout > 0.0
    if use_dropout and dropout_rng is None:
        raise DamchaValueError(
            f"`dropout_rng` is required when deterministic=False and config.dropout={config.dropout} > 0. "
            "Received: dropout_rng=None"
        )
    q, k, v = _qkv(p, config, x, c, v_tokens)
    o, weights = _attend(
        config, q, k, v, mask=mask, is_causal=is_causal, query_offset=query_offset,
        return_weights=return_weights, dropout_rng=dropout_rng if use_dropout else None,
    )
    y = _output(p, config, o)
    extras: list[Any] = []
    if return_weights:
        extras.append(weights)
    if return_metric:
        metric = {}
        for role, tokens in (("q", x), ("k", x if c is None else c)):
            side = side_of(config, role)
            if side:
                metric[role] = _head_map(p, config, side, tokens)
        extras.append(metric)
    return (y, *extras) if extras else y


def transformed_qkv(
    params: Params,
    config: DamchaConfig,
    query: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    dtype: Any = None,
) -> tuple[Array, Array, Array]:
    """q~ (B, N, H, d), k~ (B, M, G, d) and v (B, M, G, d_v) after the cross-head maps.

    Plain scaled dot-product attention on these (scale
    ``config.softmax_scale``, kv head h // (H/G) for query head h) followed by
    the output projection is DAMCHA: feed them to any fused kernel, or cache
    k~ and v for decoding.
    """
    p, config, x, c, v_tokens, _ = _prepare(params, config, query, context, value, None, dtype)
    return _qkv(p, config, x, c, v_tokens)


def metric_penalty(params: Params, config: DamchaConfig, query: Array, context: Array | None = None) -> Array:
    """Mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d), as the reference.

    A scalar array (0 for metric "none"), differentiable, for the training loss.
    """
    p, config, x, c, _, _ = _prepare(params, config, query, context, None, None, None)
    c = x if c is None else c
    per_role = []
    for role, tokens in (("q", x), ("k", c)):
        side = side_of(config, role)
        if side is not None:
            per_role.append(role_penalty(jnp, p, config, side, generator(p, config, side, tokens)))
    return jnp.mean(jnp.stack(per_role)) if per_role else jnp.zeros((), x.dtype)
